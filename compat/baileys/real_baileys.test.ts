// @botmesh/durable/baileys against the real baileys 6.17 package (run.sh installs it here, with npm
// overrides for its GitHub-only dependencies): a real `makeWASocket` socket (its event emitter, its
// sendMessage failing as it does while the connection is not open), real protobuf messages
// (`proto.WebMessageInfo` encoded and decoded: `Long` timestamps, byte fields), real media
// encryption (`encryptedStream`) served on loopback and decrypted again by the real
// `downloadMediaMessage` from what the journal kept, and `generateWAMessage` honouring the `messageId`
// option the provider sends with.
import { afterAll, expect, test } from "bun:test";
import { createServer, type Server } from "node:http";
import {
  DisconnectReason,
  downloadMediaMessage,
  encryptedStream,
  generateWAMessage,
  initAuthCreds,
  makeWASocket,
  proto,
  type WAMessage,
} from "baileys";
import { Bot, loadMediaOf, MemoryDurability } from "../../mod.ts";
import { BaileysProvider, baileysMessageIdFor, type BaileysSocketLike, messageKeyId } from "../../providers/baileys/mod.ts";
import { FakeWhatsApp } from "../../tests/support/fake_baileys.ts";

const ALICE = "4915112345678@s.whatsapp.net";
const ME = "15550000000:7@s.whatsapp.net";
const silent = {
  level: "silent",
  child() {
    return silent;
  },
  trace() {},
  debug() {},
  info() {},
  warn() {},
  error() {},
};

/** A real socket whose WebSocket points at a closed loopback port: it never opens. */
function realSocket() {
  const creds = initAuthCreds();
  creds.me = { id: ME, name: "Bot" };
  const keys: Record<string, Record<string, unknown>> = {};
  const sock = makeWASocket({
    auth: {
      creds,
      keys: {
        get: async (type: string, ids: string[]) => Object.fromEntries(ids.map((id) => [id, keys[type]?.[id]])),
        set: async (data: Record<string, Record<string, unknown>>) => {
          for (const type in data) keys[type] = { ...keys[type], ...data[type] };
        },
      },
    } as never,
    waWebSocketUrl: "ws://127.0.0.1:9/ws",
    logger: silent as never,
    markOnlineOnConnect: false,
    connectTimeoutMs: 2_000,
  });
  return sock;
}

const servers: Server[] = [];
afterAll(() => servers.forEach((s) => s.close()));

test("the real WASocket type fits BaileysSocketLike, and generateWAMessage keeps the messageId option", async () => {
  const sock = realSocket();
  const like: BaileysSocketLike = sock; // compile-time: the structural type accepts the real socket
  expect(typeof like.ev.on).toBe("function");
  const id = await baileysMessageIdFor("m1:1");
  const generated = await generateWAMessage(ALICE, { text: "x" }, { userJid: ME, messageId: id, upload: (async () => ({})) as never });
  expect(generated.key.id).toBe(id);
});

test("a real protobuf message through the real event emitter is journaled; the real sendMessage's Connection Closed (428) is retried until a reconnect's socket takes the reply", async () => {
  const sock = realSocket();
  const errors: unknown[] = [];
  const provider = new BaileysProvider({ socket: sock, mediaKey: "a media key of at least sixteen bytes", sendTimeoutMs: 2_000 });
  const backend = new MemoryDurability();
  const bot = new Bot({
    provider,
    durability: { backend, instanceId: "real", outbox: { retries: 2, leaseMs: 200, backoff: { baseMs: 10, capMs: 20 } }, inbox: { leaseMs: 200 } },
  });
  bot.on("error", (e) => errors.push(e));
  const handled: { text?: string; timestamp?: number; type: string }[] = [];
  bot.when(/.*/, async (ctx) => {
    handled.push({ text: ctx.message.text, timestamp: ctx.message.timestamp, type: ctx.message.type });
    await ctx.reply(`echo: ${ctx.message.text}`);
  });
  await bot.start();
  // A real WebMessageInfo, encoded and decoded as it comes off the wire (Long timestamp).
  const wire = proto.WebMessageInfo.encode(
    proto.WebMessageInfo.fromObject({
      key: { remoteJid: ALICE, fromMe: false, id: "3A0000000000000000AA" },
      message: { extendedTextMessage: { text: "hello real" } },
      messageTimestamp: 1_760_000_000,
      pushName: "Alice",
    }),
  ).finish();
  const decoded = proto.WebMessageInfo.decode(wire) as WAMessage;
  // A logged-in socket buffers its events from the start (socket.js: ev.buffer() on the next tick)
  // until WhatsApp's offline batch is done (CB:ib,,offline: ev.flush()): the upsert waits there.
  await new Promise((r) => setTimeout(r, 20));
  expect(sock.ev.isBuffering()).toBe(true);
  sock.ev.emit("messages.upsert", { messages: [decoded], type: "notify" });
  await new Promise((r) => setTimeout(r, 100));
  expect(handled).toEqual([]);
  sock.ev.flush(); // what the end of the offline batch does
  const end = Date.now() + 5_000;
  while (handled.length === 0 && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
  expect(handled).toEqual([{ text: "hello real", timestamp: 1_760_000_000_000, type: "text" }]);
  expect((await backend.inbox.get(messageKeyId(decoded.key)))?.state).not.toBeNull();
  // The reply: the real socket is not open, so sendMessage throws Boom 428 "Connection Closed".
  let thrown: unknown;
  await sock.sendMessage(ALICE, { text: "probe" }).catch((e) => (thrown = e));
  expect((thrown as { output?: { statusCode?: number } }).output?.statusCode).toBe(DisconnectReason.connectionClosed);
  expect(provider.classifyError(thrown)).toEqual({ retryable: true, rateLimited: "chat", retryAfterMs: 1000 });
  // The bot's reply waits for a socket, attempts unspent, however long the reconnect takes.
  await new Promise((r) => setTimeout(r, 1_500));
  const [pending] = await backend.outbox.list();
  expect(pending?.state).toBe("failed");
  expect(pending?.attempts ?? 0).toBeLessThanOrEqual(1);
  // The user's reconnect loop attaches the next socket (here the fake: no WhatsApp server to reach).
  const server = new FakeWhatsApp();
  const next = server.socket().open();
  provider.attach(next);
  const until = Date.now() + 5_000;
  while (server.delivered.length === 0 && Date.now() < until) await new Promise((r) => setTimeout(r, 10));
  await bot.idle();
  expect(server.textsTo(ALICE)).toEqual(["echo: hello real"]);
  expect(server.delivered[0]!.messageId).toBe(await baileysMessageIdFor(pending!.key));
  await bot.stop();
});

test("media: what the journal keeps of a real image message is what the real downloadMediaMessage needs to decrypt it again", async () => {
  const plain = Buffer.from("real JPEG bytes ".repeat(100));
  const enc = await encryptedStream(plain, "image", {});
  const chunks: Buffer[] = [];
  for await (const chunk of enc.encWriteStream) chunks.push(chunk as Buffer);
  const body = Buffer.concat(chunks);
  const server = createServer((_, res) => res.end(body));
  servers.push(server);
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const url = `http://127.0.0.1:${(server.address() as { port: number }).port}/v/t62.7118-24/x.enc`;
  const wire = proto.WebMessageInfo.encode(
    proto.WebMessageInfo.fromObject({
      key: { remoteJid: ALICE, fromMe: false, id: "3A0000000000000000BB" },
      message: {
        imageMessage: {
          url,
          directPath: "/v/t62.7118-24/x.enc",
          mimetype: "image/jpeg",
          caption: "a real cat",
          mediaKey: enc.mediaKey,
          fileEncSha256: enc.fileEncSha256,
          fileSha256: enc.fileSha256,
          fileLength: enc.fileLength,
          mediaKeyTimestamp: 1_760_000_000,
          jpegThumbnail: Buffer.alloc(500),
        },
      },
      messageTimestamp: 1_760_000_000,
    }),
  ).finish();
  const decoded = proto.WebMessageInfo.decode(wire) as WAMessage;
  const sock = realSocket();
  const provider = new BaileysProvider({
    socket: sock,
    mediaKey: "a media key of at least sixteen bytes",
    downloadMedia: async (m) => new Uint8Array(await downloadMediaMessage(m as WAMessage, "buffer", {}) as Buffer),
  });
  const backend = new MemoryDurability();
  const bot = new Bot({ provider, durability: { backend, instanceId: "real-media" } });
  const loaded: string[] = [];
  bot.when(() => true, async (ctx) => {
    const media = await loadMediaOf(ctx, { throwOnError: true });
    loaded.push(`${ctx.message.text}|${media!.mimeType}|${Buffer.from(media!.data).equals(plain)}`);
  });
  await bot.start();
  sock.ev.emit("messages.upsert", { messages: [decoded], type: "notify" });
  if (sock.ev.isBuffering()) sock.ev.flush();
  const end = Date.now() + 5_000;
  while (loaded.length === 0 && Date.now() < end) await new Promise((r) => setTimeout(r, 10));
  expect(loaded).toEqual(["a real cat|image/jpeg|true"]);
  // and again from the journal alone, as a reprocess after a restart would
  const record = await backend.inbox.get(messageKeyId(decoded.key));
  const again = await provider.loadMedia((record!.payload as { media: never }).media, { message: record!.payload as never });
  expect(Buffer.from(again.data).equals(plain)).toBe(true);
  expect(JSON.stringify(record!.payload)).not.toContain("jpegThumbnail");
  await bot.stop();
});
