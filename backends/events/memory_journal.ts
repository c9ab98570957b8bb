/**
 * An in-memory {@link LeasedEventJournal}: the journal of one process, and the
 * in-memory state of the file journals (which snapshot it with
 * `exportState()`, load it with `fromState()`, and write what changed with
 * `takeChanges()` / replay it with `applyChanges()`).
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import {
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  DamagedRecordError,
  type FailOutcome,
  type OutboxEntry,
  type OutboxJournal,
  StaleLeaseError,
} from "../../src/contract.ts";
import type { ClaimDueOptions, ListOptions, OutboxClaim, OutboxState, NewOutboxEntry, ReserveResult } from "../../src/contract.ts";
import {
  admitsLeased,
  checkClaim,
  checkDamagedList,
  checkAttempt,
  claimedInbound,
  scheduledInbound,
  startedInbound,
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
} from "../../src/rules.ts";
import { INBOX, INBOX_STATES } from "../../src/machine.ts";
import { showValue as show } from "../../src/show.ts";
import { describeJsonKind, storedOutboxProblem } from "../../src/stored_records.ts";
import { MemoryDurability } from "../memory/durability.ts";
import {
  type DamagedEvent,
  DamagedEventError,
  type DamagedEventListOptions,
  type EventClaimOptions,
  type EventListOptions,
  type EventRecord,
  type EventState,
  type LeasedEventJournal,
  type NewEventRecord,
} from "../../src/events/types.ts";

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
  /** The name in errors and damaged records (default `'memory-events'`): the file journals built on it pass theirs. */
  name?: string;
}

/**
 * The mark of a record set aside as damaged (see {@link DamagedEvent}), as
 * {@link EventJournalState} and {@link EventJournalChanges} carry it. The
 * record itself stays where it was stored (`events` or `outbox`), as it was.
 */
export interface DamageMark {
  /** The journal it is in: the events, or the outbox sidecar. */
  journal: "events" | "outbox";
  /** The event id or outbox key (derived from the stored form when unreadable: `damaged:<hash>`). */
  id: string;
  /** What is wrong, naming the field. */
  problem: string;
  /** Journal-clock time it was set aside. */
  setAsideAt: number;
  /** Whether a reader reported it. */
  reported: boolean;
}

/**
 * Every record of a {@link MemoryEventJournal}, as
 * {@link MemoryEventJournal.exportState} returns it and
 * {@link MemoryEventJournal.fromState} takes it: JSON as it is.
 */
export interface EventJournalState {
  /**
   * Events in append order. One that is not a valid record (a field of the
   * wrong type, an unknown state, …) is loaded all the same, as damaged (see
   * {@link DamagedEvent}), and exported again as it is.
   */
  events: EventRecord[];
  /**
   * Entries of the outbox sidecar in reservation order (ascending `seq`),
   * then the damaged ones (loaded as such, exported as they are).
   */
  outbox: OutboxEntry[];
  /** The last outbox `seq` issued (at least the largest `seq` of `outbox`). */
  outboxSeq: number;
  /** Marks of the records set aside as damaged, in the order they were (none when absent). */
  damaged?: DamageMark[];
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
  /** Marks set or changed (reported), as they are now; absent when none. */
  damaged?: DamageMark[];
}

/** A damaged record: its key, what is wrong, and its mark once set aside. */
interface Damage {
  journal: "events" | "outbox";
  /** Its id / key, or one derived from its stored form when that is unreadable. */
  key: string;
  problem: string;
  /** An event's channel as stored; `undefined` when unreadable. */
  channel: string | null | undefined;
  /** The stored form, as it is (for an event, also its slot's `record`). */
  stored: unknown;
  /** `null`: found damaged, not set aside yet. Replaced, never changed (exports hold it). */
  mark: DamageMark | null;
}

/** One record and its place in append order. */
interface Slot {
  /** For a damaged record, its stored form as it is (not a record). */
  record: EventRecord;
  order: number;
  /** Set for a damaged record: never indexed, never handed out. */
  damage: Damage | null;
}

const EVENT_STATES: readonly EventState[] = INBOX_STATES;

/** Whether `state` is still to be worked on (kept in the active index). */
function isActive(state: EventState): boolean {
  return INBOX[state].active;
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

const isFiniteNumber = (v: unknown): v is number => typeof v === "number" && Number.isFinite(v);

/** What is wrong with a stored lease, or `null`. */
function leaseProblem(lease: unknown): string | null {
  if (typeof lease !== "object" || lease === null || Array.isArray(lease)) return `must be null or a lease object, got ${describeJsonKind(lease)}`;
  const l = lease as Record<string, unknown>;
  if (typeof l.owner !== "string" || typeof l.incarnation !== "string") return "must have a string owner and incarnation";
  if (!isFiniteNumber(l.token) || !isFiniteNumber(l.expiresAt)) return "must have a finite token and expiresAt";
  return null;
}

/**
 * What is wrong with a stored event (loaded from a file), naming the first
 * bad field, or `null` for a valid record. A record stored before there were
 * ordering groups has no `orderKey`: valid (read as `null`).
 */
function storedEventProblem(value: unknown): string | null {
  if (typeof value !== "object" || value === null || Array.isArray(value)) return `an event must be an object, got ${describeJsonKind(value)}`;
  const r = value as Record<string, unknown>;
  if (typeof r.id !== "string" || r.id.length === 0) return `field "id" must be a non-empty string, got ${describeJsonKind(r.id)}`;
  if (r.channel !== null && typeof r.channel !== "string") return `field "channel" must be a string or null, got ${describeJsonKind(r.channel)}`;
  if (r.orderKey !== undefined && r.orderKey !== null && typeof r.orderKey !== "string") {
    return `field "orderKey" must be a string or null, got ${describeJsonKind(r.orderKey)}`;
  }
  if (typeof r.eventType !== "string") return `field "eventType" must be a string, got ${describeJsonKind(r.eventType)}`;
  if (!("payload" in r)) return `field "payload" is missing`;
  if (!EVENT_STATES.includes(r.state as EventState)) return `field "state" is not a state: ${describeJsonKind(r.state)}`;
  for (const field of ["createdAt", "attempts", "fence", "updatedAt"]) {
    if (!isFiniteNumber(r[field])) return `field "${field}" must be a finite number, got ${describeJsonKind(r[field])}`;
  }
  if (r.nextAttemptAt !== null && r.nextAttemptAt !== undefined && !isFiniteNumber(r.nextAttemptAt)) {
    return `field "nextAttemptAt" must be a finite number or null, got ${describeJsonKind(r.nextAttemptAt)}`;
  }
  if (r.error !== null && r.error !== undefined && typeof r.error !== "string") {
    return `field "error" must be a string or null, got ${describeJsonKind(r.error)}`;
  }
  if (INBOX[r.state as EventState].leased && (r.lease === null || r.lease === undefined)) return `field "lease" is missing: a ${r.state} event must have a lease`;
  const lease = r.lease === null || r.lease === undefined ? null : leaseProblem(r.lease);
  if (lease !== null) return `field "lease" ${lease}`;
  return null;
}

/** An id / key read from a stored form, or `null` when it has no usable one. */
function storedKey(value: unknown, field: "id" | "key"): string | null {
  const key = typeof value === "object" && value !== null ? (value as Record<string, unknown>)[field] : undefined;
  return typeof key === "string" && key.length > 0 ? key : null;
}

/** A key for a record whose id cannot be read: a hash (FNV-1a, 64 bits) of its stored form, stable while it is kept as it is. */
function derivedKey(stored: unknown): string {
  const text = JSON.stringify(stored) ?? String(stored);
  let h1 = 0x811c9dc5;
  let h2 = 0xcbf29ce4;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    h1 = Math.imul(h1 ^ c, 0x01000193) >>> 0;
    h2 = Math.imul(h2 ^ c, 0x01000193) >>> 0;
    h2 = Math.imul(h2 ^ (h1 >>> 16), 0x01000193) >>> 0;
  }
  return `damaged:${h1.toString(16).padStart(8, "0")}${h2.toString(16).padStart(8, "0")}`;
}

/** An event's channel as stored; `undefined` when unreadable. */
function storedChannel(value: unknown): string | null | undefined {
  const channel = typeof value === "object" && value !== null ? (value as Record<string, unknown>).channel : undefined;
  return channel === null || typeof channel === "string" ? channel : undefined;
}

/** Whether `value` is a well-formed {@link DamageMark}. */
function isMark(value: unknown): value is DamageMark {
  if (typeof value !== "object" || value === null) return false;
  const m = value as Record<string, unknown>;
  return (m.journal === "events" || m.journal === "outbox") && typeof m.id === "string" && typeof m.problem === "string" &&
    isFiniteNumber(m.setAsideAt) && typeof m.reported === "boolean";
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
 * Damaged records: a record loaded (`importState`, `applyChanges`) that is
 * not valid — an event or an outbox entry of the sidecar with a field of the
 * wrong type, an unknown state, … — is kept as it is and set aside by the
 * first operation that meets it (events: `claimDue`, `list`, `get`,
 * `damaged`; the sidecar: its `claimDue`, `list`, `get`, `reserve`,
 * `damaged`), once: see {@link DamagedEvent}. `setAside(id, problem)` sets a
 * valid event aside as it is (the bot's inbox does so with an event of its
 * channel that is not an inbound message). `damaged()` / `reportDamaged()`
 * list and report them (the sidecar's: `outbox.damaged()` /
 * `outbox.reportDamaged()`, as `DamagedRecord`s named after this journal);
 * the marks (`DamageMark`) go with `exportState()` and `takeChanges()`. A
 * journal that never loaded anything holds no damaged record but those set
 * aside with `setAside`.
 *
 * @example Usage
 * ```ts
 * import { MemoryEventJournal } from "@botmesh/durable/events";
 *
 * const journal = new MemoryEventJournal();
 * await journal.append({ id: "e1", eventType: "order.paid", payload: { order: 42 } });
 * const [event] = await journal.claimDue({ owner: "w1", incarnation: "a", leaseMs: 30_000, limit: 10 });
 * await journal.complete(event.id, event.lease!.token);
 * ```
 */
export class MemoryEventJournal implements LeasedEventJournal {
  /** `'memory-events'`, or the `name` option. */
  readonly name: string;
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
  /** Outbox entries loaded damaged (never in the sidecar), in the order found. */
  readonly #outDamaged = new Map<string, Damage>();
  /** Damaged records set aside, per journal (listed in the order they were: see {@link #asideList}). */
  readonly #aside = { events: new Map<string, Damage>(), outbox: new Map<string, Damage>() };
  /** Damaged records found and not set aside yet. */
  readonly #found = { events: new Set<Damage>(), outbox: new Set<Damage>() };
  /** Damaged records whose mark was set or changed since the last `takeChanges`. */
  readonly #marksChanged = new Set<Damage>();

  /**
   * An empty, open journal.
   *
   * @param options.clock the journal clock in ms since epoch (default `() => Date.now()`)
   * @param options.heartbeatChanges whether heartbeats are changes for `takeChanges` (default `false`)
   * @param options.name the name in errors and damaged records (default `'memory-events'`)
   * @throws {TypeError} when an option has the wrong type
   */
  constructor(options?: MemoryEventJournalOptions) {
    if (options !== undefined && (typeof options !== "object" || options === null)) {
      throw new TypeError(`MemoryEventJournal options must be an object, got ${show(options)}`);
    }
    if (options !== undefined) checkKnownOptions(options, ["clock", "heartbeatChanges", "name"], "MemoryEventJournal option");
    const clock = options?.clock ?? (() => Date.now());
    if (typeof clock !== "function") {
      throw new TypeError(`MemoryEventJournal option "clock" must be a function, got ${show(clock)}`);
    }
    const heartbeatChanges = options?.heartbeatChanges ?? false;
    if (typeof heartbeatChanges !== "boolean") {
      throw new TypeError(`MemoryEventJournal option "heartbeatChanges" must be a boolean, got ${show(heartbeatChanges)}`);
    }
    this.#heartbeatChanges = heartbeatChanges;
    const name = options?.name ?? "memory-events";
    if (typeof name !== "string" || name.length === 0) {
      throw new TypeError(`MemoryEventJournal option "name" must be a non-empty string, got ${show(name)}`);
    }
    this.name = name;
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
      {
        error: (key) => {
          const damage = this.#outDamaged.get(key);
          if (!damage) return null;
          this.#setAsideFound("outbox");
          return new DamagedRecordError({ journal: "outbox", id: key, backend: this.name, problem: damage.mark!.problem });
        },
        setAsideFound: () => this.#setAsideFound("outbox"),
        list: (options) => {
          const { unreported, limit } = checkDamagedList(options, "outbox.damaged");
          this.#setAsideFound("outbox");
          const out: DamagedRecord[] = [];
          for (const { mark } of this.#asideList("outbox")) {
            if (out.length >= limit) break;
            if (!unreported || !mark!.reported) out.push({ journal: "outbox", backend: this.name, ...markFields(mark!) });
          }
          return out;
        },
        report: (key) => {
          checkString(key, `outbox.reportDamaged: "key"`);
          return this.#report(this.#aside.outbox.get(key));
        },
      },
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
    if (slot?.damage) {
      // A change applied from elsewhere replaces a damaged record with a valid one.
      this.#forgetDamage(slot.damage);
      slot.damage = null;
      slot.record = next;
      this.#index(slot);
    } else if (slot) {
      const prev = slot.record;
      if (prev.state !== next.state || prev.channel !== next.channel || prev.orderKey !== next.orderKey) {
        this.#unindex(slot);
        slot.record = next;
        this.#index(slot);
      } else {
        slot.record = next;
      }
    } else {
      slot = { record: next, order: ++this.#order, damage: null };
      this.#slots.set(next.id, slot);
      this.#index(slot);
    }
    if (this.#tracking && (!heartbeat || this.#heartbeatChanges)) this.#changed.add(next.id);
    return slot;
  }

  /** Keeps `stored` as the damaged event `key` (in place of what the slot held), found, not set aside yet. */
  #storeDamagedEvent(key: string, stored: unknown, problem: string): void {
    let slot = this.#slots.get(key);
    if (slot?.damage && sameJson(slot.damage.stored, stored)) return; // applied again: it keeps its mark
    const damage: Damage = { journal: "events", key, problem, channel: storedChannel(stored), stored, mark: null };
    if (slot) {
      this.#unindex(slot);
      if (slot.damage) this.#forgetDamage(slot.damage);
      slot.record = stored as EventRecord;
      slot.damage = damage;
    } else {
      slot = { record: stored as EventRecord, order: ++this.#order, damage };
      this.#slots.set(key, slot);
    }
    this.#found.events.add(damage);
    if (this.#tracking) this.#changed.add(key);
  }

  /** Sets `damage` aside at `now`. @returns whether it was not set aside before */
  #markAside(damage: Damage, now: number): boolean {
    if (damage.mark !== null) return false;
    damage.mark = { journal: damage.journal, id: damage.key, problem: damage.problem, setAsideAt: now, reported: false };
    this.#found[damage.journal].delete(damage);
    this.#aside[damage.journal].set(damage.key, damage);
    if (this.#tracking) this.#marksChanged.add(damage);
    return true;
  }

  /**
   * The records of `journal` set aside, in the order they were: by `setAsideAt`, then key (records set aside
   * at once). Not by insertion: a change set applied again may take one out and put it back.
   */
  #asideList(journal: "events" | "outbox"): Damage[] {
    return [...this.#aside[journal].values()].sort((a, b) =>
      a.mark!.setAsideAt - b.mark!.setAsideAt || (a.key < b.key ? -1 : a.key > b.key ? 1 : 0)
    );
  }

  /** Sets aside the damaged records of `journal` found and not set aside yet: the first operation to meet one does. */
  #setAsideFound(journal: "events" | "outbox"): void {
    const found = this.#found[journal];
    if (found.size === 0) return;
    const now = this.#now();
    for (const damage of [...found]) this.#markAside(damage, now);
  }

  /** Marks a set-aside record reported. @returns whether it was not reported before */
  #report(damage: Damage | undefined): boolean {
    if (!damage || damage.mark === null || damage.mark.reported) return false;
    damage.mark = { ...damage.mark, reported: true }; // replaced: an export holds the old object
    if (this.#tracking) this.#marksChanged.add(damage);
    return true;
  }

  /** Drops a damaged record (replaced or deleted by a change applied from elsewhere). */
  #forgetDamage(damage: Damage): void {
    this.#found[damage.journal].delete(damage);
    this.#aside[damage.journal].delete(damage.key);
    this.#marksChanged.delete(damage);
    if (damage.journal === "outbox") this.#outDamaged.delete(damage.key);
  }

  /** Keeps `stored` as the damaged outbox entry `key`, found, not set aside yet. */
  #storeDamagedEntry(key: string, stored: unknown, problem: string): void {
    const damage: Damage = { journal: "outbox", key, problem, channel: undefined, stored, mark: null };
    this.#outDamaged.set(key, damage);
    this.#found.outbox.add(damage);
  }

  /** Applies a stored mark to its record (a valid event becomes set aside as it is); a mark of no record is dropped. */
  #applyMark(mark: DamageMark): void {
    let damage: Damage | undefined;
    if (mark.journal === "outbox") {
      damage = this.#outDamaged.get(mark.id);
    } else {
      const slot = this.#slots.get(mark.id);
      if (slot && slot.damage === null) {
        this.#unindex(slot);
        slot.damage = { journal: "events", key: mark.id, problem: mark.problem, channel: slot.record.channel, stored: slot.record, mark: null };
      }
      damage = slot?.damage ?? undefined;
    }
    if (!damage) return;
    damage.mark = mark;
    this.#found[damage.journal].delete(damage);
    this.#aside[damage.journal].set(damage.key, damage);
  }

  #index(slot: Slot): void {
    if (slot.damage) return;
    const { state, channel, orderKey } = slot.record;
    const index = isActive(state) ? this.#active : INBOX[state].purgeable ? this.#done : null;
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
    if (slot.damage) return;
    const { state, channel, orderKey } = slot.record;
    const index = isActive(state) ? this.#active : INBOX[state].purgeable ? this.#done : null;
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

  /**
   * Whether a new record of `orderKey` created at `createdAt` must be appended `pending` rather than leased
   * under `lease`: an active record of its key that comes before it (`createdAt` no later: the new record is
   * appended last) does not let it lease (see `admitsLeased`). One look at the key's active records.
   */
  #heldAtAppend(channel: string | null, orderKey: string, createdAt: number, now: number, lease: ClaimOptions): boolean {
    for (const slot of this.#groups.get(channel)?.get(orderKey) ?? []) {
      if (slot.record.createdAt <= createdAt && !admitsLeased(slot.record, now, lease)) return true;
    }
    return false;
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
    const key = slot.damage?.key ?? slot.record.id;
    if (slot.damage) this.#forgetDamage(slot.damage);
    this.#unindex(slot);
    this.#slots.delete(key);
    if (this.#tracking) {
      this.#changed.delete(key);
      this.#removed.add(key);
    }
  }

  /** The slot of a `processing` record whose lease carries `token`, or `null`. */
  #held(id: string, token: number): Slot | null {
    const slot = this.#slots.get(id);
    if (!slot || slot.damage || !INBOX[slot.record.state].leased || !holdsLease(slot.record.lease, token)) return null;
    return slot;
  }

  /**
   * Journals `event`: `pending`, or with `lease` already `processing` under
   * fencing token 1 (attempts 1). `createdAt` defaults to the journal clock.
   * With `lease` and an `orderKey`, it is leased only when no active record of
   * its key (in its channel) that comes before it would keep it waiting in a
   * due scan or be taken first by one (see {@link LeasedEventJournal.append});
   * otherwise it is journaled `pending`, as without `lease`. Looks at the
   * active records of its key only.
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
    const createdAt = input.createdAt ?? now;
    // Leased only when nothing of its key comes first; otherwise journaled as an append without a lease.
    if (lease !== undefined && input.orderKey !== null && this.#heldAtAppend(input.channel, input.orderKey, createdAt, now, lease)) {
      lease = undefined;
    }
    const record: EventRecord = {
      id: input.id,
      channel: input.channel,
      orderKey: input.orderKey,
      eventType: input.eventType,
      payload: input.payload,
      createdAt,
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
    if (!slot || slot.damage || slot.record.channel !== channel || !isInboxClaimable(slot.record, now, options)) return null;
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
    this.#setAsideFound("events");
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
   * Journals that run `attempt` of the record's handler begins under `token` (see {@link EventJournal.start}).
   * @returns `false` when `token` no longer holds the record
   */
  async start(id: string, token: number, attempt: number): Promise<boolean> {
    this.#assertOpen("events.start");
    checkString(id, `events.start: "id"`);
    checkFinite(token, `events.start: "token"`);
    checkAttempt(attempt, "events.start");
    const slot = this.#held(id, token);
    if (!slot) return false;
    const next = startedInbound(slot.record, attempt, this.#now());
    if (next !== slot.record) this.#store(next, slot);
    return true;
  }

  /**
   * `processing` → `scheduled`: a timer, claimable once `dueInMs` have passed (attempts unchanged).
   *
   * @throws {StaleLeaseError} when `token` is not the current lease (nothing changes)
   * @throws {TypeError} naming a bad argument
   */
  async schedule(id: string, token: number, dueInMs: number): Promise<void> {
    this.#assertOpen("events.schedule");
    checkString(id, `events.schedule: "id"`);
    checkFinite(token, `events.schedule: "token"`);
    checkFinite(dueInMs, `events.schedule: "dueInMs"`);
    const slot = this.#held(id, token);
    if (!slot) throw new StaleLeaseError("event", id, token);
    this.#store(scheduledInbound(slot.record, dueInMs, this.#now()), slot);
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
   * @throws {DamagedEventError} when it is damaged (it is set aside, if it was not yet)
   */
  async get(id: string): Promise<EventRecord | null> {
    this.#assertOpen("events.get");
    checkString(id, `events.get: "id"`);
    const slot = this.#slots.get(id);
    if (!slot) return null;
    if (slot.damage) {
      this.#setAsideFound("events");
      throw new DamagedEventError(this.name, id, slot.damage.mark!.problem, slot.damage.channel);
    }
    return cloneJson(slot.record);
  }

  /**
   * Events set aside as damaged (see {@link DamagedEvent}), in the order they
   * were, of `options.channel` when given (a record whose channel cannot be
   * read is listed under every channel); damaged records found and not set
   * aside yet are set aside first.
   *
   * @returns at most `options.limit` (default 100), only the unreported ones with `unreported`
   * @throws {TypeError} naming a bad option; {@link RangeError} for a bad `limit`
   */
  async damaged(options?: DamagedEventListOptions): Promise<DamagedEvent[]> {
    this.#assertOpen("events.damaged");
    const { unreported, limit } = checkDamagedList(options, "events.damaged");
    const hasChannel = options?.channel !== undefined;
    const channel = checkChannel(options?.channel, `events.damaged: option "channel"`);
    this.#setAsideFound("events");
    const out: DamagedEvent[] = [];
    for (const damage of this.#asideList("events")) {
      if (out.length >= limit) break;
      if (unreported && damage.mark!.reported) continue;
      if (hasChannel && damage.channel !== undefined && damage.channel !== channel) continue;
      out.push(damage.channel === undefined ? markFields(damage.mark!) : { ...markFields(damage.mark!), channel: damage.channel });
    }
    return out;
  }

  /**
   * Marks set-aside event `id` reported (of `options.channel` when given, as for `damaged`).
   * @returns whether this call marked it (`false`: reported already, or no set-aside event has this id)
   */
  async reportDamaged(id: string, options?: { channel?: string | null }): Promise<boolean> {
    this.#assertOpen("events.reportDamaged");
    checkString(id, `events.reportDamaged: "id"`);
    const hasChannel = options?.channel !== undefined;
    const channel = checkChannel(options?.channel, `events.reportDamaged: option "channel"`);
    const damage = this.#aside.events.get(id);
    if (hasChannel && damage !== undefined && damage.channel !== undefined && damage.channel !== channel) return false;
    return this.#report(damage);
  }

  /**
   * Sets event `id` aside as damaged with `problem`, as it is (see {@link DamagedEvent}).
   * @returns whether this call set it aside (`false`: no such event, or set aside already)
   */
  async setAside(id: string, problem: string): Promise<boolean> {
    this.#assertOpen("events.setAside");
    checkString(id, `events.setAside: "id"`);
    checkString(problem, `events.setAside: "problem"`);
    const slot = this.#slots.get(id);
    if (!slot) return false;
    if (slot.damage === null) {
      this.#unindex(slot);
      slot.damage = { journal: "events", key: id, problem, channel: slot.record.channel, stored: slot.record, mark: null };
    }
    return this.#markAside(slot.damage, this.#now());
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
    this.#setAsideFound("events");
    for (const slot of this.#slots.values()) {
      if (slot.damage) continue;
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
    if (!slot || slot.damage) return false;
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
   * consistent). Damaged records are exported as they were stored. Works
   * after `close()`.
   *
   * @returns events in append order, outbox entries in `seq` order (the damaged ones after them), the last
   *   `seq` issued, and the marks of the records set aside
   */
  exportState(): EventJournalState {
    const events: EventRecord[] = new Array(this.#slots.size);
    let i = 0;
    for (const slot of this.#slots.values()) events[i++] = slot.record;
    const { outbox, outboxSeq } = this.#sidecar.exportRecords();
    for (const damage of this.#outDamaged.values()) outbox.push(damage.stored as OutboxEntry);
    const damaged: DamageMark[] = [];
    for (const damage of this.#asideList("events")) damaged.push(damage.mark!);
    for (const damage of this.#asideList("outbox")) damaged.push(damage.mark!);
    return { events, outbox, outboxSeq, damaged };
  }

  /**
   * Loads `state` into this journal, which must be empty. The objects are
   * adopted, not copied: the caller must not keep or change them. Loading is
   * not a change: `takeChanges()` does not report it. A record that is not
   * valid (a field of the wrong type, an unknown state, …) is loaded as
   * damaged, kept as it is: the first operation that meets it sets it aside
   * (see {@link DamagedEvent}), unless `state.damaged` marks it set aside already.
   *
   * @param state what {@link exportState} returned, or its JSON round trip
   * @throws {Error} when the journal holds records
   * @throws {TypeError} when the state is not `{ events: [], outbox: [], outboxSeq, damaged? }` (nothing is loaded)
   * @throws {RangeError} when an id or key repeats or `seq`s are not ascending (the journal may then be partly loaded: discard it)
   */
  importState(state: EventJournalState): void {
    if (typeof state !== "object" || state === null || !Array.isArray(state.events) || !Array.isArray(state.outbox)) {
      throw new TypeError(`importState: the state must be { events: [], outbox: [], outboxSeq }, got ${show(state)}`);
    }
    checkFinite(state.outboxSeq, `importState: "outboxSeq"`);
    const marks = checkMarks(state.damaged, "importState");
    if (this.#slots.size > 0 || this.#outDamaged.size > 0 || this.#sidecar.exportRecords().outbox.length > 0) {
      throw new Error("importState needs an empty journal");
    }
    const events = classify(state.events, "id", storedEventProblem, "importState: event");
    const outbox = classify(state.outbox, "key", storedOutboxProblem, "importState: outbox entry");
    this.#tracking = false;
    try {
      for (const { key, stored, problem } of events) {
        if (problem === null) this.#store(normalized(stored));
        else this.#storeDamagedEvent(key, stored, problem);
      }
      const valid: OutboxEntry[] = [];
      for (const { key, stored, problem } of outbox) {
        if (problem === null) valid.push(stored as OutboxEntry);
        else this.#storeDamagedEntry(key, stored, problem);
      }
      this.#sidecar.importRecords({ inbox: [], outbox: valid, outboxSeq: state.outboxSeq });
      for (const mark of marks) this.#applyMark(mark);
    } finally {
      this.#tracking = true;
    }
    if (state.outboxSeq > this.#outSeq) this.#outSeq = state.outboxSeq;
  }

  /**
   * What changed since the last call (or since construction / loading): the
   * changed records as they are now (the journal's own objects, as with
   * {@link exportState}), what was deleted, and the marks of records set
   * aside or reported. Heartbeats count only with
   * the `heartbeatChanges` option; otherwise a record whose lease was only
   * extended is reported with its next change. Works after `close()`.
   *
   * @returns the changes, or `null` when nothing changed
   */
  takeChanges(): EventJournalChanges | null {
    if (
      this.#changed.size === 0 && this.#removed.size === 0 && this.#outChanged.size === 0 && this.#outRemoved.size === 0 &&
      this.#marksChanged.size === 0
    ) {
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
    // Only when there are some: a change set without marks is what versions before them wrote.
    if (this.#marksChanged.size > 0) changes.damaged = [...this.#marksChanged].map((damage) => damage.mark!);
    this.#changed.clear();
    this.#removed.clear();
    this.#outChanged.clear();
    this.#outRemoved.clear();
    this.#marksChanged.clear();
    return changes;
  }

  /**
   * Replays a change set taken from a journal with `takeChanges()` (or its
   * JSON round trip): deletes the removed records, then stores the given ones
   * (an existing id is replaced in place, a new one appended), then applies
   * the marks. A record that is not valid is stored as damaged, as it is
   * (see {@link importState}). Idempotent:
   * applying a set twice, or a set the state already holds, leaves the same
   * state. Objects are adopted, not copied. Applying is not a change of this
   * journal: `takeChanges()` does not report it.
   *
   * @param changes what `takeChanges()` returned
   * @throws {TypeError} when it is not a change set (nothing is applied)
   */
  applyChanges(changes: EventJournalChanges): void {
    if (
      typeof changes !== "object" || changes === null || !Array.isArray(changes.events) ||
      !Array.isArray(changes.removedEvents) || !Array.isArray(changes.outbox) || !Array.isArray(changes.removedOutbox)
    ) {
      throw new TypeError(`applyChanges: not a change set: ${show(changes)}`);
    }
    checkFinite(changes.outboxSeq, `applyChanges: "outboxSeq"`);
    const marks = checkMarks(changes.damaged, "applyChanges");
    const given = new Map<string, Classified>();
    for (const item of classify(changes.events, "id", storedEventProblem, null)) given.set(item.key, item);
    const entries = classify(changes.outbox, "key", storedOutboxProblem, null);
    this.#tracking = false;
    try {
      for (const id of changes.removedEvents) {
        const slot = this.#slots.get(id);
        if (!slot) continue;
        // Purged and appended again, and this state already holds the new record: leave it in its place.
        const again = given.get(id);
        if (again !== undefined && sameJson(again.stored, slot.record)) continue;
        this.#delete(slot);
      }
      for (const { key, stored, problem } of given.values()) {
        const slot = this.#slots.get(key);
        if (problem !== null) this.#storeDamagedEvent(key, stored, problem);
        else if (!slot?.damage || !sameJson(slot.record, stored)) this.#store(normalized(stored), slot); // a record set aside as it is stays so
      }
      const valid: OutboxEntry[] = [];
      const removed: string[] = [];
      for (const key of changes.removedOutbox) {
        const damage = this.#outDamaged.get(key);
        if (damage) this.#forgetDamage(damage);
        else removed.push(key);
      }
      for (const { key, stored, problem } of entries) {
        const damage = this.#outDamaged.get(key);
        if (problem === null) {
          if (damage) this.#forgetDamage(damage);
          valid.push(stored as OutboxEntry);
        } else if (!damage || !sameJson(damage.stored, stored)) {
          if (damage) this.#forgetDamage(damage);
          removed.push(key); // a live entry of that key is replaced by the damaged one
          this.#storeDamagedEntry(key, stored, problem);
        }
      }
      this.#sidecar.applyOutboxChanges(valid, removed, changes.outboxSeq);
      for (const mark of marks) this.#applyMark(mark);
    } finally {
      this.#tracking = true;
    }
    if (changes.outboxSeq > this.#outSeq) this.#outSeq = changes.outboxSeq;
  }
}

/** A stored record with its key and what is wrong with it (`null`: valid). */
interface Classified {
  key: string;
  stored: unknown;
  problem: string | null;
}

/**
 * The stored records of one list with their keys and problems. A damaged
 * record without a usable id / key gets one derived from its stored form
 * (`:2`, `:3`… after it for identical ones).
 * @param where for a repeated key: the RangeError's prefix (`null`: a later record of a key replaces an earlier one)
 * @throws {RangeError} when a key repeats
 */
function classify(
  list: readonly unknown[],
  field: "id" | "key",
  problemOf: (value: unknown) => string | null,
  where: string | null,
): Classified[] {
  const seen = new Set<string>();
  const out: Classified[] = [];
  for (const stored of list) {
    const problem = problemOf(stored);
    let key = storedKey(stored, field);
    if (key === null) {
      const base = derivedKey(stored);
      key = base;
      for (let n = 2; where !== null && seen.has(key); n++) key = `${base}:${n}`;
    } else if (where !== null && seen.has(key)) {
      throw new RangeError(`${where} ${field} ${JSON.stringify(key)} appears twice`);
    }
    seen.add(key);
    out.push({ key, stored, problem });
  }
  return out;
}

/** A valid stored event, `orderKey` filled in when it was stored before there were ordering groups. */
function normalized(stored: unknown): EventRecord {
  const record = stored as EventRecord;
  if (record.orderKey === undefined) record.orderKey = null;
  return record;
}

/** The well-formed marks of a state or change set (a malformed one is dropped: its record is set aside again). */
function checkMarks(marks: unknown, op: string): DamageMark[] {
  if (marks === undefined) return [];
  if (!Array.isArray(marks)) throw new TypeError(`${op}: "damaged" must be an array of marks, got ${describeJsonKind(marks)}`);
  return marks.filter(isMark);
}

/** The fields of a damaged-record listing taken from its mark. */
function markFields(mark: DamageMark): { id: string; problem: string; setAsideAt: number; reported: boolean } {
  return { id: mark.id, problem: mark.problem, setAsideAt: mark.setAsideAt, reported: mark.reported };
}

/** What the outbox sidecar gets to know of its damaged entries (kept by the journal, never in the sidecar). */
interface OutboxDamage {
  /** The error of `get` for a damaged key (set aside now if it was only found), or `null`. */
  error(key: string): DamagedRecordError | null;
  /** Sets aside the damaged entries found and not set aside yet. */
  setAsideFound(): void;
  list(options?: DamagedListOptions): DamagedRecord[];
  report(key: string): boolean;
}

/**
 * The sidecar's outbox, rejecting calls once the journal is closed, telling
 * heartbeats apart, with the journal's damaged entries set aside: its chat
 * moves on, `list` leaves it out, `get` and `reserve` of its key reject with a
 * {@link DamagedRecordError} (whether it was sent is unknown), `retry` and
 * `discard` answer `false`, an outcome under its old lease is stale.
 */
class SidecarOutbox implements OutboxJournal {
  readonly #inner: OutboxJournal;
  readonly #journal: { assertOpen(op: string): void; asHeartbeat<T>(run: () => T): T };
  readonly #damage: OutboxDamage;

  constructor(
    inner: OutboxJournal,
    assertOpen: (op: string) => void,
    asHeartbeat: <T>(run: () => T) => T,
    damage: OutboxDamage,
  ) {
    this.#inner = inner;
    this.#journal = { assertOpen, asHeartbeat };
    this.#damage = damage;
  }

  async reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    this.#journal.assertOpen("outbox.reserve");
    const key = typeof entry === "object" && entry !== null ? entry.key : undefined;
    const damaged = typeof key === "string" ? this.#damage.error(key) : null;
    if (damaged) throw damaged;
    return this.#inner.reserve(entry, lease);
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    this.#journal.assertOpen("outbox.claimDue");
    this.#damage.setAsideFound();
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
    const damaged = typeof key === "string" ? this.#damage.error(key) : null;
    if (damaged) throw damaged;
    return this.#inner.get(key);
  }

  async list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    this.#journal.assertOpen("outbox.list");
    this.#damage.setAsideFound();
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

  /** Entries set aside as damaged, in the order they were (those found and not set aside yet first are). */
  async damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    this.#journal.assertOpen("outbox.damaged");
    return this.#damage.list(options);
  }

  /** Marks a set-aside entry reported. @returns whether this call marked it */
  async reportDamaged(key: string): Promise<boolean> {
    this.#journal.assertOpen("outbox.reportDamaged");
    return this.#damage.report(key);
  }
}
