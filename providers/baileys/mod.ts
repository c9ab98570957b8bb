/**
 * A provider over the user's Baileys socket (`@botmesh/durable/baileys`):
 * the WhatsApp Web multi-device protocol through `makeWASocket`, with the
 * bot's inbox and outbox behind it. See docs/baileys.md.
 *
 * Nothing here imports Baileys: the socket is typed structurally
 * ({@link BaileysSocketLike}), so a `WASocket` of `baileys` or
 * `@whiskeysockets/baileys` fits, and the package stays an optional peer.
 *
 * @example
 * ```ts ignore
 * import makeWASocket, { downloadMediaMessage, useMultiFileAuthState } from "baileys";
 * import { Bot } from "@botmesh/durable";
 * import { SQLiteDurability } from "@botmesh/durable/sqlite";
 * import { BaileysProvider } from "@botmesh/durable/baileys";
 *
 * const { state, saveCreds } = await useMultiFileAuthState("auth");
 * const provider = new BaileysProvider({
 *   mediaKey: process.env.MEDIA_KEY!,
 *   downloadMedia: (m) => downloadMediaMessage(m as never, "buffer", {}),
 * });
 * const bot = new Bot({ provider, durability: { backend: new SQLiteDurability({ file: "bot.db" }), instanceId: "wa-1" } });
 * bot.when(/.+/, (ctx) => ctx.reply(`You said: ${ctx.message.text}`));
 * await bot.start();
 *
 * function connect() {
 *   const sock = makeWASocket({ auth: state });
 *   provider.attach(sock); // at once: before Baileys emits anything
 *   sock.ev.on("creds.update", saveCreds);
 *   sock.ev.on("connection.update", ({ connection, lastDisconnect }) => {
 *     if (connection === "close" && (lastDisconnect?.error as any)?.output?.statusCode !== 401) connect();
 *   });
 * }
 * connect();
 * ```
 *
 * @module
 */
export { classifyBaileysError } from "./errors.ts";
export { type BaileysMediaRef, messageKeyId, type SkipReason } from "./messages.ts";
export { BaileysProvider, type BaileysProviderOptions, baileysMessageIdFor } from "./provider.ts";
export {
  BAILEYS_STATUS,
  type BaileysConnectionUpdate,
  type BaileysEvents,
  type BaileysEventsLike,
  type BaileysLong,
  type BaileysMessageKey,
  type BaileysMessageUpdate,
  type BaileysReceiptUpdate,
  type BaileysSendOptions,
  type BaileysSocketLike,
  type BaileysUpsert,
  type BaileysWAMessage,
} from "./socket.ts";
