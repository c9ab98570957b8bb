/**
 * `@botmesh/durable/events`: an events journal that keeps the bot's inbox
 * among an app's own events. `FileEventJournal` (one process, pid lock),
 * `SharedFileEventJournal` (processes of one host, inter-process mutex,
 * optional append log), `MemoryEventJournal` (tests), `EventWorker` for the
 * app's events, and `new EventsDurability({ journal, outbox? })` for the bot.
 * A record of a journal file that is not valid is set aside, kept as it was
 * (`DamagedEvent`; `journal.damaged()`), and reported once by the bot.
 *
 * @example
 * ```ts ignore
 * import { Bot } from "@botmesh/durable";
 * import { EventsDurability, FileEventJournal } from "@botmesh/durable/events";
 *
 * const journal = await FileEventJournal.open("./data/events.json", { lock: true });
 * const bot = new Bot({ provider, durability: { backend: new EventsDurability({ journal }), instanceId: "bot-1" } });
 * await bot.start();
 * // ...
 * await bot.stop();
 * await journal.close();
 * ```
 *
 * @module
 */
export {
  BOT_CHANNEL,
  type DamagedEvent,
  DamagedEventError,
  type DamagedEventListOptions,
  type EventClaimOptions,
  type EventListOptions,
  type EventRecord,
  type EventState,
  INBOUND_INTERACTION_EVENT,
  INBOUND_MESSAGE_EVENT,
  type LeasedEventJournal,
  type NewEventRecord,
} from "../../src/events/types.ts";
export {
  type DamageMark,
  type EventJournalChanges,
  type EventJournalState,
  MemoryEventJournal,
  type MemoryEventJournalOptions,
} from "./memory_journal.ts";
export {
  EventsDurability,
  type EventsDurabilityOptions,
  eventToInbound,
  type InboundEventPayload,
  inboundToEvent,
} from "./durability.ts";
export {
  type EventContext,
  type EventHandler,
  EventWorker,
  type EventWorkerEvents,
  type EventWorkerOptions,
} from "../../src/events/worker.ts";
export {
  FileCorruptError,
  FileEventJournal,
  type FileEventJournalOptions,
  type FileEventJournalStats,
  FileLockedError,
} from "./file_journal.ts";
export { type AppendLogOptions, SharedFileEventJournal, type SharedFileEventJournalOptions } from "./shared_journal.ts";
