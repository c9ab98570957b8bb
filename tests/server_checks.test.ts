// Servers configured to lose data: an evicting Redis is refused at open (unless accepted), a Redis that
// keeps nothing on disk and a Postgres with fsync or synchronous_commit off are reported as warnings.
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { spawn, type ChildProcess } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import Redis from "ioredis";
import postgres from "postgres";
import { Bot, MemoryDurability } from "../mod.ts";
import type { OpenWarning } from "../src/contract.ts";
import type { DurabilityWarning } from "../src/engine.ts";
import { RedisDurability } from "../backends/redis/mod.ts";
import { PostgresDurability } from "../backends/postgres/mod.ts";
import { checkPostgresServer } from "../backends/postgres/server_checks.ts";
import { MockProvider } from "../src/testing/mock_provider.ts";
import { freePort, POSTGRES_URL, runId, serviceSkip, SERVICES_REQUIRED, tcpReachable } from "./support/services.ts";


describe("a backend's warnings at open reach the bot", () => {
  test("each is emitted as a warning event before the bot runs", async () => {
    const inner = new MemoryDurability();
    const wrapped = {
      name: inner.name,
      scope: inner.scope,
      inbox: inner.inbox,
      outbox: inner.outbox,
      open: (warn?: (w: OpenWarning) => void) => {
        warn?.({ code: "journal-not-durable", message: "the test server keeps nothing" });
        return Promise.resolve();
      },
    };
    const bot = new Bot({ provider: new MockProvider(), durability: { backend: wrapped, instanceId: "checks" } });
    const warnings: DurabilityWarning[] = [];
    bot.on("warning", (w) => warnings.push(w));
    await bot.start();
    expect(warnings.filter((w) => w.code === "journal-not-durable").map((w) => w.message)).toEqual(["the test server keeps nothing"]);
    await bot.stop();
  });
});

// An own redis-server: the shared one's configuration is not ours to change.
const redisBinary = ["/usr/bin/redis-server", "/usr/local/bin/redis-server"].find((p) => Bun.file(p).size > 0);
const redisSkip = redisBinary ? false : (() => {
  if (SERVICES_REQUIRED) throw new Error("BOTMESH_REQUIRE_SERVICES=1 but redis-server is not installed");
  return "redis-server is not installed";
})();

describe.skipIf(redisSkip !== false)("Redis configured to evict or to keep nothing", () => {
  let server: ChildProcess;
  let port = 0;
  let dir = "";
  const clients: Redis[] = [];
  const client = () => {
    const c = new Redis({ host: "127.0.0.1", port, lazyConnect: false, maxRetriesPerRequest: 2 });
    clients.push(c);
    return c;
  };
  beforeAll(async () => {
    port = await freePort();
    dir = mkdtempSync(join(tmpdir(), "botmesh-redis-checks-"));
    server = spawn(
      redisBinary!,
      ["--bind", "127.0.0.1", "--port", String(port), "--dir", dir, "--save", "", "--appendonly", "no", "--maxmemory", "100mb", "--maxmemory-policy", "allkeys-lru"],
      { stdio: "ignore" },
    );
    for (let i = 0; i < 100 && !(await tcpReachable("127.0.0.1", port, 200)); i++) await Bun.sleep(50);
  });
  afterAll(async () => {
    for (const c of clients) c.disconnect();
    server?.kill("SIGKILL");
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  test("an evicting maxmemory-policy is refused at open, naming the policy and the way out", async () => {
    const backend = new RedisDurability({ client: client(), keyPrefix: `checks:${runId()}:` });
    const error = await backend.open().then(() => null, (e: Error) => e);
    expect(error?.message).toContain('maxmemory-policy "allkeys-lru", maxmemory 104857600');
    expect(error?.message).toContain("noeviction");
    expect(error?.message).toContain("allowEviction: true");
    // A bot does not start on it either.
    const bot = new Bot({ provider: new MockProvider(), durability: { backend, instanceId: "evicting" } });
    bot.on("error", () => {});
    expect(await bot.start().then(() => "started", (e: Error) => e.message)).toContain("maxmemory-policy");
  });

  test("allowEviction accepts it; a server that keeps nothing on disk is a warning, and none once it appends", async () => {
    const c = client();
    const backend = new RedisDurability({ client: c, keyPrefix: `checks:${runId()}:`, allowEviction: true });
    const warnings: OpenWarning[] = [];
    await backend.open((w) => warnings.push(w));
    expect(warnings.map((w) => w.code)).toEqual(["journal-not-durable"]);
    expect(warnings[0]!.message).toContain('appendonly "no", save ""');
    await c.config("SET", "maxmemory-policy", "noeviction");
    await c.config("SET", "appendonly", "yes");
    const quiet: OpenWarning[] = [];
    await new RedisDurability({ client: c, keyPrefix: `checks:${runId()}:` }).open((w) => quiet.push(w));
    expect(quiet).toEqual([]);
  });

  test("where CONFIG is refused (a managed service, ACLs), nothing is checked and the backend opens", async () => {
    const c = client();
    await c.config("SET", "maxmemory-policy", "volatile-lru");
    const commands = {
      evalsha: (sha: string, keys: string[], args: string[]) => c.evalsha(sha, keys.length, ...keys, ...args),
      scriptLoad: (script: string) => c.script("LOAD", script),
      command: () => Promise.reject(new Error("NOPERM this user has no permissions to run the 'config|get' command")),
    };
    await new RedisDurability({ client: commands, keyPrefix: `checks:${runId()}:` }).open();
    // The same server through a client that can send CONFIG is refused.
    const refused = await new RedisDurability({ client: c, keyPrefix: `checks:${runId()}:` }).open().then(() => null, (e: Error) => e.message);
    expect(refused).toContain('maxmemory-policy "volatile-lru"');
  });

  test("without a memory limit (maxmemory 0) no policy evicts: nothing is refused", async () => {
    const c = client();
    await c.config("SET", "maxmemory-policy", "allkeys-lru");
    await c.config("SET", "maxmemory", "0");
    try {
      await new RedisDurability({ client: c, keyPrefix: `checks:${runId()}:` }).open();
    } finally {
      await c.config("SET", "maxmemory", "100mb");
    }
  });

  test("allowEviction must be a boolean", () => {
    expect(() => new RedisDurability({ client: client(), allowEviction: "yes" as never })).toThrow(
      'Redis option "allowEviction" must be a boolean, got "yes"',
    );
  });
});

const pgSkip = await serviceSkip("postgres");

describe.skipIf(pgSkip !== false)("Postgres configured to confirm commits it may lose", () => {
  const admin = pgSkip ? null : postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
  const schemas: string[] = [];
  afterAll(async () => {
    for (const schema of schemas) await admin!.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
    await admin?.end();
  });

  test("synchronous_commit off for the client's sessions is a warning; the server's defaults are not", async () => {
    const [{ fsync, synchronous_commit }] = await admin!.unsafe("SELECT current_setting('fsync') AS fsync, current_setting('synchronous_commit') AS synchronous_commit");
    expect([fsync, synchronous_commit], "the test server is durable").toEqual(["on", "on"]);
    for (const [connection, expected] of [[{}, []], [{ synchronous_commit: "off" }, ["synchronous_commit = off"]]] as const) {
      const sql = postgres(POSTGRES_URL, { max: 2, onnotice: () => {}, connection });
      const schema = `bm_checks_${runId()}`;
      schemas.push(schema);
      const warnings: OpenWarning[] = [];
      try {
        await new PostgresDurability({ sql, schema }).open((w) => warnings.push(w));
      } finally {
        await sql.end();
      }
      expect(warnings.map((w) => w.message.match(/synchronous_commit = off|fsync = off/)?.[0])).toEqual([...expected]);
      for (const w of warnings) expect(w.message).toContain(`schema "${schema}"`);
    }
  });

  test("fsync off is a warning (a server that answers SHOW fsync with off)", async () => {
    const answers: Record<string, string> = { "SHOW fsync": "off", "SHOW synchronous_commit": "local" };
    const fake = {
      unsafe: (query: string) => Promise.resolve([{ [query.slice(5)]: answers[query] }]),
    };
    const warnings: OpenWarning[] = [];
    await checkPostgresServer(fake, "schema \"x\"", true, (w) => warnings.push(w));
    expect(warnings.map((w) => w.message.match(/fsync = off|synchronous_commit = off/)?.[0])).toEqual(["fsync = off"]);
    const refused = { unsafe: () => Promise.reject(new Error("permission denied")) };
    const none: OpenWarning[] = [];
    await checkPostgresServer(refused, "schema \"x\"", true, (w) => none.push(w));
    expect(none).toEqual([]);
  });
});
