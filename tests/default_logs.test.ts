// With no error listener and no onError, the bot and the providers print what failed to the console; that text
// comes partly from the bot's users (an update's keys, a message, a handler's error about it) and lands in a
// terminal (`docker logs -f`). It is printed with every control and invisible character as a \u escape; the error
// objects a listener gets stay as they were.
import { afterEach, expect, spyOn, test } from "bun:test";
import { Bot } from "../src/bot.ts";
import { MemoryDurability } from "../backends/memory/durability.ts";
import { errorLogText } from "../src/errors.ts";
import { MockProvider } from "../src/testing/mock_provider.ts";
import { TelegramProvider } from "../providers/telegram/mod.ts";
import { TelegramUpdateError } from "../providers/telegram/updates.ts";
import { WhatsAppProvider } from "../providers/whatsapp/mod.ts";

/** Anything a terminal acts on, or shows as nothing or reordered, but the newline. */
const RAW = /[\u0000-\u0009\u000b-\u001f\u007f-\u009f\p{Cf}\u2028\u2029]/u;
/** Retitle the window (OSC), clear the screen (CSI), an 8-bit CSI, a right-to-left override. */
const EVIL = "\u001b]0;pwned\u0007\u001b[2J\u009b31m\u202e";

const spies: { mockRestore(): void }[] = [];
afterEach(() => {
  for (const s of spies.splice(0)) s.mockRestore();
});

/** What the console's error and warn print, one string a call. */
function captureConsole(): string[] {
  const logged: string[] = [];
  const capture = (...args: unknown[]) => void logged.push(args.map((a) => (a instanceof Error ? `${a.name}: ${a.message}` : String(a))).join(" "));
  spies.push(spyOn(console, "error").mockImplementation(capture), spyOn(console, "warn").mockImplementation(capture));
  return logged;
}

async function until(what: string, check: () => boolean, timeoutMs = 5_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}

test("errorLogText: the error's text with its controls escaped, newlines kept", () => {
  const text = errorLogText("[x] where:", new Error(`bad ${EVIL}`));
  expect(text.startsWith("[x] where: Error: bad \\u001b]0;pwned\\u0007\\u001b[2J\\u009b31m\\u202e\n")).toBe(true);
  expect(RAW.test(text)).toBe(false);
});

test("a webhook update whose keys carry terminal controls: the default log escapes them, the field path quotes the key", async () => {
  const logged = captureConsole();
  const provider = new TelegramProvider({ token: "123456789:AAH-fake_secret_token_part_0123456789", apiBase: "http://127.0.0.1:1", secretToken: "sek" });
  const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "default-logs" } });
  bot.when(/.*/, async () => {});
  await bot.start();
  try {
    const deep = JSON.parse("[".repeat(40) + "]".repeat(40));
    for (const update of [
      { update_id: 5, poll: { [EVIL]: deep } },
      { update_id: 7, message: { message_id: 1, date: 1, chat: { id: 1, type: "private" }, text: "hi", [EVIL]: deep } },
    ]) {
      const r = await provider.webhook(
        new Request("http://bot.test/tg", { method: "POST", headers: { "x-telegram-bot-api-secret-token": "sek" }, body: JSON.stringify(update) }),
      );
      expect(r.status).toBe(200);
    }
    await until("both updates logged, and the unreadable message dead-lettered", () =>
      logged.filter((l) => l.includes("bot: TelegramUpdateError")).length === 2 && logged.some((l) => l.includes("dead-lettered unread")));
  } finally {
    await bot.stop();
  }
  expect(logged.filter((l) => RAW.test(l)).map((l) => JSON.stringify(l.slice(0, 80)))).toEqual([]);
  const key = '["\\u001b]0;pwned\\u0007\\u001b[2J\\u009b31m\\u202e"]';
  expect(logged.some((l) => l.includes(`Telegram update field "poll${key}[0]`))).toBe(true);
});

test("the error a listener gets keeps its text; the path of an odd key is quoted in it too", async () => {
  const provider = new TelegramProvider({ token: "123456789:AAH-fake_secret_token_part_0123456789", apiBase: "http://127.0.0.1:1", secretToken: "sek" });
  const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "default-logs-listener", inbox: { retries: 0 } } });
  const heard: Error[] = [];
  bot.on("error", (e) => void heard.push(e));
  bot.when(/.*/, async () => {
    throw new Error(`handler failed on ${EVIL}`);
  });
  const logged = captureConsole();
  await bot.start();
  try {
    const deep = JSON.parse("[".repeat(40) + "]".repeat(40));
    for (const update of [
      { update_id: 9, poll: { "a.b": deep } },
      { update_id: 11, message: { message_id: 2, date: 1, chat: { id: 1, type: "private" }, text: "hi" } },
    ]) {
      const body = JSON.stringify(update);
      await provider.webhook(new Request("http://bot.test/tg", { method: "POST", headers: { "x-telegram-bot-api-secret-token": "sek" }, body }));
    }
    await until("both errors heard", () => heard.some((e) => e instanceof TelegramUpdateError) && heard.some((e) => e.message.includes("handler failed")));
  } finally {
    await bot.stop();
  }
  // A key with a dot cannot pass for two fields.
  expect((heard.find((e) => e instanceof TelegramUpdateError) as TelegramUpdateError).field).toStartWith('poll["a.b"][0][0]');
  expect(heard.find((e) => e.message.includes("handler failed"))!.message).toContain(`handler failed on ${EVIL}`);
  expect(logged).toEqual([]);
});

test("a bot without an error listener prints a handler's error escaped", async () => {
  const provider = new MockProvider();
  const bot = new Bot({ provider });
  bot.when(/.*/, async () => {
    throw new Error(`handler failed on ${EVIL}`);
  });
  const logged = captureConsole();
  await bot.start();
  try {
    await provider.receive({ id: "m1", chatId: "c1", text: "hi" });
    await until("the error logged", () => logged.length > 0);
  } finally {
    await bot.stop();
  }
  expect(logged.join("\n")).toContain("handler failed on \\u001b]0;pwned\\u0007\\u001b[2J\\u009b31m\\u202e");
  expect(logged.filter((l) => RAW.test(l))).toEqual([]);
});

test("a WhatsApp webhook problem, with a sink that takes no reports, is printed escaped", async () => {
  const logged = captureConsole();
  const appSecret = "an-app-secret-for-the-default-logs";
  const provider = new WhatsAppProvider({ accessToken: "token", phoneNumberId: "1000", appSecret, verifyToken: "verify" });
  provider.start({ receive: async () => ({ admitted: true }) as never });
  const body = JSON.stringify({
    object: "whatsapp_business_account",
    entry: [{ id: "1", changes: [{ field: "messages", value: { metadata: { phone_number_id: `2000${EVIL}` }, messages: [{ id: "m" }] } }] }],
  });
  const key = await crypto.subtle.importKey("raw", new TextEncoder().encode(appSecret), { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
  const mac = new Uint8Array(await crypto.subtle.sign("HMAC", key, new TextEncoder().encode(body)));
  const signature = `sha256=${[...mac].map((b) => b.toString(16).padStart(2, "0")).join("")}`;
  await provider.webhook(new Request("http://bot.test/wa", { method: "POST", headers: { "content-type": "application/json", "x-hub-signature-256": signature }, body }));
  await until("the problem logged", () => logged.length > 0);
  provider.stop();
  expect(logged.join("\n")).toContain("2000\\u001b]0;pwned");
  expect(logged.filter((l) => RAW.test(l))).toEqual([]);
});
