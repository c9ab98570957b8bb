import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory/durability.ts";
import type { DurabilityBackend, NewOutboxEntry } from "../src/contract.ts";
import { crashable, SimulatedCrash } from "../testing.ts";

const lease = { owner: "o", incarnation: "i", leaseMs: 60_000 };
const entry = (key: string): NewOutboxEntry => ({ key, chatId: "c", content: "x", contentHash: "h", inboundId: null });

/** A memory backend whose outbox writes take `ms` (a real disk or network round trip). */
function slow(ms: number): DurabilityBackend {
  const inner = new MemoryDurability();
  const o = inner.outbox;
  const outbox: typeof o = {
    reserve: (...a) => o.reserve(...a),
    claimDue: (...a) => o.claimDue(...a),
    heartbeat: (...a) => o.heartbeat(...a),
    markCalling: (...a) => o.markCalling(...a),
    markSent: (...a) => o.markSent(...a),
    markFailed: async (...a) => {
      await new Promise((r) => setTimeout(r, ms));
      return o.markFailed(...a);
    },
    get: (...a) => o.get(...a),
    list: (...a) => o.list(...a),
    retry: (...a) => o.retry(...a),
    discard: (...a) => o.discard(...a),
    purge: (...a) => o.purge(...a),
    damaged: (...a) => o.damaged(...a),
    reportDamaged: (...a) => o.reportDamaged(...a),
  };
  return { name: "slow", scope: "process", inbox: inner.inbox, outbox };
}

describe("crashable", () => {
  test("a write in flight at the crash takes effect, is never seen, and is listed in landedAfterCrash", async () => {
    const backend = slow(30);
    const a = crashable(backend);
    a.crashBefore("inbox.complete");
    const { entry: e } = await a.outbox.reserve(entry("k1"), lease);
    const inFlight = a.outbox.markFailed("k1", e.lease!.token, { error: "403", dead: true });
    const admitted = await a.inbox.admit({ id: "m1", kind: "message", chatId: "c", provider: "p", payload: null, receivedAt: 1 }, lease);
    await a.inbox.complete("m1", admitted!.lease!.token).catch(() => {}); // dies here
    expect(a.crashed).toBe(true);
    let error: unknown;
    await inFlight.catch((x) => error = x);
    expect(error instanceof SimulatedCrash).toBe(true);
    expect((await backend.outbox.get("k1"))?.state).toBe("dead");
    expect(a.landedAfterCrash).toEqual([{ point: "outbox.markFailed", id: "k1" }]);
    expect((await backend.inbox.get("m1"))?.state, "the crash point itself never took effect").toBe("processing");
  });

  test("nothing lands after a crash when every write finished before it", async () => {
    const a = crashable(new MemoryDurability());
    a.crashAfter("outbox.reserve");
    await a.outbox.reserve(entry("k2"), lease).catch(() => {});
    expect(a.crashed).toBe(true);
    expect(a.landedAfterCrash).toEqual([]);
  });
});

describe("simulateCrash of @botmesh/durable/testing", () => {
  test("lets a FileDurability or a FileEventJournal go as a killed process would; refuses anything else", async () => {
    const { mkdtempSync, rmSync, existsSync } = await import("node:fs");
    const { join } = await import("node:path");
    const { tmpdir } = await import("node:os");
    const { simulateCrash } = await import("../testing.ts");
    const { FileDurability } = await import("../backends/file/mod.ts");
    const { FileEventJournal } = await import("../backends/events/mod.ts");
    const dir = mkdtempSync(join(tmpdir(), "botmesh-simcrash-"));
    try {
      const backend = new FileDurability({ path: join(dir, "bot.json") });
      await backend.open();
      await backend.outbox.reserve(entry("k1"), lease);
      await simulateCrash(backend);
      expect(existsSync(join(dir, "bot.json.lock"))).toBe(true); // the lock file stays, as after kill -9
      await expect(backend.outbox.get("k1")).rejects.toThrow(/simulateCrash/);
      const reopened = new FileDurability({ path: join(dir, "bot.json") });
      await reopened.open();
      expect((await reopened.outbox.get("k1"))?.state).toBe("sending");
      await reopened.close();

      const journal = await FileEventJournal.open(join(dir, "events.json"), { lock: true });
      await simulateCrash(journal);
      await expect(journal.list()).rejects.toThrow(/simulateCrash/);

      await expect(simulateCrash(new MemoryDurability() as never)).rejects.toThrow(TypeError);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
