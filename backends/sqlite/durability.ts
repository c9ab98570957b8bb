/**
 * SQLiteDurability and SQLiteStore (see `mod.ts` for the user documentation).
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import { nextTurn } from "../../src/runtime/mod.ts";
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  DamagedRecordError,
  type DamagedRecords,
  type DurabilityBackend,
  type FailOutcome,
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type JsonValue,
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
  acceptsOutcome,
  ACTIVE_INBOX_STATES,
  admitsLeased,
  ambiguousOutbox,
  BLOCKING_OUTBOX_STATES,
  checkClaim,
  checkFinite,
  checkListFilter,
  checkNewInbound,
  checkNewOutbox,
  checkOutcome,
  checkId,
  checkString,
  claimedInbound,
  claimedOutbox,
  doneInbound,
  extendedLease,
  failedFields,
  failedOutbox,
  inboxDueAt,
  isInboxClaimable,
  isLeaseAbandoned,
  holdsChat,
  isLeasedWith,
  newInboundRecord,
  newOutboxEntry,
  normalizeList,
  replayedInbound,
  requeuedOutbox,
  sentOutbox,
  checkDamagedList,
} from "../../src/rules.ts";
import { sessionEntry, type SessionStore } from "../../src/store.ts";
import { Damage, describeJsonKind, jsonOf, storedInboundProblem, storedOutboxProblem } from "../../src/stored_records.ts";
import {
  openSqlite,
  SQLITE_DRIVERS,
  type SqliteDatabase,
  type SqliteDriverName,
  type SqliteRow,
  type SqliteStatement,
  type SqliteValue,
} from "../../src/runtime/sqlite.ts";
import { showValue as show } from "../../src/show.ts";

export type { SqliteDriverName } from "../../src/runtime/sqlite.ts";

/** Options of {@link SQLiteStore} and {@link SQLiteDurability}. */
export interface SQLiteOptions {
  /** Path of the database file (created, with its directory, when missing). Required. */
  file: string;
  /** How long a statement waits for another process's write lock, in ms (default 5000). */
  busyTimeoutMs?: number;
  /**
   * `"full"` (default): each commit (one per group commit) is fsynced and survives a power loss.
   * `"normal"`: faster; safe against a process crash, but a power loss may
   * roll back the last commits.
   */
  synchronous?: "full" | "normal";
  /** `"auto"` (default: by runtime) or `"bun:sqlite"`, `"node:sqlite"`, `"better-sqlite3"`. */
  driver?: "auto" | SqliteDriverName;
  /** Prepended to the table names (default `"botmesh_"`); letters, digits and `_`. */
  tablePrefix?: string;
  /**
   * The clock in ms since epoch (default `() => Date.now()`): every lease
   * expiry, due time, `updatedAt` and session expiry is computed from it.
   * Every process on the file must use the same clock: replace it only for
   * tests in simulated time. It must return a finite number.
   */
  clock?: () => number;
}

/** Options of {@link SQLiteStore}. */
export type SQLiteStoreOptions = SQLiteOptions;
/** Options of {@link SQLiteDurability}. */
export type SQLiteDurabilityOptions = SQLiteOptions;

/** The schema version this version of the library writes. */
export const SQLITE_SCHEMA_VERSION: number = 8;

const OPTION_NAMES = ["file", "busyTimeoutMs", "synchronous", "driver", "tablePrefix", "clock"] as const;
const DEFAULT_BUSY_TIMEOUT_MS = 5000;
/** Expired session values are swept at most this often (on a write). */
const SESSION_SWEEP_MS = 60_000;
/** Rows deleted per transaction by a purge. */
const PURGE_BATCH = 1000;
/** Expired session values deleted per sweep statement. */
const SESSION_SWEEP_BATCH = 500;
/** Most operations one group commit carries, so that other processes get the write lock in between. */
const MAX_BATCH_OPS = 256;
/** A batch takes no further operation once it has held the write lock this long (ms). */
const MAX_BATCH_MS = 5;

interface Resolved {
  file: string;
  busyTimeoutMs: number;
  synchronous: "full" | "normal";
  driver: "auto" | SqliteDriverName;
  prefix: string;
  /** The checked clock. */
  clock: () => number;
}


function resolveOptions(options: unknown): Resolved {
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`SQLite options must be an object with a "file", got ${show(options)}`);
  }
  const o = options as Record<string, unknown>;
  checkKnownOptions(o, OPTION_NAMES, "SQLite option");
  const file = o.file;
  if (typeof file !== "string" || file.length === 0) {
    throw new TypeError(`SQLite option "file" must be a non-empty string, got ${show(file)}`);
  }
  const busy = o.busyTimeoutMs ?? DEFAULT_BUSY_TIMEOUT_MS;
  if (typeof busy !== "number") {
    throw new TypeError(`SQLite option "busyTimeoutMs" must be a number, got ${show(busy)}`);
  }
  if (!Number.isInteger(busy) || busy < 0 || busy > 2_147_483_647) {
    throw new RangeError(`SQLite option "busyTimeoutMs" must be an integer from 0 to 2147483647, got ${show(busy)}`);
  }
  const synchronous = o.synchronous ?? "full";
  if (synchronous !== "full" && synchronous !== "normal") {
    throw new RangeError(`SQLite option "synchronous" must be "full" or "normal", got ${show(synchronous)}`);
  }
  const driver = o.driver ?? "auto";
  if (driver !== "auto" && !(SQLITE_DRIVERS as readonly unknown[]).includes(driver)) {
    throw new RangeError(
      `SQLite option "driver" must be "auto", ${SQLITE_DRIVERS.map((d) => `"${d}"`).join(", ")}, got ${show(driver)}`,
    );
  }
  const prefix = o.tablePrefix ?? "botmesh_";
  if (typeof prefix !== "string") {
    throw new TypeError(`SQLite option "tablePrefix" must be a string, got ${show(prefix)}`);
  }
  if (!/^[A-Za-z_][A-Za-z0-9_]{0,47}$/.test(prefix)) {
    throw new RangeError(
      `SQLite option "tablePrefix" must start with a letter or "_" and hold only letters, digits and "_" (at most 48), got ${
        show(prefix)
      }`,
    );
  }
  const clock = o.clock ?? (() => Date.now());
  if (typeof clock !== "function") {
    throw new TypeError(`SQLite option "clock" must be a function, got ${show(clock)}`);
  }
  const checked = (): number => {
    const time = (clock as () => unknown)();
    if (typeof time !== "number" || !Number.isFinite(time)) {
      throw new TypeError(`SQLite option "clock" must return a finite number, got ${show(time)}`);
    }
    return time;
  };
  return { file, busyTimeoutMs: busy, synchronous, driver: driver as Resolved["driver"], prefix, clock: checked };
}

// ---- schema ------------------------------------------------------------------

/** One step of the schema: run in the open transaction, on a file at `version - 1`. */
interface Migration {
  version: number;
  up(db: SqliteDatabase, p: string): void;
}

const BLOCKING_SQL = BLOCKING_OUTBOX_STATES.map((s) => `'${s}'`).join(", ");
const ACTIVE_SQL = ACTIVE_INBOX_STATES.map((s) => `'${s}'`).join(", ");

/**
 * The ordered migrations. Never edit a shipped one: append a new one (its
 * `version` one more than the last) and raise {@link SQLITE_SCHEMA_VERSION}.
 */
const MIGRATIONS: readonly Migration[] = [
  {
    version: 1,
    up(db, p) {
      db.exec(`
        CREATE TABLE ${p}inbox (
          ord INTEGER PRIMARY KEY,
          id TEXT NOT NULL UNIQUE,
          kind TEXT NOT NULL,
          chat_id TEXT NOT NULL,
          provider TEXT NOT NULL,
          payload TEXT NOT NULL,
          received_at INTEGER NOT NULL,
          state TEXT NOT NULL,
          attempts INTEGER NOT NULL,
          next_attempt_at INTEGER,
          lease_owner TEXT,
          lease_incarnation TEXT,
          lease_token INTEGER,
          lease_expires_at INTEGER,
          fence INTEGER NOT NULL,
          error TEXT,
          updated_at INTEGER NOT NULL
        );
        CREATE TABLE ${p}outbox (
          seq INTEGER PRIMARY KEY AUTOINCREMENT,
          key TEXT NOT NULL UNIQUE,
          chat_id TEXT NOT NULL,
          content TEXT NOT NULL,
          content_hash TEXT NOT NULL,
          inbound_id TEXT,
          state TEXT NOT NULL,
          attempts INTEGER NOT NULL,
          next_attempt_at INTEGER,
          lease_owner TEXT,
          lease_incarnation TEXT,
          lease_token INTEGER,
          lease_expires_at INTEGER,
          fence INTEGER NOT NULL,
          message_id TEXT,
          error TEXT,
          created_at INTEGER NOT NULL,
          updated_at INTEGER NOT NULL
        );
        CREATE TABLE ${p}session (
          key TEXT PRIMARY KEY,
          value TEXT NOT NULL,
          expires_at INTEGER
        );
      `);
    },
  },
  {
    // Due scans, reclaims, purges and lists stay O(what they return) at millions of rows.
    version: 2,
    up(db, p) {
      db.exec(`
        ALTER TABLE ${p}inbox ADD COLUMN due_at INTEGER;
        ALTER TABLE ${p}outbox ADD COLUMN due_at INTEGER;
        CREATE INDEX ${p}inbox_due ON ${p}inbox (due_at) WHERE due_at IS NOT NULL;
        CREATE INDEX ${p}inbox_owner ON ${p}inbox (lease_owner) WHERE lease_owner IS NOT NULL;
        CREATE INDEX ${p}inbox_state ON ${p}inbox (state, received_at, ord);
        CREATE INDEX ${p}inbox_done ON ${p}inbox (updated_at) WHERE state = 'done';
        CREATE INDEX ${p}outbox_due ON ${p}outbox (due_at) WHERE due_at IS NOT NULL;
        CREATE INDEX ${p}outbox_owner ON ${p}outbox (lease_owner) WHERE lease_owner IS NOT NULL;
        CREATE INDEX ${p}outbox_chat ON ${p}outbox (chat_id, seq) WHERE state IN (${BLOCKING_SQL});
        CREATE INDEX ${p}outbox_state ON ${p}outbox (state, seq);
        CREATE INDEX ${p}outbox_sent ON ${p}outbox (updated_at) WHERE state = 'sent';
        CREATE INDEX ${p}session_expiry ON ${p}session (expires_at) WHERE expires_at IS NOT NULL;
        UPDATE ${p}inbox SET due_at = CASE state
          WHEN 'pending' THEN 0
          WHEN 'failed' THEN COALESCE(next_attempt_at, 0)
          WHEN 'processing' THEN COALESCE(lease_expires_at, 0)
        END;
        UPDATE ${p}outbox SET due_at = COALESCE(lease_expires_at, 0) WHERE state = 'sending';
        UPDATE ${p}outbox AS o SET due_at = COALESCE(next_attempt_at, 0)
          WHERE state IN ('queued', 'failed') AND NOT EXISTS (
            SELECT 1 FROM ${p}outbox AS b
            WHERE b.chat_id = o.chat_id AND b.state IN (${BLOCKING_SQL}) AND b.seq < o.seq);
      `);
    },
  },
  {
    // Lists read O(limit) rows in their order: all records, one chat's (any
    // state), one state's (several states: one query per state, merged). The
    // inbox due index also orders by receipt, so that claimDue reads a
    // pending backlog (due_at = 0) in order instead of sorting all of it.
    version: 3,
    up(db, p) {
      db.exec(`
        CREATE INDEX ${p}inbox_received ON ${p}inbox (received_at, ord);
        CREATE INDEX ${p}inbox_chat ON ${p}inbox (chat_id, received_at, ord);
        CREATE INDEX ${p}outbox_chat_all ON ${p}outbox (chat_id, seq);
        DROP INDEX ${p}inbox_due;
        CREATE INDEX ${p}inbox_due ON ${p}inbox (due_at, received_at, ord) WHERE due_at IS NOT NULL;
      `);
    },
  },
  {
    // The call marker of an outbox entry (outbox.markCalling): uncalled exactly when `uncalled_fence`
    // equals `fence` (see outboxOf). Existing rows get NULL (no row is rewritten) and read as called:
    // they may have been sent, so a lost one stays ambiguous, as it was. A claim by an older library
    // raises the fence without touching the column: its entry reads as called too.
    version: 4,
    up(db, p) {
      db.exec(`ALTER TABLE ${p}outbox ADD COLUMN uncalled_fence INTEGER;`);
    },
  },
  {
    // An inbox due scan keeps each chat's order: it looks up the chat's `processing` records (a lease
    // held elsewhere holds back the later ones) without reading the chat's settled history.
    version: 5,
    up(db, p) {
      db.exec(`CREATE INDEX ${p}inbox_chat_leased ON ${p}inbox (chat_id, received_at, ord) WHERE state = 'processing';`);
    },
  },
  {
    // Damaged records are set aside, not deleted (see DamagedRows): `damage` (the problem), `set_aside_at`,
    // `set_aside_seq` (the order they were set aside in) and `damage_reported` (0, then 1), all NULL on a
    // readable row, so that existing rows need no rewrite. Partial indexes: only set-aside rows are in them.
    version: 6,
    up(db, p) {
      for (const table of [`${p}inbox`, `${p}outbox`]) {
        db.exec(`
          ALTER TABLE ${table} ADD COLUMN damage TEXT;
          ALTER TABLE ${table} ADD COLUMN set_aside_at INTEGER;
          ALTER TABLE ${table} ADD COLUMN set_aside_seq INTEGER;
          ALTER TABLE ${table} ADD COLUMN damage_reported INTEGER;
          CREATE INDEX ${table}_aside ON ${table} (set_aside_seq) WHERE set_aside_seq IS NOT NULL;
          CREATE INDEX ${table}_unreported ON ${table} (set_aside_seq) WHERE damage_reported = 0;
        `);
      }
    },
  },
  {
    // A leased admit looks at the active records of its chat (see SqliteInbox.admit) without reading
    // the chat's settled history: a partial index of the active ones only (the due scan's
    // inbox_chat_leased stays, so that it reads a chat's processing records without its pending backlog).
    version: 7,
    up(db, p) {
      db.exec(`CREATE INDEX ${p}inbox_chat_active ON ${p}inbox (chat_id, received_at, ord) WHERE state IN (${ACTIVE_SQL});`);
    },
  },
  {
    // Fewer indexes to maintain per message: the lease-owner indexes served only the reclaim of a previous
    // incarnation's leases (at a restart). Every leased record is in its journal's due index (an inbox
    // `processing` record and an outbox `sending` entry are due at their lease expiry), so the reclaim reads
    // that index instead: O(records due or leased), not O(records held by the owner).
    version: 8,
    up(db, p) {
      db.exec(`DROP INDEX IF EXISTS ${p}inbox_owner; DROP INDEX IF EXISTS ${p}outbox_owner;`);
    },
  },
];

/** Brings the schema to {@link SQLITE_SCHEMA_VERSION} in one transaction; refuses a newer file. */
function migrate(db: SqliteDatabase, p: string, file: string): void {
  db.exec("BEGIN IMMEDIATE");
  try {
    db.exec(`CREATE TABLE IF NOT EXISTS ${p}meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)`);
    const row = db.prepare(`SELECT value FROM ${p}meta WHERE key = 'schema_version'`).get();
    const current = row === undefined ? 0 : Number(row.value);
    if (!Number.isInteger(current) || current < 0) {
      throw new Error(`SQLite file ${JSON.stringify(file)} has an invalid schema version ${show(row?.value)}`);
    }
    if (current > SQLITE_SCHEMA_VERSION) {
      throw new Error(
        `SQLite file ${
          JSON.stringify(file)
        } has schema version ${current}, written by a newer @botmesh/durable; this version supports up to schema version ${SQLITE_SCHEMA_VERSION}: upgrade @botmesh/durable to open it`,
      );
    }
    for (const migration of MIGRATIONS) {
      if (migration.version > current) migration.up(db, p);
    }
    if (current < SQLITE_SCHEMA_VERSION) {
      db.prepare(`INSERT INTO ${p}meta (key, value) VALUES ('schema_version', ?)
        ON CONFLICT (key) DO UPDATE SET value = excluded.value`).run(String(SQLITE_SCHEMA_VERSION));
    }
    db.exec("COMMIT");
  } catch (error) {
    try {
      db.exec("ROLLBACK");
    } catch {
      // Nothing to roll back.
    }
    throw error;
  }
}

// ---- the connection ----------------------------------------------------------

/**
 * Switches a new connection to WAL. Another process opening the same file at
 * the same moment can make the switch fail with "database is locked" at once,
 * without the busy handler (SQLite does not wait where waiting could
 * deadlock), so it is retried until `busyTimeoutMs` has passed.
 */
async function enableWal(db: SqliteDatabase, busyTimeoutMs: number): Promise<void> {
  const deadline = Date.now() + busyTimeoutMs;
  for (let pause = 5;; pause = Math.min(pause * 2, 100)) {
    let journal: string;
    try {
      const mode = db.prepare("PRAGMA journal_mode = WAL").get();
      journal = String(mode ? Object.values(mode)[0] : "").toLowerCase();
      if (journal === "wal" || journal === "memory") return;
    } catch (error) {
      if (!/locked|busy/i.test(String((error as Error)?.message ?? error)) || Date.now() >= deadline) throw error;
      await new Promise((resolve) => setTimeout(resolve, pause));
      continue;
    }
    if (Date.now() >= deadline) throw new Error(`journal_mode is ${JSON.stringify(journal)}, WAL could not be enabled`);
    await new Promise((resolve) => setTimeout(resolve, pause));
  }
}

/**
 * Counters of a connection's write transactions (shared by a store and its
 * durability backend), since the instance was created.
 */
export interface SQLiteStats {
  /** Group commits: transactions committed, each one fsync under `synchronous: "full"`. */
  commits: number;
  /** Write operations carried by committed transactions (including those rolled back alone to their savepoint). */
  operations: number;
  /** Batches that could not begin or commit (each of their operations rejected, none took effect). */
  failedBatches: number;
  /** The most operations one transaction carried. */
  largestBatch: number;
}

/** A write operation waiting for its batch. */
interface PendingOp {
  work: (now: number) => unknown;
  /** At most one of its statements writes, and nothing it does after that write can throw. */
  single: boolean;
  resolve: (value: unknown) => void;
  reject: (error: unknown) => void;
}

/** The savepoint each operation of a batch runs in. */
const SAVEPOINT = "botmesh_op";
const SAVEPOINT_SQL = `SAVEPOINT ${SAVEPOINT}`;
const RELEASE_SQL = `RELEASE ${SAVEPOINT}`;
const ROLLBACK_TO_SQL = `ROLLBACK TO ${SAVEPOINT}`;

/** One database connection, shared by a store and its backend, opened while anyone holds it. */
class Connection {
  readonly options: Resolved;
  #db: SqliteDatabase | null = null;
  #refs = 0;
  #queue: Promise<unknown> = Promise.resolve();
  #statements = new Map<string, SqliteStatement>();
  /** Write operations waiting for the next batch, in call order. */
  #pending: PendingOp[] = [];
  #scheduled = false;
  #stats: SQLiteStats = { commits: 0, operations: 0, failedBatches: 0, largestBatch: 0 };

  /** The batch's schema version check (built once: statements are looked up by their text). */
  readonly #versionSql: string;

  constructor(options: Resolved) {
    this.options = options;
    this.#versionSql = `SELECT value FROM ${options.prefix}meta WHERE key = 'schema_version'`;
  }

  get file(): string {
    return this.options.file;
  }

  /** The open database, or `null`. */
  get db(): SqliteDatabase | null {
    return this.#db;
  }

  /** Runs open/close steps one at a time. */
  #serial<T>(work: () => Promise<T> | T): Promise<T> {
    const run = this.#queue.then(work);
    this.#queue = run.catch(() => {});
    return run;
  }

  /** Takes a reference; the first one opens the database. */
  acquire(): Promise<void> {
    return this.#serial(async () => {
      if (this.#refs === 0) this.#db = await this.#open();
      this.#refs++;
    });
  }

  /** Drops a reference; the last one closes the database. */
  release(): Promise<void> {
    return this.#serial(() => {
      if (this.#refs === 0) return;
      if (--this.#refs > 0) return;
      // What was queued before the close still commits.
      this.#drain();
      const db = this.#db;
      this.#db = null;
      this.#statements.clear();
      db?.close();
    });
  }

  async #open(): Promise<SqliteDatabase> {
    const { file, driver, busyTimeoutMs, synchronous, prefix } = this.options;
    const db = await openSqlite(file, driver).catch((error: unknown) => {
      throw wrapOpenError(file, null, error);
    });
    try {
      db.exec(`PRAGMA busy_timeout = ${busyTimeoutMs}`);
      await enableWal(db, busyTimeoutMs);
      db.exec(`PRAGMA synchronous = ${synchronous === "full" ? "FULL" : "NORMAL"}`);
      migrate(db, prefix, file);
      return db;
    } catch (error) {
      try {
        db.close();
      } catch {
        // Already unusable.
      }
      throw wrapOpenError(file, db.driver, error);
    }
  }

  /** A cached prepared statement. */
  stmt(sql: string): SqliteStatement {
    let statement = this.#statements.get(sql);
    if (!statement) {
      if (!this.#db) throw new Error(`SQLite file ${JSON.stringify(this.file)} was closed during the operation`);
      statement = this.#db.prepare(sql);
      this.#statements.set(sql, statement);
    }
    return statement;
  }

  /** Counters of this connection's write transactions (see {@link SQLiteStats}). */
  get stats(): SQLiteStats {
    return { ...this.#stats };
  }

  /**
   * Queues a write operation for the next group commit and resolves with
   * what `work` returned once the transaction that ran it has committed.
   *
   * `work` runs synchronously inside a `BEGIN IMMEDIATE` transaction (the
   * write lock is held), in its own `SAVEPOINT`, with the host clock read
   * when its turn comes. When it throws, only its own changes are rolled
   * back and only its promise rejects (after the commit, with its error).
   * When the file's schema version is newer than this library's (another
   * process upgraded it), the batch is refused whole, naming both versions.
   * When the batch cannot begin or commit, or `work` loses the transaction
   * (SQLite rolled it back), every operation of it rejects with an error naming
   * the file (`cause`: the driver's error) and none of them took effect.
   */
  write<T>(work: (now: number) => T, single = false): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      if (!this.#db) {
        reject(new Error(`SQLite file ${JSON.stringify(this.file)} is closed`));
        return;
      }
      this.#pending.push({ work, single, resolve: resolve as (value: unknown) => void, reject });
      this.#schedule();
    });
  }

  /** Flushes on the next turn of the event loop, so that every operation queued in this one joins the batch. */
  #schedule(): void {
    if (this.#scheduled || this.#pending.length === 0) return;
    this.#scheduled = true;
    nextTurn(() => {
      this.#scheduled = false;
      this.#flush();
      // What the batch cap left for later (operations queued by the batch's
      // continuations come after the microtasks, and schedule themselves).
      this.#schedule();
    });
  }

  /** Commits the queued operations now, batch after batch, until none is left (before closing). */
  #drain(): void {
    while (this.#pending.length > 0) this.#flush();
  }

  /** Runs one batch: up to {@link MAX_BATCH_OPS} queued operations (or {@link MAX_BATCH_MS}) in one transaction. */
  #flush(): void {
    if (this.#pending.length === 0) return;
    if (!this.#db) {
      const ops = this.#pending.splice(0);
      for (const op of ops) op.reject(new Error(`SQLite file ${JSON.stringify(this.file)} was closed during the operation`));
      return;
    }
    try {
      this.stmt("BEGIN IMMEDIATE").run();
    } catch (error) {
      // Typically SQLITE_BUSY: another connection held the write lock for longer than busyTimeoutMs.
      // Everything queued waited for that lock: it all fails, and nothing of it was applied.
      const ops = this.#pending.splice(0);
      this.#stats.failedBatches++;
      for (const op of ops) op.reject(this.#batchError("could not begin a transaction", ops.length, error));
      return;
    }
    // A newer version of the library may have migrated the file since this connection opened it
    // (a rolling upgrade on one host): writing on would leave out what its schema adds.
    let newer: number | null = null;
    try {
      const row = this.stmt(this.#versionSql).get();
      const version = row === undefined ? 0 : Number(row.value);
      if (version > SQLITE_SCHEMA_VERSION) newer = version;
    } catch {
      // Unreadable meta: leave it to the operations (they report what is wrong).
    }
    if (newer !== null) {
      try {
        this.stmt("ROLLBACK").run();
      } catch {
        // Nothing was written.
      }
      const ops = this.#pending.splice(0);
      this.#stats.failedBatches++;
      const error = new Error(
        `SQLite file ${JSON.stringify(this.file)} was upgraded to schema version ${newer} by a newer @botmesh/durable ` +
          `while this process (schema version ${SQLITE_SCHEMA_VERSION}) had it open: restart this process with the newer version; ` +
          `none of ${ops.length === 1 ? "its operation" : `its ${ops.length} operations`} took effect`,
      );
      for (const op of ops) op.reject(error);
      return;
    }
    const started = performance.now();
    const probe = this.#db.inTransaction() === true;
    const ran: { op: PendingOp; ok: boolean; value: unknown }[] = [];
    let lost: unknown = undefined;
    let taken = 0;
    while (
      taken < this.#pending.length && ran.length < MAX_BATCH_OPS &&
      (ran.length === 0 || performance.now() - started < MAX_BATCH_MS)
    ) {
      const op = this.#pending[taken++];
      if (op.single && probe) {
        // One writing statement: SQLite undoes a failed statement by itself, so no savepoint is needed
        // (two statements fewer per operation); the driver tells whether the transaction survived.
        try {
          ran.push({ op, ok: true, value: op.work(this.options.clock()) });
        } catch (error) {
          if (this.#db.inTransaction() === true) {
            ran.push({ op, ok: false, value: error });
          } else {
            op.reject(this.#batchError("this operation lost the transaction", taken, error));
            lost = error;
            break;
          }
        }
        continue;
      }
      try {
        this.stmt(SAVEPOINT_SQL).run();
        const value = op.work(this.options.clock());
        this.stmt(RELEASE_SQL).run();
        ran.push({ op, ok: true, value });
      } catch (error) {
        try {
          this.stmt(ROLLBACK_TO_SQL).run();
          this.stmt(RELEASE_SQL).run();
          ran.push({ op, ok: false, value: error });
        } catch {
          // SQLite rolled the whole transaction back (an I/O error, disk full, RAISE(ROLLBACK)).
          op.reject(this.#batchError("this operation lost the transaction", taken, error));
          lost = error;
          break;
        }
      }
    }
    this.#pending.splice(0, taken);
    if (lost === undefined) {
      try {
        this.stmt("COMMIT").run();
      } catch (error) {
        lost = error;
      }
    }
    if (lost !== undefined) {
      try {
        this.stmt("ROLLBACK").run();
      } catch {
        // The transaction is gone already.
      }
      this.#stats.failedBatches++;
      // Operations after the one that lost the transaction were not run: they go in the next batch.
      const count = taken;
      for (const { op, ok, value } of ran) {
        op.reject(ok ? this.#batchError("the transaction failed", count, lost) : value);
      }
      return;
    }
    this.#stats.commits++;
    this.#stats.operations += ran.length;
    if (ran.length > this.#stats.largestBatch) this.#stats.largestBatch = ran.length;
    for (const { op, ok, value } of ran) {
      if (ok) op.resolve(value);
      else op.reject(value);
    }
  }

  #batchError(what: string, count: number, cause: unknown): Error {
    const message = cause instanceof Error ? cause.message : String(cause);
    const ops = count === 1 ? "its operation" : `its ${count} operations`;
    return new Error(
      `SQLite file ${JSON.stringify(this.file)}: ${what}, none of ${ops} took effect: ${message}`,
      { cause },
    );
  }
}

function wrapOpenError(file: string, driver: SqliteDriverName | null, error: unknown): Error {
  const message = error instanceof Error ? error.message : String(error);
  if (message.includes("newer @botmesh/durable") || message.startsWith("No SQLite driver")) {
    return error as Error;
  }
  const via = driver ? ` (${driver})` : "";
  const hint = /not a database|file is encrypted|malformed/i.test(message) ? ": it is not a SQLite database, or it is damaged" : "";
  return new Error(`Cannot open SQLite file ${JSON.stringify(file)}${via}${hint}: ${message}`, { cause: error });
}

// ---- rows --------------------------------------------------------------------

type Row = SqliteRow;

const num = (v: SqliteValue): number => v as number;
/** Inbox rows in arrival order: `received_at`, then `ord`. */
const arrival = (a: Row, b: Row): number => num(a.received_at) - num(b.received_at) || num(a.ord) - num(b.ord);
const numOrNull = (v: SqliteValue): number | null => (v === null ? null : (v as number));

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
function leaseParams(lease: Lease | null): SqliteValue[] {
  return lease ? [lease.owner, lease.incarnation, lease.token, lease.expiresAt] : [null, null, null, null];
}

/** The set-aside columns (schema 6), read with every row: `set_aside_seq` is set on a row set aside. */
const ASIDE_COLUMNS = "set_aside_seq, damage, set_aside_at, damage_reported";

const INBOX_COLUMNS =
  `ord, id, kind, chat_id, provider, payload, received_at, state, attempts, next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, error, updated_at, ${ASIDE_COLUMNS}`;

/** Where a row was read, for errors: the file and the table. */
interface Source {
  readonly file: string;
  readonly table: string;
}

/**
 * The JSON value of `column` of a session row (identified by `key` = `id`), or an error naming
 * the file, table, row and column when its text is not JSON (the file was damaged or edited).
 */
function jsonColumn(text: SqliteValue, at: Source, key: string, id: SqliteValue, column: string): JsonValue {
  try {
    return JSON.parse(String(text)) as JsonValue;
  } catch (error) {
    throw new Error(
      `SQLite file ${JSON.stringify(at.file)}: table ${at.table}, row ${key} ${
        JSON.stringify(String(id))
      }: column ${column} is not valid JSON (the row is damaged): ${(error as Error).message}`,
      { cause: error },
    );
  }
}


/** What a write answers when the row it met is damaged (it leaves setting it aside to another operation). */
const DAMAGED: unique symbol = Symbol("damaged");

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
function inboundOf(row: Row): InboundRecord | Damage {
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

const OUTBOX_COLUMNS =
  `seq, key, chat_id, content, content_hash, inbound_id, state, attempts, next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, uncalled_fence, message_id, error, created_at, updated_at, ${ASIDE_COLUMNS}`;

/** The entry of an outbox row, or what is wrong with the row. */
function outboxOf(row: Row): OutboxEntry | Damage {
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
function uncalledFence(entry: OutboxEntry): number | null {
  return entry.called ? null : entry.fence;
}

function placeholders(n: number): string {
  return new Array(n).fill("?").join(", ");
}

/**
 * Runs a list: at most `limit` rows in `order` (`"received_at, ord"` or
 * `"seq"`), each query reading O(limit) index entries:
 * - no filter: the table in order (`byOrder`, an index on the order);
 * - a chat: that chat's rows in order (`byChat`, on the chat and the order),
 *   other states skipped;
 * - states only: one query per state on `byState` (the state, then the
 *   order), merged, so that no query sorts every row of its states.
 */
function listRows(
  c: Connection,
  table: string,
  columns: string,
  order: "received_at, ord" | "seq",
  indexes: { byOrder: string | null; byChat: string; byState: string },
  options: ListOptions<string> | undefined,
): Row[] {
  const { states, chatId, limit } = normalizeList(options);
  if (limit === 0 || (states !== null && states.size === 0)) return [];
  // Rows set aside as damaged are left out.
  const from = (index: string | null) =>
    `SELECT ${columns} FROM ${table}${index ? ` INDEXED BY ${index}` : ""} WHERE set_aside_seq IS NULL`;
  if (chatId !== undefined) {
    const list = states === null ? [] : [...states];
    const where = list.length ? ` AND state IN (${placeholders(list.length)})` : "";
    return c.stmt(`${from(indexes.byChat)} AND chat_id = ?${where} ORDER BY ${order} LIMIT ?`)
      .all(chatId, ...list, limit);
  }
  if (states === null) return c.stmt(`${from(indexes.byOrder)} ORDER BY ${order} LIMIT ?`).all(limit);
  const statement = c.stmt(`${from(indexes.byState)} AND state = ? ORDER BY ${order} LIMIT ?`);
  if (states.size === 1) return statement.all([...states][0], limit);
  const rows = [...states].flatMap((state) => statement.all(state, limit));
  rows.sort(order === "seq"
    ? (a, b) => num(a.seq) - num(b.seq)
    : (a, b) => num(a.received_at) - num(b.received_at) || num(a.ord) - num(b.ord));
  return rows.slice(0, limit);
}

// ---- argument checks ---------------------------------------------------------
// Every value bound to a statement is checked first, so that a caller gets a
// TypeError naming the argument (the same on every driver: bun:sqlite binds
// `undefined` as NULL, node:sqlite and better-sqlite3 throw an unnamed error).

// ---- the journals ------------------------------------------------------------

/** Access to the connection for the journals: `null` when the backend is not open. */
interface Gate {
  /** The open connection, or a rejection naming the file. */
  ready(): Promise<Connection>;
  readonly prefix: string;
  /** The database file, for errors. */
  readonly file: string;
}

/**
 * Deletes what `sql` picks (its one parameter is the cutoff time), at most
 * {@link PURGE_BATCH} rows per step. Each step is one write operation (of a
 * group commit) and is queued only once the previous one has committed, so
 * that a large purge never holds the write lock for long (other processes
 * would run into their busy timeout) nor blocks this one's event loop.
 */
async function purgeInBatches(gate: Gate, olderThanMs: number, sql: string): Promise<number> {
  checkFinite(olderThanMs, `purge: "olderThanMs"`);
  let cutoff: number | undefined;
  let total = 0;
  for (;;) {
    const c = await gate.ready();
    const n = await c.write((now) => c.stmt(sql).run(cutoff ??= now - olderThanMs).changes);
    total += n;
    if (n < PURGE_BATCH) return total;
  }
}


/**
 * The damaged rows of one journal table: sets them aside (once: the row is
 * kept as stored, its set-aside columns filled and its `due_at` cleared, so
 * that due scans no longer find it), lists and reports them.
 */
class DamagedRows<T> {
  readonly #gate: Gate;
  readonly #journal: "inbox" | "outbox";
  readonly #t: string;
  /** The row's storage key (`ord`, `seq`) and its id column (`id`, `key`). */
  readonly #pk: "ord" | "seq";
  readonly #idColumn: "id" | "key";
  readonly #columns: string;
  readonly #read: (row: Row) => T | Damage;
  /** Called in the transaction that set `row` aside (the outbox moves its chat on). */
  readonly #setAsideHook: (c: Connection, row: Row) => void;

  constructor(
    gate: Gate,
    journal: "inbox" | "outbox",
    columns: string,
    read: (row: Row) => T | Damage,
    setAsideHook: (c: Connection, row: Row) => void = () => {},
  ) {
    this.#gate = gate;
    this.#journal = journal;
    this.#t = `${gate.prefix}${journal}`;
    [this.#pk, this.#idColumn] = journal === "inbox" ? ["ord", "id"] : ["seq", "key"];
    this.#columns = columns;
    this.#read = read;
    this.#setAsideHook = setAsideHook;
  }

  /** The row's id or key; its storage key (`ord:<n>`, `seq:<n>`) when the id itself is unreadable. */
  #idOf(row: Row): string {
    const id = row[this.#idColumn];
    return typeof id === "string" ? id : `${this.#pk}:${row[this.#pk]}`;
  }

  /** The error `get` rejects with for a row set aside. */
  #error(row: Row): DamagedRecordError {
    return new DamagedRecordError({ journal: this.#journal, id: this.#idOf(row), backend: "sqlite", problem: String(row.damage) });
  }

  /**
   * In a write: the record of `row`, or `null` when it was set aside, or is
   * damaged (then it is set aside now).
   */
  current(c: Connection, row: Row, now: number): T | null {
    if (row.set_aside_seq !== null) return null;
    const read = this.#read(row);
    if (!(read instanceof Damage)) return read;
    this.#setAside(c, row, read.problem, now);
    return null;
  }

  /** In a write, on a row read in it: sets it aside with `problem` unless it is already. */
  #setAside(c: Connection, row: Row, problem: string, now: number): void {
    const t = this.#t;
    const { changes } = c.stmt(
      `UPDATE ${t} SET damage = ?, set_aside_at = ?, damage_reported = 0, due_at = NULL,
        set_aside_seq = (SELECT COALESCE(MAX(set_aside_seq), 0) + 1 FROM ${t} INDEXED BY ${t}_aside WHERE set_aside_seq IS NOT NULL)
      WHERE ${this.#pk} = ? AND set_aside_seq IS NULL`,
    ).run(problem, now, row[this.#pk]);
    if (changes === 1) this.#setAsideHook(c, row);
  }

  /**
   * For a read outside a transaction: the records of `rows`, or `null` when
   * some were damaged. Those are then set aside (each read again in the write
   * transaction, so that a row repaired or set aside meanwhile is left as it
   * is) and the caller reads again.
   */
  async readAll(c: Connection, rows: Row[]): Promise<T[] | null> {
    const records: T[] = [];
    const damaged: SqliteValue[] = [];
    for (const row of rows) {
      const read = row.set_aside_seq === null ? this.#read(row) : null;
      if (read === null) continue;
      if (read instanceof Damage) damaged.push(row[this.#pk]);
      else records.push(read);
    }
    if (damaged.length === 0) return records;
    await c.write((now) => {
      for (const key of damaged) {
        const row = c.stmt(`SELECT ${this.#columns} FROM ${this.#t} WHERE ${this.#pk} = ?`).get(key);
        if (row) this.current(c, row, now);
      }
    });
    return null;
  }

  /** `get`: the record of `id`, `null`, or a {@link DamagedRecordError} (a damaged row is set aside first). */
  async get(id: string): Promise<T | null> {
    const c = await this.#gate.ready();
    for (;;) {
      const row = c.stmt(`SELECT ${this.#columns} FROM ${this.#t} WHERE ${this.#idColumn} = ?`).get(id);
      if (!row) return null;
      if (row.set_aside_seq !== null) throw this.#error(row);
      const [record] = (await this.readAll(c, [row])) ?? [];
      if (record !== undefined) return record;
    }
  }

  async list(options: DamagedListOptions | undefined): Promise<DamagedRecord[]> {
    const { unreported, limit } = checkDamagedList(options, `${this.#journal}.damaged`);
    const c = await this.#gate.ready();
    if (limit === 0) return [];
    const t = this.#t;
    const rows = c.stmt(
      unreported
        ? `SELECT ${this.#pk}, ${this.#idColumn}, ${ASIDE_COLUMNS} FROM ${t} INDEXED BY ${t}_unreported
          WHERE damage_reported = 0 ORDER BY set_aside_seq LIMIT ?`
        : `SELECT ${this.#pk}, ${this.#idColumn}, ${ASIDE_COLUMNS} FROM ${t} INDEXED BY ${t}_aside
          WHERE set_aside_seq IS NOT NULL ORDER BY set_aside_seq LIMIT ?`,
    ).all(limit);
    return rows.map((row) => ({
      journal: this.#journal,
      id: this.#idOf(row),
      backend: "sqlite",
      problem: String(row.damage),
      setAsideAt: num(row.set_aside_at),
      reported: row.damage_reported === 1,
    }));
  }

  async report(id: string): Promise<boolean> {
    checkId(id, `${this.#journal}.reportDamaged: "id"`);
    const c = await this.#gate.ready();
    const t = this.#t;
    const byKey = new RegExp(`^${this.#pk}:(\\d+)$`).exec(id);
    // At most one of the two statements writes (one operation, no savepoint needed).
    return c.write(() =>
      c.stmt(`UPDATE ${t} SET damage_reported = 1 WHERE ${this.#idColumn} = ? AND damage_reported = 0`).run(id).changes === 1 ||
      (byKey !== null && c.stmt(
          `UPDATE ${t} SET damage_reported = 1 WHERE ${this.#pk} = ? AND damage_reported = 0 AND typeof(${this.#idColumn}) <> 'text'`,
        ).run(Number(byKey[1])).changes === 1), true);
  }
}

/**
 * The first active record of a chat (`chat_id`, received no later than `received_at`; parameters after
 * them: `after`'s, then now, owner, incarnation, now) that keeps a new record admitted under that lease
 * pending: `admitsLeased` of the journal rules, negated, in columns (see `SqliteInbox.admit`).
 */
function comesFirstSql(t: string, after: string, columns = INBOX_COLUMNS, order = "ORDER BY received_at, ord LIMIT 1"): string {
  return `SELECT ${columns} FROM ${t} INDEXED BY ${t}_chat_active
    WHERE chat_id = ? AND state IN (${ACTIVE_SQL}) AND set_aside_seq IS NULL AND received_at <= ?${after}
      AND (state = 'pending'
        OR (state = 'failed' AND COALESCE(next_attempt_at, 0) <= ?)
        OR (state = 'processing' AND NOT COALESCE(lease_owner = ? AND lease_incarnation = ? AND lease_expires_at > ?, 0)))
    ${order}`;
}

class SqliteInbox implements InboxJournal, DamagedRecords {
  readonly #gate: Gate;
  /** The SQL of the hot statements, built once (a statement is looked up by its text on every call). */
  readonly #sql: Readonly<Record<"select" | "update" | "insert", string>>;
  readonly #t: string;
  readonly #damaged: DamagedRows<InboundRecord>;
  /** The statements of `#comesFirst`: whether any row matches, the first from the chat's start, the next after a row. */
  readonly #comesFirstSql: readonly [string, string, string];

  constructor(gate: Gate) {
    this.#gate = gate;
    this.#t = `${gate.prefix}inbox`;
    this.#sql = {
      select: `SELECT ${INBOX_COLUMNS} FROM ${this.#t} WHERE id = ?`,
      update: `UPDATE ${this.#t} SET state = ?, attempts = ?, next_attempt_at = ?,
        lease_owner = ?, lease_incarnation = ?, lease_token = ?, lease_expires_at = ?,
        fence = ?, error = ?, updated_at = ?, due_at = ?
      WHERE id = ? AND state = ? AND fence = ? AND lease_token IS ?`,
      insert: `INSERT INTO ${this.#t} (id, kind, chat_id, provider, payload, received_at, state, attempts,
          next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, error, updated_at, due_at)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING`,
    };
    this.#damaged = new DamagedRows(gate, "inbox", INBOX_COLUMNS, inboundOf);
    this.#comesFirstSql = [
      comesFirstSql(this.#t, "", "1 AS x", "LIMIT 1"),
      comesFirstSql(this.#t, ""),
      comesFirstSql(this.#t, " AND (received_at, ord) > (?, ?)"),
    ];
  }

  /** In a write: the record of `id`, or `null` when there is none or it is damaged (set aside, now if not yet). */
  #select(c: Connection, id: string, now: number): InboundRecord | null {
    const row = c.stmt(this.#sql.select).get(id);
    return row ? this.#damaged.current(c, row, now) : null;
  }

  /**
   * Writes the changed fields of `next` over `prev`, guarded in SQL by the
   * state, fencing token and lease token read in this transaction.
   */
  #update(c: Connection, prev: InboundRecord, next: InboundRecord): boolean {
    const { changes } = c.stmt(
      this.#sql.update,
    ).run(
      next.state,
      next.attempts,
      next.nextAttemptAt,
      ...leaseParams(next.lease),
      next.fence,
      next.error,
      next.updatedAt,
      inboxDueAt(next),
      prev.id,
      prev.state,
      prev.fence,
      prev.lease?.token ?? null,
    );
    return changes === 1;
  }

  /** A fenced change (`op`, for errors): applies `change` when the record is leased with `token`. */
  async #fenced(
    op: string,
    id: string,
    token: number,
    change: (record: InboundRecord, now: number) => InboundRecord,
  ): Promise<boolean> {
    checkId(id, `inbox.${op}: "id"`);
    checkFinite(token, `inbox.${op}: "token"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, id, now);
      if (!cur || !isLeasedWith(cur, token)) return false;
      return this.#update(c, cur, change(cur, now));
    }, true);
  }

  /**
   * In the admit's write: whether an active record of the chat of `input` comes before it (received
   * no later; admitted earlier, as every existing row is) and does not let it be admitted leased under
   * `lease` (see `admitsLeased`). One range read of the partial index of the chat's active records
   * (received no later), in arrival order, stopping at the first row that keeps the new record pending
   * (the same rule, in columns): it passes over the caller's own live leases and retries not yet due,
   * and in the usual case finds nothing. Only a row found is read whole and checked by the rule (a
   * damaged one is set aside here, and the read goes on after it).
   */
  #comesFirst(c: Connection, input: NewInboundRecord, now: number, lease: ClaimOptions): boolean {
    const [any, first, next] = this.#comesFirstSql;
    const rule = [now, lease.owner, lease.incarnation, now];
    // The usual answer is none: an unordered probe says so at a fraction of the cost of the ordered read
    // (an ORDER BY costs several µs per call on bun:sqlite even when the index yields the order).
    if (c.stmt(any).get(input.chatId, input.receivedAt, ...rule) === undefined) return false;
    let row = c.stmt(first).get(input.chatId, input.receivedAt, ...rule);
    while (row !== undefined) {
      const cur = this.#damaged.current(c, row, now);
      if (cur !== null && !admitsLeased(cur, now, lease)) return true;
      // Set aside as damaged just now (or, were SQL and the rule ever to disagree, the rule's word): the next one.
      row = c.stmt(next).get(input.chatId, input.receivedAt, row.received_at, row.ord, ...rule);
    }
    return false;
  }

  async admit(record: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null> {
    const input = checkNewInbound(record); // a TypeError naming the field, before anything is written
    if (lease !== undefined) checkClaim(lease, "inbox.admit");
    const payload = JSON.stringify(input.payload);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const held = lease !== undefined && this.#comesFirst(c, input, now, lease);
      const next = newInboundRecord(input, now, held ? undefined : lease);
      const { changes } = c.stmt(
        this.#sql.insert,
      ).run(
        next.id,
        next.kind,
        next.chatId,
        next.provider,
        payload,
        next.receivedAt,
        next.state,
        next.attempts,
        next.nextAttemptAt,
        ...leaseParams(next.lease),
        next.fence,
        next.error,
        next.updatedAt,
        inboxDueAt(next),
      );
      return changes === 1 ? next : null; // its payload is the checked copy, not the caller's object
    }, true);
  }

  async claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    checkId(id, `inbox.claim: "id"`);
    checkClaim(options, "inbox.claim");
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, id, now);
      if (!cur || !isInboxClaimable(cur, now, options)) return null;
      const next = claimedInbound(cur, now, options);
      return this.#update(c, cur, next) ? next : null;
    }, true);
  }

  async claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    checkClaim(options, "inbox.claimDue");
    checkFinite(options.limit, `inbox.claimDue: option "limit"`);
    const c = await this.#gate.ready();
    if (!(options.limit > 0)) return [];
    const t = this.#t;
    return c.write((now) => {
      // Due records in arrival order (lapsed leases too, this incarnation's own included): those due at
      // a time (retries, lapsed leases) and the previous incarnations' are all read and sorted; pending
      // ones (due at 0: a backlog may be large) are read in order from the index a page at a time, as
      // the merge reaches them (records of held chats are skipped, so a page may not be enough).
      const timed = c.stmt(`SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due WHERE due_at > 0 AND due_at <= ?`)
        .all(now);
      if (options.reclaimOwn) {
        timed.push(
          ...c.stmt(
            `SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due
            WHERE due_at IS NOT NULL AND lease_owner = ? AND state = 'processing' AND lease_incarnation <> ? AND set_aside_seq IS NULL`,
          ).all(options.owner, options.incarnation),
        );
      }
      timed.sort(arrival);
      const size = Math.ceil(options.limit);
      let page = c.stmt(`SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due
        WHERE due_at = 0 ORDER BY received_at, ord LIMIT ?`).all(size);
      const nextPage = (last: Row) =>
        c.stmt(`SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due
          WHERE due_at = 0 AND (received_at, ord) > (?, ?) ORDER BY received_at, ord LIMIT ?`)
          .all(last.received_at, last.ord, size);
      // Per chat looked at: its first record processing under a lease held elsewhere (null: none). A
      // damaged one holds nothing back: it is set aside here.
      const holds = new Map<SqliteValue, Row | null>();
      const heldBack = (row: Row): boolean => {
        const chat = row.chat_id;
        let hold = holds.get(chat);
        if (hold === undefined) {
          const leased = c.stmt(
            `SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_chat_leased
            WHERE chat_id = ? AND state = 'processing' AND set_aside_seq IS NULL ORDER BY received_at, ord`,
          ).all(chat);
          hold = leased.find((r) => {
            const cur = this.#damaged.current(c, r, now);
            return cur !== null && holdsChat(cur, now, options);
          }) ?? null;
          holds.set(chat, hold);
        }
        return hold !== null && arrival(hold, row) < 0;
      };
      const seen = new Set<number>();
      const out: InboundRecord[] = [];
      let i = 0, j = 0;
      while (out.length < options.limit) {
        if (j === page.length && j === size) [page, j] = [nextPage(page[j - 1]!), 0];
        const a = timed[i], b = page[j];
        if (a === undefined && b === undefined) break;
        const row = b === undefined || (a !== undefined && arrival(a, b) < 0) ? timed[i++]! : page[j++]!;
        if (seen.has(num(row.ord))) continue;
        seen.add(num(row.ord));
        if (heldBack(row)) continue;
        const cur = this.#damaged.current(c, row, now);
        if (!cur || !isInboxClaimable(cur, now, options)) continue;
        const next = claimedInbound(cur, now, options);
        if (this.#update(c, cur, next)) out.push(next);
        else holds.set(row.chat_id, row); // not taken after all: the rest of its chat must not overtake it
      }
      return out;
    });
  }

  async heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `inbox.heartbeat: "leaseMs"`);
    return await this.#fenced("heartbeat", id, token, (rec, now) => extendedLease(rec, now, leaseMs));
  }

  async complete(id: string, token: number): Promise<void> {
    if (!(await this.#fenced("complete", id, token, doneInbound))) throw new StaleLeaseError("inbox", id, token);
  }

  async fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    checkOutcome(outcome, "inbox.fail");
    const done = await this.#fenced("fail", id, token, (rec, now) => ({ ...rec, ...failedFields(outcome, now) }));
    if (!done) throw new StaleLeaseError("inbox", id, token);
  }

  get(id: string): Promise<InboundRecord | null> {
    checkId(id, `inbox.get: "id"`);
    return this.#damaged.get(id);
  }

  async list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    checkListFilter(options, "inbox.list");
    const c = await this.#gate.ready();
    const t = this.#t;
    for (;;) {
      const rows = listRows(c, t, INBOX_COLUMNS, "received_at, ord", {
        byOrder: `${t}_received`,
        byChat: `${t}_chat`,
        byState: `${t}_state`,
      }, options);
      // Damaged rows met are set aside, and the list read again without them.
      const records = await this.#damaged.readAll(c, rows);
      if (records) return records;
    }
  }

  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#damaged.list(options);
  }

  reportDamaged(id: string): Promise<boolean> {
    return this.#damaged.report(id);
  }

  async replay(id: string): Promise<boolean> {
    checkId(id, `inbox.replay: "id"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, id, now);
      const next = cur && replayedInbound(cur, now);
      return next ? this.#update(c, cur, next) : false;
    });
  }

  purge(olderThanMs: number): Promise<number> {
    return purgeInBatches(
      this.#gate,
      olderThanMs,
      `DELETE FROM ${this.#t} WHERE ord IN (
        SELECT ord FROM ${this.#t} INDEXED BY ${this.#t}_done
        WHERE state = 'done' AND updated_at <= ? AND set_aside_seq IS NULL LIMIT ${PURGE_BATCH})`,
    );
  }
}

class SqliteOutbox implements OutboxJournal, DamagedRecords {
  readonly #gate: Gate;
  /** The SQL of the hot statements, built once (a statement is looked up by its text on every call). */
  readonly #sql: Readonly<Record<"select" | "update" | "hasUnsettled" | "head" | "insert" | "markCalling" | "setDue", string>>;
  readonly #t: string;
  readonly #damaged: DamagedRows<OutboxEntry>;

  constructor(gate: Gate) {
    this.#gate = gate;
    this.#t = `${gate.prefix}outbox`;
    this.#sql = {
      select: `SELECT ${OUTBOX_COLUMNS} FROM ${this.#t} WHERE key = ?`,
      update: `UPDATE ${this.#t} SET state = ?, attempts = ?, next_attempt_at = ?,
        lease_owner = ?, lease_incarnation = ?, lease_token = ?, lease_expires_at = ?,
        fence = ?, uncalled_fence = ?, message_id = ?, error = ?, updated_at = ?, due_at = ?
      WHERE key = ? AND state = ? AND fence = ? AND lease_token IS ?`,
      hasUnsettled: `SELECT 1 AS x FROM ${this.#t} INDEXED BY ${this.#t}_chat
      WHERE chat_id = ? AND state IN (${BLOCKING_SQL}) AND set_aside_seq IS NULL LIMIT 1`,
      head: `SELECT seq, state, next_attempt_at, due_at FROM ${this.#t} INDEXED BY ${this.#t}_chat
      WHERE chat_id = ? AND state IN (${BLOCKING_SQL}) AND set_aside_seq IS NULL ORDER BY seq LIMIT 1`,
      insert: `INSERT INTO ${this.#t} (key, chat_id, content, content_hash, inbound_id, state, attempts, next_attempt_at,
          lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, uncalled_fence, message_id, error, created_at,
          updated_at, due_at)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING RETURNING seq`,
      markCalling: `UPDATE ${this.#t} SET uncalled_fence = NULL, lease_expires_at = ?, due_at = ?
        WHERE key = ? AND state = 'sending' AND lease_token = ? AND set_aside_seq IS NULL`,
      setDue: `UPDATE ${this.#t} SET due_at = ? WHERE seq = ?`,
    };
    // An entry set aside no longer blocks its chat: the next one becomes the chat's head.
    this.#damaged = new DamagedRows(gate, "outbox", OUTBOX_COLUMNS, outboxOf, (c, row) => {
      if (typeof row.chat_id === "string") this.#syncHead(c, row.chat_id);
    });
  }

  /** In a write: the entry of `key`, or `null` when there is none or it is damaged (set aside, now if not yet). */
  #select(c: Connection, key: string, now: number): OutboxEntry | null {
    const row = c.stmt(this.#sql.select).get(key);
    return row ? this.#damaged.current(c, row, now) : null;
  }

  /** Whether the chat has an unsettled (`queued`, `sending`, `failed`) entry (set-aside ones left out). */
  #hasUnsettled(c: Connection, chatId: string): boolean {
    return c.stmt(this.#sql.hasUnsettled).get(chatId) !== undefined;
  }

  /** Whether the chat has an unsettled (`queued`, `sending`, `failed`) entry before `seq`. */
  #blocked(c: Connection, chatId: string, seq: number): boolean {
    return c.stmt(
      `SELECT 1 AS x FROM ${this.#t} INDEXED BY ${this.#t}_chat
      WHERE chat_id = ? AND state IN (${BLOCKING_SQL}) AND seq < ? AND set_aside_seq IS NULL LIMIT 1`,
    ).get(chatId, seq) !== undefined;
  }

  /**
   * Writes `next` over `prev`, guarded in SQL by the state, fencing token and
   * lease token read in this transaction. `due_at` is the lease expiry of a
   * `sending` entry, else left to {@link #syncHead} (only a chat's first
   * unsettled entry has one).
   */
  #update(c: Connection, prev: OutboxEntry, next: OutboxEntry): boolean {
    const { changes } = c.stmt(
      this.#sql.update,
    ).run(
      next.state,
      next.attempts,
      next.nextAttemptAt,
      ...leaseParams(next.lease),
      next.fence,
      uncalledFence(next),
      next.messageId,
      next.error,
      next.updatedAt,
      next.state === "sending" ? (next.lease?.expiresAt ?? 0) : null,
      prev.key,
      prev.state,
      prev.fence,
      prev.lease?.token ?? null,
    );
    if (changes !== 1) return false;
    if (next.state !== "sending") this.#syncHead(c, next.chatId);
    return true;
  }

  /** Gives the chat's first unsettled entry, when `queued`/`failed`, the `due_at` a due scan finds it by. */
  #syncHead(c: Connection, chatId: string): void {
    // Usually the chat has no unsettled entry left: an unordered probe (cheaper than the ordered read) says so.
    if (!this.#hasUnsettled(c, chatId)) return;
    const head = c.stmt(
      this.#sql.head,
    ).get(chatId);
    if (!head || head.state === "sending") return;
    const dueAt = numOrNull(head.next_attempt_at) ?? 0;
    if (head.due_at !== dueAt) c.stmt(this.#sql.setDue).run(dueAt, head.seq);
  }

  /**
   * A change (`op`, for errors) that is fenced by `token`: of a `sending`
   * entry leased with it, or with `outcome` (markSent, markFailed) also of an
   * `unknown` entry whose fence is still `token` (see {@link acceptsOutcome}).
   */
  async #fenced(
    op: string,
    key: string,
    token: number,
    change: (entry: OutboxEntry, now: number) => OutboxEntry,
    outcome = false,
  ): Promise<boolean> {
    checkId(key, `outbox.${op}: "key"`);
    checkFinite(token, `outbox.${op}: "token"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, key, now);
      if (!cur || !(outcome ? acceptsOutcome(cur, token) : isLeasedWith(cur, token))) return false;
      const next = change(cur, now);
      if (cur.state === "unknown" && next.state === "failed") {
        // It blocks its chat again: later queued/failed entries of its chat are no longer first.
        this.#unmarkBehind(c, cur.chatId, cur.seq);
      }
      return this.#update(c, cur, next);
    });
  }

  /** Drops the due marks of the chat's queued/failed entries after `seq` (an earlier entry blocks them again). */
  #unmarkBehind(c: Connection, chatId: string, seq: number): void {
    c.stmt(
      `UPDATE ${this.#t} INDEXED BY ${this.#t}_chat SET due_at = NULL
      WHERE chat_id = ? AND state IN (${BLOCKING_SQL}) AND seq > ? AND state <> 'sending' AND due_at IS NOT NULL`,
    ).run(chatId, seq);
  }

  async reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    const input = checkNewOutbox(entry); // a TypeError naming the field, before anything is written
    if (lease !== undefined) checkClaim(lease, "outbox.reserve");
    const content = JSON.stringify(input.content);
    const c = await this.#gate.ready();
    for (;;) {
      const result = await this.#reserve(c, input, content, lease);
      if (result !== DAMAGED) return result;
      // The key's entry is damaged: set aside (in an operation of its own, so that the reserve above
      // stays one writing statement) and refused with a DamagedRecordError by get, unless it changed since.
      const existing = await this.#damaged.get(input.key);
      if (existing) return { status: "exists", entry: existing };
    }
  }

  /** The reserve itself: one writing statement (the insert); {@link DAMAGED} when the key's entry is damaged. */
  #reserve(
    c: Connection,
    input: NewOutboxEntry,
    content: string,
    lease: ClaimOptions | undefined,
  ): Promise<ReserveResult | typeof DAMAGED> {
    return c.write((now): ReserveResult | typeof DAMAGED => {
      // The insert comes first (it writes nothing when the key exists): one statement fewer in the usual case.
      const clear = !this.#hasUnsettled(c, input.chatId);
      const draft = newOutboxEntry(input, 0, now, clear ? lease : undefined);
      const dueAt = draft.state === "sending" ? draft.lease!.expiresAt : clear ? (draft.nextAttemptAt ?? 0) : null;
      const row = c.stmt(
        this.#sql.insert,
      ).get(
        draft.key,
        draft.chatId,
        content,
        draft.contentHash,
        draft.inboundId,
        draft.state,
        draft.attempts,
        draft.nextAttemptAt,
        ...leaseParams(draft.lease),
        draft.fence,
        uncalledFence(draft),
        draft.messageId,
        draft.error,
        draft.createdAt,
        draft.updatedAt,
        dueAt,
      );
      if (row === undefined) {
        const found = c.stmt(this.#sql.select).get(input.key);
        const existing = found === undefined || found.set_aside_seq !== null ? null : outboxOf(found);
        return existing === null || existing instanceof Damage ? DAMAGED : { status: "exists", entry: existing };
      }
      const entry: OutboxEntry = { ...draft, seq: num(row.seq) }; // its content is the checked copy
      return { status: entry.state === "sending" ? "leased" : "queued", entry };
    }, true);
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    checkClaim(options, "outbox.claimDue");
    checkFinite(options.limit, `outbox.claimDue: option "limit"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const due: OutboxEntry[] = [];
      const ambiguous: OutboxEntry[] = [];

      // (1) Abandoned `sending` entries: lapsed leases, and the previous incarnation's under reclaimOwn.
      const rows = c.stmt(
        `SELECT ${OUTBOX_COLUMNS} FROM ${this.#t} INDEXED BY ${this.#t}_due WHERE due_at <= ? AND state = 'sending'`,
      ).all(now);
      if (options.reclaimOwn) {
        rows.push(
          ...c.stmt(`SELECT ${OUTBOX_COLUMNS} FROM ${this.#t} INDEXED BY ${this.#t}_due
            WHERE due_at IS NOT NULL AND lease_owner = ? AND state = 'sending' AND set_aside_seq IS NULL`).all(options.owner),
        );
      }
      const seen = new Set<number>();
      const lost = rows
        .filter((row) => !seen.has(num(row.seq)) && seen.add(num(row.seq)))
        .map((row) => this.#damaged.current(c, row, now))
        .filter((entry): entry is OutboxEntry => entry !== null && isLeaseAbandoned(entry.lease, now, options))
        .sort((a, b) => a.seq - b.seq);
      for (const cur of lost) {
        if (!cur.called) {
          // Its holder never announced a provider call: nothing was sent, it is due work again
          // (claimedOutbox keeps its attempts). It stays its chat's head: `sending`, due at its new expiry.
          if (!(due.length < options.limit)) continue; // left for a later scan
          const next = claimedOutbox(cur, now, options);
          if (this.#update(c, cur, next)) due.push(next);
        } else if (options.resendAmbiguous) {
          if (!(due.length < options.limit)) continue; // left for a later scan
          const next = claimedOutbox(cur, now, options);
          if (!this.#update(c, cur, next)) continue;
          ambiguous.push(next);
          due.push({ ...next, lease: { ...next.lease! } });
        } else {
          const next = ambiguousOutbox(cur, now);
          if (this.#update(c, cur, next)) ambiguous.push(next);
        }
      }

      // (2) Due chat heads (including those just freed by step 1), in seq order. Any state but `sending`
      // (step 1's): a head whose state was damaged is met here, and set aside.
      const page = Math.max(options.limit, 16);
      let after = 0;
      scan: while (due.length < options.limit) {
        const heads = c.stmt(
          `SELECT ${OUTBOX_COLUMNS}, due_at FROM ${this.#t} INDEXED BY ${this.#t}_due
          WHERE due_at <= ? AND state <> 'sending' AND seq > ? ORDER BY seq LIMIT ?`,
        ).all(now, after, page);
        for (const row of heads) {
          if (due.length >= options.limit) break;
          after = num(row.seq);
          const cur = this.#damaged.current(c, row, now);
          // Set aside: the next entry of its chat may be its head now, due: read on from here.
          if (!cur) continue scan;
          if (
            (cur.state !== "queued" && cur.state !== "failed") || (cur.nextAttemptAt ?? 0) > now ||
            this.#blocked(c, cur.chatId, cur.seq)
          ) {
            // Not (or no longer) first in its chat: drop the stale due mark.
            c.stmt(`UPDATE ${this.#t} SET due_at = NULL WHERE seq = ?`).run(cur.seq);
            this.#syncHead(c, cur.chatId);
            continue;
          }
          const next = claimedOutbox(cur, now, options);
          if (this.#update(c, cur, next)) due.push(next);
        }
        if (heads.length < page) break;
      }
      return { due, ambiguous };
    });
  }

  async heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `outbox.heartbeat: "leaseMs"`);
    return await this.#fenced("heartbeat", key, token, (entry, now) => extendedLease(entry, now, leaseMs));
  }

  async markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(key, `outbox.markCalling: "key"`);
    checkFinite(token, `outbox.markCalling: "token"`);
    checkFinite(leaseMs, `outbox.markCalling: "leaseMs"`);
    const c = await this.#gate.ready();
    // On the hot path (once per send): one conditional UPDATE, no read, no savepoint. Accepted as
    // heartbeat is (`sending`, leased with `token`); sets `called` and extends the lease (callingOutbox).
    return c.write((now) => {
      const expiresAt = now + leaseMs;
      return c.stmt(
        this.#sql.markCalling,
      ).run(expiresAt, expiresAt, key, token).changes === 1;
    }, true);
  }

  async markSent(key: string, token: number, messageId: string): Promise<void> {
    checkString(messageId, `outbox.markSent: "messageId"`);
    const done = await this.#fenced("markSent", key, token, (entry, now) => sentOutbox(entry, messageId, now), true);
    if (!done) throw new StaleLeaseError("outbox", key, token);
  }

  async markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    checkOutcome(outcome, "outbox.markFailed", true);
    // An ambiguous outcome: `unknown` (see failedOutbox); #update then due-marks the chat's next head,
    // as for claimDue's move of a lost send to `unknown`.
    const done = await this.#fenced(
      "markFailed",
      key,
      token,
      (entry, now) => failedOutbox(entry, outcome, now),
      true,
    );
    if (!done) throw new StaleLeaseError("outbox", key, token);
  }

  get(key: string): Promise<OutboxEntry | null> {
    checkId(key, `outbox.get: "key"`);
    return this.#damaged.get(key);
  }

  async list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    checkListFilter(options, "outbox.list");
    const c = await this.#gate.ready();
    const t = this.#t;
    for (;;) {
      const rows = listRows(c, t, OUTBOX_COLUMNS, "seq", {
        byOrder: null, // the primary key
        byChat: `${t}_chat_all`,
        byState: `${t}_state`,
      }, options);
      // Damaged rows met are set aside, and the list read again without them.
      const entries = await this.#damaged.readAll(c, rows);
      if (entries) return entries;
    }
  }

  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#damaged.list(options);
  }

  reportDamaged(key: string): Promise<boolean> {
    return this.#damaged.report(key);
  }

  async retry(key: string): Promise<boolean> {
    checkId(key, `outbox.retry: "key"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, key, now);
      const next = cur && requeuedOutbox(cur, now);
      if (!next) return false;
      // It is unsettled again: later queued/failed entries of its chat are no longer first.
      this.#unmarkBehind(c, cur.chatId, cur.seq);
      return this.#update(c, cur, next);
    });
  }

  async discard(key: string): Promise<boolean> {
    checkId(key, `outbox.discard: "key"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, key, now);
      if (!cur || cur.state === "sending") return false;
      c.stmt(`DELETE FROM ${this.#t} WHERE key = ? AND state <> 'sending'`).run(key);
      this.#syncHead(c, cur.chatId);
      return true;
    });
  }

  purge(olderThanMs: number): Promise<number> {
    return purgeInBatches(
      this.#gate,
      olderThanMs,
      `DELETE FROM ${this.#t} WHERE seq IN (
        SELECT seq FROM ${this.#t} INDEXED BY ${this.#t}_sent
        WHERE state = 'sent' AND updated_at <= ? AND set_aside_seq IS NULL LIMIT ${PURGE_BATCH})`,
    );
  }
}

// ---- public classes ----------------------------------------------------------

/** Set by {@link SQLiteStore.durability} for the constructor it calls. */
let adopted: Connection | undefined;

/**
 * A durability backend in a SQLite file: the inbox and outbox journals,
 * shared by the processes of one host (`scope: "host"`). Concurrent writes
 * share one transaction and one fsync (group commit, each operation in its
 * own savepoint; see the module documentation); every write resolves once
 * committed. A row that does not read back as a record is set aside, kept
 * as stored (see Damaged records in the module documentation; `damaged()` of
 * each journal lists them). Open it with
 * `open()` (the bot does in `start()`) and close it with `close()`; both are
 * reference-counted per instance. Use {@link SQLiteStore.durability} to keep
 * the journals in the same file (and connection) as the bot's session store.
 *
 * @example Journals only
 * ```ts
 * import { SQLiteDurability } from "@botmesh/durable/sqlite";
 *
 * const backend = new SQLiteDurability({ file: "./data/journal.db" });
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
 * await backend.close();
 * ```
 */
export class SQLiteDurability implements DurabilityBackend {
  /** Always `'sqlite'`. */
  readonly name: string = "sqlite";
  /** Shared by the processes of one host. */
  readonly scope: "host" = "host";
  /** The inbound journal. */
  readonly inbox: InboxJournal & DamagedRecords;
  /** The outbound journal. */
  readonly outbox: OutboxJournal & DamagedRecords;
  /** The database file. */
  readonly file: string;
  readonly #conn: Connection;
  /** References this instance holds on the connection. */
  #opens = 0;
  /** This instance's open()/close() steps, run one after the other in call order. */
  #lifecycle: Promise<unknown> = Promise.resolve();

  /**
   * @param options `file` (required), `busyTimeoutMs`, `synchronous`, `driver`, `tablePrefix`, `clock`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: SQLiteDurabilityOptions) {
    const conn = adopted ?? new Connection(resolveOptions(options));
    adopted = undefined;
    this.#conn = conn;
    this.file = conn.file;
    const gate: Gate = {
      prefix: conn.options.prefix,
      file: conn.file,
      ready: () => {
        const db = this.#opens > 0 ? conn.db : null;
        if (db) return Promise.resolve(conn);
        return Promise.reject(
          new Error(
            `SQLite durability on ${JSON.stringify(this.file)} is not open: call open() first (bot.start() does)`,
          ),
        );
      },
    };
    this.inbox = new SqliteInbox(gate);
    this.outbox = new SqliteOutbox(gate);
  }

  /** Whether this instance holds the database open. */
  get isOpen(): boolean {
    return this.#opens > 0;
  }

  /**
   * Counters of the group commits on this backend's connection (shared with
   * its {@link SQLiteStore} when it came from `store.durability()`): a snapshot.
   */
  get stats(): SQLiteStats {
    return this.#conn.stats;
  }

  /** The driver in use while open (`"bun:sqlite"`, `"node:sqlite"`, `"better-sqlite3"`), else `null`. */
  get driver(): SqliteDriverName | null {
    return this.#conn.db?.driver ?? null;
  }

  /** Runs an open/close step after the ones called before it (a failed step does not stop the next). */
  #step(work: () => Promise<void>): Promise<void> {
    const run = this.#lifecycle.then(work);
    this.#lifecycle = run.catch(() => {});
    return run;
  }

  /**
   * Opens the database (creating or upgrading its schema) on the first call;
   * later calls only count. `open()` and `close()` take effect in call order:
   * a `close()` called while an `open()` is still pending undoes that open.
   * @throws {Error} naming the file when it cannot be opened, is not a SQLite
   *   database, or has a newer schema; naming what to install when no driver is found
   */
  open(): Promise<void> {
    return this.#step(async () => {
      await this.#conn.acquire();
      this.#opens++;
    });
  }

  /**
   * Undoes one `open()` (one called before it, even if still pending; a
   * failed `open()` counts for nothing); the last one closes the connection
   * (unless its store still holds it).
   */
  close(): Promise<void> {
    return this.#step(async () => {
      if (this.#opens === 0) return;
      this.#opens--;
      await this.#conn.release();
    });
  }
}

/**
 * The bot's session store in a SQLite file: values are JSON, with an optional
 * time to live (an expired value is never returned; expired values are
 * deleted when read and swept at most once a minute on a write, or by
 * {@link SQLiteStore.purgeExpired}). `durability()` journals the bot's inbox
 * and outbox in the same file.
 *
 * The store opens its connection on first use, or by `await store.open()`
 * (which reports a bad file at once), and holds it until `store.close()`.
 * `set` and `delete` join the connection's group commit (with the journals'
 * writes when the backend came from `durability()`) and resolve once
 * committed; `get` reads at once.
 *
 * @example With a bot
 * ```ts
 * import { Bot } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 * import { SQLiteStore } from "@botmesh/durable/sqlite";
 *
 * const store = new SQLiteStore({ file: "./data/bot.db" });
 * const bot = new Bot({
 *   provider: new MockProvider(),
 *   store,
 *   durability: { backend: store.durability(), instanceId: "bot-1" },
 * });
 * bot.when(/hi/, (ctx) => ctx.reply("hello"));
 * await bot.start();
 * await store.set("chat:1", { step: 2 }, { ttlMs: 60_000 });
 * console.log(await store.get("chat:1")); // { step: 2 }
 * await bot.stop();
 * await store.close();
 * ```
 */
export class SQLiteStore implements SessionStore {
  /** The database file. */
  readonly file: string;
  readonly #conn: Connection;
  readonly #t: string;
  /** The store's own reference on the connection, while held. */
  #held: Promise<void> | null = null;
  #durability: SQLiteDurability | null = null;
  #lastSweep = 0;

  /**
   * @param options `file` (required), `busyTimeoutMs`, `synchronous`, `driver`, `tablePrefix`, `clock`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: SQLiteStoreOptions) {
    this.#conn = new Connection(resolveOptions(options));
    this.file = this.#conn.file;
    this.#t = `${this.#conn.options.prefix}session`;
  }

  /** The driver in use while open, else `null`. */
  get driver(): SqliteDriverName | null {
    return this.#conn.db?.driver ?? null;
  }

  /** Counters of the group commits on the store's connection (shared with its `durability()` backend): a snapshot. */
  get stats(): SQLiteStats {
    return this.#conn.stats;
  }

  /**
   * The durability backend journaling in this store's file, over the same
   * connection (one instance per store). Open and close it like any backend;
   * the connection stays open while either the store or the backend holds it.
   */
  durability(): SQLiteDurability {
    if (!this.#durability) {
      adopted = this.#conn;
      try {
        this.#durability = new SQLiteDurability({ file: this.file });
      } finally {
        adopted = undefined;
      }
    }
    return this.#durability;
  }

  /**
   * Opens the database now (otherwise the first get/set/delete does).
   * @throws {Error} naming the file when it cannot be opened
   */
  open(): Promise<void> {
    if (!this.#held) {
      const held = this.#conn.acquire();
      this.#held = held;
      held.catch(() => {
        if (this.#held === held) this.#held = null;
      });
    }
    return this.#held;
  }

  /** Releases the store's hold on the connection (a later use opens it again). */
  async close(): Promise<void> {
    const held = this.#held;
    if (!held) return;
    this.#held = null;
    try {
      await held;
    } catch {
      return;
    }
    await this.#conn.release();
  }

  async #ready(): Promise<Connection> {
    await this.open();
    return this.#conn;
  }

  /** The value of `key`, or `undefined` when absent or expired. */
  async get(key: string): Promise<JsonValue | undefined> {
    checkId(key, `Session key`);
    const c = await this.#ready();
    const row = c.stmt(`SELECT value, expires_at FROM ${this.#t} WHERE key = ?`).get(key);
    if (!row) return undefined;
    if (row.expires_at !== null && num(row.expires_at) <= this.#conn.options.clock()) {
      // Deleted with the next group commit; best effort: an expired value is never returned, deleted or not.
      await c.write((now) => c.stmt(`DELETE FROM ${this.#t} WHERE key = ? AND expires_at <= ?`).run(key, now))
        .catch(() => {});
      return undefined;
    }
    return jsonColumn(row.value, { file: this.file, table: this.#t }, "key", key, "value");
  }

  /** Stores `value` (JSON); with `ttlMs` it expires after that many ms. */
  async set(key: string, value: JsonValue, options?: { ttlMs?: number }): Promise<void> {
    const { text, ttlMs: ttl } = sessionEntry(key, value, options);
    const c = await this.#ready();
    await c.write((now) => {
      c.stmt(
        `INSERT INTO ${this.#t} (key, value, expires_at) VALUES (?, ?, ?)
        ON CONFLICT (key) DO UPDATE SET value = excluded.value, expires_at = excluded.expires_at`,
      ).run(key, text, ttl === null ? null : now + ttl);
      if (now - this.#lastSweep >= SESSION_SWEEP_MS) {
        this.#lastSweep = now;
        this.#sweep(c, now);
      }
    });
  }

  /** Deletes `key`. */
  async delete(key: string): Promise<void> {
    checkId(key, `Session key`);
    const c = await this.#ready();
    await c.write(() => c.stmt(`DELETE FROM ${this.#t} WHERE key = ?`).run(key));
  }

  /** Deletes every expired value now. @returns how many */
  async purgeExpired(): Promise<number> {
    const c = await this.#ready();
    let total = 0;
    for (;;) {
      const n = await c.write((now) => this.#sweep(c, now));
      total += n;
      if (n < SESSION_SWEEP_BATCH) return total;
    }
  }

  #sweep(c: Connection, now: number): number {
    return c.stmt(
      `DELETE FROM ${this.#t} WHERE key IN (
        SELECT key FROM ${this.#t} WHERE expires_at <= ? ORDER BY expires_at LIMIT ${SESSION_SWEEP_BATCH})`,
    ).run(now).changes;
  }
}
