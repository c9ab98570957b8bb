/**
 * The one small command interface the Redis backend needs
 * ({@link RedisCommands}: run a loaded script, load a script), and adapters
 * from the clients it supports: `@upstash/redis` (HTTP/fetch, for edge
 * workers), `ioredis`, `redis` (node-redis) and Bun's built-in `RedisClient`.
 * No client package is imported: the adapters use structural types only.
 *
 * @module
 */
import { showValue as show } from "../../src/show.ts";

/**
 * What the Redis backend sends to Redis: scripts only. Implement it to use a
 * client that has no adapter here.
 */
export interface RedisCommands {
  /**
   * `EVALSHA sha numkeys ...keys ...args`.
   * @returns the script's reply (the backend's scripts return one string)
   * @throws the server's error, whose message starts with `NOSCRIPT` when the script is not loaded
   */
  evalsha(sha: string, keys: string[], args: string[]): Promise<unknown>;
  /**
   * `SCRIPT LOAD script`.
   * @returns the script's SHA-1 (hex)
   */
  scriptLoad(script: string): Promise<unknown>;
  /**
   * Any other command (`CONFIG GET` at open, to check the server's configuration), where the client
   * can send one. Optional: without it the configuration is not checked.
   * @param args the command and its arguments, e.g. `["CONFIG", "GET", "maxmemory-policy"]`
   * @returns the reply
   */
  command?(args: string[]): Promise<unknown>;
}

/** The part of an `@upstash/redis` client the adapter uses. */
export interface UpstashLike {
  evalsha(sha: string, keys: string[], args: string[]): Promise<unknown>;
  scriptLoad(script: string): Promise<unknown>;
}

/** The part of an `ioredis` client the adapter uses. */
export interface IoredisLike {
  evalsha(sha: string, numkeys: number, ...keysAndArgs: string[]): Promise<unknown>;
  script(subcommand: "LOAD", script: string): Promise<unknown>;
  call(command: string, ...args: string[]): Promise<unknown>;
  /** A `Cluster` has it: its nodes (each an ioredis client). */
  nodes?(role?: "master" | "slave" | "all"): IoredisLike[];
}

/** The part of a `redis` (node-redis v4/v5) client the adapter uses. */
export interface NodeRedisLike {
  evalSha(sha: string, options: { keys: string[]; arguments: string[] }): Promise<unknown>;
  scriptLoad(script: string): Promise<unknown>;
  sendCommand(args: string[]): Promise<unknown>;
}

/** The part of Bun's `RedisClient` (`import { RedisClient } from "bun"`) the adapter uses. */
export interface BunRedisLike {
  send(command: string, args: string[]): Promise<unknown>;
  readonly connected: boolean;
}

/**
 * An adapter for an `@upstash/redis` client (`new Redis({ url, token })`).
 * Its automatic deserialization may be on or off: the backend reads both.
 *
 * @param client the Upstash client
 * @returns the commands over it
 * @example
 * ```ts ignore
 * import { Redis } from "@upstash/redis";
 * const commands = fromUpstash(new Redis({ url, token }));
 * ```
 */
export function fromUpstash(client: UpstashLike): RedisCommands {
  return {
    evalsha: (sha, keys, args) => client.evalsha(sha, keys, args),
    scriptLoad: (script) => client.scriptLoad(script),
  };
}

/**
 * An adapter for an `ioredis` client (`new Redis(url)`).
 *
 * @param client the ioredis client (a single node or a `Cluster`: scripts are
 *   loaded on every master, since `SCRIPT LOAD` has no key to route by)
 * @returns the commands over it
 * @example
 * ```ts ignore
 * import Redis from "ioredis";
 * const commands = fromIoredis(new Redis("redis://127.0.0.1:6379"));
 * ```
 */
export function fromIoredis(client: IoredisLike): RedisCommands {
  return {
    evalsha: (sha, keys, args) => client.evalsha(sha, keys.length, ...keys, ...args),
    command: (args) => client.call(args[0]!, ...args.slice(1)),
    // A Cluster routes a keyless SCRIPT LOAD to a random node, not the one the EVALSHA goes to
    // (the key prefix's slot): load it on every master, so whichever holds the slot (now, or after
    // a failover or resharding) has it.
    scriptLoad: async (script) => {
      const masters = typeof client.nodes === "function" ? client.nodes("master") : [];
      if (masters.length === 0) return await client.script("LOAD", script);
      const shas = await Promise.all(masters.map((node) => node.script("LOAD", script)));
      return shas[0];
    },
  };
}

/**
 * An adapter for a `redis` (node-redis) client (`createClient({ url })`,
 * connected with `await client.connect()`).
 *
 * @param client the node-redis client
 * @returns the commands over it
 * @example
 * ```ts ignore
 * import { createClient } from "redis";
 * const client = await createClient({ url: "redis://127.0.0.1:6379" }).connect();
 * const commands = fromNodeRedis(client);
 * ```
 */
export function fromNodeRedis(client: NodeRedisLike): RedisCommands {
  return {
    evalsha: (sha, keys, args) => client.evalSha(sha, { keys, arguments: args }),
    scriptLoad: (script) => client.scriptLoad(script),
    command: (args) => client.sendCommand(args),
  };
}

/**
 * An adapter for Bun's built-in `RedisClient`.
 *
 * @param client the Bun client
 * @returns the commands over it
 * @example
 * ```ts ignore
 * import { RedisClient } from "bun";
 * const commands = fromBunRedis(new RedisClient("redis://127.0.0.1:6379"));
 * ```
 */
export function fromBunRedis(client: BunRedisLike): RedisCommands {
  return {
    evalsha: (sha, keys, args) => client.send("EVALSHA", [sha, String(keys.length), ...keys, ...args]),
    scriptLoad: (script) => client.send("SCRIPT", ["LOAD", script]),
    command: (args) => client.send(args[0]!, args.slice(1)),
  };
}

function hasFunctions(value: object, ...names: string[]): boolean {
  return names.every((name) => typeof (value as Record<string, unknown>)[name] === "function");
}

/** Which client `value` is, or `null`. */
export function clientKind(value: unknown): "ioredis" | "node-redis" | "bun" | "upstash" | null {
  if ((typeof value !== "object" && typeof value !== "function") || value === null) return null;
  if (hasFunctions(value, "evalsha", "script", "call")) return "ioredis";
  if (hasFunctions(value, "evalSha", "scriptLoad", "sendCommand")) return "node-redis";
  if (hasFunctions(value, "send") && "connected" in value) return "bun";
  if (hasFunctions(value, "evalsha", "scriptLoad")) return "upstash"; // also a RedisCommands object
  return null;
}

/**
 * The commands over `client`, whichever supported client it is: an
 * `@upstash/redis`, `ioredis`, `redis` (node-redis) or Bun `RedisClient`, or
 * a {@link RedisCommands} object (used as it is).
 *
 * @param client the client
 * @param option how the error names it, e.g. `Redis option "client"`
 * @returns the commands
 * @throws {TypeError} naming the option when `client` is none of them
 */
export function toCommands(client: unknown, option: string): RedisCommands {
  switch (clientKind(client)) {
    case "ioredis":
      return fromIoredis(client as IoredisLike);
    case "node-redis":
      return fromNodeRedis(client as NodeRedisLike);
    case "bun":
      return fromBunRedis(client as BunRedisLike);
    case "upstash":
      return client as RedisCommands;
    default:
      throw new TypeError(
        `${option} must be an @upstash/redis client, an ioredis client, a node-redis (redis) client, a Bun RedisClient, ` +
          `or an object with evalsha(sha, keys, args) and scriptLoad(script), got ${show(client)}`,
      );
  }
}
