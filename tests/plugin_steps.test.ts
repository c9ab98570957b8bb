// Durable steps in the grammY and Telegraf plugins: `safe.step()` (and grammY's `ctx.step` with
// `bot.use(safe.steps())`) runs once per update across a rerun of the middleware, its result reaching the
// reply; a step that fails for good dead-letters the update at once; outside the middleware it is
// refused. In a conversation of @grammyjs/conversations v2 (through `conversation.external()`), a step
// before and one after `conversation.wait()` run once each across the conversation's replays, each keyed
// by the update that fed it. On the memory and SQLite backends.
import { afterAll, beforeEach, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot as GrammyBot, type Context } from "grammy";
import { type Conversation, type ConversationFlavor, conversations, createConversation } from "@grammyjs/conversations";
import { Telegraf } from "telegraf";
import { StepFailedError } from "../mod.ts";
import { durable, durableConversations, durableStorage, type StepFlavor } from "../providers/grammy/mod.ts";
import { durable as durableTelegraf } from "../providers/telegraf/mod.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { cleanupsAfterEach, pluginTestDurability, sessionBackends } from "./support/plugin_tests.ts";

const dir = mkdtempSync(join(tmpdir(), "botmesh-plugin-steps-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const cleanups = cleanupsAfterEach();
const KINDS = sessionBackends(dir);
let kind = "memory";

function grammySetup<C extends Context>() {
  const fake = new FakeTelegram().start();
  const bot = new GrammyBot<C>(fake.token, {
    client: { apiRoot: fake.url },
    botInfo: { id: fake.botId, is_bot: true, first_name: "Fake", username: "fake_bot" } as never,
  });
  const { backend, store, close } = KINDS[kind]!();
  const safe = durable(bot, { durability: pluginTestDurability(backend, "grammy-steps", 3) });
  safe.on("error", () => {}); // the runs that fail on purpose
  cleanups.push(async () => {
    await safe.stop();
    await close();
    await fake.stop();
  });
  return { fake, bot, safe, store };
}

function telegrafSetup() {
  const fake = new FakeTelegram().start();
  const bot = new Telegraf(fake.token, { telegram: { apiRoot: fake.url } });
  const { backend, close } = KINDS[kind]!();
  const safe = durableTelegraf(bot, { durability: pluginTestDurability(backend, "telegraf-steps", 3) });
  safe.on("error", () => {});
  cleanups.push(async () => {
    await safe.stop();
    await close();
    await fake.stop();
  });
  return { fake, bot, safe };
}

/** Deliver one update and wait until it is handled (or dead-lettered). */
async function deliver(safe: { idle(): Promise<void> }, bot: { handleUpdate(update: never): Promise<void> }, update: Record<string, unknown>) {
  await bot.handleUpdate(update as never);
  await safe.idle();
}

const START = { entities: [{ type: "bot_command", offset: 0, length: 6 }] };

for (const name of Object.keys(KINDS)) describe(`steps in the grammY and Telegraf plugins (${name})`, () => {
  beforeEach(() => {
    kind = name;
  });

  test("grammY: ctx.step runs once across a rerun of the middleware; its result reaches the reply", async () => {
    const { fake, bot, safe } = grammySetup<Context & StepFlavor>();
    bot.use(safe.steps());
    let runs = 0;
    let calls = 0;
    const keys: string[] = [];
    bot.on("message:text", async (ctx) => {
      runs++;
      const answer = await ctx.step("llm", ({ idempotencyKey, attempt }) => {
        calls++;
        keys.push(idempotencyKey);
        return { text: `echo ${ctx.message.text}`, attempt, at: new Date(0) };
      });
      if (runs === 1) throw new Error("cut off after the step");
      await ctx.reply(`${answer.text} (${answer.attempt}, ${String(answer.at)})`);
    });
    await safe.start();
    const update = fake.textUpdate(9, "hi");
    await deliver(safe, bot, update);
    const id = fake.inboundId(update);
    expect(runs).toBe(2);
    expect(calls).toBe(1);
    expect(keys).toEqual([`${id}:step:llm`]);
    // The result as journaled: its JSON round trip (the Date came back as its string).
    expect(fake.sent.map((s) => s.params.text)).toEqual(["echo hi (1, 1970-01-01T00:00:00.000Z)"]);
    expect((await safe.durability.outbox.get(`${id}:step:llm`))?.state).toBe("sent");
    expect((await safe.durability.inbox.get(id))?.state).toBe("done");
  });

  test("grammY: safe.step from code the middleware calls (no ctx), with its own key", async () => {
    const { fake, bot, safe } = grammySetup<Context>();
    let runs = 0;
    let calls = 0;
    const charge = (amount: number) =>
      safe.step("charge", ({ idempotencyKey }) => {
        calls++;
        return { id: `ch_${amount}`, idempotencyKey };
      }, { key: "order-17:charge", idempotent: true });
    bot.on("message:text", async (ctx) => {
      runs++;
      const charged = await charge(5);
      if (runs === 1) throw new Error("cut off after the charge");
      await ctx.reply(`charged ${charged.id} (${charged.idempotencyKey})`);
    });
    await safe.start();
    await deliver(safe, bot, fake.textUpdate(9, "buy"));
    expect([runs, calls]).toEqual([2, 1]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["charged ch_5 (order-17:charge)"]);
    expect((await safe.durability.outbox.get("order-17:charge"))?.state).toBe("sent");
  });

  test("grammY: a step that fails for good dead-letters the update at once (grammY's BotError unwrapped)", async () => {
    const { fake, bot, safe } = grammySetup<Context & StepFlavor>();
    bot.use(safe.steps());
    const dead: { kind: string; id: string }[] = [];
    safe.on("durability:dead", (e) => dead.push({ kind: e.kind, id: e.id }));
    let runs = 0;
    let calls = 0;
    bot.on("message:text", async (ctx) => {
      runs++;
      await ctx.step("pay", () => {
        calls++;
        throw Object.assign(new Error("card declined"), { retryable: false });
      });
      await ctx.reply("paid");
    });
    await safe.start();
    const update = fake.textUpdate(9, "pay");
    await deliver(safe, bot, update);
    const id = fake.inboundId(update);
    expect([runs, calls]).toEqual([1, 1]);
    expect(dead).toEqual([{ kind: "step", id: `${id}:step:pay` }, { kind: "inbound", id }]);
    const record = await safe.durability.inbox.get(id);
    expect(record?.state).toBe("dead");
    expect(record?.error).toContain('Step "pay" failed: Error: card declined');
    expect(fake.sent).toEqual([]);
  });

  test("grammY: safe.step outside the middleware is refused", async () => {
    const { safe } = grammySetup<Context>();
    await safe.start();
    await expect(safe.step("x", () => 1)).rejects.toThrow(/outside a handler of this bot/);
  });

  test("Telegraf: safe.step runs once across a rerun of the middleware; its result reaches the reply", async () => {
    const { fake, bot, safe } = telegrafSetup();
    let runs = 0;
    let calls = 0;
    bot.on("text", async (ctx) => {
      runs++;
      const answer = await safe.step("llm", () => {
        calls++;
        return `echo ${ctx.message.text}`;
      });
      if (runs === 1) throw new Error("cut off after the step");
      await ctx.reply(answer);
    });
    await safe.start();
    const update = fake.textUpdate(9, "hi");
    await deliver(safe, bot, update);
    const id = fake.inboundId(update);
    expect([runs, calls]).toEqual([2, 1]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["echo hi"]);
    expect((await safe.durability.outbox.get(`${id}:step:llm`))?.state).toBe("sent");
    expect((await safe.durability.inbox.get(id))?.state).toBe("done");
  });

  test("Telegraf: a step that fails for good dead-letters the update at once", async () => {
    const { fake, bot, safe } = telegrafSetup();
    let runs = 0;
    const errors: unknown[] = [];
    bot.on("text", async () => {
      runs++;
      try {
        await safe.step("pay", () => {
          throw Object.assign(new Error("card declined"), { retryable: false });
        });
      } catch (error) {
        errors.push(error);
        throw error;
      }
    });
    await safe.start();
    const update = fake.textUpdate(9, "pay");
    await deliver(safe, bot, update);
    expect(runs).toBe(1);
    expect(errors[0]).toBeInstanceOf(StepFailedError);
    expect((await safe.durability.inbox.get(fake.inboundId(update)))?.state).toBe("dead");
  });

  test("grammY conversations: a step before and one after conversation.wait() run once each across the replays, keyed by the update that fed them", async () => {
    type Outer = ConversationFlavor<Context & StepFlavor>;
    const { fake, bot, safe, store } = grammySetup<Outer>();
    const runs = new Map<number, number>();
    // Each update's first run fails once the middleware is done, as a crash before the done mark would.
    bot.use(async (ctx, next) => {
      const n = (runs.get(ctx.update.update_id) ?? 0) + 1;
      runs.set(ctx.update.update_id, n);
      await next();
      if (n === 1) throw new Error("cut off before the done mark");
    });
    bot.use(safe.steps());
    bot.use(conversations({ storage: durableStorage(safe, store), plugins: [durableConversations(safe)] }));
    const calls: string[] = [];
    const keys: string[] = [];
    async function quote(conversation: Conversation<Outer, Context>, ctx: Context) {
      // The outer context (with ctx.step) is what external() hands over; its result joins the replay log.
      const price = await conversation.external((outer: Outer) =>
        outer.step("price", ({ idempotencyKey }) => {
          calls.push("price");
          keys.push(idempotencyKey);
          return 42;
        })
      );
      await ctx.reply(`The price is ${price}. Your name?`);
      const answer = await conversation.waitFor("message:text");
      const receipt = await conversation.external(() =>
        safe.step("receipt", ({ idempotencyKey }) => {
          calls.push("receipt");
          keys.push(idempotencyKey);
          return `R-${answer.message.text}-${price}`;
        })
      );
      await ctx.reply(`Receipt ${receipt}`);
    }
    bot.use(createConversation(quote, "quote"));
    bot.command("start", (ctx) => ctx.conversation.enter("quote"));
    await safe.start();
    const first = fake.textUpdate(42, "/start", START);
    const second = fake.textUpdate(42, "Ada");
    await deliver(safe, bot as never, first);
    await deliver(safe, bot as never, second);
    expect(runs.get(first.update_id as number)).toBe(2);
    expect(runs.get(second.update_id as number)).toBe(2);
    // Four runs of the conversation (two per update, the second update's replaying the first's part):
    // each step ran once.
    expect(calls).toEqual(["price", "receipt"]);
    expect(keys).toEqual([`${fake.inboundId(first)}:step:price`, `${fake.inboundId(second)}:step:receipt`]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["The price is 42. Your name?", "Receipt R-Ada-42"]);
    for (const update of [first, second]) expect((await safe.durability.inbox.get(fake.inboundId(update)))?.state).toBe("done");
  });
});

