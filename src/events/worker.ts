/**
 * `EventWorker`: claims an app's events from a {@link LeasedEventJournal}
 * and runs a handler on each, with leases kept alive by heartbeats, retries
 * with backoff, and a dead state.
 *
 * @module
 */
import { errorLogText, errorMessage } from "../errors.ts";
import { StaleLeaseError } from "../contract.ts";
import { retryDelay } from "../backoff.ts";
import { Emitter } from "../emitter.ts";
import { showValue as show } from "../show.ts";
import { BOT_CHANNEL, type EventRecord, type LeasedEventJournal } from "./types.ts";

/** What a handler gets besides the event. */
export interface EventContext {
  /** The fencing token of this attempt's lease. */
  readonly token: number;
  /** This attempt's number (1 for the first). */
  readonly attempt: number;
  /** Aborted when the lease is lost (a heartbeat was refused): the event may now run elsewhere. */
  readonly signal: AbortSignal;
}

/** The handler of an {@link EventWorker}: resolve to complete the event, throw to fail it. */
export type EventHandler = (event: EventRecord, context: EventContext) => Promise<void> | void;

/** Options of {@link EventWorker}. */
export interface EventWorkerOptions {
  /** The journal to claim from. */
  journal: LeasedEventJournal;
  /** Runs once per claim of an event. */
  handler: EventHandler;
  /**
   * The channel to claim (default `null`: events without a channel). The bot's
   * channel (`'botwa:durable'`) is refused: an EventWorker never takes the bot's records.
   */
  channel?: string | null;
  /** This worker's id: the owner of its leases. Give each process its own, stable across restarts. */
  instanceId: string;
  /** Lease length in ms (default 30 000); heartbeats renew it every third of it. */
  leaseMs?: number;
  /** Handler retries before an event is dead (default 3: four attempts). */
  retries?: number;
  /** Backoff between retries, with full jitter (default `{ baseMs: 1000, capMs: 60_000 }`). */
  backoff?: { baseMs?: number; capMs?: number };
  /**
   * Events leased at once (default 1): handlers running, and events waiting
   * for an earlier one of their `orderKey` to finish.
   */
  concurrency?: number;
  /** How often to look for due events when there is nothing to do (default 1000 ms). */
  pollIntervalMs?: number;
  /** A random source in [0, 1) for the jitter (default `Math.random`). */
  random?: () => number;
}

/** The events of an {@link EventWorker}. */
export interface EventWorkerEvents {
  /** An event failed for the last time and is now `dead`. */
  dead: { event: EventRecord; error: string };
  /**
   * Something went wrong: the handler threw (`phase: 'handler'`, the event is
   * retried or dead), or a journal call failed (`'claim'`, `'complete'`,
   * `'fail'`, `'heartbeat'`, `'start'`).
   */
  error: { error: unknown; phase: "handler" | "claim" | "start" | "complete" | "fail" | "heartbeat"; event: EventRecord | null };
  /**
   * The worker lost the lease of an event (it lapsed and another claimer
   * took it): a heartbeat was refused, or the outcome was fenced off.
   */
  stale: { event: EventRecord; phase: "start" | "heartbeat" | "complete" | "fail" };
  /** (An index signature, so that the emitter accepts this map.) */
  [key: string]: unknown;
}

function positive(value: unknown, option: string, integer: boolean, min: number): number {
  if (typeof value !== "number" || !Number.isFinite(value)) {
    throw new TypeError(`EventWorker option "${option}" must be a finite number, got ${show(value)}`);
  }
  if ((integer && !Number.isInteger(value)) || value < min) {
    throw new RangeError(
      `EventWorker option "${option}" must be ${integer ? "an integer" : "a number"} of at least ${min}, got ${value}`,
    );
  }
  return value;
}

/**
 * Claims due events of one channel of a journal and runs `handler` on each.
 * While a handler runs, the lease is renewed every third of `leaseMs`; when
 * the handler resolves the event is completed, when it throws it is failed
 * and retried after an exponential backoff with full jitter, and after
 * `retries` retries it is `dead` (`'dead'` event). An event whose lease was
 * lost is left to its new holder (`'stale'` event; the handler's
 * `context.signal` is aborted). The first claim after `start()` takes back
 * the leases of this `instanceId`'s previous run at once (`reclaimOwn`).
 *
 * A worker without a channel claims only events without a channel, so it
 * never takes the bot's inbox records of the same journal.
 *
 * Events of one `orderKey` are handled in order, one at a time, across
 * workers: the journal leases a key's events to one worker at a time, oldest
 * first (while another worker's handler runs on an earlier event of the key,
 * the later ones wait in the journal), and a worker runs the events of a key
 * it holds one after another (the next one waits, its lease kept alive, until
 * the outcome of the one before is written). An event failed with a later
 * retry does not hold back the next ones of its key; events without a key
 * run concurrently.
 *
 * A damaged event (its stored form not a record: see `DamagedEvent`) is
 * never handed to the handler, and does not hold back its key: the journal
 * sets it aside, kept as it is; list them with `journal.damaged({ channel })`.
 *
 * @example Ordered events
 * ```ts
 * import { EventWorker, MemoryEventJournal } from "@botmesh/durable/events";
 *
 * const journal = new MemoryEventJournal();
 * const seen: string[] = [];
 * const worker = new EventWorker({
 *   journal,
 *   instanceId: "host-1/ledger",
 *   concurrency: 8,
 *   handler: async (event) => {
 *     seen.push(event.eventType); // per account: opened before credited
 *   },
 * });
 * worker.start();
 * await journal.append({ id: "a7-open", orderKey: "account-7", eventType: "account.opened", payload: null });
 * await journal.append({ id: "a7-credit", orderKey: "account-7", eventType: "account.credited", payload: 5 });
 * await worker.idle();
 * await worker.stop();
 * ```
 *
 * @example
 * ```ts
 * import { EventWorker, MemoryEventJournal } from "@botmesh/durable/events";
 *
 * const journal = new MemoryEventJournal();
 * const worker = new EventWorker({
 *   journal,
 *   instanceId: "host-1/mailer",
 *   handler: async (event) => {
 *     console.log(event.eventType, event.payload);
 *   },
 * });
 * worker.on("dead", ({ event, error }) => console.error(event.id, error));
 * worker.start();
 * await journal.append({ id: "order-42-paid", eventType: "order.paid", payload: { order: 42 } });
 * await worker.idle();
 * await worker.stop();
 * ```
 */
export class EventWorker {
  readonly #journal: LeasedEventJournal;
  readonly #handler: EventHandler;
  readonly #channel: string | null;
  readonly #instanceId: string;
  readonly #leaseMs: number;
  readonly #retries: number;
  readonly #backoff: { baseMs: number; capMs: number };
  readonly #concurrency: number;
  readonly #pollIntervalMs: number;
  readonly #random: () => number;
  readonly #emitter: Emitter<EventWorkerEvents>;
  /** Events leased now (handlers running or waiting for their key), by event id. */
  readonly #running = new Map<string, Promise<void>>();
  /** orderKey → the task of its latest event, which the key's next event waits for. */
  readonly #tails = new Map<string, Promise<void>>();
  #loop: Promise<void> | null = null;
  #stopping = false;
  /** `start()` was called while `stop()` was under way. */
  #startAfterStop = false;
  #incarnation = "";
  #wake: (() => void) | null = null;
  /** Bumped by every `idle()` call; a claim remembers the value it started at. */
  #epoch = 0;
  /** The epoch at which the latest claim that found nothing started. */
  #drainedEpoch = -1;
  #idleWaiters: { epoch: number; resolve: () => void }[] = [];

  /**
   * A stopped worker: call {@link start}.
   *
   * @param options the journal, the handler, `instanceId`, and optionally `channel`, `leaseMs`, `retries`, `backoff`, `concurrency`, `pollIntervalMs`, `random`
   * @throws {TypeError} when an option has the wrong type
   * @throws {RangeError} when a number is out of range, or `channel` is the bot's
   */
  constructor(options: EventWorkerOptions) {
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`EventWorker options must be an object, got ${show(options)}`);
    }
    const journal = options.journal;
    if (typeof journal !== "object" || journal === null || typeof journal.claimDue !== "function") {
      throw new TypeError(`EventWorker option "journal" must be a LeasedEventJournal, got ${show(journal)}`);
    }
    if (typeof options.handler !== "function") {
      throw new TypeError(`EventWorker option "handler" must be a function, got ${show(options.handler)}`);
    }
    const channel = options.channel ?? null;
    if (channel !== null && typeof channel !== "string") {
      throw new TypeError(`EventWorker option "channel" must be a string or null, got ${show(channel)}`);
    }
    if (channel === BOT_CHANNEL) {
      throw new RangeError(`EventWorker option "channel" must not be the bot's channel ${JSON.stringify(BOT_CHANNEL)}`);
    }
    if (typeof options.instanceId !== "string" || options.instanceId.length === 0) {
      throw new TypeError(`EventWorker option "instanceId" must be a non-empty string, got ${show(options.instanceId)}`);
    }
    const backoff = options.backoff ?? {};
    if (typeof backoff !== "object" || backoff === null) {
      throw new TypeError(`EventWorker option "backoff" must be an object, got ${show(backoff)}`);
    }
    const baseMs = positive(backoff.baseMs ?? 1000, "backoff.baseMs", false, 0);
    const capMs = positive(backoff.capMs ?? Math.max(60_000, baseMs), "backoff.capMs", false, 0);
    if (capMs < baseMs) throw new RangeError(`EventWorker option "backoff.capMs" must be at least baseMs (${baseMs}), got ${capMs}`);
    const random = options.random ?? Math.random;
    if (typeof random !== "function") {
      throw new TypeError(`EventWorker option "random" must be a function, got ${show(random)}`);
    }
    this.#journal = journal;
    this.#handler = options.handler;
    this.#channel = channel;
    this.#instanceId = options.instanceId;
    this.#leaseMs = positive(options.leaseMs ?? 30_000, "leaseMs", false, 1);
    this.#retries = positive(options.retries ?? 3, "retries", true, 0);
    this.#backoff = { baseMs, capMs };
    this.#concurrency = positive(options.concurrency ?? 1, "concurrency", true, 1);
    this.#pollIntervalMs = positive(options.pollIntervalMs ?? 1000, "pollIntervalMs", false, 1);
    this.#random = random;
    this.#emitter = new Emitter<EventWorkerEvents>((error, event) => {
      console.error(errorLogText(`EventWorker: a "${String(event)}" listener threw:`, error));
    });
  }

  /** The channel this worker claims (`null`: events without a channel). */
  get channel(): string | null {
    return this.#channel;
  }

  /** Whether the worker is started and not stopping. */
  get running(): boolean {
    return this.#loop !== null && !this.#stopping;
  }

  /**
   * Adds a listener.
   *
   * @param event `'dead'`, `'error'` or `'stale'`
   * @param listener called with the event's payload
   * @returns a function that removes the listener
   */
  on<K extends "dead" | "error" | "stale">(event: K, listener: (payload: EventWorkerEvents[K]) => void): () => void {
    return this.#emitter.on(event, listener);
  }

  /** Removes a listener added with {@link on}. */
  off<K extends "dead" | "error" | "stale">(event: K, listener: (payload: EventWorkerEvents[K]) => void): void {
    this.#emitter.off(event, listener);
  }

  /** Starts claiming (a no-op when already running). A new incarnation takes back its previous run's leases at once. */
  start(): void {
    if (this.#stopping) {
      this.#startAfterStop = true; // stop() is under way: start again once it is done
      return;
    }
    if (this.#loop !== null) return;
    this.#stopping = false;
    this.#incarnation = crypto.randomUUID();
    this.#loop = this.#run();
  }

  /**
   * Stops claiming and waits for the running handlers to finish (and their
   * outcomes to be written). Handlers are not interrupted: their `signal`
   * aborts only when their lease is lost. A `start()` called meanwhile takes
   * effect once the stop is done.
   */
  async stop(): Promise<void> {
    const loop = this.#loop;
    if (loop === null) {
      await Promise.allSettled([...this.#running.values()]);
      return;
    }
    this.#stopping = true;
    this.#wake?.();
    await loop;
    await Promise.allSettled([...this.#running.values()]);
    this.#loop = null;
    this.#stopping = false;
    this.#settleIdle();
    if (this.#startAfterStop) {
      this.#startAfterStop = false;
      this.start();
    }
  }

  /**
   * Resolves when no handler is running and a claim found nothing due (events
   * failed with a later retry time are not due). When the worker is stopped,
   * resolves when no handler is running.
   */
  idle(): Promise<void> {
    return new Promise((resolve) => {
      this.#idleWaiters.push({ epoch: ++this.#epoch, resolve });
      if (this.#loop === null || this.#stopping) this.#settleIdle();
      else this.#wake?.();
    });
  }

  /** Resolves the idle waiters for which a claim started after their call found nothing (all of them when stopped). */
  #settleIdle(): void {
    if (this.#idleWaiters.length === 0 || this.#running.size > 0) return;
    const stopped = this.#loop === null || this.#stopping;
    const keep: { epoch: number; resolve: () => void }[] = [];
    const done: (() => void)[] = [];
    for (const waiter of this.#idleWaiters) {
      if (stopped || waiter.epoch <= this.#drainedEpoch) done.push(waiter.resolve);
      else keep.push(waiter);
    }
    this.#idleWaiters = keep;
    for (const resolve of done) resolve();
  }

  async #run(): Promise<void> {
    let first = true;
    while (!this.#stopping) {
      const free = this.#concurrency - this.#running.size;
      let full = free <= 0;
      if (free > 0) {
        const epoch = this.#epoch;
        try {
          const events = await this.#journal.claimDue({
            owner: this.#instanceId,
            incarnation: this.#incarnation,
            leaseMs: this.#leaseMs,
            reclaimOwn: first,
            channel: this.#channel,
            limit: free,
          });
          first = false;
          for (const event of events) this.#start(event);
          full = events.length >= free;
          if (events.length === 0) this.#drainedEpoch = epoch;
        } catch (error) {
          this.#emitter.emit("error", { error, phase: "claim", event: null });
          this.#drainedEpoch = epoch; // idle() must not hang on a broken (or closed) journal
        }
        this.#settleIdle();
      }
      if (this.#stopping) break;
      // Full: wait for a handler to finish. Otherwise: wait for the poll interval (or a wake-up).
      await new Promise<void>((resolve) => {
        const timer = full ? null : setTimeout(() => done(), this.#pollIntervalMs);
        const done = (): void => {
          if (timer !== null) clearTimeout(timer);
          this.#wake = null;
          resolve();
        };
        this.#wake = done;
      });
    }
  }

  #start(event: EventRecord): void {
    const key = event.orderKey ?? null;
    const before = key === null ? undefined : this.#tails.get(key);
    const task = this.#process(event, before).finally(() => {
      this.#running.delete(event.id);
      if (key !== null && this.#tails.get(key) === task) this.#tails.delete(key);
      this.#wake?.();
      this.#settleIdle();
    });
    this.#running.set(event.id, task);
    if (key !== null) this.#tails.set(key, task);
  }

  /** Runs the handler on `event` once `before` (the task of the previous event of its key) is done. */
  async #process(event: EventRecord, before?: Promise<void>): Promise<void> {
    const token = event.lease!.token;
    const controller = new AbortController();
    let lost = false;
    const loseLease = (): void => {
      if (lost) return;
      lost = true;
      controller.abort(new StaleLeaseError("event", event.id, token));
      this.#emitter.emit("stale", { event, phase: "heartbeat" });
    };
    let beating = false;
    const beat = setInterval(() => {
      if (beating || lost) return;
      beating = true;
      this.#journal.heartbeat(event.id, token, this.#leaseMs).then(
        (held) => {
          if (!held) loseLease();
        },
        (error) => this.#emitter.emit("error", { error, phase: "heartbeat", event }),
      ).finally(() => beating = false);
    }, Math.max(1, Math.floor(this.#leaseMs / 3)));
    let failure: { error: unknown } | null = null;
    try {
      if (before) await before.catch(() => {});
      if (lost) return; // the lease lapsed while the event waited for its key
      // Only runs count: the claim counted nothing, the run is journaled as it begins.
      const attempt = event.attempts + 1;
      let started: boolean;
      try {
        started = await this.#journal.start(event.id, token, attempt);
      } catch (error) {
        this.#emitter.emit("error", { error, phase: "start", event });
        return; // not run: its lease lapses and a scan takes it up again
      }
      if (!started) {
        lost = true;
        this.#emitter.emit("stale", { event, phase: "start" });
        return;
      }
      event = { ...event, attempts: attempt };
      await this.#handler(event, { token, attempt, signal: controller.signal });
    } catch (error) {
      failure = { error };
    } finally {
      clearInterval(beat);
    }
    if (lost) return;
    if (failure === null) {
      await this.#outcome(event, "complete", () => this.#journal.complete(event.id, token));
      return;
    }
    this.#emitter.emit("error", { error: failure.error, phase: "handler", event });
    const message = errorMessage(failure.error);
    if (event.attempts > this.#retries) {
      const written = await this.#outcome(event, "fail", () => this.#journal.fail(event.id, token, { error: message, dead: true }));
      if (written) this.#emitter.emit("dead", { event: { ...event, state: "dead", lease: null, error: message }, error: message });
    } else {
      const retryInMs = retryDelay(event.attempts, this.#backoff, undefined, this.#random);
      await this.#outcome(event, "fail", () => this.#journal.fail(event.id, token, { error: message, retryInMs }));
    }
  }

  /** Writes an outcome. @returns whether it was written */
  async #outcome(event: EventRecord, phase: "complete" | "fail", write: () => Promise<void>): Promise<boolean> {
    try {
      await write();
      return true;
    } catch (error) {
      if (error instanceof StaleLeaseError) this.#emitter.emit("stale", { event, phase });
      else this.#emitter.emit("error", { error, phase, event });
      return false;
    }
  }
}
