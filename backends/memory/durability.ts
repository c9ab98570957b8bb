/**
 * MemoryDurability (see `mod.ts` for the user documentation).
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import type { DurabilityBackend, InboundRecord, InboxJournal, OutboxEntry, OutboxJournal } from "../../src/contract.ts";
import { showValue as show } from "../../src/show.ts";
import { withStoredCalled } from "../../src/stored_records.ts";
import type { SetAsideRecord } from "./aside.ts";
import { MemoryInbox } from "./inbox.ts";
import { MemoryOutbox, type OutboxObserver } from "./outbox.ts";

/** Options of {@link MemoryDurability}. */
export interface MemoryDurabilityOptions {
  /** The backend clock in ms since epoch (default `() => Date.now()`). */
  clock?: () => number;
}

/**
 * A durability backend that keeps its journals in memory, for one process.
 * Records are plain objects; every record it returns is a deep copy, and so
 * is what it is given. Due scans cost O(due) (heaps with lazy deletion);
 * settled records are never scanned by them. An inbox due scan takes records
 * in arrival order (`receivedAt`, then admission order) and keeps each chat's
 * order: it looks at the active records of each chat it meets (an index kept
 * in arrival order) and leaves the records behind one held elsewhere.
 *
 * Nothing survives the process: use it for tests, or to share state between
 * several `Bot` instances of one process.
 *
 * No record leaves the process, so none is ever damaged: `damaged()` lists
 * nothing and `reportDamaged()` answers `false` (unless records set aside by
 * a loader were given to {@link MemoryDurability.importRecords}, as the file
 * backend does).
 *
 * @example Usage
 * ```ts
 * import { MemoryDurability } from "@botmesh/durable";
 *
 * const backend = new MemoryDurability();
 * await backend.inbox.admit({
 *   id: "m1",
 *   kind: "message",
 *   chatId: "c1",
 *   provider: "test",
 *   payload: { text: "hi" },
 *   receivedAt: Date.now(),
 * });
 * const [record] = await backend.inbox.claimDue({
 *   owner: "host/bot/1",
 *   incarnation: "a",
 *   leaseMs: 60_000,
 *   limit: 10,
 * });
 * await backend.inbox.complete(record!.id, record!.lease!.token);
 * console.log((await backend.inbox.get("m1"))?.state); // "done"
 * ```
 *
 * @example A controlled clock
 * ```ts
 * import { MemoryDurability } from "@botmesh/durable";
 *
 * let now = 0;
 * const backend = new MemoryDurability({ clock: () => now });
 * now += 60_000; // leases taken before now lapse
 * ```
 */
export class MemoryDurability implements DurabilityBackend {
  /** Always `'memory'`. */
  readonly name: string = "memory";
  /** Shared by the `Bot` instances of one process only. */
  readonly scope: "process" = "process";
  /** The inbound journal. */
  readonly inbox: InboxJournal;
  /** The outbound journal. */
  readonly outbox: OutboxJournal;
  readonly #inbox: MemoryInbox;
  readonly #outbox: MemoryOutbox;

  /**
   * @param options.clock the backend clock in ms since epoch (default `() => Date.now()`).
   * @throws {TypeError} when an option has the wrong type.
   */
  constructor(options?: MemoryDurabilityOptions) {
    if (options !== undefined && (typeof options !== "object" || options === null)) {
      throw new TypeError(`Memory durability options must be an object, got ${show(options)}`);
    }
    if (options !== undefined) checkKnownOptions(options, ["clock"], "MemoryDurability option");
    const clock = options?.clock ?? (() => Date.now());
    if (typeof clock !== "function") {
      throw new TypeError(`Memory durability option "clock" must be a function, got ${show(clock)}`);
    }
    const now = (): number => {
      const time = clock();
      if (typeof time !== "number" || !Number.isFinite(time)) {
        throw new TypeError(`Memory durability option "clock" must return a finite number, got ${show(time)}`);
      }
      return time;
    };
    this.inbox = this.#inbox = new MemoryInbox(now);
    this.outbox = this.#outbox = new MemoryOutbox(now);
  }

  /**
   * Every record, for a backend that snapshots this state (the file backend).
   * The records are this backend's own objects, not copies: serialize them at
   * once and never change them (a change replaces a record, so a snapshot
   * taken synchronously stays consistent).
   *
   * @returns inbox records in admission order, outbox entries in reservation
   *   order (ascending `seq`), the last outbox `seq` issued, and the records
   *   set aside as damaged (inbox first, each journal's in the order they were)
   */
  exportRecords(): MemoryRecords {
    const { entries, seq } = this.#outbox.exportEntries();
    return {
      inbox: this.#inbox.exportRecords(),
      outbox: entries,
      outboxSeq: seq,
      damaged: [...this.#inbox.exportAside(), ...this.#outbox.exportAside()],
    };
  }

  /**
   * Loads records saved by {@link exportRecords} into this backend, which must
   * be empty. The objects are adopted, not copied: the caller must not keep or
   * change them. Record fields are not validated here (the caller does).
   * Admission order, reservation order, the outbox `seq` counter and every
   * fencing token are kept. Records in `damaged` (set aside by the loader)
   * are listed by each journal's `damaged()`; their ids stay taken.
   *
   * @param records what `exportRecords()` returned (or its JSON round trip)
   * @throws {Error} when the backend already holds records
   * @throws {RangeError} when an id or key appears twice, or outbox entries are not in ascending `seq` order
   *   (the backend may then be partly loaded: discard it)
   */
  importRecords(records: MemoryRecords): void {
    const aside = records.damaged ?? [];
    this.#inbox.importRecords(records.inbox, aside);
    this.#outbox.importEntries(records.outbox.map(withStoredCalled), records.outboxSeq, aside);
  }

  /**
   * Tells `observer`, synchronously, of every outbox entry stored (its new
   * value, the backend's own object: never change it) or deleted (`null`:
   * discarded or purged), including entries stored by `importRecords` and
   * {@link applyOutboxChanges}. For a journal that tracks its changes (the
   * events journal's sidecar). One observer at a time; `null` removes it.
   *
   * @param observer the observer, or `null`
   */
  observeOutbox(observer: OutboxObserver | null): void {
    this.#outbox.observe(observer);
  }

  /**
   * Replays outbox changes recorded elsewhere (through {@link observeOutbox}):
   * deletes the `removed` keys, then stores `entries` (new ones after the
   * others, in `seq` order; an existing key's entry is replaced in place), and
   * raises the `seq` counter to `seq`. Idempotent: applying a set twice, or a
   * set the state already holds, leaves the same state. Entries are adopted,
   * not copied, and not validated.
   *
   * @param entries entries as they are now
   * @param removed keys deleted (a key both removed and given, with the same `seq`, is left in place)
   * @param seq the last `seq` issued
   */
  applyOutboxChanges(entries: readonly OutboxEntry[], removed: readonly string[], seq: number): void {
    this.#outbox.applyEntries(entries.map(withStoredCalled), removed, seq);
  }
}

/** Every record of a {@link MemoryDurability}, as {@link MemoryDurability.exportRecords} returns them. */
export interface MemoryRecords {
  /** Inbox records in admission order. */
  inbox: InboundRecord[];
  /** Outbox entries in reservation order (ascending `seq`). */
  outbox: OutboxEntry[];
  /** The last outbox `seq` issued: at least the largest `seq` of `outbox` (entries may have been purged or discarded). */
  outboxSeq: number;
  /** Records set aside as damaged by whoever loaded them (none when absent), each journal's in the order they were. */
  damaged?: SetAsideRecord[];
}
