/**
 * Serverless eviction, with real processes: every webhook request runs in a process that is killed
 * with SIGKILL right after it answered (tests/fixtures/serverless_bot.ts), its Bot API fails often
 * (502s, 429s) and sometimes kills the process right after a message went out. Nothing runs on a
 * timer: retries and the recovery of what the killed processes held come from cron-style
 * `bot.sweep()` calls, each in a fresh process killed right after it returned, and from the recovery
 * sweep of each new process's `bot.start()`. At the end every
 * message has its reply, none went out twice without a `durability:ambiguous` report, and every
 * retried call happened no earlier than the journal's `nextAttemptAt` for it.
 */
import { afterAll, expect, test } from "bun:test";
import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { childLines } from "./support/child_lines.ts";

const MESSAGES = 500;
const BATCH = 10;
const FIXTURE = join(import.meta.dir, "fixtures", "serverless_bot.ts");
const dir = mkdtempSync(join(tmpdir(), "botmesh-serverless-"));
afterAll(() => process.env.KEEP_SERVERLESS ? console.log(dir) : rmSync(dir, { recursive: true, force: true }));

const file = join(dir, "bot.sqlite");
const log = join(dir, "calls.log");

/** Runs one invocation to its SIGKILL; returns its stdout lines. */
async function invoke(args: string[]): Promise<string[]> {
  const child = Bun.spawn([process.execPath, FIXTURE, args[0]!, file, log, ...args.slice(1)], { stdout: "pipe", stderr: "pipe" });
  const output = childLines(child.stdout, `${args[0]} invocation`);
  const stderr = new Response(child.stderr).text();
  const killer = setTimeout(() => child.kill("SIGKILL"), 30_000);
  await child.exited;
  clearTimeout(killer);
  await output.ended;
  expect(child.signalCode, `the ${args[0]} process was killed right after its work (stderr: ${await stderr})`).toBe("SIGKILL");
  return output.all();
}

test(`${MESSAGES} messages through processes killed after each response, with failing sends: none lost, none twice unreported, every retry after its backoff`, async () => {
  const ids = Array.from({ length: MESSAGES }, (_, i) => `m${i}`);
  const answered = new Set<string>();
  let webhooks = 0;
  let crons = 0;
  let cut = 0;
  const sweep = async () => {
    crons++;
    const line = (await invoke(["cron"])).find((l) => l.startsWith("sweep "));
    return line === undefined ? null : JSON.parse(line.slice(6)) as { more: boolean; pending: boolean };
  };
  for (let next = 0; answered.size < MESSAGES;) {
    // A request not answered (its process died mid-batch) is delivered again, as Telegram would.
    const batch: string[] = [];
    for (let i = 0; i < ids.length && batch.length < BATCH; i++) if (!answered.has(ids[i]!) && i < next + BATCH) batch.push(ids[i]!);
    next = Math.max(next, Number(batch.at(-1)!.slice(1)) + 1);
    webhooks++;
    const lines = await invoke(["webhook", ...batch]);
    const got = lines.filter((l) => l.startsWith("answered ")).map((l) => l.split(" ")[1]!);
    for (const id of got) answered.add(id);
    if (got.length < batch.length) cut++;
    if (webhooks % 2 === 0) await sweep();
  }
  // Cron ticks until nothing is left: the last leases of killed processes lapse (400 ms), backoffs pass.
  let summary = null;
  for (let tick = 0; tick < 60; tick++) {
    await Bun.sleep(450);
    summary = await sweep();
    if (summary !== null && !summary.pending && !summary.more) break;
  }
  expect(summary?.pending, "the journal has nothing unfinished left").toBe(false);

  const sent = new Map<string, number>();
  const ambiguous = new Set<string>();
  const lastFailure = new Map<string, number>();
  let retries = 0;
  let early = 0;
  let unverified = 0;
  for (const line of readFileSync(log, "utf8").split("\n")) {
    const [op, key, a, b] = line.split(" ");
    if (op === "sent") sent.set(key!, (sent.get(key!) ?? 0) + 1);
    else if (op === "ambiguous") ambiguous.add(key!);
    else if (op === "failed") lastFailure.set(key!, Number(b));
    else if (op === "call" && lastFailure.has(key!)) {
      retries++;
      const at = Number(b);
      if (at < lastFailure.get(key!)!) early++;
      lastFailure.delete(key!);
    } else if (op === "call" && Number(a) > 1) unverified++; // a resend of an ambiguous call, or a failure record cut by a kill
  }
  const lost = ids.filter((id) => !sent.has(`${id}:1`));
  const twice = [...sent].filter(([, n]) => n > 1).map(([key]) => key);
  const twiceUnreported = twice.filter((key) => !ambiguous.has(key));
  console.log(
    `serverless eviction: ${MESSAGES} messages, ${webhooks} webhook processes (${cut} cut short by a kill mid-send), ` +
      `${crons} cron sweeps; ${retries} retried calls checked against nextAttemptAt (${early} early; ${unverified} calls again without a recorded failure: resends of ambiguous calls, or a failure record cut by a kill), ` +
      `${ambiguous.size} ambiguous reported, ${twice.length} sent twice, ${lost.length} lost`,
  );
  expect(lost, "every message got its reply").toEqual([]);
  expect(twiceUnreported, "no reply went out twice without a durability:ambiguous report").toEqual([]);
  expect(early, "no retry called before its nextAttemptAt").toBe(0);
  expect(retries, "the run exercised retries").toBeGreaterThan(MESSAGES / 10);
  expect(cut, "the run exercised kills in the middle of a send").toBeGreaterThan(0);
}, 170_000);
