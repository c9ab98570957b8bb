/**
 * `@botmesh/durable/testing`: a mock provider, the crash harness and the
 * backend conformance suite.
 *
 * @module
 */
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
export { MemoryDurability } from "./backends/memory.ts";
export { TestClock, type TestClockOptions, trackBackend } from "./src/testing/test_clock.ts";
export * from "./src/testing/conformance.ts";
export { runBotConformance, runCrashMatrix } from "./src/testing/conformance_bot.ts";
export { runDurabilityConformance } from "./src/testing/run_conformance.ts";
export { type EventJournalContractOptions, runEventJournalContract } from "./src/testing/event_journal_contract.ts";
