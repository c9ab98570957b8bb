import { afterAll, describe, expect, test } from "bun:test";
import net from "node:net";
import postgres from "postgres";
import { EventsDurability, MemoryEventJournal } from "../backends/events/mod.ts";
import { MemoryKv } from "../backends/memory/kv.ts";
import { PostgresDurability, PostgresKv, PostgresStore } from "../backends/postgres/mod.ts";
import { INBOX_FILLFACTOR, inboxSql, outboxSql, POSTGRES_SCHEMA_VERSION, tables } from "../backends/postgres/sql.ts";
import { TableStats } from "../backends/postgres/table_stats.ts";
import {
  type ClaimOptions,
  DamagedRecordError,
  type NewInboundRecord,
  type NewOutboxEntry,
  SCAN_ANSWER_KEEP_MS,
  StaleLeaseError,
} from "../src/contract.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";

const skip = await serviceSkip("postgres");
const it = skip ? test.skip : test;

type Sql = ReturnType<typeof postgres>;

const clients: Sql[] = [];
/** A client ended after the file. */
function client(options: Parameters<typeof postgres>[1] = {}): Sql {
  // Idle connections close after a second: the file's clients stay open until its end, and together would exceed max_connections.
  const sql = postgres(POSTGRES_URL, { max: 4, idle_timeout: 1, onnotice: () => {}, ...options });
  clients.push(sql);
  return sql;
}
/**
 * Runs `statement` in a transaction of a session of its own and keeps that transaction open (its locks
 * held) until the returned `release` is called; resolves once the statement ran.
 */
async function holdLocks(statement: string): Promise<{ release(): Promise<void> }> {
  const holder = client({ max: 1 });
  let end!: () => void;
  const ended = new Promise<void>((resolve) => end = resolve);
  let ran!: () => void;
  const running = new Promise<void>((resolve) => ran = resolve);
  const transaction = holder.begin(async (tx) => {
    await tx.unsafe(statement);
    ran();
    await ended;
  });
  await Promise.race([running, transaction]);
  return {
    async release() {
      end();
      await transaction;
    },
  };
}
const schemas: string[] = [];
/** A fresh schema name, dropped after the file. */
function freshSchema(): string {
  const schema = `bm_pgt_${runId()}`;
  schemas.push(schema);
  return schema;
}
/** A backend opened on a fresh schema, with its client and its tables' names. */
async function openFresh(): Promise<{ schema: string; sql: Sql; b: PostgresDurability; t: ReturnType<typeof tables> }> {
  const schema = freshSchema();
  const sql = client();
  const b = new PostgresDurability({ sql, schema });
  await b.open();
  return { schema, sql, b, t: tables(schema, "botmesh_") };
}
/** Roles a test created, dropped after the file. */
const roles: string[] = [];
afterAll(async () => {
  if (skip) return;
  const admin = postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
  for (const schema of schemas) await admin.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
  await Promise.all(clients.map((sql) => sql.end({ timeout: 1 })));
  clients.length = 0;
  for (const role of roles) await admin.unsafe(`DROP OWNED BY ${role}; DROP ROLE IF EXISTS ${role}`).simple();
  await admin.end();
  await Promise.all(clients.map((sql) => sql.end({ timeout: 1 })));
});

const lease = (owner = "owner-a", leaseMs = 60_000): ClaimOptions => ({ owner, incarnation: "inc-1", leaseMs });
const inbound = (id: string, chatId = "c1", payload: unknown = { text: "hi" }): NewInboundRecord => ({
  id,
  kind: "message",
  chatId,
  provider: "test",
  payload: payload as NewInboundRecord["payload"],
  receivedAt: 1_700_000_000_000,
});
const outbound = (key: string, chatId = "c1", content: unknown = { text: "hello" }): NewOutboxEntry => ({
  key,
  chatId,
  content: content as NewOutboxEntry["content"],
  contentHash: "h",
  inboundId: null,
});

async function messageOf(run: () => unknown): Promise<{ error: Error; message: string }> {
  try {
    await run();
  } catch (error) {
    return { error: error as Error, message: (error as Error).message };
  }
  throw new Error("expected an error, but the call succeeded");
}

describe("PostgresDurability options", () => {
  const sql = { unsafe: () => Promise.resolve([]) };
  test("are checked, naming the option and quoting the value", async () => {
    const cases: [unknown, string, typeof TypeError | typeof RangeError][] = [
      [undefined, `Postgres options must be an object`, TypeError],
      [{}, `"sql" must be a postgres (porsager) client`, TypeError],
      [{ sql: { query: () => {} } }, `"sql" must be a postgres (porsager) client`, TypeError],
      [{ sql, schema: 5 }, `"schema" must be a string, got 5`, TypeError],
      [{ sql, schema: "Bots" }, `"schema" must match ^[a-z_][a-z0-9_]*$ (lowercase letters, digits, "_"; at most 63), got "Bots"`, RangeError],
      [{ sql, schema: 'a"; drop table x; --' }, `"schema" must match`, RangeError],
      [{ sql, schema: "x".repeat(64) }, `"schema" must match`, RangeError],
      [{ sql, tablePrefix: "" }, `"tablePrefix" must match ^[a-z_][a-z0-9_]*$`, RangeError],
      [{ sql, tablePrefix: "my-bot_" }, `got "my-bot_"`, RangeError],
      [{ sql, tablePrefix: "p".repeat(41) }, `"tablePrefix" must match`, RangeError],
      [{ sql, tablePrefix: 7 }, `"tablePrefix" must be a string, got 7`, TypeError],
      [{ sql, purgeBatchSize: "10" }, `"purgeBatchSize" must be a number, got "10"`, TypeError],
      [{ sql, purgeBatchSize: 0 }, `"purgeBatchSize" must be an integer from 1 to 100000, got 0`, RangeError],
      [{ sql, purgeBatchSize: 2.5 }, `got 2.5`, RangeError],
      [{ sql, url: "postgres://" }, `Unknown Postgres option "url"; known options are "sql", "schema", "tablePrefix", "purgeBatchSize"`, TypeError],
    ];
    for (const [options, text, kind] of cases) {
      for (const make of [
        (o: unknown) => new PostgresDurability(o as never),
        (o: unknown) => new PostgresStore(o as never),
        (o: unknown) => new PostgresKv(o as never),
      ]) {
        const { error, message } = await messageOf(() => make(options));
        expect(error instanceof kind, `${message} is a ${kind.name}`).toBe(true);
        expect(message).toContain(text);
      }
    }
    const ok = new PostgresDurability({ sql, schema: "bots_1", tablePrefix: "p".repeat(40), purgeBatchSize: 100_000 });
    expect([ok.name, ok.scope, ok.schema, ok.tablePrefix.length]).toEqual(["postgres", "shared", "bots_1", 40]);
    const defaults = new PostgresDurability({ sql });
    expect([defaults.schema, defaults.tablePrefix]).toEqual(["public", "botmesh_"]);
  });
});

describe("PostgresDurability schema", () => {
  it("five backends starting together on a fresh schema set it up once, and all work", async () => {
    const schema = freshSchema();
    const backends = Array.from({ length: 5 }, () => new PostgresDurability({ sql: client(), schema }));
    await Promise.all(backends.map((b) => b.open()));
    const sql = client();
    const [meta] = await sql.unsafe(`SELECT value FROM "${schema}".botmesh_meta WHERE key = 'schema_version'`);
    expect(meta?.value).toBe(String(POSTGRES_SCHEMA_VERSION));
    const admitted = await Promise.all(backends.map((b, i) => b.inbox.admit(inbound(`m${i}`))));
    expect(admitted.every((r) => r !== null)).toBe(true);
    expect((await backends[0]!.inbox.list()).length).toBe(5);
    // A later start of a current schema changes nothing.
    await new PostgresDurability({ sql: client(), schema }).open();
    expect((await backends[4]!.inbox.list()).length).toBe(5);
  });

  it("the first call sets the schema up when open() was not called; two prefixes share a schema", async () => {
    const schema = freshSchema();
    const a = new PostgresDurability({ sql: client(), schema, tablePrefix: "a_" });
    const b = new PostgresDurability({ sql: client(), schema, tablePrefix: "b_" });
    await Promise.all([a.inbox.admit(inbound("x")), b.outbox.reserve(outbound("k"))]);
    expect(await a.inbox.get("x")).not.toBe(null);
    expect(await b.inbox.get("x")).toBe(null);
    expect((await b.outbox.get("k"))?.state).toBe("queued");
  });

  it("a schema written by a newer version is refused, naming both versions", async () => {
    const schema = freshSchema();
    await new PostgresDurability({ sql: client(), schema }).open();
    await client().unsafe(`UPDATE "${schema}".botmesh_meta SET value = '${POSTGRES_SCHEMA_VERSION + 98}'`);
    const later = new PostgresDurability({ sql: client(), schema });
    const { message } = await messageOf(() => later.open());
    expect(message).toContain(`schema "${schema}"`);
    expect(message).toContain(`schema version ${POSTGRES_SCHEMA_VERSION + 98}, written by a newer @botmesh/durable`);
    expect(message).toContain(`supports up to schema version ${POSTGRES_SCHEMA_VERSION}`);
    // Lazily too, and nothing was written.
    expect((await messageOf(() => later.inbox.admit(inbound("m")))).message).toContain("newer @botmesh/durable");
    expect((await client().unsafe(`SELECT count(*)::int AS n FROM "${schema}".botmesh_inbox`))[0]?.n).toBe(0);
  });

  it("a client that transforms column names is refused with a clear error", async () => {
    const b = new PostgresDurability({ sql: client({ transform: postgres.camel }), schema: freshSchema() });
    expect((await messageOf(() => b.open())).message).toContain(`transforms column names`);
  });

  it("driver errors name the operation and the table", async () => {
    const schema = freshSchema();
    const b = new PostgresDurability({ sql: client(), schema });
    await b.open();
    await client().unsafe(`DROP TABLE "${schema}".botmesh_inbox`);
    const { error, message } = await messageOf(() => b.inbox.get("m1"));
    expect(message).toContain(`Postgres inbox.get on "${schema}"."botmesh_inbox" failed:`);
    expect(message).toContain("does not exist");
    expect((error.cause as { code?: string }).code).toBe("42P01");
  });
});

describe("PostgresDurability statements", () => {
  it("due scans and purges read indexes, not the whole table (20k settled rows, ANALYZE)", async () => {
    const { sql, b, t } = await openFresh();
    await sql.unsafe(`
      INSERT INTO ${t.inbox} (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at, due_at)
        SELECT 'in' || g, 'message', 'chat' || (g % 500), 'p', '{}', g, CASE WHEN g % 100 = 0 THEN 'pending' ELSE 'done' END,
          1, 1, 1700000000000 + g, CASE WHEN g % 100 = 0 THEN 0 END
        FROM generate_series(1, 20000) g;
      INSERT INTO ${t.outbox} (key, chat_id, content, content_hash, state, attempts, next_attempt_at, fence, created_at, updated_at, due_at)
        SELECT 'out' || g, 'chat' || CASE WHEN g % 100 = 0 THEN g ELSE g % 500 END, '{}', 'h', CASE WHEN g % 100 = 0 THEN 'queued' ELSE 'sent' END,
          1, CASE WHEN g % 100 = 0 THEN 0 END, 1, 1700000000000 + g, 1700000000000 + g, CASE WHEN g % 100 = 0 THEN 0 END
        FROM generate_series(1, 20000) g;
      INSERT INTO ${t.chat} (chat_id, ver, touched_at) SELECT 'chat' || g, g, 1700000000000 FROM generate_series(0, 20000) g;
      ANALYZE ${t.inbox}; ANALYZE ${t.outbox}; ANALYZE ${t.chat};
    `);
    const inbox = inboxSql(t);
    const outbox = outboxSql(t);
    const claim = ["o", "i", 1000, 10];
    // Each statement, and the indexes its plan must read (the partial indexes of what a scan must look at).
    const statements: [string, string, unknown[], string[]][] = [
      ["inbox.claimDue", inbox.claimDue, claim, ["botmesh_inbox_due", "botmesh_inbox_pkey"]],
      ["inbox.claimDue reclaimOwn", inbox.claimDueReclaim, claim, ["botmesh_inbox_due"]],
      ["inbox.purge", inbox.purge, [1000, 1000], ["botmesh_inbox_done", "botmesh_inbox_pkey"]],
      ["outbox.claimDue", outbox.claimDue(false, false), claim, ["botmesh_outbox_due", "botmesh_outbox_chat_active"]],
      ["outbox.claimDue reclaimOwn resend", outbox.claimDue(true, true), claim, ["botmesh_outbox_due", "botmesh_outbox_chat_active"]],
      ["outbox.purge", outbox.purge, [1000, 1000], ["botmesh_outbox_sent", "botmesh_outbox_pkey"]],
      ["outbox.purge (chat rows)", outbox.purgeChats, [3_600_000, 1000], ["botmesh_outbox_chat_touched", "botmesh_outbox_chat_all"]],
      ["outbox.reserve", outbox.reserve, ["k", "chat1", "{}", "h", null, true, "o", "i", 1000, true], ["botmesh_outbox_chat_active"]],
      ["inbox.admit (leased)", inbox.admit, ["m", "message", "chat1", "p", "{}", 1700000020000, true, "o", "i", 1000], ["botmesh_inbox_chat_live"]],
      ["inbox.admit (several, leased)", inbox.admitMany, [JSON.stringify([1, 2].map((i) => ({
        i, id: `m${i}`, kind: "message", chat_id: `chat${i}`, provider: "p", payload: "{}", received_at: 1700000020000, leased: true,
        owner: "o", inc: "i", lease_ms: 1000,
      })))], ["botmesh_inbox_chat_live"]],
    ];
    for (const [name, text, params, indexes] of statements) {
      const plan = (await sql.unsafe(`EXPLAIN ${text}`, params as never[])).map((row) => row["QUERY PLAN"]).join("\n");
      expect(plan, `${name}:\n${plan}`).not.toMatch(/Seq Scan on botmesh_(inbox|outbox|outbox_chat)\b/);
      // Neither a walk of a whole table in some order: no index scan with only a filter on the big tables.
      expect(plan, `${name}:\n${plan}`).not.toMatch(/Index Scan using botmesh_(inbox_received|inbox_pkey|outbox_pkey) on \S+ \S+ +\(cost=[^)]*\)\n\s+Filter/);
      for (const index of indexes) expect(plan, `${name} reads ${index}:\n${plan}`).toContain(` ${index} `);
      if (process.env.SHOW_PLANS) console.log(`${name}:\n${plan}\n`);
    }
    // pg_stat_activity keeps the first 1 KB of a statement by default: an admission must show as one there.
    for (const text of [inbox.admit, inbox.admitMany]) expect(text.indexOf(`INSERT INTO ${t.inbox}`)).toBeLessThan(1000);
    // And they work on that data: the 200 pending records and 200 queued chat heads are due.
    expect((await b.inbox.claimDue({ ...lease(), limit: 1000 })).length).toBe(200);
    expect((await b.outbox.claimDue({ ...lease(), limit: 1000 })).due.length).toBe(200);
    expect(await b.inbox.purge(0)).toBe(19_800);
  });

  /** A backend on a fresh schema, autovacuum off, over `sql` (by default one session: its prepared statements, its plan cache). */
  async function oneSession(sql: Sql = client({ max: 1 })): Promise<{ sql: Sql; b: PostgresDurability; t: ReturnType<typeof tables> }> {
    const schema = freshSchema();
    const b = new PostgresDurability({ sql, schema });
    await b.open();
    const t = tables(schema, "botmesh_");
    await sql.unsafe(`ALTER TABLE ${t.inbox} SET (autovacuum_enabled = false); ALTER TABLE ${t.outbox} SET (autovacuum_enabled = false);
      ALTER TABLE ${t.chat} SET (autovacuum_enabled = false)`).simple();
    return { sql, b, t };
  }

  it("a reclaimed record's start stays on its page: a HOT update, no new entry in the inbox's indexes (its pages keep room)", async () => {
    // A pool, as a bot runs it (on one session 209 of 600 stay even with pages packed full, against 421
    // with the fillfactor: too close to tell apart).
    const { sql, b, t } = await oneSession(client());
    const dead = { owner: "w", incarnation: "dead", leaseMs: 3_600_000 };
    for (let i = 0; i < 600; i += 100) {
      await Promise.all(Array.from({ length: 100 }, (_, k) => b.inbox.admit(inbound(`m${i + k}`, `c${(i + k) % 10}`), dead)));
    }
    // A restart's recovery: the owner's next incarnation takes the records back, then starts each run.
    const claimed = await b.inbox.claimDue({ owner: "w", incarnation: "next", leaseMs: 60_000, reclaimOwn: true, limit: 1_000 });
    expect(claimed.length).toBe(600);
    const pages = async () =>
      new Map((await sql.unsafe(`SELECT id, (ctid::text::point)[0]::int AS page FROM ${t.inbox}`)).map((r) => [r.id as string, r.page as number]));
    const before = await pages();
    expect((await Promise.all(claimed.map((r) => b.inbox.start(r.id, r.lease!.token, 2)))).every(Boolean)).toBe(true);
    const after = await pages();
    const stayed = claimed.filter((r) => before.get(r.id) === after.get(r.id)).length;
    // 331 of 600 with the inbox's fillfactor (80), 12 with pages packed full
    expect(stayed, "starts on the record's own page").toBeGreaterThan(200);
  });

  it("the multi-row writes' kept plans read indexes, even plans made on empty tables (no Seq Scan as the tables grow)", async () => {
    const { sql, t } = await oneSession();
    const inbox = inboxSql(t), outbox = outboxSql(t);
    const statements: [string, string][] = [
      ["inbox.admitMany", inbox.admitMany],
      ["inbox.startMany", inbox.startMany],
      ["inbox.heartbeatMany", inbox.heartbeatMany],
      ["inbox.completeMany", inbox.completeMany],
      ["inbox.getMany", inbox.getMany],
      ["outbox.reserveMany", outbox.reserveMany],
      ["outbox.heartbeatMany", outbox.heartbeatMany],
      ["outbox.markCallingMany", outbox.markCallingMany],
      ["outbox.markSentMany", outbox.markSentMany],
      ["outbox.getMany", outbox.getMany],
      ["outbox.lockChats", outbox.lockChats],
    ];
    // (The due scans' plans follow the statistics, which the backend keeps in step: the test below.)
    // The plans the server keeps for prepared statements after a few runs (generic plans), made on the empty tables.
    await sql.unsafe(`SET plan_cache_mode = force_generic_plan`);
    const plan = async (i: number) => (await sql.unsafe(`EXPLAIN EXECUTE many_${i}('[]')`)).map((r) => r["QUERY PLAN"]).join("\n");
    for (const [i, [, text]] of statements.entries()) {
      await sql.unsafe(`PREPARE many_${i}(text) AS ${text}`);
      await plan(i);
    }
    // A burst: every table grows by 20k rows within autovacuum's naptime; the kept plans are the same.
    await sql.unsafe(`
      INSERT INTO ${t.inbox} (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at)
        SELECT 'd' || g, 'message', 'c' || g, 'p', '{}', g, 'done', 1, 1, 1 FROM generate_series(1, 20000) g;
      INSERT INTO ${t.outbox} (key, chat_id, content, content_hash, state, attempts, fence, created_at, updated_at)
        SELECT 's' || g, 'c' || g, '{}', 'h', 'sent', 1, 1, 1, 1 FROM generate_series(1, 20000) g;
      INSERT INTO ${t.chat} (chat_id, ver, touched_at) SELECT 'c' || g, g, 1 FROM generate_series(1, 20000) g;
    `).simple();
    const scanning: string[] = [];
    for (const [i, [name]] of statements.entries()) {
      const kept = await plan(i);
      if (/Seq Scan on botmesh_(inbox|outbox|outbox_chat)\b/.test(kept)) scanning.push(`${name}:\n${kept}`);
    }
    expect(scanning, scanning.join("\n\n")).toEqual([]);
    // The chat rows are locked in chat order (no deadlock between two groups): a probe per chat, driven by the sorted chat ids.
    const lock = statements.findIndex(([name]) => name === "outbox.lockChats");
    const [{ "QUERY PLAN": [{ Plan: top }] }] = await sql.unsafe(`EXPLAIN (FORMAT JSON) EXECUTE many_${lock}('[]')`) as never as [
      { "QUERY PLAN": [{ Plan: { "Node Type": string; Plans: { "Node Type": string; "Parent Relationship": string; "CTE Name"?: string }[] } }] },
    ];
    const outer = top.Plans.find((p) => p["Parent Relationship"] === "Outer");
    expect([top["Node Type"], outer?.["Node Type"], outer?.["CTE Name"]]).toEqual(["Nested Loop", "CTE Scan", "k"]);
    await sql.unsafe(`DEALLOCATE ALL; RESET plan_cache_mode`).simple();
  }, 40_000);

  it("a burst of writes that outgrows the statistics gets the tables analyzed, and cached plans follow (no Seq Scan)", async () => {
    const { sql, b, t } = await oneSession(); // (no autovacuum: every ANALYZE below is the backend's)
    // A statement whose plan follows the statistics (a lookup of several keys), kept as a generic plan made on the empty table.
    await sql.unsafe(`SET plan_cache_mode = force_generic_plan`);
    await sql.unsafe(`PREPARE by_keys(text[]) AS SELECT key FROM ${t.outbox} WHERE key = ANY($1)`);
    const plan = async () => (await sql.unsafe(`EXPLAIN EXECUTE by_keys('{k1,k2}')`)).map((r) => r["QUERY PLAN"]).join("\n");
    expect(await plan(), "made on an empty table: it reads the table").toMatch(/Seq Scan on botmesh_outbox\b/);
    // A burst: the table grows by 20k rows within autovacuum's naptime. The kept plan does not change with it.
    await sql.unsafe(`INSERT INTO ${t.outbox} (key, chat_id, content, content_hash, state, attempts, fence, created_at, updated_at)
      SELECT 's' || g, 'c' || (g % 100), '{}', 'h', 'sent', 1, 1, 1, 1 FROM generate_series(1, 20000) g`);
    await sql.unsafe(`SELECT pg_stat_force_next_flush()`);
    expect(await plan(), "the kept plan still reads the table").toMatch(/Seq Scan on botmesh_outbox\b/);
    const stats = new TableStats(sql, [t.inbox, t.outbox], () => b.open());
    let analyzed: string[] = [];
    for (const until = Date.now() + 15_000; analyzed.length === 0 && Date.now() < until;) {
      analyzed = await stats.analyzeStale(); // (the server's counters may lag behind the writes a moment)
      if (analyzed.length === 0) await new Promise((r) => setTimeout(r, 100));
    }
    expect(analyzed, "the outbox changed more than its rows at its last ANALYZE (never)").toEqual([t.outbox]);
    expect(await plan(), "planned again on the new statistics").not.toMatch(/Seq Scan on botmesh_outbox\b/);
    expect(await stats.analyzeStale(), "once analyzed, not again until it doubles").toEqual([]);
    await sql.unsafe(`DEALLOCATE by_keys; RESET plan_cache_mode`).simple();
  }, 40_000);

  /** A fresh schema (autovacuum off) whose inbox grew by 3,000 rows since its last ANALYZE (never), counted by the server. */
  async function grownInbox(sql: Sql): Promise<{ b: PostgresDurability; t: ReturnType<typeof tables> }> {
    const { b, t } = await oneSession(sql);
    await sql.begin(async (tx) => {
      await tx.unsafe(`INSERT INTO ${t.inbox} (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at)
        SELECT 'd' || g, 'message', 'c' || (g % 100), 'p', '{}', g, 'done', 1, 1, 1 FROM generate_series(1, 3000) g`);
      await tx.unsafe(`SELECT pg_stat_force_next_flush()`);
    });
    return { b, t };
  }
  const lastAnalyze = async (sql: Sql, table: string) =>
    (await sql.unsafe(`SELECT pg_stat_get_last_analyze_time(to_regclass($1)) AS at`, [table]))[0]!.at;

  it("each journal's claim scan has a grown table analyzed, in the background", async () => {
    const sql = client();
    for (const journal of ["inbox", "outbox"] as const) {
      const { b, t } = await grownInbox(sql);
      expect(await lastAnalyze(sql, t.inbox)).toBe(null);
      for (const until = Date.now() + 15_000; await lastAnalyze(sql, t.inbox) === null && Date.now() < until;) {
        await b[journal].claimDue({ ...lease(), limit: 1 });
        await new Promise((r) => setTimeout(r, 100));
      }
      expect(await lastAnalyze(sql, t.inbox), `${journal}.claimDue had the grown inbox analyzed`).not.toBe(null);
    }
  }, 40_000);

  it("a grown table is not analyzed by a role that does not own it, nor while a lock ANALYZE would wait for is held; no warning either way", async () => {
    const sql = client();
    const { t } = await grownInbox(sql);
    const role = `bm_pgt_role_${runId()}`;
    roles.push(role);
    await sql.unsafe(`CREATE ROLE ${role} LOGIN; GRANT USAGE ON SCHEMA "${t.schema}" TO ${role};
      GRANT ALL ON ALL TABLES IN SCHEMA "${t.schema}" TO ${role}`).simple();
    const notices: string[] = [];
    const onnotice = (n: { message?: string }) => void notices.push(String(n.message));
    const other = client({ username: role, onnotice });
    expect(await new TableStats(other, [t.inbox, t.outbox], async () => {}).analyzeStale(), "not its owner").toEqual([]);
    expect(await lastAnalyze(sql, t.inbox)).toBe(null);
    // The owner, while another session holds a lock that ANALYZE would wait for (as a VACUUM does).
    const owner = client({ onnotice });
    const lock = await holdLocks(`LOCK TABLE ${t.inbox} IN SHARE UPDATE EXCLUSIVE MODE`);
    const stats = new TableStats(owner, [t.inbox, t.outbox], async () => {});
    try {
      expect(await stats.analyzeStale(), "locked").toEqual([]);
    } finally {
      await lock.release();
    }
    expect(await stats.analyzeStale(), "the lock released").toEqual([t.inbox]);
    expect(await lastAnalyze(sql, t.inbox)).not.toBe(null);
    expect(notices).toEqual([]);
  }, 40_000);

  it("times come from the server clock, not the replica's Date.now()", async () => {
    const sql = client();
    const b = new PostgresDurability({ sql, schema: freshSchema() });
    const kv = new PostgresKv({ sql, schema: b.schema });
    await b.open();
    const realNow = Date.now;
    const skew = 3_600_000;
    Date.now = () => realNow() + skew; // this replica's clock is an hour ahead
    try {
      const before = realNow();
      const r = await b.inbox.admit(inbound("m1"), lease("a", 200));
      const e = await b.outbox.reserve(outbound("k1"), lease("a", 200));
      expect(await b.outbox.markCalling("k1", 1, 200), "its call announced: a lapse is ambiguous").toBe(true);
      const serverNow = await kv.now();
      const after = realNow();
      for (const t of [r!.updatedAt, e.entry.updatedAt, e.entry.createdAt, serverNow]) {
        expect(t).toBeGreaterThanOrEqual(before - 1_000);
        expect(t).toBeLessThanOrEqual(after + 1_000);
      }
      expect(r!.lease!.expiresAt - r!.updatedAt).toBe(200);
      // The lease lapses by the server clock: not yet due, then due 200 ms later (the skewed clock plays no part).
      expect(await b.inbox.claim("m1", lease("b"))).toBe(null);
      expect((await b.outbox.claimDue({ ...lease("b"), limit: 10 })).ambiguous).toEqual([]);
      await new Promise((resolve) => setTimeout(resolve, 300));
      expect((await b.inbox.claim("m1", lease("b")))?.lease?.token).toBe(2);
      expect((await b.outbox.claimDue({ ...lease("b"), limit: 10 })).ambiguous.map((x) => x.key)).toEqual(["k1"]);
    } finally {
      Date.now = realNow;
    }
  });

  it("a damaged row is set aside by the read that meets it, naming the row and the column; other rows stay readable", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    await b.open();
    for (const id of ["good", "bad-json", "bad-state", "bad-lease", "bad-kind"]) await b.inbox.admit(inbound(id));
    for (const key of ["good", "bad-json", "bad-attempts", "bad-fence"]) await b.outbox.reserve(outbound(key, key));
    await sql.unsafe(`UPDATE "${schema}".botmesh_inbox SET payload = '{"text": "hi"' WHERE id = 'bad-json'`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_inbox SET state = 'sleeping' WHERE id = 'bad-state'`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_inbox SET state = 'processing' WHERE id = 'bad-lease'`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_inbox SET kind = 'letter' WHERE id = 'bad-kind'`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_outbox SET content = 'not json' WHERE key = 'bad-json'`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_outbox SET attempts = -3 WHERE key = 'bad-attempts'`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_outbox SET state = 'sending', lease_owner = 'o', lease_incarnation = 'i', lease_token = 7,
      lease_expires_at = 1, fence = 1 WHERE key = 'bad-fence'`);
    const before = await sql.unsafe(`SELECT * FROM "${schema}".botmesh_inbox ORDER BY ord`);
    const cases: [() => Promise<unknown>, string, string, string[]][] = [
      [() => b.inbox.get("bad-json"), "inbox", "bad-json", ["column payload is not valid JSON"]],
      [() => b.inbox.get("bad-state"), "inbox", "bad-state", [`column state must be one of`, `"sleeping"`]],
      [() => b.inbox.get("bad-lease"), "inbox", "bad-lease", [`column lease_* must be a lease object in state "processing"`]],
      [() => b.outbox.get("bad-json"), "outbox", "bad-json", ["column content is not valid JSON"]],
      [() => b.outbox.get("bad-attempts"), "outbox", "bad-attempts", [`column attempts must be a non-negative integer, got -3`]],
      [() => b.outbox.reserve(outbound("bad-attempts", "bad-attempts")), "outbox", "bad-attempts", [`column attempts`]],
      [() => b.outbox.get("bad-fence"), "outbox", "bad-fence", [`column fence (1) is below the lease token 7`]],
    ];
    for (const [run, journal, id, parts] of cases) {
      const { error, message } = await messageOf(run);
      expect(error instanceof DamagedRecordError, message).toBe(true);
      expect([(error as DamagedRecordError).journal, (error as DamagedRecordError).id, (error as DamagedRecordError).backend]).toEqual([journal, id, "postgres"]);
      for (const part of parts) expect((error as DamagedRecordError).problem).toContain(part);
      expect(message).toContain(id);
    }
    // list sets aside the one left (bad-kind), returns the rest.
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["good"]);
    expect((await b.inbox.damaged()).map((d) => [d.id, d.problem.split(/ must| is not/)[0], d.reported]), "in the order set aside").toEqual([
      ["bad-json", "column payload", false],
      ["bad-state", "column state", false],
      ["bad-lease", "column lease_*", false],
      ["bad-kind", "column kind", false],
    ]);
    expect((await b.outbox.list()).map((e) => e.key)).toEqual(["good"]);
    // Kept as stored: only the set-aside columns and the due mark changed.
    const after = await sql.unsafe(`SELECT * FROM "${schema}".botmesh_inbox ORDER BY ord`);
    const stored = (row: Record<string, unknown>) => {
      const { damage: _d, set_aside_at: _a, set_aside_seq: _s, damage_reported: _r, due_at: _due, ...rest } = row;
      return rest;
    };
    expect(after.map(stored)).toEqual(before.map(stored));
    expect(after.map((r) => [r.id, r.set_aside_seq === null, r.damage_reported])).toEqual([
      ["good", true, null],
      ["bad-json", false, false],
      ["bad-state", false, false],
      ["bad-lease", false, false],
      ["bad-kind", false, false],
    ]);
    expect((await b.inbox.get("good"))?.payload).toEqual({ text: "hi" });
    expect((await b.outbox.get("good"))?.content).toEqual({ text: "hello" });
    expect((await b.inbox.claim("good", lease()))?.state).toBe("processing");

    const store = new PostgresStore({ sql, schema });
    await store.set("s", { ok: true });
    await store.set("t", 1);
    await sql.unsafe(`UPDATE "${schema}".botmesh_session SET value = '{' WHERE key = 's'`);
    expect((await messageOf(() => store.get("s"))).message).toContain(`"${schema}"."botmesh_session", row key "s": column value is not valid JSON`);
    expect(await store.get("t")).toBe(1);
  });
});

describe("PostgresStore", () => {
  it("get/set/delete with a TTL measured by the server; purgeExpired; durability() on the same schema", async () => {
    const sql = client();
    const schema = freshSchema();
    const store = new PostgresStore({ sql, schema, tablePrefix: "app_", purgeBatchSize: 2 });
    expect(await store.get("missing")).toBe(undefined);
    const tricky = { "": "empty key", big: 1e21, text: "ünï ✓ 🎉 \u0000 \ud800", list: [1, { a: null }], nested: { b: 2, a: 1 } };
    await store.set("forever", tricky);
    expect(await store.get("forever")).toEqual(tricky);
    expect(Object.keys((await store.get("forever")) as object), "key order kept").toEqual(Object.keys(tricky));
    const realNow = Date.now;
    Date.now = () => realNow() - 3_600_000; // the replica's clock is an hour behind: TTLs do not care
    try {
      for (const key of ["a", "b", "c", "d", "e"]) await store.set(key, key, { ttlMs: 150 });
      expect(await store.get("a")).toBe("a");
      await new Promise((resolve) => setTimeout(resolve, 250));
      expect(await store.get("a")).toBe(undefined);
    } finally {
      Date.now = realNow;
    }
    expect(await store.purgeExpired(), "in batches of 2").toBe(5);
    expect((await sql.unsafe(`SELECT key FROM "${schema}".app_session ORDER BY key`)).map((r) => r.key)).toEqual(["forever"]);
    await store.set("forever", 2, { ttlMs: 60_000 });
    expect(await store.get("forever")).toBe(2);
    await store.delete("forever");
    expect(await store.get("forever")).toBe(undefined);
    await expect(store.set("x", 1, { ttlMs: 0 })).rejects.toThrow(`Option "ttlMs" must be a positive number, got 0`);
    await expect(store.set("x", 10n as never)).rejects.toThrow(`Session value of "x" is not JSON`);

    const backend = store.durability();
    expect(store.durability()).toBe(backend);
    expect([backend.schema, backend.tablePrefix]).toEqual([schema, "app_"]);
    await backend.inbox.admit(inbound("m1"));
    expect((await sql.unsafe(`SELECT id FROM "${schema}".app_inbox`)).map((r) => r.id)).toEqual(["m1"]);
  });
});

describe("PostgresKv", () => {
  it("compare-and-set, versions never reused (also after a delete), server clock", async () => {
    const kv = new PostgresKv({ sql: client(), schema: freshSchema() });
    expect([kv.name, kv.scope]).toEqual(["postgres", "shared"]);
    expect(await kv.get("a")).toBe(null);
    const v1 = await kv.set("a", { n: 1 }, null);
    expect(typeof v1).toBe("string");
    expect(await kv.set("a", { n: 9 }, null), "must not exist").toBe(null);
    const v2 = await kv.set("a", { n: 2 }, v1);
    expect(v2).not.toBe(v1);
    expect(await kv.set("a", { n: 3 }, v1), "stale version").toBe(null);
    expect(await kv.set("a", { n: 3 }, "not-a-version")).toBe(null);
    expect(await kv.get("a")).toEqual({ key: "a", value: { n: 2 }, version: v2! });
    const v3 = await kv.set("a", [1, "x"]);
    expect(await kv.delete("a", v2!), "stale delete").toBe(false);
    expect(await kv.delete("a", "junk")).toBe(false);
    expect(await kv.delete("a", v3!)).toBe(true);
    expect(await kv.delete("a")).toBe(false);
    const v4 = await kv.set("a", 4, null);
    expect(new Set([v1, v2, v3, v4]).size, "never reused").toBe(4);
    expect(BigInt(v4!)).toBeGreaterThan(BigInt(v3!));
    expect(await kv.set("a", 5, v1), "an old version never matches again").toBe(null);
    await expect(kv.set("b", undefined as never)).rejects.toThrow(`is not JSON`);
    const now = await kv.now();
    expect(Math.abs(now - Date.now())).toBeLessThan(5_000);
    expect(Number.isInteger(now)).toBe(true);
  });

  it("list: by prefix in byte order, after and limit, like MemoryKv", async () => {
    const kv = new PostgresKv({ sql: client(), schema: freshSchema() });
    const mem = new MemoryKv();
    const keys = [
      "p/b", "p/B", "p/_", "p/%", "p/-x", "p/0", "p/~", "p/é", "p/z", "p/\uffff", "p/😀", "p/\u{10ffff}", "p/", "p0", "p",
      "q/a", "o/z", "p/a/1", "p/a/2", "p/a%", "p/a_",
    ];
    for (const key of keys) {
      await kv.set(key, key);
      await mem.set(key, key);
    }
    const both = async (prefix: string, options?: { after?: string; limit?: number }) => {
      const got = (await kv.list(prefix, options)).map((e) => e.key);
      expect(got, `${prefix} ${JSON.stringify(options)}`).toEqual((await mem.list(prefix, options)).map((e) => e.key));
      return got;
    };
    expect(await both("p/")).toEqual(["p/", "p/%", "p/-x", "p/0", "p/B", "p/_", "p/a%", "p/a/1", "p/a/2", "p/a_", "p/b", "p/z", "p/~", "p/é", "p/\uffff", "p/😀", "p/\u{10ffff}"]);
    await both("p/a");
    await both("p/a%");
    await both("p/a_");
    await both("");
    await both("p/\u{10ffff}");
    await both("p/", { limit: 3 });
    await both("p/", { after: "p/a/1", limit: 2 });
    await both("p/", { after: "p/é" });
    await both("p/", { after: "o" });
    await both("p/", { after: "zzz" });
    await both("p/", { limit: 0 });
    const paged: string[] = [];
    let after: string | undefined;
    for (;;) {
      const page = await kv.list("p/", after === undefined ? { limit: 4 } : { after, limit: 4 });
      if (page.length === 0) break;
      paged.push(...page.map((e) => e.key));
      after = page[page.length - 1]!.key;
    }
    expect(paged).toEqual(await both("p/"));
    expect((await kv.list("p/", { limit: 1 }))[0]?.value).toBe("p/");
  });

  it("is the shared outbox of EventsDurability: two journals, one outbox", async () => {
    const sql = client();
    const schema = freshSchema();
    const a = new EventsDurability({ journal: new MemoryEventJournal(), outbox: new PostgresKv({ sql, schema }) });
    const b = new EventsDurability({ journal: new MemoryEventJournal(), outbox: new PostgresKv({ sql: client(), schema }) });
    const first = await a.outbox.reserve(outbound("k1", "chat"), lease("a"));
    expect(first.status).toBe("leased");
    const second = await b.outbox.reserve(outbound("k2", "chat"), lease("b"));
    expect(second.status, "replica b sees replica a's send in the chat").toBe("queued");
    expect((await b.outbox.reserve(outbound("k1", "chat"))).status).toBe("exists");
    await a.outbox.markSent("k1", first.entry.lease!.token, "m1");
    const claim = await b.outbox.claimDue({ ...lease("b"), limit: 10 });
    expect(claim.due.map((e) => e.key)).toEqual(["k2"]);
    await b.outbox.markSent("k2", claim.due[0]!.lease!.token, "m2");
    expect((await a.outbox.list({ chatId: "chat" })).map((e) => [e.key, e.state, e.messageId])).toEqual([
      ["k1", "sent", "m1"],
      ["k2", "sent", "m2"],
    ]);
    // The inbox stays in each journal.
    await a.inbox.admit(inbound("m1"));
    expect(await b.inbox.get("m1")).toBe(null);
  });
});

describe("PostgresDurability fixes", () => {
  const sleep = (ms: number) => new Promise((resolve) => setTimeout(resolve, ms));

  it("a lapsed lease is taken back by its own incarnation (a claim whose reply was lost); a live one is not", async () => {
    const b = new PostgresDurability({ sql: client(), schema: freshSchema() });
    const me = lease("owner-s", 150);
    await b.inbox.admit(inbound("lost"), me);
    await b.inbox.admit(inbound("live"), { ...me, leaseMs: 60_000 });
    expect(await b.inbox.claim("lost", me), "not while live").toBe(null);
    expect((await b.inbox.claimDue({ ...me, limit: 10 })).map((r) => r.id)).toEqual([]);
    const sent = await b.outbox.reserve(outbound("k1", "cx"), me);
    expect(sent.status).toBe("leased");
    expect(await b.outbox.markCalling("k1", 1, 150)).toBe(true);
    const unsent = await b.outbox.reserve(outbound("k2", "cy"), me);
    expect(unsent.status).toBe("leased");
    await sleep(300);
    const due = await b.inbox.claimDue({ ...me, limit: 10 });
    expect(due.map((r) => [r.id, r.lease?.token])).toEqual([["lost", 2]]);
    const out = await b.outbox.claimDue({ ...me, limit: 10 });
    expect(out.ambiguous.map((e) => e.key), "the announced call").toEqual(["k1"]);
    expect(out.due.map((e) => [e.key, e.lease?.token, e.attempts, e.called]), "the unannounced one, leased again").toEqual([["k2", 2, 1, false]]);
    await b.inbox.fail("lost", 2, { error: "x", retryInMs: 0 });
    expect((await b.inbox.claim("lost", me))?.lease?.token, "claim too").toBe(3);
    expect((await b.inbox.get("live"))?.lease?.token).toBe(1);
  });

  it("a damaged row does not strand the rest of a claimed batch: it is set aside, its stored columns kept, the scan goes on", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    for (const id of ["m1", "m2", "m3"]) await b.inbox.admit(inbound(id, "c", { id }));
    for (const key of ["k1", "k2", "k3"]) await b.outbox.reserve(outbound(key, key === "k3" ? "k2" : key));
    await sql.unsafe(`UPDATE "${schema}".botmesh_inbox SET payload = '{bad' WHERE id = 'm2'`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_outbox SET content = '{bad' WHERE key = 'k2'`);
    const o = lease("w");
    expect((await b.inbox.claimDue({ ...o, limit: 10 })).map((r) => r.id)).toEqual(["m1", "m3"]);
    // k3 waited behind k2 (no due mark): the same call leases it once k2 is set aside.
    expect((await b.outbox.claimDue({ ...o, limit: 10 })).due.map((e) => e.key)).toEqual(["k1", "k3"]);
    const [m2] = await sql.unsafe(`SELECT state, payload, error, damage, set_aside_at, due_at FROM "${schema}".botmesh_inbox WHERE id = 'm2'`);
    expect([m2!.state, m2!.payload, m2!.error, m2!.due_at]).toEqual(["processing", "{bad", null, null]);
    expect(m2!.damage).toStartWith("column payload is not valid JSON");
    const [k2] = await sql.unsafe(`SELECT state, content, damage FROM "${schema}".botmesh_outbox WHERE key = 'k2'`);
    expect([k2!.state, k2!.content]).toEqual(["sending", "{bad"]);
    expect(k2!.damage).toStartWith("column content is not valid JSON");
    // The lease the scan took on them is stale; nothing is left for a later scan.
    const m2Token = Number((await sql.unsafe(`SELECT lease_token FROM "${schema}".botmesh_inbox WHERE id = 'm2'`))[0]!.lease_token);
    expect((await messageOf(() => b.inbox.complete("m2", m2Token))).error instanceof StaleLeaseError).toBe(true);
    await Bun.sleep(10);
    expect((await b.inbox.claimDue({ ...o, limit: 10, reclaimOwn: true, incarnation: "inc-2" })).map((r) => r.id)).toEqual(["m1", "m3"]);
    expect((await b.inbox.damaged()).map((d) => d.id)).toEqual(["m2"]);
    expect((await b.outbox.damaged()).map((d) => d.id)).toEqual(["k2"]);
  });

  it("a limited scan that meets damaged rows runs again for the rest; a page of list too", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    for (let i = 0; i < 6; i++) await b.inbox.admit({ ...inbound(`m${i}`, `c${i}`), receivedAt: 1_000 + i });
    for (let i = 0; i < 6; i++) await b.outbox.reserve(outbound(`k${i}`, "one"));
    await sql.unsafe(`UPDATE "${schema}".botmesh_inbox SET payload = '{bad' WHERE id IN ('m0', 'm1', 'm3')`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_outbox SET content = '{bad' WHERE key IN ('k0', 'k1', 'k2')`);
    expect((await b.inbox.list({ limit: 2 })).map((r) => r.id)).toEqual(["m2", "m4"]);
    expect((await b.inbox.claimDue({ ...lease("w"), limit: 2 })).map((r) => r.id)).toEqual(["m2", "m4"]);
    expect((await b.outbox.claimDue({ ...lease("w"), limit: 2 })).due.map((e) => e.key), "the chat's first readable entry").toEqual(["k3"]);
    expect((await b.inbox.damaged()).map((d) => d.id)).toEqual(["m0", "m1", "m3"]);
    expect((await b.outbox.damaged()).map((d) => d.id)).toEqual(["k0", "k1", "k2"]);
    expect((await b.inbox.damaged({ limit: 2 })).map((d) => d.id)).toEqual(["m0", "m1"]);
    expect(await b.inbox.damaged({ limit: 0 })).toEqual([]);
    for (const [bad, text] of [[{ limit: -1 }, `"limit" must be a non-negative integer`], [{ unreported: 1 }, `"unreported" must be a boolean`]] as const) {
      expect((await messageOf(() => b.inbox.damaged(bad as never))).message).toContain(`inbox.damaged: option ${text}`);
    }
  });

  it("a set-aside row is left alone: writes under its lease are stale, operator calls answer false, purge keeps it, its chat moves on", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    const other = lease("other");
    // Inbox: d processing under a live lease elsewhere would hold back its chat.
    const d = await b.inbox.admit(inbound("d", "c"), other);
    await b.inbox.admit({ ...inbound("after", "c"), receivedAt: 1_800_000_000_000 });
    const done = await b.inbox.admit(inbound("done", "x"), other);
    await b.inbox.complete("done", done!.lease!.token);
    expect((await b.inbox.claimDue({ ...lease("w"), limit: 10 })).map((r) => r.id), "held back by d").toEqual([]);
    // Outbox: s sending elsewhere, q queued behind it.
    const s = await b.outbox.reserve(outbound("s", "c"), other);
    await b.outbox.reserve(outbound("q", "c"));
    const sent = await b.outbox.reserve(outbound("sent", "y"), other);
    await b.outbox.markSent("sent", sent.entry.lease!.token, "m");
    await sql.unsafe(`UPDATE "${schema}".botmesh_inbox SET payload = '{bad' WHERE id IN ('d', 'done')`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_outbox SET content = '{bad' WHERE key IN ('s', 'sent')`);
    expect((await b.inbox.list()).map((r) => r.id)).toEqual(["after"]);
    expect((await b.outbox.list()).map((e) => e.key)).toEqual(["q"]);
    const token = d!.lease!.token;
    expect(await b.inbox.heartbeat("d", token, 60_000)).toBe(false);
    expect((await messageOf(() => b.inbox.complete("d", token))).error instanceof StaleLeaseError).toBe(true);
    expect((await messageOf(() => b.inbox.fail("d", token, { error: "x", dead: true }))).error instanceof StaleLeaseError).toBe(true);
    expect(await b.inbox.replay("d")).toBe(false);
    expect(await b.inbox.replay("done")).toBe(false);
    expect(await b.inbox.purge(-1_000_000)).toBe(0);
    expect(await b.inbox.claim("d", { ...other, incarnation: "other-2", reclaimOwn: true })).toBe(null);
    expect((await b.inbox.claimDue({ ...lease("w"), limit: 10 })).map((r) => r.id), "d holds its chat no more").toEqual(["after"]);
    const st = s.entry.lease!.token;
    expect(await b.outbox.heartbeat("s", st, 60_000)).toBe(false);
    expect(await b.outbox.markCalling("s", st, 60_000)).toBe(false);
    expect((await messageOf(() => b.outbox.markSent("s", st, "m"))).error instanceof StaleLeaseError).toBe(true);
    for (const outcome of [{ error: "x", retryInMs: 0 }, { error: "x", ambiguous: true as const }]) {
      expect((await messageOf(() => b.outbox.markFailed("s", st, outcome))).error instanceof StaleLeaseError).toBe(true);
    }
    expect(await b.outbox.retry("sent")).toBe(false);
    expect(await b.outbox.discard("sent")).toBe(false);
    expect(await b.outbox.purge(-1_000_000)).toBe(0);
    expect((await b.outbox.claimDue({ ...lease("w"), limit: 10 })).due.map((e) => e.key), "s holds its chat no more").toEqual(["q"]);
    expect((await b.outbox.reserve(outbound("q2", "c"), lease("w"))).status, "behind q, not s").toBe("queued");
    const rows = await sql.unsafe(`SELECT id, state, payload, lease_owner FROM "${schema}".botmesh_inbox WHERE id IN ('d', 'done') ORDER BY ord`);
    expect(rows.map((r) => [r.id, r.state, r.payload, r.lease_owner]), "kept as stored").toEqual([["d", "processing", "{bad", "other"], ["done", "done", "{bad", null]]);
    // Reported once, by one of several concurrent callers.
    const answers = await Promise.all(Array.from({ length: 6 }, () => b.outbox.reportDamaged("s")));
    expect(answers.filter((x) => x).length).toBe(1);
    expect((await b.outbox.damaged({ unreported: true })).map((e) => e.id)).toEqual(["sent"]);
    expect(await b.outbox.reportDamaged("q"), "not damaged").toBe(false);
  });

  it("of concurrent reads that meet a damaged row, one sets it aside; a set-aside applies to the version read only", async () => {
    const schema = freshSchema();
    const sql = client();
    const backends = Array.from({ length: 4 }, () => new PostgresDurability({ sql: client(), schema }));
    const b = backends[0]!;
    await b.inbox.admit(inbound("bad"));
    await b.outbox.reserve(outbound("bad"));
    await sql.unsafe(`UPDATE "${schema}".botmesh_inbox SET payload = '{bad' WHERE id = 'bad'`);
    await sql.unsafe(`UPDATE "${schema}".botmesh_outbox SET content = '{bad' WHERE key = 'bad'`);
    const reads = await Promise.allSettled(backends.flatMap((x) => [x.inbox.list(), x.outbox.list(), x.inbox.get("bad"), x.outbox.get("bad")]));
    expect(reads.filter((r) => r.status === "fulfilled").map((r) => (r as PromiseFulfilledResult<unknown>).value)).toEqual(Array(8).fill([]));
    expect(reads.filter((r) => r.status === "rejected").every((r) => (r as PromiseRejectedResult).reason instanceof DamagedRecordError)).toBe(true);
    const t = tables(schema, "botmesh_");
    expect([...(await b.inbox.damaged()), ...(await b.outbox.damaged())].map((d) => [d.journal, d.id])).toEqual([["inbox", "bad"], ["outbox", "bad"]]);
    // A stale version (the row changed since it was read) is not set aside.
    await b.inbox.admit(inbound("ok"));
    const [row] = await sql.unsafe(`SELECT ord, xmin::text AS xv FROM ${t.inbox} WHERE id = 'ok'`);
    await sql.unsafe(`UPDATE ${t.inbox} SET error = 'touched' WHERE id = 'ok'`);
    expect(await sql.unsafe(inboxSql(t).setAside, [String(row!.ord), row!.xv, "stale"])).toHaveLength(0);
    expect((await b.inbox.get("ok"))?.error).toBe("touched");
  });

  it("inbox.claimDue reads only what is due with a backlog of 200k done and 20k pending (Buffers)", async () => {
    const { sql, b, t } = await openFresh();
    await sql.unsafe(`INSERT INTO ${t.inbox} (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at, due_at)
      SELECT 'd' || g, 'message', 'c' || (g % 1000), 'p', '{}', g, 'done', 1, 1, 1, NULL FROM generate_series(1, 200000) g`);
    await sql.unsafe(`INSERT INTO ${t.inbox} (id, kind, chat_id, provider, payload, received_at, state, attempts, fence, updated_at, due_at)
      SELECT 'p' || g, 'message', 'c' || (g % 1000), 'p', '{}', 200000 + g, 'pending', 0, 0, 1, 0 FROM generate_series(1, 20000) g`);
    await sql.unsafe(`ANALYZE ${t.inbox}`);
    const q = inboxSql(t);
    for (const [name, text] of [["claimDue", q.claimDue], ["claimDue reclaimOwn", q.claimDueReclaim]] as const) {
      let plan = "";
      await sql.begin(async (tx) => {
        plan = (await tx.unsafe(`EXPLAIN (ANALYZE, BUFFERS) ${text}`, ["w", "i", 60_000, 100])).map((r) => r["QUERY PLAN"]).join("\n");
        throw new Error("rollback");
      }).catch(() => {});
      expect(plan, `${name}:\n${plan}`).not.toMatch(/Seq Scan on botmesh_inbox|botmesh_inbox_received/);
      // What the pick reads (the UPDATE's own index writes aside): about one buffer per due row, not the backlog.
      const pick = /Subquery Scan on pick[^\n]*\n\s*Buffers: shared hit=(\d+)(?: read=(\d+))?/.exec(plan);
      expect(pick, `${name}:\n${plan}`).not.toBe(null);
      const buffers = Number(pick![1]) + Number(pick![2] ?? 0);
      expect(buffers, `${name} reads ${buffers} buffers:\n${plan}`).toBeLessThan(500);
    }
    const started = performance.now();
    expect((await b.inbox.claimDue({ ...lease(), limit: 100 })).map((r) => r.id).slice(0, 2)).toEqual(["p1", "p2"]);
    expect(performance.now() - started).toBeLessThan(1000);
  }, 60_000);

  it("NUL: rejected in ids, chat ids, provider, key, owner, messageId (TypeError, nothing written); replaced in errors", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    const cases: [() => Promise<unknown>, string][] = [
      [() => b.inbox.admit(inbound("a\u0000b")), `field "id" must not contain NUL`],
      [() => b.inbox.admit(inbound("m", "c\u0000")), `Inbox record "m": field "chatId" must not contain NUL`],
      [() => b.inbox.admit({ ...inbound("m"), provider: "p\u0000" }), `field "provider" must not contain NUL`],
      [() => b.inbox.admit(inbound("m"), lease("o\u0000")), `option "owner" must not contain NUL`],
      [() => b.inbox.get("x\u0000"), `inbox.get: "id" must not contain NUL`],
      [() => b.outbox.reserve(outbound("k\u0000")), `field "key" must not contain NUL`],
      [() => b.outbox.reserve(outbound("k", "c\u0000")), `Outbox entry "k": field "chatId" must not contain NUL`],
      [() => b.outbox.list({ chatId: "c\u0000" }), `option "chatId" must not contain NUL`],
    ];
    for (const [run, text] of cases) {
      const { error, message } = await messageOf(run);
      expect(error instanceof TypeError, message).toBe(true);
      expect(message).toContain(text);
    }
    expect(await b.inbox.list()).toEqual([]);
    expect(await b.outbox.list()).toEqual([]);
    const r = await b.inbox.admit(inbound("m", "c", { s: "\u0000 in the payload" }), lease());
    expect((await b.inbox.get("m"))?.payload).toEqual({ s: "\u0000 in the payload" });
    await b.inbox.fail("m", r!.lease!.token, { error: "boom\u0000!", retryInMs: 0 });
    expect((await b.inbox.get("m"))?.error).toBe("boom\ufffd!");
    const e = await b.outbox.reserve(outbound("k"), lease());
    const bad = await messageOf(() => b.outbox.markSent("k", e.entry.lease!.token, "id\u0000"));
    expect(bad.error instanceof TypeError).toBe(true);
    expect(bad.message).toContain(`outbox.markSent: "messageId" must not contain NUL`);
    await b.outbox.markFailed("k", e.entry.lease!.token, { error: "\u0000", dead: true });
    expect(await b.outbox.get("k")).toMatchObject({ state: "dead", error: "\ufffd" });
  });
});

describe("PostgresDurability outbox due scan (chat heads only)", () => {
  /** Builds a chat "big" with an unsettled head and `tail` queued entries behind it, plus `sent` sent rows. */
  async function bigTail(sql: Sql, schema: string, b: PostgresDurability, tail: number, sent: number): Promise<void> {
    const t = tables(schema, "botmesh_");
    const head = await b.outbox.reserve(outbound("head", "big"), lease("w"));
    expect(head.status).toBe("leased");
    // Through the API: queued behind the head, with no due mark.
    for (let i = 0; i < 5; i++) expect((await b.outbox.reserve(outbound(`api${i}`, "big"))).entry.state).toBe("queued");
    await sql.unsafe(`INSERT INTO ${t.outbox} (key, chat_id, content, content_hash, state, attempts, fence, next_attempt_at, created_at, updated_at, due_at)
      SELECT 'q'||g, 'big', '1', 'h', 'queued', 0, 0, 1, 1, 1, NULL FROM generate_series(1, ${tail}) g`);
    await sql.unsafe(`INSERT INTO ${t.outbox} (key, chat_id, content, content_hash, state, attempts, fence, message_id, created_at, updated_at, due_at)
      SELECT 's'||g, 'c'||(g%1000), '1', 'h', 'sent', 1, 1, 'm', 1, 1, NULL FROM generate_series(1, ${sent}) g`);
    await sql.unsafe(`INSERT INTO ${t.chat} (chat_id, ver, prev, touched_at)
      SELECT 'c'||g, nextval('${t.chatVersion.replaceAll("'", "''")}'), NULL, 1 FROM generate_series(0, 999) g`);
    await sql.unsafe(`ANALYZE ${t.outbox}; ANALYZE ${t.chat}`).simple();
  }

  async function explain(sql: Sql, text: string, params: unknown[]): Promise<string[]> {
    let lines: string[] = [];
    await sql
      .begin(async (tx) => {
        const rows = await tx.unsafe(`EXPLAIN (ANALYZE, BUFFERS) ${text}`, params as never[]);
        lines = rows.map((r) => String(r["QUERY PLAN"]));
        throw new Error("rollback");
      })
      .catch(() => {});
    return lines;
  }

  it("claimDue with a 20k queued tail behind one unsettled head and 100k sent rows reads few buffers, no Seq Scan", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    await bigTail(sql, schema, b, 20_000, 100_000);
    const t = tables(schema, "botmesh_");
    const [marked] = await sql.unsafe(`SELECT count(*)::int AS n FROM ${t.outbox} WHERE chat_id = 'big' AND due_at IS NOT NULL`);
    expect(marked!.n, "only the head is in the due index").toBe(1);
    const o = outboxSql(t);
    for (const [reclaim, resend] of [[false, false], [true, false], [true, true]] as const) {
      const lines = await explain(sql, o.claimDue(reclaim, resend), ["w2", "i", 60_000, 100]);
      const plan = lines.join("\n");
      expect(plan).not.toContain("Seq Scan");
      // The sum over every node (nested nodes count again in their parents: an upper bound); planning left out.
      const end = lines.findIndex((l) => /^Planning/.test(l));
      const buffers = lines
        .slice(0, end < 0 ? lines.length : end)
        .filter((l) => /Buffers: shared/.test(l))
        .flatMap((l) => [...l.matchAll(/(hit|read|dirtied|written)=(\d+)/g)].map((m) => Number(m[2])))
        .reduce((s, x) => s + x, 0);
      console.log(`outbox claimDue reclaim=${reclaim} resend=${resend}: buffers (sum over nodes) ${buffers}`);
      expect(buffers, plan).toBeLessThan(500);
    }
    // The head settles: the next entry becomes due, then the one after it.
    const head = (await b.outbox.get("head"))!;
    await b.outbox.markSent("head", head.lease!.token, "m-head");
    const first = await b.outbox.claimDue({ ...lease("w"), limit: 10 });
    expect(first.due.map((e) => e.key)).toEqual(["api0"]);
    await b.outbox.markFailed("api0", first.due[0]!.lease!.token, { error: "x", dead: true });
    expect((await b.outbox.claimDue({ ...lease("w"), limit: 10 })).due.map((e) => e.key)).toEqual(["api1"]);
  }, 120_000);

  it("a version 1 schema is upgraded in place: tail due marks go, the head stays due", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    const t = tables(schema, "botmesh_");
    await b.outbox.reserve(outbound("h1", "x"), lease("w"));
    for (const key of ["t1", "t2", "t3"]) await b.outbox.reserve(outbound(key, "x"));
    await b.outbox.reserve(outbound("y1", "y"));
    // Back to version 1 by hand: no resync column, and every queued entry due-marked (as version 1 wrote them).
    await sql.unsafe(`ALTER TABLE ${t.chat} DROP COLUMN resync`);
    await sql.unsafe(`UPDATE ${t.outbox} SET due_at = next_attempt_at WHERE state = 'queued'`);
    await sql.unsafe(`UPDATE ${t.meta} SET value = '1' WHERE key = 'schema_version'`);
    const upgraded = new PostgresDurability({ sql: client(), schema });
    await upgraded.open();
    const [meta] = await sql.unsafe(`SELECT value FROM ${t.meta} WHERE key = 'schema_version'`);
    expect(meta?.value).toBe(String(POSTGRES_SCHEMA_VERSION));
    const marked = await sql.unsafe(`SELECT key FROM ${t.outbox} WHERE due_at IS NOT NULL ORDER BY seq`);
    expect(marked.map((r) => r.key)).toEqual(["h1", "y1"]);
    expect((await upgraded.outbox.claimDue({ ...lease("v"), limit: 10 })).due.map((e) => e.key)).toEqual(["y1"]);
    const h1 = (await upgraded.outbox.get("h1"))!;
    await upgraded.outbox.markSent("h1", h1.lease!.token, "m");
    expect((await upgraded.outbox.claimDue({ ...lease("v"), limit: 10 })).due.map((e) => e.key)).toEqual(["t1"]);
  });

  it("a version 2 schema (no called column) is upgraded in place: old rows read as called, a lapsed old send is ambiguous", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    const t = tables(schema, "botmesh_");
    await b.outbox.reserve(outbound("old-sending", "x"), lease("w", 150));
    await b.outbox.reserve(outbound("old-behind", "x"));
    await b.outbox.reserve(outbound("old-queued", "y"));
    const sent = await b.outbox.reserve(outbound("old-sent", "z"), lease("w"));
    await b.outbox.markSent("old-sent", sent.entry.lease!.token, "m-z");
    // Back to version 2 by hand: the outbox as version 2 created it, without the column.
    await sql.unsafe(`ALTER TABLE ${t.outbox} DROP COLUMN uncalled_fence`);
    await sql.unsafe(`UPDATE ${t.meta} SET value = '2' WHERE key = 'schema_version'`);
    const upgraded = new PostgresDurability({ sql: client(), schema });
    await upgraded.open();
    const [meta] = await sql.unsafe(`SELECT value FROM ${t.meta} WHERE key = 'schema_version'`);
    expect(meta?.value).toBe(String(POSTGRES_SCHEMA_VERSION));
    expect(POSTGRES_SCHEMA_VERSION).toBe(10);
    // Version 9: the indexes of leases by owner alone went (the lease-holder indexes of version 8 stay).
    const indexes = (await sql.unsafe(`SELECT indexname FROM pg_indexes WHERE schemaname = $1`, [schema])).map((r) => String(r.indexname));
    expect(indexes.filter((i) => /_owner$/.test(i)), "no index of leases by owner alone").toEqual([]);
    // Version 10: the inbox's pages keep room for the HOT updates of runs' starts.
    const [inboxOptions] = await sql.unsafe(`SELECT reloptions FROM pg_class WHERE oid = $1::regclass`, [t.inbox]);
    expect(inboxOptions?.reloptions, "the inbox's fillfactor").toEqual([`fillfactor=${INBOX_FILLFACTOR}`]);
    expect(indexes).toContain("botmesh_inbox_lease");
    const [column] = await sql.unsafe(
      `SELECT count(*)::int AS n FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'botmesh_outbox' AND column_name = 'uncalled_fence'`,
      [schema],
    );
    expect(column?.n, "the column was added").toBe(1);
    const before = await upgraded.outbox.list();
    expect(before.map((e) => [e.key, e.state, e.called]), "every old row reads as called").toEqual([
      ["old-sending", "sending", true],
      ["old-behind", "queued", true],
      ["old-queued", "queued", true],
      ["old-sent", "sent", true],
    ]);
    // The lapsed old send may have been called: ambiguous, as before the upgrade. A claim of an old row starts it uncalled.
    await Bun.sleep(300);
    const claim = await upgraded.outbox.claimDue({ ...lease("v"), limit: 10 });
    expect(claim.ambiguous.map((e) => [e.key, e.state, e.called])).toEqual([["old-sending", "unknown", true]]);
    expect(claim.due.map((e) => [e.key, e.called, e.attempts, e.fence])).toEqual([["old-queued", false, 1, 2]]);
    expect((await upgraded.outbox.get("old-queued"))?.called).toBe(false);
    // New writes carry the flag; a later open changes nothing.
    const fresh = await upgraded.outbox.reserve(outbound("new", "n"), lease("v"));
    expect([fresh.entry.called, (await upgraded.outbox.get("new"))?.called]).toEqual([false, false]);
    expect(await upgraded.outbox.markCalling("new", 1, 60_000)).toBe(true);
    expect((await upgraded.outbox.get("new"))?.called).toBe(true);
    await new PostgresDurability({ sql: client(), schema }).open();
    expect((await upgraded.outbox.get("old-sent"))?.called).toBe(true);
  });

  it("a version 4 schema (no set-aside columns) is upgraded in place: a row an older version made dead for its damage is set aside when met", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    const t = tables(schema, "botmesh_");
    await b.inbox.admit(inbound("good"));
    await b.inbox.admit(inbound("buried"));
    await b.outbox.reserve(outbound("k", "c"));
    // Back to version 4 by hand, with a row as version 4 left a damaged one: dead, its error naming the damage.
    for (const table of [t.inbox, t.outbox]) {
      await sql.unsafe(`ALTER TABLE ${table} DROP COLUMN damage, DROP COLUMN set_aside_at, DROP COLUMN set_aside_seq, DROP COLUMN damage_reported`);
    }
    await sql.unsafe(`DROP SEQUENCE ${t.asideSeq}`);
    await sql.unsafe(`UPDATE ${t.inbox} SET payload = '{bad', state = 'dead', due_at = NULL,
      error = 'Postgres table x, row id "buried": column payload is not valid JSON (the row is damaged)' WHERE id = 'buried'`);
    await sql.unsafe(`UPDATE ${t.meta} SET value = '4' WHERE key = 'schema_version'`);
    const upgraded = new PostgresDurability({ sql: client(), schema });
    await upgraded.open();
    const [meta] = await sql.unsafe(`SELECT value FROM ${t.meta} WHERE key = 'schema_version'`);
    expect(meta?.value).toBe(String(POSTGRES_SCHEMA_VERSION));
    const indexes = await sql.unsafe(`SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND (indexname LIKE '%aside' OR indexname LIKE '%unreported') ORDER BY 1`, [schema]);
    expect(indexes.map((r) => r.indexname)).toEqual(["botmesh_inbox_aside", "botmesh_inbox_unreported", "botmesh_outbox_aside", "botmesh_outbox_unreported"]);
    expect((await upgraded.inbox.list({ state: "dead" })).map((r) => r.id), "out of the dead letters").toEqual([]);
    expect((await upgraded.inbox.damaged()).map((d) => [d.id, d.reported])).toEqual([["buried", false]]);
    expect((await upgraded.inbox.claimDue({ ...lease("v"), limit: 10 })).map((r) => r.id)).toEqual(["good"]);
    expect((await upgraded.outbox.claimDue({ ...lease("v"), limit: 10 })).due.map((e) => e.key)).toEqual(["k"]);
  });

  it("a version 5 schema is upgraded in place: a timer armed as a failed record becomes scheduled, due when it was; a real failure stays failed", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    const t = tables(schema, "botmesh_");
    const timer = (await b.inbox.admit(inbound("m0:t1", "c1"), lease("a")))!;
    const soon = (await b.inbox.admit(inbound("m1:t1", "c2"), lease("a")))!;
    const failing = (await b.inbox.admit(inbound("m2", "c3"), lease("a")))!;
    await b.inbox.schedule(timer.id, timer.fence, 3_600_000);
    await b.inbox.schedule(soon.id, soon.fence, 0);
    await b.inbox.fail(failing.id, failing.fence, { error: "boom", retryInMs: 3_600_000 });
    const before = await b.inbox.get(timer.id);
    // Back to version 5 by hand: version 5 armed a timer as a failed record, and indexed the active
    // records of a chat (pending, processing, failed) under the old name.
    await sql.unsafe(`UPDATE ${t.inbox} SET state = 'failed', error = 'Not a failure: a timer, due at 2026-12-06T10:00:00.000Z'
      WHERE id IN ('m0:t1', 'm1:t1')`);
    await sql.unsafe(`DROP INDEX ${schema}.botmesh_inbox_chat_live`);
    await sql.unsafe(`CREATE INDEX botmesh_inbox_chat_active ON ${t.inbox} (chat_id, received_at, ord) WHERE state IN ('pending', 'processing', 'failed')`);
    await sql.unsafe(`UPDATE ${t.meta} SET value = '5' WHERE key = 'schema_version'`);
    expect((await b.inbox.get(timer.id))?.state).toBe("failed");
    const upgraded = new PostgresDurability({ sql: client(), schema });
    await upgraded.open();
    const [meta] = await sql.unsafe(`SELECT value FROM ${t.meta} WHERE key = 'schema_version'`);
    expect(meta?.value).toBe(String(POSTGRES_SCHEMA_VERSION));
    const indexes = await sql.unsafe(`SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = $1 AND indexname LIKE '%chat_%' AND tablename = 'botmesh_inbox'`, [schema]);
    expect(indexes.map((r) => r.indexname)).toEqual(["botmesh_inbox_chat_live"]);
    expect(String(indexes[0]!.indexdef)).toContain("'scheduled'");
    const after = (await upgraded.inbox.get(timer.id))!;
    expect([after.state, after.error, after.nextAttemptAt, after.attempts]).toEqual(["scheduled", null, before!.nextAttemptAt, 1]);
    expect((await upgraded.inbox.get(failing.id))?.state, "a failure stays a failure").toBe("failed");
    expect((await upgraded.inbox.list({ state: "scheduled" })).map((r) => r.id).sort()).toEqual(["m0:t1", "m1:t1"]);
    // Due when it was: the one due now is taken, the other not before its deadline.
    expect((await upgraded.inbox.claimDue({ ...lease("v"), limit: 10 })).map((r) => r.id)).toEqual(["m1:t1"]);
  });

  it("a version 7 schema gets the inbox indexes by lease holder: a restart reclaims its own leases in order, a lease held elsewhere still holds back its chat", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    const t = tables(schema, "botmesh_");
    await b.inbox.admit(inbound("a1", "c1"), { ...lease("A", 3_600_000), incarnation: "old" });
    await b.inbox.admit(inbound("a2", "c1"), { ...lease("A", 3_600_000), incarnation: "old" });
    await b.inbox.admit(inbound("b1", "c2"), { ...lease("B", 3_600_000), incarnation: "other" });
    await b.inbox.admit(inbound("b2", "c2"));
    // Back to version 7 by hand: no indexes by holder.
    await sql.unsafe(`DROP INDEX ${schema}.botmesh_inbox_lease; DROP INDEX ${schema}.botmesh_inbox_holder_chat`);
    await sql.unsafe(`UPDATE ${t.meta} SET value = '7' WHERE key = 'schema_version'`);
    const upgraded = new PostgresDurability({ sql: client(), schema });
    await upgraded.open();
    const [meta] = await sql.unsafe(`SELECT value FROM ${t.meta} WHERE key = 'schema_version'`);
    expect(meta?.value).toBe(String(POSTGRES_SCHEMA_VERSION));
    const indexes = await sql.unsafe(
      `SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND indexname IN ('botmesh_inbox_lease', 'botmesh_inbox_holder_chat') ORDER BY 1`,
      [schema],
    );
    expect(indexes.map((r) => r.indexname)).toEqual(["botmesh_inbox_holder_chat", "botmesh_inbox_lease"]);
    expect((await upgraded.inbox.claimDue({ ...lease("A"), incarnation: "new", reclaimOwn: true, limit: 10 })).map((r) => r.id)).toEqual(["a1", "a2"]);
    expect((await upgraded.inbox.claimDue({ ...lease("C"), limit: 10 })).map((r) => r.id), "b1 is held by B: b2 waits").toEqual([]);
  });

  it("a version 6 schema is upgraded in place: the table of scan answers is added, and nothing else changes", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    const t = tables(schema, "botmesh_");
    await b.inbox.admit(inbound("m1", "c1"));
    await b.outbox.reserve(outbound("k1", "c1"));
    // Back to version 6 by hand: no table of scan answers.
    await sql.unsafe(`DROP TABLE ${t.scanAnswer}`);
    await sql.unsafe(`UPDATE ${t.meta} SET value = '6' WHERE key = 'schema_version'`);
    const before = [await b.inbox.list(), await b.outbox.list()];
    const upgraded = new PostgresDurability({ sql: client(), schema });
    await upgraded.open();
    const [meta] = await sql.unsafe(`SELECT value FROM ${t.meta} WHERE key = 'schema_version'`);
    expect(meta?.value).toBe(String(POSTGRES_SCHEMA_VERSION));
    const columns = await sql.unsafe(
      `SELECT column_name FROM information_schema.columns WHERE table_schema = $1 AND table_name = 'botmesh_scan_answer' ORDER BY ordinal_position`,
      [schema],
    );
    expect(columns.map((r) => r.column_name)).toEqual(["journal", "id", "answer", "stored_at"]);
    const indexes = await sql.unsafe(`SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = 'botmesh_scan_answer' ORDER BY 1`, [schema]);
    expect(indexes.map((r) => r.indexname)).toEqual(["botmesh_scan_answer_at", "botmesh_scan_answer_pkey"]);
    expect([await upgraded.inbox.list(), await upgraded.outbox.list()], "the journals as they were").toEqual(before);
    const took = await upgraded.inbox.claimDue({ ...lease("v"), limit: 10, requestId: "after-upgrade" });
    expect(took.map((r) => r.id)).toEqual(["m1"]);
    expect(await upgraded.inbox.claimDue({ ...lease("v"), limit: 10, requestId: "after-upgrade", repeat: true })).toEqual(took);
    // A later open of a current schema changes nothing (the kept answer included).
    await new PostgresDurability({ sql: client(), schema }).open();
    expect(await b.inbox.claimDue({ ...lease("v"), limit: 10, requestId: "after-upgrade", repeat: true })).toEqual(took);
  });

  it("a send claimed by a replica still on the previous library (it raises the fence, not the flag) reads as called", async () => {
    const schema = freshSchema();
    const sql = client();
    const b = new PostgresDurability({ sql, schema });
    const t = tables(schema, "botmesh_");
    const queued = await b.outbox.reserve(outbound("k", "c"));
    expect(queued.entry.called).toBe(false);
    // The version 2 claim's SET list, as an older replica runs it after the upgrade: it calls without markCalling.
    await sql.unsafe(`UPDATE ${t.outbox} SET state = 'sending', attempts = attempts + 1, next_attempt_at = NULL,
      lease_owner = 'old', lease_incarnation = 'i', lease_token = fence + 1,
      lease_expires_at = (extract(epoch from clock_timestamp()) * 1000)::bigint + 100, fence = fence + 1,
      due_at = (extract(epoch from clock_timestamp()) * 1000)::bigint + 100 WHERE key = 'k'`);
    // And its leased reserve, which does not know the column.
    await sql.unsafe(`INSERT INTO ${t.outbox} (key, chat_id, content, content_hash, state, attempts, lease_owner, lease_incarnation,
        lease_token, lease_expires_at, fence, created_at, updated_at, due_at)
      VALUES ('k2', 'c2', '{}', 'h', 'sending', 1, 'old', 'i', 1, 1, 1, 1, 1, 1)`);
    expect((await b.outbox.get("k"))?.called).toBe(true);
    expect((await b.outbox.get("k2"))?.called).toBe(true);
    await Bun.sleep(250);
    const claim = await b.outbox.claimDue({ ...lease("v"), limit: 10 });
    expect(claim.ambiguous.map((e) => e.key).sort()).toEqual(["k", "k2"]);
    expect(claim.due).toEqual([]);
  });

  it("lapsed uncalled sends are leased before the due heads, within the limit, attempts unchanged; the rest wait", async () => {
    const schema = freshSchema();
    const b = new PostgresDurability({ sql: client(), schema });
    for (const chat of ["a", "b", "c"]) await b.outbox.reserve(outbound(`lost-${chat}`, chat), lease("w", 150));
    const called = await b.outbox.reserve(outbound("called", "d"), lease("w", 150));
    expect(await b.outbox.markCalling("called", called.entry.lease!.token, 150)).toBe(true);
    for (const chat of ["a", "e"]) await b.outbox.reserve(outbound(`queued-${chat}`, chat));
    await Bun.sleep(300);
    const first = await b.outbox.claimDue({ ...lease("v"), limit: 2 });
    expect(first.ambiguous.map((e) => e.key), "ambiguity is resolved whatever the limit").toEqual(["called"]);
    expect(first.due.map((e) => [e.key, e.attempts, e.fence, e.called])).toEqual([["lost-a", 1, 2, false], ["lost-b", 1, 2, false]]);
    expect((await b.outbox.get("lost-c"))?.state, "over the limit: left for a later scan").toBe("sending");
    const second = await b.outbox.claimDue({ ...lease("v"), limit: 10 });
    expect(second.ambiguous).toEqual([]);
    expect(second.due.map((e) => [e.key, e.attempts]), "queued-a waits behind lost-a").toEqual([["lost-c", 1], ["queued-e", 1]]);
    const zero = await b.outbox.claimDue({ ...lease("v"), limit: 0 });
    expect([zero.due, zero.ambiguous]).toEqual([[], []]);
  });

  /** 3 clients, 8 chats: concurrent reserve-with-lease, claimDue, markSent, markFailed (retry) and discard, then a drain. */
  async function stress(round: number): Promise<{ sent: number; discarded: number; drainSweeps: number }> {
    const schema = freshSchema();
    const backends = Array.from({ length: 3 }, () => new PostgresDurability({ sql: client({ max: 3 }), schema }));
    await backends[0]!.open();
    const expected = new Set<string>();
    const discarded = new Set<string>();
    let counter = 0;
    let keyNo = 0;
    const rnd = () => Math.random();
    const settle = async (b: PostgresDurability, key: string, token: number) => {
      if (rnd() < 0.25) await b.outbox.markFailed(key, token, { error: "try again", retryInMs: 0 });
      else await b.outbox.markSent(key, token, String(++counter));
    };
    const deadline = Date.now() + 2_500;
    const worker = async (b: PostgresDurability, w: number) => {
      const me = { owner: `w${w}`, incarnation: "i", leaseMs: 60_000 };
      while (Date.now() < deadline) {
        const r = rnd();
        if (r < 0.45) {
          const key = `r${round}-k${keyNo++}`;
          expected.add(key);
          const res = await b.outbox.reserve(outbound(key, `chat${Math.floor(rnd() * 8)}`), rnd() < 0.7 ? me : undefined);
          if (res.status === "leased") await settle(b, key, res.entry.lease!.token);
        } else if (r < 0.9) {
          const { due } = await b.outbox.claimDue({ ...me, limit: 1 + Math.floor(rnd() * 4) });
          for (const e of due) await settle(b, e.key, e.lease!.token);
        } else {
          const keys = [...expected].filter((k) => !discarded.has(k));
          const key = keys[Math.floor(rnd() * keys.length)];
          if (key !== undefined && (await b.outbox.discard(key))) {
            const gone = await b.outbox.get(key);
            expect(gone).toBe(null);
            discarded.add(key);
          }
        }
      }
    };
    await Promise.all(backends.map((b, w) => worker(b, w)));
    // Drain: whatever is left becomes due and is sent, in order.
    let sweeps = 0;
    const me = lease("drain");
    for (; sweeps < 400; sweeps++) {
      const { due } = await backends[sweeps % 3]!.outbox.claimDue({ ...me, limit: 50 });
      for (const e of due) await backends[0]!.outbox.markSent(e.key, e.lease!.token, String(++counter));
      const left = await backends[0]!.outbox.list({ state: ["queued", "sending", "failed", "unknown", "dead"], limit: 10 });
      if (left.length === 0) break;
    }
    const all = await backends[0]!.outbox.list({ limit: 100_000 });
    const keys = all.map((e) => e.key).sort();
    expect(keys, "every entry but the discarded ones is there").toEqual([...expected].filter((k) => !discarded.has(k)).sort());
    const stranded = all.filter((e) => e.state !== "sent");
    expect(stranded.map((e) => `${e.key}:${e.state}`), "nothing stranded").toEqual([]);
    const byChat = new Map<string, number[]>();
    for (const e of all) byChat.set(e.chatId, [...(byChat.get(e.chatId) ?? []), Number(e.messageId)]);
    for (const [chat, order] of byChat) {
      expect(order, `chat ${chat}: send order is seq order`).toEqual([...order].sort((a, b) => a - b));
    }
    return { sent: all.length, discarded: discarded.size, drainSweeps: sweeps };
  }

  it("concurrency stress: everything ends sent, in seq order per chat, nothing stranded (3 rounds)", async () => {
    for (let round = 0; round < 3; round++) {
      const result = await stress(round);
      console.log(`stress round ${round}:`, JSON.stringify(result));
      expect(result.sent).toBeGreaterThan(50);
    }
  }, 60_000);
});

describe("PostgresDurability due scans asked again (requestId, repeat)", () => {
  type Client = { unsafe: Sql["unsafe"]; begin?: (fn: (tx: never) => PromiseLike<unknown>) => PromiseLike<unknown> };
  /** A client whose next transaction commits, and then its reply is lost. */
  function lossy(sql: Sql): { client: Client; loseNextCommit(): void } {
    let lose = false;
    return {
      client: {
        unsafe: sql.unsafe.bind(sql),
        begin: async (fn) => {
          const result = await sql.begin(fn as never);
          if (lose) {
            lose = false;
            throw Object.assign(new Error("read ECONNRESET (the commit's reply never arrived)"), { code: "ECONNRESET" });
          }
          return result;
        },
      },
      loseNextCommit: () => void (lose = true),
    };
  }

  it("a named scan whose reply was lost: the repeat, from another backend on the schema, answers what it took under the same tokens", async () => {
    const schema = freshSchema();
    const first = lossy(client());
    const a = new PostgresDurability({ sql: first.client as never, schema });
    const b = new PostgresDurability({ sql: client(), schema }); // another process: nothing of a's memory
    for (const id of ["m1", "m2", "m3"]) await a.inbox.admit(inbound(id, `c-${id}`));
    first.loseNextCommit();
    expect((await messageOf(() => a.inbox.claimDue({ ...lease("A"), limit: 2, requestId: "scan-in" }))).message).toContain("ECONNRESET");
    const held = await Promise.all(["m1", "m2"].map((id) => b.inbox.get(id)));
    expect(held.map((r) => [r?.state, r?.lease?.owner, r?.lease?.token]), "the scan committed").toEqual([["processing", "A", 2], ["processing", "A", 2]]);
    const again = await b.inbox.claimDue({ ...lease("A"), limit: 10, requestId: "scan-in", repeat: true });
    expect(again.map((r) => [r.id, r.lease?.token]), "the records the lost reply held").toEqual([["m1", 2], ["m2", 2]]);
    expect(again).toEqual(held as NonNullable<(typeof held)[number]>[]);
    expect(await a.inbox.claimDue({ ...lease("A"), limit: 10, requestId: "scan-in", repeat: true }), "the scanner's own repeat").toEqual(again);
    expect((await b.inbox.get("m3"))?.state, "a repeat takes nothing more").toBe("pending");
    expect(await b.outbox.claimDue({ ...lease("A"), limit: 10, requestId: "scan-in", repeat: true }), "the outbox's scans are apart")
      .toEqual({ due: [], ambiguous: [] });

    // The outbox: a due entry leased and a lost announced send made ambiguous, by a scan whose reply was lost.
    await a.outbox.reserve(outbound("k1", "x"));
    const gone = await a.outbox.reserve(outbound("k2", "y"), lease("B", 100));
    expect(await a.outbox.markCalling("k2", gone.entry.lease!.token, 100)).toBe(true);
    await Bun.sleep(200);
    first.loseNextCommit();
    expect((await messageOf(() => a.outbox.claimDue({ ...lease("A"), limit: 10, requestId: "scan-out" }))).message).toContain("ECONNRESET");
    const claim = await b.outbox.claimDue({ ...lease("A"), limit: 10, requestId: "scan-out", repeat: true });
    expect(claim.due.map((e) => [e.key, e.state, e.lease?.token])).toEqual([["k1", "sending", 2]]);
    expect(claim.ambiguous.map((e) => [e.key, e.state])).toEqual([["k2", "unknown"]]);
    expect(claim.due[0]).toEqual((await b.outbox.get("k1"))!);
    expect(await b.outbox.claimDue({ ...lease("A"), limit: 10, requestId: "never-run", repeat: true })).toEqual({ due: [], ambiguous: [] });
    // Any requestId fits (its SHA-256 is the key): long, or with a NUL.
    const odd = `x\u0000${"y".repeat(10_000)}`;
    await b.inbox.admit(inbound("m4", "c-m4"));
    const took = await b.inbox.claimDue({ ...lease("A"), limit: 1, requestId: odd });
    expect(took.map((r) => r.id)).toEqual(["m3"]);
    expect(await b.inbox.claimDue({ ...lease("A"), limit: 1, requestId: odd, repeat: true })).toEqual(took);
  });

  it("the scan and the storing of its answer are one transaction: when the store fails, nothing was taken", async () => {
    const schema = freshSchema();
    const sql = client();
    const failing: Client = {
      unsafe: sql.unsafe.bind(sql),
      begin: (fn) =>
        sql.begin((tx) =>
          (fn as (tx: unknown) => PromiseLike<unknown>)({
            unsafe: (text: string, params?: unknown[], options?: { prepare?: boolean }) =>
              text.includes("scan_answer") ? Promise.reject(new Error("the store failed")) : tx.unsafe(text, params as never, options),
          })
        ),
    };
    const b = new PostgresDurability({ sql: failing as never, schema });
    await b.inbox.admit(inbound("m1"));
    expect((await messageOf(() => b.inbox.claimDue({ ...lease("A"), limit: 10, requestId: "r" }))).message).toContain("the store failed");
    const record = await b.inbox.get("m1");
    expect([record?.state, record?.fence], "rolled back with it").toEqual(["pending", 0]);
    expect(await b.inbox.claimDue({ ...lease("A"), limit: 10, requestId: "r", repeat: true })).toEqual([]);
    // Unnamed, the scan runs as before (no transaction of its own, no answer stored).
    expect((await b.inbox.claimDue({ ...lease("A"), limit: 10 })).map((r) => r.id)).toEqual(["m1"]);
    // A client without begin: the answer is stored by a statement of its own, after the scan.
    const plain = new PostgresDurability({ sql: { unsafe: sql.unsafe.bind(sql) } as never, schema });
    await plain.outbox.reserve(outbound("k1"));
    const claim = await plain.outbox.claimDue({ ...lease("A"), limit: 10, requestId: "p" });
    expect(claim.due.map((e) => e.key)).toEqual(["k1"]);
    expect(await b.outbox.claimDue({ ...lease("A"), limit: 10, requestId: "p", repeat: true })).toEqual(claim);
  });

  /** A TCP proxy to Postgres whose `cut()` drops the client side only: the server carries on. */
  async function proxy(): Promise<{ url: string; cut(): void; close(): void }> {
    const pairs: { client: net.Socket; upstream: net.Socket }[] = [];
    const target = new URL(POSTGRES_URL);
    const server = net.createServer((client) => {
      const upstream = net.connect(Number(target.port || 5432), target.hostname);
      client.on("data", (d) => upstream.write(d));
      upstream.on("data", (d) => {
        if (!client.destroyed) client.write(d);
      });
      client.on("error", () => {});
      upstream.on("error", () => {});
      pairs.push({ client, upstream });
    });
    await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
    const url = new URL(POSTGRES_URL);
    url.hostname = "127.0.0.1";
    url.port = String((server.address() as net.AddressInfo).port);
    return {
      url: url.toString(),
      cut: () => pairs.forEach((p) => p.client.destroy()),
      close: () => {
        pairs.forEach((p) => p.upstream.destroy());
        server.close();
      },
    };
  }

  /** Clients of one test, ended by {@link endOwn} (the file's clients stay open until its end: few connections are left). */
  const owned: Sql[] = [];
  function own(): Sql {
    const sql = postgres(POSTGRES_URL, { max: 2, onnotice: () => {} });
    owned.push(sql);
    return sql;
  }
  async function endOwn(): Promise<void> {
    await Promise.all(owned.splice(0).map((sql) => sql.end({ timeout: 1 })));
  }

  it("a repeat asked while the lost scan's COMMIT is still on its way waits for it, and answers what it took", async () => {
    const schema = freshSchema();
    const t = tables(schema, "botmesh_");
    const b = new PostgresDurability({ sql: own(), schema });
    await b.open();
    await b.inbox.admit(inbound("m1"));
    await b.outbox.reserve(outbound("k1"));
    // A slow COMMIT (synchronous replication, an fsync stall): a deferred trigger on the answers sleeps at COMMIT.
    const sql = own();
    await sql.unsafe(`CREATE FUNCTION "${schema}".slow() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(1); RETURN NULL; END $$`);
    await sql.unsafe(
      `CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON ${t.scanAnswer} DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION "${schema}".slow()`,
    );
    for (const journal of ["inbox", "outbox"] as const) {
      const p = await proxy();
      const viaProxy = postgres(p.url, { max: 1, onnotice: () => {} });
      const a = new PostgresDurability({ sql: viaProxy, schema });
      const options = { ...lease("A"), limit: 10, requestId: `scan-${journal}` };
      const scan = (journal === "inbox" ? a.inbox.claimDue(options) : a.outbox.claimDue(options)).then(() => "answered", (e) => `failed: ${(e as Error).message}`);
      await Bun.sleep(400); // the COMMIT was sent and is being processed
      p.cut();
      expect(await scan, "the scan's reply is lost").toStartWith("failed");
      if (journal === "inbox") {
        const again = await b.inbox.claimDue({ ...options, repeat: true });
        expect(again.map((r) => [r.id, r.state, r.lease?.owner]), "the repeat waited for the commit").toEqual([["m1", "processing", "A"]]);
        expect(again[0]).toEqual((await b.inbox.get("m1"))!);
      } else {
        const again = await b.outbox.claimDue({ ...options, repeat: true });
        expect(again.due.map((e) => [e.key, e.state, e.lease?.owner]), "the repeat waited for the commit").toEqual([["k1", "sending", "A"]]);
      }
      p.close();
      await viaProxy.end({ timeout: 0 }).catch(() => {});
    }
    await endOwn();
  });

  it("a repeat that comes before the lost scan stored its answer closes the request: the scan fails and rolls back", async () => {
    const schema = freshSchema();
    const sql = own();
    let stalled: Promise<void> | null = null;
    let arrived = () => {};
    const reached = new Promise<void>((r) => (arrived = r));
    // The scan's store waits for `stalled` (the scan has run, its leases are not committed).
    const slow: Client = {
      unsafe: sql.unsafe.bind(sql),
      begin: (fn) =>
        sql.begin((tx) =>
          (fn as (tx: unknown) => PromiseLike<unknown>)({
            unsafe: async (text: string, params?: unknown[], options?: { prepare?: boolean }) => {
              if (text.includes("scan_answer") && stalled) {
                arrived();
                await stalled;
              }
              return await tx.unsafe(text, params as never, options);
            },
          })
        ),
    };
    const a = new PostgresDurability({ sql: slow as never, schema });
    const b = new PostgresDurability({ sql: own(), schema });
    await b.inbox.admit(inbound("m1"));
    await b.outbox.reserve(outbound("k1"));
    for (const journal of ["inbox", "outbox"] as const) {
      let go = () => {};
      stalled = new Promise<void>((r) => (go = r));
      const options = { ...lease("A"), limit: 10, requestId: `late-${journal}` };
      const scan = messageOf(() => journal === "inbox" ? a.inbox.claimDue(options) : a.outbox.claimDue(options));
      await reached;
      const again = journal === "inbox" ? await b.inbox.claimDue({ ...options, repeat: true }) : await b.outbox.claimDue({ ...options, repeat: true });
      expect(again, "nothing committed yet: the repeat answers nothing").toEqual(journal === "inbox" ? [] : { due: [], ambiguous: [] });
      go();
      const error = await scan;
      expect(error.message).toContain(`Postgres ${journal}.claimDue on`);
      expect(error.message).toContain(`a repeat of requestId "late-${journal}" closed the request first`);
      stalled = null;
      if (journal === "inbox") {
        const record = await b.inbox.get("m1");
        expect([record?.state, record?.fence, record?.lease], "the scan rolled back").toEqual(["pending", 0, null]);
        expect(await b.inbox.claimDue({ ...options, repeat: true }), "the placeholder answers nothing").toEqual([]);
      } else {
        const entry = await b.outbox.get("k1");
        expect([entry?.state, entry?.fence, entry?.lease], "the scan rolled back").toEqual(["queued", 0, null]);
        expect(await b.outbox.claimDue({ ...options, repeat: true }), "the placeholder answers nothing").toEqual({ due: [], ambiguous: [] });
      }
    }
    // A fresh request takes them.
    expect((await a.inbox.claimDue({ ...lease("A"), limit: 10, requestId: "next" })).map((r) => r.id)).toEqual(["m1"]);
    await endOwn();
  });

  it("a repeat answers the scan's due records still as it left them and every entry it made ambiguous, read again; the stored answer holds references only", async () => {
    const schema = freshSchema();
    const t = tables(schema, "botmesh_");
    const sql = own();
    const b = new PostgresDurability({ sql, schema });
    for (const id of ["m1", "m2", "m3"]) await b.inbox.admit(inbound(id, `c-${id}`, { text: "x".repeat(1000) }));
    const took = await b.inbox.claimDue({ ...lease("A"), limit: 3, requestId: "refs" });
    const [row] = await sql.unsafe(`SELECT answer FROM ${t.scanAnswer} WHERE journal = 'inbox'`);
    expect(JSON.parse(String(row?.answer))).toEqual(took.map((r) => ({ id: r.id, token: r.lease!.token })));
    await b.inbox.heartbeat("m1", took[0]!.lease!.token, 120_000); // still leased under that token: answered as it is now
    await b.inbox.complete("m2", took[1]!.lease!.token); // settled since: left out
    const again = await b.inbox.claimDue({ ...lease("A"), limit: 3, requestId: "refs", repeat: true });
    expect(again.map((r) => r.id)).toEqual(["m1", "m3"]);
    expect(again[0]).toEqual((await b.inbox.get("m1"))!);
    expect(await b.inbox.claimDue({ ...lease("A"), incarnation: "inc-2", limit: 3, requestId: "refs", repeat: true }), "another incarnation's repeat")
      .toEqual([]);

    // The outbox: an entry made ambiguous, one due; with resendAmbiguous, one in both lists.
    await b.outbox.reserve(outbound("k1", "x"));
    for (const [key, chat] of [["k2", "y"], ["k3", "z"]]) {
      const gone = await b.outbox.reserve(outbound(key!, chat), lease("B", 100));
      expect(await b.outbox.markCalling(key!, gone.entry.lease!.token, 100)).toBe(true);
    }
    await Bun.sleep(200);
    const claim = await b.outbox.claimDue({ ...lease("A"), limit: 1, requestId: "out-refs" });
    expect([claim.due.map((e) => e.key), claim.ambiguous.map((e) => e.key)]).toEqual([["k1"], ["k2", "k3"]]);
    const [outRow] = await sql.unsafe(`SELECT answer FROM ${t.scanAnswer} WHERE journal = 'outbox'`);
    expect(JSON.parse(String(outRow?.answer))).toEqual({
      due: [{ key: "k1", token: claim.due[0]!.lease!.token }],
      ambiguous: claim.ambiguous.map((e) => ({ key: e.key, fence: e.fence })),
    });
    expect(await b.outbox.claimDue({ ...lease("A"), limit: 1, requestId: "out-refs", repeat: true })).toEqual(claim);
    expect(await b.outbox.retry("k3")).toBe(true); // moved on since: still answered (its report is owed), as it is now
    await b.outbox.markFailed("k1", claim.due[0]!.lease!.token, { error: "x", retryInMs: 60_000 }); // settled since: left out
    const later = await b.outbox.claimDue({ ...lease("A"), limit: 1, requestId: "out-refs", repeat: true });
    expect([later.due.map((e) => e.key), later.ambiguous.map((e) => [e.key, e.state])]).toEqual([[], [["k2", "unknown"], ["k3", "queued"]]]);

    await b.outbox.discard("k1");
    await b.outbox.discard("k2");
    await b.outbox.discard("k3");
    const lost = await b.outbox.reserve(outbound("k4", "w"), lease("B", 100));
    expect(await b.outbox.markCalling("k4", lost.entry.lease!.token, 100)).toBe(true);
    await Bun.sleep(200);
    const resend = await b.outbox.claimDue({ ...lease("A"), limit: 10, requestId: "resend", resendAmbiguous: true });
    expect([resend.due.map((e) => [e.key, e.state]), resend.ambiguous.map((e) => [e.key, e.state])]).toEqual([[["k4", "sending"]], [["k4", "sending"]]]);
    const resent = await b.outbox.claimDue({ ...lease("A"), limit: 10, requestId: "resend", resendAmbiguous: true, repeat: true });
    expect(resent).toEqual(resend);
    expect(resent.due.find((e) => e.key === "k4")).not.toBe(resent.ambiguous.find((e) => e.key === "k4")); // two objects, as the scan's
    await endOwn();
  });

  it("answers are kept for SCAN_ANSWER_KEEP_MS by the database's clock (option clock), then gone; stores and purge delete old ones", async () => {
    const schema = freshSchema();
    const t = tables(schema, "botmesh_");
    let now = 1_800_000_000_000;
    const sql = client();
    const b = new PostgresDurability({ sql, schema, clock: () => now });
    expect(await b.inbox.claimDue({ ...lease("A", 3_600_000), limit: 10, requestId: "r-empty" })).toEqual([]);
    for (let i = 0; i < 3; i++) await b.inbox.admit(inbound(`m${i}`, `c${i}`));
    const took = await b.inbox.claimDue({ ...lease("A", 3_600_000), limit: 1, requestId: "r0" });
    expect(took.map((r) => r.id)).toEqual(["m0"]);
    const stored = await sql.unsafe(`SELECT journal, stored_at FROM ${t.scanAnswer}`);
    expect(stored.map((r) => [r.journal, Number(r.stored_at)]), "kept on the clock; a scan that took nothing keeps nothing").toEqual([["inbox", now]]);
    now += SCAN_ANSWER_KEEP_MS;
    expect(await b.inbox.claimDue({ ...lease("A", 3_600_000), limit: 10, requestId: "r0", repeat: true }), "kept this long").toEqual(took);
    now += 1;
    expect(await b.inbox.claimDue({ ...lease("A", 3_600_000), limit: 10, requestId: "r0", repeat: true }), "then gone").toEqual([]);
    // The next store deletes the old answer.
    expect((await b.inbox.claimDue({ ...lease("A", 3_600_000), limit: 1, requestId: "r1" })).map((r) => r.id)).toEqual(["m1"]);
    expect((await sql.unsafe(`SELECT id FROM ${t.scanAnswer}`)).length).toBe(1);
    // purge deletes its journal's old answers.
    const outTook = await b.outbox.claimDue({ ...lease("A", 3_600_000), limit: 1, requestId: "o0" });
    expect(outTook.due).toEqual([]);
    await b.outbox.reserve(outbound("k1"));
    expect((await b.outbox.claimDue({ ...lease("A", 3_600_000), limit: 1, requestId: "o1" })).due.map((e) => e.key)).toEqual(["k1"]);
    now += SCAN_ANSWER_KEEP_MS + 1;
    await b.inbox.purge(86_400_000);
    expect((await sql.unsafe(`SELECT journal FROM ${t.scanAnswer}`)).map((r) => r.journal)).toEqual(["outbox"]);
    await b.outbox.purge(86_400_000);
    expect((await sql.unsafe(`SELECT journal FROM ${t.scanAnswer}`)).length).toBe(0);
  });
});

describe("PostgresDurability group commit", () => {
  /** The real client, with `begin` counted and its statements optionally sabotaged. */
  function watched(sql: Sql, sabotage?: (text: string, index: number) => string | Error) {
    const seen = { begins: 0, statements: [] as number[], alone: 0 };
    const wrapped = {
      unsafe: (text: string, params?: never[], options?: { prepare?: boolean }) => {
        seen.alone++;
        return sql.unsafe(text, params, options);
      },
      begin: (fn: (tx: { unsafe: Sql["unsafe"] }) => PromiseLike<unknown>) => {
        seen.begins++;
        const broken = sabotage?.("", -1);
        if (broken instanceof Error) return Promise.reject(broken);
        return sql.begin((tx) => {
          seen.statements.push(0);
          return fn({
            unsafe: ((text: string, params?: never[], options?: { prepare?: boolean }) => {
              const sabotaged = sabotage ? sabotage(text, seen.statements[seen.statements.length - 1]!) : text;
              seen.statements[seen.statements.length - 1]!++;
              return tx.unsafe(typeof sabotaged === "string" ? sabotaged : text, params, options);
            }) as Sql["unsafe"],
          }) as never;
        });
      },
    };
    return { wrapped, seen };
  }

  it("the writes of one turn share one transaction, and each resolves after its commit", async () => {
    const { wrapped, seen } = watched(client());
    const b = new PostgresDurability({ sql: wrapped, schema: freshSchema(), groupLanes: 1 });
    await b.open();
    const records = Array.from({ length: 40 }, (_, i) => inbound(`gc-${i}`, `chat-${i % 7}`, { n: i, text: "it's \"quoted\"" }));
    const alone = seen.alone;
    const admitted = await Promise.all(records.map((r) => b.inbox.admit(r, lease())));
    expect(admitted.map((r) => r?.id)).toEqual(records.map((r) => r.id));
    expect(admitted.every((r) => r !== null && r.state === "processing" && r.lease?.token === 1)).toBe(true);
    expect(seen.begins, "one transaction for the 40 admits").toBe(1);
    expect(seen.statements, "the guard, then one multi-row statement").toEqual([2]);
    expect(seen.alone, "none ran again alone (the statement did not fail)").toBe(alone);
    const listed = await b.inbox.list({ limit: 100 });
    expect(listed.map((r) => r.id), "receipt order is call order").toEqual(records.map((r) => r.id));
    expect(listed.map((r) => r.payload)).toEqual(records.map((r) => r.payload));
    // Two completes of one record in one group (the second is stale) do not share a statement.
    const aloneBefore = seen.alone;
    const outcomes = await Promise.allSettled([
      ...admitted.map((r) => b.inbox.complete(r!.id, r!.lease!.token)),
      b.inbox.complete(admitted[0]!.id, admitted[0]!.lease!.token),
    ]);
    expect(outcomes.slice(0, 40).every((o) => o.status === "fulfilled")).toBe(true);
    expect(outcomes[40]!.status, "the repeated complete is stale").toBe("rejected");
    expect(seen.begins).toBe(2);
    expect(seen.statements).toEqual([2, 3]);
    expect(seen.alone).toBe(aloneBefore);
    const done = await b.inbox.list({ state: "done", limit: 100 });
    expect(done.length).toBe(40);
    // A lone write runs as its own statement: no BEGIN/COMMIT round trips for one write.
    const aloneAfter = seen.alone;
    await b.inbox.admit(inbound("gc-alone"), lease());
    expect(seen.begins).toBe(2);
    expect(seen.alone).toBe(aloneAfter + 1);
  });

  it("starts of one group share a statement, each answered as a lone start would be (a stale token, a repeat)", async () => {
    const { wrapped, seen } = watched(client());
    const b = new PostgresDurability({ sql: wrapped, schema: freshSchema(), groupLanes: 1 });
    await b.open();
    const admitted = await Promise.all(Array.from({ length: 20 }, (_, i) => b.inbox.admit(inbound(`st-${i}`, `chat-${i % 5}`), lease())));
    const before = seen.statements.length;
    const started = await Promise.all([
      ...admitted.map((r, i) => b.inbox.start(r!.id, r!.lease!.token, i % 2 === 0 ? 2 : 3)),
      b.inbox.start(admitted[0]!.id, admitted[0]!.lease!.token + 1, 4), // not its token
      b.inbox.start(admitted[1]!.id, admitted[1]!.lease!.token, 2), // a repeat with a lower attempt
    ]);
    expect(started).toEqual([...admitted.map(() => true), false, true]);
    expect(seen.statements.slice(before), "the guard, the merged 20, the stale and the repeat alone (same records)").toEqual([4]);
    const attempts = await Promise.all(admitted.map(async (r) => (await b.inbox.get(r!.id))!.attempts));
    expect(attempts, "attempts become the greater of the two").toEqual(admitted.map((_, i) => (i % 2 === 0 ? 2 : 3)));
  });

  it("markSent of 200 sends in one statement reads each once: no nested loop over two CTE scans (the square of the group)", async () => {
    const { sql, b, t } = await openFresh();
    const entries = await Promise.all(Array.from({ length: 200 }, (_, i) => b.outbox.reserve(outbound(`ms${i}`, `msc${i}`), lease())));
    expect(entries.every((e) => e.status === "leased")).toBe(true);
    const rows = JSON.stringify(entries.map((e) => ({ key: e.entry.key, token: e.entry.lease!.token, message_id: "m" })));
    let plan = "";
    await sql.begin(async (tx) => {
      plan = (await tx.unsafe(`EXPLAIN (ANALYZE) ${outboxSql(t).markSentMany}`, [rows])).map((r) => r["QUERY PLAN"]).join("\n");
      throw new Error("rolled back");
    }).catch((error) => expect((error as Error).message).toBe("rolled back"));
    expect(plan, plan).toMatch(/Update on botmesh_outbox \S+ +\(cost=[^)]*\) \(actual time=[^)]* rows=200 loops=1\)/);
    const removed = [...plan.matchAll(/Rows Removed by (?:Join )?Filter: (\d+)/g)].map((m) => Number(m[1]));
    expect(Math.max(0, ...removed), plan).toBeLessThan(1000);
  });

  it("reserves of one group share a statement per run of distinct chats, each answered as a lone reserve would be", async () => {
    const { wrapped, seen } = watched(client());
    const b = new PostgresDurability({ sql: wrapped, schema: freshSchema(), groupLanes: 1 });
    await b.open();
    const known = await b.outbox.reserve(outbound("r-known", "rk"), lease());
    const blocked = await b.outbox.reserve(outbound("r-head", "rb"), lease());
    const before = seen.statements.length;
    const results = await Promise.all([
      b.outbox.reserve(outbound("r-a1", "ra"), lease()),
      b.outbox.reserve(outbound("r-b1", "rb"), lease()), // behind r-head: queued
      b.outbox.reserve(outbound("r-known", "rk"), lease()), // known: exists
      b.outbox.reserve(outbound("r-a2", "ra"), lease()), // the second of chat ra: its own statement, behind r-a1
      b.outbox.reserve(outbound("r-c1", "rc")), // no lease: queued, due
      b.outbox.reserve(outbound("r-d1", "rd"), lease()),
    ]);
    expect(seen.statements.slice(before), "the guard, the chat rows' lock, [a1 b1 known], [a2 c1 d1]").toEqual([4]);
    expect(results.map((r) => [r.status, r.entry.key, r.entry.state])).toEqual([
      ["leased", "r-a1", "sending"],
      ["queued", "r-b1", "queued"],
      ["exists", "r-known", known.entry.state],
      ["queued", "r-a2", "queued"],
      ["queued", "r-c1", "queued"],
      ["leased", "r-d1", "sending"],
    ]);
    const seqs = results.map((r) => r.entry.seq);
    expect(seqs[0]! < seqs[3]! && seqs[1]! < seqs[4]! && seqs[4]! < seqs[5]!, "seqs follow call order").toBe(true);
    for (const r of results) expect((await b.outbox.get(r.entry.key))?.state).toBe(r.entry.state);
    // Settling the heads of ra and rb in one group (one markSent statement) hands each chat to its next entry.
    const sentBefore = seen.statements.length;
    await Promise.all([
      b.outbox.markSent("r-a1", results[0]!.entry.lease!.token, "m-a1"),
      b.outbox.markSent("r-head", blocked.entry.lease!.token, "m-head"),
    ]);
    expect(seen.statements.slice(sentBefore), "the guard, one markSent statement").toEqual([2]);
    const claim = await b.outbox.claimDue({ ...lease(), limit: 10 });
    expect(claim.due.map((e) => e.key).sort(), "the next heads and the due queued entry").toEqual(["r-a2", "r-b1", "r-c1"]);
  });

  it("markCalling and markSent of one group share a statement each; a stale token fails only its own write", async () => {
    const { wrapped, seen } = watched(client());
    const b = new PostgresDurability({ sql: wrapped, schema: freshSchema(), groupLanes: 1 });
    await b.open();
    const entries = [];
    for (let i = 0; i < 4; i++) entries.push((await b.outbox.reserve(outbound(`mc-${i}`, `mc${i}`), lease())).entry);
    const before = seen.statements.length;
    const calling = await Promise.all([
      ...entries.map((e) => b.outbox.markCalling(e.key, e.lease!.token, 60_000)),
      b.outbox.markCalling("mc-0", 99, 60_000),
    ]);
    expect(calling).toEqual([true, true, true, true, false]);
    expect(seen.statements.slice(before), "the guard, the merged four, the stale one alone (same key): announcements lock no chat row").toEqual([3]);
    for (const e of entries) expect((await b.outbox.get(e.key))?.called).toBe(true);
    const sent = await Promise.allSettled([
      ...entries.slice(0, 3).map((e) => b.outbox.markSent(e.key, e.lease!.token, `m-${e.key}`)),
      b.outbox.markSent("mc-3", 99, "m-stale"),
    ]);
    expect(sent.map((o) => o.status)).toEqual(["fulfilled", "fulfilled", "fulfilled", "rejected"]);
    expect((await b.outbox.get("mc-3"))?.state).toBe("sending");
    expect((await b.outbox.get("mc-1"))?.messageId).toBe("m-mc-1");
  });

  it("with two lanes, a turn's writes go in one transaction per lane, each chat's writes (by chat or by a record it holds) in one lane", async () => {
    const { wrapped, seen } = watched(client());
    const b = new PostgresDurability({ sql: wrapped, schema: freshSchema(), groupLanes: 2 });
    await b.open();
    const chats = Array.from({ length: 8 }, (_, i) => `lane-${i}`);
    const begins = seen.begins;
    const admitted = await Promise.all(chats.flatMap((c) => [b.inbox.admit(inbound(`${c}-1`, c), lease()), b.inbox.admit(inbound(`${c}-2`, c), lease())]));
    expect(seen.begins - begins, "one transaction per lane").toBe(2);
    expect(admitted.map((r) => r?.state), "the second of each chat is its chat's second, leased behind its own lease").toEqual(
      chats.flatMap(() => ["processing", "processing"]),
    );
    // By id: each record's writes go to its chat's lane; two lanes again, and every write lands.
    const done = await Promise.all(admitted.map((r) => b.inbox.complete(r!.id, r!.lease!.token)));
    expect(done.length).toBe(16);
    expect(seen.begins - begins).toBe(4);
    expect((await b.inbox.list({ state: "done", limit: 100 })).length).toBe(16);
    await expect(async () => new PostgresDurability({ sql: wrapped, groupLanes: 0 })).toThrow(/"groupLanes" must be an integer from 1 to 16/);
  });

  it("option clock: every statement's time is the clock's (leases, due times); a bad one is refused naming it", async () => {
    let now = 1_900_000_000_000;
    const b = new PostgresDurability({ sql: client(), schema: freshSchema(), clock: () => now });
    const r = (await b.inbox.admit(inbound("m1"), lease("a", 1_000)))!;
    expect([r.updatedAt, r.lease!.expiresAt]).toEqual([now, now + 1_000]);
    expect(await b.inbox.claim("m1", lease("b")), "a live lease on the clock").toBe(null);
    now += 1_001;
    expect((await b.inbox.claim("m1", lease("b")))?.lease?.owner, "lapsed on the clock, not the server's").toBe("b");
    expect(() => new PostgresDurability({ sql: client(), clock: 5 as never })).toThrow(/Postgres option "clock" must be a function/);
  });

  it("leased admits of one group keep the chat order among themselves: each is held back by an earlier one of its chat as if admitted alone", async () => {
    const { wrapped, seen } = watched(client());
    const b = new PostgresDurability({ sql: wrapped, schema: freshSchema(), groupLanes: 1 });
    await b.open();
    const settled = await b.inbox.admit(inbound("dup", "g3"), lease());
    await b.inbox.complete(settled!.id, settled!.lease!.token);
    const at = (id: string, chat: string, ms: number) => ({ ...inbound(id, chat), receivedAt: 1_700_000_000_000 + ms });
    const calls: [NewInboundRecord, ClaimOptions | undefined][] = [
      [at("a1", "g1", 0), lease("owner-a")],
      [at("a2", "g1", 1), lease("owner-a")],
      [at("a3", "g1", 2), lease("owner-b")], // behind another owner's lease in the same statement
      [at("p1", "g2", 0), undefined],
      [at("p2", "g2", 1), lease("owner-a")], // behind a pending record of the same statement
      [at("dup", "g3", 0), undefined], // its id is known: inserts nothing, holds nothing back
      [at("x", "g3", 1), lease("owner-a")],
      [at("e1", "g4", 10), lease("owner-b")], // admitted first, but received after e2: behind e2
      [at("e2", "g4", 0), lease("owner-a")],
    ];
    const statementsBefore = seen.statements.length;
    const admitted = await Promise.all(calls.map(([r, l]) => b.inbox.admit(r, l)));
    expect(seen.statements.slice(statementsBefore), "the guard, then one multi-row statement").toEqual([2]);
    expect(admitted.map((r) => r && [r.id, r.state, r.lease?.owner ?? null, r.attempts, r.fence])).toEqual([
      ["a1", "processing", "owner-a", 1, 1],
      ["a2", "processing", "owner-a", 1, 1],
      ["a3", "pending", null, 0, 0],
      ["p1", "pending", null, 0, 0],
      ["p2", "pending", null, 0, 0],
      null,
      ["x", "processing", "owner-a", 1, 1],
      ["e1", "pending", null, 0, 0],
      ["e2", "processing", "owner-a", 1, 1],
    ]);
    // Each as stored, and as a lone admit of the same records would have journaled them.
    for (const r of admitted) if (r) expect((await b.inbox.get(r.id))?.state).toBe(r.state);
  });

  it("writes of one group on one record apply in call order (a merged statement never overtakes one)", async () => {
    const { wrapped, seen } = watched(client());
    const b = new PostgresDurability({ sql: wrapped, schema: freshSchema(), groupLanes: 1 });
    await b.open();
    const [x, y, z] = await Promise.all(["ox", "oy", "oz"].map((id) => b.inbox.admit(inbound(id), lease())));
    const token = (r: typeof x) => r!.lease!.token;
    const outcomes = await Promise.allSettled([
      b.inbox.complete(y!.id, token(y)),
      b.inbox.heartbeat(x!.id, token(x), 60_000),
      b.inbox.complete(x!.id, token(x)),
      b.inbox.fail(z!.id, token(z), { error: "first", retryInMs: 60_000 }),
      b.inbox.complete(z!.id, token(z)),
    ]);
    expect(seen.statements.at(-1), "the guard; complete(ox) and complete(oz) each after the write before them").toBe(6);
    expect(outcomes.map((o) => o.status)).toEqual(["fulfilled", "fulfilled", "fulfilled", "fulfilled", "rejected"]);
    expect((outcomes[1] as PromiseFulfilledResult<boolean>).value, "the heartbeat came before the complete").toBe(true);
    expect((await b.inbox.get("ox"))?.state).toBe("done");
    expect((await b.inbox.get("oz"))?.state, "the first call wins").toBe("failed");
  });

  it("a statement canceled on a live connection (57014) rolls its group back: the others run again alone", async () => {
    const schema = freshSchema();
    const setup = new PostgresDurability({ sql: client(), schema });
    await setup.open();
    const held = await setup.inbox.admit(inbound("locked"), lease());
    const { wrapped } = watched(client({ connection: { statement_timeout: 300 } }));
    const b = new PostgresDurability({ sql: wrapped, schema, groupLanes: 1 });
    await b.open();
    const holding = await holdLocks(`SELECT 1 FROM "${schema}".botmesh_inbox WHERE id = 'locked' FOR UPDATE`);
    const outcomes = await Promise.allSettled([
      b.inbox.heartbeat("locked", held!.lease!.token, 60_000),
      b.inbox.admit(inbound("free-1"), lease()),
      b.inbox.admit(inbound("free-2"), lease()),
    ]);
    await holding.release();
    expect(outcomes[0]!.status, "the heartbeat waited on the lock past statement_timeout").toBe("rejected");
    expect(String((outcomes[0] as PromiseRejectedResult).reason.message)).toContain("statement timeout");
    expect(outcomes.slice(1).map((o) => o.status), "the admits ran again alone").toEqual(["fulfilled", "fulfilled"]);
    expect((await b.inbox.get("free-1"))?.state).toBe("processing");
  });

  it("a group left idle before its COMMIT loses its session after 5 s, so its row locks do not block others for ever", async () => {
    const schema = freshSchema();
    const other = new PostgresDurability({ sql: client(), schema });
    await other.open();
    const held = await other.inbox.admit(inbound("contended"), lease());
    // The frozen replica: its group's second statement is sent 7 s late (the session sits idle in transaction).
    const base = client();
    const b = new PostgresDurability({
      sql: {
        unsafe: base.unsafe.bind(base),
        begin: (fn: (tx: { unsafe: Sql["unsafe"] }) => PromiseLike<unknown>) => {
          // Once the server ended the session, the late statement is not sent (porsager would write it to
          // the closed socket): it fails as a statement on a lost connection does.
          let gone = false;
          const group = base.begin((tx) => {
            let n = 0;
            return fn({
              unsafe: ((text: string, params?: never[], options?: { prepare?: boolean }) => {
                if (n++ !== 2) return tx.unsafe(text, params, options);
                return Bun.sleep(7000).then(() =>
                  gone ? Promise.reject(Object.assign(new Error("session ended"), { code: "CONNECTION_CLOSED" })) : tx.unsafe(text, params, options)
                );
              }) as Sql["unsafe"],
            }) as never;
          });
          group.then(() => {}, () => gone = true);
          return group;
        },
      },
      schema,
      groupLanes: 1,
    });
    await b.open();
    const started = Date.now();
    const frozenGroup = Promise.allSettled([
      b.inbox.heartbeat("contended", held!.lease!.token, 60_000),
      b.inbox.admit(inbound("late"), lease()),
    ]);
    await Bun.sleep(300);
    // Another replica's write on the locked row waits for the frozen group, then goes through.
    expect(await other.inbox.heartbeat("contended", held!.lease!.token, 60_000)).toBe(true);
    const waited = Date.now() - started;
    expect(waited, "released by the server's timeout, not by the frozen client").toBeLessThan(6900);
    expect(waited).toBeGreaterThanOrEqual(4500);
    const outcomes = await frozenGroup;
    expect(outcomes.map((o) => o.status), "the frozen group was never acknowledged").toEqual(["rejected", "rejected"]);
    expect(await other.inbox.get("late"), "and did not commit").toBe(null);
    await Bun.sleep(2500); // the late statement is issued on the dead session: nothing may throw
  }, 20_000);

  it("two replicas' groups that lock the same chat rows in opposite statement order do not deadlock: each locks them in chat order first", async () => {
    const schema = freshSchema();
    const a = watched(client());
    const b = watched(client());
    const ra = new PostgresDurability({ sql: a.wrapped, schema, groupLanes: 1 });
    const rb = new PostgresDurability({ sql: b.wrapped, schema, groupLanes: 1 });
    await ra.open();
    await rb.open();
    // Replica a holds a send in chat x, replica b one in chat y.
    const ax = (await ra.outbox.reserve(outbound("dl-ax", "dl-x"), lease("a"))).entry;
    const by = (await rb.outbox.reserve(outbound("dl-by", "dl-y"), lease("b"))).entry;
    const t = tables(schema, "botmesh_");
    // A third session holds both chat rows, so that each group's first lock waits; released, the groups go
    // on together. Statement by statement, a's reserve would take y and b's reserve x, then each markSent
    // would wait for the other's: a deadlock, broken by the server after deadlock_timeout.
    const holding = await holdLocks(`SELECT 1 FROM ${t.chat} WHERE chat_id IN ('dl-x', 'dl-y') ORDER BY chat_id FOR UPDATE`);
    const aloneBefore = [a.seen.alone, b.seen.alone];
    const groupA = Promise.all([ra.outbox.reserve(outbound("dl-ay", "dl-y"), lease("a")), ra.outbox.markSent("dl-ax", ax.lease!.token, "m-ax")]);
    const groupB = Promise.all([rb.outbox.reserve(outbound("dl-bx", "dl-x"), lease("b")), rb.outbox.markSent("dl-by", by.lease!.token, "m-by")]);
    const admin = client({ max: 1 });
    for (let i = 0; i < 200; i++) {
      const [row] = await admin.unsafe(
        `SELECT count(*)::int AS n FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '%' || $1 || '%'`,
        [schema],
      );
      if (row!.n >= 2) break;
      await Bun.sleep(10);
    }
    await holding.release();
    const [[ay], [bx]] = await Promise.all([groupA, groupB]);
    expect([a.seen.alone - aloneBefore[0]!, b.seen.alone - aloneBefore[1]!], "no group was rolled back and run again alone").toEqual([0, 0]);
    expect([a.seen.statements.at(-1), b.seen.statements.at(-1)], "the guard, the chat rows' lock, the reserve, the markSent").toEqual([4, 4]);
    expect([(await ra.outbox.get("dl-ax"))?.state, (await rb.outbox.get("dl-by"))?.state]).toEqual(["sent", "sent"]);
    // Queued behind the other replica's send, or leased when that one was sent first (whichever group committed first).
    expect([ay.entry.key, bx.entry.key, ["queued", "leased"].includes(ay.status), ["queued", "leased"].includes(bx.status)]).toEqual(["dl-ay", "dl-bx", true, true]);
  });

  it("a group the server rolled back (an error in one statement) runs each write again alone", async () => {
    // The group: the guard, a heartbeat, then the five admits in one multi-row statement, which fails on the server.
    const { wrapped, seen } = watched(client(), (text, i) => (i === 2 ? "SELECT 1/0 AS boom" : text));
    const b = new PostgresDurability({ sql: wrapped, schema: freshSchema(), groupLanes: 1 });
    await b.open();
    const held = await b.inbox.admit(inbound("rb-held"), lease());
    const records = Array.from({ length: 5 }, (_, i) => inbound(`rb-${i}`));
    const aloneBefore = seen.alone;
    const [beat, ...admitted] = await Promise.all([
      b.inbox.heartbeat(held!.id, held!.lease!.token, 60_000),
      ...records.map((r) => b.inbox.admit(r, lease())),
    ]);
    expect(seen.begins).toBe(1);
    expect(seen.statements, "the guard, the heartbeat, the admits merged").toEqual([3]);
    expect(seen.alone - aloneBefore, "after the rollback, each of the six ran alone").toBe(6);
    expect(beat).toBe(true);
    expect(admitted.map((r) => r?.id), "every write committed on its own after the rollback").toEqual(records.map((r) => r.id));
    for (const r of records) expect((await b.inbox.get(r.id))?.state).toBe("processing");
  });

  it("a group whose transaction's fate is unknown (the connection failed) rejects every write, naming it", async () => {
    const lost = Object.assign(new Error("write CONNECTION_CLOSED 127.0.0.1:5432"), { code: "CONNECTION_CLOSED" });
    const { wrapped } = watched(client(), () => lost);
    const b = new PostgresDurability({ sql: wrapped, schema: freshSchema(), groupLanes: 1 });
    await b.open();
    const outcomes = await Promise.allSettled([b.inbox.admit(inbound("lost-1"), lease()), b.inbox.admit(inbound("lost-2"), lease())]);
    for (const o of outcomes) {
      expect(o.status).toBe("rejected");
      const message = (o as PromiseRejectedResult).reason.message as string;
      expect(message).toContain("Postgres inbox.admit on");
      expect(message).toContain("CONNECTION_CLOSED");
    }
    expect(await b.inbox.get("lost-1"), "nothing was run").toBe(null);
  });
});
