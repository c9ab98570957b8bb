/**
 * What can be wrong in a webhook payload (a field of a message or status
 * entry, an error Meta sent for a change), and reading its fields.
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import { isWellFormed } from "../../src/well_formed.ts";
import { brief, isObject } from "./values.ts";

/**
 * A message or status entry of a webhook POST that lacks a required field or
 * has one of the wrong type, or a message entry of a change whose
 * `metadata.phone_number_id` is missing or malformed; `path` locates the
 * entry in the payload and `field` names the field. A message entry is
 * journaled all the same, as an unreadable message
 * (`InboundMessage.unreadable` is {@link reason}, Meta's object is in
 * `extra.raw`), which the bot dead-letters at once; a status entry is
 * skipped. The rest of the batch is admitted either way.
 */
export class WhatsAppPayloadError extends Error {
  /** Where in the payload, e.g. `entry[0].changes[0].value.messages[1]`. */
  readonly path: string;
  /**
   * The field, e.g. `from` or `text.body`; a field of the change around the
   * entry by its full path, e.g. `entry[0].changes[0].value.metadata.phone_number_id`.
   */
  readonly field: string;
  /** What is wrong, in sentence case and without the path: the `unreadable` reason of the journaled message. */
  readonly reason: string;
  /**
   * The message was not journaled: Meta failed its change (`errors` beside it) and it carries no body
   * for its type, so nothing it holds could be kept or handled.
   */
  readonly skipped: boolean;
  /**
   * Make the error of one payload entry.
   *
   * @param path where in the payload
   * @param field the field
   * @param message what is wrong
   * @param skipped the message was skipped, not journaled (see {@link WhatsAppPayloadError.skipped})
   */
  constructor(path: string, field: string, message: string, skipped = false) {
    super(`WhatsApp webhook ${path}: ${message}`);
    this.name = "WhatsAppPayloadError";
    this.path = path;
    this.field = field;
    this.reason = message.charAt(0).toUpperCase() + message.slice(1);
    this.skipped = skipped;
  }
}

/**
 * An error Meta sent at the change level of a webhook POST (`value.errors`,
 * beside or instead of messages and statuses): a problem of the app, the
 * account or the platform that is not tied to one message, such as 130429
 * (throughput reached) or 131000 (something went wrong). It goes to `onError`;
 * the POST is answered as usual. It names no message id, so no `onStatus`
 * call can carry it: a send it concerns gets its own `failed` status.
 */
export class WhatsAppChangeError extends Error {
  /** Where in the payload, e.g. `entry[0].changes[0].value.errors[0]`. */
  readonly path: string;
  /** Meta's error code (`code`), when it is a number. */
  readonly code: number | undefined;
  /** Meta's error title (`title`, else `message`). */
  readonly title: string | undefined;
  /** `error_data.details`: Meta's explanation. */
  readonly details: string | undefined;
  /** The error object as Meta sent it (cut at `WHATSAPP_MAX_MESSAGE_DEPTH` levels). */
  readonly raw: JsonValue;
  /**
   * Make the error of one change-level error object.
   *
   * @param path where in the payload
   * @param raw the error object as Meta sent it
   */
  constructor(path: string, raw: unknown) {
    const o = isObject(raw) ? raw : {};
    const code = typeof o.code === "number" ? o.code : undefined;
    const title = typeof o.title === "string" ? o.title : typeof o.message === "string" ? o.message : undefined;
    const data = isObject(o.error_data) ? o.error_data : undefined;
    const details = typeof data?.details === "string" ? data.details : undefined;
    const head = code !== undefined ? `error ${code}` : `an error without a numeric "code" (${brief(o.code)})`;
    super(
      `WhatsApp webhook ${path}: Meta reported ${head}${title !== undefined ? ` "${title}"` : ""}` +
        `${details !== undefined && details !== title ? `: ${details}` : ""} (field "errors" of the change, not tied to a message)`,
    );
    this.name = "WhatsAppChangeError";
    this.path = path;
    this.code = code;
    this.title = title;
    this.details = details;
    this.raw = (raw ?? null) as JsonValue;
  }
}

/** A non-empty string of at most `max` characters, well-formed Unicode (ids, chat ids); otherwise an error naming the field. */
export function requireString(m: Record<string, unknown>, field: string, path: string, max = 512): string {
  const value = m[field];
  if (typeof value !== "string" || value === "" || value.length > max) {
    throw new WhatsAppPayloadError(
      path,
      field,
      `field "${field}" must be a non-empty string of at most ${max} characters, got ${value === undefined ? "undefined" : brief(value)}`,
    );
  }
  if (!isWellFormed(value)) {
    throw new WhatsAppPayloadError(path, field, `field "${field}" must be well-formed Unicode (it has a lone surrogate), got ${brief(value)}`);
  }
  return value;
}

/** Like {@link requireString}, but absent, `null` and `""` are `undefined` (Meta omits or empties a withheld phone number). */
export function optionalString(m: Record<string, unknown>, field: string, path: string, max = 512): string | undefined {
  const value = m[field];
  if (value === undefined || value === null || value === "") return undefined;
  return requireString(m, field, path, max);
}

/** The same, for a salvage: whatever is not a usable string is `undefined`. */
export function usableString(value: unknown, max: number): string | undefined {
  return typeof value === "string" && value !== "" && value.length <= max && isWellFormed(value) ? value : undefined;
}

export function parseTimestamp(value: unknown, path: string): number | undefined {
  if (value === undefined) return undefined;
  const n = typeof value === "string" && /^\d{1,12}$/.test(value) ? Number(value) : typeof value === "number" ? value : NaN;
  if (!Number.isFinite(n) || n < 0) {
    throw new WhatsAppPayloadError(path, "timestamp", `field "timestamp" must be seconds since the epoch, got ${brief(value)}`);
  }
  return n * 1000;
}
