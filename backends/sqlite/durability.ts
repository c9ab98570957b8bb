/**
 * SQLiteDurability: the inbox and outbox journals in a SQLite file (see
 * `mod.ts` for the user documentation).
 *
 * @module
 */
import type { DamagedRecords, DurabilityBackend, InboxJournal, OutboxJournal } from "../../src/contract.ts";
import type { SqliteDriverName } from "../../src/runtime/sqlite.ts";
import { Connection, type Gate, type SQLiteStats } from "./connection.ts";
import { SqliteInbox } from "./inbox.ts";
import { resolveOptions, type SQLiteDurabilityOptions } from "./options.ts";
import { SqliteOutbox } from "./outbox.ts";

/**
 * The options objects made by {@link durabilityOn}, with the connection each
 * stands for: the constructor takes that connection instead of opening its own.
 */
const sharedConnections = new WeakMap<object, Connection>();

/**
 * A backend journaling over `conn` (for `SQLiteStore.durability()`, which
 * shares its connection): the public constructor, given options that stand
 * for `conn`.
 */
export function durabilityOn(conn: Connection): SQLiteDurability {
  const options: SQLiteDurabilityOptions = { file: conn.file };
  sharedConnections.set(options, conn);
  return new SQLiteDurability(options);
}

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
   * @param options `file` (required), `busyTimeoutMs`, `synchronous`, `driver`, `tablePrefix`, `clock`, `checkOnOpen`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: SQLiteDurabilityOptions) {
    const conn = sharedConnections.get(options) ?? new Connection(resolveOptions(options));
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
   * @throws {DamagedStorageError} naming the file when it is damaged (or not a SQLite database)
   * @throws {Error} naming the file when it cannot be opened or has a newer schema; naming what to
   *   install when no driver is found
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
