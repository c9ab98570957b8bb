// @botmesh/durable/baileys against a fake Baileys socket (tests/support/fake_baileys.ts, Baileys 6.17's
// event and message shapes): upserts journaled before the handler runs and deduplicated by message key
// (a live message and its offline replay), own/status/protocol/stub messages skipped, replies sent once
// with the message id derived from the outbox key (retried after a closed connection, through the socket
// of the reconnect), an ambiguous send settled by a receipt, media loaded again, a journal refusal
// retried in memory, and a restart on SQLite continuing what the dead process left.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot, loadMediaOf, MemoryDurability } from "../mod.ts";
import type { InboundMessage } from "../provider.ts";
import type { DurabilityBackend } from "../backend.ts";
import { SQLiteDurability } from "../backends/sqlite/mod.ts";
import { crashable } from "../src/testing/crashable.ts";
import { UnencodableContentError } from "../src/content.ts";
import {
  BaileysProvider,
  type BaileysProviderOptions,
  baileysMessageIdFor,
  classifyBaileysError,
  messageKeyId,
  type SkipReason,
} from "../providers/baileys/mod.ts";
import { boom, FakeSocket, FakeWhatsApp, STATUS } from "./support/fake_baileys.ts";
import { flakyAdmit } from "./support/flaky_admit.ts";
import { cleanupsAfterEach } from "./support/plugin_tests.ts";

const cleanups = cleanupsAfterEach();
const dir = mkdtempSync(join(tmpdir(), "botmesh-baileys-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const ALICE = "4915112345678@s.whatsapp.net";
const GROUP = "120363151623077576@g.us";
const MEDIA_KEY = "a media key of at least sixteen bytes";

async function until(check: () => boolean | Promise<boolean>, what: string, ms = 5000): Promise<void> {
  const end = Date.now() + ms;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 5));
  }
}

interface Harness {
  server: FakeWhatsApp;
  sock: FakeSocket;
  provider: BaileysProvider;
  bot: Bot;
  errors: Error[];
  skipped: { id: string | null | undefined; reason: SkipReason }[];
  events: { ambiguous: unknown[]; resolved: { key: string; state: string; via: string; messageId?: string }[]; dead: unknown[] };
}

async function harness(
  setup: (bot: Bot) => void,
  options: {
    backend?: DurabilityBackend;
    server?: FakeWhatsApp;
    provider?: BaileysProviderOptions;
    instanceId?: string;
    leaseMs?: number;
    start?: boolean;
    wrapSend?: (send: BaileysProvider["send"]) => BaileysProvider["send"];
  } = {},
): Promise<Harness> {
  const server = options.server ?? new FakeWhatsApp();
  const sock = server.socket();
  const errors: Error[] = [];
  const skipped: Harness["skipped"] = [];
  const provider = new BaileysProvider({
    socket: sock,
    mediaKey: MEDIA_KEY,
    downloadMedia: server.downloadMediaMessage,
    sendTimeoutMs: 150,
    onError: (e) => errors.push(e),
    onSkipped: (m, reason) => skipped.push({ id: m.key?.id, reason }),
    ...options.provider,
  });
  sock.open();
  if (options.wrapSend) provider.send = options.wrapSend(provider.send.bind(provider));
  const leaseMs = options.leaseMs ?? 300;
  const bot = new Bot({
    provider,
    durability: {
      backend: options.backend ?? new MemoryDurability(),
      instanceId: options.instanceId ?? "baileys-test",
      inbox: { retries: 2, leaseMs, backoff: { baseMs: 10, capMs: 20 } },
      outbox: { retries: 5, leaseMs, backoff: { baseMs: 10, capMs: 30 } },
    },
  });
  const events: Harness["events"] = { ambiguous: [], resolved: [], dead: [] };
  bot.on("error", (e) => errors.push(e));
  bot.on("durability:ambiguous", (e) => events.ambiguous.push(e));
  bot.on("durability:resolved", (e) => events.resolved.push(e as Harness["events"]["resolved"][number]));
  bot.on("durability:dead", (e) => events.dead.push(e));
  setup(bot);
  if (options.start !== false) await bot.start();
  cleanups.push(() => bot.stop());
  return { server, sock, provider, bot, errors, skipped, events };
}

describe("baileys: inbound", () => {
  test("a user message is journaled before the handler runs, and the reply goes out once with the id derived from its outbox key", async () => {
    const seen: { state: string | undefined; text?: string; type: string; timestamp?: number }[] = [];
    const h = await harness((bot) =>
      bot.when(/.*/, async (ctx) => {
        seen.push({ state: (await bot.durability!.inbox.get(ctx.inboundId))?.state, text: ctx.message.text, type: ctx.message.type, timestamp: ctx.message.timestamp });
        await ctx.reply(`echo: ${ctx.message.text}`);
      })
    );
    const message = h.server.text(ALICE, "hello");
    h.sock.upsert([message]);
    await until(() => h.server.delivered.length === 1, "the reply");
    await h.bot.idle();
    const id = messageKeyId(message.key);
    expect(id).toBe(`${ALICE},0,${message.key.id}`);
    expect(seen).toEqual([{ state: "processing", text: "hello", type: "text", timestamp: (1_760_000_000 + 1) * 1000 }]);
    expect((await h.bot.durability!.inbox.get(id))?.state).toBe("done");
    const [entry] = await h.bot.durability!.outbox.list();
    expect(entry!.state).toBe("sent");
    const messageId = await baileysMessageIdFor(entry!.key);
    expect(messageId).toMatch(/^3EB0[0-9A-F]{36}$/);
    expect(h.sock.calls).toEqual([{ jid: ALICE, content: { text: "echo: hello" }, options: { messageId } }]);
    expect(entry!.messageId).toBe(messageId);
    const record = await h.bot.durability!.inbox.get(id);
    const extra = (record!.payload as unknown as InboundMessage).extra as Record<string, unknown>;
    expect(extra.key).toEqual({ remoteJid: ALICE, fromMe: false, id: message.key.id });
    expect(extra.pushName).toBe("Alice");
    expect(extra.upsertType).toBe("notify");
    expect(h.errors).toEqual([]);
  });

  test("a redelivered upsert (the live message again, then in the offline replay) is handled once; own, status, protocol and stub messages are skipped", async () => {
    const handled: string[] = [];
    const h = await harness((bot) =>
      bot.when(/.*/, async (ctx) => {
        handled.push(`${ctx.message.chatId}|${ctx.message.from ?? ""}|${ctx.message.text}`);
        await ctx.reply("ok");
      })
    );
    const live = h.server.text(ALICE, "once");
    h.sock.upsert([live]);
    h.sock.upsert([structuredClone(live)]); // Baileys emitting it twice
    h.sock.upsert([structuredClone(live)], "append"); // and the offline replay after a reconnect
    const offline = h.server.text(ALICE, "sent while we were away", { extended: true });
    const group = h.server.text(GROUP, "in a group", { participant: "4917000000000@s.whatsapp.net" });
    h.sock.upsert([offline, group], "append");
    const own = h.server.text(ALICE, "from my phone", { fromMe: true });
    const status = h.server.text("status@broadcast", "my status");
    const revoke = {
      key: { remoteJid: ALICE, fromMe: false, id: "3AREVOKE" },
      message: { protocolMessage: { key: live.key, type: 0 } },
      messageTimestamp: 1_760_000_001,
    };
    const stub = { key: { remoteJid: GROUP, fromMe: false, id: "3ASTUB" }, messageStubType: 27, messageStubParameters: ["x"] };
    const keyOnly = { key: { remoteJid: ALICE, fromMe: false, id: "3AKEYS" }, message: { senderKeyDistributionMessage: { groupId: GROUP } } };
    h.sock.upsert([own, status, revoke, stub, keyOnly]);
    await until(() => h.server.delivered.length === 3, "three replies");
    await h.bot.idle();
    expect(handled.sort()).toEqual([
      `${ALICE}||once`,
      `${ALICE}||sent while we were away`,
      `${GROUP}|4917000000000@s.whatsapp.net|in a group`,
    ].sort());
    expect(h.skipped).toEqual([
      { id: own.key.id, reason: "from-me" },
      { id: status.key.id, reason: "status-broadcast" },
      { id: "3AREVOKE", reason: "protocol" },
      { id: "3ASTUB", reason: "stub" },
      { id: "3AKEYS", reason: "no-content" },
    ]);
    expect(h.server.textsTo(ALICE)).toEqual(["ok", "ok"]);
    expect(h.errors).toEqual([]);
  });

  test("upsertTypes: [\"notify\"] leaves the offline replay out; wrapped (ephemeral) messages and interactions are read", async () => {
    const handled: { type: string; text?: string; interaction?: unknown }[] = [];
    const h = await harness((bot) => bot.when(() => true, (ctx) => void handled.push({ type: ctx.message.type, text: ctx.message.text, interaction: ctx.message.interaction })), {
      provider: { upsertTypes: ["notify"] },
    });
    const replayed = h.server.text(ALICE, "replayed");
    h.sock.upsert([replayed], "append");
    h.sock.upsert([
      { key: { remoteJid: ALICE, fromMe: false, id: "3AEPH" }, message: { ephemeralMessage: { message: { extendedTextMessage: { text: "secret" } } } } },
      { key: { remoteJid: ALICE, fromMe: false, id: "3ABTN" }, message: { buttonsResponseMessage: { selectedButtonId: "yes", selectedDisplayText: "Yes" } } },
      { key: { remoteJid: ALICE, fromMe: false, id: "3ALIST" }, message: { listResponseMessage: { title: "Row", singleSelectReply: { selectedRowId: "row-2" } } } },
    ]);
    await until(() => handled.length === 3, "three messages");
    expect(handled).toEqual([
      { type: "text", text: "secret", interaction: undefined },
      { type: "interaction", text: "Yes", interaction: { id: "yes" } },
      { type: "interaction", text: "Row", interaction: { id: "row-2" } },
    ]);
    expect(h.skipped).toEqual([{ id: replayed.key.id, reason: "upsert-type" }]);
  });

  test("an admission the journal refuses is tried again in memory (Baileys acknowledged the message already), keeping the chat's order", async () => {
    const state = { failures: 2 };
    const handled: string[] = [];
    const h = await harness((bot) => bot.when(/.*/, (ctx) => void handled.push(ctx.message.text!)), {
      backend: flakyAdmit(new MemoryDurability(), state),
    });
    h.sock.upsert([h.server.text(ALICE, "first"), h.server.text(ALICE, "second")]);
    await until(() => handled.length === 2, "both messages", 8000);
    expect(handled).toEqual(["first", "second"]);
    expect(h.errors.filter((e) => /journal refused/.test(e.message)).length).toBeGreaterThanOrEqual(1);
  });

  test("messages that come while the bot is stopped wait in memory for the next start", async () => {
    const handled: string[] = [];
    const h = await harness((bot) => bot.when(/.*/, (ctx) => void handled.push(ctx.message.text!)), { start: false });
    h.sock.upsert([h.server.text(ALICE, "while stopped")]);
    expect(h.provider.pendingCount).toBe(1);
    await h.bot.start();
    await until(() => handled.length === 1, "the held message");
    expect(handled).toEqual(["while stopped"]);
    expect(h.provider.pendingCount).toBe(0);
  });

  test("a flow reply the journal could not take as parsed (1e999 is Infinity, nesting past 64) is sanitised; the chat goes on", async () => {
    const handled: { type: string; text?: string; value?: unknown }[] = [];
    const h = await harness((bot) => bot.when(() => true, (ctx) => void handled.push({ type: ctx.message.type, text: ctx.message.text, value: ctx.message.interaction?.value })));
    const deep = "[".repeat(100) + "]".repeat(100);
    const flow = (id: string, paramsJson: string) => ({
      key: { remoteJid: ALICE, fromMe: false, id },
      message: { interactiveResponseMessage: { nativeFlowResponseMessage: { name: "flow", paramsJson } } },
      messageTimestamp: 1,
    });
    h.sock.upsert([flow("3AINF", '{"x":1e999,"y":2}'), flow("3ADEEP", `{"d":${deep}}`), flow("3APROTO", '{"__proto__":{"a":1}}')]);
    h.sock.upsert([h.server.text(ALICE, "hello after")]);
    await until(() => handled.length === 4, "all four messages");
    expect(handled.slice(0, 1)).toEqual([{ type: "interaction", text: undefined, value: { x: null, y: 2 } }]);
    let depth = 0;
    for (let v = (handled[1]!.value as { d: unknown }).d; Array.isArray(v); v = v[0]) depth++;
    expect(depth).toBeGreaterThan(10);
    expect(depth).toBeLessThan(64);
    expect(Object.keys(handled[2]!.value as object)).toEqual(["__proto__"]);
    expect(handled[3]).toEqual({ type: "text", text: "hello after", value: undefined });
    expect(h.errors.filter((e) => /journal refused/.test(e.message))).toEqual([]);
  });

  test("a message the bot refuses for good (unencodable, or its inbound checks) is journaled as unreadable and dead-lettered, not retried; the chat goes on", async () => {
    const handled: string[] = [];
    const refusals: string[] = [];
    const h = await harness((bot) => bot.when(() => true, (ctx) => void handled.push(ctx.message.text!)), { start: false });
    const start = h.provider.start.bind(h.provider);
    h.provider.start = (sink) =>
      start({
        ...sink,
        receive: (m) => {
          if (m.unreadable === undefined && m.id.endsWith("POISON1")) {
            refusals.push(m.id);
            return Promise.resolve({ status: "rejected", id: m.id, error: new UnencodableContentError("message.extra.x", "Infinity is not a finite number") });
          }
          if (m.unreadable === undefined && m.id.endsWith("POISON2")) {
            refusals.push(m.id);
            return Promise.resolve({ status: "rejected", id: m.id, error: new TypeError('Inbound message field "text" must be a string, got 1') });
          }
          return sink.receive(m);
        },
      });
    await h.bot.start();
    h.sock.upsert([h.server.text(ALICE, "poison 1", { id: "3APOISON1" }), h.server.text(ALICE, "poison 2", { id: "3APOISON2" }), h.server.text(ALICE, "after")]);
    await until(() => handled.length === 1 && h.events.dead.length === 2, "the later message and two dead letters");
    await h.provider.idle();
    await h.bot.idle();
    expect(handled).toEqual(["after"]);
    expect(refusals).toEqual([`${ALICE},0,3APOISON1`, `${ALICE},0,3APOISON2`]);
    for (const id of ["3APOISON1", "3APOISON2"]) {
      const record = await h.bot.durability!.inbox.get(`${ALICE},0,${id}`);
      expect(record?.state).toBe("dead");
      const payload = record!.payload as unknown as InboundMessage;
      expect(payload.unreadable).toMatch(/cannot take the Baileys message/);
      expect(((payload.extra as { raw: { key: { id: string } } }).raw).key.id).toBe(id);
    }
    expect(h.errors.filter((e) => /journal refused/.test(e.message))).toEqual([]);
  });

  test("across bot.stop() a chat keeps its order: a message still being sealed is not overtaken by a later one held for the next start", async () => {
    const handled: string[] = [];
    const backend = new MemoryDurability();
    const h = await harness((bot) => bot.when(() => true, (ctx) => void handled.push(ctx.message.text!)), { backend });
    const stop = h.provider.stop.bind(h.provider);
    h.provider.stop = () => {
      stop();
      h.sock.upsert([h.server.text(ALICE, "B (text, second)")]); // right after the bot let go
    };
    h.sock.upsert([h.server.image(ALICE, new Uint8Array([1, 2, 3]), { caption: "A (image, first)" })]); // its media reference is sealed (async)
    await h.bot.stop();
    await h.provider.idle();
    expect(h.provider.pendingCount).toBe(2);
    expect(h.errors.some((e) => /stopped while WhatsApp messages were still held/.test(e.message))).toBe(true);
    h.provider.stop = stop;
    const next = new Bot({ provider: h.provider, durability: { backend, instanceId: "baileys-test" } });
    next.when(() => true, (ctx) => void handled.push(ctx.message.text!));
    await next.start();
    cleanups.push(() => next.stop());
    await until(() => handled.length === 2, "both messages");
    expect(handled).toEqual(["A (image, first)", "B (text, second)"]);
  });

  test("a disconnect in the middle of the buffered offline replay loses nothing it acknowledged: the old socket's buffer is flushed on close and it stays listened to", async () => {
    const handled: string[] = [];
    const h = await harness((bot) => bot.when(() => true, (ctx) => void handled.push(ctx.message.text!)));
    // a logged-in socket buffers until the offline queue is drained; each message is acked, then upserted (into the buffer)
    h.sock.ev.buffer();
    h.sock.upsert([h.server.text(ALICE, "offline 1")], "append");
    h.sock.upsert([h.server.text(GROUP, "offline 2", { participant: "4917000000000@s.whatsapp.net" })], "append");
    expect(handled).toEqual([]);
    h.sock.close(); // connection.update is never buffered; Baileys' end() does not flush
    const second = h.server.socket();
    h.provider.attach(second);
    second.open();
    await until(() => handled.length === 2, "both acknowledged messages");
    expect(handled.sort()).toEqual(["offline 1", "offline 2"]);
    // a socket replaced without a close event: its buffer is flushed by attach()
    second.ev.buffer();
    second.upsert([h.server.text(ALICE, "offline 3")], "append");
    const third = h.server.socket();
    h.provider.attach(third);
    await until(() => handled.length === 3, "the third message");
    // an old socket without flush() (a message whose processing was under way) still reaches the bot
    delete (second.ev as { flush?: unknown }).flush;
    second.upsert([h.server.text(ALICE, "late")]);
    await until(() => handled.length === 4, "the late message");
    // detach() flushes and lets go of every socket
    third.ev.buffer();
    third.upsert([h.server.text(ALICE, "offline 4")], "append");
    h.provider.detach();
    await until(() => handled.length === 5, "the message flushed by detach()");
    expect([h.sock, second, third].map((s) => s.listenerCount("messages.upsert"))).toEqual([0, 0, 0]);
    expect(handled.slice(2)).toEqual(["offline 3", "late", "offline 4"]);
  });
});

describe("baileys: sends", () => {
  test("a send after the connection closed is retried and goes out once, through the socket of the reconnect", async () => {
    const h = await harness((bot) => bot.when(/.*/, (ctx) => ctx.reply("pong")));
    h.sock.plan.push("query-timeout", "closed"); // a usync query timed out, then the socket closed under the send
    h.sock.upsert([h.server.text(ALICE, "ping")]);
    await until(() => h.sock.calls.length === 2, "two failed attempts");
    h.sock.close(); // connection.update close: later sends do not even reach the dead socket
    await new Promise((r) => setTimeout(r, 60));
    const callsOnDead = h.sock.calls.length;
    const next = h.server.socket(); // the user's reconnect loop
    h.provider.attach(next);
    expect(h.sock.listenerCount("messages.upsert"), "the old socket is still listened to: it may still emit what it acknowledged").toBe(1);
    next.open();
    await until(() => h.server.delivered.length === 1, "the reply on the new socket", 8000);
    await h.bot.idle();
    expect(h.sock.calls.length).toBe(callsOnDead);
    expect(h.server.delivered.map((d) => [d.jid, d.socket])).toEqual([[ALICE, next.number]]);
    const ids = new Set([...h.sock.calls, ...next.calls].map((c) => c.options?.messageId));
    expect(ids.size, "every attempt carries the same message id").toBe(1);
    const [entry] = await h.bot.durability!.outbox.list();
    expect(entry!.state).toBe("sent");
    // a message the old socket still emits after the reconnect (Baileys acknowledged it) is journaled; its reply goes through the new socket
    const late = h.server.text(ALICE, "late on the old socket");
    h.sock.upsert([late]);
    next.upsert([structuredClone(late)], "append"); // the same message again: a duplicate
    next.upsert([h.server.text(ALICE, "ping again")]);
    await until(() => h.server.delivered.length === 3, "the other two replies");
    await h.bot.idle();
    expect((await h.bot.durability!.inbox.list()).map((r) => (r.payload as unknown as InboundMessage).text).sort()).toEqual(["late on the old socket", "ping", "ping again"]);
    expect(h.server.delivered.map((d) => d.socket)).toEqual([next.number, next.number, next.number]);
  });

  test("a send cut off after the stanza went out is held as ambiguous, and the receipt settles it without a second message", async () => {
    const h = await harness((bot) => bot.when(/.*/, (ctx) => ctx.reply("answer")));
    h.sock.plan.push("hang-after-write");
    h.sock.upsert([h.server.text(ALICE, "question")]);
    await until(() => h.events.ambiguous.length === 1, "the ambiguity");
    const [entry] = await h.bot.durability!.outbox.list();
    expect(entry!.state).toBe("unknown");
    const messageId = await baileysMessageIdFor(entry!.key);
    expect(h.server.delivered.map((d) => d.messageId)).toEqual([messageId]);
    h.sock.receipt(ALICE, "3AUNRELATED", STATUS.DELIVERY_ACK); // not ours: ignored
    h.sock.receipt(ALICE, messageId, STATUS.DELIVERY_ACK);
    await until(() => h.events.resolved.length === 1, "the settlement");
    expect(h.events.resolved[0]).toMatchObject({ key: entry!.key, state: "sent", via: "status", messageId });
    expect((await h.bot.durability!.outbox.get(entry!.key))?.state).toBe("sent");
    expect(h.server.delivered.length).toBe(1);
  });

  test("a group receipt that came while the send was still hanging settles it as soon as it turns ambiguous", async () => {
    const h = await harness((bot) => bot.when(/.*/, (ctx) => ctx.reply("to the group")));
    h.sock.plan.push("hang-after-write");
    h.sock.upsert([h.server.text(GROUP, "hi all", { participant: "4917000000000@s.whatsapp.net" })]);
    await until(() => h.server.delivered.length === 1, "the stanza");
    h.sock.groupReceipt(GROUP, h.server.delivered[0]!.messageId, "4917000000000@s.whatsapp.net");
    await until(() => h.events.resolved.length === 1, "the settlement");
    const [entry] = await h.bot.durability!.outbox.list();
    expect(entry!.state).toBe("sent");
    expect(entry!.messageId).toBe(h.server.delivered[0]!.messageId);
    expect(h.server.delivered.length).toBe(1);
  });

  test("a receipt Baileys' event buffer merged into the echo of our own send (its status, or userReceipt) settles the ambiguous send", async () => {
    const h = await harness((bot) => bot.when(/.*/, (ctx) => ctx.reply("answer")));
    h.sock.plan.push("hang-after-write", "hang-after-write");
    h.sock.upsert([h.server.text(ALICE, "question")]);
    await until(() => h.events.ambiguous.length === 1, "the first ambiguity");
    const echo = (jid: string, id: string, extra: Record<string, unknown>) => ({
      key: { remoteJid: jid, fromMe: true, id },
      message: { extendedTextMessage: { text: "answer" } },
      ...extra,
    });
    const first = h.server.delivered[0]!.messageId;
    h.sock.upsert([echo(ALICE, first, { status: STATUS.PENDING })], "append"); // the plain echo settles nothing
    h.sock.upsert([echo(ALICE, first, { status: STATUS.DELIVERY_ACK })], "append");
    await until(() => h.events.resolved.length === 1, "the first settlement");
    expect(h.events.resolved[0]).toMatchObject({ state: "sent", via: "status", messageId: first });
    h.sock.upsert([h.server.text(GROUP, "hi all", { participant: "4917000000000@s.whatsapp.net" })]);
    await until(() => h.events.ambiguous.length === 2, "the second ambiguity");
    const second = h.server.delivered[1]!.messageId;
    h.sock.upsert([echo(GROUP, second, { status: STATUS.PENDING, userReceipt: [{ userJid: "4917000000000@s.whatsapp.net", receiptTimestamp: 1_760_000_000 }] })], "append");
    await until(() => h.events.resolved.length === 2, "the second settlement");
    expect(h.events.resolved[1]).toMatchObject({ state: "sent", via: "status", messageId: second });
    expect(h.server.delivered.length).toBe(2);
    expect(h.skipped.map((s) => s.reason)).toEqual(["from-me", "from-me", "from-me"]);
  });

  test("a sendMessage cut off by sendTimeoutMs is still watched: a late pre-send failure (Boom 408) is confirmed not delivered and sent again, a late success settles the send", async () => {
    const h = await harness((bot) => bot.when(/.*/, (ctx) => ctx.reply(`re: ${ctx.message.text}`)));
    const original = h.sock.sendMessage;
    let gate!: () => void;
    const plan: ("fail-late" | "ok-late")[] = ["fail-late"];
    h.sock.sendMessage = async (jid, content, options) => {
      const behaviour = plan.shift();
      if (behaviour === undefined) return await original(jid, content, options);
      await new Promise<void>((resolve) => gate = resolve); // longer than sendTimeoutMs (150 ms)
      if (behaviour === "fail-late") throw boom("Timed Out", 408); // a usync query before the relay: nothing went out
      return await original(jid, content, options);
    };
    h.sock.upsert([h.server.text(ALICE, "one")]);
    await until(() => h.events.ambiguous.length === 1, "the first send cut off");
    gate();
    await until(() => h.events.resolved.length === 1, "the confirmation that it never went out");
    expect(h.events.resolved[0]).toMatchObject({ state: "failed", via: "confirm" });
    await until(() => h.server.delivered.length === 1, "the resend");
    await h.bot.idle();
    expect(h.server.textsTo(ALICE)).toEqual(["re: one"]);
    expect((await h.bot.durability!.outbox.list()).map((e) => e.state)).toEqual(["sent"]);

    plan.push("ok-late");
    h.sock.upsert([h.server.text(ALICE, "two")]);
    await until(() => h.events.ambiguous.length === 2, "the second send cut off");
    gate();
    await until(() => h.events.resolved.length === 2, "the late success settling it");
    expect(h.events.resolved[1]).toMatchObject({ state: "sent", via: "status" });
    await h.bot.idle();
    expect(h.server.textsTo(ALICE)).toEqual(["re: one", "re: two"]);
    expect(h.server.delivered.length).toBe(2);
    expect((await h.bot.durability!.outbox.list()).map((e) => e.state)).toEqual(["sent", "sent"]);
  });

  test("errors are classified: closed, lost and timed-out queries retry, logged out waits, bad content is permanent, the provider's own timeout is maybe delivered", () => {
    expect(classifyBaileysError(boom("Connection Closed", 428))).toEqual({ retryable: true, rateLimited: "chat", retryAfterMs: 1000 });
    expect(classifyBaileysError(boom("Timed Out", 408))).toEqual({ retryable: true });
    expect(classifyBaileysError(boom("Connection Replaced", 440))).toEqual({ retryable: true });
    expect(classifyBaileysError(boom("Stream Errored (restart required)", 515))).toEqual({ retryable: true });
    expect(classifyBaileysError(boom("Intentional Logout", 401))).toEqual({ retryable: true, retryAfterMs: 60_000 });
    expect(classifyBaileysError(boom("Invalid media type", 400))).toEqual({ retryable: false });
    expect(classifyBaileysError(boom("rate-overlimit", 429))).toEqual({ retryable: true, rateLimited: "chat" });
    expect(classifyBaileysError(new Error("socket hang up"))).toEqual({ retryable: true });
    const provider = new BaileysProvider();
    expect(provider.classifyError({ name: "ProviderError", maybeDelivered: true })).toEqual({ retryable: true, maybeDelivered: true });
  });

  test("options are checked", () => {
    expect(() => new BaileysProvider({ sendTimeoutMs: 0 })).toThrow(/sendTimeoutMs/);
    for (const sendTimeoutMs of [Infinity, NaN, 3_000_000_000, -1]) {
      expect(() => new BaileysProvider({ sendTimeoutMs }), String(sendTimeoutMs)).toThrow(RangeError);
      expect(() => new BaileysProvider({ sendTimeoutMs }), String(sendTimeoutMs)).toThrow(/sendTimeoutMs/);
    }
    expect(() => new BaileysProvider({ sendTimeoutMs: "5" as never })).toThrow(/sendTimeoutMs/);
    expect(new BaileysProvider({ sendTimeoutMs: 2 ** 31 - 1 })).toBeDefined();
    for (const upsertTypes of [[], ["notfy"], ["notify", 1], "notify"]) {
      expect(() => new BaileysProvider({ upsertTypes: upsertTypes as never }), JSON.stringify(upsertTypes)).toThrow(/upsertTypes/);
    }
    expect(new BaileysProvider({ upsertTypes: ["append"] })).toBeDefined();
    expect(() => new BaileysProvider({ nope: 1 } as never)).toThrow(/Unknown BaileysProvider option "nope"/);
    expect(() => new BaileysProvider({ mediaKey: "short" })).toThrow(RangeError);
    expect(() => new BaileysProvider().attach({} as never)).toThrow(/attach\(\) needs a Baileys socket/);
    const server = new FakeWhatsApp();
    const provider = new BaileysProvider({ socket: server.socket().open() });
    expect(provider.connectionId).toBe("15550000000@s.whatsapp.net");
  });
});

describe("baileys: media and restarts", () => {
  test("an image is loaded again from its journaled reference (the key and media node downloadMediaMessage needs)", async () => {
    const loaded: { text?: string; bytes: string; mimeType?: string }[] = [];
    const h = await harness((bot) =>
      bot.when(() => true, async (ctx) => {
        const media = await loadMediaOf(ctx, { throwOnError: true });
        loaded.push({ text: ctx.message.text, bytes: new TextDecoder().decode(media!.data), mimeType: media!.mimeType });
      })
    );
    h.sock.upsert([h.server.image(ALICE, new TextEncoder().encode("JPEG bytes"), { caption: "a cat", ephemeral: true })]);
    await until(() => loaded.length === 1, "the image");
    expect(loaded).toEqual([{ text: "a cat", bytes: "JPEG bytes", mimeType: "image/jpeg" }]);
    const [stored] = await h.bot.durability!.inbox.list();
    const record = { message: stored!.payload as unknown as InboundMessage };
    expect(record.message.type).toBe("image");
    const json = JSON.stringify(record.message);
    expect(json).not.toContain("jpegThumbnail");
    // a provider without downloadMedia says why it cannot load it
    const bare = new BaileysProvider({ mediaKey: MEDIA_KEY });
    await expect(bare.loadMedia(record.message.media as never, { message: record.message })).rejects.toThrow(/no "downloadMedia"/);
    // media WhatsApp no longer has (404 after the re-upload request) is rehydrate-failed
    h.server.media.clear();
    await expect(h.provider.loadMedia(record.message.media as never, { message: record.message })).rejects.toMatchObject({
      name: "MediaUnavailableError",
      reason: "rehydrate-failed",
    });
  });

  test("restart on SQLite: the next process continues what the dead one left, each reply once, a send cut off by the death settled by its receipt", async () => {
    const file = join(dir, `restart-${crypto.randomUUID()}.db`);
    const server = new FakeWhatsApp();
    const runs: string[] = [];
    const handler = (bot: Bot) =>
      bot.when(/.*/, async (ctx) => {
        runs.push(ctx.message.text!);
        await ctx.reply(`re: ${ctx.message.text}`);
      });
    // Process A dies right after its second provider call went out (before it is recorded): one reply
    // went out and is recorded, one went out unrecorded, and the third message was journaled only.
    const sqliteA = new SQLiteDurability({ file });
    const a = crashable(sqliteA);
    a.crashAfter("provider.send", { at: 2 });
    const first = await harness(handler, {
      backend: a,
      server,
      wrapSend: (send) => (chatId, content, context) => a.step("provider.send", () => send(chatId, content, context)),
    });
    const messages = [server.text(ALICE, "one"), server.text(ALICE, "two"), server.text(ALICE, "three")];
    first.sock.upsert(messages);
    await until(() => a.crashed, "the crash");
    first.sock.close(); // the process is gone: its socket with it
    first.provider.detach();
    await first.bot.stop().catch(() => {});
    await sqliteA.close?.();
    expect(server.textsTo(ALICE)).toEqual(["re: one", "re: two"]);

    // Process B: the same database, a new socket. WhatsApp delivers the unacknowledged ones again.
    const second = await harness(handler, { backend: new SQLiteDurability({ file }), server });
    cleanups.push(() => second.bot.stop());
    second.sock.upsert(messages.map((m) => structuredClone(m)), "append");
    await until(async () => (await second.bot.durability!.inbox.get(messageKeyId(messages[2]!.key)))?.state === "done", "the third message", 8000);
    await until(() => second.events.ambiguous.length === 1, "the send A lost track of");
    const lost = server.delivered.find((d) => d.content && (d.content as { text?: string }).text === "re: two")!;
    second.sock.receipt(ALICE, lost.messageId, STATUS.READ);
    await until(() => second.events.resolved.length === 1, "the receipt settling it");
    await second.bot.idle();
    expect(server.textsTo(ALICE)).toEqual(["re: one", "re: two", "re: three"]);
    expect(server.delivered.filter((d) => (d.content as { text: string }).text === "re: two").length).toBe(1);
    const states = (await second.bot.durability!.outbox.list()).map((e) => e.state);
    expect(states).toEqual(["sent", "sent", "sent"]);
    expect(runs.filter((r) => r === "one").length).toBe(1);
  });
});
