// SPEC §10, as written: a bot dies after the provider call, before its result is
// recorded; a second bot on the same state and instanceId recovers at once.
import { expect, test } from "bun:test";
import { Bot, MemoryDurability, MemoryStore } from "../mod.ts";
import { crashable, CrashableProvider, MockProvider } from "../testing.ts";

test("the crash-recovery snippet of the spec works as written", async () => {
  const store = new MemoryStore();
  const shared = new MemoryDurability();
  const a = crashable(shared);
  a.crashBefore("outbox.markSent"); // provider was called, the result is never recorded
  const providerA = new CrashableProvider(a);
  const botA = new Bot({ provider: providerA, store, durability: { backend: a, instanceId: "i1" } });
  botA.when("hello", (ctx) => ctx.reply("hi there"));
  botA.when("order", async (ctx) => {
    await ctx.reply("received");
  });
  await botA.start();
  // … drive botA until a.crashed …
  await providerA.receive({ id: "in-1", chatId: "c1", text: "hello" });
  await providerA.receive({ id: "in-2", chatId: "c2", text: "order" });
  await botA.idle();
  expect(a.crashed).toBe(true);
  expect(a.crashedAt).toBe("outbox.markSent");
  expect(providerA.sent.length).toBe(1); // the provider got it; nobody recorded it

  const providerB = new MockProvider();
  const botB = new Bot({ provider: providerB, store, durability: { backend: shared, instanceId: "i1" } });
  botB.when("hello", (ctx) => ctx.reply("hi there"));
  botB.when("order", async (ctx) => {
    await ctx.reply("received");
  });
  const ambiguous: { key: string; chatId: string }[] = [];
  botB.on("durability:ambiguous", (e) => ambiguous.push(e));
  const started = Date.now();
  await botB.start();
  await providerB.receive({ id: "in-1", chatId: "c1", text: "hello" }); // redelivered by the channel
  await providerB.receive({ id: "in-2", chatId: "c2", text: "order" });
  await botB.idle();
  expect(Date.now() - started).toBeLessThan(60_000); // did not wait for the 60 s lease
  const crashedKey = providerA.sent[0]!.idempotencyKey;
  expect(ambiguous).toEqual([{ key: crashedKey, chatId: providerA.sent[0]!.chatId }]);
  // Nothing went out twice: the ambiguous key is held, the other reply went out once.
  const all = [...providerA.sent, ...providerB.sent].map((s) => s.idempotencyKey).sort();
  expect(all).toEqual(["in-1:1", "in-2:1"]);
  expect((await shared.outbox.get(crashedKey))?.state).toBe("unknown");
  expect((await shared.inbox.get("in-1"))?.state).toBe("done");
  expect((await shared.inbox.get("in-2"))?.state).toBe("done");
  expect(botB.durability!.metrics().outboxAmbiguous).toBe(1);
  await botB.stop();
});
