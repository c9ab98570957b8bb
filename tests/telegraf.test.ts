// @botmesh/durable/telegraf against the fake Bot API server, with real Telegraf 4 bots: updates are
// journaled before the middleware runs (a webhook answered, a polling offset confirmed only then),
// redeliveries are dropped, a throwing handler is retried and then dead-lettered, a rerun is answered
// from the outbox, message-creating calls on ctx.telegram and bot.telegram are keyed <inbound id>:<n>
// and everything else passes straight through; sessions through durableStorage are applied once. On the
// memory and SQLite backends.
import { afterAll, beforeEach, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createServer, type Server } from "node:http";
import { type Context, Markup, session, Telegraf, Telegram, TelegramError } from "telegraf";
import { MemoryDurability, MemoryStore } from "../mod.ts";
import type { DurabilityBackend } from "../backend.ts";
import { SQLiteDurability } from "../backends/sqlite/mod.ts";
import { classifyTelegrafError, durable, durableStorage, isJournaledMethod } from "../providers/telegraf/mod.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { flakyAdmit } from "./support/flaky_admit.ts";
import { cleanupsAfterEach, outboxKeys, pluginTestDurability } from "./support/plugin_tests.ts";

const cleanups = cleanupsAfterEach();

const dir = mkdtempSync(join(tmpdir(), "botmesh-telegraf-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const BACKENDS: Record<string, () => DurabilityBackend> = {
  memory: () => new MemoryDurability(),
  sqlite: () => new SQLiteDurability({ file: join(dir, `${crypto.randomUUID()}.db`) }),
};
let backendName = "memory";

type SessionContext = Context & { session: { count: number; texts: string[] } };

function setup(options: { retries?: number; admitFailures?: number } = {}) {
  const fake = new FakeTelegram().start();
  const bot = new Telegraf<SessionContext>(fake.token, { telegram: { apiRoot: fake.url } });
  const real = BACKENDS[backendName]!();
  const backend = flakyAdmit(real, { failures: options.admitFailures ?? 0 });
  const safe = durable(bot, { durability: pluginTestDurability(backend, "telegraf-test", options.retries ?? 3) });
  cleanups.push(async () => {
    await safe.stop();
    await real.close?.();
    await fake.stop();
  });
  return { fake, bot, safe };
}

/** Telegraf's webhookCallback on a node:http server on a free port. */
async function serve(bot: Telegraf<SessionContext>): Promise<{ post: (update: Record<string, unknown>) => Promise<number> }> {
  const server: Server = createServer(bot.webhookCallback("/hook"));
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  cleanups.push(() => new Promise<void>((resolve) => server.close(() => resolve())));
  const port = (server.address() as { port: number }).port;
  return {
    post: async (update) => {
      const response = await fetch(`http://127.0.0.1:${port}/hook`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(update),
      });
      await response.arrayBuffer();
      return response.status;
    },
  };
}

for (const name of Object.keys(BACKENDS)) describe(`Telegraf behind the durable inbox (${name})`, () => {
  beforeEach(() => {
    backendName = name;
  });

  test("by webhook: the update is journaled before the middleware runs and answered 200 before it is done; a redelivery is dropped", async () => {
    const { fake, bot, safe } = setup();
    let release!: () => void;
    const gate = new Promise<void>((resolve) => (release = resolve));
    const seen: { state: string | undefined; text: string }[] = [];
    const update = fake.textUpdate(7, "hello");
    bot.on("text", async (ctx) => {
      seen.push({ state: (await safe.durability.inbox.get(fake.inboundId(update)))?.state, text: ctx.message.text });
      await gate;
      await ctx.reply(`echo: ${ctx.message.text}`);
    });
    await safe.start();
    const hook = await serve(bot);
    expect(await hook.post(update)).toBe(200);
    expect(fake.sent).toEqual([]); // the middleware is still waiting
    expect(await safe.durability.inbox.get(fake.inboundId(update))).not.toBeNull();
    expect(await hook.post(update)).toBe(200); // the redelivery
    release();
    await safe.idle();
    expect(seen).toEqual([{ state: "processing", text: "hello" }]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["echo: hello"]);
    expect(await outboxKeys(safe)).toEqual([`${fake.inboundId(update)}:1`]);
    expect((await safe.durability.inbox.get(fake.inboundId(update)))?.state).toBe("done");
  });

  test("by webhook: an update the journal refuses is answered 500, and handled when Telegram delivers it again", async () => {
    const { fake, bot, safe } = setup({ admitFailures: 1 });
    bot.on("text", (ctx) => ctx.reply("got it"));
    await safe.start();
    const hook = await serve(bot);
    const update = fake.textUpdate(17, "once");
    expect(await hook.post(update)).toBe(500);
    expect(await hook.post(update)).toBe(200);
    await safe.idle();
    expect(fake.sent.map((s) => s.params.text)).toEqual(["got it"]);
  });

  test("message-creating calls on ctx.telegram and bot.telegram are keyed <inbound id>:<n> and get the real Message; edits, chat actions and callback answers pass straight through", async () => {
    const { fake, bot, safe } = setup();
    const results: unknown[] = [];
    bot.on("text", async (ctx) => {
      await ctx.sendChatAction("typing");
      const first = await ctx.reply("one", Markup.inlineKeyboard([Markup.button.callback("ok", "ok")]));
      results.push(first);
      await ctx.telegram.editMessageText(ctx.chat.id, first.message_id, undefined, "one (edited)");
      await bot.telegram.sendMessage(ctx.chat.id, "two"); // bot.telegram, not ctx.telegram: still this update's send
      await ctx.telegram.sendMessage(ctx.chat.id, "three");
    });
    bot.on("callback_query", async (ctx) => {
      await ctx.answerCbQuery("noted");
      await ctx.editMessageText(`picked ${(ctx.callbackQuery as { data: string }).data}`);
    });
    await safe.start();
    const update = fake.textUpdate(8, "hi");
    await bot.handleUpdate(update as never);
    await safe.idle();
    const id = fake.inboundId(update);
    expect(await outboxKeys(safe)).toEqual([`${id}:1`, `${id}:2`, `${id}:3`]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["one", "two", "three"]);
    expect(fake.sent[0]!.params.reply_markup).toEqual({ inline_keyboard: [[{ text: "ok", callback_data: "ok", hide: false }]] });
    expect(results[0]).toMatchObject({ message_id: fake.sent[0]!.messageId, chat: { id: 8, type: "private" }, text: "one" });
    expect(fake.edits).toEqual([{ chatId: "8", messageId: fake.sent[0]!.messageId, text: "one (edited)" }]);
    expect(fake.calls.filter((c) => c.method === "sendChatAction").length).toBe(1);

    const press = fake.callbackUpdate(8, "a");
    (press.callback_query as { message: { message_id: number } }).message.message_id = fake.sent[0]!.messageId;
    await bot.handleUpdate(press as never);
    await safe.idle();
    expect(fake.answeredCallbacks.length).toBe(1);
    expect(fake.edits.map((e) => e.text)).toEqual(["one (edited)", "picked a"]);
    expect((await outboxKeys(safe)).length).toBe(3); // nothing of the button press was journaled
  });

  test("a throwing handler is retried, and the rerun is answered from the outbox: nothing is sent twice", async () => {
    const { fake, bot, safe } = setup();
    const replies: unknown[] = [];
    let runs = 0;
    let caught = 0;
    bot.catch(() => void caught++); // errors go to the inbox's retries, not to bot.catch
    bot.on("text", async (ctx) => {
      runs++;
      replies.push(await ctx.reply("working"));
      if (runs === 1) throw new Error("the process died here, say");
      await ctx.reply("done");
    });
    await safe.start();
    const update = fake.textUpdate(9, "go");
    await bot.handleUpdate(update as never);
    await safe.idle();
    expect(runs).toBe(2);
    expect(caught).toBe(0);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["working", "done"]);
    expect(replies[0]).toMatchObject({ message_id: 1, chat: { id: 9, type: "private" }, text: "working" });
    expect(replies[1]).toEqual({ message_id: 1, chat: { id: 9 } });
    expect(safe.durability.metrics().outboxDeduped).toBe(1);
    expect((await safe.durability.inbox.get(fake.inboundId(update)))?.state).toBe("done");
  });

  test("a handler that always throws is dead-lettered after its retries, with the update kept for a replay", async () => {
    const { fake, bot, safe } = setup({ retries: 2 });
    let runs = 0;
    const dead: unknown[] = [];
    safe.on("durability:dead", (d) => dead.push(d));
    bot.on("text", async (ctx) => {
      runs++;
      await ctx.reply("trying");
      throw new Error("broken handler");
    });
    await safe.start();
    const update = fake.textUpdate(11, "boom");
    await bot.handleUpdate(update as never);
    await safe.idle();
    expect(runs).toBe(3);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["trying"]); // the reruns were answered from the outbox
    const record = await safe.durability.inbox.get(fake.inboundId(update));
    expect(record?.state).toBe("dead");
    expect((record?.payload as { extra?: { update?: { update_id: number } } }).extra?.update?.update_id).toBe(update.update_id as number);
    expect(dead.length).toBe(1);
  });

  test("on a rerun, a passed-through call that fails only because the first run's took effect succeeds", async () => {
    const { fake, bot, safe } = setup();
    let runs = 0;
    const errors: unknown[] = [];
    bot.on("callback_query", async (ctx) => {
      runs++;
      try {
        await ctx.answerCbQuery();
        await ctx.editMessageText("picked");
      } catch (error) {
        errors.push(error);
        throw error;
      }
      if (runs === 1) {
        fake.inject("answerCallbackQuery", { kind: "status", status: 400, description: "Bad Request: query is too old and response timeout expired or query ID is invalid" });
        fake.inject("editMessageText", { kind: "status", status: 400, description: "Bad Request: message is not modified" });
        throw new Error("the process died here, say");
      }
      await ctx.reply("noted");
    });
    await safe.start();
    const first = await bot.telegram.sendMessage(21, "Pick one"); // outside a handler: journaled under a random key
    const press = fake.callbackUpdate(21, "a");
    (press.callback_query as { message: { message_id: number } }).message.message_id = first.message_id;
    await bot.handleUpdate(press as never);
    await safe.idle();
    expect(runs).toBe(2);
    expect(errors).toEqual([]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["Pick one", "noted"]);
    expect(fake.calls.filter((c) => c.method === "answerCallbackQuery").map((c) => c.status)).toEqual([200, 400]);
    const keys = await outboxKeys(safe);
    expect(keys.filter((k) => k.startsWith("rnd:")).length).toBe(1);
    expect(keys.filter((k) => !k.startsWith("rnd:"))).toEqual([`${fake.inboundId(press)}:1`]);
  });

  test("a send refused by the flood limit (429) waits in the outbox for its retry_after and resolves with the real Message", async () => {
    const { fake, bot, safe } = setup();
    const replies: unknown[] = [];
    bot.on("text", async (ctx) => {
      replies.push(await ctx.reply("after the flood"));
    });
    await safe.start();
    fake.inject("sendMessage", { kind: "status", status: 429, description: "Too Many Requests: retry after 1", retryAfter: 1 });
    await bot.handleUpdate(fake.textUpdate(19, "go") as never);
    await safe.idle();
    expect(fake.calls.filter((c) => c.method === "sendMessage").map((c) => c.status)).toEqual([429, 200]);
    expect(replies).toEqual([expect.objectContaining({ message_id: 1, chat: expect.objectContaining({ id: 19 }), text: "after the flood" })]);
  });

  test("a send that ends dead throws the TelegramError Telegraf would have thrown", async () => {
    const { fake, bot, safe } = setup({ retries: 0 });
    const errors: unknown[] = [];
    bot.on("text", async (ctx) => {
      try {
        await ctx.reply("hello?");
      } catch (error) {
        errors.push(error);
      }
    });
    await safe.start();
    fake.block(10);
    await bot.handleUpdate(fake.textUpdate(10, "hi") as never);
    await safe.idle();
    expect(errors.length).toBe(1);
    expect(errors[0]).toBeInstanceOf(TelegramError);
    expect((errors[0] as TelegramError).code).toBe(403);
    expect((errors[0] as TelegramError).on).toMatchObject({ method: "sendMessage" });
    expect((await safe.durability.outbox.list())[0]?.state).toBe("dead");
  });

  test("by long polling (bot.launch()): the offset confirms only journaled updates; a refused update is asked for again; a redelivery is dropped", async () => {
    const { fake, bot, safe } = setup({ admitFailures: 2 });
    const handled: string[] = [];
    bot.on("text", async (ctx) => {
      handled.push(ctx.message.text);
      await ctx.reply(`re: ${ctx.message.text}`);
    });
    await safe.start();
    const a = fake.push(fake.textUpdate(12, "a"));
    const b = fake.push(fake.textUpdate(13, "b"));
    const launched = bot.launch();
    await fake.until("both replies", () => fake.sent.length === 2, 10_000);
    fake.redeliver(a);
    const c = fake.push(fake.textUpdate(12, "c"));
    await fake.until("the third reply", () => fake.sent.length === 3, 10_000);
    await safe.stop();
    await launched;
    expect(handled.sort()).toEqual(["a", "b", "c"]);
    expect(fake.sent.map((s) => s.params.text).sort()).toEqual(["re: a", "re: b", "re: c"]);
    // Both were refused by the journal: the next getUpdates asked for them again instead of confirming them.
    expect(fake.offsets.slice(0, 2)).toEqual([0, a.update_id as number]);
    expect(fake.offsets).toContain((b.update_id as number) + 1);
    expect(fake.confirmedOffset).toBe((c.update_id as number) + 1); // stop() confirmed what was journaled
  });

  test("sessions through durableStorage are applied once per update, across retries, and never by a dead-lettered update", async () => {
    const { fake, bot, safe } = setup({ retries: 1 });
    const store = new MemoryStore();
    let runs = 0;
    bot.use(session({ defaultSession: () => ({ count: 0, texts: [] }), store: durableStorage(safe, store) }));
    bot.on("text", async (ctx) => {
      runs++;
      ctx.session.count++;
      ctx.session.texts.push(ctx.message.text);
      if (ctx.message.text === "flaky" && runs === 1) throw new Error("first run fails after the session changed");
      if (ctx.message.text === "never") throw new Error("always fails");
      await ctx.reply(`${ctx.session.count}`);
    });
    await safe.start();
    for (const text of ["flaky", "steady", "never", "last"]) {
      await bot.handleUpdate(fake.textUpdate(14, text) as never);
      await safe.idle();
    }
    const key = "14:14"; // Telegraf's default key: <from id>:<chat id>
    const stored = (await store.get(key)) as { v: { count: number; texts: string[] } };
    expect(stored.v).toEqual({ count: 3, texts: ["flaky", "steady", "last"] });
    expect(fake.sent.map((s) => s.params.text)).toEqual(["1", "2", "3"]);
    expect(await durableStorage<{ count: number }>(safe, store).get(key)).toEqual({ count: 3, texts: ["flaky", "steady", "last"] } as never);
  });
});

test("nothing process-wide is patched: another Telegraf bot and Telegram's prototype are untouched", () => {
  const callApi = Telegram.prototype.callApi;
  const bot = new Telegraf("123:abc");
  const other = new Telegraf("456:def");
  durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "x" } });
  expect(Telegram.prototype.callApi).toBe(callApi);
  expect(other.telegram.callApi).toBe(callApi);
  expect(Object.hasOwn(bot.telegram, "callApi")).toBe(true);
  expect(Object.hasOwn(other, "handleUpdate")).toBe(false);
});

test("arguments are checked: errors name the argument", () => {
  const backend = new MemoryDurability();
  expect(() => durable({} as never, { durability: { backend, instanceId: "x" } })).toThrow(/Argument "bot" must be a Telegraf 4 bot/);
  expect(() => durable(new Telegraf("123:abc"), null as never)).toThrow(TypeError);
  expect(() => durable(new Telegraf("123:abc"), { durability: { backend, instanceId: "x" }, nope: 1 } as never)).toThrow(/nope/);
  expect(() => durable(new Telegraf("123:abc"), {} as never)).toThrow(/"durability" is required/);
  expect(() => durable(new Telegraf("not-a-token"), { durability: { backend, instanceId: "x" } })).toThrow(/token/);
  const bot = new Telegraf("123:abc");
  const safe = durable(bot, { durability: { backend, instanceId: "x" } });
  expect(() => durable(bot, { durability: { backend, instanceId: "x" } })).toThrow(/already durable/);
  expect(() => durableStorage({} as never, new MemoryStore())).toThrow(/Argument "safe"/);
  expect(() => durableStorage(safe, {} as never)).toThrow(/Argument "store"/);
  expect(() => durableStorage(safe, new MemoryStore(), { ttlMs: -1 })).toThrow(RangeError);
});

test("the method table and error rules are the grammY plugin's", () => {
  expect(isJournaledMethod("sendMessage")).toBe(true);
  expect(isJournaledMethod("sendChatAction")).toBe(false);
  expect(isJournaledMethod("editMessageText")).toBe(false);
  const error = (code: number, parameters?: Record<string, unknown>) => new TelegramError({ error_code: code, description: "x", ...(parameters ? { parameters } : {}) } as never);
  expect(classifyTelegrafError(error(403))).toEqual({ retryable: false });
  expect(classifyTelegrafError(error(502))).toEqual({ retryable: true });
  expect(classifyTelegrafError(error(429, { retry_after: 3 }))).toEqual({ retryable: true, rateLimited: "chat", retryAfterMs: 3000 });
  expect(classifyTelegrafError(Object.assign(new Error("network timeout at: …"), { name: "FetchError", type: "request-timeout" }))).toEqual({ retryable: true, maybeDelivered: true });
  expect(classifyTelegrafError(Object.assign(new Error("ECONNREFUSED"), { name: "FetchError", type: "system" }))).toEqual({ retryable: true });
});
