/**
 * An existing grammY bot made crash-safe with one call: long polling, journaling in SQLite. Kill it
 * with `kill -9` at any moment and start it again: every message gets its replies, none twice.
 *
 *   TELEGRAM_TOKEN=123:abc node_modules/.bin/bun examples/grammy_bot.ts
 *
 * Optional: TELEGRAM_API (another Bot API server), BOT_DB (the SQLite file, default ./bot.db).
 * In your project the imports are `@botmesh/durable/grammy` and `@botmesh/durable/sqlite`.
 */
import { Bot } from "grammy";
import { durable } from "../providers/grammy/mod.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";

const bot = new Bot(process.env.TELEGRAM_TOKEN!, {
  client: { apiRoot: process.env.TELEGRAM_API ?? "https://api.telegram.org" },
});
bot.command("start", (ctx) => ctx.reply("Send me some text."));
bot.on("message:text", async (ctx) => {
  await ctx.replyWithChatAction("typing"); // not journaled: a typing indicator may repeat
  await ctx.reply(`Working on "${ctx.message.text}"…`);
  await new Promise((resolve) => setTimeout(resolve, 3000)); // a slow LLM call, say: kill -9 the bot now
  await ctx.reply("Done."); // after the restart this goes out, and "Working on…" is not sent again
});

// The one addition: updates journaled before the middleware runs, replies through the outbox.
const store = new SQLiteStore({ file: process.env.BOT_DB ?? "./bot.db" });
const safe = durable(bot, { durability: { backend: store.durability(), instanceId: "grammy-sqlite" } });
safe.on("durability:dead", (dead) => console.error("dead letter:", dead));
safe.on("durability:ambiguous", (send) => console.error("may have been sent, held for an operator:", send));

await safe.start(); // recovery: an update a crash cut off runs through the middleware again
void bot.start({ onStart: () => console.log("running") });
let stopping = false;
async function shutdown(): Promise<void> {
  if (stopping) return;
  stopping = true;
  await safe.stop(); // stops grammY's polling, then lets the updates under way finish
  await store.close();
  process.exit(0);
}
process.on("SIGINT", shutdown); // Ctrl-C
process.on("SIGTERM", shutdown); // docker stop, systemd, Kubernetes

