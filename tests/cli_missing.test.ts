// botmesh-durable never creates a backend: on a missing SQLite or JSON file (or directory), a SQLite file or
// Postgres schema without the backend's tables, a Redis key prefix with nothing journaled, a missing events
// journal, every command (reads and changes alike) exits 1 naming what was not found, and nothing is created.
// Nor does it upgrade one: on a SQLite file or Postgres schema of an older (or newer) schema version, every
// command exits 1 naming both versions, and the schema is left as it was.
import { afterAll, describe, expect, test } from "bun:test";
import { Database } from "bun:sqlite";
import { mkdirSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import IORedis from "ioredis";
import postgres from "postgres";
import { Redis as Upstash } from "@upstash/redis";
import { runCli } from "../src/ops/cli.ts";
import { openBackend } from "../backends/open_url.ts";
import { SQLiteDurability } from "../backends/sqlite/durability.ts";
import { EventsDurability, SharedFileEventJournal } from "../backends/events/mod.ts";
import { POSTGRES_SCHEMA_VERSION, PostgresDurability } from "../backends/postgres/mod.ts";
import { SQLITE_SCHEMA_VERSION } from "../backends/sqlite/mod.ts";
import { RedisDurability } from "../backends/redis/durability.ts";
import { POSTGRES_URL, REDIS_URL, runId, serviceSkip } from "./support/services.ts";
import { startUpstashBridge } from "./support/upstash_bridge.ts";
import { fill } from "./support/cli_fill.ts";

const tmp = join(import.meta.dir, "..", ".tmp", `cli-missing-${runId()}`);
mkdirSync(tmp, { recursive: true });
afterAll(() => rmSync(tmp, { recursive: true, force: true }));

/** Every command, with arguments: the read-only ones and the ones that change records. */
const EVERY_COMMAND: string[][] = [
  ["stats"],
  ["list", "inbox"],
  ["list", "outbox", "--state", "dead"],
  ["show", "inbox", "x"],
  ["show", "outbox", "x"],
  ["damaged"],
  ["replay", "x"],
  ["retry", "x"],
  ["mark-delivered", "x"],
  ["discard", "x"],
  ["purge", "--older-than", "0"],
];

async function cli(argv: string[]): Promise<{ code: number; stdout: string; stderr: string }> {
  let stdout = "";
  let stderr = "";
  const code = await runCli(argv, { stdout: (t) => void (stdout += t), stderr: (t) => void (stderr += t) }, {
    open: openBackend,
    serve: () => Promise.reject(new Error("the console must not get as far as serving")),
    untilShutdown: () => Promise.resolve(),
  });
  return { code, stdout, stderr };
}

/** Runs every command on `url`: each exits 1 with an error matching `pattern`; returns the last error. */
async function refusedByEvery(url: string, pattern: RegExp): Promise<string> {
  let message = "";
  for (const argv of EVERY_COMMAND) {
    const r = await cli(["-b", url, ...argv, "--json"]);
    expect({ argv, code: r.code, stdout: r.stdout }).toEqual({ argv, code: 1, stdout: "" });
    expect(r.stderr).toMatch(pattern);
    message = r.stderr;
  }
  return message;
}

/** The `console` command on `url` (without sign-in): exits 1 with an error matching `pattern`, before serving. */
async function consoleRefused(url: string, pattern: RegExp): Promise<void> {
  const r = await cli(["console", "-b", url, "--no-auth", "--port", "0"]);
  expect({ code: r.code, stdout: r.stdout }).toEqual({ code: 1, stdout: "" });
  expect(r.stderr).toMatch(pattern);
}

describe("files: nothing is created", () => {
  test("a missing SQLite file, its directory missing too: named, and not created", async () => {
    const before = readdirSync(tmp);
    const message = await refusedByEvery(`sqlite:${join(tmp, "nope", "bot.db")}`, /SQLite file ".*nope\/bot\.db" does not exist/);
    expect(message).toContain(`(nor does its directory ${JSON.stringify(join(tmp, "nope"))})`);
    expect(message).toContain("check the path; nothing is created here, a bot creates it when it starts");
    await refusedByEvery(join(tmp, "bot.sqlite3"), /SQLite file ".*bot\.sqlite3" does not exist \(from/);
    expect(readdirSync(tmp)).toEqual(before);
  });

  test("a missing JSON file (file backend) and missing events journals: named, and not created", async () => {
    const before = readdirSync(tmp);
    await refusedByEvery(`file:${join(tmp, "bot.json")}`, /Backend file ".*bot\.json" does not exist \(from "file:/);
    for (const scheme of ["events+file", "events+shared"]) {
      const message = await refusedByEvery(`${scheme}:${join(tmp, "ev", "events.json")}`, /Events journal file ".*ev\/events\.json" does not exist/);
      expect(message).toContain(scheme === "events+file" ? "FileEventJournal.open() creates it" : "SharedFileEventJournal.open() creates it");
    }
    expect(readdirSync(tmp)).toEqual(before);
  });

  test("events+file: on a shared journal with an append log: refused (it would take the log over), the log kept", async () => {
    const path = join(tmp, "shared.json");
    const journal = await SharedFileEventJournal.open(path, { appendLog: true });
    await fill(new EventsDurability({ journal }));
    await journal.close();
    const log = readFileSync(`${path}.log`, "utf8");
    expect(log).not.toBe("");
    const message = await refusedByEvery(`events+file:${path}`, /has the append log of a SharedFileEventJournal/);
    expect(message).toContain("open it with events+shared:");
    expect(readFileSync(`${path}.log`, "utf8")).toBe(log);
    const r = await cli(["-b", `events+shared:${path}`, "stats", "--json"]);
    expect([r.code, r.stderr]).toEqual([0, ""]);
    expect(JSON.parse(r.stdout).inbox).toEqual({ pending: 1, processing: 0, scheduled: 0, failed: 0, done: 1, dead: 1 });
  });

  test("a directory instead of a file", async () => {
    mkdirSync(join(tmp, "dir.db"));
    const r = await cli(["-b", join(tmp, "dir.db"), "stats"]);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain(`SQLite file ${JSON.stringify(join(tmp, "dir.db"))} is a directory, not a file`);
  });

  test("a SQLite file without the backend's tables: refused, no table created; the prefixes found are named", async () => {
    const empty = join(tmp, "empty.db");
    writeFileSync(empty, "");
    let message = await refusedByEvery(`sqlite:${empty}`, /SQLite file ".*empty\.db" has no tables of tablePrefix "botmesh_" \(from/);
    expect(message).toContain("is it the bot's database?");
    expect(statSync(empty).size).toBe(0);

    const file = join(tmp, "bm.db");
    await fill(new SQLiteDurability({ file, tablePrefix: "bm_" }));
    const tables = () => new Database(file).prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").all();
    const before = tables();
    message = await refusedByEvery(`sqlite:${file}`, /has no tables of tablePrefix "botmesh_"; tables found: tablePrefix "bm_" \(from/);
    expect(message).toContain("give ?tablePrefix=… of the bot's backend");
    await refusedByEvery(`sqlite:${file}?tablePrefix=bm2_`, /has no tables of tablePrefix "bm2_"; tables found: tablePrefix "bm_"/);
    expect(tables()).toEqual(before);
    // The right prefix opens it.
    const r = await cli(["-b", `sqlite:${file}?tablePrefix=bm_`, "stats", "--json"]);
    expect([r.code, r.stderr]).toEqual([0, ""]);
    expect(JSON.parse(r.stdout).inbox.dead).toBe(1);
  });

  test("a SQLite file of an older or newer schema version: refused by every command and the console, not upgraded", async () => {
    const file = join(tmp, "older.db");
    await fill(new SQLiteDurability({ file }));
    const older = SQLITE_SCHEMA_VERSION - 1;
    const db = new Database(file);
    // As a file of the version before: its schema_version, and the index this version's last migration drops.
    db.exec(`UPDATE botmesh_meta SET value = '${older}' WHERE key = 'schema_version';
      CREATE INDEX botmesh_inbox_owner ON botmesh_inbox (lease_owner) WHERE lease_owner IS NOT NULL;`);
    const state = () => ({
      version: db.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get(),
      indexes: db.prepare("SELECT name FROM sqlite_master WHERE type = 'index' ORDER BY name").all(),
    });
    try {
      const before = state();
      const message = await refusedByEvery(
        `sqlite:${file}`,
        new RegExp(`SQLite file ".*older\\.db" \\(tablePrefix "botmesh_"\\) has schema version ${older}, of an older @botmesh/durable; ` +
          `this botmesh-durable needs schema version ${SQLITE_SCHEMA_VERSION} \\(from`),
      );
      expect(message).toContain("it is not upgraded here, as bots of the older version may be using it");
      expect(message).toContain("use the botmesh-durable of the bots' version, or start a bot of this version (it upgrades the schema when it starts)");
      await consoleRefused(`sqlite:${file}`, new RegExp(`has schema version ${older}, of an older @botmesh/durable`));
      expect(state()).toEqual(before);
      expect(before.version).toEqual({ value: String(older) });

      const newer = SQLITE_SCHEMA_VERSION + 1;
      db.exec(`UPDATE botmesh_meta SET value = '${newer}' WHERE key = 'schema_version'`);
      await refusedByEvery(
        `sqlite:${file}`,
        new RegExp(`has schema version ${newer}, written by a newer @botmesh/durable; this botmesh-durable reads schema version ` +
          `${SQLITE_SCHEMA_VERSION} \\(from ".*older\\.db"\\): use the botmesh-durable of the bots' version`),
      );

      // A bot of this version starting on it upgrades it; then the commands work.
      db.exec(`UPDATE botmesh_meta SET value = '${older}' WHERE key = 'schema_version'`);
      const bot = new SQLiteDurability({ file });
      await bot.open();
      await bot.close();
      expect(state().version).toEqual({ value: String(SQLITE_SCHEMA_VERSION) });
      const r = await cli(["-b", `sqlite:${file}`, "stats", "--json"]);
      expect([r.code, r.stderr]).toEqual([0, ""]);
      expect(JSON.parse(r.stdout).inbox.dead).toBe(1);
    } finally {
      db.close();
    }
  });

  test("a file that is not a SQLite database", async () => {
    const file = join(tmp, "text.db");
    writeFileSync(file, "not a database, just some text that is long enough to have a header".repeat(4));
    const r = await cli(["-b", file, "stats"]);
    expect(r.code).toBe(1);
    expect(r.stderr).toContain(`Cannot read SQLite file ${JSON.stringify(file)}`);
  });
});

describe("servers: nothing is created", async () => {
  const pgSkip = await serviceSkip("postgres");
  const redisSkip = await serviceSkip("redis");

  test.skipIf(pgSkip !== false)("Postgres: an unknown schema, or a schema without tables of the prefix: refused, nothing created", async () => {
    const schema = `cli_missing_${runId()}`;
    const other = `cli_there_${runId()}`;
    const sql = postgres(POSTGRES_URL, { max: 2, onnotice: () => {} });
    const url = (params: Record<string, string>) => {
      const u = new URL(POSTGRES_URL);
      for (const [k, v] of Object.entries(params)) u.searchParams.set(k, v);
      return u.toString();
    };
    const schemaExists = async (name: string) =>
      ((await sql`SELECT count(*)::int AS n FROM pg_namespace WHERE nspname = ${name}`)[0]!.n as number) > 0;
    const tablesOf = async (name: string) =>
      (await sql`SELECT relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
                 WHERE n.nspname = ${name} AND c.relkind = 'r' ORDER BY relname`).map((r) => r.relname as string);
    try {
      const message = await refusedByEvery(url({ schema }), new RegExp(`Postgres schema "${schema}" does not exist`));
      expect(message).toContain(`check ?schema= and ?tablePrefix= (the bot's "schema" and "tablePrefix" options)`);
      expect(await schemaExists(schema)).toBe(false);

      await fill(new PostgresDurability({ sql, schema: other, tablePrefix: "bm_" }));
      const before = await tablesOf(other);
      await refusedByEvery(
        url({ schema: other }),
        // The backends there are (other runs may have more than the ten listed: then the list ends with "…").
        new RegExp(`Postgres schema "${other}" has no tables of tablePrefix "botmesh_"; backends found: ` +
          `(.*schema=${other}&tablePrefix=bm_|.*, …)`),
      );
      expect(await tablesOf(other)).toEqual(before);
      const r = await cli(["-b", url({ schema: other, tablePrefix: "bm_" }), "stats", "--json"]);
      expect([r.code, r.stderr]).toEqual([0, ""]);
      expect(JSON.parse(r.stdout).outbox.dead).toBe(1);
    } finally {
      await sql.unsafe(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
      await sql.unsafe(`DROP SCHEMA IF EXISTS ${other} CASCADE`);
      await sql.end();
    }
  }, 60_000);

  test.skipIf(pgSkip !== false)("Postgres: a schema of an older or newer schema version: refused by every command and the console, not upgraded", async () => {
    const schema = `cli_version_${runId()}`;
    const sql = postgres(POSTGRES_URL, { max: 2, onnotice: () => {} });
    const u = new URL(POSTGRES_URL);
    u.searchParams.set("schema", schema);
    const url = u.toString();
    const version = async () => (await sql.unsafe(`SELECT value FROM ${schema}.botmesh_meta WHERE key = 'schema_version'`))[0]!.value;
    const setVersion = (v: number) => sql.unsafe(`UPDATE ${schema}.botmesh_meta SET value = '${v}' WHERE key = 'schema_version'`);
    try {
      await fill(new PostgresDurability({ sql, schema }));
      const older = POSTGRES_SCHEMA_VERSION - 1;
      await setVersion(older);
      const message = await refusedByEvery(
        url,
        new RegExp(`Postgres schema "${schema}" \\(tablePrefix "botmesh_"\\) has schema version ${older}, of an older @botmesh/durable; ` +
          `this botmesh-durable needs schema version ${POSTGRES_SCHEMA_VERSION} \\(from`),
      );
      expect(message).toContain("start a bot of this version (it upgrades the schema when it starts)");
      await consoleRefused(url, new RegExp(`has schema version ${older}, of an older @botmesh/durable`));
      expect(await version()).toBe(String(older));

      await setVersion(POSTGRES_SCHEMA_VERSION + 1);
      await refusedByEvery(url, new RegExp(`has schema version ${POSTGRES_SCHEMA_VERSION + 1}, written by a newer @botmesh/durable`));
      expect(await version()).toBe(String(POSTGRES_SCHEMA_VERSION + 1));

      await setVersion(POSTGRES_SCHEMA_VERSION);
      const r = await cli(["-b", url, "stats", "--json"]);
      expect([r.code, r.stderr]).toEqual([0, ""]);
      expect(JSON.parse(r.stdout).outbox.dead).toBe(1);
    } finally {
      await sql.unsafe(`DROP SCHEMA IF EXISTS ${schema} CASCADE`);
      await sql.end();
    }
  }, 60_000);

  test.skipIf(redisSkip !== false)("Redis (ioredis and Upstash): a key prefix with nothing journaled: refused, no key written", async () => {
    const admin = new IORedis(REDIS_URL);
    const bridge = await startUpstashBridge();
    const unknown = `bm-cli-missing:${runId()}:`;
    const there = `bm-cli-there:${runId()}:`;
    try {
      await fill(new RedisDurability({ client: admin, keyPrefix: there }));
      const host = new URL(bridge.url).host;
      for (const base of [REDIS_URL, `redis+upstash+http://${bridge.token}@${host}`]) {
        const message = await refusedByEvery(
          `${base}?keyPrefix=${encodeURIComponent(unknown)}`,
          new RegExp(`Redis has no inbox or outbox under key prefix "${unknown}" \\(no key \\{${unknown}\\}in:ord nor`),
        );
        // The prefixes there are (other runs may have more than the ten listed: then the list ends with "…").
        expect(message).toMatch(new RegExp(`prefixes found: (.*keyPrefix=${there}|.*, …)`));
        expect(message).toContain(`check ?keyPrefix= (the bot's "keyPrefix" option, default "botmesh:")`);
        expect(await admin.keys(`{${unknown}}*`)).toEqual([]);
        const r = await cli(["-b", `${base}?keyPrefix=${encodeURIComponent(there)}`, "stats", "--json"]);
        expect([r.code, r.stderr]).toEqual([0, ""]);
        expect(JSON.parse(r.stdout).inbox.pending).toBe(1);
      }
    } finally {
      const keys = await admin.keys(`{${there}}*`);
      if (keys.length) await admin.del(...keys);
      await admin.quit();
      await bridge.stop();
    }
  }, 60_000);
});
