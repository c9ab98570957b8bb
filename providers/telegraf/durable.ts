/**
 * An existing Telegraf 4 bot behind the durable inbox and outbox: its updates
 * are journaled before its middleware runs, its message-creating calls go
 * through the outbox. Built from the grammY plugin's pieces (the method
 * table, the provider, the update records, the session envelopes); nothing of
 * Telegraf is patched beyond the bot instance given (its `handleUpdate` and
 * its `telegram`'s `callApi`) and the `Telegram` instance made for each update.
 *
 * @module
 */
import { Bot } from "../../src/bot.ts";
import type { Clock } from "../../src/clock.ts";
import type { DurabilityOptions } from "../../src/config.ts";
import type { BotEvents, DurabilityControl, SendResult } from "../../src/engine.ts";
import { checkKnownOptions } from "../../src/options.ts";
import { showValue as show } from "../../src/show.ts";
import type { SessionStore } from "../../src/store.ts";
import { type AsyncContext, createAsyncContext } from "../../src/runtime/async_context.ts";
import { isObj, type Obj } from "../telegram/values.ts";
import {
  type ApiFailure,
  callContent,
  failureOf,
  isJournaledMethod,
  journalChatOf,
  minimalResult,
  placeholderResult,
} from "../grammy/methods.ts";
import { type GrammyCall, GrammyProvider } from "../grammy/provider.ts";
import { isAlreadyDone } from "../grammy/reruns.ts";
import { checkStorageArguments, DurableStorage, type DurableStorageOptions } from "../grammy/storage.ts";
import { journaledUpdate, updateRecord } from "../grammy/updates.ts";
import { abortableSleep, afterFlood, REFUSED_BACKOFF_MS } from "../grammy/waits.ts";
import { TELEGRAF_ERRORS, TelegrafApiError, type TelegramErrorClass, telegrafFailureOf } from "./errors.ts";

/** Options of {@link durable}. */
export interface DurableTelegrafOptions {
  /** The durable inbox and outbox (required): a backend and an instanceId. */
  durability: DurabilityOptions;
  /** The id of the durability core, part of the default instanceId (default `'telegraf'`). */
  id?: string;
  /** Time and timers of the durability core (tests). */
  clock?: Clock;
}

/**
 * What the plugin uses of a Telegraf 4 bot (`Telegraf` of `telegraf`). Declared here rather than
 * imported, so that these declarations type-check without Telegraf's own.
 */
export interface TelegrafBotLike {
  /** The bot's API client: each update's `ctx.telegram` is made from its token and options. */
  readonly telegram: { readonly token: string; readonly options: object };
  /** What Telegraf assigns to each context. */
  readonly context: object;
  /** The bot's `getMe`, fetched once by `start()` when not set. */
  botInfo?: unknown;
  /** Runs the middleware for one update (the plugin replaces it with the journal's admission). */
  // deno-lint-ignore no-explicit-any
  handleUpdate(update: any, webhookResponse?: any): Promise<void>;
  /** The bot's middleware, composed. */
  middleware(): unknown;
  /** Stops `bot.launch()`'s long polling or webhook server. */
  stop(reason?: string): void;
}

/**
 * A Telegraf session store (`session({ store })`: `SessionStore` of Telegraf,
 * the async kind) whose writes take effect with the update that makes them:
 * see {@link durableStorage}. Values must be JSON.
 */
export interface DurableSessionStore<T> {
  /** The value of `name` as the update being handled should see it, `undefined` when absent. */
  get(name: string): Promise<T | undefined>;
  /** Store `value` under `name`: it takes effect with the update being handled. */
  set(name: string, value: T): Promise<void>;
  /** Delete `name`: it takes effect with the update being handled. */
  delete(name: string): Promise<void>;
}

/** Telegraf's `Telegram` (an `ApiClient`): what the plugin calls and wraps. */
interface TelegramInstance {
  readonly token: string;
  readonly options: object;
  callApi(method: string, payload?: Obj, options?: { signal?: AbortSignal }): Promise<unknown>;
}
type TelegramClass = new (token: string, options?: object, response?: unknown) => TelegramInstance;
type CallApi = TelegramInstance["callApi"];
/** The bot's internals the plugin reads (Telegraf 4 keeps them private in its types). */
interface TelegrafInternals {
  telegram: TelegramInstance;
  context: object;
  botInfo?: unknown;
  options?: { contextType?: new (update: unknown, telegram: TelegramInstance, botInfo: unknown) => object };
  polling?: { abortController?: { signal?: { aborted?: boolean } } };
  webhookServer?: { listening?: boolean };
  middleware(): (ctx: object, next: () => Promise<void>) => unknown;
  handleUpdate(update: unknown, webhookResponse?: unknown): Promise<void>;
  stop(reason?: string): void;
}
/** A webhook's `http.ServerResponse`, as much of it as the plugin answers with. */
interface WebhookResponse {
  writableEnded?: boolean;
  headersSent?: boolean;
  statusCode?: number;
  end(): unknown;
}

/** The Telegraf bots made durable (once each). */
const APPLIED = new WeakSet<object>();
const noop = (): Promise<void> => Promise.resolve();

/**
 * The payload of a call the outbox makes: binary it journaled comes back as `Uint8Array`, and Telegraf
 * uploads only a `Buffer` (it silently leaves out any other `source`), so each one becomes a `Buffer`
 * again (a view of the same bytes).
 */
function withBuffers(value: unknown): unknown {
  const BufferClass = (globalThis as { Buffer?: { isBuffer(v: unknown): boolean; from(b: ArrayBufferLike, o: number, n: number): Uint8Array } }).Buffer;
  if (BufferClass === undefined) return value;
  const walk = (v: unknown): unknown => {
    if (v instanceof Uint8Array) return BufferClass.isBuffer(v) ? v : BufferClass.from(v.buffer, v.byteOffset, v.byteLength);
    if (Array.isArray(v)) return v.map(walk);
    if (!isObj(v) || (Object.getPrototypeOf(v) !== Object.prototype && Object.getPrototypeOf(v) !== null)) return v;
    const out: Obj = {};
    for (const [key, item] of Object.entries(v)) out[key] = walk(item);
    return out;
  };
  return walk(value);
}

function isResponse(value: unknown): value is WebhookResponse {
  return isObj(value) && typeof value.end === "function";
}

/**
 * A Telegraf bot made crash-safe: see {@link durable}.
 */
export class DurableTelegraf<B extends TelegrafBotLike = TelegrafBotLike> {
  /** The Telegraf bot. */
  readonly telegraf: B;
  /** The durability core: the bot whose inbox and outbox the Telegraf bot now uses. */
  readonly core: Bot;
  readonly #bot: TelegrafInternals;
  readonly #provider: GrammyProvider;
  readonly #Telegram: TelegramClass;
  #starting: Promise<void> | undefined;
  #stopped = false;
  /** Set once the core's `stop()` resolved: calls made from now on go straight to Telegram. */
  #coreStopped = false;
  /** While `stop()` ends Telegraf's polling: its last `getUpdates` (which confirms the offset) does not back off. */
  #pollStopping = false;
  /** Admissions under way: a `getUpdates` waits for them, so that it confirms only journaled updates. */
  readonly #admitting = new Set<Promise<unknown>>();
  /** `getUpdates` calls under way. */
  readonly #polls = new Set<Promise<unknown>>();
  /** Updates (by `update_id`) that the journal refused, under long polling: `getUpdates` asks for them again. */
  readonly #refused = new Set<number>();
  #backoffMs: number = REFUSED_BACKOFF_MS[0];
  /** Whether updates come by long polling (a `getUpdates` went through the bot's `telegram`). */
  #polling = false;
  /** Telegraf's `TelegramError`, once a call of this process threw one. */
  #errorClass: TelegramErrorClass | undefined;
  /**
   * The middleware run a call descends from (one object per run): its inbound record id, and whether it
   * is a rerun (the record's second attempt or later).
   */
  #run: AsyncContext<{ readonly id: string; readonly rerun: boolean }> | null = null;

  /**
   * @param bot the Telegraf bot, with or without its middleware yet
   * @param options `durability` (required), `id`, `clock`
   * @throws {TypeError} when `bot` is not a Telegraf 4 bot or is already durable, or an option is missing, unknown or of the wrong type
   */
  constructor(bot: B, options: DurableTelegrafOptions) {
    const b = bot as unknown as TelegrafInternals;
    if (
      !isObj(b) || typeof b.handleUpdate !== "function" || typeof b.middleware !== "function" || !isObj(b.telegram) ||
      typeof b.telegram.callApi !== "function" || typeof b.options?.contextType !== "function"
    ) {
      throw new TypeError(`Argument "bot" must be a Telegraf 4 bot (new Telegraf(token)), got ${show(bot)}`);
    }
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`Argument "options" of durable() must be an object, got ${show(options)}`);
    }
    checkKnownOptions(options, ["durability", "id", "clock"]);
    if (APPLIED.has(bot)) throw new TypeError(`Argument "bot": this Telegraf bot is already durable: call durable() once per bot`);
    if (options.durability === undefined) throw new TypeError(`Option "durability" is required: a backend and an instanceId`);
    const token = b.telegram.token;
    if (typeof token !== "string" || !/^\d+:/.test(token)) {
      throw new TypeError(`Argument "bot": its token must look like "<bot id>:<secret>", got ${show(typeof token === "string" ? `${token.slice(0, 12)}…` : token)}`);
    }
    this.telegraf = bot;
    this.#bot = b;
    this.#Telegram = b.telegram.constructor as TelegramClass;
    // The provider's calls go through a Telegram instance of its own (the bot's token and options),
    // not through the journaling wrapper installed below.
    const caller = new this.#Telegram(token, b.telegram.options);
    const call: GrammyCall = async (method, payload, signal) => {
      try {
        return await caller.callApi(method, withBuffers(payload) as Obj, signal === undefined ? {} : { signal });
      } catch (error) {
        if (this.#errorClass === undefined && telegrafFailureOf(error) !== undefined) {
          this.#errorClass = (error as object).constructor as TelegramErrorClass;
        }
        throw error;
      }
    };
    this.#provider = new GrammyProvider(token, call, { name: "telegraf", errors: TELEGRAF_ERRORS });
    this.core = new Bot({
      provider: this.#provider,
      durability: options.durability,
      id: options.id ?? "telegraf",
      ...(options.clock !== undefined ? { clock: options.clock } : {}),
    });
    APPLIED.add(bot);
    this.core.when(() => true, (ctx) => {
      const update = journaledUpdate(ctx.message);
      const run = () => this.#handle(update);
      return this.#run === null ? run() : this.#run.run({ id: ctx.message.id, rerun: ctx.attempt > 1 }, run);
    });
    this.#journal(b.telegram);
    b.handleUpdate = (update, webhookResponse) => this.#admit(update, webhookResponse);
  }

  /** The operator surface of the inbox and outbox (metrics, dead letters, replays). */
  get durability(): DurabilityControl {
    return this.core.durability!;
  }

  /**
   * Listen to an event of the durability core: `error`, `warning`, `durability:dead`, `durability:ambiguous`.
   *
   * @param event the event
   * @param listener the listener
   * @returns a function that removes the listener
   */
  on<K extends keyof BotEvents & string>(event: K, listener: (payload: BotEvents[K]) => void): () => void {
    return this.core.on(event, listener);
  }

  /**
   * Fetch the bot's info (`getMe`) unless `bot.botInfo` is set, run recovery
   * (updates a crash left half done run through the middleware again), and
   * take updates. The first update Telegraf hands over starts it too; start
   * it before `bot.launch()` or the webhook so that recovery does not wait
   * for one. Calling it again returns the same promise.
   *
   * @returns resolves once started
   */
  start(): Promise<void> {
    this.#starting ??= (async () => {
      this.#run = await createAsyncContext();
      this.#bot.botInfo ??= await this.#bot.telegram.callApi("getMe", {});
      await this.core.start();
    })();
    return this.#starting;
  }

  /**
   * A Telegraf session store on `store` whose writes take effect with the update that makes them: see
   * {@link durableStorage}.
   *
   * @param store the session store (`SQLiteStore`, `PostgresStore`, `RedisStore`, `MemoryStore`, …)
   * @param options `ttlMs`: each write expires after that long
   * @returns the store, for Telegraf's `session({ store })`
   * @throws {TypeError} when `store` is not a session store, or an option is unknown or of the wrong type
   * @throws {RangeError} when `ttlMs` is not a positive number
   */
  // deno-lint-ignore no-explicit-any
  storage<T = any>(store: SessionStore, options?: DurableStorageOptions): DurableSessionStore<NoInfer<T>> {
    const ttlMs = checkStorageArguments(store, options);
    const adapter = new DurableStorage<T>(store, {
      current: () => this.#run?.get(),
      stateOf: async (id) => (await this.durability.inbox.get(id))?.state ?? null,
    }, ttlMs);
    return {
      get: (name) => adapter.read(name),
      set: (name, value) => adapter.write(name, value),
      delete: (name) => adapter.delete(name),
    };
  }

  /** Resolve when every admitted update is handled (or dead-lettered) and every send settled. */
  async idle(): Promise<void> {
    await Promise.allSettled([...this.#admitting]);
    await this.core.idle();
  }

  /**
   * Stop: Telegraf's long polling or webhook server (when `bot.launch()`
   * runs it), then the core, which lets the updates under way finish. Stop
   * your own web server first.
   */
  async stop(): Promise<void> {
    if (this.#stopped) return;
    this.#stopped = true;
    const bot = this.#bot;
    const polling = bot.polling !== undefined && bot.polling.abortController?.signal?.aborted !== true;
    if (polling || bot.webhookServer?.listening === true) {
      this.#pollStopping = true;
      try {
        bot.stop("durable stop");
        // The aborted getUpdates, then the one Telegraf confirms the offset with.
        for (let i = 0; i < 2; i++) {
          await Promise.allSettled([...this.#polls, ...this.#admitting]);
          await new Promise((resolve) => setTimeout(resolve, 0));
        }
        await Promise.allSettled([...this.#polls]);
      } finally {
        this.#pollStopping = false;
      }
    }
    await this.#starting?.catch(() => {});
    // Until the core is stopped, handlers still running journal their calls as before.
    try {
      await this.core.stop();
    } finally {
      this.#coreStopped = true;
    }
  }

  // ---- inbound ---------------------------------------------------------------------

  /** Telegraf's `handleUpdate` from now on: resolves once the update is journaled (or a duplicate). */
  async #admit(update: unknown, webhookResponse: unknown): Promise<void> {
    const work = this.#admitOnce(update, webhookResponse);
    this.#admitting.add(work);
    try {
      await work;
    } finally {
      this.#admitting.delete(work);
    }
  }

  async #admitOnce(update: unknown, webhookResponse: unknown): Promise<void> {
    const response = isResponse(webhookResponse) ? webhookResponse : undefined;
    let refusal: unknown;
    try {
      if (!this.#stopped) await this.start();
      const message = await updateRecord(update, this.#provider.connectionId, this.#provider.seal);
      const sink = this.#provider.sink;
      const result = sink === undefined
        ? { status: "rejected" as const, error: new Error("The durable Telegraf bot is stopped; Telegram delivers the update again") }
        : await sink.receive(message);
      const updateId = (update as { update_id: number }).update_id;
      if (result.status !== "rejected") {
        this.#refused.delete(updateId);
        // A webhook is answered 200 only now.
        if (response?.writableEnded === false) response.end();
        return;
      }
      // Long polling must not stop (Telegraf confirms the offset when it does): the next getUpdates
      // asks Telegram for the update again instead.
      if (response === undefined && this.#polling) {
        this.#refused.add(updateId);
        return;
      }
      refusal = result.error;
    } catch (error) {
      if (response === undefined) throw error;
      refusal = error;
    }
    // A webhook is answered 500: Telegram delivers the update again. Telegraf's webhookCallback does not
    // catch what handleUpdate throws, so it is answered here. Any other caller is told by the error.
    if (response === undefined) throw refusal;
    if (response.writableEnded === false) {
      if (response.headersSent !== true) response.statusCode = 500;
      response.end();
    }
  }

  /** Run the bot's middleware for a journaled update, as Telegraf's `handleUpdate` does, without its error handler. */
  async #handle(update: Obj): Promise<void> {
    const bot = this.#bot;
    bot.botInfo ??= await bot.telegram.callApi("getMe", {});
    // Each update gets a Telegram instance of its own, as Telegraf gives it (without a webhook reply).
    const telegram = this.#journal(new this.#Telegram(bot.telegram.token, bot.telegram.options));
    const ContextType = bot.options!.contextType!;
    const ctx = new ContextType(update, telegram, bot.botInfo);
    Object.assign(ctx, bot.context);
    await bot.middleware()(ctx, noop);
  }

  /** Before a `getUpdates`: its offset must not confirm an update that is not journaled. */
  async #beforePoll(payload: Obj, signal: AbortSignal | undefined): Promise<Obj> {
    while (this.#admitting.size > 0) await Promise.allSettled([...this.#admitting]);
    if (this.#refused.size === 0 || typeof payload.offset !== "number") {
      this.#backoffMs = REFUSED_BACKOFF_MS[0];
      return payload;
    }
    const first = Math.min(...this.#refused);
    if (payload.offset <= first) return payload;
    if (!this.#pollStopping) {
      await abortableSleep(this.#backoffMs, signal);
      this.#backoffMs = Math.min(REFUSED_BACKOFF_MS[1], this.#backoffMs * 2);
    }
    return { ...payload, offset: first };
  }

  // ---- outbound --------------------------------------------------------------------

  /** Route the calls of a Telegram instance (the bot's, or an update's) through the journal. */
  #journal<T extends TelegramInstance>(telegram: T): T {
    const direct: CallApi = telegram.callApi.bind(telegram);
    // An own property of this instance: Telegraf's classes and other bots are untouched.
    telegram.callApi = (method, payload = {}, options = {}) => this.#callApi(direct, method, payload, options);
    return telegram;
  }

  async #callApi(direct: CallApi, method: string, payload: Obj, options: { signal?: AbortSignal }): Promise<unknown> {
    if (method === "getUpdates") {
      this.#polling = true;
      const poll = (async () => {
        try {
          return await direct(method, await this.#beforePoll(payload, options.signal), options);
        } catch (error) {
          // Where fetch's abort error cannot be renamed (Bun), Telegraf throws a TypeError instead, and
          // its polling would end with it: an abort (stop()) ends it cleanly.
          if (options.signal?.aborted === true) throw Object.assign(new Error("getUpdates was aborted"), { name: "AbortError" });
          throw error;
        }
      })();
      this.#polls.add(poll);
      try {
        return await poll;
      } finally {
        this.#polls.delete(poll);
      }
    }
    if (!isJournaledMethod(method)) {
      try {
        return await direct(method, payload, options);
      } catch (error) {
        // A rerun makes such calls again: one that fails only because the first run's took effect has succeeded.
        const failure = telegrafFailureOf(error);
        if (failure !== undefined) this.#errorClass ??= (error as object).constructor as TelegramErrorClass;
        if (failure !== undefined && this.#run?.get()?.rerun === true && isAlreadyDone(method, failure)) return true;
        throw error;
      }
    }
    const chat = isObj(payload) ? journalChatOf(payload) : undefined;
    if (chat === undefined || this.#starting === undefined || this.#coreStopped) return direct(method, payload, options);
    await this.#starting;
    const sent = await this.core.send(chat, callContent(method, payload));
    const result = await afterFlood(sent, this.#provider, this.durability.outbox, () => this.#stopped);
    return this.#answer(method, payload, result);
  }

  /** What Telegraf's call resolves with (or throws) for a call the outbox took. */
  #answer(method: string, payload: Obj, result: SendResult): unknown {
    const answer = this.#provider.takeAnswer(result.key);
    if (result.state === "dead") {
      const failure: ApiFailure = failureOf(result, this.#provider.takeFailure(result.key));
      throw new (this.#errorClass ?? TelegrafApiError)(failure, { method, payload });
    }
    if (answer !== undefined) return answer;
    if (result.state === "sent") return minimalResult(method, payload, result.messageId ?? "");
    // Queued for a retry, being sent by another process, or of unknown outcome: the outbox has it.
    return placeholderResult(method, payload);
  }
}

/**
 * Make an existing Telegraf 4 bot crash-safe: its updates are journaled in
 * the durable inbox before its middleware runs (acknowledged to Telegram
 * only then), a redelivered update is dropped, an update a crash left half
 * done runs through the middleware again after the restart, and the calls
 * that create messages (`ctx.reply`, `ctx.replyWith*`, `ctx.send*`,
 * `telegram.send*`, `forwardMessage(s)`, `copyMessage(s)`, on `ctx.telegram`
 * and `bot.telegram`) go through the outbox, keyed `<inbound id>:<n>`: a
 * rerun gets their answers from the outbox instead of sending again.
 * Everything else (edits, callback answers, chat actions) is called directly.
 * Works with `bot.launch()` (long polling or its webhook) and
 * `bot.webhookCallback()` / `bot.createWebhook()`; see docs/telegraf.md.
 *
 * @example
 * ```ts
 * import { Telegraf } from "telegraf";
 * import { MemoryDurability } from "@botmesh/durable";
 * import { durable } from "@botmesh/durable/telegraf";
 *
 * const bot = new Telegraf("123:fake-token");
 * bot.on("text", (ctx) => ctx.reply(`You said: ${ctx.message.text}`));
 * const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * console.log(typeof safe.start); // "function": await safe.start(), then bot.launch()
 * ```
 *
 * @param bot the Telegraf bot
 * @param options `durability` (required), `id`, `clock`
 * @returns the handle: `start()`, `stop()`, `idle()`, `on()`, `storage()`, `durability`
 * @throws {TypeError} when `bot` is not a Telegraf 4 bot or is already durable, or an option is missing, unknown or of the wrong type
 */
export function durable<B extends TelegrafBotLike>(bot: B, options: DurableTelegrafOptions): DurableTelegraf<B> {
  return new DurableTelegraf(bot, options);
}

/**
 * A Telegraf session store on a {@link SessionStore} your bot already has,
 * whose writes made while an update is handled take effect with that
 * update's done mark: use it as the `store` of Telegraf's `session()`. A
 * rerun of an update (after a crash, or a retry after a throw) sees the
 * session as it was before the update; a finished update's write is never
 * lost; a dead-lettered update's write never takes effect. The values are
 * the grammY plugin's envelopes (`{ v, by, prev }`); see docs/telegraf.md.
 *
 * @example
 * ```ts
 * import { type Context, session, Telegraf } from "telegraf";
 * import { MemoryDurability, MemoryStore } from "@botmesh/durable";
 * import { durable, durableStorage } from "@botmesh/durable/telegraf";
 *
 * interface MyContext extends Context {
 *   session: { likes: number };
 * }
 * const bot = new Telegraf<MyContext>("123:fake-token");
 * const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * bot.use(session({ defaultSession: () => ({ likes: 0 }), store: durableStorage(safe, new MemoryStore()) }));
 * bot.command("like", (ctx) => {
 *   ctx.session.likes++; // applied exactly once per update, even across a kill -9
 * });
 * ```
 *
 * @param safe the durable Telegraf bot ({@link durable}'s handle)
 * @param store the session store
 * @param options `ttlMs`: each write expires after that long
 * @returns the store
 * @throws {TypeError} when `safe` is not a durable Telegraf bot, `store` not a session store, or an option is unknown or of the wrong type
 * @throws {RangeError} when `ttlMs` is not a positive number
 */
// The session type comes from the bot's context (Telegraf's `session()` infers it), not from here.
// deno-lint-ignore no-explicit-any
export function durableStorage<T = any>(
  safe: DurableTelegraf<TelegrafBotLike>,
  store: SessionStore,
  options?: DurableStorageOptions,
): DurableSessionStore<NoInfer<T>> {
  if (!(safe instanceof DurableTelegraf)) {
    throw new TypeError(`Argument "safe" must be the durable Telegraf bot that durable() returns, got ${show(safe)}`);
  }
  return safe.storage<T>(store, options);
}
