/**
 * A BuilderBot provider on this library's WhatsApp Cloud API provider: the
 * webhook journals each message before Meta gets its 200, drops Meta's
 * redeliveries, and runs BuilderBot's flows for it from the durable inbox
 * (one message at a time per chat, under a lease, again after a crash); the
 * answers go through the outbox, keyed `<inbound id>:<n>`. The flow position
 * (BuilderBot's history: `getPrevByNumber`) and the per-user `state` are kept
 * in a session store and take effect with the message's done mark.
 *
 * This module loads `@builderbot/bot` (its `ProviderClass`, and `utils` for
 * its custom events): BuilderBot's `createBot` takes as its provider only a
 * subclass of it (its private and protected members make the type nominal),
 * and the HTTP server that `httpServer(port)` starts, with the routes a bot
 * adds to `provider.server`, is that class's.
 *
 * @module
 */
import { ProviderClass, utils } from "@builderbot/bot";
import { Bot, type Context } from "../../src/bot.ts";
import type { Clock } from "../../src/clock.ts";
import type { DurabilityOptions } from "../../src/config.ts";
import type { JsonValue } from "../../src/contract.ts";
import { type LoadedMedia, loadMediaOf } from "../../src/media.ts";
import type { InboundMessage, InboundSink, Provider } from "../../src/provider.ts";
import { randomId } from "../../src/runtime/mod.ts";
import { type AsyncContext, createAsyncContext } from "../../src/runtime/async_context.ts";
import { writeFileAtomic } from "../../src/runtime/fs.ts";
import type { BotEvents, DurabilityControl, SendResult } from "../../src/engine.ts";
import { checkKnownOptions } from "../../src/options.ts";
import { nodeHandler } from "../../src/ops/node_handler.ts";
import { showValue as show } from "../../src/show.ts";
import type { SessionStore } from "../../src/store.ts";
import { checkStorageArguments, DurableStorage, type StorageRun } from "../grammy/storage.ts";
import { isObj } from "../telegram/values.ts";
import type { WhatsAppProviderOptions } from "../whatsapp/options.ts";
import { WhatsAppProvider } from "../whatsapp/provider.ts";
import { builderBotMessage, whatsAppContent } from "./messages.ts";
import { type FlowClassLike, StableRefs } from "./refs.ts";

/** Options of {@link DurableMetaProvider}. */
export interface DurableMetaProviderOptions {
  /** The WhatsApp Cloud API: `accessToken`, `phoneNumberId`, `appSecret`, `verifyToken`, … */
  whatsapp: WhatsAppProviderOptions;
  /** The durable inbox and outbox (required): a backend and an instanceId. */
  durability: DurabilityOptions;
  /**
   * Where the flow position (BuilderBot's history) and the per-user `state` are kept: a
   * `SessionStore` (`SQLiteStore`, `PostgresStore`, `RedisStore`, `FileStore`, `MemoryStore`, …),
   * usually the one whose `durability()` is the backend.
   */
  store: SessionStore;
  /** Prefix of the store's keys (default `"builderbot:"`): `<prefix>prev:<chat>`, `<prefix>state:<chat>`. */
  keyPrefix?: string;
  /** Each write of the store expires after this many ms (default: never). */
  ttlMs?: number;
  /**
   * How long a message's handling must be quiet (no send or history write of BuilderBot's under way)
   * before it counts as handled, in ms (default 20): BuilderBot does not wait for everything it starts
   * (`endFlow`'s message, say).
   */
  settleMs?: number;
  /** The path of the webhook on the server `bot.httpServer(port)` starts (default `"/webhook"`). */
  webhookPath?: string;
  /** BuilderBot's `name` of the provider (default `"bot"`). */
  name?: string;
  /** The port of `bot.httpServer(port)` (BuilderBot sets it). */
  port?: number;
  /** The id of the durability core, part of the default instanceId (default `"builderbot"`). */
  id?: string;
  /** Time and timers of the durability core (tests). */
  clock?: Clock;
}

/** What the provider uses of BuilderBot's bot (`CoreClass`, what `createBot` resolves to). */
export interface BuilderBotLike {
  provider: unknown;
  database: unknown;
  flowClass: FlowClassLike;
  stateHandler: unknown;
}

type StateValue = Record<string, unknown>;

/** A message being handled: its journal record, its chat, and what BuilderBot did while handling it. */
interface Run extends StorageRun {
  readonly ctx: Context;
  readonly from: string;
  readonly storage: DurableStorage<JsonValue>;
  /** BuilderBot's sends and history writes under way. */
  readonly pending: Set<Promise<unknown>>;
  /** Counts every send, write and state change: the run is quiet once it stops moving. */
  activity: number;
  /** The last step of the chat's history (as stored: stable names), `undefined` for none. */
  prev: JsonValue | undefined;
  prevChanged: boolean;
  stateChanged: boolean;
  /** The dispatches made by the run so far (their ids are `<run id>:dispatch:<n>`). */
  dispatches: number;
}

/** The BuilderBot database (`createBot({ database })`) of a {@link DurableMetaProvider}: see `provider.database`. */
export class DurableBuilderBotDatabase {
  /**
   * BuilderBot's `MemoryDB` keeps every step here; this database keeps only each chat's last step
   * (what `getPrevByNumber` answers), in the store: this list stays empty.
   */
  listHistory: unknown[] = [];
  readonly #host: DurableMetaProvider;

  /** @param host the provider whose store keeps the history */
  constructor(host: DurableMetaProvider) {
    this.#host = host;
  }

  /**
   * The last step BuilderBot saved for `from` that names a keyword (its flow position).
   *
   * @param from the chat
   * @returns the step, `undefined` for none
   */
  getPrevByNumber(from: string): Promise<unknown> {
    return this.#host.prevOf(from);
  }

  /**
   * Save a step of BuilderBot's: one that names a keyword becomes the chat's flow position, with
   * the done mark of the message being handled.
   *
   * @param ctx the step (`from` names the chat)
   */
  save(ctx: unknown): Promise<void> {
    return this.#host.savePrev(ctx);
  }
}

/**
 * BuilderBot's per-user `state` (its `SingleState`, `bot.stateHandler`) kept in the store: set by
 * {@link DurableMetaProvider.attach}. Each message's handling reads the chat's state from the store
 * first; what the flow changes is written with the message's done mark. Values must be JSON.
 */
export class DurableBuilderBotState {
  /** Each chat's state, as BuilderBot's `SingleState` keeps it. */
  readonly STATE: Map<string, StateValue> = new Map();
  readonly #host: DurableMetaProvider;

  /** @param host the provider whose store keeps the state */
  constructor(host: DurableMetaProvider) {
    this.#host = host;
  }

  updateState: (ctx?: { from: string }) => (keyValue: StateValue) => Promise<void> = (ctx = { from: "" }) => (keyValue) => {
    return this.#host.changeState(ctx.from, keyValue);
  };

  getMyState: (from: string) => () => StateValue | undefined = (from) => () => this.STATE.get(from);

  get: (from: string) => (prop: string) => unknown = (from) => (prop) => {
    let result: unknown = this.STATE.get(from);
    if (result === undefined) return undefined;
    for (const property of prop.split(".")) {
      result = (result as Record<string, unknown>)[property];
      if (result === undefined) return undefined;
    }
    return result;
  };

  getAllState: () => IterableIterator<StateValue> = () => this.STATE.values();

  clear: (from: string) => () => boolean = (from) => () => {
    const had = this.STATE.has(from);
    void this.#host.changeState(from, null).catch(() => {});
    return had;
  };

  clearAll: () => void = () => {
    for (const from of [...this.STATE.keys()]) void this.#host.changeState(from, null).catch(() => {});
  };

  /** Set what the store holds for `from` (a message's handling starts). */
  load(from: string, value: JsonValue | undefined): void {
    if (isObj(value)) this.STATE.set(from, value as StateValue);
    else this.STATE.delete(from);
  }
}

/** A JSON copy of a state value (what the store can keep): functions and `undefined` left out. */
function jsonOf(value: unknown): JsonValue | undefined {
  if (value === undefined) return undefined;
  return JSON.parse(JSON.stringify(value)) as JsonValue;
}

/** WhatsApp types provider-meta does not give the flows (their body is empty). */
const IGNORED_TYPES = new Set(["reaction", "system", "unsupported"]);

/** The type of an inbound record of BuilderBot's `dispatch`. */
const DISPATCH_TYPE = "builderbot-dispatch";

/**
 * The name of a custom event body (`utils.setEvent(name)`: `_event_custom_<name>_`, encrypted with a
 * key BuilderBot makes at each start), `undefined` for any other body. Only what looks like its output
 * (base64 of hex) is decrypted: BuilderBot's `decryptData` logs every failure.
 */
export function customEventOf(body: string): string | undefined {
  if (body.length < 24 || body.length > 4096 || !/^[A-Za-z0-9+/]+={0,2}$/.test(body)) return undefined;
  let hex: string;
  try {
    hex = atob(body);
  } catch {
    return undefined;
  }
  if (hex.length % 32 !== 0 || !/^[0-9a-f]+$/.test(hex)) return undefined;
  const plain = utils.decryptData(body);
  return plain.startsWith("_event_custom_") ? plain : undefined;
}

/** The context BuilderBot gets for a journaled `dispatch`: what was dispatched, its event encrypted with this process's key. */
function dispatchedMessage(message: InboundMessage): Record<string, unknown> {
  const extra = isObj(message.extra) ? message.extra : {};
  const text = message.text ?? "";
  return {
    ...(isObj(extra.payload) ? extra.payload : {}),
    from: message.chatId,
    body: extra.custom === true ? utils.encryptData(text) : text,
    inbound: message,
  };
}

/** A polka request, as the webhook middleware reads it. */
interface PolkaRequest {
  method?: string;
  url?: string;
  path?: string;
}

/**
 * A BuilderBot provider for the WhatsApp Cloud API whose messages survive a
 * crash: pass it as `createBot({ provider })`, its {@link database} as
 * `createBot({ database })`, then call {@link attach} with the bot and
 * {@link start}. See docs/builderbot.md.
 */
export class DurableMetaProvider extends ProviderClass<WhatsAppProvider> {
  globalVendorArgs: { name?: string; port?: number; writeMyself?: "none" | "host" | "both"; webhookPath: string };
  /** The WhatsApp Cloud API provider the journal receives from and sends through. */
  readonly whatsapp: WhatsAppProvider;
  /** The durability core: the inbox and outbox BuilderBot's flows now run on. */
  readonly core: Bot;
  /** The database to give `createBot`: the flow position, in the store. */
  readonly database: DurableBuilderBotDatabase;
  /** BuilderBot's `state`, in the store: {@link attach} puts it on the bot. */
  readonly state: DurableBuilderBotState;
  /** The Web-standard webhook (`Bun.serve({ fetch })`, `Deno.serve`), also served by `bot.httpServer(port)` at `webhookPath`. */
  readonly webhook: (request: Request) => Promise<Response>;
  readonly #store: SessionStore;
  readonly #prefix: string;
  readonly #ttlMs: number | undefined;
  readonly #settleMs: number;
  /** The message being handled in each chat (the inbox runs one at a time per chat). */
  readonly #runs = new Map<string, Run>();
  #refs: StableRefs | undefined;
  #starting: Promise<void> | undefined;
  /** Writes made outside any message's handling (an HTTP route's `state.update`), under way. */
  readonly #loose = new Set<Promise<unknown>>();
  /** The core's inbound sink, once started: BuilderBot's dispatched events are journaled through it. */
  #sink: InboundSink | undefined;
  #stopping = false;
  /** The run a call descends from (`null`: the runtime has no async context; the chat's run is used then). */
  #context: AsyncContext<Run> | null | undefined;
  readonly #contextReady: Promise<void>;
  /** Each chat's state writes made outside any handling, one after the other. */
  readonly #stateChains = new Map<string, Promise<void>>();

  /**
   * @param options `whatsapp`, `durability` and `store` (required); `keyPrefix`, `ttlMs`, `settleMs`,
   *   `webhookPath`, `name`, `port`, `id`, `clock`
   * @throws {TypeError} when an option is missing, unknown or of the wrong type
   */
  constructor(options: DurableMetaProviderOptions) {
    super();
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`Argument "options" of DurableMetaProvider must be an object, got ${show(options)}`);
    }
    checkKnownOptions(options, ["whatsapp", "durability", "store", "keyPrefix", "ttlMs", "settleMs", "webhookPath", "name", "port", "id", "clock"]);
    if (options.durability === undefined) throw new TypeError(`Option "durability" is required: a backend and an instanceId`);
    if (!isObj(options.whatsapp)) throw new TypeError(`Option "whatsapp" is required: the WhatsApp Cloud API options, got ${show(options.whatsapp)}`);
    this.#ttlMs = checkStorageArguments(options.store, options.ttlMs === undefined ? undefined : { ttlMs: options.ttlMs });
    this.#store = options.store;
    const prefix = options.keyPrefix ?? "builderbot:";
    if (typeof prefix !== "string") throw new TypeError(`Option "keyPrefix" must be a string, got ${show(prefix)}`);
    this.#prefix = prefix;
    const settle = options.settleMs ?? 20;
    if (typeof settle !== "number" || !(settle >= 0) || !Number.isFinite(settle)) {
      throw new TypeError(`Option "settleMs" must be a non-negative number, got ${show(settle)}`);
    }
    if (settle > 2 ** 31 - 1) throw new RangeError(`Option "settleMs" must be at most ${2 ** 31 - 1} (a timer's limit), got ${settle}`);
    this.#settleMs = settle;
    const path = options.webhookPath ?? "/webhook";
    if (typeof path !== "string" || !path.startsWith("/")) throw new TypeError(`Option "webhookPath" must be a path starting with "/", got ${show(path)}`);
    if (options.name !== undefined && (typeof options.name !== "string" || options.name === "")) {
      throw new TypeError(`Option "name" must be a non-empty string, got ${show(options.name)}`);
    }
    if (options.port !== undefined && (typeof options.port !== "number" || !Number.isInteger(options.port) || options.port < 0 || options.port > 65535)) {
      throw new TypeError(`Option "port" must be an integer from 0 to 65535, got ${show(options.port)}`);
    }
    this.globalVendorArgs = { name: options.name ?? "bot", writeMyself: "none", webhookPath: path };
    if (options.port !== undefined) this.globalVendorArgs.port = options.port;
    this.whatsapp = new WhatsAppProvider(options.whatsapp);
    this.webhook = this.whatsapp.webhook;
    this.core = new Bot({
      provider: this.#journalProvider(),
      durability: options.durability,
      id: options.id ?? "builderbot",
      ...(options.clock !== undefined ? { clock: options.clock } : {}),
    });
    this.database = new DurableBuilderBotDatabase(this);
    this.state = new DurableBuilderBotState(this);
    this.core.when(() => true, (ctx) => this.#handle(ctx));
    // BuilderBot's initAll hands routes `sendMessage: this.sendMessage`, unbound.
    this.sendMessage = this.sendMessage.bind(this);
    this.#contextReady = createAsyncContext<Run>().then((context) => {
      this.#context = context;
    });
  }

  /** The operator surface of the inbox and outbox (metrics, dead letters, replays). */
  get durability(): DurabilityControl {
    return this.core.durability!;
  }

  /**
   * Listen to an event of the durability core: `error`, `warning`, `durability:dead`, `durability:ambiguous`.
   * (BuilderBot's own provider events go through `on`.)
   *
   * @param event the event
   * @param listener the listener
   * @returns a function that removes the listener
   */
  onDurability<K extends keyof BotEvents & string>(event: K, listener: (payload: BotEvents[K]) => void): () => void {
    return this.core.on(event, listener);
  }

  /**
   * Tie the provider to the BuilderBot bot made with it (what `createBot` resolved to): the bot's
   * `state` becomes the durable one, and the flows' steps get the stable names the history is kept
   * under. Call it once, before {@link start}.
   *
   * @param bot BuilderBot's bot
   * @returns the bot
   * @throws {TypeError} when `bot` was not made with this provider and its database
   */
  attach<B extends BuilderBotLike>(bot: B): B {
    if (!isObj(bot) || !isObj(bot.flowClass) || !Array.isArray(bot.flowClass.flowSerialize)) {
      throw new TypeError(`Argument "bot" must be the bot createBot() resolved to, got ${show(bot)}`);
    }
    if (bot.provider !== this) throw new TypeError(`Argument "bot": it was made with another provider: createBot({ provider }) must be this one`);
    if (bot.database !== this.database) {
      throw new TypeError(`Argument "bot": its database is not this provider's: createBot({ database: provider.database }) keeps the flow position durable`);
    }
    if (this.#refs !== undefined) throw new TypeError(`Argument "bot": a bot is already attached to this provider`);
    this.#refs = new StableRefs(bot.flowClass, customEventOf);
    // BuilderBot reads `this.stateHandler` at each message: an own property of this bot, nothing global.
    bot.stateHandler = this.state;
    this.#wrapCallbacks(bot.flowClass as FlowClassLike & { allCallbacks?: unknown });
    return bot;
  }

  /**
   * Each step's callback of the bot counts, while it runs, as work of the handling it runs for, and so
   * do the `flowDynamic`, `endFlow`, `fallBack` and `gotoFlow` it calls (awaited or not: BuilderBot's
   * `delay` holds their sends back): the handling does not end before them, although BuilderBot's
   * queue timeout resolves `handleMsg` earlier.
   */
  #wrapCallbacks(flowClass: { allCallbacks?: unknown }): void {
    const callbacks = flowClass.allCallbacks;
    if (!isObj(callbacks)) return;
    const table = callbacks as Record<string, unknown>;
    for (const [ref, callback] of Object.entries(table)) {
      if (typeof callback !== "function") continue;
      table[ref] = (ctx: unknown, args: unknown) => {
        const from = isObj(ctx) && typeof ctx.from === "string" ? ctx.from : undefined;
        const run = from === undefined ? this.#currentRun() : (this.#runFor(from) ?? this.#currentRun());
        if (run === undefined || !isObj(args)) return (callback as (c: unknown, a: unknown) => unknown)(ctx, args);
        const tracked: Record<string, unknown> = { ...args };
        for (const name of ["flowDynamic", "endFlow", "fallBack", "gotoFlow"]) {
          const fn = args[name];
          if (typeof fn !== "function") continue;
          tracked[name] = (...a: unknown[]) => {
            const result = (fn as (...a: unknown[]) => unknown)(...a);
            if (result instanceof Promise) void this.#track(run, result).catch(() => {});
            return result;
          };
        }
        const result = (callback as (c: unknown, a: unknown) => unknown)(ctx, tracked);
        if (result instanceof Promise) void this.#track(run, result).catch(() => {});
        return result;
      };
    }
  }

  /**
   * Run recovery (messages a crash left half done run through the flows again) and take messages.
   * `bot.httpServer(port)` calls it; call it yourself when you serve {@link webhook} on your own
   * server. Calling it again returns the same promise.
   *
   * @returns resolves once started
   * @throws {Error} when no bot is attached yet
   */
  override start(): Promise<void>;
  /** @deprecated BuilderBot's `ProviderClass.start(vendor, cb)`, which starts its HTTP server: `bot.httpServer(port)` calls it. */
  override start(vendor: unknown, cb?: (arg?: unknown) => void): void;
  override start(vendor?: unknown, cb?: (arg?: unknown) => void): Promise<void> | void {
    if (vendor !== undefined) return super.start(vendor as never, cb as never);
    this.#starting ??= (async () => {
      if (this.#refs === undefined) {
        throw new Error("DurableMetaProvider: attach the bot first: provider.attach(await createBot({ flow, provider, database: provider.database }))");
      }
      await this.#contextReady;
      await this.core.start();
    })();
    return this.#starting;
  }

  /** Resolve when every admitted message is handled (or dead-lettered) and every send settled. */
  async idle(): Promise<void> {
    await this.core.idle();
    await Promise.allSettled([...this.#loose]);
  }

  /** Stop: the HTTP server of `bot.httpServer(port)` when it runs, then the core (messages under way finish). */
  override async stop(): Promise<void> {
    this.#stopping = true;
    const server = (this.server as unknown as { server?: { listening?: boolean; close(cb: (err?: Error) => void): void } }).server;
    if (server?.listening === true) await new Promise<void>((resolve) => server.close(() => resolve()));
    await this.#starting?.catch(() => {});
    await this.core.stop();
    await Promise.allSettled([...this.#loose]);
  }

  // ---- BuilderBot's ProviderClass ---------------------------------------------------

  /** Polka's app, with the webhook in front of its body parsers (the signature is over the raw body). */
  override buildHTTPServer(): ReturnType<ProviderClass["buildHTTPServer"]> {
    const app = super.buildHTTPServer();
    // Called by ProviderClass's constructor: the fields of this class are read per request only.
    let serve: ReturnType<typeof nodeHandler> | undefined;
    const webhook = (req: PolkaRequest, res: unknown, next: () => void): void => {
      const path = req.path ?? (req.url ?? "/").split("?")[0];
      if (path !== this.globalVendorArgs.webhookPath) return next();
      serve ??= nodeHandler((request) => this.webhook(request));
      void serve(req as never, res as never);
    };
    (app as unknown as { wares: unknown[] }).wares.unshift(webhook);
    return app;
  }

  protected beforeHttpServerInit(): void {}

  protected afterHttpServerInit(): void {}

  protected busEvents(): { event: string; func: () => void }[] {
    return [];
  }

  /** Starts the journal (called by `bot.httpServer(port)`); the vendor is the WhatsApp provider. */
  protected async initVendor(): Promise<WhatsAppProvider> {
    await this.start();
    return this.whatsapp;
  }

  /**
   * Send through the outbox. Called while a message of the chat is handled (BuilderBot's answers,
   * `flowDynamic`, `endFlow`, `fallBack`), the send is that message's: keyed `<inbound id>:<n>`, and
   * answered from the outbox when the message runs again after a crash. Otherwise it is journaled
   * with a random key (retried, not de-duplicated across a restart).
   *
   * @param userId the chat (the phone number)
   * @param message the text
   * @param args BuilderBot's step (`options.media`: an http(s) URL; `options.buttons`: up to 3), or `{ media, buttons }`
   * @returns what happened to the send (`state`: `sent`, `queued`, `failed`, `dead`, …)
   */
  async sendMessage<K = SendResult>(userId: string, message: unknown, args?: unknown): Promise<K> {
    const content = whatsAppContent(message, args);
    const run = this.#runFor(userId);
    if (run !== undefined) return await this.#track(run, run.ctx.send(userId, content)) as K;
    // Another chat (an admin notified from a flow), or outside any handling: the core keys the send
    // by the handler the call descends from, if any; the run waits for it all the same.
    const current = this.#currentRun();
    const sent = this.core.send(userId, content);
    return await (current !== undefined ? this.#track(current, sent) : sent) as K;
  }

  /**
   * The media of a message BuilderBot's flow got (an image, a voice note, a document: its `ctx`),
   * downloaded again through the Graph API, on the first run or on a rerun after a crash.
   *
   * @param ctx the context BuilderBot's callback got
   * @returns the bytes and the MIME type
   * @throws {MediaUnavailableError} when the message has no media or Meta no longer has it (about 30 days)
   */
  async loadMedia(ctx: { inbound?: InboundMessage }): Promise<LoadedMedia> {
    if (!isObj(ctx) || !isObj(ctx.inbound)) throw new TypeError(`Argument "ctx" must be the context of a message of this provider, got ${show(ctx)}`);
    return (await loadMediaOf({ message: ctx.inbound, bot: this.core }, { throwOnError: true }))!;
  }

  /**
   * BuilderBot's `saveFile`: the media of the message (see {@link loadMedia}) written to a file in
   * `options.path` (default: the working directory), named after its wamid.
   *
   * @param ctx the context BuilderBot's callback got
   * @param options `path`: the folder
   * @returns the file's path
   */
  async saveFile(ctx: unknown, options?: { path: string }): Promise<string> {
    const media = await this.loadMedia(ctx as { inbound?: InboundMessage });
    const inbound = (ctx as { inbound: InboundMessage }).inbound;
    const ext = /\/([a-z0-9.+-]+)/i.exec(media.mimeType?.split(";")[0] ?? "")?.[1]?.replace(/^(x-|vnd\.)/, "") ?? "bin";
    const name = `${inbound.id.replace(/[^A-Za-z0-9_-]/g, "_").slice(-64)}.${ext}`;
    const file = `${(options?.path ?? ".").replace(/\/+$/, "")}/${name}`;
    await writeFileAtomic(file, media.data);
    return file;
  }

  /**
   * BuilderBot's `emit`. A `message` it emits itself (`dispatch` from an HTTP route, `dispatchInside`) is
   * journaled in the inbox like a WhatsApp message, and runs the flows from there, keyed
   * `bb-dispatch:<id>:<n>`; when the journal refuses it (or before `start()`), it runs at once, as in
   * BuilderBot.
   */
  override emit(...args: Parameters<ProviderClass["emit"]>): void {
    const [event, payload] = args as unknown as [string, unknown];
    if (event !== "message" || this.#sink === undefined || this.#stopping || !isObj(payload) || typeof payload.from !== "string" || payload.from === "") {
      return super.emit(...args);
    }
    const run = this.#currentRun();
    const admitted = this.#journalDispatched(payload as { from: string }, run !== undefined ? this.#dispatchId(run) : undefined);
    if (run !== undefined) void this.#track(run, admitted).catch(() => {});
    this.#loose.add(admitted);
    admitted.then(() => this.#loose.delete(admitted), () => {
      this.#loose.delete(admitted);
      super.emit(...args); // not journaled: run it now, as BuilderBot would have
    });
  }

  /**
   * BuilderBot's `dispatch(event, payload)` (what an HTTP route's `bot.dispatch` does), resolving once
   * the event is journaled: answer the request only then, and a crash cannot lose it. The flow of
   * `addKeyword(utils.setEvent(event))` runs from the inbox, its sends keyed `bb-dispatch:<id>:<n>`.
   *
   * With `options.id` (the request's own id, say), a second dispatch of the same id is dropped as a
   * duplicate, as a redelivered WhatsApp message is: give one when the caller may retry the request.
   *
   * @param event the custom event's name
   * @param payload `from` (the chat: a phone number, `+` and spaces dropped) and `name`, and anything else the flow reads in `ctx`
   * @param options `id`: the event's id (the record is `bb-dispatch:<id>`); a random one when omitted
   * @returns `"duplicate"` when an event of that id was journaled already, else `"admitted"`
   * @throws {Error} when the provider is not started or the journal refuses it
   */
  async dispatch(
    event: string,
    payload: { from: string; name?: string; [key: string]: unknown },
    options: { id?: string } = {},
  ): Promise<"admitted" | "duplicate"> {
    if (typeof event !== "string" || event === "") throw new TypeError(`Argument "event" must be a non-empty string, got ${show(event)}`);
    if (!isObj(payload) || typeof payload.from !== "string" || payload.from === "") {
      throw new TypeError(`Argument "payload" must be an object with "from" (the chat), got ${show(payload)}`);
    }
    const id = options.id;
    if (id !== undefined && (typeof id !== "string" || id === "" || id.length > 400)) {
      throw new TypeError(`Option "id" must be a non-empty string of at most 400 characters, got ${show(id)}`);
    }
    const run = id === undefined ? this.#currentRun() : undefined;
    const work = this.#journalDispatched(
      { ...payload, body: utils.setEvent(event), from: utils.removePlus(payload.from) },
      id ?? (run !== undefined ? this.#dispatchId(run) : undefined),
    );
    return await (run !== undefined ? this.#track(run, work) : work);
  }

  /** The id of a dispatch made by `run`: the same on a rerun of the handling, so the rerun's is a duplicate. */
  #dispatchId(run: Run): string {
    return `${run.id}:dispatch:${++run.dispatches}`;
  }

  async #journalDispatched(payload: { from: string; body?: unknown }, id: string = randomId()): Promise<"admitted" | "duplicate"> {
    const sink = this.#sink;
    if (sink === undefined || this.#stopping) throw new Error("DurableMetaProvider is not started (or is stopping): the event was not journaled");
    const body = typeof payload.body === "string" ? payload.body : "";
    const custom = customEventOf(body);
    const rest: Record<string, unknown> = { ...payload };
    delete rest.body;
    delete rest.from;
    const message: InboundMessage = {
      id: `bb-dispatch:${id}`,
      chatId: payload.from,
      type: DISPATCH_TYPE,
      text: custom ?? body,
      extra: { custom: custom !== undefined, payload: jsonOf(rest) ?? {} },
    };
    const result = await sink.receive(message);
    if (result.status === "rejected") throw result.error;
    // "unjournaled" (inbox.failOpen): processed without the journal, as the webhook's messages then are.
    return result.status === "duplicate" ? "duplicate" : "admitted";
  }

  /** The WhatsApp provider as the core sees it: the same, but that its inbound sink is kept for `dispatch`. */
  #journalProvider(): Provider {
    const wa = this.whatsapp;
    return {
      name: wa.name,
      connectionId: wa.connectionId,
      rateLimits: wa.rateLimits,
      start: (sink) => {
        this.#sink = sink;
        return wa.start(sink);
      },
      stop: () => {
        this.#sink = undefined;
        return wa.stop();
      },
      send: (chatId, content, context) => wa.send(chatId, content, context),
      classifyError: (error) => wa.classifyError(error),
      loadMedia: (media, context) => wa.loadMedia(media, context),
    };
  }

  // ---- the history and the state ----------------------------------------------------

  #key(kind: "prev" | "state", from: string): string {
    return `${this.#prefix}${kind}:${from}`;
  }

  #storage(run: StorageRun | undefined): DurableStorage<JsonValue> {
    return new DurableStorage<JsonValue>(this.#store, {
      current: () => run,
      stateOf: async (id) => (await this.core.durability!.inbox.get(id))?.state ?? null,
    }, this.#ttlMs);
  }

  /** @internal {@link DurableBuilderBotDatabase.getPrevByNumber} */
  async prevOf(from: string): Promise<unknown> {
    const refs = this.#refs;
    const run = this.#runFor(String(from));
    const stored = run !== undefined ? run.prev : await this.#storage(undefined).read(this.#key("prev", String(from)));
    if (stored === undefined || stored === null) return undefined;
    return refs === undefined ? structuredClone(stored) : refs.decode(stored);
  }

  /** @internal {@link DurableBuilderBotDatabase.save} */
  async savePrev(ctx: unknown): Promise<void> {
    if (!isObj(ctx) || !ctx.keyword || typeof ctx.from !== "string") return; // not a flow position (MemoryDB's rule)
    const encoded = (this.#refs?.encode(ctx) ?? jsonOf(ctx)) as JsonValue;
    const run = this.#runFor(ctx.from);
    if (run !== undefined) {
      run.activity++;
      run.prev = encoded;
      run.prevChanged = true;
      return;
    }
    await this.#loosely(this.#storage(undefined).write(this.#key("prev", ctx.from), encoded));
  }

  /**
   * @internal a change of the state of `from` ({@link DurableBuilderBotState}): `keyValue` merged in,
   * or `null` to clear it. Within the chat's handling it changes the memory, written with the done
   * mark; outside (an HTTP route's `state(number).update`) it is merged into what the store holds,
   * written at once, and the memory becomes that.
   */
  changeState(from: string, keyValue: StateValue | null): Promise<void> {
    const run = this.#runFor(from);
    if (run !== undefined) {
      if (keyValue === null) this.state.STATE.delete(from);
      else this.state.STATE.set(from, { ...this.state.STATE.get(from), ...keyValue });
      run.activity++;
      run.stateChanged = true;
      return Promise.resolve();
    }
    const storage = this.#storage(undefined);
    const key = this.#key("state", from);
    const previous = this.#stateChains.get(from) ?? Promise.resolve();
    const work = previous.catch(() => {}).then(async () => {
      let value: JsonValue | undefined;
      if (keyValue === null) {
        await storage.delete(key);
      } else {
        const stored = await storage.read(key);
        value = jsonOf({ ...(isObj(stored) ? stored : {}), ...keyValue });
        await storage.write(key, value!);
      }
      // A handling of the chat under way keeps its own copy; it gets the change too.
      const running = this.#runs.get(from);
      if (running !== undefined) {
        if (value === undefined) this.state.STATE.delete(from);
        else this.state.STATE.set(from, { ...this.state.STATE.get(from), ...keyValue });
      } else {
        this.state.load(from, value);
      }
    });
    this.#stateChains.set(from, work);
    const forget = () => {
      if (this.#stateChains.get(from) === work) this.#stateChains.delete(from);
    };
    work.then(forget, forget);
    return this.#loosely(work);
  }

  /** The handling the caller descends from, if any (`undefined` without an async context). */
  #currentRun(): Run | undefined {
    const run = this.#context?.get();
    return run !== undefined && this.#runs.get(run.from) === run ? run : undefined;
  }

  /**
   * The handling a send, history write or state change for `chat` belongs to: the one the caller
   * descends from, when it handles `chat`. Where the runtime has no async context, the handling of
   * `chat` under way, if any.
   */
  #runFor(chat: string): Run | undefined {
    if (this.#context === null || this.#context === undefined) return this.#runs.get(chat);
    const run = this.#currentRun();
    return run !== undefined && run.from === chat ? run : undefined;
  }

  #loosely(work: Promise<void>): Promise<void> {
    this.#loose.add(work);
    work.then(() => this.#loose.delete(work), (error) => {
      this.#loose.delete(work);
      this.emit("notice", { title: "durable store write failed", instructions: [String(error)] });
    });
    return work;
  }

  #track<T>(run: Run, work: Promise<T>): Promise<T> {
    run.activity++;
    run.pending.add(work);
    const done = () => {
      run.pending.delete(work);
      run.activity++;
    };
    work.then(done, done);
    return work;
  }

  // ---- a journaled message through BuilderBot's flows ---------------------------------

  async #handle(ctx: Context): Promise<void> {
    const from = ctx.chatId;
    const run: Run = {
      id: ctx.message.id,
      ctx,
      from,
      storage: undefined as unknown as DurableStorage<JsonValue>,
      pending: new Set(),
      activity: 0,
      prev: undefined,
      prevChanged: false,
      stateChanged: false,
      dispatches: 0,
    };
    (run as { storage: DurableStorage<JsonValue> }).storage = this.#storage(run);
    // What the chat's earlier messages left (a rerun of this one sees the values from before it).
    const [prev, state] = await Promise.all([run.storage.read(this.#key("prev", from)), run.storage.read(this.#key("state", from))]);
    run.prev = prev;
    this.state.load(from, state);
    this.#runs.set(from, run);
    let committed: JsonValue | undefined = state;
    let ok = false;
    try {
      const payload = ctx.message.type === DISPATCH_TYPE ? dispatchedMessage(ctx.message) : builderBotMessage(ctx.message, this.whatsapp.phoneNumberId);
      // A reaction, a system message, an unsupported one: not for the flows (as provider-meta).
      if (payload.body === "" && IGNORED_TYPES.has(String(payload.type))) {
        ok = true;
        return;
      }
      // BuilderBot's core listens to "message" (handleMsg): each listener is called and awaited here,
      // where the provider's emit would not wait for it, under the run (what it sends is the run's).
      const emitter = (this as unknown as { emitter: { listeners(event: string): ((...args: unknown[]) => unknown)[] } }).emitter;
      const listen = () => Promise.all(emitter.listeners("message").map((listener) => listener(payload)));
      await (this.#context ? this.#context.run(run, listen) : listen());
      await this.#settle(run);
      const writes: Promise<void>[] = [];
      if (run.prevChanged) {
        writes.push(run.prev === undefined ? run.storage.delete(this.#key("prev", from)) : run.storage.write(this.#key("prev", from), run.prev));
      }
      let value = committed;
      if (run.stateChanged) {
        value = jsonOf(this.state.STATE.get(from));
        writes.push(value === undefined ? run.storage.delete(this.#key("state", from)) : run.storage.write(this.#key("state", from), value));
      }
      await Promise.all(writes);
      committed = value;
      ok = true;
    } finally {
      this.#runs.delete(from);
      // The memory holds only committed values: a failed (or dead-lettered) handling's changes are dropped.
      if (ok) this.state.load(from, committed);
      else this.state.STATE.delete(from);
    }
  }

  /** Wait until BuilderBot has nothing under way for the run and stayed so for `settleMs`. */
  async #settle(run: Run): Promise<void> {
    for (;;) {
      if (run.pending.size > 0) {
        await Promise.allSettled([...run.pending]);
        continue;
      }
      const mark = run.activity;
      await new Promise((resolve) => setTimeout(resolve, this.#settleMs));
      if (run.pending.size === 0 && run.activity === mark) return;
    }
  }
}
