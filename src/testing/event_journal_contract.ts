/**
 * The {@link LeasedEventJournal} contract as tests, run against every events
 * journal (memory, file, shared file) and usable by other implementations.
 * Like the durability conformance suite, it takes the test runner's
 * `describe`, `test` and `expect`, and tests lease expiry with small
 * leases and sleeps, in real time or (`simulatedTime: true`) on a
 * {@link TestClock} per test.
 *
 * @module
 */
import { StaleLeaseError } from "../contract.ts";
import type { ClaimOptions, JsonValue } from "../contract.ts";
import { BOT_CHANNEL, DamagedEventError, type EventRecord, type LeasedEventJournal, type NewEventRecord } from "../events/types.ts";
import type { ConformanceContext, ConformanceHarness } from "./conformance.ts";
import { SuiteTime } from "./suite_time.ts";
import type { TestClock } from "./test_clock.ts";
import { uid } from "./util.ts";

/** Options of {@link runEventJournalContract}. */
export interface EventJournalContractOptions {
  /** The journal's name, used in the suite's title. */
  name: string;
  /**
   * A fresh, open, empty journal; called once per test. Under
   * `simulatedTime` it must take its time from `context.now`.
   */
  create: (context: ConformanceContext) => LeasedEventJournal | Promise<LeasedEventJournal>;
  /** Called after each test, after the journal's `close()`. */
  cleanup?: (journal: LeasedEventJournal) => void | Promise<void>;
  /** The test runner's `describe`, `test` and `expect`. */
  harness: ConformanceHarness;
  /** A reason to skip the whole suite; `false` or absent runs it. */
  skip?: string | false;
  /** Multiplies every lease and sleep (default 1: leases of 40 ms, sleeps of 100 ms). */
  timeScale?: number;
  /**
   * Run every test in simulated time (default `false`), each on a fresh
   * {@link TestClock} given to `create`; virtual time stands still while a
   * journal call is in flight.
   */
  simulatedTime?: boolean;
}

/**
 * Registers the events-journal contract tests: append and dedupe, the channel
 * rules of claims (a claim without a channel never takes a record with one,
 * in particular the bot's {@link BOT_CHANNEL} records), the order of an
 * `orderKey` in due scans (concurrent ones too), fencing, takeover of
 * lapsed leases, `reclaimOwn`, fail / retry / dead, replay, list filters and
 * order, purge by channel, copies, concurrent claims, argument checks,
 * records set aside (for a journal with `setAside`) and `close()`. Each test gets a fresh journal from `create()` and closes it.
 *
 * @param options name, `create`, the test runner's functions, and optionally `cleanup`, `skip`, `timeScale`
 * @example
 * ```ts
 * import { describe, expect, test } from "bun:test";
 * import { MemoryEventJournal } from "@botmesh/durable/events";
 * import { runEventJournalContract } from "@botmesh/durable/testing";
 *
 * runEventJournalContract({
 *   name: "memory-events",
 *   create: () => new MemoryEventJournal(),
 *   harness: { describe, test, expect },
 * });
 * ```
 */
export function runEventJournalContract(options: EventJournalContractOptions): void {
  const { describe, test, expect } = options.harness;
  const title = `events journal contract: ${options.name}`;
  if (options.skip) {
    const reason = options.skip;
    describe(title, () => {
      (test.skip ?? test)(`skipped: ${reason}`, () => {});
    });
    return;
  }
  const scale = options.timeScale ?? 1;
  const ms = (n: number): number => Math.max(1, Math.round(n * scale));
  const SHORT = ms(40);
  const LAPSE = ms(100);
  const LONG = 600_000;
  /** The time of the running test (tests of one suite run one at a time). */
  let time = new SuiteTime(false);
  /** Resolves after `ms` on the running test's clock. */
  const sleep = (ms: number): Promise<void> => time.sleep(ms);
  /** A fresh journal on a fresh time (a view whose calls simulated time waits for). */
  async function fresh(): Promise<LeasedEventJournal> {
    time = new SuiteTime(options.simulatedTime === true);
    return time.view(await time.track(() => options.create(time.context)), ["outbox"]);
  }
  /** `cleanup` of the journal, then the end of the test's time. */
  async function dispose(j: LeasedEventJournal): Promise<void> {
    try {
      const cleanup = options.cleanup;
      if (cleanup) await time.track(() => cleanup(time.raw(j)));
    } finally {
      time.stop();
    }
  }

  async function withJournal(run: (j: LeasedEventJournal) => Promise<void>): Promise<void> {
    const j = await fresh();
    try {
      await run(j);
    } finally {
      try {
        await j.close();
      } finally {
        await dispose(j);
      }
    }
  }

  const it = (name: string, run: (j: LeasedEventJournal) => Promise<void>): void => {
    test(name, () => withJournal(run));
  };

  function claimer(owner: string = uid("owner"), leaseMs: number = LONG, incarnation: string = uid("inc")): ClaimOptions {
    return { owner, incarnation, leaseMs };
  }

  function event(channel: string | null = null, createdAt?: number, payload: JsonValue = { n: 1 }): NewEventRecord {
    const e: NewEventRecord = { id: uid("ev"), channel, eventType: "test.happened", payload };
    if (createdAt !== undefined) e.createdAt = createdAt;
    return e;
  }

  async function appended(j: LeasedEventJournal, e: NewEventRecord, lease?: ClaimOptions): Promise<EventRecord> {
    const r = await j.append(e, lease);
    if (r === null) throw new Error(`append of ${e.id} returned null`);
    return r;
  }

  async function mustGet(j: LeasedEventJournal, id: string): Promise<EventRecord> {
    const r = await j.get(id);
    if (r === null) throw new Error(`event ${id} is missing`);
    return r;
  }

  function tokenOf(r: EventRecord): number {
    if (r.lease === null) throw new Error(`record ${r.id} has no lease (state ${r.state})`);
    return r.lease.token;
  }

  const ids = (list: readonly EventRecord[]): string[] => list.map((r) => r.id);

  async function expectStale(run: () => Promise<unknown>, what: string): Promise<void> {
    let error: unknown = undefined;
    try {
      await run();
    } catch (e) {
      error = e;
    }
    expect(error instanceof StaleLeaseError, `${what}: expected a StaleLeaseError, got ${String(error)}`).toBe(true);
  }

  async function errorOf(run: () => Promise<unknown>): Promise<Error> {
    try {
      await run();
    } catch (error) {
      expect(error instanceof Error, `expected an Error, got ${String(error)}`).toBe(true);
      return error as Error;
    }
    throw new Error("expected an error, but the call succeeded");
  }

  describe(title, () => {
    test("has a name, a scope and an outbox sidecar", async () => {
      await withJournal(async (j) => {
        expect(typeof j.name === "string" && j.name.length > 0, "name").toBe(true);
        expect(["process", "host", "shared"].includes(j.scope), `scope ${String(j.scope)}`).toBe(true);
        expect(typeof j.outbox.reserve, "outbox").toBe("function");
      });
    });

    describe("append", () => {
      it("journals a pending record with every field", async (j) => {
        const before = time.now();
        const input = event(null, 1_700_000_000_123, { text: "héllo ✓", list: [1, null, { a: true }] });
        const r = await appended(j, input);
        expect(r.id).toBe(input.id);
        expect(r.channel).toBe(null);
        expect(r.orderKey).toBe(null);
        expect(r.eventType).toBe("test.happened");
        expect(r.payload).toEqual({ text: "héllo ✓", list: [1, null, { a: true }] });
        expect(r.createdAt).toBe(1_700_000_000_123);
        expect(r.state).toBe("pending");
        expect(r.attempts).toBe(0);
        expect(r.nextAttemptAt).toBe(null);
        expect(r.lease).toBe(null);
        expect(r.fence).toBe(0);
        expect(r.error).toBe(null);
        expect(r.updatedAt).toBeGreaterThanOrEqual(before - 5_000);
        expect(await mustGet(j, r.id)).toEqual(r);
      });

      it("an absent channel or orderKey is null and an absent createdAt is the journal's clock", async (j) => {
        const before = time.now();
        const r = await appended(j, { id: uid("ev"), eventType: "t", payload: null });
        expect(r.channel).toBe(null);
        expect(r.orderKey).toBe(null);
        expect(r.createdAt).toBeGreaterThanOrEqual(before - 5_000);
        expect(r.createdAt).toBeLessThanOrEqual(time.now() + 5_000);
      });

      it("keeps the orderKey given, through claims and outcomes", async (j) => {
        const r = await appended(j, { ...event("app"), orderKey: "account-7" });
        expect(r.orderKey).toBe("account-7");
        const [claimed] = await j.claimDue({ ...claimer(), channel: "app", limit: 1 });
        expect(claimed?.orderKey).toBe("account-7");
        await j.fail(r.id, tokenOf(claimed!), { error: "x", dead: true });
        expect((await mustGet(j, r.id)).orderKey).toBe("account-7");
        expect((await j.list({ channel: "app" }))[0]?.orderKey).toBe("account-7");
      });

      it("with a lease the record is processing under token 1", async (j) => {
        const c = claimer();
        const r = await appended(j, event("app"), c);
        expect(r.state).toBe("processing");
        expect(r.attempts).toBe(1);
        expect(r.fence).toBe(1);
        expect(r.lease?.token).toBe(1);
        expect(r.lease?.owner).toBe(c.owner);
        expect(r.lease?.incarnation).toBe(c.incarnation);
        expect(r.lease!.expiresAt).toBeGreaterThan(time.now() + LONG / 2);
        await j.complete(r.id, 1);
        expect((await mustGet(j, r.id)).state).toBe("done");
      });

      it("a second append with the same id returns null and changes nothing", async (j) => {
        const e = event(null);
        const first = await appended(j, e);
        expect(await j.append({ ...e, eventType: "other", payload: { changed: true } })).toBe(null);
        expect(await j.append({ ...e, channel: "elsewhere" }, claimer())).toBe(null);
        expect(await mustGet(j, e.id)).toEqual(first);
        expect((await j.list()).length).toBe(1);
      });

      it("refuses bad records with a TypeError naming the field, and writes nothing", async (j) => {
        const cases: [Record<string, unknown>, string][] = [
          [{ id: "" }, "id"],
          [{ id: 7 }, "id"],
          [{ eventType: 3 }, "eventType"],
          [{ channel: 5 }, "channel"],
          [{ orderKey: 5 }, "orderKey"],
          [{ createdAt: Number.NaN }, "createdAt"],
          [{ payload: { at: new Date(0) } }, "payload.at"],
          [{ payload: [1, undefined] }, "payload[1]"],
          [{ payload: { n: 1n } }, "payload.n"],
        ];
        for (const [bad, field] of cases) {
          const input = { ...event(null), ...bad } as unknown as NewEventRecord;
          const error = await errorOf(() => j.append(input));
          expect(error instanceof TypeError, `a TypeError for "${field}": ${error}`).toBe(true);
          expect(error.message.includes(field), `the error names "${field}": ${error.message}`).toBe(true);
        }
        const error = await errorOf(() => j.append(event(null), { owner: "o", leaseMs: 5 } as unknown as ClaimOptions));
        expect(error instanceof TypeError && error.message.includes("incarnation"), error.message).toBe(true);
        expect(await j.list()).toEqual([]);
      });
    });

    describe("channels", () => {
      it("a claim without a channel takes only records without one (never the bot's)", async (j) => {
        const bot = await appended(j, event(BOT_CHANNEL, 1));
        const other = await appended(j, event("app.other", 2));
        const plain = await appended(j, event(null, 3));
        expect(await j.claim(bot.id, claimer()), "claim without channel of a bot record").toBe(null);
        expect(await j.claim(other.id, { ...claimer(), channel: null }), "claim with null channel").toBe(null);
        const due = await j.claimDue({ ...claimer(), limit: 10 });
        expect(ids(due)).toEqual([plain.id]);
        expect(ids(await j.claimDue({ ...claimer(), channel: null, limit: 10 }))).toEqual([]);
        expect((await mustGet(j, bot.id)).state).toBe("pending");
        expect((await mustGet(j, other.id)).state).toBe("pending");
      });

      it("a claim with a channel takes only that channel's records", async (j) => {
        const a = await appended(j, event("a", 1));
        const b = await appended(j, event("b", 2));
        const plain = await appended(j, event(null, 3));
        expect(await j.claim(a.id, { ...claimer(), channel: "b" })).toBe(null);
        expect(await j.claim(plain.id, { ...claimer(), channel: "a" })).toBe(null);
        expect(ids(await j.claimDue({ ...claimer(), channel: "a", limit: 10 }))).toEqual([a.id]);
        const bc = await j.claim(b.id, { ...claimer(), channel: "b" });
        expect(bc?.state).toBe("processing");
        expect(ids(await j.claimDue({ ...claimer(), channel: BOT_CHANNEL, limit: 10 }))).toEqual([]);
      });

      it("the bot's channel is claimed by naming it", async (j) => {
        const bot = await appended(j, event(BOT_CHANNEL));
        expect(ids(await j.claimDue({ ...claimer(), channel: BOT_CHANNEL, limit: 10 }))).toEqual([bot.id]);
      });
    });

    describe("claims", () => {
      it("claimDue takes the oldest createdAt first (append order on ties), at most limit", async (j) => {
        const c = await appended(j, event(null, 30));
        const a = await appended(j, event(null, 10));
        const b1 = await appended(j, event(null, 20));
        const b2 = await appended(j, event(null, 20));
        const first = await j.claimDue({ ...claimer(), limit: 3 });
        expect(ids(first)).toEqual([a.id, b1.id, b2.id]);
        expect(ids(await j.claimDue({ ...claimer(), limit: 3 }))).toEqual([c.id]);
        expect(await j.claimDue({ ...claimer(), limit: 3 })).toEqual([]);
        expect(await j.claimDue({ ...claimer(), limit: 0 })).toEqual([]);
      });

      it("a claim issues a greater fencing token each time (never the token a leased append issues, 1) and counts no run; start counts one, once", async (j) => {
        const r = await appended(j, event());
        const c1 = (await j.claim(r.id, claimer()))!;
        expect(c1.state).toBe("processing");
        expect(c1.attempts, "a claim is not a run").toBe(0);
        expect(tokenOf(c1)).toBe(2);
        expect(c1.fence).toBe(2);
        expect(await j.start(r.id, tokenOf(c1), 1)).toBe(true);
        expect(await j.start(r.id, tokenOf(c1), 1), "a repeat changes nothing").toBe(true);
        expect((await j.get(r.id))!.attempts).toBe(1);
        await j.fail(r.id, tokenOf(c1), { error: "boom", retryInMs: 0 });
        expect(await j.start(r.id, tokenOf(c1), 2), "no longer held").toBe(false);
        const c2 = (await j.claim(r.id, claimer()))!;
        expect(c2.attempts).toBe(1);
        expect(tokenOf(c2)).toBe(3);
        expect(c2.fence).toBe(3);
        expect(await j.start(r.id, tokenOf(c1), 2), "a stale token").toBe(false);
        expect(await j.start(r.id, tokenOf(c2), 2)).toBe(true);
        expect((await j.get(r.id))!.attempts).toBe(2);
      });

      it("a live lease is not taken by another owner, nor by the same incarnation", async (j) => {
        const owner = claimer();
        const r = await appended(j, event(), owner);
        expect(await j.claim(r.id, claimer())).toBe(null);
        expect(await j.claimDue({ ...claimer(), limit: 10 })).toEqual([]);
        expect(await j.claim(r.id, { ...owner, reclaimOwn: true })).toBe(null);
        expect(await j.claimDue({ ...owner, reclaimOwn: true, limit: 10 })).toEqual([]);
        expect(await j.claim(r.id, { ...claimer(), reclaimOwn: true })).toBe(null);
      });

      it("a lapsed lease is taken over with a new token; the old holder is fenced off", async (j) => {
        const r = await appended(j, event(), claimer(uid("owner"), SHORT));
        await sleep(LAPSE);
        const taken = await j.claimDue({ ...claimer(), limit: 10 });
        expect(ids(taken)).toEqual([r.id]);
        expect(tokenOf(taken[0])).toBe(2);
        expect(await j.heartbeat(r.id, 1, LONG), "old holder's heartbeat").toBe(false);
        await expectStale(() => j.complete(r.id, 1), "old holder's complete");
        await expectStale(() => j.fail(r.id, 1, { error: "late", retryInMs: 0 }), "old holder's fail");
        expect(await mustGet(j, r.id)).toEqual(taken[0]);
        await j.complete(r.id, 2);
        expect((await mustGet(j, r.id)).state).toBe("done");
      });

      it("reclaimOwn takes the owner's previous incarnation's leases at once", async (j) => {
        const owner = uid("owner");
        const old = claimer(owner, LONG, uid("inc"));
        const r = await appended(j, event(), old);
        const s = await appended(j, event(), old);
        const restarted = claimer(owner, LONG, uid("inc"));
        expect(await j.claimDue({ ...restarted, limit: 10 }), "without reclaimOwn").toEqual([]);
        const back = await j.claimDue({ ...restarted, reclaimOwn: true, limit: 10 });
        expect(ids(back).sort()).toEqual([r.id, s.id].sort());
        expect(back.every((x) => x.lease?.incarnation === restarted.incarnation && x.fence === 2)).toBe(true);
        await expectStale(() => j.complete(r.id, 1), "previous incarnation's complete");
        const t = await appended(j, event(), claimer(owner, LONG, uid("inc")));
        const one = await j.claim(t.id, { ...restarted, reclaimOwn: true });
        expect(one?.fence).toBe(2);
      });

      it("a heartbeat keeps a short lease alive; a stale token's heartbeat changes nothing", async (j) => {
        const c = claimer(uid("owner"), SHORT);
        const r = await appended(j, event(), c);
        expect(await j.heartbeat(r.id, 1, LONG)).toBe(true);
        await sleep(LAPSE);
        expect(await j.claimDue({ ...claimer(), limit: 10 })).toEqual([]);
        const before = await mustGet(j, r.id);
        expect(before.lease!.expiresAt).toBeGreaterThan(time.now() + LONG / 2);
        expect(await j.heartbeat(r.id, 7, LONG)).toBe(false);
        expect(await j.heartbeat(uid("missing"), 1, LONG)).toBe(false);
        expect(await mustGet(j, r.id)).toEqual(before);
      });

      it("complete and fail of a record not leased throw StaleLeaseError and change nothing", async (j) => {
        const r = await appended(j, event());
        await expectStale(() => j.complete(r.id, 0), "complete of a pending record");
        await expectStale(() => j.complete(uid("missing"), 1), "complete of a missing record");
        const c = (await j.claim(r.id, claimer()))!;
        await j.complete(r.id, tokenOf(c));
        const done = await mustGet(j, r.id);
        await expectStale(() => j.complete(r.id, tokenOf(c)), "second complete");
        await expectStale(() => j.fail(r.id, tokenOf(c), { error: "x", dead: true }), "fail after complete");
        expect(await mustGet(j, r.id)).toEqual(done);
      });
    });

    describe("order of an orderKey", () => {
      /** An event of `key` in channel `channel`. */
      const keyed = (key: string, createdAt: number, channel: string | null = null): NewEventRecord => ({
        ...event(channel, createdAt),
        orderKey: key,
      });

      it("a record processing elsewhere holds back every later one of its key, pending and lapsed alike; its holder takes them in order", async (j) => {
        const key = uid("key");
        const x = claimer("owner-x");
        const held = await appended(j, keyed(key, 1_000), x);
        const pending = await appended(j, keyed(key, 2_000));
        // Leased by claim(id): appended leased behind another owner's record, it would be pending.
        const lapsed = await appended(j, keyed(key, 3_000));
        expect((await j.claim(lapsed.id, claimer("owner-w", SHORT)))?.lease?.owner).toBe("owner-w");
        const earlier = await appended(j, keyed(key, 500)); // before the held record: not held back
        const otherKey = await appended(j, keyed(uid("key"), 2_500));
        const noKey = await appended(j, event(null, 2_600));
        const sameKeyElsewhere = await appended(j, keyed(key, 2_700, "app"));
        await sleep(LAPSE);
        const taken = await j.claimDue({ ...claimer(), limit: 100 });
        expect(ids(taken), "the key waits behind its held record").toEqual([earlier.id, otherKey.id, noKey.id]);
        expect((await mustGet(j, lapsed.id)).lease?.owner, "not taken").toBe("owner-w");
        await j.complete(earlier.id, tokenOf(taken[0]!)); // held by that claimer, it held back the key for x too
        expect(ids(await j.claimDue({ ...claimer(), channel: "app", limit: 100 })), "a key belongs to its channel")
          .toEqual([sameKeyElsewhere.id]);
        expect(ids(await j.claimDue({ ...x, limit: 100 })), "the holder's own lease holds nothing back")
          .toEqual([pending.id, lapsed.id]);
        // Settled, the key is free again.
        for (const r of [held, pending, lapsed]) await j.complete(r.id, tokenOf(await mustGet(j, r.id)));
        expect(await j.replay(pending.id)).toBe(true);
        expect(ids(await j.claimDue({ ...claimer(), limit: 100 }))).toEqual([pending.id]);
      });

      it("append with a lease: leased only when nothing of its key comes first; otherwise pending, taken in order by a due scan", async (j) => {
        const x = claimer("owner-x");
        const key = uid("key");
        const held = await appended(j, keyed(key, 1_000), x);
        const own = await appended(j, keyed(key, 2_000), x);
        expect([own.state, own.lease?.owner, own.attempts, own.fence], "the caller's own live lease holds nothing back")
          .toEqual(["processing", "owner-x", 1, 1]);
        const behind = await appended(j, keyed(key, 3_000), claimer("owner-y"));
        expect([behind.state, behind.lease, behind.attempts, behind.fence], "behind another owner's lease: pending")
          .toEqual(["pending", null, 0, 0]);
        const otherInc = await appended(j, keyed(key, 3_500), claimer("owner-x"));
        expect(otherInc.state, "another incarnation of the owner holds nothing of x's").toBe("pending");
        const before = await appended(j, keyed(key, 500), claimer("owner-y"));
        expect(before.state, "comes before every record of its key: leased").toBe("processing");
        const elsewhere = await Promise.all([
          appended(j, keyed(uid("key"), 2_500), claimer("owner-y")),
          appended(j, event(null, 2_500), claimer("owner-y")),
          appended(j, keyed(key, 2_500, "app"), claimer("owner-y")),
        ]);
        expect(elsewhere.map((r) => r.state), "another key, no key, the key in another channel").toEqual(["processing", "processing", "processing"]);
        expect(ids(await j.claimDue({ ...claimer("owner-y"), limit: 100 })), "nothing of the key while x holds it").toEqual([]);
        await j.complete(before.id, tokenOf(before));
        await j.complete(held.id, tokenOf(held));
        await j.complete(own.id, tokenOf(own));
        expect(ids(await j.claimDue({ ...claimer("owner-y"), limit: 100 })), "then in order").toEqual([behind.id, otherInc.id]);

        // A failed record waiting for its retry and settled records come first in nothing; a due retry, a lapsed
        // lease and a pending record do.
        const waiting = uid("key");
        const failing = await appended(j, keyed(waiting, 1_000), x);
        await j.fail(failing.id, tokenOf(failing), { error: "boom", retryInMs: LONG });
        const done = await appended(j, keyed(waiting, 1_100), x);
        await j.complete(done.id, tokenOf(done));
        const dead = await appended(j, keyed(waiting, 1_200), x);
        await j.fail(dead.id, tokenOf(dead), { error: "poison", dead: true });
        expect((await appended(j, keyed(waiting, 2_000), claimer("owner-y"))).state, "behind a retry not due, done, dead").toBe("processing");
        const dueKey = uid("key");
        const due = await appended(j, keyed(dueKey, 1_000), x);
        await j.fail(due.id, tokenOf(due), { error: "boom", retryInMs: SHORT });
        const lapsedKey = uid("key");
        const lost = await appended(j, keyed(lapsedKey, 1_000), claimer("owner-lost", SHORT));
        await sleep(LAPSE);
        const afterDue = await appended(j, keyed(dueKey, 2_000), x);
        expect(afterDue.state, "behind a due retry, even the caller's own").toBe("pending");
        const afterLost = await appended(j, keyed(lapsedKey, 2_000), claimer("owner-lost", SHORT));
        expect(afterLost.state, "behind a lapsed lease").toBe("pending");
        const afterPending = await appended(j, keyed(lapsedKey, 3_000), x);
        expect(afterPending.state, "behind a pending record").toBe("pending");
        expect(ids(await j.claimDue({ ...claimer("owner-z"), limit: 100 })))
          .toEqual([due.id, lost.id, afterDue.id, afterLost.id, afterPending.id]);

        if (j.setAside === undefined) return; // an earlier contract
        const asideKey = uid("key");
        const odd = await appended(j, keyed(asideKey, 1_000));
        expect(await j.setAside(odd.id, "not what it should be")).toBe(true);
        expect((await appended(j, keyed(asideKey, 2_000), claimer("owner-y"))).state, "a record set aside comes first in nothing")
          .toBe("processing");
      });

      it("through a failover: a key's lapsed records are taken in order, by one claimer at a time", async (j) => {
        const key = uid("key");
        const lost = claimer("owner-lost", SHORT);
        const first = await appended(j, keyed(key, 1_000), lost);
        const second = await appended(j, keyed(key, 2_000), lost);
        const third = await appended(j, keyed(key, 3_000), lost);
        expect(await j.heartbeat(first.id, tokenOf(first), LONG)).toBe(true); // its handler was still running
        await sleep(LAPSE);
        const y = claimer("owner-y");
        expect(ids(await j.claimDue({ ...y, limit: 100 })), "nothing while the first is held").toEqual([]);
        expect(await j.heartbeat(first.id, tokenOf(first), SHORT)).toBe(true);
        await sleep(LAPSE);
        const z = claimer("owner-z");
        expect(ids(await j.claimDue({ ...y, limit: 1 })), "the first first").toEqual([first.id]);
        expect(ids(await j.claimDue({ ...z, limit: 100 })), "another claimer takes nothing of a key held elsewhere").toEqual([]);
        const rest = await j.claimDue({ ...y, limit: 100 });
        expect(ids(rest), "the holder takes the rest, in order").toEqual([second.id, third.id]);
        expect(rest.every((r) => r.lease?.owner === "owner-y" && tokenOf(r) === 2)).toBe(true);
      });

      it("a failed record waiting for its retry holds back nothing; a due one comes first; settled ones hold back nothing", async (j) => {
        const x = claimer("owner-x");
        const key = uid("key");
        const waiting = await appended(j, keyed(key, 1_000), x);
        await j.fail(waiting.id, tokenOf(waiting), { error: "boom", retryInMs: LONG });
        const next = await appended(j, keyed(key, 2_000));
        const key2 = uid("key");
        const due = await appended(j, keyed(key2, 1_000), x);
        await j.fail(due.id, tokenOf(due), { error: "boom", retryInMs: SHORT });
        const after = await appended(j, keyed(key2, 2_000));
        const key3 = uid("key");
        const done = await appended(j, keyed(key3, 1_000), x);
        await j.complete(done.id, tokenOf(done));
        const dead = await appended(j, keyed(key3, 1_500), x);
        await j.fail(dead.id, tokenOf(dead), { error: "poison", dead: true });
        const free = await appended(j, keyed(key3, 2_000));
        await sleep(LAPSE);
        expect(ids(await j.claimDue({ ...claimer(), limit: 100 }))).toEqual([due.id, next.id, after.id, free.id]);
      });

      it("reclaimOwn takes the previous incarnation's records of a key in order; another owner's live lease still holds them back", async (j) => {
        const key = uid("key");
        const mine = claimer("owner-r", LONG, "inc-1");
        const theirs = await appended(j, keyed(key, 1_000), claimer("owner-s"));
        // Leased by claim(id): appended leased behind another owner's record, they would be pending.
        const own = await appended(j, keyed(key, 2_000));
        const own2 = await appended(j, keyed(key, 3_000));
        for (const r of [own, own2]) expect((await j.claim(r.id, mine))?.fence).toBe(2);
        const reclaim = { ...claimer("owner-r", LONG, "inc-2"), reclaimOwn: true, limit: 100 };
        expect(ids(await j.claimDue(reclaim)), "held back by another owner's earlier record").toEqual([]);
        await j.complete(theirs.id, tokenOf(theirs));
        expect(ids(await j.claimDue(reclaim))).toEqual([own.id, own2.id]);
      });

      it("limit bounds the batch; a key's records come in order, oldest createdAt first, append order on ties", async (j) => {
        const key = uid("key");
        const c = await appended(j, keyed(key, 30));
        const a = await appended(j, keyed(key, 10));
        const b1 = await appended(j, keyed(key, 20));
        const b2 = await appended(j, keyed(key, 20));
        const holder = claimer();
        expect(ids(await j.claimDue({ ...holder, limit: 2 }))).toEqual([a.id, b1.id]);
        expect(ids(await j.claimDue({ ...claimer(), limit: 10 })), "the rest waits for the holder").toEqual([]);
        expect(ids(await j.claimDue({ ...holder, limit: 10 }))).toEqual([b2.id, c.id]);
      });

      it("claim(id) takes a record whatever the order of its key", async (j) => {
        const key = uid("key");
        await appended(j, keyed(key, 1_000), claimer());
        const later = await appended(j, keyed(key, 2_000));
        expect((await j.claim(later.id, claimer()))?.state).toBe("processing");
      });

      it("concurrent due scans never split a key between claimers: each key's records taken are its first, by one claimer", async (j) => {
        const keys = [uid("key"), uid("key"), uid("key")];
        const order = new Map<string, string[]>();
        const lost = claimer("owner-lost", SHORT); // one holder: a record appended under another lease would be pending
        let t = 1_000;
        for (let i = 0; i < 5; i++) {
          for (const key of keys) {
            const r = await appended(j, keyed(key, t++), lost);
            expect(r.state, "the holder's own leases hold nothing back").toBe("processing");
            order.set(key, [...order.get(key) ?? [], r.id]);
          }
        }
        await sleep(LAPSE);
        const results = await Promise.all(
          Array.from({ length: 6 }, (_, i) => j.claimDue({ ...claimer(`owner-${i}`), limit: 2 })),
        );
        const holder = new Map<string, string>();
        for (let i = 0; i < results.length; i++) {
          for (const r of results[i]!) holder.set(r.id, `owner-${i}`);
          const times = results[i]!.map((r) => r.createdAt);
          expect(times, "one scan's records in order").toEqual([...times].sort((a, b) => a - b));
        }
        for (const key of keys) {
          const list = order.get(key)!;
          const taken = list.filter((id) => holder.has(id));
          expect(taken, `key ${key}: the records taken are its first`).toEqual(list.slice(0, taken.length));
          expect(new Set(taken.map((id) => holder.get(id))).size, `key ${key}: one claimer`).toBeLessThanOrEqual(1);
          for (const id of taken) expect((await mustGet(j, id)).lease?.owner, "the journal agrees").toBe(holder.get(id));
        }
        expect(holder.size, "some records were taken").toBeGreaterThan(0);
      });
    });

    describe("fail, retry, dead", () => {
      it("a failure waits retryInMs, then the record is claimable again", async (j) => {
        const r = await appended(j, event(), claimer());
        await j.fail(r.id, 1, { error: "boom ✗", retryInMs: LONG });
        const failed = await mustGet(j, r.id);
        expect(failed.state).toBe("failed");
        expect(failed.error).toBe("boom ✗");
        expect(failed.lease).toBe(null);
        expect(failed.nextAttemptAt!).toBeGreaterThan(time.now() + LONG / 2);
        expect(await j.claimDue({ ...claimer(), limit: 10 })).toEqual([]);
        expect(await j.claim(r.id, claimer())).toBe(null);

        const s = await appended(j, event(), claimer());
        await j.fail(s.id, 1, { error: "soon", retryInMs: SHORT });
        await sleep(LAPSE);
        const again = await j.claimDue({ ...claimer(), limit: 10 });
        expect(ids(again)).toEqual([s.id]);
        expect(again[0].attempts, "the run its append counted; the claim counts none").toBe(1);
        expect(again[0].error).toBe("soon");
      });

      it("a dead record is never claimed again until replayed", async (j) => {
        const r = await appended(j, event(), claimer());
        await j.fail(r.id, 1, { error: "poison", dead: true });
        const dead = await mustGet(j, r.id);
        expect(dead.state).toBe("dead");
        expect(dead.error).toBe("poison");
        expect(dead.nextAttemptAt).toBe(null);
        expect(await j.claimDue({ ...claimer(), limit: 10 })).toEqual([]);
        expect(await j.claim(r.id, claimer())).toBe(null);
      });
    });

    describe("replay", () => {
      it("done, failed and dead go back to pending with attempts reset and the fence kept", async (j) => {
        const done = await appended(j, event(), claimer());
        await j.complete(done.id, 1);
        const failed = await appended(j, event(), claimer());
        await j.fail(failed.id, 1, { error: "x", retryInMs: LONG });
        const dead = await appended(j, event(), claimer());
        await j.fail(dead.id, 1, { error: "x", dead: true });
        for (const id of [done.id, failed.id, dead.id]) {
          expect(await j.replay(id), `replay ${id}`).toBe(true);
          const r = await mustGet(j, id);
          expect(r.state).toBe("pending");
          expect(r.attempts).toBe(0);
          expect(r.lease).toBe(null);
          expect(r.error).toBe(null);
          expect(r.fence).toBe(1);
        }
        const again = await j.claimDue({ ...claimer(), limit: 10 });
        expect(ids(again).sort()).toEqual([done.id, failed.id, dead.id].sort());
        expect(again.every((r) => tokenOf(r) === 2)).toBe(true);
      });

      it("pending, processing and missing records are not replayed", async (j) => {
        const pending = await appended(j, event());
        const held = await appended(j, event(), claimer());
        expect(await j.replay(pending.id)).toBe(false);
        expect(await j.replay(held.id)).toBe(false);
        expect(await j.replay(uid("missing"))).toBe(false);
        expect(await mustGet(j, held.id)).toEqual(held);
      });

      it("a replayed bot record is claimed again in the bot's channel, not without a channel", async (j) => {
        const r = await appended(j, event(BOT_CHANNEL), claimer());
        await j.complete(r.id, 1);
        expect(await j.replay(r.id)).toBe(true);
        expect(await j.claimDue({ ...claimer(), limit: 10 })).toEqual([]);
        expect(ids(await j.claimDue({ ...claimer(), channel: BOT_CHANNEL, limit: 10 }))).toEqual([r.id]);
      });
    });

    describe("list", () => {
      it("sees every channel in append order, and filters by channel, state, eventType and limit", async (j) => {
        const a = await appended(j, event("a", 30));
        const bot = await appended(j, { ...event(BOT_CHANNEL, 10), eventType: "botwa.inbound.message" });
        const plain = await appended(j, event(null, 20), claimer());
        const plain2 = await appended(j, { ...event(null, 5), eventType: "other.type" });
        await j.complete(plain.id, 1);
        expect(ids(await j.list())).toEqual([a.id, bot.id, plain.id, plain2.id]);
        expect(ids(await j.list({ channel: null }))).toEqual([plain.id, plain2.id]);
        expect(ids(await j.list({ channel: BOT_CHANNEL }))).toEqual([bot.id]);
        expect(ids(await j.list({ channel: "a" }))).toEqual([a.id]);
        expect(ids(await j.list({ channel: "none" }))).toEqual([]);
        expect(ids(await j.list({ state: "done" }))).toEqual([plain.id]);
        expect(ids(await j.list({ state: ["pending", "done"] }))).toEqual([a.id, bot.id, plain.id, plain2.id]);
        expect(ids(await j.list({ state: "pending", channel: null }))).toEqual([plain2.id]);
        expect(ids(await j.list({ eventType: "other.type" }))).toEqual([plain2.id]);
        expect(ids(await j.list({ limit: 2 }))).toEqual([a.id, bot.id]);
        expect(await j.list({ limit: 0 })).toEqual([]);
      });

      it("lists 100 records by default", async (j) => {
        for (let i = 0; i < 105; i++) await appended(j, event());
        expect((await j.list()).length).toBe(100);
        expect((await j.list({ limit: 1000 })).length).toBe(105);
      });
    });

    describe("purge", () => {
      it("deletes done records of the given channel (absent: every channel) older than the cutoff", async (j) => {
        const doneIn = async (channel: string | null): Promise<string> => {
          const r = await appended(j, event(channel), claimer());
          await j.complete(r.id, 1);
          return r.id;
        };
        const botDone = await doneIn(BOT_CHANNEL);
        const plainDone = await doneIn(null);
        const aDone = await doneIn("a");
        const pending = await appended(j, event(null));
        const dead = await appended(j, event(null), claimer());
        await j.fail(dead.id, 1, { error: "x", dead: true });
        expect(await j.purge(LONG), "nothing is old enough").toBe(0);
        await sleep(ms(20));
        expect(await j.purge(0, { channel: BOT_CHANNEL })).toBe(1);
        expect(await j.get(botDone)).toBe(null);
        expect(await j.purge(0, { channel: null })).toBe(1);
        expect(await j.get(plainDone)).toBe(null);
        expect((await mustGet(j, aDone)).state).toBe("done");
        const more = await doneIn("b");
        await sleep(ms(20));
        expect(await j.purge(0)).toBe(2);
        expect(await j.get(aDone)).toBe(null);
        expect(await j.get(more)).toBe(null);
        expect(ids(await j.list())).toEqual([pending.id, dead.id]);
        // A purged id may be appended again.
        expect((await j.append({ ...event(null), id: plainDone })) !== null).toBe(true);
      });
    });

    describe("copies", () => {
      it("records returned and records given are copies", async (j) => {
        const payload = { list: [1, 2], nested: { a: "x" } };
        const input = event(null, 1, payload);
        const r = await appended(j, input);
        payload.list.push(3);
        payload.nested.a = "changed";
        (r.payload as { list: number[] }).list.push(4);
        r.state = "done";
        const got = await mustGet(j, r.id);
        expect(got.payload).toEqual({ list: [1, 2], nested: { a: "x" } });
        expect(got.state).toBe("pending");
        (got.payload as { list: number[] }).list.length = 0;
        const [listed] = await j.list();
        expect(listed.payload).toEqual({ list: [1, 2], nested: { a: "x" } });
        const [claimedRecord] = await j.claimDue({ ...claimer(), limit: 1 });
        claimedRecord.lease!.token = 99;
        expect(tokenOf(await mustGet(j, r.id))).toBe(2);
      });
    });

    describe("concurrency", () => {
      it("concurrent claimDue calls lease each record once", async (j) => {
        const all: string[] = [];
        for (let i = 0; i < 30; i++) all.push((await appended(j, event(null, i))).id);
        await appended(j, event(BOT_CHANNEL));
        const results = await Promise.all(
          Array.from({ length: 10 }, () => j.claimDue({ ...claimer(), limit: 4 })),
        );
        const leased = results.flatMap(ids);
        expect(new Set(leased).size).toBe(leased.length);
        expect(leased.length).toBe(30);
        expect([...leased].sort()).toEqual([...all].sort());
      });

      it("concurrent claims of one record lease it once", async (j) => {
        const r = await appended(j, event(null));
        const results = await Promise.all(Array.from({ length: 10 }, () => j.claim(r.id, claimer())));
        expect(results.filter((x) => x !== null).length).toBe(1);
        expect((await mustGet(j, r.id)).fence).toBe(2);
      });
    });

    describe("set aside", () => {
      it("an event set aside is kept as it is and left out of the rest: its key moves on; it is reported once", async (j) => {
        if (j.setAside === undefined || j.damaged === undefined || j.reportDamaged === undefined) return; // an earlier contract
        expect(await j.damaged(), "none at first").toEqual([]);
        const key = uid("key");
        const odd = await appended(j, { ...event(BOT_CHANNEL, 1_000), orderKey: key }, claimer("owner-x"));
        const next = await appended(j, { ...event(BOT_CHANNEL, 2_000), orderKey: key });
        const done = await appended(j, event(BOT_CHANNEL, 3_000), claimer());
        await j.complete(done.id, 1);
        const before = time.now();
        expect(await j.setAside(odd.id, "not what it should be")).toBe(true);
        expect(await j.setAside(odd.id, "again"), "set aside once").toBe(false);
        expect(await j.setAside(uid("missing"), "x")).toBe(false);
        expect(ids(await j.claimDue({ ...claimer(), channel: BOT_CHANNEL, limit: 100 })), "not taken, not holding back its key")
          .toEqual([next.id]);
        expect(ids(await j.list({ channel: BOT_CHANNEL })), "list returns the rest").toEqual([next.id, done.id]);
        const error = await errorOf(() => j.get(odd.id));
        expect(error instanceof DamagedEventError, `get rejects with a DamagedEventError, got ${String(error)}`).toBe(true);
        expect([(error as DamagedEventError).id, (error as DamagedEventError).problem]).toEqual([odd.id, "not what it should be"]);
        expect(await j.claim(odd.id, { ...claimer(), channel: BOT_CHANNEL })).toBe(null);
        expect(await j.replay(odd.id)).toBe(false);
        expect(await j.heartbeat(odd.id, 1, LONG)).toBe(false);
        await expectStale(() => j.complete(odd.id, 1), "complete under its old lease");
        await expectStale(() => j.fail(odd.id, 1, { error: "x", dead: true }), "fail under its old lease");
        expect(await j.append({ ...event(), id: odd.id }), "its id stays taken").toBe(null);
        await sleep(ms(20));
        expect(await j.purge(0), "purge removes done records only").toBe(1);
        const [found] = await j.damaged();
        expect([found.id, found.channel, found.problem, found.reported]).toEqual([odd.id, BOT_CHANNEL, "not what it should be", false]);
        expect(found.setAsideAt).toBeGreaterThanOrEqual(before - 5_000);
        expect(await j.damaged({ channel: null }), "of another channel").toEqual([]);
        expect(await j.reportDamaged(odd.id, { channel: null }), "not in that channel").toBe(false);
        const answers = await Promise.all([1, 2, 3, 4].map(() => j.reportDamaged!(odd.id, { channel: BOT_CHANNEL })));
        expect(answers.filter((x) => x).length, "exactly one caller reports it").toBe(1);
        expect(await j.reportDamaged(odd.id)).toBe(false);
        expect(await j.reportDamaged(next.id), "not set aside").toBe(false);
        expect(await j.damaged({ unreported: true })).toEqual([]);
        expect((await j.damaged()).map((d) => [d.id, d.reported])).toEqual([[odd.id, true]]);
      });
    });

    describe("bad arguments", () => {
      it("reject with a TypeError or RangeError naming the argument, and change nothing", async (j) => {
        const held = await appended(j, event(null), claimer());
        const pending = await appended(j, event(null));
        const before = await j.list();
        const bad = (o: Record<string, unknown>) => o as unknown as ClaimOptions & { limit: number };
        const cases: [() => Promise<unknown>, string][] = [
          [() => j.claim(pending.id, bad({ incarnation: "i", leaseMs: 1000 })), "owner"],
          [() => j.claim(pending.id, bad({ ...claimer(), channel: 5 })), "channel"],
          [() => j.claimDue(bad({ ...claimer(), leaseMs: "60s", limit: 10 })), "leaseMs"],
          [() => j.claimDue(bad({ ...claimer(), limit: undefined })), "limit"],
          [() => j.claimDue(bad({ ...claimer(), limit: 10, channel: {} })), "channel"],
          [() => j.complete(held.id, undefined as unknown as number), "token"],
          [() => j.fail(held.id, tokenOf(held), { error: 42 } as unknown as { error: string; dead: true }), "error"],
          [() => j.fail(held.id, tokenOf(held), { error: "x", retryInMs: Number.NaN }), "retryInMs"],
          [() => j.heartbeat(held.id, tokenOf(held), "1s" as unknown as number), "leaseMs"],
          [() => j.list({ channel: 5 as unknown as string }), "channel"],
          [() => j.list({ state: [null] as unknown as "done"[] }), "state"],
          [() => j.list({ limit: -1 }), "limit"],
          [() => j.purge("1d" as unknown as number), "olderThanMs"],
          [() => j.purge(0, { channel: 3 as unknown as string }), "channel"],
        ];
        for (const [call, field] of cases) {
          const error = await errorOf(call);
          expect(error instanceof TypeError || error instanceof RangeError, `a TypeError/RangeError for "${field}": ${error}`)
            .toBe(true);
          expect(error.message.includes(field), `the error names "${field}": ${error.message}`).toBe(true);
        }
        expect(await j.list(), "unchanged").toEqual(before);
      });
    });

    describe("close", () => {
      test("operations after close() reject, the outbox sidecar's too", async () => {
        const j = await fresh();
        try {
          const r = await appended(j, event(null));
          await j.close();
          await errorOf(() => j.append(event(null)));
          await errorOf(() => j.claimDue({ ...claimer(), limit: 1 }));
          await errorOf(() => j.get(r.id));
          await errorOf(() => j.list());
          await errorOf(() => j.outbox.list());
          await j.close(); // a second close() is harmless
        } finally {
          await j.close();
          await dispose(j);
        }
      });
    });
  });
}
