// examples/deno_deploy.ts run as Deno Deploy would allow (`--allow-net --allow-env`, no file system)
// against Postgres and the fake Bot API: a webhook request answers only once its reply went out; a
// reply refused with a 502 stays due in the journal (no timer retries it) until a sweep is asked for.
import { expect, test } from "bun:test";
import { join } from "node:path";
import { childLines } from "./support/child_lines.ts";
import { FakeTelegram } from "./support/fake_telegram.ts";
import { POSTGRES_URL, runId, serviceSkip } from "./support/services.ts";

const root = join(import.meta.dir, "..");
const SECRET = "example-secret_123";
const SWEEP_SECRET = "sweep-secret_456";
const pgSkip = await serviceSkip("postgres");

test.skipIf(pgSkip !== false)("deno run --allow-net --allow-env examples/deno_deploy.ts: settled before the answer, retries only on a sweep", async () => {
  const schema = `bm_deploy_${runId()}`;
  const fake = new FakeTelegram().start();
  const child = Bun.spawn([join(root, "node_modules", ".bin", "deno"), "run", "--allow-net", "--allow-env", "examples/deno_deploy.ts"], {
    cwd: root,
    env: {
      ...process.env,
      TELEGRAM_TOKEN: fake.token,
      TELEGRAM_SECRET: SECRET,
      TELEGRAM_API: fake.url,
      PORT: "0",
      DATABASE_URL: POSTGRES_URL,
      PG_SCHEMA: schema,
      SWEEP_PATH: "/cron/sweep",
      SWEEP_SECRET,
      DENO_NO_UPDATE_CHECK: "1",
    },
    stdout: "pipe",
    stderr: "pipe",
  });
  const stderr = new Response(child.stderr).text();
  try {
    const lines = childLines(child.stdout, "deno_deploy.ts", 30_000);
    const line = await lines.next("listening on ").catch(async (error) => {
      child.kill();
      throw new Error(`${error.message}\nstderr: ${await stderr}`);
    });
    const base = `http://127.0.0.1:${Number(line.slice("listening on ".length))}`;
    expect(await fake.deliverWebhook(`${base}/telegram`, fake.textUpdate(4242, "hello"), { secret: SECRET })).toEqual([200]);
    expect(fake.sent.map((s) => s.params.text), "the reply went out before the request was answered").toEqual(["You said: hello"]);

    fake.inject("sendMessage", { kind: "status", status: 502 });
    expect(await fake.deliverWebhook(`${base}/telegram`, fake.textUpdate(4242, "again"), { secret: SECRET })).toEqual([200]);
    await Bun.sleep(3_000); // the first retry's backoff (under 1 s by default) passes; no timer retries it
    expect(fake.sent.length, "no retry without a sweep").toBe(1);

    const sweep = (secret: string) =>
      fetch(`${base}/cron/sweep`, { method: "POST", headers: { authorization: `Bearer ${secret}` } }).then((r) => r.status);
    expect(await sweep("wrong")).toBe(403);
    expect(await sweep(SWEEP_SECRET)).toBe(200);
    expect(fake.sent.map((s) => s.params.text)).toEqual(["You said: hello", "You said: again"]);
    const summary = await lines.next("sweep: ");
    expect(JSON.parse(summary.slice("sweep: ".length))).toMatchObject({ outbound: 1, more: false, pending: false });
  } finally {
    child.kill("SIGTERM");
    await child.exited;
    await fake.stop();
    const { default: postgres } = await import("postgres");
    const sql = postgres(POSTGRES_URL, { max: 1, onnotice: () => {} });
    await sql.unsafe(`DROP SCHEMA IF EXISTS "${schema}" CASCADE`);
    await sql.end();
  }
}, 90_000);
