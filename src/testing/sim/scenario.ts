/**
 * The scenario of one seed: replicas, chats, inbound messages and what the
 * handler does with each, the bot configuration, the fault rates and the
 * timed faults (crashes at random moments, stalls, clock steps, operator
 * actions). Everything derives from the seed.
 *
 * @module
 */
import type { Prng } from "./prng.ts";
import type { RateLimits } from "../../rate_limit.ts";
import type { FaultKind } from "./world.ts";

/** What the handler does for one message. */
export interface MessagePlan {
  id: string;
  chatId: string;
  chatIndex: number;
  text: string;
  /** First delivery (virtual ms from the start). */
  at: number;
  /** Replies via `ctx.reply`, every second one via `bot.send` from the handler (keys `<id>:1`, `<id>:2`). */
  replies: number;
  /** The handler throws on its first `throws` invocations for this message. */
  throws: number;
  /** Throw after the replies were made (else before). */
  throwAfter: boolean;
  /** Also `bot.enqueue(chat, …, { idempotencyKey: 'enq:<id>' })`. */
  enqueue: boolean;
  /** Await each reply (else leave it to the bot). */
  awaitReplies: boolean;
  /** Extra deliveries (virtual ms from the start). */
  duplicates: number[];
  /** Its id is not well-formed Unicode (a lone surrogate): the bot must refuse it, never journal it. */
  malformed?: boolean;
  /**
   * The handler asks a question no message answers (`match` refuses every one) with this timeout,
   * and replies `timeout of <id>` when it times out (no other replies; never throws).
   */
  askTimeoutMs?: number;
  /** The handler takes this long (virtual ms, on its process's clock) before it replies: a slow handler. */
  slowMs?: number;
  /**
   * The handler first runs a durable step, `ctx.step("svc", …)` (key `<id>:step:svc`), that calls the
   * world's fake service (see `service.ts`), and every reply carries the step's result (`[svc=<result>]`).
   */
  step?: StepPlan;
}

/** A handler's durable step. */
export interface StepPlan {
  /** `idempotent: true`: run again (a next attempt) after an interruption whose outcome is unknown. */
  idempotent: boolean;
  /** The step's `retries` option (default: `outbox.retries`). */
  retries?: number;
}

/** The key of a plan's step (the default key of `ctx.step("svc")` for the message). */
export function stepKeyOf(plan: Pick<MessagePlan, "id">): string {
  return `${plan.id}:step:svc`;
}

/**
 * A crash loop: the replica is killed `kills` times, first at `firstAt`, then each time `afterMs[i]`
 * after it restarted (before it can drain its backlog). Not limited by the run's crash budget.
 */
export interface CrashLoop {
  replica: number;
  firstAt: number;
  kills: number;
  afterMs: number[];
}

/** A fault at a planned moment. */
export type TimedFault =
  | { at: number; kind: "crash"; replica: number }
  | { at: number; kind: "stall"; replica: number; ms: number }
  | { at: number; kind: "clock-step"; replica: number; deltaMs: number }
  | { at: number; kind: "server-clock-step"; deltaMs: number }
  | { at: number; kind: "operator"; action: "retrySend" | "replayInbound" | "discard"; replica: number };

/** The whole plan of one seed. */
export interface Scenario {
  replicas: number;
  chats: number;
  messages: MessagePlan[];
  inbox: { leaseMs: number; retries: number; backoff: { baseMs: number; capMs: number } };
  outbox: {
    leaseMs: number;
    retries: number;
    backoff: { baseMs: number; capMs: number };
    onAmbiguous: "hold" | "resend";
  };
  journalFaultRate: number;
  providerFaultRate: number;
  /** Faults are injected in [0, faultWindowMs). */
  faultWindowMs: number;
  timed: TimedFault[];
  /**
   * What the channel can tell afterwards: `statuses` delivery statuses carrying the send's key reach
   * a live replica (`sink.confirmSent`) some time after it accepted a send; `confirm` the provider
   * answers `confirm` truthfully (delivered with its id, certainly not, or null while a call is under
   * way), sometimes null or a failed lookup.
   */
  settles: { statuses: boolean; confirm: boolean };
  /** The provider's rate limits (the outbox's limiter waits on the simulated clock), or none. */
  rateLimits: RateLimits | null;
  /**
   * Serverless shape: no sweep or retry timers (`sweepIntervalMs: 0`); every live replica's
   * `bot.sweep()` is called every `cronMs` instead. `null`: the timers run.
   */
  cronMs: number | null;
  /**
   * Backlog through a crash loop: the messages of one chat come faster than its slow handler answers
   * (several queued), and the replica that holds the chat is killed over and over shortly after each
   * restart. `null` for the other seeds.
   */
  crashLoop: CrashLoop | null;
  /** How long every inbox claim scan's reply takes after it committed (a slow journal), or `null` (at once). */
  claimLagMs: number | null;
}

/**
 * Draw a scenario.
 * @param rng the scenario's random stream
 * @param enabled the fault kinds allowed
 * @param faultWindowMs how long faults are injected
 * @returns the scenario
 */
export function drawScenario(rng: Prng, enabled: ReadonlySet<FaultKind>, faultWindowMs: number): Scenario {
  const replicas = rng.int(1, 3);
  const chats = rng.int(2, 4);
  const inbox = {
    leaseMs: rng.int(1, 5) * 1000,
    retries: rng.int(1, 3),
    backoff: { baseMs: rng.int(50, 500), capMs: rng.int(1000, 4000) },
  };
  const outbox = {
    leaseMs: rng.int(1, 5) * 1000,
    retries: rng.int(2, 4),
    backoff: { baseMs: rng.int(50, 500), capMs: rng.int(1000, 5000) },
    onAmbiguous: rng.chance(0.25) ? "resend" as const : "hold" as const,
  };
  const lease = Math.min(inbox.leaseMs, outbox.leaseMs);
  const count = rng.int(3, 10);
  const messages: MessagePlan[] = [];
  for (let i = 0; i < count; i++) {
    const chatIndex = rng.int(0, chats - 1);
    const at = rng.int(0, Math.floor(faultWindowMs * 0.6));
    const throwsKind = rng.weighted({ none: 6, once: 2, twice: 1, dead: 0.5 });
    const throws = throwsKind === "none" ? 0 : throwsKind === "once" ? 1 : throwsKind === "twice" ? 2 : inbox.retries + 1;
    const duplicates: number[] = [];
    if (enabled.has("redelivery")) {
      for (let d = rng.int(0, 3); d > 0; d--) {
        // Early (right after the first delivery), late, or long after it was done.
        const kind = rng.weighted({ early: 1, late: 2, veryLate: 1 });
        duplicates.push(
          kind === "early" ? at + rng.int(0, 50) : kind === "late" ? rng.int(at, faultWindowMs) : faultWindowMs - rng.int(0, 2000),
        );
      }
    }
    messages.push({
      id: `m${i + 1}`,
      chatId: `c${chatIndex + 1}`,
      chatIndex,
      text: `hello ${i + 1}`,
      at,
      replies: rng.int(1, 2),
      throws,
      throwAfter: rng.chance(0.5),
      enqueue: rng.chance(0.25),
      awaitReplies: rng.chance(0.5),
      duplicates,
    });
  }
  // Hostile ids: one cut mid-emoji (a lone surrogate, refused) and its twin with U+FFFD (a different,
  // well-formed id). A database that stores both as U+FFFD would take the twin for a duplicate.
  if (messages.length > 0 && rng.chance(0.25)) {
    const base = rng.pick(messages);
    for (const [suffix, malformed] of [["\uD83D", true], ["\uFFFD", false]] as const) {
      messages.push({
        ...base,
        id: `${base.id}x${suffix}`,
        text: `${base.text} (${malformed ? "cut mid-emoji" : "replacement character"})`,
        at: base.at + rng.int(1, 500),
        throws: 0,
        duplicates: [],
        ...(malformed ? { malformed: true } : {}),
      });
    }
  }
  const timedKinds = (["crash", "stall", "clock-step", "server-clock-step", "operator"] as const).filter((k) => enabled.has(k));
  const timed: TimedFault[] = [];
  if (timedKinds.length > 0) {
    for (let n = rng.int(0, 6); n > 0; n--) {
      const kind = rng.pick(timedKinds);
      const at = rng.int(0, faultWindowMs - 1);
      const replica = rng.int(0, replicas - 1);
      const step = () => (rng.chance(0.5) ? 1 : -1) * (rng.chance(0.5) ? rng.int(200, lease) : rng.int(lease, 4 * lease));
      switch (kind) {
        case "crash":
          timed.push({ at, kind, replica });
          break;
        case "stall":
          timed.push({ at, kind, replica, ms: rng.chance(0.5) ? rng.int(50, lease) : rng.int(lease, 3 * lease) });
          break;
        case "clock-step":
          timed.push({ at, kind, replica, deltaMs: step() });
          break;
        case "server-clock-step":
          timed.push({ at, kind, deltaMs: step() });
          break;
        case "operator":
          timed.push({ at, kind, replica, action: rng.pick(["retrySend", "replayInbound", "discard"] as const) });
          break;
      }
    }
  }
  timed.sort((a, b) => a.at - b.at);
  const journalFaultRate = rng.pick([0, 0.01, 0.03, 0.06, 0.1]);
  const providerFaultRate = rng.pick([0, 0.1, 0.2, 0.35]);
  // Drawn last, so that every earlier choice of a seed stays what it was.
  const settles = { statuses: rng.chance(0.4), confirm: rng.chance(0.4) };
  // After that, the rate limits (drawn last for the same reason).
  const rateLimits: RateLimits | null = rng.chance(0.5)
    ? {
      global: { count: rng.int(1, 5), perMs: rng.int(20, 200) },
      perChat: { count: 1, perMs: rng.int(10, 300), burst: rng.int(1, 2) },
    }
    : null;
  // Asks that time out, drawn from their own stream so that the scenarios of existing seeds stay as they were.
  const asks = rng.fork("asks");
  // Each in a chat of its own: a chat has one conversation, and a second ask there would replace the first.
  const firstAskChat = asks.int(0, chats - 1);
  const askChats = asks.chance(0.5) ? (asks.chance(0.5) ? [0] : [0, 1]).map((i) => (i + firstAskChat) % chats) : [];
  for (const [n, chatIndex] of askChats.entries()) {
    const i = n + 1;
    messages.push({
      id: `a${i}`,
      chatId: `c${chatIndex + 1}`,
      chatIndex,
      text: `ask ${i}`,
      at: asks.int(0, Math.floor(faultWindowMs * 0.6)),
      replies: 0,
      throws: 0,
      throwAfter: false,
      enqueue: false,
      awaitReplies: true,
      duplicates: enabled.has("redelivery") && asks.chance(0.5) ? [asks.int(0, faultWindowMs)] : [],
      askTimeoutMs: asks.chance(0.5) ? asks.int(100, lease) : asks.int(lease, 4 * lease),
    });
  }
  // Backlog through a crash loop, drawn from its own stream (the scenarios of existing seeds stay as they were).
  const backlog = rng.fork("backlog");
  let crashLoop: CrashLoop | null = null;
  let claimLagMs: number | null = null;
  if (backlog.chance(0.12) && enabled.has("crash")) {
    const chatIndex = backlog.int(0, chats - 1);
    const count = backlog.int(4, 8);
    const start = backlog.int(0, 3000);
    const gap = backlog.int(20, 150);
    /** Message `b<n>` of the backlog's chat, arriving at `at`, whose handler is slow. */
    const backlogMessage = (n: number, at: number): MessagePlan => ({
      id: `b${n}`,
      chatId: `c${chatIndex + 1}`,
      chatIndex,
      text: `backlog ${n}`,
      at,
      replies: 1,
      throws: 0,
      throwAfter: false,
      enqueue: false,
      awaitReplies: true,
      duplicates: [],
      slowMs: backlog.int(400, 1500),
    });
    for (let i = 1; i <= count; i++) {
      messages.push(backlogMessage(i, start + (i - 1) * gap));
    }
    const kills = backlog.int(6, 10);
    crashLoop = {
      replica: chatIndex % replicas,
      firstAt: start + count * gap + backlog.int(50, 400),
      kills,
      afterMs: Array.from({ length: kills - 1 }, () => backlog.int(50, 600)),
    };
    // More of the chat's messages while the loop goes on (the channel gives them to another replica while
    // the looping one is down), and a journal slow to answer claim scans: a scan's records are leased
    // before the scanner learns of them, the window in which a later message of the chat must wait.
    const more = backlog.int(2, 5);
    for (let i = 1; i <= more; i++) {
      messages.push(backlogMessage(count + i, crashLoop.firstAt + backlog.int(0, 8000)));
    }
    // Below the quarter lease an admission holds the channel's answer for a claim scan of its process; past
    // it, the message still waits for the scan's records in its chat's queue (bounded by a lease).
    claimLagMs = backlog.int(20, Math.min(400, inbox.leaseMs / 4 - 50));
  }
  // Durable steps, drawn from their own stream (the scenarios of existing seeds stay as they were).
  const steps = rng.fork("steps");
  if (steps.chance(0.75)) {
    for (const m of messages) {
      if (m.askTimeoutMs !== undefined || m.malformed || !steps.chance(0.5)) continue;
      const retries = steps.weighted({ default: 3, none: 1, one: 1 });
      m.step = { idempotent: steps.chance(0.5), ...(retries === "default" ? {} : { retries: retries === "none" ? 0 : 1 }) };
    }
  }
  return {
    replicas,
    chats,
    messages,
    inbox,
    outbox,
    journalFaultRate,
    providerFaultRate,
    faultWindowMs,
    timed,
    settles,
    rateLimits,
    // Drawn from its own stream, so the scenarios of existing seeds stay as they were.
    cronMs: rng.fork("cron").chance(0.25) ? rng.fork("cron-ms").int(200, 3000) : null,
    crashLoop,
    claimLagMs,
  };
}

/** One line about a scenario, for the trace. */
export function describeScenario(s: Scenario): string {
  return `${s.replicas} replica(s), ${s.chats} chats, ${s.messages.length} messages; inbox lease ${s.inbox.leaseMs}ms retries ${s.inbox.retries}; ` +
    `outbox lease ${s.outbox.leaseMs}ms retries ${s.outbox.retries} backoff ${s.outbox.backoff.baseMs}/${s.outbox.backoff.capMs} onAmbiguous ${s.outbox.onAmbiguous}; ` +
    `journal fault rate ${s.journalFaultRate}, provider fault rate ${s.providerFaultRate}; ${s.timed.length} timed fault(s)` +
    `${s.settles.statuses ? "; delivery statuses" : ""}${s.settles.confirm ? "; provider confirm" : ""}` +
    `${s.rateLimits ? `; rate limits ${JSON.stringify(s.rateLimits)}` : ""}` +
    `${s.cronMs !== null ? `; no timers, bot.sweep() every ${s.cronMs}ms` : ""}` +
    `${s.crashLoop ? `; backlog of ${s.messages.filter((m) => m.slowMs !== undefined).length} slow messages through a crash loop of r${s.crashLoop.replica + 1} (${s.crashLoop.kills} kills)` : ""}` +
    `${s.claimLagMs !== null ? `; inbox claim scans answer ${s.claimLagMs}ms after they commit` : ""}` +
    `${s.messages.some((m) => m.step) ? `; steps in ${s.messages.filter((m) => m.step).map((m) => `${m.id}${m.step!.idempotent ? " (idempotent)" : ""}`).join(", ")}` : ""}` +
    `${s.messages.some((m) => m.askTimeoutMs) ? `; asks timing out after ${s.messages.filter((m) => m.askTimeoutMs).map((m) => `${m.askTimeoutMs}ms`).join(", ")}` : ""}`;
}
