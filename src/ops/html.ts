/**
 * Small HTML helpers for the operations console: escaping and a tagged
 * template that escapes every interpolated value unless it is marked safe.
 *
 * @module
 */
import { escapeControls, replaceControls } from "../controls.ts";

/**
 * A fragment of HTML that is already safe to emit as is ({@link html} builds
 * them; interpolating one into {@link html} does not escape it again).
 *
 * @example
 * ```ts
 * const bold = new SafeHtml("<b>trusted markup</b>");
 * html`<p>${bold}</p>`.html; // "<p><b>trusted markup</b></p>"
 * ```
 */
export class SafeHtml {
  /** The HTML text. */
  readonly html: string;
  /**
   * @param html HTML text that is known to be safe (built by {@link html} or escaped)
   * @throws never
   */
  constructor(html: string) {
    this.html = html;
  }
  /**
   * @returns the HTML text
   * @throws never
   */
  toString(): string {
    return this.html;
  }
}

const ESCAPES: Record<string, string> = {
  "&": "&amp;",
  "<": "&lt;",
  ">": "&gt;",
  '"': "&quot;",
  "'": "&#39;",
  "`": "&#96;",
};

/**
 * A character reference for each UTF-16 unit of `c`; a C1 control stays as
 * it is, since HTML reads `&#x80;` to `&#x9f;` as windows-1252 characters.
 */
const reference = (c: string): string => {
  if (c >= "\u0080" && c <= "\u009f") return c;
  let out = "";
  for (let i = 0; i < c.length; i++) out += `&#x${c.charCodeAt(i).toString(16)};`;
  return out;
};

/**
 * Escape text for an HTML text node or a quoted attribute value. Control,
 * format (bidi, zero-width) and separator characters would make one id read
 * as another: in a text node each is shown as its `\u` escape, as the
 * command line shows it; in an attribute (a link, a form field) each is a
 * character reference, so that the value stays the record's real one.
 *
 * @param text any value; `null`/`undefined` become the empty string
 * @param attribute whether the text is an attribute value
 * @returns the escaped text (`&`, `<`, `>`, `"`, `'` and `` ` `` replaced by entities)
 * @throws never
 * @example
 * ```ts
 * escapeHtml(`<script>alert("x")</script>`); // "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"
 * escapeHtml("in-\u202egnp.exe"); // "in-\\u202egnp.exe"
 * ```
 */
export function escapeHtml(text: unknown, attribute = false): string {
  if (text === null || text === undefined) return "";
  const shown = attribute ? String(text) : escapeControls(String(text), true);
  const escaped = shown.replace(/[&<>"'`]/g, (c) => ESCAPES[c]!);
  return attribute ? replaceControls(escaped, false, reference) : escaped;
}

/** What {@link html} accepts as an interpolated value. */
export type HtmlValue = SafeHtml | string | number | boolean | null | undefined | readonly HtmlValue[];

function render(value: HtmlValue, attribute: boolean): string {
  if (value instanceof SafeHtml) return value.html;
  if (Array.isArray(value)) return value.map((v) => render(v, attribute)).join("");
  if (value === null || value === undefined || value === false) return "";
  return escapeHtml(value, attribute);
}

/** Whether HTML ending with `out` is inside a tag (a value there is an attribute's): interpolated values hold no `<` or `>`. */
function insideTag(out: string): boolean {
  return out.lastIndexOf("<") > out.lastIndexOf(">");
}

/**
 * A tagged template that builds HTML: interpolated values are escaped (as
 * text, or as an attribute value inside a tag: see {@link escapeHtml}), except
 * {@link SafeHtml} fragments (nested `html` results); arrays are joined;
 * `null`, `undefined` and `false` render nothing.
 *
 * @param strings the literal parts
 * @param values the interpolated values
 * @returns the safe fragment
 * @throws never
 * @example
 * ```ts
 * const name = "<b>x</b>";
 * html`<p>${name}</p>`.html; // "<p>&lt;b&gt;x&lt;/b&gt;</p>"
 * ```
 */
export function html(strings: TemplateStringsArray, ...values: HtmlValue[]): SafeHtml {
  let out = strings[0]!;
  for (let i = 0; i < values.length; i++) out += render(values[i]!, insideTag(out)) + strings[i + 1]!;
  return new SafeHtml(out);
}
