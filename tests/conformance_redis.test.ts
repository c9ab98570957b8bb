// The conformance suite on Redis: the whole of it on RedisDurability over ioredis; the journal contract
// over @upstash/redis (through the loopback Upstash bridge, auto-pipelining off and on), node-redis and
// Bun's RedisClient, and on RedisStore#durability() and new KvDurability(RedisKv).
import { afterAll, describe, expect, test } from "bun:test";
import { Redis as Upstash } from "@upstash/redis";
import IORedis from "ioredis";
import { createClient } from "redis";
import { RedisClient } from "bun";
import type { DurabilityBackend } from "../src/contract.ts";
import { RedisDurability, RedisKv, RedisStore } from "../backends/redis/mod.ts";
import { KvDurability } from "../backends/kv/durability.ts";
import { runBackendContract, runDurabilityConformance } from "../testing.ts";
import { REDIS_URL, runId, serviceSkip } from "./support/services.ts";
import { startUpstashBridge, type UpstashBridge } from "./support/upstash_bridge.ts";



const skip = await serviceSkip("redis");
const harness = { describe, test, expect };

let bridge: UpstashBridge | null = null;
const admin = skip ? null : new IORedis(REDIS_URL, { lazyConnect: false });
if (!skip) bridge = await startUpstashBridge();
afterAll(async () => {
  await bridge?.stop();
  admin?.disconnect();
});

/** Deletes every key under the prefix (SCAN + DEL). */
async function dropPrefix(keyPrefix: string): Promise<void> {
  if (!admin) return;
  let cursor = "0";
  do {
    const [next, keys] = await admin.scan(cursor, "MATCH", `{${keyPrefix}}*`, "COUNT", 1000);
    cursor = next;
    if (keys.length > 0) await admin.del(...keys);
  } while (cursor !== "0");
}

/** One way to build a client, and to let it go as a killed process would. */
interface ClientKind {
  name: string;
  /** Leases and sleeps of the suite are multiplied by this (HTTP round trips are slower under load). */
  timeScale: number;
  open(): unknown | Promise<unknown>;
  close(client: unknown): void | Promise<void>;
}

const upstash = (autoPipelining: boolean): ClientKind => ({
  name: `@upstash/redis over the REST bridge, auto-pipelining ${autoPipelining ? "on" : "off"}`,
  timeScale: 4,
  open: () => new Upstash({ url: bridge!.url, token: bridge!.token, enableAutoPipelining: autoPipelining, retry: false }),
  close: () => {},
});
const ioredis: ClientKind = {
  name: "ioredis",
  timeScale: 2,
  open: () => new IORedis(REDIS_URL),
  close: (c) => (c as IORedis).disconnect(),
};
const nodeRedis: ClientKind = {
  name: "node-redis",
  timeScale: 2,
  open: () => createClient({ url: REDIS_URL }).connect(),
  close: async (c) => {
    await (c as ReturnType<typeof createClient>).destroy();
  },
};
const bunRedis: ClientKind = {
  name: "Bun RedisClient",
  timeScale: 2,
  open: () => new RedisClient(REDIS_URL),
  close: (c) => (c as RedisClient).close(),
};

interface Held {
  client: unknown;
  keyPrefix: string;
  kind: ClientKind;
  /** The backend `reopen` replaced this one with (its client is the open one). */
  next?: DurabilityBackend;
}
const held = new WeakMap<object, Held>();

async function over(
  kind: ClientKind,
  keyPrefix: string,
  build: (client: unknown, keyPrefix: string, clock: (() => number) | undefined) => DurabilityBackend,
  clock: (() => number) | undefined,
) {
  const client = await kind.open();
  const backend = build(client, keyPrefix, clock);
  held.set(backend, { client, keyPrefix, kind });
  return backend;
}

/**
 * A damaged-records tests' hook: the record's payload (inbox) made too deep or content (outbox) made invalid
 * JSON in place, as a hand edit or a bug elsewhere would leave it; or (`"state"`) its state an unknown word.
 */
const damageOf = (what: "json" | "state") =>
async (backend: DurabilityBackend, journal: "inbox" | "outbox", id: string): Promise<DurabilityBackend> => {
  const { keyPrefix } = held.get(backend)!;
  const key = `{${keyPrefix}}${journal === "inbox" ? "in" : "out"}:r:${id}`;
  // The inbox record's payload nested far deeper than the journal writes (MAX_STORED_DEPTH); the outbox entry's not JSON.
  const [field, value] = what === "state"
    ? ["state", "lost"]
    : journal === "inbox"
    ? ["payload", "[".repeat(300_000) + "]".repeat(300_000)]
    : ["content", "{not json"];
  if ((await admin!.hset(key, field, value)) !== 0) throw new Error(`no record at ${key}`);
  return backend;
};

/**
 * The hook of KvDurability over RedisKv: the kv value of the record given a shape that is no record
 * (an inbox record's state an unknown word; an outbox entry's value a bare string).
 */
async function damageKv(backend: DurabilityBackend, journal: "inbox" | "outbox", id: string): Promise<DurabilityBackend> {
  const kv = new RedisKv({ client: admin, keyPrefix: held.get(backend)!.keyPrefix });
  const key = `r/${journal === "inbox" ? "in" : "out"}/${id.replace(/[%/]/g, (c) => (c === "%" ? "%25" : "%2F"))}`;
  const stored = (await kv.get(key))!.value as { rec: Record<string, unknown> };
  await kv.set(key, journal === "inbox" ? { ...stored, rec: { ...stored.rec, state: "archived" } } : "{not json");
  return backend;
}

function suite(
  title: string,
  kind: ClientKind,
  build: (client: unknown, keyPrefix: string, clock: (() => number) | undefined) => DurabilityBackend,
  run: typeof runDurabilityConformance = runDurabilityConformance,
  damage: "json" | "state" | "kv" = "json",
  /** `server`: the production scripts on the server's clock, in real time (leases and sleeps scaled). */
  time: "simulated" | "server" = "simulated",
): void {
  const simulated = time === "simulated";
  run({
    name: `redis (${title}, ${kind.name}${simulated ? "" : ", the server's clock"})`,
    skip,
    create: ({ now }) => over(kind, `bm-conf:${runId()}:`, build, simulated ? now : undefined),
    reopen: async (old, { now }) => {
      const h = held.get(old)!;
      await h.kind.close(h.client);
      h.next = await over(kind, h.keyPrefix, build, simulated ? now : undefined);
      return h.next;
    },
    // Given the first backend of a test that reopened (the damaged-records tests do), the client to
    // close is the last one's.
    cleanup: async (backend) => {
      let h = held.get(backend)!;
      while (h.next) h = held.get(h.next)!;
      await dropPrefix(h.keyPrefix);
      await h.kind.close(h.client);
    },
    damage: damage === "kv" ? damageKv : damageOf(damage),
    harness,
    // Simulated: the scripts' time comes from the test's clock (option `clock`), leases lapse in simulated
    // time. On the server's clock, run beside the other suites (two cores busy): leases get more room.
    timeScale: simulated ? kind.timeScale : kind.timeScale * 1.5,
    simulatedTime: simulated,
  });
}

const durability = (client: unknown, keyPrefix: string, clock: (() => number) | undefined) => new RedisDurability({ client, keyPrefix, clock });

// The whole suite (journal contract, the bot's rules, the crash matrix) once, over ioredis. The other
// clients and wrappers run the same scripts: the journal contract is enough for them.
suite("RedisDurability", ioredis, durability, runDurabilityConformance, "state");
suite("RedisDurability", upstash(false), durability, runBackendContract);
suite("RedisDurability", upstash(true), durability, runBackendContract);
suite("RedisStore#durability", ioredis, (client, keyPrefix, clock) => new RedisStore({ client, keyPrefix, clock }).durability(), runBackendContract);
suite("new KvDurability(RedisKv)", upstash(false), (client, keyPrefix, clock) => new KvDurability(new RedisKv({ client, keyPrefix, clock })), runBackendContract, "kv");
suite("RedisDurability", nodeRedis, durability, runBackendContract);
suite("RedisDurability", bunRedis, durability, runBackendContract);
// The production scripts (the server's TIME) and real leases: the journal contract once more.
suite("RedisDurability", ioredis, durability, runBackendContract, "state", "server");
