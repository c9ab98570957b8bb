/**
 * A journaled error's parts. A handler's error is journaled as
 * `name: message`, then one `Caused by: name: message` line per cause, then
 * the first frames of its stack, each indented (`    at fn (file:1:2)`).
 * The console's record page shows the parts apart, its lists, its error
 * filter and the command line's tables use the message and the causes only.
 *
 * @module
 */

import { errorParts } from "../errors.ts";

/**
 * A journaled error without its stack frames: its message and its
 * `Caused by:` lines, as journaled. The text the console's error filter
 * searches.
 * @param text the error as journaled
 * @returns the text without frame lines
 */
export function errorWithoutStack(text: string): string {
  const { head, causes } = errorParts(text);
  return [...head, ...causes.map((c) => `Caused by: ${c}`)].join("\n");
}

/**
 * A journaled error on one line, for a table cell: the message, then each
 * cause after `; caused by `, without the stack frames.
 * @param text the error as journaled
 * @returns one line
 */
export function errorOneLine(text: string): string {
  const { head, causes } = errorParts(text);
  const flat = (s: string): string => s.replace(/\s*\n\s*/g, " ").trim();
  return [flat(head.join("\n")), ...causes.map((c) => `caused by ${flat(c)}`)].filter((s) => s !== "").join("; ");
}
