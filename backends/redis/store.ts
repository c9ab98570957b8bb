/**
 * RedisStore: the bot's session store on Redis (see `mod.ts` for the user
 * documentation).
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import type { JsonValue } from "../../src/contract.ts";
import { checkId } from "../../src/rules.ts";
import { sessionEntry, type SessionStore } from "../../src/store.ts";
import { durabilityOn, type RedisDurability } from "./durability.ts";
import { resolveOptions, type RedisStoreOptions } from "./options.ts";
import { list, Runner } from "./runner.ts";

/**
 * The bot's session store on Redis: JSON values under `{keyPrefix}s:<key>`,
 * with an optional time to live (`SET … PX`, expired by Redis itself).
 * `durability()` journals the inbox and outbox with the same client and
 * prefix.
 *
 * @example
 * ```ts ignore
 * import Redis from "ioredis";
 * import { RedisStore } from "@botmesh/durable/redis";
 *
 * const store = new RedisStore({ client: new Redis(), keyPrefix: "shop-bot:" });
 * await store.set("chat:1", { step: 2 }, { ttlMs: 60_000 });
 * console.log(await store.get("chat:1")); // { step: 2 }
 * const backend = store.durability(); // give it to the Bot
 * ```
 */
export class RedisStore implements SessionStore {
  /** The key prefix. */
  readonly keyPrefix: string;
  readonly #runner: Runner;
  #durability: RedisDurability | null = null;

  /**
   * @param options `client` (required), `keyPrefix`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: RedisStoreOptions) {
    this.#runner = new Runner(resolveOptions(options, "RedisStore"));
    this.keyPrefix = this.#runner.keyPrefix;
  }

  /**
   * The durability backend over the same client and key prefix (one instance per store).
   * @returns the backend
   */
  durability(): RedisDurability {
    if (!this.#durability) {
      this.#durability = durabilityOn(this.#runner);
    }
    return this.#durability;
  }

  /**
   * @param key the session key
   * @returns the value of `key`, or `undefined` when absent or expired
   * @throws {Error} naming the key when the stored value is not JSON
   */
  async get(key: string): Promise<JsonValue | undefined> {
    checkId(key, `Session key`);
    const [raw] = list(await this.#runner.run("storeGet", [key]));
    if (raw === undefined) return undefined;
    try {
      return JSON.parse(String(raw)) as JsonValue;
    } catch (error) {
      throw new Error(
        `Redis session value at key ${JSON.stringify(`${this.#runner.tag}s:${key}`)} is not JSON (${errorMessage(error)})`,
      );
    }
  }

  /**
   * Stores `value` (JSON); with `ttlMs` it expires after that many ms.
   * @throws {RangeError} when `ttlMs` is not a positive number
   * @throws {TypeError} when `value` is not JSON
   */
  async set(key: string, value: JsonValue, options?: { ttlMs?: number }): Promise<void> {
    const { text, ttlMs: ttl } = sessionEntry(key, value, options);
    await this.#runner.run("storeSet", [key, text, ttl === null ? "" : String(Math.ceil(ttl))]);
  }

  /** Deletes `key`. */
  async delete(key: string): Promise<void> {
    checkId(key, `Session key`);
    await this.#runner.run("storeDelete", [key]);
  }
}
