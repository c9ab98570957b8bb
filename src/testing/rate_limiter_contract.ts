/**
 * The shared conformance suite of {@link RateLimiter}s: what the outbox
 * needs of any limiter (in memory, Postgres, Redis, or your own). It runs in
 * real time: the buckets' intervals are a few hundred ms, and nothing asserts
 * that the machine is fast, only that the limiter never admits more than
 * its rate.
 *
 * @module
 */
import type { RateBucket, RateLimiter } from "../contract.ts";
import type { ConformanceHarness } from "./conformance.ts";
import { uid } from "./util.ts";

/** Options of {@link runRateLimiterConformance}. */
export interface RateLimiterConformanceOptions {
  /** Named in the suite's title. */
  name: string;
  /** A fresh limiter for one test. */
  create: () => RateLimiter | Promise<RateLimiter>;
  /** Called after each test with the limiter it created. */
  cleanup?: (limiter: RateLimiter) => void | Promise<void>;
  harness: ConformanceHarness;
  /** A reason to skip the suite (the server is not reachable); `false` or absent runs it. */
  skip?: string | false;
  /**
   * Whether a bucket first used holds one send only, not its burst (the limiter keeps no state across
   * restarts, so it assumes the worst, as `MemoryRateLimiter` does) rather than being full (a shared
   * limiter's state outlives a process).
   */
  freshBucketsHoldOne: boolean;
}

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/**
 * Run the rate limiter conformance suite.
 * @param options the limiter factory, the test harness and what a fresh bucket holds
 */
export function runRateLimiterConformance(options: RateLimiterConformanceOptions): void {
  const { describe, test, expect } = options.harness;
  const run = (name: string, fn: (limiter: RateLimiter) => Promise<void>) => {
    if (options.skip) {
      (test.skip ?? test)(`${name} (skipped: ${options.skip})`, () => {});
      return;
    }
    test(name, async () => {
      const limiter = await options.create();
      try {
        await fn(limiter);
      } finally {
        await options.cleanup?.(limiter);
      }
    });
  };
  const bucket = (perMs: number, count = 1, burst = 1): RateBucket => ({ key: uid("bucket"), count, perMs, burst });
  /** Takes until one is admitted, sleeping what the limiter says: then the bucket is empty. */
  const drain = async (limiter: RateLimiter, buckets: RateBucket[]) => {
    for (let i = 0; i < 50; i++) {
      const answer = await limiter.take(buckets);
      if (answer.ok) return;
      expect(answer.waitMs, "a refusal says how long to wait").toBeGreaterThan(0);
      await sleep(answer.waitMs + 1);
    }
    throw new Error("the limiter admitted nothing in 50 rounds of waiting what it said");
  };

  describe(`rate limiter: ${options.name}`, () => {
    run("a fresh bucket is full (a shared limiter) or holds one send (an in-process one)", async (limiter) => {
      const b = bucket(3000, 1, 3);
      expect((await limiter.take([b])).ok, "one send at once").toBe(true);
      const second = await limiter.take([b]);
      if (options.freshBucketsHoldOne) {
        expect(second.ok, "not the burst").toBe(false);
        if (!second.ok) expect(second.waitMs).toBeLessThanOrEqual(3000);
      } else {
        expect(second.ok, "the burst").toBe(true);
        expect((await limiter.take([b])).ok, "the burst").toBe(true);
        expect((await limiter.take([b])).ok, "no more than the burst").toBe(false);
      }
    });

    run("an empty bucket refuses, names itself and says how long: at most one interval", async (limiter) => {
      const b = bucket(400);
      await drain(limiter, [b]);
      const refused = await limiter.take([b]);
      expect(refused.ok).toBe(false);
      if (refused.ok) return;
      expect(refused.key).toBe(b.key);
      expect(refused.waitMs).toBeGreaterThan(0);
      expect(refused.waitMs).toBeLessThanOrEqual(400);
      await sleep(refused.waitMs + 5);
      expect((await limiter.take([b])).ok, "refilled after the wait it said").toBe(true);
    });

    run("a take of several buckets is all or nothing, and names the one that holds it back", async (limiter) => {
      const roomy = bucket(300);
      const tight = bucket(2000);
      await drain(limiter, [roomy]);
      await sleep(320); // roomy holds one send again
      await drain(limiter, [tight]);
      const refused = await limiter.take([roomy, tight]);
      expect(refused.ok).toBe(false);
      if (!refused.ok) expect(refused.key, "the empty bucket").toBe(tight.key);
      expect((await limiter.take([roomy])).ok, "nothing was taken from the other bucket").toBe(true);
    });

    run("never more than the burst plus the rate: sequential and concurrent takes", async (limiter) => {
      const interval = 250;
      const b = bucket(1000, 4, 3);
      await drain(limiter, [b]);
      await sleep(3 * interval + 20); // full: the burst of 3
      const startedAt = Date.now();
      const answers = await Promise.all(Array.from({ length: 12 }, () => limiter.take([b])));
      const elapsed = Date.now() - startedAt;
      const admitted = answers.filter((a) => a.ok).length;
      expect(admitted, "the burst was there").toBeGreaterThanOrEqual(3);
      expect(admitted, "no more than the burst and what refilled meanwhile").toBeLessThanOrEqual(3 + Math.ceil(elapsed / interval));
      // Sequential takes for a while: never more than the rate allows.
      const rate = bucket(500, 5, 1);
      await drain(limiter, [rate]);
      const from = Date.now();
      let ok = 0;
      while (Date.now() - from < 700) {
        if ((await limiter.take([rate])).ok) ok++;
        await sleep(5);
      }
      const span = Date.now() - from;
      expect(ok, `at most one per 100 ms in ${span} ms`).toBeLessThanOrEqual(Math.floor(span / 100) + 1);
      expect(ok, "it admits at its rate, not never").toBeGreaterThan(0);
    });

    run("pause holds a bucket for the given time, even a full one; other buckets go on", async (limiter) => {
      const b = bucket(100);
      const other = bucket(100);
      await drain(limiter, [b]);
      await drain(limiter, [other]);
      await sleep(120);
      await limiter.pause(b, 600);
      const refused = await limiter.take([b]);
      expect(refused.ok).toBe(false);
      if (!refused.ok) {
        expect(refused.waitMs, "about the pause").toBeGreaterThan(400);
        expect(refused.waitMs).toBeLessThanOrEqual(600);
      }
      expect((await limiter.take([other])).ok, "another bucket is not paused").toBe(true);
      // A shorter pause never shortens a longer one.
      await limiter.pause(b, 10);
      expect((await limiter.take([b])).ok).toBe(false);
      // A bucket never used can be paused too.
      const fresh = bucket(100);
      await limiter.pause(fresh, 500);
      const held = await limiter.take([fresh]);
      expect(held.ok).toBe(false);
      if (!held.ok) expect(held.waitMs).toBeGreaterThan(300);
    });

    run("keys are opaque: any text, kept apart", async (limiter) => {
      const base = uid("k");
      const keys = [`${base}:chat:-100123`, `${base}/bot/ü ✓`, `${base}:chat:-100123 `, `${base}'; DROP TABLE x; --`];
      const buckets = keys.map((key) => ({ key, count: 1, perMs: 1000, burst: 1 }));
      await drain(limiter, [buckets[0]!]);
      for (const b of buckets.slice(1)) {
        const answer = await limiter.take([b]);
        if (!answer.ok) expect(answer.key, "refused only by its own bucket").toBe(b.key);
      }
      const again = await limiter.take([buckets[0]!]);
      expect(again.ok, "the first key's bucket is its own").toBe(false);
    });
  });
}
