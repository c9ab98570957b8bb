/**
 * `@botmesh/durable/file`: a durability backend that keeps both journals in
 * one JSON snapshot file and an append-only log beside it, for a bot that
 * runs as one process.
 *
 * - The state lives in memory (a {@link MemoryDurability}). Each group commit
 *   appends one record to the log `<path>.log` (the records it changed, as
 *   they are now), flushed with `fdatasync`: its cost does not grow with the
 *   journals. Once the log holds twice the snapshot's bytes (at least
 *   256 KiB), the next commit writes a new snapshot instead (a new temporary
 *   file `<path>.<random>.tmp`, created exclusively, `fsync`, an atomic
 *   rename over `<path>`, an `fsync` of the directory) naming a new
 *   generation of the log, and empties the log.
 *   `open()` reads the snapshot and replays the log records of its
 *   generation (others are left over from before a compaction, and skipped).
 * - Each log record carries its length and a CRC-32. A torn end of the log
 *   (the last append before a crash, never acknowledged: a record cut short,
 *   or a whole one whose middle never reached the disk, failing its
 *   checksum; no intact record after it) is cut off at `open()`, its bytes
 *   kept in `<path>.log.torn-<n>` beside the log, and reported to `open()`'s
 *   `warn` as `journal-torn-tail`. A damaged record with intact records
 *   after it makes `open()` fail naming the log and the byte offset (both
 *   files left untouched).
 * - `close()` writes a last snapshot without a log (and deletes the log), so
 *   a closed store is one snapshot, as earlier versions wrote it and read it;
 *   a snapshot with a log beside it is format version 3, which earlier
 *   versions refuse to open rather than miss the log.
 * - Group commit: operations that arrive while a write is under way share
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
export {
  FileCorruptError,
  FileDurability,
  type FileDurabilityOptions,
  type FileDurabilityStats,
  FileLockedError,
} from "./durability.ts";
