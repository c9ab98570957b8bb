/**
 * Anchor: pg-boss 10 on the same Postgres, in its own schema.
 *
 * - equal work (`oneJob` false): per message an inbound job on queue "in" (`id` = a uuid); its
 *   handler sends the reply job to queue "out" with `id` = a uuid derived from the idempotency key
 *   (pg-boss inserts with ON CONFLICT DO NOTHING: a second send of that key is a no-op); a reply
 *   worker sends it to the same in-process mock provider our rows use. The closed loop closes on that
 *   send; the measured interval ends once every job of both queues is `completed` in the job table.
 * - one job (`oneJob` true): per message one `send` with a fresh uuid; closed loop on the handler having
 *   run; the interval likewise ends once all are `completed`.
 *
 * pg-boss 10's worker loop sleeps `pollingInterval - fetchDuration` after every fetch, even a
 * non-empty one, unless `notifyWorker(id)` wakes it; the minimum interval is 0.5 s. So every send is
 * followed by `boss.notifyWorker(id)` of the worker of its queue (in-process, like our own wake-ups);
 * without it a closed loop waits up to 0.5 s per round. A batch's jobs are handled concurrently
 * (Promise.all). Latency = send called → the reply's send (equal work) or → handler entered.
 *
 *   bun bench/anchors/pgboss.ts '{"ns":{...},"chats":100,"seconds":2,"warmSeconds":0.5,"batchSize":100}'
 */
import { createHash, randomUUID } from "node:crypto";
import PgBoss from "pg-boss";
import { BenchProvider, childMain, closedLoop, type LoadConfig, type Ns, pgUrl, replyWaiters, type RowResult } from "../lib.ts";

const cfg = JSON.parse(process.argv[2] ?? "{}") as LoadConfig & { ns: Ns; batchSize: number; oneJob?: boolean };

/** A uuid (version 5 layout) derived from an idempotency key. */
function uuidOf(key: string): string {
  const h = createHash("sha1").update(key).digest();
  h[6] = (h[6]! & 0x0f) | 0x50;
  h[8] = (h[8]! & 0x3f) | 0x80;
  const x = h.subarray(0, 16).toString("hex");
  return `${x.slice(0, 8)}-${x.slice(8, 12)}-${x.slice(12, 16)}-${x.slice(16, 20)}-${x.slice(20)}`;
}

childMain(async (): Promise<RowResult> => {
  const boss = new PgBoss({ connectionString: pgUrl(cfg.ns), schema: cfg.ns.name, max: 10, supervise: false, schedule: false });
  const errors: unknown[] = [];
  boss.on("error", (e) => errors.push(e));
  await boss.start();
  await boss.createQueue("in");
  if (!cfg.oneJob) await boss.createQueue("out");
  const provider = new BenchProvider();
  const replied = replyWaiters(provider);
  const abort = new AbortController();
  const handled = new Map<number, number>();
  const ran = new Map<number, () => void>();
  const work = { batchSize: cfg.batchSize, pollingIntervalSeconds: 0.5 };
  let outWorker = "";
  const inWorker = await boss.work<{ n: number; chat: number }>("in", work, async (jobs) => {
    await Promise.all(jobs.map(async (job) => {
      const n = job.data.n;
      handled.set(n, (handled.get(n) ?? 0) + 1);
      if (cfg.oneJob) {
        const r = ran.get(n);
        ran.delete(n);
        return r?.();
      }
      await boss.send("out", job.data, { id: uuidOf(`m-${n}:0`) });
      boss.notifyWorker(outWorker);
    }));
  });
  if (!cfg.oneJob) {
    outWorker = await boss.work<{ n: number; chat: number }>("out", work, async (jobs) => {
      await Promise.all(jobs.map((job) =>
        provider.send(`c${job.data.chat}`, `r:m-${job.data.n}`, { idempotencyKey: job.id, attempt: 1, signal: abort.signal })
      ));
    });
  }
  const { default: postgres } = await import("postgres");
  const sql = postgres(pgUrl(cfg.ns), { max: 1, onnotice: () => {} });
  const completed = async () => {
    const rows = await sql.unsafe(`select name, count(*)::int as n from "${cfg.ns.name}".job where state = 'completed' group by name`);
    const by = Object.fromEntries(rows.map((r) => [r.name as string, r.n as number]));
    return { in: by.in ?? 0, out: by.out ?? 0 };
  };
  let sent = 0;
  const { total, result } = await closedLoop(cfg, async (n, c) => {
    sent++;
    const done = cfg.oneJob ? new Promise<void>((resolve) => ran.set(n, resolve)) : replied(`m-${n}`);
    await boss.send("in", { n, chat: c }, { id: randomUUID() });
    boss.notifyWorker(inWorker);
    await done;
  }, async () => {
    for (;;) {
      if (errors.length > 0) throw new Error(`pg-boss error: ${String(errors[0])}`);
      const c = await completed();
      if (c.in >= sent && (cfg.oneJob || c.out >= sent)) return;
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
  });
  const counts = await sql.unsafe(`select name, state, count(*)::int as n from "${cfg.ns.name}".job group by name, state order by name, state`);
  await sql.end({ timeout: 5 });
  await boss.stop({ graceful: true, wait: true, timeout: 10_000 });
  if (errors.length > 0) throw new Error(`pg-boss errors: ${String(errors[0])}`);
  const wrong = Array.from({ length: total }, (_, n) => handled.get(n) ?? 0).filter((x) => x !== 1).length;
  if (wrong > 0) throw new Error(`${wrong} of ${total} inbound jobs not handled exactly once`);
  if (!cfg.oneJob) provider.verify(total);
  const want = cfg.oneJob ? [["in", total]] : [["in", total], ["out", total]];
  const shown = counts.map((r) => `${r.name}/${r.state}: ${r.n}`).join(", ");
  if (counts.length !== want.length || want.some(([q, n]) => !counts.some((r) => r.name === q && r.state === "completed" && r.n === n))) {
    throw new Error(`job table holds ${shown}; expected ${want.map(([q, n]) => `${q}/completed: ${n}`).join(", ")}`);
  }
  return { ...result, note: `batchSize ${cfg.batchSize}, pollingIntervalSeconds 0.5, notifyWorker after each send; pool max 10` };
});
