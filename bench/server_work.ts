/**
 * Server work per message: what one durable message (admitted, one reply sent, done) costs the server,
 * for our backend and for the server's ceiling (our protocol's writes as plain statements or commands),
 * side by side. Each row is a closed loop of 100 chats in its own child process (bench/row.ts,
 * bench/ceilings/*.ts), no warm-up loop, so that every message it counts is in the counters.
 *
 * - Postgres (the shared server): rows inserted, updated (and of those HOT: no index entry written) and
 *   deleted per message, by table (`pg_stat_user_tables` of the run's schema, read once the child's
 *   connections closed and flushed their counters); the indexes of each table (a row inserted or
 *   updated other than HOT writes an entry in each index whose predicate it meets); WAL bytes per
 *   message (`pg_current_wal_insert_lsn()` at the start and end of the measured loop: the whole
 *   server's, so anything else writing meanwhile is counted too: run it on a quiet server).
 * - Redis (a redis-server of its own, AOF everysec): commands per message by name (`INFO commandstats`:
 *   the commands our scripts run count, the script calls themselves are shown apart), and AOF bytes per
 *   message (`aof_current_size`).
 *
 *   bun bench/server_work.ts [--seconds S (2)] [--runs N (3): the median run of each row]
 *
 * Prints markdown; `lines()` gives the same to bench/run.ts.
 */
import postgres from "postgres";
import Redis from "ioredis";
import { join } from "node:path";
import { POSTGRES_URL, tcpReachable } from "../tests/support/services.ts";
import { createNs, dropNs, LABELS, type Ns, type RowResult, scriptOf } from "./lib.ts";
import { startAofRedis } from "./servers.ts";

type WorkKind = "postgres" | "ceiling-postgres" | "redis-aof" | "ceiling-redis-aof";

interface TableWork {
  table: string;
  inserted: number;
  updated: number;
  hot: number;
  deleted: number;
  indexes: number;
}

/** One run's counts, per message. */
interface Work {
  messages: number;
  tables?: TableWork[];
  walBytes?: number;
  commands?: Map<string, number>;
  aofBytes?: number;
}

/** Runs `kind` once in its child, sampling the server at the child's start and end marks. */
async function runOnce(kind: WorkKind, seconds: number, redisUrl: string | undefined): Promise<Work> {
  const ns = createNs(kind, redisUrl ? { redisUrl } : {});
  const sql = kind.endsWith("postgres") ? postgres(POSTGRES_URL, { max: 1, onnotice: () => {} }) : null;
  const redis = redisUrl && !sql ? new Redis(redisUrl) : null;
  try {
    const sample = async (): Promise<{ lsn?: string; commands?: Map<string, number>; aof?: number }> => {
      if (sql) return { lsn: (await sql`SELECT pg_current_wal_insert_lsn()::text AS lsn`)[0]!.lsn as string };
      if (redis) {
        const stats = await redis.info("commandstats");
        const commands = new Map<string, number>();
        for (const m of stats.matchAll(/^cmdstat_([^:]+):calls=(\d+)/gm)) commands.set(m[1]!, Number(m[2]));
        const aof = /aof_current_size:(\d+)/.exec(await redis.info("persistence"));
        return { commands, ...(aof ? { aof: Number(aof[1]) } : {}) };
      }
      return {};
    };
    const config: Record<string, unknown> = { mode: "load", ns, chats: 100, seconds, warmSeconds: 0 };
    if (kind === "ceiling-postgres") config.groups = 4;
    const proc = Bun.spawn([process.execPath, join(import.meta.dir, scriptOf(kind)), JSON.stringify(config)], {
      stdin: "pipe",
      stdout: "pipe",
      stderr: "inherit",
      env: { ...process.env, BENCH_ACK: "1" },
    });
    const marks: Awaited<ReturnType<typeof sample>>[] = [];
    let last = "", buf = "";
    const decoder = new TextDecoder();
    const reader = proc.stdout.getReader();
    for (;;) {
      const { done, value: chunk } = await reader.read();
      if (done) break;
      buf += decoder.decode(chunk, { stream: true });
      for (let i = buf.indexOf("\n"); i >= 0; i = buf.indexOf("\n")) {
        const line = buf.slice(0, i).trim();
        buf = buf.slice(i + 1);
        if (line === "@@start" || line === "@@end") {
          marks.push(await sample());
          proc.stdin.write("ok\n");
          proc.stdin.flush();
        } else if (line) last = line;
      }
    }
    if (buf.trim()) last = buf.trim();
    if ((await proc.exited) !== 0) throw new Error(`${LABELS[kind]}: the child failed`);
    const result = JSON.parse(last) as RowResult;
    const work: Work = { messages: result.messages };
    const [start, end] = marks;
    if (!start || !end) throw new Error(`${LABELS[kind]}: the child gave no start and end marks`);
    if (sql) {
      const lsnBytes = async (a: string, b: string) => Number((await sql`SELECT pg_wal_lsn_diff(${b}::pg_lsn, ${a}::pg_lsn)::bigint AS n`)[0]!.n);
      work.walBytes = (await lsnBytes(start.lsn!, end.lsn!)) / result.messages;
      work.tables = await tableWork(sql, ns, result.messages);
    } else {
      work.commands = new Map();
      for (const [name, calls] of end.commands!) {
        const n = calls - (start.commands!.get(name) ?? 0);
        // the samples' own INFO calls are not the row's
        if (n > 0 && name !== "info") work.commands.set(name, n / result.messages);
      }
      if (start.aof !== undefined && end.aof !== undefined) work.aofBytes = (end.aof - start.aof) / result.messages;
    }
    return work;
  } finally {
    await sql?.end({ timeout: 5 });
    if (redis) await redis.quit().catch(() => redis.disconnect());
    await dropNs(ns).catch(() => {});
  }
}

/** Rows written per message in the schema of `ns`, by table, once the counters are flushed (stable twice). */
async function tableWork(sql: postgres.Sql, ns: Ns, messages: number): Promise<TableWork[]> {
  const read = async () =>
    await sql`
      SELECT t.relname AS table, t.n_tup_ins::bigint AS ins, t.n_tup_upd::bigint AS upd, t.n_tup_hot_upd::bigint AS hot,
        t.n_tup_del::bigint AS del, (SELECT count(*) FROM pg_index i WHERE i.indrelid = t.relid)::int AS indexes
      FROM pg_stat_user_tables t WHERE t.schemaname = ${ns.name} ORDER BY t.relname`;
  let rows = await read(), previous = "";
  for (let tries = 0; tries < 20; tries++) {
    const now = JSON.stringify(rows);
    if (now === previous) break;
    previous = now;
    await Bun.sleep(300);
    rows = await read();
  }
  return rows
    .map((r) => ({
      table: String(r.table),
      inserted: Number(r.ins) / messages,
      updated: Number(r.upd) / messages,
      hot: Number(r.hot) / messages,
      deleted: Number(r.del) / messages,
      indexes: Number(r.indexes),
    }))
    .filter((t) => t.inserted + t.updated + t.deleted >= 0.005); // (a run's one-off writes, e.g. the schema's version row, left out)
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const f2 = (x: number) => x.toFixed(2);

/** The markdown lines of the measurement (runs of each row interleaved; the median per figure). */
export async function lines(opts: { seconds: number; runs: number }): Promise<string[]> {
  const out: string[] = [];
  const pgUp = await tcpReachable("127.0.0.1", Number(new URL(POSTGRES_URL).port || 5432), 500);
  const aof = await startAofRedis();
  try {
    const kinds: WorkKind[] = [...(pgUp ? ["postgres", "ceiling-postgres"] as const : []), ...(aof ? ["redis-aof", "ceiling-redis-aof"] as const : [])];
    const runs = new Map<WorkKind, Work[]>(kinds.map((k) => [k, []]));
    for (let r = 0; r < opts.runs; r++) {
      for (const kind of kinds) runs.get(kind)!.push(await runOnce(kind, opts.seconds, kind.includes("redis") ? aof!.url : undefined));
    }
    if (pgUp) {
      out.push("| row | table | rows inserted | updated (of those HOT) | deleted | indexes | WAL bytes / msg |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |");
      for (const kind of ["postgres", "ceiling-postgres"] as const) {
        const works = runs.get(kind)!;
        const wal = median(works.map((w) => w.walBytes!));
        const names = [...new Set(works.flatMap((w) => w.tables!.map((t) => t.table)))];
        let total = { inserted: 0, updated: 0, hot: 0, deleted: 0 };
        names.forEach((name, i) => {
          const pick = (f: keyof Omit<TableWork, "table">) => median(works.map((w) => w.tables!.find((t) => t.table === name)?.[f] ?? 0));
          const t = { inserted: pick("inserted"), updated: pick("updated"), hot: pick("hot"), deleted: pick("deleted") };
          total = { inserted: total.inserted + t.inserted, updated: total.updated + t.updated, hot: total.hot + t.hot, deleted: total.deleted + t.deleted };
          out.push(`| ${i === 0 ? LABELS[kind] : ""} | ${name} | ${f2(t.inserted)} | ${f2(t.updated)} (${f2(t.hot)}) | ${f2(t.deleted)} | ${pick("indexes")} | |`);
        });
        out.push(`| ${LABELS[kind]}, all tables | | **${f2(total.inserted)}** | **${f2(total.updated)}** (${f2(total.hot)}) | **${f2(total.deleted)}** | | **${Math.round(wal).toLocaleString("en-US")}** |`);
      }
      out.push("");
    }
    if (aof) {
      out.push("| row | commands / msg (run inside scripts included) | script calls / msg | AOF bytes / msg |", "| --- | --- | ---: | ---: |");
      for (const kind of ["redis-aof", "ceiling-redis-aof"] as const) {
        const works = runs.get(kind)!;
        const names = [...new Set(works.flatMap((w) => [...w.commands!.keys()]))];
        const per = new Map(names.map((n) => [n, median(works.map((w) => w.commands!.get(n) ?? 0))]));
        const scripts = ["evalsha", "eval", "fcall", "evalsha_ro", "eval_ro"].reduce((s, n) => s + (per.get(n) ?? 0), 0);
        const inner = [...per].filter(([n, v]) => v >= 0.01 && !["evalsha", "eval", "fcall", "evalsha_ro", "eval_ro", "script|load", "script"].includes(n))
          .sort((a, b) => b[1] - a[1]);
        const sum = inner.reduce((s, [, v]) => s + v, 0);
        out.push(
          `| ${LABELS[kind]} | **${f2(sum)}**: ${inner.map(([n, v]) => `${n} ${f2(v)}`).join(", ")} | ${f2(scripts)} | ${Math.round(median(works.map((w) => w.aofBytes ?? NaN))).toLocaleString("en-US")} |`,
        );
      }
      out.push("");
    }
  } finally {
    await aof?.stop();
  }
  return out;
}

if (import.meta.main) {
  const argv = process.argv.slice(2);
  const value = (name: string) => {
    const i = argv.indexOf(name);
    return i >= 0 ? argv[i + 1] : undefined;
  };
  const out = await lines({ seconds: Number(value("--seconds") ?? 2), runs: Number(value("--runs") ?? 3) });
  console.log(out.join("\n"));
}
