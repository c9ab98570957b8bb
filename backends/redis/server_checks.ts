/**
 * What a Redis server must be configured for before a journal lives in it:
 * no eviction of keys under memory pressure (refused unless accepted), and
 * persistence (a warning when the server keeps nothing on disk).
 *
 * @module
 */
import type { OpenWarning } from "../../src/contract.ts";
import type { RedisCommands } from "./clients.ts";

/**
 * `CONFIG GET` answers as a flat list (`[name, value]`, RESP2) or a map
 * (RESP3, node-redis): the value of `name`, or `undefined`.
 */
function configValue(reply: unknown, name: string): string | undefined {
  if (Array.isArray(reply)) {
    for (let i = 0; i + 1 < reply.length; i += 2) if (String(reply[i]) === name) return String(reply[i + 1]);
    return undefined;
  }
  if (reply !== null && typeof reply === "object") {
    const value = reply instanceof Map ? reply.get(name) : (reply as Record<string, unknown>)[name];
    return value === undefined ? undefined : String(value);
  }
  return undefined;
}

/**
 * Reads the server's eviction and persistence settings with `CONFIG GET`
 * where the client can send it and the server allows it (managed services
 * and Upstash often do not: then nothing is checked).
 *
 * @param commands the client's commands
 * @param where how errors name the backend (its key prefix)
 * @param allowEviction accept an evicting `maxmemory-policy`
 * @param warn receives the warning about persistence
 * @throws {Error} when `maxmemory-policy` evicts keys and `allowEviction` is not set
 */
export async function checkRedisServer(
  commands: RedisCommands,
  where: string,
  allowEviction: boolean,
  warn: ((warning: OpenWarning) => void) | undefined,
): Promise<void> {
  if (typeof commands.command !== "function") return;
  const get = async (name: string): Promise<string | undefined> => {
    try {
      return configValue(await commands.command!(["CONFIG", "GET", name]), name);
    } catch {
      return undefined; // CONFIG not allowed (ACLs, a managed service): nothing to check
    }
  };
  const [policy, maxmemory] = await Promise.all([get("maxmemory-policy"), get("maxmemory")]);
  // Without a memory limit (maxmemory 0) nothing is ever evicted, whatever the policy.
  if (policy !== undefined && policy !== "noeviction" && maxmemory !== "0" && !allowEviction) {
    throw new Error(
      `Redis ${where} evicts keys under memory pressure (maxmemory-policy "${policy}", maxmemory ${maxmemory ?? "unknown"}): journal records could ` +
        `vanish without a trace. Set maxmemory-policy to "noeviction" (redis.conf, or CONFIG SET maxmemory-policy ` +
        `noeviction), or pass allowEviction: true to accept it`,
    );
  }
  if (warn === undefined) return;
  const [appendonly, save] = await Promise.all([get("appendonly"), get("save")]);
  if (appendonly === "no" && save !== undefined && save.trim() === "") {
    warn({
      code: "journal-not-durable",
      message: `Redis ${where} keeps nothing on disk (appendonly "no", save ""): the journal is lost when Redis ` +
        `restarts. Turn on appendonly (appendfsync everysec or always) to keep it`,
    });
  }
}
