/**
 * A Telegram webhook bot on Deno.serve, journaling in Postgres (several replicas can share it).
 *
 *   DATABASE_URL=postgres://… TELEGRAM_TOKEN=123:abc TELEGRAM_SECRET=some-secret deno run -A examples/telegram_deno_postgres.ts
 *
 * Optional: PORT (default 8000), TELEGRAM_API (another Bot API server), PG_SCHEMA (default "public").
 */
import postgres from "postgres";
import { Bot } from "../mod.ts";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { TelegramProvider } from "../providers/telegram/provider.ts";

// For tsc, which checks this repo with Bun's types (Deno has its own):
declare const Deno: { env: { get(k: string): string | undefined }; serve(o: object, h: (r: Request) => Promise<Response>): unknown };
const env = (name: string) => Deno.env.get(name);

const sql = postgres(env("DATABASE_URL") ?? "", { max: 5, fetch_types: false, onnotice: () => {} });
const telegram = new TelegramProvider({
  token: env("TELEGRAM_TOKEN") ?? "",
  secretToken: env("TELEGRAM_SECRET") ?? "",
  apiBase: env("TELEGRAM_API") ?? "https://api.telegram.org",
});
const backend = new PostgresDurability({ sql, schema: env("PG_SCHEMA") ?? "public" });
// Each replica needs its own instanceId: set INSTANCE_ID (stable) to take back its work at once after a
// restart; without it the library adds a per-boot suffix and a restart waits for the old leases.
const bot = new Bot({ provider: telegram, durability: { backend, ...(env("INSTANCE_ID") ? { instanceId: env("INSTANCE_ID") } : {}) } });

bot.when(/.*/, (ctx) => ctx.reply(`You said: ${ctx.message.text}`));
bot.when(() => true, (ctx) => ctx.reply(`Got your ${ctx.message.type}, thanks!`));

await bot.start();
Deno.serve({ port: Number(env("PORT") ?? 8000), onListen: ({ port }: { port: number }) => console.log(`listening on ${port}`) }, telegram.webhook);
