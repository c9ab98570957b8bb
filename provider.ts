/**
 * `@botmesh/durable/provider`: what a channel author needs to connect a new
 * messaging platform. The `Provider` contract (admit inbound messages through
 * an `InboundSink`, send with an idempotency key, confirm sends in question),
 * how provider errors are classified into retryable or not, and the sealed
 * media references that let a handler load an attachment after a restart.
 *
 * @example
 * ```ts
 * import { classifyProviderError, ProviderError } from "@botmesh/durable/provider";
 *
 * const verdict = classifyProviderError(new ProviderError("rate limited", { status: 429, retryAfterMs: 1000 }));
 * console.log(verdict.retryable); // true
 * ```
 *
 * @module
 */
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
export type { Rate, RateLimits } from "./src/rate_limit.ts";
export { CUT_NESTING_MARK, cutDeepNesting, MAX_CONTENT_DEPTH, UnencodableContentError } from "./src/content.ts";
export {
  checkEnvelope,
  type LoadedMedia,
  type MediaLoadContext,
  MEDIA_REF_VERSION,
  MediaSeal,
  type MediaSealOptions,
  MediaUnavailableError,
  type MediaUnavailableReason,
  type StoredMediaRef,
} from "./src/media.ts";
