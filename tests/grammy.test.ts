// @botmesh/durable/grammy against the fake Bot API server: updates are journaled before the
// middleware runs and answered only then, redeliveries are dropped, a rerun is answered from the
// outbox, message-creating calls are keyed <inbound id>:<n> and everything else passes straight
// through; by webhook (std/http and node:http), grammY's long polling and @grammyjs/runner; on the
// memory, SQLite and file backends, and on Postgres and Redis when they are reachable.
import { afterAll, beforeEach, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { createServer, type Server } from "node:http";
import { run } from "@grammyjs/runner";
import { Bot as GrammyBot, type Context, GrammyError, InlineKeyboard, InputFile, session, type SessionFlavor, webhookCallback } from "grammy";
import { MemoryDurability } from "../mod.ts";
import { basicAuth, durabilityConsole, prometheusMetrics } from "../ops.ts";
import type { DurabilityBackend } from "../backend.ts";
import { SQLiteDurability } from "../backends/sqlite/mod.ts";
import { FileDurability } from "../backends/file/mod.ts";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { RedisDurability } from "../backends/redis/mod.ts";
import postgres from "postgres";
import IORedis from "ioredis";
import { POSTGRES_URL, REDIS_URL, runId, serviceSkip } from "./support/services.ts";
import { durable, isJournaledMethod } from "../providers/grammy/mod.ts";
import { FakeTelegram, telegramLimits } from "./support/fake_telegram.ts";
import { flakyAdmit } from "./support/flaky_admit.ts";
import { cleanupsAfterEach, outboxKeys, pluginTestDurability } from "./support/plugin_tests.ts";

function escapeHtml(text: string): string {
  return text.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;").replace(/'/g, "&#39;");
}

const cleanups = cleanupsAfterEach();

const dir = mkdtempSync(join(tmpdir(), "botmesh-grammy-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const BACKENDS: Record<string, () => DurabilityBackend> = {
  memory: () => new MemoryDurability(),
  sqlite: () => new SQLiteDurability({ file: join(dir, `${crypto.randomUUID()}.db`) }),
  file: () => new FileDurability({ path: join(dir, `${crypto.randomUUID()}.json`) }),
};
// The shared backends when their servers are reachable: a random schema or key prefix per test.
const sql = (await serviceSkip("postgres")) === false ? postgres(POSTGRES_URL, { max: 4, onnotice: () => {} }) : undefined;
const redis = (await serviceSkip("redis")) === false ? new IORedis(REDIS_URL) : undefined;
const schemas: string[] = [];
const prefixes: string[] = [];
if (sql) {
  BACKENDS.postgres = () => {
    const schema = `grammy_${runId()}`;
    schemas.push(schema);
    return new PostgresDurability({ sql, schema });
  };
}
if (redis) {
  BACKENDS.redis = () => {
    const keyPrefix = `bm-grammy:${runId()}:`;
    prefixes.push(keyPrefix);
    return new RedisDurability({ client: redis, keyPrefix });
  };
}
afterAll(async () => {
  for (const schema of schemas) await sql!.unsafe(`drop schema if exists ${schema} cascade`);
  await sql?.end();
  for (const prefix of prefixes) {
    const keys = await redis!.keys(`${prefix}*`);
    const braced = await redis!.keys(`{${prefix}}*`);
    if (keys.length + braced.length > 0) await redis!.del(...keys, ...braced);
  }
  await redis?.quit();
});
let backendName = "memory";

function botOf(fake: FakeTelegram): GrammyBot {
  return new GrammyBot(fake.token, {
    client: { apiRoot: fake.url },
    botInfo: {
      id: fake.botId,
      is_bot: true,
      first_name: "Fake",
      username: "fake_bot",
      can_join_groups: true,
      can_read_all_group_messages: false,
      supports_inline_queries: false,
      can_connect_to_business: false,
      has_main_web_app: false,
      has_topics_enabled: false,
      allows_users_to_create_topics: false,
      can_manage_bots: false,
    } as never,
  });
}

function setup(options: { retries?: number; admitFailures?: number } = {}) {
  const fake = new FakeTelegram().start();
  const bot = botOf(fake);
  const real = BACKENDS[backendName]!();
  const backend = flakyAdmit(real, { failures: options.admitFailures ?? 0 });
  const safe = durable(bot, { durability: pluginTestDurability(backend, "grammy-test", options.retries ?? 3) });
  cleanups.push(async () => {
    await safe.stop();
    await real.close?.();
    await fake.stop();
  });
  return { fake, bot, safe };
}

function webhookRequest(update: Record<string, unknown>): Request {
  return new Request("http://bot.test/telegram", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(update),
  });
}

for (const name of Object.keys(BACKENDS)) describe(`grammY behind the durable inbox (${name})`, () => {
  beforeEach(() => {
    backendName = name;
  });

  test("an update is journaled before the middleware runs, and the webhook answers before the middleware is done", async () => {
    const { fake, bot, safe } = setup();
    let release!: () => void;
    const gate = new Promise<void>((resolve) => (release = resolve));
    const seen: { state: string | undefined; text: string }[] = [];
    const update = fake.textUpdate(7, "hello");
    bot.on("message:text", async (ctx) => {
      seen.push({ state: (await safe.durability.inbox.get(fake.inboundId(update)))?.state, text: ctx.message.text });
      await gate;
      await ctx.reply(`echo: ${ctx.message.text}`);
    });
    await safe.start();
    const handle = webhookCallback(bot, "std/http");
    const response = await handle(webhookRequest(update));
    expect(response.status).toBe(200);
    expect(fake.sent).toEqual([]); // the middleware is still waiting
    expect(await safe.durability.inbox.get(fake.inboundId(update))).not.toBeNull();
    // A redelivery (Telegram did not get the answer, say) is dropped.
    expect((await handle(webhookRequest(update))).status).toBe(200);
    release();
    await safe.idle();
    expect(seen).toEqual([{ state: "processing", text: "hello" }]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["echo: hello"]);
    expect(await outboxKeys(safe)).toEqual([`${fake.inboundId(update)}:1`]);
    expect((await safe.durability.inbox.get(fake.inboundId(update)))?.state).toBe("done");
  });

  test("an update nested some thousands of levels deep is dead-lettered (kept cut at the limit), answered 200; the next one runs", async () => {
    const { fake, bot, safe } = setup();
    const seen: string[] = [];
    bot.on("message:text", (ctx) => void seen.push(ctx.message.text));
    bot.on("my_chat_member", () => void seen.push("member"));
    await safe.start();
    const handle = webhookCallback(bot, "std/http");
    const deep = () => JSON.parse("[".repeat(20_000) + "]".repeat(20_000)) as unknown;
    const message = { update_id: 9001, message: { message_id: 2, date: 1, chat: { id: 31, type: "private" }, text: "x", a: deep() } };
    const member = { update_id: 9002, my_chat_member: { chat: { id: 31, type: "private" }, a: deep() } };
    expect((await handle(webhookRequest(message))).status).toBe(200);
    expect((await handle(webhookRequest(member))).status).toBe(200);
    const next = fake.textUpdate(31, "next");
    expect((await handle(webhookRequest(next))).status).toBe(200);
    await safe.idle();
    expect(seen).toEqual(["next"]);
    const records = [await safe.durability.inbox.get(`tg:${fake.botId}:9001:31:2`), await safe.durability.inbox.get(`tg:${fake.botId}:9002:my_chat_member`)];
    expect(records.map((r) => [r?.state, r?.chatId])).toEqual([["dead", "31"], ["dead", "31"]]);
    expect((records[1]!.payload as { unreadable: string }).unreadable).toContain('"my_chat_member.a[0][0]');
  });

  test("message-creating calls are keyed <inbound id>:<n> and get the real Message; edits, chat actions and callback answers pass straight through", async () => {
    const { fake, bot, safe } = setup();
    const results: unknown[] = [];
    bot.on("message:text", async (ctx) => {
      await ctx.replyWithChatAction("typing");
      const first = await ctx.reply("one", { reply_markup: new InlineKeyboard().text("ok", "ok") });
      results.push(first);
      await ctx.api.editMessageText(ctx.chat.id, first.message_id, "one (edited)");
      await bot.api.sendMessage(ctx.chat.id, "two"); // bot.api, not ctx.api: still this update's send
      await ctx.api.sendMessage(ctx.chat.id, "three");
    });
    bot.on("callback_query:data", async (ctx) => {
      await ctx.answerCallbackQuery({ text: "noted" });
      await ctx.editMessageText(`picked ${ctx.callbackQuery.data}`);
    });
    await safe.start();
    const handle = webhookCallback(bot, "std/http");
    const update = fake.textUpdate(8, "hi");
    expect((await handle(webhookRequest(update))).status).toBe(200);
    await safe.idle();
    const id = fake.inboundId(update);
    expect(await outboxKeys(safe)).toEqual([`${id}:1`, `${id}:2`, `${id}:3`]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["one", "two", "three"]);
    expect(fake.sent[0]!.params.reply_markup).toEqual({ inline_keyboard: [[{ text: "ok", callback_data: "ok" }]] });
    expect(results[0]).toMatchObject({ message_id: fake.sent[0]!.messageId, chat: { id: 8, type: "private" }, text: "one" });
    expect(fake.edits).toEqual([{ chatId: "8", messageId: fake.sent[0]!.messageId, text: "one (edited)" }]);
    expect(fake.calls.filter((c) => c.method === "sendChatAction").length).toBe(1);

    const press = fake.callbackUpdate(8, "a");
    (press.callback_query as { message: { message_id: number } }).message.message_id = fake.sent[0]!.messageId;
    expect((await handle(webhookRequest(press))).status).toBe(200);
    await safe.idle();
    expect(fake.answeredCallbacks.length).toBe(1);
    expect(fake.edits.map((e) => e.text)).toEqual(["one (edited)", "picked a"]);
    expect((await outboxKeys(safe)).length).toBe(3); // nothing of the button press was journaled
    expect((await safe.durability.inbox.get(fake.inboundId(press)))?.state).toBe("done");
  });

  test("a rerun of the middleware (after a failure) is answered from the outbox: nothing is sent twice", async () => {
    const { fake, bot, safe } = setup();
    const replies: unknown[] = [];
    let runs = 0;
    bot.on("message:text", async (ctx) => {
      runs++;
      replies.push(await ctx.reply("working"));
      if (runs === 1) throw new Error("the process died here, say");
      await ctx.reply("done");
    });
    await safe.start();
    const update = fake.textUpdate(9, "go");
    expect((await webhookCallback(bot, "std/http")(webhookRequest(update))).status).toBe(200);
    await safe.idle();
    expect(runs).toBe(2);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["working", "done"]);
    // The first run got the real Message; the rerun the minimal one the outbox keeps.
    expect(replies[0]).toMatchObject({ message_id: 1, chat: { id: 9, type: "private" }, text: "working" });
    expect(replies[1]).toEqual({ message_id: 1, chat: { id: 9 } });
    expect(safe.durability.metrics().outboxDeduped).toBe(1);
  });

  test("calls with no chat_id that spend Stars (sendGift to a user, a business account's transfer) are journaled: a rerun does not repeat them", async () => {
    const { fake, bot, safe } = setup();
    const answers: unknown[] = [];
    let runs = 0;
    bot.on("message:text", async (ctx) => {
      runs++;
      answers.push(await ctx.api.sendGift(ctx.from.id, "gift-1"));
      answers.push(await ctx.api.transferBusinessAccountStars("bc-1", 10));
      if (runs === 1) throw new Error("the handler failed after paying");
    });
    fake.inject("sendGift", { kind: "body", body: JSON.stringify({ ok: true, result: true }) } as never, 5);
    fake.inject("transferBusinessAccountStars", { kind: "body", body: JSON.stringify({ ok: true, result: true }) } as never, 5);
    await safe.start();
    const update = fake.textUpdate(31, "pay");
    expect((await webhookCallback(bot, "std/http")(webhookRequest(update))).status).toBe(200);
    await safe.idle();
    expect(runs).toBe(2);
    const gifts = fake.calls.filter((c) => c.method === "sendGift");
    expect(gifts.length).toBe(1);
    expect(gifts[0]!.params).toMatchObject({ user_id: 31, gift_id: "gift-1" });
    expect(gifts[0]!.params.chat_id).toBeUndefined();
    expect(fake.calls.filter((c) => c.method === "transferBusinessAccountStars").length).toBe(1);
    expect(answers).toEqual([true, true, true, true]);
    const id = fake.inboundId(update);
    const entries = await safe.durability.outbox.list();
    expect(entries.map((e) => [e.key, e.chatId]).sort()).toEqual([[`${id}:1`, "31"], [`${id}:2`, "business:bc-1"]]);
  });

  test("on a rerun, a passed-through call that fails only because the first run's took effect succeeds", async () => {
    const { fake, bot, safe } = setup();
    let runs = 0;
    const errors: unknown[] = [];
    bot.on("callback_query:data", async (ctx) => {
      runs++;
      try {
        await ctx.answerCallbackQuery();
        await ctx.editMessageText("picked");
      } catch (error) {
        errors.push(error);
        throw error;
      }
      if (runs === 1) {
        // What Telegram answers when the same calls are made again.
        fake.inject("answerCallbackQuery", { kind: "status", status: 400, description: "Bad Request: query is too old and response timeout expired or query ID is invalid" });
        fake.inject("editMessageText", { kind: "status", status: 400, description: "Bad Request: message is not modified" });
        throw new Error("the process died here, say");
      }
      await ctx.reply("noted");
    });
    await safe.start();
    const first = await bot.api.sendMessage(21, "Pick one"); // outside a handler: journaled under a random key
    const press = fake.callbackUpdate(21, "a");
    (press.callback_query as { message: { message_id: number } }).message.message_id = first.message_id;
    await webhookCallback(bot, "std/http")(webhookRequest(press));
    await safe.idle();
    expect(runs).toBe(2);
    expect(errors).toEqual([]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["Pick one", "noted"]);
    expect(fake.calls.filter((c) => c.method === "answerCallbackQuery").map((c) => c.status)).toEqual([200, 400]);
    expect(fake.calls.filter((c) => c.method === "editMessageText").map((c) => c.status)).toEqual([200, 400]);
    expect((await safe.durability.inbox.get(fake.inboundId(press)))?.state).toBe("done");
    const keys = await outboxKeys(safe);
    expect(keys.filter((k) => k.startsWith("rnd:")).length).toBe(1);
    expect(keys.filter((k) => !k.startsWith("rnd:"))).toEqual([`${fake.inboundId(press)}:1`]);
  });

  test("a send that ends dead throws the GrammyError grammY would have thrown", async () => {
    const { fake, bot, safe } = setup({ retries: 0 });
    const errors: unknown[] = [];
    bot.on("message:text", async (ctx) => {
      try {
        await ctx.reply("hello?");
      } catch (error) {
        errors.push(error);
      }
    });
    await safe.start();
    fake.block(10);
    await webhookCallback(bot, "std/http")(webhookRequest(fake.textUpdate(10, "hi")));
    await safe.idle();
    expect(errors.length).toBe(1);
    expect(errors[0]).toBeInstanceOf(GrammyError);
    expect((errors[0] as GrammyError).error_code).toBe(403);
    expect((errors[0] as GrammyError).method).toBe("sendMessage");
    expect((await safe.durability.outbox.list())[0]?.state).toBe("dead");
  });

  test("a send queued for a retry answers a placeholder (message_id 0) and the outbox delivers it", async () => {
    const { fake, bot, safe } = setup();
    const replies: unknown[] = [];
    bot.on("message:text", async (ctx) => {
      replies.push(await ctx.reply("later"));
    });
    await safe.start();
    fake.inject("sendMessage", { kind: "status", status: 502 });
    await webhookCallback(bot, "std/http")(webhookRequest(fake.textUpdate(11, "hi")));
    await safe.idle();
    expect(replies).toEqual([{ message_id: 0, chat: { id: 11 } }]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["later"]);
  });

  test("an update the journal does not take is not acknowledged: the webhook call fails", async () => {
    const { fake, bot, safe } = setup();
    bot.on("message", () => {});
    await safe.start();
    const handle = webhookCallback(bot, "std/http");
    await safe.stop();
    await expect(handle(webhookRequest(fake.textUpdate(12, "hi")))).rejects.toThrow(/stopped/);
    // So is a direct call of handleUpdate, when the bot is not long polling.
    await expect(bot.handleUpdate(fake.textUpdate(12, "hi again") as never)).rejects.toThrow(/stopped/);
  });

  test("a node:http webhook (grammY's http adapter)", async () => {
    const { fake, bot, safe } = setup();
    bot.on("message:text", (ctx) => ctx.reply(`node: ${ctx.message.text}`));
    await safe.start();
    const server: Server = createServer(webhookCallback(bot, "http"));
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
    cleanups.push(() => new Promise<void>((resolve) => server.close(() => resolve())));
    const port = (server.address() as { port: number }).port;
    const update = fake.textUpdate(13, "hey");
    expect(await fake.deliverWebhook(`http://127.0.0.1:${port}/`, update)).toEqual([200]);
    expect(await fake.deliverWebhook(`http://127.0.0.1:${port}/`, update)).toEqual([200]);
    await safe.idle();
    expect(fake.sent.map((s) => s.params.text)).toEqual(["node: hey"]);
  });

  test("grammY's long polling (bot.start()): offsets confirm journaled updates, a redelivery is dropped", async () => {
    const { fake, bot, safe } = setup();
    bot.on("message:text", (ctx) => ctx.reply(`polled: ${ctx.message.text}`));
    await safe.start();
    const first = fake.push(fake.textUpdate(14, "a"));
    fake.push(fake.textUpdate(14, "b"));
    void bot.start({ timeout: 1 });
    await fake.until("two replies", () => fake.sent.length === 2, 15_000);
    fake.redeliver(first);
    fake.push(fake.textUpdate(14, "c"));
    await fake.until("the third reply", () => fake.sent.length === 3, 15_000);
    await bot.stop();
    await safe.idle();
    expect(fake.sent.map((s) => s.params.text)).toEqual(["polled: a", "polled: b", "polled: c"]);
    expect(fake.pending).toBe(0);
  });

  test("long polling: an update the journal refused is asked for again (the offset does not pass it), and handled once", async () => {
    const { fake, bot, safe } = setup({ admitFailures: 2 });
    const errors: Error[] = [];
    safe.on("error", (error) => errors.push(error));
    bot.on("message:text", (ctx) => ctx.reply(`polled: ${ctx.message.text}`));
    await safe.start();
    const first = fake.push(fake.textUpdate(18, "a"));
    fake.push(fake.textUpdate(18, "b"));
    void bot.start({ timeout: 1 });
    await fake.until("two replies", () => fake.sent.length === 2, 15_000);
    await bot.stop();
    await safe.idle();
    expect(fake.sent.map((s) => s.params.text)).toEqual(["polled: a", "polled: b"]);
    expect(errors.some((e) => /journal unavailable/.test(e.message + String(e.cause)))).toBe(true);
    // A getUpdates asked for the refused update again, after one had confirmed nothing past it.
    expect(fake.offsets).toContain(first.update_id as number);
  });

  test("@grammyjs/runner: updates handled concurrently across chats, in order within a chat, once each", async () => {
    const { fake, bot, safe } = setup();
    bot.on("message:text", async (ctx) => {
      await new Promise((resolve) => setTimeout(resolve, Math.random() * 20));
      await ctx.reply(`ran: ${ctx.message.text}`);
    });
    await safe.start();
    const updates = [];
    for (let i = 0; i < 10; i++) updates.push(fake.push(fake.textUpdate(100 + (i % 3), `m${i}`)));
    const runner = run(bot, { runner: { fetch: { timeout: 1 } } });
    cleanups.push(() => (runner.isRunning() ? runner.stop() : undefined));
    await fake.until("ten replies", () => fake.sent.length === 10, 15_000);
    fake.redeliver(updates[0]!);
    await fake.until("the redelivery is confirmed", () => fake.pending === 0, 15_000);
    await runner.stop();
    await safe.idle();
    expect(fake.sent.length).toBe(10);
    for (const chat of ["100", "101", "102"]) {
      const texts = fake.sent.filter((s) => s.chatId === chat).map((s) => Number(String(s.params.text).slice(6)));
      expect(texts).toEqual([...texts].sort((a, b) => a - b));
    }
  });

  test("grammY's session plugin works as before", async () => {
    const { fake, bot, safe } = setup();
    type SessionContext = Context & SessionFlavor<{ count: number }>;
    const counting = bot as unknown as GrammyBot<SessionContext>;
    counting.use(session({ initial: () => ({ count: 0 }) }));
    counting.on("message:text", (ctx) => ctx.reply(`count ${++ctx.session.count}`));
    await safe.start();
    const handle = webhookCallback(bot, "std/http");
    for (const text of ["a", "b", "c"]) await handle(webhookRequest(fake.textUpdate(15, text)));
    await handle(webhookRequest(fake.textUpdate(16, "other chat")));
    await safe.idle();
    // Chats run side by side; within a chat, in order.
    expect(fake.sent.filter((s) => s.chatId === "15").map((s) => s.params.text)).toEqual(["count 1", "count 2", "count 3"]);
    expect(fake.sent.filter((s) => s.chatId === "16").map((s) => s.params.text)).toEqual(["count 1"]);
  });

  test("updates of other kinds are journaled too, in the chat they name", async () => {
    const { fake, bot, safe } = setup();
    const edited: string[] = [];
    bot.on("edited_message:text", (ctx) => {
      edited.push(ctx.editedMessage.text);
    });
    await safe.start();
    const update = { update_id: 555, edited_message: { message_id: 3, date: 1, edit_date: 2, chat: { id: 17, type: "private" }, text: "fixed" } };
    await webhookCallback(bot, "std/http")(webhookRequest(update));
    await safe.idle();
    expect(edited).toEqual(["fixed"]);
    const record = await safe.durability.inbox.get(`tg:${fake.botId}:555:edited_message`);
    expect(record).toMatchObject({ chatId: "17", state: "done" });
  });

  test("an upload (InputFile) is sent once, directly: its content cannot be journaled", async () => {
    const { fake, bot, safe } = setup();
    const replies: unknown[] = [];
    bot.on("message:text", async (ctx) => {
      replies.push(await ctx.replyWithPhoto(new InputFile(new Uint8Array([1, 2, 3]), "dot.jpg"), { caption: "a dot" }));
      replies.push(await ctx.reply("and a text"));
    });
    await safe.start();
    const update = fake.textUpdate(19, "photo please");
    await webhookCallback(bot, "std/http")(webhookRequest(update));
    await safe.idle();
    expect(fake.sent.map((s) => s.method)).toEqual(["sendPhoto", "sendMessage"]);
    expect(String(fake.sent[0]!.params.photo)).toMatch(/^attach:\/\//); // uploaded as multipart
    expect(fake.sent[0]!.params.caption).toBe("a dot");
    expect(replies[0]).toMatchObject({ message_id: fake.sent[0]!.messageId });
    expect(await outboxKeys(safe)).toEqual([`${fake.inboundId(update)}:2`]);
  });

  test("dead letters, the console, Prometheus and a replay work on the grammY bot", async () => {
    const { fake, bot, safe } = setup({ retries: 0 });
    const dead: string[] = [];
    safe.on("error", () => {});
    safe.on("durability:dead", (d) => dead.push(d.id));
    let fixed = false;
    bot.on("message:text", async (ctx) => {
      if (!fixed) throw new Error("a bug in the middleware");
      await ctx.reply("fixed");
    });
    await safe.start();
    const update = fake.textUpdate(20, "boom");
    const id = fake.inboundId(update);
    await webhookCallback(bot, "std/http")(webhookRequest(update));
    await safe.idle();
    expect(dead).toEqual([id]);
    const auth = { authorization: `Basic ${btoa("ops:correct horse")}` };
    const console = durabilityConsole(safe, { auth: basicAuth("ops", "correct horse") });
    const page = await (await console(new Request("http://console.test/inbound?state=dead", { headers: auth }))).text();
    expect(page).toContain(escapeHtml(id));
    expect(await prometheusMetrics(safe)).toContain('botmesh_durable_inbox_records{state="dead"} 1');
    fixed = true;
    expect(await safe.durability.replayInbound(id)).toBe(true);
    await fake.until("the reply of the replay", () => fake.sent.length === 1);
    await safe.idle();
    expect(fake.sent.map((s) => s.params.text)).toEqual(["fixed"]);
    expect((await safe.durability.inbox.get(id))?.state).toBe("done");
  });
});

test("durable() refuses a second call on the same bot, and a bot that is not one", () => {
  const bot = new GrammyBot("123456:ABC-DEF");
  durable(bot, { durability: { backend: new MemoryDurability() } });
  expect(() => durable(bot, { durability: { backend: new MemoryDurability() } })).toThrow(/already durable/);
  expect(() => durable({} as never, { durability: { backend: new MemoryDurability() } })).toThrow(/must be a grammY Bot/);
  expect(() => durable(new GrammyBot("123456:ABC-DEF"), {} as never)).toThrow(/"durability" is required/);
});

test("which methods are journaled", () => {
  const spending = ["sendGift", "giftPremiumSubscription", "transferBusinessAccountStars", "postStory", "repostStory", "answerGuestQuery"];
  for (const m of ["sendMessage", "sendPhoto", "sendMediaGroup", "forwardMessage", "forwardMessages", "copyMessage", "copyMessages", "sendPoll", ...spending]) {
    expect(isJournaledMethod(m), m).toBe(true);
  }
  for (const m of ["sendChatAction", "sendMessageDraft", "editMessageText", "answerCallbackQuery", "deleteMessage", "getMe", "setMessageReaction"]) {
    expect(isJournaledMethod(m), m).toBe(false);
  }
});

test("a durable() call that fails validation leaves the bot free: the next call reports its own error, or succeeds", () => {
  const bot = new GrammyBot("123456:ABC-DEF");
  expect(() => durable(bot, { durability: {} } as never)).toThrow(/"durability.backend" is required/);
  expect(() => durable(bot, { durability: { backend: new MemoryDurability(), inbox: { retries: "3" } } } as never)).toThrow(/retries/);
  expect(() => durable(bot, { durability: { backend: new MemoryDurability() } })).not.toThrow();
  expect(() => durable(bot, { durability: { backend: new MemoryDurability() } })).toThrow(/already durable/);
});

test("a reply made while safe.stop() drains is journaled: the rerun after the restart does not send it again", async () => {
  const fake = new FakeTelegram().start();
  cleanups.push(() => fake.stop());
  const backend = new MemoryDurability();
  let release!: () => void;
  const gate = new Promise<void>((resolve) => (release = resolve));
  let runs = 0;
  const handler = async (ctx: Context) => {
    runs++;
    await ctx.reply("A");
    if (runs === 1) await gate;
    await ctx.reply("B");
    if (runs === 1) throw new Error("the LLM call failed during shutdown");
  };
  const options = { durability: { backend, instanceId: "drain", inbox: { backoff: { baseMs: 10, capMs: 20 } } } };
  const bot = botOf(fake);
  bot.on("message", handler);
  const safe = durable(bot, options);
  await safe.start();
  const update = fake.textUpdate(41, "go");
  await bot.handleUpdate(update as never);
  await fake.until("the first reply", () => fake.sent.length === 1);
  const stopping = safe.stop();
  await new Promise((resolve) => setTimeout(resolve, 50));
  release();
  await stopping;
  expect((await backend.outbox.list()).map((e) => e.key).sort()).toEqual([`${fake.inboundId(update)}:1`, `${fake.inboundId(update)}:2`]);

  const bot2 = botOf(fake);
  bot2.on("message", handler);
  const safe2 = durable(bot2, options);
  cleanups.push(() => safe2.stop());
  // The failed record's retry is due after its backoff: the restart's recovery takes it then.
  await new Promise((resolve) => setTimeout(resolve, 100));
  await safe2.start();
  await fake.until("the rerun", () => runs === 2, 15_000);
  await safe2.idle();
  expect((await backend.inbox.get(fake.inboundId(update)))?.state).toBe("done");
  expect(runs).toBe(2);
  expect(fake.sent.map((s) => s.params.text)).toEqual(["A", "B"]);
}, 30_000);

test("@grammyjs/runner still running after safe.stop(): its getUpdates back off, they do not spin", async () => {
  const fake = new FakeTelegram().start();
  cleanups.push(() => fake.stop());
  const bot = botOf(fake);
  bot.on("message", (ctx) => ctx.reply("ok"));
  const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "runner-stop" } });
  await safe.start();
  const runner = run(bot, { runner: { fetch: { timeout: 1 } } });
  fake.push(fake.textUpdate(42, "a"));
  await fake.until("the reply", () => fake.sent.length === 1, 15_000);
  await safe.stop();
  const before = fake.calls.filter((c) => c.method === "getUpdates").length;
  fake.push(fake.textUpdate(42, "b"));
  await new Promise((resolve) => setTimeout(resolve, 1500));
  const polls = fake.calls.filter((c) => c.method === "getUpdates").length - before;
  await runner.stop();
  // The refused update is asked for again with a growing pause (0.5 s, 1 s, …), not thousands of times.
  expect(polls).toBeLessThan(20);
  expect(fake.sent.length).toBe(1);
  expect(fake.pending).toBe(1); // never confirmed: the next start gets it
});

test("Telegram's rate limits by default: a burst of replies in one chat waits for its slots and gets real Messages, ahead of a queued broadcast", async () => {
  // Telegram's limits, the windows a little shorter: a limiter running exactly at a strict limit can
  // see the odd 429 from network jitter (it is paused and retried, see docs/rate-limits.md).
  const fake = new FakeTelegram({ limits: telegramLimits(1.05) }).start();
  cleanups.push(() => fake.stop());
  const bot = botOf(fake);
  const replies: { message_id: number }[] = [];
  const edits: string[] = [];
  bot.on("message", async (ctx) => {
    for (let i = 0; i < 3; i++) {
      const message = await ctx.reply(`part ${i}`);
      replies.push(message);
      await ctx.api.editMessageText(ctx.chat.id, message.message_id, `part ${i} (edited)`).then(() => edits.push(`part ${i}`));
    }
  });
  const safe = durable(bot, { durability: { backend: new MemoryDurability(), instanceId: "limits", inbox: { retries: 0 } } });
  cleanups.push(() => safe.stop());
  await safe.start();
  // A broadcast of 150 sends (five seconds of the global limit) queued before the update.
  for (let i = 0; i < 150; i++) await safe.core.enqueue(String(1000 + i), `news ${i}`);
  await bot.handleUpdate(fake.textUpdate(43, "go") as never);
  await safe.idle();
  expect(replies.map((m) => m.message_id)).toEqual([1, 2, 3]);
  expect(edits).toEqual(["part 0", "part 1", "part 2"]);
  const order = fake.sent.map((s) => String(s.params.text));
  expect(order.filter((t) => t.startsWith("news")).length).toBe(150);
  // The handler's replies went ahead of the broadcast: the last one is out before its last sends.
  expect(order.indexOf("part 2")).toBeLessThan(order.indexOf("news 149"));
}, 60_000);
