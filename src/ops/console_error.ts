/**
 * A journaled error's parts. A handler's error is journaled as
 * `name: message`, then one `Caused by: name: message` line per cause, then
 * the first frames of its stack, each indented (`    at fn (file:1:2)`).
 * The console's record page shows the parts apart, its lists, its error
 * filter and the command line's tables use the message and the causes only.
 *
 * @module
 */

/** A journaled error split in its parts. */
export interface ErrorParts {
  /** The message (its lines). */
  head: string[];
  /** Each cause, without its `Caused by:` (a cause's continuation lines appended to it). */
  causes: string[];
  /** The stack frames, trimmed. */
  stack: string[];
}

const CAUSED_BY = /^\s*caused by:?\s*/i;
/** An indented stack frame: V8's `at fn (file:1:2)`, or `fn@file:1:2`. */
const FRAME = /^\s+(at\s|[^\s:]*@)/;

/**
 * Splits a journaled error into its message, its causes and its stack frames.
 * @param text the error as journaled
 * @returns its parts
 */
export function errorParts(text: string): ErrorParts {
  const parts: ErrorParts = { head: [], causes: [], stack: [] };
  for (const line of text.split("\n")) {
    if (CAUSED_BY.test(line)) parts.causes.push(line.replace(CAUSED_BY, ""));
    else if (FRAME.test(line)) parts.stack.push(line.trim());
    else if (parts.causes.length > 0) parts.causes[parts.causes.length - 1] += `\n${line}`;
    else parts.head.push(line);
  }
  return parts;
}

/**
 * A journaled error without its stack frames: its message and its
 * `Caused by:` lines, as journaled. The text the console's error filter
 * searches.
 * @param text the error as journaled
 * @returns the text without frame lines
 */
export function errorWithoutStack(text: string): string {
  return text.split("\n").filter((line) => !FRAME.test(line)).join("\n");
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
