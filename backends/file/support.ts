/**
 * Internal building blocks of the file backends (`FileDurability`, and the
 * events journals `FileEventJournal` and `SharedFileEventJournal`): one
 * implementation of each piece, shared by all of them.
 *
 * - **The process lock** `<file>.lock` ({@link FileLock}, {@link FileLockedError}):
 *   one process at a time owns the file, for as long as it has it open.
 * - **The in-process registry of open files** ({@link claimOpenFile}): a second
 *   backend on the same file in the same process is refused, whatever its kind.
 * - **The snapshot write** ({@link writeSnapshot}): atomic replace that keeps the
 *   file's permission bits.
 * - **The snapshot read** ({@link readJsonSnapshot}, {@link parseJsonBytes}):
 *   JSON with the byte offset of the first encoding or syntax error
 *   ({@link FileCorruptError}).
 * - **The inter-process mutex** `<file>.mutex` ({@link FileMutex},
 *   {@link withFileMutex}): held for the few milliseconds of one write by one
 *   of several processes that share the file.
 * - **The framed append log** ({@link frameLogRecord}, {@link scanLogRecords}):
 *   records with a length and a CRC-32, a torn last one told from damage.
 * - {@link isLockHeldByLiveProcess}: whether a live process holds `<file>.lock`
 *   (a shared journal refuses such a file).
 *
 * These are not part of the public API: names and signatures may change in
 * any release. File I/O goes through the runtime shim (`src/runtime/fs.ts`).
 *
 * @module
 */
import { delay, hostname, randomId, unrefTimer } from "../../src/runtime/mod.ts";
import {
  createExclusive,
  createExclusiveLinked,
  currentPid,
  isProcessAlive,
  linkFile,
  listDirectory,
  readFileBytes,
  removeFile,
  renameFile,
  statFile,
  touchFile,
  writeFileAtomic,
} from "../../src/runtime/fs.ts";
import { showValue as show } from "../../src/show.ts";

/** Permission bits of a new snapshot file (`0o600`): it holds chat content. */
export const NEW_FILE_MODE: number = 0o600;
/** Default `staleLockMs` of the lock and the mutex: 30 s. */
export const DEFAULT_STALE_LOCK_MS: number = 30_000;
/** Longest interval between two refreshes of a held lock file's mtime. */
const LOCK_REFRESH_MS = 10_000;
/** An unreadable (empty or damaged) lock file counts as stale once unchanged this long. */
const UNREADABLE_LOCK_STALE_MS = 10_000;
/** A `.break` file (held for a few ms while a stale lock is broken) left by a crash is removed once this old. */
const BREAK_STALE_MS = 5_000;
/** Default {@link FileMutexOptions.timeoutMs}. */
const DEFAULT_MUTEX_TIMEOUT_MS = 10_000;
/**
 * Smallest `staleLockMs` accepted anywhere (`FileMutex`, `FileDurability`,
 * `FileEventJournal`, `SharedFileEventJournal`): an ordinary pause (GC, a
 * busy event loop) must not reach it.
 */
export const MIN_STALE_LOCK_MS: number = 1_000;
/** Longest pause between two attempts to take a busy mutex. */
const MUTEX_MAX_BACKOFF_MS = 20;

const decoder = new TextDecoder();

/**
 * The message of a thrown value.
 *
 * @param error what was thrown
 * @returns its message
 */
export function messageOf(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/**
 * Runs one file-system step of a backend's `open()`/`close()`; an error of the
 * runtime is wrapped to name the backend and the file (`cause` kept).
 *
 * @param label the backend named in the error (`FileDurability`)
 * @param file the file
 * @param what the step, e.g. `cannot read it`
 * @param run the step
 * @returns what `run` returns
 */
export async function fileStep<T>(label: string, file: string, what: string, run: () => Promise<T>): Promise<T> {
  try {
    return await run();
  } catch (error) {
    if (error instanceof Error && error.message.startsWith(label)) throw error;
    throw new Error(`${label}: ${file}: ${what}: ${messageOf(error)}`, { cause: error });
  }
}

function seconds(ms: number): string {
  return `${Math.max(0, Math.ceil(ms / 100) / 10)} s`;
}

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

/** Shared by every copy of this module in the process (a `globalThis` slot). */
function processGlobal<T>(key: string, create: () => T): T {
  return ((globalThis as Record<symbol, unknown>)[Symbol.for(key)] ??= create()) as T;
}

// ---------------------------------------------------------------------------
// Errors

/** What a lock file (or a mutex file) holds. */
export interface LockHolder {
  /** The holder's pid (on its host). */
  pid: number;
  /** The holder's hostname, if written. */
  hostname?: string;
  /** When the holder took it (ISO 8601), if written. */
  startedAt?: string;
  /** Random per lock taken: tells a holder from a previous process with the same pid. */
  nonce?: string;
}

/** The message of a {@link FileLockedError} (a function: Deno's API check wants one plain `super()` call). */
function lockedMessage(
  file: string,
  lockPath: string,
  holder: LockHolder | null,
  staleInMs: number | null,
  label: string,
): string {
  const wait = staleInMs === null ? "" : ` It counts as stale in ${seconds(staleInMs)} if it is not refreshed meanwhile.`;
  if (holder === null) {
    return `${label}: ${file} is locked: lock file ${lockPath} is unreadable (empty or damaged; its creator may ` +
      `be writing it).${wait} Delete the lock file only if no process uses the file.`;
  }
  const since = holder.startedAt ? `, since ${holder.startedAt}` : "";
  const host = holder.hostname ? ` on host ${holder.hostname}` : "";
  return `${label}: ${file} is in use by another process (pid ${holder.pid}${host}${since}); ` +
    `lock file ${lockPath}.${wait} Stop that process first; delete the lock file only if it is gone.`;
}

/**
 * Another process holds the lock file of a file backend: a live process on
 * this host, a process on another host whose lock file was refreshed less
 * than `staleLockMs` ago, or a lock file that is unreadable (being written,
 * or damaged) and changed less than 10 s ago.
 */
export class FileLockedError extends Error {
  /** The lock file (absolute path). */
  readonly lockPath: string;
  /** The pid written in the lock file (`0` when the lock file is unreadable). */
  readonly pid: number;
  /** The host written in the lock file, if any. */
  readonly hostname: string | undefined;
  /**
   * For a lock judged by its age (a holder on another host, or an unreadable
   * lock file): ms until it counts as stale unless it is refreshed; `null`
   * for a live process on this host.
   */
  readonly staleInMs: number | null;

  /**
   * @param file the locked file
   * @param lockPath its lock file
   * @param holder what the lock file says, or `null` when it is unreadable
   * @param staleInMs ms until the lock counts as stale, for a lock judged by its age
   * @param label the backend named at the start of the message (default `'FileDurability'`)
   */
  constructor(
    file: string,
    lockPath: string,
    holder: LockHolder | null,
    staleInMs: number | null = null,
    label: string = "FileDurability",
  ) {
    super(lockedMessage(file, lockPath, holder, staleInMs, label));
    this.name = "FileLockedError";
    this.lockPath = lockPath;
    this.pid = holder?.pid ?? 0;
    this.hostname = holder?.hostname;
    this.staleInMs = staleInMs === null ? null : Math.max(0, Math.ceil(staleInMs));
  }
}

/** The message of a {@link FileCorruptError}. */
function corruptMessage(file: string, offset: number | null, detail: string, label: string): string {
  const where = offset === null ? "" : ` at byte ${offset}`;
  return `${label}: ${file} is damaged${where}: ${detail}. The file was left untouched; ` +
    `restore it from a backup or move it away to start empty.`;
}

/** A snapshot file cannot be used: damaged JSON, invalid UTF-8, or an invalid structure. */
export class FileCorruptError extends Error {
  /** The snapshot file (absolute path). */
  readonly file: string;
  /** Byte offset of the first problem (syntax and encoding errors), or `null` for a structure error. */
  readonly offset: number | null;

  /**
   * @param file the snapshot file
   * @param offset the byte offset, or `null`
   * @param detail what is wrong
   * @param label the backend named at the start of the message (default `'FileDurability'`)
   */
  constructor(file: string, offset: number | null, detail: string, label: string = "FileDurability") {
    super(corruptMessage(file, offset, detail, label));
    this.name = "FileCorruptError";
    this.file = file;
    this.offset = offset;
  }
}

// ---------------------------------------------------------------------------
// The in-process registry of open files

/** Files open in this process (absolute real path → the backend that has it), shared by every copy of this module. */
const OPEN_FILES: Map<string, object> = processGlobal("@botmesh/durable/file:open-files", () => new Map<string, object>());
/** The kind of each registered backend (`'FileDurability'`, `'FileEventJournal'`, …), for messages. */
const OPEN_LABELS: WeakMap<object, string> = processGlobal(
  "@botmesh/durable/file:open-labels",
  () => new WeakMap<object, string>(),
);

/**
 * Register `owner` as the one backend of this process that has `file` open.
 * Every file backend (of any kind) registers its file at `open()`, so two
 * backends on one file in one process refuse each other. Registering the
 * same owner again does nothing.
 *
 * @param file the absolute real path (symlinks resolved) of the file
 * @param owner the backend opening it
 * @param label its kind, named in the error (`'FileDurability'`, `'FileEventJournal'`, …)
 * @throws {Error} when another backend of this process has `file` open; the
 *   message starts with `<label>: <file> is already open in this process`
 */
export function claimOpenFile(file: string, owner: object, label: string): void {
  const current = OPEN_FILES.get(file);
  if (current !== undefined && current !== owner) {
    const other = OPEN_LABELS.get(current) ?? "another backend";
    const through = other === label ? `another ${label}` : `a ${other}`;
    throw new Error(
      `${label}: ${file} is already open in this process through ${through}; close that one first` +
        (other === label ? " (or share one instance between your bots)" : ""),
    );
  }
  OPEN_FILES.set(file, owner);
  OPEN_LABELS.set(owner, label);
}

/**
 * Undo {@link claimOpenFile}: only when `owner` is the one registered for `file`.
 *
 * @param file the absolute real path given to {@link claimOpenFile}
 * @param owner the backend that registered it
 * @returns whether a registration was removed
 */
export function releaseOpenFile(file: string, owner: object): boolean {
  if (OPEN_FILES.get(file) !== owner) return false;
  OPEN_FILES.delete(file);
  return true;
}

/**
 * The backend of this process that has `file` open, if any.
 *
 * @param file an absolute real path
 * @returns the registered backend, or `undefined`
 */
export function openFileOwner(file: string): object | undefined {
  return OPEN_FILES.get(file);
}

// ---------------------------------------------------------------------------
// The process lock `<file>.lock`

/**
 * Nonces of the lock files this process holds (shared by every copy of this
 * module). A lock file with this process's pid whose nonce is not here is
 * stale (a previous process that had the same pid); one whose nonce is here is
 * held through another spelling of the path (a symlink).
 */
const HELD_LOCKS: Set<string> = processGlobal("@botmesh/durable/file:held-locks", () => new Set<string>());

/** A lock (or mutex) file as read: its bytes and its mtime. */
interface SeenLock {
  bytes: Uint8Array;
  mtimeMs: number;
}

async function readLock(lockPath: string): Promise<SeenLock | null> {
  const stat = await statFile(lockPath);
  if (stat === null) return null;
  const bytes = await readFileBytes(lockPath);
  return bytes === null ? null : { bytes, mtimeMs: stat.mtimeMs };
}

/**
 * Parse the content of a lock or mutex file.
 *
 * @param text the file's text
 * @returns the holder, or `null` when it is not a JSON object with an integer `pid`
 */
export function parseLockHolder(text: string): LockHolder | null {
  try {
    const value = JSON.parse(text) as (Partial<LockHolder> & { acquiredAt?: unknown }) | null;
    if (typeof value !== "object" || value === null || !Number.isInteger(value.pid)) return null;
    return {
      pid: value.pid!,
      hostname: typeof value.hostname === "string" ? value.hostname : undefined,
      startedAt: typeof value.startedAt === "string"
        ? value.startedAt
        : typeof value.acquiredAt === "string"
        ? value.acquiredAt
        : undefined,
      nonce: typeof value.nonce === "string" ? value.nonce : undefined,
    };
  } catch {
    return null;
  }
}

/** Options of {@link FileLock.acquire}. */
export interface FileLockOptions {
  /**
   * How long, in ms, a lock file written by a process on another host must go
   * without a refresh before it counts as stale and is broken (default
   * `30000`). A live holder refreshes its lock file's mtime every
   * `min(10 s, staleLockMs / 3)`. Not validated here: the backend validates
   * its own option.
   */
  staleLockMs?: number;
  /** The backend named in error messages (default `'FileDurability'`). */
  label?: string;
}

/**
 * The pid lock file `<file>.lock` of a single-process file backend, held
 * while the backend is open.
 *
 * The lock file holds the pid, the hostname and a random nonce; it is
 * created atomically with its content (written to a temporary file, then
 * hard-linked into place), and its holder refreshes its mtime every
 * `min(10 s, staleLockMs / 3)` (an unref'd timer). A lock is stale when:
 * - it names this host (or no host) and its pid is dead, or it holds this
 *   process's own pid with a nonce this process does not hold (e.g. pid 1 in
 *   a restarted container): broken at once;
 * - it names another host (a container on a shared volume: its pid means
 *   nothing here) and its mtime is older than `staleLockMs`;
 * - it is unreadable (empty or damaged) and its mtime is older than 10 s.
 *
 * Processes breaking a stale lock at the same time are serialized by a
 * short-lived `<file>.lock.break` file (`O_EXCL`; one left by a crash is
 * removed after 5 s): the lock is re-read under it and deleted only if
 * unchanged, then taken with `O_EXCL` as usual and checked by its nonce; so
 * exactly one of them gets it.
 */
export class FileLock {
  /** The locked file, as given. */
  readonly file: string;
  /** `<file>.lock`. */
  readonly lockPath: string;
  /** The nonce written in the lock file. */
  readonly nonce: string;
  #held = true;
  #timer: ReturnType<typeof setInterval> | null = null;

  private constructor(file: string, nonce: string, refreshMs: number) {
    this.file = file;
    this.lockPath = `${file}.lock`;
    this.nonce = nonce;
    const timer = setInterval(() => {
      if (!this.#held) return;
      void (async () => {
        const bytes = await readFileBytes(this.lockPath);
        if (bytes !== null && parseLockHolder(decoder.decode(bytes))?.nonce === nonce) await touchFile(this.lockPath);
      })().catch(() => {}); // best effort: the next tick tries again
    }, refreshMs);
    unrefTimer(timer);
    this.#timer = timer;
  }

  /**
   * Take `<file>.lock` (breaking a stale one) and start refreshing its mtime.
   *
   * @param file the absolute real path of the file to lock
   * @param options `staleLockMs` (default `30000`) and `label`
   * @returns the held lock
   * @throws {FileLockedError} when another process holds it
   * @throws {Error} when this process holds it through another path (`<label>: <file> is already open in this
   *   process …`), when a holder's pid cannot be checked (Deno without `--allow-run`), or on a file-system error
   */
  static async acquire(file: string, options: FileLockOptions = {}): Promise<FileLock> {
    const staleLockMs = options.staleLockMs ?? DEFAULT_STALE_LOCK_MS;
    const label = options.label ?? "FileDurability";
    const nonce = await acquireLock(file, staleLockMs, label);
    return new FileLock(file, nonce, Math.min(LOCK_REFRESH_MS, staleLockMs / 3));
  }

  /** Whether this lock is still held (neither released nor abandoned). */
  get held(): boolean {
    return this.#held;
  }

  /**
   * Stop refreshing and delete the lock file, only if it is still ours (never
   * one that someone else took after deleting ours by hand). Calling it again
   * does nothing.
   *
   * @throws {Error} when the lock file cannot be read or deleted
   */
  async release(): Promise<void> {
    if (!this.#held) return;
    this.#stop();
    const bytes = await readFileBytes(this.lockPath);
    if (bytes !== null && parseLockHolder(decoder.decode(bytes))?.nonce === this.nonce) await removeFile(this.lockPath);
  }

  /**
   * Let the lock go as a killed process would: stop refreshing and forget it,
   * leaving the lock file in place (the next opener breaks it, as after a
   * restart). For crash simulations.
   */
  abandon(): void {
    if (this.#held) this.#stop();
  }

  #stop(): void {
    this.#held = false;
    HELD_LOCKS.delete(this.nonce);
    if (this.#timer !== null) clearInterval(this.#timer);
    this.#timer = null;
  }
}

/**
 * Takes `<file>.lock` and returns the nonce written in it. The lock file is
 * created atomically with its content (a temporary file hard-linked into
 * place, `O_EXCL` semantics), then re-read to check that it holds our nonce.
 * A stale lock (see {@link FileLock}) is broken under `<file>.lock.break`.
 */
async function acquireLock(file: string, staleLockMs: number, label: string): Promise<string> {
  const lockPath = `${file}.lock`;
  const pid = await currentPid();
  const host = await hostname();
  const nonce = randomId();
  const mine = JSON.stringify({ pid, hostname: host, startedAt: new Date().toISOString(), nonce });
  let unreadable = 0;
  for (let attempt = 0; attempt < 100; attempt++) {
    if (await createExclusiveLinked(lockPath, mine, `${lockPath}.${nonce}.tmp`)) {
      // Ours unless another process deleted it meanwhile (only possible after a crash while breaking, or by hand).
      const check = await readFileBytes(lockPath);
      if (check !== null && parseLockHolder(decoder.decode(check))?.nonce === nonce) {
        HELD_LOCKS.add(nonce);
        return nonce;
      }
      continue;
    }
    const seen = await readLock(lockPath);
    if (seen === null) continue; // released meanwhile
    const holder = parseLockHolder(decoder.decode(seen.bytes));
    const age = Date.now() - seen.mtimeMs;
    if (holder === null) {
      // Our lock files have their content from creation; an unreadable one is being written by another
      // library version or file system without hard links, or was damaged: stale only once unchanged 10 s.
      if (age < UNREADABLE_LOCK_STALE_MS) {
        if (++unreadable <= 3) {
          await delay(50);
          continue;
        }
        throw new FileLockedError(file, lockPath, null, UNREADABLE_LOCK_STALE_MS - age, label);
      }
    } else if (holder.hostname !== undefined && holder.hostname !== host) {
      // Another host (a container on a shared volume): its pid means nothing here; a live holder refreshes the mtime.
      if (age < staleLockMs) throw new FileLockedError(file, lockPath, holder, staleLockMs - age, label);
    } else if (holder.pid === pid) {
      if (holder.nonce !== undefined && HELD_LOCKS.has(holder.nonce)) {
        throw new Error(
          `${label}: ${file} is already open in this process (through another path to the same file); ` +
            `close that one first (lock file ${lockPath})`,
        );
      }
    } else if (await holderAlive(lockPath, holder.pid, label)) {
      throw new FileLockedError(file, lockPath, holder, null, label);
    }
    if (!(await breakStale(lockPath, seen, BREAK_STALE_MS))) await delay(2 + Math.random() * 10); // another process is breaking it
  }
  throw new Error(`${label}: could not take the lock file ${lockPath} (it keeps changing)`);
}

/**
 * Deletes the stale lock file `seen`, unless it changed since (another
 * process broke it and took the lock meanwhile), under `<lock>.break`
 * (`O_EXCL`), so that processes breaking one stale lock at the same time do
 * it one after the other. Returns `false` when another process holds
 * `<lock>.break` (one left by a crash is removed once older than
 * `breakStaleMs`).
 *
 * The stale file is first renamed to a name of our own and checked there:
 * when it is not the one judged stale (a breaker paused between its check
 * and its delete, while others broke and retook the lock), it is linked back
 * in place instead of being deleted.
 */
async function breakStale(lockPath: string, seen: SeenLock, breakStaleMs: number): Promise<boolean> {
  const breakPath = `${lockPath}.break`;
  const token = randomId();
  if (!(await createExclusive(breakPath, token))) {
    const text = await readFileBytes(breakPath);
    const stat = await statFile(breakPath);
    if (text !== null && stat !== null && Date.now() - stat.mtimeMs > breakStaleMs) {
      const again = await readFileBytes(breakPath);
      if (again !== null && sameBytes(again, text)) await removeFile(breakPath);
    }
    return false;
  }
  try {
    const now = await readLock(lockPath);
    if (now !== null && sameBytes(now.bytes, seen.bytes) && now.mtimeMs === seen.mtimeMs) {
      const aside = `${lockPath}.${token}.stale`;
      if (await renameFile(lockPath, aside)) {
        try {
          const moved = await readLock(aside);
          if (moved !== null && !(sameBytes(moved.bytes, seen.bytes) && moved.mtimeMs === seen.mtimeMs)) {
            await linkFile(aside, lockPath); // not the stale one: put it back (unless the path was taken again)
          }
        } finally {
          await removeFile(aside).catch(() => {});
        }
      }
    }
  } finally {
    const mine = await readFileBytes(breakPath).catch(() => null);
    if (mine !== null && decoder.decode(mine) === token) await removeFile(breakPath).catch(() => {});
  }
  return true;
}

/** Whether the lock's holder runs; a runtime that cannot tell gets a clear error instead of a guess. */
async function holderAlive(lockPath: string, pid: number, label: string): Promise<boolean> {
  try {
    return await isProcessAlive(pid);
  } catch (error) {
    throw new Error(
      `${label}: cannot tell whether pid ${pid}, the holder of lock file ${lockPath}, is still running ` +
        `(${messageOf(error)}). On Deno, grant --allow-run; or delete the lock file if that process is gone.`,
      { cause: error },
    );
  }
}

/**
 * The holder of `<file>.lock` when that lock is live: held by a live
 * process of this host (this process included), by a process of another
 * host that refreshed it less than `staleLockMs` ago, or unreadable and
 * changed less than 10 s ago (then a holder with pid `0`). A lock the next
 * {@link FileLock.acquire} would break counts as not held.
 *
 * @param file the locked file (absolute real path)
 * @param options `staleLockMs` (default `30000`) and `label` (named in errors)
 * @returns the live holder, or `null` when there is no lock file or it is stale
 * @throws {Error} when a holder's pid cannot be checked (Deno without
 *   `--allow-run`), or the lock file cannot be read
 */
export async function findLiveLockHolder(file: string, options: FileLockOptions = {}): Promise<LockHolder | null> {
  const lockPath = `${file}.lock`;
  const staleLockMs = options.staleLockMs ?? DEFAULT_STALE_LOCK_MS;
  const seen = await readLock(lockPath);
  if (seen === null) return null;
  const holder = parseLockHolder(decoder.decode(seen.bytes));
  const age = Date.now() - seen.mtimeMs;
  if (holder === null) return age < UNREADABLE_LOCK_STALE_MS ? { pid: 0 } : null;
  const host = await hostname();
  if (holder.hostname !== undefined && holder.hostname !== host) return age < staleLockMs ? holder : null;
  if (holder.pid === (await currentPid())) {
    return holder.nonce !== undefined && HELD_LOCKS.has(holder.nonce) ? holder : null;
  }
  return (await holderAlive(lockPath, holder.pid, options.label ?? "FileDurability")) ? holder : null;
}

/**
 * Whether a live process (this one included) holds the single-process lock
 * `<file>.lock` (see {@link findLiveLockHolder}). A shared journal checks it
 * to refuse a file that a locked single-process backend has open.
 *
 * @param file the file (absolute real path)
 * @param options `staleLockMs` (default `30000`), for a holder on another host
 * @returns `true` when the lock is live
 * @throws {Error} when a holder's pid cannot be checked, or the lock file cannot be read
 */
export async function isLockHeldByLiveProcess(file: string, options: FileLockOptions = {}): Promise<boolean> {
  return (await findLiveLockHolder(file, options)) !== null;
}

// ---------------------------------------------------------------------------
// Writing and reading a snapshot

/** Options of {@link writeSnapshot}. */
export interface SnapshotWriteOptions {
  /** Flush the file and its directory before resolving (default `true`). */
  fsync?: boolean;
  /**
   * Permission bits to give the file. Default: the current file's (read with
   * a `stat`), or {@link NEW_FILE_MODE} for a new file. A backend that knows
   * them from `open()` passes them and saves the `stat`.
   */
  mode?: number;
  /** The temporary file (default `<file>.tmp`; same directory). */
  tempPath?: string;
}

/**
 * Replace a snapshot file atomically: write `text` to `<file>.tmp`, `fsync`,
 * rename it over `file`, `fsync` the directory. A reader, or a restart after
 * a crash at any moment, sees the previous content or the new one, never a
 * mix. The permission bits are kept (a new file gets `0o600`); they are set
 * on the temporary file before the rename, so the file never exists with
 * wider ones. On an error `file` is left as it was.
 *
 * @param file the snapshot file (its real path: a symlink would be replaced)
 * @param text the new content
 * @param options `fsync` (default `true`), `mode` and `tempPath`
 * @throws {Error} the runtime's error (`ENOSPC`, `EACCES`, …)
 */
export async function writeSnapshot(file: string, text: string | Uint8Array, options: SnapshotWriteOptions = {}): Promise<void> {
  const mode = options.mode ?? (await statFile(file))?.mode ?? NEW_FILE_MODE;
  await writeFileAtomic(file, text, { fsync: options.fsync ?? true, mode, tempPath: options.tempPath });
}

/**
 * The permission bits a snapshot rewrite should keep: the file's, or
 * {@link NEW_FILE_MODE} when it does not exist yet.
 *
 * @param file the snapshot file
 * @param label the backend named in the error (default `'FileDurability'`)
 * @returns the mode and whether the file exists
 * @throws {Error} when `file` is a directory (`<label>: <file>: is a directory; …`), or cannot be read
 */
export async function snapshotFileMode(
  file: string,
  label: string = "FileDurability",
): Promise<{ mode: number; exists: boolean }> {
  const stat = await statFile(file);
  if (stat?.isDirectory) throw new Error(`${label}: ${file}: is a directory; the option "path" must name a file`);
  return { mode: stat?.mode ?? NEW_FILE_MODE, exists: stat !== null };
}

/**
 * Parse a snapshot's bytes as UTF-8 JSON (a leading BOM is accepted by the
 * checker). On failure the checker locates the first problem.
 *
 * @param file the file the bytes come from (named in the error)
 * @param bytes its content
 * @param label the backend named in the error (default `'FileDurability'`)
 * @returns the parsed value
 * @throws {FileCorruptError} with the byte offset of the first encoding or syntax error
 */
export function parseJsonBytes(file: string, bytes: Uint8Array, label: string = "FileDurability"): unknown {
  try {
    return JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes));
  } catch {
    const problem = findJsonSyntaxError(bytes) ??
      { offset: null, reason: "the JSON parser rejected it (no syntax error found by the checker)" };
    throw new FileCorruptError(file, problem.offset, problem.reason, label);
  }
}

/**
 * Read a snapshot file and parse it as JSON ({@link parseJsonBytes}).
 *
 * @param file the snapshot file
 * @param label the backend named in the error (default `'FileDurability'`)
 * @returns the parsed value and the bytes, or `null` when the file does not exist
 * @throws {FileCorruptError} when it is not valid UTF-8 JSON (byte offset given)
 * @throws {Error} a read error of the runtime
 */
export async function readJsonSnapshot(
  file: string,
  label: string = "FileDurability",
): Promise<{ value: unknown; bytes: Uint8Array } | null> {
  const bytes = await readFileBytes(file);
  if (bytes === null) return null;
  return { value: parseJsonBytes(file, bytes, label), bytes };
}

export { describeJsonKind } from "../../src/stored_records.ts";

// ---------------------------------------------------------------------------
// The inter-process mutex `<file>.mutex`

/** Options of {@link FileMutex} and {@link withFileMutex}. */
export interface FileMutexOptions {
  /**
   * How long, in ms, {@link FileMutex.acquire} waits for a busy mutex before
   * it rejects with a {@link FileMutexTimeoutError} (default `10000`; `0`:
   * one attempt; `Infinity`: no limit).
   */
  timeoutMs?: number;
  /**
   * How long, in ms, a mutex may go without a refresh of its mtime before it
   * is taken as abandoned (a stuck holder, e.g. `SIGSTOP`) and broken
   * (default `30000`, at least `100`). A mutex of a dead pid of this host is
   * broken at once. Use the same value in every process.
   */
  staleLockMs?: number;
  /**
   * How often, in ms, a holder refreshes its mutex's mtime while it holds it
   * (default a third of `staleLockMs`; above `0`, below `staleLockMs`).
   */
  heartbeatMs?: number;
  /** The component named at the start of error messages (default `'FileMutex'`). */
  label?: string;
}

/** {@link FileMutex.acquire} waited `timeoutMs` and the mutex stayed busy. */
export class FileMutexTimeoutError extends Error {
  /** The mutex file. */
  readonly mutexPath: string;
  /** Its last holder seen (`null` when its content was unreadable). */
  readonly holder: LockHolder | null;
  /** How long it waited, in ms. */
  readonly waitedMs: number;

  /**
   * @param mutexPath the mutex file
   * @param holder its last holder seen, or `null`
   * @param waitedMs how long it waited
   * @param label the component named at the start of the message
   */
  constructor(mutexPath: string, holder: LockHolder | null, waitedMs: number, label: string = "FileMutex") {
    super(mutexTimeoutMessage(mutexPath, holder, waitedMs, label));
    this.name = "FileMutexTimeoutError";
    this.mutexPath = mutexPath;
    this.holder = holder;
    this.waitedMs = waitedMs;
  }
}

function mutexTimeoutMessage(mutexPath: string, holder: LockHolder | null, waitedMs: number, label: string): string {
  const who = holder === null
    ? "an unreadable holder"
    : `pid ${holder.pid}${holder.hostname ? ` on host ${holder.hostname}` : ""}${
      holder.startedAt ? `, since ${holder.startedAt}` : ""
    }`;
  return `${label}: timed out after ${Math.round(waitedMs)} ms waiting for the mutex ${mutexPath}, held by ${who}. ` +
    `A live holder keeps it only for one write; a stuck one is broken once its mutex is not refreshed for staleLockMs.`;
}

/** A held mutex was broken by another process (its holder was taken as abandoned). */
export class FileMutexLostError extends Error {
  /** The mutex file. */
  readonly mutexPath: string;

  /**
   * @param mutexPath the mutex file
   * @param label the component named at the start of the message
   */
  constructor(mutexPath: string, label: string = "FileMutex") {
    super(
      `${label}: the mutex ${mutexPath} is no longer held by this process: it was taken as abandoned ` +
        `(not refreshed for staleLockMs: the process was stopped or its event loop blocked) and broken`,
    );
    this.name = "FileMutexLostError";
    this.mutexPath = mutexPath;
  }
}

/** A held {@link FileMutex}: returned by {@link FileMutex.acquire}. */
export interface FileMutexHandle {
  /** The mutex file `<file>.mutex`. */
  readonly mutexPath: string;
  /** The nonce written in the mutex file. */
  readonly nonce: string;
  /** When it was taken (`Date.now()`). */
  readonly acquiredAt: number;
  /** Whether a heartbeat found another holder's mutex in place of ours (it was broken); never reset. */
  readonly lost: boolean;
  /** Whether {@link release} was called. */
  readonly released: boolean;
  /**
   * Whether the mutex file is still ours (reads it). Check it right before a
   * commit that must not happen without the mutex (e.g. the rename of a
   * snapshot): a holder stuck past `staleLockMs` has lost it.
   *
   * @returns `true` when the mutex file holds our nonce
   */
  stillHeld(): Promise<boolean>;
  /**
   * Like {@link stillHeld}, but throws.
   *
   * @throws {FileMutexLostError} when it is not ours any more
   */
  assertHeld(): Promise<void>;
  /**
   * Stop the heartbeat and remove the mutex file, only if it is still ours.
   * Calling it again does nothing (returns `false`).
   *
   * @returns `true` when our mutex file was removed, `false` when it was not ours any more (broken) or already released
   * @throws {Error} a file-system error (the heartbeat is stopped all the same)
   */
  release(): Promise<boolean>;
}

/** Nonces of the mutexes this process holds (shared by every copy of this module): an in-process holder is waited for, never broken. */
const HELD_MUTEXES: Set<string> = processGlobal("@botmesh/durable/file:held-mutexes", () => new Set<string>());

function checkOptionNumber(label: string, name: string, value: unknown): number {
  if (typeof value !== "number" || Number.isNaN(value)) {
    throw new TypeError(`${label} option "${name}" must be a number of milliseconds, got ${show(value)}`);
  }
  return value;
}

/**
 * An inter-process mutex on `<file>.mutex`, for several processes of one
 * host that write one file (e.g. `SharedFileEventJournal`): take it around
 * each read-modify-write of the file, for as short as possible.
 *
 * - The mutex file is created atomically with its content (pid, hostname,
 *   nonce, time; a temporary file hard-linked into place: `O_EXCL`
 *   semantics) and re-read to check that it holds our nonce.
 * - A busy mutex is polled with a small backoff (1–20 ms, with jitter) until
 *   `timeoutMs`; then {@link FileMutexTimeoutError} names the mutex file and
 *   its holder.
 * - A mutex of a dead pid on this host (or of this process's pid with a
 *   nonce this process does not hold: a previous process with the same pid)
 *   is broken at once.
 * - The holder refreshes the mutex's mtime every `heartbeatMs` (an unref'd
 *   timer) while it holds it; a mutex whose mtime is older than
 *   `staleLockMs` is taken as abandoned (a stuck holder, e.g. `SIGSTOP`, or a
 *   holder on another host) and broken. A mutex held in this process is never
 *   broken. Nothing is ever killed. A holder whose event loop is blocked for
 *   `staleLockMs` cannot refresh and loses it: check
 *   {@link FileMutexHandle.assertHeld} before committing.
 * - Breaking is serialized by `<file>.mutex.break` (`O_EXCL`, held for a few
 *   ms; one left by a crash is removed after `min(5 s, staleLockMs)`): the
 *   mutex is re-read under it and removed only if unchanged (same bytes, same
 *   mtime), then taken with `O_EXCL` as usual; so two breakers never both win.
 * - {@link FileMutexHandle.release} removes the mutex only if it is still ours.
 *
 * Needs a file system with hard links or `O_EXCL` (local disks; NFSv3+), and
 * on Deno `--allow-run` to check pids (without it, a holder is judged by its
 * mtime only).
 *
 * @example
 * ```ts ignore
 * const mutex = new FileMutex("/data/journal.json", { staleLockMs: 30_000 });
 * const held = await mutex.acquire();
 * try {
 *   // read, change and rewrite /data/journal.json
 *   await held.assertHeld();
 * } finally {
 *   await held.release();
 * }
 * ```
 */
export class FileMutex {
  /** The file the mutex guards, as given. */
  readonly file: string;
  /** `<file>.mutex`. */
  readonly mutexPath: string;
  /** See {@link FileMutexOptions.timeoutMs}. */
  readonly timeoutMs: number;
  /** See {@link FileMutexOptions.staleLockMs}. */
  readonly staleLockMs: number;
  /** See {@link FileMutexOptions.heartbeatMs}. */
  readonly heartbeatMs: number;
  /** See {@link FileMutexOptions.label}. */
  readonly label: string;

  /**
   * @param file the file the mutex guards (use the same absolute path in every process)
   * @param options `timeoutMs` (default `10000`), `staleLockMs` (default `30000`),
   *   `heartbeatMs` (default `staleLockMs / 3`) and `label`
   * @throws {TypeError} when `file` is not a non-empty string, `options` is not an object, or an option has the
   *   wrong type (the message names it)
   * @throws {RangeError} when an option is out of range: `timeoutMs` below 0, `staleLockMs` not finite or below
   *   1000, `heartbeatMs` not finite, not above 0 or not below `staleLockMs` (the message names it)
   */
  constructor(file: string, options: FileMutexOptions = {}) {
    if (typeof options !== "object" || options === null || Array.isArray(options)) {
      throw new TypeError(`FileMutex options must be an object, got ${show(options)}`);
    }
    const rawLabel = options.label ?? "FileMutex";
    if (typeof rawLabel !== "string" || rawLabel.length === 0) {
      throw new TypeError(`FileMutex option "label" must be a non-empty string, got ${show(rawLabel)}`);
    }
    const label = rawLabel;
    if (typeof file !== "string" || file.length === 0 || file.includes("\0")) {
      throw new TypeError(`${label}: the mutex's file must be a non-empty path without NUL, got ${show(file)}`);
    }
    const timeoutMs = checkOptionNumber(label, "timeoutMs", options.timeoutMs ?? DEFAULT_MUTEX_TIMEOUT_MS);
    if (timeoutMs < 0) {
      throw new RangeError(`${label} option "timeoutMs" must be at least 0 (or Infinity), got ${show(timeoutMs)}`);
    }
    const staleLockMs = checkOptionNumber(label, "staleLockMs", options.staleLockMs ?? DEFAULT_STALE_LOCK_MS);
    if (!Number.isFinite(staleLockMs) || staleLockMs < MIN_STALE_LOCK_MS) {
      throw new RangeError(
        `${label} option "staleLockMs" must be a finite number of milliseconds, at least ${MIN_STALE_LOCK_MS}, ` +
          `got ${show(staleLockMs)}`,
      );
    }
    const heartbeatMs = checkOptionNumber(label, "heartbeatMs", options.heartbeatMs ?? staleLockMs / 3);
    if (!Number.isFinite(heartbeatMs) || heartbeatMs <= 0 || heartbeatMs >= staleLockMs) {
      throw new RangeError(
        `${label} option "heartbeatMs" must be a finite number of milliseconds above 0 and below "staleLockMs" ` +
          `(${staleLockMs}), got ${show(heartbeatMs)}`,
      );
    }
    this.file = file;
    this.mutexPath = `${file}.mutex`;
    this.timeoutMs = timeoutMs;
    this.staleLockMs = staleLockMs;
    this.heartbeatMs = heartbeatMs;
    this.label = label;
  }

  /**
   * Take the mutex: wait while it is held (breaking it when its holder is
   * dead or stuck), then create it and start its heartbeat.
   *
   * @returns the held mutex; call {@link FileMutexHandle.release} in a `finally`
   * @throws {FileMutexTimeoutError} when it stayed busy for `timeoutMs`
   * @throws {Error} a file-system error (the directory is missing, permissions)
   */
  async acquire(): Promise<FileMutexHandle> {
    const path = this.mutexPath;
    const started = Date.now();
    const deadline = started + this.timeoutMs;
    const pid = await currentPid();
    const host = await hostname();
    const nonce = randomId();
    const mine = JSON.stringify({ pid, hostname: host, startedAt: new Date().toISOString(), nonce });
    // Registered before the file exists: another acquirer of this process that reads it must not break it.
    HELD_MUTEXES.add(nonce);
    let holder: LockHolder | null = null;
    try {
      for (let attempt = 0;; attempt++) {
        if (await createExclusiveLinked(path, mine, `${path}.${nonce}.tmp`)) {
          const check = await readFileBytes(path);
          if (check !== null && parseLockHolder(decoder.decode(check))?.nonce === nonce) {
            return new HeldMutex(this, nonce);
          }
          continue; // removed by a breaker in between (only after a pause longer than staleLockMs): try again
        }
        const seen = await readLock(path);
        if (seen !== null) {
          holder = parseLockHolder(decoder.decode(seen.bytes));
          if (await this.#abandoned(holder, seen, pid, host)) {
            if (await breakStale(path, seen, Math.min(BREAK_STALE_MS, this.staleLockMs))) continue;
          }
        } else {
          continue; // released meanwhile
        }
        const now = Date.now();
        if (now >= deadline) throw new FileMutexTimeoutError(path, holder, now - started, this.label);
        const base = Math.min(MUTEX_MAX_BACKOFF_MS, 2 ** Math.min(attempt, 5));
        await delay(Math.min(deadline - now, Math.max(1, base * (0.5 + Math.random() / 2))));
      }
    } catch (error) {
      HELD_MUTEXES.delete(nonce);
      throw error;
    }
  }

  /**
   * Run `fn` while holding the mutex, and release it after (also when `fn`
   * throws).
   *
   * @param fn the work; gets the held mutex (e.g. to {@link FileMutexHandle.assertHeld} before a commit)
   * @returns what `fn` returns
   * @throws {FileMutexTimeoutError} when the mutex stayed busy for `timeoutMs`
   * @throws what `fn` throws; else a release error (then `fn` did run to its end)
   */
  async run<T>(fn: (held: FileMutexHandle) => T | Promise<T>): Promise<T> {
    const held = await this.acquire();
    let result: T;
    try {
      result = await fn(held);
    } catch (error) {
      await held.release().catch(() => {});
      throw error;
    }
    await held.release();
    return result;
  }

  /** Whether the holder seen is gone or stuck: dead pid of this host, a previous process's pid, or no refresh for staleLockMs. */
  async #abandoned(holder: LockHolder | null, seen: SeenLock, pid: number, host: string): Promise<boolean> {
    if (holder?.nonce !== undefined && HELD_MUTEXES.has(holder.nonce)) return false; // this process: wait
    const sameHost = holder !== null && (holder.hostname === undefined || holder.hostname === host);
    if (sameHost) {
      if (holder!.pid === pid) return true; // our pid, a nonce we do not hold: a previous process with this pid
      let alive = true;
      try {
        alive = await isProcessAlive(holder!.pid);
      } catch {
        // Cannot tell (Deno without --allow-run): judge by the mtime only.
      }
      if (!alive) return true;
    }
    return Date.now() - seen.mtimeMs > this.staleLockMs;
  }
}

/** The {@link FileMutexHandle} of {@link FileMutex.acquire}. */
class HeldMutex implements FileMutexHandle {
  readonly mutexPath: string;
  readonly nonce: string;
  readonly acquiredAt: number = Date.now();
  readonly #label: string;
  #lost = false;
  #released = false;
  #timer: ReturnType<typeof setInterval> | null;

  constructor(mutex: FileMutex, nonce: string) {
    this.mutexPath = mutex.mutexPath;
    this.nonce = nonce;
    this.#label = mutex.label;
    this.#timer = setInterval(() => void this.#beat().catch(() => {}), mutex.heartbeatMs);
    unrefTimer(this.#timer);
  }

  get lost(): boolean {
    return this.#lost;
  }

  get released(): boolean {
    return this.#released;
  }

  async #beat(): Promise<void> {
    if (this.#released || this.#lost) return;
    const bytes = await readFileBytes(this.mutexPath);
    if (bytes === null) return; // moved aside for a moment by a breaker that will put it back, or gone: next tick tells
    if (parseLockHolder(decoder.decode(bytes))?.nonce !== this.nonce) {
      this.#lost = true;
      this.#stop();
      return;
    }
    await touchFile(this.mutexPath);
  }

  async stillHeld(): Promise<boolean> {
    if (this.#released || this.#lost) return false;
    const bytes = await readFileBytes(this.mutexPath);
    return bytes !== null && parseLockHolder(decoder.decode(bytes))?.nonce === this.nonce;
  }

  async assertHeld(): Promise<void> {
    if (!(await this.stillHeld())) throw new FileMutexLostError(this.mutexPath, this.#label);
  }

  async release(): Promise<boolean> {
    if (this.#released) return false;
    this.#released = true;
    this.#stop();
    try {
      // Known lost, or someone else's now: nothing of ours to remove. Never moved aside: renaming another
      // holder's live mutex away, even for a moment, would let a third process take it meanwhile.
      if (this.#lost) return false;
      const current = await readFileBytes(this.mutexPath);
      if (current === null || parseLockHolder(decoder.decode(current))?.nonce !== this.nonce) {
        this.#lost = true;
        return false;
      }
      // Moved to a name of our own first, then checked: someone else's mutex is put back, never deleted.
      const aside = `${this.mutexPath}.${this.nonce}.release`;
      if (!(await renameFile(this.mutexPath, aside))) return false;
      try {
        const bytes = await readFileBytes(aside);
        if (bytes !== null && parseLockHolder(decoder.decode(bytes))?.nonce === this.nonce) return true;
        await linkFile(aside, this.mutexPath);
        return false;
      } finally {
        await removeFile(aside);
      }
    } finally {
      HELD_MUTEXES.delete(this.nonce);
    }
  }

  #stop(): void {
    if (this.#timer !== null) clearInterval(this.#timer);
    this.#timer = null;
  }
}

/**
 * Run `fn` under the inter-process mutex `<file>.mutex` (see
 * {@link FileMutex}): `new FileMutex(file, options).run(fn)`.
 *
 * @param file the file the mutex guards
 * @param options `timeoutMs`, `staleLockMs`, `heartbeatMs`, `label`
 * @param fn the work, run while the mutex is held
 * @returns what `fn` returns
 * @throws {TypeError} or {@link RangeError} for a bad option (named)
 * @throws {FileMutexTimeoutError} when the mutex stayed busy for `timeoutMs`
 * @throws what `fn` throws; else a release error
 */
export function withFileMutex<T>(
  file: string,
  options: FileMutexOptions | undefined,
  fn: (held: FileMutexHandle) => T | Promise<T>,
): Promise<T> {
  try {
    return new FileMutex(file, options).run(fn);
  } catch (error) {
    return Promise.reject(error);
  }
}

// ---------------------------------------------------------------------------
// Locating a syntax error (failure path only: JSON.parse does not say where, on every runtime)

/**
 * The first encoding or JSON syntax error of `bytes`: its byte offset and
 * what is wrong, or `null` when the bytes are valid UTF-8 JSON (a leading
 * BOM is skipped). Iterative: any nesting depth.
 *
 * @param bytes the content of a file (or of one line of a log)
 * @returns the offset and the reason, or `null`
 */
export function findJsonSyntaxError(bytes: Uint8Array): { offset: number; reason: string } | null {
  return findUtf8Error(bytes) ?? findJsonError(bytes);
}
/** The offset of the first byte of an invalid UTF-8 sequence. */
function findUtf8Error(b: Uint8Array): { offset: number; reason: string } | null {
  const n = b.length;
  let i = 0;
  while (i < n) {
    const c = b[i];
    if (c < 0x80) {
      i++;
      continue;
    }
    let need: number;
    let lo = 0x80;
    let hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) need = 1;
    else if (c >= 0xe0 && c <= 0xef) {
      need = 2;
      if (c === 0xe0) lo = 0xa0; // no overlong forms
      if (c === 0xed) hi = 0x9f; // no surrogates
    } else if (c >= 0xf0 && c <= 0xf4) {
      need = 3;
      if (c === 0xf0) lo = 0x90;
      if (c === 0xf4) hi = 0x8f; // at most U+10FFFF
    } else {
      return { offset: i, reason: `invalid UTF-8 (byte 0x${hex(c)} cannot start a character)` };
    }
    for (let k = 1; k <= need; k++) {
      if (i + k >= n) return { offset: i, reason: "invalid UTF-8 (a character is cut off by the end of the file: truncated?)" };
      const d = b[i + k];
      const min = k === 1 ? lo : 0x80;
      const max = k === 1 ? hi : 0xbf;
      if (d < min || d > max) {
        return { offset: i, reason: `invalid UTF-8 (byte 0x${hex(d)} at ${i + k} does not continue the character)` };
      }
    }
    i += need + 1;
  }
  return null;
}

function hex(byte: number): string {
  return byte.toString(16).toUpperCase().padStart(2, "0");
}

/** Describes the byte at `i` for a syntax message. */
function describeAt(b: Uint8Array, i: number): string {
  if (i >= b.length) return "the end of the file (truncated?)";
  const c = b[i];
  return c >= 0x20 && c < 0x7f ? `${JSON.stringify(String.fromCharCode(c))}` : `byte 0x${hex(c)}`;
}

/** Scanner modes: a value is expected, an object key is expected, a value just ended. */
const Mode = { Value: 0, Key: 1, After: 2 } as const;

/** A JSON syntax checker over bytes (iterative: any nesting depth). */
function findJsonError(b: Uint8Array): { offset: number; reason: string } | null {
  const n = b.length;
  let i = b[0] === 0xef && b[1] === 0xbb && b[2] === 0xbf ? 3 : 0;
  const stack: number[] = []; // 0: array, 1: object
  let mode: number = Mode.Value;
  const err = (reason: string) => ({ offset: i, reason });
  const isDigit = (c: number) => c >= 0x30 && c <= 0x39;
  const skipSpace = () => {
    while (i < n && (b[i] === 0x20 || b[i] === 0x0a || b[i] === 0x0d || b[i] === 0x09)) i++;
  };
  const scanString = (): { offset: number; reason: string } | null => {
    i++; // the opening quote
    for (;;) {
      if (i >= n) return err("unterminated string: the end of the file (truncated?)");
      const c = b[i];
      if (c === 0x22) {
        i++;
        return null;
      }
      if (c === 0x5c) {
        const e = b[i + 1];
        if (e === 0x75) {
          for (let k = 2; k < 6; k++) {
            const h = b[i + k];
            const ok = h !== undefined && (isDigit(h) || (h >= 0x41 && h <= 0x46) || (h >= 0x61 && h <= 0x66));
            if (!ok) {
              i += k;
              return err(`invalid \\u escape: expected a hex digit, found ${describeAt(b, i)}`);
            }
          }
          i += 6;
          continue;
        }
        if (e === undefined || !'"\\/bfnrt'.includes(String.fromCharCode(e))) {
          i++;
          return err(`invalid escape in a string: ${describeAt(b, i)}`);
        }
        i += 2;
        continue;
      }
      if (c < 0x20) return err(`control character 0x${hex(c)} in a string (must be escaped)`);
      i++;
    }
  };
  const scanNumber = (): { offset: number; reason: string } | null => {
    if (b[i] === 0x2d) i++;
    if (b[i] === 0x30) i++;
    else if (i < n && isDigit(b[i])) while (i < n && isDigit(b[i])) i++;
    else return err(`invalid number: expected a digit, found ${describeAt(b, i)}`);
    if (b[i] === 0x2e) {
      i++;
      if (!(i < n && isDigit(b[i]))) return err(`invalid number: expected a digit after ".", found ${describeAt(b, i)}`);
      while (i < n && isDigit(b[i])) i++;
    }
    if (b[i] === 0x65 || b[i] === 0x45) {
      i++;
      if (b[i] === 0x2b || b[i] === 0x2d) i++;
      if (!(i < n && isDigit(b[i]))) return err(`invalid number: expected an exponent digit, found ${describeAt(b, i)}`);
      while (i < n && isDigit(b[i])) i++;
    }
    return null;
  };
  const scanWord = (word: string): { offset: number; reason: string } | null => {
    for (let k = 0; k < word.length; k++, i++) {
      if (b[i] !== word.charCodeAt(k)) return err(`invalid literal (expected ${JSON.stringify(word)}), found ${describeAt(b, i)}`);
    }
    return null;
  };
  for (;;) {
    skipSpace();
    if (mode === Mode.Value) {
      const c = b[i];
      let problem: { offset: number; reason: string } | null = null;
      if (c === 0x5b || c === 0x7b) {
        stack.push(c === 0x5b ? 0 : 1);
        i++;
        skipSpace();
        if (b[i] === (c === 0x5b ? 0x5d : 0x7d)) {
          i++;
          stack.pop();
          mode = Mode.After;
        } else {
          mode = c === 0x5b ? Mode.Value : Mode.Key;
        }
        continue;
      }
      if (c === 0x22) problem = scanString();
      else if (c === 0x2d || (c !== undefined && isDigit(c))) problem = scanNumber();
      else if (c === 0x74) problem = scanWord("true");
      else if (c === 0x66) problem = scanWord("false");
      else if (c === 0x6e) problem = scanWord("null");
      else return err(`expected a value, found ${describeAt(b, i)}`);
      if (problem) return problem;
      mode = Mode.After;
    } else if (mode === Mode.Key) {
      if (b[i] !== 0x22) return err(`expected a string key, found ${describeAt(b, i)}`);
      const problem = scanString();
      if (problem) return problem;
      skipSpace();
      if (b[i] !== 0x3a) return err(`expected ":" after a key, found ${describeAt(b, i)}`);
      i++;
      mode = Mode.Value;
    } else {
      if (stack.length === 0) return i >= n ? null : err(`unexpected ${describeAt(b, i)} after the end of the JSON value`);
      const inObject = stack[stack.length - 1] === 1;
      if (b[i] === 0x2c) {
        i++;
        mode = inObject ? Mode.Key : Mode.Value;
      } else if (b[i] === (inObject ? 0x7d : 0x5d)) {
        i++;
        stack.pop();
      } else {
        return err(`expected "," or "${inObject ? "}" : "]"}", found ${describeAt(b, i)}`);
      }
    }
  }
}

/** The leftovers of an interrupted writer: `<base>.<nonce>.tmp`, `<base>.<mutex|lock>.<nonce>.<tmp|stale|release>`. */
const LEFTOVER = /^\.(?:(?:mutex|lock)\.[0-9A-Za-z_-]+\.(?:tmp|stale|release)|[0-9A-Za-z_-]+\.tmp)$/;

/**
 * Removes the temporary files a killed writer leaves next to `file`: a
 * journal's `<file>.<nonce>.tmp`, and the mutex's and the lock's
 * `<file>.mutex.<nonce>.tmp`, `.stale` and `.release` (and the same for
 * `<file>.lock`). Only files not modified for `olderThanMs` are removed: a live
 * writer's are younger (it renames, links or removes them within one commit).
 * Removing one that a writer stopped for longer still uses is harmless: its
 * commit or its release then fails (see `SharedFileEventJournal`).
 *
 * @param file the journal file
 * @param olderThanMs the age (ms since the last modification) from which a leftover is removed
 * @returns the paths removed
 */
export async function removeLeftoverFiles(file: string, olderThanMs: number): Promise<string[]> {
  const slash = file.lastIndexOf("/");
  const dir = slash <= 0 ? "/" : file.slice(0, slash);
  const base = file.slice(slash + 1);
  const names = (await listDirectory(dir)) ?? [];
  const removed: string[] = [];
  for (const name of names) {
    if (!name.startsWith(base) || !LEFTOVER.test(name.slice(base.length))) continue;
    const path = `${dir}/${name}`;
    const stat = await statFile(path).catch(() => null);
    if (stat === null || Date.now() - stat.mtimeMs < olderThanMs) continue;
    if (await removeFile(path).catch(() => false)) removed.push(path);
  }
  return removed;
}

// ---------------------------------------------------------------------------
// The framed append log (`FileDurability`'s `<file>.log`): one record per line, `R <length> <crc32> <json>\n`

const CRC_TABLE = (() => {
  const table = new Uint32Array(256);
  for (let n = 0; n < 256; n++) {
    let c = n;
    for (let k = 0; k < 8; k++) c = c & 1 ? 0xedb88320 ^ (c >>> 1) : c >>> 1;
    table[n] = c >>> 0;
  }
  return table;
})();

/**
 * The CRC-32 (IEEE) of `bytes`.
 *
 * @param bytes the data
 * @returns the checksum, an unsigned 32-bit integer
 */
export function crc32(bytes: Uint8Array): number {
  let c = 0xffffffff;
  for (let i = 0; i < bytes.length; i++) c = CRC_TABLE[(c ^ bytes[i]) & 0xff] ^ (c >>> 8);
  return (c ^ 0xffffffff) >>> 0;
}

const logEncoder = new TextEncoder();

/**
 * One record of a framed log: `R <byte length> <crc32, 8 hex digits> <json>\n`.
 *
 * @param json the record's JSON text (no raw newline: `JSON.stringify` never writes one)
 * @returns its bytes
 */
export function frameLogRecord(json: string): Uint8Array {
  const payload = logEncoder.encode(json);
  const header = logEncoder.encode(`R ${payload.length} ${crc32(payload).toString(16).padStart(8, "0")} `);
  const out = new Uint8Array(header.length + payload.length + 1);
  out.set(header, 0);
  out.set(payload, header.length);
  out[out.length - 1] = 10;
  return out;
}

/** The records of a framed log as read by {@link scanLogRecords}. */
export interface ScannedLog {
  /** Each whole record: its byte offset and its parsed JSON. */
  records: { offset: number; value: unknown }[];
  /** The length of the log's whole records: what follows is a torn last write, to be cut off. */
  end: number;
}

/**
 * The record at `pos`, or `null` when there is no whole, intact record there; `"complete"` when a
 * whole frame is there (header, length and final newline all in place) but its payload fails the
 * checksum or is not JSON: damage, not a torn write (an append cut short by a crash never ends on
 * the newline the frame's own length points at).
 */
function recordAt(bytes: Uint8Array, pos: number): { value: unknown; next: number } | "complete" | null {
  const n = bytes.length;
  if (bytes[pos] !== 0x52 || bytes[pos + 1] !== 0x20) return null; // "R "
  let i = pos + 2;
  let length = 0;
  const digits = i;
  while (i < n && bytes[i] >= 0x30 && bytes[i] <= 0x39 && i - digits < 12) length = length * 10 + (bytes[i++] - 0x30);
  if (i === digits || bytes[i] !== 0x20) return null;
  i++;
  if (i + 9 > n || bytes[i + 8] !== 0x20) return null;
  const hexText = String.fromCharCode(...bytes.subarray(i, i + 8));
  if (!/^[0-9a-f]{8}$/.test(hexText)) return null;
  const crc = Number.parseInt(hexText, 16);
  i += 9;
  const end = i + length;
  if (end >= n || bytes[end] !== 10) return null;
  const payload = bytes.subarray(i, end);
  if (crc32(payload) !== crc) return "complete";
  try {
    return { value: JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(payload)), next: end + 1 };
  } catch {
    return "complete";
  }
}

/**
 * Reads a framed log (see {@link frameLogRecord}). A record that is cut
 * off with no intact record after it is the torn last write of a process
 * that died mid-append (never acknowledged): it ends the log
 * ({@link ScannedLog.end}). One with intact records after it is damage, and
 * so is a whole frame whose payload fails its checksum, wherever it is.
 *
 * @param file the log file, named in errors
 * @param bytes its content
 * @param label the backend named in errors
 * @returns the intact records and where they end
 * @throws {FileCorruptError} at the offset of a damaged record: a whole one, or one that intact records follow
 */
export function scanLogRecords(file: string, bytes: Uint8Array, label: string): ScannedLog {
  const records: { offset: number; value: unknown }[] = [];
  let pos = 0;
  while (pos < bytes.length) {
    const found = recordAt(bytes, pos);
    if (found !== null && found !== "complete") {
      records.push({ offset: pos, value: found.value });
      pos = found.next;
      continue;
    }
    if (found === "complete") {
      throw new FileCorruptError(
        file,
        pos,
        `log record ${records.length + 1} is damaged: a whole record whose checksum does not match (not a write cut short)`,
        label,
      );
    }
    for (let nl = bytes.indexOf(10, pos); nl >= 0 && nl + 1 < bytes.length; nl = bytes.indexOf(10, nl + 1)) {
      const next = recordAt(bytes, nl + 1);
      if (next !== null && next !== "complete") {
        throw new FileCorruptError(
          file,
          pos,
          `log record ${records.length + 1} is damaged (cut short, or its checksum does not match) and intact records follow it`,
          label,
        );
      }
    }
    break; // a torn last write
  }
  return { records, end: pos };
}
