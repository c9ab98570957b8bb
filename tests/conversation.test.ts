// Conversations: ctx.ask() in process, across restarts (a new Bot on the same backend and store),
// timeouts, match filters, divergence on replay, step failures, misuse and damaged transcripts.
import { describe, expect, test } from "bun:test";
import { AskTimeoutError, Bot, type Context, MemoryDurability, MemoryStore, type SessionStore, TEXT } from "../mod.ts";
import type { DurabilityBackend } from "../src/contract.ts";
import type { BotEvents } from "../src/engine.ts";
import { type CrashPoint, crashable, crashableStore } from "../src/testing/crashable.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { MockProvider } from "../src/testing/mock_provider.ts";

const fast = (backend: DurabilityBackend, instanceId = "conv-1") => ({
  backend,
  instanceId,
  sweepIntervalMs: 20,
  inbox: { leaseMs: 300, retries: 3, backoff: { baseMs: 2, capMs: 10 } },
  outbox: { leaseMs: 300, retries: 3, backoff: { baseMs: 2, capMs: 10 } },
});

/** A store that is "durable" for the bot (not a MemoryStore instance) but lives in this process. */
class KeptStore implements SessionStore {
  readonly inner = new MemoryStore();
  readonly writes: string[] = [];
  get(key: string) {
    return this.inner.get(key);
  }
  set(key: string, value: Parameters<SessionStore["set"]>[1], options?: { ttlMs?: number }) {
    this.writes.push(key);
    return this.inner.set(key, value, options);
  }
  delete(key: string) {
    return this.inner.delete(key);
  }
}

type Form = (ctx: Context) => Promise<unknown>;

const form: Form = async (ctx) => {
  const name = await ctx.ask("Name?");
  const age = await ctx.ask(`Age, ${name.text}?`);
  const city = await ctx.ask("City?");
  await ctx.reply(`Done: ${name.text}, ${age.text}, ${city.text}`);
};

function makeBot(
  backend: DurabilityBackend | null,
  store: SessionStore | undefined,
  handler: Form = form,
  provider = new MockProvider(),
  instanceId?: string,
) {
  const bot = new Bot({ provider, store, ...(backend ? { durability: fast(backend, instanceId) } : {}) });
  const warnings: BotEvents["warning"][] = [];
  const errors: Error[] = [];
  bot.on("warning", (w) => warnings.push(w));
  bot.on("error", (e) => errors.push(e));
  bot.when("form", handler);
  bot.when(() => true, (ctx) => ctx.reply(`echo ${ctx.message.text ?? ctx.message.type}`));
  return { bot, provider, warnings, errors };
}

const sent = (p: MockProvider) => p.sent.map((s) => [s.idempotencyKey, s.content]);

describe("ctx.ask", () => {
  test("a 3-step form in one process, without durability: each step's sends keyed by the message that fed it", async () => {
    const { bot, provider } = makeBot(null, undefined);
    await bot.start();
    for (const [id, text] of [["m0", "form"], ["m1", "Ann"], ["m2", "33"], ["m3", "Paris"], ["m4", "hi"]]) {
      await provider.receive({ id, chatId: "c", text });
    }
    await bot.idle();
    expect(sent(provider)).toEqual([
      ["m0:1", "Name?"],
      ["m1:1", "Age, Ann?"],
      ["m2:1", "City?"],
      ["m3:1", "Done: Ann, 33, Paris"],
      ["m4:1", "echo hi"],
    ]);
    await bot.stop();
  });

  test("chats are independent: each has its own conversation", async () => {
    const { bot, provider } = makeBot(new MemoryDurability(), new KeptStore());
    await bot.start();
    await provider.receive({ id: "a0", chatId: "a", text: "form" });
    await provider.receive({ id: "b0", chatId: "b", text: "form" });
    await provider.receive({ id: "b1", chatId: "b", text: "Bo" });
    await provider.receive({ id: "a1", chatId: "a", text: "Al" });
    await bot.idle();
    expect(sent(provider).filter(([k]) => String(k).endsWith(":1")).map(([, c]) => c).sort()).toEqual(
      ["Age, Al?", "Age, Bo?", "Name?", "Name?"],
    );
    await bot.stop();
  });

  test("a pending ask survives a restart: the handler is replayed, no prompt goes out twice", async () => {
    const backend = new MemoryDurability();
    const store = new KeptStore();
    const a = makeBot(backend, store);
    await a.bot.start();
    await a.provider.receive({ id: "m0", chatId: "c", text: "form" });
    await a.provider.receive({ id: "m1", chatId: "c", text: "Ann" });
    await a.bot.idle();
    await a.bot.stop();
    expect(sent(a.provider)).toEqual([["m0:1", "Name?"], ["m1:1", "Age, Ann?"]]);

    const b = makeBot(backend, store);
    await b.bot.start();
    await b.provider.receive({ id: "m2", chatId: "c", text: "33" });
    await b.provider.receive({ id: "m3", chatId: "c", text: "Paris" });
    await b.bot.idle();
    expect(sent(b.provider)).toEqual([["m2:1", "City?"], ["m3:1", "Done: Ann, 33, Paris"]]);
    const m = b.bot.durability!.metrics();
    expect(m.conversationsReplayed).toBe(1);
    expect(m.conversationsDiverged).toBe(0);
    expect(m.outboxDeduped).toBe(2); // the replayed prompts, answered from the outbox
    expect(b.warnings).toEqual([]);
    // The finished conversation is recorded as ended by m3; the next message goes to the handlers.
    const stored = await store.get("botmesh:conversation:bot:c") as { state: string; endedBy: string };
    expect([stored.state, stored.endedBy]).toEqual(["ended", "m3"]);
    await b.provider.receive({ id: "m4", chatId: "c", text: "hello" });
    await b.bot.idle();
    expect(sent(b.provider).at(-1)).toEqual(["m4:1", "echo hello"]);
    await b.bot.stop();
  });

  test("a message that does not match the pending ask's `match` goes to the normal handlers", async () => {
    const handler: Form = async (ctx) => {
      const answer = await ctx.ask("Type your name", { match: TEXT });
      await ctx.reply(`Hi ${answer.text}`);
    };
    const { bot, provider } = makeBot(new MemoryDurability(), new KeptStore(), handler);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await provider.receive({ id: "m1", chatId: "c", media: { type: "image", data: "x" } });
    await provider.receive({ id: "m2", chatId: "c", text: "Ann" });
    await bot.idle();
    expect(sent(provider)).toEqual([["m0:1", "Type your name"], ["m1:1", "echo image"], ["m2:1", "Hi Ann"]]);
    await bot.stop();
  });

  test("a filtered ask is replayed after a restart to test the next message", async () => {
    const handler: Form = async (ctx) => {
      const answer = await ctx.ask("Type your name", { match: TEXT });
      await ctx.reply(`Hi ${answer.text}`);
    };
    const backend = new MemoryDurability();
    const store = new KeptStore();
    const a = makeBot(backend, store, handler);
    await a.bot.start();
    await a.provider.receive({ id: "m0", chatId: "c", text: "form" });
    await a.bot.idle();
    await a.bot.stop();
    const b = makeBot(backend, store, handler);
    await b.bot.start();
    await b.provider.receive({ id: "m1", chatId: "c", media: { type: "image", data: "x" } });
    await b.provider.receive({ id: "m2", chatId: "c", text: "Ann" });
    await b.bot.idle();
    expect(sent(b.provider)).toEqual([["m1:1", "echo image"], ["m2:1", "Hi Ann"]]);
    expect(b.bot.durability!.metrics().conversationsReplayed).toBe(1);
    await b.bot.stop();
  });

  test("a timeout raises AskTimeoutError in the handler; its sends are keyed <flow>:t<step>:<n>", async () => {
    const handler: Form = async (ctx) => {
      try {
        await ctx.ask("Quick, your name?", { timeoutMs: 60 });
        await ctx.reply("thanks");
      } catch (error) {
        expect(error).toBeInstanceOf(AskTimeoutError);
        expect((error as AskTimeoutError).timeoutMs).toBe(60);
        await ctx.reply("too slow");
      }
    };
    const { bot, provider } = makeBot(new MemoryDurability(), new KeptStore(), handler);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await bot.idle();
    const end = Date.now() + 3000;
    while (provider.sent.length < 2 && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
    await bot.idle();
    await provider.receive({ id: "m1", chatId: "c", text: "Ann" });
    await bot.idle();
    expect(sent(provider)).toEqual([["m0:1", "Quick, your name?"], ["m0:t1:1", "too slow"], ["m1:1", "echo Ann"]]);
    await bot.stop();
  });

  test("a deadline that passed while no process held the flow fires before the next message is handled", async () => {
    const handler: Form = async (ctx) => {
      try {
        const name = await ctx.ask("Name?", { timeoutMs: 80 });
        await ctx.reply(`Hi ${name.text}`);
      } catch (error) {
        if (!(error instanceof AskTimeoutError)) throw error;
        const again = await ctx.ask("Too slow. Name, please?");
        await ctx.reply(`Hi ${again.text}, at last`);
      }
    };
    const backend = new MemoryDurability();
    const store = new KeptStore();
    const a = makeBot(backend, store, handler);
    await a.bot.start();
    await a.provider.receive({ id: "m0", chatId: "c", text: "form" });
    await a.bot.idle();
    await a.bot.stop(); // its timer goes with it
    await new Promise((r) => setTimeout(r, 120));
    const b = makeBot(backend, store, handler);
    await b.bot.start();
    await b.provider.receive({ id: "m1", chatId: "c", text: "Ann" });
    await b.bot.idle();
    // The timeout step runs first (it asks again), then m1 answers the new ask.
    expect(sent(b.provider)).toEqual([["m0:t1:1", "Too slow. Name, please?"], ["m1:1", "Hi Ann, at last"]]);
    await b.bot.stop();
  });

  test("an ask's timeout is journaled: a process with another instanceId fires it after a restart, with no new message", async () => {
    const handler: Form = async (ctx) => {
      try {
        await ctx.ask("Name?", { timeoutMs: 250 });
      } catch (error) {
        if (!(error instanceof AskTimeoutError)) throw error;
        await ctx.reply("Timed out; send form to start again.");
      }
    };
    const backend = new MemoryDurability();
    const store = new KeptStore();
    const a = makeBot(backend, store, handler);
    await a.bot.start();
    await a.provider.receive({ id: "m0", chatId: "c", text: "form" });
    await a.bot.idle(); // an ask waiting for its answer is not work under way
    await a.bot.stop();
    const timer = await backend.inbox.get("m0:t1");
    expect(timer?.state, "due in the inbox at the deadline, blocking nothing").toBe("scheduled");
    expect(timer?.error, "not a failure").toBe(null);
    expect(timer?.chatId).toBe("c");
    const b = makeBot(backend, store, handler, new MockProvider(), "conv-2");
    await b.bot.start();
    const end = Date.now() + 5000;
    while (b.provider.sent.length === 0 && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
    await b.bot.idle();
    expect(sent(b.provider)).toEqual([["m0:t1:1", "Timed out; send form to start again."]]);
    expect((await backend.inbox.get("m0:t1"))?.state).toBe("done");
    expect(await store.get("botmesh:conversation:bot:c")).toMatchObject({ state: "ended", endedBy: "m0:t1" });
    await b.bot.stop();
  });

  test("a replay whose prompt differs is reported (warning + metric) and uses the recorded answer", async () => {
    let deploy = 1;
    const handler: Form = async (ctx) => {
      const name = await ctx.ask(deploy === 1 ? "Name?" : "Your name?"); // not deterministic
      const age = await ctx.ask("Age?");
      await ctx.reply(`${name.text}/${age.text}`);
    };
    const backend = new MemoryDurability();
    const store = new KeptStore();
    const a = makeBot(backend, store, handler);
    await a.bot.start();
    await a.provider.receive({ id: "m0", chatId: "c", text: "form" });
    await a.provider.receive({ id: "m1", chatId: "c", text: "Ann" });
    await a.bot.idle();
    await a.bot.stop();
    deploy = 2;
    const b = makeBot(backend, store, handler);
    await b.bot.start();
    await b.provider.receive({ id: "m2", chatId: "c", text: "33" });
    await b.bot.idle();
    expect(sent(b.provider)).toEqual([["m2:1", "Ann/33"]]);
    const m = b.bot.durability!.metrics();
    expect(m.conversationsDiverged).toBe(1);
    expect(m.outboxDiverged).toBe(1); // the changed prompt under its old key was not sent
    const diverged = b.warnings.filter((w) => w.code === "conversation-diverged");
    expect(diverged).toHaveLength(1);
    expect(diverged[0]!.message).toContain('"m0"');
    expect(diverged[0]!.chatId).toBe("c");
    await b.bot.stop();
  });

  test("a replay that returns before the waiting ask is reported, and the message goes to the handlers", async () => {
    let asks = 2;
    const handler: Form = async (ctx) => {
      for (let i = 0; i < asks; i++) await ctx.ask(`Q${i + 1}?`);
      await ctx.reply("over");
    };
    const backend = new MemoryDurability();
    const store = new KeptStore();
    const a = makeBot(backend, store, handler);
    await a.bot.start();
    await a.provider.receive({ id: "m0", chatId: "c", text: "form" });
    await a.provider.receive({ id: "m1", chatId: "c", text: "one" });
    await a.bot.idle();
    await a.bot.stop();
    asks = 1;
    const b = makeBot(backend, store, handler);
    await b.bot.start();
    await b.provider.receive({ id: "m2", chatId: "c", text: "two" });
    await b.bot.idle();
    expect(b.bot.durability!.metrics().conversationsDiverged).toBe(1);
    expect(b.warnings.map((w) => w.code)).toContain("conversation-diverged");
    // The replay's "over" reuses key m1:1 (Q2's): answered from the outbox, not sent, and reported too.
    expect(sent(b.provider)).toEqual([["m2:1", "echo two"]]);
    expect(b.bot.durability!.metrics().outboxDiverged).toBe(1);
    await b.bot.stop();
  });

  test("a step that throws is retried with backoff; the retry replays the flow and asks nothing twice", async () => {
    let failures = 1;
    const handler: Form = async (ctx) => {
      const name = await ctx.ask("Name?");
      if (failures-- > 0) throw new Error("lookup failed");
      await ctx.ask(`Age, ${name.text}?`);
      await ctx.reply("ok");
    };
    const { bot, provider, warnings } = makeBot(new MemoryDurability(), new KeptStore(), handler);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await provider.receive({ id: "m1", chatId: "c", text: "Ann" });
    await bot.idle();
    await provider.receive({ id: "m2", chatId: "c", text: "33" });
    await bot.idle();
    expect(sent(provider)).toEqual([["m0:1", "Name?"], ["m1:1", "Age, Ann?"], ["m2:1", "ok"]]);
    expect(warnings.map((w) => w.code)).toContain("handler-retry");
    expect(bot.durability!.metrics().conversationsReplayed).toBe(1);
    expect((await bot.durability!.inbox.get("m1"))?.attempts).toBe(2);
    await bot.stop();
  });

  test("a crash after the transcript was written but before the message was done: the reprocess asks nothing again", async () => {
    const shared = new MemoryDurability();
    const store = new KeptStore();
    const a = crashable(shared);
    a.crashBefore("inbox.complete", { at: 2 }); // m1's completion
    const botA = makeBot(a, store);
    await botA.bot.start();
    await botA.provider.receive({ id: "m0", chatId: "c", text: "form" });
    await botA.provider.receive({ id: "m1", chatId: "c", text: "Ann" });
    const end = Date.now() + 3000;
    while (!a.crashed && Date.now() < end) await new Promise((r) => setTimeout(r, 5));
    expect(a.crashed).toBe(true);
    await botA.bot.stop().catch(() => {});
    expect(sent(botA.provider)).toEqual([["m0:1", "Name?"], ["m1:1", "Age, Ann?"]]);

    const b = makeBot(shared, store);
    await b.bot.start(); // recovery reprocesses m1: its step is in the transcript already
    await b.bot.idle();
    expect((await shared.inbox.get("m1"))?.state).toBe("done");
    for (const [id, text] of [["m0", "form"], ["m1", "Ann"], ["m2", "33"], ["m3", "Paris"]]) {
      await b.provider.receive({ id, chatId: "c", text });
    }
    await b.bot.idle();
    expect(sent(b.provider)).toEqual([["m2:1", "City?"], ["m3:1", "Done: Ann, 33, Paris"]]);
    await b.bot.stop();
  });

  test("an AskTimeoutError the handler does not catch ends the conversation (reported); the chat is not blocked", async () => {
    const handler: Form = async (ctx) => {
      const name = await ctx.ask("Name?", { timeoutMs: 60 }); // no try/catch
      await ctx.reply(`Hi ${name.text}`);
    };
    const store = new KeptStore();
    const { bot, provider, errors } = makeBot(new MemoryDurability(), store, handler);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await bot.idle();
    const end = Date.now() + 3000;
    while (errors.length === 0 && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
    await bot.idle();
    expect(errors.map((e) => e.message).join("\n")).toMatch(/was ended: its timeout step failed: No answer within 60 ms/);
    expect((await store.get("botmesh:conversation:bot:c") as { state: string }).state).toBe("ended");
    await provider.receive({ id: "m1", chatId: "c", text: "hello" });
    await bot.idle();
    expect(sent(provider)).toEqual([["m0:1", "Name?"], ["m1:1", "echo hello"]]);
    expect((await bot.durability!.inbox.get("m1"))?.state).toBe("done");
    await bot.stop();
  });

  test("a step that fails keeps its place: an answer sent during its retry backoff queues behind it", async () => {
    let failures = 1;
    const handler: Form = async (ctx) => {
      const name = await ctx.ask("Name?");
      if (failures-- > 0) throw new Error("lookup failed");
      const age = await ctx.ask(`Age, ${name.text}?`);
      await ctx.reply(`name=${name.text} age=${age.text}`);
    };
    const provider = new MockProvider();
    const bot = new Bot({
      provider,
      store: new KeptStore(),
      durability: { ...fast(new MemoryDurability()), inbox: { leaseMs: 300, retries: 3, backoff: { baseMs: 150, capMs: 150 } } },
    });
    bot.when("form", handler);
    bot.when(() => true, (ctx) => ctx.reply(`echo ${ctx.message.text}`));
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await provider.receive({ id: "m1", chatId: "c", text: "Ann" }); // its step fails once: retried after ≥ 150 ms
    await provider.receive({ id: "m2", chatId: "c", text: "33" }); // arrives before that retry
    await bot.idle();
    expect(sent(provider)).toEqual([["m0:1", "Name?"], ["m1:1", "Age, Ann?"], ["m2:1", "name=Ann age=33"]]);
    await bot.stop();
  });

  test("a step that fails on its last attempt ends the conversation; what was queued goes to the handlers", async () => {
    const handler: Form = async (ctx) => {
      await ctx.ask("Name?");
      throw new Error("always fails");
    };
    const provider = new MockProvider();
    const errors: Error[] = [];
    const bot = new Bot({
      provider,
      store: new KeptStore(),
      durability: { ...fast(new MemoryDurability()), inbox: { leaseMs: 300, retries: 1, backoff: { baseMs: 100, capMs: 100 } } },
    });
    bot.on("error", (e) => errors.push(e));
    bot.when("form", handler);
    bot.when(() => true, (ctx) => ctx.reply(`echo ${ctx.message.text}`));
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await provider.receive({ id: "m1", chatId: "c", text: "Ann" });
    await provider.receive({ id: "m2", chatId: "c", text: "later" });
    await bot.idle();
    expect((await bot.durability!.inbox.get("m1"))?.state).toBe("dead");
    expect((await bot.durability!.inbox.get("m2"))?.state).toBe("done");
    expect(sent(provider)).toEqual([["m0:1", "Name?"], ["m2:1", "echo later"]]);
    expect(errors.map((e) => e.message).join("\n")).toContain("failed on its last attempt: always fails");
    await provider.receive({ id: "m3", chatId: "c", text: "hi" });
    await bot.idle();
    expect(sent(provider).at(-1)).toEqual(["m3:1", "echo hi"]);
    await bot.stop();
  });

  // Each on an in-process journal, and on a SQLite file that the recovering process opens anew.
  const journals: Record<string, () => { first: DurabilityBackend; next: () => DurabilityBackend; done: () => void }> = {
    memory: () => {
      const shared = new MemoryDurability();
      return { first: shared, next: () => shared, done: () => {} };
    },
    sqlite: () => {
      const dir = mkdtempSync(join(tmpdir(), "botmesh-conv-"));
      const file = join(dir, "bot.db");
      return { first: new SQLiteDurability({ file }), next: () => new SQLiteDurability({ file }), done: () => rmSync(dir, { recursive: true, force: true }) };
    },
  };
  const timerCrashes: readonly (readonly [CrashPoint, number, "before" | "after"])[] = [
    ["store.set", 1, "after"], // the transcript is written, the timer not yet journaled
    ["inbox.admit", 2, "before"], // 1: the message, 2: the timer
    ["inbox.admit", 2, "after"], // journaled leased, not armed: its lease lapses, a sweep arms it
    ["inbox.schedule", 1, "before"],
    ["inbox.schedule", 1, "after"], // armed, the step not yet done: the reprocess finds it journaled
  ];
  for (const [journal, [point, at, when]] of Object.keys(journals).flatMap((journal) => timerCrashes.map((c) => [journal, c] as const))) {
    test(`${journal}: a crash ${when} ${point} (${at}) while an ask's timer is journaled: the timeout fires once after recovery`, async () => {
      const handler: Form = async (ctx) => {
        try {
          await ctx.ask("Name?", { timeoutMs: 200 });
        } catch (error) {
          if (!(error instanceof AskTimeoutError)) throw error;
          await ctx.reply("timed out");
        }
      };
      const opened = journals[journal]!();
      const store = new KeptStore();
      const a = crashable(opened.first);
      if (when === "before") a.crashBefore(point, { at });
      else a.crashAfter(point, { at });
      const botA = makeBot(a, crashableStore(a, store), handler);
      await botA.bot.start();
      await botA.provider.receive({ id: "m0", chatId: "c", text: "form" });
      const end = Date.now() + 3000;
      while (!a.crashed && Date.now() < end) await new Promise((r) => setTimeout(r, 5));
      expect(a.crashed).toBe(true);
      await botA.bot.stop().catch(() => {});

      const shared = opened.next();
      const b = makeBot(shared, store, handler);
      await b.bot.start(); // recovery reprocesses m0 (its step recorded or not) or arms the lapsed timer
      const until = Date.now() + 3000;
      while (!b.provider.sent.some((s) => s.content === "timed out") && Date.now() < until) {
        await new Promise((r) => setTimeout(r, 10));
      }
      await b.bot.idle();
      const all = [...sent(botA.provider), ...sent(b.provider)];
      expect(all.filter(([, content]) => content === "timed out")).toEqual([["m0:t1:1", "timed out"]]);
      expect(all.filter(([, content]) => content === "Name?").length, "the question once (or a reported resend)").toBeGreaterThanOrEqual(1);
      expect((await shared.inbox.get("m0:t1"))?.state).toBe("done");
      expect((await shared.inbox.get("m0"))?.state).toBe("done");
      await b.bot.stop();
      await opened.first.close?.();
      opened.done();
    });
  }

  test("a timer taken up before its deadline spends none of its step's attempts: with inbox.retries 1 a timeout step that fails once is retried", async () => {
    let timeouts = 0;
    const handler: Form = async (ctx) => {
      try {
        await ctx.ask("Name?", { timeoutMs: 900 });
      } catch (error) {
        if (!(error instanceof AskTimeoutError)) throw error;
        if (++timeouts === 1) throw new Error("the timeout step fails once");
        await ctx.reply("timed out");
      }
    };
    const shared = new MemoryDurability();
    const store = new KeptStore();
    const retryOnce = { leaseMs: 300, retries: 1, backoff: { baseMs: 20, capMs: 20 } };
    // The process dies right after journaling the timer, before arming it: its lease lapses long before
    // the deadline, and the next process's sweep takes it up early (and arms it again).
    const a = crashable(shared);
    a.crashAfter("inbox.admit", { at: 2 });
    const providerA = new MockProvider();
    const botA = new Bot({ provider: providerA, store: crashableStore(a, store), durability: { ...fast(a), inbox: retryOnce } });
    botA.on("error", () => {});
    botA.when("form", handler);
    await botA.start();
    await providerA.receive({ id: "m0", chatId: "c", text: "form" });
    const end = Date.now() + 3000;
    while (!a.crashed && Date.now() < end) await new Promise((r) => setTimeout(r, 5));
    expect(a.crashed).toBe(true);
    await botA.stop().catch(() => {});

    const provider = new MockProvider();
    const errors: Error[] = [];
    const bot = new Bot({ provider, store, durability: { ...fast(shared), inbox: retryOnce } });
    bot.on("error", (e) => errors.push(e));
    bot.when("form", handler);
    await bot.start();
    const until = Date.now() + 5000;
    while (!provider.sent.some((m) => m.content === "timed out") && Date.now() < until) await new Promise((r) => setTimeout(r, 10));
    await bot.idle();
    expect(timeouts, "the timeout step ran twice: its first run failed, its retry replied").toBe(2);
    expect(sent(provider).filter(([, content]) => content === "timed out")).toEqual([["m0:t1:1", "timed out"]]);
    expect((await shared.inbox.get("m0:t1"))?.state).toBe("done");
    await bot.stop();
  });

  test("a timer left by an ended conversation does not time out the next one at the same step", async () => {
    const started: Record<string, number> = {};
    const handler: Form = async (ctx) => {
      started[ctx.inboundId] = Date.now();
      try {
        const a = await ctx.ask("Name?", { timeoutMs: 400 });
        await ctx.reply(`hi ${a.text}`);
      } catch (error) {
        if (!(error instanceof AskTimeoutError)) throw error;
        await ctx.reply(`timed out after ${Date.now() - started[ctx.inboundId]!} ms`);
      }
    };
    const backend = new MemoryDurability();
    const { bot, provider } = makeBot(backend, new KeptStore(), handler);
    await bot.start();
    await provider.receive({ id: "f1", chatId: "c", text: "form" });
    await provider.receive({ id: "f2", chatId: "c", text: "Ann" }); // answered: f1's conversation ends
    await bot.idle();
    await new Promise((r) => setTimeout(r, 200));
    await provider.receive({ id: "g1", chatId: "c", text: "form" }); // asks at step 1, as f1 did
    const end = Date.now() + 3000;
    while (!provider.sent.some((s) => String(s.content).startsWith("timed out")) && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
    await bot.idle();
    const timedOut = provider.sent.find((s) => String(s.content).startsWith("timed out"))!;
    expect(timedOut.idempotencyKey).toBe("g1:t1:1");
    expect(Number(/after (\d+) ms/.exec(String(timedOut.content))![1]), "g1's own deadline, not f1's").toBeGreaterThanOrEqual(390);
    expect((await backend.inbox.get("f1:t1"))?.state, "f1's timer fired and found nothing to do").toBe("done");
    await bot.stop();
  });

  test("a handler that lets AskTimeoutError through ends its conversation at once: no retries, the next message is not held up", async () => {
    const handler: Form = async (ctx) => {
      await ctx.ask("Name?", { timeoutMs: 100 }); // an uncaught AskTimeoutError is the handler's answer
    };
    const backend = new MemoryDurability();
    const { bot, provider, warnings, errors } = makeBot(backend, new KeptStore(), handler);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    const end = Date.now() + 3000;
    while ((await backend.inbox.get("m0:t1"))?.state !== "done" && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
    expect((await backend.inbox.get("m0:t1"))?.state).toBe("done");
    expect(warnings.filter((w) => w.code === "handler-retry")).toEqual([]);
    expect(errors.map((e) => e.message).filter((m) => m.includes("was ended"))).toHaveLength(1);
    await provider.receive({ id: "m1", chatId: "c", text: "hello" });
    await bot.idle();
    expect(sent(provider)).toEqual([["m0:1", "Name?"], ["m1:1", "echo hello"]]);
    await bot.stop();
  });

  test("timers armed in one process fire on time whatever order they were armed in (sweep interval far longer)", async () => {
    const fired: Record<string, number> = {};
    const asked: Record<string, number> = {};
    const bot = new Bot({
      provider: new MockProvider(),
      store: new KeptStore(),
      durability: { backend: new MemoryDurability(), instanceId: "timers", sweepIntervalMs: 60_000 },
    });
    bot.when("form", async (ctx) => {
      const timeoutMs = ctx.chatId === "late" ? 700 : 200;
      asked[ctx.chatId] = Date.now();
      try {
        await ctx.ask("Name?", { timeoutMs });
      } catch (error) {
        if (!(error instanceof AskTimeoutError)) throw error;
        fired[ctx.chatId] = Date.now() - asked[ctx.chatId]!;
      }
    });
    await bot.start();
    const provider = bot.provider as MockProvider;
    await provider.receive({ id: "l0", chatId: "late", text: "form" }); // armed first, due last
    await provider.receive({ id: "s0", chatId: "soon", text: "form" });
    const end = Date.now() + 5000;
    while (Object.keys(fired).length < 2 && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
    expect(fired.soon).toBeGreaterThanOrEqual(190);
    expect(fired.late).toBeGreaterThanOrEqual(690);
    expect(fired.late, "not left for the next periodic sweep (60 s)").toBeLessThan(3000);
    await bot.stop();
  });

  test("idle() sees a retry behind more waiting asks than one read of the failed records holds", async () => {
    let failOnce = true;
    const bot = new Bot({ provider: new MockProvider(), store: new KeptStore(), durability: fast(new MemoryDurability()) });
    bot.on("warning", () => {});
    bot.when("form", async (ctx) => {
      await ctx.ask("Name?", { timeoutMs: 3_600_000 }).catch(() => {});
    });
    bot.when(() => true, async (ctx) => {
      if (failOnce) {
        failOnce = false;
        throw new Error("fails once");
      }
      await ctx.reply("done");
    });
    await bot.start();
    const provider = bot.provider as MockProvider;
    for (let i = 0; i < 205; i++) await provider.receive({ id: `a${String(i).padStart(3, "0")}`, chatId: `c${i}`, text: "form" });
    await bot.idle(); // 205 timers waiting: not work
    await provider.receive({ id: "z", chatId: "late", text: "hello" }); // fails once: a retry behind them all
    await bot.idle();
    expect(provider.sent.filter((s) => s.content === "done").length, "idle() waited for the retry").toBe(1);
    await bot.stop();
  });

  test("deadlines an earlier version kept in its index are journaled at start, and the index dropped", async () => {
    const handler: Form = async (ctx) => {
      try {
        await ctx.ask("Name?", { timeoutMs: 250 });
      } catch (error) {
        if (!(error instanceof AskTimeoutError)) throw error;
        await ctx.reply("timed out");
      }
    };
    const journaled = new MemoryDurability();
    // As an earlier version ran: no timer journaled (its admission dropped), the deadline in the instance's index.
    const inbox = journaled.inbox;
    const older = {
      name: journaled.name,
      scope: journaled.scope,
      outbox: journaled.outbox,
      inbox: new Proxy(inbox, {
        get: (target, prop) =>
          prop === "admit"
            ? (record: { id: string }, lease?: unknown) => (record.id.endsWith(":t1") ? Promise.resolve(null) : inbox.admit(record as never, lease as never))
            : (Reflect.get(target, prop) as (...args: unknown[]) => unknown).bind(target),
      }),
    };
    const store = new KeptStore();
    const a = makeBot(older, store, handler);
    await a.bot.start();
    await a.provider.receive({ id: "m0", chatId: "c", text: "form" });
    await a.bot.idle();
    await a.bot.stop();
    expect(await journaled.inbox.get("m0:t1")).toBe(null);
    const transcript = await store.get("botmesh:conversation:bot:c") as { asks: { deadline: number }[] };
    await store.set("botmesh:conversation-deadlines:bot:conv-1", { c: transcript.asks[0]!.deadline });
    const b = makeBot(journaled, store, handler);
    await b.bot.start();
    expect((await journaled.inbox.get("m0:t1"))?.state).toBe("scheduled");
    expect(await store.get("botmesh:conversation-deadlines:bot:conv-1")).toBe(undefined);
    const end = Date.now() + 3000;
    while (b.provider.sent.length === 0 && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
    await b.bot.idle();
    expect(sent(b.provider)).toEqual([["m0:t1:1", "timed out"]]);
    await b.bot.stop();
  });

  test("without timers (sweepIntervalMs 0), idle() after the deadline fires the due timer: a waiting timer is no work, a due one is", async () => {
    const handler: Form = async (ctx) => {
      try {
        await ctx.ask("Name?", { timeoutMs: 100 });
      } catch (error) {
        if (!(error instanceof AskTimeoutError)) throw error;
        await ctx.reply("timed out");
      }
    };
    const provider = new MockProvider();
    const bot = new Bot({ provider, store: new KeptStore(), durability: { ...fast(new MemoryDurability()), sweepIntervalMs: 0 } });
    bot.when("form", handler);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await bot.idle(); // the ask waits for its answer: no work
    expect(sent(provider)).toEqual([["m0:1", "Name?"]]);
    await new Promise((r) => setTimeout(r, 200));
    await bot.idle();
    expect(sent(provider)).toEqual([["m0:1", "Name?"], ["m0:t1:1", "timed out"]]);
    await bot.stop();
  });

  test("a timer is not an operator's to run early: a replay of it is refused, and it fires once at its deadline", async () => {
    const handler: Form = async (ctx) => {
      try {
        await ctx.ask("Name?", { timeoutMs: 400 });
      } catch (error) {
        if (!(error instanceof AskTimeoutError)) throw error;
        await ctx.reply("timed out");
      }
    };
    const backend = new MemoryDurability();
    const { bot, provider } = makeBot(backend, new KeptStore(), handler);
    await bot.start();
    const started = Date.now();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await bot.idle();
    expect(await bot.durability!.replayInbound("m0:t1")).toBe(false);
    expect((await backend.inbox.get("m0:t1"))?.state).toBe("scheduled");
    const end = Date.now() + 3000;
    while (provider.sent.length < 2 && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
    expect(Date.now() - started).toBeGreaterThanOrEqual(400);
    await bot.idle();
    expect(sent(provider)).toEqual([["m0:1", "Name?"], ["m0:t1:1", "timed out"]]);
    await bot.stop();
  });

  test("a timeoutMs beyond the retention is refused (the transcript would expire first)", async () => {
    const seen: unknown[] = [];
    const handler: Form = async (ctx) => {
      seen.push(await ctx.ask("x", { timeoutMs: 8 * 86_400_000 }).catch((e) => e));
    };
    const { bot, provider } = makeBot(new MemoryDurability(), new KeptStore(), handler);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await bot.idle();
    expect(String(seen[0])).toMatch(/RangeError: Option "timeoutMs" of ctx.ask\(\) must not exceed durability.retention \(604800000 ms\)/);
    await bot.stop();
  });

  test("misuse is refused with errors that name the option", async () => {
    const seen: unknown[] = [];
    const handler: Form = async (ctx) => {
      for (
        const bad of [
          () => ctx.ask("x", { timeoutMs: 0 }),
          () => ctx.ask("x", { timeoutMs: "5s" as never }),
          () => ctx.ask("x", { match: 42 as never }),
          () => ctx.ask("x", "soon" as never),
        ]
      ) {
        seen.push(await bad().catch((e) => e));
      }
      const first = ctx.ask("one?");
      seen.push(await ctx.ask("two?").catch((e) => e));
      await first;
    };
    const { bot, provider } = makeBot(new MemoryDurability(), new KeptStore(), handler);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await bot.idle();
    const messages = seen.map((e) => `${(e as Error).name}: ${(e as Error).message}`);
    expect(messages[0]).toMatch(/^RangeError: Option "timeoutMs" of ctx.ask\(\) must be a positive number, got 0/);
    expect(messages[1]).toMatch(/^RangeError: Option "timeoutMs".*"5s"/);
    expect(messages[2]).toMatch(/^TypeError: .*match/);
    expect(messages[3]).toMatch(/^TypeError: Argument "options" of ctx.ask\(\) must be an object/);
    expect(messages[4]).toMatch(/another ask of this handler is waiting/);
    await bot.stop();
  });

  test("with durability but no durable store, the first ask warns once that a pending ask is lost on restart", async () => {
    const { bot, provider, warnings } = makeBot(new MemoryDurability(), undefined);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await provider.receive({ id: "n0", chatId: "d", text: "form" });
    await bot.idle();
    expect(warnings.filter((w) => w.code === "conversation-not-durable")).toHaveLength(1);
    await bot.stop();
  });

  test("a damaged transcript is reported naming the field and set aside; the message goes to the handlers", async () => {
    const store = new KeptStore();
    await store.inner.set("botmesh:conversation:bot:c", { v: 1, handler: 0, steps: [{ message: { id: 7 } }], asks: [], state: "waiting", startedAt: 1 });
    const { bot, provider, errors } = makeBot(new MemoryDurability(), store);
    await bot.start();
    await provider.receive({ id: "m1", chatId: "c", text: "hello" });
    await bot.idle();
    expect(sent(provider)).toEqual([["m1:1", "echo hello"]]);
    expect(errors.map((e) => e.message).join("\n")).toContain('field "steps[0].message"');
    await bot.stop();
  });

  test("ctx.send to another chat inside a step is keyed by the step's message", async () => {
    const handler: Form = async (ctx) => {
      const answer = await ctx.ask("To whom?");
      await ctx.send(answer.text!, `Hello from ${ctx.chatId}`);
      await ctx.send(answer.text!, "again", { idempotencyKey: "explicit-1" });
    };
    const { bot, provider } = makeBot(new MemoryDurability(), new KeptStore(), handler);
    await bot.start();
    await provider.receive({ id: "m0", chatId: "c", text: "form" });
    await provider.receive({ id: "m1", chatId: "c", text: "other" });
    await bot.idle();
    expect(provider.sent.map((s) => [s.idempotencyKey, s.chatId])).toEqual([["m0:1", "c"], ["m1:1", "other"], ["explicit-1", "other"]]);
    await bot.stop();
  });
});
