/**
 * The one seam for time and chance: every timer, wall-clock read and jitter
 * of the engine, the bot, conversations and the in-process backends goes
 * through a {@link Clock}. Production uses {@link systemClock}; a simulation
 * passes its own and runs a whole multi-replica scenario in simulated time.
 *
 * @module
 */
import { unrefTimer } from "./runtime/mod.ts";

/** An opaque timer handle of a {@link Clock}. */
export type ClockTimer = unknown;

/** Time and chance, injectable. */
export interface Clock {
  /** Wall-clock time in ms since epoch. It may step forward or back (NTP, a VM resumed). */
  now(): number;
  /** A clock in ms that never steps: elapsed time, to tell a wall-clock step or a stall. */
  monotonic(): number;
  /**
   * Call `fn` once after `ms` milliseconds. The timer does not keep the process alive.
   * @param fn what to call
   * @param ms the delay
   * @returns a handle for {@link Clock.clearTimeout}
   */
  setTimeout(fn: () => void, ms: number): ClockTimer;
  /** Cancel a timer of {@link Clock.setTimeout} (`undefined` is ignored). */
  clearTimeout(timer: ClockTimer | undefined): void;
  /** A random number in [0, 1): backoff jitter. */
  random(): number;
}

/** setTimeout's largest delay; longer delays are re-armed. */
const MAX_TIMER_MS = 2_147_483_647;

/**
 * The real clock: `Date.now()`, `performance.now()`, the runtime's timers
 * (unref'd) and `Math.random()`.
 */
export const systemClock: Clock = {
  now: () => Date.now(),
  monotonic: () => performance.now(),
  setTimeout(fn: () => void, ms: number): ClockTimer {
    const timer = setTimeout(fn, Math.min(MAX_TIMER_MS, Math.max(0, ms)));
    unrefTimer(timer);
    return timer;
  },
  clearTimeout(timer: ClockTimer | undefined): void {
    if (timer !== undefined) clearTimeout(timer as ReturnType<typeof setTimeout>);
  },
  random: () => Math.random(),
};

/**
 * Checks a user-supplied clock.
 * @param clock the value
 * @param option the option's name, for the error
 * @returns the clock
 * @throws {TypeError} when a method is missing
 */
export function checkClock(clock: unknown, option: string): Clock {
  if (typeof clock !== "object" || clock === null) {
    throw new TypeError(`Option "${option}" must be a Clock object, got ${clock === null ? "null" : typeof clock}`);
  }
  for (const method of ["now", "monotonic", "setTimeout", "clearTimeout", "random"] as const) {
    if (typeof (clock as Record<string, unknown>)[method] !== "function") {
      throw new TypeError(`Option "${option}" must have a ${method}() method`);
    }
  }
  return clock as Clock;
}

/**
 * Resolve after `ms` on `clock`, or reject when `signal` aborts.
 * @param clock the clock
 * @param ms the delay
 * @param signal aborts the wait
 * @returns a promise resolved after the delay
 */
export function sleep(clock: Clock, ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const onAbort = () => {
      clock.clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = clock.setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** A repeating timer on a {@link Clock}; `stop()` cancels it. */
export interface Repeating {
  stop(): void;
}

/**
 * Call `fn` every `ms` on `clock` (the next period starts when the timer fires, not when `fn` settles).
 * @param clock the clock
 * @param ms the period
 * @param fn what to call
 * @returns a handle to stop it
 */
export function every(clock: Clock, ms: number, fn: () => void): Repeating {
  let stopped = false;
  let timer: ClockTimer | undefined;
  const arm = () => {
    timer = clock.setTimeout(() => {
      if (stopped) return;
      arm();
      fn();
    }, ms);
  };
  arm();
  return {
    stop() {
      stopped = true;
      clock.clearTimeout(timer);
    },
  };
}
