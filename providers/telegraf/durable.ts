/**
 * An existing Telegraf 4 bot behind the durable inbox and outbox: its updates
 * are journaled before its middleware runs, its message-creating calls go
 * through the outbox. Built from the grammY plugin's pieces (the method
 * table, the provider, the update records, the admission of updates, the
 * answers of journaled calls, the session envelopes); nothing of
 * Telegraf is patched beyond the bot instance given (its `handleUpdate` and
 * its `telegram`'s `callApi`) and the `Telegram` instance made for each update.
 *
 * @module
 */
import { Bot } from "../../src/bot.ts";
import type { Clock } from "../../src/clock.ts";
import type { DurabilityOptions } from "../../src/config.ts";
import type { BotEvents, DurabilityControl } from "../../src/engine.ts";
import type { StepCall, StepOptions } from "../../src/engine/steps.ts";
import { checkKnownOptions } from "../../src/options.ts";
import { setOwn } from "../../src/rules.ts";
import { showValue as show } from "../../src/show.ts";
import type { SessionStore } from "../../src/store.ts";
import { withoutToken } from "../telegram/redact.ts";
import { isObj, type Obj } from "../telegram/values.ts";
import { UpdateAdmission } from "../grammy/admission.ts";
import { sendJournaled } from "../grammy/answers.ts";
import { isJournaledMethod, journalChatOf } from "../grammy/methods.ts";
import { type GrammyCall, GrammyProvider } from "../grammy/provider.ts";
import { isAlreadyDone } from "../grammy/reruns.ts";
import { MiddlewareRuns } from "../grammy/runs.ts";
import type { DurableStorageOptions } from "../grammy/storage.ts";
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
    for (const [key, item] of Object.entries(v)) setOwn(out, key, walk(item));
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
  readonly #admission: UpdateAdmission;
  /** `getUpdates` calls under way. */
  readonly #polls = new Set<Promise<unknown>>();
  /** Telegraf's `TelegramError`, once a call of this process threw one. */
  #errorClass: TelegramErrorClass | undefined;
  readonly #runs = new MiddlewareRuns();

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
    this.#admission = new UpdateAdmission({
      provider: this.#provider,
      library: "Telegraf",
      stopped: () => this.#stopped,
      start: () => this.start(),
    });
    // A call the middleware makes directly throws Telegraf's own error to it (node-fetch's FetchError
    // quotes the URL, the token in it); one the middleware lets through is journaled and reported
    // without the token.
    this.#runs.route(this.core, (update) => withoutToken(token, () => this.#handle(update)));
    this.#journal(b.telegram);
    // Telegraf's handleUpdate from now on: resolves once the update is journaled (or a duplicate).
    b.handleUpdate = (update, webhookResponse) => this.#admission.track(this.#admit(update, webhookResponse));
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
      await this.#runs.init();
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
    const adapter = this.#runs.storage<T>(this.core, store, options);
    return {
      get: (name) => adapter.read(name),
      set: (name, value) => adapter.write(name, value),
      delete: (name) => adapter.delete(name),
    };
  }

  /**
   * A durable step of the update being handled: `fn` runs once for it, its result (JSON) journaled
   * in the outbox before the middleware goes on; a rerun of the update (after a crash, or a retry
   * after a throw) gets the journaled result back without calling `fn` again. A failure is retried
   * with backoff, then journaled for good (`StepFailedError`); a run cut off during `fn` is reported
   * (`durability:ambiguous`) and not run again (`StepAmbiguousError`) unless the step is
   * `idempotent`. Key `<inbound id>:step:<name>` unless `key` is given. Callable from any code the
   * middleware runs (it finds the update through the async context). See docs/steps.md.
   *
   * @example
   * ```ts
   * import { Telegraf } from "telegraf";
   * import { MemoryDurability } from "@botmesh/durable";
   * import { durable } from "@botmesh/durable/telegraf";
   *
   * const bot = new Telegraf("123:fake-token");
   * const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
   * bot.on("text", async (ctx) => {
   *   const answer = await safe.step("llm", async ({ idempotencyKey }) => {
   *     // e.g. fetch("https://llm.example/v1/chat", { headers: { "Idempotency-Key": idempotencyKey }, … })
   *     return `You said: ${ctx.message.text}`;
   *   });
   *   await ctx.reply(answer); // a rerun of the update is answered from the outbox too
   * });
   * ```
   *
   * @param name the step's name, once per update
   * @param fn the step: its result must be JSON
   * @param options `key`, `idempotent`, `retries`
   * @returns the step's result as journaled (its JSON round trip)
   * @throws {Error} when called outside the middleware of an update of this bot
   * @throws {StepFailedError} when the step failed for good (now or on an earlier run)
   * @throws {StepAmbiguousError} when an earlier run may have had its effect and the step is not idempotent
   */
  step<T>(name: string, fn: (call: StepCall) => T | Promise<T>, options?: StepOptions): Promise<Awaited<T>> {
    return this.core.step(name, fn, options);
  }

  /** Resolve when every admitted update is handled (or dead-lettered) and every send settled. */
  async idle(): Promise<void> {
    await Promise.allSettled(this.#admission.underWay());
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
      await this.#admission.stoppingPolls(async () => {
        bot.stop("durable stop");
        // The aborted getUpdates, then the one Telegraf confirms the offset with.
        for (let i = 0; i < 2; i++) {
          await Promise.allSettled([...this.#polls, ...this.#admission.underWay()]);
          await new Promise((resolve) => setTimeout(resolve, 0));
        }
        await Promise.allSettled([...this.#polls]);
      });
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

  /** Admit an update; a webhook is answered 200 once it is journaled, 500 when it is not. */
  async #admit(update: unknown, webhookResponse: unknown): Promise<void> {
    const response = isResponse(webhookResponse) ? webhookResponse : undefined;
    try {
      await this.#admission.admit(update, response !== undefined);
    } catch (error) {
      if (response === undefined) throw error;
      // Telegraf's webhookCallback does not catch what handleUpdate throws, so it is answered here:
      // Telegram delivers the update again.
      if (response.writableEnded === false) {
        if (response.headersSent !== true) response.statusCode = 500;
        response.end();
      }
      return;
    }
    if (response?.writableEnded === false) response.end();
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
      const poll = (async () => {
        try {
          return await direct(method, await this.#admission.beforePoll(payload, options.signal), options);
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
        if (failure !== undefined && this.#runs.current()?.rerun === true && isAlreadyDone(method, failure)) return true;
        throw error;
      }
    }
    const chat = isObj(payload) ? journalChatOf(payload) : undefined;
    if (chat === undefined || this.#starting === undefined || this.#coreStopped) return direct(method, payload, options);
    await this.#starting;
    const answer = await sendJournaled(this.core, this.#provider, chat, method, payload, () => this.#stopped);
    // Telegraf's call resolves with the result, or throws its TelegramError.
    if (!answer.ok) throw new (this.#errorClass ?? TelegrafApiError)(answer, { method, payload });
    return answer.result;
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
