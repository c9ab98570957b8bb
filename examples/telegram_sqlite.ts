/**
 * A Telegram bot (long polling) journaling in SQLite. Kill it with `kill -9` at any moment and start
 * it again: every message gets its replies, and no reply goes out twice.
 *
 *   TELEGRAM_TOKEN=123:abc node_modules/.bin/bun examples/telegram_sqlite.ts
 *   TELEGRAM_TOKEN=123:abc node_modules/.bin/deno run -A examples/telegram_sqlite.ts
 *
 * Optional: TELEGRAM_API (another Bot API server), BOT_DB (the SQLite file, default ./bot.db).
 * The README shows this bot with the package's import paths.
 */
import { Bot, TEXT } from "../mod.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import { TelegramProvider } from "../providers/telegram/mod.ts";

const telegram = new TelegramProvider({
  token: process.env.TELEGRAM_TOKEN!,
  mode: "polling", // getUpdates: no public URL needed
  deleteWebhookOnStart: true,
  apiBase: process.env.TELEGRAM_API ?? "https://api.telegram.org",
});
const store = new SQLiteStore({ file: process.env.BOT_DB ?? "./bot.db" });
const bot = new Bot({
  provider: telegram,
  store,
  // The same instanceId after a restart: the new process takes back what the killed one left, at once.
  durability: { backend: store.durability(), instanceId: "telegram-sqlite" },
});

async function askModel(text = ""): Promise<string> {
  await new Promise((resolve) => setTimeout(resolve, 3000)); // a slow LLM call: kill -9 the bot now
  return `You said "${text}".`;
}

bot.when(TEXT, async (ctx) => {
  await ctx.reply(`Working on "${ctx.message.text}"…`);
  // A step: its result is journaled before the handler goes on; a rerun gets it back without a call.
  const answer = await ctx.step("llm", () => askModel(ctx.message.text), { idempotent: true });
  await ctx.reply(answer); // after the restart this goes out, and "Working on…" is not sent again
});
bot.on("durability:dead", (dead) => console.error("dead letter:", dead));
bot.on("durability:ambiguous", (event) => console.error("outcome unknown, reported:", event));

await bot.start();
console.log("running");
process.on("SIGINT", async () => {
  await bot.stop();
  await store.close();
  process.exit(0);
});
