import { describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { FileDurability, simulateCrash } from "../backends/file.ts";
import { runDurabilityConformance } from "../testing.ts";
import type { DurabilityBackend } from "../src/backend.ts";

/** A backend on `bot.json` in a fresh temporary directory. */
function fresh(): FileDurability {
  const dir = mkdtempSync(join(tmpdir(), "botmesh-file-conf-"));
  return new FileDurability({ path: join(dir, "bot.json") });
}

runDurabilityConformance({
  name: "file",
  create: fresh,
  // A restart: the old instance is let go as a killed process would be (its lock file stays, holding our pid).
  reopen: async (old: DurabilityBackend) => {
    await simulateCrash(old as FileDurability);
    return new FileDurability({ path: (old as FileDurability).path });
  },
  cleanup: (backend: DurabilityBackend) => {
    rmSync(dirname((backend as FileDurability).path), { recursive: true, force: true });
  },
  harness: { describe, test, expect },
});
