/**
 * Baileys' send errors as the outbox reads them.
 *
 * `sock.sendMessage` ends in `relayMessage`, whose last step is
 * `await sendNode(stanza)`: every query before it (devices, sessions, group
 * metadata, the media upload) happens before the message leaves. Baileys
 * throws `@hapi/boom` errors carrying `output.statusCode` (its
 * `DisconnectReason`s: 428 connection closed, 408 connection lost or a query
 * timed out, 440 replaced, 401 logged out, 500 bad session, 515 restart
 * required).
 *
 * @module
 */
import type { ErrorClassification } from "../../src/provider.ts";
import { isObj } from "./messages.ts";

/** The status code of a Boom error (`error.output.statusCode`), or of an error with a numeric `status`/`statusCode`. */
export function baileysStatusOf(error: unknown): number | undefined {
  if (!isObj(error) && !(error instanceof Error)) return undefined;
  const e = error as { output?: unknown; status?: unknown; statusCode?: unknown; data?: unknown };
  if (isObj(e.output) && typeof e.output.statusCode === "number") return e.output.statusCode;
  if (typeof e.statusCode === "number") return e.statusCode;
  if (typeof e.status === "number") return e.status;
  // an AxiosError (a media download) carries the HTTP answer in `response`
  const response = (error as { response?: unknown }).response;
  if (isObj(response) && typeof response.status === "number") return response.status;
  return undefined;
}

/**
 * Whether a failed `sendMessage` may be retried:
 *
 * - an error the provider marks `maybeDelivered` (its own timeout: `sendMessage` did not return
 *   within `sendTimeoutMs`, so the stanza may have left) is held as ambiguous;
 * - Boom 428 (Connection Closed: the socket was not open, nothing was written) waits a second
 *   without spending an attempt (`rateLimited: "chat"`), so a long reconnect costs no reply its retries;
 * - 408 (a query before the relay timed out, or the connection was lost), 440, 500, 503, 515 and
 *   other 5xx are retried: nothing left before the relay's last step;
 * - 401 (logged out) and 403 are retried after a minute: the account must be linked again;
 * - 429 waits without spending an attempt;
 * - any other 4xx (400 "Invalid media type", 404, 406) is permanent;
 * - anything else (a `TypeError` from a content Baileys cannot build) is retried.
 *
 * @param error what `send` threw
 * @returns the classification
 */
export function classifyBaileysError(error: unknown): ErrorClassification {
  if (isObj(error) || error instanceof Error) {
    const e = error as { maybeDelivered?: unknown; retryable?: unknown; retryAfterMs?: unknown; rateLimited?: unknown };
    if (e.maybeDelivered === true) return { retryable: true, maybeDelivered: true };
    if (typeof e.retryable === "boolean" && baileysStatusOf(error) === undefined) {
      return { retryable: e.retryable, ...(typeof e.retryAfterMs === "number" ? { retryAfterMs: e.retryAfterMs } : {}) };
    }
  }
  const status = baileysStatusOf(error);
  if (status === undefined) return { retryable: true };
  if (status === 429) return { retryable: true, rateLimited: "chat" };
  if (status === 401 || status === 403) return { retryable: true, retryAfterMs: 60_000 };
  if (status === 428) return { retryable: true, rateLimited: "chat", retryAfterMs: 1_000 };
  if (status === 408 || status === 425 || status === 440 || status >= 500) return { retryable: true };
  if (status >= 400) return { retryable: false };
  return { retryable: true };
}
