// A Bot on PostgresDurability while its server connections are killed and the server refuses new
// ones for a while. The bot reports errors, a message whose admission failed is not dispatched
// (`receive` reports it rejected, so the channel redelivers it), everything journaled before stays,
// and once the server is back (the porsager client reconnects on its own) new messages and the
// redeliveries are processed, without restarting the bot.
//
// The bot's client runs on a database of its own (created and dropped here), so that the outage
// (ALTER DATABASE … ALLOW_CONNECTIONS false) touches nothing else on the server.
import { afterAll, describe, expect, test } from "bun:test";
import postgres from "postgres";
import { Bot } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";

const skip = await serviceSkip("postgres");
const admin = skip ? null : postgres(POSTGRES_URL, { max: 2, onnotice: () => {} });
const databases: string[] = [];

// Dropping the test's databases waits for the server to end their sessions: on a loaded machine, longer
// than the default hook timeout.
afterAll(async () => {
  for (const db of databases) await admin!.unsafe(`DROP DATABASE IF EXISTS "${db}" WITH (FORCE)`);
  await admin?.end();
}, 60_000);

async function until(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 10_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (!(await check())) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 10));
  }
}

/** The server processes of the bot's client (by its application_name). */
async function botBackends(app: string): Promise<{ pid: number; waiting: boolean; query: string }[]> {
  const rows = await admin!.unsafe(
    `SELECT pid, wait_event_type = 'Lock' AS waiting, query FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()`,
    [app],
  );
  return rows.map((r) => ({ pid: Number(r.pid), waiting: r.waiting === true, query: String(r.query) }));
}

async function killBot(app: string): Promise<number> {
  const rows = await admin!.unsafe(
    `SELECT pg_terminate_backend(pid) AS killed FROM pg_stat_activity WHERE application_name = $1 AND pid <> pg_backend_pid()`,
    [app],
  );
  return rows.filter((r) => r.killed === true).length;
}

describe.skipIf(Boolean(skip))("postgres outage", () => {
  test("connections killed while messages arrive, then the server refuses connections, then comes back", async () => {
    const db = `bm_outage_${runId()}`;
    databases.push(db);
    await admin!.unsafe(`CREATE DATABASE "${db}"`);
    const url = new URL(POSTGRES_URL);
    url.pathname = `/${db}`;
    const app = `bm-outage-${runId()}`;
    const sql = postgres(url.toString(), {
      max: 4,
      onnotice: () => {},
      connection: { application_name: app },
      connect_timeout: 2,
      // The backend uses no array types. With the default (true), porsager 3.4 runs a type query on
      // each new connection and leaves its rejection unhandled when that connection is killed
      // during it (an unhandled rejection ends a Node process).
      fetch_types: false,
    });
    const backend = new PostgresDurability({ sql, schema: "bots" });
    const provider = new MockProvider();
    // admitTimeoutMs: under load, porsager 3.4 can lose a query issued while its connections fail (it never
    // settles); the bot then answers rejected after this long rather than hanging the channel.
    const bot = new Bot({
      provider,
      durability: { backend, instanceId: `outage-${runId()}`, sweepIntervalMs: 50, inbox: { admitTimeoutMs: 3000 } },
    });
    const handled: string[] = [];
    const errors: Error[] = [];
    bot.on("error", (error: Error) => errors.push(error));
    bot.when(/.*/, async (ctx) => {
      handled.push(ctx.inboundId);
      await ctx.reply(`echo ${ctx.message.text}`);
    });
    await bot.start();
    const lockTx = postgres(url.toString(), { max: 1, onnotice: () => {} });
    try {
      expect((await provider.receive({ id: "m1", chatId: "c1", text: "one" })).status).toBe("admitted");
      await bot.idle();
      await until("the first reply", async () => (await backend.outbox.list({ state: "sent" })).length === 1);
      expect(handled).toEqual(["m1"]);

      // (1) Admissions in flight when the connections die: hold them on a table lock, then kill.
      let release!: () => void;
      const released = new Promise<void>((resolve) => release = resolve);
      const locked = new Promise<void>((resolve) => {
        lockTx.begin(async (tx) => {
          await tx.unsafe(`LOCK TABLE bots.botmesh_inbox IN ACCESS EXCLUSIVE MODE`);
          resolve();
          await released;
        }).catch(() => {}); // ended in `finally` when the test failed before releasing it
      });
      await locked;
      const inFlight = [
        provider.receive({ id: "m2", chatId: "c1", text: "two" }),
        provider.receive({ id: "m3", chatId: "c2", text: "three" }),
      ];
      // Both admissions sent and waiting on the lock (not queued in the client behind a sweep): issued
      // together, they are one group commit, pipelined on one connection, the first one waiting.
      const admitting = (b: { waiting: boolean; query: string }) => b.waiting && b.query.includes(`INSERT INTO "bots"."botmesh_inbox"`);
      await until("the admissions to wait on the lock", async () => (await botBackends(app)).filter(admitting).length >= 1);
      expect(await killBot(app)).toBeGreaterThanOrEqual(1);
      const during = await Promise.all(inFlight);
      expect(during.map((r) => r.status), "admissions cut off are refused, so the channel redelivers").toEqual(["rejected", "rejected"]);
      expect(errors.length, "the bot reported the failure").toBeGreaterThan(0);
      expect(errors.some((e) => /Postgres inbox\.admit on "bots"\."botmesh_inbox" failed/.test(e.message + String(e.cause)))).toBe(true);
      release();
      await bot.idle();
      expect(handled, "nothing refused was dispatched").toEqual(["m1"]);

      // (2) The server refuses connections for a while: sweeps and admissions fail, the bot keeps running.
      await admin!.unsafe(`ALTER DATABASE "${db}" ALLOW_CONNECTIONS false`);
      await killBot(app);
      await until("the bot's connections to be gone", async () => (await botBackends(app)).length === 0);
      const errorsBefore = errors.length;
      const refused = await provider.receive({ id: "m4", chatId: "c1", text: "four" });
      expect(refused.status).toBe("rejected");
      await new Promise((resolve) => setTimeout(resolve, 300)); // sweeps fail meanwhile
      expect(errors.length).toBeGreaterThan(errorsBefore);
      expect(handled).toEqual(["m1"]);

      // (3) Back: the client reconnects on its own; redeliveries and new messages are processed by the same bot.
      await admin!.unsafe(`ALTER DATABASE "${db}" ALLOW_CONNECTIONS true`);
      const errorsBack = errors.length;
      const answers: string[] = [];
      // A connection attempt or a connection killed during the outage may still fail one more statement.
      // Under load (the suites share two cores) the pool's first good connection can take over 10 s.
      await until("the client to reconnect", () => backend.inbox.get("m1").then(() => true, () => false), 25_000);
      // The channel redelivers what was refused (a connection that died during the outage may still
      // refuse one more statement before the pool replaces it).
      for (const [id, chatId, text] of [["m2", "c1", "two"], ["m3", "c2", "three"], ["m4", "c1", "four"], ["m5", "c1", "five"]]) {
        let status = "";
        for (let attempt = 0; attempt < 5 && status !== "admitted"; attempt++) {
          const r = await provider.receive({ id: id!, chatId: chatId!, text: text! });
          status = r.status;
          answers.push(`${id} ${r.status}`);
          // Refused by the server, or a query the client left unsettled (admitTimeoutMs): redelivered either way.
          if (r.status === "rejected") expect(r.error.message).toMatch(/Postgres inbox\.admit|durability\.inbox\.admitTimeoutMs/);
        }
        expect(status, id).toBe("admitted");
      }
      await bot.idle();
      await until("the replies to be sent", async () => (await backend.outbox.list({ state: "sent" })).length === 5);
      // (On failure: the order the handlers ran in, and what the bot reported since the server came back.)
      const story = `answers ${answers.join(", ")}; handled ${handled.join(",")}; bot errors since: ${errors.slice(errorsBack).map((e) => e.message).join(" | ") || "-"}`;
      expect([...handled].sort(), `each refused message ran once, after its redelivery (${story})`).toEqual(["m1", "m2", "m3", "m4", "m5"]);
      expect(provider.sent.filter((s) => s.chatId === "c1").map((s) => s.content)).toEqual([
        "echo one",
        "echo two",
        "echo four",
        "echo five",
      ]);
      // Everything journaled stays.
      expect((await backend.inbox.list()).map((r) => [r.id, r.state])).toEqual([
        ["m1", "done"],
        ["m2", "done"],
        ["m3", "done"],
        ["m4", "done"],
        ["m5", "done"],
      ]);
    } finally {
      await admin!.unsafe(`ALTER DATABASE "${db}" ALLOW_CONNECTIONS true`).catch(() => {});
      await bot.stop();
      await lockTx.end({ timeout: 1 });
      await sql.end({ timeout: 1 });
    }
  }, 50_000);
});
