// Every options object a user writes is checked for unknown keys: a typo ("fsyc: false") fails at
// once, naming the key, instead of leaving the default silently in force.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { Bot, MemoryDurability, MemoryRateLimiter } from "../mod.ts";
import { basicAuth, durabilityConsole, prometheusMetrics } from "../ops.ts";
import { MockProvider } from "../testing.ts";
import { KvDurability } from "../backends/kv/mod.ts";
import { MemoryKv } from "../backends/memory/mod.ts";
import { FileDurability } from "../backends/file/mod.ts";
import { SQLiteDurability, SQLiteStore } from "../backends/sqlite/mod.ts";
import { EventsDurability, FileEventJournal, MemoryEventJournal, SharedFileEventJournal } from "../backends/events/mod.ts";
import { PostgresDurability, PostgresKv, PostgresRateLimiter, PostgresStore } from "../backends/postgres/mod.ts";
import { fromIoredis, RedisDurability, RedisKv, RedisRateLimiter, RedisStore } from "../backends/redis/mod.ts";
import { TelegramProvider } from "../providers/telegram/mod.ts";
import { WhatsAppProvider } from "../providers/whatsapp/mod.ts";
import { durable } from "../providers/grammy/mod.ts";
import { Bot as GrammyBot } from "grammy";

const dir = mkdtempSync(join(tmpdir(), "botmesh-options-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const sql = { unsafe: () => Promise.resolve([]) } as never;
const client = fromIoredis({} as never);
const provider = new MockProvider();
const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "options-test" } });
const bogus = { bogus: 1 } as Record<string, unknown>;

const constructors: [string, () => unknown][] = [
  ["Bot", () => new Bot({ provider, ...bogus } as never)],
  ["Bot durability", () => new Bot({ provider, durability: { backend: new MemoryDurability(), ...bogus } } as never)],
  ["Bot durability.outbox", () => new Bot({ provider, durability: { backend: new MemoryDurability(), outbox: bogus } } as never)],
  [
    "Bot durability.outbox.rateLimit",
    () => new Bot({ provider, durability: { backend: new MemoryDurability(), outbox: { rateLimit: bogus } } } as never),
  ],
  [
    "Bot durability.outbox.rateLimit.global",
    () => new Bot({ provider, durability: { backend: new MemoryDurability(), outbox: { rateLimit: { global: { count: 1, perMs: 1, ...bogus } } } } } as never),
  ],
  ["MemoryRateLimiter", () => new MemoryRateLimiter(bogus as never)],
  ["PostgresRateLimiter", () => new PostgresRateLimiter({ sql, ...bogus } as never)],
  ["RedisRateLimiter", () => new RedisRateLimiter({ client, ...bogus } as never)],
  ["MemoryDurability", () => new MemoryDurability(bogus as never)],
  ["MemoryKv", () => new MemoryKv(bogus as never)],
  ["KvDurability", () => new KvDurability(new MemoryKv(), bogus as never)],
  ["FileDurability", () => new FileDurability({ path: join(dir, "f.json"), ...bogus } as never)],
  ["SQLiteDurability", () => new SQLiteDurability({ file: join(dir, "s.db"), ...bogus } as never)],
  ["SQLiteStore", () => new SQLiteStore({ file: join(dir, "s.db"), ...bogus } as never)],
  ["MemoryEventJournal", () => new MemoryEventJournal(bogus as never)],
  ["EventsDurability", () => new EventsDurability({ journal: new MemoryEventJournal(), ...bogus } as never)],
  ["PostgresDurability", () => new PostgresDurability({ sql, ...bogus } as never)],
  ["PostgresStore", () => new PostgresStore({ sql, ...bogus } as never)],
  ["PostgresKv", () => new PostgresKv({ sql, ...bogus } as never)],
  ["RedisDurability", () => new RedisDurability({ client, ...bogus } as never)],
  ["RedisStore", () => new RedisStore({ client, ...bogus } as never)],
  ["RedisKv", () => new RedisKv({ client, ...bogus } as never)],
  ["TelegramProvider", () => new TelegramProvider({ token: "123456:ABC-DEF", ...bogus } as never)],
  [
    "WhatsAppProvider",
    () => new WhatsAppProvider({ accessToken: "t", phoneNumberId: "1", appSecret: "s", verifyToken: "v", ...bogus } as never),
  ],
  ["durable (grammY)", () => durable(new GrammyBot("123456:ABC-DEF"), { durability: { backend: new MemoryDurability() }, ...bogus } as never)],
  ["durabilityConsole", () => durabilityConsole(bot, { auth: basicAuth("ops", "a-long-password"), ...bogus } as never)],
];

const openers: [string, () => Promise<unknown>][] = [
  ["FileEventJournal.open", () => FileEventJournal.open(join(dir, "e.json"), { lock: true, ...bogus } as never)],
  ["SharedFileEventJournal.open", () => SharedFileEventJournal.open(join(dir, "se.json"), bogus as never)],
  ["SharedFileEventJournal.open appendLog", () => SharedFileEventJournal.open(join(dir, "se.json"), { appendLog: bogus } as never)],
  ["prometheusMetrics", () => prometheusMetrics(bot, bogus as never)],
];

const UNKNOWN = /Unknown .*"([\w.]+\.)?bogus"; known options/;

describe("an unknown option is refused, naming it", () => {
  for (const [name, make] of constructors) {
    test(name, () => {
      expect(make).toThrow(TypeError);
      expect(make).toThrow(UNKNOWN);
    });
  }
  for (const [name, open] of openers) {
    test(name, async () => {
      const error = await open().then(() => null, (e: unknown) => e);
      expect(error).toBeInstanceOf(TypeError);
      expect((error as Error).message).toMatch(UNKNOWN);
    });
  }
});
