import { describe, expect, test } from "bun:test";
import { DamagedRecordError, type DurabilityBackend, type OutboxEntry, StaleLeaseError } from "../src/contract.ts";
import { MemoryKv } from "../backends/memory/kv.ts";
import { EventsDurability, type EventsDurabilityOptions } from "../backends/events/durability.ts";
import { type EventJournalChanges, type EventJournalState, MemoryEventJournal } from "../backends/events/memory_journal.ts";
import {
  BOT_CHANNEL,
  DamagedEventError,
  type EventRecord,
  INBOUND_INTERACTION_EVENT,
  INBOUND_MESSAGE_EVENT,
  type LeasedEventJournal,
} from "../src/events/types.ts";
import { runEventJournalContract } from "../src/testing/event_journal_contract.ts";
import { runBackendContract } from "../testing.ts";

/** The journal under each backend, so that a "restarted process" gets a journal loaded from a snapshot of it. */
const journalOf = new WeakMap<DurabilityBackend, MemoryEventJournal>();
const kvOf = new WeakMap<DurabilityBackend, MemoryKv>();

function over(journal: MemoryEventJournal, kv?: MemoryKv): DurabilityBackend {
  const backend = new EventsDurability({ journal, outbox: kv });
  journalOf.set(backend, journal);
  if (kv) kvOf.set(backend, kv);
  return backend;
}

/** A journal loaded from the JSON text of `old`'s snapshot, as a file journal would be after a restart. */
function reloaded(old: MemoryEventJournal, clock?: () => number): MemoryEventJournal {
  return MemoryEventJournal.fromState(JSON.parse(JSON.stringify(old.exportState())) as EventJournalState, clock ? { clock } : undefined);
}

// The whole suite runs once for the events family, on the file journal (conformance_events_file): over
// the other journals, EventsDurability runs the journal contract, and each journal its own contract.
runBackendContract({
  name: "events(memory-events)",
  create: ({ now }) => over(new MemoryEventJournal({ clock: now })),
  reopen: (old, { now }) => over(reloaded(journalOf.get(old)!, now)),
  harness: { describe, test, expect },
  simulatedTime: true,
});

runBackendContract({
  name: "events(memory-events) + kv outbox",
  create: ({ now }) => over(new MemoryEventJournal({ clock: now }), new MemoryKv({ clock: now })),
  reopen: (old, { now }) => over(reloaded(journalOf.get(old)!, now), kvOf.get(old)!),
  harness: { describe, test, expect },
  simulatedTime: true,
});

runEventJournalContract({
  name: "memory-events",
  create: ({ now }) => new MemoryEventJournal({ clock: now }),
  harness: { describe, test, expect },
  simulatedTime: true,
});

runEventJournalContract({
  name: "memory-events (loaded from a snapshot)",
  create: ({ now }) => reloaded(new MemoryEventJournal({ clock: now }), now),
  harness: { describe, test, expect },
  simulatedTime: true,
});

/** A seeded random source (mulberry32). */
function seeded(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const roundTrip = <T>(value: T): T => JSON.parse(JSON.stringify(value)) as T;
const text = (journal: MemoryEventJournal): string => JSON.stringify(journal.exportState());

/**
 * Runs `steps` random operations (events and outbox, several owners, a clock
 * that jumps so that leases lapse and purges delete) on `journal`.
 */
async function randomOps(
  journal: MemoryEventJournal,
  clock: { now: number },
  random: () => number,
  steps: number,
  after?: (step: number) => void,
): Promise<void> {
  const pick = <T>(list: readonly T[]): T => list[Math.floor(random() * list.length)];
  const channels = [null, "a", BOT_CHANNEL];
  const owners = ["w1", "w2", "w3"];
  const incarnations = ["i1", "i2"];
  const claimOf = () => ({ owner: pick(owners), incarnation: pick(incarnations), leaseMs: pick([50, 500, 5_000]) });
  let n = 0;
  for (let step = 0; step < steps; step++) {
    clock.now += Math.floor(random() * 200);
    const all = journal.exportState();
    const someEvent = all.events.length > 0 ? pick(all.events) : null;
    const someEntry = all.outbox.length > 0 ? pick(all.outbox) : null;
    const op = Math.floor(random() * 18);
    try {
      switch (op) {
        case 0:
        case 1:
          await journal.append(
            { id: `e${n++}`, channel: pick(channels), eventType: "t", payload: { step, r: random() }, createdAt: Math.floor(random() * 1000) },
            random() < 0.3 ? claimOf() : undefined,
          );
          break;
        case 2:
          await journal.claimDue({ ...claimOf(), channel: pick(channels), limit: 1 + Math.floor(random() * 3), reclaimOwn: random() < 0.3 });
          break;
        case 3:
          if (someEvent) await journal.claim(someEvent.id, { ...claimOf(), channel: someEvent.channel });
          break;
        case 4:
          if (someEvent?.lease) await journal.heartbeat(someEvent.id, someEvent.lease.token, 1_000);
          break;
        case 5:
          if (someEvent?.lease) await journal.complete(someEvent.id, someEvent.lease.token);
          break;
        case 6:
          if (someEvent?.lease) {
            await journal.fail(someEvent.id, someEvent.lease.token, random() < 0.3 ? { error: "dead", dead: true } : { error: "x", retryInMs: 100 });
          }
          break;
        case 7:
          if (someEvent) await journal.replay(someEvent.id);
          break;
        case 8:
          await journal.purge(Math.floor(random() * 500), random() < 0.5 ? { channel: pick(channels) } : undefined);
          break;
        case 9:
        case 10:
          await journal.outbox.reserve(
            { key: `k${n++}`, chatId: pick(["c1", "c2"]), content: { step }, contentHash: "h", inboundId: null },
            random() < 0.5 ? claimOf() : undefined,
          );
          break;
        case 11:
          await journal.outbox.claimDue({ ...claimOf(), limit: 2, reclaimOwn: random() < 0.3, resendAmbiguous: random() < 0.5 });
          break;
        case 12:
          if (someEntry?.lease) {
            if (random() < 0.5) await journal.outbox.markSent(someEntry.key, someEntry.lease.token, `m${step}`);
            else await journal.outbox.markFailed(someEntry.key, someEntry.lease.token, { error: "x", retryInMs: 50 });
          }
          break;
        case 13:
          if (someEntry?.lease) {
            if (random() < 0.5) await journal.outbox.heartbeat(someEntry.key, someEntry.lease.token, 1_000);
            else await journal.outbox.markCalling(someEntry.key, someEntry.lease.token, 1_000);
          }
          break;
        case 14:
          if (someEntry) await (random() < 0.5 ? journal.outbox.retry(someEntry.key) : journal.outbox.discard(someEntry.key));
          break;
        case 15:
          await journal.outbox.purge(Math.floor(random() * 500));
          break;
        case 16:
          if (someEvent && random() < 0.3) await journal.setAside(someEvent.id, `set aside at step ${step}`);
          break;
        case 17: {
          const aside = await journal.damaged({ unreported: true });
          if (aside.length > 0) await journal.reportDamaged(pick(aside).id);
          break;
        }
      }
    } catch (error) {
      if (!(error instanceof StaleLeaseError)) throw error;
    }
    after?.(step);
  }
}

describe("MemoryEventJournal state and changes", () => {
  test("exportState / fromState round trip keeps records, order, fences and the outbox seq", async () => {
    const clock = { now: 1_000 };
    const journal = new MemoryEventJournal({ clock: () => clock.now });
    await randomOps(journal, clock, seeded(1), 300);
    const state = journal.exportState();
    expect(state.events.length).toBeGreaterThan(0);
    expect(state.outbox.length).toBeGreaterThan(0);
    expect(state.damaged!.length, "some were set aside").toBeGreaterThan(0);
    const copy = MemoryEventJournal.fromState(roundTrip(state), { clock: () => clock.now });
    expect(text(copy)).toBe(text(journal));
    expect(await copy.damaged({ limit: 1000 })).toEqual(await journal.damaged({ limit: 1000 }));
    expect(copy.takeChanges(), "loading is not a change").toBe(null);
    expect(await copy.list({ limit: 1000 })).toEqual(await journal.list({ limit: 1000 }));
    expect(await copy.outbox.list({ limit: 1000 })).toEqual(await journal.outbox.list({ limit: 1000 }));
    // It goes on from the loaded state: the next outbox seq is above every one before.
    const next = await copy.outbox.reserve({ key: "later", chatId: "c9", content: null, contentHash: "h", inboundId: null });
    expect(next.entry.seq).toBe(state.outboxSeq + 1);
  });

  test("importState refuses a journal with records, repeated ids and a malformed state; a malformed record is loaded damaged", async () => {
    const journal = new MemoryEventJournal();
    await journal.append({ id: "x", eventType: "t", payload: null });
    expect(() => journal.importState({ events: [], outbox: [], outboxSeq: 0 })).toThrow(/empty/);
    const state = journal.exportState();
    expect(() => MemoryEventJournal.fromState({ ...state, events: [state.events[0], state.events[0]] })).toThrow(RangeError);
    expect(() => MemoryEventJournal.fromState(null as unknown as EventJournalState)).toThrow(TypeError);
    expect(() => MemoryEventJournal.fromState({ ...state, damaged: 5 as unknown as [] })).toThrow(/damaged/);
    const weird = MemoryEventJournal.fromState({ ...state, events: [{ ...state.events[0], state: "weird" as "done" }] });
    await expect(weird.get("x")).rejects.toThrow(/field "state"/);
    const nan = MemoryEventJournal.fromState({ ...state, events: [{ ...state.events[0], fence: Number.NaN }] });
    await expect(nan.get("x")).rejects.toThrow(/field "fence"/);
  });

  for (const seed of [2, 3, 4, 5]) {
    test(`a journal rebuilt from a snapshot and change sets equals the original (seed ${seed})`, async () => {
      const clock = { now: 1_000 };
      const journal = new MemoryEventJournal({ clock: () => clock.now, heartbeatChanges: true });
      const log: EventJournalChanges[] = [];
      let snapshot: { state: EventJournalState; at: number } | null = null;
      const random = seeded(seed);
      await randomOps(journal, clock, random, 600, (step) => {
        if (random() < 0.3) {
          const changes = journal.takeChanges();
          if (changes) log.push(roundTrip(changes));
        }
        if (step === 300) {
          const changes = journal.takeChanges();
          if (changes) log.push(roundTrip(changes));
          snapshot = { state: roundTrip(journal.exportState()), at: log.length };
        }
      });
      const last = journal.takeChanges();
      if (last) log.push(roundTrip(last));
      expect(journal.takeChanges(), "nothing changed since").toBe(null);
      expect(log.length).toBeGreaterThan(10);

      // From empty, every set once.
      const fromEmpty = new MemoryEventJournal();
      for (const changes of log) fromEmpty.applyChanges(roundTrip(changes));
      expect(text(fromEmpty)).toBe(text(journal));
      expect(fromEmpty.takeChanges(), "applying is not a change").toBe(null);

      // From empty, every set twice.
      const twice = new MemoryEventJournal();
      for (const changes of log) {
        twice.applyChanges(roundTrip(changes));
        twice.applyChanges(roundTrip(changes));
      }
      expect(text(twice)).toBe(text(journal));

      // From the snapshot, the later sets.
      const { state, at } = snapshot!;
      const fromSnapshot = MemoryEventJournal.fromState(roundTrip(state), { clock: () => clock.now });
      for (const changes of log.slice(at)) fromSnapshot.applyChanges(roundTrip(changes));
      expect(text(fromSnapshot)).toBe(text(journal));

      // From the snapshot, the sets it already holds replayed too.
      const replayed = MemoryEventJournal.fromState(roundTrip(state));
      for (const changes of log) replayed.applyChanges(roundTrip(changes));
      expect(text(replayed)).toBe(text(journal));

      // The rebuilt journal behaves the same.
      const owner = { owner: "w9", incarnation: "z", leaseMs: 1_000, limit: 100 };
      expect(await fromSnapshot.claimDue(owner)).toEqual(await journal.claimDue(owner));
    });
  }

  test("heartbeats are changes only with heartbeatChanges", async () => {
    const clock = { now: 1_000 };
    const quiet = new MemoryEventJournal({ clock: () => clock.now });
    const loud = new MemoryEventJournal({ clock: () => clock.now, heartbeatChanges: true });
    for (const journal of [quiet, loud]) {
      await journal.append({ id: "e", eventType: "t", payload: null }, { owner: "o", incarnation: "i", leaseMs: 100 });
      await journal.outbox.reserve({ key: "k", chatId: "c", content: null, contentHash: "h", inboundId: null }, {
        owner: "o",
        incarnation: "i",
        leaseMs: 100,
      });
      expect(journal.takeChanges()?.events.length).toBe(1);
    }
    clock.now += 10;
    for (const journal of [quiet, loud]) {
      expect(await journal.heartbeat("e", 1, 5_000)).toBe(true);
      expect(await journal.outbox.heartbeat("k", 1, 5_000)).toBe(true);
    }
    expect(quiet.takeChanges(), "a heartbeat alone is not a change").toBe(null);
    const changes = loud.takeChanges()!;
    expect(changes.events.map((e) => e.lease?.expiresAt)).toEqual([1_010 + 5_000]);
    expect(changes.outbox.map((e) => e.lease?.expiresAt)).toEqual([1_010 + 5_000]);
    // The next real change reports the current lease.
    await quiet.outbox.markSent("k", 1, "m");
    await quiet.heartbeat("e", 1, 7_000);
    await quiet.append({ id: "f", eventType: "t", payload: null });
    const next = quiet.takeChanges()!;
    expect(next.events.map((e) => e.id)).toEqual(["f"]);
    expect(next.outbox.map((e) => e.state)).toEqual(["sent"]);
    await quiet.complete("e", 1);
    expect(quiet.takeChanges()!.events.map((e) => e.state)).toEqual(["done"]);
  });

  test("markCalling is a change, also without heartbeatChanges: `called` is reported for writing", async () => {
    const clock = { now: 1_000 };
    const journal = new MemoryEventJournal({ clock: () => clock.now });
    const lease = { owner: "o", incarnation: "i", leaseMs: 100 };
    await journal.outbox.reserve({ key: "k", chatId: "c", content: null, contentHash: "h", inboundId: null }, lease);
    expect(journal.takeChanges()?.outbox.map((e) => e.called)).toEqual([false]);
    clock.now += 10;
    expect(await journal.outbox.markCalling("k", 2, 5_000), "a stale token").toBe(false);
    expect(journal.takeChanges(), "a refused markCalling changes nothing").toBe(null);
    expect(await journal.outbox.markCalling("k", 1, 5_000)).toBe(true);
    const changes = journal.takeChanges()!;
    expect(changes.outbox.map((e) => [e.key, e.called, e.lease?.expiresAt])).toEqual([["k", true, 1_010 + 5_000]]);
    // Replayed elsewhere (a snapshot, a log line), the flag comes along.
    const copy = new MemoryEventJournal({ clock: () => clock.now });
    copy.applyChanges(roundTrip(changes));
    expect((await copy.outbox.get("k"))?.called).toBe(true);
    await journal.close();
    await expect(journal.outbox.markCalling("k", 1, 5_000)).rejects.toThrow(/outbox\.markCalling.*closed/);
  });

  test("outbox entries stored before `called` existed (a state, a change set) read as called", async () => {
    const clock = { now: 1_000 };
    const journal = new MemoryEventJournal({ clock: () => clock.now });
    const lease = { owner: "o", incarnation: "i", leaseMs: 100 };
    await journal.outbox.reserve({ key: "a", chatId: "c1", content: null, contentHash: "h", inboundId: null }, lease);
    await journal.outbox.reserve({ key: "b", chatId: "c2", content: null, contentHash: "h", inboundId: null });
    const old = <T extends { outbox: OutboxEntry[] }>(value: T): T => {
      const copy = roundTrip(value);
      for (const entry of copy.outbox) delete (entry as Partial<OutboxEntry>).called;
      return copy;
    };
    const fromState = MemoryEventJournal.fromState(old(journal.exportState()), { clock: () => clock.now });
    const fromChanges = new MemoryEventJournal({ clock: () => clock.now });
    fromChanges.applyChanges(old(journal.takeChanges()!));
    for (const loaded of [fromState, fromChanges]) {
      expect((await loaded.outbox.list()).map((e) => [e.key, e.called])).toEqual([["a", true], ["b", true]]);
      expect(loaded.exportState().outbox.map((e) => e.called), "exported with the flag").toEqual([true, true]);
    }
    // A lapsed old send may have started its call: ambiguous, as before the flag existed.
    clock.now += 1_000;
    for (const loaded of [fromState, fromChanges]) {
      const claim = await loaded.outbox.claimDue({ owner: "p", incarnation: "j", leaseMs: 100, limit: 10 });
      expect(claim.ambiguous.map((e) => e.key)).toEqual(["a"]);
      expect(claim.due.map((e) => [e.key, e.called])).toEqual([["b", false]]);
    }
  });

  test("a purged id appended again keeps its place when a change set is applied again", async () => {
    const clock = { now: 1_000 };
    const journal = new MemoryEventJournal({ clock: () => clock.now });
    await journal.append({ id: "a", eventType: "t", payload: 1 }, { owner: "o", incarnation: "i", leaseMs: 10 });
    await journal.complete("a", 1);
    await journal.append({ id: "b", eventType: "t", payload: 2 });
    const base = roundTrip(journal.exportState());
    journal.takeChanges();
    clock.now += 100;
    expect(await journal.purge(50)).toBe(1);
    await journal.append({ id: "a", eventType: "t", payload: 3 });
    const changes = roundTrip(journal.takeChanges()!);
    expect(changes.removedEvents).toEqual(["a"]);
    expect(changes.events.map((e) => e.id)).toEqual(["a"]);
    const copy = MemoryEventJournal.fromState(base);
    copy.applyChanges(roundTrip(changes));
    expect(text(copy)).toBe(text(journal));
    expect((await copy.list()).map((e) => e.id)).toEqual(["b", "a"]);
    copy.applyChanges(roundTrip(changes));
    expect(text(copy)).toBe(text(journal));
  });

  test("applyChanges refuses a malformed set and applies nothing; a malformed record is stored damaged, as it is", async () => {
    const journal = new MemoryEventJournal();
    expect(() => journal.applyChanges({} as EventJournalChanges)).toThrow(TypeError);
    const set = { events: [{ id: "x" } as EventRecord], removedEvents: [], outbox: [], removedOutbox: [], outboxSeq: 0 };
    expect(() => journal.applyChanges({ ...set, damaged: {} as [] })).toThrow(TypeError);
    expect(journal.exportState().events).toEqual([]);
    journal.applyChanges(set);
    expect(journal.exportState().events).toEqual([{ id: "x" } as EventRecord]);
    await expect(journal.get("x")).rejects.toThrow(DamagedEventError);
  });

  test("the outbox sidecar and the journal reject calls after close; state and changes stay readable", async () => {
    const journal = new MemoryEventJournal();
    await journal.append({ id: "e", eventType: "t", payload: null });
    await journal.close();
    expect(journal.closed).toBe(true);
    await expect(journal.outbox.list()).rejects.toThrow(/closed/);
    await expect(journal.get("e")).rejects.toThrow(/closed/);
    expect(journal.exportState().events.length).toBe(1);
    expect(journal.takeChanges()?.events.length).toBe(1);
  });

  test("option checks", () => {
    expect(() => new MemoryEventJournal({ clock: 5 as unknown as () => number })).toThrow(/clock/);
    expect(() => new MemoryEventJournal({ heartbeatChanges: "yes" as unknown as boolean })).toThrow(/heartbeatChanges/);
  });
});

describe("damaged records of a MemoryEventJournal", () => {
  const lease = { owner: "other", incarnation: "i", leaseMs: 60_000 };
  /** A state with valid and damaged events (one without a readable id) and outbox entries. */
  async function damagedState(): Promise<EventJournalState> {
    const source = new MemoryEventJournal({ clock: () => 1_000 });
    await source.append({ id: "held", orderKey: "k", eventType: "t", payload: null, createdAt: 1 }, lease);
    await source.append({ id: "next", orderKey: "k", eventType: "t", payload: { n: 2 }, createdAt: 2 });
    await source.append({ id: "nameless", channel: "a", eventType: "t", payload: null, createdAt: 3 });
    await source.outbox.reserve({ key: "k1", chatId: "c", content: "one", contentHash: "h", inboundId: null });
    await source.outbox.reserve({ key: "k2", chatId: "c", content: "two", contentHash: "h", inboundId: null });
    const state = roundTrip(source.exportState());
    (state.events[0] as unknown as Record<string, unknown>).attempts = "many"; // processing under a live lease: would hold "k"
    (state.events[2] as unknown as Record<string, unknown>).id = 5;
    (state.outbox[0] as unknown as Record<string, unknown>).state = "exploded";
    return state;
  }

  test("a record that is not valid is loaded as it is, set aside once by the first operation that meets it, and left out of the rest", async () => {
    const state = await damagedState();
    const stored = roundTrip(state);
    let now = 5_000;
    const journal = MemoryEventJournal.fromState(state, { clock: () => now });
    expect(journal.takeChanges(), "loading is not a change").toBe(null);
    // The due scan meets them: the damaged record neither taken nor holding back its key.
    const claimed = await journal.claimDue({ owner: "w", incarnation: "j", leaseMs: 1_000, limit: 10 });
    expect(claimed.map((e) => e.id)).toEqual(["next"]);
    const marks = journal.takeChanges()!.damaged!;
    expect(marks.map((m) => [m.journal, m.id, m.setAsideAt, m.reported])).toEqual([
      ["events", "held", 5_000, false],
      ["events", marks[1].id, 5_000, false],
    ]);
    expect(marks[1].id).toMatch(/^damaged:[0-9a-f]{16}$/);
    now = 6_000;
    const found = await journal.damaged();
    // Set aside at once: in key order.
    expect(found.map((d) => [d.id, d.channel, d.setAsideAt])).toEqual([[marks[1].id, "a", 5_000], ["held", null, 5_000]]);
    expect(found[0].problem).toContain('field "id"');
    expect(found[1].problem).toContain('field "attempts"');
    expect((await journal.damaged({ channel: "a" })).map((d) => d.id)).toEqual([marks[1].id]);
    const error = await journal.get("held").then(() => null, (e: unknown) => e);
    expect(error).toBeInstanceOf(DamagedEventError);
    expect([(error as DamagedEventError).id, (error as DamagedEventError).journal]).toEqual(["held", "memory-events"]);
    expect((await journal.list()).map((e) => e.id)).toEqual(["next"]);
    expect(await journal.claim("held", { ...lease, owner: "w2" })).toBe(null);
    expect(await journal.replay("held")).toBe(false);
    expect(await journal.heartbeat("held", 1, 1_000)).toBe(false);
    await expect(journal.complete("held", 1)).rejects.toThrow(StaleLeaseError);
    await expect(journal.fail("held", 1, { error: "x", dead: true })).rejects.toThrow(StaleLeaseError);
    expect(await journal.append({ id: "held", eventType: "t", payload: null }), "its id stays taken").toBe(null);
    expect(await journal.setAside("held", "again"), "set aside once").toBe(false);
    // The outbox sidecar: the same, met by its own operations.
    expect((await journal.outbox.list()).map((e) => e.key)).toEqual(["k2"]);
    const [entry] = await journal.outbox.damaged!();
    expect([entry.journal, entry.id, entry.backend, entry.setAsideAt, entry.reported]).toEqual(["outbox", "k1", "memory-events", 6_000, false]);
    await expect(journal.outbox.get("k1")).rejects.toThrow(DamagedRecordError);
    await expect(journal.outbox.reserve({ key: "k1", chatId: "c", content: "one", contentHash: "h", inboundId: null }))
      .rejects.toThrow(DamagedRecordError);
    expect(await journal.outbox.retry("k1")).toBe(false);
    expect(await journal.outbox.discard("k1")).toBe(false);
    expect((await journal.outbox.claimDue({ owner: "w", incarnation: "j", leaseMs: 1_000, limit: 10 })).due.map((e) => e.key)).toEqual(["k2"]);
    // Reported once.
    expect(await Promise.all([journal.reportDamaged("held"), journal.reportDamaged("held")])).toEqual([true, false]);
    expect(await journal.reportDamaged("next"), "not a damaged record").toBe(false);
    expect(await journal.outbox.reportDamaged!("k1")).toBe(true);
    expect((await journal.damaged({ unreported: true })).map((d) => d.id)).toEqual([marks[1].id]);
    // Kept as stored, and so exported; marks survive a reload, which sets nothing aside again.
    const exported = roundTrip(journal.exportState());
    expect(exported.events[0]).toEqual(stored.events[0]);
    expect(exported.events[2]).toEqual(stored.events[2]);
    expect(exported.outbox.find((e) => e.key === "k1")).toEqual(stored.outbox[0]);
    const again = MemoryEventJournal.fromState(exported, { clock: () => 9_000 });
    expect(await again.damaged()).toEqual(await journal.damaged());
    expect(await again.outbox.damaged!()).toEqual(await journal.outbox.damaged!());
    expect(again.takeChanges()).toBe(null);
  });

  test("a change set with a damaged record stores it as it is; its mark goes with the changes", async () => {
    const state = await damagedState();
    const a = new MemoryEventJournal({ clock: () => 7_000 });
    const b = new MemoryEventJournal({ clock: () => 8_000 });
    const changes = { events: state.events, removedEvents: [], outbox: state.outbox, removedOutbox: [], outboxSeq: state.outboxSeq };
    a.applyChanges(roundTrip(changes));
    b.applyChanges(roundTrip(changes));
    expect((await a.list()).map((e) => e.id)).toEqual(["next"]);
    await a.outbox.list();
    await a.reportDamaged("held");
    b.applyChanges(roundTrip(a.takeChanges()!));
    expect(await b.damaged()).toEqual(await a.damaged());
    expect(await b.outbox.damaged!()).toEqual(await a.outbox.damaged!());
    expect(b.takeChanges(), "b set nothing aside itself").toBe(null);
    expect(JSON.stringify(b.exportState())).toBe(JSON.stringify(a.exportState()));
  });

  test("setAside: a reader sets a valid event aside as it is; none is damaged otherwise", async () => {
    const journal = new MemoryEventJournal({ clock: () => 1_000 });
    expect(await journal.damaged()).toEqual([]);
    expect(await journal.outbox.damaged!()).toEqual([]);
    expect(await journal.reportDamaged("x")).toBe(false);
    await journal.append({ id: "odd", channel: BOT_CHANNEL, orderKey: "c", eventType: "not.inbound", payload: null, createdAt: 1 }, lease);
    await journal.append({ id: "m", channel: BOT_CHANNEL, orderKey: "c", eventType: INBOUND_MESSAGE_EVENT, payload: null, createdAt: 2 });
    const before = (await journal.list({ channel: BOT_CHANNEL }))[0];
    expect(await journal.setAside("odd", "not an inbound record")).toBe(true);
    expect(await journal.setAside("odd", "again")).toBe(false);
    expect(await journal.setAside("missing", "x")).toBe(false);
    expect((await journal.claimDue({ owner: "w", incarnation: "j", leaseMs: 1_000, channel: BOT_CHANNEL, limit: 10 })).map((e) => e.id))
      .toEqual(["m"]);
    expect(await journal.damaged()).toEqual([{ id: "odd", channel: BOT_CHANNEL, problem: "not an inbound record", setAsideAt: 1_000, reported: false }]);
    expect(await journal.damaged({ channel: null })).toEqual([]);
    expect(await journal.reportDamaged("odd", { channel: null }), "not in that channel").toBe(false);
    expect(journal.exportState().events[0], "kept as it is").toEqual(before);
    await expect(journal.get("odd")).rejects.toThrow("not an inbound record");
  });
});

describe("EventsDurability", () => {
  test("inbox records are events of the bot's channel; the app's events stay out of the inbox", async () => {
    const journal = new MemoryEventJournal();
    const backend = new EventsDurability({ journal });
    expect(backend.name).toBe("events(memory-events)");
    expect(backend.scope).toBe("process");
    await backend.outbox.reserve({ key: "k", chatId: "c", content: null, contentHash: "h", inboundId: null });
    expect((await journal.outbox.get("k"))?.key, "the outbox is the journal's sidecar").toBe("k");
    await journal.append({ id: "app1", eventType: "order.paid", payload: { order: 1 } });
    await journal.append({ id: "app2", channel: BOT_CHANNEL, eventType: "not.inbound", payload: null });
    const r = await backend.inbox.admit({
      id: "m1",
      kind: "interaction",
      chatId: "c1",
      provider: "test",
      payload: { text: "hi" },
      receivedAt: 123,
    });
    expect(r?.kind).toBe("interaction");
    const event = (await journal.get("m1"))!;
    expect(event.channel).toBe(BOT_CHANNEL);
    expect(event.eventType).toBe(INBOUND_INTERACTION_EVENT);
    expect(event.createdAt).toBe(123);
    expect(event.payload).toEqual({ chatId: "c1", provider: "test", message: { text: "hi" } });
    expect((await backend.inbox.list()).map((x) => x.id)).toEqual(["m1"]);
    expect(await backend.inbox.get("app1")).toBe(null);
    // An inbound id taken by an app event is refused loudly, not swallowed as a duplicate.
    await expect(backend.inbox.admit({ id: "app1", kind: "message", chatId: "c", provider: "p", payload: null, receivedAt: 1 }))
      .rejects.toThrow(/already holds an app event with that id/);
    expect((await journal.get("app1"))?.eventType, "the app's event is untouched").toBe("order.paid");
    // A redelivery of the bot's own message is still a duplicate.
    expect(await backend.inbox.admit({ id: "m1", kind: "interaction", chatId: "c1", provider: "test", payload: null, receivedAt: 1 }))
      .toBe(null);
    expect(await backend.inbox.replay("app1")).toBe(false);
    // A foreign event in the bot's channel is set aside by the first inbox call that meets it (here the list
    // above), not handed to the bot: a damaged inbox record, reported by the bot.
    const claimed = await backend.inbox.claimDue({ owner: "bot", incarnation: "i", leaseMs: 1_000, limit: 10 });
    expect(claimed.map((x) => x.id)).toEqual(["m1"]);
    await expect(journal.get("app2")).rejects.toThrow(DamagedEventError);
    const [aside] = await backend.inbox.damaged!();
    expect([aside.journal, aside.id, aside.backend, aside.reported]).toEqual(["inbox", "app2", backend.name, false]);
    expect(aside.problem).toContain('field "eventType" is "not.inbound"');
    expect((await journal.get("app1"))?.state).toBe("pending");
    // A replay through the journal is picked up by the bot's next sweep.
    await backend.inbox.complete("m1", claimed[0].lease!.token);
    expect(await journal.replay("m1")).toBe(true);
    const again = await backend.inbox.claimDue({ owner: "bot", incarnation: "i", leaseMs: 1_000, limit: 10 });
    expect(again.map((x) => x.id)).toEqual(["m1"]);
    expect(again[0].lease?.token).toBe(2);
  });

  test("an event of the bot's channel that is not an inbound message is a damaged inbox record: set aside, reported once", async () => {
    const source = new MemoryEventJournal();
    await source.append({ id: "app-x", eventType: "order.paid", payload: null });
    const state = roundTrip(source.exportState());
    (state.events[0] as unknown as Record<string, unknown>).state = "weird"; // an app's event, damaged
    const journal = MemoryEventJournal.fromState(state);
    const backend = new EventsDurability({ journal });
    const message = { kind: "message" as const, chatId: "c1", provider: "test", payload: null, receivedAt: 1 };
    await journal.append({ id: "m2", channel: BOT_CHANNEL, orderKey: "c1", eventType: INBOUND_MESSAGE_EVENT, payload: "{not json", createdAt: 1 });
    await backend.inbox.admit({ ...message, id: "m3", receivedAt: 2 });
    const error = await backend.inbox.get("m2").then(() => null, (e: unknown) => e as DamagedRecordError);
    expect(error).toBeInstanceOf(DamagedRecordError);
    expect([error!.journal, error!.id, error!.backend]).toEqual(["inbox", "m2", "events(memory-events)"]);
    expect(error!.problem).toContain('field "payload"');
    expect(await backend.inbox.admit({ ...message, id: "m2" }), "a redelivery is a duplicate of it").toBe(null);
    await expect(backend.inbox.admit({ ...message, id: "app-x" }), "an app's damaged event keeps its id").rejects.toThrow(/app event/);
    expect(await backend.inbox.get("app-x"), "an app's event is not the inbox's").toBe(null);
    expect((await backend.inbox.list()).map((r) => r.id)).toEqual(["m3"]);
    expect((await backend.inbox.claimDue({ owner: "bot", incarnation: "i", leaseMs: 1_000, limit: 10 })).map((r) => r.id))
      .toEqual(["m3"]);
    expect((await backend.inbox.damaged!()).map((d) => [d.journal, d.id, d.backend, d.reported])).toEqual([
      ["inbox", "m2", "events(memory-events)", false],
    ]);
    expect((await journal.damaged()).map((d) => d.id).sort(), "the journal lists the app's too").toEqual(["app-x", "m2"]);
    expect(await backend.inbox.reportDamaged!("app-x"), "not an inbox record").toBe(false);
    expect(await Promise.all([backend.inbox.reportDamaged!("m2"), backend.inbox.reportDamaged!("m2")])).toEqual([true, false]);
    expect(await backend.inbox.replay("m2")).toBe(false);
    expect(await backend.outbox.damaged!()).toEqual([]);
  });

  test("close() leaves the journal open; a closed journal makes operations reject", async () => {
    const journal = new MemoryEventJournal();
    const backend = new EventsDurability({ journal });
    await backend.open?.();
    await backend.close?.();
    expect(journal.closed).toBe(false);
    await journal.close();
    await expect(backend.inbox.list()).rejects.toThrow(/closed/);
    await expect(backend.outbox.list()).rejects.toThrow(/closed/);
  });

  test("a kv outbox replaces the sidecar", async () => {
    const journal = new MemoryEventJournal();
    const kv = new MemoryKv();
    const backend = new EventsDurability({ journal, outbox: kv });
    await backend.outbox.reserve({ key: "k", chatId: "c", content: null, contentHash: "h", inboundId: null });
    expect(await journal.outbox.list()).toEqual([]);
    expect((await kv.list("")).length).toBeGreaterThan(0);
  });

  test("option checks", () => {
    expect(() => new EventsDurability(undefined as unknown as EventsDurabilityOptions)).toThrow(TypeError);
    expect(() => new EventsDurability({ journal: {} as LeasedEventJournal })).toThrow(/journal/);
    expect(() => new EventsDurability({ journal: new MemoryEventJournal(), outbox: 5 as unknown as MemoryKv })).toThrow(/outbox/);
    // A journal written before timers had a state of their own lacks schedule: refused, naming it.
    const journal = new MemoryEventJournal();
    const older = new Proxy(journal, { get: (target, key) => (key === "schedule" ? undefined : Reflect.get(target, key, target)) });
    expect(() => new EventsDurability({ journal: older })).toThrow(/has no method "schedule" of a LeasedEventJournal/);
  });
});
