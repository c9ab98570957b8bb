/**
 * An in-memory {@link DurableKv}: a map with versions, for tests and for
 * trying `new KvDurability()` without a server.
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import type { BackendScope, DurableKv, JsonValue, KvEntry } from "../../src/contract.ts";
import { cloneJson } from "../../src/rules.ts";

/** Options of {@link MemoryKv}. */
export interface MemoryKvOptions {
  /** The store clock in ms since epoch (default `() => Date.now()`). */
  clock?: () => number;
}

/**
 * Compares two keys in byte-wise (UTF-8) order. UTF-16 code unit order only
 * differs from it where a surrogate meets a unit in U+E000..U+FFFF.
 */
function compareKeys(a: string, b: string): number {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) {
    const x = a.charCodeAt(i);
    const y = b.charCodeAt(i);
    if (x !== y) return utf8Rank(x) - utf8Rank(y);
  }
  return a.length - b.length;
}

function utf8Rank(unit: number): number {
  if (unit >= 0xe000) return unit - 0x800;
  if (unit >= 0xd800) return unit + 0x2000;
  return unit;
}

/**
 * A {@link DurableKv} kept in a `Map` inside one process. Versions come from
 * one counter, so a version is never reused, not even after a delete. Values
 * are deep-copied in and out.
 *
 * @example Usage
 * ```ts
 * import { KvDurability } from "@botmesh/durable/kv";
 * import { MemoryKv } from "@botmesh/durable/memory";
 *
 * const kv = new MemoryKv();
 * const version = await kv.set("a", { n: 1 }, null); // create
 * await kv.set("a", { n: 2 }, version); // compare-and-set
 * const backend = new KvDurability(kv);
 * ```
 */
export class MemoryKv implements DurableKv {
  /** Always `'memory'`. */
  readonly name: string = "memory";
  /** Shared by the users of one process only. */
  readonly scope: BackendScope = "process";
  readonly #data = new Map<string, { value: JsonValue; version: string }>();
  /** Every key, in byte-wise order, so that `list` costs O(log n + listed). */
  readonly #sorted: string[] = [];
  readonly #clock: () => number;
  #counter = 0;

  /**
   * @param options.clock the store clock in ms since epoch (default `() => Date.now()`).
   * @throws {TypeError} when `clock` is not a function.
   */
  constructor(options?: MemoryKvOptions) {
    if (typeof options === "object" && options !== null) checkKnownOptions(options, ["clock"], "MemoryKv option");
    const clock = options?.clock ?? (() => Date.now());
    if (typeof clock !== "function") throw new TypeError(`MemoryKv option "clock" must be a function`);
    this.#clock = clock;
  }

  /**
   * Reads one key.
   * @param key the key.
   * @returns a copy of its value with its version, or `null`.
   */
  async get(key: string): Promise<KvEntry | null> {
    const slot = this.#data.get(key);
    return slot ? { key, value: cloneJson(slot.value), version: slot.version } : null;
  }

  /**
   * Writes one key, optionally only if its version is `expectVersion`.
   * @param key the key.
   * @param value the value (copied).
   * @param expectVersion `null`: the key must not exist; `undefined`: unconditional.
   * @returns the new version, or `null` when the condition failed.
   */
  async set(key: string, value: JsonValue, expectVersion?: string | null): Promise<string | null> {
    const slot = this.#data.get(key);
    if (expectVersion === null && slot) return null;
    if (typeof expectVersion === "string" && slot?.version !== expectVersion) return null;
    const version = String(++this.#counter);
    if (!slot) this.#sorted.splice(this.#lowerBound(key), 0, key);
    this.#data.set(key, { value: cloneJson(value), version });
    return version;
  }

  /**
   * Deletes one key, optionally only if its version is `expectVersion`.
   * @param key the key.
   * @param expectVersion the version it must have (unconditional when `undefined`).
   * @returns whether a key was deleted.
   */
  async delete(key: string, expectVersion?: string): Promise<boolean> {
    const slot = this.#data.get(key);
    if (!slot || (expectVersion !== undefined && slot.version !== expectVersion)) return false;
    this.#data.delete(key);
    this.#sorted.splice(this.#lowerBound(key), 1);
    return true;
  }

  /**
   * Keys starting with `prefix`, in byte-wise ascending order.
   * @param prefix the key prefix.
   * @param options.after only keys after this one; `options.limit` at most this many.
   * @returns copies of the entries.
   */
  async list(prefix: string, options?: { after?: string; limit?: number }): Promise<KvEntry[]> {
    const after = options?.after;
    const limit = Math.max(0, options?.limit ?? Infinity);
    const chosen: string[] = [];
    let i = this.#lowerBound(after !== undefined && compareKeys(after, prefix) >= 0 ? after : prefix);
    if (after !== undefined && this.#sorted[i] === after) i++;
    for (; i < this.#sorted.length && chosen.length < limit; i++) {
      const key = this.#sorted[i]!;
      if (!key.startsWith(prefix)) break;
      chosen.push(key);
    }
    return chosen.map((key) => {
      const slot = this.#data.get(key)!;
      return { key, value: cloneJson(slot.value), version: slot.version };
    });
  }

  /** The index of the first key not below `key`. */
  #lowerBound(key: string): number {
    let lo = 0;
    let hi = this.#sorted.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      if (compareKeys(this.#sorted[mid]!, key) < 0) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  /**
   * The store clock.
   * @returns ms since epoch.
   */
  async now(): Promise<number> {
    return this.#clock();
  }
}
