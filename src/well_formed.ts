/**
 * Well-formed Unicode for ids and keys. A string with a lone UTF-16 surrogate
 * (text cut in the middle of an emoji) has no UTF-8 form: SQLite, Postgres and
 * Redis store it as U+FFFD, so two different ids or keys would become one
 * there (and not in memory): every backend refuses them instead.
 *
 * @module
 */

/** A high surrogate not followed by a low one, or a low one not preceded by a high one. */
const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

type MaybeWellFormed = { isWellFormed?: () => boolean };
const native = typeof (String.prototype as MaybeWellFormed).isWellFormed === "function";

/**
 * Whether `text` is well-formed Unicode (no lone surrogate).
 *
 * @param text the string
 * @returns `true` when every surrogate is part of a pair
 */
export function isWellFormed(text: string): boolean {
  return native ? (text as unknown as MaybeWellFormed).isWellFormed!() : !LONE_SURROGATE.test(text);
}

/**
 * The index of the first lone surrogate in `text`, or `-1`.
 *
 * @param text the string
 * @returns the UTF-16 index of the first lone surrogate, or `-1` when there is none
 */
export function loneSurrogateAt(text: string): number {
  if (isWellFormed(text)) return -1;
  return LONE_SURROGATE.exec(text)?.index ?? -1;
}

/**
 * Refuses a string that is not well-formed Unicode.
 *
 * @param value a string
 * @param what how the error names it, e.g. `Outbox entry key` or `inbox.claim: "id"`
 * @returns `value`
 * @throws {TypeError} naming it, the index of the lone surrogate and the value (escaped)
 */
export function checkWellFormed(value: string, what: string): string {
  if (isWellFormed(value)) return value;
  throw new TypeError(
    `${what} must be well-formed Unicode (a lone surrogate at index ${loneSurrogateAt(value)}), got ${JSON.stringify(value)}`,
  );
}
