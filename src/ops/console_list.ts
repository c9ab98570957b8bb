/**
 * The console's lists: a filter (state, chat, error text, age), the scan of
 * the journal behind it, and the cursor that pages through it. Bulk actions
 * use the same filter and scan, so a confirmation counts exactly what the
 * list shows.
 *
 * @module
 */
import type { InboundRecord, InboundState, JsonValue, OutboxEntry, OutboxState } from "../contract.ts";
import type { ConsoleOps } from "./console_ops.ts";
import { INBOX, OUTBOX, operatorOrder } from "../machine.ts";
import { errorWithoutStack } from "./console_error.ts";
import { HttpError } from "./console_render.ts";
import { parseDuration } from "../config.ts";

/** The two journals, as the console names them in its URLs. */
export type Journal = "inbound" | "outbound";

/** Inbound states, in the console's order. */
export const INBOUND_STATES: readonly InboundState[] = operatorOrder(INBOX);
/** Outbound states, in the console's order. */
export const OUTBOUND_STATES: readonly OutboxState[] = operatorOrder(OUTBOX);
/** A list looks at most at this many records of its state and chat (error and age filters apply within). */
export const SCAN_CAP = 10_000;
/** The longest query parameter accepted. */
const MAX_PARAM_CHARS = 1024;

/** A filter of a list, from the query. */
export interface ListFilter {
  journal: Journal;
  /** One state, or `undefined` for all. */
  state: string | undefined;
  /** A chat id (exact), or `""`. */
  chat: string;
  /** Text the error's message or causes must contain (case-insensitive; not its stack frames), or `""`. */
  error: string;
  /** Only records created at least this long ago (a duration like `2h`), or `""`. */
  older: string;
  /** Only records created at most this long ago, or `""`. */
  newer: string;
}

/** A record of either journal, as a list shows it. */
export interface Row {
  id: string;
  chatId: string;
  state: string;
  attempts: number;
  error: string | null;
  createdAt: number;
  updatedAt: number;
  /** The payload or content. */
  message: JsonValue;
  /**
   * The position in the journal's order: `receivedAt` inbound (records of one
   * millisecond are in id order, see {@link compareRows}), `seq` outbound.
   */
  order: number;
}

/**
 * A query parameter, at most {@link MAX_PARAM_CHARS} long.
 * @param query the query
 * @param name the parameter
 * @returns its value, or `null` when absent
 * @throws {HttpError} 400 when longer
 */
export function param(query: URLSearchParams, name: string): string | null {
  const value = query.get(name);
  if (value !== null && value.length > MAX_PARAM_CHARS) {
    throw new HttpError(400, `Parameter "${name}" is too long (at most ${MAX_PARAM_CHARS} characters)`);
  }
  return value;
}

/**
 * A duration like `30m`, `2h`, `7d`, in ms (the grammar of the durations of the configuration and
 * the command line).
 * @param text the duration
 * @param name the parameter it came from, for the error
 * @returns the duration in ms
 * @throws {HttpError} 400 naming the parameter
 */
function parseAge(text: string, name: string): number {
  try {
    return parseDuration(text, name);
  } catch {
    throw new HttpError(400, `Parameter "${name}" must be a duration like 30m, 2h or 7d; got "${text}"`);
  }
}

/**
 * The filter of a list or bulk action, from its query.
 * @param journal the list's journal
 * @param query the query (`state`, `chat`, `error`, `older`, `newer`)
 * @returns the filter
 * @throws {HttpError} 400 naming a bad parameter
 */
export function parseFilter(journal: Journal, query: URLSearchParams): ListFilter {
  const states: readonly string[] = journal === "inbound" ? INBOUND_STATES : OUTBOUND_STATES;
  const raw = param(query, "state");
  let state: string | undefined;
  if (raw !== null && raw !== "" && raw !== "all") {
    if (!states.includes(raw)) throw new HttpError(400, `Parameter "state" must be one of ${["all", ...states].join(", ")}; got "${raw}"`);
    state = raw;
  }
  const filter: ListFilter = {
    journal,
    state,
    chat: param(query, "chat") ?? "",
    error: (param(query, "error") ?? "").trim(),
    older: (param(query, "older") ?? "").trim(),
    newer: (param(query, "newer") ?? "").trim(),
  };
  if (filter.older) parseAge(filter.older, "older");
  if (filter.newer) parseAge(filter.newer, "newer");
  return filter;
}

/**
 * The filter as query parameters (empty ones left out by the URL builder).
 * @param f the filter
 * @returns the parameters
 */
export function filterParams(f: ListFilter): Record<string, string | undefined> {
  return { state: f.state, chat: f.chat, error: f.error, older: f.older, newer: f.newer };
}

/**
 * Whether the filter narrows beyond what the backend's `list` filters (state, chat): error text or age.
 * @param f the filter
 * @returns whether some of it is applied by the console
 */
export function filtersInMemory(f: ListFilter): boolean {
  return f.error !== "" || f.older !== "" || f.newer !== "";
}

/**
 * The filter in words, for the pages: `state dead, chat "c1", error containing "blocked"`.
 * @param f the filter
 * @returns the words
 */
export function describeFilter(f: ListFilter): string {
  const parts = [f.state ? `state ${f.state}` : "every state"];
  if (f.chat) parts.push(`chat "${f.chat}"`);
  if (f.error) parts.push(`error containing "${f.error}"`);
  if (f.older) parts.push(`created more than ${f.older} ago`);
  if (f.newer) parts.push(`created less than ${f.newer} ago`);
  return parts.join(", ");
}

function inboundRow(r: InboundRecord): Row {
  return {
    id: r.id,
    chatId: r.chatId,
    state: r.state,
    attempts: r.attempts,
    error: r.error,
    createdAt: r.receivedAt,
    updatedAt: r.updatedAt,
    message: r.payload,
    order: r.receivedAt,
  };
}

function outboundRow(e: OutboxEntry): Row {
  return {
    id: e.key,
    chatId: e.chatId,
    state: e.state,
    attempts: e.attempts,
    error: e.error,
    createdAt: e.createdAt,
    updatedAt: e.updatedAt,
    message: e.content,
    order: e.seq,
  };
}

/**
 * The console's order of records: by `order`, then by id. Inbound records of
 * one millisecond are listed by the backends in admission order, which a
 * record does not carry; the console orders them by id instead, so that a
 * cursor names a place in the order whether or not its record is still
 * listed. Outbound `seq`s are unique.
 * @param a a record
 * @param b another
 * @returns negative when `a` comes first
 */
function compareRows(a: Row, b: Row): number {
  return a.order - b.order || (a.id < b.id ? -1 : a.id > b.id ? 1 : 0);
}

/** What a scan found. */
export interface Scan {
  /** The matching records, in the console's order ({@link compareRows}). */
  rows: Row[];
  /** Whether every record of the state and chat was read (else more exist past the ones read). */
  complete: boolean;
  /** Whether the scan stopped at {@link SCAN_CAP} with more records left. */
  truncated: boolean;
}

/**
 * Read the records matching `f`: state and chat by the backend's `list` (the
 * first `upTo` of them, at most {@link SCAN_CAP}), error text and age here,
 * measured from `now`. When more records are left, the ones read that share
 * their `order` with the first one left are left out too (the console orders
 * a millisecond's records by id, and some of them were not read), unless
 * that leaves nothing of a scan up to the cap.
 * @param ops the console's operations
 * @param f the filter
 * @param now the time ages are measured from
 * @param upTo read at most this many records of the state and chat
 * @returns what was found
 */
export async function scan(ops: ConsoleOps, f: ListFilter, now: number, upTo: number = SCAN_CAP): Promise<Scan> {
  const cap = Math.min(upTo, SCAN_CAP);
  const options = { ...(f.state ? { state: f.state } : {}), ...(f.chat ? { chatId: f.chat } : {}), limit: cap + 1 };
  const all = f.journal === "inbound"
    ? (await ops.inboxList(options as { state?: InboundState })).map(inboundRow)
    : (await ops.outboxList(options as { state?: OutboxState })).map(outboundRow);
  const complete = all.length <= cap;
  let read = all.slice(0, cap);
  if (!complete) {
    const left = all[cap]!.order;
    const whole = read.filter((r) => r.order !== left);
    if (whole.length > 0 || cap < SCAN_CAP) read = whole;
  }
  read.sort(compareRows);
  const needle = f.error.toLowerCase();
  const olderMs = f.older ? parseAge(f.older, "older") : null;
  const newerMs = f.newer ? parseAge(f.newer, "newer") : null;
  const rows = read.filter((r) =>
    (needle === "" || (r.error !== null && errorWithoutStack(r.error).toLowerCase().includes(needle))) &&
    (olderMs === null || r.createdAt <= now - olderMs) &&
    (newerMs === null || r.createdAt >= now - newerMs)
  );
  return { rows, complete, truncated: !complete && cap === SCAN_CAP };
}

/** A page's cursor: the last record of the page before, its place in the journal's order, and where it was in the list. */
export interface Cursor {
  /** `receivedAt` (inbound) or `seq` (outbound) of the record. */
  order: number;
  /** Its index in the list when the cursor was made (a hint of how far to read). */
  index: number;
  /** Its id or key. */
  id: string;
}

/**
 * The cursor of the page after `row`, which is at `index` in its list.
 * @param row the last record of a page
 * @param index its index in the list
 * @returns the cursor, for `after`
 */
export function cursorAfter(row: Row, index: number): string {
  return `${row.order}.${index}.${row.id}`;
}

/**
 * The cursor in a query's `after`.
 * @param text the parameter
 * @returns the cursor, or `null` for the first page
 * @throws {HttpError} 400 when it is malformed
 */
export function parseCursor(text: string | null): Cursor | null {
  if (text === null || text === "") return null;
  const match = /^(\d{1,16})\.(\d{1,7})\.([\s\S]+)$/.exec(text);
  if (!match) throw new HttpError(400, `Parameter "after" is not a cursor of this console; got "${text}"`);
  return { order: Number(match[1]), index: Number(match[2]), id: match[3]! };
}

/**
 * Where the page after `cursor` starts in `rows`: just after the record it
 * names, or (that record is gone or left the filter) at the first record
 * after it in the console's order ({@link compareRows}).
 * @param rows the records read, in the console's order
 * @param cursor the cursor, or `null` for the first page
 * @returns the index, or `null` when neither is among `rows`
 */
export function pageStart(rows: readonly Row[], cursor: Cursor | null): number | null {
  if (cursor === null) return 0;
  const at = rows.findIndex((r) => r.id === cursor.id);
  if (at >= 0) return at + 1;
  const later = rows.findIndex((r) => r.order > cursor.order || (r.order === cursor.order && r.id > cursor.id));
  return later < 0 ? null : later;
}
