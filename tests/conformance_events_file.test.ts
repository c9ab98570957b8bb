import { describe, expect, test } from "bun:test";
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { FileEventJournal, simulateCrash } from "../backends/events/file_journal.ts";
import { EventsDurability } from "../backends/events/durability.ts";
import type { LeasedEventJournal } from "../src/events/types.ts";
import type { DurabilityBackend } from "../src/contract.ts";
import { runEventJournalContract } from "../src/testing/event_journal_contract.ts";
import { runDurabilityConformance } from "../testing.ts";

/** `events.json` in a fresh temporary directory. */
function freshPath(): string {
  return join(mkdtempSync(join(tmpdir(), "botmesh-events-file-conf-")), "events.json");
}

/** Every journal opened on a directory's file (reopened after a crash or a damage), for cleanup. */
const openedIn = new Map<string, FileEventJournal[]>();

async function openJournal(path: string, now: () => number): Promise<FileEventJournal> {
  const journal = await FileEventJournal.open(path, { lock: true, clock: now });
  const dir = dirname(journal.file);
  openedIn.set(dir, [...(openedIn.get(dir) ?? []), journal]);
  return journal;
}

/** Closes every journal opened on the file that was not let go, and removes its directory. */
async function dispose(journal: FileEventJournal): Promise<void> {
  const dir = dirname(journal.file);
  try {
    for (const j of openedIn.get(dir) ?? [journal]) if (!j.closed) await j.close();
  } finally {
    openedIn.delete(dir);
    rmSync(dir, { recursive: true, force: true });
  }
}

runEventJournalContract({
  name: "file-events",
  create: ({ now }) => openJournal(freshPath(), now),
  cleanup: (journal: LeasedEventJournal) => dispose(journal as FileEventJournal),
  harness: { describe, test, expect },
  simulatedTime: true,
});

/** The journal under each backend. */
const journalOf = new WeakMap<DurabilityBackend, FileEventJournal>();

function over(journal: FileEventJournal): DurabilityBackend {
  const backend = new EventsDurability({ journal });
  journalOf.set(backend, journal);
  return backend;
}

runDurabilityConformance({
  name: "events(file-events)",
  create: async ({ now }) => over(await openJournal(freshPath(), now)),
  // A restart: the old journal is let go as a killed process would be (its lock file stays, holding our pid).
  reopen: async (old: DurabilityBackend, { now }) => {
    const journal = journalOf.get(old)!;
    await simulateCrash(journal);
    return over(await openJournal(journal.path, now));
  },
  // A hand edit: the record's state made an unknown word in the closed file, which is then opened again.
  damage: async (backend, journal, id, { now }) => {
    const old = journalOf.get(backend)!;
    await old.close();
    const doc = JSON.parse(readFileSync(old.file, "utf8"));
    const records: Record<string, unknown>[] = journal === "inbox" ? doc.events : doc.outbox;
    const record = records.find((r) => r[journal === "inbox" ? "id" : "key"] === id);
    if (!record) throw new Error(`no ${journal} record ${id} in ${old.file}`);
    // An inbox record's message nested deeper than the journal writes (MAX_STORED_DEPTH; not so deep that the
    // event journal's copies overflow the stack); an outbox entry's unknown state.
    const text = journal === "inbox"
      ? JSON.stringify(doc).replace(JSON.stringify(record), JSON.stringify({ ...record, payload: { ...(record.payload as object), message: "@DEEP@" } }))
        .replace('"@DEEP@"', "[".repeat(1_000) + "]".repeat(1_000))
      : JSON.stringify({ ...doc, outbox: records.map((r) => r === record ? { ...r, state: "exploded" } : r) });
    writeFileSync(old.file, text);
    return over(await openJournal(old.path, now));
  },
  cleanup: (backend: DurabilityBackend) => dispose(journalOf.get(backend)!),
  harness: { describe, test, expect },
  simulatedTime: true,
});
