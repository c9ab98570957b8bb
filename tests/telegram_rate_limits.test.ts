// Telegram's flood limits, end to end: the real Telegram provider against the fake Bot API enforcing
// them exactly (at 10x Telegram's rates, so that a broadcast of 5,000 messages takes about 21 s, not
// 190 s). The bot's limiter runs at 80% of the fake's limits: sends admitted exactly at the limit reach
// a strict server closer together than they left (network and event-loop jitter), so a bot leaves a
// margin. At 10x the rates the same margin is a tenth of the time: 10% of Telegram's real limits leaves
// 100 ms between two sends of a chat, 10% of the scaled ones 11 ms, less than the bot and the fake (one
// event loop) stall on a loaded machine; 20% leaves 25 ms. A broadcast through bot.enqueue meets no 429
// and never goes faster than its limits; a 429 spends no attempt and pauses only its chat.
import { afterEach, describe, expect, test } from "bun:test";
import { Bot, MemoryDurability } from "../mod.ts";
import { TelegramProvider } from "../providers/telegram/mod.ts";
import { FakeTelegram, telegramLimits } from "./support/fake_telegram.ts";
import { scaledTelegramLimits } from "./support/scaled_limits.ts";

/** The fake enforces Telegram's limits this many times faster. */
const FACTOR = 10;
/** The bot's limiter runs at this share of the fake's limits. */
const MARGIN = 0.8;
const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

async function setup(f: FakeTelegram, outbox: Record<string, unknown>): Promise<Bot> {
  const provider = new TelegramProvider({ token: f.token, apiBase: f.url, secretToken: false, requestTimeoutMs: 10_000 });
  const bot = new Bot({
    provider,
    durability: { backend: new MemoryDurability(), instanceId: "tg-rate", outbox },
  });
  bot.on("error", (e) => console.error(e));
  await bot.start();
  cleanups.push(() => bot.stop());
  return bot;
}

describe("telegram: flood limits", () => {
  test("a broadcast of 5,000 messages to 500 chats: no 429, each message once, in chat order, never faster than the limits", async () => {
    const f = new FakeTelegram({ limits: telegramLimits(FACTOR) }).start();
    cleanups.push(() => f.stop());
    const bot = await setup(f, { rateLimit: scaledTelegramLimits(FACTOR * MARGIN) });
    const globalRate = 30 * FACTOR * MARGIN; // sends per second the bot allows itself
    // 450 private chats and 50 groups (negative ids), 10 messages each, enqueued message by message.
    const chats = Array.from({ length: 500 }, (_, i) => (i < 450 ? String(1000 + i) : String(-1_000_000 - i)));
    const total = chats.length * 10;
    const startedAt = performance.now();
    for (let n = 0; n < 10; n++) {
      for (const chat of chats) await bot.enqueue(chat, `news ${n}`, { idempotencyKey: `b-${chat}-${n}` });
    }
    await bot.idle();
    const seconds = (performance.now() - startedAt) / 1000;
    const metrics = bot.durability!.metrics();

    expect(f.floodRefusals, "no send was refused for flooding").toBe(0);
    expect(f.calls.filter((c) => c.status === 429).length).toBe(0);
    expect(f.sent.length, "every message arrived").toBe(total);
    const seen = new Set(f.sent.map((s) => `${s.chatId}|${s.params.text}`));
    expect(seen.size, "each exactly once").toBe(total);
    for (const chat of chats) {
      const texts = f.sent.filter((s) => s.chatId === chat).map((s) => s.params.text);
      expect(texts, `chat ${chat} in order`).toEqual(Array.from({ length: 10 }, (_, n) => `news ${n}`));
    }
    // Not faster than the bot's limit allows (evenly spaced, one per 1000 / globalRate ms): `total`
    // sends span at least (total - 1) such intervals, less what the first send may have been delayed on
    // its way (arrivals are timed at the fake, admissions at the bot: 50 ms of slack). No upper bound:
    // the machine is shared. (The fake's windows, which refused nothing, bound every 100 ms too.)
    const span = f.sent[total - 1]!.at - f.sent[0]!.at;
    expect(span, "the broadcast kept to the global limit").toBeGreaterThanOrEqual((total - 1) * (1000 / globalRate) - 50);
    expect(metrics.outboxThrottled, "sends waited for the limiter").toBeGreaterThan(0);
    expect(metrics.outboxRetried + metrics.outboxDead).toBe(0);
    const ideal = total / globalRate;
    console.log(
      `broadcast of ${total} messages to ${chats.length} chats at ${FACTOR * MARGIN}x Telegram's limits: ${seconds.toFixed(1)} s, ideal ${
        ideal.toFixed(1)
      } s (ratio ${(seconds / ideal).toFixed(2)}), 429s: ${f.floodRefusals}, throttled: ${metrics.outboxThrottled}`,
    );
  }, 180_000);

  test("a 429 spends no attempt (retries: 0 still sends after it) and pauses only its chat", async () => {
    const f = new FakeTelegram().start();
    cleanups.push(() => f.stop());
    const bot = await setup(f, { retries: 0, rateLimit: scaledTelegramLimits(FACTOR) });
    const dead: unknown[] = [];
    bot.on("durability:dead", (d) => dead.push(d));
    f.inject("sendMessage", { kind: "status", status: 429, retryAfter: 1 });
    const first = await bot.send("7001", "one", { idempotencyKey: "p1" });
    expect(first.state, "paused by the 429").toBe("failed");
    const behind = await bot.send("7001", "two", { idempotencyKey: "p2" });
    expect(behind.state, "waits behind it").toBe("queued");
    const other = await bot.send("7002", "elsewhere", { idempotencyKey: "o1" });
    expect(other.state, "another chat goes on").toBe("sent");
    const paused = await bot.durability!.outbox.get("p1");
    expect([paused?.state, paused?.attempts]).toEqual(["failed", 0]);
    expect((paused?.nextAttemptAt ?? 0) - (paused?.updatedAt ?? 0), "retry_after: 1 s").toBeGreaterThanOrEqual(999);
    await bot.idle();
    expect(f.sent.map((s) => `${s.chatId}:${s.params.text}`)).toEqual(["7002:elsewhere", "7001:one", "7001:two"]);
    const sent = await bot.durability!.outbox.get("p1");
    expect([sent?.state, sent?.attempts], "sent at its first counted attempt").toEqual(["sent", 1]);
    expect(dead).toEqual([]);
    expect(bot.durability!.metrics().outboxThrottled).toBeGreaterThanOrEqual(1);
  }, 30_000);
});
