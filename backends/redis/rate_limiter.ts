/**
 * `new RedisRateLimiter({ client })`: the outbox's rate-limit buckets in
 * Redis, shared by every replica: one key per bucket (the GCRA state as the
 * time of the next send, expiring once the bucket is full again), decided by
 * one Lua script on the server's clock (`TIME`), so that a take of several
 * buckets is atomic and all or nothing.
 *
 * @module
 */
import type { RateBucket, RateLimiter, RateTake } from "../../src/contract.ts";
import { checkKnownOptions } from "../../src/options.ts";
import { gcraParams } from "../../src/rate_limit.ts";
import { showValue as show } from "../../src/show.ts";
import type { RedisCommands } from "./clients.ts";
import { evalScript, sha1Hex } from "./runner.ts";
import { slotGuard } from "./lua.ts";
import { resolveOptions } from "./options.ts";

/** Options of {@link RedisRateLimiter}. */
export interface RedisRateLimiterOptions {
  /** An `@upstash/redis`, `ioredis`, `redis` (node-redis) or Bun `RedisClient` client, or `RedisCommands`. */
  client: unknown;
  /** Every key starts with `{keyPrefix}rl:` (default `"botmesh:"`; one hash slot in a cluster). */
  keyPrefix?: string;
}

/** The slot guard of the backend's scripts (see `slotGuard`), on the tag of the first bucket's key, then the server's clock. */
const NOW = `local TAG = string.match(KEYS[1], '^{[^}]*}')
${slotGuard("TAG")}local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000`;

/** KEYS: the buckets; ARGV: interval and tolerance of each → {1} or {0, wait, index of the bucket} (gcraStep of src/rate_limit.ts). */
const TAKE = `${NOW}
local worst, at, nexts = 0, 0, {}
for i, k in ipairs(KEYS) do
  local interval, tol = tonumber(ARGV[2 * i - 1]), tonumber(ARGV[2 * i])
  local from = math.max(tonumber(redis.call('GET', k) or '0'), now)
  local wait = from - tol - now
  if wait > worst then worst, at = wait, i end
  nexts[i] = from + interval
end
if worst > 0 then return {0, string.format('%.3f', worst), at} end
for i, k in ipairs(KEYS) do
  redis.call('SET', k, string.format('%.3f', nexts[i]), 'PX', math.ceil(nexts[i] - now) + 1000)
end
return {1}`;

/** KEYS[1]: the bucket; ARGV: ms to pause, its tolerance. */
const PAUSE = `${NOW}
local v = math.max(tonumber(redis.call('GET', KEYS[1]) or '0'), now + tonumber(ARGV[1]) + tonumber(ARGV[2]))
redis.call('SET', KEYS[1], string.format('%.3f', v), 'PX', math.ceil(v - now) + 1000)
return {1}`;

/**
 * The rate-limit buckets of every replica in Redis.
 *
 * @example
 * ```ts ignore
 * import Redis from "ioredis";
 * import { RedisRateLimiter } from "@botmesh/durable/redis";
 * const limiter = new RedisRateLimiter({ client: new Redis(process.env.REDIS_URL!) });
 * // new Bot({ provider, durability: { backend, outbox: { rateLimit: { limiter } } } })
 * ```
 */
export class RedisRateLimiter implements RateLimiter {
  readonly name = "redis";
  readonly scope = "shared" as const;
  readonly #commands: RedisCommands;
  readonly #tag: string;
  readonly #shas = new Map<string, Promise<string>>();

  /**
   * @param options the client and key prefix
   * @throws {TypeError} naming the option for a client of no known kind or an unknown option
   * @throws {RangeError} naming the option for a bad key prefix
   */
  constructor(options: RedisRateLimiterOptions) {
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`RedisRateLimiter options must be an object with a "client", got ${show(options)}`);
    }
    checkKnownOptions(options, ["client", "keyPrefix"], "RedisRateLimiter option");
    const resolved = resolveOptions(options, "RedisRateLimiter");
    this.#commands = resolved.commands;
    this.#tag = `{${resolved.keyPrefix}}rl:`;
  }

  async #eval(script: string, keys: string[], args: string[]): Promise<unknown> {
    let sha = this.#shas.get(script);
    if (sha === undefined) this.#shas.set(script, sha = sha1Hex(script));
    return await evalScript(this.#commands, script, await sha, keys, args);
  }

  /** @inheritdoc */
  async take(buckets: readonly RateBucket[]): Promise<RateTake> {
    if (buckets.length === 0) return { ok: true };
    const args: string[] = [];
    for (const b of buckets) {
      const { interval, tolerance } = gcraParams(b);
      args.push(String(interval), String(tolerance));
    }
    const reply = await this.#eval(TAKE, buckets.map((b) => this.#tag + b.key), args);
    if (!Array.isArray(reply)) throw new Error(`RedisRateLimiter: unexpected reply ${show(reply)}`);
    if (Number(reply[0]) === 1) return { ok: true };
    const bucket = buckets[Number(reply[2]) - 1] ?? buckets[0]!;
    return { ok: false, waitMs: Math.max(0, Number(reply[1])), key: bucket.key };
  }

  /** @inheritdoc */
  async pause(bucket: RateBucket, ms: number): Promise<void> {
    const { tolerance } = gcraParams(bucket);
    await this.#eval(PAUSE, [this.#tag + bucket.key], [String(Math.max(0, ms)), String(tolerance)]);
  }
}
