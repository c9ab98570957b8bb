import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory.ts";
import { runDurabilityConformance } from "../testing.ts";

runDurabilityConformance({
  name: "memory",
  create: () => new MemoryDurability(),
  harness: { describe, test, expect },
});
