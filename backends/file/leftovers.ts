/**
 * The temporary files an interrupted writer leaves next to a file
 * ({@link removeLeftoverFiles}): a snapshot's or a journal's
 * `<file>.<nonce>.tmp`, and the lock's and the mutex's own.
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */
import { listDirectory, removeFile, statFile } from "../../src/runtime/fs.ts";

/** The leftovers of an interrupted writer: `<base>.<nonce>.tmp`, `<base>.<mutex|lock>.<nonce>.<tmp|stale|release>`. */
const LEFTOVER = /^\.(?:(?:mutex|lock)\.[0-9A-Za-z_-]+\.(?:tmp|stale|release)|[0-9A-Za-z_-]+\.tmp)$/;
/** The file's own temporary files (an atomic rewrite's): `<base>.<nonce>.tmp`. */
const OWN_TEMP = /^\.[0-9A-Za-z_-]+\.tmp$/;

/**
 * Removes the temporary files a killed writer leaves next to `file`: a
 * snapshot rewrite's or a journal's `<file>.<nonce>.tmp`, and the mutex's and
 * the lock's `<file>.mutex.<nonce>.tmp`, `.stale` and `.release` (and the same
 * for `<file>.lock`). Only files not modified for `olderThanMs` are removed: a
 * live writer's are younger (it renames, links or removes them within one
 * commit). Removing one that a writer stopped for longer still uses is
 * harmless: its commit or its release then fails (see `SharedFileEventJournal`).
 * A backend that holds `file`'s lock, so that nobody else rewrites it, passes
 * `ownTempsOlderThanMs: 0`: every `<file>.<nonce>.tmp` is then a leftover.
 *
 * @param file the journal file
 * @param olderThanMs the age (ms since the last modification) from which a leftover is removed
 * @param options `ownTempsOlderThanMs`: the age for `<file>.<nonce>.tmp` (default `olderThanMs`)
 * @returns the paths removed
 */
export async function removeLeftoverFiles(
  file: string,
  olderThanMs: number,
  options: { ownTempsOlderThanMs?: number } = {},
): Promise<string[]> {
  const slash = file.lastIndexOf("/");
  const dir = slash <= 0 ? "/" : file.slice(0, slash);
  const base = file.slice(slash + 1);
  const names = (await listDirectory(dir)) ?? [];
  const removed: string[] = [];
  for (const name of names) {
    const rest = name.slice(base.length);
    if (!name.startsWith(base) || !LEFTOVER.test(rest)) continue;
    const age = OWN_TEMP.test(rest) ? options.ownTempsOlderThanMs ?? olderThanMs : olderThanMs;
    const path = `${dir}/${name}`;
    if (age > 0) {
      const stat = await statFile(path).catch(() => null);
      if (stat === null || Date.now() - stat.mtimeMs < age) continue;
    }
    if (await removeFile(path).catch(() => false)) removed.push(path);
  }
  return removed;
}
