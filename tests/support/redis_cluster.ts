/**
 * A throwaway Redis Cluster on loopback for the cluster tests: `masters` masters (each with
 * `replicasPerMaster` replicas) of the Debian `redis-server` binary on free ports, in a temp dir of
 * its own (`nodes.conf`, logs), without persistence; created with `redis-cli --cluster create`, then
 * waited for until every node reports `cluster_state:ok` and agrees on the slots. `stop()` kills
 * the processes and removes the dir. Helpers: move a slot to another master (the way an operator
 * reshards: IMPORTING/MIGRATING, MIGRATE in batches, SETSLOT NODE on every master) and the manual
 * failover of a master.
 */
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import IORedis from "ioredis";
import { SERVICES_REQUIRED } from "./services.ts";

/** One node of the cluster. */
export interface ClusterNode {
  port: number;
  /** The node id (40 hex digits). */
  id: string;
  process: ChildProcess;
}

/** A running test cluster. */
export interface RedisClusterHandle {
  /** `127.0.0.1:port` of every node (masters first, as created). */
  readonly addresses: string[];
  /** Every node, those added by `addMaster` too. */
  readonly nodes: ClusterNode[];
  /** The dir of its files (removed by `stop`). */
  readonly dir: string;
  /** A direct (non-cluster) client of the node at `port`. */
  node(port: number): IORedis;
  /** The port of the master that serves `slot` now (by the view of the first reachable node). */
  masterOf(slot: number): Promise<number>;
  /** The ports of the masters. */
  masters(): Promise<number[]>;
  /** The hash slot of `key` (`CLUSTER KEYSLOT`). */
  keyslot(key: string): Promise<number>;
  /**
   * Moves `slot` from its master to the master at `toPort`: SETSLOT IMPORTING on the target,
   * MIGRATING on the source, then MIGRATE of the keys `batch` at a time (`pauseMs` between batches),
   * then SETSLOT NODE on the target, the source and every other master.
   * @returns how many keys were moved and in how many MIGRATE calls
   */
  moveSlot(slot: number, toPort: number, options?: { batch?: number; pauseMs?: number; onBatch?: (moved: number) => void }): Promise<{ keys: number; batches: number }>;
  /** `CLUSTER FAILOVER` on a replica of the master at `masterPort`; resolves once the replica is master. @returns its port */
  failover(masterPort: number): Promise<number>;
  /** Starts one more node and adds it as a master without slots (CLUSTER MEET); resolves once every node knows it. @returns its port */
  addMaster(): Promise<number>;
  /** Kills every node and removes the dir. */
  stop(): Promise<void>;
}

/** Whether the `redis-server` and `redis-cli` binaries are on the PATH. */
function haveBinaries(): boolean {
  for (const bin of ["redis-server", "redis-cli"]) {
    const r = spawnSync(bin, ["--version"], { stdio: "ignore" });
    if (r.error || r.status !== 0) return false;
  }
  return true;
}

/**
 * A skip reason when the cluster cannot be started here (no `redis-server`), or `false`.
 * @throws {Error} when `BOTMESH_REQUIRE_SERVICES=1` and the binaries are missing
 */
export function clusterSkip(): string | false {
  if (haveBinaries()) return false;
  const reason = "redis-server or redis-cli is not on the PATH: skipping the Redis Cluster tests (install redis-server)";
  if (SERVICES_REQUIRED) throw new Error(`BOTMESH_REQUIRE_SERVICES=1 but ${reason}`);
  console.warn(reason);
  return reason;
}

/** A free TCP port on loopback whose cluster bus port (+10000) is free too. */
async function freePort(taken: Set<number>): Promise<number> {
  for (let attempt = 0; attempt < 50; attempt++) {
    const port = await new Promise<number>((resolve, reject) => {
      const server = createServer();
      server.once("error", reject);
      server.listen(0, "127.0.0.1", () => {
        const p = (server.address() as { port: number }).port;
        server.close(() => resolve(p));
      });
    });
    if (port + 10_000 > 65_535 || taken.has(port) || taken.has(port + 10_000)) continue;
    const busFree = await new Promise<boolean>((resolve) => {
      const server = createServer();
      server.once("error", () => resolve(false));
      server.listen(port + 10_000, "127.0.0.1", () => server.close(() => resolve(true)));
    });
    if (!busFree) continue;
    taken.add(port);
    taken.add(port + 10_000);
    return port;
  }
  throw new Error("no free port pair (port, port + 10000) for a cluster node after 50 attempts");
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));

async function waitFor<T>(what: string, timeoutMs: number, probe: () => Promise<T | undefined | false>): Promise<T> {
  const deadline = Date.now() + timeoutMs;
  let last: unknown;
  for (;;) {
    try {
      const v = await probe();
      if (v !== undefined && v !== false) return v as T;
    } catch (error) {
      last = error;
    }
    if (Date.now() > deadline) throw new Error(`Redis cluster: timed out after ${timeoutMs} ms waiting for ${what}${last ? ` (last error: ${last})` : ""}`);
    await sleep(100);
  }
}

function run(bin: string, args: string[]): Promise<{ code: number | null; out: string }> {
  return new Promise((resolve) => {
    const child = spawn(bin, args, { stdio: ["ignore", "pipe", "pipe"] });
    let out = "";
    child.stdout.on("data", (d) => (out += d));
    child.stderr.on("data", (d) => (out += d));
    child.on("close", (code) => resolve({ code, out }));
  });
}

/** The slot ranges of `CLUSTER SHARDS`/`SLOTS` as [from, to, masterPort][]. */
async function slotMap(client: IORedis): Promise<Array<[number, number, number]>> {
  const slots = (await client.cluster("SLOTS")) as unknown as Array<[number, number, [string, number, string]]>;
  return slots.map(([from, to, master]) => [from, to, Number(master[1])]);
}

/**
 * Starts a cluster of `masters` masters with `replicasPerMaster` replicas each.
 * @param options `masters` (default 3), `replicasPerMaster` (default 0)
 * @returns the handle; call `stop()` at the end
 */
export async function startRedisCluster(options: { masters?: number; replicasPerMaster?: number } = {}): Promise<RedisClusterHandle> {
  const masters = options.masters ?? 3;
  const replicas = options.replicasPerMaster ?? 0;
  const count = masters * (1 + replicas);
  const dir = mkdtempSync(join(tmpdir(), "botmesh-redis-cluster-"));
  const taken = new Set<number>();
  const ports: number[] = [];
  for (let i = 0; i < count; i++) ports.push(await freePort(taken));
  const processes: ChildProcess[] = [];
  const clients = new Map<number, IORedis>();
  const node = (port: number) => {
    let c = clients.get(port);
    if (!c) {
      c = new IORedis({ host: "127.0.0.1", port, lazyConnect: false, maxRetriesPerRequest: 2, retryStrategy: () => 200 });
      c.on("error", () => {});
      clients.set(port, c);
    }
    return c;
  };
  let stopped = false;
  const stop = async () => {
    if (stopped) return;
    stopped = true;
    for (const c of clients.values()) c.disconnect();
    await Promise.all(processes.map((p) => new Promise<void>((resolve) => {
      if (p.exitCode !== null || p.signalCode !== null) return resolve();
      p.once("exit", () => resolve());
      p.kill("SIGKILL");
    })));
    rmSync(dir, { recursive: true, force: true });
  };
  try {
    const startNode = (port: number) => {
      const child = spawn("redis-server", [
        "--port", String(port),
        "--bind", "127.0.0.1",
        "--cluster-enabled", "yes",
        "--cluster-config-file", join(dir, `nodes-${port}.conf`),
        "--cluster-node-timeout", "2000",
        "--dir", dir,
        "--save", "",
        "--appendonly", "no",
        "--logfile", join(dir, `redis-${port}.log`),
        "--daemonize", "no",
      ], { stdio: "ignore" });
      processes.push(child);
      return child;
    };
    for (const port of ports) startNode(port);
    for (const port of ports) await waitFor(`node ${port} to answer PING`, 10_000, async () => (await node(port).ping()) === "PONG");
    const created = await run("redis-cli", [
      "--cluster", "create", ...ports.map((p) => `127.0.0.1:${p}`),
      "--cluster-replicas", String(replicas), "--cluster-yes",
    ]);
    if (created.code !== 0) throw new Error(`redis-cli --cluster create exited with ${created.code}:\n${created.out}`);
    await waitFor("cluster_state:ok on every node with the same slot map", 30_000, async () => {
      const maps: string[] = [];
      for (const port of ports) {
        const info = String(await node(port).cluster("INFO"));
        if (!/cluster_state:ok/.test(info) || !/cluster_slots_ok:16384/.test(info)) return false;
        maps.push(JSON.stringify((await slotMap(node(port))).sort((a, b) => a[0] - b[0])));
      }
      // Replicas must have attached too (CLUSTER SLOTS lists them after the master).
      if (replicas > 0) {
        const full = (await node(ports[0]!).cluster("SLOTS")) as unknown[][];
        if (full.some((range) => range.length < 3 + replicas)) return false;
      }
      return maps.every((m) => m === maps[0]);
    });
    const ids = await Promise.all(ports.map(async (port) => String(await node(port).cluster("MYID"))));
    const nodes: ClusterNode[] = ports.map((port, i) => ({ port, id: ids[i]!, process: processes[i]! }));
    const idOf = (port: number) => nodes.find((n) => n.port === port)!.id;
    const live = () => nodes.filter((n) => n.process.exitCode === null && n.process.signalCode === null);

    const masterPorts = async () => {
      const out: number[] = [];
      for (const n of live()) {
        const role = (await node(n.port).role()) as unknown[];
        if (role[0] === "master") out.push(n.port);
      }
      return out;
    };
    const masterOf = async (slot: number) => {
      const map = await slotMap(node(live()[0]!.port));
      const hit = map.find(([from, to]) => slot >= from && slot <= to);
      if (!hit) throw new Error(`Redis cluster: no master serves slot ${slot}`);
      return hit[2];
    };

    const handle: RedisClusterHandle = {
      addresses: ports.map((p) => `127.0.0.1:${p}`),
      nodes,
      dir,
      node,
      masterOf,
      masters: masterPorts,
      keyslot: async (key) => Number(await node(ports[0]!).cluster("KEYSLOT", key)),
      async moveSlot(slot, toPort, opts = {}) {
        const batch = opts.batch ?? 10;
        const fromPort = await masterOf(slot);
        if (fromPort === toPort) throw new Error(`Redis cluster: slot ${slot} is already on ${toPort}`);
        const source = node(fromPort);
        const target = node(toPort);
        await target.cluster("SETSLOT", slot, "IMPORTING", idOf(fromPort));
        await source.cluster("SETSLOT", slot, "MIGRATING", idOf(toPort));
        let keys = 0;
        let batches = 0;
        for (;;) {
          const some = (await source.cluster("GETKEYSINSLOT", slot, batch)) as string[];
          if (some.length === 0) break;
          await source.migrate("127.0.0.1", toPort, "", 0, 10_000, "KEYS", ...some);
          keys += some.length;
          batches++;
          opts.onBatch?.(keys);
          if (opts.pauseMs) await sleep(opts.pauseMs);
        }
        // The order redis-cli uses: the target first, then the source, then every other master.
        await target.cluster("SETSLOT", slot, "NODE", idOf(toPort));
        await source.cluster("SETSLOT", slot, "NODE", idOf(toPort));
        for (const port of await masterPorts()) {
          if (port !== toPort && port !== fromPort) await node(port).cluster("SETSLOT", slot, "NODE", idOf(toPort));
        }
        return { keys, batches };
      },
      async failover(masterPort) {
        const masterId = idOf(masterPort);
        const replica = await waitFor(`a replica of ${masterPort}`, 10_000, async () => {
          for (const n of live()) {
            if (n.port === masterPort) continue;
            const role = (await node(n.port).role()) as unknown[];
            if (role[0] === "slave" && Number(role[2]) === masterPort && role[3] === "connected") return n.port;
          }
          return false;
        });
        await node(replica).cluster("FAILOVER");
        await waitFor(`the replica ${replica} of ${masterId} to become master`, 30_000, async () => {
          const role = (await node(replica).role()) as unknown[];
          return role[0] === "master";
        });
        // The other nodes learn of it by gossip: wait until every one maps the old master's slots to it.
        const slots = (await slotMap(node(replica))).filter(([, , port]) => port === replica);
        await waitFor(`every node to see ${replica} as the master of its slots`, 30_000, async () => {
          for (const n of live()) {
            const map = await slotMap(node(n.port));
            if (!slots.every(([from]) => map.some(([f, to, port]) => from >= f && from <= to && port === replica))) return false;
          }
          return true;
        });
        return replica;
      },
      async addMaster() {
        const port = await freePort(taken);
        const child = startNode(port);
        await waitFor(`node ${port} to answer PING`, 10_000, async () => (await node(port).ping()) === "PONG");
        await node(port).cluster("MEET", "127.0.0.1", ports[0]!);
        const id = String(await node(port).cluster("MYID"));
        nodes.push({ port, id, process: child });
        await waitFor(`every node to know ${port}`, 30_000, async () => {
          for (const n of live()) {
            const known = String(await node(n.port).cluster("NODES"));
            if (!known.includes(id) || /handshake|noaddr/.test(known)) return false;
          }
          return /cluster_state:ok/.test(String(await node(port).cluster("INFO")));
        });
        return port;
      },
      stop,
    };
    return handle;
  } catch (error) {
    await stop();
    throw error;
  }
}
