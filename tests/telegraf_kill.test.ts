// A Telegraf bot made crash-safe with @botmesh/durable/telegraf (on SQLite; by bot.launch() long
// polling, and by Telegraf's webhookCallback), SIGKILLed at random moments while updates stream in and
// started again each time, with the inbox's default settings: at the end every update got both its
// replies, and a reply went out twice only where the restarted process reported the send as ambiguous
// (killed during its Bot API call; sent again under onAmbiguous: "resend"). By webhook, an update is
// delivered again until it is answered 200, as Telegram does.
import { afterAll, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { childLines } from "./support/child_lines.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { untilQuiescent } from "./support/quiescence.ts";

const dir = join(tmpdir(), `botmesh-telegraf-kill-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => {
  if (!process.env.TELEGRAF_KEEP) rmSync(dir, { recursive: true, force: true });
  else console.log(`kept ${dir}`);
});

const KILLS = Number(process.env.TELEGRAF_KILLS ?? 20);
const CHATS = [501, 502, 503, 504];

async function killRun(mode: "polling" | "webhook"): Promise<void> {
  const fake = new FakeTelegram().start();
  const db = join(dir, `${mode}.db`);
  /** The webhook of the process running now (webhook mode), `null` while none runs. */
  let port: number | null = null;
  const queues = new Map<number, Record<string, unknown>[]>(CHATS.map((c) => [c, []]));
  let delivering = true;
  // Telegram's side of a webhook: per chat, each update in turn, delivered again until answered 200.
  const deliverers = mode !== "webhook" ? [] : CHATS.map(async (chat) => {
    const queue = queues.get(chat)!;
    while (delivering || queue.length > 0) {
      const update = queue[0];
      if (update === undefined || port === null) {
        await Bun.sleep(10);
        continue;
      }
      const ok = await fetch(`http://127.0.0.1:${port}/`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body: JSON.stringify(update),
      }).then(async (r) => (await r.arrayBuffer(), r.ok), () => false);
      if (ok) queue.shift();
      else await Bun.sleep(20);
    }
  });
  const spawn = () => {
    const child = Bun.spawn([process.execPath, "tests/fixtures/telegraf_bot.ts", db, fake.url, fake.token, mode], {
      stdout: "pipe",
      stderr: "pipe",
    });
    return { child, lines: childLines(child.stdout, "Telegraf bot", 20_000), stderr: new Response(child.stderr).text() };
  };
  const runs: ReturnType<typeof spawn>[] = [];
  const texts: string[] = [];
  const inboundIds = new Map<string, string>();
  let streaming = true;
  const stream = (async () => {
    for (let i = 0; streaming; i++) {
      const text = `u${i}`;
      texts.push(text);
      const chat = CHATS[i % CHATS.length]!;
      const update = fake.textUpdate(chat, text);
      if (mode !== "webhook") fake.push(update);
      else queues.get(chat)!.push(update);
      inboundIds.set(text, fake.inboundId(update));
      await Bun.sleep(5 + Math.random() * 20);
    }
  })();
  try {
    let killed = 0;
    while (killed < KILLS) {
      const run = spawn();
      runs.push(run);
      const ready = await run.lines.next("ready").catch(async (error) => {
        throw new Error(`${error.message}\nstderr: ${await run.stderr}`);
      });
      if (mode === "webhook") port = Number(ready.split(" ")[1]);
      await Bun.sleep(50 + Math.random() * 400);
      run.child.kill("SIGKILL");
      port = null;
      await run.child.exited;
      await run.lines.ended;
      if (run.child.signalCode === "SIGKILL") killed++;
    }
    streaming = false;
    await stream;
    const last = spawn();
    runs.push(last);
    const ready = await last.lines.next("ready");
    if (mode === "webhook") port = Number(ready.split(" ")[1]);
    delivering = false;
    await Promise.all(deliverers);
    const replies = () => new Set(fake.sent.map((s) => String(s.params.text)));
    await fake.until("every reply", () => {
      const got = replies();
      return texts.every((t) => got.has(`1 ${t}`) && got.has(`2 ${t}`));
    }, 60_000).catch(async (error) => {
      const got = replies();
      const missing = texts.filter((t) => !got.has(`1 ${t}`) || !got.has(`2 ${t}`));
      const dead = runs.flatMap((r) => r.lines.all()).filter((l) => l.startsWith("dead ")).slice(0, 5);
      last.child.kill("SIGKILL");
      throw new Error(
        `${error.message}: ${missing.length} missing, the first ${JSON.stringify(missing.slice(0, 10).map((t) => [t, inboundIds.get(t), got.has(`1 ${t}`), got.has(`2 ${t}`)]))}; ` +
          `dead: ${JSON.stringify(dead)}; stderr of the last run: ${(await last.stderr.catch(() => "")).slice(-2000)}`,
      );
    });
    // Every update settled, no send under way or due, every send journaled as sent at the fake: the
    // last run sends nothing more, so a duplicate would already be counted below.
    await untilQuiescent(db, fake, inboundIds.values(), 30_000).catch(async (error) => {
      last.child.kill("SIGKILL");
      throw new Error(`${error.message}; stderr of the last run: ${(await last.stderr.catch(() => "")).slice(-2000)}`);
    });
    last.child.kill("SIGTERM");
    expect(await last.child.exited, await last.stderr).toBe(0);
    await last.lines.ended;

    const lines = runs.flatMap((r) => r.lines.all());
    expect(lines.filter((l) => l.startsWith("dead "))).toEqual([]);
    const ambiguous = new Set(lines.filter((l) => l.startsWith("ambiguous ")).map((l) => l.slice("ambiguous ".length)));
    const counts = new Map<string, number>();
    for (const sent of fake.sent) counts.set(String(sent.params.text), (counts.get(String(sent.params.text)) ?? 0) + 1);
    const lost = texts.filter((t) => !counts.has(`1 ${t}`) || !counts.has(`2 ${t}`));
    expect(lost, "updates without both replies").toEqual([]);
    // Reply "<n> <text>" is the n-th message-creating call of its update's handling: key <inbound id>:<n>.
    const twice = [...counts].filter(([, n]) => n > 1).map(([reply]) => reply);
    const unreported = twice.filter((reply) => !ambiguous.has(`${inboundIds.get(reply.slice(2))}:${reply.slice(0, 1)}`));
    expect(unreported, "replies sent twice without an ambiguous report").toEqual([]);
    console.log(
      `telegraf kill (${mode}): ${KILLS} SIGKILLs, ${texts.length} updates, ${fake.sent.length} replies, ` +
        `${ambiguous.size} ambiguous reports, ${twice.length} replies sent twice (all reported), 0 lost`,
    );
  } finally {
    streaming = false;
    delivering = false;
    port = null;
    for (const run of runs) run.child.kill("SIGKILL");
    await fake.stop();
  }
}

for (const mode of ["polling", "webhook"] as const) {
  test(`a Telegraf bot (${mode}) SIGKILLed ${KILLS} times while updates stream in: no update lost, no reply twice unreported`, () => killRun(mode), 120_000);
}

test("examples/telegraf_bot.ts killed with SIGKILL mid-handler: every reply once", async () => {
  const fake = new FakeTelegram().start();
  const db = join(dir, "example.db");
  const spawn = () =>
    Bun.spawn([process.execPath, "examples/telegraf_bot.ts"], {
      env: { ...process.env, TELEGRAM_TOKEN: fake.token, TELEGRAM_API: fake.url, BOT_DB: db },
      stdout: "pipe",
      stderr: "pipe",
    });
  const texts = () => fake.sent.filter((s) => s.method === "sendMessage").map((s) => String(s.params.text));
  let child = spawn();
  try {
    await childLines(child.stdout, "telegraf_bot.ts", 15_000).next("running");
    const update = fake.push(fake.textUpdate(4242, "hello"));
    await fake.until("the first reply", () => texts().length === 1, 15_000);
    child.kill("SIGKILL"); // inside the handler's 3 s wait: "Done." was never sent
    await child.exited;
    expect(texts()).toEqual(['Working on "hello"…']);
    child = spawn();
    await childLines(child.stdout, "telegraf_bot.ts (restarted)", 15_000).next("running");
    await fake.until("the second reply", () => texts().length === 2, 15_000);
    await untilQuiescent(db, fake, [fake.inboundId(update)], 15_000); // past it, a duplicate would be in texts()
    expect(texts()).toEqual(['Working on "hello"…', "Done."]);
    expect(fake.calls.filter((c) => c.method === "sendChatAction").length).toBe(2); // passed straight through, each run
  } finally {
    child.kill("SIGINT");
    expect(await child.exited).toBe(0);
    await fake.stop();
  }
}, 60_000);
