/**
 * A WhatsApp Cloud API echo bot on Bun, journaled in SQLite.
 *
 *   WA_TOKEN=… WA_PHONE_NUMBER_ID=… WA_APP_SECRET=… WA_VERIFY_TOKEN=… bun examples/whatsapp_bun.ts
 *
 * Point the app's webhook at http(s)://<host>:<PORT>/ (default port 8080).
 * `WA_GRAPH_BASE` overrides the Graph API URL (the tests use a fake one).
 */
import { Bot, IMAGE, loadMediaOf } from "../mod.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import { WhatsAppProvider } from "../providers/whatsapp/mod.ts";

const env = (name: string): string => Bun.env[name] ?? (() => { throw new Error(`Set ${name}`); })();
const provider = new WhatsAppProvider({
  accessToken: env("WA_TOKEN"),
  phoneNumberId: env("WA_PHONE_NUMBER_ID"),
  appSecret: env("WA_APP_SECRET"),
  verifyToken: env("WA_VERIFY_TOKEN"),
  ...(Bun.env.WA_GRAPH_BASE ? { graphBase: Bun.env.WA_GRAPH_BASE } : {}),
  onStatus: (s) => console.log(`status ${s.id} ${s.status}`),
});
const store = new SQLiteStore({ file: Bun.env.WA_DB ?? "./whatsapp-bot.db" });
const bot = new Bot({ provider, store, durability: { backend: store.durability(), instanceId: "whatsapp-example" } });
bot.when(IMAGE, async (ctx) => {
  const media = await loadMediaOf(ctx);
  await ctx.reply(media ? `Nice picture (${media.data.byteLength} bytes)` : "Please send the image again");
});
bot.when(/.*/, (ctx) => ctx.reply(`You said: ${ctx.message.text}`));

await bot.start();
const server = Bun.serve({ port: Number(Bun.env.PORT ?? 8080), fetch: provider.webhook });
console.log(`listening on http://${server.hostname}:${server.port}/`);
process.on("SIGTERM", async () => {
  server.stop();
  await bot.stop();
  await store.close();
  console.log("stopped");
  process.exit(0);
});
