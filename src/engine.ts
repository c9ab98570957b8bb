/**
 * The durability engine: journals inbound messages before dispatch, leases
 * and heartbeats what is being worked on, journals every send before the
 * provider call, retries with backoff, dead-letters, reports ambiguous sends,
 * and sweeps for due and abandoned work. The `Bot` drives it.
 *
 * @module
 */
import {
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  type DurabilityBackend,
  type InboundRecord,
  type JsonValue,
  DamagedRecordError,
  StaleLeaseError,
} from "./contract.ts";
import { retryDelay } from "./backoff.ts";
import { BoundedSet } from "./bounded_map.ts";
import { Deadlines } from "./deadlines.ts";
import type { ResolvedDurability } from "./config.ts";
import { decodeContent, encodeContent } from "./content.ts";
import type { Emitter } from "./emitter.ts";
import { errorDetail, errorText, isProcessDeath } from "./errors.ts";
import { TIMER_STATE } from "./rules.ts";
import {
  type AdmitResult,
  type InboundMessage,
  type OutboundContent,
  type Provider,
} from "./provider.ts";
import { type Clock, every, type Repeating, sleep } from "./clock.ts";
import { hostname, randomId } from "./runtime/mod.ts";
import type { DurabilityHistograms } from "./histogram.ts";
import { Observer, TRACE_FIELD, withoutTrace } from "./observe.ts";
import { MemoryRateLimiter, resolveRateLimits } from "./rate_limit.ts";
import { Throttle } from "./throttle.ts";
import {
  type BotEvents,
  type DurabilityControl,
  type DurabilityMetrics,
  type DurabilityWarning,
  asError,
  emitError,
  type EngineHost,
  type InboundJob,
  type JournaledTimer,
  type SendOptions,
  type SendResult,
  type SweepSummary,
  zeroMetrics,
} from "./engine/types.ts";
import { runOf, TIMER_FIELD, timerOf } from "./engine/jobs.ts";
import { Wakeups } from "./engine/wakeups.ts";
import { type HeldLease, Leases } from "./engine/leases.ts";
import { Ambiguity } from "./engine/ambiguity.ts";
import { Outcomes } from "./engine/outcomes.ts";
import { operatorControl } from "./engine/control.ts";
import { Settling, type SweepCounts } from "./engine/settling.ts";
import { Outbound } from "./engine/outbound.ts";

export type {
  BotEvents,
  DurabilityControl,
  DurabilityMetrics,
  DurabilityWarning,
  EngineHost,
  InboundJob,
  JournaledTimer,
  SendOptions,
  SendResult,
  SweepSummary,
  WarningCode,
} from "./engine/types.ts";
export { emitError, listDamaged, zeroMetrics } from "./engine/types.ts";
export { attemptsOf } from "./engine/jobs.ts";

/** One admission's place in its chat: `late` while a write answered after its timeout may still land. */
interface AdmissionSlot {
  late: Promise<void> | null;
}


const SWEEP_BATCH = 64;

/** Damaged records reported per journal per sweep tick (the rest at the next ticks). */
const DAMAGED_REPORT_BATCH = 100;

/**
 * Records one lost-reply adoption lists per state (it runs only after a claim or reservation failed).
 * A backend's list has no time order filter: past this many `unknown` entries waiting for an operator,
 * a send a lost scan made unknown may go unreported.
 */
const ADOPT_LIST_LIMIT = 10_000;
/** Attempts of the recovery sweep in `start()` before it rejects. */
const START_SWEEP_ATTEMPTS = 3;
/**
 * How far apart this process's clock and the backend's may be when looking for the sends a lost scan
 * made unknown (wide: a missed one would be silent, an extra one is only a second report).
 */
const LOST_SCAN_SLACK_MS = 60_000;
/** Records one inbox scan of the first sweep after a start (the one that reclaims) takes at most. */
const RECLAIM_BATCH = 1024;
/** Claims beyond the handler retries that a record may take without an outcome (crashes) before it is dead. */
const POISON_ALLOWANCE = 3;
const DEDUPE_CAPACITY = 10_000;
/** Under rate limits, deliveries the sweeps keep claimed ahead of the limiter (the rest wait in the journal, unleased). */
const AHEAD_OF_LIMIT = 256;


/** The durability engine behind a `Bot` with `durability` options. */
export class DurabilityEngine {
  readonly config: ResolvedDurability;
  readonly backend: DurabilityBackend;
  /** One per engine start: tells this process's leases from those of an earlier one with the same instanceId. */
  readonly incarnation: string = randomId();
  #instanceId = "";
  #host: EngineHost;
  #metrics: DurabilityMetrics = zeroMetrics();
  #observer: Observer;
  #dedupe = new BoundedSet<string>(DEDUPE_CAPACITY);
  /** The admission timeouts (one timer for all: a timer per admission cost more than a memory admit). */
  #deadlines: Deadlines;
  /** Admissions being journaled, by inbound id. */
  #admitting = new Map<string, Promise<AdmitResult>>();
  /** A claim or reservation failed without an answer: its records may be leased to this incarnation unknown to it. */
  #adoptPending = false;
  /** Claim scans whose results are not all held yet (their records are leased to us but look unheld). */
  #claimsInFlight = 0;
  /** The inbox claim scan under way (settled once what it claimed is on the chats' queues), or null. */
  #inboxScan: Promise<void> | null = null;
  /** Admissions answered `rejected` whose write may still land (a timeout) or be read back (an error), by id. */
  readonly #lateAdmissions = new Map<string, Promise<void>>();
  /**
   * The `receivedAt` of admissions answered `rejected` whose write may have been issued, by id: the channel's
   * redelivery is journaled with it, so that the journal keeps the chat's receipt order (a later message of
   * the chat admitted meanwhile comes after it there too, as in the chat's queue).
   */
  readonly #rejectedReceivedAt = new Map<string, number>();
  /** The lease each dispatched job runs under (a later claim of the record holds a new one). */
  #jobLeases = new WeakMap<InboundJob, HeldLease>();
  /**
   * Wall time at the start of the earliest outbox claim scan that failed without an answer since the
   * last adoption: it may have moved sends to `unknown` whose report was lost with its reply.
   */
  #lostScanSince: { from: number; to: number } | null = null;
  #sweeping: Promise<void> | null = null;
  #sweepAgain = false;
  #clock: Clock;
  #sweepTimer: Repeating | undefined;
  #reportingDamaged: Promise<void> | null = null;
  #lastReceivedAt = Number.NEGATIVE_INFINITY;
  #heartbeatTimer: Repeating | undefined;
  /** The sweeper's wake-ups (a retry's backoff, a timer's deadline). */
  readonly #wakeups: Wakeups;
  /** The leases this incarnation holds, and their renewal. */
  readonly #leases: Leases;
  /** The sends reported ambiguous, and how they settle. */
  readonly #ambiguity: Ambiguity;
  /** Outcome writes under leases. */
  readonly #outcomes: Outcomes;
  /** idle() and sweepFor(): when the journals hold no work under way. */
  readonly #settling: Settling;
  /** Sends: reserve, announce, call, record. */
  readonly #outbound: Outbound;
  #lastPurge = -Infinity;
  /** What the sweeps of this process took up, and the part of it `sweepFor()` already reported. */
  #swept: SweepCounts = { inbound: 0, outbound: 0, ambiguous: 0, purges: 0 };
  #started = false;
  #ready = false;
  #stopping = false;
  #halted = false;
  #abort = new AbortController();
  /** The outbox's rate limits (`null`: none). */
  #throttle: Throttle | null = null;
  /** Deliveries the sweeps dispatched that have not finished (under rate limits they are capped). */
  #sweptInFlight = 0;

  constructor(config: ResolvedDurability, host: EngineHost) {
    this.config = config;
    this.backend = config.backend;
    this.#host = host;
    this.#clock = host.clock;
    this.#deadlines = new Deadlines(host.clock);
    this.#observer = new Observer(host.clock, config.tracer);
    const provider = host.provider;
    const limits = resolveRateLimits(provider.rateLimits, config.outbox.rateLimit, provider.name);
    if (limits.global !== undefined || limits.perChat !== undefined) {
      limits.limiter ??= new MemoryRateLimiter({ clock: host.clock });
      const prefix = `${host.botId}/${provider.connectionId ?? provider.name}`;
      this.#throttle = new Throttle(limits, host.clock, prefix, (error) => void this.#report(error, "outbox rate limiter"));
    }
    this.#leases = new Leases({
      backend: this.backend,
      clock: host.clock,
      leaseMs: { inbox: config.inbox.leaseMs, outbox: config.outbox.leaseMs },
      halted: () => this.#halted,
      warn: (warning) => this.#warn(warning),
      report: (error, context) => void this.#report(error, context),
    });
    this.#outcomes = new Outcomes({
      backend: this.backend,
      clock: host.clock,
      leases: this.#leases,
      leaseMs: { inbox: config.inbox.leaseMs, outbox: config.outbox.leaseMs },
      halted: () => this.#halted,
      stopping: () => this.#stopping,
      halt: () => this.#halt(),
      report: (error, context) => this.#report(error, context),
      stale: (kind, id, error) => this.#stale(kind, id, error),
    });
    this.#ambiguity = new Ambiguity({
      backend: this.backend,
      config,
      host,
      clock: host.clock,
      metrics: this.#metrics,
      signal: this.#abort.signal,
      halted: () => this.#halted,
      report: (error, context) => void this.#report(error, context),
      wake: (inMs) => this.#wake(inMs),
      countAmbiguous: () => void this.#swept.ambiguous++,
    });
    this.#outbound = new Outbound({
      backend: this.backend,
      config,
      host,
      clock: host.clock,
      metrics: this.#metrics,
      leases: this.#leases,
      outcomes: this.#outcomes,
      ambiguity: this.#ambiguity,
      observer: this.#observer,
      throttle: this.#throttle,
      signal: this.#abort.signal,
      incarnation: this.incarnation,
      instanceId: () => this.#instanceId,
      ready: () => this.#ready,
      halted: () => this.#halted,
      stopping: () => this.#stopping,
      halt: () => this.#halt(),
      report: (error, context) => this.#report(error, context),
      warn: (warning) => this.#warn(warning),
      wake: (inMs) => this.#wake(inMs),
      claim: () => this.#claim("outbox"),
      claimsInFlight: () => this.#claimsInFlight,
      claimScansHeld: () => this.#claimScansHeld(),
      adoptLater: () => void (this.#adoptPending = true),
    });
    this.#settling = new Settling({
      backend: this.backend,
      clock: host.clock,
      claimsInFlight: () => this.#claimsInFlight,
      swept: () => this.#swept,
      sweep: () => this.sweep(),
      whenLocalIdle: () => host.whenLocalIdle(),
      halted: () => this.#halted,
      stopping: () => this.#stopping,
      report: (error, context) => this.#report(error, context),
    });
    this.#wakeups = new Wakeups(host.clock, () => void this.sweep(), () => !this.#halted && !this.#stopping);

  }

  /** The resolved instanceId. */
  get instanceId(): string {
    return this.#instanceId;
  }

  /** Whether a simulated process death stopped this engine. */
  get halted(): boolean {
    return this.#halted;
  }

  /** Resolve the instanceId, open the backend, run the first (recovery) sweep and start the timers. */
  async start(): Promise<void> {
    if (this.#started) throw new Error("This bot was already started");
    this.#started = true;
    this.#instanceId = this.config.instanceId ?? await this.#defaultInstanceId();
    if (this.config.instanceId === undefined && this.backend.scope === "host") {
      // Every process of the host computes the same default; sharing it, they would take each other's leases.
      this.#warn({
        code: "default-instance-id",
        message: `The ${this.backend.name} backend can be shared by several processes of this host, and ` +
          `instanceId defaulted to "${this.#instanceId}", the same in each of them: ` +
          `give every process sharing it its own durability.instanceId`,
      });
    }
    this.#ready = true;
    this.#leases.startRounds();
    try {
      await this.backend.open?.((warning) => this.#warn({ code: warning.code, message: warning.message }));
      // A journal hiccup during recovery (an error, a lost reply) is retried a few times before start()
      // gives up: a recovery scan whose reply was lost may have made sends unknown that only the next
      // scan of this incarnation can still report.
      for (let attempt = 1;; attempt++) {
        try {
          await this.#sweepOnce(true);
          break;
        } catch (error) {
          if (isProcessDeath(error) || this.#halted || attempt >= START_SWEEP_ATTEMPTS) throw error;
          this.#report(error, `recovery sweep (attempt ${attempt} of ${START_SWEEP_ATTEMPTS})`);
          await sleep(this.#clock, 50 * 2 ** attempt);
        }
      }
    } catch (error) {
      if (isProcessDeath(error)) this.#halt();
      throw error;
    }
    if (this.config.sweepIntervalMs > 0) {
      this.#sweepTimer = every(this.#clock, this.config.sweepIntervalMs, () => {
        void this.sweep();
        void this.#reportDamaged();
      });
    }
    void this.#reportDamaged();
    this.#heartbeatTimer = every(this.#clock, this.#leases.heartbeatEveryMs, () => void this.#leases.heartbeat());
  }

  async #defaultInstanceId(): Promise<string> {
    const provider = this.#host.provider;
    const id = `${await hostname()}/${this.#host.botId}/${provider.connectionId ?? provider.name}`;
    return this.backend.scope === "shared" ? `${id}/${randomId().slice(0, 8)}` : id;
  }

  #claim(kind: "inbox" | "outbox"): ClaimOptions {
    return {
      owner: this.#instanceId,
      incarnation: this.incarnation,
      leaseMs: kind === "inbox" ? this.config.inbox.leaseMs : this.config.outbox.leaseMs,
    };
  }

  // ---- failure plumbing ----------------------------------------------------

  /** A simulated process death: stop everything at once, as `kill -9` would. */
  #halt(): void {
    if (this.#halted) return;
    this.#halted = true;
    this.#abort.abort(new Error("The process died"));
    this.#throttle?.close();
    this.#clearTimers();
    this.#leases.clear();
  }

  #clearTimers(): void {
    this.#sweepTimer?.stop();
    this.#heartbeatTimer?.stop();
    this.#wakeups.clear();
    this.#deadlines.close();
  }

  /** Report an error that has no caller; returns `true` when it was a process death (the caller must stop). */
  #report(error: unknown, context: string): boolean {
    if (isProcessDeath(error)) {
      this.#halt();
      return true;
    }
    if (this.#halted) return true;
    emitError(this.#host.events, error, context);
    return false;
  }

  /**
   * Report the records the backend set aside as damaged that no bot reported yet: each as one `error`
   * event (a {@link DamagedRecordError} naming it and the backend), counted in `damagedRecords`, by the
   * one bot whose `reportDamaged` marked it. Runs with the periodic sweep, never two at once.
   */
  #reportDamaged(): Promise<void> {
    if (this.#reportingDamaged !== null) return this.#reportingDamaged;
    const run = async () => {
      for (const journal of [this.backend.inbox, this.backend.outbox]) {
        const found = await journal.damaged({ unreported: true, limit: DAMAGED_REPORT_BATCH });
        for (const record of found) {
          if (this.#halted || !await journal.reportDamaged(record.id)) continue;
          this.#metrics.damagedRecords++;
          this.#report(new DamagedRecordError(record), `${record.journal} of backend "${record.backend}"`);
        }
      }
    };
    const work = run()
      .catch((error) => void this.#report(error, "report of damaged records"))
      .finally(() => {
        this.#reportingDamaged = null;
      });
    this.#reportingDamaged = work;
    this.#host.track(work);
    return work;
  }

  /**
   * Count a conversation event in `metrics()`.
   * @param metric which counter
   */
  count(metric: "conversationsReplayed" | "conversationsDiverged"): void {
    this.#metrics[metric]++;
  }

  #warn(warning: DurabilityWarning): void {
    this.#host.events.emit("warning", warning);
  }

  #stale(kind: "inbox" | "outbox", id: string, error: StaleLeaseError): void {
    this.#metrics.staleLeases++;
    this.#warn({
      code: "stale-lease",
      message: `${error.message}; another instance took it over and its result stands`,
      ...(kind === "inbox" ? { id } : { key: id }),
    });
  }

  #wake(inMs: number): void {
    // Without timers (sweepIntervalMs 0), due work waits in the journal for the next bot.sweep().
    if (this.config.sweepIntervalMs === 0) return;
    this.#wakeups.wake(inMs);
  }

  // ---- inbox -----------------------------------------------------------------

  /**
   * Admit an inbound message: dedupe, journal (leased to this instance), dispatch.
   * @param message the provider's message
   * @param dispatch where the admitted job goes (its place in the bot's per-chat queue): called once
   *   with the job, or with `null` when there is none; for an admission the journal confirms only after
   *   `admitTimeoutMs` (answered `rejected`), after that confirmation, so that the message keeps its
   *   place in its chat ahead of the messages that came after it
   * @returns what happened; `rejected` means "let the channel redeliver"
   */
  admit(message: InboundMessage, dispatch: (job: InboundJob | null) => void): Promise<AdmitResult> {
    const slot: AdmissionSlot = { late: null };
    const result = this.#observer.admit(message, (traceparent) => this.#admit(message, dispatch, traceparent, slot));
    const release = () => {
      if (slot.late === null) dispatch(null);
      else void slot.late.then(() => dispatch(null));
    };
    // The slot is settled (or handed to the late write) before the channel gets its answer.
    return result.then((answer) => {
      release();
      return answer;
    }, (error: unknown) => {
      release();
      throw error;
    });
  }

  /**
   * An admission answered `rejected` whose write was still on its way (`admitTimeoutMs`) or whose error
   * may hide a commit (read back): when it landed leased to this process, its job runs in the place its
   * message had in the chat's queue.
   */
  async #lateAdmission(
    message: InboundMessage,
    writing: Promise<InboundRecord | null>,
    dispatch: (job: InboundJob) => void,
    open: () => boolean,
  ): Promise<void> {
    const id = message.id;
    let record: InboundRecord | null;
    try {
      record = await writing;
    } catch {
      return; // not journaled: the channel delivers it again
    }
    if (record === null || record.state !== "processing" || this.#halted || this.#stopping || !open()) return;
    if ((this.#leases.get("inbox", id)?.token ?? 0) >= record.fence) return; // taken up meanwhile (a redelivery)
    this.#remember(id);
    this.#metrics.inboundJournaled++;
    const job: InboundJob = { message, record, sends: [], sendCount: 0, runCounted: record.attempts > 0 };
    this.#jobLeases.set(job, this.#leases.hold("inbox", id, record.fence));
    dispatch(job);
  }

  async #admit(
    message: InboundMessage,
    dispatch: (job: InboundJob) => void,
    traceparent: string | undefined,
    slot: AdmissionSlot,
  ): Promise<AdmitResult> {
    const id = message.id;
    // A redelivery of a message whose late admission is still on its way waits for it.
    const late = this.#lateAdmissions.get(id);
    if (late !== undefined) {
      await late;
      if (this.#dedupe.has(id)) {
        this.#metrics.inboundDuplicates++;
        return { status: "duplicate", id };
      }
    }
    if (this.#halted || this.#stopping) {
      return { status: "rejected", id, error: new Error("The bot is stopping; the message was not admitted") };
    }
    // A redelivery that arrives while the first delivery is still being journaled waits for it: it is a
    // duplicate only once that one is journaled. Were it answered "duplicate" at once, the channel would
    // take it as delivered, and a failure of the first write would lose the message.
    for (let first = this.#admitting.get(id); first !== undefined; first = this.#admitting.get(id)) {
      if ((await first).status !== "rejected") {
        this.#metrics.inboundDuplicates++;
        return { status: "duplicate", id };
      }
    }
    const admission = this.#admitOnce(message, dispatch, traceparent, slot);
    this.#admitting.set(id, admission);
    try {
      return await admission;
    } finally {
      if (this.#admitting.get(id) === admission) this.#admitting.delete(id);
    }
  }

  async #admitOnce(
    message: InboundMessage,
    dispatch: (job: InboundJob) => void,
    traceparent: string | undefined,
    slot: AdmissionSlot,
  ): Promise<AdmitResult> {
    const id = message.id;
    if (this.#halted || this.#stopping) {
      return { status: "rejected", id, error: new Error("The bot is stopping; the message was not admitted") };
    }
    if (this.#dedupe.has(id)) {
      this.#metrics.inboundDuplicates++;
      return { status: "duplicate", id };
    }
    this.#remember(id);
    let payload: JsonValue;
    try {
      payload = encodeContent(message, "message");
      if (traceparent !== undefined) payload = { ...payload as Record<string, JsonValue>, [TRACE_FIELD]: traceparent };
    } catch (error) {
      this.#dedupe.delete(id);
      const err = asError(error);
      this.#report(err, `admission of inbound message "${id}"`);
      return { status: "rejected", id, error: err };
    }
    let record: InboundRecord | null;
    const admittedAt = this.#clock.monotonic();
    const receivedAt = this.#rejectedReceivedAt.get(id) ?? this.#nextReceivedAt();
    this.#rejectedReceivedAt.delete(id);
    const writing = this.backend.inbox.admit({
      id,
      kind: message.type === "interaction" ? "interaction" : "message",
      chatId: message.chatId,
      provider: this.#host.provider.name,
      payload,
      receivedAt,
    }, this.#claim("inbox"));
    let timedOut = false;
    try {
      record = await this.#deadlines.within(writing, this.config.inbox.admitTimeoutMs, () => {
        timedOut = true;
        return new Error(
          `The journal did not confirm the admission of "${id}" within ${this.config.inbox.admitTimeoutMs} ms ` +
            `(durability.inbox.admitTimeoutMs); answered rejected so that the channel delivers it again`,
        );
      });
    } catch (error) {
      this.#dedupe.delete(id);
      const err = asError(error);
      if (this.#report(error, `journal of inbound message "${id}"`)) return { status: "rejected", id, error: err };
      if (this.config.failOpen) {
        dispatch({ message, record: null, sends: [], sendCount: 0 });
        return { status: "unjournaled", id, error: err };
      }
      // The write may still land (a timeout), or may have landed with its reply lost (an error after the
      // commit: read back), leased to this process: its message keeps its chat's place until that is known,
      // so that the chat's later messages never run before it. Bounded by a lease: past it, the record (if
      // it landed) is a sweep's to take, and the chat moves on.
      const landing = timedOut ? writing : this.#readBackAdmission(id);
      let open = true;
      const late = this.#lateAdmission(message, landing, dispatch, () => open);
      const tracked = this.#deadlines.within(late, this.config.inbox.leaseMs, () => new Error("late admission")).catch(() => {}).then(() => {
        open = false;
        if (this.#lateAdmissions.get(id) === tracked) this.#lateAdmissions.delete(id);
      });
      this.#lateAdmissions.set(id, tracked);
      slot.late = tracked;
      this.#rejectedReceivedAt.set(id, receivedAt);
      if (this.#rejectedReceivedAt.size > DEDUPE_CAPACITY) this.#rejectedReceivedAt.delete(this.#rejectedReceivedAt.keys().next().value!);
      return { status: "rejected", id, error: err };
    }
    if (record === null) record = await this.#ownLostAdmission(id);
    if (record === null) {
      this.#metrics.inboundDuplicates++;
      return { status: "duplicate", id };
    }
    this.#metrics.inboundJournaled++;
    if (record.state === "pending") {
      // Journaled behind a record of its chat that comes first (held by another replica, or due): a sweep
      // takes the chat in order once it is free. Look now, in case it already is.
      this.#wake(0);
      return { status: "admitted", id };
    }
    // Leased: nothing of its chat comes first in the journal but records leased to this very process.
    // A claim scan of this process whose answer is still on its way may hold earlier records of the
    // chat: let them reach the chat's queue first (they go ahead of this message there).
    const scan = this.#inboxScan;
    if (scan !== null) {
      // Bounded: a scan that hangs must not hold the channel's answer (the order is then at the scan's mercy).
      await this.#deadlines.within(scan, Math.min(2000, this.config.inbox.leaseMs / 4), () => new Error("slow claim scan")).catch(() => {});
    }
    // Taken up meanwhile (adopted, or re-claimed by a sweep after a clock step): that job handles it.
    if ((this.#leases.get("inbox", id)?.token ?? 0) >= record.fence) return { status: "admitted", id };
    const job: InboundJob = { message, record, sends: [], sendCount: 0, runCounted: record.attempts > 0 };
    this.#jobLeases.set(job, this.#leases.hold("inbox", id, record.fence, admittedAt));
    const slow = this.#inboxScan;
    if (slow !== null) {
      // The scan (or the adoption after its lost reply) is still on its way: the channel has its answer
      // now, and the job takes its place in the chat's queue once what the scan leased to this process is
      // queued ahead of it (bounded by a lease: the job is held, and heartbeated, meanwhile).
      slot.late = this.#deadlines.within(slow, this.config.inbox.leaseMs, () => new Error("slow claim scan")).catch(() => {})
        .then(() => dispatch(job));
      return { status: "admitted", id };
    }
    dispatch(job);
    return { status: "admitted", id };
  }

  /**
   * After an admission whose reply was an error: the record, if the write committed leased to this very
   * incarnation (its reply lost), else `null`. Read until the journal answers, within the caller's bound.
   */
  async #readBackAdmission(id: string): Promise<InboundRecord | null> {
    const until = this.#clock.monotonic() + this.config.inbox.leaseMs;
    for (let read = 0; !this.#halted && !this.#stopping && this.#clock.monotonic() < until; read++) {
      try {
        const record = await this.backend.inbox.get(id);
        const lease = record?.lease;
        if (!record || record.state !== "processing" || !lease || record.fence !== 1) return null;
        return lease.owner === this.#instanceId && lease.incarnation === this.incarnation ? record : null;
      } catch (error) {
        if (isProcessDeath(error)) return null;
        await sleep(this.#clock, Math.min(Math.max(5, Math.floor(this.config.inbox.leaseMs / 8)), 25 * 2 ** Math.min(read, 6)));
      }
    }
    return null;
  }

  /**
   * Journal a timer as an inbox record of `chatId` that becomes due at `at`
   * (wall-clock ms): admitted leased to this process, then `scheduled` at
   * the deadline (`inbox.schedule`), so that it holds back nothing of its chat, and any
   * process's sweep (a `bot.sweep()` of a cron trigger too) takes it up once
   * due. It comes back as a job with `timer` set. Idempotent: a timer whose id
   * is journaled already is left as it is. A crash between the two writes
   * leaves it leased; once its lease lapses a sweep takes it, finds it not due
   * and arms it again (as for a timer taken up early anywhere).
   * @param id the record id (unique in the inbox: derive it from the message the timer belongs to)
   * @param chatId the chat whose queue runs it
   * @param at when it is due
   * @param data what the timer's job needs when it fires
   * @throws the journal's error when the admission failed (the caller's step fails and is retried)
   */
  async scheduleTimer(id: string, chatId: string, at: number, data: JsonValue): Promise<void> {
    const record = await this.backend.inbox.admit({
      id,
      kind: "message",
      chatId,
      provider: this.#host.provider.name,
      payload: { id, chatId, type: "timeout", [TIMER_FIELD]: { at, data } },
      receivedAt: this.#nextReceivedAt(),
    }, this.#claim("inbox"));
    if (record === null) {
      // Journaled already (armed by an earlier run of the step), unless a message took its id.
      const existing = await this.backend.inbox.get(id).catch(() => null);
      if (existing !== null && timerOf(existing.payload) === undefined) {
        this.#report(
          new Error(`The timer "${id}" (an ask's timeout) was not journaled: an inbound message has that id; the ask times out only when its chat's next message arrives`),
          `timer "${id}"`,
        );
      }
      return;
    }
    // Pending behind its chat: a due scan takes it and arms it (see process()).
    if (record.state !== "processing") return;
    // Taken up already by this process as lost work (its admission's answer came late): that job arms
    // it, or fires it when due.
    if (this.#leases.has("inbox", id)) return;
    // Held while it is armed, so that nothing of this process takes it for lost work meanwhile.
    const lease = this.#leases.hold("inbox", id, record.fence);
    try {
      await this.#outcomes.record(lease, (token) => this.#armTimer(id, token, at), [TIMER_STATE]);
    } catch (error) {
      if (isProcessDeath(error)) throw error;
      // It is journaled: once its lease lapses, a sweep arms it.
    } finally {
      this.#leases.release("inbox", id, lease.token);
    }
  }

  /** Make a leased timer record `scheduled`, due at `at` (attempts unchanged: arming is not a run). */
  async #armTimer(id: string, token: number, at: number): Promise<void> {
    const dueInMs = Math.max(0, Math.ceil(at - this.#clock.now()));
    await this.backend.inbox.schedule(id, token, dueInMs);
    this.#wake(dueInMs);
  }

  /**
   * The record of `id` when an earlier admission by this very incarnation
   * landed but its reply was lost (a connection cut after the commit, or a
   * client that retried the write): it is leased to us and nobody works on it,
   * so it is ours to dispatch now rather than after its lease lapses.
   */
  async #ownLostAdmission(id: string): Promise<InboundRecord | null> {
    await this.#claimScansHeld();
    if (this.#leases.has("inbox", id)) return null;
    let existing: InboundRecord | null;
    try {
      existing = await this.backend.inbox.get(id);
    } catch {
      return null; // a duplicate all the same; the lease lapses and a sweep takes it
    }
    const lease = existing?.lease;
    if (!existing || existing.state !== "processing" || !lease) return null;
    if (lease.owner !== this.#instanceId || lease.incarnation !== this.incarnation) return null;
    if (this.#leases.has("inbox", id)) return null; // dispatched while we read
    if (this.#claimsInFlight > 0) {
      this.#adoptPending = true; // a scan may be about to take it; if not, the next sweep does
      return null;
    }
    if (this.#leases.knew("inbox", id, existing.fence)) return null; // handled here already
    return existing;
  }

  /**
   * The wall time of an admission, strictly after this process's previous one: messages of one chat
   * that arrive in the same millisecond keep their arrival order in every backend's due scan, whose
   * order is `receivedAt` (a backend without an admission counter breaks ties by id).
   */
  #nextReceivedAt(): number {
    const now = this.#clock.now();
    this.#lastReceivedAt = now > this.#lastReceivedAt ? now : this.#lastReceivedAt + 1;
    return this.#lastReceivedAt;
  }

  #remember(id: string): void {
    this.#dedupe.add(id);
  }

  /**
   * Run a job's handler under its lease, then record the outcome: done, a
   * retry with backoff, or dead.
   * @param job the job
   * @param handle runs the handler and awaits the sends it made
   */
  async process(job: InboundJob, handle: () => Promise<void>): Promise<void> {
    const record = job.record;
    if (this.#halted) return;
    const unreadable = job.message.unreadable;
    if (record === null) {
      if (unreadable !== undefined) {
        return void this.#report(new Error(`Unreadable inbound message "${job.message.id}": ${unreadable}`), "unjournaled message");
      }
      try {
        await this.#observer.handle(job.message, null, handle);
      } catch (error) {
        this.#report(error, `handler of unjournaled message "${job.message.id}"`);
      }
      return;
    }
    // The job's lease, whose token a sweep of this incarnation may hand on while the handler runs.
    const lease = this.#jobLeases.get(job) ?? this.#leases.get("inbox", record.id) ?? this.#leases.hold("inbox", record.id, record.fence);
    if (job.timer && job.timer.at > this.#clock.now()) {
      // Taken up before it is due (admitted behind its chat, a lease lost before it was armed, an
      // operator's replay, a clock of another process ahead of this one): armed again, not run.
      const at = job.timer.at;
      try {
        await this.#outcomes.record(lease, (token) => this.#armTimer(record.id, token, at), [TIMER_STATE]);
      } finally {
        this.#leases.release("inbox", record.id, lease.token);
      }
      return;
    }
    const retries = this.config.inbox.retries;
    // This run's number in the journal: an admission that ran it at once counted it; otherwise it is
    // journaled now. A timer's leased admission counted a run that was only its arming: its runs are one less.
    const journaled = job.runCounted === true ? Math.max(1, record.attempts) : record.attempts + 1;
    const attempts = runOf(journaled, job.timer !== undefined);
    let failure: unknown;
    let failed = false;
    let deadNow = false;
    /** The failure is the handler's own error: journaled with its causes and stack for an operator. */
    let handlerThrew = false;
    if (unreadable !== undefined) {
      // The provider could not parse it: journaled so that nothing a user sent vanishes, never handled.
      failed = deadNow = true;
      failure = new Error(`Unreadable ${record.provider} message: ${unreadable}`);
    } else if (attempts > retries + 1 + POISON_ALLOWANCE) {
      // Its handler began that many runs, none with an outcome: it takes the process down with it.
      failed = true;
      failure = new Error(`Processing was cut off (crash or lost lease) in ${attempts - 1} attempts`);
    } else if (job.runCounted !== true && !await this.#startRun(lease, record.id, journaled)) {
      // Not journaled as begun (the lease was lost, or the journal failed): not run here. Its lease lapses
      // and a sweep takes it up again.
      this.#leases.release("inbox", record.id, lease.token);
      return;
    } else {
      record.attempts = journaled;
      job.runCounted = true;
      try {
        await this.#observer.handle(job.message, record, handle);
      } catch (error) {
        if (isProcessDeath(error) || this.#halted) return void this.#halt();
        failed = true;
        failure = error;
        handlerThrew = true;
      }
    }
    if (this.#halted) return;
    const inbox = this.backend.inbox;
    try {
      if (!failed) {
        await this.#outcomes.record(lease, (token) => inbox.complete(record.id, token), ["done"]);
      } else if (deadNow || attempts > retries) {
        const text = errorText(failure);
        const dead = { error: handlerThrew ? errorDetail(failure) : text, dead: true } as const;
        if (!await this.#outcomes.record(lease, (token) => inbox.fail(record.id, token, dead), ["dead"])) {
          return;
        }
        this.#metrics.inboundDead++;
        this.#host.events.emit("durability:dead", { kind: "inbound", id: record.id, error: text });
        this.#report(failure, deadNow
          ? `inbound record "${record.id}" (dead-lettered unread; the record keeps what the channel sent)`
          : `handler of inbound record "${record.id}" (dead after ${attempts} attempts)`);
      } else {
        const retryInMs = retryDelay(attempts, this.config.inbox.backoff, undefined, () => this.#clock.random());
        const outcome = { error: handlerThrew ? errorDetail(failure) : errorText(failure), retryInMs };
        if (!await this.#outcomes.record(lease, (token) => inbox.fail(record.id, token, outcome), ["failed"])) return;
        this.#warn({
          code: "handler-retry",
          id: record.id,
          message: `The handler of inbound record "${record.id}" failed (attempt ${attempts} of ${
            retries + 1
          }); retrying in ${retryInMs} ms: ${errorText(failure)}`,
        });
        this.#wake(retryInMs);
      }
    } finally {
      this.#leases.release("inbox", record.id, lease.token);
    }
  }

  /**
   * Journal that run `attempt` of an inbox record's handler begins (`inbox.start`), retrying a journal
   * error while this process holds the lease (a repeat after a lost reply changes nothing).
   * @returns whether it is journaled; `false` when the lease was lost (or the bot stops while the journal fails)
   */
  async #startRun(lease: HeldLease, id: string, attempt: number): Promise<boolean> {
    for (let tries = 1;; tries++) {
      const token = lease.token;
      try {
        if (await this.backend.inbox.start(id, token, attempt)) return true;
        // A claim scan of this process may have re-leased it (its lease looked lapsed: a server clock step)
        // with the answer still on its way: that scan hands this job the new token.
        if (lease.token === token && this.#claimsInFlight > 0) await this.#claimScansHeld();
        // Re-leased to this very process meanwhile (a sweep handed the work a new token): again with it.
        if (lease.token !== token && !lease.lost && this.#leases.get("inbox", id) === lease) continue;
        return false;
      } catch (error) {
        if (this.#report(error, `journal of inbox record "${id}" (start of run ${attempt}, try ${tries})`)) return false;
        // Retried while the lease is held (heartbeats keep it): giving up would let the chat's next message
        // run first, and a start that committed with its reply lost would count a run never made.
        if (lease.lost || this.#leases.get("inbox", id) !== lease || (this.#stopping && tries >= 3)) return false;
        await sleep(this.#clock, Math.min(Math.max(5, Math.floor(this.config.inbox.leaseMs / 4)), 50 * 2 ** tries));
        if (this.#halted) return false;
      }
    }
  }
  // ---- outbox ----------------------------------------------------------------

  /**
   * Journal a send and, in `now` mode, deliver it at once (unless an earlier
   * send of the chat is pending).
   * @param chatId the chat
   * @param content what to send
   * @param key the idempotency key
   * @param inboundId the inbound record the send was made for
   * @param mode `now` sends now; `enqueue` leaves it to the worker
   * @returns what happened
   */
  send(chatId: string, content: OutboundContent, key: string, inboundId: string | null, mode: "now" | "enqueue"): Promise<SendResult> {
    return this.#outbound.send(chatId, content, key, inboundId, mode);
  }

  /**
   * Content the provider does not journal (an edit, a typing indicator): one provider call now,
   * no outbox entry, no retry; its error goes to the caller.
   */
  sendDirect(chatId: string, content: OutboundContent, key: string): Promise<SendResult> {
    return this.#outbound.sendDirect(chatId, content, key);
  }

  /**
   * A channel's word that the send with `key` reached it (a delivery status carrying the key): an
   * `unknown` entry becomes `sent`; one still on its way is remembered, so that if its outcome is
   * lost the ambiguity resolves at once. See `InboundSink.confirmSent`.
   */
  confirmSent(key: string, messageId: string): Promise<boolean> {
    return this.#ambiguity.confirmSent(key, messageId);
  }

  // ---- sweeps ----------------------------------------------------------------

  /** Look for due and abandoned work now. Concurrent calls share one sweep (and ask for one more). */
  sweep(): Promise<void> {
    if (this.#halted || !this.#started) return Promise.resolve();
    if (this.#sweeping) {
      this.#sweepAgain = true;
      return this.#sweeping;
    }
    const run = async () => {
      do {
        this.#sweepAgain = false;
        try {
          await this.#sweepOnce(false);
        } catch (error) {
          if (this.#report(error, "sweep")) return;
        }
      } while (this.#sweepAgain && !this.#halted && !this.#stopping);
    };
    this.#sweeping = run().finally(() => {
      this.#sweeping = null;
    });
    this.#host.track(this.#sweeping);
    return this.#sweeping;
  }

  async #sweepOnce(first: boolean): Promise<void> {
    if (this.#stopping && !first) return;
    if (this.#adoptPending) await this.#adoptOwnLost();
    // A restart takes back everything the previous incarnation held at once: its backlog can be large, and
    // each reclaiming scan reads the owner's records (those already taken back too), so fewer, larger batches.
    const batch = first ? RECLAIM_BATCH : SWEEP_BATCH;
    const inboxClaim = { ...this.#claim("inbox"), reclaimOwn: first, limit: batch };
    for (;;) {
      const claimedAt = this.#clock.monotonic();
      let records: InboundRecord[];
      this.#claimsInFlight++;
      let scanned!: () => void;
      const scan = this.#inboxScan = new Promise<void>((resolve) => scanned = resolve);
      const scanDone = () => {
        if (this.#inboxScan === scan) this.#inboxScan = null;
        scanned();
      };
      try {
        // A sweep must never take work this very process is doing: leases that may look lapsed are renewed first.
        records = await this.#leases.claimScan(() => this.backend.inbox.claimDue(inboxClaim));
      } catch (error) {
        this.#claimsInFlight--;
        try {
          // An admission meanwhile waits (bounded) for the adoption of what the scan may have leased to us.
          await this.#afterUnansweredClaim(error);
        } finally {
          scanDone();
        }
        throw error;
      }
      this.#claimsInFlight--; // the loop below holds them all before it yields
      for (const record of records) {
        const mine = this.#leases.get("inbox", record.id);
        if (mine !== undefined && !mine.lost && mine.settling !== "retry") {
          // Still being handled here: its lease only looked lapsed (a server clock step). Carry on under the new token.
          this.#leases.handOn(mine, record.fence, claimedAt, record.attempts);
          continue;
        }
        const lease = this.#leases.hold("inbox", record.id, record.fence, claimedAt);
        this.#swept.inbound++;
        if (record.attempts > 0 && record.error === null) this.#metrics.inboundReplayed++; // a run began, no outcome
        this.#dispatchRecord(record, lease);
      }
      scanDone();
      if (records.length < batch) break;
    }
    const outboxClaim = {
      ...this.#claim("outbox"),
      reclaimOwn: first,
      limit: SWEEP_BATCH,
      resendAmbiguous: this.config.outbox.onAmbiguous === "resend",
    };
    for (;;) {
      // Under rate limits, only what the limiter may admit soon is claimed: the rest waits unleased.
      if (this.#throttle !== null) outboxClaim.limit = Math.max(1, Math.min(SWEEP_BATCH, AHEAD_OF_LIMIT - this.#sweptInFlight));
      const claimedAt = this.#clock.monotonic();
      let claimed: Awaited<ReturnType<DurabilityBackend["outbox"]["claimDue"]>>;
      const scanStartedAt = this.#clock.now();
      this.#claimsInFlight++;
      try {
        claimed = await this.#leases.claimScan(() => this.backend.outbox.claimDue(outboxClaim));
      } catch (error) {
        this.#claimsInFlight--;
        const scanEndedAt = this.#clock.now();
        this.#widenLostScan(Math.min(scanStartedAt, scanEndedAt), Math.max(scanStartedAt, scanEndedAt));
        await this.#afterUnansweredClaim(error);
        throw error;
      }
      const { due, ambiguous } = claimed;
      outboxClaim.reclaimOwn = false;
      let unheld = true;
      try {
        // Which of them this process was working on (its lease only looked lapsed: a server clock step).
        const mineBefore = new Map<string, HeldLease>();
        for (const entry of [...due, ...ambiguous]) {
          const mine = this.#leases.get("outbox", entry.key);
          if (mine !== undefined && !mine.lost) mineBefore.set(entry.key, mine);
        }
        const dueKeys = new Set(due.map((entry) => entry.key));
        const ambiguousKeys = new Set(ambiguous.map((entry) => entry.key));
        // Deliveries run on their own (a hung provider call must not stall the sweeps); once one
        // settles, the next entry of its chat may be due, so look again. The lease is held from here on.
        for (const entry of due) {
          const mine = mineBefore.get(entry.key);
          // A held send being settled that comes back due without being ambiguous is a new attempt: its
          // failure was recorded (the reply lost) and its retry is due.
          if (mine !== undefined && (mine.settling !== "retry" || ambiguousKeys.has(entry.key))) {
            this.#leases.handOn(mine, entry.fence, claimedAt, entry.attempts); // re-leased while still ours
            continue;
          }
          const lease = this.#leases.hold("outbox", entry.key, entry.fence, claimedAt);
          this.#swept.outbound++;
          const resend = ambiguousKeys.has(entry.key);
          this.#sweptInFlight++;
          this.#outbound.inChatOrder(entry.chatId, () => this.#outbound.deliver(lease, entry, undefined, resend)).then(
            () => {
              this.#sweptInFlight--;
              this.#wake(0);
            },
            (error) => {
              this.#sweptInFlight--;
              this.#report(error, `delivery of outbox entry "${entry.key}"`);
            },
          );
        }
        unheld = false;
        this.#claimsInFlight--;
        for (const entry of ambiguous) {
          const mine = mineBefore.get(entry.key);
          // A reservation whose answer is still on its way may be ours too, or another process's entry
          // that it only found: it cannot tell, so that one is reported.
          if (mine === undefined) {
            if (entry.state === "unknown") this.#ambiguity.settle(entry);
            else this.#ambiguity.report(entry);
            // A reservation of ours whose answer is still on its way may hold this very lease: it must not call.
            if (entry.state === "unknown") this.#outbound.rememberMadeUnknown(entry.key, entry.fence);
            continue;
          }
          if (dueKeys.has(entry.key)) continue; // re-leased to us ('resend'): the work under way took the new token
          if (this.#outbound.calling.has(entry.key)) {
            // Its call is under way: reported now (were this process to die during the call, nobody else
            // would), and the call's outcome still resolves the entry (a late outcome is accepted).
            this.#ambiguity.report(entry);
            continue;
          }
          // Its call never started: nothing to report, send it again in its turn.
          this.#leases.drop(mine);
          const requeued = await this.backend.outbox.retry(entry.key).catch((error) => {
            this.#report(error, `requeue of outbox entry "${entry.key}"`);
            return false;
          });
          if (requeued) this.#wake(0);
          else if (!this.#halted) this.#ambiguity.report(entry); // left unknown: an operator must see it
        }
      } finally {
        if (unheld) this.#claimsInFlight--;
      }
      if (this.#halted) return;
      if (due.length < SWEEP_BATCH && ambiguous.length < SWEEP_BATCH) break;
    }
    const purgeEvery = Math.min(this.config.retentionMs / 10, 3_600_000);
    if (this.#clock.monotonic() - this.#lastPurge >= purgeEvery) {
      this.#lastPurge = this.#clock.monotonic();
      await this.backend.inbox.purge(this.config.retentionMs);
      await this.backend.outbox.purge(this.config.retentionMs);
      this.#swept.purges++;
    }
  }

  /** Wait (briefly) until no claim scan of this process has results it is not holding yet. */
  async #claimScansHeld(): Promise<void> {
    for (let waited = 0; this.#claimsInFlight > 0 && waited < 50 && !this.#halted; waited++) {
      await sleep(this.#clock, 5);
    }
  }

  /** Add the wall-time span of an unanswered outbox claim scan to the span the next adoption looks at. */
  #widenLostScan(from: number, to: number): void {
    const span = this.#lostScanSince;
    this.#lostScanSince = span === null ? { from, to } : { from: Math.min(span.from, from), to: Math.max(span.to, to) };
  }

  /** Dispatch a claimed record as a job that runs under `lease`. */
  #dispatchRecord(record: InboundRecord, lease: HeldLease): void {
    let message: InboundMessage;
    const timer = timerOf(record.payload);
    try {
      message = timer
        ? { id: record.id, chatId: record.chatId, type: "timeout" }
        : decodeContent(withoutTrace(record.payload)) as InboundMessage;
    } catch (error) {
      message = { id: record.id, chatId: record.chatId, type: "unknown" };
      this.#report(error, `payload of inbound record "${record.id}"`);
    }
    const job: InboundJob = { message, record, sends: [], sendCount: 0, ...(timer ? { timer } : {}) };
    this.#jobLeases.set(job, lease);
    this.#host.dispatch(job);
  }

  /**
   * A claim scan failed: it may have committed with its reply lost. Take up what it leased to this
   * incarnation at once (before those leases lapse); if that fails too, the next sweep tries again.
   */
  async #afterUnansweredClaim(error: unknown): Promise<void> {
    this.#adoptPending = true;
    if (isProcessDeath(error) || this.#halted) return;
    await this.#adoptOwnLost().catch(() => {});
  }

  /**
   * After a claim or reservation failed without an answer, take up what it may have leased to this
   * incarnation: records `processing`/`sending` under this incarnation's lease that it does not hold.
   * Nothing was done with them here, so they are handled and sent now instead of waiting for their
   * leases to lapse (and, for a send, instead of being taken for an ambiguous one).
   */
  async #adoptOwnLost(): Promise<void> {
    this.#adoptPending = false;
    const lostScanSince = this.#lostScanSince;
    this.#lostScanSince = null;
    try {
      if (lostScanSince !== null) {
        // A scan that moved sends to `unknown` reports them; its reply was lost, so report the sends
        // that became unknown since it started (another replica may report one of them too: better twice
        // than never). The slack covers a backend clock that runs behind this one.
        for (const entry of await this.backend.outbox.list({ state: "unknown", limit: ADOPT_LIST_LIMIT })) {
          if (entry.updatedAt < lostScanSince.from - LOST_SCAN_SLACK_MS) continue;
          if (entry.updatedAt > lostScanSince.to + LOST_SCAN_SLACK_MS) continue;
          if (this.#ambiguity.wasReported(entry.key, entry.fence)) continue;
          this.#ambiguity.settle(entry);
        }
      }
      const [records, entries] = await Promise.all([
        this.backend.inbox.list({ state: "processing", limit: ADOPT_LIST_LIMIT }),
        this.backend.outbox.list({ state: "sending", limit: ADOPT_LIST_LIMIT }),
      ]);
      for (const record of records) {
        const lease = record.lease;
        if (!lease || lease.owner !== this.#instanceId || lease.incarnation !== this.incarnation) continue;
        if (lease.token !== record.fence || this.#leases.has("inbox", record.id) || this.#claimsInFlight > 0) continue;
        if (this.#admitting.has(record.id)) continue; // its admission's answer is on its way
        if (this.#leases.knew("inbox", record.id, record.fence)) continue; // handled here already (the list is stale)
        this.#dispatchRecord(record, this.#leases.hold("inbox", record.id, record.fence, -Infinity));
      }
      for (const entry of entries) {
        if (!this.#outbound.isOwnUncalled(entry)) continue;
        // With 'resend', a lost scan re-leases abandoned sends to us instead of making them unknown:
        // one that was called before may have been delivered, so it is reported before it goes again
        // (perhaps one that had only failed: a report too many rather than a silent resend).
        if (lostScanSince !== null && this.config.outbox.onAmbiguous === "resend" && entry.attempts > 1) {
          this.#ambiguity.report(entry);
        }
        const lease = this.#leases.hold("outbox", entry.key, entry.fence, -Infinity);
        this.#outbound.inChatOrder(entry.chatId, () => this.#outbound.deliver(lease, entry)).then(
          () => this.#wake(0),
          (error) => void this.#report(error, `delivery of outbox entry "${entry.key}"`),
        );
      }
    } catch (error) {
      this.#adoptPending = true;
      if (lostScanSince !== null) this.#widenLostScan(lostScanSince.from, lostScanSince.to);
      throw error;
    }
  }

  // ---- settling and stopping -------------------------------------------------

  /**
   * Sweep until nothing due is left or `budgetMs` has passed, waiting for the work each pass took up
   * (see `Bot.sweep()`).
   */
  sweepFor(budgetMs: number): Promise<SweepSummary> {
    return this.#settling.sweepFor(budgetMs);
  }

  /** Resolve when every admitted record is done or dead and every outbox entry is sent, dead or unknown. */
  idle(): Promise<void> {
    return this.#settling.idle();
  }

  /** Stop taking work, let in-flight work finish, close the backend. */
  async stop(): Promise<void> {
    if (this.#stopping) return;
    this.#stopping = true;
    this.#clearTimers();
    // Sends waiting for the rate limiter stay in the journal, never called: the next start sends them.
    this.#throttle?.close();
    if (this.#halted) return;
    // Heartbeats go on while in-flight work finishes.
    this.#heartbeatTimer = every(this.#clock, this.#leases.heartbeatEveryMs, () => void this.#leases.heartbeat());
    try {
      await this.#host.whenLocalIdle();
    } finally {
      this.#heartbeatTimer.stop();
    }
    await this.backend.close?.();
  }
  /** The operator surface, `bot.durability`. */
  control(): DurabilityControl {
    const engine = this;
    return operatorControl({
      backend: this.backend,
      instanceId: () => engine.#instanceId,
      replayed: (id) => {
        this.#metrics.inboundReplayed++;
        this.#dedupe.delete(id);
        this.#wake(0);
      },
      requeued: () => this.#wake(0),
      resolveSent: (entry, messageId) => this.#ambiguity.resolveSent(entry, messageId, "operator"),
      metrics: () => ({ ...this.#metrics, outboxWaitingForLimit: this.#throttle?.waiting ?? 0 }),
      histograms: () => this.#observer.histograms(),
    });
  }
}
