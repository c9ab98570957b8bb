/**
 * Rows and records: a journal row read back as a record, checked column by
 * column; the values written to columns (no NUL in `text`, durations in whole
 * ms); the parameters of lists and the batches of purges.
 *
 * @module
 */
import type {
  ClaimOptions,
  InboundRecord,
  JsonValue,
  Lease,
  ListOptions,
  NewInboundRecord,
  NewOutboxEntry,
  OutboxEntry,
} from "../../src/contract.ts";
import { checkClaim, checkId, checkListFilter, checkNewInbound, checkNewOutbox, checkString, normalizeList } from "../../src/rules.ts";
import { Damage, jsonOf, storedInboundProblem, storedOutboxProblem } from "../../src/stored_records.ts";
import type { Row } from "./connection.ts";

/** Durations are clamped to this (about 31,000 years), so that `now + ms` stays a safe integer. */
export const MAX_DURATION_MS = 1e15;

/** A number column (bigint columns arrive as strings); anything else stays as is, for the record check to report. */
export function num(v: unknown): unknown {
  if (typeof v === "string" && v !== "" && Number.isFinite(Number(v))) return Number(v);
  if (typeof v === "bigint") return Number(v);
  return v;
}

function numOrNull(v: unknown): unknown {
  return v === null ? null : num(v);
}

/** A whole number of ms for `now + ms` in SQL: rounded up, at least 0, at most {@link MAX_DURATION_MS}. */
export function duration(ms: number): number {
  return Math.min(MAX_DURATION_MS, Math.max(0, Math.ceil(ms)));
}

/** Free text for a `text` column, which cannot hold NUL: each NUL becomes U+FFFD. */
export function textForPg(text: string): string {
  return text.includes("\u0000") ? text.replaceAll("\u0000", "\ufffd") : text;
}

/** The TypeError of a NUL in a field Postgres `text` stores (it cannot hold one), before anything is written. */
function nulError(what: string): TypeError {
  return new TypeError(`${what} must not contain NUL (\\u0000): a Postgres text column cannot hold it`);
}

/** {@link checkString}, and no NUL (an id, key, chat id, owner…: stored or compared as `text`). */
export function pgString(value: unknown, what: string): string {
  checkString(value, what);
  if ((value as string).includes("\u0000")) throw nulError(what);
  return value as string;
}

/** {@link pgString} for an id or a key: also well-formed Unicode (see {@link checkId}). */
export function pgId(value: unknown, what: string): string {
  return pgString(checkId(value, what), what);
}

/** {@link checkClaim}, and no NUL in the owner or incarnation. */
export function pgClaim(options: ClaimOptions, op: string): void {
  checkClaim(options, op);
  pgString(options.owner, `${op}: option "owner"`);
  pgString(options.incarnation, `${op}: option "incarnation"`);
}

/** {@link checkListFilter}, and no NUL in the chat id or the states. */
export function pgListFilter(options: ListOptions<string> | undefined, op: string): void {
  checkListFilter(options, op);
  if (options?.chatId !== undefined) pgString(options.chatId, `${op}: option "chatId"`);
  const state = options?.state;
  if (state !== undefined) for (const item of typeof state === "string" ? [state] : state) pgString(item, `${op}: option "state"`);
}

/** {@link checkNewInbound}, and no NUL in the text fields (the payload is JSON text: its NULs are escaped). */
export function pgInbound(record: NewInboundRecord): NewInboundRecord {
  const input = checkNewInbound(record);
  const what = `Inbox record ${JSON.stringify(input.id)}`;
  for (const field of ["id", "chatId", "provider", "kind"] as const) {
    if (input[field].includes("\u0000")) throw nulError(`${what}: field "${field}"`);
  }
  return input;
}

/** {@link checkNewOutbox}, and no NUL in the text fields (the content is JSON text: its NULs are escaped). */
export function pgOutbound(entry: NewOutboxEntry): NewOutboxEntry {
  const input = checkNewOutbox(entry);
  const what = `Outbox entry ${JSON.stringify(input.key)}`;
  for (const field of ["key", "chatId", "contentHash", "inboundId"] as const) {
    if (input[field]?.includes("\u0000")) throw nulError(`${what}: field "${field}"`);
  }
  return input;
}

/** Whether `token` can be a stored fencing token (a fractional or huge one never matches: it is stale). */
export function tokenOk(token: number): boolean {
  return Number.isSafeInteger(token) && token > 0;
}

/** The JSON of a session or kv `column`, or an error naming the table, row and column. */
export function jsonColumn(text: unknown, table: string, key: string, id: unknown, column: string): JsonValue {
  const value = jsonOf(text, column);
  if (value instanceof Damage) {
    throw new Error(`Postgres table ${table}, row ${key} ${JSON.stringify(String(id))}: ${value.problem} (the row is damaged)`);
  }
  return value;
}

/** A stored-record check's problem (`field "chatId" must be …`) in terms of the row (`column chat_id must be …`). */
function columnProblem(problem: string): Damage {
  return new Damage(problem.replace(/^field "(\w+)"/, (_, field: string) =>
    `column ${field === "lease" ? "lease_*" : field.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`)}`));
}

/** A record of a row this call just wrote from the caller's checked input: it reads back. */
export function written<T>(read: T | Damage, table: string): T {
  if (read instanceof Damage) throw new Error(`Postgres table ${table}: a row just written does not read back: ${read.problem}`);
  return read;
}

function leaseOf(row: Row): Lease | null {
  if (row.lease_owner === null) return null;
  return {
    owner: row.lease_owner as string,
    incarnation: row.lease_incarnation as string,
    token: num(row.lease_token) as number,
    expiresAt: num(row.lease_expires_at) as number,
  };
}

/** The inbox record of a row (its payload `payload` when the row has none), checked field by field. */
export function inboundOf(row: Row, payload?: JsonValue): InboundRecord | Damage {
  const json = payload !== undefined ? payload : jsonOf(row.payload, "payload");
  if (json instanceof Damage) return json;
  const record = {
    id: row.id,
    kind: row.kind,
    chatId: row.chat_id,
    provider: row.provider,
    payload: json,
    receivedAt: num(row.received_at),
    state: row.state,
    attempts: num(row.attempts),
    nextAttemptAt: numOrNull(row.next_attempt_at),
    lease: leaseOf(row),
    fence: num(row.fence),
    error: row.error,
    updatedAt: num(row.updated_at),
  } as InboundRecord;
  const problem = storedInboundProblem(record);
  return problem ? columnProblem(problem) : record;
}

/** The outbox entry of a row (its content `content` when the row has none), checked field by field. */
export function outboxOf(row: Row, content?: JsonValue): OutboxEntry | Damage {
  const json = content !== undefined ? content : jsonOf(row.content, "content");
  if (json instanceof Damage) return json;
  const uncalledFence = row.uncalled_fence;
  const entry = {
    key: row.key,
    chatId: row.chat_id,
    content: json,
    contentHash: row.content_hash,
    inboundId: row.inbound_id,
    state: row.state,
    attempts: num(row.attempts),
    nextAttemptAt: numOrNull(row.next_attempt_at),
    lease: leaseOf(row),
    fence: num(row.fence),
    // `called` is stored as `uncalled_fence` (see OUTBOX_COLUMNS in sql.ts): uncalled exactly when it
    // is the fence; NULL (a row older than the flag, or claimed by an older library) reads as called.
    called: uncalledFence === null || uncalledFence === undefined || num(uncalledFence) !== num(row.fence),
    messageId: row.message_id,
    error: row.error,
    seq: num(row.seq),
    createdAt: num(row.created_at),
    updatedAt: num(row.updated_at),
  } as OutboxEntry;
  const problem = storedOutboxProblem(entry);
  return problem ? columnProblem(problem) : entry;
}

/** The filter of a `list` as statement parameters. */
export function listParams(options: ListOptions<string> | undefined): { chat: boolean; states: string[]; params: unknown[]; limit: number } | null {
  const { states, chatId, limit } = normalizeList(options);
  if (limit === 0 || (states !== null && states.size === 0)) return null;
  const list = states === null ? [] : [...states];
  const params: unknown[] = [];
  if (chatId !== undefined) params.push(chatId);
  params.push(...list, limit);
  return { chat: chatId !== undefined, states: list, params, limit };
}

/** Runs `step` (one bounded delete) until it deletes fewer than `batch` rows. @returns the total */
export async function inBatches(batch: number, step: () => Promise<number>): Promise<number> {
  let total = 0;
  for (;;) {
    const n = await step();
    total += n;
    if (n < batch) return total;
  }
}
