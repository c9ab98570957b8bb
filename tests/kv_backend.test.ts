/**
 * Tests of what is specific to the generic kv backend: hint keys under
 * crashes and races, and O(due) scans. The contract itself is checked by the
 * conformance suite (tests/conformance_kv.test.ts).
 */
import { describe, expect, test } from "bun:test";
import {
  type ClaimOptions,
  DamagedRecordError,
  type DurableKv,
  type JsonValue,
  type KvEntry,
  type NewInboundRecord,
  type NewOutboxEntry,
} from "../src/contract.ts";
import { KvDurability } from "../backends/kv/durability.ts";
import { MemoryKv } from "../backends/memory/kv.ts";

const T0 = 1_700_000_000_000;
const HOUR = 3_600_000;

function clocked(): { kv: MemoryKv; advance: (ms: number) => void } {
  let now = T0;
  return { kv: new MemoryKv({ clock: () => now }), advance: (ms) => void (now += ms) };
}

function msg(id: string, chatId = "c1", receivedAt = T0): NewInboundRecord {
  return { id, kind: "message", chatId, provider: "test", payload: { text: id }, receivedAt };
}

function send(key: string, chatId = "c1"): NewOutboxEntry {
  return { key, chatId, content: { text: key }, contentHash: `h:${key}`, inboundId: null };
}

const A: ClaimOptions = { owner: "a", incarnation: "a1", leaseMs: 30_000 };
const B: ClaimOptions = { owner: "b", incarnation: "b1", leaseMs: 30_000 };

/** Forwards to `inner`; subclasses hook the calls. */
class WrapKv implements DurableKv {
  readonly name: string = "wrap";
  readonly scope: "process" = "process";
  constructor(readonly inner: DurableKv) {}
  get(key: string): Promise<KvEntry | null> {
    return this.inner.get(key);
  }
  set(key: string, value: JsonValue, expectVersion?: string | null): Promise<string | null> {
    return this.inner.set(key, value, expectVersion);
  }
  delete(key: string, expectVersion?: string): Promise<boolean> {
    return this.inner.delete(key, expectVersion);
  }
  list(prefix: string, options?: { after?: string; limit?: number }): Promise<KvEntry[]> {
    return this.inner.list(prefix, options);
  }
  now(): Promise<number> {
    return this.inner.now();
  }
}

/** Dies at the `crashAt`-th write (set or delete), before or after applying it; every later call fails. */
class CrashingKv extends WrapKv {
  writes = 0;
  crashed = false;
  constructor(inner: DurableKv, readonly crashAt: number, readonly mode: "before" | "after") {
    super(inner);
  }
  #alive(): void {
    if (this.crashed) throw new Error("process is dead");
  }
  async #write<T>(op: () => Promise<T>): Promise<T> {
    this.#alive();
    if (++this.writes === this.crashAt) {
      this.crashed = true;
      if (this.mode === "after") await op();
      throw new Error("crash");
    }
    return op();
  }
  override get(key: string): Promise<KvEntry | null> {
    this.#alive();
    return super.get(key);
  }
  override set(key: string, value: JsonValue, expectVersion?: string | null): Promise<string | null> {
    return this.#write(() => super.set(key, value, expectVersion));
  }
  override delete(key: string, expectVersion?: string): Promise<boolean> {
    return this.#write(() => super.delete(key, expectVersion));
  }
  override list(prefix: string, options?: { after?: string; limit?: number }): Promise<KvEntry[]> {
    this.#alive();
    return super.list(prefix, options);
  }
  override now(): Promise<number> {
    this.#alive();
    return super.now();
  }
}

/** Counts reads. */
class CountingKv extends WrapKv {
  gets = 0;
  lists = 0;
  override get(key: string): Promise<KvEntry | null> {
    this.gets++;
    return super.get(key);
  }
  override list(prefix: string, options?: { after?: string; limit?: number }): Promise<KvEntry[]> {
    this.lists++;
    return super.list(prefix, options);
  }
}

/** Yields a random number of times before each call, so that concurrent operations interleave. */
class JitterKv extends WrapKv {
  async #jitter(): Promise<void> {
    for (let n = Math.floor(Math.random() * 6); n > 0; n--) await Promise.resolve();
  }
  override async get(key: string): Promise<KvEntry | null> {
    await this.#jitter();
    return super.get(key);
  }
  override async set(key: string, value: JsonValue, expectVersion?: string | null): Promise<string | null> {
    await this.#jitter();
    return super.set(key, value, expectVersion);
  }
  override async delete(key: string, expectVersion?: string): Promise<boolean> {
    await this.#jitter();
    return super.delete(key, expectVersion);
  }
  override async list(prefix: string, options?: { after?: string; limit?: number }): Promise<KvEntry[]> {
    await this.#jitter();
    return super.list(prefix, options);
  }
}

/** Holds every delete until `release()`. */
class HeldDeletesKv extends WrapKv {
  held: (() => void)[] = [];
  override async delete(key: string, expectVersion?: string): Promise<boolean> {
    await new Promise<void>((resolve) => this.held.push(resolve));
    return super.delete(key, expectVersion);
  }
  release(): void {
    for (const go of this.held.splice(0)) go();
  }
}

const ACTIVE = new Set(["pending", "processing", "scheduled", "failed", "queued", "sending"]);

/** Every hint a record lists exists, and exactly the active records list a due hint. */
async function expectHintsIntact(kv: DurableKv, prefix = ""): Promise<void> {
  for (const entry of await kv.list(`${prefix}r/`)) {
    const { rec, hints } = entry.value as { rec: { state: string }; hints: string[] };
    for (const hint of hints) {
      if ((await kv.get(hint)) === null) throw new Error(`${entry.key} (${rec.state}) lost its hint ${hint}`);
    }
    expect(hints.some((hint) => hint.startsWith(`${prefix}i/due/`))).toBe(ACTIVE.has(rec.state));
  }
}

async function settle(): Promise<void> {
  for (let i = 0; i < 50; i++) await new Promise((resolve) => setTimeout(resolve, 0));
}

describe("KvDurability", () => {
  test("name and scope come from the kv", () => {
    const backend = new KvDurability(new MemoryKv());
    expect(backend.name).toBe("kv:memory");
    expect(backend.scope).toBe("process");
  });

  test("ids and chat ids with '/' and '%' stay apart", async () => {
    const { kv } = clocked();
    const backend = new KvDurability(kv, { prefix: "p/" });
    await backend.inbox.admit(msg("x/1%2F", "a/b"));
    await backend.inbox.admit(msg("x%2F1", "a"));
    const claimed = await backend.inbox.claimDue({ ...A, limit: 10 });
    expect(claimed.map((r) => r.id).sort()).toEqual(["x%2F1", "x/1%2F"]);
    expect((await backend.inbox.list({ chatId: "a/b" })).map((r) => r.id)).toEqual(["x/1%2F"]);
    expect((await backend.inbox.list({ state: "processing", chatId: "a" })).map((r) => r.id)).toEqual(["x%2F1"]);

    // Chat "a/b" is not held back by an unsettled send of chat "a" (or of "a%2Fb").
    expect((await backend.outbox.reserve(send("k1", "a"), A)).status).toBe("leased");
    expect((await backend.outbox.reserve(send("k2", "a%2Fb"), A)).status).toBe("leased");
    expect((await backend.outbox.reserve(send("k3", "a/b"), A)).status).toBe("leased");
    expect((await backend.outbox.reserve(send("k4", "a"), A)).status).toBe("queued");
    await expectHintsIntact(kv, "p/");
  });

  test("a crash at any write never loses a record from the inbox due scan", async () => {
    for (const mode of ["before", "after"] as const) {
      for (let crashAt = 1;; crashAt++) {
        const { kv, advance } = clocked();
        const dying = new CrashingKv(kv, crashAt, mode);
        const backend = new KvDurability(dying);
        try {
          await backend.inbox.admit(msg("m2", "c1", T0 - 4), A); // leased: nothing of c1 comes first
          await backend.inbox.admit(msg("m1", "c1", T0 - 5));
          await backend.inbox.admit(msg("m3", "c2", T0 - 3));
          const [m1] = await backend.inbox.claimDue({ ...A, limit: 1 });
          await backend.inbox.heartbeat("m2", 1, 60_000);
          await backend.inbox.fail(m1.id, m1.lease!.token, { error: "boom", retryInMs: 1000 });
          await backend.inbox.complete("m2", 1);
          await backend.inbox.replay("m2");
          const m3 = await backend.inbox.claim("m3", A);
          await backend.inbox.fail("m3", m3!.lease!.token, { error: "x", dead: true });
          await backend.inbox.replay("m3");
          await backend.inbox.claimDue({ ...A, limit: 10 });
        } catch (error) {
          if (!dying.crashed) throw error;
        }
        await expectHintsIntact(kv);
        // Another instance, after every lease lapsed, finds every unfinished record.
        advance(HOUR);
        const rescuer = new KvDurability(kv);
        await rescuer.inbox.claimDue({ ...B, limit: 100 });
        for (const record of await rescuer.inbox.list({ limit: 1000 })) {
          expect(record.state === "done" || record.state === "dead" || record.lease?.owner === "b").toBe(true);
        }
        await expectHintsIntact(kv);
        if (!dying.crashed) break; // the script ran to its end: every write was a crash point once
      }
    }
  });

  test("a crash at any write never loses an outbox entry from the due scan", async () => {
    for (const mode of ["before", "after"] as const) {
      for (let crashAt = 1;; crashAt++) {
        const { kv, advance } = clocked();
        const dying = new CrashingKv(kv, crashAt, mode);
        const backend = new KvDurability(dying);
        try {
          const k1 = await backend.outbox.reserve(send("k1"), A);
          await backend.outbox.reserve(send("k2"), A); // queued behind k1
          await backend.outbox.reserve(send("k3", "c2"));
          await backend.outbox.markFailed("k1", k1.entry.lease!.token, { error: "503", retryInMs: 0 });
          const { due } = await backend.outbox.claimDue({ ...A, limit: 10 });
          for (const entry of due) {
            if (entry.key === "k1") await backend.outbox.markSent("k1", entry.lease!.token, "p1");
            else await backend.outbox.markFailed(entry.key, entry.lease!.token, { error: "400", dead: true });
          }
          await backend.outbox.retry("k3");
          await backend.outbox.claimDue({ ...A, limit: 10 }); // leases k2 and k3; A then dies
          await backend.outbox.reserve(send("k4"), A);
        } catch (error) {
          if (!dying.crashed) throw error;
        }
        await expectHintsIntact(kv);
        advance(HOUR);
        const rescuer = new KvDurability(kv);
        for (let round = 0; round < 10; round++) {
          const { due } = await rescuer.outbox.claimDue({ ...B, limit: 100, resendAmbiguous: true });
          for (const entry of due) await rescuer.outbox.markSent(entry.key, entry.lease!.token, `m:${entry.key}`);
          if (due.length === 0) break;
        }
        for (const entry of await rescuer.outbox.list({ limit: 1000 })) {
          expect(["sent", "dead"]).toContain(entry.state);
        }
        await expectHintsIntact(kv);
        if (!dying.crashed) break;
      }
    }
  });

  test("a hint dropped late by a slow instance cannot remove the hint a later change needs", async () => {
    const { kv } = clocked();
    const slow = new HeldDeletesKv(kv);
    const fast = new KvDurability(kv);
    await fast.inbox.admit(msg("m1"));
    const claiming = new KvDurability(slow).inbox.claim("m1", A); // stalls after its CAS, before dropping hints
    for (let i = 0; i < 100 && slow.held.length === 0; i++) await Promise.resolve();
    expect(slow.held.length).toBeGreaterThan(0);
    await fast.inbox.fail("m1", 2, { error: "x", dead: true });
    expect(await fast.inbox.replay("m1")).toBe(true); // pending again: the same due position as at first
    slow.release();
    expect((await claiming)?.lease?.token).toBe(2);
    await expectHintsIntact(kv);
    expect((await fast.inbox.claimDue({ ...B, limit: 10 })).map((r) => r.id)).toEqual(["m1"]);
  });

  test("hints of a create that never happened are kept for a while, then removed", async () => {
    const { kv, advance } = clocked();
    const dying = new CrashingKv(kv, 3, "before"); // two hints written, the record never
    await expect(new KvDurability(dying).inbox.admit(msg("m1"))).rejects.toThrow("crash");
    const backend = new KvDurability(kv);
    expect((await kv.list("i/")).length).toBe(2);
    expect(await backend.inbox.claimDue({ ...A, limit: 10 })).toEqual([]);
    expect((await kv.list("i/")).length).toBe(2); // its writer might still be on the way
    advance(HOUR);
    expect(await backend.inbox.claimDue({ ...A, limit: 10 })).toEqual([]);
    expect((await kv.list("i/due/")).length).toBe(0);
    // A redelivery is admitted normally.
    expect(await backend.inbox.admit(msg("m1"))).not.toBeNull();
    expect((await backend.inbox.claimDue({ ...A, limit: 10 })).map((r) => r.id)).toEqual(["m1"]);
  });

  test("two instances racing to claim one record: exactly one wins", async () => {
    for (let trial = 0; trial < 100; trial++) {
      const { kv } = clocked();
      const shared = new JitterKv(kv);
      const one = new KvDurability(shared);
      const two = new KvDurability(shared);
      await one.inbox.admit(msg("m1"));
      const results = await Promise.all([one.inbox.claim("m1", A), two.inbox.claim("m1", B)]);
      const winners = results.filter((r) => r !== null);
      expect(winners.length).toBe(1);
      expect(winners[0]!.lease!.token).toBe(2);
      const stored = await one.inbox.get("m1");
      expect(stored!.lease!.owner).toBe(winners[0]!.lease!.owner);
      expect(stored!.attempts, "a claim counts no run").toBe(0);
      await expectHintsIntact(kv);
    }
  });

  test("racing due scans share the records out: each claimed once", async () => {
    const { kv } = clocked();
    const shared = new JitterKv(kv);
    const seed = new KvDurability(kv);
    for (let i = 0; i < 60; i++) await seed.inbox.admit(msg(`m${String(i).padStart(2, "0")}`, `c${i}`, T0 + i));
    const instances = ["x", "y", "z"].map((owner) => ({ owner, incarnation: owner, leaseMs: 30_000 }));
    const claims = await Promise.all(instances.map((o) => new KvDurability(shared).inbox.claimDue({ ...o, limit: 60 })));
    const ids = claims.flat().map((r) => r.id);
    expect(ids.length).toBe(60);
    expect(new Set(ids).size).toBe(60);
    for (const batch of claims) {
      expect(batch.map((r) => r.receivedAt)).toEqual([...batch.map((r) => r.receivedAt)].sort((a, b) => a - b));
    }
    await expectHintsIntact(kv);
  });

  test("an abandoned send becomes unknown exactly once across racing claimers", async () => {
    const { kv, advance } = clocked();
    const seed = new KvDurability(kv);
    for (let i = 0; i < 20; i++) {
      const reserved = await seed.outbox.reserve(send(`k${i}`, `c${i}`), A);
      expect(reserved.status).toBe("leased");
      expect(await seed.outbox.markCalling(reserved.entry.key, reserved.entry.lease!.token, A.leaseMs)).toBe(true);
    }
    advance(A.leaseMs + 1);
    const shared = new JitterKv(kv);
    const results = await Promise.all(
      [B, { ...B, owner: "c" }, { ...B, owner: "d" }].map((o) => new KvDurability(shared).outbox.claimDue({ ...o, limit: 10 })),
    );
    const keys = results.flatMap((r) => r.ambiguous.map((e) => e.key));
    expect(keys.length).toBe(20);
    expect(new Set(keys).size).toBe(20);
    expect(results.every((r) => r.due.length === 0)).toBe(true);
    expect((await seed.outbox.list({ state: "unknown", limit: 100 })).length).toBe(20);
    await expectHintsIntact(kv);
  });

  test("an abandoned send whose call was never announced is leased again exactly once across racing claimers", async () => {
    const { kv, advance } = clocked();
    const seed = new KvDurability(kv);
    for (let i = 0; i < 20; i++) expect((await seed.outbox.reserve(send(`k${i}`, `c${i}`), A)).status).toBe("leased");
    advance(A.leaseMs + 1);
    const shared = new JitterKv(kv);
    const results = await Promise.all(
      [B, { ...B, owner: "c" }, { ...B, owner: "d" }].map((o) => new KvDurability(shared).outbox.claimDue({ ...o, limit: 5 })),
    );
    expect(results.every((r) => r.ambiguous.length === 0 && r.due.length <= 5)).toBe(true);
    const due = results.flatMap((r) => r.due);
    expect(new Set(due.map((e) => e.key)).size).toBe(due.length);
    expect(due.every((e) => e.fence === 2 && e.attempts === 1 && !e.called && e.state === "sending")).toBe(true);
    // What the limits left behind is still `sending` under A's lapsed lease, and the next scan takes it.
    const rest = await seed.outbox.claimDue({ ...B, limit: 100 });
    expect(rest.ambiguous).toEqual([]);
    expect(rest.due.length).toBeGreaterThanOrEqual(5);
    expect(rest.due.every((e) => e.fence === 2 && e.attempts === 1)).toBe(true);
    expect(new Set([...due, ...rest.due].map((e) => e.key)).size).toBe(20);
    expect((await seed.outbox.list({ state: "sending", limit: 100 })).every((e) => e.lease!.token === 2)).toBe(true);
    await expectHintsIntact(kv);
  });

  test("an entry stored before `called` existed reads as called; a write upgrades it in place", async () => {
    const { kv, advance } = clocked();
    const backend = new KvDurability(kv);
    const lapsing = await backend.outbox.reserve(send("k1", "c1"), A);
    const queued = await backend.outbox.reserve(send("k2", "c2"));
    const held = await backend.outbox.reserve(send("k3", "c3"), A);
    // Rewrite the stored values as an older version wrote them: no `called` field.
    for (const key of ["k1", "k2", "k3"]) {
      const stored = (await kv.get(`r/out/${key}`))!;
      const { rec, hints } = stored.value as { rec: Record<string, JsonValue>; hints: JsonValue };
      delete rec.called;
      expect(await kv.set(stored.key, { rec, hints }, stored.version)).not.toBeNull();
    }
    expect((await backend.outbox.get("k1"))!.called, "an old sending entry may have started its call").toBe(true);
    expect((await backend.outbox.get("k2"))!.called).toBe(true);
    expect((await backend.outbox.list({ limit: 10 })).map((e) => e.called)).toEqual([true, true, true]);
    expect((await backend.outbox.list({ state: "queued" })).map((e) => e.called)).toEqual([true]);
    expect((await backend.outbox.reserve(send("k1", "c1"), A))).toMatchObject({ status: "exists", entry: { called: true } });

    // A heartbeat writes the entry back with the flag (still true: nothing may clear it but a claim).
    expect(await backend.outbox.heartbeat("k3", held.entry.lease!.token, 10 * A.leaseMs)).toBe(true);
    expect(((await kv.get("r/out/k3"))!.value as { rec: { called?: boolean } }).rec.called).toBe(true);

    // Its lease lapsed: conservative, so ambiguous as before the flag existed; the queued one is leased uncalled.
    advance(A.leaseMs + 1);
    const claim = await backend.outbox.claimDue({ ...B, limit: 10 });
    expect(claim.ambiguous.map((e) => e.key)).toEqual([lapsing.entry.key]);
    expect((await backend.outbox.get("k1"))!.state).toBe("unknown");
    expect(claim.due.map((e) => e.key)).toEqual([queued.entry.key]);
    expect(claim.due[0]!.called, "a claim starts it uncalled").toBe(false);
    expect(((await kv.get("r/out/k2"))!.value as { rec: { called?: boolean } }).rec.called).toBe(false);
    await expectHintsIntact(kv);
  });

  test("claimDue reads O(due), not O(all)", async () => {
    const { kv } = clocked();
    const seed = new KvDurability(kv);
    for (let i = 0; i < 5000; i++) {
      await seed.inbox.admit(msg(`d${i}`, "c1", T0 - 10_000 + i), A);
      await seed.inbox.complete(`d${i}`, 1);
      const reserved = await seed.outbox.reserve(send(`s${i}`, `c${i % 50}`), A);
      await seed.outbox.markSent(`s${i}`, reserved.entry.lease!.token, `p${i}`);
    }
    await seed.inbox.admit(msg("due"));
    await seed.outbox.reserve(send("due", "c7"));

    const counting = new CountingKv(kv);
    const backend = new KvDurability(counting);
    expect((await backend.inbox.claimDue({ ...B, limit: 10 })).map((r) => r.id)).toEqual(["due"]);
    expect(counting.lists + counting.gets).toBeLessThanOrEqual(3);

    counting.gets = counting.lists = 0;
    expect((await backend.outbox.claimDue({ ...B, limit: 10 })).due.map((e) => e.key)).toEqual(["due"]);
    expect(counting.lists + counting.gets).toBeLessThanOrEqual(4);

    counting.gets = counting.lists = 0;
    expect(await backend.inbox.purge(60_000)).toBe(0); // nothing old enough: one page, stops at once
    expect(await backend.outbox.purge(60_000)).toBe(0);
    expect(counting.lists + counting.gets).toBeLessThanOrEqual(2);
  });

  test("a leased admit reads the chat index up to its own arrival: one list, and one read of each active record before it", async () => {
    const { kv } = clocked();
    const counting = new CountingKv(kv);
    const backend = new KvDurability(counting);
    const admit = async (id: string, chatId: string, receivedAt: number, lease?: ClaimOptions) => {
      counting.gets = counting.lists = 0;
      const record = await backend.inbox.admit(msg(id, chatId, receivedAt), lease);
      return [record?.state, counting.lists, counting.gets];
    };
    expect(await admit("p1", "c9", T0), "without a lease: no list, no read").toEqual(["pending", 0, 0]);
    expect(await admit("m1", "c1", T0, A), "nothing before it").toEqual(["processing", 1, 0]);
    expect(await admit("m2", "c1", T0 + 1, A), "the caller's own lease lets it").toEqual(["processing", 1, 1]);
    expect(await admit("m0", "c1", T0 - 1, B), "records received later come after it: not read").toEqual(["processing", 1, 0]);
    expect(await admit("m3", "c1", T0 + 1, B), "held elsewhere, in the same millisecond too").toEqual(["pending", 1, 3]);
    await backend.inbox.complete("m1", 1);
    await backend.inbox.complete("m2", 1);
    expect(await admit("m4", "c1", T0 + 2, B), "settled records leave the index; a pending one comes first").toEqual(["pending", 1, 2]);

    // Same millisecond, the new id sorting first: it is held back at admission and in due scans alike.
    expect((await backend.inbox.admit(msg("x1", "c2", T0), A))!.state).toBe("processing");
    expect((await backend.inbox.admit(msg("x0", "c2", T0), B))!.state).toBe("pending");
    expect((await backend.inbox.claimDue({ ...B, limit: 10 })).map((r) => r.id), "nothing of c2 while x1 is held").toEqual(["p1", "m3", "m4"]);
    await backend.inbox.complete("x1", 1);
    expect((await backend.inbox.claimDue({ ...B, limit: 10 })).map((r) => r.id)).toEqual(["x0"]);

    // A record without a chat index key (stored before the index existed) and a damaged one count as nothing.
    await backend.inbox.admit(msg("old", "c3", T0), A);
    const old = (await kv.get("r/in/old"))!;
    const { rec, hints } = old.value as { rec: JsonValue; hints: string[] };
    const chatKey = hints.find((hint) => hint.startsWith("i/chat-in/"))!;
    await kv.set("r/in/old", { rec, hints: hints.filter((hint) => hint !== chatKey) }, old.version);
    await kv.delete(chatKey);
    await backend.inbox.admit(msg("bad", "c3", T0), A);
    const bad = (await kv.get("r/in/bad"))!.value as { rec: Record<string, JsonValue>; hints: string[] };
    await kv.set("r/in/bad", { ...bad, rec: { ...bad.rec, state: "archived" } });
    expect(await admit("new", "c3", T0 + 1, B)).toEqual(["processing", 1, 1]);
    expect((await backend.inbox.damaged()).map((d) => d.id), "the damaged one, met by the admit, is set aside").toEqual(["bad"]);
  });

  test("purge and list by state go through the state index", async () => {
    const { kv, advance } = clocked();
    const backend = new KvDurability(kv);
    for (let i = 0; i < 5; i++) {
      await backend.inbox.admit(msg(`m${i}`, "c1", T0 + i), A);
      if (i < 3) await backend.inbox.complete(`m${i}`, 1);
    }
    advance(10_000);
    await backend.inbox.admit(msg("m9", "c1", T0 + 9), A);
    await backend.inbox.complete("m9", 1);
    expect((await backend.inbox.list({ state: "done" })).map((r) => r.id)).toEqual(["m0", "m1", "m2", "m9"]);
    expect((await backend.inbox.list({ state: ["processing", "done"], limit: 3 })).map((r) => r.id))
      .toEqual(["m0", "m1", "m2"]);
    expect(await backend.inbox.purge(5_000)).toBe(3);
    expect((await backend.inbox.list()).map((r) => r.id)).toEqual(["m3", "m4", "m9"]);
    await expectHintsIntact(kv);
    expect((await kv.list("i/st/in/done/")).length).toBe(1);
  });

  test("seq increases across instances sharing one kv", async () => {
    const { kv } = clocked();
    const shared = new JitterKv(kv);
    const results = await Promise.all(
      Array.from({ length: 30 }, (_, i) => new KvDurability(shared).outbox.reserve(send(`k${i}`, `c${i}`))),
    );
    const seqs = results.map((r) => r.entry.seq).sort((a, b) => a - b);
    expect(seqs).toEqual(Array.from({ length: 30 }, (_, i) => i + 1));
    await settle();
  });

  test("a damaged value is set aside once across racing instances, kept as it is, and its index keys stop counting", async () => {
    const { kv, advance } = clocked();
    const seed = new KvDurability(kv);
    for (const id of ["m1", "m2", "m3"]) await seed.inbox.admit(msg(id, "c1"), A);
    await kv.set("r/in/m1", { rec: { id: "m1" }, hints: ["i/due/x"] }); // the first of its chat
    const shared = new JitterKv(kv);
    advance(60_000);
    const scans = await Promise.all([1, 2, 3, 4].map(() => new KvDurability(shared).inbox.claimDue({ ...B, limit: 10 })));
    expect(scans.flat().map((r) => r.id).sort(), "the rest of the chat is taken, once").toEqual(["m2", "m3"]);
    const markers = await kv.list("d/in/");
    expect(markers.map((m) => [m.key, (m.value as { reported: boolean }).reported])).toEqual([["d/in/m1", false]]);
    expect(await kv.get("r/in/m1"), "kept as it is").toMatchObject({ value: { rec: { id: "m1" }, hints: ["i/due/x"] } });
    const itsKeys = async (prefix: string) => (await kv.list(prefix)).filter((hint) => hint.key.includes("/m1/")).length;
    expect([await itsKeys("i/due/"), await itsKeys("i/chat-in/")], "the index keys the scans met are gone").toEqual([0, 0]);
    expect(await seed.inbox.list({ state: "processing" })).toHaveLength(2);
    expect(await itsKeys("i/st/"), "and a list by state drops its state key").toBe(0);
    const read: string[] = [];
    const watching = new (class extends WrapKv {
      override get(key: string): Promise<KvEntry | null> {
        read.push(key);
        return super.get(key);
      }
    })(kv);
    advance(60_000);
    expect((await new KvDurability(watching).inbox.claimDue({ ...A, limit: 10 })).map((r) => r.id)).toEqual(["m2", "m3"]);
    expect(read.filter((key) => key === "r/in/m1"), "the damaged record is not read again").toEqual([]);
    const [problem] = await seed.inbox.damaged();
    expect(problem).toMatchObject({ journal: "inbox", id: "m1", backend: "kv:memory", reported: false });
    expect(problem!.problem).toContain('field "kind"');
  });

  test("a value whose id is not its key's, met first by get, is set aside by it", async () => {
    const { kv } = clocked();
    const backend = new KvDurability(kv, { prefix: "p:" });
    await backend.outbox.reserve(send("a/b"));
    const stored = (await kv.get("p:r/out/a%2Fb"))!.value as { rec: Record<string, unknown>; hints: string[] };
    await kv.set("p:r/out/a%2Fb", { ...stored, rec: { ...stored.rec, key: "other" } });
    const error = await backend.outbox.get("a/b").catch((e) => e);
    expect(error).toBeInstanceOf(DamagedRecordError);
    expect(error.problem).toBe('field "key" must be the one of its key ("a/b"), got "other"');
    expect((await backend.outbox.damaged()).map((d) => d.id)).toEqual(["a/b"]);
    await expect(backend.outbox.reserve(send("a/b"))).rejects.toBeInstanceOf(DamagedRecordError);
    expect(await backend.outbox.list()).toEqual([]);
    expect(await backend.outbox.reportDamaged("a/b")).toBe(true);
    expect(await backend.outbox.reportDamaged("a/b")).toBe(false);
  });
});
