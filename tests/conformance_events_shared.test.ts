import { describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { type SharedFileEventJournalOptions, SharedFileEventJournal } from "../backends/events/shared_journal.ts";
import type { DurabilityBackend } from "../src/backend.ts";
import { eventsDurability } from "../src/events/durability.ts";
import type { LeasedEventJournal } from "../src/events/types.ts";
import { runEventJournalContract } from "../src/testing/event_journal_contract.ts";
import { runDurabilityConformance } from "../testing.ts";

const variants: { name: string; options: SharedFileEventJournalOptions }[] = [
  { name: "shared-file-events", options: {} },
  { name: "shared-file-events appendLog", options: { appendLog: true } },
  // Compaction (snapshot with logSeq, then the log truncated) happens many times inside the suite.
  { name: "shared-file-events appendLog compactEvery 7", options: { appendLog: { compactEvery: 7 } } },
];

/** The journal under each backend, for reopen and cleanup. */
const journalOf = new WeakMap<DurabilityBackend, SharedFileEventJournal>();

async function freshJournal(options: SharedFileEventJournalOptions): Promise<SharedFileEventJournal> {
  const dir = mkdtempSync(join(tmpdir(), "botmesh-shared-events-"));
  return await SharedFileEventJournal.open(join(dir, "events.json"), options);
}

function over(journal: SharedFileEventJournal): DurabilityBackend {
  const backend = eventsDurability({ journal });
  journalOf.set(backend, journal);
  return backend;
}

for (const { name, options } of variants) {
  runEventJournalContract({
    name,
    create: ({ now }) => freshJournal({ ...options, clock: now }),
    cleanup: async (journal: LeasedEventJournal) => {
      await journal.close();
      rmSync(dirname((journal as SharedFileEventJournal).path), { recursive: true, force: true });
    },
    harness: { describe, test, expect },
    simulatedTime: true,
  });

  runDurabilityConformance({
    name: `events(${name})`,
    create: async ({ now }) => over(await freshJournal({ ...options, clock: now })),
    // A restart: the old journal is closed, a new one opens the same file (and loads it from disk).
    reopen: async (old: DurabilityBackend, { now }) => {
      const journal = journalOf.get(old)!;
      await journal.close();
      return over(await SharedFileEventJournal.open(journal.path, { ...options, clock: now }));
    },
    cleanup: async (backend: DurabilityBackend) => {
      const journal = journalOf.get(backend)!;
      await journal.close();
      rmSync(dirname(journal.path), { recursive: true, force: true });
    },
    harness: { describe, test, expect },
    simulatedTime: true,
  });
}
