import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory.ts";
import { runBackendContract } from "../src/testing/conformance.ts";

runBackendContract({
  name: "memory",
  create: () => new MemoryDurability(),
  harness: { describe, test, expect },
});
