// TestClock: virtual time that moves when the process is quiet, held while tracked real work is in
// flight; and the clock options of the backends the conformance suites run in simulated time.
import { describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot, MemoryDurability } from "../mod.ts";
import { FileDurability } from "../backends/file/durability.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { MockProvider, TestClock, trackBackend } from "../testing.ts";

const realSleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

describe("TestClock", () => {
  test("sleeps cost no real time; now() and monotonic() move by the virtual delay", async () => {
    const clock = new TestClock({ start: 1_000_000 });
    try {
      const started = performance.now();
      await clock.sleep(3_600_000);
      expect(clock.now()).toBe(1_000_000 + 3_600_000);
      expect(clock.monotonic()).toBe(3_600_000);
      expect(performance.now() - started).toBeLessThan(1_000);
    } finally {
      clock.stop();
    }
  });

  test("timers fire in due order, ties in the order set; a cleared timer never fires", async () => {
    const clock = new TestClock({ start: 0 });
    try {
      const fired: string[] = [];
      clock.setTimeout(() => fired.push(`b@${clock.now()}`), 20);
      clock.setTimeout(() => fired.push(`a@${clock.now()}`), 10);
      clock.setTimeout(() => fired.push(`c@${clock.now()}`), 20);
      const cleared = clock.setTimeout(() => fired.push("cleared"), 15);
      clock.clearTimeout(cleared);
      clock.clearTimeout(undefined);
      clock.setTimeout(() => fired.push(`now@${clock.now()}`), -5);
      await clock.sleep(30);
      expect(fired).toEqual(["now@0", "a@10", "b@20", "c@20"]);
    } finally {
      clock.stop();
    }
  });

  test("time stands still while tracked work is in flight", async () => {
    const clock = new TestClock({ start: 0 });
    try {
      const seen: number[] = [];
      const work = clock.track(async () => {
        await realSleep(50);
        seen.push(clock.now());
        return "done";
      });
      const timer = clock.sleep(1).then(() => seen.push(clock.now()));
      expect(await work).toBe("done");
      await timer;
      expect(seen, "the work ended at virtual 0, before the 1 ms timer").toEqual([0, 1]);
      expect(clock.inFlight).toBe(0);
      // A synchronous throw is released too.
      await expect(clock.track(() => {
        throw new Error("sync");
      })).rejects.toThrow("sync");
      expect(clock.inFlight).toBe(0);
    } finally {
      clock.stop();
    }
  });

  test("a tracked call that hangs holds time only for hungAfterMs", async () => {
    const clock = new TestClock({ start: 0, hungAfterMs: 50 });
    try {
      void clock.track(new Promise(() => {}));
      const started = performance.now();
      await clock.sleep(10);
      expect(performance.now() - started).toBeGreaterThanOrEqual(40);
      expect(clock.inFlight).toBe(1);
    } finally {
      clock.stop();
    }
  });

  test("a backend view holds time during its calls and passes other members through", async () => {
    const clock = new TestClock();
    const raw = new MemoryDurability({ clock: () => clock.now() });
    const backend = trackBackend(raw, clock);
    try {
      expect(backend.name).toBe(raw.name);
      expect(backend.inbox).toBe(backend.inbox);
      const record = await backend.inbox.admit(
        { id: "m1", kind: "message", chatId: "c", provider: "p", payload: null, receivedAt: 0 },
        { owner: "o", incarnation: "i", leaseMs: 1_000 },
      );
      expect(record?.lease?.expiresAt).toBe(clock.now() + 1_000);
      expect(clock.inFlight).toBe(0);
      await clock.sleep(1_001);
      expect((await backend.inbox.claimDue({ owner: "o2", incarnation: "j", leaseMs: 1_000, limit: 10 })).length)
        .toBe(1);
    } finally {
      clock.stop();
    }
  });

  test("a bot on a TestClock: heartbeats and sweeps run in virtual time", async () => {
    const clock = new TestClock();
    try {
      const backend = new MemoryDurability({ clock: () => clock.now() });
      const provider = new MockProvider({ sendDelayMs: 5_000, clock });
      const bot = new Bot({
        clock,
        provider,
        durability: { backend, instanceId: "t", inbox: { leaseMs: 1_000 }, outbox: { leaseMs: 1_000 } },
      });
      bot.when("ping", (ctx) => ctx.reply("pong"));
      await bot.start();
      const started = performance.now();
      await provider.receive({ chatId: "c", text: "ping" });
      await bot.idle();
      expect(provider.sent.map((s) => s.content)).toEqual(["pong"]);
      expect(clock.elapsed, "the 5 s send took virtual time").toBeGreaterThanOrEqual(5_000);
      expect(performance.now() - started).toBeLessThan(5_000);
      expect(bot.durability!.metrics().staleLeases).toBe(0);
      await bot.stop();
    } finally {
      clock.stop();
    }
  });

  test("stop() drops pending timers; options are checked", async () => {
    const clock = new TestClock();
    let fired = false;
    clock.setTimeout(() => (fired = true), 1);
    clock.stop();
    await realSleep(20);
    expect(fired).toBe(false);
    expect(clock.stopped).toBe(true);
    expect(() => new TestClock({ start: Number.NaN })).toThrow(TypeError);
    expect(() => new TestClock({ quietTurns: 0 })).toThrow(TypeError);
    expect(() => new TestClock({ hungAfterMs: 0 })).toThrow(TypeError);
    expect(() => new TestClock({ random: 1 as never })).toThrow(TypeError);
    expect(new TestClock({ random: () => 0.25 }).random()).toBe(0.25);
  });
});

describe("backend clock options", () => {
  const lease = { owner: "o", incarnation: "i", leaseMs: 1_000 };
  const record = (id: string) => ({ id, kind: "message" as const, chatId: "c", provider: "p", payload: null, receivedAt: 0 });

  test("SQLiteDurability: leases and timestamps come from `clock`; a bad clock is refused", async () => {
    const dir = mkdtempSync(join(tmpdir(), "botmesh-clock-"));
    try {
      expect(() => new SQLiteDurability({ file: join(dir, "x.db"), clock: 5 as never })).toThrow(/"clock" must be a function/);
      let now = 1_000_000;
      const backend = new SQLiteDurability({ file: join(dir, "a.db"), clock: () => now });
      await backend.open();
      try {
        const r = await backend.inbox.admit(record("m1"), lease);
        expect([r?.updatedAt, r?.lease?.expiresAt]).toEqual([1_000_000, 1_001_000]);
        expect((await backend.inbox.claimDue({ ...lease, owner: "o2", limit: 10 })).length).toBe(0);
        now += 1_001;
        expect((await backend.inbox.claimDue({ ...lease, owner: "o2", limit: 10 })).length).toBe(1);
      } finally {
        await backend.close();
      }
      const bad = new SQLiteDurability({ file: join(dir, "b.db"), clock: () => Number.NaN });
      await bad.open();
      try {
        await expect(bad.inbox.admit(record("m2"), lease)).rejects.toThrow(/"clock" must return a finite number/);
      } finally {
        await bad.close();
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test("FileDurability: leases and timestamps come from `clock`, also after a reopen; a bad clock is refused", async () => {
    const dir = mkdtempSync(join(tmpdir(), "botmesh-clock-"));
    try {
      expect(() => new FileDurability({ path: join(dir, "x.json"), clock: "now" as never })).toThrow(/"clock" must be a function/);
      let now = 2_000_000;
      const path = join(dir, "bot.json");
      const a = new FileDurability({ path, clock: () => now });
      await a.open();
      const r = await a.inbox.admit(record("m1"), lease);
      expect([r?.updatedAt, r?.lease?.expiresAt]).toEqual([2_000_000, 2_001_000]);
      await a.close();
      const b = new FileDurability({ path, clock: () => now });
      await b.open();
      try {
        expect((await b.inbox.claimDue({ ...lease, owner: "o2", limit: 10 })).length).toBe(0);
        now += 1_001;
        const taken = await b.inbox.claimDue({ ...lease, owner: "o2", limit: 10 });
        expect(taken.map((t) => t.lease?.expiresAt)).toEqual([now + 1_000]);
      } finally {
        await b.close();
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
