// @grammyjs/conversations v2 in a durable grammY bot: with durableConversations(safe) in its plugins
// and durableStorage as its storage, the calls a conversation makes go through the outbox under the
// keys of the update being handled. A four-step conversation with a button (an inline keyboard and its
// callback query): a normal run sends each prompt once; a rerun of any step (its first run failed after
// the prompt was sent, before the update was done, as after a crash) is answered from the outbox and
// the conversation goes on; the replays of earlier steps make no API call and journal nothing. On the
// memory backend with a MemoryStore and on SQLite.
import { afterAll, beforeEach, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot as GrammyBot, type Context, InlineKeyboard, session, type SessionFlavor } from "grammy";
import { type Conversation, type ConversationFlavor, conversations, createConversation } from "@grammyjs/conversations";
import { durable, durableConversations, type DurableGrammy, durableStorage } from "../providers/grammy/mod.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { cleanupsAfterEach, sessionBackends } from "./support/plugin_tests.ts";

const dir = mkdtempSync(join(tmpdir(), "botmesh-grammy-conversations-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const cleanups = cleanupsAfterEach();

const KINDS = sessionBackends(dir);
let kind = "memory";

type Outer = ConversationFlavor<Context & SessionFlavor<{ orders: number }>>;
const CHAT = 42;
const START = { entities: [{ type: "bot_command", offset: 0, length: 6 }] };

interface Options {
  /** Updates (by step, 1 to 4) whose first run fails after the middleware ran: the next run is a rerun. */
  failAfter?: number[];
  /** Fail the conversation itself once, in step 4, between its two replies. */
  failBetween?: boolean;
  /** Install the plugin (default true). */
  plugin?: boolean;
}

function setup(options: Options = {}) {
  const fake = new FakeTelegram().start();
  const bot = new GrammyBot<Outer>(fake.token, {
    client: { apiRoot: fake.url },
    botInfo: { id: fake.botId, is_bot: true, first_name: "Fake", username: "fake_bot" } as never,
  });
  const { backend, store, close } = KINDS[kind]!();
  const safe = durable(bot, {
    durability: {
      backend,
      instanceId: "grammy-conversations-test",
      inbox: { retries: 3, backoff: { baseMs: 10, capMs: 20 } },
      outbox: { backoff: { baseMs: 10, capMs: 20 }, rateLimit: false },
    },
  });
  safe.on("error", () => {}); // the runs that fail on purpose
  cleanups.push(async () => {
    await safe.stop();
    await close();
    await fake.stop();
  });
  const failAfter = new Set(options.failAfter ?? []);
  const runs = new Map<number, number>(); // update_id → runs of the middleware
  let failBetween = options.failBetween ?? false;
  // Outermost: fails an update's first run once everything below it is done (the conversation state
  // and the session written, the replies sent), as a crash before the done mark would.
  bot.use(async (ctx, next) => {
    const n = (runs.get(ctx.update.update_id) ?? 0) + 1;
    runs.set(ctx.update.update_id, n);
    await next();
    if (n === 1 && failAfter.has(stepOf.get(ctx.update.update_id) ?? 0)) throw new Error("cut off before the done mark");
  });
  bot.use(session({ initial: () => ({ orders: 0 }), storage: durableStorage(safe, store) }));
  const plugins = options.plugin === false ? [] : [durableConversations(safe)];
  bot.use(conversations({ storage: { type: "key", adapter: durableStorage(safe, store), prefix: "conversation:" }, plugins }));
  async function order(conversation: Conversation<Outer, Context>, ctx: Context) {
    await ctx.reply("Your name?");
    const name = (await conversation.waitFor("message:text")).message.text;
    await ctx.reply(`Pick a size, ${name}`, { reply_markup: new InlineKeyboard().text("S", "size:S").text("M", "size:M") });
    const pressed = await conversation.waitForCallbackQuery(/^size:/);
    const size = pressed.callbackQuery.data.slice("size:".length);
    await pressed.answerCallbackQuery({ text: `${size} it is` });
    await pressed.reply("How many?");
    const count = await conversation.form.int();
    await ctx.reply(`${name}: ${count} × ${size}`);
    await conversation.external(() => {
      if (failBetween) {
        failBetween = false;
        throw new Error("the conversation fails between its two replies");
      }
    });
    await conversation.external((outer: Outer) => outer.session.orders++);
    await ctx.reply("Thanks!");
  }
  bot.use(createConversation(order, "order"));
  bot.command("start", (ctx) => ctx.conversation.enter("order"));
  const stepOf = new Map<number, number>();
  const updates = [
    fake.textUpdate(CHAT, "/start", START),
    fake.textUpdate(CHAT, "Ada"),
    fake.callbackUpdate(CHAT, "size:M"),
    fake.textUpdate(CHAT, "3"),
  ];
  updates.forEach((u, i) => stepOf.set(u.update_id as number, i + 1));
  return { fake, bot, safe, store, updates, runs };
}

/** Deliver one update and wait until it is handled; the API calls (but getMe) made meanwhile. */
async function step(fake: FakeTelegram, bot: GrammyBot<Outer>, safe: DurableGrammy, update: Record<string, unknown>) {
  const from = fake.calls.length;
  await bot.handleUpdate(update as never);
  await safe.idle();
  return fake.calls.slice(from).filter((c) => c.method !== "getMe").map((c) => `${c.method} ${c.params.text ?? ""}`.trim());
}

const PROMPTS = ["Your name?", "Pick a size, Ada", "How many?", "Ada: 3 × M", "Thanks!"];
/** The calls each step makes, once. */
const CALLS = [
  ["sendMessage Your name?"],
  ["sendMessage Pick a size, Ada"],
  ["answerCallbackQuery M it is", "sendMessage How many?"],
  ["sendMessage Ada: 3 × M", "sendMessage Thanks!"],
];

for (const name of Object.keys(KINDS)) describe(`conversations v2 through the outbox (${name})`, () => {
  beforeEach(() => {
    kind = name;
  });

  test("a normal run: each prompt sent once, each under its update's key; the replays of earlier steps make no call", async () => {
    const { fake, bot, safe, store, updates } = setup();
    await safe.start();
    const calls = [];
    for (const update of updates) calls.push(await step(fake, bot, safe, update));
    // Step 4 replays steps 1 to 3 from the conversation's log: none of their calls is made again.
    expect(calls).toEqual(CALLS);
    expect(fake.sent.map((s) => s.params.text)).toEqual(PROMPTS);
    expect(fake.sent[1]!.params.reply_markup).toEqual({ inline_keyboard: [[{ text: "S", callback_data: "size:S" }, { text: "M", callback_data: "size:M" }]] });
    // Journaled under the keys of the update that made them, and nothing else.
    const keys = (await safe.durability.outbox.list({ limit: 100 })).map((e) => e.key).sort();
    const ids = updates.map((u) => fake.inboundId(u));
    expect(keys).toEqual([`${ids[0]}:1`, `${ids[1]}:1`, `${ids[2]}:1`, `${ids[3]}:1`, `${ids[3]}:2`].sort());
    // The conversation is over, the session counted the order once.
    expect(await durableStorage(safe, store).read(`conversation:${CHAT}`)).toBeUndefined();
    expect(await durableStorage(safe, store).read(String(CHAT))).toEqual({ orders: 1 });
  });

  for (const failed of [1, 2, 3, 4]) {
    test(`step ${failed} cut off after its prompt was sent, before it was done: the rerun is answered from the outbox and the conversation goes on`, async () => {
      const { fake, bot, safe, store, updates, runs } = setup({ failAfter: [failed] });
      await safe.start();
      const calls = [];
      for (const update of updates) calls.push(await step(fake, bot, safe, update));
      expect(runs.get(updates[failed - 1]!.update_id as number)).toBe(2);
      // The rerun sends nothing again; only the button's answer (not journaled) is made once per run.
      const expected = CALLS.map((c) => [...c]);
      if (failed === 3) expected[2] = ["answerCallbackQuery M it is", "sendMessage How many?", "answerCallbackQuery M it is"];
      expect(calls).toEqual(expected);
      expect(fake.sent.map((s) => s.params.text)).toEqual(PROMPTS);
      expect(await durableStorage(safe, store).read(`conversation:${CHAT}`)).toBeUndefined();
      expect(await durableStorage(safe, store).read(String(CHAT))).toEqual({ orders: 1 });
      for (const update of updates) expect((await safe.durability.inbox.get(fake.inboundId(update)))?.state).toBe("done");
    });
  }

  test("the conversation fails between two replies of a step: the retry answers the first from the outbox and sends the second", async () => {
    const { fake, bot, safe, store, updates, runs } = setup({ failBetween: true });
    await safe.start();
    const calls = [];
    for (const update of updates) calls.push(await step(fake, bot, safe, update));
    expect(runs.get(updates[3]!.update_id as number)).toBe(2);
    expect(calls).toEqual(CALLS);
    expect(fake.sent.map((s) => s.params.text)).toEqual(PROMPTS);
    expect(await durableStorage(safe, store).read(String(CHAT))).toEqual({ orders: 1 });
  });

  test("without the plugin a conversation's calls bypass the outbox: a rerun sends its prompt again", async () => {
    const { fake, bot, safe, updates } = setup({ failAfter: [2], plugin: false });
    await safe.start();
    for (const update of updates) await step(fake, bot, safe, update);
    expect(fake.sent.map((s) => s.params.text)).toEqual([PROMPTS[0], PROMPTS[1], PROMPTS[1], ...PROMPTS.slice(2)]);
    expect(await safe.durability.outbox.list({ limit: 100 })).toEqual([]);
  });

  test("the plugin listed twice, or also in createConversation, installs the outbox once", async () => {
    const fake = new FakeTelegram().start();
    const bot = new GrammyBot<ConversationFlavor<Context>>(fake.token, {
      client: { apiRoot: fake.url },
      botInfo: { id: fake.botId, is_bot: true, first_name: "Fake", username: "fake_bot" } as never,
    });
    const { backend, store, close } = KINDS[kind]!();
    const safe = durable(bot, { durability: { backend, instanceId: "grammy-conversations-twice", outbox: { rateLimit: false } } });
    cleanups.push(async () => {
      await safe.stop();
      await close();
      await fake.stop();
    });
    bot.use(conversations({ storage: durableStorage(safe, store), plugins: [durableConversations(safe), durableConversations(safe)] }));
    bot.use(createConversation(async (conversation: Conversation<ConversationFlavor<Context>, Context>, ctx: Context) => {
      await ctx.reply("One?");
      await conversation.wait();
      await ctx.reply("Two.");
    }, { id: "twice", plugins: [durableConversations(safe)] }));
    bot.command("start", (ctx) => ctx.conversation.enter("twice"));
    await safe.start();
    const first = fake.textUpdate(CHAT, "/start", START);
    const second = fake.textUpdate(CHAT, "x");
    await step(fake, bot as never, safe, first);
    await step(fake, bot as never, safe, second);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["One?", "Two."]);
    expect((await safe.durability.outbox.list({ limit: 100 })).map((e) => e.key).sort()).toEqual(
      [`${fake.inboundId(first)}:1`, `${fake.inboundId(second)}:1`].sort(),
    );
  });

  test("a conversational menu: rendered before the outbox journals the reply, its button's handler replies through the outbox", async () => {
    const fake = new FakeTelegram().start();
    const bot = new GrammyBot<ConversationFlavor<Context>>(fake.token, {
      client: { apiRoot: fake.url },
      botInfo: { id: fake.botId, is_bot: true, first_name: "Fake", username: "fake_bot" } as never,
    });
    const { backend, store, close } = KINDS[kind]!();
    const safe = durable(bot, {
      durability: { backend, instanceId: "grammy-conversations-menu", inbox: { backoff: { baseMs: 10, capMs: 20 } }, outbox: { rateLimit: false } },
    });
    safe.on("error", () => {});
    cleanups.push(async () => {
      await safe.stop();
      await close();
      await fake.stop();
    });
    let pressRuns = 0;
    bot.use(async (ctx, next) => {
      await next();
      if (ctx.callbackQuery !== undefined && ++pressRuns === 1) throw new Error("cut off before the done mark");
    });
    bot.use(conversations({ storage: durableStorage(safe, store), plugins: [durableConversations(safe)] }));
    bot.use(createConversation(async (conversation: Conversation<ConversationFlavor<Context>, Context>, ctx: Context) => {
      const menu = conversation.menu("pick").text("Tea", (c) => c.reply("Tea it is"));
      await ctx.reply("Tea?", { reply_markup: menu });
      await conversation.waitFor("message:text");
      await ctx.reply("Bye");
    }, "menu"));
    bot.command("start", (ctx) => ctx.conversation.enter("menu"));
    await safe.start();
    await step(fake, bot as never, safe, fake.textUpdate(CHAT, "/start", START));
    const markup = fake.sent[0]!.params.reply_markup as { inline_keyboard: { text: string; callback_data: string }[][] };
    expect(markup.inline_keyboard[0]![0]!.text).toBe("Tea");
    const press = fake.callbackUpdate(CHAT, markup.inline_keyboard[0]![0]!.callback_data);
    (press.callback_query as { message: { message_id: number } }).message.message_id = fake.sent[0]!.messageId;
    await step(fake, bot as never, safe, press);
    await step(fake, bot as never, safe, fake.textUpdate(CHAT, "done"));
    // The press was run twice (its first run cut off): its reply went out once.
    expect(pressRuns).toBe(2);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["Tea?", "Tea it is", "Bye"]);
    expect((await safe.durability.outbox.get(`${fake.inboundId(press)}:1`))?.state).toBe("sent");
  });
});

test("durableConversations names a wrong argument", () => {
  expect(() => durableConversations({} as never)).toThrow(/Argument "safe"/);
});
