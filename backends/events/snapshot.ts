/**
 * The file format shared by `FileEventJournal` and `SharedFileEventJournal`:
 * one JSON snapshot `{ format, version, logSeq, outboxSeq, events, outbox,
 * damaged? }`. `logSeq` is the last append-log entry the snapshot contains
 * (0 without a log), so that replaying the log skips what the snapshot
 * already holds. Events are `EventRecord`s as they are; one stored before
 * there were ordering groups has no `orderKey` and reads as `orderKey: null`.
 * A record of `events` or `outbox` that is not valid is read as damaged and
 * written back as it was; `damaged` holds the marks of the records set aside
 * (`DamageMark`: journal, id, problem, setAsideAt, reported). A snapshot with
 * marks is `version` 2 (versions before it refuse it rather than drop them),
 * one without is `version` 1, as before.
 *
 * @module
 */
import { MemoryEventJournal, type MemoryEventJournalOptions } from "./memory_journal.ts";
import { FileCorruptError } from "../file/corrupt_error.ts";
import { parseJsonBytes } from "../file/snapshot.ts";

/** The `format` marker of an events journal file. */
export const EVENTS_FORMAT = "@botmesh/durable/events";
/**
 * The version of the file format: 2 when the snapshot has a `damaged`
 * section (versions before it refuse such a file rather than drop the marks),
 * else 1 (which they also read). This code reads both.
 */
export const EVENTS_FORMAT_VERSION = 2;

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
  const damaged = state.damaged?.length ? `,"damaged":${JSON.stringify(state.damaged)}` : "";
  const head = JSON.stringify({
    format: EVENTS_FORMAT,
    version: state.damaged?.length ? EVENTS_FORMAT_VERSION : 1,
    logSeq,
    outboxSeq: state.outboxSeq,
  });
  return `${head.slice(0, -1)},"events":${arrayJson(state.events)},"outbox":${arrayJson(state.outbox)}${damaged}}`;
}

/**
 * The JSON text of each record object, kept while the object lives: the
 * journal never changes a record in place (a change replaces the object), so
 * a snapshot rewrite serializes only the records changed since the last one.
 */
const recordJson = new WeakMap<object, string>();

/** `JSON.stringify(records)`, each record's text from {@link recordJson}. */
function arrayJson(records: readonly object[]): string {
  let out = "[";
  for (let i = 0; i < records.length; i++) {
    const record = records[i];
    let text = recordJson.get(record);
    if (text === undefined) {
      text = JSON.stringify(record);
      recordJson.set(record, text);
    }
    out += i === 0 ? text : `,${text}`;
  }
  return `${out}]`;
}

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
  if (doc!.version !== 1 && doc!.version !== EVENTS_FORMAT_VERSION) {
    bad(`field "version" is ${JSON.stringify(doc!.version)}; this code reads versions 1 and ${EVENTS_FORMAT_VERSION}`);
  }
  const logSeq = doc!.logSeq;
  if (typeof logSeq !== "number" || !Number.isInteger(logSeq) || logSeq < 0) {
    bad(`field "logSeq" must be a non-negative integer, got ${JSON.stringify(logSeq)}`);
  }
  const journal = new MemoryEventJournal(options);
  try {
    journal.importState({
      events: doc!.events as never,
      outbox: doc!.outbox as never,
      outboxSeq: doc!.outboxSeq as never,
      damaged: doc!.damaged as never,
    });
  } catch (error) {
    bad((error as Error).message);
  }
  return { journal, logSeq: logSeq as number };
}
