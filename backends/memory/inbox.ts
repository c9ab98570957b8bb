/**
 * The inbox journal in memory: due scans by a heap, each chat's active
 * records in arrival order.
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
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type ListOptions,
  type NewInboundRecord,
  StaleLeaseError,
} from "../../src/contract.ts";
import {
  ACTIVE_INBOX_STATES,
  admitsLeased,
  checkClaim,
  checkFinite,
  checkId,
  checkNewInbound,
  checkOutcome,
  checkAttempt,
  claimedInbound,
  scheduledInbound,
  startedInbound,
  doneInbound,
  extendedLease,
  failedFields,
  holdsChat,
  inboxDueAt,
  isInboxClaimable,
  isLeasedWith,
  matchesList,
  newInboundRecord,
  normalizeList,
  replayedInbound,
} from "../../src/rules.ts";
import { INBOX } from "../../src/machine.ts";
import { MinHeap } from "../../src/min_heap.ts";
import { ScanAnswers } from "../../src/scan_answers.ts";
import { AsideList, type SetAsideRecord } from "./aside.ts";
import { COMPACT_MIN, copy, earlier, type HeapItem, indexAdd, indexRemove, type Slot, StateCounts } from "./slots.ts";

/** When a due scan must look at an inbox record; `pending` is claimable whatever its `receivedAt`. */
function inboxHeapKey(record: InboundRecord): number | null {
  return INBOX[record.state].due === "always" ? Number.NEGATIVE_INFINITY : inboxDueAt(record);
}

/** Arrival order of inbox slots: `receivedAt`, then admission order. */
function byArrival(a: Slot<InboundRecord>, b: Slot<InboundRecord>): number {
  const x = a.record.receivedAt;
  const y = b.record.receivedAt;
  return x < y ? -1 : x > y ? 1 : a.order - b.order;
}

function isActive(state: InboundState): boolean {
  return ACTIVE_INBOX_STATES.includes(state);
}

/** Index of the first slot of `queue` (in arrival order) not before `slot`. */
function arrivalBound(queue: readonly Slot<InboundRecord>[], slot: Slot<InboundRecord>): number {
  let lo = 0;
  let hi = queue.length;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (byArrival(queue[mid], slot) < 0) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

export class MemoryInbox implements InboxJournal, DamagedRecords {
  readonly #now: () => number;
  readonly #slots = new Map<string, Slot<InboundRecord>>();
  /** Records a loader set aside as damaged (never in `#slots`). */
  readonly #aside = new AsideList("inbox");
  /** Active records by when they become claimable. */
  readonly #due = new MinHeap<HeapItem>(earlier);
  /** `done` records by `updatedAt`, for `purge`. */
  readonly #done = new MinHeap<HeapItem>(earlier);
  /** owner → ids of the records it holds a lease on. */
  readonly #leased = new Map<string, Set<string>>();
  /** chatId → its active records in arrival order, for the chat-order check of due scans. */
  readonly #chats = new Map<string, Slot<InboundRecord>[]>();
  readonly #states = new StateCounts();
  #version = 0;
  #order = 0;

  readonly #answers: ScanAnswers<InboundRecord[]>;

  constructor(now: () => number) {
    this.#now = now;
    this.#answers = new ScanAnswers<InboundRecord[]>(() => [], (a) => a.length === 0);
  }

  #valid = (item: HeapItem): boolean => this.#slots.get(item.id)?.version === item.version;

  /** Stores `next` in `slot` (or a new slot) and keeps every index in step. */
  #store(next: InboundRecord, slot?: Slot<InboundRecord>): Slot<InboundRecord> {
    const prev = slot?.record;
    this.#states.move(prev?.state, next.state);
    if (prev?.lease) indexRemove(this.#leased, prev.lease.owner, prev.id);
    if (next.lease) indexAdd(this.#leased, next.lease.owner, next.id);
    const version = ++this.#version;
    const wasActive = prev !== undefined && isActive(prev.state);
    if (slot) {
      slot.record = next;
      slot.version = version;
    } else {
      slot = { record: next, version, order: ++this.#order };
      this.#slots.set(next.id, slot);
    }
    const active = isActive(next.state);
    if (wasActive && !active) this.#chatRemove(slot);
    if (!wasActive && active) this.#chatInsert(slot);
    const at = inboxHeapKey(next);
    if (at !== null) this.#due.push({ at, id: next.id, version });
    if (INBOX[next.state].purgeable) this.#done.push({ at: next.updatedAt, id: next.id, version });
    this.#compact();
    return slot;
  }

  #compact(): void {
    const bound = 4 * this.#slots.size;
    if (this.#due.size > COMPACT_MIN && this.#due.size > bound) this.#due.retain(this.#valid);
    if (this.#done.size > COMPACT_MIN && this.#done.size > bound) this.#done.retain(this.#valid);
  }

  #chatInsert(slot: Slot<InboundRecord>): void {
    let queue = this.#chats.get(slot.record.chatId);
    if (!queue) this.#chats.set(slot.record.chatId, queue = []);
    queue.splice(arrivalBound(queue, slot), 0, slot);
  }

  #chatRemove(slot: Slot<InboundRecord>): void {
    const queue = this.#chats.get(slot.record.chatId);
    if (!queue) return;
    const i = arrivalBound(queue, slot);
    if (queue[i] === slot) queue.splice(i, 1);
    if (queue.length === 0) this.#chats.delete(slot.record.chatId);
  }

  /** The first active record of `chatId` that holds back the later ones from a scan under `options`. */
  #holder(chatId: string, now: number, options: ClaimOptions): Slot<InboundRecord> | null {
    for (const slot of this.#chats.get(chatId) ?? []) if (holdsChat(slot.record, now, options)) return slot;
    return null;
  }

  /** The slot of a `processing` record whose lease carries `token`, or `null`. */
  #held(id: string, token: number): Slot<InboundRecord> | null {
    const slot = this.#slots.get(id);
    if (!slot || !isLeasedWith(slot.record, token)) return null;
    return slot;
  }

  async admit(record: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null> {
    if (lease !== undefined) checkClaim(lease, "inbox.admit");
    const input = checkNewInbound(record);
    if (this.#slots.has(input.id) || this.#aside.has(input.id)) return null;
    const now = this.#now();
    // Only what comes before it counts: the active records of its chat received no later (it is admitted last).
    const held = lease !== undefined &&
      (this.#chats.get(input.chatId) ?? []).some((slot) => slot.record.receivedAt <= input.receivedAt && !admitsLeased(slot.record, now, lease));
    const next = newInboundRecord(input, now, held ? undefined : lease);
    this.#store(next);
    return copy(next);
  }

  async claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    checkId(id, `inbox.claim: "id"`);
    checkClaim(options, "inbox.claim");
    const slot = this.#slots.get(id);
    const now = this.#now();
    if (!slot || !isInboxClaimable(slot.record, now, options)) return null;
    const next = claimedInbound(slot.record, now, options);
    this.#store(next, slot);
    return copy(next);
  }

  async claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    checkClaim(options, "inbox.claimDue");
    checkFinite(options.limit, `inbox.claimDue: option "limit"`);
    return this.#answers.answer(options, () => this.#scanDue(options), (a) => a.map(copy));
  }

  #scanDue(options: ClaimDueOptions): InboundRecord[] {
    const now = this.#now();
    const popped: HeapItem[] = [];
    const candidates = new Map<string, Slot<InboundRecord>>();
    for (let top = this.#due.peek(); top !== undefined && top.at <= now; top = this.#due.peek()) {
      this.#due.pop();
      const slot = this.#slots.get(top.id);
      if (!slot || slot.version !== top.version) continue;
      popped.push(top);
      candidates.set(top.id, slot);
    }
    if (options.reclaimOwn) {
      for (const id of this.#leased.get(options.owner) ?? []) {
        const slot = this.#slots.get(id);
        if (slot) candidates.set(id, slot);
      }
    }
    const claimable = [...candidates.values()]
      .filter((slot) => isInboxClaimable(slot.record, now, options))
      .sort(byArrival);
    // Holders are found before anything is claimed: what this scan claims is the caller's, and holds nothing back.
    const holders = new Map<string, Slot<InboundRecord> | null>();
    const out: InboundRecord[] = [];
    for (const slot of claimable) {
      if (!(out.length < options.limit)) break;
      const chatId = slot.record.chatId;
      let holder = holders.get(chatId);
      if (holder === undefined) holders.set(chatId, holder = this.#holder(chatId, now, options));
      if (holder !== null && byArrival(holder, slot) < 0) continue;
      const next = claimedInbound(slot.record, now, options);
      this.#store(next, slot);
      out.push(copy(next));
    }
    // Items of records left unchanged go back; claimed ones have fresh items.
    for (const item of popped) if (this.#valid(item)) this.#due.push(item);
    return out;
  }

  async heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(id, `inbox.heartbeat: "id"`);
    checkFinite(token, `inbox.heartbeat: "token"`);
    checkFinite(leaseMs, `inbox.heartbeat: "leaseMs"`);
    const slot = this.#held(id, token);
    if (!slot) return false;
    this.#store(extendedLease(slot.record, this.#now(), leaseMs), slot);
    return true;
  }

  async start(id: string, token: number, attempt: number): Promise<boolean> {
    checkId(id, `inbox.start: "id"`);
    checkFinite(token, `inbox.start: "token"`);
    checkAttempt(attempt, "inbox.start");
    const slot = this.#held(id, token);
    if (!slot) return false;
    const next = startedInbound(slot.record, attempt, this.#now());
    if (next !== slot.record) this.#store(next, slot);
    return true;
  }

  async schedule(id: string, token: number, dueInMs: number): Promise<void> {
    checkId(id, `inbox.schedule: "id"`);
    checkFinite(token, `inbox.schedule: "token"`);
    checkFinite(dueInMs, `inbox.schedule: "dueInMs"`);
    const slot = this.#held(id, token);
    if (!slot) throw new StaleLeaseError("inbox", id, token);
    this.#store(scheduledInbound(slot.record, dueInMs, this.#now()), slot);
  }

  async complete(id: string, token: number): Promise<void> {
    checkId(id, `inbox.complete: "id"`);
    checkFinite(token, `inbox.complete: "token"`);
    const slot = this.#held(id, token);
    if (!slot) throw new StaleLeaseError("inbox", id, token);
    this.#store(doneInbound(slot.record, this.#now()), slot);
  }

  async fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    checkId(id, `inbox.fail: "id"`);
    checkFinite(token, `inbox.fail: "token"`);
    checkOutcome(outcome, "inbox.fail");
    const slot = this.#held(id, token);
    if (!slot) throw new StaleLeaseError("inbox", id, token);
    this.#store({ ...slot.record, ...failedFields(outcome, this.#now()) }, slot);
  }

  async get(id: string): Promise<InboundRecord | null> {
    checkId(id, `inbox.get: "id"`);
    const slot = this.#slots.get(id);
    if (slot) return copy(slot.record);
    const damaged = this.#aside.error(id);
    if (damaged) throw damaged;
    return null;
  }

  async damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#aside.list(options);
  }

  async reportDamaged(id: string): Promise<boolean> {
    return this.#aside.report(id);
  }

  async list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    const filter = normalizeList(options);
    if (this.#states.noneIn(filter.states)) return [];
    const slots: Slot<InboundRecord>[] = [];
    for (const slot of this.#slots.values()) if (matchesList(slot.record, filter)) slots.push(slot);
    slots.sort(byArrival);
    return slots.slice(0, filter.limit).map((slot) => copy(slot.record));
  }

  async replay(id: string): Promise<boolean> {
    checkId(id, `inbox.replay: "id"`);
    const slot = this.#slots.get(id);
    if (!slot) return false;
    const replayed = replayedInbound(slot.record, this.#now());
    if (!replayed) return false;
    this.#store(replayed, slot);
    return true;
  }

  /** The live records in admission order (not copies). */
  exportRecords(): InboundRecord[] {
    const out: InboundRecord[] = new Array(this.#slots.size);
    let i = 0;
    // Map order is admission order: a key is only re-inserted after a purge, with a new order.
    for (const slot of this.#slots.values()) out[i++] = slot.record;
    return out;
  }

  /** The records set aside as damaged, in the order they were (not copies). */
  exportAside(): SetAsideRecord[] {
    return this.#aside.export();
  }

  /** Adopts `records` (admission order) and the inbox records of `aside` into an empty journal. */
  importRecords(records: readonly InboundRecord[], aside: readonly SetAsideRecord[]): void {
    if (this.#slots.size > 0) throw new Error("importRecords needs an empty inbox");
    this.#aside.import(aside);
    const seen = new Set<string>();
    for (const record of records) {
      if (seen.has(record.id)) {
        throw new RangeError(`importRecords: inbox record id ${JSON.stringify(record.id)} appears twice`);
      }
      seen.add(record.id);
    }
    for (const record of records) this.#store(record);
  }

  async purge(olderThanMs: number): Promise<number> {
    const cutoff = this.#now() - olderThanMs;
    let count = 0;
    for (let top = this.#done.peek(); top !== undefined && top.at <= cutoff; top = this.#done.peek()) {
      this.#done.pop();
      const slot = this.#slots.get(top.id);
      if (!slot || slot.version !== top.version || !INBOX[slot.record.state].purgeable) continue;
      this.#slots.delete(top.id);
      this.#states.move(slot.record.state, undefined);
      count++;
    }
    return count;
  }
}
