/**
 * A lock file as `FileLock` (`<file>.lock`) and `FileMutex`
 * (`<file>.mutex`) write it: the holder it names (pid, hostname, time,
 * nonce), reading it, and breaking a stale one so that exactly one of several
 * breakers wins.
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */
import { randomId } from "../../src/runtime/mod.ts";
import { createExclusive, linkFile, readFileBytes, removeFile, renameFile, statFile } from "../../src/runtime/fs.ts";

/** Default `staleLockMs` of the lock and the mutex: 30 s. */
export const DEFAULT_STALE_LOCK_MS: number = 30_000;
/** A `.break` file (held for a few ms while a stale lock is broken) left by a crash is removed once this old. */
export const BREAK_STALE_MS: number = 5_000;
/**
 * Smallest `staleLockMs` accepted anywhere (`FileMutex`, `FileDurability`,
 * `FileEventJournal`, `SharedFileEventJournal`): an ordinary pause (GC, a
 * busy event loop) must not reach it.
 */
export const MIN_STALE_LOCK_MS: number = 1_000;

const decoder = new TextDecoder();

function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  for (let i = 0; i < a.length; i++) if (a[i] !== b[i]) return false;
  return true;
}

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

/** A lock (or mutex) file as read: its bytes and its mtime. */
export interface SeenLock {
  /** Its content. */
  bytes: Uint8Array;
  /** Its mtime (ms since the epoch). */
  mtimeMs: number;
}

/**
 * Read a lock or mutex file.
 *
 * @param lockPath the file
 * @returns its bytes and mtime, or `null` when it does not exist
 */
export async function readLock(lockPath: string): Promise<SeenLock | null> {
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
 *
 * @param lockPath the lock or mutex file
 * @param seen the file as read when it was judged stale
 * @param breakStaleMs the age from which a `<lock>.break` left by a crash is removed
 * @returns `false` when another process is breaking it
 */
export async function breakStale(lockPath: string, seen: SeenLock, breakStaleMs: number): Promise<boolean> {
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
