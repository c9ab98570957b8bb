// The web DLQ console in a real browser (Chromium via playwright-core): served
// with Bun.serve over a Bot on SQLite, behind basic auth. Skips with a message
// when /usr/bin/chromium is missing, unless BOTMESH_REQUIRE_SERVICES=1.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { existsSync, mkdirSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { type Browser, chromium } from "playwright-core";
import { Bot } from "../src/bot.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { ProviderError } from "../src/errors.ts";
import { MockProvider } from "../src/testing/mock_provider.ts";
import { basicAuth, durabilityConsole } from "../src/ops/console.ts";

/** Where Chromium is (`BOTMESH_CHROMIUM` overrides, e.g. to check the skip path). */
const CHROMIUM = process.env.BOTMESH_CHROMIUM ?? "/usr/bin/chromium";
const REQUIRED = process.env.BOTMESH_REQUIRE_SERVICES === "1";
const available = existsSync(CHROMIUM);
if (!available) {
  if (REQUIRED) throw new Error(`BOTMESH_REQUIRE_SERVICES=1 but Chromium is missing at ${CHROMIUM}`);
  console.warn(`Chromium is missing at ${CHROMIUM}: skipping the console browser tests (install it: apt-get install chromium)`);
}

const root = join(import.meta.dir, "..");
const SCREENSHOT = join(root, ".tmp", "screenshots", "console-retry.png");
/** Screenshots of the pages at 1280 and 390 px, to look at. */
const SHOTS = process.env.BOTMESH_CONSOLE_SHOTS ?? join(root, ".tmp", "console-shots");
const dir = join(tmpdir(), `botmesh-console-browser-${crypto.randomUUID()}`);
const USER = "ops";
const PASSWORD = "browser-test-password";
const XSS = `<script>alert(1)</script>"'><img src=x onerror=alert(1)>`;
const TIMEOUT = 90_000;

const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

async function until(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 10_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

let browser: Browser | undefined;
let server: ReturnType<typeof Bun.serve> | undefined;
let bot: Bot | undefined;
let provider: MockProvider;
let base = "";

describe.skipIf(!available)("the DLQ console in Chromium", () => {
  beforeAll(async () => {
    mkdirSync(dir, { recursive: true });
    provider = new MockProvider();
    bot = new Bot({
      provider,
      durability: {
        backend: new SQLiteDurability({ file: join(dir, "console.db") }),
        instanceId: "browser-test",
        inbox: { retries: 0 },
        outbox: { retries: 0 },
      },
    });
    bot.on("error", () => {});
    bot.when(/boom/, () => {
      throw new Error(`handler failed ${XSS}`);
    });
    await bot.start();
    // A dead send (permanent provider error), and dead records full of markup.
    provider.failNext(1, new ProviderError("Recipient blocked the bot", { retryable: false, status: 403 }));
    expect((await bot.send("chat-1", "Your order 42 is confirmed", { idempotencyKey: "order-42:confirm" })).state)
      .toBe("dead");
    provider.failNext(1, new ProviderError(`rejected ${XSS}`, { retryable: false }));
    expect((await bot.send(`chat-${XSS}`, `payload ${XSS}`, { idempotencyKey: `key-${XSS}` })).state).toBe("dead");
    await provider.receive({ id: `in-${XSS}`, chatId: `chat-${XSS}`, text: `boom ${XSS}` });
    await bot.idle();

    const handler = durabilityConsole(bot, { auth: basicAuth(USER, PASSWORD), basePath: "/ops" });
    server = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: handler });
    base = `http://127.0.0.1:${server.port}/ops`;
    browser = await chromium.launch({
      executablePath: CHROMIUM,
      args: [
        "--no-sandbox",
        "--headless",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-quic",
      ],
    });
  }, TIMEOUT);

  afterAll(async () => {
    await browser?.close();
    server?.stop(true);
    await bot?.stop();
    rmSync(dir, { recursive: true, force: true });
  });

  test("overview → dead outbound list → record → Retry → confirm: the send is delivered", async () => {
    const context = await browser!.newContext({ httpCredentials: { username: USER, password: PASSWORD } });
    const page = await context.newPage();
    const dialogs: string[] = [];
    page.on("dialog", (dialog) => {
      dialogs.push(dialog.message());
      void dialog.dismiss();
    });
    try {
      const overview = await page.goto(`${base}/`);
      expect(overview!.status()).toBe(200);
      expect(overview!.headers()["content-security-policy"]).toContain("default-src 'none'");
      expect(await page.locator("h1").textContent()).toBe("Overview");
      expect(await page.locator("body").textContent()).toContain("Counts stop at 1000");

      // The dead count of the outbound table links to the dead outbound list.
      const deadLink = page.locator(`section:has(h2:text("Outbound")) a[href="/ops/outbound?state=dead"]`);
      expect(await deadLink.textContent()).toBe("2");
      await deadLink.click();
      await page.waitForURL(/\/ops\/outbound\?state=dead$/);
      expect(await page.locator("h1").textContent()).toBe("Outbound · dead");

      await page.getByRole("link", { name: "order-42:confirm" }).click();
      await page.waitForURL(/\/ops\/outbound\/record\?id=order-42%3Aconfirm$/);
      expect(await page.locator("h1").textContent()).toBe("Outbound entry");
      expect(await page.locator("pre").textContent()).toBe(`"Your order 42 is confirmed"`);
      expect(await page.locator("tr:has(th:text-is('Last error')) td").textContent()).toBe(
        "ProviderError: Recipient blocked the bot",
      );

      const sentBefore = provider.sent.length;
      await page.getByRole("link", { name: "Retry…" }).click();
      await page.waitForURL(/\/ops\/outbound\/retry\?id=order-42%3Aconfirm$/);
      expect(await page.locator("h1").textContent()).toBe("Retry this send?");
      expect(provider.sent.length).toBe(sentBefore); // the confirmation page changes nothing

      await page.getByRole("button", { name: "Yes, retry" }).click();
      await page.waitForURL(/\/ops\/outbound\/record\?id=order-42%3Aconfirm&notice=retry$/);
      expect(await page.locator(".notice").textContent()).toBe("Retried: the send is queued again.");

      await until("the retried send", () => provider.sent.length === sentBefore + 1);
      expect(provider.sent.at(-1)).toMatchObject({ idempotencyKey: "order-42:confirm", chatId: "chat-1" });
      await until("state sent", async () => (await bot!.durability!.outbox.get("order-42:confirm"))?.state === "sent");

      await page.reload();
      expect(await page.locator("tr:has(th:text-is('State')) td").textContent()).toBe("sent");
      expect(await page.locator("tr:has(th:text-is('Provider message id')) td").textContent()).toMatch(/^mock-msg-\d+$/);
      // A sent entry offers no Retry.
      expect(await page.getByRole("link", { name: "Retry…" }).count()).toBe(0);

      mkdirSync(join(root, ".tmp", "screenshots"), { recursive: true });
      await page.screenshot({ path: SCREENSHOT, fullPage: true });
      expect(existsSync(SCREENSHOT)).toBe(true);
      expect(statSync(SCREENSHOT).size).toBeGreaterThan(5_000);
      expect(dialogs).toEqual([]);
    } finally {
      await context.close();
    }
  }, TIMEOUT);

  test("with JavaScript disabled the lists and records still work", async () => {
    const context = await browser!.newContext({
      javaScriptEnabled: false,
      httpCredentials: { username: USER, password: PASSWORD },
    });
    const page = await context.newPage();
    try {
      await page.goto(`${base}/`);
      await page.getByRole("link", { name: "Inbound DLQ" }).click();
      await page.waitForURL(/\/ops\/inbound\?state=dead$/);
      expect(await page.locator("tbody tr").count()).toBe(1);
      expect(await page.locator("tbody tr td").first().textContent()).toBe(`in-${XSS}`);

      // The filter form is a plain GET form.
      await page.goto(`${base}/outbound?state=all`);
      await page.locator('input[name="chat"]').fill("chat-1");
      await page.getByRole("button", { name: "Filter" }).click();
      await page.waitForURL(/chat=chat-1/);
      expect(await page.locator("tbody tr").count()).toBe(1);
      expect(await page.locator("tbody tr td").first().textContent()).toBe("order-42:confirm");

      await page.getByRole("link", { name: "order-42:confirm" }).click();
      expect(await page.locator("h1").textContent()).toBe("Outbound entry");
    } finally {
      await context.close();
    }
  }, TIMEOUT);

  test("XSS payloads render as text and never execute", async () => {
    const context = await browser!.newContext({ httpCredentials: { username: USER, password: PASSWORD } });
    const page = await context.newPage();
    const dialogs: string[] = [];
    page.on("dialog", (dialog) => {
      dialogs.push(dialog.message());
      void dialog.dismiss();
    });
    try {
      await page.goto(`${base}/outbound?state=dead`);
      expect(await page.locator("body").textContent()).toContain(`key-${XSS}`);
      await page.getByRole("link", { name: `key-${XSS}` }).click();
      expect(await page.locator("tr:has(th:text-is('Chat')) td").textContent()).toBe(`chat-${XSS}`);
      expect(await page.locator("tr:has(th:text-is('Last error')) td").textContent()).toBe(`ProviderError: rejected ${XSS}`);
      expect(await page.locator("h2:text-is('Content') + pre").textContent()).toBe(JSON.stringify(`payload ${XSS}`));
      expect(await page.locator("img").count()).toBe(0);
      expect(await page.locator("main script").count()).toBe(0);

      await page.goto(`${base}/inbound?state=dead`);
      await page.getByRole("link", { name: `in-${XSS}` }).click();
      expect(await page.locator("h1").textContent()).toBe("Inbound record");
      expect(await page.locator("h2:text-is('Payload') + pre").textContent()).toContain(JSON.stringify(`boom ${XSS}`));
      // The handler's error: its message shown, its stack frames folded under "Stack".
      expect(await page.locator("tr:has(th:text-is('Last error')) td div.err").textContent()).toBe(`Error: handler failed ${XSS}`);
      expect(await page.locator("tr:has(th:text-is('Last error')) details summary").textContent()).toMatch(/^Stack \(\d+ frames\)$/);
      expect(await page.locator("tr:has(th:text-is('Last error')) details pre").isVisible()).toBe(false);
      await page.getByRole("link", { name: "Replay…" }).click();
      expect(await page.locator("h1").textContent()).toBe("Replay this record?");
      expect(await page.locator("img").count()).toBe(0);

      // Reflected input: a bad state and a missing record echo the value, escaped.
      await page.goto(`${base}/inbound?state=${encodeURIComponent(XSS)}`);
      expect(await page.locator(".error").textContent()).toContain(XSS);
      await page.goto(`${base}/outbound/record?id=${encodeURIComponent(XSS)}`);
      expect(await page.locator(".error").textContent()).toContain(XSS);
      expect(await page.locator("img").count()).toBe(0);

      await sleep(200);
      expect(dialogs).toEqual([]);
    } finally {
      await context.close();
    }
  }, TIMEOUT);

  test("without credentials the browser gets 401 and sees no records", async () => {
    const context = await browser!.newContext();
    const page = await context.newPage();
    try {
      // Headless Chromium cancels the Basic prompt (ERR_INVALID_AUTH_CREDENTIALS): the navigation fails.
      const failed = await page.goto(`${base}/outbound?state=dead`).then(() => null, (error: Error) => error);
      expect(failed?.message).toContain("ERR_INVALID_AUTH_CREDENTIALS");
      // The same request from the browser context's HTTP stack shows the 401 and its challenge.
      const response = await page.request.get(`${base}/outbound?state=dead`);
      expect(response.status()).toBe(401);
      expect(response.headers()["www-authenticate"]).toBe(`Basic realm="Durability console", charset="UTF-8"`);
      expect(await response.text()).not.toContain("order-42");
    } finally {
      await context.close();
    }
  }, TIMEOUT);

  test("retry all on a list filtered by chat and error text: one confirmation page, then every one is sent", async () => {
    for (const key of ["bulk-1", "bulk-2", "bulk-3"]) {
      provider.failNext(1, new ProviderError("Bulk failure: chat muted", { retryable: false }));
      expect((await bot!.send("bulk-chat", `bulk text ${key}`, { idempotencyKey: key })).state).toBe("dead");
    }
    const context = await browser!.newContext({ javaScriptEnabled: false, httpCredentials: { username: USER, password: PASSWORD } });
    const page = await context.newPage();
    try {
      await page.goto(`${base}/outbound?state=dead`);
      await page.locator('input[name="chat"]').fill("bulk-chat");
      await page.locator('input[name="error"]').fill("muted");
      await page.getByRole("button", { name: "Filter" }).click();
      await page.waitForURL(/error=muted/);
      expect(await page.locator("tbody tr").count()).toBe(3);
      expect(await page.locator("tbody tr td.preview").first().textContent()).toBe("bulk text bulk-1");
      const sentBefore = provider.sent.length;
      await page.getByRole("link", { name: "Retry all 3…" }).click();
      expect(await page.locator("h1").textContent()).toBe("Retry 3 sends?");
      expect(await page.locator("main").textContent()).toContain("the provider is called again");
      expect(provider.sent.length).toBe(sentBefore);
      await page.getByRole("button", { name: "Yes, retry 3 sends" }).click();
      await page.waitForURL(/notice=bulk-retry/);
      expect(await page.locator(".notice").textContent()).toBe("Retried 3 sends.");
      await until("the three sends", () => provider.sent.filter((s) => s.chatId === "bulk-chat").length === 3);
      await page.goto(`${base}/outbound?chat=bulk-chat`);
      expect(await page.locator("tbody .state").allTextContents()).toEqual(["sent", "sent", "sent"]);
    } finally {
      await context.close();
    }
  }, TIMEOUT);

  test("mark an unknown send as delivered: sent, not sent again, the old error kept in a neutral colour", async () => {
    provider.failNext(1, new ProviderError("timed out after the request went out", { retryable: true, maybeDelivered: true }));
    await bot!.send("chat-2", "Did this arrive?", { idempotencyKey: "maybe-42" }).catch(() => {});
    await bot!.idle();
    const context = await browser!.newContext({ httpCredentials: { username: USER, password: PASSWORD } });
    const page = await context.newPage();
    try {
      await page.goto(`${base}/`);
      await page.getByRole("link", { name: "Unknown sends" }).click();
      await page.getByRole("link", { name: "maybe-42" }).click();
      const red = await page.locator("tr:has(th:text-is('Last error')) td div").evaluate((el) => getComputedStyle(el).color);
      expect(red).toBe("rgb(138, 19, 8)");
      const calls = provider.calls.length;
      await page.getByRole("link", { name: "Mark as delivered…" }).click();
      expect(await page.locator("h1").textContent()).toBe("Mark this send as delivered?");
      await page.locator('input[name="messageId"]').fill("mock-msg-seen");
      await page.getByRole("button", { name: "Yes, mark as delivered" }).click();
      await page.waitForURL(/notice=delivered/);
      expect(await page.locator(".notice").textContent()).toBe("Marked as delivered: the send is sent, and was not sent again.");
      expect(await page.locator("tr:has(th:text-is('State')) td").textContent()).toBe("sent");
      expect(await page.locator("tr:has(th:text-is('Provider message id')) td").textContent()).toBe("mock-msg-seen");
      const past = page.locator("tr:has(th:text-is('Last error before it was sent')) td div");
      expect(await past.textContent()).toBe("ProviderError: timed out after the request went out");
      expect(await past.evaluate((el) => getComputedStyle(el).color)).toBe("rgb(90, 98, 114)");
      expect(await page.getByRole("link", { name: "Mark as delivered…" }).count()).toBe(0);
      await bot!.idle();
      expect(provider.calls.length, "no new call").toBe(calls);
    } finally {
      await context.close();
    }
  }, TIMEOUT);

  test("ages are relative with the exact time on hover; auto-refresh reloads the page without a script", async () => {
    const context = await browser!.newContext({ javaScriptEnabled: false, httpCredentials: { username: USER, password: PASSWORD } });
    const page = await context.newPage();
    try {
      await page.goto(`${base}/outbound?state=dead`);
      const time = page.locator("tbody time").first();
      expect(await time.textContent()).toMatch(/^(just now|\d+ (s|min) ago)$/);
      expect(await time.getAttribute("title")).toMatch(/^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$/);
      await page.getByRole("link", { name: "10 s" }).click();
      await page.waitForURL(/refresh=10/);
      let loads = 0;
      page.on("load", () => loads++);
      await page.waitForEvent("load", { timeout: 60_000 });
      expect(loads).toBeGreaterThanOrEqual(1);
      expect(page.url()).toContain("refresh=10");
    } finally {
      await context.close();
    }
  }, TIMEOUT);

  test("usable at 390 px: no page scrolls sideways, long keys wrap; screenshots at 1280 and 390 px", async () => {
    const longKey = `order-${"x".repeat(40)}:${"0123456789".repeat(8)}`;
    provider.failNext(1, new ProviderError(`Recipient blocked the bot ${"very-long-token-".repeat(12)}`, { retryable: false }));
    await bot!.send(`chat-${"9".repeat(60)}`, "A message with a long key and a long chat id", { idempotencyKey: longKey });
    mkdirSync(SHOTS, { recursive: true });
    const pages: [string, string][] = [
      ["overview", "/"],
      ["outbound-dead", "/outbound?state=dead"],
      ["outbound-all", "/outbound"],
      ["inbound-dead", "/inbound?state=dead"],
      ["record-long-key", `/outbound/record?id=${encodeURIComponent(longKey)}`],
      ["record-sent", `/outbound/record?id=${encodeURIComponent("order-42:confirm")}`],
      ["confirm-retry", `/outbound/retry?id=${encodeURIComponent(longKey)}`],
      ["bulk-discard", "/outbound/bulk/discard?state=dead"],
      ["damaged", "/damaged"],
    ];
    for (const width of [1280, 390]) {
      const context = await browser!.newContext({
        viewport: { width, height: 844 },
        httpCredentials: { username: USER, password: PASSWORD },
      });
      const page = await context.newPage();
      try {
        for (const [name, path] of pages) {
          const response = await page.goto(`${base}${path}`);
          expect(response!.status(), path).toBe(200);
          const scrollWidth = await page.evaluate(() => document.scrollingElement!.scrollWidth);
          expect(scrollWidth, `${path} at ${width} px`).toBeLessThanOrEqual(width);
          await page.screenshot({ path: join(SHOTS, `${name}-${width}.png`), fullPage: true });
        }
        if (width === 390) {
          // The long key wraps inside its cell instead of widening the page.
          await page.goto(`${base}/outbound?state=dead`);
          const box = await page.getByRole("link", { name: longKey }).boundingBox();
          expect(box!.x + box!.width).toBeLessThanOrEqual(390);
          expect(box!.height).toBeGreaterThan(20);
        }
      } finally {
        await context.close();
      }
    }
  }, TIMEOUT);
});
