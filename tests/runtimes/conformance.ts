/**
 * Runs the conformance suite outside bun:test, to prove the backends on the
 * other runtimes and their drivers (Node 20: better-sqlite3; Deno:
 * node:sqlite and Deno's file system). A backend named alone runs the journal
 * contract; `<name>:full` runs the whole suite (the bot's rules and the crash
 * matrix too: the runtime's async context and timers under a real bot).
 *
 *   deno run -A tests/runtimes/conformance.ts memory file:full sqlite
 *   bun build tests/runtimes/conformance.ts --target=node --outdir .tmp/rt --external better-sqlite3
 *   node .tmp/rt/conformance.js memory file sqlite
 *   deno run -A tests/runtimes/conformance.ts postgres
 *   bun build tests/runtimes/conformance.ts --target=node --outdir .tmp/rt --external better-sqlite3 --external postgres
 *   node .tmp/rt/conformance.js postgres
 *
 * memory, file, sqlite and the events journals run in simulated time (a
 * TestClock per test: no real sleeps, no timeScale margins); postgres runs in
 * real time (its leases are on the server's clock).
 *
 * Exits non-zero when a test fails.
 */
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { connect as netConnect } from "node:net";
import process from "node:process";
import type { DurabilityBackend } from "../../src/contract.ts";
import { MemoryDurability } from "../../backends/memory/durability.ts";
import { FileDurability, simulateCrash } from "../../backends/file/durability.ts";
import { SQLiteDurability } from "../../backends/sqlite/durability.ts";
import { openSqlite } from "../../src/runtime/sqlite.ts";
import { PostgresDurability } from "../../backends/postgres/mod.ts";
import {
  EventsDurability,
  FileEventJournal,
  type LeasedEventJournal,
  SharedFileEventJournal,
} from "../../backends/events/mod.ts";
import { simulateCrash as simulateJournalCrash } from "../../backends/events/file_journal.ts";
import { runBackendContract, runDurabilityConformance } from "../../testing.ts";
import type { BackendConformanceOptions } from "../../src/testing/conformance.ts";
import { createHarness } from "./harness.ts";

type Setup = Omit<BackendConformanceOptions, "harness">;

const dirs = new WeakMap<DurabilityBackend, string>();
const paths = new WeakMap<DurabilityBackend, string>();

function tempDir(): string {
  return mkdtempSync(join(tmpdir(), "botmesh-rt-"));
}

// The in-process backends run in simulated time (a TestClock per test, its time given to the backend);
// postgres keeps real time (its leases are on the server's clock).
const setups: Record<string, () => Setup> = {
  memory: () => ({ name: "memory", simulatedTime: true, create: ({ now }) => new MemoryDurability({ clock: now }) }),
  file: () => {
    const open = (path: string, dir: string, clock: () => number) => {
      const b = new FileDurability({ path, clock });
      dirs.set(b, dir);
      paths.set(b, path);
      return b;
    };
    return {
      name: "file",
      // Virtual time stands still during the fsync'd snapshot rewrites: no margin needed.
      simulatedTime: true,
      create: ({ now }) => {
        const dir = tempDir();
        return open(join(dir, "bot.json"), dir, now);
      },
      reopen: async (old, { now }) => {
        await simulateCrash(old as FileDurability);
        return open(paths.get(old)!, dirs.get(old)!, now);
      },
      // A hand edit of the snapshot: an unknown inbox state, an outbox field of the wrong type.
      damage: async (old, journal, id, { now }) => {
        await (old as FileDurability).close();
        const path = paths.get(old)!;
        const snapshot = JSON.parse(readFileSync(path, "utf8"));
        const record = snapshot[journal].find((r: { id?: string; key?: string }) => (journal === "inbox" ? r.id : r.key) === id);
        if (journal === "inbox") record.state = "archived";
        else record.attempts = "2";
        writeFileSync(path, JSON.stringify(snapshot));
        return open(path, dirs.get(old)!, now);
      },
      cleanup: (b) => rmSync(dirs.get(b)!, { recursive: true, force: true }),
    };
  },
  sqlite: () => {
    const open = (file: string, dir: string, clock: () => number) => {
      const b = new SQLiteDurability({ file, clock });
      dirs.set(b, dir);
      paths.set(b, file);
      return b;
    };
    return {
      name: "sqlite",
      simulatedTime: true,
      create: ({ now }) => {
        const dir = tempDir();
        return open(join(dir, "bot.db"), dir, now);
      },
      reopen: async (old, { now }) => {
        const b = old as SQLiteDurability;
        while (b.isOpen) await b.close();
        return open(paths.get(old)!, dirs.get(old)!, now);
      },
      // A hand edit of the file through the runtime's own driver: the payload or content made invalid JSON.
      damage: async (b, journal, id) => {
        const raw = await openSqlite(paths.get(b)!);
        try {
          const { changes } = raw.prepare(
            `UPDATE botmesh_${journal} SET ${journal === "inbox" ? "payload" : "content"} = ? WHERE ${journal === "inbox" ? "id" : "key"} = ?`,
          ).run("{not json", id);
          if (changes !== 1) throw new Error(`no ${journal} row ${id} to damage`);
        } finally {
          raw.close();
        }
        return b;
      },
      cleanup: (b) => rmSync(dirs.get(b)!, { recursive: true, force: true }),
    };
  },
};

/** EventsDurability over a journal opened on a fresh file; `reopen` lets the old journal go and opens the file again. */
function eventsSetup(
  name: string,
  open: (path: string, clock: () => number) => Promise<LeasedEventJournal>,
  letGo: (j: LeasedEventJournal) => Promise<void>,
  editable = false,
): Setup {
  const journals = new WeakMap<DurabilityBackend, LeasedEventJournal>();
  const over = async (path: string, dir: string, clock: () => number) => {
    const journal = await open(path, clock);
    const b = new EventsDurability({ journal });
    journals.set(b, journal);
    dirs.set(b, dir);
    paths.set(b, path);
    return b;
  };
  return {
    name,
    simulatedTime: true, // fsync'd file writes hold virtual time, as for "file"
    create: ({ now }) => {
      const dir = tempDir();
      return over(join(dir, "events.json"), dir, now);
    },
    reopen: async (old, { now }) => {
      await letGo(journals.get(old)!);
      return over(paths.get(old)!, dirs.get(old)!, now);
    },
    cleanup: async (b) => {
      await journals.get(b)?.close().catch(() => {});
      rmSync(dirs.get(b)!, { recursive: true, force: true });
    },
    // A journal whose whole state is one JSON file: a hand edit gives a record an unknown state.
    ...(editable
      ? {
        damage: async (old: DurabilityBackend, journal: "inbox" | "outbox", id: string, { now }: { now: () => number }) => {
          await journals.get(old)!.close();
          const path = paths.get(old)!;
          const doc = JSON.parse(readFileSync(path, "utf8"));
          const records: Record<string, unknown>[] = journal === "inbox" ? doc.events : doc.outbox;
          const record = records.find((r) => r[journal === "inbox" ? "id" : "key"] === id);
          if (!record) throw new Error(`no ${journal} record ${id} in ${path}`);
          record.state = "exploded";
          writeFileSync(path, JSON.stringify(doc));
          return over(path, dirs.get(old)!, now);
        },
      }
      : {}),
  };
}
setups["events-file"] = () =>
  eventsSetup(
    "events (FileEventJournal)",
    (p, clock) => FileEventJournal.open(p, { lock: true, clock }),
    (j) => simulateJournalCrash(j as FileEventJournal),
    true,
  );
setups["events-shared"] = () =>
  eventsSetup(
    "events (SharedFileEventJournal, appendLog)",
    (p, clock) => SharedFileEventJournal.open(p, { appendLog: { compactEvery: 7 }, clock }),
    (j) => j.close(),
  );

// PostgresDurability over a porsager client loaded from node_modules (a bare "postgres": under Deno
// deno.json's "nodeModulesDir": "manual" resolves it there, offline; the Node bundle keeps it
// external). Each test gets its own schema; a reopen ends the old client (as a killed process
// would) and opens a new one. BOTMESH_PG_URL overrides the server.
type PgClient = { end(options?: { timeout?: number }): Promise<void>; unsafe(query: string): Promise<unknown> };
const pgHomes = new WeakMap<DurabilityBackend, { sql: PgClient; schema: string }>();
/** Whether something accepts TCP connections at `url`'s host and port. */
function reachable(url: string): Promise<boolean> {
  const u = new URL(url);
  return new Promise((resolve) => {
    const socket = netConnect({ host: u.hostname, port: Number(u.port || 5432) });
    const done = (ok: boolean) => {
      clearTimeout(timer);
      socket.destroy();
      resolve(ok);
    };
    const timer = setTimeout(() => done(false), 1_000);
    socket.once("connect", () => done(true));
    socket.once("error", () => done(false));
  });
}
const PG_URL = process.env.BOTMESH_PG_URL ?? "postgres://postgres@127.0.0.1:5432/test";
const wantsPostgres = process.argv.slice(2).includes("postgres") || process.argv.length <= 2;
let pgSkip: string | false = false;
if (wantsPostgres && !(await reachable(PG_URL))) {
  if (process.env.BOTMESH_REQUIRE_SERVICES === "1") {
    throw new Error(`BOTMESH_REQUIRE_SERVICES=1 but postgres is not reachable at ${new URL(PG_URL).host}`);
  }
  pgSkip = `postgres is not reachable at ${new URL(PG_URL).host} (set BOTMESH_PG_URL)`;
  console.warn(`skipping the postgres conformance: ${pgSkip}`);
}
setups.postgres = () => {
  const url = PG_URL;
  const connect = async (): Promise<PgClient> => {
    const { default: postgres } = await import("postgres");
    return postgres(url, { max: 10, onnotice: () => {}, fetch_types: false }) as unknown as PgClient;
  };
  const over = async (schema: string) => {
    const sql = await connect();
    const b = new PostgresDurability({ sql: sql as never, schema });
    pgHomes.set(b, { sql, schema });
    return b;
  };
  return {
    name: "postgres",
    timeScale: 3,
    skip: pgSkip,
    create: () => over(`bm_rt_${crypto.randomUUID().replaceAll("-", "").slice(0, 12)}`),
    reopen: async (old) => {
      const home = pgHomes.get(old)!;
      await home.sql.end({ timeout: 2 });
      return over(home.schema);
    },
    cleanup: async (b) => {
      const home = pgHomes.get(b)!;
      await home.sql.end({ timeout: 2 });
      const admin = await connect();
      await admin.unsafe(`DROP SCHEMA IF EXISTS "${home.schema}" CASCADE`);
      await admin.end();
    },
  };
};

const runtime = "Deno" in globalThis ? "deno" : "Bun" in globalThis ? "bun" : `node ${process.version}`;
const wanted = process.argv.slice(2).filter((a) => !a.startsWith("-"));
if (wanted.length === 0) wanted.push(...Object.keys(setups));
let failures = 0;
for (const arg of wanted) {
  const [name, mode = "contract"] = arg.split(":") as [string, string?];
  const setup = setups[name];
  if (!setup) throw new TypeError(`Unknown backend "${name}": use ${Object.keys(setups).join(", ")}`);
  if (mode !== "contract" && mode !== "full") throw new TypeError(`Unknown mode "${mode}" of "${arg}": use ${name} or ${name}:full`);
  const harness = createHarness();
  (mode === "full" ? runDurabilityConformance : runBackendContract)({ ...setup(), harness });
  const started = Date.now();
  const result = await harness.run();
  failures += result.failed.length;
  console.log(
    `${runtime}: conformance (${mode === "full" ? "whole suite" : "journal contract"}) of ${name}: ${result.passed} passed, ${result.failed.length} failed, ${result.skipped} skipped (${
      ((Date.now() - started) / 1000).toFixed(1)
    } s)`,
  );
}
process.exit(failures > 0 ? 1 : 0);
