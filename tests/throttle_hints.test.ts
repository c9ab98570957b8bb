// The outbox's line in front of the rate limiter remembers which buckets it knows empty: one per chat
// at most, so that memory stays bounded however many distinct chats (ids the senders choose) it sees.
import { describe, expect, test } from "bun:test";
import type { Clock } from "../src/clock.ts";
import { MemoryRateLimiter } from "../src/rate_limit.ts";
import { MAX_EMPTY_HINTS, Throttle } from "../src/throttle.ts";

function manualClock() {
  let t = 1_000_000;
  const clock: Clock = {
    now: () => t,
    monotonic: () => t,
    setTimeout: () => undefined,
    clearTimeout: () => {},
    random: () => 0.5,
  };
  return { clock, advance: (ms: number) => void (t += ms) };
}

function throttle(clock: Clock): Throttle {
  return new Throttle(
    { global: undefined, perChat: () => ({ count: 1, perMs: 1000 }), limiter: new MemoryRateLimiter({ clock, maxKeys: 100 }) },
    clock,
    "bot:1",
    () => {},
  );
}

describe("Throttle: buckets known empty", () => {
  test("hints of buckets that refilled go when new ones come: many distinct chats over time keep few", async () => {
    const { clock, advance } = manualClock();
    const line = throttle(clock);
    for (let i = 0; i < 20_000; i++) {
      await line.pause(line.chatBucket(`chat-${i}`)!, 500);
      advance(1000);
    }
    expect(line.emptyHints).toBeLessThanOrEqual(64);
    line.close();
  });

  test("at once, past the bound the oldest hints go", async () => {
    const { clock } = manualClock();
    const line = throttle(clock);
    for (let i = 0; i < MAX_EMPTY_HINTS + 5_000; i++) await line.pause(line.chatBucket(`chat-${i}`)!, 60_000);
    expect(line.emptyHints).toBe(MAX_EMPTY_HINTS);
    line.close();
  });

  test("a chat's own hint still holds its sends back while its bucket is empty", async () => {
    const { clock, advance } = manualClock();
    const line = throttle(clock);
    await line.pause(line.chatBucket("a")!, 5_000);
    for (let i = 0; i < 1_000; i++) await line.pause(line.chatBucket(`other-${i}`)!, 10);
    advance(100);
    await line.pause(line.chatBucket("late")!, 10);
    let settled = false;
    const admitted = line.admit("a", () => false).then((r) => {
      settled = true;
      return r;
    });
    await Promise.resolve();
    expect(settled).toBe(false);
    expect(line.waiting).toBe(1);
    line.close();
    expect(await admitted).toBe(false);
  });
});
