/**
 * Bulk actions of the console: replay, retry or discard every record of a
 * filtered list, behind one confirmation page that says how many records and
 * what will happen. The confirmation's form (a POST with a CSRF token bound
 * to the filter, the time the ages were measured from, and the newest change
 * it counted) acts only on the records it counted: one that changed since is
 * left alone and counted as such.
 *
 * @module
 */
import type { CsrfTokens } from "./console_auth.ts";
import { describeFilter, filterParams, type Journal, type ListFilter, parseFilter, type Row, scan, SCAN_CAP } from "./console_list.ts";
import type { ConsoleOps } from "./console_ops.ts";
import { INBOX_MACHINE, OUTBOX_MACHINE } from "../machine.ts";
import { HttpError, preview, stateBadge } from "./console_render.ts";
import { html, SafeHtml } from "./html.ts";

/** A bulk action. */
export interface BulkSpec {
  journal: Journal;
  name: "replay" | "retry" | "discard";
  label: string;
  /** The states it applies to: records of the list in another state are left out. */
  allowed: readonly string[];
  explain: string;
  /** What was done, for the notice: `Retried` … */
  done: string;
}

/** The bulk actions, by path. */
export const BULK: Record<string, BulkSpec> = {
  "inbound/bulk/replay": {
    journal: "inbound",
    name: "replay",
    label: "Replay",
    allowed: INBOX_MACHINE.transitions.replay.from,
    explain: "Each record is made pending again (attempts reset) and its handler runs again, in each chat's order.",
    done: "Replayed",
  },
  "outbound/bulk/retry": {
    journal: "outbound",
    name: "retry",
    label: "Retry",
    allowed: OUTBOX_MACHINE.transitions.retry.from,
    explain:
      "Each send is queued again (attempts reset) and the provider is called again. An unknown send among them may reach its chat twice: check the chat and mark it as delivered instead when it arrived.",
    done: "Retried",
  },
  "outbound/bulk/discard": {
    journal: "outbound",
    name: "discard",
    label: "Discard",
    allowed: OUTBOX_MACHINE.transitions.discard.from,
    explain: "Each entry is deleted from the outbox: it will not be sent, and its idempotency key is forgotten. This cannot be undone.",
    done: "Discarded",
  },
};

/** What the bulk pages need from the handler. */
export interface BulkContext {
  ops: ConsoleOps;
  csrf: CsrfTokens;
  url(path: string, params?: Record<string, string | number | undefined>): string;
  now(): number;
}

const SHOWN_KEYS = 20;
const CONCURRENCY = 4;

function eligible(rows: readonly Row[], spec: BulkSpec): Row[] {
  return rows.filter((r) => spec.allowed.includes(r.state));
}

function tokenSubject(f: ListFilter, at: number, cutoff: number, expected: number): string {
  return JSON.stringify([filterParams(f), at, cutoff, expected]);
}

function noun(spec: BulkSpec, n: number): string {
  const word = spec.journal === "inbound" ? "record" : "send";
  return `${n} ${word}${n === 1 ? "" : "s"}`;
}

/**
 * The bulk link of a list, when its action applies to some of its records.
 * @param ctx the handler's context
 * @param path the action's path, a key of {@link BULK}
 * @param f the list's filter
 * @param rows every record of the list, or `null` when they were not all read (the link then has no count)
 * @returns the link, or `null` when the action applies to none
 */
export function bulkLink(ctx: BulkContext, path: string, f: ListFilter, rows: readonly Row[] | null): SafeHtml | null {
  const spec = BULK[path]!;
  const n = rows === null ? null : eligible(rows, spec).length;
  if (n === 0) return null;
  const danger = spec.name === "discard" ? " danger" : " secondary";
  return html`<a class="button${new SafeHtml(danger)}" href="${ctx.url(`/${path}`, filterParams(f))}">${spec.label} all${
    n === null ? "" : ` ${n}`
  }…</a>`;
}

/**
 * The confirmation page of a bulk action (a GET: changes nothing).
 * @param ctx the handler's context
 * @param path the action's path, a key of {@link BULK}
 * @param query the list's filter
 * @param user the operator, bound into the token
 * @returns the page
 * @throws {HttpError} 400 on a bad filter
 */
export async function bulkConfirm(
  ctx: BulkContext,
  path: string,
  query: URLSearchParams,
  user: string,
): Promise<{ title: string; body: SafeHtml }> {
  const spec = BULK[path]!;
  const f = parseFilter(spec.journal, query);
  const at = ctx.now();
  const found = await scan(ctx.ops, f, at);
  const targets = eligible(found.rows, spec);
  const listUrl = ctx.url(`/${spec.journal}`, filterParams(f));
  const what = html`<p>The list: ${describeFilter(f)}. ${found.rows.length} record${found.rows.length === 1 ? "" : "s"} match${
    found.rows.length === 1 ? "es" : ""
  }${
    targets.length < found.rows.length
      ? `; ${found.rows.length - targets.length} of them are in a state ${spec.name} does not apply to (it needs ${spec.allowed.join(", ")}) and are left alone`
      : ""
  }.</p>${
    found.truncated
      ? html`<p class="note">Only the first ${SCAN_CAP} records of this state and chat were looked at: run it again for the rest.</p>`
      : null
  }`;
  if (targets.length === 0) {
    return {
      title: `Nothing to ${spec.name}`,
      body: html`<h1>Nothing to ${spec.name}</h1>${what}<p><a href="${listUrl}">Back to the list</a></p>`,
    };
  }
  const cutoff = Math.max(...targets.map((r) => r.updatedAt));
  const token = await ctx.csrf.issue(user, path, tokenSubject(f, at, cutoff, targets.length));
  const shown = targets.slice(0, SHOWN_KEYS).map((r) =>
    html`<li><span class="id">${r.id}</span> ${stateBadge(r.state)} <span class="preview">${preview(r.message, 60)}</span></li>`
  );
  const danger = spec.name === "discard" ? " danger" : "";
  return {
    title: `${spec.label} ${noun(spec, targets.length)}?`,
    body: html`<h1>${spec.label} ${noun(spec, targets.length)}?</h1>
${what}
<p><strong>What will happen:</strong> ${spec.explain}</p>
<p>Records that change before you confirm (handled, retried, or new ones) are left alone.</p>
<ul class="keys">${shown}${targets.length > SHOWN_KEYS ? html`<li>… and ${targets.length - SHOWN_KEYS} more</li>` : null}</ul>
<form method="post" action="${ctx.url(`/${path}`, filterParams(f))}">
<input type="hidden" name="csrf" value="${token}">
<input type="hidden" name="at" value="${at}">
<input type="hidden" name="cutoff" value="${cutoff}">
<input type="hidden" name="expected" value="${targets.length}">
<div class="actions"><button class="button${new SafeHtml(danger)}" type="submit">Yes, ${spec.name} ${noun(spec, targets.length)}</button><a class="button secondary" href="${listUrl}">Cancel</a></div>
</form>`,
  };
}

function integerField(form: URLSearchParams, name: string): number {
  const raw = form.get(name) ?? "";
  if (!/^\d{1,16}$/.test(raw)) throw new HttpError(400, `Form field "${name}" must be a whole number; nothing was changed`);
  return Number(raw);
}

/**
 * Run a confirmed bulk action (the POST).
 * @param ctx the handler's context
 * @param path the action's path, a key of {@link BULK}
 * @param query the list's filter
 * @param form the posted form (`csrf`, `at`, `cutoff`, `expected`)
 * @param user the operator
 * @returns where to go next: the list, with a notice of what was done
 * @throws {HttpError} 403 on a bad token (nothing changed), 400 on a bad form
 */
export async function bulkPerform(
  ctx: BulkContext,
  path: string,
  query: URLSearchParams,
  form: URLSearchParams,
  user: string,
): Promise<string> {
  const spec = BULK[path]!;
  const f = parseFilter(spec.journal, query);
  const at = integerField(form, "at");
  const cutoff = integerField(form, "cutoff");
  const expected = integerField(form, "expected");
  const problem = await ctx.csrf.check(form.get("csrf"), user, path, tokenSubject(f, at, cutoff, expected));
  if (problem !== null) throw new HttpError(403, `Refused: ${problem}. Nothing was changed.`);
  const found = await scan(ctx.ops, f, at);
  const targets = eligible(found.rows, spec).filter((r) => r.updatedAt <= cutoff).slice(0, expected);
  const act = spec.name === "replay"
    ? (id: string) => ctx.ops.replay(id)
    : spec.name === "retry"
    ? (id: string) => ctx.ops.retry(id)
    : (id: string) => ctx.ops.discard(id);
  let done = 0;
  let next = 0;
  const worker = async (): Promise<void> => {
    while (next < targets.length) {
      const row = targets[next++]!;
      if (await act(row.id)) done++;
    }
  };
  await Promise.all(Array.from({ length: Math.min(CONCURRENCY, targets.length) }, worker));
  return ctx.url(`/${spec.journal}`, { ...filterParams(f), notice: `bulk-${spec.name}`, n: done, left: expected - done });
}

/**
 * The notice after a bulk action, from its redirect's query (fixed texts and whole numbers only).
 * @param query the query
 * @returns the text, or `null`
 */
export function bulkNotice(query: URLSearchParams): string | null {
  const name = query.get("notice");
  const spec = Object.values(BULK).find((s) => `bulk-${s.name}` === name);
  const n = query.get("n") ?? "";
  const left = query.get("left") ?? "0";
  if (!spec || !/^\d{1,6}$/.test(n) || !/^\d{1,6}$/.test(left)) return null;
  const changed = Number(left) > 0
    ? ` ${left} had changed since the confirmation (or changed meanwhile) and ${Number(left) === 1 ? "was" : "were"} left alone.`
    : "";
  return `${spec.done} ${noun(spec, Number(n))}.${changed}`;
}
