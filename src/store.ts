/**
 * The conversation/session store interface, and an in-memory one.
 *
 * @module
 */
import type { JsonValue } from "./backend.ts";

/** Conversation and session state of the bot, by key. */
export interface SessionStore {
  get(key: string): Promise<JsonValue | undefined>;
  /** Store `value`; with `ttlMs` it expires after that long. */
  set(key: string, value: JsonValue, options?: { ttlMs?: number }): Promise<void>;
  delete(key: string): Promise<void>;
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
