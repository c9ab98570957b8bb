/**
 * Simulated time: one scheduler (virtual time, timers in a min-heap by due
 * time then insertion order) and per-replica views of it implementing
 * {@link Clock}, each with its own wall-clock offset (a clock step), a
 * "frozen until" (a stall, SIGSTOP) and a kill switch (process death).
 *
 * @module
 */
import type { Clock, ClockTimer } from "../../clock.ts";
import { MinHeap } from "../../min_heap.ts";
import type { Prng } from "./prng.ts";

/** One scheduled callback. */
export interface SimTimer {
  due: number;
  seq: number;
  fn: () => void;
  cancelled: boolean;
}

/** The virtual epoch every run starts at (ms since 1970). */
export const SIM_EPOCH = 1_700_000_000_000;

/** What stopped {@link SimScheduler.runUntil}. */
export type RunStop = "deadline" | "done" | "empty" | "runaway";

/** Drain the microtask queue: `setImmediate` runs after every pending microtask. */
function drainMicrotasks(): Promise<void> {
  return new Promise((resolve) => setImmediate(resolve));
}

/** Virtual time and its timers; single-threaded, deterministic. */
export class SimScheduler {
  /** Virtual time, ms since epoch (it only moves forward). */
  time: number = SIM_EPOCH;
  #heap = new MinHeap<SimTimer>((a, b) => a.due < b.due || (a.due === b.due && a.seq < b.seq));
  #seq = 0;
  /** Timers fired so far. */
  steps = 0;

  /** Virtual ms since the start of the run. */
  get elapsed(): number {
    return this.time - SIM_EPOCH;
  }

  /** Call `fn` at virtual time `due` (not before now). */
  at(due: number, fn: () => void): SimTimer {
    const timer: SimTimer = { due: Math.max(this.time, due), seq: ++this.#seq, fn, cancelled: false };
    this.#heap.push(timer);
    return timer;
  }

  /** Call `fn` after `ms` virtual ms. */
  after(ms: number, fn: () => void): SimTimer {
    return this.at(this.time + Math.max(0, Number.isFinite(ms) ? ms : 0), fn);
  }

  /** Resolve after `ms` virtual ms. */
  sleep(ms: number): Promise<void> {
    return new Promise((resolve) => this.after(ms, resolve));
  }

  cancel(timer: SimTimer | undefined): void {
    if (timer) timer.cancelled = true;
  }

  #peek(): SimTimer | undefined {
    for (let top = this.#heap.peek(); top !== undefined; top = this.#heap.peek()) {
      if (!top.cancelled) return top;
      this.#heap.pop();
    }
    return undefined;
  }

  /**
   * Drive the simulation: drain microtasks, fire the next timer, repeat, until
   * `done()` holds (checked after each drain), no timer is due by `deadline`
   * (virtual time is then set to `deadline`), or `maxSteps` timers fired.
   */
  async runUntil(deadline: number, done?: () => boolean, maxSteps: number = Infinity): Promise<RunStop> {
    for (let steps = 0;; steps++) {
      await drainMicrotasks();
      if (done?.()) return "done";
      const next = this.#peek();
      if (next === undefined || next.due > deadline) {
        if (deadline > this.time && Number.isFinite(deadline)) this.time = deadline;
        return next === undefined ? "empty" : "deadline";
      }
      if (steps >= maxSteps) return "runaway";
      this.#heap.pop();
      if (next.due > this.time) this.time = next.due;
      this.steps++;
      next.fn();
    }
  }
}

/** The mutable state of one replica's clock, shared by its incarnations. */
export interface ReplicaTime {
  /** Wall-clock offset from virtual time (a clock step changes it). */
  offset: number;
  /** Virtual time until which the replica is stalled (its timers fire at the end). */
  frozenUntil: number;
}

interface Handle {
  timer: SimTimer;
  cancelled: boolean;
}

/**
 * One incarnation's view of simulated time: `now()` is virtual time plus the
 * replica's wall offset, `monotonic()` never steps, timers due while the
 * replica is frozen fire when the freeze ends, and after `kill()` nothing of
 * this incarnation fires again.
 */
export class ReplicaClock implements Clock {
  readonly #sched: SimScheduler;
  readonly #state: ReplicaTime;
  readonly #random: Prng;
  #dead = false;
  #handles = new Set<Handle>();

  constructor(sched: SimScheduler, state: ReplicaTime, random: Prng) {
    this.#sched = sched;
    this.#state = state;
    this.#random = random;
  }

  now(): number {
    return this.#sched.time + this.#state.offset;
  }

  monotonic(): number {
    return this.#sched.elapsed;
  }

  setTimeout(fn: () => void, ms: number): ClockTimer {
    const handle: Handle = { timer: undefined as unknown as SimTimer, cancelled: this.#dead };
    if (this.#dead) return handle;
    const fire = () => {
      if (handle.cancelled || this.#dead) return;
      if (this.#state.frozenUntil > this.#sched.time) {
        handle.timer = this.#sched.at(this.#state.frozenUntil, fire);
        return;
      }
      this.#handles.delete(handle);
      fn();
    };
    handle.timer = this.#sched.after(Math.max(0, ms), fire);
    this.#handles.add(handle);
    return handle;
  }

  clearTimeout(timer: ClockTimer | undefined): void {
    const handle = timer as Handle | undefined;
    if (!handle) return;
    handle.cancelled = true;
    this.#sched.cancel(handle.timer);
    this.#handles.delete(handle);
  }

  random(): number {
    return this.#random.next();
  }

  /** The process died: none of its timers fires again. */
  kill(): void {
    this.#dead = true;
    for (const handle of this.#handles) {
      handle.cancelled = true;
      this.#sched.cancel(handle.timer);
    }
    this.#handles.clear();
  }

  get dead(): boolean {
    return this.#dead;
  }
}
