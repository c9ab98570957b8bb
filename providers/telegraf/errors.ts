/**
 * Telegraf's errors as the outbox reads them: a `TelegramError` (the Bot
 * API's error answer) by its `error_code`, a `FetchError` (the network) as a
 * retry, held as ambiguous when the request timed out after it went out.
 *
 * @module
 */
import type { ErrorClassification } from "../../src/provider.ts";
import { isObj, type Obj } from "../telegram/values.ts";
import type { ApiFailure } from "../grammy/methods.ts";
import { type CallErrors, classifyGrammyError } from "../grammy/provider.ts";

/**
 * The Bot API's error answer a Telegraf `TelegramError` carries (its `response`).
 *
 * @param error what a Telegraf call threw
 * @returns the answer, `undefined` for another error (the network, an abort)
 */
export function telegrafFailureOf(error: unknown): ApiFailure | undefined {
  if (!isObj(error) || !isObj(error.response) || typeof error.response.error_code !== "number") return undefined;
  const response = error.response;
  return {
    ok: false,
    error_code: response.error_code as number,
    description: String(response.description ?? error.message),
    ...(isObj(response.parameters) ? { parameters: response.parameters } : {}),
  };
}

/**
 * Whether a Telegraf call's error may be retried: a `TelegramError` by its
 * `error_code` as for grammY (429 after `retry_after`, a pause of the chat
 * that spends no attempt; 408, 425 and 5xx retried; other 4xx permanent); a
 * `FetchError` (the network) is retried, and held as ambiguous when it was a
 * timeout after the request went out.
 *
 * @example
 * ```ts
 * import { classifyTelegrafError } from "@botmesh/durable/telegraf";
 *
 * const blocked = { response: { ok: false, error_code: 403, description: "Forbidden: bot was blocked by the user" } };
 * console.log(classifyTelegrafError(blocked)); // { retryable: false }
 * ```
 *
 * @param error what the call threw
 * @returns the classification
 */
export function classifyTelegrafError(error: unknown): ErrorClassification {
  const failure = telegrafFailureOf(error);
  if (failure !== undefined) {
    // The same status rules as grammY's errors.
    return classifyGrammyError({ name: "GrammyError", error_code: failure.error_code, parameters: failure.parameters });
  }
  if (isObj(error) && error.name === "FetchError") {
    const timedOut = error.type === "request-timeout" || /timeout|timed out/i.test(String(error.message));
    return { retryable: true, ...(timedOut ? { maybeDelivered: true } : {}) };
  }
  return { retryable: true };
}

/** How the provider of a durable Telegraf bot reads the errors of its calls. */
export const TELEGRAF_ERRORS: CallErrors = { failureOf: telegrafFailureOf, classify: classifyTelegrafError };

/** What a Telegraf call throws for a Bot API error: `TelegramError`'s constructor. */
export type TelegramErrorClass = new (response: ApiFailure, on?: { method: string; payload: Obj }) => Error;

/**
 * A stand-in for Telegraf's `TelegramError`, of the same shape (`response`,
 * `on`, `code`, `description`, `parameters`), used for a dead send when this
 * process has not yet seen a `TelegramError` to take the class from.
 */
export class TelegrafApiError extends Error {
  /** The Bot API's error answer. */
  readonly response: ApiFailure;
  /** The call: `{ method, payload }`. */
  readonly on: { method: string; payload: Obj } | Record<string, never>;

  /**
   * @param response the Bot API's error answer
   * @param on the call that failed
   */
  constructor(response: ApiFailure, on: { method: string; payload: Obj } | Record<string, never> = {}) {
    super(`${response.error_code}: ${response.description}`);
    this.name = "TelegramError";
    this.response = response;
    this.on = on;
  }

  /** The Bot API's `error_code`. */
  get code(): number {
    return this.response.error_code;
  }

  /** The Bot API's `description`. */
  get description(): string {
    return this.response.description;
  }

  /** The Bot API's `parameters` (`retry_after`, `migrate_to_chat_id`). */
  get parameters(): Obj | undefined {
    return this.response.parameters;
  }
}
