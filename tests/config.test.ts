import { describe, expect, test } from "bun:test";
import { Bot, MemoryDurability, parseDuration } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import { resolveDurability } from "../src/config.ts";

const backend = new MemoryDurability();
const make = (durability: unknown) =>
  new Bot({ provider: new MockProvider(), durability: durability as never });

function rejects(durability: unknown, kind: typeof TypeError | typeof RangeError, option: string, value?: string) {
  let error: unknown;
  try {
    make(durability);
  } catch (e) {
    error = e;
  }
  expect(error).toBeInstanceOf(kind);
  expect((error as Error).message).toContain(`"${option}"`);
  if (value !== undefined) expect((error as Error).message).toContain(value);
}

describe("durability options are validated and named in errors", () => {
  test("missing backend", () => rejects({}, TypeError, "durability.backend"));
  test("a backend that is not one", () => rejects({ backend: { inbox: 1 } }, TypeError, "durability.backend"));
  test("a backend written for an older contract (no outbox.markCalling) is refused by name", () => {
    const memory = new MemoryDurability();
    const { markCalling: _, ...outbox } = Object.fromEntries(
      ["reserve", "claimDue", "heartbeat", "markCalling", "markSent", "markFailed", "get", "list", "retry", "discard", "purge"]
        .map((m) => [m, (memory.outbox as unknown as Record<string, (...a: unknown[]) => unknown>)[m]!.bind(memory.outbox)]),
    );
    rejects({ backend: { name: "old-one", scope: "process", inbox: memory.inbox, outbox } }, TypeError, "outbox.markCalling", '"old-one"');
  });
  test("negative inbox lease", () => rejects({ backend, inbox: { leaseMs: -5 } }, RangeError, "durability.inbox.leaseMs", "-5"));
  test("outbox lease under 20 ms", () => rejects({ backend, outbox: { leaseMs: 10 } }, RangeError, "durability.outbox.leaseMs", "10"));
  test("a non-integer lease", () => rejects({ backend, outbox: { leaseMs: "60s" } }, TypeError, "durability.outbox.leaseMs", '"60s"'));
  test("unknown backoff field", () =>
    rejects({ backend, outbox: { backoff: { baseMs: 10, maxMs: 20 } } }, TypeError, "durability.outbox.backoff.maxMs"));
  test("backoff cap below base", () =>
    rejects({ backend, inbox: { backoff: { baseMs: 100, capMs: 10 } } }, RangeError, "durability.inbox.backoff.capMs"));
  test("bad retention string", () => rejects({ backend, retention: "7 days" }, TypeError, "durability.retention", '"7 days"'));
  test("negative retention", () => rejects({ backend, retention: -1 }, RangeError, "durability.retention", "-1"));
  test("unknown top-level option", () => rejects({ backend, retries: 3 }, TypeError, "durability.retries"));
  test("bad onAmbiguous", () => rejects({ backend, outbox: { onAmbiguous: "drop" } }, TypeError, "durability.outbox.onAmbiguous", '"drop"'));
  test("negative retries", () => rejects({ backend, outbox: { retries: -1 } }, RangeError, "durability.outbox.retries"));
  test("empty instanceId", () => rejects({ backend, instanceId: "" }, TypeError, "durability.instanceId"));
  test("failOpen not a boolean", () => rejects({ backend, failOpen: "yes" }, TypeError, "durability.failOpen"));
  test("maxPayloadBytes zero", () => rejects({ backend, outbox: { maxPayloadBytes: 0 } }, RangeError, "durability.outbox.maxPayloadBytes"));
  test("durations parse", () => {
    expect(parseDuration("7d", "x")).toBe(604_800_000);
    expect(parseDuration("1.5h", "x")).toBe(5_400_000);
    expect(parseDuration("250ms", "x")).toBe(250);
    expect(parseDuration(42, "x")).toBe(42);
  });
  test("bot options", () => {
    expect(() => new Bot({ provider: {} as never })).toThrow(/"provider"/);
    expect(() => new Bot({ provider: new MockProvider(), extra: 1 } as never)).toThrow(/"extra"/);
    const bot = new Bot({ provider: new MockProvider() });
    expect(() => bot.when(42 as never, () => {})).toThrow(/"matcher"/);
    expect(() => bot.when("hi", "nope" as never)).toThrow(/"handler"/);
    expect(() => bot.send("", "x")).toThrow(/"chatId"/);
  });
  test("timer options above setTimeout's limit", () => {
    rejects({ backend, sweepIntervalMs: 3e9 }, RangeError, "durability.sweepIntervalMs", "3000000000");
    rejects({ backend, inbox: { leaseMs: 9e9 } }, RangeError, "durability.inbox.leaseMs");
    rejects({ backend, inbox: { admitTimeoutMs: 0 } }, RangeError, "durability.inbox.admitTimeoutMs", "0");
    rejects({ backend, outbox: { backoff: { capMs: 3e9 } } }, RangeError, "durability.outbox.backoff.capMs");
  });
  test("sweepIntervalMs 0 turns the timers off; a negative one is refused naming the choice", () => {
    expect(resolveDurability({ backend, sweepIntervalMs: 0 }).sweepIntervalMs).toBe(0);
    rejects({ backend, sweepIntervalMs: -5 }, RangeError, "durability.sweepIntervalMs", "bot.sweep()");
  });
  test("a tracer must have startSpan and startActiveSpan", () => {
    rejects({ backend, tracer: {} }, TypeError, "durability.tracer");
    rejects({ backend, tracer: { startSpan() {} } }, TypeError, "durability.tracer");
    const tracer = { startSpan() {}, startActiveSpan() {} };
    expect(resolveDurability({ backend, tracer } as never).tracer).toBe(tracer as never);
  });

  test("rate limit options", () => {
    rejects({ backend, outbox: { rateLimit: true } }, TypeError, "durability.outbox.rateLimit", "true");
    rejects({ backend, outbox: { rateLimit: { globl: { count: 1, perMs: 1 } } } }, TypeError, "durability.outbox.rateLimit", "globl");
    rejects({ backend, outbox: { rateLimit: { global: { count: 0, perMs: 1000 } } } }, RangeError, "durability.outbox.rateLimit.global.count", "0");
    rejects({ backend, outbox: { rateLimit: { perChat: { count: 1, perMs: 1.5 } } } }, TypeError, "durability.outbox.rateLimit.perChat.perMs", "1.5");
    rejects({ backend, outbox: { rateLimit: { perChat: { count: 1, perMs: 1000, every: 2 } } } }, TypeError, "durability.outbox.rateLimit.perChat", "every");
    rejects({ backend, outbox: { rateLimit: { limiter: {} } } }, TypeError, "durability.outbox.rateLimit.limiter");
    expect(resolveDurability({ backend, outbox: { rateLimit: false } }).outbox.rateLimit).toBe(false);
    expect(resolveDurability({ backend, outbox: { rateLimit: { global: { count: 30, perMs: 1000 }, perChat: false } } }).outbox.rateLimit)
      .toEqual({ global: { count: 30, perMs: 1000, burst: 1 }, perChat: false });
  });

  test("the defaults of SPEC §7", () => {
    const resolved = resolveDurability({ backend });
    expect(resolved).toEqual({
      backend,
      instanceId: undefined,
      retentionMs: 7 * 24 * 3600 * 1000,
      failOpen: false,
      inbox: { leaseMs: 60_000, retries: 3, backoff: { baseMs: 1000, capMs: 60_000 }, admitTimeoutMs: 10_000 },
      outbox: {
        retries: 5,
        backoff: { baseMs: 1000, capMs: 60_000 },
        leaseMs: 60_000,
        maxPayloadBytes: 1024 * 1024,
        onAmbiguous: "hold",
        rateLimit: {},
      },
      sweepIntervalMs: 5000,
      tracer: null,
    });
    expect(resolveDurability({ backend, outbox: { leaseMs: 40 } }).sweepIntervalMs).toBe(20);
    expect(new Bot({ provider: new MockProvider() }).durability).toBeUndefined();
  });
});

describe("bad input never loses what is journaled", () => {
  test("garbage from a provider is rejected naming the field; journaled records stay", async () => {
    const provider = new MockProvider();
    const store = new MemoryDurability();
    const bot = new Bot({ provider, durability: { backend: store, instanceId: "t" } });
    const errors: Error[] = [];
    bot.on("error", (e) => errors.push(e));
    bot.when(() => true, (ctx) => ctx.reply("ok"));
    await bot.start();
    await provider.receive({ id: "good", chatId: "c", text: "x" });
    const sink = (provider as unknown as { receive: MockProvider["receive"] });
    const bad = await sink.receive({ id: "bad", chatId: 42 as never, text: "x" });
    expect(bad.status).toBe("rejected");
    expect(errors.at(-1)?.message).toContain('"chatId"');
    const weird = await provider.receive({ id: "fn", chatId: "c", media: { type: "image", thumb: (() => 1) as never } });
    expect(weird.status).toBe("rejected");
    expect(errors.at(-1)?.message).toContain("message.media.thumb");
    await bot.idle();
    expect((await store.inbox.get("good"))?.state).toBe("done");
    expect(await store.inbox.get("fn")).toBe(null);
    // The rejected id is forgotten by the dedupe: a corrected redelivery is processed.
    expect((await provider.receive({ id: "fn", chatId: "c", text: "fixed" })).status).toBe("admitted");
    await bot.idle();
    expect(provider.sent.length).toBe(2);
    await bot.stop();
  });

  test("a provider receipt without a message id is recorded with a warning", async () => {
    const provider = new MockProvider();
    provider.send = () => Promise.resolve({ messageId: undefined as never });
    const backend = new MemoryDurability();
    const bot = new Bot({ provider, durability: { backend, instanceId: "t" } });
    const warnings: string[] = [];
    bot.on("warning", (w) => warnings.push(w.message));
    await bot.start();
    const result = await bot.send("c", "x", { idempotencyKey: "k" });
    expect(result.state).toBe("sent");
    expect(warnings[0]).toContain('"messageId"');
    expect((await backend.outbox.get("k"))?.state).toBe("sent");
    await bot.stop();
  });
});

describe("instanceId defaults", () => {
  const { hostname } = require("node:os") as typeof import("node:os");
  test("single-process backend: <hostname>/<botId>/<connectionId>", async () => {
    const bot = new Bot({ provider: new MockProvider(), id: "support", durability: { backend: new MemoryDurability() } });
    await bot.start();
    expect(bot.durability!.instanceId).toBe(`${hostname()}/support/mock`);
    await bot.stop();
  });
  test("shared backend: a per-boot suffix, so two processes on one host never share it", async () => {
    const shared = () => Object.assign(new MemoryDurability(), { scope: "shared" as const });
    const a = new Bot({ provider: new MockProvider(), durability: { backend: shared() } });
    const b = new Bot({ provider: new MockProvider(), durability: { backend: shared() } });
    await a.start();
    await b.start();
    expect(a.durability!.instanceId.startsWith(`${hostname()}/bot/mock/`)).toBe(true);
    expect(a.durability!.instanceId).not.toBe(b.durability!.instanceId);
    await a.stop();
    await b.stop();
  });
  test("host-scoped backend (SQLite): the single-process default, with a warning to set it per process", async () => {
    const host = Object.assign(new MemoryDurability(), { scope: "host" as const });
    const bot = new Bot({ provider: new MockProvider(), id: "support", durability: { backend: host } });
    const warnings: { code: string; message: string }[] = [];
    bot.on("warning", (w) => void warnings.push(w));
    await bot.start();
    expect(bot.durability!.instanceId).toBe(`${hostname()}/support/mock`);
    expect(warnings.map((w) => w.code)).toEqual(["default-instance-id"]);
    expect(warnings[0]!.message).toContain("durability.instanceId");
    await bot.stop();
    const explicit = new Bot({ provider: new MockProvider(), durability: { backend: host, instanceId: "p1" } });
    const none: unknown[] = [];
    explicit.on("warning", (w) => void none.push(w));
    await explicit.start();
    await explicit.stop();
    expect(none).toEqual([]);
  });
  test("sending before start() is refused", async () => {
    const bot = new Bot({ provider: new MockProvider(), durability: { backend: new MemoryDurability() } });
    await expect(bot.send("c", "x")).rejects.toThrow(/bot.start\(\)/);
  });
});
