/**
 * The whole conformance suite in one call.
 *
 * @module
 */
import { type BackendConformanceOptions, runBackendContract } from "./conformance.ts";
import { runBotConformance, runCrashMatrix } from "./conformance_bot.ts";
import { runStepConformance } from "./conformance_steps.ts";

/**
 * Registers the whole conformance suite for a backend: the journal contract,
 * the durability rules driven through a `Bot`, the crash matrix, and durable
 * steps (`ctx.step()`, with a crash matrix of their own). Every
 * backend of this library runs it; third-party backends can too.
 *
 * @param options name, `create`, the test runner's `describe`/`test`/`expect`, and optionally `reopen`, `cleanup`, `skip`,
 *   `timeScale`, `simulatedTime` (each test on a `TestClock`, given to `create` as `context.now`)
 * @example
 * ```ts
 * import { describe, expect, test } from "bun:test";
 * import { MemoryDurability } from "@botmesh/durable";
 * import { runDurabilityConformance } from "@botmesh/durable/testing";
 *
 * runDurabilityConformance({
 *   name: "memory",
 *   create: () => new MemoryDurability(),
 *   harness: { describe, test, expect },
 * });
 * ```
 */
export function runDurabilityConformance(options: BackendConformanceOptions): void {
  runBackendContract(options);
  runBotConformance(options);
  runCrashMatrix(options);
  runStepConformance(options);
}
