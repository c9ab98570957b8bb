/**
 * Small HTML helpers for the operations console: escaping and a tagged
 * template that escapes every interpolated value unless it is marked safe.
 *
 * @module
 */

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
 * Escape text for an HTML text node or a quoted attribute value.
 *
 * @param text any value; `null`/`undefined` become the empty string
 * @returns the escaped text (`&`, `<`, `>`, `"`, `'` and `` ` `` replaced by entities)
 * @throws never
 * @example
 * ```ts
 * escapeHtml(`<script>alert("x")</script>`); // "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"
 * ```
 */
export function escapeHtml(text: unknown): string {
  if (text === null || text === undefined) return "";
  return String(text).replace(/[&<>"'`]/g, (c) => ESCAPES[c]!);
}

/** What {@link html} accepts as an interpolated value. */
export type HtmlValue = SafeHtml | string | number | boolean | null | undefined | readonly HtmlValue[];

function render(value: HtmlValue): string {
  if (value instanceof SafeHtml) return value.html;
  if (Array.isArray(value)) return value.map(render).join("");
  if (value === null || value === undefined || value === false) return "";
  return escapeHtml(value);
}

/**
 * A tagged template that builds HTML: interpolated values are escaped, except
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
  for (let i = 0; i < values.length; i++) out += render(values[i]!) + strings[i + 1]!;
  return new SafeHtml(out);
}
