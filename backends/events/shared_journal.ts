/**
 * `SharedFileEventJournal`: one events-journal file shared by several
 * processes of one host, every operation under the inter-process mutex
 * `<file>.mutex`.
 *
 * @module
 */
import type { ClaimDueOptions, ClaimOptions, FailOutcome, ListOptions, NewOutboxEntry } from "../../src/backend.ts";
import type { OutboxClaim, OutboxEntry, OutboxJournal, OutboxState, ReserveResult } from "../../src/backend.ts";
import { MemoryEventJournal, type MemoryEventJournalOptions } from "../../src/events/memory_journal.ts";
import type {
  EventClaimOptions,
  EventListOptions,
  EventRecord,
  LeasedEventJournal,
  NewEventRecord,
} from "../../src/events/types.ts";
import { randomId } from "../../src/runtime/mod.ts";
import {
  appendToFile,
  dirName,
  ensureDir,
  type FileIdentity,
  openPinned,
  type PinnedFile,
  readFileRange,
  realPathOf,
  removeFile,
  renameFile,
  resolvePath,
  statIdentity,
  syncDirectory,
  truncateFile,
  writeFilePinned,
} from "../../src/runtime/fs.ts";
import { showValue as show } from "../../src/show.ts";
import { storedOutboxProblem } from "../../src/stored_records.ts";
import {
  claimOpenFile,
  DEFAULT_STALE_LOCK_MS,
  FileCorruptError,
  FileLockedError,
  findLiveLockHolder,
  findJsonSyntaxError,
  FileMutex,
  type FileMutexHandle,
  FileMutexLostError,
  releaseOpenFile,
  snapshotFileMode,
} from "../file_support.ts";
import { parseEventSnapshot, serializeEventSnapshot } from "./snapshot.ts";

const LABEL = "SharedFileEventJournal";
/** Default {@link AppendLogOptions.compactEvery}. */
const DEFAULT_COMPACT_EVERY = 1000;
/** Default {@link AppendLogOptions.compactBytes}: 4 MiB. */
const DEFAULT_COMPACT_BYTES = 4 * 1024 * 1024;
/** The stamp a shared journal writes first in its snapshot: `generation` and `writer`. */
const SNAPSHOT_STAMP = /^\{"generation":(\d+),"writer":"([0-9A-Za-z_-]+)",/;
/** Most operations run under one hold of the mutex (group commit). */
const MAX_BATCH = 256;

const encoder = new TextEncoder();

/** Options of the append log (`appendLog: { … }`). */
export interface AppendLogOptions {
  /** Compact (rewrite the snapshot, truncate the log) after this many log entries (default `1000`, at least 1). */
  compactEvery?: number;
  /** …or once the log reaches this many bytes (default 4 MiB). */
  compactBytes?: number;
  /** Flush each appended line to the disk (default: the journal's `fsync`, itself `true` by default). */
  fsync?: boolean;
}

/** Options of {@link SharedFileEventJournal.open}. */
export interface SharedFileEventJournalOptions {
  /**
   * Append one line per write to `<file>.log` instead of rewriting the whole
   * snapshot (`true`, or the compaction options); default `false`.
   */
  appendLog?: boolean | AppendLogOptions;
  /** Flush snapshots (and, unless `appendLog.fsync` says otherwise, log lines) to the disk (default `true`). */
  fsync?: boolean;
  /**
   * A mutex not refreshed for this long (ms) is taken as abandoned (a stuck
   * holder) and broken; a mutex of a dead pid is broken at once (default
   * `30000`, at least `100`). Also the staleness of a `<file>.lock` of another
   * host. Use the same value in every process.
   */
  staleLockMs?: number;
  /** How often (ms) a holder refreshes the mutex's mtime (default `staleLockMs / 3`). */
  heartbeatMs?: number;
  /** How long (ms) an operation waits for a busy mutex before it rejects (default `10000`). */
  mutexTimeoutMs?: number;
  /** The journal clock in ms since epoch (default `() => Date.now()`). */
  clock?: () => number;
}

/**
 * Test hooks (process-wide; not part of the API): called at the commit
 * points, so that a test can stop or kill a process exactly there.
 * @internal
 */
export interface SharedJournalTestHooks {
  /** Right before the mutex check and the commit (`snapshot`: rename; `append`: the log line's write). */
  beforeCommit?: (what: { kind: "snapshot" | "append" | "compact"; path: string; bytes: Uint8Array }) => void | Promise<void>;
  /** After the mutex check, right before the commit itself (the rename, or the log line's write). */
  afterCheck?: (what: { kind: "snapshot" | "append" | "compact"; path: string }) => void | Promise<void>;
  /** After a compaction's snapshot was renamed into place, before the log is truncated. */
  betweenSnapshotAndTruncate?: (logPath: string) => void | Promise<void>;
}

/** @internal Set by test fixtures only. */
export const sharedJournalTestHooks: SharedJournalTestHooks = {};

/** One queued operation. */
interface Job {
  op: string;
  fn: (journal: MemoryEventJournal) => Promise<unknown>;
  resolve: (value: unknown) => void;
  reject: (error: unknown) => void;
}

type Outcome = { ok: true; value: unknown } | { ok: false; error: unknown };

function sameIdentity(a: FileIdentity | null, b: FileIdentity | null): boolean {
  if (a === null || b === null) return a === b;
  return a.id === b.id && a.size === b.size && a.mtimeNs === b.mtimeNs;
}

function checkBoolean(value: unknown, name: string): boolean {
  if (typeof value !== "boolean") throw new TypeError(`${LABEL} option "${name}" must be a boolean, got ${show(value)}`);
  return value;
}

/**
 * An events journal in one file shared by several processes of one host
 * (`scope: 'host'`): claims are exclusive and fencing tokens hold across
 * processes. Same file format as `FileEventJournal` (a JSON snapshot with
 * `logSeq`, see `./snapshot.ts`), the core's outbox stored in it too.
 *
 * Every operation, reads included, runs under the mutex `<file>.mutex` (see
 * `FileMutex`): it brings this process's cached journal up to date with the
 * file, runs, writes what changed, and releases the mutex. Operations called
 * while the mutex is being waited for run together under the next hold
 * (group commit), in call order.
 *
 * - Default: a write rewrites the whole snapshot (a temporary file renamed
 *   over it, the mutex checked right before the rename, so that a holder that
 *   was stopped and lost the mutex before the check never commits its late
 *   write; for a stop after the check, see below). The
 *   snapshot is re-read only when it was replaced: this process keeps the
 *   snapshot it knows open, so its inode cannot be reused, and compares
 *   `dev:ino`, size and mtime.
 * - `appendLog`: a write appends one line `{"seq":n,…changes}` to
 *   `<file>.log` (one write call); a sync reads only the bytes appended since
 *   this process's last look. Every `compactEvery` entries or `compactBytes`,
 *   the snapshot is rewritten with `logSeq` and the log truncated; a crash in
 *   between is harmless (replay skips entries up to `logSeq`), and a torn
 *   last line (a writer died mid-line) is trimmed before the next append.
 *   Per-write cost does not grow with the journal.
 * - A mutex left by a dead process is broken at once; a stuck holder's after
 *   `staleLockMs`. Nothing is ever killed.
 * - A holder stopped (or its event loop blocked) for longer than `staleLockMs`
 *   right between its mutex check and its commit still commits once it runs
 *   again. Such a write is never acknowledged: when the mutex was taken over
 *   by the time of the release, the whole batch rejects with a
 *   `FileMutexLostError` ("…taken over during the commit: this write may or
 *   may not be in the journal") and the cache is dropped. In `appendLog`
 *   each line carries a nonce (`w`) and is read back where it had to land:
 *   of two lines with one `seq` every reader applies the first, and the
 *   writer of the second is told its write failed (it re-syncs next time).
 *   Snapshots are stamped `generation` (after the last one known, and not
 *   before the host's clock) and `writer`; a holder that finds a snapshot by
 *   another writer whose generation is not after the one it knew (a late
 *   rename) writes back the state it knew, dropping the late write.
 *   Remaining window: a late rename, or a late compaction's truncate of the
 *   log, lands after the new holder's commit and the next holder to sync
 *   does not know the newer generation (a process that opened, or reloaded,
 *   after the late rename, or whose last look predates the new holder's
 *   commit) and writes on top of it: then the acknowledged writes committed
 *   after the late writer's own sync (which its snapshot does not hold, or
 *   which its truncate removed) are lost, silently for their writers. In
 *   `appendLog`, a late compaction (its rename, then its truncate of the
 *   log) after other holders appended lines without rewriting the snapshot
 *   is not detected at all (its generation is after every one known): the
 *   lines it truncates, acknowledged, are lost. A late log line computed on stale state
 *   whose `seq` is not taken (nobody appended since its writer's sync, e.g.
 *   the snapshot was rewritten in between) is applied although its writer
 *   was told its write may have failed.
 * - A file that a live `FileEventJournal` holds (its `<file>.lock`) is
 *   refused, at open and by every operation: an error instead of lost records.
 * - `close()` lets operations already called finish, and rejects later ones.
 *
 * @example Three workers (processes) may run this on one file
 * ```ts
 * import { mkdtempSync } from "node:fs";
 * import { tmpdir } from "node:os";
 * import { join } from "node:path";
 * import { SharedFileEventJournal } from "./shared_journal.ts";
 *
 * const path = join(mkdtempSync(join(tmpdir(), "shared-events-")), "events.json");
 * const journal = await SharedFileEventJournal.open(path, { appendLog: true });
 * await journal.append({ id: "order-42", eventType: "order.paid", payload: { order: 42 } });
 * const [event] = await journal.claimDue({ owner: "worker-1", incarnation: "a", leaseMs: 30_000, limit: 10 });
 * await journal.complete(event.id, event.lease!.token);
 * await journal.close();
 * ```
 */
export class SharedFileEventJournal implements LeasedEventJournal {
  /** Always `'shared-file-events'`. */
  readonly name: string = "shared-file-events";
  /** Processes of one host. */
  readonly scope: "host" = "host";
  /** The snapshot file (absolute real path). */
  readonly path: string;
  /** The append log `<file>.log` (used with `appendLog`, and folded in when found). */
  readonly logPath: string;
  /** The core's outbox, in the same file. */
  readonly outbox: OutboxJournal;

  readonly #mutex: FileMutex;
  readonly #appendLog: boolean;
  readonly #compactEvery: number;
  readonly #compactBytes: number;
  readonly #fsync: boolean;
  readonly #logFsync: boolean;
  readonly #staleLockMs: number;
  readonly #mode: number;
  readonly #memoryOptions: MemoryEventJournalOptions;
  readonly #temp: string;

  /** The file's state as this process last saw it (`null`: reload). */
  #cache: MemoryEventJournal | null = null;
  /** The snapshot the cache was loaded from or written as, kept open (its inode cannot be reused). */
  #pinned: PinnedFile | null = null;
  #pinnedId: FileIdentity | null = null;
  /** `generation` and `writer` of that snapshot (`0`, `null`: none, e.g. written by a `FileEventJournal`). */
  #generation = 0;
  #writer: string | null = null;
  /** `logSeq` of that snapshot. */
  #snapLogSeq = 0;
  /** The last log entry applied (or written). */
  #lastSeq = 0;
  /** Bytes of the log applied so far (always at a line end). */
  #logOffset = 0;
  /** Lines of the log before `#logOffset` (for errors: "line n"). */
  #logLines = 0;
  /** `dev:ino` of the log read so far. */
  #logId: string | null = null;

  readonly #queue: Job[] = [];
  #draining: Promise<void> | null = null;
  #closed = false;
  #released = false;

  private constructor(
    path: string,
    mutex: FileMutex,
    mode: number,
    settings: {
      appendLog: boolean;
      compactEvery: number;
      compactBytes: number;
      fsync: boolean;
      logFsync: boolean;
      staleLockMs: number;
      clock?: () => number;
    },
  ) {
    this.path = path;
    this.logPath = `${path}.log`;
    this.#mutex = mutex;
    this.#mode = mode;
    this.#appendLog = settings.appendLog;
    this.#compactEvery = settings.compactEvery;
    this.#compactBytes = settings.compactBytes;
    this.#fsync = settings.fsync;
    this.#logFsync = settings.logFsync;
    this.#staleLockMs = settings.staleLockMs;
    this.#memoryOptions = settings.clock ? { clock: settings.clock, heartbeatChanges: true } : { heartbeatChanges: true };
    this.#temp = `${path}.${randomId()}.tmp`;
    const run = <T>(op: string, fn: (journal: MemoryEventJournal) => Promise<T>): Promise<T> => this.#enqueue(op, fn);
    this.outbox = new SharedOutbox(run);
  }

  /**
   * Opens (or starts) the journal file `path`, shared with other processes.
   * The file need not exist; its directory is created when missing.
   *
   * @param path the journal file
   * @param options `appendLog`, `fsync`, `staleLockMs`, `heartbeatMs`, `mutexTimeoutMs`, `clock`
   * @returns the open journal
   * @throws {TypeError} or {RangeError} naming a bad option
   * @throws {FileLockedError} when a live process holds `<file>.lock` (a `FileEventJournal` has the file)
   * @throws {FileCorruptError} when the snapshot or the log is damaged (file and offset named)
   * @throws {Error} when this process already has the file open through another backend
   */
  static async open(path: string, options: SharedFileEventJournalOptions = {}): Promise<SharedFileEventJournal> {
    if (typeof path !== "string" || path.length === 0 || path.includes("\0")) {
      throw new TypeError(`${LABEL}: the path must be a non-empty string without NUL, got ${show(path)}`);
    }
    if (typeof options !== "object" || options === null || Array.isArray(options)) {
      throw new TypeError(`${LABEL} options must be an object, got ${show(options)}`);
    }
    const fsync = checkBoolean(options.fsync ?? true, "fsync");
    const rawLog = options.appendLog ?? false;
    let appendLog = false;
    let compactEvery = DEFAULT_COMPACT_EVERY;
    let compactBytes = DEFAULT_COMPACT_BYTES;
    let logFsync = fsync;
    if (typeof rawLog === "boolean") {
      appendLog = rawLog;
    } else if (typeof rawLog === "object" && rawLog !== null && !Array.isArray(rawLog)) {
      appendLog = true;
      compactEvery = rawLog.compactEvery ?? DEFAULT_COMPACT_EVERY;
      if (typeof compactEvery !== "number" || !Number.isInteger(compactEvery) || compactEvery < 1) {
        throw new RangeError(`${LABEL} option "appendLog.compactEvery" must be an integer of at least 1, got ${show(compactEvery)}`);
      }
      compactBytes = rawLog.compactBytes ?? DEFAULT_COMPACT_BYTES;
      if (typeof compactBytes !== "number" || Number.isNaN(compactBytes) || compactBytes <= 0) {
        throw new RangeError(`${LABEL} option "appendLog.compactBytes" must be a number of bytes above 0, got ${show(compactBytes)}`);
      }
      logFsync = checkBoolean(rawLog.fsync ?? fsync, "appendLog.fsync");
    } else {
      throw new TypeError(`${LABEL} option "appendLog" must be a boolean or { compactEvery, compactBytes, fsync }, got ${show(rawLog)}`);
    }
    if (options.clock !== undefined && typeof options.clock !== "function") {
      throw new TypeError(`${LABEL} option "clock" must be a function, got ${show(options.clock)}`);
    }
    const staleLockMs = options.staleLockMs ?? DEFAULT_STALE_LOCK_MS;
    const absolute = await resolvePath(path);
    await ensureDir(await dirName(absolute));
    const file = await realPathOf(absolute);
    const mutex = new FileMutex(file, {
      staleLockMs,
      heartbeatMs: options.heartbeatMs,
      timeoutMs: options.mutexTimeoutMs,
      label: LABEL,
    });
    const { mode } = await snapshotFileMode(file, LABEL);
    const journal = new SharedFileEventJournal(file, mutex, mode, {
      appendLog,
      compactEvery,
      compactBytes,
      fsync,
      logFsync,
      staleLockMs: mutex.staleLockMs,
      clock: options.clock,
    });
    claimOpenFile(file, journal, LABEL);
    try {
      await journal.#refuseIfLocked(); // before waiting for the mutex: a clear error at once
      await journal.#enqueue("open", async () => undefined);
    } catch (error) {
      journal.#closed = true;
      await journal.#release();
      throw error;
    }
    return journal;
  }

  /** Whether {@link close} was called. */
  get closed(): boolean {
    return this.#closed;
  }

  append(event: NewEventRecord, lease?: ClaimOptions): Promise<EventRecord | null> {
    return this.#enqueue("events.append", (j) => j.append(event, lease));
  }

  claim(id: string, options: EventClaimOptions): Promise<EventRecord | null> {
    return this.#enqueue("events.claim", (j) => j.claim(id, options));
  }

  claimDue(options: EventClaimOptions & { limit: number }): Promise<EventRecord[]> {
    return this.#enqueue("events.claimDue", (j) => j.claimDue(options));
  }

  heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#enqueue("events.heartbeat", (j) => j.heartbeat(id, token, leaseMs));
  }

  complete(id: string, token: number): Promise<void> {
    return this.#enqueue("events.complete", (j) => j.complete(id, token));
  }

  fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    return this.#enqueue("events.fail", (j) => j.fail(id, token, outcome));
  }

  get(id: string): Promise<EventRecord | null> {
    return this.#enqueue("events.get", (j) => j.get(id));
  }

  list(options?: EventListOptions): Promise<EventRecord[]> {
    return this.#enqueue("events.list", (j) => j.list(options));
  }

  replay(id: string): Promise<boolean> {
    return this.#enqueue("events.replay", (j) => j.replay(id));
  }

  purge(olderThanMs: number, options?: { channel?: string | null }): Promise<number> {
    return this.#enqueue("events.purge", (j) => j.purge(olderThanMs, options));
  }

  /**
   * Lets the operations already called finish, then rejects later ones and
   * lets the file go (the mutex is only held during operations). Calling it
   * again does nothing.
   */
  async close(): Promise<void> {
    this.#closed = true;
    while (this.#draining) await this.#draining;
    await this.#release();
  }

  async #release(): Promise<void> {
    if (this.#released) return;
    this.#released = true;
    this.#cache = null;
    const pin = this.#pinned;
    this.#pinned = null;
    this.#pinnedId = null;
    releaseOpenFile(this.path, this);
    await pin?.close().catch(() => {});
  }

  #enqueue<T>(op: string, fn: (journal: MemoryEventJournal) => Promise<T>): Promise<T> {
    if (this.#closed && op !== "open") {
      return Promise.reject(new Error(`${op}: the ${this.name} journal ${this.path} is closed`));
    }
    return new Promise<T>((resolve, reject) => {
      this.#queue.push({ op, fn, resolve: resolve as (value: unknown) => void, reject });
      if (this.#draining === null) this.#draining = this.#drain();
    });
  }

  async #drain(): Promise<void> {
    try {
      while (this.#queue.length > 0) await this.#runBatch(this.#queue.splice(0, MAX_BATCH));
    } finally {
      this.#draining = null; // runs synchronously after the last check of the queue
    }
  }

  /** Runs `batch` under one hold of the mutex: sync, run, persist, release, then settle. */
  async #runBatch(batch: Job[]): Promise<void> {
    let held: FileMutexHandle;
    try {
      held = await this.#mutex.acquire();
    } catch (error) {
      for (const job of batch) job.reject(error);
      return;
    }
    const outcomes: Outcome[] = [];
    let committed = false;
    try {
      await this.#refuseIfLocked();
      const journal = await this.#sync(held);
      for (const job of batch) {
        try {
          outcomes.push({ ok: true, value: await job.fn(journal) });
        } catch (error) {
          outcomes.push({ ok: false, error });
        }
      }
      committed = await this.#persist(held, journal);
    } catch (error) {
      await this.#forget();
      await held.release().catch(() => {});
      batch.forEach((job, i) => {
        const own = outcomes[i];
        job.reject(own !== undefined && !own.ok ? own.error : error);
      });
      return;
    }
    // A mutex left behind by a release error is broken once stale. `false`: it was taken over (a stop longer
    // than staleLockMs) somewhere between the check before the commit and now: the commit cannot be confirmed.
    const kept = await held.release().catch(() => null);
    if (committed && kept === false) {
      await this.#forget();
      const error = this.#unconfirmed("");
      for (const job of batch) job.reject(error);
      return;
    }
    batch.forEach((job, i) => {
      const outcome = outcomes[i];
      if (outcome.ok) job.resolve(outcome.value);
      else job.reject(outcome.error);
    });
  }

  /** The error of a write whose commit cannot be confirmed (the mutex was lost around it). */
  #unconfirmed(detail: string): FileMutexLostError {
    const error = new FileMutexLostError(this.#mutex.mutexPath, LABEL);
    error.message = `${LABEL}: the mutex on ${this.path} was taken over during the commit: this write may or may ` +
      `not be in the journal (the process was stopped, or its event loop blocked, for longer than staleLockMs ` +
      `between its mutex check and its commit)${detail}`;
    return error;
  }

  /** Drops the cache: the next operation reloads the file. */
  async #forget(): Promise<void> {
    this.#cache = null;
    const pin = this.#pinned;
    this.#pinned = null;
    this.#pinnedId = null;
    await pin?.close().catch(() => {});
  }

  /** @throws {FileLockedError} when a live process holds `<file>.lock` */
  async #refuseIfLocked(): Promise<void> {
    const holder = await findLiveLockHolder(this.path, { staleLockMs: this.#staleLockMs, label: LABEL });
    if (holder === null) return;
    const error = new FileLockedError(this.path, `${this.path}.lock`, holder, null, LABEL);
    error.message += ` The lock is a single-process journal's (e.g. a FileEventJournal): a ${LABEL} refuses the ` +
      `file while it is held, so that neither loses the other's records.`;
    throw error;
  }

  /** Brings the cache up to date with the file (under the mutex). */
  async #sync(held: FileMutexHandle | null = null): Promise<MemoryEventJournal> {
    const snapshot = await statIdentity(this.path);
    if (this.#cache === null || !sameIdentity(snapshot, this.#pinnedId)) await this.#reload(held);
    if (!(await this.#syncLog())) {
      await this.#reload(); // the log was replaced or shrank without a new snapshot: replay it from its start
      await this.#syncLog();
    }
    return this.#cache!;
  }

  /**
   * Loads the snapshot (log position reset: the log is replayed from its start). When the snapshot found is
   * a shared journal's of a generation not after the one this process knew, by another writer, it was
   * renamed into place late by a holder that had lost the mutex (that writer was told its write failed):
   * the state this process knew, acknowledged writes included, is written back as a newer generation.
   */
  async #reload(held: FileMutexHandle | null = null): Promise<void> {
    const known = this.#cache !== null && this.#writer !== null
      ? { cache: this.#cache, generation: this.#generation, writer: this.#writer, lastSeq: this.#lastSeq }
      : null;
    await this.#forget();
    const pin = await openPinned(this.path);
    let journal: MemoryEventJournal;
    let logSeq = 0;
    if (pin === null) {
      journal = new MemoryEventJournal(this.#memoryOptions);
    } else {
      try {
        const identity = await pin.identity();
        const bytes = await pin.readAll();
        const loaded = parseEventSnapshot(this.path, bytes, LABEL, this.#memoryOptions);
        journal = loaded.journal;
        logSeq = loaded.logSeq;
        this.#pinnedId = identity;
        const stamp = SNAPSHOT_STAMP.exec(new TextDecoder().decode(bytes.subarray(0, 120)));
        this.#generation = stamp ? Number(stamp[1]) : 0;
        this.#writer = stamp ? stamp[2] : null;
      } catch (error) {
        await pin.close().catch(() => {});
        throw error;
      }
    }
    if (pin === null) {
      this.#generation = 0;
      this.#writer = null;
    }
    this.#pinned = pin;
    this.#cache = journal;
    this.#snapLogSeq = logSeq;
    this.#lastSeq = logSeq;
    this.#logOffset = 0;
    this.#logLines = 0;
    this.#logId = null;
    if (
      held !== null && known !== null && this.#writer !== null && this.#writer !== known.writer &&
      this.#generation <= known.generation
    ) {
      // A late rename: restore what this process knew; log lines after it are replayed on top as usual.
      this.#cache = known.cache;
      this.#lastSeq = known.lastSeq;
      this.#generation = known.generation;
      await this.#writeSnapshot(held, known.cache, known.lastSeq, "snapshot");
    }
  }

  /**
   * Applies the log lines appended since the last look; trims a torn last line.
   * @returns `false` when the log was replaced or shrank (the caller reloads)
   */
  async #syncLog(): Promise<boolean> {
    const info = await statIdentity(this.logPath);
    if (info === null) {
      this.#logOffset = 0;
      this.#logLines = 0;
      this.#logId = null;
      return true;
    }
    if (this.#logId !== null && (info.id !== this.#logId || info.size < this.#logOffset)) return false;
    this.#logId = info.id;
    if (info.size === this.#logOffset) return true;
    const start = this.#logOffset;
    const bytes = (await readFileRange(this.logPath, start, info.size)) ?? new Uint8Array(0);
    const journal = this.#cache!;
    let pos = 0;
    let line = this.#logLines;
    for (;;) {
      const end = bytes.indexOf(10, pos);
      if (end < 0) break;
      line++;
      if (end > pos) this.#applyLine(journal, bytes.subarray(pos, end), start + pos, line);
      pos = end + 1;
    }
    this.#logLines = line;
    if (pos < bytes.length) {
      // A torn last line: its writer died mid-write (we hold the mutex, so nobody is writing it). Trim it.
      await truncateFile(this.logPath, start + pos, { fsync: this.#logFsync });
    }
    this.#logOffset = start + pos;
    return true;
  }

  #applyLine(journal: MemoryEventJournal, line: Uint8Array, offset: number, lineNo: number): void {
    let entry: Record<string, unknown>;
    try {
      entry = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(line));
    } catch {
      const problem = findJsonSyntaxError(line);
      throw new FileCorruptError(
        this.logPath,
        offset + (problem?.offset ?? 0),
        `a log line is not valid JSON: ${problem?.reason ?? "rejected by the parser"}`,
        LABEL,
      );
    }
    const seq = entry?.seq;
    if (typeof entry !== "object" || entry === null || typeof seq !== "number" || !Number.isInteger(seq) || seq < 1) {
      throw new FileCorruptError(this.logPath, offset, `line ${lineNo}: a log line has no valid "seq": ${show(seq)}`, LABEL);
    }
    // Entries already in the snapshot, or not after the last one applied (a late write), are skipped: of two
    // lines with one seq, the first wins (the second's writer was told its write failed, see #persist).
    if (seq <= this.#lastSeq) return;
    const outbox = entry.outbox;
    if (!Array.isArray(outbox)) {
      throw new FileCorruptError(this.logPath, offset, `line ${lineNo}: field "outbox" must be an array, got ${show(outbox)}`, LABEL);
    }
    for (let i = 0; i < outbox.length; i++) {
      const problem = storedOutboxProblem(outbox[i]);
      if (problem === null) continue;
      const key = (outbox[i] as { key?: unknown } | null)?.key;
      const label = `outbox entry ${i}${typeof key === "string" ? ` (key ${JSON.stringify(key)})` : ""}`;
      throw new FileCorruptError(this.logPath, offset, `line ${lineNo} (log entry ${seq}): ${label}: ${problem}`, LABEL);
    }
    try {
      journal.applyChanges(entry as never);
    } catch (error) {
      throw new FileCorruptError(this.logPath, offset, `log entry ${seq}: ${(error as Error).message}`, LABEL);
    }
    this.#lastSeq = seq;
  }

  /**
   * Writes what the batch changed (under the mutex).
   * @returns whether something was committed
   */
  async #persist(held: FileMutexHandle, journal: MemoryEventJournal): Promise<boolean> {
    const changes = journal.takeChanges();
    if (changes === null) return false;
    if (!this.#appendLog) {
      // The log has entries only when an appendLog process shares the file: this write is then a compaction.
      await this.#writeSnapshot(held, journal, this.#lastSeq, "snapshot");
      if (this.#logOffset > 0) await this.#truncateLog();
      return true;
    }
    const seq = this.#lastSeq + 1;
    // The sync left the log at #logOffset bytes (a torn tail trimmed): our line must land there. A nonce
    // (`w`) makes the line ours alone, so that reading it back there proves it landed in place.
    const offset = this.#logOffset;
    const bytes = encoder.encode(`${JSON.stringify({ seq, w: randomId(), ...changes })}\n`);
    await sharedJournalTestHooks.beforeCommit?.({ kind: "append", path: this.logPath, bytes });
    await this.#refuseIfLocked();
    await held.assertHeld();
    await sharedJournalTestHooks.afterCheck?.({ kind: "append", path: this.logPath });
    await appendToFile(this.logPath, bytes, { fsync: this.#logFsync, mode: this.#mode });
    const landed = await readFileRange(this.logPath, offset, offset + bytes.length);
    if (landed === null || landed.length !== bytes.length || landed.some((b, i) => b !== bytes[i])) {
      // Another line is where ours should be: a holder that lost the mutex appended late (its line, first
      // with this seq, is the one every reader applies; ours is skipped). Never acknowledged.
      await this.#forget();
      throw this.#unconfirmed(
        `; here another writer's line took byte ${offset} of ${this.logPath}, where this write's line (seq ${seq}) ` +
          `was to land: readers skip this write's line (a second line with one seq)`,
      );
    }
    this.#logOffset = offset + bytes.length;
    this.#logLines++;
    this.#lastSeq = seq;
    if (this.#logId === null) this.#logId = (await statIdentity(this.logPath))?.id ?? null;
    if (seq - this.#snapLogSeq >= this.#compactEvery || this.#logOffset >= this.#compactBytes) {
      try {
        await this.#writeSnapshot(held, journal, seq, "compact");
        await sharedJournalTestHooks.betweenSnapshotAndTruncate?.(this.logPath);
        await this.#truncateLog();
      } catch {
        // The write is committed in the log; the compaction is retried with the next write.
        await this.#forget();
      }
    }
    return true;
  }

  async #truncateLog(): Promise<void> {
    await truncateFile(this.logPath, 0, { fsync: this.#logFsync });
    this.#logOffset = 0;
    this.#logLines = 0;
  }

  /** Replaces the snapshot (temporary file, mutex check, rename) and pins the new one. */
  async #writeSnapshot(
    held: FileMutexHandle,
    journal: MemoryEventJournal,
    logSeq: number,
    kind: "snapshot" | "compact",
  ): Promise<void> {
    // Stamped first: a generation after the last one known (and not before this host's clock, so that it
    // stays ahead of generations forgotten by a FileEventJournal's rewrite), and this write's nonce.
    const generation = Math.max(this.#generation + 1, Date.now());
    const writer = randomId();
    const text = serializeEventSnapshot(journal, logSeq);
    const bytes = encoder.encode(`{"generation":${generation},"writer":${JSON.stringify(writer)},${text.slice(1)}`);
    const pin = await writeFilePinned(this.#temp, bytes, { fsync: this.#fsync, mode: this.#mode });
    try {
      await sharedJournalTestHooks.beforeCommit?.({ kind, path: this.path, bytes });
      await this.#refuseIfLocked();
      await held.assertHeld(); // a holder that was stopped and lost the mutex never commits its late write
      await sharedJournalTestHooks.afterCheck?.({ kind, path: this.path });
      if (!(await renameFile(this.#temp, this.path))) throw new Error(`${LABEL}: ${this.#temp} vanished before its rename`);
    } catch (error) {
      await pin.close().catch(() => {});
      await removeFile(this.#temp).catch(() => {});
      throw error;
    }
    const old = this.#pinned;
    this.#pinned = pin;
    this.#pinnedId = await pin.identity();
    this.#snapLogSeq = logSeq;
    this.#generation = generation;
    this.#writer = writer;
    await old?.close().catch(() => {});
    if (this.#fsync) await syncDirectory(await dirName(this.path));
  }
}

/** The outbox of a {@link SharedFileEventJournal}: each call is an operation of the journal. */
class SharedOutbox implements OutboxJournal {
  readonly #run: <T>(op: string, fn: (journal: MemoryEventJournal) => Promise<T>) => Promise<T>;

  constructor(run: <T>(op: string, fn: (journal: MemoryEventJournal) => Promise<T>) => Promise<T>) {
    this.#run = run;
  }

  reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    return this.#run("outbox.reserve", (j) => j.outbox.reserve(entry, lease));
  }

  claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    return this.#run("outbox.claimDue", (j) => j.outbox.claimDue(options));
  }

  heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#run("outbox.heartbeat", (j) => j.outbox.heartbeat(key, token, leaseMs));
  }

  /** Written (log line or snapshot) before it resolves, as every change. */
  markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#run("outbox.markCalling", (j) => j.outbox.markCalling(key, token, leaseMs));
  }

  markSent(key: string, token: number, messageId: string): Promise<void> {
    return this.#run("outbox.markSent", (j) => j.outbox.markSent(key, token, messageId));
  }

  markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    return this.#run("outbox.markFailed", (j) => j.outbox.markFailed(key, token, outcome));
  }

  get(key: string): Promise<OutboxEntry | null> {
    return this.#run("outbox.get", (j) => j.outbox.get(key));
  }

  list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    return this.#run("outbox.list", (j) => j.outbox.list(options));
  }

  retry(key: string): Promise<boolean> {
    return this.#run("outbox.retry", (j) => j.outbox.retry(key));
  }

  discard(key: string): Promise<boolean> {
    return this.#run("outbox.discard", (j) => j.outbox.discard(key));
  }

  purge(olderThanMs: number): Promise<number> {
    return this.#run("outbox.purge", (j) => j.outbox.purge(olderThanMs));
  }
}
