// Every update of the corpus of real, documented Telegram payloads (tests/corpus/telegram/,
// sources and licences in SOURCES.md) through the webhook handler of a real Bot on
// MemoryDurability: answered 200, each user message admitted exactly once and its redelivery a
// duplicate, of the expected type, nothing unparseable acknowledged without a journaled record;
// then the whole corpus by long polling. The defects fixed in the provider each have a test on a
// real payload of the corpus (venue before location, typed service messages, unknown kinds kept
// raw, updates without file_unique_id, unreadable user updates journaled and dead-lettered).
import { afterEach, describe, expect, test } from "bun:test";
import { readdirSync, readFileSync } from "node:fs";
import { join } from "node:path";
import { type AdmitResult, type InboundSink } from "../provider.ts";
import { ANY, Bot, type DurabilityBackend, type InboundMessage, MemoryDurability } from "../mod.ts";
import { TelegramProvider, type TelegramProviderOptions } from "../providers/telegram/mod.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";

type Obj = Record<string, unknown>;

/** One corpus entry: an update as its source has it, and what the provider must make of it. */
interface Sample {
  file: string;
  name: string;
  source: string;
  licence: string;
  note?: string;
  update: Obj;
  expect: { type?: string; skipped?: string };
}

const corpusDir = join(import.meta.dir, "corpus", "telegram");
const corpus: Sample[] = readdirSync(corpusDir)
  .filter((f) => f.endsWith(".json"))
  .sort()
  .flatMap((file) => (JSON.parse(readFileSync(join(corpusDir, file), "utf8")) as Omit<Sample, "file">[]).map((s) => ({ ...s, file })));
const byName = (name: string): Sample => {
  const sample = corpus.find((s) => s.name === name);
  if (!sample) throw new Error(`No corpus sample named ${JSON.stringify(name)}`);
  return structuredClone(sample);
};

/** The update kinds that carry a user's message: never acknowledged without a record. */
const USER_KINDS = ["message", "channel_post", "business_message", "callback_query"];
/** The kinds that keep their Bot API field name as their type, with the object in `extra`. */
const TYPED = [
  "venue", "location", "contact", "poll", "dice", "paid_media", "story", "game", "invoice", "giveaway", "giveaway_winners",
  "checklist", "web_app_data", "users_shared", "chat_shared", "successful_payment", "refunded_payment", "new_chat_members",
  "left_chat_member",
];
const SECRET = "corpus_secret";
const TOKEN = "424242:corpus-token";
const BOT_ID = "424242";

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

interface Run {
  bot: Bot;
  provider: TelegramProvider;
  /** What reached the bot, with its answer. */
  received: { message: InboundMessage; status: AdmitResult["status"] }[];
  skipped: string[];
  errors: Error[];
  botErrors: Error[];
  dead: { kind: string; id: string; error: string }[];
  handled: string[];
  /** Bot API methods called (answerCallbackQuery). */
  calls: string[];
}

async function start(options: { backend?: DurabilityBackend; provider?: Partial<TelegramProviderOptions> } = {}): Promise<Run> {
  const run = { received: [], skipped: [], errors: [], botErrors: [], dead: [], handled: [], calls: [] } as unknown as Run;
  const provider = new TelegramProvider({
    token: TOKEN,
    secretToken: SECRET,
    // Nothing leaves the process: the only calls are answerCallbackQuery.
    fetch: (async (url: string | URL | Request) => {
      run.calls.push(String(url).split("/").at(-1)!);
      return new Response(JSON.stringify({ ok: true, result: true }), { headers: { "content-type": "application/json" } });
    }) as typeof fetch,
    onError: (e) => run.errors.push(e),
    onSkippedUpdate: (s) => run.skipped.push(s.kind),
    ...options.provider,
  });
  const startProvider = provider.start.bind(provider);
  provider.start = (sink: InboundSink) =>
    startProvider({
      receive: async (message) => {
        const result = await sink.receive(message);
        run.received.push({ message, status: result.status });
        return result;
      },
      ...(sink.reportError ? { reportError: sink.reportError.bind(sink) } : {}),
      ...(sink.confirmSent ? { confirmSent: sink.confirmSent.bind(sink) } : {}),
    });
  const bot = new Bot({
    provider,
    durability: { backend: options.backend ?? new MemoryDurability(), instanceId: "tg-corpus", inbox: { retries: 1, backoff: { baseMs: 5, capMs: 10 } } },
  });
  bot.on("error", (e) => run.botErrors.push(e));
  bot.on("durability:dead", (d) => run.dead.push(d as Run["dead"][number]));
  bot.when(ANY, (ctx) => void run.handled.push(ctx.message.id));
  await bot.start();
  cleanups.push(() => bot.stop());
  Object.assign(run, { bot, provider });
  return run;
}

function post(update: unknown): Request {
  return new Request("http://bot.test/telegram", {
    method: "POST",
    headers: { "content-type": "application/json", "x-telegram-bot-api-secret-token": SECRET },
    body: JSON.stringify(update),
  });
}

/** POST the update twice (a delivery and Telegram's redelivery of it); both must be answered 200. */
async function deliverTwice(run: Run, update: unknown): Promise<string[]> {
  const texts: string[] = [];
  for (let i = 0; i < 2; i++) {
    const response = await run.provider.webhook(post(update));
    texts.push(await response.text());
    expect(response.status, texts.at(-1)).toBe(200);
  }
  await run.bot.idle();
  return texts;
}

const messageOf = (update: Obj): Obj | undefined => {
  const key = USER_KINDS.find((k) => update[k] !== undefined);
  return key === undefined || key === "callback_query" ? undefined : update[key] as Obj;
};

test("the corpus: at least 60 updates, every one with its source, a permissive licence and an expectation", () => {
  expect(corpus.length).toBeGreaterThanOrEqual(60);
  const sources = readFileSync(join(corpusDir, "SOURCES.md"), "utf8");
  for (const s of corpus) {
    expect(typeof s.name === "string" && s.name !== "", s.file).toBe(true);
    expect(s.source, s.name).toMatch(/^(https:\/\/core\.telegram\.org\/|[\w.-]+\/[\w.-]+ \S+@[0-9a-f]{40})/);
    expect(["MIT", "Apache-2.0", "BSD-2-Clause", "BSD-3-Clause", "ISC", "CC0-1.0", "Telegram Bot API documentation example"], s.name).toContain(s.licence);
    expect(typeof s.update.update_id, s.name).toBe("number");
    expect(s.expect.type !== undefined || s.expect.skipped !== undefined, s.name).toBe(true);
    // SOURCES.md names every repository (or the docs page) the corpus draws from.
    expect(sources, s.name).toContain(s.source.startsWith("https://") ? s.source.split("#")[0]! : s.source.split(" ")[0]!);
  }
  expect(new Set(corpus.map((s) => `${s.file}: ${s.name}`)).size).toBe(corpus.length);
  // What the corpus must cover.
  const types = new Set(corpus.map((s) => s.expect.type ?? `skipped:${s.expect.skipped}`));
  for (
    const kind of [
      "text", "image", "document", "audio", "video", "sticker", "location", "venue", "contact", "poll", "dice", "interaction",
      "web_app_data", "users_shared", "chat_shared", "successful_payment", "new_chat_members", "left_chat_member", "other",
      "skipped:edited_message", "skipped:inline_query", "skipped:new_update_kind",
    ]
  ) expect(types, kind).toContain(kind);
  expect(corpus.some((s) => s.update.channel_post !== undefined)).toBe(true);
  expect(corpus.some((s) => isObj(messageOf(s.update)) && (messageOf(s.update)!.forward_from !== undefined || messageOf(s.update)!.forward_origin !== undefined))).toBe(true);
  expect(corpus.some((s) => isObj(messageOf(s.update)) && messageOf(s.update)!.reply_to_message !== undefined)).toBe(true);
  expect(corpus.some((s) => isObj(messageOf(s.update)) && messageOf(s.update)!.entities !== undefined)).toBe(true);
  expect(corpus.some((s) => isObj(messageOf(s.update)) && messageOf(s.update)!.animation !== undefined)).toBe(true);
});

function isObj(v: unknown): v is Obj {
  return typeof v === "object" && v !== null && !Array.isArray(v);
}

describe("every corpus update through the webhook", () => {
  for (const sample of corpus) {
    test(`${sample.file}: ${sample.name}`, async () => {
      const run = await start();
      const update = structuredClone(sample.update);
      await deliverTwice(run, update);
      const userKind = USER_KINDS.find((k) => update[k] !== undefined);
      if (sample.expect.skipped !== undefined) {
        // Not a user's message: acknowledged, nothing journaled, and said to onSkippedUpdate.
        expect(userKind).toBeUndefined();
        expect(run.received).toEqual([]);
        expect(run.skipped).toEqual([sample.expect.skipped, sample.expect.skipped]);
      } else {
        // A user's message: admitted exactly once, the redelivery a duplicate of the same id.
        expect(userKind).toBeDefined();
        expect(run.received.map((r) => r.status)).toEqual(["admitted", "duplicate"]);
        const [first, second] = run.received.map((r) => r.message);
        expect(second).toEqual(first!);
        const message = first!;
        expect(message.unreadable).toBeUndefined();
        expect(message.type).toBe(sample.expect.type!);
        expect(JSON.parse(JSON.stringify(message))).toEqual(message);
        expect((await run.bot.durability!.inbox.get(message.id))?.state).toBe("done");
        expect(run.handled).toEqual([message.id]);
        const m = messageOf(update);
        if (m !== undefined) {
          const chat = m.chat as Obj;
          expect(message.id).toBe(`tg:${BOT_ID}:${update.update_id}:${chat.id}:${m.message_id}`);
          expect(message.chatId).toBe(String(chat.id));
          expect(message.text).toBe((m.text ?? m.caption) as string | undefined);
          const extra = message.extra as Obj;
          if (TYPED.includes(message.type)) expect(extra[message.type]).toEqual(m[message.type]);
          if (message.type === "other") expect(extra.raw).toEqual(m);
          if (["image", "document", "audio", "video", "sticker"].includes(message.type)) expect(message.media).toBeDefined();
        } else {
          expect(message.type).toBe("interaction");
          expect(run.calls).toEqual(["answerCallbackQuery"]); // once: not for the duplicate
        }
      }
      expect(run.errors).toEqual([]);
      expect(run.botErrors).toEqual([]);
      expect(run.dead).toEqual([]);
    });
  }
});

test("the whole corpus by long polling: every user update admitted once, the rest skipped, every update confirmed", async () => {
  const f = new FakeTelegram().start();
  cleanups.push(() => f.stop());
  const run = await start({ provider: { token: f.token, apiBase: f.url, fetch: globalThis.fetch, mode: "polling", pollTimeoutSec: 0, pollBackoff: { baseMs: 5, capMs: 10 } } });
  // The docs' examples share update_id 10000: each gets a fresh one (the envelope, not the content).
  const pushed = corpus.map((s) => f.push({ ...structuredClone(s.update), update_id: undefined }));
  const last = Math.max(...pushed.map((u) => u.update_id as number));
  await f.until("every update confirmed", () => f.confirmedOffset > last, 20_000);
  await run.bot.idle();
  const users = corpus.filter((s) => s.expect.type !== undefined);
  expect(run.received.filter((r) => r.status === "admitted").length).toBe(users.length);
  expect(new Set(run.received.map((r) => r.message.id)).size).toBe(users.length);
  expect(run.received.every((r) => r.message.unreadable === undefined)).toBe(true);
  expect(run.skipped.length).toBe(corpus.length - users.length);
  expect(run.handled.length).toBe(users.length);
  expect(run.errors).toEqual([]);
}, 60_000);

describe("the fixed defects, on real payloads of the corpus", () => {
  async function one(update: Obj): Promise<InboundMessage> {
    const run = await start();
    await deliverTwice(run, update);
    expect(run.received.map((r) => r.status)).toEqual(["admitted", "duplicate"]);
    return run.received[0]!.message;
  }

  test("a venue (which the Bot API sends with a location too) is a venue, with its title and address", async () => {
    const aiogram = byName("aiogram: MESSAGE_WITH_VENUE");
    expect(Object.keys(aiogram.update.message as Obj)).toEqual(expect.arrayContaining(["location", "venue"]));
    const venue = await one(aiogram.update);
    expect(venue.type).toBe("venue");
    expect((venue.extra as Obj).venue).toEqual({
      location: { latitude: 50.693416, longitude: 30.624605 },
      title: "Venue Name",
      address: "Venue Address",
      foursquare_id: "4e6f2cec483bad563d150f98",
    });
    const teloxide = await one(byName("teloxide: issue_481").update);
    expect(teloxide.type).toBe("venue");
    expect((teloxide.extra as Obj).venue).toMatchObject({ title: "Title", address: "Address", foursquare_id: "some_foursquare_id" });
    // A plain location stays a location.
    const location = await one(byName("aiogram: MESSAGE_WITH_LOCATION").update);
    expect([location.type, (location.extra as Obj).location]).toEqual(["location", { latitude: 50.693416, longitude: 30.624605 }]);
  });

  test("web_app_data keeps the Web App's data and button text (not as text: a client can send anything there)", async () => {
    const message = await one(byName("tgbot: web_app_data").update);
    expect(message.type).toBe("web_app_data");
    expect((message.extra as Obj).web_app_data).toEqual({ data: "web-app-data", button_text: "web-app-button-text" });
    expect(message.text).toBeUndefined();
  });

  test("users_shared, chat_shared and successful_payment keep their type and content", async () => {
    const users = await one(byName("tgbot: users_shared").update);
    expect([users.type, (users.extra as Obj).users_shared]).toEqual(["users_shared", { request_id: 1, users: [{ user_id: 1 }] }]);
    const chat = await one(byName("teloxide: de_shared_chat").update);
    expect([chat.type, (chat.extra as Obj).chat_shared]).toEqual(["chat_shared", { request_id: 348349, chat_id: 384939 }]);
    const chat2 = await one(byName("tgbot: chat_shared-2").update);
    expect((chat2.extra as Obj).chat_shared).toMatchObject({ chat_id: 1, title: "title", username: "username" });
    const paid = await one(byName("aiogram: MESSAGE_WITH_SUCCESSFUL_PAYMENT").update);
    expect(paid.type).toBe("successful_payment");
    expect((paid.extra as Obj).successful_payment).toEqual({
      currency: "USD",
      total_amount: 6250,
      invoice_payload: "HAPPY FRIDAYS COUPON",
      telegram_payment_charge_id: "_",
      provider_payment_charge_id: "12345678901234_test",
    });
  });

  test("member joins and leaves are new_chat_members / left_chat_member with the users", async () => {
    const joined = await one(byName("tgbot: new_chat_members").update);
    expect([joined.type, (joined.extra as Obj).new_chat_members]).toEqual(["new_chat_members", [{ first_name: "User", id: 1, is_bot: false }]]);
    const left = await one(byName("tgbot: left_chat_member").update);
    expect([left.type, (left.extra as Obj).left_chat_member]).toEqual(["left_chat_member", { first_name: "User", id: 1, is_bot: false }]);
  });

  test("paid media with a caption, a story and a giveaway keep their kind; an unknown kind keeps the raw message", async () => {
    const paid = await one(byName("tgbot: paid_media").update);
    expect([paid.type, (paid.extra as Obj).paid_media]).toEqual(["paid_media", { star_count: 100, paid_media: [{ type: "preview" }] }]);
    const story = await one(byName("teloxide: issue_1107").update);
    expect([story.type, ((story.extra as Obj).story as Obj).id]).toEqual(["story", 2]);
    const giveaway = await one(byName("teloxide: giveaway").update);
    expect(giveaway.type).toBe("giveaway");
    const unknown = byName("tgbot: unknown-2");
    const other = await one(unknown.update);
    expect(other.type).toBe("other");
    expect((other.extra as Obj).raw).toEqual(unknown.update.message as Obj);
    expect(((other.extra as Obj).raw as Obj).unknown_value).toEqual({ key: "value" });
    // A media kind newer than the provider, with a caption: not mistaken for a text message.
    const live = byName("tgbot: live_photo");
    (live.update.message as Obj).caption = "a caption";
    const newer = await one(live.update);
    expect([newer.type, newer.text]).toEqual(["other", "a caption"]);
    expect(((newer.extra as Obj).raw as Obj).live_photo).toEqual((live.update.message as Obj).live_photo);
  });

  test("an animation (sent with a document too) is an animation; media without file_unique_id (the Bot API docs' own examples) is admitted", async () => {
    const animation = byName("tgbot: animation");
    const message = animation.update.message as Obj;
    message.document = { file_id: "file-id", file_unique_id: "unique-id" }; // as the Bot API sends it
    const gif = await one(animation.update);
    expect(gif.type).toBe("video");
    expect(((gif.media as Obj).ref as Obj).kind).toBe("animation");
    for (const [name, type] of [["Bot API docs: Message with audio", "audio"], ["Bot API docs: Voice message", "audio"], ["Bot API docs: Message with a document", "document"]]) {
      const m = await one(byName(name!).update);
      expect(m.type).toBe(type!);
      expect(m.unreadable).toBeUndefined();
      expect((m.media as Obj).ref).toMatchObject({ fileId: "AwADBAADbXXXXXXXXXXXGBdhD2l6_XX", fileUniqueId: "" });
    }
  });

  test("a user's update that cannot be parsed is journaled as unreadable and dead-lettered, never acknowledged unrecorded", async () => {
    const run = await start();
    // The docs' text message without its chat.
    const noChat = byName("Bot API docs: Message with text").update;
    delete (noChat.message as Obj).chat;
    const texts = await deliverTwice(run, noChat);
    expect(texts[0]).toBe('ok (journaled as unreadable: Telegram update field "message.chat" must be an object, got undefined)');
    expect(run.received.map((r) => r.status)).toEqual(["admitted", "duplicate"]);
    const message = run.received[0]!.message;
    expect(message).toEqual({
      id: `tg:${BOT_ID}:10000:-:1365`,
      chatId: `tg:${BOT_ID}:unreadable`,
      type: "unreadable",
      unreadable: 'Telegram update field "message.chat" must be an object, got undefined',
      from: "1111111",
      timestamp: 1441645532000,
      extra: { updateKind: "message", updateId: 10000, raw: noChat as never },
    });
    expect(run.received[1]!.message.id).toBe(message.id); // stable across redeliveries
    // No handler ran; the record is dead at once, with the reason, and keeps what Telegram sent.
    expect(run.handled).toEqual([]);
    const record = await run.bot.durability!.inbox.get(message.id);
    expect(record?.state).toBe("dead");
    expect(run.dead.map((d) => [d.kind, d.id])).toEqual([["inbound", message.id]]);
    expect(run.dead[0]!.error).toContain('"message.chat"');
    expect(run.errors.map((e) => e.message)).toEqual([
      'Telegram update field "message.chat" must be an object, got undefined',
      'Telegram update field "message.chat" must be an object, got undefined',
    ]);
  });

  test("unreadable callback queries, channel posts and update ids: the chat and id from whatever is there", async () => {
    const run = await start();
    // The docs' callback query with a number for data: the chat is the user's, from "from".
    const callback = byName("Bot API docs: Callback query").update;
    (callback.callback_query as Obj).data = 42;
    // A channel post whose text is not a string: the chat id is there.
    const channel = byName("aiogram: MESSAGE_FROM_CHANNEL").update;
    (channel.channel_post as Obj).text = { not: "a string" };
    // An update_id that is not an integer: the id is a hash of the update, the same on redelivery.
    const badId = byName("Bot API docs: Message with entities").update;
    badId.update_id = "10000";
    for (const update of [callback, channel, badId]) await deliverTwice(run, update);
    const seen = run.received.map((r) => [r.message.id, r.message.chatId, r.message.unreadable, r.status]);
    expect(seen.slice(0, 4)).toEqual([
      [`tg:${BOT_ID}:10000:cb:4382bfdwdsb323b2d9`, "1111111", 'Telegram update field "callback_query.data" must be a string, got 42', "admitted"],
      [`tg:${BOT_ID}:10000:cb:4382bfdwdsb323b2d9`, "1111111", 'Telegram update field "callback_query.data" must be a string, got 42', "duplicate"],
      [`tg:${BOT_ID}:${channel.update_id}:-1001065170817:123432`, "-1001065170817", 'Telegram update field "channel_post.text" must be a string, got {"not":"a string"}', "admitted"],
      [`tg:${BOT_ID}:${channel.update_id}:-1001065170817:123432`, "-1001065170817", 'Telegram update field "channel_post.text" must be a string, got {"not":"a string"}', "duplicate"],
    ]);
    expect(seen[4]![0]).toMatch(new RegExp(`^tg:${BOT_ID}:h[0-9a-f]{32}:1111111:1365$`));
    expect(seen.slice(4).map((s) => [s[0], s[1], s[2], s[3]])).toEqual([
      [seen[4]![0], "1111111", 'Telegram update field "update_id" must be an integer, got "10000"', "admitted"],
      [seen[4]![0], "1111111", 'Telegram update field "update_id" must be an integer, got "10000"', "duplicate"],
    ]);
    expect(run.handled).toEqual([]);
    expect(run.dead.length).toBe(3);
    expect(run.calls).toEqual([]); // an unreadable callback query is not answered as handled
  });

  test("an unreadable update the journal refuses is answered 503, and admitted on redelivery", async () => {
    const memory = new MemoryDurability();
    let failures = 1;
    const inbox = new Proxy(memory.inbox, {
      get(target, p) {
        if (p === "admit") {
          return async (...args: Parameters<DurabilityBackend["inbox"]["admit"]>) => {
            if (failures-- > 0) throw new Error("journal unavailable (injected)");
            return target.admit(...args);
          };
        }
        const v = Reflect.get(target, p, target);
        return typeof v === "function" ? v.bind(target) : v;
      },
    });
    const backend = new Proxy(memory, {
      get(target, p) {
        if (p === "inbox") return inbox;
        const v = Reflect.get(target, p, target);
        return typeof v === "function" ? v.bind(target) : v;
      },
    });
    const run = await start({ backend });
    const update = byName("Bot API docs: Voice message").update;
    ((update.message as Obj).voice as Obj).file_id = ""; // a file_id Telegram would never send
    const refused = await run.provider.webhook(post(update));
    expect(refused.status).toBe(503);
    const again = await run.provider.webhook(post(update));
    expect(again.status).toBe(200);
    await run.bot.idle();
    expect(run.received.map((r) => r.status)).toEqual(["rejected", "admitted"]);
    expect(run.received[1]!.message.unreadable).toBe('Telegram update field "message.voice.file_id" must be a non-empty string, got ""');
    expect((await run.bot.durability!.inbox.get(run.received[1]!.message.id))?.state).toBe("dead");
  });

  test("a malformed update that is not a user's message is acknowledged without a record", async () => {
    const run = await start();
    const inline = byName("Bot API docs: Inline query").update;
    inline.update_id = "x";
    const [text] = await deliverTwice(run, inline);
    expect(text).toBe('ok (update skipped: Telegram update field "update_id" must be an integer, got "x")');
    expect(run.received).toEqual([]);
    // An edit is a skipped kind: acknowledged as it is, readable or not.
    const edit = byName("Bot API docs: Edited message").update;
    delete (edit.edited_message as Obj).chat;
    await deliverTwice(run, edit);
    expect(run.received).toEqual([]);
    expect(run.skipped).toEqual(["edited_message", "edited_message"]);
  });
});
