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
import { Deadlines } from "./deadlines.ts";
import type { ResolvedDurability } from "./config.ts";
import { decodeContent } from "./content.ts";
import type { Emitter } from "./emitter.ts";
import { isProcessDeath } from "./errors.ts";
import {
  type AdmitResult,
  type InboundMessage,
  type OutboundContent,
  type Provider,
} from "./provider.ts";
import { type Clock, every, type Repeating, sleep } from "./clock.ts";
import { hostname, randomId } from "./runtime/mod.ts";
import type { DurabilityHistograms } from "./histogram.ts";
import { Observer, withoutTrace } from "./observe.ts";
import { MemoryRateLimiter, resolveRateLimits } from "./rate_limit.ts";
import { Throttle } from "./throttle.ts";
import {
  type BotEvents,
  type DurabilityControl,
  type DurabilityMetrics,
  type DurabilityWarning,
  emitError,
  type EngineHost,
  type InboundJob,
  type JournaledTimer,
  type SendOptions,
  type SendResult,
  type SweepSummary,
  zeroMetrics,
} from "./engine/types.ts";
import { timerOf } from "./engine/jobs.ts";
import { Wakeups } from "./engine/wakeups.ts";
import { type HeldLease, Leases } from "./engine/leases.ts";
import { Ambiguity } from "./engine/ambiguity.ts";
import { Outcomes } from "./engine/outcomes.ts";
import { operatorControl } from "./engine/control.ts";
import { Settling, type SweepCounts } from "./engine/settling.ts";
import { Outbound } from "./engine/outbound.ts";
import { Inbound } from "./engine/inbound.ts";

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
  /** The admission timeouts (one timer for all: a timer per admission cost more than a memory admit). */
  #deadlines: Deadlines;
  /** A claim or reservation failed without an answer: its records may be leased to this incarnation unknown to it. */
  #adoptPending = false;
  /** Claim scans whose results are not all held yet (their records are leased to us but look unheld). */
  #claimsInFlight = 0;
  /** The inbox claim scan under way (settled once what it claimed is on the chats' queues), or null. */
  #inboxScan: Promise<void> | null = null;
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
  /** Messages and timers: admit, run, record. */
  readonly #inbound: Inbound;
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
    this.#inbound = new Inbound({
      backend: this.backend,
      config,
      host,
      clock: host.clock,
      metrics: this.#metrics,
      leases: this.#leases,
      outcomes: this.#outcomes,
      observer: this.#observer,
      deadlines: this.#deadlines,
      incarnation: this.incarnation,
      instanceId: () => this.#instanceId,
      halted: () => this.#halted,
      stopping: () => this.#stopping,
      halt: () => this.#halt(),
      report: (error, context) => this.#report(error, context),
      warn: (warning) => this.#warn(warning),
      wake: (inMs) => this.#wake(inMs),
      claim: () => this.#claim("inbox"),
      claimsInFlight: () => this.#claimsInFlight,
      claimScansHeld: () => this.#claimScansHeld(),
      inboxScan: () => this.#inboxScan,
      adoptLater: () => void (this.#adoptPending = true),
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
   *   with the job, or with `null` when there is none
   * @returns what happened; `rejected` means "let the channel redeliver"
   */
  admit(message: InboundMessage, dispatch: (job: InboundJob | null) => void): Promise<AdmitResult> {
    return this.#inbound.admit(message, dispatch);
  }

  /**
   * Journal a timer as an inbox record of `chatId`, `scheduled` until `at` (wall-clock ms); see
   * `Inbound.scheduleTimer`.
   */
  scheduleTimer(id: string, chatId: string, at: number, data: JsonValue): Promise<void> {
    return this.#inbound.scheduleTimer(id, chatId, at, data);
  }

  /**
   * Run a job's handler under its lease, then record the outcome: done, a
   * retry with backoff, or dead.
   * @param job the job
   * @param handle runs the handler and awaits the sends it made
   */
  process(job: InboundJob, handle: () => Promise<void>): Promise<void> {
    return this.#inbound.process(job, handle);
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
    this.#inbound.jobLeases.set(job, lease);
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
        if (this.#inbound.admitting.has(record.id)) continue; // its admission's answer is on its way
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
        this.#inbound.forget(id);
        this.#wake(0);
      },
      requeued: () => this.#wake(0),
      resolveSent: (entry, messageId) => this.#ambiguity.resolveSent(entry, messageId, "operator"),
      metrics: () => ({ ...this.#metrics, outboxWaitingForLimit: this.#throttle?.waiting ?? 0 }),
      histograms: () => this.#observer.histograms(),
    });
  }
}
