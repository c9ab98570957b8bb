import { afterEach, describe, expect, test } from "bun:test";
import {
  chmodSync,
  existsSync,
  lstatSync,
  mkdirSync,
  mkdtempSync,
  readdirSync,
  readFileSync,
  rmdirSync,
  rmSync,
  statSync,
  symlinkSync,
  utimesSync,
  writeFileSync,
} from "node:fs";
import { hostname, tmpdir } from "node:os";
import { join, relative } from "node:path";
import {
  FileCorruptError,
  FileDurability,
  fileDurabilityTestHooks,
  FileLockedError,
  readFileDurabilityState,
  simulateCrash,
} from "../backends/file/durability.ts";
import { snapshotWriteTestHooks } from "../backends/file/snapshot.ts";
import { MemoryDurability } from "../backends/memory/durability.ts";
import type { ClaimOptions, NewInboundRecord, NewOutboxEntry, OpenWarning } from "../src/contract.ts";

const dirs: string[] = [];
const opened: FileDurability[] = [];

afterEach(async () => {
  fileDurabilityTestHooks.beforeWrite = undefined;
  snapshotWriteTestHooks.beforeWrite = undefined;
  for (const b of opened.splice(0)) {
    while (b.isOpen) await b.close().catch(() => {});
  }
  for (const dir of dirs.splice(0)) rmSync(dir, { recursive: true, force: true });
});

function tempDir(): string {
  const dir = mkdtempSync(join(tmpdir(), "botmesh-file-test-"));
  dirs.push(dir);
  return dir;
}

function backendAt(path: string, fsync?: boolean): FileDurability {
  const b = new FileDurability(fsync === undefined ? { path } : { path, fsync });
  opened.push(b);
  return b;
}

async function openAt(path: string): Promise<FileDurability> {
  const b = backendAt(path);
  await b.open();
  return b;
}

const A: ClaimOptions = { owner: "A", incarnation: "a1", leaseMs: 60_000 };
const B: ClaimOptions = { owner: "B", incarnation: "b1", leaseMs: 60_000 };

function msg(id: string, chatId = "c1", payload: NewInboundRecord["payload"] = { text: id }): NewInboundRecord {
  return { id, kind: "message", chatId, provider: "test", payload, receivedAt: 1_700_000_000_000 };
}

function send(key: string, chatId = "c1"): NewOutboxEntry {
  return { key, chatId, content: { text: key }, contentHash: `h-${key}`, inboundId: null };
}

/** Makes every write fail with ENOSPC (as a full disk) until the returned function is called. */
function failWrites(): () => void {
  fileDurabilityTestHooks.beforeWrite = () => {
    throw Object.assign(new Error("ENOSPC: no space left on device, write"), { code: "ENOSPC" });
  };
  return () => {
    fileDurabilityTestHooks.beforeWrite = undefined;
  };
}

/** The state on disk: the snapshot with its log applied. */
async function stored(path: string): Promise<{ inbox: any[]; outbox: any[] } & Record<string, any>> {
  return (await readFileDurabilityState(path)) as { inbox: any[]; outbox: any[] };
}

async function rejection(promise: Promise<unknown>): Promise<Error> {
  try {
    await promise;
  } catch (error) {
    return error as Error;
  }
  throw new Error("expected a rejection");
}

/** The pid of a process that has exited (and was reaped). */
function deadPid(): number {
  const child = Bun.spawnSync(["true"]);
  return child.pid;
}

describe("FileDurability options", () => {
  test("name, scope, path", () => {
    const b = new FileDurability({ path: "./x/bot.json" });
    expect(b.name).toBe("file");
    expect(b.scope).toBe("process");
    expect(b.path).toBe("./x/bot.json");
    expect(b.isOpen).toBe(false);
  });

  test("a missing or empty path is a TypeError naming `path`", () => {
    // @ts-expect-error wrong on purpose
    expect(() => new FileDurability()).toThrow(TypeError);
    // @ts-expect-error wrong on purpose
    expect(() => new FileDurability()).toThrow(/"path"/);
    // @ts-expect-error wrong on purpose
    expect(() => new FileDurability({})).toThrow(/option "path" must be a non-empty string, got undefined/);
    expect(() => new FileDurability({ path: "" })).toThrow(/option "path" must be a non-empty string, got ""/);
    // @ts-expect-error wrong on purpose
    expect(() => new FileDurability({ path: 42 })).toThrow(TypeError);
    expect(() => new FileDurability({ path: "a\0b" })).toThrow(/"path"/);
  });

  test("fsync must be a boolean: a TypeError naming `fsync`", () => {
    // @ts-expect-error wrong on purpose
    expect(() => new FileDurability({ path: "x.json", fsync: "yes" })).toThrow(TypeError);
    // @ts-expect-error wrong on purpose
    expect(() => new FileDurability({ path: "x.json", fsync: 1 })).toThrow(/option "fsync" must be a boolean, got 1/);
    expect(new FileDurability({ path: "x.json", fsync: false }).name).toBe("file");
  });
});

describe("open and close", () => {
  test("operations before open and after close reject with a clear error", async () => {
    const path = join(tempDir(), "bot.json");
    const b = backendAt(path);
    const before = await rejection(b.inbox.get("x"));
    expect(before.message).toMatch(/FileDurability .*bot\.json is not open: call open\(\) or start the bot/);
    await b.open();
    expect(await b.inbox.get("x")).toBe(null);
    await b.close();
    const after = await rejection(b.outbox.list());
    expect(after.message).toContain(`FileDurability ${path} is not open`);
  });

  test("a new file is created at open, with its directory; the lock file exists while open", async () => {
    const dir = join(tempDir(), "nested", "deeper");
    const path = join(dir, "bot.json");
    const b = await openAt(path);
    const text = readFileSync(path, "utf8");
    expect(JSON.parse(text)).toEqual({ format: "@botmesh/durable/file", version: 1, outboxSeq: 0, inbox: [], outbox: [] });
    const lock = JSON.parse(readFileSync(`${path}.lock`, "utf8"));
    expect(lock.pid).toBe(process.pid);
    expect(typeof lock.hostname).toBe("string");
    expect(typeof lock.startedAt).toBe("string");
    expect(b.stats.rewrites).toBe(1);
    await b.close();
    expect(existsSync(`${path}.lock`)).toBe(false);
    expect(readdirSync(dir).filter((name) => name.endsWith(".tmp"))).toEqual([]);
  });

  test("open/close are counted on one instance: loaded at the first open, released at the last close", async () => {
    const path = join(tempDir(), "bot.json");
    const b = backendAt(path);
    await Promise.all([b.open(), b.open()]);
    await b.open();
    await b.inbox.admit(msg("m1"));
    await b.close();
    await b.close();
    expect(b.isOpen).toBe(true);
    expect((await b.inbox.get("m1"))?.state).toBe("pending");
    expect(existsSync(`${path}.lock`)).toBe(true);
    await b.close();
    expect(b.isOpen).toBe(false);
    expect(existsSync(`${path}.lock`)).toBe(false);
    await b.close(); // closing a closed backend does nothing
    // Reopening the same instance loads the file again.
    await b.open();
    expect((await b.inbox.get("m1"))?.state).toBe("pending");
  });

  test("close waits for operations already called and writes them", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const admits = Array.from({ length: 20 }, (_, i) => b.inbox.admit(msg(`m${i}`)));
    await b.close();
    expect((await Promise.all(admits)).every((r) => r !== null)).toBe(true);
    expect(JSON.parse(readFileSync(path, "utf8")).inbox.length).toBe(20);
  });
});

describe("the lock", () => {
  test("a second FileDurability on the same file in this process is rejected until the first is closed", async () => {
    const dir = tempDir();
    const path = join(dir, "bot.json");
    const first = await openAt(path);
    const second = backendAt(relative(process.cwd(), path)); // same file through another spelling
    const error = await rejection(second.open());
    expect(error.message).toContain(`${path} is already open in this process`);
    expect(existsSync(`${path}.lock`)).toBe(true); // the first one's lock is untouched
    await first.inbox.admit(msg("m1"));
    await first.close();
    await second.open();
    expect((await second.inbox.get("m1"))?.state).toBe("pending");
  });

  test("the same file through a symlinked directory is recognised as already open", async () => {
    const dir = tempDir();
    mkdirSync(join(dir, "real"));
    symlinkSync(join(dir, "real"), join(dir, "link"));
    const first = await openAt(join(dir, "real", "bot.json"));
    const second = backendAt(join(dir, "link", "bot.json"));
    expect((await rejection(second.open())).message).toContain(`${join(dir, "real", "bot.json")} is already open in this process`);
    expect(JSON.parse(readFileSync(join(dir, "real", "bot.json.lock"), "utf8")).pid).toBe(process.pid);
    await first.close();
    await second.open();
  });

  test("a lock left by a dead process is broken at once", async () => {
    const path = join(tempDir(), "bot.json");
    const pid = deadPid();
    writeFileSync(`${path}.lock`, JSON.stringify({ pid, hostname: hostname(), startedAt: "2020-01-01T00:00:00.000Z" }));
    const b = await openAt(path);
    expect(JSON.parse(readFileSync(`${path}.lock`, "utf8")).pid).toBe(process.pid);
    await b.close();
  });

  test("a lock holding this process's pid that this process does not hold is broken (a restarted container)", async () => {
    const path = join(tempDir(), "bot.json");
    writeFileSync(`${path}.lock`, JSON.stringify({ pid: process.pid }));
    const b = await openAt(path);
    await b.inbox.admit(msg("m1"));
    await b.close();
  });

  test("an empty lock file (a crash right after its creation) is broken once unchanged for 10 s", async () => {
    const path = join(tempDir(), "bot.json");
    writeFileSync(`${path}.lock`, "");
    const old = new Date(Date.now() - 11_000);
    utimesSync(`${path}.lock`, old, old);
    const b = await openAt(path);
    expect(JSON.parse(readFileSync(`${path}.lock`, "utf8")).pid).toBe(process.pid);
  });

  test("a lock of a live process is respected: the error names the pid and the lock file", async () => {
    const path = join(tempDir(), "bot.json");
    const sleeper = Bun.spawn(["sleep", "30"]);
    try {
      const lockText = JSON.stringify({ pid: sleeper.pid, hostname: hostname(), startedAt: "2024-05-01T10:00:00.000Z" });
      writeFileSync(`${path}.lock`, lockText);
      writeFileSync(path, JSON.stringify({ format: "@botmesh/durable/file", version: 1, outboxSeq: 0, inbox: [], outbox: [] }));
      const fileBefore = readFileSync(path);
      const b = backendAt(path);
      const error = await rejection(b.open());
      expect(error).toBeInstanceOf(FileLockedError);
      expect(error.message).toContain(`pid ${sleeper.pid}`);
      expect(error.message).toContain(`lock file ${path}.lock`);
      expect((error as FileLockedError).pid).toBe(sleeper.pid);
      expect((error as FileLockedError).lockPath).toBe(`${path}.lock`);
      expect((error as FileLockedError).staleInMs).toBe(null); // judged by its pid, not by its age
      expect(readFileSync(`${path}.lock`, "utf8")).toBe(lockText);
      expect(readFileSync(path).equals(fileBefore)).toBe(true);
      expect(b.isOpen).toBe(false);
      // Once that process is gone, the next open breaks its lock.
      sleeper.kill("SIGKILL");
      await sleeper.exited;
      await b.open();
      expect(b.isOpen).toBe(true);
    } finally {
      sleeper.kill("SIGKILL");
    }
  });

  test("simulateCrash lets the instance go: the lock file stays and the next instance breaks it", async () => {
    const path = join(tempDir(), "bot.json");
    const old = await openAt(path);
    await old.inbox.admit(msg("m1"));
    await simulateCrash(old);
    expect(existsSync(`${path}.lock`)).toBe(true);
    expect((await rejection(old.inbox.get("m1"))).message).toMatch(/simulateCrash/);
    expect((await rejection(old.open())).message).toMatch(/simulateCrash/);
    const next = await openAt(path);
    expect((await next.inbox.get("m1"))?.state).toBe("pending");
  });

  test("simulateCrash during a write: the write finishes, waiting operations reject", async () => {
    const path = join(tempDir(), "bot.json");
    const old = await openAt(path);
    const pending = old.inbox.admit(msg("m1"));
    const crashed = simulateCrash(old);
    const error = await rejection(pending);
    expect(error.message).toMatch(/simulateCrash/);
    await crashed;
    const next = await openAt(path);
    // The admit may or may not have reached the disk (as with a real kill); the file is readable either way.
    expect(["pending", undefined]).toContain((await next.inbox.get("m1"))?.state);
  });
});

describe("damaged files are never overwritten", () => {
  /** A valid snapshot with non-ASCII text before the damage, so byte and character offsets differ. */
  async function validFile(path: string): Promise<Buffer> {
    const b = await openAt(path);
    await b.inbox.admit(msg("m1", "c1", { text: "grüße ✓ 🎉 日本" }));
    await b.inbox.admit(msg("m2", "c1", { text: "second" }));
    await b.outbox.reserve(send("k1"));
    await b.close();
    return readFileSync(path);
  }

  async function expectCorrupt(path: string, offset: number | null, detail: RegExp): Promise<void> {
    const before = readFileSync(path);
    const b = backendAt(path);
    const error = await rejection(b.open());
    expect(error).toBeInstanceOf(FileCorruptError);
    expect(error.message).toContain(path);
    if (offset !== null) expect(error.message).toContain(`at byte ${offset}:`);
    expect((error as FileCorruptError).offset).toBe(offset);
    expect(error.message).toMatch(detail);
    expect(readFileSync(path).equals(before)).toBe(true);
    expect(existsSync(`${path}.lock`)).toBe(false);
    expect(b.isOpen).toBe(false);
    // Still refused on a second try, still untouched.
    await rejection(b.open());
    expect(readFileSync(path).equals(before)).toBe(true);
  }

  test("a truncated file: the offset is the end of the file", async () => {
    const path = join(tempDir(), "bot.json");
    const bytes = await validFile(path);
    const cut = bytes.indexOf("second") + 3;
    writeFileSync(path, bytes.subarray(0, cut));
    await expectCorrupt(path, cut, /unterminated string.*truncated/);
  });

  test("a truncated file cut between values", async () => {
    const path = join(tempDir(), "bot.json");
    const bytes = await validFile(path);
    const cut = bytes.indexOf('"outbox":[') + '"outbox":['.length;
    writeFileSync(path, bytes.subarray(0, cut));
    await expectCorrupt(path, cut, /expected a value, found the end of the file \(truncated\?\)/);
  });

  test("an empty file", async () => {
    const path = join(tempDir(), "bot.json");
    writeFileSync(path, "");
    await expectCorrupt(path, 0, /end of the file/);
  });

  test("a flipped byte: the offset is the damaged byte's, in UTF-8 bytes", async () => {
    const path = join(tempDir(), "bot.json");
    const bytes = await validFile(path);
    const at = bytes.indexOf('"chatId"', bytes.indexOf('"m2"')) + '"chatId"'.length; // the ':' after a key
    expect(bytes[at]).toBe(0x3a);
    expect(bytes.toString("utf8").indexOf('"chatId"', bytes.toString("utf8").indexOf('"m2"'))).toBeLessThan(at - 8); // bytes ≠ characters here
    const damaged = Buffer.from(bytes);
    damaged[at] ^= 0x01; // ':' → ';'
    writeFileSync(path, damaged);
    await expectCorrupt(path, at, /expected ":" after a key, found ";"/);
  });

  test("invalid UTF-8: the offset of the bad byte", async () => {
    const path = join(tempDir(), "bot.json");
    const bytes = await validFile(path);
    const at = bytes.indexOf("second");
    const damaged = Buffer.from(bytes);
    damaged[at] = 0xff;
    writeFileSync(path, damaged);
    await expectCorrupt(path, at, /invalid UTF-8 \(byte 0xFF/);
  });

  test("a multi-byte character cut in half", async () => {
    const path = join(tempDir(), "bot.json");
    const bytes = await validFile(path);
    const at = bytes.indexOf(Buffer.from("✓"));
    const damaged = Buffer.concat([bytes.subarray(0, at + 1), bytes.subarray(at + 3)]); // only the lead byte stays
    writeFileSync(path, damaged);
    await expectCorrupt(path, at, /invalid UTF-8/);
  });

  test("data after the end", async () => {
    const path = join(tempDir(), "bot.json");
    const bytes = await validFile(path);
    writeFileSync(path, Buffer.concat([bytes, Buffer.from(" {}")]));
    await expectCorrupt(path, bytes.length + 1, /after the end of the JSON value/);
  });

  test("not a FileDurability snapshot, or another version", async () => {
    const path = join(tempDir(), "bot.json");
    writeFileSync(path, JSON.stringify({ hello: "world" }));
    await expectCorrupt(path, null, /not a FileDurability snapshot \("format" is undefined/);
    writeFileSync(path, JSON.stringify([1, 2]));
    await expectCorrupt(path, null, /expected a JSON object, got an array/);
    writeFileSync(path, JSON.stringify({ format: "@botmesh/durable/file", version: 4, outboxSeq: 0, inbox: [], outbox: [] }));
    await expectCorrupt(path, null, /unsupported format version 4/);
    writeFileSync(path, JSON.stringify({ format: "@botmesh/durable/file", version: 3, outboxSeq: 0, inbox: [], outbox: [] }));
    await expectCorrupt(path, null, /"log" must be a positive integer in a version 3 snapshot, got undefined/);
    writeFileSync(path, JSON.stringify({ format: "@botmesh/durable/file", version: 1, outboxSeq: 0, inbox: {}, outbox: [] }));
    await expectCorrupt(path, null, /"inbox" must be an array, got an object/);
    const base = { format: "@botmesh/durable/file", version: 2, outboxSeq: 0, inbox: [], outbox: [] };
    writeFileSync(path, JSON.stringify({ ...base, damaged: {} }));
    await expectCorrupt(path, null, /"damaged" must be an array, got an object/);
    writeFileSync(path, JSON.stringify({ ...base, damaged: [{ journal: "inbox", id: "m1", problem: "p", setAsideAt: 1, reported: "no", record: null }] }));
    await expectCorrupt(path, null, /damaged record 0: field "reported" must be a boolean, got "no"/);
  });

  test("a damaged record is set aside, kept in the file as it was, named by its field; the rest opens", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    for (const id of ["m1", "m2", "m3", "m4", "m5"]) await b.inbox.admit(msg(id));
    for (const key of ["k1", "k2", "k3", "k4", "k5"]) await b.outbox.reserve(send(key, `chat-${key}`));
    await b.close();
    const snap = JSON.parse(readFileSync(path, "utf8"));
    expect([snap.version, "damaged" in snap], "nothing set aside: version 1, no section").toEqual([1, false]);
    snap.inbox[1].state = "bogus";
    snap.inbox[2].lease = { owner: "A", incarnation: "x", token: "1", expiresAt: 0 };
    snap.inbox[3].id = 42;
    snap.inbox.push({ ...snap.inbox[0], payload: "a second m1" });
    delete snap.outbox[0].contentHash;
    snap.outbox[1].seq = 9; // above outboxSeq
    snap.outbox[2].seq = 4; // k4's: the later one in the file is set aside
    snap.outbox[4].seq = 2; // k5 moved before k3
    const edited = JSON.parse(JSON.stringify(snap));
    writeFileSync(path, JSON.stringify(snap));

    const c = await openAt(path);
    const problems = [...await c.inbox.damaged(), ...await c.outbox.damaged()].map((d) => [d.journal, d.id, d.backend, d.reported, d.problem]);
    expect(problems.map(([journal, id]) => [journal, id])).toEqual([
      ["inbox", "m2"],
      ["inbox", "m3"],
      ["inbox", "inbox[3]"],
      ["inbox", "m1"],
      ["outbox", "k1"],
      ["outbox", "k2"],
      ["outbox", "k4"],
    ]);
    expect(problems.every(([, , backend, reported]) => backend === "file" && reported === false)).toBe(true);
    const text = problems.map(([, , , , problem]) => problem).join("\n");
    expect(text).toContain('field "state" must be one of pending, processing, scheduled, failed, done, dead, got "bogus"');
    expect(text).toMatch(/field "lease" must be null or a lease object|lease whose "token"/);
    expect(text).toContain('field "id" must be a string, got 42');
    expect(text).toContain("the id appears twice");
    expect(text).toContain('field "contentHash" is missing');
    expect(text).toContain('field "seq" 9 is above the snapshot\'s "outboxSeq" 5');
    expect(text).toContain('field "seq" 4 is also entry "k3"\'s');
    expect((await c.inbox.list()).map((r) => [r.id, r.payload])).toEqual([["m1", { text: "m1" }], ["m5", { text: "m5" }]]);
    expect((await c.outbox.list()).map((e) => [e.key, e.seq]), "sorted by seq").toEqual([["k5", 2], ["k3", 4]]);
    expect((await rejection(c.inbox.get("m2"))).message).toContain('Inbox record "m2" in backend "file" is damaged and set aside');
    expect((await c.inbox.get("m1"))?.payload, "the first m1 wins").toEqual({ text: "m1" });
    expect(await c.inbox.admit(msg("m2")), "a damaged record's id stays taken").toBe(null);
    expect((await rejection(c.outbox.reserve(send("k1", "chat-k1")))).name, "a damaged entry's key: its fate is unknown").toBe("DamagedRecordError");
    expect(await c.inbox.reportDamaged("inbox[3]")).toBe(true);

    // Written at once, each record exactly as it was; reported flags survive.
    const written = await stored(path);
    expect(written.version, "a snapshot with a log beside it").toBe(3);
    expect(written.damaged.map((d: { record: unknown }) => d.record)).toEqual([
      edited.inbox[1],
      edited.inbox[2],
      edited.inbox[3],
      edited.inbox[5],
      edited.outbox[0],
      edited.outbox[1],
      edited.outbox[3],
    ]);
    await c.close();
    const d = await openAt(path);
    expect((await d.inbox.damaged()).map((r) => [r.id, r.reported])).toEqual([["m2", false], ["m3", false], ["inbox[3]", true], ["m1", false]]);
    expect((await d.inbox.damaged({ unreported: true, limit: 2 })).map((r) => r.id)).toEqual(["m2", "m3"]);
    expect((await d.outbox.damaged()).map((r) => r.id)).toEqual(["k1", "k2", "k4"]);
    expect(d.stats.rewrites, "nothing new set aside: nothing written").toBe(0);
  });

  test("a leftover temporary file from a crash mid-write is ignored and removed", async () => {
    const path = join(tempDir(), "bot.json");
    await validFile(path);
    const leftover = `${path}.${crypto.randomUUID()}.tmp`;
    writeFileSync(`${path}.tmp`, '{"format":"@botmesh/durable/file","vers'); // as earlier versions named it
    writeFileSync(leftover, '{"format":"@botmesh/durable/file","vers'); // however young: the lock is ours
    writeFileSync(`${path}.notes.txt`, "kept");
    const b = await openAt(path);
    expect(existsSync(`${path}.tmp`)).toBe(false);
    expect(existsSync(leftover)).toBe(false);
    expect(existsSync(`${path}.notes.txt`)).toBe(true);
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["m1", "m2"]);
  });
});

describe("group commit and durability", () => {
  test("concurrent admits share rewrites", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const before = b.stats.rewrites;
    const N = 200;
    const results = await Promise.all(Array.from({ length: N }, (_, i) => b.inbox.admit(msg(`m${i}`, `c${i % 7}`))));
    expect(results.every((r) => r !== null)).toBe(true);
    const rewrites = b.stats.rewrites - before;
    expect(rewrites).toBeGreaterThanOrEqual(1);
    expect(rewrites).toBeLessThanOrEqual(2);
    expect(JSON.parse(readFileSync(path, "utf8")).inbox.length).toBe(N);
  });

  test("operations arriving during a rewrite share the next one", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const before = b.stats.rewrites;
    const first = b.inbox.admit(msg("first"));
    await Promise.resolve();
    await Promise.resolve();
    await Promise.resolve(); // the first rewrite is under way
    const later = Array.from({ length: 50 }, (_, i) => b.outbox.reserve(send(`k${i}`, `c${i}`)));
    await Promise.all([first, ...later]);
    expect(b.stats.rewrites - before).toBeLessThanOrEqual(2);
  });

  test("a duplicate admit resolves only once the record it found is on disk", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const first = b.inbox.admit(msg("m1"));
    const duplicate = await b.inbox.admit(msg("m1"));
    expect(duplicate).toBe(null);
    const onDisk = JSON.parse(readFileSync(path, "utf8"));
    expect(onDisk.inbox.map((r: { id: string }) => r.id)).toEqual(["m1"]);
    await first;
  });

  test("a read resolves only once what it saw is on disk", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    void b.outbox.reserve(send("k1"));
    const got = await b.outbox.get("k1");
    expect(got?.state).toBe("queued");
    expect(JSON.parse(readFileSync(path, "utf8")).outbox[0].key).toBe("k1");
  });

  test("heartbeats are not written on their own, only with the next change", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const r = (await b.inbox.admit(msg("m1"), { ...A, leaseMs: 1_000 }))!;
    const e = (await b.outbox.reserve(send("k1"), { ...A, leaseMs: 1_000 })).entry;
    const rewrites = b.stats.rewrites;
    for (let i = 0; i < 20; i++) {
      expect(await b.inbox.heartbeat("m1", r.lease!.token, 500_000)).toBe(true);
      expect(await b.outbox.heartbeat("k1", e.lease!.token, 500_000)).toBe(true);
    }
    expect(await b.inbox.heartbeat("m1", 99, 500_000)).toBe(false);
    expect(b.stats.rewrites).toBe(rewrites);
    expect((await stored(path)).inbox[0].lease.expiresAt).toBe(r.lease!.expiresAt);
    await b.inbox.admit(msg("m2"));
    expect(b.stats.rewrites).toBe(rewrites + 1);
    expect((await stored(path)).inbox[0].lease.expiresAt).toBeGreaterThan(r.lease!.expiresAt + 400_000);
    expect((await stored(path)).outbox[0].lease.expiresAt).toBeGreaterThan(e.lease!.expiresAt + 400_000);
  });

  test("no-op results do not rewrite", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    await b.inbox.admit(msg("m1"));
    await b.outbox.reserve(send("k1"));
    const rewrites = b.stats.rewrites;
    expect(await b.inbox.admit(msg("m1"))).toBe(null);
    expect((await b.outbox.reserve(send("k1"))).status).toBe("exists");
    expect(await b.inbox.claim("nope", B)).toBe(null);
    expect(await b.inbox.replay("m1")).toBe(false);
    expect(await b.outbox.retry("k1")).toBe(false);
    expect(await b.inbox.purge(0)).toBe(0);
    expect(await b.inbox.list()).toHaveLength(1);
    expect(b.stats.rewrites).toBe(rewrites);
  });

  test("a failed rewrite whose file cannot be reloaded fails the backend: every operation rejects, saying to reopen", async () => {
    const dir = tempDir();
    const path = join(dir, "data", "bot.json");
    const b = await openAt(path);
    await b.inbox.admit(msg("m1"));
    rmSync(join(dir, "data"), { recursive: true, force: true }); // the next rewrite cannot create its temporary file
    const error = await rejection(b.inbox.admit(msg("m2")));
    expect(error.message).toContain(`FileDurability could not write ${path}`);
    expect(b.stats.failedRewrites).toBe(1);
    // The file is gone with its directory: the state cannot be rebuilt, so nothing is served from memory.
    mkdirSync(join(dir, "data"));
    for (const op of [b.inbox.get("m1"), b.inbox.admit(msg("m3")), b.outbox.list()]) {
      const failed = await rejection(op);
      expect(failed.message).toContain(`FileDurability could not write ${path}`);
      expect(failed.message).toContain("nor reload it");
      expect(failed.message).toContain("close it and open it again");
    }
    expect(b.stats.failedRewrites).toBe(1); // nothing more was tried
    expect((await rejection(b.close())).message).toContain("close it and open it again");
    expect(b.isOpen).toBe(false);
    await b.open(); // reopened: loads the file (gone: starts empty, written at once)
    expect(await b.inbox.list()).toEqual([]);
    await b.inbox.admit(msg("m4"));
    expect(JSON.parse(readFileSync(path, "utf8")).inbox.map((r: { id: string }) => r.id)).toEqual(["m4"]);
  });

  test("a close whose final rewrite fails rejects naming the file, and releases it all the same", async () => {
    const dir = tempDir();
    const path = join(dir, "data", "bot.json");
    const b = await openAt(path);
    await b.inbox.admit(msg("m1"));
    rmSync(join(dir, "data"), { recursive: true, force: true });
    await rejection(b.inbox.admit(msg("m2")));
    const error = await rejection(b.close());
    expect(error.message).toContain(`FileDurability could not write ${path}`);
    expect(b.isOpen).toBe(false);
    mkdirSync(join(dir, "data"));
    const c = await openAt(path); // not "already open in this process"
    expect(await c.inbox.list()).toEqual([]); // the file went away with its directory
  });

  test("fsync: false still writes atomically", async () => {
    const path = join(tempDir(), "bot.json");
    const b = backendAt(path, false);
    await b.open();
    await b.inbox.admit(msg("m1"));
    expect(JSON.parse(readFileSync(path, "utf8")).inbox.length).toBe(1);
  });
});

describe("restart from disk", () => {
  test("keeps records, fencing tokens, outbox order and the seq counter", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const { inbox, outbox } = b;
    // Inbox: pending, processing (leased), done, failed, dead, a replayed one; fences above 1.
    await inbox.admit(msg("pending", "c1", { text: "grüße ✓ 🎉", nested: [1, { a: null }] }));
    const leased = (await inbox.admit(msg("leased", "c2"), A))!;
    const done = (await inbox.admit(msg("done", "c3"), A))!;
    await inbox.complete("done", done.lease!.token);
    const failed = (await inbox.admit(msg("failed", "c4"), A))!;
    await inbox.fail("failed", failed.lease!.token, { error: "boom", retryInMs: 600_000 });
    const dead = (await inbox.admit(msg("dead", "c5"), A))!;
    await inbox.fail("dead", dead.lease!.token, { error: "fatal", dead: true });
    expect(await inbox.claim("failed", B)).toBe(null); // not due yet
    // Outbox: a chat with a sending head and a queued follower, a sent one, a dead one, a discarded one (seq gap).
    const head = (await outbox.reserve(send("o1", "x"), A)).entry;
    expect(await outbox.markCalling("o1", head.lease!.token, 60_000)).toBe(true); // its provider call announced
    await outbox.reserve(send("o2", "x"), A); // queued behind o1
    const s = (await outbox.reserve(send("o3", "y"), A)).entry;
    await outbox.markSent("o3", s.lease!.token, "provider-1");
    const d = (await outbox.reserve(send("o4", "z"), A)).entry;
    await outbox.markFailed("o4", d.lease!.token, { error: "bad recipient", dead: true });
    await outbox.reserve(send("o5", "w"));
    expect(await outbox.discard("o5")).toBe(true);
    const inboxBefore = await inbox.list();
    const outboxBefore = await outbox.list();
    await b.close();

    const c = await openAt(path);
    expect(await c.inbox.list()).toEqual(inboxBefore);
    expect(await c.outbox.list()).toEqual(outboxBefore);
    // The seq counter continues after the discarded entry.
    const o6 = (await c.outbox.reserve(send("o6", "v"))).entry;
    expect(o6.seq).toBe(6);
    // Chat order survives: o2 waits behind o1's lease; another owner takes nothing of chat x.
    const claim = await c.outbox.claimDue({ ...B, limit: 10 });
    expect(claim.due.map((e) => e.key)).toEqual(["o6"]);
    // A restart of A reclaims its own: o1 (called) becomes unknown (ambiguous), o2 is then due; tokens continue.
    const reclaim = await c.outbox.claimDue({ owner: "A", incarnation: "a2", leaseMs: 60_000, limit: 10, reclaimOwn: true });
    expect(reclaim.ambiguous.map((e) => e.key)).toEqual(["o1"]);
    expect(reclaim.due.map((e) => e.key)).toEqual(["o2"]);
    expect(reclaim.due[0].lease!.token).toBe(2); // o2 was queued, never leased: its first claim
    expect((await c.outbox.get("o1"))!.fence).toBe(head.fence);
    // Inbox fencing continues: the leased record's next claim gets a greater token; the old token is stale.
    const retaken = (await c.inbox.claim("leased", { owner: "A", incarnation: "a2", leaseMs: 1_000, reclaimOwn: true }))!;
    expect(retaken.lease!.token).toBe(leased.fence + 1);
    await expect(c.inbox.complete("leased", leased.lease!.token)).rejects.toThrow(/Stale lease/);
    // Receipt order and admission order are kept.
    expect((await c.inbox.list()).map((r) => r.id)).toEqual(["pending", "leased", "done", "failed", "dead"]);
    expect((await c.inbox.list({ state: "dead" }))[0].error).toBe("fatal");
  });

  test("the call marker: written before markCalling resolves, kept across a restart; an uncalled lost send is due again", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const called = (await b.outbox.reserve(send("called", "x"), A)).entry;
    const uncalled = (await b.outbox.reserve(send("uncalled", "y"), A)).entry;
    expect(called.called).toBe(false);
    const onDisk = async () => (await stored(path)).outbox as { key: string; called: boolean }[];
    expect((await onDisk()).map((e) => e.called)).toEqual([false, false]);
    const rewrites = b.stats.rewrites;
    expect(await b.outbox.markCalling("called", called.lease!.token, 60_000)).toBe(true);
    expect(b.stats.rewrites, "unlike a heartbeat, it is written at once").toBe(rewrites + 1);
    expect((await onDisk()).map((e) => [e.key, e.called])).toEqual([["called", true], ["uncalled", false]]);
    expect(await b.outbox.markCalling("called", 99, 60_000)).toBe(false);
    expect(await b.outbox.markCalling("nope", 1, 60_000)).toBe(false);
    expect(b.stats.rewrites, "a refused markCalling writes nothing").toBe(rewrites + 1);
    await simulateCrash(b);

    const c = await openAt(path);
    expect((await c.outbox.get("called"))!.called).toBe(true);
    expect((await c.outbox.get("uncalled"))!.called).toBe(false);
    const reclaim = await c.outbox.claimDue({ owner: "A", incarnation: "a2", leaseMs: 60_000, limit: 10, reclaimOwn: true });
    expect(reclaim.ambiguous.map((e) => e.key)).toEqual(["called"]);
    expect(reclaim.due.map((e) => [e.key, e.lease!.token, e.attempts, e.called])).toEqual([
      ["uncalled", uncalled.fence + 1, 1, false],
    ]);
    expect((await onDisk()).map((e) => [e.key, e.called])).toEqual([["called", true], ["uncalled", false]]);
  });

  test("a snapshot written before the call marker: its entries read as called, a lapsed old send is ambiguous", async () => {
    const path = join(tempDir(), "bot.json");
    const now = Date.now();
    const entry = (key: string, chatId: string, seq: number, extra: Record<string, unknown>) => ({
      key,
      chatId,
      content: { text: key },
      contentHash: `h-${key}`,
      inboundId: null,
      state: "queued",
      attempts: 0,
      nextAttemptAt: now - 10,
      lease: null,
      fence: 0,
      messageId: null,
      error: null,
      seq,
      createdAt: now - 5_000,
      updatedAt: now - 5_000,
      ...extra,
    });
    const sending = (expiresAt: number) => ({
      state: "sending",
      attempts: 1,
      nextAttemptAt: null,
      lease: { owner: "old", incarnation: "o1", token: 1, expiresAt },
      fence: 1,
    });
    writeFileSync(
      path,
      JSON.stringify({
        format: "@botmesh/durable/file",
        version: 1,
        outboxSeq: 3,
        inbox: [],
        outbox: [
          entry("lapsed", "c1", 1, sending(now - 1_000)),
          entry("live", "c2", 2, sending(now + 600_000)),
          entry("queued", "c3", 3, {}),
        ],
      }),
    );
    const b = await openAt(path);
    for (const key of ["lapsed", "live", "queued"]) {
      expect((await b.outbox.get(key))!.called, `${key}: written before the marker existed`).toBe(true);
    }
    const claim = await b.outbox.claimDue({ ...B, limit: 10 });
    expect(claim.ambiguous.map((e) => e.key), "a lapsed old send may have been sent").toEqual(["lapsed"]);
    expect((await b.outbox.get("lapsed"))!.state).toBe("unknown");
    expect(claim.due.map((e) => [e.key, e.called, e.attempts])).toEqual([["queued", false, 1]]);
    // The rewrite stores the field for every entry.
    const onDisk = JSON.parse(readFileSync(path, "utf8")).outbox as { key: string; called: boolean }[];
    expect(onDisk.map((e) => [e.key, e.called])).toEqual([["lapsed", true], ["live", true], ["queued", false]]);
    expect(await b.outbox.markCalling("live", 1, 60_000)).toBe(true);
    await b.close();
    const c = await openAt(path);
    expect((await c.outbox.list()).map((e) => [e.key, e.state, e.called])).toEqual([
      ["lapsed", "unknown", true],
      ["live", "sending", true],
      ["queued", "sending", false],
    ]);
  });

  test("an entry whose call marker is not a boolean is set aside, naming the field", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    await b.outbox.reserve(send("k1"));
    await b.outbox.reserve(send("k2"));
    await b.close();
    const snap = JSON.parse(readFileSync(path, "utf8"));
    snap.outbox[0].called = "yes";
    writeFileSync(path, JSON.stringify(snap));
    const c = await openAt(path);
    expect((await c.outbox.damaged()).map((d) => [d.id, d.problem])).toEqual([["k1", 'field "called" must be a boolean, got "yes"']]);
    expect((await c.outbox.list()).map((e) => e.key)).toEqual(["k2"]);
  });

  test("MemoryDurability export/import round trip keeps order, seq and fences", async () => {
    const m = new MemoryDurability();
    for (let i = 0; i < 5; i++) await m.inbox.admit(msg(`m${i}`, `c${i % 2}`), i % 2 ? A : undefined);
    for (let i = 0; i < 4; i++) await m.outbox.reserve(send(`k${i}`, "c"), A);
    await m.outbox.discard("k3");
    const exported = JSON.parse(JSON.stringify(m.exportRecords()));
    expect(exported.outboxSeq).toBe(4);
    const n = new MemoryDurability();
    n.importRecords(exported);
    expect(await n.inbox.list()).toEqual(await m.inbox.list());
    expect(await n.outbox.list()).toEqual(await m.outbox.list());
    expect((await n.outbox.reserve(send("k9", "c"))).entry.seq).toBe(5);
    expect(() => n.importRecords(exported)).toThrow(/empty/);
    const dup = new MemoryDurability();
    expect(() => dup.importRecords({ ...exported, inbox: [exported.inbox[0], exported.inbox[0]] })).toThrow(/twice/);
  });
});

describe("a failed rewrite never leaves its change in memory", () => {
  test("a leased admit whose rewrite fails is not kept: the redelivered message is admitted again, not a duplicate", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    await b.inbox.admit(msg("m0", "c0"));
    const healed = failWrites(); // the next write fails, as on a full disk
    const error = await rejection(b.inbox.admit(msg("m1"), A));
    expect(error.message).toContain(`FileDurability could not write ${path}`);
    expect((error.cause as { code?: string }).code).toBe("ENOSPC");
    healed();
    expect(await b.inbox.get("m1")).toBe(null); // memory holds only what is on disk
    const again = await b.inbox.admit(msg("m1"), A); // the channel redelivers it
    expect(again?.state).toBe("processing");
    expect(again?.lease?.token).toBe(1);
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["m0", "m1"]);
    expect((await stored(path)).inbox.map((r: { id: string }) => r.id)).toEqual(["m0", "m1"]);
  });

  test("a snapshot write (the first write after open starts the log) that fails is handled the same way", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    snapshotWriteTestHooks.beforeWrite = () => { // the snapshot write fails, as on a full disk
      throw Object.assign(new Error("ENOSPC: no space left on device, write"), { code: "ENOSPC" });
    };
    const error = await rejection(b.inbox.admit(msg("m0"), A));
    expect(error.message).toContain(`FileDurability could not write ${path}`);
    expect((error.cause as { code?: string }).code).toBe("ENOSPC");
    snapshotWriteTestHooks.beforeWrite = undefined;
    expect(await b.inbox.list()).toEqual([]);
    expect((await b.inbox.admit(msg("m0"), A))?.lease?.token).toBe(1);
    expect((await stored(path)).inbox.map((r: { id: string }) => r.id)).toEqual(["m0"]);
  });

  test("every waiting operation rejects, not only those of the failed rewrite; none of their changes stays", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const head = (await b.outbox.reserve(send("k0"), A)).entry;
    const healed = failWrites();
    const first = b.inbox.admit(msg("m1")); // this one starts a rewrite
    await Promise.resolve();
    await Promise.resolve();
    await Promise.resolve();
    const later = [b.inbox.admit(msg("m2")), b.outbox.markSent("k0", head.lease!.token, "mid"), b.outbox.reserve(send("k1"))];
    const results = await Promise.allSettled([first, ...later]);
    expect(results.map((r) => r.status)).toEqual(["rejected", "rejected", "rejected", "rejected"]);
    healed();
    expect(await b.inbox.list()).toEqual([]);
    expect((await b.outbox.list()).map((e) => [e.key, e.state])).toEqual([["k0", "sending"]]);
    // The lease is the one on disk: its token still works.
    await b.outbox.markSent("k0", head.lease!.token, "mid");
    expect((await b.outbox.get("k0"))?.state).toBe("sent");
  });

  test("a heartbeat-extended lease falls back to its expiry on disk after a rebuild; the next heartbeat extends it", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const r = (await b.inbox.admit(msg("m1"), { ...A, leaseMs: 1_000 }))!;
    expect(await b.inbox.heartbeat("m1", r.lease!.token, 500_000)).toBe(true);
    const healed = failWrites();
    await rejection(b.inbox.admit(msg("m2")));
    healed();
    expect((await b.inbox.get("m1"))?.lease?.expiresAt).toBe(r.lease!.expiresAt);
    expect(await b.inbox.heartbeat("m1", r.lease!.token, 500_000)).toBe(true);
    expect((await b.inbox.get("m1"))!.lease!.expiresAt).toBeGreaterThan(r.lease!.expiresAt + 400_000);
  });

  test("close: a failed final state and a failed lock release are both reported (AggregateError)", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    await b.inbox.admit(msg("m1"));
    // The rewrite cannot rename over a directory, the reload cannot read one: the backend is failed.
    rmSync(path);
    mkdirSync(path);
    const healed = failWrites();
    await rejection(b.inbox.admit(msg("m2")));
    healed();
    // And the lock file cannot be read to be released.
    rmSync(`${path}.lock`);
    mkdirSync(`${path}.lock`);
    const error = await rejection(b.close());
    expect(error).toBeInstanceOf(AggregateError);
    expect(error.message).toContain(`FileDurability could not write ${path}`);
    expect(error.message).toContain(`cannot release the lock file ${path}.lock`);
    const errors = (error as AggregateError).errors as Error[];
    expect(errors).toHaveLength(2);
    expect(errors[0].message).toContain("close it and open it again");
    expect(errors[1].message).toContain(`FileDurability: ${path}: cannot release the lock file`);
    expect(error.cause).toBe(errors[0]);
    expect(b.isOpen).toBe(false);
  });
});

describe("symlinks, modes, errors naming the file", () => {
  test("a symlinked file: one lock for both paths, and a rewrite keeps the symlink", async () => {
    const dir = tempDir();
    const real = join(dir, "bot.json");
    const link = join(dir, "link.json");
    const a = await openAt(real);
    await a.close();
    symlinkSync(real, link);
    const b = await openAt(link);
    expect(b.file).toBe(real);
    expect(existsSync(`${real}.lock`)).toBe(true);
    expect(existsSync(`${link}.lock`)).toBe(false);
    const other = backendAt(real);
    expect((await rejection(other.open())).message).toContain(`${real} is already open in this process`);
    await b.inbox.admit(msg("m1"));
    expect(lstatSync(link).isSymbolicLink()).toBe(true);
    expect(JSON.parse(readFileSync(real, "utf8")).inbox.map((r: { id: string }) => r.id)).toEqual(["m1"]);
    await b.close();
    expect(existsSync(`${real}.lock`)).toBe(false);
  });

  test("a dangling symlink: the file is created at its target, the symlink stays", async () => {
    const dir = tempDir();
    const target = join(dir, "target.json");
    const link = join(dir, "link.json");
    symlinkSync(target, link);
    const b = await openAt(link);
    expect(b.file).toBe(target);
    await b.inbox.admit(msg("m1"));
    expect(lstatSync(link).isSymbolicLink()).toBe(true);
    expect(JSON.parse(readFileSync(target, "utf8")).inbox).toHaveLength(1);
  });

  test("a directory at the path: open() fails naming the file", async () => {
    const path = join(tempDir(), "bot.json");
    mkdirSync(path);
    const error = await rejection(backendAt(path).open());
    expect(error.message).toStartWith(`FileDurability: ${path}: `);
    expect(error.message).toContain("is a directory");
    expect(existsSync(`${path}.lock`)).toBe(false);
  });

  test("a directory that cannot be created: the error names the file and keeps the cause", async () => {
    const dir = tempDir();
    writeFileSync(join(dir, "plain"), "x");
    const path = join(dir, "plain", "bot.json");
    const error = await rejection(backendAt(path).open());
    expect(error.message).toStartWith(`FileDurability: ${path}: cannot create its directory: `);
    expect(["ENOTDIR", "EEXIST"]).toContain(String((error.cause as { code?: string }).code));
  });

  test("a symlink planted at <path>.tmp or <path>.log after open() is never written through nor chmod'ed", async () => {
    const dir = tempDir();
    const path = join(dir, "bot.json");
    const victims = ["victim-tmp", "victim-log"].map((name) => {
      writeFileSync(join(dir, name), "root:x:0:0:root:/root:/bin/bash\n");
      chmodSync(join(dir, name), 0o644);
      return join(dir, name);
    });
    const b = await openAt(path); // a new file: written plain, without a log
    symlinkSync(victims[0], `${path}.tmp`);
    symlinkSync(victims[1], `${path}.log`);
    // The next write is a snapshot (to a new <path>.<random>.tmp) starting a new log: the link is replaced.
    await b.inbox.admit(msg("m1", "c1", { text: "secret chat text" }));
    expect(lstatSync(`${path}.log`).isSymbolicLink()).toBe(false);
    await b.inbox.admit(msg("m2"));
    await b.close(); // the last write is a plain snapshot
    for (const victim of victims) {
      expect(readFileSync(victim, "utf8")).toBe("root:x:0:0:root:/root:/bin/bash\n");
      expect(statSync(victim).mode & 0o777).toBe(0o644);
    }
    expect(lstatSync(path).isSymbolicLink()).toBe(false);
    expect(lstatSync(`${path}.tmp`).isSymbolicLink(), "the planted link is left alone").toBe(true);
    expect(readdirSync(dir).filter((name) => name.endsWith(".tmp"))).toEqual(["bot.json.tmp"]);
    expect((await stored(path)).inbox.map((r: { id: string }) => r.id)).toEqual(["m1", "m2"]);
  });

  test("a symlink planted at <path>.log while closed: open() refuses it, and never truncates nor chmods its target", async () => {
    const dir = tempDir();
    const path = join(dir, "bot.json");
    const victim = join(dir, "victim");
    writeFileSync(victim, "root:x:0:0:root:/root:/bin/bash\n");
    chmodSync(victim, 0o644);
    const b = await openAt(path);
    await b.inbox.admit(msg("m1")); // the snapshot now names a log
    await simulateCrash(b); // no final plain write: the log stays
    rmSync(`${path}.log`);
    symlinkSync(victim, `${path}.log`);
    const error = await rejection(backendAt(path).open());
    expect(error.message).toContain(`cannot open its log ${path}.log`);
    expect((error.cause as { code?: string }).code).toBe("ELOOP");
    expect(readFileSync(victim, "utf8")).toBe("root:x:0:0:root:/root:/bin/bash\n");
    expect(statSync(victim).mode & 0o777).toBe(0o644);
  });

  test("a new file gets mode 0600; rewrites keep an existing file's mode", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    expect(statSync(path).mode & 0o777).toBe(0o600);
    await b.close();
    chmodSync(path, 0o640);
    await b.open();
    await b.inbox.admit(msg("m1"));
    expect(statSync(path).mode & 0o777).toBe(0o640);
    await b.close();
    chmodSync(path, 0o600);
    await b.open();
    await b.inbox.admit(msg("m2"));
    expect(statSync(path).mode & 0o777).toBe(0o600);
  });
});

describe("the lock across hosts and processes", () => {
  test("staleLockMs must be a finite number of at least 1000: a TypeError naming it", () => {
    // @ts-expect-error wrong on purpose
    expect(() => new FileDurability({ path: "x.json", staleLockMs: "30s" })).toThrow(/option "staleLockMs" must be/);
    expect(() => new FileDurability({ path: "x.json", staleLockMs: 10 })).toThrow(TypeError);
    expect(() => new FileDurability({ path: "x.json", staleLockMs: Infinity })).toThrow(/"staleLockMs".*got Infinity/);
    expect(new FileDurability({ path: "x.json", staleLockMs: 60_000 }).name).toBe("file");
  });

  test("a lock of another host is judged by its mtime, not its pid: respected while fresh, broken once stale", async () => {
    const path = join(tempDir(), "bot.json");
    const lockText = JSON.stringify({ pid: deadPid(), hostname: "other-container", startedAt: "2024-05-01T10:00:00.000Z", nonce: "n" });
    writeFileSync(`${path}.lock`, lockText);
    const b = backendAt(path);
    const error = await rejection(b.open());
    expect(error).toBeInstanceOf(FileLockedError);
    expect(error.message).toContain("on host other-container");
    expect(error.message).toContain(`lock file ${path}.lock`);
    expect(error.message).toMatch(/counts as stale in (29\.\d|30) s/);
    expect((error as FileLockedError).hostname).toBe("other-container");
    expect((error as FileLockedError).staleInMs).toBeGreaterThan(25_000);
    expect(readFileSync(`${path}.lock`, "utf8")).toBe(lockText);
    // 31 s without a refresh: its holder is gone.
    const old = new Date(Date.now() - 31_000);
    utimesSync(`${path}.lock`, old, old);
    await b.open();
    expect(JSON.parse(readFileSync(`${path}.lock`, "utf8")).pid).toBe(process.pid);
    await b.close();
    // staleLockMs sets the threshold.
    writeFileSync(`${path}.lock`, lockText);
    const recent = new Date(Date.now() - 5_000);
    utimesSync(`${path}.lock`, recent, recent);
    const c = new FileDurability({ path, staleLockMs: 4_000 });
    opened.push(c);
    await c.open();
  });

  test("the holder refreshes its lock file's mtime", async () => {
    const path = join(tempDir(), "bot.json");
    const b = new FileDurability({ path, staleLockMs: 1_000 }); // refreshed every 333 ms
    opened.push(b);
    await b.open();
    const old = new Date(Date.now() - 60_000);
    utimesSync(`${path}.lock`, old, old);
    await Bun.sleep(600);
    expect(Date.now() - statSync(`${path}.lock`).mtimeMs).toBeLessThan(1_000);
    await b.close();
  });

  test("an empty lock file that changed recently is respected (its creator may be writing it)", async () => {
    const path = join(tempDir(), "bot.json");
    writeFileSync(`${path}.lock`, "");
    const error = await rejection(backendAt(path).open());
    expect(error).toBeInstanceOf(FileLockedError);
    expect(error.message).toContain(`lock file ${path}.lock is unreadable`);
    expect((error as FileLockedError).staleInMs).toBeGreaterThan(9_000);
    expect(readFileSync(`${path}.lock`, "utf8")).toBe("");
  });

  test("our lock file has its content from its creation, and no temporary file is left", async () => {
    const dir = tempDir();
    const path = join(dir, "bot.json");
    const b = await openAt(path);
    expect(JSON.parse(readFileSync(`${path}.lock`, "utf8")).nonce).toBeString();
    expect(readdirSync(dir).sort()).toEqual(["bot.json", "bot.json.lock"]);
    await b.close();
    expect(readdirSync(dir)).toEqual(["bot.json"]);
  });

  test("processes breaking one stale lock at the same time: exactly one gets it, every round", async () => {
    const ROUNDS = 10;
    const PROCS = 6;
    const ROUND_MS = 450;
    const dir = tempDir();
    const paths = Array.from({ length: ROUNDS }, (_, i) => {
      const path = join(dir, `r${i}`, "bot.json");
      mkdirSync(join(dir, `r${i}`));
      writeFileSync(`${path}.lock`, JSON.stringify({ pid: deadPid(), nonce: "dead" }));
      return path;
    });
    const fixture = join(import.meta.dir, "fixtures", "file_writer.ts");
    const startAt = Date.now() + 1_200; // every child started and loaded
    const children = Array.from({ length: PROCS }, () =>
      Bun.spawn([process.execPath, fixture, "--lock-race", String(startAt), String(ROUND_MS), "300", ...paths], {
        stdout: "pipe",
        stderr: "inherit",
      })
    );
    const outputs = await Promise.all(children.map((c) => new Response(c.stdout).text()));
    const held = Array.from({ length: ROUNDS }, () => [] as [number, number][]);
    const answered = new Array<number>(ROUNDS).fill(0);
    const errors: string[] = [];
    for (const line of outputs.join("").split("\n").filter(Boolean)) {
      const [what, round, a, b] = line.split(" ");
      answered[Number(round)]++;
      if (what === "OPENED") held[Number(round)]!.push([Number(a), Number(b)]);
      else if (a !== "FileLockedError") errors.push(line);
    }
    expect(answered).toEqual(new Array(ROUNDS).fill(PROCS));
    expect(errors, "the others are told the file is locked").toEqual([]);
    for (const [round, spans] of held.entries()) {
      expect(spans.length, `round ${round}: one broke the dead lock and opened`).toBeGreaterThanOrEqual(1);
      // A process that comes late (a loaded machine) may open after the winner closed; never while it holds.
      spans.sort((x, y) => x[0] - y[0]);
      for (let k = 1; k < spans.length; k++) {
        expect(spans[k]![0], `round ${round}: two holders at once`).toBeGreaterThanOrEqual(spans[k - 1]![1]);
      }
    }
    // Most rounds are a real race: every process tried while the winner held the lock.
    expect(held.filter((spans) => spans.length === 1).length).toBeGreaterThanOrEqual(ROUNDS / 2);
  }, 10_000);
});

describe("the log beside the snapshot", () => {
  /** A store left by a killed process: a snapshot naming its log, and the log's records (each op one record). */
  async function crashedStore(path: string, ids: string[]): Promise<void> {
    const b = await openAt(path);
    for (const id of ids) await b.inbox.admit(msg(id));
    await simulateCrash(b);
  }

  test("a new store is a plain snapshot; changes are appended to <path>.log; close() leaves a plain snapshot again", async () => {
    const dir = tempDir();
    const path = join(dir, "bot.json");
    const b = await openAt(path);
    await b.inbox.admit(msg("m1"));
    await b.inbox.admit(msg("m2"));
    await b.outbox.reserve(send("k1"));
    expect(b.stats.snapshots, "the new file, then the first write starts the log").toBe(2);
    expect(b.stats.logAppends).toBe(2);
    const snap = JSON.parse(readFileSync(path, "utf8"));
    expect([snap.version, snap.inbox.length]).toEqual([3, 1]);
    expect(Number.isSafeInteger(snap.log) && snap.log >= 1, "the snapshot names its log's generation").toBe(true);
    expect(readFileSync(`${path}.log`, "utf8").startsWith(`R `)).toBe(true);
    expect(readFileSync(`${path}.log`, "utf8")).toContain(`{"g":${snap.log},`);
    expect((await stored(path)).inbox.map((r: { id: string }) => r.id)).toEqual(["m1", "m2"]);
    await b.close();
    expect(readdirSync(dir)).toEqual(["bot.json"]);
    const plain = JSON.parse(readFileSync(path, "utf8"));
    expect([plain.version, "log" in plain, plain.inbox.length, plain.outbox.length]).toEqual([1, false, 2, 1]);
  });

  test("a store of an earlier version (a snapshot alone) opens unchanged, and is read back the same", async () => {
    const path = join(tempDir(), "bot.json");
    const m = new MemoryDurability();
    await m.inbox.admit(msg("old1"));
    await m.outbox.reserve(send("k-old"));
    writeFileSync(path, JSON.stringify({ format: "@botmesh/durable/file", version: 1, ...m.exportRecords(), damaged: undefined }));
    writeFileSync(`${path}.log`, "not ours: never read while the snapshot names no log\n");
    const before = readFileSync(path);
    const b = await openAt(path);
    expect(readFileSync(path).equals(before), "opening writes nothing").toBe(true);
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["old1"]);
    await b.inbox.admit(msg("new1"));
    await simulateCrash(b);
    const c = await openAt(path);
    expect((await c.inbox.list()).map((r) => r.id)).toEqual(["old1", "new1"]);
    expect((await c.outbox.list()).map((e) => e.key)).toEqual(["k-old"]);
  });

  test("restart replays the log: records, removals, the seq counter, reports", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    await b.inbox.admit(msg("m1"));
    const r = (await b.inbox.admit(msg("m2", "c2"), A))!;
    await b.inbox.complete("m2", r.lease!.token);
    const e1 = (await b.outbox.reserve(send("k1", "x"), A)).entry;
    await b.outbox.markSent("k1", e1.lease!.token, "mid-1");
    await b.outbox.reserve(send("k2", "y"));
    await b.outbox.reserve(send("k3", "z"));
    expect(await b.outbox.discard("k3")).toBe(true);
    expect(b.stats.logAppends).toBeGreaterThan(4);
    await simulateCrash(b);
    const c = await openAt(path);
    expect((await c.inbox.list()).map((x) => [x.id, x.state])).toEqual([["m1", "pending"], ["m2", "done"]]);
    expect((await c.outbox.list()).map((x) => [x.key, x.state, x.seq])).toEqual([["k1", "sent", 1], ["k2", "queued", 2]]);
    expect((await c.outbox.reserve(send("k4"))).entry.seq, "the discarded k3's seq is not reused").toBe(4);
    expect((await c.outbox.get("k1"))?.messageId).toBe("mid-1");
  });

  /** Opens `path`, collecting the warnings of `open()`. */
  async function openWarned(path: string, warnings: OpenWarning[]): Promise<FileDurability> {
    const b = backendAt(path);
    await b.open((w) => warnings.push(w));
    return b;
  }

  test("a torn last record (a kill mid-append) is cut off, set aside beside the log and warned; what is before it is kept", async () => {
    const path = join(tempDir(), "bot.json");
    await crashedStore(path, ["m1", "m2", "m3"]);
    const log = readFileSync(`${path}.log`);
    const lastStart = log.lastIndexOf("\nR ", log.length - 2) + 1;
    const cut = lastStart + Math.floor((log.length - lastStart) / 2);
    writeFileSync(`${path}.log`, log.subarray(0, cut)); // m3's record cut
    const warnings: OpenWarning[] = [];
    const b = await openWarned(path, warnings);
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["m1", "m2"]);
    expect(readFileSync(`${path}.log`).length, "the torn record is cut off").toBe(lastStart);
    expect(readFileSync(`${path}.log.torn-1`).equals(log.subarray(lastStart, cut))).toBe(true);
    expect(warnings.map((w) => [w.code, w.message.includes(`${path}.log ended in a torn write at byte ${lastStart}`)])).toEqual([
      ["journal-torn-tail", true],
    ]);
    await b.inbox.admit(msg("m4"));
    await simulateCrash(b);
    const c = await openAt(path);
    expect((await c.inbox.list()).map((r) => r.id)).toEqual(["m1", "m2", "m4"]);
  });

  test("torn tails of every length, and garbage after the last record (zeros of a crash mid-extend), are dropped", async () => {
    const path = join(tempDir(), "bot.json");
    await crashedStore(path, ["m1", "m2"]);
    const log = readFileSync(`${path}.log`);
    const lastStart = log.lastIndexOf("\nR ", log.length - 2) + 1;
    const warnings: OpenWarning[] = [];
    for (let cut = lastStart; cut < log.length; cut += 7) {
      writeFileSync(`${path}.log`, log.subarray(0, cut));
      const b = await openWarned(path, warnings);
      expect((await b.inbox.list()).map((r) => r.id), `cut at ${cut}`).toEqual(["m1"]);
      expect(warnings.splice(0).length, `cut at ${cut}: warned unless nothing was cut`).toBe(cut === lastStart ? 0 : 1);
      await simulateCrash(b);
    }
    writeFileSync(`${path}.log`, Buffer.concat([log, Buffer.alloc(4096)]));
    const b = await openWarned(path, warnings);
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["m1", "m2"]);
    expect(readFileSync(`${path}.log`).equals(log)).toBe(true);
    expect(warnings.map((w) => w.code)).toEqual(["journal-torn-tail"]);
  });

  test("a damaged record with intact records after it: open() fails naming the log and the offset, files untouched", async () => {
    const path = join(tempDir(), "bot.json");
    await crashedStore(path, ["m1", "m2", "m3", "m4"]); // m1 in the snapshot, m2 to m4 in the log
    const log = readFileSync(`${path}.log`);
    const second = log.indexOf("\nR ") + 1;
    const damaged = Buffer.from(log);
    damaged[second + 30] ^= 0x01; // a bit flipped in m3's record: its checksum fails, m4's record follows
    writeFileSync(`${path}.log`, damaged);
    const snapshot = readFileSync(path);
    const error = await rejection(backendAt(path).open());
    expect(error).toBeInstanceOf(FileCorruptError);
    expect(error.message).toContain(`${path}.log is damaged at byte ${second}:`);
    expect(error.message).toContain("log record 2 is damaged");
    expect((error as FileCorruptError).offset).toBe(second);
    expect(readFileSync(`${path}.log`).equals(damaged)).toBe(true);
    expect(readFileSync(path).equals(snapshot)).toBe(true);
  });

  test("a whole last log record whose middle was never written (zeros: its checksum fails) is a torn tail: set aside beside the log, warned, earlier records kept", async () => {
    const dir = tempDir();
    const path = join(dir, "bot.json");
    const b0 = await openAt(path);
    await b0.inbox.admit(msg("m1")); // the snapshot
    await b0.inbox.admit(msg("m2"));
    await b0.inbox.admit(msg("m3", "c1", { text: "x".repeat(300) })); // the log's last record
    await simulateCrash(b0);
    const log = readFileSync(`${path}.log`);
    const last = log.lastIndexOf("\nR ", log.length - 2) + 1;
    const torn = Buffer.from(log);
    torn.fill(0, last + 40, log.length - 40); // page writeback left the frame's length and final newline, not its middle
    writeFileSync(`${path}.log`, torn);
    const warnings: OpenWarning[] = [];
    const b = await openWarned(path, warnings);
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["m1", "m2"]);
    expect(readFileSync(`${path}.log`).equals(log.subarray(0, last)), "the torn frame is cut off, the rest kept").toBe(true);
    const aside = `${path}.log.torn-1`;
    expect(readFileSync(aside).equals(torn.subarray(last)), "the cut-off bytes, as they were").toBe(true);
    expect(warnings.map((w) => w.code)).toEqual(["journal-torn-tail"]);
    expect(warnings[0]!.message).toContain(`${path}.log`);
    expect(warnings[0]!.message).toContain(`byte ${last}`);
    expect(warnings[0]!.message).toContain(aside);
    await b.inbox.admit(msg("m4"));
    await simulateCrash(b);
    const again = readFileSync(`${path}.log`);
    const m4 = again.lastIndexOf("\nR ", again.length - 2) + 1;
    writeFileSync(`${path}.log`, again.subarray(0, again.length - 10)); // m4's frame cut short
    const c = await openWarned(path, warnings);
    expect((await c.inbox.list()).map((r) => r.id)).toEqual(["m1", "m2"]);
    expect(readFileSync(`${path}.log.torn-2`).equals(again.subarray(m4, again.length - 10)), "the next one beside it").toBe(true);
    expect(readFileSync(aside).equals(torn.subarray(last)), "the first one kept").toBe(true);
  });

  test("a whole log record with a zeroed middle and an intact record after it is damage: open() fails naming the log and the offset, nothing set aside", async () => {
    const dir = tempDir();
    const path = join(dir, "bot.json");
    await crashedStore(path, ["m1", "m2", "m3", "m4"]); // m1 in the snapshot, m2 to m4 in the log
    const log = readFileSync(`${path}.log`);
    const second = log.indexOf("\nR ") + 1;
    const third = log.indexOf("\nR ", second) + 1;
    const damaged = Buffer.from(log);
    damaged.fill(0, second + 40, third - 40); // m3's frame: length and newline intact, checksum fails; m4's follows
    writeFileSync(`${path}.log`, damaged);
    const warnings: unknown[] = [];
    const error = await rejection(backendAt(path).open((w) => warnings.push(w)));
    expect(error).toBeInstanceOf(FileCorruptError);
    expect(error.message).toContain(`${path}.log is damaged at byte ${second}:`);
    expect(error.message).toContain("log record 2 is damaged");
    expect((error as FileCorruptError).offset).toBe(second);
    expect(readFileSync(`${path}.log`).equals(damaged)).toBe(true);
    expect(readdirSync(dir).filter((name) => name.includes("torn"))).toEqual([]);
    expect(warnings).toEqual([]);
  });

  test("a log left behind (a kill between close()'s plain snapshot and the log's removal, then a downgrade) is never replayed over a later snapshot", async () => {
    const dir = tempDir();
    const path = join(dir, "bot.json");
    let b = await openAt(path);
    const r = (await b.inbox.admit(msg("m1"), A))!;
    const res = await b.outbox.reserve(send("k1"), A);
    const token = res.entry.lease!.token;
    await b.outbox.markCalling("k1", token, 60_000);
    const leftOver = readFileSync(`${path}.log`);
    await b.close(); // a plain snapshot, then the log is removed
    // An older version (no log) settles both; the left-over log comes back beside its plain snapshot.
    b = await openAt(path);
    await b.outbox.markSent("k1", token, "platform-1");
    await b.inbox.complete("m1", r.lease!.token);
    await b.close();
    // This version's first write starts a new log generation; a kill before that log is emptied.
    b = await openAt(path);
    await b.inbox.admit(msg("m2"));
    await simulateCrash(b);
    writeFileSync(`${path}.log`, leftOver);
    b = await openAt(path);
    expect((await b.outbox.get("k1"))?.state).toBe("sent");
    expect((await b.inbox.get("m1"))?.state).toBe("done");
    expect((await b.inbox.get("m2"))?.state).toBe("pending");
  });

  test("an append whose flush fails is cut off again: the operation rejects and is not in the state, nor after a reopen", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    await b.inbox.admit(msg("m1")); // the first write: a snapshot; the log is open from here on
    const { open } = await import("node:fs/promises");
    const probe = await open(join(tempDir(), "probe"), "w");
    const handleProto = Object.getPrototypeOf(probe) as { datasync: () => Promise<void> };
    await probe.close();
    const datasync = handleProto.datasync;
    let failures = 1;
    handleProto.datasync = function (this: unknown) {
      if (failures-- > 0) return Promise.reject(Object.assign(new Error("EIO: i/o error, fdatasync"), { code: "EIO" }));
      return datasync.call(this);
    };
    let error: Error;
    try {
      error = await rejection(b.inbox.admit(msg("m2")));
    } finally {
      handleProto.datasync = datasync;
    }
    expect(error.message).toContain("EIO");
    expect(await b.inbox.get("m2")).toBe(null);
    await b.inbox.admit(msg("m3")); // the log takes appends again
    await b.close();
    const again = await openAt(path);
    expect((await again.inbox.list()).map((r) => r.id).sort()).toEqual(["m1", "m3"]);
  });

  test("an intact log record holding a record that is not valid: that record is set aside, as in the snapshot", async () => {
    const path = join(tempDir(), "bot.json");
    await crashedStore(path, ["m1"]);
    const good = (await stored(path)).inbox[0];
    const bad = { ...good, id: "m2", state: "bogus" };
    const { frameLogRecord } = await import("../backends/file/log_records.ts");
    const { log: g } = JSON.parse(readFileSync(path, "utf8"));
    writeFileSync(`${path}.log`, Buffer.concat([readFileSync(`${path}.log`), frameLogRecord(JSON.stringify({ g, i: [bad] }))]));
    const b = await openAt(path);
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["m1"]);
    expect((await b.inbox.damaged()).map((d) => [d.id, d.problem])).toEqual([
      ["m2", 'field "state" must be one of pending, processing, scheduled, failed, done, dead, got "bogus"'],
    ]);
    expect((await stored(path)).damaged.map((d: { record: unknown }) => d.record), "written at once, as it was").toEqual([bad]);
    expect(await b.inbox.reportDamaged("m2")).toBe(true);
    await simulateCrash(b);
    const c = await openAt(path);
    expect((await c.inbox.damaged()).map((d) => [d.id, d.reported]), "the report was logged").toEqual([["m2", true]]);
  });

  test("log records of an older generation (a compaction killed before it reset the log) are skipped", async () => {
    const path = join(tempDir(), "bot.json");
    await crashedStore(path, ["m1", "m2"]);
    const snap = JSON.parse(readFileSync(path, "utf8"));
    writeFileSync(path, JSON.stringify({ ...snap, log: snap.log + 1 })); // the log's records are of another generation
    const b = await openAt(path);
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["m1"]);
    await b.inbox.admit(msg("m3"));
    expect(JSON.parse(readFileSync(path, "utf8")).log, "the first write is a compaction to a new generation").not.toBe(snap.log + 1);
    await simulateCrash(b);
    const c = await openAt(path);
    expect((await c.inbox.list()).map((r) => r.id)).toEqual(["m1", "m3"]);
  });

  test("the log is compacted into a new snapshot as it grows; a purge is written as a new snapshot", async () => {
    const path = join(tempDir(), "bot.json");
    const b = await openAt(path);
    const big = "x".repeat(20_000);
    for (let i = 0; i < 40; i++) await b.inbox.admit(msg(`m${i}`, "c1", { text: big }));
    expect(b.stats.snapshots, "compacted at least once").toBeGreaterThan(2);
    expect(b.stats.logBytes).toBeLessThan(2 * JSON.parse(readFileSync(path, "utf8")).inbox.length * 21_000 + 300_000);
    const snapshots = b.stats.snapshots;
    for (let i = 0; i < 40; i++) {
      const [r] = await b.inbox.claimDue({ ...A, limit: 1 });
      await b.inbox.complete(r.id, r.lease!.token);
    }
    expect(await b.inbox.purge(-60_000)).toBe(40);
    expect(b.stats.snapshots).toBeGreaterThan(snapshots);
    await simulateCrash(b);
    const c = await openAt(path);
    expect(await c.inbox.list()).toEqual([]);
  });

  test("a log deleted with its directory: the write fails instead of appending to a file nobody can read", async () => {
    const dir = tempDir();
    const path = join(dir, "data", "bot.json");
    const b = await openAt(path);
    await b.inbox.admit(msg("m1"));
    await b.inbox.admit(msg("m2")); // appended to the log
    rmSync(join(dir, "data"), { recursive: true, force: true });
    const error = await rejection(b.inbox.admit(msg("m3")));
    expect(error.message).toContain(`FileDurability could not write ${path}`);
    expect(error.message).toContain("was deleted");
  });
});
