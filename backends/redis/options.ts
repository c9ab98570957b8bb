/**
 * The options of {@link RedisDurability}, {@link RedisStore} and
 * {@link RedisKv}, and their checks.
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import { showValue as show } from "../../src/show.ts";
import { type RedisCommands, toCommands } from "./clients.ts";

/** Options of {@link RedisDurability}, {@link RedisStore} and {@link RedisKv}. */
export interface RedisOptions {
  /**
   * The client: an `@upstash/redis` client, an `ioredis` client, a connected
   * `redis` (node-redis) client, a Bun `RedisClient`, or a {@link RedisCommands}. Required.
   */
  client: unknown;
  /**
   * Every key starts with `{keyPrefix}` (default `"botmesh:"`): 1 to 128
   * characters, without `{` or `}`. Give each bot (tenant, test run) its own.
   */
  keyPrefix?: string;
  /**
   * Accept a server whose `maxmemory-policy` evicts keys (anything but
   * `noeviction`), which `open()` otherwise refuses: evicted journal records
   * vanish without a trace. Default `false`.
   */
  allowEviction?: boolean;
  /**
   * The time every script uses, in ms since epoch (default: the server's clock, `TIME`). For tests on
   * simulated time (a `TestClock`): every process on the prefix must use the same clock. The scripts
   * then run in a variant that reads the time from the call's first key.
   */
  clock?: () => number;
}

/** Options of {@link RedisDurability}. */
export type RedisDurabilityOptions = RedisOptions;
/** Options of {@link RedisStore}. */
export type RedisStoreOptions = RedisOptions;
/** Options of {@link RedisKv}. */
export type RedisKvOptions = RedisOptions;

const OPTION_NAMES = ["client", "keyPrefix", "allowEviction", "clock"] as const;

/** The options checked: the client as commands, and the key prefix. */
export interface Resolved {
  commands: RedisCommands;
  keyPrefix: string;
  allowEviction: boolean;
  /** The test clock, or `undefined`: the server's. */
  clock?: () => number;
}

/** The options of the class `what` (named in errors), checked. */
export function resolveOptions(options: unknown, what: string): Resolved {
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`${what} options must be an object with a "client", got ${show(options)}`);
  }
  const o = options as Record<string, unknown>;
  checkKnownOptions(o, OPTION_NAMES, "Redis option");
  const commands = toCommands(o.client, `Redis option "client"`);
  const keyPrefix = o.keyPrefix ?? "botmesh:";
  if (typeof keyPrefix !== "string") {
    throw new TypeError(`Redis option "keyPrefix" must be a string, got ${show(keyPrefix)}`);
  }
  if (keyPrefix.length === 0 || keyPrefix.length > 128 || /[{}]/.test(keyPrefix)) {
    throw new RangeError(
      `Redis option "keyPrefix" must be 1 to 128 characters without "{" or "}", got ${show(keyPrefix)}`,
    );
  }
  const allowEviction = o.allowEviction ?? false;
  if (typeof allowEviction !== "boolean") {
    throw new TypeError(`Redis option "allowEviction" must be a boolean, got ${show(allowEviction)}`);
  }
  const clock = o.clock;
  if (clock !== undefined && typeof clock !== "function") {
    throw new TypeError(`Redis option "clock" must be a function returning ms since epoch, got ${show(clock)}`);
  }
  return { commands, keyPrefix, allowEviction, ...(clock ? { clock: clock as () => number } : {}) };
}
