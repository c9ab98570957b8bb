// The bot token stays out of what the grammY and Telegraf plugins journal, log and report: a failed
// call's error (node-fetch's FetchError quotes the URL, /bot<token>/<method>) reaches the outbox, the
// durability:dead event and the default logs as a redacted copy of the same name, classified as the
// call's own error was; an error the middleware lets through reaches the inbox the same way. The
// outbound copies keep an own "__proto__" key as an own key.
import { expect, test } from "bun:test";
import { Telegraf } from "telegraf";
import { Bot as GrammyBot } from "grammy";
import { Bot, MemoryDurability } from "../mod.ts";
import { classifyGrammyError, GrammyProvider } from "../providers/grammy/provider.ts";
import { callContent } from "../providers/grammy/methods.ts";
import { durable as durableGrammy } from "../providers/grammy/mod.ts";
import { classifyTelegrafError, durable as durableTelegraf } from "../providers/telegraf/mod.ts";
import { TELEGRAF_ERRORS } from "../providers/telegraf/errors.ts";
import { redactError, redactToken } from "../providers/telegram/redact.ts";
import { cleanupsAfterEach } from "./support/plugin_tests.ts";

const cleanups = cleanupsAfterEach();
const TOKEN = "123456789:AAH-redaction_secret_token_part_0123456789";
const SECRET = TOKEN.split(":")[1]!;

function fetchError(method: string, extra: Record<string, unknown> = {}): Error {
  return Object.assign(new Error(`request to https://api.telegram.org/bot${TOKEN}/${method} failed, reason: getaddrinfo ENOTFOUND api.telegram.org`), {
    name: "FetchError",
    type: "system",
    code: "ENOTFOUND",
    ...extra,
  });
}

/** Waits (polling the journal, no fixed sleep) until `done` holds. */
async function until(done: () => Promise<boolean>, ms = 5000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!(await done())) {
    if (Date.now() > deadline) throw new Error("timed out waiting");
    await new Promise((r) => setTimeout(r, 10));
  }
}

test("redactToken: the token, its percent-encoded form and any bot<id>:<secret> become <token>", () => {
  expect(redactToken(`https://api.telegram.org/bot${TOKEN}/sendMessage`, TOKEN)).toBe("https://api.telegram.org/bot<token>/sendMessage");
  expect(redactToken(`url=${encodeURIComponent(TOKEN)}`, TOKEN)).toBe("url=<token>");
  expect(redactToken(`url=${encodeURIComponent(TOKEN).replace("%3A", "%3a")}`, TOKEN)).toBe("url=<token>");
  expect(redactToken("GET /bot987654:Zz-other_bots_secret/getMe and /bot55%3Aabc_DEF-1/x", TOKEN)).toBe("GET /bot<token>/getMe and /bot<token>/x");
  expect(redactToken("nothing secret here", TOKEN)).toBe("nothing secret here");
});

test("redactError: same name, message, stack and cause chain (cause, or grammY's error) without the token; classifying properties kept", () => {
  const inner = fetchError("sendMessage");
  const outer = Object.assign(new Error(`Network request for 'sendMessage' failed! (bot${TOKEN})`), { name: "HttpError", error: inner });
  const copy = redactError(outer, TOKEN) as Error & { cause: Error & { code?: unknown; type?: unknown } };
  expect(copy.name).toBe("HttpError");
  expect(copy.message).toBe("Network request for 'sendMessage' failed! (bot<token>)");
  expect(copy.cause.name).toBe("FetchError");
  expect(copy.cause.message).toStartWith("request to https://api.telegram.org/bot<token>/sendMessage failed");
  expect(copy.cause.code).toBe("ENOTFOUND");
  expect(copy.cause.type).toBe("system");
  for (const e of [copy, copy.cause]) {
    expect(String(e.stack)).not.toContain(SECRET);
    expect(JSON.stringify(e)).not.toContain(SECRET);
  }
  const withCause = new Error("outer", { cause: new Error(`inner ${encodeURIComponent(TOKEN)}`) });
  expect((redactError(withCause, TOKEN).cause as Error).message).toBe("inner <token>");
});

test("a send failing with node-fetch's FetchError (URL with the token) is journaled, reported and logged without the token", async () => {
  const provider = new GrammyProvider(TOKEN, (method) => Promise.reject(fetchError(method)));
  const logged: string[] = [];
  const dead: string[] = [];
  const bot = new Bot({
    provider,
    durability: {
      backend: new MemoryDurability(),
      instanceId: "redaction-grammy",
      outbox: { retries: 0, backoff: { baseMs: 5, capMs: 10 }, rateLimit: { perChat: false, global: false } },
    },
  });
  bot.on("error", (e) => logged.push(String((e as Error)?.message ?? e)));
  bot.on("durability:dead", (d) => dead.push(d.error));
  await bot.start();
  cleanups.push(() => bot.stop());
  const result = await bot.send("42", "hello");
  await until(async () => (await bot.durability!.outbox.list()).some((e) => e.state === "dead"));
  const entries = await bot.durability!.outbox.list();
  expect(entries[0]!.error).toStartWith("FetchError: request to https://api.telegram.org/bot<token>/sendMessage failed");
  for (const entry of entries) expect(JSON.stringify(entry)).not.toContain(SECRET);
  expect(JSON.stringify(result)).not.toContain(SECRET);
  expect(dead.length).toBe(1);
  for (const line of [...dead, ...logged]) expect(line).not.toContain(SECRET);
});

test("what send throws is a redacted copy, classified as the call's own error was (grammY's and Telegraf's rules)", async () => {
  const grammyErrors: unknown[] = [
    Object.assign(new Error(`Call to 'sendMessage' failed! (429: Too Many Requests) bot${TOKEN}`), { name: "GrammyError", error_code: 429, description: "Too Many Requests", parameters: { retry_after: 3 } }),
    Object.assign(new Error("Call to 'sendMessage' failed! (403: Forbidden)"), { name: "GrammyError", error_code: 403, description: "Forbidden" }),
    Object.assign(new Error("Call to 'sendMessage' failed! (502: Bad Gateway)"), { name: "GrammyError", error_code: 502, description: "Bad Gateway" }),
    Object.assign(new Error("Network request for 'sendMessage' failed!"), { name: "HttpError", error: Object.assign(fetchError("sendMessage"), { name: "TimeoutError" }) }),
    Object.assign(new Error(`Request to 'sendMessage' timed out after 500 ms`), { name: "HttpError", error: fetchError("sendMessage") }),
    fetchError("sendMessage"),
    "a string thrown",
  ];
  const telegrafErrors: unknown[] = [
    Object.assign(new Error("429: Too Many Requests"), { name: "TelegramError", response: { ok: false, error_code: 429, description: "Too Many Requests", parameters: { retry_after: 2 } } }),
    Object.assign(new Error("400: Bad Request"), { name: "TelegramError", response: { ok: false, error_code: 400, description: "Bad Request" } }),
    fetchError("sendMessage", { type: "request-timeout", message: `network timeout at: https://api.telegram.org/bot${TOKEN}/sendMessage` }),
    fetchError("sendMessage"),
  ];
  const cases: [GrammyProvider, unknown[], (e: unknown) => unknown][] = [
    [new GrammyProvider(TOKEN, () => Promise.reject(new Error("unset"))), grammyErrors, classifyGrammyError],
    [new GrammyProvider(TOKEN, () => Promise.reject(new Error("unset")), { name: "telegraf", errors: TELEGRAF_ERRORS }), telegrafErrors, classifyTelegrafError],
  ];
  for (const [model, errors, classify] of cases) {
    for (const original of errors) {
      const provider = new GrammyProvider(TOKEN, () => Promise.reject(original), model.name === "telegraf" ? { name: "telegraf", errors: TELEGRAF_ERRORS } : {});
      const thrown = await provider.send("42", "hi", { idempotencyKey: "k", attempt: 1, signal: new AbortController().signal }).then(() => undefined, (e: unknown) => e);
      expect(thrown).toBeInstanceOf(Error);
      expect(thrown).not.toBe(original);
      const text = `${(thrown as Error).name}: ${(thrown as Error).message} ${(thrown as Error).stack} ${JSON.stringify(thrown)}`;
      expect(text).not.toContain(SECRET);
      if (original instanceof Error) expect((thrown as Error).name).toBe(original.name);
      const expected = model.classifyError(original);
      expect(provider.classifyError(thrown)).toEqual(expected);
      // The copy keeps what the exported rules read, too.
      expect(classify(thrown)).toEqual(classify(original));
    }
  }
});

/**
 * A Telegraf bot whose Telegram instances (the bot's, the provider's, each update's: all of the bot's
 * class) make their calls with `callApi`: node-fetch's FetchError is what Telegraf throws on Node (Bun
 * runs its own fetch), so the tests throw it here.
 */
function telegrafWith(callApi: (method: string, payload: unknown) => Promise<unknown>): Telegraf {
  const bot = new Telegraf(TOKEN);
  bot.botInfo = { id: 123456789, is_bot: true, first_name: "Fake", username: "fake_bot" } as never;
  const proto = Object.getPrototypeOf(bot.telegram) as object;
  const Base = bot.telegram.constructor as new (token: string, options?: object) => object;
  Object.setPrototypeOf(bot.telegram, Object.create(proto, {
    constructor: {
      value: class extends Base {
        callApi(method: string, payload: unknown): Promise<unknown> {
          return callApi(method, payload);
        }
      },
    },
  }));
  return bot;
}

test("Telegraf failing with node-fetch's FetchError: the journaled send's error and the one the middleware lets through are journaled and reported without the token", async () => {
  const bot = telegrafWith((method) => Promise.reject(fetchError(method)));
  const safe = durableTelegraf(bot, {
    durability: {
      backend: new MemoryDurability(),
      instanceId: "redaction-telegraf",
      inbox: { retries: 0, backoff: { baseMs: 5, capMs: 10 } },
      outbox: { retries: 0, backoff: { baseMs: 5, capMs: 10 }, rateLimit: { perChat: false, global: false } },
    },
  });
  cleanups.push(() => safe.stop());
  const seenByHandler: unknown[] = [];
  const reported: unknown[] = [];
  const dead: string[] = [];
  safe.on("error", (e) => reported.push(e));
  safe.on("durability:dead", (d) => dead.push(d.error));
  bot.on("text", async (ctx) => {
    // Journaled: dead at once (no retries), answered as a failure.
    await ctx.reply("hello").catch((e: unknown) => seenByHandler.push(e));
    // Passed through: Telegraf's own FetchError reaches the handler as it is (user code owns it), and is let through.
    await ctx.telegram.editMessageText(7, 1, undefined, "edited").catch((e: unknown) => {
      seenByHandler.push(e);
      throw e;
    });
  });
  await safe.start();
  await bot.handleUpdate({ update_id: 1, message: { message_id: 1, date: 0, chat: { id: 7, type: "private", first_name: "A" }, from: { id: 7, is_bot: false, first_name: "A" }, text: "hi" } } as never);
  await safe.idle();
  const outbox = await safe.durability.outbox.list();
  expect(outbox.map((e) => e.state)).toEqual(["dead"]);
  expect(outbox[0]!.error).toMatch(/^FetchError: request to https:\/\/api\.telegram\.org\/bot<token>\/sendMessage failed/);
  const inbox = await safe.durability.inbox.list();
  expect(inbox.map((r) => r.state)).toEqual(["dead"]);
  expect(inbox[0]!.error).toMatch(/^FetchError: request to https:\/\/api\.telegram\.org\/bot<token>\/editMessageText failed/);
  expect(dead.length).toBe(2);
  expect(reported.length).toBeGreaterThan(0);
  for (const text of [JSON.stringify(outbox), JSON.stringify(inbox), ...dead, ...reported.map((e) => `${(e as Error).message} ${(e as Error).stack}`)]) {
    expect(text).not.toContain(SECRET);
  }
  // The journaled call's answer (a TelegramError made from the journal) has no token either; the
  // passed-through call's error is Telegraf's own.
  expect(seenByHandler.length).toBe(2);
  expect(String((seenByHandler[0] as Error).message)).not.toContain(SECRET);
  expect(String((seenByHandler[1] as Error).message)).toContain(SECRET);
});

test("grammY: an error the middleware lets through (BotError quotes its message) is journaled and reported without the token", async () => {
  const bot = new GrammyBot(TOKEN, { botInfo: { id: 123456789, is_bot: true, first_name: "Fake", username: "fake_bot" } as never });
  const safe = durableGrammy(bot, {
    durability: { backend: new MemoryDurability(), instanceId: "redaction-grammy-mw", inbox: { retries: 0, backoff: { baseMs: 5, capMs: 10 } } },
  });
  cleanups.push(() => safe.stop());
  const reported: unknown[] = [];
  const dead: string[] = [];
  safe.on("error", (e) => reported.push(e));
  safe.on("durability:dead", (d) => dead.push(d.error));
  bot.on("message:text", () => {
    throw Object.assign(new Error("Network request for 'editMessageText' failed!"), { name: "HttpError", error: fetchError("editMessageText") });
  });
  await safe.start();
  await bot.handleUpdate({ update_id: 3, message: { message_id: 3, date: 0, chat: { id: 9, type: "private", first_name: "C" }, from: { id: 9, is_bot: false, first_name: "C" }, text: "hi" } } as never);
  await safe.idle();
  const inbox = await safe.durability.inbox.list();
  expect(inbox.map((r) => r.state)).toEqual(["dead"]);
  expect(inbox[0]!.error).toStartWith("BotError: HttpError in middleware: Network request for 'editMessageText' failed!");
  expect(inbox[0]!.error).toContain("Caused by: HttpError");
  expect(inbox[0]!.error).toContain("Caused by: FetchError: request to https://api.telegram.org/bot<token>/editMessageText failed");
  expect(dead.length).toBe(1);
  expect(reported.length).toBeGreaterThan(0);
  for (const text of [JSON.stringify(inbox), ...dead, ...reported.map((e) => `${(e as Error).message} ${(e as Error).stack}`)]) {
    expect(text).not.toContain(SECRET);
  }
});

test("an error the middleware lets through without the token keeps its identity", async () => {
  const bot = telegrafWith(() => Promise.resolve(true));
  const safe = durableTelegraf(bot, {
    durability: { backend: new MemoryDurability(), instanceId: "redaction-identity", inbox: { retries: 0, backoff: { baseMs: 5, capMs: 10 } } },
  });
  cleanups.push(() => safe.stop());
  const mine = new RangeError("nothing secret");
  const reported: unknown[] = [];
  safe.on("error", (e) => reported.push(e));
  bot.on("text", () => {
    throw mine;
  });
  await safe.start();
  await bot.handleUpdate({ update_id: 2, message: { message_id: 2, date: 0, chat: { id: 8, type: "private", first_name: "B" }, from: { id: 8, is_bot: false, first_name: "B" }, text: "hi" } } as never);
  await safe.idle();
  expect(reported).toContain(mine);
});

test("grammY's call content keeps an own __proto__ key as an own key", async () => {
  const payload = JSON.parse('{"chat_id": 5, "text": "x", "reply_markup": {"__proto__": {"polluted": true}, "inline_keyboard": []}}') as Record<string, unknown>;
  const content = callContent("sendMessage", payload);
  const markup = content.reply_markup as Record<string, unknown>;
  expect(Object.getPrototypeOf(markup)).toBe(Object.prototype);
  expect(Object.hasOwn(markup, "__proto__")).toBe(true);
  expect(JSON.stringify(content)).toContain('"__proto__":{"polluted":true}');
});

test("Telegraf's copy of an outbox call's payload keeps an own __proto__ key as an own key", async () => {
  const payload = JSON.parse('{"chat_id": 5, "text": "x", "reply_markup": {"__proto__": {"polluted": true}, "inline_keyboard": []}}') as Record<string, unknown>;
  // Telegraf: the provider's call copies the payload (Buffers for binary) before Telegraf sends it.
  const sent: unknown[] = [];
  const bot = telegrafWith((_method, p) => {
    sent.push(p);
    return Promise.resolve({ message_id: 1, chat: { id: 5 } });
  });
  const safe = durableTelegraf(bot, { durability: { backend: new MemoryDurability(), instanceId: "redaction-proto" } });
  cleanups.push(() => safe.stop());
  await safe.start();
  await safe.core.send("5", { ...payload, method: "sendMessage" } as never);
  await safe.idle();
  expect(sent.length).toBe(1);
  const got = (sent[0] as Record<string, unknown>).reply_markup as Record<string, unknown>;
  expect(Object.getPrototypeOf(got)).toBe(Object.prototype);
  expect(Object.hasOwn(got, "__proto__")).toBe(true);
});
