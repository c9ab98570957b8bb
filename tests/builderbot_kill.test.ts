// A BuilderBot bot on DurableMetaProvider (tests/fixtures/builderbot_bot.ts, on SQLite) SIGKILLed at
// random moments while users go through a capture flow of three questions (size, colour, quantity),
// their messages delivered as Meta does (signed, again until answered 200), every other order started
// by a custom event (provider.dispatch: its keyword encrypted with a key of each start), and started
// again each time. At the end: no message lost, no reply sent twice (but a send cut off during its Graph call,
// reported ambiguous and sent again), never the welcome flow, and each user's replies exactly the
// questions and order summaries of their orders, in order, with the answers they gave.
import { expect, test } from "bun:test";
import { join } from "node:path";
import type { InboundState, OutboxState } from "../backend.ts";
import { countRecords, openBackend } from "../ops.ts";
import { KillRuns, killTestDir, spawnFixture } from "./support/kill_harness.ts";
import { FakeWhatsApp, inbound, makeWamid, webhookPayload } from "./support/fake_whatsapp.ts";

const dir = killTestDir("builderbot-kill", "BUILDERBOT_KEEP");
const KILLS = Number(process.env.BUILDERBOT_KILLS ?? 25);
const USERS = 5;

const TOKEN = "EAAG-kill-access-token";
const PHONE = "106540352242922";
const SECRET = "app-secret-kill-0123456789";

const SETTLED_INBOX: ReadonlySet<string> = new Set<InboundState>(["done", "dead"]);
const SETTLED_OUTBOX: ReadonlySet<string> = new Set<OutboxState>(["sent", "dead", "unknown"]);

/** Resolves once the bot's journal is quiescent: every message settled, every send settled and received. */
async function untilQuiescent(db: string, fake: FakeWhatsApp, ids: string[], timeoutMs: number): Promise<void> {
  const opened = await openBackend(`sqlite:${db}`);
  const deadline = Date.now() + timeoutMs;
  let last = "not checked yet";
  try {
    for (;;) {
      const counts = await countRecords(opened.backend, 1);
      const active = [
        ...Object.entries(counts.inbox).filter(([s, n]) => n > 0 && !SETTLED_INBOX.has(s)).map(([s]) => `inbox ${s}`),
        ...Object.entries(counts.outbox).filter(([s, n]) => n > 0 && !SETTLED_OUTBOX.has(s)).map(([s]) => `outbox ${s}`),
      ];
      const settled = new Set((await opened.backend.inbox.list({ state: ["done", "dead"], limit: 1_000_000 })).map((r) => r.id));
      const unsettled = ids.filter((id) => !settled.has(id));
      const received = new Set(fake.sent.map((s) => s.wamid));
      const unseen = (await opened.backend.outbox.list({ state: "sent", limit: 1_000_000 })).filter((e) => !received.has(e.messageId ?? undefined));
      last = active.length > 0
        ? `records still active (${active.join(", ")})`
        : unsettled.length > 0
        ? `${unsettled.length} messages not settled`
        : unseen.length > 0
        ? `${unseen.length} sends journaled as sent the fake never received`
        : "";
      if (last === "") return;
      if (Date.now() > deadline) throw new Error(`the bot was not quiescent within ${timeoutMs} ms: ${last}`);
      await Bun.sleep(50);
    }
  } finally {
    await opened.close();
  }
}

test(`a BuilderBot bot SIGKILLed ${KILLS} times mid-flow: 0 lost, 0 duplicate replies, every flow finished with the right answers`, async () => {
  const fake = FakeWhatsApp.start({ accessToken: TOKEN, phoneNumberId: PHONE, appSecret: SECRET });
  const db = join(dir, "builderbot.db");
  let port: number | null = null;
  let killing = true;
  let aborted = false;
  const ids: string[] = [];
  /** Per user, the replies it must get, in order. */
  const expected = new Map<string, string[]>();
  const users = Array.from({ length: USERS }, (_, i) => `1650555${String(1000 + i)}`);

  /** Deliver one text as Meta does (signed, again after a pause until answered 200), or dispatch the PEDIDO event so. */
  const deliver = async (user: string, text: string): Promise<void> => {
    const id = makeWamid();
    if (text !== "PEDIDO") ids.push(id);
    const payload = webhookPayload(PHONE, { messages: [inbound.text(user, text, id)], contacts: [{ wa_id: user, profile: { name: user } }] });
    for (;;) {
      if (aborted) throw new Error("the test ended");
      if (port !== null) {
        const post = text === "PEDIDO"
          ? fetch(`http://127.0.0.1:${port}/dispatch?from=${user}&id=${id}`, { method: "POST" }).then(async (r) => (await r.arrayBuffer(), r.status))
          : fake.post(`http://127.0.0.1:${port}/webhook`, payload).then((r) => r.status);
        const status = await post.catch(() => 0);
        if (status === 200) return;
      }
      await Bun.sleep(20);
    }
  };
  // Each user orders again and again while the bot is being killed, then finishes the order under way.
  const senders = users.map(async (user, u) => {
    const replies: string[] = [];
    expected.set(user, replies);
    for (let o = 0; killing || o === 0; o++) {
      const [size, colour, qty] = [`T${u}-${o}`, `c${u}-${o}`, String(u * 10 + o + 1)];
      // Every other order starts with the custom event (bot.dispatch from an HTTP route) instead of the text.
      for (const text of [o % 2 === 0 ? "pedido" : "PEDIDO", size, colour, qty]) {
        await deliver(user, text);
        await Bun.sleep(20 + Math.random() * 150);
      }
      replies.push("¿Qué talla?", "¿Qué color?", "¿Cuántas?", `Pedido: talla ${size}, color ${colour}, ${qty} unidades`);
    }
  });

  const runs = new KillRuns(() => spawnFixture(["tests/fixtures/builderbot_bot.ts", db, fake.url, TOKEN, PHONE, SECRET], "BuilderBot bot"));
  const ready = (line: string) => (port = Number(line.split(" ")[1]));
  const started = Date.now();
  try {
    await runs.killRepeatedly(KILLS, { ready, killed: () => (port = null) });
    killing = false;
    ready(await runs.startLast());
    await Promise.all(senders);
    await runs.orKillLast(untilQuiescent(db, fake, ids, 30_000));
    await runs.stopLast();

    expect(runs.deadLines()).toEqual([]);
    const ambiguous = runs.ambiguousKeys();
    // Sends of one outbox key (`<inbound wamid>:<n>`) the fake took more than once: only ambiguous ones may.
    const byKey = new Map<string, number>();
    for (const s of fake.sent) {
      const key = String(s.body.biz_opaque_callback_data);
      byKey.set(key, (byKey.get(key) ?? 0) + 1);
    }
    const twice = [...byKey].filter(([, n]) => n > 1).map(([key]) => key);
    expect(twice.filter((key) => !ambiguous.has(key)), "replies sent twice without an ambiguous report").toEqual([]);
    let lost = 0;
    let orders = 0;
    for (const user of users) {
      const seen = new Set<string>();
      const got = fake.sent.filter((s) => s.body.to === user).filter((s) => {
        const key = String(s.body.biz_opaque_callback_data);
        if (seen.has(key)) return false; // an ambiguous send sent again: counted once
        seen.add(key);
        return true;
      }).map((s) => String(s.body.text?.body));
      const want = expected.get(user)!;
      orders += want.length / 4;
      lost += want.filter((t) => !got.includes(t)).length;
      expect(got, `the replies of ${user}`).toEqual(want);
    }
    const messages = ids.length;
    console.log(
      `builderbot kill: ${KILLS} SIGKILLs, ${USERS} users, ${orders} orders (${messages} messages), ${fake.sent.length} replies, ` +
        `${ambiguous.size} ambiguous reports, ${twice.length} sent twice (all reported), ${lost} lost, ${Date.now() - started} ms`,
    );
    expect(lost).toBe(0);
  } finally {
    killing = false;
    aborted = true;
    port = null;
    await Promise.allSettled(senders);
    runs.killAll();
    fake.close();
  }
}, 120_000);
