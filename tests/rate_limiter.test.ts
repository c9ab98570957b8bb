// The rate limiter conformance suite on every limiter: in memory (per replica), Postgres and Redis
// (shared by replicas; skipped when the server is not reachable), and the bucket arithmetic.
import { afterAll, describe, expect, test } from "bun:test";
import postgres from "postgres";
import IORedis from "ioredis";
import { MemoryRateLimiter } from "../mod.ts";
import { PostgresRateLimiter } from "../backends/postgres/mod.ts";
import { RedisRateLimiter } from "../backends/redis/mod.ts";
import { runRateLimiterConformance } from "../testing.ts";
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
