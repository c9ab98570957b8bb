/**
 * A rate-limited broadcast: `messages` sends to `chats` chats through `bot.enqueue` (MemoryDurability,
 * an in-process provider that answers at once), under a global limit of `rate` sends per second and
 * one send per `chatMs` per chat. Prints one JSON line: the time from the first enqueue to `bot.idle()`,
 * the ideal (the larger of messages / rate and a chat's sends spaced chatMs apart) and their ratio
 * (1 = the limiter lost nothing). Exits 1 when a message was not sent exactly once, in its chat's order.
 *
 *   bun bench/broadcast.bench.ts                     1,000 messages, 100 chats, 100/s, 1 per 500 ms per chat
 *   bun bench/broadcast.bench.ts '{"messages":5000,"chats":500,"rate":300,"chatMs":100}'
 */
import { Bot, MemoryDurability } from "../mod.ts";
import { MockProvider } from "../testing.ts";

interface Config {
  messages: number;
  chats: number;
  /** Global sends per second. */
  rate: number;
  /** Per-chat interval in ms. */
  chatMs: number;
}

const config: Config = { messages: 1000, chats: 100, rate: 100, chatMs: 500, ...JSON.parse(process.argv[2] ?? "{}") };
const provider = new MockProvider();
const bot = new Bot({
  provider,
  durability: {
    backend: new MemoryDurability(),
    instanceId: "bench-broadcast",
    outbox: {
      rateLimit: {
        global: { count: config.rate, perMs: 1000 },
        perChat: { count: 1, perMs: config.chatMs },
      },
    },
  },
});
await bot.start();
const perChat = Math.ceil(config.messages / config.chats);
const startedAt = performance.now();
let n = 0;
for (let round = 0; round < perChat && n < config.messages; round++) {
  for (let chat = 0; chat < config.chats && n < config.messages; chat++, n++) {
    await bot.enqueue(`c${chat}`, `m${round}`, { idempotencyKey: `c${chat}-${round}` });
  }
}
await bot.idle();
const seconds = (performance.now() - startedAt) / 1000;
const metrics = bot.durability!.metrics();
await bot.stop();

let wrong = 0;
const seen = new Set<string>();
const next = new Map<string, number>();
for (const sent of provider.sent) {
  if (seen.has(sent.idempotencyKey)) wrong++;
  seen.add(sent.idempotencyKey);
  const expected = next.get(sent.chatId) ?? 0;
  if (sent.content !== `m${expected}`) wrong++;
  next.set(sent.chatId, expected + 1);
}
if (seen.size !== config.messages) wrong++;
const ideal = Math.max(config.messages / config.rate, ((perChat - 1) * config.chatMs) / 1000);
console.log(JSON.stringify({
  ...config,
  seconds: Number(seconds.toFixed(3)),
  ideal: Number(ideal.toFixed(3)),
  ratio: Number((seconds / ideal).toFixed(3)),
  throttled: metrics.outboxThrottled,
  wrong,
}));
process.exit(wrong === 0 ? 0 : 1);
