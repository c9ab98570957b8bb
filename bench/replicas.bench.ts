/**
 * Throughput of replicas as OS processes, side by side in one run: messages per second on
 * Postgres and Redis with 1 and 3 replicas, and the same scenario on the embedded backends
 * (SQLite with 1 and 3 processes on one file; FileDurability, one process only).
 *
 *   bun bench/replicas.bench.ts                       # every scenario, 3 runs, 1000 messages each
 *   bun bench/replicas.bench.ts --runs 1 --messages 2000 --chats 100
 *   bun bench/replicas.bench.ts --only sqlite,postgres --upstash   # add Redis over the Upstash bridge
 *
 * Needs PostgreSQL and Redis as for the tests (`BOTMESH_PG_URL`, `BOTMESH_REDIS_URL`; see
 * tests/support/services.ts); a scenario whose server is not reachable is left out with a note.
 *
 * Each scenario: a fresh namespace (temp directory, schema, key prefix; dropped after), the
 * replicas of tests/fixtures/replica.ts started on it (explicit instanceIds, 30 s leases: no
 * takeover here), a warm-up of 60 messages, then `--messages` messages over `--chats` chats routed
 * sticky by chat (the chats spread evenly over the replicas), at most `--window` messages
 * outstanding (written to a replica, not yet handled) at a time. Each message gets one reply: one
 * journaled inbound record (admit with lease, complete) and one outbox entry (reserve, markSent).
 * The handler does not think and the provider answers at once, so this measures the journals and
 * the processes' overhead. Time: from the first message written until every message was handled and
 * a replica's `bot.idle()` saw nothing active in the journal. Printed: msgs/s per run, the median,
 * and the median's ratio to the baseline (SQLite, 1 process).
 *
 * The machine's core count matters: 3 replicas on 2 cores share them with the test process and the
 * database server. Measure, don't assert: nothing here fails on a slow number.
 *
 * @module
 */
import { cpus } from "node:os";
import {
  type BackendKind,
  Cluster,
  createNamespace,
  dropNamespace,
  type Namespace,
  openBackend,
  planMessages,
  type PlannedMessage,
} from "../tests/support/replica_harness.ts";
import { POSTGRES_URL, REDIS_URL, tcpReachable } from "../tests/support/services.ts";
import { startUpstashBridge } from "../tests/support/upstash_bridge.ts";

// ---- flags -------------------------------------------------------------------------

function flag(name: string): string | undefined {
  const i = process.argv.indexOf(`--${name}`);
  return i < 0 ? undefined : process.argv[i + 1];
}
function intFlag(name: string, fallback: number): number {
  const raw = flag(name);
  if (raw === undefined) return fallback;
  const n = Number(raw);
  if (!Number.isInteger(n) || n < 1) throw new Error(`--${name} must be a positive integer, got ${raw}`);
  return n;
}
const MESSAGES = intFlag("messages", 1000);
const CHATS = intFlag("chats", 60);
const RUNS = intFlag("runs", 3);
const WINDOW = intFlag("window", 300);
const WITH_UPSTASH = process.argv.includes("--upstash");
const ONLY = flag("only")?.split(",");

interface Scenario {
  kind: BackendKind;
  label: string;
  replicas: number;
}
const ALL_SCENARIOS: Scenario[] = [
  { kind: "sqlite", label: "SQLite", replicas: 1 },
  { kind: "sqlite", label: "SQLite", replicas: 3 },
  { kind: "file", label: "File", replicas: 1 },
  { kind: "postgres", label: "Postgres", replicas: 1 },
  { kind: "postgres", label: "Postgres", replicas: 3 },
  { kind: "redis", label: "Redis (ioredis)", replicas: 1 },
  { kind: "redis", label: "Redis (ioredis)", replicas: 3 },
  ...(WITH_UPSTASH
    ? [
      { kind: "upstash", label: "Redis (Upstash bridge)", replicas: 1 },
      { kind: "upstash", label: "Redis (Upstash bridge)", replicas: 3 },
    ] satisfies Scenario[]
    : []),
];
const SCENARIOS: Scenario[] = ALL_SCENARIOS.filter((s) => !ONLY || ONLY.includes(s.kind));

async function unavailable(kind: BackendKind): Promise<string | false> {
  if (kind === "postgres" || kind === "redis" || kind === "upstash" || kind === "node-redis") {
    const url = new URL(kind === "postgres" ? POSTGRES_URL : REDIS_URL);
    const up = await tcpReachable(url.hostname, Number(url.port || (kind === "postgres" ? 5432 : 6379)));
    if (!up) return `${url.host} is not reachable`;
  }
  return false;
}

// ---- one measurement ----------------------------------------------------------------

/** Delivers `plan` with at most WINDOW outstanding; resolves when every message was handled. */
async function pump(cluster: Cluster, plan: PlannedMessage[]): Promise<void> {
  const base = cluster.handled.size;
  let next = 0;
  const deadline = performance.now() + 300_000;
  while (cluster.handled.size - base < plan.length) {
    while (next < plan.length && next - (cluster.handled.size - base) < WINDOW) cluster.deliver(plan[next++]!);
    if (performance.now() > deadline) throw new Error(`stuck: ${cluster.stuck()}`);
    await Promise.race([cluster.changed(), Bun.sleep(100)]);
  }
}

async function measure(s: Scenario, run: number): Promise<number> {
  const bridge = s.kind === "upstash" ? await startUpstashBridge() : undefined;
  const ns: Namespace = createNamespace(s.kind, `bench_${s.replicas}_${run}`, bridge && { url: bridge.url, token: bridge.token });
  const reader = await openBackend(ns);
  const cluster = new Cluster(ns, { leaseMs: 30_000, thinkMs: [0, 0], sendMs: 0, upstash: ns.upstash });
  try {
    // Creates the schema once, before the replicas start (not the file backend: one process only).
    if (s.kind !== "file") await reader.backend.open?.();
    const names = Array.from({ length: s.replicas }, (_, i) => `bench-${i + 1}`);
    await cluster.start(names);
    // Chats are routed to the least loaded replica as they first appear; one reply per message.
    const all = planMessages(60 + MESSAGES, CHATS, 1000 + run).map((m) => ({ ...m, replies: 1 }));
    const warmup = all.slice(0, 60);
    const plan = all.slice(60);
    await pump(cluster, warmup);
    const t0 = performance.now();
    await pump(cluster, plan);
    const settled = cluster.replica(names[0]!).next("settled ", 120_000);
    cluster.replica(names[0]!).command({ op: "settle" });
    await settled;
    const seconds = (performance.now() - t0) / 1000;
    // A sanity check, not an assertion on speed: every reply went out once.
    const keys = new Set(cluster.sink.map((l) => l.key));
    if (keys.size !== all.length || cluster.sink.length !== all.length) {
      throw new Error(`expected ${all.length} replies once each, got ${cluster.sink.length} lines, ${keys.size} keys`);
    }
    await Promise.all(cluster.replicas.map((r) => r.stop()));
    return MESSAGES / seconds;
  } finally {
    for (const r of cluster.replicas) r.proc.kill("SIGKILL");
    await Promise.all(cluster.replicas.map((r) => r.exited));
    if (s.kind !== "file") await reader.backend.close?.().catch(() => {});
    await reader.close().catch(() => {});
    await dropNamespace(ns);
    await bridge?.stop();
  }
}

// ---- the run ---------------------------------------------------------------------------

console.log(
  `replicas bench: ${MESSAGES} messages over ${CHATS} chats per scenario, window ${WINDOW}, ${RUNS} run(s), ` +
    `${cpus().length} cores, bun ${Bun.version}`,
);
const results = new Map<Scenario, number[]>();
const skipped = new Map<Scenario, string>();
for (const s of SCENARIOS) {
  const why = await unavailable(s.kind);
  if (why) skipped.set(s, why);
  else results.set(s, []);
}
// Runs are interleaved (every scenario once, then again), so that a noisy moment hurts all alike.
for (let run = 1; run <= RUNS; run++) {
  for (const [s, list] of results) {
    try {
      const rate = await measure(s, run);
      list.push(rate);
      console.log(`  run ${run}: ${s.label} × ${s.replicas}: ${rate.toFixed(0)} msgs/s`);
    } catch (error) {
      console.log(`  run ${run}: ${s.label} × ${s.replicas}: FAILED: ${(error as Error).message.slice(0, 500)}`);
    }
  }
}

const median = (xs: number[]) => {
  const sorted = [...xs].sort((a, b) => a - b);
  return sorted.length === 0 ? NaN : sorted.length % 2 ? sorted[(sorted.length - 1) / 2]! : (sorted[sorted.length / 2 - 1]! + sorted[sorted.length / 2]!) / 2;
};
const baseline = [...results].find(([s]) => s.kind === "sqlite" && s.replicas === 1)?.[1];
const base = baseline ? median(baseline) : NaN;
const rows = [["backend", "replicas", "msgs/s (median)", "runs", "× SQLite 1"]];
for (const [s, list] of results) {
  const m = median(list);
  rows.push([s.label, String(s.replicas), Number.isNaN(m) ? "-" : m.toFixed(0), list.map((x) => x.toFixed(0)).join(" / "), Number.isNaN(base) || Number.isNaN(m) ? "-" : (m / base).toFixed(2)]);
}
for (const [s, why] of skipped) rows.push([s.label, String(s.replicas), "skipped", why, "-"]);
const widths = rows[0]!.map((_, i) => Math.max(...rows.map((r) => r[i]!.length)));
console.log("");
for (const [i, r] of rows.entries()) {
  console.log(`| ${r.map((c, j) => c.padEnd(widths[j]!)).join(" | ")} |`);
  if (i === 0) console.log(`| ${widths.map((w) => "-".repeat(w)).join(" | ")} |`);
}
process.exit(0);
