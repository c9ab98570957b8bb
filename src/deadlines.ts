/**
 * Timeouts for many promises at once under one timer, for hot paths where a
 * timer per promise (armed, then cleared a moment later) costs more than the
 * work it guards.
 *
 * @example
 * ```ts
 * import { Deadlines } from "./deadlines.ts";
 * import { systemClock } from "./clock.ts";
 * const deadlines = new Deadlines(systemClock);
 * const answer = await deadlines.within(Promise.resolve(42), 1000, () => new Error("too slow"));
 * console.assert(answer === 42);
 * ```
 */
import type { Clock, ClockTimer } from "./clock.ts";
import { MinHeap } from "./min_heap.ts";

/** The heap is rebuilt without its settled waiters once it holds this many and four times the pending ones. */
const COMPACT_MIN = 1024;

interface Waiter {
  at: number;
  settled: boolean;
  expire: () => void;
}

/** Rejects a promise that has not settled by its deadline; every pending deadline shares one timer. */
export class Deadlines {
  readonly #clock: Clock;
  readonly #heap = new MinHeap<Waiter>((a, b) => a.at < b.at);
  #timer: ClockTimer | undefined;
  #armedFor = Infinity;
  /** Waiters not settled yet; the heap also holds settled ones until they reach its top or a compaction. */
  #pending = 0;
  #closed = false;

  /** @param clock the clock that measures the deadlines (monotonic time) and arms the timer */
  constructor(clock: Clock) {
    this.#clock = clock;
  }

  /** @returns how many waiters are kept, settled ones not yet dropped included (bounded by compaction) */
  get kept(): number {
    return this.#heap.size;
  }

  /**
   * `work`, or a rejection with `timeoutError()` when it has not settled within `ms` (`work` goes on,
   * and a late failure of it is nobody's to handle).
   * @param work the promise to wait for
   * @param ms how long to wait, in milliseconds
   * @param timeoutError builds the rejection of a timeout
   * @returns a promise settled like `work`, or rejected at the deadline
   */
  within<T>(work: Promise<T>, ms: number, timeoutError: () => Error): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const waiter: Waiter = { at: this.#clock.monotonic() + ms, settled: false, expire: () => reject(timeoutError()) };
      const settle = () => {
        if (waiter.settled) return;
        waiter.settled = true;
        // While running, the timer stays armed with nothing pending (it fires once, finds nothing, and
        // stops): re-arming it for each of a sequence of one-at-a-time promises would cost a timer each.
        if (--this.#pending === 0 && this.#closed) this.#idle();
      };
      work.then(
        (value) => {
          settle();
          resolve(value);
        },
        (error) => {
          settle();
          reject(error);
        },
      );
      this.#pending++;
      if (this.#heap.size >= COMPACT_MIN && this.#heap.size > 4 * this.#pending) this.#heap.retain((w) => !w.settled);
      this.#heap.push(waiter);
      if (waiter.at < this.#armedFor) this.#arm(waiter.at);
    });
  }

  /**
   * No timer left armed once nothing is pending (now, or when the last pending promise settles): a
   * timer would keep a process alive for up to the longest deadline. Later calls still time out.
   */
  close(): void {
    this.#closed = true;
    if (this.#pending === 0) this.#idle();
  }

  #idle(): void {
    this.#clock.clearTimeout(this.#timer);
    this.#timer = undefined;
    this.#armedFor = Infinity;
    this.#heap.retain(() => false);
  }

  #arm(at: number): void {
    this.#clock.clearTimeout(this.#timer);
    this.#armedFor = at;
    this.#timer = this.#clock.setTimeout(() => this.#fire(), at - this.#clock.monotonic());
  }

  #fire(): void {
    this.#timer = undefined;
    this.#armedFor = Infinity;
    const now = this.#clock.monotonic();
    for (let top = this.#heap.peek(); top !== undefined; top = this.#heap.peek()) {
      if (top.settled) {
        this.#heap.pop();
        continue;
      }
      if (top.at > now) {
        this.#arm(top.at);
        return;
      }
      this.#heap.pop();
      top.settled = true;
      this.#pending--;
      top.expire();
    }
  }
}
