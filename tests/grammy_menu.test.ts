// @grammyjs/menu in a durable grammY bot, against the fake Bot API (which keeps each message's text and
// keyboard, and refuses what Telegram refuses to a repeat: a second answer of a button press, an edit to
// the content a message already has). A menu with a counter button (it edits the menu's text), a
// submenu and its back button, and buttons that send messages: each press is answered once; a rerun of
// a press (its first run cut off after its calls, before the done mark, as a crash would) is answered
// from the outbox for its sends, and its repeated edits and answers succeed; a press of an outdated menu
// is answered and the menu re-rendered, as the menu intends; with the session in durableStorage the
// counter is applied once per press. On the memory backend with a MemoryStore and on SQLite.
import { afterAll, afterEach, beforeEach, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot as GrammyBot, type Context, session, type SessionFlavor, type StorageAdapter } from "grammy";
import { Menu } from "@grammyjs/menu";
import { MemoryDurability, MemoryStore, type SessionStore } from "../mod.ts";
import type { DurabilityBackend } from "../backend.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import { durable, type DurableGrammy, durableStorage } from "../providers/grammy/mod.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";

const dir = mkdtempSync(join(tmpdir(), "botmesh-grammy-menu-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
});

type Stores = { backend: DurabilityBackend; store: SessionStore; close: () => Promise<void> | void };
const KINDS: Record<string, () => Stores> = {
  memory: () => ({ backend: new MemoryDurability(), store: new MemoryStore(), close: () => {} }),
  sqlite: () => {
    const store = new SQLiteStore({ file: join(dir, `${crypto.randomUUID()}.db`) });
    return { backend: store.durability(), store, close: () => store.close() };
  },
};
let kind = "memory";

type Counter = { count: number };
type C = Context & SessionFlavor<Counter>;
const CHAT = 77;
const START = { entities: [{ type: "bot_command", offset: 0, length: 6 }] };
type Keyboard = { inline_keyboard: { text: string; callback_data?: string }[][] };

interface Options {
  /** The session storage: durableStorage (default) or grammY's plain use of the same store. */
  storage?: "durable" | "plain";
  /** The counter button's label shows the count (a press of an older rendering is outdated). */
  countInLabel?: boolean;
}

function setup(options: Options & { queryTtlMs?: number } = {}) {
  const fake = new FakeTelegram({ repeats: true, ...(options.queryTtlMs !== undefined ? { queryTtlMs: options.queryTtlMs } : {}) }).start();
  const bot = new GrammyBot<C>(fake.token, {
    client: { apiRoot: fake.url },
    botInfo: { id: fake.botId, is_bot: true, first_name: "Fake", username: "fake_bot" } as never,
  });
  const { backend, store, close } = KINDS[kind]!();
  const safe = durable(bot, {
    durability: {
      backend,
      instanceId: "grammy-menu-test",
      inbox: { retries: 3, backoff: { baseMs: 10, capMs: 20 } },
      outbox: { backoff: { baseMs: 10, capMs: 20 }, rateLimit: false },
    },
  });
  const errors: unknown[] = [];
  safe.on("error", (error) => errors.push(error));
  cleanups.push(async () => {
    await safe.stop();
    await close();
    await fake.stop();
  });
  /** Updates whose first run is cut off once the middleware ran (its calls made, its session written). */
  const cutOff = new Set<number>();
  const runs = new Map<number, number>();
  bot.use(async (ctx, next) => {
    const n = (runs.get(ctx.update.update_id) ?? 0) + 1;
    runs.set(ctx.update.update_id, n);
    await next();
    if (n === 1 && cutOff.has(ctx.update.update_id)) throw new Error("cut off before the done mark");
  });
  const plain: StorageAdapter<Counter> = {
    read: async (key) => (await store.get(key)) as Counter | undefined,
    write: (key, value) => store.set(key, value as never),
    delete: (key) => store.delete(key),
  };
  const storage = options.storage === "plain" ? plain : durableStorage<Counter>(safe, store);
  bot.use(session({ initial: () => ({ count: 0 }), storage }));
  const label = options.countInLabel ? (ctx: C) => `+1 (${ctx.session.count})` : "+1";
  const main = new Menu<C>("main")
    .text(label, async (ctx) => {
      ctx.session.count++;
      await ctx.editMessageText(`Count: ${ctx.session.count}`); // the menu keeps its keyboard on the message
    })
    .submenu("More", "more")
    .row()
    .text("Hi", (ctx) => ctx.reply(`Hi at ${ctx.session.count}`));
  const more = new Menu<C>("more")
    .text("Say", async (ctx) => {
      await ctx.reply("said one");
      await ctx.reply("said two");
    })
    .back("Back");
  main.register(more);
  bot.use(main);
  bot.command("start", (ctx) => ctx.reply(`Count: ${ctx.session.count}`, { reply_markup: main }));
  return { fake, bot, safe, store, storage, cutOff, runs, errors };
}

/** Deliver one update and wait until it is handled; the API calls (but getMe) made meanwhile. */
async function deliver(fake: FakeTelegram, bot: GrammyBot<C>, safe: DurableGrammy, update: Record<string, unknown>) {
  const from = fake.calls.length;
  await bot.handleUpdate(update as never);
  await safe.idle();
  return fake.calls.slice(from).filter((c) => c.method !== "getMe").map((c) => `${c.method} ${c.status}`);
}

/** The keyboard of a sent message as it is now. */
function keyboardOf(fake: FakeTelegram, messageId: number): Keyboard {
  return fake.message(CHAT, messageId)!.reply_markup as Keyboard;
}

/** The labels of a keyboard, row by row. */
function labels(keyboard: Keyboard | undefined): string[][] {
  return keyboard?.inline_keyboard.map((row) => row.map((b) => b.text)) ?? [];
}

/** A press of the button labelled `label` (or starting with it) of the message as it is now. */
function press(fake: FakeTelegram, messageId: number, label: string): Record<string, unknown> {
  const button = keyboardOf(fake, messageId).inline_keyboard.flat().find((b) => b.text.startsWith(label));
  if (button?.callback_data === undefined) throw new Error(`no button "${label}" on message ${messageId}`);
  return fake.pressUpdate(CHAT, messageId, button.callback_data);
}

function queryId(update: Record<string, unknown>): string {
  return (update.callback_query as { id: string }).id;
}

/** Send the menu with /start; the message id of the menu. */
async function start(fake: FakeTelegram, bot: GrammyBot<C>, safe: DurableGrammy): Promise<number> {
  await deliver(fake, bot, safe, fake.textUpdate(CHAT, "/start", START));
  return fake.sent.at(-1)!.messageId;
}

const MAIN = [["+1", "More"], ["Hi"]];
const MORE = [["Say", "Back"]];

for (const name of Object.keys(KINDS)) describe(`@grammyjs/menu (${name})`, () => {
  beforeEach(() => {
    kind = name;
  });

  test("the menu is sent through the outbox rendered; the counter edits the text and keeps the keyboard; each press answered once", async () => {
    const { fake, bot, safe, storage, errors } = setup();
    await safe.start();
    const menu = await start(fake, bot, safe);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["Count: 0"]);
    expect(labels(keyboardOf(fake, menu))).toEqual(MAIN);
    // Journaled with the keyboard the menu rendered (JSON, not the Menu).
    const [entry] = await safe.durability.outbox.list({ limit: 10 });
    expect(JSON.stringify(entry!.content)).toContain(keyboardOf(fake, menu).inline_keyboard[0]![0]!.callback_data!);
    const presses = [];
    for (let i = 0; i < 3; i++) {
      const p = press(fake, menu, "+1");
      presses.push(p);
      expect((await deliver(fake, bot, safe, p)).sort()).toEqual(["answerCallbackQuery 200", "editMessageText 200"]);
    }
    expect(fake.edits.map((e) => e.text)).toEqual(["Count: 1", "Count: 2", "Count: 3"]);
    expect(fake.message(CHAT, menu)!.text).toBe("Count: 3");
    expect(labels(keyboardOf(fake, menu))).toEqual(MAIN); // the edit carried the menu
    expect(fake.answeredCallbacks).toEqual(presses.map(queryId));
    expect(await storage.read(String(CHAT))).toEqual({ count: 3 });
    expect(fake.sent.length).toBe(1); // edits and answers pass straight through
    expect((await safe.durability.outbox.list({ limit: 10 })).length).toBe(1);
    expect(errors).toEqual([]);
  });

  test("a submenu and back: each navigation edits the keyboard of the menu's message", async () => {
    const { fake, bot, safe, errors } = setup();
    await safe.start();
    const menu = await start(fake, bot, safe);
    const toMore = press(fake, menu, "More");
    expect((await deliver(fake, bot, safe, toMore)).sort()).toEqual(["answerCallbackQuery 200", "editMessageReplyMarkup 200"]);
    expect(labels(keyboardOf(fake, menu))).toEqual(MORE);
    const back = press(fake, menu, "Back");
    expect((await deliver(fake, bot, safe, back)).sort()).toEqual(["answerCallbackQuery 200", "editMessageReplyMarkup 200"]);
    expect(labels(keyboardOf(fake, menu))).toEqual(MAIN);
    expect(fake.message(CHAT, menu)!.text).toBe("Count: 0");
    expect(fake.answeredCallbacks).toEqual([queryId(toMore), queryId(back)]);
    expect(errors).toEqual([]);
  });

  test("buttons that send messages: journaled under the press's keys", async () => {
    const { fake, bot, safe, errors } = setup();
    await safe.start();
    const menu = await start(fake, bot, safe);
    const hi = press(fake, menu, "Hi");
    expect((await deliver(fake, bot, safe, hi)).sort()).toEqual(["answerCallbackQuery 200", "sendMessage 200"]);
    await deliver(fake, bot, safe, press(fake, menu, "More"));
    const say = press(fake, menu, "Say");
    await deliver(fake, bot, safe, say);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["Count: 0", "Hi at 0", "said one", "said two"]);
    const keys = (await safe.durability.outbox.list({ limit: 10 })).map((e) => e.key);
    for (const key of [`${fake.inboundId(hi)}:1`, `${fake.inboundId(say)}:1`, `${fake.inboundId(say)}:2`]) expect(keys).toContain(key);
    expect(fake.answeredCallbacks.length).toBe(3);
    expect(errors).toEqual([]);
  });

  test("a rerun of each press (cut off after its calls, before the done mark): sends answered from the outbox, repeated edits and answers succeed, the counter applied once", async () => {
    const { fake, bot, safe, storage, cutOff, runs, errors } = setup();
    await safe.start();
    const start = fake.textUpdate(CHAT, "/start", START);
    cutOff.add(start.update_id as number);
    await deliver(fake, bot, safe, start);
    const menu = fake.sent[0]!.messageId;
    const calls: Record<string, string[]> = {};
    for (const label of ["+1", "+1", "Hi", "More", "Say", "Back", "+1"]) {
      const p = press(fake, menu, label);
      cutOff.add(p.update_id as number);
      const made = await deliver(fake, bot, safe, p);
      expect(runs.get(p.update_id as number)).toBe(2);
      calls[label] ??= made.sort();
      expect((await safe.durability.inbox.get(fake.inboundId(p)))?.state).toBe("done");
    }
    // The rerun's answer is refused as a repeat ("query is too old"), its edit as "message is not
    // modified": both succeed on a rerun. Its sends are answered from the outbox: sent once.
    expect(calls["+1"]).toEqual(["answerCallbackQuery 200", "answerCallbackQuery 400", "editMessageText 200", "editMessageText 400"]);
    expect(calls["More"]).toEqual(["answerCallbackQuery 200", "answerCallbackQuery 400", "editMessageReplyMarkup 200", "editMessageReplyMarkup 400"]);
    expect(calls["Hi"]).toEqual(["answerCallbackQuery 200", "answerCallbackQuery 400", "sendMessage 200"]);
    expect(calls["Say"]).toEqual(["answerCallbackQuery 200", "answerCallbackQuery 400", "sendMessage 200", "sendMessage 200"]);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["Count: 0", "Hi at 2", "said one", "said two"]);
    expect(safe.durability.metrics().outboxDeduped).toBe(4);
    expect(fake.edits.map((e) => e.text)).toEqual(["Count: 1", "Count: 2", "Count: 3"]);
    expect(await storage.read(String(CHAT))).toEqual({ count: 3 });
    expect(fake.message(CHAT, menu)!.text).toBe("Count: 3");
    expect(labels(keyboardOf(fake, menu))).toEqual(MAIN);
    expect(new Set(fake.answeredCallbacks).size).toBe(7);
    expect(fake.answeredCallbacks.length).toBe(7);
    // Each press ran twice (above), not three times: no call of a rerun failed.
    expect(errors).toEqual([]);
  });

  test("an outdated menu (pressed on an older rendering): answered and re-rendered, the button not run; a rerun of that too", async () => {
    const { fake, bot, safe, storage, cutOff, runs, errors } = setup({ countInLabel: true });
    await safe.start();
    const older = await start(fake, bot, safe);
    const newer = await start(fake, bot, safe);
    await deliver(fake, bot, safe, press(fake, newer, "+1"));
    expect(labels(keyboardOf(fake, newer))[0]).toEqual(["+1 (1)", "More"]);
    expect(labels(keyboardOf(fake, older))[0]).toEqual(["+1 (0)", "More"]);
    // The older message's button was rendered with the count 0: its hash no longer matches.
    const stale = press(fake, older, "+1");
    cutOff.add(stale.update_id as number);
    const made = await deliver(fake, bot, safe, stale);
    expect(made.sort()).toEqual(["answerCallbackQuery 200", "answerCallbackQuery 400", "editMessageReplyMarkup 200", "editMessageReplyMarkup 400"]);
    const answer = fake.calls.find((c) => c.method === "answerCallbackQuery" && c.params.callback_query_id === queryId(stale));
    expect(answer!.params.text).toBe("Menu was outdated, try again!");
    expect(labels(keyboardOf(fake, older))[0]).toEqual(["+1 (1)", "More"]); // re-rendered
    expect(fake.message(CHAT, older)!.text).toBe("Count: 0"); // the button did not run
    expect(await storage.read(String(CHAT))).toEqual({ count: 1 });
    // Pressed again on the fresh rendering, it runs.
    await deliver(fake, bot, safe, press(fake, older, "+1"));
    expect(fake.message(CHAT, older)!.text).toBe("Count: 2");
    expect(await storage.read(String(CHAT))).toEqual({ count: 2 });
    expect((await safe.durability.inbox.get(fake.inboundId(stale)))?.state).toBe("done");
    expect(runs.get(stale.update_id as number)).toBe(2);
    expect(errors).toEqual([]);
  });

  test("with the count in the button's label, a rerun of a counter press runs the button again (not outdated): durableStorage gives it the session before the press", async () => {
    const { fake, bot, safe, storage, cutOff } = setup({ countInLabel: true });
    await safe.start();
    const menu = await start(fake, bot, safe);
    const p = press(fake, menu, "+1");
    cutOff.add(p.update_id as number);
    await deliver(fake, bot, safe, p);
    const texts = fake.calls.filter((c) => c.method === "answerCallbackQuery").map((c) => c.params.text);
    expect(texts).toEqual([undefined, undefined]); // not "Menu was outdated"
    expect(fake.edits.map((e) => e.text)).toEqual(["Count: 1"]);
    expect(await storage.read(String(CHAT))).toEqual({ count: 1 });
  });

  test("the same store without durableStorage: the rerun applies the press again (the failure durableStorage fixes)", async () => {
    const { fake, bot, safe, store, cutOff } = setup({ storage: "plain" });
    await safe.start();
    const menu = await start(fake, bot, safe);
    const p = press(fake, menu, "+1");
    cutOff.add(p.update_id as number);
    await deliver(fake, bot, safe, p);
    expect(fake.edits.map((e) => e.text)).toEqual(["Count: 1", "Count: 2"]);
    expect(await store.get(String(CHAT))).toEqual({ count: 2 });
  });

  test("a press whose query expired before its first run (it waited in the journal): the answer fails, the update is retried, the rerun goes on without it", async () => {
    const { fake, bot, safe, storage, runs, errors } = setup({ queryTtlMs: 200 });
    await safe.start();
    const menu = await start(fake, bot, safe);
    const p = press(fake, menu, "+1");
    await Bun.sleep(250);
    await deliver(fake, bot, safe, p);
    expect(runs.get(p.update_id as number)).toBe(2);
    expect(fake.calls.filter((c) => c.method === "answerCallbackQuery").map((c) => c.status)).toEqual([400, 400]);
    expect(fake.answeredCallbacks).toEqual([]);
    // The first run's session write never took effect (its update failed): the counter is applied once.
    expect(await storage.read(String(CHAT))).toEqual({ count: 1 });
    expect(fake.edits.map((e) => e.text)).toEqual(["Count: 1"]);
    expect((await safe.durability.inbox.get(fake.inboundId(p)))?.state).toBe("done");
    expect(errors).toEqual([]);
  });
});
