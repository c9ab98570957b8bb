/**
 * The state rules of the contract as pure functions, shared by backends that
 * keep records as objects (memory, the generic kv, file). The state sets and
 * preconditions come from the state table (`machine.ts`), as do the state lists
 * of the SQL and Lua backends; the conformance suite keeps them equal.
 *
 * @module
 */
import type {
  ClaimOptions,
  DamagedListOptions,
  FailOutcome,
  InboundRecord,
  InboundState,
  JsonValue,
  Lease,
  ListOptions,
  NewInboundRecord,
  NewOutboxEntry,
  OutboxEntry,
  OutboxState,
  ReserveOptions,
} from "./contract.ts";
import { type DueBy, INBOX, INBOX_MACHINE, OUTBOX, statesWhere, theState } from "./machine.ts";
import { showValue } from "./show.ts";
import { checkWellFormed } from "./well_formed.ts";

/** Outbox states that hold back later sends of the same chat. */
export const BLOCKING_OUTBOX_STATES: readonly OutboxState[] = statesWhere(OUTBOX, "blocksChat");
/** Inbox states that are still to be worked on. */
export const ACTIVE_INBOX_STATES: readonly InboundState[] = statesWhere(INBOX, "active");
/** The state of a send whose call may have reached the channel (`ambiguousOutbox`): the one a late outcome still resolves. */
export const AMBIGUOUS_OUTBOX_STATE: OutboxState = theState(OUTBOX, "acceptsLateOutcome");

/**
 * The fencing token an admission or a reservation leases its new record under. A claim never issues it
 * ({@link claimToken}), so a record leased under it is still as its writer left it: a caller whose
 * write lost its reply finds its own lease there by the record's id, and a lease of its own under any
 * other token came from a claim.
 */
export const WRITER_TOKEN = 1;

/**
 * The fencing token a claim issues: above the record's fence, and above {@link WRITER_TOKEN} (a record
 * written pending or queued, fence 0, is first claimed under token 2).
 * @param fence the record's fence before the claim
 */
export function claimToken(fence: number): number {
  return Math.max(fence, WRITER_TOKEN) + 1;
}

/** A new lease for `options` with fencing token `token`, at backend time `now`. */
export function newLease(options: ClaimOptions, token: number, now: number): Lease {
  return { owner: options.owner, incarnation: options.incarnation, token, expiresAt: now + options.leaseMs };
}

/**
 * Whether `lease` was lost by its holder: lapsed (whoever asks, the holder's
 * own incarnation too: a claim whose reply never reached it must not strand
 * the record), or live but reclaimable by the owner's next incarnation.
 */
export function isLeaseAbandoned(lease: Lease | null, now: number, options: ClaimOptions): boolean {
  if (!lease) return true;
  if (lease.expiresAt <= now) return true;
  if (lease.owner === options.owner && lease.incarnation === options.incarnation) return false;
  return options.reclaimOwn === true && lease.owner === options.owner;
}

/** Whether an inbox record (or an event record: same lifecycle) may be claimed now under `options`. */
export function isInboxClaimable(
  record: { state: InboundState; nextAttemptAt: number | null; lease: Lease | null },
  now: number,
  options: ClaimOptions,
): boolean {
  switch (INBOX[record.state]?.due) {
    case "always":
      return true;
    case "nextAttemptAt":
      return (record.nextAttemptAt ?? 0) <= now;
    case "leaseExpiry":
      return isLeaseAbandoned(record.lease, now, options);
    default:
      return false;
  }
}

/**
 * Whether an active inbox record (or event record) holds back the later records of its chat from a
 * due scan under `options`: `processing` under a live lease the caller cannot take and does not hold
 * itself. See `InboxJournal.claimDue`.
 */
export function holdsChat(
  record: { state: InboundState; lease: Lease | null },
  now: number,
  options: ClaimOptions,
): boolean {
  if (INBOX[record.state]?.leased !== true || record.lease === null) return false;
  if (record.lease.owner === options.owner && record.lease.incarnation === options.incarnation) return false;
  return !isLeaseAbandoned(record.lease, now, options);
}

/**
 * Whether a record of a chat lets a new record of that chat be admitted leased under `options` (see
 * `InboxJournal.admit`): a settled record, the caller's own live lease, and a `failed` record whose
 * retry is not due yet do; a pending record, a due retry, and a lease held elsewhere or lapsed do not.
 */
export function admitsLeased(
  record: { state: InboundState; nextAttemptAt: number | null; lease: Lease | null },
  now: number,
  options: ClaimOptions,
): boolean {
  switch (INBOX[record.state]?.due ?? "never") {
    case "nextAttemptAt":
      return (record.nextAttemptAt ?? 0) > now;
    case "leaseExpiry":
      return record.lease !== null && record.lease.expiresAt > now &&
        record.lease.owner === options.owner && record.lease.incarnation === options.incarnation;
    case "always":
      return false;
    default:
      return true;
  }
}

/** When an active inbox record next becomes claimable by a due scan (`null`: never by time). */
export function inboxDueAt(record: InboundRecord): number | null {
  return dueAt(INBOX[record.state]?.due, record);
}

function dueAt(due: DueBy | undefined, record: { nextAttemptAt: number | null; lease: Lease | null }): number | null {
  switch (due) {
    case "always":
      return 0; // always due, whatever the admitting replica's clock said
    case "nextAttemptAt":
      return record.nextAttemptAt ?? 0;
    case "leaseExpiry":
      return record.lease ? record.lease.expiresAt : 0;
    default:
      return null;
  }
}

/** When an outbox entry next needs the worker (`null`: settled, or held by a live lease forever). */
export function outboxDueAt(entry: OutboxEntry): number | null {
  return dueAt(OUTBOX[entry.state]?.due, entry);
}

/**
 * A fresh inbox record, leased when `lease` is given. A leased record counts its first run (attempts 1):
 * the caller runs it in its per-chat queue without another write.
 */
export function newInboundRecord(
  input: NewInboundRecord,
  now: number,
  lease?: ClaimOptions,
): InboundRecord {
  return {
    id: input.id,
    kind: input.kind,
    chatId: input.chatId,
    provider: input.provider,
    payload: input.payload,
    receivedAt: input.receivedAt,
    state: lease ? "processing" : "pending",
    attempts: lease ? 1 : 0,
    nextAttemptAt: null,
    lease: lease ? newLease(lease, 1, now) : null,
    fence: lease ? WRITER_TOKEN : 0,
    error: null,
    updatedAt: now,
  };
}

/** The lifecycle fields an inbox record and an event record share (the rules below work on both). */
export interface LeasedLifecycle {
  state: InboundState;
  attempts: number;
  nextAttemptAt: number | null;
  lease: Lease | null;
  fence: number;
  error: string | null;
  updatedAt: number;
}

/** `record` claimed under `options`: a copy with a new lease and token, attempts unchanged (a claim is not a run). */
export function claimedInbound<R extends LeasedLifecycle>(record: R, now: number, options: ClaimOptions): R {
  const token = claimToken(record.fence);
  return {
    ...record,
    state: "processing",
    nextAttemptAt: null,
    lease: newLease(options, token, now),
    fence: token,
    updatedAt: now,
  };
}

/**
 * `record` whose run `attempt` begins under its lease (`start`): attempts `max(attempts, attempt)`,
 * `updatedAt` kept (a run's start changes no state; lists and purges go by `updatedAt`).
 */
export function startedInbound<R extends LeasedLifecycle>(record: R, attempt: number, _now?: number): R {
  return record.attempts >= attempt ? record : { ...record, attempts: attempt };
}

/** The state of an armed timer: where `inbox.schedule` leads. */
export const TIMER_STATE: InboundState = theTarget(INBOX_MACHINE.transitions.schedule.to.ok);

/**
 * How versions before the `scheduled` state journaled an armed timer: a `failed` record whose error
 * starts with this. The schema migrations turn such records into `scheduled` ones.
 */
export const LEGACY_TIMER_ERROR = "Not a failure: a timer";

function theTarget(to: InboundState | "deleted"): InboundState {
  if (to === "deleted") throw new Error("inbox.schedule deletes nothing");
  return to;
}

/**
 * `record` armed as a timer (`inbox.schedule`): `scheduled`, due `dueInMs`
 * from `now` (never before `now`), lease dropped, no error; attempts unchanged.
 */
export function scheduledInbound<R extends LeasedLifecycle>(record: R, dueInMs: number, now: number): R {
  return { ...record, state: TIMER_STATE, nextAttemptAt: now + Math.max(0, dueInMs), lease: null, error: null, updatedAt: now };
}

/**
 * A fresh outbox entry with sequence `seq`: leased when `lease` is given and the chat is clear (the
 * caller passes `undefined` otherwise); a leased entry is written with its call announced (`called`,
 * as {@link callingOutbox} would make it) when `lease.calling` is `true`.
 */
export function newOutboxEntry(
  input: NewOutboxEntry,
  seq: number,
  now: number,
  lease: ReserveOptions | undefined,
): OutboxEntry {
  return {
    key: input.key,
    chatId: input.chatId,
    content: input.content,
    contentHash: input.contentHash,
    inboundId: input.inboundId,
    state: lease ? "sending" : "queued",
    attempts: lease ? 1 : 0,
    nextAttemptAt: lease ? null : now,
    lease: lease ? newLease(lease, 1, now) : null,
    fence: lease ? WRITER_TOKEN : 0,
    called: lease?.calling === true,
    messageId: null,
    error: null,
    seq,
    createdAt: now,
    updatedAt: now,
  };
}

/** `entry` leased for a provider call under `options`. */
export function claimedOutbox(entry: OutboxEntry, now: number, options: ClaimOptions): OutboxEntry {
  const token = claimToken(entry.fence);
  // A lost lease that never announced its call started no attempt: the new lease takes its number.
  // One that did (re-leased by resendAmbiguous) keeps `called`: that call may still reach the channel,
  // so the new lease lost before its own call is ambiguous again, not silently sent a third time.
  const uncalled = entry.state === "sending" && !entry.called;
  const stillCalled = entry.state === "sending" && entry.called;
  return {
    ...entry,
    state: "sending",
    attempts: uncalled ? entry.attempts : entry.attempts + 1,
    nextAttemptAt: null,
    lease: newLease(options, token, now),
    fence: token,
    called: stillCalled,
    updatedAt: now,
  };
}

/** `entry` with a provider call announced under its lease (`markCalling`), the lease extended by `leaseMs`. */
export function callingOutbox(entry: OutboxEntry, now: number, leaseMs: number): OutboxEntry {
  return { ...extendedLease(entry, now, leaseMs), called: true };
}

/** `entry` whose sender was lost: `unknown`, lease dropped. */
export function ambiguousOutbox(entry: OutboxEntry, now: number): OutboxEntry {
  return {
    ...entry,
    state: "unknown",
    lease: null,
    nextAttemptAt: null,
    error: entry.error ?? "the sender was lost during the provider call",
    updatedAt: now,
  };
}

/**
 * The state and timing fields of a `failed`/`dead` failure outcome at backend
 * time `now` (an inbox record, an event record, an outbox entry). An
 * `ambiguous` outcome has no such fields (see {@link failedOutbox}).
 */
export function failedFields(
  outcome: FailOutcome,
  now: number,
): { state: "failed" | "dead"; nextAttemptAt: number | null; error: string; lease: null; updatedAt: number } {
  if (outcome.ambiguous) throw new TypeError(`An ambiguous failure outcome has no failed/dead fields`);
  return outcome.dead
    ? { state: "dead", nextAttemptAt: null, error: outcome.error, lease: null, updatedAt: now }
    : {
      state: "failed",
      nextAttemptAt: now + Math.max(0, outcome.retryInMs),
      error: outcome.error,
      lease: null,
      updatedAt: now,
    };
}

/**
 * `entry` after `outbox.markFailed(outcome)` at backend time `now`: `failed`
 * or `dead` ({@link failedFields}), or for `{ error, ambiguous: true }`
 * `unknown` exactly as {@link ambiguousOutbox} makes a lost send (lease
 * dropped, `nextAttemptAt` null, fence and attempts unchanged), with `error`
 * the outcome's text. A `throttled` retry gives its attempt back (one less,
 * never below 0).
 */
export function failedOutbox(entry: OutboxEntry, outcome: FailOutcome, now: number): OutboxEntry {
  if (outcome.ambiguous) return { ...ambiguousOutbox(entry, now), error: outcome.error };
  const failed = { ...entry, ...failedFields(outcome, now) };
  if (outcome.throttled === true) failed.attempts = Math.max(0, entry.attempts - 1);
  return failed;
}

/** Whether a fenced operation with `token` may change `lease`'s record (not lapsed-and-retaken). */
export function holdsLease(lease: Lease | null, token: number): boolean {
  return lease !== null && lease.token === token;
}

/** `list` options with defaults applied: a state set (or null for all) and a limit. */
export function normalizeList<S extends string>(
  options: ListOptions<S> | undefined,
): { states: ReadonlySet<S> | null; chatId: string | undefined; limit: number } {
  checkListFilter(options, "list");
  const state = options?.state;
  const states = state === undefined ? null : new Set<S>(typeof state === "string" ? [state as S] : state);
  const limit = options?.limit ?? 100;
  if (!Number.isInteger(limit) || limit < 0) {
    throw new RangeError(`List option "limit" must be a non-negative integer, got ${JSON.stringify(limit)}`);
  }
  return { states, chatId: options?.chatId, limit };
}

/** Whether `item` passes a normalized list filter. */
export function matchesList<S extends string>(
  item: { state: S; chatId: string },
  filter: { states: ReadonlySet<S> | null; chatId: string | undefined },
): boolean {
  return (filter.states === null || filter.states.has(item.state)) &&
    (filter.chatId === undefined || item.chatId === filter.chatId);
}

/**
 * A deep copy of a JSON value (records, payloads, content). Several times
 * faster than `structuredClone` for the small objects journals hold.
 *
 * @param value a JSON value (no cycles, no class instances)
 * @returns the copy
 */
export function cloneJson<T>(value: T): T {
  if (typeof value !== "object" || value === null) return value;
  if (Array.isArray(value)) {
    const out = new Array(value.length);
    for (let i = 0; i < value.length; i++) out[i] = cloneJson(value[i]);
    return out as T;
  }
  const out: Record<string, unknown> = {};
  for (const key in value) {
    if (Object.prototype.hasOwnProperty.call(value, key)) setOwn(out, key, cloneJson((value as Record<string, unknown>)[key]));
  }
  return out as T;
}

/**
 * Sets `out[key] = item` as an own data property, also for the key
 * `__proto__` (an assignment would set the prototype instead: the key would be
 * lost, and its value would become the object's prototype).
 *
 * @param out a plain object
 * @param key the key
 * @param item the value
 */
export function setOwn(out: Record<string, unknown>, key: string, item: unknown): void {
  if (key === "__proto__") {
    Object.defineProperty(out, key, { value: item, writable: true, enumerable: true, configurable: true });
  } else {
    out[key] = item;
  }
}

/** Whether `record` is in its leased state (`processing`/`sending`) under fencing token `token`. */
export function isLeasedWith(
  record: { state: InboundState | OutboxState; lease: Lease | null },
  token: number,
): boolean {
  const traits = (INBOX as Record<string, { leased: boolean } | undefined>)[record.state] ??
    (OUTBOX as Record<string, { leased: boolean } | undefined>)[record.state];
  return traits?.leased === true && holdsLease(record.lease, token);
}

/**
 * Whether an outbox entry accepts the outcome (`markSent`, `markFailed`) of
 * the provider call made under fencing token `token`: it is `sending` leased
 * with `token`, or it is `unknown` and its `fence` is still `token` (its lease
 * was taken for lost, but nobody claimed it since: the late outcome of that
 * very call resolves it). An operator `retry` and any later claim issue a new
 * fence, so the old token stays stale after them.
 */
export function acceptsOutcome(
  entry: { state: OutboxState; lease: Lease | null; fence: number },
  token: number,
): boolean {
  const traits = OUTBOX[entry.state];
  if (traits?.acceptsLateOutcome) return entry.fence === token;
  return traits?.leased === true && holdsLease(entry.lease, token);
}

/** `record` with its lease extended by `leaseMs` from backend time `now`. */
export function extendedLease<R extends { lease: Lease | null }>(record: R, now: number, leaseMs: number): R {
  return { ...record, lease: { ...record.lease!, expiresAt: now + leaseMs } };
}

/** `record` completed: `done`, lease dropped. */
export function doneInbound<R extends LeasedLifecycle>(record: R, now: number): R {
  return { ...record, state: "done", lease: null, nextAttemptAt: null, updatedAt: now };
}

/** `entry` sent with the provider's `messageId`, lease dropped. */
export function sentOutbox(entry: OutboxEntry, messageId: string, now: number): OutboxEntry {
  return { ...entry, state: "sent", messageId, lease: null, nextAttemptAt: null, updatedAt: now };
}

/** `record` made `pending` again by an operator (attempts reset), or `null` when it is not done, failed or dead. */
export function replayedInbound<R extends LeasedLifecycle>(record: R, now: number): R | null {
  if (INBOX[record.state]?.retryable !== true) return null;
  return { ...record, state: "pending", attempts: 0, nextAttemptAt: null, lease: null, error: null, updatedAt: now };
}

/** `entry` queued again by an operator (due now, attempts reset), or `null` when it is not dead, failed or unknown. */
export function requeuedOutbox(entry: OutboxEntry, now: number): OutboxEntry | null {
  if (OUTBOX[entry.state]?.retryable !== true) return null;
  return { ...entry, state: "queued", nextAttemptAt: now, attempts: 0, lease: null, updatedAt: now };
}

// ---- input checks -----------------------------------------------------------


/**
 * A deep copy of `value` that is exactly what JSON keeps: strings, finite
 * numbers, booleans, null, arrays and plain objects (object keys whose value is
 * `undefined` are left out, as `JSON.stringify` does).
 *
 * @param value the value to copy
 * @param path the field name used in the error, e.g. `payload`
 * @param what whose field it is, e.g. `Inbox record "m1"`
 * @returns the copy
 * @throws {TypeError} naming the path of the first value JSON cannot hold unchanged (NaN, a BigInt, a Date, a cycle…)
 */
export function checkedJson(value: unknown, path: string, what: string): JsonValue {
  const ancestors: object[] = [];
  const walk = (v: unknown, at: string): JsonValue => {
    switch (typeof v) {
      case "string":
      case "boolean":
        return v;
      case "number":
        if (Number.isFinite(v)) return v;
        break;
      case "object": {
        if (v === null) return null;
        if (ancestors.includes(v)) throw new TypeError(`${what}: field "${at}" must be JSON, got a cycle`);
        const proto = Object.getPrototypeOf(v);
        if (Array.isArray(v)) {
          ancestors.push(v);
          const out = new Array<JsonValue>(v.length);
          for (let i = 0; i < v.length; i++) out[i] = walk(v[i], `${at}[${i}]`);
          ancestors.pop();
          return out;
        }
        if (proto !== Object.prototype && proto !== null) break;
        ancestors.push(v);
        const out: { [key: string]: JsonValue } = {};
        for (const key of Object.keys(v)) {
          const item = (v as Record<string, unknown>)[key];
          if (item !== undefined) setOwn(out, key, walk(item, `${at}.${key}`));
        }
        ancestors.pop();
        return out;
      }
    }
    throw new TypeError(`${what}: field "${at}" must be JSON, got ${showValue(v)}`);
  };
  return walk(value, path);
}

function requireString(value: unknown, field: string, what: string, allowEmpty = false): string {
  if (typeof value !== "string" || (!allowEmpty && value.length === 0)) {
    throw new TypeError(`${what}: field "${field}" must be a ${allowEmpty ? "" : "non-empty "}string, got ${showValue(value)}`);
  }
  return value;
}

/** {@link requireString} for an id, a chat id or a key: non-empty and well-formed Unicode. */
function requireId(value: unknown, field: string, what: string): string {
  return checkWellFormed(requireString(value, field, what), `${what}: field "${field}"`);
}

/**
 * Checks a record given to `admit` and returns a normalized copy (the payload
 * deep-copied), so that every backend stores the same thing and a bad field
 * fails before anything is written, with a message that names it.
 *
 * @param input what the caller passed to `admit`
 * @returns the checked copy
 * @throws {TypeError} naming the first bad field
 */
export function checkNewInbound(input: NewInboundRecord): NewInboundRecord {
  if (typeof input !== "object" || input === null) {
    throw new TypeError(`An inbox record must be an object, got ${showValue(input)}`);
  }
  const id = requireId(input.id, "id", "Inbox record");
  const what = `Inbox record ${JSON.stringify(id)}`;
  if (input.kind !== "message" && input.kind !== "interaction") {
    throw new TypeError(`${what}: field "kind" must be "message" or "interaction", got ${showValue(input.kind)}`);
  }
  if (typeof input.receivedAt !== "number" || !Number.isFinite(input.receivedAt)) {
    throw new TypeError(`${what}: field "receivedAt" must be a finite number, got ${showValue(input.receivedAt)}`);
  }
  return {
    id,
    kind: input.kind,
    chatId: requireId(input.chatId, "chatId", what),
    provider: requireString(input.provider, "provider", what, true),
    payload: checkedJson(input.payload === undefined ? null : input.payload, "payload", what),
    receivedAt: input.receivedAt,
  };
}

/**
 * Checks an entry given to `reserve` and returns a normalized copy (content
 * deep-copied, a missing `inboundId` as `null`).
 *
 * @param input what the caller passed to `reserve`
 * @returns the checked copy
 * @throws {TypeError} naming the first bad field
 */
export function checkNewOutbox(input: NewOutboxEntry): NewOutboxEntry {
  if (typeof input !== "object" || input === null) {
    throw new TypeError(`An outbox entry must be an object, got ${showValue(input)}`);
  }
  const key = requireId(input.key, "key", "Outbox entry");
  const what = `Outbox entry ${JSON.stringify(key)}`;
  const inboundId = input.inboundId ?? null;
  if (inboundId !== null) requireId(inboundId, "inboundId", what);
  return {
    key,
    chatId: requireId(input.chatId, "chatId", what),
    content: checkedJson(input.content === undefined ? null : input.content, "content", what),
    contentHash: requireString(input.contentHash, "contentHash", what, true),
    inboundId,
  };
}

// ---- argument checks ----------------------------------------------------------
// Every backend checks its arguments with these before it changes anything, so
// that a caller gets a TypeError naming the argument whatever the backend (a
// SQL driver would bind `undefined` as NULL or throw an unnamed error).

/**
 * @param value the argument
 * @param what how the error names it, e.g. `inbox.claim: "id"`
 * @returns `value`
 * @throws {TypeError} when `value` is not a string
 */
export function checkString(value: unknown, what: string): string {
  if (typeof value !== "string") throw new TypeError(`${what} must be a string, got ${showValue(value)}`);
  return value;
}

/**
 * {@link checkString} for an id, a chat id, a key or a lease owner: also
 * well-formed Unicode (SQLite, Postgres and Redis store a lone surrogate as
 * U+FFFD, so two such ids would be one there).
 *
 * @param value the argument
 * @param what how the error names it, e.g. `inbox.claim: "id"`
 * @returns `value`
 * @throws {TypeError} when `value` is not a string, or has a lone surrogate
 */
export function checkId(value: unknown, what: string): string {
  return checkWellFormed(checkString(value, what), what);
}

/**
 * @param value the argument
 * @param what how the error names it
 * @returns `value`
 * @throws {TypeError} when `value` is not a finite number
 */
export function checkFinite(value: unknown, what: string): number {
  if (typeof value !== "number" || !Number.isFinite(value)) {
    throw new TypeError(`${what} must be a finite number, got ${showValue(value)}`);
  }
  return value;
}

/**
 * @param value the `attempt` of a `start`
 * @param op the operation, for the error
 * @returns `value`
 * @throws {RangeError} when `value` is not a positive integer
 */
export function checkAttempt(value: unknown, op: string): number {
  if (typeof value !== "number" || !Number.isInteger(value) || value < 1) {
    throw new RangeError(`${op}: "attempt" must be a positive integer, got ${showValue(value)}`);
  }
  return value;
}

/**
 * Checks the lease options of `op` (an `admit`/`reserve` lease, a claim).
 *
 * @param options the lease options
 * @param op the operation, for the error
 * @throws {TypeError} naming the first bad option
 */
export function checkClaim(options: ClaimOptions, op: string): void {
  if (typeof options !== "object" || options === null) {
    throw new TypeError(`${op}: the lease options must be an object, got ${showValue(options)}`);
  }
  checkId(options.owner, `${op}: option "owner"`);
  checkId(options.incarnation, `${op}: option "incarnation"`);
  checkFinite(options.leaseMs, `${op}: option "leaseMs"`);
}

/**
 * Checks a failure outcome (`fail`, `markFailed`).
 *
 * @param outcome the outcome
 * @param op the operation, for the error
 * @param ambiguity whether `ambiguous: true` and `throttled: true` are allowed
 *   (`outbox.markFailed` only: inbound and event records have no `unknown`
 *   state, and no rate limit)
 * @throws {TypeError} naming the first bad field: `error` not a string; `dead`
 *   or `ambiguous` not a boolean; `ambiguous` where it is not allowed, or with
 *   `dead: true` or a `retryInMs`; `retryInMs` not finite for a retry
 */
export function checkOutcome(outcome: FailOutcome, op: string, ambiguity = false): void {
  if (typeof outcome !== "object" || outcome === null) {
    throw new TypeError(`${op}: the outcome must be an object, got ${showValue(outcome)}`);
  }
  checkString(outcome.error, `${op}: outcome "error"`);
  const { dead, ambiguous, throttled } = outcome as { dead?: unknown; ambiguous?: unknown; throttled?: unknown };
  if (dead !== undefined && typeof dead !== "boolean") {
    throw new TypeError(`${op}: outcome "dead" must be a boolean, got ${showValue(dead)}`);
  }
  if (throttled !== undefined && typeof throttled !== "boolean") {
    throw new TypeError(`${op}: outcome "throttled" must be a boolean, got ${showValue(throttled)}`);
  }
  if (throttled === true) {
    if (!ambiguity) throw new TypeError(`${op}: outcome "throttled" is only for outbox.markFailed`);
    if (dead === true) throw new TypeError(`${op}: outcome "throttled" and "dead" cannot both be true`);
    if (ambiguous === true) throw new TypeError(`${op}: outcome "throttled" and "ambiguous" cannot both be true`);
  }
  if (ambiguous !== undefined && typeof ambiguous !== "boolean") {
    throw new TypeError(`${op}: outcome "ambiguous" must be a boolean, got ${showValue(ambiguous)}`);
  }
  if (ambiguous === true) {
    if (!ambiguity) {
      throw new TypeError(`${op}: outcome "ambiguous" is only for outbox.markFailed (this record has no unknown state)`);
    }
    if (dead === true) throw new TypeError(`${op}: outcome "ambiguous" and "dead" cannot both be true`);
    const retryInMs = (outcome as { retryInMs?: unknown }).retryInMs;
    if (retryInMs !== undefined) {
      throw new TypeError(`${op}: outcome "ambiguous" takes no "retryInMs", got ${showValue(retryInMs)}`);
    }
    return;
  }
  if (!dead) checkFinite((outcome as { retryInMs?: unknown }).retryInMs, `${op}: outcome "retryInMs"`);
}

/**
 * Checks the filter values of a `list` (states, chat id).
 *
 * @param options the list options
 * @param op the operation, for the error
 * @throws {TypeError} naming the first bad option
 */
export function checkListFilter(options: ListOptions<string> | undefined, op: string): void {
  if (options === undefined || options === null) return;
  if (options.chatId !== undefined) checkId(options.chatId, `${op}: option "chatId"`);
  const state = options.state;
  if (state === undefined) return;
  for (const item of typeof state === "string" ? [state] : Array.isArray(state) ? state : [state]) {
    checkString(item, `${op}: option "state"`);
  }
}


/**
 * The checked options of a journal's `damaged`: `unreported` (default `false`) and `limit` (default 100).
 * @param options what the caller passed
 * @param op how errors name the call, e.g. `inbox.damaged`
 * @returns the options with their defaults
 * @throws {TypeError} when `options` is not an object or `unreported` not a boolean
 * @throws {RangeError} when `limit` is not a non-negative integer
 */
export function checkDamagedList(options: DamagedListOptions | undefined, op: string): { unreported: boolean; limit: number } {
  if (options === undefined) return { unreported: false, limit: 100 };
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`${op}: options must be an object, got ${showValue(options)}`);
  }
  const { unreported = false, limit = 100 } = options;
  if (typeof unreported !== "boolean") throw new TypeError(`${op}: option "unreported" must be a boolean, got ${showValue(unreported)}`);
  if (!Number.isInteger(limit) || limit < 0) {
    throw new RangeError(`${op}: option "limit" must be a non-negative integer, got ${showValue(limit)}`);
  }
  return { unreported, limit };
}
