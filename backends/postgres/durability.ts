/**
 * PostgresDurability, PostgresStore and PostgresKv (see `mod.ts` for the user
 * documentation; the SQL text is in `sql.ts`).
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import { nextTurn } from "../../src/runtime/mod.ts";
import {
  type BackendScope,
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  DamagedRecordError,
  type DurabilityBackend,
  type DurableKv,
  type FailOutcome,
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type JsonValue,
  type KvEntry,
  type Lease,
  type ListOptions,
  type NewInboundRecord,
  type NewOutboxEntry,
  type OutboxClaim,
  type OutboxEntry,
  type OutboxJournal,
  type OutboxState,
  type ReserveResult,
  StaleLeaseError,
} from "../../src/contract.ts";
import {
  checkClaim,
  checkFinite,
  checkListFilter,
  checkNewInbound,
  checkNewOutbox,
  checkOutcome,
  checkId,
  checkString,
  normalizeList,
} from "../../src/rules.ts";
import { sessionEntry, type SessionStore } from "../../src/store.ts";
import { Damage, jsonOf, storedInboundProblem, storedOutboxProblem } from "../../src/stored_records.ts";
import { showValue as show } from "../../src/show.ts";
import {
  type AsideSql,
  IDENTIFIER,
  inboxSql,
  type InboxSql,
  kvSql,
  type KvSql,
  LONGEST_SUFFIX,
  migrationSql,
  NEWER_SCHEMA_MARK,
  outboxSql,
  type OutboxSql,
  POSTGRES_SCHEMA_VERSION,
  sessionSql,
  type SessionSql,
  tables,
  type Tables,
} from "./sql.ts";

export { POSTGRES_SCHEMA_VERSION } from "./sql.ts";

/**
 * The part of a [postgres](https://github.com/porsager/postgres) (porsager)
 * client this module uses. A `postgres()` client (`Sql`) has it; declared
 * here so that this module does not depend on the driver's types.
 */
export interface PostgresClient {
  /**
   * Runs one statement with `$1`… parameters.
   * @returns the rows (an array; porsager's `RowList` also has `count`)
   */
  // deno-lint-ignore no-explicit-any
  unsafe(query: string, parameters?: any[], options?: { prepare?: boolean }): PromiseLike<any>;
  /**
   * Runs `fn`'s statements in one transaction on one connection (porsager's
   * `sql.begin`; its statements are pipelined). Without it, journal writes
   * are not group-committed: each is its own transaction.
   */
  // deno-lint-ignore no-explicit-any
  begin?(fn: (tx: PostgresClient) => PromiseLike<any>): PromiseLike<any>;
}

/** Options of {@link PostgresDurability}, {@link PostgresStore} and {@link PostgresKv}. */
export interface PostgresOptions {
  /** A porsager `postgres()` client (required). It stays the caller's: this module never ends it. */
  sql: PostgresClient;
  /** The schema of the tables (default `"public"`; created when missing): `^[a-z_][a-z0-9_]*$`. */
  schema?: string;
  /** Prepended to the table names (default `"botmesh_"`): `^[a-z_][a-z0-9_]*$`, at most 40 characters. */
  tablePrefix?: string;
  /** Rows one purge statement deletes at most (default 1000; 1 to 100000). */
  purgeBatchSize?: number;
  /**
   * Group commits of journal writes under way at once (default 1; 1 to 16), each on its own connection;
   * each chat's writes go to one of them (see "Statements" in the module documentation).
   */
  groupLanes?: number;
}

/** Options of {@link PostgresDurability}. */
export type PostgresDurabilityOptions = PostgresOptions;
/** Options of {@link PostgresStore}. */
export type PostgresStoreOptions = PostgresOptions;
/** Options of {@link PostgresKv}. */
export type PostgresKvOptions = PostgresOptions;

const OPTION_NAMES = ["sql", "schema", "tablePrefix", "purgeBatchSize", "groupLanes"] as const;
const DEFAULT_PURGE_BATCH = 1000;
const MAX_PURGE_BATCH = 100_000;
/** Postgres cuts identifiers at 63 bytes; the prefix leaves room for the longest table/index suffix. */
const MAX_PREFIX = 63 - LONGEST_SUFFIX - 4;
/** Chat rows are dropped by `purge` only when untouched for at least this long. */
const CHAT_ROW_MIN_AGE_MS = 3_600_000;
/** Expired session values are swept at most this often (on a `set`). */
const SESSION_SWEEP_MS = 60_000;
/** Durations are clamped to this (about 31,000 years), so that `now + ms` stays a safe integer. */
const MAX_DURATION_MS = 1e15;
/** The `backend` of a {@link DamagedRecord}: the journals' `name`. */
const BACKEND = "postgres";

interface Resolved {
  sql: PostgresClient;
  schema: string;
  prefix: string;
  purgeBatch: number;
  lanes: number;
}

function resolveOptions(options: unknown): Resolved {
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`Postgres options must be an object with a "sql" client, got ${show(options)}`);
  }
  const o = options as Record<string, unknown>;
  checkKnownOptions(o, OPTION_NAMES, "Postgres option");
  const sql = o.sql;
  if (
    (typeof sql !== "function" && (typeof sql !== "object" || sql === null)) ||
    typeof (sql as { unsafe?: unknown }).unsafe !== "function"
  ) {
    throw new TypeError(`Postgres option "sql" must be a postgres (porsager) client, as postgres(url) returns, got ${show(sql)}`);
  }
  const schema = o.schema ?? "public";
  if (typeof schema !== "string") throw new TypeError(`Postgres option "schema" must be a string, got ${show(schema)}`);
  if (!IDENTIFIER.test(schema) || schema.length > 63) {
    throw new RangeError(
      `Postgres option "schema" must match ^[a-z_][a-z0-9_]*$ (lowercase letters, digits, "_"; at most 63), got ${show(schema)}`,
    );
  }
  const prefix = o.tablePrefix ?? "botmesh_";
  if (typeof prefix !== "string") throw new TypeError(`Postgres option "tablePrefix" must be a string, got ${show(prefix)}`);
  if (!IDENTIFIER.test(prefix) || prefix.length > MAX_PREFIX) {
    throw new RangeError(
      `Postgres option "tablePrefix" must match ^[a-z_][a-z0-9_]*$ (lowercase letters, digits, "_"; at most ${MAX_PREFIX}), got ${
        show(prefix)
      }`,
    );
  }
  const batch = o.purgeBatchSize ?? DEFAULT_PURGE_BATCH;
  if (typeof batch !== "number") {
    throw new TypeError(`Postgres option "purgeBatchSize" must be a number, got ${show(batch)}`);
  }
  if (!Number.isInteger(batch) || batch < 1 || batch > MAX_PURGE_BATCH) {
    throw new RangeError(`Postgres option "purgeBatchSize" must be an integer from 1 to ${MAX_PURGE_BATCH}, got ${show(batch)}`);
  }
  const lanes = o.groupLanes ?? DEFAULT_LANES;
  if (typeof lanes !== "number") throw new TypeError(`Postgres option "groupLanes" must be a number, got ${show(lanes)}`);
  if (!Number.isInteger(lanes) || lanes < 1 || lanes > MAX_LANES) {
    throw new RangeError(`Postgres option "groupLanes" must be an integer from 1 to ${MAX_LANES}, got ${show(lanes)}`);
  }
  return { sql: sql as PostgresClient, schema, prefix, purgeBatch: batch, lanes };
}

// ---- the connection context ------------------------------------------------------

type Row = Record<string, unknown>;

/** Schema setups under way or done, per client and schema + prefix (one per process for all backends on them). */
const setups = new WeakMap<object, Map<string, Promise<void>>>();

/** A journal write waiting for its group commit. */
interface QueuedWrite {
  op: string;
  table: string;
  text: string;
  params: unknown[];
  /** How this write joins the other writes of its kind in one multi-row statement, when it can. */
  many?: ManyRows;
  resolve: (rows: Row[] & { count?: number }) => void;
  reject: (error: unknown) => void;
}

/**
 * A write that a group may carry in one multi-row statement with the other
 * writes of its `kind`: `text` takes `$1`, a JSON array of the writes' `row`s
 * (`json_to_recordset`: no array types, which the client may not know), and
 * returns each changed row with its write's `key` as `mkey`. Two writes of
 * one key never share a statement (each must see the other's effect).
 */
interface ManyRows {
  kind: string;
  text: string;
  key: string;
  row: Record<string, unknown>;
  /** Writes of one partition (an outbox reserve's chat) never share a statement either. */
  partition?: string;
}

/** Statements one group commit carries at most. */
const MAX_GROUP = 256;
/**
 * Group commits under way at once, per backend (option `groupLanes`): one per lane, and each chat's writes
 * go to one lane (by a hash of the chat id). Two groups of one process that touched the same rows could lock
 * them in opposite orders (a group's statements lock their chats' rows statement by statement) and
 * deadlock; every row a journal write locks (its record, its chat's row, the chat's next head) belongs to
 * its chat, so groups of two lanes never wait on each other. A write whose chat this process does not know
 * (a record it never admitted, claimed or reserved) goes to lane 0.
 */
const DEFAULT_LANES = 1;
const MAX_LANES = 16;
/** Chats of records this process holds, remembered at most (the oldest are forgotten first). */
const MAX_KNOWN_CHATS = 100_000;

/** The lane of a chat among `lanes` (FNV-1a of its id). */
function laneOf(chat: string | undefined, lanes: number): number {
  if (chat === undefined || lanes === 1) return 0;
  let h = 0x811c9dc5;
  for (let i = 0; i < chat.length; i++) h = Math.imul(h ^ chat.charCodeAt(i), 0x01000193);
  return (h >>> 0) % lanes;
}

/**
 * Whether a failed transaction is known to have rolled back: the server
 * answered with an error other than a connection failure (class 08) or an
 * operator intervention that ends the session (class 57, but for 57014, a
 * statement canceled on a live connection). A lost connection leaves the
 * commit's fate unknown.
 */
function rolledBack(error: unknown): boolean {
  const code = (error as { code?: unknown } | null)?.code;
  return (error as { name?: unknown } | null)?.name === "PostgresError" && typeof code === "string" &&
    /^[0-9A-Z]{5}$/.test(code) && !code.startsWith("08") && (!code.startsWith("57") || code === "57014");
}

/**
 * The first statement of a group's transaction: the server ends a session
 * left idle in it (its client frozen or cut off before COMMIT) after 5 s,
 * releasing its row locks (the transaction rolls back; its writes were not
 * acknowledged).
 */
const GROUP_GUARD = "SET LOCAL idle_in_transaction_session_timeout = 5000";

/** A connection failure reported by porsager (`CONNECTION_CLOSED`, `CONNECT_TIMEOUT`…) or the socket (`ECONNRESET`…). */
function connectionLost(error: unknown): boolean {
  const code = (error as { code?: unknown } | null)?.code;
  return typeof code === "string" && /^(CONNECT|E[A-Z]+$)/.test(code);
}

/** What the journals, the store and the kv share: the client, the names, the schema setup, the group commit. */
class Context {
  readonly sql: PostgresClient;
  readonly t: Tables;
  readonly purgeBatch: number;
  readonly #lanes: { queued: QueuedWrite[]; busy: boolean; scheduled: boolean }[];
  /** The chat of each record this process admitted, claimed or reserved and has not settled (`table\0id`). */
  readonly #chats = new Map<string, string>();

  constructor(options: Resolved) {
    this.sql = options.sql;
    this.t = tables(options.schema, options.prefix);
    this.purgeBatch = options.purgeBatch;
    this.#lanes = Array.from({ length: options.lanes }, () => ({ queued: [] as QueuedWrite[], busy: false, scheduled: false }));
  }

  /** `"schema"."prefix*"`, for errors. */
  get where(): string {
    return `schema ${JSON.stringify(this.t.schema)}, tables ${JSON.stringify(`${this.t.prefix}*`)}`;
  }

  /**
   * Creates or upgrades the schema once per client, schema and prefix (a
   * failed attempt is forgotten, so the next call tries again).
   */
  ready(): Promise<void> {
    let byName = setups.get(this.sql);
    if (!byName) setups.set(this.sql, byName = new Map());
    const key = `${this.t.schema}\u0000${this.t.prefix}`;
    let setup = byName.get(key);
    if (!setup) {
      setup = this.#migrate();
      byName.set(key, setup);
      const map = byName;
      setup.catch(() => {
        if (map.get(key) === setup) map.delete(key);
      });
    }
    return setup;
  }

  async #migrate(): Promise<void> {
    try {
      await this.sql.unsafe(migrationSql(this.t), []);
    } catch (error) {
      const message = error instanceof Error ? error.message : String(error);
      const at = message.indexOf(NEWER_SCHEMA_MARK);
      if (at >= 0) {
        const version = message.slice(at + NEWER_SCHEMA_MARK.length).trim();
        throw new Error(
          `Postgres ${this.where} has schema version ${version}, written by a newer @botmesh/durable; ` +
            `this version supports up to schema version ${POSTGRES_SCHEMA_VERSION}: upgrade @botmesh/durable to use it`,
          { cause: error },
        );
      }
      throw new Error(`Postgres: cannot set up ${this.where}: ${message}`, { cause: error });
    }
    const probe = await this.sql.unsafe("SELECT 1 AS botmesh_probe", []);
    const row = (probe as Row[])[0];
    if (!row || !("botmesh_probe" in row)) {
      throw new Error(
        `Postgres: the client given as "sql" transforms column names (${JSON.stringify(Object.keys(row ?? {}))}); ` +
          `give the backend a client without "transform"`,
      );
    }
  }

  /**
   * Runs one journal write (one statement, `op` and `table` name it in errors)
   * in a group commit: the writes called in one turn of the event loop share
   * one transaction (one commit, one WAL flush), their statements pipelined
   * on one connection; one such transaction per lane (see {@link DEFAULT_LANES}) runs
   * at once, and the writes that arrive meanwhile wait for the next one. A
   * write resolves once its transaction committed. When the transaction
   * fails with a server error (it rolled back: a deadlock with another
   * replica, a constraint), each write runs again alone; when the connection
   * is lost (the commit's fate is unknown), each write rejects with that error.
   * A lone write, or a client without `begin`, runs as its own statement.
   */
  write(op: string, table: string, text: string, params: unknown[], many?: ManyRows, chat?: string): Promise<Row[] & { count?: number }> {
    if (typeof this.sql.begin !== "function") return this.run(op, table, text, params);
    const lane = this.#lanes[laneOf(chat ?? this.#chats.get(`${table}\u0000${String(params[0])}`), this.#lanes.length)]!;
    return new Promise((resolve, reject) => {
      lane.queued.push({ op, table, text, params, ...(many ? { many } : {}), resolve, reject });
      this.#schedule(lane);
    });
  }

  /** Remembers the chat of record `id` of `table` (held by this process), for the lane of its writes. */
  know(table: string, id: string, chat: string): void {
    const key = `${table}\u0000${id}`;
    if (this.#chats.get(key) === chat) return;
    this.#chats.delete(key);
    this.#chats.set(key, chat);
    if (this.#chats.size > MAX_KNOWN_CHATS) this.#chats.delete(this.#chats.keys().next().value!);
  }

  /** Forgets the chat of a record this process settled. */
  forget(table: string, id: string): void {
    this.#chats.delete(`${table}\u0000${id}`);
  }

  #schedule(lane: { queued: QueuedWrite[]; busy: boolean; scheduled: boolean }): void {
    if (lane.scheduled || lane.queued.length === 0 || lane.busy) return;
    lane.scheduled = true;
    nextTurn(() => {
      lane.scheduled = false;
      if (lane.queued.length === 0 || lane.busy) return;
      lane.busy = true;
      void this.#commit(lane.queued.splice(0, MAX_GROUP)).finally(() => {
        lane.busy = false;
        this.#schedule(lane);
      });
    });
  }

  async #commit(group: QueuedWrite[]): Promise<void> {
    const alone = (w: QueuedWrite) => this.run(w.op, w.table, w.text, w.params).then(w.resolve, w.reject);
    if (group.length === 1) return void await alone(group[0]!);
    // The statements: one per write, or one per kind of mergeable writes (at its first write's place).
    // A write joins its kind's statement (placed earlier) only when no earlier write of the group touched
    // its record (the first parameter of every journal write is the record's id or key): each write still
    // sees the effect of every write called before it on the same record.
    type Statement = { text: string; params: unknown[]; writes: QueuedWrite[]; partitions?: Set<string> };
    const statements: Statement[] = [];
    const merged = new Map<string, Statement>();
    const touched = new Set<string>();
    for (const w of group) {
      const record = `${w.table}\u0000${String(w.params[0])}`;
      const seen = touched.has(record);
      touched.add(record);
      const m = w.many;
      const into = m ? merged.get(m.kind) : undefined;
      if (m && into && !seen && (m.partition === undefined || !into.partitions?.has(m.partition))) {
        into.writes.push(w);
        if (m.partition !== undefined) into.partitions!.add(m.partition);
        continue;
      }
      const statement: Statement = { text: w.text, params: w.params, writes: [w] };
      if (m?.partition !== undefined) statement.partitions = new Set([m.partition]);
      if (m) merged.set(m.kind, statement);
      statements.push(statement);
    }
    for (const st of statements) {
      if (st.writes.length < 2) continue;
      st.text = st.writes[0]!.many!.text;
      st.params = [JSON.stringify(st.writes.map((w, i) => ({ ...w.many!.row, i })))];
    }
    let results: (Row[] & { count?: number })[];
    try {
      await this.ready();
      results = await this.#begun(statements);
    } catch (error) {
      if (rolledBack(error)) {
        for (const w of group) await alone(w); // one after another, in call order
        return;
      }
      const message = error instanceof Error ? error.message : String(error);
      for (const w of group) {
        w.reject(new Error(`Postgres ${w.op} on ${w.table} failed: ${message}`, { cause: error }));
      }
      return;
    }
    statements.forEach((st, i) => {
      const rows = results[i]!;
      if (st.writes.length === 1) return void st.writes[0]!.resolve(rows);
      const byKey = new Map<unknown, Row[]>();
      for (const row of rows) {
        const list = byKey.get(row.mkey);
        if (list) list.push(row);
        else byKey.set(row.mkey, [row]);
      }
      for (const w of st.writes) w.resolve(byKey.get(w.many!.key) ?? []);
    });
  }

  /** A group's transaction by `begin` (BEGIN, then the statements pipelined, then COMMIT): each statement's rows. */
  #begun(statements: { text: string; params: unknown[] }[]): PromiseLike<(Row[] & { count?: number })[]> {
    return this.sql.begin!((tx) =>
      new Promise((resolve) => {
        // Row locks are held until COMMIT: a replica frozen before it (a pause, a partition) must not hold
        // them, and every write waiting on them, for ever.
        void tx.unsafe(GROUP_GUARD).then(() => {}, () => {});
        void Promise.allSettled(statements.map((st) => tx.unsafe(st.text, st.params, { prepare: true }))).then((outcomes) => {
          // The connection was lost: issue nothing more on it (porsager would write the ROLLBACK to a
          // closed socket and throw out of a timer); `begin` rejects with the loss on its own.
          if (outcomes.some((o) => o.status === "rejected" && connectionLost(o.reason))) return;
          // A statement's server error made COMMIT a rollback, and `begin` rejects with that error.
          resolve(outcomes.map((o) => (o.status === "fulfilled" ? o.value : [])));
        });
      })
    );
  }

  /** Runs one prepared statement (`op` and `table` name it in errors) after the schema setup. */
  async run(op: string, table: string, text: string, params: unknown[]): Promise<Row[] & { count?: number }> {
    await this.ready();
    try {
      return await this.sql.unsafe(text, params, { prepare: true });
    } catch (error) {
      const message = error instanceof Error ? error.message : String(error);
      throw new Error(`Postgres ${op} on ${table} failed: ${message}`, { cause: error });
    }
  }
}

// ---- rows ------------------------------------------------------------------------

/** A number column (bigint columns arrive as strings); anything else stays as is, for the record check to report. */
function num(v: unknown): unknown {
  if (typeof v === "string" && v !== "" && Number.isFinite(Number(v))) return Number(v);
  if (typeof v === "bigint") return Number(v);
  return v;
}

function numOrNull(v: unknown): unknown {
  return v === null ? null : num(v);
}

/** A whole number of ms for `now + ms` in SQL: rounded up, at least 0, at most {@link MAX_DURATION_MS}. */
function duration(ms: number): number {
  return Math.min(MAX_DURATION_MS, Math.max(0, Math.ceil(ms)));
}

/** Free text for a `text` column, which cannot hold NUL: each NUL becomes U+FFFD. */
function textForPg(text: string): string {
  return text.includes("\u0000") ? text.replaceAll("\u0000", "\ufffd") : text;
}

/** The TypeError of a NUL in a field Postgres `text` stores (it cannot hold one), before anything is written. */
function nulError(what: string): TypeError {
  return new TypeError(`${what} must not contain NUL (\\u0000): a Postgres text column cannot hold it`);
}

/** {@link checkString}, and no NUL (an id, key, chat id, owner…: stored or compared as `text`). */
function pgString(value: unknown, what: string): string {
  checkString(value, what);
  if ((value as string).includes("\u0000")) throw nulError(what);
  return value as string;
}

/** {@link pgString} for an id or a key: also well-formed Unicode (see {@link checkId}). */
function pgId(value: unknown, what: string): string {
  return pgString(checkId(value, what), what);
}

/** {@link checkClaim}, and no NUL in the owner or incarnation. */
function pgClaim(options: ClaimOptions, op: string): void {
  checkClaim(options, op);
  pgString(options.owner, `${op}: option "owner"`);
  pgString(options.incarnation, `${op}: option "incarnation"`);
}

/** {@link checkListFilter}, and no NUL in the chat id or the states. */
function pgListFilter(options: ListOptions<string> | undefined, op: string): void {
  checkListFilter(options, op);
  if (options?.chatId !== undefined) pgString(options.chatId, `${op}: option "chatId"`);
  const state = options?.state;
  if (state !== undefined) for (const item of typeof state === "string" ? [state] : state) pgString(item, `${op}: option "state"`);
}

/** {@link checkNewInbound}, and no NUL in the text fields (the payload is JSON text: its NULs are escaped). */
function pgInbound(record: NewInboundRecord): NewInboundRecord {
  const input = checkNewInbound(record);
  const what = `Inbox record ${JSON.stringify(input.id)}`;
  for (const field of ["id", "chatId", "provider", "kind"] as const) {
    if (input[field].includes("\u0000")) throw nulError(`${what}: field "${field}"`);
  }
  return input;
}

/** {@link checkNewOutbox}, and no NUL in the text fields (the content is JSON text: its NULs are escaped). */
function pgOutbound(entry: NewOutboxEntry): NewOutboxEntry {
  const input = checkNewOutbox(entry);
  const what = `Outbox entry ${JSON.stringify(input.key)}`;
  for (const field of ["key", "chatId", "contentHash", "inboundId"] as const) {
    if (input[field]?.includes("\u0000")) throw nulError(`${what}: field "${field}"`);
  }
  return input;
}

/** Whether `token` can be a stored fencing token (a fractional or huge one never matches: it is stale). */
function tokenOk(token: number): boolean {
  return Number.isSafeInteger(token) && token > 0;
}

/** The JSON of a session or kv `column`, or an error naming the table, row and column. */
function jsonColumn(text: unknown, table: string, key: string, id: unknown, column: string): JsonValue {
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
function written<T>(read: T | Damage, table: string): T {
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
function inboundOf(row: Row, payload?: JsonValue): InboundRecord | Damage {
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
function outboxOf(row: Row, content?: JsonValue): OutboxEntry | Damage {
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

/** The options of `damaged`, checked. */
function damagedOptions(options: DamagedListOptions | undefined, op: string): { unreported: boolean; limit: number } {
  if (options === undefined) return { unreported: false, limit: 100 };
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`${op}: options must be an object, got ${show(options)}`);
  }
  const { unreported = false, limit = 100 } = options;
  if (typeof unreported !== "boolean") throw new TypeError(`${op}: option "unreported" must be a boolean, got ${show(unreported)}`);
  if (!Number.isSafeInteger(limit) || limit < 0) throw new RangeError(`${op}: option "limit" must be a non-negative integer, got ${show(limit)}`);
  return { unreported, limit };
}

/** Reads of a journal's rows that stop at a damaged row: a due scan or list runs again for what it left, this many times at most. */
const DAMAGED_ROUNDS = 10;
/** A row that changed between its read and its set-aside is read again, this many times at most. */
const SETTLE_TRIES = 5;

/**
 * The damaged rows of one journal (see "Damaged records" in the module
 * documentation): reads that set aside a row they cannot read, the list of
 * the rows set aside, and their reports.
 */
class Aside<T> {
  readonly #c: Context;
  readonly #journal: "inbox" | "outbox";
  readonly #table: string;
  readonly #q: AsideSql;
  readonly #pk: "ord" | "seq";
  readonly #id: "id" | "key";
  readonly #read: (row: Row) => T | Damage;

  constructor(c: Context, journal: "inbox" | "outbox", table: string, q: AsideSql, read: (row: Row) => T | Damage) {
    this.#c = c;
    this.#journal = journal;
    this.#table = table;
    this.#q = q;
    [this.#pk, this.#id] = journal === "inbox" ? ["ord", "id"] : ["seq", "key"];
    this.#read = read;
  }

  #error(row: Row, problem: unknown): DamagedRecordError {
    return new DamagedRecordError({ journal: this.#journal, id: String(row[this.#id]), backend: BACKEND, problem: String(problem) });
  }

  /**
   * The record of `row` (read with its set-aside columns and version), or,
   * when it is damaged, the error naming it, once it is set aside (by this
   * call or another); `null` when the row is gone. The set-aside applies to
   * the version read only: a row that changed since is read again (a few
   * times: one that never stops changing is named but left for a later call).
   */
  async settle(op: string, row: Row): Promise<T | DamagedRecordError | null> {
    let r: Row | undefined = row;
    for (let tries = 1; r; tries++) {
      if (r.set_aside_seq !== null && r.set_aside_seq !== undefined) return this.#error(r, r.damage);
      const read = this.#read(r);
      if (!(read instanceof Damage)) return read;
      const at: unknown[] = [String(r[this.#pk])];
      if ((await this.#run(op, this.#q.setAside, [...at, String(r.xv), read.problem])).length === 1) return this.#error(r, read.problem);
      if (tries === SETTLE_TRIES) return this.#error(r, read.problem); // still changing: a later call sets it aside
      r = (await this.#run(op, this.#q.row, at))[0];
    }
    return null;
  }

  #run(op: string, text: string, params: unknown[]): Promise<Row[] & { count?: number }> {
    return this.#c.run(`${this.#journal}.${op}`, this.#table, text, params);
  }

  async damaged(options: DamagedListOptions | undefined): Promise<DamagedRecord[]> {
    const { unreported, limit } = damagedOptions(options, `${this.#journal}.damaged`);
    if (limit === 0) return [];
    const rows = await this.#run("damaged", this.#q.damaged(unreported), [limit]);
    return rows.map((r) => ({
      journal: this.#journal,
      id: String(r.id),
      backend: BACKEND,
      problem: String(r.damage),
      setAsideAt: Number(r.set_aside_at),
      reported: r.damage_reported === true,
    }));
  }

  async report(id: string): Promise<boolean> {
    pgId(id, `${this.#journal}.reportDamaged: "${this.#id}"`);
    return (await this.#run("reportDamaged", this.#q.report, [id])).length === 1;
  }
}

/** The filter of a `list` as statement parameters. */
function listParams(options: ListOptions<string> | undefined): { chat: boolean; states: string[]; params: unknown[]; limit: number } | null {
  const { states, chatId, limit } = normalizeList(options);
  if (limit === 0 || (states !== null && states.size === 0)) return null;
  const list = states === null ? [] : [...states];
  const params: unknown[] = [];
  if (chatId !== undefined) params.push(chatId);
  params.push(...list, limit);
  return { chat: chatId !== undefined, states: list, params, limit };
}

/**
 * The record a claim returned, when it read back as the row the claim wrote: not damaged, not changed since
 * (set aside, claimed again) by another call while it was read again.
 */
function leasedBy<T extends { fence: number; state: string }>(read: T | DamagedRecordError | null, row: Row | undefined): T | null {
  if (read === null || read instanceof DamagedRecordError || !row) return null;
  return read.fence === num(row.fence) && read.state === row.state ? read : null;
}

/**
 * The records of a list (`query`, a page of at most `limit` rows), the damaged rows set aside: when a full
 * page held one, the page is read again (without it) so that it holds as many records as the limit allows.
 */
async function listed<T>(aside: Aside<T>, limit: number, query: () => Promise<Row[]>): Promise<T[]> {
  let records: T[] = [];
  for (let round = 0, again = true; again && round < DAMAGED_ROUNDS; round++) {
    const rows = await query();
    records = [];
    let damaged = false;
    for (const row of rows) {
      const read = await aside.settle("list", row);
      if (read instanceof DamagedRecordError) damaged = true;
      else if (read !== null) records.push(read);
    }
    again = damaged && rows.length >= limit;
  }
  return records;
}

/** Runs `step` (one bounded delete) until it deletes fewer than `batch` rows. @returns the total */
async function inBatches(batch: number, step: () => Promise<number>): Promise<number> {
  let total = 0;
  for (;;) {
    const n = await step();
    total += n;
    if (n < batch) return total;
  }
}

// ---- the journals ----------------------------------------------------------------

class PgInbox implements InboxJournal {
  readonly #c: Context;
  readonly #q: InboxSql & AsideSql;
  readonly #t: string;
  readonly #aside: Aside<InboundRecord>;

  constructor(c: Context) {
    this.#c = c;
    this.#q = inboxSql(c.t);
    this.#t = c.t.inbox;
    this.#aside = new Aside(c, "inbox", this.#t, this.#q, (row) => inboundOf(row));
  }

  #run(op: string, text: string, params: unknown[]): Promise<Row[] & { count?: number }> {
    return this.#c.run(`inbox.${op}`, this.#t, text, params);
  }

  /** A write that joins the group commit (see `Context.write`); `chat` when the caller knows it. */
  #write(op: string, text: string, params: unknown[], many?: ManyRows, chat?: string): Promise<Row[] & { count?: number }> {
    return this.#c.write(`inbox.${op}`, this.#t, text, params, many, chat);
  }

  async admit(record: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null> {
    const input = pgInbound(record); // a TypeError naming the field, before anything is written
    if (lease !== undefined) pgClaim(lease, "inbox.admit");
    const params = [
      input.id,
      input.kind,
      input.chatId,
      input.provider,
      JSON.stringify(input.payload),
      input.receivedAt,
      lease !== undefined,
      lease?.owner ?? null,
      lease?.incarnation ?? null,
      duration(lease?.leaseMs ?? 0),
    ] as const;
    const [id, kind, chat_id, provider, payload, received_at, leased, owner, inc, lease_ms] = params;
    const rows = await this.#write("admit", this.#q.admit, [...params], {
      kind: "inbox.admit",
      text: this.#q.admitMany,
      key: id,
      row: { id, kind, chat_id, provider, payload, received_at, leased, owner, inc, lease_ms },
    }, chat_id);
    if (rows.length && lease !== undefined) this.#c.know(this.#t, id, chat_id);
    return rows.length ? written(inboundOf(rows[0]!, input.payload), this.#t) : null;
  }

  async claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    pgId(id, `inbox.claim: "id"`);
    pgClaim(options, "inbox.claim");
    const text = options.reclaimOwn ? this.#q.claimReclaim : this.#q.claim;
    const rows = await this.#run("claim", text, [options.owner, options.incarnation, duration(options.leaseMs), id]);
    const read = rows.length ? await this.#aside.settle("claim", rows[0]!) : null;
    const record = read instanceof DamagedRecordError ? null : leasedBy(read, rows[0]);
    if (record) this.#c.know(this.#t, record.id, record.chatId);
    return record;
  }

  async claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    pgClaim(options, "inbox.claimDue");
    checkFinite(options.limit, `inbox.claimDue: option "limit"`);
    if (!(options.limit > 0)) return [];
    const text = options.reclaimOwn ? this.#q.claimDueReclaim : this.#q.claimDue;
    const limit = Math.min(Math.ceil(options.limit), 1_000_000);
    const good: { ord: number; record: InboundRecord }[] = [];
    // Each row is read on its own: a damaged one is set aside (see "Damaged records" in the module
    // documentation), the others are returned, and the scan runs again for what it left.
    for (let round = 0, damaged = true; damaged && good.length < limit && round < DAMAGED_ROUNDS; round++) {
      damaged = false;
      const rows = await this.#run("claimDue", text, [options.owner, options.incarnation, duration(options.leaseMs), limit - good.length]);
      for (const row of rows) {
        const read = await this.#aside.settle("claimDue", row);
        if (read instanceof DamagedRecordError) damaged = true;
        const record = leasedBy(read, row);
        if (record) {
          good.push({ ord: Number(row.ord), record });
          this.#c.know(this.#t, record.id, record.chatId);
        }
      }
    }
    // An UPDATE returns rows in no particular order: arrival order, as the scan picked them.
    return good.sort((a, b) => a.record.receivedAt - b.record.receivedAt || a.ord - b.ord).map((item) => item.record);
  }

  /** `many`: the multi-row statement of the write's kind, and the row's columns besides `id` and `token`. */
  async #fenced(op: string, text: string, id: string, token: number, more: unknown[], many?: [string, Record<string, unknown>]): Promise<boolean> {
    pgId(id, `inbox.${op}: "id"`);
    checkFinite(token, `inbox.${op}: "token"`);
    if (!tokenOk(token)) return false;
    const rows = await this.#write(op, text, [id, token, ...more], many ? { kind: `inbox.${op}`, text: many[0], key: id, row: { id, token, ...many[1] } } : undefined);
    return rows.length === 1;
  }

  async heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `inbox.heartbeat: "leaseMs"`);
    const ms = duration(leaseMs);
    return await this.#fenced("heartbeat", this.#q.heartbeat, id, token, [ms], [this.#q.heartbeatMany, { lease_ms: ms }]);
  }

  async complete(id: string, token: number): Promise<void> {
    const done = await this.#fenced("complete", this.#q.complete, id, token, [], [this.#q.completeMany, {}]);
    this.#c.forget(this.#t, id);
    if (!done) throw new StaleLeaseError("inbox", id, token);
  }

  async fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    checkOutcome(outcome, "inbox.fail");
    const dead = outcome.dead === true;
    const retry = dead ? 0 : duration((outcome as { retryInMs: number }).retryInMs);
    const failed = await this.#fenced("fail", this.#q.fail, id, token, [dead, textForPg(outcome.error), retry]);
    this.#c.forget(this.#t, id);
    if (!failed) throw new StaleLeaseError("inbox", id, token);
  }

  async get(id: string): Promise<InboundRecord | null> {
    pgId(id, `inbox.get: "id"`);
    const rows = await this.#run("get", this.#q.get, [id]);
    const read = rows.length ? await this.#aside.settle("get", rows[0]!) : null;
    if (read instanceof DamagedRecordError) throw read;
    return read;
  }

  list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    pgListFilter(options, "inbox.list");
    const filter = listParams(options);
    if (!filter) return Promise.resolve([]);
    return listed(this.#aside, filter.limit, () => this.#run("list", this.#q.list(filter.chat, filter.states.length), filter.params));
  }

  async replay(id: string): Promise<boolean> {
    pgId(id, `inbox.replay: "id"`);
    return (await this.#run("replay", this.#q.replay, [id])).length === 1;
  }

  async purge(olderThanMs: number): Promise<number> {
    checkFinite(olderThanMs, `inbox.purge: "olderThanMs"`);
    const older = Math.max(-MAX_DURATION_MS, Math.min(MAX_DURATION_MS, Math.floor(olderThanMs)));
    const batch = this.#c.purgeBatch;
    return await inBatches(batch, async () => (await this.#run("purge", this.#q.purge, [older, batch])).count ?? 0);
  }

  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#aside.damaged(options);
  }

  reportDamaged(id: string): Promise<boolean> {
    return this.#aside.report(id);
  }
}

class PgOutbox implements OutboxJournal {
  readonly #c: Context;
  readonly #q: OutboxSql & AsideSql;
  readonly #t: string;
  readonly #aside: Aside<OutboxEntry>;

  constructor(c: Context) {
    this.#c = c;
    this.#q = outboxSql(c.t);
    this.#t = c.t.outbox;
    this.#aside = new Aside(c, "outbox", this.#t, this.#q, (row) => outboxOf(row));
  }

  #run(op: string, text: string, params: unknown[]): Promise<Row[] & { count?: number }> {
    return this.#c.run(`outbox.${op}`, this.#t, text, params);
  }

  /** A write that joins the group commit (see `Context.write`). */
  #write(op: string, text: string, params: unknown[], many?: ManyRows, chat?: string): Promise<Row[] & { count?: number }> {
    return this.#c.write(`outbox.${op}`, this.#t, text, params, many, chat);
  }

  async reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    const input = pgOutbound(entry); // a TypeError naming the field, before anything is written
    if (lease !== undefined) pgClaim(lease, "outbox.reserve");
    const params = [
      input.key,
      input.chatId,
      JSON.stringify(input.content),
      input.contentHash,
      input.inboundId,
      lease !== undefined,
      lease?.owner ?? null,
      lease?.incarnation ?? null,
      duration(lease?.leaseMs ?? 0),
    ] as const;
    const [key, chat_id, content, content_hash, inbound_id, leased, owner, inc, lease_ms] = params;
    const rows = await this.#write("reserve", this.#q.reserve, [...params], {
      kind: "outbox.reserve",
      text: this.#q.reserveMany,
      key,
      row: { key, chat_id, content, content_hash, inbound_id, leased, owner, inc, lease_ms },
      partition: chat_id,
    }, chat_id);
    const row = rows[0];
    if (row && row.status === "new") {
      const created = written(outboxOf(row, input.content), this.#t);
      if (created.state === "sending") this.#c.know(this.#t, created.key, created.chatId);
      return { status: created.state === "sending" ? "leased" : "queued", entry: created };
    }
    const known = row ? await this.#aside.settle("reserve", row) : null;
    if (known instanceof DamagedRecordError) throw known;
    if (known) return { status: "exists", entry: known };
    // The key was journaled by a concurrent reserve after this statement's snapshot was taken.
    const existing = await this.get(input.key);
    if (!existing) throw new Error(`Postgres outbox.reserve on ${this.#t}: entry ${JSON.stringify(input.key)} vanished`);
    return { status: "exists", entry: existing };
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    pgClaim(options, "outbox.claimDue");
    checkFinite(options.limit, `outbox.claimDue: option "limit"`);
    const limit = Math.max(0, Math.min(Math.ceil(options.limit), 1_000_000));
    const text = this.#q.claimDue(options.reclaimOwn === true, options.resendAmbiguous === true);
    const due: OutboxEntry[] = [];
    const ambiguous: OutboxEntry[] = [];
    // Each row is read on its own: a damaged one is set aside (its chat's next entry gets its due mark, see
    // "Damaged records" in the module documentation), the others are returned, and the scan runs again for
    // what it left (the first round runs whatever the limit: it resolves the lost sends).
    for (let round = 0, damaged = true; damaged && (round === 0 || due.length < limit) && round < DAMAGED_ROUNDS; round++) {
      damaged = false;
      const rows = await this.#run("claimDue", text, [options.owner, options.incarnation, duration(options.leaseMs), limit - due.length]);
      for (const row of rows) {
        const read = await this.#aside.settle("claimDue", row);
        if (read instanceof DamagedRecordError) damaged = true;
        const entry = leasedBy(read, row);
        if (!entry) continue;
        this.#c.know(this.#t, entry.key, entry.chatId);
        if (row.part === "ambiguous") {
          ambiguous.push(entry);
          if (options.resendAmbiguous) due.push(structuredClone(entry));
        } else {
          due.push(entry);
        }
      }
    }
    due.sort((a, b) => a.seq - b.seq);
    ambiguous.sort((a, b) => a.seq - b.seq);
    return { due, ambiguous };
  }

  /** `many`: the multi-row statement of the write's kind, and the row's columns besides `key` and `token`. */
  async #fenced(op: string, text: string, key: string, token: number, more: unknown[], many?: [string, Record<string, unknown>]): Promise<boolean> {
    pgId(key, `outbox.${op}: "key"`);
    checkFinite(token, `outbox.${op}: "token"`);
    if (!tokenOk(token)) return false;
    const rows = await this.#write(op, text, [key, token, ...more], many ? { kind: `outbox.${op}`, text: many[0], key, row: { key, token, ...many[1] } } : undefined);
    return rows.length === 1;
  }

  async heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `outbox.heartbeat: "leaseMs"`);
    const ms = duration(leaseMs);
    return await this.#fenced("heartbeat", this.#q.heartbeat, key, token, [ms], [this.#q.heartbeatMany, { lease_ms: ms }]);
  }

  async markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `outbox.markCalling: "leaseMs"`);
    // One statement, group-committed as a heartbeat is (the hot path: one per send).
    const ms = duration(leaseMs);
    return await this.#fenced("markCalling", this.#q.markCalling, key, token, [ms], [this.#q.markCallingMany, { lease_ms: ms }]);
  }

  async markSent(key: string, token: number, messageId: string): Promise<void> {
    pgString(messageId, `outbox.markSent: "messageId"`);
    const many: [string, Record<string, unknown>] = [this.#q.markSentMany, { message_id: messageId }];
    const sent = await this.#fenced("markSent", this.#q.markSent, key, token, [messageId], many);
    this.#c.forget(this.#t, key);
    if (!sent) throw new StaleLeaseError("outbox", key, token);
  }

  async markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    checkOutcome(outcome, "outbox.markFailed", true);
    if (outcome.ambiguous) {
      // `unknown`, no longer blocking its chat (see markAmbiguous in sql.ts).
      const unknown = await this.#fenced("markFailed", this.#q.markAmbiguous, key, token, [textForPg(outcome.error)]);
      this.#c.forget(this.#t, key);
      if (!unknown) throw new StaleLeaseError("outbox", key, token);
      return;
    }
    const dead = outcome.dead === true;
    const retry = dead ? 0 : duration((outcome as { retryInMs: number }).retryInMs);
    const failed = await this.#fenced("markFailed", this.#q.markFailed, key, token, [dead, textForPg(outcome.error), retry]);
    this.#c.forget(this.#t, key);
    if (!failed) throw new StaleLeaseError("outbox", key, token);
  }

  async get(key: string): Promise<OutboxEntry | null> {
    pgId(key, `outbox.get: "key"`);
    const rows = await this.#run("get", this.#q.get, [key]);
    const read = rows.length ? await this.#aside.settle("get", rows[0]!) : null;
    if (read instanceof DamagedRecordError) throw read;
    return read;
  }

  list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    pgListFilter(options, "outbox.list");
    const filter = listParams(options);
    if (!filter) return Promise.resolve([]);
    return listed(this.#aside, filter.limit, () => this.#run("list", this.#q.list(filter.chat, filter.states.length), filter.params));
  }

  async retry(key: string): Promise<boolean> {
    pgId(key, `outbox.retry: "key"`);
    const rows = await this.#run("retry", this.#q.retry, [key]);
    return Number(rows[0]?.n ?? 0) === 1;
  }

  async discard(key: string): Promise<boolean> {
    pgId(key, `outbox.discard: "key"`);
    return ((await this.#run("discard", this.#q.discard, [key])).count ?? 0) === 1;
  }

  async purge(olderThanMs: number): Promise<number> {
    checkFinite(olderThanMs, `outbox.purge: "olderThanMs"`);
    const older = Math.max(-MAX_DURATION_MS, Math.min(MAX_DURATION_MS, Math.floor(olderThanMs)));
    const batch = this.#c.purgeBatch;
    const total = await inBatches(batch, async () => (await this.#run("purge", this.#q.purge, [older, batch])).count ?? 0);
    // Chat rows of chats with no entry left (see "Per-chat order" in the module documentation).
    const chatAge = Math.max(older, CHAT_ROW_MIN_AGE_MS);
    await inBatches(batch, async () => (await this.#c.run("outbox.purge", this.#c.t.chat, this.#q.purgeChats, [chatAge, batch])).count ?? 0);
    return total;
  }

  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#aside.damaged(options);
  }

  reportDamaged(key: string): Promise<boolean> {
    return this.#aside.report(key);
  }
}

// ---- public classes ----------------------------------------------------------------

/**
 * A durability backend in PostgreSQL: the inbox and outbox journals, shared
 * by any number of replicas on any number of hosts (`scope: "shared"`).
 * Every operation is one statement; fencing, claims and clocks are decided
 * by the server (see the module documentation). Retention is the Bot's
 * `durability.retention` (the engine calls `purge`). A row that does not
 * read back as a record (damaged by a hand edit or a bug elsewhere) is set
 * aside, kept as stored, by the first read that meets it: everything else
 * leaves it out, `get` rejects with a `DamagedRecordError`, and each
 * journal's `damaged()` lists it (see "Damaged records" in the module
 * documentation).
 *
 * The schema is created or upgraded by `open()` (the bot calls it in
 * `start()`), or by the first operation. `close()` leaves the client open:
 * it is the caller's, end it with `await sql.end()`.
 *
 * @example Journals only
 * ```ts ignore
 * import postgres from "postgres";
 * import { PostgresDurability } from "@botmesh/durable/postgres";
 *
 * const sql = postgres("postgres://postgres@127.0.0.1:5432/test", { max: 10, fetch_types: false });
 * const backend = new PostgresDurability({ sql, schema: "bots" });
 * await backend.open();
 * const id = crypto.randomUUID(); // the provider's message id
 * await backend.inbox.admit({
 *   id,
 *   kind: "message",
 *   chatId: "c1",
 *   provider: "test",
 *   payload: { text: "hi" },
 *   receivedAt: Date.now(),
 * });
 * const record = await backend.inbox.claim(id, { owner: "host/bot/1", incarnation: "a", leaseMs: 60_000 });
 * await backend.inbox.complete(id, record!.lease!.token);
 * console.log((await backend.inbox.get(id))?.state); // "done"
 * await sql.end();
 * ```
 */
export class PostgresDurability implements DurabilityBackend {
  /** Always `'postgres'`. */
  readonly name: string = "postgres";
  /** Shared by replicas on many hosts. */
  readonly scope: "shared" = "shared";
  /** The inbound journal. */
  readonly inbox: InboxJournal;
  /** The outbound journal. */
  readonly outbox: OutboxJournal;
  /** The schema of the tables. */
  readonly schema: string;
  /** The prefix of the table names. */
  readonly tablePrefix: string;
  readonly #c: Context;

  /**
   * @param options `sql` (required), `schema`, `tablePrefix`, `purgeBatchSize`, `groupLanes`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: PostgresDurabilityOptions) {
    this.#c = new Context(resolveOptions(options));
    this.schema = this.#c.t.schema;
    this.tablePrefix = this.#c.t.prefix;
    this.inbox = new PgInbox(this.#c);
    this.outbox = new PgOutbox(this.#c);
  }

  /**
   * Creates or upgrades the schema (once per client, schema and prefix; later calls resolve at once).
   * @throws {Error} naming the schema when it cannot be set up or was written by a newer version of the library
   */
  open(): Promise<void> {
    return this.#c.ready();
  }

  /** Nothing to release: the client stays open (it is the caller's). */
  close(): Promise<void> {
    return Promise.resolve();
  }
}

/**
 * The bot's session store in PostgreSQL: values are JSON, with an optional
 * time to live measured by the server clock (an expired value is never
 * returned; expired values are swept at most once a minute on a `set`, or by
 * {@link PostgresStore.purgeExpired}). `durability()` journals the bot's
 * inbox and outbox in the same schema, over the same client.
 *
 * @example With a bot
 * ```ts ignore
 * import postgres from "postgres";
 * import { Bot } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 * import { PostgresStore } from "@botmesh/durable/postgres";
 *
 * const sql = postgres(process.env.DATABASE_URL!, { max: 10, fetch_types: false });
 * const store = new PostgresStore({ sql });
 * const bot = new Bot({
 *   provider: new MockProvider(),
 *   store,
 *   durability: { backend: store.durability(), instanceId: "bot-1", retention: "7d" },
 * });
 * bot.when(/hi/, (ctx) => ctx.reply("hello"));
 * await bot.start();
 * await store.set("chat:1", { step: 2 }, { ttlMs: 60_000 });
 * console.log(await store.get("chat:1")); // { step: 2 }
 * await bot.stop();
 * await sql.end();
 * ```
 */
export class PostgresStore implements SessionStore {
  /** The schema of the tables. */
  readonly schema: string;
  /** The prefix of the table names. */
  readonly tablePrefix: string;
  readonly #options: Resolved;
  readonly #c: Context;
  readonly #q: SessionSql;
  #durability: PostgresDurability | null = null;
  #lastSweep = 0;

  /**
   * @param options `sql` (required), `schema`, `tablePrefix`, `purgeBatchSize`, `groupLanes` (of its `durability()`)
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: PostgresStoreOptions) {
    this.#options = resolveOptions(options);
    this.#c = new Context(this.#options);
    this.#q = sessionSql(this.#c.t);
    this.schema = this.#c.t.schema;
    this.tablePrefix = this.#c.t.prefix;
  }

  /**
   * The durability backend journaling in this store's schema, over the same
   * client (one instance per store).
   * @returns the backend
   */
  durability(): PostgresDurability {
    this.#durability ??= new PostgresDurability({
      sql: this.#options.sql,
      schema: this.#options.schema,
      tablePrefix: this.#options.prefix,
      purgeBatchSize: this.#options.purgeBatch,
      groupLanes: this.#options.lanes,
    });
    return this.#durability;
  }

  /**
   * Sets up the schema now (otherwise the first get/set/delete does).
   * @throws {Error} naming the schema when it cannot be set up
   */
  open(): Promise<void> {
    return this.#c.ready();
  }

  /** Nothing to release: the client stays open (it is the caller's). */
  close(): Promise<void> {
    return Promise.resolve();
  }

  /**
   * @param key the key
   * @returns the value of `key`, or `undefined` when absent or expired
   * @throws {Error} naming the table and key when the stored value is not JSON
   */
  async get(key: string): Promise<JsonValue | undefined> {
    checkId(key, `Session key`);
    const rows = await this.#c.run("session.get", this.#c.t.session, this.#q.get, [key]);
    if (!rows.length) return undefined;
    return jsonColumn(rows[0]!.value, this.#c.t.session, "key", key, "value");
  }

  /**
   * Stores `value` (JSON); with `ttlMs` it expires after that many ms of the server clock.
   * @param key the key
   * @param value a JSON value
   * @param options `ttlMs`: a positive number of ms
   * @throws {RangeError} when `ttlMs` is not a positive number
   * @throws {TypeError} when `value` is not JSON
   */
  async set(key: string, value: JsonValue, options?: { ttlMs?: number }): Promise<void> {
    const { text, ttlMs: ttl } = sessionEntry(key, value, options);
    await this.#c.run("session.set", this.#c.t.session, this.#q.set, [key, text, ttl === null ? null : duration(ttl)]);
    const now = Date.now(); // only paces the sweeps of this process
    if (now - this.#lastSweep >= SESSION_SWEEP_MS) {
      this.#lastSweep = now;
      await this.purgeExpired().catch(() => {});
    }
  }

  /**
   * Deletes `key`.
   * @param key the key
   */
  async delete(key: string): Promise<void> {
    checkId(key, `Session key`);
    await this.#c.run("session.delete", this.#c.t.session, this.#q.delete, [key]);
  }

  /**
   * Deletes every expired value now, in bounded batches.
   * @returns how many were deleted
   */
  async purgeExpired(): Promise<number> {
    const batch = this.#c.purgeBatch;
    return await inBatches(batch, async () => (await this.#c.run("session.purgeExpired", this.#c.t.session, this.#q.sweep, [batch])).count ?? 0);
  }
}

/** The smallest string above every string that starts with `prefix` (code point order = UTF-8 byte order), or `null`. */
function prefixEnd(prefix: string): string | null {
  const points = [...prefix];
  while (points.length > 0) {
    const last = points.pop()!.codePointAt(0)!;
    if (last < 0x10ffff) {
      const next = last === 0xd7ff ? 0xe000 : last + 1;
      return points.join("") + String.fromCodePoint(next);
    }
  }
  return null;
}

/**
 * A {@link DurableKv} in PostgreSQL: one row per key, JSON text values.
 * Versions come from one sequence, so a version is never reused for a key,
 * not even after a delete. Every call is one statement; `list` reads keys in
 * byte order (`COLLATE "C"`) by the primary key; `now()` is the server clock.
 * Use it with `new KvDurability(kv)` or as the shared outbox of
 * `new EventsDurability({ journal, outbox: kv })`.
 *
 * @example Compare-and-set
 * ```ts ignore
 * import postgres from "postgres";
 * import { KvDurability } from "@botmesh/durable/kv";
 * import { PostgresKv } from "@botmesh/durable/postgres";
 *
 * const sql = postgres("postgres://postgres@127.0.0.1:5432/test");
 * const kv = new PostgresKv({ sql, tablePrefix: "app_" });
 * const v1 = await kv.set("a", { n: 1 }, null); // create
 * console.log(await kv.set("a", { n: 2 }, v1)); // a new version
 * console.log(await kv.set("a", { n: 3 }, v1)); // null: the version moved on
 * const backend = new KvDurability(kv, { prefix: "bot-a:" });
 * await sql.end();
 * ```
 */
export class PostgresKv implements DurableKv {
  /** Always `'postgres'`. */
  readonly name: string = "postgres";
  /** Shared by replicas on many hosts. */
  readonly scope: BackendScope = "shared";
  /** The schema of the table. */
  readonly schema: string;
  /** The prefix of the table names. */
  readonly tablePrefix: string;
  readonly #c: Context;
  readonly #q: KvSql;

  /**
   * @param options `sql` (required), `schema`, `tablePrefix`, `purgeBatchSize` (unused here)
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: PostgresKvOptions) {
    this.#c = new Context(resolveOptions(options));
    this.#q = kvSql(this.#c.t);
    this.schema = this.#c.t.schema;
    this.tablePrefix = this.#c.t.prefix;
  }

  /**
   * Sets up the schema now (otherwise the first call does).
   * @throws {Error} naming the schema when it cannot be set up
   */
  open(): Promise<void> {
    return this.#c.ready();
  }

  #run(op: string, text: string, params: unknown[]): Promise<Row[] & { count?: number }> {
    return this.#c.run(`kv.${op}`, this.#c.t.kv, text, params);
  }

  #entry(row: Row): KvEntry {
    return {
      key: row.key as string,
      value: jsonColumn(row.value, this.#c.t.kv, "key", row.key, "value"),
      version: String(row.version),
    };
  }

  /**
   * Reads one key.
   * @param key the key
   * @returns its value and version, or `null`
   */
  async get(key: string): Promise<KvEntry | null> {
    checkId(key, `kv.get: "key"`);
    const rows = await this.#run("get", this.#q.get, [key]);
    return rows.length ? this.#entry(rows[0]!) : null;
  }

  /**
   * Writes one key, optionally only if its version is `expectVersion`.
   * @param key the key
   * @param value a JSON value
   * @param expectVersion `null`: the key must not exist; `undefined`: unconditional
   * @returns the new version, or `null` when the condition failed
   * @throws {TypeError} when `value` is not JSON
   */
  async set(key: string, value: JsonValue, expectVersion?: string | null): Promise<string | null> {
    checkId(key, `kv.set: "key"`);
    if (expectVersion !== undefined && expectVersion !== null) checkString(expectVersion, `kv.set: "expectVersion"`);
    let text: string | undefined;
    try {
      text = JSON.stringify(value);
    } catch (error) {
      throw new TypeError(`kv.set: the value of ${JSON.stringify(key)} is not JSON: ${(error as Error).message}`, { cause: error });
    }
    if (text === undefined) throw new TypeError(`kv.set: the value of ${JSON.stringify(key)} is not JSON, got ${show(value)}`);
    let rows: Row[];
    if (expectVersion === undefined) rows = await this.#run("set", this.#q.setAny, [key, text]);
    else if (expectVersion === null) rows = await this.#run("set", this.#q.setNew, [key, text]);
    else if (!/^[1-9][0-9]{0,17}$/.test(expectVersion)) return null; // never issued
    else rows = await this.#run("set", this.#q.setIf, [key, text, expectVersion]);
    return rows.length ? String(rows[0]!.version) : null;
  }

  /**
   * Deletes one key, optionally only if its version is `expectVersion`.
   * @param key the key
   * @param expectVersion the version it must have (unconditional when `undefined`)
   * @returns whether a key was deleted
   */
  async delete(key: string, expectVersion?: string): Promise<boolean> {
    checkId(key, `kv.delete: "key"`);
    if (expectVersion === undefined) return ((await this.#run("delete", this.#q.delete, [key])).count ?? 0) === 1;
    checkString(expectVersion, `kv.delete: "expectVersion"`);
    if (!/^[1-9][0-9]{0,17}$/.test(expectVersion)) return false;
    return ((await this.#run("delete", this.#q.deleteIf, [key, expectVersion])).count ?? 0) === 1;
  }

  /**
   * Keys starting with `prefix`, in byte-wise ascending order.
   * @param prefix the key prefix
   * @param options `after`: only keys after this one; `limit`: at most this many
   * @returns the entries
   */
  async list(prefix: string, options?: { after?: string; limit?: number }): Promise<KvEntry[]> {
    checkString(prefix, `kv.list: "prefix"`);
    const after = options?.after;
    if (after !== undefined) checkString(after, `kv.list: option "after"`);
    const limit = options?.limit;
    if (limit !== undefined) checkFinite(limit, `kv.list: option "limit"`);
    if (limit !== undefined && limit <= 0) return [];
    const upper = prefixEnd(prefix);
    const params: unknown[] = [prefix];
    if (upper !== null) params.push(upper);
    if (after !== undefined) params.push(after);
    if (limit !== undefined) params.push(Math.min(Math.ceil(limit), 1_000_000_000));
    const rows = await this.#run("list", this.#q.list(upper !== null, after !== undefined, limit !== undefined), params);
    return rows.map((row) => this.#entry(row));
  }

  /**
   * The server clock.
   * @returns ms since epoch
   */
  async now(): Promise<number> {
    const rows = await this.#run("now", this.#q.now, []);
    return Number(rows[0]!.now);
  }
}
