/**
 * The line of sends waiting for the outbox's rate limits. A send whose
 * lease is held waits here before its provider call (nothing is journaled
 * while it waits: a crash then leaves it never called, sent again later
 * without an attempt spent). One pump asks the limiter for the sends in
 * line, oldest first, and skips those whose bucket it knows to be empty
 * until that bucket refills: an empty global bucket costs one take per
 * refill, not one per waiting send, and one chat's empty bucket holds back
 * only that chat.
 *
 * @module
 */
import type { RateBucket, RateLimiter } from "./contract.ts";
import { type Clock, type ClockTimer } from "./clock.ts";
import { bucketOf, checkRate, MemoryRateLimiter, type ResolvedRateLimits } from "./rate_limit.ts";

interface Waiter {
  buckets: RateBucket[];
  /** A send made now (a handler's reply): it goes ahead of every send the worker took from the journal. */
  urgent: boolean;
  /** Whether the send gave up (its lease was lost, the process stopped): it leaves the line. */
  gone: () => boolean;
  resolve: (admitted: boolean) => void;
}

/** How long the pump sleeps at most before it looks at the line again (a lost lease leaves it). */
const RECHECK_MS = 250;
/** A failing limiter is reported at most this often (the first failure at once). */
const REPORT_EVERY_MS = 60_000;
/** The most buckets known empty that are remembered (a hint forgotten costs one take, nothing more). */
export const MAX_EMPTY_HINTS = 10_000;

/** The outbox's rate limits of one engine: the buckets of a send, and the line in front of the limiter. */
export class Throttle {
  readonly limits: ResolvedRateLimits;
  readonly #limiter: RateLimiter;
  readonly #clock: Clock;
  readonly #prefix: string;
  readonly #onError: (error: unknown) => void;
  #line: Waiter[] = [];
  /** Buckets known empty until this monotonic time (hints from the limiter's answers and pauses). */
  #emptyUntil = new Map<string, number>();
  /** The size at which the next new hint first drops the expired ones (amortized: twice the size left). */
  #pruneAt = 64;
  #pumping = false;
  #timer: ClockTimer | undefined;
  #wakeAt = Infinity;
  #closed = false;
  /** This process's own limiter, used while the configured (shared) one fails. */
  #fallback: MemoryRateLimiter | null = null;
  #failures = { unreported: 0, lastReportAt: -Infinity };

  /**
   * @param limits the limits (with a limiter)
   * @param clock the engine's clock
   * @param prefix what the bucket keys start with (the bot and its channel account: a shared limiter serves several bots)
   * @param onError told of a limiter error (the send waits and asks again)
   */
  constructor(limits: ResolvedRateLimits, clock: Clock, prefix: string, onError: (error: unknown) => void) {
    if (limits.limiter === undefined) throw new TypeError("Throttle needs a limiter");
    this.limits = limits;
    this.#limiter = limits.limiter;
    this.#clock = clock;
    this.#prefix = prefix;
    this.#onError = onError;
  }

  /** Sends waiting in line. */
  get waiting(): number {
    return this.#line.length;
  }

  /** The global bucket, if there is a global limit. */
  globalBucket(): RateBucket | undefined {
    return this.limits.global === undefined ? undefined : bucketOf(`${this.#prefix}:global`, this.limits.global);
  }

  /**
   * The bucket of `chatId`, if its chat has a limit. A rate the user's `perChat` function gives is
   * checked like a configured one; a bad one is reported and the chat goes without a chat limit
   * (the global limit still holds), rather than leave its send stuck.
   */
  chatBucket(chatId: string): RateBucket | undefined {
    const rate = this.limits.perChat?.(chatId);
    if (rate === undefined) return undefined;
    try {
      return bucketOf(`${this.#prefix}:chat:${chatId}`, checkRate(rate, `durability.outbox.rateLimit.perChat(${JSON.stringify(chatId)})`));
    } catch (error) {
      this.#onError(error);
      return undefined;
    }
  }

  /** The buckets a send to `chatId` takes from. */
  bucketsOf(chatId: string): RateBucket[] {
    const out: RateBucket[] = [];
    const global = this.globalBucket();
    const chat = this.chatBucket(chatId);
    if (chat) out.push(chat);
    if (global) out.push(global);
    return out;
  }

  /**
   * Wait in line until the limiter admits a send to `chatId`.
   * @param chatId the send's chat
   * @param gone whether the send gave up meanwhile
   * @param urgent a send made now (it goes ahead of the worker's sends in line)
   * @returns `true` when admitted at once (no wait), `"waited"` when admitted after a wait, `false` when it gave up
   */
  async admit(chatId: string, gone: () => boolean, urgent = false): Promise<true | "waited" | false> {
    const buckets = this.bucketsOf(chatId);
    if (buckets.length === 0) return true;
    if (this.#closed) return false;
    if ((this.#line.length === 0 || (urgent && !this.#line[0]!.urgent)) && !this.#knownEmpty(buckets, this.#clock.monotonic())) {
      // Nobody in line: ask at once (the common case of a bot well under its limits).
      const first = await this.#take(buckets);
      if (first === true) return true;
    }
    const admitted = await new Promise<boolean>((resolve) => {
      if (this.#closed) return resolve(false);
      const waiter = { buckets, urgent, gone, resolve };
      if (urgent) {
        // After the urgent ones already waiting, before the first of the worker's.
        const at = this.#line.findIndex((w) => !w.urgent);
        this.#line.splice(at < 0 ? this.#line.length : at, 0, waiter);
      } else {
        this.#line.push(waiter);
      }
      this.#schedule(0);
    });
    return admitted ? "waited" : false;
  }

  /**
   * Admit nothing from `bucket` for `ms` (a 429 the channel said holds for every chat, or for one).
   * @param bucket the bucket
   * @param ms how long
   */
  async pause(bucket: RateBucket, ms: number): Promise<void> {
    this.#hint(bucket.key, this.#clock.monotonic() + ms);
    await this.#limiter.pause(bucket, ms);
  }

  /** Let every waiting send go without admission (the process stops or died): each gives up. */
  close(): void {
    this.#closed = true;
    this.#clock.clearTimeout(this.#timer);
    for (const waiter of this.#line.splice(0)) waiter.resolve(false);
  }

  /** Buckets known empty remembered now (at most {@link MAX_EMPTY_HINTS}). */
  get emptyHints(): number {
    return this.#emptyUntil.size;
  }

  #hint(key: string, until: number): void {
    const known = this.#emptyUntil.get(key);
    if (known !== undefined) {
      if (known < until) this.#emptyUntil.set(key, until);
      return;
    }
    // A new bucket (every chat has its own: their ids are the senders' to choose): the hints of
    // buckets no one asked about again since they refilled go first, and past the bound the oldest.
    if (this.#emptyUntil.size >= this.#pruneAt) {
      const now = this.#clock.monotonic();
      for (const [old, at] of this.#emptyUntil) if (at <= now) this.#emptyUntil.delete(old);
      this.#pruneAt = Math.max(64, 2 * this.#emptyUntil.size);
    }
    for (const old of this.#emptyUntil.keys()) {
      if (this.#emptyUntil.size < MAX_EMPTY_HINTS) break;
      this.#emptyUntil.delete(old);
    }
    this.#emptyUntil.set(key, until);
  }

  #knownEmpty(buckets: readonly RateBucket[], now: number): number {
    let until = 0;
    for (const bucket of buckets) {
      const at = this.#emptyUntil.get(bucket.key);
      if (at === undefined) continue;
      if (at <= now) this.#emptyUntil.delete(bucket.key);
      else until = Math.max(until, at);
    }
    return until;
  }

  /**
   * One take: `true` when admitted; otherwise the empty bucket is remembered. While the configured
   * limiter fails (a shared one whose server is down), this process meters its sends on its own
   * memory limiter: sends keep going at the configured rates, per replica, never unmetered.
   */
  async #take(buckets: RateBucket[]): Promise<boolean> {
    let answer;
    try {
      answer = await this.#limiter.take(buckets);
    } catch (error) {
      this.#limiterFailed(error);
      if (this.#limiter instanceof MemoryRateLimiter) {
        for (const bucket of buckets) this.#hint(bucket.key, this.#clock.monotonic() + RECHECK_MS);
        return false;
      }
      this.#fallback ??= new MemoryRateLimiter({ clock: this.#clock });
      answer = await this.#fallback.take(buckets);
    }
    if (answer.ok) return true;
    this.#hint(answer.key, this.#clock.monotonic() + Math.max(1, answer.waitMs));
    return false;
  }

  #limiterFailed(error: unknown): void {
    const now = this.#clock.monotonic();
    if (now - this.#failures.lastReportAt < REPORT_EVERY_MS) {
      this.#failures.unreported++;
      return;
    }
    const more = this.#failures.unreported;
    this.#failures = { unreported: 0, lastReportAt: now };
    const reason = error instanceof Error ? error : new Error(String(error));
    this.#onError(new Error(
      `Rate limiter "${this.#limiter.name}" failed (${more} more failures since the last report); sends are metered by this process alone until it answers: ${reason.message}`,
      { cause: error },
    ));
  }

  #schedule(ms: number): void {
    if (this.#closed) return;
    const at = this.#clock.monotonic() + ms;
    if (this.#pumping || at >= this.#wakeAt) return;
    this.#clock.clearTimeout(this.#timer);
    this.#wakeAt = at;
    this.#timer = this.#clock.setTimeout(() => {
      this.#wakeAt = Infinity;
      void this.#pump();
    }, ms);
  }

  /** Admit from the line, oldest first, every send whose buckets are not known empty; then sleep until one may be. */
  async #pump(): Promise<void> {
    if (this.#pumping || this.#closed) return;
    this.#pumping = true;
    let sleepMs = RECHECK_MS;
    try {
      for (let i = 0; i < this.#line.length && !this.#closed;) {
        const waiter = this.#line[i]!;
        if (waiter.gone()) {
          this.#line.splice(i, 1);
          waiter.resolve(false);
          continue;
        }
        const now = this.#clock.monotonic();
        const emptyUntil = this.#knownEmpty(waiter.buckets, now);
        if (emptyUntil > now) {
          sleepMs = Math.min(sleepMs, emptyUntil - now);
          i++;
          continue;
        }
        if (await this.#take(waiter.buckets)) {
          const at = this.#line.indexOf(waiter);
          if (at >= 0) this.#line.splice(at, 1);
          waiter.resolve(true);
          i = 0; // the line may have changed while the limiter answered: from the front again
        } else {
          i = 0;
        }
      }
    } finally {
      this.#pumping = false;
    }
    if (this.#line.length > 0) this.#schedule(Math.max(1, Math.ceil(sleepMs)));
  }
}
