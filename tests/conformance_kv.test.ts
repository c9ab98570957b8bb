import { describe, expect, test } from "bun:test";
import type { DurabilityBackend } from "../src/contract.ts";
import { KvDurability } from "../backends/kv/durability.ts";
import { MemoryKv } from "../backends/memory/kv.ts";
import { runDurabilityConformance } from "../testing.ts";

/** The store under each backend, so that a "restarted process" gets a new backend over the same keys. */
const storeOf = new WeakMap<DurabilityBackend, MemoryKv>();

function over(kv: MemoryKv): DurabilityBackend {
  const backend = new KvDurability(kv);
  storeOf.set(backend, kv);
  return backend;
}

runDurabilityConformance({
  name: "kv (MemoryKv)",
  create: ({ now }) => over(new MemoryKv({ clock: now })),
  reopen: (old) => over(storeOf.get(old)!),
  // Values overwritten in place: an inbox record given a payload nested deeper than the journal writes
  // (MAX_STORED_DEPTH; its index keys kept), an outbox entry's value replaced by text that is not a record at all.
  damage: async (backend, journal, id) => {
    const kv = storeOf.get(backend)!;
    const key = `r/${journal === "inbox" ? "in" : "out"}/${id.replace(/[%/]/g, (c) => (c === "%" ? "%25" : "%2F"))}`;
    const stored = (await kv.get(key))!.value as { rec: Record<string, unknown>; hints: string[] };
    await kv.set(key, journal === "inbox" ? { ...stored, rec: { ...stored.rec, payload: JSON.parse("[".repeat(1_000) + "]".repeat(1_000)) } } : "{not json");
    return backend;
  },
  harness: { describe, test, expect },
  simulatedTime: true,
});
