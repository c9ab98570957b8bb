/**
 * RedisKv: a versioned key-value store on Redis (see `mod.ts` for the user
 * documentation).
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import type { BackendScope, DurableKv, JsonValue, KvEntry } from "../../src/contract.ts";
import { checkFinite, checkId, checkString } from "../../src/rules.ts";
import { showValue as show } from "../../src/show.ts";
import { type RedisKvOptions, resolveOptions } from "./options.ts";
import { list, Runner } from "./runner.ts";

function byteCompare(a: string, b: string): number {
  const x = new TextEncoder().encode(a);
  const y = new TextEncoder().encode(b);
  const n = Math.min(x.length, y.length);
  for (let i = 0; i < n; i++) if (x[i] !== y[i]) return x[i]! - y[i]!;
  return x.length - y.length;
}

/**
 * A {@link DurableKv} on Redis: versioned compare-and-set in one script per
 * call. A version is a number from one counter per key prefix, so it is never
 * reused (not even after a delete); `list` is in byte order (a sorted set
 * read `BYLEX`); `now()` is Redis `TIME`. Use it with `new KvDurability(kv)` or
 * as the shared outbox of `new EventsDurability({ journal, outbox: kv })`.
 *
 * @example
 * ```ts ignore
 * import Redis from "ioredis";
 * import { KvDurability } from "@botmesh/durable/kv";
 * import { RedisKv } from "@botmesh/durable/redis";
 *
 * const kv = new RedisKv({ client: new Redis(), keyPrefix: "shop-bot-kv:" });
 * const version = await kv.set("a", { n: 1 }, null); // create
 * console.log(await kv.set("a", { n: 2 }, version)); // a new version
 * const backend = new KvDurability(kv);
 * ```
 */
export class RedisKv implements DurableKv {
  /** Always `'redis'`. */
  readonly name: string = "redis";
  /** Shared by many hosts. */
  readonly scope: BackendScope = "shared";
  /** The key prefix. */
  readonly keyPrefix: string;
  readonly #runner: Runner;

  /**
   * @param options `client` (required), `keyPrefix`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: RedisKvOptions) {
    this.#runner = new Runner(resolveOptions(options, "RedisKv"));
    this.keyPrefix = this.#runner.keyPrefix;
  }

  #value(key: string, raw: unknown): JsonValue {
    try {
      return JSON.parse(String(raw)) as JsonValue;
    } catch (error) {
      throw new Error(
        `Redis kv value at key ${JSON.stringify(`${this.#runner.tag}kv:r:${key}`)}: field "v" is not JSON (${errorMessage(error)})`,
      );
    }
  }

  /**
   * @param key the key
   * @returns its value and version, or `null`
   */
  async get(key: string): Promise<KvEntry | null> {
    checkId(key, `kv.get: "key"`);
    const r = list(await this.#runner.run("kvGet", [key]));
    if (r.length < 2) return null;
    return { key, value: this.#value(key, r[0]), version: String(r[1]) };
  }

  /**
   * Writes `value` if the current version is `expectVersion` (`null`: the key
   * must not exist; `undefined`: unconditional).
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
      throw new TypeError(`kv.set: the value of ${JSON.stringify(key)} is not JSON: ${errorMessage(error)}`, { cause: error });
    }
    if (text === undefined) throw new TypeError(`kv.set: the value of ${JSON.stringify(key)} is not JSON, got ${show(value)}`);
    const mode = expectVersion === undefined ? "any" : expectVersion === null ? "absent" : "match";
    const [version] = list(await this.#runner.run("kvSet", [key, text, mode, expectVersion ?? ""]));
    return version === undefined ? null : String(version);
  }

  /**
   * Deletes `key` if its version is `expectVersion` (unconditional when `undefined`).
   * @returns whether a key was deleted
   */
  async delete(key: string, expectVersion?: string): Promise<boolean> {
    checkId(key, `kv.delete: "key"`);
    if (expectVersion !== undefined) checkString(expectVersion, `kv.delete: "expectVersion"`);
    const [done] = list(
      await this.#runner.run("kvDelete", [key, expectVersion === undefined ? "0" : "1", expectVersion ?? ""]),
    );
    return String(done) === "1";
  }

  /**
   * Keys starting with `prefix`, in byte order, after `after` when given, at most `limit`.
   * @returns the entries
   */
  async list(prefix: string, options?: { after?: string; limit?: number }): Promise<KvEntry[]> {
    checkString(prefix, `kv.list: "prefix"`);
    const after = options?.after;
    if (after !== undefined) checkString(after, `kv.list: option "after"`);
    const limitOpt = options?.limit;
    if (limitOpt !== undefined) checkFinite(limitOpt, `kv.list: option "limit"`);
    const limit = limitOpt === undefined ? -1 : Math.max(0, Math.floor(limitOpt));
    if (limit === 0) return [];
    const start = after !== undefined && byteCompare(after, prefix) >= 0
      ? `(${after}`
      : prefix === ""
      ? "-"
      : `[${prefix}`;
    const flat = list(await this.#runner.run("kvList", [start, prefix, String(limit)]));
    const out: KvEntry[] = [];
    for (let i = 0; i + 2 < flat.length; i += 3) {
      const key = String(flat[i]);
      out.push({ key, value: this.#value(key, flat[i + 1]), version: String(flat[i + 2]) });
    }
    return out;
  }

  /** @returns the server's clock (ms since epoch, Redis `TIME`) */
  now(): Promise<number> {
    return this.#runner.now();
  }
}
