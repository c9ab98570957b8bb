/**
 * The WhatsApp Cloud API provider (`@botmesh/durable/whatsapp`).
 *
 * Inbound: a Web-standard webhook handler ({@link WhatsAppProvider.webhook})
 * that answers Meta's verification GET (`hub.challenge`), checks the
 * `X-Hub-Signature-256` of every POST, admits each message of the payload to
 * the bot (ids are the `wamid`s, so Meta's redeliveries are recognised) and
 * answers 200 only once every message is admitted; when one is refused (the
 * journal failed: fail closed) it answers 503 and Meta redelivers the whole
 * POST, whose already admitted messages come back as duplicates and are
 * dropped by the bot. Status callbacks (sent, delivered, read, failed) are not
 * messages: they go to the `onStatus` option. A status that confirms a send
 * calls `sink.confirmSent`; when that fails (the journal again), the POST is
 * answered 503 too, so that the status comes back with its redelivery.
 *
 * Outbound: `POST /{version}/{phone-number-id}/messages` on the Graph API,
 * with errors classified from the HTTP status and the Graph error code
 * (throttling and transient errors are retried, honouring `Retry-After`;
 * permanent ones go straight to the dead-letter queue).
 *
 * Media: the media id of an inbound image, audio, video, document or sticker
 * is sealed into the inbox record, and `loadMediaOf(ctx)` downloads it again
 * through the Graph API (Cloud API media ids live about 30 days).
 *
 * Web-standard only (`fetch`, `Request`/`Response`, Web Crypto), so the
 * webhook mounts in `Bun.serve`, `Deno.serve`, or Node's `http` through the
 * core's adapter: `createServer(nodeHandler(provider.webhook))`.
 *
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { WhatsAppProvider } from "@botmesh/durable/whatsapp";
 *
 * const provider = new WhatsAppProvider({
 *   accessToken: "EAAG…",
 *   phoneNumberId: "106540352242922",
 *   appSecret: "the app secret of the Meta app",
 *   verifyToken: "the token typed into the webhook settings",
 * });
 * const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "wa-1" } });
 * bot.when(/hello/i, (ctx) => ctx.reply("Hi!"));
 * await bot.start();
 * Deno.serve({ port: 8080 }, provider.webhook);
 * ```
 *
 * @module
 */
export { classifyGraphError, parseRetryAfter, WhatsAppApiError } from "./api.ts";
export { parseWhatsAppChatId, whatsAppChatId, type WhatsAppRecipient } from "./chat_ids.ts";
export { DEFAULT_GRAPH_BASE, DEFAULT_GRAPH_VERSION, type WhatsAppProviderOptions } from "./options.ts";
export { WHATSAPP_MAX_MESSAGE_DEPTH } from "./changes.ts";
export { WhatsAppChangeError, WhatsAppPayloadError } from "./payloads.ts";
export { WHATSAPP_RATE_LIMITS, WhatsAppProvider } from "./provider.ts";
export type { WhatsAppStatus } from "./statuses.ts";
