// The botmesh-durable CLI as a real process: Bun (`bun cli.ts`) on SQLite, file, events journals, Postgres and Redis
// (Upstash REST bridge and ioredis); Deno and Node 20 (bundled) on SQLite.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { Database } from "bun:sqlite";
import { mkdirSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { tmpdir } from "node:os";
import IORedis from "ioredis";
import postgres from "postgres";
import { FileDurability } from "../backends/file/durability.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { EventsDurability, FileEventJournal, SharedFileEventJournal } from "../backends/events/mod.ts";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { RedisDurability } from "../backends/redis/durability.ts";
import { Redis as Upstash } from "@upstash/redis";
import { BackendUrlError } from "../src/ops/cli.ts";
import { errorDetail } from "../src/errors.ts";
import { openBackend } from "../backends/open_url.ts";
import { POSTGRES_URL, REDIS_URL, runId, serviceSkip } from "./support/services.ts";
import { startUpstashBridge, type UpstashBridge } from "./support/upstash_bridge.ts";
import { bundleCliForNode } from "./support/cli_process.ts";
import { fill } from "./support/cli_fill.ts";

const root = join(import.meta.dir, "..");
const bin = join(root, "node_modules", ".bin");
const tmp = join(root, ".tmp", `cli-test-${runId()}`);
mkdirSync(tmp, { recursive: true });
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

interface Run {
  code: number;
  stdout: string;
  stderr: string;
  // deno-lint-ignore no-explicit-any
  json(): any;
}

type Runner = (args: string[]) => Promise<Run>;

async function spawn(cmd: string[], env: Record<string, string> = {}): Promise<Run> {
  const child = Bun.spawn(cmd, {
    cwd: tmp,
    stdout: "pipe",
    stderr: "pipe",
    env: { ...process.env, DENO_NO_UPDATE_CHECK: "1", BOTMESH_DURABLE_BACKEND: "", ...env },
  });
  const [stdout, stderr, code] = await Promise.all([
    new Response(child.stdout).text(),
    new Response(child.stderr).text(),
    child.exited,
  ]);
  return {
    code,
    stdout,
    stderr,
    json() {
      try {
        return JSON.parse(stdout);
      } catch {
        throw new Error(`stdout is not one JSON document (exit ${code}):\n${stdout}\nstderr:\n${stderr}`);
      }
    },
  };
}

const bun: Runner = (args) => spawn([join(bin, "bun"), join(root, "cli.ts"), ...args]);

/** Runs several commands: at once, or one after the other (a file backend admits one process at a time). */
function many(run: Runner, parallel: boolean, list: string[][]): Promise<Run[]> {
  if (parallel) return Promise.all(list.map((args) => run(args)));
  return list.reduce<Promise<Run[]>>(async (acc, args) => [...(await acc), await run(args)], Promise.resolve([]));
}

/** The whole command set against a filled backend. */
async function fullScenario(run: Runner, url: string, parallel = true): Promise<void> {
  const b = ["--backend", url];
  // Reads (and operations that change nothing) first.
  const [
    statsJson,
    statsHuman,
    deadJson,
    pendingDone,
    nobody,
    limitOne,
    outboxHuman,
    deadHuman,
    showSent,
    showDead,
    showMissing,
    replayGhost,
    retrySent,
    purgeNone,
  ] = await many(run, parallel, [
    [...b, "stats", "--json"],
    [...b, "stats"],
    [...b, "list", "inbox", "--state", "dead", "--json"],
    [...b, "list", "inbox", "--state=pending,done", "--chat", "c1", "--json"],
    [...b, "list", "inbox", "--chat", "nobody"],
    [...b, "list", "inbox", "--limit", "1", "--json"],
    [...b, "list", "outbox"],
    [...b, "list", "inbox", "--state", "dead"],
    [...b, "show", "outbox", "out-sent", "--json"],
    [...b, "show", "inbox", "in-dead"],
    [...b, "show", "inbox", "no-such-id"],
    [...b, "replay", "ghost", "--json"],
    [...b, "retry", "out-sent", "--json"],
    [...b, "purge", "--older-than", "7d", "--json"],
  ]);

  expect(statsJson!.stderr).toBe("");
  expect(statsJson!.code).toBe(0);
  let stats = statsJson!.json();
  expect(stats.inbox).toEqual({ pending: 1, processing: 0, scheduled: 0, failed: 0, done: 1, dead: 1 });
  expect(stats.outbox).toEqual({ queued: 0, sending: 0, sent: 1, failed: 0, dead: 1, unknown: 0 });
  expect(stats.counters).toBeNull();
  expect(stats.note).toContain("no counters");
  expect(stats.oldestPendingAgeSeconds).toBeGreaterThanOrEqual(119);

  expect(statsHuman!.code, statsHuman!.stderr).toBe(0);
  expect(statsHuman!.stdout).toMatch(/INBOX\s+RECORDS\npending\s+1\nprocessing\s+0\nscheduled\s+0\nfailed\s+0\ndone\s+1\ndead\s+1\n/);
  expect(statsHuman!.stdout).toContain("Counters: none. A bare backend has no counters");

  expect(deadJson!.code).toBe(0);
  const deadIn = deadJson!.json();
  expect(deadIn.map((x: { id: string }) => x.id)).toEqual(["in-dead"]);
  expect(deadIn[0]).toMatchObject({ state: "dead", chatId: "c1", attempts: 1, error: 'Handler "boom" failed\nat line 2' });

  expect(pendingDone!.json().map((x: { id: string }) => x.id).sort()).toEqual(["in-done", "in-pending"]);
  expect([nobody!.code, nobody!.stdout]).toEqual([0, "No inbox records match.\n"]);
  expect(limitOne!.json()).toHaveLength(1);

  expect(outboxHuman!.code).toBe(0);
  expect(outboxHuman!.stdout.split("\n")[0]).toMatch(/^KEY\s+STATE\s+CHAT\s+ATTEMPTS\s+CREATED\s+MESSAGE ID\s+ERROR$/);
  expect(outboxHuman!.stdout).toMatch(/out-dead\s+dead\s+c2\s+1\s+\d{4}-\d\d-\d\dT[\d:.]+Z\s+Invalid recipient/);
  expect(outboxHuman!.stdout).toMatch(/out-sent\s+sent\s+c3\s+1\s+\S+\s+msg-1/);
  expect(outboxHuman!.stdout).toContain("(2)\n");
  // A message's second line (not indented: not a stack frame) is flattened in the table.
  expect([deadHuman!.code, deadHuman!.stderr], "list inbox --state dead: exit code and stderr").toEqual([0, ""]);
  expect(deadHuman!.stdout, `list inbox --state dead printed:\n${deadHuman!.stdout}`).toContain('Handler "boom" failed at line 2');

  expect(showSent!.code).toBe(0);
  expect(showSent!.json()).toMatchObject({ key: "out-sent", state: "sent", messageId: "msg-1", content: { text: "out-sent" } });
  expect(showDead!.code).toBe(0);
  expect(showDead!.stdout).toContain("state: dead\n");
  expect(showDead!.stdout).toContain('"text": "text of in-dead"');
  expect(showMissing!.code).toBe(1);
  expect(showMissing!.stderr).toContain('Inbox record "no-such-id" not found');

  expect(replayGhost!.code).toBe(1);
  expect(replayGhost!.json()).toMatchObject({ ok: false, state: null, error: 'Inbox record "ghost" not found' });
  expect(retrySent!.code).toBe(1);
  expect(retrySent!.json()).toMatchObject({ command: "retry", key: "out-sent", ok: false, state: "sent" });
  expect(purgeNone!.code).toBe(0);
  expect(purgeNone!.json()).toEqual({ command: "purge", olderThanMs: 604_800_000, inbox: 0, outbox: 0 });

  // replay: dead → pending; a pending record cannot be replayed
  let r = await run([...b, "replay", "in-dead", "--json"]);
  expect(r.code).toBe(0);
  expect(r.json()).toEqual({ command: "replay", id: "in-dead", ok: true, state: "pending", error: null });
  r = await run([...b, "replay", "in-dead"]);
  expect(r.code).toBe(1);
  expect(r.stderr).toContain('Inbox record "in-dead" is pending');

  // retry: dead → queued
  r = await run([...b, "retry", "out-dead"]);
  expect([r.code, r.stdout]).toEqual([0, 'Outbox entry "out-dead" is queued again: a running bot sends it on its next sweep.\n']);
  r = await run([...b, "show", "outbox", "out-dead", "--json"]);
  expect(r.json()).toMatchObject({ state: "queued", attempts: 0 });

  // discard
  r = await run([...b, "discard", "out-dead", "--json"]);
  expect(r.code).toBe(0);
  expect(r.json()).toEqual({ command: "discard", key: "out-dead", ok: true, state: "queued", error: null });
  r = await run([...b, "discard", "out-dead"]);
  expect(r.code).toBe(1);
  expect(r.stderr).toContain('Outbox entry "out-dead" not found');

  // purge: everything settled is older than 0 ms
  await Bun.sleep(20);
  r = await run([...b, "purge", "--older-than", "0"]);
  expect(r.code).toBe(0);
  expect(r.stdout).toBe("Purged 1 inbox record (done) and 1 outbox entry (sent) last changed more than 0ms ago.\n");
  expect(r.stderr).toContain("purging: 1 inbox records, 0 outbox entries so far\n");
  expect(r.stderr).toContain("purging: 1 inbox records, 1 outbox entries so far\n");

  r = await run([...b, "stats", "--json"]);
  stats = r.json();
  expect(stats.inbox).toEqual({ pending: 2, processing: 0, scheduled: 0, failed: 0, done: 0, dead: 0 });
  expect(stats.outbox).toEqual({ queued: 0, sending: 0, sent: 0, failed: 0, dead: 0, unknown: 0 });
}

/** Spawning is slow on a loaded machine: each test gets this long. */
const SLOW = 60_000;

describe("botmesh-durable under Bun", () => {
  test("SQLite: list, show, replay, retry, discard, purge, stats", async () => {
    const file = join(tmp, "bot.db");
    await fill(new SQLiteDurability({ file }));
    await fullScenario(bun, `sqlite:${file}`);
    // the relative form and a bare path open the same file
    let r = await bun(["-b", "sqlite:./bot.db", "list", "inbox", "--json"]);
    expect(r.json()).toHaveLength(2);
    r = await bun(["list", "inbox", "--json", "-b", "./bot.db"]);
    expect(r.json()).toHaveLength(2);
    r = await spawn([join(bin, "bun"), join(root, "cli.ts"), "list", "inbox", "--json"], {
      BOTMESH_DURABLE_BACKEND: `sqlite://${file}`,
    });
    expect(r.json()).toHaveLength(2);
  }, SLOW);

  test("SQLite: a damaged row is set aside: list shows the others, damaged lists it with its problem, show names it", async () => {
    const file = join(tmp, "damaged.db");
    await fill(new SQLiteDurability({ file }));
    const raw = new Database(file);
    raw.exec(`UPDATE botmesh_inbox SET payload = '{"text":' WHERE id = 'in-dead'`);
    raw.close();
    const b = ["-b", `sqlite:${file}`];
    let r = await bun([...b, "list", "inbox", "--json"]);
    expect([r.code, r.stderr]).toEqual([0, ""]);
    expect(r.json().map((x: { id: string }) => x.id)).toEqual(["in-pending", "in-done"]);
    r = await bun([...b, "list", "inbox", "--state", "dead"]);
    expect([r.code, r.stdout]).toEqual([0, "No inbox records match.\n"]);
    r = await bun([...b, "damaged"]);
    expect(r.code).toBe(0);
    expect(r.stdout.split("\n")[0]).toMatch(/^JOURNAL\s+ID\s+SET ASIDE\s+REPORTED\s+PROBLEM$/);
    expect(r.stdout).toMatch(/inbox\s+in-dead\s+\d{4}-\d\d-\d\dT[\d:.]+Z\s+no\s+column payload is not valid JSON/);
    expect(r.stdout).toContain("(1)\n");
    r = await bun([...b, "damaged", "--json"]);
    expect(r.code).toBe(0);
    const found = r.json();
    expect(found).toMatchObject([{ journal: "inbox", id: "in-dead", backend: "sqlite", reported: false }]);
    expect(found[0].problem).toMatch(/^column payload is not valid JSON/);
    expect(typeof found[0].setAsideAt).toBe("number");
    r = await bun([...b, "show", "inbox", "in-dead"]);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain('Inbox record "in-dead" in backend "sqlite" is damaged and set aside: column payload is not valid JSON');
    // Kept as stored.
    const check = new Database(file);
    expect(check.prepare("SELECT payload, state FROM botmesh_inbox WHERE id = 'in-dead'").get())
      .toEqual({ payload: '{"text":', state: "dead" });
    check.close();
  }, SLOW);

  test("SQLite: a handler's error with causes and stack frames: the table shows the message and causes, show and --json all of it", async () => {
    const file = join(tmp, "stack.db");
    await fill(new SQLiteDurability({ file }));
    const error = errorDetail(new Error("quota exceeded", { cause: new TypeError("socket closed") }));
    expect(error).toMatch(/^Error: quota exceeded\nCaused by: TypeError: socket closed\n {4}at .*cli\.test\.ts/);
    const raw = new Database(file);
    raw.prepare(`UPDATE botmesh_inbox SET error = ? WHERE id = 'in-dead'`).run(error);
    raw.close();
    const b = ["-b", `sqlite:${file}`];
    const [table, show, json] = await Promise.all([
      bun([...b, "list", "inbox", "--state", "dead"]),
      bun([...b, "show", "inbox", "in-dead"]),
      bun([...b, "list", "inbox", "--state", "dead", "--json"]),
    ]);
    expect(table.code).toBe(0);
    expect(table.stdout.split("\n")[1]).toMatch(/^in-dead\s+dead\s+c1\s+message\s+1\s+\S+\s+Error: quota exceeded; caused by TypeError: socket closed$/);
    expect(table.stdout).not.toContain("cli.test.ts");
    expect(show.stdout).toContain(`error: ${error.replace(/\n/g, "\n  ")}\n`); // its lines indented under the field
    expect(json.json()[0].error).toBe(error);
  }, SLOW);

  test("file backend: the same commands", async () => {
    const path = join(tmp, "bot.json");
    await fill(new FileDurability({ path }));
    await fullScenario(bun, `file:${path}`, false);
    const r = await bun(["-b", "./bot.json", "stats", "--json"]);
    expect(r.json().inbox.pending).toBe(2);
  }, SLOW);

  test("events journals: events+file: (FileEventJournal, its lock taken) and events+shared: (SharedFileEventJournal)", async () => {
    const plain = join(tmp, "events.json");
    const journal = await FileEventJournal.open(plain, { lock: true });
    await fill(new EventsDurability({ journal }));
    await journal.append({ id: "app-1", channel: "orders", eventType: "created", payload: {}, createdAt: Date.now() });
    await journal.close();
    await fullScenario(bun, `events+file:${plain}`, false);
    let r = await bun(["-b", `events+file:${plain}`, "stats"]);
    expect(r.stdout).toContain(`Backend: events+file ${plain}`);
    // Only the bot's channel is the inbox: the app's own events are not listed.
    r = await bun(["-b", `events+file:${plain}`, "list", "inbox", "--json"]);
    expect(r.json().map((x: { id: string }) => x.id).sort()).toEqual(["in-dead", "in-pending"]);

    const shared = join(tmp, "shared-events.json");
    const sharedJournal = await SharedFileEventJournal.open(shared, { appendLog: true });
    await fill(new EventsDurability({ journal: sharedJournal }));
    await sharedJournal.close();
    await fullScenario(bun, `events+shared:${shared}`, false);

    // A FileEventJournal is one process's: the CLI says so while it is open.
    const held = await FileEventJournal.open(plain, { lock: true });
    try {
      r = await bun(["-b", `events+file:${plain}`, "stats"]);
      expect(r.code).toBe(1);
      expect(r.stderr).toContain(`Cannot open events journal ${JSON.stringify(plain)}`);
      expect(r.stderr).toContain("stop the bot first");
      r = await bun(["-b", `events+shared:${plain}`, "stats"]);
      expect(r.code).toBe(1);
      expect(r.stderr).toContain("the bot uses a FileEventJournal: stop it, then open the file with events+file:");
    } finally {
      await held.close();
    }
  }, SLOW);

  test("usage errors exit 2 with the usage on stderr; errors name the argument", async () => {
    const file = join(tmp, "usage.db");
    await fill(new SQLiteDurability({ file }));
    const b = ["-b", file];
    const cases: Array<[string[], RegExp]> = [
      [[...b, "frobnicate"], /Unknown command "frobnicate"; commands are list, show/],
      [[...b, "list", "inbox", "--bogus"], /Unknown flag "--bogus"/],
      [[...b, "list", "inbox", "-x"], /Unknown flag "-x"/],
      [[...b, "list", "mailbox"], /"list" takes "inbox" or "outbox", got "mailbox"/],
      [[...b, "list"], /"list" needs <inbox\|outbox>/],
      [[...b, "list", "inbox", "--limit", "ten"], /Flag "--limit" must be a positive integer, got "ten"/],
      [[...b, "list", "inbox", "--state", "zombie"], /Flag "--state" has "zombie", not a inbox state/],
      [[...b, "list", "outbox", "--state", "done"], /"done", not a outbox state; use queued, sending/],
      [[...b, "show", "inbox"], /missing <id>/],
      [[...b, "replay", "a", "b"], /Unexpected argument "b" for "replay"/],
      [[...b, "replay", "a", "--state", "dead"], /Flag "--state" does not apply to "replay"/],
      [[...b, "purge"], /"purge" needs --older-than/],
      [[...b, "purge", "--older-than", "soon"], /Flag "--older-than" must be a duration like 7d, 12h, 30m or a number of ms, got "soon"/],
      [[...b, "stats", "--json=yes"], /Flag "--json" takes no value/],
      [[...b, "list", "inbox", "--chat"], /Flag "--chat" needs a value/],
      [["stats"], /Missing the backend: give --backend <url> or set BOTMESH_DURABLE_BACKEND/],
      [[], /Missing the command/],
    ];
    const results = await Promise.all(cases.map(([args]) => bun(args)));
    results.forEach((r, i) => {
      const [args, pattern] = cases[i]!;
      expect({ args, code: r.code, stdout: r.stdout }).toEqual({ args, code: 2, stdout: "" });
      expect(r.stderr).toMatch(pattern);
      expect(r.stderr).toContain("Usage: botmesh-durable");
      expect(r.stderr).not.toContain("Accepted backend forms"); // the one usage line, not the whole help
    });

    const help = await bun(["--help"]);
    expect([help.code, help.stderr]).toEqual([0, ""]);
    expect(help.stdout).toContain("Usage: botmesh-durable");
    expect((await bun(["-h"])).stdout).toBe(help.stdout);
    const version = await bun(["--version"]);
    const pkg = await Bun.file(join(root, "package.json")).json();
    expect([version.code, version.stdout]).toEqual([0, `botmesh-durable ${pkg.version}\n`]);
  }, SLOW);

  test("bad backend URLs: exit 2, naming the URL and listing the accepted forms; a missing file: exit 1", async () => {
    const cases: Array<[string, RegExp]> = [
      // the userinfo of a scheme it does not know may be a token: hidden whole
      ["mysql://root@localhost/db", /Backend URL "mysql:\/\/\*\*\*@localhost\/db" is of no known form/],
      ["./data/bot.txt", /Backend URL "\.\/data\/bot\.txt" is of no known form/],
      ["sqlite://host/x.db", /names a host; write sqlite:\.\/relative\/path or sqlite:\/\/\/absolute\/path/],
      ["sqlite:./bot.db?keyPrefix=x", /unknown parameter "keyPrefix"; it takes "tablePrefix"/],
      ["redis://127.0.0.1:1?schema=x", /unknown parameter "schema"; it takes "keyPrefix"/],
      ["redis+upstash://127.0.0.1:1", /has no token/],
      ["postgres://u:secret@127.0.0.1:1/db?schema=Bad-Schema", /schema/],
      ["", /Missing the backend/],
    ];
    const results = await Promise.all(cases.map(([url]) => bun(["-b", url, "stats"])));
    for (const [i, [url, pattern]] of cases.entries()) {
      const r = results[i]!;
      expect({ url, code: r.code }).toEqual({ url, code: 2 });
      expect(r.stderr).toMatch(pattern);
      if (url !== "") expect(r.stderr).toContain("Accepted backend forms:");
      expect(r.stderr).not.toContain("secret");
    }
    const missing = await bun(["-b", "sqlite:./nope/bot.db", "stats"]);
    expect(missing.code).toBe(1);
    expect(missing.stderr).toContain('SQLite file "./nope/bot.db" does not exist (nor does its directory');
    const refused = await bun(["-b", "postgres://u:secret@127.0.0.1:1/db", "stats"]);
    expect(refused.code).toBe(1);
    expect(refused.stderr).toContain('Cannot open Postgres at "postgres://u:***@127.0.0.1:1/db"');
    expect(refused.stderr).not.toContain("secret");
  }, SLOW);

  test("openBackend (in process): a BackendUrlError for a bad URL, the open backend for a good one", async () => {
    await expect(openBackend("bogus:x")).rejects.toBeInstanceOf(BackendUrlError);
    await expect(openBackend("bogus:x")).rejects.toThrow(/Backend URL "bogus:x" is of no known form\nAccepted backend forms:/);
    const file = join(tmp, "inproc.db");
    await fill(new SQLiteDurability({ file }));
    const opened = await openBackend(`sqlite:${file}`);
    try {
      expect(opened.backend.name).toBe("sqlite");
      expect(opened.description).toBe(`sqlite ${file}`);
      expect((await opened.backend.inbox.get("in-dead"))?.state).toBe("dead");
    } finally {
      await opened.close();
    }
  });
});

describe("botmesh-durable on the shared backends", async () => {
  const pgSkip = await serviceSkip("postgres");
  const redisSkip = await serviceSkip("redis");

  test.skipIf(pgSkip !== false)("Postgres (a random schema, dropped after)", async () => {
    const schema = `cli_${runId()}`;
    const sql = postgres(POSTGRES_URL, { max: 2, onnotice: () => {} });
    try {
      await fill(new PostgresDurability({ sql, schema, tablePrefix: "bm_" }));
      const u = new URL(POSTGRES_URL);
      u.searchParams.set("schema", schema);
      u.searchParams.set("tablePrefix", "bm_");
      await fullScenario(bun, u.toString());
      const r = await bun(["-b", u.toString().replace(/^postgres:/, "postgresql:"), "stats"]);
      expect(r.stdout).toContain(`(schema ${schema}, tables bm_*)`);
    } finally {
      await sql.unsafe(`drop schema if exists ${schema} cascade`);
      await sql.end();
    }
  }, SLOW);

  describe.skipIf(redisSkip !== false)("Redis", () => {
    let bridge: UpstashBridge;
    let admin: IORedis;
    const prefixes: string[] = [];
    beforeAll(async () => {
      bridge = await startUpstashBridge();
      admin = new IORedis(REDIS_URL);
    });
    afterAll(async () => {
      for (const p of prefixes) {
        const keys = await admin.keys(`{${p}}*`);
        if (keys.length) await admin.del(...keys);
      }
      await admin?.quit();
      await bridge?.stop();
    });

    test("through @upstash/redis and the REST bridge (a random keyPrefix)", async () => {
      const keyPrefix = `bm-cli:${runId()}:`;
      prefixes.push(keyPrefix);
      await fill(new RedisDurability({ client: new Upstash({ url: bridge.url, token: bridge.token }), keyPrefix }));
      const hostPort = new URL(bridge.url).host;
      const url = `redis+upstash+http://${bridge.token}@${hostPort}?keyPrefix=${encodeURIComponent(keyPrefix)}`;
      await fullScenario(bun, url);
      const insecure = `redis+upstash://${bridge.token}@${hostPort}?insecure=1&keyPrefix=${encodeURIComponent(keyPrefix)}`;
      const r = await bun(["-b", insecure, "stats"]);
      expect(r.code).toBe(0);
      expect(r.stdout).toContain(`Backend: upstash http://${hostPort} (keys ${keyPrefix}*)`);
      const denied = await bun(["-b", `redis+upstash+http://wrong@${hostPort}`, "stats"]);
      expect(denied.code).toBe(1);
      expect(denied.stderr).toContain(`Cannot open Redis at "redis+upstash+http://***@${hostPort}"`);
      expect(denied.stderr).not.toContain("wrong@");
    }, SLOW);

    test("through ioredis (a random keyPrefix)", async () => {
      const keyPrefix = `bm-cli:${runId()}:`;
      prefixes.push(keyPrefix);
      const client = new IORedis(REDIS_URL);
      await fill(new RedisDurability({ client, keyPrefix }));
      await client.quit();
      await fullScenario(bun, `${REDIS_URL}?keyPrefix=${encodeURIComponent(keyPrefix)}`);
      const refused = await bun(["-b", "redis://127.0.0.1:1", "stats"]);
      expect(refused.code).toBe(1);
      expect(refused.stderr).toContain('Cannot open Redis at "redis://127.0.0.1:1"');
    }, SLOW);
  });
});

describe("botmesh-durable on other runtimes (SQLite)", () => {
  async function shortScenario(run: Runner, label: string): Promise<void> {
    const file = join(tmp, `${label}.db`);
    await fill(new SQLiteDurability({ file }));
    let r = await run(["-b", `sqlite:${file}`, "stats", "--json"]);
    expect({ code: r.code, stderr: r.stderr }).toEqual({ code: 0, stderr: "" });
    expect(r.json().inbox).toEqual({ pending: 1, processing: 0, scheduled: 0, failed: 0, done: 1, dead: 1 });
    r = await run(["-b", `sqlite:${file}`, "list", "inbox", "--state", "dead", "--json"]);
    expect(r.json().map((x: { id: string }) => x.id)).toEqual(["in-dead"]);
    r = await run(["-b", `sqlite:${file}`, "replay", "in-dead"]);
    expect(r.code).toBe(0);
    r = await run(["-b", `sqlite:${file}`, "list", "outbox"]);
    expect(r.stdout).toMatch(/out-dead\s+dead/);
    r = await run(["-b", `sqlite:${file}`, "purge", "--older-than", "0", "--json"]);
    expect(r.json()).toMatchObject({ inbox: 1, outbox: 1 });
    r = await run(["-b", "mysql://x", "stats"]);
    expect(r.code).toBe(2);
    expect(r.stderr).toContain("Accepted backend forms:");
    r = await run(["--version"]);
    expect(r.stdout).toMatch(/^botmesh-durable \d+\.\d+\.\d+/);
  }

  test("Deno (deno run -A cli.ts)", async () => {
    await shortScenario((args) => spawn([join(bin, "deno"), "run", "-A", join(root, "cli.ts"), ...args]), "deno");
  }, SLOW);

  test("Node 20 (bundled with bun build --target=node, better-sqlite3)", async () => {
    const out = bundleCliForNode(join(tmp, "cli.mjs"));
    // Inside the repository the externals resolve from node_modules.
    await shortScenario((args) => spawn(["node", out, ...args]), "node");
    const v = await spawn(["node", "--version"]);
    expect(v.stdout).toMatch(/^v2\d\./);
    // Outside it they do not: the error names the package to install.
    const away = join(tmpdir(), `bm-cli-${runId()}`);
    mkdirSync(away, { recursive: true });
    try {
      const copy = join(away, "cli.mjs");
      writeFileSync(copy, await Bun.file(out).text());
      const [pg, upstash, io] = await Promise.all([
        spawn(["node", copy, "-b", "postgres://u@127.0.0.1:1/db", "stats"]),
        spawn(["node", copy, "-b", "redis+upstash://t@127.0.0.1:1", "stats"]),
        spawn(["node", copy, "-b", "redis://127.0.0.1:1", "stats"]),
      ]);
      expect([pg.code, upstash.code, io.code]).toEqual([1, 1, 1]);
      expect(pg.stderr).toContain('The "postgres" package is needed for postgres:// URLs but could not be loaded (install it: npm install postgres)');
      expect(upstash.stderr).toContain('The "@upstash/redis" package is needed for redis+upstash:// URLs');
      expect(io.stderr).toContain('The "ioredis" package is needed for redis:// URLs');
    } finally {
      rmSync(away, { recursive: true, force: true });
    }
  }, SLOW);
});
