/**
 * The bot: handlers, per-chat sequential dispatch, sends, and the durability
 * engine when `durability` is configured.
 *
 * @module
 */
import type { InboundRecord, JsonValue } from "./contract.ts";
import { checkKnownOptions } from "./options.ts";
import { type DurabilityOptions, resolveDurability } from "./config.ts";
import { Emitter } from "./emitter.ts";
import {
  attemptsOf,
  type BotEvents,
  type DurabilityControl,
  DurabilityEngine,
  emitError,
  type InboundJob,
  type SendOptions,
  type SendResult,
  type SweepSummary,
} from "./engine.ts";
import { Conversations, type FlowContext, type HandlerSend, type HandlerStep, type StepJob } from "./conversation.ts";
import { encodeStepResult, type StepCall, type StepOptions, stepResultOf } from "./engine/steps.ts";
import { errorLogText, errorText, isProcessDeath } from "./errors.ts";
import { showValue as show } from "./show.ts";
import { assertMatcher, type Matcher } from "./matchers.ts";
import type { AdmitResult, InboundMessage, OutboundContent, Provider } from "./provider.ts";
import { checkClock, type Clock, type ClockTimer, systemClock } from "./clock.ts";
import { randomId } from "./runtime/mod.ts";
import { type AsyncContext, createAsyncContext } from "./runtime/async_context.ts";
import { MemoryStore, type SessionStore } from "./store.ts";
import { checkWellFormed } from "./well_formed.ts";

/** A handler run as seen from what it calls: its send, until the handler has returned. */
interface HandlerScope {
  readonly bot: Bot;
  readonly send: HandlerSend;
  readonly step: HandlerStep;
  /** `false` once the handler returned or threw: what it left running sends on its own. */
  open: boolean;
}

/** Options of {@link Bot}. */
export interface BotOptions {
  /** The channel adapter. */
  provider: Provider;
  /** Conversation/session state. */
  store?: SessionStore;
  /** Turn on the durable inbox and outbox. */
  durability?: DurabilityOptions;
  /** This bot's id, part of the default instanceId (default `'bot'`). */
  id?: string;
  /**
   * Time, timers and jitter for the bot, its conversations and its durability engine (default
   * {@link systemClock}). A test or a simulation passes its own to run in simulated time.
   */
  clock?: Clock;
}

/** What a handler gets. */
export interface Context extends FlowContext {
  readonly bot: Bot;
}

/** A message handler. */
export type Handler = (ctx: Context) => unknown | Promise<unknown>;

const INBOUND_FIELDS = ["id", "chatId", "type"] as const;
/** setTimeout's largest delay. */
const MAX_TIMER_MS = 2 ** 31 - 1;

function checkInbound(message: unknown): InboundMessage {
  if (typeof message !== "object" || message === null) {
    throw new TypeError(`Inbound message must be an object, got ${message === null ? "null" : typeof message}`);
  }
  const m = message as Record<string, unknown>;
  for (const field of INBOUND_FIELDS) {
    const value = m[field];
    if (typeof value !== "string" || value === "" || value.length > 512) {
      throw new TypeError(
        `Inbound message field "${field}" must be a non-empty string of at most 512 characters, got ${
          JSON.stringify(value) ?? "undefined"
        }`,
      );
    }
    if (field !== "type") checkWellFormed(value, `Inbound message field "${field}"`);
  }
  if (m.text !== undefined && typeof m.text !== "string") {
    throw new TypeError(`Inbound message field "text" must be a string, got ${JSON.stringify(m.text)}`);
  }
  if (m.unreadable !== undefined && (typeof m.unreadable !== "string" || m.unreadable === "")) {
    throw new TypeError(`Inbound message field "unreadable" must be a non-empty string (the reason), got ${JSON.stringify(m.unreadable) ?? "undefined"}`);
  }
  return message as InboundMessage;
}

function checkSendArgs(chatId: unknown, options: SendOptions | undefined): void {
  if (typeof chatId !== "string" || chatId === "") {
    throw new TypeError(`Argument "chatId" must be a non-empty string, got ${JSON.stringify(chatId) ?? "undefined"}`);
  }
  checkWellFormed(chatId, `Argument "chatId"`);
  const key = options?.idempotencyKey;
  if (key !== undefined && (typeof key !== "string" || key === "" || key.length > 512)) {
    throw new TypeError(
      `Option "idempotencyKey" must be a non-empty string of at most 512 characters, got ${JSON.stringify(key)}`,
    );
  }
  if (key !== undefined) checkWellFormed(key, `Option "idempotencyKey"`);
}

/**
 * A chatbot whose message processing survives crashes and restarts when
 * `durability` is configured.
 *
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 *
 * const provider = new MockProvider();
 * const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * bot.when(/hello/i, (ctx) => ctx.reply("Hi!"));
 * await bot.start();
 * await provider.receive({ chatId: "chat-1", text: "hello" });
 * await bot.idle();
 * console.log(provider.sent[0].content); // "Hi!"
 * await bot.stop();
 * ```
 */
export class Bot {
  readonly provider: Provider;
  readonly store: SessionStore | undefined;
  readonly id: string;
  #events: Emitter<BotEvents>;
  #handlers: { matcher: Matcher; handler: Handler }[] = [];
  #engine: DurabilityEngine | undefined;
  /** Per chat, jobs in arrival order; a promise is a slot kept for a message whose journal write is under way. */
  /** Per chat: the jobs to run in order (a slot while its message is being journaled), each with when it was received. */
  #chats = new Map<string, QueuedJob[]>();
  #starting: Promise<void> | undefined;
  /** Admissions and chat drains under way (a count: a Set of their promises cost a hash per message). */
  #inFlight = 0;
  #idleWaiters: (() => void)[] = [];
  #state: "new" | "starting" | "running" | "stopping" | "stopped" = "new";
  #conversations: Conversations;
  #timers = new Set<ClockTimer>();
  readonly #clock: Clock;
  /** The handler being run, as seen from anything it calls (`null`: the runtime has no async context). */
  #handlerContext: AsyncContext<HandlerScope> | null | undefined;
  #handlersRunning = 0;
  #warnedNoContext = false;

  /**
   * @param options provider, store, durability
   * @throws {TypeError} when an option has the wrong type or is unknown
   * @throws {RangeError} when an option is out of range
   */
  constructor(options: BotOptions) {
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`Bot options must be an object, got ${options === null ? "null" : typeof options}`);
    }
    checkKnownOptions(options, ["provider", "store", "durability", "id", "clock"]);
    const provider = options.provider as Partial<Provider> | undefined;
    if (typeof provider !== "object" || provider === null || typeof provider.send !== "function") {
      throw new TypeError(`Option "provider" must be a provider with send() and start(), got ${typeof provider}`);
    }
    if (typeof provider.start !== "function" || typeof provider.name !== "string" || provider.name === "") {
      throw new TypeError(`Option "provider" must have a start() method and a non-empty "name"`);
    }
    if (options.id !== undefined && (typeof options.id !== "string" || options.id === "")) {
      throw new TypeError(`Option "id" must be a non-empty string, got ${JSON.stringify(options.id)}`);
    }
    this.#clock = options.clock === undefined ? systemClock : checkClock(options.clock, "clock");
    const clock = this.#clock;
    this.provider = options.provider;
    this.store = options.store;
    this.id = options.id ?? "bot";
    this.#events = new Emitter<BotEvents>((error, event) => {
      // A throwing listener must not break the bot; report it once, without recursion.
      if (event === "error") console.error(errorLogText("[@botmesh/durable] an error listener threw:", error));
      else this.#events.emit("error", error instanceof Error ? error : new Error(errorText(error)));
    });
    if (options.durability !== undefined) {
      const config = resolveDurability(options.durability);
      this.#engine = new DurabilityEngine(config, {
        provider: this.provider,
        botId: this.id,
        events: this.#events,
        // A record a sweep claimed takes its place by when it was received: ahead of a later message
        // whose slot was queued while the claim's answer was on its way.
        dispatch: (job) => this.#dispatch(job, job.message.chatId, job.record?.receivedAt),
        whenLocalIdle: () => this.#whenLocalIdle(),
        track: (work) => this.#track(work),
        clock,
      });
    }
    const engine = this.#engine;
    const store = this.store ?? new MemoryStore();
    this.#conversations = new Conversations({
      botId: this.id,
      store,
      storeIsDurable: !(store instanceof MemoryStore),
      durable: engine !== undefined,
      retentionMs: engine?.config.retentionMs ?? 7 * 86_400_000,
      now: () => clock.now(),
      handlers: () => this.#handlers,
      send: (job, chatId, content, key, mode) => {
        const result = this.#send(chatId, content, key, (job as InboundJob).record ? job.message.id : null, mode);
        result.catch(() => {}); // observed by the step, whether or not the handler awaits it
        job.sends.push(result);
        return result;
      },
      checkSend: checkSendArgs,
      journals: (content) => this.#journals(content),
      sendDirect: (chatId, content, key) => this.#sendDirect(chatId, content, key ?? `rnd:${randomId()}`),
      step: (job, chatId, key, name, fn, options) => {
        if (engine === undefined) {
          // No journal: the step simply runs (its result is the same JSON round trip as a journaled one's).
          return Promise.resolve().then(() => fn({ idempotencyKey: key, attempt: 1, signal: new AbortController().signal }))
            .then((value) => stepResultOf(encodeStepResult(value))!.value);
        }
        // A message handled without its record (admitted while the journal failed) still journals its steps.
        const record = (job as InboundJob).record;
        return engine.step({ recordId: record?.id ?? job.message.id, chatId, key, name, fn, options });
      },
      runHandler: (send, step, fn) => {
        this.#handlersRunning++;
        const scope: HandlerScope = { bot: this, send, step, open: true };
        const done = () => {
          scope.open = false;
          this.#handlersRunning--;
        };
        try {
          const result = this.#handlerContext ? this.#handlerContext.run(scope, fn) : fn();
          Promise.resolve(result).then(done, done);
          return result;
        } catch (error) {
          done();
          throw error;
        }
      },
      makeContext: (base) => {
        (base as { bot?: Bot }).bot = this;
        return base;
      },
      warn: (code, message, chatId) => this.#events.emit("warning", { code, message, chatId }),
      reportError: (error) => this.#emitError(error),
      deadlinesKey: () => `botmesh:conversation-deadlines:${this.id}:${engine?.control().instanceId ?? "local"}`,
      count: (metric) => engine?.count(metric),
      isFinalAttempt: (job) => {
        const inbound = job as InboundJob;
        return inbound.record === null || attemptsOf(inbound as InboundJob & { record: InboundRecord }) > (engine?.config.inbox.retries ?? 0);
      },
      ...(engine ? { scheduleTimer: (id: string, chatId: string, at: number, data: JsonValue) => engine.scheduleTimer(id, chatId, at, data) } : {}),
      schedule: (chatId, at, run) => {
        const arm = (delayMs: number) => {
          const timer = clock.setTimeout(() => {
            this.#timers.delete(timer);
            if (this.#state === "new" || this.#state === "starting") return arm(20); // dispatched once the bot runs
            // A timer may fire a little early (Node), or be capped at setTimeout's limit: wait for the rest.
            if (clock.now() < at) return arm(at - clock.now());
            if (this.#state !== "running" || engine?.halted) return;
            const message: InboundMessage = { id: `timer:${randomId()}`, chatId, type: "timeout" };
            this.#dispatch({ message, record: null, sends: [], sendCount: 0, run });
          }, Math.min(MAX_TIMER_MS, Math.max(0, delayMs)));
          this.#timers.add(timer);
        };
        arm(at - clock.now() + 1);
      },
    });
  }

  /** The operator surface (`undefined` without `durability`). */
  get durability(): DurabilityControl | undefined {
    return this.#engine?.control();
  }

  /**
   * Handle messages that match. The first handler whose matcher matches runs.
   *
   * @param matcher text, RegExp, predicate, type constant, or an array of them
   * @param handler the handler
   * @returns this bot
   * @throws {TypeError} when the matcher or handler is not one
   */
  when(matcher: Matcher, handler: Handler): this {
    assertMatcher(matcher);
    if (typeof handler !== "function") {
      throw new TypeError(`Argument "handler" must be a function, got ${typeof handler}`);
    }
    this.#handlers.push({ matcher, handler });
    return this;
  }

  /**
   * Listen to an event: `error`, `warning`, `durability:dead`, `durability:ambiguous`.
   *
   * @param event the event
   * @param listener the listener
   * @returns a function that removes the listener
   */
  on<K extends keyof BotEvents & string>(event: K, listener: (payload: BotEvents[K]) => void): () => void {
    return this.#events.on(event, listener);
  }

  /**
   * Send now. With durability the send is journaled first and retried on failure.
   * Called while a handler runs (from the handler or anything it calls), the send
   * is the handler's, as `ctx.send` would make it: keyed `<inbound id>:<n>` and
   * awaited before the message counts as done. Sends are numbered in the order
   * they are made: give concurrent ones (a timer, an un-awaited helper) a key
   * of their own if that order can change between runs. A send made after the
   * handler returned (by a timer it left behind) is not the handler's. Where the runtime has no async
   * context (a browser), such a send gets a random key: use `ctx.send` there.
   * Content the provider does not journal (an edit, a typing indicator: see
   * `Provider.isJournaled`) goes straight to the provider, without a key number.
   *
   * @param chatId the chat
   * @param content text, or an object of the provider's shape
   * @param options `idempotencyKey` (else the handler's next key, or a random key outside a handler)
   * @returns what happened to the send
   * @throws {TypeError} when `chatId` or `idempotencyKey` is not a non-empty string
   */
  send(chatId: string, content: OutboundContent, options?: SendOptions): Promise<SendResult> {
    checkSendArgs(chatId, options);
    const handlerSend = this.#currentHandlerSend(options);
    if (handlerSend !== undefined) return handlerSend(chatId, content, options, "now");
    const key = options?.idempotencyKey ?? `rnd:${randomId()}`;
    if (!this.#journals(content)) return this.#sendDirect(chatId, content, key);
    return this.#send(chatId, content, key, null, "now");
  }

  /**
   * A durable step of the handler this call descends from, as `ctx.step` makes it (see
   * `FlowContext.step`): for code that has no `ctx` of this bot, e.g. grammY or Telegraf middleware.
   *
   * @param name the step's name, once per message
   * @param fn the step: its result must be JSON
   * @param options `key`, `idempotent`, `retries`
   * @returns the step's result as journaled
   * @throws {Error} when called outside a handler of this bot (a step needs the message it belongs to)
   */
  step<T>(name: string, fn: (call: StepCall) => T | Promise<T>, options?: StepOptions): Promise<Awaited<T>> {
    const handling = this.#handlerContext?.get();
    if (handling === undefined || handling.bot !== this || !handling.open) {
      return Promise.reject(new Error(`bot.step("${String(name)}") was called outside a handler of this bot: a step belongs to the message being handled`));
    }
    return handling.step(name, fn, options);
  }

  /**
   * Journal a send and return at once; the outbox worker delivers it. A
   * second call with the same key does nothing.
   *
   * @param chatId the chat
   * @param content text, or an object of the provider's shape
   * @param options `idempotencyKey` (a random key when omitted)
   * @returns the key
   */
  async enqueue(chatId: string, content: OutboundContent, options?: SendOptions): Promise<{ key: string }> {
    checkSendArgs(chatId, options);
    const handlerSend = this.#engine ? this.#currentHandlerSend(options) : undefined;
    if (handlerSend !== undefined) return { key: (await handlerSend(chatId, content, options, "enqueue")).key };
    const key = options?.idempotencyKey ?? `rnd:${randomId()}`;
    if (!this.#journals(content)) {
      this.#sendDirect(chatId, content, key).catch((error) => this.#emitError(error));
    } else if (this.#engine) {
      await this.#engine.send(chatId, content, key, null, "enqueue");
    } else {
      this.#track(this.#send(chatId, content, key, null, "now").catch((error) => this.#emitError(error)));
    }
    return { key };
  }

  /** The send of the handler this call descends from (its key numbering, its done check). */
  #currentHandlerSend(options: SendOptions | undefined): HandlerSend | undefined {
    const handling = this.#handlerContext?.get();
    if (handling !== undefined && handling.bot === this && handling.open) return handling.send;
    if (
      this.#handlerContext === null && options?.idempotencyKey === undefined && this.#handlersRunning > 0 && this.#engine &&
      !this.#warnedNoContext
    ) {
      this.#warnedNoContext = true;
      this.#events.emit("warning", {
        code: "send-without-context",
        message:
          "bot.send was called while a handler ran, on a runtime without an async context: it cannot tell whose send it is, so it got a random key and a reprocess sends it again; use ctx.send in handlers",
      });
    }
    return undefined;
  }

  /** Whether the provider journals `content` (see `Provider.isJournaled`). */
  #journals(content: OutboundContent): boolean {
    const isJournaled = this.provider.isJournaled;
    return typeof isJournaled !== "function" || isJournaled.call(this.provider, content) !== false;
  }

  /** Content the provider does not journal: one provider call, no outbox, no retries. */
  #sendDirect(chatId: string, content: OutboundContent, key: string): Promise<SendResult> {
    // Without durability every send is a direct one.
    return this.#engine ? this.#engine.sendDirect(chatId, content, key) : this.#send(chatId, content, key, null, "now");
  }

  #send(
    chatId: string,
    content: OutboundContent,
    key: string,
    inboundId: string | null,
    mode: "now" | "enqueue",
  ): Promise<SendResult> {
    if (this.#engine) return this.#engine.send(chatId, content, key, inboundId, mode);
    const work = this.provider.send(chatId, content, {
      idempotencyKey: key,
      attempt: 1,
      signal: new AbortController().signal,
    }).then((receipt): SendResult => ({ key, state: "sent", messageId: String(receipt?.messageId ?? "") }));
    this.#track(work);
    return work;
  }

  /** Run recovery (the first sweep), then start the provider. */
  start(): Promise<void> {
    if (this.#state !== "new") {
      return Promise.reject(new Error(`Bot.start() was called on a bot that is ${this.#state}`));
    }
    this.#state = "starting";
    this.#starting = (async () => {
      this.#handlerContext ??= await createAsyncContext();
      await this.#engine?.start();
      const engine = this.#engine;
      await this.provider.start({
        receive: (message) => this.#receive(message),
        reportError: (error) => this.#emitError(error),
        confirmSent: (key, messageId) => engine ? engine.confirmSent(key, messageId) : Promise.resolve(false),
      });
      if (this.#state === "starting") this.#state = "running";
      await this.#conversations.restore().catch((error) => this.#emitError(error));
    })();
    return this.#starting;
  }

  /**
   * Resolve when all work has settled: every admitted record done or dead,
   * every outbox entry sent, dead or unknown (waits through pending retries).
   * @throws {DamagedStorageError} once the backend reported its storage damaged (nothing settles then)
   */
  async idle(): Promise<void> {
    if (this.#engine) return this.#engine.idle();
    await this.#whenLocalIdle();
  }

  /**
   * Resolve when the work this process has under way has finished: the handlers of the messages it
   * admitted ran and their sends were attempted. Unlike {@link Bot.idle}, it does not wait for
   * retries: a failed send or handler stays due in the journal for a later sweep. Await it (or hand
   * it to `waitUntil`) before a serverless request returns.
   *
   * @returns a promise that resolves once nothing is in flight in this process
   */
  settled(): Promise<void> {
    return this.#whenLocalIdle();
  }

  /**
   * Take up due and abandoned work now, within a time budget: recover lapsed leases, run due
   * inbound retries, deliver due sends, report sends whose outcome is unknown, purge old records.
   * It works in passes, each taking up what is due and waiting until that work is finished, and
   * starts no new pass once `budgetMs` is spent: the budget bounds how long it keeps looking, and
   * a pass that started finishes first (so a function that ends when this resolves cuts off no
   * send). Calls of one bot run one after another; several processes may sweep at once (leases
   * keep each record to one of them). Made for cron triggers on platforms where no
   * process outlives a request (with `durability.sweepIntervalMs: 0`; see docs/serverless.md).
   *
   * @param options `budgetMs`: stop taking up more work after this many ms (default 10 000)
   * @returns what it did, and whether work is left (`more`: due now; `pending`: due now or later)
   * @throws {Error} when the bot is not running or has no `durability`
   * @throws {TypeError} when `options` is not an object or has an unknown key
   * @throws {RangeError} when `budgetMs` is not a positive integer
   */
  async sweep(options?: { budgetMs?: number }): Promise<SweepSummary> {
    if (options !== undefined) {
      if (typeof options !== "object" || options === null) {
        throw new TypeError(`Argument "options" of bot.sweep() must be an object like { budgetMs: 10000 }, got ${show(options)}`);
      }
      checkKnownOptions(options, ["budgetMs"], "bot.sweep() option");
    }
    const budgetMs = options?.budgetMs ?? 10_000;
    if (typeof budgetMs !== "number" || !Number.isInteger(budgetMs) || budgetMs <= 0 || budgetMs > MAX_TIMER_MS) {
      throw new RangeError(`Option "budgetMs" of bot.sweep() must be a positive integer of ms up to ${MAX_TIMER_MS}, got ${show(budgetMs)}`);
    }
    if (!this.#engine) throw new Error("Bot.sweep() needs the durability option (a journal to sweep)");
    await this.#starting;
    if (this.#state !== "running") throw new Error(`Bot.sweep() was called on a bot that is ${this.#state}`);
    return this.#engine.sweepFor(budgetMs);
  }

  /** Stop taking work, let in-flight work finish, release what the bot holds. */
  async stop(): Promise<void> {
    if (this.#state === "stopping" || this.#state === "stopped") return;
    this.#state = "stopping";
    await this.#starting?.catch(() => {}); // a start under way finishes first, then is undone
    for (const timer of this.#timers) this.#clock.clearTimeout(timer);
    this.#timers.clear();
    try {
      await this.provider.stop?.();
    } finally {
      if (this.#engine) await this.#engine.stop();
      else await this.#whenLocalIdle();
      await this.#conversations.flush();
      this.#state = "stopped";
    }
  }

  async #receive(raw: InboundMessage): Promise<AdmitResult> {
    let message: InboundMessage;
    try {
      message = checkInbound(raw);
    } catch (error) {
      const err = error as Error;
      this.#emitError(err);
      return { status: "rejected", id: String((raw as { id?: unknown } | null)?.id ?? ""), error: err };
    }
    if (this.#state === "stopping" || this.#state === "stopped") {
      return { status: "rejected", id: message.id, error: new Error("The bot is stopping; redeliver later") };
    }
    if (!this.#engine) {
      if (message.unreadable !== undefined) {
        // No journal to keep it in: said loudly, never handed to a handler.
        this.#emitError(new Error(`Unreadable inbound message "${message.id}" (chat "${message.chatId}"): ${message.unreadable}`));
        return { status: "admitted", id: message.id };
      }
      this.#dispatch({ message, record: null, sends: [], sendCount: 0 });
      return { status: "admitted", id: message.id };
    }
    // Keep the message's place in its chat's queue while it is journaled, so that a slow
    // journal write never lets a later message of the chat overtake it.
    let fill!: (job: InboundJob | null) => void;
    const slot = new Promise<InboundJob | null>((resolve) => fill = resolve);
    // Queued at once, in the order the engine gives its arrival (its receivedAt): a record a sweep
    // claims goes ahead of it when received before it. The engine fills the slot once: with the job,
    // or null (after a late confirmation, if one is due).
    const admission = this.#engine.admit(message, fill, (receivedAt) => this.#dispatch(slot, message.chatId, receivedAt));
    this.#track(admission);
    return admission;
  }

  #emitError(error: unknown): void {
    if (isProcessDeath(error) || this.#engine?.reportDamage(error, "bot")) return;
    emitError(this.#events, error, "bot");
  }


  // ---- per-chat dispatch -----------------------------------------------------

  /**
   * Queue a job on its chat. Without `receivedAt` it goes last; with it (a record a sweep claimed), it
   * goes ahead of the queued jobs not started yet that were received after it.
   */
  #dispatch(
    job: InboundJob | Promise<InboundJob | null>,
    chatId: string = (job as InboundJob).message.chatId,
    receivedAt?: number,
  ): void {
    const entry: QueuedJob = { job, at: receivedAt ?? this.#clock.now(), started: false };
    const queue = this.#chats.get(chatId);
    if (queue) {
      let at = queue.length;
      if (receivedAt !== undefined) while (at > 0 && !queue[at - 1]!.started && queue[at - 1]!.at > receivedAt) at--;
      queue.splice(at, 0, entry);
      return;
    }
    this.#chats.set(chatId, [entry]);
    this.#track(this.#drainChat(chatId));
  }

  async #drainChat(chatId: string): Promise<void> {
    const queue = this.#chats.get(chatId)!;
    try {
      while (queue.length > 0) {
        const head = queue[0]!;
        const job = await head.job;
        // A record received before it was queued ahead of it while it waited for its journal: that first.
        if (queue[0] !== head) continue;
        head.started = true;
        if (job !== null) {
          if (this.#engine) await this.#engine.process(job, () => this.#handle(job));
          else await this.#handle(job).catch((error) => this.#emitError(error));
        }
        queue.shift();
        if (this.#engine?.halted) queue.length = 0;
      }
    } finally {
      this.#chats.delete(chatId);
    }
  }

  async #handle(job: InboundJob): Promise<void> {
    let outcomes: PromiseSettledResult<SendResult>[] = [];
    try {
      if (job.run) await job.run(job);
      else if (job.timer) await this.#conversations.fire(job as StepJob, job.timer.data);
      else await this.#conversations.handle(job as StepJob);
    } finally {
      // Even a failing handler's sends settle before its outcome is recorded.
      if (job.sends.length > 0) outcomes = await Promise.allSettled(job.sends);
    }
    // Done only once every send the handler made is sent or durably queued.
    const failed = outcomes.find((o): o is PromiseRejectedResult => o.status === "rejected");
    if (failed) throw failed.reason;
  }

  // ---- in-flight tracking ----------------------------------------------------

  #track(work: Promise<unknown>): void {
    this.#inFlight++;
    const done = () => {
      if (--this.#inFlight === 0) {
        const waiters = this.#idleWaiters;
        this.#idleWaiters = [];
        for (const resolve of waiters) resolve();
      }
    };
    work.then(done, done);
  }

  #whenLocalIdle(): Promise<void> {
    if (this.#inFlight === 0) return Promise.resolve();
    return new Promise((resolve) => this.#idleWaiters.push(resolve));
  }
}

/** A job on its chat's queue, and when its message was received (wall clock). */
interface QueuedJob {
  job: InboundJob | Promise<InboundJob | null>;
  at: number;
  /** Taken off to run: nothing goes ahead of it any more. */
  started: boolean;
}
