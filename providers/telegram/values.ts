/**
 * Checks on values from outside: JSON objects from Telegram, and whatever a
 * caller threw.
 *
 * @module
 */

/** A JSON object as read from Telegram. */
export type Obj = Record<string, unknown>;

/** Whether a value is a plain object (not `null`, not an array). */
export function isObj(v: unknown): v is Obj {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

/** A thrown value as an `Error`. */
export function asError(error: unknown): Error {
  return error instanceof Error ? error : new Error(String(error));
}
