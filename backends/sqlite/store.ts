/**
 * SQLiteStore: the bot's session store in a SQLite file (see `mod.ts` for the
 * user documentation).
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import { checkId } from "../../src/rules.ts";
import type { SqliteDriverName, SqliteValue } from "../../src/runtime/sqlite.ts";
import { sessionEntry, type SessionStore } from "../../src/store.ts";
import { Connection, type SQLiteStats } from "./connection.ts";
import { durabilityOn, type SQLiteDurability } from "./durability.ts";
import { resolveOptions, type SQLiteStoreOptions } from "./options.ts";
import { num } from "./rows.ts";

/** Expired session values are swept at most this often (on a write). */
const SESSION_SWEEP_MS = 60_000;
/** Expired session values deleted per sweep statement. */
const SESSION_SWEEP_BATCH = 500;

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
   * @param options `file` (required), `busyTimeoutMs`, `synchronous`, `driver`, `tablePrefix`, `clock`, `checkOnOpen`
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
      this.#durability = durabilityOn(this.#conn);
    }
    return this.#durability;
  }

  /**
   * Opens the database now (otherwise the first get/set/delete does).
   * @throws {Error} naming the file when it cannot be opened (a `DamagedStorageError` when it is damaged)
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
