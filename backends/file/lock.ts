/**
 * The process lock `<file>.lock` of a single-process file backend
 * (`FileDurability`, `FileEventJournal`): {@link FileLock} takes it (breaking
 * a stale one) and keeps it fresh while the backend is open;
 * {@link FileLockedError} names a live holder; {@link findLiveLockHolder}
 * tells whether a live process holds it (a shared journal refuses such a
 * file).
 *
 * Internal to the file backends: not part of the public API (only
 * {@link FileLockedError} is exported, through the backends' entries).
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import { delay, hostname, randomId, unrefTimer } from "../../src/runtime/mod.ts";
import { createExclusiveLinked, currentPid, isProcessAlive, readFileBytes, removeFile, touchFile } from "../../src/runtime/fs.ts";
import {
  BREAK_STALE_MS,
  breakStale,
  DEFAULT_STALE_LOCK_MS,
  type LockHolder,
  parseLockHolder,
  readLock,
} from "./lock_file.ts";
import { processGlobal } from "./process_global.ts";

/** Longest interval between two refreshes of a held lock file's mtime. */
const LOCK_REFRESH_MS = 10_000;
/** An unreadable (empty or damaged) lock file counts as stale once unchanged this long. */
const UNREADABLE_LOCK_STALE_MS = 10_000;

const decoder = new TextDecoder();

function seconds(ms: number): string {
  return `${Math.max(0, Math.ceil(ms / 100) / 10)} s`;
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


/**
 * Nonces of the lock files this process holds (shared by every copy of this
 * module). A lock file with this process's pid whose nonce is not here is
 * stale (a previous process that had the same pid); one whose nonce is here is
 * held through another spelling of the path (a symlink).
 */
const HELD_LOCKS: Set<string> = processGlobal("@botmesh/durable/file:held-locks", () => new Set<string>());

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

/** Whether the lock's holder runs; a runtime that cannot tell gets a clear error instead of a guess. */
async function holderAlive(lockPath: string, pid: number, label: string): Promise<boolean> {
  try {
    return await isProcessAlive(pid);
  } catch (error) {
    throw new Error(
      `${label}: cannot tell whether pid ${pid}, the holder of lock file ${lockPath}, is still running ` +
        `(${errorMessage(error)}). On Deno, grant --allow-run; or delete the lock file if that process is gone.`,
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
