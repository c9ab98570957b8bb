/**
 * `@botmesh/durable/builderbot`: BuilderBot (`@builderbot/bot` 1.3) bots on
 * the WhatsApp Cloud API whose messages survive a crash. {@link DurableMetaProvider}
 * replaces `@builderbot/provider-meta`: its webhook journals each message in
 * the durable inbox before Meta gets its 200, drops Meta's redeliveries, and
 * runs BuilderBot's flows for it from the inbox (one message at a time per
 * chat, under a lease, again after a crash); the flows' answers go through
 * the outbox, keyed `<inbound id>:<n>`, retried and dead-lettered. Its
 * `database` and the `state` {@link DurableMetaProvider.attach} puts on the bot
 * keep the flow position and the per-user state in a session store, written
 * with the message's done mark: a captured answer continues its flow after a
 * restart. `@builderbot/bot` is an optional peer dependency, loaded by this
 * entry only. See docs/builderbot.md.
 *
 * @example
 * ```ts ignore
 * import { addKeyword, createBot, createFlow } from "@builderbot/bot";
 * import { DurableMetaProvider } from "@botmesh/durable/builderbot";
 * import { SQLiteStore } from "@botmesh/durable/sqlite";
 *
 * const store = new SQLiteStore({ file: "bot.db" });
 * const provider = new DurableMetaProvider({
 *   whatsapp: { accessToken, phoneNumberId, appSecret, verifyToken },
 *   durability: { backend: store.durability(), instanceId: "shop-1" },
 *   store,
 * });
 * const order = addKeyword("pedido")
 *   .addAnswer("¿Qué talla?", { capture: true }, (ctx, { state }) => state.update({ size: ctx.body }));
 * const bot = await createBot({ flow: createFlow([order]), provider, database: provider.database });
 * provider.attach(bot);
 * bot.httpServer(3008); // the webhook at /webhook
 * ```
 *
 * @module
 */
export {
  type BuilderBotLike,
  DurableBuilderBotDatabase,
  DurableBuilderBotState,
  DurableMetaProvider,
  type DurableMetaProviderOptions,
} from "./provider.ts";
export { type BuilderBotMessage, bodyOf, whatsAppContent } from "./messages.ts";
