/**
 * `@botmesh/durable/telegraf`: make an existing Telegraf 4 bot crash-safe
 * with one call. Its updates are journaled in the durable inbox before its
 * middleware runs (a webhook answers, or long polling confirms, only then);
 * a redelivered update is dropped; an update a crash left half done runs
 * through the middleware again after the restart. The calls that create
 * messages (`ctx.reply`, `ctx.replyWith*`, `send*`, `forwardMessage(s)`,
 * `copyMessage(s)`, on `ctx.telegram` and `bot.telegram`) go through the
 * outbox keyed `<inbound id>:<n>`, so a rerun is answered from the outbox
 * instead of sending twice; `safe.step(name, fn)` runs the middleware's other
 * effects (an LLM call, a payment) once per update. Telegraf is an optional peer dependency: nothing
 * here loads it; your bot does. See docs/telegraf.md.
 *
 * @example Long polling on SQLite
 * ```ts ignore
 * import { Telegraf } from "telegraf";
 * import { durable } from "@botmesh/durable/telegraf";
 * import { SQLiteStore } from "@botmesh/durable/sqlite";
 *
 * const bot = new Telegraf(process.env.BOT_TOKEN!);
 * bot.on("text", (ctx) => ctx.reply(`You said: ${ctx.message.text}`));
 * const store = new SQLiteStore({ file: "bot.db" });
 * const safe = durable(bot, { durability: { backend: store.durability(), instanceId: "bot-1" } });
 * await safe.start();
 * bot.launch();
 * ```
 *
 * @module
 */
export {
  durable,
  type DurableSessionStore,
  durableStorage,
  DurableTelegraf,
  type DurableTelegrafOptions,
  type TelegrafBotLike,
} from "./durable.ts";
export type { DurableStorageOptions } from "../grammy/storage.ts";
export type { StepCall, StepOptions } from "../../src/engine/steps.ts";
export { isJournaledMethod } from "../grammy/methods.ts";
export { classifyTelegrafError, TelegrafApiError } from "./errors.ts";
