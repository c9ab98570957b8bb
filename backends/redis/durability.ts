/**
 * RedisDurability: the inbox and outbox journals on Redis (see `mod.ts` for
 * the user documentation; the Lua scripts are in `lua.ts`).
 *
 * @module
 */
import type { DamagedRecords, DurabilityBackend, InboxJournal, OpenWarning, OutboxJournal } from "../../src/contract.ts";
import { RedisInbox } from "./inbox.ts";
import { type RedisDurabilityOptions, resolveOptions } from "./options.ts";
import { RedisOutbox } from "./outbox.ts";
import { Runner } from "./runner.ts";
import { checkRedisServer } from "./server_checks.ts";

/**
 * The options objects made by {@link durabilityOn}, with the runner each
 * stands for: the constructor takes that runner instead of making its own.
 */
const sharedRunners = new WeakMap<object, Runner>();

/**
 * A backend over `runner` (for {@link RedisStore.durability}, which shares its
 * client and prefix): the public constructor, given options that stand for `runner`.
 */
export function durabilityOn(runner: Runner): RedisDurability {
  const options: RedisDurabilityOptions = { client: null };
  sharedRunners.set(options, runner);
  return new RedisDurability(options);
}

/**
 * A durability backend on Redis: the inbox and outbox journals, shared by
 * many replicas on many hosts (`scope: "shared"`). Every transition is one
 * atomic Lua script with the server's clock and the fencing check inside;
 * due scans read sorted sets of due entries only (and the inbox scan the
 * active records of their chats).
 *
 * An inbox due scan leases in arrival order (`receivedAt`, then admission
 * order) and keeps each chat's order through a failover: it walks the chat's
 * active records from the first, and takes none after one that is
 * `processing` under a live lease held elsewhere (see
 * `InboxJournal.claimDue`). Being one script, two concurrent scans never
 * split a chat. Records of chats held elsewhere do not fill the batch: the
 * pending backlog is read on, page by page, up to `limit + 1000` records a
 * scan. See the module documentation for the clients and the key layout.
 *
 * A damaged record (a hash this library did not write: a payload that is not
 * JSON, an unknown state, …) never fails a call nor stalls its chat: the
 * first call that meets it sets it aside, its hash kept as it is. `list` and
 * due scans go on without it, `get` rejects with a `DamagedRecordError`, and
 * `inbox.damaged()`/`outbox.damaged()` list what was set aside (the bot
 * reports each one once as an `error` event).
 *
 * The backend does not own the client: `open()` checks that Redis answers
 * (and runs Lua), `close()` does nothing; close the client after `bot.stop()`.
 *
 * @example With a TCP client (ioredis)
 * ```ts ignore
 * import Redis from "ioredis";
 * import { Bot } from "@botmesh/durable";
 * import { RedisDurability } from "@botmesh/durable/redis";
 *
 * const client = new Redis(process.env.REDIS_URL!);
 * const bot = new Bot({
 *   provider,
 *   durability: { backend: new RedisDurability({ client, keyPrefix: "shop-bot:" }), instanceId: "bot-1" },
 * });
 * await bot.start();
 * // …
 * await bot.stop();
 * client.disconnect();
 * ```
 *
 * @example With Upstash (edge workers)
 * ```ts ignore
 * import { Redis } from "@upstash/redis";
 * import { RedisDurability } from "@botmesh/durable/redis";
 *
 * const backend = new RedisDurability({ client: Redis.fromEnv(), keyPrefix: "shop-bot:" });
 * await backend.open();
 * const id = crypto.randomUUID();
 * await backend.inbox.admit({ id, kind: "message", chatId: "c1", provider: "test", payload: { text: "hi" }, receivedAt: Date.now() });
 * const record = await backend.inbox.claim(id, { owner: "edge-1", incarnation: "a", leaseMs: 60_000 });
 * await backend.inbox.complete(id, record!.lease!.token);
 * console.log((await backend.inbox.get(id))?.state); // "done"
 * ```
 */
export class RedisDurability implements DurabilityBackend {
  /** Always `'redis'`. */
  readonly name: string = "redis";
  /** Shared by many replicas on many hosts. */
  readonly scope: "shared" = "shared";
  /** The inbound journal. */
  readonly inbox: InboxJournal & DamagedRecords;
  /** The outbound journal. */
  readonly outbox: OutboxJournal & DamagedRecords;
  /** The key prefix (inside the hash tag: keys start with `{keyPrefix}`). */
  readonly keyPrefix: string;
  readonly #runner: Runner;

  /**
   * @param options `client` (required), `keyPrefix`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: RedisDurabilityOptions) {
    const runner = sharedRunners.get(options) ?? new Runner(resolveOptions(options, "RedisDurability"));
    this.#runner = runner;
    this.keyPrefix = runner.keyPrefix;
    this.inbox = new RedisInbox(runner);
    this.outbox = new RedisOutbox(runner);
  }

  /**
   * Checks that Redis answers and runs the backend's scripts (loading them when needed), then the
   * server's configuration where `CONFIG GET` is allowed: an evicting `maxmemory-policy` is refused
   * (unless `allowEviction`), and a server that keeps nothing on disk is reported to `warn`.
   * @param warn receives what the bot reports as a `warning` (`journal-not-durable`)
   * @throws {Error} naming the key prefix and the client's error when Redis does not answer, or the
   *   eviction policy when it evicts keys
   */
  async open(warn?: (warning: OpenWarning) => void): Promise<void> {
    await this.#runner.now();
    await checkRedisServer(this.#runner.commands, `(key prefix ${JSON.stringify(this.keyPrefix)})`, this.#runner.allowEviction, warn);
  }

  /** Nothing to release: the client is the caller's. */
  async close(): Promise<void> {}

  /**
   * The server's clock.
   * @returns ms since epoch by Redis `TIME`
   */
  now(): Promise<number> {
    return this.#runner.now();
  }
}
