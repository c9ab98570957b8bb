/**
 * The file-system part of the runtime shim: the few file and process
 * operations the file backend needs, on Bun, Node (20+) and Deno (2+).
 *
 * Everything goes through `node:fs/promises`, `node:path` and `node:process`,
 * imported lazily on first use (all three runtimes provide them; Deno needs
 * `--allow-read`, `--allow-write` and, for {@link isProcessAlive}, `--allow-run`).
 * Nothing here is loaded by the core unless a file backend is used.
 *
 * Errors thrown by the runtime are passed on unchanged (they carry a `code`
 * such as `ENOENT`, `EEXIST`, `ENOSPC`, `EACCES`).
 *
 * @module
 */

type FsPromises = typeof import("node:fs/promises");
type PathModule = typeof import("node:path");
type ProcessModule = typeof import("node:process");

let fsModule: Promise<FsPromises> | undefined;
let pathModule: Promise<PathModule> | undefined;
let processModule: Promise<ProcessModule> | undefined;

function fs(): Promise<FsPromises> {
  return fsModule ??= import("node:fs/promises");
}

function paths(): Promise<PathModule> {
  return pathModule ??= import("node:path");
}

/**
 * Open flags, as numbers: `O_NOFOLLOW` where the platform has it (not
 * Windows, where creating a symlink takes a privilege), so that a symlink
 * planted at the name is refused (`ELOOP`) instead of followed.
 */
interface OpenFlags {
  /** Create a new file, write only; fails (`EEXIST`) when the name exists, a symlink included (`O_EXCL`). */
  createNew: number;
  /** {@link OpenFlags.createNew}, read and write. */
  createNewReadWrite: number;
  /** Append, creating the file when missing; a symlink is refused. */
  append: number;
  /** Read and write an existing file; a symlink is refused. */
  readWrite: number;
}

let openFlagsValue: OpenFlags | undefined;

async function openFlags(): Promise<OpenFlags> {
  if (openFlagsValue !== undefined) return openFlagsValue;
  const c = (await fs()).constants;
  const noFollow = c.O_NOFOLLOW ?? 0;
  return openFlagsValue = {
    createNew: c.O_WRONLY | c.O_CREAT | c.O_EXCL | noFollow,
    createNewReadWrite: c.O_RDWR | c.O_CREAT | c.O_EXCL | noFollow,
    append: c.O_WRONLY | c.O_CREAT | c.O_APPEND | noFollow,
    readWrite: c.O_RDWR | noFollow,
  };
}

async function proc(): Promise<ProcessModule> {
  processModule ??= import("node:process");
  const mod = await processModule;
  // Node and Bun expose `process` as the default export; take it when present.
  return ((mod as unknown as { default?: ProcessModule }).default ?? mod) as ProcessModule;
}

/**
 * The `code` of a runtime error.
 *
 * @param error anything thrown
 * @returns its `code` (`'ENOENT'`, `'EEXIST'`, …), or `undefined`
 */
export function errorCode(error: unknown): string | undefined {
  const code = (error as { code?: unknown } | null)?.code;
  return typeof code === "string" ? code : undefined;
}

/**
 * The absolute form of `path`, resolved against the current directory.
 *
 * @param path a relative or absolute path
 * @returns the absolute, normalized path
 */
export async function resolvePath(path: string): Promise<string> {
  return (await paths()).resolve(path);
}

/**
 * The directory part of `path`.
 *
 * @param path a path
 * @returns its parent directory
 */
export async function dirName(path: string): Promise<string> {
  return (await paths()).dirname(path);
}

/**
 * Read a whole file.
 *
 * @param path the file
 * @returns its bytes, or `null` when it does not exist
 * @throws {Error} any other read error (permissions, a directory, I/O)
 */
export async function readFileBytes(path: string): Promise<Uint8Array | null> {
  try {
    const data = await (await fs()).readFile(path);
    return new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
  } catch (error) {
    if (errorCode(error) === "ENOENT") return null;
    throw error;
  }
}

/**
 * A fresh temporary name next to `path`: `<path>.<random>.tmp` (a random
 * UUID, so nobody can plant a file or a symlink there beforehand). The file
 * backends remove such names left by a crash when they open `path`.
 *
 * @param path the file the temporary one will replace
 * @returns the temporary path (same directory)
 */
export function uniqueTempPath(path: string): string {
  return `${path}.${crypto.randomUUID()}.tmp`;
}

/** Options of {@link writeFileAtomic}. */
export interface AtomicWriteOptions {
  /** Flush the file and its directory to the disk before resolving (default `true`). */
  fsync?: boolean;
  /**
   * The temporary file to write first (default {@link uniqueTempPath}:
   * `<path>.<random>.tmp`); it must be on the same file system. It is
   * created exclusively: when the name exists (a symlink included) the write
   * fails with `EEXIST` and that file is left alone.
   */
  tempPath?: string;
  /**
   * Permission bits of the new file (e.g. `0o600`), set on the open
   * temporary file (`fchmod`) before the rename, so the umask does not apply
   * and the file never exists with wider permissions. Default: the runtime's
   * default for a new file (`0o666` minus the umask).
   */
  mode?: number;
}

/**
 * Replace `path` atomically: write `data` to a new temporary file (created
 * with `O_CREAT | O_EXCL | O_NOFOLLOW` under a random name, so a symlink
 * planted beside `path` is never written through), flush it (`fsync`),
 * rename it over `path`, then flush the directory so the rename itself is
 * durable (skipped where the runtime or the OS cannot open a directory, e.g.
 * Windows). A reader sees the old content or the new, never a mix. The mode
 * is set on the open handle, never by name. On an error the temporary file
 * is removed (best effort) and `path` is left as it was.
 *
 * @param path the file to replace (a symlink at `path` is replaced, not followed)
 * @param data the new content (a string is written as UTF-8)
 * @param options `fsync` (default `true`), `tempPath` (default `<path>.<random>.tmp`) and `mode`
 * @throws {Error} a create, write, flush or rename error of the runtime (`ENOSPC`, `EACCES`, `EEXIST`, …)
 */
export async function writeFileAtomic(
  path: string,
  data: string | Uint8Array,
  options: AtomicWriteOptions = {},
): Promise<void> {
  const f = await fs();
  const sync = options.fsync ?? true;
  const temp = options.tempPath ?? uniqueTempPath(path);
  // When this fails the name is not ours (EEXIST): nothing to remove.
  const handle = await f.open(temp, (await openFlags()).createNew, options.mode ?? 0o666);
  let renamed = false;
  try {
    try {
      if (options.mode !== undefined) await handle.chmod(options.mode); // the umask does not apply
      await handle.writeFile(data);
      if (sync) await handle.sync();
    } finally {
      await handle.close();
    }
    await f.rename(temp, path);
    renamed = true;
  } finally {
    if (!renamed) await f.unlink(temp).catch(() => {});
  }
  if (sync) await syncDirectory(await dirName(path));
}

/**
 * Flush a directory's entries (a rename or a new file in it) to the disk.
 * Does nothing where directories cannot be opened or flushed (Windows, some
 * file systems).
 *
 * @param dir the directory
 * @throws {Error} an I/O error reported by the flush itself (`EIO`)
 */
export async function syncDirectory(dir: string): Promise<void> {
  const f = await fs();
  let handle: Awaited<ReturnType<FsPromises["open"]>>;
  try {
    handle = await f.open(dir, "r");
  } catch {
    return; // not supported here
  }
  try {
    await handle.sync();
  } catch (error) {
    const code = errorCode(error);
    if (code === "EIO" || code === "ENOSPC") throw error;
    // EINVAL, EPERM, EISDIR, ENOTSUP: the platform cannot flush a directory.
  } finally {
    await handle.close().catch(() => {});
  }
}

/**
 * Create a file that must not exist yet (`O_CREAT | O_EXCL`, flag `wx`) and
 * write `text` into it.
 *
 * @param path the file
 * @param text its content (a string is written as UTF-8)
 * @param options `fsync`: flush it before resolving (default `false`); `mode`: permission bits of the new
 *   file, less the umask (default `0o666`)
 * @returns `true` when created, `false` when the file already exists
 * @throws {Error} any other error (the directory is missing, permissions)
 */
export async function createExclusive(
  path: string,
  text: string | Uint8Array,
  options: { fsync?: boolean; mode?: number } = {},
): Promise<boolean> {
  const f = await fs();
  let handle: Awaited<ReturnType<FsPromises["open"]>>;
  try {
    handle = await f.open(path, (await openFlags()).createNew, options.mode ?? 0o666);
  } catch (error) {
    if (errorCode(error) === "EEXIST") return false;
    throw error;
  }
  try {
    await handle.writeFile(text);
    if (options.fsync) await handle.sync();
  } finally {
    await handle.close();
  }
  return true;
}

/**
 * Create `path` atomically with `text` in it: the content is written to a
 * unique temporary file next to it, which is then hard-linked to `path`
 * (`link` fails when `path` exists, like `O_EXCL`). Unlike
 * {@link createExclusive}, `path` never exists empty or half written. Where
 * the file system has no hard links (`EPERM`, `ENOTSUP`, `ENOSYS`, `EXDEV`),
 * falls back to {@link createExclusive}.
 *
 * @param path the file
 * @param text its content (UTF-8)
 * @param tempPath the temporary file (unique, same directory); removed before returning
 * @returns `true` when created, `false` when the file already exists
 * @throws {Error} any other error (the directory is missing, permissions)
 */
export async function createExclusiveLinked(path: string, text: string, tempPath: string): Promise<boolean> {
  const f = await fs();
  try {
    await f.writeFile(tempPath, text, { flag: (await openFlags()).createNew });
    try {
      await f.link(tempPath, path);
      return true;
    } catch (error) {
      const code = errorCode(error);
      if (code === "EEXIST") return false;
      if (code === "EPERM" || code === "ENOTSUP" || code === "ENOSYS" || code === "EXDEV" || code === "EOPNOTSUPP") {
        return await createExclusive(path, text);
      }
      throw error;
    }
  } finally {
    await f.rm(tempPath, { force: true }).catch(() => {});
  }
}

/** What {@link statFile} returns. */
export interface FileStat {
  /** Whether it is a directory. */
  isDirectory: boolean;
  /** Permission bits (`mode & 0o7777`). */
  mode: number;
  /** Last modification time, ms since the epoch. */
  mtimeMs: number;
}

/**
 * The type, permission bits and modification time of `path` (symlinks followed).
 *
 * @param path the file
 * @returns its stat, or `null` when it does not exist
 * @throws {Error} any other error (permissions, I/O)
 */
export async function statFile(path: string): Promise<FileStat | null> {
  try {
    const st = await (await fs()).stat(path);
    return { isDirectory: st.isDirectory(), mode: st.mode & 0o7777, mtimeMs: st.mtimeMs };
  } catch (error) {
    if (errorCode(error) === "ENOENT") return null;
    throw error;
  }
}

/**
 * Set a file's access and modification times to now (`utimes`).
 *
 * @param path the file
 * @throws {Error} any error (`ENOENT` when it does not exist, permissions)
 */
export async function touchFile(path: string): Promise<void> {
  const now = new Date();
  await (await fs()).utimes(path, now, now);
}

/**
 * The real path of a file that may not exist yet: symlinks (of the file
 * itself, dangling ones included, and of its directories) are resolved.
 * `realpath` of the file when it exists; else, when it is a symlink to a
 * missing file, the link target (followed up to 40 levels); else `realpath`
 * of its directory plus its name.
 *
 * @param path an absolute path
 * @returns the absolute real path
 * @throws {Error} when the directory does not exist or cannot be resolved (`ENOENT`, `EACCES`, `ELOOP`)
 */
export async function realPathOf(path: string): Promise<string> {
  const f = await fs();
  const p = await paths();
  let current = p.resolve(path);
  for (let hops = 0;; hops++) {
    try {
      return await f.realpath(current);
    } catch (error) {
      if (errorCode(error) !== "ENOENT") throw error;
    }
    let target: string | null = null;
    try {
      target = await f.readlink(current);
    } catch {
      // Not a symlink (or missing): the file does not exist yet.
    }
    if (target === null) return p.join(await f.realpath(p.dirname(current)), p.basename(current));
    if (hops >= 40) {
      throw Object.assign(new Error(`ELOOP: too many levels of symbolic links, ${path}`), { code: "ELOOP" });
    }
    current = p.resolve(p.dirname(current), target);
  }
}

/**
 * Delete a file; a missing file is not an error.
 *
 * @param path the file
 * @returns whether a file was deleted
 * @throws {Error} any other error (permissions, a directory)
 */
export async function removeFile(path: string): Promise<boolean> {
  try {
    await (await fs()).unlink(path);
    return true;
  } catch (error) {
    if (errorCode(error) === "ENOENT") return false;
    throw error;
  }
}

/**
 * Create a directory and its parents when missing.
 *
 * @param path the directory
 * @throws {Error} when it cannot be created (permissions, a file in the way)
 */
export async function ensureDir(path: string): Promise<void> {
  await (await fs()).mkdir(path, { recursive: true });
}

/**
 * This process's id.
 *
 * @returns the pid
 */
export async function currentPid(): Promise<number> {
  return (await proc()).pid;
}

/**
 * Whether a process with id `pid` exists on this host (signal 0: nothing is
 * sent). `ESRCH` means it is gone; `EPERM` means it exists but belongs to
 * another user, so it counts as alive.
 *
 * @param pid the process id
 * @returns `false` only when the process certainly does not exist
 * @throws {Error} when the runtime cannot tell (Deno without `--allow-run`:
 *   `NotCapable`); a lock must never be broken on a guess
 */
export async function isProcessAlive(pid: number): Promise<boolean> {
  if (!Number.isInteger(pid) || pid <= 0) return false;
  try {
    (await proc()).kill(pid, 0);
    return true;
  } catch (error) {
    const code = errorCode(error);
    if (code === "ESRCH") return false;
    if (code === "EPERM") return true;
    throw error;
  }
}

/**
 * Rename `from` to `to` (`rename(2)`: atomic, replaces `to` when it exists).
 *
 * @param from the existing file
 * @param to its new path (same file system)
 * @returns `true` when renamed, `false` when `from` does not exist
 * @throws {Error} any other error (permissions, another file system)
 */
export async function renameFile(from: string, to: string): Promise<boolean> {
  try {
    await (await fs()).rename(from, to);
    return true;
  } catch (error) {
    if (errorCode(error) === "ENOENT") return false;
    throw error;
  }
}

/**
 * Give an existing file a second name (`link(2)`); fails, without replacing
 * anything, when `path` exists.
 *
 * @param existing the file
 * @param path the new name (same file system)
 * @returns `true` when linked, `false` when `path` already exists or `existing` does not
 * @throws {Error} any other error (permissions, no hard links on this file system)
 */
export async function linkFile(existing: string, path: string): Promise<boolean> {
  try {
    await (await fs()).link(existing, path);
    return true;
  } catch (error) {
    const code = errorCode(error);
    if (code === "EEXIST" || code === "ENOENT") return false;
    throw error;
  }
}

/**
 * The identity and size of a file: enough to tell whether it was replaced
 * (a new inode) or changed in place (size, mtime in ns).
 */
export interface FileIdentity {
  /** `<dev>:<ino>` (exact, from a bigint stat). */
  id: string;
  /** Size in bytes. */
  size: number;
  /** Last modification time in ns since the epoch, as a decimal string. */
  mtimeNs: string;
}

function identityOf(st: import("node:fs").BigIntStats): FileIdentity {
  return { id: `${st.dev}:${st.ino}`, size: Number(st.size), mtimeNs: String(st.mtimeNs) };
}

/**
 * The identity (`dev:ino`), size and mtime (ns) of `path` (symlinks followed).
 *
 * @param path the file
 * @returns its identity, or `null` when it does not exist
 * @throws {Error} any other error (permissions, I/O)
 */
export async function statIdentity(path: string): Promise<FileIdentity | null> {
  try {
    return identityOf(await (await fs()).stat(path, { bigint: true }));
  } catch (error) {
    if (errorCode(error) === "ENOENT") return null;
    throw error;
  }
}

/**
 * A file kept open: its inode cannot be reused by another file while it is
 * open, so an equal `dev:ino` later means the very same file.
 */
export interface PinnedFile {
  /** The identity of the open file (fstat). */
  identity(): Promise<FileIdentity>;
  /** Its whole content, read through the open handle. */
  readAll(): Promise<Uint8Array>;
  /** Close the handle (calling it again does nothing). */
  close(): Promise<void>;
}

function pinned(handle: Awaited<ReturnType<FsPromises["open"]>>): PinnedFile {
  let closed = false;
  return {
    identity: async () => identityOf(await handle.stat({ bigint: true })),
    readAll: async () => {
      const st = await handle.stat();
      const out = new Uint8Array(st.size);
      let done = 0;
      while (done < out.length) {
        const { bytesRead } = await handle.read(out, done, out.length - done, done);
        if (bytesRead === 0) break;
        done += bytesRead;
      }
      return done === out.length ? out : out.subarray(0, done);
    },
    close: async () => {
      if (closed) return;
      closed = true;
      await handle.close();
    },
  };
}

/**
 * Create `path`, a new file (`O_CREAT | O_EXCL | O_NOFOLLOW`: fails with
 * `EEXIST` when the name exists, a symlink included), write `data`, flush
 * it when `fsync`, and return it still open (see {@link PinnedFile}), e.g.
 * to rename or link it into place afterwards and keep its inode pinned.
 *
 * @param path the file to create (a fresh name, e.g. {@link uniqueTempPath})
 * @param data the content (a string is written as UTF-8)
 * @param options `fsync` (default `true`) and `mode` (permission bits, set on the open handle)
 * @returns the open file
 * @throws {Error} a create, write or flush error of the runtime (the file may be left partly written)
 */
export async function writeFilePinned(
  path: string,
  data: string | Uint8Array,
  options: { fsync?: boolean; mode?: number } = {},
): Promise<PinnedFile> {
  const f = await fs();
  const handle = await f.open(path, (await openFlags()).createNewReadWrite, options.mode ?? 0o666);
  try {
    if (options.mode !== undefined) await handle.chmod(options.mode);
    await handle.writeFile(data);
    if (options.fsync ?? true) await handle.sync();
  } catch (error) {
    await handle.close().catch(() => {});
    throw error;
  }
  return pinned(handle);
}

/**
 * Append `data` to `path` (created when missing, with `mode`) in one write
 * call, and flush it when `fsync`. A symlink at `path` is refused (`ELOOP`,
 * where the platform has `O_NOFOLLOW`), not written through.
 *
 * @param path the file
 * @param data the bytes (a string is written as UTF-8)
 * @param options `fsync` (default `true`) and `mode` of a new file (default `0o600`)
 * @throws {Error} a write or flush error of the runtime
 */
export async function appendToFile(
  path: string,
  data: string | Uint8Array,
  options: { fsync?: boolean; mode?: number } = {},
): Promise<void> {
  const f = await fs();
  const handle = await f.open(path, (await openFlags()).append, options.mode ?? 0o600);
  try {
    const bytes = typeof data === "string" ? new TextEncoder().encode(data) : data;
    let done = 0;
    while (done < bytes.length) {
      const { bytesWritten } = await handle.write(bytes, done, bytes.length - done);
      done += bytesWritten;
    }
    if (options.fsync ?? true) await handle.sync();
  } finally {
    await handle.close();
  }
}

/**
 * Read the bytes `[start, end)` of `path` (fewer when the file is shorter).
 *
 * @param path the file
 * @param start the first byte
 * @param end the byte after the last
 * @returns the bytes, or `null` when the file does not exist
 * @throws {Error} any other read error
 */
export async function readFileRange(path: string, start: number, end: number): Promise<Uint8Array | null> {
  let handle: Awaited<ReturnType<FsPromises["open"]>>;
  try {
    handle = await (await fs()).open(path, "r");
  } catch (error) {
    if (errorCode(error) === "ENOENT") return null;
    throw error;
  }
  try {
    const out = new Uint8Array(Math.max(0, end - start));
    let done = 0;
    while (done < out.length) {
      const { bytesRead } = await handle.read(out, done, out.length - done, start + done);
      if (bytesRead === 0) break;
      done += bytesRead;
    }
    return done === out.length ? out : out.subarray(0, done);
  } finally {
    await handle.close();
  }
}

/**
 * Cut `path` to `length` bytes (`ftruncate(2)`), and flush it when `fsync`.
 * A symlink at `path` is refused (`ELOOP`, where the platform has
 * `O_NOFOLLOW`), not followed.
 *
 * @param path the file
 * @param length the new size
 * @param options `fsync` (default `true`)
 * @returns `false` when the file does not exist
 * @throws {Error} any other error
 */
export async function truncateFile(path: string, length: number, options: { fsync?: boolean } = {}): Promise<boolean> {
  let handle: Awaited<ReturnType<FsPromises["open"]>>;
  try {
    handle = await (await fs()).open(path, (await openFlags()).readWrite);
  } catch (error) {
    if (errorCode(error) === "ENOENT") return false;
    throw error;
  }
  try {
    await handle.truncate(length);
    if (options.fsync ?? true) await handle.sync();
  } finally {
    await handle.close();
  }
  return true;
}

/**
 * The names in a directory (`readdir`), in no particular order.
 *
 * @param path the directory
 * @returns its entries' names, or `null` when it does not exist
 * @throws {Error} any other error (permissions, not a directory)
 */
export async function listDirectory(path: string): Promise<string[] | null> {
  try {
    return await (await fs()).readdir(path);
  } catch (error) {
    if (errorCode(error) === "ENOENT") return null;
    throw error;
  }
}

/** A file kept open for appending (see {@link openAppendFile}). */
export interface AppendFile {
  /** Appends `data` in full; with `sync`, flushes it (`fdatasync`) before resolving. */
  append(data: Uint8Array, sync: boolean): Promise<void>;
  /** Cuts the file to `length` bytes; with `sync`, flushes it. Later appends go to the new end. */
  truncate(length: number, sync: boolean): Promise<void>;
  /** Whether the open file still has a name (not deleted, nor its directory, since it was opened). */
  linked(): Promise<boolean>;
  /** Closes the handle (calling it again does nothing). */
  close(): Promise<void>;
}

/**
 * Open `path` for appending (`O_APPEND`; created when missing), and keep it
 * open: each append is one write and, when asked, one `fdatasync`, with no
 * open or close per write. A symlink at `path` is refused (`ELOOP`, where
 * the platform has `O_NOFOLLOW`), not followed.
 *
 * @param path the file
 * @param mode the permission bits, set on the open handle (`fchmod`)
 * @returns the open file
 * @throws {Error} an open error of the runtime (permissions, a missing directory, `ELOOP` for a symlink)
 */
export async function openAppendFile(path: string, mode: number): Promise<AppendFile> {
  const f = await fs();
  const handle = await f.open(path, (await openFlags()).append, mode);
  let closed = false;
  try {
    await handle.chmod(mode);
  } catch (error) {
    await handle.close().catch(() => {});
    throw error;
  }
  return {
    append: async (data, sync) => {
      let done = 0;
      while (done < data.length) {
        const { bytesWritten } = await handle.write(data, done, data.length - done);
        done += bytesWritten;
      }
      if (sync) await handle.datasync();
    },
    truncate: async (length, sync) => {
      await handle.truncate(length);
      if (sync) await handle.datasync();
    },
    linked: async () => (await handle.stat()).nlink > 0,
    close: async () => {
      if (closed) return;
      closed = true;
      await handle.close();
    },
  };
}
