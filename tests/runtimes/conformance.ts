/**
 * Runs the whole conformance suite outside bun:test, to prove the backends on
 * the other runtimes and their drivers (Node 20: better-sqlite3; Deno:
 * node:sqlite and Deno's file system).
 *
 *   deno run -A tests/runtimes/conformance.ts memory file sqlite
 *   bun build tests/runtimes/conformance.ts --target=node --outdir .tmp/rt --external better-sqlite3
 *   node .tmp/rt/conformance.js memory file sqlite
 *
 * Exits non-zero when a test fails.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import process from "node:process";
import type { DurabilityBackend } from "../../src/backend.ts";
import { MemoryDurability } from "../../backends/memory.ts";
import { FileDurability, simulateCrash } from "../../backends/file.ts";
import { SQLiteDurability } from "../../backends/sqlite.ts";
import { runDurabilityConformance } from "../../testing.ts";
import type { BackendConformanceOptions } from "../../src/testing/conformance.ts";
import { createHarness } from "./harness.ts";

type Setup = Omit<BackendConformanceOptions, "harness">;

const dirs = new WeakMap<DurabilityBackend, string>();
const paths = new WeakMap<DurabilityBackend, string>();

function tempDir(): string {
  return mkdtempSync(join(tmpdir(), "botmesh-rt-"));
}

const setups: Record<string, () => Setup> = {
  memory: () => ({ name: "memory", create: () => new MemoryDurability() }),
  file: () => {
    const open = (path: string, dir: string) => {
      const b = new FileDurability({ path });
      dirs.set(b, dir);
      paths.set(b, path);
      return b;
    };
    return {
      name: "file",
      create: () => {
        const dir = tempDir();
        return open(join(dir, "bot.json"), dir);
      },
      reopen: async (old) => {
        await simulateCrash(old as FileDurability);
        return open(paths.get(old)!, dirs.get(old)!);
      },
      cleanup: (b) => rmSync(dirs.get(b)!, { recursive: true, force: true }),
    };
  },
  sqlite: () => {
    const open = (file: string, dir: string) => {
      const b = new SQLiteDurability({ file });
      dirs.set(b, dir);
      paths.set(b, file);
      return b;
    };
    return {
      name: "sqlite",
      create: () => {
        const dir = tempDir();
        return open(join(dir, "bot.db"), dir);
      },
      reopen: async (old) => {
        const b = old as SQLiteDurability;
        while (b.isOpen) await b.close();
        return open(paths.get(old)!, dirs.get(old)!);
      },
      cleanup: (b) => rmSync(dirs.get(b)!, { recursive: true, force: true }),
    };
  },
};

const runtime = "Deno" in globalThis ? "deno" : "Bun" in globalThis ? "bun" : `node ${process.version}`;
const wanted = process.argv.slice(2).filter((a) => !a.startsWith("-"));
if (wanted.length === 0) wanted.push(...Object.keys(setups));
let failures = 0;
for (const name of wanted) {
  const setup = setups[name];
  if (!setup) throw new TypeError(`Unknown backend "${name}": use ${Object.keys(setups).join(", ")}`);
  const harness = createHarness();
  runDurabilityConformance({ ...setup(), harness });
  const started = Date.now();
  const result = await harness.run();
  failures += result.failed.length;
  console.log(
    `${runtime}: conformance of ${name}: ${result.passed} passed, ${result.failed.length} failed, ${result.skipped} skipped (${
      ((Date.now() - started) / 1000).toFixed(1)
    } s)`,
  );
}
process.exit(failures > 0 ? 1 : 0);
