/**
 * When the journals hold no work under way: `idle()` (tests, graceful drains) and `sweepFor()` (a
 * cron function's `bot.sweep()`), with what each sweep took up.
 *
 * @module
 */
import { type Clock, sleep } from "../clock.ts";
import type { DamagedStorageError, DurabilityBackend } from "../contract.ts";
import { ACTIVE_INBOX_STATES, BLOCKING_OUTBOX_STATES, TIMER_STATE } from "../rules.ts";
import { timerOf } from "./jobs.ts";
import type { SweepSummary } from "./types.ts";

/** The active inbox states that are work for `idle()`: all but a timer's (`scheduled`). */
const WORK_INBOX_STATES = ACTIVE_INBOX_STATES.filter((state) => state !== TIMER_STATE);
/** How many failed inbox records an idle check reads, in turn, past timers that an older version journaled as failures. */
const ACTIVE_FAILED_LOOKS = [1, 200, 5_000, 100_000];

/** What the sweeps of a process took up. */
export interface SweepCounts {
  inbound: number;
  outbound: number;
  ambiguous: number;
  purges: number;
}

/** What settling needs from the engine. */
export interface SettlingHost {
  backend: DurabilityBackend;
  clock: Clock;
  /** Claim scans whose records are not all held yet. */
  claimsInFlight(): number;
  /** What the sweeps took up so far. */
  swept(): SweepCounts;
  sweep(): Promise<void>;
  /** Resolves when the bot has no job queued or running. */
  whenLocalIdle(): Promise<void>;
  halted(): boolean;
  stopping(): boolean;
  /** The damage a backend reported: no work is taken up or finished any more. */
  damaged(): DamagedStorageError | null;
  /** Report an error that has no caller; `true` when the caller must give up. */
  report(error: unknown, context: string): boolean;
}

/** `idle()` and `sweepFor()`. */
export class Settling {
  readonly #h: SettlingHost;
  /** The part of the sweeps' counts that `sweepFor()` reported already. */
  #reported: SweepCounts = { inbound: 0, outbound: 0, ambiguous: 0, purges: 0 };
  #tail: Promise<void> = Promise.resolve();

  constructor(host: SettlingHost) {
    this.#h = host;
  }

  /**
   * Whether the journals hold work under way (or this process has a claim scan on its way). A
   * `scheduled` timer is not, due or not: a sweep takes a due one up (`idle()` begins with one).
   */
  async hasActiveWork(): Promise<boolean> {
    // A claim scan whose answer is on its way holds records this process is about to work on.
    if (this.#h.claimsInFlight() > 0) return true;
    const outbound = await this.#h.backend.outbox.list({ state: BLOCKING_OUTBOX_STATES, limit: 1 });
    if (outbound.length > 0) return true;
    // The active inbox states but a timer's in one read: a record moving from one to another between
    // two reads (a retry claimed: failed, then processing) would be missed by both. A `scheduled` timer
    // (an ask waiting for its answer) is not work under way until a sweep takes it up; a retry is. A
    // timer armed by a version that journaled timers as `failed` ("Not a failure: a timer") is told
    // apart by its payload: read on past those until one that is work, or the end.
    const now = this.#h.clock.now();
    for (const limit of ACTIVE_FAILED_LOOKS) {
      const active = await this.#h.backend.inbox.list({ state: WORK_INBOX_STATES, limit });
      if (active.some((r) => r.state !== "failed" || (timerOf(r.payload)?.at ?? -Infinity) <= now)) return true;
      if (active.length < limit) return false;
    }
    return true; // more waiting asks than it reads: counted as work, never as idle by mistake
  }

  /** Damaged storage settles nothing: what is under way stays so until it is repaired. */
  #throwDamage(): void {
    const damage = this.#h.damaged();
    if (damage !== null) throw damage;
  }

  /**
   * Sweep until nothing due is left or `budgetMs` has passed, waiting for the work each pass took up
   * (see `Bot.sweep()`).
   */
  sweepFor(budgetMs: number): Promise<SweepSummary> {
    // One at a time: each call reports what was taken up since the previous one.
    const run = this.#tail.then(() => this.#sweepFor(budgetMs));
    this.#tail = run.then(() => {}, () => {});
    return run;
  }

  async #sweepFor(budgetMs: number): Promise<SweepSummary> {
    const startedAt = this.#h.clock.monotonic();
    const taken = (c: SweepCounts) => c.inbound + c.outbound;
    // What the start's recovery sweep (or a timer's sweep) took up since the last call counts too.
    let seen = this.#reported;
    let more = false;
    for (;;) {
      this.#throwDamage();
      await this.#h.sweep();
      // The work it took up is finished before it returns (or looks for more): a cron function that
      // ends when this resolves must not cut off a send under way, which would leave it ambiguous.
      await this.#h.whenLocalIdle();
      const now = { ...this.#h.swept() };
      const claimed = taken(now) - taken(seen);
      seen = now;
      if (this.#h.halted() || this.#h.stopping() || claimed === 0) break;
      if (this.#h.clock.monotonic() - startedAt >= budgetMs) {
        more = true;
        break;
      }
    }
    this.#throwDamage();
    const from = this.#reported;
    this.#reported = seen;
    const pending = this.#h.halted() ? true : await this.hasActiveWork().catch(() => true);
    return {
      inbound: seen.inbound - from.inbound,
      outbound: seen.outbound - from.outbound,
      ambiguous: seen.ambiguous - from.ambiguous,
      purged: seen.purges > from.purges,
      more,
      pending,
      ms: Math.round(this.#h.clock.monotonic() - startedAt),
    };
  }

  /**
   * Resolve when every admitted record is done or dead and every outbox entry is sent, dead or unknown.
   * A timer waiting for its deadline is no work; one already due is taken up by the sweep this begins
   * with (it is work from then on), so that it fires before `idle()` resolves, with or without timers.
   * Rejects with the `DamagedStorageError` once a backend reported its storage damaged.
   */
  async idle(): Promise<void> {
    await this.#h.sweep();
    let pause = 1;
    for (;;) {
      await this.#h.whenLocalIdle();
      if (this.#h.halted()) return;
      this.#throwDamage();
      let active: boolean;
      try {
        active = await this.hasActiveWork();
      } catch (error) {
        if (this.#h.report(error, "idle check")) return this.#throwDamage();
        active = true;
      }
      if (!active) {
        await this.#h.whenLocalIdle();
        if (!await this.hasActiveWork().catch(() => true)) return;
      }
      await this.#h.sweep();
      await sleep(this.#h.clock, pause);
      pause = Math.min(pause * 2, 50);
    }
  }
}
