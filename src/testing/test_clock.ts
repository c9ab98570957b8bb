/**
 * A {@link Clock} in virtual time that moves by itself whenever the process
 * is quiet: tests that wait for leases to lapse, sweeps to run and backoffs to
 * pass cost no real time, and slow real I/O (a file backend's fsync, SQLite
 * under load) never races a virtual lease, because time stands still while
 * it is in flight.
 *
 * @module
 */
import type { Clock, ClockTimer } from "../clock.ts";
import type { DurabilityBackend } from "../contract.ts";
import { MinHeap } from "../min_heap.ts";

/** Options of {@link TestClock}. */
export interface TestClockOptions {
  /** The virtual wall-clock time at the start, in ms since epoch (default: the real `Date.now()`). */
  start?: number;
  /** The random source of {@link TestClock.random} (default `Math.random`). */
  random?: () => number;
  /**
   * How many real macrotask turns in a row nothing tracked may be in flight
   * and nothing tracked may start or end before virtual time moves to the
   * next timer (default 4). Each turn lets pending microtasks, `setImmediate`
   * callbacks and completed I/O run.
   */
  quietTurns?: number;
  /**
   * A tracked operation that has not settled after this many real ms no
   * longer holds virtual time (default 5000): a call that hangs for good (a
   * write of a "killed" process) must not freeze every timer.
   */
  hungAfterMs?: number;
}

interface Timer {
  due: number;
  seq: number;
  fn: () => void;
  done: boolean;
}

/** Yield one real macrotask turn. */
const macrotask: () => Promise<void> = (() => {
  const immediate = (globalThis as { setImmediate?: (fn: () => void) => unknown }).setImmediate;
  if (typeof immediate === "function") return () => new Promise<void>((resolve) => immediate(resolve));
  return () => new Promise<void>((resolve) => setTimeout(resolve, 0));
})();

/**
 * A {@link Clock} in virtual time for tests. Time only moves when every
 * piece of work in the process has settled: the clock's driver yields a few
 * real macrotask turns and, when no {@link TestClock.track tracked}
 * operation is in flight, jumps to the earliest timer and fires it, one at a
 * time. Pass it to `new Bot({ clock })` and to the backend's clock option
 * (`clock: () => testClock.now()`), sleep with {@link TestClock.sleep}, run
 * real I/O the virtual clock must wait for through {@link TestClock.track}
 * (or a backend through {@link trackBackend}), and {@link TestClock.stop}
 * it when the test ends.
 *
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { MockProvider, TestClock } from "@botmesh/durable/testing";
 * const clock = new TestClock();
 * const backend = new MemoryDurability({ clock: () => clock.now() });
 * const bot = new Bot({ clock, provider: new MockProvider(), durability: { backend, instanceId: "t" } });
 * await bot.start();
 * await clock.sleep(60_000); // a minute of leases, heartbeats and sweeps, in a few ms
 * await bot.stop();
 * clock.stop();
 * ```
 */
export class TestClock implements Clock {
  #time: number;
  readonly #start: number;
  readonly #random: () => number;
  readonly #quietTurns: number;
  readonly #hungAfterMs: number;
  #heap = new MinHeap<Timer>((a, b) => a.due < b.due || (a.due === b.due && a.seq < b.seq));
  #seq = 0;
  /** Tracked operations in flight: id → real start time. */
  #inFlight = new Map<number, number>();
  #nextOp = 0;
  /** Bumped when a tracked operation starts or settles. */
  #activity = 0;
  #wake: (() => void) | undefined;
  #settled: (() => void) | undefined;
  #driving = false;
  #stopped = false;
  /** Timers fired so far. */
  fired = 0;

  /**
   * @param options `start`, `random`, `quietTurns`, `hungAfterMs`
   * @throws {TypeError} when an option is invalid
   */
  constructor(options: TestClockOptions = {}) {
    const start = options.start ?? Date.now();
    if (typeof start !== "number" || !Number.isFinite(start)) throw new TypeError(`TestClock option "start" must be a finite number`);
    if (options.random !== undefined && typeof options.random !== "function") {
      throw new TypeError(`TestClock option "random" must be a function`);
    }
    const quietTurns = options.quietTurns ?? 4;
    if (!Number.isInteger(quietTurns) || quietTurns < 1) throw new TypeError(`TestClock option "quietTurns" must be a positive integer`);
    const hungAfterMs = options.hungAfterMs ?? 5_000;
    if (typeof hungAfterMs !== "number" || !(hungAfterMs > 0)) throw new TypeError(`TestClock option "hungAfterMs" must be a positive number`);
    this.#time = this.#start = start;
    this.#random = options.random ?? Math.random;
    this.#quietTurns = quietTurns;
    this.#hungAfterMs = hungAfterMs;
  }

  /** Virtual wall-clock time, ms since epoch. */
  now(): number {
    return this.#time;
  }

  /** Virtual ms since the clock was made (never steps). */
  monotonic(): number {
    return this.#time - this.#start;
  }

  /** Virtual ms since the clock was made. */
  get elapsed(): number {
    return this.#time - this.#start;
  }

  /** The random source. */
  random(): number {
    return this.#random();
  }

  /**
   * Call `fn` once `ms` virtual ms from now.
   * @param fn what to call
   * @param ms the delay (negative or not finite: 0)
   * @returns a handle for {@link TestClock.clearTimeout}
   */
  setTimeout(fn: () => void, ms: number): ClockTimer {
    const delay = Number.isFinite(ms) && ms > 0 ? ms : 0;
    const timer: Timer = { due: this.#time + delay, seq: ++this.#seq, fn, done: false };
    if (!this.#stopped) {
      this.#heap.push(timer);
      this.#drive();
    }
    return timer;
  }

  /** Cancel a timer (`undefined`, a fired timer or another clock's handle are ignored). */
  clearTimeout(timer: ClockTimer | undefined): void {
    if (typeof timer === "object" && timer !== null && "due" in timer && "done" in timer) (timer as Timer).done = true;
  }

  /**
   * Resolve after `ms` virtual ms.
   * @param ms the delay
   * @returns a promise resolved when the clock gets there
   */
  sleep(ms: number): Promise<void> {
    return new Promise((resolve) => this.setTimeout(resolve, ms));
  }

  /**
   * Run real work that virtual time must wait for: no timer fires while it is
   * in flight (up to `hungAfterMs` of real time).
   * @param work the operation (called at once) or its promise
   * @returns what it returns
   */
  track<T>(work: (() => T) | Promise<T>): Promise<Awaited<T>> {
    const release = this.hold();
    let result: Promise<Awaited<T>>;
    try {
      result = Promise.resolve(typeof work === "function" ? (work as () => T)() : work) as Promise<Awaited<T>>;
    } catch (error) {
      release();
      return Promise.reject(error);
    }
    result.then(release, release);
    return result;
  }

  /**
   * Hold virtual time until the returned function is called (or `hungAfterMs` of real time passed).
   * @returns the release (calling it again does nothing)
   */
  hold(): () => void {
    const id = ++this.#nextOp;
    this.#inFlight.set(id, performance.now());
    this.#activity++;
    return () => {
      if (!this.#inFlight.delete(id)) return;
      this.#activity++;
      if (this.#inFlight.size === 0) this.#settled?.();
    };
  }

  /** Tracked operations in flight (hung ones included). */
  get inFlight(): number {
    return this.#inFlight.size;
  }

  /** Stop the clock: no timer fires any more (the pending ones are dropped). Call it when the test ends. */
  stop(): void {
    this.#stopped = true;
    this.#heap = new MinHeap<Timer>(() => false);
    this.#wake?.();
    this.#settled?.();
  }

  /** Whether {@link TestClock.stop} was called. */
  get stopped(): boolean {
    return this.#stopped;
  }

  /** The earliest live timer, dropping cancelled ones. */
  #next(): Timer | undefined {
    for (;;) {
      const t = this.#heap.peek();
      if (t === undefined || !t.done) return t;
      this.#heap.pop();
    }
  }

  /** Tracked operations that still hold time, and when the oldest of them stops holding it (real ms). */
  #holding(): { count: number; releaseInMs: number } {
    const now = performance.now();
    let count = 0;
    let releaseInMs = Infinity;
    for (const started of this.#inFlight.values()) {
      const left = started + this.#hungAfterMs - now;
      if (left > 0) {
        count++;
        releaseInMs = Math.min(releaseInMs, left);
      }
    }
    return { count, releaseInMs };
  }

  /** Until every tracked operation settled or the oldest counts as hung. */
  #whenSettled(releaseInMs: number): Promise<void> {
    return new Promise<void>((resolve) => {
      const timer = setTimeout(finish, Math.max(1, Math.ceil(releaseInMs)));
      function finish() {
        clearTimeout(timer);
        resolve();
      }
      this.#settled = () => {
        this.#settled = undefined;
        finish();
      };
    });
  }

  /** Whether the process stayed quiet for `quietTurns` turns in a row (false: stopped). */
  async #quiet(): Promise<boolean> {
    let calm = 0;
    let seen = this.#activity;
    while (calm < this.#quietTurns) {
      await macrotask();
      if (this.#stopped) return false;
      const { count, releaseInMs } = this.#holding();
      if (count > 0) {
        await this.#whenSettled(releaseInMs);
        if (this.#stopped) return false;
        calm = 0;
        seen = this.#activity;
        continue;
      }
      if (this.#activity !== seen) {
        seen = this.#activity;
        calm = 0;
        continue;
      }
      calm++;
    }
    return true;
  }

  /** The driver: fires timers in virtual-time order whenever the process is quiet. */
  #drive(): void {
    if (this.#driving) {
      this.#wake?.();
      return;
    }
    this.#driving = true;
    void (async () => {
      try {
        while (!this.#stopped) {
          if (this.#next() === undefined) {
            await new Promise<void>((resolve) => (this.#wake = resolve));
            this.#wake = undefined;
            continue;
          }
          if (!await this.#quiet()) continue;
          const timer = this.#next();
          if (timer === undefined) continue;
          this.#heap.pop();
          timer.done = true;
          if (timer.due > this.#time) this.#time = timer.due;
          this.fired++;
          try {
            timer.fn();
          } catch (error) {
            queueMicrotask(() => {
              throw error;
            });
          }
        }
      } finally {
        this.#driving = false;
      }
    })();
  }
}

/**
 * A view of `target` whose method calls are {@link TestClock.track tracked}
 * on `clock` while the promises they return are pending, and whose object
 * members named in `nested` are such views too. Other members pass through.
 *
 * @param target the object (a backend, a journal)
 * @param clock the test clock
 * @param nested members that are objects with methods to track too
 * @returns the view (a different object than `target`)
 */
export function trackCalls<T extends object>(target: T, clock: TestClock, nested: readonly string[] = []): T {
  const wrappers = new Map<PropertyKey, { original: unknown; wrapper: unknown }>();
  const views = new Map<PropertyKey, { original: unknown; view: unknown }>();
  return new Proxy(target, {
    get(t, prop) {
      const value = Reflect.get(t, prop, t);
      if (typeof prop === "string" && nested.includes(prop) && typeof value === "object" && value !== null) {
        let view = views.get(prop);
        if (view === undefined || view.original !== value) {
          view = { original: value, view: trackCalls(value, clock) };
          views.set(prop, view);
        }
        return view.view;
      }
      if (typeof value !== "function") return value;
      let known = wrappers.get(prop);
      if (known === undefined || known.original !== value) {
        const fn = value as (...args: unknown[]) => unknown;
        const wrapper = (...args: unknown[]) => {
          const release = clock.hold();
          let out: unknown;
          try {
            out = fn.apply(t, args);
          } catch (error) {
            release();
            throw error;
          }
          if (typeof (out as { then?: unknown } | null)?.then === "function") Promise.resolve(out).then(release, release);
          else release();
          return out;
        };
        known = { original: value, wrapper };
        wrappers.set(prop, known);
      }
      return known.wrapper;
    },
  });
}

/**
 * A view of `backend` whose calls (journal operations, `open()`, `close()`)
 * are {@link TestClock.track tracked} on `clock`: virtual time stands still
 * while one of them is in flight. Other members pass through to the backend.
 *
 * @param backend the backend
 * @param clock the test clock
 * @returns the view (a different object than `backend`)
 */
export function trackBackend<B extends DurabilityBackend>(backend: B, clock: TestClock): B {
  return trackCalls(backend, clock, ["inbox", "outbox"]);
}
