/**
 * Text made safe for a terminal. The command line prints journal data (keys,
 * chat ids, message text, error text) that the bot's users can partly write:
 * a control character in it could clear the operator's screen, move the
 * cursor over rows already printed, retitle the window or reorder text, and
 * an invisible one makes one id read as another. Which characters are
 * written as `\u` escapes is defined once, in `src/controls.ts`.
 *
 * @module
 */
import { escapeControls } from "../controls.ts";

export { escapeControls };

/**
 * A run of this many spaces or more inside a field is shown folded: enough
 * padding wraps the rest of the field to the start of a screen line, where
 * it passes for another field (`200 spaces` then `state: sent`).
 */
const LONG_RUN = 8;
const SPACE_RUN = new RegExp(`\\p{Zs}{${LONG_RUN},}`, "gu");
/** The same, but a run that starts a line (the indentation of pretty JSON) is kept. */
const SPACE_RUN_INSIDE_LINE = new RegExp(`(?<=[^\\p{Zs}\\n])\\p{Zs}{${LONG_RUN},}`, "gu");

/**
 * `text` with each run of 8 or more space characters (any `\p{Zs}`: the
 * no-break and ideographic spaces too) written as `⟨200 spaces⟩`.
 * @param text a field's text
 * @param keepIndentation leave runs that start a line (indented JSON)
 * @returns the text
 */
export function foldSpaces(text: string, keepIndentation = false): string {
  return text.replace(keepIndentation ? SPACE_RUN_INSIDE_LINE : SPACE_RUN, (run) => `⟨${[...run].length} spaces⟩`);
}
