/**
 * The conversation/session store interface, and an in-memory one.
 *
 * @module
 */
import type { JsonValue } from "./contract.ts";
import { checkId } from "./rules.ts";
import { showValue as show } from "./show.ts";

/** Conversation and session state of the bot, by key. */
export interface SessionStore {
  get(key: string): Promise<JsonValue | undefined>;
  /** Store `value`; with `ttlMs` it expires after that long. */
  set(key: string, value: JsonValue, options?: { ttlMs?: number }): Promise<void>;
  delete(key: string): Promise<void>;
}

/**
 * The checked arguments of a {@link SessionStore.set} for a store that keeps
 * values as JSON text.
 *
 * @param key the session key
 * @param value the value; must be JSON
 * @param options `ttlMs`: a positive number of ms, or absent
 * @returns the value's JSON text and the TTL (`null`: none)
 * @throws {RangeError} when `ttlMs` is not a positive number
 * @throws {TypeError} when `key` is not a string or `value` is not JSON
 */
export function sessionEntry(key: string, value: JsonValue, options?: { ttlMs?: number }): { text: string; ttlMs: number | null } {
  const ttl = options?.ttlMs;
  if (ttl !== undefined && (typeof ttl !== "number" || !(ttl > 0) || !Number.isFinite(ttl))) {
    throw new RangeError(`Option "ttlMs" must be a positive number, got ${show(ttl)}`);
  }
  checkId(key, `Session key`);
  let text: string | undefined;
  try {
    text = JSON.stringify(value);
  } catch (error) {
    throw new TypeError(`Session value of ${JSON.stringify(key)} is not JSON: ${(error as Error).message}`, { cause: error });
  }
  if (text === undefined) throw new TypeError(`Session value of ${JSON.stringify(key)} is not JSON, got ${show(value)}`);
  return { text, ttlMs: ttl ?? null };
}

/**
 * A {@link SessionStore} in memory (lost on restart).
 *
 * @example
 * ```ts
 * import { MemoryStore } from "@botmesh/durable";
 * const store = new MemoryStore();
 * await store.set("chat:1", { step: 2 }, { ttlMs: 60_000 });
 * console.log(await store.get("chat:1")); // { step: 2 }
 * ```
 */
export class MemoryStore implements SessionStore {
  #values = new Map<string, { value: JsonValue; expiresAt: number }>();

  get(key: string): Promise<JsonValue | undefined> {
    const item = this.#values.get(key);
    if (item && item.expiresAt <= Date.now()) this.#values.delete(key);
    return Promise.resolve(item && item.expiresAt > Date.now() ? structuredClone(item.value) : undefined);
  }

  set(key: string, value: JsonValue, options?: { ttlMs?: number }): Promise<void> {
    const ttl = options?.ttlMs;
    if (ttl !== undefined && (typeof ttl !== "number" || !(ttl > 0))) {
      return Promise.reject(new RangeError(`Option "ttlMs" must be a positive number, got ${String(ttl)}`));
    }
    this.#values.set(key, { value: structuredClone(value), expiresAt: ttl === undefined ? Infinity : Date.now() + ttl });
    return Promise.resolve();
  }

  delete(key: string): Promise<void> {
    this.#values.delete(key);
    return Promise.resolve();
  }
}
