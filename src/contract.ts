/**
 * The backend contract: what a durability backend must provide so that the
 * engine can keep the inbox/outbox guarantees. Every backend (memory, file,
 * SQLite, Postgres, Redis, events journal, or the generic {@link DurableKv}
 * one) implements {@link DurabilityBackend} and passes the shared conformance
 * suite (`runDurabilityConformance` in `@botmesh/durable/testing`).
 *
 * Rules every implementation keeps:
 * - Times are decided by the backend's own clock (a shared backend uses its
 *   server's clock). Callers pass durations (`leaseMs`, `retryInMs`), never
 *   absolute times.
 * - Every claim issues a new fencing token, strictly greater than every token
 *   issued before for that record. Completions, failures and heartbeats carry
 *   the token and are checked atomically by the backend; a stale one throws
 *   {@link StaleLeaseError} (heartbeats return `false`) and changes nothing.
 *   A late outbox outcome (`markSent`, `markFailed`) also resolves an
 *   `unknown` entry whose `fence` is still its token (nobody claimed it since).
 * - Due scans (`claimDue`) cost O(due), not O(all records): settled records
 *   (`done`, `sent`, `dead`, `unknown`) are never scanned by them.
 *
 * @module
 */

import type { InboxStateName, OutboxStateName } from "./machine.ts";

/** A JSON value as stored in a journal. */
export type JsonValue =
  | string
  | number
  | boolean
  | null
  | JsonValue[]
  | { [key: string]: JsonValue };

/** The two kinds of inbound records. */
export type InboundKind = "message" | "interaction";

/**
 * Inbound record states.
 * `pending` admitted, not yet claimed; `processing` leased to an instance;
 * `failed` the handler threw, retried at `nextAttemptAt`; `done`; `dead` (inbound DLQ).
 */
export type InboundState = InboxStateName;

/**
 * Outbox entry states.
 * `queued` journaled, waiting for the worker; `sending` leased, the provider
 * call may be under way; `sent`; `failed` retried at `nextAttemptAt`; `dead`
 * (outbound DLQ); `unknown` the owner's lease lapsed (or its incarnation was
 * replaced) while sending, or its sender reported an ambiguous outcome
 * (`markFailed` with `ambiguous: true`: the call may have reached the
 * channel). An `unknown` entry keeps its `fence`:
 * when its sender was in fact alive (a stall, a clock step) and its provider
 * call finishes, its `markSent`/`markFailed` under that token still resolves
 * it to `sent`, `failed` or `dead`, as long as nobody claimed the entry since
 * (an operator `retry` makes it `queued`, and the next claim issues a new
 * token). An `unknown` entry does not block its chat; resolved to `failed` it
 * blocks it again.
 */
export type OutboxState = OutboxStateName;

/** The lease an instance holds on a record while it works on it. */
export interface Lease {
  /** The `instanceId` of the holder. */
  owner: string;
  /** Random id of the holder's process incarnation (one per `Bot` start). */
  incarnation: string;
  /** Fencing token: strictly increasing per record, checked on every completion. */
  token: number;
  /** Backend-clock time (ms since epoch) at which the lease lapses. */
  expiresAt: number;
}

/** What an inbound record holds when it is admitted. */
export interface NewInboundRecord {
  /** The provider's message id (also the record id). */
  id: string;
  kind: InboundKind;
  chatId: string;
  /** The provider's name. */
  provider: string;
  /** The inbound message as JSON. */
  payload: JsonValue;
  /** When the bot received it (ms since epoch). */
  receivedAt: number;
}

/** An inbound record as journaled. */
export interface InboundRecord extends NewInboundRecord {
  state: InboundState;
  /** How many runs of its handler began (see `InboxJournal.start`); claims are not counted. */
  attempts: number;
  /** For `failed`: when it may be claimed again (backend clock). */
  nextAttemptAt: number | null;
  /** Set while `processing`. */
  lease: Lease | null;
  /**
   * The last fencing token issued for this record: 1 when it was admitted leased, 0 when admitted
   * pending and never claimed. A claim issues `max(fence, 1) + 1` (`claimToken`), never 1.
   */
  fence: number;
  /** The last handler error, as text. */
  error: string | null;
  /** Backend-clock time of the last change. */
  updatedAt: number;
}

/** What an outbox entry holds when it is reserved. */
export interface NewOutboxEntry {
  /** The idempotency key (the entry's id). */
  key: string;
  chatId: string;
  /** The content as JSON (binary already encoded as base64). */
  content: JsonValue;
  /** A hash of `content`, used to detect a reused key with different content. */
  contentHash: string;
  /** The inbound record this send was made for, if any. */
  inboundId: string | null;
}

/** An outbox entry as journaled. */
export interface OutboxEntry extends NewOutboxEntry {
  state: OutboxState;
  /** Provider calls started for this entry. */
  attempts: number;
  /** For `queued`/`failed`: when it may be claimed (backend clock). */
  nextAttemptAt: number | null;
  /** Set while `sending`. */
  lease: Lease | null;
  /**
   * The last fencing token issued for this entry: 1 when it was reserved leased, 0 when reserved
   * queued and never claimed. A claim issues `max(fence, 1) + 1` (`claimToken`), never 1.
   */
  fence: number;
  /**
   * Whether a provider call may have started under the entry's current fence:
   * set by {@link OutboxJournal.markCalling}, just before the call. Every
   * claim that issues a fencing token (a leased `reserve`, `claimDue`) starts
   * it `false`, except `claimDue` with `resendAmbiguous` re-leasing a lost
   * `sending` entry that was `called`: it stays `true` (the lost call may
   * still reach the channel, so the new lease lost before its own call is
   * ambiguous again). Nothing else changes it. A `sending` entry whose lease
   * lapsed with `called` still `false` was never sent: `claimDue` leases it
   * again as due work, not as an ambiguous one.
   */
  called: boolean;
  /** The provider's message id once `sent`. */
  messageId: string | null;
  error: string | null;
  /** Order of reservation; sends of one chat leave in this order. */
  seq: number;
  createdAt: number;
  updatedAt: number;
}

/** Who claims, and for how long. */
export interface ClaimOptions {
  /** The claimer's `instanceId`. */
  owner: string;
  /** The claimer's incarnation id. */
  incarnation: string;
  /** Lease length in ms (backend clock). */
  leaseMs: number;
  /**
   * Also take records leased by `owner` under another incarnation, whatever
   * their expiry (the first sweep after a restart with the same instanceId).
   * Live leases of this very incarnation are never taken; a lapsed one is
   * claimable like anyone's (so that a claim whose reply was lost on the
   * network does not strand its records).
   */
  reclaimOwn?: boolean;
}

/** A due scan: at most `limit` records. */
export interface ClaimDueOptions extends ClaimOptions {
  limit: number;
  /**
   * Names this scan so that its answer can be asked for again with
   * `repeat` when its reply never arrives (an error that may hide a
   * commit). A fresh id for each scan. A caller asks again before it scans
   * again, so a backend keeps at least the latest answer of each caller
   * (owner and incarnation), for at least {@link SCAN_ANSWER_KEEP_MS} (a scan
   * that took nothing may keep nothing: its repeat answers nothing all the
   * same). A repeat closes the request: a scan of that id that had not
   * committed when its repeat was answered never commits.
   */
  requestId?: string;
  /**
   * Change nothing: answer what the earlier scan named `requestId` answered
   * (the records it leased to the caller; on the outbox, the entries it made
   * ambiguous too), or nothing (`[]`, no entries) when that scan committed
   * nothing or took nothing. A record that changed since may be answered as
   * that scan answered it: its fencing token is then stale. A backend whose
   * scan is not one atomic step (the generic kv: one compare-and-set per
   * record) answers the records whose claims it had confirmed when the
   * error came; one whose own claim lost its reply is taken again once its
   * lease lapses.
   */
  repeat?: boolean;
}

/**
 * How long (ms) a backend keeps a due scan's answer for a repeat (see {@link ClaimDueOptions.requestId}):
 * a journal that stays unreachable longer than this after a scan lost its reply leaves the sends that
 * scan made ambiguous `unknown` without a `durability:ambiguous` event (they are listed, counted and
 * shown like every `unknown` send).
 */
export const SCAN_ANSWER_KEEP_MS = 600_000;

/**
 * How a failure is recorded: retry after a delay, dead, or (outbox only)
 * ambiguous.
 *
 * - `{ error, retryInMs }`: `failed`, due again after `retryInMs`.
 * - `{ error, dead: true }`: `dead` (the DLQ).
 * - `{ error, ambiguous: true }` (`outbox.markFailed` only): the provider call
 *   may have reached the channel (e.g. it timed out after the request was
 *   sent). The entry becomes `unknown` exactly as `claimDue` makes a lapsed
 *   `sending` entry unknown: lease dropped, `nextAttemptAt` null, `fence` and
 *   `attempts` unchanged, `error` set to `error`. It no longer blocks its
 *   chat, is not re-sent on its own, a late outcome under the same token
 *   still resolves it, and an operator `retry` requeues it. `inbox.fail` (and
 *   an events journal's `fail`) refuses it with a `TypeError`: inbound records
 *   have no `unknown` state. `ambiguous` together with `dead` (or with a
 *   `retryInMs`) is a `TypeError`.
 * - `{ error, retryInMs, throttled: true }` (`outbox.markFailed` only): the
 *   channel refused the call for its rate limit (a 429), so nothing was sent
 *   and no attempt was spent: `failed` and due again after `retryInMs` like a
 *   retry, with `attempts` given back (one less, never below 0: the next claim
 *   counts the same attempt again). `throttled` with `dead` or `ambiguous`, and
 *   on `inbox.fail` (or an events journal's `fail`), is a `TypeError`.
 */
export type FailOutcome =
  | { error: string; retryInMs: number; dead?: false; ambiguous?: false; throttled?: boolean }
  | { error: string; dead: true; ambiguous?: false; throttled?: false }
  | { error: string; ambiguous: true; dead?: false; retryInMs?: undefined; throttled?: false };

/** A filter for `list`. */
export interface ListOptions<S extends string> {
  /** One state or several; all states when omitted. */
  state?: S | readonly S[];
  chatId?: string;
  /** At most this many (default 100). */
  limit?: number;
}

/**
 * A record a backend could not read back, set aside. Damaged means its stored
 * form is not a record (invalid JSON, a field of the wrong type, an unknown
 * state), whatever did it: a disk, a hand edit, a bug elsewhere. Set aside
 * means kept with the data it was stored with (a backend whose scan leased
 * it before reading it may leave that stale lease), never deleted, and left
 * out of everything else: a due
 * scan neither takes it nor lets it hold back its chat, `list` returns the
 * other records, `get` rejects with a {@link DamagedRecordError}, and
 * operations on it change nothing (`replay`, `retry` and `discard` answer
 * `false`; a completion under its old lease is stale). The first `claimDue`
 * or `list` that meets it sets it aside, once (some backends on any read, or
 * when they load it); `damaged` lists the records
 * set aside, and the bot reports each one once (`reportDamaged`).
 */
export interface DamagedRecord {
  /** The journal it is in. */
  journal: "inbox" | "outbox";
  /** The record's id (inbox) or key (outbox), as the backend stores it. */
  id: string;
  /** The backend's `name`. */
  backend: string;
  /** What is wrong, naming the field. */
  problem: string;
  /** Backend-clock time it was set aside. */
  setAsideAt: number;
  /** Whether a bot reported it already (see `reportDamaged`). */
  reported: boolean;
}

/** A filter for `damaged`. */
export interface DamagedListOptions {
  /** Only the records no bot reported yet. */
  unreported?: boolean;
  /** At most this many (default 100). */
  limit?: number;
}

/** The journal calls that read and report the damaged records of one journal. */
export interface DamagedRecords {
  /** Records set aside as damaged, in the order they were set aside. */
  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]>;
  /**
   * Mark a damaged record reported: of several bots that find it, exactly
   * one call answers `true` and reports it.
   * @returns whether this call marked it (`false`: reported already, or no damaged record has this id)
   */
  reportDamaged(id: string): Promise<boolean>;
}

/** The inbound journal. */
export interface InboxJournal extends DamagedRecords {
  /**
   * Journal a new inbound record: `pending`, or with `lease` already leased
   * to the caller (`processing`, attempts 1: the run the caller makes of it,
   * fencing token 1) so that no other instance takes it while it waits in the
   * caller's per-chat queue. With
   * `lease`, the record is leased only when nothing of its chat comes first:
   * while an active record of its chat is held elsewhere (see `claimDue`) or
   * would be taken first by a due scan (pending, a retry that is due, a
   * lapsed lease), it is journaled `pending` instead (attempts 0, token 0:
   * the caller must not handle it), and a due scan takes it, in order, once
   * the chat is free. The caller's own live leases, a `failed` record
   * waiting for its retry and settled records come first in nothing (see
   * `admitsLeased` in the journal rules). Two admissions of one chat racing
   * on two callers may both lease: route each chat to one replica.
   * @returns the new record, or `null` when a record with this id exists (nothing changes).
   */
  admit(record: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null>;
  /**
   * Lease one record: `pending`, `failed` and due, `processing` with a lapsed
   * lease, or reclaimable under `reclaimOwn`. Issues a new fencing token;
   * `attempts` is unchanged (a claim is not a run: see `start`).
   * @returns the leased record, or `null` when it is not claimable.
   */
  claim(id: string, options: ClaimOptions): Promise<InboundRecord | null>;
  /**
   * Lease up to `limit` claimable records in arrival order (`receivedAt`,
   * then admission order), keeping each chat's order through a failover: a
   * record is taken only while no earlier active record of its chat is
   * `processing` under a lease held elsewhere (live, and not the caller's:
   * another owner's, or another incarnation's that `reclaimOwn` does not
   * cover). Such a record holds back every later record of its chat, due or
   * not, until it settles or its lease lapses; so due scans, concurrent
   * ones included, never hand records of one chat to two callers at once.
   * The caller's own live leases hold nothing back (its per-chat queue keeps
   * them in order), and neither does a `failed` record waiting for its retry
   * (within a replica, too, the next message of the chat is handled
   * meanwhile; once due, the retry is taken like any record, so it may run
   * beside a later message of its chat held elsewhere). O(due), plus the
   * active records of the chats it looks at.
   */
  claimDue(options: ClaimDueOptions): Promise<InboundRecord[]>;
  /** Extend a lease. @returns `false` when `token` is no longer the holder's. */
  heartbeat(id: string, token: number, leaseMs: number): Promise<boolean>;
  /**
   * Journal that run `attempt` of the record's handler begins under `token`:
   * `attempts` becomes `max(attempts, attempt)`, so a repeat (after a lost
   * reply) changes nothing. Only runs are counted: a record claimed and left
   * waiting behind its chat, or taken up before it is due, spends nothing.
   * @returns `false` when `token` is no longer the holder's (nothing changes).
   */
  start(id: string, token: number, attempt: number): Promise<boolean>;
  /**
   * `processing` → `scheduled`: a timer, due at its deadline `dueInMs` from
   * now (backend time), when a due scan takes it like any due record.
   * Attempts unchanged: arming a timer (again, when it was taken up before
   * its deadline) is not a run. A `scheduled` record holds back nothing of
   * its chat until it is due.
   * @throws {StaleLeaseError} when `token` is stale.
   * @throws {TypeError} naming `dueInMs` when it is not a finite number.
   */
  schedule(id: string, token: number, dueInMs: number): Promise<void>;
  /** `processing` → `done`. @throws {StaleLeaseError} when `token` is stale. */
  complete(id: string, token: number): Promise<void>;
  /**
   * `processing` → `failed` or `dead`.
   * @throws {StaleLeaseError} when `token` is stale.
   * @throws {TypeError} naming a bad outcome field; `ambiguous` is refused (no `unknown` inbound state).
   */
  fail(id: string, token: number, outcome: FailOutcome): Promise<void>;
  get(id: string): Promise<InboundRecord | null>;
  /** Records in receipt order. */
  list(options?: ListOptions<InboundState>): Promise<InboundRecord[]>;
  /**
   * Make a `done`, `failed` or `dead` record `pending` again (attempts reset);
   * a `processing` record is left alone.
   * @returns whether the record was made pending.
   */
  replay(id: string): Promise<boolean>;
  /** Delete `done` records last changed more than `olderThanMs` ago. @returns how many. */
  purge(olderThanMs: number): Promise<number>;
}

/** The lease options of {@link OutboxJournal.reserve}. */
export interface ReserveOptions extends ClaimOptions {
  /**
   * The caller will call the provider as soon as the reservation answers
   * (the send goes out at once): an entry leased by this reservation is
   * written with its call announced (`called: true`, as {@link OutboxJournal.markCalling}
   * would write it), so the call needs no journal write of its own. Lost
   * before its call, such an entry is ambiguous, as one lost after
   * `markCalling`. Optional for a backend: one that ignores it writes the
   * entry uncalled, and the engine announces the call with `markCalling`.
   */
  calling?: boolean;
}

/** What {@link OutboxJournal.reserve} did. */
export type ReserveResult =
  /** New entry, leased to the caller (`sending`): call the provider now. */
  | { status: "leased"; entry: OutboxEntry }
  /** New entry, `queued`: an earlier send of the chat is unsettled, or no lease was asked. */
  | { status: "queued"; entry: OutboxEntry }
  /** The key was already journaled; nothing changed. */
  | { status: "exists"; entry: OutboxEntry };

/** What {@link OutboxJournal.claimDue} found. */
export interface OutboxClaim {
  /** Entries leased to the caller (`sending`), to send now. */
  due: OutboxEntry[];
  /**
   * `sending` entries whose owner lost them (lease lapsed, or own previous
   * incarnation under `reclaimOwn`) after it had announced a provider call
   * (`called`). Each was moved to `unknown` by this call, exactly once across
   * all claimers, or — with `resendAmbiguous` — leased to the caller again and
   * returned here as well as in `due`. A lost `sending` entry whose call was
   * never announced is not ambiguous: it is leased to the caller again and
   * returned in `due` only, with `attempts` unchanged (its lost lease started
   * no call).
   */
  ambiguous: OutboxEntry[];
}

/** The outbound journal. */
export interface OutboxJournal extends DamagedRecords {
  /**
   * Journal a send under its idempotency key, before the provider is called.
   * With `lease`, the entry is leased to the caller at once unless an earlier
   * entry of the same chat is `queued`, `sending` or `failed`. With
   * `lease.calling`, an entry leased at once is also written with its
   * provider call announced (`called: true`), in the same write, as if
   * {@link markCalling} had followed under its lease; a queued entry is
   * written uncalled, as without it. A backend that ignores `calling`
   * (writes the entry uncalled) stays correct: the engine sees `called:
   * false` on the leased entry and announces the call with `markCalling`.
   */
  reserve(entry: NewOutboxEntry, lease?: ReserveOptions): Promise<ReserveResult>;
  /**
   * Lease up to `limit` due `queued`/`failed` entries that are first in their
   * chat (no earlier `queued`/`sending`/`failed` entry), and resolve abandoned
   * `sending` entries: those with `called` become ambiguous (see
   * {@link OutboxClaim.ambiguous}), those without are leased again as due
   * work (they count against `limit`). O(due).
   */
  claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim>;
  /** Extend a lease. @returns `false` when `token` is no longer the holder's (also for an `unknown` entry). */
  heartbeat(key: string, token: number, leaseMs: number): Promise<boolean>;
  /**
   * Journal that a provider call is about to start under `token` (`called`
   * becomes `true`), and extend the lease by `leaseMs` as `heartbeat` does.
   * The engine calls the provider only after this resolved `true`, so a lost
   * `sending` entry without it was certainly never sent. Idempotent: a repeat
   * under the same token (a retry after a lost reply) answers `true` again.
   * @returns `false` when `token` is no longer the holder's (nothing changes; also for an `unknown` entry).
   */
  markCalling(key: string, token: number, leaseMs: number): Promise<boolean>;
  /**
   * `sending` → `sent`, storing `messageId`. Accepted when the entry is
   * `sending` leased with `token`, or `unknown` with `fence` still `token`
   * (a late outcome: the call's lease was taken for lost, nobody claimed the
   * entry since). Any other entry (`queued`, `sent`, `failed`, `dead`, a newer
   * lease, `unknown` with another fence) is stale.
   * @throws {StaleLeaseError} when `token` is stale (nothing changes).
   */
  markSent(key: string, token: number, messageId: string): Promise<void>;
  /**
   * `sending` → `failed` (due again after `retryInMs`), `dead`, or with
   * `ambiguous: true` `unknown` (the provider call may have reached the
   * channel: the entry is made `unknown` exactly as `claimDue` makes a lapsed
   * `sending` entry unknown — lease dropped, `nextAttemptAt` null, `fence` and
   * `attempts` unchanged, `error` the given text — so it stops blocking its
   * chat, is listed as `unknown`, a later `markSent`/`markFailed` under the
   * same token still resolves it, and an operator `retry` requeues it).
   * Accepted under the same rule as {@link markSent}: `sending` leased with
   * `token`, or `unknown` with `fence` still `token` (a resolved `failed`
   * entry blocks its chat again, as any failed entry).
   * @throws {StaleLeaseError} when `token` is stale (nothing changes).
   * @throws {TypeError} naming a bad outcome field (`ambiguous` with `dead`, …).
   */
  markFailed(key: string, token: number, outcome: FailOutcome): Promise<void>;
  get(key: string): Promise<OutboxEntry | null>;
  /** Entries in reservation order. */
  list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]>;
  /**
   * Make a `dead`, `failed` or `unknown` entry `queued` and due now (attempts reset).
   * @returns whether it was requeued.
   */
  retry(key: string): Promise<boolean>;
  /** Forget an entry that is not `sending`. @returns whether it was deleted. */
  discard(key: string): Promise<boolean>;
  /** Delete `sent` entries last changed more than `olderThanMs` ago. @returns how many. */
  purge(olderThanMs: number): Promise<number>;
}

/** Every method of {@link InboxJournal}, by name (what a backend must provide). */
export const INBOX_JOURNAL_METHODS: readonly (keyof InboxJournal)[] = [
  "admit",
  "claim",
  "claimDue",
  "start",
  "heartbeat",
  "schedule",
  "complete",
  "fail",
  "get",
  "list",
  "replay",
  "purge",
  "damaged",
  "reportDamaged",
];

/** Every method of {@link OutboxJournal}, by name (what a backend must provide). */
export const OUTBOX_JOURNAL_METHODS: readonly (keyof OutboxJournal)[] = [
  "reserve",
  "claimDue",
  "heartbeat",
  "markCalling",
  "markSent",
  "markFailed",
  "get",
  "list",
  "retry",
  "discard",
  "purge",
  "damaged",
  "reportDamaged",
];

/**
 * Who can share one backend: `process` (memory, file), `host` (SQLite, shared
 * file), `shared` (Postgres, Redis: many hosts). A shared backend gets a
 * per-boot suffix on the default `instanceId`.
 */
export type BackendScope = "process" | "host" | "shared";

/**
 * What a backend's `open` found that an operator should know:
 * `journal-not-durable` when the server is configured so that a write it
 * confirmed can be lost (no persistence, fsync off, asynchronous commits);
 * `journal-torn-tail` when a file journal's log ended in a torn write (the
 * last append before a crash), cut off and set aside in a file beside it.
 */
export interface OpenWarning {
  code: "journal-not-durable" | "journal-torn-tail";
  message: string;
}

/** A durability backend: an inbox and an outbox journal. */
export interface DurabilityBackend {
  /** A short name used in errors (`'memory'`, `'postgres'`, …). */
  readonly name: string;
  readonly scope: BackendScope;
  readonly inbox: InboxJournal;
  readonly outbox: OutboxJournal;
  /**
   * Called by `bot.start()` before the first sweep.
   * @param warn receives what the backend found about its server that an operator should know (the bot
   *   emits each as a `warning` event), e.g. a database configured to lose committed writes
   */
  open?(warn?: (warning: OpenWarning) => void): Promise<void>;
  /** Called by `bot.stop()` after in-flight work finished. */
  close?(): Promise<void>;
}

/**
 * One token bucket of a {@link RateLimiter.take}: `count` sends per `perMs`,
 * at most `burst` of them at once after a quiet spell. Its state lives under
 * `key` (the limiter's, shared by every replica that uses the same limiter).
 */
export interface RateBucket {
  key: string;
  count: number;
  perMs: number;
  burst: number;
}

/** What {@link RateLimiter.take} answered: taken, or the bucket that holds the send back and for how long. */
export type RateTake = { ok: true } | { ok: false; waitMs: number; key: string };

/**
 * Where the outbox's rate limits keep their buckets: in this process
 * (`MemoryRateLimiter`, per replica) or on a server every replica shares
 * (`PostgresRateLimiter`, `RedisRateLimiter`: atomic, on the server's clock).
 * Every implementation passes the shared limiter conformance suite
 * (`runRateLimiterConformance` in `@botmesh/durable/testing`).
 */
export interface RateLimiter {
  /** A short name used in errors and docs (`'memory'`, `'postgres'`, `'redis'`). */
  readonly name: string;
  /** `process`: one replica's limits; `shared`: one set of limits for every replica on the same server. */
  readonly scope: "process" | "shared";
  /**
   * Take one send from every bucket at once, or from none: when one of them
   * is empty nothing is taken, and the answer names the bucket that holds the
   * send back longest and how long (at least until then, no take of these
   * buckets can succeed unless a bucket's rate changes).
   */
  take(buckets: readonly RateBucket[]): Promise<RateTake>;
  /** Admit nothing from `bucket` for `ms` (a channel said to wait: a 429 with `retry_after`). */
  pause(bucket: RateBucket, ms: number): Promise<void>;
}

/** A versioned value of a {@link DurableKv}. */
export interface KvEntry<T = JsonValue> {
  key: string;
  value: T;
  /** Opaque version; changes on every write and is never reused for the key, not even after a delete. */
  version: string;
}

/**
 * A small versioned key-value store. Give one to `new KvDurability()` and get an
 * inbox and outbox with the full contract, built on compare-and-set alone.
 */
export interface DurableKv {
  readonly name: string;
  readonly scope: BackendScope;
  get(key: string): Promise<KvEntry | null>;
  /**
   * Write `value` if the current version is `expectVersion` (`null`: the key
   * must not exist; `undefined`: unconditional).
   * @returns the new version, or `null` when the condition failed.
   */
  set(key: string, value: JsonValue, expectVersion?: string | null): Promise<string | null>;
  /** Delete if the version matches (unconditional when `undefined`). @returns whether a key was deleted. */
  delete(key: string, expectVersion?: string): Promise<boolean>;
  /**
   * Keys with `prefix`, in ascending key order (byte-wise), starting after
   * `after` when given, at most `limit`.
   */
  list(prefix: string, options?: { after?: string; limit?: number }): Promise<KvEntry[]>;
  /** The store's clock (ms since epoch); a shared store uses its server's. */
  now(): Promise<number>;
}

/** A completion, failure or heartbeat carried a fencing token that is no longer current. */
export class StaleLeaseError extends Error {
  /** The record id or outbox key. */
  readonly id: string;
  /** The token the caller held. */
  readonly token: number;
  constructor(kind: "inbox" | "outbox" | "event", id: string, token: number) {
    super(`Stale lease on ${kind} record "${id}": fencing token ${token} is no longer current`);
    this.name = "StaleLeaseError";
    this.id = id;
    this.token = token;
  }
}

/** A record that a backend set aside as damaged (see {@link DamagedRecord}): `get` rejects with it. */
export class DamagedRecordError extends Error {
  /** The journal it is in. */
  readonly journal: "inbox" | "outbox";
  /** The record's id (inbox) or key (outbox). */
  readonly id: string;
  /** The backend's name. */
  readonly backend: string;
  /** What is wrong, naming the field. */
  readonly problem: string;
  constructor(record: { journal: "inbox" | "outbox"; id: string; backend: string; problem: string }) {
    const what = record.journal === "inbox" ? "Inbox record" : "Outbox entry";
    super(`${what} "${record.id}" in backend "${record.backend}" is damaged and set aside: ${record.problem}`);
    this.name = "DamagedRecordError";
    this.journal = record.journal;
    this.id = record.id;
    this.backend = record.backend;
    this.problem = record.problem;
  }
}

/**
 * A backend's storage is damaged (a corrupt database file): nothing it answers can be trusted. A backend
 * throws it from `open()` and from every operation once it has met the damage. A bot that meets it
 * reports it once (an `error` event), admits no message from then on (each is answered `rejected`, so
 * that the channel delivers it again), records no outcome (nothing is dead-lettered for it: the leases
 * lapse) and takes up no work, until the storage is repaired and the bot started again.
 */
export class DamagedStorageError extends Error {
  /** The backend's name. */
  readonly backend: string;
  /** Where the storage is: a file's path. */
  readonly location: string;
  /**
   * @param message what is damaged, where, and what to do about it
   * @param options the backend, the location, and the driver's error as `cause`
   */
  constructor(message: string, options: { backend: string; location: string; cause?: unknown }) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = "DamagedStorageError";
    this.backend = options.backend;
    this.location = options.location;
  }
}

/**
 * The {@link DamagedStorageError} that `error` is, or that is among its causes (a handler may wrap it).
 * @param error anything thrown
 * @returns the damage, or `undefined`
 */
export function damagedStorageOf(error: unknown): DamagedStorageError | undefined {
  let cause = error;
  for (let depth = 0; depth < 8 && cause instanceof Error; depth++) {
    if (cause instanceof DamagedStorageError) return cause;
    cause = cause.cause;
  }
  return undefined;
}
