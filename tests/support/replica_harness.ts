/**
 * Shared pieces of the replica failover test (tests/replicas.test.ts), its child
 * (tests/fixtures/replica.ts) and the replica bench (bench/replicas.bench.ts):
 *
 * - {@link openBackend}: one durability backend of a kind on a namespace (a
 *   directory for the embedded backends, a schema for Postgres, a key prefix
 *   for Redis), the same in the child and in the parent (which reads the
 *   journals at the end);
 * - {@link createNamespace} / {@link dropNamespace}: one per test, dropped after;
 * - {@link Replica}: a child process and its stdout protocol;
 * - {@link Cluster}: the parent side: a sticky-by-chat router with a channel's
 *   redelivery on failover, the sink (every provider call of every replica),
 *   and the checks of the end state.
 *
 * @module
 */
import { existsSync, mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import type { DurabilityBackend } from "../../src/contract.ts";
import type { DurabilityMetrics } from "../../src/engine.ts";
import { POSTGRES_URL, REDIS_URL, runId } from "./services.ts";

/**
 * The backends a replica can run on. `redis` is ioredis, `upstash` is @upstash/redis over the bridge, `node-redis` is
 * `redis`, `pgbouncer` is Postgres through a PgBouncer in transaction mode (the client with `prepare: false`),
 * `redis-cluster` is ioredis' `Cluster` on the nodes of {@link Namespace.redisCluster}.
 */
export type BackendKind = "sqlite" | "file" | "postgres" | "pgbouncer" | "redis" | "upstash" | "node-redis" | "redis-cluster";

/** Where one test's journals live. */
export interface Namespace {
  kind: BackendKind;
  /** A directory (sqlite, file), a schema (postgres) or a key prefix (redis kinds). */
  name: string;
  /** For `upstash`: the bridge's REST endpoint. */
  upstash?: { url: string; token: string };
  /** For `pgbouncer`: the URL through the pooler. */
  pgbouncer?: string;
  /** For `redis-cluster`: `host:port` of the cluster's nodes (tests/support/redis_cluster.ts). */
  redisCluster?: string[];
}

/** A backend and how to let go of it (and of the client under it). */
export interface OpenedBackend {
  backend: DurabilityBackend;
  close(): Promise<void>;
}

/**
 * Opens the durability backend of `ns` (a new client for the shared ones).
 * The caller opens the backend itself (`bot.start()` does), and calls `close()` at the end
 * (which ends the client; the backends never end a client they were given).
 */
export async function openBackend(ns: Namespace): Promise<OpenedBackend> {
  switch (ns.kind) {
    case "sqlite": {
      const { SQLiteDurability } = await import("../../backends/sqlite/durability.ts");
      const backend = new SQLiteDurability({ file: join(ns.name, "bot.db") });
      return { backend, close: async () => {} };
    }
    case "file": {
      const { FileDurability } = await import("../../backends/file/durability.ts");
      const backend = new FileDurability({ path: join(ns.name, "journal.json") });
      return { backend, close: async () => {} };
    }
    case "postgres": {
      const { default: postgres } = await import("postgres");
      const { PostgresDurability } = await import("../../backends/postgres/mod.ts");
      const sql = postgres(POSTGRES_URL, { max: 4, onnotice: () => {} });
      const backend = new PostgresDurability({ sql, schema: ns.name });
      return { backend, close: () => sql.end({ timeout: 2 }) };
    }
    case "pgbouncer": {
      if (!ns.pgbouncer) throw new Error("pgbouncer namespace without the pooler's url");
      const { default: postgres } = await import("postgres");
      const { PostgresDurability } = await import("../../backends/postgres/mod.ts");
      const sql = postgres(ns.pgbouncer, { max: 4, prepare: false, onnotice: () => {} });
      const backend = new PostgresDurability({ sql, schema: ns.name });
      return { backend, close: () => sql.end({ timeout: 2 }) };
    }
    case "redis": {
      const { default: Redis } = await import("ioredis");
      const { RedisDurability } = await import("../../backends/redis/durability.ts");
      const client = new Redis(REDIS_URL, { lazyConnect: false, maxRetriesPerRequest: 3 });
      const backend = new RedisDurability({ client, keyPrefix: ns.name });
      return { backend, close: async () => void await client.quit().catch(() => client.disconnect()) };
    }
    case "node-redis": {
      const { createClient } = await import("redis");
      const { RedisDurability } = await import("../../backends/redis/durability.ts");
      const client = createClient({ url: REDIS_URL });
      await client.connect();
      const backend = new RedisDurability({ client, keyPrefix: ns.name });
      return { backend, close: async () => void await client.quit().catch(() => {}) };
    }
    case "redis-cluster": {
      const { RedisDurability } = await import("../../backends/redis/durability.ts");
      const client = await redisClusterClient(ns);
      const backend = new RedisDurability({ client, keyPrefix: ns.name });
      return { backend, close: async () => void await client.quit().catch(() => client.disconnect()) };
    }
    case "upstash": {
      if (!ns.upstash) throw new Error("upstash namespace without the bridge's url and token");
      const { Redis } = await import("@upstash/redis");
      const { RedisDurability } = await import("../../backends/redis/durability.ts");
      const client = new Redis({ url: ns.upstash.url, token: ns.upstash.token, automaticDeserialization: false });
      const backend = new RedisDurability({ client, keyPrefix: ns.name });
      return { backend, close: async () => {} };
    }
  }
}

/** An ioredis `Cluster` client of a `redis-cluster` namespace's nodes. */
async function redisClusterClient(ns: Namespace) {
  if (!ns.redisCluster?.length) throw new Error(`redis-cluster namespace ${ns.name} without the cluster's node addresses`);
  const { default: Redis } = await import("ioredis");
  return new Redis.Cluster(
    ns.redisCluster.map((a) => ({ host: a.slice(0, a.lastIndexOf(":")), port: Number(a.slice(a.lastIndexOf(":") + 1)) })),
    { redisOptions: { maxRetriesPerRequest: 3 } },
  );
}

/** A fresh namespace for one test (a temp directory, a schema name, a key prefix). */
export function createNamespace(
  kind: BackendKind,
  label: string,
  upstash?: { url: string; token: string },
  pgbouncer?: string,
  redisCluster?: string[],
): Namespace {
  const id = runId();
  switch (kind) {
    case "sqlite":
    case "file":
      return { kind, name: mkdtempSync(join(tmpdir(), `botmesh-replicas-${label}-`)) };
    case "postgres":
      return { kind, name: `replicas_${label.replace(/\W/g, "_")}_${id}` };
    case "pgbouncer":
      return { kind, name: `replicas_pgb_${label.replace(/\W/g, "_")}_${id}`, pgbouncer };
    case "redis-cluster":
      return { kind, name: `botmesh-replicas:${label}:${id}:`, redisCluster };
    default:
      return { kind, name: `botmesh-replicas:${label}:${id}:`, upstash };
  }
}

/** Drops what a namespace left: the directory, the schema, the keys under the prefix. */
export async function dropNamespace(ns: Namespace): Promise<void> {
  switch (ns.kind) {
    case "sqlite":
    case "file":
      rmSync(ns.name, { recursive: true, force: true });
      return;
    case "postgres":
    case "pgbouncer":
      return await dropPostgresSchema(ns.name);
    case "redis-cluster":
      return await clusterKeysOf(ns, (keys, node) => node.unlink(...keys));
    default:
      // Upstash runs through the bridge onto the same Redis server: delete over TCP.
      return await dropRedisKeys(ns.name);
  }
}

/** Drops a Postgres schema and everything in it. */
export async function dropPostgresSchema(schema: string): Promise<void> {
  const { default: postgres } = await import("postgres");
  const sql = postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
  try {
    await sql.unsafe(`drop schema if exists "${schema}" cascade`);
  } finally {
    await sql.end({ timeout: 2 });
  }
}

/** The keys that hold `prefix` (RedisDurability hash-tags its prefix, `{prefix}…`; BullMQ's keys start with it). */
export async function redisKeysOf(prefix: string, each: (keys: string[]) => Promise<unknown>): Promise<void> {
  const { default: Redis } = await import("ioredis");
  const client = new Redis(REDIS_URL);
  try {
    let cursor = "0";
    do {
      const [next, keys] = await client.scan(cursor, "MATCH", `*${prefix}*`, "COUNT", 5000);
      cursor = next;
      if (keys.length > 0) await each(keys);
    } while (cursor !== "0");
  } finally {
    await client.quit().catch(() => client.disconnect());
  }
}

/** The keys of a `redis-cluster` namespace, master by master (a key's node is given to `each`). */
async function clusterKeysOf(
  ns: Namespace,
  each: (keys: string[], node: import("ioredis").Redis) => Promise<unknown>,
): Promise<void> {
  const client = await redisClusterClient(ns);
  try {
    await new Promise<void>((resolve, reject) => {
      client.once("ready", () => resolve());
      client.once("error", reject);
    });
    for (const node of client.nodes("master")) {
      let cursor = "0";
      do {
        const [next, keys] = await node.scan(cursor, "MATCH", `{${ns.name}}*`, "COUNT", 5000);
        cursor = next;
        if (keys.length > 0) await each(keys, node);
      } while (cursor !== "0");
    }
  } finally {
    await client.quit().catch(() => client.disconnect());
  }
}

/** Deletes every key that holds `prefix`. */
export async function dropRedisKeys(prefix: string): Promise<void> {
  const { default: Redis } = await import("ioredis");
  const client = new Redis(REDIS_URL);
  try {
    await redisKeysOf(prefix, (keys) => client.unlink(...keys));
  } finally {
    await client.quit().catch(() => client.disconnect());
  }
}

/** How many keys (redis kinds) or tables (postgres) a namespace still has: 0 after {@link dropNamespace}. */
export async function namespaceLeftovers(ns: Namespace): Promise<number> {
  switch (ns.kind) {
    case "sqlite":
    case "file":
      return existsSync(ns.name) ? 1 : 0;
    case "postgres":
    case "pgbouncer": {
      const { default: postgres } = await import("postgres");
      const sql = postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
      try {
        const rows = await sql`select count(*)::int as n from information_schema.schemata where schema_name = ${ns.name}`;
        return rows[0]!.n as number;
      } finally {
        await sql.end({ timeout: 2 });
      }
    }
    case "redis-cluster": {
      let count = 0;
      await clusterKeysOf(ns, async (keys) => count += keys.length);
      return count;
    }
    default: {
      let count = 0;
      await redisKeysOf(ns.name, async (keys) => count += keys.length);
      return count;
    }
  }
}

/**
 * For SQLite: whether the database's write lock is free (a `BEGIN IMMEDIATE` gets it within 100 ms).
 * A process stopped (SIGSTOP) inside a write transaction keeps the lock and stalls every other
 * process of the host until it is continued: leases cannot help there. For Postgres: whether no
 * server session of the schema was left stuck by the stop (see `noGroupLeftOpen`). Always true for
 * the others.
 */
export async function writeLockFree(ns: Namespace): Promise<boolean> {
  if (ns.kind === "postgres" || ns.kind === "pgbouncer") return await noGroupLeftOpen(ns.name);
  if (ns.kind !== "sqlite") return true;
  const { Database } = await import("bun:sqlite");
  const db = new Database(join(ns.name, "bot.db"));
  try {
    db.exec("PRAGMA busy_timeout = 100");
    db.exec("BEGIN IMMEDIATE");
    db.exec("ROLLBACK");
    return true;
  } catch {
    return false;
  } finally {
    db.close();
  }
}

/**
 * Postgres: whether no server session of the schema has been stuck for 100 ms: a group transaction
 * left open by the stop (idle in transaction: its row locks stay until the server's
 * `idle_in_transaction_session_timeout`, 5 s, ends it), or a statement whose result the stopped
 * client does not read (active, writing to its client: behind PgBouncer in transaction pooling its
 * server connection stays assigned to the stopped client for good, and a small pool runs dry). A live
 * replica's statements and groups last far less. Asked 150 ms after the stop, once what reached the
 * server has run.
 */
async function noGroupLeftOpen(schema: string): Promise<boolean> {
  const { default: postgres } = await import("postgres");
  const sql = postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
  try {
    await Bun.sleep(150);
    const rows = await sql`
      select count(*)::int as n from pg_stat_activity a
      where a.datname = current_database() and a.pid <> pg_backend_pid() and a.backend_type = 'client backend'
        and a.state <> 'idle' and a.state_change < clock_timestamp() - interval '100 milliseconds'
        and position(${schema} in a.query) > 0`;
    return rows[0]!.n === 0;
  } finally {
    await sql.end({ timeout: 2 });
  }
}

// ---- the child's configuration ---------------------------------------------------

/** What the parent tells a replica (the child's last argument, as JSON). */
export interface ReplicaConfig {
  /** Inbox and outbox lease (ms). */
  leaseMs: number;
  /** The handler thinks this long before each reply: `[min, max]` ms, derived from the message id (a replay thinks as long). */
  thinkMs: [number, number];
  /** The provider call takes this long after the `sent` line is written (ms): a kill can land in between. */
  sendMs: number;
  /**
   * Slow provider calls: a key with `hash01(key) < 1 / oneIn` takes `ms` instead of `sendMs`, so a
   * kill or a freeze can be aimed at a call under way (an ambiguous send). See {@link isSlowKey}.
   */
  slowSend?: { ms: number; oneIn: number };
  /** durability.sweepIntervalMs (default: derived from the leases). */
  sweepIntervalMs?: number;
  /** For `upstash`. */
  upstash?: { url: string; token: string };
  /** For `pgbouncer`. */
  pgbouncer?: string;
  /** For `redis-cluster`: the nodes' `host:port`. */
  redisCluster?: string[];
}

/** The child's metrics line. */
export interface ReplicaStats {
  instanceId: string;
  pid: number;
  metrics: DurabilityMetrics;
}

// ---- the parent side: one child ------------------------------------------------------

/** The child script. */
export const REPLICA_CHILD: string = join(import.meta.dir, "..", "fixtures", "replica.ts");

/** A replica child process. */
export class Replica {
  readonly name: string;
  readonly proc: Bun.Subprocess<"pipe", "pipe", "pipe">;
  readonly exited: Promise<number | null>;
  /** Resolves once its stdout is closed and every line of it was read. */
  readonly drained: Promise<void>;
  /** When its last stdout line was read (parent's performance.now()). */
  lastLineAt = 0;
  /** Every stdout line so far. */
  readonly lines: string[] = [];
  stderr = "";
  #waiters: { prefix: string; resolve: (line: string) => void }[] = [];
  #onLine: (replica: Replica, line: string, at: number) => void;
  /** Lines read before a waiter for them existed: matched by `next` from here on. */
  #read = 0;

  constructor(
    ns: Namespace,
    name: string,
    config: ReplicaConfig,
    onLine: (replica: Replica, line: string, at: number) => void,
  ) {
    this.name = name;
    this.#onLine = onLine;
    this.proc = Bun.spawn([process.execPath, REPLICA_CHILD, ns.kind, ns.name, name, JSON.stringify(config)], {
      // The environment as it is now (Bun's default is the one this process started with): the replica
      // bench sets PGAPPNAME to find its replicas' Postgres backends.
      env: { ...process.env },
      stdin: "pipe",
      stdout: "pipe",
      stderr: "pipe",
    });
    this.exited = this.proc.exited.then((code) => code, () => null);
    this.drained = this.#pump().catch(() => {});
    const stderr = this.proc.stderr.getReader();
    void (async () => {
      const decoder = new TextDecoder();
      for (;;) {
        const { done, value } = await stderr.read();
        if (done) break;
        const text = decoder.decode(value, { stream: true });
        this.stderr += text;
        if (process.env.REPLICA_DEBUG) process.stderr.write(`[${name}] ${text}`);
      }
    })().catch(() => {});
  }

  async #pump(): Promise<void> {
    const decoder = new TextDecoder();
    const reader = this.proc.stdout.getReader();
    let buffered = "";
    for (;;) {
      const { done, value } = await reader.read();
      if (done) break;
      buffered += decoder.decode(value, { stream: true });
      let at: number;
      while ((at = buffered.indexOf("\n")) >= 0) {
        const line = buffered.slice(0, at);
        buffered = buffered.slice(at + 1);
        this.lines.push(line);
        this.lastLineAt = performance.now();
        this.#onLine(this, line, this.lastLineAt);
        for (const w of [...this.#waiters]) {
          if (line.startsWith(w.prefix)) {
            this.#waiters.splice(this.#waiters.indexOf(w), 1);
            w.resolve(line);
          }
        }
      }
    }
  }

  get pid(): number {
    return this.proc.pid;
  }

  /** The next line (from now on) that starts with `prefix`. */
  next(prefix: string, timeoutMs = 20_000): Promise<string> {
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        reject(new Error(`${this.name}: no "${prefix}" line within ${timeoutMs} ms; stderr: ${this.stderr.slice(-2000)}`));
      }, timeoutMs);
      const waiter = {
        prefix,
        resolve: (line: string) => {
          clearTimeout(timer);
          resolve(line);
        },
      };
      this.#waiters.push(waiter);
      void this.exited.then((code) => {
        if (!this.#waiters.includes(waiter)) return;
        clearTimeout(timer);
        reject(new Error(`${this.name} exited (${code}) before a "${prefix}" line; stderr: ${this.stderr.slice(-2000)}`));
      });
    });
  }

  /** The first line ever that starts with `prefix`, or the next one. */
  first(prefix: string, timeoutMs?: number): Promise<string> {
    const seen = this.lines.find((l) => l.startsWith(prefix));
    return seen !== undefined ? Promise.resolve(seen) : this.next(prefix, timeoutMs);
  }

  /** One JSON command on the child's stdin. */
  command(command: Record<string, unknown>): void {
    this.proc.stdin.write(JSON.stringify(command) + "\n");
    this.proc.stdin.flush();
  }

  /** Its metrics now (the child answers a `stats` command). */
  async stats(timeoutMs = 10_000): Promise<ReplicaStats> {
    const line = this.next("stats ", timeoutMs);
    this.command({ op: "stats" });
    return JSON.parse((await line).slice("stats ".length));
  }

  /** Graceful stop: `bot.stop()`, backend closed; resolves with its final metrics. */
  async stop(timeoutMs = 20_000): Promise<ReplicaStats> {
    const line = this.next("stopped ", timeoutMs);
    this.command({ op: "stop" });
    const stats = JSON.parse((await line).slice("stopped ".length));
    await this.exited;
    return stats;
  }

  signal(signal: "SIGKILL" | "SIGSTOP" | "SIGCONT"): void {
    this.proc.kill(signal);
  }

  /** SIGKILL; resolves once it exited and every line it wrote was read. */
  async kill(): Promise<void> {
    this.proc.kill("SIGKILL");
    await this.exited;
    await this.drained;
  }

  /** SIGSTOP; resolves once the lines it wrote before it stopped were read (none came for 100 ms). */
  async freeze(): Promise<void> {
    this.proc.kill("SIGSTOP");
    const start = performance.now();
    do await Bun.sleep(25);
    while (performance.now() - Math.max(start, this.lastLineAt) < 100);
  }
}

// ---- the parent side: the cluster -------------------------------------------------

/** One message of the stream. */
export interface PlannedMessage {
  /** Its place in the stream (0-based): also its place in its chat. */
  index: number;
  id: string;
  chatId: string;
  /** How many replies the handler makes. */
  replies: number;
}

/** One provider call at the sink (a `sent` line of some replica). */
export interface SinkLine {
  key: string;
  chatId: string;
  text: string;
  /** When the replica made the call (its `performance.timeOrigin + now()`, in ms with fractions). */
  t: number;
  by: string;
  /** When the parent read the line (its performance.now()). */
  seenAt: number;
}

/**
 * A stream of `count` messages over `chats` chats (seeded): every third one gets
 * two replies, the rest one.
 */
export function planMessages(count: number, chats: number, seed = 7): PlannedMessage[] {
  let s = seed >>> 0;
  const random = () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  const pad = (n: number) => String(n).padStart(4, "0");
  return Array.from({ length: count }, (_, index) => ({
    index,
    id: `m${pad(index)}`,
    chatId: `c${String(Math.floor(random() * chats)).padStart(2, "0")}`,
    replies: index % 3 === 0 ? 2 : 1,
  }));
}

/** The idempotency keys a message's replies get (`<id>:<n>`). */
export function keysOf(m: PlannedMessage): string[] {
  return Array.from({ length: m.replies }, (_, n) => `${m.id}:${n + 1}`);
}

/** The text of reply `n` of message `id` (what the handler sends; deterministic). */
export function replyText(id: string, n: number): string {
  return `re:${id}#${n}`;
}

/** Whether the provider call for `key` is one of the slow ones of `config.slowSend`. */
export function isSlowKey(config: ReplicaConfig, key: string): boolean {
  return config.slowSend !== undefined && hash01(`slow:${key}`) < 1 / config.slowSend.oneIn;
}

/** A stable 0..1 value per string (FNV-1a). */
export function hash01(text: string): number {
  let h = 2166136261;
  for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 16777619);
  return (h >>> 0) / 2 ** 32;
}

/** A failover the cluster went through: what the replica held, and how soon the others took it. */
export interface Failover {
  replica: string;
  how: "killed" | "frozen";
  /** When it was killed or stopped (parent's performance.now()). */
  at: number;
  /** Admitted by it (acknowledged, or found in the journal), not yet handled to the end. */
  held: string[];
  /** Messages it had been sent but had not acknowledged. */
  unacked: string[];
  /** Of those, how many the journal had (admitted before it died). */
  unackedInJournal: number;
  /** Messages redelivered to a survivor (unacknowledged ones, and the recently acknowledged ones of a lost ack window). */
  redelivered: string[];
  /** Of those, how many the journal had when they were redelivered (the survivors must drop them as duplicates). */
  redeliveredInJournal: number;
  /** ms from `at` to the first handler start by another replica of a held message. */
  firstTakeoverMs: number | null;
  /** ms from `at` until every held message was handled by another replica. */
  allTakenMs: number | null;
}

/** The parent: routes messages to replicas sticky by chat, watches their output, fails chats over. */
export class Cluster {
  readonly ns: Namespace;
  readonly config: ReplicaConfig;
  readonly replicas: Replica[] = [];
  readonly sink: SinkLine[] = [];
  readonly ambiguousEvents: { key: string; chatId: string; by: string }[] = [];
  readonly warnings: { code: string; id: string; by: string; at: number }[] = [];
  /** id → the replica that admitted it (ack `admitted`). */
  readonly admittedBy: Map<string, string> = new Map();
  /** `ack … duplicate` lines: redeliveries the journal (or a dedupe) dropped. */
  readonly duplicateAcks: { id: string; by: string }[] = [];
  /** Handler starts: id → [{ by, at }]. */
  readonly starts: Map<string, { by: string; at: number; attempt: number }[]> = new Map();
  /** Handler ends: id → [{ by, at }]. */
  readonly handled: Map<string, { by: string; at: number }[]> = new Map();
  readonly failovers: Failover[] = [];
  /** Messages acknowledged by the replica, with when. */
  readonly acked: Map<string, { by: string; at: number }> = new Map();
  /** Admissions a replica refused (`nack`): redelivered a moment later. */
  nacks = 0;

  #messages = new Map<string, PlannedMessage>();
  #live = new Set<string>();
  /** chat → replica; a chat being failed over is absent and has a `held` queue. */
  #route = new Map<string, string>();
  #held = new Map<string, PlannedMessage[]>();
  /** chat → ids that must be handled (by anyone) before the chat moves on. */
  #blocking = new Map<string, Set<string>>();
  /** Per replica: messages written to it, not yet acknowledged. */
  #unacked = new Map<string, Map<string, PlannedMessage>>();
  #byName = new Map<string, Replica>();
  #changed: (() => void)[] = [];

  constructor(ns: Namespace, config: ReplicaConfig) {
    this.ns = ns;
    this.config = config;
  }

  /** Starts `names.length` replicas and waits until every one is ready (recovery done). */
  async start(names: string[]): Promise<void> {
    for (const name of names) {
      const replica = new Replica(this.ns, name, this.config, (r, line, at) => this.#onLine(r, line, at));
      this.replicas.push(replica);
      this.#byName.set(name, replica);
      this.#unacked.set(name, new Map());
    }
    await Promise.all(this.replicas.map((r) => r.first("ready ", 30_000)));
    for (const name of names) this.#live.add(name);
  }

  replica(name: string): Replica {
    return this.#byName.get(name)!;
  }

  get live(): string[] {
    return [...this.#live];
  }

  /** The replica a chat is routed to (undefined while it is being failed over). */
  routeOf(chatId: string): string | undefined {
    return this.#route.get(chatId);
  }

  #onLine(r: Replica, line: string, at: number): void {
    const sp = line.indexOf(" ");
    const type = sp < 0 ? line : line.slice(0, sp);
    const rest = sp < 0 ? [] : line.slice(sp + 1).split(" ");
    switch (type) {
      case "sent": {
        const [key, chatId, text, t] = rest;
        this.sink.push({ key: key!, chatId: chatId!, text: text!, t: Number(t), by: r.name, seenAt: at });
        break;
      }
      case "ack": {
        const [id, status] = rest;
        this.#unacked.get(r.name)?.delete(id!);
        if (!this.acked.has(id!)) this.acked.set(id!, { by: r.name, at });
        if (status === "admitted") this.admittedBy.set(id!, r.name);
        else this.duplicateAcks.push({ id: id!, by: r.name });
        break;
      }
      case "nack": {
        // Not admitted (fail closed): the channel redelivers it a moment later.
        this.nacks++;
        const m = this.#messages.get(rest[0]!);
        this.#unacked.get(r.name)?.delete(rest[0]!);
        if (m) setTimeout(() => this.deliver(m), 50);
        break;
      }
      case "start": {
        const [id, attempt] = rest;
        const list = this.starts.get(id!) ?? [];
        list.push({ by: r.name, at, attempt: Number(attempt) });
        this.starts.set(id!, list);
        break;
      }
      case "handled": {
        const id = rest[0]!;
        const list = this.handled.get(id) ?? [];
        list.push({ by: r.name, at });
        this.handled.set(id, list);
        this.#unblock(id);
        break;
      }
      case "ambiguous":
        this.ambiguousEvents.push({ key: rest[0]!, chatId: rest[1]!, by: r.name });
        break;
      case "warning":
        this.warnings.push({ code: rest[0]!, id: rest[1]!, by: r.name, at });
        break;
    }
    const waiters = this.#changed;
    this.#changed = [];
    for (const w of waiters) w();
  }

  /** Resolves on the next line of any replica. */
  changed(): Promise<void> {
    return new Promise((resolve) => this.#changed.push(resolve));
  }

  /** Waits until `check()` holds (re-checked on every line and every 50 ms); fails after `ms`. */
  async waitFor(what: string, ms: number, check: () => boolean): Promise<number> {
    const start = performance.now();
    while (!check()) {
      if (performance.now() - start > ms) {
        throw new Error(`timed out after ${ms} ms waiting for ${what}; ${this.stuck()}`);
      }
      await Promise.race([this.changed(), Bun.sleep(50)]);
    }
    return performance.now() - start;
  }

  /** Hands a message to the replica its chat is routed to (a new chat goes to the least loaded live replica), or holds it while its chat fails over. */
  deliver(m: PlannedMessage): void {
    this.#messages.set(m.id, m);
    const held = this.#held.get(m.chatId);
    if (held) {
      held.push(m);
      return;
    }
    let to = this.#route.get(m.chatId);
    if (to === undefined) {
      // A new chat (or one that moved) goes to the live replica with the fewest chats.
      const load = new Map([...this.#live].sort().map((n) => [n, 0]));
      for (const r of this.#route.values()) if (load.has(r)) load.set(r, load.get(r)! + 1);
      to = [...load].sort((a, b) => a[1] - b[1])[0]![0];
      this.#route.set(m.chatId, to);
    }
    this.#unacked.get(to)!.set(m.id, m);
    this.#byName.get(to)!.command({ op: "msg", id: m.id, chatId: m.chatId, text: `n=${m.replies}` });
  }

  /** Messages written to `name` and not yet acknowledged. */
  unackedOf(name: string): number {
    return this.#unacked.get(name)!.size;
  }

  /** Admitted by `name` (acknowledged by it) and not handled to the end by anyone yet. */
  inFlightOf(name: string): string[] {
    return [...this.admittedBy].filter(([id, by]) => by === name && !this.handled.has(id)).map(([id]) => id);
  }

  /** Stop routing to `name`: its chats are held (new messages wait) until {@link failOver} or {@link undrain}. Returns those chats. */
  drain(name: string): string[] {
    this.#live.delete(name);
    const chats: string[] = [];
    for (const [chat, to] of this.#route) {
      if (to === name) {
        this.#route.delete(chat);
        chats.push(chat);
        if (!this.#held.has(chat)) this.#held.set(chat, []);
      }
    }
    return chats;
  }

  /** Undoes a {@link drain} that no failover followed: `name` is live again and gets its chats back, their held messages in order. */
  undrain(name: string, chats: string[]): void {
    this.#live.add(name);
    for (const chat of chats) {
      this.#route.set(chat, name);
      this.#release(chat);
    }
  }

  /**
   * `name` died (killed) or froze (stopped, already drained), and the lines it wrote were read: its chats move to the survivors, like
   * a channel that fails over. Messages it did not acknowledge are redelivered, and so are those it
   * acknowledged within `lostAckWindowMs` before `at` (acknowledgements a dying process may not have
   * got out: the journal must drop these as duplicates). A chat moves only once every message of it
   * that `name` admitted was handled by someone (the survivors take those over when the leases
   * lapse), so the chat's messages stay in order.
   * @param reader a backend on the same namespace, to ask the journal which unacknowledged messages were admitted
   */
  async failOver(
    name: string,
    how: "killed" | "frozen",
    at: number,
    reader: DurabilityBackend,
    lostAckWindowMs = 0,
  ): Promise<Failover> {
    this.drain(name);
    const unacked = [...this.#unacked.get(name)!.values()];
    this.#unacked.get(name)!.clear();
    const failover: Failover = {
      replica: name,
      how,
      at,
      held: [],
      unacked: unacked.map((m) => m.id),
      unackedInJournal: 0,
      redelivered: [],
      redeliveredInJournal: 0,
      firstTakeoverMs: null,
      allTakenMs: null,
    };
    const admitted = new Set(this.inFlightOf(name));
    for (const m of unacked) {
      const record = await reader.inbox.get(m.id);
      if (record !== null) {
        failover.unackedInJournal++;
        if (!this.handled.has(m.id)) admitted.add(m.id);
      }
    }
    // Its lines were all read, but the journal has the last word: a record it completed is not held.
    for (const id of [...admitted]) if ((await reader.inbox.get(id))?.state === "done") admitted.delete(id);
    failover.held = [...admitted].sort();
    const lostAcks = [...this.acked].filter(([, a]) => a.by === name && a.at >= at - lostAckWindowMs).map(([id]) =>
      this.#messages.get(id)!
    );
    const redeliver = [...new Map([...unacked, ...lostAcks].map((m) => [m.id, m])).values()];
    failover.redelivered = redeliver.map((m) => m.id).sort();
    for (const m of redeliver) if (await reader.inbox.get(m.id) !== null) failover.redeliveredInJournal++;
    for (const m of redeliver) {
      const held = this.#held.get(m.chatId) ?? [];
      held.push(m);
      this.#held.set(m.chatId, held);
    }
    for (const id of admitted) {
      // One a survivor already handled during the reads above blocks nothing (its handled line came before this set).
      if ((this.handled.get(id) ?? []).some((e) => e.by !== name && e.at >= at)) continue;
      const chat = this.#messages.get(id)!.chatId;
      const set = this.#blocking.get(chat) ?? new Set();
      set.add(id);
      this.#blocking.set(chat, set);
    }
    this.failovers.push(failover);
    this.#takeoverProgress(failover);
    // Chats with nothing to wait for move at once.
    for (const chat of [...this.#held.keys()]) this.#release(chat);
    return failover;
  }

  #unblock(id: string): void {
    const m = this.#messages.get(id);
    if (!m) return;
    for (const f of this.failovers) if (f.held.includes(id)) this.#takeoverProgress(f);
    const set = this.#blocking.get(m.chatId);
    if (!set?.delete(id)) return;
    if (set.size === 0) this.#release(m.chatId);
  }

  /** Records how far the survivors got with `f`'s held messages (also right after the failover: some may have been taken during its reads). */
  #takeoverProgress(f: Failover): void {
    const takenBy = (h: string) => (this.handled.get(h) ?? []).some((e) => e.by !== f.replica && e.at >= f.at);
    if (f.firstTakeoverMs === null && f.held.some(takenBy)) {
      // The first start of a held message by another replica.
      const firstStart = f.held.flatMap((h) => this.starts.get(h) ?? []).filter((s) => s.by !== f.replica && s.at >= f.at)
        .sort((a, b) => a.at - b.at)[0];
      if (firstStart) f.firstTakeoverMs = firstStart.at - f.at;
    }
    if (f.allTakenMs === null && f.held.every(takenBy)) f.allTakenMs = performance.now() - f.at;
  }

  #release(chat: string): void {
    if ((this.#blocking.get(chat)?.size ?? 0) > 0) return;
    this.#blocking.delete(chat);
    const held = this.#held.get(chat);
    if (!held) return;
    this.#held.delete(chat);
    held.sort((a, b) => a.index - b.index);
    for (const m of held) this.deliver(m);
  }

  /** What happened in one chat, in time order (parent's clock): routing, acks, handler starts and ends, provider calls. */
  timeline(chatId: string): string[] {
    const ids = new Set([...this.#messages.values()].filter((m) => m.chatId === chatId).map((m) => m.id));
    const events: { at: number; what: string }[] = [];
    for (const l of this.sink) if (l.chatId === chatId) events.push({ at: l.seenAt, what: `sent ${l.key} by ${l.by}` });
    for (const [id, a] of this.acked) if (ids.has(id)) events.push({ at: a.at, what: `ack ${id} by ${a.by}` });
    for (const [id, list] of this.starts) {
      if (ids.has(id)) for (const s of list) events.push({ at: s.at, what: `start ${id} by ${s.by} (attempt ${s.attempt})` });
    }
    for (const [id, list] of this.handled) if (ids.has(id)) for (const h of list) events.push({ at: h.at, what: `handled ${id} by ${h.by}` });
    for (const e of this.ambiguousEvents) if (e.chatId === chatId) events.push({ at: NaN, what: `ambiguous ${e.key} by ${e.by}` });
    for (const w of this.warnings) {
      const id = w.id.includes(":") ? w.id.slice(0, w.id.lastIndexOf(":")) : w.id;
      if (ids.has(id)) events.push({ at: w.at, what: `warning ${w.code} ${w.id} by ${w.by}` });
    }
    for (const f of this.failovers) events.push({ at: f.at, what: `${f.how} ${f.replica} (held ${f.held.join(",")})` });
    return events.sort((a, b) => a.at - b.at).map((e) => `${e.at.toFixed(1)} ${e.what}`);
  }

  /** What the cluster is waiting for (for timeout messages): held chats and what blocks them, unacknowledged messages. */
  stuck(): string {
    const blocked = [...this.#held.keys()].map((chat) =>
      `${chat} (holding ${this.#held.get(chat)!.length}, waiting for ${[...(this.#blocking.get(chat) ?? [])].join(",") || "-"})`
    );
    const unacked = [...this.#unacked].map(([name, m]) => `${name}: ${[...m.keys()].join(",") || "-"}`);
    const notAcked = [...this.#messages.keys()].filter((id) => !this.acked.has(id));
    return `held chats: ${blocked.join("; ") || "-"}; unacked: ${unacked.join("; ")}; never acknowledged: ${
      notAcked.join(",") || "-"
    }; failovers: ${
      this.failovers.map((f) =>
        `${f.how} ${f.replica}: not yet taken: ${
          f.held.filter((h) => !(this.handled.get(h) ?? []).some((e) => e.by !== f.replica && e.at >= f.at)).join(",") || "-"
        }`
      ).join("; ")
    }`;
  }

  /** Chats still waiting for a failover. */
  get heldChats(): number {
    return this.#held.size;
  }
}

// ---- the end state -----------------------------------------------------------------

/** A reply that went out before the reply of an earlier message (or an earlier reply) of its chat. */
export interface OrderBreak {
  chatId: string;
  /** The key that went out first, and its message. */
  first: { key: string; id: string; by: string };
  /** The key that should have gone out first, and its message. */
  overtaken: { key: string; id: string; by: string };
  /** Both messages were held by a replica that then died or froze: the takeover broke their order. */
  fromTakeover: boolean;
  text: string;
}

/** What the checks found, for the test's assertions and its printout. */
export interface Verdict {
  messages: number;
  expectedKeys: number;
  sinkLines: number;
  /** Keys the journal holds as `unknown`. */
  unknown: string[];
  /** Keys reported by `durability:ambiguous` events (each event once). */
  ambiguousEvents: string[];
  /** Keys named by more than one ambiguous event. */
  ambiguousReportedTwice: string[];
  /** Reported ambiguous: events ∪ unknown entries. */
  reported: Set<string>;
  /** Expected keys, not ambiguous, missing at the sink. */
  lost: string[];
  /** Keys at the sink more than once (with the count), not ambiguous. */
  duplicates: { key: string; times: number }[];
  /** Ambiguous keys at the sink more than once (hold means: never resent). */
  ambiguousDuplicates: { key: string; times: number }[];
  /** Keys at the sink that no message should have produced. */
  unexpected: string[];
  /** Sink lines whose text is not the reply the key stands for. */
  wrongText: string[];
  /** Per-chat order breaks among non-ambiguous replies (a reply of a later message went out first). */
  orderBreaks: OrderBreak[];
  inbox: { done: number; dead: string[]; active: number };
  outbox: { sent: number; dead: string[]; active: number };
}

/** Reads the journal through `reader` and checks the sink against the plan. */
export async function verify(
  plan: PlannedMessage[],
  cluster: Cluster,
  reader: DurabilityBackend,
): Promise<Verdict> {
  const all = { limit: 1_000_000 };
  const [done, inboundDead, inboundActive, sent, unknown, outboundDead, outboundActive] = await Promise.all([
    reader.inbox.list({ ...all, state: "done" }),
    reader.inbox.list({ ...all, state: "dead" }),
    reader.inbox.list({ ...all, state: ["pending", "processing", "failed"] }),
    reader.outbox.list({ ...all, state: "sent" }),
    reader.outbox.list({ ...all, state: "unknown" }),
    reader.outbox.list({ ...all, state: "dead" }),
    reader.outbox.list({ ...all, state: ["queued", "sending", "failed"] }),
  ]);
  const unknownKeys = unknown.map((e) => e.key).sort();
  const eventKeys = cluster.ambiguousEvents.map((e) => e.key);
  const reported = new Set([...unknownKeys, ...eventKeys]);
  const expected = new Map<string, { m: PlannedMessage; n: number }>();
  for (const m of plan) keysOf(m).forEach((k, i) => expected.set(k, { m, n: i + 1 }));
  const byKey = new Map<string, SinkLine[]>();
  for (const line of cluster.sink) byKey.set(line.key, [...(byKey.get(line.key) ?? []), line]);

  const lost = [...expected.keys()].filter((k) => !reported.has(k) && !byKey.has(k));
  const duplicates: Verdict["duplicates"] = [];
  const ambiguousDuplicates: Verdict["ambiguousDuplicates"] = [];
  for (const [key, lines] of byKey) {
    if (lines.length < 2) continue;
    (reported.has(key) ? ambiguousDuplicates : duplicates).push({ key, times: lines.length });
  }
  const unexpected = [...byKey.keys()].filter((k) => !expected.has(k));
  const wrongText = cluster.sink.filter((l) => {
    const e = expected.get(l.key);
    return e !== undefined && (l.text !== replyText(e.m.id, e.n) || l.chatId !== e.m.chatId);
  }).map((l) => `${l.key}: ${l.chatId} ${l.text}`);

  // Per chat, the first call of each non-ambiguous key in time order must follow the stream order.
  const orderBreaks: OrderBreak[] = [];
  const takenBy = (id: string, f: Failover) => (cluster.handled.get(id) ?? []).find((h) => h.by !== f.replica && h.at >= f.at)?.by;
  const firstCalls = [...byKey.entries()].filter(([k]) => expected.has(k) && !reported.has(k))
    .map(([k, lines]) => ({ key: k, ...expected.get(k)!, t: Math.min(...lines.map((l) => l.t)) }));
  const chats = new Map<string, typeof firstCalls>();
  for (const c of firstCalls) chats.set(c.m.chatId, [...(chats.get(c.m.chatId) ?? []), c]);
  for (const [chat, calls] of chats) {
    calls.sort((a, b) => a.t - b.t);
    for (let i = 1; i < calls.length; i++) {
      const a = calls[i - 1]!;
      const b = calls[i]!;
      if (a.m.index > b.m.index || (a.m.index === b.m.index && a.n > b.n)) {
        const lineOf = (c: typeof a) => byKey.get(c.key)!.reduce((x, y) => (y.t < x.t ? y : x));
        const took = cluster.failovers.find((f) => f.held.includes(a.m.id) && f.held.includes(b.m.id));
        const fromTakeover = took !== undefined;
        const how = took === undefined
          ? ""
          : takenBy(a.m.id, took) !== takenBy(b.m.id, took)
          ? `: both taken over from ${took.replica}, by two replicas (${takenBy(b.m.id, took)}, ${takenBy(a.m.id, took)})`
          : `: both taken over from ${took.replica} by ${takenBy(a.m.id, took)}, the later one first`;
        orderBreaks.push({
          chatId: chat,
          first: { key: a.key, id: a.m.id, by: lineOf(a).by },
          overtaken: { key: b.key, id: b.m.id, by: lineOf(b).by },
          fromTakeover,
          text: `${chat}: ${a.key} (by ${lineOf(a).by}) went out before ${b.key} (by ${lineOf(b).by})${how}`,
        });
      }
    }
  }
  const counts = new Map<string, number>();
  for (const k of eventKeys) counts.set(k, (counts.get(k) ?? 0) + 1);
  return {
    messages: plan.length,
    expectedKeys: expected.size,
    sinkLines: cluster.sink.length,
    unknown: unknownKeys,
    ambiguousEvents: [...new Set(eventKeys)].sort(),
    ambiguousReportedTwice: [...counts].filter(([, n]) => n > 1).map(([k]) => k),
    reported,
    lost,
    duplicates,
    ambiguousDuplicates,
    unexpected,
    wrongText,
    orderBreaks,
    inbox: { done: done.length, dead: inboundDead.map((r) => r.id), active: inboundActive.length },
    outbox: { sent: sent.length, dead: outboundDead.map((e) => e.key), active: outboundActive.length },
  };
}
