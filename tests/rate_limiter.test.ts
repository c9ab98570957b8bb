// The rate limiter conformance suite on every limiter: in memory (per replica), Postgres and Redis
// (shared by replicas; skipped when the server is not reachable), and the bucket arithmetic.
import { afterAll, describe, expect, test } from "bun:test";
import postgres from "postgres";
import IORedis from "ioredis";
import { Bot, MemoryDurability, MemoryRateLimiter } from "../mod.ts";
import { PostgresRateLimiter } from "../backends/postgres/mod.ts";
import { RedisRateLimiter } from "../backends/redis/mod.ts";
import { MockProvider, runRateLimiterConformance } from "../testing.ts";
import { gcraPause, gcraStep } from "../backend.ts";
import type { Clock } from "../src/clock.ts";
import { POSTGRES_URL, REDIS_URL, runId, serviceSkip } from "./support/services.ts";

const harness = { describe, test, expect };
const pgSkip = await serviceSkip("postgres");
const redisSkip = await serviceSkip("redis");
const sql = pgSkip ? null : postgres(POSTGRES_URL, { max: 10, onnotice: () => {} });
const redis = redisSkip ? null : new IORedis(REDIS_URL);
const schema = `rl_${runId()}`;
afterAll(async () => {
  await sql?.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
  await sql?.end();
  redis?.disconnect();
});

runRateLimiterConformance({ name: "memory", harness, freshBucketsHoldOne: true, create: () => new MemoryRateLimiter() });
runRateLimiterConformance({
  name: "postgres",
  harness,
  skip: pgSkip,
  freshBucketsHoldOne: false,
  create: () => new PostgresRateLimiter({ sql: sql!, schema }),
});
runRateLimiterConformance({
  name: "redis",
  harness,
  skip: redisSkip,
  freshBucketsHoldOne: false,
  create: () => new RedisRateLimiter({ client: redis!, keyPrefix: `rl-${runId()}:` }),
});

describe("rate limiter arithmetic and options", () => {
  test("GCRA: a burst, then one per interval; a pause holds it back", () => {
    const b = { key: "k", count: 2, perMs: 1000, burst: 3 };
    let tat = 0;
    const admitted: number[] = [];
    for (let now = 1000; now <= 3000; now += 100) {
      for (;;) {
        const step = gcraStep(tat, b, now);
        if (step.waitMs > 0) break;
        tat = step.next;
        admitted.push(now);
      }
    }
    expect(admitted.slice(0, 3), "the burst of 3 at once").toEqual([1000, 1000, 1000]);
    expect(admitted.slice(3), "then one per 500 ms").toEqual([1500, 2000, 2500, 3000]);
    const paused = gcraPause(tat, b, 3000, 2000);
    expect(gcraStep(paused, b, 4999).waitMs).toBeGreaterThan(0);
    expect(gcraStep(paused, b, 5000).waitMs).toBe(0);
  });

  test("MemoryRateLimiter: one send at the start, not the burst; on its clock; refuses unknown options", async () => {
    let t = 5_000;
    const clock: Clock = { now: () => t, monotonic: () => t, setTimeout: () => 0, clearTimeout: () => {}, random: () => 0 };
    const limiter = new MemoryRateLimiter({ clock });
    const b = { key: "c", count: 1, perMs: 1000, burst: 2 };
    expect((await limiter.take([b])).ok, "one send at the start").toBe(true);
    expect(await limiter.take([b])).toEqual({ ok: false, waitMs: 1000, key: "c" });
    t += 2000;
    expect((await limiter.take([b])).ok).toBe(true);
    expect((await limiter.take([b])).ok).toBe(true);
    expect((await limiter.take([b])).ok).toBe(false);
    expect(() => new MemoryRateLimiter({ clok: clock } as never)).toThrow(/clok/);
    expect(() => new PostgresRateLimiter({} as never)).toThrow(/"sql"/);
    expect(() => new PostgresRateLimiter({ sql: { unsafe() {} }, purgeBatchSize: 3 } as never)).toThrow(/purgeBatchSize/);
    expect(() => new RedisRateLimiter({ client: 1 })).toThrow(/"client"/);
  });
});

describe("MemoryRateLimiter's maxKeys", () => {
  test("the buckets kept never pass maxKeys under a burst of distinct keys, one by one or concurrent", async () => {
    let t = 1_000_000;
    const clock: Clock = { now: () => t, monotonic: () => t, setTimeout: () => 0, clearTimeout: () => {}, random: () => 0 };
    const limiter = new MemoryRateLimiter({ clock, maxKeys: 50 });
    // A slow rate: every bucket taken stays not yet full for a minute, none is free to forget.
    const chat = (i: number) => ({ key: `chat:${i}`, count: 1, perMs: 60_000, burst: 1 });
    const global = { key: "global", count: 1000, perMs: 1000, burst: 1 };
    let most = 0;
    for (let i = 0; i < 500; i++) {
      t += 1;
      expect((await limiter.take([global, chat(i)])).ok).toBe(true);
      most = Math.max(most, limiter.size);
    }
    const results = await Promise.all(
      Array.from({ length: 2_000 }, (_, i) => limiter.take([chat(500 + i)]).then((r) => (most = Math.max(most, limiter.size), r))),
    );
    expect(results.every((r) => r.ok)).toBe(true);
    for (let i = 0; i < 20; i++) {
      await limiter.pause(chat(10_000 + i), 5_000);
      most = Math.max(most, limiter.size);
    }
    expect(most).toBe(50);
    // The buckets used last are kept (the chat just taken still waits its minute), the ones idle longest went.
    expect(await limiter.take([chat(2_499)])).toMatchObject({ ok: false, key: "chat:2499" });
    expect(await limiter.take([chat(10_019)])).toMatchObject({ ok: false, key: "chat:10019" });
    expect((await limiter.take([chat(0)])).ok, "a bucket forgotten starts full").toBe(true);
  });

  test("maxKeys must be a positive integer, the error names it", () => {
    for (const bad of [0, -1, 1.5, Number.NaN, "10"]) {
      expect(() => new MemoryRateLimiter({ maxKeys: bad as never })).toThrow(/"maxKeys" must be a positive integer, got/);
    }
    expect(new MemoryRateLimiter({ maxKeys: 1 }).size).toBe(0);
  });
});

describe("the outbox in front of a limiter", () => {
  const durability = (rateLimit: unknown) => ({
    backend: new MemoryDurability(),
    instanceId: `rl-${runId()}`,
    sweepIntervalMs: 20,
    outbox: { leaseMs: 2_000, rateLimit },
  }) as never;

  test("a shared limiter that fails: sends go on, metered by this process, and the failure is reported, not once per send", async () => {
    let takes = 0;
    const broken = {
      name: "broken",
      scope: "shared" as const,
      take: () => {
        takes++;
        return Promise.reject(new Error("ECONNREFUSED"));
      },
      pause: () => Promise.reject(new Error("ECONNREFUSED")),
    };
    const provider = new MockProvider();
    const bot = new Bot({
      provider,
      durability: durability({ global: { count: 1000, perMs: 1000 }, perChat: { count: 1, perMs: 60_000 }, limiter: broken }),
    });
    const errors: string[] = [];
    bot.on("error", (error) => errors.push(error.message));
    await bot.start();
    try {
      for (let i = 0; i < 20; i++) await bot.enqueue(`c${i}`, `x${i}`);
      const reply = await bot.send("z", "now");
      expect(reply.state).toBe("sent");
      const second = bot.send("z", "again"); // the chat's own limit still holds: 1 a minute
      second.catch(() => {});
      for (let i = 0; i < 400 && provider.sent.length < 21; i++) await new Promise((resolve) => setTimeout(resolve, 10));
      await new Promise((resolve) => setTimeout(resolve, 100));
      expect(provider.sent.filter((s) => s.chatId !== "z").length, "the broadcast went out").toBe(20);
      expect(provider.sent.filter((s) => s.chatId === "z").map((s) => s.content), "metered: the second waits for the chat's slot").toEqual(["now"]);
      expect(takes).toBeGreaterThan(20);
      expect(errors.length, "reported once, then at most once a minute").toBe(1);
      expect(errors[0]).toContain('Rate limiter "broken" failed');
    } finally {
      await bot.stop();
    }
  });

  test("a bad rate from a perChat function is reported naming the chat and field; the send still goes out", async () => {
    const provider = new MockProvider();
    const bot = new Bot({ provider, durability: durability({ perChat: () => ({ count: 0, perMs: 1000 }) }) });
    const errors: string[] = [];
    bot.on("error", (error) => errors.push(error.message));
    await bot.start();
    try {
      expect((await bot.send("c1", "hi")).state).toBe("sent");
      expect(errors.some((m) => m.includes('Option "durability.outbox.rateLimit.perChat("c1").count" must be between 1')), errors.join(" | ")).toBe(true);
    } finally {
      await bot.stop();
    }
  });

  test("a reply made now goes ahead of a broadcast waiting for the limiter", async () => {
    const provider = new MockProvider();
    const bot = new Bot({ provider, durability: durability({ global: { count: 40, perMs: 1000 }, perChat: false }) });
    await bot.start();
    try {
      for (let i = 0; i < 60; i++) await bot.enqueue(`b${i}`, `broadcast ${i}`);
      while (provider.sent.length < 2) await new Promise((resolve) => setTimeout(resolve, 5));
      const reply = await bot.send("user", "your answer");
      expect(reply.state).toBe("sent");
      const position = provider.sent.findIndex((s) => s.chatId === "user");
      expect(position, `the reply went out at position ${position} of 61, ahead of the waiting broadcast`).toBeLessThan(10);
    } finally {
      await bot.stop();
    }
  }, 30_000);
});
