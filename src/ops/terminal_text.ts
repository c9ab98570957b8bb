/**
 * Text made safe for a terminal. The command line prints journal data (keys,
 * chat ids, message text, error text) that the bot's users can partly write:
 * a control character in it could clear the operator's screen, move the
 * cursor over rows already printed, retitle the window or reorder text.
 * Each such character is written as a `\u` escape, which is also valid
 * inside a JSON string.
 *
 * @module
 */

/** C0 controls but the newline, DEL, C1 controls, and the bidirectional overrides and isolates. */
const CONTROL_BUT_NEWLINE = /[\u0000-\u0009\u000b-\u001f\u007f-\u009f\u202a-\u202e\u2066-\u2069]/g;
/** The same and the newline: for one field. */
const CONTROL = /[\u0000-\u001f\u007f-\u009f\u202a-\u202e\u2066-\u2069]/g;

/**
 * `text` with each terminal control character written as `\uXXXX`.
 * @param text any text
 * @param keepNewlines keep `\n` (for whole output, whose lines they end); a field escapes them too
 * @returns the text, with no control character but `\n` when `keepNewlines`
 */
export function escapeControls(text: string, keepNewlines = false): string {
  return text.replace(keepNewlines ? CONTROL_BUT_NEWLINE : CONTROL, (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, "0")}`);
}
