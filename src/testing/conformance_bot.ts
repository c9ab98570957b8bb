/**
 * The bot-level half of the conformance suite: the durability rules
 * (docs/guarantees.md) driven through a real `Bot` and a `MockProvider` on the
 * backend under test, and the crash matrix: for every crash point,
 * before and after, a bot dies there and a second bot on the same state
 * recovers.
 *
 * @module
 */
import { uid } from "./util.ts";
import { SuiteTime } from "./suite_time.ts";
import {
  DamagedRecordError,
  type DurabilityBackend,
  type InboxJournal,
  type JsonValue,
  type OutboxJournal,
  type RateLimiter,
  type ReserveOptions,
} from "../contract.ts";
import { loadMediaOf, MediaUnavailableError } from "../media.ts";
import { AskTimeoutError } from "../conversation.ts";
import { Bot as CoreBot, type BotOptions } from "../bot.ts";
import type { DurabilityOptions } from "../config.ts";
import type { BotEvents, DurabilityMetrics } from "../engine.ts";
import { ProviderError } from "../errors.ts";
import { MemoryRateLimiter } from "../rate_limit.ts";
import { ANY } from "../matchers.ts";
import { MemoryStore, type SessionStore } from "../store.ts";
import type {
  AdmitResult,
  InboundMessage,
  InboundSink,
  OutboundContent,
  Provider,
  SendContext,
  SendReceipt,
} from "../provider.ts";
import type { BackendConformanceOptions, ConformanceHarness } from "./conformance.ts";
import { CRASH_POINTS, crashable, CrashableProvider, crashableStore, type CrashPoint } from "./crashable.ts";
import { MockProvider as CoreMockProvider, type MockProviderOptions } from "./mock_provider.ts";
import { expectExactJson } from "./exact_json.ts";

type Expect = ConformanceHarness["expect"];
/** A bot (the suite's tests construct theirs on the test's clock; see `runBotConformance`). */
type Bot = CoreBot;
/** The base of the suite's providers. */
const MockProvider = CoreMockProvider;
type MockProvider = CoreMockProvider;

/** A MockProvider whose sends of chosen keys take `delayMs`, and that tells when a send started. */
class SlowKeysProvider extends MockProvider {
  readonly slowKeys = new Set<string>();
  readonly #delayMs: number;
  readonly #time: SuiteTime;
  readonly #started = new Map<string, () => void>();
  readonly #startedKeys = new Set<string>();
  constructor(delayMs: number, time: SuiteTime) {
    super();
    this.#delayMs = delayMs;
    this.#time = time;
  }
  /** Resolves once a send of `key` has started. */
  whenStarted(key: string): Promise<void> {
    if (this.#startedKeys.has(key)) return Promise.resolve();
    return new Promise((resolve) => this.#started.set(key, resolve));
  }
  override async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    this.#startedKeys.add(context.idempotencyKey);
    this.#started.get(context.idempotencyKey)?.();
    if (this.slowKeys.has(context.idempotencyKey)) await this.#time.sleep(this.#delayMs);
    return super.send(chatId, content, context);
  }
}

/** A MockProvider that also hands the bot a message exactly as given (JSON from a webhook, own `__proto__` keys and all). */
class RawProvider extends MockProvider {
  #sink: InboundSink | undefined;
  override start(sink: InboundSink): void {
    this.#sink = sink;
    super.start(sink);
  }
  deliver(message: InboundMessage): Promise<AdmitResult> {
    if (!this.#sink) throw new Error("RawProvider is not started: call bot.start() first");
    return this.#sink.receive(message);
  }
}

/** Fast settings for tests, scaled. */
export function fastDurability(backend: DurabilityBackend, scale: number, extra: Partial<DurabilityOptions> = {}): DurabilityOptions {
  const { inbox, outbox, ...rest } = extra;
  return {
    backend,
    instanceId: uid("inst"),
    sweepIntervalMs: Math.round(20 * scale),
    ...rest,
    inbox: { leaseMs: Math.round(300 * scale), retries: 3, backoff: { baseMs: 2, capMs: 10 }, ...inbox },
    outbox: { leaseMs: Math.round(300 * scale), retries: 3, backoff: { baseMs: 2, capMs: 10 }, ...outbox },
  } satisfies DurabilityOptions;
}

/** Every payload of `event` the bot emits from now on. */
export function collect<K extends keyof BotEvents & string>(bot: Bot, event: K): BotEvents[K][] {
  const seen: BotEvents[K][] = [];
  bot.on(event, (payload) => seen.push(payload));
  return seen;
}

/** A backend whose operations can be replaced one by one (to inject journal failures). */
function intercept(
  backend: DurabilityBackend,
  inbox: Partial<InboxJournal> = {},
  outbox: Partial<OutboxJournal> = {},
): DurabilityBackend {
  const wrap = <J extends object>(journal: J, overrides: Partial<J>): J =>
    new Proxy(journal, {
      get(target, prop, receiver) {
        if (prop in overrides) return (overrides as Record<PropertyKey, unknown>)[prop];
        const value = Reflect.get(target, prop, receiver);
        return typeof value === "function" ? value.bind(target) : value;
      },
    });
  return {
    name: `intercepted(${backend.name})`,
    scope: backend.scope,
    inbox: wrap(backend.inbox, inbox),
    outbox: wrap(backend.outbox, outbox),
    open: backend.open?.bind(backend),
    close: backend.close?.bind(backend),
  };
}

function metricsOf(bot: Bot): DurabilityMetrics {
  return bot.durability!.metrics();
}

/**
 * Registers the bot-level durability tests for a backend.
 *
 * @param options the same options as `runBackendContract`
 */
export function runBotConformance(options: BackendConformanceOptions): void {
  const { describe, test, expect } = options.harness;
  const scale = options.timeScale ?? 1;
  const title = `durability through the bot: ${options.name}`;
  if (options.skip) {
    describe(title, () => {
      (test.skip ?? test)(`skipped: ${options.skip}`, () => {});
    });
    return;
  }

  /** The time of the running test (tests of one suite run one at a time): every `Bot` gets `clock: time.clock`. */
  let time = new SuiteTime(false);
  /** Resolves after `ms` on the running test's clock. */
  const sleep = (ms: number): Promise<void> => time.sleep(ms);
  /** In this suite a bot and a mock provider run on the test's clock unless told otherwise. */
  const Bot = class extends CoreBot {
    constructor(options: BotOptions) {
      super({ clock: time.clock, ...options });
    }
  };
  const MockProvider = class extends CoreMockProvider {
    constructor(options: MockProviderOptions = {}) {
      super({ clock: time.clock, ...options });
    }
  };

  /** Runs `fn` with a fresh backend and stops every bot it started. */
  const withBackend = (name: string, fn: (backend: DurabilityBackend, bots: Bot[]) => Promise<void>) =>
    test(name, async () => {
      time = new SuiteTime(options.simulatedTime === true);
      try {
        const backend = await time.create(options);
        const bots: Bot[] = [];
        // The test holds the backend open too, so it can read it after the bots stop.
        await backend.open?.();
        try {
          await fn(backend, bots);
        } finally {
          for (const bot of bots) await bot.stop().catch(() => {});
          try {
            await backend.close?.();
          } finally {
            await time.cleanup(options, backend);
          }
        }
      } finally {
        time.stop();
      }
    });

  const start = async (bots: Bot[], bot: Bot) => {
    bots.push(bot);
    await bot.start();
    return bot;
  };

  describe(title, () => {
    withBackend("admits before dispatch, drops redeliveries, completes after the reply", async (backend, bots) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      const seenState: (string | undefined)[] = [];
      bot.when(/hi/, async (ctx) => {
        seenState.push((await backend.inbox.get(ctx.inboundId))?.state);
        await ctx.reply("hello");
      });
      await start(bots, bot);
      const id = uid("m");
      expect((await provider.receive({ id, chatId: "c1", text: "hi" })).status).toBe("admitted");
      expect((await provider.receive({ id, chatId: "c1", text: "hi" })).status).toBe("duplicate");
      await bot.idle();
      expect(seenState, "the record is journaled and leased before the handler runs").toEqual(["processing"]);
      expect(provider.sent.map((s) => [s.content, s.idempotencyKey])).toEqual([["hello", `${id}:1`]]);
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect((await backend.outbox.get(`${id}:1`))?.state).toBe("sent");
      expect((await backend.outbox.get(`${id}:1`))?.messageId).toBe(provider.sent[0]!.messageId);
      const m = metricsOf(bot);
      expect([m.inboundJournaled, m.inboundDuplicates, m.outboxJournaled]).toEqual([1, 1, 1]);
      // A redelivery after a restart (the in-memory dedupe is gone) is dropped by the journal.
      await bot.stop();
      const bot2 = await start(bots, new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) }));
      expect((await provider.receive({ id, chatId: "c1", text: "hi" })).status).toBe("duplicate");
      expect(metricsOf(bot2).inboundDuplicates).toBe(1);
    });

    withBackend("bot.send from inside a handler is the handler's send: keyed <inbound id>:<n>, awaited, answered on reprocess", async (backend, bots) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      let attempts = 0;
      const notify = async (chatId: string, text: string) => {
        await sleep(1);
        // Not awaited by the handler: it still counts in the done check.
        void bot.send(chatId, text);
      };
      bot.when(/order/, async (ctx) => {
        attempts++;
        await notify("kitchen", `new ${ctx.message.text}`);
        await ctx.reply("received");
        await bot.enqueue(ctx.chatId, "queued note");
        if (attempts === 1) throw new Error("fails after its sends, so the message is processed again");
      });
      await start(bots, bot);
      const outside = await bot.send("c9", "not from a handler");
      expect(outside.key.startsWith("rnd:"), "a send outside any handler keeps a random key").toBe(true);
      const id = uid("m");
      await provider.receive({ id, chatId: "c1", text: "order 7" });
      await bot.idle();
      expect(attempts).toBe(2);
      const keys = provider.sent.filter((s) => s.chatId !== "c9").map((s) => [s.chatId, s.content, s.idempotencyKey])
        .sort((a, b) => String(a[2]).localeCompare(String(b[2])));
      expect(keys, "each send went out once, under the keys of the message").toEqual([
        ["kitchen", "new order 7", `${id}:1`],
        ["c1", "received", `${id}:2`],
        ["c1", "queued note", `${id}:3`],
      ]);
      expect(metricsOf(bot).outboxDeduped, "the reprocess was answered from the outbox").toBe(3);
      expect((await backend.inbox.get(id))?.state).toBe("done");
    });

    withBackend("a send made after its handler returned is not the handler's: it gets a key of its own", async (backend, bots) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      let release!: () => void;
      const gate = new Promise<void>((resolve) => release = resolve);
      let late: Promise<{ key: string }> | undefined;
      bot.when(/x/, async (ctx) => {
        late = gate.then(() => bot.send(ctx.chatId, "later"));
        await ctx.reply("now");
      });
      await start(bots, bot);
      const id = uid("m");
      await provider.receive({ id, chatId: "c1", text: "x" });
      await bot.idle();
      expect((await backend.inbox.get(id))?.state).toBe("done");
      release();
      const { key } = await late!;
      expect(key.startsWith("rnd:"), `a timer left behind sends on its own, got key ${key}`).toBe(true);
      await bot.idle();
      expect(provider.sent.map((s) => [s.content, s.idempotencyKey])).toEqual([["now", `${id}:1`], ["later", key]]);
    });

    withBackend("edits and typing indicators go straight to the provider, without the outbox or a key number", async (backend, bots) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      const errors: string[] = [];
      bot.when(/hi/, async (ctx) => {
        await ctx.reply({ kind: "typing" });
        const sent = await ctx.reply("hello");
        await bot.send(ctx.chatId, { kind: "edit", messageId: sent.messageId, text: "hello!" });
        provider.failNext(1, new ProviderError("Mock typing failure", { retryable: true }));
        await ctx.reply({ kind: "typing" }).catch((error: Error) => errors.push(error.message));
        await ctx.reply("bye");
      });
      await start(bots, bot);
      const id = uid("m");
      await provider.receive({ id, chatId: "c1", text: "hi" });
      await bot.idle();
      expect(provider.sent.map((s) => typeof s.content === "string" ? s.content : (s.content as { kind: string }).kind)).toEqual([
        "typing",
        "hello",
        "edit",
        "bye",
      ]);
      expect(errors, "a direct call's error goes to its caller, once, without a retry").toEqual(["Mock typing failure"]);
      const journaled = await backend.outbox.list({ limit: 100 });
      expect(journaled.map((e) => e.key).sort(), "only the messages are journaled, numbered without the direct calls").toEqual(
        [`${id}:1`, `${id}:2`].sort(),
      );
      expect((await backend.outbox.get(`${id}:2`))?.content).toBe("bye");
      expect((await backend.inbox.get(id))?.state).toBe("done");
      const m = metricsOf(bot);
      expect([m.outboxJournaled, m.outboxBypassed, m.outboxDead]).toEqual([2, 0, 0]);
    });

    withBackend("handles one chat in arrival order and chats in parallel", async (backend, bots) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      const log: string[] = [];
      let running = 0;
      let maxPerChat = 0;
      const perChat = new Map<string, number>();
      bot.when(() => true, async (ctx) => {
        const n = (perChat.get(ctx.chatId) ?? 0) + 1;
        perChat.set(ctx.chatId, n);
        maxPerChat = Math.max(maxPerChat, n);
        running++;
        log.push(`start ${ctx.message.text}`);
        await sleep(5);
        await ctx.reply(`echo ${ctx.message.text}`);
        running--;
        perChat.set(ctx.chatId, n - 1);
      });
      await start(bots, bot);
      for (let i = 1; i <= 5; i++) {
        await provider.receive({ chatId: "a", text: `a${i}` });
        await provider.receive({ chatId: "b", text: `b${i}` });
      }
      await bot.idle();
      expect(maxPerChat, "two messages of one chat never run at once").toBe(1);
      expect(provider.sent.filter((s) => s.chatId === "a").map((s) => s.content)).toEqual(
        ["a1", "a2", "a3", "a4", "a5"].map((t) => `echo ${t}`),
      );
      expect(provider.sent.filter((s) => s.chatId === "b").map((s) => s.content)).toEqual(
        ["b1", "b2", "b3", "b4", "b5"].map((t) => `echo ${t}`),
      );
      expect(running).toBe(0);
    });

    withBackend("retries a failing handler with backoff, then dead-letters it; replay processes it again", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale, { inbox: { retries: 2 } }) });
      const dead = collect(bot, "durability:dead");
      const errors = collect(bot, "error");
      let healthy = false;
      const attempts: number[] = [];
      bot.when(ANY, async (ctx) => {
        attempts.push(ctx.attempt);
        if (!healthy) throw new Error("handler broke", { cause: new TypeError("the menu is missing") });
        await ctx.reply("fixed");
      });
      await start(bots, bot);
      const id = uid("m");
      await provider.receive({ id, chatId: "c", text: "x" });
      await bot.idle();
      const record = await backend.inbox.get(id);
      expect(attempts, `handler runs (the record: ${JSON.stringify([record?.state, record?.attempts, record?.error?.split("\n")[0]])}; errors: ${errors.map(String).join("; ")})`).toEqual([1, 2, 3]);
      expect(record?.state).toBe("dead");
      // The journal keeps what an operator needs: the error, its causes and where it was thrown.
      const lines = record!.error!.split("\n");
      expect(lines.slice(0, 2)).toEqual(["Error: handler broke", "Caused by: TypeError: the menu is missing"]);
      expect(lines.length, "the stack's frames follow").toBeGreaterThan(2);
      expect(lines.slice(2).every((line) => line.startsWith("    ")), "each frame indented").toBe(true);
      expect(dead, "the event carries the one-line text").toEqual([{ kind: "inbound", id, error: "Error: handler broke" }]);
      expect(errors.length).toBe(1);
      expect(metricsOf(bot).inboundDead).toBe(1);
      expect((await bot.durability!.inbox.list({ state: "dead" })).map((r) => r.id)).toEqual([id]);
      healthy = true;
      expect(await bot.durability!.replayInbound(id)).toBe(true);
      await bot.idle();
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect(provider.sent.map((s) => s.content)).toEqual(["fixed"]);
      expect(metricsOf(bot).inboundReplayed).toBe(1);
    });

    withBackend("retries a failing send with backoff, then dead-letters it; retrySend sends it", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale, { outbox: { retries: 2 } }) });
      const dead = collect(bot, "durability:dead");
      await start(bots, bot);
      provider.failNext(3);
      const first = await bot.send("c", "hi", { idempotencyKey: "k-dead" });
      expect(first.state).toBe("failed");
      await bot.idle();
      expect(provider.calls.filter((c) => c.idempotencyKey === "k-dead").length).toBe(3);
      const entry = await backend.outbox.get("k-dead");
      expect(entry?.state).toBe("dead");
      expect(dead.map((d) => [d.kind, d.id])).toEqual([["outbound", "k-dead"]]);
      const m = metricsOf(bot);
      expect([m.outboxDead, m.outboxRetried]).toEqual([1, 2]);
      expect((await bot.durability!.outbox.list({ state: "dead" })).map((e) => e.key)).toEqual(["k-dead"]);
      expect(await bot.durability!.retrySend("k-dead")).toBe(true);
      await bot.idle();
      expect((await backend.outbox.get("k-dead"))?.state).toBe("sent");
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual(["k-dead"]);
      expect(await bot.durability!.outbox.discard("k-dead")).toBe(true);
      expect(await backend.outbox.get("k-dead")).toBe(null);
    });

    withBackend("a permanent provider error goes straight to dead; retry-after is honoured", async (backend, bots) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      await start(bots, bot);
      provider.failNext(1, new ProviderError("invalid recipient", { status: 400 }));
      const result = await bot.send("c", "x", { idempotencyKey: "k-perm" });
      expect(result.state).toBe("dead");
      expect(provider.calls.length).toBe(1);
      const retryAfterMs = Math.round(80 * scale);
      provider.failNext(1, new ProviderError("slow down", { status: 429, retryAfterMs }));
      const started = time.now();
      await bot.send("c2", "y", { idempotencyKey: "k-429" });
      await bot.idle();
      const waited = time.now() - started;
      expect((await backend.outbox.get("k-429"))?.state).toBe("sent");
      expect(waited, "the retry waited for the channel's retry-after").toBeGreaterThanOrEqual(retryAfterMs - 2);
    });

    withBackend("an explicit key sends once; enqueue twice does nothing; a reused key with new content diverges", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      const warnings = collect(bot, "warning");
      await start(bots, bot);
      const a = await bot.send("c", "invoice", { idempotencyKey: "invoice:42" });
      const b = await bot.send("c", "invoice", { idempotencyKey: "invoice:42" });
      expect([a.state, b.state, b.deduped]).toEqual(["sent", "sent", true]);
      expect(b.messageId).toBe(a.messageId);
      expect(await bot.enqueue("c", "remind", { idempotencyKey: "reminder:1" })).toEqual({ key: "reminder:1" });
      expect(await bot.enqueue("c", "remind", { idempotencyKey: "reminder:1" })).toEqual({ key: "reminder:1" });
      await bot.idle();
      const c = await bot.send("c", "a different invoice", { idempotencyKey: "invoice:42" });
      expect(c.deduped).toBe(true);
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual(["invoice:42", "reminder:1"]);
      const m = metricsOf(bot);
      expect([m.outboxDeduped, m.outboxDiverged, m.outboxDeferred, m.outboxJournaled]).toEqual([2, 1, 1, 2]);
      expect(warnings.filter((w) => w.code === "outbox-diverged").map((w) => w.key)).toEqual(["invoice:42"]);
      const random = await bot.send("c", "no key");
      expect(random.key.length).toBeGreaterThan(10);
    });

    withBackend("sends to one chat leave in order: a later send waits behind a failed one", async (backend, bots) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      await start(bots, bot);
      provider.failNext(1);
      const first = await bot.send("c", "first", { idempotencyKey: "o1" });
      const second = await bot.send("c", "second", { idempotencyKey: "o2" });
      const other = await bot.send("d", "other chat", { idempotencyKey: "o3" });
      expect([first.state, second.state, other.state]).toEqual(["failed", "queued", "sent"]);
      await bot.idle();
      expect(provider.sent.filter((s) => s.chatId === "c").map((s) => s.content)).toEqual(["first", "second"]);
    });

    withBackend("an inbound record is done only once its sends are sent or durably queued", async (backend, bots) => {
      let failReserve = 1;
      const flaky = intercept(backend, {}, {
        reserve: (entry, lease) => {
          if (failReserve-- > 0) return Promise.reject(new Error("journal unavailable"));
          return backend.outbox.reserve(entry, lease);
        },
      });
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(flaky, scale) });
      collect(bot, "error");
      const attempts: number[] = [];
      bot.when(ANY, (ctx) => {
        attempts.push(ctx.attempt);
        void ctx.reply("not awaited"); // the engine awaits it anyway
      });
      await start(bots, bot);
      const id = uid("m");
      await provider.receive({ id, chatId: "c", text: "x" });
      await bot.idle();
      expect(attempts, "the unjournaled reply failed the first attempt").toEqual([1, 2]);
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual([`${id}:1`]);
    });

    /** `backend` with its markSent held until `release()`, and the order the engine asked for markSent and complete. */
    const heldMarkSent = (backend: DurabilityBackend) => {
      const calls: string[] = [];
      let release!: () => void;
      const released = new Promise<void>((resolve) => (release = resolve));
      const held = intercept(backend, {
        complete: (id, token) => {
          calls.push(`complete ${id}`);
          return backend.inbox.complete(id, token);
        },
      }, {
        markSent: async (key, token, messageId) => {
          calls.push(`markSent ${key}`);
          await released;
          return backend.outbox.markSent(key, token, messageId);
        },
      });
      const until = async (done: () => boolean) => {
        for (let i = 0; i < 200 && !done(); i++) await sleep(5);
      };
      return { held, calls, release, until };
    };

    withBackend("a handler's send answers once the provider answered; the done mark is asked right after its sent mark", async (backend, bots) => {
      const { held, calls, release, until } = heldMarkSent(backend);
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(held, scale) });
      const seen: { messageId?: string; state?: string }[] = [];
      bot.when(ANY, async (ctx) => {
        const result = await ctx.reply("pong");
        // Answered while its outcome's write waits: the journal still says the call is under way.
        seen.push({ messageId: result.messageId, state: (await backend.outbox.get(result.key))?.state });
      });
      await start(bots, bot);
      const id = uid("m");
      try {
        await provider.receive({ id, chatId: "c", text: "ping" });
        await until(() => calls.length >= 2);
        expect(seen).toEqual([{ messageId: provider.sent[0]!.messageId, state: "sending" }]);
        expect(calls, "the sent mark first, the done mark right after it (one group commit)").toEqual([`markSent ${id}:1`, `complete ${id}`]);
        let idle = false;
        const waiting = bot.idle().then(() => (idle = true));
        await sleep(20);
        expect(idle, "bot.idle() waits for the outcome's write").toBe(false);
        release();
        await waiting;
        expect((await backend.outbox.get(`${id}:1`))?.state).toBe("sent");
        expect((await backend.inbox.get(id))?.state).toBe("done");
      } finally {
        release();
      }
    });

    withBackend("a send from outside a handler answers only once its outcome is journaled (a script may end right after it)", async (backend, bots) => {
      const { held, calls, release, until } = heldMarkSent(backend);
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(held, scale) });
      await start(bots, bot);
      const key = uid("k");
      try {
        let answered = false;
        const sending = bot.send("c", "hello", { idempotencyKey: key }).then((r) => {
          answered = true;
          return r;
        });
        await until(() => calls.length >= 1);
        expect(calls).toEqual([`markSent ${key}`]);
        expect(provider.sent.length, "the call was made").toBe(1);
        await sleep(20);
        expect(answered, "not answered while the outcome's write waits").toBe(false);
        release();
        expect((await sending).state).toBe("sent");
        expect((await backend.outbox.get(key))?.state).toBe("sent");
      } finally {
        release();
      }
    });

    withBackend("a stale completion is rejected and counted; the new owner's work stands", async (backend, bots) => {
      // A is frozen: its heartbeats never land and its sweeps find nothing (so B, not A itself, takes the lapsed lease).
      const frozen = intercept(backend, { heartbeat: () => Promise.resolve(true), claimDue: () => Promise.resolve([]) });
      const lease = Math.round(60 * scale);
      const providerA = new MockProvider();
      const botA = new Bot({ clock: time.clock, provider: providerA, durability: fastDurability(frozen, scale, { inbox: { leaseMs: lease } }) });
      const warningsA = collect(botA, "warning");
      botA.when(ANY, async (ctx) => {
        await sleep(lease * 4);
        await ctx.reply("from A");
      });
      const providerB = new MockProvider();
      const botB = new Bot({ clock: time.clock, provider: providerB, durability: fastDurability(backend, scale, { inbox: { leaseMs: lease } }) });
      botB.when(ANY, (ctx) => ctx.reply("from B"));
      await start(bots, botA);
      const id = uid("m");
      await providerA.receive({ id, chatId: "c", text: "x" });
      await start(bots, botB);
      await botB.idle();
      await botA.idle();
      expect(metricsOf(botA).staleLeases).toBe(1);
      expect(warningsA.some((w) => w.code === "stale-lease" && w.id === id)).toBe(true);
      const record = await backend.inbox.get(id);
      expect([record?.state, record?.fence]).toEqual(["done", 2]);
      expect(providerB.sent.map((s) => [s.content, s.idempotencyKey])).toEqual([["from B", `${id}:1`]]);
      expect(providerA.sent.length, "A's late reply has B's key and is answered from the outbox").toBe(0);
      expect(metricsOf(botA).outboxDiverged).toBe(1);
    });

    withBackend("an ask's timeout fires in the handler, and after a restart the next process fires the one it left", async (backend, bots) => {
      const store = new MemoryStore(); // outlives the "process", as a durable store would
      const timeoutMs = Math.round(150 * scale);
      const make = () => {
        const provider = new MockProvider();
        const bot = new Bot({ clock: time.clock, provider, store, durability: fastDurability(backend, scale, { instanceId: "asker-1" }) });
        bot.on("warning", () => {}); // the memory store is not durable: warned once
        bot.when("order", async (ctx) => {
          try {
            const size = await ctx.ask("Size?", { timeoutMs });
            await ctx.reply(`size ${size.text}`);
          } catch (error) {
            if (!(error instanceof AskTimeoutError)) throw error;
            await ctx.reply(`no answer in ${error.timeoutMs} ms`);
          }
        });
        return { bot, provider };
      };
      const waitForSends = async (provider: MockProvider, n: number) => {
        for (let i = 0; i < 400 && provider.sent.length < n; i++) await sleep(Math.round(10 * scale));
      };
      // In one process: the timer fires while the bot runs.
      const a = make();
      await start(bots, a.bot);
      const first = uid("m");
      await a.provider.receive({ id: first, chatId: "c1", text: "order" });
      await waitForSends(a.provider, 2);
      await a.bot.idle();
      expect(a.provider.sent.map((x) => [x.idempotencyKey, x.content])).toEqual([
        [`${first}:1`, "Size?"],
        [`${first}:t1:1`, `no answer in ${timeoutMs} ms`],
      ]);
      // Across a restart: the process that asked is gone before the deadline; the next one arms it.
      const second = uid("m");
      await a.provider.receive({ id: second, chatId: "c2", text: "order" });
      await a.bot.idle();
      await a.bot.stop();
      const b = make();
      await start(bots, b.bot);
      await waitForSends(b.provider, 1);
      await b.bot.idle();
      expect(b.provider.sent.map((x) => [x.idempotencyKey, x.content])).toEqual([[`${second}:t1:1`, `no answer in ${timeoutMs} ms`]]);
      expect((await backend.outbox.get(`${second}:1`))?.state, "the question went out once, before the restart").toBe("sent");
    });

    withBackend("media is loaded again when a message is reprocessed after a crash; what cannot be is said why", async (
      backend,
      bots,
    ) => {
      const a = crashable(backend);
      const botA = new Bot({ clock: time.clock, provider: new CrashableProvider(a), durability: fastDurability(a, scale, { instanceId: "media-1" }) });
      botA.when(ANY, () => new Promise(() => {})); // the process dies before the handler ends
      await start(bots, botA);
      const ids = { ok: uid("m"), once: uid("m"), foreign: uid("m"), tampered: uid("m") };
      const receive = (id: string, media: Record<string, JsonValue>) =>
        (botA.provider as CrashableProvider).receive({ id, chatId: "c1", media });
      await receive(ids.ok, { type: "image", data: "PNG\u0000bytes \u00e9", mimeType: "image/png", z: 1, a: [2, { y: 3, b: 4 }] });
      await receive(ids.once, { type: "image", data: "secret", viewOnce: true });
      a.crashBefore("inbox.heartbeat"); // the handlers hang; the next heartbeat kills A
      for (let i = 0; i < 200 && !a.crashed; i++) await sleep(Math.round(10 * scale));
      expect(a.crashed).toBe(true);
      // A record of another provider, and one whose reference was altered in the journal.
      const forge = async (id: string, mutate: (media: Record<string, JsonValue>) => void) => {
        const sealed = new MockProvider({ name: "mock" });
        const seen: JsonValue[] = [];
        sealed.start({ receive: async (m) => (seen.push(m.media!), { status: "admitted", id: m.id }) });
        await sealed.receive({ id, chatId: "c2", media: { type: "image", data: "x" } });
        const media = structuredClone(seen[0]) as Record<string, JsonValue>;
        mutate(media);
        const payload = { id, chatId: "c2", type: "image", media } as unknown as JsonValue;
        await backend.inbox.admit({ id, kind: "message", chatId: "c2", provider: "mock", payload, receivedAt: time.now() }, {
          owner: "media-1",
          incarnation: "dead",
          leaseMs: 1,
        });
      };
      await forge(ids.foreign, (m) => (m.provider = "other-channel"));
      await forge(ids.tampered, (m) => ((m.ref as Record<string, JsonValue>).data = "y"));
      await sleep(5);

      const seen = new Map<string, string>();
      const botB = new Bot({ clock: time.clock, provider: new MockProvider(), durability: fastDurability(backend, scale, { instanceId: "media-1" }) });
      botB.when(ANY, async (ctx) => {
        try {
          const media = await loadMediaOf(ctx, { throwOnError: true });
          seen.set(ctx.inboundId, `${media!.mimeType} ${new TextDecoder().decode(media!.data)}`);
        } catch (error) {
          if (!(error instanceof MediaUnavailableError)) throw error;
          seen.set(ctx.inboundId, error.reason);
          expect(await loadMediaOf(ctx), "without throwOnError: null").toBe(null);
        }
      });
      await start(bots, botB);
      await botB.idle();
      expect(Object.fromEntries(seen)).toEqual({
        [ids.ok]: "image/png PNG\u0000bytes \u00e9",
        [ids.once]: "not-durable",
        [ids.foreign]: "provider-mismatch",
        [ids.tampered]: "rehydrate-failed",
      });
    });

    withBackend("a dead replica's records are taken over when the lease lapses; the same instanceId takes them at once", async (
      backend,
      bots,
    ) => {
      const lease = Math.round(250 * scale);
      const a = crashable(backend);
      const botA = new Bot({ clock: time.clock,
        provider: new CrashableProvider(a),
        durability: fastDurability(a, scale, { instanceId: "replica-1", inbox: { leaseMs: lease } }),
      });
      botA.when(ANY, () => new Promise(() => {})); // hangs: the process "dies" with it
      await start(bots, botA);
      const id1 = uid("m");
      const id2 = uid("m");
      await (botA.provider as CrashableProvider).receive({ id: id1, chatId: "c1", text: "x" });
      await (botA.provider as CrashableProvider).receive({ id: id2, chatId: "c2", text: "y" });
      a.crashBefore("inbox.complete");
      a.crashBefore("inbox.heartbeat");
      await sleep(lease / 3 + 20); // the next heartbeat kills A
      expect(a.crashed).toBe(true);
      // Another instanceId must wait for the lease to lapse.
      const other = new MockProvider();
      const botOther = new Bot({ clock: time.clock,
        provider: other,
        durability: fastDurability(backend, scale, { instanceId: "replica-2", inbox: { leaseMs: lease } }),
      });
      botOther.when(ANY, (ctx) => ctx.reply(`other ${ctx.message.text}`));
      await start(bots, botOther);
      expect((await backend.inbox.get(id1))?.lease?.owner, "not taken before the lease lapsed").toBe("replica-1");
      // The same instanceId (a restart) takes back what its dead incarnation held at once.
      const same = new MockProvider();
      const botSame = new Bot({ clock: time.clock,
        provider: same,
        durability: fastDurability(backend, scale, { instanceId: "replica-1", inbox: { leaseMs: lease } }),
      });
      botSame.when(ANY, (ctx) => ctx.reply(`same ${ctx.message.text}`));
      const before = time.now();
      await start(bots, botSame);
      await botSame.idle();
      expect(time.now() - before, "recovered without waiting for the lease").toBeLessThan(lease);
      expect(same.sent.map((s) => s.content).sort()).toEqual(["same x", "same y"]);
      expect(other.sent.length).toBe(0);
      expect(metricsOf(botSame).inboundReplayed).toBe(2);
      for (const id of [id1, id2]) expect((await backend.inbox.get(id))?.state).toBe("done");
    });

    withBackend("without timers (sweepIntervalMs 0) due work waits in the journal; bot.sweep() takes it up, lapsed leases too, once", async (
      backend,
      bots,
    ) => {
      // Long enough that the dead process's lease outlasts the first sweep on a loaded machine (real time on servers).
      const lease = Math.round(1000 * scale);
      const durability = (b: DurabilityBackend, instanceId: string) =>
        fastDurability(b, scale, { instanceId, sweepIntervalMs: 0, inbox: { leaseMs: lease }, outbox: { leaseMs: lease } });
      // A process that dies holding a message (evicted right after it answered the request).
      const a = crashable(backend);
      const botA = new Bot({ clock: time.clock, provider: new CrashableProvider(a), durability: durability(a, uid("evicted")) });
      botA.when(ANY, () => new Promise(() => {}));
      await start(bots, botA);
      const lost = uid("m");
      await (botA.provider as CrashableProvider).receive({ id: lost, chatId: "c0", text: "lost" });
      a.crashBefore("inbox.complete");
      a.crashBefore("inbox.heartbeat");
      await sleep(lease / 3 + 20);
      expect(a.crashed).toBe(true);

      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: durability(backend, uid("cron")) });
      const refused = (p: Promise<unknown>) => p.then(() => "resolved", (error: Error) => `${error.name}: ${error.message}`);
      expect(await refused(bot.sweep())).toBe("Error: Bot.sweep() was called on a bot that is new");
      expect(await refused(bot.sweep({ budgetMs: 0 }))).toBe(
        "RangeError: Option \"budgetMs\" of bot.sweep() must be a positive integer of ms up to 2147483647, got 0",
      );
      expect((await refused(bot.sweep({ budget: 5 } as never))).startsWith('TypeError: Unknown bot.sweep() option "budget"')).toBe(true);
      expect((await refused(bot.sweep(5000 as never))).startsWith('TypeError: Argument "options" of bot.sweep() must be an object')).toBe(true);
      let failHandler = true;
      bot.when(ANY, async (ctx) => {
        if (ctx.message.text === "flaky" && failHandler) {
          failHandler = false;
          throw new Error("fails once");
        }
        await ctx.reply(`re ${ctx.message.text}`);
      });
      await start(bots, bot);
      provider.failNext(1);
      const m1 = uid("m");
      const m2 = uid("m");
      await provider.receive({ id: m1, chatId: "c1", text: "send fails" });
      await provider.receive({ id: m2, chatId: "c2", text: "flaky" });
      await bot.settled();
      await sleep(Math.round(100 * scale)); // past both backoffs (at most 10 ms)
      expect(provider.sent.length, "no retry without a sweep").toBe(0);
      expect((await backend.outbox.get(`${m1}:1`))?.state).toBe("failed");
      expect((await backend.inbox.get(m2))?.state).not.toBe("done");

      const first = await bot.sweep();
      expect(provider.sent.map((s) => s.content).sort()).toEqual(["re flaky", "re send fails"]);
      expect(first.outbound).toBeGreaterThanOrEqual(1);
      expect(first.inbound).toBeGreaterThanOrEqual(1);
      expect(first.more).toBe(false);
      expect(first.pending, "the evicted process's message is still leased").toBe(true);
      expect((await backend.inbox.get(lost))?.state).toBe("processing");

      await sleep(lease + 50); // its lease lapses
      const second = await bot.sweep({ budgetMs: 5_000 });
      expect(second.inbound).toBe(1);
      expect(second.pending).toBe(false);
      expect(provider.sent.map((s) => s.content).sort()).toEqual(["re flaky", "re lost", "re send fails"]);

      const third = await bot.sweep();
      expect([third.inbound, third.outbound, third.ambiguous, third.more, third.pending]).toEqual([0, 0, 0, false, false]);
      expect(provider.sent.length, "a sweep with nothing due sends nothing").toBe(3);
      for (const id of [lost, m1, m2]) expect((await backend.inbox.get(id))?.state).toBe("done");
    });

    withBackend("without timers, an ask's timeout is due in the journal: a sweep of another process fires it once, not before its deadline", async (
      backend,
      bots,
    ) => {
      const store = new MemoryStore(); // outlives the "processes", as a durable store would
      const timeoutMs = Math.round(300 * scale);
      const make = () => {
        const provider = new MockProvider();
        const bot = new Bot({
          clock: time.clock,
          provider,
          store,
          durability: fastDurability(backend, scale, { instanceId: uid("fn"), sweepIntervalMs: 0 }),
        });
        bot.on("warning", () => {}); // the memory store is not durable: warned once
        bot.when("order", async (ctx) => {
          try {
            const size = await ctx.ask("Size?", { timeoutMs });
            await ctx.reply(`size ${size.text}`);
          } catch (error) {
            if (!(error instanceof AskTimeoutError)) throw error;
            await ctx.reply(`no answer in ${error.timeoutMs} ms`);
          }
        });
        return { bot, provider };
      };
      // A webhook process asks, answers its request, and is gone.
      const asker = make();
      await start(bots, asker.bot);
      const asked = uid("m");
      const answered = uid("m");
      const askedAt = time.clock.now();
      await asker.provider.receive({ id: asked, chatId: "c1", text: "order" });
      await asker.provider.receive({ id: answered, chatId: "c2", text: "order" });
      await asker.bot.settled();
      await asker.bot.stop();
      expect(asker.provider.sent.map((s) => s.idempotencyKey).sort()).toEqual([`${answered}:1`, `${asked}:1`].sort());
      expect((await backend.inbox.get(`${asked}:t1`))?.state, "the timeout is journaled, due at the deadline").toBe("scheduled");
      // The answer in c2 comes to another process before the deadline.
      const answering = make();
      await start(bots, answering.bot);
      await answering.provider.receive({ id: uid("m"), chatId: "c2", text: "M" });
      await answering.bot.settled();
      expect(answering.provider.sent.map((s) => s.content)).toEqual(["size M"]);
      // A cron sweep before the deadline fires nothing.
      const early = await answering.bot.sweep();
      if (time.clock.now() - askedAt < timeoutMs) {
        expect(answering.provider.sent.length, "not before the deadline").toBe(1);
        expect(early.pending, "a timer not due is no work under way").toBe(false);
      }
      await answering.bot.stop();
      await sleep(timeoutMs + Math.round(50 * scale));
      // Fresh cron processes after the deadline: the first fires c1's timeout; c2's finds its ask answered.
      const cron = make();
      await start(bots, cron.bot);
      await cron.bot.sweep();
      expect(cron.provider.sent.map((s) => [s.idempotencyKey, s.content])).toEqual([[`${asked}:t1:1`, `no answer in ${timeoutMs} ms`]]);
      await cron.bot.stop();
      const again = make();
      await start(bots, again.bot);
      await again.bot.sweep();
      expect(again.provider.sent.length, "fired once").toBe(0);
      for (const id of [`${asked}:t1`, `${answered}:t1`]) expect((await backend.inbox.get(id))?.state).toBe("done");
      const transcript = await store.get(`botmesh:conversation:${cron.bot.id}:c1`) as { state?: string; endedBy?: string };
      expect([transcript.state, transcript.endedBy]).toEqual(["ended", `${asked}:t1`]);
    });

    withBackend("a message that arrives while a sweep's claim of an earlier record of its chat is on its way is handled after it", async (
      backend,
      bots,
    ) => {
      // The claim scan's answer is held back (a slow network): the record it leased to this process
      // reaches the chat's queue after a later message of the chat was journaled, leased too.
      let gate: Promise<void> | null = null;
      let release!: () => void;
      let scanning!: () => void;
      const scanStarted = new Promise<void>((resolve) => scanning = resolve);
      const slow = intercept(backend, {
        claimDue: async (o) => {
          const claimed = await backend.inbox.claimDue(o);
          if (gate && claimed.length > 0) {
            scanning();
            await gate;
          }
          return claimed;
        },
      });
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(slow, scale, { sweepIntervalMs: 0 }) });
      const handled: string[] = [];
      bot.when(ANY, async (ctx) => {
        handled.push(ctx.message.text ?? "");
        await ctx.reply(`re ${ctx.message.text}`);
      });
      await start(bots, bot);
      // The first message of the chat, journaled by a process that is gone before handling it.
      const first = uid("m");
      const payload = { id: first, chatId: "c1", type: "text", text: "first" };
      expect(await backend.inbox.admit({ id: first, kind: "message", chatId: "c1", provider: provider.name, payload, receivedAt: time.clock.now() - 1000 }))
        .not.toBe(null);
      gate = new Promise<void>((resolve) => release = resolve);
      const sweeping = bot.sweep();
      await scanStarted; // leased to this process in the journal, the answer not back yet
      const second = uid("m");
      const admitted = provider.receive({ id: second, chatId: "c1", text: "second" });
      await sleep(Math.round(60 * scale));
      release();
      expect((await admitted).status).toBe("admitted");
      await sweeping;
      await bot.settled();
      await bot.idle();
      expect(handled).toEqual(["first", "second"]);
      expect(provider.sent.map((s) => s.content)).toEqual(["re first", "re second"]);
    });

    withBackend("an admission the journal confirms after admitTimeoutMs keeps its message's place: later messages of its chat wait for it", async (
      backend,
      bots,
    ) => {
      // The first message's write lands at once, its answer comes after the admission timeout (a stalled
      // connection): the channel is told "rejected", and the next message of the chat arrives meanwhile.
      const slowIds = new Set<string>();
      const stalled = intercept(backend, {
        admit: async (record, lease) => {
          const landed = await backend.inbox.admit(record, lease);
          if (slowIds.has(record.id)) await sleep(Math.round(150 * scale));
          return landed;
        },
      });
      const provider = new MockProvider();
      const bot = new Bot({
        clock: time.clock,
        provider,
        durability: fastDurability(stalled, scale, { inbox: { admitTimeoutMs: Math.round(40 * scale) } }),
      });
      bot.on("error", () => {});
      const handled: string[] = [];
      bot.when(ANY, async (ctx) => {
        handled.push(ctx.message.text ?? "");
        await ctx.reply(`re ${ctx.message.text}`);
      });
      await start(bots, bot);
      const first = uid("m");
      slowIds.add(first);
      const firstAnswer = provider.receive({ id: first, chatId: "c1", text: "first" });
      await sleep(Math.round(5 * scale));
      const second = await provider.receive({ id: uid("m"), chatId: "c1", text: "second" });
      expect((await firstAnswer).status, "past admitTimeoutMs: the channel will deliver it again").toBe("rejected");
      expect(second.status).toBe("admitted");
      await bot.settled();
      await bot.idle();
      expect(handled).toEqual(["first", "second"]);
      // The channel's redelivery finds it handled.
      expect((await provider.receive({ id: first, chatId: "c1", text: "first" })).status).toBe("duplicate");
      await bot.idle();
      expect(provider.sent.map((s) => s.content)).toEqual(["re first", "re second"]);
    });

    withBackend("an ask's timeout whose admission committed but lost its reply is armed by the step's retry under its admission's lease, not a lease later", async (
      backend,
      bots,
    ) => {
      let lost = 0;
      const flaky = intercept(backend, {
        admit: async (record, lease) => {
          const result = await backend.inbox.admit(record, lease);
          if (record.id.endsWith(":t1") && lost++ === 0) throw new Error("read ECONNRESET (after the commit)");
          return result;
        },
      });
      const provider = new MockProvider();
      const bot = await start(bots, new Bot({ clock: time.clock, provider, store: new MemoryStore(), durability: fastDurability(flaky, scale) }));
      bot.on("warning", () => {}); // the memory store is not durable: warned once
      bot.when("order", async (ctx) => {
        const size = await ctx.ask("Size?", { timeoutMs: Math.round(60_000 * scale) });
        await ctx.reply(`size ${size.text}`);
      });
      const id = uid("m");
      await provider.receive({ id, chatId: uid("c"), text: "order" });
      let timer = await backend.inbox.get(`${id}:t1`);
      for (let i = 0; i < 400 && timer?.state !== "scheduled"; i++) {
        await sleep(Math.round(10 * scale));
        timer = await backend.inbox.get(`${id}:t1`);
      }
      expect(lost, "the timer's admissions: the lost one, then the step's retry").toBe(2);
      // Armed under the admission's token 1: a sweep that took it up once its lease lapsed would hold token 2.
      expect([timer?.state, timer?.fence]).toEqual(["scheduled", 1]);
      expect(provider.sent.map((s) => s.content)).toEqual(["Size?"]);
      await bot.stop();
    });

    withBackend("without timers, bot.sweep() returns only once the work it took up is finished, however small its budget", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale, { sweepIntervalMs: 0 }) });
      let failing = true;
      bot.when(ANY, async (ctx) => {
        if (failing) throw new Error("down for now");
        await sleep(Math.round(30 * scale)); // a slow handler
        await ctx.reply(`re ${ctx.message.text}`);
      });
      await start(bots, bot);
      const ids = [uid("m"), uid("m"), uid("m")];
      for (const [i, id] of ids.entries()) await provider.receive({ id, chatId: `c${i}`, text: `m${i}` });
      await bot.settled();
      await sleep(Math.round(50 * scale)); // past the backoffs
      failing = false;
      const summary = await bot.sweep({ budgetMs: 1 });
      for (const id of ids) expect((await backend.inbox.get(id))?.state, "finished before sweep() resolved").toBe("done");
      expect(provider.sent.map((s) => s.content).sort()).toEqual(["re m0", "re m1", "re m2"]);
      expect(summary.inbound).toBe(3);
    });

    withBackend("without timers, a send that bypasses the outbox does not wait for an earlier send of its chat that only a sweep retries", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({
        clock: time.clock,
        provider,
        durability: fastDurability(backend, scale, { sweepIntervalMs: 0, outbox: { maxPayloadBytes: 200 } }),
      });
      bot.on("warning", () => {});
      bot.when(ANY, (ctx) => ctx.reply(ctx.message.text === "big" ? "x".repeat(500) : "small"));
      await start(bots, bot);
      provider.failNext(1);
      await provider.receive({ chatId: "c1", text: "first" });
      await bot.settled();
      await provider.receive({ chatId: "c1", text: "big" });
      let settled = false;
      void bot.settled().then(() => settled = true);
      for (let i = 0; i < 50 && !settled; i++) await sleep(Math.round(10 * scale));
      expect(settled, "the request can end: the bypassed send went out").toBe(true);
      expect(provider.sent.map((s) => (s.content as string).length)).toEqual([500]);
      await bot.sweep();
      expect(provider.sent.map((s) => (s.content as string).length), "the sweep delivers the earlier one").toEqual([500, 5]);
    });

    withBackend("a slow send keeps its lease through heartbeats and is never taken for abandoned", async (
      backend,
      bots,
    ) => {
      const lease = Math.round(40 * scale);
      const provider = new MockProvider({ sendDelayMs: lease * 4, clock: time.clock });
      const bot = new Bot({ clock: time.clock,
        provider,
        durability: fastDurability(backend, scale, { outbox: { leaseMs: lease }, inbox: { leaseMs: lease } }),
      });
      const other = new Bot({ clock: time.clock,
        provider: new MockProvider(),
        durability: fastDurability(backend, scale, { outbox: { leaseMs: lease }, inbox: { leaseMs: lease } }),
      });
      const ambiguous = collect(other, "durability:ambiguous");
      await start(bots, bot);
      await start(bots, other);
      const result = await bot.send("c", "big upload", { idempotencyKey: "slow" });
      expect(result.state).toBe("sent");
      await other.idle();
      expect(ambiguous.length).toBe(0);
      expect((await backend.outbox.get("slow"))?.state).toBe("sent");
      expect(provider.sent.length).toBe(1);
    });

    withBackend("a send that waits in its chat's queue holds its lease from its claim and goes out once", async (
      backend,
      bots,
    ) => {
      // A dead entry retried by an operator is claimed by a sweep, then waits behind a slow send of its chat
      // for several lease lengths: its lease must be heartbeated while it waits, never taken for abandoned.
      for (const policy of ["hold", "resend"] as const) {
        const lease = Math.round(100 * scale);
        const provider = new SlowKeysProvider(lease * 3, time);
        const bot = await start(
          bots,
          new Bot({ clock: time.clock,
            provider,
            durability: fastDurability(backend, scale, { outbox: { leaseMs: lease, onAmbiguous: policy } }),
          }),
        );
        const ambiguous = collect(bot, "durability:ambiguous");
        const warnings = collect(bot, "warning");
        const chatId = uid("c");
        const first = uid("first");
        provider.failNext(1, new ProviderError("invalid recipient", { retryable: false }));
        expect((await bot.send(chatId, "one", { idempotencyKey: first })).state).toBe("dead");
        const slowKey = uid("slow");
        provider.slowKeys.add(slowKey);
        const slow = bot.send(chatId, "two", { idempotencyKey: slowKey });
        await provider.whenStarted(slowKey);
        expect(await bot.durability!.retrySend(first)).toBe(true);
        expect((await slow).state).toBe("sent");
        await bot.idle();
        const calls = provider.calls.filter((c) => c.idempotencyKey === first);
        expect(calls.map((c) => c.ok), `${policy}: the retried send reached the provider once more`).toEqual([false, true]);
        expect((await backend.outbox.get(first))?.state).toBe("sent");
        expect(ambiguous).toEqual([]);
        expect(warnings.filter((w) => w.code === "stale-lease" || w.code === "lease-lost")).toEqual([]);
        expect(metricsOf(bot).staleLeases).toBe(0);
        await bot.stop();
      }
    });

    withBackend("a sweep never takes what this very process is working on, even when its leases look lapsed", async (
      backend,
      bots,
    ) => {
      // The heartbeats are answered but never land (as if the backend's clock stepped forward past every lease):
      // the process's own sweeps find its in-flight message and send lapsed, and must leave them to it.
      for (const policy of ["hold", "resend"] as const) {
        const frozen = intercept(backend, { heartbeat: () => Promise.resolve(true) }, { heartbeat: () => Promise.resolve(true) });
        const lease = Math.round(60 * scale);
        const provider = new SlowKeysProvider(lease * 3, time);
        const bot = await start(
          bots,
          new Bot({ clock: time.clock,
            provider,
            durability: fastDurability(frozen, scale, {
              inbox: { leaseMs: lease },
              outbox: { leaseMs: lease, onAmbiguous: policy },
            }),
          }),
        );
        const ambiguous = collect(bot, "durability:ambiguous");
        const resolved = collect(bot, "durability:resolved");
        const warnings = collect(bot, "warning");
        let runs = 0;
        bot.when(ANY, async (ctx) => {
          runs++;
          await sleep(lease * 3);
          await ctx.reply("done thinking");
        });
        const id = uid("m");
        provider.slowKeys.add(`${id}:1`);
        await provider.receive({ id, chatId: uid("c"), text: "x" });
        await bot.idle();
        expect(runs, `${policy}: the handler ran once`).toBe(1);
        expect(provider.calls.map((c) => c.idempotencyKey)).toEqual([`${id}:1`]);
        expect((await backend.inbox.get(id))?.state).toBe("done");
        const entry = await backend.outbox.get(`${id}:1`);
        expect([entry?.state, entry?.messageId]).toEqual(["sent", provider.sent[0]!.messageId]);
        // 'hold': the sweep made the send unknown during its call, which is reported at once (had the
        // process died during the call, nobody else would); the call's outcome then resolved it to sent.
        // 'resend': it was re-leased to the process, which carried on under the new token: nothing to report.
        expect(ambiguous.length, `${policy}: reports`).toBe(policy === "hold" ? 1 : 0);
        // The report is settled by the call's late outcome: no operator alert is left hanging.
        expect(resolved, `${policy}: resolved`).toEqual(policy === "hold"
          ? [{ key: `${id}:1`, chatId: entry!.chatId, state: "sent", messageId: provider.sent[0]!.messageId, via: "call" }]
          : []);
        expect(metricsOf(bot).outboxResolved).toBe(resolved.length);
        expect(warnings.filter((w) => w.code === "stale-lease")).toEqual([]);
        expect(metricsOf(bot).staleLeases).toBe(0);
        expect(metricsOf(bot).outboxAmbiguous).toBe(ambiguous.length);
        await bot.stop();
      }
    });

    withBackend("a reservation that committed but whose reply was lost is sent once, never answered as a duplicate", async (
      backend,
      bots,
    ) => {
      let lost = 0;
      const flaky = intercept(backend, {}, {
        reserve: async (entry, lease) => {
          const result = await backend.outbox.reserve(entry, lease);
          if (lost++ === 0) throw new Error("read ECONNRESET (after the commit)");
          return result;
        },
      });
      const provider = new MockProvider();
      const bot = await start(bots, new Bot({ clock: time.clock, provider, durability: fastDurability(flaky, scale) }));
      const errors = collect(bot, "error");
      const ambiguous = collect(bot, "durability:ambiguous");
      const warnings = collect(bot, "warning");
      bot.when(ANY, (ctx) => ctx.reply("the answer"));
      const id = uid("m");
      await provider.receive({ id, chatId: uid("c"), text: "x" });
      await bot.idle();
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual([`${id}:1`]);
      const entry = await backend.outbox.get(`${id}:1`);
      expect([entry?.state, entry?.messageId]).toEqual(["sent", provider.sent[0]!.messageId]);
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect(ambiguous).toEqual([]);
      expect(warnings.filter((w) => w.code === "stale-lease")).toEqual([]);
      expect(metricsOf(bot).outboxDeduped).toBe(0);
      expect(errors.length).toBeLessThanOrEqual(1);
      // bot.send outside a handler: the caller is answered with the send, not with the lost reply.
      lost = 0;
      const key = uid("k");
      expect((await bot.send(uid("c"), "direct", { idempotencyKey: key })).state).toBe("sent");
      expect(provider.sent.filter((s) => s.idempotencyKey === key).length).toBe(1);
    });

    withBackend("an announcement answered late and then refused is taken back (a retry): the send goes out once, never reported ambiguous", async (
      backend,
      bots,
    ) => {
      const leaseMs = Math.round(300 * scale);
      let calls = 0;
      const flaky = intercept(backend, {}, {
        // Heartbeats fail meanwhile too: nothing confirms the lease after the announcement was asked.
        heartbeat: async (key, token, ms) => {
          if (calls < 4) throw new Error("connect ECONNREFUSED (sim)");
          return backend.outbox.heartbeat(key, token, ms);
        },
        markCalling: async (key, token, ms) => {
          calls++;
          if (calls === 1) {
            // It commits (the entry is called), and its answer comes after half a lease.
            const held = await backend.outbox.markCalling(key, token, ms);
            await time.sleep(Math.round(leaseMs * 0.6));
            return held;
          }
          if (calls <= 4) throw new Error("connect ECONNREFUSED (sim)");
          return backend.outbox.markCalling(key, token, ms);
        },
      });
      const provider = new MockProvider();
      // Enqueued: a sweep delivers it, announcing its call on its own (markCalling).
      const bot = await start(bots, new Bot({ clock: time.clock, provider, durability: fastDurability(flaky, scale) }));
      const ambiguous = collect(bot, "durability:ambiguous");
      bot.on("error", () => {});
      const key = uid("k");
      await bot.enqueue(uid("c"), "hello", { idempotencyKey: key });
      for (let i = 0; i < 400 && provider.sent.length === 0; i++) await sleep(Math.round(10 * scale));
      await bot.idle();
      expect(calls, "the late answer, three refusals, then the announcement of the retry").toBeGreaterThanOrEqual(5);
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual([key]);
      expect((await backend.outbox.get(key))?.state).toBe("sent");
      expect(ambiguous).toEqual([]);
    });

    withBackend("a reservation that committed queued (its chat held elsewhere) but whose reply was lost answers the handler with the queued send: one run, one send", async (
      backend,
      bots,
    ) => {
      const chat = uid("c");
      // Another process holds a send of the chat (its lease lapses soon): the reply is journaled queued behind it.
      await backend.outbox.reserve(
        { key: uid("other"), chatId: chat, content: { text: "before" }, contentHash: "h0", inboundId: null },
        { owner: uid("other"), incarnation: "x", leaseMs: Math.round(100 * scale) },
      );
      let lost = 0;
      const states: string[] = [];
      const flaky = intercept(backend, {}, {
        reserve: async (entry, lease) => {
          const result = await backend.outbox.reserve(entry, lease);
          if (entry.chatId === chat && lost++ === 0) {
            states.push(result.entry.state);
            throw new Error("read ECONNRESET (after the commit)");
          }
          return result;
        },
      });
      const provider = new MockProvider();
      const bot = await start(bots, new Bot({ clock: time.clock, provider, durability: fastDurability(flaky, scale) }));
      const ambiguous = collect(bot, "durability:ambiguous");
      const runs: string[] = [];
      const answers: string[] = [];
      bot.when(ANY, async (ctx) => {
        runs.push(ctx.message.id);
        answers.push((await ctx.reply("the answer")).state);
      });
      const id = uid("m");
      await provider.receive({ id, chatId: chat, text: "x" });
      for (let i = 0; i < 400 && !provider.sent.some((s) => s.idempotencyKey === `${id}:1`); i++) await sleep(Math.round(10 * scale));
      await bot.idle();
      expect(states).toEqual(["queued"]);
      expect(runs).toEqual([id]);
      expect(answers).toEqual(["queued"]);
      expect(provider.sent.filter((s) => s.idempotencyKey === `${id}:1`).length).toBe(1);
      const record = await backend.inbox.get(id);
      expect([record?.state, record?.attempts]).toEqual(["done", 1]);
      expect(ambiguous).toEqual([]);
    });

    withBackend("claim scans whose reply was lost are asked again: their records handled at once, their ambiguous send reported once", async (
      backend,
      bots,
    ) => {
      // A process that is gone left a message journaled and a send whose call it had announced.
      const chat = uid("c");
      const id = uid("m");
      const payload = { id, chatId: chat, type: "text", text: "left behind" };
      expect(await backend.inbox.admit({ id, kind: "message", chatId: chat, provider: "mock", payload, receivedAt: time.clock.now() - 1000 }))
        .not.toBe(null);
      const gone = { owner: uid("gone"), incarnation: uid("inc"), leaseMs: Math.round(20 * scale) };
      const called = await backend.outbox.reserve({ key: uid("k"), chatId: uid("c"), content: { text: "hi" }, contentHash: "h", inboundId: null }, gone);
      expect(await backend.outbox.markCalling(called.entry.key, 1, gone.leaseMs)).toBe(true);
      await sleep(Math.round(60 * scale));
      // Each journal loses the reply of its first scan that took something: the scan committed.
      const lostOnce = { inbox: 0, outbox: 0 };
      const repeats = { inbox: 0, outbox: 0 };
      const lossy = intercept(backend, {
        claimDue: async (o) => {
          if (o.repeat) repeats.inbox++;
          const claimed = await backend.inbox.claimDue(o);
          if (!o.repeat && claimed.length > 0 && lostOnce.inbox++ === 0) throw new Error("read ECONNRESET (after the commit)");
          return claimed;
        },
      }, {
        claimDue: async (o) => {
          if (o.repeat) repeats.outbox++;
          const claimed = await backend.outbox.claimDue(o);
          if (!o.repeat && claimed.due.length + claimed.ambiguous.length > 0 && lostOnce.outbox++ === 0) {
            throw new Error("read ECONNRESET (after the commit)");
          }
          return claimed;
        },
      });
      const provider = new MockProvider();
      // Leases of a minute: taken up only after they lapse, the record would wait that long.
      const durability = fastDurability(lossy, scale, { inbox: { leaseMs: 60_000 }, outbox: { leaseMs: 60_000 } });
      const bot = new Bot({ clock: time.clock, provider, durability });
      const ambiguous = collect(bot, "durability:ambiguous");
      bot.when(ANY, (ctx) => ctx.reply(`re ${ctx.message.text}`));
      await start(bots, bot);
      const deadline = time.now() + 5_000 * scale;
      while ((await backend.inbox.get(id))?.state !== "done" && time.now() < deadline) await sleep(10);
      await bot.idle();
      expect([lostOnce.inbox, lostOnce.outbox].map((n) => n > 0), "both scans lost their reply").toEqual([true, true]);
      expect(repeats.inbox > 0 && repeats.outbox > 0, "and were asked again").toBe(true);
      expect((await backend.inbox.get(id))?.state, "handled well before its lease lapsed").toBe("done");
      expect(provider.sent.map((s) => s.content)).toEqual(["re left behind"]);
      expect(ambiguous.map((a) => a.key), "the lost send, reported once").toEqual([called.entry.key]);
      expect((await backend.outbox.get(called.entry.key))?.state).toBe("unknown");
    });

    withBackend("outcome writes whose reply was lost reach their outcome, with no stale lease counted", async (
      backend,
      bots,
    ) => {
      const lostOnce = new Set<string>();
      const loseReply = <A extends unknown[], R>(name: string, op: (...args: A) => Promise<R>) => async (...args: A) => {
        const result = await op(...args);
        if (!lostOnce.has(name)) {
          lostOnce.add(name);
          throw new Error(`connection reset after ${name} committed`);
        }
        return result;
      };
      const flaky = intercept(backend, {
        complete: loseReply("complete", backend.inbox.complete.bind(backend.inbox)),
        fail: loseReply("fail", backend.inbox.fail.bind(backend.inbox)),
        heartbeat: loseReply("inbox.heartbeat", backend.inbox.heartbeat.bind(backend.inbox)),
      }, {
        markSent: loseReply("markSent", backend.outbox.markSent.bind(backend.outbox)),
        markFailed: loseReply("markFailed", backend.outbox.markFailed.bind(backend.outbox)),
        heartbeat: loseReply("outbox.heartbeat", backend.outbox.heartbeat.bind(backend.outbox)),
      });
      const lease = Math.round(60 * scale);
      const provider = new MockProvider();
      const bot = await start(
        bots,
        new Bot({ clock: time.clock, provider, durability: fastDurability(flaky, scale, { inbox: { leaseMs: lease }, outbox: { leaseMs: lease } }) }),
      );
      collect(bot, "error");
      const warnings = collect(bot, "warning");
      const ambiguous = collect(bot, "durability:ambiguous");
      const attempts: number[] = [];
      bot.when(ANY, async (ctx) => {
        attempts.push(ctx.attempt);
        if (ctx.attempt === 1) throw new Error("first attempt fails");
        await sleep(lease); // long enough for heartbeats
        await ctx.reply("second attempt replies");
      });
      provider.failNext(1); // the first send fails and is retried
      const id = uid("m");
      await provider.receive({ id, chatId: uid("c"), text: "x" });
      await bot.idle();
      for (const write of ["complete", "fail", "markSent", "markFailed"]) expect(lostOnce.has(write), write).toBe(true);
      expect(attempts).toEqual([1, 2]);
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect((await backend.outbox.get(`${id}:1`))?.state).toBe("sent");
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual([`${id}:1`]);
      expect(warnings.filter((w) => w.code === "stale-lease")).toEqual([]);
      expect(metricsOf(bot).staleLeases).toBe(0);
      expect(ambiguous).toEqual([]);
    });

    withBackend("a send whose sender died mid-call is unknown and reported; 'resend' sends it again", async (
      backend,
      bots,
    ) => {
      for (const policy of ["hold", "resend"] as const) {
        const a = crashable(backend);
        a.crashBefore("outbox.markSent");
        const providerA = new CrashableProvider(a);
        const instanceId = uid("inst");
        const botA = await start(bots, new Bot({ clock: time.clock, provider: providerA, durability: fastDurability(a, scale, { instanceId }) }));
        const key = `amb-${policy}`;
        await botA.send("c", "maybe", { idempotencyKey: key }).catch(() => {});
        expect(a.crashed).toBe(true);
        expect(providerA.sent.length).toBe(1);
        const providerB = new MockProvider();
        const botB = new Bot({ clock: time.clock,
          provider: providerB,
          durability: fastDurability(backend, scale, { instanceId, outbox: { onAmbiguous: policy } }),
        });
        const events = collect(botB, "durability:ambiguous");
        await start(bots, botB);
        await botB.idle();
        expect(events).toEqual([{ key, chatId: "c" }]);
        expect(metricsOf(botB).outboxAmbiguous).toBe(1);
        expect((await backend.outbox.get(key))?.state).toBe(policy === "hold" ? "unknown" : "sent");
        expect(providerB.sent.length).toBe(policy === "hold" ? 0 : 1);
        if (policy === "hold") {
          expect((await botB.durability!.outbox.list({ state: "unknown" })).map((e) => e.key)).toEqual([key]);
          await botB.durability!.retrySend(key);
          await botB.idle();
          expect(providerB.sent.length, "an operator can send it again").toBe(1);
        }
      }
    });

    withBackend("a crash after the reservation, before the call was announced, is not ambiguous: recovery sends it once", async (
      backend,
      bots,
    ) => {
      // A rate limit: the send waits for it after its reservation, which does not announce the call.
      const limited = { rateLimit: { global: { count: 1000, perMs: 1000 } } };
      const cases = [
        { point: "outbox.reserve", when: "after", outbox: limited },
        { point: "outbox.markCalling", when: "before", outbox: limited },
      ] as const;
      for (const { point, when, outbox } of cases) {
        const a = crashable(backend);
        if (when === "after") a.crashAfter(point);
        else a.crashBefore(point);
        const providerA = new CrashableProvider(a);
        const instanceId = uid("inst");
        const botA = await start(bots, new Bot({ clock: time.clock, provider: providerA, durability: fastDurability(a, scale, { instanceId, outbox }) }));
        const key = `uncalled-${point}`;
        await botA.send("c", "surely", { idempotencyKey: key }).catch(() => {});
        expect(a.crashed, point).toBe(true);
        expect(providerA.sent.length, `no call before the crash at ${point}`).toBe(0);
        const providerB = new MockProvider();
        const botB = new Bot({ clock: time.clock, provider: providerB, durability: fastDurability(backend, scale, { instanceId }) });
        const events = collect(botB, "durability:ambiguous");
        await start(bots, botB);
        await botB.idle();
        expect(events, `not ambiguous after a crash ${when} ${point}`).toEqual([]);
        expect(metricsOf(botB).outboxAmbiguous).toBe(0);
        expect(providerB.sent.map((m) => m.idempotencyKey), "recovery sent it once").toEqual([key]);
        const entry = await backend.outbox.get(key);
        expect([entry?.state, entry?.attempts], "sent at its first attempt").toEqual(["sent", 1]);
      }
      {
        // A reply that goes out at once: its reservation announces the call. A crash before it leaves
        // nothing journaled of the reply: the message is handled again and the reply sent once.
        const a = crashable(backend);
        a.crashBefore("outbox.reserveCalling");
        const instanceId = uid("inst");
        const providerA = new CrashableProvider(a);
        const botA = await start(bots, new Bot({ clock: time.clock, provider: providerA, durability: fastDurability(a, scale, { instanceId }) }));
        botA.on("error", () => {});
        botA.when(ANY, (ctx) => ctx.reply("the answer"));
        const id = uid("m");
        await providerA.receive({ id, chatId: uid("c"), text: "x" }).catch(() => {});
        await botA.idle().catch(() => {});
        expect(a.crashed, "crashed before the reply's reservation").toBe(true);
        expect(await backend.outbox.get(`${id}:1`), "nothing journaled").toBe(null);
        const providerB = new MockProvider();
        const botB = new Bot({ clock: time.clock, provider: providerB, durability: fastDurability(backend, scale, { instanceId }) });
        const events = collect(botB, "durability:ambiguous");
        botB.when(ANY, (ctx) => ctx.reply("the answer"));
        await start(bots, botB);
        await botB.idle();
        expect(events).toEqual([]);
        expect(providerB.sent.map((m) => m.idempotencyKey), "the reply sent once").toEqual([`${id}:1`]);
        expect((await backend.inbox.get(id))?.state).toBe("done");
      }
      // A crash after the announcement, before the call, cannot be told from one during the call: after
      // markCalling (a rate-limited send), or after a reservation that announced it (a send made at once).
      for (const { point, outbox } of [{ point: "outbox.markCalling", outbox: limited }, { point: "outbox.reserveCalling", outbox: {} }] as const) {
        const a = crashable(backend);
        a.crashAfter(point);
        const instanceId = uid("inst");
        const providerA = new CrashableProvider(a);
        const botA = await start(bots, new Bot({ clock: time.clock, provider: providerA, durability: fastDurability(a, scale, { instanceId, outbox }) }));
        const key = `announced-${point}`;
        await botA.send("c2", "maybe", { idempotencyKey: key }).catch(() => {});
        expect(a.crashed).toBe(true);
        expect(providerA.sent.length, `no call before the crash after ${point}`).toBe(0);
        expect(a.announced.has(key), "announced in the journal").toBe(true);
        const providerB = new MockProvider();
        const botB = new Bot({ clock: time.clock, provider: providerB, durability: fastDurability(backend, scale, { instanceId }) });
        const events = collect(botB, "durability:ambiguous");
        await start(bots, botB);
        await botB.idle();
        expect(events, `ambiguous after a crash after ${point}`).toEqual([{ key, chatId: "c2" }]);
        expect(providerB.sent.length, "not sent again").toBe(0);
        const entry = await backend.outbox.get(key);
        expect([entry?.state, entry?.attempts, entry?.called]).toEqual(["unknown", 1, true]);
      }
    });

    withBackend("a send made at once is reserved with its call announced: one journal write before the call; queued or rate-limited sends announce it with markCalling", async (
      backend,
      bots,
    ) => {
      const calls: string[] = [];
      const counting = intercept(backend, {}, {
        reserve: (entry, lease) => {
          calls.push(`reserve${(lease as ReserveOptions | undefined)?.calling === true ? "+calling" : lease ? "+lease" : ""}`);
          return backend.outbox.reserve(entry, lease);
        },
        markCalling: (key, token, leaseMs) => {
          calls.push("markCalling");
          return backend.outbox.markCalling(key, token, leaseMs);
        },
      });
      const provider = new MockProvider();
      const bot = await start(bots, new Bot({ clock: time.clock, provider, durability: fastDurability(counting, scale) }));
      const chat = uid("c");
      expect((await bot.send(chat, "one", { idempotencyKey: uid("k") })).state).toBe("sent");
      expect(calls, "one write before the call").toEqual(["reserve+calling"]);
      expect(metricsOf(bot).outboxAmbiguous).toBe(0);
      // Deferred: queued uncalled, then leased by the worker and announced.
      calls.length = 0;
      const deferred = uid("k");
      await bot.enqueue(chat, "later", { idempotencyKey: deferred });
      await bot.idle();
      expect((await backend.outbox.get(deferred))?.state).toBe("sent");
      expect(calls).toEqual(["reserve", "markCalling"]);
      await bot.stop();

      // With a rate limit, the reservation does not announce the call: the send may wait for the limiter.
      calls.length = 0;
      const limitedProvider = new MockProvider();
      const limited = await start(bots, new Bot({
        clock: time.clock,
        provider: limitedProvider,
        durability: fastDurability(counting, scale, { outbox: { rateLimit: { global: { count: 1000, perMs: 1000 } } } }),
      }));
      expect((await limited.send(uid("c"), "limited", { idempotencyKey: uid("k") })).state).toBe("sent");
      expect(calls).toEqual(["reserve+lease", "markCalling"]);
    });

    withBackend("a backend that ignores calling (writes the reservation uncalled) still works: the engine announces the call with markCalling", async (
      backend,
      bots,
    ) => {
      let markCalling = 0;
      const older = intercept(backend, {}, {
        reserve: (entry, lease) => {
          const { calling: _ignored, ...claim } = (lease ?? {}) as ReserveOptions;
          return backend.outbox.reserve(entry, lease === undefined ? undefined : claim);
        },
        markCalling: (key, token, leaseMs) => {
          markCalling++;
          return backend.outbox.markCalling(key, token, leaseMs);
        },
      });
      const provider = new MockProvider();
      const bot = await start(bots, new Bot({ clock: time.clock, provider, durability: fastDurability(older, scale) }));
      const key = uid("k");
      expect((await bot.send(uid("c"), "hi", { idempotencyKey: key })).state).toBe("sent");
      expect(markCalling, "announced with markCalling").toBe(1);
      expect(provider.sent.map((m) => m.idempotencyKey)).toEqual([key]);
      // Its crash after the reservation is not ambiguous (the entry was written uncalled).
      const a = crashable(older);
      a.crashAfter("outbox.reserve");
      const instanceId = uid("inst");
      await start(bots, new Bot({ clock: time.clock, provider: new CrashableProvider(a), durability: fastDurability(a, scale, { instanceId }) }))
        .then((botA) => botA.send("c3", "x", { idempotencyKey: "older-uncalled" }).catch(() => {}));
      expect(a.crashed).toBe(true);
      const providerB = new MockProvider();
      const botB = new Bot({ clock: time.clock, provider: providerB, durability: fastDurability(backend, scale, { instanceId }) });
      const events = collect(botB, "durability:ambiguous");
      await start(bots, botB);
      await botB.idle();
      expect(events).toEqual([]);
      expect(providerB.sent.map((m) => m.idempotencyKey)).toEqual(["older-uncalled"]);
    });

    withBackend("a reservation that announced its call and whose reply and read-back were lost is sent once by the handler's retry, not held as ambiguous", async (
      backend,
      bots,
    ) => {
      let lose = true;
      const flaky = intercept(backend, {}, {
        reserve: async (entry, lease) => {
          const result = await backend.outbox.reserve(entry, lease);
          if (lose) throw new Error("read ECONNRESET (after the commit)");
          return result;
        },
        get: async (key) => {
          if (lose) {
            lose = false;
            throw new Error("read ECONNRESET");
          }
          return await backend.outbox.get(key);
        },
      });
      const provider = new MockProvider();
      const bot = await start(bots, new Bot({ clock: time.clock, provider, durability: fastDurability(flaky, scale) }));
      const ambiguous = collect(bot, "durability:ambiguous");
      bot.on("error", () => {});
      bot.when(ANY, (ctx) => ctx.reply("the answer"));
      const id = uid("m");
      await provider.receive({ id, chatId: uid("c"), text: "x" });
      await bot.idle();
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual([`${id}:1`]);
      const entry = await backend.outbox.get(`${id}:1`);
      expect([entry?.state, entry?.attempts]).toEqual(["sent", 1]);
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect(ambiguous).toEqual([]);
    });

    withBackend("a 429 spends no attempt: with retries 0 the send still goes after it; only its chat waits behind it", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({
        clock: time.clock,
        provider,
        durability: fastDurability(backend, scale, { outbox: { retries: 0, rateLimit: false } }),
      });
      const dead = collect(bot, "durability:dead");
      await start(bots, bot);
      const retryAfterMs = Math.round(60 * scale);
      provider.failNext(1, new ProviderError("Too Many Requests: retry after 1", { status: 429, retryAfterMs }));
      const first = await bot.send("paused", "a1", { idempotencyKey: "a1" });
      expect(first.state, "paused, not dead").toBe("failed");
      const behind = await bot.send("paused", "a2", { idempotencyKey: "a2" });
      expect(behind.state, "waits behind the paused send").toBe("queued");
      const other = await bot.send("free", "b1", { idempotencyKey: "b1" });
      expect(other.state, "another chat is not paused").toBe("sent");
      const paused = await backend.outbox.get("a1");
      expect([paused?.state, paused?.attempts], "journaled as paused, its attempt given back").toEqual(["failed", 0]);
      expect((paused?.nextAttemptAt ?? 0) - (paused?.updatedAt ?? 0)).toBeGreaterThanOrEqual(retryAfterMs - 1);
      await bot.idle();
      expect(provider.sent.map((m) => m.idempotencyKey), "b1 first; a1 after its pause, then a2").toEqual(["b1", "a1", "a2"]);
      expect(provider.calls.filter((c) => c.idempotencyKey === "a1").map((c) => c.ok)).toEqual([false, true]);
      const sent = await backend.outbox.get("a1");
      expect([sent?.state, sent?.attempts], "sent at its first counted attempt").toEqual(["sent", 1]);
      expect(dead).toEqual([]);
      expect(metricsOf(bot).outboxThrottled).toBe(1);
      expect(metricsOf(bot).outboxRetried, "a paused send is not a retry").toBe(0);
    });

    withBackend("a 429 the channel says is global pauses every chat through the rate limiter, without spending an attempt", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({
        clock: time.clock,
        provider,
        durability: fastDurability(backend, scale, { outbox: { retries: 0, rateLimit: { global: { count: 1000, perMs: 1000 } } } }),
      });
      await start(bots, bot);
      const retryAfterMs = Math.round(80 * scale);
      provider.failNext(1, new ProviderError("throughput reached", { status: 429, retryAfterMs, rateLimited: "global" }));
      const pausedAt = time.clock.monotonic();
      expect((await bot.send("a", "first", { idempotencyKey: "g1" })).state).toBe("failed");
      const other = await bot.send("b", "elsewhere", { idempotencyKey: "g2" });
      expect(other.state, "another chat waited for the pause, then went").toBe("sent");
      expect(time.clock.monotonic() - pausedAt, "not before the channel's retry-after").toBeGreaterThanOrEqual(retryAfterMs - 1);
      await bot.idle();
      expect(provider.sent.map((m) => m.idempotencyKey).sort()).toEqual(["g1", "g2"]);
      const first = await backend.outbox.get("g1");
      expect([first?.state, first?.attempts]).toEqual(["sent", 1]);
      expect(metricsOf(bot).outboxThrottled, "the paused send and the one that waited").toBeGreaterThanOrEqual(2);
    });

    withBackend("sends wait for the rate limits in the outbox, in chat order; a wait is no attempt, and one cut short is sent again, not ambiguous", async (
      backend,
      bots,
    ) => {
      const perMs = Math.round(40 * scale);
      // The limiter's admissions, on the bot's clock (a provider call comes later, after a journal write),
      // in the order it decided them.
      const inner = new MemoryRateLimiter({ clock: time.clock });
      const admitted: { keys: string[]; at: number }[] = [];
      const recording: RateLimiter = {
        name: "recording",
        scope: "process",
        take: async (buckets) => {
          const at = time.clock.monotonic(); // the memory limiter decides in this same turn
          const answer = await inner.take(buckets);
          if (answer.ok) admitted.push({ keys: buckets.map((b) => b.key), at });
          return answer;
        },
        pause: (bucket, ms) => inner.pause(bucket, ms),
      };
      const provider = new MockProvider();
      const rateLimit = { perChat: { count: 1, perMs }, global: { count: 2, perMs }, limiter: recording };
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale, { outbox: { rateLimit } }) });
      await start(bots, bot);
      for (let i = 0; i < 4; i++) {
        for (const chat of ["x", "y", "z"]) await bot.enqueue(chat, `${chat}${i}`, { idempotencyKey: `${chat}${i}` });
      }
      await bot.idle();
      expect(admitted.length, "one admission per send").toBe(12);
      admitted.sort((a, b) => a.at - b.at);
      for (const chat of ["x", "y", "z"]) {
        const sent = provider.sent.filter((m) => m.chatId === chat).map((m) => m.idempotencyKey);
        expect(sent, `chat ${chat} in order`).toEqual([0, 1, 2, 3].map((i) => `${chat}${i}`));
        const times = admitted.filter((a) => a.keys.some((k) => k.endsWith(`:chat:${chat}`))).map((a) => a.at);
        expect(times.length).toBe(4);
        for (let i = 1; i < times.length; i++) {
          expect(times[i]! - times[i - 1]!, `chat ${chat}: one send per ${perMs} ms`).toBeGreaterThanOrEqual(perMs - 1);
        }
      }
      for (let i = 2; i < admitted.length; i++) {
        expect(admitted[i]!.at - admitted[i - 2]!.at, `two sends per ${perMs} ms in all`).toBeGreaterThanOrEqual(perMs - 1);
      }
      for (const entry of await backend.outbox.list({ limit: 100 })) expect([entry.key, entry.state, entry.attempts]).toEqual([entry.key, "sent", 1]);
      expect(metricsOf(bot).outboxThrottled, "sends waited").toBeGreaterThan(0);
      expect(metricsOf(bot).outboxWaitingForLimit).toBe(0);

      // A limiter that admits nothing: the send waits with its lease held, never called; stopped, it is sent by the next start.
      const closed: RateLimiter = {
        name: "closed",
        scope: "process",
        take: async (buckets) => ({ ok: false, waitMs: 10_000, key: buckets[0]!.key }),
        pause: async () => {},
      };
      const instanceId = uid("inst");
      const providerA = new MockProvider();
      const botA = await start(bots, new Bot({
        clock: time.clock,
        provider: providerA,
        durability: fastDurability(backend, scale, { instanceId, outbox: { rateLimit: { perChat: { count: 1, perMs: 1000 }, limiter: closed } } }),
      }));
      const waiting = botA.send("w", "held back", { idempotencyKey: "held" });
      for (let i = 0; i < 200 && metricsOf(botA).outboxWaitingForLimit === 0; i++) await sleep(5);
      expect(metricsOf(botA).outboxWaitingForLimit, "waiting for the limiter").toBe(1);
      const held = await backend.outbox.get("held");
      expect([held?.state, held?.called], "leased, no call announced").toEqual(["sending", false]);
      await botA.stop();
      await waiting.catch(() => {});
      expect(providerA.calls).toEqual([]);
      const providerB = new MockProvider();
      const botB = new Bot({ clock: time.clock, provider: providerB, durability: fastDurability(backend, scale, { instanceId, outbox: { rateLimit: false } }) });
      const ambiguous = collect(botB, "durability:ambiguous");
      await start(bots, botB);
      await botB.idle();
      expect(ambiguous).toEqual([]);
      expect(providerB.sent.map((m) => m.idempotencyKey)).toEqual(["held"]);
      const sent = await backend.outbox.get("held");
      expect([sent?.state, sent?.attempts], "sent at its first attempt").toEqual(["sent", 1]);
    });

    withBackend("a delivery status carrying the key resolves an unknown send (even one reported earlier, or seen while it was in flight)", async (
      backend,
      bots,
    ) => {
      const ambiguousOf = async (key: string, chatId: string) => {
        const a = crashable(backend);
        a.crashBefore("outbox.markSent");
        const instanceId = uid("inst");
        const botA = await start(bots, new Bot({ clock: time.clock, provider: new CrashableProvider(a), durability: fastDurability(a, scale, { instanceId }) }));
        await botA.send(chatId, "maybe", { idempotencyKey: key }).catch(() => {});
        expect(a.crashed).toBe(true);
        return instanceId;
      };
      // Reported first, the status comes later.
      const instanceId = await ambiguousOf("late-status", "c");
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale, { instanceId }) });
      const ambiguous = collect(bot, "durability:ambiguous");
      const resolved = collect(bot, "durability:resolved");
      await start(bots, bot);
      await bot.idle();
      expect(ambiguous).toEqual([{ key: "late-status", chatId: "c" }]);
      expect(await provider.reportDelivered("nobody-sent-this", "wamid.X"), "an unknown key changes nothing").toBe(false);
      expect(await provider.reportDelivered("late-status", "wamid.1")).toBe(true);
      const entry = await backend.outbox.get("late-status");
      expect([entry?.state, entry?.messageId]).toEqual(["sent", "wamid.1"]);
      expect(resolved).toEqual([{ key: "late-status", chatId: "c", state: "sent", messageId: "wamid.1", via: "status" }]);
      expect(metricsOf(bot).outboxResolved).toBe(1);
      expect(await provider.reportDelivered("late-status", "wamid.1"), "a repeat of the status").toBe(false);
      expect(provider.sent.length, "never sent again").toBe(0);

      // The status arrives while the send is in flight; its outcome is then lost: resolved at once, not reported.
      const slow = new MockProvider({ sendDelayMs: Math.round(200 * scale) });
      const failing = crashable(backend);
      const botC = new Bot({ clock: time.clock, provider: slow, durability: fastDurability(failing, scale, { instanceId: uid("inst") }) });
      const ambiguousC = collect(botC, "durability:ambiguous");
      const resolvedC = collect(botC, "durability:resolved");
      botC.on("error", () => {});
      await start(bots, botC);
      const sending = botC.send("c3", "timed out", { idempotencyKey: "early-status" });
      // The call is under way once it is announced (it lasts 200 ms of the suite's time).
      while ((await backend.outbox.get("early-status"))?.called !== true) await sleep(Math.round(5 * scale));
      expect((await backend.outbox.get("early-status"))?.state).toBe("sending");
      expect(await slow.reportDelivered("early-status", "wamid.2"), "remembered, not resolved yet").toBe(false);
      slow.failNext(1, new ProviderError("timed out", { retryable: true, maybeDelivered: true }));
      await sending.catch(() => {});
      await botC.idle();
      expect(ambiguousC, "reported at once").toEqual([{ key: "early-status", chatId: "c3" }]);
      expect(resolvedC, "then settled by the status it had seen").toEqual([{ key: "early-status", chatId: "c3", state: "sent", messageId: "wamid.2", via: "status" }]);
      const early = await backend.outbox.get("early-status");
      expect([early?.state, early?.messageId]).toEqual(["sent", "wamid.2"]);
      expect(metricsOf(botC).outboxResolved).toBe(1);
      expect(metricsOf(botC).outboxAmbiguous).toBe(1);
      expect(slow.calls.length, "one call").toBe(1);

      // The status arrives while a failed attempt waits for its retry (at least 400 ms away, whatever the
      // jitter draws): the retry makes no second call. The status is remembered by the replica that
      // saw it, so the bots above stop first (one of them could take the retry).
      await bot.stop();
      await botC.stop();
      const flaky = new MockProvider();
      const botD = new Bot({ clock: time.clock, provider: flaky, durability: fastDurability(backend, scale) });
      const resolvedD = collect(botD, "durability:resolved");
      await start(bots, botD);
      flaky.failNext(1, new ProviderError("bad gateway", { status: 502, retryAfterMs: Math.round(400 * scale) }));
      const failed = await botD.send("c4", "retried", { idempotencyKey: "status-before-retry" });
      expect(failed.state).toBe("failed");
      expect(await flaky.reportDelivered("status-before-retry", "wamid.3")).toBe(false);
      await botD.idle();
      const retried = await backend.outbox.get("status-before-retry");
      expect([retried?.state, retried?.messageId]).toEqual(["sent", "wamid.3"]);
      expect(flaky.calls.length, "the failed call only").toBe(1);
      expect(resolvedD.map((e) => [e.key, e.state, e.via])).toEqual([["status-before-retry", "sent", "status"]]);
    });

    withBackend("an operator marks an unknown send as delivered: sent without a new call, resolved via operator, refused for any other state", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = await start(bots, new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) }));
      const ambiguous = collect(bot, "durability:ambiguous");
      const resolved = collect(bot, "durability:resolved");
      const chatId = uid("c");
      const key = uid("maybe");
      provider.failNext(1, new ProviderError("timed out", { retryable: true, maybeDelivered: true }));
      await bot.send(chatId, "did it arrive?", { idempotencyKey: key }).catch(() => {});
      await bot.idle();
      const unknown = await backend.outbox.get(key);
      expect(unknown?.state).toBe("unknown");
      expect(ambiguous).toEqual([{ key, chatId }]);

      expect(await bot.durability!.markDelivered(key, "msg-seen-by-operator")).toBe(true);
      const sent = await backend.outbox.get(key);
      expect([sent?.state, sent?.messageId, sent?.attempts, sent?.fence]).toEqual(["sent", "msg-seen-by-operator", unknown!.attempts, unknown!.fence]);
      expect(sent?.error, "the last error before it was sent is kept").toBe(unknown!.error);
      expect(resolved).toEqual([{ key, chatId, state: "sent", messageId: "msg-seen-by-operator", via: "operator" }]);
      expect(metricsOf(bot).outboxResolved).toBe(1);
      expect(await bot.durability!.markDelivered(key), "a sent entry is not unknown").toBe(false);
      await bot.idle();
      expect(provider.calls.filter((c) => c.idempotencyKey === key).length, "never called again").toBe(1);

      // Without a message id, and refused once an operator retried it (queued: no longer unknown).
      const second = uid("maybe");
      provider.failNext(1, new ProviderError("timed out", { retryable: true, maybeDelivered: true }));
      await bot.send(chatId, "and this one?", { idempotencyKey: second }).catch(() => {});
      await bot.idle();
      expect((await backend.outbox.get(second))?.state).toBe("unknown");
      expect(await bot.durability!.markDelivered(second)).toBe(true);
      expect((await backend.outbox.get(second))?.messageId, "no message id known").toBe("");
      const third = uid("maybe");
      provider.failNext(1, new ProviderError("timed out", { retryable: true, maybeDelivered: true }));
      await bot.send(chatId, "a third", { idempotencyKey: third }).catch(() => {});
      await bot.idle();
      expect(await bot.durability!.retrySend(third)).toBe(true);
      expect(await bot.durability!.markDelivered(third), "retried: queued or sent, not unknown").toBe(false);
      expect(await bot.durability!.markDelivered(uid("nobody")), "no such key").toBe(false);
      await bot.idle();
      expect((await backend.outbox.get(third))?.state).toBe("sent");
      expect(resolved.map((e) => [e.key, e.via])).toEqual([[key, "operator"], [second, "operator"]]);
    });

    withBackend("a provider's confirm settles an ambiguous send before an operator is asked: sent, sent again, or left unknown", async (
      backend,
      bots,
    ) => {
      type Answer = { delivered: true; messageId: string } | { delivered: false } | null | "throw" | "garbage";
      const answers = new Map<string, Answer>([
        ["was-delivered", { delivered: true, messageId: "m-77" }],
        ["never-arrived", { delivered: false }],
        ["cannot-tell", null],
        ["lookup-fails", "throw"],
        ["garbage", "garbage"],
        ["always-lost", { delivered: false }],
      ]);
      const asked: string[] = [];
      let lostCalls = 0;
      class ConfirmingProvider extends MockProvider {
        override send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
          if (context.idempotencyKey === "always-lost") {
            lostCalls++;
            return Promise.reject(new ProviderError("timed out", { retryable: true, maybeDelivered: true }));
          }
          return super.send(chatId, content, context);
        }
        confirm(send: { idempotencyKey: string; chatId: string; content: unknown }): Promise<{ delivered: true; messageId: string } | { delivered: false } | null> {
          asked.push(`${send.idempotencyKey}|${send.chatId}|${String(send.content)}`);
          const answer = answers.get(send.idempotencyKey)!;
          if (answer === "throw") return Promise.reject(new Error("lookup failed"));
          if (answer === "garbage") return Promise.resolve({ delivered: "yes" } as unknown as null);
          return Promise.resolve(answer);
        }
      }
      for (const key of answers.keys()) {
        const a = crashable(backend);
        a.crashBefore("outbox.markSent");
        const botA = await start(bots, new Bot({ clock: time.clock, provider: new CrashableProvider(a), durability: fastDurability(a, scale) }));
        await botA.send(`chat-${key}`, `text of ${key}`, { idempotencyKey: key }).catch(() => {});
        expect(a.crashed).toBe(true);
      }
      await sleep(Math.round(400 * scale)); // their leases lapse: another replica finds them
      const provider = new ConfirmingProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      const ambiguous = collect(bot, "durability:ambiguous");
      const resolved = collect(bot, "durability:resolved");
      const errors = collect(bot, "error");
      await start(bots, bot);
      await bot.idle();
      const once = [...answers.keys()].filter((k) => k !== "always-lost").map((k) => `${k}|chat-${k}|text of ${k}`);
      const lost = "always-lost|chat-always-lost|text of always-lost";
      expect(asked.filter((a) => a !== lost).sort(), "asked once about each").toEqual(once.sort());
      expect(asked.filter((a) => a === lost).length, "asked after each of its 4 attempts").toBe(4);
      const states = Object.fromEntries(await Promise.all([...answers.keys()].map(async (k) => [k, (await backend.outbox.get(k))?.state])));
      expect(states).toEqual({
        "was-delivered": "sent",
        "never-arrived": "sent",
        "cannot-tell": "unknown",
        "lookup-fails": "unknown",
        garbage: "unknown",
        "always-lost": "dead",
      });
      expect((await backend.outbox.get("was-delivered"))?.messageId).toBe("m-77");
      expect((await backend.outbox.get("never-arrived"))?.attempts, "its resend counts as an attempt").toBe(2);
      expect((await backend.outbox.get("always-lost"))?.attempts, "the retry budget holds: dead after retries + 1").toBe(4);
      expect(provider.sent.map((m) => m.idempotencyKey), "only the one that never arrived went out again").toEqual(["never-arrived"]);
      expect(lostCalls, "its 3 retries, each timed out").toBe(3);
      // Every ambiguity is reported at once; those the channel settles are then reported resolved.
      expect(ambiguous.filter((e) => e.key !== "always-lost").map((e) => e.key).sort()).toEqual([...answers.keys()].filter((k) => k !== "always-lost").sort());
      expect(ambiguous.filter((e) => e.key === "always-lost").length).toBe(4);
      expect(resolved.map((e) => [e.key, e.state, e.via]).sort()).toEqual([
        ["always-lost", "dead", "confirm"],
        ["always-lost", "failed", "confirm"],
        ["always-lost", "failed", "confirm"],
        ["always-lost", "failed", "confirm"],
        ["never-arrived", "failed", "confirm"],
        ["was-delivered", "sent", "confirm"],
      ]);
      expect(metricsOf(bot).outboxResolved).toBe(6);
      expect(metricsOf(bot).outboxAmbiguous).toBe(ambiguous.length);
      const left = (await backend.outbox.list({ state: "unknown", limit: 100 })).map((e) => e.key).filter((k) => answers.has(k));
      expect(left.sort(), "left for an operator").toEqual(["cannot-tell", "garbage", "lookup-fails"]);
      const errorText = errors.map((e) => e.message).join("\n");
      expect(errorText.includes("lookup failed"), `the failed lookup is reported: ${errorText}`).toBe(true);
      expect(/confirm\(\).*"delivered"/.test(errorText), `a garbage answer names the field: ${errorText}`).toBe(true);
    });

    withBackend("with 'resend', the provider's confirm is asked before an ambiguous send goes out again", async (
      backend,
      bots,
    ) => {
      const answers = new Map<string, { delivered: true; messageId: string } | { delivered: false } | null>([
        ["resend-arrived", { delivered: true, messageId: "m-9" }],
        ["resend-lost", { delivered: false }],
        ["resend-unsure", null],
      ]);
      class ConfirmingProvider extends MockProvider {
        confirm(send: { idempotencyKey: string }): Promise<{ delivered: true; messageId: string } | { delivered: false } | null> {
          return Promise.resolve(answers.get(send.idempotencyKey) ?? null);
        }
      }
      for (const key of answers.keys()) {
        const a = crashable(backend);
        a.crashBefore("outbox.markSent");
        const botA = await start(bots, new Bot({ clock: time.clock, provider: new CrashableProvider(a), durability: fastDurability(a, scale) }));
        await botA.send(`chat-${key}`, `text of ${key}`, { idempotencyKey: key }).catch(() => {});
        expect(a.crashed).toBe(true);
      }
      await sleep(Math.round(400 * scale)); // their leases lapse
      const provider = new ConfirmingProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale, { outbox: { onAmbiguous: "resend" } }) });
      const ambiguous = collect(bot, "durability:ambiguous");
      const resolved = collect(bot, "durability:resolved");
      await start(bots, bot);
      await bot.idle();
      expect(ambiguous.map((e) => e.key).sort(), "each reported").toEqual([...answers.keys()].sort());
      expect(provider.sent.map((m) => m.idempotencyKey).sort(), "sent again unless the channel had it").toEqual(["resend-lost", "resend-unsure"]);
      const arrived = await backend.outbox.get("resend-arrived");
      expect([arrived?.state, arrived?.messageId]).toEqual(["sent", "m-9"]);
      expect(resolved.map((e) => [e.key, e.state, e.via])).toEqual([["resend-arrived", "sent", "confirm"]]);
      expect(metricsOf(bot).outboxResolved).toBe(1);
    });

    withBackend("an unreadable message is journaled and dead-lettered with its reason, never handled; its redelivery is a duplicate", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      const handled: string[] = [];
      bot.when(ANY, (ctx) => void handled.push(ctx.message.id));
      const dead = collect(bot, "durability:dead");
      bot.on("error", () => {});
      await start(bots, bot);
      const raw = { messages: [{ from: "", id: "wamid.bad", type: "text" }] };
      const input = { id: "unread-1", chatId: "c-unread", type: "unreadable", unreadable: `Field "from" is empty`, extra: { raw } };
      expect((await provider.receive(input)).status).toBe("admitted");
      await bot.idle();
      expect((await provider.receive(input)).status, "a redelivery").toBe("duplicate");
      await provider.receive({ id: "fine-1", chatId: "c-unread", text: "hello" });
      await bot.idle();
      expect(handled, "only the readable message reached a handler").toEqual(["fine-1"]);
      const record = await backend.inbox.get("unread-1");
      expect(record?.state).toBe("dead");
      expect(record?.error?.includes(`Field "from" is empty`), `the reason is kept: ${record?.error}`).toBe(true);
      expect((record?.payload as { extra?: unknown }).extra, "the raw payload is kept").toEqual({ raw });
      expect(dead).toEqual([{ kind: "inbound", id: "unread-1", error: record!.error! }]);
      expect(metricsOf(bot).inboundDead).toBe(1);
      expect((await bot.durability!.inbox.list({ state: "dead" })).map((r) => r.id)).toEqual(["unread-1"]);
      const refused = await provider.receive({ ...input, id: "unread-2", unreadable: "" });
      expect(refused.status).toBe("rejected");
      expect(refused.status === "rejected" && refused.error.message.includes(`"unreadable"`), "the bad field is named").toBe(true);
    });

    withBackend("content is journaled as JSON with binary as base64; unencodable or oversized content bypasses", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock,
        provider,
        durability: fastDurability(backend, scale, { outbox: { maxPayloadBytes: 2048 } }),
      });
      const warnings = collect(bot, "warning");
      await start(bots, bot);
      const bytes = new Uint8Array([0, 1, 2, 250, 255]);
      provider.failNext(1);
      await bot.send("c", { caption: "pic", data: bytes, $meta: "kept" }, { idempotencyKey: "bin" });
      await bot.idle();
      const delivered = provider.sent.find((s) => s.idempotencyKey === "bin")!.content as Record<string, unknown>;
      expect(delivered.data instanceof Uint8Array).toBe(true);
      expect([...(delivered.data as Uint8Array)]).toEqual([...bytes]);
      expect(delivered.$meta).toBe("kept");
      const stream = new ReadableStream();
      const viaStream = await bot.send("c", { stream } as unknown as OutboundContent, { idempotencyKey: "stream" });
      const big = await bot.send("c", "x".repeat(5000), { idempotencyKey: "big" });
      expect([viaStream.bypassed, big.bypassed]).toEqual([true, true]);
      expect(await backend.outbox.get("stream")).toBe(null);
      expect(await backend.outbox.get("big")).toBe(null);
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual(["bin", "stream", "big"]);
      expect(metricsOf(bot).outboxBypassed).toBe(2);
      const bypassWarnings = warnings.filter((w) => w.code === "outbox-bypassed");
      expect(bypassWarnings.length).toBe(2);
      expect(bypassWarnings[0]!.message.includes("content.stream")).toBe(true);
    });

    withBackend("fails closed when the journal cannot admit; failOpen dispatches without it", async (backend, bots) => {
      for (const failOpen of [false, true]) {
        let failAdmit = 1;
        const flaky = intercept(backend, {
          admit: (record, lease) => {
            if (failAdmit-- > 0) return Promise.reject(new Error("disk full"));
            return backend.inbox.admit(record, lease);
          },
        });
        const provider = new MockProvider();
        const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(flaky, scale, { failOpen }) });
        const errors = collect(bot, "error");
        bot.when(ANY, (ctx) => ctx.reply("ok"));
        await start(bots, bot);
        const id = uid("m");
        const first = await provider.receive({ id, chatId: "c", text: "x" });
        await bot.idle();
        expect(errors.length).toBe(1);
        if (!failOpen) {
          expect(first.status).toBe("rejected");
          expect(provider.sent.length).toBe(0);
          expect((await provider.receive({ id, chatId: "c", text: "x" })).status, "a redelivery is processed").toBe(
            "admitted",
          );
          await bot.idle();
          expect((await backend.inbox.get(id))?.state).toBe("done");
        } else {
          expect(first.status).toBe("unjournaled");
          expect(await backend.inbox.get(id)).toBe(null);
        }
        expect(provider.sent.length).toBe(1);
      }
    });

    withBackend("a redelivery during the first admission waits for it: never acknowledged before the message is journaled", async (
      backend,
      bots,
    ) => {
      let release!: () => void;
      const gate = new Promise<void>((resolve) => release = resolve);
      let failNext = true;
      const slow = intercept(backend, {
        admit: async (record, lease) => {
          if (failNext) {
            failNext = false;
            await gate;
            throw new Error("journal write failed");
          }
          await gate;
          return backend.inbox.admit(record, lease);
        },
      });
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(slow, scale) });
      bot.on("error", () => {});
      const handled: string[] = [];
      bot.when(ANY, (ctx) => void handled.push(ctx.inboundId));
      await start(bots, bot);
      const id = uid("m");
      const first = provider.receive({ id, chatId: "c", text: "x" });
      const second = provider.receive({ id, chatId: "c", text: "x" }); // the channel gave up on the first and redelivers
      const third = provider.receive({ id, chatId: "c", text: "x" });
      let settled = 0;
      for (const p of [first, second, third]) p.then(() => settled++);
      await sleep(Math.round(30 * scale));
      expect(settled, "nothing is answered while the first write is under way").toBe(0);
      release();
      const statuses = [(await first).status, (await second).status, (await third).status];
      // The first write failed: a redelivery that waited for it then journaled the message itself.
      expect(statuses).toEqual(["rejected", "admitted", "duplicate"]);
      await bot.idle();
      expect(handled).toEqual([id]);
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect(metricsOf(bot).inboundDuplicates).toBe(1);
    });

    withBackend("an admission the journal does not confirm in admitTimeoutMs is refused; if it lands later, it is processed once", async (
      backend,
      bots,
    ) => {
      let release!: () => void;
      const gate = new Promise<void>((resolve) => release = resolve);
      let hangNext = true;
      let landed: Promise<unknown> = Promise.resolve();
      const stuck = intercept(backend, {
        admit: (record, lease) => {
          if (!hangNext) return backend.inbox.admit(record, lease);
          hangNext = false;
          const write = gate.then(() => backend.inbox.admit(record, lease)); // a query stuck in the driver, landing later
          landed = write;
          return write;
        },
      });
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(stuck, scale, { inbox: { admitTimeoutMs: Math.round(80 * scale) } }) });
      const errors: Error[] = [];
      bot.on("error", (e) => errors.push(e));
      const handled: string[] = [];
      bot.when(ANY, async (ctx) => {
        handled.push(ctx.inboundId);
        await ctx.reply("once");
      });
      await start(bots, bot);
      const id = uid("m");
      const first = await provider.receive({ id, chatId: "c", text: "x" });
      expect(first.status).toBe("rejected");
      expect(errors.some((e) => e.message.includes("admitTimeoutMs")), "the timeout is reported").toBe(true);
      release();
      await landed; // the stuck write lands after all, leased to this bot
      const again = await provider.receive({ id, chatId: "c", text: "x" }); // the channel delivers it again
      // Admitted at once, or (when a sweep's claim was under way) acknowledged as journaled and taken up
      // by the next sweep: either way it is handled once, without waiting for its lease to lapse.
      expect(again.status === "admitted" || again.status === "duplicate", `redelivery answered ${again.status}`).toBe(true);
      await bot.idle();
      expect(handled).toEqual([id]);
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect(provider.sent.filter((s) => s.idempotencyKey === `${id}:1`).length).toBe(1);
    });

    withBackend("an admission that landed but lost its reply is processed at once (read back); its redelivery is a duplicate", async (backend, bots) => {
      // The write commits, then the connection drops (or a client retries it): the bot saw an error.
      let loseReply = 1;
      const lossy = intercept(backend, {
        admit: async (record, lease) => {
          const admitted = await backend.inbox.admit(record, lease);
          if (loseReply-- > 0) throw new Error("connection reset after the commit");
          return admitted;
        },
      });
      const provider = new MockProvider();
      // A long lease: without taking its own record back, the bot would wait a minute for it.
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(lossy, scale, { inbox: { leaseMs: 60_000 } }) });
      bot.when(ANY, (ctx) => ctx.reply("ok"));
      await start(bots, bot);
      const id = uid("m");
      expect((await provider.receive({ id, chatId: "c", text: "x" })).status).toBe("rejected");
      expect((await backend.inbox.get(id))?.state === undefined, "the first write landed").toBe(false);
      // The bot read the record back and took it up in its chat's place: the redelivery is a duplicate.
      expect((await provider.receive({ id, chatId: "c", text: "x" })).status).toBe("duplicate");
      const deadline = time.now() + 5_000 * scale;
      while ((await backend.inbox.get(id))?.state !== "done" && time.now() < deadline) await sleep(10);
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect(provider.sent.map((s) => s.chatId)).toEqual(["c"]);
      expect((await provider.receive({ id, chatId: "c", text: "x" })).status, "later redeliveries stay duplicates").toBe(
        "duplicate",
      );
      expect(metricsOf(bot).inboundJournaled).toBe(1);
    });

    withBackend("purges done and sent records after the retention; keeps dead ones", async (backend, bots) => {
      const retention = Math.round(60 * scale);
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock,
        provider,
        durability: fastDurability(backend, scale, { retention, inbox: { retries: 0 } }),
      });
      collect(bot, "error");
      bot.when("boom", () => {
        throw new Error("boom");
      });
      bot.when(ANY, (ctx) => ctx.reply("ok"));
      await start(bots, bot);
      const done = uid("m");
      const dead = uid("m");
      await provider.receive({ id: done, chatId: "c", text: "x" });
      await provider.receive({ id: dead, chatId: "d", text: "boom" });
      await bot.idle();
      // Done (or, on a slow machine where idle() outlasted the short retention, already purged).
      const settled = await backend.inbox.get(done);
      expect(settled === null || settled.state === "done", `state ${settled?.state}`).toBe(true);
      await sleep(retention * 3);
      await bot.idle();
      expect(await backend.inbox.get(done)).toBe(null);
      expect(await backend.outbox.get(`${done}:1`)).toBe(null);
      expect((await backend.inbox.get(dead))?.state).toBe("dead");
    });

    withBackend("idle() waits through pending retries; stop() lets in-flight work finish", async (backend, bots) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock,
        provider,
        durability: fastDurability(backend, scale, { outbox: { backoff: { baseMs: 30, capMs: 60 } } }),
      });
      let finished = false;
      bot.when(ANY, async (ctx) => {
        await ctx.reply("r");
        await sleep(30);
        finished = true;
      });
      await start(bots, bot);
      provider.failNext(2);
      const id = uid("m");
      await provider.receive({ id, chatId: "c", text: "x" });
      await bot.idle();
      expect(provider.sent.length).toBe(1);
      expect((await backend.outbox.get(`${id}:1`))?.attempts).toBe(3);
      finished = false;
      await provider.receive({ id: uid("m"), chatId: "c", text: "y" });
      await bot.stop();
      expect(finished, "stop() waited for the running handler").toBe(true);
      const late = await bot.durability!.inbox.list({ state: ["pending", "processing", "failed"] });
      expect(late.length).toBe(0);
    });

    withBackend("a transient journal error while recording an outcome is retried, not left half-settled", async (
      backend,
      bots,
    ) => {
      let failComplete = 1;
      let failMarkSent = 1;
      const flaky = intercept(backend, {
        complete: (id, token) =>
          failComplete-- > 0 ? Promise.reject(new Error("transient")) : backend.inbox.complete(id, token),
      }, {
        markSent: (key, token, messageId) =>
          failMarkSent-- > 0 ? Promise.reject(new Error("transient")) : backend.outbox.markSent(key, token, messageId),
      });
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(flaky, scale) });
      const errors = collect(bot, "error");
      bot.when(ANY, (ctx) => ctx.reply("ok"));
      await start(bots, bot);
      const id = uid("m");
      await provider.receive({ id, chatId: "c", text: "x" });
      await bot.send("c", "after", { idempotencyKey: `${id}-later` });
      await bot.idle();
      expect(errors.length, "both failures were reported").toBe(2);
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect((await backend.outbox.get(`${id}:1`))?.state).toBe("sent");
      expect((await backend.outbox.get(`${id}-later`))?.state).toBe("sent");
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual([`${id}:1`, `${id}-later`]);
    });

    withBackend("a slow journal write never lets a later message of the chat overtake an earlier one", async (
      backend,
      bots,
    ) => {
      let delayFirst = true;
      const slow = intercept(backend, {
        admit: async (record, lease) => {
          if (delayFirst) {
            delayFirst = false;
            await sleep(Math.round(30 * scale));
          }
          return backend.inbox.admit(record, lease);
        },
      });
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(slow, scale) });
      const handled: string[] = [];
      bot.when(ANY, (ctx) => {
        handled.push(ctx.message.text!);
      });
      await start(bots, bot);
      await Promise.all([
        provider.receive({ chatId: "c", text: "first" }),
        provider.receive({ chatId: "c", text: "second" }),
      ]);
      await bot.idle();
      expect(handled).toEqual(["first", "second"]);
    });

    withBackend("stop() waits for admissions under way and for a start() under way", async (backend, bots) => {
      const slow = intercept(backend, {
        admit: async (record, lease) => {
          await sleep(Math.round(30 * scale));
          return backend.inbox.admit(record, lease);
        },
      });
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(slow, scale) });
      let handledAfterStop = false;
      let stopped = false;
      bot.when(ANY, () => {
        handledAfterStop = stopped;
      });
      await start(bots, bot);
      const id = uid("m");
      const admission = provider.receive({ id, chatId: "c", text: "x" });
      await bot.stop();
      stopped = true;
      expect((await admission).status).toBe("admitted");
      expect((await backend.inbox.get(id))?.state, "the admitted message was processed before stop() resolved").toBe(
        "done",
      );
      expect(handledAfterStop).toBe(false);
      // stop() during start(): the provider ends up stopped.
      const provider2 = new MockProvider();
      const bot2 = new Bot({ clock: time.clock, provider: provider2, durability: fastDurability(backend, scale) });
      const starting = bot2.start();
      await bot2.stop();
      await starting;
      let refused = false;
      await provider2.receive({ chatId: "c", text: "late" }).catch(() => refused = true);
      expect(refused, "no message reaches a stopped bot").toBe(true);
    });

    withBackend("a handler that throws with a failing unawaited send is retried; nothing is unhandled", async (
      backend,
      bots,
    ) => {
      let failReserve = 1;
      const flaky = intercept(backend, {}, {
        reserve: (entry, lease) =>
          failReserve-- > 0 ? Promise.reject(new Error("journal down")) : backend.outbox.reserve(entry, lease),
      });
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(flaky, scale) });
      collect(bot, "error");
      collect(bot, "warning");
      bot.when(ANY, (ctx) => {
        void ctx.reply("reply");
        if (ctx.attempt === 1) throw new Error("handler failed too");
      });
      await start(bots, bot);
      const id = uid("m");
      await provider.receive({ id, chatId: "c", text: "x" });
      await bot.idle();
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual([`${id}:1`]);
    });

    withBackend("a send that bypasses the outbox still waits behind earlier sends of its chat", async (
      backend,
      bots,
    ) => {
      const provider = new MockProvider();
      const bot = new Bot({ clock: time.clock,
        provider,
        durability: fastDurability(backend, scale, {
          outbox: { maxPayloadBytes: 100, backoff: { baseMs: 20, capMs: 20 } },
        }),
      });
      collect(bot, "warning");
      await start(bots, bot);
      provider.failNext(1);
      expect((await bot.send("c", "small", { idempotencyKey: "k1" })).state).toBe("failed");
      const big = await bot.send("c", "x".repeat(500), { idempotencyKey: "k2" });
      expect(big.bypassed).toBe(true);
      await bot.idle();
      expect(provider.sent.map((s) => s.idempotencyKey)).toEqual(["k1", "k2"]);
    });

    test(`metrics has every counter: ${options.name}`, () => {
      const bot = new Bot({ provider: new MockProvider(), durability: { backend: { ...stubBackend } } });
      expect(Object.keys(bot.durability!.metrics()).sort()).toEqual([
        "conversationsDiverged",
        "conversationsReplayed",
        "damagedRecords",
        "inboundDead",
        "inboundDuplicates",
        "inboundJournaled",
        "inboundReplayed",
        "outboxAmbiguous",
        "outboxBypassed",
        "outboxDead",
        "outboxDeduped",
        "outboxDeferred",
        "outboxDiverged",
        "outboxJournaled",
        "outboxResolved",
        "outboxRetried",
        "outboxThrottled",
        "outboxWaitingForLimit",
        "staleLeases",
        "stepsCalled",
        "stepsFailed",
        "stepsReplayed",
      ]);
    });

    withBackend("ids, chat ids and idempotency keys that are not well-formed Unicode are refused at the bot's entry points", async (
      backend,
      bots,
    ) => {
      const provider = new RawProvider();
      const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
      collect(bot, "error");
      const handled: string[] = [];
      const inHandler: unknown[] = [];
      bot.when(ANY, async (ctx) => {
        handled.push(ctx.inboundId);
        for (const send of [
          () => ctx.reply("x", { idempotencyKey: `${ctx.inboundId}:\uD83D` }),
          () => ctx.send("c\uDE00", "x"),
        ]) {
          try {
            await send();
            inHandler.push("sent");
          } catch (error) {
            inHandler.push(error);
          }
        }
      });
      await start(bots, bot);
      const base = uid("m");
      // "m\uD83D" and "m\uDE00" (a text cut mid-emoji) would both be "m\uFFFD" in SQLite, Postgres or Redis.
      const cases: [InboundMessage, string, string][] = [
        [{ id: `${base}\uD83D`, chatId: "c1", type: "text", text: "a" }, "id", `${base}\uD83D`],
        [{ id: `${base}\uDE00`, chatId: "c1", type: "text", text: "b" }, "id", `${base}\uDE00`],
        [{ id: uid("m"), chatId: "c\uD83D", type: "text", text: "c" }, "chatId", "c\uD83D"],
      ];
      for (const [message, field, value] of cases) {
        const result = await provider.deliver(message);
        expect(result.status, `a lone surrogate in "${field}"`).toBe("rejected");
        const error = (result as { error?: Error }).error;
        expect(error instanceof TypeError, `a TypeError, got ${String(error)}`).toBe(true);
        expect(error!.message.includes(`field "${field}" must be well-formed Unicode`), error!.message).toBe(true);
        expect(error!.message.includes(JSON.stringify(value)), `the value, escaped: ${error!.message}`).toBe(true);
      }
      // The bot's sends refuse at once (synchronously for send()).
      const sendCases: [() => unknown, string][] = [
        [() => bot.send("c1", "hi", { idempotencyKey: "k\uD83D" }), `Option "idempotencyKey"`],
        [() => bot.send("c1", "hi", { idempotencyKey: "k\uDE00" }), `Option "idempotencyKey"`],
        [() => bot.send("c\uD83D", "hi"), `Argument "chatId"`],
      ];
      for (const [call, name] of sendCases) {
        let thrown: unknown = undefined;
        try {
          call();
        } catch (error) {
          thrown = error;
        }
        expect(thrown instanceof TypeError, `${name}: thrown synchronously, got ${String(thrown)}`).toBe(true);
        expect((thrown as Error).message.startsWith(`${name} must be well-formed Unicode`), (thrown as Error).message).toBe(true);
      }
      let enqueued: unknown = undefined;
      await bot.enqueue("c1", "hi", { idempotencyKey: "k\uD83D" }).catch((error) => (enqueued = error));
      expect(enqueued instanceof TypeError, `enqueue: ${String(enqueued)}`).toBe(true);
      // A well-formed message goes through; its handler's sends with such keys are refused too.
      const ok = uid("m");
      expect((await provider.deliver({ id: ok, chatId: "c1", type: "text", text: "ok" })).status).toBe("admitted");
      await bot.idle();
      expect(handled, "only the well-formed message was handled").toEqual([ok]);
      expect(inHandler.map((e) => e instanceof TypeError), "ctx.reply / ctx.send refuse").toEqual([true, true]);
      expect((await backend.inbox.list()).map((r) => r.id), "nothing else was journaled").toEqual([ok]);
      expect(await backend.outbox.list(), "nothing was reserved").toEqual([]);
      expect(provider.sent, "nothing was sent").toEqual([]);
    });

    withBackend("a message with own __proto__ and constructor keys reaches the handler unchanged, also when replayed after a crash", async (
      backend,
      bots,
    ) => {
      const id = uid("m");
      const text = JSON.stringify({ id, chatId: "c1", type: "text", text: "proto" }).slice(0, -1) +
        ', "extra": {"__proto__": {"polluted": true}, "constructor": {"prototype": {"x": 1}}, "list": [{"__proto__": null}]}' +
        ', "__proto__": {"top": "own"}}';
      const live = JSON.parse(text) as InboundMessage;
      const seen: { who: string; message: InboundMessage }[] = [];
      const a = crashable(backend);
      const rawA = new RawProvider();
      const botA = new Bot({ clock: time.clock, provider: new CrashableProvider(a, rawA), durability: fastDurability(a, scale, { instanceId: "proto-1" }) });
      botA.when(ANY, (ctx) => {
        seen.push({ who: "A", message: ctx.message });
        return new Promise(() => {}); // the process dies before the handler ends
      });
      await start(bots, botA);
      expect((await rawA.deliver(live)).status).toBe("admitted");
      for (let i = 0; i < 200 && seen.length === 0; i++) await sleep(Math.round(5 * scale));
      const journaled = (await backend.inbox.get(id))?.payload;
      expectExactJson(expect, journaled, JSON.parse(text) as JsonValue, "the journaled payload");
      a.crashBefore("inbox.heartbeat"); // the next heartbeat kills A
      for (let i = 0; i < 200 && !a.crashed; i++) await sleep(Math.round(10 * scale));
      expect(a.crashed).toBe(true);

      const botB = new Bot({ clock: time.clock, provider: new MockProvider(), durability: fastDurability(backend, scale, { instanceId: "proto-1" }) });
      botB.when(ANY, (ctx) => {
        seen.push({ who: "B", message: ctx.message });
      });
      await start(bots, botB);
      await botB.idle();
      expect(seen.map((s) => s.who), "handled live, then replayed").toEqual(["A", "B"]);
      for (const { who, message } of seen) {
        expectExactJson(expect, message, JSON.parse(text) as JsonValue, `the message bot ${who}'s handler saw`);
        expect((message as unknown as Record<string, unknown>).top, `${who}: the own __proto__ key is no prototype`).toBe(undefined);
        expect((message.extra as Record<string, unknown>).polluted, `${who}: nor the nested one`).toBe(undefined);
      }
      expect((await backend.inbox.get(id))?.state).toBe("done");
      expect(({} as Record<string, unknown>).polluted, "Object.prototype is untouched").toBe(undefined);
    });

    withBackend("a chat routed to another replica while the first still handles a message of it: the new message waits, and is handled after it", async (
      backend,
      bots,
    ) => {
      const order: string[] = [];
      let release!: () => void;
      const gate = new Promise<void>((resolve) => (release = resolve));
      const make = (name: string) => {
        const provider = new MockProvider();
        const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
        bot.when(ANY, async (ctx) => {
          order.push(`${ctx.message.text}:start`);
          if (ctx.message.text === "one") await gate;
          order.push(`${ctx.message.text}:end`);
          await ctx.reply(`${name} saw ${ctx.message.text}`);
        });
        return { provider, bot };
      };
      const a = make("A");
      const b = make("B");
      await start(bots, a.bot);
      await start(bots, b.bot);
      expect((await a.provider.receive({ id: uid("m"), chatId: "moved", text: "one" })).status).toBe("admitted");
      for (let i = 0; i < 200 && !order.includes("one:start"); i++) await sleep(Math.round(5 * scale));
      expect((await b.provider.receive({ id: uid("m"), chatId: "moved", text: "two" })).status).toBe("admitted");
      await sleep(Math.round(150 * scale)); // several sweeps of both bots
      expect(order, "the second message waits while the first is handled").toEqual(["one:start"]);
      release();
      for (let i = 0; i < 400 && !order.includes("two:end"); i++) await sleep(Math.round(5 * scale));
      expect(order, "then it is handled, after the first").toEqual(["one:start", "one:end", "two:start", "two:end"]);
    });

    describe("damaged records", () => {
      if (!options.damage) {
        (test.skip ?? test)("skipped: no damage option (the backend keeps no stored form that could be damaged)", () => {});
        return;
      }
      const damage = options.damage;
      /** A pending record of `chatId` whose payload is a text message, journaled as a channel would have it. */
      const pendingText = async (backend: DurabilityBackend, chatId: string, text: string, receivedAt: number) => {
        const id = uid("m");
        const record = await backend.inbox.admit({
          id,
          kind: "message",
          chatId,
          provider: "mock",
          payload: { id, chatId, type: "text", text },
          receivedAt,
        });
        if (record === null) throw new Error(`admit of ${id} returned null`);
        return id;
      };
      /** Runs `run` on a fresh backend with one inbox record and one outbox entry damaged; the bots it starts are stopped. */
      const withDamaged = (
        name: string,
        run: (backend: DurabilityBackend, damaged: { inbox: string; outbox: string; good: string }, bots: Bot[]) => Promise<void>,
      ) =>
        test(name, async () => {
          time = new SuiteTime(options.simulatedTime === true);
          let backend = await time.create(options);
          let open = false;
          const bots: Bot[] = [];
          try {
            await backend.open?.();
            open = true;
            const chat = uid("chat");
            const inbox = await pendingText(backend, chat, "damaged", 1_000);
            const good = await pendingText(backend, chat, "hello", 2_000);
            const outbox = (await backend.outbox.reserve({ key: uid("out"), chatId: uid("chat"), content: "lost words", contentHash: "h", inboundId: null })).entry.key;
            open = false;
            backend = await time.damage(damage, backend, "inbox", inbox);
            backend = await time.damage(damage, backend, "outbox", outbox);
            await backend.open?.();
            open = true;
            await run(backend, { inbox, outbox, good }, bots);
          } finally {
            for (const bot of bots) await bot.stop().catch(() => {});
            try {
              if (open) await backend.close?.();
            } finally {
              await time.cleanup(options, backend); // the backend the test ended on (a damage may have reopened it)
              time.stop();
            }
          }
        });
      const damagedErrors = (errors: Error[]) =>
        errors.filter((e) => e instanceof DamagedRecordError).map((e) => [(e as DamagedRecordError).journal, (e as DamagedRecordError).id, (e as DamagedRecordError).backend]);
      const waitFor = async (what: string, done: () => boolean | Promise<boolean>) => {
        for (let i = 0; i < 400; i++) {
          if (await done()) return;
          await sleep(Math.round(10 * scale));
        }
        throw new Error(`timed out waiting for ${what}`);
      };

      withDamaged("set aside and reported once, by one of two bots: an error naming it and its backend, counted in damagedRecords; its chat is handled", async (backend, damaged, bots) => {
        const provider = new MockProvider();
        const runs: Bot[] = [];
        const errors: Error[] = [];
        for (let i = 0; i < 2; i++) {
          const bot = new Bot({ clock: time.clock, provider, durability: fastDurability(backend, scale) });
          bot.on("error", (error) => void errors.push(error));
          bot.when(ANY, (ctx) => ctx.reply(`re: ${ctx.message.text}`));
          runs.push(await start(bots, bot));
        }
        await waitFor("both damaged records reported", () => damagedErrors(errors).length >= 2);
        await waitFor("the good record handled", async () => (await backend.inbox.get(damaged.good))?.state === "done");
        for (const bot of runs) await bot.idle();
        await sleep(Math.round(100 * scale)); // a few more sweep ticks: nothing is reported twice
        expect(damagedErrors(errors).sort()).toEqual([
          ["inbox", damaged.inbox, backend.name],
          ["outbox", damaged.outbox, backend.name],
        ].sort());
        expect(runs.reduce((n, bot) => n + metricsOf(bot).damagedRecords, 0), "counted once").toBe(2);
        expect(provider.sent.map((s) => s.content), "the rest of the chat is handled").toEqual(["re: hello"]);
        expect((await backend.inbox.damaged()).map((d) => [d.id, d.reported])).toEqual([[damaged.inbox, true]]);
        expect((await backend.outbox.damaged()).map((d) => [d.id, d.reported])).toEqual([[damaged.outbox, true]]);
      });

      for (const journal of ["inbox", "outbox"] as const) {
        withDamaged(`crash before ${journal}.reportDamaged: the next bot reports it`, async (backend, damaged, bots) => {
          const a = crashable(backend);
          a.crashBefore(`${journal}.reportDamaged`);
          const botA = new Bot({ clock: time.clock, provider: new CrashableProvider(a), durability: fastDurability(a, scale, { instanceId: "dmg" }) });
          botA.on("error", () => {});
          await start(bots, botA).catch(() => {});
          await waitFor("the crash", () => a.crashed);
          const errors: Error[] = [];
          const botB = new Bot({ clock: time.clock, provider: new MockProvider(), durability: fastDurability(backend, scale, { instanceId: "dmg" }) });
          botB.on("error", (error) => void errors.push(error));
          await start(bots, botB);
          await waitFor("the report", () => damagedErrors(errors).some(([j]) => j === journal));
          await sleep(Math.round(100 * scale));
          expect(damagedErrors(errors).filter(([j]) => j === journal)).toEqual([[journal, damaged[journal], backend.name]]);
        });
        withDamaged(`crash after ${journal}.reportDamaged: marked reported, its event lost; no bot reports it twice`, async (backend, damaged, bots) => {
          const a = crashable(backend);
          a.crashAfter(`${journal}.reportDamaged`);
          const botA = new Bot({ clock: time.clock, provider: new CrashableProvider(a), durability: fastDurability(a, scale, { instanceId: "dmg" }) });
          botA.on("error", () => {});
          await start(bots, botA).catch(() => {});
          await waitFor("the crash", () => a.crashed);
          const errors: Error[] = [];
          const botB = new Bot({ clock: time.clock, provider: new MockProvider(), durability: fastDurability(backend, scale, { instanceId: "dmg" }) });
          botB.on("error", (error) => void errors.push(error));
          await start(bots, botB);
          await waitFor("the other journal's report", () => damagedErrors(errors).length >= (journal === "inbox" ? 1 : 0));
          await sleep(Math.round(100 * scale));
          expect(damagedErrors(errors).filter(([j]) => j === journal), "not reported again").toEqual([]);
          expect((await backend[journal].damaged()).map((d) => [d.id, d.reported]), "listed for an operator").toEqual([[damaged[journal], true]]);
        });
      }
    });
  });
}


const unused = (): Promise<never> => Promise.reject(new Error("not used"));
const stubBackend: DurabilityBackend = {
  name: "stub",
  scope: "process",
  inbox: {
    admit: unused,
    claim: unused,
    claimDue: unused,
    start: unused,
    heartbeat: unused,
    schedule: unused,
    complete: unused,
    fail: unused,
    get: unused,
    list: unused,
    replay: unused,
    purge: unused,
    damaged: unused,
    reportDamaged: unused,
  },
  outbox: {
    reserve: unused,
    claimDue: unused,
    heartbeat: unused,
    markCalling: unused,
    markSent: unused,
    markFailed: unused,
    get: unused,
    list: unused,
    retry: unused,
    discard: unused,
    purge: unused,
    damaged: unused,
    reportDamaged: unused,
  },
};

// ---- the crash matrix --------------------------------------------------------

/** How often a point is reached before the matrix crashes there (some are reached at start-up first). */
const CRASH_AT: Partial<Record<CrashPoint, number>> = {
  "inbox.claim": 4,
  "outbox.claim": 4,
  "store.set": 2, // chat c4's second transcript write (after "Age?")
};

/** A provider whose failures are decided by the content, the same in every process, with a shared log. */
class ScriptedProvider extends MockProvider {
  constructor(readonly world: World, readonly slowMs: number, readonly time: SuiteTime) {
    super();
  }
  override async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    const text = typeof content === "string" ? content : "";
    const key = context.idempotencyKey;
    const calls = (this.world.calls.get(key) ?? 0) + 1;
    this.world.calls.set(key, calls);
    if (text.includes("[perm]")) throw new ProviderError("invalid recipient", { status: 400 });
    if (text.includes("[slow]")) await this.time.sleep(this.slowMs); // long enough for lease heartbeats
    if (text.includes("[flaky]") && calls === 1) throw new ProviderError("timeout", { status: 503 });
    const receipt = await super.send(chatId, content, context);
    this.world.delivered.push(key);
    return receipt;
  }
}

/** What the matrix remembers across the two "processes". */
interface World {
  calls: Map<string, number>;
  delivered: string[];
  handlerThrew: Set<string>;
}

const CHATS = ["c1", "c2", "c3", "c4"];
/** Chat c4 runs a conversation: "form", then two answers. */
const FORM_TEXTS = ["c4-form", "Ann", "33"];

function matrixMessages(run: string) {
  const messages: { id: string; chatId: string; text: string }[] = [];
  for (let i = 1; i <= 3; i++) {
    for (const chatId of CHATS) {
      let text = chatId === "c4" ? FORM_TEXTS[i - 1]! : `${chatId}-m${i}`;
      if (chatId === "c1" && i === 2) text += " [throw-once]";
      if (chatId === "c2" && i === 2) text += " [slow]";
      if (chatId === "c3" && i === 3) text += " [flaky]";
      if (chatId === "c3" && i === 1) text += " [perm]";
      messages.push({ id: `${run}-${chatId}-m${i}`, chatId, text });
    }
  }
  return messages;
}

function matrixBot(provider: Provider, backend: DurabilityBackend, world: World, scale: number, events: {
  ambiguous: string[];
  dead: string[];
}, store: SessionStore, time: SuiteTime): Bot {
  const bot = new CoreBot({
    clock: time.clock,
    provider,
    store,
    durability: fastDurability(backend, scale, {
      instanceId: "matrix",
      inbox: { leaseMs: Math.round(60 * scale) },
      outbox: { leaseMs: Math.round(60 * scale) },
    }),
  });
  bot.on("error", () => {});
  bot.on("durability:ambiguous", ({ key }) => events.ambiguous.push(key));
  bot.on("durability:dead", ({ id }) => events.dead.push(id));
  // Two sends per step, like the other chats: a reply, then the next question.
  bot.when("c4-form", async (ctx) => {
    await ctx.reply("one: form");
    const name = await ctx.ask("two: Name?");
    await ctx.reply(`one: ${name.text}`);
    const age = await ctx.ask(`two: Age, ${name.text}?`);
    await ctx.reply(`one: ${age.text}`);
    await ctx.reply(`two: done ${name.text}/${age.text}`);
  });
  bot.when(ANY, async (ctx) => {
    const text = ctx.message.text ?? "";
    if (text.includes("[throw-once]") && !world.handlerThrew.has(ctx.inboundId)) {
      world.handlerThrew.add(ctx.inboundId);
      throw new Error("first attempt fails");
    }
    if (text.includes("[slow]")) await time.sleep(Math.round(50 * scale));
    const tag = text.includes("[perm]") ? " [perm]" : text.includes("[flaky]") ? " [flaky]" : text.includes("[slow]") ? " [slow]" : "";
    await ctx.reply(`one: ${text.split(" ")[0]}${tag}`);
    await ctx.reply(`two: ${text.split(" ")[0]}`);
  });
  return bot;
}

/**
 * Registers the crash matrix for a backend: for every crash point, before and
 * after, a bot crashes once in a scenario with several chats, several
 * messages per chat, a handler that replies twice, a handler that fails once,
 * a slow handler, a flaky and a permanently failing send, and operator
 * actions; then a second bot on the same state and instanceId recovers.
 *
 * @param options the same options as `runBackendContract`
 */
export function runCrashMatrix(options: BackendConformanceOptions): void {
  const { describe, test, expect } = options.harness;
  const scale = options.timeScale ?? 1;
  const title = `crash matrix: ${options.name}`;
  if (options.skip) {
    describe(title, () => {
      (test.skip ?? test)(`skipped: ${options.skip}`, () => {});
    });
    return;
  }
  describe(title, () => {
    // A damaged record's report is not reached by this scenario (no record is damaged in it): its crash
    // points recover in the damaged-records test of runDurabilityConformance, on backends that can damage one.
    // Nor is a timer's arming (no conversation asks here): `inbox.schedule` recovers in the conversation
    // suite's crash tests of a journaled ask timer. Nor is a durable step's call (no step here): `step.call`
    // recovers in the steps suite's crash matrix.
    for (const point of CRASH_POINTS.filter((p) => !p.endsWith(".reportDamaged") && p !== "inbox.schedule" && p !== "step.call")) {
      for (const when of ["before", "after"] as const) {
        test(`crash ${when} ${point}, then recover`, async () => {
          const time = new SuiteTime(options.simulatedTime === true);
          try {
            const backend = await time.create(options);
            const held = { backend };
            await backend.open?.();
            try {
              await crashAndRecover(held, options.reopen, point, when, scale, expect, time);
            } finally {
              try {
                await held.backend.close?.();
              } finally {
                await time.cleanup(options, held.backend);
              }
            }
          } finally {
            time.stop();
          }
        });
      }
    }
  });
}

async function crashAndRecover(
  held: { backend: DurabilityBackend },
  reopen: BackendConformanceOptions["reopen"],
  point: CrashPoint,
  when: "before" | "after",
  scale: number,
  expect: Expect,
  time: SuiteTime,
): Promise<void> {
  const world: World = { calls: new Map(), delivered: [], handlerThrew: new Set() };
  const events = { ambiguous: [] as string[], dead: [] as string[] };
  const run = uid("r");
  const messages = matrixMessages(run);
  let backend = held.backend;
  const a = crashable(backend);
  if (when === "before") a.crashBefore(point, { at: CRASH_AT[point] ?? 1 });
  else a.crashAfter(point, { at: CRASH_AT[point] ?? 1 });
  const providerA = new CrashableProvider(a, new ScriptedProvider(world, Math.round(50 * scale), time));
  const store = new MemoryStore(); // the session store outlives the "process", as a durable one would
  const botA = matrixBot(providerA, a, world, scale, events, crashableStore(a, store), time);
  let rejectedByA = 0;
  try {
    await botA.start();
    for (const m of messages) {
      if (a.crashed) break;
      if ((await providerA.receive(m)).status === "rejected") rejectedByA++;
    }
    const d = botA.durability!;
    const perm = `${run}-c3-m1:1`;
    await botA.idle();
    if (!a.crashed) await d.replayInbound(`${run}-c1-m1`);
    await botA.idle();
    if (!a.crashed) await d.retrySend(perm);
    await botA.idle();
    if (!a.crashed) await d.outbox.discard(perm);
  } catch (error) {
    if (!a.crashed) throw error; // only the simulated death may end the first process
  }
  await botA.stop().catch(() => {});
  const metricsA = botA.durability!.metrics();
  expect(a.crashed, `the scenario reached "${point}" (hits: ${JSON.stringify(a.hits)})`).toBe(true);

  // A second process on the same state and instanceId.
  if (reopen) {
    backend = held.backend = await time.reopen(reopen, backend);
    await backend.open?.();
  }
  const providerB = new ScriptedProvider(world, Math.round(50 * scale), time);
  const botB = matrixBot(providerB, backend, world, scale, events, store, time);
  await botB.start();
  for (const m of messages) await providerB.receive(m); // the channel redelivers everything unacknowledged (and more)
  await botB.idle();
  const metricsB = botB.durability!.metrics();
  await botB.stop();

  // Every admitted message is done or dead; here none may be dead.
  for (const m of messages) {
    const record = await backend.inbox.get(m.id);
    expect(record?.state, `inbound ${m.id} after a crash ${when} ${point}`).toBe("done");
  }
  // An admission under way when A died may have been journaled without A seeing it (B then sees a duplicate).
  const journaled = metricsA.inboundJournaled + metricsB.inboundJournaled;
  expect(journaled, "no message journaled twice").toBeLessThanOrEqual(messages.length);
  expect(journaled + rejectedByA, "every message journaled").toBeGreaterThanOrEqual(messages.length);

  // Each key is delivered at most once, unless it was reported ambiguous.
  const deliveries = new Map<string, number>();
  for (const key of world.delivered) deliveries.set(key, (deliveries.get(key) ?? 0) + 1);
  for (const [key, count] of deliveries) {
    if (!events.ambiguous.includes(key)) expect(count, `deliveries of ${key}`).toBe(1);
  }
  // Nothing lost: every reply is sent (delivered once), dead (the permanent failure) or unknown (reported).
  const unknown: string[] = [];
  for (const m of messages) {
    for (const n of [1, 2]) {
      const key = `${m.id}:${n}`;
      const entry = await backend.outbox.get(key);
      const isPerm = m.text.includes("[perm]") && n === 1;
      if (entry === null) {
        expect(isPerm, `only the discarded dead send may be gone (${key})`).toBe(true);
        continue;
      }
      if (entry.state === "unknown") {
        unknown.push(key);
        continue;
      }
      expect(entry.state, `state of ${key}`).toBe(isPerm ? "dead" : "sent");
      if (!isPerm) expect(deliveries.get(key), `deliveries of sent ${key}`).toBe(1);
    }
  }
  expect(unknown.sort(), "every unknown send was reported").toEqual([...new Set(events.ambiguous)].sort());
  // Ambiguous only where a provider call may really have happened: one was made, or the crash fell
  // between its journaled announcement and the call. A crash after the reservation is not ambiguous.
  for (const key of new Set(events.ambiguous)) {
    expect(world.calls.has(key) || a.announced.has(key), `${key} reported ambiguous with no provider call announced (crash ${when} ${point})`)
      .toBe(true);
  }
  // The conversation resumed where it was: each question asked once, the answers it recorded used.
  const [form, name, age] = messages.filter((m) => m.chatId === "c4");
  const expected: [string, string][] = [
    [`${form!.id}:2`, "two: Name?"],
    [`${name!.id}:2`, "two: Age, Ann?"],
    [`${age!.id}:2`, "two: done Ann/33"],
  ];
  for (const [key, content] of expected) expect((await backend.outbox.get(key))?.content, `content of ${key}`).toBe(content);
  const conversation = await store.get("botmesh:conversation:bot:c4") as { state?: string; endedBy?: string } | undefined;
  expect([conversation?.state, conversation?.endedBy], "the conversation ended with its last answer").toEqual(["ended", age!.id]);
  expect(metricsA.outboxAmbiguous + metricsB.outboxAmbiguous).toBe(events.ambiguous.length);
  const permKey = `${run}-c3-m1:1`;
  if (!events.ambiguous.includes(permKey)) {
    // Crashing right after the dead transition loses the event with the process; the DLQ entry stays.
    // So does a crash elsewhere while that write was in flight (a backend with real I/O).
    const eventLost = (point === "outbox.markFailed" && when === "after") ||
      a.landedAfterCrash.some((op) => op.point === "outbox.markFailed" && op.id === permKey);
    expect(events.dead.includes(permKey) || eventLost, "the permanent failure was reported").toBe(true);
    expect(metricsA.outboxDead + metricsB.outboxDead).toBe(events.dead.length);
  }
}

