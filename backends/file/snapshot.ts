/**
 * A snapshot file of a file backend: written by an atomic replace that keeps
 * its permission bits ({@link writeSnapshot}, {@link snapshotFileMode}), read
 * as JSON with the byte offset of the first encoding or syntax error
 * ({@link readJsonSnapshot}, {@link parseJsonBytes}).
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */
import { readFileBytes, statFile, writeFileAtomic } from "../../src/runtime/fs.ts";
import { FileCorruptError } from "./corrupt_error.ts";
import { findJsonSyntaxError } from "./json_error.ts";

/** Permission bits of a new snapshot file (`0o600`): it holds chat content. */
export const NEW_FILE_MODE: number = 0o600;

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
  /** The temporary file (default `<file>.<random>.tmp`, created exclusively; same directory). */
  tempPath?: string;
}

/**
 * Test hooks of the snapshot writes of every file backend in the process
 * (`FileDurability`, `FileEventJournal`): set by tests only, reset after.
 */
export const snapshotWriteTestHooks: {
  /** Before each snapshot write: throw to make it fail, as a full disk would. */
  beforeWrite?: (file: string) => void | Promise<void>;
} = {};

/**
 * Replace a snapshot file atomically: write `text` to a new temporary file
 * `<file>.<random>.tmp` (created exclusively, never through a symlink planted
 * beside `file`), `fsync`, rename it over `file`, `fsync` the directory. A
 * reader, or a restart after a crash at any moment, sees the previous content
 * or the new one, never a mix. The permission bits are kept (a new file gets
 * `0o600`); they are set on the open temporary file before the rename, so the
 * file never exists with wider ones. On an error `file` is left as it was and
 * the temporary file is removed (one left by a crash is removed when the
 * backend next opens `file`, by `removeLeftoverFiles` of `./leftovers.ts`).
 *
 * @param file the snapshot file (its real path: a symlink would be replaced)
 * @param text the new content
 * @param options `fsync` (default `true`), `mode` and `tempPath`
 * @throws {Error} the runtime's error (`ENOSPC`, `EACCES`, …)
 */
export async function writeSnapshot(file: string, text: string | Uint8Array, options: SnapshotWriteOptions = {}): Promise<void> {
  await snapshotWriteTestHooks.beforeWrite?.(file);
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
