import { describe, expect, test } from "bun:test";
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { type SharedFileEventJournalOptions, SharedFileEventJournal } from "../backends/events/shared_journal.ts";
import type { DurabilityBackend } from "../src/contract.ts";
import { EventsDurability } from "../backends/events/durability.ts";
import type { LeasedEventJournal } from "../src/events/types.ts";
import { runEventJournalContract } from "../src/testing/event_journal_contract.ts";
import { runBackendContract } from "../testing.ts";

/**
 * How each variant damages a record: an unknown state (the journal sets the record aside), or for the
 * bot's inbox a payload that is no longer an inbound message (a valid event the bot's inbox sets aside).
 */
type Hurt = (record: Record<string, unknown>, journal: "inbox" | "outbox") => void;
const unknownState: Hurt = (record) => void (record.state = "exploded");
const badPayload: Hurt = (record, journal) => void (journal === "inbox" ? record.payload = "{not json" : record.state = "exploded");

const variants: { name: string; options: SharedFileEventJournalOptions; hurt: Hurt }[] = [
  { name: "shared-file-events", options: {}, hurt: badPayload },
  { name: "shared-file-events appendLog", options: { appendLog: true }, hurt: unknownState },
  // Compaction (snapshot with logSeq, then the log truncated) happens many times inside the suite.
  { name: "shared-file-events appendLog compactEvery 7", options: { appendLog: { compactEvery: 7 } }, hurt: unknownState },
];

/** The journal under each backend, for reopen and cleanup. */
const journalOf = new WeakMap<DurabilityBackend, SharedFileEventJournal>();
/** Every journal opened on a directory's file (reopened after a restart or a damage), for cleanup. */
const openedIn = new Map<string, SharedFileEventJournal[]>();

async function openJournal(path: string, options: SharedFileEventJournalOptions): Promise<SharedFileEventJournal> {
  const journal = await SharedFileEventJournal.open(path, options);
  openedIn.set(dirname(journal.path), [...(openedIn.get(dirname(journal.path)) ?? []), journal]);
  return journal;
}

async function freshJournal(options: SharedFileEventJournalOptions): Promise<SharedFileEventJournal> {
  const dir = mkdtempSync(join(tmpdir(), "botmesh-shared-events-"));
  return await openJournal(join(dir, "events.json"), options);
}

/** Closes every journal opened on the file, and removes its directory. */
async function dispose(journal: SharedFileEventJournal): Promise<void> {
  const dir = dirname(journal.path);
  try {
    for (const j of openedIn.get(dir) ?? [journal]) await j.close();
  } finally {
    openedIn.delete(dir);
    rmSync(dir, { recursive: true, force: true });
  }
}

/**
 * Damages record `id` where its latest version is stored: the newest generation that holds it (a
 * snapshot, or a delta line), edited in place.
 */
function damageGenerations(journal: SharedFileEventJournal, kind: "inbox" | "outbox", id: string, hurt: Hurt): void {
  const gens = readdirSync(journal.genDir).filter((name) => /^\d+$/.test(name)).map(Number).sort((a, b) => b - a);
  for (const gen of gens) {
    const file = join(journal.genDir, String(gen));
    const text = readFileSync(file, "utf8");
    const doc = JSON.parse(text);
    const records: Record<string, unknown>[] = (kind === "inbox" ? doc.events : doc.outbox) ?? [];
    const record = records.find((r) => r[kind === "inbox" ? "id" : "key"] === id);
    if (!record) continue;
    hurt(record, kind);
    writeFileSync(file, JSON.stringify(doc) + (text.endsWith("\n") ? "\n" : "")); // key order kept: the stamp stays first
    return;
  }
  throw new Error(`no ${kind} record ${id} in ${journal.genDir}`);
}

function over(journal: SharedFileEventJournal): DurabilityBackend {
  const backend = new EventsDurability({ journal });
  journalOf.set(backend, journal);
  return backend;
}

for (const { name, options, hurt } of variants) {
  runEventJournalContract({
    name,
    create: ({ now }) => freshJournal({ ...options, clock: now }),
    cleanup: (journal: LeasedEventJournal) => dispose(journal as SharedFileEventJournal),
    harness: { describe, test, expect },
    simulatedTime: true,
  });

  // (the whole suite runs once for the events family, on the file journal: conformance_events_file)
  runBackendContract({
    name: `events(${name})`,
    create: async ({ now }) => over(await freshJournal({ ...options, clock: now })),
    // A restart: the old journal is closed, a new one opens the same file (and loads it from disk).
    reopen: async (old: DurabilityBackend, { now }) => {
      const journal = journalOf.get(old)!;
      await journal.close();
      return over(await openJournal(journal.path, { ...options, clock: now }));
    },
    // A hand edit of the closed journal's newest generation holding the record, then the file opened again.
    damage: async (backend, journal, id, { now }) => {
      const old = journalOf.get(backend)!;
      await old.close();
      damageGenerations(old, journal, id, hurt);
      return over(await openJournal(old.path, { ...options, clock: now }));
    },
    cleanup: (backend: DurabilityBackend) => dispose(journalOf.get(backend)!),
    harness: { describe, test, expect },
    simulatedTime: true,
  });
}
