/**
 * `@botmesh/durable/file`: a durability backend that keeps both journals in
 * one JSON snapshot file, for a bot that runs as one process.
 *
 * - The state lives in memory (a {@link MemoryDurability}); every change is
 *   made durable by rewriting the whole file: a temporary file `<path>.tmp`,
 *   `fsync`, an atomic rename over `<path>`, and an `fsync` of the directory.
 *   A reader (or a restart after a crash at any moment) sees the previous
 *   snapshot or the new one, never a mix.
 * - Group commit: operations that arrive while a rewrite is under way share
 *   the next one. Every operation, reads and no-op results included, resolves
 *   only once the state it observed is on disk.
 * - Memory never holds what was not written: after a failed rewrite every
 *   waiting operation rejects and the state is reloaded from the file (the
 *   last snapshot written).
 * - Lease heartbeats are kept in memory and written with the next change:
 *   only a restart of this process can take a lease, and a restart reclaims
 *   its own records at once (same `instanceId`). An `outbox.markCalling` is
 *   a change: it resolves once on disk, before the provider is called.
 * - A snapshot written before outbox entries had `called` (the call marker)
 *   is read with `called: true` for each of its entries (a call may have
 *   started: a lost send stays ambiguous); the next rewrite stores the field.
 * - A lock file `<path>.lock` (created atomically with its content, holding
 *   the pid and the hostname, its mtime refreshed while held) keeps a second
 *   process out; a second `FileDurability` on the same file in this process
 *   is rejected until the first is closed. Symlinks are resolved at `open()`:
 *   every path to one file shares one lock, and a symlink is never replaced.
 * - A file that is not a snapshot (broken JSON or UTF-8, a wrong top-level
 *   structure) is never overwritten: `open()` fails naming the file and the
 *   byte offset, and leaves the file untouched.
 * - A damaged record (a field of the wrong type, an unknown state, an id
 *   that appears twice…) does not stop the others: `open()` sets it aside.
 *   It is moved, exactly as it was, to the snapshot's `damaged` section with
 *   the problem, the time and whether a bot reported it (the file is
 *   rewritten at once), and left out of the journals: see
 *   {@link FileDurability}. A snapshot with a `damaged` section is format
 *   version 2, which older versions of this library refuse to open rather
 *   than drop it; one without is still version 1.
 * - Rewrites keep the file's permission bits; a new file gets `0o600` (the
 *   snapshot holds chat content).
 *
 * File I/O goes through the runtime shim (`src/runtime/fs.ts`), so the
 * backend runs on Bun, Node 20+ and Deno 2+ (Deno: `--allow-read
 * --allow-write --allow-run --allow-sys`: `--allow-run` to check the lock
 * holder's pid, `--allow-sys` to read the hostname written in the lock file;
 * without it Deno writes `localhost`, and a process of this host that sees
 * its real name there judges the lock by its age, as another host's).
 *
 * @module
 */
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
  type ReserveResult,
} from "../src/backend.ts";
import { MemoryDurability, type MemoryRecords, type SetAsideRecord } from "./memory.ts";
import { dirName, ensureDir, readFileBytes, realPathOf, removeFile, resolvePath } from "../src/runtime/fs.ts";
import { SnapshotCommitter } from "./group_commit.ts";
import {
  claimOpenFile,
  describeJsonKind as kindOf,
  FileCorruptError,
  FileLock,
  FileLockedError,
  fileStep,
  NEW_FILE_MODE,
  MIN_STALE_LOCK_MS,
  parseJsonBytes,
  releaseOpenFile,
  snapshotFileMode,
} from "./file_support.ts";
import { showValue as show } from "../src/show.ts";
import {
  storedCalled,
  storedInboundProblem as checkInbound,
  storedOutboxProblem as checkOutbound,
} from "../src/stored_records.ts";

export { FileCorruptError, FileLockedError };

/** Options of {@link FileDurability}. */
export interface FileDurabilityOptions {
  /**
   * The snapshot file, e.g. `./data/bot.json` (relative paths are resolved
   * against the current directory at `open()`, and symlinks to their target).
   * Its directory is created when missing. `<path>.lock` and `<path>.tmp`
   * live next to the real file. A new file is created with mode `0o600`;
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
}

/** The snapshot's format marker. */
const FORMAT = "@botmesh/durable/file";
/** The snapshot's format version: 2 when it has a `damaged` section, else 1 (which older versions also read). */
const VERSION = 2;
/** Default of {@link FileDurabilityOptions.staleLockMs}. */
const DEFAULT_STALE_LOCK_MS = 30_000;
/** The backend named in error messages. */
const LABEL = "FileDurability";
/** The backend's `name`. */
const NAME = "file";

/** One file-system step of `open()`/`close()`, its errors naming the file. */
function step<T>(file: string, what: string, run: () => Promise<T>): Promise<T> {
  return fileStep(LABEL, file, what, run);
}

/** Runs one operation on the open state and resolves once what it observed is on disk. */
type Run = <T>(operation: (mem: MemoryDurability) => Promise<T>, changed: (result: T) => boolean) => Promise<T>;

let testHooks: { crash(backend: FileDurability): Promise<void> } | undefined;

/**
 * A durability backend on one JSON snapshot file, for a bot that runs as one
 * process (`scope: "process"`). Every change rewrites the whole file
 * atomically (temporary file, `fsync`, rename, directory `fsync`);
 * concurrent operations share one rewrite (group commit). The cost of a
 * rewrite is one `JSON.stringify` of the whole state plus the write: keep the
 * journals small with `retention` (done and sent records are purged), or use
 * SQLite for large volumes.
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
    this.#commit = new SnapshotCommitter<MemoryDurability>({
      label: LABEL,
      file: () => this.file,
      fsync,
      mode: () => this.#mode,
      serialize: serializeSnapshot,
      parse: (file, bytes) => {
        const mem = this.#newMemory();
        mem.importRecords(parseSnapshot(file, bytes, this.#now).records);
        return mem;
      },
      current: () => this.#memory(),
      reloaded: "rebuilt",
      recovery: " until it is reopened: close it and open it again (stop and start the bot) once the file is usable.",
    });
    const run: Run = (operation, changed) => this.#commit.run(operation, changed);
    this.inbox = new FileInbox(run);
    this.outbox = new FileOutbox(run);
  }

  /** The lease clock's time (times records set aside). */
  #now = (): number => this.#clock ? this.#clock() : Date.now();

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
    return this.#commit.stats;
  }

  /**
   * Take the lock and load the file (a missing file starts empty and is
   * written at once). Counted: only the first call of a series loads; each
   * call needs a matching {@link close}.
   *
   * @throws {FileLockedError} when another process holds `<path>.lock`
   * @throws {FileCorruptError} when the file is not a snapshot (the file is
   *   left untouched); damaged records in a snapshot are set aside instead
   * @throws {Error} when the file is already open through another
   *   `FileDurability` of this process, or cannot be read or created (the
   *   message starts with `FileDurability: <file>:`, the runtime's error is its `cause`)
   */
  open(): Promise<void> {
    return this.#serial(() => this.#open());
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

  async #open(): Promise<void> {
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
      await step(file, `cannot remove the leftover ${file}.tmp`, () => removeFile(`${file}.tmp`));
      const bytes = await step(file, "cannot read it", () => readFileBytes(file));
      const mem = this.#newMemory();
      const loaded = bytes === null ? null : parseSnapshot(file, bytes, this.#now);
      if (loaded !== null) mem.importRecords(loaded.records);
      this.#commit.attach(mem);
      // A new file: written now, so that a bad path or permission shows at start. Records just set aside:
      // written now, so that they keep the time they were set aside.
      if (loaded === null || loaded.setAside > 0) await this.#commit.writeNow();
      this.#refs = 1;
    } catch (error) {
      this.#commit.detach();
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
        // Let operations already under way join, then write what is not on disk yet.
        await null;
        await this.#commit.flush();
      },
      async () => {
        try {
          await step(file, `cannot release the lock file ${file}.lock`, () => this.#releaseLock());
        } finally {
          releaseOpenFile(file, this);
        }
      },
    );
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
    return this.#run((m) => m.inbox.admit(record, lease), (r) => r !== null);
  }
  claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    return this.#run((m) => m.inbox.claim(id, options), (r) => r !== null);
  }
  claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    return this.#run((m) => m.inbox.claimDue(options), (r) => r.length > 0);
  }
  heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#run((m) => m.inbox.heartbeat(id, token, leaseMs), () => false); // written with the next change
  }
  complete(id: string, token: number): Promise<void> {
    return this.#run((m) => m.inbox.complete(id, token), () => true);
  }
  fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    return this.#run((m) => m.inbox.fail(id, token, outcome), () => true);
  }
  get(id: string): Promise<InboundRecord | null> {
    return this.#run((m) => m.inbox.get(id), () => false);
  }
  list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    return this.#run((m) => m.inbox.list(options), () => false);
  }
  replay(id: string): Promise<boolean> {
    return this.#run((m) => m.inbox.replay(id), (r) => r);
  }
  purge(olderThanMs: number): Promise<number> {
    return this.#run((m) => m.inbox.purge(olderThanMs), (n) => n > 0);
  }
  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#run((m) => m.inbox.damaged(options), () => false);
  }
  reportDamaged(id: string): Promise<boolean> {
    return this.#run((m) => m.inbox.reportDamaged(id), (r) => r);
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
    return this.#run((m) => m.outbox.claimDue(options), (r) => r.due.length > 0 || r.ambiguous.length > 0);
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
    return this.#run((m) => m.outbox.reportDamaged(key), (r) => r);
  }
}

// ---------------------------------------------------------------------------
// Writing, reading and checking a snapshot

/** The snapshot's text: `JSON.stringify` of the whole state. */
function serializeSnapshot(mem: MemoryDurability): string {
  const records = mem.exportRecords();
  const damaged = records.damaged ?? [];
  return JSON.stringify({
    format: FORMAT,
    version: damaged.length > 0 ? VERSION : 1,
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

/**
 * Parses and checks a snapshot: records that fail their checks are set aside
 * (at `now()`), the rest are loaded.
 * @throws {FileCorruptError} when the file is not a snapshot
 */
function parseSnapshot(file: string, bytes: Uint8Array, now: () => number): ParsedSnapshot {
  const value = parseJsonBytes(file, bytes, LABEL);
  const fail = (detail: string): never => {
    throw new FileCorruptError(file, null, detail);
  };
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    fail(`expected a JSON object, got ${kindOf(value)}`);
  }
  const snap = value as Record<string, unknown>;
  if (snap.format !== FORMAT) {
    fail(`not a FileDurability snapshot ("format" is ${show(snap.format)}, expected ${JSON.stringify(FORMAT)})`);
  }
  if (snap.version !== 1 && snap.version !== VERSION) {
    fail(`unsupported format version ${show(snap.version)} (this library reads versions 1 and ${VERSION})`);
  }
  if (!Number.isSafeInteger(snap.outboxSeq) || (snap.outboxSeq as number) < 0) {
    fail(`"outboxSeq" must be a non-negative integer, got ${show(snap.outboxSeq)}`);
  }
  if (!Array.isArray(snap.inbox)) fail(`"inbox" must be an array, got ${kindOf(snap.inbox)}`);
  if (!Array.isArray(snap.outbox)) fail(`"outbox" must be an array, got ${kindOf(snap.outbox)}`);
  const outboxSeq = snap.outboxSeq as number;
  const damaged = parseDamaged(snap.damaged, fail);
  const before = damaged.length;
  let at: number | undefined;
  const setAside = (journal: "inbox" | "outbox", id: string, problem: string, stored: unknown): void => {
    at ??= now();
    damaged.push({ journal, id, backend: NAME, problem, setAsideAt: at, reported: false, stored: stored as JsonValue });
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
