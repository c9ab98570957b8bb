/**
 * The library in Cloudflare's runtime: tests/fixtures/workerd/worker.ts, bundled for the browser
 * target, served by workerd (no nodejs_compat), takes Telegram webhooks and journals in Redis through
 * `@upstash/redis` (fetch) against the Upstash REST bridge; replies go to the fake Bot API.
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { existsSync } from "node:fs";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { RedisClient } from "bun";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { REDIS_URL, runId, SERVICES_REQUIRED, serviceSkip } from "./support/services.ts";
import { startUpstashBridge, type UpstashBridge } from "./support/upstash_bridge.ts";

const ROOT = join(import.meta.dir, "..");
const BINARY = join(ROOT, "node_modules", "@cloudflare", "workerd-linux-64", "bin", "workerd");

/** Why workerd cannot run here (skip), or `false`; throws when it is installed but broken and services are required. */
function workerdSkip(): string | false {
  if (process.platform !== "linux" || process.arch !== "x64") return `workerd: this test runs the linux-64 binary, not ${process.platform}-${process.arch}`;
  if (!existsSync(BINARY)) return `workerd: the binary is not installed (${BINARY}); npm install`;
  const probe = spawnSync(BINARY, ["--version"], { encoding: "utf8", timeout: 30_000 });
  if (probe.status === 0) return false;
  const why = `workerd: the binary is installed but does not run (${probe.error?.message ?? probe.stderr.trim()})`;
  if (SERVICES_REQUIRED) throw new Error(why);
  return why;
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}

const capnpText = (value: string): string => JSON.stringify(value);

const skip = workerdSkip() || (await serviceSkip("redis"));
if (skip) console.warn(`skipping tests/workerd.test.ts: ${skip}`);

describe.skipIf(Boolean(skip))("workerd: a Telegram webhook Worker journaling in Redis over Upstash REST", () => {
  const secret = "workerd-secret";
  const keyPrefix = `workerd:${runId()}:`;
  let dir = "";
  let fake: FakeTelegram;
  let bridge: UpstashBridge;
  let workerd: ChildProcess | undefined;
  let output = "";
  let base = "";
  let redis: RedisClient;

  beforeAll(async () => {
    dir = await mkdtemp(join(tmpdir(), "botmesh-workerd-"));
    const built = await Bun.build({
      entrypoints: [join(ROOT, "tests", "fixtures", "workerd", "worker.ts")],
      target: "browser",
      format: "esm",
      external: ["node:*"],
    });
    if (!built.success) throw new AggregateError(built.logs, "bundling the Worker failed");
    await writeFile(join(dir, "worker.js"), await built.outputs[0]!.text());
    fake = new FakeTelegram().start();
    bridge = await startUpstashBridge();
    redis = new RedisClient(REDIS_URL);
    const port = await freePort();
    base = `http://127.0.0.1:${port}`;
    const bindings: Record<string, string> = {
      TELEGRAM_TOKEN: fake.token,
      TELEGRAM_SECRET: secret,
      TELEGRAM_API: fake.url,
      UPSTASH_URL: bridge.url,
      UPSTASH_TOKEN: bridge.token,
      KEY_PREFIX: keyPrefix,
    };
    const config = `using Workerd = import "/workerd/workerd.capnp";
const config :Workerd.Config = (
  services = [
    (name = "main", worker = .bot),
    (name = "loopback", network = (allow = ["local", "private", "public"])),
  ],
  sockets = [(name = "http", address = ${capnpText(`127.0.0.1:${port}`)}, http = (), service = "main")],
);
const bot :Workerd.Worker = (
  modules = [(name = "worker.js", esModule = embed "worker.js")],
  compatibilityDate = "2025-09-01",
  globalOutbound = "loopback",
  bindings = [
${Object.entries(bindings).map(([name, value]) => `    (name = ${capnpText(name)}, text = ${capnpText(value)}),`).join("\n")}
  ],
);
`;
    await writeFile(join(dir, "config.capnp"), config);
    const child = spawn(BINARY, ["serve", join(dir, "config.capnp"), "--verbose"], { stdio: ["ignore", "pipe", "pipe"] });
    workerd = child;
    child.stdout!.on("data", (chunk: Buffer) => (output += chunk.toString()));
    child.stderr!.on("data", (chunk: Buffer) => (output += chunk.toString()));
    const deadline = Date.now() + 60_000;
    for (;;) {
      if (child.exitCode !== null) throw new Error(`workerd exited (${child.exitCode}):\n${output}`);
      const ok = await fetch(base, { method: "GET" }).then(() => true, () => false);
      if (ok) break;
      if (Date.now() > deadline) throw new Error(`workerd did not listen within 60 s:\n${output}`);
      await Bun.sleep(100);
    }
  }, 90_000);

  afterAll(async () => {
    if (workerd && workerd.exitCode === null) {
      const exited = new Promise((resolve) => workerd!.once("exit", resolve));
      workerd.kill("SIGTERM");
      await exited;
    }
    for await (const key of scan(`{${keyPrefix}}*`)) await redis?.del(key);
    redis?.close();
    await bridge?.stop();
    await fake?.stop();
    if (dir) await rm(dir, { recursive: true, force: true });
  });

  async function* scan(pattern: string): AsyncGenerator<string> {
    if (!redis) return;
    let cursor = "0";
    do {
      const [next, keys] = (await redis.send("SCAN", [cursor, "MATCH", pattern, "COUNT", "1000"])) as [string, string[]];
      cursor = next;
      yield* keys;
    } while (cursor !== "0");
  }

  const post = (update: Record<string, unknown>, token = secret): Promise<Response> =>
    fetch(base, {
      method: "POST",
      headers: { "content-type": "application/json", "x-telegram-bot-api-secret-token": token },
      body: JSON.stringify(update),
    });

  async function until(what: string, check: () => boolean): Promise<void> {
    const deadline = Date.now() + 30_000;
    while (!check()) {
      if (Date.now() > deadline) {
        const states: string[] = [];
        for await (const key of scan(`{${keyPrefix}}*:r:*`)) states.push(`${key}=${JSON.stringify(await redis.hgetall(key))}`);
        throw new Error(
          `timed out waiting for ${what}; Bot API calls: ${JSON.stringify(fake.calls.map((c) => [c.method, c.status]))}; ` +
            `records: ${states.join(", ")}; workerd said:\n${output}`,
        );
      }
      await Bun.sleep(50);
    }
  }

  test("a webhook update is journaled, handled once and answered once; a redelivery is dropped", async () => {
    const update = fake.textUpdate(4201, "hello from workerd");
    const first = await post(update);
    expect(first.status, output).toBe(200);
    await until("the reply", () => fake.sent.length >= 1);
    const again = await post(update);
    expect(again.status, output).toBe(200);
    const other = fake.textUpdate(4202, "second chat");
    expect((await post(other)).status, output).toBe(200);
    await until("the second reply", () => fake.sent.length >= 2);
    // The redelivery was answered 200 after its admission said "duplicate": nothing more is coming.
    expect(fake.sent.map((s) => [s.method, s.chatId, s.params.text])).toEqual([
      ["sendMessage", "4201", "You said: hello from workerd"],
      ["sendMessage", "4202", "You said: second chat"],
    ]);
    expect(fake.calls.filter((c) => c.method === "sendMessage")).toHaveLength(2);

    const inbox: string[] = [];
    for await (const key of scan(`{${keyPrefix}}in:r:*`)) inbox.push(key);
    expect(inbox).toHaveLength(2);
    const states = await Promise.all(inbox.map((key) => redis.hget(key, "state")));
    expect(states).toEqual(["done", "done"]);
    const outbox: string[] = [];
    for await (const key of scan(`{${keyPrefix}}out:r:*`)) outbox.push(key);
    expect(outbox).toHaveLength(2);
    expect(await Promise.all(outbox.map((key) => redis.hget(key, "state")))).toEqual(["sent", "sent"]);
  }, 60_000);

  test("a webhook with the wrong secret is refused and journals nothing", async () => {
    const before: string[] = [];
    for await (const key of scan(`{${keyPrefix}}in:r:*`)) before.push(key);
    const response = await post(fake.textUpdate(4203, "intruder"), "wrong");
    expect(response.status).toBe(401);
    const after: string[] = [];
    for await (const key of scan(`{${keyPrefix}}in:r:*`)) after.push(key);
    expect(after.length).toBe(before.length);
  }, 30_000);
});
