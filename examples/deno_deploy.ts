/**
 * A Telegram webhook bot shaped for Deno Deploy: no file system, no timers, Postgres for the journal.
 * Every request finishes the work it admitted before it answers; retries and the work of evicted
 * isolates are taken up by `bot.sweep()` on `Deno.cron` (where the runtime has it).
 *
 *   DATABASE_URL=postgres://… TELEGRAM_TOKEN=123:abc TELEGRAM_SECRET=some-secret \
 *     deno run --allow-net --allow-env examples/deno_deploy.ts
 *
 * Optional: PORT (default 8000), TELEGRAM_API (another Bot API server), PG_SCHEMA (default "public"),
 * SWEEP_PATH and SWEEP_SECRET (also sweep on a POST to this path carrying `Authorization: Bearer
 * <SWEEP_SECRET>`, for a scheduler that calls a URL).
 */
import postgres from "postgres";
import { Bot } from "../mod.ts";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { TelegramProvider } from "../providers/telegram/provider.ts";

// For tsc, which checks this repo with Bun's types (Deno has its own):
declare const Deno: {
  env: { get(k: string): string | undefined };
  serve(o: object, h: (r: Request) => Promise<Response>): unknown;
  cron?: (name: string, schedule: string, fn: () => Promise<void>) => unknown;
};
const env = (name: string) => Deno.env.get(name);

const sql = postgres(env("DATABASE_URL") ?? "", { max: 3, fetch_types: false, onnotice: () => {} });
const telegram = new TelegramProvider({
  token: env("TELEGRAM_TOKEN") ?? "",
  secretToken: env("TELEGRAM_SECRET") ?? "",
  apiBase: env("TELEGRAM_API") ?? "https://api.telegram.org",
});
const bot = new Bot({
  provider: telegram,
  durability: {
    backend: new PostgresDurability({ sql, schema: env("PG_SCHEMA") ?? "public" }),
    // No sweep or retry timers: an isolate may be gone before they fire. The cron below sweeps.
    sweepIntervalMs: 0,
    // An evicted isolate's work is taken over once its lease lapses: keep leases short.
    inbox: { leaseMs: 30_000 },
    outbox: { leaseMs: 30_000 },
  },
});

bot.when(/.*/, (ctx) => ctx.reply(`You said: ${ctx.message.text}`));
bot.when(() => true, (ctx) => ctx.reply(`Got your ${ctx.message.type}, thanks!`));

const ready = bot.start();

const sweep = async () => {
  await ready;
  const summary = await bot.sweep({ budgetMs: 20_000 });
  console.log(`sweep: ${JSON.stringify(summary)}`);
};
Deno.cron?.("botmesh sweep", "* * * * *", sweep);

/** Whether two texts are equal, compared in constant time (through SHA-256: the length does not leak either). */
async function sameText(a: string, b: string): Promise<boolean> {
  const digest = async (text: string) => new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(text)));
  const [x, y] = await Promise.all([digest(a), digest(b)]);
  let diff = 0;
  for (let i = 0; i < x.length; i++) diff |= x[i]! ^ y[i]!;
  return diff === 0;
}

const sweepPath = env("SWEEP_PATH");
const sweepSecret = env("SWEEP_SECRET");
if (sweepPath && !sweepSecret) throw new Error("SWEEP_PATH needs SWEEP_SECRET (the sweep endpoint must not be open to anyone)");
Deno.serve({ port: Number(env("PORT") ?? 8000), onListen: ({ port }: { port: number }) => console.log(`listening on ${port}`) }, async (request) => {
  await ready;
  if (sweepPath && request.method === "POST" && new URL(request.url).pathname === sweepPath) {
    if (!(await sameText(request.headers.get("authorization") ?? "", `Bearer ${sweepSecret}`))) return new Response("forbidden\n", { status: 403 });
    await sweep();
    return new Response("swept\n");
  }
  const response = await telegram.webhook(request);
  // The work this request admitted is done (or due in the journal) before the isolate may go.
  await bot.settled();
  return response;
});
