/**
 * The shared building blocks of the file backends (backends/file/):
 * the inter-process mutex across real OS processes (kills and stops
 * included), the live-lock check, the open-file registry shared by every
 * kind of file backend, and the snapshot helpers.
 */
import { type ChildLines, childLines } from "./support/child_lines.ts";
import { afterAll, afterEach, describe, expect, test } from "bun:test";
import {
  chmodSync,
  existsSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmSync,
  statSync,
  symlinkSync,
  utimesSync,
  writeFileSync,
} from "node:fs";
import { hostname, tmpdir } from "node:os";
import { join } from "node:path";
import { FileDurability } from "../backends/file/durability.ts";
import { FileCorruptError } from "../backends/file/corrupt_error.ts";
import { findLiveLockHolder, isLockHeldByLiveProcess } from "../backends/file/lock.ts";
import {
  FileMutex,
  type FileMutexHandle,
  FileMutexLostError,
  FileMutexTimeoutError,
  withFileMutex,
} from "../backends/file/mutex.ts";
import { claimOpenFile, openFileOwner, releaseOpenFile } from "../backends/file/open_files.ts";
import { parseJsonBytes, readJsonSnapshot, writeSnapshot } from "../backends/file/snapshot.ts";
import { removeLeftoverFiles } from "../backends/file/leftovers.ts";
import {
  appendToFile,
  openAppendFile,
  truncateFile,
  writeFileAtomic,
  writeFilePinned,
} from "../src/runtime/fs.ts";

const FIXTURE = join(import.meta.dir, "fixtures", "mutex_holder.ts");
const root = mkdtempSync(join(tmpdir(), "botmesh-file-support-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));

let counter = 0;
function freshFile(): string {
  const dir = join(root, `t${counter++}`);
  mkdirSync(dir);
  return join(dir, "journal.json");
}

type Child = ReturnType<typeof Bun.spawn<"ignore", "pipe", "inherit">>;
const children: Child[] = [];
const cleanups: (() => Promise<unknown> | unknown)[] = [];
afterEach(async () => {
  for (const child of children.splice(0)) {
    try {
      child.kill("SIGCONT");
      child.kill("SIGKILL");
    } catch {
      // already gone
    }
    await child.exited;
  }
  for (const cleanup of cleanups.splice(0)) await cleanup();
});

/** Reads a child's stdout line by line; `next(prefix)` waits for the next line that starts with it. */
function lines(child: Child): ChildLines {
  return childLines(child.stdout, "the child", 5_000);
}

function spawnHolder(file: string, staleLockMs: number): { child: Child; out: ReturnType<typeof lines> } {
  const child = Bun.spawn([process.execPath, FIXTURE, "hold", file, String(staleLockMs)], {
    stdin: "ignore",
    stdout: "pipe",
    stderr: "inherit",
  });
  children.push(child);
  return { child, out: lines(child) };
}

function mutexNonce(file: string): string | undefined {
  return JSON.parse(readFileSync(`${file}.mutex`, "utf8")).nonce;
}

async function rejection(promise: Promise<unknown>): Promise<Error> {
  try {
    await promise;
  } catch (error) {
    return error as Error;
  }
  throw new Error("expected a rejection");
}

function deadPid(): number {
  const child = Bun.spawnSync(["true"]);
  return child.pid;
}

describe("FileMutex across processes", () => {
  test("3 processes increment one counter under the mutex: exact total, never two holders at once", async () => {
    const file = freshFile();
    writeFileSync(file, "0");
    const N = 120;
    const procs = Array.from({ length: 3 }, () =>
      Bun.spawn([process.execPath, FIXTURE, "count", file, String(N)], { stdout: "pipe", stderr: "inherit" })
    );
    children.push(...(procs as Child[]));
    const outputs = await Promise.all(procs.map((p) => new Response(p.stdout).text()));
    expect(await Promise.all(procs.map((p) => p.exited))).toEqual([0, 0, 0]);
    expect(outputs.map((o) => o.trim())).toEqual([`DONE ${N} 0`, `DONE ${N} 0`, `DONE ${N} 0`]);
    expect(Number(readFileSync(file, "utf8"))).toBe(3 * N);
    expect(existsSync(`${file}.mutex`)).toBe(false); // every release removed its own mutex
    expect(existsSync(`${file}.mutex.break`)).toBe(false);
  }, 15_000);

  test("a SIGKILLed holder's mutex is broken at once by the next acquirer", async () => {
    const file = freshFile();
    const { child, out } = spawnHolder(file, 30_000);
    const heldLine = await out.next("HELD");
    expect(mutexNonce(file)).toBe(heldLine.split(" ")[1]);
    child.kill("SIGKILL");
    await child.exited;
    const started = Date.now();
    const held = await new FileMutex(file, { timeoutMs: 2_000 }).acquire();
    expect(Date.now() - started).toBeLessThan(1_000); // not after staleLockMs (30 s)
    expect(mutexNonce(file)).toBe(held.nonce);
    expect(await held.release()).toBe(true);
    expect(existsSync(`${file}.mutex`)).toBe(false);
  }, 10_000);

  test("a SIGSTOPped holder is broken only after staleLockMs, is never killed, and learns it lost the mutex", async () => {
    const file = freshFile();
    const STALE = 1_000;
    const { child, out } = spawnHolder(file, STALE);
    const childNonce = (await out.next("HELD")).split(" ")[1];
    await Bun.sleep(250); // a heartbeat or two
    child.kill("SIGSTOP");
    const stoppedAt = Date.now();
    // Not broken before staleLockMs: a short attempt times out, naming the mutex and the holder.
    const early = await rejection(new FileMutex(file, { staleLockMs: STALE, timeoutMs: 150 }).acquire());
    expect(early).toBeInstanceOf(FileMutexTimeoutError);
    expect(early.message).toContain(`${file}.mutex`);
    expect(early.message).toContain(`pid ${child.pid}`);
    expect((early as FileMutexTimeoutError).holder?.pid).toBe(child.pid);
    expect(mutexNonce(file)).toBe(childNonce);
    // Then broken once its mtime is older than staleLockMs.
    const held = await new FileMutex(file, { staleLockMs: STALE, timeoutMs: 5_000 }).acquire();
    const waited = Date.now() - stoppedAt;
    expect(waited).toBeGreaterThanOrEqual(STALE - STALE / 3 - 50); // the last refresh was at most heartbeatMs before the stop
    expect(waited).toBeLessThan(STALE + 1_500);
    expect(mutexNonce(file)).toBe(held.nonce);
    expect(child.exitCode).toBe(null); // nothing was killed
    expect(() => process.kill(child.pid, 0)).not.toThrow();
    // Resumed, the old holder's heartbeat finds another nonce: it stops, flags it lost, and leaves ours alone.
    child.kill("SIGCONT");
    await out.next("LOST", 3_000);
    expect(mutexNonce(file)).toBe(held.nonce);
    expect(await held.release()).toBe(true);
  }, 10_000);

  test("a live holder past staleLockMs is not broken as long as its heartbeat refreshes the mtime", async () => {
    const file = freshFile();
    const STALE = 1_000;
    const { child, out } = spawnHolder(file, STALE);
    const childNonce = (await out.next("HELD")).split(" ")[1];
    const started = Date.now();
    const error = await rejection(new FileMutex(file, { staleLockMs: STALE, timeoutMs: 3_500 }).acquire());
    expect(Date.now() - started).toBeGreaterThanOrEqual(3_500 - 5);
    expect(error).toBeInstanceOf(FileMutexTimeoutError);
    expect((error as FileMutexTimeoutError).waitedMs).toBeGreaterThan(3 * STALE);
    expect(mutexNonce(file)).toBe(childNonce);
    expect(Date.now() - statSync(`${file}.mutex`).mtimeMs).toBeLessThan(STALE);
    expect(out.all().includes("LOST")).toBe(false);
    child.kill("SIGKILL");
    await child.exited;
  }, 10_000);
});

describe("FileMutex in one process", () => {
  test("release never removes someone else's mutex; a second release does nothing", async () => {
    const file = freshFile();
    const held = await new FileMutex(file).acquire();
    const other = JSON.stringify({ pid: process.pid + 1, hostname: hostname(), nonce: "someone-else" });
    writeFileSync(`${file}.mutex`, other); // as if it had been broken and taken by another process
    expect(await held.stillHeld()).toBe(false);
    expect((await rejection(held.assertHeld()))).toBeInstanceOf(FileMutexLostError);
    expect(await held.release()).toBe(false);
    expect(readFileSync(`${file}.mutex`, "utf8")).toBe(other);
    expect(await held.release()).toBe(false);
    expect(readdirNames(file)).toEqual(["journal.json.mutex"]); // nothing left aside
  });

  test("release of a mutex taken over never moves the new holder's mutex aside (not even for a moment)", async () => {
    const file = freshFile();
    const other = JSON.stringify({ pid: process.pid + 1, hostname: hostname(), nonce: "someone-else" });
    // Not yet known lost: release reads the file and leaves it in place (a rename aside and back changes its ctime).
    const held = await new FileMutex(file).acquire();
    writeFileSync(`${file}.mutex`, other);
    const before = statSync(`${file}.mutex`, { bigint: true });
    await Bun.sleep(20);
    expect(await held.release()).toBe(false);
    const after = statSync(`${file}.mutex`, { bigint: true });
    expect([after.ino, after.ctimeNs, after.nlink]).toEqual([before.ino, before.ctimeNs, before.nlink]);
    expect(held.lost).toBe(true);
    rmSync(`${file}.mutex`);
    // Known lost (the heartbeat saw it): release does not even look.
    const lost = await new FileMutex(file, { staleLockMs: 1_000, heartbeatMs: 100 }).acquire();
    writeFileSync(`${file}.mutex`, other);
    await Bun.sleep(250);
    expect(lost.lost).toBe(true);
    const seen = statSync(`${file}.mutex`, { bigint: true });
    await Bun.sleep(20);
    expect(await lost.release()).toBe(false);
    expect(statSync(`${file}.mutex`, { bigint: true }).ctimeNs).toBe(seen.ctimeNs);
    expect(readFileSync(`${file}.mutex`, "utf8")).toBe(other);
    expect(readdirNames(file)).toEqual(["journal.json.mutex"]);
  });

  test("a holder's heartbeat flags a lost mutex", async () => {
    const file = freshFile();
    const held = await new FileMutex(file, { staleLockMs: 1_000, heartbeatMs: 100 }).acquire();
    cleanups.push(() => held.release());
    expect(held.lost).toBe(false);
    await held.assertHeld();
    writeFileSync(`${file}.mutex`, JSON.stringify({ pid: 1, nonce: "x" }));
    await Bun.sleep(250);
    expect(held.lost).toBe(true);
  });

  test("holders in one process wait for each other; an in-process holder is never broken, even with an old mtime", async () => {
    const file = freshFile();
    const mutex = new FileMutex(file, { staleLockMs: 1_000, heartbeatMs: 150, timeoutMs: 400 });
    const first = await mutex.acquire();
    const old = new Date(Date.now() - 60_000);
    utimesSync(`${file}.mutex`, old, old);
    const error = await rejection(mutex.acquire());
    expect(error).toBeInstanceOf(FileMutexTimeoutError);
    expect(mutexNonce(file)).toBe(first.nonce);
    // Queued acquirers get it in turn once it is released.
    const order: number[] = [];
    const waiting = [1, 2, 3].map((i) =>
      withFileMutex(file, { timeoutMs: 2_000 }, async () => {
        order.push(i);
        await Bun.sleep(5);
        order.push(-i);
      })
    );
    await Bun.sleep(30);
    expect(await first.release()).toBe(true);
    await Promise.all(waiting);
    for (let k = 0; k < order.length; k += 2) expect(order[k + 1]).toBe(-order[k]); // never interleaved
    expect(existsSync(`${file}.mutex`)).toBe(false);
  });

  test("a mutex of a dead pid, or of this pid with an unknown nonce, is broken at once", async () => {
    for (const pid of [deadPid(), process.pid]) {
      const file = freshFile();
      writeFileSync(`${file}.mutex`, JSON.stringify({ pid, hostname: hostname(), nonce: "previous" }));
      const started = Date.now();
      const held = await new FileMutex(file, { timeoutMs: 1_000 }).acquire();
      expect(Date.now() - started).toBeLessThan(500);
      expect(mutexNonce(file)).toBe(held.nonce);
      await held.release();
    }
  });

  test("a mutex of another host, or unreadable, is broken only once not refreshed for staleLockMs", async () => {
    for (const text of [JSON.stringify({ pid: 1, hostname: "other-host", nonce: "n" }), ""]) {
      const file = freshFile();
      writeFileSync(`${file}.mutex`, text);
      const error = await rejection(new FileMutex(file, { staleLockMs: 5_000, timeoutMs: 50 }).acquire());
      expect(error).toBeInstanceOf(FileMutexTimeoutError);
      expect(error.message).toContain(text ? "pid 1 on host other-host" : "an unreadable holder");
      const old = new Date(Date.now() - 6_000);
      utimesSync(`${file}.mutex`, old, old);
      const held = await new FileMutex(file, { staleLockMs: 5_000, timeoutMs: 500 }).acquire();
      expect(mutexNonce(file)).toBe(held.nonce);
      await held.release();
    }
  });

  test("withFileMutex returns fn's result, releases after a throw, and passes the handle", async () => {
    const file = freshFile();
    let seen: FileMutexHandle | undefined;
    expect(await withFileMutex(file, undefined, (held) => {
      seen = held;
      return 42;
    })).toBe(42);
    expect(seen!.released).toBe(true);
    const boom = await rejection(withFileMutex(file, {}, () => {
      expect(existsSync(`${file}.mutex`)).toBe(true);
      throw new Error("boom");
    }));
    expect(boom.message).toBe("boom");
    expect(existsSync(`${file}.mutex`)).toBe(false);
  });

  test("options are validated: TypeError or RangeError naming the option", async () => {
    const file = freshFile();
    const cases: [unknown, ErrorConstructor, RegExp][] = [
      [null, TypeError, /options must be an object/],
      [{ timeoutMs: "1" }, TypeError, /"timeoutMs"/],
      [{ timeoutMs: -1 }, RangeError, /"timeoutMs"/],
      [{ timeoutMs: Number.NaN }, TypeError, /"timeoutMs"/],
      [{ staleLockMs: "1000" }, TypeError, /"staleLockMs"/],
      [{ staleLockMs: 50 }, RangeError, /"staleLockMs".*at least 1000/],
      [{ staleLockMs: 999 }, RangeError, /"staleLockMs".*at least 1000/],
      [{ staleLockMs: Infinity }, RangeError, /"staleLockMs"/],
      [{ heartbeatMs: 0 }, RangeError, /"heartbeatMs"/],
      [{ staleLockMs: 1_000, heartbeatMs: 1_000 }, RangeError, /"heartbeatMs".*below "staleLockMs"/],
      [{ heartbeatMs: true }, TypeError, /"heartbeatMs"/],
      [{ label: "" }, TypeError, /"label"/],
    ];
    for (const [options, type, message] of cases) {
      expect(() => new FileMutex(file, options as never)).toThrow(type);
      expect(() => new FileMutex(file, options as never)).toThrow(message);
      const error = await rejection(withFileMutex(file, options as never, () => 1));
      expect(error).toBeInstanceOf(type);
    }
    expect(() => new FileMutex("")).toThrow(TypeError);
    const ok = new FileMutex(file, { staleLockMs: 1_200 });
    expect([ok.staleLockMs, ok.heartbeatMs, ok.timeoutMs, ok.mutexPath]).toEqual([1_200, 400, 10_000, `${file}.mutex`]);
    expect(new FileMutex(file).heartbeatMs).toBe(10_000);
    expect(new FileMutex(file, { timeoutMs: Infinity }).timeoutMs).toBe(Infinity);
  });
});

function readdirNames(file: string): string[] {
  return readdirSync(join(file, "..")).sort();
}

describe("the single-process lock seen from a shared journal", () => {
  test("isLockHeldByLiveProcess: a FileDurability's lock, in this process and in another", async () => {
    const file = freshFile();
    expect(await isLockHeldByLiveProcess(file)).toBe(false);
    const backend = new FileDurability({ path: file, fsync: false });
    await backend.open();
    expect(await isLockHeldByLiveProcess(file)).toBe(true);
    expect((await findLiveLockHolder(file))?.pid).toBe(process.pid);
    await backend.close();
    expect(await isLockHeldByLiveProcess(file)).toBe(false);

    const sleeper = Bun.spawn(["sleep", "30"]);
    cleanups.push(() => sleeper.kill());
    writeFileSync(`${file}.lock`, JSON.stringify({ pid: sleeper.pid, hostname: hostname(), nonce: "s" }));
    expect(await isLockHeldByLiveProcess(file)).toBe(true);
    writeFileSync(`${file}.lock`, JSON.stringify({ pid: deadPid(), hostname: hostname(), nonce: "d" }));
    expect(await isLockHeldByLiveProcess(file)).toBe(false);
    writeFileSync(`${file}.lock`, JSON.stringify({ pid: process.pid, hostname: hostname(), nonce: "previous" }));
    expect(await isLockHeldByLiveProcess(file)).toBe(false); // our pid, not our nonce: a previous process
    writeFileSync(`${file}.lock`, JSON.stringify({ pid: 1, hostname: "other-container", nonce: "o" }));
    expect(await isLockHeldByLiveProcess(file)).toBe(true);
    const old = new Date(Date.now() - 60_000);
    utimesSync(`${file}.lock`, old, old);
    expect(await isLockHeldByLiveProcess(file)).toBe(false);
    expect(await isLockHeldByLiveProcess(file, { staleLockMs: 120_000 })).toBe(true);
  });

  test("the open-file registry: a FileDurability and another kind of file backend refuse each other in one process", async () => {
    const file = freshFile();
    const backend = new FileDurability({ path: file, fsync: false });
    await backend.open();
    const journal = {};
    expect(() => claimOpenFile(file, journal, "FileEventJournal")).toThrow(
      `FileEventJournal: ${file} is already open in this process through a FileDurability; close that one first`,
    );
    await backend.close();
    claimOpenFile(file, journal, "FileEventJournal");
    claimOpenFile(file, journal, "FileEventJournal"); // again: no-op
    expect(openFileOwner(file)).toBe(journal);
    const error = await rejection(new FileDurability({ path: file }).open());
    expect(error.message).toContain(`${file} is already open in this process through a FileEventJournal`);
    expect(releaseOpenFile(file, {})).toBe(false);
    expect(releaseOpenFile(file, journal)).toBe(true);
    expect(openFileOwner(file)).toBe(undefined);
  });
});

describe("snapshot helpers", () => {
  test("writeSnapshot keeps the file's mode, gives a new file 0600; readJsonSnapshot gives the byte offset of damage", async () => {
    const file = freshFile();
    await writeSnapshot(file, '{"a":1}', { fsync: false });
    expect(statSync(file).mode & 0o777).toBe(0o600);
    chmodSync(file, 0o640);
    await writeSnapshot(file, '{"a":2}');
    expect(statSync(file).mode & 0o777).toBe(0o640);
    expect((await readJsonSnapshot(file))?.value).toEqual({ a: 2 });
    expect(await readJsonSnapshot(`${file}.missing`)).toBe(null);
    writeFileSync(file, '{"a":2,,}');
    const error = await rejection(readJsonSnapshot(file, "FileEventJournal"));
    expect(error).toBeInstanceOf(FileCorruptError);
    expect((error as FileCorruptError).offset).toBe(7);
    expect(error.message).toStartWith(`FileEventJournal: ${file} is damaged at byte 7`);
    const bad = new Uint8Array([0x5b, 0x22, 0xff, 0x22, 0x5d]);
    expect(() => parseJsonBytes(file, bad)).toThrow(/at byte 2: invalid UTF-8/);
  });
});

describe("a symlink planted beside a file is never written through nor chmod'ed", () => {
  const VICTIM = "root:x:0:0:root:/root:/bin/bash\n";

  /** A file of the bot's user (mode 0644) and a symlink to it at `link`. */
  function plant(link: string): string {
    const victim = join(link, "..", `victim-${counter++}`);
    writeFileSync(victim, VICTIM);
    chmodSync(victim, 0o644);
    symlinkSync(victim, link);
    return victim;
  }

  function expectUntouched(victim: string): void {
    expect(readFileSync(victim, "utf8")).toBe(VICTIM);
    expect(statSync(victim).mode & 0o777).toBe(0o644);
  }

  test("writeSnapshot: a rewrite goes to a new <file>.<random>.tmp, never to a planted <file>.tmp", async () => {
    const file = freshFile();
    await writeSnapshot(file, '{"a":1}', { fsync: false });
    const victim = plant(`${file}.tmp`);
    await writeSnapshot(file, '{"secret":"chat text"}', { mode: 0o600 });
    expectUntouched(victim);
    expect(readFileSync(file, "utf8")).toBe('{"secret":"chat text"}');
    expect(statSync(file).mode & 0o777).toBe(0o600);
    const left = readdirSync(join(file, "..")).filter((name) => name.endsWith(".tmp"));
    expect(left, "only the planted link").toEqual(["journal.json.tmp"]);
  });

  test("writeFileAtomic: a temporary name that exists (a symlink) is refused with EEXIST and left alone", async () => {
    const file = freshFile();
    const victim = plant(`${file}.given.tmp`);
    const error = await rejection(writeFileAtomic(file, "x", { tempPath: `${file}.given.tmp`, mode: 0o600 }));
    expect((error as { code?: string }).code).toBe("EEXIST");
    expectUntouched(victim);
    expect(readFileSync(`${file}.given.tmp`, "utf8"), "the link is not removed").toBe(VICTIM);
    expect(existsSync(file)).toBe(false);
  });

  test("writeFileAtomic: a failed rename removes the temporary file", async () => {
    const file = freshFile();
    mkdirSync(file);
    writeFileSync(join(file, "inside"), "x"); // a non-empty directory: the rename over it fails
    const error = await rejection(writeFileAtomic(file, "x", { fsync: false }));
    expect(["EISDIR", "ENOTEMPTY", "EEXIST"]).toContain(String((error as { code?: string }).code));
    expect(readdirSync(join(file, "..")).filter((name) => name.endsWith(".tmp"))).toEqual([]);
  });

  test("appendToFile, openAppendFile, truncateFile, writeFilePinned refuse a symlink at the name", async () => {
    const file = freshFile();
    const victim = plant(`${file}.log`);
    await rejection(appendToFile(`${file}.log`, "secret chat text\n", { fsync: false, mode: 0o600 }));
    await rejection(openAppendFile(`${file}.log`, 0o600));
    await rejection(truncateFile(`${file}.log`, 0, { fsync: false }));
    expect(((await rejection(writeFilePinned(`${file}.log`, "secret", { mode: 0o600 }))) as { code?: string }).code)
      .toBe("EEXIST");
    expectUntouched(victim);
  });

  test("openAppendFile sets the mode on the open file; removeLeftoverFiles with ownTempsOlderThanMs 0 removes young temps", async () => {
    const file = freshFile();
    writeFileSync(`${file}.log`, "");
    chmodSync(`${file}.log`, 0o644);
    const log = await openAppendFile(`${file}.log`, 0o600);
    await log.append(new TextEncoder().encode("a\n"), false);
    await log.close();
    expect(statSync(`${file}.log`).mode & 0o777).toBe(0o600);
    const young = `${file}.${crypto.randomUUID()}.tmp`;
    const lockTemp = `${file}.lock.n1.tmp`;
    writeFileSync(young, "x");
    writeFileSync(lockTemp, "x");
    expect(await removeLeftoverFiles(file, 60_000)).toEqual([]);
    expect(await removeLeftoverFiles(file, 60_000, { ownTempsOlderThanMs: 0 })).toEqual([young]);
    expect(existsSync(lockTemp), "another's temp younger than olderThanMs is kept").toBe(true);
  });
});

describe("the framed log", () => {
  test("crc32 is CRC-32/IEEE; a record is `R <length> <crc> <json>\\n`", async () => {
    const { crc32, frameLogRecord } = await import("../backends/file/log_records.ts");
    expect(crc32(new TextEncoder().encode("123456789"))).toBe(0xcbf43926);
    expect(new TextDecoder().decode(frameLogRecord('{"a":"é"}'))).toBe(`R 10 ${crc32(new TextEncoder().encode('{"a":"é"}')).toString(16).padStart(8, "0")} {"a":"é"}\n`);
  });

  test("scanLogRecords: whole records, a torn tail ends the log, damage before intact records is an error", async () => {
    const { frameLogRecord, scanLogRecords } = await import("../backends/file/log_records.ts");
    const a = frameLogRecord('{"n":1}');
    const b = frameLogRecord('{"n":2}');
    const c = frameLogRecord('{"n":3}');
    const join3 = (...parts: Uint8Array[]) => {
      const out = new Uint8Array(parts.reduce((n, p) => n + p.length, 0));
      let at = 0;
      for (const p of parts) (out.set(p, at), at += p.length);
      return out;
    };
    const whole = join3(a, b, c);
    expect(scanLogRecords("/x.log", whole, "T").records.map((r) => r.value)).toEqual([{ n: 1 }, { n: 2 }, { n: 3 }]);
    expect(scanLogRecords("/x.log", whole, "T").end).toBe(whole.length);
    for (let cut = a.length + b.length; cut < whole.length; cut++) {
      const torn = scanLogRecords("/x.log", whole.subarray(0, cut), "T");
      expect(torn.records.length).toBe(2);
      expect(torn.end).toBe(a.length + b.length);
    }
    const damaged = whole.slice();
    damaged[a.length + 12] ^= 0x20; // inside b's payload: its checksum fails, c follows
    let error: unknown = null;
    try {
      scanLogRecords("/x.log", damaged, "T");
    } catch (e) {
      error = e;
    }
    expect(error).toBeInstanceOf(FileCorruptError);
    expect((error as InstanceType<typeof FileCorruptError>).offset).toBe(a.length);
    expect((error as Error).message).toContain("log record 2 is damaged");
    const lastZeroed = whole.slice();
    lastZeroed.fill(0, a.length + b.length + 14, whole.length - 2); // c whole (header, length, newline), its middle zeros
    const scanned = scanLogRecords("/x.log", lastZeroed, "T");
    expect(scanned.records.map((r) => r.value)).toEqual([{ n: 1 }, { n: 2 }]);
    expect(scanned.end).toBe(a.length + b.length);
  });
});
