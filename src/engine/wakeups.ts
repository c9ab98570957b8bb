/**
 * The wake-ups of the sweeper: a retry's backoff, a timer's deadline, work handed back. Every wake-up
 * asked for is kept, and one clock timer is armed for the earliest; when it fires, the ones it reached
 * are dropped and the next is armed.
 *
 * @module
 */
import type { Clock, ClockTimer } from "../clock.ts";
import { MinHeap } from "../min_heap.ts";

/** setTimeout's largest delay. */
export const MAX_TIMER_MS = 2_147_483_647;

/** One timer for all the sweeper's wake-ups. */
export class Wakeups {
  readonly #clock: Clock;
  readonly #fire: () => void;
  readonly #active: () => boolean;
  #timer: ClockTimer | undefined;
  #at = Infinity;
  /** The wake-ups asked for and not reached yet (monotonic times). */
  readonly #times = new MinHeap<number>((a, b) => a < b);

  /**
   * @param clock the engine's clock
   * @param fire what a wake-up does (a sweep)
   * @param active whether wake-ups are still wanted (not stopping, not halted)
   */
  constructor(clock: Clock, fire: () => void, active: () => boolean) {
    this.#clock = clock;
    this.#fire = fire;
    this.#active = active;
  }

  /** Wake up `inMs` from now (at once for 0), unless an earlier wake-up covers it. */
  wake(inMs: number): void {
    if (!this.#active()) return;
    const at = this.#clock.monotonic() + Math.min(Math.max(0, inMs), MAX_TIMER_MS);
    this.#times.push(at);
    if (at < this.#at) this.#arm(at);
  }

  /** Forget every wake-up and disarm the timer. */
  clear(): void {
    this.#clock.clearTimeout(this.#timer);
    this.#at = Infinity;
    this.#times.retain(() => false);
  }

  #arm(at: number): void {
    this.#clock.clearTimeout(this.#timer);
    this.#at = at;
    this.#timer = this.#clock.setTimeout(() => {
      this.#at = Infinity;
      const now = this.#clock.monotonic();
      for (let next = this.#times.peek(); next !== undefined && next <= now + 1; next = this.#times.peek()) this.#times.pop();
      const next = this.#times.peek();
      if (next !== undefined && this.#active()) this.#arm(next);
      this.#fire();
    }, Math.max(0, at - this.#clock.monotonic()) + 1);
  }
}
