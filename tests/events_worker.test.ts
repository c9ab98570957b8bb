import { describe, expect, test } from "bun:test";
import { BOT_CHANNEL, type EventRecord, type LeasedEventJournal } from "../src/events/types.ts";
import { MemoryEventJournal } from "../backends/events/memory_journal.ts";
import { EventsDurability } from "../backends/events/durability.ts";
import { EventWorker, type EventWorkerOptions } from "../src/events/worker.ts";

const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

function worker(journal: LeasedEventJournal, options: Partial<EventWorkerOptions> = {}): EventWorker {
  return new EventWorker({
    journal,
    instanceId: "host/worker",
    handler: () => {},
    pollIntervalMs: 10,
    ...options,
  });
}

/** Resolves when `check` holds, polling; fails after `ms`. */
async function until(check: () => boolean | Promise<boolean>, ms = 5_000): Promise<void> {
  const end = Date.now() + ms;
  while (!(await check())) {
    if (Date.now() > end) throw new Error("condition not reached in time");
    await sleep(5);
  }
}

describe("EventWorker", () => {
  test("handles and completes the events without a channel, never the bot's or another channel's", async () => {
    const journal = new MemoryEventJournal();
    const backend = new EventsDurability({ journal });
    await backend.inbox.admit({ id: "m1", kind: "message", chatId: "c", provider: "p", payload: null, receivedAt: 1 });
    await journal.append({ id: "bot-raw", channel: BOT_CHANNEL, eventType: "x", payload: null });
    await journal.append({ id: "other", channel: "billing", eventType: "x", payload: null });
    const seen: string[] = [];
    const w = worker(journal, { handler: (event) => void seen.push(event.id) });
    w.start();
    for (let i = 0; i < 5; i++) await journal.append({ id: `e${i}`, eventType: "order.paid", payload: { i }, createdAt: 10 - i });
    await w.idle();
    await w.stop();
    expect(seen.sort()).toEqual(["e0", "e1", "e2", "e3", "e4"]);
    for (const id of seen) expect((await journal.get(id))?.state).toBe("done");
    expect((await journal.get("m1"))?.state).toBe("pending");
    expect((await journal.get("bot-raw"))?.state).toBe("pending");
    expect((await journal.get("other"))?.state).toBe("pending");
    expect((await journal.get("m1"))?.attempts).toBe(0);
  });

  test("start() during stop() takes effect once the stop is done", async () => {
    const journal = new MemoryEventJournal();
    let release!: () => void;
    const gate = new Promise<void>((r) => release = r);
    const seen: string[] = [];
    const w = worker(journal, {
      handler: async (event) => {
        seen.push(event.id);
        if (event.id === "slow") await gate;
      },
    });
    await journal.append({ id: "slow", eventType: "x", payload: null });
    w.start();
    await until(() => seen.includes("slow"));
    const stopping = w.stop();
    w.start(); // while the stop waits for the slow handler
    release();
    await stopping;
    expect(w.running, "running again after the stop").toBe(true);
    await journal.append({ id: "after", eventType: "x", payload: null });
    await until(async () => (await journal.get("after"))?.state === "done");
    await w.stop();
    expect(w.running).toBe(false);
  });

  test("a worker of a channel handles that channel only, oldest createdAt first", async () => {
    const journal = new MemoryEventJournal();
    await journal.append({ id: "late", channel: "billing", eventType: "x", payload: null, createdAt: 20 });
    await journal.append({ id: "early", channel: "billing", eventType: "x", payload: null, createdAt: 10 });
    await journal.append({ id: "plain", eventType: "x", payload: null });
    const seen: string[] = [];
    const w = worker(journal, { channel: "billing", handler: (event) => void seen.push(event.id) });
    expect(w.channel).toBe("billing");
    w.start();
    await w.idle();
    await w.stop();
    expect(seen).toEqual(["early", "late"]);
    expect((await journal.get("plain"))?.state).toBe("pending");
  });

  test("a throwing handler is retried with backoff, then dead after `retries`", async () => {
    const journal = new MemoryEventJournal();
    const attempts: number[] = [];
    const dead: { event: EventRecord; error: string }[] = [];
    const errors: string[] = [];
    const w = worker(journal, {
      retries: 2,
      backoff: { baseMs: 1, capMs: 1 },
      random: () => 0,
      handler: (_event, ctx) => {
        attempts.push(ctx.attempt);
        throw new Error(`boom ${ctx.attempt}`);
      },
    });
    w.on("dead", (payload) => dead.push(payload));
    w.on("error", ({ phase, error }) => errors.push(`${phase}: ${(error as Error).message}`));
    await journal.append({ id: "e", eventType: "x", payload: null });
    w.start();
    await until(() => dead.length > 0);
    await w.stop();
    expect(attempts).toEqual([1, 2, 3]);
    expect(errors).toEqual(["handler: boom 1", "handler: boom 2", "handler: boom 3"]);
    expect(dead.length).toBe(1);
    expect(dead[0].event.id).toBe("e");
    expect(dead[0].error).toBe("boom 3");
    const record = (await journal.get("e"))!;
    expect(record.state).toBe("dead");
    expect(record.attempts).toBe(3);
    expect(record.error).toBe("boom 3");
  });

  test("the retry delay is exponential with full jitter", async () => {
    let now = 1_000_000;
    const journal = new MemoryEventJournal({ clock: () => now });
    const w = worker(journal, {
      backoff: { baseMs: 1_000, capMs: 3_000 },
      random: () => 0.5,
      handler: () => {
        throw new Error("no");
      },
    });
    await journal.append({ id: "e", eventType: "x", payload: null });
    w.start();
    const delays: number[] = [];
    for (let attempt = 1; attempt <= 3; attempt++) {
      await until(async () => (await journal.get("e"))?.attempts === attempt && (await journal.get("e"))?.state === "failed");
      const r = (await journal.get("e"))!;
      delays.push(r.nextAttemptAt! - r.updatedAt);
      now = r.nextAttemptAt!;
    }
    await w.stop();
    // 0.5 × min(cap, base × 2^(attempt-1)): 500, 1000, 1500 (capped at 3000).
    expect(delays).toEqual([500, 1_000, 1_500]);
  });

  test("heartbeats keep the lease of a long handler; nobody else takes the event", async () => {
    const journal = new MemoryEventJournal();
    await journal.append({ id: "slow", eventType: "x", payload: null });
    let stolen: EventRecord[] = [];
    const stale: unknown[] = [];
    const w = worker(journal, {
      leaseMs: 60,
      handler: async () => {
        await sleep(250);
        stolen = await journal.claimDue({ owner: "thief", incarnation: "t", leaseMs: 1_000, limit: 10 });
      },
    });
    w.on("stale", (payload) => stale.push(payload));
    w.start();
    await w.idle();
    await w.stop();
    expect(stolen).toEqual([]);
    expect(stale).toEqual([]);
    const record = (await journal.get("slow"))!;
    expect(record.state).toBe("done");
    expect(record.fence).toBe(2); // its one claim (an append without a lease is claimed under 2)
  });

  test("a lost lease aborts the handler's signal, emits 'stale' and writes no outcome", async () => {
    const journal = new MemoryEventJournal();
    // A journal whose heartbeats are refused: the lease is taken by another claimer meanwhile.
    const refusing: LeasedEventJournal = Object.assign(Object.create(journal) as LeasedEventJournal, {
      heartbeat: async () => false,
      start: (id: string, token: number, attempt: number) => journal.start(id, token, attempt),
      claimDue: (o: Parameters<LeasedEventJournal["claimDue"]>[0]) => journal.claimDue(o),
      complete: (id: string, token: number) => journal.complete(id, token),
      fail: (id: string, token: number, outcome: Parameters<LeasedEventJournal["fail"]>[2]) => journal.fail(id, token, outcome),
    });
    await journal.append({ id: "e", eventType: "x", payload: null });
    const stale: string[] = [];
    let aborted = false;
    const w = worker(refusing, {
      leaseMs: 30,
      handler: async (_event, ctx) => {
        await new Promise<void>((resolve) => ctx.signal.addEventListener("abort", () => resolve()));
        aborted = ctx.signal.aborted;
      },
    });
    w.on("stale", ({ event, phase }) => stale.push(`${event.id}:${phase}`));
    w.start();
    await until(() => aborted);
    await w.stop();
    expect(stale).toEqual(["e:heartbeat"]);
    const record = (await journal.get("e"))!;
    expect(record.state).toBe("processing");
    expect(record.attempts).toBe(1);
  });

  test("an outcome fenced off by a newer lease emits 'stale' and changes nothing", async () => {
    const journal = new MemoryEventJournal();
    await journal.append({ id: "e", eventType: "x", payload: null });
    const stale: string[] = [];
    let taken: EventRecord[] = [];
    const w = worker(journal, {
      leaseMs: 60_000,
      handler: async () => {
        // The same instanceId restarted elsewhere takes the lease back at once (reclaimOwn).
        taken = await journal.claimDue({ owner: "host/worker", incarnation: "next", leaseMs: 60_000, reclaimOwn: true, limit: 10 });
      },
    });
    w.on("stale", ({ event, phase }) => stale.push(`${event.id}:${phase}`));
    w.start();
    await until(() => stale.length > 0);
    await w.stop();
    expect(taken.map((r) => r.id)).toEqual(["e"]);
    expect(stale).toEqual(["e:complete"]);
    const record = (await journal.get("e"))!;
    expect(record.state).toBe("processing");
    expect(record.lease?.incarnation).toBe("next");
    expect(record.fence).toBe(3);
  });

  test("concurrency bounds the handlers running at once", async () => {
    const journal = new MemoryEventJournal();
    for (let i = 0; i < 9; i++) await journal.append({ id: `e${i}`, eventType: "x", payload: null });
    let running = 0;
    let peak = 0;
    const w = worker(journal, {
      concurrency: 3,
      handler: async () => {
        running++;
        peak = Math.max(peak, running);
        await sleep(30);
        running--;
      },
    });
    w.start();
    await w.idle();
    await w.stop();
    expect(peak).toBe(3);
    expect((await journal.list({ state: "done" })).length).toBe(9);
  });

  test("events of one orderKey run one at a time, in order; other keys and events without a key run meanwhile", async () => {
    const journal = new MemoryEventJournal();
    let release!: () => void;
    const gate = new Promise<void>((r) => release = r);
    const started: string[] = [];
    const w = worker(journal, {
      concurrency: 6,
      handler: async (event) => {
        started.push(event.id);
        if (event.id === "k1-a") await gate;
      },
    });
    for (const id of ["k1-a", "k1-b", "k2-a", "k1-c", "k2-b"]) {
      await journal.append({ id, orderKey: id.slice(0, 2), eventType: "x", payload: null });
    }
    await journal.append({ id: "plain", eventType: "x", payload: null });
    w.start();
    await until(() => started.length === 4);
    await sleep(30);
    expect(started).toEqual(["k1-a", "k2-a", "plain", "k2-b"]);
    expect((await journal.get("k1-b"))?.state, "leased, waiting for k1-a").toBe("processing");
    release();
    await w.idle();
    await w.stop();
    expect(started.filter((id) => id.startsWith("k1"))).toEqual(["k1-a", "k1-b", "k1-c"]);
    expect((await journal.list({ state: "done" })).length).toBe(6);
  });

  test("a failed event waiting for its retry does not hold back the next ones of its key", async () => {
    const journal = new MemoryEventJournal();
    const seen: string[] = [];
    const w = worker(journal, {
      backoff: { baseMs: 60_000, capMs: 60_000 },
      handler: (event) => {
        seen.push(event.id);
        if (event.id === "first") throw new Error("later");
      },
    });
    await journal.append({ id: "first", orderKey: "k", eventType: "x", payload: null });
    await journal.append({ id: "second", orderKey: "k", eventType: "x", payload: null });
    w.start();
    await w.idle();
    await w.stop();
    expect(seen).toEqual(["first", "second"]);
    expect((await journal.get("first"))?.state).toBe("failed");
    expect((await journal.get("second"))?.state).toBe("done");
  });

  test("two workers never run events of one key at once, and run each key in order; waiting leases are kept alive", async () => {
    const journal = new MemoryEventJournal();
    const keys = ["k1", "k2"];
    for (let i = 0; i < 6; i++) {
      for (const key of keys) await journal.append({ id: `${key}-${i}`, orderKey: key, eventType: "x", payload: i });
    }
    const active = new Map<string, number>();
    const order = new Map<string, number[]>();
    const overlaps: string[] = [];
    const stale: string[] = [];
    const handler = async (event: EventRecord): Promise<void> => {
      const key = event.orderKey!;
      if (active.get(key)) overlaps.push(event.id);
      active.set(key, (active.get(key) ?? 0) + 1);
      order.set(key, [...order.get(key) ?? [], event.payload as number]);
      await sleep(15);
      active.set(key, active.get(key)! - 1);
    };
    const workers = ["host/w1", "host/w2"].map((instanceId) => worker(journal, { instanceId, concurrency: 4, leaseMs: 60, handler }));
    for (const w of workers) {
      w.on("stale", ({ event }) => stale.push(event.id));
      w.start();
    }
    await until(async () => (await journal.list({ state: "done" })).length === 12);
    for (const w of workers) await w.stop();
    expect(overlaps).toEqual([]);
    expect(stale).toEqual([]);
    for (const key of keys) expect(order.get(key), key).toEqual([0, 1, 2, 3, 4, 5]);
  });

  test("stop() waits for running handlers and their outcomes; no claim after stop", async () => {
    const journal = new MemoryEventJournal();
    await journal.append({ id: "e", eventType: "x", payload: null });
    let started = false;
    const w = worker(journal, {
      handler: async () => {
        started = true;
        await sleep(100);
      },
    });
    w.start();
    await until(() => started);
    expect(w.running).toBe(true);
    await w.stop();
    expect(w.running).toBe(false);
    expect((await journal.get("e"))?.state).toBe("done");
    await journal.append({ id: "after", eventType: "x", payload: null });
    await sleep(50);
    expect((await journal.get("after"))?.state).toBe("pending");
    await w.idle(); // stopped: resolves at once
  });

  test("a restarted worker with the same instanceId takes back its previous run's leases at once", async () => {
    const journal = new MemoryEventJournal();
    await journal.append({ id: "held", eventType: "x", payload: null }, {
      owner: "host/worker",
      incarnation: "previous-run",
      leaseMs: 600_000,
    });
    await journal.append({ id: "other-owner", eventType: "x", payload: null }, {
      owner: "someone-else",
      incarnation: "x",
      leaseMs: 600_000,
    });
    const seen: string[] = [];
    const w = worker(journal, { handler: (event) => void seen.push(event.id) });
    w.start();
    await w.idle();
    await w.stop();
    expect(seen).toEqual(["held"]);
    expect((await journal.get("held"))?.fence).toBe(2);
    expect((await journal.get("other-owner"))?.state).toBe("processing");
  });

  test("a journal error is reported as 'error' (phase claim) and idle() does not hang", async () => {
    const journal = new MemoryEventJournal();
    await journal.close();
    const errors: string[] = [];
    const w = worker(journal);
    w.on("error", ({ phase }) => errors.push(phase));
    w.start();
    await w.idle();
    await w.stop();
    expect(errors.length).toBeGreaterThan(0);
    expect(errors.every((phase) => phase === "claim")).toBe(true);
  });

  test("options are checked, naming the option", () => {
    const journal = new MemoryEventJournal();
    const base = { journal, instanceId: "w", handler: () => {} };
    const cases: [Record<string, unknown>, string, ErrorConstructor][] = [
      [{ journal: null }, "journal", TypeError],
      [{ handler: 5 }, "handler", TypeError],
      [{ instanceId: "" }, "instanceId", TypeError],
      [{ channel: 5 }, "channel", TypeError],
      [{ channel: BOT_CHANNEL }, "channel", RangeError],
      [{ leaseMs: 0 }, "leaseMs", RangeError],
      [{ leaseMs: "1s" }, "leaseMs", TypeError],
      [{ retries: -1 }, "retries", RangeError],
      [{ retries: 1.5 }, "retries", RangeError],
      [{ backoff: { baseMs: 10, capMs: 5 } }, "capMs", RangeError],
      [{ backoff: { baseMs: Number.NaN } }, "baseMs", TypeError],
      [{ concurrency: 0 }, "concurrency", RangeError],
      [{ pollIntervalMs: -5 }, "pollIntervalMs", RangeError],
      [{ random: 1 }, "random", TypeError],
    ];
    for (const [bad, name, kind] of cases) {
      let error: unknown = null;
      try {
        new EventWorker({ ...base, ...bad } as unknown as EventWorkerOptions);
      } catch (e) {
        error = e;
      }
      expect(error instanceof kind, `${name}: ${String(error)}`).toBe(true);
      expect((error as Error).message.includes(name), (error as Error).message).toBe(true);
    }
    expect(() => new EventWorker(undefined as unknown as EventWorkerOptions)).toThrow(TypeError);
  });
});
