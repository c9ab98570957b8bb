/**
 * The provider behind a crash-safe grammY bot: its sends are Bot API calls
 * made through grammY (with the API transformers installed before the
 * plugin), its inbound side is grammY's own update delivery.
 *
 * @module
 */
import { BoundedMap } from "../../src/bounded_map.ts";
import { isRetryableStatus } from "../../src/errors.ts";
import { MediaSeal } from "../../src/media.ts";
import type {
  ErrorClassification,
  InboundSink,
  OutboundContent,
  Provider,
  SendContext,
  SendReceipt,
} from "../../src/provider.ts";
import type { RateLimits } from "../../src/rate_limit.ts";
import { TELEGRAM_RATE_LIMITS } from "../telegram/provider.ts";
import { showValue as show } from "../../src/show.ts";
import { redactError } from "../telegram/redact.ts";
import { isObj, type Obj } from "../telegram/values.ts";
import { type ApiFailure, isJournaledMethod, messageIdsOf } from "./methods.ts";

/** One Bot API call through grammY: resolves with the result, throws grammY's `GrammyError` or `HttpError`. */
export type GrammyCall = (method: string, payload: Obj, signal?: AbortSignal) => Promise<unknown>;

/** How many answers (and errors) of sends are kept for the grammY call that made them. */
const KEPT_ANSWERS = 1_000;

/**
 * Whether a send error may be retried: grammY's `GrammyError` by its
 * `error_code` (429 after `retry_after`, a pause of the chat that spends no
 * attempt; 5xx; other 4xx are permanent), an
 * `HttpError` (the network) is retried, and held as ambiguous when it was a
 * timeout after the request went out.
 *
 * @param error what the call threw
 * @returns the classification
 */
export function classifyGrammyError(error: unknown): ErrorClassification {
  if (!isObj(error)) return { retryable: true };
  if (error.name === "GrammyError" && typeof error.error_code === "number") {
    const code = error.error_code;
    const after = isObj(error.parameters) && typeof error.parameters.retry_after === "number"
      ? error.parameters.retry_after * 1000
      : undefined;
    // The statuses read as the Telegram provider reads them (408, 425, 429 and 5xx retry; a 429 waits without an attempt).
    return {
      retryable: isRetryableStatus(code),
      ...(code === 429 ? { rateLimited: "chat" as const } : {}),
      ...(after !== undefined ? { retryAfterMs: after } : {}),
    };
  }
  if (error.name === "HttpError") {
    // grammY keeps the network's error in `error`; a redacted copy (see `redactError`) in `cause`.
    const cause = isObj(error.error) ? error.error : isObj(error.cause) ? error.cause : undefined;
    const timedOut = /timed out/i.test(String(error.message)) || cause?.name === "TimeoutError";
    return { retryable: true, ...(timedOut ? { maybeDelivered: true } : {}) };
  }
  return { retryable: true };
}

/** The Bot API error answer a grammY `GrammyError` carries, `undefined` for another error (the network). */
function grammyFailureOf(error: unknown): ApiFailure | undefined {
  if (!isObj(error) || error.name !== "GrammyError" || typeof error.error_code !== "number") return undefined;
  return {
    ok: false,
    error_code: error.error_code,
    description: String(error.description ?? error.message),
    ...(isObj(error.parameters) ? { parameters: error.parameters } : {}),
  };
}

/**
 * How the provider reads the errors its calls throw: grammY's by default; a bot library that makes
 * its Bot API calls differently (Telegraf) brings its own.
 */
export interface CallErrors {
  /** The Bot API's error answer an error carries, `undefined` for another error (the network). */
  failureOf(error: unknown): ApiFailure | undefined;
  /** Whether a failed call may be retried. */
  classify(error: unknown): ErrorClassification;
}

const GRAMMY_ERRORS: CallErrors = { failureOf: grammyFailureOf, classify: classifyGrammyError };

/** Options of a {@link GrammyProvider} made for another bot library than grammY. */
export interface GrammyProviderOptions {
  /** The provider's name (default `'grammy'`): also the media seal's. */
  name?: string;
  /** How errors of calls are read (default: grammY's). */
  errors?: CallErrors;
}

/**
 * The provider of a crash-safe grammY bot. Content is a Bot API call:
 * `{ method, ...payload }` (a string is a `sendMessage` of that text).
 */
export class GrammyProvider implements Provider {
  /** `'grammy'` (or the name it was given). */
  readonly name: string;
  /** The bot's id: the part of the token before `:`. */
  readonly connectionId: string;
  /** Seals media references in inbox records, as the Telegram provider does. */
  readonly seal: MediaSeal;
  /**
   * Telegram's limits (`TELEGRAM_RATE_LIMITS`): 30 sends a second overall, 1 a second in a private
   * chat, 20 a minute in a group. Journaled calls wait in the outbox for their slot instead of
   * meeting a 429. Override them with `durability.outbox.rateLimit`.
   */
  readonly rateLimits: RateLimits = TELEGRAM_RATE_LIMITS;
  #sink: InboundSink | undefined;
  readonly #call: GrammyCall;
  readonly #errors: CallErrors;
  readonly #answers = new BoundedMap<string, unknown>(KEPT_ANSWERS);
  readonly #failures = new BoundedMap<string, ApiFailure>(KEPT_ANSWERS);
  readonly #token: string;
  /** How each error `send` threw (a redacted copy) was classified, read from the call's own error. */
  readonly #classified = new WeakMap<object, ErrorClassification>();

  /**
   * @param token the bot's token
   * @param call makes one Bot API call
   * @param options `name` and `errors`, for another bot library than grammY
   * @throws {TypeError} when the token has no numeric bot id before `:`
   */
  constructor(token: string, call: GrammyCall, options: GrammyProviderOptions = {}) {
    this.name = options.name ?? "grammy";
    this.#errors = options.errors ?? GRAMMY_ERRORS;
    // The outbox calls it detached from the provider.
    this.classifyError = this.classifyError.bind(this);
    const match = /^(\d+):/.exec(typeof token === "string" ? token : "");
    if (match === null) throw new TypeError(`The grammY bot's token must look like "<bot id>:<secret>", got ${show(typeof token === "string" ? `${token.slice(0, 12)}…` : token)}`);
    this.connectionId = match[1]!;
    this.#token = token;
    this.seal = new MediaSeal({ provider: this.name, key: `botmesh/telegram-media/v1/${token}` });
    this.#call = call;
  }

  /** The bot, while it is started. */
  get sink(): InboundSink | undefined {
    return this.#sink;
  }

  /**
   * Take the bot's sink; updates come through grammY's `handleUpdate`.
   *
   * @param sink the bot
   */
  start(sink: InboundSink): void {
    this.#sink = sink;
  }

  /** Let go of the sink: updates are refused from now on. */
  stop(): void {
    this.#sink = undefined;
  }

  /**
   * Whether a call is journaled: a message-creating method (see `isJournaledMethod`).
   *
   * @param content the call
   * @returns whether it goes through the outbox
   */
  isJournaled(content: OutboundContent): boolean {
    return typeof content === "string" || (typeof content.method === "string" && isJournaledMethod(content.method));
  }

  /**
   * Make the call. Its answer (or its Bot API error) is kept for the grammY
   * call it was made for, under the outbox key.
   *
   * @param chatId the chat (the content's `chat_id` wins when it has one)
   * @param content `{ method, ...payload }`, or a text
   * @param context the outbox key and the abort signal
   * @returns the message id(s), comma-separated
   * @throws a copy of what the call threw (`GrammyError`, `HttpError`, Telegraf's `TelegramError`,
   *   `FetchError`) without the token: of the same `name`, message, stack and causes redacted (see
   *   `redactError`); the outbox journals its message. It is classified as the call's own error was.
   */
  async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    const { method, ...payload } = typeof content === "string" ? { method: "sendMessage", text: content } : content;
    if (typeof method !== "string" || method === "") {
      throw new TypeError(`grammY content must have a "method" (a Bot API method), got ${show(method)}`);
    }
    // A call keyed by its user, business connection or guest query has no chat_id to fill in.
    if (payload.chat_id === undefined && payload.user_id === undefined && payload.business_connection_id === undefined && payload.guest_query_id === undefined) {
      payload.chat_id = chatId;
    }
    let result: unknown;
    try {
      result = await this.#call(method, payload, context.signal);
    } catch (error) {
      const failure = this.#errors.failureOf(error);
      if (failure !== undefined) this.#failures.set(context.idempotencyKey, failure);
      // Its message may quote the URL, and the URL holds the token (node-fetch's FetchError, a
      // grammY HttpError's cause): what the outbox journals, the events and the logs show is a copy.
      const safe = redactError(error, this.#token);
      try {
        this.#classified.set(safe, this.#classify(error));
      } catch {
        // A classifier that throws is the outbox's to handle: it classifies the copy then.
      }
      throw safe;
    }
    this.#answers.set(context.idempotencyKey, result);
    this.#failures.delete(context.idempotencyKey);
    return { messageId: messageIdsOf(result) };
  }

  /**
   * Say whether a failed call may be retried ({@link classifyGrammyError}, or the `errors` given).
   *
   * @param error what the call threw
   * @returns the classification
   */
  classifyError(error: unknown): ErrorClassification {
    return (isObj(error) || error instanceof Error ? this.#classified.get(error) : undefined) ?? this.#classify(error);
  }

  #classify(error: unknown): ErrorClassification {
    return this.#errors.classify(error);
  }

  /**
   * The answer of the call made for an outbox key by this process, once.
   *
   * @param key the outbox key
   * @returns the answer, `undefined` when this process made no such call (or forgot it)
   */
  takeAnswer(key: string): unknown {
    const answer = this.#answers.get(key);
    this.#answers.delete(key);
    return answer;
  }

  /**
   * Whether the answer of the call made for an outbox key is here (see {@link takeAnswer}).
   *
   * @param key the outbox key
   * @returns whether this process made the call and kept its answer
   */
  hasAnswer(key: string): boolean {
    return this.#answers.has(key);
  }

  /**
   * When the last call made for an outbox key met Telegram's flood limit (429): its `retry_after`.
   *
   * @param key the outbox key
   * @returns the wait in ms (1 s when Telegram named none), `undefined` when the last call was no 429
   */
  floodWaitOf(key: string): number | undefined {
    const failure = this.#failures.get(key);
    if (failure?.error_code !== 429) return undefined;
    const after = failure.parameters?.retry_after;
    return typeof after === "number" && after >= 0 ? after * 1000 : 1000;
  }

  /**
   * The Bot API error of the last call made for an outbox key, once.
   *
   * @param key the outbox key
   * @returns the error answer, when known
   */
  takeFailure(key: string): ApiFailure | undefined {
    const failure = this.#failures.get(key);
    this.#failures.delete(key);
    return failure;
  }
}
