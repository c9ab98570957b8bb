/**
 * `@botmesh/durable/backend`: what a backend author needs. The contract
 * (`DurabilityBackend`, its inbox and outbox journals, `DurableKv`), the
 * journal rules as pure functions (state changes, due times, leases, chat
 * order) and the input checks every backend applies, so a new backend states
 * the same rules instead of re-deriving them. Run `runBackendContract` and
 * `runBotConformance` of `@botmesh/durable/testing` against it.
 *
 * @example
 * ```ts
 * import { type ClaimOptions, isLeaseAbandoned, newLease } from "@botmesh/durable/backend";
 *
 * const claim: ClaimOptions = { owner: "host/bot/1", incarnation: "a1", leaseMs: 30_000 };
 * const lease = newLease(claim, 1, Date.now());
 * isLeaseAbandoned(lease, Date.now(), claim); // false: the lease is live
 * ```
 *
 * @module
 */
export {
  type BackendScope,
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  type OpenWarning,
  DamagedRecordError,
  DamagedStorageError,
  damagedStorageOf,
  type DamagedRecords,
  type DurabilityBackend,
  type DurableKv,
  type FailOutcome,
  type InboundKind,
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type JsonValue,
  type KvEntry,
  type Lease,
  type ListOptions,
  type NewInboundRecord,
  type NewOutboxEntry,
  type OutboxClaim,
  type OutboxEntry,
  type OutboxJournal,
  type OutboxState,
  type RateBucket,
  type RateLimiter,
  type RateTake,
  type ReserveOptions,
  type ReserveResult,
  SCAN_ANSWER_KEEP_MS,
  StaleLeaseError,
} from "./src/contract.ts";
export { ScanAnswers } from "./src/scan_answers.ts";
export { gcraParams, gcraPause, gcraStep } from "./src/rate_limit.ts";
export {
  acceptsOutcome,
  ACTIVE_INBOX_STATES,
  admitsLeased,
  ambiguousOutbox,
  BLOCKING_OUTBOX_STATES,
  callingOutbox,
  checkAttempt,
  checkClaim,
  checkDamagedList,
  checkedJson,
  checkFinite,
  checkId,
  checkListFilter,
  checkNewInbound,
  checkNewOutbox,
  checkOutcome,
  checkString,
  claimedInbound,
  claimedOutbox,
  cloneJson,
  doneInbound,
  extendedLease,
  failedFields,
  failedOutbox,
  holdsChat,
  holdsLease,
  inboxDueAt,
  isInboxClaimable,
  isLeaseAbandoned,
  isLeasedWith,
  type LeasedLifecycle,
  matchesList,
  newInboundRecord,
  newLease,
  newOutboxEntry,
  normalizeList,
  outboxDueAt,
  replayedInbound,
  requeuedOutbox,
  sentOutbox,
  startedInbound,
} from "./src/rules.ts";
export { describeJsonKind, storedInboundProblem, storedOutboxProblem } from "./src/stored_records.ts";
export { type SessionStore, sessionEntry } from "./src/store.ts";
