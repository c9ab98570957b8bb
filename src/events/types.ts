/**
 * The events journal's contract (`@botmesh/durable/events`): records of an
 * app's event journal, claimed with leases and fencing tokens, and the
 * `LeasedEventJournal` that a shared journal implements.
 *
 * @module
 */
import type { InboxStateName } from "../machine.ts";
import type { ClaimOptions, DamagedListOptions, FailOutcome, JsonValue, Lease, OutboxJournal } from "../contract.ts";

/** The channel of the bot's inbox records in an events journal. */
export const BOT_CHANNEL = "botwa:durable";
/** The eventType of an inbound message journaled by the bot. */
export const INBOUND_MESSAGE_EVENT = "botwa.inbound.message";
/** The eventType of an inbound interaction journaled by the bot. */
export const INBOUND_INTERACTION_EVENT = "botwa.inbound.interaction";

/** Where an event is in its processing. Same lifecycle as an inbox record. */
export type EventState = InboxStateName;

/** What a caller appends. */
export interface NewEventRecord {
  /** Unique in the journal; a second append with the same id does nothing. */
  id: string;
  /** `null` (or absent) for the app's own events; the bot's records use {@link BOT_CHANNEL}. */
  channel?: string | null;
  /**
   * The ordering group of the event within its channel (an order id, an
   * account, a chat: the bot's records use their chat id); `null` or absent:
   * none. Records of one `orderKey` are claimed by due scans in order, one
   * claimer at a time (see {@link LeasedEventJournal.claimDue}).
   */
  orderKey?: string | null;
  eventType: string;
  payload: JsonValue;
  /** When it happened (ms since epoch); default: the journal's clock at append. Claims take the oldest first. */
  createdAt?: number;
}

/** One record of the journal. */
export interface EventRecord {
  id: string;
  channel: string | null;
  /** The ordering group within the channel; `null`: none (so are records stored before there were groups). */
  orderKey: string | null;
  eventType: string;
  payload: JsonValue;
  createdAt: number;
  state: EventState;
  /** Claims so far. */
  attempts: number;
  /** When a `failed` record may be claimed again. */
  nextAttemptAt: number | null;
  lease: Lease | null;
  /** The last fencing token issued (0 before the first claim). */
  fence: number;
  error: string | null;
  updatedAt: number;
}

/**
 * Lease options of a claim. `channel` says which records it may take:
 * absent or `null` takes only records without a channel (so an app's
 * `EventWorker` never takes the bot's records); a string takes only that
 * channel's records.
 */
export interface EventClaimOptions extends ClaimOptions {
  channel?: string | null;
}

/** Options of `list`. */
export interface EventListOptions {
  /** A channel (`null`: records without one); absent: every channel. */
  channel?: string | null;
  state?: EventState | readonly EventState[];
  eventType?: string;
  /** Default 100. */
  limit?: number;
}

/**
 * An event set aside as damaged: its stored form is not an event record (a
 * field of the wrong type, an unknown state, …), or a reader could not use it
 * and set it aside (`setAside`: the bot's inbox does so with an event of its
 * channel that is not an inbound message). It is kept as it is, never
 * deleted, and left out of everything else: due scans neither take it nor
 * let it hold back its `orderKey`, `list` returns the other records, `get`
 * rejects with a {@link DamagedEventError}, `claim` answers `null`, `replay`
 * `false`, `purge` leaves it, and a completion under its old lease is stale.
 * The first `claimDue`, `list`, `get` or `damaged` that meets a damaged
 * record sets it aside, once.
 */
export interface DamagedEvent {
  /** Its id as stored; for a record whose id cannot be read, a key derived from its stored form (`damaged:<hash>`). */
  id: string;
  /** Its channel as stored; absent when that cannot be read (such a record is listed under every channel). */
  channel?: string | null;
  /** What is wrong, naming the field. */
  problem: string;
  /** Journal-clock time it was set aside. */
  setAsideAt: number;
  /** Whether a reader reported it already (see `reportDamaged`). */
  reported: boolean;
}

/** Options of `damaged`. */
export interface DamagedEventListOptions extends DamagedListOptions {
  /** A channel (`null`: records without one); absent: every channel. */
  channel?: string | null;
}

/** `get` of an event set aside as damaged (see {@link DamagedEvent}). */
export class DamagedEventError extends Error {
  /** The event's id (see {@link DamagedEvent.id}). */
  readonly id: string;
  /** The journal's name. */
  readonly journal: string;
  /** What is wrong, naming the field. */
  readonly problem: string;
  /** Its channel as stored; absent when that cannot be read. */
  readonly channel?: string | null;
  constructor(journal: string, id: string, problem: string, channel?: string | null) {
    super(`Event "${id}" in journal "${journal}" is damaged and set aside: ${problem}`);
    this.name = "DamagedEventError";
    this.id = id;
    this.journal = journal;
    this.problem = problem;
    if (channel !== undefined) this.channel = channel;
  }
}

/**
 * An events journal whose operations are atomic, with leases and fencing
 * tokens checked by the journal: what the bot's durability needs from an
 * events journal, and what an `EventWorker` claims from. Records come back as
 * copies. Same rules as the inbox of the durability contract
 * (`src/contract.ts`), with a channel.
 */
export interface LeasedEventJournal {
  /** A name for errors and metrics (e.g. `'file-events'`). */
  readonly name: string;
  /** Who may share it: `'process'` (FileEventJournal) or `'host'` (SharedFileEventJournal). */
  readonly scope: "process" | "host" | "shared";
  /**
   * Journals `event` (`pending`, or `processing` under `lease` with token 1).
   * With `lease`, a record with an `orderKey` is leased only when nothing of
   * its key comes first: while an active record of its key (in its channel)
   * that comes before it (`createdAt`, then append order) is held elsewhere
   * (see {@link claimDue}) or would be taken first by a due scan (`pending`, a
   * retry that is due, a lapsed lease), it is journaled `pending` instead
   * (attempts 0, token 0: the caller must not handle it), and a due scan
   * takes it, in order, once the key is free. The caller's own live leases
   * (same owner and incarnation), a `failed` record waiting for its retry,
   * settled records and records set aside come first in nothing. The check
   * and the append are one atomic step (in `SharedFileEventJournal`, under its
   * mutex: across the processes of the host too). A record without a key is
   * leased as asked. This is the bot's inbox admission (`InboxJournal.admit`)
   * for the bot's records, whose key is their chat.
   * @returns the record, or `null` when a record with that id exists (nothing changes)
   */
  append(event: NewEventRecord, lease?: ClaimOptions): Promise<EventRecord | null>;
  /** Leases record `id` when it is claimable and in `options.channel` (whatever its `orderKey`'s order); `null` otherwise. */
  claim(id: string, options: EventClaimOptions): Promise<EventRecord | null>;
  /**
   * Leases up to `limit` claimable records of `options.channel` in order
   * (oldest `createdAt` first, append order on ties), keeping the order of each
   * `orderKey`: a record with a key is taken only while no earlier active
   * record of its key (in its channel) is `processing` under a lease held
   * elsewhere (live, and not the caller's: another owner's, or another
   * incarnation's that `reclaimOwn` does not cover). Such a record holds back
   * every later record of its key, due or not, until it settles or its lease
   * lapses; so two callers never hold records of one key at once, concurrent
   * scans included. The caller's own live leases hold nothing back (the
   * caller runs its records of a key one after another: `EventWorker` does),
   * and neither does a `failed` record waiting for its retry. Records without
   * a key are not ordered. O(due), plus the active records of the keys it
   * looks at.
   */
  claimDue(options: EventClaimOptions & { limit: number }): Promise<EventRecord[]>;
  /** Extends the lease held under `token`; `false` when it is no longer held. */
  heartbeat(id: string, token: number, leaseMs: number): Promise<boolean>;
  /**
   * Journals that run `attempt` of the record's handler begins under `token`: `attempts`
   * becomes `max(attempts, attempt)` (a claim counts nothing). `false` when `token` is no longer held.
   */
  start(id: string, token: number, attempt: number): Promise<boolean>;
  /**
   * `scheduled`: a timer, claimable once `dueInMs` have passed (attempts unchanged).
   * @throws {StaleLeaseError} when `token` is not the current lease
   */
  schedule(id: string, token: number, dueInMs: number): Promise<void>;
  /** `done`. @throws {StaleLeaseError} when `token` is not the current lease */
  complete(id: string, token: number): Promise<void>;
  /** `failed` (claimable again after `retryInMs`) or `dead`. @throws {StaleLeaseError} */
  fail(id: string, token: number, outcome: FailOutcome): Promise<void>;
  /** @throws {DamagedEventError} when the record is set aside as damaged */
  get(id: string): Promise<EventRecord | null>;
  /** Every channel unless `channel` is given, in append order; records set aside as damaged are left out. */
  list(options?: EventListOptions): Promise<EventRecord[]>;
  /** `done`, `failed` or `dead` back to `pending` with attempts reset; `false` otherwise. */
  replay(id: string): Promise<boolean>;
  /** Deletes `done` records of `channel` (absent: every channel) not updated for `olderThanMs`. @returns how many */
  purge(olderThanMs: number, options?: { channel?: string | null }): Promise<number>;
  /**
   * Events set aside as damaged (see {@link DamagedEvent}) in the order they
   * were set aside, of `channel` when given; at most `limit` (default 100).
   */
  damaged?(options?: DamagedEventListOptions): Promise<DamagedEvent[]>;
  /**
   * Marks a damaged event reported (of `options.channel` when given, as for `damaged`).
   * @returns `true` for exactly one caller (`false`: reported already, or no set-aside event has this id)
   */
  reportDamaged?(id: string, options?: { channel?: string | null }): Promise<boolean>;
  /**
   * Sets event `id` aside as damaged with `problem`, as it is (a reader that
   * cannot use it, e.g. the bot's inbox with an event of its channel that is
   * not an inbound message). @returns whether this call set it aside (`false`: no such event, or set aside already)
   */
  setAside?(id: string, problem: string): Promise<boolean>;
  /** The core's outbox, stored as a sidecar of this journal (same file, same atomic write). */
  readonly outbox: OutboxJournal;
  /** Lets operations already called finish, then rejects later ones. */
  close(): Promise<void>;
}

/** The methods every {@link LeasedEventJournal} has (its optional ones left out). */
export const LEASED_EVENT_JOURNAL_METHODS: readonly (keyof LeasedEventJournal)[] = [
  "append",
  "claim",
  "claimDue",
  "heartbeat",
  "start",
  "schedule",
  "complete",
  "fail",
  "get",
  "list",
  "replay",
  "purge",
  "close",
];

export type { FailOutcome };
