/**
 * Fixed-bucket histograms of durations, in seconds, for the Prometheus
 * exposition: what `bot.durability.histograms()` returns.
 *
 * @module
 */

/**
 * Upper bounds (seconds) of the duration buckets: from 5 ms (a reply the
 * handler writes at once) to 10 minutes (a send waiting out a channel's rate
 * limit or retries).
 */
const DURATION_BUCKETS_SECONDS: readonly number[] = Object.freeze([
  0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600,
]);

/** A histogram's state: cumulative counts per upper bound, as in the Prometheus text format. */
export interface HistogramSnapshot {
  /** Upper bounds in seconds, ascending (`+Inf` is implied: its count is `count`). */
  bounds: readonly number[];
  /** Observations at most `bounds[i]`, for each `i` (cumulative, so never decreasing). */
  cumulative: number[];
  /** Observations in all. */
  count: number;
  /** Sum of the observed values, in seconds. */
  sum: number;
}

/** The duration histograms of `bot.durability.histograms()`, all in seconds. */
export interface DurabilityHistograms {
  /**
   * From an inbound message's `receivedAt` to each of its replies recorded as sent (replies
   * sent by this process, for messages this process handled).
   */
  replyLatency: HistogramSnapshot;
  /** Each provider call that sends (journaled, bypassed or direct), success or failure. */
  providerCall: HistogramSnapshot;
  /** An outbox entry's time from its reservation (`createdAt`) to its first provider call. */
  outboxQueued: HistogramSnapshot;
}

/** One histogram: counts per bucket (not cumulative), kept cumulative only in snapshots. */
export class Histogram {
  readonly bounds: readonly number[];
  #counts: number[];
  #count = 0;
  #sum = 0;

  /** @param bounds upper bounds in seconds, ascending */
  constructor(bounds: readonly number[] = DURATION_BUCKETS_SECONDS) {
    this.bounds = bounds;
    this.#counts = new Array<number>(bounds.length).fill(0);
  }

  /** @param seconds a duration (negative values count as 0; NaN is ignored) */
  observe(seconds: number): void {
    if (Number.isNaN(seconds)) return;
    const value = seconds > 0 ? seconds : 0;
    this.#count++;
    this.#sum += value;
    const bounds = this.bounds;
    for (let i = 0; i < bounds.length; i++) {
      if (value <= bounds[i]!) {
        this.#counts[i]!++;
        return;
      }
    }
  }

  /** @returns the current state, with cumulative counts */
  snapshot(): HistogramSnapshot {
    const cumulative: number[] = [];
    let total = 0;
    for (const n of this.#counts) cumulative.push(total += n);
    return { bounds: this.bounds, cumulative, count: this.#count, sum: this.#sum };
  }
}

/** @returns the three duration histograms, empty */
export function emptyHistograms(): { [K in keyof DurabilityHistograms]: Histogram } {
  return { replyLatency: new Histogram(), providerCall: new Histogram(), outboxQueued: new Histogram() };
}
