/**
 * The inter-process mutex `<file>.mutex` ({@link FileMutex},
 * {@link withFileMutex}): held for the few milliseconds of one write by one
 * of several processes that share a file (`SharedFileEventJournal`).
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */
import { delay, hostname, randomId, unrefTimer } from "../../src/runtime/mod.ts";
import {
  createExclusiveLinked,
  currentPid,
  isProcessAlive,
  linkFile,
  readFileBytes,
  removeFile,
  renameFile,
  touchFile,
} from "../../src/runtime/fs.ts";
import { showValue as show } from "../../src/show.ts";
import {
  BREAK_STALE_MS,
  breakStale,
  DEFAULT_STALE_LOCK_MS,
  type LockHolder,
  MIN_STALE_LOCK_MS,
  parseLockHolder,
  readLock,
  type SeenLock,
} from "./lock_file.ts";
import { processGlobal } from "./process_global.ts";

/** Default {@link FileMutexOptions.timeoutMs}. */
const DEFAULT_MUTEX_TIMEOUT_MS = 10_000;
/** Longest pause between two attempts to take a busy mutex. */
const MUTEX_MAX_BACKOFF_MS = 20;

const decoder = new TextDecoder();

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
   * (default `30000`, at least `1000`). A mutex of a dead pid of this host is
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
