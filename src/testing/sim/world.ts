/**
 * The shared state of one simulated run: the scheduler, the replicas and
 * their incarnations, the fault plan's random stream, the ground-truth
 * ledger and the trace.
 *
 * @module
 */
import type { Bot } from "../../bot.ts";
import { SimulatedCrash } from "../crashable.ts";
import { Ledger } from "./ledger.ts";
import type { Prng } from "./prng.ts";
import { ReplicaClock, type ReplicaTime, type SimScheduler } from "./scheduler.ts";

/** Every fault kind the simulator can inject (`--faults` takes a subset). */
export const FAULT_KINDS = [
  "crash",
  "error-before",
  "lost-reply",
  "delay",
  "stall",
  "clock-step",
  "server-clock-step",
  "provider-timeout",
  "provider-transient",
  "provider-permanent",
  "provider-retry-after",
  "provider-slow",
  "provider-crash",
  "redelivery",
  "operator",
] as const;

/** A fault kind. */
export type FaultKind = (typeof FAULT_KINDS)[number];

/** One process lifetime of a replica. */
export interface Incarnation {
  /** `<instanceId>#<n>`. */
  readonly id: string;
  readonly replica: Replica;
  alive: boolean;
  readonly clock: ReplicaClock;
  bot: Bot | null;
  /** The bot's sink, once its provider was started. */
  receive: ((message: import("../../provider.ts").InboundMessage) => Promise<import("../../provider.ts").AdmitResult>) | null;
  /** The bot's `sink.confirmSent`, once its provider was started (a delivery status goes there). */
  confirmSent: ((key: string, messageId: string) => Promise<boolean>) | null;
  /** Resolves when the incarnation dies (what it was doing never answers then). */
  readonly died: Promise<void>;
  /** Resolves `died`. */
  readonly markDied: () => void;
}

/** A replica: a stable instanceId, restarted as new incarnations. */
export interface Replica {
  readonly name: string;
  readonly index: number;
  readonly time: ReplicaTime;
  incarnations: Incarnation[];
  current: Incarnation | null;
  /** Virtual-time intervals during which the replica was stalled. */
  freezes: { from: number; to: number }[];
}

/** The world of one run. */
/** What an outside call of the simulation does: succeed, or one of the provider faults. */
export type CallFault = "ok" | "provider-timeout" | "provider-transient" | "provider-permanent" | "provider-retry-after" | "provider-crash";

export class World {
  readonly sched: SimScheduler;
  /** Fault-plan decisions made while the run goes on. */
  readonly plan: Prng;
  readonly ledger: Ledger = new Ledger();
  readonly trace: string[] = [];
  readonly replicas: Replica[] = [];
  readonly enabled: ReadonlySet<FaultKind>;
  readonly faultCounts: Record<string, number> = {};
  /** Trace every journal call, heartbeats and reads too. */
  verbose = false;
  /** Faults are injected only while this holds (the end phase turns it off). */
  faultsActive = true;
  /** Backend clock offset from virtual time (a server clock step changes it). */
  serverOffset = 0;
  /** Probability of a fault at one journal call. */
  journalFaultRate = 0;
  /** Probability of a non-ok outcome at one provider call. */
  providerFaultRate = 0;
  crashes = 0;
  maxCrashes = 4;
  /** How long an inbox claim scan's reply takes after it committed (`Scenario.claimLagMs`). */
  claimLagMs = 0;
  /** Lease lengths (for delays "longer than a lease"). */
  leaseMs = 1000;
  /** Called when an incarnation dies (the run schedules its restart). */
  onCrash: (inc: Incarnation) => void = () => {};
  /** Lease-threatening faults injected (stall, clock steps, long delays, failed heartbeats). */
  leaseThreats = 0;

  constructor(sched: SimScheduler, plan: Prng, enabled: ReadonlySet<FaultKind>) {
    this.sched = sched;
    this.plan = plan;
    this.enabled = enabled;
  }

  /** The backend's clock. */
  serverNow = (): number => this.sched.time + this.serverOffset;

  log(who: string, text: string): void {
    const t = this.sched.elapsed;
    this.trace.push(`${(t / 1000).toFixed(3).padStart(9)}s ${who.padEnd(5)} ${text}`);
  }

  count(kind: string): void {
    this.faultCounts[kind] = (this.faultCounts[kind] ?? 0) + 1;
  }

  can(kind: FaultKind): boolean {
    return this.faultsActive && this.enabled.has(kind) && (kind !== "crash" && kind !== "provider-crash" || this.crashes < this.maxCrashes);
  }

  /**
   * The fault of one outside call (a provider send, a step's call to the fake service) and its latency,
   * drawn from the plan; counted under `<prefix>-<kind>`.
   */
  pickCallFault(prefix: "provider" | "step"): { outcome: CallFault; latency: number } {
    let outcome: CallFault = "ok";
    let latency = this.plan.int(1, 40);
    if (this.faultsActive && this.plan.chance(this.providerFaultRate)) {
      const picked = this.plan.weighted({
        "provider-timeout": this.can("provider-timeout") ? 2 : 0,
        "provider-transient": this.can("provider-transient") ? 2 : 0,
        "provider-permanent": this.can("provider-permanent") ? 0.5 : 0,
        "provider-retry-after": this.can("provider-retry-after") ? 1 : 0,
        "provider-slow": this.can("provider-slow") ? 2 : 0,
        "provider-crash": this.can("provider-crash") ? 0.7 : 0,
        ok: 0.001,
      });
      if (picked === "provider-slow") {
        latency = this.plan.int(Math.floor(this.leaseMs / 3), Math.floor(this.leaseMs * 2.5));
        this.count(latency > this.leaseMs ? `${prefix}-slow(>lease)` : `${prefix}-slow`);
      } else {
        outcome = picked;
        if (picked !== "ok") this.count(picked.replace(/^provider-/, `${prefix}-`));
      }
    }
    return { outcome, latency };
  }

  addReplica(name: string, random: Prng): Replica {
    const replica: Replica = {
      name,
      index: this.replicas.length,
      time: { offset: 0, frozenUntil: 0 },
      incarnations: [],
      current: null,
      freezes: [],
    };
    void random;
    this.replicas.push(replica);
    return replica;
  }

  newIncarnation(replica: Replica, random: Prng): Incarnation {
    replica.time.frozenUntil = 0;
    let markDied!: () => void;
    const died = new Promise<void>((resolve) => markDied = resolve);
    const inc: Incarnation = {
      id: `${replica.name}#${replica.incarnations.length + 1}`,
      replica,
      alive: true,
      clock: new ReplicaClock(this.sched, replica.time, random),
      bot: null,
      receive: null,
      confirmSent: null,
      died,
      markDied,
    };
    replica.incarnations.push(inc);
    replica.current = inc;
    return inc;
  }

  /** Kill an incarnation: nothing of it runs or is seen again. */
  crash(inc: Incarnation, why: string): void {
    if (!inc.alive) return;
    inc.alive = false;
    inc.receive = null;
    inc.clock.kill();
    inc.markDied();
    this.ledger.diedAt.set(inc.id, this.sched.time);
    this.log(inc.id, `CRASH (${why})`);
    this.onCrash(inc);
  }

  /** The error every operation of a dead incarnation gets. */
  death(): SimulatedCrash {
    return new SimulatedCrash(undefined, "dead");
  }

  /** Whether the replica is stalled now. */
  frozen(replica: Replica): boolean {
    return replica.time.frozenUntil > this.sched.time;
  }

  /** Wait while the replica is stalled (a result arriving at a stopped process is seen when it resumes). */
  async thaw(replica: Replica): Promise<void> {
    while (replica.time.frozenUntil > this.sched.time) {
      await this.sched.sleep(replica.time.frozenUntil - this.sched.time);
    }
  }

  /** Whether the replica was stalled at some point in [from, to]. */
  wasFrozen(replica: Replica, from: number, to: number): boolean {
    return replica.freezes.some((f) => f.from <= to && f.to >= from);
  }
}
