/**
 * The torn end of a file backend's log (the last append before a crash,
 * never acknowledged), kept beside the log before the log is cut
 * ({@link setAsideTornTail}).
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */
import { createExclusive, dirName, syncDirectory } from "../../src/runtime/fs.ts";

/**
 * Writes `tail` to a new file beside `logFile`, `<logFile>.torn-<n>` (the first free `n`), flushed
 * (and its directory entry) when `fsync`, so that it is on disk before the log is cut.
 *
 * @param logFile the log
 * @param tail the bytes cut off
 * @param options `fsync` and `mode` (permission bits of the new file)
 * @returns the file written
 * @throws {Error} a write error of the runtime, or when `torn-1` to `torn-10000` all exist
 */
export async function setAsideTornTail(logFile: string, tail: Uint8Array, options: { fsync: boolean; mode: number }): Promise<string> {
  for (let n = 1; n <= 10_000; n++) {
    const aside = `${logFile}.torn-${n}`;
    if (!(await createExclusive(aside, tail, options))) continue;
    if (options.fsync) await syncDirectory(await dirName(logFile));
    return aside;
  }
  throw new Error(`${logFile}.torn-1 to ${logFile}.torn-10000 all exist: remove the ones you have looked at`);
}
