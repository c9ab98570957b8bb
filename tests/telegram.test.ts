// The Telegram provider against a fake Bot API server on loopback: long polling
// (offsets confirmed only after admission), the webhook handler (secret, 405,
// 400, 503 then 200 on redelivery), sends (429 retry_after, 5xx, timeouts,
// 400/403 → DLQ, garbage bodies), media on reprocess (memory and SQLite, across a
// restart), callback queries, and option validation.
import { afterAll, afterEach, describe, expect, test } from "bun:test";
import { mkdirSync, readdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot, ANY, type Context, type DurabilityBackend, IMAGE, type InboundMessage, INTERACTION, loadMediaOf, MediaUnavailableError, MemoryDurability, type Provider, ProviderError } from "../mod.ts";
import { type AdmitResult, type InboundSink } from "../provider.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { crashable } from "../src/testing/crashable.ts";
import { TELEGRAM_MAX_UPDATE_DEPTH, TelegramProvider, type TelegramProviderOptions, TelegramUpdateError } from "../providers/telegram/mod.ts";
import { CUT_NESTING_MARK } from "../src/content.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { flakyAdmit } from "./support/flaky_admit.ts";
import { scaledTelegramLimits } from "./support/scaled_limits.ts";

const dir = join(tmpdir(), `botmesh-telegram-tests-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const SECRET = "s3cret_webhook-token";
const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

function fake(): FakeTelegram {
  const f = new FakeTelegram().start();
  cleanups.push(() => f.stop());
  return f;
}

interface Harness {
  bot: Bot;
  provider: TelegramProvider;
  errors: Error[];
  botErrors: Error[];
  dead: { kind: string; id: string; error: string }[];
  /** Every message the provider handed to the bot, with the bot's answer. */
  received: { message: InboundMessage; status: AdmitResult["status"] }[];
}

/** Record what the provider hands to the bot (and what the bot answered) on the way in. */
function recordSink(provider: TelegramProvider, received: Harness["received"]): void {
  const start = provider.start.bind(provider);
  provider.start = (sink: InboundSink) =>
    start({
      receive: async (message) => {
        const result = await sink.receive(message);
        received.push({ message, status: result.status });
        return result;
      },
      ...(sink.reportError ? { reportError: sink.reportError.bind(sink) } : {}),
      ...(sink.confirmSent ? { confirmSent: sink.confirmSent.bind(sink) } : {}),
    });
}

async function harness(
  f: FakeTelegram,
  options: Partial<TelegramProviderOptions> & { backend?: DurabilityBackend; instanceId?: string; setup?: (bot: Bot) => void } = {},
): Promise<Harness> {
  const { backend, instanceId, setup, ...providerOptions } = options;
  const errors: Error[] = [];
  const provider = new TelegramProvider({
    token: f.token,
    apiBase: f.url,
    secretToken: SECRET,
    pollTimeoutSec: 1,
    pollBackoff: { baseMs: 10, capMs: 50 },
    requestTimeoutMs: 2_000,
    onError: (e) => errors.push(e),
    ...providerOptions,
  });
  const received: Harness["received"] = [];
  recordSink(provider, received);
  const bot = new Bot({
    provider,
    durability: {
      backend: backend ?? new MemoryDurability(),
      instanceId: instanceId ?? "tg-test",
      // Telegram's limits at 10x: a test must not wait a second per message of a chat.
      outbox: { retries: 4, backoff: { baseMs: 10, capMs: 50 }, rateLimit: scaledTelegramLimits(10) },
      inbox: { retries: 2, backoff: { baseMs: 10, capMs: 50 } },
    },
  });
  const botErrors: Error[] = [];
  const dead: Harness["dead"] = [];
  bot.on("error", (e) => botErrors.push(e));
  bot.on("durability:dead", (d) => dead.push(d as Harness["dead"][number]));
  setup?.(bot);
  await bot.start();
  cleanups.push(() => bot.stop());
  return { bot, provider, errors, botErrors, dead, received };
}

function webhookRequest(body: string | Record<string, unknown>, init: { secret?: string | null; method?: string } = {}): Request {
  const secret = init.secret === undefined ? SECRET : init.secret;
  return new Request("http://bot.test/telegram", {
    method: init.method ?? "POST",
    headers: { "content-type": "application/json", ...(secret !== null ? { "x-telegram-bot-api-secret-token": secret } : {}) },
    ...(init.method === "GET" ? {} : { body: typeof body === "string" ? body : JSON.stringify(body) }),
  });
}

const bytes = (text: string) => new TextEncoder().encode(text);

describe("telegram: long polling", () => {
  for (const store of ["memory", "sqlite"] as const) test(`${store}: text, photo, document, voice and a callback query are handled; replies carry Telegram's message ids`, async () => {
    const f = fake();
    const backend = store === "memory" ? new MemoryDurability() : new SQLiteDurability({ file: join(dir, `poll-${crypto.randomUUID()}.db`) });
    const loaded: { type: string; text: string; mimeType?: string; fileName?: string }[] = [];
    const interactions: unknown[] = [];
    const h = await harness(f, {
      mode: "polling",
      backend,
      setup: (bot) => {
        bot.when(INTERACTION, async (ctx) => {
          interactions.push(ctx.message.interaction);
          await ctx.reply(`chose ${ctx.message.interaction!.id}`);
        });
        bot.when((m) => m.media !== undefined, async (ctx) => {
          const media = await loadMediaOf(ctx, { throwOnError: true });
          loaded.push({
            type: ctx.message.type,
            text: new TextDecoder().decode(media!.data),
            mimeType: media!.mimeType,
            fileName: media!.fileName,
          });
          await ctx.reply(`got ${ctx.message.type} ${ctx.message.text ?? ""}`.trim());
        });
        bot.when(/.*/, (ctx) => ctx.reply(`echo: ${ctx.message.text}`));
      },
    });
    const hello = f.push(f.textUpdate(1001, "hello"));
    f.push(f.mediaUpdate(1001, "photo", bytes("JPEG-bytes"), { caption: "a cat" }).update);
    f.push(f.mediaUpdate(1002, "document", bytes("PDF-bytes"), { mimeType: "application/pdf", fileName: "a.pdf" }).update);
    f.push(f.mediaUpdate(1003, "voice", bytes("OGG-bytes"), { mimeType: "audio/ogg" }).update);
    const cb = f.push(f.callbackUpdate(1004, "btn:yes"));
    await f.until("five replies", () => f.sent.length >= 5);
    await h.bot.idle();
    const texts = f.sent.map((s) => `${s.chatId} ${s.params.text}`).sort();
    expect(texts).toEqual(["1001 echo: hello", "1001 got image a cat", "1002 got document", "1003 got audio", "1004 chose btn:yes"]);
    expect(f.sent.filter((s) => s.chatId === "1001").map((s) => s.messageId)).toEqual([1, 2]);
    expect(loaded.sort((a, b) => a.type.localeCompare(b.type))).toEqual([
      { type: "audio", text: "OGG-bytes", mimeType: "audio/ogg", fileName: undefined },
      { type: "document", text: "PDF-bytes", mimeType: "application/pdf", fileName: "a.pdf" },
      { type: "image", text: "JPEG-bytes", mimeType: "image/jpeg", fileName: undefined },
    ]);
    expect(interactions).toEqual([{
      id: "btn:yes",
      value: { callbackQueryId: (cb.callback_query as { id: string }).id, data: "btn:yes", messageId: 1, chatInstance: "-42" },
    }]);
    await f.until("the callback query answered", () => f.answeredCallbacks.length === 1);
    expect(f.answeredCallbacks).toEqual([(cb.callback_query as { id: string }).id]);
    // The outbox recorded Telegram's message ids.
    const entry = await h.bot.durability!.outbox.get(`${f.inboundId(hello)}:1`);
    expect(entry?.state).toBe("sent");
    expect(entry?.messageId).toBe(String(f.sent.find((s) => s.params.text === "echo: hello")!.messageId));
    await f.until("every update confirmed", () => f.confirmedOffset > (cb.update_id as number));
    expect(h.errors).toEqual([]);
  });

  test("the offset is confirmed only after admission: a refused update is fetched again and processed once", async () => {
    const f = fake();
    const state = { failures: 1 };
    const runs: string[] = [];
    const h = await harness(f, {
      mode: "polling",
      backend: flakyAdmit(new MemoryDurability(), state),
      setup: (bot) => bot.when(/.*/, (ctx) => {
        runs.push(ctx.message.text!);
        return ctx.reply(`ok ${ctx.message.text}`);
      }),
    });
    // One batch: the first update is refused; the second of its chat must not overtake it.
    const first = f.push(f.textUpdate(2001, "one"));
    f.push(f.textUpdate(2001, "two"));
    const third = f.push(f.textUpdate(2002, "three"));
    const id = first.update_id as number;
    await f.until("three replies", () => f.sent.length === 3);
    await h.bot.idle();
    expect(state.failures).toBe(0);
    expect(runs.filter((r) => r !== "three")).toEqual(["one", "two"]);
    expect(runs.length).toBe(3);
    expect(f.sent.filter((s) => s.chatId === "2001").map((s) => s.params.text)).toEqual(["ok one", "ok two"]);
    // The poll after the refusal asked from the refused update again (it was not confirmed).
    const afterRefusal = f.offsets.filter((o) => o !== undefined);
    expect(afterRefusal[0]).toBeLessThanOrEqual(id);
    expect(f.offsets.filter((o) => o === id).length).toBeGreaterThanOrEqual(1);
    await f.until("confirmed past all", () => f.confirmedOffset === (third.update_id as number) + 1);
    expect(h.botErrors.some((e) => /journal unavailable/.test(e.message))).toBe(true);
    expect(h.bot.durability!.metrics().inboundJournaled).toBe(3);
  });

  test("a duplicate in one batch and a redelivery after confirmation are processed once", async () => {
    const f = fake();
    const runs: string[] = [];
    const h = await harness(f, {
      mode: "polling",
      setup: (bot) => bot.when(/.*/, (ctx) => {
        runs.push(ctx.inboundId);
        return ctx.reply("once");
      }),
    });
    const u = f.textUpdate(3001, "hi");
    f.push(u);
    f.redeliver(u); // the same update_id twice in one batch
    await f.until("confirmed", () => f.confirmedOffset > (u.update_id as number));
    f.redeliver(u); // Telegram sends it again later
    const later = f.push(f.textUpdate(3001, "later"));
    await f.until("the later one confirmed", () => f.confirmedOffset > (later.update_id as number));
    await h.bot.idle();
    expect(runs).toEqual([f.inboundId(u), f.inboundId(later)]);
    expect(f.sent.length).toBe(2);
    expect(h.bot.durability!.metrics().inboundDuplicates).toBe(2);
  });

  test("a malformed user update is reported with its field and journaled as unreadable, never dropped; the rest of the batch is processed", async () => {
    const f = fake();
    const skipped: string[] = [];
    const h = await harness(f, {
      mode: "polling",
      onSkippedUpdate: (s) => skipped.push(s.kind),
      setup: (bot) => bot.when(/.*/, (ctx) => ctx.reply(`ok ${ctx.message.text}`)),
    });
    f.push(f.textUpdate(4001, "before"));
    const noChat = f.push({ message: { message_id: 5, date: 1, text: "no chat" } });
    const badChat = f.push({ message: { message_id: 6, date: 1, chat: { id: "not-a-number" }, text: "bad chat id" } });
    f.push({ edited_message: { message_id: 7, date: 1, chat: { id: 4001 }, text: "edited" } });
    f.push({ my_chat_member: "not an object either" }); // not a user's message: reported by nobody, skipped
    const last = f.push(f.textUpdate(4001, "after"));
    await f.until("two replies", () => f.sent.length === 2);
    await f.until("all confirmed", () => f.confirmedOffset > (last.update_id as number));
    expect(f.sent.map((s) => s.params.text)).toEqual(["ok before", "ok after"]);
    expect(skipped).toEqual(["edited_message", "my_chat_member"]);
    const fields = h.errors.filter((e): e is TelegramUpdateError => e instanceof TelegramUpdateError).map((e) => e.field);
    expect(fields).toEqual(["message.chat", "message.chat.id"]);
    expect(h.errors[0]!.message).toBe('Telegram update field "message.chat" must be an object, got undefined');
    // Both unreadable ones reached the bot, admitted, with the reason and the raw update: not acknowledged unrecorded.
    const unreadable = h.received.filter((r) => r.message.unreadable !== undefined);
    expect(unreadable.map((r) => [r.message.id, r.message.chatId, r.message.type, r.status])).toEqual([
      [`tg:${f.botId}:${noChat.update_id}:-:5`, `tg:${f.botId}:unreadable`, "unreadable", "admitted"],
      [`tg:${f.botId}:${badChat.update_id}:-:6`, `tg:${f.botId}:unreadable`, "unreadable", "admitted"],
    ]);
    expect(unreadable.map((r) => r.message.unreadable)).toEqual([
      'Telegram update field "message.chat" must be an object, got undefined',
      'Telegram update field "message.chat.id" must be an integer, got "not-a-number"',
    ]);
    expect(unreadable[0]!.message.extra).toEqual({ updateKind: "message", updateId: noChat.update_id as number, raw: noChat as never });
    await h.bot.idle();
    for (const r of unreadable) expect(await h.bot.durability!.inbox.get(r.message.id)).toBeDefined();
  });

  test("an unreadable update the journal refuses is not confirmed: it is fetched again and admitted once", async () => {
    const f = fake();
    const state = { failures: 1 };
    const h = await harness(f, { mode: "polling", backend: flakyAdmit(new MemoryDurability(), state) });
    const bad = f.push({ message: { message_id: 9, date: 1, chat: { id: 4101 }, text: 42 } });
    const after = f.push(f.textUpdate(4101, "after")); // of the same chat: it waits behind the refused one
    await f.until("all confirmed", () => f.confirmedOffset > (after.update_id as number));
    expect(state.failures).toBe(0);
    // Refused first (the offset stayed at it), then admitted; never confirmed before that.
    const id = `tg:${f.botId}:${bad.update_id}:4101:9`;
    expect(h.received.filter((r) => r.message.id === id).map((r) => r.status)).toEqual(["rejected", "admitted"]);
    expect(f.offsets.filter((o) => o !== undefined)[0]).toBe(bad.update_id as number);
    const record = h.received.find((r) => r.message.id === id)!.message;
    expect(record).toMatchObject({ chatId: "4101", type: "unreadable", unreadable: 'Telegram update field "message.text" must be a string, got 42' });
    expect(await h.bot.durability!.inbox.get(id)).toBeDefined();
  });

  test("getUpdates failures (5xx, 429 retry_after, a bad body, 409 conflict, a hang) are reported and polling recovers", async () => {
    const f = fake();
    f.inject("getUpdates", { kind: "status", status: 502 });
    f.inject("getUpdates", { kind: "body", body: "<html>proxy error</html>", status: 200 });
    f.inject("getUpdates", { kind: "status", status: 409 });
    f.inject("getUpdates", { kind: "status", status: 429, description: "Too Many Requests: retry after 1", retryAfter: 1 });
    f.inject("getUpdates", { kind: "hang" });
    const h = await harness(f, {
      mode: "polling",
      requestTimeoutMs: 300,
      pollTimeoutSec: 0,
      setup: (bot) => bot.when(/.*/, (ctx) => ctx.reply("pong")),
    });
    f.push(f.textUpdate(5001, "ping"));
    await f.until("the reply", () => f.sent.length === 1, 15_000);
    const polls = f.calls.filter((c) => c.method === "getUpdates");
    expect(polls.slice(0, 5).map((c) => c.status)).toEqual([502, 200, 409, 429, 0]);
    // retry_after honoured: the poll after the 429 came no sooner than 1 s later.
    expect(polls[4]!.at - polls[3]!.at).toBeGreaterThanOrEqual(950);
    const messages = h.errors.map((e) => e.message);
    expect(messages[0]).toContain("Telegram getUpdates failed with 502");
    expect(messages[1]).toContain("not a Bot API answer");
    expect(messages[2]).toContain("another getUpdates is running with this token, or a webhook is set");
    expect(messages[3]).toContain("429");
    expect(messages[4]).toContain("timed out");
  });

  test("stop() aborts the long poll under way at once", async () => {
    const f = fake();
    const h = await harness(f, { mode: "polling", pollTimeoutSec: 20 });
    await f.until("a long poll", () => f.calls.some((c) => c.method === "getUpdates"));
    const started = Date.now();
    await h.bot.stop();
    expect(Date.now() - started).toBeLessThan(3_000); // the poll waits up to 20 s: stop() must not
    const polls = f.calls.filter((c) => c.method === "getUpdates").length;
    f.push(f.textUpdate(6001, "after stop"));
    await new Promise((resolve) => setTimeout(resolve, 100)); // a stopped loop would poll here: it must not
    expect(f.calls.filter((c) => c.method === "getUpdates").length).toBe(polls);
  });

  test("stop() confirms the updates admitted since the last poll; a restart does not fetch them again", async () => {
    const f = fake();
    const runs: string[] = [];
    const h = await harness(f, { mode: "polling", pollTimeoutSec: 5, setup: (bot) => bot.when(/.*/, (ctx) => void runs.push(ctx.message.text!)) });
    const u = f.push(f.textUpdate(6201, "once"));
    await f.until("handled", () => runs.length === 1);
    await h.bot.stop();
    expect(f.confirmedOffset).toBe((u.update_id as number) + 1);
    expect(f.pending).toBe(0);
    const again = await harness(f, { mode: "polling", pollTimeoutSec: 0, setup: (bot) => bot.when(/.*/, (ctx) => void runs.push(ctx.message.text!)) });
    await f.until("a poll of the new provider", () => f.offsets.filter((o) => o === undefined).length === 2);
    await again.bot.idle();
    expect(runs).toEqual(["once"]);
    expect(again.bot.durability!.metrics().inboundDuplicates).toBe(0);
  });

  test("a webhook still set: 409 is reported with what to do, and polling keeps trying", async () => {
    const f = fake();
    f.webhookUrl = "https://example.com/hook";
    const h = await harness(f, { mode: "polling" });
    await f.until("two refused polls", () => f.calls.filter((c) => c.status === 409).length >= 2);
    expect(h.errors[0]!.message).toBe(
      "Telegram long polling failed (another getUpdates is running with this token, or a webhook is set: call deleteWebhook or set deleteWebhookOnStart): " +
        "Telegram getUpdates failed with 409: Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to delete the webhook first",
    );
  });

  test("setWebhook passes the secret and the allowed updates", async () => {
    const f = fake();
    const provider = new TelegramProvider({ token: f.token, apiBase: f.url, secretToken: SECRET, allowedUpdates: ["message"] });
    await provider.setWebhook("https://bot.example.com/telegram", { max_connections: 10 });
    expect(f.webhookUrl).toBe("https://bot.example.com/telegram");
    expect(f.calls[0]!.params).toEqual({
      url: "https://bot.example.com/telegram",
      secret_token: SECRET,
      allowed_updates: ["message"],
      max_connections: 10,
    });
  });

  test("deleteWebhookOnStart removes a webhook so that polling works", async () => {
    const f = fake();
    f.webhookUrl = "https://example.com/hook";
    await harness(f, { mode: "polling", deleteWebhookOnStart: true, setup: (bot) => bot.when(/.*/, (ctx) => ctx.reply("ok")) });
    expect(f.webhookUrl).toBe("");
    f.push(f.textUpdate(6101, "hi"));
    await f.until("the reply", () => f.sent.length === 1);
    expect(f.calls[0]!.method).toBe("deleteWebhook");
  });
});

describe("telegram: an update nested some thousands of levels deep", () => {
  // 20 000 levels of arrays, 40 KB of JSON: encoding it for the journal once overflowed the stack, so that
  // its admission failed the same way on every delivery (the webhook answered 503 for ever, polling stalled).
  const deep = () => JSON.parse("[".repeat(20_000) + "]".repeat(20_000)) as unknown;
  const cutPath = `message.a${"[0]".repeat(TELEGRAM_MAX_UPDATE_DEPTH - 2)}`;

  test("webhook: answered 200, the update journaled as unreadable (kept cut at the limit, named) and dead-lettered", async () => {
    const f = fake();
    const h = await harness(f, { setup: (bot) => bot.when(/.*/, (ctx) => ctx.reply(`ok ${ctx.message.text}`)) });
    const update = { update_id: 8001, message: { message_id: 3, date: 1, chat: { id: 5001, type: "private" }, a: deep() } };
    const response = await h.provider.webhook(webhookRequest(JSON.stringify(update)));
    expect(response.status).toBe(200);
    const text = await response.text();
    expect(text).toStartWith(`ok (journaled as unreadable: Telegram update field "${cutPath}" nests deeper than ${TELEGRAM_MAX_UPDATE_DEPTH} levels`);
    const id = `tg:${f.botId}:8001:5001:3`;
    await h.bot.idle();
    const record = await h.bot.durability!.inbox.get(id);
    expect(record?.state).toBe("dead");
    const payload = record!.payload as { type: string; unreadable: string; extra: { raw: { message: { a: unknown } } } };
    expect(payload.type).toBe("unreadable");
    expect(payload.unreadable).toContain(`"${cutPath}"`);
    // The update is kept, cut at TELEGRAM_MAX_UPDATE_DEPTH levels.
    let kept: unknown = payload.extra.raw.message.a;
    let levels = 2;
    while (Array.isArray(kept)) {
      kept = kept[0];
      levels++;
    }
    expect([kept, levels]).toEqual([CUT_NESTING_MARK, TELEGRAM_MAX_UPDATE_DEPTH]);
    expect(h.dead.map((d) => d.id)).toEqual([id]);
    const fields = h.errors.filter((e): e is TelegramUpdateError => e instanceof TelegramUpdateError).map((e) => e.field);
    expect(fields).toEqual([cutPath]);
    // Without an integer update_id (its id is then a hash of the update) and not a user's update: the same, no overflow.
    const noId = await h.provider.webhook(webhookRequest(JSON.stringify({ update_id: "x", message: { message_id: 4, chat: { id: 5001 }, a: deep() } })));
    expect(noId.status).toBe(200);
    const other = await h.provider.webhook(webhookRequest(JSON.stringify({ update_id: 8002, my_chat_member: { a: deep() } })));
    expect(other.status).toBe(200);
    expect(await other.text()).toContain("update skipped: Telegram update field \"my_chat_member.a[0]");
    const ok = await h.provider.webhook(webhookRequest(f.textUpdate(5001, "next")));
    expect(ok.status).toBe(200);
    await f.until("the reply to the next one", () => f.sent.length === 1);
    expect(f.sent[0]!.params.text).toBe("ok next");
  });

  test("two updates without an integer update_id that differ only below the cut: two ids, each the same on a redelivery", async () => {
    const f = fake();
    const h = await harness(f);
    const deepTo = (leaf: string) => JSON.parse(`${"[".repeat(5_000)}"${leaf}"${"]".repeat(5_000)}`) as unknown;
    const update = (leaf: string) => JSON.stringify({ update_id: "x", message: { message_id: 4, chat: { id: 5001 }, a: deepTo(leaf) } });
    for (const body of [update("first"), update("second"), update("first")]) {
      expect((await h.provider.webhook(webhookRequest(body))).status).toBe(200);
    }
    await h.bot.idle();
    const ids = h.dead.map((d) => d.id);
    expect(ids).toHaveLength(2);
    expect(new Set(ids).size).toBe(2);
    for (const id of ids) expect(id).toMatch(new RegExp(`^tg:${f.botId}:h[0-9a-f]{32}:5001:4$`));
  });

  test("polling: the poller dead-letters it and goes on to the next update", async () => {
    const f = fake();
    const h = await harness(f, { mode: "polling", setup: (bot) => bot.when(/.*/, (ctx) => ctx.reply(`ok ${ctx.message.text}`)) });
    const bad = f.push({ message: { message_id: 3, date: 1, chat: { id: 5002, type: "private" }, a: deep() } });
    const skipped = f.push({ my_chat_member: { a: deep() } });
    const last = f.push(f.textUpdate(5002, "after"));
    await f.until("the reply to the next update", () => f.sent.length === 1);
    await f.until("all confirmed", () => f.confirmedOffset > (last.update_id as number));
    expect(f.sent[0]!.params.text).toBe("ok after");
    await h.bot.idle();
    expect((await h.bot.durability!.inbox.get(`tg:${f.botId}:${bad.update_id}:5002:3`))?.state).toBe("dead");
    const fields = h.errors.filter((e): e is TelegramUpdateError => e instanceof TelegramUpdateError).map((e) => [e.field, e.updateId]);
    expect(fields).toEqual([[cutPath, bad.update_id as number], [`my_chat_member.a${"[0]".repeat(TELEGRAM_MAX_UPDATE_DEPTH - 2)}`, skipped.update_id as number]]);
  });
});

describe("telegram: webhook", () => {
  test("405, 401, 413, 400 for a body that is not an update, a malformed update reported; 503 while not started", async () => {
    const f = fake();
    const provider = new TelegramProvider({ token: f.token, apiBase: f.url, secretToken: SECRET, maxBodyBytes: 2048, onError: () => {} });
    const update = f.textUpdate(7001, "hi");
    expect((await provider.webhook(webhookRequest(update))).status).toBe(503);
    const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "wh" } });
    const dead: string[] = [];
    bot.on("error", () => {}); // the unreadable ones below are dead-lettered, and said as errors
    bot.on("durability:dead", (d) => void dead.push((d as { id: string }).id));
    const runs: string[] = [];
    bot.when(/.*/, (ctx) => void runs.push(ctx.message.text!));
    await bot.start();
    cleanups.push(() => bot.stop());
    const get = await provider.webhook(webhookRequest("", { method: "GET" }));
    expect(get.status).toBe(405);
    expect(get.headers.get("allow")).toBe("POST");
    expect((await provider.webhook(webhookRequest(update, { secret: null }))).status).toBe(401);
    const wrong = await provider.webhook(webhookRequest(update, { secret: `${SECRET}x` }));
    expect(wrong.status).toBe(401);
    expect(await wrong.text()).toContain("X-Telegram-Bot-Api-Secret-Token");
    expect((await provider.webhook(webhookRequest("x".repeat(3000)))).status).toBe(413);
    const badJson = await provider.webhook(webhookRequest("{not json"));
    expect(badJson.status).toBe(400);
    expect(await badJson.text()).toMatch(/^Bad request: the body is not a JSON Telegram update/);
    // A user's update that can never be parsed: reported with the field named, journaled as
    // unreadable (the bot dead-letters it), and answered 200 once admitted, so that Telegram does
    // not send it again and again ahead of the updates after it.
    const noChat = await provider.webhook(webhookRequest({ update_id: 9, message: { message_id: 1, date: 1, text: "x" } }));
    expect(noChat.status).toBe(200);
    expect(await noChat.text()).toBe('ok (journaled as unreadable: Telegram update field "message.chat" must be an object, got undefined)');
    const ok = await provider.webhook(webhookRequest(update));
    expect(ok.status).toBe(200);
    expect((await provider.webhook(webhookRequest({ update_id: 10, my_chat_member: {} }))).status).toBe(200);
    const badId = await provider.webhook(webhookRequest({ update_id: "x", message: {} }));
    expect(badId.status).toBe(200);
    expect(await badId.text()).toBe('ok (journaled as unreadable: Telegram update field "update_id" must be an integer, got "x")');
    // Not a user's update: acknowledged without a record.
    const badKind = await provider.webhook(webhookRequest({ update_id: "y", my_chat_member: {} }));
    expect(badKind.status).toBe(200);
    expect(await badKind.text()).toBe('ok (update skipped: Telegram update field "update_id" must be an integer, got "y")');
    expect((await provider.webhook(webhookRequest("[1, 2]"))).status).toBe(400);
    await bot.idle();
    expect(runs).toEqual(["hi"]);
    expect((await bot.durability!.inbox.get(`tg:${f.botId}:9:-:1`))?.state).toBe("dead");
    expect(dead).toContain(`tg:${f.botId}:9:-:1`);
  });

  test("408 when the body does not arrive within bodyTimeoutMs: a body that never ends holds nothing", async () => {
    const f = fake();
    const provider = new TelegramProvider({ token: f.token, apiBase: f.url, secretToken: SECRET, bodyTimeoutMs: 150, onError: () => {} });
    const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "wh-slow" } });
    await bot.start();
    cleanups.push(() => bot.stop());
    let cancelled = false;
    const endless = new ReadableStream<Uint8Array>({
      start(controller) {
        controller.enqueue(bytes('{"update_id":1,"message":'));
      },
      cancel() {
        cancelled = true;
      },
    });
    const started = performance.now();
    const response = await provider.webhook(
      new Request("http://bot.test/telegram", {
        method: "POST",
        headers: { "x-telegram-bot-api-secret-token": SECRET },
        body: endless,
        duplex: "half",
      } as RequestInit),
    );
    const took = performance.now() - started;
    expect(response.status).toBe(408);
    expect(await response.text()).toContain("150 ms (bodyTimeoutMs)");
    expect(took).toBeGreaterThanOrEqual(140);
    expect(took).toBeLessThan(5_000);
    expect(cancelled).toBe(true);
    expect((await provider.webhook(webhookRequest(f.textUpdate(7002, "hi")))).status).toBe(200);
    expect(() => new TelegramProvider({ token: f.token, secretToken: SECRET, bodyTimeoutMs: 0 })).toThrow(/bodyTimeoutMs/);
  });

  test("without onError, a malformed update is the bot's error event", async () => {
    const f = fake();
    const provider = new TelegramProvider({ token: f.token, apiBase: f.url, secretToken: SECRET });
    const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "wh-events" } });
    const botErrors: Error[] = [];
    bot.on("error", (e) => botErrors.push(e));
    await bot.start();
    cleanups.push(() => bot.stop());
    const noChat = await provider.webhook(webhookRequest({ update_id: 9, message: { message_id: 1, date: 1, text: "x" } }));
    expect(noChat.status).toBe(200);
    expect(botErrors.map((e) => e.message).join("\n")).toContain('"message.chat"');
  });

  test("the journal fails: 503, Telegram redelivers, 200, processed once; duplicates answer 200", async () => {
    const f = fake();
    const state = { failures: 1 };
    const runs: string[] = [];
    const h = await harness(f, {
      backend: flakyAdmit(new MemoryDurability(), state),
      setup: (bot) => bot.when(/.*/, (ctx) => {
        runs.push(ctx.inboundId);
        return ctx.reply("got it");
      }),
    });
    const server = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: h.provider.webhook });
    cleanups.push(() => server.stop(true));
    const url = `http://127.0.0.1:${server.port}/telegram`;
    const update = f.textUpdate(8001, "hello");
    expect(await f.deliverWebhook(url, update, { secret: SECRET, attempts: 3, retryDelayMs: 20 })).toEqual([503, 200]);
    expect(await f.deliverWebhook(url, update, { secret: SECRET })).toEqual([200]);
    expect(await f.deliverWebhook(url, update, { secret: "wrong" })).toEqual([401]);
    await h.bot.idle();
    expect(runs).toEqual([f.inboundId(update)]);
    expect(f.sent.map((s) => s.params.text)).toEqual(["got it"]);
    expect(h.bot.durability!.metrics().inboundDuplicates).toBe(1);
  });

  test("failOpen: the journal fails, the update is handled without it and answered 200", async () => {
    const f = fake();
    const errors: Error[] = [];
    const provider = new TelegramProvider({ token: f.token, apiBase: f.url, secretToken: SECRET, onError: (e) => errors.push(e) });
    const bot = new Bot({
      provider,
      durability: { backend: flakyAdmit(new MemoryDurability(), { failures: 1 }), instanceId: "wh-open", failOpen: true },
    });
    bot.on("error", () => {});
    bot.when(/.*/, (ctx) => ctx.reply("handled anyway"));
    await bot.start();
    cleanups.push(() => bot.stop());
    expect((await provider.webhook(webhookRequest(f.textUpdate(8301, "hi")))).status).toBe(200);
    await bot.idle();
    expect(f.sent.map((s) => s.params.text)).toEqual(["handled anyway"]);
    expect(errors).toEqual([]);
  });

  test("a callback query by webhook reaches the interaction handler and is answered after admission", async () => {
    const f = fake();
    const seen: string[] = [];
    const h = await harness(f, { setup: (bot) => bot.when(INTERACTION, (ctx) => void seen.push(ctx.message.interaction!.id)) });
    const update = f.callbackUpdate(8101, "vote:42");
    expect((await h.provider.webhook(webhookRequest(update))).status).toBe(200);
    expect((await h.provider.webhook(webhookRequest(update))).status).toBe(200); // a duplicate: not answered twice
    await f.until("answered", () => f.answeredCallbacks.length === 1);
    await h.bot.idle();
    expect(seen).toEqual(["vote:42"]);
    expect(f.answeredCallbacks).toEqual([(update.callback_query as { id: string }).id]);
  });

  test("a failing answerCallbackQuery is only reported", async () => {
    const f = fake();
    f.inject("answerCallbackQuery", { kind: "status", status: 400, description: "Bad Request: query is too old" });
    const seen: string[] = [];
    const h = await harness(f, { setup: (bot) => bot.when(INTERACTION, (ctx) => void seen.push(ctx.message.interaction!.id)) });
    expect((await h.provider.webhook(webhookRequest(f.callbackUpdate(8201, "a")))).status).toBe(200);
    await f.until("the error reported", () => h.errors.length === 1);
    await h.bot.idle();
    expect(seen).toEqual(["a"]);
    expect(h.errors[0]!.message).toContain("answerCallbackQuery");
    expect(String((h.errors[0]!.cause as Error).message)).toContain("query is too old");
  });
});

test("a sink that throws instead of refusing: the webhook answers 503 and polling fetches the update again", async () => {
  const f = fake();
  const errors: Error[] = [];
  let fail = 2;
  const received: string[] = [];
  const sink = {
    receive: async (message: { id: string }) => {
      if (fail-- > 0) throw new Error("sink exploded");
      received.push(message.id);
      return { status: "admitted" as const, id: message.id };
    },
  };
  const hook = new TelegramProvider({ token: f.token, apiBase: f.url, secretToken: SECRET, onError: (e) => errors.push(e) });
  await hook.start(sink as never);
  const update = f.textUpdate(8401, "x");
  expect((await hook.webhook(webhookRequest(update))).status).toBe(503);
  const poller = new TelegramProvider({
    token: f.token,
    apiBase: f.url,
    mode: "polling",
    pollTimeoutSec: 1,
    pollBackoff: { baseMs: 5, capMs: 10 },
    onError: (e) => errors.push(e),
  });
  await poller.start(sink as never);
  cleanups.push(() => poller.stop());
  const polled = f.push(f.textUpdate(8402, "y"));
  await f.until("admitted", () => received.length === 1);
  expect(received).toEqual([f.inboundId(polled)]);
  expect(errors.map((e) => e.message)).toEqual(["sink exploded", "sink exploded"]);
});

describe("telegram: sends", () => {
  test("429 with retry_after is honoured", async () => {
    const f = fake();
    f.inject("sendMessage", { kind: "status", status: 429, description: "Too Many Requests: retry after 1", retryAfter: 1 });
    const h = await harness(f);
    const result = await h.bot.send("9001", "hi", { idempotencyKey: "k429" });
    expect(result.state).toBe("failed");
    expect(result.error).toContain("Too Many Requests: retry after 1");
    await h.bot.idle();
    const calls = f.calls.filter((c) => c.method === "sendMessage");
    expect(calls.map((c) => c.status)).toEqual([429, 200]);
    expect(calls[1]!.at - calls[0]!.at).toBeGreaterThanOrEqual(950);
    expect(calls[1]!.at - calls[0]!.at).toBeLessThan(5_000);
    expect((await h.bot.durability!.outbox.get("k429"))?.messageId).toBe("1");
  });

  test("5xx is retried; a timeout is held as ambiguous until an operator retries it; the message goes out once", async () => {
    const f = fake();
    f.inject("sendMessage", { kind: "status", status: 502 });
    f.inject("sendMessage", { kind: "hang" });
    f.inject("sendMessage", { kind: "status", status: 500 });
    const h = await harness(f, { requestTimeoutMs: 300 });
    const ambiguous: unknown[] = [];
    h.bot.on("durability:ambiguous", (event) => ambiguous.push(event));
    const first = await h.bot.send("9002", "hello", { idempotencyKey: "k5xx" });
    expect(first.state).toBe("failed");
    await h.bot.idle();
    // The 502 is retried; the timeout may have reached Telegram: held as unknown and reported, not retried.
    expect(f.calls.filter((c) => c.method === "sendMessage").map((c) => c.status)).toEqual([502, 0]);
    expect((await h.bot.durability!.outbox.get("k5xx"))?.state).toBe("unknown");
    expect(ambiguous).toEqual([{ key: "k5xx", chatId: "9002" }]);
    // An operator who checked that it did not arrive sends it again: the 500 is retried, then it goes out once.
    expect(await h.bot.durability!.retrySend("k5xx")).toBe(true);
    await h.bot.idle();
    const calls = f.calls.filter((c) => c.method === "sendMessage");
    expect(calls.map((c) => c.status)).toEqual([502, 0, 500, 200]);
    expect(f.sent.length).toBe(1);
    const entry = await h.bot.durability!.outbox.get("k5xx");
    expect(entry?.state).toBe("sent");
    expect(entry?.messageId).toBe("1");
  });

  test("an edit answered 400 \"message is not modified\" has taken effect: sent, not dead", async () => {
    const f = fake();
    const h = await harness(f);
    f.inject("editMessageText", { kind: "status", status: 400, description: "Bad Request: message is not modified: specified new message content and reply markup are exactly the same" });
    const result = await h.bot.send("9005", { method: "editMessageText", message_id: 12, text: "same" }, { idempotencyKey: "edit-1" });
    expect([result.state, result.messageId]).toEqual(["sent", "12"]);
    expect(h.dead).toEqual([]);
  });

  test("edits, chat actions and drafts go straight to the Bot API; everything else is journaled", async () => {
    const f = fake();
    const h = await harness(f);
    const typing = await h.bot.send("9006", { method: "sendChatAction", action: "typing" }, { idempotencyKey: "typing-1" });
    const first = await h.bot.send("9006", "draft", { idempotencyKey: "text-1" });
    const edit = await h.bot.send("9006", { method: "editMessageText", message_id: Number(first.messageId), text: "edited" }, { idempotencyKey: "edit-2" });
    const poll = await h.bot.send("9006", { method: "sendPoll", question: "Q?", options: ["a", "b"] }, { idempotencyKey: "poll-1" });
    expect([typing.state, edit.state, poll.state]).toEqual(["sent", "sent", "sent"]);
    const outbox = h.bot.durability!.outbox;
    expect(await outbox.get("typing-1")).toBeNull();
    expect(await outbox.get("edit-2")).toBeNull();
    expect((await outbox.get("poll-1"))?.state).toBe("sent");
    const answer = await h.bot.send("9006", { method: "answerCallbackQuery", callback_query_id: "q1" }, { idempotencyKey: "answer-1" });
    expect(answer.state).toBe("sent");
    expect((await outbox.get("answer-1"))?.state, "a method that creates no message but fails when repeated stays journaled").toBe("sent");
    expect(f.calls.map((c) => c.method).filter((m) => m !== "getMe")).toEqual(["sendChatAction", "sendMessage", "editMessageText", "sendPoll", "answerCallbackQuery"]);
    expect(f.edits).toEqual([{ chatId: "9006", messageId: Number(first.messageId), text: "edited" }]);
    // A failed direct call is the caller's error, not a dead letter, and it is not retried.
    f.inject("editMessageText", { kind: "status", status: 400, description: "Bad Request: message to edit not found" });
    const failed = await h.bot.send("9006", { method: "editMessageText", message_id: 99, text: "x" }).then(() => null, (e: Error) => e.message);
    expect(failed).toContain("message to edit not found");
    await h.bot.idle();
    expect(h.dead).toEqual([]);
    expect(f.calls.filter((c) => c.method === "editMessageText").length).toBe(2);
  });

  test("400 and 403 are permanent: dead at once, with Telegram's description", async () => {
    const f = fake();
    f.block("9003");
    f.inject("sendMessage", { kind: "status", status: 400, description: "Bad Request: chat not found" });
    const h = await harness(f);
    const missing = await h.bot.send("9004", "hi", { idempotencyKey: "k400" });
    expect(missing.state).toBe("dead");
    expect(missing.error).toContain("Bad Request: chat not found");
    const blocked = await h.bot.send("9003", "hi", { idempotencyKey: "k403" });
    expect(blocked.state).toBe("dead");
    expect(blocked.error).toBe("ProviderError: Telegram sendMessage failed with 403: Forbidden: bot was blocked by the user");
    expect(h.dead.map((d) => d.id).sort()).toEqual(["k400", "k403"]);
    expect(f.calls.filter((c) => c.method === "sendMessage").length).toBe(2);
  });

  test("a 200 that is not a Bot API answer, or lacks the message_id, is a clear permanent error", async () => {
    const f = fake();
    f.inject("sendMessage", { kind: "body", body: "<html>captive portal</html>", status: 200 });
    f.inject("sendMessage", { kind: "garbage-ok" });
    const h = await harness(f);
    const garbage = await h.bot.send("9005", "hi", { idempotencyKey: "kg1" });
    expect(garbage.state).toBe("dead");
    expect(garbage.error).toContain('Telegram sendMessage answered HTTP 200 with a body that is not a Bot API answer ("<html>captive portal</html>")');
    const noId = await h.bot.send("9005", "hi", { idempotencyKey: "kg2" });
    expect(noId.state).toBe("dead");
    expect(noId.error).toContain('answered ok but without a "message_id"');
  });

  test("content forms: text with params, photo by URL, a document upload, a raw method; bad content is permanent", async () => {
    const f = fake();
    const h = await harness(f);
    const sends = [
      await h.bot.send("9006", { text: "*bold*", parse_mode: "MarkdownV2", reply_markup: { inline_keyboard: [[{ text: "Yes", callback_data: "y" }]] } }),
      await h.bot.send("9006", { photo: "https://example.com/cat.jpg", text: "a cat" }),
      await h.bot.send("9006", { document: bytes("%PDF-1.4"), fileName: "report.pdf", caption: "report" }),
      await h.bot.send("9006", { method: "sendPoll", question: "Tea?", options: [{ text: "yes" }, { text: "no" }] }),
    ];
    expect(sends.map((s) => [s.state, s.messageId])).toEqual([["sent", "1"], ["sent", "2"], ["sent", "3"], ["sent", "4"]]);
    expect(f.sent.map((s) => s.method)).toEqual(["sendMessage", "sendPhoto", "sendDocument", "sendPoll"]);
    expect(f.sent[0]!.params.reply_markup).toEqual({ inline_keyboard: [[{ text: "Yes", callback_data: "y" }]] });
    expect(f.sent[1]!.params).toMatchObject({ photo: "https://example.com/cat.jpg", caption: "a cat" });
    expect(f.sent[2]!.params).toMatchObject({ document: { upload: "report.pdf", size: 8 }, caption: "report", chat_id: "9006" });
    await h.bot.send("9006", { text: "elsewhere?", chat_id: "1" });
    expect(f.sent.at(-1)!.chatId).toBe("9006");
    const bad = await h.bot.send("9006", { sticker: 42 } as never);
    expect(bad.state).toBe("dead");
    expect(bad.error).toContain('Telegram content field "sticker" must be a URL, a file_id or a Uint8Array, got 42');
    const unknown = await h.bot.send("9006", { hello: "x" });
    expect(unknown.state).toBe("dead");
    expect(unknown.error).toContain('got an object with keys ["hello"]');
  });

  test("classifyError reads ProviderError; a wrong token is permanent", async () => {
    const f = fake();
    const provider = new TelegramProvider({ token: "42:wrong", apiBase: f.url, secretToken: false });
    expect(provider.classifyError(new ProviderError("x", { status: 429, retryAfterMs: 3000 }))).toEqual({ retryable: true, retryAfterMs: 3000, rateLimited: "chat" });
    expect(provider.classifyError(new TypeError("fetch failed"))).toEqual({ retryable: true });
    const error = await provider.send("1", "hi", { idempotencyKey: "k", attempt: 1, signal: new AbortController().signal }).catch((e) => e);
    expect(error).toBeInstanceOf(ProviderError);
    expect(error.status).toBe(401);
    expect(error.retryable).toBe(false);
    expect(error.message).toBe("Telegram sendMessage failed with 401: Unauthorized");
  });
});

describe("telegram: media on reprocess", () => {
  test("SQLite: media loads on the first processing and again after a crash and restart; the reply goes out once", async () => {
    const f = fake();
    const file = join(dir, `media-${crypto.randomUUID()}.db`);
    const sqliteA = new SQLiteDurability({ file });
    const a = crashable(sqliteA);
    a.crashBefore("inbox.complete");
    const loads: { attempt: number; data: string }[] = [];
    const setup = (bot: Bot) =>
      bot.when(IMAGE, async (ctx: Context) => {
        const media = await loadMediaOf(ctx, { throwOnError: true });
        loads.push({ attempt: ctx.attempt, data: new TextDecoder().decode(media!.data) });
        await ctx.reply(`${media!.data.byteLength} bytes`);
      });
    const botA = await harness(f, { backend: a, instanceId: "tg-media", setup });
    const { update } = f.mediaUpdate(9101, "photo", bytes("PNG-DATA"));
    expect((await botA.provider.webhook(webhookRequest(update))).status).toBe(200);
    await f.until("the reply", () => f.sent.length === 1);
    await f.until("the crash", () => a.crashed);
    await botA.bot.stop();
    await sqliteA.close();
    const botB = await harness(f, { backend: new SQLiteDurability({ file }), instanceId: "tg-media", setup });
    await botB.bot.idle();
    expect(loads).toEqual([{ attempt: 1, data: "PNG-DATA" }, { attempt: 2, data: "PNG-DATA" }]);
    expect(f.sent.map((s) => s.params.text)).toEqual(["8 bytes"]); // answered from the outbox the second time
    const record = await botB.bot.durability!.inbox.get(f.inboundId(update));
    expect(record?.state).toBe("done");
  });

  test("tampered, wrong provider, wrong key, deleted file, over 20 MB, and a 5xx", async () => {
    const f = fake();
    let captured: Context | undefined;
    const h = await harness(f, { setup: (bot) => bot.when(ANY, (ctx) => void (captured = ctx)) });
    const { update, fileId } = f.mediaUpdate(9201, "document", bytes("DOC"), { mimeType: "text/plain", fileName: "a.txt" });
    expect((await h.provider.webhook(webhookRequest(update))).status).toBe(200);
    await h.bot.idle();
    const ctx = captured!;
    const reason = async (c: { message: Context["message"]; bot: { provider: Provider } }) => {
      try {
        await loadMediaOf(c, { throwOnError: true });
        return "loaded";
      } catch (error) {
        return error instanceof MediaUnavailableError ? error.reason : `other: ${error}`;
      }
    };
    expect(await loadMediaOf(ctx)).toMatchObject({ mimeType: "text/plain", fileName: "a.txt" });
    const media = ctx.message.media as { ref: Record<string, unknown> };
    const tampered = { ...ctx.message, media: { ...media, ref: { ...media.ref, fileId: "someone-elses" } } };
    expect(await reason({ message: tampered, bot: { provider: h.provider } })).toBe("rehydrate-failed");
    const other = new TelegramProvider({ token: f.token, apiBase: f.url, name: "telegram-2", secretToken: false });
    expect(await reason({ message: ctx.message, bot: { provider: other } })).toBe("provider-mismatch");
    const rotated = new TelegramProvider({ token: `${f.botId}:rotated-token`, apiBase: f.url, secretToken: false });
    expect(await reason({ message: ctx.message, bot: { provider: rotated } })).toBe("rehydrate-failed");
    f.inject("getFile", { kind: "status", status: 502 });
    const transient = await loadMediaOf(ctx).catch((e) => e);
    expect(transient).toBeInstanceOf(ProviderError);
    expect(transient.retryable).toBe(true);
    f.deleteFile(fileId);
    const gone = await loadMediaOf(ctx, { throwOnError: true }).catch((e) => e);
    expect(gone).toBeInstanceOf(MediaUnavailableError);
    expect(gone.reason).toBe("rehydrate-failed");
    expect(gone.message).toContain("wrong file_id or the file is temporarily unavailable");
    expect(gone.cause).toBeInstanceOf(ProviderError);
    const big = f.mediaUpdate(9201, "video", bytes("x"), { fileSize: 25 * 1024 * 1024 }).update;
    expect((await h.provider.webhook(webhookRequest(big))).status).toBe(200);
    await h.bot.idle();
    expect(ctx === captured).toBe(false);
    expect(await reason(captured!)).toBe("not-durable");
  });
});

test("parseUpdate: a null field counts as absent; a typed kind of the wrong shape names the field", async () => {
  const provider = new TelegramProvider({ token: "123:abc", secretToken: false });
  const base = { message_id: 3, date: 1, chat: { id: 77, type: "private" } };
  const parsed = await provider.parseUpdate({ update_id: 1, message: { ...base, text: "hi", photo: null, caption: null, venue: null } });
  expect(parsed.kind === "message" && [parsed.message.type, parsed.message.text]).toEqual(["text", "hi"]);
  const cases: [Record<string, unknown>, string, string][] = [
    [{ venue: { title: "T", location: { latitude: 1, longitude: 2 } } }, "message.venue.address", 'Telegram update field "message.venue.address" must be a string, got undefined'],
    [{ web_app_data: { data: 5, button_text: "b" } }, "message.web_app_data.data", 'Telegram update field "message.web_app_data.data" must be a string, got 5'],
    [{ new_chat_members: { id: 1 } }, "message.new_chat_members", 'Telegram update field "message.new_chat_members" must be an array of objects, got {"id":1}'],
    [{ users_shared: "x" }, "message.users_shared", 'Telegram update field "message.users_shared" must be an object, got "x"'],
  ];
  for (const [fields, field, text] of cases) {
    const error = await provider.parseUpdate({ update_id: 2, message: { ...base, ...fields } }).catch((e) => e);
    expect(error).toBeInstanceOf(TelegramUpdateError);
    expect([error.field, error.message, error.updateId]).toEqual([field, text, 2]);
  }
});

test("providers/telegram/ is Web-standard: no node: imports, no Deno, Bun or process globals", () => {
  const folder = join(import.meta.dir, "..", "providers", "telegram");
  const files = readdirSync(folder).filter((name) => name.endsWith(".ts")).sort();
  expect(files).toContain("provider.ts");
  expect(files).toContain("mod.ts");
  const code = (name: string) => readFileSync(join(folder, name), "utf8").replace(/\/\*[\s\S]*?\*\/|\/\/.*$/gm, "");
  expect(code("provider.ts")).toMatch(/export class TelegramProvider/);
  const offenders: string[] = [];
  for (const name of files) {
    const text = code(name);
    for (const pattern of [/from\s+["']node:|import\(\s*["']node:/, /\bDeno\s*\./, /\bBun\s*\./, /\bprocess\s*\./]) {
      if (pattern.test(text)) offenders.push(`${name} matches ${pattern}`);
    }
  }
  expect(offenders).toEqual([]);
});

describe("telegram: options", () => {
  const token = "123:abc";
  const cases: [Record<string, unknown>, typeof TypeError | typeof RangeError, RegExp][] = [
    [{}, TypeError, /^Option "token" must be a bot token string/],
    [{ token: "nocolon" }, TypeError, /^Option "token" must look like "123456:ABC-DEF…".*7 characters/],
    [{ token }, TypeError, /^Option "secretToken" is required in webhook mode/],
    [{ token, secretToken: "has space" }, TypeError, /^Option "secretToken" must be 1-256 characters/],
    [{ token, secretToken: false, mode: "push" }, TypeError, /^Option "mode" must be "webhook" or "polling", got "push"$/],
    [{ token, secretToken: false, apiBase: "ftp://x" }, TypeError, /^Option "apiBase" must be an http\(s\) URL, got "ftp:\/\/x"$/],
    [{ token, secretToken: false, pollTimeoutSec: 60 }, RangeError, /^Option "pollTimeoutSec" must be an integer from 0 to 50, got 60$/],
    [{ token, secretToken: false, requestTimeoutMs: "1s" }, TypeError, /^Option "requestTimeoutMs" must be an integer from 100 to 600000, got "1s"$/],
    [{ token, secretToken: false, mediaKey: "short" }, RangeError, /^Option "mediaKey" must be at least 16 bytes, got 5$/],
    [{ token, secretToken: false, fetch: 1 }, TypeError, /^Option "fetch" must be a function, got 1$/],
    [{ token, secretToken: false, allowedUpdates: "message" }, TypeError, /^Option "allowedUpdates" must be an array/],
    [{ token, secretToken: false, pollBackoff: { baseMs: 100, capMs: 10 } }, RangeError, /^Option "pollBackoff.capMs" must be at least/],
    [{ token, secretToken: false, name: "" }, TypeError, /^Option "name" must be a non-empty string, got ""$/],
    [{ token, secretToken: false, colour: 1 }, TypeError, /^Unknown Telegram option "colour"; known options are "token"/],
  ];
  for (const [options, Kind, pattern] of cases) {
    test(`rejects ${JSON.stringify(options).replace(token, "<token>")}`, () => {
      let error: unknown;
      try {
        new TelegramProvider(options as never);
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(Kind);
      expect((error as Error).message).toMatch(pattern);
    });
  }

  test("the connection id is the bot id; the token never appears in errors", async () => {
    const provider = new TelegramProvider({ token: "777:SECRETPART", secretToken: false, apiBase: "http://127.0.0.1:9", requestTimeoutMs: 500 });
    expect(provider.connectionId).toBe("777");
    expect(provider.name).toBe("telegram");
    expect(provider.mode).toBe("webhook");
    const error = await provider.call("getMe").then(() => null, (e: ProviderError) => e);
    expect(error).toBeInstanceOf(ProviderError);
    expect(error!.retryable).toBe(true);
    expect(error!.message).not.toContain("SECRETPART");
    // Nor anywhere in the error as a runtime prints it (the cause chain, properties such as `path`).
    expect(Bun.inspect(error)).not.toContain("SECRETPART");
    let cause: unknown = error;
    while (cause instanceof Error) {
      for (const value of Object.values(cause)) expect(String(value)).not.toContain("SECRETPART");
      cause = cause.cause;
    }
  });
});
