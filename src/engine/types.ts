/**
 * The engine's public shapes: its counters, warnings and events, a send's result, an inbound job, what
 * it needs from the bot, and the operator surface `bot.durability`.
 *
 * @module
 */
import type { ClaimOptions, DamagedListOptions, DamagedRecord, DamagedStorageError, DurabilityBackend, InboundRecord, JsonValue, OutboxState } from "../contract.ts";
import type { Leases } from "./leases.ts";
import type { Clock } from "../clock.ts";
import type { ResolvedDurability } from "../config.ts";
import type { Emitter } from "../emitter.ts";
import { errorLogText, errorText } from "../errors.ts";
import type { DurabilityHistograms } from "../histogram.ts";
import type { InboundMessage, Provider } from "../provider.ts";

/** The counters of `bot.durability.metrics()`. */
export interface DurabilityMetrics {
  /** Inbound records journaled. */
  inboundJournaled: number;
  /** Redeliveries of known inbound ids, dropped. */
  inboundDuplicates: number;
  /** Inbound records processed again after a crash, a lapsed lease or an operator replay. */
  inboundReplayed: number;
  /** Inbound records moved to the inbound DLQ. */
  inboundDead: number;
  /** Sends journaled in the outbox. */
  outboxJournaled: number;
  /** Sends answered from the outbox (key already journaled with the same content). */
  outboxDeduped: number;
  /** Provider calls that retried a failed send. */
  outboxRetried: number;
  /** Sends journaled as queued for the worker instead of going out at once. */
  outboxDeferred: number;
  /** Sends moved to the outbound DLQ. */
  outboxDead: number;
  /** Sends whose outcome is unknown (a sender died mid-call, a call timed out), left `unknown` for an operator and reported. */
  outboxAmbiguous: number;
  /**
   * Ambiguous sends settled: by the channel, a delivery status that carried the send's key (`sent`
   * with its message id) or the provider's `confirm` (`sent`, or certainly not delivered: queued
   * again); or by an operator who saw it arrive (`markDelivered`).
   */
  outboxResolved: number;
  /** Sends that bypassed the outbox (too large or not encodable). */
  outboxBypassed: number;
  /** Completions rejected because another instance had taken the record. */
  staleLeases: number;
  /** Reused keys whose content differed from the journaled one. */
  outboxDiverged: number;
  /** Conversations rebuilt by replaying their handler over the recorded answers (after a restart or a failed step). */
  conversationsReplayed: number;
  /** Conversation replays that did not follow the recorded transcript (the handler was not deterministic). */
  conversationsDiverged: number;
  /** Damaged records the backend set aside, reported by this bot (each by one bot only). */
  damagedRecords: number;
  /** Sends that waited for the outbox's rate limiter, or that the channel paused with a 429 (no attempt spent). */
  outboxThrottled: number;
  /** A gauge: sends waiting for the outbox's rate limiter now. */
  outboxWaitingForLimit: number;
  /** Calls of a step's function (`ctx.step`) this process made, retries included. */
  stepsCalled: number;
  /** Steps answered from the journal (a rerun got the recorded result or failure back without a call). */
  stepsReplayed: number;
  /** Steps that failed for good (their error journaled; `durability:dead` of kind `step`). */
  stepsFailed: number;
}

/** Codes of `warning` events. */
export type WarningCode =
  | "outbox-diverged"
  | "outbox-bypassed"
  | "stale-lease"
  | "lease-lost"
  | "provider-receipt"
  | "handler-retry"
  | "default-instance-id"
  | "conversation-diverged"
  | "conversation-not-durable"
  | "send-without-context"
  | "journal-not-durable"
  | "journal-torn-tail";

/** The payload of a `warning` event. */
export interface DurabilityWarning {
  code: WarningCode;
  message: string;
  /** The outbox key, for outbound warnings. */
  key?: string;
  /** The inbound record id, for inbound warnings. */
  id?: string;
  /** The chat, for conversation warnings. */
  chatId?: string;
}

/** The events a bot emits. */
export interface BotEvents {
  [event: string]: unknown;
  /** Something failed that the bot could not hand back to a caller (a journal error, a handler crash). */
  error: Error;
  warning: DurabilityWarning;
  /** A record reached a DLQ: `id` is the inbound id or the outbox key (a step's: the key of its attempt). */
  "durability:dead": { kind: "inbound" | "outbound" | "step"; id: string; error: string };
  /**
   * A send's outcome is unknown (its sender died during the provider call, or the call timed out): held
   * for an operator. For a step (`ctx.step`), `step` is its name and `key` its attempt's outbox key.
   */
  "durability:ambiguous": { key: string; chatId: string; step?: string };
  /**
   * An ambiguous send (already reported by `durability:ambiguous`) was settled: `sent` by the channel
   * (a delivery status carrying its key, or the provider's `confirm`), by the late outcome of the call
   * itself (`via: "call"`: its lease looked lost during the call, after a stall or a clock step of the
   * journal, and the call then succeeded) or by an operator who checked the chat (`markDelivered`,
   * `via: "operator"`), or, when `confirm` said it never arrived, `failed` (sent again after its backoff)
   * or `dead` (its retries were spent). An idempotent step's cut-off attempt is settled by the step
   * running again (`via: "rerun"`).
   */
  "durability:resolved": {
    key: string;
    chatId: string;
    state: "sent" | "failed" | "dead";
    messageId?: string;
    via: "status" | "confirm" | "call" | "operator" | "rerun";
  };
}

/** What a send did. */
export interface SendResult {
  /** The idempotency key. */
  key: string;
  /** The entry's state after this call (`queued`/`failed`: the worker delivers it). */
  state: OutboxState;
  /** The provider's message id once sent. */
  messageId?: string;
  /** `true` when the key was already journaled and nothing new was sent. */
  deduped?: boolean;
  /** `true` when the content bypassed the outbox (sent once, without journal or retries). */
  bypassed?: boolean;
  /** The last error, for `failed` and `dead`. */
  error?: string;
}

/** Options of a send. */
export interface SendOptions {
  /** The idempotency key; see the README for the defaults. */
  idempotencyKey?: string;
}

/** An inbound message ready to be handled: journaled and leased, or unjournaled under `failOpen`. */
export interface InboundJob {
  message: InboundMessage;
  /** The leased record; `null` when processed without the journal. */
  record: InboundRecord | null;
  /** Sends made while handling it (their promises), awaited before it is done. */
  sends: Promise<SendResult>[];
  /** How many sends were made (for the `<id>:<n>` keys). */
  sendCount: number;
  /** A job of the bot itself (an ask's timeout) instead of a message for the handlers. */
  run?: (job: InboundJob) => Promise<void>;
  /** For a journaled timer (see `DurabilityEngine.scheduleTimer`): when it is due, and what it carries. */
  timer?: JournaledTimer;
  /**
   * Whether the record's `attempts` counts this run already (a leased admission counts the run its
   * process makes of it); otherwise the run is journaled (`inbox.start`) when it begins.
   */
  runCounted?: boolean;
}

/** A timer journaled as an inbox record of its chat, due at `at` (wall-clock ms). */
export interface JournaledTimer {
  at: number;
  /** What the timer's owner needs when it fires (JSON). */
  data: JsonValue;
}

/** What the engine needs from the bot. */
export interface EngineHost {
  provider: Provider;
  botId: string;
  events: Emitter<BotEvents>;
  /** Queue a job on its chat's queue. */
  dispatch(job: InboundJob): void;
  /** Resolves when the bot has no job queued or running. */
  whenLocalIdle(): Promise<void>;
  /** Count a promise as in-flight work until it settles. */
  track(work: Promise<unknown>): void;
  /** Time, timers and jitter. */
  clock: Clock;
}

/** The operator surface: `bot.durability`. */
export interface DurabilityControl {
  /** This replica's instanceId (known after `start()`). */
  readonly instanceId: string;
  readonly inbox: {
    list: DurabilityBackend["inbox"]["list"];
    get: DurabilityBackend["inbox"]["get"];
  };
  readonly outbox: {
    list: DurabilityBackend["outbox"]["list"];
    get: DurabilityBackend["outbox"]["get"];
    /** Forget an entry (not while it is being sent). */
    discard(key: string): Promise<boolean>;
  };
  /** Process an inbound record again (done, failed or dead). @returns whether it was requeued. */
  replayInbound(id: string): Promise<boolean>;
  /** Send an entry again (dead, failed or unknown). @returns whether it was requeued. */
  retrySend(key: string): Promise<boolean>;
  /**
   * Record an `unknown` send as delivered without sending it again: the operator checked the chat and
   * the message is there. The entry becomes `sent` under its own fencing token (as a late outcome of
   * its lost call would), so it fails when anyone retried or resolved it meanwhile; counted in
   * `outboxResolved` and told as `durability:resolved` with `via: "operator"`.
   * @param key the entry's idempotency key
   * @param messageId the provider's message id when the operator knows it (default `""`: not known)
   * @returns whether it was `unknown` and is `sent` now
   */
  markDelivered(key: string, messageId?: string): Promise<boolean>;
  /** A snapshot of the counters. */
  metrics(): DurabilityMetrics;
  /** A snapshot of the duration histograms (this process's, since `bot.start()`). */
  histograms(): DurabilityHistograms;
  /**
   * The records the backend set aside as damaged (kept, never deleted), inbox first, at most
   * `limit` (default 100) per journal.
   */
  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]>;
}

/** What one `bot.sweep()` did. */
export interface SweepSummary {
  /** Inbound records it took up (due retries, lapsed leases) and handled (the start's recovery included). */
  inbound: number;
  /** Outbox entries it took up (due retries, lapsed leases) and tried to deliver (sent, or failed again and due later). */
  outbound: number;
  /** Sends reported as `durability:ambiguous` meanwhile (their outcome is unknown). */
  ambiguous: number;
  /** Whether it purged records older than the retention. */
  purged: boolean;
  /** The budget ran out while each pass still found due work: call it again soon. */
  more: boolean;
  /** The journals still hold unfinished work (due now or later, e.g. a retry waiting for its backoff). */
  pending: boolean;
  /** How long it took, in ms. */
  ms: number;
}

/** @returns every counter of {@link DurabilityMetrics} at zero */
export function zeroMetrics(): DurabilityMetrics {
  return {
    inboundJournaled: 0,
    inboundDuplicates: 0,
    inboundReplayed: 0,
    inboundDead: 0,
    outboxJournaled: 0,
    outboxDeduped: 0,
    outboxRetried: 0,
    outboxDeferred: 0,
    outboxDead: 0,
    outboxAmbiguous: 0,
    outboxResolved: 0,
    outboxBypassed: 0,
    staleLeases: 0,
    outboxDiverged: 0,
    conversationsReplayed: 0,
    conversationsDiverged: 0,
    damagedRecords: 0,
    outboxThrottled: 0,
    outboxWaitingForLimit: 0,
    stepsCalled: 0,
    stepsReplayed: 0,
    stepsFailed: 0,
  };
}

/**
 * Emit `error`, or print it when nobody listens (an unheard error must not vanish).
 * @param events the bot's events
 * @param error what failed
 * @param context where, for the printed form
 */
export function emitError(events: Emitter<BotEvents>, error: unknown, context: string): void {
  const err = asError(error);
  if (events.listenerCount("error") === 0) console.error(errorLogText(`[@botmesh/durable] ${context}:`, err));
  else events.emit("error", err);
}

/** `error` as an Error (its text when it is not one). */
export function asError(error: unknown): Error {
  return error instanceof Error ? error : new Error(errorText(error));
}

/**
 * The records `backend` set aside as damaged, inbox first, at most `options.limit` (default 100) per journal.
 * @param backend the backend
 * @param options filter and limit, as for each journal's `damaged`
 * @returns the damaged records of both journals
 */
export async function listDamaged(backend: DurabilityBackend, options?: DamagedListOptions): Promise<DamagedRecord[]> {
  const found: DamagedRecord[] = [];
  for (const journal of [backend.inbox, backend.outbox]) found.push(...await journal.damaged(options));
  return found;
}

/** What every module of the engine gets from it: the journals, the settings, the bot, time, the counters, and its state. */
export interface EngineCore {
  backend: DurabilityBackend;
  config: ResolvedDurability;
  host: EngineHost;
  clock: Clock;
  /** The engine's counters (updated in place). */
  metrics: DurabilityMetrics;
  /** Whether a simulated process death stopped the engine. */
  halted(): boolean;
  /** Whether the engine is stopping (it takes no new work). */
  stopping(): boolean;
  /**
   * Report an error that has no caller; `true` when the caller must give up: a process death, or damaged
   * storage (see {@link EngineCore.damaged}).
   */
  report(error: unknown, context: string): boolean;
  /** The damage a backend reported (reported once): from then on nothing is admitted, run or recorded. */
  damaged(): DamagedStorageError | null;
  warn(warning: DurabilityWarning): void;
  /** Ask the sweeper to look for work `inMs` from now. */
  wake(inMs: number): void;
  /** The leases this incarnation holds. */
  leases: Leases;
  /** This engine start's incarnation. */
  incarnation: string;
  instanceId(): string;
  /** The lease options of a claim, admission or reservation of this incarnation. */
  claim(kind: "inbox" | "outbox"): ClaimOptions;
}
