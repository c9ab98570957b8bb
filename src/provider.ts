/**
 * The provider interface: what a channel adapter gives the bot (docs/providers.md).
 *
 * @module
 */
import type { JsonValue } from "./contract.ts";
import { isRetryableStatus, ProviderError } from "./errors.ts";
import type { LoadedMedia, MediaLoadContext, StoredMediaRef } from "./media.ts";
import type { RateLimits } from "./rate_limit.ts";

/** The type of an inbound message; matchers such as `IMAGE` test it. */
export type MessageType = "text" | "image" | "audio" | "video" | "document" | "interaction" | (string & {});

/** A button press, list choice or similar. */
export interface Interaction {
  /** What was chosen (a button id, a list row id). */
  id: string;
  /** Extra data the channel sent with it. */
  value?: JsonValue;
}

/** An inbound message or interaction as the provider delivers it. Everything must be JSON. */
export interface InboundMessage {
  /** The channel's message id: stable across redeliveries. */
  id: string;
  chatId: string;
  type: MessageType;
  text?: string;
  /** A serialized media reference (a `MediaSeal` envelope): whatever the provider needs to load it again. */
  media?: JsonValue;
  interaction?: Interaction;
  /** The sender, when the chat is a group. */
  from?: string;
  /** When the channel says it was sent (ms since epoch). */
  timestamp?: number;
  /** Anything else the provider wants journaled. */
  extra?: JsonValue;
  /**
   * Set by a provider for a user message it could not parse (the reason, in
   * sentence case). The bot journals it like any message but runs no handler:
   * the record goes straight to the inbound dead-letter queue with this reason,
   * where an operator sees it with what the channel sent (console, CLI). The provider
   * keeps the raw payload in `extra.raw`, and acknowledges it to the channel
   * only once it is admitted, so nothing a user sent vanishes silently.
   */
  unreadable?: string;
}

/** Outbound content: text, or a JSON object of the provider's shape; binary as `Uint8Array`. */
export type OutboundContent = string | { [key: string]: unknown };

/** What the bot tells the provider about one send. */
export interface SendContext {
  /** The outbox key: a provider that supports idempotent sends can pass it on. */
  idempotencyKey: string;
  /** Which attempt this is (1 for the first). */
  attempt: number;
  /** Aborted when the bot halts. */
  signal: AbortSignal;
}

/** What the provider returns from a send. */
export interface SendReceipt {
  /** The channel's id of the sent message. */
  messageId: string;
}

/**
 * What a channel says afterwards about a send whose outcome was lost (see
 * {@link Provider.confirm}).
 */
export type SendConfirmation =
  /** It reached the channel: the entry is recorded as `sent` with this message id. */
  | { delivered: true; messageId: string }
  /** It certainly did not reach the channel: the entry is queued and sent again. */
  | { delivered: false };

/** The send a provider is asked about in {@link Provider.confirm}. */
export interface SendInQuestion {
  /** The outbox idempotency key (what `SendContext.idempotencyKey` carried). */
  idempotencyKey: string;
  chatId: string;
  content: OutboundContent;
  /** Aborted when the bot halts. */
  signal: AbortSignal;
}

/** Whether a failed send may be retried. */
export interface ErrorClassification {
  retryable: boolean;
  retryAfterMs?: number;
  /**
   * The call may have reached the channel (a timeout after the request was sent): the send is
   * ambiguous, held as `unknown` and reported instead of retried (`onAmbiguous: 'resend'` retries it).
   */
  maybeDelivered?: boolean;
  /**
   * The channel refused the call for its rate limit (a 429): nothing was sent. The send waits
   * `retryAfterMs` (1 s when absent) without spending an attempt; `chat` holds back only its chat,
   * `global` every chat of the bot (through the outbox's rate limiter).
   */
  rateLimited?: "chat" | "global";
}

/** How an admitted (or refused) inbound message was taken. */
export type AdmitResult =
  /** Journaled; will be processed. */
  | { status: "admitted"; id: string }
  /** A redelivery of a known id: dropped. Acknowledge it. */
  | { status: "duplicate"; id: string }
  /** Not journaled and not processed: do not acknowledge, let the channel redeliver. */
  | { status: "rejected"; id: string; error: Error }
  /** `failOpen`: the journal failed but the message is processed without it. */
  | { status: "unjournaled"; id: string; error: Error };

/** The bot as a provider sees it: where inbound messages go. */
export interface InboundSink {
  /**
   * Hand one inbound message to the bot. Resolves once it is admitted or
   * refused; acknowledge it to the channel only when the status is not
   * `'rejected'`.
   */
  receive(message: InboundMessage): Promise<AdmitResult>;
  /**
   * Report a problem that no caller sees (a malformed update, a failed poll,
   * a failed acknowledgement): the bot emits it as an `error` event.
   */
  reportError?(error: Error): void;
  /**
   * The channel said a send reached it (a delivery status carrying the outbox
   * key, as WhatsApp's `biz_opaque_callback_data` does). An `unknown` entry
   * with this key is resolved to `sent` with `messageId` and counted as
   * `outboxResolved`; for a send still under way or waiting for a retry the
   * word is remembered by this process (up to 10,000 keys), so that its retry
   * makes no second call and an ambiguity found later resolves at once.
   * @returns whether an `unknown` entry was resolved now
   */
  confirmSent?(idempotencyKey: string, messageId: string): Promise<boolean>;
}

/**
 * A channel adapter.
 *
 * @example
 * ```ts
 * import type { Provider } from "@botmesh/durable";
 * const console: Provider = {
 *   name: "console",
 *   start() {},
 *   async send(chatId, content) {
 *     globalThis.console.log(chatId, content);
 *     return { messageId: crypto.randomUUID() };
 *   },
 * };
 * ```
 */
export interface Provider {
  /** A short stable name; journaled with every inbound record. */
  readonly name: string;
  /** The account this provider is connected as (a phone number id, a bot token id); part of the default instanceId. */
  readonly connectionId?: string;
  /**
   * The channel's rate limits, the defaults of the outbox's limiter (see
   * docs/rate-limits.md): sends wait in the outbox instead of failing.
   * `durability.outbox.rateLimit` overrides them.
   */
  readonly rateLimits?: RateLimits;
  /** Start delivering inbound messages to `sink`. */
  start(sink: InboundSink): void | Promise<void>;
  /** Stop delivering inbound messages. */
  stop?(): void | Promise<void>;
  /** Send content to a chat; resolve with the channel's message id. */
  send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt>;
  /**
   * Whether a send of `content` goes through the outbox (default: every send does). Answer
   * `false` only for calls that are idempotent (an edit) or transient (a typing indicator, a
   * draft): the bot hands them straight to `send`, once, without an outbox entry, a retry or a
   * key number, and their error goes to the caller. A call that would fail when repeated (a
   * deletion) should stay journaled: a handler run again after a crash is then answered from
   * the outbox.
   */
  isJournaled?(content: OutboundContent): boolean;
  /**
   * Ask the channel whether an ambiguous send (a provider call whose outcome
   * was lost: a crash or a timeout during it) reached it. Called once the send
   * became `unknown` (and was reported), within 10 s. Return `null` when the
   * channel cannot tell; throw only for a failed lookup (reported, and the
   * send stays `unknown`). `{ delivered: true, messageId }` records it as
   * sent. Answer `{ delivered: false }` only when the send certainly did not
   * arrive and cannot arrive later: it counts as a failed attempt and is sent
   * again after its backoff (dead once its retries are spent).
   */
  confirm?(send: SendInQuestion): Promise<SendConfirmation | null>;
  /** Say whether an error thrown by `send` may be retried; the default reads `ProviderError` and HTTP statuses. */
  classifyError?(error: unknown): ErrorClassification;
  /**
   * Load an inbound message's media again from the channel (see `loadMediaOf`).
   * `media` is the journaled reference, already checked for version and
   * provider; the provider checks its MAC (`MediaSeal.open`) and throws a
   * `MediaUnavailableError` when the media cannot be had, any other error
   * when a retry may help.
   */
  loadMedia?(media: StoredMediaRef, context: MediaLoadContext): Promise<LoadedMedia>;
}

/**
 * The default error classification: a `ProviderError` says it itself; an
 * error with a numeric `status` is retryable for 408/425/429/5xx (a 429 is
 * `rateLimited: 'chat'`: it waits without spending an attempt); a network
 * `TypeError` (what `fetch` throws) and anything unknown is retryable. A
 * timeout (an error named `TimeoutError`, as `AbortSignal.timeout` raises) or an
 * error with `maybeDelivered: true` may have reached the channel: the engine
 * holds such a send as ambiguous instead of retrying it.
 *
 * @param error what `send` threw
 * @returns whether to retry, and not before when
 */
export function classifyProviderError(error: unknown): ErrorClassification {
  if (error instanceof ProviderError) {
    const classified: ErrorClassification = { retryable: error.retryable, retryAfterMs: error.retryAfterMs };
    if (error.maybeDelivered) classified.maybeDelivered = true;
    if (error.rateLimited !== undefined) classified.rateLimited = error.rateLimited;
    return classified;
  }
  if (typeof error === "object" && error !== null) {
    const { status, retryable, retryAfterMs, maybeDelivered, name } = error as Record<string, unknown>;
    const after = typeof retryAfterMs === "number" && retryAfterMs >= 0 ? retryAfterMs : undefined;
    // A timeout (AbortSignal.timeout's TimeoutError) may have been delivered before it fired.
    const maybe = maybeDelivered === true || name === "TimeoutError" ? { maybeDelivered: true } : {};
    const scope = (error as { rateLimited?: unknown }).rateLimited;
    const limited: Pick<ErrorClassification, "rateLimited"> = scope === "chat" || scope === "global"
      ? { rateLimited: scope }
      : status === 429
      ? { rateLimited: "chat" }
      : {};
    if (typeof retryable === "boolean") return { retryable, retryAfterMs: after, ...maybe, ...limited };
    if (typeof status === "number") return { retryable: isRetryableStatus(status), retryAfterMs: after, ...maybe, ...limited };
    return { retryable: true, ...maybe };
  }
  return { retryable: true };
}
