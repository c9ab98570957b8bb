/**
 * Fills a namespace with `count` finished messages (a `done` inbound record
 * and its `sent` outbox entry each), the journal a long-running bot retains,
 * before a scale row measures on top of it (spawned by bench/run.ts):
 *
 *   bun bench/prefill.ts '{"ns":{...},"count":100000,"chats":100}'
 *
 * The records belong to chats c0…c<chats-1>, the chat ids the measured runs use (a live chat carries
 * retained records too). After the copies: Postgres `VACUUM ANALYZE` and `CHECKPOINT`, SQLite
 * `PRAGMA wal_checkpoint(TRUNCATE)`, so the measured runs do not pay for the prefill's dirty pages.
 *
 * - SQLite, Postgres: 1,000 templates through the backend's own API (its real
 *   schema, chat rows and all), then bulk `INSERT … SELECT` copies of them
 *   with new ids (`<id>-<n>`), every column copied as the backend wrote it;
 * - Redis: 1,000 templates through the API likewise, then copies of their
 *   keys in big pipelines, mirroring the key layout the backend wrote (see redis());
 * - events journal: built in a MemoryEventJournal through the same API and
 *   saved as one snapshot (as bench/events_growth.bench.ts does).
 */
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import type { DurabilityBackend } from "../src/contract.ts";
import { POSTGRES_URL } from "../tests/support/services.ts";
import { type Ns, openKind } from "./lib.ts";

const { ns, count, chats = 100 } = JSON.parse(process.argv[2] ?? "{}") as { ns: Ns; count: number; chats?: number };
const lease = { owner: "prefill", incarnation: "prefill", leaseMs: 600_000 };
const TEMPLATES = Math.min(1000, count);
const progress = (what: string, done: number) => process.stderr.write(`\r  prefill ${ns.kind} ${what}: ${done}/${count}   `);

/** One finished message through the API: admitted, done, its reply reserved and sent. */
async function finished(backend: DurabilityBackend, id: string, chatId: string): Promise<void> {
  const record = await backend.inbox.admit({
    id,
    kind: "message",
    chatId,
    provider: "mock",
    payload: { id, chatId, type: "text", text: id },
    receivedAt: Date.now(),
  }, lease);
  if (!record?.lease) throw new Error(`prefill: ${id} was not admitted with a lease`);
  const r = await backend.outbox.reserve({ key: `${id}:0`, chatId, content: `r:${id}`, contentHash: "prefill", inboundId: id }, lease);
  if (r.status !== "leased") throw new Error(`prefill: reply of ${id} is ${r.status}`);
  await backend.outbox.markSent(r.entry.key, r.entry.lease!.token, `msg-${id}`);
  await backend.inbox.complete(id, record.lease.token);
}

/** Through the API, one message of a chat at a time (a chat's next admit waits behind its active record). */
async function viaApi(backend: DurabilityBackend, from: number, to: number, idOf: (i: number) => string): Promise<void> {
  await Promise.all(Array.from({ length: Math.min(chats, to - from) }, async (_, c) => {
    for (let i = from + c; i < to; i += chats) {
      await finished(backend, idOf(i), `c${i % chats}`);
      if (i % 10_000 === 0) progress("api", i);
    }
  }));
}

const templateId = (i: number) => `pre${i}`;

async function sqlite(): Promise<void> {
  const { Database } = await import("bun:sqlite");
  const db = new Database(join(ns.name, "bot.db"));
  db.exec("PRAGMA synchronous = OFF");
  const copies = Math.ceil(count / TEMPLATES) - 1;
  const cols = (t: string) => (db.prepare(`PRAGMA table_info(${t})`).all() as { name: string; pk: number }[]).filter((c) => c.pk === 0).map((c) => c.name);
  const inCols = cols("botmesh_inbox"), outCols = cols("botmesh_outbox");
  const renamed = (c: string) => c === "id" || c === "key" || c === "inbound_id" ? `${c} || '-' || g` : c;
  db.exec("CREATE TEMP TABLE tin AS SELECT * FROM botmesh_inbox; CREATE TEMP TABLE tout AS SELECT * FROM botmesh_outbox");
  const step = Math.max(1, Math.floor(100_000 / TEMPLATES));
  for (let g = 1; g <= copies; g += step) {
    const last = Math.min(copies, g + step - 1);
    const series = `WITH RECURSIVE s(g) AS (SELECT ${g} UNION ALL SELECT g + 1 FROM s WHERE g < ${last})`;
    db.transaction(() => {
      db.exec(`INSERT INTO botmesh_inbox (${inCols}) ${series} SELECT ${inCols.map(renamed)} FROM tin, s`);
      db.exec(`INSERT INTO botmesh_outbox (${outCols}) ${series} SELECT ${outCols.map(renamed)} FROM tout, s`);
    })();
    progress("sql", (last + 1) * TEMPLATES);
  }
  db.exec("DROP TABLE tin; DROP TABLE tout; ANALYZE");
  db.close();
}

async function postgres(): Promise<void> {
  const { default: postgres } = await import("postgres");
  const sql = postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
  try {
    const copies = Math.ceil(count / TEMPLATES) - 1;
    const cols = async (t: string) =>
      (await sql`select column_name from information_schema.columns where table_schema = ${ns.name} and table_name = ${t} and is_identity = 'NO' and is_generated = 'NEVER' order by ordinal_position`)
        .map((r) => r.column_name as string);
    const inCols = await cols("botmesh_inbox"), outCols = await cols("botmesh_outbox");
    const renamed = (c: string) => c === "id" || c === "key" || c === "inbound_id" ? `${c} || '-' || g` : c;
    const s = `"${ns.name}"`;
    await sql.unsafe(`create table ${s}.tin as select * from ${s}.botmesh_inbox; create table ${s}.tout as select * from ${s}.botmesh_outbox`);
    const step = Math.max(1, Math.floor(100_000 / TEMPLATES));
    for (let g = 1; g <= copies; g += step) {
      const last = Math.min(copies, g + step - 1);
      await sql.begin(async (tx) => {
        await tx.unsafe(`insert into ${s}.botmesh_inbox (${inCols}) select ${inCols.map(renamed)} from ${s}.tin, generate_series(${g}, ${last}) g`);
        await tx.unsafe(`insert into ${s}.botmesh_outbox (${outCols}) select ${outCols.map(renamed)} from ${s}.tout, generate_series(${g}, ${last}) g`);
      });
      progress("sql", (last + 1) * TEMPLATES);
    }
    await sql.unsafe(`drop table ${s}.tin; drop table ${s}.tout`);
  } finally {
    await sql.end({ timeout: 5 });
  }
}

/**
 * Redis: copies of the templates' keys, mirroring the backend's layout as it
 * wrote it: a key named after a template id (its record hash) is copied
 * under the new id; a shared key (a state, chat or due index) gets the
 * template's member under the new id, with the same score. Every template
 * id inside a name, member or field value is replaced. Volatile keys (the
 * scripts' request-id replies) are left alone.
 */
async function redis(): Promise<void> {
  const { default: Redis } = await import("ioredis");
  const { REDIS_URL } = await import("../tests/support/services.ts");
  const client = new Redis(ns.redisUrl ?? REDIS_URL);
  const ID = /(pre\d+)(?![\d-])/g;
  const HAS = /pre\d+(?![\d-])/;
  const rename = (s: string, g: number) => s.replace(ID, `$1-${g}`);
  type Copy = (p: ReturnType<typeof client.pipeline>, g: number) => void;
  const copiers: Copy[] = [];
  let cursor = "0";
  do {
    const [next, keys] = await client.scan(cursor, "MATCH", `*${ns.name}*`, "COUNT", 5000);
    cursor = next;
    for (const key of keys) {
      if (await client.pttl(key) >= 0) continue;
      const own = HAS.test(key);
      const type = await client.type(key);
      if (type === "hash") {
        const fields = Object.entries(await client.hgetall(key));
        if (own) copiers.push((p, g) => void p.hset(rename(key, g), ...fields.flatMap(([f, v]) => [f, rename(v, g)])));
        else {
          const mine = fields.filter(([f]) => HAS.test(f));
          if (mine.length > 0) copiers.push((p, g) => void p.hset(key, ...mine.flatMap(([f, v]) => [rename(f, g), rename(v, g)])));
        }
      } else if (type === "zset") {
        const flat = await client.zrange(key, 0, -1, "WITHSCORES");
        const pairs: [string, string][] = [];
        for (let i = 0; i < flat.length; i += 2) if (own || HAS.test(flat[i]!)) pairs.push([flat[i + 1]!, flat[i]!]);
        if (pairs.length > 0) copiers.push((p, g) => void p.zadd(own ? rename(key, g) : key, ...pairs.flatMap(([s, m]) => [s, rename(m, g)])));
      } else if (type === "set") {
        const members = (await client.smembers(key)).filter((m) => own || HAS.test(m));
        if (members.length > 0) copiers.push((p, g) => void p.sadd(own ? rename(key, g) : key, ...members.map((m) => rename(m, g))));
      } else if (type === "string" && own) {
        const value = (await client.get(key))!;
        copiers.push((p, g) => void p.set(rename(key, g), rename(value, g)));
      } else if (own) {
        throw new Error(`prefill redis: cannot copy ${type} key ${key}`);
      }
    }
  } while (cursor !== "0");
  const copies = Math.ceil(count / TEMPLATES) - 1;
  let next = 1;
  await Promise.all(Array.from({ length: 4 }, async () => {
    while (next <= copies) {
      const g = next++;
      const p = client.pipeline();
      for (const copy of copiers) copy(p, g);
      const failed = (await p.exec())?.find(([e]) => e);
      if (failed) throw failed[0];
      if (g % 10 === 0) progress("copies", (g + 1) * TEMPLATES);
    }
  }));
  await client.quit();
}

/** After the prefill: Postgres VACUUM ANALYZE (every table of the schema) and CHECKPOINT; SQLite a WAL checkpoint. */
async function settle(): Promise<void> {
  if (ns.kind === "postgres") {
    const { default: postgres } = await import("postgres");
    const sql = postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
    try {
      for (const { t } of await sql`select tablename as t from pg_tables where schemaname = ${ns.name}`) {
        await sql.unsafe(`VACUUM ANALYZE "${ns.name}"."${t}"`);
      }
      await sql.unsafe("CHECKPOINT");
    } finally {
      await sql.end({ timeout: 5 });
    }
  } else if (ns.kind === "sqlite-normal" || ns.kind === "sqlite-full") {
    const { Database } = await import("bun:sqlite");
    const db = new Database(join(ns.name, "bot.db"));
    const [row] = db.prepare("PRAGMA wal_checkpoint(TRUNCATE)").all() as { busy: number }[];
    db.close();
    if (row?.busy) throw new Error("prefill: the SQLite WAL checkpoint was blocked");
  }
}

const started = performance.now();
if (ns.kind === "events-log" || ns.kind === "events") {
  const { MemoryEventJournal, EventsDurability } = await import("../backends/events/mod.ts");
  const { serializeEventSnapshot } = await import("../backends/events/snapshot.ts");
  const memory = new MemoryEventJournal();
  await viaApi(new EventsDurability({ journal: memory }), 0, count, templateId);
  writeFileSync(join(ns.name, "events.json"), serializeEventSnapshot(memory, 0));
} else {
  const opened = await openKind(ns);
  const backend = opened.backend!;
  await backend.open?.();
  await viaApi(backend, 0, TEMPLATES, templateId);
  await backend.close?.();
  await opened.close();
  if (count > TEMPLATES) await (ns.kind === "postgres" ? postgres() : ns.kind === "redis" || ns.kind === "redis-aof" ? redis() : sqlite());
}
await settle();
process.stderr.write(`\r  prefill ${ns.kind}: ${count} finished messages in ${((performance.now() - started) / 1000).toFixed(1)} s\n`);
process.exit(0);
