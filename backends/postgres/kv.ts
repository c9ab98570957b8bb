/**
 * PostgresKv: a versioned key-value store in Postgres (see `mod.ts` for the
 * user documentation; the SQL text is in `sql.ts`).
 *
 * @module
 */
import type { BackendScope, DurableKv, JsonValue, KvEntry } from "../../src/contract.ts";
import { checkFinite, checkId, checkString } from "../../src/rules.ts";
import { showValue as show } from "../../src/show.ts";
import { Context, type Row } from "./connection.ts";
import { type PostgresKvOptions, resolveOptions } from "./options.ts";
import { jsonColumn } from "./rows.ts";
import { kvSql, type KvSql } from "./sql.ts";

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
