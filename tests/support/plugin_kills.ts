/**
 * The kill tests the grammY and Telegraf plugins share, run on a fixture bot of either (see
 * tests/grammy_kill.test.ts, tests/telegraf_kill.test.ts and the session ones).
 */
import { expect } from "bun:test";
import { join } from "node:path";
import { openBackend } from "../../ops.ts";
import { SQLiteStore } from "../../backends/sqlite/mod.ts";
import { childLines } from "./child_lines.ts";
import { FakeTelegram } from "./fake_telegram.ts";
import { KillRuns, sentCounts, spawnFixture, streamUpdates } from "./kill_harness.ts";
import { untilQuiescent } from "./quiescence.ts";

/** The key that marks a stored session value as an envelope of durableStorage. */
export const SESSION_MARK = "@botmesh/durable:session";

/** A fixture bot of a plugin's kill test. */
export interface KillFixture {
  /** The plugin, in the summary line (`grammy`, `telegraf`). */
  readonly name: string;
  /** The fixture's script. */
  readonly script: string;
  /** Names the bot in timeout errors. */
  readonly label: string;
  /** How many SIGKILLs. */
  readonly kills: number;
  /** The scratch folder. */
  readonly dir: string;
}

/**
 * The bot (two replies per update, on SQLite) SIGKILLed `kills` times while updates stream in, by long
 * polling or by webhook (delivered again until answered 200, as Telegram does): at the end every
 * update got both its replies, and a reply went out twice only where a restarted run reported the
 * send as ambiguous.
 *
 * @param fixture the bot
 * @param mode how updates reach it (its fixture's argument)
 * @returns resolves when the test passed
 */
export async function repliesKillRun(fixture: KillFixture, mode: string): Promise<void> {
  const chats = [501, 502, 503, 504];
  const fake = new FakeTelegram().start();
  const db = join(fixture.dir, `${mode}.db`);
  /** The webhook of the process running now (webhook mode), `null` while none runs. */
  let port: number | null = null;
  const queues = new Map<number, Record<string, unknown>[]>(chats.map((c) => [c, []]));
  let delivering = true;
  // Telegram's side of a webhook: per chat, each update in turn, delivered again until answered 200.
  const deliverers = mode !== "webhook" ? [] : chats.map(async (chat) => {
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
  const runs = new KillRuns(() => spawnFixture([fixture.script, db, fake.url, fake.token, mode], fixture.label));
  const texts: string[] = [];
  const inboundIds = new Map<string, string>();
  const stopStream = streamUpdates((i) => {
    const text = `u${i}`;
    texts.push(text);
    const chat = chats[i % chats.length]!;
    const update = fake.textUpdate(chat, text);
    if (mode !== "webhook") fake.push(update);
    else queues.get(chat)!.push(update);
    inboundIds.set(text, fake.inboundId(update));
  }, 20);
  const listen = (ready: string) => {
    if (mode === "webhook") port = Number(ready.split(" ")[1]);
  };
  try {
    await runs.killRepeatedly(fixture.kills, { ready: listen, killed: () => (port = null) });
    await stopStream();
    listen(await runs.startLast());
    delivering = false;
    await Promise.all(deliverers);
    const replies = () => new Set(fake.sent.map((s) => String(s.params.text)));
    await fake.until("every reply", () => {
      const got = replies();
      return texts.every((t) => got.has(`1 ${t}`) && got.has(`2 ${t}`));
    }, 60_000).catch(async (error) => {
      const got = replies();
      const missing = texts.filter((t) => !got.has(`1 ${t}`) || !got.has(`2 ${t}`));
      const dead = runs.deadLines().slice(0, 5);
      runs.last.child.kill("SIGKILL");
      throw new Error(
        `${error.message}: ${missing.length} missing, the first ${JSON.stringify(missing.slice(0, 10).map((t) => [t, inboundIds.get(t), got.has(`1 ${t}`), got.has(`2 ${t}`)]))}; ` +
          `dead: ${JSON.stringify(dead)}; stderr of the last run: ${await runs.lastStderr()}`,
      );
    });
    // Every update settled, no send under way or due, every send journaled as sent at the fake: the
    // last run sends nothing more, so a duplicate would already be counted below.
    await runs.orKillLast(untilQuiescent(db, fake, inboundIds.values(), 30_000));
    await runs.stopLast();

    expect(runs.deadLines()).toEqual([]);
    const ambiguous = runs.ambiguousKeys();
    const counts = sentCounts(fake);
    const lost = texts.filter((t) => !counts.has(`1 ${t}`) || !counts.has(`2 ${t}`));
    expect(lost, "updates without both replies").toEqual([]);
    // Reply "<n> <text>" is the n-th message-creating call of its update's handling: key <inbound id>:<n>.
    const twice = [...counts].filter(([, n]) => n > 1).map(([reply]) => reply);
    const unreported = twice.filter((reply) => !ambiguous.has(`${inboundIds.get(reply.slice(2))}:${reply.slice(0, 1)}`));
    expect(unreported, "replies sent twice without an ambiguous report").toEqual([]);
    console.log(
      `${fixture.name} kill (${mode}): ${fixture.kills} SIGKILLs, ${texts.length} updates, ${fake.sent.length} replies, ` +
        `${ambiguous.size} ambiguous reports, ${twice.length} replies sent twice (all reported), 0 lost`,
    );
  } finally {
    void stopStream();
    delivering = false;
    port = null;
    runs.killAll();
    await fake.stop();
  }
}

/**
 * The bot with sessions on SQLite through durableStorage, SIGKILLed `kills` times while updates
 * stream in by long polling: at the end each chat's session counter equals the number of its updates,
 * and its list holds each of its texts once.
 *
 * @param fixture the bot
 * @param sessionKey the key the bot's session of a private chat is stored under
 * @returns resolves when the test passed
 */
export async function sessionsKillRun(fixture: KillFixture, sessionKey: (chat: number) => string): Promise<void> {
  const chats = [601, 602, 603, 604];
  const fake = new FakeTelegram().start();
  const db = join(fixture.dir, "sessions.db");
  const runs = new KillRuns(() => spawnFixture([fixture.script, db, fake.url, fake.token], fixture.label));
  const texts = new Map<number, string[]>(chats.map((c) => [c, []]));
  const inboundIds: string[] = [];
  const stopStream = streamUpdates((i) => {
    const chat = chats[i % chats.length]!;
    const text = `u${i}`;
    texts.get(chat)!.push(text);
    inboundIds.push(fake.inboundId(fake.push(fake.textUpdate(chat, text))));
  }, 15);
  try {
    await runs.killRepeatedly(fixture.kills);
    await stopStream();
    await runs.startLast();
    // Every update settled and every reply sent: nothing more changes a session.
    await runs.orKillLast(untilQuiescent(db, fake, inboundIds, 30_000));
    await runs.stopLast();
    expect(runs.deadLines()).toEqual([]);

    const store = new SQLiteStore({ file: db });
    const opened = await openBackend(`sqlite:${db}`);
    let doubled = 0;
    let lost = 0;
    try {
      for (const chat of chats) {
        const stored = (await store.get(sessionKey(chat))) as Record<string, unknown> | undefined;
        expect(stored?.[SESSION_MARK], `chat ${chat}: an envelope`).toBe(1);
        // Written by an update that is done (or purged): its value is the session.
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
      `${fixture.name} sessions kill: ${fixture.kills} SIGKILLs, ${total} updates in ${chats.length} chats, ` +
        `${doubled} applied twice, ${lost} lost, ${fake.sent.length} replies`,
    );
    expect(doubled).toBe(0);
    expect(lost).toBe(0);
  } finally {
    void stopStream();
    runs.killAll();
    await fake.stop();
  }
}

/**
 * The plugin's example bot (a reply, a 3 s wait, a second reply), SIGKILLed inside its handler's
 * wait: the restarted bot sends the second reply only, once.
 *
 * @param example the example's script
 * @param db the SQLite file it runs on
 * @returns resolves when the test passed
 */
export async function exampleKilledMidHandler(example: string, db: string): Promise<void> {
  const fake = new FakeTelegram().start();
  const name = example.slice(example.lastIndexOf("/") + 1);
  const spawn = () =>
    Bun.spawn([process.execPath, example], {
      env: { ...process.env, TELEGRAM_TOKEN: fake.token, TELEGRAM_API: fake.url, BOT_DB: db },
      stdout: "pipe",
      stderr: "pipe",
    });
  const texts = () => fake.sent.filter((s) => s.method === "sendMessage").map((s) => String(s.params.text));
  let child = spawn();
  try {
    await childLines(child.stdout, name, 15_000).next("running");
    const update = fake.push(fake.textUpdate(4242, "hello"));
    await fake.until("the first reply", () => texts().length === 1, 15_000);
    child.kill("SIGKILL"); // inside the handler's 3 s wait: "Done." was never sent
    await child.exited;
    expect(texts()).toEqual(['Working on "hello"…']);
    child = spawn();
    await childLines(child.stdout, `${name} (restarted)`, 15_000).next("running");
    await fake.until("the second reply", () => texts().length === 2, 15_000);
    await untilQuiescent(db, fake, [fake.inboundId(update)], 15_000); // past it, a duplicate would be in texts()
    expect(texts()).toEqual(['Working on "hello"…', "Done."]);
    expect(fake.calls.filter((c) => c.method === "sendChatAction").length).toBe(2); // passed straight through, each run
  } finally {
    child.kill("SIGINT");
    expect(await child.exited).toBe(0);
    await fake.stop();
  }
}
