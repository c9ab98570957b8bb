/**
 * Maps and sets that keep at most `capacity` keys: adding past it forgets the oldest.
 *
 * Eviction does not use `Map.prototype.keys().next()`: on JavaScriptCore that
 * walks past every deleted slot, so a map that evicts on each add spends O(n)
 * per add. The insertion order lives in an array with a moving head instead,
 * compacted once the head has passed `capacity` slots.
 *
 * @example
 * ```ts
 * import { BoundedSet } from "./bounded_map.ts";
 * const seen = new BoundedSet<string>(2);
 * seen.add("a"); seen.add("b"); seen.add("c");
 * console.assert(!seen.has("a") && seen.has("b") && seen.has("c"));
 * ```
 */
export class BoundedMap<K, V> {
  readonly capacity: number;
  #values = new Map<K, { value: V; seq: number }>();
  #order: K[] = [];
  #orderSeq: number[] = [];
  #head = 0;
  #next = 0;

  /**
   * @param capacity the most keys kept (a positive integer)
   * @throws {RangeError} when `capacity` is not a positive integer
   */
  constructor(capacity: number) {
    if (!Number.isInteger(capacity) || capacity < 1) {
      throw new RangeError(`Capacity must be a positive integer, got ${String(capacity)}`);
    }
    this.capacity = capacity;
  }

  /** @returns how many keys are kept */
  get size(): number {
    return this.#values.size;
  }

  /** @returns whether `key` is kept */
  has(key: K): boolean {
    return this.#values.has(key);
  }

  /** @returns the value kept under `key` */
  get(key: K): V | undefined {
    return this.#values.get(key)?.value;
  }

  /** Keep `value` under `key` (an existing key keeps its place in the order); the oldest goes when past capacity. */
  set(key: K, value: V): void {
    const slot = this.#values.get(key);
    if (slot !== undefined) {
      slot.value = value;
      return;
    }
    const seq = this.#next++;
    this.#values.set(key, { value, seq });
    this.#order.push(key);
    this.#orderSeq.push(seq);
    while (this.#values.size > this.capacity) {
      const oldest = this.#order[this.#head]!, oldestSeq = this.#orderSeq[this.#head]!;
      this.#head++;
      if (this.#values.get(oldest)?.seq === oldestSeq) this.#values.delete(oldest);
    }
    if (this.#head >= this.capacity || this.#order.length > 2 * this.capacity + 64) this.#compact();
  }

  /** @returns whether `key` was kept (it no longer is) */
  delete(key: K): boolean {
    return this.#values.delete(key);
  }

  #compact(): void {
    const order: K[] = [], orderSeq: number[] = [];
    for (let i = this.#head; i < this.#order.length; i++) {
      const key = this.#order[i]!, seq = this.#orderSeq[i]!;
      if (this.#values.get(key)?.seq === seq) {
        order.push(key);
        orderSeq.push(seq);
      }
    }
    this.#order = order;
    this.#orderSeq = orderSeq;
    this.#head = 0;
  }
}

/** A {@link BoundedMap} of keys only. */
export class BoundedSet<T> {
  #map: BoundedMap<T, true>;

  /**
   * @param capacity the most values kept (a positive integer)
   * @throws {RangeError} when `capacity` is not a positive integer
   */
  constructor(capacity: number) {
    this.#map = new BoundedMap(capacity);
  }

  /** @returns how many values are kept */
  get size(): number {
    return this.#map.size;
  }

  /** @returns whether `value` is kept */
  has(value: T): boolean {
    return this.#map.has(value);
  }

  /** Keep `value` (an existing one keeps its place); the oldest goes when past capacity. */
  add(value: T): void {
    this.#map.set(value, true);
  }

  /** @returns whether `value` was kept (it no longer is) */
  delete(value: T): boolean {
    return this.#map.delete(value);
  }
}
