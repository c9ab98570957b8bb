/**
 * The file format shared by `FileEventJournal` and `SharedFileEventJournal`:
 * one JSON snapshot `{ format, version, logSeq, outboxSeq, events, outbox }`.
 * `logSeq` is the last append-log entry the snapshot contains (0 without a
 * log), so that replaying the log skips what the snapshot already holds.
 * Events are `EventRecord`s as they are; one stored before there were
 * ordering groups has no `orderKey` and reads as `orderKey: null`.
 *
 * @module
 */
import { MemoryEventJournal, type MemoryEventJournalOptions } from "../../src/events/memory_journal.ts";
import { FileCorruptError, parseJsonBytes } from "../file_support.ts";
import { storedOutboxProblem } from "../../src/stored_records.ts";

/** The `format` marker of an events journal file. */
export const EVENTS_FORMAT = "@botmesh/durable/events";
/** The version of the file format this code writes and reads. */
export const EVENTS_FORMAT_VERSION = 1;

/** A parsed snapshot: the journal and the log position it contains. */
export interface LoadedEventSnapshot {
  journal: MemoryEventJournal;
  logSeq: number;
}

/**
 * The snapshot text of `journal` (records serialized as they are).
 *
 * @param journal the journal to save
 * @param logSeq the last log entry it contains
 * @returns the JSON text
 */
export function serializeEventSnapshot(journal: MemoryEventJournal, logSeq: number): string {
  const state = journal.exportState();
  return JSON.stringify({
    format: EVENTS_FORMAT,
    version: EVENTS_FORMAT_VERSION,
    logSeq,
    outboxSeq: state.outboxSeq,
    events: state.events,
    outbox: state.outbox,
  });
}

/**
 * Parses and checks a snapshot file's bytes into a journal.
 *
 * @param file the file, for errors
 * @param bytes its content
 * @param label the journal class named in errors
 * @param options options of the journal built
 * @returns the journal and its `logSeq`
 * @throws {FileCorruptError} naming the file and the byte offset (syntax, encoding) or the bad field (structure)
 */
export function parseEventSnapshot(
  file: string,
  bytes: Uint8Array,
  label: string,
  options?: MemoryEventJournalOptions,
): LoadedEventSnapshot {
  const doc = parseJsonBytes(file, bytes, label) as Record<string, unknown> | null;
  const bad = (detail: string): never => {
    throw new FileCorruptError(file, null, detail, label);
  };
  if (typeof doc !== "object" || doc === null || Array.isArray(doc)) bad("the top level is not a JSON object");
  if (doc!.format !== EVENTS_FORMAT) {
    bad(`field "format" is ${JSON.stringify(doc!.format)}, expected ${JSON.stringify(EVENTS_FORMAT)}`);
  }
  if (doc!.version !== EVENTS_FORMAT_VERSION) {
    bad(`field "version" is ${JSON.stringify(doc!.version)}; this code reads version ${EVENTS_FORMAT_VERSION}`);
  }
  const logSeq = doc!.logSeq;
  if (typeof logSeq !== "number" || !Number.isInteger(logSeq) || logSeq < 0) {
    bad(`field "logSeq" must be a non-negative integer, got ${JSON.stringify(logSeq)}`);
  }
  if (Array.isArray(doc!.outbox)) {
    (doc!.outbox as unknown[]).forEach((entry, i) => {
      const problem = storedOutboxProblem(entry);
      if (problem === null) return;
      const key = (entry as { key?: unknown } | null)?.key;
      bad(`outbox entry ${i}${typeof key === "string" ? ` (key ${JSON.stringify(key)})` : ""}: ${problem}`);
    });
  }
  const journal = new MemoryEventJournal(options);
  try {
    journal.importState({
      events: doc!.events as never,
      outbox: doc!.outbox as never,
      outboxSeq: doc!.outboxSeq as never,
    });
  } catch (error) {
    bad((error as Error).message);
  }
  return { journal, logSeq: logSeq as number };
}
