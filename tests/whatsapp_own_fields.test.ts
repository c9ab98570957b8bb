// A WhatsApp message's "type" (and an interactive reply's "type") names the field holding its body:
// only the message's own fields are read, and the body is kept in `extra` as an own field, whatever
// the name (`constructor`, `toString`, `__proto__`, …).
import { afterEach, describe, expect, test } from "bun:test";
import { ANY, Bot, type InboundMessage, MemoryDurability } from "../mod.ts";
import { type InboundSink } from "../provider.ts";
import { parseMessage } from "../providers/whatsapp/messages.ts";
import { WhatsAppProvider } from "../providers/whatsapp/mod.ts";

const PHONE = "106540352242922";
const SECRET = "app-secret-0123456789abcdef";
const encoder = new TextEncoder();

async function sign(body: string): Promise<string> {
  const key = await crypto.subtle.importKey("raw", encoder.encode(SECRET), { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
  const mac = new Uint8Array(await crypto.subtle.sign("HMAC", key, encoder.encode(body)));
  return `sha256=${Array.from(mac, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

function makeProvider(): WhatsAppProvider {
  return new WhatsAppProvider({
    accessToken: "EAAG-test-access-token",
    phoneNumberId: PHONE,
    appSecret: SECRET,
    verifyToken: "verify-me-please",
    graphBase: "http://127.0.0.1:9",
    onError: () => {},
  });
}

async function post(provider: WhatsAppProvider, messages: string): Promise<Response> {
  const body = `{"object":"whatsapp_business_account","entry":[{"id":"102290129340398","changes":[{"field":"messages","value":` +
    `{"messaging_product":"whatsapp","metadata":{"display_phone_number":"15550783881","phone_number_id":"${PHONE}"},` +
    `"messages":[${messages}]}}]}]}`;
  return await provider.webhook(
    new Request("http://127.0.0.1/webhook/whatsapp", {
      method: "POST",
      headers: { "content-type": "application/json", "x-hub-signature-256": await sign(body) },
      body,
    }),
  );
}

const stops: (() => Promise<void>)[] = [];
afterEach(async () => {
  while (stops.length > 0) await stops.pop()!();
});

describe("message types named like Object.prototype members", () => {
  for (const type of ["constructor", "toString", "valueOf", "hasOwnProperty", "__proto__"]) {
    test(`type "${type}" without a "${type}" field: extra["${type}"] reads as null, not as an inherited member`, () => {
      const raw = JSON.parse(`{"id":"wamid.x","from":"16505551234","timestamp":"1700000000","type":"${type}"}`);
      const { message } = parseMessage(raw, "p", new Map());
      const extra = message.extra as Record<string, unknown>;
      expect(Object.getPrototypeOf(extra)).toBe(Object.prototype);
      expect(Object.getOwnPropertyDescriptor(extra, type)?.value).toBeNull();
      expect(message.type).toBe(type);
    });
  }

  test("an unknown type without its field adds nothing to extra", () => {
    const raw = JSON.parse(`{"id":"wamid.x","from":"16505551234","type":"unsupported"}`);
    const { message } = parseMessage(raw, "p", new Map());
    expect(Object.hasOwn(message.extra as object, "unsupported")).toBe(false);
  });

  test(`type "constructor" with a "constructor" field: the field is kept in extra`, () => {
    const raw = JSON.parse(`{"id":"wamid.x","from":"16505551234","type":"constructor","constructor":{"a":1}}`);
    const { message } = parseMessage(raw, "p", new Map());
    expect(Object.getOwnPropertyDescriptor(message.extra, "constructor")?.value).toEqual({ a: 1 });
  });

  test("an interactive reply whose type names an Object.prototype member keeps no inherited function", () => {
    const raw = JSON.parse(`{"id":"wamid.x","from":"16505551234","type":"interactive","interactive":{"type":"toString"}}`);
    const { message } = parseMessage(raw, "p", new Map());
    expect(message.interaction).toEqual({ id: "toString", value: { kind: "toString", raw: null } });
  });

  test("webhook: such a message is journaled (answered 200) and the chat's next message is handled", async () => {
    const provider = makeProvider();
    const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "wa-own-fields" } });
    const seen: InboundMessage[] = [];
    bot.on("error", () => {});
    let next!: () => void;
    const handled = new Promise<void>((resolve) => (next = resolve));
    bot.when(ANY, (ctx) => {
      seen.push(ctx.message);
      if (ctx.message.id === "wamid.ownnext") next();
    });
    await bot.start();
    stops.push(() => bot.stop());
    const response = await post(
      provider,
      `{"from":"16505551234","id":"wamid.ownctor","timestamp":"1700000000","type":"constructor"},` +
        `{"from":"16505551234","id":"wamid.ownnext","timestamp":"1700000001","type":"text","text":{"body":"hello"}}`,
    );
    expect(response.status).toBe(200);
    await handled;
    expect(seen.map((m) => m.id)).toEqual(["wamid.ownctor", "wamid.ownnext"]);
  });
});

describe("__proto__ keys in WhatsApp messages", () => {
  const MESSAGE = `{"from":"16505551234","id":"wamid.ownproto","timestamp":"1700000000","type":"__proto__",` +
    `"__proto__":{"groupId":"120363000000000000@g.us","profileName":"Bank Support","username":"admin"}}`;

  test("parseMessage: a message type of __proto__ keeps the body as an own field, not as extra's prototype", () => {
    const { message } = parseMessage(JSON.parse(MESSAGE), "entry[0].changes[0].value.messages[0]", new Map());
    const extra = message.extra as Record<string, unknown>;
    expect(Object.getPrototypeOf(extra)).toBe(Object.prototype);
    expect(extra.groupId).toBeUndefined();
    expect(extra.profileName).toBeUndefined();
    expect(Object.getOwnPropertyDescriptor(extra, "__proto__")?.value).toEqual({
      groupId: "120363000000000000@g.us",
      profileName: "Bank Support",
      username: "admin",
    });
  });

  test("an interactive reply of type __proto__ gives no object a chosen prototype", () => {
    const raw = JSON.parse(`{"id":"wamid.x","from":"16505551234","type":"interactive","interactive":{"type":"__proto__","__proto__":{"id":"x"}}}`);
    const { message } = parseMessage(raw, "p", new Map());
    const value = message.interaction!.value as Record<string, unknown>;
    expect(Object.getPrototypeOf(value)).toBe(Object.prototype);
    expect(value.raw).toEqual({ id: "x" });
  });

  test("webhook: the message handed to the bot has no inherited groupId/profileName", async () => {
    const provider = makeProvider();
    const received: InboundMessage[] = [];
    const sink: InboundSink = {
      receive(message) {
        received.push(message);
        return Promise.resolve({ status: "admitted", id: message.id });
      },
      reportError: () => {},
      confirmSent: () => Promise.resolve(false),
    };
    provider.start(sink);
    stops.push(async () => await provider.stop?.());
    const response = await post(provider, MESSAGE);
    expect(response.status).toBe(200);
    expect(received.length).toBe(1);
    const extra = received[0]!.extra as Record<string, unknown>;
    expect(Object.getPrototypeOf(extra)).toBe(Object.prototype);
    expect(extra.groupId).toBeUndefined();
    expect(extra.profileName).toBeUndefined();
  });
});
