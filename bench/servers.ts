/**
 * The servers the orchestrator (bench/run.ts) measures on: the durable Redis it starts (AOF, fsync every
 * second), the persistence settings it prints, and the server CPU time it samples around each measured
 * interval (from /proc on this host).
 */
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { tcpReachable } from "../tests/support/services.ts";

export interface AofRedis {
  url: string;
  port: number;
  pid: number;
  stop(): Promise<void>;
}

let running: { kill(): void } | null = null;
/** Kills the AOF redis-server if the orchestrator exits without stopping it (an error, a signal). */
process.on("exit", () => running?.kill());
for (const signal of ["SIGINT", "SIGTERM", "SIGHUP"] as const) {
  process.on(signal, () => {
    running?.kill();
    process.exit(130);
  });
}

/**
 * Starts a redis-server on the first free port from 6380: a temp dir, `appendonly yes`, `appendfsync
 * everysec`, no RDB snapshots. `null` when redis-server cannot be started (not installed).
 */
export async function startAofRedis(): Promise<AofRedis | null> {
  let port = 6380;
  while (port < 6400 && await tcpReachable("127.0.0.1", port, 300)) port++;
  const dir = mkdtempSync(join(tmpdir(), "botmesh-bench-redis-aof-"));
  let proc;
  try {
    proc = Bun.spawn([
      "redis-server",
      "--port", String(port),
      "--bind", "127.0.0.1",
      "--dir", dir,
      "--appendonly", "yes",
      "--appendfsync", "everysec",
      "--save", "",
      "--daemonize", "no",
      "--logfile", join(dir, "redis.log"),
    ], { stdout: "ignore", stderr: "inherit" });
  } catch {
    rmSync(dir, { recursive: true, force: true });
    return null;
  }
  running = proc;
  const deadline = Date.now() + 10_000;
  while (!(await tcpReachable("127.0.0.1", port, 300))) {
    if (proc.exitCode !== null || Date.now() > deadline) {
      proc.kill();
      running = null;
      rmSync(dir, { recursive: true, force: true });
      return null;
    }
    await Bun.sleep(50);
  }
  return {
    url: `redis://127.0.0.1:${port}`,
    port,
    pid: proc.pid,
    async stop() {
      proc.kill();
      await proc.exited;
      running = null;
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** A Redis server's pid (INFO, this host) and the persistence it runs with (CONFIG GET). */
export async function redisInfo(url: string): Promise<{ pid: number | null; version: string; persistence: string }> {
  const { default: Redis } = await import("ioredis");
  const client = new Redis(url, { lazyConnect: true, maxRetriesPerRequest: 1 });
  try {
    await client.connect();
    const info = await client.info("server");
    const get = async (name: string) => ((await client.config("GET", name)) as string[])[1] ?? "?";
    const [aof, fsync, save] = [await get("appendonly"), await get("appendfsync"), await get("save")];
    return {
      pid: Number(/process_id:(\d+)/.exec(info)?.[1]) || null,
      version: /redis_version:(\S+)/.exec(info)?.[1] ?? "?",
      persistence: `appendonly ${aof}${aof === "yes" ? `, appendfsync ${fsync}` : ""}, save "${save}"`,
    };
  } finally {
    client.disconnect();
  }
}

const HZ = 100; // USER_HZ on Linux

/** utime + stime of a process (all its threads), ms; null when it is gone or /proc cannot be read. */
export function procCpuMs(pid: number): number | null {
  try {
    const f = readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1]!.split(" ").map(Number);
    return ((f[11]! + f[12]!) * 1000) / HZ;
  } catch {
    return null;
  }
}

/** Per process CPU ms of a server, at one moment. */
export type CpuSample = Map<number, number>;

/** CPU ms used between two samples by the processes of the second (a process new since the first counts from 0). */
export function cpuBetween(a: CpuSample | null, b: CpuSample | null): number | null {
  if (!a || !b || b.size === 0) return null;
  let ms = 0;
  for (const [pid, t] of b) ms += t - (a.get(pid) ?? 0);
  return ms;
}

type Sql = import("postgres").Sql;

/**
 * Postgres's processes that work for one run: its client backends (by the run's application_name) and
 * the server's own background processes (WAL writer, checkpointer, autovacuum…; shared with whatever
 * else uses the server). Other sessions' backends are left out.
 */
export async function postgresCpu(sql: Sql, app: string): Promise<CpuSample | null> {
  try {
    const rows = await sql`SELECT pid FROM pg_stat_activity WHERE application_name = ${app} OR backend_type <> 'client backend'`;
    const sample: CpuSample = new Map();
    for (const r of rows) {
      const ms = procCpuMs(r.pid as number);
      if (ms !== null) sample.set(r.pid as number, ms);
    }
    return sample;
  } catch {
    return null;
  }
}

export function redisCpu(pid: number | null): CpuSample | null {
  if (pid === null) return null;
  const ms = procCpuMs(pid);
  return ms === null ? null : new Map([[pid, ms]]);
}
