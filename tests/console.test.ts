// The web DLQ console, in process: handler(new Request(...)) over a Bot on the
// memory backend and on SQLite (a temp file), and over a bare backend.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { createServer } from "node:http";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot } from "../src/bot.ts";
import { MemoryDurability } from "../backends/memory/durability.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import type { DurabilityBackend } from "../src/contract.ts";
import { ProviderError } from "../src/errors.ts";
import { MockProvider } from "../src/testing/mock_provider.ts";
import { basicAuth, type ConsoleHandler, durabilityConsole, nodeHandler } from "../src/ops/console.ts";
import { escapeHtml } from "../src/ops/html.ts";
import { errorDetails, relativeTime } from "../src/ops/console_render.ts";

const dir = join(tmpdir(), `botmesh-console-tests-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const XSS_A = "<script>alert(1)</script>";
const XSS_B = `"'><img src=x onerror=alert(1)>`;
const XSS = `${XSS_A}${XSS_B}`;
const AUTH = { authorization: `Basic ${btoa("ops:correct horse")}` };
const BASE = "http://console.test";

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

async function until(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 5_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(10);
  }
}

interface Fixture {
  bot: Bot;
  provider: MockProvider;
  backend: DurabilityBackend;
  handler: ConsoleHandler;
  handlerRuns: string[];
  deadInboundId: string;
  deadKey: string;
  xssKey: string;
}

const BACKENDS: { name: string; make: () => DurabilityBackend }[] = [
  { name: "memory", make: () => new MemoryDurability() },
  { name: "sqlite", make: () => new SQLiteDurability({ file: join(dir, `${crypto.randomUUID()}.db`) }) },
];

/** A bot with one dead inbound record (handler throws) and two dead sends (permanent provider errors). */
async function fixture(make: () => DurabilityBackend): Promise<Fixture> {
  const provider = new MockProvider();
  const backend = make();
  const bot = new Bot({
    provider,
    durability: { backend, instanceId: "console-test", inbox: { retries: 0 }, outbox: { retries: 0 } },
  });
  bot.on("error", () => {});
  const handlerRuns: string[] = [];
  bot.when(/boom/, (ctx) => {
    handlerRuns.push(ctx.inboundId);
    throw new Error(`handler failed ${XSS}`);
  });
  bot.when(/hello/, (ctx) => ctx.reply("hi"));
  await bot.start();
  const deadInboundId = `in-${XSS}`;
  await provider.receive({ id: deadInboundId, chatId: `chat-${XSS}`, text: `boom ${XSS}` });
  await provider.receive({ id: "in-ok", chatId: "c1", text: "hello" });
  await bot.idle();
  provider.failNext(1, new ProviderError("Recipient blocked the bot", { retryable: false, status: 403 }));
  const dead = await bot.send("c2", { text: "important" } as never, { idempotencyKey: "dead-send-1" });
  expect(dead.state).toBe("dead");
  provider.failNext(1, new ProviderError(`rejected ${XSS}`, { retryable: false }));
  const xss = await bot.send(`chat-${XSS}`, `payload ${XSS}`, { idempotencyKey: `key-${XSS}` });
  expect(xss.state).toBe("dead");
  await bot.idle();
  const handler = durabilityConsole(bot, { auth: basicAuth("ops", "correct horse") });
  return { bot, provider, backend, handler, handlerRuns, deadInboundId, deadKey: "dead-send-1", xssKey: `key-${XSS}` };
}

function get(handler: ConsoleHandler, path: string, headers: Record<string, string> = AUTH): Promise<Response> {
  return handler(new Request(`${BASE}${path}`, { headers }));
}

function post(
  handler: ConsoleHandler,
  path: string,
  body: string,
  headers: Record<string, string> = AUTH,
): Promise<Response> {
  return handler(
    new Request(`${BASE}${path}`, {
      method: "POST",
      headers: { "content-type": "application/x-www-form-urlencoded", ...headers },
      body,
    }),
  );
}

const unescape = (s: string): string =>
  s.replace(/&quot;/g, '"').replace(/&#39;/g, "'").replace(/&lt;/g, "<").replace(/&gt;/g, ">").replace(/&#96;/g, "`")
    .replace(/&amp;/g, "&");

/** Open a confirmation page and return its form's action and CSRF token. */
async function confirmation(handler: ConsoleHandler, path: string): Promise<{ action: string; token: string }> {
  const res = await get(handler, path);
  expect(res.status).toBe(200);
  const text = await res.text();
  const action = /<form method="post" action="([^"]+)"/.exec(text)?.[1];
  const token = /name="csrf" value="([^"]+)"/.exec(text)?.[1];
  expect(action).toBeDefined();
  expect(token).toBeDefined();
  return { action: unescape(action!), token: unescape(token!) };
}

async function snapshot(f: Fixture): Promise<string> {
  const d = f.bot.durability!;
  const inbox = await d.inbox.list({ limit: 10_000 });
  const outbox = await d.outbox.list({ limit: 10_000 });
  return JSON.stringify({ inbox, outbox, sent: f.provider.sent.length, calls: f.provider.calls.length, m: d.metrics() });
}

const enc = encodeURIComponent;

for (const { name, make } of BACKENDS) {
  describe(`console on a Bot with ${name}`, () => {
    test("overview counts per state, and says where counts stop", async () => {
      const f = await fixture(make);
      try {
        const res = await get(f.handler, "/");
        expect(res.status).toBe(200);
        expect(res.headers.get("content-type")).toBe("text/html; charset=utf-8");
        const text = await res.text();
        expect(text).toContain(`<a href="/inbound?state=dead">1</a>`);
        expect(text).toContain(`<a href="/inbound?state=done">1</a>`);
        expect(text).toContain(`<a href="/outbound?state=dead">2</a>`);
        expect(text).toContain(`<a href="/outbound?state=sent">1</a>`);
        expect(text).toContain("Counts stop at 1000");
        expect(text).toContain("Signed in as ops");
        // This process's rate limits: nothing waits, nothing was throttled (the mock has no limits).
        expect(text).toContain(`<td class="num" id="outbox-waiting-for-limit">0</td>`);
        expect(text).toContain(`<td class="num" id="outbox-throttled">0</td>`);
      } finally {
        await f.bot.stop();
      }
    });

    test("lists per journal and state, with chat filter and limit", async () => {
      const f = await fixture(make);
      try {
        const inDead = await (await get(f.handler, "/inbound?state=dead")).text();
        expect(inDead).toContain(escapeHtml(`/inbound/record?id=${enc(f.deadInboundId)}`));
        expect(inDead).not.toContain("in-ok");
        const outDead = await (await get(f.handler, "/outbound?state=dead")).text();
        expect(outDead).toContain(`/outbound/record?id=${enc(f.deadKey)}`);
        expect(outDead).toContain("ProviderError: Recipient blocked the bot");
        const byChat = await (await get(f.handler, "/outbound?state=dead&chat=c2")).text();
        expect(byChat).toContain("dead-send-1");
        expect(byChat).not.toContain(enc(f.xssKey));
        const all = await (await get(f.handler, "/outbound?limit=1")).text();
        expect(all).toContain("Records 1–1 of 3 matching every state");
        expect(all).toMatch(/href="\/outbound\?limit=1&amp;after=\d+\.[^"]+">Next page<\/a>/);
        const none = await (await get(f.handler, "/inbound?state=pending")).text();
        expect(none).toContain("No records.");
      } finally {
        await f.bot.stop();
      }
    });

    test("a record shows payload, attempts, error, lease, fencing token and times", async () => {
      const f = await fixture(make);
      try {
        const out = await (await get(f.handler, `/outbound/record?id=${enc(f.deadKey)}`)).text();
        expect(out).toContain("<h1>Outbound entry</h1>");
        expect(out).toContain(escapeHtml(JSON.stringify({ text: "important" }, null, 2)));
        expect(out).toContain("<tr><th>Attempts</th><td>1</td></tr>");
        expect(out).toContain("<tr><th>Fencing token (last issued)</th><td>1</td></tr>");
        expect(out).toContain("<tr><th>Lease</th><td>none</td></tr>");
        expect(out).toMatch(/<tr><th>Created<\/th><td><time datetime="(\d{4}-\d\d-\d\dT[^"]+)" title="\1">(just now|\d+ s ago)<\/time>/);
        expect(out).toContain(`href="/outbound/retry?id=dead-send-1">Retry…</a>`);
        expect(out).toContain(`href="/outbound/discard?id=dead-send-1">Discard…</a>`);
        const inb = await (await get(f.handler, `/inbound/record?id=${enc(f.deadInboundId)}`)).text();
        expect(inb).toContain("<h1>Inbound record</h1>");
        expect(inb).toContain(`href="${escapeHtml(`/inbound/replay?id=${enc(f.deadInboundId)}`)}">Replay…</a>`);
        expect(inb).toContain("<tr><th>Provider</th><td>mock</td></tr>");
        const missing = await get(f.handler, "/outbound/record?id=nope");
        expect(missing.status).toBe(404);
        expect(await missing.text()).toContain("No outbound entry with key &quot;nope&quot;");
      } finally {
        await f.bot.stop();
      }
    });

    test("retry of a dead send via the confirmation page and a POST with the CSRF token delivers it", async () => {
      const f = await fixture(make);
      try {
        const before = f.provider.sent.length;
        const { action, token } = await confirmation(f.handler, `/outbound/retry?id=${enc(f.deadKey)}`);
        expect(action).toBe(`/outbound/retry?id=${enc(f.deadKey)}`);
        expect(f.provider.sent.length).toBe(before); // the confirmation page changed nothing
        const res = await post(f.handler, action, `csrf=${enc(token)}`);
        expect(res.status).toBe(303);
        expect(res.headers.get("location")).toBe(`/outbound/record?id=${enc(f.deadKey)}&notice=retry`);
        await until("the retried send", () => f.provider.sent.length === before + 1);
        expect(f.provider.sent.at(-1)!.idempotencyKey).toBe(f.deadKey);
        await until("state sent", async () => (await f.bot.durability!.outbox.get(f.deadKey))?.state === "sent");
        const page = await (await get(f.handler, res.headers.get("location")!)).text();
        expect(page).toContain("Retried: the send is queued again.");
        expect(page).toContain(`<span class="state state-sent">sent</span>`);
        // The same token again: the entry is sent now, so nothing happens (409).
        const again = await post(f.handler, action, `csrf=${enc(token)}`);
        expect(again.status).toBe(409);
        expect(f.provider.sent.length).toBe(before + 1);
      } finally {
        await f.bot.stop();
      }
    });

    test("replay of a dead inbound record runs the handler again (through bot.durability: metrics count it)", async () => {
      const f = await fixture(make);
      try {
        expect(f.handlerRuns).toEqual([f.deadInboundId]);
        const { action, token } = await confirmation(f.handler, `/inbound/replay?id=${enc(f.deadInboundId)}`);
        const res = await post(f.handler, action, `csrf=${enc(token)}`);
        expect(res.status).toBe(303);
        await until("the replayed handler", () => f.handlerRuns.length === 2);
        expect(f.bot.durability!.metrics().inboundReplayed).toBe(1);
        await f.bot.idle();
      } finally {
        await f.bot.stop();
      }
    });

    test("discard deletes a dead send and redirects to the list", async () => {
      const f = await fixture(make);
      try {
        const { action, token } = await confirmation(f.handler, `/outbound/discard?id=${enc(f.deadKey)}`);
        const res = await post(f.handler, action, `csrf=${enc(token)}`);
        expect(res.status).toBe(303);
        expect(res.headers.get("location")).toBe(`/outbound?state=dead&notice=discard`);
        expect(await f.bot.durability!.outbox.get(f.deadKey)).toBeNull();
        expect(await (await get(f.handler, res.headers.get("location")!)).text()).toContain("Discarded.");
      } finally {
        await f.bot.stop();
      }
    });

    test("a POST without, with a wrong, or with another record's or action's token is 403 and changes nothing", async () => {
      const f = await fixture(make);
      try {
        const before = await snapshot(f);
        const path = `/outbound/retry?id=${enc(f.deadKey)}`;
        const { token } = await confirmation(f.handler, path);
        const other = await confirmation(f.handler, `/outbound/retry?id=${enc(f.xssKey)}`);
        const discard = await confirmation(f.handler, `/outbound/discard?id=${enc(f.deadKey)}`);
        const [ts, mac] = token.split(".");
        const forged = `${ts}.${mac!.slice(0, -1)}${mac!.endsWith("A") ? "B" : "A"}`;
        const bodies = ["", "csrf=", "csrf=garbage", `csrf=${enc(forged)}`, `csrf=${enc(other.token)}`, `csrf=${enc(discard.token)}`];
        for (const body of bodies) {
          const res = await post(f.handler, path, body);
          expect(res.status).toBe(403);
          expect(await res.text()).toContain("Nothing was changed.");
        }
        // A cross-site form post is refused even with a valid token.
        const cross = await post(f.handler, path, `csrf=${enc(token)}`, { ...AUTH, "sec-fetch-site": "cross-site" });
        expect(cross.status).toBe(403);
        // Not a form: 415.
        const json = await f.handler(new Request(`${BASE}${path}`, {
          method: "POST",
          headers: { ...AUTH, "content-type": "application/json" },
          body: JSON.stringify({ csrf: token }),
        }));
        expect(json.status).toBe(415);
        await sleep(50);
        expect(await snapshot(f)).toBe(before);
      } finally {
        await f.bot.stop();
      }
    });

    test("unauthenticated GET and POST are 401 (with a Basic challenge) and change nothing", async () => {
      const f = await fixture(make);
      try {
        const before = await snapshot(f);
        const path = `/outbound/retry?id=${enc(f.deadKey)}`;
        const { token } = await confirmation(f.handler, path);
        const wrong = { authorization: `Basic ${btoa("ops:wrong")}` };
        const cases: [string, Record<string, string>][] = [
          ["none", {}],
          ["wrong password", wrong],
          ["wrong user", { authorization: `Basic ${btoa("admin:correct horse")}` }],
          ["garbage", { authorization: "Basic !!!" }],
          ["bearer", { authorization: "Bearer x" }],
        ];
        for (const [, headers] of cases) {
          for (const p of ["/", "/outbound?state=dead", `/outbound/record?id=${enc(f.deadKey)}`, path, "/no-such-page"]) {
            const res = await get(f.handler, p, headers);
            expect(res.status).toBe(401);
            expect(res.headers.get("www-authenticate")).toBe(`Basic realm="Durability console", charset="UTF-8"`);
            const text = await res.text();
            expect(text).not.toContain("dead-send-1");
          }
          const res = await post(f.handler, path, `csrf=${enc(token)}`, headers);
          expect(res.status).toBe(401);
        }
        await sleep(50);
        expect(await snapshot(f)).toBe(before);
      } finally {
        await f.bot.stop();
      }
    });

    test("XSS: payloads, chat ids, keys and errors are rendered escaped", async () => {
      const f = await fixture(make);
      try {
        const pages = [
          "/inbound?state=dead",
          "/outbound?state=dead",
          `/inbound/record?id=${enc(f.deadInboundId)}`,
          `/outbound/record?id=${enc(f.xssKey)}`,
          `/outbound/retry?id=${enc(f.xssKey)}`,
          `/inbound/replay?id=${enc(f.deadInboundId)}`,
          `/outbound?chat=${enc(XSS)}`,
          `/outbound/record?id=${enc(`missing ${XSS}`)}`,
          `/inbound?state=${enc(XSS)}`,
          `/outbound?error=${enc(XSS)}`,
          `/outbound/bulk/retry?state=dead&error=${enc(XSS)}`,
          `/outbound/bulk/discard?chat=${enc(`chat-${XSS}`)}`,
        ];
        for (const p of pages) {
          const text = await (await get(f.handler, p)).text();
          expect(text).not.toContain(XSS_A);
          expect(text).not.toContain(XSS_B);
          expect(text).not.toContain("<img");
          expect(text).not.toContain("<script");
          expect(text).toContain(escapeHtml(XSS_A));
          expect(text).toContain(escapeHtml(XSS_B));
        }
        const list = await (await get(f.handler, "/outbound?state=dead")).text();
        expect(list).toContain(`href="${escapeHtml(`/outbound/record?id=${enc(f.xssKey)}`)}"`);
        expect(list).toContain(`<td data-label="Chat" class="id">${escapeHtml(`chat-${XSS}`)}</td>`);
        expect(list).toContain(escapeHtml(`ProviderError: rejected ${XSS}`));
        const record = await (await get(f.handler, `/inbound/record?id=${enc(f.deadInboundId)}`)).text();
        expect(record).toContain(escapeHtml(`"text": ${JSON.stringify(`boom ${XSS}`)}`));
        // The retry through the confirmation works for a key full of markup, too.
        const before = f.provider.sent.length;
        const { action, token } = await confirmation(f.handler, `/outbound/retry?id=${enc(f.xssKey)}`);
        expect((await post(f.handler, action, `csrf=${enc(token)}`)).status).toBe(303);
        await until("the retried send", () => f.provider.sent.length === before + 1);
        expect(f.provider.sent.at(-1)!.chatId).toBe(`chat-${XSS}`);
      } finally {
        await f.bot.stop();
      }
    });

    test("GET never mutates: every view and confirmation page, even with the method-override tricks", async () => {
      const f = await fixture(make);
      try {
        const before = await snapshot(f);
        const paths = [
          "/",
          "/inbound",
          "/outbound",
          "/inbound?state=dead",
          "/outbound?state=dead&limit=1",
          `/inbound/record?id=${enc(f.deadInboundId)}`,
          `/outbound/record?id=${enc(f.deadKey)}`,
          `/inbound/replay?id=${enc(f.deadInboundId)}`,
          `/outbound/retry?id=${enc(f.deadKey)}`,
          `/outbound/discard?id=${enc(f.deadKey)}`,
          `/outbound/retry?id=${enc(f.deadKey)}&csrf=x&_method=POST`,
          "/outbound/bulk/retry?state=dead",
          "/outbound/bulk/discard",
          "/inbound/bulk/replay?state=dead",
          "/outbound?state=dead&error=blocked&older=1s&refresh=10",
        ];
        for (const p of paths) {
          expect((await get(f.handler, p)).status).toBe(200);
          const head = await f.handler(new Request(`${BASE}${p}`, { method: "HEAD", headers: AUTH }));
          expect(head.status).toBe(200);
          expect(await head.text()).toBe("");
        }
        await sleep(50);
        expect(await snapshot(f)).toBe(before);
      } finally {
        await f.bot.stop();
      }
    });
  });
}

describe("console: unreadable messages", () => {
  test("a message the provider could not parse is in the inbound DLQ with its reason and the raw payload", async () => {
    const provider = new MockProvider();
    const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "console-unreadable" } });
    bot.on("error", () => {});
    await bot.start();
    try {
      const raw = { object: "whatsapp_business_account", entry: [{ changes: [{ value: { messages: [{ id: "wamid.U1", from: "" }] } }] }] };
      await provider.receive({ id: "wamid.U1", chatId: "wa:123:unreadable", type: "unreadable", unreadable: `Message field "from" is empty`, extra: { raw } });
      await bot.idle();
      const handler = durabilityConsole(bot, { auth: basicAuth("ops", "pw") });
      const auth = { authorization: `Basic ${btoa("ops:pw")}` };
      const list = await (await get(handler, "/inbound?state=dead", auth)).text();
      expect(list).toContain("wamid.U1");
      expect(unescape(list)).toContain(`Message field "from" is empty`);
      const record = unescape(await (await get(handler, `/inbound/record?id=${encodeURIComponent("wamid.U1")}`, auth)).text());
      expect(record).toContain(`"object": "whatsapp_business_account"`);
      expect(record).toContain(`Message field "from" is empty`);
    } finally {
      await bot.stop();
    }
  });
});

describe("console: protocol, options and adapters", () => {
  let shared: Fixture | undefined;
  const f = async (): Promise<Fixture> => (shared ??= await fixture(BACKENDS[0]!.make));
  afterAll(async () => {
    await shared?.bot.stop();
  });

  test("security headers on every response (200, 303, 400, 401, 403, 404, 405)", async () => {
    const own = await fixture(BACKENDS[0]!.make);
    const { handler, deadKey, xssKey } = own;
    const { action, token } = await confirmation(handler, `/outbound/discard?id=${enc(xssKey)}`);
    const responses = [
      await get(handler, "/"),
      await get(handler, "/inbound?state=bogus"),
      await get(handler, "/", {}),
      await post(handler, `/outbound/retry?id=${enc(deadKey)}`, "csrf=x"),
      await get(handler, "/nope"),
      await post(handler, "/", ""),
      await post(handler, action, `csrf=${enc(token)}`),
    ];
    await own.bot.stop();
    expect(responses.map((r) => r.status)).toEqual([200, 400, 401, 403, 404, 405, 303]);
    for (const r of responses) {
      expect(r.headers.get("content-security-policy")).toBe(
        "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'",
      );
      expect(r.headers.get("x-frame-options")).toBe("DENY");
      expect(r.headers.get("referrer-policy")).toBe("no-referrer");
      expect(r.headers.get("cache-control")).toBe("no-store");
      expect(r.headers.get("x-content-type-options")).toBe("nosniff");
    }
  });

  test("wrong method → 405 with Allow; unknown paths → 404", async () => {
    const { handler } = await f();
    for (const [method, path, allow] of [
      ["POST", "/", "GET, HEAD"],
      ["DELETE", "/outbound", "GET, HEAD"],
      ["PUT", "/outbound/record?id=x", "GET, HEAD"],
      ["DELETE", "/outbound/retry?id=x", "GET, HEAD, POST"],
      ["PATCH", "/inbound/replay?id=x", "GET, HEAD, POST"],
    ] as const) {
      const res = await handler(new Request(`${BASE}${path}`, { method, headers: AUTH }));
      expect(res.status).toBe(405);
      expect(res.headers.get("allow")).toBe(allow);
    }
    for (const path of ["/nope", "/inbound/retry?id=x", "/outbound/replay?id=x", "/inbound/record/x", "/../etc/passwd"]) {
      expect((await get(handler, path)).status).toBe(404);
    }
  });

  test("bad input → 400 naming the parameter", async () => {
    const { handler } = await f();
    const cases: [string, string][] = [
      ["/inbound?state=sent", `Parameter &quot;state&quot; must be one of all, pending, processing, scheduled, failed, done, dead`],
      ["/outbound?state=done", `Parameter &quot;state&quot; must be one of all, queued, sending, failed, sent, dead, unknown`],
      ["/outbound?limit=0", `Parameter &quot;limit&quot; must be an integer from 1 to 1000; got &quot;0&quot;`],
      ["/outbound?limit=1001", `Parameter &quot;limit&quot;`],
      ["/outbound?limit=ten", `Parameter &quot;limit&quot;`],
      ["/outbound?limit=-5", `Parameter &quot;limit&quot;`],
      ["/outbound?limit=1.5", `Parameter &quot;limit&quot;`],
      ["/outbound/record", `Parameter &quot;id&quot; is required`],
      ["/inbound/record?id=", `Parameter &quot;id&quot; is required`],
      ["/outbound/retry", `Parameter &quot;id&quot; is required`],
      [`/outbound?chat=${"x".repeat(2000)}`, `Parameter &quot;chat&quot; is too long`],
    ];
    for (const [path, message] of cases) {
      const res = await get(handler, path);
      expect(res.status).toBe(400);
      expect(await res.text()).toContain(message);
    }
  });

  test("a confirmation page for a record in the wrong state is 409 and has no form", async () => {
    const { handler } = await f();
    const res = await get(handler, `/inbound/replay?id=in-ok`);
    expect(res.status).toBe(200); // done may be replayed
    const sent = (await shared!.bot.durability!.outbox.list({ state: "sent" }))[0]!;
    const retry = await get(handler, `/outbound/retry?id=${enc(sent.key)}`);
    expect(retry.status).toBe(409);
    const text = await retry.text();
    expect(text).toContain("The record is sent; retry needs one of: failed, dead, unknown.");
    expect(text).not.toContain("<form method=\"post\"");
    expect((await get(handler, `/outbound/retry?id=missing`)).status).toBe(404);
  });

  test("bidi and invisible characters of journal data show as \\u escapes; links and forms still carry the real id", async () => {
    // "in-\u202egnp.exe" would display as "in-exe.png": an operator would confirm an action on an id that reads as another.
    const backend = new MemoryDurability();
    const owner = { owner: "o", incarnation: "i", leaseMs: 60_000 };
    const id = "in-\u202egnp.exe";
    await backend.inbox.admit({ id, kind: "message", chatId: "42\u200b", provider: "mock", payload: { text: "x\u2067y\u200e" }, receivedAt: Date.now() });
    const claim = await backend.inbox.claim(id, owner);
    await backend.inbox.start(id, claim!.lease!.token, 1);
    await backend.inbox.fail(id, claim!.lease!.token, { error: "Error: \u202eevil\u061c", dead: true });
    const handler = durabilityConsole(backend, { auth: basicAuth("ops", "correct horse") });
    try {
      const shown = "in-\\u202egnp.exe";
      const pages = ["/inbound?state=dead", `/inbound/record?id=${enc(id)}`, `/inbound/replay?id=${enc(id)}`];
      for (const path of pages) {
        const res = await get(handler, path);
        expect(res.status).toBe(200);
        const text = await res.text();
        const raw = /[\p{Cf}\u2028\u2029]/u.exec(text);
        expect({ path, raw: raw ? text.slice(Math.max(0, raw.index - 40), raw.index + 10) : null }).toEqual({ path, raw: null });
        expect({ path, shown: text.includes(shown) }).toEqual({ path, shown: true });
      }
      const list = await (await get(handler, "/inbound?state=dead")).text();
      expect(list).toContain(`href="${escapeHtml(`/inbound/record?id=${enc(id)}`, true)}">${shown}</a>`);
      expect(list).toContain(`<td data-label="Chat" class="id">42\\u200b</td>`);
      const record = await (await get(handler, `/inbound/record?id=${enc(id)}`)).text();
      expect(record).toContain(`<title>Inbound ${shown} · `);
      expect(record).toContain(`<tr><th>Message</th><td>x\\u2067y\\u200e</td></tr>`);
      expect(record).toContain(escapeHtml(`"text": "x\\u2067y\\u200e"`));
      expect(record).toContain(`Error: \\u202eevil\\u061c`);
      // The confirmation's form acts on the record itself, not on the id as shown.
      const { action, token } = await confirmation(handler, `/inbound/replay?id=${enc(id)}`);
      expect(new URL(action, BASE).searchParams.get("id")).toBe(id);
      expect((await post(handler, action, `csrf=${enc(token)}`)).status).toBe(303);
      expect((await backend.inbox.get(id))?.state).toBe("pending");
      // In an attribute a format character is a character reference: the field keeps its value.
      const filtered = await (await get(handler, `/inbound?chat=${enc("42\u200b")}`)).text();
      expect(filtered).toContain(`name="chat" value="42&#x200b;"`);
      expect(escapeHtml("a\u202eb")).toBe("a\\u202eb");
      expect(escapeHtml("a\u202eb\u0085", true)).toBe("a&#x202e;b\u0085");
    } finally {
      await handler.close();
    }
  });

  test("tokens are bound to the user: another operator cannot use one", async () => {
    const { bot, deadKey } = await f();
    const users: Record<string, string> = { "token-a": "alice", "token-b": "bob" };
    const handler = durabilityConsole(bot, {
      auth: (request) => {
        const user = users[request.headers.get("x-token") ?? ""];
        return user ? { user } : null;
      },
      csrfSecret: "a shared secret of enough length",
    });
    const page = await (await handler(new Request(`${BASE}/outbound/retry?id=${enc(deadKey)}`, { headers: { "x-token": "token-a" } })))
      .text();
    const token = unescape(/name="csrf" value="([^"]+)"/.exec(page)![1]!);
    const asBob = await handler(new Request(`${BASE}/outbound/retry?id=${enc(deadKey)}`, {
      method: "POST",
      headers: { "x-token": "token-b", "content-type": "application/x-www-form-urlencoded" },
      body: `csrf=${enc(token)}`,
    }));
    expect(asBob.status).toBe(403);
    // A custom auth without a challenge: 401 without WWW-Authenticate.
    const anon = await handler(new Request(`${BASE}/`));
    expect(anon.status).toBe(401);
    expect(anon.headers.get("www-authenticate")).toBeNull();
    // With the same secret a second handler (another replica) accepts alice's token.
    const replica = durabilityConsole(bot, {
      auth: (request) => (request.headers.get("x-token") === "token-a" ? { user: "alice" } : null),
      csrfSecret: "a shared secret of enough length",
    });
    const ok = await replica(new Request(`${BASE}/outbound/retry?id=${enc(deadKey)}`, {
      method: "POST",
      headers: { "x-token": "token-a", "content-type": "application/x-www-form-urlencoded" },
      body: `csrf=${enc(token)}`,
    }));
    expect(ok.status).toBe(303);
    await until("delivery", async () => (await bot.durability!.outbox.get(deadKey))?.state === "sent");
  });

  test("an expired token is refused", async () => {
    const { bot, xssKey } = await f();
    const handler = durabilityConsole(bot, { auth: basicAuth("ops", "correct horse"), tokenMaxAgeMs: 1000 });
    const { action, token } = await confirmation(handler, `/outbound/discard?id=${enc(xssKey)}`);
    await sleep(1_100);
    const res = await post(handler, action, `csrf=${enc(token)}`);
    expect(res.status).toBe(403);
    expect(await res.text()).toContain("expired");
    expect(await bot.durability!.outbox.get(xssKey)).not.toBeNull();
  });

  test("an auth function that throws gives 500 without details; one returning junk gives 401", async () => {
    const { bot } = await f();
    const reported: unknown[] = [];
    const throwing = durabilityConsole(bot, {
      auth: () => {
        throw new Error("db password is hunter2");
      },
      onError: (error) => reported.push(error),
    });
    const res = await throwing(new Request(`${BASE}/`));
    expect(res.status).toBe(500);
    expect(await res.text()).not.toContain("hunter2");
    expect(reported.map((e) => (e as Error).message), "told to the operator's log, not the page").toEqual(["db password is hunter2"]);
    const junk = durabilityConsole(bot, { auth: () => ({ user: "" }) });
    expect((await junk(new Request(`${BASE}/`))).status).toBe(401);
  });

  test("construction: auth is required; bad options are named", () => {
    const bot = new Bot({ provider: new MockProvider(), durability: { backend: new MemoryDurability() } });
    expect(() => durabilityConsole(bot, {} as never)).toThrow(/Option "auth" is required/);
    expect(() => durabilityConsole(bot, undefined as never)).toThrow(/"auth" must be given/);
    expect(() => durabilityConsole(bot, { auth: "yes" } as never)).toThrow(/Option "auth" must be a function/);
    const auth = basicAuth("ops", "pw");
    expect(() => durabilityConsole(bot, { auth, basePath: "ops" })).toThrow(/Option "basePath"/);
    expect(() => durabilityConsole(bot, { auth, basePath: "/ops/" })).toThrow(/Option "basePath"/);
    expect(() => durabilityConsole(bot, { auth, csrfSecret: "short" })).toThrow(/Option "csrfSecret" must be at least 16 bytes/);
    expect(() => durabilityConsole(bot, { auth, countCap: 0 })).toThrow(/Option "countCap"/);
    expect(() => durabilityConsole(bot, { auth, colour: "red" } as never)).toThrow(/Unknown option "colour"/);
    expect(() => durabilityConsole(new Bot({ provider: new MockProvider() }), { auth })).toThrow(
      /Bot without durability/,
    );
    expect(() => durabilityConsole({} as never, { auth })).toThrow(/Argument "target"/);
    expect(() => basicAuth("", "pw")).toThrow(/Argument "user"/);
    expect(() => basicAuth("a:b", "pw")).toThrow(/Argument "user"/);
    expect(() => basicAuth("ops", "")).toThrow(/Argument "password"/);
  });

  test("a bare backend, a basePath and the count cap", async () => {
    const backend = new MemoryDurability();
    for (let i = 0; i < 4; i++) {
      await backend.outbox.reserve({ key: `k${i}`, chatId: "c", content: { i }, contentHash: "h", inboundId: null });
    }
    await backend.inbox.admit({ id: "i1", kind: "message", chatId: "c", provider: "p", payload: {}, receivedAt: Date.now() });
    const handler = durabilityConsole(backend, { auth: basicAuth("ops", "correct horse"), basePath: "/ops/dlq", countCap: 3, title: "My <ops>" });
    const overview = await get(handler, "/ops/dlq");
    expect(overview.status).toBe(200);
    const text = await overview.text();
    expect(text).toContain(`<a href="/ops/dlq/outbound?state=queued">3+</a>`);
    expect(text).toContain(`<a href="/ops/dlq/inbound?state=pending">1</a>`);
    expect(text).toContain("Counts stop at 3: a state with more records shows 3+.");
    expect(text).toContain("My &lt;ops&gt;");
    expect(text, "a bare backend has no process counters").not.toContain("outbox-waiting-for-limit");
    expect((await get(handler, "/ops/dlq/")).status).toBe(200);
    expect((await get(handler, "/")).status).toBe(404);
    expect((await get(handler, "/ops/dlqx")).status).toBe(404);
    expect((await get(handler, "/ops/outbound")).status).toBe(404);
    // Actions on a bare backend call the journals directly.
    const { action, token } = await confirmation(handler, `/ops/dlq/outbound/discard?id=k0`);
    expect(action).toBe("/ops/dlq/outbound/discard?id=k0");
    expect((await post(handler, action, `csrf=${enc(token)}`)).status).toBe(303);
    expect(await backend.outbox.get("k0")).toBeNull();
    // Keys with path and query characters round-trip through the percent-encoded links.
    const odd = "../a/b?c=d&e=%2F#f";
    await backend.outbox.reserve({ key: odd, chatId: "c", content: "x", contentHash: "h", inboundId: null });
    const list = await (await get(handler, "/ops/dlq/outbound?limit=1000")).text();
    const href = unescape(/href="([^"]*record\?id=\.\.[^"]*)"/.exec(list)![1]!);
    expect(href).toBe(`/ops/dlq/outbound/record?id=${enc(odd)}`);
    const oddPage = await get(handler, href);
    expect(oddPage.status).toBe(200);
    expect(await oddPage.text()).toContain(`<tr><th>Key</th><td><span class="id">${escapeHtml(odd)}</span></td></tr>`);
    const replay = await confirmation(handler, `/ops/dlq/inbound/replay?id=i1`).catch((e) => e);
    expect(replay).toBeInstanceOf(Error); // pending: no replay form (409)
  });

  test("nodeHandler serves the console through node:http", async () => {
    const { handler, deadKey, bot } = await f();
    const server = createServer(nodeHandler(handler));
    await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
    const { port } = server.address() as { port: number };
    try {
      const base = `http://127.0.0.1:${port}`;
      expect((await fetch(`${base}/`)).status).toBe(401);
      const page = await fetch(`${base}/outbound/discard?id=${enc(deadKey)}`, { headers: AUTH });
      expect(page.status).toBe(200);
      expect(page.headers.get("x-frame-options")).toBe("DENY");
      const token = unescape(/name="csrf" value="([^"]+)"/.exec(await page.text())![1]!);
      const done = await fetch(`${base}/outbound/discard?id=${enc(deadKey)}`, {
        method: "POST",
        redirect: "manual",
        headers: { ...AUTH, "content-type": "application/x-www-form-urlencoded" },
        body: `csrf=${enc(token)}`,
      });
      expect(done.status).toBe(303);
      expect(await bot.durability!.outbox.get(deadKey)).toBeNull();
      const big = await fetch(`${base}/outbound/discard?id=x`, {
        method: "POST",
        headers: { ...AUTH, "content-type": "application/x-www-form-urlencoded" },
        body: "x".repeat(2 * 1024 * 1024),
      });
      expect(big.status).toBe(413);
    } finally {
      await new Promise((resolve) => server.close(resolve));
    }
  }, 60_000);
});

describe("console: bulk actions, mark as delivered, pages, ages, refresh", () => {
  const auth = basicAuth("ops", "correct horse");

  /** A bot on memory with dead sends in two chats (two error texts) and one unknown send. */
  async function sends() {
    const provider = new MockProvider();
    const backend = new MemoryDurability();
    const bot = new Bot({ provider, durability: { backend, instanceId: "bulk-test", inbox: { retries: 0 }, outbox: { retries: 0 } } });
    bot.on("error", () => {});
    await bot.start();
    const dead = async (chatId: string, key: string, message: string) => {
      provider.failNext(1, new ProviderError(message, { retryable: false }));
      expect((await bot.send(chatId, `text of ${key}`, { idempotencyKey: key })).state).toBe("dead");
    };
    await dead("a", "a1", "Recipient blocked the bot");
    await dead("a", "a2", "Chat not found");
    await dead("b", "b1", "Recipient blocked the bot");
    provider.failNext(1, new ProviderError("timed out", { retryable: true, maybeDelivered: true }));
    await bot.send("b", "did it arrive?", { idempotencyKey: "maybe-1" }).catch(() => {});
    await bot.idle();
    expect((await backend.outbox.get("maybe-1"))?.state).toBe("unknown");
    const handler = durabilityConsole(bot, { auth });
    return { provider, backend, bot, handler };
  }

  async function bulkForm(handler: ConsoleHandler, path: string) {
    const res = await get(handler, path);
    expect(res.status).toBe(200);
    const text = await res.text();
    const fields = Object.fromEntries(
      [...text.matchAll(/<input type="hidden" name="([a-z]+)" value="([^"]*)">/g)].map((m) => [m[1]!, unescape(m[2]!)]),
    );
    const action = unescape(/<form method="post" action="([^"]+)"/.exec(text)![1]!);
    return { text, action, body: new URLSearchParams(fields).toString() };
  }

  test("retry all on a list filtered by state and error text: one confirmation with the count, then exactly those", async () => {
    const { provider, backend, bot, handler } = await sends();
    try {
      const list = await (await get(handler, "/outbound?state=dead&error=blocked")).text();
      expect(list).toContain("Records 1–2 of 2 matching state dead, error containing &quot;blocked&quot;");
      expect(list).toContain(`href="/outbound/bulk/retry?state=dead&amp;error=blocked">Retry all 2…</a>`);
      const before = provider.calls.length;
      const { text, action, body } = await bulkForm(handler, "/outbound/bulk/retry?state=dead&error=blocked");
      expect(text).toContain("<h1>Retry 2 sends?</h1>");
      expect(text).toContain("The list: state dead, error containing &quot;blocked&quot;. 2 records match.");
      expect(text).toContain("the provider is called again");
      expect(text).toContain(`<button class="button" type="submit">Yes, retry 2 sends</button>`);
      expect(provider.calls.length, "the confirmation page changed nothing").toBe(before);
      // A wrong token (the filter changed under it) is refused and changes nothing.
      const forged = await post(handler, "/outbound/bulk/retry?state=dead", body);
      expect(forged.status).toBe(403);
      expect(await forged.text()).toContain("Nothing was changed.");
      const res = await post(handler, action, body);
      expect(res.status).toBe(303);
      expect(res.headers.get("location")).toBe("/outbound?state=dead&error=blocked&notice=bulk-retry&n=2&left=0");
      await until("both sends", async () => (await backend.outbox.get("a1"))?.state === "sent" && (await backend.outbox.get("b1"))?.state === "sent");
      expect((await backend.outbox.get("a2"))?.state, "another error text: left alone").toBe("dead");
      expect(await (await get(handler, res.headers.get("location")!)).text()).toContain("Retried 2 sends.");
    } finally {
      await bot.stop();
    }
  }, 60_000);

  test("a bulk action leaves alone what changed after its confirmation, and says how many", async () => {
    const { backend, bot, handler } = await sends();
    try {
      const { action, body } = await bulkForm(handler, "/outbound/bulk/discard?chat=a");
      // Counted: a1 and a2 (dead, discard applies). One is retried meanwhile, then sent: it changed.
      await sleep(5); // a change in a later millisecond than the confirmation's newest
      expect(await bot.durability!.retrySend("a1")).toBe(true);
      await until("a1 sent", async () => (await backend.outbox.get("a1"))?.state === "sent");
      const res = await post(handler, action, body);
      expect(res.headers.get("location")).toBe("/outbound?chat=a&notice=bulk-discard&n=1&left=1");
      expect(await backend.outbox.get("a2")).toBeNull();
      expect((await backend.outbox.get("a1"))?.state, "changed after the confirmation: kept").toBe("sent");
      expect(await (await get(handler, res.headers.get("location")!)).text()).toContain(
        "Discarded 1 send. 1 had changed since the confirmation (or changed meanwhile) and was left alone.",
      );
    } finally {
      await bot.stop();
    }
  }, 60_000);

  test("replay all by age: records newer than the cut-off are not counted; nothing to do says so without a form", async () => {
    const provider = new MockProvider();
    const backend = new MemoryDurability();
    const runs: string[] = [];
    const bot = new Bot({ provider, durability: { backend, instanceId: "age-test", inbox: { retries: 0 } } });
    bot.on("error", () => {});
    bot.when(/boom/, (ctx) => {
      runs.push(ctx.inboundId);
      throw new Error("handler failed");
    });
    await bot.start();
    try {
      await provider.receive({ id: "m1", chatId: "c", text: "boom 1" });
      await provider.receive({ id: "m2", chatId: "c", text: "boom 2" });
      await bot.idle();
      const handler = durabilityConsole(bot, { auth });
      const none = await (await get(handler, "/inbound/bulk/replay?state=dead&older=1h")).text();
      expect(none).toContain("<h1>Nothing to replay</h1>");
      expect(none).not.toContain("<form");
      const bad = await get(handler, "/inbound?older=soon");
      expect(bad.status).toBe(400);
      expect(await bad.text()).toContain("Parameter &quot;older&quot; must be a duration like 30m, 2h or 7d");
      const { text, action, body } = await bulkForm(handler, "/inbound/bulk/replay?state=dead&newer=1h");
      expect(text).toContain("<h1>Replay 2 records?</h1>");
      expect((await post(handler, action, body)).status).toBe(303);
      await until("both replayed", () => runs.length === 4);
      expect(bot.durability!.metrics().inboundReplayed).toBe(2);
      await bot.idle();
    } finally {
      await bot.stop();
    }
  }, 60_000);

  test("mark as delivered: an unknown send becomes sent without a new call; its old error stays, shown as before it was sent", async () => {
    const { provider, backend, bot, handler } = await sends();
    try {
      const resolved: unknown[] = [];
      bot.on("durability:resolved", (e) => resolved.push(e));
      const record = await (await get(handler, "/outbound/record?id=maybe-1")).text();
      expect(record).toContain(`href="/outbound/delivered?id=maybe-1">Mark as delivered…</a>`);
      expect(record).toContain(`<tr><th>Last error</th><td><div class="err">ProviderError: timed out</div></td></tr>`);
      const { action, token } = await confirmation(handler, "/outbound/delivered?id=maybe-1");
      const page = await (await get(handler, "/outbound/delivered?id=maybe-1")).text();
      expect(page).toContain("<h1>Mark this send as delivered?</h1>");
      expect(page).toContain(`<input name="messageId"`);
      const calls = provider.calls.length;
      const res = await post(handler, action, `csrf=${enc(token)}&messageId=wamid.42`);
      expect(res.status).toBe(303);
      expect(res.headers.get("location")).toBe("/outbound/record?id=maybe-1&notice=delivered");
      const entry = await backend.outbox.get("maybe-1");
      expect([entry?.state, entry?.messageId]).toEqual(["sent", "wamid.42"]);
      expect(resolved).toEqual([{ key: "maybe-1", chatId: "b", state: "sent", messageId: "wamid.42", via: "operator" }]);
      expect(bot.durability!.metrics().outboxResolved).toBe(1);
      await bot.idle();
      expect(provider.calls.length, "no new call").toBe(calls);
      const after = await (await get(handler, "/outbound/record?id=maybe-1&notice=delivered")).text();
      expect(after).toContain("Marked as delivered: the send is sent, and was not sent again.");
      expect(after).toContain(
        `<tr><th>Last error before it was sent</th><td><div class="past-err">ProviderError: timed out</div></td></tr>`,
      );
      expect(after).not.toContain(`class="err"`);
      // Not unknown any more: the confirmation is a 409 without a form, and the old token changes nothing.
      expect((await get(handler, "/outbound/delivered?id=maybe-1")).status).toBe(409);
      expect((await post(handler, action, `csrf=${enc(token)}`)).status).toBe(409);
      // In the list the old error of a sent entry is neutral too.
      const list = await (await get(handler, "/outbound?state=sent")).text();
      expect(list).toContain(`<span class="past-err">before it was sent: ProviderError: timed out</span>`);
    } finally {
      await bot.stop();
    }
  }, 60_000);

  test("mark as delivered on a bare backend: markSent under the entry's fence", async () => {
    const backend = new MemoryDurability();
    await backend.outbox.reserve(
      { key: "k", chatId: "c", content: "x", contentHash: "h", inboundId: null },
      { owner: "gone", incarnation: "i", leaseMs: 60_000 },
    );
    const entry = (await backend.outbox.get("k"))!;
    await backend.outbox.markFailed("k", entry.fence, { error: "Error: socket hang up", ambiguous: true });
    const handler = durabilityConsole(backend, { auth });
    const { action, token } = await confirmation(handler, "/outbound/delivered?id=k");
    expect((await post(handler, action, `csrf=${enc(token)}`)).status).toBe(303);
    const sent = await backend.outbox.get("k");
    expect([sent?.state, sent?.messageId, sent?.error]).toEqual(["sent", "", "Error: socket hang up"]);
    expect(await (await get(handler, "/outbound/record?id=k")).text()).toContain(
      "<tr><th>Provider message id</th><td>not known (marked as delivered by an operator)</td></tr>",
    );
  }, 60_000);

  test("pages by cursor: every record once, in order; a cursor whose record is gone goes on after it", async () => {
    const backend = new MemoryDurability();
    for (let i = 0; i < 7; i++) {
      await backend.outbox.reserve({ key: `k${i}`, chatId: "c", content: { text: `message number ${i}` }, contentHash: "h", inboundId: null });
    }
    const handler = durabilityConsole(backend, { auth });
    const seen: string[] = [];
    let path: string | null = "/outbound?limit=3";
    const notes: string[] = [];
    while (path !== null) {
      const text: string = await (await get(handler, path)).text();
      seen.push(...[...text.matchAll(/record\?id=(k\d)"/g)].map((m) => m[1]!));
      notes.push(/Records [^ ]+ of \d+/.exec(text)![0]);
      const next: RegExpExecArray | null = /href="([^"]+)">Next page<\/a>/.exec(text);
      path = next ? unescape(next[1]!) : null;
      if (seen.length > 3) expect(text).toContain(`href="/outbound?limit=3">First page</a>`);
    }
    expect(seen).toEqual(["k0", "k1", "k2", "k3", "k4", "k5", "k6"]);
    expect(notes).toEqual(["Records 1–3 of 7", "Records 4–6 of 7", "Records 7–7 of 7"]);
    // The page after k2, once k2 is gone.
    const first = await (await get(handler, "/outbound?limit=3")).text();
    const next = unescape(/href="([^"]+)">Next page<\/a>/.exec(first)![1]!);
    expect(await backend.outbox.discard("k2")).toBe(true);
    const after = await (await get(handler, next)).text();
    expect([...after.matchAll(/record\?id=(k\d)"/g)].map((m) => m[1])).toEqual(["k3", "k4", "k5"]);
    expect(first, "the message text is previewed").toContain(`<td data-label="Message" class="preview wide">message number 0</td>`);
    expect((await get(handler, "/outbound?after=nonsense")).status).toBe(400);
  }, 60_000);

  test("a long list reads only up to its page (more exist, bulk links without a count); its pages still see every record once", async () => {
    const backend = new MemoryDurability();
    const keys = Array.from({ length: 130 }, (_, i) => `k${String(i).padStart(3, "0")}`);
    for (const key of keys) await backend.outbox.reserve({ key, chatId: "c", content: key, contentHash: "h", inboundId: null });
    const handler = durabilityConsole(backend, { auth });
    const seen: string[] = [];
    const notes: string[] = [];
    let path: string | null = "/outbound?limit=20";
    while (path !== null) {
      const text: string = await (await get(handler, path)).text();
      if (seen.length === 0) {
        expect(text).toContain(`href="/outbound/bulk/discard">Discard all…</a>`);
        expect(text).toContain("Records 1–20; more exist");
      }
      seen.push(...[...text.matchAll(/record\?id=(k\d+)"/g)].map((m) => m[1]!));
      notes.push(/Records [^ ]+(;| of \d+)/.exec(text)![0]);
      const next: RegExpExecArray | null = /href="([^"]+)">Next page<\/a>/.exec(text);
      path = next ? unescape(next[1]!) : null;
    }
    expect(seen).toEqual(keys);
    expect(notes.at(-1)).toBe("Records 121–130 of 130");
    const confirm = await (await get(handler, "/outbound/bulk/discard")).text();
    expect(confirm).toContain("<h1>Discard 130 sends?</h1>");
  }, 60_000);

  for (const [{ name, make }, step] of BACKENDS.flatMap((b) => [[b, 1], [b, 7]] as const)) {
    const admitted = step === 1 ? "in id order" : "out of id order";
    test(`${name}, admitted ${admitted}: a millisecond's inbound records page by id; a cursor whose record left the list hides none of the rest`, async () => {
      const backend = make();
      await backend.open?.();
      try {
        const at = Date.now() - 60_000;
        // The backend lists a millisecond's records in admission order, the console by id.
        const ids = Array.from({ length: 30 }, (_, i) => `r${String((i * step) % 30).padStart(2, "0")}`);
        for (const id of ids) {
          await backend.inbox.admit({ id, kind: "message", chatId: `c-${id}`, provider: "p", payload: { text: id }, receivedAt: at });
        }
        await backend.inbox.admit({ id: "a-later", kind: "message", chatId: "c", provider: "p", payload: { text: "later" }, receivedAt: at + 1 });
        const sorted = [...ids].sort();
        const handler = durabilityConsole(backend, { auth });
        const idsOf = (text: string) => [...text.matchAll(/record\?id=([^"&]+)"/g)].map((m) => m[1]!);
        const nextOf = (text: string) => {
          const next = /href="([^"]+)">Next page<\/a>/.exec(text);
          return next ? unescape(next[1]!) : null;
        };
        const walk = async (from: string) => {
          const seen: string[] = [];
          for (let path: string | null = from; path !== null;) {
            const text: string = await (await get(handler, path)).text();
            seen.push(...idsOf(text));
            path = nextOf(text);
          }
          return seen;
        };
        expect(await walk("/inbound?state=pending&limit=10")).toEqual([...sorted, "a-later"]);

        // The last record of page 1 is handled (it leaves the pending list) before "Next page" is followed.
        const first = await (await get(handler, "/inbound?state=pending&limit=10")).text();
        expect(idsOf(first)).toEqual(sorted.slice(0, 10));
        const next = nextOf(first)!;
        const lease = await backend.inbox.claim("r09", { owner: "o", incarnation: "i", leaseMs: 60_000 });
        await backend.inbox.complete("r09", lease!.lease!.token);
        expect(await walk(next)).toEqual([...sorted.slice(10), "a-later"]);

        // Records before the cursor's leave too: still none after it is hidden, none before it repeated.
        for (const id of ["r03", "r08"]) {
          const l = await backend.inbox.claim(id, { owner: "o", incarnation: "i", leaseMs: 60_000 });
          await backend.inbox.complete(id, l!.lease!.token);
        }
        expect(await walk(next)).toEqual([...sorted.slice(10), "a-later"]);
      } finally {
        await backend.close?.();
      }
    }, 60_000);
  }

  test("a list that reads only up to its page does not cut a millisecond's records: its pages still see every record once", async () => {
    const backend = new MemoryDurability();
    const at = Date.now() - 60_000;
    const ids = Array.from({ length: 150 }, (_, i) => `m${String(149 - i).padStart(3, "0")}`);
    for (const [i, id] of ids.entries()) {
      // 10 records in each of the first two milliseconds, then 130 in one (more than a page and its margin).
      const receivedAt = i < 10 ? at : i < 20 ? at + 1 : at + 2;
      await backend.inbox.admit({ id, kind: "message", chatId: "c", provider: "p", payload: { text: id }, receivedAt });
    }
    const expected = [...ids.slice(0, 10).sort(), ...ids.slice(10, 20).sort(), ...ids.slice(20).sort()];
    const handler = durabilityConsole(backend, { auth });
    const seen: string[] = [];
    for (let path: string | null = "/inbound?limit=7"; path !== null;) {
      const text: string = await (await get(handler, path)).text();
      seen.push(...[...text.matchAll(/record\?id=(m\d+)"/g)].map((m) => m[1]!));
      const next: RegExpExecArray | null = /href="([^"]+)">Next page<\/a>/.exec(text);
      path = next ? unescape(next[1]!) : null;
    }
    expect(seen).toEqual(expected);
  }, 60_000);

  test("the error filter matches the message and its causes, not the stack frames a handler's error carries", async () => {
    const provider = new MockProvider();
    const backend = new MemoryDurability();
    const bot = new Bot({ provider, durability: { backend, instanceId: "filter-test", inbox: { retries: 0 }, outbox: { retries: 0 } } });
    bot.on("error", () => {});
    bot.when(/quota/, () => {
      throw new Error("quota exceeded", { cause: new TypeError("socket closed by peer") });
    });
    await bot.start();
    try {
      await provider.receive({ id: "in-quota", chatId: "c1", text: "quota" });
      await bot.idle();
      const error = (await backend.inbox.get("in-quota"))!.error!;
      expect(error).toContain("\nCaused by: TypeError: socket closed by peer\n");
      expect(error, "the journal has the stack frames").toMatch(/\n {4}at .*console\.test\.ts/);
      const handler = durabilityConsole(bot, { auth });
      const matching = async (needle: string) => {
        const text = await (await get(handler, `/inbound?state=dead&error=${enc(needle)}`)).text();
        return [...text.matchAll(/record\?id=([^"&]+)"/g)].map((m) => m[1]);
      };
      expect(await matching("QUOTA")).toEqual(["in-quota"]);
      expect(await matching("socket closed")).toEqual(["in-quota"]);
      expect(await matching("Caused by")).toEqual(["in-quota"]);
      for (const frame of ["console.test", "console.test.ts:", "    at ", "at "]) expect([frame, await matching(frame)]).toEqual([frame, []]);
      // The record page shows the journaled causes and frames, and its note says the journal has them.
      const page = await (await get(handler, `/inbound/record?id=in-quota`)).text();
      expect(page).toContain("<li>caused by TypeError: socket closed by peer</li>");
      expect(page).toMatch(/<summary>Stack \(\d+ frames\)<\/summary>/);
      const note = /<p class="note">The journal keeps the last error[^<]*/.exec(page)?.[0] ?? "";
      expect(note).toContain("with its causes and the first 12 frames of its stack");
      expect(note).not.toMatch(/stacks (and causes )?go to/);
      const bulk = await (await get(handler, `/inbound/bulk/replay?state=dead&error=console.test`)).text();
      expect(bulk).not.toContain("in-quota");
      expect(await (await get(handler, `/inbound/bulk/replay?state=dead&error=quota`)).text()).toContain("<h1>Replay 1 record?</h1>");
    } finally {
      await bot.stop();
    }
  }, 60_000);

  test("relative ages with the exact time on hover; refresh by link or meta refresh, no script", async () => {
    expect(relativeTime(1_000_000, 1_000_000 + 2_000)).toBe("just now");
    expect(relativeTime(1_000_000, 1_000_000 + 42_000)).toBe("42 s ago");
    expect(relativeTime(1_000_000, 1_000_000 + 3 * 60_000 + 5_000)).toBe("3 min ago");
    expect(relativeTime(1_000_000, 1_000_000 + 5 * 3_600_000)).toBe("5 h ago");
    expect(relativeTime(1_000_000, 1_000_000 + 9 * 86_400_000)).toBe("9 d ago");
    expect(relativeTime(1_000_000 + 120_000, 1_000_000)).toBe("in 2 min");
    const backend = new MemoryDurability();
    const receivedAt = Date.now() - 3 * 60_000 - 10_000;
    await backend.inbox.admit({ id: "i1", kind: "message", chatId: "c", provider: "p", payload: { text: "hello there" }, receivedAt });
    const handler = durabilityConsole(backend, { auth });
    const list = await (await get(handler, "/inbound")).text();
    const exact = new Date(receivedAt).toISOString();
    expect(list).toContain(`<td data-label="Received"><time datetime="${exact}" title="${exact}">3 min ago</time></td>`);
    expect(list).toContain(`<a class="button secondary" href="/inbound">Refresh</a>`);
    expect(list).not.toContain(`http-equiv="refresh"`);
    const auto = await (await get(handler, "/inbound?refresh=30")).text();
    expect(auto).toContain(`<meta http-equiv="refresh" content="30">`);
    expect(auto).toContain(`<a href="/inbound">off</a>`);
    expect(auto).not.toContain("<script");
    expect((await get(handler, "/inbound?refresh=1")).status).toBe(400);
  }, 60_000);

  test("an error's cause chain and stack lines, when the journal has them, are shown apart", () => {
    const fragment = errorDetails("Error: outer\nCaused by: TypeError: inner\n    at f (x.ts:1:1)\n    at g (y.ts:2:2)", "err").html;
    expect(fragment).toContain(`<div class="err">Error: outer</div>`);
    expect(fragment).toContain(`<ol class="err"><li>caused by TypeError: inner</li></ol>`);
    expect(fragment).toContain("<summary>Stack (2 frames)</summary><pre>at f (x.ts:1:1)\nat g (y.ts:2:2)</pre>");
  }, 60_000);

  test("a backend that was not opened is opened by the console; one that cannot be opened is a 503 that says why, and logged", async () => {
    const backend = new SQLiteDurability({ file: join(dir, `${crypto.randomUUID()}.db`) });
    const handler = durabilityConsole(backend, { auth });
    const res = await get(handler, "/");
    expect(res.status).toBe(200);
    await handler.close();
    let fail = true;
    const broken = new MemoryDurability() as MemoryDurability & { open(): Promise<void> };
    broken.open = () => fail ? Promise.reject(new Error("connection refused")) : Promise.resolve();
    const reported: unknown[] = [];
    const console503 = durabilityConsole(broken, { auth, onError: (e) => reported.push(e) });
    const down = await get(console503, "/outbound");
    expect(down.status).toBe(503);
    expect(await down.text()).toContain("The memory backend could not be opened: connection refused");
    expect(reported.map((e) => (e as Error).message)).toEqual(["The memory backend could not be opened: connection refused"]);
    fail = false;
    expect((await get(console503, "/outbound")).status, "the next request tries again").toBe(200);
    // A bot opens its backend in start(): before it, the page says so and the failure is logged.
    const file = join(dir, `${crypto.randomUUID()}.db`);
    const idle = new Bot({ provider: new MockProvider(), durability: { backend: new SQLiteDurability({ file }), instanceId: "not-started" } });
    const logged: unknown[] = [];
    const early = await get(durabilityConsole(idle, { auth, onError: (e) => logged.push(e) }), "/outbound");
    expect(early.status).toBe(500);
    expect(await early.text()).toContain("is not open: call open() first (bot.start() does)");
    expect(logged.length).toBe(1);
  }, 60_000);
});
