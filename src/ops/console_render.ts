/**
 * Rendering pieces of the operations console: the style sheet, the security
 * headers, times (exact and relative), previews of messages, errors with
 * what the journal keeps of them, and the error type of the handler.
 *
 * @module
 */
import type { JsonValue } from "../contract.ts";
import { cutDeepNesting, MAX_STORED_DEPTH } from "../content.ts";
import { errorParts } from "../errors.ts";
import { html, SafeHtml } from "./html.ts";

/** Headers on every console response: no scripts, no framing, no caching, no referrer. */
export const SECURITY_HEADERS: Record<string, string> = {
  "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'",
  "x-frame-options": "DENY",
  "referrer-policy": "no-referrer",
  "cache-control": "no-store",
  "x-content-type-options": "nosniff",
};

const MAX_SHOWN_JSON = 256 * 1024;

/**
 * An integer option of the console, `fallback` when not given.
 * @throws {RangeError} naming the option when it is not an integer from `min` to `max`
 */
export function integerOption(value: number | undefined, name: string, fallback: number, min: number, max: number): number {
  const n = value ?? fallback;
  if (!Number.isInteger(n) || n < min || n > max) {
    throw new RangeError(`Option "${name}" must be an integer from ${min} to ${max}, got ${String(n)}`);
  }
  return n;
}

/**
 * Whether `value` is a non-null object or function.
 * @param value anything
 * @returns whether it can have properties
 */
export function isObject(value: unknown): value is Record<string, unknown> {
  return (typeof value === "object" || typeof value === "function") && value !== null;
}

/** A request the console answers with an error page (the message is shown, escaped). */
export class HttpError extends Error {
  readonly status: number;
  readonly headers: Record<string, string>;
  constructor(status: number, message: string, headers: Record<string, string> = {}) {
    super(message);
    this.status = status;
    this.headers = headers;
  }
}

/**
 * An HTML response with the security headers.
 * @param status the status
 * @param body the HTML, or `null`
 * @param headers more headers
 * @returns the response
 */
export function respond(status: number, body: string | null, headers: Record<string, string> = {}): Response {
  const h = new Headers({ "content-type": "text/html; charset=utf-8", ...SECURITY_HEADERS, ...headers });
  return new Response(body, { status, headers: h });
}

/** Headings of the error pages. */
export const STATUS_TEXT: Record<number, string> = {
  400: "Bad request",
  401: "Authentication required",
  403: "Forbidden",
  404: "Not found",
  405: "Method not allowed",
  408: "Request timeout",
  409: "Conflict",
  413: "Request too large",
  415: "Unsupported media type",
  429: "Too many requests",
  500: "Internal error",
  503: "Backend unavailable",
};

/** The style sheet: readable from 320 px up (lists become cards below 720 px). */
export const STYLE = `
*{box-sizing:border-box}
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 20px;display:flex;gap:8px 20px;align-items:center;flex-wrap:wrap}
header a{color:#cfe0ff;text-decoration:none}header strong{font-size:16px}header .who{margin-left:auto;color:#aab}
main{padding:16px 20px;max-width:1280px}
h1{font-size:20px;margin:4px 0 12px;overflow-wrap:anywhere}h2{font-size:16px;margin:18px 0 8px}
table{border-collapse:collapse;background:#fff}
th,td{border:1px solid #dde1e8;padding:5px 9px;text-align:left;vertical-align:top;overflow-wrap:anywhere}
th{background:#eef1f5;font-weight:600}
table.list th{white-space:nowrap;overflow-wrap:normal}
table.list{width:100%}
table.record{width:100%;max-width:900px}table.record th{width:200px}
td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#fff;border:1px solid #dde1e8;padding:10px;overflow:auto;max-height:480px;white-space:pre-wrap;overflow-wrap:anywhere;margin:6px 0}
.state{display:inline-block;padding:0 6px;border-radius:3px;background:#e4e8ee;font-size:12px;white-space:nowrap}
.state-dead,.state-unknown{background:#ffd9d6;color:#8a1308}.state-failed{background:#ffefc7;color:#7a5200}
.state-done,.state-sent{background:#d9f2df;color:#14622b}
.notice{background:#e5f4ff;border:1px solid #9cc8f0;padding:8px 12px;margin:8px 0}
.error{background:#fff0ef;border:1px solid #f0aaa3;padding:8px 12px;margin:8px 0;overflow-wrap:anywhere}
.note{color:#5a6272;font-size:13px}
.actions{display:flex;gap:10px;margin:12px 0;flex-wrap:wrap;align-items:center}
.button{display:inline-block;padding:6px 14px;border-radius:4px;border:1px solid #2a5bd7;background:#2a5bd7;color:#fff;text-decoration:none;font:inherit;cursor:pointer}
.button.secondary{background:#fff;color:#2a5bd7}.button.danger{background:#c3261b;border-color:#c3261b}
form.filters{display:flex;gap:10px;align-items:end;margin:8px 0 12px;flex-wrap:wrap}
form.filters label,form.inline label{display:flex;flex-direction:column;font-size:12px;color:#5a6272}
form.filters input,form.filters select{font:inherit;padding:3px 5px;max-width:100%}
.err{color:#8a1308;overflow-wrap:anywhere}
.past-err{color:#5a6272;overflow-wrap:anywhere}
.id{overflow-wrap:anywhere;word-break:break-word}
.preview{color:#3b4252;overflow-wrap:anywhere}
time{white-space:nowrap;text-decoration:underline dotted #aab}
.toolbar{display:flex;gap:6px 14px;flex-wrap:wrap;align-items:center;margin:6px 0;font-size:13px}
.overview{display:flex;gap:0 40px;flex-wrap:wrap}
ul.keys{margin:6px 0;padding-left:20px}ul.keys li{overflow-wrap:anywhere;margin:0 0 4px}ul.keys .preview{display:block;font-size:13px}
details summary{cursor:pointer;color:#2a5bd7}
@media (max-width:720px){
header{padding:8px 12px}header .who{margin-left:0}
main{padding:12px}
table.list,table.list tbody{display:block;width:100%}
table.list thead{display:none}
table.list tr{display:grid;grid-template-columns:1fr 1fr;border:1px solid #dde1e8;margin:0 0 10px;background:#fff}
table.list td{display:block;border:0;border-bottom:1px solid #eef1f5;text-align:left;min-width:0}
table.list td.wide{grid-column:1/-1}
table.list td[data-label]::before{content:attr(data-label);display:block;font-size:11px;color:#5a6272}
table.record,table.record tbody,table.record tr,table.record th,table.record td{display:block;width:100%}
table.record th{width:auto;font-size:11px;font-weight:400;color:#5a6272;background:#fff;border-bottom:0;padding-bottom:0}
table.record td{border-top:0}
}
`;

/**
 * An exact time in ISO 8601 (UTC).
 * @param ms ms since epoch, or nothing
 * @returns the text, `—` for nothing
 */
export function fmtTime(ms: number | null | undefined): string {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return "—";
  try {
    return new Date(ms).toISOString();
  } catch {
    return String(ms);
  }
}

/**
 * How long ago (or how far ahead) `ms` is from `now`, in words: `just now`, `3 min ago`, `in 2 h`.
 * @param ms the time
 * @param now the time to measure from
 * @returns the text
 */
export function relativeTime(ms: number, now: number): string {
  const diff = now - ms;
  const abs = Math.abs(diff);
  let text: string;
  if (abs < 5_000) return "just now";
  if (abs < 60_000) text = `${Math.floor(abs / 1000)} s`;
  else if (abs < 3_600_000) text = `${Math.floor(abs / 60_000)} min`;
  else if (abs < 86_400_000) text = `${Math.floor(abs / 3_600_000)} h`;
  else text = `${Math.floor(abs / 86_400_000)} d`;
  return diff >= 0 ? `${text} ago` : `in ${text}`;
}

/**
 * A time as a `<time>` element: relative text, the exact time on hover (`title`) and in `datetime`.
 * @param ms the time, or nothing (`—`)
 * @param now the time to measure from
 * @returns the fragment
 */
export function timeTag(ms: number | null | undefined, now: number): SafeHtml {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return html`—`;
  const exact = fmtTime(ms);
  return html`<time datetime="${exact}" title="${exact}">${relativeTime(ms, now)}</time>`;
}

/**
 * A payload or content to print: its objects and arrays nested deeper than {@link MAX_STORED_DEPTH} (which
 * `JSON.stringify` would overflow the stack on) replaced by `CUT_NESTING_MARK`, with a note naming the
 * first one cut, or `""` when none was.
 * @param value the payload or content
 * @param name how the note names the value (`payload`)
 * @returns the value to print and the note
 */
export function cutForShow(value: JsonValue, name: string): { value: JsonValue; note: string } {
  const { value: kept, cutAt } = cutDeepNesting(value, MAX_STORED_DEPTH, name);
  return {
    value: kept as JsonValue,
    note: cutAt === undefined ? "" : `(${name} cut: nested deeper than ${MAX_STORED_DEPTH} levels, first at ${cutAt})`,
  };
}

/**
 * `value` as indented JSON, cut at 256 KiB and at {@link MAX_STORED_DEPTH} levels (see {@link cutForShow}).
 * @param value the payload or content
 * @param name how a note on a cut names the value
 * @returns the text
 */
export function prettyJson(value: JsonValue, name = "value"): string {
  const { value: kept, note } = cutForShow(value, name);
  let text = JSON.stringify(kept, null, 2) ?? "null";
  text = text.length > MAX_SHOWN_JSON ? `${text.slice(0, MAX_SHOWN_JSON)}\n… (truncated, ${text.length} characters)` : text;
  return note === "" ? text : `${text}\n${note}`;
}

/**
 * `text` cut at `max` characters (with `…`).
 * @param text the text; `null` is empty
 * @param max at most this many characters
 * @returns the text
 */
export function truncate(text: string | null, max: number): string {
  if (text === null) return "";
  return text.length > max ? `${text.slice(0, max)}…` : text;
}

/**
 * A state as a coloured badge.
 * @param state the state
 * @returns the fragment
 */
export function stateBadge(state: string): SafeHtml {
  return html`<span class="state state-${state}">${state}</span>`;
}

function textOf(value: JsonValue | undefined): string | null {
  if (typeof value === "string") return value;
  if (!isObject(value) || Array.isArray(value)) return null;
  for (const field of ["text", "caption", "body", "unreadable"]) {
    const v = (value as Record<string, JsonValue>)[field];
    if (typeof v === "string" && v !== "") return v;
  }
  const kind = (value as Record<string, JsonValue>).kind ?? (value as Record<string, JsonValue>).type;
  return typeof kind === "string" ? `[${kind}]` : null;
}

/**
 * A one-line preview of a journaled message: an inbound payload or an
 * outbound content (its text, caption or kind), whitespace folded, cut at `max`.
 * @param value the payload or content
 * @param max at most this many characters
 * @returns the preview, empty when there is nothing to show
 */
export function preview(value: JsonValue, max = 80): string {
  const text = textOf(value);
  return text === null ? "" : truncate(text.replace(/\s+/g, " ").trim(), max);
}

/**
 * An error as the journal keeps it, for the record page: its first line, then
 * any `Caused by:` lines as the cause chain and any stack frames (`    at …`)
 * folded in a `<details>`.
 * @param text the journaled error text
 * @param className `err` (the record's current error) or `past-err` (kept from before it succeeded)
 * @returns the fragment
 */
export function errorDetails(text: string, className: "err" | "past-err"): SafeHtml {
  const { head, causes, stack } = errorParts(text);
  return html`<div class="${className}">${head.join("\n")}</div>${
    causes.length > 0 ? html`<ol class="${className}">${causes.map((c) => html`<li>caused by ${c}</li>`)}</ol>` : null
  }${stack.length > 0 ? html`<details><summary>Stack (${stack.length} frames)</summary><pre>${stack.join("\n")}</pre></details>` : null}`;
}
