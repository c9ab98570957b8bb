/**
 * What the fixture bots of the plugins' kill tests share (tests/fixtures/grammy_*_bot.ts,
 * tests/fixtures/telegraf_*_bot.ts): their durability, the lines they print for the test, and their stop.
 * Nothing here imports bun:test: the fixtures run as processes of their own.
 */
import type { SQLiteStore } from "../../backends/sqlite/mod.ts";
import type { DurabilityOptions } from "../../src/config.ts";
import type { BotEvents } from "../../src/engine.ts";
import { writeLine } from "./stdout_line.ts";

/** What a fixture uses of a durable bot (grammY's or Telegraf's). */
export interface DurableFixtureBot {
  on<K extends keyof BotEvents & string>(event: K, listener: (payload: BotEvents[K]) => void): () => void;
  stop(): Promise<void>;
}

/**
 * The durability of a kill fixture on SQLite: an ambiguous send (killed during its call) is reported,
 * then sent again, so nothing is lost; Telegram's rate limits (the provider's default) 100 times
 * faster, as the tests stream hundreds of replies into a few chats, which at one a second per chat
 * would take minutes. The inbox keeps its defaults: the tests kill the bot every few hundred ms with a
 * backlog, and only handler runs count toward the crash-loop guard, not the claims of each restart's
 * recovery.
 *
 * @param store the SQLite store (journal and sessions)
 * @param instanceId the instance id
 * @returns the `durability` option
 */
export function killFixtureDurability(store: SQLiteStore, instanceId: string): DurabilityOptions {
  return {
    backend: store.durability(),
    instanceId,
    outbox: {
      onAmbiguous: "resend",
      backoff: { baseMs: 20, capMs: 200 },
      rateLimit: { global: { count: 30, perMs: 10 }, perChat: { count: 1, perMs: 10 } },
    },
  };
}

/**
 * Print the reports the kill tests read (blocking writes, so a SIGKILL never loses a written line):
 * `ambiguous <key>` for each `durability:ambiguous`, `dead <json>` for each `durability:dead`.
 *
 * @param safe the durable bot
 * @param reports which of them
 */
export function reportOnStdout(safe: DurableFixtureBot, reports: readonly ("ambiguous" | "dead")[]): void {
  if (reports.includes("ambiguous")) safe.on("durability:ambiguous", (send) => writeLine(`ambiguous ${send.key}`));
  if (reports.includes("dead")) safe.on("durability:dead", (dead) => writeLine(`dead ${JSON.stringify(dead)}`));
}

/**
 * On SIGTERM, stop the bot and close the store, then exit 0.
 *
 * @param safe the durable bot
 * @param store its store
 */
export function stopOnSigterm(safe: DurableFixtureBot, store: SQLiteStore): void {
  process.on("SIGTERM", async () => {
    await safe.stop();
    await store.close();
    process.exit(0);
  });
}
