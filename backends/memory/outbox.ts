/**
 * The outbox journal in memory: due scans by a heap of leases and chat
 * heads, each chat's unsettled entries in `seq` order.
 *
 * @module
 */
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  type DamagedRecords,
  type FailOutcome,
  type ListOptions,
  type NewOutboxEntry,
  type OutboxClaim,
  type OutboxEntry,
  type OutboxJournal,
  type OutboxState,
  type ReserveResult,
  StaleLeaseError,
} from "../../src/contract.ts";
import {
  acceptsOutcome,
  ambiguousOutbox,
  BLOCKING_OUTBOX_STATES,
  callingOutbox,
  checkClaim,
  checkFinite,
  checkId,
  checkNewOutbox,
  checkOutcome,
  checkString,
  claimedOutbox,
  extendedLease,
  failedOutbox,
  isLeaseAbandoned,
  isLeasedWith,
  matchesList,
  newOutboxEntry,
  normalizeList,
  outboxDueAt,
  requeuedOutbox,
  sentOutbox,
} from "../../src/rules.ts";
import { OUTBOX } from "../../src/machine.ts";
import { MinHeap } from "../../src/min_heap.ts";
import { copyClaim, isEmptyClaim, ScanAnswers } from "../../src/scan_answers.ts";
import { AsideList, type SetAsideRecord } from "./aside.ts";
import { COMPACT_MIN, copy, earlier, type HeapItem, indexAdd, indexRemove, type Slot, StateCounts } from "./slots.ts";

/** Whether an outbox state holds back later sends of its chat. */
function blocking(state: OutboxState): boolean {
  return BLOCKING_OUTBOX_STATES.includes(state);
}

/** A chat's unsettled entries, ascending by `seq`. */
type ChatQueue = { seq: number; key: string }[];

/** Index of the first item with `seq >= seq`. */
function lowerBound(queue: ChatQueue, seq: number): number {
  let lo = 0;
  let hi = queue.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (queue[mid].seq < seq) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

export class MemoryOutbox implements OutboxJournal, DamagedRecords {
  readonly #now: () => number;
  readonly #slots = new Map<string, Slot<OutboxEntry>>();
  /** Entries a loader set aside as damaged (never in `#slots`). */
  readonly #aside = new AsideList("outbox");
  /** `sending` entries (by lease expiry) and chat heads (by `nextAttemptAt`). */
  readonly #due = new MinHeap<HeapItem>(earlier);
  /** `sent` entries by `updatedAt`, for `purge`. */
  readonly #sent = new MinHeap<HeapItem>(earlier);
  readonly #leased = new Map<string, Set<string>>();
  readonly #chats = new Map<string, ChatQueue>();
  readonly #states = new StateCounts();
  #version = 0;
  #seq = 0;
  /** Told synchronously of every entry stored or deleted (see {@link MemoryDurability.observeOutbox}). */
  #observer: OutboxObserver | null = null;

  readonly #answers: ScanAnswers<OutboxClaim>;

  constructor(now: () => number) {
    this.#now = now;
    this.#answers = new ScanAnswers<OutboxClaim>(() => ({ due: [], ambiguous: [] }), isEmptyClaim);
  }

  #valid = (item: HeapItem): boolean => this.#slots.get(item.id)?.version === item.version;

  #head(chatId: string): string | undefined {
    return this.#chats.get(chatId)?.[0]?.key;
  }

  #isHead(entry: OutboxEntry): boolean {
    return this.#head(entry.chatId) === entry.key;
  }

  /** Whether a due scan must see `entry`: leased, or a blocking chat head. */
  #watched(entry: OutboxEntry): boolean {
    return OUTBOX[entry.state].leased || (blocking(entry.state) && this.#isHead(entry));
  }

  #chatInsert(entry: OutboxEntry): void {
    let queue = this.#chats.get(entry.chatId);
    if (!queue) this.#chats.set(entry.chatId, queue = []);
    queue.splice(lowerBound(queue, entry.seq), 0, { seq: entry.seq, key: entry.key });
  }

  #chatRemove(entry: OutboxEntry): void {
    const queue = this.#chats.get(entry.chatId);
    if (!queue) return;
    const i = lowerBound(queue, entry.seq);
    if (queue[i]?.key === entry.key) queue.splice(i, 1);
    if (queue.length === 0) this.#chats.delete(entry.chatId);
  }

  /** Gives the slot a new version and, when watched, a heap item. */
  #bump(slot: Slot<OutboxEntry>): void {
    const version = slot.version = ++this.#version;
    const entry = slot.record;
    const at = this.#watched(entry) ? outboxDueAt(entry) : null;
    if (at !== null) this.#due.push({ at, id: entry.key, version });
    if (OUTBOX[entry.state].purgeable) this.#sent.push({ at: entry.updatedAt, id: entry.key, version });
  }

  /**
   * Stores `next` in `slot` (a new slot when omitted; `null` deletes the
   * slot's entry) and keeps every index in step. When the chat's head changes,
   * the new head gets a heap item so that the due scan finds it.
   */
  #store(next: OutboxEntry | null, slot?: Slot<OutboxEntry>): void {
    const prev = slot?.record;
    const entry = (next ?? prev)!;
    this.#states.move(prev?.state, next?.state);
    const headBefore = this.#head(entry.chatId);
    if (prev?.lease) indexRemove(this.#leased, prev.lease.owner, prev.key);
    if (next?.lease) indexAdd(this.#leased, next.lease.owner, next.key);
    const wasBlocking = prev !== undefined && blocking(prev.state);
    const isBlocking = next !== null && blocking(next.state);
    if (wasBlocking && !isBlocking) this.#chatRemove(prev);
    if (!wasBlocking && isBlocking) this.#chatInsert(next);
    if (next === null) {
      this.#slots.delete(entry.key);
    } else if (slot) {
      slot.record = next;
      this.#bump(slot);
    } else {
      slot = { record: next, version: 0, order: next.seq };
      this.#slots.set(next.key, slot);
      this.#bump(slot);
    }
    const headAfter = this.#head(entry.chatId);
    if (headAfter !== undefined && headAfter !== headBefore && headAfter !== entry.key) {
      this.#bump(this.#slots.get(headAfter)!);
    }
    this.#compact();
    this.#observer?.(entry.key, next);
  }

  /** Sets (or with `null` removes) the observer of stored and deleted entries. */
  observe(observer: OutboxObserver | null): void {
    this.#observer = observer;
  }

  /**
   * Replays a change set: deletes `removed` keys, then stores `entries`
   * (inserted or replacing the entry of their key), and raises the `seq`
   * counter to `seq`. A key both removed and given whose current entry has
   * the given entry's `seq` is replaced in place (the set was already applied).
   */
  applyEntries(entries: readonly OutboxEntry[], removed: readonly string[], seq: number): void {
    const given = new Map<string, OutboxEntry>();
    for (const entry of entries) given.set(entry.key, entry);
    for (const key of removed) {
      const slot = this.#slots.get(key);
      if (!slot || given.get(key)?.seq === slot.record.seq) continue;
      this.#store(null, slot);
    }
    const sorted = [...given.values()].sort((a, b) => a.seq - b.seq);
    for (const entry of sorted) {
      this.#store(entry, this.#slots.get(entry.key));
      if (entry.seq > this.#seq) this.#seq = entry.seq;
    }
    if (seq > this.#seq) this.#seq = seq;
  }

  #compact(): void {
    const bound = 4 * this.#slots.size;
    if (this.#due.size > COMPACT_MIN && this.#due.size > bound) this.#due.retain(this.#valid);
    if (this.#sent.size > COMPACT_MIN && this.#sent.size > bound) this.#sent.retain(this.#valid);
  }

  #held(key: string, token: number): Slot<OutboxEntry> | null {
    const slot = this.#slots.get(key);
    if (!slot || !isLeasedWith(slot.record, token)) return null;
    return slot;
  }

  /** The slot of `key` when it accepts the outcome of the call made under `token` (see {@link acceptsOutcome}). */
  #resolvable(key: string, token: number): Slot<OutboxEntry> | null {
    const slot = this.#slots.get(key);
    if (!slot || !acceptsOutcome(slot.record, token)) return null;
    return slot;
  }

  async reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    if (lease !== undefined) checkClaim(lease, "outbox.reserve");
    const input = checkNewOutbox(entry);
    const existing = this.#slots.get(input.key);
    if (existing) return { status: "exists", entry: copy(existing.record) };
    // The key is journaled, but its entry cannot be read: whether it was sent is unknown.
    const damaged = this.#aside.error(input.key);
    if (damaged) throw damaged;
    const clear = this.#head(input.chatId) === undefined;
    const next = newOutboxEntry(
      input,
      ++this.#seq,
      this.#now(),
      clear ? lease : undefined,
    );
    this.#store(next);
    return { status: OUTBOX[next.state].leased ? "leased" : "queued", entry: copy(next) };
  }

  /** Pops every valid item due at `now` into `popped` (by key). */
  #drain(now: number, popped: Map<string, HeapItem>): void {
    for (let top = this.#due.peek(); top !== undefined && top.at <= now; top = this.#due.peek()) {
      this.#due.pop();
      if (this.#valid(top)) popped.set(top.id, top);
    }
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    checkClaim(options, "outbox.claimDue");
    checkFinite(options.limit, `outbox.claimDue: option "limit"`);
    return this.#answers.answer(options, () => this.#scanDue(options), copyClaim);
  }

  #scanDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): OutboxClaim {
    const now = this.#now();
    const due: OutboxEntry[] = [];
    const ambiguous: OutboxEntry[] = [];
    const popped = new Map<string, HeapItem>();
    this.#drain(now, popped);

    // (1) Abandoned `sending` entries: lapsed leases, and our previous incarnation's.
    const sending = new Map<string, Slot<OutboxEntry>>();
    for (const key of popped.keys()) {
      const slot = this.#slots.get(key)!;
      if (OUTBOX[slot.record.state].due === "leaseExpiry") sending.set(key, slot);
    }
    if (options.reclaimOwn) {
      for (const key of this.#leased.get(options.owner) ?? []) sending.set(key, this.#slots.get(key)!);
    }
    const lost = [...sending.values()]
      .filter((slot) => isLeaseAbandoned(slot.record.lease, now, options))
      .sort((a, b) => a.record.seq - b.record.seq);
    for (const slot of lost) {
      if (!slot.record.called) {
        // Its holder never announced a provider call: nothing was sent, it is due work again.
        if (!(due.length < options.limit)) continue; // left for a later scan
        const next = claimedOutbox(slot.record, now, options);
        this.#store(next, slot);
        due.push(copy(next));
      } else if (options.resendAmbiguous) {
        if (!(due.length < options.limit)) continue; // left for a later scan
        const next = claimedOutbox(slot.record, now, options);
        this.#store(next, slot);
        ambiguous.push(copy(next));
        due.push(copy(next));
      } else {
        const next = ambiguousOutbox(slot.record, now);
        this.#store(next, slot);
        ambiguous.push(copy(next));
      }
    }

    // (2) Due chat heads, including those just freed by step (1).
    this.#drain(now, popped);
    const heads: Slot<OutboxEntry>[] = [];
    for (const item of popped.values()) {
      const slot = this.#slots.get(item.id);
      if (!slot || slot.version !== item.version) continue;
      const entry = slot.record;
      if (
        OUTBOX[entry.state].due === "nextAttemptAt" && this.#isHead(entry) &&
        (entry.nextAttemptAt ?? 0) <= now
      ) heads.push(slot);
    }
    heads.sort((a, b) => a.record.seq - b.record.seq);
    for (const slot of heads) {
      if (!(due.length < options.limit)) break;
      const next = claimedOutbox(slot.record, now, options);
      this.#store(next, slot);
      due.push(copy(next));
    }

    // Unchanged entries that the scan must still watch go back into the heap.
    for (const item of popped.values()) {
      if (this.#valid(item) && this.#watched(this.#slots.get(item.id)!.record)) this.#due.push(item);
    }
    return { due, ambiguous };
  }

  async heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(key, `outbox.heartbeat: "key"`);
    checkFinite(token, `outbox.heartbeat: "token"`);
    checkFinite(leaseMs, `outbox.heartbeat: "leaseMs"`);
    const slot = this.#held(key, token);
    if (!slot) return false;
    this.#store(extendedLease(slot.record, this.#now(), leaseMs), slot);
    return true;
  }

  async markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(key, `outbox.markCalling: "key"`);
    checkFinite(token, `outbox.markCalling: "token"`);
    checkFinite(leaseMs, `outbox.markCalling: "leaseMs"`);
    const slot = this.#held(key, token);
    if (!slot) return false;
    this.#store(callingOutbox(slot.record, this.#now(), leaseMs), slot);
    return true;
  }

  async markSent(key: string, token: number, messageId: string): Promise<void> {
    checkId(key, `outbox.markSent: "key"`);
    checkFinite(token, `outbox.markSent: "token"`);
    checkString(messageId, `outbox.markSent: "messageId"`);
    const slot = this.#resolvable(key, token);
    if (!slot) throw new StaleLeaseError("outbox", key, token);
    this.#store(sentOutbox(slot.record, messageId, this.#now()), slot);
  }

  async markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    checkId(key, `outbox.markFailed: "key"`);
    checkFinite(token, `outbox.markFailed: "token"`);
    checkOutcome(outcome, "outbox.markFailed", true);
    const slot = this.#resolvable(key, token);
    if (!slot) throw new StaleLeaseError("outbox", key, token);
    // #store moves the state counters, the lease index, the chat queue and the due heap (an ambiguous
    // outcome leaves the chat queue like claimDue's move to `unknown`, and the chat's next head gets a heap item).
    this.#store(failedOutbox(slot.record, outcome, this.#now()), slot);
  }

  async get(key: string): Promise<OutboxEntry | null> {
    checkId(key, `outbox.get: "key"`);
    const slot = this.#slots.get(key);
    if (slot) return copy(slot.record);
    const damaged = this.#aside.error(key);
    if (damaged) throw damaged;
    return null;
  }

  async damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#aside.list(options);
  }

  async reportDamaged(key: string): Promise<boolean> {
    return this.#aside.report(key);
  }

  async list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    const filter = normalizeList(options);
    const out: OutboxEntry[] = [];
    if (filter.limit === 0 || this.#states.noneIn(filter.states)) return out;
    // Map order is reservation order: keys are never re-inserted.
    for (const slot of this.#slots.values()) {
      if (!matchesList(slot.record, filter)) continue;
      out.push(copy(slot.record));
      if (out.length >= filter.limit) break;
    }
    return out;
  }

  async retry(key: string): Promise<boolean> {
    checkId(key, `outbox.retry: "key"`);
    const slot = this.#slots.get(key);
    if (!slot) return false;
    const requeued = requeuedOutbox(slot.record, this.#now());
    if (!requeued) return false;
    this.#store(requeued, slot);
    return true;
  }

  async discard(key: string): Promise<boolean> {
    checkId(key, `outbox.discard: "key"`);
    const slot = this.#slots.get(key);
    if (!slot || !OUTBOX[slot.record.state].discardable) return false;
    this.#store(null, slot);
    return true;
  }

  /** The entries set aside as damaged, in the order they were (not copies). */
  exportAside(): SetAsideRecord[] {
    return this.#aside.export();
  }

  /** The live entries in reservation order (not copies), and the last `seq` issued. */
  exportEntries(): { entries: OutboxEntry[]; seq: number } {
    const entries: OutboxEntry[] = new Array(this.#slots.size);
    let i = 0;
    for (const slot of this.#slots.values()) entries[i++] = slot.record;
    return { entries, seq: this.#seq };
  }

  /**
   * Adopts `entries` (ascending `seq`) and the outbox entries of `aside` into an empty journal; the next
   * `seq` issued is above `seq` and every entry's.
   */
  importEntries(entries: readonly OutboxEntry[], seq: number, aside: readonly SetAsideRecord[]): void {
    if (this.#slots.size > 0) throw new Error("importEntries needs an empty outbox");
    this.#aside.import(aside);
    const seen = new Set<string>();
    let last = 0;
    for (const entry of entries) {
      if (seen.has(entry.key)) throw new RangeError(`importEntries: outbox key ${JSON.stringify(entry.key)} appears twice`);
      if (!(entry.seq > last)) {
        throw new RangeError(`importEntries: outbox entries must be in ascending "seq" order (${entry.seq} after ${last})`);
      }
      seen.add(entry.key);
      last = entry.seq;
    }
    for (const entry of entries) this.#store(entry);
    this.#seq = Math.max(seq, last);
  }

  async purge(olderThanMs: number): Promise<number> {
    const cutoff = this.#now() - olderThanMs;
    let count = 0;
    for (let top = this.#sent.peek(); top !== undefined && top.at <= cutoff; top = this.#sent.peek()) {
      this.#sent.pop();
      const state = this.#valid(top) ? this.#slots.get(top.id)!.record.state : null;
      if (state === null || !OUTBOX[state].purgeable) continue;
      this.#slots.delete(top.id);
      this.#states.move(state, undefined);
      this.#observer?.(top.id, null);
      count++;
    }
    return count;
  }
}

/** Told of an outbox entry stored (`entry`) or deleted (`null`); see {@link MemoryDurability.observeOutbox}. */
export type OutboxObserver = (key: string, entry: OutboxEntry | null) => void;
