// durableStorage of @botmesh/durable/grammy: grammY sessions (and @grammyjs/conversations v2 state)
// whose writes take effect with the update's done mark. A rerun of an update (a retry after a throw,
// a recovery after a crash) sees the session as it was before the update; a dead-lettered update's
// write never takes effect; a finished update's write is never lost. On the memory backend with a
// MemoryStore and on SQLite (SQLiteStore for the journal and the sessions).
import { afterAll, beforeEach, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot as GrammyBot, type Context, session, type SessionFlavor } from "grammy";
import { type Conversation, type ConversationFlavor, conversations, createConversation } from "@grammyjs/conversations";
import type { SessionStore } from "../mod.ts";
import type { DurabilityBackend } from "../backend.ts";
import { durable, durableConversations, type DurableGrammy, durableStorage } from "../providers/grammy/mod.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { cleanupsAfterEach, sessionBackends } from "./support/plugin_tests.ts";

const MARK = "@botmesh/durable:session";

const dir = mkdtempSync(join(tmpdir(), "botmesh-grammy-session-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const cleanups = cleanupsAfterEach();

const KINDS = sessionBackends(dir);
let kind = "memory";

type Counting = Context & SessionFlavor<{ count: number }>;

function botOf<C extends Context>(fake: FakeTelegram): GrammyBot<C> {
  return new GrammyBot<C>(fake.token, {
    client: { apiRoot: fake.url },
    botInfo: { id: fake.botId, is_bot: true, first_name: "Fake", username: "fake_bot" } as never,
  });
}

function setup<C extends Context = Counting>(options: { retries?: number } = {}) {
  const fake = new FakeTelegram().start();
  const bot = botOf<C>(fake);
  const { backend, store: inner, close } = KINDS[kind]!();
  // Counted: the store's reads and writes, the inbox reads (what a session read and write cost).
  const counts = { get: 0, set: 0, delete: 0, inboxGet: 0 };
  const store: SessionStore = {
    get: (key) => (counts.get++, inner.get(key)),
    set: (key, value, options) => (counts.set++, inner.set(key, value, options)),
    delete: (key) => (counts.delete++, inner.delete(key)),
  };
  const inbox = backend.inbox as { get: DurabilityBackend["inbox"]["get"] };
  const get = inbox.get.bind(inbox);
  inbox.get = (id) => (counts.inboxGet++, get(id));
  const safe = durable(bot, {
    durability: {
      backend,
      instanceId: "grammy-session-test",
      inbox: { retries: options.retries ?? 3, backoff: { baseMs: 10, capMs: 20 } },
      outbox: { backoff: { baseMs: 10, capMs: 20 }, rateLimit: false },
    },
  });
  const errors: unknown[] = [];
  safe.on("error", (error) => errors.push(error)); // the handlers that throw on purpose
  cleanups.push(async () => {
    await safe.stop();
    await close();
    await fake.stop();
  });
  return { fake, bot, safe, store, counts };
}

/** Deliver `updates` as Telegram would (journaled by handleUpdate), and wait until all are handled. */
async function deliver(bot: GrammyBot<never>, safe: DurableGrammy, updates: Record<string, unknown>[]): Promise<void> {
  for (const update of updates) await bot.handleUpdate(update as never);
  await safe.idle();
}

for (const name of Object.keys(KINDS)) describe(`durableStorage (${name})`, () => {
  beforeEach(() => {
    kind = name;
  });

  test("a session counter is incremented once per update, per chat", async () => {
    const { fake, bot, safe, store } = setup();
    const storage = durableStorage<{ count: number }>(safe, store);
    bot.use(session({ initial: () => ({ count: 0 }), storage }));
    bot.on("message:text", (ctx) => {
      ctx.session.count++;
    });
    await safe.start();
    const updates = [1, 2, 1, 1, 2, 3, 1].map((chat, i) => fake.textUpdate(chat, `m${i}`));
    await deliver(bot as never, safe, updates);
    expect(await storage.read("1")).toEqual({ count: 4 });
    expect(await storage.read("2")).toEqual({ count: 2 });
    expect(await storage.read("3")).toEqual({ count: 1 });
    expect(await storage.has("4")).toBe(false);
    // Stored as an envelope: the value, the update that wrote it, the value before it.
    const last = updates[6]!;
    expect(await store.get("1")).toEqual({ [MARK]: 1, v: { count: 4 }, by: fake.inboundId(last), prev: { count: 3 } });
  });

  test("cost: per update, one store read, one store write and at most one inbox read; a run's reads share one", async () => {
    const { fake, bot, safe, store, counts } = setup();
    bot.use(session({ initial: () => ({ count: 0 }), storage: safe.storage(store) }));
    const reads: unknown[] = [];
    const storage = safe.storage<{ count: number }>(store);
    bot.on("message:text", async (ctx) => {
      ctx.session.count++;
      reads.push(...await Promise.all([storage.read("other"), storage.read("other")]));
    });
    await safe.start();
    await storage.write("other", { count: 7 });
    await deliver(bot as never, safe, [fake.textUpdate(11, "a")]);
    const per: (typeof counts)[] = [];
    for (const text of ["b", "c", "d"]) {
      const before = { ...counts };
      await deliver(bot as never, safe, [fake.textUpdate(11, text)]);
      per.push({ get: counts.get - before.get, set: counts.set - before.set, delete: counts.delete - before.delete, inboxGet: counts.inboxGet - before.inboxGet });
    }
    // The session: one read, one write, one inbox read (its writer, the previous update, not yet seen
    // done). "other": one read shared by the run's two reads, no inbox read (written outside an update).
    expect(per).toEqual(Array(3).fill({ get: 2, set: 1, delete: 0, inboxGet: 1 }));
    expect(reads).toEqual(Array(8).fill({ count: 7 }));
    expect(await storage.read("11")).toEqual({ count: 4 });
  });

  test("a handler that throws after the session was written: retried, the counter applied once when it succeeds", async () => {
    const { fake, bot, safe, store } = setup({ retries: 3 });
    const seen: number[] = [];
    let failures = 2;
    // Installed before session(): it throws after session() has written the session back.
    bot.use(async (_ctx, next) => {
      await next();
      if (failures-- > 0) throw new Error("after the session was written");
    });
    bot.use(session({ initial: () => ({ count: 0 }), storage: safe.storage(store) }));
    bot.on("message:text", (ctx) => {
      seen.push(ctx.session.count);
      ctx.session.count++;
    });
    await safe.start();
    const first = fake.textUpdate(5, "one");
    await deliver(bot as never, safe, [first]);
    expect(seen).toEqual([0, 0, 0]); // each run sees the session as it was before the update
    expect((await safe.durability.inbox.get(fake.inboundId(first)))?.state).toBe("done");
    await deliver(bot as never, safe, [fake.textUpdate(5, "two")]);
    expect(seen).toEqual([0, 0, 0, 1]);
    expect(await safe.storage(store).read("5")).toEqual({ count: 2 });
  });

  test("the same store without durableStorage applies the update once per run (the failure this fixes)", async () => {
    const { fake, bot, safe, store } = setup({ retries: 3 });
    let failures = 2;
    bot.use(async (_ctx, next) => {
      await next();
      if (failures-- > 0) throw new Error("after the session was written");
    });
    const plain = { read: (k: string) => store.get(k), write: (k: string, v: unknown) => store.set(k, v as never), delete: (k: string) => store.delete(k) };
    bot.use(session({ initial: () => ({ count: 0 }), storage: plain as never }));
    bot.on("message:text", (ctx) => {
      ctx.session.count++;
    });
    await safe.start();
    await deliver(bot as never, safe, [fake.textUpdate(5, "one")]);
    expect(await store.get("5")).toEqual({ count: 3 });
  });

  test("a dead-lettered update's session write never takes effect; a replay applies it once", async () => {
    const { fake, bot, safe, store } = setup<Context & SessionFlavor<{ count: number; texts: string[] }>>({ retries: 2 });
    let failing = true;
    bot.use(async (ctx, next) => {
      await next();
      if (failing && ctx.message?.text === "bad") throw new Error("always");
    });
    bot.use(session({ initial: () => ({ count: 0, texts: [] as string[] }), storage: safe.storage(store) }));
    bot.on("message:text", (ctx) => {
      ctx.session.count++;
      ctx.session.texts.push(ctx.message.text);
    });
    await safe.start();
    const bad = fake.textUpdate(6, "bad");
    await deliver(bot as never, safe, [fake.textUpdate(6, "a"), bad]);
    expect((await safe.durability.inbox.get(fake.inboundId(bad)))?.state).toBe("dead");
    const storage = safe.storage(store);
    expect(await storage.read("6")).toEqual({ count: 1, texts: ["a"] });
    await deliver(bot as never, safe, [fake.textUpdate(6, "b")]);
    expect(await storage.read("6")).toEqual({ count: 2, texts: ["a", "b"] });
    // An operator replays it once the cause is fixed: applied once, on top of what came since.
    failing = false;
    expect(await safe.durability.replayInbound(fake.inboundId(bad))).toBe(true);
    await fake.until("the replay", async () => (await safe.durability.inbox.get(fake.inboundId(bad)))?.state === "done");
    expect(await storage.read("6")).toEqual({ count: 3, texts: ["a", "b", "bad"] });
  });

  test("a rerun after a crash between the session write and the done mark sees the value before the update", async () => {
    const { fake, bot, safe, store } = setup();
    const update = fake.textUpdate(7, "again");
    const id = fake.inboundId(update);
    // What a run of this update left when the process died after session() wrote, before the done mark.
    await store.set("7", { [MARK]: 1, v: { count: 11 }, by: id, prev: { count: 10 } });
    let release!: () => void;
    const gate = new Promise<void>((resolve) => (release = resolve));
    let entered!: () => void;
    const running = new Promise<void>((resolve) => (entered = resolve));
    const seen: number[] = [];
    bot.use(async (_ctx, next) => {
      entered();
      await gate;
      await next();
    });
    bot.use(session({ initial: () => ({ count: 0 }), storage: safe.storage(store) }));
    bot.on("message:text", (ctx) => {
      seen.push(ctx.session.count);
      ctx.session.count++;
    });
    await safe.start();
    await bot.handleUpdate(update as never);
    await running;
    // Meanwhile, a reader elsewhere (another chat sharing the key) sees the value before it too: not done.
    const storage = safe.storage<{ count: number }>(store);
    expect((await safe.durability.inbox.get(id))?.state).toBe("processing");
    expect(await storage.read("7")).toEqual({ count: 10 });
    release();
    await safe.idle();
    expect(seen).toEqual([10]);
    expect(await storage.read("7")).toEqual({ count: 11 });
    expect(await store.get("7")).toEqual({ [MARK]: 1, v: { count: 11 }, by: id, prev: { count: 10 } });
  });

  test("a write of an update still running is not seen by others; once done it is", async () => {
    const { fake, bot, safe, store } = setup();
    const storage = safe.storage<{ n: number }>(store);
    let release!: () => void;
    const gate = new Promise<void>((resolve) => (release = resolve));
    let written!: () => void;
    const wrote = new Promise<void>((resolve) => (written = resolve));
    const inside: unknown[] = [];
    bot.on("message:text", async () => {
      inside.push(await storage.read("shared"));
      await storage.write("shared", { n: 1 });
      inside.push(await storage.read("shared")); // the run sees its own write
      await storage.write("shared", { n: 2 });
      inside.push(await storage.has("shared"));
      written();
      await gate;
    });
    await safe.start();
    await storage.write("shared", { n: 0 }); // outside an update: at once
    const update = fake.textUpdate(8, "x");
    await bot.handleUpdate(update as never);
    await wrote;
    expect(await storage.read("shared")).toEqual({ n: 0 });
    expect(await store.get("shared")).toEqual({ [MARK]: 1, v: { n: 2 }, by: fake.inboundId(update), prev: { n: 0 } });
    release();
    await safe.idle();
    expect(inside).toEqual([{ n: 0 }, { n: 1 }, true]);
    expect(await storage.read("shared")).toEqual({ n: 2 });
  });

  test("a delete during an update takes effect with it; values stored before the adapter are read as they are", async () => {
    const { fake, bot, safe, store } = setup();
    await store.set("9", { count: 41 }); // a session written by grammY's plain storage, earlier
    let fail = 1;
    bot.use(async (_ctx, next) => {
      await next();
      if (fail-- > 0) throw new Error("once");
    });
    bot.use(session({ initial: () => ({ count: 0 }), storage: safe.storage(store) }));
    const seen: number[] = [];
    bot.on("message:text", (ctx) => {
      seen.push(ctx.session.count);
      (ctx as { session: unknown }).session = null; // grammY deletes the session
    });
    await safe.start();
    await deliver(bot as never, safe, [fake.textUpdate(9, "reset")]);
    expect(seen).toEqual([41, 41]);
    expect(await safe.storage(store).read("9")).toBeUndefined();
    expect(await safe.storage(store).has("9")).toBe(false);
  });

  test("@grammyjs/conversations v2 keeps its state in it: a retry after a throw resumes the conversation where it was, its reply is not sent again", async () => {
    type C = ConversationFlavor<Context>;
    const { fake, bot, safe, store } = setup<C>();
    let failures = 1;
    bot.use(async (ctx, next) => {
      await next();
      if (ctx.message?.text === "Ada" && failures-- > 0) throw new Error("after the conversation state was written");
    });
    bot.use(conversations({ storage: safe.storage(store), plugins: [durableConversations(safe)] }));
    bot.use(createConversation(async (conversation: Conversation<C, Context>, ctx: Context) => {
      await ctx.reply("Your name?");
      const answer = await conversation.waitFor("message:text");
      await answer.reply(`Hi ${answer.message.text}`);
    }, "greet"));
    bot.command("start", (ctx) => ctx.conversation.enter("greet"));
    await safe.start();
    await deliver(bot as never, safe, [fake.textUpdate(10, "/start", { entities: [{ type: "bot_command", offset: 0, length: 6 }] })]);
    const ada = fake.textUpdate(10, "Ada");
    await deliver(bot as never, safe, [ada]);
    // Each run of the second update resumed the conversation from its state before that update (with a
    // plain storage the retry would find it over: its first run deleted it before throwing). The greeting
    // went through the outbox under the update's first key: the retry was answered from there.
    expect(fake.sent.map((s) => s.params.text)).toEqual(["Your name?", "Hi Ada"]);
    expect((await safe.durability.outbox.get(`${fake.inboundId(ada)}:1`))?.state).toBe("sent");
    expect(await safe.storage(store).read("10")).toBeUndefined(); // the conversation ended
  });
});

describe("durableStorage arguments", () => {
  test("TypeErrors name the argument", async () => {
    kind = "memory";
    const { safe, store } = setup();
    expect(() => durableStorage({} as never, store)).toThrow(/Argument "safe"/);
    expect(() => durableStorage(safe, {} as never)).toThrow(/Argument "store"/);
    expect(() => durableStorage(safe, store, 5 as never)).toThrow(/Argument "options"/);
    expect(() => durableStorage(safe, store, { ttl: 5 } as never)).toThrow(TypeError);
    expect(() => durableStorage(safe, store, { ttlMs: "5" } as never)).toThrow(/"ttlMs"/);
    expect(() => durableStorage(safe, store, { ttlMs: 0 })).toThrow(RangeError);
    const storage = durableStorage(safe, store, { ttlMs: 60_000 });
    expect(storage.read(1 as never)).rejects.toThrow(/Argument "key"/);
    expect(storage.write("", 1)).rejects.toThrow(/Argument "key"/);
    await storage.write("k", { a: 1 });
    expect(await storage.read("k")).toEqual({ a: 1 });
  });
});
