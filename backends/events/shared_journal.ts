/**
 * `SharedFileEventJournal`: one events-journal file shared by several
 * processes of one host, every operation under the inter-process mutex
 * `<file>.mutex`.
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import type { ClaimDueOptions, ClaimOptions, DamagedListOptions, DamagedRecord, FailOutcome, ListOptions } from "../../src/contract.ts";
import type { NewOutboxEntry, OutboxClaim, OutboxEntry, OutboxJournal, OutboxState, ReserveResult } from "../../src/contract.ts";
import { MemoryEventJournal, type MemoryEventJournalOptions } from "./memory_journal.ts";
import { jsonLineAfter } from "./file_journal.ts";
import type {
  DamagedEvent,
  DamagedEventListOptions,
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
  linkFile,
  listDirectory,
  readFileBytes,
  readFileRange,
  realPathOf,
  removeFile,
  renameFile,
  resolvePath,
  statFile,
  statIdentity,
  syncDirectory,
  truncateFile,
  uniqueTempPath,
  writeFileAtomic,
  writeFilePinned,
} from "../../src/runtime/fs.ts";
import { showValue as show } from "../../src/show.ts";
import { FileCorruptError } from "../file/corrupt_error.ts";
import { findJsonSyntaxError } from "../file/json_error.ts";
import { FileLockedError, findLiveLockHolder } from "../file/lock.ts";
import { DEFAULT_STALE_LOCK_MS, MIN_STALE_LOCK_MS } from "../file/lock_file.ts";
import { removeLeftoverFiles } from "../file/leftovers.ts";
import { FileMutex, type FileMutexHandle, FileMutexLostError } from "../file/mutex.ts";
import { claimOpenFile, releaseOpenFile } from "../file/open_files.ts";
import { snapshotFileMode } from "../file/snapshot.ts";
import { parseEventSnapshot, serializeEventSnapshot } from "./snapshot.ts";

const LABEL = "SharedFileEventJournal";
/** Without {@link AppendLogOptions.compactBytes}: compact once the deltas hold this many times the snapshot's bytes… */
const COMPACT_FACTOR = 2;
/** …and at least this many. */
const COMPACT_MIN_BYTES = 1024 * 1024;
/**
 * Without {@link AppendLogOptions.compactEvery}: compact once there are this many delta files, or one per
 * {@link SNAPSHOT_BYTES_PER_DELTA} bytes of snapshot if more: each delta is a file every open reads,
 * and a small snapshot must not leave thousands of them, while a large one is still rewritten only
 * after deltas worth a fixed share of it (so its cost per write stays flat).
 */
const COMPACT_MIN_DELTAS = 1000;
const SNAPSHOT_BYTES_PER_DELTA = 4096;
/** The `shared` field of this version's snapshots (generations and the mirror). */
const SHARED_FORMAT = 2;
/** The stamp of this version's snapshots: `generation`, `writer`, `shared`, `adopted` (groups: generation, adopted). */
const STAMP = /^\{"generation":(\d+),"writer":"[0-9A-Za-z_-]+","shared":2,"adopted":(null|"[^"\\]*"),/;
/** A generation's file name. */
const GEN_NAME = /^[1-9][0-9]{0,15}$/;
/** Most operations run under one hold of the mutex (group commit). */
const MAX_BATCH = 256;
/** How often a batch whose commit was refused (another writer committed that generation) runs again. */
const MAX_TRIES = 10;
/** Listings of the generations before a sync gives up (each retry follows a concurrent removal). */
const MAX_SYNC_ATTEMPTS = 50;
/** Bytes read from the end of the `.log` mirror to find its last line. */
const MIRROR_TAIL = 65_536;

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** Options of the append log (`appendLog: { … }`). */
export interface AppendLogOptions {
  /**
   * Compact (rewrite the snapshot, remove the deltas) after this many deltas (at least 1; default:
   * 1000, or one per 4 KiB of snapshot if more: each delta is a file that every open reads).
   */
  compactEvery?: number;
  /**
   * …or once the log reaches this many bytes (default: twice the snapshot's
   * bytes, at least 1 MiB, so that the cost of compactions per write does not
   * grow with the journal).
   */
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
   * `30000`, at least `1000`, as for `FileEventJournal`). Also the staleness
   * of a `<file>.lock` of another host. Use the same value in every process.
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
 * Test hooks of every SharedFileEventJournal in the process, exported by
 * `@botmesh/durable/testing` only: called at the commit points, so that a
 * test can stop or kill a process exactly there. Reset what you set after the test.
 */
export interface SharedJournalTestHooks {
  /** After the temporary file is written, before the checks (mutex, newest generation) and the link that commits. */
  beforeCommit?: (what: { kind: "snapshot" | "append" | "compact"; path: string; bytes: Uint8Array }) => void | Promise<void>;
  /** After the checks, right before the link that commits. */
  afterCheck?: (what: { kind: "snapshot" | "append" | "compact"; path: string }) => void | Promise<void>;
  /**
   * At each step of a commit: `write` (before the temporary file), `linked` (right after the link that
   * commits), `mirror` (before the journal file or its `.log` is updated for a FileEventJournal), and
   * `refused` (a commit refused: the batch runs again).
   */
  step?: (what: { step: string; kind: "snapshot" | "append" | "compact"; path: string }) => void | Promise<void>;
}

/** The process-wide {@link SharedJournalTestHooks} (set by tests only). */
export const sharedJournalTestHooks: SharedJournalTestHooks = {};

/** One queued operation. */
interface Job {
  op: string;
  fn: (journal: MemoryEventJournal) => Promise<unknown>;
  resolve: (value: unknown) => void;
  reject: (error: unknown) => void;
  /** Runs so far (a refused commit runs the batch again). */
  tries: number;
}

type Outcome = { ok: true; value: unknown } | { ok: false; error: unknown };

function checkBoolean(value: unknown, name: string): boolean {
  if (typeof value !== "boolean") throw new TypeError(`${LABEL} option "${name}" must be a boolean, got ${show(value)}`);
  return value;
}

/**
 * An events journal in one file shared by several processes of one host
 * (`scope: 'host'`): claims are exclusive and fencing tokens hold across
 * processes. The core's outbox is stored with it.
 *
 * Every operation, reads included, runs under the mutex `<file>.mutex` (see
 * `FileMutex`): it brings this process's cached journal up to date, runs,
 * commits what changed, and releases the mutex. Operations called while the
 * mutex is being waited for run together under the next hold (group commit),
 * in call order.
 *
 * - The journal is a sequence of generations `<file>.gen/1`, `2`, …: each
 *   is a snapshot (the format of `./snapshot.ts`, stamped `generation`) or,
 *   with `appendLog`, a delta (one line `{"seq":n,…changes}`) on top of the
 *   one before. Readers take the newest snapshot and the deltas after it.
 * - Commits are exclusive by construction, not by timing: a commit writes a
 *   temporary file and links it as generation `n + 1` (`link(2)` fails when
 *   the name exists), after checking that it still holds the mutex and that
 *   `n` is the newest generation. Of two writers that both believe they hold
 *   the mutex (one was stopped for longer than `staleLockMs` and its mutex
 *   broken), one only commits `n + 1`: the other's link fails, nothing of its
 *   batch is in the journal, and the batch runs again under the mutex on the
 *   newest state (up to 10 times; then it rejects). A writer stopped right
 *   after its link, whose generation another writer built on at once, is told
 *   its write may or may not be in the journal (`FileMutexLostError`; it is).
 *   A name freed by the removal of old generations and linked again by a
 *   writer stopped meanwhile is below the newest snapshot: nobody reads it,
 *   and its writer is told so the same way.
 * - Default: every commit is a snapshot. `appendLog`: a commit is a delta (a
 *   small file, cost independent of the journal's size; two flushes, the file
 *   and the directory, where the append took one); once the deltas since the
 *   last snapshot hold twice its bytes (at least 1 MiB; or `compactBytes`)
 *   or number 1000 (or one per 4 KiB of snapshot if more; or `compactEvery`)
 *   the commit is a snapshot, so the
 *   cost of compactions per write stays flat as the journal grows.
 *   Generations before a snapshot are removed after it.
 * - The journal file itself and `<file>.log` are a mirror of the newest
 *   generation (a hard link of the snapshot, and the deltas after it as
 *   lines), for a `FileEventJournal` opened on the file later. The mirror is
 *   written after the commit (unflushed; `close()` flushes it) and checked by
 *   the next commit, which rewrites it whole when it is not at the generation
 *   before. A `FileEventJournal`
 *   opened on a file whose newest generation never reached the mirror (its
 *   writer was killed, or stopped for longer than `staleLockMs` and then
 *   updated the mirror late, with no shared commit since) reads the older
 *   state. The shared journals never read the mirror except to adopt a file
 *   that someone else wrote (see below).
 * - A file written by a `FileEventJournal`, or by an earlier version of this
 *   class (a snapshot and a `.log`, no generations), is read (the log's torn
 *   last line ignored) and committed as the next snapshot generation
 *   (`adopted`: its identity, so that it is adopted once).
 * - A mutex left by a dead process is broken at once; a stuck holder's after
 *   `staleLockMs` (at least 1000 ms, as for `FileEventJournal`). Nothing is
 *   ever killed. Temporary files left by a killed writer (`<file>.<id>.tmp`,
 *   the mutex's and the lock's `.tmp`, `.stale`, `.release`, the generation
 *   directory's `.tmp`) are removed by the next open once older than
 *   `staleLockMs`.
 * - A file that a live `FileEventJournal` holds (its `<file>.lock`) is
 *   refused, at open and by every operation: an error instead of lost records.
 * - A due scan runs under the mutex on the newest state, so the records of
 *   one `orderKey` are leased to one process at a time, oldest first (see
 *   `LeasedEventJournal.claimDue`), whichever processes scan at once.
 * - A record (event or outbox entry) of a snapshot or a delta that is not
 *   valid is kept as it was and set aside, as in a `FileEventJournal` (see
 *   `DamagedEvent`): the first operation that meets it, in any process,
 *   commits its mark, so it is set aside once and reported once
 *   (`reportDamaged` answers `true` in one process only). A generation that
 *   is not JSON, or not the journal's format, is refused whole
 *   (`FileCorruptError`).
 * - `close()` lets operations already called finish, and rejects later ones.
 *
 * @example Three workers (processes) may run this on one file
 * ```ts
 * import { mkdtempSync } from "node:fs";
 * import { tmpdir } from "node:os";
 * import { join } from "node:path";
 * import { SharedFileEventJournal } from "@botmesh/durable/events";
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
  /** The generations `<file>.gen/<n>`, the journal itself (see the class docs). */
  readonly genDir: string;
  /** The core's outbox, in the same file. */
  readonly outbox: OutboxJournal;

  readonly #mutex: FileMutex;
  readonly #appendLog: boolean;
  readonly #compactEvery: number;
  /** `null`: a multiple of the snapshot's size. */
  readonly #compactBytes: number | null;
  readonly #fsync: boolean;
  readonly #logFsync: boolean;
  readonly #staleLockMs: number;
  readonly #mode: number;
  readonly #memoryOptions: MemoryEventJournalOptions;

  /** The state of generation `#gen` as this process last read or wrote it (`null`: reload). */
  #cache: MemoryEventJournal | null = null;
  /** The newest generation applied to the cache. */
  #gen = 0;
  /** The newest snapshot generation at or before `#gen`, and the bytes of the deltas after it. */
  #snapGen = 0;
  #deltaBytes = 0;
  /** The size of snapshot generation `#snapGen`. */
  #snapBytes = 0;
  /** The key (`dev:ino:size:mtime`) of the foreign journal file last adopted (carried by every snapshot). */
  #adopted: string | null = null;
  /** The key of the journal file last seen to be a shared journal's mirror. */
  #pathSeen: string | null = null;
  /** The mirror was written without a flush since the last one (flushed by `close()`). */
  #mirrorDirty = false;

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
      compactBytes: number | null;
      fsync: boolean;
      logFsync: boolean;
      staleLockMs: number;
      clock?: () => number;
    },
  ) {
    this.path = path;
    this.logPath = `${path}.log`;
    this.genDir = `${path}.gen`;
    this.#mutex = mutex;
    this.#mode = mode;
    this.#appendLog = settings.appendLog;
    this.#compactEvery = settings.compactEvery;
    this.#compactBytes = settings.compactBytes;
    this.#fsync = settings.fsync;
    this.#logFsync = settings.logFsync;
    this.#staleLockMs = settings.staleLockMs;
    this.#memoryOptions = { heartbeatChanges: true, name: "shared-file-events", ...(settings.clock ? { clock: settings.clock } : {}) };
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
   * @throws {FileCorruptError} when the snapshot or the log is not JSON or not the journal's format (file and
   *   offset named; a record that is not valid is set aside instead)
   * @throws {Error} when this process already has the file open through another backend
   */
  static async open(path: string, options: SharedFileEventJournalOptions = {}): Promise<SharedFileEventJournal> {
    if (typeof path !== "string" || path.length === 0 || path.includes("\0")) {
      throw new TypeError(`${LABEL}: the path must be a non-empty string without NUL, got ${show(path)}`);
    }
    if (typeof options !== "object" || options === null || Array.isArray(options)) {
      throw new TypeError(`${LABEL} options must be an object, got ${show(options)}`);
    }
    checkKnownOptions(options, ["appendLog", "fsync", "staleLockMs", "heartbeatMs", "mutexTimeoutMs", "clock"], `${LABEL} option`);
    const fsync = checkBoolean(options.fsync ?? true, "fsync");
    const rawLog = options.appendLog ?? false;
    let appendLog = false;
    let compactEvery = Number.POSITIVE_INFINITY;
    let compactBytes: number | null = null;
    let logFsync = fsync;
    if (typeof rawLog === "boolean") {
      appendLog = rawLog;
    } else if (typeof rawLog === "object" && rawLog !== null && !Array.isArray(rawLog)) {
      checkKnownOptions(rawLog, ["compactEvery", "compactBytes", "fsync"], `${LABEL} option`, "appendLog");
      appendLog = true;
      compactEvery = rawLog.compactEvery ?? Number.POSITIVE_INFINITY;
      if (typeof compactEvery !== "number" || !(Number.isInteger(compactEvery) || compactEvery === Infinity) || compactEvery < 1) {
        throw new RangeError(`${LABEL} option "appendLog.compactEvery" must be an integer of at least 1, got ${show(compactEvery)}`);
      }
      compactBytes = rawLog.compactBytes ?? null;
      if (compactBytes !== null && (typeof compactBytes !== "number" || Number.isNaN(compactBytes) || compactBytes <= 0)) {
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
    if (typeof staleLockMs === "number" && !(staleLockMs >= MIN_STALE_LOCK_MS)) {
      throw new RangeError(
        `${LABEL} option "staleLockMs" must be a finite number of milliseconds, at least ${MIN_STALE_LOCK_MS}, ` +
          `got ${show(staleLockMs)}`,
      );
    }
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
      // Temporary files of a killed writer (never younger than staleLockMs: a live writer's are).
      await removeLeftoverFiles(file, mutex.staleLockMs);
      await journal.#removeLeftoverTemps();
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

  /** Journals that run `attempt` of the record's handler begins under `token`. @returns `false` when it is no longer held */
  start(id: string, token: number, attempt: number): Promise<boolean> {
    return this.#enqueue("events.start", (j) => j.start(id, token, attempt));
  }

  /** `scheduled`: a timer, due in `dueInMs`. @throws {StaleLeaseError} when `token` is not the current lease */
  schedule(id: string, token: number, dueInMs: number): Promise<void> {
    return this.#enqueue("events.schedule", (j) => j.schedule(id, token, dueInMs));
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

  /** Events set aside as damaged, in the order they were (see `DamagedEvent`). @returns at most `limit` (default 100) */
  damaged(options?: DamagedEventListOptions): Promise<DamagedEvent[]> {
    return this.#enqueue("events.damaged", (j) => j.damaged(options));
  }

  /** Marks a set-aside event reported: of several processes, exactly one call answers `true`. */
  reportDamaged(id: string, options?: { channel?: string | null }): Promise<boolean> {
    return this.#enqueue("events.reportDamaged", (j) => j.reportDamaged(id, options));
  }

  /** Sets event `id` aside as damaged with `problem`, as it is. @returns whether this call set it aside */
  setAside(id: string, problem: string): Promise<boolean> {
    return this.#enqueue("events.setAside", (j) => j.setAside(id, problem));
  }

  /**
   * Lets the operations already called finish, then rejects later ones and
   * lets the file go (the mutex is only held during operations). Calling it
   * again does nothing.
   */
  async close(): Promise<void> {
    this.#closed = true;
    while (this.#draining) await this.#draining;
    if (this.#mirrorDirty && !this.#released) {
      // The mirror is written unflushed (the generations are the journal); flushed here for a FileEventJournal.
      this.#mirrorDirty = false;
      if (this.#logFsync && (await statIdentity(this.logPath).catch(() => null)) !== null) {
        await appendToFile(this.logPath, new Uint8Array(0), { fsync: true }).catch(() => {});
      }
      if (this.#fsync) await syncDirectory(await dirName(this.path)).catch(() => {});
    }
    await this.#release();
  }

  async #release(): Promise<void> {
    if (this.#released) return;
    this.#released = true;
    this.#cache = null;
    releaseOpenFile(this.path, this);
  }

  #enqueue<T>(op: string, fn: (journal: MemoryEventJournal) => Promise<T>): Promise<T> {
    if (this.#closed && op !== "open") {
      return Promise.reject(new Error(`${op}: the ${this.name} journal ${this.path} is closed`));
    }
    return new Promise<T>((resolve, reject) => {
      this.#queue.push({ op, fn, resolve: resolve as (value: unknown) => void, reject, tries: 0 });
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
    try {
      await this.#refuseIfLocked();
      const journal = await this.#sync(held);
      for (const job of batch) {
        job.tries++;
        try {
          outcomes.push({ ok: true, value: await job.fn(journal) });
        } catch (error) {
          outcomes.push({ ok: false, error });
        }
      }
      await this.#persist(held, journal);
    } catch (error) {
      await this.#forget();
      await held.release().catch(() => {});
      if (error instanceof CommitRefused) {
        // Nothing of this batch is in the journal (another writer committed the generation: this process
        // lost the mutex during a stop longer than staleLockMs). It runs again, on the newest state.
        await sharedJournalTestHooks.step?.({ step: "refused", kind: this.#appendLog ? "append" : "snapshot", path: this.genDir });
        const again = batch.filter((job) => job.tries < MAX_TRIES);
        for (const job of batch) if (job.tries >= MAX_TRIES) job.reject(this.#refused(error, job.tries));
        this.#queue.unshift(...again);
        return;
      }
      batch.forEach((job, i) => {
        const own = outcomes[i];
        job.reject(own !== undefined && !own.ok ? own.error : error);
      });
      return;
    }
    // The commit is confirmed by its link: whether the mutex is still ours at the release does not matter.
    await held.release().catch(() => null);
    batch.forEach((job, i) => {
      const outcome = outcomes[i];
      if (outcome.ok) job.resolve(outcome.value);
      else job.reject(outcome.error);
    });
  }

  /** The error of a write refused `tries` times (not in the journal). */
  #refused(error: CommitRefused, tries: number): FileMutexLostError {
    const lost = new FileMutexLostError(this.#mutex.mutexPath, LABEL);
    lost.message = `${LABEL}: this write is not in the journal ${this.path}: its commit was refused ${tries} times ` +
      `(another writer committed first each time; last: ${error.message})`;
    return lost;
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
    this.#gen = 0;
    this.#snapGen = 0;
    this.#deltaBytes = 0;
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

  /** Removes the temporary files of the generation directory not modified for staleLockMs (a killed writer's). */
  async #removeLeftoverTemps(): Promise<void> {
    for (const name of (await listDirectory(this.genDir)) ?? []) {
      if (!name.endsWith(".tmp")) continue;
      const stat = await statFile(`${this.genDir}/${name}`).catch(() => null);
      if (stat !== null && Date.now() - stat.mtimeMs >= this.#staleLockMs) await removeFile(`${this.genDir}/${name}`).catch(() => {});
    }
  }

  /** Brings the cache up to date with the newest generation (under the mutex); adopts a foreign file first. */
  async #sync(held: FileMutexHandle): Promise<MemoryEventJournal> {
    for (let attempt = 0; attempt < MAX_SYNC_ATTEMPTS; attempt++) {
      const gens = await this.#listGenerations();
      const max = gens.length === 0 ? 0 : gens[gens.length - 1];
      if (max === 0) {
        // No generation yet: a new file, or one written by an earlier version or a FileEventJournal.
        await this.#adopt(held, 0, await this.#pathKey());
        continue;
      }
      if (this.#cache === null || this.#gen !== max) {
        if (!(await this.#catchUp(max, gens[0]))) {
          await this.#forget(); // a generation was removed under us (a newer snapshot exists): list again
          continue;
        }
      }
      const foreign = await this.#foreignPath();
      if (foreign !== null) {
        await this.#adopt(held, max, foreign);
        continue;
      }
      return this.#cache!;
    }
    throw new Error(`${LABEL}: cannot read a consistent generation of ${this.genDir} (${MAX_SYNC_ATTEMPTS} attempts)`);
  }

  /** The generations present, ascending. */
  async #listGenerations(): Promise<number[]> {
    const names = (await listDirectory(this.genDir)) ?? [];
    const gens: number[] = [];
    for (const name of names) if (GEN_NAME.test(name)) gens.push(Number(name));
    return gens.sort((a, b) => a - b);
  }

  #genPath(gen: number): string {
    return `${this.genDir}/${gen}`;
  }

  /**
   * Reads generations up to `max` into the cache: forward from the one known, or (cold) down from `max` to
   * the newest snapshot, then forward.
   * @returns `false` when a generation needed was removed meanwhile (the caller lists again)
   */
  async #catchUp(max: number, min: number): Promise<boolean> {
    if (this.#cache !== null && this.#gen < max) {
      for (let gen = this.#gen + 1; gen <= max; gen++) {
        const bytes = await readFileBytes(this.#genPath(gen));
        if (bytes === null) return false;
        this.#applyGeneration(gen, bytes);
      }
      return true;
    }
    await this.#forget();
    const deltas: [number, Uint8Array][] = [];
    for (let gen = max; ; gen--) {
      if (gen < min || gen < 1) {
        throw new FileCorruptError(this.#genPath(min), 0, `no snapshot generation at or below ${max}`, LABEL);
      }
      const bytes = await readFileBytes(this.#genPath(gen));
      if (bytes === null) return false;
      if (isDelta(bytes)) {
        deltas.push([gen, bytes]);
        continue;
      }
      this.#applyGeneration(gen, bytes);
      break;
    }
    for (const [gen, bytes] of deltas.reverse()) this.#applyGeneration(gen, bytes);
    return true;
  }

  /** Applies generation `gen` (a snapshot replaces the cache, a delta is applied to it). */
  #applyGeneration(gen: number, bytes: Uint8Array): void {
    const file = this.#genPath(gen);
    if (isDelta(bytes)) {
      if (this.#cache === null || this.#gen !== gen - 1) {
        throw new FileCorruptError(file, 0, `delta generation ${gen} without generation ${gen - 1} before it`, LABEL);
      }
      const end = bytes.indexOf(10);
      applyLogLine(this.#cache, end < 0 ? bytes : bytes.subarray(0, end), file, 0, 1, gen - 1, gen);
      this.#gen = gen;
      this.#deltaBytes += bytes.length;
      return;
    }
    const loaded = parseEventSnapshot(file, bytes, LABEL, this.#memoryOptions);
    const stamp = STAMP.exec(decoder.decode(bytes.subarray(0, 400)));
    if (stamp === null || Number(stamp[1]) !== gen) {
      throw new FileCorruptError(file, 0, `the snapshot is not stamped generation ${gen}`, LABEL);
    }
    this.#cache = loaded.journal;
    this.#gen = gen;
    this.#snapGen = gen;
    this.#snapBytes = bytes.length;
    this.#deltaBytes = 0;
    this.#adopted = stamp[2] === "null" ? null : JSON.parse(stamp[2]);
  }

  /** `dev:ino:size:mtime` of the journal file (`null`: none). */
  async #pathKey(): Promise<string | null> {
    const info = await statIdentity(this.path);
    return info === null ? null : `${info.id}:${info.size}:${info.mtimeNs}`;
  }

  /**
   * The key of the journal file when someone else than a shared journal wrote it since (a FileEventJournal,
   * or an earlier version of this class) and it was not adopted yet; `null` otherwise.
   */
  async #foreignPath(): Promise<string | null> {
    const key = await this.#pathKey();
    if (key === null || key === this.#pathSeen || key === this.#adopted) return null;
    const head = await readFileRange(this.path, 0, 400);
    if (head !== null && STAMP.test(decoder.decode(head))) {
      this.#pathSeen = key; // a mirror written by a shared journal
      return null;
    }
    return key;
  }

  /**
   * Takes the journal file (and its `.log`) as written by a FileEventJournal or an earlier version, and
   * commits it as generation `max + 1`, a snapshot that names it (`adopted`: not adopted twice).
   */
  async #adopt(held: FileMutexHandle, max: number, key: string | null): Promise<void> {
    await this.#forget();
    const journal = await this.#loadFile();
    journal.takeChanges(); // loading is not a change
    await this.#commitSnapshot(held, journal, max + 1, key, "snapshot");
  }

  /** Reads the journal file and replays its `.log` (the format of FileEventJournal and of earlier versions). */
  async #loadFile(): Promise<MemoryEventJournal> {
    const bytes = await readFileBytes(this.path);
    let journal = new MemoryEventJournal(this.#memoryOptions);
    let last = 0;
    if (bytes !== null) ({ journal, logSeq: last } = parseEventSnapshot(this.path, bytes, LABEL, this.#memoryOptions));
    const log = await readFileBytes(this.logPath);
    if (log === null) return journal;
    let pos = 0;
    let line = 0;
    for (;;) {
      const end = log.indexOf(10, pos);
      if (end < 0) break; // a torn last line (its writer died mid-write) was never acknowledged
      line++;
      try {
        if (end > pos) last = applyLogLine(journal, log.subarray(pos, end), this.logPath, pos, line, last, null);
      } catch (error) {
        // A last line that is not JSON (its middle never written: a crash during its flush), with no intact
        // line after it, was never acknowledged either: a torn end, not applied. Before a good line: damage.
        if (!(error instanceof FileCorruptError) || jsonLineAfter(log, end + 1)) throw error;
        console.warn(
          `[@botmesh/durable] SharedFileEventJournal: ${this.logPath} ends in a torn write at byte ${pos} ` +
            `(${log.length - pos} bytes that are not a whole JSON line, with none after them); the lines before it were applied`,
        );
        break;
      }
      pos = end + 1;
    }
    return journal;
  }

  /**
   * Writes what the batch changed as the next generation (under the mutex).
   * @returns whether something was committed
   * @throws {CommitRefused} when another writer committed that generation (nothing of this batch is in the journal)
   */
  async #persist(held: FileMutexHandle, journal: MemoryEventJournal): Promise<boolean> {
    const changes = journal.takeChanges();
    if (changes === null) return false;
    const gen = this.#gen + 1;
    const deltas = gen - 1 - this.#snapGen;
    const compactBytes = this.#compactBytes ?? Math.max(COMPACT_MIN_BYTES, COMPACT_FACTOR * this.#snapBytes);
    const compactEvery = this.#compactEvery !== Number.POSITIVE_INFINITY
      ? this.#compactEvery
      : Math.max(COMPACT_MIN_DELTAS, Math.ceil(this.#snapBytes / SNAPSHOT_BYTES_PER_DELTA));
    if (!this.#appendLog || deltas >= compactEvery || this.#deltaBytes >= compactBytes) {
      await this.#commitSnapshot(held, journal, gen, this.#adopted, this.#appendLog ? "compact" : "snapshot");
      return true;
    }
    const bytes = encoder.encode(`${JSON.stringify({ seq: gen, w: randomId(), ...changes })}\n`);
    await this.#commitGeneration(held, gen, bytes, "append");
    this.#gen = gen;
    this.#deltaBytes += bytes.length;
    await this.#mirrorLine(journal, gen, bytes).catch(() => {});
    return true;
  }

  /** Commits `journal` as snapshot generation `gen`, then removes the generations before it and mirrors it. */
  async #commitSnapshot(
    held: FileMutexHandle,
    journal: MemoryEventJournal,
    gen: number,
    adopted: string | null,
    kind: "snapshot" | "compact",
  ): Promise<void> {
    const bytes = this.#snapshotBytes(journal, gen, adopted);
    await this.#commitGeneration(held, gen, bytes, kind);
    this.#cache = journal;
    this.#gen = gen;
    this.#snapGen = gen;
    this.#snapBytes = bytes.length;
    this.#deltaBytes = 0;
    this.#adopted = adopted;
    await this.#afterSnapshot(gen, kind).catch(() => {});
  }

  #snapshotBytes(journal: MemoryEventJournal, gen: number, adopted: string | null): Uint8Array {
    const text = serializeEventSnapshot(journal, gen);
    return encoder.encode(
      `{"generation":${gen},"writer":${JSON.stringify(randomId())},"shared":${SHARED_FORMAT},` +
        `"adopted":${JSON.stringify(adopted)},${text.slice(1)}`,
    );
  }

  /**
   * The commit: `bytes` written to a temporary file, then linked as `<file>.gen/<gen>` (`link` fails when
   * that name exists: of two writers that both believe they hold the mutex, one only commits `gen`).
   * @throws {CommitRefused} when nothing was committed (the generation was taken, or a newer one exists)
   * @throws {FileMutexLostError} when it was committed but a newer generation appeared before the check
   *   that follows the link (only after a stop longer than staleLockMs): it may or may not be in the journal
   */
  async #commitGeneration(
    held: FileMutexHandle,
    gen: number,
    bytes: Uint8Array,
    kind: "snapshot" | "append" | "compact",
  ): Promise<void> {
    const target = this.#genPath(gen);
    const temp = `${this.genDir}/${randomId()}.tmp`;
    await this.#step("write", kind, target);
    await ensureDir(this.genDir);
    const pin = await writeFilePinned(temp, bytes, { fsync: kind === "append" ? this.#logFsync : this.#fsync, mode: this.#mode });
    await pin.close().catch(() => {});
    let linked = false;
    try {
      await sharedJournalTestHooks.beforeCommit?.({ kind, path: target, bytes });
      await this.#refuseIfLocked();
      // Before the link: a writer that knows it lost the mutex, or is behind, commits nothing.
      if (!(await held.stillHeld())) throw new CommitRefused(`the mutex was taken over before the commit`);
      const before = await this.#listGenerations();
      const newest = before.length === 0 ? 0 : before[before.length - 1];
      if (newest !== gen - 1) throw new CommitRefused(`the newest generation is ${newest}, not ${gen - 1}`);
      await sharedJournalTestHooks.afterCheck?.({ kind, path: target });
      linked = await linkFile(temp, target);
    } finally {
      await removeFile(temp).catch(() => {});
    }
    if (!linked) throw new CommitRefused(`generation ${gen} was committed by another writer`);
    await this.#step("linked", kind, target);
    if (kind === "append" ? this.#logFsync : this.#fsync) await syncDirectory(this.genDir);
    // A name removed after a newer snapshot can be linked again by a writer that was stopped meanwhile: such
    // a generation is below the newest snapshot, which readers start from. Nobody reads it.
    const after = await this.#listGenerations();
    if (after[after.length - 1] > gen) {
      await this.#forget();
      throw this.#unconfirmed(`; generation ${after[after.length - 1]} appeared after ${gen}, this write's`);
    }
  }

  /** After snapshot generation `gen`: the generations before it are removed, and the mirror is rewritten. */
  async #afterSnapshot(gen: number, kind: "snapshot" | "compact"): Promise<void> {
    for (const old of await this.#listGenerations()) if (old < gen) await removeFile(this.#genPath(old)).catch(() => {});
    await this.#step("mirror", kind, this.path);
    if ((await statIdentity(this.#genPath(gen + 1))) !== null) return; // a newer commit mirrors itself
    const temp = uniqueTempPath(this.path);
    if (!(await linkFile(this.#genPath(gen), temp))) return;
    try {
      await renameFile(temp, this.path);
    } finally {
      await removeFile(temp).catch(() => {});
    }
    this.#pathSeen = await this.#pathKey();
    if ((await statIdentity(this.logPath)) !== null) await truncateFile(this.logPath, 0, { fsync: false });
    this.#mirrorDirty = true;
  }

  /**
   * Mirrors delta generation `gen` as a line of `<file>.log` (read by a FileEventJournal opened later),
   * when the mirror is at `gen - 1`; otherwise rewrites the whole mirror.
   */
  async #mirrorLine(journal: MemoryEventJournal, gen: number, bytes: Uint8Array): Promise<void> {
    await this.#step("mirror", "append", this.logPath);
    if ((await statIdentity(this.#genPath(gen + 1))) !== null) return;
    if ((await this.#mirrorAt()) === gen - 1) {
      await appendToFile(this.logPath, bytes, { fsync: false, mode: this.#mode });
      this.#mirrorDirty = true;
      return;
    }
    await writeFileAtomic(this.path, this.#snapshotBytes(journal, gen, this.#adopted), { fsync: this.#fsync, mode: this.#mode });
    this.#pathSeen = await this.#pathKey();
    await truncateFile(this.logPath, 0, { fsync: false });
    this.#mirrorDirty = true;
  }

  /** The generation the mirror (the journal file and its `.log`) holds, `-1` when unknown. */
  async #mirrorAt(): Promise<number> {
    const head = await readFileRange(this.path, 0, 400);
    const stamp = head === null ? null : STAMP.exec(decoder.decode(head));
    if (stamp === null) return -1;
    const snapshot = Number(stamp[1]);
    const info = await statIdentity(this.logPath);
    if (info === null || info.size === 0) return snapshot;
    // The last line: read back from the end until its start (a large batch makes a long line).
    let tail: Uint8Array | null = null;
    let start = -1;
    for (let span = MIRROR_TAIL; start < 0; span *= 4) {
      const from = Math.max(0, info.size - span);
      tail = await readFileRange(this.logPath, from, info.size);
      if (tail === null || tail.length === 0 || tail[tail.length - 1] !== 10) return -1;
      const newline = tail.lastIndexOf(10, tail.length - 2);
      if (newline >= 0 || from === 0) start = newline + 1;
    }
    const seq = /^\{"seq":(\d+),/.exec(decoder.decode(tail!.subarray(start, start + 40)));
    if (seq === null) return -1;
    return Math.max(snapshot, Number(seq[1]));
  }

  async #step(step: string, kind: "snapshot" | "append" | "compact", path: string): Promise<void> {
    await sharedJournalTestHooks.step?.({ step, kind, path });
  }
}

/** Nothing of the batch was committed (another writer committed that generation): the batch runs again. */
class CommitRefused extends Error {
  constructor(detail: string) {
    super(`${LABEL}: commit refused: ${detail}`);
    this.name = "CommitRefused";
  }
}

/** Whether a generation's bytes are a delta (a log line) rather than a snapshot. */
function isDelta(bytes: Uint8Array): boolean {
  return bytes[0] === 123 && bytes[1] === 34 && bytes[2] === 115 && bytes[3] === 101 && bytes[4] === 113; // {"seq
}

/**
 * Applies one log line (or delta generation) to `journal`.
 * @param last the last entry applied: lines not after it are skipped (of two lines with one seq, the first wins)
 * @param expect the seq it must have (a delta generation), or `null`
 * @returns the last entry applied
 */
function applyLogLine(
  journal: MemoryEventJournal,
  line: Uint8Array,
  file: string,
  offset: number,
  lineNo: number,
  last: number,
  expect: number | null,
): number {
  let entry: Record<string, unknown>;
  try {
    entry = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(line));
  } catch {
    const problem = findJsonSyntaxError(line);
    throw new FileCorruptError(
      file,
      offset + (problem?.offset ?? 0),
      `a log line is not valid JSON: ${problem?.reason ?? "rejected by the parser"}`,
      LABEL,
    );
  }
  const seq = entry?.seq;
  if (typeof entry !== "object" || entry === null || typeof seq !== "number" || !Number.isInteger(seq) || seq < 1) {
    throw new FileCorruptError(file, offset, `line ${lineNo}: a log line has no valid "seq": ${show(seq)}`, LABEL);
  }
  if (expect !== null && seq !== expect) {
    throw new FileCorruptError(file, offset, `generation ${expect} holds a line of seq ${seq}`, LABEL);
  }
  if (seq <= last) return last;
  try {
    journal.applyChanges(entry as never);
  } catch (error) {
    throw new FileCorruptError(file, offset, `log entry ${seq}: ${(error as Error).message}`, LABEL);
  }
  return seq;
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

  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#run("outbox.damaged", (j) => j.outbox.damaged!(options));
  }

  reportDamaged(key: string): Promise<boolean> {
    return this.#run("outbox.reportDamaged", (j) => j.outbox.reportDamaged!(key));
  }
}
