import { describe, expect, test } from "bun:test";
import { kvDurability } from "../backends/kv.ts";
import { MemoryKv } from "../backends/memory_kv.ts";
import { runDurabilityConformance } from "../testing.ts";

runDurabilityConformance({
  name: "kv (MemoryKv)",
  create: () => kvDurability(new MemoryKv()),
  harness: { describe, test, expect },
});
