import { describe, expect, test } from "bun:test";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { FileDurability, simulateCrash } from "../backends/file/durability.ts";
import { runDurabilityConformance } from "../testing.ts";
import type { DurabilityBackend } from "../src/contract.ts";

/** A backend on `bot.json` in a fresh temporary directory. */
function fresh(clock: () => number): FileDurability {
  const dir = mkdtempSync(join(tmpdir(), "botmesh-file-conf-"));
  return new FileDurability({ path: join(dir, "bot.json"), clock });
}

runDurabilityConformance({
  name: "file",
  create: ({ now }) => fresh(now),
  // A restart: the old instance is let go as a killed process would be (its lock file stays, holding our pid).
  reopen: async (old: DurabilityBackend, { now }) => {
    await simulateCrash(old as FileDurability);
    return new FileDurability({ path: (old as FileDurability).path, clock: now });
  },
  // A hand edit: the backend is closed, the record given a state this library does not know (an inbox
  // record) or a content nested far deeper than the journal writes (an outbox entry), and the file opened again.
  damage: async (backend: DurabilityBackend, journal, id, { now }) => {
    const file = backend as FileDurability;
    await file.close();
    const snap = JSON.parse(readFileSync(file.path, "utf8"));
    const record = snap[journal].find((r: { id?: string; key?: string }) => (journal === "inbox" ? r.id : r.key) === id);
    if (journal === "inbox") record.state = "archived";
    else record.content = "@DEEP@";
    writeFileSync(file.path, JSON.stringify(snap).replace('"@DEEP@"', "[".repeat(300_000) + "]".repeat(300_000)));
    return new FileDurability({ path: file.path, clock: now });
  },
  cleanup: (backend: DurabilityBackend) => {
    rmSync(dirname((backend as FileDurability).path), { recursive: true, force: true });
  },
  harness: { describe, test, expect },
  simulatedTime: true,
});
