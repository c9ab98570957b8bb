/**
 * Outbound rate limits: the {@link Rate} of a bucket, the limits a provider
 * announces ({@link RateLimits}), the `durability.outbox.rateLimit` option,
 * and the in-process limiter ({@link MemoryRateLimiter}). The buckets are
 * GCRA (a token bucket kept as one number per key: the theoretical arrival
 * time of the next send), so a shared limiter stores one value per key.
 *
 * @module
 */
import type { RateBucket, RateLimiter, RateTake } from "./contract.ts";
import { type Clock, systemClock } from "./clock.ts";
import { checkKnownOptions } from "./options.ts";
import { showValue as show } from "./show.ts";

/** `count` sends per `perMs` ms, at most `burst` (default 1: evenly spaced) at once after a quiet spell. */
export interface Rate {
  count: number;
  perMs: number;
  burst?: number;
}

/** The limits of a channel: one for all sends, and one per chat (which may depend on the chat). */
export interface RateLimits {
  /** Every send of this bot (a provider account, a phone number). */
  global?: Rate;
  /** The sends of one chat; a function may answer per chat (`undefined`: no limit for that chat). */
  perChat?: Rate | ((chatId: string) => Rate | undefined);
}

/**
 * The `durability.outbox.rateLimit` option: `false` turns the limits off;
 * otherwise each limit overrides the provider's default (`false` drops it),
 * and `limiter` says where the buckets live (default: this process).
 */
export interface RateLimitOptions {
  global?: Rate | false;
  perChat?: Rate | ((chatId: string) => Rate | undefined) | false;
  /** Where the buckets live: a `MemoryRateLimiter` (default, per replica) or a shared one (Postgres, Redis). */
  limiter?: RateLimiter;
}

/** The limits an engine applies, provider defaults and user overrides merged. */
export interface ResolvedRateLimits {
  global: Rate | undefined;
  perChat: ((chatId: string) => Rate | undefined) | undefined;
  limiter: RateLimiter | undefined;
}

/** Largest `perMs` a rate may have (a day). */
const MAX_PER_MS = 86_400_000;

/**
 * Check a {@link Rate}.
 * @param value the rate
 * @param option the option's name, for the error
 * @returns the rate with its burst
 * @throws {TypeError} naming the option for a wrong type or an unknown key
 * @throws {RangeError} naming the option for a value out of range
 */
export function checkRate(value: unknown, option: string): Required<Rate> {
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new TypeError(`Option "${option}" must be a rate such as { count: 30, perMs: 1000 }, got ${show(value)}`);
  }
  checkKnownOptions(value, ["count", "perMs", "burst"], "option", option);
  const raw = value as Record<string, unknown>;
  const int = (v: unknown, name: string, max: number): number => {
    if (typeof v !== "number" || !Number.isInteger(v)) {
      throw new TypeError(`Option "${option}.${name}" must be an integer, got ${show(v)}`);
    }
    if (v < 1 || v > max) throw new RangeError(`Option "${option}.${name}" must be between 1 and ${max}, got ${show(v)}`);
    return v;
  };
  const count = int(raw.count, "count", 1_000_000);
  const perMs = int(raw.perMs, "perMs", MAX_PER_MS);
  const burst = raw.burst === undefined ? 1 : int(raw.burst, "burst", 1_000_000);
  return { count, perMs, burst };
}

function isLimiter(value: unknown): value is RateLimiter {
  if (typeof value !== "object" || value === null) return false;
  const l = value as Partial<RateLimiter>;
  return typeof l.take === "function" && typeof l.pause === "function" && typeof l.name === "string";
}

/**
 * Check the `durability.outbox.rateLimit` option (before the provider is known).
 * @param value the option
 * @param option its name
 * @returns `false` (limits off), or the checked overrides
 * @throws {TypeError} naming the option for a wrong type or an unknown key
 * @throws {RangeError} naming the option for a rate out of range
 */
export function checkRateLimitOption(value: unknown, option: string): RateLimitOptions | false {
  if (value === undefined) return {};
  if (value === false) return false;
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new TypeError(`Option "${option}" must be false or an object with "global", "perChat" or "limiter", got ${show(value)}`);
  }
  checkKnownOptions(value, ["global", "perChat", "limiter"], "option", option);
  const raw = value as Record<string, unknown>;
  const out: RateLimitOptions = {};
  if (raw.global !== undefined) out.global = raw.global === false ? false : checkRate(raw.global, `${option}.global`);
  if (raw.perChat !== undefined) {
    if (raw.perChat === false || typeof raw.perChat === "function") out.perChat = raw.perChat as RateLimitOptions["perChat"];
    else out.perChat = checkRate(raw.perChat, `${option}.perChat`);
  }
  if (raw.limiter !== undefined) {
    if (!isLimiter(raw.limiter)) {
      throw new TypeError(`Option "${option}.limiter" must be a rate limiter (with name, take and pause), got ${show(raw.limiter)}`);
    }
    out.limiter = raw.limiter;
  }
  return out;
}

/**
 * Merge a provider's default limits with the user's overrides.
 * @param defaults the provider's `rateLimits`
 * @param options the checked `durability.outbox.rateLimit`
 * @param provider the provider's name, for errors in its defaults
 * @returns the limits to apply (no limiter when there is no limit)
 * @throws {TypeError} naming the provider for a malformed default
 */
export function resolveRateLimits(defaults: RateLimits | undefined, options: RateLimitOptions | false, provider: string): ResolvedRateLimits {
  if (options === false) return { global: undefined, perChat: undefined, limiter: undefined };
  const where = `rateLimits of provider "${provider}"`;
  const global = options.global === false
    ? undefined
    : options.global ?? (defaults?.global === undefined ? undefined : checkRate(defaults.global, `${where}.global`));
  const chosen = options.perChat === false ? undefined : options.perChat ?? defaults?.perChat;
  let perChat: ResolvedRateLimits["perChat"];
  if (typeof chosen === "function") perChat = chosen;
  else if (chosen !== undefined) {
    const rate = checkRate(chosen, options.perChat === undefined ? `${where}.perChat` : "durability.outbox.rateLimit.perChat");
    perChat = () => rate;
  }
  const any = global !== undefined || perChat !== undefined;
  return { global, perChat, limiter: any ? options.limiter : undefined };
}

/**
 * The bucket of `rate` under `key`.
 * @param key the bucket's key
 * @param rate its rate
 * @returns the bucket
 */
export function bucketOf(key: string, rate: Rate): RateBucket {
  return { key, count: rate.count, perMs: rate.perMs, burst: rate.burst ?? 1 };
}

/**
 * One GCRA step on a bucket whose state is `tat` (theoretical arrival time, ms) at `now`. With
 * `burst` 1 the sends are at least one interval apart, so no window of `perMs` ever holds more than
 * `count` of them (a wake-up that comes late loses its slot rather than crowd the next one).
 * @returns the wait (0: admitted) and the state after taking
 */
export function gcraStep(tat: number, bucket: RateBucket, now: number): { waitMs: number; next: number } {
  const { interval, tolerance } = gcraParams(bucket);
  const from = Math.max(tat, now);
  const waitMs = from - tolerance - now;
  return waitMs > 0 ? { waitMs, next: tat } : { waitMs: 0, next: from + interval };
}

/**
 * The state of a bucket paused for `ms` from `now` (nothing admitted before `now + ms`).
 * @returns the new theoretical arrival time
 */
export function gcraPause(tat: number, bucket: RateBucket, now: number, ms: number): number {
  return Math.max(tat, now + ms + gcraParams(bucket).tolerance);
}

/**
 * A bucket's GCRA parameters, as the shared limiters hand them to their SQL and Lua.
 * @param bucket the bucket
 * @returns `interval`: ms between two sends at the rate; `tolerance`: how far ahead a burst may take
 */
export function gcraParams(bucket: RateBucket): { interval: number; tolerance: number } {
  const interval = bucket.perMs / bucket.count;
  return { interval, tolerance: (bucket.burst - 1) * interval };
}

/** Options of {@link MemoryRateLimiter}. */
export interface MemoryRateLimiterOptions {
  /** Its clock (default the system's); the bucket times are its `monotonic()`. */
  clock?: Clock;
  /**
   * Buckets kept at most, a positive integer (default 100 000). Past it the bucket used least recently
   * goes: forgetting a full bucket changes nothing; a bucket forgotten before it refilled starts full
   * again (its chat may get one burst early).
   */
  maxKeys?: number;
}

/**
 * The buckets in this process: each replica has its own. Nothing is known
 * of the sends before the limiter was made, so every bucket starts with one
 * send and refills at its rate from there (not with its burst): a process
 * that restarts in a loop cannot burst past the rate, and a chat's first
 * reply after a restart still goes at once.
 *
 * @example
 * ```ts
 * import { MemoryRateLimiter } from "@botmesh/durable";
 * const limiter = new MemoryRateLimiter();
 * await limiter.take([{ key: "global", count: 30, perMs: 1000, burst: 1 }]);
 * ```
 */
export class MemoryRateLimiter implements RateLimiter {
  readonly name = "memory";
  readonly scope = "process" as const;
  readonly #clock: Clock;
  readonly #startedAt: number;
  readonly #maxKeys: number;
  readonly #tat = new Map<string, number>();

  /**
   * @param options its clock and size
   * @throws {TypeError} for an unknown option
   */
  constructor(options: MemoryRateLimiterOptions = {}) {
    checkKnownOptions(options, ["clock", "maxKeys"], "MemoryRateLimiter option");
    this.#clock = options.clock ?? systemClock;
    const maxKeys = options.maxKeys ?? 100_000;
    if (typeof maxKeys !== "number" || !Number.isSafeInteger(maxKeys) || maxKeys < 1) {
      throw new RangeError(`MemoryRateLimiter option "maxKeys" must be a positive integer, got ${show(maxKeys)}`);
    }
    this.#maxKeys = maxKeys;
    this.#startedAt = this.#clock.monotonic();
  }

  #state(bucket: RateBucket): number {
    const known = this.#tat.get(bucket.key);
    if (known !== undefined) return known;
    // At the start a bucket holds one send, not its burst: a process restarting in a loop sends at most
    // one more per bucket per start than the rate allows. Later, an unused bucket is full.
    return this.#startedAt + gcraParams(bucket).tolerance;
  }

  /** The buckets kept now (at most `maxKeys`). */
  get size(): number {
    return this.#tat.size;
  }

  #store(key: string, tat: number): void {
    this.#tat.delete(key);
    this.#tat.set(key, tat); // the map's order is the order of last use: the first is the one idle longest
    // A hard bound: the buckets idle longest go, full or not (a bucket still refilling that goes starts
    // full again). Stopping at the first bucket not yet full let a burst of distinct keys at a slow
    // rate grow the map without bound.
    for (const old of this.#tat.keys()) {
      if (this.#tat.size <= this.#maxKeys) break;
      this.#tat.delete(old);
    }
  }

  /** @inheritdoc */
  async take(buckets: readonly RateBucket[]): Promise<RateTake> {
    const now = this.#clock.monotonic();
    const next: number[] = [];
    let worst: RateTake = { ok: true };
    for (const bucket of buckets) {
      const step = gcraStep(this.#state(bucket), bucket, now);
      if (step.waitMs > 0 && (worst.ok || step.waitMs > worst.waitMs)) worst = { ok: false, waitMs: step.waitMs, key: bucket.key };
      next.push(step.next);
    }
    if (!worst.ok) return worst;
    buckets.forEach((bucket, i) => this.#store(bucket.key, next[i]!));
    return worst;
  }

  /** @inheritdoc */
  async pause(bucket: RateBucket, ms: number): Promise<void> {
    const now = this.#clock.monotonic();
    this.#store(bucket.key, gcraPause(this.#state(bucket), bucket, now, ms));
  }
}
