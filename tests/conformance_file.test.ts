import { describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { FileDurability, simulateCrash } from "../backends/file.ts";
import { runDurabilityConformance } from "../testing.ts";
import type { DurabilityBackend } from "../src/backend.ts";

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
  cleanup: (backend: DurabilityBackend) => {
    rmSync(dirname((backend as FileDurability).path), { recursive: true, force: true });
  },
  harness: { describe, test, expect },
  simulatedTime: true,
});
