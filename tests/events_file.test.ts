import { afterEach, describe, expect, spyOn, test } from "bun:test";
import {
  chmodSync,
  existsSync,
  lstatSync,
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
import { FileCorruptError, FileEventJournal, FileLockedError, simulateCrash } from "../backends/events/file_journal.ts";
import { SharedFileEventJournal } from "../backends/events/shared_journal.ts";
import { serializeEventSnapshot } from "../backends/events/snapshot.ts";
import { FileMutex } from "../backends/file/mutex.ts";
import { snapshotWriteTestHooks } from "../backends/file/snapshot.ts";
import { type ClaimOptions, type NewOutboxEntry, StaleLeaseError } from "../src/contract.ts";
import { MemoryEventJournal } from "../backends/events/memory_journal.ts";
import { BOT_CHANNEL, type NewEventRecord } from "../src/events/types.ts";

const dirs: string[] = [];
const opened: FileEventJournal[] = [];

afterEach(async () => {
  snapshotWriteTestHooks.beforeWrite = undefined;
  for (const j of opened.splice(0)) if (!j.closed) await j.close().catch(() => {});
  for (const dir of dirs.splice(0)) rmSync(dir, { recursive: true, force: true });
});

function tempDir(): string {
  const dir = mkdtempSync(join(tmpdir(), "botmesh-events-file-"));
  dirs.push(dir);
  return dir;
}

function freshPath(): string {
  return join(tempDir(), "events.json");
}

/** Makes every snapshot write fail with ENOSPC (as a full disk) until the returned function is called. */
function failWrites(): () => void {
  snapshotWriteTestHooks.beforeWrite = () => {
    throw Object.assign(new Error("ENOSPC: no space left on device, write"), { code: "ENOSPC" });
  };
  return () => {
    snapshotWriteTestHooks.beforeWrite = undefined;
  };
}

/** The temporary files beside `path` (`<path>.tmp`, `<path>.<random>.tmp`). */
function temps(path: string): string[] {
  return readdirSync(join(path, "..")).filter((name) => name.endsWith(".tmp"));
}

async function openAt(path: string, options: Partial<Parameters<typeof FileEventJournal.open>[1]> = {}) {
  const j = await FileEventJournal.open(path, { lock: true, ...options });
  opened.push(j);
  return j;
}

const A: ClaimOptions = { owner: "A", incarnation: "a1", leaseMs: 60_000 };
const B: ClaimOptions = { owner: "B", incarnation: "b1", leaseMs: 60_000 };

function ev(id: string, channel: string | null = null): NewEventRecord {
  return { id, channel, eventType: "order.paid", payload: { order: id }, createdAt: 1_700_000_000_000 };
}

function send(key: string, chatId = "c1"): NewOutboxEntry {
  return { key, chatId, content: { text: key }, contentHash: `h-${key}`, inboundId: null };
}

async function rejection(promise: Promise<unknown>): Promise<Error> {
  try {
    await promise;
  } catch (error) {
    return error as Error;
  }
  throw new Error("expected a rejection");
}

/** The file as JSON. */
function onDisk(path: string): { logSeq: number; outboxSeq: number; events: { id: string }[]; outbox: { key: string }[] } {
  return JSON.parse(readFileSync(path, "utf8"));
}

/** The pid of a process that has exited (and was reaped). */
function deadPid(): number {
  return Bun.spawnSync(["true"]).pid;
}

describe("FileEventJournal orderKey", () => {
  test("is kept in the snapshot; a record stored without one reads as null", async () => {
    const path = freshPath();
    const j = await openAt(path);
    await j.append(ev("old"));
    await j.append({ ...ev("a"), orderKey: "k" });
    await j.close();
    writeFileSync(path, readFileSync(path, "utf8").replaceAll('"orderKey":null,', ""));
    expect(readFileSync(path, "utf8")).not.toContain('"orderKey":null');
    const again = await openAt(path);
    expect((await again.list()).map((e) => [e.id, e.orderKey])).toEqual([["old", null], ["a", "k"]]);
    await again.append({ ...ev("b"), orderKey: "k", createdAt: 1_800_000_000_000 });
    expect((await again.claimDue({ ...A, limit: 2 })).map((e) => e.id)).toEqual(["old", "a"]);
    expect(await again.claimDue({ ...B, limit: 10 }), "b waits behind a, held by A").toEqual([]);
    expect((await again.claimDue({ ...A, limit: 10 })).map((e) => e.id)).toEqual(["b"]);
  });
});

describe("FileEventJournal.open options", () => {
  test("name, scope, path, file, locked", async () => {
    const path = freshPath();
    const j = await openAt(path);
    expect(j.name).toBe("file-events");
    expect(j.scope).toBe("process");
    expect(j.path).toBe(path);
    expect(j.file).toBe(path);
    expect(j.locked).toBe(true);
    expect(j.closed).toBe(false);
  });

  test("`lock` is required: a TypeError naming it; other bad options are named too", async () => {
    const path = freshPath();
    for (const [options, name] of [
      [{}, "lock"],
      [{ lock: "yes" }, "lock"],
      [{ lock: true, fsync: 1 }, "fsync"],
      [{ lock: true, staleLockMs: 10 }, "staleLockMs"],
      [{ lock: true, clock: 5 }, "clock"],
    ] as const) {
      const error = await rejection(FileEventJournal.open(path, options as never));
      expect(error).toBeInstanceOf(TypeError);
      expect(error.message).toContain(`option "${name}"`);
    }
    expect((await rejection(FileEventJournal.open("", { lock: true }))).message).toContain('"path"');
    expect((await rejection(FileEventJournal.open(path, null as never))).message).toContain("{ lock: true }");
    expect(existsSync(path)).toBe(false);
  });

  test("a new file is created at open with its directory, mode 0600; the lock file exists while open", async () => {
    const path = join(tempDir(), "sub", "dir", "events.json");
    const j = await openAt(path);
    expect(onDisk(path)).toMatchObject({ format: "@botmesh/durable/events", version: 1, logSeq: 0, events: [], outbox: [] });
    expect(statSync(path).mode & 0o777).toBe(0o600);
    expect(JSON.parse(readFileSync(`${path}.lock`, "utf8")).pid).toBe(process.pid);
    expect(j.stats.rewrites).toBe(1);
    await j.close();
    expect(existsSync(`${path}.lock`)).toBe(false);
  });

  test("lock: false takes no lock file (locked is false) but still keeps a second open in this process out", async () => {
    const path = freshPath();
    const j = await openAt(path, { lock: false });
    expect(j.locked).toBe(false);
    expect(existsSync(`${path}.lock`)).toBe(false);
    await j.append(ev("e1"));
    expect((await rejection(FileEventJournal.open(path, { lock: false }))).message).toContain("already open in this process");
    await j.close();
    const again = await openAt(path, { lock: false });
    expect((await again.get("e1"))?.state).toBe("pending");
  });

  test("a rewrite keeps an existing file's mode", async () => {
    const path = freshPath();
    const j = await openAt(path);
    await j.close();
    const { chmodSync } = await import("node:fs");
    chmodSync(path, 0o640);
    const k = await openAt(path);
    await k.append(ev("e1"));
    expect(statSync(path).mode & 0o777).toBe(0o640);
  });

  test("the clock option is the journal's and the sidecar's clock", async () => {
    let now = 5_000;
    const j = await openAt(freshPath(), { clock: () => now });
    const e = await j.append({ id: "e1", eventType: "x", payload: null });
    expect(e?.createdAt).toBe(5_000);
    now = 6_000;
    const r = await j.outbox.reserve(send("k1"));
    expect(r.entry.createdAt).toBe(6_000);
  });
});

describe("the lock", () => {
  test("a second open of the same file in this process is refused until the first is closed", async () => {
    const path = freshPath();
    const j = await openAt(path);
    const error = await rejection(FileEventJournal.open(path, { lock: true }));
    expect(error.message).toContain(`FileEventJournal: ${path} is already open in this process`);
    expect(existsSync(`${path}.lock`)).toBe(true); // the first one's lock is untouched
    await j.append(ev("e1")); // and it still works
    await j.close();
    const k = await openAt(path);
    expect((await k.list()).map((e) => e.id)).toEqual(["e1"]);
  });

  test("another live process holding the lock: FileLockedError naming the pid and the lock file; broken once it is gone", async () => {
    const path = freshPath();
    const sleeper = Bun.spawn(["sleep", "30"]);
    try {
      const lockText = JSON.stringify({ pid: sleeper.pid, hostname: hostname(), startedAt: "2024-05-01T10:00:00.000Z" });
      writeFileSync(`${path}.lock`, lockText);
      const error = await rejection(FileEventJournal.open(path, { lock: true }));
      expect(error).toBeInstanceOf(FileLockedError);
      expect(error.message).toContain("FileEventJournal");
      expect(error.message).toContain(`pid ${sleeper.pid}`);
      expect(error.message).toContain(`lock file ${path}.lock`);
      expect((error as FileLockedError).pid).toBe(sleeper.pid);
      expect(readFileSync(`${path}.lock`, "utf8")).toBe(lockText);
      expect(existsSync(path)).toBe(false); // nothing written
      // The refused open did not keep the file registered in this process.
      sleeper.kill("SIGKILL");
      await sleeper.exited;
      const j = await openAt(path);
      expect(JSON.parse(readFileSync(`${path}.lock`, "utf8")).pid).toBe(process.pid);
      expect(j.locked).toBe(true);
    } finally {
      sleeper.kill("SIGKILL");
    }
  });

  test("a lock left by a dead process is broken at once", async () => {
    const path = freshPath();
    writeFileSync(`${path}.lock`, JSON.stringify({ pid: deadPid(), hostname: hostname(), startedAt: "2020-01-01T00:00:00.000Z" }));
    const started = Date.now();
    await openAt(path);
    expect(Date.now() - started).toBeLessThan(2_000);
    expect(JSON.parse(readFileSync(`${path}.lock`, "utf8")).pid).toBe(process.pid);
  });

  test("simulateCrash lets the journal go: the lock file stays, operations reject, the next open breaks the lock", async () => {
    const path = freshPath();
    const j = await openAt(path);
    await j.append(ev("e1"));
    const lockText = readFileSync(`${path}.lock`, "utf8");
    await simulateCrash(j);
    expect(readFileSync(`${path}.lock`, "utf8")).toBe(lockText);
    expect(j.closed).toBe(true);
    expect((await rejection(j.get("e1"))).message).toContain("simulateCrash");
    expect((await rejection(j.outbox.list())).message).toContain("simulateCrash");
    const k = await openAt(path);
    expect((await k.get("e1"))?.state).toBe("pending");
    expect(readFileSync(`${path}.lock`, "utf8")).not.toBe(lockText);
    await j.close(); // a let-go journal's close does nothing
    expect(existsSync(`${path}.lock`)).toBe(true); // k's lock
  });

  test("simulateCrash during a write: the write finishes, waiting operations reject", async () => {
    const path = freshPath();
    const j = await openAt(path);
    const first = j.append(ev("e1"));
    await Promise.resolve();
    await Promise.resolve();
    const crash = simulateCrash(j);
    const results = await Promise.allSettled([first, j.append(ev("e2"))]);
    await crash;
    expect(results[1].status).toBe("rejected");
    const k = await openAt(path);
    expect((await k.list()).map((e) => e.id)).not.toContain("e2");
  });
});

describe("group commit and durability", () => {
  test("N concurrent appends share far fewer rewrites, and each resolves once it is on disk", async () => {
    const path = freshPath();
    const j = await openAt(path);
    const before = j.stats.rewrites;
    const n = 100;
    const results = await Promise.all(Array.from({ length: n }, (_, i) => j.append(ev(`e${i}`))));
    expect(results.every((r) => r !== null)).toBe(true);
    const rewrites = j.stats.rewrites - before;
    expect(rewrites).toBeGreaterThanOrEqual(1);
    expect(rewrites).toBeLessThanOrEqual(3);
    expect(onDisk(path).events.length).toBe(n);
  });

  test("operations arriving during a rewrite share the next one", async () => {
    const path = freshPath();
    const j = await openAt(path);
    const before = j.stats.rewrites;
    const first = j.append(ev("e0"));
    await new Promise((r) => setTimeout(r, 0));
    const later = Array.from({ length: 20 }, (_, i) => j.append(ev(`e${i + 1}`)));
    await Promise.all([first, ...later]);
    expect(j.stats.rewrites - before).toBeLessThanOrEqual(3);
    expect(onDisk(path).events.length).toBe(21);
  });

  test("events and outbox writes share rewrites; an outbox operation resolves only once it is on disk", async () => {
    const path = freshPath();
    const j = await openAt(path);
    const before = j.stats.rewrites;
    await Promise.all([
      j.append(ev("e1")),
      j.outbox.reserve(send("k1")),
      j.outbox.reserve(send("k2", "c2"), A),
      j.append(ev("e2", BOT_CHANNEL)),
    ]);
    expect(j.stats.rewrites - before).toBe(1);
    const disk = onDisk(path);
    expect(disk.outbox.map((e) => e.key)).toEqual(["k1", "k2"]);
    expect(disk.outboxSeq).toBe(2);
    const claim = await j.outbox.claimDue({ ...B, limit: 10 });
    expect(claim.due.map((e) => e.key)).toEqual(["k1"]);
    expect((onDisk(path).outbox[0] as unknown as { state: string }).state).toBe("sending");
    await j.outbox.markSent("k1", claim.due[0].lease!.token, "mid-1");
    expect((onDisk(path).outbox[0] as unknown as { messageId: string }).messageId).toBe("mid-1");
  });

  test("heartbeats (of events and of outbox entries) do not rewrite; the new expiry is written with the next change", async () => {
    const path = freshPath();
    const j = await openAt(path);
    await j.append(ev("e1"), { ...A, leaseMs: 1_000 });
    const { entry } = await j.outbox.reserve(send("k1"), { ...A, leaseMs: 1_000 });
    const before = j.stats.rewrites;
    const diskBefore = readFileSync(path, "utf8");
    expect(await j.heartbeat("e1", 1, 500_000)).toBe(true);
    expect(await j.outbox.heartbeat("k1", entry.lease!.token, 500_000)).toBe(true);
    expect(await j.heartbeat("e1", 99, 500_000)).toBe(false);
    expect(j.stats.rewrites).toBe(before);
    expect(readFileSync(path, "utf8")).toBe(diskBefore);
    await j.append(ev("e2"));
    expect(j.stats.rewrites).toBe(before + 1);
    const disk = JSON.parse(readFileSync(path, "utf8"));
    expect(disk.events[0].lease.expiresAt).toBeGreaterThan(Date.now() + 400_000);
    expect(disk.outbox[0].lease.expiresAt).toBeGreaterThan(Date.now() + 400_000);
  });

  test("markCalling is a change, not a heartbeat: it rewrites and resolves once `called` is on disk", async () => {
    const path = freshPath();
    const j = await openAt(path);
    const { entry } = await j.outbox.reserve(send("k1"), { ...A, leaseMs: 1_000 });
    expect((onDisk(path).outbox[0] as unknown as { called: boolean }).called).toBe(false);
    const before = j.stats.rewrites;
    expect(await j.outbox.markCalling("k1", entry.lease!.token + 1, 500_000), "a stale token").toBe(false);
    expect(j.stats.rewrites, "a refused markCalling writes nothing").toBe(before);
    expect(await j.outbox.markCalling("k1", entry.lease!.token, 500_000)).toBe(true);
    expect(j.stats.rewrites).toBe(before + 1);
    const stored = onDisk(path).outbox[0] as unknown as { called: boolean; lease: { expiresAt: number } };
    expect(stored.called).toBe(true);
    expect(stored.lease.expiresAt).toBeGreaterThan(Date.now() + 400_000);
    await simulateCrash(j);
    const k = await openAt(path);
    expect((await k.outbox.get("k1"))?.called, "after a crash").toBe(true);
  });

  test("reads and no-op results do not rewrite", async () => {
    const j = await openAt(freshPath());
    await j.append(ev("e1"));
    await j.outbox.reserve(send("k1"));
    const before = j.stats.rewrites;
    expect(await j.append(ev("e1"))).toBe(null);
    expect((await j.outbox.reserve(send("k1"))).status).toBe("exists");
    await j.get("e1");
    await j.list();
    await j.outbox.list();
    expect(await j.claimDue({ ...A, channel: "nothing-here", limit: 5 })).toEqual([]);
    expect(await j.claim("nope", A)).toBe(null);
    expect(await j.replay("e1")).toBe(false);
    expect(await j.purge(0)).toBe(0);
    expect(await j.outbox.retry("k1")).toBe(false);
    expect(j.stats.rewrites).toBe(before);
  });

  test("a stale token rejects with StaleLeaseError and changes nothing", async () => {
    const j = await openAt(freshPath());
    await j.append(ev("e1"), A);
    const before = j.stats.rewrites;
    expect(await rejection(j.complete("e1", 7))).toBeInstanceOf(StaleLeaseError);
    expect(j.stats.rewrites).toBe(before);
  });

  test("fsync: false still writes atomically", async () => {
    const path = freshPath();
    const j = await openAt(path, { fsync: false });
    await j.append(ev("e1"));
    expect(onDisk(path).events.map((e) => e.id)).toEqual(["e1"]);
    expect(temps(path)).toEqual([]);
  });
});

describe("a failed rewrite", () => {
  test("rejects every waiting operation and reloads the state from the file", async () => {
    const path = freshPath();
    const j = await openAt(path);
    const head = (await j.outbox.reserve(send("k0"), A)).entry;
    await j.append(ev("e0"));
    const healed = failWrites(); // the next rewrite fails, as on a full disk
    const first = j.append(ev("e1"));
    await Promise.resolve();
    const later = [j.append(ev("e2")), j.outbox.markSent("k0", head.lease!.token, "mid"), j.outbox.reserve(send("k1"))];
    const results = await Promise.allSettled([first, ...later]);
    expect(results.map((r) => r.status)).toEqual(["rejected", "rejected", "rejected", "rejected"]);
    const error = (results[0] as PromiseRejectedResult).reason as Error;
    expect(error.message).toContain(`FileEventJournal could not write ${path}`);
    expect(j.stats.failedRewrites).toBe(1);
    healed();
    expect((await j.list()).map((e) => e.id)).toEqual(["e0"]);
    expect((await j.outbox.list()).map((e) => [e.key, e.state])).toEqual([["k0", "sending"]]);
    await j.outbox.markSent("k0", head.lease!.token, "mid"); // the lease on disk still works
    expect(await j.append(ev("e1"))).not.toBe(null); // redelivered: appended again, not a duplicate
    expect(onDisk(path).events.map((e) => e.id)).toEqual(["e0", "e1"]);
  });

  test("when the file cannot be reloaded either, every operation rejects until it is reopened", async () => {
    const dir = tempDir();
    const path = join(dir, "data", "events.json");
    const j = await openAt(path);
    await j.append(ev("e1"));
    rmSync(join(dir, "data"), { recursive: true, force: true });
    expect((await rejection(j.append(ev("e2")))).message).toContain(`could not write ${path}`);
    mkdirSync(join(dir, "data"));
    for (const op of [j.get("e1"), j.append(ev("e3")), j.outbox.list()]) {
      const failed = await rejection(op);
      expect(failed.message).toContain("nor reload it");
    }
    expect((await rejection(j.close())).message).toContain("nor reload it");
    const k = await openAt(path); // released all the same
    expect(await k.list()).toEqual([]);
  });
});

describe("restart from disk", () => {
  test("keeps events, states, channels, fences, the outbox, its order and seq counter", async () => {
    const path = freshPath();
    const j = await openAt(path);
    await j.append(ev("a"));
    await j.append(ev("b", BOT_CHANNEL));
    await j.append(ev("c"));
    const [claimed] = await j.claimDue({ ...A, limit: 1 });
    await j.fail(claimed.id, claimed.lease!.token, { error: "boom", retryInMs: 0 });
    const [again] = await j.claimDue({ ...A, limit: 1 });
    expect(again.id).toBe("a");
    expect(again.fence).toBe(3);
    const c = (await j.claim("c", B))!;
    await j.complete("c", c.lease!.token);
    await j.outbox.reserve(send("k1"));
    await j.outbox.reserve(send("k2"));
    const out = await j.outbox.claimDue({ ...A, limit: 1 });
    await j.outbox.markSent("k1", out.due[0].lease!.token, "mid-1");
    expect(await j.outbox.discard("k2")).toBe(true);
    await j.outbox.reserve(send("k3"));
    const events = await j.list();
    const outbox = await j.outbox.list();
    await j.close();

    const k = await openAt(path);
    expect(await k.list()).toEqual(events);
    expect(await k.outbox.list()).toEqual(outbox);
    await expect(k.complete("a", 1)).rejects.toBeInstanceOf(StaleLeaseError); // fence survives
    await k.complete("a", 3);
    expect((await k.replay("c"))).toBe(true);
    expect((await k.claim("c", B))?.fence).toBe(3); // the next token follows the stored fence
    expect((await k.outbox.reserve(send("k4"))).entry.seq).toBe(4); // the seq counter continues past the discarded k2
    expect((await k.list({ channel: BOT_CHANNEL })).map((e) => e.id)).toEqual(["b"]);
  });

  test("a snapshot written before `called` existed: its outbox entries read as called, and are rewritten with it", async () => {
    const clock = { now: 1_700_000_000_000 };
    const path = freshPath();
    const old = new MemoryEventJournal({ clock: () => clock.now });
    await old.outbox.reserve(send("k1"), { ...A, leaseMs: 1_000 });
    await old.outbox.reserve(send("k2", "c2"));
    const doc = JSON.parse(serializeEventSnapshot(old, 0));
    for (const entry of doc.outbox) delete entry.called;
    writeFileSync(path, JSON.stringify(doc));

    const j = await openAt(path, { clock: () => clock.now });
    expect((await j.outbox.list()).map((e) => [e.key, e.called])).toEqual([["k1", true], ["k2", true]]);
    // A lapsed old send may have started its call: ambiguous, as before the flag existed.
    clock.now += 2_000;
    const claim = await j.outbox.claimDue({ ...B, limit: 10 });
    expect(claim.ambiguous.map((e) => e.key)).toEqual(["k1"]);
    expect(claim.due.map((e) => [e.key, e.called])).toEqual([["k2", false]]);
    const disk = onDisk(path).outbox as unknown as { key: string; called: boolean }[];
    expect(disk.map((e) => [e.key, e.called]), "rewritten with the flag").toEqual([["k1", true], ["k2", false]]);
  });

  test("a leftover temporary file from a crash mid-write is ignored and removed", async () => {
    const path = freshPath();
    const j = await openAt(path);
    await j.append(ev("e1"));
    await j.close();
    writeFileSync(`${path}.tmp`, '{"format":"@botmesh/durable/events","ver'); // as earlier versions named it
    const leftover = `${path}.${crypto.randomUUID()}.tmp`;
    writeFileSync(leftover, '{"format":"@botmesh/durable/events","ver'); // however young: the lock is ours
    const k = await openAt(path);
    expect((await k.list()).map((e) => e.id)).toEqual(["e1"]);
    expect(temps(path)).toEqual([]);
    await k.close();
    // Without the lock (another process may be writing): only one older than staleLockMs is removed.
    const young = `${path}.${crypto.randomUUID()}.tmp`;
    const old = `${path}.${crypto.randomUUID()}.tmp`;
    writeFileSync(young, "x");
    writeFileSync(old, "x");
    const hourAgo = new Date(Date.now() - 3_600_000);
    utimesSync(old, hourAgo, hourAgo);
    const unlocked = await openAt(path, { lock: false });
    await unlocked.close();
    expect(existsSync(young)).toBe(true);
    expect(existsSync(old)).toBe(false);
  });

  test("a symlink planted at <path>.tmp after open is never written through nor chmod'ed", async () => {
    const path = freshPath();
    const victim = join(path, "..", "victim");
    writeFileSync(victim, "root:x:0:0:root:/root:/bin/bash\n");
    chmodSync(victim, 0o644);
    const j = await openAt(path);
    await j.append(ev("e0"));
    symlinkSync(victim, `${path}.tmp`);
    await j.append({ ...ev("e1"), payload: { card: "4111 1111 1111 1111" } });
    await j.close();
    expect(readFileSync(victim, "utf8")).toBe("root:x:0:0:root:/root:/bin/bash\n");
    expect(statSync(victim).mode & 0o777).toBe(0o644);
    expect(lstatSync(path).isSymbolicLink()).toBe(false);
    expect(onDisk(path).events.map((e) => e.id)).toEqual(["e0", "e1"]);
    expect(temps(path), "only the planted link").toEqual(["events.json.tmp"]);
  });
});

describe("damaged files are never overwritten", () => {
  async function expectCorrupt(path: string, offset: number | null, ...parts: string[]): Promise<FileCorruptError> {
    const before = readFileSync(path);
    const error = await rejection(FileEventJournal.open(path, { lock: true }));
    expect(error).toBeInstanceOf(FileCorruptError);
    expect((error as FileCorruptError).file).toBe(path);
    expect((error as FileCorruptError).offset).toBe(offset);
    expect(error.message).toContain(`FileEventJournal: ${path} is damaged`);
    for (const part of parts) expect(error.message).toContain(part);
    expect(readFileSync(path).equals(before)).toBe(true); // untouched
    expect(existsSync(`${path}.lock`)).toBe(false); // and released
    return error as FileCorruptError;
  }

  async function written(): Promise<string> {
    const path = freshPath();
    const j = await openAt(path);
    await j.append(ev("e1"));
    await j.outbox.reserve(send("k1"));
    await j.close();
    return path;
  }

  test("a truncated file: the offset is the end of the file", async () => {
    const path = await written();
    const text = readFileSync(path, "utf8");
    writeFileSync(path, text.slice(0, text.length - 10));
    await expectCorrupt(path, text.length - 10, "truncated");
  });

  test("an empty file", async () => {
    const path = freshPath();
    writeFileSync(path, "");
    await expectCorrupt(path, 0);
  });

  test("invalid UTF-8: the offset of the bad byte", async () => {
    const path = await written();
    const bytes = readFileSync(path);
    const at = bytes.indexOf(Buffer.from("order.paid"));
    bytes[at + 2] = 0xff;
    writeFileSync(path, bytes);
    await expectCorrupt(path, at + 2, "invalid UTF-8");
  });

  test("wrong format or version: the field is named", async () => {
    const path = await written();
    const doc = JSON.parse(readFileSync(path, "utf8"));
    writeFileSync(path, JSON.stringify({ ...doc, format: "@botmesh/durable/file" }));
    await expectCorrupt(path, null, 'field "format"');
    writeFileSync(path, JSON.stringify({ ...doc, version: 3 }));
    await expectCorrupt(path, null, 'field "version"');
    writeFileSync(path, JSON.stringify({ ...doc, logSeq: -1 }));
    await expectCorrupt(path, null, 'field "logSeq"');
  });

  test("the top level of a valid file that is not a journal names the field", async () => {
    const path = await written();
    const doc = JSON.parse(readFileSync(path, "utf8"));
    writeFileSync(path, JSON.stringify({ ...doc, events: { e1: doc.events[0] } }));
    await expectCorrupt(path, null, "importState");
    writeFileSync(path, JSON.stringify({ ...doc, events: [doc.events[0], doc.events[0]] }));
    await expectCorrupt(path, null, 'event id "e1" appears twice');
  });
});

describe("damaged records: a record that is not valid is set aside, kept in the file as it was", () => {
  test("the rest of the file is read; the first operation that meets it sets it aside, and the file says so", async () => {
    const path = freshPath();
    const first = await openAt(path);
    await first.append(ev("e1"));
    await first.append(ev("e2"));
    await first.outbox.reserve(send("k1"));
    await first.outbox.reserve(send("k2"));
    await first.close();
    const doc = JSON.parse(readFileSync(path, "utf8"));
    doc.events[0].state = "weird";
    doc.outbox[0].lease = { owner: "A" };
    const text = JSON.stringify(doc);
    writeFileSync(path, text);
    const j = await openAt(path, { clock: () => 5_000 });
    expect(readFileSync(path, "utf8"), "opening writes nothing").toBe(text);
    expect((await j.list()).map((e) => e.id)).toEqual(["e2"]);
    const [event] = await j.damaged();
    expect([event.id, event.channel, event.setAsideAt, event.reported]).toEqual(["e1", null, 5_000, false]);
    expect(event.problem).toContain('field "state"');
    await expect(j.get("e1")).rejects.toThrow(/e1.*damaged.*field "state"/);
    expect((await j.outbox.list()).map((e) => e.key)).toEqual(["k2"]);
    const [entry] = await j.outbox.damaged!();
    expect([entry.journal, entry.id, entry.backend]).toEqual(["outbox", "k1", "file-events"]);
    expect(entry.problem).toContain('field "lease"');
    expect(await j.reportDamaged("e1")).toBe(true);
    // On disk: the records as they were, and their marks.
    const after = JSON.parse(readFileSync(path, "utf8"));
    expect(after.events[0]).toEqual(doc.events[0]);
    expect(after.outbox.find((e: { key: string }) => e.key === "k1")).toEqual(doc.outbox[0]);
    expect(after.version, "a file with marks is version 2").toBe(2);
    expect(after.damaged).toEqual([
      { journal: "events", id: "e1", problem: event.problem, setAsideAt: 5_000, reported: true },
      { journal: "outbox", id: "k1", problem: entry.problem, setAsideAt: 5_000, reported: false },
    ]);
    await j.close();
    const again = await openAt(path, { clock: () => 9_000 });
    expect((await again.damaged()).map((d) => [d.id, d.setAsideAt, d.reported])).toEqual([["e1", 5_000, true]]);
    expect(readFileSync(path, "utf8"), "set aside once: nothing new to write").toBe(JSON.stringify(after));
  });

  test("a file without damaged records is written as before (no \"damaged\" field)", async () => {
    const path = await (async () => {
      const p = freshPath();
      const j = await openAt(p);
      await j.append(ev("e1"));
      await j.close();
      return p;
    })();
    const doc = JSON.parse(readFileSync(path, "utf8"));
    expect("damaged" in doc).toBe(false);
    expect(doc.version).toBe(1);
  });
});

describe("taking over a file of a SharedFileEventJournal", () => {
  /** A journal with the given history, its snapshot at `logSeq`, and log lines for entries after it. */
  function changeLines(steps: ((m: MemoryEventJournal) => Promise<unknown>)[], firstSeq: number): Promise<string[]> {
    return (async () => {
      const m = new MemoryEventJournal();
      const lines: string[] = [];
      let seq = firstSeq;
      for (const run of steps) {
        await run(m);
        const changes = m.takeChanges();
        if (changes !== null) lines.push(JSON.stringify({ seq: seq++, ...changes })); // a no-op writes no line
      }
      return lines;
    })();
  }

  test("with a real SharedFileEventJournal (appendLog): its log is taken over, and it goes on from the fresh snapshot", async () => {
    const path = freshPath();
    const shared = await SharedFileEventJournal.open(path, { appendLog: true });
    for (const id of ["e1", "e2", "e3"]) await shared.append(ev(id));
    await shared.append(ev("m1", BOT_CHANNEL), A);
    const [claimed] = await shared.claimDue({ ...B, limit: 1 });
    await shared.complete(claimed.id, claimed.lease!.token);
    await shared.outbox.reserve(send("k1"));
    await shared.outbox.reserve(send("k2"), A);
    const events = await shared.list();
    const outbox = await shared.outbox.list();
    await shared.close();
    expect(readFileSync(`${path}.log`, "utf8").trim().split("\n").length).toBeGreaterThanOrEqual(7);

    const j = await openAt(path);
    expect(j.stats.replayedLogEntries).toBeGreaterThanOrEqual(7);
    expect(await j.list()).toEqual(events);
    expect(await j.outbox.list()).toEqual(outbox);
    expect(existsSync(`${path}.log`)).toBe(false);
    // Both kinds on one file in one process: refused.
    expect((await rejection(SharedFileEventJournal.open(path, { appendLog: true }))).message).toContain("already open");
    await j.append(ev("e4"));
    await j.close();

    const again = await SharedFileEventJournal.open(path, { appendLog: true });
    try {
      expect((await again.list()).map((e) => e.id)).toEqual([...events.map((e) => e.id), "e4"]);
      await again.append(ev("e5"));
      await expect(again.complete("m1", 0)).rejects.toBeInstanceOf(StaleLeaseError);
    } finally {
      await again.close();
    }
    const k = await openAt(path);
    expect((await k.list()).map((e) => e.id)).toEqual([...events.map((e) => e.id), "e4", "e5"]);
    expect((await k.outbox.list()).map((e) => e.key)).toEqual(["k1", "k2"]);
  });

  test("log entries past the snapshot's logSeq are replayed, a torn last line ignored; then a fresh snapshot, no log", async () => {
    const path = freshPath();
    // The snapshot holds entries 1..2 (e1 appended, then claimed).
    const base = new MemoryEventJournal();
    await base.append(ev("e1"));
    await base.claim("e1", A);
    writeFileSync(path, serializeEventSnapshot(base, 2));
    const mem = MemoryEventJournal.fromState(JSON.parse(JSON.stringify(base.exportState())));
    mem.takeChanges();
    const lines = [
      // Entries 1 and 2, already in the snapshot (compaction cut before the log was truncated): skipped.
      JSON.stringify({ seq: 1, events: [{ ...base.exportState().events[0], id: "ghost" }], removedEvents: [], outbox: [], removedOutbox: [], outboxSeq: 0 }),
      JSON.stringify({ seq: 2, events: [], removedEvents: ["e1"], outbox: [], removedOutbox: [], outboxSeq: 0 }),
    ];
    await mem.complete("e1", 2);
    lines.push(JSON.stringify({ seq: 3, ...mem.takeChanges() }));
    await mem.append(ev("e2", BOT_CHANNEL));
    await mem.outbox.reserve(send("k1"), A);
    lines.push(JSON.stringify({ seq: 4, ...mem.takeChanges() }));
    const torn = JSON.stringify({ seq: 5, events: [{ id: "e3" }] }).slice(0, 20);
    writeFileSync(`${path}.log`, lines.join("\n") + "\n" + torn);

    const j = await openAt(path);
    expect(j.stats.replayedLogEntries).toBe(2);
    expect(await j.list()).toEqual(await mem.list());
    expect(await j.outbox.list()).toEqual(await mem.outbox.list());
    expect(existsSync(`${path}.log`)).toBe(false);
    const disk = onDisk(path);
    expect(disk.logSeq).toBe(0);
    expect(disk.events.map((e) => e.id)).toEqual(["e1", "e2"]);
    expect(disk.outbox.map((e) => e.key)).toEqual(["k1"]);
    // The outbox lease of the replayed entry holds.
    await j.outbox.markSent("k1", 1, "mid");
  });

  test("a last log line whose middle was never written (zeros, newline in place) is a torn end: set aside beside the log, warned, earlier lines replayed", async () => {
    const path = freshPath();
    const lines = await changeLines([(m) => m.append(ev("a")), (m) => m.append(ev("b")), (m) => m.append(ev("c"))], 1);
    const text = Buffer.from(lines.join("\n") + "\n");
    const last = text.length - Buffer.byteLength(lines[2]!) - 1;
    const torn = Buffer.from(text);
    torn.fill(0, last + 10, text.length - 10); // page writeback left the line's start, end and newline, not its middle
    writeFileSync(`${path}.log`, torn);
    const warnings: unknown[][] = [];
    const warn = spyOn(console, "warn").mockImplementation((...args: unknown[]) => void warnings.push(args));
    let j: FileEventJournal;
    try {
      j = await openAt(path);
    } finally {
      warn.mockRestore();
    }
    expect((await j.list()).map((e) => e.id)).toEqual(["a", "b"]);
    expect(j.stats.replayedLogEntries).toBe(2);
    expect(readFileSync(`${path}.log.torn-1`).equals(torn.subarray(last)), "the torn bytes, as they were").toBe(true);
    expect(existsSync(`${path}.log`)).toBe(false);
    expect(warnings.length).toBe(1);
    const message = String(warnings[0]![0]);
    expect(message).toContain(`${path}.log ended in a torn write at byte ${last}`);
    expect(message).toContain(`set aside in ${path}.log.torn-1`);
    expect(onDisk(path).events.map((e) => e.id)).toEqual(["a", "b"]);
  });

  test("a log line whose middle was never written, with a JSON line after it, is damage: open() fails naming the log and the offset, nothing set aside", async () => {
    const path = freshPath();
    const lines = await changeLines([(m) => m.append(ev("a")), (m) => m.append(ev("b")), (m) => m.append(ev("c"))], 1);
    const text = Buffer.from(lines.join("\n") + "\n");
    const second = Buffer.byteLength(lines[0]!) + 1;
    const damaged = Buffer.from(text);
    damaged.fill(0, second + 10, second + Buffer.byteLength(lines[1]!) - 10);
    writeFileSync(`${path}.log`, damaged);
    const error = await rejection(openAt(path));
    expect(error).toBeInstanceOf(FileCorruptError);
    expect(error.message).toContain(`${path}.log is damaged at byte ${second + 10}: line 2:`);
    expect((error as FileCorruptError).offset).toBe(second + 10);
    expect(readFileSync(`${path}.log`).equals(damaged)).toBe(true);
    expect(existsSync(`${path}.log.torn-1`)).toBe(false);
  });

  test("log lines written before `called` existed: their outbox entries read as called", async () => {
    const path = freshPath();
    const lines = (await changeLines([
      (m) => m.outbox.reserve(send("k1"), { ...A, leaseMs: 1_000 }),
      (m) => m.outbox.reserve(send("k2", "c2")),
    ], 1)).map((line) => {
      const doc = JSON.parse(line);
      for (const entry of doc.outbox) delete entry.called;
      return JSON.stringify(doc);
    });
    writeFileSync(`${path}.log`, lines.join("\n") + "\n");
    const j = await openAt(path, { clock: () => Date.now() + 1_000_000 }); // past the lease of k1 (the lines were written on Date.now)
    expect(j.stats.replayedLogEntries).toBe(2);
    expect((await j.outbox.list()).map((e) => [e.key, e.called])).toEqual([["k1", true], ["k2", true]]);
    expect((onDisk(path).outbox as unknown as { called: boolean }[]).map((e) => e.called)).toEqual([true, true]);
    const claim = await j.outbox.claimDue({ ...B, limit: 10 });
    expect(claim.ambiguous.map((e) => e.key)).toEqual(["k1"]);
    expect(claim.due.map((e) => e.key)).toEqual(["k2"]);
  });

  test("a crash between the fresh snapshot and the log's removal: replaying again changes nothing", async () => {
    const path = freshPath();
    const lines = await changeLines([
      (m) => m.append(ev("a")),
      (m) => m.append(ev("b")),
      (m) => m.claim("a", A),
      (m) => m.purge(0), // nothing done yet
      (m) => m.complete("a", 2),
      (m) => m.purge(-1), // a purged
      (m) => m.append(ev("a")), // appended again, after b
      (m) => m.outbox.reserve(send("k1")),
    ], 1);
    writeFileSync(`${path}.log`, lines.join("\n") + "\n");
    const j = await openAt(path);
    expect(j.stats.replayedLogEntries).toBe(7); // the no-op purge wrote no line
    const events = await j.list();
    const outbox = await j.outbox.list();
    expect(events.map((e) => [e.id, e.state])).toEqual([["b", "pending"], ["a", "pending"]]);
    await j.close();
    writeFileSync(`${path}.log`, lines.join("\n") + "\n"); // as if the removal had not happened
    const k = await openAt(path);
    expect(await k.list()).toEqual(events);
    expect(await k.outbox.list()).toEqual(outbox);
  });

  test("an entry not above the last one applied (a late write) is skipped; an unterminated last line is ignored even if whole", async () => {
    const path = freshPath();
    const lines = await changeLines([(m) => m.append(ev("a")), (m) => m.append(ev("b"))], 1);
    const late = JSON.stringify({ seq: 2, events: [{ ...JSON.parse(lines[0]).events[0], id: "late" }], removedEvents: [], outbox: [], removedOutbox: [], outboxSeq: 0 });
    const unterminated = (await changeLines([(m) => m.append(ev("x"))], 3))[0];
    writeFileSync(`${path}.log`, [...lines, late].join("\n") + "\n" + unterminated);
    const j = await openAt(path);
    expect(j.stats.replayedLogEntries).toBe(2);
    expect((await j.list()).map((e) => e.id)).toEqual(["a", "b"]);
  });

  test("a damaged line before the last: FileCorruptError naming the log and the byte offset; nothing is written", async () => {
    const path = freshPath();
    const lines = await changeLines([(m) => m.append(ev("a")), (m) => m.append(ev("b")), (m) => m.append(ev("c"))], 1);
    lines[1] = lines[1].replace('"order.paid"', '"order.paid",,');
    const log = lines.join("\n") + "\n";
    writeFileSync(`${path}.log`, log);
    const error = await rejection(FileEventJournal.open(path, { lock: true }));
    expect(error).toBeInstanceOf(FileCorruptError);
    expect((error as FileCorruptError).file).toBe(`${path}.log`);
    expect((error as FileCorruptError).offset).toBe(lines[0].length + 1 + lines[1].indexOf(",,") + 1);
    expect(error.message).toContain("line 2");
    expect(existsSync(path)).toBe(false);
    expect(readFileSync(`${path}.log`, "utf8")).toBe(log);
    expect(existsSync(`${path}.lock`)).toBe(false);
  });

  test("a bad record in a log entry is set aside, kept as it was; a bad entry names the line and the field", async () => {
    const path = freshPath();
    const lines = await changeLines([(m) => m.outbox.reserve(send("k1")), (m) => m.outbox.reserve(send("k2"))], 1);
    const entry = JSON.parse(lines[0]);
    entry.outbox[0].state = "lost";
    writeFileSync(`${path}.log`, [JSON.stringify(entry), lines[1]].join("\n") + "\n");
    const j = await openAt(path);
    expect((await j.outbox.list()).map((e) => e.key)).toEqual(["k2"]);
    expect((await j.outbox.damaged!()).map((d) => [d.id, d.problem])).toEqual([["k1", 'field "state" must be one of queued, sending, sent, failed, dead, unknown, got "lost"']]);
    expect(onDisk(path).outbox.find((e) => e.key === "k1")).toEqual(entry.outbox[0]);
    await j.close();
    writeFileSync(`${path}.log`, JSON.stringify({ events: [] }) + "\n");
    expect((await rejection(FileEventJournal.open(path, { lock: true }))).message).toContain('field "seq"');
  });

  test("while a SharedFileEventJournal holds <path>.mutex, open waits for it before reading", async () => {
    const path = freshPath();
    const held = await new FileMutex(path).acquire();
    let done = false;
    const opening = openAt(path).then((j) => {
      done = true;
      return j;
    });
    await new Promise((r) => setTimeout(r, 150));
    expect(done).toBe(false);
    // The "shared journal" writes under its mutex; the opening journal must see it.
    const base = new MemoryEventJournal();
    await base.append(ev("written-under-the-mutex"));
    writeFileSync(path, serializeEventSnapshot(base, 0));
    await held.release();
    const j = await opening;
    expect((await j.list()).map((e) => e.id)).toEqual(["written-under-the-mutex"]);
    expect(existsSync(`${path}.mutex`)).toBe(false); // released after loading
  });
});

describe("close()", () => {
  test("lets operations already called finish and writes them; later operations reject naming the file", async () => {
    const path = freshPath();
    const j = await openAt(path);
    const called = [j.append(ev("e1")), j.append(ev("e2")), j.outbox.reserve(send("k1"))];
    const closing = j.close();
    expect(j.closed).toBe(true);
    const late = [j.append(ev("e3")), j.get("e1"), j.outbox.reserve(send("k2")), j.outbox.list()].map(rejection);
    await Promise.all(called);
    await closing;
    expect(j.close()).toBe(closing); // the same promise
    for (const op of late) expect((await op).message).toContain(`FileEventJournal ${path} is closed`);
    expect((await late[0]).message).toContain("events.append was called after close()");
    expect((await late[3]).message).toContain("outbox.list was called after close()");
    const disk = onDisk(path);
    expect(disk.events.map((e) => e.id)).toEqual(["e1", "e2"]);
    expect(disk.outbox.map((e) => e.key)).toEqual(["k1"]);
    expect(existsSync(`${path}.lock`)).toBe(false);
    const k = await openAt(path); // the registration is released
    expect((await k.list()).length).toBe(2);
  });

  test("an operation called before close whose rewrite fails rejects; close reloads, then releases the file", async () => {
    const path = freshPath();
    const j = await openAt(path);
    await j.append(ev("e1"));
    const healed = failWrites();
    const pending = rejection(j.append(ev("e2")));
    await j.close(); // nothing is left unwritten: the state was reloaded from the file
    expect((await pending).message).toContain(`FileEventJournal could not write ${path}`);
    healed();
    expect(existsSync(`${path}.lock`)).toBe(false);
    const k = await openAt(path);
    expect((await k.list()).map((e) => e.id)).toEqual(["e1"]);
  });
});
