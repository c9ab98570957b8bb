/**
 * The durability engine: journals inbound messages before dispatch, leases
 * and heartbeats what is being worked on, journals every send before the
 * provider call, retries with backoff, dead-letters, reports ambiguous sends,
 * and sweeps for due and abandoned work. The `Bot` drives it.
 *
 * @module
 */
import { type ClaimOptions, damagedStorageOf, type DurabilityBackend, type JsonValue, StaleLeaseError } from "./contract.ts";
import { Deadlines } from "./deadlines.ts";
import type { ResolvedDurability } from "./config.ts";
import { isProcessDeath } from "./errors.ts";
import type { AdmitResult, InboundMessage, OutboundContent } from "./provider.ts";
import { type Clock, every, type Repeating, sleep } from "./clock.ts";
import { hostname, randomId } from "./runtime/mod.ts";
import { Observer } from "./observe.ts";
import { MemoryRateLimiter, resolveRateLimits } from "./rate_limit.ts";
import { Throttle } from "./throttle.ts";
import {
  type DurabilityControl,
  type DurabilityMetrics,
  type DurabilityWarning,
  emitError,
  type EngineCore,
  type EngineHost,
  type InboundJob,
  type SendResult,
  type SweepSummary,
  zeroMetrics,
} from "./engine/types.ts";
import { Wakeups } from "./engine/wakeups.ts";
import { Leases } from "./engine/leases.ts";
import { Ambiguity } from "./engine/ambiguity.ts";
import { Outcomes } from "./engine/outcomes.ts";
import { operatorControl } from "./engine/control.ts";
import { Settling } from "./engine/settling.ts";
import { Outbound } from "./engine/outbound.ts";
import { Inbound } from "./engine/inbound.ts";
import { Sweeper } from "./engine/sweeper.ts";
import { DamagedReports } from "./engine/damaged.ts";
import { StorageDamage } from "./engine/storage_damage.ts";
import { type StepRequest, Steps } from "./engine/steps.ts";

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





/** Attempts of the recovery sweep in `start()` before it rejects. */
const START_SWEEP_ATTEMPTS = 3;


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
  #clock: Clock;
  #sweepTimer: Repeating | undefined;
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
  readonly #steps: Steps;
  /** Due and abandoned work taken up (a scan whose reply was lost asked again); old records purged. */
  readonly #sweeper: Sweeper;
  /** The damaged records this bot reports. */
  readonly #damaged: DamagedReports;
  #started = false;
  #ready = false;
  #stopping = false;
  #halted = false;
  /** The damage a backend reported: from then on nothing is admitted, taken up or recorded. */
  readonly #damage = new StorageDamage((damage, context, tell) => {
    this.#sweepTimer?.stop();
    this.#wakeups.clear();
    if (tell) emitError(this.#host.events, damage, context);
  });
  #abort = new AbortController();
  /** The outbox's rate limits (`null`: none). */
  #throttle: Throttle | null = null;

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
    const core: EngineCore = {
      backend: this.backend,
      config,
      host,
      clock: host.clock,
      metrics: this.#metrics,
      halted: () => this.#halted,
      stopping: () => this.#stopping,
      report: (error, context) => this.#report(error, context),
      damaged: () => this.#damage.current,
      warn: (warning) => this.#warn(warning),
      wake: (inMs) => this.#wake(inMs),
      leases: this.#leases,
      incarnation: this.incarnation,
      instanceId: () => this.#instanceId,
      claim: (kind) => this.#claim(kind),
    };
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
      countAmbiguous: () => this.#sweeper.countAmbiguous(),
    });
    this.#inbound = new Inbound({
      ...core,
      outcomes: this.#outcomes,
      observer: this.#observer,
      deadlines: this.#deadlines,
      halt: () => this.#halt(),
      claimsInFlight: () => this.#sweeper.claimsInFlight,
      claimScansHeld: () => this.#sweeper.claimScansHeld(),
      inboxScansUnanswered: () => this.#sweeper.inboxScansUnanswered,
      inboxScansPending: () => this.#sweeper.inboxScansPending(),
    });
    this.#outbound = new Outbound({
      ...core,
      outcomes: this.#outcomes,
      ambiguity: this.#ambiguity,
      observer: this.#observer,
      throttle: this.#throttle,
      signal: this.#abort.signal,
      ready: () => this.#ready,
      halt: () => this.#halt(),
    });
    this.#steps = new Steps({ ...core, outcomes: this.#outcomes, ambiguity: this.#ambiguity, calling: this.#outbound.calling, ownUncalled: (entry) => this.#outbound.isOwnUncalled(entry), signal: this.#abort.signal, halt: () => this.#halt() });
    this.#sweeper = new Sweeper({
      ...core,
      inbound: this.#inbound,
      outbound: this.#outbound,
      ambiguity: this.#ambiguity,
      throttle: this.#throttle,
      started: () => this.#started,
      claim: (kind) => this.#claim(kind),
    });
    this.#damaged = new DamagedReports({
      backend: this.backend,
      host,
      metrics: this.#metrics,
      halted: () => this.#halted,
      report: (error, context) => this.#report(error, context),
    });
    this.#settling = new Settling({
      backend: this.backend,
      clock: host.clock,
      claimsInFlight: () => this.#sweeper.claimsInFlight,
      swept: () => this.#sweeper.swept,
      sweep: () => this.sweep(),
      whenLocalIdle: () => host.whenLocalIdle(),
      halted: () => this.#halted,
      damaged: () => this.#damage.current,
      stopping: () => this.#stopping,
      report: (error, context) => this.#report(error, context),
    });
    this.#wakeups = new Wakeups(host.clock, () => void this.sweep(), () => !this.#halted && !this.#stopping && this.#damage.current === null);

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
          await this.#sweeper.sweepOnce(true);
          break;
        } catch (error) {
          if (isProcessDeath(error) || this.#halted || attempt >= START_SWEEP_ATTEMPTS || damagedStorageOf(error)) throw error;
          this.#report(error, `recovery sweep (attempt ${attempt} of ${START_SWEEP_ATTEMPTS})`);
          await sleep(this.#clock, 50 * 2 ** attempt);
        }
      }
      // Damage met by the recovery is start()'s error (reported by it, not as an event as well).
      if (this.#damage.current !== null) throw this.#damage.current;
    } catch (error) {
      if (isProcessDeath(error)) this.#halt();
      throw error;
    }
    this.#damage.recovered();
    if (this.config.sweepIntervalMs > 0) {
      this.#sweepTimer = every(this.#clock, this.config.sweepIntervalMs, () => {
        void this.sweep();
        void this.#damaged.report();
      });
    }
    void this.#damaged.report();
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
    this.#sweeper.stopWaiting();
  }

  #clearTimers(): void {
    this.#sweepTimer?.stop();
    this.#heartbeatTimer?.stop();
    this.#wakeups.clear();
    this.#deadlines.close();
  }

  /**
   * Report an error that has no caller; returns `true` when the caller must give up: a process death, or
   * damaged storage. The damage is reported once; from then on nothing is admitted, taken up or recorded
   * (an outcome written to damaged storage cannot be trusted, and none is dead-lettered for it).
   */
  #report(error: unknown, context: string): boolean {
    if (isProcessDeath(error)) {
      this.#halt();
      return true;
    }
    if (this.#halted || this.reportDamage(error, context)) return true;
    emitError(this.#host.events, error, context);
    return false;
  }

  /** When `error` is (or is caused by) damaged storage: see {@link StorageDamage.note}. @returns whether it was damage */
  reportDamage(error: unknown, context: string): boolean {
    return this.#damage.note(error, context);
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
  admit(message: InboundMessage, dispatch: (job: InboundJob | null) => void, place?: (receivedAt: number) => void): Promise<AdmitResult> {
    return this.#inbound.admit(message, dispatch, place);
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

  /** Run a handler's step, or return the result a run of it recorded (see `Steps.run`). */
  step(request: StepRequest): Promise<JsonValue | undefined> {
    return this.#steps.run(request);
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
    return this.#sweeper.sweep();
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
    this.#sweeper.stopWaiting();
    // Sends waiting for the rate limiter stay in the journal, never called: the next start sends them.
    this.#throttle?.close();
    if (this.#halted) return;
    // Heartbeats go on while in-flight work finishes.
    this.#heartbeatTimer = every(this.#clock, this.#leases.heartbeatEveryMs, () => void this.#leases.heartbeat());
    try {
      await this.#host.whenLocalIdle();
      await this.#sweeper.reportUnanswered();
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
