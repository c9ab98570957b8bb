/**
 * Shared pieces of the benchmark harness (bench/run.ts and its children):
 * the backend kinds, how to open one on a namespace, and how to drop it.
 */
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { DurabilityBackend } from "../src/backend.ts";
import { dropPostgresSchema, dropRedisKeys } from "../tests/support/replica_harness.ts";
import { POSTGRES_URL, REDIS_URL, runId } from "../tests/support/services.ts";

/** Our rows. `off` = durability off. */
export const KINDS = [
  "off",
  "memory",
  "file",
  "sqlite-normal",
  "sqlite-full",
  "events",
  "events-log",
  "postgres",
  "redis",
  "upstash",
] as const;
export type Kind = (typeof KINDS)[number];
export type AnchorKind = "bullmq" | "pgboss";

export const LABELS: Record<Kind | AnchorKind, string> = {
  off: "durability off",
  memory: "memory",
  file: "file",
  "sqlite-normal": "SQLite synchronous=NORMAL",
  "sqlite-full": "SQLite synchronous=FULL",
  events: "events journal (shared file)",
  "events-log": "events journal + appendLog",
  postgres: "Postgres",
  redis: "Redis (ioredis, TCP)",
  upstash: "Redis (@upstash/redis, REST bridge)",
  bullmq: "BullMQ (anchor)",
  pgboss: "pg-boss (anchor)",
};

/** Which server a kind needs. */
export function serverOf(kind: Kind | AnchorKind): "postgres" | "redis" | null {
  if (kind === "postgres" || kind === "pgboss") return "postgres";
  if (kind === "redis" || kind === "upstash" || kind === "bullmq") return "redis";
  return null;
}

/** Where one run's journals live: a directory, a Postgres schema or a Redis key prefix. */
export interface Ns {
  kind: Kind | AnchorKind;
  name: string;
  upstash?: { url: string; token: string };
}

export function createNs(kind: Kind | AnchorKind, upstash?: { url: string; token: string }): Ns {
  const server = serverOf(kind);
  if (server === "postgres") return { kind, name: `bench_${kind}_${runId()}` };
  if (server === "redis") return { kind, name: `botmesh-bench:${kind}:${runId()}:`, ...(upstash ? { upstash } : {}) };
  return { kind, name: mkdtempSync(join(tmpdir(), `botmesh-bench-${kind}-`)) };
}

export async function dropNs(ns: Ns): Promise<void> {
  const server = serverOf(ns.kind);
  if (server === null) return rmSync(ns.name, { recursive: true, force: true });
  if (server === "postgres") return await dropPostgresSchema(ns.name);
  await dropRedisKeys(ns.name);
}

/** The result of a load run: `total` messages in `ms`, with each message's latency (sorted here). */
export function loadResult(total: number, ms: number, latency: Float64Array): RowResult {
  latency.sort();
  return {
    messages: total,
    ms,
    msgPerSec: total / (ms / 1000),
    p50: percentile(latency, 0.5),
    p99: percentile(latency, 0.99),
    rssMb: peakRssMb(),
  };
}

export interface Opened {
  backend: DurabilityBackend | undefined;
  close(): Promise<void>;
}

/** Opens the backend of `ns` (not yet `open()`ed: `bot.start()` does that). */
export async function openKind(ns: Ns): Promise<Opened> {
  const none = async () => {};
  switch (ns.kind as Kind) {
    case "off":
      return { backend: undefined, close: none };
    case "memory": {
      const { MemoryDurability } = await import("../mod.ts");
      return { backend: new MemoryDurability(), close: none };
    }
    case "file": {
      const { FileDurability } = await import("../backends/file.ts");
      return { backend: new FileDurability({ path: join(ns.name, "journal.json") }), close: none };
    }
    case "sqlite-normal":
    case "sqlite-full": {
      const { SQLiteDurability } = await import("../backends/sqlite.ts");
      const synchronous = ns.kind === "sqlite-full" ? "full" : "normal";
      return { backend: new SQLiteDurability({ file: join(ns.name, "bot.db"), synchronous }), close: none };
    }
    case "events":
    case "events-log": {
      const { SharedFileEventJournal, eventsDurability } = await import("../backends/events.ts");
      const journal = await SharedFileEventJournal.open(join(ns.name, "events.json"), { appendLog: ns.kind === "events-log" });
      return { backend: eventsDurability({ journal }), close: () => journal.close() };
    }
    case "postgres": {
      const { default: postgres } = await import("postgres");
      const { PostgresDurability } = await import("../backends/postgres.ts");
      const sql = postgres(POSTGRES_URL, { max: 10, fetch_types: false, onnotice: () => {} });
      return { backend: new PostgresDurability({ sql, schema: ns.name }), close: () => sql.end({ timeout: 5 }) };
    }
    case "redis": {
      const { default: Redis } = await import("ioredis");
      const { RedisDurability } = await import("../backends/redis.ts");
      const client = new Redis(REDIS_URL);
      return {
        backend: new RedisDurability({ client, keyPrefix: ns.name }),
        close: async () => void await client.quit().catch(() => client.disconnect()),
      };
    }
    case "upstash": {
      if (!ns.upstash) throw new Error("upstash: no bridge url");
      const { Redis } = await import("@upstash/redis");
      const { RedisDurability } = await import("../backends/redis.ts");
      const client = new Redis({ url: ns.upstash.url, token: ns.upstash.token, automaticDeserialization: false });
      return { backend: new RedisDurability({ client, keyPrefix: ns.name }), close: none };
    }
  }
  throw new Error(`unknown kind ${ns.kind}`);
}

/**
 * Peak RSS of this process in MB: /proc/self/status VmHWM. Not getrusage's
 * ru_maxrss: Linux carries that over from the forking parent across exec.
 */
export function peakRssMb(): number {
  try {
    const kb = /VmHWM:\s*(\d+)/.exec(readFileSync("/proc/self/status", "utf8"))?.[1];
    if (kb) return Number(kb) / 1024;
  } catch { /* not Linux */ }
  return process.resourceUsage().maxRSS / 1024;
}

export function percentile(sorted: Float64Array | number[], p: number): number {
  if (sorted.length === 0) return NaN;
  return sorted[Math.min(sorted.length - 1, Math.floor(p * sorted.length))]!;
}

/** What a measuring child prints (one JSON line on stdout). */
export interface RowResult {
  messages: number;
  ms: number;
  msgPerSec: number;
  p50: number;
  p99: number;
  rssMb: number;
  /** Recovery: ms from `bot.start()` until all were claimed, and until all replied and idle. */
  claimedMs?: number;
  doneMs?: number;
  startMs?: number;
  note?: string;
  /** CPU the database server spent during the run, per message (µs; measured by the orchestrator). */
  serverUsPerMsg?: number;
}

/** Runs `main` and prints its result as the last stdout line; exit code 1 on any error. */
export function childMain(main: () => Promise<RowResult>): void {
  main().then(
    (r) => {
      process.stdout.write(JSON.stringify(r) + "\n");
      process.exit(0);
    },
    (error) => {
      process.stderr.write(`${error instanceof Error ? error.stack ?? error.message : String(error)}\n`);
      process.exit(1);
    },
  );
}
