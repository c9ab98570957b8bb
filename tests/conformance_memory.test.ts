import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory/durability.ts";
import { runDurabilityConformance } from "../testing.ts";

runDurabilityConformance({
  name: "memory",
  create: ({ now }) => new MemoryDurability({ clock: now }),
  harness: { describe, test, expect },
  simulatedTime: true,
});
