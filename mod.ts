/**
 * `@botmesh/durable`: a chatbot core whose message processing survives
 * crashes, restarts and replica failover. Inbound messages are journaled
 * before any handler runs; every send is journaled under an idempotency key
 * before the provider is called, retried with backoff, and dead-lettered when
 * retries run out.
 *
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 *
 * const provider = new MockProvider();
 * const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * bot.when(/hello/i, (ctx) => ctx.reply("Hi!"));
 * await bot.start();
 * await provider.receive({ chatId: "chat-1", text: "hello" });
 * await bot.idle();
 * await bot.stop();
 * ```
 *
 * @module
 */
export { Bot, type BotOptions, type Context, type Handler } from "./src/bot.ts";
export { type Clock, type ClockTimer, systemClock } from "./src/clock.ts";
export { type AskOptions, AskTimeoutError, type FlowContext, type StepInput, type StoredConversation } from "./src/conversation.ts";
export type {
  BotEvents,
  DurabilityControl,
  DurabilityMetrics,
  DurabilityWarning,
  SendOptions,
  SendResult,
  WarningCode,
} from "./src/engine.ts";
export {
  type BackoffOptions,
  type DurabilityOptions,
  type InboxOptions,
  type OutboxOptions,
  parseDuration,
} from "./src/config.ts";
export {
  ANY,
  AUDIO,
  DOCUMENT,
  IMAGE,
  INTERACTION,
  type Matcher,
  TEXT,
  type TypeMatcher,
  VIDEO,
} from "./src/matchers.ts";
export {
  type AdmitResult,
  classifyProviderError,
  type ErrorClassification,
  type InboundMessage,
  type InboundSink,
  type Interaction,
  type MessageType,
  type OutboundContent,
  type Provider,
  type SendConfirmation,
  type SendContext,
  type SendInQuestion,
  type SendReceipt,
} from "./src/provider.ts";
export { isRetryableStatus, ProviderError, type ProviderErrorOptions } from "./src/errors.ts";
export { UnencodableContentError } from "./src/content.ts";
export {
  checkEnvelope,
  type LoadedMedia,
  type LoadMediaOptions,
  loadMediaOf,
  type MediaContext,
  type MediaLoadContext,
  MEDIA_REF_VERSION,
  MediaSeal,
  type MediaSealOptions,
  MediaUnavailableError,
  type MediaUnavailableReason,
  type StoredMediaRef,
} from "./src/media.ts";
export { MemoryStore, type SessionStore } from "./src/store.ts";
export {
  type BackendScope,
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  DamagedRecordError,
  type DamagedRecords,
  type DurabilityBackend,
  type DurableKv,
  type FailOutcome,
  type InboundKind,
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type JsonValue,
  type KvEntry,
  type Lease,
  type ListOptions,
  type NewInboundRecord,
  type NewOutboxEntry,
  type OutboxClaim,
  type OutboxEntry,
  type OutboxJournal,
  type OutboxState,
  type ReserveResult,
  StaleLeaseError,
} from "./src/backend.ts";
export { MemoryDurability, type MemoryDurabilityOptions } from "./backends/memory.ts";
export { kvDurability, type KvDurabilityOptions } from "./backends/kv.ts";
export { MemoryKv } from "./backends/memory_kv.ts";
export {
  basicAuth,
  type BasicAuthOptions,
  type ConsoleAuth,
  type ConsoleBot,
  type ConsoleHandler,
  type ConsoleIdentity,
  type ConsoleTarget,
  durabilityConsole,
  type DurabilityConsoleOptions,
  nodeHandler,
  type NodeHandlerOptions,
  type NodeRequestLike,
  type NodeResponseLike,
} from "./src/ops/console.ts";
export {
  countRecords,
  escapeLabelValue,
  PROMETHEUS_CONTENT_TYPE,
  prometheusMetrics,
  type PrometheusOptions,
  type PrometheusSource,
  type RecordCounts,
} from "./src/ops/prometheus.ts";
