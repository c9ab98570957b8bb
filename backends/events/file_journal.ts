/**
 * `FileEventJournal`: an events journal ({@link LeasedEventJournal}) on one
 * JSON snapshot file, for one process — the file counterpart of
 * `MemoryEventJournal`, with the core's outbox as a sidecar in the same file.
 *
 * - The state lives in memory (a `MemoryEventJournal`); every change is made
 *   durable by rewriting the whole file atomically (temporary file, `fsync`,
 *   rename, directory `fsync`), in the format of `./snapshot.ts` (`logSeq` 0).
 * - Group commit: operations that arrive while a rewrite is under way share
 *   the next one. Every operation (reads and no-op results included, and
 *   every operation of the outbox sidecar) resolves only once the state it
 *   observed is on disk.
 * - Lease heartbeats (of events and of outbox entries) stay in memory and are
 *   written with the next change. `outbox.markCalling` extends a lease too,
 *   but is a change: it resolves once its `called` flag is on disk.
 * - After a failed rewrite every waiting operation rejects and the state is
 *   reloaded from the file: memory never holds what was not written.
 * - `{ lock: true }` (required for durability) takes the pid lock file
 *   `<path>.lock`; a second `open()` of the same file in this process is
 *   refused until the first journal is closed (with or without `lock`).
 * - A file left by a `SharedFileEventJournal` is taken over: its
 *   `<path>.log` is replayed at `open()` (under the shared journal's mutex
 *   `<path>.mutex`), then written into a fresh snapshot and removed.
 * - A record (event or outbox entry) that is not valid is set aside, kept in
 *   the file as it was (see `DamagedEvent`); a file that is not JSON or not
 *   the journal's format is refused whole (`FileCorruptError`).
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import { checkKnownOptions } from "../../src/options.ts";
import type {
  ClaimDueOptions,
  ClaimOptions,
  DamagedListOptions,
  DamagedRecord,
  FailOutcome,
  ListOptions,
  NewOutboxEntry,
  OutboxClaim,
  OutboxEntry,
  OutboxJournal,
  OutboxState,
  ReserveResult,
} from "../../src/contract.ts";
import {
  type EventJournalChanges,
  MemoryEventJournal,
  type MemoryEventJournalOptions,
} from "./memory_journal.ts";
import type {
  DamagedEvent,
  DamagedEventListOptions,
  EventClaimOptions,
  EventListOptions,
  EventRecord,
  LeasedEventJournal,
  NewEventRecord,
} from "../../src/events/types.ts";
import { dirName, ensureDir, readFileBytes, realPathOf, removeFile, resolvePath, statFile } from "../../src/runtime/fs.ts";
import { showValue as show } from "../../src/show.ts";
import { FileCorruptError } from "../file/corrupt_error.ts";
import { fileStep } from "../file/file_step.ts";
import { findJsonSyntaxError } from "../file/json_error.ts";
import { FileLock, FileLockedError } from "../file/lock.ts";
import { DEFAULT_STALE_LOCK_MS } from "../file/lock_file.ts";
import { removeLeftoverFiles } from "../file/leftovers.ts";
import { FileMutex } from "../file/mutex.ts";
import { claimOpenFile, releaseOpenFile } from "../file/open_files.ts";
import { NEW_FILE_MODE, snapshotFileMode } from "../file/snapshot.ts";
import { SnapshotCommitter } from "../file/snapshot_committer.ts";
import { setAsideTornTail } from "../file/torn_tail.ts";
import { parseEventSnapshot, serializeEventSnapshot } from "./snapshot.ts";

export { FileCorruptError, FileLockedError };

/** The journal named in error messages. */
const LABEL = "FileEventJournal";

/** Options of {@link FileEventJournal.open}. */
export interface FileEventJournalOptions {
  /**
   * Take the pid lock file `<path>.lock`, so that a second process cannot
   * open the file (required for durability: `EventsDurability` refuses an
   * unlocked journal). `false` opens the file without a lock: a second
   * writer (another process, or a `SharedFileEventJournal`) would overwrite
   * this journal's writes and the other way round. Use it only for a file
   * nothing else writes (a one-off inspection or migration script).
   */
  lock: boolean;
  /**
   * Flush every rewrite (file and directory) to the disk before the
   * operations waiting on it resolve (default `true`). `false` survives a
   * process crash but not a power loss or an OS crash.
   */
  fsync?: boolean;
  /**
   * How long, in ms, a lock file (or a `SharedFileEventJournal`'s mutex)
   * written by a process on another host must go without a refresh before it
   * counts as stale and is broken (default `30000`, at least `1000`). A lock
   * of a process on this host is judged by its pid (a dead pid is broken at
   * once).
   */
  staleLockMs?: number;
  /** The journal clock in ms since epoch (default `() => Date.now()`); the outbox sidecar uses it too. */
  clock?: () => number;
}

/** Counters of a {@link FileEventJournal}, for monitoring and tests. */
export interface FileEventJournalStats {
  /** Snapshot rewrites that reached the disk (the one of `open()` for a new file or a replayed log included). */
  rewrites: number;
  /** Rewrites that failed (their operations were rejected). */
  failedRewrites: number;
  /** Size of the last snapshot written, in UTF-16 code units of its JSON text (about its size in bytes for ASCII data). */
  lastSnapshotChars: number;
  /** Duration of the last successful rewrite in ms (serialization, write, flushes and rename). */
  lastRewriteMs: number;
  /** Entries of a `<path>.log` (left by a `SharedFileEventJournal`) replayed at `open()`. */
  replayedLogEntries: number;
}

/** Runs one operation on the open state and resolves once what it observed is on disk. */
type Run = <T>(op: string, operation: (mem: MemoryEventJournal) => Promise<T>) => Promise<T>;

/** One file-system step of `open()`/`close()`, its errors naming the file. */
function step<T>(file: string, what: string, run: () => Promise<T>): Promise<T> {
  return fileStep(LABEL, file, what, run);
}

let testHooks: { crash(journal: FileEventJournal): Promise<void> } | undefined;
/** Lets only {@link FileEventJournal.open} construct a journal. */
const CONSTRUCT = Symbol("FileEventJournal.construct");

/**
 * An events journal on one JSON snapshot file, for one process
 * (`scope: 'process'`): the {@link LeasedEventJournal} contract (leases,
 * fencing tokens, channels, replay, purge) with the core's outbox as a
 * sidecar in the same file and the same atomic snapshot, for
 * `new EventsDurability({ journal })`.
 *
 * Every change rewrites the whole file atomically (temporary file, `fsync`,
 * rename, directory `fsync`); concurrent operations share one rewrite (group
 * commit), and every operation, of the events and of `outbox`, resolves only
 * once the state it observed is on disk. The cost of a write is one
 * `JSON.stringify` of the whole journal plus the write: keep the journal
 * small (the bot's retention purges its records; `purge()` the app's), give
 * the bot a journal file of its own, or use a database backend for volume.
 * Lease heartbeats are kept in memory and written with the next change: only
 * a restart of this process can take a lease, and a restart reclaims its own
 * records at once (same `instanceId`).
 *
 * `open(path, { lock: true })` resolves the real path (symlinks followed),
 * registers the file in this process (a second `open()` of it is refused
 * until `close()`), takes the pid lock `<path>.lock` (another live process →
 * {@link FileLockedError} naming the pid and the lock file; a dead process's
 * lock is broken at once), and loads the file. If a `SharedFileEventJournal`
 * used the file, the load runs under its mutex `<path>.mutex`, and the
 * entries of its append log `<path>.log` past the snapshot's `logSeq` are
 * replayed, written into a fresh snapshot, and the log removed. A torn end
 * of the log (a last line with no newline, or one that is not JSON with no
 * JSON line after it: its middle never reached the disk) is not replayed: its
 * bytes are kept in `<path>.log.torn-<n>` and a `console.warn` names them. A file (or log line) that is not JSON, or not the
 * journal's format → {@link FileCorruptError} naming the file and the byte
 * offset or the field; nothing is written.
 *
 * Damaged records: an event or an outbox entry of a readable file that is
 * not a valid record (a field of the wrong type, an unknown state, … a bad
 * disk or a hand edit) does not make the file unreadable. It is kept in the
 * file as it was, and the first operation that meets it (`claimDue`, `list`,
 * `get`, `damaged`; the outbox's own) sets it aside, once, writing its mark
 * (`damaged` in the file: what is wrong, when, whether it was reported). It
 * is left out of everything else: due scans neither take it nor let it hold
 * back its `orderKey` (or its chat, in the outbox), `list` returns the other
 * records, `get` rejects with a `DamagedEventError` (the outbox's with a
 * `DamagedRecordError`), and operations on it change nothing.
 * `damaged()` / `reportDamaged()` (and the outbox's) list and report them:
 * through `EventsDurability`, the bot reports each once as an `error` event.
 *
 * A failed rewrite (disk full, permissions) rejects every operation waiting
 * for a write, with an error naming the file, and the state is reloaded from
 * the file (the last snapshot written); if that fails too, every operation
 * rejects until the journal is closed and opened again.
 *
 * `close()` lets the operations already called finish, writes what is left,
 * and releases the lock and the registration; later operations reject with
 * an error naming the file.
 *
 * `open(path, { lock: false })` skips the pid lock (`locked` is `false`):
 * not durable against a second writer, which would overwrite this journal's
 * rewrites (and `EventsDurability` refuses such a journal); the file is
 * still registered in this process.
 *
 * On Deno: `--allow-read --allow-write --allow-run --allow-sys` (`--allow-run`
 * to check a lock holder's pid, `--allow-sys` for the hostname in the lock).
 *
 * @example Usage
 * ```ts
 * import { FileEventJournal } from "@botmesh/durable/events";
 *
 * const dir = await Deno.makeTempDir();
 * const journal = await FileEventJournal.open(`${dir}/events.json`, { lock: true });
 * await journal.append({ id: "e1", eventType: "order.paid", payload: { order: 42 } });
 * const [event] = await journal.claimDue({ owner: "w1", incarnation: "a", leaseMs: 30_000, limit: 10 });
 * await journal.complete(event.id, event.lease!.token);
 * await journal.close();
 *
 * const again = await FileEventJournal.open(`${dir}/events.json`, { lock: true });
 * console.log((await again.get("e1"))?.state); // "done"
 * await again.close();
 * await Deno.remove(dir, { recursive: true });
 * ```
 *
 * @example With a bot
 * ```ts ignore
 * const journal = await FileEventJournal.open("./data/events.json", { lock: true });
 * const bot = new Bot({ provider, durability: { backend: new EventsDurability({ journal }) } });
 * await bot.start();
 * // …
 * await bot.stop();
 * await journal.close();
 * ```
 */
export class FileEventJournal implements LeasedEventJournal {
  /** Always `'file-events'`. */
  readonly name: string = "file-events";
  /** One process: the lock file keeps other processes out. */
  readonly scope: "process" = "process";
  /** The file as given to `open()`. */
  readonly path: string;
  /** The absolute real path of the file (symlinks resolved). */
  readonly file: string;
  /** Whether the journal holds the pid lock `<file>.lock` (`open(path, { lock: true })`): required for durability. */
  readonly locked: boolean;
  /** The core's outbox, stored in the same file: its writes share the rewrites, and resolve once on disk. */
  readonly outbox: OutboxJournal;

  readonly #staleLockMs: number;
  readonly #fsync: boolean;
  readonly #memOptions: MemoryEventJournalOptions;
  /** Permission bits of the file, kept across rewrites. */
  #mode = NEW_FILE_MODE;
  #lock: FileLock | null = null;
  /** The state in memory and its group commit into the file (failed state and crash included). */
  readonly #commit: SnapshotCommitter<MemoryEventJournal>;
  /** Operations called and not settled yet. */
  readonly #inflight = new Set<Promise<unknown>>();
  /** Set by the first `close()`. */
  #closing: Promise<void> | null = null;
  /** Entries of a shared journal's log replayed at `open()`. */
  #replayedLogEntries = 0;

  static {
    testHooks = { crash: (journal) => journal.#crash() };
  }

  /** Use {@link FileEventJournal.open}. */
  private constructor(
    key: symbol,
    path: string,
    file: string,
    options: { lock: boolean; fsync: boolean; staleLockMs: number; clock?: () => number },
  ) {
    if (key !== CONSTRUCT) throw new TypeError(`${LABEL}: use FileEventJournal.open(path, { lock: true })`);
    this.path = path;
    this.file = file;
    this.locked = options.lock;
    this.#staleLockMs = options.staleLockMs;
    this.#fsync = options.fsync;
    this.#memOptions = { heartbeatChanges: false, name: "file-events", ...(options.clock ? { clock: options.clock } : {}) };
    this.#commit = new SnapshotCommitter<MemoryEventJournal>({
      label: LABEL,
      file: () => this.file,
      fsync: options.fsync,
      mode: () => this.#mode,
      serialize: (mem) => serializeEventSnapshot(mem, 0),
      parse: (file, bytes) => parseEventSnapshot(file, bytes, LABEL, this.#memOptions).journal,
      current: () => this.#state(),
      reloaded: "reloaded",
      recovery: ": close the journal and open it again once the file is usable.",
    });
    this.outbox = new FileSidecarOutbox((op, operation) => this.#run(op, operation));
  }

  /**
   * Opens the journal on `path` (a missing file starts empty and is written
   * at once; its directory is created).
   *
   * @param path the journal file, e.g. `./data/events.json`
   * @param options `lock` (required; `true` for durability), `fsync` (default `true`), `staleLockMs`, `clock`
   * @returns the open journal
   * @throws {TypeError} for a bad option (named)
   * @throws {FileLockedError} when another live process holds `<path>.lock`
   * @throws {FileCorruptError} when the file or its `.log` is not JSON or not the journal's format (nothing is
   *   written; a record that is not valid is set aside instead)
   * @throws {Error} when the file is already open in this process (`FileEventJournal: <file> is already open in
   *   this process …`), or cannot be read or written (`FileEventJournal: <file>: …`, the runtime's error as `cause`)
   */
  static async open(path: string, options: FileEventJournalOptions): Promise<FileEventJournal> {
    if (typeof path !== "string" || path.length === 0 || path.includes("\0")) {
      throw new TypeError(`${LABEL}.open: "path" must be a non-empty string without NUL, got ${show(path)}`);
    }
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`${LABEL}.open: the options must be an object such as { lock: true }, got ${show(options)}`);
    }
    checkKnownOptions(options, ["lock", "fsync", "staleLockMs", "clock"], `${LABEL} option`);
    const { lock, fsync = true, staleLockMs = DEFAULT_STALE_LOCK_MS, clock } = options;
    if (typeof lock !== "boolean") {
      throw new TypeError(
        `${LABEL}.open: option "lock" must be true or false (true takes the pid lock file, required for durability), ` +
          `got ${show(lock)}`,
      );
    }
    if (typeof fsync !== "boolean") throw new TypeError(`${LABEL}.open: option "fsync" must be a boolean, got ${show(fsync)}`);
    if (typeof staleLockMs !== "number" || !Number.isFinite(staleLockMs) || staleLockMs < 1000) {
      throw new TypeError(
        `${LABEL}.open: option "staleLockMs" must be a finite number of milliseconds, at least 1000, got ${show(staleLockMs)}`,
      );
    }
    if (clock !== undefined && typeof clock !== "function") {
      throw new TypeError(`${LABEL}.open: option "clock" must be a function, got ${show(clock)}`);
    }
    const absolute = await resolvePath(path);
    await step(absolute, "cannot create its directory", async () => ensureDir(await dirName(absolute)));
    // Every path to the file (symlinks) shares one lock and one registration, and a rewrite never replaces a symlink.
    const file = await step(absolute, "cannot resolve its real path", () => realPathOf(absolute));
    const journal = new FileEventJournal(CONSTRUCT, path, file, { lock, fsync, staleLockMs, clock });
    await journal.#open();
    return journal;
  }

  /** A copy of the rewrite counters. */
  get stats(): FileEventJournalStats {
    return { ...this.#commit.stats, replayedLogEntries: this.#replayedLogEntries };
  }

  /** Whether `close()` was called (or the journal was let go by `simulateCrash`). */
  get closed(): boolean {
    return this.#closing !== null || this.#commit.crashed;
  }

  async #open(): Promise<void> {
    const file = this.file;
    claimOpenFile(file, this, LABEL);
    try {
      if (this.locked) {
        this.#lock = await step(
          file,
          `cannot take the lock file ${file}.lock`,
          () => FileLock.acquire(file, { staleLockMs: this.#staleLockMs, label: LABEL }),
        );
      }
      this.#mode = (await step(file, "cannot read it", () => snapshotFileMode(file, LABEL))).mode;
      // A SharedFileEventJournal works (or worked) on this file: read it, and take over its log, under its mutex.
      const shared = (await step(file, "cannot read it", () => statFile(`${file}.mutex`))) !== null ||
        (await step(file, "cannot read it", () => statFile(`${file}.log`))) !== null;
      if (shared) {
        await new FileMutex(file, { staleLockMs: this.#staleLockMs, label: LABEL }).run(() => this.#load());
      } else {
        await this.#load();
      }
    } catch (error) {
      this.#commit.detach();
      const lock = this.#lock;
      this.#lock = null;
      if (lock !== null) await lock.release().catch(() => {});
      releaseOpenFile(file, this);
      throw error;
    }
  }

  /** Reads the snapshot (and replays a shared journal's log), writing the file when it is new or a log was replayed. */
  async #load(): Promise<void> {
    const file = this.file;
    const logPath = `${file}.log`;
    // A temporary file left by a crash during a rewrite is an unfinished write: the snapshot is the truth.
    // `<file>.<random>.tmp` (and `<file>.tmp` of earlier versions); without the lock, only old ones (a writer's are young).
    await step(file, `cannot remove the leftover ${file}.tmp`, () => removeFile(`${file}.tmp`));
    await step(
      file,
      `cannot remove the leftover temporary files ${file}.*.tmp`,
      () => removeLeftoverFiles(file, this.#staleLockMs, { ownTempsOlderThanMs: this.locked ? 0 : this.#staleLockMs }),
    );
    const bytes = await step(file, "cannot read it", () => readFileBytes(file));
    let mem: MemoryEventJournal;
    let logSeq = 0;
    if (bytes === null) {
      mem = new MemoryEventJournal(this.#memOptions);
    } else {
      ({ journal: mem, logSeq } = parseEventSnapshot(file, bytes, LABEL, this.#memOptions));
    }
    const log = await step(file, `cannot read ${logPath}`, () => readFileBytes(logPath));
    const replayed = log === null ? { applied: 0, tornAt: null } : replayLog(logPath, log, mem, logSeq);
    if (replayed.tornAt !== null) {
      const tail = log!.subarray(replayed.tornAt);
      const aside = await step(
        file,
        `cannot set aside the torn end of ${logPath}`,
        () => setAsideTornTail(logPath, tail, { fsync: this.#fsync, mode: this.#mode }),
      );
      console.warn(
        `[@botmesh/durable] ${LABEL}: ${logPath} ended in a torn write at byte ${replayed.tornAt} (${tail.length} bytes ` +
          `that are not a whole JSON line, with none after them: the last append before a crash). The lines before it ` +
          `were replayed; the torn bytes were set aside in ${aside}`,
      );
    }
    mem.takeChanges(); // loading is not a change
    this.#commit.attach(mem);
    // A new file: written now, so a bad path or permission shows at open. A log: its entries go into the snapshot.
    if (bytes === null || log !== null) await this.#commit.writeNow();
    if (log !== null) {
      // Removed only once the snapshot holds it all; a crash before this replays it again (idempotent).
      await step(file, `cannot remove ${logPath}`, () => removeFile(logPath));
      this.#replayedLogEntries = replayed.applied;
    }
  }

  /**
   * Lets the operations already called finish, writes what is not on disk
   * yet, and releases the lock file and the registration of the file; later
   * operations reject. Calling it again returns the same promise.
   *
   * @throws {Error} when the final rewrite fails or the journal is failed
   *   (the lock is released all the same), or the lock file cannot be released
   */
  close(): Promise<void> {
    this.#closing ??= this.#close();
    return this.#closing;
  }

  async #close(): Promise<void> {
    if (this.#commit.crashed) return;
    const file = this.file;
    await this.#commit.close(
      async () => {
        await null; // operations called in the same tick are in flight
        while (this.#inflight.size > 0) await Promise.allSettled([...this.#inflight]);
        await this.#commit.flush({ untilCrash: true });
      },
      async () => {
        const lock = this.#lock;
        this.#lock = null;
        try {
          if (lock !== null) await step(file, `cannot release the lock file ${file}.lock`, () => lock.release());
        } finally {
          releaseOpenFile(file, this);
        }
      },
    );
  }

  /**
   * Journals `event` (`pending`, or `processing` under `lease` with token 1).
   *
   * @returns the record, or `null` when a record with that id exists (nothing changes)
   * @throws {TypeError} naming a bad field or lease option
   */
  append(event: NewEventRecord, lease?: ClaimOptions): Promise<EventRecord | null> {
    return this.#run("events.append", (m) => m.append(event, lease));
  }

  /** Leases record `id` when it is claimable and in `options.channel`. @returns the leased record, or `null` */
  claim(id: string, options: EventClaimOptions): Promise<EventRecord | null> {
    return this.#run("events.claim", (m) => m.claim(id, options));
  }

  /**
   * Leases up to `limit` claimable records of `options.channel`, oldest `createdAt` first, keeping each
   * `orderKey`'s order (see `LeasedEventJournal.claimDue`). @returns the leased records
   */
  claimDue(options: EventClaimOptions & { limit: number }): Promise<EventRecord[]> {
    return this.#run("events.claimDue", (m) => m.claimDue(options));
  }

  /** Extends the lease held under `token` (in memory: written with the next change). @returns `false` when it is no longer held */
  heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#run("events.heartbeat", (m) => m.heartbeat(id, token, leaseMs));
  }

  /** Journals that run `attempt` of the record's handler begins under `token`. @returns `false` when it is no longer held */
  start(id: string, token: number, attempt: number): Promise<boolean> {
    return this.#run("events.start", (m) => m.start(id, token, attempt));
  }

  /** `scheduled`: a timer, due in `dueInMs`. @throws {StaleLeaseError} when `token` is not the current lease */
  schedule(id: string, token: number, dueInMs: number): Promise<void> {
    return this.#run("events.schedule", (m) => m.schedule(id, token, dueInMs));
  }

  /** `done`. @throws {StaleLeaseError} when `token` is not the current lease */
  complete(id: string, token: number): Promise<void> {
    return this.#run("events.complete", (m) => m.complete(id, token));
  }

  /** `failed` (claimable again after `retryInMs`) or `dead`. @throws {StaleLeaseError} when `token` is not the current lease */
  fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    return this.#run("events.fail", (m) => m.fail(id, token, outcome));
  }

  /**
   * Record `id`.
   *
   * @returns a copy of it, or `null`
   */
  get(id: string): Promise<EventRecord | null> {
    return this.#run("events.get", (m) => m.get(id));
  }

  /** Records in append order, every channel unless `channel` is given. @returns copies */
  list(options?: EventListOptions): Promise<EventRecord[]> {
    return this.#run("events.list", (m) => m.list(options));
  }

  /** `done`, `failed` or `dead` back to `pending` with attempts reset. @returns `false` otherwise */
  replay(id: string): Promise<boolean> {
    return this.#run("events.replay", (m) => m.replay(id));
  }

  /** Deletes `done` records of `channel` (absent: every channel) not updated for `olderThanMs`. @returns how many */
  purge(olderThanMs: number, options?: { channel?: string | null }): Promise<number> {
    return this.#run("events.purge", (m) => m.purge(olderThanMs, options));
  }

  /** Events set aside as damaged, in the order they were (see `DamagedEvent`). @returns at most `limit` (default 100) */
  damaged(options?: DamagedEventListOptions): Promise<DamagedEvent[]> {
    return this.#run("events.damaged", (m) => m.damaged(options));
  }

  /** Marks a set-aside event reported. @returns whether this call marked it */
  reportDamaged(id: string, options?: { channel?: string | null }): Promise<boolean> {
    return this.#run("events.reportDamaged", (m) => m.reportDamaged(id, options));
  }

  /** Sets event `id` aside as damaged with `problem`, as it is. @returns whether this call set it aside */
  setAside(id: string, problem: string): Promise<boolean> {
    return this.#run("events.setAside", (m) => m.setAside(id, problem));
  }

  /**
   * Runs one operation on the in-memory state and resolves once what it
   * observed is on disk. An operation called after `close()` rejects at
   * once; one called before runs to its end.
   */
  #run<T>(op: string, operation: (mem: MemoryEventJournal) => Promise<T>): Promise<T> {
    if (this.#commit.crashed) {
      return Promise.reject(new Error(`${LABEL} ${this.file} was let go by simulateCrash(): open it again`));
    }
    if (this.#closing !== null || this.#commit.state === null) {
      return Promise.reject(new Error(`${LABEL} ${this.file} is closed: ${op} was called after close(); open it again`));
    }
    // Any change since the last operation (this one's, or one that ran meanwhile): heartbeats are not changes.
    const running = this.#commit.run(operation, (_result, mem) => mem.takeChanges() !== null);
    this.#inflight.add(running);
    const done = () => void this.#inflight.delete(running);
    running.then(done, done);
    return running;
  }

  /** The state; throws when the journal is failed or let go. */
  #state(): MemoryEventJournal {
    const failure = this.#commit.failure;
    if (failure !== null) throw new Error(failure.message, { cause: failure.cause });
    const mem = this.#commit.state;
    if (mem === null) {
      throw new Error(
        this.#commit.crashed
          ? `${LABEL} ${this.file} was let go by simulateCrash(): open it again`
          : `${LABEL} ${this.file} is closed; open it again`,
      );
    }
    return mem;
  }

  async #crash(): Promise<void> {
    if (this.#commit.crashed) return;
    this.#lock?.abandon(); // the lock file stays, as after a kill
    await this.#commit.crash(); // a write under way finishes, as the kernel would finish a rename
    this.#lock = null;
    releaseOpenFile(this.file, this);
  }
}

/**
 * **For tests only.** Lets `journal` go as if its process had been killed:
 * no new write starts, a write under way finishes, operations waiting for a
 * write reject, later operations reject, and the in-process registration of
 * the file is dropped — but the lock file stays, holding this process's pid,
 * so the next `FileEventJournal.open()` breaks it as a restarted process
 * would. For a restart in one test process (the conformance suite's `reopen`).
 *
 * @param journal the journal to let go; it is never usable again
 * @returns once a write under way has finished
 * @example
 * ```ts ignore
 * await simulateCrash(journal);
 * const again = await FileEventJournal.open(journal.path, { lock: true });
 * ```
 */
export function simulateCrash(journal: FileEventJournal): Promise<void> {
  if (!(journal instanceof FileEventJournal)) {
    return Promise.reject(new TypeError(`simulateCrash needs a FileEventJournal, got ${show(journal)}`));
  }
  return testHooks!.crash(journal);
}

/** The sidecar outbox: every operation goes through the journal's group commit. */
class FileSidecarOutbox implements OutboxJournal {
  readonly #run: Run;
  constructor(run: Run) {
    this.#run = run;
  }
  reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    return this.#run("outbox.reserve", (m) => m.outbox.reserve(entry, lease));
  }
  claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    return this.#run("outbox.claimDue", (m) => m.outbox.claimDue(options));
  }
  heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#run("outbox.heartbeat", (m) => m.outbox.heartbeat(key, token, leaseMs));
  }
  /** A change (not a heartbeat): resolves once `called` is on disk. */
  markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#run("outbox.markCalling", (m) => m.outbox.markCalling(key, token, leaseMs));
  }
  markSent(key: string, token: number, messageId: string): Promise<void> {
    return this.#run("outbox.markSent", (m) => m.outbox.markSent(key, token, messageId));
  }
  markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    return this.#run("outbox.markFailed", (m) => m.outbox.markFailed(key, token, outcome));
  }
  get(key: string): Promise<OutboxEntry | null> {
    return this.#run("outbox.get", (m) => m.outbox.get(key));
  }
  list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    return this.#run("outbox.list", (m) => m.outbox.list(options));
  }
  retry(key: string): Promise<boolean> {
    return this.#run("outbox.retry", (m) => m.outbox.retry(key));
  }
  discard(key: string): Promise<boolean> {
    return this.#run("outbox.discard", (m) => m.outbox.discard(key));
  }
  purge(olderThanMs: number): Promise<number> {
    return this.#run("outbox.purge", (m) => m.outbox.purge(olderThanMs));
  }
  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#run("outbox.damaged", (m) => m.outbox.damaged!(options));
  }
  reportDamaged(key: string): Promise<boolean> {
    return this.#run("outbox.reportDamaged", (m) => m.outbox.reportDamaged!(key));
  }
}

// ---------------------------------------------------------------------------
// The append log of a SharedFileEventJournal

const fatalDecoder = new TextDecoder("utf-8", { fatal: true });

function isBlank(bytes: Uint8Array): boolean {
  for (const b of bytes) if (b !== 0x20 && b !== 0x09 && b !== 0x0d) return false;
  return true;
}

/**
 * Whether a line after `from` parses as JSON (an intact entry, not a torn write).
 * @param bytes a log
 * @param from where to look from
 * @returns whether such a line is there
 */
export function jsonLineAfter(bytes: Uint8Array, from: number): boolean {
  for (let start = from; start < bytes.length;) {
    const end = bytes.indexOf(0x0a, start);
    if (end === -1) return false;
    const chunk = bytes.subarray(start, end);
    start = end + 1;
    if (isBlank(chunk)) continue;
    try {
      JSON.parse(fatalDecoder.decode(chunk));
      return true;
    } catch {
      // not JSON either
    }
  }
  return false;
}

/**
 * Applies the entries of a `SharedFileEventJournal` append log to `mem`:
 * one JSON line per write, `{ seq, events, removedEvents, outbox,
 * removedOutbox, outboxSeq }` (a `takeChanges()` change set with its log
 * position). Entries with `seq <= logSeq` are in the snapshot already and
 * skipped, and so is an entry not above the last one applied. A torn end (a
 * write cut short, never acknowledged: a last line with no newline, or one
 * that is not JSON, its middle never written, with no JSON line after it) is
 * not applied: `tornAt` is where it starts.
 *
 * @returns how many entries were applied, and where the torn end starts (`null`: none)
 * @throws {FileCorruptError} naming the log file and the byte offset of a damaged line
 */
function replayLog(
  logPath: string,
  bytes: Uint8Array,
  mem: MemoryEventJournal,
  logSeq: number,
): { applied: number; tornAt: number | null } {
  let start = 0;
  let line = 0;
  let last = logSeq;
  let applied = 0;
  while (start < bytes.length) {
    let end = bytes.indexOf(0x0a, start);
    const terminated = end !== -1;
    if (!terminated) end = bytes.length;
    line++;
    const at = start;
    const chunk = bytes.subarray(start, end);
    start = end + 1;
    if (!terminated) return { applied, tornAt: isBlank(chunk) ? null : at };
    if (isBlank(chunk)) continue;
    const bad = (offset: number, detail: string): never => {
      throw new FileCorruptError(logPath, offset, `line ${line}: ${detail}`, LABEL);
    };
    let doc: unknown;
    try {
      doc = JSON.parse(fatalDecoder.decode(chunk));
    } catch {
      if (!jsonLineAfter(bytes, start)) return { applied, tornAt: at };
      const problem = findJsonSyntaxError(chunk);
      bad(at + (problem?.offset ?? 0), problem?.reason ?? "the JSON parser rejected it");
    }
    if (typeof doc !== "object" || doc === null || Array.isArray(doc)) bad(at, "not a JSON object");
    const entry = doc as Partial<EventJournalChanges> & { seq?: unknown };
    const seq = entry.seq;
    if (typeof seq !== "number" || !Number.isSafeInteger(seq) || seq < 1) {
      bad(at, `field "seq" must be a positive integer, got ${show(seq)}`);
    }
    // Already in the snapshot, or not after the last entry applied (a late write): skipped, as the shared journal does.
    if ((seq as number) <= last) continue;
    try {
      mem.applyChanges(entry as EventJournalChanges);
    } catch (error) {
      bad(at, `entry seq ${seq}: ${errorMessage(error)}`);
    }
    last = seq as number;
    applied++;
  }
  return { applied, tornAt: null };
}
