/**
 * The bookkeeping both journals share: records in slots with a version, heap
 * items that go stale when their slot changes (lazy deletion), counts by
 * state, the index of leases by owner.
 *
 * @module
 */
import { cloneJson } from "../../src/rules.ts";

/** A record with the bookkeeping that keeps heap items honest. */
export interface Slot<R> {
  record: R;
  /** Bumped on every change; heap items carrying an older version are stale. */
  version: number;
  /** Admission order (ties of `receivedAt`). */
  order: number;
}

/** A heap item: record `id` is due at `at`, if it still has `version`. */
export interface HeapItem {
  at: number;
  id: string;
  version: number;
}

/** Heap order: the earliest due first. */
export const earlier = (a: HeapItem, b: HeapItem): boolean => a.at < b.at;
/** Heaps are rebuilt without their stale items once they exceed this and four times their live bound. */
export const COMPACT_MIN = 1024;

/** A deep copy: what goes in and what comes out of a journal is never shared with the caller. */
export function copy<T>(value: T): T {
  return cloneJson(value);
}

/** Counts records by state, so that a list of states none holds (`bot.idle()`'s) answers without a scan. */
export class StateCounts {
  readonly #counts = new Map<string, number>();
  move(from: string | undefined, to: string | undefined): void {
    if (from === to) return;
    if (from !== undefined) this.#counts.set(from, (this.#counts.get(from) ?? 0) - 1);
    if (to !== undefined) this.#counts.set(to, (this.#counts.get(to) ?? 0) + 1);
  }
  /** Whether no record is in any of `states` (`null`: all states). */
  noneIn(states: ReadonlySet<string> | null): boolean {
    if (states === null) return false;
    for (const state of states) if ((this.#counts.get(state) ?? 0) > 0) return false;
    return true;
  }
}

/** Adds `id` to the owner index. */
export function indexAdd(index: Map<string, Set<string>>, owner: string, id: string): void {
  let ids = index.get(owner);
  if (!ids) index.set(owner, ids = new Set());
  ids.add(id);
}

/** Removes `id` from the owner index. */
export function indexRemove(index: Map<string, Set<string>>, owner: string, id: string): void {
  const ids = index.get(owner);
  if (!ids) return;
  ids.delete(id);
  if (ids.size === 0) index.delete(owner);
}
