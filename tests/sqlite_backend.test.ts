// SQLite-specific tests: several connections (processes) on one file, the session store,
// group commit, open/close semantics, schema versions and migrations, query plans, options, bad files, damaged rows.
import { afterAll, describe, expect, test } from "bun:test";
import { Database } from "bun:sqlite";
import { mkdirSync, readdirSync, rmSync, statSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { DamagedRecordError, StaleLeaseError } from "../src/contract.ts";
import type { ClaimOptions, NewInboundRecord, NewOutboxEntry } from "../src/contract.ts";
import { SQLITE_SCHEMA_VERSION, SQLiteDurability, SQLiteStore } from "../backends/sqlite/mod.ts";
import { createdSqlitePath, openSqlite } from "../src/runtime/sqlite.ts";

const dir = join(tmpdir(), `botmesh-sqlite-tests-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const tempFile = (): string => join(dir, `${crypto.randomUUID()}.db`);
const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

function lease(owner: string, leaseMs = 60_000, incarnation = "i1"): ClaimOptions {
  return { owner, incarnation, leaseMs };
}

function inbound(id: string, extra: Partial<NewInboundRecord> = {}): NewInboundRecord {
  return { id, kind: "message", chatId: "c1", provider: "test", payload: { text: id }, receivedAt: Date.now(), ...extra };
}

function outbound(key: string, chatId = "c1", extra: Partial<NewOutboxEntry> = {}): NewOutboxEntry {
  return { key, chatId, content: { text: key }, contentHash: "h", inboundId: null, ...extra };
}

async function rejection(run: () => Promise<unknown>): Promise<Error> {
  try {
    await run();
  } catch (error) {
    return error as Error;
  }
  throw new Error("expected a rejection");
}

/** Two backends on one file, opened: like two processes of one host. */
async function pair(): Promise<[SQLiteDurability, SQLiteDurability, string]> {
  const file = tempFile();
  const a = new SQLiteDurability({ file });
  const b = new SQLiteDurability({ file });
  await a.open();
  await b.open();
  return [a, b, file];
}

describe("sqlite: several connections on one file", () => {
  test("racing inbox claimDue never hands a record to both, nor a chat to both", async () => {
    const [a, b] = await pair();
    const n = 300;
    for (let i = 0; i < n; i++) await a.inbox.admit(inbound(`m${i}`, { receivedAt: i, chatId: `c${i % 30}` }));
    const claims = await Promise.all(
      Array.from({ length: 40 }, (_, i) =>
        (i % 2 ? a : b).inbox.claimDue({ ...lease(i % 2 ? "A" : "B"), limit: 13 })),
    );
    const ids = claims.flat().map((r) => r.id);
    expect(new Set(ids).size).toBe(ids.length);
    for (const r of claims.flat()) expect(r.lease!.token).toBe(2);
    // Each chat went to one holder, which took a prefix of it.
    const holders = new Map<string, Set<string>>();
    const taken = new Map<string, number[]>();
    for (const r of claims.flat()) {
      holders.set(r.chatId, (holders.get(r.chatId) ?? new Set()).add(r.lease!.owner));
      taken.set(r.chatId, [...taken.get(r.chatId) ?? [], Number(r.id.slice(1))]);
    }
    for (const [chat, owners] of holders) expect([chat, owners.size]).toEqual([chat, 1]);
    for (const [chat, numbers] of taken) {
      const first = Number(chat.slice(1));
      expect(numbers.sort((x, y) => x - y)).toEqual(numbers.map((_, k) => first + 30 * k));
    }
    // Settled, the rest is anyone's: every record is taken exactly once in the end.
    for (const r of claims.flat()) await a.inbox.complete(r.id, r.lease!.token);
    const rest: string[] = [];
    for (let more = await b.inbox.claimDue({ ...lease("B"), limit: 50 }); more.length > 0; more = await b.inbox.claimDue({ ...lease("B"), limit: 50 })) {
      for (const r of more) {
        rest.push(r.id);
        await b.inbox.complete(r.id, r.lease!.token);
      }
    }
    expect(new Set([...ids, ...rest]).size).toBe(n);
    expect(ids.length + rest.length).toBe(n);
    await a.close();
    await b.close();
  });

  test("racing leased admits of one chat on two connections: the write lock serialises them, one holder leases", async () => {
    const [a, b] = await pair();
    // Received at the same time: arrival order is admission order.
    const admitted = await Promise.all(
      Array.from({ length: 24 }, (_, i) =>
        (i % 2 ? a : b).inbox.admit(inbound(`m${i}`, { chatId: `c${Math.floor(i / 2) % 4}`, receivedAt: 1_000 }), lease(i % 2 ? "A" : "B"))),
    );
    for (let chat = 0; chat < 4; chat++) {
      const records = admitted.filter((r) => r!.chatId === `c${chat}`);
      const holders = new Set(records.filter((r) => r!.state === "processing").map((r) => r!.lease!.owner));
      expect([`c${chat}`, holders.size], "each chat's leased records are of one holder").toEqual([`c${chat}`, 1]);
      for (const r of records) expect((await a.inbox.get(r!.id))?.state).toBe(r!.state);
    }
    await a.close();
    await b.close();
  });

  test("racing outbox claimDue never hands an entry to both, and keeps chat order", async () => {
    const [a, b] = await pair();
    for (let i = 0; i < 200; i++) await a.outbox.reserve(outbound(`k${i}`, `chat${i % 20}`));
    const claimed: string[] = [];
    for (let round = 0; round < 30; round++) {
      const [x, y] = await Promise.all([
        a.outbox.claimDue({ ...lease("A"), limit: 7 }),
        b.outbox.claimDue({ ...lease("B"), limit: 7 }),
      ]);
      for (const e of [...x.due, ...y.due]) {
        claimed.push(e.key);
        // Only the first unsettled entry of a chat is ever leased: settle it so the next one is due.
        await (x.due.includes(e) ? a : b).outbox.markSent(e.key, e.lease!.token, `msg-${e.key}`);
      }
    }
    expect(new Set(claimed).size).toBe(claimed.length);
    expect(claimed.length).toBe(200);
    const byChat = new Map<string, number[]>();
    for (const key of claimed) {
      const i = Number(key.slice(1));
      byChat.set(`chat${i % 20}`, [...(byChat.get(`chat${i % 20}`) ?? []), i]);
    }
    for (const order of byChat.values()) expect(order).toEqual([...order].sort((x, y) => x - y));
    await a.close();
    await b.close();
  });

  test("a stale fencing token is rejected across connections", async () => {
    const [a, b] = await pair();
    await a.inbox.admit(inbound("m1"), lease("A", 30));
    await a.outbox.reserve(outbound("k1"), lease("A", 30));
    expect(await a.outbox.markCalling("k1", 1, 30), "its call announced: a lost lease is ambiguous").toBe(true);
    await a.outbox.reserve(outbound("k2", "c2"), lease("A", 30)); // never announced
    await sleep(80);
    const taken = await b.inbox.claim("m1", lease("B"));
    expect(taken?.lease?.token).toBe(2);
    expect(await a.inbox.heartbeat("m1", 1, 60_000)).toBe(false);
    expect(await rejection(() => a.inbox.complete("m1", 1))).toBeInstanceOf(StaleLeaseError);
    expect(await rejection(() => a.inbox.fail("m1", 1, { error: "x", dead: true }))).toBeInstanceOf(StaleLeaseError);
    await b.inbox.complete("m1", 2);
    expect((await a.inbox.get("m1"))?.state).toBe("done");

    const { due, ambiguous } = await b.outbox.claimDue({ ...lease("B"), limit: 10, resendAmbiguous: true });
    expect(ambiguous.map((e) => e.key)).toEqual(["k1"]);
    expect(due.map((e) => e.key)).toEqual(["k1", "k2"]);
    expect(due.map((e) => [e.lease?.token, e.attempts, e.called])).toEqual([[2, 2, true], [2, 1, false]]);
    expect(await rejection(() => a.outbox.markSent("k1", 1, "late"))).toBeInstanceOf(StaleLeaseError);
    expect(await a.outbox.heartbeat("k1", 1, 60_000)).toBe(false);
    expect(await a.outbox.markCalling("k1", 1, 60_000)).toBe(false);
    expect(await a.outbox.markCalling("k2", 1, 60_000)).toBe(false);
    expect((await a.outbox.get("k2"))?.called).toBe(false);
    expect(await b.outbox.markCalling("k1", 2, 60_000)).toBe(true);
    expect((await a.outbox.get("k1"))?.called, "seen by the other connection").toBe(true);
    await b.outbox.markSent("k1", 2, "m-b");
    expect((await a.outbox.get("k1"))?.messageId).toBe("m-b");
    await a.close();
    await b.close();
  });

  test("a connection holding the write lock makes the other wait busyTimeoutMs, then fail", async () => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file, busyTimeoutMs: 50 });
    await backend.open();
    const raw = await openSqlite(file);
    raw.exec("BEGIN IMMEDIATE");
    const started = Date.now();
    const error = await rejection(() => backend.inbox.admit(inbound("m1")));
    expect(Date.now() - started).toBeGreaterThanOrEqual(40);
    expect(error.message).toMatch(/locked|busy/i);
    raw.exec("ROLLBACK");
    expect(await backend.inbox.admit(inbound("m1"))).not.toBeNull();
    raw.close();
    await backend.close();
  });

  test("processes sharing one file: each record is claimed by exactly one", async () => {
    const file = tempFile();
    const seed = new SQLiteDurability({ file });
    await seed.open();
    const n = 400;
    for (let i = 0; i < n; i++) await seed.inbox.admit(inbound(`m${i}`, { receivedAt: i, chatId: `c${i % 7}` }));
    for (let i = 0; i < n; i++) await seed.outbox.reserve(outbound(`k${i}`, `c${i % 40}`));
    await seed.close();
    const script = join(dir, `worker-${crypto.randomUUID()}.ts`);
    writeFileSync(
      script,
      `import { SQLiteDurability } from ${JSON.stringify(join(import.meta.dir, "..", "backends", "sqlite", "durability.ts"))};
import { existsSync, writeFileSync } from "node:fs";
const [file, owner, all] = process.argv.slice(2);
const owners = all.split(",");
// A barrier on marker files: every worker reaches a point before any goes past it.
const barrier = async (stage) => {
  writeFileSync(\`\${file}.\${stage}.\${owner}\`, "");
  const until = Date.now() + 20_000;
  while (!owners.every((o) => existsSync(\`\${file}.\${stage}.\${o}\`))) {
    if (Date.now() > until) throw new Error(\`barrier \${stage}: not every worker arrived\`);
    await new Promise((r) => setTimeout(r, 5));
  }
};
const b = new SQLiteDurability({ file });
await b.open();
await barrier("opened");
const claim = { owner, incarnation: owner, leaseMs: 60_000, limit: 5 };
const inbox = [], outbox = [];
let idle = 0;
let first = true;
while (idle < 20) {
  const got = await b.inbox.claimDue(claim);
  const out = await b.outbox.claimDue(claim);
  // Each worker holds its first claims until every worker has claimed once, so all of them race.
  if (first) await barrier("claimed");
  first = false;
  for (const r of got) { inbox.push(r.id); await b.inbox.complete(r.id, r.lease.token); }
  for (const e of out.due) { outbox.push(e.key); await b.outbox.markSent(e.key, e.lease.token, owner); }
  idle = got.length + out.due.length === 0 ? idle + 1 : 0;
  await new Promise((r) => setTimeout(r, 1));
}
await b.close();
console.log(JSON.stringify({ inbox, outbox }));
`,
    );
    const owners = ["P1", "P2", "P3"];
    const procs = owners.map((owner) =>
      Bun.spawn([process.execPath, script, file, owner, owners.join(",")], { stdout: "pipe", stderr: "pipe" })
    );
    const results = await Promise.all(procs.map(async (p) => {
      const [out, err, code] = await Promise.all([new Response(p.stdout).text(), new Response(p.stderr).text(), p.exited]);
      expect(err.replace(/\n$/, ""), "worker stderr").toBe("");
      expect(code).toBe(0);
      return JSON.parse(out) as { inbox: string[]; outbox: string[] };
    }));
    const inboxIds = results.flatMap((r) => r.inbox);
    const outboxKeys = results.flatMap((r) => r.outbox);
    expect(new Set(inboxIds).size).toBe(inboxIds.length);
    expect(inboxIds.length).toBe(n);
    expect(new Set(outboxKeys).size).toBe(outboxKeys.length);
    expect(outboxKeys.length).toBe(n);
    // The barrier makes every worker claim before any finishes its first claims: all three took part.
    for (const r of results) expect(r.inbox.length + r.outbox.length).toBeGreaterThan(0);
    const check = new SQLiteDurability({ file });
    await check.open();
    expect((await check.inbox.list({ state: "done", limit: 1000 })).length).toBe(n);
    expect((await check.outbox.list({ state: "sent", limit: 1000 })).length).toBe(n);
    await check.close();
  }, 30_000);
});

describe("sqlite: group commit", () => {
  test("concurrent operations share one transaction, and each resolves only once it is committed", async () => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file });
    await backend.open();
    const before = backend.stats;
    const raw = new Database(file);
    const visible = (id: string) => raw.prepare("SELECT 1 AS x FROM botmesh_inbox WHERE id = ?").get(id) !== null;
    const n = 100;
    const seenCommitted: boolean[] = [];
    await Promise.all(
      Array.from({ length: n }, (_, i) =>
        backend.inbox.admit(inbound(`m${i}`)).then((r) => {
          expect(r?.id).toBe(`m${i}`);
          seenCommitted.push(visible(`m${i}`)); // another connection sees it: committed
        })),
    );
    expect(seenCommitted).toEqual(new Array(n).fill(true));
    const after = backend.stats;
    // One batch, unless a slow machine hits the batch's time cap (about 5 ms).
    expect(after.commits - before.commits).toBeLessThanOrEqual(n / 10);
    expect(after.operations - before.operations).toBe(n);
    expect(after.largestBatch).toBeGreaterThanOrEqual(n / 10);
    expect(after.failedBatches).toBe(0);
    // Sequential operations still commit one by one.
    await backend.inbox.admit(inbound("s1"));
    await backend.inbox.admit(inbound("s2"));
    expect(backend.stats.commits).toBe(after.commits + 2);
    raw.close();
    await backend.close();
  });

  test("a batch carries at most 256 operations", async () => {
    const backend = new SQLiteDurability({ file: tempFile(), synchronous: "normal" });
    await backend.open();
    const before = backend.stats;
    await Promise.all(Array.from({ length: 600 }, (_, i) => backend.inbox.admit(inbound(`m${i}`))));
    const after = backend.stats;
    expect(after.largestBatch).toBeLessThanOrEqual(256);
    expect(after.commits - before.commits).toBeGreaterThanOrEqual(3);
    expect(after.commits - before.commits).toBeLessThan(60);
    expect((await backend.inbox.list({ limit: 1000 })).length).toBe(600);
    await backend.close();
  });

  test("a stale token rejects alone; the others of its batch commit", async () => {
    const backend = new SQLiteDurability({ file: tempFile() });
    await backend.open();
    await backend.inbox.admit(inbound("held"), lease("A"));
    await backend.outbox.reserve(outbound("k1"), lease("A"));
    const before = backend.stats.commits;
    const results = await Promise.allSettled([
      backend.inbox.admit(inbound("a1")),
      backend.inbox.complete("held", 7), // stale: the token is 1
      backend.outbox.markSent("k1", 1, "msg-1"),
      backend.outbox.markSent("k1", 1, "again"), // stale by now: k1 is sent
      backend.inbox.admit(inbound("a2")),
    ]);
    expect(results.map((r) => r.status)).toEqual(["fulfilled", "rejected", "fulfilled", "rejected", "fulfilled"]);
    expect((results[1] as PromiseRejectedResult).reason).toBeInstanceOf(StaleLeaseError);
    expect((results[3] as PromiseRejectedResult).reason).toBeInstanceOf(StaleLeaseError);
    // One batch, or two if a pause on a loaded machine hit the batch's 5 ms cap.
    expect(backend.stats.commits - before).toBeLessThanOrEqual(2);
    expect((await backend.inbox.get("a1"))?.state).toBe("pending");
    expect((await backend.inbox.get("a2"))?.state).toBe("pending");
    expect((await backend.inbox.get("held"))?.state).toBe("processing");
    expect((await backend.outbox.get("k1"))?.messageId).toBe("msg-1");
    await backend.close();
  });

  test("an operation failing half way is rolled back to its savepoint; the others of its batch commit", async () => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file });
    await backend.open();
    await backend.outbox.reserve(outbound("k1", "c1"), lease("A"));
    await backend.outbox.reserve(outbound("k2", "c1")); // queued behind k1
    await backend.outbox.reserve(outbound("j1", "c2"), lease("A"));
    // markSent("k1") updates k1, then makes k2 the due head of c1: that second write fails.
    const raw = new Database(file);
    raw.exec(`CREATE TRIGGER fail_head BEFORE UPDATE OF due_at ON botmesh_outbox WHEN NEW.key = 'k2'
      BEGIN SELECT RAISE(ABORT, 'head update refused'); END`);
    const before = backend.stats.commits;
    const results = await Promise.allSettled([
      backend.inbox.admit(inbound("a1")),
      backend.outbox.markSent("k1", 1, "msg-k1"),
      backend.outbox.markSent("j1", 1, "msg-j1"),
    ]);
    expect(results.map((r) => r.status)).toEqual(["fulfilled", "rejected", "fulfilled"]);
    expect(String((results[1] as PromiseRejectedResult).reason.message)).toContain("head update refused");
    // One batch, or two if a pause on a loaded machine hit the batch's 5 ms cap.
    expect(backend.stats.commits - before).toBeLessThanOrEqual(2);
    // k1's own first write (state sent) was undone with the rest of the operation.
    expect((await backend.outbox.get("k1"))?.state).toBe("sending");
    expect((await backend.outbox.get("k1"))?.messageId).toBeNull();
    expect((await backend.outbox.get("j1"))?.state).toBe("sent");
    expect((await backend.inbox.get("a1"))?.state).toBe("pending");
    raw.exec("DROP TRIGGER fail_head");
    await backend.outbox.markSent("k1", 1, "msg-k1");
    expect((await backend.outbox.claimDue({ ...lease("A"), limit: 10 })).due.map((e) => e.key)).toEqual(["k2"]);
    raw.close();
    await backend.close();
  });

  test("a one-statement operation that fails (no savepoint) fails alone; the others of its batch commit", async () => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file });
    await backend.open();
    const held = await backend.inbox.admit(inbound("held"), lease("A"));
    const raw = new Database(file);
    raw.exec(`CREATE TRIGGER refuse BEFORE INSERT ON botmesh_inbox WHEN NEW.id = 'refused'
      BEGIN SELECT RAISE(ABORT, 'insert refused'); END`);
    const before = backend.stats.commits;
    const results = await Promise.allSettled([
      backend.inbox.admit(inbound("first")),
      backend.inbox.admit(inbound("refused")),
      backend.inbox.complete("held", held!.lease!.token),
      backend.outbox.reserve(outbound("k1", "c1"), lease("A")),
    ]);
    expect(results.map((r) => r.status)).toEqual(["fulfilled", "rejected", "fulfilled", "fulfilled"]);
    expect(String((results[1] as PromiseRejectedResult).reason.message)).toContain("insert refused");
    expect(backend.stats.commits - before).toBeLessThanOrEqual(2);
    expect(backend.stats.failedBatches).toBe(0);
    expect((await backend.inbox.get("first"))?.state).toBe("pending");
    expect(await backend.inbox.get("refused")).toBeNull();
    expect((await backend.inbox.get("held"))?.state).toBe("done");
    expect((await backend.outbox.get("k1"))?.state).toBe("sending");
    raw.exec("DROP TRIGGER refuse");
    raw.close();
    await backend.close();
  });

  test("an operation that rolls the whole transaction back fails its batch alone; later operations run in the next", async () => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file });
    await backend.open();
    const raw = new Database(file);
    raw.exec(`CREATE TRIGGER lose_tx BEFORE INSERT ON botmesh_inbox WHEN NEW.id = 'poison'
      BEGIN SELECT RAISE(ROLLBACK, 'transaction lost'); END`);
    // Statements prepared first: a batch is also cut after 5 ms, and a first prepare on a loaded
    // machine could take that long and commit "before" alone.
    await backend.inbox.admit(inbound("warm-up"));
    const results = await Promise.allSettled([
      backend.inbox.admit(inbound("before")),
      backend.inbox.admit(inbound("poison")),
      backend.inbox.admit(inbound("after")),
    ]);
    expect(results.map((r) => r.status)).toEqual(["rejected", "rejected", "fulfilled"]);
    const lost = (results[0] as PromiseRejectedResult).reason as Error;
    expect(lost.message).toContain(JSON.stringify(file));
    expect(lost.message).toContain("transaction lost");
    expect(lost.message).toContain("none of its 2 operations took effect");
    // The operation that lost it gets an error naming the file too, with the driver's error as cause.
    const loser = (results[1] as PromiseRejectedResult).reason as Error;
    expect(loser.message).toContain(JSON.stringify(file));
    expect(loser.message).toContain("transaction lost");
    expect(loser.message).toContain("this operation lost the transaction");
    expect(String((loser.cause as Error)?.message)).toContain("transaction lost");
    expect(await backend.inbox.get("before")).toBeNull();
    expect(await backend.inbox.get("poison")).toBeNull();
    expect((await backend.inbox.get("after"))?.state).toBe("pending");
    expect(backend.stats.failedBatches).toBe(1);
    raw.exec("DROP TRIGGER lose_tx");
    expect(await backend.inbox.admit(inbound("before"))).not.toBeNull();
    raw.close();
    await backend.close();
  });

  test("a batch that cannot begin (write lock held past busyTimeoutMs) rejects whole; nothing of it applied", async () => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file, busyTimeoutMs: 50 });
    await backend.open();
    await backend.inbox.admit(inbound("held"), lease("A"));
    const raw = await openSqlite(file);
    raw.exec("BEGIN IMMEDIATE");
    const results = await Promise.allSettled([
      backend.inbox.admit(inbound("m1")),
      backend.inbox.complete("held", 1),
      backend.outbox.reserve(outbound("k1")),
    ]);
    expect(results.map((r) => r.status)).toEqual(["rejected", "rejected", "rejected"]);
    for (const r of results) {
      const message = String((r as PromiseRejectedResult).reason.message);
      expect(message).toContain(JSON.stringify(file));
      expect(message).toMatch(/locked|busy/i);
    }
    expect(backend.stats.failedBatches).toBe(1);
    raw.exec("ROLLBACK");
    expect(await backend.inbox.get("m1")).toBeNull();
    expect((await backend.inbox.get("held"))?.state).toBe("processing");
    expect(await backend.outbox.get("k1")).toBeNull();
    // Once the lock is free, the same operations work.
    const [m1] = await Promise.all([
      backend.inbox.admit(inbound("m1")),
      backend.inbox.complete("held", 1),
      backend.outbox.reserve(outbound("k1")),
    ]);
    expect(m1?.state).toBe("pending");
    expect((await backend.inbox.get("held"))?.state).toBe("done");
    expect((await backend.outbox.get("k1"))?.state).toBe("queued");
    raw.close();
    await backend.close();
  });

  test("a failed COMMIT rejects the whole batch with the file named, applies nothing, and the next batch works", async () => {
    // Make this connection's COMMIT statement fail on demand (bun:sqlite is the driver here).
    let failCommit = false;
    const original = Database.prototype.prepare;
    Database.prototype.prepare = function (this: Database, sql: string, ...rest: unknown[]) {
      const statement = (original as (...args: unknown[]) => ReturnType<typeof original>).call(this, sql, ...rest);
      if (sql !== "COMMIT") return statement;
      return {
        run: (...params: unknown[]) => {
          if (failCommit) throw new Error("disk I/O error (simulated)");
          return (statement.run as (...args: unknown[]) => unknown)(...params);
        },
        get: (...params: unknown[]) => (statement.get as (...args: unknown[]) => unknown)(...params),
        all: (...params: unknown[]) => (statement.all as (...args: unknown[]) => unknown)(...params),
      } as unknown as typeof statement;
    } as typeof original;
    const file = tempFile();
    const store = new SQLiteStore({ file });
    const backend = store.durability();
    try {
      await backend.open();
      await backend.inbox.admit(inbound("held"), lease("A")); // prepares COMMIT through the patch
    } finally {
      Database.prototype.prepare = original;
    }
    failCommit = true;
    const results = await Promise.allSettled([
      backend.inbox.admit(inbound("m1")),
      backend.inbox.complete("held", 1),
      store.set("k", 1),
      backend.outbox.reserve(outbound("k1")),
    ]);
    failCommit = false;
    expect(results.map((r) => r.status)).toEqual(["rejected", "rejected", "rejected", "rejected"]);
    for (const r of results) {
      const message = String((r as PromiseRejectedResult).reason.message);
      expect(message).toContain(JSON.stringify(file));
      expect(message).toContain("simulated");
      expect(message).toContain("none of its 4 operations took effect");
    }
    expect(await backend.inbox.get("m1")).toBeNull();
    expect((await backend.inbox.get("held"))?.state).toBe("processing");
    expect(await store.get("k")).toBeUndefined();
    expect(await backend.outbox.get("k1")).toBeNull();
    const raw = new Database(file);
    expect((raw.prepare("SELECT count(*) AS n FROM botmesh_inbox").get() as { n: number }).n).toBe(1);
    raw.close();
    await Promise.all([backend.inbox.admit(inbound("m1")), backend.inbox.complete("held", 1), store.set("k", 1)]);
    expect((await backend.inbox.get("held"))?.state).toBe("done");
    expect(await store.get("k")).toBe(1);
    await backend.close();
    await store.close();
  });

  test("session writes join the journals' batch; operations queued before the last close still commit", async () => {
    const file = tempFile();
    const store = new SQLiteStore({ file });
    const backend = store.durability();
    await backend.open();
    await store.set("warm", 0);
    const before = store.stats;
    await Promise.all([store.set("a", 1), backend.inbox.admit(inbound("m1")), store.delete("warm")]);
    expect(store.stats.commits - before.commits).toBeLessThanOrEqual(2); // 2 only if the 5 ms batch cap was hit
    expect(backend.stats).toEqual(store.stats);
    const pending = [backend.inbox.admit(inbound("m2")), store.set("b", 2)];
    await store.close();
    const closing = backend.close();
    await Promise.all([...pending, closing]);
    expect(store.driver).toBeNull();
    const raw = new Database(file);
    expect(raw.prepare("SELECT id FROM botmesh_inbox WHERE id = 'm2'").get()).toEqual({ id: "m2" });
    expect(raw.prepare("SELECT value FROM botmesh_session WHERE key = 'b'").get()).toEqual({ value: "2" });
    raw.close();
  });
});

describe("sqlite: open and close", () => {
  test("operations on a backend that is not open reject with a clear error", async () => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file });
    const error = await rejection(() => backend.inbox.get("x"));
    expect(error.message).toContain(`SQLite durability on ${JSON.stringify(file)} is not open`);
    expect(error.message).toContain("open()");
    expect(backend.isOpen).toBe(false);
    expect(backend.driver).toBeNull();
  });

  test("open and close are reference-counted per instance", async () => {
    const backend = new SQLiteDurability({ file: tempFile() });
    await Promise.all([backend.open(), backend.open()]);
    expect(backend.driver).toBe("bun:sqlite");
    await backend.close();
    expect(await backend.inbox.admit(inbound("m1"))).not.toBeNull(); // still open once
    await backend.close();
    await rejection(() => backend.inbox.get("m1"));
    await backend.close(); // an extra close does nothing
    await backend.open();
    expect((await backend.inbox.get("m1"))?.state).toBe("pending");
    await backend.close();
  });

  test("close() called while open() is pending undoes that open; open/close take effect in call order", async () => {
    const backend = new SQLiteDurability({ file: tempFile() });
    const opening = backend.open();
    await backend.close(); // open() is still loading the driver / migrating
    await opening;
    expect(backend.isOpen).toBe(false);
    expect(backend.driver).toBeNull(); // the connection was closed, not leaked
    await rejection(() => backend.inbox.get("m1"));

    // open, close, open, all pending at once: open once at the end.
    await Promise.all([backend.open(), backend.close(), backend.open()]);
    expect(backend.isOpen).toBe(true);
    expect(await backend.inbox.admit(inbound("m1"))).not.toBeNull();
    await backend.close();
    expect(backend.driver).toBeNull();

    // A failed open counts for nothing: the close after it does not undo a later open.
    const bad = join(dir, `not-a-dir-${crypto.randomUUID()}`);
    writeFileSync(bad, "a file where a directory should be");
    const broken = new SQLiteDurability({ file: join(bad, "bot.db") });
    const results = await Promise.allSettled([broken.open(), broken.close()]);
    expect(results.map((r) => r.status)).toEqual(["rejected", "fulfilled"]);
    expect(broken.isOpen).toBe(false);
  });

  test("the store opens on first use and shares its connection with its backend", async () => {
    const file = tempFile();
    const store = new SQLiteStore({ file });
    expect(store.driver).toBeNull();
    await store.set("k", { a: 1 });
    expect(store.driver).toBe("bun:sqlite");
    const backend = store.durability();
    expect(store.durability()).toBe(backend);
    expect(backend.name).toBe("sqlite");
    expect(backend.scope).toBe("host");
    await rejection(() => backend.inbox.get("m1")); // the backend itself was not opened
    await backend.open();
    await backend.inbox.admit(inbound("m1"));
    await store.close(); // the backend still holds the connection
    expect((await backend.inbox.get("m1"))?.id).toBe("m1");
    await backend.close();
    expect(store.driver).toBeNull(); // nobody holds it: closed
    expect(await store.get("k")).toEqual({ a: 1 }); // opens again on use
    await store.close();
  });

  test("store.open() reports a bad file at once; a failed open can be retried", async () => {
    const file = join(dir, `not-a-dir-${crypto.randomUUID()}`);
    writeFileSync(file, "a file where a directory should be");
    const store = new SQLiteStore({ file: join(file, "bot.db") });
    const error = await rejection(() => store.open());
    expect(error.message).toContain(`Cannot open SQLite file ${JSON.stringify(join(file, "bot.db"))}`);
    await rejection(() => store.get("k"));
    await store.close();
  });
});

describe("sqlite: session store", () => {
  test("get, set, delete; values round-trip exactly and are copies", async () => {
    const store = new SQLiteStore({ file: tempFile() });
    const value = { text: "héllo ✓ 你好 🎉👨‍👩‍👧‍👦 e\u0301", lone: "\ud800", n: [0, -1.5, 1e21], nested: { x: null } };
    await store.set("chat:ключ ✓", value);
    const got = await store.get("chat:ключ ✓");
    expect(got).toEqual(value);
    expect(got).not.toBe(await store.get("chat:ключ ✓"));
    await store.set("chat:ключ ✓", "replaced");
    expect(await store.get("chat:ключ ✓")).toBe("replaced");
    await store.delete("chat:ключ ✓");
    expect(await store.get("chat:ключ ✓")).toBeUndefined();
    expect(await store.get("missing")).toBeUndefined();
    await store.delete("missing");
    await store.set("falsy", 0);
    expect(await store.get("falsy")).toBe(0);
    await store.set("null", null);
    expect(await store.get("null")).toBeNull();
    await store.close();
  });

  test("an expired value is never returned and is purged lazily or by purgeExpired", async () => {
    const file = tempFile();
    // Time moves only when the test says so: a loaded machine cannot let a ttl lapse early.
    let now = Date.now();
    const store = new SQLiteStore({ file, clock: () => now });
    await store.set("short", 1, { ttlMs: 40 });
    await store.set("long", 2, { ttlMs: 60_000 });
    await store.set("forever", 3);
    for (let i = 0; i < 3; i++) await store.set(`gone${i}`, i, { ttlMs: 20 });
    now += 39;
    expect(await store.get("short")).toBe(1);
    now += 41;
    expect(await store.get("short")).toBeUndefined();
    expect(await store.get("long")).toBe(2);
    expect(await store.get("forever")).toBe(3);
    const raw = new Database(file);
    const count = () => (raw.prepare("SELECT count(*) AS n FROM botmesh_session").get() as { n: number }).n;
    expect(count()).toBe(5); // "short" was deleted when read
    expect(await store.purgeExpired()).toBe(3);
    expect(count()).toBe(2);
    // A write re-setting a key without a ttl drops its expiry.
    await store.set("long", 4);
    expect((raw.prepare("SELECT expires_at FROM botmesh_session WHERE key = 'long'").get() as { expires_at: null })
      .expires_at).toBeNull();
    raw.close();
    await store.close();
  });

  test("a bad ttl or a value that is not JSON is rejected", async () => {
    const store = new SQLiteStore({ file: tempFile() });
    for (const ttlMs of [0, -5, Number.NaN, "10" as unknown as number]) {
      const error = await rejection(() => store.set("k", 1, { ttlMs }));
      expect(error).toBeInstanceOf(RangeError);
      expect(error.message).toContain('"ttlMs"');
    }
    const error = await rejection(() => store.set("k", undefined as unknown as null));
    expect(error).toBeInstanceOf(TypeError);
    await store.close();
  });

  test("two stores on one file see each other's values", async () => {
    const file = tempFile();
    const a = new SQLiteStore({ file });
    const b = new SQLiteStore({ file });
    await a.set("k", { from: "a" });
    expect(await b.get("k")).toEqual({ from: "a" });
    await b.delete("k");
    expect(await a.get("k")).toBeUndefined();
    await a.close();
    await b.close();
  });
});

/** Schema version 1, exactly as its migration created it. */
const V1_SCHEMA = `
  CREATE TABLE botmesh_meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
  INSERT INTO botmesh_meta VALUES ('schema_version', '1');
  CREATE TABLE botmesh_inbox (
    ord INTEGER PRIMARY KEY, id TEXT NOT NULL UNIQUE, kind TEXT NOT NULL, chat_id TEXT NOT NULL,
    provider TEXT NOT NULL, payload TEXT NOT NULL, received_at INTEGER NOT NULL, state TEXT NOT NULL,
    attempts INTEGER NOT NULL, next_attempt_at INTEGER, lease_owner TEXT, lease_incarnation TEXT,
    lease_token INTEGER, lease_expires_at INTEGER, fence INTEGER NOT NULL, error TEXT, updated_at INTEGER NOT NULL);
  CREATE TABLE botmesh_outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, key TEXT NOT NULL UNIQUE, chat_id TEXT NOT NULL, content TEXT NOT NULL,
    content_hash TEXT NOT NULL, inbound_id TEXT, state TEXT NOT NULL, attempts INTEGER NOT NULL,
    next_attempt_at INTEGER, lease_owner TEXT, lease_incarnation TEXT, lease_token INTEGER,
    lease_expires_at INTEGER, fence INTEGER NOT NULL, message_id TEXT, error TEXT,
    created_at INTEGER NOT NULL, updated_at INTEGER NOT NULL);
  CREATE TABLE botmesh_session (key TEXT PRIMARY KEY, value TEXT NOT NULL, expires_at INTEGER);
`;

/** What schema version 2 added to version 1 (as shipped; frozen here to build a version-2 file). */
const V2_UPGRADE = `
  ALTER TABLE botmesh_inbox ADD COLUMN due_at INTEGER;
  ALTER TABLE botmesh_outbox ADD COLUMN due_at INTEGER;
  CREATE INDEX botmesh_inbox_due ON botmesh_inbox (due_at) WHERE due_at IS NOT NULL;
  CREATE INDEX botmesh_inbox_owner ON botmesh_inbox (lease_owner) WHERE lease_owner IS NOT NULL;
  CREATE INDEX botmesh_inbox_state ON botmesh_inbox (state, received_at, ord);
  CREATE INDEX botmesh_inbox_done ON botmesh_inbox (updated_at) WHERE state = 'done';
  CREATE INDEX botmesh_outbox_due ON botmesh_outbox (due_at) WHERE due_at IS NOT NULL;
  CREATE INDEX botmesh_outbox_owner ON botmesh_outbox (lease_owner) WHERE lease_owner IS NOT NULL;
  CREATE INDEX botmesh_outbox_chat ON botmesh_outbox (chat_id, seq) WHERE state IN ('queued', 'sending', 'failed');
  CREATE INDEX botmesh_outbox_state ON botmesh_outbox (state, seq);
  CREATE INDEX botmesh_outbox_sent ON botmesh_outbox (updated_at) WHERE state = 'sent';
  CREATE INDEX botmesh_session_expiry ON botmesh_session (expires_at) WHERE expires_at IS NOT NULL;
  UPDATE botmesh_meta SET value = '2' WHERE key = 'schema_version';
`;

/** What schema version 3 added to version 2 (as shipped; frozen here to build a version-3 file). */
const V3_UPGRADE = `
  CREATE INDEX botmesh_inbox_received ON botmesh_inbox (received_at, ord);
  CREATE INDEX botmesh_inbox_chat ON botmesh_inbox (chat_id, received_at, ord);
  CREATE INDEX botmesh_outbox_chat_all ON botmesh_outbox (chat_id, seq);
  DROP INDEX botmesh_inbox_due;
  CREATE INDEX botmesh_inbox_due ON botmesh_inbox (due_at, received_at, ord) WHERE due_at IS NOT NULL;
  UPDATE botmesh_meta SET value = '3' WHERE key = 'schema_version';
`;

/** What schema versions 4 and 5 added (as shipped; frozen here to build a version-5 file). */
const V4_V5_UPGRADE = `
  ALTER TABLE botmesh_outbox ADD COLUMN uncalled_fence INTEGER;
  CREATE INDEX botmesh_inbox_chat_leased ON botmesh_inbox (chat_id, received_at, ord) WHERE state = 'processing';
  UPDATE botmesh_meta SET value = '5' WHERE key = 'schema_version';
`;

describe("sqlite: schema versions", () => {
  test("a new file gets the current schema version", async () => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file });
    await backend.open();
    await backend.close();
    const raw = new Database(file);
    expect(raw.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get()).toEqual({
      value: String(SQLITE_SCHEMA_VERSION),
    });
    expect((raw.prepare("PRAGMA journal_mode").get() as { journal_mode: string }).journal_mode).toBe("wal");
    raw.close();
  });

  test("a file at version 1 is upgraded in place and keeps its data", async () => {
    const file = tempFile();
    const raw = new Database(file);
    raw.exec(V1_SCHEMA);
    const now = Date.now();
    const payload = JSON.stringify({ text: "héllo ✓ 🎉" });
    const insertIn = raw.prepare(
      `INSERT INTO botmesh_inbox (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at)
       VALUES (?, 'message', 'c1', 'test', ?, ?, ?, 0, 0, ?)`,
    );
    insertIn.run("old-pending", payload, 1, "pending", now);
    insertIn.run("old-done", payload, 2, "done", now);
    const insertOut = raw.prepare(
      `INSERT INTO botmesh_outbox (key, chat_id, content, content_hash, state, attempts, next_attempt_at, fence,
        message_id, created_at, updated_at) VALUES (?, ?, '{"text":"x"}', 'h', ?, 0, ?, 0, ?, ?, ?)`,
    );
    insertOut.run("c1-first", "c1", "queued", now - 10, null, now, now);
    insertOut.run("c1-second", "c1", "queued", now - 10, null, now, now);
    insertOut.run("c2-failed", "c2", "failed", now - 10, null, now, now);
    insertOut.run("c3-sent", "c3", "sent", null, "msg-1", now, now);
    raw.prepare("INSERT INTO botmesh_session VALUES ('chat:1', '{\"step\":2}', NULL)").run();
    raw.close();

    const store = new SQLiteStore({ file });
    expect(await store.get("chat:1")).toEqual({ step: 2 });
    const backend = store.durability();
    await backend.open();
    expect((await backend.inbox.get("old-done"))?.state).toBe("done");
    const claimed = await backend.inbox.claimDue({ ...lease("A"), limit: 10 });
    expect(claimed.map((r) => r.id)).toEqual(["old-pending"]);
    expect(claimed[0].payload).toEqual({ text: "héllo ✓ 🎉" });
    const { due } = await backend.outbox.claimDue({ ...lease("A"), limit: 10 });
    expect(due.map((e) => e.key)).toEqual(["c1-first", "c2-failed"]);
    expect((await backend.outbox.get("c3-sent"))?.messageId).toBe("msg-1");
    await backend.outbox.markSent("c1-first", due[0]!.fence, "m");
    expect((await backend.outbox.claimDue({ ...lease("A"), limit: 10 })).due.map((e) => e.key)).toEqual(["c1-second"]);
    // New records get seqs after the old ones.
    const fresh = await backend.outbox.reserve(outbound("new", "c9"));
    expect(fresh.entry.seq).toBe(5);
    await backend.close();
    await store.close();

    const check = new Database(file);
    expect(check.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get()).toEqual({
      value: String(SQLITE_SCHEMA_VERSION),
    });
    check.close();
  });

  test("a file at version 2 is upgraded (list and due-order indexes) and keeps its data", async () => {
    const file = tempFile();
    const raw = new Database(file);
    raw.exec(V1_SCHEMA);
    raw.exec(V2_UPGRADE);
    const now = Date.now();
    const insertIn = raw.prepare(
      `INSERT INTO botmesh_inbox (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at, due_at)
       VALUES (?, 'message', ?, 'test', '{}', ?, ?, 0, 0, ?, ?)`,
    );
    insertIn.run("p2", "c1", 2, "pending", now, 0);
    insertIn.run("d1", "c2", 1, "done", now, null);
    insertIn.run("p3", "c2", 3, "pending", now, 0);
    raw.prepare(
      `INSERT INTO botmesh_outbox (key, chat_id, content, content_hash, state, attempts, next_attempt_at, fence,
        created_at, updated_at, due_at) VALUES ('k1', 'c1', '{}', 'h', 'queued', 0, 0, 0, ?, ?, 0)`,
    ).run(now, now);
    raw.close();

    const backend = new SQLiteDurability({ file });
    await backend.open();
    expect((await backend.inbox.list()).map((r) => r.id)).toEqual(["d1", "p2", "p3"]);
    expect((await backend.inbox.list({ chatId: "c2" })).map((r) => r.id)).toEqual(["d1", "p3"]);
    expect((await backend.inbox.list({ state: ["pending", "done"], limit: 2 })).map((r) => r.id)).toEqual(["d1", "p2"]);
    expect((await backend.outbox.list({ chatId: "c1" })).map((e) => e.key)).toEqual(["k1"]);
    expect((await backend.inbox.claimDue({ ...lease("A"), limit: 10 })).map((r) => r.id)).toEqual(["p2", "p3"]);
    await backend.close();
    const check = new Database(file);
    expect(check.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get()).toEqual({
      value: String(SQLITE_SCHEMA_VERSION),
    });
    const indexes = (check.prepare("SELECT name FROM sqlite_master WHERE type = 'index'").all() as { name: string }[])
      .map((r) => r.name);
    for (const name of ["botmesh_inbox_received", "botmesh_inbox_chat", "botmesh_outbox_chat_all", "botmesh_inbox_due"]) {
      expect(indexes).toContain(name);
    }
    expect((check.prepare("SELECT sql FROM sqlite_master WHERE name = 'botmesh_inbox_due'").get() as { sql: string }).sql)
      .toContain("received_at");
    check.close();
  });

  test("a file at version 3 gets the call marker: its old entries read as called, a lapsed old send stays ambiguous", async () => {
    const file = tempFile();
    const raw = new Database(file);
    raw.exec(V1_SCHEMA);
    raw.exec(V2_UPGRADE);
    raw.exec(V3_UPGRADE);
    const now = Date.now();
    const insert = raw.prepare(
      `INSERT INTO botmesh_outbox (key, chat_id, content, content_hash, state, attempts, next_attempt_at, lease_owner,
        lease_incarnation, lease_token, lease_expires_at, fence, created_at, updated_at, due_at)
       VALUES (?, ?, '{}', 'h', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
    );
    // A send whose lease lapsed before the upgrade (its call may have gone out), one still leased, one queued.
    insert.run("lapsed", "c1", "sending", 1, null, "old-owner", "i0", 1, now - 1000, 1, now - 2000, now - 2000, now - 1000);
    insert.run("live", "c2", "sending", 1, null, "old-owner", "i0", 1, now + 60_000, 1, now, now, now + 60_000);
    insert.run("queued", "c3", "queued", 0, now - 10, null, null, null, null, 0, now, now, now - 10);
    raw.close();

    const backend = new SQLiteDurability({ file });
    await backend.open();
    for (const key of ["lapsed", "live", "queued"]) {
      expect((await backend.outbox.get(key))?.called, `${key}: written before the marker existed`).toBe(true);
    }
    const claim = await backend.outbox.claimDue({ ...lease("B"), limit: 10 });
    expect(claim.ambiguous.map((e) => e.key), "a lapsed old send may have been sent").toEqual(["lapsed"]);
    expect((await backend.outbox.get("lapsed"))?.state).toBe("unknown");
    // A claim starts the flag over: the queued entry is leased uncalled.
    expect(claim.due.map((e) => [e.key, e.called])).toEqual([["queued", false]]);
    expect((await backend.outbox.get("queued"))?.called).toBe(false);
    // The live old lease is still its holder's: markCalling works on it (it already reads as called).
    expect(await backend.outbox.markCalling("live", 1, 60_000)).toBe(true);
    expect((await backend.outbox.get("live"))?.called).toBe(true);
    // New entries start uncalled.
    const fresh = await backend.outbox.reserve(outbound("fresh", "c9"), lease("B"));
    expect(fresh.entry.called).toBe(false);
    expect((await backend.outbox.get("fresh"))?.called).toBe(false);
    await backend.close();

    const check = new Database(file);
    expect(check.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get()).toEqual({
      value: String(SQLITE_SCHEMA_VERSION),
    });
    // Uncalled exactly when uncalled_fence is the fence; the old rows were not rewritten by the upgrade.
    expect(check.prepare("SELECT key, fence, uncalled_fence FROM botmesh_outbox ORDER BY seq").all()).toEqual([
      { key: "lapsed", fence: 1, uncalled_fence: null },
      { key: "live", fence: 1, uncalled_fence: null },
      { key: "queued", fence: 2, uncalled_fence: 2 },
      { key: "fresh", fence: 1, uncalled_fence: 1 },
    ]);
    check.close();
  });

  test("an entry claimed by an older library (the fence raised, the marker untouched) reads as called", async () => {
    // A process of a library older than schema 3 checks the version only at open: left running on an upgraded
    // file, it claims entries without knowing the marker (and calls the provider without announcing it).
    const file = tempFile();
    const backend = new SQLiteDurability({ file });
    await backend.open();
    await backend.outbox.reserve(outbound("k1", "c1"));
    await backend.outbox.reserve(outbound("k2", "c2"), lease("A"));
    expect((await backend.outbox.get("k1"))?.called).toBe(false);
    expect((await backend.outbox.get("k2"))?.called).toBe(false);
    const raw = new Database(file);
    const now = Date.now();
    // Its claims, as its UPDATE statement wrote them: state, attempts, lease, fence; its lease has lapsed since.
    raw.prepare(
      `UPDATE botmesh_outbox SET state = 'sending', attempts = attempts + 1, next_attempt_at = NULL,
        lease_owner = 'old', lease_incarnation = 'o1', lease_token = fence + 1, lease_expires_at = ?, fence = fence + 1,
        due_at = ? WHERE key IN ('k1', 'k2')`,
    ).run(now - 1000, now - 1000);
    raw.close();
    expect((await backend.outbox.get("k1"))?.called).toBe(true);
    expect((await backend.outbox.get("k2"))?.called).toBe(true);
    const claim = await backend.outbox.claimDue({ ...lease("B"), limit: 10 });
    expect(claim.ambiguous.map((e) => e.key), "its calls may have gone out").toEqual(["k1", "k2"]);
    expect(claim.due).toEqual([]);
    await backend.close();
  });

  test("a file at version 5 gets the set-aside columns: its rows read as before, its damaged ones are set aside", async () => {
    const file = tempFile();
    const raw = new Database(file);
    for (const step of [V1_SCHEMA, V2_UPGRADE, V3_UPGRADE, V4_V5_UPGRADE]) raw.exec(step);
    const now = Date.now();
    const insertIn = raw.prepare(
      `INSERT INTO botmesh_inbox (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at, due_at)
       VALUES (?, 'message', 'c1', 'test', ?, ?, 'pending', 0, 0, ?, 0)`,
    );
    insertIn.run("bad", "{oops", 1, now);
    insertIn.run("good", '{"text":"hi"}', 2, now);
    const insertOut = raw.prepare(
      `INSERT INTO botmesh_outbox (key, chat_id, content, content_hash, state, attempts, next_attempt_at, fence, uncalled_fence,
        created_at, updated_at, due_at) VALUES (?, 'c1', '{}', 'h', ?, 0, 0, 0, 0, ?, ?, ?)`,
    );
    insertOut.run("k-bad", "paused", now, now, 0); // the chat's head, with a state no version wrote
    insertOut.run("k-next", "queued", now, now, null);
    raw.close();

    const backend = new SQLiteDurability({ file });
    await backend.open();
    expect((await backend.inbox.claimDue({ ...lease("A"), limit: 10 })).map((r) => [r.id, r.payload])).toEqual([["good", { text: "hi" }]]);
    expect((await backend.outbox.claimDue({ ...lease("A"), limit: 10 })).due.map((e) => e.key)).toEqual(["k-next"]);
    expect((await backend.inbox.damaged()).map((d) => [d.id, d.reported])).toEqual([["bad", false]]);
    expect((await backend.outbox.damaged()).map((d) => d.problem)).toEqual([
      'column state must be one of queued, sending, sent, failed, dead, unknown, got "paused"',
    ]);
    await backend.close();
    const check = new Database(file);
    expect(check.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get()).toEqual({
      value: String(SQLITE_SCHEMA_VERSION),
    });
    expect(check.prepare("SELECT id, payload, set_aside_seq FROM botmesh_inbox ORDER BY ord").all()).toEqual([
      { id: "bad", payload: "{oops", set_aside_seq: 1 },
      { id: "good", payload: '{"text":"hi"}', set_aside_seq: null },
    ]);
    const indexes = (check.prepare("SELECT name FROM sqlite_master WHERE type = 'index'").all() as { name: string }[]).map((r) => r.name);
    for (const name of ["botmesh_inbox_aside", "botmesh_inbox_unreported", "botmesh_outbox_aside", "botmesh_outbox_unreported"]) {
      expect(indexes).toContain(name);
    }
    check.close();
  });

  test("a file at version 6 gets the index of each chat's active records: a leased admit sees the chat's earlier records", async () => {
    const file = tempFile();
    const first = new SQLiteDurability({ file });
    await first.open();
    await first.inbox.admit(inbound("old-pending"));
    await first.inbox.admit(inbound("old-held", { chatId: "c2" }), lease("B"));
    await first.close();
    // Version 6 is version 7 without the index.
    const raw = new Database(file);
    raw.exec(`DROP INDEX botmesh_inbox_chat_active; UPDATE botmesh_meta SET value = '6' WHERE key = 'schema_version';`);
    raw.close();
    const backend = new SQLiteDurability({ file });
    await backend.open();
    expect((await backend.inbox.admit(inbound("behind-pending"), lease("A")))?.state).toBe("pending");
    expect((await backend.inbox.admit(inbound("behind-held", { chatId: "c2" }), lease("A")))?.state).toBe("pending");
    expect((await backend.inbox.admit(inbound("alone", { chatId: "c3" }), lease("A")))?.state).toBe("processing");
    await backend.close();
    const check = new Database(file);
    expect(check.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get()).toEqual({
      value: String(SQLITE_SCHEMA_VERSION),
    });
    expect(check.prepare("SELECT sql FROM sqlite_master WHERE name = 'botmesh_inbox_chat_active'").get()).toEqual({
      sql: "CREATE INDEX botmesh_inbox_chat_active ON botmesh_inbox (chat_id, received_at, ord) WHERE state IN ('pending', 'processing', 'scheduled', 'failed')",
    });
    check.close();
  });

  test("a file at version 7 loses the lease-owner indexes and keeps its records: a restart still reclaims its own leases", async () => {
    const file = tempFile();
    const first = new SQLiteDurability({ file });
    await first.open();
    await first.inbox.admit(inbound("held", { chatId: "c1" }), lease("A", 3_600_000, "old"));
    await first.inbox.admit(inbound("other", { chatId: "c2" }), lease("B", 3_600_000, "old"));
    await first.inbox.admit(inbound("waiting", { chatId: "c3" }));
    const sending = await first.outbox.reserve(outbound("k-held", "c1"), lease("A", 3_600_000, "old"));
    await first.outbox.reserve(outbound("k-next", "c1"), lease("A", 3_600_000, "old"));
    await first.close();
    expect(sending.status).toBe("leased");
    // Version 7 is version 8 with the two lease-owner indexes.
    const raw = new Database(file);
    raw.exec(`
      CREATE INDEX botmesh_inbox_owner ON botmesh_inbox (lease_owner) WHERE lease_owner IS NOT NULL;
      CREATE INDEX botmesh_outbox_owner ON botmesh_outbox (lease_owner) WHERE lease_owner IS NOT NULL;
      UPDATE botmesh_meta SET value = '7' WHERE key = 'schema_version';`);
    raw.close();

    const backend = new SQLiteDurability({ file });
    await backend.open();
    expect((await backend.inbox.list()).map((r) => [r.id, r.state, r.lease?.incarnation ?? null])).toEqual([
      ["held", "processing", "old"],
      ["other", "processing", "old"],
      ["waiting", "pending", null],
    ]);
    // A's new incarnation takes its own previous leases at once (not B's, which have an hour to run).
    const reclaim = { ...lease("A", 60_000, "new"), limit: 10, reclaimOwn: true };
    expect((await backend.inbox.claimDue(reclaim)).map((r) => [r.id, r.lease?.incarnation])).toEqual([
      ["held", "new"],
      ["waiting", "new"],
    ]);
    const claimed = await backend.outbox.claimDue({ ...reclaim, resendAmbiguous: false });
    expect(claimed.due.map((e) => [e.key, e.lease?.incarnation])).toEqual([["k-held", "new"]]);
    expect(claimed.ambiguous).toEqual([]);
    expect((await backend.outbox.get("k-next"))?.state).toBe("queued");
    await backend.close();
    const check = new Database(file);
    expect(check.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get()).toEqual({
      value: String(SQLITE_SCHEMA_VERSION),
    });
    const indexes = (check.prepare("SELECT name FROM sqlite_master WHERE type = 'index'").all() as { name: string }[]).map((r) => r.name);
    expect(indexes).not.toContain("botmesh_inbox_owner");
    expect(indexes).not.toContain("botmesh_outbox_owner");
    check.close();
  });

  test("a file at version 8 is upgraded: a timer armed as a failed record becomes scheduled, due when it was; a real failure stays failed", async () => {
    const file = tempFile();
    const first = new SQLiteDurability({ file });
    await first.open();
    const timer = (await first.inbox.admit(inbound("m0:t1", { chatId: "c1" }), lease("A")))!;
    const soon = (await first.inbox.admit(inbound("m1:t1", { chatId: "c2" }), lease("A")))!;
    const failing = (await first.inbox.admit(inbound("m2", { chatId: "c3" }), lease("A")))!;
    await first.inbox.schedule(timer.id, timer.fence, 3_600_000);
    await first.inbox.schedule(soon.id, soon.fence, 0);
    await first.inbox.fail(failing.id, failing.fence, { error: "boom", retryInMs: 3_600_000 });
    const before = (await first.inbox.get(timer.id))!;
    await first.close();
    // Version 8 armed a timer as a failed record, and its index of a chat's active records had no timer state.
    const raw = new Database(file);
    raw.exec(`
      UPDATE botmesh_inbox SET state = 'failed', error = 'Not a failure: a timer, due at 2026-12-06T10:00:00.000Z'
        WHERE id IN ('m0:t1', 'm1:t1');
      DROP INDEX botmesh_inbox_chat_active;
      CREATE INDEX botmesh_inbox_chat_active ON botmesh_inbox (chat_id, received_at, ord) WHERE state IN ('pending', 'processing', 'failed');
      UPDATE botmesh_meta SET value = '8' WHERE key = 'schema_version';`);
    raw.close();

    const backend = new SQLiteDurability({ file });
    await backend.open();
    const after = (await backend.inbox.get(timer.id))!;
    expect([after.state, after.error, after.nextAttemptAt, after.attempts]).toEqual(["scheduled", null, before.nextAttemptAt, 1]);
    expect((await backend.inbox.get(failing.id))?.state, "a failure stays a failure").toBe("failed");
    expect((await backend.inbox.list({ state: "scheduled" })).map((r) => r.id)).toEqual(["m0:t1", "m1:t1"]);
    // Due when it was: the one due now is taken, the other not before its deadline; a leased admit of
    // the timer's chat goes by the index built again (a timer not due holds back nothing).
    expect((await backend.inbox.claimDue({ ...lease("B"), limit: 10 })).map((r) => r.id)).toEqual(["m1:t1"]);
    expect((await backend.inbox.admit(inbound("m3", { chatId: "c1" }), lease("A")))?.state).toBe("processing");
    await backend.close();
    const check = new Database(file);
    expect(check.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get()).toEqual({ value: String(SQLITE_SCHEMA_VERSION) });
    expect(check.prepare("SELECT sql FROM sqlite_master WHERE name = 'botmesh_inbox_chat_active'").get()).toEqual({
      sql: "CREATE INDEX botmesh_inbox_chat_active ON botmesh_inbox (chat_id, received_at, ord) WHERE state IN ('pending', 'processing', 'scheduled', 'failed')",
    });
    check.close();
  });

  test("a file at version 9 gets the lease indexes: a restart reclaims its own leases in order, and a lease held elsewhere still holds back its chat", async () => {
    const file = tempFile();
    const first = new SQLiteDurability({ file });
    await first.open();
    await first.inbox.admit(inbound("a1", { chatId: "c1" }), lease("A", 3_600_000, "old"));
    await first.inbox.admit(inbound("a2", { chatId: "c1" }), lease("A", 3_600_000, "old"));
    await first.inbox.admit(inbound("b1", { chatId: "c2" }), lease("B", 3_600_000, "other"));
    await first.inbox.admit(inbound("b2", { chatId: "c2" }));
    await first.close();
    // Version 9 read a chat's leases by its index of processing records, and had no index by holder.
    const raw = new Database(file);
    raw.exec(`
      DROP INDEX botmesh_inbox_chat_lease;
      DROP INDEX botmesh_inbox_lease;
      CREATE INDEX botmesh_inbox_chat_leased ON botmesh_inbox (chat_id, received_at, ord) WHERE state = 'processing';
      UPDATE botmesh_meta SET value = '9' WHERE key = 'schema_version';`);
    raw.close();

    const backend = new SQLiteDurability({ file });
    await backend.open();
    expect((await backend.inbox.claimDue({ ...lease("A", 60_000, "new"), reclaimOwn: true, limit: 10 })).map((r) => r.id)).toEqual(["a1", "a2"]);
    expect((await backend.inbox.claimDue({ ...lease("C"), limit: 10 })).map((r) => r.id), "b1 is held by B: b2 waits").toEqual([]);
    await backend.close();
    const check = new Database(file);
    expect(check.prepare("SELECT value FROM botmesh_meta WHERE key = 'schema_version'").get()).toEqual({ value: String(SQLITE_SCHEMA_VERSION) });
    const indexes = (check.prepare("SELECT name FROM sqlite_master WHERE type = 'index' AND name LIKE 'botmesh_inbox_%lease%'").all() as { name: string }[])
      .map((r) => r.name).sort();
    expect(indexes).toEqual(["botmesh_inbox_chat_lease", "botmesh_inbox_lease"]);
    check.close();
  });

  test("a file from a newer version is refused with the file and both versions named", async () => {
    const file = tempFile();
    const first = new SQLiteDurability({ file });
    await first.open();
    await first.close();
    const raw = new Database(file);
    raw.exec("UPDATE botmesh_meta SET value = '99' WHERE key = 'schema_version'");
    raw.close();
    const backend = new SQLiteDurability({ file });
    const error = await rejection(() => backend.open());
    expect(error.message).toContain(JSON.stringify(file));
    expect(error.message).toContain("schema version 99");
    expect(error.message).toContain(`up to schema version ${SQLITE_SCHEMA_VERSION}`);
    expect(backend.isOpen).toBe(false);
    const store = new SQLiteStore({ file });
    expect((await rejection(() => store.get("k"))).message).toContain("schema version 99");
  });

  test("a process left running on a file a newer version upgraded stops writing, naming the file and both versions", async () => {
    const [a, b, file] = await pair();
    await a.inbox.admit(inbound("m0"), lease("A"));
    // The other process of a rolling upgrade migrated the file to a newer schema (simulated).
    const raw = new Database(file);
    raw.exec(`UPDATE botmesh_meta SET value = '${SQLITE_SCHEMA_VERSION + 1}' WHERE key = 'schema_version'`);
    const results = await Promise.allSettled([
      b.inbox.admit(inbound("m1")),
      b.outbox.reserve(outbound("k1")),
      b.inbox.complete("m0", 1),
    ]);
    expect(results.map((r) => r.status)).toEqual(["rejected", "rejected", "rejected"]);
    for (const r of results) {
      const message = String((r as PromiseRejectedResult).reason.message);
      expect(message).toContain(JSON.stringify(file));
      expect(message).toContain(`schema version ${SQLITE_SCHEMA_VERSION + 1}`);
      expect(message).toContain(`(schema version ${SQLITE_SCHEMA_VERSION})`);
      expect(message).toContain("restart this process with the newer version");
    }
    expect(await rejection(() => a.inbox.admit(inbound("m2")))).toBeInstanceOf(Error);
    expect(raw.prepare("SELECT count(*) AS n FROM botmesh_inbox").get()).toEqual({ n: 1 });
    expect(raw.prepare("SELECT count(*) AS n FROM botmesh_outbox").get()).toEqual({ n: 0 });
    expect((await a.inbox.get("m0"))?.state).toBe("processing");
    expect(b.stats.failedBatches).toBeGreaterThanOrEqual(1);
    raw.exec(`UPDATE botmesh_meta SET value = '${SQLITE_SCHEMA_VERSION}' WHERE key = 'schema_version'`);
    raw.close();
    expect(await b.inbox.admit(inbound("m1"))).not.toBeNull();
    await a.close();
    await b.close();
  });

  test("a table prefix keeps two schemas apart in one file", async () => {
    const file = tempFile();
    const a = new SQLiteDurability({ file, tablePrefix: "bot_a_" });
    const b = new SQLiteDurability({ file, tablePrefix: "bot_b_" });
    await a.open();
    await b.open();
    await a.inbox.admit(inbound("m1"));
    expect(await b.inbox.get("m1")).toBeNull();
    expect(await b.inbox.admit(inbound("m1"))).not.toBeNull();
    await a.close();
    await b.close();
  });
});

describe("sqlite: bad files and options", () => {
  test("a file that is not a SQLite database gives a clear error naming it", async () => {
    const file = tempFile();
    writeFileSync(file, "this is not a database\n".repeat(200));
    const backend = new SQLiteDurability({ file });
    const error = await rejection(() => backend.open());
    expect(error.message).toContain(`Cannot open SQLite file ${JSON.stringify(file)}`);
    expect(error.message).toContain("not a SQLite database");
    expect(backend.isOpen).toBe(false);
    const store = new SQLiteStore({ file });
    expect((await rejection(() => store.set("k", 1))).message).toContain("not a SQLite database");
  });

  test("invalid options are rejected naming the option and the value", () => {
    const file = tempFile();
    const cases: [unknown, ErrorConstructor, RegExp][] = [
      [undefined, TypeError, /SQLite options must be an object.*got undefined/],
      ["x.db", TypeError, /SQLite options must be an object.*got "x\.db"/],
      [{}, TypeError, /option "file" must be a non-empty string, got undefined/],
      [{ file: "" }, TypeError, /option "file" must be a non-empty string, got ""/],
      [{ file: 42 }, TypeError, /option "file" must be a non-empty string, got 42/],
      [{ file, busyTimeoutMs: -1 }, RangeError, /option "busyTimeoutMs" must be an integer .*got -1/],
      [{ file, busyTimeoutMs: 1.5 }, RangeError, /option "busyTimeoutMs" .*got 1\.5/],
      [{ file, busyTimeoutMs: "5" }, TypeError, /option "busyTimeoutMs" must be a number, got "5"/],
      [{ file, synchronous: "off" }, RangeError, /option "synchronous" must be "full" or "normal", got "off"/],
      [{ file, driver: "sqlite3" }, RangeError, /option "driver" must be .*"better-sqlite3", got "sqlite3"/],
      [{ file, tablePrefix: "a-b" }, RangeError, /option "tablePrefix" .*got "a-b"/],
      [{ file, tablePrefix: 1 }, TypeError, /option "tablePrefix" must be a string, got 1/],
      [{ file, checkOnOpen: "yes" }, TypeError, /option "checkOnOpen" must be a boolean, got "yes"/],
      [{ file, bogus: true }, TypeError, /Unknown SQLite option "bogus"; known options are "file"/],
    ];
    for (const [options, type, message] of cases) {
      for (const make of [
        () => new SQLiteDurability(options as { file: string }),
        () => new SQLiteStore(options as { file: string }),
      ]) {
        let error: unknown;
        try {
          make();
        } catch (e) {
          error = e;
        }
        expect(error, `options ${String(JSON.stringify(options))}`).toBeInstanceOf(type);
        expect((error as Error).message).toMatch(message);
        expect((error as Error).message[0]).toBe((error as Error).message[0].toUpperCase());
      }
    }
  });

  test("a driver that cannot be loaded names what to install", async () => {
    const backend = new SQLiteDurability({ file: tempFile(), driver: "node:sqlite" });
    // Bun has no node:sqlite; the error says which driver failed.
    const error = await backend.open().then(() => null, (e: Error) => e);
    if (error) expect(error.message).toMatch(/No SQLite driver could be loaded on Bun.*node:sqlite/);
    else await backend.close(); // a Bun that gained node:sqlite
  });

  test("ids, chat ids and errors round-trip unicode exactly", async () => {
    const backend = new SQLiteDurability({ file: tempFile(), synchronous: "normal" });
    await backend.open();
    const id = "ид-✓-🎉-e\u0301";
    await backend.inbox.admit(inbound(id, { chatId: "чат 你好" }), lease("ownér ✓"));
    await backend.inbox.fail(id, 1, { error: "bőom 💥", dead: true });
    const record = await backend.inbox.get(id);
    expect(record?.chatId).toBe("чат 你好");
    expect(record?.error).toBe("bőom 💥");
    expect((await backend.inbox.list({ chatId: "чат 你好" })).map((r) => r.id)).toEqual([id]);
    const reserved = await backend.outbox.reserve(outbound("ключ:1", "чат 你好", { inboundId: id }), lease("ownér ✓"));
    expect(reserved.status).toBe("leased");
    await backend.outbox.markSent("ключ:1", 1, "msg-✓");
    expect((await backend.outbox.get("ключ:1"))?.messageId).toBe("msg-✓");
    expect((await backend.outbox.get("ключ:1"))?.inboundId).toBe(id);
    await backend.close();
  });
});

describe("sqlite: bad input never reaches the driver", () => {
  test("a missing inboundId is null; bad fields are a TypeError naming them and nothing is written", async () => {
    const file = tempFile();
    const backend = new SQLiteDurability({ file });
    await backend.open();
    const { inboundId: _, ...noInbound } = outbound("k-missing");
    const reserved = await backend.outbox.reserve(noInbound as NewOutboxEntry);
    expect(reserved.entry.inboundId).toBeNull();
    expect((await backend.outbox.get("k-missing"))?.inboundId).toBeNull();

    const badInbound: [Partial<Record<keyof NewInboundRecord, unknown>>, string][] = [
      [{ receivedAt: Number.NaN }, "receivedAt"],
      [{ receivedAt: undefined }, "receivedAt"],
      [{ payload: { n: 10n } }, "payload.n"],
      [{ payload: { rows: [1, { at: new Date() }] } }, "payload.rows[1].at"],
      [{ chatId: undefined }, "chatId"],
    ];
    for (const [bad, field] of badInbound) {
      const error = await rejection(() => backend.inbox.admit({ ...inbound("m-bad"), ...bad } as NewInboundRecord));
      expect(error, field).toBeInstanceOf(TypeError);
      expect(error.message).toContain(field);
    }
    const badOutbound: [Partial<Record<keyof NewOutboxEntry, unknown>>, string][] = [
      [{ content: { n: 1n } }, "content.n"],
      [{ inboundId: 7 }, "inboundId"],
      [{ contentHash: undefined }, "contentHash"],
    ];
    for (const [bad, field] of badOutbound) {
      const error = await rejection(() => backend.outbox.reserve({ ...outbound("k-bad"), ...bad } as NewOutboxEntry));
      expect(error, field).toBeInstanceOf(TypeError);
      expect(error.message).toContain(field);
    }
    // Lease options, ids, tokens, outcomes: named too.
    const named: [() => Promise<unknown>, string][] = [
      [() => backend.inbox.admit(inbound("m-bad"), { owner: undefined, incarnation: "i", leaseMs: 1 } as never), '"owner"'],
      [() => backend.inbox.claim(undefined as never, lease("A")), '"id"'],
      [() => backend.inbox.claimDue({ ...lease("A"), limit: undefined as never }), '"limit"'],
      [() => backend.inbox.complete("m", undefined as never), '"token"'],
      [() => backend.inbox.fail("m", 1, { error: undefined as never, dead: true }), '"error"'],
      [() => backend.outbox.markSent("k-missing", 1, undefined as never), '"messageId"'],
      [() => backend.outbox.get(undefined as never), '"key"'],
      [() => backend.inbox.list({ chatId: 5 as never }), '"chatId"'],
    ];
    for (const [run, field] of named) {
      const error = await rejection(run);
      expect(error, field).toBeInstanceOf(TypeError);
      expect(error.message).toContain(field);
    }
    await backend.close();
    const raw = new Database(file);
    expect(raw.prepare("SELECT count(*) AS n FROM botmesh_inbox").get()).toEqual({ n: 0 });
    expect(raw.prepare("SELECT key FROM botmesh_outbox").all()).toEqual([{ key: "k-missing" }]);
    raw.close();
  });

  test("the driver shim refuses undefined, NaN and BigInt parameters with a TypeError on every driver", async () => {
    const db = await openSqlite(":memory:");
    db.exec("CREATE TABLE t (a)");
    for (const bad of [undefined, Number.NaN, 1n]) {
      let error: unknown;
      try {
        db.prepare("INSERT INTO t VALUES (?)").run(bad as never);
      } catch (e) {
        error = e;
      }
      expect(error).toBeInstanceOf(TypeError);
      expect((error as Error).message).toContain("Cannot bind parameter 1");
    }
    expect(db.prepare("SELECT count(*) AS n FROM t").get()).toEqual({ n: 0 });
    db.close();
  });
});

describe("sqlite: lists", () => {
  test("lists by chat, state and several states keep their order and limit", async () => {
    const backend = new SQLiteDurability({ file: tempFile() });
    await backend.open();
    // Receipt order differs from insertion order; states: i % 3 = 0 done, 1 dead, 2 pending.
    const ids: string[] = [];
    for (let i = 0; i < 30; i++) {
      const id = `m${i}`;
      ids.push(id);
      await backend.inbox.admit(inbound(id, { receivedAt: 1000 - i * 10 + (i % 2) * 5, chatId: `c${i % 2}` }), i % 3 === 2 ? undefined : lease("A"));
      if (i % 3 === 0) await backend.inbox.complete(id, 1);
      if (i % 3 === 1) await backend.inbox.fail(id, 1, { error: "x", dead: true });
    }
    const all = await backend.inbox.list({ limit: 100 });
    const expected = (filter: (r: (typeof all)[number]) => boolean, limit: number) =>
      all.filter(filter).slice(0, limit).map((r) => r.id);
    expect(all.map((r) => r.receivedAt)).toEqual(all.map((r) => r.receivedAt).sort((a, b) => a - b));
    expect((await backend.inbox.list({ limit: 4 })).map((r) => r.id)).toEqual(expected(() => true, 4));
    expect((await backend.inbox.list({ state: ["done", "pending"], limit: 7 })).map((r) => r.id))
      .toEqual(expected((r) => r.state === "done" || r.state === "pending", 7));
    expect((await backend.inbox.list({ state: ["dead", "done", "pending", "failed"] })).map((r) => r.id))
      .toEqual(expected(() => true, 100));
    expect((await backend.inbox.list({ chatId: "c1", limit: 5 })).map((r) => r.id))
      .toEqual(expected((r) => r.chatId === "c1", 5));
    expect((await backend.inbox.list({ chatId: "c0", state: ["dead", "pending"], limit: 3 })).map((r) => r.id))
      .toEqual(expected((r) => r.chatId === "c0" && (r.state === "dead" || r.state === "pending"), 3));
    expect(await backend.inbox.list({ state: [] })).toEqual([]);
    expect(await backend.inbox.list({ limit: 0 })).toEqual([]);

    for (let i = 0; i < 20; i++) {
      const r = await backend.outbox.reserve(outbound(`k${i}`, `c${i % 3}`), lease("A"));
      if (r.status === "leased") await backend.outbox.markSent(`k${i}`, 1, "m");
    }
    const entries = await backend.outbox.list({ limit: 100 });
    expect(entries.map((e) => e.seq)).toEqual(entries.map((e) => e.seq).sort((a, b) => a - b));
    expect((await backend.outbox.list({ state: ["queued", "sent"], limit: 6 })).map((e) => e.key))
      .toEqual(entries.slice(0, 6).map((e) => e.key));
    expect((await backend.outbox.list({ chatId: "c2" })).map((e) => e.key))
      .toEqual(entries.filter((e) => e.chatId === "c2").map((e) => e.key));
    await backend.close();
  });
});

describe("sqlite: chat order at admission", () => {
  test("a leased admit counts the chat's active records received no later, of any state; settled and set-aside records never count", async () => {
    let now = 1_000_000;
    const backend = new SQLiteDurability({ file: tempFile(), clock: () => now });
    await backend.open();
    const a = lease("A", 1_000);
    const admit = async (id: string, receivedAt: number, options?: ClaimOptions) =>
      (await backend.inbox.admit(inbound(id, { chatId: "c1", receivedAt }), options))?.state;
    // A pending record received later does not come first: the new one sorts before it.
    expect(await admit("later", 5_000)).toBe("pending");
    expect(await admit("earlier", 4_000, a)).toBe("processing");
    expect(await admit("after-later", 6_000, a)).toBe("pending");
    // Settled records never count; the caller's own live lease and a retry not yet due do not come first.
    const clear = await backend.inbox.claimDue({ ...a, limit: 10 });
    expect(clear.map((r) => r.id)).toEqual(["later", "after-later"]);
    await backend.inbox.complete("later", clear[0]!.fence);
    await backend.inbox.fail("after-later", clear[1]!.fence, { error: "x", retryInMs: 500 });
    expect(await admit("mine", 7_000, a)).toBe("processing");
    expect(await admit("other-incarnation", 7_500, lease("A", 1_000, "i2"))).toBe("pending");
    // The clock is the backend's: the retry falls due and the leases lapse.
    now += 600;
    expect(await admit("behind-due-retry", 8_000, a)).toBe("pending");
    // A damaged record (here: one that comes first) is set aside when met and counts no more.
    const raw = new Database(backend.file);
    raw.exec(`UPDATE botmesh_inbox SET payload = '{' WHERE state IN ('pending', 'failed')`);
    raw.close();
    expect(await admit("after-damage", 9_000, a)).toBe("processing");
    expect((await backend.inbox.damaged()).map((d) => d.id).sort()).toEqual(
      ["after-later", "behind-due-retry", "other-incarnation"],
    );
    now += 2_000; // every lease lapsed: the lapsed ones come first
    expect(await admit("behind-lapsed", 10_000, a)).toBe("pending");
    await backend.close();
  });
});

describe("sqlite: damaged rows", () => {
  test("a journal row that cannot be read is set aside, kept as stored; a session value that cannot be parsed names the file, table, row and column", async () => {
    const file = tempFile();
    const store = new SQLiteStore({ file });
    const backend = store.durability();
    await backend.open();
    await backend.inbox.admit(inbound("m1", { receivedAt: 1 }));
    await backend.inbox.admit(inbound("m2", { receivedAt: 2 }));
    await backend.outbox.reserve(outbound("k1"));
    await backend.outbox.reserve(outbound("k2"));
    await store.set("s1", { a: 1 });
    const raw = new Database(file);
    raw.exec(`UPDATE botmesh_inbox SET payload = '{"text":' WHERE id = 'm1'`);
    raw.exec(`UPDATE botmesh_outbox SET content = 'not json' WHERE key = 'k1'`);
    raw.exec(`UPDATE botmesh_session SET value = '[1,' WHERE key = 's1'`);

    const inError = await rejection(() => backend.inbox.get("m1"));
    expect(inError).toBeInstanceOf(DamagedRecordError);
    expect(inError).toMatchObject({ journal: "inbox", id: "m1", backend: "sqlite" });
    expect((inError as DamagedRecordError).problem).toMatch(/^column payload is not valid JSON: /);
    expect((await backend.inbox.list()).map((r) => r.id)).toEqual(["m2"]);
    expect((await backend.outbox.list({ chatId: "c1" })).map((e) => e.key)).toEqual(["k2"]);
    const outError = await rejection(() => backend.outbox.get("k1"));
    expect(outError).toMatchObject({ journal: "outbox", id: "k1", backend: "sqlite" });
    expect(outError.message).toMatch(/^Outbox entry "k1" in backend "sqlite" is damaged and set aside: column content is not valid JSON/);
    expect((await backend.outbox.damaged()).map((d) => [d.id, d.problem.split(":")[0], d.reported]))
      .toEqual([["k1", "column content is not valid JSON", false]]);
    // Kept as stored: only the set-aside columns (and the due mark) changed.
    expect(raw.prepare("SELECT payload, state, attempts, due_at, set_aside_seq, damage_reported FROM botmesh_inbox WHERE id = 'm1'").get())
      .toEqual({ payload: '{"text":', state: "pending", attempts: 0, due_at: null, set_aside_seq: 1, damage_reported: 0 });
    expect(raw.prepare("SELECT content, state, set_aside_seq FROM botmesh_outbox WHERE key = 'k1'").get())
      .toEqual({ content: "not json", state: "queued", set_aside_seq: 1 });

    const sessionError = await rejection(() => store.get("s1"));
    expect(sessionError.message).toMatch(/table botmesh_session, row key "s1": column value is not valid JSON/);
    expect(sessionError.message).toContain(JSON.stringify(file));
    expect(sessionError.cause).toBeInstanceOf(SyntaxError);
    raw.close();
    await backend.close();
    await store.close();
  });

  test("wrong types, unknown states, partial leases and BLOBs name their column; an unreadable id is named by its storage key", async () => {
    const backend = new SQLiteDurability({ file: tempFile() });
    await backend.open();
    for (const id of ["state", "attempts", "lease", "blob", "good"]) await backend.inbox.admit(inbound(id, { chatId: id }));
    await backend.outbox.reserve(outbound("k-state", "c1"));
    await backend.outbox.reserve(outbound("k-next", "c1"));
    const raw = new Database(backend.file);
    raw.exec(`UPDATE botmesh_inbox SET state = 'archived' WHERE id = 'state'`);
    raw.exec(`UPDATE botmesh_inbox SET attempts = 'many' WHERE id = 'attempts'`);
    raw.exec(`UPDATE botmesh_inbox SET lease_token = 3 WHERE id = 'lease'`);
    raw.exec(`UPDATE botmesh_inbox SET id = X'0102' WHERE id = 'blob'`);
    raw.exec(`UPDATE botmesh_outbox SET state = 'archived' WHERE key = 'k-state'`);
    const blobOrd = (raw.prepare("SELECT ord FROM botmesh_inbox WHERE typeof(id) = 'blob'").get() as { ord: number }).ord;
    raw.close();
    // A due scan meets them all (each was pending); the outbox head with an unknown state hands its chat on at once.
    expect((await backend.inbox.claimDue({ ...lease("A"), limit: 10 })).map((r) => r.id)).toEqual(["good"]);
    expect((await backend.outbox.claimDue({ ...lease("A"), limit: 10 })).due.map((e) => e.key)).toEqual(["k-next"]);
    expect((await backend.inbox.damaged()).map((d) => [d.id, d.problem])).toEqual([
      ["state", 'column state must be one of pending, processing, scheduled, failed, done, dead, got "archived"'],
      ["attempts", 'column attempts must be a non-negative integer, got "many"'],
      ["lease", "column lease_owner must be a string (the lease columns are all set or all NULL), got null"],
      [`ord:${blobOrd}`, "column id holds a BLOB"],
    ]);
    expect((await backend.outbox.damaged()).map((d) => [d.id, d.problem])).toEqual([
      ["k-state", 'column state must be one of queued, sending, sent, failed, dead, unknown, got "archived"'],
    ]);
    expect(await backend.inbox.reportDamaged(`ord:${blobOrd}`)).toBe(true);
    expect(await backend.inbox.reportDamaged(`ord:${blobOrd}`)).toBe(false);
    expect(await backend.inbox.reportDamaged(`ord:${blobOrd + 100}`)).toBe(false);
    expect((await backend.inbox.damaged({ unreported: true })).map((d) => d.id)).toEqual(["state", "attempts", "lease"]);
    expect((await backend.inbox.damaged({ limit: 1 })).map((d) => d.id)).toEqual(["state"]);
    expect(await backend.inbox.damaged({ limit: 0 })).toEqual([]);
    expect(await rejection(() => backend.inbox.damaged({ limit: -1 }))).toBeInstanceOf(RangeError);
    expect(await rejection(() => backend.inbox.damaged({ unreported: "yes" as unknown as boolean }))).toBeInstanceOf(TypeError);
    await backend.close();
  });

  test("under its old lease a damaged record is stale; a reserve of its key rejects, an admit of its id is a duplicate", async () => {
    const backend = new SQLiteDurability({ file: tempFile() });
    await backend.open();
    await backend.inbox.admit(inbound("m1"), lease("A"));
    await backend.outbox.reserve(outbound("k1"), lease("A"));
    const raw = new Database(backend.file);
    raw.exec(`UPDATE botmesh_inbox SET payload = '{' WHERE id = 'm1'`);
    raw.exec(`UPDATE botmesh_outbox SET content = '{' WHERE key = 'k1'`);
    raw.close();
    expect(await backend.inbox.heartbeat("m1", 1, 60_000)).toBe(false);
    expect(await rejection(() => backend.inbox.complete("m1", 1))).toBeInstanceOf(StaleLeaseError);
    expect(await rejection(() => backend.inbox.fail("m1", 1, { error: "x", dead: true }))).toBeInstanceOf(StaleLeaseError);
    expect(await backend.inbox.claim("m1", { ...lease("B"), reclaimOwn: true })).toBeNull();
    expect(await backend.inbox.admit(inbound("m1"))).toBeNull();
    expect(await backend.outbox.heartbeat("k1", 1, 60_000)).toBe(false);
    expect(await backend.outbox.markCalling("k1", 1, 60_000)).toBe(false);
    expect(await rejection(() => backend.outbox.markSent("k1", 1, "m"))).toBeInstanceOf(StaleLeaseError);
    const reserved = await rejection(() => backend.outbox.reserve(outbound("k1")));
    expect(reserved).toBeInstanceOf(DamagedRecordError);
    expect(reserved).toMatchObject({ journal: "outbox", id: "k1" });
    expect((await backend.inbox.damaged()).map((d) => d.id)).toEqual(["m1"]);
    expect((await backend.outbox.damaged()).map((d) => d.id)).toEqual(["k1"]);
    const check = new Database(backend.file);
    expect(check.prepare("SELECT state, lease_token, fence FROM botmesh_inbox").all()).toEqual([{ state: "processing", lease_token: 1, fence: 1 }]);
    expect(check.prepare("SELECT state, lease_token, uncalled_fence FROM botmesh_outbox").all()).toEqual([{ state: "sending", lease_token: 1, uncalled_fence: 1 }]);
    check.close();
    await backend.close();
  });

  test("several processes meet the same damaged rows: each is set aside once, and reported once", async () => {
    const [a, b, file] = await pair();
    for (let i = 0; i < 40; i++) await a.inbox.admit(inbound(`m${i}`, { receivedAt: i, chatId: `c${i % 4}` }));
    for (let i = 0; i < 12; i++) await a.outbox.reserve(outbound(`k${i}`, `c${i % 3}`));
    const raw = new Database(file);
    raw.exec(`UPDATE botmesh_inbox SET payload = 'x' WHERE id IN ('m0', 'm5', 'm22')`);
    raw.exec(`UPDATE botmesh_outbox SET state = 'lost' WHERE key IN ('k0', 'k4')`);
    const runs = await Promise.allSettled(Array.from({ length: 16 }, (_, i) => {
      const x = i % 2 ? a : b;
      switch (i % 4) {
        case 0:
          return x.inbox.claimDue({ ...lease(`o${i}`), limit: 5 });
        case 1:
          return x.inbox.list({ limit: 100 });
        case 2:
          return x.outbox.claimDue({ ...lease(`o${i}`), limit: 5 });
        default:
          return Promise.all([x.inbox.get("m22"), x.outbox.list()]);
      }
    }));
    for (const run of runs) {
      if (run.status === "rejected") expect(run.reason).toBeInstanceOf(DamagedRecordError); // the get of m22
    }
    const inbox = await a.inbox.damaged();
    expect(inbox.map((d) => d.id).sort()).toEqual(["m0", "m22", "m5"]);
    expect(await b.inbox.damaged()).toEqual(inbox);
    expect(raw.prepare("SELECT set_aside_seq FROM botmesh_inbox WHERE set_aside_seq IS NOT NULL ORDER BY set_aside_seq").all())
      .toEqual([{ set_aside_seq: 1 }, { set_aside_seq: 2 }, { set_aside_seq: 3 }]);
    expect((await b.outbox.damaged()).map((d) => d.id).sort()).toEqual(["k0", "k4"]);
    const reports = await Promise.all(["m0", "m5", "m22"].flatMap((id) => [a.inbox.reportDamaged(id), b.inbox.reportDamaged(id)]));
    expect(reports.filter(Boolean).length).toBe(3);
    raw.close();
    await a.close();
    await b.close();
  });
});

describe("sqlite: query plans", () => {
  test("due scans, reclaims, fenced updates, purges and lists use indexes, never a table scan; lists never sort", async () => {
    // Record every statement the backend prepares (bun:sqlite is the driver here).
    const prepared: string[] = [];
    const listed: string[] = [];
    let target = prepared;
    const original = Database.prototype.prepare;
    Database.prototype.prepare = function (this: Database, sql: string, ...rest: unknown[]) {
      target.push(sql);
      return (original as (...args: unknown[]) => unknown).call(this, sql, ...rest);
    } as typeof original;
    const file = tempFile();
    const store = new SQLiteStore({ file });
    const backend = store.durability();
    try {
      await backend.open();
      await store.set("k", 1, { ttlMs: 1 });
      const a = lease("A", 60_000, "i1");
      await backend.inbox.admit(inbound("m1"));
      await backend.inbox.admit(inbound("m2", { chatId: "c2" }), a); // its own chat: leased, m1 pending does not come first
      await backend.inbox.claim("m1", a);
      await backend.inbox.heartbeat("m1", 2, 1000);
      await backend.inbox.fail("m1", 2, { error: "x", retryInMs: 0 });
      await backend.inbox.claimDue({ ...lease("A", 1000, "i2"), limit: 10, reclaimOwn: true });
      await backend.inbox.complete("m2", 2);
      await backend.inbox.replay("m2");
      await backend.inbox.purge(0);
      await backend.outbox.reserve(outbound("k1"), a);
      await backend.outbox.reserve(outbound("k2"));
      await backend.outbox.reserve(outbound("k3", "c2"));
      await backend.outbox.heartbeat("k1", 1, 1000);
      await backend.outbox.markFailed("k1", 1, { error: "x", retryInMs: 0 });
      await backend.outbox.claimDue({ ...lease("A", 1000, "i2"), limit: 10, reclaimOwn: true });
      await backend.outbox.markSent("k1", 2, "m");
      await backend.outbox.markFailed("k3", 2, { error: "x", dead: true });
      await backend.outbox.retry("k3");
      await backend.outbox.discard("k3");
      await backend.outbox.purge(0);
      await store.purgeExpired();
      await store.get("k");
      await store.delete("k");
      target = listed;
      for (const journal of [backend.inbox, backend.outbox] as const) {
        const list = journal.list.bind(journal) as (options?: object) => Promise<unknown[]>;
        await list();
        await list({ limit: 5 });
        await list({ chatId: "c1" });
        await list({ state: "failed" });
        await list({ state: ["failed", "dead"] });
        await list({ state: ["failed", "dead", "done", "sent"], limit: 3 });
        await list({ chatId: "c1", state: "failed" });
        await list({ chatId: "c1", state: ["failed", "dead"] });
      }
      target = prepared;
      // Damaged rows: set aside when met, listed and reported.
      const raw = new Database(file);
      raw.exec(`UPDATE botmesh_inbox SET payload = '{' WHERE id = 'm1'`);
      raw.exec(`UPDATE botmesh_outbox SET content = '{' WHERE key = 'k2'`);
      raw.close();
      // A leased admit behind m1 (processing under another incarnation) meets it damaged: set aside, it does not count.
      expect((await backend.inbox.admit(inbound("m3"), a))?.state).toBe("processing");
      expect((await backend.inbox.list()).map((r) => r.id)).toEqual(["m2", "m3"]);
      await backend.outbox.list();
      for (const journal of [backend.inbox, backend.outbox]) {
        expect(await journal.damaged()).toHaveLength(1);
        await journal.damaged({ unreported: true });
        await journal.reportDamaged("m1");
        await journal.reportDamaged("seq:1");
      }
    } finally {
      Database.prototype.prepare = original;
      await backend.close();
      await store.close();
    }
    const raw = new Database(file);
    const journal = (sql: string) => /botmesh_(inbox|outbox|session)\b/.test(sql);
    const statements = [...new Set(prepared)].filter(journal);
    const lists = [...new Set(listed)].filter(journal);
    expect(statements.length).toBeGreaterThan(15);
    expect(lists.length).toBeGreaterThanOrEqual(8);
    const scans: string[] = [];
    for (const sql of [...statements, ...lists]) {
      const plan = raw.prepare(`EXPLAIN QUERY PLAN ${sql}`).all() as { detail: string }[];
      const isList = lists.includes(sql);
      const flat = sql.replace(/\s+/g, " ");
      for (const { detail } of plan) {
        // An unfiltered list walks an index (or the outbox's primary key) in its order and stops at the limit
        // (skipping the rows set aside as damaged).
        const orderedWalk = (isList && / WHERE set_aside_seq IS NULL ORDER BY /.test(flat) &&
          /^SCAN botmesh_(inbox USING INDEX botmesh_inbox_received|outbox)$/.test(detail)) ||
          // The unreported damaged rows: a partial index of just those, walked in order up to the limit.
          /^SCAN botmesh_(inbox|outbox) USING INDEX botmesh_(inbox|outbox)_unreported$/.test(detail);
        if (/^SCAN botmesh_(inbox|outbox|session)\b/.test(detail) && !orderedWalk) scans.push(`${detail} in: ${flat}`);
        if (isList && /TEMP B-TREE/.test(detail)) scans.push(`${detail} in: ${flat}`);
      }
    }
    raw.close();
    expect(scans).toEqual([]);
  });
});

// A measurement, not a check: `SQLITE_BENCH=1 bun test tests/sqlite_backend.test.ts -t "1M rows"`.
describe("sqlite: 1M rows (SQLITE_BENCH=1)", () => {
  test.skipIf(!process.env.SQLITE_BENCH)("claimDue, purge and write throughput at a million rows", async () => {
    const file = tempFile();
    const seed = new SQLiteDurability({ file });
    await seed.open();
    await seed.close();
    const now = Date.now();
    const day = 86_400_000;
    const raw = new Database(file);
    raw.exec("PRAGMA journal_mode = WAL");
    let t = performance.now();
    raw.exec(`
      BEGIN;
      WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000)
      INSERT INTO botmesh_inbox (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at)
        SELECT 'done-' || i, 'message', 'chat-' || (i % 5000), 'test', '{"text":"hello ✓"}', ${now - 10 * day} + i,
          'done', 1, 1, ${now - 10 * day} + i * ${Math.floor((10 * day) / 1_000_000)} FROM n;
      WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 1000000)
      INSERT INTO botmesh_outbox (key, chat_id, content, content_hash, state, attempts, fence, message_id, created_at, updated_at)
        SELECT 'sent-' || i, 'chat-' || (i % 5000), '{"text":"reply ✓"}', 'h', 'sent', 1, 1, 'msg-' || i,
          ${now - 10 * day} + i, ${now - 10 * day} + i * ${Math.floor((10 * day) / 1_000_000)} FROM n;
      COMMIT;`);
    const fillMs = performance.now() - t;
    raw.close();
    const time = async <T>(what: string, run: () => Promise<T>): Promise<T> => {
      const start = performance.now();
      const result = await run();
      console.log(`  ${what}: ${(performance.now() - start).toFixed(2)} ms`);
      return result;
    };
    console.log(`1M done inbox records + 1M sent outbox entries filled in ${fillMs.toFixed(0)} ms`);
    // The page check at open (checkOnOpen, the default) reads the whole file.
    const mb = (statSync(file).size / 1e6).toFixed(0);
    for (const checkOnOpen of [false, true]) {
      const probe = new SQLiteDurability({ file, checkOnOpen });
      await time(`open with checkOnOpen: ${checkOnOpen} (${mb} MB file)`, () => probe.open());
      await probe.close();
    }
    const b = new SQLiteDurability({ file });
    await b.open();
    await time("inbox.claimDue, nothing due", () => b.inbox.claimDue({ ...lease("A"), limit: 100, reclaimOwn: true }));
    await time("outbox.claimDue, nothing due", () => b.outbox.claimDue({ ...lease("A"), limit: 100, reclaimOwn: true }));
    for (let i = 0; i < 1000; i++) await b.inbox.admit(inbound(`p${i}`, { receivedAt: now + i }));
    for (let i = 0; i < 1000; i++) await b.outbox.reserve(outbound(`q${i}`, `hot-${i % 50}`));
    const claimed = await time("inbox.claimDue limit 100 of 1000 pending", () => b.inbox.claimDue({ ...lease("A"), limit: 100 }));
    expect(claimed.length).toBe(100);
    const due = await time(
      "outbox.claimDue limit 100 (1000 queued in 50 chats)",
      () => b.outbox.claimDue({ ...lease("A"), limit: 100 }),
    );
    expect(due.due.length).toBe(50);
    // Lists at 1M rows: each should read about `limit` rows (schema version 3).
    await time("inbox.list() limit 100", () => b.inbox.list());
    await time("inbox.list({ chatId }) limit 100", () => b.inbox.list({ chatId: "chat-7" }));
    await time("inbox.list({ state: ['done', 'dead'] }) limit 100", () => b.inbox.list({ state: ["done", "dead"] }));
    await time("inbox.list({ chatId, state: 'done' }) limit 100", () => b.inbox.list({ chatId: "chat-7", state: "done" }));
    await time("outbox.list({ chatId }) limit 100", () => b.outbox.list({ chatId: "chat-7" }));
    await time("outbox.list({ state: ['sent', 'dead'] }) limit 100", () => b.outbox.list({ state: ["sent", "dead"] }));
    await time("inbox.purge, nothing old enough", () => b.inbox.purge(30 * day));
    const purgedIn = await time("inbox.purge of 10k done records", () => b.inbox.purge(10 * day - 10 * day / 100));
    const purgedOut = await time("outbox.purge of 10k sent entries", () => b.outbox.purge(10 * day - 10 * day / 100));
    console.log(`  (purged ${purgedIn} + ${purgedOut})`);
    const rate = async (what: string, n: number, run: (i: number) => Promise<unknown>) => {
      const start = performance.now();
      for (let i = 0; i < n; i++) await run(i);
      const ms = performance.now() - start;
      console.log(`  ${what}: ${Math.round((n / ms) * 1000)}/s`);
    };
    await rate("admit (synchronous=FULL)", 2000, (i) => b.inbox.admit(inbound(`r${i}`)));
    await rate("reserve+markSent (FULL)", 1000, async (i) => {
      const r = await b.outbox.reserve(outbound(`w${i}`, `w${i}`), lease("A"));
      await b.outbox.markSent(`w${i}`, r.entry.lease!.token, "m");
    });
    await b.close();
    const fast = new SQLiteDurability({ file, synchronous: "normal" });
    await fast.open();
    await rate("admit (synchronous=NORMAL)", 2000, (i) => fast.inbox.admit(inbound(`s${i}`)));
    await rate("reserve+markSent (NORMAL)", 1000, async (i) => {
      const r = await fast.outbox.reserve(outbound(`x${i}`, `x${i}`), lease("A"));
      await fast.outbox.markSent(`x${i}`, r.entry.lease!.token, "m");
    });
    await fast.close();

    // A pending backlog of 200k: claimDue reads it in receipt order from the due index instead of sorting it.
    const backlog = new Database(file);
    backlog.exec(`
      WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 200000)
      INSERT INTO botmesh_inbox (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at, due_at)
        SELECT 'backlog-' || i, 'message', 'chat-' || (i % 5000), 'test', '{}', ${now} - i, 'pending', 0, 0, ${now}, 0 FROM n;`);
    backlog.close();
    const c = new SQLiteDurability({ file });
    await c.open();
    await time("inbox.claimDue limit 100 of a 200k pending backlog", () => c.inbox.claimDue({ ...lease("B"), limit: 100 }));
    await c.close();
  }, 600_000);
});

describe("sqlite: file modes", () => {
  /** The mode of each file in `where`, as `name 600`. */
  const modes = (where: string): string[] =>
    readdirSync(where).sort().map((f) => `${f} ${(statSync(join(where, f)).mode & 0o777).toString(8)}`);

  test("a new journal, its -wal and -shm are 0600, named by a path or by a file: URI of a local path", async () => {
    const names = [
      (d: string) => join(d, "bot.db"),
      (d: string) => `file:${join(d, "bot.db")}?mode=rwc`,
      (d: string) => `file://localhost${encodeURI(join(d, "bot.db"))}`,
    ];
    for (const name of names) {
      const where = join(dir, `modes-${crypto.randomUUID()}`);
      mkdirSync(where, { recursive: true });
      const backend = new SQLiteDurability({ file: name(where) });
      await backend.open();
      const store = new SQLiteStore({ file: name(where).replace("bot.db", "store.db") });
      await store.set("chat:1", { secret: "x" });
      try {
        expect(modes(where), name(where)).toEqual(
          ["bot.db 600", "bot.db-shm 600", "bot.db-wal 600", "store.db 600", "store.db-shm 600", "store.db-wal 600"],
        );
      } finally {
        await backend.close();
        await store.close();
      }
    }
  });

  test("the file a name creates: a path, the path of a local file: URI; none for a database in memory or opened without creating", () => {
    expect(createdSqlitePath("/data/bot.db")).toBe("/data/bot.db");
    expect(createdSqlitePath("data/bot.db")).toBe("data/bot.db");
    expect(createdSqlitePath("file:/data/bot.db?mode=rwc&cache=shared")).toBe("/data/bot.db");
    expect(createdSqlitePath("file:///data/my%20bot.db#x")).toBe("/data/my bot.db");
    expect(createdSqlitePath("file://localhost/data/bot.db")).toBe("/data/bot.db");
    expect(createdSqlitePath("file:bot.db")).toBe("bot.db");
    for (const none of [":memory:", "", "file::memory:", "file:/data/bot.db?mode=memory", "file:/data/bot.db?mode=ro", "file://host/data/bot.db", "file:?mode=rwc"]) {
      expect(createdSqlitePath(none), none).toBeNull();
    }
  });

  test("a file: URI of a database in memory creates no file", async () => {
    const where = join(dir, `modes-${crypto.randomUUID()}`);
    mkdirSync(where, { recursive: true });
    const backend = new SQLiteDurability({ file: `file:${join(where, "mem.db")}?mode=memory` });
    await backend.open();
    try {
      expect(modes(where)).toEqual([]);
    } finally {
      await backend.close();
    }
  });
});
