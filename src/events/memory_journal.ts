/**
 * An in-memory {@link LeasedEventJournal}: the journal of one process, and the
 * in-memory state of the file journals (which snapshot it with
 * `exportState()`, load it with `fromState()`, and write what changed with
 * `takeChanges()` / replay it with `applyChanges()`).
 *
 * @module
 */
import { type ClaimOptions, type FailOutcome, type OutboxEntry, type OutboxJournal, StaleLeaseError } from "../backend.ts";
import type { ClaimDueOptions, ListOptions, OutboxClaim, OutboxState, NewOutboxEntry, ReserveResult } from "../backend.ts";
import {
  checkClaim,
  claimedInbound,
  doneInbound,
  isInboxClaimable,
  replayedInbound,
  checkedJson,
  checkFinite,
  checkOutcome,
  checkString,
  cloneJson,
  extendedLease,
  failedFields,
  holdsChat,
  holdsLease,
  newLease,
} from "../journal_rules.ts";
import { showValue as show } from "../show.ts";
import { MemoryDurability } from "../../backends/memory.ts";
import type {
  EventClaimOptions,
  EventListOptions,
  EventRecord,
  EventState,
  LeasedEventJournal,
  NewEventRecord,
} from "./types.ts";

/** Options of {@link MemoryEventJournal}. */
export interface MemoryEventJournalOptions {
  /** The journal clock in ms since epoch (default `() => Date.now()`); the outbox sidecar uses it too. */
  clock?: () => number;
  /**
   * Whether a lease heartbeat (of an event or of an outbox entry) counts as a
   * change for {@link MemoryEventJournal.takeChanges} (default `false`: a
   * heartbeat only moves a lease's expiry, and the record is reported with its
   * next real change, current expiry included). A journal shared between
   * processes must set it, so that other processes see the lease extended.
   */
  heartbeatChanges?: boolean;
}

/**
 * Every record of a {@link MemoryEventJournal}, as
 * {@link MemoryEventJournal.exportState} returns it and
 * {@link MemoryEventJournal.fromState} takes it: JSON as it is.
 */
export interface EventJournalState {
  /** Events in append order. */
  events: EventRecord[];
  /** Outbox entries of the sidecar in reservation order (ascending `seq`). */
  outbox: OutboxEntry[];
  /** The last outbox `seq` issued (at least the largest `seq` of `outbox`). */
  outboxSeq: number;
}

/**
 * What changed in a {@link MemoryEventJournal} between two calls of
 * {@link MemoryEventJournal.takeChanges}: the records as they are now, and the
 * ids / keys deleted. An id may be both in `removedEvents` and `events` (it
 * was purged and appended again): `applyChanges` removes before it stores.
 */
export interface EventJournalChanges {
  /** Events appended or changed, as they are now, in append order. */
  events: EventRecord[];
  /** Ids of purged events. */
  removedEvents: string[];
  /** Outbox entries reserved or changed, as they are now, in `seq` order. */
  outbox: OutboxEntry[];
  /** Keys of discarded or purged outbox entries. */
  removedOutbox: string[];
  /** The last outbox `seq` issued. */
  outboxSeq: number;
}

/** One record and its place in append order. */
interface Slot {
  record: EventRecord;
  order: number;
}

const EVENT_STATES: readonly EventState[] = ["pending", "processing", "failed", "done", "dead"];

/** Whether `state` is still to be worked on (kept in the active index). */
function isActive(state: EventState): boolean {
  return state === "pending" || state === "processing" || state === "failed";
}



/** Oldest `createdAt` first, append order on ties. */
function byCreated(a: Slot, b: Slot): number {
  return a.record.createdAt < b.record.createdAt ? -1 : a.record.createdAt > b.record.createdAt ? 1 : a.order - b.order;
}

/** Plain deep equality of JSON values. */
function sameJson(a: unknown, b: unknown): boolean {
  if (a === b) return true;
  if (typeof a !== "object" || typeof b !== "object" || a === null || b === null) return false;
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  const ka = Object.keys(a);
  const kb = Object.keys(b);
  if (ka.length !== kb.length) return false;
  for (const k of ka) {
    if (!Object.prototype.hasOwnProperty.call(b, k)) return false;
    if (!sameJson((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k])) return false;
  }
  return true;
}

/**
 * Checks the channel option of a claim, list or purge.
 * @throws {TypeError} when it is neither a string, `null` nor absent
 */
function checkChannel(value: unknown, what: string): string | null {
  if (value === undefined || value === null) return null;
  if (typeof value !== "string") throw new TypeError(`${what} must be a string or null, got ${show(value)}`);
  return value;
}

/**
 * Checks an event given to `append` and returns a normalized copy.
 * @throws {TypeError} naming the first bad field
 */
function checkNewEvent(input: NewEventRecord): NewEventRecord & { channel: string | null; orderKey: string | null } {
  if (typeof input !== "object" || input === null) {
    throw new TypeError(`An event record must be an object, got ${show(input)}`);
  }
  if (typeof input.id !== "string" || input.id.length === 0) {
    throw new TypeError(`Event record: field "id" must be a non-empty string, got ${show(input.id)}`);
  }
  const what = `Event record ${JSON.stringify(input.id)}`;
  const channel = checkChannel(input.channel, `${what}: field "channel"`);
  const orderKey = checkChannel(input.orderKey, `${what}: field "orderKey"`);
  if (typeof input.eventType !== "string" || input.eventType.length === 0) {
    throw new TypeError(`${what}: field "eventType" must be a non-empty string, got ${show(input.eventType)}`);
  }
  if (input.createdAt !== undefined) checkFinite(input.createdAt, `${what}: field "createdAt"`);
  return {
    id: input.id,
    channel,
    orderKey,
    eventType: input.eventType,
    payload: checkedJson(input.payload === undefined ? null : input.payload, "payload", what),
    createdAt: input.createdAt,
  };
}

/**
 * Checks the shape of a stored event (loaded from a file), so that a damaged
 * file fails on load with a message naming the field, not later. A record
 * stored before there were ordering groups gets `orderKey: null`.
 * @throws {TypeError} naming the first bad field
 */
function checkStoredEvent(record: EventRecord, where: string): void {
  if (typeof record !== "object" || record === null) throw new TypeError(`${where}: an event must be an object, got ${show(record)}`);
  const what = `${where}: event ${JSON.stringify(record.id)}`;
  if (typeof record.id !== "string" || record.id.length === 0) throw new TypeError(`${what}: field "id" must be a non-empty string`);
  if (record.channel !== null && typeof record.channel !== "string") throw new TypeError(`${what}: field "channel" must be a string or null`);
  if (record.orderKey === undefined) record.orderKey = null;
  else if (record.orderKey !== null && typeof record.orderKey !== "string") {
    throw new TypeError(`${what}: field "orderKey" must be a string or null`);
  }
  if (typeof record.eventType !== "string") throw new TypeError(`${what}: field "eventType" must be a string`);
  if (!EVENT_STATES.includes(record.state)) throw new TypeError(`${what}: field "state" is not a state: ${show(record.state)}`);
  for (const field of ["createdAt", "attempts", "fence", "updatedAt"] as const) {
    if (typeof record[field] !== "number" || !Number.isFinite(record[field])) {
      throw new TypeError(`${what}: field "${field}" must be a finite number, got ${show(record[field])}`);
    }
  }
  if (record.state === "processing" && (typeof record.lease !== "object" || record.lease === null)) {
    throw new TypeError(`${what}: a processing event must have a lease`);
  }
}

/**
 * An events journal kept in memory, for one process: the full
 * {@link LeasedEventJournal} contract (leases, fencing tokens, replay, purge
 * by channel), with the core's outbox as a sidecar (`outbox`, the outbox of a
 * {@link MemoryDurability} on the same clock).
 *
 * Records it returns are deep copies, and so is what it is given. Due scans
 * (`claimDue`) take records oldest `createdAt` first and keep the order of
 * each `orderKey` (a record waits while an earlier one of its key is leased
 * elsewhere); they look only at the active (`pending`, `processing`,
 * `failed`) records of the claimed channel, through an index by channel and
 * by key: O(active); `done` and `dead` records are never scanned by them.
 *
 * For the file journals built on it: `exportState()` / `fromState()` snapshot
 * and load the whole state, `takeChanges()` / `applyChanges()` carry what
 * changed since the last call (an append-only log).
 *
 * @example Usage
 * ```ts
 * import { MemoryEventJournal } from "./memory_journal.ts";
 *
 * const journal = new MemoryEventJournal();
 * await journal.append({ id: "e1", eventType: "order.paid", payload: { order: 42 } });
 * const [event] = await journal.claimDue({ owner: "w1", incarnation: "a", leaseMs: 30_000, limit: 10 });
 * await journal.complete(event.id, event.lease!.token);
 * ```
 */
export class MemoryEventJournal implements LeasedEventJournal {
  /** Always `'memory-events'`. */
  readonly name: string = "memory-events";
  /** One process. */
  readonly scope: "process" = "process";
  /** The core's outbox: the sidecar's, rejecting calls once the journal is closed. */
  readonly outbox: OutboxJournal;
  readonly #now: () => number;
  readonly #heartbeatChanges: boolean;
  readonly #sidecar: MemoryDurability;
  /** Every record, in append order. */
  readonly #slots = new Map<string, Slot>();
  /** channel → its `pending`, `processing` and `failed` records. */
  readonly #active = new Map<string | null, Set<Slot>>();
  /** channel → its `done` records, for `purge`. */
  readonly #done = new Map<string | null, Set<Slot>>();
  /** channel → orderKey → its active records, for the order of due scans. */
  readonly #groups = new Map<string | null, Map<string, Set<Slot>>>();
  #order = 0;
  #closed = false;
  /** Off while importing or applying changes: those are not changes of this journal. */
  #tracking = true;
  /** Set while a heartbeat runs, so that the outbox observer can tell heartbeats apart. */
  #inHeartbeat = false;
  readonly #changed = new Set<string>();
  readonly #removed = new Set<string>();
  readonly #outChanged = new Map<string, OutboxEntry>();
  readonly #outRemoved = new Set<string>();
  #outSeq = 0;

  /**
   * An empty, open journal.
   *
   * @param options.clock the journal clock in ms since epoch (default `() => Date.now()`)
   * @param options.heartbeatChanges whether heartbeats are changes for `takeChanges` (default `false`)
   * @throws {TypeError} when an option has the wrong type
   */
  constructor(options?: MemoryEventJournalOptions) {
    if (options !== undefined && (typeof options !== "object" || options === null)) {
      throw new TypeError(`MemoryEventJournal options must be an object, got ${show(options)}`);
    }
    const clock = options?.clock ?? (() => Date.now());
    if (typeof clock !== "function") {
      throw new TypeError(`MemoryEventJournal option "clock" must be a function, got ${show(clock)}`);
    }
    const heartbeatChanges = options?.heartbeatChanges ?? false;
    if (typeof heartbeatChanges !== "boolean") {
      throw new TypeError(`MemoryEventJournal option "heartbeatChanges" must be a boolean, got ${show(heartbeatChanges)}`);
    }
    this.#heartbeatChanges = heartbeatChanges;
    this.#now = (): number => {
      const time = clock();
      if (typeof time !== "number" || !Number.isFinite(time)) {
        throw new TypeError(`MemoryEventJournal option "clock" must return a finite number, got ${show(time)}`);
      }
      return time;
    };
    this.#sidecar = new MemoryDurability({ clock: this.#now });
    this.#sidecar.observeOutbox((key, entry) => this.#observeOutbox(key, entry));
    this.outbox = new SidecarOutbox(
      this.#sidecar.outbox,
      (op) => this.#assertOpen(op),
      (run) => this.#asHeartbeat(run),
    );
  }

  /**
   * A journal holding `state` (see {@link importState}).
   *
   * @param state what {@link exportState} returned, or its JSON round trip
   * @param options as for the constructor
   * @returns the journal; `takeChanges()` reports nothing of the loaded state
   * @throws {TypeError} when a record is malformed
   * @throws {RangeError} when an id, key or `seq` repeats
   */
  static fromState(state: EventJournalState, options?: MemoryEventJournalOptions): MemoryEventJournal {
    const journal = new MemoryEventJournal(options);
    journal.importState(state);
    return journal;
  }

  /** Throws when the journal is closed (used by the outbox sidecar too). */
  #assertOpen(op: string): void {
    if (this.#closed) throw new Error(`${op}: the ${this.name} journal is closed`);
  }

  /** Runs a sidecar heartbeat, so that the outbox observer knows it is one. */
  #asHeartbeat<T>(run: () => T): T {
    this.#inHeartbeat = true;
    try {
      return run();
    } finally {
      this.#inHeartbeat = false;
    }
  }

  #observeOutbox(key: string, entry: OutboxEntry | null): void {
    if (entry !== null && entry.seq > this.#outSeq) this.#outSeq = entry.seq;
    if (!this.#tracking) return;
    if (entry === null) {
      this.#outChanged.delete(key);
      this.#outRemoved.add(key);
    } else if (!this.#inHeartbeat || this.#heartbeatChanges || this.#outChanged.has(key)) {
      // An untracked heartbeat still refreshes a value already to be reported.
      this.#outChanged.set(key, entry);
    }
  }

  /** Stores `next` in `slot` (a new slot when omitted) and keeps the indexes in step. */
  #store(next: EventRecord, slot?: Slot, heartbeat = false): Slot {
    if (slot) {
      const prev = slot.record;
      if (prev.state !== next.state || prev.channel !== next.channel || prev.orderKey !== next.orderKey) {
        this.#unindex(slot);
        slot.record = next;
        this.#index(slot);
      } else {
        slot.record = next;
      }
    } else {
      slot = { record: next, order: ++this.#order };
      this.#slots.set(next.id, slot);
      this.#index(slot);
    }
    if (this.#tracking && (!heartbeat || this.#heartbeatChanges)) this.#changed.add(next.id);
    return slot;
  }

  #index(slot: Slot): void {
    const { state, channel, orderKey } = slot.record;
    const index = isActive(state) ? this.#active : state === "done" ? this.#done : null;
    if (!index) return;
    let set = index.get(channel);
    if (!set) index.set(channel, set = new Set());
    set.add(slot);
    if (orderKey === null || index !== this.#active) return;
    let keys = this.#groups.get(channel);
    if (!keys) this.#groups.set(channel, keys = new Map());
    let group = keys.get(orderKey);
    if (!group) keys.set(orderKey, group = new Set());
    group.add(slot);
  }

  #unindex(slot: Slot): void {
    const { state, channel, orderKey } = slot.record;
    const index = isActive(state) ? this.#active : state === "done" ? this.#done : null;
    const set = index?.get(channel);
    if (!set) return;
    set.delete(slot);
    if (set.size === 0) index!.delete(channel);
    if (orderKey === null || index !== this.#active) return;
    const keys = this.#groups.get(channel);
    const group = keys?.get(orderKey);
    if (!group) return;
    group.delete(slot);
    if (group.size > 0) return;
    keys!.delete(orderKey);
    if (keys!.size === 0) this.#groups.delete(channel);
  }

  /** The first (by `createdAt`, then append order) active record of a key that holds it back from `options`, or `null`. */
  #firstHolder(channel: string | null, orderKey: string, now: number, options: ClaimOptions): Slot | null {
    let first: Slot | null = null;
    for (const slot of this.#groups.get(channel)?.get(orderKey) ?? []) {
      if (holdsChat(slot.record, now, options) && (first === null || byCreated(slot, first) < 0)) first = slot;
    }
    return first;
  }

  #delete(slot: Slot): void {
    this.#unindex(slot);
    this.#slots.delete(slot.record.id);
    if (this.#tracking) {
      this.#changed.delete(slot.record.id);
      this.#removed.add(slot.record.id);
    }
  }

  /** The slot of a `processing` record whose lease carries `token`, or `null`. */
  #held(id: string, token: number): Slot | null {
    const slot = this.#slots.get(id);
    if (!slot || slot.record.state !== "processing" || !holdsLease(slot.record.lease, token)) return null;
    return slot;
  }

  /**
   * Journals `event`: `pending`, or with `lease` already `processing` under
   * fencing token 1 (attempts 1). `createdAt` defaults to the journal clock.
   *
   * @returns a copy of the record, or `null` when a record with that id exists (nothing changes)
   * @throws {TypeError} naming a bad field or lease option
   */
  async append(event: NewEventRecord, lease?: ClaimOptions): Promise<EventRecord | null> {
    this.#assertOpen("events.append");
    if (lease !== undefined) checkClaim(lease, "events.append");
    const input = checkNewEvent(event);
    if (this.#slots.has(input.id)) return null;
    const now = this.#now();
    const record: EventRecord = {
      id: input.id,
      channel: input.channel,
      orderKey: input.orderKey,
      eventType: input.eventType,
      payload: input.payload,
      createdAt: input.createdAt ?? now,
      state: lease ? "processing" : "pending",
      attempts: lease ? 1 : 0,
      nextAttemptAt: null,
      lease: lease ? newLease(lease, 1, now) : null,
      fence: lease ? 1 : 0,
      error: null,
      updatedAt: now,
    };
    this.#store(record);
    return cloneJson(record);
  }

  /**
   * Leases record `id` when it is in `options.channel` (absent or `null`: no
   * channel) and claimable: `pending`, `failed` and due, `processing` under a
   * lapsed lease, or (with `reclaimOwn`) leased by the owner's previous
   * incarnation. Issues the next fencing token.
   *
   * @returns a copy of the leased record, or `null`
   * @throws {TypeError} naming a bad argument
   */
  async claim(id: string, options: EventClaimOptions): Promise<EventRecord | null> {
    this.#assertOpen("events.claim");
    checkString(id, `events.claim: "id"`);
    checkClaim(options, "events.claim");
    const channel = checkChannel(options.channel, `events.claim: option "channel"`);
    const slot = this.#slots.get(id);
    const now = this.#now();
    if (!slot || slot.record.channel !== channel || !isInboxClaimable(slot.record, now, options)) return null;
    const next = claimedInbound(slot.record, now, options);
    this.#store(next, slot);
    return cloneJson(next);
  }

  /**
   * Leases up to `limit` claimable records of `options.channel` (absent or
   * `null`: records without a channel), oldest `createdAt` first (append order
   * on ties), keeping the order of each `orderKey`: a record is skipped while
   * an earlier active record of its key is `processing` under a lease held
   * elsewhere (see {@link LeasedEventJournal.claimDue}). Scans only that
   * channel's active records, and the active records of the keys it meets.
   *
   * @returns copies of the leased records
   * @throws {TypeError} naming a bad option
   */
  async claimDue(options: EventClaimOptions & { limit: number }): Promise<EventRecord[]> {
    this.#assertOpen("events.claimDue");
    checkClaim(options, "events.claimDue");
    checkFinite(options.limit, `events.claimDue: option "limit"`);
    const channel = checkChannel(options.channel, `events.claimDue: option "channel"`);
    const active = this.#active.get(channel);
    if (!active || options.limit <= 0) return [];
    const now = this.#now();
    const claimable: Slot[] = [];
    for (const slot of active) if (isInboxClaimable(slot.record, now, options)) claimable.push(slot);
    claimable.sort(byCreated);
    // A claimable record never holds its key, and leasing it to the caller does not make it hold: one look per key.
    const holders = new Map<string, Slot | null>();
    const out: EventRecord[] = [];
    for (const slot of claimable) {
      if (!(out.length < options.limit)) break;
      const key = slot.record.orderKey;
      if (key !== null) {
        let holder = holders.get(key);
        if (holder === undefined) holders.set(key, holder = this.#firstHolder(channel, key, now, options));
        if (holder !== null && byCreated(holder, slot) < 0) continue;
      }
      const next = claimedInbound(slot.record, now, options);
      this.#store(next, slot);
      out.push(cloneJson(next));
    }
    return out;
  }

  /**
   * Extends the lease held under `token` to `leaseMs` from now.
   *
   * @returns `false` when `token` no longer holds the record (nothing changes)
   * @throws {TypeError} naming a bad argument
   */
  async heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    this.#assertOpen("events.heartbeat");
    checkString(id, `events.heartbeat: "id"`);
    checkFinite(token, `events.heartbeat: "token"`);
    checkFinite(leaseMs, `events.heartbeat: "leaseMs"`);
    const slot = this.#held(id, token);
    if (!slot) return false;
    this.#store(extendedLease(slot.record, this.#now(), leaseMs), slot, true);
    return true;
  }

  /**
   * `processing` → `done`.
   *
   * @throws {StaleLeaseError} when `token` is not the current lease (nothing changes)
   * @throws {TypeError} naming a bad argument
   */
  async complete(id: string, token: number): Promise<void> {
    this.#assertOpen("events.complete");
    checkString(id, `events.complete: "id"`);
    checkFinite(token, `events.complete: "token"`);
    const slot = this.#held(id, token);
    if (!slot) throw new StaleLeaseError("event", id, token);
    this.#store(doneInbound(slot.record, this.#now()), slot);
  }

  /**
   * `processing` → `failed` (claimable again after `retryInMs`) or `dead`.
   *
   * @throws {StaleLeaseError} when `token` is not the current lease (nothing changes)
   * @throws {TypeError} naming a bad argument or outcome field
   */
  async fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    this.#assertOpen("events.fail");
    checkString(id, `events.fail: "id"`);
    checkFinite(token, `events.fail: "token"`);
    checkOutcome(outcome, "events.fail");
    const slot = this.#held(id, token);
    if (!slot) throw new StaleLeaseError("event", id, token);
    this.#store({ ...slot.record, ...failedFields(outcome, this.#now()) }, slot);
  }

  /**
   * Record `id`, in any channel.
   * @returns a copy, or `null`
   */
  async get(id: string): Promise<EventRecord | null> {
    this.#assertOpen("events.get");
    checkString(id, `events.get: "id"`);
    const slot = this.#slots.get(id);
    return slot ? cloneJson(slot.record) : null;
  }

  /**
   * Records in append order, filtered by channel (absent: every channel;
   * `null`: records without one), state and eventType; at most `limit` (default 100).
   *
   * @returns copies
   * @throws {TypeError} naming a bad filter
   * @throws {RangeError} when `limit` is not a non-negative integer
   */
  async list(options?: EventListOptions): Promise<EventRecord[]> {
    this.#assertOpen("events.list");
    if (options !== undefined && (typeof options !== "object" || options === null)) {
      throw new TypeError(`events.list: the options must be an object, got ${show(options)}`);
    }
    const hasChannel = options?.channel !== undefined;
    const channel = checkChannel(options?.channel, `events.list: option "channel"`);
    const eventType = options?.eventType;
    if (eventType !== undefined) checkString(eventType, `events.list: option "eventType"`);
    const state = options?.state;
    let states: Set<string> | null = null;
    if (state !== undefined) {
      const list: readonly unknown[] = typeof state === "string" ? [state] : Array.isArray(state) ? state : [state];
      for (const item of list) checkString(item, `events.list: option "state"`);
      states = new Set(list as string[]);
    }
    const limit = options?.limit ?? 100;
    if (!Number.isInteger(limit) || limit < 0) {
      throw new RangeError(`events.list: option "limit" must be a non-negative integer, got ${show(limit)}`);
    }
    const out: EventRecord[] = [];
    if (limit === 0) return out;
    for (const slot of this.#slots.values()) {
      const r = slot.record;
      if (hasChannel && r.channel !== channel) continue;
      if (states !== null && !states.has(r.state)) continue;
      if (eventType !== undefined && r.eventType !== eventType) continue;
      out.push(cloneJson(r));
      if (out.length >= limit) break;
    }
    return out;
  }

  /**
   * A `done`, `failed` or `dead` record back to `pending`, attempts reset
   * (its fence is kept, so old tokens stay stale).
   *
   * @returns whether it was made pending (`false` for a `pending` or `processing` record, or no record)
   */
  async replay(id: string): Promise<boolean> {
    this.#assertOpen("events.replay");
    checkString(id, `events.replay: "id"`);
    const slot = this.#slots.get(id);
    if (!slot) return false;
    const replayed = replayedInbound(slot.record, this.#now());
    if (!replayed) return false;
    this.#store(replayed, slot);
    return true;
  }

  /**
   * Deletes the `done` records of `options.channel` (absent: every channel;
   * `null`: records without one) last changed at least `olderThanMs` ago.
   *
   * @returns how many were deleted
   * @throws {TypeError} naming a bad argument
   */
  async purge(olderThanMs: number, options?: { channel?: string | null }): Promise<number> {
    this.#assertOpen("events.purge");
    checkFinite(olderThanMs, `events.purge: "olderThanMs"`);
    if (options !== undefined && (typeof options !== "object" || options === null)) {
      throw new TypeError(`events.purge: the options must be an object, got ${show(options)}`);
    }
    const all = options?.channel === undefined;
    const channel = checkChannel(options?.channel, `events.purge: option "channel"`);
    const cutoff = this.#now() - olderThanMs;
    const sets = all ? [...this.#done.values()] : [this.#done.get(channel)].filter((s): s is Set<Slot> => !!s);
    const doomed: Slot[] = [];
    for (const set of sets) for (const slot of set) if (slot.record.updatedAt <= cutoff) doomed.push(slot);
    for (const slot of doomed) this.#delete(slot);
    return doomed.length;
  }

  /** Rejects every later operation (memory operations finish synchronously, so none is left running). */
  async close(): Promise<void> {
    this.#closed = true;
  }

  /** Whether {@link close} was called. */
  get closed(): boolean {
    return this.#closed;
  }

  /**
   * The whole state, for a snapshot. The records are the journal's own
   * objects, not copies: serialize them at once and never change them (a
   * change replaces a record object, so what is taken synchronously stays
   * consistent). Works after `close()`.
   *
   * @returns events in append order, outbox entries in `seq` order and the last `seq` issued
   */
  exportState(): EventJournalState {
    const events: EventRecord[] = new Array(this.#slots.size);
    let i = 0;
    for (const slot of this.#slots.values()) events[i++] = slot.record;
    const { outbox, outboxSeq } = this.#sidecar.exportRecords();
    return { events, outbox, outboxSeq };
  }

  /**
   * Loads `state` into this journal, which must be empty. The objects are
   * adopted, not copied: the caller must not keep or change them. Loading is
   * not a change: `takeChanges()` does not report it.
   *
   * @param state what {@link exportState} returned, or its JSON round trip
   * @throws {Error} when the journal holds records
   * @throws {TypeError} when a record is malformed (nothing is loaded)
   * @throws {RangeError} when an id or key repeats or `seq`s are not ascending (the journal may then be partly loaded: discard it)
   */
  importState(state: EventJournalState): void {
    if (typeof state !== "object" || state === null || !Array.isArray(state.events) || !Array.isArray(state.outbox)) {
      throw new TypeError(`importState: the state must be { events: [], outbox: [], outboxSeq }, got ${show(state)}`);
    }
    checkFinite(state.outboxSeq, `importState: "outboxSeq"`);
    if (this.#slots.size > 0 || this.#sidecar.exportRecords().outbox.length > 0) {
      throw new Error("importState needs an empty journal");
    }
    const seen = new Set<string>();
    for (const record of state.events) {
      checkStoredEvent(record, "importState");
      if (seen.has(record.id)) throw new RangeError(`importState: event id ${JSON.stringify(record.id)} appears twice`);
      seen.add(record.id);
    }
    this.#tracking = false;
    try {
      for (const record of state.events) this.#store(record);
      this.#sidecar.importRecords({ inbox: [], outbox: state.outbox, outboxSeq: state.outboxSeq });
    } finally {
      this.#tracking = true;
    }
    if (state.outboxSeq > this.#outSeq) this.#outSeq = state.outboxSeq;
  }

  /**
   * What changed since the last call (or since construction / loading): the
   * changed records as they are now (the journal's own objects, as with
   * {@link exportState}), and what was deleted. Heartbeats count only with
   * the `heartbeatChanges` option; otherwise a record whose lease was only
   * extended is reported with its next change. Works after `close()`.
   *
   * @returns the changes, or `null` when nothing changed
   */
  takeChanges(): EventJournalChanges | null {
    if (this.#changed.size === 0 && this.#removed.size === 0 && this.#outChanged.size === 0 && this.#outRemoved.size === 0) {
      return null;
    }
    const slots: Slot[] = [];
    for (const id of this.#changed) {
      const slot = this.#slots.get(id);
      if (slot) slots.push(slot);
    }
    slots.sort((a, b) => a.order - b.order);
    const changes: EventJournalChanges = {
      events: slots.map((slot) => slot.record),
      removedEvents: [...this.#removed],
      outbox: [...this.#outChanged.values()].sort((a, b) => a.seq - b.seq),
      removedOutbox: [...this.#outRemoved],
      outboxSeq: this.#outSeq,
    };
    this.#changed.clear();
    this.#removed.clear();
    this.#outChanged.clear();
    this.#outRemoved.clear();
    return changes;
  }

  /**
   * Replays a change set taken from a journal with `takeChanges()` (or its
   * JSON round trip): deletes the removed records, then stores the given ones
   * (an existing id is replaced in place, a new one appended). Idempotent:
   * applying a set twice, or a set the state already holds, leaves the same
   * state. Objects are adopted, not copied. Applying is not a change of this
   * journal: `takeChanges()` does not report it.
   *
   * @param changes what `takeChanges()` returned
   * @throws {TypeError} when a record is malformed (nothing is applied)
   */
  applyChanges(changes: EventJournalChanges): void {
    if (
      typeof changes !== "object" || changes === null || !Array.isArray(changes.events) ||
      !Array.isArray(changes.removedEvents) || !Array.isArray(changes.outbox) || !Array.isArray(changes.removedOutbox)
    ) {
      throw new TypeError(`applyChanges: not a change set: ${show(changes)}`);
    }
    checkFinite(changes.outboxSeq, `applyChanges: "outboxSeq"`);
    for (const record of changes.events) checkStoredEvent(record, "applyChanges");
    const given = new Map<string, EventRecord>();
    for (const record of changes.events) given.set(record.id, record);
    this.#tracking = false;
    try {
      for (const id of changes.removedEvents) {
        const slot = this.#slots.get(id);
        if (!slot) continue;
        // Purged and appended again, and this state already holds the new record: leave it in its place.
        const again = given.get(id);
        if (again !== undefined && sameJson(again, slot.record)) continue;
        this.#delete(slot);
      }
      for (const record of given.values()) this.#store(record, this.#slots.get(record.id));
      this.#sidecar.applyOutboxChanges(changes.outbox, changes.removedOutbox, changes.outboxSeq);
    } finally {
      this.#tracking = true;
    }
    if (changes.outboxSeq > this.#outSeq) this.#outSeq = changes.outboxSeq;
  }
}

/** The sidecar's outbox, rejecting calls once the journal is closed, telling heartbeats apart. */
class SidecarOutbox implements OutboxJournal {
  readonly #inner: OutboxJournal;
  readonly #journal: { assertOpen(op: string): void; asHeartbeat<T>(run: () => T): T };

  constructor(
    inner: OutboxJournal,
    assertOpen: (op: string) => void,
    asHeartbeat: <T>(run: () => T) => T,
  ) {
    this.#inner = inner;
    this.#journal = { assertOpen, asHeartbeat };
  }

  async reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    this.#journal.assertOpen("outbox.reserve");
    return this.#inner.reserve(entry, lease);
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    this.#journal.assertOpen("outbox.claimDue");
    return this.#inner.claimDue(options);
  }

  async heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    this.#journal.assertOpen("outbox.heartbeat");
    // The memory outbox stores synchronously within the call, before its promise settles.
    return this.#journal.asHeartbeat(() => this.#inner.heartbeat(key, token, leaseMs));
  }

  async markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    this.#journal.assertOpen("outbox.markCalling");
    // Not a heartbeat: `called` must be written (takeChanges reports it) before the provider is called.
    return this.#inner.markCalling(key, token, leaseMs);
  }

  async markSent(key: string, token: number, messageId: string): Promise<void> {
    this.#journal.assertOpen("outbox.markSent");
    return this.#inner.markSent(key, token, messageId);
  }

  async markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    this.#journal.assertOpen("outbox.markFailed");
    return this.#inner.markFailed(key, token, outcome);
  }

  async get(key: string): Promise<OutboxEntry | null> {
    this.#journal.assertOpen("outbox.get");
    return this.#inner.get(key);
  }

  async list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    this.#journal.assertOpen("outbox.list");
    return this.#inner.list(options);
  }

  async retry(key: string): Promise<boolean> {
    this.#journal.assertOpen("outbox.retry");
    return this.#inner.retry(key);
  }

  async discard(key: string): Promise<boolean> {
    this.#journal.assertOpen("outbox.discard");
    return this.#inner.discard(key);
  }

  async purge(olderThanMs: number): Promise<number> {
    this.#journal.assertOpen("outbox.purge");
    return this.#inner.purge(olderThanMs);
  }
}
