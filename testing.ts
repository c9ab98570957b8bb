/**
 * `@botmesh/durable/testing`: test your bot and your backend. A mock
 * provider, the crash harness (crash points in the journal steps), a test
 * clock, the backend and bot conformance suites, and the test hooks of the
 * file backends.
 *
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { crashable, CrashableProvider } from "@botmesh/durable/testing";
 *
 * const shared = new MemoryDurability();
 * const backend = crashable(shared);
 * backend.crashAfter("provider.send"); // the process dies after the provider call, before recording it
 * const bot = new Bot({ provider: new CrashableProvider(backend), durability: { backend, instanceId: "bot-1" } });
 * ```
 *
 * @module
 */
import { FileDurability, simulateCrash as simulateFileCrash } from "./backends/file/durability.ts";
import { FileEventJournal, simulateCrash as simulateJournalCrash } from "./backends/events/file_journal.ts";
import { showValue } from "./src/show.ts";

export { MockProvider, type MockInbound, type MockProviderOptions, type SentMessage } from "./src/testing/mock_provider.ts";
export {
  CRASH_POINTS,
  crashable,
  crashableStore,
  type CrashableBackend,
  CrashableProvider,
  type CrashOptions,
  type CrashPoint,
  SimulatedCrash,
} from "./src/testing/crashable.ts";
export { TestClock, type TestClockOptions, trackBackend } from "./src/testing/test_clock.ts";
export {
  type BackendConformanceOptions,
  type ConformanceContext,
  type ConformanceHarness,
  type ConformanceMatchers,
  runBackendContract,
} from "./src/testing/conformance.ts";
export { runBotConformance, runCrashMatrix } from "./src/testing/conformance_bot.ts";
export { runDurabilityConformance } from "./src/testing/run_conformance.ts";
export { type RateLimiterConformanceOptions, runRateLimiterConformance } from "./src/testing/rate_limiter_contract.ts";
export { type EventJournalContractOptions, runEventJournalContract } from "./src/testing/event_journal_contract.ts";
export { fileDurabilityTestHooks, type FileDurabilityTestHooks } from "./backends/file/durability.ts";
export { sharedJournalTestHooks, type SharedJournalTestHooks } from "./backends/events/shared_journal.ts";

/**
 * Lets a `FileDurability` or a `FileEventJournal` go as a killed process
 * would: its lock file stays, its operations reject, and opening the file
 * again recovers what was journaled.
 *
 * @param target the open backend or journal
 * @returns when it is let go
 * @throws {TypeError} (as a rejection) when `target` is neither
 *
 * @example
 * ```ts ignore
 * import { FileDurability } from "@botmesh/durable/file";
 * import { simulateCrash } from "@botmesh/durable/testing";
 *
 * const backend = new FileDurability({ path: "./data/bot.json" });
 * await backend.open();
 * await simulateCrash(backend);
 * ```
 */
export function simulateCrash(target: FileDurability | FileEventJournal): Promise<void> {
  if (target instanceof FileDurability) return simulateFileCrash(target);
  if (target instanceof FileEventJournal) return simulateJournalCrash(target);
  return Promise.reject(new TypeError(`simulateCrash needs a FileDurability or a FileEventJournal, got ${showValue(target)}`));
}
