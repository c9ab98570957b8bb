/**
 * `@botmesh/durable`: a chatbot core whose message processing survives
 * crashes, restarts and replica failover. Inbound messages are journaled
 * before any handler runs; every send is journaled under an idempotency key
 * before the provider is called, retried with backoff, and dead-lettered when
 * retries run out.
 *
 * This entry holds what a bot author uses. Backends and providers have their
 * own entries (`@botmesh/durable/sqlite`, `/postgres`, `/redis`, `/file`,
 * `/events`, `/kv`, `/memory`, `/telegram`, `/whatsapp`); operations tools are
 * in `/ops`, the test harness in `/testing`, and what a backend or channel
 * author needs in `/backend` and `/provider`.
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
export { type AskOptions, AskTimeoutError, type FlowContext, type HandlerStep, type StepInput, type StoredConversation } from "./src/conversation.ts";
export { type StepCall, StepAmbiguousError, StepFailedError, type StepOptions } from "./src/engine/steps.ts";
export type {
  BotEvents,
  DurabilityControl,
  DurabilityMetrics,
  DurabilityWarning,
  SendOptions,
  SendResult,
  SweepSummary,
  WarningCode,
} from "./src/engine.ts";
export {
  type BackoffOptions,
  type DurabilityOptions,
  type InboxOptions,
  type OutboxOptions,
  parseDuration,
} from "./src/config.ts";
export type { DurabilityHistograms, HistogramSnapshot } from "./src/histogram.ts";
export type { SpanContextLike, SpanLike, TracerLike } from "./src/tracing.ts";
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
export type {
  InboundMessage,
  Interaction,
  MessageType,
  OutboundContent,
  Provider,
  SendInQuestion,
} from "./src/provider.ts";
export { ProviderError, type ProviderErrorOptions } from "./src/errors.ts";
export { MemoryRateLimiter, type MemoryRateLimiterOptions, type Rate, type RateLimitOptions, type RateLimits } from "./src/rate_limit.ts";
export type { RateLimiter } from "./src/contract.ts";
export { UnencodableContentError } from "./src/content.ts";
export {
  type LoadedMedia,
  type LoadMediaOptions,
  loadMediaOf,
  type MediaContext,
  MediaUnavailableError,
  type MediaUnavailableReason,
  type StoredMediaRef,
} from "./src/media.ts";
export { MemoryStore, type SessionStore } from "./src/store.ts";
// What `bot.durability` lists and returns (records, states, filters), for the bot author's own tools.
export type {
  DamagedListOptions,
  DamagedRecord,
  DurabilityBackend,
  InboundRecord,
  InboundState,
  JsonValue,
  ListOptions,
  OutboxEntry,
  OutboxState,
} from "./src/contract.ts";
export { MemoryDurability, type MemoryDurabilityOptions } from "./backends/memory/mod.ts";
