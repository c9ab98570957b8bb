/**
 * FileDurability: the inbox and outbox in one JSON snapshot with an append
 * log beside it (see `mod.ts` for the user documentation).
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import { checkKnownOptions } from "../../src/options.ts";
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  type DamagedRecords,
  type DurabilityBackend,
  type FailOutcome,
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type ListOptions,
  type NewInboundRecord,
  type NewOutboxEntry,
  type OutboxClaim,
  type OutboxEntry,
  type OutboxJournal,
  type OutboxState,
  type JsonValue,
  type OpenWarning,
  type ReserveResult,
} from "../../src/contract.ts";
import { SnapshotCommitter } from "./snapshot_committer.ts";
import type { SetAsideRecord } from "../memory/aside.ts";
import { MemoryDurability, type MemoryRecords } from "../memory/durability.ts";
import {
  type AppendFile,
  dirName,
  ensureDir,
  openAppendFile,
  readFileBytes,
  syncDirectory,
  realPathOf,
  removeFile,
  resolvePath,
} from "../../src/runtime/fs.ts";
import { FileCorruptError } from "./corrupt_error.ts";
import { fileStep } from "./file_step.ts";
import { removeLeftoverFiles } from "./leftovers.ts";
import { FileLock, FileLockedError } from "./lock.ts";
import { DEFAULT_STALE_LOCK_MS, MIN_STALE_LOCK_MS } from "./lock_file.ts";
import { frameLogRecord, scanLogRecords } from "./log_records.ts";
import { claimOpenFile, releaseOpenFile } from "./open_files.ts";
import { setAsideTornTail } from "./torn_tail.ts";
import { NEW_FILE_MODE, parseJsonBytes, snapshotFileMode, writeSnapshot } from "./snapshot.ts";
import { showValue as show } from "../../src/show.ts";
import { cutDeepNesting, MAX_STORED_DEPTH } from "../../src/content.ts";
import {
  describeJsonKind as kindOf,
  storedCalled,
  storedInboundProblem as checkInbound,
  storedOutboxProblem as checkOutbound,
} from "../../src/stored_records.ts";

export { FileCorruptError, FileLockedError };

/** Options of {@link FileDurability}. */
export interface FileDurabilityOptions {
  /**
   * The snapshot file, e.g. `./data/bot.json` (relative paths are resolved
   * against the current directory at `open()`, and symlinks to their target).
   * Its directory is created when missing. `<path>.lock`, `<path>.log` and the
   * temporary `<path>.<random>.tmp` live next to the real file. A new file is created with mode `0o600`;
   * an existing file keeps its mode across rewrites.
   */
  path: string;
  /**
   * Flush every rewrite (file and directory) to the disk before the
   * operations waiting on it resolve (default `true`). `false` survives a
   * process crash but not a power loss or an OS crash.
   */
  fsync?: boolean;
  /**
   * How long, in ms, a lock file written by a process on another host (a
   * container with its own pid namespace on a shared volume) must go without
   * a refresh before it counts as stale and is broken (default `30000`, at
   * least `1000`). Such a holder's pid cannot be checked from here; a live
   * holder refreshes its lock file's mtime every `min(10 s, staleLockMs / 3)`.
   * Use the same value on every host, and keep the hosts' clocks in sync. A
   * lock of a process on this host is judged by its pid instead (a dead pid
   * is broken at once).
   */
  staleLockMs?: number;
  /**
   * The clock of leases, due times and timestamps in ms since epoch (default
   * `() => Date.now()`), as for `MemoryDurability`; lock files keep the real
   * clock. Replace it only for tests in simulated time. It must return a
   * finite number.
   */
  clock?: () => number;
}

/** Counters of a {@link FileDurability}, for monitoring and tests. */
export interface FileDurabilityStats {
  /** Snapshot rewrites that reached the disk (the initial one of a new file included). */
  rewrites: number;
  /** Rewrites that failed (their operations were rejected). */
  failedRewrites: number;
  /** Size of the last snapshot written, in UTF-16 code units of its JSON text (about its size in bytes for ASCII data). */
  lastSnapshotChars: number;
  /** Duration of the last successful rewrite in ms (serialization, write, flushes and rename). */
  lastRewriteMs: number;
  /** Of `rewrites`, whole snapshots written (a new file, compactions of the log, the last write of `close()`). */
  snapshots: number;
  /** Of `rewrites`, group commits appended to the log `<path>.log`. */
  logAppends: number;
  /** Bytes in the log now (compacted into a new snapshot once it is twice the snapshot's size, at least 256 KiB). */
  logBytes: number;
}

/** The snapshot's format marker. */
const FORMAT = "@botmesh/durable/file";
/** The snapshot's format version: 2 when it has a `damaged` section, else 1 (which older versions also read). */
const VERSION = 2;
/** The format version of a snapshot with a log beside it (older versions refuse it rather than miss the log). */
const LOG_VERSION = 3;
/** The log is compacted into a new snapshot once it holds this many times the snapshot's bytes… */
const COMPACT_FACTOR = 2;
/** …and at least this many. */
const COMPACT_MIN_BYTES = 256 * 1024;
/** The backend named in error messages. */
const LABEL = "FileDurability";
/** The backend's `name`. */
const NAME = "file";

/** One file-system step of `open()`/`close()`, its errors naming the file. */
function step<T>(file: string, what: string, run: () => Promise<T>): Promise<T> {
  return fileStep(LABEL, file, what, run);
}

/**
 * Runs one operation on the open state and resolves once what it observed is
 * on disk; `touched` tells the log what it changed in the inbox (outbox
 * entries are observed) and what it reported.
 */
type Run = <T>(
  operation: (mem: MemoryDurability) => Promise<T>,
  changed: (result: T) => boolean,
  touched?: (result: T, log: FileLog) => void,
) => Promise<T>;

let testHooks: { crash(backend: FileDurability): Promise<void> } | undefined;

/**
 * Test hooks of every FileDurability in the process, exported by
 * `@botmesh/durable/testing` only: make a write fail as a full disk would.
 * Reset what you set after the test.
 */
export interface FileDurabilityTestHooks {
  /** Before each write (its changes taken): throw to make it fail, as a full disk would. */
  beforeWrite?: (what: { kind: "append" | "compact" | "plain"; path: string }) => void | Promise<void>;
}

/** The process-wide {@link FileDurabilityTestHooks} (set by tests only). */
export const fileDurabilityTestHooks: FileDurabilityTestHooks = {};

/**
 * A durability backend on one JSON snapshot file and its append-only log,
 * for a bot that runs as one process (`scope: "process"`). Each group commit
 * appends the records it changed to `<path>.log` (`fdatasync`); the log is
 * compacted into a new snapshot (temporary file, `fsync`, rename, directory
 * `fsync`) once it holds twice the snapshot's bytes, so the cost per change
 * stays flat while the whole state is written only now and then. A
 * compaction is one `JSON.stringify` of the whole state: keep the journals
 * small with `retention` (done and sent records are purged; a purge is
 * written as a new snapshot), or use SQLite for large volumes.
 *
 * `open()` resolves the real path (symlinks followed), takes the lock file
 * `<path>.lock` and loads the file; `close()` writes what is left and
 * releases the lock. A `Bot` calls both (`start()` /
 * `stop()`); several bots and your own code may share one instance, and the
 * calls are counted: the file is loaded at the first `open()` and released at
 * the last `close()`.
 *
 * The lock file holds the pid, the hostname and a random nonce; it is
 * created atomically with its content (written to a temporary file, then
 * hard-linked into place), and its holder refreshes its mtime every
 * `min(10 s, staleLockMs / 3)`. A lock is stale when:
 * - it names this host (or no host) and its pid is dead, or it holds this
 *   process's own pid with a nonce this process does not hold (e.g. pid 1 in
 *   a restarted container): broken at once;
 * - it names another host (a container on a shared volume: its pid means
 *   nothing here) and its mtime is older than `staleLockMs` (default 30 s);
 * - it is unreadable (empty or damaged) and its mtime is older than 10 s.
 * Processes breaking a stale lock at the same time are serialized by a
 * short-lived `<path>.lock.break` file (`O_EXCL`; one left by a crash is
 * removed after 5 s): the lock is re-read under it and deleted only if
 * unchanged, then taken with `O_EXCL` as usual and checked by its nonce; so
 * exactly one of them gets it.
 *
 * Damaged records: a record of the file that is not a valid inbox record or
 * outbox entry (a field of the wrong type, an unknown state, an id or key
 * that appears twice, an outbox `seq` repeated or above the snapshot's
 * counter) is set aside by `open()`: kept in the file as it was, in the
 * snapshot's `damaged` section, with the problem (naming the field), when it
 * was set aside and whether a bot reported it. It is left out of the
 * journals: due scans neither take it nor let it hold back its chat, `list`
 * returns the other records, `get` rejects with a `DamagedRecordError`, an
 * `admit` of its id answers `null` (the id is taken), a `reserve` of its key
 * rejects with that error (whether it was sent is unknown), and `replay`,
 * `retry`, `discard`, `purge` and completions under its old lease change
 * nothing. `damaged()` lists such records and the bot reports each one once
 * (`reportDamaged`, written before it resolves). A record whose id is not
 * even a string is named by its place in the file, e.g. `inbox[3]`.
 *
 * Errors:
 * - Another process holds the lock → {@link FileLockedError} naming the lock
 *   file, the pid and the host (and, for a lock judged by its age, how long
 *   until it counts as stale).
 * - A file that is not a snapshot (broken JSON or UTF-8, a wrong top-level
 *   structure) → {@link FileCorruptError} with the byte offset when there is
 *   one; the file is left as it is.
 * - Any other file-system error of `open()`/`close()` (a directory at the
 *   path, permissions) → an `Error` whose message starts with
 *   `FileDurability: <file>:`, the runtime's error as its `cause`.
 * - A failed rewrite (disk full, permissions) rejects every operation waiting
 *   for a rewrite (their changes were all made on the state that could not
 *   be written) with an error naming the file, and the state in memory is
 *   rebuilt from the file, the last snapshot written: memory never holds what
 *   is not on disk, so a retried operation (a redelivered message) starts
 *   from the durable state. An operation running while the state is rebuilt
 *   rejects as well. A rejected operation did not take effect, unless the
 *   rewrite failed after its rename (flushing the directory): then the file,
 *   and the rebuilt state, hold it. Heartbeats are not written on their own:
 *   leases they extended fall back to the expiry on disk, until the next
 *   heartbeat extends them again (tokens are unchanged).
 * - When that rebuild fails too (the file was deleted or cannot be read),
 *   the backend is failed: every operation rejects with an error naming the
 *   file and saying to reopen it; `close()` rejects with that error (and
 *   releases the file), and a later `open()` loads the file again.
 * - A `close()` whose final rewrite fails rejects, and releases the file all
 *   the same. When releasing the lock file fails too, it rejects with an
 *   `AggregateError` of both (its message and `cause` are the first).
 * - Operations on a backend that is not open reject.
 *
 * @example Usage
 * ```ts
 * import { FileDurability } from "@botmesh/durable/file";
 *
 * const dir = await Deno.makeTempDir();
 * const backend = new FileDurability({ path: `${dir}/bot.json` });
 * await backend.open(); // a Bot does this in start()
 * await backend.inbox.admit({
 *   id: "m1",
 *   kind: "message",
 *   chatId: "c1",
 *   provider: "test",
 *   payload: { text: "hi" },
 *   receivedAt: Date.now(),
 * });
 * await backend.close(); // a Bot does this in stop()
 *
 * const again = new FileDurability({ path: `${dir}/bot.json` });
 * await again.open();
 * console.log((await again.inbox.get("m1"))?.state); // "pending"
 * await again.close();
 * await Deno.remove(dir, { recursive: true });
 * ```
 *
 * @example With a bot
 * ```ts ignore
 * import { Bot } from "@botmesh/durable";
 * import { FileDurability } from "@botmesh/durable/file";
 *
 * const bot = new Bot({
 *   provider,
 *   durability: { backend: new FileDurability({ path: "./data/bot.json" }), instanceId: "bot-1" },
 * });
 * await bot.start(); // opens the file and takes the lock
 * // …
 * await bot.stop(); // writes what is left and releases the lock
 * ```
 */
export class FileDurability implements DurabilityBackend {
  /** Always `'file'`. */
  readonly name: string = NAME;
  /** One process: the lock file keeps other processes out. */
  readonly scope: "process" = "process";
  /** The inbound journal. */
  readonly inbox: InboxJournal;
  /** The outbound journal. */
  readonly outbox: OutboxJournal;
  /** The snapshot file as given in the options. */
  readonly path: string;

  readonly #staleLockMs: number;
  /** The lease clock (undefined: `Date.now()`). */
  readonly #clock: (() => number) | undefined;
  /** The absolute real path, known from the first `open()`. */
  #file: string | undefined;
  /** Permission bits of the snapshot file, kept across rewrites. */
  #mode = NEW_FILE_MODE;
  /** The state in memory and its group commit into the file (failed state and crash included). */
  readonly #commit: SnapshotCommitter<MemoryDurability>;
  readonly #log: FileLog;
  /** Open calls not yet matched by a close. */
  #refs = 0;
  /** Serializes open/close. */
  #lifecycle: Promise<unknown> = Promise.resolve();
  /** Our lock file `<file>.lock`, while we hold it (its holder refreshes its mtime). */
  #lock: FileLock | null = null;

  static {
    testHooks = { crash: (backend) => backend.#crash() };
  }

  /**
   * @param options `path` (required), `fsync` (default `true`),
   *   `staleLockMs` (default `30000`) and `clock` (default `Date.now()`)
   * @throws {TypeError} when `options` is not an object, `path` is not a
   *   non-empty string, `fsync` is not a boolean, `staleLockMs` is not a
   *   finite number of at least 1000, or `clock` is not a function; the
   *   message names the option
   */
  constructor(options: FileDurabilityOptions) {
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`FileDurability options must be an object with a "path", got ${show(options)}`);
    }
    checkKnownOptions(options, ["path", "fsync", "staleLockMs", "clock"], "FileDurability option");
    const { path, fsync = true, staleLockMs = DEFAULT_STALE_LOCK_MS, clock } = options;
    if (typeof path !== "string" || path.length === 0) {
      throw new TypeError(`FileDurability option "path" must be a non-empty string, got ${show(path)}`);
    }
    if (path.includes("\0")) {
      throw new TypeError(`FileDurability option "path" must not contain a NUL character, got ${show(path)}`);
    }
    if (typeof fsync !== "boolean") {
      throw new TypeError(`FileDurability option "fsync" must be a boolean, got ${show(fsync)}`);
    }
    if (typeof staleLockMs !== "number" || !Number.isFinite(staleLockMs) || staleLockMs < MIN_STALE_LOCK_MS) {
      throw new TypeError(
        `FileDurability option "staleLockMs" must be a finite number of milliseconds, at least ${MIN_STALE_LOCK_MS}, got ${show(staleLockMs)}`,
      );
    }
    if (clock !== undefined && typeof clock !== "function") {
      throw new TypeError(`FileDurability option "clock" must be a function, got ${show(clock)}`);
    }
    this.path = path;
    this.#staleLockMs = staleLockMs;
    this.#clock = clock;
    const log = this.#log = new FileLog({ file: () => this.file, fsync, mode: () => this.#mode });
    this.#commit = new SnapshotCommitter<MemoryDurability>({
      label: LABEL,
      file: () => this.file,
      fsync,
      mode: () => this.#mode,
      write: (state) => log.write(state),
      reload: async (failure) => {
        try {
          if (failure.cause instanceof LogUndecidedError) {
            // Whether the failed append is on disk is unknown: reloading could bring back a rejected change.
            throw new Error(`its last log record may or may not be on disk (cutting it off failed: ${errorMessage(failure.cause.cutError)})`);
          }
          const file = this.file;
          const read = await readStore(file);
          if (read === null) throw new Error("the file is gone (deleted, or its directory was)");
          const mem = this.#loadMemory(file, read).mem;
          if (this.#commit.state !== null && !this.#commit.crashed) await log.attach(mem, read);
          return mem;
        } catch (error) {
          await log.close();
          throw error;
        }
      },
      current: () => this.#memory(),
      reloaded: "rebuilt",
      recovery: " until it is reopened: close it and open it again (stop and start the bot) once the file is usable.",
    });
    const run: Run = (operation, changed, touched) =>
      this.#commit.run(operation, (result) => {
        touched?.(result, log);
        return changed(result);
      });
    this.inbox = new FileInbox(run);
    this.outbox = new FileOutbox(run);
  }

  /** The lease clock's time (times records set aside). */
  #now = (): number => this.#clock ? this.#clock() : Date.now();

  /** The state of a store read (its records checked: those that fail are set aside). */
  #loadMemory(file: string, read: StoreRead): { mem: MemoryDurability; setAside: number } {
    const parsed = checkSnapshot(file, read.snap, this.#now);
    const mem = this.#newMemory();
    mem.importRecords(parsed.records);
    return { mem, setAside: parsed.setAside };
  }

  /** A new in-memory state, on the lease clock. */
  #newMemory(): MemoryDurability {
    return this.#clock ? new MemoryDurability({ clock: this.#clock }) : new MemoryDurability();
  }

  /** The absolute real path of the snapshot file, symlinks resolved (the given `path` until the first `open()`). */
  get file(): string {
    return this.#file ?? this.path;
  }

  /** Whether the backend is open (between the first `open()` and the last `close()`). */
  get isOpen(): boolean {
    return this.#commit.state !== null && this.#refs > 0;
  }

  /** A copy of the rewrite counters. */
  get stats(): FileDurabilityStats {
    const { failedRewrites, lastRewriteMs } = this.#commit.stats;
    const written = this.#log.stats;
    return { rewrites: written.snapshots + written.logAppends, failedRewrites, lastRewriteMs, ...written };
  }

  /**
   * Take the lock and load the file (a missing file starts empty and is
   * written at once). Counted: only the first call of a series loads; each
   * call needs a matching {@link close}.
   *
   * @param warn receives what the bot reports as a `warning`: `journal-torn-tail` when the log ended in
   *   a torn write, cut off and set aside in `<path>.log.torn-<n>` (default: `console.warn`)
   * @throws {FileLockedError} when another process holds `<path>.lock`
   * @throws {FileCorruptError} when the file is not a snapshot, or a damaged log record has intact
   *   records after it (the files are left untouched); damaged records in a snapshot are set aside instead
   * @throws {Error} when the file is already open through another
   *   `FileDurability` of this process, or cannot be read or created (the
   *   message starts with `FileDurability: <file>:`, the runtime's error is its `cause`)
   */
  open(warn?: (warning: OpenWarning) => void): Promise<void> {
    return this.#serial(() => this.#open(warn));
  }

  /**
   * Undo one {@link open}. The last one waits for the operations already
   * called, writes what is not on disk yet, and releases the lock; later
   * operations reject. Closing a backend that is not open does nothing.
   *
   * @throws {Error} when the final rewrite fails or the backend is failed
   *   (the lock is released all the same), or the lock file cannot be
   *   released; an `AggregateError` when both happen
   */
  close(): Promise<void> {
    return this.#serial(() => this.#close());
  }

  #serial(step: () => Promise<void>): Promise<void> {
    const run = this.#lifecycle.then(step);
    this.#lifecycle = run.catch(() => {});
    return run;
  }

  async #open(warn: ((warning: OpenWarning) => void) | undefined): Promise<void> {
    if (this.#commit.crashed) throw new Error(`FileDurability ${this.file} was let go by simulateCrash(): create a new one`);
    if (this.#refs > 0) {
      this.#refs++;
      return;
    }
    const absolute = await resolvePath(this.path);
    await step(absolute, "cannot create its directory", async () => ensureDir(await dirName(absolute)));
    // Every path to the file (symlinks) shares one lock and one registration, and a rewrite never replaces a symlink.
    const file = this.#file = await step(absolute, "cannot resolve its real path", () => realPathOf(absolute));
    claimOpenFile(file, this, LABEL);
    let locked = false;
    try {
      this.#lock = await step(
        file,
        `cannot take the lock file ${file}.lock`,
        () => FileLock.acquire(file, { staleLockMs: this.#staleLockMs, label: LABEL }),
      );
      locked = true;
      this.#mode = (await step(file, "cannot read it", () => snapshotFileMode(file, LABEL))).mode;
      // A temporary file left by a crash during a rewrite is an unfinished write: the snapshot is the truth.
      // `<file>.<random>.tmp` (and `<file>.tmp` of earlier versions): only this backend writes them, under the lock.
      await step(file, `cannot remove the leftover ${file}.tmp`, () => removeFile(`${file}.tmp`));
      await step(
        file,
        `cannot remove the leftover temporary files ${file}.*.tmp`,
        () => removeLeftoverFiles(file, this.#staleLockMs, { ownTempsOlderThanMs: 0 }),
      );
      const read = await step(file, "cannot read it", () => readStore(file));
      const loaded = read === null ? { mem: this.#newMemory(), setAside: 0 } : this.#loadMemory(file, read);
      const torn = read === null || read.tail.length === 0
        ? null
        : await step(file, `cannot set aside the torn end of its log ${file}.log`, () => this.#log.setAsideTail(read.tail));
      await step(file, `cannot open its log ${file}.log`, () => this.#log.attach(loaded.mem, read));
      if (torn !== null) {
        const warning: OpenWarning = {
          code: "journal-torn-tail",
          message: `${LABEL}: ${file}.log ended in a torn write at byte ${read!.logEnd} (${read!.tail.length} bytes that are not ` +
            `a whole intact record, with none after them: the last append before a crash, never acknowledged). The records ` +
            `before it were loaded; the torn bytes were cut off and set aside in ${torn}`,
        };
        if (warn === undefined) console.warn(`[@botmesh/durable] ${warning.message}`);
        else warn(warning);
      }
      this.#commit.attach(loaded.mem);
      // A new file: written now, so that a bad path or permission shows at start. Records just set aside:
      // written now, so that they keep the time they were set aside.
      if (read === null) await this.#writeNow("plain");
      else if (loaded.setAside > 0) await this.#writeNow("compact");
      this.#refs = 1;
    } catch (error) {
      this.#commit.detach();
      await this.#log.close();
      if (locked) await this.#releaseLock().catch(() => {});
      releaseOpenFile(file, this);
      throw error;
    }
  }

  async #close(): Promise<void> {
    if (this.#refs === 0) return;
    if (--this.#refs > 0) return;
    const file = this.#file!;
    await this.#commit.close(
      async () => {
        // Let operations already under way join, then write what is not on disk yet, and end the log: the
        // file is left a snapshot alone, as older versions of this library read it.
        await null;
        await this.#commit.flush();
        if (this.#commit.failure !== null) throw this.#commit.failure;
        if (this.#log.hasLog && this.#commit.state !== null) await this.#writeNow("plain");
      },
      async () => {
        await this.#log.close();
        try {
          await step(file, `cannot release the lock file ${file}.lock`, () => this.#releaseLock());
        } finally {
          releaseOpenFile(file, this);
        }
      },
    );
  }

  /** A change written at once, as `kind` (see {@link FileLog.force}). */
  async #writeNow(kind: "plain" | "compact"): Promise<void> {
    this.#log.force(kind);
    await this.#commit.writeNow();
  }

  /** Releases our lock file (only if it is still ours); its refresh stops at once. */
  async #releaseLock(): Promise<void> {
    const lock = this.#lock;
    this.#lock = null;
    if (lock !== null) await lock.release();
  }

  /** The state; throws when the backend is not open or is failed. */
  #memory(): MemoryDurability {
    const mem = this.#commit.state;
    if (mem === null || this.#refs === 0) {
      throw new Error(
        this.#commit.crashed
          ? `FileDurability ${this.file} was let go by simulateCrash(): create a new one`
          : `FileDurability ${this.file} is not open: call open() or start the bot`,
      );
    }
    const failure = this.#commit.failure;
    if (failure !== null) throw new Error(failure.message, { cause: failure.cause });
    return mem;
  }

  async #crash(): Promise<void> {
    this.#refs = 0;
    this.#lock?.abandon(); // the lock file stays, as after a kill
    await this.#commit.crash(); // a write under way finishes, as the kernel would finish a rename
    await this.#log.close();
    this.#lock = null;
    if (this.#file !== undefined) releaseOpenFile(this.#file, this);
  }
}

/**
 * **For tests only.** Lets `backend` go as if its process had been killed:
 * no new write starts, a write under way finishes, operations waiting for a
 * write reject, later operations reject, and the in-process registration of
 * the file is dropped — but the lock file stays, holding this process's pid,
 * so the next `FileDurability` on the file breaks it at `open()` as a
 * restarted process would. Use it to simulate a restart in one test process
 * (the conformance suite's `reopen`).
 *
 * @param backend the backend to let go; it can never be opened again
 * @returns once a write under way has finished
 * @example
 * ```ts ignore
 * runDurabilityConformance({
 *   name: "file",
 *   create: () => new FileDurability({ path: freshPath() }),
 *   reopen: async (old) => {
 *     await simulateCrash(old as FileDurability);
 *     return new FileDurability({ path: (old as FileDurability).path });
 *   },
 *   harness: { describe, test, expect },
 * });
 * ```
 */
export function simulateCrash(backend: FileDurability): Promise<void> {
  if (!(backend instanceof FileDurability)) {
    return Promise.reject(new TypeError(`simulateCrash needs a FileDurability, got ${show(backend)}`));
  }
  return testHooks!.crash(backend);
}

class FileInbox implements InboxJournal, DamagedRecords {
  readonly #run: Run;
  constructor(run: Run) {
    this.#run = run;
  }
  admit(record: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null> {
    return this.#run((m) => m.inbox.admit(record, lease), (r) => r !== null, (r, c) => r !== null && c.touchInbox(r.id));
  }
  claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    return this.#run((m) => m.inbox.claim(id, options), (r) => r !== null, (r, c) => r !== null && c.touchInbox(id));
  }
  claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    // A repeat is answered by the memory model's kept answer and changes nothing.
    return this.#run((m) => m.inbox.claimDue(options), (r) => options.repeat !== true && r.length > 0, (r, c) => r.forEach((x) => c.touchInbox(x.id)));
  }
  heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    // Written with the next change.
    return this.#run((m) => m.inbox.heartbeat(id, token, leaseMs), () => false, (r, c) => r && c.touchInbox(id));
  }
  start(id: string, token: number, attempt: number): Promise<boolean> {
    return this.#run((m) => m.inbox.start(id, token, attempt), (r) => r, (r, c) => r && c.touchInbox(id));
  }
  schedule(id: string, token: number, dueInMs: number): Promise<void> {
    return this.#run((m) => m.inbox.schedule(id, token, dueInMs), () => true, (_, c) => c.touchInbox(id));
  }
  complete(id: string, token: number): Promise<void> {
    return this.#run((m) => m.inbox.complete(id, token), () => true, (_, c) => c.touchInbox(id));
  }
  fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    return this.#run((m) => m.inbox.fail(id, token, outcome), () => true, (_, c) => c.touchInbox(id));
  }
  get(id: string): Promise<InboundRecord | null> {
    return this.#run((m) => m.inbox.get(id), () => false);
  }
  list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    return this.#run((m) => m.inbox.list(options), () => false);
  }
  replay(id: string): Promise<boolean> {
    return this.#run((m) => m.inbox.replay(id), (r) => r, (r, c) => r && c.touchInbox(id));
  }
  purge(olderThanMs: number): Promise<number> {
    // The records purged are not named: the next write is a new snapshot.
    return this.#run((m) => m.inbox.purge(olderThanMs), (n) => n > 0, (n, c) => n > 0 && c.compactNext());
  }
  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#run((m) => m.inbox.damaged(options), () => false);
  }
  reportDamaged(id: string): Promise<boolean> {
    return this.#run((m) => m.inbox.reportDamaged(id), (r) => r, (r, c) => r && c.reported("inbox", id));
  }
}

class FileOutbox implements OutboxJournal, DamagedRecords {
  readonly #run: Run;
  constructor(run: Run) {
    this.#run = run;
  }
  reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    return this.#run((m) => m.outbox.reserve(entry, lease), (r) => r.status !== "exists");
  }
  claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    return this.#run((m) => m.outbox.claimDue(options), (r) => options.repeat !== true && (r.due.length > 0 || r.ambiguous.length > 0));
  }
  heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#run((m) => m.outbox.heartbeat(key, token, leaseMs), () => false); // written with the next change
  }
  markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    // Unlike a heartbeat, written before it resolves: the provider is called only after, and a send
    // found lost after a restart without it is sent again.
    return this.#run((m) => m.outbox.markCalling(key, token, leaseMs), (r) => r);
  }
  markSent(key: string, token: number, messageId: string): Promise<void> {
    return this.#run((m) => m.outbox.markSent(key, token, messageId), () => true);
  }
  markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    return this.#run((m) => m.outbox.markFailed(key, token, outcome), () => true);
  }
  get(key: string): Promise<OutboxEntry | null> {
    return this.#run((m) => m.outbox.get(key), () => false);
  }
  list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    return this.#run((m) => m.outbox.list(options), () => false);
  }
  retry(key: string): Promise<boolean> {
    return this.#run((m) => m.outbox.retry(key), (r) => r);
  }
  discard(key: string): Promise<boolean> {
    return this.#run((m) => m.outbox.discard(key), (r) => r);
  }
  purge(olderThanMs: number): Promise<number> {
    return this.#run((m) => m.outbox.purge(olderThanMs), (n) => n > 0);
  }
  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#run((m) => m.outbox.damaged(options), () => false);
  }
  reportDamaged(key: string): Promise<boolean> {
    return this.#run((m) => m.outbox.reportDamaged(key), (r) => r, (r, c) => r && c.reported("outbox", key));
  }
}

// ---------------------------------------------------------------------------
// Writing, reading and checking a snapshot

/**
 * The snapshot's text: `JSON.stringify` of the whole state. With `logGen`
 * (a log is kept beside it), format version 3 naming that generation of the
 * log; else version 2 when records were set aside, 1 otherwise.
 */
function serializeSnapshot(mem: MemoryDurability, logGen: number): string {
  const records = mem.exportRecords();
  const damaged = records.damaged ?? [];
  return JSON.stringify({
    format: FORMAT,
    version: logGen > 0 ? LOG_VERSION : damaged.length > 0 ? VERSION : 1,
    ...logGen > 0 ? { log: logGen } : {},
    outboxSeq: records.outboxSeq,
    inbox: records.inbox,
    outbox: records.outbox,
    ...damaged.length > 0
      ? {
        damaged: damaged.map(({ journal, id, problem, setAsideAt, reported, stored }) => ({
          journal,
          id,
          problem,
          setAsideAt,
          reported,
          record: stored,
        })),
      }
      : {},
  });
}

/** A snapshot as read, and how many of its records this read set aside (to be written at once). */
interface ParsedSnapshot {
  records: MemoryRecords;
  setAside: number;
}

type Fail = (detail: string) => never;

/**
 * The snapshot's JSON, its top-level structure checked, and the log
 * generation it names (`0`: a snapshot written without a log).
 * @throws {FileCorruptError} when the file is not a snapshot
 */
function readSnapshotObject(file: string, bytes: Uint8Array): { snap: Record<string, unknown>; logGen: number } {
  const value = parseJsonBytes(file, bytes, LABEL);
  const fail: Fail = (detail) => {
    throw new FileCorruptError(file, null, detail);
  };
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    fail(`expected a JSON object, got ${kindOf(value)}`);
  }
  const snap = value as Record<string, unknown>;
  if (snap.format !== FORMAT) {
    fail(`not a FileDurability snapshot ("format" is ${show(snap.format)}, expected ${JSON.stringify(FORMAT)})`);
  }
  if (snap.version !== 1 && snap.version !== 2 && snap.version !== LOG_VERSION) {
    fail(`unsupported format version ${show(snap.version)} (this library reads versions 1 to ${LOG_VERSION})`);
  }
  if (snap.version === LOG_VERSION && (!Number.isSafeInteger(snap.log) || (snap.log as number) < 1)) {
    fail(`"log" must be a positive integer in a version ${LOG_VERSION} snapshot, got ${show(snap.log)}`);
  }
  if (!Number.isSafeInteger(snap.outboxSeq) || (snap.outboxSeq as number) < 0) {
    fail(`"outboxSeq" must be a non-negative integer, got ${show(snap.outboxSeq)}`);
  }
  if (!Array.isArray(snap.inbox)) fail(`"inbox" must be an array, got ${kindOf(snap.inbox)}`);
  if (!Array.isArray(snap.outbox)) fail(`"outbox" must be an array, got ${kindOf(snap.outbox)}`);
  if (snap.damaged !== undefined && !Array.isArray(snap.damaged)) fail(`"damaged" must be an array, got ${kindOf(snap.damaged)}`);
  return { snap, logGen: snap.version === LOG_VERSION ? snap.log as number : 0 };
}

/**
 * Checks a snapshot's records (the log applied): records that fail their
 * checks are set aside (at `now()`), the rest are loaded.
 * @throws {FileCorruptError} when the `damaged` section is not valid
 */
function checkSnapshot(file: string, snap: Record<string, unknown>, now: () => number): ParsedSnapshot {
  const fail: Fail = (detail) => {
    throw new FileCorruptError(file, null, detail);
  };
  const outboxSeq = snap.outboxSeq as number;
  const damaged = parseDamaged(snap.damaged, fail);
  const before = damaged.length;
  let at: number | undefined;
  const setAside = (journal: "inbox" | "outbox", id: string, problem: string, stored: unknown): void => {
    at ??= now();
    // Kept as read, except what nests too deep to be written back (JSON.stringify would overflow the stack):
    // the record's payload or content is one level below it.
    const { value, cutAt } = cutDeepNesting(stored, MAX_STORED_DEPTH + 1, journal);
    const kept = cutAt === undefined ? problem : `${problem}; kept cut from ${cutAt} on`;
    damaged.push({ journal, id, backend: NAME, problem: kept, setAsideAt: at, reported: false, stored: value as JsonValue });
  };

  const inbox: InboundRecord[] = [];
  const ids = new Set<string>();
  (snap.inbox as unknown[]).forEach((item, i) => {
    const id = (item as { id?: unknown } | null)?.id;
    const problem = checkInbound(item) ?? (ids.has(id as string) ? "the id appears twice (an earlier record has it)" : null);
    if (problem !== null) return setAside("inbox", typeof id === "string" ? id : `inbox[${i}]`, problem, item);
    ids.add(id as string);
    inbox.push(item as InboundRecord);
  });

  const keys = new Set<string>();
  const valid: OutboxEntry[] = [];
  (snap.outbox as unknown[]).forEach((item, i) => {
    const entry = item as OutboxEntry | null;
    const key = entry?.key;
    const problem = checkOutbound(item) ??
      (keys.has(key as string)
        ? "the key appears twice (an earlier entry has it)"
        : entry!.seq > outboxSeq
        ? `field "seq" ${entry!.seq} is above the snapshot's "outboxSeq" ${outboxSeq}`
        : null);
    if (problem !== null) return setAside("outbox", typeof key === "string" ? key : `outbox[${i}]`, problem, item);
    keys.add(key as string);
    valid.push(entry!);
  });
  // Written in ascending seq order: an entry a damaged seq moved is sorted back (stable), a repeated seq set aside.
  valid.sort((a, b) => a.seq - b.seq);
  const outbox: OutboxEntry[] = [];
  for (const entry of valid) {
    const previous = outbox[outbox.length - 1];
    if (previous !== undefined && previous.seq === entry.seq) {
      setAside("outbox", entry.key, `field "seq" ${entry.seq} is also entry ${JSON.stringify(previous.key)}'s`, entry);
      continue;
    }
    // A snapshot written before the call marker existed has none: a call may have started (see storedCalled).
    if (typeof entry.called !== "boolean") entry.called = storedCalled(entry.called);
    outbox.push(entry);
  }
  return { records: { inbox, outbox, outboxSeq, damaged }, setAside: damaged.length - before };
}

/** The `damaged` section of a snapshot (records set aside when it was read before). */
function parseDamaged(section: unknown, fail: (detail: string) => never): SetAsideRecord[] {
  if (section === undefined) return [];
  if (!Array.isArray(section)) return fail(`"damaged" must be an array, got ${kindOf(section)}`);
  return section.map((item: unknown, i) => {
    const d = item as Record<string, unknown> | null;
    const problem = typeof d !== "object" || d === null || Array.isArray(d)
      ? `expected an object, got ${kindOf(d)}`
      : d.journal !== "inbox" && d.journal !== "outbox"
      ? `field "journal" must be "inbox" or "outbox", got ${show(d.journal)}`
      : typeof d.id !== "string"
      ? `field "id" must be a string, got ${show(d.id)}`
      : typeof d.problem !== "string"
      ? `field "problem" must be a string, got ${show(d.problem)}`
      : typeof d.setAsideAt !== "number" || !Number.isFinite(d.setAsideAt)
      ? `field "setAsideAt" must be a finite number, got ${show(d.setAsideAt)}`
      : typeof d.reported !== "boolean"
      ? `field "reported" must be a boolean, got ${show(d.reported)}`
      : !("record" in d)
      ? `field "record" is missing`
      : null;
    if (problem !== null) fail(`damaged record ${i}: ${problem}`);
    const { journal, id, problem: what, setAsideAt, reported, record } = d as {
      journal: "inbox" | "outbox";
      id: string;
      problem: string;
      setAsideAt: number;
      reported: boolean;
      record: JsonValue;
    };
    return { journal, id, backend: NAME, problem: what, setAsideAt, reported, stored: record };
  });
}

// ---------------------------------------------------------------------------
// The log beside the snapshot

/**
 * One record of `<file>.log`: what one group commit changed, as the records
 * are after it. `g` is the log generation (the snapshot's `log`): records of
 * another generation are left over from before a compaction (already in the
 * snapshot) and skipped.
 */
interface LogRecord {
  g: number;
  /** Inbox records as they are now (stored whole: replay replaces by id, or appends). */
  i?: unknown[];
  /** Inbox ids removed. */
  x?: string[];
  /** Outbox entries as they are now. */
  o?: unknown[];
  /** Outbox keys removed (discarded or purged). */
  d?: string[];
  /** The last outbox `seq` issued. */
  s?: number;
  /** Damaged records reported: `[journal, id]`. */
  r?: [string, string][];
}

function checkLogRecord(value: unknown): string | null {
  const rec = value as Record<string, unknown> | null;
  if (typeof rec !== "object" || rec === null || Array.isArray(rec)) return `expected an object, got ${kindOf(rec)}`;
  if (!Number.isSafeInteger(rec.g)) return `field "g" must be an integer, got ${show(rec.g)}`;
  for (const field of ["i", "x", "o", "d", "r"]) {
    if (rec[field] !== undefined && !Array.isArray(rec[field])) return `field "${field}" must be an array, got ${kindOf(rec[field])}`;
  }
  if (rec.s !== undefined && (!Number.isSafeInteger(rec.s) || (rec.s as number) < 0)) {
    return `field "s" must be a non-negative integer, got ${show(rec.s)}`;
  }
  return null;
}

/** A journal of the snapshot (an array of records) indexed by id for replay; removed slots are `undefined`. */
class Replayed {
  readonly items: unknown[];
  readonly #index = new Map<unknown, number>();
  readonly #field: "id" | "key";
  constructor(items: unknown[], field: "id" | "key") {
    this.items = items;
    this.#field = field;
    items.forEach((item, i) => {
      const id = (item as Record<string, unknown> | null)?.[field];
      if (typeof id === "string" && !this.#index.has(id)) this.#index.set(id, i);
    });
  }
  put(item: unknown): void {
    const id = (item as Record<string, unknown> | null)?.[this.#field];
    const at = this.#index.get(id);
    if (at !== undefined) this.items[at] = item;
    else {
      if (typeof id === "string") this.#index.set(id, this.items.length);
      this.items.push(item);
    }
  }
  remove(id: unknown): void {
    const at = this.#index.get(id);
    if (at === undefined) return;
    this.items[at] = undefined;
    this.#index.delete(id);
  }
  result(): unknown[] {
    return this.items.filter((item) => item !== undefined);
  }
}

/** An append failed and cutting it off again failed too: the log's last record may or may not be there. */
class LogUndecidedError extends Error {
  readonly cutError: unknown;
  constructor(cause: unknown, cutError: unknown) {
    super(`the append failed (${errorMessage(cause)}) and so did cutting it off (${errorMessage(cutError)})`, { cause });
    this.name = "LogUndecidedError";
    this.cutError = cutError;
  }
}

/**
 * A new log generation: random, never a successor. A counter would restart at 1 after a plain
 * snapshot (a `close()`, an older version), and a log left behind by a crash or a downgrade could
 * then carry the number of a later snapshot and be replayed over it.
 */
function newLogGen(previous: number): number {
  for (;;) {
    const [high, low] = crypto.getRandomValues(new Uint32Array(2));
    const gen = (high! & 0x1fffff) * 2 ** 32 + low!;
    if (gen >= 1 && gen !== previous) return gen;
  }
}

/** A snapshot read with its log applied (records not checked yet). */
interface StoreRead {
  snap: Record<string, unknown>;
  logGen: number;
  snapshotBytes: number;
  /** The log's length up to its last whole record (what follows is a torn write, cut off at open). */
  logEnd: number;
  /** The log's length as found. */
  logSize: number;
  /** What follows the log's last whole record (empty when nothing). */
  tail: Uint8Array;
  /** The log holds records of another generation (left by a compaction that could not reset it): it is reset. */
  staleLog: boolean;
}

/**
 * Reads the snapshot and applies the records of its log generation.
 * @returns `null` when the snapshot file does not exist
 * @throws {FileCorruptError} when the snapshot is not one, or a log record is damaged (not the torn last one)
 */
async function readStore(file: string): Promise<StoreRead | null> {
  const bytes = await readFileBytes(file);
  if (bytes === null) return null;
  const { snap, logGen } = readSnapshotObject(file, bytes);
  const read: StoreRead = { snap, logGen, snapshotBytes: bytes.length, logEnd: 0, logSize: 0, tail: new Uint8Array(0), staleLog: false };
  if (logGen === 0) return read;
  const logFile = `${file}.log`;
  const log = await readFileBytes(logFile);
  if (log === null) return read;
  const scanned = scanLogRecords(logFile, log, LABEL);
  read.logEnd = scanned.end;
  read.logSize = log.length;
  read.tail = log.subarray(scanned.end);
  const inbox = new Replayed(snap.inbox as unknown[], "id");
  const outbox = new Replayed(snap.outbox as unknown[], "key");
  const damaged = (snap.damaged ?? []) as Record<string, unknown>[];
  let outboxSeq = snap.outboxSeq as number;
  scanned.records.forEach(({ offset, value }, n) => {
    const problem = checkLogRecord(value);
    if (problem !== null) throw new FileCorruptError(logFile, offset, `log record ${n + 1}: ${problem}`);
    const rec = value as LogRecord;
    if (rec.g !== logGen) {
      read.staleLog = true;
      return;
    }
    for (const item of rec.i ?? []) inbox.put(item);
    for (const id of rec.x ?? []) inbox.remove(id);
    for (const key of rec.d ?? []) outbox.remove(key);
    for (const item of rec.o ?? []) outbox.put(item);
    if (rec.s !== undefined && rec.s > outboxSeq) outboxSeq = rec.s;
    for (const report of rec.r ?? []) {
      const [journal, id] = Array.isArray(report) ? report : [];
      const found = damaged.find((d) => d?.journal === journal && d?.id === id);
      if (found !== undefined) found.reported = true;
    }
  });
  snap.inbox = inbox.result();
  snap.outbox = outbox.result();
  snap.outboxSeq = outboxSeq;
  return read;
}

/**
 * **For tests and tools.** The state a `FileDurability` file holds, as
 * `open()` reads it: the snapshot with the records of its log `<file>.log`
 * applied (a torn last record left out), not checked. The snapshot's own
 * fields (`format`, `version`, `log`) are as in the file.
 *
 * @param path the snapshot file (its real path: symlinks are not resolved here)
 * @returns the snapshot object (`inbox`, `outbox`, `outboxSeq`, `damaged`), or `null` when there is no file
 * @throws {FileCorruptError} when the snapshot is not one, or a log record is damaged
 */
export async function readFileDurabilityState(path: string): Promise<Record<string, unknown> | null> {
  return (await readStore(path))?.snap ?? null;
}

/** What the next write must be: the changes appended to the log, a compaction (new snapshot and log), or a snapshot without a log. */
type WriteKind = "append" | "compact" | "plain";

/**
 * How the state reaches the disk (the write of a {@link SnapshotCommitter},
 * which does the group commit): what changed since the last write is
 * appended to the log as one framed record; a compaction writes a new
 * snapshot naming a new log generation and empties the log.
 */
class FileLog {
  readonly #file: () => string;
  readonly #fsync: boolean;
  readonly #mode: () => number;
  readonly #stats = { lastSnapshotChars: 0, snapshots: 0, logAppends: 0, logBytes: 0 };
  /** The log generation the snapshot on disk names (`0`: none, the next write is a compaction). */
  #logGen = 0;
  #logBytes = 0;
  #snapshotBytes = 0;
  #log: AppendFile | null = null;
  /** The next write is a compaction (a purge, a stale log) or, set by {@link force}, this kind. */
  #forced: WriteKind | null = null;
  /** What changed since the last write was taken: inbox ids, outbox entries (`null`: removed), reports. */
  #inboxTouched = new Set<string>();
  #outboxTouched = new Map<string, OutboxEntry | null>();
  #outboxSeq = 0;
  #reports: [string, string][] = [];
  /** The state whose outbox changes are observed. */
  #observed: MemoryDurability | null = null;

  constructor(options: { file: () => string; fsync: boolean; mode: () => number }) {
    this.#file = options.file;
    this.#fsync = options.fsync;
    this.#mode = options.mode;
  }

  /** The counters of what was written. */
  get stats(): { lastSnapshotChars: number; snapshots: number; logAppends: number; logBytes: number } {
    return { ...this.#stats };
  }

  /** Whether the snapshot on disk has a log (the last write of `close()` ends it). */
  get hasLog(): boolean {
    return this.#logGen > 0;
  }

  /**
   * Takes a state loaded from the files: opens the log for appending and cuts
   * off a torn last record. `read` is `null` for a new file.
   */
  async attach(mem: MemoryDurability, read: StoreRead | null): Promise<void> {
    await this.close();
    this.#logGen = read?.logGen ?? 0;
    this.#logBytes = read?.logEnd ?? 0;
    this.#snapshotBytes = read?.snapshotBytes ?? 0;
    this.#forced = read?.staleLog ? "compact" : null;
    this.#inboxTouched = new Set();
    this.#outboxTouched = new Map();
    this.#reports = [];
    this.#outboxSeq = 0;
    if (read !== null && read.logGen > 0) {
      const log = await this.#openLog();
      try {
        if (read.logSize > read.logEnd) await log.truncate(read.logEnd, this.#fsync); // a torn last write
      } catch (error) {
        await log.close().catch(() => {});
        throw error;
      }
      this.#log = log;
    }
    this.#observed?.observeOutbox(null); // a state replaced after a failed write tells nothing more
    mem.observeOutbox((key, entry) => {
      this.#outboxTouched.set(key, entry);
      if (entry !== null && entry.seq > this.#outboxSeq) this.#outboxSeq = entry.seq;
    });
    this.#observed = mem;
  }

  /**
   * Copies the torn end of the log (what follows its last whole record) to a new file beside it,
   * `<file>.log.torn-<n>` (the first free `n`), flushed before the log is cut.
   * @returns the file written
   */
  setAsideTail(tail: Uint8Array): Promise<string> {
    return setAsideTornTail(`${this.#file()}.log`, tail, { fsync: this.#fsync, mode: this.#mode() });
  }

  /** Opens the log for appending; its directory entry is flushed (it may have just been created). */
  async #openLog(): Promise<AppendFile> {
    const file = this.#file();
    const log = await openAppendFile(`${file}.log`, this.#mode());
    try {
      if (this.#fsync) await syncDirectory(await dirName(file));
    } catch (error) {
      await log.close().catch(() => {});
      throw error;
    }
    return log;
  }

  /** Closes the log's handle (never throws). */
  async close(): Promise<void> {
    const log = this.#log;
    this.#log = null;
    await log?.close().catch(() => {});
  }

  /** An inbox record changed (written with the next write). */
  touchInbox(id: string): void {
    this.#inboxTouched.add(id);
  }

  /** A damaged record was reported. */
  reported(journal: string, id: string): void {
    this.#reports.push([journal, id]);
  }

  /** Records were removed in a way not tracked per record (a purge): the next write is a compaction. */
  compactNext(): void {
    if (this.#forced !== "plain") this.#forced = "compact";
  }

  /**
   * The next write is `kind`: `plain` (a snapshot without a log, readable by older versions: a new
   * file, and the last write of `close()`) or `compact` (records just set aside).
   */
  force(kind: "plain" | "compact"): void {
    this.#forced = kind;
  }

  /** One write: the changes since the last one appended to the log, or a whole snapshot. */
  async write(state: MemoryDurability): Promise<void> {
    const kind: WriteKind = this.#forced ??
      (this.#logGen === 0 || this.#log === null ||
          this.#logBytes >= Math.max(COMPACT_MIN_BYTES, COMPACT_FACTOR * this.#snapshotBytes)
        ? "compact"
        : "append");
    this.#forced = null;
    // Taken synchronously: the changes, and the records as they are now.
    const inboxIds = [...this.#inboxTouched];
    this.#inboxTouched.clear();
    const outbox = this.#outboxTouched;
    this.#outboxTouched = new Map();
    const reports = this.#reports.splice(0);
    const file = this.#file();
    await fileDurabilityTestHooks.beforeWrite?.({ kind, path: file });
    if (kind !== "append") {
      const logGen = kind === "compact" ? newLogGen(this.#logGen) : 0;
      const text = serializeSnapshot(state, logGen);
      await writeSnapshot(file, text, { fsync: this.#fsync, mode: this.#mode() });
      // The snapshot names the new generation: the old log's records are in it, and skipped if still there.
      this.#logGen = logGen;
      this.#logBytes = 0;
      this.#snapshotBytes = text.length;
      if (kind === "compact") {
        if (this.#log === null) {
          // The old log's content is obsolete: the file is replaced, not opened (a symlink planted at its
          // name is removed, never written through).
          await removeFile(`${file}.log`);
          this.#log = await this.#openLog();
        }
        await this.#log.truncate(0, this.#fsync);
      } else {
        await this.close();
        await removeFile(`${file}.log`);
      }
      this.#stats.snapshots++;
      this.#stats.lastSnapshotChars = text.length;
    } else {
      const images = await Promise.all(inboxIds.map((id) => state.inbox.get(id)));
      if (inboxIds.length === 0 && outbox.size === 0 && reports.length === 0) return;
      const record: LogRecord = { g: this.#logGen };
      const changedInbox: InboundRecord[] = [];
      const removedInbox: string[] = [];
      images.forEach((image, n) => image === null ? removedInbox.push(inboxIds[n]) : changedInbox.push(image));
      if (changedInbox.length > 0) record.i = changedInbox;
      if (removedInbox.length > 0) record.x = removedInbox;
      const entries: OutboxEntry[] = [];
      const removed: string[] = [];
      for (const [key, entry] of outbox) entry === null ? removed.push(key) : entries.push(entry);
      if (entries.length > 0) record.o = entries;
      if (removed.length > 0) record.d = removed;
      if (outbox.size > 0) record.s = this.#outboxSeq;
      if (reports.length > 0) record.r = reports;
      const bytes = frameLogRecord(JSON.stringify(record));
      const log = this.#log!;
      try {
        await log.append(bytes, this.#fsync);
      } catch (error) {
        // The record may be in the file though its flush failed: cut it off, so that the reload that
        // follows does not bring back what the callers are told was not written. Should that fail too,
        // the log is left for the next open to judge, and this instance rejects until reopened.
        try {
          await log.truncate(this.#logBytes, this.#fsync);
        } catch (cutError) {
          throw new LogUndecidedError(error, cutError);
        }
        throw error;
      }
      // An append to a deleted file (or directory) succeeds and keeps nothing.
      if (!(await log.linked())) throw new Error(`its log ${file}.log was deleted`);
      this.#logBytes += bytes.length;
      this.#stats.logAppends++;
    }
    this.#stats.logBytes = this.#logBytes;
  }
}
