/**
 * An existing grammY bot behind the durable inbox and outbox: its updates
 * are journaled before its middleware runs, its message-creating calls go
 * through the outbox.
 *
 * @module
 */
import type { ApiClientOptions, Bot as GrammyBot, Context as GrammyContext, Transformer } from "grammy";
import { Bot } from "../../src/bot.ts";
import type { Clock } from "../../src/clock.ts";
import type { DurabilityOptions } from "../../src/config.ts";
import type { BotEvents, DurabilityControl } from "../../src/engine.ts";
import { isStepOutcomeError, type StepCall, type StepOptions } from "../../src/engine/steps.ts";
import { checkKnownOptions } from "../../src/options.ts";
import { showValue as show } from "../../src/show.ts";
import { withoutToken } from "../telegram/redact.ts";
import { isObj, type Obj } from "../telegram/values.ts";
import { UpdateAdmission } from "./admission.ts";
import { sendJournaled } from "./answers.ts";
import { isJournaledMethod, journalChatOf } from "./methods.ts";
import { type GrammyCall, GrammyProvider } from "./provider.ts";
import { isAlreadyDone } from "./reruns.ts";
import { MiddlewareRuns } from "./runs.ts";
import type { SessionStore } from "../../src/store.ts";
import type { DurableStorageAdapter, DurableStorageOptions } from "./storage.ts";

/** Options of {@link durable}. */
export interface DurableGrammyOptions {
  /** The durable inbox and outbox (required): a backend and an instanceId. */
  durability: DurabilityOptions;
  /** The id of the durability core, part of the default instanceId (default `'grammy'`). */
  id?: string;
  /** Time and timers of the durability core (tests). */
  clock?: Clock;
}

/**
 * What the plugin uses of a grammY `Bot` (every grammY 1.x bot has it). Declared here rather than
 * imported, so that these declarations type-check without grammY's own.
 */
export interface GrammyBotLike {
  /** The bot's token. */
  readonly token: string;
  /** The bot's API: its transformers. */
  readonly api: {
    readonly config: {
      // deno-lint-ignore no-explicit-any
      use(...transformers: any[]): unknown;
      // deno-lint-ignore no-explicit-any
      installedTransformers(): any[];
    };
  };
  /** Runs the middleware for one update (the plugin replaces it with the journal's admission). */
  handleUpdate(update: { update_id: number }, webhookReplyEnvelope?: unknown): Promise<void>;
  /** Fetches the bot's info (`getMe`) once. */
  init(): Promise<void>;
  /** Whether `bot.start()` long polling runs. */
  isRunning(): boolean;
  /** Stops `bot.start()` long polling. */
  stop(): Promise<void>;
}

/**
 * The context flavor of {@link DurableGrammy.steps}: `ctx.step(name, fn, options?)` in grammY
 * middleware, a durable step of the update being handled (see {@link DurableGrammy.step}).
 */
export interface StepFlavor {
  /**
   * Run `fn` once for this update: its result (JSON) is journaled before the middleware goes on, and
   * a rerun of the update gets it back without calling `fn` again. See {@link DurableGrammy.step}.
   *
   * @param name the step's name, once per update
   * @param fn the step: its result must be JSON
   * @param options `key`, `idempotent`, `retries`
   * @returns the step's result as journaled (its JSON round trip)
   */
  step<T>(name: string, fn: (call: StepCall) => T | Promise<T>, options?: StepOptions): Promise<Awaited<T>>;
}

type GrammyInternals = GrammyBot<GrammyContext>;
/** A grammY middleware, as conversations v2 takes it in `plugins`. */
export type ConversationPlugin = (ctx: { api: object }, next: () => Promise<void>) => Promise<void>;
/** What the conversation plugin uses of a conversation context's `Api`. */
interface ConversationApi {
  readonly token: string;
  readonly options?: unknown;
  readonly config: { use(...transformers: Transformer[]): unknown; installedTransformers(): Transformer[] };
}

type HandleUpdate = GrammyInternals["handleUpdate"];

/**
 * grammY wraps what the middleware throws in a `BotError` (its `error`): a step's settled outcome
 * (`StepFailedError`, `StepAmbiguousError`) is handed to the core as itself, which dead-letters the
 * update at once instead of rerunning it to the same end.
 */
function unwrapStep(error: unknown): never {
  const inner = isObj(error) ? (error as { error?: unknown }).error : undefined;
  throw isStepOutcomeError(inner) ? inner : error;
}
type Update = Parameters<HandleUpdate>[0];
/** The grammY bots made durable (once each). */
const APPLIED = new WeakSet<object>();
/**
 * A grammY bot made crash-safe: see {@link durable}.
 */
export class DurableGrammy<B extends GrammyBotLike = GrammyBotLike> {
  /** The grammY bot. */
  readonly grammy: B;
  /** The durability core: the bot whose inbox and outbox the grammY bot now uses. */
  readonly core: Bot;
  readonly #provider: GrammyProvider;
  readonly #handleUpdate: HandleUpdate;
  #starting: Promise<void> | undefined;
  #stopped = false;
  /** Set once the core's `stop()` resolved: calls made from now on go straight to Telegram. */
  #coreStopped = false;
  readonly #admission: UpdateAdmission;
  readonly #runs = new MiddlewareRuns();

  /**
   * @param bot the grammY bot, with or without its middleware yet
   * @param options `durability` (required), `id`, `clock`
   * @throws {TypeError} when `bot` is not a grammY bot or is already durable, or an option is missing, unknown or of the wrong type
   */
  constructor(bot: B, options: DurableGrammyOptions) {
    const b = bot as unknown as Obj;
    if (!isObj(b) || typeof b.handleUpdate !== "function" || !isObj(b.api) || !isObj((b.api as Obj).config)) {
      throw new TypeError(`Argument "bot" must be a grammY Bot, got ${show(bot)}`);
    }
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`Options of durable() must be an object, got ${show(options)}`);
    }
    checkKnownOptions(options, ["durability", "id", "clock"]);
    if (APPLIED.has(bot)) throw new TypeError(`This grammY bot is already durable: call durable() once per bot`);
    if (options.durability === undefined) throw new TypeError(`Option "durability" is required: a backend and an instanceId`);
    this.grammy = bot;
    // The provider's calls go through the transformers installed so far (a throttler, say), not
    // through the outbox transformer installed below, nor anything installed after it.
    const below = bot.api.config.installedTransformers();
    const ApiClass = bot.api.constructor as new (token: string, config?: ApiClientOptions) => GrammyInternals["api"];
    const callApi = new ApiClass(bot.token, (bot as unknown as { clientConfig?: ApiClientOptions }).clientConfig);
    if (below.length > 0) callApi.config.use(...below);
    const call: GrammyCall = (method, payload, signal) =>
      (callApi.raw as unknown as Record<string, (p: Obj, s?: AbortSignal) => Promise<unknown>>)[method]!(payload, signal);
    this.#provider = new GrammyProvider(bot.token, call);
    this.core = new Bot({
      provider: this.#provider,
      durability: options.durability,
      id: options.id ?? "grammy",
      ...(options.clock !== undefined ? { clock: options.clock } : {}),
    });
    APPLIED.add(bot);
    this.#admission = new UpdateAdmission({
      provider: this.#provider,
      library: "grammY",
      stopped: () => this.#stopped,
      start: () => this.start(),
    });
    this.#handleUpdate = bot.handleUpdate as HandleUpdate;
    // A call the middleware makes directly throws grammY's own error to it (an HttpError may quote the
    // URL, the token in it); one the middleware lets through is journaled and reported without the token.
    const token = bot.token;
    this.#runs.route(this.core, (update) => withoutToken(token, () => this.#handleUpdate.call(bot, update as unknown as Update).catch(unwrapStep)));
    bot.api.config.use(this.#transformer);
    // grammY's handleUpdate from now on: resolves once the update is journaled (or a duplicate).
    bot.handleUpdate = (update, webhookReplyEnvelope) =>
      this.#admission.track(this.#admission.admit(update, webhookReplyEnvelope !== undefined));
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
   * Initialize the grammY bot (`bot.init()`), run recovery (updates a crash
   * left half done run through the middleware again), and take updates. The
   * first update grammY hands over starts it too; start it before
   * `bot.start()` or the webhook so that recovery does not wait for one.
   * Calling it again returns the same promise.
   *
   * @returns resolves once started
   */
  start(): Promise<void> {
    this.#starting ??= (async () => {
      await this.#runs.init();
      await this.grammy.init();
      await this.core.start();
    })();
    return this.#starting;
  }

  /**
   * A grammY storage adapter on `store` whose writes take effect with the update that makes them: see
   * {@link durableStorage}.
   *
   * @param store the session store (`SQLiteStore`, `PostgresStore`, `RedisStore`, `MemoryStore`, …)
   * @param options `ttlMs`: each write expires after that long
   * @returns the adapter, for `session({ storage })` or `conversations({ storage })`
   * @throws {TypeError} when `store` is not a session store, or an option is unknown or of the wrong type
   * @throws {RangeError} when `ttlMs` is not a positive number
   */
  storage<T = unknown>(store: SessionStore, options?: DurableStorageOptions): DurableStorageAdapter<T> {
    return this.#runs.storage<T>(this.core, store, options);
  }

  /**
   * The plugin that puts the calls of `@grammyjs/conversations` v2 through the outbox: pass it in
   * `plugins` of `conversations()` (or of `createConversation`). See {@link durableConversations}.
   *
   * @returns the conversation plugin (a grammY middleware)
   */
  conversationPlugin(): ConversationPlugin {
    return this.#conversationPlugin;
  }

  /**
   * Conversations v2 gives each context of a conversation an `Api` of its own, whose first transformer
   * answers the calls of replayed steps from the conversation's log and makes the others (a menu's
   * may follow). A transformer installed after it would see every call, replayed or not. The plugin
   * replaces that `Api` with one that has the same transformers on top of the outbox transformer: a
   * replayed call is answered from the log before it reaches the outbox; a call of the update being
   * handled reaches it, and is journaled under that update's key sequence.
   */
  readonly #conversationPlugin: ConversationPlugin = (ctx, next) => {
    const api = ctx.api as unknown as ConversationApi;
    const installed = api.config.installedTransformers();
    if (!installed.includes(this.#transformer)) {
      const ApiClass = api.constructor as new (token: string, options?: unknown) => ConversationApi;
      const own = new ApiClass(api.token, api.options);
      own.config.use(this.#transformer, ...installed);
      (ctx as { api: unknown }).api = own;
    }
    return next();
  };

  /**
   * A durable step of the update being handled: `fn` runs once for it, its result (JSON) journaled
   * in the outbox before the middleware goes on; a rerun of the update (after a crash, or a retry
   * after a throw) gets the journaled result back without calling `fn` again. A failure is retried
   * with backoff, then journaled for good (`StepFailedError`); a run cut off during `fn` is reported
   * (`durability:ambiguous`) and not run again (`StepAmbiguousError`) unless the step is
   * `idempotent`. Key `<inbound id>:step:<name>` unless `key` is given. Callable from any code the
   * middleware runs (it finds the update through the async context); inside a conversation, wrap it in
   * `conversation.external()`. See docs/steps.md.
   *
   * @example
   * ```ts
   * import { Bot } from "grammy";
   * import { MemoryDurability } from "@botmesh/durable";
   * import { durable } from "@botmesh/durable/grammy";
   *
   * const bot = new Bot("123:fake-token");
   * const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
   * bot.on("message:text", async (ctx) => {
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

  /**
   * A middleware that gives each context `ctx.step(name, fn, options?)`, the same as
   * {@link DurableGrammy.step}: `bot.use(safe.steps())`, with {@link StepFlavor} in the context type.
   *
   * @example
   * ```ts
   * import { Bot, type Context } from "grammy";
   * import { MemoryDurability } from "@botmesh/durable";
   * import { durable, type StepFlavor } from "@botmesh/durable/grammy";
   *
   * const bot = new Bot<Context & StepFlavor>("123:fake-token");
   * const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
   * bot.use(safe.steps());
   * bot.on("message:text", async (ctx) => {
   *   const answer = await ctx.step("llm", () => `You said: ${ctx.message.text}`);
   *   await ctx.reply(answer);
   * });
   * ```
   *
   * @returns the middleware
   */
  steps(): (ctx: object, next: () => Promise<void>) => Promise<void> {
    return (ctx, next) => {
      (ctx as StepFlavor).step = (name, fn, options) => this.core.step(name, fn, options);
      return next();
    };
  }

  /** Resolve when every admitted update is handled (or dead-lettered) and every send settled. */
  async idle(): Promise<void> {
    await Promise.allSettled(this.#admission.underWay());
    await this.core.idle();
  }

  /**
   * Stop: grammY's long polling (when `bot.start()` runs it), then the core,
   * which lets the updates under way finish. Stop `@grammyjs/runner` (its
   * handle's `stop()`) or the web server first.
   */
  async stop(): Promise<void> {
    if (this.#stopped) return;
    this.#stopped = true;
    if (this.grammy.isRunning()) await this.#admission.stoppingPolls(() => this.grammy.stop());
    await this.#starting?.catch(() => {});
    // Until the core is stopped, handlers still running journal their calls as before.
    try {
      await this.core.stop();
    } finally {
      this.#coreStopped = true;
    }
  }

  // ---- outbound --------------------------------------------------------------------

  readonly #transformer: Transformer = async (prev, method, payload, signal) => {
    if (method === "getUpdates") {
      return prev(method, (await this.#admission.beforePoll(payload as Obj, signal as AbortSignal | undefined)) as typeof payload, signal);
    }
    const p = payload as unknown as Obj;
    if (!isJournaledMethod(method)) {
      const response = await prev(method, payload, signal);
      // A rerun makes such calls again: one that fails only because the first run's took effect has succeeded.
      if (this.#runs.current()?.rerun === true && isAlreadyDone(method, response)) return { ok: true, result: true } as typeof response;
      return response;
    }
    const chat = isObj(p) ? journalChatOf(p) : undefined;
    if (chat === undefined || this.#starting === undefined || this.#coreStopped) {
      return prev(method, payload, signal);
    }
    await this.#starting;
    // grammY turns an error answer into a GrammyError itself.
    // deno-lint-ignore no-explicit-any
    return (await sendJournaled(this.core, this.#provider, chat, method, p, () => this.#stopped)) as any;
  };
}

/**
 * Make an existing grammY bot crash-safe: its updates are journaled in the
 * durable inbox before its middleware runs (acknowledged to Telegram only
 * then), a redelivered update is dropped, an update a crash left half done
 * runs through the middleware again after the restart, and the calls that
 * create messages (`ctx.reply`, `ctx.replyWith*`, `send*`, `forwardMessage(s)`,
 * `copyMessage(s)` on `ctx.api` and `bot.api`) go through the outbox, keyed
 * `<inbound id>:<n>`: a rerun gets their answers from the outbox instead of
 * sending again. Everything else (edits, callback answers, chat actions) is
 * called directly. Works with `bot.start()`, `webhookCallback` and
 * `@grammyjs/runner`; see docs/grammy.md.
 *
 * @example
 * ```ts ignore
 * import { Bot } from "grammy";
 * import { durable } from "@botmesh/durable/grammy";
 * import { SQLiteStore } from "@botmesh/durable/sqlite";
 *
 * const bot = new Bot(process.env.BOT_TOKEN!);
 * bot.on("message:text", (ctx) => ctx.reply(`You said: ${ctx.message.text}`));
 * const store = new SQLiteStore({ file: "bot.db" });
 * const safe = durable(bot, { durability: { backend: store.durability(), instanceId: "bot-1" } });
 * await safe.start(); // recovery first
 * bot.start();
 * ```
 *
 * @param bot the grammY bot
 * @param options `durability` (required), `id`, `clock`
 * @returns the handle: `start()`, `stop()`, `idle()`, `on()`, `durability`
 * @throws {TypeError} when `bot` is not a grammY bot, or an option is missing, unknown or of the wrong type
 */
export function durable<B extends GrammyBotLike>(bot: B, options: DurableGrammyOptions): DurableGrammy<B> {
  return new DurableGrammy(bot, options);
}

/**
 * A grammY storage adapter on a {@link SessionStore} your bot already has,
 * whose writes made while an update is handled take effect with that
 * update's done mark: use it as the `storage` of grammY's `session()` or of
 * `@grammyjs/conversations` v2. A rerun of an update (after a crash, or a
 * retry after a throw) sees the session as it was before the update; a
 * finished update's write is never lost; a dead-lettered update's write never
 * takes effect. Each value is stored as an envelope with the record that
 * wrote it and the value before it; a read costs one store read, plus one
 * inbox read the first time a record is seen done. See docs/grammy.md.
 *
 * @example
 * ```ts
 * import { Bot, type Context, session, type SessionFlavor } from "grammy";
 * import { MemoryDurability, MemoryStore } from "@botmesh/durable";
 * import { durable, durableStorage } from "@botmesh/durable/grammy";
 *
 * type MyContext = Context & SessionFlavor<{ likes: number }>;
 * const bot = new Bot<MyContext>("123:fake-token");
 * const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * bot.use(session({ initial: () => ({ likes: 0 }), storage: durableStorage(safe, new MemoryStore()) }));
 * bot.on("message:text", (ctx) => {
 *   ctx.session.likes++; // applied exactly once per update, even across a kill -9
 * });
 * ```
 *
 * @param safe the durable grammY bot ({@link durable}'s handle)
 * @param store the session store
 * @param options `ttlMs`: each write expires after that long
 * @returns the adapter
 * @throws {TypeError} when `safe` is not a durable grammY bot, `store` not a session store, or an option is unknown or of the wrong type
 * @throws {RangeError} when `ttlMs` is not a positive number
 */
export function durableStorage<T = unknown>(
  safe: DurableGrammy<GrammyBotLike>,
  store: SessionStore,
  options?: DurableStorageOptions,
): DurableStorageAdapter<T> {
  if (!(safe instanceof DurableGrammy)) {
    throw new TypeError(`Argument "safe" must be the durable grammY bot that durable() returns, got ${show(safe)}`);
  }
  return safe.storage<T>(store, options);
}

/**
 * The `@grammyjs/conversations` v2 plugin of a durable grammY bot: the calls a conversation makes
 * through its `ctx` go through the outbox like the bot's own. A step replayed from the conversation's
 * log is answered from that log and makes no call; a call made while an update is handled is journaled
 * under that update's keys, so a rerun of the update (after a crash, or a retry) is answered from the
 * outbox instead of sending again. Pass it in `plugins` of `conversations()`, with
 * {@link durableStorage} as its `storage`. See docs/grammy.md.
 *
 * @example
 * ```ts
 * import { Bot } from "grammy";
 * import { MemoryDurability, MemoryStore } from "@botmesh/durable";
 * import { durable, durableConversations, durableStorage } from "@botmesh/durable/grammy";
 *
 * const bot = new Bot("123:fake-token");
 * const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * // The options of conversations() of @grammyjs/conversations v2: bot.use(conversations(options))
 * const options = { storage: durableStorage(safe, new MemoryStore()), plugins: [durableConversations(safe)] };
 * ```
 *
 * @param safe the durable grammY bot ({@link durable}'s handle)
 * @returns the plugin (a grammY middleware)
 * @throws {TypeError} when `safe` is not a durable grammY bot
 */
export function durableConversations(safe: DurableGrammy<GrammyBotLike>): ConversationPlugin {
  if (!(safe instanceof DurableGrammy)) {
    throw new TypeError(`Argument "safe" must be the durable grammY bot that durable() returns, got ${show(safe)}`);
  }
  return safe.conversationPlugin();
}
