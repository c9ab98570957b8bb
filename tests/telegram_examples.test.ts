// The three Telegram webhook examples, each run as written in a real child process
// (bun / deno run -A / node on a bun-built bundle) against the fake Bot API server:
// an update POSTed with the secret gets its reply at the fake, a wrong secret gets 401,
// a redelivery is not answered twice. Each example stays under 40 lines. The README's
// bot (long polling on SQLite) is killed with SIGKILL mid-handler and started again.
import { afterAll, describe, expect, test } from "bun:test";
import { mkdirSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { childLines } from "./support/child_lines.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";

const root = join(import.meta.dir, "..");
const bin = (name: string) => join(root, "node_modules", ".bin", name);
const dir = join(tmpdir(), `botmesh-telegram-examples-${crypto.randomUUID()}`);
mkdirSync(dir, { recursive: true });
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const SECRET = "example-secret_123";
const pgSkip = await serviceSkip("postgres");

async function runExample(cmd: string[], env: Record<string, string>): Promise<void> {
  const fake = new FakeTelegram().start();
  const child = Bun.spawn(cmd, {
    cwd: root,
    env: { ...process.env, TELEGRAM_TOKEN: fake.token, TELEGRAM_SECRET: SECRET, TELEGRAM_API: fake.url, PORT: "0", ...env },
    stdout: "pipe",
    stderr: "pipe",
  });
  const stderr = new Response(child.stderr).text();
  try {
    const lines = childLines(child.stdout, cmd.join(" "), 15_000);
    const line = await lines.next("listening on ").catch(async (error) => {
      child.kill();
      throw new Error(`${error.message}\nstderr: ${await stderr}`);
    });
    const url = `http://127.0.0.1:${Number(line.slice("listening on ".length))}/telegram`;
    const update = fake.textUpdate(4242, "hello");
    expect(await fake.deliverWebhook(url, update, { secret: "wrong" })).toEqual([401]);
    expect(await fake.deliverWebhook(url, update, { secret: SECRET, attempts: 5, retryDelayMs: 100 })).toEqual([200]);
    await fake.until("the reply", () => fake.sent.length === 1, 15_000);
    expect(fake.sent[0]!).toMatchObject({ method: "sendMessage", chatId: "4242", messageId: 1 });
    expect(fake.sent[0]!.params.text).toBe("You said: hello");
    const photo = fake.mediaUpdate(4242, "photo", new TextEncoder().encode("JPEG")).update;
    expect(await fake.deliverWebhook(url, photo, { secret: SECRET })).toEqual([200]);
    expect(await fake.deliverWebhook(url, update, { secret: SECRET })).toEqual([200]); // a redelivery
    await fake.until("the second reply", () => fake.sent.length === 2, 15_000);
    expect(fake.sent[1]!.params.text).toBe("Got your image, thanks!");
  } finally {
    child.kill("SIGTERM");
    await child.exited;
    await fake.stop();
  }
  expect(fake.sent.length).toBe(2);
  // Bun and Node examples stop the bot on SIGTERM and exit 0; Deno's dies of the signal.
  if (!cmd[0]!.endsWith("deno")) expect(child.exitCode, await stderr).toBe(0);
}

describe("telegram examples", () => {
  test("each example is under 40 lines", () => {
    for (const name of ["telegram_bun.ts", "telegram_deno_postgres.ts", "telegram_node.ts"]) {
      const lines = readFileSync(join(root, "examples", name), "utf8").trimEnd().split("\n").length;
      expect(lines, name).toBeLessThan(40);
    }
  });

  test("the README's bot is examples/telegram_sqlite.ts (the same handler and durability lines)", () => {
    const readme = readFileSync(join(root, "README.md"), "utf8");
    const example = readFileSync(join(root, "examples", "telegram_sqlite.ts"), "utf8");
    const block = /```ts\n(import \{ Bot, TEXT \} from "@botmesh\/durable";[\s\S]*?)```/.exec(readme)?.[1];
    expect(block, "README.md has the Telegram + SQLite bot").toBeDefined();
    const shared = block!.split("\n").filter((line) => /^(bot\.|  await ctx|\}\);|  durability:|const bot)/.test(line));
    expect(shared.length).toBeGreaterThanOrEqual(8);
    for (const line of shared) expect(example, `examples/telegram_sqlite.ts lacks the README line ${line}`).toContain(line);
  });

  test("the README bot (examples/telegram_sqlite.ts, polling on SQLite) killed with SIGKILL mid-handler: every reply once", async () => {
    const fake = new FakeTelegram().start();
    const db = join(dir, "readme.db");
    const spawn = () =>
      Bun.spawn([bin("bun"), "examples/telegram_sqlite.ts"], {
        cwd: root,
        env: { ...process.env, TELEGRAM_TOKEN: fake.token, TELEGRAM_API: fake.url, BOT_DB: db },
        stdout: "pipe",
        stderr: "pipe",
      });
    const texts = () => fake.sent.filter((s) => s.method === "sendMessage").map((s) => String(s.params.text));
    let child = spawn();
    try {
      await childLines(child.stdout, "telegram_sqlite.ts", 15_000).next("running");
      fake.push(fake.textUpdate(4242, "hello"));
      await fake.until("the first reply", () => texts().length === 1, 15_000);
      child.kill("SIGKILL"); // inside the step's 3 s model call: the answer was never sent
      await child.exited;
      expect(texts()).toEqual(['Working on "hello"…']);
      child = spawn();
      await childLines(child.stdout, "telegram_sqlite.ts (restarted)", 15_000).next("running");
      await fake.until("the second reply", () => texts().length === 2, 15_000);
      await Bun.sleep(500); // a duplicate would come now
      // The cut-off step (idempotent) ran again; "Working on…" was answered from the outbox.
      expect(texts()).toEqual(['Working on "hello"…', 'You said "hello".']);
    } finally {
      child.kill("SIGINT");
      await child.exited;
      await fake.stop();
    }
  });

  test("Bun.serve on SQLite (bun examples/telegram_bun.ts)", async () => {
    await runExample([bin("bun"), "examples/telegram_bun.ts"], { BOT_DB: join(dir, "bun.db") });
  });

  test("node:http with nodeHandler on a file journal (bundled with bun build --target=node, run by Node 20)", async () => {
    const out = join(dir, "node-bundle");
    const build = Bun.spawnSync([bin("bun"), "build", "examples/telegram_node.ts", "--target=node", "--outdir", out], { cwd: root });
    expect(build.exitCode, build.stderr.toString()).toBe(0);
    await runExample(["node", join(out, "telegram_node.js")], { BOT_FILE: join(dir, "node.json") });
  });

  test.skipIf(pgSkip !== false)("Deno.serve on Postgres (deno run -A examples/telegram_deno_postgres.ts)", async () => {
    const schema = `bm_tg_${runId()}`;
    try {
      await runExample([bin("deno"), "run", "-A", "examples/telegram_deno_postgres.ts"], {
        DATABASE_URL: POSTGRES_URL,
        PG_SCHEMA: schema,
        DENO_NO_UPDATE_CHECK: "1",
      });
    } finally {
      const { default: postgres } = await import("postgres");
      const sql = postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
      await sql.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
      await sql.end();
    }
  });
});
