// A Telegraf bot with sessions on SQLite through durableStorage (SQLiteStore for the journal and the
// sessions), SIGKILLed at random moments while updates stream in by long polling (bot.launch()),
// restarted each time, with the inbox's default settings: at the end each chat's session counter equals
// the number of its updates, and its list holds each of its texts once (no update applied twice, none lost).
import { afterAll, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { openBackend } from "../ops.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import { childLines } from "./support/child_lines.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { untilQuiescent } from "./support/quiescence.ts";

const dir = join(tmpdir(), `botmesh-telegraf-session-kill-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => {
  if (!process.env.TELEGRAF_KEEP) rmSync(dir, { recursive: true, force: true });
  else console.log(`kept ${dir}`);
});

const KILLS = Number(process.env.TELEGRAF_KILLS ?? 20);
const CHATS = [601, 602, 603, 604];
const MARK = "@botmesh/durable:session";

test(`Telegraf sessions on durableStorage, the bot SIGKILLed ${KILLS} times while updates stream in: each update applied once`, async () => {
  const fake = new FakeTelegram().start();
  const db = join(dir, "sessions.db");
  const spawn = () => {
    const child = Bun.spawn([process.execPath, "tests/fixtures/telegraf_session_bot.ts", db, fake.url, fake.token], {
      stdout: "pipe",
      stderr: "pipe",
    });
    return { child, lines: childLines(child.stdout, "Telegraf session bot", 20_000), stderr: new Response(child.stderr).text() };
  };
  const runs: ReturnType<typeof spawn>[] = [];
  const texts = new Map<number, string[]>(CHATS.map((c) => [c, []]));
  const inboundIds: string[] = [];
  let streaming = true;
  const stream = (async () => {
    for (let i = 0; streaming; i++) {
      const chat = CHATS[i % CHATS.length]!;
      const text = `u${i}`;
      texts.get(chat)!.push(text);
      inboundIds.push(fake.inboundId(fake.push(fake.textUpdate(chat, text))));
      await Bun.sleep(5 + Math.random() * 15);
    }
  })();
  try {
    let killed = 0;
    while (killed < KILLS) {
      const run = spawn();
      runs.push(run);
      await run.lines.next("ready").catch(async (error) => {
        throw new Error(`${error.message}\nstderr: ${await run.stderr}`);
      });
      await Bun.sleep(50 + Math.random() * 400);
      run.child.kill("SIGKILL");
      await run.child.exited;
      await run.lines.ended;
      if (run.child.signalCode === "SIGKILL") killed++;
    }
    streaming = false;
    await stream;
    const last = spawn();
    runs.push(last);
    await last.lines.next("ready");
    // Every update settled and every reply sent: nothing more changes a session.
    await untilQuiescent(db, fake, inboundIds, 30_000).catch(async (error) => {
      last.child.kill("SIGKILL");
      throw new Error(`${error.message}; stderr of the last run: ${(await last.stderr.catch(() => "")).slice(-2000)}`);
    });
    last.child.kill("SIGTERM");
    expect(await last.child.exited, await last.stderr).toBe(0);
    await last.lines.ended;
    expect(runs.flatMap((r) => r.lines.all()).filter((l) => l.startsWith("dead "))).toEqual([]);

    const store = new SQLiteStore({ file: db });
    const opened = await openBackend(`sqlite:${db}`);
    let doubled = 0;
    let lost = 0;
    try {
      for (const chat of CHATS) {
        const stored = (await store.get(`${chat}:${chat}`)) as Record<string, unknown> | undefined;
        expect(stored?.[MARK], `chat ${chat}: an envelope`).toBe(1);
        // Telegraf's default key is <from id>:<chat id>. Written by an update that is done (or purged): its value is the session.
        const by = String(stored!.by);
        expect((await opened.backend.inbox.get(by))?.state ?? "done", `chat ${chat}: the last writer`).toBe("done");
        const session = stored!.v as { count: number; texts: string[] };
        const expected = texts.get(chat)!;
        const times = new Map<string, number>();
        for (const t of session.texts) times.set(t, (times.get(t) ?? 0) + 1);
        doubled += [...times.values()].filter((n) => n > 1).length;
        lost += expected.filter((t) => !times.has(t)).length;
        expect(session.count, `chat ${chat}: the counter`).toBe(expected.length);
        expect([...session.texts].sort(), `chat ${chat}: each text once`).toEqual([...expected].sort());
      }
    } finally {
      await opened.close();
      await store.close();
    }
    const total = [...texts.values()].reduce((n, t) => n + t.length, 0);
    console.log(
      `telegraf sessions kill: ${KILLS} SIGKILLs, ${total} updates in ${CHATS.length} chats, ` +
        `${doubled} applied twice, ${lost} lost, ${fake.sent.length} replies`,
    );
    expect(doubled).toBe(0);
    expect(lost).toBe(0);
  } finally {
    streaming = false;
    for (const run of runs) run.child.kill("SIGKILL");
    await fake.stop();
  }
}, 120_000);
