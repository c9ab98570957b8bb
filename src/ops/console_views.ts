/**
 * The console's pages: the overview, the filtered lists with their pages,
 * one record, the damaged records, and the confirmation of an action on one
 * record. Each view is a GET and changes nothing.
 *
 * @module
 */
import type { InboundRecord, InboundState, OutboxEntry, OutboxState } from "../contract.ts";
import type { CsrfTokens } from "./console_auth.ts";
import { bulkLink, type BulkContext } from "./console_bulk.ts";
import {
  cursorAfter,
  describeFilter,
  filterParams,
  INBOUND_STATES,
  type Journal,
  OUTBOUND_STATES,
  filtersInMemory,
  pageStart,
  param,
  parseCursor,
  parseFilter,
  scan,
  SCAN_CAP,
} from "./console_list.ts";
import type { ConsoleOps } from "./console_ops.ts";
import { INBOX, INBOX_MACHINE, OUTBOX, OUTBOX_MACHINE } from "../machine.ts";
import { errorDetails, fmtTime, HttpError, prettyJson, preview, stateBadge, timeTag, truncate } from "./console_render.ts";
import { html, type HtmlValue, SafeHtml } from "./html.ts";
import { STACK_FRAMES } from "../errors.ts";

/** A page of the console. */
export interface Page {
  status?: number;
  title: string;
  body: SafeHtml;
  /** Reload the page every this many seconds (`<meta http-equiv="refresh">`: no script). */
  refresh?: number;
}

/** An action on one record. */
export interface ActionSpec {
  journal: Journal;
  name: "replay" | "retry" | "discard" | "delivered";
  label: string;
  /** The action in a sentence: `mark as delivered`. */
  verb: string;
  /** The states the record may be in for the action. */
  allowed: readonly string[];
  explain: string;
  notice: string;
}

/** Whether `state` is a journal's finished-well state (`done`, `sent`): an error on it is history. */
function isPurgeable(state: string): boolean {
  const traits = (INBOX as Record<string, { purgeable: boolean } | undefined>)[state] ??
    (OUTBOX as Record<string, { purgeable: boolean } | undefined>)[state];
  return traits?.purgeable === true;
}

/** The actions on one record, by path. */
export const ACTIONS: Record<string, ActionSpec> = {
  "inbound/replay": {
    journal: "inbound",
    name: "replay",
    label: "Replay",
    verb: "replay",
    allowed: INBOX_MACHINE.transitions.replay.from,
    explain: "The record is made pending again (attempts reset) and its handler runs again.",
    notice: "Replayed: the record is pending again.",
  },
  "outbound/retry": {
    journal: "outbound",
    name: "retry",
    label: "Retry",
    verb: "retry",
    allowed: OUTBOX_MACHINE.transitions.retry.from,
    explain:
      "The send is queued again (attempts reset) and the provider is called again. For an unknown send the message may be delivered twice.",
    notice: "Retried: the send is queued again.",
  },
  "outbound/delivered": {
    journal: "outbound",
    name: "delivered",
    label: "Mark as delivered",
    verb: "mark as delivered",
    allowed: OUTBOX_MACHINE.transitions.markDelivered.from,
    explain:
      "You checked the chat and the message is there: the entry becomes sent without calling the provider again. Do this only when you saw it arrive; if it did not, retry instead.",
    notice: "Marked as delivered: the send is sent, and was not sent again.",
  },
  "outbound/discard": {
    journal: "outbound",
    name: "discard",
    label: "Discard",
    verb: "discard",
    allowed: OUTBOX_MACHINE.transitions.discard.from,
    explain: "The entry is deleted from the outbox. It will not be sent, and its idempotency key is forgotten.",
    notice: "Discarded.",
  },
};

/** What the views need from the handler. */
export interface ViewContext extends BulkContext {
  ops: ConsoleOps;
  csrf: CsrfTokens;
  countCap: number;
}

const DEFAULT_LIMIT = 50;
const MAX_LIMIT = 1000;
const REFRESH_CHOICES = [10, 30, 60];
/** Records read past a page's cursor hint, for records removed before it since the cursor was made. */
const CURSOR_MARGIN = 100;

function parseLimit(query: URLSearchParams): number {
  const raw = param(query, "limit");
  if (raw === null || raw === "") return DEFAULT_LIMIT;
  const n = /^\d{1,7}$/.test(raw) ? Number(raw) : NaN;
  if (!Number.isInteger(n) || n < 1 || n > MAX_LIMIT) {
    throw new HttpError(400, `Parameter "limit" must be an integer from 1 to ${MAX_LIMIT}; got "${raw}"`);
  }
  return n;
}

function parseRefresh(query: URLSearchParams): number | undefined {
  const raw = param(query, "refresh");
  if (raw === null || raw === "" || raw === "0") return undefined;
  const n = /^\d{1,4}$/.test(raw) ? Number(raw) : NaN;
  if (!Number.isInteger(n) || n < 5 || n > 3600) {
    throw new HttpError(400, `Parameter "refresh" must be a number of seconds from 5 to 3600, or 0; got "${raw}"`);
  }
  return n;
}

function requireId(query: URLSearchParams): string {
  const id = param(query, "id");
  if (id === null || id === "") throw new HttpError(400, `Parameter "id" is required`);
  return id;
}

const field = (name: string, value: HtmlValue): SafeHtml => html`<tr><th>${name}</th><td>${value}</td></tr>`;
const cell = (label: string, value: HtmlValue, cls = ""): SafeHtml =>
  html`<td data-label="${label}"${new SafeHtml(cls ? ` class="${cls}"` : "")}>${value}</td>`;

/** The views of the console (each a GET that changes nothing). */
export interface Views {
  overview(query: URLSearchParams): Promise<Page>;
  damaged(query: URLSearchParams): Promise<Page>;
  list(journal: Journal, query: URLSearchParams, notice: string | null): Promise<Page>;
  record(journal: Journal, query: URLSearchParams, notice: string | null): Promise<Page>;
  /** The confirmation page of the action at `path`. */
  confirm(path: string, query: URLSearchParams, user: string): Promise<Page>;
  /** The record's state now, or `null` when there is none. */
  currentState(journal: Journal, id: string): Promise<string | null>;
}

/**
 * The console's views over `ctx`.
 * @param ctx the operations, tokens and URL builder of the handler
 * @returns the views
 */
export function views(ctx: ViewContext): Views {
  const { ops, csrf, url, now, countCap } = ctx;

  /** The refresh links of a page at `path` with `params` (without the notice). */
  const toolbar = (path: string, params: Record<string, string | number | undefined>, refresh: number | undefined): SafeHtml => {
    const choices = REFRESH_CHOICES.map((s) =>
      s === refresh ? html`<strong>${s} s</strong>` : html`<a href="${url(path, { ...params, refresh: s })}">${s} s</a>`
    );
    return html`<div class="toolbar"><a class="button secondary" href="${url(path, { ...params, refresh })}">Refresh</a>
<span>As of <time datetime="${fmtTime(now())}" title="${fmtTime(now())}">${fmtTime(now()).slice(11, 19)} UTC</time></span>
<span>Auto-refresh: ${refresh ? html`<a href="${url(path, params)}">off</a>` : html`<strong>off</strong>`} · ${
      choices.map((c, i) => i === 0 ? c : html` · ${c}`)
    }</span></div>`;
  };

  const countRow = async (journal: Journal, state: string): Promise<SafeHtml> => {
    const rows = journal === "inbound"
      ? await ops.inboxList({ state: state as InboundState, limit: countCap + 1 })
      : await ops.outboxList({ state: state as OutboxState, limit: countCap + 1 });
    const count = rows.length > countCap ? `${countCap}+` : String(rows.length);
    return html`<tr><td>${stateBadge(state)}</td><td class="num"><a href="${url(`/${journal}`, { state })}">${count}</a></td></tr>`;
  };

  /** The rate limiter's line and throttled sends of this process (a bot only). */
  const rateLimits = (): SafeHtml | string => {
    const m = ops.metrics?.();
    if (m === undefined) return "";
    return html`<section><h2>Rate limits (this process)</h2><table><tbody>
<tr><td>Sends waiting for the rate limiter</td><td class="num" id="outbox-waiting-for-limit">${String(m.outboxWaitingForLimit)}</td></tr>
<tr><td>Sends throttled since start (waited, or paused by a 429)</td><td class="num" id="outbox-throttled">${String(m.outboxThrottled)}</td></tr>
</tbody></table></section>`;
  };

  const overview = async (query: URLSearchParams): Promise<Page> => {
    const refresh = parseRefresh(query);
    const inbound = await Promise.all(INBOUND_STATES.map((s) => countRow("inbound", s)));
    const outbound = await Promise.all(OUTBOUND_STATES.map((s) => countRow("outbound", s)));
    return {
      title: "Overview",
      refresh,
      body: html`<h1>Overview</h1>${toolbar("/", {}, refresh)}
<p class="note">Counts stop at ${countCap}: a state with more records shows ${countCap}+.</p>
<div class="overview">
<section><h2>Inbound (inbox)</h2><table><thead><tr><th>State</th><th>Records</th></tr></thead><tbody>${inbound}</tbody></table>
<p><a href="${url("/inbound")}">All inbound records</a></p></section>
<section><h2>Outbound (outbox)</h2><table><thead><tr><th>State</th><th>Sends</th></tr></thead><tbody>${outbound}</tbody></table>
<p><a href="${url("/outbound")}">All sends</a></p></section>
</div>${rateLimits()}`,
    };
  };

  const damaged = async (query: URLSearchParams): Promise<Page> => {
    const limit = parseLimit(query);
    const at = now();
    const found = await ops.damaged({ limit: limit + 1 });
    const byJournal = (["inbox", "outbox"] as const).map((j) => found.filter((d) => d.journal === j));
    const more = byJournal.some((list) => list.length > limit);
    const rows = byJournal.flatMap((list) => list.slice(0, limit)).map((d) =>
      html`<tr>${cell("Journal", d.journal === "inbox" ? "inbound" : "outbound")}${cell("Id", d.id, "id wide")}${
        cell("Set aside", timeTag(d.setAsideAt, at))
      }${cell("Reported", d.reported ? "yes" : "no")}${cell("Problem", truncate(d.problem, 400), "err wide")}</tr>`
    );
    return {
      title: "Damaged records",
      body: html`<h1>Damaged records</h1>
<p class="note">Records the backend could not read back. Each was set aside as it was stored (never deleted), left out of the lists, the due scans and its chat's order, and reported once as an error by a bot. Repair or remove them with the backend's own tools.</p>
${
        rows.length === 0
          ? html`<p>No damaged records.</p>`
          : html`<table class="list"><thead><tr><th>Journal</th><th>Id</th><th>Set aside</th><th>Reported</th><th>Problem</th></tr></thead><tbody>${rows}</tbody></table>`
      }${more ? html`<p class="note">Showing the first ${limit} per journal.</p>` : ""}`,
    };
  };

  const errorCell = (state: string, error: string | null): SafeHtml => {
    if (error === null) return cell("Last error", "", "wide");
    const settled = isPurgeable(state);
    return settled
      ? cell("Last error", html`<span class="past-err">before it was ${state}: ${truncate(error.split("\n")[0]!, 200)}</span>`, "wide")
      : cell("Last error", truncate(error.split("\n")[0]!, 200), "err wide");
  };

  const list = async (journal: Journal, query: URLSearchParams, notice: string | null): Promise<Page> => {
    const states: readonly string[] = journal === "inbound" ? INBOUND_STATES : OUTBOUND_STATES;
    const f = parseFilter(journal, query);
    const limit = parseLimit(query);
    const refresh = parseRefresh(query);
    const after = param(query, "after");
    const cursor = parseCursor(after);
    const at = now();
    // Without an error or age filter the backend's list filters everything: read only up to this page
    // (and a margin for records removed before it); with one, or when that is not enough, up to the cap.
    let found = await scan(ops, f, at, filtersInMemory(f) ? SCAN_CAP : (cursor?.index ?? 0) + limit + CURSOR_MARGIN);
    let start = pageStart(found.rows, cursor);
    if (!found.complete && (start === null || start + limit >= found.rows.length)) {
      found = await scan(ops, f, at, SCAN_CAP);
      start = pageStart(found.rows, cursor);
    }
    start ??= found.rows.length;
    const shown = found.rows.slice(start, start + limit);
    const more = start + limit < found.rows.length;
    const rows = shown.map((r) =>
      html`<tr>${cell(journal === "inbound" ? "Id" : "Key", html`<a href="${url(`/${journal}/record`, { id: r.id })}">${r.id}</a>`, "id wide")}${
        cell("Chat", r.chatId, "id")
      }${cell("State", stateBadge(r.state))}${cell("Message", preview(r.message), "preview wide")}${cell("Attempts", r.attempts, "num")}${
        cell(journal === "inbound" ? "Received" : "Created", timeTag(r.createdAt, at))
      }${cell("Updated", timeTag(r.updatedAt, at))}${errorCell(r.state, r.error)}</tr>`
    );
    const heading = `${journal === "inbound" ? "Inbound" : "Outbound"} · ${f.state ?? "all states"}`;
    const options = ["all", ...states].map((s) =>
      html`<option value="${s}"${new SafeHtml((f.state ?? "all") === s ? " selected" : "")}>${s}</option>`
    );
    const params = { ...filterParams(f), limit: limit === DEFAULT_LIMIT ? undefined : limit };
    // Counts only when every record was read; else the confirmation page counts them.
    const counted = found.complete ? found.rows : null;
    const bulk = journal === "inbound"
      ? [bulkLink(ctx, "inbound/bulk/replay", f, counted)]
      : [bulkLink(ctx, "outbound/bulk/retry", f, counted), bulkLink(ctx, "outbound/bulk/discard", f, counted)];
    const total = found.complete ? ` of ${found.rows.length}` : found.truncated ? ` of ${found.rows.length}+` : "; more exist";
    return {
      title: heading,
      refresh,
      body: html`<h1>${heading}</h1>
${notice ? html`<div class="notice">${notice}</div>` : null}
<form class="filters" method="get" action="${url(`/${journal}`)}">
<label>State<select name="state">${options}</select></label>
<label>Chat id<input name="chat" value="${f.chat}" placeholder="any chat" size="14"></label>
<label>Error contains<input name="error" value="${f.error}" placeholder="any error" size="14"></label>
<label>Older than<input name="older" value="${f.older}" placeholder="e.g. 1h" size="6"></label>
<label>Newer than<input name="newer" value="${f.newer}" placeholder="e.g. 7d" size="6"></label>
<label>Per page<input name="limit" type="number" min="1" max="${MAX_LIMIT}" value="${limit}" size="5"></label>
<button class="button secondary" type="submit">Filter</button></form>
${toolbar(`/${journal}`, { ...params, after: after ?? undefined }, refresh)}
${bulk.some((b) => b !== null) ? html`<div class="actions">${bulk}</div>` : null}
${
        rows.length === 0
          ? html`<p>No records${start > 0 ? " on this page" : ""}.</p>`
          : html`<table class="list"><thead><tr><th>${journal === "inbound" ? "Id" : "Key"}</th><th>Chat</th><th>State</th><th>Message</th><th>Attempts</th><th>${
            journal === "inbound" ? "Received" : "Created"
          }</th><th>Updated</th><th>Last error</th></tr></thead><tbody>${rows}</tbody></table>`
      }
<p class="note">${
        shown.length > 0 ? `Records ${start + 1}–${start + shown.length}${total}` : found.complete ? `${found.rows.length} records` : "No records on this page"
      } matching ${describeFilter(f)}, in ${journal === "inbound" ? "receipt" : "reservation"} order.${
        found.truncated ? ` Only the first ${SCAN_CAP} of this state and chat are looked at: narrow the filter to see further.` : ""
      }</p>
<div class="actions">${start > 0 ? html`<a class="button secondary" href="${url(`/${journal}`, params)}">First page</a>` : null}${
        more ? html`<a class="button secondary" href="${url(`/${journal}`, { ...params, after: cursorAfter(shown.at(-1)!, start + shown.length - 1) })}">Next page</a>` : null
      }</div>`,
    };
  };

  const leaseRows = (r: InboundRecord | OutboxEntry, at: number): SafeHtml[] =>
    r.lease
      ? [
        field("Lease owner", r.lease.owner),
        field("Lease incarnation", r.lease.incarnation),
        field("Lease token", r.lease.token),
        field("Lease expires", timeTag(r.lease.expiresAt, at)),
      ]
      : [field("Lease", "none")];

  const actionButtons = (journal: Journal, state: string, id: string): SafeHtml[] =>
    Object.entries(ACTIONS)
      .filter(([, spec]) => spec.journal === journal && spec.allowed.includes(state))
      .map(([path, spec]) =>
        html`<a class="button${new SafeHtml(spec.name === "discard" ? " danger" : "")}" href="${url(`/${path}`, { id })}">${spec.label}…</a>`
      );

  const errorRow = (state: string, error: string | null): SafeHtml => {
    if (error === null) return field("Last error", "—");
    if (isPurgeable(state)) {
      return field(`Last error before it was ${state}`, errorDetails(error, "past-err"));
    }
    return field("Last error", errorDetails(error, "err"));
  };

  const record = async (journal: Journal, query: URLSearchParams, notice: string | null): Promise<Page> => {
    const id = requireId(query);
    const refresh = parseRefresh(query);
    const at = now();
    const bar = toolbar(`/${journal}/record`, { id }, refresh);
    if (journal === "inbound") {
      const r = await ops.inboxGet(id);
      if (!r) throw new HttpError(404, `No inbound record with id "${id}"`);
      return {
        title: `Inbound ${id}`,
        refresh,
        body: html`<h1>Inbound record</h1>
${notice ? html`<div class="notice">${notice}</div>` : null}${bar}
<table class="record"><tbody>
${field("Id", html`<span class="id">${r.id}</span>`)}${field("State", stateBadge(r.state))}${field("Kind", r.kind)}${field("Chat", r.chatId)}
${field("Message", preview(r.payload, 400) || "—")}
${field("Provider", r.provider)}${field("Attempts", r.attempts)}${errorRow(r.state, r.error)}
${field("Next attempt", timeTag(r.nextAttemptAt, at))}${leaseRows(r, at)}${field("Fencing token (last issued)", r.fence)}
${field("Received", timeTag(r.receivedAt, at))}${field("Updated", timeTag(r.updatedAt, at))}
</tbody></table>
<p class="note">The journal keeps the last error only: a handler's error with its causes and the first ${STACK_FRAMES} frames of its stack, a send's error as its name and message. The whole error goes to the bot's <code>error</code> event and your logs.</p>
<div class="actions">${actionButtons("inbound", r.state, r.id)}<a class="button secondary" href="${
          url("/inbound", { state: r.state })
        }">Back to the list</a></div>
<h2>Payload</h2><pre>${prettyJson(r.payload, "payload")}</pre>`,
      };
    }
    const e = await ops.outboxGet(id);
    if (!e) throw new HttpError(404, `No outbound entry with key "${id}"`);
    return {
      title: `Outbound ${id}`,
      refresh,
      body: html`<h1>Outbound entry</h1>
${notice ? html`<div class="notice">${notice}</div>` : null}${bar}
<table class="record"><tbody>
${field("Key", html`<span class="id">${e.key}</span>`)}${field("State", stateBadge(e.state))}${field("Chat", e.chatId)}
${field("Message", preview(e.content, 400) || "—")}
${field("Inbound record", e.inboundId ? html`<a href="${url("/inbound/record", { id: e.inboundId })}">${e.inboundId}</a>` : "—")}
${field("Attempts", e.attempts)}${errorRow(e.state, e.error)}${
        field("Provider message id", e.messageId === null ? "—" : e.messageId === "" ? "not known (marked as delivered by an operator)" : e.messageId)
      }
${field("Next attempt", timeTag(e.nextAttemptAt, at))}${leaseRows(e, at)}${field("Fencing token (last issued)", e.fence)}
${field("Sequence", e.seq)}${field("Content hash", html`<span class="id">${e.contentHash}</span>`)}
${field("Created", timeTag(e.createdAt, at))}${field("Updated", timeTag(e.updatedAt, at))}
</tbody></table>
<p class="note">The journal keeps the last error only: a send's error as its name and message (a handler's error also with its causes and stack frames, on its inbound record). The whole error goes to the bot's <code>error</code> event and your logs.</p>
<div class="actions">${actionButtons("outbound", e.state, e.key)}<a class="button secondary" href="${
        url("/outbound", { state: e.state })
      }">Back to the list</a></div>
<h2>Content</h2><pre>${prettyJson(e.content, "content")}</pre>`,
    };
  };

  const currentState = async (journal: Journal, id: string): Promise<string | null> => {
    const found = journal === "inbound" ? await ops.inboxGet(id) : await ops.outboxGet(id);
    return found ? found.state : null;
  };

  const confirm = async (path: string, query: URLSearchParams, user: string): Promise<Page> => {
    const spec = ACTIONS[path]!;
    const id = requireId(query);
    const state = await currentState(spec.journal, id);
    if (state === null) throw new HttpError(404, `No ${spec.journal} record with id "${id}"`);
    const recordUrl = url(`/${spec.journal}/record`, { id });
    if (!spec.allowed.includes(state)) {
      return {
        status: 409,
        title: `${spec.label} not possible`,
        body: html`<h1>${spec.label} not possible</h1><div class="error">The record is ${state}; ${spec.verb} needs one of: ${
          spec.allowed.join(", ")
        }.</div><p><a href="${recordUrl}">Back to the record</a></p>`,
      };
    }
    const token = await csrf.issue(user, path, id);
    const what = spec.journal === "inbound" ? "record" : "send";
    return {
      title: `${spec.label}?`,
      body: html`<h1>${spec.name === "delivered" ? "Mark this send as delivered?" : `${spec.label} this ${what}?`}</h1>
<table class="record"><tbody>${field(spec.journal === "inbound" ? "Id" : "Key", html`<span class="id">${id}</span>`)}${
        field("State", stateBadge(state))
      }</tbody></table>
<p>${spec.explain}</p>
<form method="post" action="${url(`/${path}`, { id })}">
<input type="hidden" name="csrf" value="${token}">
${
        spec.name === "delivered"
          ? html`<p><label>Provider message id, if you know it (optional)<br><input name="messageId" maxlength="512" size="30"></label></p>`
          : null
      }<div class="actions"><button class="button${new SafeHtml(spec.name === "discard" ? " danger" : "")}" type="submit">Yes, ${spec.verb}</button><a class="button secondary" href="${recordUrl}">Cancel</a></div>
</form>`,
    };
  };

  return { overview, damaged, list, record, confirm, currentState };
}
