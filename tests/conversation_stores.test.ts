// A conversation across two restarts on each durable session store (SQLite, Postgres, Redis over
// ioredis and over @upstash/redis), each process with a new client: the first restart replays the
// flow to feed the next answer, the second finds only an armed deadline and runs the timeout. Every
// prompt goes out once.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import postgres from "postgres";
import IORedis from "ioredis";
import { Redis as Upstash } from "@upstash/redis";
import { AskTimeoutError, Bot, type DurabilityBackend, type SessionStore } from "../mod.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import { PostgresStore } from "../backends/postgres/mod.ts";
import { RedisStore } from "../backends/redis/mod.ts";
import { MockProvider } from "../src/testing/mock_provider.ts";
import { POSTGRES_URL, REDIS_URL, runId, serviceSkip } from "./support/services.ts";
import { startUpstashBridge, type UpstashBridge } from "./support/upstash_bridge.ts";

const dir = join(tmpdir(), `botmesh-conv-stores-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
const pgSkip = await serviceSkip("postgres");
const redisSkip = await serviceSkip("redis");
const admin = pgSkip ? null : postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
const bridge: UpstashBridge | null = redisSkip ? null : await startUpstashBridge();
const schemas: string[] = [];
const prefixes: string[] = [];
afterAll(async () => {
  if (prefixes.length > 0) {
    const redis = new IORedis(REDIS_URL);
    for (const prefix of prefixes) {
      let cursor = "0";
      do {
        const [next, keys] = await redis.scan(cursor, "MATCH", `{${prefix}}*`, "COUNT", 1000);
        cursor = next;
        if (keys.length > 0) await redis.del(...keys);
      } while (cursor !== "0");
    }
    redis.disconnect();
  }
  rmSync(dir, { recursive: true, force: true });
  for (const schema of schemas) await admin!.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
  await admin?.end();
  await bridge?.stop();
});

/** One process's store, its durability backend, and how to let them go. */
interface Opened {
  store: SessionStore;
  backend: DurabilityBackend;
  close(): Promise<void>;
}

const form = async (ctx: Parameters<Parameters<Bot["when"]>[1]>[0]) => {
  const name = await ctx.ask("Name?");
  const age = await ctx.ask(`Age, ${name.text}?`);
  try {
    const city = await ctx.ask("City?", { timeoutMs: 400 });
    await ctx.reply(`Done: ${name.text}, ${age.text}, ${city.text}`);
  } catch (error) {
    if (!(error instanceof AskTimeoutError)) throw error;
    await ctx.reply(`No city for ${name.text}/${age.text}`);
  }
};

async function run(open: () => Promise<Opened>) {
  const sent: [string, unknown][] = [];
  const life = async (work: (provider: MockProvider, bot: Bot) => Promise<void>) => {
    const opened = await open();
    const provider = new MockProvider();
    const bot = new Bot({ provider, store: opened.store, durability: { backend: opened.backend, instanceId: "stores-1", sweepIntervalMs: 50 } });
    bot.when("form", form);
    bot.when(() => true, (ctx) => ctx.reply(`echo ${ctx.message.text}`));
    await bot.start();
    try {
      await work(provider, bot);
    } finally {
      await bot.stop();
      sent.push(...provider.sent.map((s): [string, unknown] => [s.idempotencyKey, s.content]));
      await opened.close();
    }
  };
  await life(async (provider, bot) => {
    await provider.receive({ id: "m0", chatId: "u", text: "form" });
    await provider.receive({ id: "m1", chatId: "u", text: "Ann" });
    await bot.idle();
  });
  let replayed = 0;
  await life(async (provider, bot) => {
    await provider.receive({ id: "m2", chatId: "u", text: "33" });
    await bot.idle();
    replayed = bot.durability!.metrics().conversationsReplayed;
  });
  await life(async (provider, bot) => {
    // No message: the timeout of "City?" is due in the journal, and this restart's sweep fires it.
    const end = Date.now() + 5000;
    while (provider.sent.length === 0 && Date.now() < end) await new Promise((r) => setTimeout(r, 20));
    await bot.idle();
  });
  expect(sent).toEqual([
    ["m0:1", "Name?"],
    ["m1:1", "Age, Ann?"],
    ["m2:1", "City?"],
    ["m0:t3:1", "No city for Ann/33"],
  ]);
  expect(replayed).toBe(1);
  const last = await open();
  try {
    expect(await last.store.get("botmesh:conversation:bot:u")).toMatchObject({ state: "ended", endedBy: "m0:t3" });
    // The timeout was journaled as an inbox record of its own, done once it fired.
    await last.backend.open?.();
    expect((await last.backend.inbox.get("m0:t3"))?.state).toBe("done");
  } finally {
    await last.close();
  }
}

describe("a conversation across restarts on each durable store", () => {
  test("SQLiteStore", async () => {
    const file = join(dir, "conv.db");
    await run(async () => {
      const store = new SQLiteStore({ file });
      return { store, backend: store.durability(), close: async () => store.close() };
    });
  });

  test.skipIf(Boolean(pgSkip))("PostgresStore", async () => {
    const schema = `bm_conv_${runId()}`;
    schemas.push(schema);
    await run(async () => {
      const sql = postgres(POSTGRES_URL, { max: 4, onnotice: () => {}, fetch_types: false });
      const store = new PostgresStore({ sql, schema });
      return { store, backend: store.durability(), close: () => sql.end({ timeout: 5 }) };
    });
  });

  test.skipIf(Boolean(redisSkip))("RedisStore over ioredis", async () => {
    const keyPrefix = `bm-conv-${runId()}`;
    prefixes.push(keyPrefix);
    await run(async () => {
      const client = new IORedis(REDIS_URL);
      const store = new RedisStore({ client, keyPrefix });
      return { store, backend: store.durability(), close: async () => void client.disconnect() };
    });
  });

  test.skipIf(Boolean(redisSkip))("RedisStore over @upstash/redis (REST bridge)", async () => {
    const keyPrefix = `bm-conv-${runId()}`;
    prefixes.push(keyPrefix);
    await run(async () => {
      const client = new Upstash({ url: bridge!.url, token: bridge!.token, retry: false });
      const store = new RedisStore({ client, keyPrefix });
      return { store, backend: store.durability(), close: async () => {} };
    });
  });
});
