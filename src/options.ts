/**
 * The one check every options object goes through: a key the reader does not
 * know is a typo, and silently ignoring it would hide a setting the user
 * believes is in force.
 *
 * @module
 */

/**
 * Throws when `options` has a key that is not in `known`.
 *
 * @param options the options object, already known to be a plain object
 * @param known the option names the reader accepts
 * @param what how the message names an option, e.g. `"SQLite option"` (default `"option"`)
 * @param within for a nested object, the name of the option that holds it (e.g. `"inbox"`)
 * @throws {TypeError} naming the unknown key and listing the known ones
 *
 * @example
 * ```ts
 * import { checkKnownOptions } from "./options.ts";
 * checkKnownOptions({ file: "bot.db" }, ["file", "clock"], "SQLite option"); // passes
 * ```
 */
export function checkKnownOptions(
  options: object,
  known: readonly string[],
  what: string = "option",
  within?: string,
): void {
  for (const key of Object.keys(options)) {
    if (known.includes(key)) continue;
    const list = known.map((k) => `"${k}"`).join(", ");
    throw new TypeError(
      within === undefined
        ? `Unknown ${what} ${JSON.stringify(key)}; known options are ${list}`
        : `Unknown ${what} ${JSON.stringify(`${within}.${key}`)}; known options of "${within}" are ${list}`,
    );
  }
}
