import { describe, expect, test } from "bun:test";
import type { DurabilityBackend } from "../src/backend.ts";
import { kvDurability } from "../backends/kv.ts";
import { MemoryKv } from "../backends/memory_kv.ts";
import { runDurabilityConformance } from "../testing.ts";

/** The store under each backend, so that a "restarted process" gets a new backend over the same keys. */
const storeOf = new WeakMap<DurabilityBackend, MemoryKv>();

function over(kv: MemoryKv): DurabilityBackend {
  const backend = kvDurability(kv);
  storeOf.set(backend, kv);
  return backend;
}

runDurabilityConformance({
  name: "kv (MemoryKv)",
  create: ({ now }) => over(new MemoryKv({ clock: now })),
  reopen: (old) => over(storeOf.get(old)!),
  harness: { describe, test, expect },
  simulatedTime: true,
});
