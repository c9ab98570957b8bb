// The Redis backend on a real Redis Cluster (3 masters, each with a replica; redis-server on loopback,
// started for this file by tests/support/redis_cluster.ts), through ioredis' `Cluster` client:
//
// 1. The conformance suite: RedisDurability (the whole suite: journal contract, bot rules, crash
//    matrix), RedisStore#durability() and new KvDurability(RedisKv) (the journal contract), the rate
//    limiter contract, and RedisStore's session values. Each test has its own random key prefix, so
//    its own hash slot (on whichever master holds it).
// 2. A slot migration caught half-way (some keys of the prefix moved, the others not yet): every
//    script answers TRYAGAIN before it reads or writes anything (the slot guard of lua.ts), the
//    client retries, and once the slot is settled the calls run on every key. Without the guard a
//    read there answered a stored record as missing and a session write on the importing node broke
//    the operator's MIGRATE (BUSYKEY).
// 3. Scripts lost by a failover: a replica promoted by CLUSTER FAILOVER has none of the scripts (the
//    script cache is not replicated); the first call after it loads them again (NOSCRIPT).
//
// The replicas-as-processes scenarios on the cluster (SIGKILL, slot migration and master failover
// while a stream is handled) are in tests/replicas.test.ts (target "Redis Cluster").
import { afterAll, describe, expect, test } from "bun:test";
import IORedis, { type Cluster } from "ioredis";
import type { DurabilityBackend } from "../src/contract.ts";
import { RedisDurability, RedisKv, RedisRateLimiter, RedisStore } from "../backends/redis/mod.ts";
import { KvDurability } from "../backends/kv/durability.ts";
import { BATCH, SCRIPTS } from "../backends/redis/lua.ts";
import { sha1Hex } from "../backends/redis/runner.ts";
import { runBackendContract, runDurabilityConformance, runRateLimiterConformance } from "../testing.ts";
import { runId } from "./support/services.ts";
import { clusterSkip, type RedisClusterHandle, startRedisCluster } from "./support/redis_cluster.ts";

const skip = clusterSkip();
const harness = { describe, test, expect };
/** Several suites run at once under npm test: leases get margin (ioredis' timeScale of conformance_redis). */
const TIME_SCALE = 3;

const cluster: RedisClusterHandle | null = skip ? null : await startRedisCluster({ masters: 3, replicasPerMaster: 1 });
const clients: Cluster[] = [];
/** A Cluster client of the test cluster (disconnected at the end). */
function clusterClient(): Cluster {
  const [host, port] = cluster!.addresses[0]!.split(":");
  const client = new IORedis.Cluster([{ host: host!, port: Number(port) }], { retryDelayOnTryAgain: 100 });
  clients.push(client);
  return client;
}
const admin = cluster ? clusterClient() : null;
afterAll(async () => {
  for (const c of clients) c.disconnect();
  await cluster?.stop();
});

/** The keys under `{keyPrefix}` (one slot: read on the master that holds it). */
async function keysOf(keyPrefix: string): Promise<string[]> {
  const tag = `{${keyPrefix}}`;
  const master = cluster!.node(await cluster!.masterOf(await cluster!.keyslot(tag)));
  const out: string[] = [];
  let cursor = "0";
  do {
    const [next, keys] = await master.scan(cursor, "MATCH", `${tag}*`, "COUNT", 1000);
    cursor = next;
    out.push(...keys);
  } while (cursor !== "0");
  return out;
}

async function dropPrefix(keyPrefix: string): Promise<void> {
  const keys = await keysOf(keyPrefix);
  // One slot: a multi-key DEL is routed as one call.
  for (let i = 0; i < keys.length; i += 500) await admin!.del(...keys.slice(i, i + 500));
}

interface Held {
  client: Cluster;
  keyPrefix: string;
  next?: DurabilityBackend;
}
const held = new WeakMap<object, Held>();

type Build = (client: Cluster, keyPrefix: string, clock: () => number) => DurabilityBackend;

function over(keyPrefix: string, build: Build, clock: () => number): DurabilityBackend {
  const client = clusterClient();
  const backend = build(client, keyPrefix, clock);
  held.set(backend, { client, keyPrefix });
  return backend;
}

/** The damaged-records hook: the record's state an unknown word, in place. */
async function damageState(backend: DurabilityBackend, journal: "inbox" | "outbox", id: string): Promise<DurabilityBackend> {
  const key = `{${held.get(backend)!.keyPrefix}}${journal === "inbox" ? "in" : "out"}:r:${id}`;
  if ((await admin!.hset(key, "state", "lost")) !== 0) throw new Error(`no record at ${key}`);
  return backend;
}

/** The hook of KvDurability over RedisKv: the kv value of the record given a shape that is no record. */
async function damageKv(backend: DurabilityBackend, journal: "inbox" | "outbox", id: string): Promise<DurabilityBackend> {
  const kv = new RedisKv({ client: admin, keyPrefix: held.get(backend)!.keyPrefix });
  const key = `r/${journal === "inbox" ? "in" : "out"}/${id.replace(/[%/]/g, (c) => (c === "%" ? "%25" : "%2F"))}`;
  const stored = (await kv.get(key))!.value as { rec: Record<string, unknown> };
  await kv.set(key, journal === "inbox" ? { ...stored, rec: { ...stored.rec, state: "archived" } } : "{not json");
  return backend;
}

function suite(
  title: string,
  build: Build,
  run: typeof runDurabilityConformance,
  damage: typeof damageState,
): void {
  run({
    name: `redis cluster (${title}, ioredis Cluster)`,
    skip,
    create: ({ now }) => over(`bm-cluster:${runId()}:`, build, now),
    reopen: (old, { now }) => {
      const h = held.get(old)!;
      h.client.disconnect();
      h.next = over(h.keyPrefix, build, now);
      return h.next;
    },
    cleanup: async (backend) => {
      let h = held.get(backend)!;
      while (h.next) h = held.get(h.next)!;
      await dropPrefix(h.keyPrefix);
      h.client.disconnect();
    },
    damage,
    harness,
    timeScale: TIME_SCALE,
    // The scripts' time comes from the test's clock (option `clock`): leases lapse in simulated time.
    simulatedTime: true,
  });
}

suite("RedisDurability", (client, keyPrefix, clock) => new RedisDurability({ client, keyPrefix, clock }), runBackendContract, damageState);
suite("RedisStore#durability", (client, keyPrefix, clock) => new RedisStore({ client, keyPrefix, clock }).durability(), runBackendContract, damageState);
suite("new KvDurability(RedisKv)", (client, keyPrefix, clock) => new KvDurability(new RedisKv({ client, keyPrefix, clock })), runBackendContract, damageKv);

runRateLimiterConformance({
  name: "redis cluster (ioredis Cluster)",
  harness,
  skip,
  freshBucketsHoldOne: false,
  create: () => new RedisRateLimiter({ client: admin!, keyPrefix: `bm-cluster-rl:${runId()}:` }),
});

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

describe("redis cluster: RedisStore", () => {
  test.skipIf(Boolean(skip))("session values: set, get, expiry, delete on the prefix's master", async () => {
    const keyPrefix = `bm-cluster-store:${runId()}:`;
    try {
      const store = new RedisStore({ client: admin, keyPrefix });
      await store.set("chat:1", { step: 2 });
      await store.set("chat:2", "short", { ttlMs: 200 });
      expect(await store.get("chat:1")).toEqual({ step: 2 });
      expect(await store.get("chat:2")).toBe("short");
      // The values live on the master of the prefix's slot.
      expect((await keysOf(keyPrefix)).sort()).toEqual([`{${keyPrefix}}s:chat:1`, `{${keyPrefix}}s:chat:2`]);
      await sleep(400);
      expect(await store.get("chat:2")).toBeUndefined();
      await store.delete("chat:1");
      expect(await store.get("chat:1")).toBeUndefined();
    } finally {
      await dropPrefix(keyPrefix);
    }
  });
});

describe("redis cluster: a slot migration caught half-way", () => {
  test.skipIf(Boolean(skip))("every call waits (TRYAGAIN, nothing run) until the slot is settled, then sees every key", async () => {
    const keyPrefix = `bm-cluster-mig:${runId()}:`;
    const tag = `{${keyPrefix}}`;
    const client = clusterClient();
    const backend = new RedisDurability({ client, keyPrefix });
    const store = new RedisStore({ client, keyPrefix });
    const kv = new RedisKv({ client, keyPrefix });
    const limiter = new RedisRateLimiter({ client, keyPrefix });
    try {
      await backend.open();
      const at = Date.now();
      for (let i = 0; i < 20; i++) {
        await backend.inbox.admit({ id: `m${i}`, kind: "message", chatId: `c${i % 3}`, provider: "t", payload: { i }, receivedAt: at + i });
      }
      await store.set("s1", { v: 1 });
      const version = await kv.set("k1", { v: 1 });
      expect((await limiter.take([{ key: "b", count: 1, perMs: 60_000, burst: 1 }])).ok).toBe(true);

      const slot = await cluster!.keyslot(tag);
      const from = await cluster!.masterOf(slot);
      const to = (await cluster!.masters()).find((p) => p !== from)!;
      const idOf = (port: number) => cluster!.nodes.find((n) => n.port === port)!.id;
      const source = cluster!.node(from);
      const keys = (await source.cluster("GETKEYSINSLOT", slot, 10_000)) as string[];
      const mine = keys.filter((k) => k.startsWith(tag));
      // The records, the session value, the kv entry and the bucket stay on the source for now; some index keys move.
      const stay = (k: string) => /in:r:|s:s1$|kv:r:k1$|rl:b$/.test(k);
      const first = mine.filter((k) => !stay(k));
      expect(first.length).toBeGreaterThan(0);
      await cluster!.node(to).cluster("SETSLOT", slot, "IMPORTING", idOf(from));
      await source.cluster("SETSLOT", slot, "MIGRATING", idOf(to));
      await source.migrate("127.0.0.1", to, "", 0, 10_000, "KEYS", ...first);

      // Issued while the slot is half moved: none may answer before it is settled.
      const settledAt = { t: Infinity };
      const answered = <T>(p: Promise<T>) => p.then((value) => ({ value, at: Date.now() }));
      const calls = {
        get: answered(backend.inbox.get("m3")),
        list: answered(backend.inbox.list({ limit: 100 })),
        admit: answered(backend.inbox.admit({ id: "late", kind: "message", chatId: "c0", provider: "t", payload: {}, receivedAt: at + 100 })),
        session: answered(store.get("s1")),
        sessionSet: answered(store.set("s1", { v: 2 })),
        kvGet: answered(kv.get("k1")),
        take: answered(limiter.take([{ key: "b", count: 1, perMs: 60_000, burst: 1 }])),
      };
      await sleep(1_500);
      // Nothing was written on the importing node meanwhile: the rest of the keys move without BUSYKEY.
      const rest = ((await source.cluster("GETKEYSINSLOT", slot, 10_000)) as string[]).filter((k) => k.startsWith(tag));
      expect(rest.length).toBeGreaterThan(0);
      expect(rest.filter(stay).length).toBe(mine.filter(stay).length);
      expect(await source.migrate("127.0.0.1", to, "", 0, 10_000, "KEYS", ...rest)).toBe("OK");
      settledAt.t = Date.now();
      for (const port of [to, from, ...(await cluster!.masters()).filter((p) => p !== to && p !== from)]) {
        await cluster!.node(port).cluster("SETSLOT", slot, "NODE", idOf(to));
      }
      const r = {
        get: await calls.get,
        list: await calls.list,
        admit: await calls.admit,
        session: await calls.session,
        sessionSet: await calls.sessionSet,
        kvGet: await calls.kvGet,
        take: await calls.take,
      };
      for (const [name, { at: t }] of Object.entries(r)) expect({ name, afterSettled: t >= settledAt.t }).toEqual({ name, afterSettled: true });
      expect(r.get.value?.state).toBe("pending");
      // The list ran before or after the late admission (both waited): all 20 earlier records in it.
      expect(r.list.value.map((x) => x.id).filter((id) => id !== "late").sort()).toEqual(
        Array.from({ length: 20 }, (_, i) => `m${i}`).sort(),
      );
      expect(r.admit.value?.state).toBe("pending");
      // The read ran before or after the concurrent write (both waited), never on a half-moved slot.
      expect([{ v: 1 }, { v: 2 }]).toContainEqual(r.session.value as { v: number });
      expect(await store.get("s1")).toEqual({ v: 2 });
      expect(r.kvGet.value?.version).toBe(version!);
      // The bucket was full: the take of the half-moved slot waited and then saw it.
      expect(r.take.value.ok).toBe(false);
      expect((await backend.inbox.list({ limit: 100 })).length).toBe(21);
      expect(await cluster!.masterOf(slot)).toBe(to);
      expect(await source.cluster("COUNTKEYSINSLOT", slot)).toBe(0);
    } finally {
      await dropPrefix(keyPrefix);
    }
  }, 30_000);
});

describe("redis cluster: resharding onto a new master", () => {
  test.skipIf(Boolean(skip))("the slot moved under load to a master that joined after the scripts were loaded", async () => {
    const keyPrefix = `bm-cluster-new:${runId()}:`;
    const client = clusterClient();
    const backend = new RedisDurability({ client, keyPrefix });
    try {
      await backend.open();
      const slot = await cluster!.keyslot(`{${keyPrefix}}`);
      const fresh = await cluster!.addMaster();
      // It gets a slot of its own first, as a rebalancing would: ioredis 5 sends ASKING without handling
      // its promise, and while the ASK target holds no slot the Cluster's slot refresh drops its
      // connection, so that ASKING rejects unhandled ("Connection is closed.", outside any call).
      await cluster!.moveSlot((slot + 8192) % 16384, fresh);
      const shas = await Promise.all([SCRIPTS.inGet, BATCH].map((s) => sha1Hex(s.text)));
      expect(await cluster!.node(fresh).script("EXISTS", ...shas)).toEqual([0, 0]);
      // Admissions and reads go on while the slot moves, one after the other in 4 lanes.
      let stop = false;
      const admitted: string[] = [];
      const failures: string[] = [];
      const lane = async (n: number) => {
        for (let i = 0; !stop; i++) {
          const id = `l${n}-${i}`;
          try {
            const r = await backend.inbox.admit({ id, kind: "message", chatId: `c${n}`, provider: "t", payload: { i }, receivedAt: Date.now() });
            if (r?.state !== "pending") throw new Error(`admit ${id} answered ${JSON.stringify(r)}`);
            admitted.push(id);
            if ((await backend.inbox.get(id))?.id !== id) throw new Error(`get ${id} missed the record`);
          } catch (error) {
            failures.push(String(error));
          }
        }
      };
      const lanes = [0, 1, 2, 3].map(lane);
      await sleep(500);
      // Batches of 20 keys: the move takes a second or two (the calls wait for it, up to TRYAGAIN_RETRY_MS).
      const moved = await cluster!.moveSlot(slot, fresh, { batch: 20, pauseMs: 5 });
      await sleep(300);
      stop = true;
      await Promise.all(lanes);
      console.log(
        `resharding onto a new master: ${moved.keys} keys in ${moved.batches} MIGRATE calls, ${admitted.length} admitted, ` +
          `${failures.length} failures`,
      );
      expect(failures).toEqual([]);
      expect(moved.batches).toBeGreaterThan(1);
      expect(await cluster!.masterOf(slot)).toBe(fresh);
      expect(await cluster!.node(fresh).script("EXISTS", ...shas)).toEqual([1, 1]);
      const listed = new Set((await backend.inbox.list({ limit: 100_000 })).map((r) => r.id));
      expect(admitted.filter((id) => !listed.has(id))).toEqual([]);
      expect(listed.size).toBe(admitted.length);
    } finally {
      await dropPrefix(keyPrefix);
    }
  }, 60_000);
});

describe("redis cluster: a master failover", () => {
  test.skipIf(Boolean(skip))("the promoted replica has no scripts: the next calls load them again", async () => {
    const keyPrefix = `bm-cluster-fo:${runId()}:`;
    const client = clusterClient();
    const backend = new RedisDurability({ client, keyPrefix });
    try {
      await backend.open();
      await backend.inbox.admit({ id: "a", kind: "message", chatId: "c", provider: "t", payload: {}, receivedAt: Date.now() });
      const slot = await cluster!.keyslot(`{${keyPrefix}}`);
      const old = await cluster!.masterOf(slot);
      const promoted = await cluster!.failover(old);
      expect(await cluster!.masterOf(slot)).toBe(promoted);
      // A promoted replica may lack the scripts (SCRIPT LOAD went to the masters of the time; the cache
      // is not part of the replication stream): flushed here, so that the calls below meet NOSCRIPT.
      await cluster!.node(promoted).script("FLUSH");
      const shas = await Promise.all([SCRIPTS.inGet, BATCH].map((s) => sha1Hex(s.text)));
      expect(await cluster!.node(promoted).script("EXISTS", ...shas)).toEqual([0, 0]);
      // Writes and reads go on, through MOVED and NOSCRIPT, with nothing lost (a manual failover waits
      // for the replica to catch up).
      expect((await backend.inbox.get("a"))?.state).toBe("pending");
      const b = await backend.inbox.admit({ id: "b", kind: "message", chatId: "c", provider: "t", payload: {}, receivedAt: Date.now() });
      expect(b?.state).toBe("pending");
      expect((await backend.inbox.list({ limit: 10 })).map((r) => r.id).sort()).toEqual(["a", "b"]);
      expect(await cluster!.node(promoted).script("EXISTS", ...shas)).toEqual([1, 1]);
    } finally {
      await dropPrefix(keyPrefix);
    }
  }, 60_000);
});
