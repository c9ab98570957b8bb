/**
 * Characters that journal data and error text may carry but no log line,
 * terminal or page shows as themselves. The command line, the console and
 * the library's own default logs show each of them as a `\u` escape; the
 * data they show stays as it is.
 *
 * @module
 */

/**
 * C0 controls, DEL, C1 controls (`\p{Cc}`), Unicode format characters
 * (`\p{Cf}`: the bidi marks, overrides and isolates, zero-width characters,
 * the soft hyphen, the byte order mark, tag characters) and the line and
 * paragraph separators. A terminal acts on the controls (clears the screen,
 * moves the cursor, retitles the window); the others are invisible or
 * reorder the text around them, so that one id reads as another.
 */
const SHOWN_ESCAPED = /[\p{Cc}\p{Cf}\u2028\u2029]/gu;
/** The same but the newline. */
const SHOWN_ESCAPED_BUT_NEWLINE = /[\u0000-\u0009\u000b-\u001f\u007f-\u009f\p{Cf}\u2028\u2029]/gu;

/**
 * `text` with each character {@link escapeControls} escapes replaced by `replace(character)`.
 * @param text any text
 * @param keepNewlines leave `\n` as it is
 * @param replace what to write for one such character (a whole code point: astral format characters are two units)
 * @returns the text
 */
export function replaceControls(text: string, keepNewlines: boolean, replace: (character: string) => string): string {
  return text.replace(keepNewlines ? SHOWN_ESCAPED_BUT_NEWLINE : SHOWN_ESCAPED, replace);
}

/**
 * `text` with each control, format (bidi, zero-width) and line or paragraph
 * separator character written as `\uXXXX` (an astral one as its two UTF-16
 * units), which is also valid inside a JSON string.
 * @param text any text
 * @param keepNewlines keep `\n` (for whole output, whose lines they end); a field escapes them too
 * @returns the text, with none of those characters but `\n` when `keepNewlines`
 * @example
 * ```ts
 * escapeControls("42\u200b"); // "42\\u200b"
 * ```
 */
export function escapeControls(text: string, keepNewlines = false): string {
  return replaceControls(text, keepNewlines, (c) => {
    let out = "";
    for (let i = 0; i < c.length; i++) out += `\\u${c.charCodeAt(i).toString(16).padStart(4, "0")}`;
    return out;
  });
}
