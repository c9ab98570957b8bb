/**
 * A minimal bot on the in-memory backend, driven by the mock provider.
 *
 *   deno run examples/echo.ts
 *   bun examples/echo.ts
 *
 * `instanceId` is set explicitly, so the library never needs the hostname
 * (no `--allow-sys` on Deno).
 */
import { Bot, MemoryDurability } from "../mod.ts";
import { MockProvider } from "../testing.ts";

const provider = new MockProvider();
const bot = new Bot({
  provider,
  durability: { backend: new MemoryDurability(), instanceId: "echo-example" },
});
bot.when(/hi/, (ctx) => ctx.reply("hello"));
bot.when(/bye/, (ctx) => ctx.reply("see you"));

await bot.start();
await provider.receive({ id: "m1", chatId: "c1", text: "hi" });
await provider.receive({ id: "m2", chatId: "c1", text: "bye" });
await provider.receive({ id: "m1", chatId: "c1", text: "hi" }); // a redelivery of m1: not handled again
await bot.idle();

console.log("sent:");
for (const s of provider.sent) console.log(`  ${s.chatId} ${s.idempotencyKey} ${JSON.stringify(s.content)}`);
console.log("metrics:", bot.durability!.metrics());
await bot.stop();
