/**
 * The benchmark harness: one durable bot message (admitted, handled, one reply through the outbox, done)
 * per backend, side by side with BullMQ, pg-boss and graphile-worker doing the same work (an inbound job
 * whose processor adds a reply job keyed by the idempotency key, a reply worker that sends it) and doing
 * one job, with DBOS doing it as a workflow of two steps per message, and with a ceiling per server (our
 * protocol's writes as plain statements/commands on the same client); scale rows (retained journal) and
 * restart recovery. Every run is its own child process (bench/row.ts, bench/anchors/*.ts,
 * bench/ceilings/*.ts) on a fresh store; runs are interleaved across rows (round robin), after one
 * discarded warm-up round. The graphile-worker and DBOS anchors also run under Node (rows "(Node)"):
 * Bun.build bundles the anchor for Node (packages left external) into node_modules/.cache/botmesh-bench/.
 *
 *   bun bench/run.ts                      full run (≈ 30 min on the shared 2-core machine), writes bench/RESULTS.md
 *   bun bench/run.ts --quick              smoke (CI): 0.2 s runs, 1 round, scale 2k, recovery 500 (not 100k), no RESULTS.md
 *   options: --runs N (5)  --seconds S (2: each measured run)  --warm S (0.5: each child's own warm-up)
 *            --only postgres,pgboss,ceiling-postgres (durability off always runs: the × off base; the row
 *            names are OTHERS and KINDS in bench/lib.ts, e.g. graphile, graphile-node-1, dbos, dbos-node)
 *            --scale 1k,100k,1M  --scale-runs N (3)  --scale-max events-log=1M,redis=1M (both 100k by default:
 *            1M adds ≈ 10 min for the events journal, ≈ 7 min for Redis)  --recovery N (10000)  --recovery-large N (100000: Postgres,
 *            Redis AOF, SQLite NORMAL only; 0 = none)  --recovery-only (restart recovery alone)  --ceiling-groups N (4)
 *            --no-warmup-round  --no-scale  --no-recovery  --no-broadcast  --no-server-work  --write (RESULTS.md even with --quick)  --no-write
 *
 * Exits 1 only when a run was incorrect (a message not replied exactly once, a record left unfinished,
 * counts not the totals, a crash) or a required server is missing (BOTMESH_REQUIRE_SERVICES=1); never
 * because of a slow number.
 */
import { execFileSync } from "node:child_process";
import { readFileSync, rmSync, writeFileSync } from "node:fs";
import { cpus, release, totalmem } from "node:os";
import { join } from "node:path";
import { POSTGRES_URL, REDIS_URL, SERVICES_REQUIRED, tcpReachable } from "../tests/support/services.ts";
import { type UpstashBridge, startUpstashBridge } from "../tests/support/upstash_bridge.ts";
import { type AnyKind, createNs, dropNs, type Kind, KINDS, LABELS, type Ns, OTHERS, type RowResult, runtimeOf, scriptOf, type Server, serverOf } from "./lib.ts";
import { type AofRedis, cpuBetween, type CpuSample, postgresCpu, redisCpu, redisInfo, startAofRedis } from "./servers.ts";
import { lines as serverWorkLines } from "./server_work.ts";

// ---- options -----------------------------------------------------------------------

const argv = process.argv.slice(2);
const flag = (name: string) => argv.includes(name);
const value = (name: string) => {
  const i = argv.indexOf(name);
  return i >= 0 ? argv[i + 1] : undefined;
};
const QUICK = flag("--quick");
const RUNS = Number(value("--runs") ?? (QUICK ? 1 : 5));
const SECONDS = Number(value("--seconds") ?? (QUICK ? 0.2 : 2));
const WARM = Number(value("--warm") ?? (QUICK ? 0.05 : 0.5));
const WARMUP_ROUND = !QUICK && !flag("--no-warmup-round");
const WARMUP_SECONDS = Math.min(1, SECONDS);
const ONLY = value("--only")?.split(",").map((s) => s.trim());
const parseSize = (s: string) => Number(s.toLowerCase().replace(/k$/, "e3").replace(/m$/, "e6"));
const SCALE = flag("--no-scale") || flag("--recovery-only") ? [] : (value("--scale") ?? (QUICK ? "2k" : "1k,100k,1M")).split(",").map(parseSize);
const SCALE_RUNS = Number(value("--scale-runs") ?? (QUICK ? 1 : 3));
const WRITE = flag("--write") || (!QUICK && !flag("--no-write"));
const CEILING_GROUPS = Number(value("--ceiling-groups") ?? 4);
const SCENARIOS = [
  { name: "100 chats", chats: 100 },
  { name: "1 chat (sequential)", chats: 1 },
];
const RECOVERY_RECORDS = flag("--no-recovery") ? 0 : Number(value("--recovery") ?? (QUICK ? 500 : 10_000));
/** The larger restart recovery (linear in the backlog: 10× the records, 10× the time), on the kinds of {@link RECOVERY_LARGE_KINDS}. */
const RECOVERY_LARGE = flag("--no-recovery") ? 0 : Number(value("--recovery-large") ?? (QUICK ? 0 : 100_000));
/** Only the restart recovery rows (no throughput, scale or broadcast tables). */
const RECOVERY_ONLY = flag("--recovery-only");
const SCALE_KINDS: Kind[] = ["sqlite-normal", "postgres", "redis", "events-log"];
/** The broadcasts of the rate-limited broadcast table. */
const BROADCASTS = QUICK
  ? [{ messages: 200, chats: 20, rate: 100, chatMs: 100 }]
  : [{ messages: 1000, chats: 100, rate: 100, chatMs: 500 }, { messages: 5000, chats: 500, rate: 300, chatMs: 100 }];
const RECOVERY_KINDS: Kind[] = ["file", "sqlite-normal", "sqlite-full", "events", "events-log", "postgres", "redis-aof", "redis", "upstash"];
const RECOVERY_LARGE_KINDS: Kind[] = ["sqlite-normal", "postgres", "redis-aof"];
const CHILD_TIMEOUT_MS = 15 * 60_000;
const selected = (k: string) => !ONLY || ONLY.includes(k);

const log = (s: string) => process.stderr.write(s + "\n");
const fmtInt = (n: number | null | undefined) => n !== null && n !== undefined && Number.isFinite(n) ? Math.round(n).toLocaleString("en-US") : "–";
const fmt = (n: number | null | undefined, d = 2) => n === null || n === undefined || !Number.isFinite(n) ? "–" : n.toFixed(d);
const medianOf = <T>(xs: T[], key: (x: T) => number) => [...xs].sort((a, b) => key(a) - key(b))[Math.floor((xs.length - 1) / 2)]!;

// ---- machine and servers -----------------------------------------------------------------

function sh(cmd: string, args: string[]): string {
  try {
    return execFileSync(cmd, args, { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"] }).trim();
  } catch {
    return "?";
  }
}
const pkg = (name: string) => {
  try {
    return JSON.parse(readFileSync(join(import.meta.dir, "..", "node_modules", name, "package.json"), "utf8")).version as string;
  } catch {
    return "?";
  }
};

let failures = 0;
const failureNotes: string[] = [];
const fail = (what: string) => {
  failures++;
  failureNotes.push(what);
  log(`FAILED: ${what}`);
};

const started = Date.now();
const command = `bun bench/run.ts${argv.length ? " " + argv.join(" ") : ""}`;
const notes: string[] = [];
/** Node on the PATH runs the "(Node)" anchor rows; without it they are left out. */
const NODE_VERSION = sh("node", ["--version"]);
const hasNode = NODE_VERSION !== "?";
if (!hasNode && [...OTHERS].some((k) => runtimeOf(k) === "node" && selected(k))) notes.push("node is not on the PATH: the (Node) rows are left out.");
/** Where the anchors bundled for Node go (this run's own folder, removed at the end). */
const NODE_OUT = join(import.meta.dir, "..", "node_modules", ".cache", "botmesh-bench", `run-${process.pid}`);
const nodeBuilds = new Map<string, Promise<string>>();
/**
 * A bench script bundled for Node, once per run: Bun.build, target node, ESM, every package left external
 * (imported from node_modules as Node resolves it, the packages' own Node builds); our TypeScript
 * (bench/lib.ts, the mock provider) compiled in.
 */
function forNode(script: string): Promise<string> {
  let p = nodeBuilds.get(script);
  if (!p) {
    p = Bun.build({ entrypoints: [join(import.meta.dir, script)], outdir: NODE_OUT, target: "node", format: "esm", packages: "external", naming: "[name].mjs" })
      .then((out) => {
        if (!out.success || !out.outputs[0]) throw new Error(`bundling ${script} for Node failed: ${out.logs.map(String).join("; ")}`);
        return out.outputs[0].path;
      });
    nodeBuilds.set(script, p);
  }
  return p;
}
const up: Record<Server, boolean> = { postgres: false, redis: false, "redis-aof": false };
for (const [server, url, port] of [["postgres", POSTGRES_URL, 5432], ["redis", REDIS_URL, 6379]] as const) {
  const u = new URL(url);
  up[server] = await tcpReachable(u.hostname, Number(u.port || port));
  if (!up[server]) {
    if (SERVICES_REQUIRED) {
      log(`BOTMESH_REQUIRE_SERVICES=1 but ${server} is not reachable at ${u.host}`);
      process.exit(1);
    }
    notes.push(`${server} is not reachable at ${u.host}: its rows are left out.`);
  }
}
const wantsAof = [...KINDS, ...OTHERS].some((k) => serverOf(k) === "redis-aof" && selected(k)) || RECOVERY_KINDS.some((k) => serverOf(k) === "redis-aof" && selected(k));
const aof: AofRedis | null = wantsAof ? await startAofRedis() : null;
up["redis-aof"] = aof !== null;
if (wantsAof && !aof) {
  if (SERVICES_REQUIRED) {
    log("BOTMESH_REQUIRE_SERVICES=1 but the bench could not start redis-server (AOF) on a port from 6380");
    process.exit(1);
  }
  notes.push("redis-server could not be started for the AOF rows: they are left out.");
}

async function main(): Promise<void> {
  const { default: postgres } = await import("postgres");
  const pg = up.postgres ? postgres(POSTGRES_URL, { max: 1, onnotice: () => {}, connection: { application_name: "botmesh-bench-orchestrator" } }) : null;
  const redisServers: Record<"redis" | "redis-aof", { pid: number | null; version: string; persistence: string } | null> = {
    redis: up.redis ? await redisInfo(REDIS_URL) : null,
    "redis-aof": aof ? await redisInfo(aof.url) : null,
  };
  let pgInfo = { version: "not reachable", persistence: "" };
  if (pg) {
    const show = async (name: string) => Object.values((await pg.unsafe(`SHOW ${name}`))[0]!)[0] as string;
    pgInfo = {
      version: await show("server_version"),
      persistence: `fsync ${await show("fsync")}, synchronous_commit ${await show("synchronous_commit")}, full_page_writes ${await show("full_page_writes")}, wal_sync_method ${
        await show("wal_sync_method")
      }`,
    };
  }
  const model = /model name\s*:\s*(.*)/.exec(readFileSync("/proc/cpuinfo", "utf8"))?.[1] ?? cpus()[0]?.model ?? "?";
  const os = /PRETTY_NAME="([^"]*)"/.exec((() => {
    try {
      return readFileSync("/etc/os-release", "utf8");
    } catch {
      return "";
    }
  })())?.[1] ?? "?";
  const header = [
    `CPU: ${model}, ${cpus().length} cores; RAM ${(totalmem() / 2 ** 30).toFixed(1)} GiB; ${os}, Linux ${release()}`,
    `Bun ${process.versions.bun}, Node ${NODE_VERSION}, PostgreSQL ${pgInfo.version}, Redis ${redisServers.redis?.version ?? redisServers["redis-aof"]?.version ?? "not reachable"}`,
    `packages: bullmq ${pkg("bullmq")}, pg-boss ${pkg("pg-boss")}, graphile-worker ${pkg("graphile-worker")}, @dbos-inc/dbos-sdk ${pkg("@dbos-inc/dbos-sdk")}, pg ${pkg("pg")}, postgres ${pkg("postgres")}, ioredis ${pkg("ioredis")}, @upstash/redis ${pkg("@upstash/redis")}`,
    `Postgres (${new URL(POSTGRES_URL).host}): ${pg ? pgInfo.persistence : "not reachable"} (SHOW); the rows on it: ours, pg-boss, graphile-worker, DBOS, its ceiling`,
    `Redis, durable (${aof ? `${new URL(aof.url).host}, started by the bench in a temp dir` : "not started"}): ${
      redisServers["redis-aof"]?.persistence ?? "–"
    } (CONFIG GET); the rows on it: ours "AOF everysec", BullMQ "AOF everysec", its ceiling`,
    `Redis, not durable (${new URL(REDIS_URL).host}, the shared test server): ${redisServers.redis?.persistence ?? "not reachable"} (CONFIG GET); its rows are labelled "not durable"`,
  ];
  console.log(`# @botmesh/durable benchmarks\n\n${command}  (${new Date(started).toISOString()})\n${header.join("\n")}\n`);

  /**
   * Before a scale or recovery row: what the row before it left behind is written out first (a dropped
   * schema of a million rows, the files of a deleted store), so that it does not fall on this row:
   * Postgres `CHECKPOINT`, then `sync`, then up to 30 s for the machine's CPU to stay under 20% busy
   * for a second (/proc/stat; skipped where there is none).
   */
  const settle = async (): Promise<void> => {
    if (pg) await pg.unsafe("CHECKPOINT").catch(() => {});
    sh("sync", []);
    const busy = (): [number, number] | null => {
      try {
        const f = readFileSync("/proc/stat", "utf8").split("\n")[0]!.trim().split(/\s+/).slice(1).map(Number);
        const idle = f[3]! + f[4]!;
        return [f.reduce((a, b) => a + b, 0) - idle, idle];
      } catch {
        return null;
      }
    };
    for (const until = Date.now() + 30_000; Date.now() < until;) {
      const a = busy();
      await Bun.sleep(1000);
      const b = busy();
      if (!a || !b) return;
      const used = b[0] - a[0], all = used + b[1] - a[1];
      if (all > 0 && used / all < 0.2) return;
    }
  };

  const sample = async (server: Server | null, ns: Ns): Promise<CpuSample | null> => {
    if (server === "postgres") return pg && ns.app ? await postgresCpu(pg, ns.app) : null;
    if (server === "redis" || server === "redis-aof") return redisCpu(redisServers[server]?.pid ?? null);
    return null;
  };

  /**
   * Runs one child; it prints `@@start` and `@@end` around its measured interval and waits for an answer
   * on stdin, so the server CPU is sampled at those moments; its last stdout line is its JSON result. A
   * failure is counted and reported, not thrown.
   */
  async function child(script: string, config: Record<string, unknown> & { ns: Ns }, what: string): Promise<RowResult | null> {
    const server = serverOf(config.ns.kind);
    let argv0 = [process.execPath, join(import.meta.dir, script)];
    if (runtimeOf(config.ns.kind) === "node") {
      try {
        argv0 = ["node", await forNode(script)];
      } catch (error) {
        fail(`${what}: ${error instanceof Error ? error.message : String(error)}`);
        return null;
      }
    }
    const proc = Bun.spawn([...argv0, JSON.stringify(config)], {
      stdin: "pipe",
      stdout: "pipe",
      stderr: "inherit",
      env: { ...process.env, BENCH_ACK: "1" },
    });
    const timer = setTimeout(() => proc.kill("SIGKILL"), CHILD_TIMEOUT_MS);
    let cpuStart: CpuSample | null = null, cpuEnd: CpuSample | null = null, last = "";
    const decoder = new TextDecoder();
    let buf = "";
    const reader = proc.stdout.getReader();
    for (;;) {
      const { done, value: chunk } = await reader.read();
      if (done) break;
      buf += decoder.decode(chunk, { stream: true });
      let i;
      while ((i = buf.indexOf("\n")) >= 0) {
        const line = buf.slice(0, i).trim();
        buf = buf.slice(i + 1);
        if (line === "@@start" || line === "@@end") {
          const s = await sample(server, config.ns);
          if (line === "@@start") cpuStart = s;
          else cpuEnd = s;
          proc.stdin.write("ok\n");
          proc.stdin.flush();
        } else if (line) last = line;
      }
    }
    if (buf.trim()) last = buf.trim();
    const code = await proc.exited;
    clearTimeout(timer);
    if (code === 0) {
      try {
        const result = JSON.parse(last) as RowResult;
        const ms = cpuBetween(cpuStart, cpuEnd);
        if (ms !== null && result.messages > 0) result.serverUsPerMsg = (ms * 1000) / result.messages;
        return result;
      } catch { /* reported below */ }
    }
    fail(`${what}: exit ${code}`);
    return null;
  }

  const bridge: UpstashBridge | undefined = up.redis && selected("upstash") ? await startUpstashBridge() : undefined;
  const nsFor = (kind: AnyKind) =>
    createNs(kind, {
      ...(serverOf(kind) === "redis-aof" && aof ? { redisUrl: aof.url } : {}),
      ...(kind === "upstash" && bridge ? { upstash: { url: bridge.url, token: bridge.token } } : {}),
    });
  const available = (k: AnyKind) => {
    const s = serverOf(k);
    return (s === null || up[s]) && (runtimeOf(k) !== "node" || hasNode);
  };
  const configOf = (kind: AnyKind, chats: number, seconds: number): Record<string, unknown> => {
    const base = { mode: "load", chats, seconds, warmSeconds: WARM };
    if (kind.startsWith("pgboss")) return { ...base, batchSize: chats === 1 ? 1 : 100, oneJob: kind.endsWith("-1") };
    if (kind.startsWith("graphile")) return { ...base, concurrency: chats, oneJob: kind.endsWith("-1") };
    if (kind.startsWith("bullmq")) return { ...base, oneJob: kind.endsWith("-1") };
    if (kind === "ceiling-postgres") return { ...base, groups: CEILING_GROUPS };
    return base;
  };

  // ---- throughput rows: round robin, warm-up round discarded -----------------------------------

  const loadKinds: AnyKind[] = [...KINDS.filter((k) => selected(k) || k === "off"), ...OTHERS.filter(selected)].filter(available);
  const results = new Map<string, RowResult[]>();
  const keyOf = (kind: AnyKind, scenario: string) => `${kind}\u0000${scenario}`;
  const rounds = RECOVERY_ONLY ? 0 : RUNS + (WARMUP_ROUND ? 1 : 0);
  for (let round = 0; round < rounds; round++) {
    const warm = WARMUP_ROUND && round === 0;
    for (const sc of SCENARIOS) {
      for (const kind of loadKinds) {
        log(`${warm ? "warm-up" : `run ${round + (WARMUP_ROUND ? 0 : 1)}/${RUNS}`} · ${LABELS[kind]} · ${sc.name}`);
        const ns = nsFor(kind);
        try {
          const res = await child(scriptOf(kind), { ...configOf(kind, sc.chats, warm ? WARMUP_SECONDS : SECONDS), ns }, `${LABELS[kind]}, ${sc.name}${warm ? " (warm-up)" : ""}`);
          if (res && !warm) {
            const list = results.get(keyOf(kind, sc.name)) ?? [];
            list.push(res);
            results.set(keyOf(kind, sc.name), list);
          }
        } finally {
          await dropNs(ns).catch((e) => log(`drop ${ns.name}: ${e}`));
        }
      }
    }
  }

  // ---- scale rows ----------------------------------------------------------------------------

  interface ScaleRow {
    kind: Kind;
    size: number;
    runs: RowResult[];
    prefillS: number;
  }
  const scaleRows: ScaleRow[] = [];
  // The largest size per kind: the events journal is one JSON snapshot (1M: ≈ 5 min of prefill, ≈ 2 min a
  // run, 4 GB); copying 1M messages' keys into Redis takes ≈ 5 min on this machine.
  const scaleMax = new Map(Object.entries({ "events-log": "100k", redis: "100k" }).map(([k, v]) => [k, parseSize(v)]));
  for (const item of (value("--scale-max") ?? "").split(",").filter(Boolean)) {
    const [k, v] = item.split("=");
    scaleMax.set(k!.trim(), parseSize(v!.trim()));
  }
  for (const kind of SCALE_KINDS.filter((k) => selected(k) && available(k))) {
    for (const size of SCALE) {
      if (size > (scaleMax.get(kind) ?? Infinity)) continue;
      const ns = nsFor(kind);
      try {
        log(`scale · ${LABELS[kind]} · ${size.toLocaleString("en-US")} retained`);
        await settle();
        const t0 = performance.now();
        const pre = Bun.spawn([process.execPath, join(import.meta.dir, "prefill.ts"), JSON.stringify({ ns, count: size, chats: 100 })], { stdout: "inherit", stderr: "inherit" });
        if (await pre.exited !== 0) {
          fail(`prefill ${LABELS[kind]} ${size}`);
          scaleRows.push({ kind, size, runs: [], prefillS: NaN });
          continue;
        }
        const prefillS = (performance.now() - t0) / 1000;
        const runs: RowResult[] = [];
        for (let r = 0; r < SCALE_RUNS; r++) {
          const res = await child("row.ts", { mode: "load", ns, chats: 100, seconds: SECONDS, warmSeconds: WARM, idPrefix: `s${r}-`, retained: size }, `scale ${LABELS[kind]} ${size} run ${r + 1}`);
          if (res) runs.push(res);
        }
        scaleRows.push({ kind, size, runs, prefillS });
      } finally {
        await dropNs(ns).catch((e) => log(`drop ${ns.name}: ${e}`));
      }
    }
  }

  // ---- restart recovery ------------------------------------------------------------------------

  const recoveryRows: { kind: Kind; records: number; result: RowResult | null }[] = [];
  const recoveryRuns: [Kind[], number][] = [[RECOVERY_KINDS, RECOVERY_RECORDS], [RECOVERY_LARGE_KINDS, RECOVERY_LARGE]];
  for (const [kinds, records] of recoveryRuns) {
    if (!(records > 0)) continue;
    for (const kind of kinds.filter((k) => selected(k) && available(k))) {
      const ns = nsFor(kind);
      try {
        log(`recovery · ${LABELS[kind]} · ${records} records`);
        await settle();
        recoveryRows.push({ kind, records, result: await child("row.ts", { mode: "recovery", ns, records }, `recovery ${LABELS[kind]} ${records}`) });
      } finally {
        await dropNs(ns).catch((e) => log(`drop ${ns.name}: ${e}`));
      }
    }
  }
  // ---- server work per message ---------------------------------------------------------------

  let serverWork: string[] = [];
  if (!QUICK && !RECOVERY_ONLY && !flag("--no-server-work")) {
    log("server work per message (ours and the ceilings)");
    serverWork = await serverWorkLines({ seconds: SECONDS, runs: 3 }).catch((error) => {
      fail(`server work: ${error instanceof Error ? error.message : String(error)}`);
      return [];
    });
  }

  // ---- rate-limited broadcast ------------------------------------------------------------------

  const broadcastRows: Record<string, number>[] = [];
  if (!flag("--no-broadcast") && !RECOVERY_ONLY) {
    for (const config of BROADCASTS) {
      log(`broadcast · ${config.messages} messages · ${config.rate}/s`);
      const proc = Bun.spawn([process.execPath, join(import.meta.dir, "broadcast.bench.ts"), JSON.stringify(config)], { stdout: "pipe", stderr: "inherit" });
      const out = await new Response(proc.stdout).text();
      const code = await proc.exited;
      const line = out.trim().split("\n").pop() ?? "";
      try {
        broadcastRows.push(JSON.parse(line));
      } catch {
        fail(`broadcast ${config.messages} at ${config.rate}/s: no result (${line.slice(0, 200)})`);
        continue;
      }
      if (code !== 0) fail(`broadcast ${config.messages} at ${config.rate}/s: a message was not sent exactly once in its chat's order`);
    }
  }
  await bridge?.stop();
  await pg?.end({ timeout: 2 });

  // ---- tables ----------------------------------------------------------------------------------

  const runsOf = (kind: AnyKind, scenario: string) => results.get(keyOf(kind, scenario)) ?? [];
  const med = (kind: AnyKind, scenario: string) => {
    const rs = runsOf(kind, scenario);
    return rs.length ? medianOf(rs, (x) => x.msgPerSec) : null;
  };
  /** The rows a row is compared with: its equal-work anchors, its one-job anchors, its ceiling. */
  const compare: Partial<Record<AnyKind, { equal: AnyKind[]; one: AnyKind[]; ceiling: AnyKind }>> = {
    postgres: {
      equal: ["pgboss", "graphile", "graphile-node", "dbos", "dbos-node"],
      one: ["pgboss-1", "graphile-1", "graphile-node-1"],
      ceiling: "ceiling-postgres",
    },
    "redis-aof": { equal: ["bullmq-aof"], one: ["bullmq-aof-1"], ceiling: "ceiling-redis-aof" },
    redis: { equal: ["bullmq"], one: ["bullmq-1"], ceiling: "ceiling-redis" },
    upstash: { equal: ["bullmq"], one: ["bullmq-1"], ceiling: "ceiling-redis" },
  };
  const ceilingOf: Partial<Record<AnyKind, AnyKind>> = {
    pgboss: "ceiling-postgres",
    "pgboss-1": "ceiling-postgres",
    graphile: "ceiling-postgres",
    "graphile-1": "ceiling-postgres",
    "graphile-node": "ceiling-postgres",
    "graphile-node-1": "ceiling-postgres",
    dbos: "ceiling-postgres",
    "dbos-node": "ceiling-postgres",
    "bullmq-aof": "ceiling-redis-aof",
    "bullmq-aof-1": "ceiling-redis-aof",
    bullmq: "ceiling-redis",
    "bullmq-1": "ceiling-redis",
  };
  const ratio = (a: RowResult | null, b: AnyKind | undefined, scenario: string) => {
    const r = b ? med(b, scenario) : null;
    return a && r ? fmt(a.msgPerSec / r.msgPerSec) : "";
  };
  /** A peer in a list of ratios: its label without the kind of work ("graphile-worker (Node)"). */
  const peerName = (k: AnyKind) => LABELS[k].replace(/, (equal work|one job)$/, "");
  /** The ratios of a row to several peers, each named ("3.06 pg-boss, 2.50 DBOS"); one peer: the bare ratio. */
  const ratios = (a: RowResult | null, peers: AnyKind[], scenario: string) => {
    if (peers.length === 1) return ratio(a, peers[0], scenario);
    return peers.flatMap((b) => {
      const r = med(b, scenario);
      return a && r ? [`${fmt(a.msgPerSec / r.msgPerSec)} ${peerName(b)}`] : [];
    }).join(", ");
  };
  const runsShown = `${RUNS} run${RUNS === 1 ? "" : "s"}`;
  const mainTables: string[] = [];
  for (const sc of SCENARIOS) {
    mainTables.push(
      `### ${sc.name}`,
      "",
      `| row | msg/s median (min – max of ${runsShown}) | p50 ms | p99 ms | client CPU µs/msg | server CPU µs/msg | peak RSS MB | × off | × equal-work anchor | × one-job anchor | × ceiling |`,
      "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    );
    for (const kind of loadKinds) {
      const rs = runsOf(kind, sc.name);
      const m = med(kind, sc.name);
      const off = med("off", sc.name);
      const cmp = compare[kind];
      const span = rs.length > 1 ? ` (${fmtInt(Math.min(...rs.map((r) => r.msgPerSec)))} – ${fmtInt(Math.max(...rs.map((r) => r.msgPerSec)))})` : "";
      mainTables.push(
        `| ${LABELS[kind]} | ${m ? `**${fmtInt(m.msgPerSec)}**${span}` : "FAILED"} | ${fmt(m?.p50)} | ${fmt(m?.p99)} | ${fmt(m?.cpuUsPerMsg, 0)} | ${fmt(m?.serverUsPerMsg, 0)} | ${fmt(m?.rssMb, 0)} | ${
          kind !== "off" && m && off && (KINDS as readonly string[]).includes(kind) ? fmt(m.msgPerSec / off.msgPerSec) : ""
        } | ${cmp ? ratios(m, cmp.equal, sc.name) : ""} | ${cmp ? ratios(m, cmp.one, sc.name) : ""} | ${ratio(m, cmp ? cmp.ceiling : ceilingOf[kind], sc.name)} |`,
      );
    }
    mainTables.push("");
  }

  const scaleTable = [
    `| backend | done messages retained (chats c0…c99, the live ones) | µs/msg median (min – max of ${SCALE_RUNS}) | msg/s | p50 ms | p99 ms | cost × vs ${SCALE[0] ? SCALE[0].toLocaleString("en-US") : "first"} | prefill + checkpoint s |`,
    "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
  ];
  const scaleMed = (s: ScaleRow) => s.runs.length ? medianOf(s.runs, (x) => x.msgPerSec) : null;
  for (const s of scaleRows) {
    const m = scaleMed(s);
    const first = scaleRows.find((x) => x.kind === s.kind && x.runs.length);
    const f = first ? scaleMed(first) : null;
    const us = (r: RowResult) => 1e6 / r.msgPerSec;
    scaleTable.push(
      `| ${LABELS[s.kind]} | ${s.size.toLocaleString("en-US")} | ${m ? `${fmt(us(m), 1)} (${fmt(Math.min(...s.runs.map(us)), 1)} – ${fmt(Math.max(...s.runs.map(us)), 1)})` : "FAILED"} | ${
        fmtInt(m?.msgPerSec)
      } | ${fmt(m?.p50)} | ${fmt(m?.p99)} | ${f && m ? fmt(us(m) / us(f)) : ""} | ${fmt(s.prefillS, 1)} |`,
    );
  }

  const recoveryTable = [
    `| backend | unfinished records | all claimed by the new incarnation (ms) | all replied, bot idle (ms) | bot.start() resolved (ms) | all replied ≤ 2 s per 10,000 |`,
    "| --- | ---: | ---: | ---: | ---: | --- |",
  ];
  /** The time a recovery of `records` may take: 2 s per 10,000 (linear in the backlog). */
  const recoveryBudgetMs = (records: number) => 2000 * records / 10_000;
  for (const r of recoveryRows) {
    const res = r.result;
    recoveryTable.push(
      `| ${LABELS[r.kind]} | ${r.records.toLocaleString("en-US")} | ${res ? fmt(res.claimedMs, 0) : "FAILED"} | ${fmt(res?.doneMs, 0)} | ${fmt(res?.startMs, 0)} | ${
        res ? (res.doneMs! <= recoveryBudgetMs(r.records) ? "met" : "not met") : ""
      } |`,
    );
  }

  // ---- targets, judged from the numbers above ------------------------------------------

  const targets = ["| target | measured | |", "| --- | ---: | --- |"];
  const hundred = SCENARIOS[0]!.name, seq = SCENARIOS[1]!.name;
  const judge = (what: string, measured: number | null, ok: (x: number) => boolean, shown: (x: number) => string) =>
    targets.push(`| ${what} | ${measured === null || !Number.isFinite(measured) ? "not measured" : shown(measured)} | ${measured === null || !Number.isFinite(measured) ? "" : ok(measured) ? "met" : "**not met**"} |`);
  const rel = (a: AnyKind, b: AnyKind, sc = hundred) => {
    const x = med(a, sc), y = med(b, sc);
    return x && y ? x.msgPerSec / y.msgPerSec : null;
  };
  const rate = (k: AnyKind, sc = hundred) => med(k, sc)?.msgPerSec ?? null;
  const times = (x: number) => `${fmt(x)}×`;
  /** A row over the faster (median msg/s) of a peer's rows under Bun and under Node, and which that was. */
  const relFaster = (a: AnyKind, peers: AnyKind[], sc = hundred) => {
    const x = med(a, sc);
    const ys = peers.flatMap((b) => {
      const y = med(b, sc);
      return y ? [{ b, y }] : [];
    }).sort((p, q) => q.y.msgPerSec - p.y.msgPerSec);
    return x && ys[0] ? { x: x.msgPerSec / ys[0].y.msgPerSec, against: runtimeOf(ys[0].b) === "node" ? "Node" : "Bun" } : null;
  };
  judge("Postgres ≥ 2× pg-boss, equal work (100 chats)", rel("postgres", "pgboss"), (x) => x >= 2, times);
  for (const [name, peers] of [["graphile-worker", ["graphile", "graphile-node"]], ["DBOS", ["dbos", "dbos-node"]]] as const) {
    const r = relFaster("postgres", [...peers]);
    judge(`Postgres ≥ 2× ${name}, equal work (100 chats${r ? `; against its faster runtime, ${r.against}` : ""})`, r?.x ?? null, (x) => x >= 2, times);
  }
  judge("Postgres ≥ 1.5× pg-boss, one job (100 chats)", rel("postgres", "pgboss-1"), (x) => x >= 1.5, times);
  judge("Postgres ≥ 0.7 of the Postgres ceiling (100 chats)", rel("postgres", "ceiling-postgres"), (x) => x >= 0.7, times);
  judge("Redis AOF everysec ≥ 2× BullMQ AOF everysec, equal work (100 chats)", rel("redis-aof", "bullmq-aof"), (x) => x >= 2, times);
  judge("Redis AOF everysec ≥ 1.2× BullMQ AOF everysec, one job (100 chats)", rel("redis-aof", "bullmq-aof-1"), (x) => x >= 1.2, times);
  judge("Redis AOF everysec ≥ 0.5 of the Redis AOF ceiling (100 chats)", rel("redis-aof", "ceiling-redis-aof"), (x) => x >= 0.5, times);
  judge("SQLite synchronous=NORMAL ≥ 20,000 msg/s (100 chats)", rate("sqlite-normal"), (x) => x >= 20_000, fmtInt);
  judge("SQLite synchronous=FULL ≥ 10,000 msg/s (100 chats)", rate("sqlite-full"), (x) => x >= 10_000, fmtInt);
  judge("memory ≥ 0.4× durability off (100 chats)", rel("memory", "off"), (x) => x >= 0.4, times);
  judge("file ≥ 1,000 msg/s, 1 chat", rate("file", seq), (x) => x >= 1_000, fmtInt);
  judge("file ≥ 5,000 msg/s, 100 chats", rate("file"), (x) => x >= 5_000, fmtInt);
  judge("events journal (shared file) ≥ 2,000 msg/s, 100 chats", rate("events"), (x) => x >= 2_000, fmtInt);
  judge("events journal + appendLog ≥ 2,000 msg/s, 100 chats", rate("events-log"), (x) => x >= 2_000, fmtInt);
  {
    const ev = scaleRows.filter((s) => s.kind === "events-log" && s.runs.length);
    const a = ev[0], b = ev.at(-1);
    const cost = a && b && a !== b ? scaleMed(a)!.msgPerSec / scaleMed(b)!.msgPerSec : null;
    judge(
      `appendLog cost ≤ 1.3× from 1k to 1M records${a && b && a !== b ? ` (measured ${a.size.toLocaleString("en-US")} → ${b.size.toLocaleString("en-US")}${b.size < 1_000_000 ? "; 1M with --scale-max events-log=1M" : ""})` : ""}`,
      cost,
      (x) => x <= 1.3,
      times,
    );
  }
  for (const kind of ["sqlite-normal", "sqlite-full", "postgres", "redis-aof"] as const) {
    const r = recoveryRows.find((x) => x.kind === kind && x.records === RECOVERY_RECORDS);
    judge(
      `restart recovery of 10,000 unfinished records, all replied ≤ 2 s: ${LABELS[kind]}${RECOVERY_RECORDS > 0 && RECOVERY_RECORDS !== 10_000 ? ` (measured with ${RECOVERY_RECORDS.toLocaleString("en-US")})` : ""}`,
      r?.result?.doneMs ?? null,
      (x) => x <= recoveryBudgetMs(RECOVERY_RECORDS),
      (x) => `${fmtInt(x)} ms`,
    );
  }
  for (const kind of RECOVERY_LARGE_KINDS) {
    const r = recoveryRows.find((x) => x.kind === kind && x.records === RECOVERY_LARGE);
    judge(
      `restart recovery of 100,000 unfinished records, all replied ≤ 20 s: ${LABELS[kind]}${RECOVERY_LARGE > 0 && RECOVERY_LARGE !== 100_000 ? ` (measured with ${RECOVERY_LARGE.toLocaleString("en-US")})` : ""}`,
      r?.result?.doneMs ?? null,
      (x) => x <= recoveryBudgetMs(RECOVERY_LARGE),
      (x) => `${fmtInt(x)} ms`,
    );
  }
  for (const kind of RECOVERY_LARGE_KINDS) {
    const small = recoveryRows.find((x) => x.kind === kind && x.records === RECOVERY_RECORDS)?.result;
    const large = recoveryRows.find((x) => x.kind === kind && x.records === RECOVERY_LARGE)?.result;
    const factor = RECOVERY_LARGE / RECOVERY_RECORDS;
    judge(
      `restart recovery linear in the backlog, all replied ${fmtInt(RECOVERY_LARGE)} / ${fmtInt(RECOVERY_RECORDS)} ≤ ${fmt(factor, 0)}×: ${LABELS[kind]}`,
      small && large && RECOVERY_RECORDS > 0 ? large.doneMs! / small.doneMs! : null,
      (x) => x <= factor,
      times,
    );
  }
  for (const [kind, max] of [["sqlite-full", 1.1], ["redis-aof", 0.6], ["postgres", 2.5]] as const) {
    judge(`p50 receive→reply ≤ ${max} ms, 1 chat: ${LABELS[kind]}`, med(kind, seq)?.p50 ?? null, (x) => x <= max, (x) => `${fmt(x)} ms`);
  }

  const pgNote = med("pgboss", hundred)?.note ?? "see bench/anchors/pgboss.ts";
  const gwNote = (med("graphile", hundred) ?? med("graphile-node", hundred))?.note ?? "see bench/anchors/graphile.ts";
  const dbosNote = (med("dbos", hundred) ?? med("dbos-node", hundred))?.note ?? "see bench/anchors/dbos.ts";
  const explain = [
    `Every row runs ${runsShown} of at least ${SECONDS} s each (after a ${WARM} s warm-up in the same process, drained and not measured)${
      WARMUP_ROUND ? `, after one discarded warm-up round (${WARMUP_SECONDS} s runs)` : ""
    }. Rounds go round robin: run 1 of every row, then run 2 of every row, and so on, so a slow minute of this shared 2-core machine falls on every row alike. The bold number is the median run's; p50/p99, client CPU, server CPU and peak RSS are those of the median run.`,
    "",
    "- A message (ours): `provider.receive()` admits it (journaled), the handler calls `ctx.reply()` once, the reply goes out through the outbox (journaled, leased) to an in-process mock provider that answers at once (BenchProvider, bench/lib.ts), it is marked sent, the record done. Closed loop: each chat sends its next message once the reply to its previous one was sent; the measured interval runs until the deadline, then waits for the work in flight (`bot.idle()`).",
    "- Equal-work anchors: per message an inbound job; its processor adds a reply job with `jobId` (BullMQ) / `id` (pg-boss, a uuid derived from the key) / `jobKey` (graphile-worker) = the idempotency key, so a retried processor adds no second reply; a reply worker sends it to the same mock provider; both jobs completed (the interval ends once both queues' jobs are all completed; graphile-worker deletes completed jobs: once its job table is empty). DBOS: per message a workflow started with workflow ID = the message id (its idempotency key), of two checkpointed steps, handle the message and send the reply to the same mock provider; the interval ends once every workflow's result is recorded. The closed loop closes on that send, as ours does. One-job anchors: one job per message, nothing sent; the loop closes on the job's completion (BullMQ `completed` event) or its handler having run (pg-boss, graphile-worker); they do half our durable work and are labelled so.",
    `- BullMQ: one \`Worker\` per queue with concurrency = chats, defaults otherwise (completed jobs kept). pg-boss 10: one \`work()\` per queue, ${pgNote} (batchSize 1 for 1 chat); supervise/schedule off. pg-boss's worker sleeps \`pollingInterval\` (≥ 0.5 s) after every fetch unless \`notifyWorker()\` wakes it, so every send notifies its queue's worker in-process. graphile-worker: one runner for both tasks, in its own schema, ${gwNote} (the batching its docs recommend for a high-throughput queue; concurrentJobs 1 for 1 chat); LISTEN/NOTIFY wakes it. DBOS: \`DBOS.launch()\` with its system database in its own schema of the same database (\`systemDatabaseSchemaName\`), ${dbosNote}.`,
    `- Ceilings (bench/ceilings/): every write our protocol needs per message whose reply goes out at once, and no more: admit (leased), reserve with the call's announcement (leased, its called flag set in the same write), markSent, complete; each as one plain statement (Postgres: INSERT, INSERT, UPDATE … WHERE lease_token, UPDATE … WHERE lease_token) or one HSET with its index ZADD/ZREMs (Redis), on tables/keys with only the indexes the protocol reads (due records, a chat's active records); same client (porsager postgres / ioredis), same closed loop and mock provider, the writes of one turn batched as our backends do (Postgres: one transaction per turn, one multi-row statement per kind, BEGIN…COMMIT pipelined, ${CEILING_GROUPS} groups in flight; Redis: one MULTI/EXEC per turn, up to 8 pipelined). No chat-order probe, retries, payload or damage checks. × ceiling = how close a row is to what the server can do for this protocol from this client.`,
    "- Verification (any failure exits 1): every message replied exactly once; nothing left unfinished; the journals' done inbound records and sent replies of the run (listed by state) equal the totals; anchors: the completed counts of both queues equal the totals and nothing is waiting, active or failed (graphile-worker: both tasks' successes equal the totals and its job table is empty; DBOS: every workflow SUCCESS and each of its two steps recorded once per message); ceilings: every row/key done and sent.",
    "- client CPU µs/msg: the child process's own CPU time (user + system, all threads: `process.cpuUsage()`) over the measured interval, per message. server CPU µs/msg: the server's CPU time over the same interval (the child signals the orchestrator when it starts and ends measuring and waits while it samples /proc on this host): Postgres = the run's own backends (by application_name) plus the server's background processes (WAL writer, checkpointer…, shared with anything else using the server); Redis = the redis-server process. The not-durable Redis and Postgres are shared with other work on this machine; the AOF Redis is the bench's alone.",
    "- × off: msg/s over durability off, same scenario. × equal-work / one-job anchor / ceiling: Postgres over each of pg-boss, graphile-worker and DBOS (each named) and the Postgres ceiling; Redis AOF over BullMQ AOF and the AOF ceiling; the not-durable Redis rows over the not-durable BullMQ and ceiling; anchors over their server's ceiling.",
    "- With 100 chats in a closed loop the latency is mostly queueing (p50 ≈ chats / msg/s); the latency targets are judged on the 1-chat rows.",
    `- Anchors run under Bun; graphile-worker and DBOS also under Node ${NODE_VERSION} (the rows marked "(Node)", their users' runtime): the same anchor file, bundled for Node by Bun.build (target node, every package external, so Node loads the packages' own builds from node_modules). The Upstash REST bridge runs in the orchestrator process (its CPU is in neither CPU column).`,
  ];
  const scaleExplain = [
    `Cost per message on the 100-chat shape (${SCALE_RUNS} runs of ≥ ${SECONDS} s on one prefilled store, each run with new message ids; median, min – max) with N finished messages (a \`done\` inbound record and its \`sent\` reply each) already retained, on the same chat ids c0…c99 the measured runs use. Prefill (bench/prefill.ts): SQLite/Postgres 1,000 through the backend's API then bulk INSERT…SELECT copies, then Postgres \`VACUUM ANALYZE\` + \`CHECKPOINT\`, SQLite \`PRAGMA wal_checkpoint(TRUNCATE)\`; Redis (the not-durable server) 1,000 through the API then pipelined copies of the keys it wrote; the events journal through the API into one snapshot. In this run the events journal stops at ${fmtInt(scaleMax.get("events-log"))} and Redis at ${fmtInt(scaleMax.get("redis"))} (\`--scale-max\`; 100k by default: their 1M prefill takes minutes on this machine). A store over 10,000 retained is not listed by state after a run (the rest of verify runs; the 1,000 size runs it all).`,
  ];
  const recoveryExplain = [
    `${RECOVERY_RECORDS.toLocaleString("en-US")} inbound records (and ${fmtInt(RECOVERY_LARGE)} on ${RECOVERY_LARGE_KINDS.map((k) => LABELS[k]).join(", ")}) on 100 chats, admitted leased to a dead incarnation of instanceId "bench" (1 h lease), then a new bot on the same store: a restart reclaims its own previous incarnation's leases in its first sweep (\`reclaimOwn\`, in batches of 1,024 growing to 8,192). Judged on all replied (every reply sent and \`bot.idle()\` resolved) from the \`bot.start()\` call, against 2 s per 10,000 records (linear in the backlog); claimed (the backend's claim calls returned all of them to the new incarnation) is shown beside it. One run each, each after what the row before it left was written out (Postgres \`CHECKPOINT\`, \`sync\`, the CPU idle again).`,
  ];

  const body = [
    "## Throughput and latency",
    "",
    ...mainTables,
    ...explain,
    "",
    ...(scaleRows.length ? ["## Retained journal (scale)", "", ...scaleTable, "", ...scaleExplain, ""] : []),
    ...(recoveryRows.length ? ["## Restart recovery", "", ...recoveryTable, "", ...recoveryExplain, ""] : []),
    ...(serverWork.length
      ? [
        "## Server work per message",
        "",
        ...serverWork,
        "Measured by bench/server_work.ts in the same run: 100 chats, ours and the server's ceiling (every write our protocol needs for a message whose reply goes out at once: admit, reserve with the call's announcement, markSent, complete), median of 3 runs each. Postgres: rows per message by table from `pg_stat_user_tables` of the run's schema (a row inserted, or updated other than HOT, writes an entry in each index whose predicate it meets); WAL bytes from `pg_current_wal_insert_lsn()` over the measured loop (the whole server's: anything else writing meanwhile counts). Redis: commands per message from `INFO commandstats` of the bench's own AOF server (those our scripts run count; the script calls themselves are shown apart) and AOF bytes per message.",
        "",
      ]
      : []),
    ...(broadcastRows.length
      ? [
        "## Rate-limited broadcast",
        "",
        "| messages | chats | global rate | per chat | time | ideal | × ideal |",
        "|---:|---:|---:|---:|---:|---:|---:|",
        ...broadcastRows.map((r) =>
          `| ${fmtInt(r.messages)} | ${fmtInt(r.chats)} | ${fmtInt(r.rate)}/s | 1 per ${fmtInt(r.chatMs)} ms | ${fmt(r.seconds)} s | ${fmt(r.ideal)} s | **${fmt(r.ratio)}** |`
        ),
        "",
        "A broadcast through `bot.enqueue` (MemoryDurability, an in-process provider that answers at once) under the outbox's rate limits (bench/broadcast.bench.ts): the time from the first enqueue to `bot.idle()` over the ideal (the larger of messages / rate and one chat's sends spaced by its limit). 1 would mean the limiter lost nothing. With a burst of 1 (the default: sends evenly spaced, never more than the limit in any window) a timer that fires late loses that slot, so on a busy machine the ratio grows with the rate (at 100/s a slot is 10 ms; at Telegram's real 30/s, 33 ms). Every message is checked to have been sent exactly once, in its chat's order.",
        "",
      ]
      : []),
    "## Targets",
    "",
    `Each target with its measured value (medians, 100 chats unless it says otherwise) from the tables above.`,
    "",
    ...targets,
    "",
    ...(notes.length || failureNotes.length ? ["## Notes", "", ...notes.map((n) => `- ${n}`), ...failureNotes.map((n) => `- FAILED: ${n}`), ""] : []),
  ];
  const elapsed = ((Date.now() - started) / 1000).toFixed(0);
  console.log(body.join("\n"));
  console.log(`(${elapsed} s)`);
  if (WRITE) {
    writeFileSync(
      join(import.meta.dir, "RESULTS.md"),
      [
        "# Benchmark results",
        "",
        `Produced by \`${command}\` (\`npm run bench\`) on ${new Date(started).toISOString()}, in ${elapsed} s.`,
        "",
        "Machine and servers:",
        "",
        ...header.map((h) => `- ${h}`),
        "",
        ...body,
      ].join("\n"),
    );
    log(`wrote bench/RESULTS.md`);
  }
}

try {
  await main();
} catch (error) {
  fail(`the harness: ${error instanceof Error ? error.stack ?? error.message : String(error)}`);
} finally {
  await aof?.stop();
  rmSync(NODE_OUT, { recursive: true, force: true });
}
process.exit(failures > 0 ? 1 : 0);
