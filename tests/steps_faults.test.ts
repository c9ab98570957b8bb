// Durable steps under faults: one regression test per defect the review of src/engine/steps.ts found
// (a server clock step, lost and late replies of markCalling, a superseded attempt's late result, a
// conversation's settled step failure, a crash in a retry's backoff, a message admitted without its
// record, a purged earlier attempt). Each waits on conditions (bounded), never on a fixed sleep.
import { afterEach, expect, test } from "bun:test";
import { Bot, MemoryDurability, ProviderError } from "../mod.ts";
import type { DurabilityBackend, OutboxEntry } from "../src/contract.ts";
import { MockProvider } from "../src/testing/mock_provider.ts";
import { crashable } from "../src/testing/crashable.ts";
import { proxied, until } from "./support/lossy.ts";

// The marks of step attempts that hold no result (STEP_NOT_RUN, STEP_SUPERSEDED in src/engine/steps.ts).
const STEP_NOT_RUN = "botmesh:step-not-run";
const STEP_SUPERSEDED = "botmesh:step-superseded";

type Tuning = { leaseMs?: number; sweepIntervalMs?: number; outboxBackoff?: { baseMs: number; capMs: number } };

const config = (backend: DurabilityBackend, instanceId: string, t: Tuning = {}) => ({
  backend,
  instanceId,
  sweepIntervalMs: t.sweepIntervalMs ?? 20,
  inbox: { leaseMs: t.leaseMs ?? 300, retries: 3, backoff: { baseMs: 2, capMs: 10 } },
  outbox: { leaseMs: t.leaseMs ?? 300, retries: 3, backoff: t.outboxBackoff ?? { baseMs: 2, capMs: 10 } },
});

/** A backend whose inbox and outbox have the given methods replaced (the rest is `backend`'s). */
function faulty(
  backend: DurabilityBackend,
  inbox: Record<string, unknown>,
  outbox: Record<string, unknown>,
): DurabilityBackend {
  const wrapped = { inbox: proxied(backend.inbox, inbox), outbox: proxied(backend.outbox, outbox) };
  return proxied(backend, wrapped);
}

interface Events {
  ambiguous: { key: string; chatId: string; step?: string }[];
  resolved: { key: string; chatId: string; state: string; via: string }[];
  dead: { kind: string; id: string; error: string }[];
  errors: string[];
  warnings: string[];
}

function watch(bot: Bot): Events {
  const ev: Events = { ambiguous: [], resolved: [], dead: [], errors: [], warnings: [] };
  bot.on("durability:ambiguous", (e) => ev.ambiguous.push(e as Events["ambiguous"][number]));
  bot.on("durability:resolved", (e) => ev.resolved.push(e));
  bot.on("durability:dead", (e) => ev.dead.push(e as Events["dead"][number]));
  bot.on("error", (e) => ev.errors.push(e.message));
  bot.on("warning", (w) => ev.warnings.push(w.message));
  return ev;
}

/** Waits (bounded) until `check()` resolves true. */
async function untilAsync(check: () => Promise<boolean>, what: string, timeoutMs = 10_000): Promise<void> {
  const deadline = performance.now() + timeoutMs;
  while (!await check()) {
    if (performance.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}

const inboundState = async (backend: DurabilityBackend, id: string) => (await backend.inbox.get(id))?.state;
const settledInbound = (backend: DurabilityBackend, id: string) =>
  untilAsync(async () => ["done", "dead"].includes((await inboundState(backend, id)) ?? ""), `inbound "${id}" done or dead`);
const steps = async (backend: DurabilityBackend): Promise<Record<string, [OutboxEntry["state"], string | null]>> =>
  Object.fromEntries(
    (await backend.outbox.list({})).filter((e) => e.key.includes(":step:")).map((e) => [e.key, [e.state, e.messageId]]),
  );

/** Bots to stop after each test (a crashed one may refuse: ignored). */
const running: Bot[] = [];
afterEach(async () => {
  for (const bot of running.splice(0)) await bot.stop().catch(() => {});
});
const started = async (bot: Bot) => {
  running.push(bot);
  await bot.start();
  return bot;
};

test("t1: a step running while the journal's clock steps forward is reported by the process's own sweep, never run again", async () => {
  let offset = 0;
  const backend = new MemoryDurability({ clock: () => Date.now() + offset });
  let calls = 0;
  let entered = false;
  // The journal server's clock steps past the lease during the call, just after a heartbeat of the
  // attempt: the process's own sweep (every 20 ms) finds the lease lapsed before its next heartbeat (333 ms).
  const heartbeat = async (key: string, token: number, leaseMs: number) => {
    const held = await backend.outbox.heartbeat(key, token, leaseMs);
    if (entered && key === "m1:step:pay" && offset === 0) offset += 5000;
    return held;
  };
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: config(faulty(backend, {}, { heartbeat }), "a", { leaseMs: 1000 }) });
  const ev = watch(bot);
  let released = false;
  bot.when(() => true, async (ctx) => {
    const r = await ctx.step("pay", async () => {
      const n = ++calls;
      if (n === 1) {
        entered = true;
        await until(() => released, "the test to release the step");
      }
      return { charge: n };
    });
    await ctx.reply(`charged ${JSON.stringify(r)}`);
  });
  await started(bot);
  void provider.receive({ id: "m1", chatId: "c1", text: "pay" });
  await until(() => offset > 0, "the step's call and a heartbeat of it");
  await untilAsync(async () => (await backend.outbox.get("m1:step:pay"))?.state !== "sending", "the sweep to take up the step's attempt");
  released = true;
  await settledInbound(backend, "m1");
  await bot.idle();
  expect(calls).toBe(1);
  expect(provider.sent.map((s) => s.content)).toEqual(['charged {"charge":1}']);
  expect(await steps(backend)).toEqual({ "m1:step:pay": ["sent", '{"v":{"charge":1}}'] });
  expect(await inboundState(backend, "m1")).toBe("done");
  // Taken for cut off, then settled by the call's own result.
  expect(ev.ambiguous.map((e) => e.key)).toEqual(["m1:step:pay"]);
  expect(ev.resolved.map((e) => [e.key, e.chatId, e.state, e.via])).toEqual([["m1:step:pay", "c1", "sent", "call"]]);
  expect(ev.dead).toEqual([]);
});

test("t2: a lost reply to markCalling is asked again: the step runs once, nothing is ambiguous", async () => {
  const backend = new MemoryDurability();
  let lose = true;
  const markCalling = async (key: string, token: number, leaseMs: number) => {
    const held = await backend.outbox.markCalling(key, token, leaseMs);
    if (lose && key.includes(":step:")) {
      lose = false;
      throw new Error("connection reset (reply lost)");
    }
    return held;
  };
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: config(faulty(backend, {}, { markCalling }), "a") });
  const ev = watch(bot);
  let calls = 0;
  bot.when(() => true, async (ctx) => {
    const r = await ctx.step("pay", async () => ({ charge: ++calls }));
    await ctx.reply(`charged ${JSON.stringify(r)}`);
  });
  await started(bot);
  await provider.receive({ id: "m1", chatId: "c1", text: "pay" });
  await settledInbound(backend, "m1");
  await bot.idle();
  expect(lose).toBe(false); // the fault was hit
  expect(calls).toBe(1);
  expect(await inboundState(backend, "m1")).toBe("done");
  expect(provider.sent.map((s) => s.content)).toEqual(['charged {"charge":1}']);
  expect(await steps(backend)).toEqual({ "m1:step:pay": ["sent", '{"v":{"charge":1}}'] });
  expect(ev.ambiguous).toEqual([]);
  expect(ev.dead).toEqual([]);
});

test("t2b: markCalling unanswered three times in a row: the rerun of the message takes its own uncalled attempt up", async () => {
  // The announcement gives up after three tries; the attempt stays leased to this process with its call
  // journaled but never made. Its lease must not lapse into an ambiguity: the handler's retry takes it up.
  const backend = new MemoryDurability();
  let lose = 3;
  const markCalling = async (key: string, token: number, leaseMs: number) => {
    const held = await backend.outbox.markCalling(key, token, leaseMs);
    if (lose > 0 && key.includes(":step:")) {
      lose--;
      throw new Error("connection reset (reply lost)");
    }
    return held;
  };
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: config(faulty(backend, {}, { markCalling }), "a") });
  const ev = watch(bot);
  let calls = 0;
  bot.when(() => true, async (ctx) => {
    const r = await ctx.step("pay", async () => ({ charge: ++calls }));
    await ctx.reply(`charged ${JSON.stringify(r)}`);
  });
  await started(bot);
  await provider.receive({ id: "m1", chatId: "c1", text: "pay" });
  await settledInbound(backend, "m1");
  await bot.idle();
  expect(lose).toBe(0);
  expect(calls).toBe(1);
  expect(await inboundState(backend, "m1")).toBe("done");
  expect(await steps(backend)).toEqual({ "m1:step:pay": ["sent", '{"v":{"charge":1}}'] });
  expect(ev.ambiguous).toEqual([]);
  expect(ev.dead).toEqual([]);
});

test("t3: an idempotent step's superseded attempt cannot replace the result the user saw with its late one", async () => {
  const backend = new MemoryDurability();
  let stall = false;
  const heartbeat = (journal: { heartbeat: (...a: never[]) => Promise<boolean> }) => async (...a: never[]) => {
    if (stall) throw new Error("network partition");
    return await journal.heartbeat(...a);
  };
  const backendA = faulty(backend, { heartbeat: heartbeat(backend.inbox) }, { heartbeat: heartbeat(backend.outbox) });
  const pa = new MockProvider();
  const pb = new MockProvider();
  const a = new Bot({ provider: pa, durability: config(backendA, "A", { sweepIntervalMs: 60_000 }) });
  const b = new Bot({ provider: pb, durability: config(backend, "B") });
  const evA = watch(a);
  const evB = watch(b);
  let calls = 0;
  let aEntered = false;
  let aDone = false;
  const results: unknown[] = [];
  a.when(() => true, async (ctx) => {
    try {
      const r = await ctx.step("llm", async () => {
        const c = ++calls;
        aEntered = true;
        stall = true; // A is cut off from the journal while its call runs
        await until(() => pb.sent.length > 0, "B to answer the user");
        stall = false;
        return `answer-A-${c}`;
      }, { idempotent: true });
      await ctx.reply(r);
    } finally {
      aDone = true;
    }
  });
  b.when(() => true, async (ctx) => {
    const r = await ctx.step("llm", async () => `answer-B-${++calls}`, { idempotent: true });
    results.push(r);
    await ctx.reply(r);
  });
  await started(a);
  void pa.receive({ id: "m1", chatId: "c1", text: "q" });
  await until(() => aEntered, "A's call");
  await started(b);
  await until(() => aDone, "A's handler to end");
  await settledInbound(backend, "m1");
  await b.idle();
  expect(pa.sent).toEqual([]);
  expect(pb.sent.map((s) => s.content)).toEqual(["answer-B-2"]);
  expect(await steps(backend)).toEqual({
    "m1:step:llm": ["sent", STEP_SUPERSEDED],
    "m1:step:llm#2": ["sent", '{"v":"answer-B-2"}'],
  });
  expect(evB.ambiguous.map((e) => e.key)).toEqual(["m1:step:llm"]);
  expect(evB.resolved.map((e) => [e.key, e.chatId, e.state, e.via])).toEqual([["m1:step:llm", "c1", "sent", "rerun"]]);
  // A later run of the message (an operator's replay) gets the result the user saw.
  expect(await b.durability!.replayInbound("m1")).toBe(true);
  await until(() => results.length === 2, "the replayed run's step");
  await settledInbound(backend, "m1");
  expect(results).toEqual(["answer-B-2", "answer-B-2"]);
  expect(calls).toBe(2);
  expect(pb.sent.map((s) => s.content)).toEqual(["answer-B-2"]);
  expect([...evA.warnings, ...evB.warnings].filter((w) => w.includes("different content"))).toEqual([]);
});

test("t4: a step's settled failure in a conversation ends it: the chat's next messages are handled afresh", async () => {
  const backend = new MemoryDurability();
  const provider = new MockProvider();
  const bot = new Bot({ provider, durability: config(backend, "a") });
  const ev = watch(bot);
  const handled: string[] = [];
  bot.when(/^order/, async (ctx) => {
    handled.push(`order: ${ctx.message.text}`);
    const card = await ctx.ask("which card?");
    await ctx.step("charge", () => {
      throw new ProviderError("card declined", { retryable: false });
    });
    await ctx.reply(`charged ${card.text}`);
  });
  bot.when(() => true, async (ctx) => {
    handled.push(`other: ${ctx.message.text}`);
    await ctx.reply(`echo ${ctx.message.text}`);
  });
  await started(bot);
  for (const [id, text] of [["m1", "order"], ["m2", "visa"], ["m3", "hello?"], ["m4", "order"]]) {
    await provider.receive({ id, chatId: "c1", text });
    await settledInbound(backend, id);
    await bot.idle();
  }
  expect(await inboundState(backend, "m2")).toBe("dead");
  for (const id of ["m1", "m3", "m4"]) expect(await inboundState(backend, id)).toBe("done");
  expect(handled).toEqual(["order: order", "other: hello?", "order: order"]);
  expect(provider.sent.map((s) => s.content)).toEqual(["which card?", "echo hello?", "which card?"]);
  expect(ev.dead.map((e) => [e.kind, e.id])).toEqual([["step", "m2:step:charge"], ["inbound", "m2"]]);
  expect(ev.errors.some((e) => e.includes("conversation") && e.includes("ended"))).toBe(true);
});

test("t5: a crash during a step's retry backoff leaves nothing ambiguous: the next run retries the step", async () => {
  const shared = new MemoryDurability();
  const a = crashable(shared);
  const provider = new MockProvider();
  // A long backoff (Retry-After and the cap alike), so that the process dies in it, at its next inbox heartbeat.
  const botA = new Bot({ provider, durability: config(a, "A", { outboxBackoff: { baseMs: 2000, capMs: 2000 } }) });
  watch(botA);
  let calls = 0;
  botA.when(() => true, async (ctx) => {
    await ctx.step("pay", async () => {
      calls++;
      a.crashBefore("inbox.heartbeat");
      throw new ProviderError("rate limited", { status: 429, retryAfterMs: 2000 });
    });
    await ctx.reply("paid by A");
  });
  await started(botA);
  void provider.receive({ id: "m1", chatId: "c1", text: "pay" });
  await until(() => a.crashed, "A to die during the backoff");
  expect(calls).toBe(1);
  const bot = new Bot({ provider, durability: config(shared, "B") });
  const ev = watch(bot);
  bot.when(() => true, async (ctx) => {
    await ctx.step("pay", async () => {
      calls++;
      return "ok";
    });
    await ctx.reply("paid");
  });
  await started(bot);
  await settledInbound(shared, "m1");
  await bot.idle();
  expect(calls).toBe(2);
  expect(await inboundState(shared, "m1")).toBe("done");
  expect(provider.sent.map((s) => s.content)).toEqual(["paid"]);
  expect(await steps(shared)).toEqual({
    "m1:step:pay": ["sent", STEP_SUPERSEDED],
    "m1:step:pay#2": ["sent", '{"v":"ok"}'],
  });
  expect(ev.ambiguous).toEqual([]);
  expect(ev.dead).toEqual([]);
});

test("t6: a message admitted without its record (failOpen) still journals its steps: a redelivery does not run them again", async () => {
  const backend = new MemoryDurability();
  let down = false;
  const admit = async (...args: Parameters<DurabilityBackend["inbox"]["admit"]>) => {
    if (down) throw new Error("ECONNREFUSED");
    return await backend.inbox.admit(...args);
  };
  const wrapped = faulty(backend, { admit }, {});
  let charges = 0;
  let runs = 0;
  const handler = async (ctx: Parameters<Parameters<Bot["when"]>[1]>[0]) => {
    try {
      const r = await ctx.step("pay", () => ({ charge: ++charges }));
      await ctx.reply(`charged #${r.charge}`);
    } finally {
      runs++;
    }
  };
  const p1 = new MockProvider();
  const bot1 = new Bot({ provider: p1, durability: { ...config(wrapped, "a"), failOpen: true } });
  watch(bot1);
  bot1.when(() => true, handler);
  await started(bot1);
  await p1.receive({ id: "m1", chatId: "c1", text: "pay" });
  await settledInbound(backend, "m1");
  await bot1.idle();
  expect(runs).toBe(1);
  down = true; // the channel redelivers m1 while the inbox journal cannot admit (the outbox works)
  const p2 = new MockProvider();
  const bot2 = new Bot({ provider: p2, durability: { ...config(wrapped, "b"), failOpen: true } });
  watch(bot2);
  bot2.when(() => true, handler);
  await started(bot2);
  const admission = await p2.receive({ id: "m1", chatId: "c1", text: "pay" });
  expect(admission.status).toBe("unjournaled");
  await until(() => runs === 2, "the unjournaled run of m1");
  await bot2.idle();
  expect(charges).toBe(1);
  expect(p1.sent.map((s) => s.content)).toEqual(["charged #1"]);
  expect(p2.sent).toEqual([]); // its reply is the journaled one, already sent
  expect(await steps(backend)).toEqual({ "m1:step:pay": ["sent", '{"v":{"charge":1}}'] });
});

test("t7: a late reply to markCalling is confirmed before the call: a lease lapsed meanwhile means no call", async () => {
  const backend = new MemoryDurability();
  let partitioned = false;
  let delayed = false;
  const markCalling = async (key: string, token: number, leaseMs: number) => {
    const held = await backend.outbox.markCalling(key, token, leaseMs);
    if (!delayed && key.includes(":step:")) {
      // Committed; then A is cut off (its heartbeats fail) and the reply comes only after B's sweep took
      // the attempt for cut off during its call.
      delayed = true;
      partitioned = true;
      await untilAsync(async () => (await backend.outbox.get(key))?.state === "unknown", "B's sweep to take the attempt up");
      partitioned = false;
    }
    return held;
  };
  const heartbeat = (journal: { heartbeat: (...a: never[]) => Promise<boolean> }) => async (...a: never[]) => {
    if (partitioned) throw new Error("network partition");
    return await journal.heartbeat(...a);
  };
  const backendA = faulty(backend, { heartbeat: heartbeat(backend.inbox) }, { markCalling, heartbeat: heartbeat(backend.outbox) });
  const pa = new MockProvider();
  const pb = new MockProvider();
  const a = new Bot({ provider: pa, durability: config(backendA, "A", { sweepIntervalMs: 60_000 }) });
  const b = new Bot({ provider: pb, durability: config(backend, "B") });
  watch(a);
  const evB = watch(b);
  const charged: string[] = [];
  let aDone = false;
  a.when(() => true, async (ctx) => {
    try {
      await ctx.step("pay", () => {
        charged.push("A");
        return "charged";
      });
    } finally {
      aDone = true;
    }
  });
  b.when(() => true, async (ctx) => {
    await ctx.step("pay", () => {
      charged.push("B");
      return "charged";
    });
  });
  await started(a);
  void pa.receive({ id: "m1", chatId: "c1", text: "pay" });
  await until(() => delayed, "A's markCalling");
  await started(b);
  await until(() => aDone, "A's handler to end");
  await settledInbound(backend, "m1");
  await b.idle();
  // The attempt is held as cut off (B reported it); the card was never charged behind that report.
  expect(charged).toEqual([]);
  expect(await steps(backend)).toEqual({ "m1:step:pay": ["unknown", null] });
  expect(evB.ambiguous.map((e) => e.key)).toEqual(["m1:step:pay"]);
  expect(await inboundState(backend, "m1")).toBe("dead");
});

test("t8: a purged earlier attempt does not let a held ambiguous step run again on a replay", async () => {
  let offset = 0;
  const shared = new MemoryDurability({ clock: () => Date.now() + offset });
  const a = crashable(shared);
  a.crashBefore("outbox.markCalling"); // attempt 1 reserved, never called: settled as not run
  const provider = new MockProvider();
  let charges = 0;
  const handler = async (ctx: Parameters<Parameters<Bot["when"]>[1]>[0]) => {
    await ctx.step("pay", () => {
      charges++;
      throw new ProviderError("gateway timeout after the request went out", { maybeDelivered: true });
    });
  };
  const botA = new Bot({ provider, durability: config(a, "A") });
  watch(botA);
  botA.when(() => true, handler);
  await started(botA);
  void provider.receive({ id: "m1", chatId: "c1", text: "pay" });
  await until(() => a.crashed, "A to die before announcing the call");
  const bot = new Bot({ provider, durability: config(shared, "B") });
  const ev = watch(bot);
  bot.when(() => true, handler);
  await started(bot);
  await untilAsync(async () => (await inboundState(shared, "m1")) === "dead", "m1 dead-lettered");
  await bot.idle();
  expect(charges).toBe(1);
  expect(await steps(shared)).toEqual({ "m1:step:pay": ["sent", STEP_NOT_RUN], "m1:step:pay#2": ["unknown", null] });
  offset += 8 * 86_400_000; // the message waits in the dead letters past the retention
  expect(await shared.outbox.purge(7 * 86_400_000)).toBe(1);
  expect(await steps(shared)).toEqual({ "m1:step:pay#2": ["unknown", null] });
  // An operator replays it without settling the step.
  expect(await bot.durability!.replayInbound("m1")).toBe(true);
  await untilAsync(async () => (await inboundState(shared, "m1")) === "dead", "the replay dead-lettered");
  await bot.idle();
  expect(charges).toBe(1);
  expect(await steps(shared)).toEqual({ "m1:step:pay#2": ["unknown", null] });
  expect(new Set(ev.ambiguous.map((e) => e.key))).toEqual(new Set(["m1:step:pay#2"]));
  expect(ev.dead.filter((e) => e.kind === "inbound").map((e) => e.error)).toEqual([
    expect.stringContaining("StepAmbiguousError"),
    expect.stringContaining("StepAmbiguousError"),
  ]);
});
