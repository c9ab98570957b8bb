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
        expect(all).toContain("Showing 1 record; more exist");
        expect(all).toContain(`href="/outbound?limit=2">Show up to 2</a>`);
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
        expect(out).toMatch(/<tr><th>Created<\/th><td>\d{4}-\d\d-\d\dT/);
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
        expect(list).toContain(`<td>${escapeHtml(`chat-${XSS}`)}</td>`);
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
      ["/inbound?state=sent", `Parameter &quot;state&quot; must be one of all, pending, processing, failed, done, dead`],
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
    expect(text).toContain("The record is sent; retry needs one of: dead, failed, unknown.");
    expect(text).not.toContain("<form method=\"post\"");
    expect((await get(handler, `/outbound/retry?id=missing`)).status).toBe(404);
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
    const throwing = durabilityConsole(bot, {
      auth: () => {
        throw new Error("db password is hunter2");
      },
    });
    const res = await throwing(new Request(`${BASE}/`));
    expect(res.status).toBe(500);
    expect(await res.text()).not.toContain("hunter2");
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
    expect(await oddPage.text()).toContain(`<tr><th>Key</th><td>${escapeHtml(odd)}</td></tr>`);
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
  });
});
