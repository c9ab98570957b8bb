// A grammY bot with an @grammyjs/menu menu (a counter in a durable session on SQLite, a submenu, buttons
// that send messages), made crash-safe with @botmesh/durable/grammy, SIGKILLed at random moments while
// users press its buttons, restarted each time, with the inbox's default settings. Each user sends
// /start, then presses a button of the menu message as the fake Bot API has it now (a callback_query
// of that message) once the previous press took effect, as people do. The fake refuses what Telegram
// refuses to a repeat (a second answer of a press, an edit to the content a message has) and lets a
// press's query expire after QUERY_TTL_MS. At the end: no press lost, each `+1` applied once to its
// user's counter (and its edit made once), no message sent twice unless the restarted process reported
// its send ambiguous (killed during its Bot API call; sent again under onAmbiguous: "resend"), every
// press answered or its query expired.
import { afterAll, expect, test } from "bun:test";
import { mkdirSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { openBackend } from "../ops.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import { childLines } from "./support/child_lines.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { untilQuiescent } from "./support/quiescence.ts";

const dir = join(tmpdir(), `botmesh-grammy-menu-kill-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => {
  if (!process.env.GRAMMY_KEEP) rmSync(dir, { recursive: true, force: true });
  else console.log(`kept ${dir}`);
});

const KILLS = Number(process.env.GRAMMY_KILLS ?? 20);
const USERS = Array.from({ length: 10 }, (_, i) => 801 + i);
const QUERY_TTL_MS = 3_000;
const MARK = "@botmesh/durable:session";
const START = { entities: [{ type: "bot_command", offset: 0, length: 6 }] };
type Keyboard = { inline_keyboard: { text: string; callback_data?: string }[][] };
type Label = "+1" | "More" | "Hi" | "Say" | "Back";

test(`grammY with @grammyjs/menu, the bot SIGKILLed ${KILLS} times while ${USERS.length} users press buttons: no press lost, none applied twice`, async () => {
  const fake = new FakeTelegram({ repeats: true, queryTtlMs: QUERY_TTL_MS }).start();
  const db = join(dir, "menu.db");
  const spawn = () => {
    const child = Bun.spawn([process.execPath, "tests/fixtures/grammy_menu_bot.ts", db, fake.url, fake.token], {
      stdout: "pipe",
      stderr: "pipe",
    });
    return { child, lines: childLines(child.stdout, "grammY menu bot", 20_000), stderr: new Response(child.stderr).text() };
  };
  const runs: ReturnType<typeof spawn>[] = [];
  const inboundIds: string[] = [];
  /** Each message the bot owes, `<chat>|<text>` → the outbox key it goes out under: <inbound id>:<n>. */
  const keyOf = new Map<string, string>();
  const presses: { chat: number; query: string; label: Label }[] = [];
  const counts = new Map<number, number>(USERS.map((u) => [u, 0]));
  const menus = new Map<number, number>();
  const sentIn = (chat: number, text: string) => fake.sent.some((s) => s.chatId === String(chat) && s.params.text === text);
  const answered = (query: string) => fake.answeredCallbacks.includes(query);
  const refused = (query: string) => fake.calls.some((c) => c.method === "answerCallbackQuery" && c.params.callback_query_id === query && c.status === 400);
  const push = (update: Record<string, unknown>, owed: string[], chat: number) => {
    const id = fake.inboundId(fake.push(update));
    inboundIds.push(id);
    owed.forEach((text, i) => keyOf.set(`${chat}|${text}`, `${id}:${i + 1}`));
  };
  let walking = true;
  const walk = async (chat: number) => {
    push(fake.textUpdate(chat, "/start", START), ["Count: 0"], chat);
    await fake.until(`the menu in chat ${chat}`, () => sentIn(chat, "Count: 0"), 30_000);
    const menu = fake.sent.find((s) => s.chatId === String(chat) && s.params.text === "Count: 0")!.messageId;
    menus.set(chat, menu);
    const keyboard = () => fake.message(chat, menu)!.reply_markup as Keyboard;
    const shows = (first: string) => keyboard().inline_keyboard[0]![0]!.text === first;
    let view: "main" | "more" = "main";
    for (let i = 0; i === 0 || walking; i++) {
      const r = Math.random();
      const label: Label = view === "main" ? (r < 0.6 ? "+1" : r < 0.8 ? "Hi" : "More") : (r < 0.5 ? "Say" : "Back");
      const data = keyboard().inline_keyboard.flat().find((b) => b.text === label)!.callback_data!;
      const update = fake.pressUpdate(chat, menu, data);
      const query = (update.callback_query as { id: string }).id;
      presses.push({ chat, query, label });
      const owed = label === "Hi" ? [`hi ${query}`] : label === "Say" ? [`say1 ${query}`, `say2 ${query}`] : [];
      push(update, owed, chat);
      const count = counts.get(chat)! + (label === "+1" ? 1 : 0);
      const effect = {
        "+1": () => fake.message(chat, menu)!.text === `Count: ${count}`,
        "More": () => shows("Say"),
        "Back": () => shows("+1"),
        "Hi": () => owed.every((t) => sentIn(chat, t)),
        "Say": () => owed.every((t) => sentIn(chat, t)),
      }[label];
      await fake.until(`press ${label} (${query}) in chat ${chat}`, () => effect() && (answered(query) || refused(query)), 30_000);
      counts.set(chat, count);
      if (label === "More") view = "more";
      if (label === "Back") view = "main";
    }
  };
  let walkers: Promise<void[]> | undefined;
  try {
    let killed = 0;
    while (killed < KILLS) {
      const run = spawn();
      runs.push(run);
      await run.lines.next("ready").catch(async (error) => {
        throw new Error(`${error.message}\nstderr: ${await run.stderr}`);
      });
      walkers ??= Promise.all(USERS.map(walk));
      await Bun.sleep(50 + Math.random() * 400);
      run.child.kill("SIGKILL");
      await run.child.exited;
      await run.lines.ended;
      if (run.child.signalCode === "SIGKILL") killed++;
    }
    walking = false;
    const last = spawn();
    runs.push(last);
    await last.lines.next("ready");
    const stderrOfLast = async () => (await last.stderr.catch(() => "")).slice(-2000);
    // Each user's last press takes effect; then every update is settled and every message sent: a
    // duplicate would already be at the fake.
    await walkers!.catch(async (error) => {
      last.child.kill("SIGKILL");
      throw new Error(`${error.message}; stderr of the last run: ${await stderrOfLast()}`);
    });
    await untilQuiescent(db, fake, inboundIds, 30_000).catch(async (error) => {
      last.child.kill("SIGKILL");
      throw new Error(`${error.message}; stderr of the last run: ${await stderrOfLast()}`);
    });
    last.child.kill("SIGTERM");
    expect(await last.child.exited, await last.stderr).toBe(0);
    await last.lines.ended;

    const lines = runs.flatMap((r) => r.lines.all());
    expect(lines.filter((l) => l.startsWith("dead "))).toEqual([]);
    const ambiguous = new Set(lines.filter((l) => l.startsWith("ambiguous ")).map((l) => l.slice("ambiguous ".length)));

    // Messages: each owed one sent, none unasked for, none twice unless reported ambiguous.
    const times = new Map<string, number>();
    for (const sent of fake.sent) {
      const key = `${sent.chatId}|${sent.params.text}`;
      times.set(key, (times.get(key) ?? 0) + 1);
    }
    expect([...times.keys()].filter((k) => !keyOf.has(k)), "messages no update asked for").toEqual([]);
    expect([...keyOf.keys()].filter((k) => !times.has(k)), "messages never sent").toEqual([]);
    const twice = [...times].filter(([, n]) => n > 1).map(([k]) => k);
    expect(twice.filter((k) => !ambiguous.has(keyOf.get(k)!)), "messages sent twice without an ambiguous report").toEqual([]);

    // Presses: each answered once, or its query expired before any answer; each `+1` applied once.
    const answers = new Map<string, number>();
    for (const q of fake.answeredCallbacks) answers.set(q, (answers.get(q) ?? 0) + 1);
    expect([...answers].filter(([, n]) => n > 1), "presses answered twice").toEqual([]);
    const expired = presses.filter((p) => !answers.has(p.query));
    expect(expired.filter((p) => !refused(p.query)), "presses neither answered nor expired").toEqual([]);
    const store = new SQLiteStore({ file: db });
    const opened = await openBackend(`sqlite:${db}`);
    let doubled = 0;
    let lost = 0;
    try {
      for (const chat of USERS) {
        const stored = (await store.get(String(chat))) as Record<string, unknown> | undefined;
        expect(stored?.[MARK], `chat ${chat}: an envelope`).toBe(1);
        expect((await opened.backend.inbox.get(String(stored!.by)))?.state ?? "done", `chat ${chat}: the last writer`).toBe("done");
        const session = stored!.v as { count: number; presses: string[] };
        const plusOnes = presses.filter((p) => p.chat === chat && p.label === "+1").map((p) => p.query);
        const applied = new Map<string, number>();
        for (const q of session.presses) applied.set(q, (applied.get(q) ?? 0) + 1);
        doubled += [...applied.values()].filter((n) => n > 1).length;
        lost += plusOnes.filter((q) => !applied.has(q)).length;
        expect(session.count, `chat ${chat}: the counter`).toBe(plusOnes.length);
        expect([...session.presses].sort(), `chat ${chat}: each +1 once`).toEqual([...plusOnes].sort());
        // The counter's edits: each count shown once, the menu's keyboard kept.
        const menu = menus.get(chat)!;
        const edits = fake.edits.filter((e) => e.chatId === String(chat) && e.messageId === menu).map((e) => e.text);
        expect(edits, `chat ${chat}: the edits`).toEqual(plusOnes.map((_, i) => `Count: ${i + 1}`));
        expect(fake.message(chat, menu)!.text).toBe(`Count: ${plusOnes.length}`);
      }
    } finally {
      await opened.close();
      await store.close();
    }
    expect(doubled).toBe(0);
    expect(lost).toBe(0);
    const answerCalls = fake.calls.filter((c) => c.method === "answerCallbackQuery");
    const by = (label: Label) => presses.filter((p) => p.label === label).length;
    console.log(
      `grammy menu kill: ${KILLS} SIGKILLs, ${USERS.length} users, ${presses.length} presses ` +
        `(+1 ${by("+1")}, Hi ${by("Hi")}, More ${by("More")}, Say ${by("Say")}, Back ${by("Back")}), 0 lost, ${doubled} applied twice, ` +
        `${answers.size} answered once, ${expired.length} expired unanswered, ${answerCalls.length} answer calls ` +
        `(${answerCalls.filter((c) => c.status === 400).length} refused as repeats or expired), ` +
        `${fake.edits.length} text edits, ${fake.markupEdits.length} keyboard edits, ` +
        `${fake.sent.length} messages (${keyOf.size} owed), ${ambiguous.size} ambiguous reports, ${twice.length} sent twice (all reported)`,
    );
  } finally {
    walking = false;
    for (const run of runs) run.child.kill("SIGKILL");
    await fake.stop();
  }
}, 120_000);
