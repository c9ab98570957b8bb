/**
 * Throughput of replicas as OS processes, and what bounds it on this machine: messages per second on
 * one Postgres and on one Redis (ioredis) with 1, 2 and 4 replicas (`--replicas`), and the same
 * scenario on the embedded backends (SQLite with 1 and 3 processes on one file; FileDurability, one
 * process only).
 *
 *   bun bench/replicas.bench.ts                       # every scenario, 3 runs, 1000 messages each
 *   bun bench/replicas.bench.ts --runs 1 --messages 2000 --chats 100
 *   bun bench/replicas.bench.ts --only postgres,redis --replicas 1,2,4,8
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
 * a replica's `bot.idle()` saw nothing active in the journal.
 *
 * CPU time over the same window, from /proc on this host (utime + stime, in `getconf CLK_TCK` ticks):
 * - server: every process named `postgres` (the whole server: shared with whatever else uses it; a
 *   backend that exits within the window takes its time with it), and of that the backends of this
 *   run's replicas (by application_name, `PGAPPNAME`); for Redis the redis-server process (its pid
 *   from INFO), shared the same way;
 * - replicas: the replica child processes;
 * - parent: this process (`process.cpuUsage()`: routing, reading the children's lines, and for
 *   Upstash the REST bridge);
 * - machine: every core's busy time (/proc/stat), so that "other" = the machine minus the above
 *   (other people's work on this machine);
 * - after the window, the replicas idle for a second: what an idle replica uses (sweeps, timers).
 *
 * Printed: msgs/s per run, then per scenario the median, its ratio to the 1-replica row of the same
 * backend, CPU seconds per 1000 messages (medians), the busy cores of the window, and per backend a
 * verdict computed from these numbers: which CPU saturates as replicas are added.
 *
 * The machine's core count matters: 4 replicas on 2 cores share them with the bench process and the
 * database server. Measure, don't assert: nothing here fails on a slow number.
 *
 * @module
 */
import { readdirSync, readFileSync } from "node:fs";
import { cpus, loadavg } from "node:os";
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
function listFlag(name: string, fallback: number[]): number[] {
  const raw = flag(name);
  if (raw === undefined) return fallback;
  const list = raw.split(",").map((x) => Number(x.trim()));
  if (list.length === 0 || list.some((n) => !Number.isInteger(n) || n < 1)) {
    throw new Error(`--${name} must be a comma-separated list of positive integers, got ${raw}`);
  }
  return [...new Set(list)].sort((a, b) => a - b);
}
const MESSAGES = intFlag("messages", 1000);
const CHATS = intFlag("chats", 60);
const RUNS = intFlag("runs", 3);
const WINDOW = intFlag("window", 300);
/** Replica counts of the shared backends (Postgres, Redis). */
const REPLICAS = listFlag("replicas", [1, 2, 4]);
const WITH_UPSTASH = process.argv.includes("--upstash");
const ONLY = flag("only")?.split(",");

interface Scenario {
  kind: BackendKind;
  label: string;
  replicas: number;
}
const shared = (kind: BackendKind, label: string): Scenario[] => REPLICAS.map((replicas) => ({ kind, label, replicas }));
const ALL_SCENARIOS: Scenario[] = [
  { kind: "sqlite", label: "SQLite", replicas: 1 },
  { kind: "sqlite", label: "SQLite", replicas: 3 },
  { kind: "file", label: "File", replicas: 1 },
  ...shared("postgres", "Postgres"),
  ...shared("redis", "Redis (ioredis)"),
  ...(WITH_UPSTASH ? shared("upstash", "Redis (Upstash bridge)") : []),
];
const SCENARIOS: Scenario[] = ALL_SCENARIOS.filter((s) => !ONLY || ONLY.includes(s.kind));
if (ONLY && SCENARIOS.length === 0) {
  throw new Error(`--only ${ONLY.join(",")} matches no scenario (kinds: ${[...new Set(ALL_SCENARIOS.map((s) => s.kind))].join(", ")})`);
}

async function unavailable(kind: BackendKind): Promise<string | false> {
  if (kind === "postgres" || kind === "redis" || kind === "upstash" || kind === "node-redis") {
    const url = new URL(kind === "postgres" ? POSTGRES_URL : REDIS_URL);
    const up = await tcpReachable(url.hostname, Number(url.port || (kind === "postgres" ? 5432 : 6379)));
    if (!up) return `${url.host} is not reachable`;
  }
  return false;
}

// ---- CPU time from /proc --------------------------------------------------------------

/** Clock ticks per second of /proc's times (`getconf CLK_TCK`; 100 if that fails). */
const CLK_TCK = (() => {
  try {
    const n = Number(Bun.spawnSync(["getconf", "CLK_TCK"]).stdout.toString().trim());
    return Number.isInteger(n) && n > 0 ? n : 100;
  } catch {
    return 100;
  }
})();
const CORES = cpus().length;

/** utime + stime of a process (all its threads), seconds; null when it is gone or /proc cannot be read. */
function procCpuSec(pid: number): number | null {
  try {
    const stat = readFileSync(`/proc/${pid}/stat`, "utf8");
    const f = stat.slice(stat.lastIndexOf(") ") + 2).split(" ").map(Number);
    return (f[11]! + f[12]!) / CLK_TCK;
  } catch {
    return null;
  }
}

/** Per process CPU seconds at one moment. */
type CpuSample = Map<number, number>;

function sample(pids: Iterable<number>): CpuSample {
  const out: CpuSample = new Map();
  for (const pid of pids) {
    const s = procCpuSec(pid);
    if (s !== null) out.set(pid, s);
  }
  return out;
}

/** CPU seconds used between two samples by the processes of the second (a process new since the first counts from 0). */
function cpuBetween(a: CpuSample, b: CpuSample): number | null {
  if (b.size === 0) return null;
  let sec = 0;
  for (const [pid, t] of b) sec += t - (a.get(pid) ?? 0);
  return sec;
}

/** Pids of the processes whose comm is `name` (the whole Postgres server: postmaster, backends, background workers). */
function pidsNamed(name: string): number[] {
  const pids: number[] = [];
  for (const entry of readdirSync("/proc")) {
    if (!/^\d+$/.test(entry)) continue;
    try {
      if (readFileSync(`/proc/${entry}/comm`, "utf8").trim() === name) pids.push(Number(entry));
    } catch {
      // Gone meanwhile.
    }
  }
  return pids;
}

/** Busy seconds of all cores together (/proc/stat: user, nice, system, irq, softirq, steal). */
function machineBusySec(): number | null {
  try {
    const f = readFileSync("/proc/stat", "utf8").split("\n")[0]!.trim().split(/\s+/).slice(1).map(Number);
    return (f[0]! + f[1]! + f[2]! + f[5]! + f[6]! + (f[7] ?? 0)) / CLK_TCK;
  } catch {
    return null;
  }
}

/** The redis-server's pid on this host (INFO's process_id, checked against /proc), or null. */
async function redisServerPid(): Promise<number | null> {
  const { default: Redis } = await import("ioredis");
  const client = new Redis(REDIS_URL, { lazyConnect: true, maxRetriesPerRequest: 1 });
  try {
    await client.connect();
    const pid = Number(/process_id:(\d+)/.exec(await client.info("server"))?.[1]);
    if (pid && readFileSync(`/proc/${pid}/comm`, "utf8").trim().startsWith("redis-server")) return pid;
  } catch {
    // Not on this host, or not readable.
  } finally {
    client.disconnect();
  }
  const port = new URL(REDIS_URL).port || "6379";
  return pidsNamed("redis-server").find((pid) => {
    try {
      return readFileSync(`/proc/${pid}/cmdline`, "utf8").includes(`:${port}`);
    } catch {
      return false;
    }
  }) ?? null;
}

/** The application_name of this run's Postgres connections (the children inherit it): its backends are "ours". */
const APP = `botmesh-replicas-bench-${process.pid}`;
process.env.PGAPPNAME = APP;

/** The server's processes of one kind, and those of them that serve this run (Postgres: by application_name). */
interface ServerProbe {
  all(): CpuSample;
  ours(): Promise<CpuSample | null>;
  close(): Promise<void>;
}

async function serverProbe(kind: BackendKind): Promise<ServerProbe | null> {
  if (kind === "postgres") {
    const { default: postgres } = await import("postgres");
    const sql = postgres(POSTGRES_URL, { max: 1, onnotice: () => {}, connection: { application_name: `${APP}-probe` } });
    return {
      all: () => sample(pidsNamed("postgres")),
      ours: async () => {
        try {
          const rows = await sql`SELECT pid FROM pg_stat_activity WHERE application_name = ${APP}`;
          return sample(rows.map((r) => r.pid as number));
        } catch {
          return null;
        }
      },
      close: () => sql.end({ timeout: 2 }),
    };
  }
  if (kind === "redis" || kind === "upstash" || kind === "node-redis") {
    const pid = await redisServerPid();
    if (pid === null) return null;
    return { all: () => sample([pid]), ours: async () => null, close: async () => {} };
  }
  return null;
}

// ---- one measurement ----------------------------------------------------------------

/** One run of one scenario: its rate and the CPU seconds of the timed window. */
interface Measured {
  rate: number;
  seconds: number;
  /** Every process of the server (null: no server, or not on this host). */
  server: number | null;
  /** Of those, the backends of this run's replicas (Postgres only). */
  serverOurs: number | null;
  replicas: number | null;
  parent: number;
  /** All cores' busy time. */
  machine: number | null;
  /** CPU seconds per second of one replica, on average, in the second after the window (nothing to do: its timers and sweeps). */
  idlePerReplica: number | null;
}

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

async function measure(s: Scenario, run: number): Promise<Measured> {
  const bridge = s.kind === "upstash" ? await startUpstashBridge() : undefined;
  const ns: Namespace = createNamespace(s.kind, `bench_${s.replicas}_${run}`, bridge && { url: bridge.url, token: bridge.token });
  const reader = await openBackend(ns);
  const cluster = new Cluster(ns, { leaseMs: 30_000, thinkMs: [0, 0], sendMs: 0, upstash: ns.upstash });
  const probe = await serverProbe(s.kind);
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
    const pids = cluster.replicas.map((r) => r.pid);
    const ours0 = await probe?.ours();
    const server0 = probe?.all();
    const replicas0 = sample(pids);
    const machine0 = machineBusySec();
    const parent0 = process.cpuUsage();
    const t0 = performance.now();
    await pump(cluster, plan);
    const settled = cluster.replica(names[0]!).next("settled ", 120_000);
    cluster.replica(names[0]!).command({ op: "settle" });
    await settled;
    const seconds = (performance.now() - t0) / 1000;
    const parent1 = process.cpuUsage(parent0);
    const machine1 = machineBusySec();
    const replicas1 = sample(pids);
    const server1 = probe?.all();
    const ours1 = await probe?.ours();
    // A sanity check, not an assertion on speed: every reply went out once.
    const keys = new Set(cluster.sink.map((l) => l.key));
    if (keys.size !== all.length || cluster.sink.length !== all.length) {
      throw new Error(`expected ${all.length} replies once each, got ${cluster.sink.length} lines, ${keys.size} keys`);
    }
    // What the replicas burn with nothing to do (sweeps, timers), for the verdict.
    const idle0 = sample(pids);
    const idleStart = performance.now();
    await Bun.sleep(1000);
    const idle1 = sample(pids);
    const idleSeconds = (performance.now() - idleStart) / 1000;
    const idle = idle1.size === pids.length ? cpuBetween(idle0, idle1) : null;
    await Promise.all(cluster.replicas.map((r) => r.stop()));
    return {
      rate: MESSAGES / seconds,
      seconds,
      server: server0 && server1 ? cpuBetween(server0, server1) : null,
      serverOurs: ours0 && ours1 ? cpuBetween(ours0, ours1) : null,
      replicas: replicas1.size === pids.length ? cpuBetween(replicas0, replicas1) : null,
      parent: (parent1.user + parent1.system) / 1e6,
      machine: machine0 !== null && machine1 !== null ? machine1 - machine0 : null,
      idlePerReplica: idle === null ? null : idle / idleSeconds / pids.length,
    };
  } finally {
    for (const r of cluster.replicas) r.proc.kill("SIGKILL");
    await Promise.all(cluster.replicas.map((r) => r.exited));
    await probe?.close().catch(() => {});
    if (s.kind !== "file") await reader.backend.close?.().catch(() => {});
    await reader.close().catch(() => {});
    await dropNamespace(ns);
    await bridge?.stop();
  }
}

// ---- the run ---------------------------------------------------------------------------

const load = () => loadavg().map((x) => x.toFixed(2)).join(" ");
console.log(
  `replicas bench: ${MESSAGES} messages over ${CHATS} chats per scenario, window ${WINDOW}, ${RUNS} run(s), ` +
    `replicas ${REPLICAS.join(",")} on the shared backends, ${CORES} cores, bun ${Bun.version}, load average ${load()}`,
);
const results = new Map<Scenario, Measured[]>();
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
      const m = await measure(s, run);
      list.push(m);
      const cpu = (x: number | null) => (x === null ? "-" : x.toFixed(2));
      console.log(
        `  run ${run}: ${s.label} × ${s.replicas}: ${m.rate.toFixed(0)} msgs/s (${m.seconds.toFixed(2)} s; CPU s: server ${
          cpu(m.server)
        }, replicas ${cpu(m.replicas)}, parent ${cpu(m.parent)}, machine ${cpu(m.machine)}; idle replica ${
          m.idlePerReplica === null ? "-" : m.idlePerReplica.toFixed(3)
        } cores each)`,
      );
    } catch (error) {
      console.log(`  run ${run}: ${s.label} × ${s.replicas}: FAILED: ${(error as Error).message.slice(0, 500)}`);
    }
  }
}

// ---- the table ---------------------------------------------------------------------------

function median(xs: number[]): number {
  const sorted = [...xs].sort((a, b) => a - b);
  return sorted.length === 0
    ? NaN
    : sorted.length % 2
    ? sorted[(sorted.length - 1) / 2]!
    : (sorted[sorted.length / 2 - 1]! + sorted[sorted.length / 2]!) / 2;
}
/** Median over the runs that have the number (NaN when none has it). */
const medianOf = (list: Measured[], pick: (m: Measured) => number | null) =>
  median(list.map(pick).filter((x): x is number => x !== null));

/** One scenario's medians: rate, and per 1000 messages / as busy cores, the CPU of each part. */
interface Row {
  s: Scenario;
  runs: Measured[];
  rate: number;
  per1k: { server: number; serverOurs: number; replicas: number; parent: number; machine: number };
  /** Cores busy on average over the window (CPU seconds / wall seconds). */
  cores: { server: number; replicas: number; parent: number; machine: number; other: number };
  /** Cores one idle replica uses. */
  idlePerReplica: number;
}
function rowOf(s: Scenario, runs: Measured[]): Row {
  const per1k = (pick: (m: Measured) => number | null) => medianOf(runs, (m) => { const x = pick(m); return x === null ? null : x * 1000 / MESSAGES; });
  const cores = (pick: (m: Measured) => number | null) => medianOf(runs, (m) => { const x = pick(m); return x === null ? null : x / m.seconds; });
  const other = (m: Measured) => m.machine === null ? null : Math.max(0, m.machine - (m.server ?? 0) - (m.replicas ?? 0) - m.parent);
  return {
    s,
    runs,
    rate: medianOf(runs, (m) => m.rate),
    per1k: {
      server: per1k((m) => m.server),
      serverOurs: per1k((m) => m.serverOurs),
      replicas: per1k((m) => m.replicas),
      parent: per1k((m) => m.parent),
      machine: per1k((m) => m.machine),
    },
    cores: {
      server: cores((m) => m.server),
      replicas: cores((m) => m.replicas),
      parent: cores((m) => m.parent),
      machine: cores((m) => m.machine),
      other: cores(other),
    },
    idlePerReplica: medianOf(runs, (m) => m.idlePerReplica),
  };
}
const rows = [...results].filter(([, runs]) => runs.length > 0).map(([s, runs]) => rowOf(s, runs));
const oneOf = (r: Row) => rows.find((x) => x.s.kind === r.s.kind && x.s.replicas === 1);

const num = (x: number, digits: number) => (Number.isNaN(x) ? "-" : x.toFixed(digits));
const table: string[][] = [[
  "backend",
  "replicas",
  "msgs/s (median)",
  "runs",
  "× 1 replica",
  "CPU s/1000 msgs: server",
  "(of it, our backends)",
  "replicas",
  "parent",
  `busy cores of ${CORES}: server / replicas / parent / other`,
]];
for (const r of rows) {
  const one = oneOf(r);
  table.push([
    r.s.label,
    String(r.s.replicas),
    num(r.rate, 0),
    r.runs.map((m) => m.rate.toFixed(0)).join(" / "),
    one ? num(r.rate / one.rate, 2) : "-",
    num(r.per1k.server, 3),
    num(r.per1k.serverOurs, 3),
    num(r.per1k.replicas, 3),
    num(r.per1k.parent, 3),
    `${num(r.cores.machine, 2)}: ${[r.cores.server, r.cores.replicas, r.cores.parent, r.cores.other].map((x) => num(x, 2)).join(" / ")}`,
  ]);
}
for (const [s, list] of results) if (list.length === 0) table.push([s.label, String(s.replicas), "failed", "-", "-", "-", "-", "-", "-", "-"]);
for (const [s, why] of skipped) table.push([s.label, String(s.replicas), "skipped", why, "-", "-", "-", "-", "-", "-"]);
const widths = table[0]!.map((_, i) => Math.max(...table.map((r) => r[i]!.length)));
console.log("");
for (const [i, r] of table.entries()) {
  console.log(`| ${r.map((c, j) => c.padEnd(widths[j]!)).join(" | ")} |`);
  if (i === 0) console.log(`| ${widths.map((w) => "-".repeat(w)).join(" | ")} |`);
}

// ---- the verdicts ----------------------------------------------------------------------------

/** A saturated machine: its busy cores reach this share of all cores. */
const SATURATED = 0.85;
/** A single-threaded server (redis-server) is bound when it uses this much of its one core. */
const ONE_CORE = 0.85;

/** What the rows of one backend say bounds it, from the numbers (the top replica count's row decides). */
function verdict(backend: Row[]): string {
  const first = backend[0]!;
  const last = backend.at(-1)!;
  const c = last.cores;
  const facts: string[] = [];
  if (backend.length > 1) {
    facts.push(`×${num(last.rate / first.rate, 2)} msgs/s from ${first.s.replicas} to ${last.s.replicas} replicas`);
    const trend = (a: number, b: number, what: string) => {
      if (Number.isNaN(a) || Number.isNaN(b) || a === 0) return;
      const g = b / a;
      facts.push(`${what} CPU per message ${g > 1.15 ? "grows" : g < 0.87 ? "shrinks" : "stays flat"} (×${g.toFixed(2)})`);
    };
    trend(first.per1k.server, last.per1k.server, "server");
    trend(first.per1k.serverOurs, last.per1k.serverOurs, "our backends'");
    trend(first.per1k.replicas, last.per1k.replicas, "replica");
    if (!Number.isNaN(last.idlePerReplica) && !Number.isNaN(last.per1k.replicas)) {
      // The part of the replicas' CPU per message that idle work (sweeps, timers) would explain.
      const idlePer1k = (last.idlePerReplica * last.s.replicas * 1000) / last.rate;
      facts.push(
        `an idle replica uses ${num(last.idlePerReplica, 3)} cores: at ${last.s.replicas} that is ${
          num((idlePer1k / last.per1k.replicas) * 100, 0)
        }% of their CPU per message`,
      );
    }
  }
  const perReplica = c.replicas / last.s.replicas;
  facts.push(
    `at ${last.s.replicas}: ${num(c.machine, 2)} of ${CORES} cores busy (server ${num(c.server, 2)}, replicas ${num(c.replicas, 2)} = ${
      num(perReplica, 2)
    } each${perReplica < 0.25 && c.machine < SATURATED * CORES ? ", idle-ish" : ""}, parent ${num(c.parent, 2)}, other ${num(c.other, 2)})`,
  );
  const ours: [string, number][] = (
    [
      ["bound by the server", c.server],
      ["client-bound (the replica processes)", c.replicas],
      ["bound by the bench parent (routing, reading lines)", c.parent],
    ] as [string, number][]
  ).filter(([, x]) => !Number.isNaN(x));
  const oursTotal = ours.reduce((sum, [, x]) => sum + x, 0);
  const [top, topCores] = [...ours].sort((a, b) => b[1] - a[1])[0] ?? ["?", NaN];
  const contended = c.other >= 0.25 ? `; other work on this machine took ${num(c.other, 2)} cores meanwhile: contended numbers` : "";
  let bound: string;
  const redis = last.s.kind === "redis" || last.s.kind === "upstash" || last.s.kind === "node-redis";
  if (redis && c.server >= ONE_CORE) {
    bound = `bound by the server: single-threaded redis-server at ${num(c.server, 2)} of its one core`;
  } else if (Number.isNaN(c.machine)) {
    bound = `the machine's busy time is unknown; the largest CPU share of this run: ${top}`;
  } else if (c.machine >= SATURATED * CORES) {
    bound = `all cores busy, ${top}: it takes ${num((topCores / oursTotal) * 100, 0)}% of this run's CPU${contended}`;
  } else {
    bound = `no CPU saturated (${num(c.machine, 2)} of ${CORES} cores busy): bound by waiting (round trips, fsync, locks), not CPU; ` +
      `the largest CPU share: ${top.replace(/^bound by |^client-bound /, "")}`;
  }
  return `${bound}; ${facts.join("; ")}`;
}

console.log("");
for (const label of [...new Set(rows.map((r) => r.s.label))]) {
  const backend = rows.filter((r) => r.s.label === label).sort((a, b) => a.s.replicas - b.s.replicas);
  console.log(`${label}: ${verdict(backend)}.`);
}
console.log(
  `\nserver = every \`postgres\` process (shared: other sessions count too; "our backends" = this run's replicas' connections) or the redis-server process (shared); ` +
    `parent = this process (routing, reading the replicas' lines${WITH_UPSTASH ? ", the Upstash bridge" : ""}); other = the machine's busy time minus these. ` +
    `Each column is its own median over the runs (so a row's parts need not add up exactly). ` +
    `CLK_TCK ${CLK_TCK}. Load average at the end: ${load()}.`,
);
process.exit(0);
