import { describe, expect, test } from "bun:test";
import type { DurabilityBackend } from "../src/backend.ts";
import { MemoryKv } from "../backends/memory_kv.ts";
import { eventsDurability } from "../src/events/durability.ts";
import { type EventJournalState, MemoryEventJournal } from "../src/events/memory_journal.ts";
import { runDurabilityConformance } from "../testing.ts";

/** The journal under each backend, so that a "restarted process" gets a journal loaded from a snapshot of it. */
const journalOf = new WeakMap<DurabilityBackend, MemoryEventJournal>();
const kvOf = new WeakMap<DurabilityBackend, MemoryKv>();

function over(journal: MemoryEventJournal, kv?: MemoryKv): DurabilityBackend {
  const backend = eventsDurability({ journal, outbox: kv });
  journalOf.set(backend, journal);
  if (kv) kvOf.set(backend, kv);
  return backend;
}

/** A journal loaded from the JSON text of `old`'s snapshot, as a file journal would be after a restart. */
function reloaded(old: MemoryEventJournal): MemoryEventJournal {
  return MemoryEventJournal.fromState(JSON.parse(JSON.stringify(old.exportState())) as EventJournalState);
}

runDurabilityConformance({
  name: "events(memory-events)",
  create: () => over(new MemoryEventJournal()),
  reopen: (old) => over(reloaded(journalOf.get(old)!)),
  harness: { describe, test, expect },
});

runDurabilityConformance({
  name: "events(memory-events) + kv outbox",
  create: () => over(new MemoryEventJournal(), new MemoryKv()),
  reopen: (old) => over(reloaded(journalOf.get(old)!), kvOf.get(old)!),
  harness: { describe, test, expect },
});
