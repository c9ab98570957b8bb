/**
 * Journal rows and records: the columns read, a row's record (or what is
 * wrong with the row: a damaged row), and a record's lease as columns.
 *
 * @module
 */
import type { InboundRecord, Lease, OutboxEntry } from "../../src/contract.ts";
import { Damage, describeJsonKind, jsonOf, storedInboundProblem, storedOutboxProblem } from "../../src/stored_records.ts";
import type { SqliteRow, SqliteValue } from "../../src/runtime/sqlite.ts";

/** A row as the driver returns it. */
export type Row = SqliteRow;

/** A column known to hold a number. */
export function num(v: SqliteValue): number {
  return v as number;
}

/** Inbox rows in arrival order: `received_at`, then `ord`. */
export function arrival(a: Row, b: Row): number {
  return num(a.received_at) - num(b.received_at) || num(a.ord) - num(b.ord);
}

/** A column known to hold a number or NULL. */
export function numOrNull(v: SqliteValue): number | null {
  return v === null ? null : (v as number);
}

function leaseOf(row: Row): Lease | null {
  if (row.lease_owner === null) return null;
  return {
    owner: String(row.lease_owner),
    incarnation: String(row.lease_incarnation),
    token: num(row.lease_token),
    expiresAt: num(row.lease_expires_at),
  };
}

/** The lease columns of `lease`: owner, incarnation, token, expiresAt. */
export function leaseParams(lease: Lease | null): SqliteValue[] {
  return lease ? [lease.owner, lease.incarnation, lease.token, lease.expiresAt] : [null, null, null, null];
}

/** The set-aside columns (schema 6), read with every row: `set_aside_seq` is set on a row set aside. */
export const ASIDE_COLUMNS: string = "set_aside_seq, damage, set_aside_at, damage_reported";

/** The columns of an inbox row, that {@link inboundOf} reads. */
export const INBOX_COLUMNS: string =
  `ord, id, kind, chat_id, provider, payload, received_at, state, attempts, next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, error, updated_at, ${ASIDE_COLUMNS}`;

/** The columns of the record fields that the stored-record checks name. */
const FIELD_COLUMNS: Record<string, string> = {
  chatId: "chat_id",
  receivedAt: "received_at",
  nextAttemptAt: "next_attempt_at",
  lease: "lease_*",
  updatedAt: "updated_at",
  contentHash: "content_hash",
  inboundId: "inbound_id",
  messageId: "message_id",
  createdAt: "created_at",
};

/** A stored-record check's problem (`field "chatId" must be …`) in terms of the table (`column chat_id must be …`). */
const columnProblem = (problem: string): Damage =>
  new Damage(problem.replace(/^field "(\w+)"/, (_, field: string) => `column ${FIELD_COLUMNS[field] ?? field}`));

const LEASE_COLUMNS: readonly (readonly [string, (v: unknown) => boolean, string])[] = [
  ["lease_owner", (v) => typeof v === "string", "a string"],
  ["lease_incarnation", (v) => typeof v === "string", "a string"],
  ["lease_token", (v) => Number.isSafeInteger(v) && (v as number) > 0, "a positive integer"],
  ["lease_expires_at", (v) => typeof v === "number" && Number.isFinite(v), "a finite number"],
];

/** What is wrong with the row's columns before its fields are checked: a BLOB anywhere, a partial lease. */
function columnsProblem(row: Row): Damage | null {
  for (const column in row) {
    if ((row[column] as unknown) instanceof Uint8Array) return new Damage(`column ${column} holds a BLOB`);
  }
  if (LEASE_COLUMNS.every(([column]) => row[column] === null)) return null;
  for (const [column, ok, expected] of LEASE_COLUMNS) {
    if (!ok(row[column])) {
      return new Damage(`column ${column} must be ${expected} (the lease columns are all set or all NULL), got ${describeJsonKind(row[column])}`);
    }
  }
  return null;
}

/** The lease of a row whose lease columns passed {@link columnsProblem}. */
const storedLease = (row: Row): Lease | null => (row.lease_owner === null ? null : leaseOf(row));

/** The record of an inbox row, or what is wrong with the row. */
export function inboundOf(row: Row): InboundRecord | Damage {
  const columns = columnsProblem(row);
  if (columns) return columns;
  const payload = jsonOf(row.payload, "payload");
  if (payload instanceof Damage) return payload;
  const record = {
    id: row.id,
    kind: row.kind,
    chatId: row.chat_id,
    provider: row.provider,
    payload,
    receivedAt: row.received_at,
    state: row.state,
    attempts: row.attempts,
    nextAttemptAt: row.next_attempt_at,
    lease: storedLease(row),
    fence: row.fence,
    error: row.error,
    updatedAt: row.updated_at,
  };
  const problem = storedInboundProblem(record);
  return problem === null ? record as InboundRecord : columnProblem(problem);
}

/** The columns of an outbox row, that {@link outboxOf} reads. */
export const OUTBOX_COLUMNS: string =
  `seq, key, chat_id, content, content_hash, inbound_id, state, attempts, next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, uncalled_fence, message_id, error, created_at, updated_at, ${ASIDE_COLUMNS}`;

/** The entry of an outbox row, or what is wrong with the row. */
export function outboxOf(row: Row): OutboxEntry | Damage {
  const columns = columnsProblem(row);
  if (columns) return columns;
  const content = jsonOf(row.content, "content");
  if (content instanceof Damage) return content;
  const uncalled = row.uncalled_fence ?? null;
  if (uncalled !== null && !Number.isSafeInteger(uncalled)) {
    return new Damage(`column uncalled_fence must be NULL or an integer, got ${describeJsonKind(uncalled)}`);
  }
  const entry = {
    key: row.key,
    chatId: row.chat_id,
    content,
    contentHash: row.content_hash,
    inboundId: row.inbound_id,
    state: row.state,
    attempts: row.attempts,
    nextAttemptAt: row.next_attempt_at,
    lease: storedLease(row),
    fence: row.fence,
    // Uncalled exactly when `uncalled_fence` is the fence; NULL (a row older than the marker) reads as called.
    called: uncalled === null || uncalled !== row.fence,
    messageId: row.message_id,
    error: row.error,
    seq: row.seq,
    createdAt: row.created_at,
    updatedAt: row.updated_at,
  };
  const problem = storedOutboxProblem(entry);
  return problem === null ? entry as OutboxEntry : columnProblem(problem);
}

/** The `uncalled_fence` column of `entry`: its fence while uncalled, else NULL (see {@link outboxOf}). */
export function uncalledFence(entry: OutboxEntry): number | null {
  return entry.called ? null : entry.fence;
}

export function placeholders(n: number): string {
  return new Array(n).fill("?").join(", ");
}
