/**
 * The database connection shared by a store and its durability backend: open
 * while anyone holds it, prepared statements, and the group commit.
 *
 * @module
 */
import { DamagedStorageError } from "../../src/contract.ts";
import { errorMessage } from "../../src/errors.ts";
import { nextTurn } from "../../src/runtime/mod.ts";
import {
  isDamageError,
  openSqlite,
  type SqliteDatabase,
  type SqliteDriverName,
  type SqliteStatement,
} from "../../src/runtime/sqlite.ts";
import { checkPages, damagedFile } from "./damage.ts";
import type { ResolvedOptions } from "./options.ts";
import { migrate, SQLITE_SCHEMA_VERSION } from "./schema.ts";

/** Most operations one group commit carries, so that other processes get the write lock in between. */
const MAX_BATCH_OPS = 256;
/** A batch takes no further operation once it has held the write lock this long (ms). */
const MAX_BATCH_MS = 5;
/**
 * WAL pages (4 KiB) after which a commit copies the WAL back into the file (SQLite's default is 1,000).
 * Each message rewrites its rows and their index entries several times over a few commits; a longer
 * WAL lets a checkpoint copy each page once for many of those writes (a 100,000-message backlog
 * drained about 30% faster), for a WAL file that grows to about 40 MB between checkpoints.
 */
const WAL_AUTOCHECKPOINT_PAGES = 10_000;

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
/** The statements that end a transaction or savepoint: they still run once the file is found damaged. */
const CONTROL_SQL: ReadonlySet<string> = new Set(["BEGIN IMMEDIATE", "COMMIT", "ROLLBACK", SAVEPOINT_SQL, RELEASE_SQL, ROLLBACK_TO_SQL]);

/** One database connection, shared by a store and its backend, opened while anyone holds it. */
export class Connection {
  readonly options: ResolvedOptions;
  #db: SqliteDatabase | null = null;
  #refs = 0;
  #queue: Promise<unknown> = Promise.resolve();
  #statements = new Map<string, SqliteStatement>();
  /** Write operations waiting for the next batch, in call order. */
  #pending: PendingOp[] = [];
  #scheduled = false;
  #stats: SQLiteStats = { commits: 0, operations: 0, failedBatches: 0, largestBatch: 0 };
  /**
   * The damage a statement met (`SQLITE_CORRUPT`, `SQLITE_NOTADB`): from then on, until the connection is
   * opened again, every operation rejects with it, as what the file answers cannot be trusted.
   */
  #damage: DamagedStorageError | null = null;

  /** The batch's schema version check (built once: statements are looked up by their text). */
  readonly #versionSql: string;

  constructor(options: ResolvedOptions) {
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
      if (this.#refs === 0) {
        this.#db = await this.#open();
        this.#damage = null;
      }
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
      db.exec(`PRAGMA wal_autocheckpoint = ${WAL_AUTOCHECKPOINT_PAGES}`);
      if (this.options.checkOnOpen) checkPages(db, file);
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

  /**
   * A cached prepared statement. A driver error that reports damage is thrown as the connection's
   * {@link DamagedStorageError}, which every statement but a transaction's end throws from then on.
   */
  stmt(sql: string): SqliteStatement {
    let statement = this.#statements.get(sql);
    if (!statement) {
      const db = this.#db;
      if (!db) throw new Error(`SQLite file ${JSON.stringify(this.file)} was closed during the operation`);
      const control = CONTROL_SQL.has(sql);
      const raw = this.#guard(control, () => db.prepare(sql));
      statement = {
        run: (...params) => this.#guard(control, () => raw.run(...params)),
        get: (...params) => this.#guard(control, () => raw.get(...params)),
        all: (...params) => this.#guard(control, () => raw.all(...params)),
      };
      this.#statements.set(sql, statement);
    }
    return statement;
  }

  /** Runs a driver call, unless the file was found damaged (`control`: runs all the same); see {@link stmt}. */
  #guard<T>(control: boolean, call: () => T): T {
    if (this.#damage !== null && !control) throw this.#damage;
    try {
      return call();
    } catch (error) {
      if (!isDamageError(error)) throw error;
      this.#damage ??= damagedFile(this.file, errorMessage(error), { cause: error });
      throw this.#damage;
    }
  }

  /** The damage a statement met since the connection was opened, or `null`. */
  get damage(): DamagedStorageError | null {
    return this.#damage;
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
      if (this.#damage !== null) {
        reject(this.#damage);
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
    if (this.#damage !== null) {
      for (const op of this.#pending.splice(0)) op.reject(this.#damage);
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
    // Damage met by an operation: none of the batch is committed (what it read cannot be trusted).
    if (lost === undefined && this.#damage !== null) lost = this.#damage;
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
    if (this.#damage !== null) return this.#damage;
    const message = errorMessage(cause);
    const ops = count === 1 ? "its operation" : `its ${count} operations`;
    return new Error(
      `SQLite file ${JSON.stringify(this.file)}: ${what}, none of ${ops} took effect: ${message}`,
      { cause },
    );
  }
}

function wrapOpenError(file: string, driver: SqliteDriverName | null, error: unknown): Error {
  const message = errorMessage(error);
  if (error instanceof DamagedStorageError || message.includes("newer @botmesh/durable") || message.startsWith("No SQLite driver")) {
    return error as Error;
  }
  if (isDamageError(error)) return damagedFile(file, message, { cause: error, opening: true, driver, unreadable: true });
  const via = driver ? ` (${driver})` : "";
  const hint = /not a database|file is encrypted|malformed/i.test(message) ? ": it is not a SQLite database, or it is damaged" : "";
  return new Error(`Cannot open SQLite file ${JSON.stringify(file)}${via}${hint}: ${message}`, { cause: error });
}

/** Access to the connection for the journals: `ready()` rejects while their backend is not open. */
export interface Gate {
  /** The open connection, or a rejection naming the file. */
  ready(): Promise<Connection>;
  readonly prefix: string;
  /** The database file, for errors. */
  readonly file: string;
}
