/**
 * MemoryDurability (see `mod.ts` for the user documentation).
 *
 * @module
 */
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  DamagedRecordError,
  type DamagedRecords,
  type DurabilityBackend,
  type FailOutcome,
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type JsonValue,
  type ListOptions,
  type NewInboundRecord,
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
  ACTIVE_INBOX_STATES,
  ambiguousOutbox,
  BLOCKING_OUTBOX_STATES,
  checkClaim,
  checkFinite,
  checkId,
  checkNewInbound,
  checkNewOutbox,
  checkOutcome,
  checkString,
  claimedInbound,
  callingOutbox,
  claimedOutbox,
  cloneJson,
  failedFields,
  failedOutbox,
  doneInbound,
  extendedLease,
  holdsChat,
  admitsLeased,
  inboxDueAt,
  isInboxClaimable,
  isLeasedWith,
  isLeaseAbandoned,
  matchesList,
  newInboundRecord,
  newOutboxEntry,
  normalizeList,
  outboxDueAt,
  replayedInbound,
  requeuedOutbox,
  sentOutbox,
  checkDamagedList,
} from "../../src/rules.ts";
import { MinHeap } from "../../src/min_heap.ts";
import { withStoredCalled } from "../../src/stored_records.ts";
import { showValue as show } from "../../src/show.ts";

/** Options of {@link MemoryDurability}. */
export interface MemoryDurabilityOptions {
  /** The backend clock in ms since epoch (default `() => Date.now()`). */
  clock?: () => number;
}

/** A record with the bookkeeping that keeps heap items honest. */
interface Slot<R> {
  record: R;
  /** Bumped on every change; heap items carrying an older version are stale. */
  version: number;
  /** Admission order (ties of `receivedAt`). */
  order: number;
}

/** A heap item: record `id` is due at `at`, if it still has `version`. */
interface HeapItem {
  at: number;
  id: string;
  version: number;
}

const earlier = (a: HeapItem, b: HeapItem): boolean => a.at < b.at;
/** Heaps are rebuilt without their stale items once they exceed this and four times their live bound. */
const COMPACT_MIN = 1024;

function copy<T>(value: T): T {
  return cloneJson(value);
}


/** Counts records by state, so that a list of states none holds (`bot.idle()`'s) answers without a scan. */
class StateCounts {
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


/** The records of one journal that a loader set aside as damaged, in the order they were set aside. */
class AsideList {
  readonly #journal: "inbox" | "outbox";
  #items: SetAsideRecord[] = [];

  constructor(journal: "inbox" | "outbox") {
    this.#journal = journal;
  }

  has(id: string): boolean {
    return this.#items.some((item) => item.id === id);
  }

  /** The error of `get` for `id`, or `null` when no record of this id was set aside. */
  error(id: string): DamagedRecordError | null {
    const item = this.#items.find((item) => item.id === id);
    return item ? new DamagedRecordError(item) : null;
  }

  list(options: DamagedListOptions | undefined): DamagedRecord[] {
    const { unreported, limit } = checkDamagedList(options, `${this.#journal}.damaged`);
    const out: DamagedRecord[] = [];
    for (const { stored: _, ...record } of this.#items) {
      if (out.length >= limit) break;
      if (!unreported || !record.reported) out.push(record);
    }
    return out;
  }

  report(id: string): boolean {
    checkId(id, `${this.#journal}.reportDamaged: "id"`);
    const i = this.#items.findIndex((item) => item.id === id && !item.reported);
    if (i < 0) return false;
    // Replaced, not changed: an exported snapshot holds the objects themselves.
    this.#items[i] = { ...this.#items[i], reported: true };
    return true;
  }

  import(items: readonly SetAsideRecord[]): void {
    if (this.#items.length > 0) throw new Error(`importRecords needs an empty ${this.#journal}`);
    this.#items = items.filter((item) => item.journal === this.#journal);
  }

  export(): SetAsideRecord[] {
    return this.#items;
  }
}

/** Adds `id` to / removes it from the owner index. */
function indexAdd(index: Map<string, Set<string>>, owner: string, id: string): void {
  let ids = index.get(owner);
  if (!ids) index.set(owner, ids = new Set());
  ids.add(id);
}

function indexRemove(index: Map<string, Set<string>>, owner: string, id: string): void {
  const ids = index.get(owner);
  if (!ids) return;
  ids.delete(id);
  if (ids.size === 0) index.delete(owner);
}

/** When a due scan must look at an inbox record; `pending` is claimable whatever its `receivedAt`. */
function inboxHeapKey(record: InboundRecord): number | null {
  return record.state === "pending" ? Number.NEGATIVE_INFINITY : inboxDueAt(record);
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

class MemoryInbox implements InboxJournal, DamagedRecords {
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

  constructor(now: () => number) {
    this.#now = now;
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
    if (next.state === "done") this.#done.push({ at: next.updatedAt, id: next.id, version });
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
      if (!slot || slot.version !== top.version || slot.record.state !== "done") continue;
      this.#slots.delete(top.id);
      this.#states.move("done", undefined);
      count++;
    }
    return count;
  }
}

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

class MemoryOutbox implements OutboxJournal, DamagedRecords {
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

  constructor(now: () => number) {
    this.#now = now;
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
    return entry.state === "sending" || (blocking(entry.state) && this.#isHead(entry));
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
    if (entry.state === "sent") this.#sent.push({ at: entry.updatedAt, id: entry.key, version });
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
    return { status: next.state === "sending" ? "leased" : "queued", entry: copy(next) };
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
    const now = this.#now();
    const due: OutboxEntry[] = [];
    const ambiguous: OutboxEntry[] = [];
    const popped = new Map<string, HeapItem>();
    this.#drain(now, popped);

    // (1) Abandoned `sending` entries: lapsed leases, and our previous incarnation's.
    const sending = new Map<string, Slot<OutboxEntry>>();
    for (const key of popped.keys()) {
      const slot = this.#slots.get(key)!;
      if (slot.record.state === "sending") sending.set(key, slot);
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
        (entry.state === "queued" || entry.state === "failed") && this.#isHead(entry) &&
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
    if (!slot || slot.record.state === "sending") return false;
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
      if (!this.#valid(top) || this.#slots.get(top.id)!.record.state !== "sent") continue;
      this.#slots.delete(top.id);
      this.#states.move("sent", undefined);
      this.#observer?.(top.id, null);
      count++;
    }
    return count;
  }
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
 * import { assertEquals } from "@std/assert";
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
 * await backend.inbox.complete(record.id, record.lease!.token);
 * assertEquals((await backend.inbox.get("m1"))?.state, "done");
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

/** Told of an outbox entry stored (`entry`) or deleted (`null`); see {@link MemoryDurability.observeOutbox}. */
export type OutboxObserver = (key: string, entry: OutboxEntry | null) => void;

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

/** A record set aside as damaged, with what was stored (see {@link MemoryRecords.damaged}). */
export interface SetAsideRecord extends DamagedRecord {
  /** The record's stored form, kept as it was. */
  stored: JsonValue;
}
