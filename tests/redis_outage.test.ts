// A Bot on RedisDurability while Redis goes away and comes back:
// (a) ioredis, its connections killed by an admin (CLIENT KILL ID, found by CLIENT SETNAME);
// (b) @upstash/redis, the REST bridge stopped and restarted.
// The bot reports errors, a message whose admission failed is not dispatched (it is rejected so
// the channel redelivers it), everything journaled stays, and once Redis is back new messages are
// processed without restarting the bot.
import { afterAll, describe, expect, test } from "bun:test";
import IORedis from "ioredis";
import { Redis as Upstash } from "@upstash/redis";
import { Bot } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import { RedisDurability } from "../backends/redis/durability.ts";
import { REDIS_URL, runId, serviceSkip } from "./support/services.ts";
import { startUpstashBridge, type UpstashBridge } from "./support/upstash_bridge.ts";

const skip = await serviceSkip("redis");
const admin = skip ? null : new IORedis(REDIS_URL);
const prefixes: string[] = [];

afterAll(async () => {
  for (const p of prefixes) {
    let cursor = "0";
    do {
      const [next, keys] = await admin!.scan(cursor, "MATCH", `{${p}}*`, "COUNT", 1000);
      cursor = next;
      if (keys.length > 0) await admin!.del(...keys);
    } while (cursor !== "0");
  }
  admin?.disconnect();
});

async function until(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 10_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await Bun.sleep(10);
  }
}

/** A bot that echoes every text, recording what its handler saw and the errors it reported. */
function echoBot(backend: RedisDurability) {
  const provider = new MockProvider();
  const bot = new Bot({
    provider,
    durability: { backend, instanceId: `outage-${runId()}`, sweepIntervalMs: 50 },
  });
  const handled: string[] = [];
  const errors: Error[] = [];
  bot.on("error", (error: Error) => errors.push(error));
  bot.when(/.*/, async (ctx) => {
    handled.push(ctx.inboundId);
    await ctx.reply(`echo ${ctx.message.text}`);
  });
  return { bot, provider, handled, errors };
}

describe.skipIf(Boolean(skip))("redis outage", () => {
  test("ioredis: connections killed while messages arrive", async () => {
    const keyPrefix = `bm-outage:${runId()}:`;
    prefixes.push(keyPrefix);
    const name = `bm-outage-${runId()}`;
    const client = new IORedis(REDIS_URL, {
      connectionName: name, // CLIENT SETNAME on every (re)connection
      enableOfflineQueue: false, // fail fast while disconnected: the channel redelivers
      maxRetriesPerRequest: 0,
      retryStrategy: () => 400, // come back 400 ms after a loss
    });
    const backend = new RedisDurability({ client, keyPrefix });
    await until("ioredis to connect", () => client.status === "ready");
    const { bot, provider, handled, errors } = echoBot(backend);
    await bot.start();
    try {
      expect((await provider.receive({ id: "m1", chatId: "c1", text: "one" })).status).toBe("admitted");
      await bot.idle();
      expect(handled).toEqual(["m1"]);

      // Kill every connection of this client (by the name it set), as a network failure would.
      const list = String(await admin!.call("CLIENT", "LIST"));
      const ids = list.split("\n").filter((line) => line.includes(` name=${name} `)).map((line) => /id=(\d+)/.exec(line)![1]!);
      expect(ids.length).toBeGreaterThan(0);
      for (const id of ids) await admin!.call("CLIENT", "KILL", "ID", id);
      await until("ioredis to notice the loss", () => client.status !== "ready");

      // Messages arriving now are not journaled: refused (not dispatched), so the channel redelivers.
      const during = await Promise.all([
        provider.receive({ id: "m2", chatId: "c1", text: "two" }),
        provider.receive({ id: "m3", chatId: "c2", text: "three" }),
      ]);
      expect(during.map((r) => r.status)).toEqual(["rejected", "rejected"]);
      expect(errors.length, "the bot reported the failure").toBeGreaterThan(0);
      expect(errors.some((e) => e.message.includes("Redis") || String(e.cause).includes("Redis"))).toBe(true);

      await until("ioredis to reconnect", () => client.status === "ready");
      // Back: the redeliveries and new messages are processed, by the same bot.
      expect((await provider.receive({ id: "m2", chatId: "c1", text: "two" })).status).toBe("admitted");
      expect((await provider.receive({ id: "m4", chatId: "c1", text: "four" })).status).toBe("admitted");
      expect((await provider.receive({ id: "m3", chatId: "c2", text: "three" })).status).toBe("admitted");
      await bot.idle();
      await until("the replies to be sent", async () => (await backend.outbox.list({ state: "sent" })).length === 4);
      expect(handled.filter((id) => id === "m2" || id === "m3").length, "each refused message ran once, after redelivery").toBe(2);
      expect([...handled].sort()).toEqual(["m1", "m2", "m3", "m4"]);
      expect(provider.sent.filter((s) => s.chatId === "c1").map((s) => s.content)).toEqual(["echo one", "echo two", "echo four"]);
      // Everything journaled stays, in the order the bot first received it (a refused message's redelivery
      // keeps its first receipt time: m3 came before m4).
      const inbox = await backend.inbox.list();
      expect(inbox.map((r) => [r.id, r.state])).toEqual([["m1", "done"], ["m2", "done"], ["m3", "done"], ["m4", "done"]]);
    } finally {
      await bot.stop();
      client.disconnect();
    }
  }, 30_000);

  test("@upstash/redis: the REST endpoint stopped and restarted", async () => {
    const keyPrefix = `bm-outage:${runId()}:`;
    prefixes.push(keyPrefix);
    const bridge: UpstashBridge = await startUpstashBridge();
    const client = new Upstash({ url: bridge.url, token: bridge.token, retry: false });
    const backend = new RedisDurability({ client, keyPrefix });
    const { bot, provider, handled, errors } = echoBot(backend);
    await bot.start();
    try {
      expect((await provider.receive({ id: "u1", chatId: "c1", text: "one" })).status).toBe("admitted");
      await bot.idle();
      await until("the first reply", async () => (await backend.outbox.list({ state: "sent" })).length === 1);

      await bridge.stop();
      const during = await provider.receive({ id: "u2", chatId: "c1", text: "two" });
      expect(during.status).toBe("rejected");
      expect(errors.length).toBeGreaterThan(0);
      await Bun.sleep(200); // sweeps fail meanwhile; the bot keeps running
      expect(handled).toEqual(["u1"]);

      await bridge.restart();
      expect((await provider.receive({ id: "u2", chatId: "c1", text: "two" })).status).toBe("admitted");
      expect((await provider.receive({ id: "u3", chatId: "c1", text: "three" })).status).toBe("admitted");
      await bot.idle();
      await until("the replies to be sent", async () => (await backend.outbox.list({ state: "sent" })).length === 3);
      expect(handled).toEqual(["u1", "u2", "u3"]);
      expect(provider.sent.map((s) => s.content)).toEqual(["echo one", "echo two", "echo three"]);
      expect((await backend.inbox.list()).map((r) => [r.id, r.state])).toEqual([["u1", "done"], ["u2", "done"], ["u3", "done"]]);
    } finally {
      await bot.stop();
      await bridge.stop();
    }
  }, 30_000);
});
