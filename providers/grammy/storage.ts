/**
 * A grammY storage adapter (`read`, `write`, `delete`, `has`) on a
 * {@link SessionStore}, whose writes made while an update is handled take
 * effect with that update's done mark: a rerun of the update (after a crash,
 * or a retry after a throw) sees the value as it was before the update, and a
 * dead-lettered update's write never takes effect.
 *
 * Each value is stored as an envelope `{ v, by, prev }`: `by` is the inbound
 * record that wrote `v`, `prev` the value that record saw before it. A read
 * resolves it: written by this very record in an earlier run → `prev`; by a
 * record that is `done` (or purged: only `done` records are) → `v`; by a
 * record not done (pending, processing, failed, dead) → `prev`.
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import type { SessionStore } from "../../src/store.ts";
import { BoundedSet } from "../../src/bounded_map.ts";
import { checkKnownOptions } from "../../src/options.ts";
import { showValue as show } from "../../src/show.ts";

/** The key that marks a stored value as an envelope of this adapter. */
const MARK = "@botmesh/durable:session";
/** How many records found `done` are remembered, so that reading what they wrote costs no inbox read. */
const DONE_CACHE = 4096;

/** A value as this adapter stores it. `v` absent: deleted. `by` absent: written outside an update. */
interface Envelope {
  [MARK]: 1;
  v?: JsonValue;
  by?: string;
  prev?: JsonValue;
}

/** The run of the middleware a call descends from: one object per run (of one inbound record). */
export interface StorageRun {
  /** The inbound record id of the update being handled. */
  readonly id: string;
}

/** How a {@link DurableStorage} learns the run it is called in and the state of a record. */
export interface StorageHooks {
  /** The run the caller descends from, `undefined` outside one. */
  current(): StorageRun | undefined;
  /** The state of the inbound record `id`, `null` when there is none (purged). */
  stateOf(id: string): Promise<string | null>;
}

/** Options of {@link DurableGrammy.storage} and {@link durableStorage}. */
export interface DurableStorageOptions {
  /** Each write expires after this many ms (the store's `ttlMs`); default: never. */
  ttlMs?: number;
}

/**
 * grammY's `StorageAdapter` (and the plain storage of `@grammyjs/conversations`
 * v2), made durable: see {@link durableStorage}. Values must be JSON.
 */
export interface DurableStorageAdapter<T> {
  /** The value of `key` as the update being handled should see it, `undefined` when absent. */
  read(key: string): Promise<T | undefined>;
  /** Store `value` under `key`: it takes effect with the update being handled. */
  write(key: string, value: T): Promise<void>;
  /** Delete `key`: it takes effect with the update being handled. */
  delete(key: string): Promise<void>;
  /** Whether `key` has a value (as {@link read} resolves it). */
  has(key: string): Promise<boolean>;
}

/** What a run has read or written of one key: the value before the update, and the value now. */
interface Touched {
  base: JsonValue | undefined;
  current: JsonValue | undefined;
}

function isEnvelope(value: JsonValue | undefined): value is Envelope & JsonValue {
  return typeof value === "object" && value !== null && !Array.isArray(value) && (value as Record<string, unknown>)[MARK] === 1;
}

function copy<V>(value: V): V {
  return value === undefined ? value : structuredClone(value);
}

function checkKey(key: unknown): asserts key is string {
  if (typeof key !== "string" || key === "") throw new TypeError(`Argument "key" must be a non-empty string, got ${show(key)}`);
}

/**
 * Checks the arguments of {@link durableStorage} past `safe`.
 *
 * @param store the session store
 * @param options the options
 * @returns the TTL of each write, or `undefined`
 * @throws {TypeError} when `store` is not a session store or an option is unknown or of the wrong type
 * @throws {RangeError} when `ttlMs` is not a positive number
 */
export function checkStorageArguments(store: unknown, options: unknown): number | undefined {
  const s = store as Record<string, unknown> | null;
  if (typeof s !== "object" || s === null || typeof s.get !== "function" || typeof s.set !== "function" || typeof s.delete !== "function") {
    throw new TypeError(`Argument "store" must be a SessionStore (get, set and delete), got ${show(store)}`);
  }
  if (options === undefined) return undefined;
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`Argument "options" must be an object, got ${show(options)}`);
  }
  checkKnownOptions(options, ["ttlMs"], "storage option");
  const ttl = (options as DurableStorageOptions).ttlMs;
  if (ttl === undefined) return undefined;
  if (typeof ttl !== "number") throw new TypeError(`Option "ttlMs" must be a number, got ${show(ttl)}`);
  if (!(ttl > 0) || !Number.isFinite(ttl)) throw new RangeError(`Option "ttlMs" must be a positive number, got ${show(ttl)}`);
  return ttl;
}

/** The adapter: see the module documentation. */
export class DurableStorage<T> implements DurableStorageAdapter<T> {
  readonly #store: SessionStore;
  readonly #hooks: StorageHooks;
  readonly #set: { ttlMs: number } | undefined;
  /** Records found done (or purged): what they wrote has taken effect for good. */
  readonly #done = new BoundedSet<string>(DONE_CACHE);
  /** Per run, the keys it has read or written: a second read in the same run sees the run's own write. */
  readonly #runs = new WeakMap<StorageRun, Map<string, Promise<Touched>>>();

  /**
   * @param store the session store (checked by the caller)
   * @param hooks the run and the record states
   * @param ttlMs the TTL of each write
   */
  constructor(store: SessionStore, hooks: StorageHooks, ttlMs: number | undefined) {
    this.#store = store;
    this.#hooks = hooks;
    this.#set = ttlMs === undefined ? undefined : { ttlMs };
  }

  async read(key: string): Promise<T | undefined> {
    checkKey(key);
    return copy((await this.#touch(key, this.#hooks.current())).current) as T | undefined;
  }

  async has(key: string): Promise<boolean> {
    return (await this.read(key)) !== undefined;
  }

  async write(key: string, value: T): Promise<void> {
    checkKey(key);
    await this.#put(key, value === undefined ? undefined : value as JsonValue);
  }

  async delete(key: string): Promise<void> {
    checkKey(key);
    await this.#put(key, undefined);
  }

  async #put(key: string, value: JsonValue | undefined): Promise<void> {
    const run = this.#hooks.current();
    if (run === undefined) {
      // Outside an update: takes effect at once.
      if (value === undefined) await this.#store.delete(key);
      else await this.#store.set(key, { [MARK]: 1, v: value } as JsonValue, this.#set);
      return;
    }
    const touched = await this.#touch(key, run);
    const envelope: Envelope = { [MARK]: 1, by: run.id };
    if (value !== undefined) envelope.v = value;
    if (touched.base !== undefined) envelope.prev = touched.base;
    await this.#store.set(key, envelope as unknown as JsonValue, this.#set);
    touched.current = copy(value);
  }

  /** What `run` has of `key`, read from the store the first time (calls at once share that read). */
  #touch(key: string, run: StorageRun | undefined): Promise<Touched> {
    const load = async (): Promise<Touched> => {
      const base = await this.#resolve(key, run);
      return { base, current: base };
    };
    if (run === undefined) return load();
    let seen = this.#runs.get(run);
    if (seen === undefined) this.#runs.set(run, seen = new Map());
    let touched = seen.get(key);
    if (touched === undefined) {
      touched = load();
      seen.set(key, touched);
      // A failed read is not kept: the next call reads again.
      touched.catch(() => {
        if (seen.get(key) === touched) seen.delete(key);
      });
    }
    return touched;
  }

  /** The stored value of `key` as `run` (or a caller outside any run) should see it. */
  async #resolve(key: string, run: StorageRun | undefined): Promise<JsonValue | undefined> {
    const stored = await this.#store.get(key);
    if (!isEnvelope(stored)) return stored; // absent, or stored before this adapter: taken as it is
    const { v, by, prev } = stored;
    if (by === undefined) return v;
    // Written by an earlier run of this same update (a crash or a throw cut it off): the value before it.
    if (run !== undefined && by === run.id) return prev;
    return (await this.#isDone(by)) ? v : prev;
  }

  async #isDone(id: string): Promise<boolean> {
    if (this.#done.has(id)) return true;
    const state = await this.#hooks.stateOf(id);
    // Only done records are purged: a missing one was done.
    const done = state === null || state === "done";
    if (done) this.#done.add(id);
    return done;
  }
}
