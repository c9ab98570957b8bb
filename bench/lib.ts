/**
 * Shared pieces of the benchmark harness (bench/run.ts and its children):
 * the backend kinds, how to open one on a namespace, and how to drop it.
 */
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { DurabilityBackend } from "../src/contract.ts";
import type { OutboundContent, SendContext, SendReceipt } from "../src/provider.ts";
import { MockProvider } from "../testing.ts";
import { POSTGRES_URL, REDIS_URL, runId } from "../tests/support/services.ts";

/** Our rows. `off` = durability off; `redis-aof` = ioredis on the bench's own AOF (everysec) redis-server. */
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
  "redis-aof",
  "upstash",
] as const;
export type Kind = (typeof KINDS)[number];
/**
 * The comparison rows: BullMQ, pg-boss and graphile-worker doing equal work (an inbound job whose
 * processor adds a reply job keyed by the idempotency key, a reply worker that sends it) or one job per
 * message (`-1`); DBOS doing equal work as a workflow per message (id = the message id) of two steps;
 * `-node`: the same anchor under Node instead of Bun; the ceilings: our protocol's writes as plain
 * statements/commands on the same client.
 */
export const OTHERS = [
  "pgboss",
  "pgboss-1",
  "graphile",
  "graphile-1",
  "graphile-node",
  "graphile-node-1",
  "dbos",
  "dbos-node",
  "bullmq-aof",
  "bullmq-aof-1",
  "bullmq",
  "bullmq-1",
  "ceiling-postgres",
  "ceiling-redis-aof",
  "ceiling-redis",
] as const;
export type Other = (typeof OTHERS)[number];
export type AnyKind = Kind | Other;
/** Kept for the other bench scripts. */
export type AnchorKind = "bullmq" | "pgboss";

export const LABELS: Record<AnyKind, string> = {
  off: "durability off",
  memory: "memory",
  file: "file",
  "sqlite-normal": "SQLite synchronous=NORMAL",
  "sqlite-full": "SQLite synchronous=FULL",
  events: "events journal (shared file)",
  "events-log": "events journal + appendLog",
  postgres: "Postgres",
  redis: "Redis (ioredis), not durable",
  "redis-aof": "Redis (ioredis), AOF everysec",
  upstash: "Redis (@upstash/redis, REST bridge), not durable",
  pgboss: "pg-boss, equal work",
  "pgboss-1": "pg-boss, one job",
  graphile: "graphile-worker, equal work",
  "graphile-1": "graphile-worker, one job",
  "graphile-node": "graphile-worker (Node), equal work",
  "graphile-node-1": "graphile-worker (Node), one job",
  dbos: "DBOS, equal work",
  "dbos-node": "DBOS (Node), equal work",
  "bullmq-aof": "BullMQ AOF everysec, equal work",
  "bullmq-aof-1": "BullMQ AOF everysec, one job",
  bullmq: "BullMQ not durable, equal work",
  "bullmq-1": "BullMQ not durable, one job",
  "ceiling-postgres": "ceiling: Postgres",
  "ceiling-redis-aof": "ceiling: Redis AOF everysec",
  "ceiling-redis": "ceiling: Redis not durable",
};

/** The servers: Postgres, the shared Redis (no persistence here) and the bench's own AOF redis-server. */
export type Server = "postgres" | "redis" | "redis-aof";

/** Which server a kind needs. */
export function serverOf(kind: AnyKind): Server | null {
  if (kind === "postgres" || kind.startsWith("pgboss") || kind.startsWith("graphile") || kind.startsWith("dbos") || kind === "ceiling-postgres") return "postgres";
  if (kind === "redis-aof" || kind.startsWith("bullmq-aof") || kind === "ceiling-redis-aof") return "redis-aof";
  if (kind === "redis" || kind === "upstash" || kind.startsWith("bullmq") || kind === "ceiling-redis") return "redis";
  return null;
}

/** Which script measures a kind. */
export function scriptOf(kind: AnyKind): string {
  if (kind.startsWith("bullmq")) return "anchors/bullmq.ts";
  if (kind.startsWith("pgboss")) return "anchors/pgboss.ts";
  if (kind.startsWith("graphile")) return "anchors/graphile.ts";
  if (kind.startsWith("dbos")) return "anchors/dbos.ts";
  if (kind.startsWith("ceiling-")) return kind === "ceiling-postgres" ? "ceilings/postgres.ts" : "ceilings/redis.ts";
  return "row.ts";
}

/** Which runtime runs a kind's child: Bun, or Node for the `-node` anchor rows (their users' runtime). */
export function runtimeOf(kind: AnyKind): "bun" | "node" {
  return /-node(-|$)/.test(kind) ? "node" : "bun";
}

/**
 * Where one run's journals live: a directory, a Postgres schema or a Redis key prefix. `redisUrl`: the
 * server of a Redis kind; `app`: the Postgres application_name of the run's connections (the
 * orchestrator counts the server CPU of those backends).
 */
export interface Ns {
  kind: AnyKind;
  name: string;
  redisUrl?: string;
  app?: string;
  upstash?: { url: string; token: string };
}

export function createNs(kind: AnyKind, opts: { redisUrl?: string; upstash?: { url: string; token: string } } = {}): Ns {
  const server = serverOf(kind);
  const id = runId().replace(/[^A-Za-z0-9_]/g, "_");
  if (server === "postgres") return { kind, name: `bench_${kind.replace(/-/g, "_")}_${id}`, app: `botmesh-bench-${id}` };
  if (server !== null) {
    return { kind, name: `botmesh-bench:${kind}:${id}:`, redisUrl: opts.redisUrl ?? REDIS_URL, ...(opts.upstash ? { upstash: opts.upstash } : {}) };
  }
  return { kind, name: mkdtempSync(join(tmpdir(), `botmesh-bench-${kind}-`)) };
}

/** The Postgres URL with the run's application_name (both porsager and pg read it from the URL). */
export function pgUrl(ns: Ns): string {
  const u = new URL(POSTGRES_URL);
  if (ns.app) u.searchParams.set("application_name", ns.app);
  return u.toString();
}

export async function dropNs(ns: Ns): Promise<void> {
  const server = serverOf(ns.kind);
  if (server === null) return rmSync(ns.name, { recursive: true, force: true });
  if (server === "postgres") {
    // Imported here, not at the top: the anchors import this module under Node too (bundled), and the
    // harness module reads Bun's `import.meta.dir` when it loads.
    const { dropPostgresSchema } = await import("../tests/support/replica_harness.ts");
    return await dropPostgresSchema(ns.name);
  }
  const { default: Redis } = await import("ioredis");
  const client = new Redis(ns.redisUrl ?? REDIS_URL);
  try {
    let cursor = "0";
    do {
      const [next, keys] = await client.scan(cursor, "MATCH", `*${ns.name.replace(/[*?[\]\\]/g, "\\$&")}*`, "COUNT", 5000);
      cursor = next;
      if (keys.length > 0) await client.unlink(...keys);
    } while (cursor !== "0");
  } finally {
    await client.quit().catch(() => client.disconnect());
  }
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
      const { FileDurability } = await import("../backends/file/durability.ts");
      return { backend: new FileDurability({ path: join(ns.name, "journal.json") }), close: none };
    }
    case "sqlite-normal":
    case "sqlite-full": {
      const { SQLiteDurability } = await import("../backends/sqlite/durability.ts");
      const synchronous = ns.kind === "sqlite-full" ? "full" : "normal";
      return { backend: new SQLiteDurability({ file: join(ns.name, "bot.db"), synchronous }), close: none };
    }
    case "events":
    case "events-log": {
      const { SharedFileEventJournal, EventsDurability } = await import("../backends/events/mod.ts");
      const journal = await SharedFileEventJournal.open(join(ns.name, "events.json"), { appendLog: ns.kind === "events-log" });
      return { backend: new EventsDurability({ journal }), close: () => journal.close() };
    }
    case "postgres": {
      const { default: postgres } = await import("postgres");
      const { PostgresDurability } = await import("../backends/postgres/mod.ts");
      const sql = postgres(pgUrl(ns), { max: 10, fetch_types: false, onnotice: () => {} });
      return { backend: new PostgresDurability({ sql, schema: ns.name }), close: () => sql.end({ timeout: 5 }) };
    }
    case "redis":
    case "redis-aof": {
      const { default: Redis } = await import("ioredis");
      const { RedisDurability } = await import("../backends/redis/durability.ts");
      const client = new Redis(ns.redisUrl ?? REDIS_URL);
      return {
        backend: new RedisDurability({ client, keyPrefix: ns.name }),
        close: async () => void await client.quit().catch(() => client.disconnect()),
      };
    }
    case "upstash": {
      if (!ns.upstash) throw new Error("upstash: no bridge url");
      const { Redis } = await import("@upstash/redis");
      const { RedisDurability } = await import("../backends/redis/durability.ts");
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
  /** Messages in the measured interval (a warm-up before it is not counted). */
  messages: number;
  ms: number;
  msgPerSec: number;
  p50: number;
  p99: number;
  rssMb: number;
  /** The child's own CPU time (user + system, all its threads) in the measured interval, per message. */
  cpuUsPerMsg?: number;
  /** Recovery: ms from `bot.start()` until all were claimed, and until all replied and idle. */
  claimedMs?: number;
  doneMs?: number;
  startMs?: number;
  note?: string;
  /** CPU the database server spent in the measured interval, per message (µs; measured by the orchestrator). */
  serverUsPerMsg?: number;
}

/**
 * Tells the orchestrator that the measured interval starts or ends (`@@start`, `@@end` on stdout) and
 * waits for its answer on stdin (it samples the server's CPU time in between), so the server CPU window
 * is the measured interval. Run alone (no BENCH_ACK), a child does not wait.
 */
let stdinLines: string[] = [];
let stdinWaiter: (() => void) | null = null;
if (process.env.BENCH_ACK === "1") {
  process.stdin.setEncoding("utf8");
  let buf = "";
  process.stdin.on("data", (chunk: string) => {
    buf += chunk;
    let i;
    while ((i = buf.indexOf("\n")) >= 0) {
      stdinLines.push(buf.slice(0, i));
      buf = buf.slice(i + 1);
    }
    stdinWaiter?.();
  });
}
export async function mark(what: "start" | "end"): Promise<void> {
  if (process.env.BENCH_ACK !== "1") return;
  process.stdout.write(`@@${what}\n`);
  while (stdinLines.length === 0) await new Promise<void>((resolve) => (stdinWaiter = resolve));
  stdinWaiter = null;
  stdinLines = stdinLines.slice(1);
}

/** How long a load child runs: a warm-up (not measured) then the measured closed loop, both time-bound. */
export interface LoadConfig {
  chats: number;
  /** The measured closed loop runs until this many seconds have passed (then drains). */
  seconds: number;
  /** A closed loop of this many seconds before, drained, not measured. */
  warmSeconds: number;
  /** Message ids `${idPrefix}m-<n>` (scale rows run several times on one store). */
  idPrefix?: string;
}

/**
 * The closed loop every load child runs: `chats` chats, each sending its next message once the
 * previous one's reply was sent (`message` resolves then), until the deadline; then `drain` waits for
 * the rest of the work (records done, jobs completed). A warm-up loop first (drained, not measured),
 * then `@@start`, the measured loop and its drain, `@@end`. Message numbers go on across both loops:
 * `total` is how many were sent in all (for verify), `result` is the measured interval's.
 */
export async function closedLoop(
  cfg: LoadConfig,
  message: (n: number, chat: number) => Promise<void>,
  drain: () => Promise<void>,
): Promise<{ total: number; result: RowResult }> {
  let next = 0;
  const run = async (seconds: number, latency: number[] | null) => {
    const deadline = performance.now() + seconds * 1000;
    await Promise.all(Array.from({ length: cfg.chats }, async (_, c) => {
      while (performance.now() < deadline) {
        const n = next++;
        const t0 = performance.now();
        await message(n, c);
        latency?.push(performance.now() - t0);
      }
    }));
    await drain();
  };
  if (cfg.warmSeconds > 0) await run(cfg.warmSeconds, null);
  const first = next;
  const latency: number[] = [];
  await mark("start");
  const cpu0 = process.cpuUsage();
  const t0 = performance.now();
  await run(cfg.seconds, latency);
  const ms = performance.now() - t0;
  const cpu = process.cpuUsage(cpu0);
  await mark("end");
  const messages = next - first;
  latency.sort((a, b) => a - b);
  return {
    total: next,
    result: {
      messages,
      ms,
      msgPerSec: messages / (ms / 1000),
      p50: percentile(latency, 0.5),
      p99: percentile(latency, 0.99),
      rssMb: peakRssMb(),
      cpuUsPerMsg: (cpu.user + cpu.system) / messages,
    },
  };
}

/**
 * The mock provider of every row (ours, the anchors' reply workers, the ceilings): MockProvider's send,
 * and who waits for which reply. A reply's text is `r:<message id>`.
 */
export class BenchProvider extends MockProvider {
  readonly replies: Map<string, number> = new Map();
  onReply: (id: string) => void = () => {};
  override async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    const receipt = await super.send(chatId, content, context);
    const text = typeof content === "string" ? content : String(content.text);
    const id = text.slice(2);
    this.replies.set(id, (this.replies.get(id) ?? 0) + 1);
    this.onReply(id);
    return receipt;
  }
  /** Throws unless each of the first `total` messages got exactly one reply (and nothing else did). */
  verify(total: number, prefix = ""): void {
    let wrong = 0;
    const examples: string[] = [];
    for (let n = 0; n < total; n++) {
      const id = `${prefix}m-${n}`, got = this.replies.get(id) ?? 0;
      if (got !== 1) {
        wrong++;
        if (examples.length < 3) examples.push(`${id}: ${got}`);
      }
    }
    if (wrong > 0 || this.replies.size !== total) {
      throw new Error(`${wrong} of ${total} messages not replied exactly once (e.g. ${examples.join(", ")}); ${this.replies.size} replied ids`);
    }
  }
}

/** Waits for the next turn of replies: the callback fires each time the mock provider sends. */
export function replyWaiters(provider: BenchProvider): (id: string) => Promise<void> {
  const waiting = new Map<string, () => void>();
  provider.onReply = (id) => {
    const w = waiting.get(id);
    if (w) {
      waiting.delete(id);
      w();
    }
  };
  return (id) => new Promise<void>((resolve) => waiting.set(id, resolve));
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
