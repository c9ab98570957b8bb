// Real failover between replicas that are OS processes (SPEC §5 "Leases, fencing, heartbeats",
// §8 "Several replicas"). Three children of tests/fixtures/replica.ts share one backend, each with
// its own instanceId and 1.2 s leases; the test process is the channel: it streams 300 messages
// from 30 chats, routes each chat to one replica (sticky by chat) over its stdin, and sees every
// provider call of every replica on their stdout (the sink: a line written when the call happens,
// before the bot records it).
//
// 1. Killed: one replica gets SIGKILL while its handlers are mid-work (leases held). Its chats
//    move to the survivors: the messages it had not acknowledged are redelivered, and so are those
//    acknowledged in the last 300 ms (acknowledgements a dying process may not have got out): the
//    journal drops those it holds as duplicates. A chat moves once every message of it that the dead
//    replica had admitted was handled by a survivor (which takes those over when their leases lapse:
//    claimDue on the shared backend), so the chat's replies stay in order. Measured: how soon after
//    the kill a survivor starts a handler of the dead replica's work, and finishes all of it.
// 2. Frozen: one replica is drained (its chats held), then SIGSTOPped while it holds leases, past
//    its lease; the others take its work over; then SIGCONT. Its late completions are rejected by
//    fencing and counted in its staleLeases.
//
// At the end, for both: every message done in the journal, every reply at the sink exactly once,
// except those reported ambiguous (`durability:ambiguous` events, and `unknown` outbox entries read
// from the backend: the same set), which reached it at most once (held, never resent); no reply
// lost; no unexpected one; per-chat order kept among non-ambiguous replies; nothing dead.
//
// Backends: SQLite (a baseline that always runs: shared by the processes of one host), Postgres,
// Redis over ioredis, and Redis through the Upstash REST bridge. Each test has its own schema or
// key prefix (runId()), dropped after. Postgres and Redis skip (with a message) when their server
// is not reachable, and fail under BOTMESH_REQUIRE_SERVICES=1.
import { afterAll, describe, expect, test } from "bun:test";
import type { DurabilityBackend } from "../src/contract.ts";
import {
  type BackendKind,
  Cluster,
  createNamespace,
  dropNamespace,
  hash01,
  isSlowKey,
  type Failover,
  keysOf,
  type Namespace,
  namespaceLeftovers,
  openBackend,
  planMessages,
  type ReplicaConfig,
  type ReplicaStats,
  type SinkLine,
  verify,
  type Verdict,
  writeLockFree,
} from "./support/replica_harness.ts";
import { serviceSkip } from "./support/services.ts";
import { startUpstashBridge } from "./support/upstash_bridge.ts";
import { pgbouncerSkip, startPgBouncer } from "./support/pgbouncer.ts";
import { clusterSkip, type RedisClusterHandle, startRedisCluster } from "./support/redis_cluster.ts";

const LEASE_MS = 1200;
const CONFIG: ReplicaConfig = { leaseMs: LEASE_MS, thinkMs: [30, 130], sendMs: 4, slowSend: { ms: 400, oneIn: 8 } };
const MESSAGES = 300;
const CHATS = 30;
/** One message every this many ms: the stream takes about 3 s. */
const PACE_MS = 10;
const NAMES = ["r1", "r2", "r3"];
/** A freeze that lands inside a write is retried this many times before the attempt is given up. */
const MAX_RESTOPS = 5;

const clusters: Cluster[] = [];
afterAll(() => {
  for (const c of clusters) for (const r of c.replicas) r.proc.kill("SIGKILL");
});

interface Target {
  kind: BackendKind;
  label: string;
  /** A reason to skip, or false. */
  skip: string | false;
  upstash?: () => Promise<{ url: string; token: string; stop(): Promise<void> | void }>;
  pgbouncer?: () => Promise<{ url: string; stop(): Promise<void> }>;
  /** For `redis-cluster`: starts a cluster for one scenario. */
  redisCluster?: () => Promise<RedisClusterHandle>;
}

const targets: Target[] = [
  { kind: "sqlite", label: "SQLite (one host)", skip: false },
  { kind: "postgres", label: "Postgres", skip: await serviceSkip("postgres") },
  {
    kind: "pgbouncer",
    label: "Postgres through PgBouncer (transaction pooling)",
    skip: (await serviceSkip("postgres")) || pgbouncerSkip(),
    pgbouncer: () => startPgBouncer("transaction"),
  },
  { kind: "redis", label: "Redis (ioredis)", skip: await serviceSkip("redis") },
  {
    kind: "upstash",
    label: "Redis (@upstash/redis over the bridge)",
    skip: await serviceSkip("redis"),
    upstash: () => startUpstashBridge(),
  },
  {
    kind: "redis-cluster",
    label: "Redis Cluster (ioredis Cluster, 3 masters with a replica each)",
    skip: clusterSkip(),
    redisCluster: () => startRedisCluster({ masters: 3, replicasPerMaster: 1 }),
  },
];
for (const t of targets) if (t.skip) console.warn(`replicas: ${t.label}: skipped: ${t.skip}`);

/** One scenario's run: the cluster, its namespace, a reader on the same backend; torn down after. */
async function withCluster<T>(
  target: Target,
  label: string,
  run: (cluster: Cluster, reader: DurabilityBackend, redis: RedisClusterHandle | undefined) => Promise<T>,
  config: ReplicaConfig = CONFIG,
): Promise<T> {
  const bridge = target.upstash ? await target.upstash() : undefined;
  const pooler = target.pgbouncer ? await target.pgbouncer() : undefined;
  const redis = target.redisCluster ? await target.redisCluster() : undefined;
  const ns: Namespace = createNamespace(target.kind, label, bridge && { url: bridge.url, token: bridge.token }, pooler?.url, redis?.addresses);
  const cluster = new Cluster(ns, { ...config, upstash: ns.upstash, pgbouncer: ns.pgbouncer, redisCluster: ns.redisCluster });
  clusters.push(cluster);
  let reader: { backend: DurabilityBackend; close(): Promise<void> } | undefined;
  try {
    // The reader opens first: it creates the schema, so the replicas' first opens do not race on it.
    reader = await openBackend(ns);
    await reader.backend.open?.();
    await cluster.start(NAMES);
    return await run(cluster, reader.backend, redis);
  } finally {
    for (const r of cluster.replicas) r.proc.kill("SIGKILL");
    await Promise.all(cluster.replicas.map((r) => r.exited));
    await reader?.backend.close?.().catch(() => {});
    await reader?.close().catch(() => {});
    await dropNamespace(ns);
    const left = await namespaceLeftovers(ns);
    if (left !== 0) throw new Error(`namespace ${ns.name} not dropped: ${left} left`);
    await bridge?.stop();
    await pooler?.stop();
    await redis?.stop();
  }
}

/**
 * Streams the plan at PACE_MS; `at(i)` runs (awaited) before message i goes out. When it returns true,
 * the time it took does not count: the rest of the stream goes out at its pace, not in a burst.
 */
async function stream(
  cluster: Cluster,
  plan: ReturnType<typeof planMessages>,
  at: (i: number) => Promise<boolean | void> | boolean | void,
): Promise<void> {
  let t0 = performance.now();
  for (const m of plan) {
    const before = performance.now();
    if (await at(m.index)) t0 += performance.now() - before;
    cluster.deliver(m);
    const due = t0 + (m.index + 1) * PACE_MS;
    const wait = due - performance.now();
    if (wait > 0) await Bun.sleep(wait);
  }
}

/** A slow provider call of `name` under way, seen less than 150 ms ago (so at least 250 ms of it are left). */
function slowCallUnderWay(cluster: Cluster, name: string): SinkLine | undefined {
  const now = performance.now();
  for (let i = cluster.sink.length - 1; i >= 0; i--) {
    const l = cluster.sink[i]!;
    if (now - l.seenAt >= 150) return undefined;
    if (l.by === name && isSlowKey(CONFIG, l.key)) return l;
  }
  return undefined;
}

/** Waits until every message was acknowledged and no chat is held, then until a survivor's bot.idle(). */
async function settle(cluster: Cluster, plan: ReturnType<typeof planMessages>, settler: string): Promise<void> {
  await cluster.waitFor("every message acknowledged and every chat routed", 30_000, () =>
    cluster.heldChats === 0 && plan.every((m) => cluster.acked.has(m.id)));
  const replica = cluster.replica(settler);
  const settled = replica.next("settled ", 30_000);
  replica.command({ op: "settle" });
  await settled;
}

function expectClean(v: Verdict, plan: ReturnType<typeof planMessages>, cluster: Cluster): void {
  // Any order break fails, those of a takeover too (the survivors' due scans keep each chat's order).
  for (const chat of new Set(v.orderBreaks.map((b) => b.chatId))) {
    console.log(`order broken in ${chat}:\n  ${cluster.timeline(chat).join("\n  ")}`);
  }
  // Every message handled to the end, nothing in a DLQ, nothing left active.
  expect(v.inbox).toEqual({ done: plan.length, dead: [], active: 0 });
  expect(v.outbox.dead).toEqual([]);
  expect(v.outbox.active).toBe(0);
  expect(v.outbox.sent + v.unknown.length).toBe(v.expectedKeys);
  // Reported ambiguous: each key by exactly one event; every unknown entry was reported, and a reported
  // one that is no longer unknown was resolved by its sender's late outcome (sent, at the sink once).
  expect(v.ambiguousReportedTwice).toEqual([]);
  for (const key of v.unknown) expect(v.ambiguousEvents).toContain(key);
  // The sink: nothing lost, nothing twice, nothing unexpected, the right texts, chat order kept.
  expect(v.lost).toEqual([]);
  expect(v.duplicates).toEqual([]);
  expect(v.ambiguousDuplicates).toEqual([]); // held (onAmbiguous 'hold'): never resent
  expect(v.unexpected).toEqual([]);
  expect(v.wrongText).toEqual([]);
  // Each break with what happened to its two keys (a CI log keeps only the lines before the failure).
  const story = (key: string) => {
    const sent = cluster.sink.filter((l) => l.key === key).map((l) => `sent by ${l.by} at ${l.seenAt.toFixed(0)}`);
    const ambiguous = cluster.ambiguousEvents.filter((e) => e.key === key).map((e) => `reported by ${e.by}`);
    // Its message's own story too: who admitted it, and every handler start and end.
    const id = key.slice(0, key.lastIndexOf(":"));
    const ack = cluster.acked.get(id);
    const admitted = ack ? [`acked by ${ack.by} at ${ack.at.toFixed(0)}${cluster.admittedBy.has(id) ? "" : " (duplicate)"}`] : ["never acked"];
    const starts = (cluster.starts.get(id) ?? []).map((s) => `started by ${s.by} at ${s.at.toFixed(0)} (attempt ${s.attempt})`);
    const handled = (cluster.handled.get(id) ?? []).map((h) => `handled by ${h.by} at ${h.at.toFixed(0)}`);
    return `${key}: ${[...sent, ...ambiguous].join(", ") || "-"}${v.unknown.includes(key) ? ", unknown at the end" : ""} (${
      [...admitted, ...starts, ...handled].join(", ")
    })`;
  };
  const failovers = cluster.failovers.map((f) => `${f.how} ${f.replica} at ${f.at.toFixed(0)} holding ${f.held.join(",") || "-"}`).join("; ") ||
    "no failover";
  expect(v.orderBreaks.map((b) => `${b.text} [${story(b.first.key)}; ${story(b.overtaken.key)}; ${failovers}]`)).toEqual([]);
  const atSink = new Set(v.reported);
  for (const k of plan.flatMap(keysOf)) if (!v.reported.has(k)) atSink.add(k);
  expect(atSink.size).toBe(v.expectedKeys);
}

function sum(stats: ReplicaStats[], field: keyof ReplicaStats["metrics"]): number {
  return stats.reduce((n, s) => n + s.metrics[field], 0);
}

function describeFailover(f: Failover): string {
  return `held ${f.held.length}, unacked ${f.unacked.length} (${f.unackedInJournal} in the journal), ` +
    `redelivered ${f.redelivered.length} (${f.redeliveredInJournal} in the journal), first takeover ${f.firstTakeoverMs?.toFixed(0)} ms, ` +
    `all taken ${f.allTakenMs?.toFixed(0)} ms`;
}

function summary(v: Verdict): string {
  return `${v.messages} messages, ${v.expectedKeys} keys, ${v.sinkLines} sink lines, ` +
    `${v.unknown.length} ambiguous (${v.unknown.join(",") || "-"}), inbox done ${v.inbox.done}, ` +
    `outbox sent ${v.outbox.sent}, order breaks ${v.orderBreaks.length}`;
}

for (const target of targets) {
  describe(`replicas as processes: ${target.label}`, () => {
    test.skipIf(target.skip !== false)("SIGKILL mid-work: the survivors take its leases over when they lapse", async () => {
      await withCluster(target, "kill", async (cluster, reader) => {
        const plan = planMessages(MESSAGES, CHATS, 11);
        const victim = "r2";
        let failover: Failover | undefined;
        let inFlightAtKill = 0;
        let cutOff: SinkLine | undefined;
        await stream(cluster, plan, async (i) => {
          // From the 120th message on, as soon as it has at least 3 messages admitted and not handled
          // to the end, and a provider call under way (its result not recorded: an ambiguous send).
          if (failover || i < 120 || cluster.inFlightOf(victim).length < 3) return;
          const slow = slowCallUnderWay(cluster, victim);
          if (!slow) return;
          cutOff = slow;
          inFlightAtKill = cluster.inFlightOf(victim).length;
          const at = performance.now();
          await cluster.replica(victim).kill();
          failover = await cluster.failOver(victim, "killed", at, reader, 300);
        });
        const survivors = NAMES.filter((n) => n !== victim);
        await settle(cluster, plan, survivors[0]!);
        const v = await verify(plan, cluster, reader);
        const stats = await Promise.all(survivors.map((n) => cluster.replica(n).stop()));
        expect(failover).toBeDefined();
        const f = failover!;
        console.log(
          `[${target.label}] kill: ${summary(v)}; ${victim} had ${inFlightAtKill} in flight and was killed ` +
            `${(f.at - cutOff!.seenAt).toFixed(0)} ms into the call ${cutOff!.key}: ${describeFailover(f)}; ` +
            `duplicate acks ${cluster.duplicateAcks.length}, survivors' inboundDuplicates ${sum(stats, "inboundDuplicates")}, ` +
            `inboundReplayed ${sum(stats, "inboundReplayed")}, outboxDeduped ${sum(stats, "outboxDeduped")}`,
        );

        expectClean(v, plan, cluster);
        expect(inFlightAtKill).toBeGreaterThanOrEqual(3);
        // The call cut off by the kill (at least 100 ms of it were left): reported ambiguous, and at
        // the sink once (the dead replica's call).
        expect(f.at - cutOff!.seenAt).toBeLessThan(CONFIG.slowSend!.ms - 100);
        expect(v.unknown).toContain(cutOff!.key);
        expect(cluster.sink.filter((l) => l.key === cutOff!.key).map((l) => l.by)).toEqual([victim]);
        expect(f.held.length).toBeGreaterThan(0); // what it admitted and had not handled to the end
        // Taken over, by the survivors, and only after the leases lapsed: the last heartbeat was at
        // most a third of a lease before the kill, so at least two thirds of a lease after it.
        for (const id of f.held) {
          expect({ id, bySurvivor: (cluster.handled.get(id) ?? []).some((h) => h.by !== victim) }).toEqual({
            id,
            bySurvivor: true,
          });
        }
        expect(f.firstTakeoverMs).not.toBeNull();
        expect(f.firstTakeoverMs!).toBeGreaterThan((LEASE_MS * 2) / 3 - 100);
        expect(f.allTakenMs).not.toBeNull();
        expect(f.allTakenMs!).toBeLessThan(LEASE_MS + 600 + 4_000);
        // Redeliveries the journal held were dropped as duplicates by the survivors, and counted.
        expect(f.redelivered.length).toBeGreaterThan(0);
        expect(f.redeliveredInJournal).toBeGreaterThan(0);
        expect(cluster.duplicateAcks.filter((d) => d.by !== victim).length).toBe(f.redeliveredInJournal);
        expect(sum(stats, "inboundDuplicates")).toBe(cluster.duplicateAcks.filter((d) => d.by !== victim).length);
        // The survivors processed the dead replica's records again; ambiguous ones counted by them.
        expect(sum(stats, "inboundReplayed")).toBeGreaterThanOrEqual(f.held.length);
        expect(sum(stats, "outboxAmbiguous")).toBe(v.unknown.length);
        expect(sum(stats, "staleLeases")).toBe(0);
      });
    }, 60_000);

    test.skipIf(target.skip !== false)("SIGSTOP past its lease, then SIGCONT: its late completions are fenced off", async () => {
      await withCluster(target, "frozen", async (cluster, reader) => {
        const plan = planMessages(MESSAGES, CHATS, 23);
        const victim = "r3";
        let failover: Failover | undefined;
        let inFlightAtStop = 0;
        let refrozen = 0;
        let attempts = 0;
        let cutOff: SinkLine | undefined;
        let resumedAt = 0;
        let thawed: Promise<void> = Promise.resolve();
        await stream(cluster, plan, async (i) => {
          if (failover || i < 100 || cluster.inFlightOf(victim).length < 3) return;
          const slow = slowCallUnderWay(cluster, victim);
          if (!slow) return;
          cutOff = slow;
          const drained = cluster.drain(victim); // its chats wait; nothing unacknowledged is left behind in it
          await cluster.waitFor(`${victim}'s acknowledgements`, 5_000, () => cluster.unackedOf(victim) === 0);
          inFlightAtStop = cluster.inFlightOf(victim).length;
          // SQLite: a process stopped inside a write transaction keeps the file's write lock and
          // stalls the whole host (no lease helps there); Postgres: one stopped before a group's
          // COMMIT keeps its rows locked for the server's 5 s idle-in-transaction timeout, past the
          // survivors' own leases. Freeze it outside one (continue and retry). A thaw lasts 20-80 ms:
          // a group behind PgBouncer takes several round trips, and the thawed process first runs the
          // timers that came due while it was stopped. The freeze counts from the first stop: the
          // thaws are too short to be sure of a heartbeat, so its leases may lapse as soon as 2/3 of a
          // lease after the first stop (not the last one).
          const at = performance.now();
          let lockFree = false;
          attempts++;
          for (refrozen = 0; refrozen <= MAX_RESTOPS; refrozen++) {
            if (refrozen > 0) {
              cluster.replica(victim).signal("SIGCONT");
              await Bun.sleep(20 + hash01(`retry${attempts}:${refrozen}`) * 60);
            }
            await cluster.replica(victim).freeze();
            if (lockFree = await writeLockFree(cluster.ns)) break;
          }
          if (!lockFree || cluster.inFlightOf(victim).length === 0) {
            // Always stopped inside a write, or it finished all it held in the thaws: resume it, give
            // its chats back and try again later in the stream (which waits meanwhile).
            cluster.replica(victim).signal("SIGCONT");
            cluster.undrain(victim, drained);
            return true;
          }
          failover = await cluster.failOver(victim, "frozen", at, reader);
          // Thaw it once the others have handled all it held (its leases lapsed), while the stream goes on.
          thawed = cluster.waitFor("the survivors to take the frozen replica's work", 15_000, () =>
            failover!.allTakenMs !== null).then(() => {
              resumedAt = performance.now();
              cluster.replica(victim).signal("SIGCONT");
            });
        });
        await thawed;
        const survivors = NAMES.filter((n) => n !== victim);
        await settle(cluster, plan, survivors[0]!);
        // The thawed replica finishes what it had (answered from the outbox, completions refused).
        const late = cluster.replica(victim);
        const lateSettled = late.next("settled ", 30_000);
        late.command({ op: "settle" });
        await lateSettled;
        const v = await verify(plan, cluster, reader);
        const victimStats = await late.stop();
        const stats = await Promise.all(survivors.map((n) => cluster.replica(n).stop()));
        expect(failover, `no freeze held work to fail over (${attempts} attempts)`).toBeDefined();
        const f = failover!;
        const lateStarts = [...cluster.starts.values()].flat().filter((s) => s.by === victim && s.at > resumedAt).length;
        const lateCalls = cluster.sink.filter((l) => l.by === victim && l.t > performance.timeOrigin + resumedAt);
        const staleWarnings = cluster.warnings.filter((w) => w.by === victim && w.code === "stale-lease");
        console.log(
          `[${target.label}] freeze: ${summary(v)}; ${victim} had ${inFlightAtStop} in flight and was stopped ` +
            `${(f.at - cutOff!.seenAt).toFixed(0)} ms into the call ${cutOff!.key}: ${describeFailover(f)}; ` +
            `frozen for ${(resumedAt - f.at).toFixed(0)} ms (stopped again ${refrozen} times: write lock held; attempt ${attempts}); after SIGCONT it started ${lateStarts} handlers, made ` +
            `${lateCalls.length} provider calls (${lateCalls.map((l) => l.key).join(",") || "-"}); its staleLeases ` +
            `${victimStats.metrics.staleLeases} (stale-lease warnings ${staleWarnings.length}), outboxDeduped ` +
            `${victimStats.metrics.outboxDeduped}`,
        );

        expectClean(v, plan, cluster);
        expect(inFlightAtStop).toBeGreaterThanOrEqual(1);
        // The call it froze in (when at least 100 ms of it were left: a SQLite retry can come later):
        // reported ambiguous by a survivor, never sent again; the frozen sender's late outcome resolves it.
        // (Stopped again: the call may have ended during a thaw in between.)
        if (refrozen === 0 && f.at - cutOff!.seenAt < CONFIG.slowSend!.ms - 100) expect(v.ambiguousEvents).toContain(cutOff!.key);
        expect(cluster.sink.filter((l) => l.key === cutOff!.key).map((l) => l.by)).toEqual([victim]);
        expect(f.firstTakeoverMs!).toBeGreaterThan((LEASE_MS * 2) / 3 - 100);
        expect(resumedAt - f.at).toBeGreaterThan(LEASE_MS);
        // Its late completions (after this thaw, not an earlier attempt's) were refused by fencing, each
        // counted and warned about.
        expect(staleWarnings.filter((w) => w.at > resumedAt).length).toBeGreaterThan(0);
        expect(staleWarnings.length).toBe(victimStats.metrics.staleLeases);
        // (On failure: when the survivors lost leases, counted from the stop, and the thaw.)
        const survivorsStale = cluster.warnings.filter((w) => w.by !== victim && w.code === "stale-lease")
          .map((w) => `${w.id} by ${w.by} at +${(w.at - f.at).toFixed(0)} ms`);
        expect(sum(stats, "staleLeases"), `survivors' stale leases (thawed at +${(resumedAt - f.at).toFixed(0)} ms): ${survivorsStale.join(", ")}`)
          .toBe(0);
        // A late provider call is one the survivors had reported ambiguous (under way at the freeze), or
        // one whose lease nobody had taken yet (its call announced under a token still current): either
        // way the only delivery of its key.
        for (const l of lateCalls) {
          const by = cluster.sink.filter((s) => s.key === l.key).map((s) => s.by);
          expect({ key: l.key, by }).toEqual({ key: l.key, by: [victim] });
        }
        expect(sum([...stats, victimStats], "outboxAmbiguous")).toBe(v.ambiguousEvents.length);
      });
    }, 60_000);

    if (target.kind === "redis-cluster") clusterScenarios(target);
  });
}

/** How many errors (`error` events, printed by the children) each replica's bot reported, and their distinct messages (3 at most). */
function errorsOf(cluster: Cluster): Record<string, { count: number; first: string[] }> {
  const out: Record<string, { count: number; first: string[] }> = {};
  for (const r of cluster.replicas) {
    const lines = r.stderr.split("\n");
    const messages = new Set(lines.filter((l) => /^error: /.test(l)).map((l) => l.slice(0, 200)));
    out[r.name] = { count: lines.filter((l) => /^\[\w+\] error:/.test(l)).length, first: [...messages].slice(0, 3) };
  }
  return out;
}

/**
 * The cluster's own failovers while the stream is handled: the key prefix's hash slot moved to another
 * master and back (IMPORTING/MIGRATING, MIGRATE in batches, SETSLOT NODE), and the slot's master
 * replaced by its replica (CLUSTER FAILOVER). No replica dies: the checks are those of the kills.
 */
function clusterScenarios(target: Target): void {
  /** The leases of the resharding scenario: longer than its slow move. */
  const RESHARD_LEASE_MS = 8_000;

  test.skipIf(target.skip !== false)("the prefix's hash slot migrated to another master mid-stream, and back", async () => {
    await withCluster(target, "reshard", async (cluster, reader, redis) => {
      const plan = planMessages(MESSAGES, CHATS, 31);
      const slot = await redis!.keyslot(`{${cluster.ns.name}}`);
      const moves: { from: number; to: number; keys: number; batches: number; startedAt: number; ms: number }[] = [];
      let moving: Promise<void> = Promise.resolve();
      // The first move is quick (batches of 20 keys); the second slow (batches of 10, 20 ms apart: 2 to 4
      // s, longer than ioredis' own TRYAGAIN retries, 16 of 100 ms: the runner's go on). The calls wait
      // meanwhile, heartbeats too: the leases are longer than the moves here (RESHARD_LEASE_MS).
      const move = async () => {
        const from = await redis!.masterOf(slot);
        const to = moves[0]?.from ?? (await redis!.masters()).find((p) => p !== from)!;
        const startedAt = performance.now();
        const done = await redis!.moveSlot(slot, to, moves.length === 0 ? { batch: 20, pauseMs: 5 } : { batch: 10, pauseMs: 20 });
        moves.push({ from, to, ...done, startedAt, ms: performance.now() - startedAt });
      };
      await stream(cluster, plan, async (i) => {
        if (i === 100 || i === 200) {
          await moving;
          moving = move();
        }
      });
      await moving;
      await settle(cluster, plan, NAMES[0]!);
      const v = await verify(plan, cluster, reader);
      const stats = await Promise.all(NAMES.map((n) => cluster.replica(n).stop()));
      const errors = errorsOf(cluster);
      // What the stream asked of the replicas while the slot was half moved.
      const during = (t: number) => moves.some((m) => t >= m.startedAt && t <= m.startedAt + m.ms);
      const acksDuring = [...cluster.acked.values()].filter((a) => during(a.at)).length;
      const sentDuring = cluster.sink.filter((l) => during(l.seenAt)).length;
      console.log(
        `[${target.label}] reshard: ${summary(v)}; slot ${slot} moved ${moves.map((m) => `${m.from}->${m.to}: ${m.keys} keys in ` +
          `${m.batches} MIGRATE calls, ${m.ms.toFixed(0)} ms`).join("; ")}; ${acksDuring} acks and ${sentDuring} provider ` +
          `calls during the moves; nacks ${cluster.nacks}; staleLeases ${sum(stats, "staleLeases")}, inboundReplayed ` +
          `${sum(stats, "inboundReplayed")}, outboxAmbiguous ${sum(stats, "outboxAmbiguous")} (ambiguous events ` +
          `${v.ambiguousEvents.length}); bot errors ` +
          `${JSON.stringify(errors)}`,
      );
      expectClean(v, plan, cluster);
      expect(moves.length).toBe(2);
      for (const m of moves) expect(m.keys).toBeGreaterThan(MESSAGES / 2); // the journal's keys moved, batch by batch
      expect(moves[1]!.to).toBe(moves[0]!.from);
      expect(await redis!.masterOf(slot)).toBe(moves[1]!.to);
      expect(moves[1]!.ms).toBeGreaterThan(1_600);
      expect(moves[1]!.ms).toBeLessThan(RESHARD_LEASE_MS);
      // No lease lapsed: nothing was taken over, fenced off or reported ambiguous.
      expect(sum(stats, "staleLeases")).toBe(0);
      expect(sum(stats, "outboxAmbiguous")).toBe(0);
      expect(v.ambiguousEvents).toEqual([]);
    }, { ...CONFIG, leaseMs: RESHARD_LEASE_MS });
  }, 120_000);

  test.skipIf(target.skip !== false)("the slot's master replaced by its replica (CLUSTER FAILOVER) mid-stream", async () => {
    await withCluster(target, "failover", async (cluster, reader, redis) => {
      const plan = planMessages(MESSAGES, CHATS, 37);
      const slot = await redis!.keyslot(`{${cluster.ns.name}}`);
      const old = await redis!.masterOf(slot);
      let promoted: Promise<{ port: number; ms: number }> | undefined;
      await stream(cluster, plan, (i) => {
        if (i !== 150) return;
        const t = performance.now();
        promoted = redis!.failover(old).then((port) => ({ port, ms: performance.now() - t }));
      });
      const p = await promoted!;
      await settle(cluster, plan, NAMES[0]!);
      const v = await verify(plan, cluster, reader);
      const stats = await Promise.all(NAMES.map((n) => cluster.replica(n).stop()));
      console.log(
        `[${target.label}] master failover: ${summary(v)}; slot ${slot}: master ${old} replaced by ${p.port} in ` +
          `${p.ms.toFixed(0)} ms; nacks ${cluster.nacks}; staleLeases ${sum(stats, "staleLeases")}, outboxAmbiguous ` +
          `${sum(stats, "outboxAmbiguous")}; bot errors ${JSON.stringify(errorsOf(cluster))}`,
      );
      expectClean(v, plan, cluster);
      expect(await redis!.masterOf(slot)).toBe(p.port);
      expect(sum(stats, "outboxAmbiguous")).toBe(v.unknown.length);
    });
  }, 120_000);
}
