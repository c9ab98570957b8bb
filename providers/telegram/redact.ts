/**
 * The one rule that keeps a bot token out of what the library journals, logs
 * or reports: the Telegram provider's errors and those the grammY and
 * Telegraf plugins let reach the outbox, the inbox or the events.
 *
 * @module
 */
import { isObj } from "./values.ts";

/** What stands in for a token. */
const MARK = "<token>";
/** Any Bot API token in a URL path: `bot<bot id>:<secret>`, the `:` also percent-encoded. */
const ANY_TOKEN = /bot\d+(?::|%3A)[A-Za-z0-9_-]+/gi;
/** How deep a cause chain is copied. */
const MAX_CAUSES = 5;

/**
 * A text without the bot token: the token, its percent-encoded form, and any
 * `bot<digits>:<secret>` (another bot's token in a URL) become `<token>`.
 *
 * @param text a message or a body that may quote the URL
 * @param token the bot's token
 * @returns the text without it
 */
export function redactToken(text: string, token: string): string {
  let out = text;
  if (token !== "") {
    out = out.replaceAll(token, MARK);
    const encoded = encodeURIComponent(token);
    if (encoded !== token) out = out.replaceAll(encoded, MARK).replaceAll(encoded.replaceAll("%3A", "%3a"), MARK);
  }
  return out.replace(ANY_TOKEN, `bot${MARK}`);
}

/** Own properties of an error copied onto its redacted copy: what classifies it (status, code, the Bot API's answer). */
const KEPT = ["error_code", "description", "parameters", "code", "type", "errno", "status", "retryable", "retryAfterMs", "maybeDelivered", "rateLimited"];

/**
 * A copy of a thrown value that cannot carry the token: an `Error` of the
 * same `name`, its message and stack redacted, its cause chain (`cause`, or
 * grammY's `error`) copied the same way, and of its other properties only
 * those that classify it (`error_code`, `description`, `parameters`, `code`,
 * `type`, `status`, …; strings redacted) and Telegraf's `response` (the Bot
 * API's error answer). Nothing else (a URL, a request, a config) is kept.
 *
 * @param error what was thrown
 * @param token the bot's token
 * @returns the copy
 */
export function redactError(error: unknown, token: string): Error {
  return copyOf(error, token, MAX_CAUSES);
}

function copyOf(error: unknown, token: string, depth: number): Error {
  const clean = (v: unknown): unknown => typeof v === "string" ? redactToken(v, token) : v;
  if (!(error instanceof Error)) {
    const text = typeof error === "string" ? error : isObj(error) && typeof error.message === "string" ? error.message : String(error);
    return new Error(redactToken(text, token));
  }
  const copy = new Error(redactToken(String(error.message), token));
  copy.name = redactToken(String(error.name), token);
  copy.stack = typeof error.stack === "string" ? redactToken(error.stack, token) : `${copy.name}: ${copy.message}`;
  const source = error as unknown as Record<string, unknown>;
  const target = copy as unknown as Record<string, unknown>;
  for (const key of KEPT) {
    const value = source[key];
    if (value === undefined || typeof value === "function") continue;
    if (isObj(value)) target[key] = Object.fromEntries(Object.entries(value).map(([k, v]) => [k, clean(v)]));
    else if (typeof value !== "object") target[key] = clean(value);
  }
  if (isObj(source.response)) {
    target.response = Object.fromEntries(Object.entries(source.response).map(([k, v]) => [k, isObj(v) ? { ...v } : clean(v)]));
  }
  const cause = source.cause !== undefined ? source.cause : source.error;
  if (cause !== undefined && cause !== null && cause !== error && depth > 0) {
    target.cause = copyOf(cause, token, depth - 1);
  }
  return copy;
}

/**
 * Whether a thrown value shows the token anywhere the library would journal, log or report it:
 * its name, message or stack, or those of its cause chain (`cause`, or grammY's `error`).
 *
 * @param error what was thrown
 * @param token the bot's token
 * @returns whether it needs {@link redactError}
 */
export function showsToken(error: unknown, token: string): boolean {
  const seen = new Set<unknown>();
  let current: unknown = error;
  while (current !== undefined && current !== null && !seen.has(current) && seen.size <= MAX_CAUSES) {
    seen.add(current);
    const parts = isObj(current) || current instanceof Error
      ? [(current as { name?: unknown }).name, (current as { message?: unknown }).message, (current as { stack?: unknown }).stack]
      : [current];
    for (const part of parts) {
      if (typeof part === "string" && redactToken(part, token) !== part) return true;
    }
    if (!isObj(current) && !(current instanceof Error)) break;
    const c = current as { cause?: unknown; error?: unknown };
    current = c.cause !== undefined ? c.cause : c.error;
  }
  return false;
}

/**
 * Run `work`, and rethrow what it throws without the token: a redacted copy (see {@link redactError})
 * when the error shows the token (see {@link showsToken}), the error itself otherwise (its class and
 * identity kept).
 *
 * @param token the bot's token
 * @param work what may throw an error that quotes the token (a bot's middleware)
 * @returns what `work` returns
 */
export async function withoutToken<T>(token: string, work: () => Promise<T>): Promise<T> {
  try {
    return await work();
  } catch (error) {
    throw showsToken(error, token) ? redactError(error, token) : error;
  }
}
