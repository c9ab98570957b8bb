/**
 * Conversations: `ctx.ask()` waits for the chat's next message inside the
 * handler, and survives restarts by replaying the handler over its recorded
 * transcript (docs/conversations-and-media.md).
 *
 * The transcript is kept in the bot's `SessionStore` under
 * `botmesh:conversation:<botId>:<chatId>`: the message that started the flow,
 * then the input that fed each later step (a message, or a timeout), and a
 * fingerprint of each ask's prompt. A step is everything the handler does
 * between two asks; its sends are keyed by the message that fed it
 * (`<message id>:<n>`, a timeout step `<flow id>:t<step>:<n>`), so a replay's
 * sends are answered from the outbox and nothing goes out twice.
 *
 * @module
 */
import { damagedStorageOf, type JsonValue } from "./contract.ts";
import { encodeContent, hashText } from "./content.ts";
import type { SendOptions, SendResult } from "./engine.ts";
import { assertMatcher, type Matcher, matches } from "./matchers.ts";
import type { InboundMessage, OutboundContent } from "./provider.ts";
import { isProcessDeath } from "./errors.ts";
import { showValue as show } from "./show.ts";
import type { SessionStore } from "./store.ts";
import { checkStepArguments, isStepOutcomeError, type StepCall, type StepOptions } from "./engine/steps.ts";

/**
 * Thrown by `ctx.ask()` when no answer came within its `timeoutMs`.
 *
 * @example
 * ```ts
 * import { AskTimeoutError, Bot } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 * const bot = new Bot({ provider: new MockProvider() });
 * bot.when("order", async (ctx) => {
 *   try {
 *     const size = await ctx.ask("Which size?", { timeoutMs: 60_000 });
 *     await ctx.reply(`Size ${size.text}, noted.`);
 *   } catch (error) {
 *     if (error instanceof AskTimeoutError) return ctx.reply("No answer; send 'order' to start again.");
 *     throw error;
 *   }
 * });
 * ```
 */
export class AskTimeoutError extends Error {
  /** The ask's `timeoutMs`. */
  readonly timeoutMs: number;
  /**
   * @param timeoutMs the ask's timeout
   */
  constructor(timeoutMs: number) {
    super(`No answer within ${timeoutMs} ms`);
    this.name = "AskTimeoutError";
    this.timeoutMs = timeoutMs;
  }
}

/** Options of `ctx.ask()`. */
export interface AskOptions {
  /** Give up after this many ms: the ask throws an {@link AskTimeoutError}. */
  timeoutMs?: number;
  /** Only a message that matches answers; any other goes to the normal handlers (default: any message). */
  match?: Matcher;
}

/** One input of a conversation step: the message that fed it, or a timeout. */
export type StepInput = { message: InboundMessage } | { timeout: { at: number; timeoutMs: number } };

/** A conversation as stored. */
export interface StoredConversation {
  v: 1;
  /** The index of the handler (in `bot.when` order) that runs it. */
  handler: number;
  /** `steps[0]` started the flow; `steps[i]` answered `asks[i - 1]`. */
  steps: StepInput[];
  /** Each ask: a fingerprint of its prompt, its deadline, and whether it has a `match`. */
  asks: { fp: string; deadline: number | null; timeoutMs: number | null; filtered: boolean }[];
  /** `waiting`: `asks.at(-1)` waits for `steps[asks.length]`. */
  state: "waiting" | "ended";
  /** The id of the input that ended it (so a reprocess of that message knows it was consumed). */
  endedBy?: string;
  /** Answers taken for the waiting ask but not fed yet (a step that failed waits for its retry), oldest first. */
  queued?: InboundMessage[];
  startedAt: number;
}

/** What a conversation step sees of the message being processed (an `InboundJob` of the bot). */
export interface StepJob {
  message: InboundMessage;
  sends: Promise<SendResult>[];
  record: { attempts: number } | null;
}

/** A send made on behalf of the handler being run: keyed `<id>:<n>` unless `options` gives a key. */
export type HandlerSend = (
  chatId: string,
  content: OutboundContent,
  options: SendOptions | undefined,
  mode: "now" | "enqueue",
) => Promise<SendResult>;

/**
 * A durable step of the handler being run: keyed `<id>:step:<name>` unless `options` gives a key.
 * Resolves to the step's result as journaled (its JSON round trip).
 */
export type HandlerStep = <T>(name: string, fn: (call: StepCall) => T | Promise<T>, options?: StepOptions) => Promise<Awaited<T>>;

/** What a handler gets (the bot adds `bot`: see `Context`). */
export interface FlowContext {
  /** The inbound message or interaction that started this handler. */
  readonly message: InboundMessage;
  readonly chatId: string;
  /** The id of the message that started this handler (the provider's message id). */
  readonly inboundId: string;
  /** The attempt of the record being processed: 1 on the first processing, more on a retry or a replay. */
  readonly attempt: number;
  /** Send to this chat. Key `<id>:<n>` unless `idempotencyKey` is given, `<id>` the message that fed the current step (see `ask`). */
  reply(content: OutboundContent, options?: SendOptions): Promise<SendResult>;
  /** Send to any chat. Key `<id>:<n>` unless `idempotencyKey` is given, `<id>` the message that fed the current step (see `ask`). */
  send(chatId: string, content: OutboundContent, options?: SendOptions): Promise<SendResult>;
  /**
   * Send `prompt` (unless `null`) and wait for the chat's next message, which
   * is returned. The wait survives a restart on a durable store: the handler
   * is replayed over the recorded answers (see the README on determinism).
   * Sends after the answer are keyed by the answering message.
   *
   * @throws {AskTimeoutError} when `timeoutMs` passes without an answer
   */
  ask(prompt: OutboundContent | null, options?: AskOptions): Promise<InboundMessage>;
  /**
   * Run `fn` once for this message: its result (JSON) is journaled before the handler goes on, and a
   * rerun of the message (after a crash, a retry, a conversation's replay) gets the journaled result back
   * without calling `fn` again. A failure is retried with backoff, then journaled for good
   * ({@link StepFailedError}); a run cut off during `fn` whose outcome is unknown is reported and held
   * ({@link StepAmbiguousError}) unless the step is `idempotent`. Key `<id>:step:<name>` unless `key` is
   * given, `<id>` the message that fed the current step (see `ask`); each name once per such step.
   * Without durability, `fn` simply runs.
   *
   * @example
   * ```ts
   * import { Bot, MemoryDurability } from "@botmesh/durable";
   * import { MockProvider } from "@botmesh/durable/testing";
   * const bot = new Bot({ provider: new MockProvider(), durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
   * bot.when(/.+/, async (ctx) => {
   *   const answer = await ctx.step("llm", async ({ idempotencyKey }) => {
   *     // e.g. fetch("https://llm.example/v1/chat", { headers: { "Idempotency-Key": idempotencyKey }, … })
   *     return `You said ${ctx.message.text}`;
   *   });
   *   await ctx.reply(answer);
   * });
   * ```
   */
  step<T>(name: string, fn: (call: StepCall) => T | Promise<T>, options?: StepOptions): Promise<Awaited<T>>;
}

type Suspension = { kind: "ask" } | { kind: "ended" } | { kind: "threw"; error: unknown };

interface Deferred<T> {
  promise: Promise<T>;
  resolve(value: T): void;
}

function deferred<T>(): Deferred<T> {
  let resolve!: (value: T) => void;
  const promise = new Promise<T>((r) => resolve = r);
  return { promise, resolve };
}

/** What the conversation layer needs from the bot. */
export interface ConversationHost {
  botId: string;
  store: SessionStore;
  /** Whether the store outlives the process (a warning is given once otherwise, when durability is on). */
  storeIsDurable: boolean;
  durable: boolean;
  retentionMs: number;
  /** Wall-clock time in ms since epoch (the bot's clock). */
  now(): number;
  handlers(): readonly { matcher: Matcher; handler: (ctx: never) => unknown }[];
  /** Send for a step: the key is `<prefix>:<n>` unless given; the promise joins the job's sends. */
  send(job: StepJob, chatId: string, content: OutboundContent, key: string, mode: "now" | "enqueue"): Promise<SendResult>;
  /** Whether the provider journals `content` (false for an edit or a typing indicator: no key, no outbox). */
  journals(content: OutboundContent): boolean;
  /** Call the provider straight away for content it does not journal. */
  sendDirect(chatId: string, content: OutboundContent, key: string | undefined): Promise<SendResult>;
  /** Run a handler with `send` and `step` as the handling context of everything it calls (see `Bot.send`). */
  runHandler(send: HandlerSend, step: HandlerStep, fn: () => unknown): unknown;
  /** Run a durable step of the job's handler under `key` (without a journal: `fn` once). */
  step(job: StepJob, chatId: string, key: string, name: string, fn: (call: StepCall) => unknown, options: StepOptions | undefined): Promise<unknown>;
  checkSend(chatId: unknown, options: SendOptions | undefined): void;
  /** A context for the handler; the bot adds `bot`. */
  makeContext(base: FlowContext): unknown;
  warn(code: "conversation-diverged" | "conversation-not-durable", message: string, chatId: string): void;
  reportError(error: Error): void;
  /** Whether a failure of this job is final (no retry follows): its last attempt, or no journal. */
  isFinalAttempt(job: StepJob): boolean;
  count(metric: "conversationsReplayed" | "conversationsDiverged"): void;
  /** The session key of this instance's armed deadlines. */
  deadlinesKey(): string;
  /** Queue a timeout on the chat's queue at `at` (a timer of this process; used without a journal). */
  schedule(chatId: string, at: number, run: (job: StepJob) => Promise<void>): void;
  /**
   * Journal a timer of the chat due at `at` (see `DurabilityEngine.scheduleTimer`): any process's
   * sweep fires it through {@link Conversations.fire}. Absent without a journal.
   */
  scheduleTimer?: (id: string, chatId: string, at: number, data: JsonValue) => Promise<void>;
}

const CACHE_CAPACITY = 10_000;
const DEFERRED: unique symbol = Symbol("deferred");

function fingerprint(prompt: OutboundContent | null): string {
  if (prompt === null || prompt === undefined) return "-";
  try {
    return hashText(JSON.stringify(encodeContent(prompt, "prompt")));
  } catch {
    return "?";
  }
}

function inputId(input: StepInput, flowId: string, step: number): string {
  return "message" in input ? input.message.id : `${flowId}:t${step}`;
}

/** A running handler invocation that may ask. */
class Flow {
  readonly chatId: string;
  readonly handlerIndex: number;
  steps: StepInput[];
  asks: StoredConversation["asks"];
  startedAt: number;
  job: StepJob;
  keyPrefix = "";
  sendCount = 0;
  /** The step names used since the current input (each once). */
  stepNames = new Set<string>();
  askCount = 0;
  pending: { index: number; match: Matcher | undefined; resolve(m: InboundMessage): void; reject(e: unknown): void } | null =
    null;
  finished = false;
  #asking = false;
  #suspension!: Deferred<Suspension>;
  readonly #host: ConversationHost;

  constructor(host: ConversationHost, handlerIndex: number, stored: Pick<StoredConversation, "steps" | "asks" | "startedAt">, job: StepJob) {
    this.#host = host;
    this.handlerIndex = handlerIndex;
    this.steps = stored.steps.slice();
    this.asks = stored.asks.slice();
    this.startedAt = stored.startedAt;
    this.job = job;
    this.chatId = job.message.chatId;
    this.#enter(0, job);
  }

  get flowId(): string {
    return (this.steps[0] as { message: InboundMessage }).message.id;
  }

  #enter(step: number, job: StepJob): void {
    this.job = job;
    this.keyPrefix = inputId(this.steps[step]!, this.flowId, step);
    this.sendCount = 0;
    this.stepNames = new Set();
  }

  /** Run the handler from the start; resolves at its first live ask or its end. */
  run(handler: (ctx: never) => unknown): Promise<Suspension> {
    this.#suspension = deferred();
    const first = (this.steps[0] as { message: InboundMessage }).message;
    const handlerSend: HandlerSend = (chatId, content, options, mode) => {
      this.#host.checkSend(chatId, options);
      if (!this.#host.journals(content)) return this.#host.sendDirect(chatId, content, options?.idempotencyKey);
      const key = options?.idempotencyKey ?? `${this.keyPrefix}:${++this.sendCount}`;
      return this.#host.send(this.job, chatId, content, key, mode);
    };
    const send = (chatId: string, content: OutboundContent, options?: SendOptions): Promise<SendResult> =>
      handlerSend(chatId, content, options, "now");
    const handlerStep = (<T>(name: string, fn: (call: StepCall) => T | Promise<T>, options?: StepOptions): Promise<Awaited<T>> => {
      try {
        if (this.finished) throw new Error(`ctx.step("${String(name)}") was called after the handler returned: await each step in the handler`);
        checkStepArguments(name, fn, options);
        if (options?.key === undefined) {
          if (this.stepNames.has(name)) {
            throw new TypeError(`Step name "${name}" was used twice for one message: give each step of a handler its own name (an index in a loop)`);
          }
          this.stepNames.add(name);
        }
      } catch (error) {
        return Promise.reject(error);
      }
      const key = options?.key ?? `${this.keyPrefix}:step:${name}`;
      return this.#host.step(this.job, this.chatId, key, name, fn, options) as Promise<Awaited<T>>;
    }) as HandlerStep;
    const flow = this;
    const ctx = this.#host.makeContext({
      message: first,
      chatId: first.chatId,
      inboundId: first.id,
      get attempt() {
        return flow.job.record?.attempts ?? 1;
      },
      reply: (content, options) => send(first.chatId, content, options),
      send,
      ask: (prompt, options) => this.#ask(prompt, options, send),
      step: handlerStep,
    });
    Promise.resolve().then(() => this.#host.runHandler(handlerSend, handlerStep, () => handler(ctx as never))).then(
      () => this.#settle({ kind: "ended" }),
      (error) => this.#settle({ kind: "threw", error }),
    );
    return this.#suspension.promise;
  }

  #settle(suspension: Suspension): void {
    if (suspension.kind !== "ask") this.finished = true;
    this.#suspension.resolve(suspension);
  }

  async #ask(
    prompt: OutboundContent | null,
    options: AskOptions | undefined,
    send: (chatId: string, content: OutboundContent) => Promise<SendResult>,
  ): Promise<InboundMessage> {
    if (options !== undefined && (typeof options !== "object" || options === null)) {
      throw new TypeError(`Argument "options" of ctx.ask() must be an object, got ${show(options)}`);
    }
    const timeoutMs = options?.timeoutMs;
    if (timeoutMs !== undefined && (typeof timeoutMs !== "number" || !(timeoutMs > 0) || !Number.isFinite(timeoutMs))) {
      throw new RangeError(`Option "timeoutMs" of ctx.ask() must be a positive number, got ${show(timeoutMs)}`);
    }
    if (timeoutMs !== undefined && timeoutMs > this.#host.retentionMs) {
      throw new RangeError(
        `Option "timeoutMs" of ctx.ask() must not exceed durability.retention (${this.#host.retentionMs} ms), got ${timeoutMs}: ` +
          `the transcript expires with the retention`,
      );
    }
    if (options?.match !== undefined) assertMatcher(options.match, "match");
    if (this.finished) throw new Error("ctx.ask() was called after the handler returned");
    if (this.#asking) throw new Error("ctx.ask() was called while another ask of this handler is waiting; await each ask");
    this.#asking = true;
    try {
      return await this.#askNow(prompt, options, send);
    } finally {
      this.#asking = false;
    }
  }

  async #askNow(
    prompt: OutboundContent | null,
    options: AskOptions | undefined,
    send: (chatId: string, content: OutboundContent) => Promise<SendResult>,
  ): Promise<InboundMessage> {
    const timeoutMs = options?.timeoutMs;
    const index = this.askCount++;
    const fp = fingerprint(prompt);
    if (prompt !== null && prompt !== undefined) {
      const sent = send(this.chatId, prompt);
      await sent;
    }
    const recorded = this.asks[index];
    if (recorded && recorded.fp !== fp) {
        this.#host.count("conversationsDiverged");
        this.#host.warn(
          "conversation-diverged",
          `The conversation started by message ${show(this.flowId)} diverged on replay: ask ${index + 1} ` +
            `has a different prompt than when it was first asked; the recorded answer is used. Code between asks must ` +
            `depend only on the answers and stored state`,
          this.chatId,
        );
    }
    if (index + 1 < this.steps.length) {
      // Replaying: the answer is recorded.
      const input = this.steps[index + 1]!;
      this.#enter(index + 1, this.job);
      if ("timeout" in input) throw new AskTimeoutError(input.timeout.timeoutMs);
      return input.message;
    }
    if (!recorded) {
      // A new ask; a replay that reaches the waiting ask keeps its recorded deadline.
      this.asks.length = index;
      this.asks.push({
        fp,
        deadline: timeoutMs === undefined ? null : this.#host.now() + timeoutMs,
        timeoutMs: timeoutMs ?? null,
        filtered: options?.match !== undefined,
      });
    }
    return new Promise<InboundMessage>((resolve, reject) => {
      this.pending = { index, match: options?.match, resolve, reject };
      this.#settle({ kind: "ask" });
    });
  }

  /** Whether the pending ask takes `message`. */
  accepts(message: InboundMessage): boolean {
    return this.pending !== null && (this.pending.match === undefined || matches(this.pending.match, message));
  }

  /** Feed the pending ask; resolves at the next live ask or the end. */
  feed(input: StepInput, job: StepJob): Promise<Suspension> {
    const pending = this.pending!;
    this.pending = null;
    this.steps.push(input);
    this.#enter(this.steps.length - 1, job);
    this.#suspension = deferred();
    if ("timeout" in input) pending.reject(new AskTimeoutError(input.timeout.timeoutMs));
    else pending.resolve(input.message);
    return this.#suspension.promise;
  }
}

function lruSet<K, V>(map: Map<K, V>, key: K, value: V): void {
  map.delete(key);
  map.set(key, value);
  if (map.size > CACHE_CAPACITY) map.delete(map.keys().next().value as K);
}

/**
 * The conversation layer of one bot: runs each handler as a flow that may
 * ask, keeps flows waiting in memory, and stores their transcripts.
 *
 * An answer is first queued in the transcript (`queued`), then fed; the step
 * it feeds removes it from the queue in the same write that records it. So a
 * step that fails and waits for its retry keeps its place: later messages of
 * the chat queue behind it instead of answering its ask.
 */
export class Conversations {
  readonly #host: ConversationHost;
  /** Per chat: the stored conversation (`null`: none), as last read or written by this process. */
  #states = new Map<string, StoredConversation | null>();
  /** Per chat: a flow waiting at an ask in memory. */
  #live = new Map<string, Flow>();
  #warnedNotDurable = false;
  /** Per chat: the deadline of the waiting ask this instance armed a timer for. */
  #deadlines = new Map<string, number>();
  /** Changes to the stored deadline index not written yet (`null`: remove). */
  #deadlineChanges = new Map<string, number | null>();
  #deadlinesWrite: Promise<void> = Promise.resolve();

  constructor(host: ConversationHost) {
    this.#host = host;
  }

  #key(chatId: string): string {
    return `botmesh:conversation:${this.#host.botId}:${chatId}`;
  }

  async #load(chatId: string): Promise<StoredConversation | null> {
    if (this.#states.has(chatId)) return this.#states.get(chatId)!;
    const raw = await this.#host.store.get(this.#key(chatId));
    let state: StoredConversation | null = null;
    try {
      state = raw === undefined || raw === null ? null : checkStored(raw, this.#key(chatId));
    } catch (error) {
      // A damaged transcript must not block the chat: report it, and the message goes to the handlers.
      this.#host.reportError(error as Error);
    }
    lruSet(this.#states, chatId, state);
    return state;
  }

  async #save(
    chatId: string,
    flow: Pick<StoredConversation, "steps" | "asks" | "startedAt"> & { handlerIndex: number },
    state: "waiting" | "ended",
    queued: InboundMessage[],
    endedBy?: string,
  ): Promise<void> {
    const stored: StoredConversation = {
      v: 1,
      handler: flow.handlerIndex,
      steps: flow.steps,
      asks: flow.asks,
      state,
      ...(endedBy !== undefined ? { endedBy } : {}),
      ...(state === "waiting" && queued.length > 0 ? { queued } : {}),
      startedAt: flow.startedAt,
    };
    // The transcript is only good while the outbox still holds its steps' sends.
    const ttlMs = Math.max(1000, flow.startedAt + this.#host.retentionMs - this.#host.now());
    await this.#host.store.set(this.#key(chatId), stored as unknown as JsonValue, { ttlMs });
    lruSet(this.#states, chatId, structuredClone(stored));
  }

  /**
   * Handle one message: queue it for the chat's waiting ask and feed it, or
   * run the first matching handler.
   *
   * @param job the message and where its sends go
   */
  async handle(job: StepJob): Promise<void> {
    const { message } = job;
    const chatId = message.chatId;
    let state = this.#states.get(chatId);
    if (state === undefined) state = await this.#load(chatId);
    if (state && consumed(state, message.id)) {
      // Its step is recorded (a reprocess after a crash); the timer of the ask it left may not be.
      const deadline = state.state === "waiting" ? state.asks.at(-1)?.deadline ?? null : null;
      if (deadline !== null && (this.#host.scheduleTimer || this.#deadlines.get(chatId) !== deadline)) {
        await this.#arm(chatId, firstOf(state).id, state.steps.length, deadline);
      }
      return;
    }
    if (state?.state === "waiting" && queuedOf(state).length === 0) {
      const deadline = state.asks.at(-1)?.deadline ?? null;
      if (deadline !== null && deadline <= this.#host.now()) {
        await this.#timeOut(chatId, state, job);
        state = this.#states.get(chatId) ?? null;
      }
    }
    if (state?.state === "waiting") {
      const queued = queuedOf(state);
      if (!queued.some((m) => m.id === message.id)) {
        if (queued.length === 0) {
          // Only a message the waiting ask takes is queued for it (a filtered ask is tested on the flow).
          const flow = await this.#guard(chatId, job, () => this.#flowOf(chatId, state!, job), message);
          if (flow === DEFERRED || !flow?.accepts(message)) return this.#plain(message, job);
        }
        const current = this.#states.get(chatId)!;
        await this.#save(chatId, { ...current, handlerIndex: current.handler }, "waiting", [...queuedOf(current), message]);
      }
      return this.#drain(chatId, job);
    }
    return this.#plain(message, job);
  }

  /** Run the first handler that matches `message` (a new flow). */
  async #plain(message: InboundMessage, job: StepJob): Promise<void> {
    const handlers = this.#host.handlers();
    const index = handlers.findIndex((h) => matches(h.matcher, message));
    if (index < 0) return;
    const flow = new Flow(this.#host, index, { steps: [{ message }], asks: [], startedAt: this.#host.now() }, job);
    await this.#settleStep(flow, await flow.run(handlers[index]!.handler), job, message.id, false, []);
  }

  /** Feed the queued answers of the chat's waiting ask, oldest first, each as its own step. */
  async #drain(chatId: string, job: StepJob): Promise<void> {
    for (;;) {
      const state = this.#states.get(chatId);
      if (state?.state !== "waiting") return;
      const [input, ...rest] = queuedOf(state);
      if (!input) return;
      const flow = await this.#guard(chatId, job, () => this.#flowOf(chatId, state, job), input);
      if (flow === DEFERRED) return;
      if (!flow) {
        // The conversation ended on replay: what was queued for it goes to the handlers.
        for (const m of [input, ...rest]) await this.#plain(m, job);
        return;
      }
      if (!flow.accepts(input)) {
        await this.#save(chatId, flow, "waiting", rest);
        await this.#plain(input, job);
        continue;
      }
      const step = flow.steps.length;
      const done = await this.#guard(chatId, job, async () => {
        const suspension = await flow.feed({ message: input }, job);
        await this.#settleStep(flow, suspension, job, inputId({ message: input }, flow.flowId, step), true, rest);
      }, input);
      if (done === DEFERRED) return;
    }
  }

  /**
   * Run the step (or the replay) that feeds `input`, in `job`.
   *
   * - It fails for another message than the job's own: that message's record
   *   is being retried and will feed it again, with the rest of the queue;
   *   this job is done (its message stays queued behind it): `DEFERRED`.
   * - It fails for the job's own message on its last attempt: the
   *   conversation ends (reported) and what else was queued goes to the
   *   handlers, so the chat is not blocked for good; the error stands.
   * - Otherwise the error stands and the job is retried, `input` still first
   *   in the queue.
   */
  async #guard<T>(chatId: string, job: StepJob, work: () => Promise<T>, input: InboundMessage): Promise<T | typeof DEFERRED> {
    try {
      return await work();
    } catch (error) {
      // Damaged storage is no failure of the flow: the job gives up as it is, whatever message failed.
      if (isProcessDeath(error) || damagedStorageOf(error) !== undefined) throw error;
      if (input.id !== job.message.id) return DEFERRED;
      // A step's journaled failure or ambiguity dead-letters the message at once: it is final too.
      if (!this.#host.isFinalAttempt(job) && !isStepOutcomeError(error)) throw error;
      const state = this.#states.get(chatId);
      if (state?.state === "waiting") {
        await this.#end(chatId, state);
        this.#host.reportError(
          new Error(
            `The conversation started by message ${show(firstOf(state).id)} was ended: its step for message ` +
              `${show(input.id)} failed on its last attempt: ${(error as Error)?.message ?? String(error)}`,
            { cause: error },
          ),
        );
        for (const m of queuedOf(state)) if (m.id !== input.id) await this.#plain(m, job);
      }
      throw error;
    }
  }

  /** The waiting flow of the chat: in memory, or replayed from the transcript. */
  async #flowOf(chatId: string, state: StoredConversation, job: StepJob): Promise<Flow | null> {
    const live = this.#live.get(chatId);
    if (live && live.steps.length === state.steps.length && live.pending) return live;
    this.#live.delete(chatId);
    const handlers = this.#host.handlers();
    const first = firstOf(state);
    let index = state.handler;
    if (!handlers[index] || !matches(handlers[index]!.matcher, first)) {
      index = handlers.findIndex((h) => matches(h.matcher, first));
      this.#diverged(chatId, first.id, `its handler (number ${state.handler + 1}) no longer matches its first message`);
      if (index < 0) {
        await this.#end(chatId, state);
        return null;
      }
    }
    this.#host.count("conversationsReplayed");
    const flow = new Flow(this.#host, index, state, job);
    const suspension = await flow.run(handlers[index]!.handler);
    if (suspension.kind === "threw") throw suspension.error;
    if (suspension.kind === "ended" || flow.pending?.index !== state.asks.length - 1) {
      this.#diverged(chatId, first.id, "the handler returned before it reached the ask that is waiting");
      await this.#end(chatId, state);
      return null;
    }
    lruSet(this.#live, chatId, flow);
    return flow;
  }

  async #end(chatId: string, state: StoredConversation, endedBy?: string): Promise<void> {
    await this.#save(chatId, { ...state, handlerIndex: state.handler }, "ended", [], endedBy);
    this.#live.delete(chatId);
    await this.#disarm(chatId);
  }

  #diverged(chatId: string, flowId: string, why: string): void {
    this.#host.count("conversationsDiverged");
    this.#host.warn(
      "conversation-diverged",
      `The conversation started by message ${show(flowId)} diverged on replay: ${why}. Code between asks must depend only on the answers and stored state`,
      chatId,
    );
  }

  /**
   * After a step: wait for its sends, then record where the flow is, with
   * `queued` left (before the step's message is marked done).
   */
  async #settleStep(
    flow: Flow,
    suspension: Suspension,
    job: StepJob,
    input: string,
    stored: boolean,
    queued: InboundMessage[],
  ): Promise<void> {
    const chatId = flow.chatId;
    const forget = () => {
      if (this.#live.get(chatId) === flow) this.#live.delete(chatId);
    };
    if (suspension.kind === "threw") {
      forget();
      throw suspension.error;
    }
    if (job.sends.length > 0) {
      const outcomes = await Promise.allSettled(job.sends);
      const failed = outcomes.find((o): o is PromiseRejectedResult => o.status === "rejected");
      if (failed) {
        forget();
        throw failed.reason;
      }
    }
    if (suspension.kind === "ended") {
      forget();
      if (stored) {
        await this.#save(chatId, flow, "ended", [], input);
        await this.#disarm(chatId);
      }
      return;
    }
    if (this.#host.durable && !this.#host.storeIsDurable && !this.#warnedNotDurable) {
      this.#warnedNotDurable = true;
      this.#host.warn(
        "conversation-not-durable",
        "A handler asked with durability on but without a durable store: a pending ask is lost on restart. Pass `store` (e.g. SQLiteStore) to the Bot",
        chatId,
      );
    }
    try {
      await this.#save(chatId, flow, "waiting", queued);
    } catch (error) {
      forget();
      throw error;
    }
    lruSet(this.#live, chatId, flow);
    const deadline = flow.asks.at(-1)!.deadline;
    if (deadline !== null) await this.#arm(chatId, flow.flowId, flow.steps.length, deadline);
    else await this.#disarm(chatId);
  }

  /**
   * Arm the timer of the chat's waiting ask before the step is done: journaled
   * (due in the inbox, for any process's sweep), or without a journal a timer
   * of this process recorded in this instance's deadline index.
   * @param flowId the conversation's first message id
   * @param step the step the timeout would be (the number of steps so far)
   */
  async #arm(chatId: string, flowId: string, step: number, deadline: number): Promise<void> {
    if (this.#host.scheduleTimer) {
      return this.#host.scheduleTimer(inputId({ timeout: { at: deadline, timeoutMs: 0 } }, flowId, step), chatId, deadline, { flow: flowId, step });
    }
    if (this.#deadlines.get(chatId) !== deadline) {
      this.#host.schedule(chatId, deadline, (job) => this.#onDeadline(chatId, deadline, job));
      this.#deadlines.set(chatId, deadline);
    }
    await this.#writeDeadline(chatId, deadline);
  }

  async #disarm(chatId: string): Promise<void> {
    if (this.#deadlines.delete(chatId)) await this.#writeDeadline(chatId, null);
  }

  /**
   * A journaled timer fired (see {@link ConversationHost.scheduleTimer}): the
   * ask it was armed for times out, unless the conversation moved on.
   * @param job the timer's job
   * @param data what it was armed with
   */
  async fire(job: StepJob, data: JsonValue): Promise<void> {
    const chatId = job.message.chatId;
    // Another process may have moved the conversation on since this one last read it.
    this.#states.delete(chatId);
    const state = await this.#load(chatId);
    const { flow, step } = (data ?? {}) as { flow?: unknown; step?: unknown };
    // The ask it was armed for is still waiting at the same step. Its stored deadline may differ from
    // `at` when two processes ran the step at once (a lease lost to a stall): the transcript written
    // last and the timer journaled first can come from different runs. It times out now all the same:
    // no other timer is armed for this step.
    if (state?.state !== "waiting" || firstOf(state).id !== flow || state.steps.length !== step || state.asks.at(-1)?.deadline === null) {
      return;
    }
    if (queuedOf(state).length > 0) return; // an answer is in: it is handled first
    await this.#timeOut(chatId, state, job);
  }

  async #onDeadline(chatId: string, deadline: number, job: StepJob): Promise<void> {
    const state = await this.#load(chatId);
    if (state?.state !== "waiting" || state.asks.at(-1)?.deadline !== deadline || queuedOf(state).length > 0) {
      // It moved on (answered, or another ask is waiting): nothing to do, and the index entry is stale.
      if (this.#deadlines.get(chatId) === deadline) await this.#disarm(chatId);
      return;
    }
    await this.#timeOut(chatId, state, job);
  }

  /**
   * The index of the deadlines this instance armed, so that a restart arms
   * them again. Written as a merge of this process's changes over what is
   * stored (so entries not restored yet are kept), one write at a time.
   */
  #writeDeadline(chatId: string, deadline: number | null): Promise<void> {
    this.#deadlineChanges.set(chatId, deadline);
    const write = this.#deadlinesWrite.then(async () => {
      if (this.#deadlineChanges.size === 0) return;
      const changes = new Map(this.#deadlineChanges);
      this.#deadlineChanges.clear();
      const key = this.#host.deadlinesKey();
      const stored = await this.#host.store.get(key);
      const index: Record<string, number> = typeof stored === "object" && stored !== null && !Array.isArray(stored)
        ? { ...(stored as Record<string, number>) }
        : {};
      for (const [chat, at] of changes) {
        if (at === null) delete index[chat];
        else index[chat] = at;
      }
      await this.#host.store.set(key, index, { ttlMs: this.#host.retentionMs });
    });
    this.#deadlinesWrite = write.catch(() => {});
    return write;
  }

  /** Resolves once the deadline index writes under way are done (the bot awaits it in `stop()`). */
  flush(): Promise<void> {
    return this.#deadlinesWrite;
  }

  /**
   * Arm the timers of the asks this instance left waiting before a restart
   * (its deadlines are stored under its instanceId).
   */
  async restore(): Promise<void> {
    const key = this.#host.deadlinesKey();
    const raw = await this.#host.store.get(key);
    if (raw === undefined || raw === null) return;
    if (typeof raw !== "object" || Array.isArray(raw)) {
      throw new TypeError(`Stored ask deadlines ${JSON.stringify(key)} are damaged: expected an object, got ${show(raw)}`);
    }
    if (this.#host.scheduleTimer) {
      // An index an earlier version wrote (it kept timers in the process): journal each waiting ask's
      // timer, then drop the index.
      for (const [chatId, deadline] of Object.entries(raw)) {
        if (typeof deadline !== "number") continue;
        const state = await this.#load(chatId);
        if (state?.state !== "waiting" || state.asks.at(-1)?.deadline !== deadline) continue;
        await this.#arm(chatId, firstOf(state).id, state.steps.length, deadline);
      }
      await this.#host.store.delete(key);
      return;
    }
    for (const [chatId, deadline] of Object.entries(raw)) {
      if (typeof deadline !== "number" || this.#deadlines.has(chatId)) continue;
      this.#deadlines.set(chatId, deadline);
      this.#host.schedule(chatId, deadline, (job) => this.#onDeadline(chatId, deadline, job));
    }
  }

  /**
   * The waiting ask's deadline passed: the handler gets an
   * {@link AskTimeoutError}. A timeout step run by its journaled timer that
   * fails is retried with the timer's record; on its last attempt, when the
   * handler let the `AskTimeoutError` through, when a message that found the
   * deadline passed ran it, or without a journal, it ends the conversation
   * (reported) so that the chat is not stuck at a dead ask.
   */
  async #timeOut(chatId: string, state: StoredConversation, job: StepJob): Promise<void> {
    const ask = state.asks.at(-1)!;
    const input: StepInput = { timeout: { at: ask.deadline!, timeoutMs: ask.timeoutMs ?? 0 } };
    try {
      const flow = await this.#flowOf(chatId, state, job);
      if (!flow) return;
      const step = flow.steps.length;
      const suspension = await flow.feed(input, job);
      await this.#settleStep(flow, suspension, job, inputId(input, flow.flowId, step), true, []);
    } catch (error) {
      if (isProcessDeath(error)) throw error;
      // Run by its journaled timer: retried like any step until its last attempt (the transcript still
      // has the ask waiting), unless the handler let the AskTimeoutError through (that is its answer).
      // Run by a message that found the deadline passed, it ends here: that message is handled next.
      if ((job as { timer?: unknown }).timer !== undefined && !(error instanceof AskTimeoutError) && !this.#host.isFinalAttempt(job)) {
        throw error;
      }
      const current = this.#states.get(chatId);
      if (current?.state === "waiting") await this.#end(chatId, current, `${firstOf(current).id}:t${current.steps.length}`);
      this.#host.reportError(
        new Error(
          `The conversation started by message ${show(firstOf(state).id)} was ended: its timeout step failed: ${
            (error as Error)?.message ?? String(error)
          }`,
          { cause: error },
        ),
      );
    }
  }
}

function firstOf(state: StoredConversation): InboundMessage {
  return (state.steps[0] as { message: InboundMessage }).message;
}

function queuedOf(state: StoredConversation): InboundMessage[] {
  return state.queued ?? [];
}

function consumed(state: StoredConversation, id: string): boolean {
  if (state.state === "ended" && state.endedBy === id) return true;
  return state.steps.some((s) => "message" in s && s.message.id === id);
}

function checkStored(raw: JsonValue, key: string): StoredConversation {
  const s = raw as Partial<StoredConversation> | null;
  const bad = (field: string) =>
    new TypeError(
      `Stored conversation ${JSON.stringify(key)} is damaged and was set aside: field "${field}" is missing or of the wrong type`,
    );
  if (typeof s !== "object" || s === null || s.v !== 1) throw bad("v");
  if (!Array.isArray(s.steps) || s.steps.length === 0) throw bad("steps");
  const first = s.steps[0] as { message?: { id?: unknown; chatId?: unknown } };
  if (typeof first?.message?.id !== "string" || typeof first.message.chatId !== "string") throw bad("steps[0].message");
  for (const [i, step] of s.steps.entries()) {
    const m = (step as { message?: { id?: unknown; chatId?: unknown } } | null)?.message;
    const t = (step as { timeout?: { at?: unknown; timeoutMs?: unknown } } | null)?.timeout;
    const ok = m ? typeof m.id === "string" && typeof m.chatId === "string" : typeof t?.at === "number" && typeof t.timeoutMs === "number";
    if (!ok || (i === 0 && !m)) throw bad(`steps[${i}]`);
  }
  if (!Array.isArray(s.asks)) throw bad("asks");
  for (const [i, ask] of s.asks.entries()) {
    if (typeof ask?.fp !== "string" || (ask.deadline !== null && typeof ask.deadline !== "number")) throw bad(`asks[${i}]`);
  }
  if (s.state !== "waiting" && s.state !== "ended") throw bad("state");
  if (s.state === "waiting" && s.asks.length !== s.steps.length) throw bad("asks");
  if (typeof s.handler !== "number") throw bad("handler");
  if (s.queued !== undefined) {
    if (!Array.isArray(s.queued)) throw bad("queued");
    for (const [i, m] of s.queued.entries()) {
      if (typeof m?.id !== "string" || typeof m.chatId !== "string") throw bad(`queued[${i}]`);
    }
  }
  if (typeof s.startedAt !== "number") throw bad("startedAt");
  return s as StoredConversation;
}
