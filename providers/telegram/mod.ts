/**
 * `@botmesh/durable/telegram`: a {@link Provider} for the Telegram Bot API,
 * by webhook or by long polling. Web-standard only (`fetch`, `Request`,
 * `Response`, `AbortSignal`, Web Crypto), so it runs on Bun, Deno and Node.
 *
 * Durability rules it follows (see docs/providers.md):
 * - **Webhook**: an update is answered `200` only once the bot has admitted
 *   it (journaled, a duplicate, or dispatched under `failOpen`); when the
 *   journal refuses it the answer is `503`, so Telegram delivers it again.
 * - **Long polling**: the `offset` that confirms updates to Telegram only
 *   moves past updates the bot has admitted. When one is refused, the next
 *   `getUpdates` starts at it (after a backoff); the updates after it come
 *   again and are dropped as duplicates.
 * - **Unreadable updates**: a message, channel post, business message or
 *   callback query that cannot be parsed is still handed to the bot, with
 *   `unreadable` (the reason, naming the field) and the update in
 *   `extra.raw`: the bot journals it and dead-letters it at once, and it is
 *   acknowledged only once admitted, like any message. Only an update that
 *   is certainly not a user's message is acknowledged without a record.
 * - Inbound ids are `tg:<bot id>:<update_id>:<chat id>:<message_id>` for
 *   messages and `tg:<bot id>:<update_id>:cb:<callback query id>` for button
 *   presses: stable across redeliveries (Telegram redelivers an update with
 *   its `update_id`), and not reused when Telegram restarts `update_id` at a
 *   random value after a week without updates.
 *
 * @example A webhook bot on Bun
 * ```ts ignore
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { TelegramProvider } from "@botmesh/durable/telegram";
 *
 * const telegram = new TelegramProvider({ token: process.env.TELEGRAM_TOKEN!, secretToken: process.env.TELEGRAM_SECRET! });
 * const bot = new Bot({ provider: telegram, durability: { backend: new MemoryDurability(), instanceId: "tg-1" } });
 * bot.when(/hi/i, (ctx) => ctx.reply("Hello!"));
 * await bot.start();
 * Bun.serve({ port: 8080, fetch: telegram.webhook });
 * ```
 *
 * @module
 */
export { TELEGRAM_MAX_DOWNLOAD_BYTES, type TelegramMediaRef } from "./media.ts";
export type { TelegramProviderOptions } from "./options.ts";
export { TELEGRAM_RATE_LIMITS, TelegramProvider } from "./provider.ts";
export {
  type ParsedUpdate,
  type SkippedUpdate,
  TELEGRAM_HANDLED_UPDATES,
  TELEGRAM_MAX_UPDATE_DEPTH,
  TelegramUpdateError,
} from "./updates.ts";
