import { expect, test } from "bun:test";
import { Bot, MemoryDurability, StepAmbiguousError } from "../mod.ts";
import type { DurabilityBackend } from "../src/contract.ts";
import { MockProvider } from "../src/testing/mock_provider.ts";
import { crashable } from "../src/testing/crashable.ts";

const fast = (backend: DurabilityBackend, instanceId = "s-1") => ({
  backend,
  instanceId,
  sweepIntervalMs: 20,
  inbox: { leaseMs: 300, retries: 3, backoff: { baseMs: 2, capMs: 10 } },
  outbox: { leaseMs: 300, retries: 3, backoff: { baseMs: 2, capMs: 10 } },
});

test("a step runs once across a handler retry", async () => {
  const backend = new MemoryDurability();
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: fast(backend) });
  let calls = 0;
  let runs = 0;
  bot.when(() => true, async (ctx) => {
    runs++;
    const answer = await ctx.step("llm", () => {
      calls++;
      return { text: `echo ${ctx.message.text}` };
    });
    if (runs === 1) throw new Error("after the step");
    await ctx.reply(answer.text);
  });
  await bot.start();
  await provider.receive({ id: "m1", chatId: "c1", text: "hi" });
  await bot.idle();
  expect(runs).toBe(2);
  expect(calls).toBe(1);
  expect(provider.sent.map((s) => s.content)).toEqual(["echo hi"]);
  const entry = await backend.outbox.get("m1:step:llm");
  expect(entry?.state).toBe("sent");
  await bot.stop();
});

test("a step whose run was cut off during its call is held and reported", async () => {
  const shared = new MemoryDurability();
  const a = crashable(shared);
  a.crashAfter("step.call");
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: fast(a) });
  const ambiguous: unknown[] = [];
  const dead: unknown[] = [];
  let calls = 0;
  bot.when(() => true, async (ctx) => {
    await ctx.step("pay", () => a.step("step.call", async () => ++calls));
  });
  bot.on("error", () => {});
  await bot.start();
  await provider.receive({ id: "m1", chatId: "c1", text: "hi" });
  await new Promise((r) => setTimeout(r, 50));
  expect(a.crashed).toBe(true);
  await bot.stop().catch(() => {});
  const bot2 = new Bot({ provider, durability: fast(shared, "s-2") });
  bot2.on("durability:ambiguous", (e) => ambiguous.push(e));
  bot2.on("durability:dead", (e) => dead.push(e));
  const errors: Error[] = [];
  bot2.on("error", (e) => errors.push(e));
  bot2.when(() => true, async (ctx) => {
    await ctx.step("pay", async () => ++calls);
  });
  await bot2.start();
  await bot2.idle();
  console.log(ambiguous, dead, errors.map((e) => e.message), (await shared.inbox.get("m1"))?.state, (await shared.outbox.get("m1:step:pay"))?.state);
  expect(calls).toBe(1);
  await bot2.stop();
});
