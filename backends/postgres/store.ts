/**
 * PostgresStore: the bot's session store in Postgres (see `mod.ts` for the
 * user documentation; the SQL text is in `sql.ts`).
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import { checkId } from "../../src/rules.ts";
import { sessionEntry, type SessionStore } from "../../src/store.ts";
import { Context } from "./connection.ts";
import { PostgresDurability } from "./durability.ts";
import { type PostgresStoreOptions, type Resolved, resolveOptions } from "./options.ts";
import { duration, inBatches, jsonColumn } from "./rows.ts";
import { sessionSql, type SessionSql } from "./sql.ts";

/** Expired session values are swept at most this often (on a `set`). */
const SESSION_SWEEP_MS = 60_000;

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
      ...(this.#options.clock ? { clock: this.#options.clock } : {}),
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
