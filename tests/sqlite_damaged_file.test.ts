// A SQLite file damaged past its header (pages overwritten with garbage, the header and schema intact so
// that it opens) fails closed: a bot on it does not start, or, when the damage is met later, refuses
// every admission (the channel delivers the message again), dead-letters nothing, and reports the damage
// once, naming the file. The same on every driver; and journal files are created 0600.
import { afterAll, describe, expect, test } from "bun:test";
import { Database } from "bun:sqlite";
import { existsSync, mkdirSync, readFileSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { DamagedStorageError } from "../backend.ts";
import { Bot } from "../mod.ts";
import { MockProvider } from "../testing.ts";
import { SQLiteDurability, SQLiteStore } from "../backends/sqlite/mod.ts";
import { openBackend } from "../backends/open_url.ts";
import { runCli } from "../src/ops/cli.ts";
import { damageTable, journalWithRecords } from "./support/sqlite_damage.ts";

const dir = join(tmpdir(), `botmesh-sqlite-damaged-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
// Inside the repository, so that the Node bundle finds node_modules/better-sqlite3.
const buildDir = join(import.meta.dir, "..", ".tmp", `sqlite-damaged-${crypto.randomUUID()}`);
afterAll(() => {
  rmSync(dir, { recursive: true, force: true });
  rmSync(buildDir, { recursive: true, force: true });
});

const tempFile = (): string => join(dir, `${crypto.randomUUID()}.db`);

/** Poll `check` until it holds; fail naming `what` after `ms`. */
async function waitFor(what: string, check: () => boolean, ms = 10_000): Promise<void> {
  const start = performance.now();
  while (!check()) {
    if (performance.now() - start > ms) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}

/**
 * Damages `table` (or index) under a connection that has the file open: the page is overwritten on disk,
 * and a write through another connection makes the open one read its pages from the file again.
 */
async function damageUnder(file: string, table: string): Promise<void> {
  await damageTable(file, table);
  const other = new Database(file);
  try {
    other.exec("UPDATE botmesh_meta SET value = value WHERE key = 'schema_version'");
  } finally {
    other.close();
  }
}

/** The inbox as stored (read past the indexes, which may be what is damaged). */
function inboxRows(file: string): { id: string; state: string }[] {
  const db = new Database(file, { readonly: true });
  try {
    return db.prepare("SELECT id, state FROM botmesh_inbox NOT INDEXED ORDER BY id").all() as { id: string; state: string }[];
  } finally {
    db.close();
  }
}

function expectNamesFile(error: unknown, file: string): void {
  expect(error).toBeInstanceOf(DamagedStorageError);
  const damage = error as DamagedStorageError;
  expect(damage.location).toBe(file);
  expect(damage.backend).toBe("sqlite");
  expect(damage.message).toContain(JSON.stringify(file));
  expect(damage.message).toContain(".recover");
}

describe("sqlite: a damaged file", () => {
  test("a bot on it does not start: the error names the file and what to do, and nothing is written", async () => {
    const file = tempFile();
    await journalWithRecords(file);
    await damageTable(file, "botmesh_inbox");
    const before = readFileSync(file);
    const mock = new MockProvider();
    const bot = new Bot({ provider: mock, durability: { backend: new SQLiteDurability({ file }), instanceId: "t" } });
    const errors: Error[] = [];
    bot.on("error", (error) => errors.push(error));
    const error = await bot.start().then(() => null, (e: unknown) => e);
    expectNamesFile(error, file);
    expect((error as Error).message).toContain("quick_check");
    expect(errors).toEqual([]); // start()'s rejection is the report
    expect(readFileSync(file).equals(before)).toBe(true);
    expect(existsSync(`${file}-wal`) ? statSync(`${file}-wal`).size : 0).toBe(0);
  });

  test("met at run time, it refuses admissions, is reported once and dead-letters nothing; before it, all works", async () => {
    const file = tempFile();
    const mock = new MockProvider();
    const backend = new SQLiteDurability({ file });
    const bot = new Bot({ provider: mock, durability: { backend, instanceId: "t", inbox: { retries: 0 } } });
    const errors: Error[] = [];
    bot.on("error", (error) => errors.push(error));
    let release!: () => void;
    const held = new Promise<void>((resolve) => release = resolve);
    let running = 0;
    bot.when("hold", async (ctx) => {
      running++;
      await held;
      await ctx.reply("held done");
    });
    bot.when("ping", (ctx) => ctx.reply("pong"));
    await bot.start();
    // The undamaged file works.
    expect((await mock.receive({ id: "m0", chatId: "c0", text: "ping" })).status).toBe("admitted");
    await bot.idle();
    expect(mock.sent.map((s) => s.content)).toEqual(["pong"]);

    expect((await mock.receive({ id: "m1", chatId: "c1", text: "hold" })).status).toBe("admitted");
    await waitFor("the handler to run", () => running === 1);
    // The index a record joins when it is done: its completion meets the damage.
    await damageUnder(file, "botmesh_inbox_done");
    release();
    await waitFor("the damage to be reported", () => errors.length > 0);
    expectNamesFile(errors[0], file);

    const refused = await mock.receive({ id: "m2", chatId: "c2", text: "ping" });
    expect(refused.status).toBe("rejected");
    expectNamesFile((refused as { error: Error }).error, file);
    expect((await mock.receive({ id: "m3", chatId: "c3", text: "ping" })).status).toBe("rejected");
    expectNamesFile(await bot.idle().then(() => null, (e: unknown) => e), file);
    await bot.stop();
    expect(errors.length).toBe(1);
    // m1 is left leased (its lease lapses), neither done nor dead; m2 and m3 were never journaled.
    expect(inboxRows(file)).toEqual([{ id: "m0", state: "done" }, { id: "m1", state: "processing" }]);
  });

  test("a handler whose store (in the same file) meets the damage dead-letters nothing", async () => {
    const file = tempFile();
    const store = new SQLiteStore({ file });
    const mock = new MockProvider();
    const bot = new Bot({ provider: mock, store, durability: { backend: store.durability(), instanceId: "t", inbox: { retries: 0 } } });
    const errors: Error[] = [];
    bot.on("error", (error) => errors.push(error));
    const dead: string[] = [];
    bot.on("durability:dead", ({ id }) => dead.push(id));
    let release!: () => void;
    const held = new Promise<void>((resolve) => release = resolve);
    let running = 0;
    bot.when("count", async (ctx) => {
      running++;
      await held;
      const seen = (await store.get("count")) as number | undefined;
      await store.set("count", (seen ?? 0) + 1);
      await ctx.reply(`count ${(seen ?? 0) + 1}`);
    });
    await store.set("count", 0);
    await bot.start();
    expect((await mock.receive({ id: "m1", chatId: "c1", text: "count" })).status).toBe("admitted");
    await waitFor("the handler to run", () => running === 1);
    await damageUnder(file, "botmesh_session");
    release();
    await waitFor("the damage to be reported", () => errors.length > 0);
    expectNamesFile(errors[0], file);
    expect((await mock.receive({ id: "m2", chatId: "c2", text: "count" })).status).toBe("rejected");
    await bot.stop();
    await store.close();
    expect(errors.length).toBe(1);
    expect(dead).toEqual([]);
    expect(mock.sent).toEqual([]);
    expect(inboxRows(file)).toEqual([{ id: "m1", state: "processing" }]);
  });

  test("the CLI names the file", async () => {
    const file = tempFile();
    await journalWithRecords(file);
    await damageTable(file, "botmesh_inbox");
    for (const args of [["stats"], ["list", "inbox"]]) {
      let stderr = "";
      const code = await runCli(["-b", `sqlite:${file}`, ...args], {
        stdout: () => {},
        stderr: (text: string) => void (stderr += text),
      }, { open: openBackend });
      expect(code, args.join(" ")).not.toBe(0);
      expect(stderr, args.join(" ")).toContain(JSON.stringify(file));
      expect(stderr, args.join(" ")).toMatch(/damaged/);
    }
  });
});

/** What tests/fixtures/sqlite_damaged_file.ts printed under one runtime. */
interface FixtureReport {
  modes: { db: number | null; wal: number | null; shm: number | null };
  open: Record<string, unknown>;
  openUnchecked: Record<string, unknown>;
  outboxBefore: Record<string, unknown>;
  admit: Record<string, unknown>;
  reserve: Record<string, unknown>;
  outboxAfter: Record<string, unknown>;
  reopened: Record<string, unknown>;
  unchanged: boolean;
}

function runFixture(command: string[], runtime: string): FixtureReport {
  const work = join(dir, runtime);
  mkdirSync(work, { recursive: true });
  const run = Bun.spawnSync([...command, work], { stdout: "pipe", stderr: "pipe" });
  expect(run.exitCode, `${runtime}: ${run.stderr.toString()}`).toBe(0);
  return JSON.parse(run.stdout.toString().trim().split("\n").pop()!) as FixtureReport;
}

const FIXTURE = join(import.meta.dir, "fixtures", "sqlite_damaged_file.ts");
const BIN = join(import.meta.dir, "..", "node_modules", ".bin");

describe("sqlite: every driver", () => {
  const runtimes: [string, () => string[]][] = [
    ["bun (bun:sqlite)", () => [process.execPath, FIXTURE]],
    ["deno (node:sqlite)", () => [join(BIN, "deno"), "run", "-A", FIXTURE]],
    ["node (better-sqlite3)", () => {
      const out = join(buildDir, "sqlite_damaged_file.mjs");
      const build = Bun.spawnSync([process.execPath, "build", FIXTURE, "--target=node", "--outfile", out, "--external", "better-sqlite3"]);
      expect(build.exitCode, build.stderr.toString()).toBe(0);
      return ["node", out];
    }],
  ];
  for (const [runtime, command] of runtimes) {
    test(`${runtime}: the damage is a DamagedStorageError naming the file, at open and at run time; files are 0600`, () => {
      const report = runFixture(command(), runtime.split(" ")[0]!);
      if (process.platform !== "win32") expect(report.modes).toEqual({ db: 0o600, wal: 0o600, shm: 0o600 });
      const damaged = { ok: false, name: "DamagedStorageError", damaged: true, namesFile: true };
      expect(report.open).toMatchObject(damaged);
      expect(report.open.message).toContain("Cannot open SQLite file");
      expect(report.openUnchecked).toEqual({ ok: true });
      expect(report.outboxBefore).toEqual({ ok: true }); // the outbox is intact
      expect(report.admit).toMatchObject(damaged);
      expect(report.reserve).toMatchObject(damaged); // in the admit's group commit: rolled back with it
      // Once met, every operation refuses: what the file answers can no longer be trusted.
      expect(report.outboxAfter).toMatchObject(damaged);
      expect(report.reopened).toEqual({ ok: true }); // until the file is opened again
      expect(report.unchanged).toBe(true);
    }, 60_000);
  }
});
