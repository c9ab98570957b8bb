/**
 * A Telegram webhook bot on Bun.serve, journaling in SQLite (replies are sent once, even across a crash).
 *
 *   TELEGRAM_TOKEN=123:abc TELEGRAM_SECRET=some-secret PORT=8080 bun examples/telegram_bun.ts
 *
 * Then tell Telegram where it is, with the same secret: `await telegram.setWebhook("https://…")`.
 * Optional: TELEGRAM_API (another Bot API server), BOT_DB (the SQLite file).
 */
import { Bot } from "../mod.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import { TelegramProvider } from "../providers/telegram/mod.ts";

const env = process.env;
const telegram = new TelegramProvider({
  token: env.TELEGRAM_TOKEN ?? "",
  secretToken: env.TELEGRAM_SECRET ?? "",
  ...(env.TELEGRAM_API ? { apiBase: env.TELEGRAM_API } : {}),
});
const store = new SQLiteStore({ file: env.BOT_DB ?? "./data/telegram.db" });
const bot = new Bot({ provider: telegram, store, durability: { backend: store.durability(), instanceId: "telegram-bun" } });

bot.when(/.*/, (ctx) => ctx.reply(`You said: ${ctx.message.text}`));
bot.when(() => true, (ctx) => ctx.reply(`Got your ${ctx.message.type}, thanks!`));

await bot.start();
const server = Bun.serve({ port: Number(env.PORT ?? 8080), fetch: telegram.webhook });
console.log(`listening on ${server.port}`);
process.on("SIGTERM", async () => {
  await server.stop();
  await bot.stop();
  await store.close();
  process.exit(0);
});
