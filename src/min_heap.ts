/**
 * A small binary min-heap, used by in-process backends for due scans and
 * retention queues (with lazy deletion: callers skip stale items on pop).
 *
 * @module
 */

/**
 * A binary min-heap ordered by `less`.
 *
 * @example Usage
 * ```ts
 * import { MinHeap } from "./min_heap.ts";
 *
 * const heap = new MinHeap<number>((a, b) => a < b);
 * heap.push(3);
 * heap.push(1);
 * heap.pop(); // 1
 * ```
 */
export class MinHeap<T> {
  #items: T[] = [];
  readonly #less: (a: T, b: T) => boolean;

  /** A heap where `less(a, b)` says that `a` comes out before `b`. */
  constructor(less: (a: T, b: T) => boolean) {
    this.#less = less;
  }

  /** How many items the heap holds (stale ones included). */
  get size(): number {
    return this.#items.length;
  }

  /** The smallest item, without removing it. */
  peek(): T | undefined {
    return this.#items[0];
  }

  /** Add an item. O(log n). */
  push(item: T): void {
    const items = this.#items;
    items.push(item);
    this.#up(items.length - 1);
  }

  /** Remove and return the smallest item. O(log n). */
  pop(): T | undefined {
    const items = this.#items;
    if (items.length === 0) return undefined;
    const top = items[0];
    const last = items.pop() as T;
    if (items.length > 0) {
      items[0] = last;
      this.#down(0);
    }
    return top;
  }

  /** Keep only the items for which `keep` is true. O(n). */
  retain(keep: (item: T) => boolean): void {
    this.#items = this.#items.filter(keep);
    for (let i = (this.#items.length >> 1) - 1; i >= 0; i--) this.#down(i);
  }

  #up(i: number): void {
    const items = this.#items;
    const item = items[i];
    while (i > 0) {
      const parent = (i - 1) >> 1;
      if (!this.#less(item, items[parent])) break;
      items[i] = items[parent];
      i = parent;
    }
    items[i] = item;
  }

  #down(i: number): void {
    const items = this.#items;
    const n = items.length;
    const item = items[i];
    for (;;) {
      const left = 2 * i + 1;
      if (left >= n) break;
      const right = left + 1;
      const child = right < n && this.#less(items[right], items[left]) ? right : left;
      if (!this.#less(items[child], item)) break;
      items[i] = items[child];
      i = child;
    }
    items[i] = item;
  }
}
