/**
 * `@botmesh/durable/grammy`: make an existing grammY bot crash-safe with one
 * call. Its updates are journaled in the durable inbox before its middleware
 * runs (a webhook answers, or long polling confirms, only then); a
 * redelivered update is dropped; an update a crash left half done runs
 * through the middleware again after the restart. The calls that create
 * messages (`ctx.reply`, `ctx.replyWith*`, `send*`, `forwardMessage(s)`,
 * `copyMessage(s)`, on `ctx.api` and `bot.api`) go through the outbox keyed
 * `<inbound id>:<n>`, so a rerun is answered from the outbox instead of
 * sending twice; `durableConversations(safe)`, a plugin of
 * `@grammyjs/conversations` v2, does the same for the calls of conversations.
 * `safe.step(name, fn)` (or `ctx.step` with `bot.use(safe.steps())`) runs
 * the middleware's other effects (an LLM call, a payment) once per update.
 * grammY is an optional peer dependency: nothing here loads it; your bot
 * does. See docs/grammy.md.
 *
 * @example Long polling on SQLite
 * ```ts ignore
 * import { Bot } from "grammy";
 * import { durable } from "@botmesh/durable/grammy";
 * import { SQLiteStore } from "@botmesh/durable/sqlite";
 *
 * const bot = new Bot(process.env.BOT_TOKEN!);
 * bot.on("message:text", (ctx) => ctx.reply(`You said: ${ctx.message.text}`));
 * const store = new SQLiteStore({ file: "bot.db" });
 * const safe = durable(bot, { durability: { backend: store.durability(), instanceId: "bot-1" } });
 * await safe.start();
 * bot.start();
 * ```
 *
 * @module
 */
export {
  type ConversationPlugin,
  durable,
  durableConversations,
  DurableGrammy,
  type DurableGrammyOptions,
  durableStorage,
  type GrammyBotLike,
  type StepFlavor,
} from "./durable.ts";
export type { StepCall, StepOptions } from "../../src/engine/steps.ts";
export type { DurableStorageAdapter, DurableStorageOptions } from "./storage.ts";
export { isJournaledMethod } from "./methods.ts";
export { classifyGrammyError } from "./provider.ts";
