// The WhatsApp Cloud API provider against a fake Graph API and a fake Meta
// webhook sender on loopback, with a real Bot and durability (memory; SQLite
// for the restart and one full run).
import { afterAll, afterEach, describe, expect, test } from "bun:test";
import { spawn } from "node:child_process";
import { mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { ANY, Bot, type DurabilityBackend, type InboundMessage, loadMediaOf, type LoadedMedia, MediaUnavailableError, MemoryDurability } from "../mod.ts";
import { type InboundSink } from "../provider.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import {
  classifyGraphError,
  parseRetryAfter,
  parseWhatsAppChatId,
  WhatsAppApiError,
  WhatsAppChangeError,
  whatsAppChatId,
  WhatsAppPayloadError,
  WHATSAPP_MAX_MESSAGE_DEPTH,
  WhatsAppProvider,
  type WhatsAppProviderOptions,
  type WhatsAppStatus,
} from "../providers/whatsapp/mod.ts";
import { CUT_NESTING_MARK } from "../src/content.ts";
import { childLines } from "./support/child_lines.ts";
import { addressedTo, corpusPayload, FakeWhatsApp, inbound, makeWamid, statusUpdate, webhookPayload } from "./support/fake_whatsapp.ts";

const dir = join(tmpdir(), `botmesh-whatsapp-tests-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const TOKEN = "EAAG-test-access-token";
const PHONE = "106540352242922";
const SECRET = "app-secret-0123456789abcdef";
const VERIFY = "verify-me-please";
const USER = "16505551234";
const USER2 = "16505550000";

const fake = FakeWhatsApp.start({ accessToken: TOKEN, phoneNumberId: PHONE, appSecret: SECRET });
afterAll(() => fake.close());

const cleanups: (() => Promise<void> | void)[] = [];
afterEach(async () => {
  while (cleanups.length > 0) await cleanups.pop()!();
});

interface Harness {
  bot: Bot;
  provider: WhatsAppProvider;
  hook: string;
  seen: InboundMessage[];
  errors: Error[];
  botErrors: unknown[];
  statuses: WhatsAppStatus[];
  dead: { kind: string; id: string; error: string }[];
}

function makeProvider(
  extra: Partial<WhatsAppProviderOptions> = {},
  sinks?: { errors: Error[]; statuses: WhatsAppStatus[] },
): WhatsAppProvider {
  return new WhatsAppProvider({
    accessToken: TOKEN,
    phoneNumberId: PHONE,
    appSecret: SECRET,
    verifyToken: VERIFY,
    graphBase: fake.url,
    requestTimeoutMs: 2_000,
    onError: (error) => sinks?.errors.push(error),
    onStatus: (status) => {
      sinks?.statuses.push(status);
    },
    ...extra,
  });
}

/** A bot with the WhatsApp provider, its webhook served on loopback. */
async function harness(
  options: {
    backend?: DurabilityBackend;
    provider?: Partial<WhatsAppProviderOptions>;
    setup?: (bot: Bot, h: Harness) => void;
    outboxRetries?: number;
    inboxRetries?: number;
    start?: boolean;
  } = {},
): Promise<Harness> {
  const errors: Error[] = [];
  const statuses: WhatsAppStatus[] = [];
  const provider = makeProvider(options.provider, { errors, statuses });
  const bot = new Bot({
    provider,
    durability: {
      backend: options.backend ?? new MemoryDurability(),
      instanceId: "wa-test",
      inbox: { retries: options.inboxRetries ?? 2, backoff: { baseMs: 10, capMs: 40 } },
      // The pair limit (1 per 6 s per user) off: these tests send several messages to one chat at once.
      outbox: { retries: options.outboxRetries ?? 4, backoff: { baseMs: 10, capMs: 40 }, rateLimit: { perChat: false } },
    },
  });
  const server = Bun.serve({ hostname: "127.0.0.1", port: 0, fetch: provider.webhook });
  const h: Harness = {
    bot,
    provider,
    hook: `http://127.0.0.1:${server.port}/webhook/whatsapp`,
    seen: [],
    errors,
    botErrors: [],
    statuses,
    dead: [],
  };
  bot.on("error", (e) => h.botErrors.push(e));
  bot.on("durability:dead", (d) => h.dead.push(d));
  if (options.setup) options.setup(bot, h);
  else bot.when(ANY, (ctx) => void h.seen.push(ctx.message));
  if (options.start !== false) await bot.start();
  cleanups.push(async () => {
    await bot.stop();
    server.stop(true);
  });
  return h;
}

/** The levels of objects and arrays in a value (the value itself is level 1), counted without recursion. */
function depthOf(value: unknown): number {
  let max = 0;
  const stack: [unknown, number][] = [[value, 1]];
  while (stack.length > 0) {
    const [v, d] = stack.pop()!;
    if (typeof v !== "object" || v === null) continue;
    max = Math.max(max, d);
    for (const item of Object.values(v)) stack.push([item, d + 1]);
  }
  return max;
}

const payload = (messages: unknown[], statuses?: unknown[]) =>
  webhookPayload(PHONE, { contacts: [{ profile: { name: "Sheena Nelson" }, wa_id: USER }], messages, ...(statuses ? { statuses } : {}) });

/** A sink that records what the provider hands the bot and admits each id once, as a journal does. */
function recordingSink(options: { confirmSent?: (key: string, messageId: string) => Promise<boolean> } = {}) {
  const received: InboundMessage[] = [];
  const journal = new Map<string, InboundMessage>();
  const confirmed: [string, string][] = [];
  const reported: Error[] = [];
  const sink: InboundSink = {
    receive(message) {
      received.push(message);
      if (journal.has(message.id)) return Promise.resolve({ status: "duplicate", id: message.id });
      journal.set(message.id, message);
      return Promise.resolve({ status: "admitted", id: message.id });
    },
    reportError: (error) => void reported.push(error),
    confirmSent(key, messageId) {
      confirmed.push([key, messageId]);
      return options.confirmSent ? options.confirmSent(key, messageId) : Promise.resolve(false);
    },
  };
  return { sink, received, journal, confirmed, reported };
}

/** A provider whose errors and statuses are collected, for a recording sink. */
function sinkProvider(extra: Partial<WhatsAppProviderOptions> = {}) {
  const errors: Error[] = [];
  const statuses: WhatsAppStatus[] = [];
  return { provider: makeProvider(extra, { errors, statuses }), errors, statuses };
}

/** POST a payload to the provider's webhook handler directly, signed as Meta signs it. */
async function postSigned(provider: WhatsAppProvider, body: unknown): Promise<Response> {
  const text = JSON.stringify(body);
  return await provider.webhook(
    new Request("http://127.0.0.1/webhook/whatsapp", {
      method: "POST",
      headers: { "content-type": "application/json", "x-hub-signature-256": await fake.sign(text) },
      body: text,
    }),
  );
}

// ---- verification and request checks ------------------------------------------------------

describe("webhook verification and request checks", () => {
  test("GET verification answers the challenge only for the right token", async () => {
    const h = await harness();
    const ok = await fetch(`${h.hook}?hub.mode=subscribe&hub.verify_token=${VERIFY}&hub.challenge=1158201444`);
    expect(ok.status).toBe(200);
    expect(ok.headers.get("content-type")).toContain("text/plain");
    expect(await ok.text()).toBe("1158201444");
    const wrong = await fetch(`${h.hook}?hub.mode=subscribe&hub.verify_token=nope&hub.challenge=1158201444`);
    expect(wrong.status).toBe(403);
    expect(await wrong.text()).toContain("verify_token does not match");
    const longer = await fetch(`${h.hook}?hub.mode=subscribe&hub.verify_token=${VERIFY}x&hub.challenge=1`);
    expect(longer.status).toBe(403);
    const noMode = await fetch(`${h.hook}?hub.verify_token=${VERIFY}&hub.challenge=1`);
    expect(noMode.status).toBe(403);
    const badMode = await fetch(`${h.hook}?hub.mode=unsubscribe&hub.verify_token=${VERIFY}&hub.challenge=1`);
    expect(badMode.status).toBe(403);
  });

  test("POST signature: 401 when missing, malformed or wrong, 200 when right", async () => {
    const h = await harness();
    const body = payload([inbound.text(USER, "hi")]);
    const missing = await fake.post(h.hook, body, { signature: null });
    expect(missing.status).toBe(401);
    expect(missing.text).toContain("Missing X-Hub-Signature-256");
    const malformed = await fake.post(h.hook, body, { signature: "sha1=abc" });
    expect(malformed.status).toBe(401);
    expect(malformed.text).toContain("Malformed");
    const wrongSecret = await fake.post(h.hook, body, { signature: await fake.sign(JSON.stringify(body), "another-secret") });
    expect(wrongSecret.status).toBe(401);
    expect(wrongSecret.text).toContain("does not match");
    // signed, then altered in transit
    const altered = await fake.post(h.hook, JSON.stringify(body).replace('"hi"', '"ho"'), {
      signature: await fake.sign(JSON.stringify(body)),
    });
    expect(altered.status).toBe(401);
    await h.bot.idle();
    expect(h.seen).toHaveLength(0);
    expect(await h.bot.durability!.inbox.list()).toHaveLength(0);
    const right = await fake.post(h.hook, body);
    expect(right.status).toBe(200);
    await h.bot.idle();
    expect(h.seen.map((m) => m.text)).toEqual(["hi"]);
  });

  test("400 for a body that is not JSON or not a WhatsApp payload, with a clear message", async () => {
    const h = await harness();
    const notJson = await fake.post(h.hook, "{not json");
    expect(notJson.status).toBe(400);
    expect(notJson.text).toContain("not valid JSON");
    const wrongObject = await fake.post(h.hook, { object: "page", entry: [] });
    expect(wrongObject.status).toBe(400);
    expect(wrongObject.text).toBe('Webhook field "object" must be "whatsapp_business_account", got "page"');
    const noEntry = await fake.post(h.hook, { object: "whatsapp_business_account" });
    expect(noEntry.status).toBe(400);
    expect(noEntry.text).toContain('field "entry" must be an array');
    const array = await fake.post(h.hook, "[1,2]");
    expect(array.status).toBe(400);
    expect(array.text).toContain("must be a JSON object");
  });

  test("413 over maxBodyBytes, by Content-Length and by a streamed body", async () => {
    const h = await harness({ provider: { maxBodyBytes: 4096 } });
    const big = JSON.stringify({ object: "whatsapp_business_account", entry: [], pad: "x".repeat(5000) });
    const byLength = await fake.post(h.hook, big);
    expect(byLength.status).toBe(413);
    expect(byLength.text).toContain("4096");
    // no Content-Length: the body is read up to the limit
    const stream = new ReadableStream<Uint8Array>({
      start(controller) {
        for (let i = 0; i < 10; i++) controller.enqueue(new TextEncoder().encode("x".repeat(1000)));
        controller.close();
      },
    });
    const streamed = await h.provider.webhook(
      new Request("http://localhost/hook", {
        method: "POST",
        headers: { "x-hub-signature-256": `sha256=${"0".repeat(64)}` },
        body: stream,
        duplex: "half",
      } as RequestInit),
    );
    expect(streamed.status).toBe(413);
    // the default is 1 MiB
    const h2 = await harness();
    const huge = await fake.post(h2.hook, JSON.stringify({ pad: "y".repeat(1024 * 1024 + 1) }));
    expect(huge.status).toBe(413);
  });

  test("408 when the body does not arrive within bodyTimeoutMs: a body that never ends holds nothing", async () => {
    const { provider, errors } = sinkProvider({ bodyTimeoutMs: 150 });
    let cancelled: unknown = "not cancelled";
    const endless = new ReadableStream<Uint8Array>({
      start(controller) {
        controller.enqueue(new TextEncoder().encode('{"object":"whatsapp_business_account","entry":['));
      },
      cancel(reason) {
        cancelled = reason;
      },
    });
    const started = performance.now();
    const response = await provider.webhook(
      new Request("http://localhost/hook", {
        method: "POST",
        headers: { "x-hub-signature-256": `sha256=${"0".repeat(64)}` },
        body: endless,
        duplex: "half",
      } as RequestInit),
    );
    const took = performance.now() - started;
    expect(response.status).toBe(408);
    expect(await response.text()).toContain("150 ms (bodyTimeoutMs)");
    expect(took).toBeGreaterThanOrEqual(140);
    expect(took).toBeLessThan(5_000);
    expect(String(cancelled), "the body is cancelled").toContain("150 ms");
    expect(errors).toEqual([]);
    // A body that ends in time is read as before (a wrong signature: 401, not 408).
    const ok = await provider.webhook(
      new Request("http://localhost/hook", {
        method: "POST",
        headers: { "x-hub-signature-256": `sha256=${"0".repeat(64)}` },
        body: "{}",
      }),
    );
    expect(ok.status).toBe(401);
    expect(() => sinkProvider({ bodyTimeoutMs: 0 })).toThrow('Option "bodyTimeoutMs"');
  });

  test("405 with Allow for other methods; 503 while the bot is not started", async () => {
    const h = await harness({ start: false });
    const put = await fetch(h.hook, { method: "PUT", body: "x" });
    expect(put.status).toBe(405);
    expect(put.headers.get("allow")).toBe("GET, POST");
    const notStarted = await fake.post(h.hook, payload([inbound.text(USER, "early")]));
    expect(notStarted.status).toBe(503);
    expect(notStarted.text).toContain("not started");
    await h.bot.start();
    const started = await fake.post(h.hook, payload([inbound.text(USER, "early")]));
    expect(started.status).toBe(200);
    await h.bot.idle();
    expect(h.seen.map((m) => m.text)).toEqual(["early"]);
  });
});

// ---- inbound messages --------------------------------------------------------------------------

describe("inbound messages", () => {
  test("each kind reaches the handlers with its type, text and interaction; statuses are not admitted", async () => {
    const h = await harness();
    const sentId = makeWamid();
    const messages = [
      inbound.text(USER, "Does it come in another color?", "wamid.text1"),
      inbound.media("image", USER, { caption: "a cat", mime_type: "image/jpeg", sha256: "abc", id: "9001" }, "wamid.image1"),
      inbound.media("audio", USER, { mime_type: "audio/ogg; codecs=opus", sha256: "abc", id: "9002", voice: true }, "wamid.audio1"),
      inbound.media("document", USER, { caption: "the invoice", filename: "invoice.pdf", mime_type: "application/pdf", id: "9003" }, "wamid.doc1"),
      inbound.media("video", USER, { mime_type: "video/mp4", id: "9004" }, "wamid.video1"),
      inbound.media("sticker", USER, { mime_type: "image/webp", id: "9005", animated: false }, "wamid.sticker1"),
      inbound.buttonReply(USER, "yes-button", "Yes", "wamid.button1"),
      inbound.listReply(USER, "row-2", "Express", "Next day", "wamid.list1"),
      inbound.templateButton(USER, "STOP_PROMOS", "Stop promotions", "wamid.tpl1"),
      inbound.other(USER, "reaction", { message_id: sentId, emoji: "👍" }, "wamid.reaction1"),
      inbound.other(USER, "location", { latitude: 1.5, longitude: 2.5, name: "Cafe", address: "Main St 1" }, "wamid.loc1"),
      inbound.other(USER, "unsupported", undefined, "wamid.unsup1"),
    ];
    const statuses = [
      statusUpdate(sentId, "sent", USER, { biz_opaque_callback_data: "order:42:1" }),
      statusUpdate(sentId, "delivered", USER),
      statusUpdate(sentId, "read", USER),
      statusUpdate(makeWamid(), "failed", USER, { errors: [{ code: 131047, title: "Re-engagement message" }] }),
    ];
    const res = await fake.post(h.hook, payload(messages, statuses));
    expect(res.status).toBe(200);
    const summary = JSON.parse(res.text);
    expect(summary).toMatchObject({ ok: true, admitted: 12, duplicates: 0, rejected: 0, statuses: 4 });
    await h.bot.idle();
    const byId = new Map(h.seen.map((m) => [m.id, m]));
    expect(h.seen.map((m) => m.id)).toEqual(messages.map((m) => m.id as string)); // one chat: payload order
    const text = byId.get("wamid.text1")!;
    expect(text).toMatchObject({ type: "text", text: "Does it come in another color?", chatId: USER, from: USER });
    expect(text.timestamp).toBe(Number(messages[0].timestamp) * 1000);
    expect((text.extra as Record<string, unknown>).profileName).toBe("Sheena Nelson");
    expect(byId.get("wamid.image1")).toMatchObject({ type: "image", text: "a cat" });
    expect(byId.get("wamid.image1")!.media).toMatchObject({ v: 1, provider: "whatsapp", ref: { mediaId: "9001", mimeType: "image/jpeg" } });
    expect(byId.get("wamid.audio1")).toMatchObject({ type: "audio", extra: { audio: { voice: true } } });
    expect(byId.get("wamid.audio1")!.text).toBeUndefined();
    expect(byId.get("wamid.doc1")).toMatchObject({ type: "document", text: "the invoice" });
    expect(byId.get("wamid.doc1")!.media).toMatchObject({ ref: { fileName: "invoice.pdf" } });
    expect(byId.get("wamid.video1")!.type).toBe("video");
    expect(byId.get("wamid.sticker1")!.type).toBe("sticker");
    expect(byId.get("wamid.button1")).toMatchObject({
      type: "interaction",
      interaction: { id: "yes-button", value: { kind: "button_reply", title: "Yes" } },
    });
    expect((byId.get("wamid.button1")!.extra as Record<string, unknown>).context).toBeDefined();
    expect(byId.get("wamid.list1")).toMatchObject({
      type: "interaction",
      interaction: { id: "row-2", value: { kind: "list_reply", title: "Express", description: "Next day" } },
    });
    expect(byId.get("wamid.tpl1")).toMatchObject({
      type: "interaction",
      interaction: { id: "STOP_PROMOS", value: { kind: "button", title: "Stop promotions", payload: "STOP_PROMOS" } },
    });
    expect(byId.get("wamid.reaction1")).toMatchObject({ type: "reaction", text: "👍", extra: { reaction: { message_id: sentId } } });
    expect(byId.get("wamid.loc1")).toMatchObject({ type: "location", text: "Cafe, Main St 1" });
    expect(byId.get("wamid.unsup1")!.type).toBe("unsupported");
    // statuses: to onStatus, not to the inbox
    expect(h.statuses.map((s) => s.status)).toEqual(["sent", "delivered", "read", "failed"]);
    expect(h.statuses[0]).toMatchObject({ id: sentId, recipientId: USER, callbackData: "order:42:1" });
    expect(h.statuses[3].errors).toEqual([{ code: 131047, title: "Re-engagement message" }]);
    const records = await h.bot.durability!.inbox.list();
    expect(records.map((r) => r.id).sort()).toEqual(messages.map((m) => m.id as string).sort());
    expect(records.find((r) => r.id === "wamid.button1")!.kind).toBe("interaction");
    expect(h.errors).toHaveLength(0);
  });

  test("a status-only POST admits nothing and calls no handler", async () => {
    const h = await harness();
    const res = await fake.post(h.hook, webhookPayload(PHONE, { statuses: [statusUpdate(makeWamid(), "delivered", USER)] }));
    expect(res.status).toBe(200);
    await h.bot.idle();
    expect(h.seen).toHaveLength(0);
    expect(await h.bot.durability!.inbox.list()).toHaveLength(0);
    expect(h.statuses).toHaveLength(1);
    expect(h.bot.durability!.metrics().inboundJournaled).toBe(0);
  });

  test("a message nested some thousands of levels deep: answered 200, journaled as unreadable (cut at the limit, named), dead-lettered", async () => {
    // 20 000 levels of arrays, 40 KB of JSON: encoding it for the journal once overflowed the stack, so that the
    // POST was answered 503 on every redelivery and its other messages never got in.
    const deep = () => JSON.parse("[".repeat(20_000) + "]".repeat(20_000)) as unknown;
    const h = await harness();
    const bad: Record<string, unknown> = { ...inbound.text(USER, "deep"), context: { a: deep() } };
    const noId = { from: USER2, type: "text", text: { body: "x" }, b: deep() }; // its id is then a hash of the message
    const good = inbound.text(USER, "fine");
    const res = await fake.post(h.hook, payload([bad, noId, good]));
    expect(res.status).toBe(200);
    const summary = JSON.parse(res.text);
    expect(summary).toMatchObject({ ok: true, admitted: 3, unreadable: 2 });
    const cutAt = `context.a${"[0]".repeat(WHATSAPP_MAX_MESSAGE_DEPTH - 2)}`;
    expect(summary.errors[0]).toBe(
      `WhatsApp webhook entry[0].changes[0].value.messages[0]: field "${cutAt}" nests deeper than ${WHATSAPP_MAX_MESSAGE_DEPTH} levels ` +
        "of objects and arrays (WHATSAPP_MAX_MESSAGE_DEPTH): the message is kept cut at that depth",
    );
    expect(h.errors.filter((e) => e instanceof WhatsAppPayloadError).map((e) => (e as WhatsAppPayloadError).field)).toEqual([
      cutAt,
      `b${"[0]".repeat(WHATSAPP_MAX_MESSAGE_DEPTH - 1)}`,
    ]);
    await h.bot.idle();
    expect(h.seen.map((m) => m.text)).toEqual(["fine"]);
    const record = await h.bot.durability!.inbox.get(bad.id as string);
    expect(record?.state).toBe("dead");
    let kept: unknown = (record!.payload as { extra: { raw: { context: { a: unknown } } } }).extra.raw.context.a;
    let levels = 2;
    while (Array.isArray(kept)) {
      kept = kept[0];
      levels++;
    }
    expect([kept, levels]).toEqual([CUT_NESTING_MARK, WHATSAPP_MAX_MESSAGE_DEPTH]);
    const deadIds = h.dead.map((d) => d.id);
    expect(deadIds).toHaveLength(2);
    expect(deadIds).toContain(bad.id as string);
    expect(deadIds.find((id) => id !== bad.id)).toMatch(/^unreadable:sha256:[0-9a-f]{64}$/);
  });

  test("two messages without an id that differ only below the cut: two ids, each the same on a redelivery", async () => {
    const h = await harness();
    const deep = (leaf: string) => JSON.parse(`${"[".repeat(5_000)}"${leaf}"${"]".repeat(5_000)}`) as unknown;
    const first = { from: USER, type: "text", text: { body: "x" }, b: deep("first") };
    const second = { from: USER, type: "text", text: { body: "x" }, b: deep("second") };
    const res = await fake.post(h.hook, payload([first, second]));
    expect(JSON.parse(res.text)).toMatchObject({ ok: true, admitted: 2, duplicates: 0, unreadable: 2 });
    const again = await fake.post(h.hook, payload([first, second]));
    expect(JSON.parse(again.text)).toMatchObject({ ok: true, admitted: 0, duplicates: 2, unreadable: 2 });
    await h.bot.idle();
    const ids = h.dead.map((d) => d.id);
    expect(ids).toHaveLength(2);
    expect(new Set(ids).size).toBe(2);
    for (const id of ids) expect(id).toMatch(/^unreadable:sha256:[0-9a-f]{64}$/);
  });

  test("a status and a change-level error nested some thousands of levels deep reach onStatus and onError cut, the field named", async () => {
    const h = await harness();
    const deep = () => JSON.parse("[".repeat(20_000) + "]".repeat(20_000)) as unknown;
    const wamid = makeWamid();
    const body = webhookPayload(PHONE, {
      statuses: [statusUpdate(wamid, "failed", USER, { errors: [{ code: 131026, x: deep() }] })],
      errors: [{ code: 131000, title: "Something went wrong", x: deep() }],
    });
    const res = await fake.post(h.hook, body);
    expect(res.status).toBe(200);
    const cutAt = `errors[0].x${"[0]".repeat(WHATSAPP_MAX_MESSAGE_DEPTH - 3)}`;
    expect(JSON.parse(res.text).errors).toContain(
      `WhatsApp webhook entry[0].changes[0].value.statuses[0]: field "${cutAt}" nests deeper than ${WHATSAPP_MAX_MESSAGE_DEPTH} levels ` +
        "of objects and arrays (WHATSAPP_MAX_MESSAGE_DEPTH): the status is kept cut at that depth",
    );
    expect(h.statuses.map((s) => [s.id, s.status])).toEqual([[wamid, "failed"]]);
    const status = h.statuses[0]!;
    expect(depthOf(status.raw)).toBe(WHATSAPP_MAX_MESSAGE_DEPTH);
    expect(depthOf(status.errors)).toBe(WHATSAPP_MAX_MESSAGE_DEPTH - 1);
    expect(JSON.stringify(status.raw)).toContain(CUT_NESTING_MARK);
    const changeError = h.errors.find((e): e is WhatsAppChangeError => e instanceof WhatsAppChangeError)!;
    expect(changeError.code).toBe(131000);
    expect(depthOf(changeError.raw)).toBe(WHATSAPP_MAX_MESSAGE_DEPTH);
  });

  test("a batch with malformed messages admits the others; each malformed one is journaled as unreadable, never lost", async () => {
    const { provider, errors } = sinkProvider();
    const rec = recordingSink();
    provider.start(rec.sink);
    const good1 = inbound.text(USER, "first");
    const noSender = inbound.text(USER, "lost");
    delete noSender.from;
    const badText: Record<string, unknown> = { ...inbound.text(USER2, "x"), text: { nobody: 1 } };
    const badButton = { ...inbound.buttonReply(USER, "", "Empty") };
    const good2 = inbound.text(USER2, "second");
    const body = payload([good1, noSender, "garbage".repeat(1000), badText, badButton, good2]);
    const res = await postSigned(provider, body);
    expect(res.status).toBe(200);
    const summary = await res.json();
    expect(summary).toMatchObject({ admitted: 6, unreadable: 4, duplicates: 0 });
    expect(summary.errors).toHaveLength(4);
    // what reached the bot: every message, in payload order per chat, the unreadable ones with their reason
    const byId = new Map(rec.received.map((m) => [m.id, m]));
    expect(byId.get(good1.id as string)).toMatchObject({ text: "first", chatId: USER });
    expect(byId.get(good1.id as string)!.unreadable).toBeUndefined();
    expect(byId.get(noSender.id as string)).toMatchObject({
      chatId: `wa:${PHONE}:unreadable`,
      type: "text",
      unreadable:
        'The message has no sender: field "from" (the phone number) is undefined, field "from_user_id" (the business-scoped user id) is undefined, and the change has no sole contact with a "user_id"',
      extra: { raw: noSender, field: "from_user_id", path: "entry[0].changes[0].value.messages[1]", waType: "text" },
    });
    const garbage = rec.received.find((m) => m.id.startsWith("unreadable:sha256:"))!;
    expect(garbage.id).toMatch(/^unreadable:sha256:[0-9a-f]{64}$/);
    expect(garbage).toMatchObject({ chatId: `wa:${PHONE}:unreadable`, type: "unreadable", extra: { raw: "garbage".repeat(1000) } });
    expect(garbage.unreadable).toStartWith('A message must be an object, got "garbagegarbage');
    expect(byId.get(badText.id as string)).toMatchObject({
      chatId: USER2,
      from: USER2,
      unreadable: 'Field "text.body" must be a string, got undefined',
    });
    expect(byId.get(badButton.id as string)!.unreadable).toBe('Field "interactive.button_reply.id" must be a non-empty string, got ""');
    expect(rec.received.filter((m) => m.chatId === USER2).map((m) => m.id)).toEqual([badText.id as string, good2.id as string]);
    // each is reported, naming the field
    expect(errors.every((e) => e instanceof WhatsAppPayloadError)).toBe(true);
    const [e1, e2, e3, e4] = errors as WhatsAppPayloadError[];
    expect(e1.message).toBe(
      "WhatsApp webhook entry[0].changes[0].value.messages[1]: the message has no sender: field \"from\" (the phone number) is " +
        'undefined, field "from_user_id" (the business-scoped user id) is undefined, and the change has no sole contact with a "user_id"',
    );
    expect(e1.field).toBe("from_user_id");
    expect(e2.message).toContain("messages[2]: a message must be an object");
    expect(e2.message.length).toBeLessThan(300); // the value is quoted, cut short
    expect(e3.field).toBe("text.body");
    expect(e4.field).toBe("interactive.button_reply.id");
    // Meta redelivers the same POST: the same ids (the hash too), all duplicates
    const again = await (await postSigned(provider, body)).json();
    expect(again).toMatchObject({ admitted: 0, duplicates: 6, unreadable: 4 });
    expect(rec.journal.size).toBe(6);
  });

  test("an unreadable message is answered like any message: 503 while the journal refuses it, then 200", async () => {
    const { provider } = sinkProvider();
    const rec = recordingSink();
    let refuse = true;
    const receive = rec.sink.receive;
    rec.sink.receive = (m) =>
      refuse && m.unreadable !== undefined
        ? Promise.resolve({ status: "rejected", id: m.id, error: new Error("journal down") })
        : receive(m);
    provider.start(rec.sink);
    const bad: Record<string, unknown> = { ...inbound.text(USER, "x"), text: { nobody: 1 } };
    const body = payload([bad, inbound.text(USER2, "other chat")]);
    const refused = await postSigned(provider, body);
    expect(refused.status).toBe(503);
    expect(await refused.json()).toMatchObject({ ok: false, admitted: 1, rejected: 1, unreadable: 1 });
    expect(rec.journal.has(bad.id as string)).toBe(false);
    refuse = false;
    const redelivered = await postSigned(provider, body);
    expect(redelivered.status).toBe(200);
    expect(await redelivered.json()).toMatchObject({ ok: true, admitted: 1, duplicates: 1 });
    expect(rec.journal.get(bad.id as string)!.unreadable).toBe('Field "text.body" must be a string, got undefined');
  });

  test("with a real bot, an unreadable message is journaled and no handler runs for it", async () => {
    const h = await harness();
    const bad: Record<string, unknown> = { ...inbound.text(USER, "x"), text: { nobody: 1 } };
    const res = await fake.post(h.hook, payload([bad, inbound.text(USER, "fine")]));
    expect(res.status).toBe(200);
    await h.bot.idle();
    expect(h.seen.map((m) => m.text)).toEqual(["fine"]);
    const ids = (await h.bot.durability!.inbox.list()).map((r) => r.id);
    expect(ids).toContain(bad.id as string);
    expect(h.errors.map((e) => (e as WhatsAppPayloadError).field)).toEqual(["text.body"]);
  });

  test("without onError, a malformed message is the bot's error event", async () => {
    const h = await harness({ provider: { onError: undefined } });
    const noId = inbound.text(USER, "no id");
    delete noId.id;
    expect((await fake.post(h.hook, payload([noId, inbound.text(USER, "fine")]))).status).toBe(200);
    await h.bot.idle();
    expect(h.seen.map((m) => m.text)).toEqual(["fine"]);
    expect(h.errors).toHaveLength(0);
    const reported = h.botErrors.filter((e) => e instanceof WhatsAppPayloadError) as WhatsAppPayloadError[];
    expect(reported).toHaveLength(1);
    expect(reported[0].field).toBe("id");
  });

  test("changes for another phone number (reported once) and other fields are ignored with a 200", async () => {
    const h = await harness();
    const other = await fake.post(h.hook, webhookPayload("999999999", { messages: [inbound.text(USER, "not ours")] }));
    expect(other.status).toBe(200);
    expect(JSON.parse(other.text)).toMatchObject({ admitted: 0, ignored: 1 });
    // Reported once per number, so that a mistyped phoneNumberId does not drop every message silently.
    await fake.post(h.hook, webhookPayload("999999999", { messages: [inbound.text(USER, "not ours either")] }));
    expect(h.errors.map((e) => e.message)).toEqual([expect.stringContaining('messages for phone number id "999999999" were ignored')]);
    const template = await fake.post(
      h.hook,
      webhookPayload(PHONE, {}, "message_template_status_update"),
    );
    expect(template.status).toBe(200);
    await h.bot.idle();
    expect(h.seen).toHaveLength(0);
    expect(await h.bot.durability!.inbox.list()).toHaveLength(0);
  });

  test("messages of one chat are handled one at a time in payload order, across chats concurrently", async () => {
    const order: string[] = [];
    let running = 0;
    let maxRunningPerChat = 0;
    const h = await harness({
      setup: (bot) =>
        bot.when(ANY, async (ctx) => {
          if (ctx.chatId === USER) {
            running++;
            maxRunningPerChat = Math.max(maxRunningPerChat, running);
          }
          await Promise.resolve();
          order.push(`${ctx.chatId}:${ctx.message.text}`);
          if (ctx.chatId === USER) running--;
        }),
    });
    const msgs = ["1", "2", "3", "4", "5"].map((t) => inbound.text(USER, t));
    msgs.splice(2, 0, inbound.text(USER2, "other"));
    expect((await fake.post(h.hook, payload(msgs))).status).toBe(200);
    await h.bot.idle();
    expect(order.filter((o) => o.startsWith(USER + ":"))).toEqual(["1", "2", "3", "4", "5"].map((t) => `${USER}:${t}`));
    expect(order).toContain(`${USER2}:other`);
    expect(maxRunningPerChat).toBe(1);
  });

  test("duplicates (same wamid in one POST and across POSTs, redeliveries) are processed once", async () => {
    const h = await harness();
    const m = inbound.text(USER, "once", "wamid.dup1");
    const first = await fake.post(h.hook, payload([m, m]));
    expect(first.status).toBe(200);
    expect(JSON.parse(first.text)).toMatchObject({ admitted: 1, duplicates: 1 });
    const again = await fake.post(h.hook, payload([m, inbound.text(USER, "new")]));
    expect(again.status).toBe(200);
    expect(JSON.parse(again.text)).toMatchObject({ admitted: 1, duplicates: 1 });
    await h.bot.idle();
    const later = await fake.post(h.hook, payload([m]));
    expect(later.status).toBe(200);
    await h.bot.idle();
    expect(h.seen.map((x) => x.text)).toEqual(["once", "new"]);
    expect(h.bot.durability!.metrics().inboundDuplicates).toBe(3);
    expect(await h.bot.durability!.inbox.list()).toHaveLength(2);
  });

  test("journal failure: 503, Meta redelivers, each message is processed exactly once", async () => {
    const backend = new MemoryDurability();
    const admit = backend.inbox.admit.bind(backend.inbox);
    let failures = 0;
    let calls = 0;
    (backend.inbox as { admit: typeof admit }).admit = (record, lease) => {
      calls++;
      // the second message of the first delivery fails to journal, once
      if (record.id === "wamid.j2" && failures === 0) {
        failures++;
        return Promise.reject(new Error("disk full"));
      }
      return admit(record, lease);
    };
    const h = await harness({ backend });
    const body = payload([inbound.text(USER, "one", "wamid.j1"), inbound.text(USER, "two", "wamid.j2"), inbound.text(USER2, "three", "wamid.j3")]);
    const statuses = await fake.deliver(h.hook, body);
    expect(statuses).toEqual([503, 200]);
    await h.bot.idle();
    expect(failures).toBe(1);
    expect(calls).toBeGreaterThanOrEqual(4);
    expect(h.seen.map((m) => m.id).sort()).toEqual(["wamid.j1", "wamid.j2", "wamid.j3"]);
    const records = await h.bot.durability!.inbox.list();
    expect(records.every((r) => r.state === "done")).toBe(true);
    expect(records).toHaveLength(3);
    expect(h.botErrors.some((e) => String((e as Error).message ?? e).includes("disk full"))).toBe(true);
    // the ones admitted on the first delivery came back as duplicates
    expect(h.bot.durability!.metrics().inboundDuplicates).toBe(2);
  });

  test("stress: concurrent POSTs, duplicates on purpose and flaky journal writes lose nothing and process each once", async () => {
    const backend = new MemoryDurability();
    const admit = backend.inbox.admit.bind(backend.inbox);
    let calls = 0;
    let failed = 0;
    (backend.inbox as { admit: typeof admit }).admit = (record, lease) => {
      if (++calls % 4 === 0) {
        failed++;
        return Promise.reject(new Error("journal hiccup"));
      }
      return admit(record, lease);
    };
    const counts = new Map<string, number>();
    const perChat = new Map<string, string[]>();
    const h = await harness({
      backend,
      setup: (bot) =>
        bot.when(ANY, (ctx) => {
          counts.set(ctx.message.id, (counts.get(ctx.message.id) ?? 0) + 1);
          perChat.set(ctx.chatId, [...(perChat.get(ctx.chatId) ?? []), ctx.message.text!]);
        }),
    });
    const posts = Array.from({ length: 10 }, (_, p) =>
      payload(Array.from({ length: 5 }, (_, i) => inbound.text(`1555000${p % 3}`, `p${p}-m${i}`, `wamid.stress-${p}-${i}`))));
    const deliveries = await Promise.all([
      ...posts.map((body) => fake.deliver(h.hook, body, 20)),
      ...posts.slice(0, 5).map((body) => fake.deliver(h.hook, body, 20)), // Meta sends some twice
    ]);
    expect(deliveries.every((d) => d.at(-1) === 200)).toBe(true);
    await h.bot.idle();
    expect(failed).toBeGreaterThan(0);
    expect(counts.size).toBe(50);
    expect([...counts.values()].every((n) => n === 1)).toBe(true);
    const records = await h.bot.durability!.inbox.list({ limit: 1000 });
    expect(records).toHaveLength(50);
    expect(records.every((r) => r.state === "done")).toBe(true);
    // within a POST delivered once, a chat's messages keep their order even across failed admissions
    // (a concurrent second delivery of one POST may find an admission still in flight and pass over it)
    for (const texts of perChat.values()) {
      for (let p = 5; p < 10; p++) {
        const mine = texts.filter((t) => t.startsWith(`p${p}-`));
        expect(mine).toEqual([...mine].sort());
      }
    }
  });

  test("after bot.stop() the webhook answers 503 so Meta redelivers to the next process", async () => {
    const h = await harness();
    await h.bot.stop();
    const res = await fake.post(h.hook, payload([inbound.text(USER, "late")]));
    expect(res.status).toBe(503);
    expect(h.seen).toHaveLength(0);
  });

  test("a WhatsApp Flow answer (nfm_reply) is an interaction with the parsed response", async () => {
    const h = await harness();
    const flow = inbound.other(USER, "interactive", {
      type: "nfm_reply",
      nfm_reply: { name: "flow", body: "Sent", response_json: '{"flow_token":"t1","size":"M"}' },
    }, "wamid.flow1");
    expect((await fake.post(h.hook, payload([flow]))).status).toBe(200);
    await h.bot.idle();
    expect(h.seen[0]).toMatchObject({
      type: "interaction",
      interaction: { id: "flow", value: { kind: "nfm_reply", title: "Sent", response: { flow_token: "t1", size: "M" } } },
    });
  });

  test("an onStatus that throws makes Meta redeliver; the messages of that POST are not processed twice", async () => {
    let throwOnce = true;
    const h = await harness({
      provider: {
        onStatus: () => {
          if (throwOnce) {
            throwOnce = false;
            throw new Error("status store down");
          }
        },
      },
    });
    const body = payload([inbound.text(USER, "with status")], [statusUpdate(makeWamid(), "read", USER)]);
    expect(await fake.deliver(h.hook, body)).toEqual([503, 200]);
    await h.bot.idle();
    expect(h.seen.map((m) => m.text)).toEqual(["with status"]);
    expect(h.errors.map((e) => e.message).join()).toContain("status store down");
  });
});

// ---- sends ------------------------------------------------------------------------------------

// ---- real documented payloads: usernames, groups, change-level errors, confirmations -------------

const BSUID = "US.13491208655302741918";

describe("real payloads (tests/corpus/whatsapp): usernames, groups, change-level errors, confirmations", () => {
  test("a user whose phone number Meta withholds is identified by from_user_id: chat bsuid:<id>, with the username", async () => {
    const { provider, errors } = sinkProvider();
    const rec = recordingSink();
    provider.start(rec.sink);
    const sample = await corpusPayload(
      "meta-docs.json",
      "bsuid: incoming text from a user with a username, phone number withheld, parent BSUIDs enabled",
    );
    const res = await postSigned(provider, addressedTo(sample, PHONE));
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ admitted: 1, unreadable: 0 });
    expect(rec.received).toHaveLength(1);
    const m = rec.received[0];
    expect(m).toMatchObject({
      id: "wamid.HBgLMTY1MDM4Nzk0MzkVAgASGBQzQTRBNjU5OUFFRTAzODEwMTQ0RgA=",
      chatId: `bsuid:${BSUID}`,
      from: `bsuid:${BSUID}`,
      type: "text",
      text: "Does it come in another color?",
      extra: { userId: BSUID, parentUserId: "US.ENT.11815799212886844830", username: "realsheenanelson", profileName: "Sheena Nelson" },
    });
    expect(m.unreadable).toBeUndefined();
    expect((m.extra as Record<string, unknown>).waId).toBeUndefined();
    expect(errors).toHaveLength(0);
    // an empty "from" is the same as none
    const emptied = addressedTo(sample, PHONE);
    emptied.entry[0].changes[0].value.messages[0].from = "";
    emptied.entry[0].changes[0].value.messages[0].id = "wamid.empty-from";
    await postSigned(provider, emptied);
    expect(rec.received[1]).toMatchObject({ id: "wamid.empty-from", chatId: `bsuid:${BSUID}` });
    expect(errors).toHaveLength(0);
  });

  test("when Meta gives both, the chat id stays the phone number and the BSUID rides along in extra", async () => {
    const { provider } = sinkProvider();
    const rec = recordingSink();
    provider.start(rec.sink);
    const sample = await corpusPayload("whatsapp-api-js.json", "v25/incoming");
    expect((await postSigned(provider, addressedTo(sample, PHONE))).status).toBe(200);
    expect(rec.received[0]).toMatchObject({
      id: "ABGGFlA5Fpa",
      chatId: "16315551181",
      from: "16315551181",
      text: "this is a text message",
      extra: { waId: "16315551181", userId: BSUID, parentUserId: "US.11815799212886844830", username: "@testusername" },
    });
  });

  test("a group message: the chat is the group, the sender its participant; a group's messages keep their order", async () => {
    const { provider } = sinkProvider();
    const order: string[] = [];
    const rec = recordingSink();
    const receive = rec.sink.receive;
    rec.sink.receive = async (m) => {
      order.push(`start ${m.id}`);
      await new Promise((r) => setTimeout(r, m.id.endsWith(">") ? 30 : 0)); // the first is slow: the second must wait
      order.push(`end ${m.id}`);
      return await receive(m);
    };
    provider.start(rec.sink);
    const sample = addressedTo(
      await corpusPayload("meta-docs.json", "group: text message received in a group"),
      PHONE,
    );
    const first = sample.entry[0].changes[0].value.messages[0];
    const second = { ...first, from: "16505550000", id: "wamid.second-in-group", text: { body: "I agree" } };
    sample.entry[0].changes[0].value.messages.push(second);
    expect((await postSigned(provider, sample)).status).toBe(200);
    const groupChat = "group:HBgLMTY1MDM4Nzk0MzkVAgASGBQzQTRBNjU5OUFFRTAzODEwMTQ0RgA";
    expect(rec.received[0]).toMatchObject({
      id: "wamid.HASDI128HJOPUERIH82ahdasd09ASDHi5>",
      chatId: groupChat,
      from: "16505551234",
      text: "What does everyone think about this?",
      extra: { groupId: "HBgLMTY1MDM4Nzk0MzkVAgASGBQzQTRBNjU5OUFFRTAzODEwMTQ0RgA", profileName: "Tiago Mingo", waId: "16505551234" },
    });
    expect(rec.received[1]).toMatchObject({ chatId: groupChat, from: "16505550000", text: "I agree" });
    expect(order).toEqual([`start ${first.id}`, `end ${first.id}`, "start wamid.second-in-group", "end wamid.second-in-group"]);
  });

  test("a change-level error (Meta's 130429 example) goes to onError naming the code and title; the POST is answered 200", async () => {
    const { provider, errors } = sinkProvider();
    const rec = recordingSink();
    provider.start(rec.sink);
    const res = await postSigned(provider, addressedTo(await corpusPayload("meta-docs.json", "errors: change-level 130429 rate limit hit"), PHONE));
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ admitted: 0, statuses: 0 });
    expect(rec.received).toHaveLength(0);
    expect(errors).toHaveLength(1);
    const error = errors[0] as WhatsAppChangeError;
    expect(error).toBeInstanceOf(WhatsAppChangeError);
    expect(error).toMatchObject({ code: 130429, title: "Rate limit hit", path: "entry[0].changes[0].value.errors[0]" });
    expect(error.message).toBe(
      'WhatsApp webhook entry[0].changes[0].value.errors[0]: Meta reported error 130429 "Rate limit hit": Message failed to send ' +
        'because there were too many messages sent from this phone number in a short period of time (field "errors" of the change, not tied to a message)',
    );
  });

  test("a change-level 131000 beside an interactive message Meta could not render: the message is skipped with an error naming its path, nothing journaled", async () => {
    const { provider, errors } = sinkProvider();
    const rec = recordingSink();
    provider.start(rec.sink);
    const sample = addressedTo(await corpusPayload("pywa.json", "message:interactive_message_with_err"), PHONE);
    const res = await postSigned(provider, sample);
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ admitted: 0, unreadable: 0, duplicates: 0 });
    expect(rec.received).toHaveLength(0);
    expect(errors.map((e) => e.name)).toEqual(["WhatsAppPayloadError", "WhatsAppChangeError"]);
    const skipped = errors[0] as WhatsAppPayloadError;
    expect(skipped.path).toBe("entry[0].changes[0].value.messages[0]");
    expect(skipped.field).toBe("interactive.type");
    expect(skipped.skipped).toBe(true);
    expect(skipped.message).toBe(
      'WhatsApp webhook entry[0].changes[0].value.messages[0]: Field "interactive.type" must be a string, got undefined; ' +
        "Meta reported the change as failed, so the message is skipped",
    );
    expect((errors[1] as WhatsAppChangeError).code).toBe(131000);
    expect(errors[1].message).toContain('error 131000 "Something went wrong": Unsupported webhook payload');
    // The same message without Meta's error beside it is a message we cannot read: journaled as unreadable.
    const alone = structuredClone(sample);
    delete alone.entry[0].changes[0].value.errors;
    expect(await (await postSigned(provider, alone)).json()).toMatchObject({ admitted: 1, unreadable: 1 });
    expect(rec.received[0]).toMatchObject({ id: "wamid.wegrchytvwcggt=", unreadable: 'Field "interactive.type" must be a string, got undefined' });
  });

  test("a message that names no sender, in a change with one contact: handled in the bsuid: chat of that contact", async () => {
    const { provider, errors } = sinkProvider();
    const rec = recordingSink();
    provider.start(rec.sink);
    const sample = addressedTo(await corpusPayload("meta-docs.json", "bsuid: incoming text from a user with a username, phone number withheld, parent BSUIDs enabled"), PHONE);
    const value = sample.entry[0].changes[0].value;
    const message = value.messages[0];
    delete message.from;
    delete message.from_user_id;
    delete message.from_parent_user_id;
    const res = await postSigned(provider, sample);
    expect(await res.json()).toMatchObject({ admitted: 1, unreadable: 0 });
    expect(errors).toEqual([]);
    expect(rec.received[0]).toMatchObject({ chatId: "bsuid:US.13491208655302741918", from: "bsuid:US.13491208655302741918", extra: { userId: "US.13491208655302741918", username: "realsheenanelson" } });
    // Two contacts: whose it is cannot be told, so it stays unreadable (journaled, naming the field).
    const two = structuredClone(sample);
    two.entry[0].changes[0].value.contacts.push({ profile: { name: "Other" }, user_id: "US.99" });
    two.entry[0].changes[0].value.messages[0].id = "wamid.second";
    expect(await (await postSigned(provider, two)).json()).toMatchObject({ admitted: 1, unreadable: 1 });
  });

  test("a change whose metadata or phone_number_id is missing or malformed: each message is journaled as unreadable, never dropped", async () => {
    const { provider, errors } = sinkProvider();
    const rec = recordingSink();
    provider.start(rec.sink);
    const sample = await corpusPayload("meta-docs.json", "messages: incoming text (Sheena Nelson)");
    const V = "entry[0].changes[0].value";
    const ID = `${V}.metadata.phone_number_id`;
    // deno-lint-ignore no-explicit-any
    const cases: [string, (value: any) => void, string, string][] = [
      ["no metadata", (v) => delete v.metadata, `${V}.metadata`, `Field "${V}.metadata" is missing`],
      ["metadata null", (v) => v.metadata = null, `${V}.metadata`, `Field "${V}.metadata" must be an object, got null`],
      ["metadata a string", (v) => v.metadata = PHONE, `${V}.metadata`, `Field "${V}.metadata" must be an object, got "${PHONE}"`],
      ["no phone_number_id", (v) => delete v.metadata.phone_number_id, ID, `Field "${ID}" is missing`],
      ["phone_number_id null", (v) => v.metadata.phone_number_id = null, ID, `Field "${ID}" must be a string, got null`],
      ["phone_number_id another number", (v) => v.metadata.phone_number_id = 999, ID, `Field "${ID}" must be a string, got 999`],
      [
        "phone_number_id a number past 2^53",
        (v) => v.metadata.phone_number_id = 12345678901234567,
        ID,
        `Field "${ID}" must be a string, got 12345678901234568`,
      ],
      [
        "phone_number_id not a phone number id",
        (v) => v.metadata.phone_number_id = ` ${PHONE}`,
        ID,
        `Field "${ID}" must be a phone number id (1 to 64 letters, digits, "_" or "-"), got " ${PHONE}"`,
      ],
      ["phone_number_id empty", (v) => v.metadata.phone_number_id = "", ID, `Field "${ID}" must be a phone number id (1 to 64 letters, digits, "_" or "-"), got ""`],
    ];
    for (const [i, [name, mutate, field, reason]] of cases.entries()) {
      const body = addressedTo(sample, PHONE);
      const value = body.entry[0].changes[0].value;
      mutate(value);
      value.messages[0].id = `wamid.case-${i}`;
      const res = await postSigned(provider, body);
      expect({ name, status: res.status }).toEqual({ name, status: 200 });
      expect(await res.json()).toMatchObject({ ok: true, admitted: 1, unreadable: 1, ignored: 0 });
      // journaled under its wamid, in the sender's chat, with the reason naming the field and Meta's object
      const record = rec.journal.get(`wamid.case-${i}`)!;
      expect({ name, record }).toMatchObject({
        name,
        record: {
          chatId: "16505551234",
          from: "16505551234",
          type: "text",
          timestamp: 1749416383000,
          unreadable: reason,
          extra: { raw: value.messages[0], field, path: `${V}.messages[0]`, waType: "text" },
        },
      });
      expect(record.text).toBeUndefined();
      expect(errors.at(-1)).toBeInstanceOf(WhatsAppPayloadError);
      expect(errors.at(-1)).toMatchObject({ path: `${V}.messages[0]`, field, reason });
      // Meta redelivers: a duplicate, not a second record
      expect(await (await postSigned(provider, body)).json()).toMatchObject({ admitted: 0, duplicates: 1 });
    }
    expect(rec.journal.size).toBe(cases.length);

    // the usual id and chat rules: no wamid -> the hash of the message; a group message -> the group
    const group = addressedTo(await corpusPayload("meta-docs.json", "group: text message received in a group"), PHONE);
    const body = addressedTo(sample, PHONE);
    const value = body.entry[0].changes[0].value;
    delete value.metadata.phone_number_id;
    delete value.messages[0].id;
    value.messages.push(group.entry[0].changes[0].value.messages[0]);
    value.statuses = addressedTo(await corpusPayload("pywa.json", "message_status:with_tracker"), PHONE).entry[0].changes[0].value.statuses;
    const res = await postSigned(provider, body);
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ admitted: 2, unreadable: 2, statuses: 0 }); // its statuses may be another number's: skipped
    const [hashed, inGroup] = rec.received.slice(-2);
    expect(hashed.id).toMatch(/^unreadable:sha256:[0-9a-f]{64}$/);
    expect(hashed).toMatchObject({ chatId: "16505551234", unreadable: `Field "${ID}" is missing` });
    expect(inGroup).toMatchObject({
      id: "wamid.HASDI128HJOPUERIH82ahdasd09ASDHi5>",
      chatId: "group:HBgLMTY1MDM4Nzk0MzkVAgASGBQzQTRBNjU5OUFFRTAzODEwMTQ0RgA",
      from: "16505551234",
      unreadable: `Field "${ID}" is missing`,
      extra: { path: `${V}.messages[1]` },
    });
    expect(rec.confirmed).toHaveLength(0);
    expect(await (await postSigned(provider, body)).json()).toMatchObject({ admitted: 0, duplicates: 2 });

    // a change without messages is no user message: ignored, as before
    const statusOnly = addressedTo(await corpusPayload("pywa.json", "message_status:with_tracker"), PHONE);
    delete statusOnly.entry[0].changes[0].value.metadata;
    const before = errors.length;
    expect(await (await postSigned(provider, statusOnly)).json()).toMatchObject({ admitted: 0, statuses: 0, ignored: 1 });
    expect(errors).toHaveLength(before);
  });

  test("phone_number_id as a JSON number equal to ours is taken as ours (reported once); another well-formed id is ignored", async () => {
    const { provider, errors } = sinkProvider();
    const rec = recordingSink();
    provider.start(rec.sink);
    const sample = await corpusPayload("meta-docs.json", "messages: incoming text (Sheena Nelson)");
    const numeric = addressedTo(sample, PHONE);
    numeric.entry[0].changes[0].value.metadata.phone_number_id = Number(PHONE);
    const res = await postSigned(provider, numeric);
    expect(res.status).toBe(200);
    expect(await res.json()).toMatchObject({ admitted: 1, unreadable: 0 });
    expect(rec.received[0]).toMatchObject({ chatId: "16505551234", text: "Does it come in another color?" });
    expect(rec.received[0].unreadable).toBeUndefined();
    expect(errors.map((e) => e.message)).toEqual([
      `WhatsApp webhook entry[0].changes[0].value.metadata.phone_number_id: the phone number id is the number ${PHONE}, not a string; ` +
      `taken as this provider's "${PHONE}" (reported once)`,
    ]);
    await postSigned(provider, numeric);
    expect(errors).toHaveLength(1);
    // a well-formed id that is not ours: another number's change, ignored and reported once, as before
    const other = addressedTo(sample, "106540352242923");
    expect(await (await postSigned(provider, other)).json()).toMatchObject({ admitted: 0, unreadable: 0, ignored: 1 });
    expect(errors.at(-1)!.message).toContain('messages for phone number id "106540352242923" were ignored');
    expect(rec.journal.size).toBe(1);
  });

  test("with a real bot, a message of a change without metadata is journaled, dead-lettered, and no handler runs", async () => {
    const h = await harness();
    const body = addressedTo(await corpusPayload("meta-docs.json", "messages: incoming text (Sheena Nelson)"), PHONE);
    delete body.entry[0].changes[0].value.metadata;
    expect(await fake.deliver(h.hook, body)).toEqual([200]);
    await h.bot.idle();
    const wamid = body.entry[0].changes[0].value.messages[0].id;
    expect(h.seen).toHaveLength(0);
    const records = await h.bot.durability!.inbox.list();
    expect(records.map((r) => r.id)).toEqual([wamid]);
    expect(records[0].payload).toMatchObject({ unreadable: 'Field "entry[0].changes[0].value.metadata" is missing' });
    expect(h.dead).toEqual([expect.objectContaining({ kind: "inbound", id: wamid })]);
  });

  test("a sent/delivered/read status with biz_opaque_callback_data confirms the send; failed does not; a failing confirmSent is reported and answered 503", async () => {
    const { provider, errors, statuses } = sinkProvider();
    let fail = false;
    const rec = recordingSink({ confirmSent: () => fail ? Promise.reject(new Error("journal down")) : Promise.resolve(true) });
    provider.start(rec.sink);
    const sample = addressedTo(await corpusPayload("pywa.json", "message_status:with_tracker"), PHONE);
    expect((await postSigned(provider, sample)).status).toBe(200);
    expect(rec.confirmed).toEqual([["some data", "wamid.xyzxyz"]]);
    expect(statuses[0]).toMatchObject({ id: "wamid.xyzxyz", status: "sent", callbackData: "some data", chatId: "972987654321" });
    for (const status of ["delivered", "read", "played", "failed"]) {
      const copy = structuredClone(sample);
      copy.entry[0].changes[0].value.statuses[0].status = status;
      expect((await postSigned(provider, copy)).status).toBe(200);
    }
    expect(rec.confirmed.map(([key]) => key)).toEqual(["some data", "some data", "some data", "some data"]); // not for failed
    expect(statuses.map((s) => s.status)).toEqual(["sent", "delivered", "read", "played", "failed"]);
    fail = true;
    const res = await postSigned(provider, sample);
    expect(res.status).toBe(503); // Meta redelivers the POST, and the status with it
    expect(errors.at(-1)!.message).toBe(
      'WhatsApp webhook entry[0].changes[0].value.statuses[0]: confirmSent("some data", "wamid.xyzxyz") failed for the "sent" status: journal down',
    );
    expect(statuses).toHaveLength(6); // onStatus still called
  });

  test("a failing confirmSent (the journal) is answered 503: Meta redelivers, the status confirms then, the messages are duplicates", async () => {
    const { provider, errors, statuses } = sinkProvider();
    let failures = 1;
    const rec = recordingSink({
      confirmSent: () => failures-- > 0 ? Promise.reject(new Error("journal down")) : Promise.resolve(true),
    });
    provider.start(rec.sink);
    // one POST with a real message and a real status carrying an outbox key, as Meta batches them
    const body = addressedTo(await corpusPayload("meta-docs.json", "messages: incoming text (Sheena Nelson)"), PHONE);
    const tracker = addressedTo(await corpusPayload("pywa.json", "message_status:with_tracker"), PHONE);
    body.entry[0].changes[0].value.statuses = tracker.entry[0].changes[0].value.statuses;
    const wamid = body.entry[0].changes[0].value.messages[0].id;
    const first = await postSigned(provider, body);
    expect(first.status).toBe(503);
    const summary = await first.json();
    expect(summary).toMatchObject({ ok: false, admitted: 1, rejected: 0, statuses: 1 });
    expect(summary.errors[0]).toBe("confirmSent failed; redeliver the POST");
    expect(errors.map((e) => e.message)).toEqual([expect.stringContaining('confirmSent("some data", "wamid.xyzxyz") failed')]);
    // Meta redelivers the same POST: the message is a duplicate, the status confirms the send now
    const again = await postSigned(provider, body);
    expect(again.status).toBe(200);
    expect(await again.json()).toMatchObject({ ok: true, admitted: 0, duplicates: 1, statuses: 1 });
    expect(rec.confirmed).toEqual([["some data", "wamid.xyzxyz"], ["some data", "wamid.xyzxyz"]]);
    expect([...rec.journal.keys()]).toEqual([wamid]);
    expect(statuses.map((s) => s.id)).toEqual(["wamid.xyzxyz", "wamid.xyzxyz"]); // onStatus sees the redelivered status again
    // a callback data no journal can hold as a key (a lone surrogate, a NUL) is no outbox key: not offered, so never a 503 loop
    for (const odd of ["bad\ud800key", "bad\u0000key"]) {
      const copy = structuredClone(tracker);
      copy.entry[0].changes[0].value.statuses[0].biz_opaque_callback_data = odd;
      failures = 1_000;
      expect((await postSigned(provider, copy)).status).toBe(200);
    }
    expect(rec.confirmed).toHaveLength(2);
  });

  test("with a real bot, a journal failure during confirmSent makes Meta redeliver until it is through", async () => {
    const backend = new MemoryDurability();
    const get = backend.outbox.get.bind(backend.outbox);
    let failures = 1;
    backend.outbox.get = (key) => failures-- > 0 ? Promise.reject(new Error("journal down")) : get(key);
    const h = await harness({ backend });
    const body = addressedTo(await corpusPayload("pywa.json", "message:text"), PHONE);
    body.entry[0].changes[0].value.statuses = addressedTo(await corpusPayload("pywa.json", "message_status:with_tracker"), PHONE)
      .entry[0].changes[0].value.statuses;
    expect(await fake.deliver(h.hook, body)).toEqual([503, 200]);
    await h.bot.idle();
    expect(h.seen.map((m) => m.text)).toEqual(["Body Text"]); // handled once
    expect(h.errors.map((e) => e.message)).toEqual([expect.stringContaining("journal down")]);
    expect(h.statuses.map((s) => s.status)).toEqual(["sent", "sent"]);
  });

  test("statuses of BSUID and group sends say which chat they are about", async () => {
    const { provider, statuses } = sinkProvider();
    provider.start(recordingSink().sink);
    await postSigned(provider, addressedTo(await corpusPayload("meta-docs.json", "bsuid: delivered status of a send to a BSUID, phone number withheld"), PHONE));
    await postSigned(provider, addressedTo(await corpusPayload("pywa.json", "message_status:group"), PHONE));
    await postSigned(provider, addressedTo(await corpusPayload("meta-docs.json", "status: failed (131049)"), PHONE));
    expect(statuses[0]).toMatchObject({ status: "delivered", recipientUserId: BSUID, chatId: `bsuid:${BSUID}` });
    expect(statuses[0].recipientId).toBeUndefined();
    expect(statuses[1]).toMatchObject({
      status: "read",
      recipientId: "fowefinoewcnw",
      chatId: "group:fowefinoewcnw",
      participant: "<GROUP_PARTICIPANT_USER_PHONE_NUMBER>",
    });
    expect(statuses[2]).toMatchObject({ status: "failed", chatId: "16505551234", errors: [{ code: 131049 }] });
  });

  test("replies: a BSUID chat is sent with recipient (no to), a group chat with recipient_type group and to = the group id", async () => {
    const h = await harness({
      setup: (bot) => bot.when(ANY, (ctx) => ctx.reply(`echo: ${ctx.message.text}`)),
    });
    const bsuid = addressedTo(
      await corpusPayload("meta-docs.json", "bsuid: incoming text from a user with a username, phone number withheld, parent BSUIDs enabled"),
      PHONE,
    );
    const group = addressedTo(await corpusPayload("meta-docs.json", "group: text message received in a group"), PHONE);
    expect((await fake.post(h.hook, bsuid)).status).toBe(200);
    expect((await fake.post(h.hook, group)).status).toBe(200);
    const toUser = await fake.waitForSend((a) => a.body.text?.body === "echo: Does it come in another color?");
    expect(toUser.body).toMatchObject({ messaging_product: "whatsapp", recipient_type: "individual", recipient: BSUID, type: "text" });
    expect("to" in toUser.body).toBe(false);
    const toGroup = await fake.waitForSend((a) => a.body.text?.body === "echo: What does everyone think about this?");
    expect(toGroup.body).toMatchObject({
      messaging_product: "whatsapp",
      recipient_type: "group",
      to: "HBgLMTY1MDM4Nzk0MzkVAgASGBQzQTRBNjU5OUFFRTAzODEwMTQ0RgA",
    });
    expect("recipient" in toGroup.body).toBe(false);
    // proactive sends by chat id, and a passthrough message object: the chat id decides the addressing
    await h.bot.send(whatsAppChatId({ kind: "user", userId: BSUID }), "by helper");
    await h.bot.send(BSUID, "bare");
    await h.bot.send("group:Y2FwaV9ncm91cDoxNzA1NTU1MDEzOToxMjAzNjM0MDQ2OTQyMzM4MjAZD", {
      type: "text",
      to: "16505559999",
      text: { body: "passthrough" },
    });
    await h.bot.idle();
    const helper = await fake.waitForSend((a) => a.body.text?.body === "by helper");
    expect(helper.body).toMatchObject({ recipient: BSUID, recipient_type: "individual" });
    expect((await fake.waitForSend((a) => a.body.text?.body === "bare")).body.recipient).toBe(BSUID);
    const passthrough = await fake.waitForSend((a) => a.body.text?.body === "passthrough");
    expect(passthrough.body).toMatchObject({ recipient_type: "group", to: "Y2FwaV9ncm91cDoxNzA1NTU1MDEzOToxMjAzNjM0MDQ2OTQyMzM4MjAZD" });
  });

  test("the placeholder chat of unreadable messages cannot be sent to: a permanent error, straight to the DLQ", async () => {
    const h = await harness({ setup: () => {} });
    await h.bot.send(`wa:${PHONE}:unreadable`, "hello?").catch(() => {});
    await h.bot.idle();
    const dead = h.dead.find((d) => d.kind === "outbound");
    expect(dead?.error).toContain("it is where unreadable messages without a usable sender are journaled");
  });

  test("chat ids: whatsAppChatId and parseWhatsAppChatId", () => {
    expect(whatsAppChatId({ kind: "phone", phone: "16505551234" })).toBe("16505551234");
    expect(whatsAppChatId({ kind: "user", userId: BSUID })).toBe(`bsuid:${BSUID}`);
    expect(whatsAppChatId({ kind: "group", groupId: "Y2Fw" })).toBe("group:Y2Fw");
    expect(parseWhatsAppChatId("16505551234")).toEqual({ kind: "phone", phone: "16505551234" });
    expect(parseWhatsAppChatId(`bsuid:${BSUID}`)).toEqual({ kind: "user", userId: BSUID });
    expect(parseWhatsAppChatId("US.ENT.11815799212886844830")).toEqual({ kind: "user", userId: "US.ENT.11815799212886844830" });
    expect(parseWhatsAppChatId("group:Y2Fw")).toEqual({ kind: "group", groupId: "Y2Fw" });
    expect(() => whatsAppChatId({ kind: "user", userId: "" })).toThrow('A WhatsApp user id must be a non-empty string, got ""');
  });
});

describe("sends through the Graph API", () => {
  test("a reply goes to /{version}/{phone-number-id}/messages and its wamid is recorded", async () => {
    const h = await harness({ setup: (bot) => bot.when(/hello/, (ctx) => ctx.reply("Hi there!")) });
    const before = fake.attempts.length;
    expect((await fake.post(h.hook, payload([inbound.text(USER, "hello", "wamid.hello1")]))).status).toBe(200);
    await h.bot.idle();
    const attempts = fake.attempts.slice(before);
    expect(attempts).toHaveLength(1);
    expect(attempts[0].version).toBe("v24.0");
    expect(attempts[0].phoneNumberId).toBe(PHONE);
    expect(attempts[0].body).toEqual({
      messaging_product: "whatsapp",
      recipient_type: "individual",
      to: USER,
      type: "text",
      text: { body: "Hi there!" },
      biz_opaque_callback_data: "wamid.hello1:1",
    });
    const [entry] = await h.bot.durability!.outbox.list();
    expect(entry).toMatchObject({ key: "wamid.hello1:1", state: "sent", messageId: attempts[0].wamid });
  });

  test("content shapes: text with preview and reply, media by link and id, interactive, template, passthrough", async () => {
    const h = await harness();
    const before = fake.attempts.length;
    const sends: [unknown, Record<string, unknown>][] = [
      [{ text: "see https://example.com", previewUrl: true, replyTo: "wamid.orig" }, {
        type: "text",
        text: { body: "see https://example.com", preview_url: true },
        context: { message_id: "wamid.orig" },
      }],
      [{ image: { link: "https://example.com/cat.jpg", caption: "cat" } }, {
        type: "image",
        image: { link: "https://example.com/cat.jpg", caption: "cat" },
      }],
      [{ document: { id: "1234", filename: "a.pdf" } }, { type: "document", document: { id: "1234", filename: "a.pdf" } }],
      [
        { interactive: { type: "button", body: { text: "Pick" }, action: { buttons: [{ type: "reply", reply: { id: "a", title: "A" } }] } } },
        { type: "interactive" },
      ],
      [{ template: { name: "hello_world", language: { code: "en_US" } } }, { type: "template", template: { name: "hello_world", language: { code: "en_US" } } }],
      [{ type: "location", location: { latitude: 1, longitude: 2 } }, { type: "location", location: { latitude: 1, longitude: 2 } }],
    ];
    let n = 0;
    for (const [content] of sends) {
      const result = await h.bot.send(USER, content as Record<string, unknown>, { idempotencyKey: `shape-${++n}` });
      expect(result.state).toBe("sent");
      expect(result.messageId).toStartWith("wamid.");
    }
    const attempts = fake.attempts.slice(before);
    expect(attempts).toHaveLength(sends.length);
    sends.forEach(([, expected], i) => {
      expect(attempts[i].body).toMatchObject({ messaging_product: "whatsapp", to: USER, ...expected });
    });
    // reactions carry no callback data
    await h.bot.send(USER, { reaction: { message_id: "wamid.x", emoji: "👍" } }, { idempotencyKey: "react-1" });
    expect(fake.attempts.at(-1)!.body.biz_opaque_callback_data).toBeUndefined();
  });

  test("content WhatsApp cannot send is dead at once with a clear error", async () => {
    const h = await harness();
    const before = fake.attempts.length;
    const bytes = await h.bot.send(USER, { image: { caption: "no link" } }, { idempotencyKey: "bad-1" });
    expect(bytes.state).toBe("dead");
    expect(bytes.error).toContain('content field "image" must be an object with "link" or "id"');
    const unknown = await h.bot.send(USER, { foo: 1 }, { idempotencyKey: "bad-2" });
    expect(unknown.state).toBe("dead");
    expect(unknown.error).toContain('got keys ["foo"]');
    expect(fake.attempts.length).toBe(before); // nothing went out
  });

  test("429 with Retry-After: the retry waits at least that long", async () => {
    const h = await harness();
    const before = fake.attempts.length;
    fake.failSends({
      kind: "graph",
      status: 429,
      code: 130429,
      message: "(#130429) Rate limit hit",
      details: "Cloud API message throughput has been reached.",
      retryAfter: "1",
    });
    const first = await h.bot.send(USER, "throttled", { idempotencyKey: "rl-1" });
    expect(first.state).toBe("failed");
    expect(first.error).toContain("130429");
    await h.bot.idle();
    const attempts = fake.attempts.slice(before);
    expect(attempts.map((a) => a.status)).toEqual([429, 200]);
    expect(attempts[1].at - attempts[0].at).toBeGreaterThanOrEqual(950);
    expect(attempts[1].at - attempts[0].at).toBeLessThan(5_000);
    expect((await h.bot.durability!.outbox.get("rl-1"))!.state).toBe("sent");
  });

  test("5xx and transient Graph codes are retried; throttling codes on a 400 too", async () => {
    const h = await harness({ outboxRetries: 6 });
    const before = fake.attempts.length;
    fake.failSends(
      { kind: "http", status: 502, body: "<html>Bad Gateway</html>" },
      { kind: "graph", status: 500, code: 2, message: "(#2) Service temporarily unavailable" },
      { kind: "graph", status: 503, code: 133004, message: "Server temporarily unavailable" },
      { kind: "graph", status: 400, code: 131000, message: "Something went wrong" },
      { kind: "graph", status: 400, code: 131056, message: "(#131056) (Business Account, Consumer Account) pair rate limit hit", retryAfter: "0" },
    );
    const result = await h.bot.send(USER, "eventually", { idempotencyKey: "5xx-1" });
    expect(result.state).toBe("failed");
    await h.bot.idle();
    expect(fake.attempts.slice(before).map((a) => a.status)).toEqual([502, 500, 503, 400, 400, 200]);
    expect((await h.bot.durability!.outbox.get("5xx-1"))!.state).toBe("sent");
  });

  test("permanent Graph errors (131047, 131026, 100, 190) go to the DLQ at once with Graph's message", async () => {
    const h = await harness();
    const cases = [
      { status: 400, code: 131047, message: "(#131047) Re-engagement message", details: "Message failed to send because more than 24 hours have passed since the customer last replied to this number." },
      { status: 400, code: 131026, message: "(#131026) Message Undeliverable" },
      { status: 400, code: 100, message: "(#100) Invalid parameter", details: "Parameter 'to' is invalid" },
      { status: 401, code: 190, message: "Error validating access token: Session has expired" },
    ];
    for (const [i, c] of cases.entries()) {
      const before = fake.attempts.length;
      fake.failSends({ kind: "graph", ...c });
      const result = await h.bot.send(USER, `perm ${i}`, { idempotencyKey: `perm-${i}` });
      expect(result.state).toBe("dead");
      expect(result.error).toContain(`error ${c.code}`);
      expect(result.error).toContain(c.message);
      if (c.details) expect(result.error).toContain(c.details);
      expect(fake.attempts.length - before).toBe(1); // not retried
    }
    const dead = await h.bot.durability!.outbox.list({ state: "dead" });
    expect(dead.map((d) => d.key).sort()).toEqual(["perm-0", "perm-1", "perm-2", "perm-3"]);
    expect(h.dead.filter((d) => d.kind === "outbound")).toHaveLength(4);
    // a real wrong token: the fake answers 190 itself
    const wrong = makeProvider({ accessToken: "nope" });
    const error = await wrong.send(USER, "x", { idempotencyKey: "k", attempt: 1, signal: new AbortController().signal })
      .catch((e) => e);
    expect(error).toBeInstanceOf(WhatsAppApiError);
    expect(error).toMatchObject({ status: 401, code: 190, retryable: false, type: "OAuthException" });
  });

  test("a timeout may have been delivered: held as unknown and reported, never retried silently", async () => {
    const h = await harness({ provider: { requestTimeoutMs: 300 } });
    const ambiguous: unknown[] = [];
    h.bot.on("durability:ambiguous", (event) => ambiguous.push(event));
    const before = fake.attempts.length;
    fake.failSends({ kind: "hang" });
    const first = await h.bot.send(USER, "slow", { idempotencyKey: "to-1" });
    expect(first.state).toBe("unknown");
    expect(first.error).toContain("timed out after 300 ms");
    await h.bot.idle();
    expect(fake.attempts.slice(before)).toHaveLength(1);
    expect((await h.bot.durability!.outbox.get("to-1"))!.state).toBe("unknown");
    expect(ambiguous).toEqual([{ key: "to-1", chatId: USER }]);
    // An operator who checked that it did not arrive sends it again.
    expect(await h.bot.durability!.retrySend("to-1")).toBe(true);
    await h.bot.idle();
    expect((await h.bot.durability!.outbox.get("to-1"))!.state).toBe("sent");
  });

  test("a network error is retried", async () => {
    let failures = 1;
    const h = await harness({
      provider: {
        fetch: ((input: RequestInfo | URL, init?: RequestInit) => {
          if (failures-- > 0) return Promise.reject(new TypeError("fetch failed: ECONNRESET"));
          return fetch(input, init);
        }) as typeof fetch,
      },
    });
    const first = await h.bot.send(USER, "net", { idempotencyKey: "net-1" });
    expect(first.state).toBe("failed");
    expect(first.error).toContain("ECONNRESET");
    await h.bot.idle();
    expect((await h.bot.durability!.outbox.get("net-1"))!.state).toBe("sent");
  });

  test("a send aborted by the bot's signal is a retryable error", async () => {
    const provider = makeProvider();
    const controller = new AbortController();
    fake.failSends({ kind: "hang" });
    const before = fake.attempts.length;
    const pending = provider.send(USER, "halt", { idempotencyKey: "abort-1", attempt: 1, signal: controller.signal });
    await fake.waitForAttempts(before + 1); // the fake holds it
    controller.abort();
    const error = await pending.catch((e) => e);
    expect(error.message).toBe("WhatsApp send was aborted");
    expect(provider.classifyError(error)).toEqual({ retryable: true, retryAfterMs: undefined });
  });

  test("a garbage 200 is a clear error, not retried (Meta may have sent it)", async () => {
    const h = await harness();
    const before = fake.attempts.length;
    fake.failSends({ kind: "http", status: 200, body: "<html>captive portal</html>" });
    const result = await h.bot.send(USER, "garbage", { idempotencyKey: "g-1" });
    expect(result.state).toBe("dead");
    expect(result.error).toContain('without "messages[0].id"');
    expect(result.error).toContain("captive portal");
    fake.failSends({ kind: "http", status: 200, body: '{"messaging_product":"whatsapp","messages":[]}', contentType: "application/json" });
    const empty = await h.bot.send(USER, "garbage 2", { idempotencyKey: "g-2" });
    expect(empty.state).toBe("dead");
    expect(fake.attempts.length - before).toBe(2);
  });

  test("markRead sends a read receipt with an optional typing indicator; errors are Graph errors", async () => {
    const h = await harness({
      setup: (bot, hh) =>
        bot.when(ANY, async (ctx) => {
          await hh.provider.markRead(ctx.message.id, { typing: true });
          await ctx.reply("read it");
        }),
    });
    expect((await fake.post(h.hook, payload([inbound.text(USER, "read me", "wamid.read1")]))).status).toBe(200);
    await h.bot.idle();
    expect(fake.reads).toContainEqual({ messageId: "wamid.read1", typing: true });
    await h.provider.markRead("wamid.read2");
    expect(fake.reads).toContainEqual({ messageId: "wamid.read2", typing: false });
    const bad = await h.provider.markRead("not-a-wamid").catch((e) => e);
    expect(bad).toBeInstanceOf(WhatsAppApiError);
    expect(bad.message).toContain("mark as read failed with HTTP 400, error 100");
    await expect(h.provider.markRead("")).rejects.toThrow('Argument "messageId" must be a non-empty string, got ""');
  });

  test("classification: codes, statuses, Retry-After forms", () => {
    expect(classifyGraphError(400, 130429, new Headers({ "retry-after": "3" }))).toEqual({ retryable: true, retryAfterMs: 3000, rateLimited: "global" });
    expect(classifyGraphError(400, 131056)).toEqual({ retryable: true, retryAfterMs: 6000, rateLimited: "chat" });
    expect(classifyGraphError(400, 4).retryable).toBe(true);
    expect(classifyGraphError(400, 80007).retryable).toBe(true);
    expect(classifyGraphError(400, 131048).retryable).toBe(true);
    expect(classifyGraphError(500, 1).retryable).toBe(true);
    expect(classifyGraphError(400, 132001).retryable).toBe(false); // template does not exist
    expect(classifyGraphError(403, 200).retryable).toBe(false);
    expect(classifyGraphError(400, 131030).retryable).toBe(false);
    expect(classifyGraphError(429, undefined)).toEqual({ retryable: true, retryAfterMs: undefined, rateLimited: "global" });
    expect(classifyGraphError(503, undefined).retryable).toBe(true);
    expect(classifyGraphError(404, undefined).retryable).toBe(false);
    const usage = new Headers({
      "x-business-use-case-usage": JSON.stringify({ "1": [{ type: "whatsapp", call_count: 100, estimated_time_to_regain_access: 2 }] }),
    });
    expect(classifyGraphError(400, 80007, usage).retryAfterMs).toBe(120_000);
    const now = Date.parse("2026-01-01T00:00:00Z");
    expect(parseRetryAfter("Thu, 01 Jan 2026 00:00:05 GMT", now)).toBe(5000);
    expect(parseRetryAfter("0.5", now)).toBe(500);
    expect(parseRetryAfter("soon", now)).toBeUndefined();
    expect(parseRetryAfter(null, now)).toBeUndefined();
  });
});

// ---- media ------------------------------------------------------------------------------------

const PNG = new Uint8Array([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a, 1, 2, 3, 4, 5]);
const OGG = new TextEncoder().encode("OggS fake voice note");
const PDF = new TextEncoder().encode("%PDF-1.7 fake invoice");

describe("media on reprocess", () => {
  test("image, audio and document load with loadMediaOf on the first processing", async () => {
    const loaded = new Map<string, LoadedMedia | null>();
    const h = await harness({
      setup: (bot) => bot.when(ANY, async (ctx) => void loaded.set(ctx.message.id, await loadMediaOf(ctx, { throwOnError: true }))),
    });
    const imageId = await fake.addMedia(PNG, "image/png");
    const audioId = await fake.addMedia(OGG, "audio/ogg");
    const docId = await fake.addMedia(PDF, "application/pdf");
    const res = await fake.post(
      h.hook,
      payload([
        inbound.media("image", USER, { id: imageId, mime_type: "image/png", caption: "look" }, "wamid.m-img"),
        inbound.media("audio", USER, { id: audioId, mime_type: "audio/ogg", voice: true }, "wamid.m-aud"),
        inbound.media("document", USER, { id: docId, mime_type: "application/pdf", filename: "invoice.pdf" }, "wamid.m-doc"),
      ]),
    );
    expect(res.status).toBe(200);
    await h.bot.idle();
    expect(loaded.get("wamid.m-img")).toEqual({ data: PNG, mimeType: "image/png" });
    expect(loaded.get("wamid.m-aud")).toEqual({ data: OGG, mimeType: "audio/ogg" });
    expect(loaded.get("wamid.m-doc")).toEqual({ data: PDF, mimeType: "application/pdf", fileName: "invoice.pdf" });
    expect(fake.mediaRequests).toContain(`lookup:${imageId}`);
    expect(fake.mediaRequests).toContain(`download:${docId}`);
  });

  test("after a restart (new Bot, new provider, same SQLite file) a replayed message loads its media again", async () => {
    const file = join(dir, `restart-${crypto.randomUUID()}.db`);
    const imageId = await fake.addMedia(PNG, "image/png");
    const loads: (LoadedMedia | null)[] = [];
    const setup = (bot: Bot) => bot.when(ANY, async (ctx) => void loads.push(await loadMediaOf(ctx, { throwOnError: true })));

    const store1 = new SQLiteStore({ file });
    const h1 = await harness({ backend: store1.durability(), setup });
    expect((await fake.post(h1.hook, payload([inbound.media("image", USER, { id: imageId, mime_type: "image/png" }, "wamid.r-img")]))).status)
      .toBe(200);
    await h1.bot.idle();
    await h1.bot.stop();
    await store1.close();

    const store2 = new SQLiteStore({ file });
    const h2 = await harness({ backend: store2.durability(), setup });
    cleanups.push(() => store2.close());
    await h2.bot.durability!.replayInbound("wamid.r-img");
    await h2.bot.idle();
    expect(loads).toEqual([{ data: PNG, mimeType: "image/png" }, { data: PNG, mimeType: "image/png" }]);
    expect((await h2.bot.durability!.inbox.get("wamid.r-img"))!.state).toBe("done");
  });

  test("tampered, foreign, expired and hash-mismatched media are unavailable; a 5xx is thrown as is", async () => {
    const h = await harness({ setup: () => {} });
    const imageId = await fake.addMedia(PNG, "image/png");
    const badHashId = await fake.addMedia(PNG, "image/png", "0".repeat(64));
    const expiredId = await fake.addMedia(PNG, "image/png");
    const expired400Id = await fake.addMedia(PNG, "image/png");
    const res = await fake.post(
      h.hook,
      payload([
        inbound.media("image", USER, { id: imageId, mime_type: "image/png" }, "wamid.t-ok"),
        inbound.media("image", USER, { id: badHashId, mime_type: "image/png" }, "wamid.t-hash"),
        inbound.media("image", USER, { id: expiredId, mime_type: "image/png" }, "wamid.t-exp"),
        inbound.media("image", USER, { id: expired400Id, mime_type: "image/png" }, "wamid.t-exp400"),
        inbound.media("image", USER, { mime_type: "image/png" }, "wamid.t-noid"),
      ]),
    );
    expect(res.status).toBe(200);
    await h.bot.idle();
    const inbox = h.bot.durability!.inbox;
    const ctxOf = async (id: string, provider = h.provider) => {
      const record = await inbox.get(id);
      return { message: record!.payload as unknown as InboundMessage, bot: { provider } };
    };
    const reason = (p: Promise<unknown>) => p.then(() => "loaded", (e) => e instanceof MediaUnavailableError ? e.reason : `other: ${e}`);

    expect(await loadMediaOf(await ctxOf("wamid.t-ok"))).toEqual({ data: PNG, mimeType: "image/png" });

    // tampered: the media id changed in the record
    const ok = await ctxOf("wamid.t-ok");
    const tampered = structuredClone(ok.message) as InboundMessage & { media: { ref: { mediaId: string } } };
    tampered.media.ref.mediaId = badHashId;
    expect(await reason(loadMediaOf({ message: tampered, bot: ok.bot }, { throwOnError: true }))).toBe("rehydrate-failed");

    // another provider name wrote it
    const other = makeProvider({ name: "whatsapp-eu" });
    expect(await reason(loadMediaOf(await ctxOf("wamid.t-ok", other), { throwOnError: true }))).toBe("provider-mismatch");

    // another media key (e.g. the app secret was rotated)
    const rotated = makeProvider({ appSecret: "a-rotated-app-secret" });
    expect(await reason(loadMediaOf(await ctxOf("wamid.t-ok", rotated), { throwOnError: true }))).toBe("rehydrate-failed");

    // expired at Meta: 404, and 400 code 100/33 as Meta answers
    fake.expireMedia(expiredId, 404);
    fake.expireMedia(expired400Id, 400);
    const expired = await loadMediaOf(await ctxOf("wamid.t-exp"), { throwOnError: true }).catch((e) => e);
    expect(expired).toBeInstanceOf(MediaUnavailableError);
    expect(expired.reason).toBe("rehydrate-failed");
    expect(expired.message).toContain("no longer available");
    expect(expired.cause).toBeInstanceOf(WhatsAppApiError);
    expect(await reason(loadMediaOf(await ctxOf("wamid.t-exp400"), { throwOnError: true }))).toBe("rehydrate-failed");
    expect(await loadMediaOf(await ctxOf("wamid.t-exp"))).toBeNull(); // without throwOnError

    // sha256 mismatch
    const hash = await loadMediaOf(await ctxOf("wamid.t-hash"), { throwOnError: true }).catch((e) => e);
    expect(hash.reason).toBe("rehydrate-failed");
    expect(hash.message).toContain("SHA-256");

    // no media id: not durable
    expect(await reason(loadMediaOf(await ctxOf("wamid.t-noid"), { throwOnError: true }))).toBe("not-durable");

    // a 5xx on the lookup or the download is thrown as it is (the inbox retries), even without throwOnError
    fake.failMedia({ kind: "graph", status: 500, code: 2, message: "Service temporarily unavailable" });
    const lookup5xx = await loadMediaOf(await ctxOf("wamid.t-ok")).catch((e) => e);
    expect(lookup5xx).toBeInstanceOf(WhatsAppApiError);
    expect(lookup5xx.retryable).toBe(true);
    fake.failDownloads({ kind: "http", status: 503, body: "busy" });
    const download5xx = await loadMediaOf(await ctxOf("wamid.t-ok")).catch((e) => e);
    expect(download5xx).toBeInstanceOf(WhatsAppApiError);
    expect(download5xx.message).toContain("media download failed with HTTP 503");
    expect(download5xx.retryable).toBe(true);
    // throttling answered with a 400 (as Graph does) is retried too, not taken for expired media
    fake.failMedia({ kind: "graph", status: 400, code: 130429, message: "Rate limit hit" });
    const throttled = await loadMediaOf(await ctxOf("wamid.t-ok"), { throwOnError: true }).catch((e) => e);
    expect(throttled).toBeInstanceOf(WhatsAppApiError);
    expect(throttled.retryable).toBe(true);
    // a lookup that points the download (with the bearer token) at plain http on another host is refused
    fake.failMedia({
      kind: "http",
      status: 200,
      body: JSON.stringify({ messaging_product: "whatsapp", url: "http://media.example.invalid/x", mime_type: "image/png", id: "m" }),
      contentType: "application/json",
    });
    const insecure = await loadMediaOf(await ctxOf("wamid.t-ok")).catch((e) => e);
    expect(insecure).toBeInstanceOf(Error);
    expect(insecure.message).toContain("that is not https");
    // a download that is gone (the URL expired between lookup and download) is unavailable
    fake.failDownloads({ kind: "http", status: 404, body: "Not Found" });
    expect(await reason(loadMediaOf(await ctxOf("wamid.t-ok"), { throwOnError: true }))).toBe("rehydrate-failed");
    expect(await loadMediaOf(await ctxOf("wamid.t-ok"))).toEqual({ data: PNG, mimeType: "image/png" });
  });

  test("a media download that hangs times out (retryable); one over maxMediaBytes is unavailable", async () => {
    const h = await harness({ setup: () => {}, provider: { requestTimeoutMs: 300, maxMediaBytes: 8 } });
    const id = await fake.addMedia(PNG, "image/png");
    expect((await fake.post(h.hook, payload([inbound.media("image", USER, { id }, "wamid.big")]))).status).toBe(200);
    await h.bot.idle();
    const record = await h.bot.durability!.inbox.get("wamid.big");
    const ctx = { message: record!.payload as unknown as InboundMessage, bot: { provider: h.provider } };
    fake.failDownloads({ kind: "hang" });
    const hung = await loadMediaOf(ctx).catch((e) => e);
    expect(hung.message).toContain("media download timed out after 300 ms");
    expect(hung.retryable).toBe(true);
    const big = await loadMediaOf(ctx, { throwOnError: true }).catch((e) => e);
    expect(big).toBeInstanceOf(MediaUnavailableError);
    expect(big.reason).toBe("rehydrate-failed");
    expect(big.message).toContain("over 8 bytes");
  });

  test("a media download failing with 5xx makes the inbox retry the handler, which then succeeds", async () => {
    const loaded: (LoadedMedia | null)[] = [];
    const h = await harness({
      setup: (bot) => bot.when(ANY, async (ctx) => void loaded.push(await loadMediaOf(ctx))),
    });
    const id = await fake.addMedia(PDF, "application/pdf");
    fake.failDownloads({ kind: "http", status: 502, body: "<html>Bad Gateway</html>" });
    expect((await fake.post(h.hook, payload([inbound.media("document", USER, { id }, "wamid.retry-doc")]))).status).toBe(200);
    await h.bot.idle();
    expect(loaded).toEqual([{ data: PDF, mimeType: "application/pdf" }]);
    const record = await h.bot.durability!.inbox.get("wamid.retry-doc");
    expect(record!.state).toBe("done");
    expect(record!.attempts).toBeGreaterThanOrEqual(2);
  });
});

// ---- SQLite full run ------------------------------------------------------------------------------

describe("on SQLite", () => {
  test("message in, reply out, redelivery dropped, send retried after a 429", async () => {
    const store = new SQLiteStore({ file: join(dir, `full-${crypto.randomUUID()}.db`) });
    const h = await harness({
      backend: store.durability(),
      setup: (bot, hh) =>
        bot.when(/order/, async (ctx) => {
          hh.seen.push(ctx.message);
          await ctx.reply(`Order received: ${ctx.message.text}`);
        }),
    });
    cleanups.unshift(() => store.close());
    const before = fake.attempts.length;
    fake.failSends({ kind: "graph", status: 429, code: 130429, message: "(#130429) Rate limit hit", retryAfter: "0" });
    const m = inbound.text(USER, "order 42", "wamid.sqlite1");
    expect((await fake.post(h.hook, payload([m]))).status).toBe(200);
    expect((await fake.post(h.hook, payload([m]))).status).toBe(200);
    await h.bot.idle();
    expect(h.seen).toHaveLength(1);
    const attempts = fake.attempts.slice(before);
    expect(attempts.map((a) => a.status)).toEqual([429, 200]);
    const [entry] = await h.bot.durability!.outbox.list();
    expect(entry).toMatchObject({ key: "wamid.sqlite1:1", state: "sent", messageId: attempts[1].wamid });
    expect((await h.bot.durability!.inbox.get("wamid.sqlite1"))!.state).toBe("done");
  });
});

// ---- options ---------------------------------------------------------------------------------

describe("options", () => {
  const base: WhatsAppProviderOptions = { accessToken: TOKEN, phoneNumberId: PHONE, appSecret: SECRET, verifyToken: VERIFY };
  const make = (o: Record<string, unknown>) => () => new WhatsAppProvider({ ...base, ...o } as WhatsAppProviderOptions);

  test("bad options are rejected with an error naming the option and quoting the value", () => {
    expect(make({ accessToken: undefined })).toThrow(new TypeError('Option "accessToken" must be a non-empty string, got undefined'));
    expect(make({ accessToken: "" })).toThrow('Option "accessToken" must be a non-empty string, got ""');
    expect(make({ phoneNumberId: 123 })).toThrow('Option "phoneNumberId" must be a non-empty string, got 123');
    expect(make({ phoneNumberId: "12/34" })).toThrow(RangeError);
    expect(make({ phoneNumberId: "12/34" })).toThrow('Option "phoneNumberId"');
    expect(make({ appSecret: null })).toThrow('Option "appSecret" must be a non-empty string, got null');
    expect(make({ verifyToken: undefined })).toThrow('Option "verifyToken"');
    expect(make({ graphBase: "ftp://x" })).toThrow('Option "graphBase" must be an http(s) URL without query or fragment, got "ftp://x"');
    expect(make({ graphBase: "not a url" })).toThrow('Option "graphBase"');
    expect(make({ graphVersion: "21" })).toThrow(new RangeError('Option "graphVersion" must look like "v24.0", got "21"'));
    expect(make({ fetch: "fetch" })).toThrow('Option "fetch" must be a function, got "fetch"');
    expect(make({ requestTimeoutMs: 0 })).toThrow(new RangeError('Option "requestTimeoutMs" must be an integer from 1 to 2147483647, got 0'));
    expect(make({ requestTimeoutMs: "5" })).toThrow('Option "requestTimeoutMs" must be a number, got "5"');
    expect(make({ maxBodyBytes: 1.5 })).toThrow('Option "maxBodyBytes"');
    expect(make({ maxMediaBytes: -1 })).toThrow('Option "maxMediaBytes"');
    expect(make({ mediaKey: "short" })).toThrow(new RangeError('Option "mediaKey" must be at least 16 bytes, got 5'));
    expect(make({ mediaKey: 42 })).toThrow('Option "mediaKey" must be a string or a Uint8Array, got 42');
    expect(make({ name: "" })).toThrow('Option "name" must be a non-empty string, got ""');
    expect(make({ onStatus: true })).toThrow('Option "onStatus" must be a function, got true');
    expect(make({ onError: {} })).toThrow('Option "onError" must be a function, got {}');
    expect(make({ callbackData: "yes" })).toThrow('Option "callbackData" must be a boolean, got "yes"');
    expect(make({ phoneNumber: "1" })).toThrow('Unknown WhatsApp option "phoneNumber"');
    expect(() => new WhatsAppProvider(null as never)).toThrow("WhatsAppProvider options must be an object, got null");
  });

  test("defaults: name, connectionId, graph base and version", () => {
    const p = new WhatsAppProvider(base);
    expect(p.name).toBe("whatsapp");
    expect(p.connectionId).toBe(PHONE);
    expect(p.graphBase).toBe("https://graph.facebook.com");
    expect(p.graphVersion).toBe("v24.0");
    expect(new WhatsAppProvider({ ...base, graphBase: "http://127.0.0.1:1/" }).graphBase).toBe("http://127.0.0.1:1");
  });
});

// ---- the example, as a child process --------------------------------------------------------------

describe("examples/whatsapp_bun.ts", () => {
  // The example runs with WhatsApp's default limits: its second reply to the chat, in the first
  // seconds after the start, waits for the pair limit (one per 6 s).
  test("runs against the fake: text and image answered, SIGTERM stops it cleanly", async () => {
    const child = spawn(process.execPath, [join(import.meta.dir, "..", "examples", "whatsapp_bun.ts")], {
      stdio: ["ignore", "pipe", "pipe"],
      env: {
        ...process.env,
        WA_TOKEN: TOKEN,
        WA_PHONE_NUMBER_ID: PHONE,
        WA_APP_SECRET: SECRET,
        WA_VERIFY_TOKEN: VERIFY,
        WA_GRAPH_BASE: fake.url,
        WA_DB: join(dir, `example-${crypto.randomUUID()}.db`),
        PORT: "0",
      },
    });
    const exited = new Promise<number | null>((resolve) => child.once("exit", (code) => resolve(code)));
    let stderr = "";
    child.stderr!.on("data", (d) => stderr += d);
    cleanups.push(() => void child.kill("SIGKILL"));
    const lines = childLines(
      new ReadableStream<Uint8Array>({
        start(controller) {
          child.stdout!.on("data", (d: Uint8Array) => controller.enqueue(new Uint8Array(d)));
          child.stdout!.on("end", () => controller.close());
        },
      }),
      "whatsapp_bun.ts",
      15_000,
    );
    const listening = await lines.next("listening on ");
    const port = Number(/:(\d+)\/$/.exec(listening)![1]);
    const hook = `http://127.0.0.1:${port}/`;
    const verify = await fetch(`${hook}?hub.mode=subscribe&hub.verify_token=${VERIFY}&hub.challenge=42`);
    expect(await verify.text()).toBe("42");
    const chat = "447700900123";
    const imageId = await fake.addMedia(PNG, "image/png");
    const body = webhookPayload(PHONE, {
      messages: [inbound.text(chat, "hello example"), inbound.media("image", chat, { id: imageId, mime_type: "image/png" })],
      statuses: [statusUpdate(makeWamid(), "delivered", chat)],
    });
    expect(await fake.deliver(hook, body)).toEqual([200]);
    const echo = await fake.waitForSend((a) => a.body.to === chat && a.body.text?.body === "You said: hello example");
    const picture = await fake.waitForSend((a) => a.body.to === chat && a.body.text?.body === `Nice picture (${PNG.byteLength} bytes)`);
    expect(echo.wamid).toStartWith("wamid.");
    expect(picture.wamid).toStartWith("wamid.");
    await lines.next("status ");
    child.kill("SIGTERM");
    await lines.next("stopped");
    expect(await exited).toBe(0);
    expect(stderr).toBe("");
  }, 30_000);
});
