import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory/durability.ts";
import { type ClaimOptions, DamagedRecordError, type NewInboundRecord, type NewOutboxEntry, StaleLeaseError } from "../src/contract.ts";

function setup(start = 1_000) {
  const clock = { now: start };
  const backend = new MemoryDurability({ clock: () => clock.now });
  return { clock, backend, inbox: backend.inbox, outbox: backend.outbox };
}

const A: ClaimOptions = { owner: "A", incarnation: "a1", leaseMs: 1_000 };
const A2: ClaimOptions = { owner: "A", incarnation: "a2", leaseMs: 1_000 };
const B: ClaimOptions = { owner: "B", incarnation: "b1", leaseMs: 1_000 };

function msg(id: string, receivedAt = 0, chatId = "c1"): NewInboundRecord {
  return { id, kind: "message", chatId, provider: "test", payload: { text: id }, receivedAt };
}

function send(key: string, chatId = "c1"): NewOutboxEntry {
  return { key, chatId, content: { text: key }, contentHash: `h-${key}`, inboundId: null };
}

describe("MemoryDurability options", () => {
  test("name and scope", () => {
    const backend = new MemoryDurability();
    expect(backend.name).toBe("memory");
    expect(backend.scope).toBe("process");
  });

  test("rejects a clock that is not a function", () => {
    // @ts-expect-error wrong type on purpose
    expect(() => new MemoryDurability({ clock: "now" })).toThrow(/option "clock" must be a function, got "now"/);
    // @ts-expect-error wrong type on purpose
    expect(() => new MemoryDurability(42)).toThrow(TypeError);
  });
});

describe("inbox", () => {
  test("admit, duplicate, copies", async () => {
    const { inbox } = setup();
    const input = msg("m1", 5);
    const record = await inbox.admit(input);
    expect(record).toMatchObject({ id: "m1", state: "pending", attempts: 0, fence: 0, lease: null, updatedAt: 1_000 });
    expect(await inbox.admit(msg("m1", 6))).toBeNull();
    (input.payload as { text: string }).text = "mutated";
    record!.state = "done";
    const got = await inbox.get("m1");
    expect(got).toMatchObject({ state: "pending", payload: { text: "m1" }, receivedAt: 5 });
    (got!.payload as { text: string }).text = "mutated";
    expect((await inbox.get("m1"))!.payload).toEqual({ text: "m1" });
  });

  test("admit with a lease", async () => {
    const { inbox } = setup();
    const record = await inbox.admit(msg("m1"), A);
    expect(record).toMatchObject({ state: "processing", attempts: 1, fence: 1, lease: { owner: "A", token: 1, expiresAt: 2_000 } });
    expect(await inbox.claimDue({ ...B, limit: 10 })).toEqual([]);
  });

  test("fencing: a stale completion throws and changes nothing", async () => {
    const { inbox, clock } = setup();
    await inbox.admit(msg("m1"));
    const first = (await inbox.claim("m1", A))!;
    expect(first.lease!.token).toBe(2) // a claim never issues 1, the token of a leased admission;
    expect(await inbox.claim("m1", B)).toBeNull();
    clock.now += 1_000; // lease lapses
    const second = (await inbox.claim("m1", B))!;
    expect(second.lease!.token).toBe(3);
    expect(second.attempts, "claims count no run").toBe(0);
    await expect(inbox.complete("m1", 2)).rejects.toBeInstanceOf(StaleLeaseError);
    await expect(inbox.fail("m1", 2, { error: "x", retryInMs: 0 })).rejects.toBeInstanceOf(StaleLeaseError);
    expect(await inbox.heartbeat("m1", 2, 1_000)).toBe(false);
    expect(await inbox.heartbeat("m1", 3, 5_000)).toBe(true);
    expect((await inbox.get("m1"))!.lease!.expiresAt).toBe(clock.now + 5_000);
    await inbox.complete("m1", 3);
    expect((await inbox.get("m1"))!.state).toBe("done");
    await expect(inbox.complete("m1", 3)).rejects.toBeInstanceOf(StaleLeaseError);
    await expect(inbox.complete("nope", 1)).rejects.toBeInstanceOf(StaleLeaseError);
  });

  test("lease expiry takeover by claimDue, heartbeats keep it", async () => {
    const { inbox, clock } = setup();
    await inbox.admit(msg("m1"));
    const [r] = await inbox.claimDue({ ...A, limit: 10 });
    expect(r.lease!.owner).toBe("A");
    clock.now += 900;
    expect(await inbox.heartbeat("m1", r.lease!.token, 1_000)).toBe(true);
    clock.now += 900; // past the first expiry, not the extended one
    expect(await inbox.claimDue({ ...B, limit: 10 })).toEqual([]);
    clock.now += 100;
    // Lapsed: whoever sweeps first takes it, its own incarnation too (a claim whose reply was lost).
    const taken = await inbox.claimDue({ ...B, limit: 10 });
    expect(taken.map((x) => [x.id, x.lease!.owner, x.lease!.token])).toEqual([["m1", "B", 3]]);
    expect(await inbox.claimDue({ ...A, limit: 10 }), "B's live lease holds").toEqual([]);
    clock.now += 60_001;
    const back = await inbox.claimDue({ ...B, limit: 10 });
    expect(back.map((x) => [x.id, x.lease!.owner, x.lease!.token]), "B takes back its own lapsed lease").toEqual([["m1", "B", 4]]);
  });

  test("reclaimOwn takes the previous incarnation's leases at once", async () => {
    const { inbox } = setup();
    await inbox.admit(msg("m1"), A);
    await inbox.admit(msg("m2", 0, "c2"), B);
    expect(await inbox.claimDue({ ...A2, limit: 10 })).toEqual([]);
    const got = await inbox.claimDue({ ...A2, limit: 10, reclaimOwn: true });
    expect(got.map((x) => [x.id, x.lease!.incarnation, x.fence])).toEqual([["m1", "a2", 2]]);
    // The new incarnation's own leases are never reclaimed by itself.
    expect(await inbox.claimDue({ ...A2, limit: 10, reclaimOwn: true })).toEqual([]);
    expect(await inbox.claim("m2", { ...A2, reclaimOwn: true })).toBeNull();
  });

  test("claimDue: oldest receivedAt first, limit, failed retry time", async () => {
    const { inbox, clock } = setup();
    await inbox.admit(msg("late", 30));
    await inbox.admit(msg("early", 10));
    await inbox.admit(msg("tie", 10));
    await inbox.admit(msg("future", 1_000_000)); // pending is claimable whatever its receivedAt
    const two = await inbox.claimDue({ ...A, limit: 2 });
    expect(two.map((x) => x.id)).toEqual(["early", "tie"]);
    const rest = await inbox.claimDue({ ...A, limit: 10 });
    expect(rest.map((x) => x.id)).toEqual(["late", "future"]);
    await inbox.fail("early", 2, { error: "boom", retryInMs: 500 });
    expect(await inbox.get("early")).toMatchObject({ state: "failed", error: "boom", nextAttemptAt: 1_500, lease: null });
    expect(await inbox.claimDue({ ...A, limit: 10 })).toEqual([]);
    clock.now += 500;
    const again = await inbox.claimDue({ ...A, limit: 10 });
    expect(again.map((x) => [x.id, x.attempts, x.fence])).toEqual([["early", 0, 3]]);
    await inbox.fail("early", 3, { error: "fatal", dead: true });
    expect((await inbox.get("early"))!.state).toBe("dead");
  });

  test("list order and filters, replay", async () => {
    const { inbox } = setup();
    await inbox.admit(msg("b", 20, "c2"));
    await inbox.admit(msg("a", 10));
    await inbox.admit(msg("c", 20));
    expect((await inbox.list()).map((x) => x.id)).toEqual(["a", "b", "c"]);
    expect((await inbox.list({ chatId: "c1" })).map((x) => x.id)).toEqual(["a", "c"]);
    expect((await inbox.list({ limit: 1 })).map((x) => x.id)).toEqual(["a"]);
    const r = (await inbox.claim("a", A))!;
    expect((await inbox.list({ state: ["processing"] })).map((x) => x.id)).toEqual(["a"]);
    expect(await inbox.replay("a")).toBe(false);
    await inbox.fail("a", r.lease!.token, { error: "e", dead: true });
    expect(await inbox.replay("a")).toBe(true);
    expect(await inbox.get("a")).toMatchObject({ state: "pending", attempts: 0, error: null, fence: 2 });
    const again = (await inbox.claim("a", A))!;
    expect(again.lease!.token).toBe(3); // tokens keep increasing across replays
    expect(await inbox.replay("b")).toBe(false);
    expect(await inbox.replay("missing")).toBe(false);
  });

  test("purge deletes old done records only", async () => {
    const { inbox, clock } = setup();
    for (const id of ["a", "b", "c"]) await inbox.admit(msg(id), A);
    await inbox.complete("a", 1);
    clock.now += 100;
    await inbox.complete("b", 1);
    await inbox.fail("c", 1, { error: "x", dead: true });
    expect(await inbox.purge(100)).toBe(1);
    expect(await inbox.get("a")).toBeNull();
    expect(await inbox.purge(0)).toBe(1);
    expect((await inbox.list()).map((x) => x.id)).toEqual(["c"]);
    // A replayed done record is not purged.
    await inbox.admit(msg("d"), A);
    await inbox.complete("d", 1);
    await inbox.replay("d");
    expect(await inbox.purge(0)).toBe(0);
    // A purged id can be admitted again.
    expect(await inbox.admit(msg("a"))).not.toBeNull();
  });

  test("claimDue does not scan settled records", async () => {
    const { inbox, outbox } = setup();
    for (let i = 0; i < 10_000; i++) {
      await inbox.admit(msg(`d${i}`, i), A);
      await inbox.complete(`d${i}`, 1);
      await outbox.reserve(send(`s${i}`, `c${i}`), A);
      await outbox.markSent(`s${i}`, 1, `p${i}`);
    }
    await inbox.admit(msg("due", 1));
    await outbox.reserve(send("due", "cx"));
    // Any iteration over a big Map or Set during the scans fails the test.
    const protos = [Map.prototype, Set.prototype] as unknown as Record<PropertyKey, unknown>[];
    const names: PropertyKey[] = ["values", "keys", "entries", "forEach", Symbol.iterator];
    const saved = protos.map((p) => names.map((n) => p[n]));
    let bigScans = 0;
    for (const p of protos) {
      for (const n of names) {
        const original = p[n] as (...args: unknown[]) => unknown;
        p[n] = function (this: { size: number }, ...args: unknown[]) {
          if (this.size >= 1_000) bigScans++;
          return original.apply(this, args);
        };
      }
    }
    let inboxDue, outboxDue;
    try {
      inboxDue = await inbox.claimDue({ ...B, limit: 10 });
      outboxDue = await outbox.claimDue({ ...B, limit: 10 });
    } finally {
      protos.forEach((p, i) => names.forEach((n, j) => (p[n] = saved[i][j])));
    }
    expect(bigScans).toBe(0);
    expect(inboxDue.map((x) => x.id)).toEqual(["due"]);
    expect(outboxDue.due.map((x) => x.key)).toEqual(["due"]);
    expect(await inbox.purge(0)).toBe(10_000);
    expect(await outbox.purge(0)).toBe(10_000);
  });
});

describe("outbox", () => {
  test("reserve: leased, queued behind the chat, exists", async () => {
    const { outbox } = setup();
    const first = await outbox.reserve(send("k1"), A);
    expect(first.status).toBe("leased");
    expect(first.entry).toMatchObject({ state: "sending", attempts: 1, fence: 1, seq: 1, lease: { token: 1 } });
    const second = await outbox.reserve(send("k2"), A);
    expect(second.status).toBe("queued");
    expect(second.entry).toMatchObject({ state: "queued", attempts: 0, seq: 2, nextAttemptAt: 1_000 });
    const other = await outbox.reserve(send("k3", "c2"), A);
    expect(other.status).toBe("leased");
    const plain = await outbox.reserve(send("k4", "c3"));
    expect(plain.status).toBe("queued");
    const again = await outbox.reserve({ ...send("k1"), contentHash: "other" }, B);
    expect(again.status).toBe("exists");
    expect(again.entry).toMatchObject({ key: "k1", contentHash: "h-k1", state: "sending", lease: { owner: "A" } });
  });

  test("chat order: a later send waits for the earlier one", async () => {
    const { outbox, clock } = setup();
    await outbox.reserve(send("k1"), A);
    await outbox.reserve(send("k2"));
    await outbox.reserve(send("k3"));
    expect((await outbox.claimDue({ ...A, limit: 10 })).due).toEqual([]);
    await outbox.markFailed("k1", 1, { error: "429", retryInMs: 100 });
    // k1 failed: still blocks k2.
    expect((await outbox.claimDue({ ...A, limit: 10 })).due).toEqual([]);
    clock.now += 100;
    let claim = await outbox.claimDue({ ...A, limit: 10 });
    expect(claim.due.map((x) => [x.key, x.attempts, x.fence])).toEqual([["k1", 2, 2]]);
    await outbox.markSent("k1", 2, "p1");
    expect(await outbox.get("k1")).toMatchObject({ state: "sent", messageId: "p1", lease: null });
    claim = await outbox.claimDue({ ...A, limit: 10 });
    expect(claim.due.map((x) => x.key)).toEqual(["k2"]);
    await outbox.markFailed("k2", 2, { error: "400", dead: true });
    claim = await outbox.claimDue({ ...A, limit: 10 });
    expect(claim.due.map((x) => x.key)).toEqual(["k3"]);
    await expect(outbox.markSent("k2", 2, "x")).rejects.toBeInstanceOf(StaleLeaseError);
    // Retrying the dead k2 puts it back in front of later sends.
    expect(await outbox.retry("k2")).toBe(true);
    expect(await outbox.get("k2")).toMatchObject({ state: "queued", attempts: 0, error: "400", nextAttemptAt: clock.now });
    const k4 = await outbox.reserve(send("k4"), A);
    expect(k4.status).toBe("queued");
    await outbox.markSent("k3", 2, "p3");
    claim = await outbox.claimDue({ ...A, limit: 10 });
    expect(claim.due.map((x) => x.key)).toEqual(["k2"]);
    expect((await outbox.list({ chatId: "c1" })).map((x) => x.key)).toEqual(["k1", "k2", "k3", "k4"]);
  });

  test("discard frees the chat", async () => {
    const { outbox } = setup();
    await outbox.reserve(send("k1"), A);
    await outbox.reserve(send("k2"));
    expect(await outbox.discard("k1")).toBe(false); // sending
    await outbox.markFailed("k1", 1, { error: "e", retryInMs: 60_000 });
    expect(await outbox.discard("k1")).toBe(true);
    expect(await outbox.get("k1")).toBeNull();
    expect((await outbox.claimDue({ ...A, limit: 10 })).due.map((x) => x.key)).toEqual(["k2"]);
    expect(await outbox.discard("missing")).toBe(false);
  });

  test("ambiguous: a lapsed sending entry becomes unknown once; the chat moves on", async () => {
    const { outbox, clock } = setup();
    await outbox.reserve(send("k1"), A);
    expect(await outbox.markCalling("k1", 1, A.leaseMs)).toBe(true); // the call was announced
    await outbox.reserve(send("k2"));
    clock.now += 999;
    expect(await outbox.claimDue({ ...B, limit: 10 })).toEqual({ due: [], ambiguous: [] });
    clock.now += 1;
    const claim = await outbox.claimDue({ ...B, limit: 10 });
    expect(claim.ambiguous.map((x) => [x.key, x.state, x.lease])).toEqual([["k1", "unknown", null]]);
    expect(claim.due.map((x) => [x.key, x.lease!.owner])).toEqual([["k2", "B"]]);
    expect((await outbox.claimDue({ ...A, limit: 10 })).ambiguous).toEqual([]);
    // The sender's late outcome resolves it (the fence is still its token); a second one is stale.
    await outbox.markSent("k1", 1, "late");
    expect([(await outbox.get("k1"))!.state, (await outbox.get("k1"))!.messageId]).toEqual(["sent", "late"]);
    await expect(outbox.markSent("k1", 1, "again")).rejects.toBeInstanceOf(StaleLeaseError);
    expect(await outbox.retry("k1")).toBe(false);
  });

  test("ambiguous with reclaimOwn and resendAmbiguous", async () => {
    const { outbox } = setup();
    await outbox.reserve(send("k1"), A);
    await outbox.markCalling("k1", 1, A.leaseMs);
    await outbox.reserve(send("k2", "c2"), B);
    await outbox.markCalling("k2", 1, B.leaseMs);
    // Same incarnation never resolves its own sends.
    expect((await outbox.claimDue({ ...A, limit: 10, reclaimOwn: true })).ambiguous).toEqual([]);
    const claim = await outbox.claimDue({ ...A2, limit: 10, reclaimOwn: true, resendAmbiguous: true });
    expect(claim.ambiguous.map((x) => [x.key, x.state])).toEqual([["k1", "sending"]]);
    expect(claim.due.map((x) => [x.key, x.lease!.incarnation, x.fence, x.attempts])).toEqual([["k1", "a2", 2, 2]]);
    expect(await outbox.heartbeat("k1", 1, 1_000)).toBe(false);
    expect(await outbox.heartbeat("k1", 2, 1_000)).toBe(true);
    await outbox.markSent("k1", 2, "p1");
  });

  test("a lapsed send whose call was never announced is due again, not ambiguous; own incarnation's too", async () => {
    const { outbox, clock } = setup();
    await outbox.reserve(send("k1"), A);
    await outbox.reserve(send("k2"));
    clock.now += 1_000;
    const claim = await outbox.claimDue({ ...B, limit: 10 });
    expect(claim.ambiguous).toEqual([]);
    expect(claim.due.map((x) => [x.key, x.lease!.owner, x.fence, x.attempts, x.called])).toEqual([["k1", "B", 2, 1, false]]);
    await outbox.reserve(send("k3", "c3"), A);
    const own = await outbox.claimDue({ ...A2, limit: 10, reclaimOwn: true });
    expect(own.ambiguous).toEqual([]);
    expect(own.due.map((x) => [x.key, x.lease!.incarnation, x.attempts])).toEqual([["k3", "a2", 1]]);
  });

  test("records exported before the call marker existed read as called: a lapsed one stays ambiguous", async () => {
    const { clock } = setup();
    const source = new MemoryDurability({ clock: () => clock.now });
    await source.outbox.reserve(send("k1"), A);
    const exported = JSON.parse(JSON.stringify(source.exportRecords()));
    for (const e of exported.outbox) delete e.called; // as an older version wrote it
    const imported = new MemoryDurability({ clock: () => clock.now });
    imported.importRecords(exported);
    expect((await imported.outbox.get("k1"))!.called).toBe(true);
    const changes = new MemoryDurability({ clock: () => clock.now });
    changes.applyOutboxChanges(exported.outbox, [], exported.outboxSeq);
    expect((await changes.outbox.get("k1"))!.called).toBe(true);
    clock.now += 1_000;
    for (const b of [imported, changes]) {
      const claim = await b.outbox.claimDue({ ...B, limit: 10 });
      expect([claim.due, claim.ambiguous.map((x) => x.key)]).toEqual([[], ["k1"]]);
    }
  });

  test("list and purge", async () => {
    const { outbox, clock } = setup();
    await outbox.reserve(send("k1"), A);
    await outbox.reserve(send("k2", "c2"), A);
    await outbox.reserve(send("k3"));
    await outbox.markSent("k1", 1, "p1");
    expect((await outbox.list({ state: "queued" })).map((x) => x.key)).toEqual(["k3"]);
    expect((await outbox.list({ limit: 2 })).map((x) => x.key)).toEqual(["k1", "k2"]);
    clock.now += 10;
    await outbox.markSent("k2", 1, "p2");
    expect(await outbox.purge(10)).toBe(1);
    expect(await outbox.get("k1")).toBeNull();
    expect(await outbox.purge(0)).toBe(1);
    expect(await outbox.reserve(send("k1"))).toMatchObject({ status: "queued", entry: { seq: 4 } });
  });
});

describe("damaged records", () => {
  test("none ever: damaged() lists nothing, reportDamaged() answers false; both check their arguments", async () => {
    const { backend } = setup();
    await backend.inbox.admit(msg("m1"));
    await backend.outbox.reserve(send("k1"));
    for (const journal of [backend.inbox, backend.outbox]) {
      expect(await journal.damaged()).toEqual([]);
      expect(await journal.damaged({ unreported: true, limit: 0 })).toEqual([]);
      expect(await journal.reportDamaged("m1")).toBe(false);
      // @ts-expect-error wrong type on purpose
      await expect(journal.damaged({ unreported: "yes" })).rejects.toThrow(/option "unreported" must be a boolean, got "yes"/);
      await expect(journal.damaged({ limit: -1 })).rejects.toThrow(RangeError);
      // @ts-expect-error wrong type on purpose
      await expect(journal.damaged(42)).rejects.toThrow(/options must be an object, got 42/);
      // @ts-expect-error wrong type on purpose
      await expect(journal.reportDamaged(42)).rejects.toThrow(/reportDamaged: "id" must be a string/);
    }
  });

  test("records a loader set aside: listed, reported once, their ids taken, left out of everything else", async () => {
    const { clock } = setup();
    const backend = new MemoryDurability({ clock: () => clock.now });
    const aside = (journal: "inbox" | "outbox", id: string) =>
      ({ journal, id, backend: "file", problem: `field "state" is bad`, setAsideAt: 5, reported: false, stored: { id, state: "?" } });
    backend.importRecords({ inbox: [], outbox: [], outboxSeq: 3, damaged: [aside("inbox", "m1"), aside("outbox", "k1"), aside("inbox", "m2")] });
    expect((await backend.inbox.damaged()).map((d) => d.id)).toEqual(["m1", "m2"]);
    expect(await backend.inbox.damaged({ limit: 1 })).toEqual([
      { journal: "inbox", id: "m1", backend: "file", problem: `field "state" is bad`, setAsideAt: 5, reported: false },
    ]);
    expect(await Promise.all([1, 2, 3].map(() => backend.inbox.reportDamaged("m1")))).toEqual([true, false, false]);
    expect((await backend.inbox.damaged({ unreported: true })).map((d) => d.id)).toEqual(["m2"]);
    await expect(backend.inbox.get("m2")).rejects.toBeInstanceOf(DamagedRecordError);
    expect(await backend.inbox.admit(msg("m2"))).toBeNull();
    expect(await backend.inbox.claim("m2", A)).toBeNull();
    expect(await backend.inbox.replay("m2")).toBe(false);
    await expect(backend.outbox.reserve(send("k1"))).rejects.toThrow(/Outbox entry "k1" in backend "file" is damaged and set aside/);
    expect(await backend.outbox.retry("k1")).toBe(false);
    expect(await backend.outbox.discard("k1")).toBe(false);
    expect((await backend.outbox.reserve(send("k2"))).entry.seq).toBe(4);
    expect(backend.exportRecords().damaged!.map((d) => [d.id, d.reported])).toEqual([["m1", true], ["m2", false], ["k1", false]]);
  });
});
