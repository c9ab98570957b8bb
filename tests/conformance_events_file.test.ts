import { describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { FileEventJournal, simulateCrash } from "../backends/events/file_journal.ts";
import { eventsDurability } from "../src/events/durability.ts";
import type { LeasedEventJournal } from "../src/events/types.ts";
import type { DurabilityBackend } from "../src/backend.ts";
import { runEventJournalContract } from "../src/testing/event_journal_contract.ts";
import { runDurabilityConformance } from "../testing.ts";

/** `events.json` in a fresh temporary directory. */
function freshPath(): string {
  return join(mkdtempSync(join(tmpdir(), "botmesh-events-file-conf-")), "events.json");
}

/** Closes the journal unless it was let go, and removes its directory. */
async function dispose(journal: FileEventJournal): Promise<void> {
  try {
    if (!journal.closed) await journal.close();
  } finally {
    rmSync(dirname(journal.file), { recursive: true, force: true });
  }
}

runEventJournalContract({
  name: "file-events",
  create: ({ now }) => FileEventJournal.open(freshPath(), { lock: true, clock: now }),
  cleanup: (journal: LeasedEventJournal) => dispose(journal as FileEventJournal),
  harness: { describe, test, expect },
  simulatedTime: true,
});

/** The journal under each backend. */
const journalOf = new WeakMap<DurabilityBackend, FileEventJournal>();

function over(journal: FileEventJournal): DurabilityBackend {
  const backend = eventsDurability({ journal });
  journalOf.set(backend, journal);
  return backend;
}

runDurabilityConformance({
  name: "events(file-events)",
  create: async ({ now }) => over(await FileEventJournal.open(freshPath(), { lock: true, clock: now })),
  // A restart: the old journal is let go as a killed process would be (its lock file stays, holding our pid).
  reopen: async (old: DurabilityBackend, { now }) => {
    const journal = journalOf.get(old)!;
    await simulateCrash(journal);
    return over(await FileEventJournal.open(journal.path, { lock: true, clock: now }));
  },
  cleanup: (backend: DurabilityBackend) => dispose(journalOf.get(backend)!),
  harness: { describe, test, expect },
  simulatedTime: true,
});
