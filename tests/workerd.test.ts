/**
 * The library in Cloudflare's runtime, for real: the Workers of tests/fixtures/workerd/, bundled for
 * the browser target, served by workerd, take Telegram webhooks (replies go to the fake Bot API) and
 * journal
 * - in Redis through `@upstash/redis` (fetch) against the Upstash REST bridge, with no compatibility
 *   flag (no Node.js APIs at all);
 * - in PostgreSQL through porsager's `postgres` over `cloudflare:sockets` (`nodejs_compat`: that
 *   client's Workers build needs `node:buffer`, `node:events`, `node:stream`).
 */
import { afterAll, beforeAll, describe, expect, test } from "bun:test";
import { spawn, spawnSync, type ChildProcess } from "node:child_process";
import { existsSync } from "node:fs";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { RedisClient } from "bun";
import postgres from "postgres";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { freePort, POSTGRES_URL, REDIS_URL, runId, SERVICES_REQUIRED, serviceSkip } from "./support/services.ts";
import { startUpstashBridge, type UpstashBridge } from "./support/upstash_bridge.ts";

const ROOT = join(import.meta.dir, "..");
const FIXTURES = join(ROOT, "tests", "fixtures", "workerd");
const BINARY = join(ROOT, "node_modules", "@cloudflare", "workerd-linux-64", "bin", "workerd");
const SECRET = "workerd-secret";

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


/** A Worker that runs the `scheduled` handler of the one bound as MAIN and answers its outcome. */
const TRIGGER = `export default {
  async fetch(request, env) {
    return Response.json(await env.MAIN.scheduled({ cron: "*/5 * * * *" }));
  },
};
`;

/** A Worker served by workerd on loopback. */
interface ServedWorker {
  readonly url: string;
  /** POST here to run the Worker's `scheduled` handler (through a service binding's `scheduled()`). */
  readonly scheduledUrl: string;
  /** What workerd printed so far. */
  output(): string;
  stop(): Promise<void>;
}

/**
 * Bundles `entry` and serves it with workerd; its outbound fetches and sockets may reach loopback.
 *
 * @param entry the Worker module, under tests/fixtures/workerd
 * @param bindings text bindings
 * @param flags compatibility flags
 * @returns the running Worker
 */
async function serveWorker(entry: string, bindings: Record<string, string>, flags: string[] = []): Promise<ServedWorker> {
  const dir = await mkdtemp(join(tmpdir(), "botmesh-workerd-"));
  const built = await Bun.build({
    entrypoints: [join(FIXTURES, entry)],
    target: "browser",
    format: "esm",
    conditions: ["workerd", "worker"],
    external: ["node:*", "cloudflare:*"],
  });
  if (!built.success) throw new AggregateError(built.logs, `bundling ${entry} failed`);
  await writeFile(join(dir, "worker.js"), await built.outputs[0]!.text());
  const port = await freePort();
  const triggerPort = await freePort();
  await writeFile(join(dir, "trigger.js"), TRIGGER);
  const text = (value: string): string => JSON.stringify(value);
  await writeFile(join(dir, "config.capnp"), `using Workerd = import "/workerd/workerd.capnp";
const config :Workerd.Config = (
  services = [
    (name = "main", worker = .bot),
    (name = "loopback", network = (allow = ["local", "private", "public"])),
    (name = "trigger", worker = .trigger),
  ],
  sockets = [
    (name = "http", address = ${text(`127.0.0.1:${port}`)}, http = (), service = "main"),
    (name = "trigger", address = ${text(`127.0.0.1:${triggerPort}`)}, http = (), service = "trigger"),
  ],
);
const trigger :Workerd.Worker = (
  modules = [(name = "trigger.js", esModule = embed "trigger.js")],
  compatibilityDate = "2025-09-01",
  compatibilityFlags = ["service_binding_extra_handlers"],
  bindings = [(name = "MAIN", service = "main")],
);
const bot :Workerd.Worker = (
  modules = [(name = "worker.js", esModule = embed "worker.js")],
  compatibilityDate = "2025-09-01",
  compatibilityFlags = [${flags.map(text).join(", ")}],
  globalOutbound = "loopback",
  bindings = [
${Object.entries(bindings).map(([name, value]) => `    (name = ${text(name)}, text = ${text(value)}),`).join("\n")}
  ],
);
`);
  let output = "";
  const child: ChildProcess = spawn(BINARY, ["serve", join(dir, "config.capnp"), "--verbose", "--experimental"], { stdio: ["ignore", "pipe", "pipe"] });
  child.stdout!.on("data", (chunk: Buffer) => (output += chunk.toString()));
  child.stderr!.on("data", (chunk: Buffer) => (output += chunk.toString()));
  const exited = new Promise<void>((resolve) => child.once("exit", () => resolve()));
  const stop = async (): Promise<void> => {
    if (child.exitCode === null && child.signalCode === null) {
      child.kill("SIGTERM");
      await exited;
    }
    await rm(dir, { recursive: true, force: true });
  };
  const url = `http://127.0.0.1:${port}`;
  const deadline = Date.now() + 60_000;
  for (;;) {
    if (child.exitCode !== null) {
      await stop();
      throw new Error(`workerd exited (${child.exitCode}):\n${output}`);
    }
    if (await fetch(url).then(() => true, () => false)) break;
    if (Date.now() > deadline) {
      await stop();
      throw new Error(`workerd did not listen within 60 s:\n${output}`);
    }
    await Bun.sleep(100);
  }
  return { url, scheduledUrl: `http://127.0.0.1:${triggerPort}`, output: () => output, stop };
}

const post = (url: string, update: Record<string, unknown>, secret = SECRET): Promise<Response> =>
  fetch(url, {
    method: "POST",
    headers: { "content-type": "application/json", "x-telegram-bot-api-secret-token": secret },
    body: JSON.stringify(update),
  });

async function until(what: string, check: () => boolean, detail: () => string | Promise<string>): Promise<void> {
  const deadline = Date.now() + 30_000;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}: ${await detail()}`);
    await Bun.sleep(50);
  }
}

const replies = (fake: FakeTelegram) => fake.sent.map((s) => [s.method, s.chatId, s.params.text]);

const noWorkerd = workerdSkip();
if (noWorkerd) console.warn(`skipping tests/workerd.test.ts: ${noWorkerd}`);
const redisSkip = noWorkerd || (await serviceSkip("redis"));
const pgSkip = noWorkerd || (await serviceSkip("postgres"));

describe.skipIf(redisSkip !== false)("workerd: a Telegram webhook Worker journaling in Redis over Upstash REST, no compatibility flag", () => {
  const keyPrefix = `workerd:${runId()}:`;
  let fake: FakeTelegram;
  let bridge: UpstashBridge;
  let redis: RedisClient;
  let worker: ServedWorker | undefined;

  async function* scan(pattern: string): AsyncGenerator<string> {
    let cursor = "0";
    do {
      const [next, keys] = (await redis.send("SCAN", [cursor, "MATCH", pattern, "COUNT", "1000"])) as [string, string[]];
      cursor = next;
      yield* keys;
    } while (cursor !== "0");
  }

  async function records(kind: "in" | "out"): Promise<Record<string, string>[]> {
    const found: Record<string, string>[] = [];
    for await (const key of scan(`{${keyPrefix}}${kind}:r:*`)) found.push((await redis.hgetall(key)) as Record<string, string>);
    return found;
  }

  const detail = async () =>
    `Bot API calls ${JSON.stringify(fake.calls.map((c) => [c.method, c.status]))}; ` +
    `outbox ${JSON.stringify(await records("out"))}; workerd said:\n${worker?.output()}`;

  beforeAll(async () => {
    fake = new FakeTelegram().start();
    bridge = await startUpstashBridge();
    redis = new RedisClient(REDIS_URL);
    worker = await serveWorker("worker.ts", {
      TELEGRAM_TOKEN: fake.token,
      TELEGRAM_SECRET: SECRET,
      TELEGRAM_API: fake.url,
      UPSTASH_URL: bridge.url,
      UPSTASH_TOKEN: bridge.token,
      KEY_PREFIX: keyPrefix,
    });
  }, 90_000);

  afterAll(async () => {
    await worker?.stop();
    if (redis) {
      for await (const key of scan(`{${keyPrefix}}*`)) await redis.del(key);
      redis.close();
    }
    await bridge?.stop();
    await fake?.stop();
  });

  test("updates are journaled, handled once and answered once; a redelivery is dropped", async () => {
    const update = fake.textUpdate(4201, "hello from workerd");
    expect((await post(worker!.url, update)).status).toBe(200);
    await until("the reply", () => fake.sent.length >= 1, detail);
    expect((await post(worker!.url, update)).status).toBe(200);
    expect((await post(worker!.url, fake.textUpdate(4202, "second chat"))).status).toBe(200);
    await until("the second reply", () => fake.sent.length >= 2, detail);
    expect(replies(fake)).toEqual([
      ["sendMessage", "4201", "You said: hello from workerd"],
      ["sendMessage", "4202", "You said: second chat"],
    ]);
    expect(fake.calls.filter((c) => c.method === "sendMessage")).toHaveLength(2);
    // The Worker answers the webhook first; the outcome of each update is written under waitUntil after
    // its reply went out.
    for (const deadline = Date.now() + 10_000; Date.now() < deadline; await Bun.sleep(50)) {
      if ((await records("in")).every((r) => r.state === "done")) break;
    }
    const inbox = await records("in");
    expect(inbox.map((r) => [r.chatId, r.state]).sort()).toEqual([["4201", "done"], ["4202", "done"]]);
    const outbox = await records("out");
    expect(outbox.map((r) => [r.chatId, r.state, r.called]).sort()).toEqual([["4201", "sent", "1"], ["4202", "sent", "1"]]);
  }, 60_000);

  test("the scheduled handler starts a bot (its recovery sweep reads the journal over Upstash) and settles", async () => {
    const requests = bridge.requests;
    const sent = fake.sent.length;
    const answer = await fetch(worker!.scheduledUrl, { method: "POST" });
    expect(await answer.json()).toEqual({ outcome: "ok", noRetry: false });
    expect(bridge.requests).toBeGreaterThan(requests);
    expect(fake.sent.length).toBe(sent);
  }, 30_000);

  test("a webhook with the wrong secret is refused and journals nothing", async () => {
    const before = (await records("in")).length;
    expect((await post(worker!.url, fake.textUpdate(4203, "intruder"), "wrong")).status).toBe(401);
    expect((await records("in")).length).toBe(before);
  }, 30_000);

  test("workerd reported no uncaught exception, hung request or cross-request promise", () => {
    expect(worker!.output()).not.toMatch(/uncaught|exception|hung|different request|error/i);
  });
});

describe.skipIf(pgSkip !== false)("workerd: the Worker journaling in PostgreSQL over cloudflare:sockets (nodejs_compat)", () => {
  const schema = `workerd_${runId()}`;
  let fake: FakeTelegram;
  let worker: ServedWorker | undefined;
  const sql = pgSkip === false ? postgres(POSTGRES_URL, { max: 1, onnotice: () => {} }) : null;

  beforeAll(async () => {
    fake = new FakeTelegram().start();
    worker = await serveWorker("postgres_worker.ts", {
      TELEGRAM_TOKEN: fake.token,
      TELEGRAM_SECRET: SECRET,
      TELEGRAM_API: fake.url,
      PG_URL: POSTGRES_URL,
      PG_SCHEMA: schema,
    }, ["nodejs_compat"]);
  }, 90_000);

  afterAll(async () => {
    await worker?.stop();
    await sql?.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
    await sql?.end();
    await fake?.stop();
  });

  test("updates are journaled, handled once and answered once; a redelivery is dropped", async () => {
    const detail = () => `Bot API calls ${JSON.stringify(fake.calls.map((c) => [c.method, c.status]))}; workerd said:\n${worker?.output()}`;
    const update = fake.textUpdate(4301, "hello over a socket");
    expect((await post(worker!.url, update)).status).toBe(200);
    await until("the reply", () => fake.sent.length >= 1, detail);
    expect((await post(worker!.url, update)).status).toBe(200);
    expect((await post(worker!.url, fake.textUpdate(4302, "second chat"))).status).toBe(200);
    await until("the second reply", () => fake.sent.length >= 2, detail);
    expect(replies(fake)).toEqual([
      ["sendMessage", "4301", "You said: hello over a socket"],
      ["sendMessage", "4302", "You said: second chat"],
    ]);
    // The outcomes are written under waitUntil, after the replies went out.
    const settled = () => sql!.unsafe(`SELECT count(*)::int AS n FROM "${schema}".botmesh_inbox WHERE state <> 'done'`);
    for (const deadline = Date.now() + 10_000; Date.now() < deadline; await Bun.sleep(50)) {
      if ((await settled())[0]!.n === 0) break;
    }
    const inbox = await sql!.unsafe(`SELECT chat_id, state FROM "${schema}".botmesh_inbox ORDER BY chat_id`);
    expect(inbox.map((r) => [r.chat_id, r.state])).toEqual([["4301", "done"], ["4302", "done"]]);
    const outbox = await sql!.unsafe(`SELECT chat_id, state FROM "${schema}".botmesh_outbox ORDER BY chat_id`);
    expect(outbox.map((r) => [r.chat_id, r.state])).toEqual([["4301", "sent"], ["4302", "sent"]]);
  }, 60_000);
  test("workerd reported no uncaught exception, hung request or cross-request promise", () => {
    expect(worker!.output()).not.toMatch(/uncaught|exception|hung|different request|error/i);
  });
});
