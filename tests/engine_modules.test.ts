// The engine's modules alone, on TestClock with MemoryDurability: the sweeper's wake-ups and the
// leases (hold, hand on, renew, lose, the claim-scan gate), settling, outcome writes, the ambiguity
// handling (report, settle by a delivery status or the provider's confirm) and the operator surface.
import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../mod.ts";
import { TestClock } from "../testing.ts";
import { Leases } from "../src/engine/leases.ts";
import type { DurabilityWarning } from "../src/engine/types.ts";
import { Wakeups } from "../src/engine/wakeups.ts";
import { Settling } from "../src/engine/settling.ts";
import { Outcomes } from "../src/engine/outcomes.ts";
import { Ambiguity } from "../src/engine/ambiguity.ts";
import { operatorControl } from "../src/engine/control.ts";
import { type BotEvents, zeroMetrics } from "../src/engine/types.ts";
import { Emitter } from "../src/emitter.ts";
import { resolveDurability } from "../src/config.ts";
import { MockProvider } from "../testing.ts";
import type { SendInQuestion, Provider } from "../src/provider.ts";

function setup(leaseMs = 300) {
  const clock = new TestClock({ start: 1_700_000_000_000 });
  const backend = new MemoryDurability({ clock: () => clock.now() });
  const warnings: DurabilityWarning[] = [];
  const errors: string[] = [];
  let halted = false;
  const leases = new Leases({
    backend,
    clock,
    leaseMs: { inbox: leaseMs, outbox: leaseMs },
    halted: () => halted,
    warn: (w) => warnings.push(w),
    report: (error, context) => errors.push(`${context}: ${String(error)}`),
  });
  const claimer = (owner = "me", ms = leaseMs) => ({ owner, incarnation: "i1", leaseMs: ms });
  const message = (id: string, chatId = "c") => ({ id, kind: "message" as const, chatId, provider: "p", payload: {}, receivedAt: clock.now() });
  return { clock, backend, leases, warnings, errors, claimer, message, halt: () => halted = true };
}

describe("Wakeups", () => {
  test("one timer for many wake-ups: each fires at its time, none early, the earliest first; clear() forgets them", async () => {
    const clock = new TestClock({ start: 0 });
    try {
      const fired: number[] = [];
      let active = true;
      const w = new Wakeups(clock, () => fired.push(clock.monotonic()), () => active);
      w.wake(500);
      w.wake(100);
      w.wake(300);
      await clock.sleep(1_000);
      expect(fired.length).toBe(3);
      expect(fired[0]!).toBeGreaterThanOrEqual(100);
      expect(fired[1]!).toBeGreaterThanOrEqual(300);
      expect(fired[2]!).toBeGreaterThanOrEqual(500);
      w.wake(200);
      w.clear();
      await clock.sleep(1_000);
      expect(fired.length, "cleared").toBe(3);
      active = false;
      w.wake(0);
      await clock.sleep(100);
      expect(fired.length, "not active: nothing armed").toBe(3);
    } finally {
      clock.stop();
    }
  });
});

describe("Leases", () => {
  test("hold returns the held lease of that token; handOn moves it to a new token; a lease given up uncalled is remembered", async () => {
    const { clock, leases } = setup();
    try {
      const a = leases.hold("inbox", "m1", 1);
      expect(leases.hold("inbox", "m1", 1)).toBe(a);
      expect(leases.get("inbox", "m1")).toBe(a);
      expect(leases.has("outbox", "m1")).toBe(false);
      leases.handOn(a, 2, clock.monotonic(), 1);
      expect([a.token, a.attempts]).toEqual([2, 1]);
      leases.release("inbox", "m1", 1);
      expect(leases.get("inbox", "m1"), "a release under an old token keeps the lease").toBe(a);
      leases.release("inbox", "m1", 2);
      expect(leases.get("inbox", "m1")).toBe(undefined);
      const b = leases.hold("outbox", "k1", 3);
      expect(leases.givenUpUncalled("k1", 3), "held, not given up").toBe(false);
      leases.markUncalled(b.id, b.token);
      expect([leases.givenUpUncalled("k1", 3), leases.givenUpUncalled("k1", 4)]).toEqual([true, false]);
    } finally {
      clock.stop();
    }
  });

  test("heartbeat rounds keep a held lease alive past its length; a lease taken elsewhere is lost and warned about once", async () => {
    const { clock, backend, leases, warnings, claimer, message } = setup(300);
    try {
      const r = (await backend.inbox.admit(message("m1"), claimer()))!;
      const lease = leases.hold("inbox", "m1", r.fence);
      for (let i = 0; i < 6; i++) {
        await clock.sleep(leases.heartbeatEveryMs);
        await leases.heartbeat();
      }
      expect(clock.monotonic()).toBeGreaterThan(300);
      expect(await backend.inbox.claim("m1", claimer("other")), "renewed: not claimable elsewhere").toBe(null);
      expect(lease.lost).toBe(false);
      // Another owner takes it once it lapses.
      await clock.sleep(400);
      expect(await backend.inbox.claim("m1", claimer("other"))).not.toBe(null);
      expect(await leases.renew(lease)).toBe("lost");
      expect(lease.lost).toBe(true);
      expect(warnings.map((w) => w.code)).toEqual(["lease-lost"]);
      await leases.heartbeat();
      expect(warnings.length, "a lost lease is not renewed again").toBe(1);
    } finally {
      clock.stop();
    }
  });

  test("a renewal that finds the record settled by its own outcome is lost without a warning", async () => {
    const { clock, backend, leases, warnings, claimer, message } = setup();
    try {
      const r = (await backend.inbox.admit(message("m1"), claimer()))!;
      const lease = leases.hold("inbox", "m1", r.fence);
      lease.settling = "final";
      await backend.inbox.complete("m1", r.fence);
      expect(await leases.renew(lease)).toBe("lost");
      expect(warnings).toEqual([]);
    } finally {
      clock.stop();
    }
  });

  test("a claim scan renews leases first when the wall clock stepped, and scans run one at a time", async () => {
    const { clock, backend, leases, claimer, message } = setup(300);
    try {
      const r = (await backend.inbox.admit(message("m1"), claimer()))!;
      leases.hold("inbox", "m1", r.fence);
      leases.startRounds();
      const renewed: string[] = [];
      const heartbeat = backend.inbox.heartbeat.bind(backend.inbox);
      backend.inbox.heartbeat = (id, token, ms) => {
        renewed.push(id);
        return heartbeat(id, token, ms);
      };
      await leases.claimScan(async () => null);
      expect(renewed, "no step, no overdue round: no renewal").toEqual([]);
      (clock as unknown as { now: () => number }).now = ((now) => () => now() + 5_000)(clock.now.bind(clock));
      await leases.claimScan(async () => null);
      expect(renewed, "a wall step: renewed before the scan").toEqual(["m1"]);
      const order: string[] = [];
      let release!: () => void;
      const first = leases.claimScan(() => new Promise<void>((resolve) => { order.push("first"); release = resolve; }));
      const second = leases.claimScan(async () => void order.push("second"));
      await clock.sleep(10);
      expect(order).toEqual(["first"]);
      release();
      await Promise.all([first, second]);
      expect(order).toEqual(["first", "second"]);
    } finally {
      clock.stop();
    }
  });

  test("a halted engine renews nothing", async () => {
    const { clock, backend, leases, claimer, message, halt } = setup();
    try {
      const r = (await backend.inbox.admit(message("m1"), claimer()))!;
      leases.hold("inbox", "m1", r.fence);
      halt();
      let calls = 0;
      backend.inbox.heartbeat = async () => (calls++, true);
      await leases.heartbeat();
      expect(calls).toBe(0);
    } finally {
      clock.stop();
    }
  });
});

describe("Settling", () => {
  const settlingOf = (backend: MemoryDurability, clock: TestClock, claims = 0) =>
    new Settling({
      backend,
      clock,
      claimsInFlight: () => claims,
      swept: () => ({ inbound: 0, outbound: 0, ambiguous: 0, purges: 0 }),
      sweep: async () => {},
      whenLocalIdle: async () => {},
      halted: () => false,
      stopping: () => false,
      damaged: () => null,
      report: () => false,
    });

  test("a scheduled timer is no work; a pending record, a retry and a timer an older version armed as failed but now due are", async () => {
    const { clock, backend, claimer, message } = setup();
    try {
      const settling = settlingOf(backend, clock);
      expect(await settling.hasActiveWork()).toBe(false);
      const timer = (await backend.inbox.admit(message("t1"), claimer()))!;
      await backend.inbox.schedule("t1", timer.fence, 60_000);
      expect(await settling.hasActiveWork(), "a timer waiting for its deadline").toBe(false);
      // As an older version armed one: failed, its deadline in its payload.
      const legacy = (await backend.inbox.admit({ ...message("t2"), payload: { $timer: { at: clock.now() + 60_000 } } }, claimer()))!;
      await backend.inbox.fail("t2", legacy.fence, { error: "Not a failure: a timer, due at …", retryInMs: 60_000 });
      expect(await settling.hasActiveWork(), "an older version's timer, not due").toBe(false);
      await clock.sleep(61_000);
      expect(await settling.hasActiveWork(), "an older version's timer, due").toBe(true);
      const r = (await backend.inbox.claim("t2", claimer()))!;
      await backend.inbox.complete("t2", r.fence);
      expect(await settling.hasActiveWork()).toBe(false);
      await backend.inbox.admit(message("m1", "c2"));
      expect(await settling.hasActiveWork(), "a pending message").toBe(true);
      expect(await settlingOf(new MemoryDurability({ clock: () => clock.now() }), clock, 1).hasActiveWork(), "a claim scan on its way").toBe(true);
    } finally {
      clock.stop();
    }
  });
});

describe("Outcomes", () => {
  function outcomesOf(s: ReturnType<typeof setup>) {
    const stale: string[] = [];
    const outcomes = new Outcomes({
      backend: s.backend,
      clock: s.clock,
      leases: s.leases,
      leaseMs: { inbox: 300, outbox: 300 },
      halted: () => false,
      stopping: () => false,
      halt: () => {},
      report: () => false,
      stale: (_kind, id) => void stale.push(id),
    });
    return { outcomes, stale };
  }

  test("a write whose reply was lost after it committed is read back as landed; one refused for a lease taken elsewhere is stale", async () => {
    const s = setup();
    try {
      const { outcomes, stale } = outcomesOf(s);
      const r = (await s.backend.inbox.admit(s.message("m1"), s.claimer()))!;
      const lease = s.leases.hold("inbox", "m1", r.fence);
      let calls = 0;
      const lostReply = async (token: number) => {
        calls++;
        await s.backend.inbox.complete("m1", token);
        if (calls === 1) throw new Error("connection reset after the commit");
      };
      expect(await outcomes.record(lease, lostReply, ["done"])).toBe(true);
      expect(calls, "read back, not written again").toBe(1);
      expect(stale).toEqual([]);
      const r2 = (await s.backend.inbox.admit(s.message("m2", "c2"), s.claimer("me", 20)))!;
      const lease2 = s.leases.hold("inbox", "m2", r2.fence);
      await s.clock.sleep(50);
      await s.backend.inbox.claim("m2", s.claimer("other"));
      expect(await outcomes.record(lease2, (token) => s.backend.inbox.complete("m2", token), ["done"])).toBe(false);
      expect(stale).toEqual(["m2"]);
      expect(lease2.settling, "a completion is final").toBe("final");
    } finally {
      s.clock.stop();
    }
  });
});

describe("Ambiguity", () => {
  /** An Ambiguity over the setup's journals, with a provider that confirms (or not) and its events collected. */
  function ambiguityOf(s: ReturnType<typeof setup>, confirm?: (key: string) => { delivered: boolean; messageId?: string }) {
    const provider: MockProvider & Pick<Provider, "confirm"> = new MockProvider();
    if (confirm) provider.confirm = async ({ idempotencyKey }: SendInQuestion) => {
      const answer = confirm(idempotencyKey);
      return answer.delivered ? { delivered: true, messageId: answer.messageId ?? "" } : { delivered: false };
    };
    const events = new Emitter<BotEvents>(() => {});
    const seen: string[] = [];
    events.on("durability:ambiguous", (e) => void seen.push(`ambiguous ${e.key}`));
    events.on("durability:resolved", (e) => void seen.push(`resolved ${e.key} ${e.state} via ${e.via}`));
    const metrics = zeroMetrics();
    const woken: number[] = [];
    let counted = 0;
    const work: Promise<unknown>[] = [];
    const ambiguity = new Ambiguity({
      backend: s.backend,
      config: resolveDurability({ backend: s.backend, outbox: { retries: 3, backoff: { baseMs: 10, capMs: 10 } } }),
      host: { provider, botId: "b", events, dispatch: () => {}, whenLocalIdle: async () => {}, track: (p) => void work.push(p), clock: s.clock },
      clock: s.clock,
      metrics,
      signal: new AbortController().signal,
      halted: () => false,
      report: (error) => void s.errors.push(String(error)),
      wake: (ms) => void woken.push(ms),
      countAmbiguous: () => void counted++,
    });
    return { ambiguity, seen, metrics, woken, counted: () => counted, settled: () => Promise.all(work) };
  }

  /** A send whose holder announced its call and was lost: `unknown` after a scan once its lease lapsed. */
  async function unknownEntry(s: ReturnType<typeof setup>, key: string, meanwhile: () => Promise<unknown> = async () => {}) {
    const { entry } = await s.backend.outbox.reserve(
      { key, chatId: "c", content: { text: "hi" }, contentHash: "h", inboundId: null },
      s.claimer("gone", 100),
    );
    await s.backend.outbox.markCalling(key, entry.fence, 100);
    await meanwhile();
    await s.clock.sleep(200);
    const claim = await s.backend.outbox.claimDue({ ...s.claimer(), limit: 10 });
    expect(claim.ambiguous.map((e) => [e.key, e.state])).toEqual([[key, "unknown"]]);
    return claim.ambiguous[0]!;
  }

  test("a delivery status seen while the send was on its way settles it as sent once it turns unknown: reported, then resolved", async () => {
    const s = setup();
    try {
      const a = ambiguityOf(s);
      const entry = await unknownEntry(s, "k1", async () => {
        expect(await a.ambiguity.confirmSent("k1", "tg-7"), "on its way: remembered, nothing settled").toBe(false);
      });
      a.ambiguity.settle(entry);
      await a.settled();
      expect(a.seen).toEqual(["ambiguous k1", "resolved k1 sent via status"]);
      expect(await s.backend.outbox.get("k1")).toMatchObject({ state: "sent", messageId: "tg-7" });
      expect([a.metrics.outboxAmbiguous, a.metrics.outboxResolved, a.counted()]).toEqual([1, 1, 1]);
      expect(a.ambiguity.wasReported("k1", entry.fence)).toBe(true);
      expect(a.ambiguity.wasReported("k1", entry.fence + 1)).toBe(false);
    } finally {
      s.clock.stop();
    }
  });

  test("a provider that confirms the send never arrived: a failed attempt retried after its backoff (woken), not sent", async () => {
    const s = setup();
    try {
      const a = ambiguityOf(s, () => ({ delivered: false }));
      const entry = await unknownEntry(s, "k2");
      a.ambiguity.settle(entry);
      await a.settled();
      expect(a.seen).toEqual(["ambiguous k2", "resolved k2 failed via confirm"]);
      expect((await s.backend.outbox.get("k2"))?.state).toBe("failed");
      expect(a.woken.length).toBe(1);
      expect(a.woken[0]!).toBeLessThanOrEqual(10); // the backoff (jittered)
      expect(s.errors).toEqual([]);
    } finally {
      s.clock.stop();
    }
  });
});

describe("operatorControl", () => {
  test("replays and retries tell the engine; markDelivered settles only an unknown send, and a step's result must be JSON", async () => {
    const s = setup();
    try {
      const told: string[] = [];
      const resolvedWith: string[] = [];
      const control = operatorControl({
        backend: s.backend,
        instanceId: () => "me",
        replayed: (id) => void told.push(`replayed ${id}`),
        requeued: () => void told.push("requeued"),
        resolveSent: async (entry, messageId) => {
          resolvedWith.push(`${entry.key} ${messageId}`);
          await s.backend.outbox.markSent(entry.key, entry.fence, messageId);
          return "resolved";
        },
        metrics: () => zeroMetrics(),
        histograms: () => ({}) as never,
      });
      const r = (await s.backend.inbox.admit(s.message("m1"), s.claimer()))!;
      await s.backend.inbox.fail("m1", r.fence, { error: "boom", dead: true });
      expect(await control.replayInbound("m1")).toBe(true);
      expect(await control.replayInbound("nope")).toBe(false);
      const { entry } = await s.backend.outbox.reserve({ key: "k1", chatId: "c", content: { text: "x" }, contentHash: "h", inboundId: null }, s.claimer());
      expect(await control.markDelivered("k1", "tg-1"), "sending, not unknown: left alone").toBe(false);
      await s.backend.outbox.markFailed("k1", entry.fence, { error: "bad", dead: true });
      expect(await control.retrySend("k1")).toBe(true);
      expect(told).toEqual(["replayed m1", "requeued"]);
      await unknownOf(s, "k2");
      expect(await control.markDelivered("k2", "tg-2")).toBe(true);
      expect(resolvedWith).toEqual(["k2 tg-2"]);
      await expect(control.markDelivered("k2", 5 as unknown as string)).rejects.toThrow(/"messageId"/);
    } finally {
      s.clock.stop();
    }
  });

  async function unknownOf(s: ReturnType<typeof setup>, key: string) {
    const { entry } = await s.backend.outbox.reserve({ key, chatId: "c2", content: { text: "y" }, contentHash: "h", inboundId: null }, s.claimer("gone", 100));
    await s.backend.outbox.markCalling(key, entry.fence, 100);
    await s.clock.sleep(200);
    await s.backend.outbox.claimDue({ ...s.claimer(), limit: 10 });
    expect((await s.backend.outbox.get(key))?.state).toBe("unknown");
  }
});
