/**
 * The connection context that the journals, the store and the kv of one
 * backend share: the client, the table names, the schema setup, and the group
 * commit of journal writes in lanes (see "Statements" in `mod.ts`).
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import { nextTurn } from "../../src/runtime/mod.ts";
import { loginFailure } from "./login_error.ts";
import type { PostgresClient, Resolved } from "./options.ts";
import { TableStats } from "./table_stats.ts";
import { migrationSql, NEWER_SCHEMA_MARK, NOW_MS, outboxSql, POSTGRES_SCHEMA_VERSION, tables, type Tables } from "./sql.ts";

export type Row = Record<string, unknown>;

/** Runs one statement (`op` and `table` name it in errors): {@link Context.run}, or one of a {@link Context.transaction}. */
export type RunStatement = (op: string, table: string, text: string, params: unknown[]) => Promise<Row[] & { count?: number }>;

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
  /** Its record's chat, when known. */
  chat?: string;
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
export interface ManyRows {
  kind: string;
  text: string;
  key: string;
  row: Record<string, unknown>;
  /** Writes of one partition (an outbox reserve's chat) never share a statement either. */
  partition?: string;
}

/** Statements one group commit carries at most. */
const MAX_GROUP = 256;

/** Chats of records this process holds, remembered at most (the oldest are forgotten first). */
const MAX_KNOWN_CHATS = 100_000;

/**
 * The lane of a chat among `lanes` (FNV-1a of its id).
 *
 * Group commits under way at once, per backend (option `groupLanes`): one per lane, and each chat's writes
 * go to one lane (by a hash of the chat id). Two groups of one process that touched the same rows could lock
 * them in opposite orders (a group's statements lock their chats' rows statement by statement) and
 * deadlock; every row a journal write locks (its record, its chat's row, the chat's next head) belongs to
 * its chat, so groups of two lanes never wait on each other. A write whose chat this process does not know
 * (a record it never admitted, claimed or reserved) goes to lane 0.
 */
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

/** The group writes whose statement locks their chat's outbox row (in chat order, `COLLATE "C"`, as the column). */
const LOCKS_CHAT_ROW = new Set(["outbox.reserve", "outbox.markSent", "outbox.markFailed"]);

/**
 * The first statement of a group's transaction: the server ends a session
 * left idle in it (its client frozen or cut off before COMMIT) after 5 s,
 * releasing its row locks (the transaction rolls back; its writes were not
 * acknowledged). And no JIT compilation: a due scan's cost estimate grows
 * with a backlog past `jit_above_cost`, and compiling it took about 1 s
 * where running it took tens of ms (each scan of a restart's recovery).
 */
const GROUP_GUARD = "SELECT set_config('idle_in_transaction_session_timeout', '5000', true), set_config('jit', 'off', true)";

/**
 * Whether the client prepares statements: porsager's `prepare` option (on by default). Off, every
 * statement is sent unnamed, which a pooler in transaction mode (PgBouncer) needs.
 * @param sql the client
 * @returns `false` only for a client created with `prepare: false`
 */
export function clientPrepares(sql: PostgresClient): boolean {
  return (sql as { options?: { prepare?: unknown } }).options?.prepare !== false;
}

/** SQLSTATEs of a named prepared statement the server does not have (26000) or already has (42P05). */
const LOST_STATEMENT = /^(26000|42P05)$/;

/**
 * A statement's error as text; a prepared statement the server lost or already has (a pooler in
 * transaction mode hands each transaction another server connection) says what to change.
 */
export function statementError(error: unknown): string {
  const message = errorMessage(error);
  const code = (error as { code?: unknown } | null)?.code;
  if (typeof code === "string" && LOST_STATEMENT.test(code) || /prepared statement "[^"]*" (does not|already) exists?/.test(message)) {
    return `${message} (the client prepares statements, and the server connection changed between them: ` +
      `behind a pooler in transaction mode such as PgBouncer's pool_mode=transaction, create the client with ` +
      `postgres(url, { prepare: false }), or pool in session mode)`;
  }
  return message;
}

/** A connection failure reported by porsager (`CONNECTION_CLOSED`, `CONNECT_TIMEOUT`…) or the socket (`ECONNRESET`…). */
function connectionLost(error: unknown): boolean {
  const code = (error as { code?: unknown } | null)?.code;
  return typeof code === "string" && /^(CONNECT|E[A-Z]+$)/.test(code);
}

/** What the journals, the store and the kv share: the client, the names, the schema setup, the group commit. */
export class Context {
  readonly sql: PostgresClient;
  readonly t: Tables;
  /** Locks the outbox chat rows of a group's writes, in chat order (see `#commit`). */
  readonly #chatRowsLock: string;
  readonly purgeBatch: number;
  /** Whether statements are prepared: as the client is configured (`prepare: false` behind a transaction pooler). */
  readonly prepare: boolean;
  readonly #lanes: { queued: QueuedWrite[]; busy: boolean; scheduled: boolean }[];
  /** The chat of each record this process admitted, claimed or reserved and has not settled (`table\0id`). */
  readonly #chats = new Map<string, string>();
  /** The test clock (option `clock`), or `undefined`: statements use the server's. */
  readonly #clock: (() => number) | undefined;
  /** Statistics of the journals' tables after a burst of writes (each claim scan may check them). */
  readonly stats: TableStats;

  constructor(options: Resolved) {
    this.sql = options.sql;
    this.t = tables(options.schema, options.prefix);
    this.purgeBatch = options.purgeBatch;
    this.#clock = options.clock;
    this.prepare = options.clock === undefined && clientPrepares(options.sql);
    this.#lanes = Array.from({ length: options.lanes }, () => ({ queued: [] as QueuedWrite[], busy: false, scheduled: false }));
    this.stats = new TableStats(this.sql, [this.t.inbox, this.t.outbox], () => this.ready());
    this.#chatRowsLock = outboxSql(this.t).lockChats;
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
      const message = errorMessage(error);
      const at = message.indexOf(NEWER_SCHEMA_MARK);
      if (at >= 0) {
        const version = message.slice(at + NEWER_SCHEMA_MARK.length).trim();
        throw new Error(
          `Postgres ${this.where} has schema version ${version}, written by a newer @botmesh/durable; ` +
            `this version supports up to schema version ${POSTGRES_SCHEMA_VERSION}: upgrade @botmesh/durable to use it`,
          { cause: error },
        );
      }
      const login = loginFailure(error, this.sql);
      if (login !== null) throw new Error(`${login}; cannot set up ${this.where}`, { cause: error });
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
   * on one connection; one such transaction per lane (see {@link laneOf}) runs
   * at once, and the writes that arrive meanwhile wait for the next one. A
   * write resolves once its transaction committed. When the transaction
   * fails with a server error (it rolled back: a deadlock with another
   * replica, a constraint), each write runs again alone; when the connection
   * is lost (the commit's fate is unknown), each write rejects with that error.
   * A lone write, or a client without `begin`, runs as its own statement.
   */
  write(op: string, table: string, text: string, params: unknown[], many?: ManyRows, chat?: string): Promise<Row[] & { count?: number }> {
    if (typeof this.sql.begin !== "function") return this.run(op, table, text, params);
    const known = chat ?? this.#chats.get(`${table}\u0000${String(params[0])}`);
    const lane = this.#lanes[laneOf(known, this.#lanes.length)]!;
    return new Promise((resolve, reject) => {
      lane.queued.push({ op, table, text, params, ...(many ? { many } : {}), ...(known !== undefined ? { chat: known } : {}), resolve, reject });
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
    // A statement that settles or reserves a send locks its chat's outbox row, then the chat's entries (its
    // own, the next head); heartbeats and announcements lock only entries this process holds, which no other
    // replica's write waits for. Two statements of a group lock theirs one after the other, so another
    // replica's group could hold what this one waits for and wait for what it holds: a deadlock, which the
    // server breaks after deadlock_timeout (1 s, a stall of both groups' heartbeats too). Such a group first
    // locks the outbox rows of every chat it writes to, in chat order: chat rows before entries, and chat
    // rows in chat order, in every group.
    const outboxStatements = statements.filter((st) => st.writes.some((w) => w.table === this.t.outbox));
    if (outboxStatements.length > 1 && outboxStatements.some((st) => st.writes.some((w) => LOCKS_CHAT_ROW.has(w.op)))) {
      const chats = [...new Set(group.filter((w) => w.table === this.t.outbox && w.chat !== undefined).map((w) => w.chat!))];
      if (chats.length > 0) statements.unshift({ text: this.#chatRowsLock, params: [JSON.stringify(chats)], writes: [] });
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
      const message = statementError(error);
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
        void Promise.allSettled(statements.map((st) => tx.unsafe(this.#timed(st.text), st.params, { prepare: this.prepare }))).then((outcomes) => {
          // The connection was lost: issue nothing more on it (porsager would write the ROLLBACK to a
          // closed socket and throw out of a timer); `begin` rejects with the loss on its own.
          if (outcomes.some((o) => o.status === "rejected" && connectionLost(o.reason))) return;
          // A statement's server error made COMMIT a rollback, and `begin` rejects with that error.
          resolve(outcomes.map((o) => (o.status === "fulfilled" ? o.value : [])));
        });
      })
    );
  }

  /**
   * Runs `fn` in one transaction on one connection (`begin`), after the schema setup: `fn` runs its
   * statements with the `run` it is given, and the transaction commits when `fn` resolves (rolls back
   * when it rejects). Like a group commit, the transaction sets `idle_in_transaction_session_timeout`,
   * so that a client frozen before its COMMIT does not hold row locks for ever. A client without
   * `begin` runs each statement as its own transaction. `op` and `table` name a failed COMMIT.
   */
  async transaction<T>(op: string, table: string, fn: (run: RunStatement) => Promise<T>): Promise<T> {
    await this.ready();
    if (typeof this.sql.begin !== "function") return await fn((o, t, text, params) => this.run(o, t, text, params));
    const named = new WeakSet<object>();
    try {
      return await this.sql.begin(async (tx) => {
        // Pipelined before fn's first statement, as in a group (its failure fails that statement).
        void tx.unsafe(GROUP_GUARD).then(() => {}, () => {});
        return await fn(async (o, t, text, params) => {
          try {
            return await tx.unsafe(this.#timed(text), params, { prepare: this.prepare });
          } catch (error) {
            // The connection was lost: issue nothing more on it (porsager would write the ROLLBACK to a
            // closed socket and throw out of a timer); `begin` rejects with the loss on its own.
            if (connectionLost(error)) return await new Promise<never>(() => {});
            const failure = new Error(`Postgres ${o} on ${t} failed: ${statementError(error)}`, { cause: error });
            named.add(failure);
            throw failure;
          }
        });
      }) as T;
    } catch (error) {
      if (typeof error === "object" && error !== null && named.has(error)) throw error;
      throw new Error(`Postgres ${op} on ${table} failed: ${statementError(error)}`, { cause: error });
    }
  }

  /** Runs one prepared statement (`op` and `table` name it in errors) after the schema setup. */
  async run(op: string, table: string, text: string, params: unknown[]): Promise<Row[] & { count?: number }> {
    await this.ready();
    try {
      return await this.sql.unsafe(this.#timed(text), params, { prepare: this.prepare });
    } catch (error) {
      throw new Error(`Postgres ${op} on ${table} failed: ${statementError(error)}`, { cause: error });
    }
  }

  /** `text` with the server's time replaced by the test clock's, when there is one. */
  #timed(text: string): string {
    return this.#clock === undefined ? text : text.replaceAll(NOW_MS, `(${Math.floor(this.#clock())})::bigint`);
  }
}
