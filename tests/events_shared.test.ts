/**
 * SharedFileEventJournal with real processes (tests/fixtures/shared_events_worker.ts, run with
 * the bun binary): three workers on one file, a SIGKILLed and a SIGSTOPped mutex holder, a kill
 * between a compaction's snapshot and its truncate, a torn log line, and a FileEventJournal on the
 * same file (refused in both orders).
 */
import { childLines } from "./support/child_lines.ts";
import { afterAll, afterEach, describe, expect, spyOn, test } from "bun:test";
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
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  type SharedFileEventJournalOptions,
  SharedFileEventJournal,
  sharedJournalTestHooks,
} from "../backends/events/shared_journal.ts";
import { FileLockedError } from "../backends/file/lock.ts";
import { FileCorruptError } from "../backends/file/corrupt_error.ts";
import { MemoryEventJournal } from "../backends/events/memory_journal.ts";
import type { EventRecord } from "../src/events/types.ts";

const FIXTURE = join(import.meta.dir, "fixtures", "shared_events_worker.ts");
const root = mkdtempSync(join(tmpdir(), "botmesh-shared-events-"));
afterAll(() => rmSync(root, { recursive: true, force: true }));

let counter = 0;
function freshFile(): string {
  const dir = join(root, `t${counter++}`);
  mkdirSync(dir);
  return join(dir, "events.json");
}

type Child = ReturnType<typeof Bun.spawn<"ignore", "pipe", "inherit">>;
const children: Child[] = [];
const journals: SharedFileEventJournal[] = [];
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
  for (const journal of journals.splice(0)) await journal.close();
});

interface Worker {
  child: Child;
  next(prefix: string, timeoutMs?: number): Promise<string>;
  all(): string[];
}

/** Starts the fixture; `next(prefix)` waits for its next stdout line starting with `prefix`. */
function spawnWorker(mode: string, file: string, config: Record<string, unknown>): Worker {
  const child = Bun.spawn([process.execPath, FIXTURE, mode, file, JSON.stringify(config)], {
    stdin: "ignore",
    stdout: "pipe",
    stderr: "inherit",
  });
  children.push(child);
  return { child, ...childLines(child.stdout, mode, 10_000) };
}

async function openJournal(file: string, options: SharedFileEventJournalOptions): Promise<SharedFileEventJournal> {
  const journal = await SharedFileEventJournal.open(file, options);
  journals.push(journal);
  return journal;
}

async function appendJobs(journal: SharedFileEventJournal, from: number, to: number): Promise<void> {
  for (let i = from; i < to; i++) await journal.append({ id: `job-${i}`, eventType: "job", payload: { i } });
}

/**
 * Checks the workers' reports against the file: each job done exactly once, no two holders of one
 * event at once, claim tokens unique and increasing per event across processes, stale completions
 * refused, and the file's fence of each job equal to its number of claims.
 */
async function checkCounts(file: string, options: SharedFileEventJournalOptions, workers: Worker[], total: number) {
  const lines = workers.flatMap((w) => w.all());
  expect(lines.filter((l) => l.startsWith("OVERLAP")), "two processes held one event at once").toEqual([]);
  expect(lines.filter((l) => l.startsWith("STALE-ACCEPTED") || l.startsWith("ERROR"))).toEqual([]);
  const done = lines.filter((l) => l.startsWith("DONE ")).map((l) => l.split(" ")[1]);
  expect(done.length, "sum of completions").toBe(total);
  expect(new Set(done).size, "each event done once").toBe(total);
  const tokens = new Map<string, number[]>();
  for (const w of workers) {
    for (const line of w.all()) {
      if (!line.startsWith("CLAIM ")) continue;
      const [, id, token] = line.split(" ");
      tokens.set(id, [...(tokens.get(id) ?? []), Number(token)]);
    }
  }
  const check = await SharedFileEventJournal.open(file, options);
  try {
    const all = await check.list({ limit: 10_000 });
    const jobs = all.filter((e) => e.eventType === "job");
    expect(jobs.length).toBe(total);
    expect(jobs.every((e) => e.state === "done"), "every job done").toBe(true);
    // A write whose commit was refused ran again under the mutex: in the journal exactly when acknowledged.
    const committed = workers.filter((w) => w.all().includes("COMMITTED")).map((w) => `zombie-${w.child.pid}`);
    expect(all.filter((e) => e.id.startsWith("zombie-")).map((e) => e.id).sort()).toEqual(committed.sort());
    for (const event of jobs) {
      const seen = (tokens.get(event.id) ?? []).sort((a, b) => a - b);
      // One claim per token across all processes: tokens 2..fence (appended unleased: claims never issue
      // the writer's token 1), each issued once.
      expect(seen, `tokens of ${event.id}`).toEqual(Array.from({ length: event.fence - 1 }, (_, i) => i + 2));
      expect(event.attempts).toBe(event.fence - 1);
    }
    return all;
  } finally {
    await check.close();
  }
}

const MODES: { name: string; options: SharedFileEventJournalOptions }[] = [
  { name: "snapshot rewrite", options: {} },
  { name: "appendLog", options: { appendLog: { compactEvery: 25 } } },
];

for (const { name, options } of MODES) {
  const config = { appendLog: options.appendLog ?? false };

  describe(`SharedFileEventJournal across processes (${name})`, () => {
    test("three workers claim from one stream: exclusive claims, fencing across processes, counts add up", async () => {
      const file = freshFile();
      const TOTAL = 90;
      const journal = await openJournal(file, options);
      await appendJobs(journal, 0, 30);
      const workers = [1, 2, 3].map((n) => spawnWorker("work", file, { ...config, total: TOTAL, name: `w${n}` }));
      for (let i = 30; i < TOTAL; i += 10) {
        await Bun.sleep(30);
        await appendJobs(journal, i, i + 10); // the stream goes on while the workers claim
      }
      for (const w of workers) await w.next("EXIT", 14_000);
      await journal.close();
      const all = await checkCounts(file, options, workers, TOTAL);
      // Each worker did part of the work.
      for (const w of workers) expect(w.all().some((l) => l.startsWith("DONE"))).toBe(true);
      expect(all.length).toBe(TOTAL);
    }, 20_000);

    test("SIGKILL of the mutex holder: its mutex is broken at once and the others go on", async () => {
      const file = freshFile();
      const TOTAL = 40;
      const journal = await openJournal(file, options); // staleLockMs 30 s: only the dead pid can explain a quick break
      await appendJobs(journal, 0, TOTAL);
      const holder = spawnWorker("pause-commit", file, { ...config, total: TOTAL, pauseAfter: 3, go: `${file}.go`, name: "a" });
      await holder.next("PAUSED");
      const others = [2, 3].map((n) => spawnWorker("work", file, { ...config, total: TOTAL, name: `w${n}` }));
      await Bun.sleep(100);
      expect(existsSync(`${file}.mutex`), "the paused process holds the mutex").toBe(true);
      holder.child.kill("SIGKILL");
      await holder.child.exited;
      const killedAt = Date.now();
      expect(await journal.get("job-0")).not.toBeNull(); // waits for the mutex: broken at once, not after 30 s
      expect(Date.now() - killedAt).toBeLessThan(5_000);
      for (const w of others) await w.next("EXIT", 14_000);
      await journal.close();
      await checkCounts(file, options, [holder, ...others], TOTAL);
    }, 20_000);

    test("SIGSTOP of the mutex holder: broken after staleLockMs; after SIGCONT its commit is refused and runs again", async () => {
      const file = freshFile();
      const TOTAL = 30;
      const stale = { ...config, staleLockMs: 1_000 };
      const journal = await openJournal(file, { ...options, staleLockMs: 1_000 });
      await appendJobs(journal, 0, TOTAL);
      await journal.close();
      const go = `${file}.go`;
      const holder = spawnWorker("pause-commit", file, { ...stale, total: TOTAL, pauseAfter: 2, go, name: "a" });
      await holder.next("PAUSED");
      holder.child.kill("SIGSTOP");
      const stoppedAt = Date.now();
      const others = [2, 3].map((n) => spawnWorker("work", file, { ...stale, total: TOTAL, name: `w${n}` }));
      const first = await others[0].next("DONE", 14_000);
      expect(first).toBeTruthy();
      expect(Date.now() - stoppedAt, "the stopped holder's mutex is broken only once stale").toBeGreaterThanOrEqual(900);
      for (const w of others) await w.next("EXIT", 14_000);
      writeFileSync(go, "");
      holder.child.kill("SIGCONT");
      // Its link finds its generation taken: nothing of it was committed; it ran again on the newest state.
      expect(await holder.next("COMMITTED", 10_000)).toBe("COMMITTED");
      await holder.child.exited;
      await checkCounts(file, options, [holder, ...others], TOTAL);
    }, 20_000);
  });
}

test("processes in different modes share one file (rewrite, appendLog, appendLog compacting every 5)", async () => {
  const file = freshFile();
  const TOTAL = 60;
  const journal = await openJournal(file, {});
  await appendJobs(journal, 0, TOTAL);
  await journal.close();
  const modes = [false, true, { compactEvery: 5 }];
  const workers = modes.map((appendLog, n) => spawnWorker("work", file, { appendLog, total: TOTAL, name: `m${n}` }));
  for (const w of workers) await w.next("EXIT", 14_000);
  for (const options of [{}, { appendLog: true }]) await checkCounts(file, options, workers, TOTAL);
}, 20_000);

describe("SharedFileEventJournal appendLog: crashes", () => {
  const options: SharedFileEventJournalOptions = { appendLog: { compactEvery: 10 } };
  const ids = (events: EventRecord[]) => events.map((e) => `${e.id}:${e.state}`);

  test("SIGKILL after a compaction's commit, before the mirror: reopen loses nothing, the mirror is repaired", async () => {
    const file = freshFile();
    const w = spawnWorker("pause-compaction", file, { appendLog: { compactEvery: 10 }, count: 50 });
    await w.next("COMPACTING");
    w.child.kill("SIGKILL");
    await w.child.exited;
    const appended = w.all().filter((l) => l.startsWith("APPENDED ")).map((l) => l.split(" ")[1]);
    const completed = w.all().filter((l) => l.startsWith("COMPLETED ")).map((l) => l.split(" ")[1]);
    expect(appended.length).toBeGreaterThan(3);
    expect(statSync(`${file}.log`).size, "the mirror's log was not truncated").toBeGreaterThan(0);

    const journal = await openJournal(file, options);
    const events = await journal.list({ limit: 1000 });
    for (const id of appended) expect(events.some((e) => e.id === id), id).toBe(true);
    for (const id of completed) expect((await journal.get(id))?.state, id).toBe("done");
    // It goes on: more writes (and compactions) after the crash, seen the same by a fresh open of either mode.
    await appendJobs(journal, 100, 125);
    const after = ids(await journal.list({ limit: 1000 }));
    await journal.close();
    for (const mode of [options, {}]) {
      const again = await openJournal(file, mode);
      expect(ids(await again.list({ limit: 1000 }))).toEqual(after);
      await again.close();
    }
    // The mirror (the journal file and its .log) holds it all too: what a FileEventJournal opened later reads.
    const { FileEventJournal } = await import("../backends/events/file_journal.ts");
    const single = await FileEventJournal.open(file, { lock: true });
    expect(ids(await single.list({ limit: 1000 }))).toEqual(after);
    await single.close();
  }, 20_000);

  test("a writer killed mid-line in the .log mirror: nothing acknowledged is lost, the next write repairs the mirror", async () => {
    const file = freshFile();
    const w = spawnWorker("torn", file, { appendLog: { compactEvery: 1000 }, tornAt: 7 });
    await w.next("TORN");
    await w.child.exited;
    const log = readFileSync(`${file}.log`);
    expect(log[log.length - 1], "the log ends mid-line").not.toBe(10);
    const appended = w.all().filter((l) => l.startsWith("APPENDED ")).map((l) => l.split(" ")[1]);
    expect(appended.length).toBeGreaterThan(3);

    const journal = await openJournal(file, options); // the dead writer's mutex is broken at once
    for (const id of appended) expect(await journal.get(id), id).not.toBeNull();
    await journal.append({ id: "after-the-tear", eventType: "job", payload: null });
    const repaired = readFileSync(`${file}.log`);
    expect(repaired.length === 0 || repaired[repaired.length - 1] === 10, "the mirror is whole again").toBe(true);
    const after = ids(await journal.list({ limit: 1000 }));
    await journal.close();
    const again = await openJournal(file, options);
    expect(ids(await again.list({ limit: 1000 }))).toEqual(after);
    expect(await again.get("after-the-tear")).not.toBeNull();
    await again.close();
    const { FileEventJournal } = await import("../backends/events/file_journal.ts");
    const single = await FileEventJournal.open(file, { lock: true });
    expect(ids(await single.list({ limit: 1000 }))).toEqual(after);
    await single.close();
  }, 20_000);
});

/** Waits until the process is stopped (state `T` in /proc). */
async function waitStopped(pid: number): Promise<void> {
  const until = Date.now() + 5_000;
  while (readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1]?.[0] !== "T") {
    if (Date.now() > until) throw new Error(`process ${pid} did not stop`);
    await Bun.sleep(5);
  }
}

describe("a holder stopped at its commit, past staleLockMs: two holders never both commit", () => {
  const STALE = 1_000;
  const ids = async (journal: SharedFileEventJournal) => (await journal.list({ limit: 100 })).map((e) => e.id);

  for (const { name, options: base } of MODES) {
    const options = { ...base, staleLockMs: STALE };
    const config = { appendLog: base.appendLog ?? false, staleLockMs: STALE };

    test(`between its checks and its link (${name}): its link is refused, the write runs again on top`, async () => {
      const file = freshFile();
      const b = await openJournal(file, options);
      await b.append({ id: "seed", eventType: "job", payload: null });
      const a = spawnWorker("stop-after-check", file, config);
      await a.next("STOPPING");
      await waitStopped(a.child.pid);
      await b.append({ id: "b-1", eventType: "job", payload: null }); // breaks the stuck mutex once stale; commits A's generation
      a.child.kill("SIGCONT");
      expect(await a.next("COMMITTED", 10_000)).toBe("COMMITTED"); // refused at the link, then ran again under the mutex
      await a.child.exited;
      const zombie = `zombie-${a.child.pid}`;
      expect(await ids(b)).toEqual(["seed", "b-1", zombie]);
      await b.append({ id: "b-2", eventType: "job", payload: null });
      await b.close();
      const fresh = await openJournal(file, options);
      expect(await ids(fresh)).toEqual(["seed", "b-1", zombie, "b-2"]);
    }, 20_000);

    test(`right after its link (${name}): its write is in; told it may be (a newer generation came at once)`, async () => {
      const file = freshFile();
      const b = await openJournal(file, options);
      await b.append({ id: "seed", eventType: "job", payload: null });
      const a = spawnWorker("stop-after-link", file, config);
      await a.next("STOPPING");
      await waitStopped(a.child.pid);
      await b.append({ id: "b-1", eventType: "job", payload: null }); // on top of A's committed generation
      a.child.kill("SIGCONT");
      const lost = await a.next("LOST", 10_000);
      expect(lost).toContain("FileMutexLostError");
      expect(lost).toContain("may or may not be in the journal");
      await a.child.exited;
      const zombie = `zombie-${a.child.pid}`;
      expect(await ids(b)).toEqual(["seed", zombie, "b-1"]);
      await b.close();
      const fresh = await openJournal(file, options);
      expect(await ids(fresh)).toEqual(["seed", zombie, "b-1"]);
    }, 20_000);
  }
});

describe("SharedFileEventJournal and a FileEventJournal on one file", () => {
  for (const { name, options } of MODES) {
    test(`a live FileEventJournal first: the shared open is refused (${name})`, async () => {
      const file = freshFile();
      const go = `${file}.go`;
      const w = spawnWorker("file-journal", file, { go });
      await w.next("OPEN");
      const error = await SharedFileEventJournal.open(file, options).then(() => null, (e: unknown) => e);
      expect(error).toBeInstanceOf(FileLockedError);
      expect((error as Error).message).toContain(`pid ${w.child.pid}`);
      writeFileSync(go, "");
      await w.next("CLOSED");
      await w.child.exited;
      const journal = await openJournal(file, options);
      expect((await journal.get("from-file-journal"))?.state).toBe("pending");
    }, 20_000);

    test(`a FileEventJournal opened later: each shared operation is refused, no record lost (${name})`, async () => {
      const file = freshFile();
      const journal = await openJournal(file, options);
      await appendJobs(journal, 0, 3);
      const go = `${file}.go`;
      const w = spawnWorker("file-journal", file, { go });
      await w.next("OPEN");
      for (const op of [() => journal.append({ id: "refused", eventType: "job", payload: null }), () => journal.list()]) {
        const error = await op().then(() => null, (e: unknown) => e);
        expect(error).toBeInstanceOf(FileLockedError);
      }
      writeFileSync(go, "");
      await w.next("CLOSED");
      await w.child.exited;
      const ids = (await journal.list()).map((e) => e.id).sort();
      expect(ids).toEqual(["from-file-journal", "job-0", "job-1", "job-2"]);
      await journal.append({ id: "later", eventType: "job", payload: null });
      expect(await journal.get("later")).not.toBeNull();
    }, 20_000);
  }
});

describe("SharedFileEventJournal in one process", () => {
  test("close() lets operations already called finish and rejects later ones", async () => {
    const file = freshFile();
    const journal = await openJournal(file, {});
    const called = [0, 1, 2, 3, 4].map((i) => journal.append({ id: `c${i}`, eventType: "job", payload: i }));
    const closing = journal.close();
    const late = await journal.get("c0").then(() => null, (e: unknown) => e as Error);
    expect(late?.message).toContain("closed");
    expect((await Promise.all(called)).map((r) => r?.id)).toEqual(["c0", "c1", "c2", "c3", "c4"]);
    await closing;
    await journal.close(); // again: nothing
    const again = await openJournal(file, {});
    expect((await again.list()).length).toBe(5);
    expect((await again.outbox.list()).length).toBe(0);
  });

  test("appendLog by default: a small journal is compacted after 1,000 deltas, not left with thousands of delta files", async () => {
    const file = freshFile();
    const journal = await openJournal(file, { appendLog: true, fsync: false });
    let most = 0;
    for (let i = 0; i < 1_300; i++) {
      await journal.append({ id: `d${i}`, eventType: "job", payload: i });
      if (i % 50 === 0) most = Math.max(most, readdirSync(`${file}.gen`).length);
    }
    most = Math.max(most, readdirSync(`${file}.gen`).length);
    expect(most, "delta files of one snapshot at most (the snapshot is far below 1 MiB)").toBeLessThanOrEqual(1_002);
    expect(most, "deltas do pile up between compactions").toBeGreaterThan(900);
    await journal.close();
    const again = await openJournal(file, {});
    expect((await again.list({ limit: 2_000 })).length).toBe(1_300);
  }, 60_000);

  test("appendLog: a write is one delta generation (and one line of the .log mirror); every compactEvery a snapshot", async () => {
    const file = freshFile();
    const journal = await openJournal(file, { appendLog: { compactEvery: 3 } });
    const gens = () => readdirSync(`${file}.gen`).sort((x, y) => Number(x) - Number(y));
    expect(gens(), "the open commits the first snapshot").toEqual(["1"]);
    await journal.append({ id: "a", eventType: "job", payload: null }); // generation 2
    await journal.append({ id: "b", eventType: "job", payload: null }); // generation 3
    expect(gens()).toEqual(["1", "2", "3"]);
    const delta = JSON.parse(readFileSync(`${file}.gen/3`, "utf8"));
    expect(delta.seq).toBe(3);
    expect(delta.events.map((e: EventRecord) => e.id)).toEqual(["b"]);
    const lines = readFileSync(`${file}.log`, "utf8").split("\n");
    expect(lines.length).toBe(3);
    expect(JSON.parse(lines[1])).toEqual(delta);
    await journal.append({ id: "c", eventType: "job", payload: null }); // generation 4
    await journal.append({ id: "d", eventType: "job", payload: null }); // generation 5: 3 deltas since the snapshot
    expect(gens(), "the generations before a snapshot are removed").toEqual(["5"]);
    expect(JSON.parse(readFileSync(`${file}.gen/5`, "utf8")).logSeq).toBe(5);
    expect(statSync(`${file}.log`).size).toBe(0);
    expect(statSync(file).ino, "the mirror is the snapshot (a hard link)").toBe(statSync(`${file}.gen/5`).ino);
    await journal.append({ id: "e", eventType: "job", payload: null });
    expect(JSON.parse(readFileSync(`${file}.log`, "utf8")).seq).toBe(6);
  });

  test("appendLog: a delta longer than 64 KiB is mirrored as a line too, the next one appended after it", async () => {
    const file = freshFile();
    const journal = await openJournal(file, { appendLog: true });
    const mirror = statSync(file).ino;
    await journal.append({ id: "big", eventType: "job", payload: { text: "x".repeat(300_000) } });
    await journal.append({ id: "small", eventType: "job", payload: null });
    const lines = readFileSync(`${file}.log`, "utf8").split("\n").filter(Boolean);
    expect(lines.map((line) => JSON.parse(line).seq)).toEqual([2, 3]);
    expect(statSync(file).ino, "the mirror's snapshot was not rewritten").toBe(mirror);
    expect(readdirSync(`${file}.gen`).sort(), "no compaction: the default follows the snapshot's size, at least 1 MiB").toEqual(["1", "2", "3"]);
  });

  test("appendLog default: compacted once the deltas hold twice the snapshot's bytes (at least 1 MiB)", async () => {
    const file = freshFile();
    const journal = await openJournal(file, { appendLog: true });
    const payload = { text: "y".repeat(100_000) };
    for (let i = 0; i < 12; i++) await journal.append({ id: `e${i}`, eventType: "job", payload });
    const gens = readdirSync(`${file}.gen`).map(Number).sort((a, b) => a - b);
    expect(gens[0], "a snapshot was written after about 1 MiB of deltas").toBeGreaterThan(1);
    expect(gens.length).toBeLessThan(12);
    expect((await journal.list()).length).toBe(12);
  });

  test("a damaged delta generation: FileCorruptError naming the file and the offset", async () => {
    const file = freshFile();
    const journal = await openJournal(file, { appendLog: true });
    await journal.append({ id: "a", eventType: "job", payload: null }); // generation 2
    await journal.close();
    writeFileSync(`${file}.gen/3`, '{"seq":3,not json}\n');
    const error = await SharedFileEventJournal.open(file, { appendLog: true }).then(() => null, (e: unknown) => e as Error);
    expect(error?.name).toBe("FileCorruptError");
    expect(error?.message).toContain(`${file}.gen/3`);
    expect(error?.message).toContain("byte 9");
  });

  test("a bad outbox entry in a delta generation is set aside, kept as it was; the rest is read", async () => {
    const file = freshFile();
    const journal = await openJournal(file, { appendLog: true });
    await journal.append({ id: "a", eventType: "job", payload: null }); // generation 2
    await journal.outbox.reserve({ key: "k1", chatId: "c", content: "hi", contentHash: "h", inboundId: null }); // 3
    await journal.close();
    const entry = JSON.parse(readFileSync(`${file}.gen/3`, "utf8"));
    entry.seq = 4;
    entry.outbox[0].state = "sending"; // with lease null
    const line = `${JSON.stringify(entry)}\n`;
    writeFileSync(`${file}.gen/4`, line);
    const again = await openJournal(file, { appendLog: true });
    expect((await again.list()).map((e) => e.id)).toEqual(["a"]);
    expect(await again.outbox.list()).toEqual([]);
    const [damaged] = await again.outbox.damaged!();
    expect([damaged.id, damaged.backend]).toEqual(["k1", "shared-file-events"]);
    expect(damaged.problem).toContain('field "lease"');
    expect(readFileSync(`${file}.gen/4`, "utf8"), "the generation is left as it is").toBe(line);
    // Its mark is the next generation; a snapshot (the mirror, a compaction) keeps the entry as it was.
    const mark = JSON.parse(readFileSync(`${file}.gen/5`, "utf8"));
    expect(mark.damaged).toEqual([{ journal: "outbox", id: "k1", problem: damaged.problem, setAsideAt: damaged.setAsideAt, reported: false }]);
  });

  test("processes that meet one damaged record: it is set aside once, and reported by exactly one", async () => {
    const file = freshFile();
    const journal = await openJournal(file, {});
    await journal.append({ id: "bad", eventType: "job", payload: null });
    await journal.append({ id: "good", eventType: "job", payload: null });
    await journal.close();
    const gens = readdirSync(`${file}.gen`).filter((n) => /^\d+$/.test(n)).map(Number).sort((a, b) => b - a);
    const newest = `${file}.gen/${gens[0]}`;
    const doc = JSON.parse(readFileSync(newest, "utf8"));
    doc.events[0].state = "exploded";
    writeFileSync(newest, JSON.stringify(doc));
    const script = `
      const { SharedFileEventJournal } = await import(${JSON.stringify(join(import.meta.dir, "..", "backends", "events", "shared_journal.ts"))});
      const j = await SharedFileEventJournal.open(${JSON.stringify(file)}, { mutexTimeoutMs: 30000 });
      const claimed = await j.claimDue({ owner: String(process.pid), incarnation: "i", leaseMs: 60000, limit: 10 });
      const found = await j.damaged();
      const reported = await j.reportDamaged("bad");
      await j.close();
      console.log(JSON.stringify({ claimed: claimed.map((e) => e.id), found: found.map((d) => [d.id, d.setAsideAt]), reported }));
    `;
    const children = Array.from({ length: 4 }, () =>
      Bun.spawn([process.execPath, "-e", script], { stdin: "ignore", stdout: "pipe", stderr: "inherit" })
    );
    const outputs = await Promise.all(children.map(async (child) => {
      const text = await new Response(child.stdout).text();
      expect(await child.exited).toBe(0);
      return JSON.parse(text) as { claimed: string[]; found: [string, number][]; reported: boolean };
    }));
    expect(outputs.filter((o) => o.reported).length, "reported by exactly one").toBe(1);
    expect(new Set(outputs.map((o) => JSON.stringify(o.found))).size, "set aside once: every process sees one mark").toBe(1);
    expect(outputs.flatMap((o) => o.claimed), "the other record claimed once").toEqual(["good"]);
    const check = await openJournal(file, {});
    expect((await check.damaged()).map((d) => [d.id, d.reported])).toEqual([["bad", true]]);
    const after = JSON.parse(readFileSync(check.path, "utf8"));
    expect(after.events[0], "kept as it was").toEqual(doc.events[0]);
  }, 20_000);

  test("orderKey is kept by snapshots and deltas; a record stored without one reads as null", async () => {
    const file = freshFile();
    const journal = await openJournal(file, { appendLog: { compactEvery: 3 } });
    await journal.append({ id: "old", eventType: "job", payload: null }); // generation 2: a delta
    await journal.append({ id: "a", orderKey: "k", eventType: "job", payload: null }); // 3
    await journal.append({ id: "b", orderKey: "k", eventType: "job", payload: null, createdAt: 0 }); // 4: a snapshot
    await journal.append({ id: "c", orderKey: "k2", eventType: "job", payload: null }); // 5: a delta
    await journal.close();
    // As a version without ordering groups wrote it.
    let stripped = 0;
    for (const name of readdirSync(`${file}.gen`)) {
      const gen = `${file}.gen/${name}`;
      const text = readFileSync(gen, "utf8");
      stripped += text.split('"orderKey":null,').length - 1;
      writeFileSync(gen, text.replaceAll('"orderKey":null,', ""));
    }
    expect(stripped, "the record without a key").toBe(1);
    const again = await openJournal(file, { appendLog: true });
    expect((await again.list()).map((e) => [e.id, e.orderKey])).toEqual([["old", null], ["a", "k"], ["b", "k"], ["c", "k2"]]);
    const A = { owner: "A", incarnation: "a1", leaseMs: 60_000 };
    expect((await again.claimDue({ ...A, limit: 1 })).map((e) => e.id)).toEqual(["b"]);
    await again.close();
    const reopened = await openJournal(file, {}); // from the newest generation: A's lease of "b" holds key "k" back
    expect((await reopened.claimDue({ owner: "B", incarnation: "b1", leaseMs: 60_000, limit: 10 })).map((e) => e.id))
      .toEqual(["old", "c"]);
  });

  test("a file of the earlier format (snapshot stamped generation/writer, a .log, a torn last line) opens and is upgraded", async () => {
    const file = freshFile();
    const journal = await openJournal(file, { appendLog: true });
    await journal.append({ id: "a", eventType: "job", payload: null });
    await journal.append({ id: "b", eventType: "job", payload: null });
    await journal.close();
    // As the earlier version left it: no generations, the old stamp, log lines after the snapshot's logSeq.
    rmSync(`${file}.gen`, { recursive: true });
    writeFileSync(file, readFileSync(file, "utf8").replace(',"shared":2,"adopted":null', ""));
    writeFileSync(`${file}.log`, '{"seq":9,"w":"x","events":[{"id":"torn', { flag: "a" });
    for (const options of [{ appendLog: true }, {}]) {
      const again = await openJournal(file, options);
      expect((await again.list()).map((e) => e.id).slice(0, 2)).toEqual(["a", "b"]);
      await again.append({ id: `more-${options.appendLog ? "log" : "snap"}`, eventType: "job", payload: null });
      await again.close();
    }
    const last = await openJournal(file, {});
    expect((await last.list()).map((e) => e.id)).toEqual(["a", "b", "more-log", "more-snap"]);
  });

  test("the temporary files a killed writer leaves (.tmp, .stale, .release) are removed on the next open", async () => {
    const file = freshFile();
    const first = await openJournal(file, {});
    await first.close();
    const old = [`${file}.k1.tmp`, `${file}.mutex.n1.tmp`, `${file}.mutex.n1.stale`, `${file}.mutex.n1.release`, `${file}.lock.n2.stale`, `${file}.gen/t1.tmp`];
    const young = `${file}.mutex.n3.stale`;
    const unrelated = `${file}.go`;
    const hourAgo = new Date(Date.now() - 3_600_000);
    for (const path of old) {
      writeFileSync(path, "x");
      utimesSync(path, hourAgo, hourAgo);
    }
    writeFileSync(young, "x");
    writeFileSync(unrelated, "x");
    utimesSync(unrelated, hourAgo, hourAgo);
    await openJournal(file, {});
    for (const path of old) expect(existsSync(path), path).toBe(false);
    expect(existsSync(young), "a live writer's (younger than staleLockMs) is kept").toBe(true);
    expect(existsSync(unrelated)).toBe(true);
  });

  test("appendLog: a symlink planted at <file>.log is never appended to, truncated nor chmod'ed", async () => {
    const file = freshFile();
    const victim = join(file, "..", "victim");
    writeFileSync(victim, "root:x:0:0:root:/root:/bin/bash\n");
    chmodSync(victim, 0o644);
    const journal = await openJournal(file, { appendLog: { compactEvery: 3 } });
    await journal.append({ id: "e0", eventType: "order.paid", payload: { card: "4111 1111 1111 1111" } });
    rmSync(`${file}.log`, { force: true });
    symlinkSync(victim, `${file}.log`);
    // Appends mirrored as log lines, and compactions that rewrite the mirror and empty its log.
    for (let i = 1; i < 8; i++) await journal.append({ id: `e${i}`, eventType: "order.paid", payload: { card: "4111 1111 1111 1111" } });
    await journal.close();
    expect(readFileSync(victim, "utf8")).toBe("root:x:0:0:root:/root:/bin/bash\n");
    expect(statSync(victim).mode & 0o777).toBe(0o644);
    expect(lstatSync(`${file}.log`).isSymbolicLink(), "the planted link is left alone").toBe(true);
    const again = await openJournal(file, { appendLog: true });
    expect((await again.list()).map((e) => e.id)).toEqual(["e0", "e1", "e2", "e3", "e4", "e5", "e6", "e7"]);
  });

  test("appendLog: markCalling is a change: one line with `called` is appended before it resolves", async () => {
    const file = freshFile();
    const journal = await openJournal(file, { appendLog: true });
    const { entry } = await journal.outbox.reserve(
      { key: "k1", chatId: "c", content: "hi", contentHash: "h", inboundId: null },
      { owner: "o", incarnation: "i", leaseMs: 1_000 },
    );
    const lines = () => readFileSync(`${file}.log`, "utf8").trim().split("\n").map((l) => JSON.parse(l));
    expect(lines().at(-1).outbox[0].called).toBe(false);
    expect(await journal.outbox.markCalling("k1", entry.lease!.token + 1, 60_000), "a stale token").toBe(false);
    expect(await journal.outbox.markCalling("k1", entry.lease!.token, 60_000)).toBe(true);
    const last = lines().at(-1);
    expect(last.outbox.map((e: { key: string; called: boolean }) => [e.key, e.called])).toEqual([["k1", true]]);
    expect(last.outbox[0].lease.expiresAt).toBeGreaterThan(entry.lease!.expiresAt);
    await journal.close();
    const again = await openJournal(file, { appendLog: true });
    expect((await again.outbox.get("k1"))?.called).toBe(true);
  });

  for (const mode of ["rewrite", "appendLog"] as const) {
    test(`a file written before \`called\` existed (${mode}): its outbox entries read as called`, async () => {
      const file = freshFile();
      const options: SharedFileEventJournalOptions = mode === "appendLog" ? { appendLog: true } : {};
      const journal = await openJournal(file, options);
      await journal.outbox.reserve(
        { key: "k1", chatId: "c1", content: "hi", contentHash: "h", inboundId: null },
        { owner: "o", incarnation: "i", leaseMs: 1_000 },
      );
      await journal.outbox.reserve({ key: "k2", chatId: "c2", content: "hi", contentHash: "h", inboundId: null });
      await journal.close();
      // Strip the flag wherever it was written, as an older version wrote the file.
      const strip = (doc: { outbox?: Record<string, unknown>[] }) => {
        for (const entry of doc.outbox ?? []) delete entry.called;
        return JSON.stringify(doc);
      };
      // An older version: no generations, the journal file and its .log only.
      rmSync(`${file}.gen`, { recursive: true, force: true });
      if (existsSync(file)) writeFileSync(file, strip(JSON.parse(readFileSync(file, "utf8"))));
      if (mode === "appendLog") {
        const lines = readFileSync(`${file}.log`, "utf8").trim().split("\n");
        expect(lines.length).toBe(2);
        writeFileSync(`${file}.log`, lines.map((l) => strip(JSON.parse(l))).join("\n") + "\n");
      } else {
        expect(readFileSync(file, "utf8")).not.toContain('"called"');
      }
      const again = await openJournal(file, { ...options, clock: () => Date.now() + 60_000 }); // past k1's lease
      expect((await again.outbox.list()).map((e) => [e.key, e.called])).toEqual([["k1", true], ["k2", true]]);
      // A lapsed old send may have started its call: ambiguous, as before the flag existed.
      const claim = await again.outbox.claimDue({ owner: "p", incarnation: "j", leaseMs: 1_000, limit: 10 });
      expect(claim.ambiguous.map((e) => e.key)).toEqual(["k1"]);
      expect(claim.due.map((e) => [e.key, e.called])).toEqual([["k2", false]]);
    });
  }

  test("option errors name the option", async () => {
    const file = freshFile();
    const cases: [SharedFileEventJournalOptions, string][] = [
      [{ appendLog: { compactEvery: 0 } }, "compactEvery"],
      [{ appendLog: { compactBytes: -1 } }, "compactBytes"],
      [{ appendLog: "yes" as never }, "appendLog"],
      [{ fsync: 1 as never }, "fsync"],
      [{ staleLockMs: 10 }, "staleLockMs"],
      [{ staleLockMs: 999 }, "at least 1000"],
      [{ heartbeatMs: 40_000 }, "heartbeatMs"],
      [{ clock: 5 as never }, "clock"],
    ];
    for (const [options, field] of cases) {
      const error = await SharedFileEventJournal.open(file, options).then(() => null, (e: unknown) => e as Error);
      expect(error?.message, field).toContain(field);
    }
  });
});

describe("taking over the log of a FileEventJournal whose last line was torn", () => {
  /** Log lines of three appends (`a`, `b`, `c`), in the format both file journals write. */
  async function threeLines(): Promise<string[]> {
    const m = new MemoryEventJournal();
    const lines: string[] = [];
    for (const id of ["a", "b", "c"]) {
      await m.append({ id, eventType: "job", payload: null });
      lines.push(JSON.stringify({ seq: lines.length + 1, ...m.takeChanges() }));
    }
    return lines;
  }

  test("a last line whose middle was never written (zeros, newline in place) is a torn end: the lines before it applied, warned", async () => {
    const file = freshFile();
    const lines = await threeLines();
    const text = Buffer.from(lines.join("\n") + "\n");
    const last = text.length - Buffer.byteLength(lines[2]!) - 1;
    const torn = Buffer.from(text);
    torn.fill(0, last + 10, text.length - 10);
    writeFileSync(`${file}.log`, torn);
    const warnings: unknown[][] = [];
    const warn = spyOn(console, "warn").mockImplementation((...args: unknown[]) => void warnings.push(args));
    let journal: SharedFileEventJournal;
    try {
      journal = await openJournal(file, {});
    } finally {
      warn.mockRestore();
    }
    expect((await journal.list()).map((e) => e.id)).toEqual(["a", "b"]);
    expect(warnings.map((w) => String(w[0])).filter((w) => w.includes("torn write"))).toEqual([
      `[@botmesh/durable] SharedFileEventJournal: ${file}.log ends in a torn write at byte ${last} (${text.length - last} bytes that are not a whole JSON line, with none after them); the lines before it were applied`,
    ]);
  });

  test("a line whose middle was never written, with a JSON line after it, is damage: open() fails", async () => {
    const file = freshFile();
    const lines = await threeLines();
    const text = Buffer.from(lines.join("\n") + "\n");
    const second = Buffer.byteLength(lines[0]!) + 1;
    const damaged = Buffer.from(text);
    damaged.fill(0, second + 10, second + Buffer.byteLength(lines[1]!) - 10);
    writeFileSync(`${file}.log`, damaged);
    const error = await SharedFileEventJournal.open(file, {}).then(() => null, (e: unknown) => e);
    expect(error).toBeInstanceOf(FileCorruptError);
    expect(String((error as Error).message)).toContain(`${file}.log`);
  });
});

