// A grammY bot with @grammyjs/conversations v2 and sessions, made crash-safe with
// @botmesh/durable/grammy (durableStorage on SQLite for both, durableConversations among the
// conversations' plugins), SIGKILLed at random moments while users walk through a four-step
// conversation with a button, restarted each time, with the inbox's default settings. Each user
// answers a prompt once it has arrived, as people do, and starts a new conversation once one is over.
// At the end: no update lost, no reply sent twice unless the restarted process reported its send
// ambiguous (killed during its Bot API call; sent again under onAmbiguous: "resend"), and every
// conversation completed exactly once (its order counted once in the session).
import { expect, test } from "bun:test";
import { join } from "node:path";
import { openBackend } from "../ops.ts";
import { SQLiteStore } from "../backends/sqlite/mod.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { KillRuns, killTestDir, sentCounts, spawnFixture } from "./support/kill_harness.ts";
import { SESSION_MARK } from "./support/plugin_kills.ts";
import { untilQuiescent } from "./support/quiescence.ts";

const dir = killTestDir("grammy-conversation-kill", "GRAMMY_KEEP");
const KILLS = Number(process.env.GRAMMY_KILLS ?? 20);
const USERS = Array.from({ length: 12 }, (_, i) => 701 + i);

test(`grammY conversations v2, the bot SIGKILLed ${KILLS} times while ${USERS.length} users walk through them: none lost, none twice`, async () => {
  const fake = new FakeTelegram().start();
  const db = join(dir, "conversations.db");
  const runs = new KillRuns(() => spawnFixture(["tests/fixtures/grammy_conversation_bot.ts", db, fake.url, fake.token], "grammY conversation bot"));
  const inboundIds: string[] = [];
  /** Each reply the bot owes → the outbox key it goes out under: <inbound id of its update>:<n>. */
  const keyOf = new Map<string, string>();
  const rounds = new Map<number, number>(USERS.map((u) => [u, 0]));
  const sentTexts = (chat: number) => new Set(fake.sent.filter((s) => s.chatId === String(chat)).map((s) => String(s.params.text)));
  /** The user sends `update`, then waits for the replies it owes. */
  const say = async (chat: number, update: Record<string, unknown>, replies: string[]) => {
    const id = fake.inboundId(fake.push(update));
    inboundIds.push(id);
    replies.forEach((reply, i) => keyOf.set(reply, `${id}:${i + 1}`));
    await fake.until(`${JSON.stringify(replies)} in chat ${chat}`, () => {
      const got = sentTexts(chat);
      return replies.every((r) => got.has(r));
    }, 30_000);
  };
  let walking = true;
  const walk = async (chat: number) => {
    for (let round = 1; round === 1 || walking; round++) {
      const tag = `c${chat}r${round}`;
      const size = round % 2 === 0 ? "S" : "M";
      const start = `/start ${tag}`;
      await say(chat, fake.textUpdate(chat, start, { entities: [{ type: "bot_command", offset: 0, length: 6 }] }), [`${tag}: name?`]);
      await say(chat, fake.textUpdate(chat, `name of ${tag}`), [`${tag}: size?`]);
      await say(chat, fake.callbackUpdate(chat, `size:${size}`), [`${tag}: how many?`]);
      await say(chat, fake.textUpdate(chat, String(round + 1)), [`${tag}: ${round + 1} × ${size}`, `${tag}: done, order #${round}`]);
      rounds.set(chat, round);
    }
  };
  let walkers: Promise<void[]> | undefined;
  try {
    await runs.killRepeatedly(KILLS, { ready: () => (walkers ??= Promise.all(USERS.map(walk))) });
    walking = false;
    await runs.startLast();
    // Each user finishes the conversation under way; then every update is settled and every reply sent:
    // a duplicate would already be at the fake.
    await runs.orKillLast(walkers!);
    await runs.orKillLast(untilQuiescent(db, fake, inboundIds, 30_000));
    await runs.stopLast();

    expect(runs.deadLines()).toEqual([]);
    const ambiguous = runs.ambiguousKeys();
    const counts = sentCounts(fake);
    const unexpected = [...counts.keys()].filter((text) => !keyOf.has(text));
    expect(unexpected, "replies no update asked for").toEqual([]);
    const lost = [...keyOf.keys()].filter((text) => !counts.has(text));
    expect(lost, "replies never sent").toEqual([]);
    const twice = [...counts].filter(([, n]) => n > 1).map(([text]) => text);
    const unreported = twice.filter((text) => !ambiguous.has(keyOf.get(text)!));
    expect(unreported, "replies sent twice without an ambiguous report").toEqual([]);

    // Every conversation completed once: the session counted each user's orders once, and no
    // conversation is left under way.
    const store = new SQLiteStore({ file: db });
    const opened = await openBackend(`sqlite:${db}`);
    const resolved = async (key: string) => {
      const stored = (await store.get(key)) as Record<string, unknown> | undefined;
      if (stored === undefined) return undefined;
      expect(stored[SESSION_MARK], `${key}: an envelope`).toBe(1);
      expect((await opened.backend.inbox.get(String(stored.by)))?.state ?? "done", `${key}: its last writer`).toBe("done");
      return stored.v;
    };
    try {
      for (const chat of USERS) {
        expect(await resolved(String(chat)), `chat ${chat}: the session`).toEqual({ orders: rounds.get(chat) });
        expect(await resolved(`conversation:${chat}`), `chat ${chat}: no conversation under way`).toBeUndefined();
      }
    } finally {
      await opened.close();
      await store.close();
    }
    const conversationsDone = [...rounds.values()].reduce((a, b) => a + b, 0);
    const presses = fake.calls.filter((c) => c.method === "answerCallbackQuery").length;
    console.log(
      `grammy conversations kill: ${KILLS} SIGKILLs, ${USERS.length} users, ${conversationsDone} conversations completed once, ` +
        `${inboundIds.length} updates, 0 lost, ${fake.sent.length} replies (${keyOf.size} owed), ${ambiguous.size} ambiguous reports, ` +
        `${twice.length} replies sent twice (all reported), ${presses} button answers for ${conversationsDone} presses`,
    );
  } finally {
    walking = false;
    runs.killAll();
    await fake.stop();
  }
}, 120_000);
