/** The setup the in-process tests of the grammY and Telegraf plugins share. */
import { afterEach } from "bun:test";
import type { DurabilityBackend } from "../../backend.ts";
import type { DurabilityOptions } from "../../src/config.ts";
import type { DurabilityControl } from "../../src/engine.ts";
import { MemoryDurability, MemoryStore, type SessionStore } from "../../mod.ts";
import { SQLiteStore } from "../../backends/sqlite/mod.ts";
import { join } from "node:path";

/**
 * Clean-ups run after each test of the file, the last pushed first.
 *
 * @returns the list to push them to
 */
export function cleanupsAfterEach(): (() => Promise<void> | void)[] {
  const cleanups: (() => Promise<void> | void)[] = [];
  afterEach(async () => {
    for (const cleanup of cleanups.splice(0).reverse()) await cleanup();
  });
  return cleanups;
}

/**
 * The durability of a plugin test: fast inbox and outbox retries, and Telegram's rate limits (the
 * provider's default) ten times faster.
 *
 * @param backend the backend
 * @param instanceId the instance id
 * @param retries the inbox's retries
 * @returns the `durability` option
 */
export function pluginTestDurability(backend: DurabilityBackend, instanceId: string, retries: number): DurabilityOptions {
  return {
    backend,
    instanceId,
    inbox: { retries, backoff: { baseMs: 10, capMs: 20 } },
    outbox: { backoff: { baseMs: 10, capMs: 20 }, rateLimit: { global: { count: 30, perMs: 100 }, perChat: { count: 1, perMs: 100 } } },
  };
}

/**
 * The keys in a durable bot's outbox, sorted.
 *
 * @param safe the durable bot
 * @returns the keys
 */
export async function outboxKeys(safe: { readonly durability: DurabilityControl }): Promise<string[]> {
  return (await safe.durability.outbox.list()).map((e) => e.key).sort();
}

/** A journal and a session store, for the session tests. */
export interface SessionBackends {
  readonly backend: DurabilityBackend;
  readonly store: SessionStore;
  close(): Promise<void> | void;
}

/**
 * The journals and session stores the session tests run on: memory (a MemoryStore), and SQLite (an
 * SQLiteStore for the journal and the sessions).
 *
 * @param dir where the SQLite files go
 * @returns kind → a fresh one
 */
export function sessionBackends(dir: string): Record<string, () => SessionBackends> {
  return {
    memory: () => ({ backend: new MemoryDurability(), store: new MemoryStore(), close: () => {} }),
    sqlite: () => {
      const store = new SQLiteStore({ file: join(dir, `${crypto.randomUUID()}.db`) });
      return { backend: store.durability(), store, close: () => store.close() };
    },
  };
}
