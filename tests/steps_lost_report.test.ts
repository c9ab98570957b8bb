// A step cut off during its call is reported `durability:ambiguous` by the process whose scan makes it
// `unknown`, once. When that process dies right after the scan's commit, before its report (found by
// tests/step_kill.test.ts: a restarted bot SIGKILLed during its recovery), the attempt is already
// `unknown` for the next one, which no scan reports again; the run that dead-letters the message then
// says it in the message's dead letter (`durability:dead`, the StepAmbiguousError naming the attempt), so a
// held step is never dead-lettered silently, and a step is never reported ambiguous twice.
import { afterEach, expect, test } from "bun:test";
import { Bot, MemoryDurability } from "../mod.ts";
import type { DurabilityBackend } from "../src/contract.ts";
import { MockProvider } from "../src/testing/mock_provider.ts";
import { crashable } from "../src/testing/crashable.ts";
import { until } from "./support/lossy.ts";

const config = (backend: DurabilityBackend) => ({
  backend,
  instanceId: "bot-1", // each bot is a restart of the same process: its start reclaims the last one's work
  sweepIntervalMs: 20,
  inbox: { leaseMs: 300, retries: 3, backoff: { baseMs: 2, capMs: 10 } },
  outbox: { leaseMs: 300, retries: 3, backoff: { baseMs: 2, capMs: 10 } },
});

const running: Bot[] = [];
afterEach(async () => {
  for (const bot of running.splice(0)) await bot.stop().catch(() => {});
});

test("a step's ambiguity whose report died with the recovery that found it is told by the message's dead letter", async () => {
  const shared = new MemoryDurability();
  const provider = new MockProvider();
  let calls = 0;
  const handler = (backend: ReturnType<typeof crashable> | null) => async (ctx: Parameters<Parameters<Bot["when"]>[1]>[0]) => {
    await ctx.step("pay", () => (backend ? backend.step("step.call", async () => ++calls) : ++calls));
    await ctx.reply("paid");
  };

  // A dies during the step's call (after it took effect, before its result is recorded).
  const a = crashable(shared);
  a.crashAfter("step.call");
  const botA = new Bot({ provider, durability: config(a) });
  botA.on("error", () => {});
  botA.when(() => true, handler(a));
  running.push(botA);
  await botA.start();
  void provider.receive({ id: "m1", chatId: "c1", text: "pay" });
  await until(() => a.crashed, "A to die during the step's call");
  expect(calls).toBe(1);

  // B, its restart, dies right after its recovery's outbox scan made the attempt unknown: no report.
  const b = crashable(shared);
  b.crashAfter("outbox.claim");
  const botB = new Bot({ provider, durability: config(b) });
  const reportsB: unknown[] = [];
  botB.on("durability:ambiguous", (e) => reportsB.push(e));
  botB.on("error", () => {});
  botB.when(() => true, handler(b));
  running.push(botB);
  await botB.start().catch(() => {});
  await until(() => b.crashed, "B to die after its recovery's outbox scan");
  expect((await shared.outbox.get("m1:step:pay"))?.state).toBe("unknown");
  expect(reportsB).toEqual([]);

  // C, the next restart: the rerun dead-letters the message, naming the step's attempt.
  const botC = new Bot({ provider, durability: config(shared) });
  const reports: unknown[] = [];
  const dead: { kind: string; id: string; error: string }[] = [];
  botC.on("durability:ambiguous", (e) => reports.push(e));
  botC.on("durability:dead", (e) => dead.push(e));
  botC.on("error", () => {});
  botC.when(() => true, handler(null));
  running.push(botC);
  await botC.start();
  await botC.idle();
  expect(calls).toBe(1);
  const record = await shared.inbox.get("m1");
  expect(record?.state).toBe("dead");
  expect(record?.error ?? "").toStartWith("StepAmbiguousError");
  expect(reports, "not reported a second time").toEqual([]);
  expect(dead).toHaveLength(1);
  expect(dead[0]).toMatchObject({ kind: "inbound", id: "m1" });
  expect(dead[0]!.error).toStartWith('StepAmbiguousError: Step "pay" may have run without its result being recorded (outbox entry "m1:step:pay" is unknown)');
  expect(provider.sent).toEqual([]);
});
