/**
 * The deterministic simulation runner: one seed → one whole multi-replica bot
 * scenario in simulated time with a seeded fault plan, then the invariants.
 *
 * @module
 */
import type { DurabilityBackend, InboundRecord, OutboxEntry } from "../../contract.ts";
import { Bot } from "../../bot.ts";
import { type DurabilityMetrics, zeroMetrics } from "../../engine.ts";
import { errorText, isProcessDeath } from "../../errors.ts";
import { AskTimeoutError } from "../../conversation.ts";
import { ACTIVE_INBOX_STATES } from "../../rules.ts";
import type { JsonValue } from "../../contract.ts";
import type { SessionStore } from "../../store.ts";
import type { SpanContextLike, SpanLike, SpanOptionsLike, TracerLike } from "../../tracing.ts";
import { HOSTILE_EXTRA_TEXT, SimChannel, type SimMessage } from "./channel.ts";
import { faultyBackend } from "./faulty_backend.ts";
import { checkInvariants, type SimFailure } from "./invariants.ts";
import { Prng } from "./prng.ts";
import { describeScenario, drawScenario, type MessagePlan, type Scenario, stepKeyOf } from "./scenario.ts";
import { callService } from "./service.ts";
import { SIM_EPOCH, SimScheduler } from "./scheduler.ts";
import { FAULT_KINDS, type FaultKind, type Incarnation, type Replica, World } from "./world.ts";

/** Makes the shared backend of a run; `serverNow` is its clock (the database server's). */
export type BackendFactory = (serverNow: () => number) => DurabilityBackend;

/** Options of one run. */
export interface SimOptions {
  seed: number;
  /** The fault kinds to inject (default all). */
  faults?: readonly FaultKind[];
  /**
   * Fail an ambiguity where no provider call happened nor was announced in the journal (a crash
   * between the reservation and the call). Default `true`; `false` only counts them.
   */
  strictAmbiguity?: boolean;
  /** Count a duplicate send that follows a call the channel accepted but that timed out as a failure. */
  strictTimeouts?: boolean;
  /** How long faults are injected, virtual ms (default 30 000). */
  faultWindowMs?: number;
  /** Trace every journal call (heartbeats and reads too). */
  verbose?: boolean;
  /** How long the end phase may take to settle, virtual ms (default 600 000). */
  settleMs?: number;
}

/** What one run found. */
export interface SimResult {
  seed: number;
  ok: boolean;
  failures: SimFailure[];
  trace: string[];
  /** Faults injected, by kind. */
  faults: Record<string, number>;
  /** Ambiguity transitions by the sim's verdict (see `AmbiguityRecord.verdict`). */
  ambiguity: Record<string, number>;
  /** Duplicate sends allowed because the channel accepted a call that then timed out (the engine retried it). */
  timeoutDuplicates: number;
  providerCalls: number;
  /** Calls of step functions at the fake service, those that took effect, and steps reported ambiguous. */
  stepCalls: { calls: number; effects: number; ambiguous: number };
  virtualMs: number;
  steps: number;
  scenario: string;
}


/** Parse a `--faults` list. */
export function parseFaults(text: string): FaultKind[] {
  const kinds = text.split(",").map((s) => s.trim()).filter((s) => s !== "");
  for (const k of kinds) {
    if (!(FAULT_KINDS as readonly string[]).includes(k)) {
      throw new RangeError(`Unknown fault kind "${k}"; known kinds: ${FAULT_KINDS.join(", ")}`);
    }
  }
  return kinds as FaultKind[];
}

/** Timers the code under test armed on the real clock during runs (a determinism leak). */
let realTimerLeaks: string[] = [];

async function withRealTimerWatch<T>(fn: () => Promise<T>): Promise<T> {
  const g = globalThis as unknown as Record<string, unknown>;
  const saved = { setTimeout: g.setTimeout, setInterval: g.setInterval };
  const watch = (name: string, real: unknown) =>
    Object.assign((...args: unknown[]) => {
      const frames = new Error().stack?.split("\n").slice(2, 6).join(" | ") ?? "";
      // A test file's own helpers (a child process reader of another suite in the same runner) are not the code under test.
      if (!frames.includes("/tests/")) realTimerLeaks.push(`${name}: ${frames}`);
      return (real as (...a: unknown[]) => unknown)(...args);
    }, real as object);
  g.setTimeout = watch("setTimeout", saved.setTimeout);
  g.setInterval = watch("setInterval", saved.setInterval);
  try {
    return await fn();
  } finally {
    g.setTimeout = saved.setTimeout;
    g.setInterval = saved.setInterval;
  }
}

/**
 * Run one seed.
 * @param create makes the shared backend
 * @param options seed and switches
 * @returns what the run found
 */
export async function runSimulation(create: BackendFactory, options: SimOptions): Promise<SimResult> {
  realTimerLeaks = [];
  spanCount = 0;
  return await withRealTimerWatch(() => simulate(create, options));
}

async function simulate(create: BackendFactory, options: SimOptions): Promise<SimResult> {
  const seed = options.seed >>> 0;
  const root = new Prng(seed);
  const enabled = new Set<FaultKind>(options.faults ?? FAULT_KINDS);
  const faultWindowMs = options.faultWindowMs ?? 30_000;
  const scenario: Scenario = drawScenario(root.fork("scenario"), enabled, faultWindowMs);
  const sched = new SimScheduler();
  const world = new World(sched, root.fork("plan"), enabled);
  world.journalFaultRate = scenario.journalFaultRate;
  world.providerFaultRate = scenario.providerFaultRate;
  world.verbose = options.verbose ?? false;
  world.leaseMs = Math.min(scenario.inbox.leaseMs, scenario.outbox.leaseMs);
  world.claimLagMs = scenario.claimLagMs ?? 0;
  const shared = create(world.serverNow);
  const channel = new SimChannel(world, undefined, scenario.settles, scenario.rateLimits);
  const resend = scenario.outbox.onAmbiguous === "resend";
  const bots: Bot[] = [];
  const invocations = new Map<string, number>();
  const handlersRunning = new Set<string>();
  const plans = new Map(scenario.messages.map((m) => [m.id, m]));
  const jitter = root.fork("jitter");
  // Conversation transcripts outlive every incarnation, as a durable store's would.
  const store = new SimStore();
  world.log("sim", `seed ${seed}: ${describeScenario(scenario)}`);

  const handler = (inc: Incarnation) => async (ctx: import("../../bot.ts").Context) => {
    const plan: MessagePlan | undefined = plans.get(ctx.message.id);
    if (!plan) return;
    const n = (invocations.get(plan.id) ?? 0) + 1;
    invocations.set(plan.id, n);
    world.log(inc.id, `handler ${plan.id} invocation ${n} (attempt ${ctx.attempt})`);
    // One process runs a message's handler once at a time (a second run while the first is under way
    // means it took its own live work for abandoned). A flow waiting at an ask is not under way: a
    // process replays it when its transcript moved on elsewhere.
    const running = `${inc.id}|${plan.id}`;
    if (handlersRunning.has(running) && plan.askTimeoutMs === undefined) {
      world.ledger.live.push({
        invariant: "double-handling",
        time: world.sched.time,
        detail: `${inc.id} started the handler of ${plan.id} again (invocation ${n}) while its earlier run was under way`,
      });
    }
    handlersRunning.add(running);
    world.ledger.handled.add(plan.id);
    // Content round-trips exactly: a key such as __proto__ stays an own key, live and replayed.
    const extra = ctx.message.extra as Record<string, unknown> | undefined;
    if (
      extra === undefined || JSON.stringify(extra) !== HOSTILE_EXTRA_TEXT || !Object.prototype.hasOwnProperty.call(extra, "__proto__") ||
      Object.getPrototypeOf(extra) !== Object.prototype
    ) {
      world.ledger.live.push({
        invariant: "content-changed",
        time: world.sched.time,
        detail: `${inc.id} handled ${plan.id} (invocation ${n}) with extra ${JSON.stringify(extra)}, not ${HOSTILE_EXTRA_TEXT}`,
      });
    }
    try {
      if (plan.slowMs !== undefined) {
        // On its process's clock: a process that dies never wakes it (its handler never finishes).
        await new Promise<void>((resolve) => inc.clock.setTimeout(resolve, plan.slowMs!));
      }
      await runPlan(plan, n, ctx, inc);
    } finally {
      handlersRunning.delete(running);
    }
  };

  const runPlan = async (plan: MessagePlan, n: number, ctx: import("../../bot.ts").Context, inc: Incarnation) => {
    if (plan.askTimeoutMs !== undefined) {
      try {
        await ctx.ask(`question of ${plan.id}`, { timeoutMs: plan.askTimeoutMs, match: () => false });
      } catch (error) {
        if (!(error instanceof AskTimeoutError)) throw error;
        world.ledger.timedOut.add(plan.id);
        await ctx.reply(`timeout of ${plan.id}`);
      }
      return;
    }
    const fail = n <= plan.throws;
    // A durable step first: its result is journaled before the handler goes on, and a rerun (a retry after
    // the failure below, a crash, a replay) gets it back. Every reply carries it.
    let carried = "";
    if (plan.step !== undefined) {
      const { idempotent, retries } = plan.step;
      const key = stepKeyOf(plan);
      const result = await ctx.step("svc", (call) => callService(world, inc, key, idempotent, call), {
        idempotent,
        ...(retries !== undefined ? { retries } : {}),
      });
      world.log(inc.id, `handler ${plan.id} invocation ${n}: step ${key} -> ${JSON.stringify(result)}`);
      carried = ` [svc=${String(result)}]`;
    }
    if (plan.enqueue) await ctx.bot.enqueue(ctx.chatId, `queued for ${plan.id}`, { idempotencyKey: `enq:${plan.id}` });
    if (fail && !plan.throwAfter) throw new Error(`sim handler failure (${plan.id}, invocation ${n})`);
    for (let i = 1; i <= plan.replies; i++) {
      // Every second reply goes through bot.send: made while the handler runs, it is the handler's send
      // (the same key `<id>:<i>`, in its done check), whichever way it is made.
      const text = `reply ${i} to ${plan.id}${carried}`;
      const sent = i % 2 === 0 ? ctx.bot.send(ctx.chatId, text) : ctx.reply(text);
      if (plan.awaitReplies) await sent;
    }
    if (fail) throw new Error(`sim handler failure (${plan.id}, invocation ${n})`);
  };

  const start = (replica: Replica) => {
    const inc = world.newIncarnation(replica, jitter.fork(`${replica.name}#${replica.incarnations.length + 1}`));
    const bot = new Bot({
      provider: channel.provider(inc),
      clock: inc.clock,
      id: "sim",
      store,
      durability: {
        backend: faultyBackend(world, inc, shared, resend),
        tracer: handleRecorder(world, inc),
        instanceId: replica.name,
        inbox: scenario.inbox,
        outbox: scenario.outbox,
        ...(scenario.cronMs !== null ? { sweepIntervalMs: 0 } : {}),
      },
    });
    inc.bot = bot;
    bots.push(bot);
    bot.on("error", (error) => {
      const ended = /^The conversation started by message "(.+?)" was ended/.exec(error.message);
      if (ended) world.ledger.conversationsEnded.add(ended[1]!);
      if (!isProcessDeath(error)) world.log(inc.id, `error event: ${errorText(error)}`);
    });
    bot.on("warning", (w) => {
      world.log(inc.id, `warning ${w.code}: ${w.key ?? w.id ?? ""}`);
      if (w.code === "outbox-diverged") world.ledger.diverged.push({ key: w.key ?? "", inc: inc.id, time: sched.time });
      if (w.code === "stale-lease") {
        const token = /fencing token (\d+)/.exec(w.message);
        world.ledger.staleWarnings.push({
          kind: w.key !== undefined ? "outbox" : "inbox",
          id: (w.key ?? w.id)!,
          token: token ? Number(token[1]) : null,
          inc: inc.id,
          time: sched.time,
        });
      }
    });
    bot.on("durability:ambiguous", ({ key, chatId, step }) => {
      world.ledger.ambiguousEvents.push({ key, inc: inc.id, time: sched.time, chatId, ...(step !== undefined ? { step } : {}) });

      world.log(inc.id, `event durability:ambiguous ${key}${step !== undefined ? ` (step ${step}, chat ${chatId})` : ""}`);
    });
    bot.on("durability:resolved", ({ key, state, messageId, via }) => {
      world.ledger.resolvedEvents.push({ key, inc: inc.id, time: sched.time, state, via });
      world.log(inc.id, `event durability:resolved ${key} -> ${state}${messageId ? ` (${messageId})` : ""} via ${via}`);
    });
    bot.on("durability:dead", ({ kind, id, error }) => {
      world.ledger.deadEvents.push({ kind, id, inc: inc.id, error });
      world.log(inc.id, `event durability:dead ${kind} ${id}: ${error}`);
    });
    bot.when(() => true, handler(inc));
    world.log(inc.id, "start");
    const loop = scenario.crashLoop;
    if (loop !== null && replica.index === loop.replica && loopKills > 0 && loopKills < loop.kills) {
      // Killed again shortly after this restart, before it can drain its backlog.
      sched.after(loop.afterMs[loopKills - 1]!, () => loopKill(inc));
    }
    bot.start().then(
      () => world.log(inc.id, "started"),
      (error) => {
        if (isProcessDeath(error) || !inc.alive) return;
        // A start that fails (a journal error in the recovery sweep) ends the process; it is restarted.
        world.log(inc.id, `start failed: ${errorText(error)}`);
        world.crash(inc, "start failed, the process exits");
      },
    );
  };

  // The crash loop (see `Scenario.crashLoop`): kills so far.
  let loopKills = 0;
  const loopKill = (inc: Incarnation) => {
    if (!inc.alive || !world.faultsActive) return;
    loopKills++;
    world.count("crash-loop");
    world.crash(inc, `crash loop, kill ${loopKills} of ${scenario.crashLoop!.kills}`);
  };
  if (scenario.crashLoop !== null) {
    const loop = scenario.crashLoop;
    sched.at(SIM_EPOCH + loop.firstAt, () => {
      const inc = world.replicas[loop.replica]!.current;
      if (inc?.alive) loopKill(inc);
    });
  }

  world.onCrash = (inc) => {
    const replica = inc.replica;
    if (replica.current !== inc) return;
    const delay = world.faultsActive ? world.plan.int(200, 5000) : 0;
    sched.after(delay, () => {
      if (replica.current === inc) start(replica);
    });
  };

  for (let i = 0; i < scenario.replicas; i++) world.addReplica(`r${i + 1}`, root);
  for (const replica of world.replicas) start(replica);

  if (scenario.cronMs !== null) {
    const cronMs = scenario.cronMs;
    const cron = () => {
      for (const replica of world.replicas) {
        const inc = replica.current;
        if (!inc?.alive || !inc.bot || world.frozen(replica)) continue;
        inc.bot.sweep({ budgetMs: cronMs }).then(
          (s) => world.log(inc.id, `cron sweep: inbound ${s.inbound}, outbound ${s.outbound}, ambiguous ${s.ambiguous}${s.more ? ", more" : ""}`),
          (error) => world.log(inc.id, `cron sweep refused: ${errorText(error)}`),
        );
      }
      sched.after(cronMs, cron);
    };
    sched.after(cronMs, cron);
  }

  const message = (m: MessagePlan): SimMessage => ({ id: m.id, chatId: m.chatId, chatIndex: m.chatIndex, text: m.text });
  for (const m of scenario.messages) {
    sched.at(SIM_EPOCH + m.at, () => channel.deliver(message(m), "first"));
    for (const d of m.duplicates) {
      sched.at(SIM_EPOCH + d, () => {
        if (!world.faultsActive) return;
        world.count("redelivery");
        channel.deliver(message(m), "duplicate");
      });
    }
  }

  for (const f of scenario.timed) {
    sched.at(SIM_EPOCH + f.at, () => {
      if (!world.faultsActive) return;
      switch (f.kind) {
        case "crash": {
          const inc = world.replicas[f.replica]!.current;
          if (!inc?.alive || !world.can("crash")) return;
          world.count("crash");
          world.crashes++;
          world.crash(inc, "killed at a random moment");
          return;
        }
        case "stall": {
          const replica = world.replicas[f.replica]!;
          const until = sched.time + f.ms;
          if (until <= replica.time.frozenUntil) return;
          replica.time.frozenUntil = until;
          replica.freezes.push({ from: sched.time, to: until });
          world.count(f.ms > world.leaseMs ? "stall(>lease)" : "stall");
          world.leaseThreats++;
          world.log(replica.current?.id ?? replica.name, `fault stall for ${f.ms}ms`);
          return;
        }
        case "clock-step": {
          const replica = world.replicas[f.replica]!;
          replica.time.offset += f.deltaMs;
          world.count("clock-step");
          world.leaseThreats++;
          world.log(replica.current?.id ?? replica.name, `fault wall clock step ${f.deltaMs > 0 ? "+" : ""}${f.deltaMs}ms`);
          return;
        }
        case "server-clock-step":
          world.serverOffset += f.deltaMs;
          world.count("server-clock-step");
          world.leaseThreats++;
          world.log("srv", `fault server clock step ${f.deltaMs > 0 ? "+" : ""}${f.deltaMs}ms`);
          return;
        case "operator": {
          const inc = world.replicas[f.replica]!.current;
          if (!inc?.alive || !inc.bot || world.frozen(inc.replica)) return;
          void operator(inc, f.action);
          return;
        }
      }
    });
  }

  const operator = async (inc: Incarnation, action: "retrySend" | "replayInbound" | "discard") => {
    const control = inc.bot!.durability!;
    try {
      if (action === "replayInbound") {
        const records = await shared.inbox.list({ limit: 10_000 });
        if (records.length === 0) return;
        const id = world.plan.pick(records).id;
        world.count("operator");
        world.log(inc.id, `operator replayInbound(${id})`);
        world.log(inc.id, `operator replayInbound(${id}) -> ${await control.replayInbound(id)}`);
      } else {
        const entries = await shared.outbox.list({ limit: 10_000 });
        if (entries.length === 0) return;
        const key = world.plan.pick(entries).key;
        world.count("operator");
        world.log(inc.id, `operator ${action}(${key})`);
        const result = action === "retrySend" ? await control.retrySend(key) : await control.outbox.discard(key);
        world.log(inc.id, `operator ${action}(${key}) -> ${result}`);
      }
    } catch (error) {
      world.log(inc.id, `operator ${action} failed: ${errorText(error)}`);
    }
  };

  // Fault phase.
  const maxSteps = 200_000;
  let stop = await sched.runUntil(SIM_EPOCH + faultWindowMs, undefined, maxSteps);

  // End phase: no more faults, every replica up, let time run until everything settled.
  world.faultsActive = false;
  world.log("sim", "end of faults: restarting dead replicas, letting the run settle");
  for (const replica of world.replicas) {
    if (replica.current && !replica.current.alive) start(replica);
  }
  const lease = Math.max(scenario.inbox.leaseMs, scenario.outbox.leaseMs);
  const grace = 3 * lease + scenario.outbox.backoff.capMs + scenario.inbox.backoff.capMs;
  let settledAt: number | null = null;
  let checking = false;
  const check = async () => {
    if (checking) return;
    checking = true;
    try {
      const all = world.replicas.every((r) => r.current?.alive);
      const acked = scenario.messages.every((m) => channel.acked.has(m.id));
      const quiet = channel.inFlight === 0 && channel.callsInFlight === 0;
      const inbox = await shared.inbox.list({ state: ACTIVE_INBOX_STATES, limit: 1 });
      const outbox = await shared.outbox.list({ state: ["queued", "sending", "failed"], limit: 1 });
      const settled = all && acked && quiet && inbox.length === 0 && outbox.length === 0;
      if (!settled) settledAt = null;
      else if (settledAt === null) settledAt = sched.time;
    } finally {
      checking = false;
    }
  };
  const ticker = () => {
    void check();
    sched.after(500, ticker);
  };
  sched.after(0, ticker);
  const deadline = SIM_EPOCH + faultWindowMs + (options.settleMs ?? 600_000);
  if (stop !== "runaway") {
    stop = await sched.runUntil(deadline, () => settledAt !== null && sched.time >= settledAt + grace, maxSteps);
  }

  const failures: SimFailure[] = [];
  if (stop === "runaway") failures.push({ invariant: "runaway", detail: `more than ${maxSteps} timer steps in one phase` });
  else if (stop !== "done") {
    failures.push({ invariant: "not-settled", detail: `not settled by the virtual deadline (${(deadline - SIM_EPOCH) / 1000}s)` });
  }
  const inbox: InboundRecord[] = await shared.inbox.list({ limit: 100_000 });
  const outbox: OutboxEntry[] = await shared.outbox.list({ limit: 100_000 });
  const metrics = zeroMetrics();
  for (const bot of bots) {
    const m = bot.durability!.metrics();
    for (const k of Object.keys(metrics) as (keyof DurabilityMetrics)[]) metrics[k] += m[k];
  }
  const notes = { timeoutDuplicates: 0 };
  failures.push(
    ...checkInvariants({
      world,
      channel,
      scenario,
      inbox,
      outbox,
      metrics,
      strictAmbiguity: options.strictAmbiguity ?? true,
      strictTimeouts: options.strictTimeouts ?? true,
      notes,
    }),
  );
  if (realTimerLeaks.length > 0) {
    failures.push({ invariant: "real-timer", detail: `${realTimerLeaks.length} real timer(s) armed: ${realTimerLeaks[0]}` });
  }
  world.log("sim", `end at ${(sched.elapsed / 1000).toFixed(3)}s: inbox ${stateCounts(inbox)}; outbox ${stateCounts(outbox)}`);
  world.log("sim", `metrics ${JSON.stringify(metrics)}`);
  for (const f of failures) world.log("sim", `FAIL ${f.invariant}: ${f.detail}`);
  const ambiguity: Record<string, number> = {};
  for (const a of world.ledger.ambiguities) ambiguity[a.verdict] = (ambiguity[a.verdict] ?? 0) + 1;
  return {
    seed,
    ok: failures.length === 0,
    failures,
    trace: world.trace,
    faults: world.faultCounts,
    ambiguity,
    timeoutDuplicates: notes.timeoutDuplicates,
    providerCalls: world.ledger.calls.length,
    stepCalls: {
      calls: world.ledger.stepCalls.length,
      effects: world.ledger.stepCalls.filter((c) => c.effect).length,
      ambiguous: world.ledger.ambiguousEvents.filter((e) => e.step !== undefined).length,
    },
    virtualMs: sched.elapsed,
    steps: sched.steps,
    scenario: describeScenario(scenario),
  };
}

/**
 * A tracer that records every handler run the engine starts (its `botmesh.handle` span, opened where a
 * handler run starts: after the not-due check of a timer, never for a record dead-lettered unread or
 * cut off) in the ledger, with the true time and the process's wall clock. Span ids are a counter.
 */
function handleRecorder(world: World, inc: Incarnation): TracerLike {
  const ids = (): SpanContextLike => {
    const n = ++spanCount;
    return { traceId: n.toString(16).padStart(32, "0"), spanId: n.toString(16).padStart(16, "0"), traceFlags: 1 };
  };
  const span = (): SpanLike => {
    const context = ids();
    return { spanContext: () => context, setAttribute: () => {}, setStatus: () => {}, recordException: () => {}, end: () => {} };
  };
  return {
    startSpan: () => span(),
    startActiveSpan: (name: string, options: SpanOptionsLike, ...rest: unknown[]) => {
      const fn = rest.at(-1) as (span: SpanLike) => unknown;
      const id = options.attributes?.["botmesh.message_id"];
      // A dead process runs nothing (the sim cannot stop its code, but nothing of it counts).
      if (name === "botmesh.handle" && typeof id === "string" && inc.alive) {
        world.ledger.handleStarts.push({
          id,
          inc: inc.id,
          time: world.sched.time,
          wall: inc.clock.now(),
          seq: world.ledger.handleStarts.length,
          attempts: Number(options.attributes?.["botmesh.attempt"] ?? 0),
        });
      }
      return fn(span());
    },
  } as TracerLike;
}
let spanCount = 0;

function stateCounts(records: { state: string }[]): string {
  const counts: Record<string, number> = {};
  for (const r of records) counts[r.state] = (counts[r.state] ?? 0) + 1;
  return Object.entries(counts).map(([s, n]) => `${s} ${n}`).join(", ") || "empty";
}

/** A session store shared by every incarnation of a run (no TTLs: a run lasts minutes of virtual time). */
class SimStore implements SessionStore {
  readonly #values = new Map<string, string>();
  get(key: string): Promise<JsonValue | undefined> {
    const text = this.#values.get(key);
    return Promise.resolve(text === undefined ? undefined : JSON.parse(text));
  }
  set(key: string, value: JsonValue): Promise<void> {
    this.#values.set(key, JSON.stringify(value));
    return Promise.resolve();
  }
  delete(key: string): Promise<void> {
    this.#values.delete(key);
    return Promise.resolve();
  }
}
