/**
 * A Telegram webhook bot on Node's http server, journaling in a file.
 *
 *   bun build examples/telegram_node.ts --target=node --outdir .tmp/ex   (Node 20 runs no .ts)
 *   TELEGRAM_TOKEN=123:abc TELEGRAM_SECRET=some-secret PORT=8080 node .tmp/ex/telegram_node.js
 *
 * Optional: TELEGRAM_API (another Bot API server), BOT_FILE (the journal file).
 */
import { createServer } from "node:http";
import { Bot } from "../mod.ts";
import { nodeHandler } from "../ops.ts";
import { FileDurability } from "../backends/file/durability.ts";
import { TelegramProvider } from "../providers/telegram/mod.ts";

const env = process.env;
const telegram = new TelegramProvider({
  token: env.TELEGRAM_TOKEN ?? "",
  secretToken: env.TELEGRAM_SECRET ?? "",
  apiBase: env.TELEGRAM_API ?? "https://api.telegram.org",
});
const backend = new FileDurability({ path: env.BOT_FILE ?? "./data/telegram.json" });
const bot = new Bot({ provider: telegram, durability: { backend, instanceId: "telegram-node" } });

bot.when(/.*/, (ctx) => ctx.reply(`You said: ${ctx.message.text}`));
bot.when(() => true, (ctx) => ctx.reply(`Got your ${ctx.message.type}, thanks!`));

await bot.start();
const server = createServer(nodeHandler(telegram.webhook));
server.listen(Number(env.PORT ?? 8080), () => console.log(`listening on ${(server.address() as { port: number }).port}`));
process.on("SIGTERM", () => server.close(async () => {
  await bot.stop();
  process.exit(0);
}));
