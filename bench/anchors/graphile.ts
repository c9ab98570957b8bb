/**
 * Anchor: graphile-worker on the same Postgres, in its own schema; runs under Bun, and under Node for
 * the `(Node)` rows (bench/run.ts bundles it for Node).
 *
 * - equal work (`oneJob` false): per message an inbound job of task "in" (no job key, as pg-boss's
 *   inbound job has a fresh id); its task adds the reply job of task "out" with `jobKey` = the reply's
 *   idempotency key (`m-<n>:0`, the default `replace` mode: a second add of that key while the job is
 *   pending updates it instead of adding another); the "out" task sends it to the same in-process mock
 *   provider our rows use, with the job key as the send's idempotency key. The closed loop closes on
 *   that send; the measured interval ends once every job of both tasks succeeded and was released
 *   (graphile-worker deletes a job when it completes: the job table is empty).
 * - one job (`oneJob` true): per message one job of task "in" whose task does nothing; closed loop on
 *   the task having run; the interval likewise ends once all succeeded and the job table is empty.
 *
 * One runner (worker pool) runs both tasks, configured as the docs' performance page recommends for a
 * high-throughput queue: `concurrentJobs` = chats (the jobs that can be runnable at once: one per chat
 * in the closed loop), batching on (`localQueue.size` = concurrentJobs + 1, `completeJobBatchDelay` and
 * `failJobBatchDelay` 0), `maxPoolSize` 10 (the pool of pg-boss and of our Postgres row; the docs allow
 * a pool smaller than concurrentJobs). New jobs wake the pool through LISTEN/NOTIFY. Latency = addJob
 * called → the reply's send (equal work) or → task entered (one job).
 *
 *   bun bench/anchors/graphile.ts '{"ns":{...},"chats":100,"seconds":2,"warmSeconds":0.5,"concurrency":100}'
 */
import { EventEmitter } from "node:events";
import { Logger, run, type WorkerEvents } from "graphile-worker";
import postgres from "postgres";
import { BenchProvider, childMain, closedLoop, type LoadConfig, type Ns, pgUrl, replyWaiters, type RowResult } from "../lib.ts";

const cfg = JSON.parse(process.argv[2] ?? "{}") as LoadConfig & { ns: Ns; concurrency: number; oneJob?: boolean };

interface Payload {
  n: number;
  chat: number;
}

childMain(async (): Promise<RowResult> => {
  const errors: string[] = [];
  const succeeded = { in: 0, out: 0 };
  let wake: () => void = () => {};
  const events: WorkerEvents = new EventEmitter();
  events.on("job:success", ({ job }) => {
    if (job.task_identifier === "in") succeeded.in++;
    else succeeded.out++;
    wake();
  });
  events.on("job:error", ({ job, error }) => errors.push(`job ${job.task_identifier} ${job.id} failed: ${String(error)}`));
  // graphile-worker's default logger prints on stdout (the child's result channel): errors to stderr only.
  const logger = new Logger(() => (level, message) => {
    if (level === "error") process.stderr.write(`graphile-worker: ${message}\n`);
  });
  const provider = new BenchProvider();
  const replied = replyWaiters(provider);
  const abort = new AbortController();
  const handled = new Map<number, number>();
  const ran = new Map<number, () => void>();
  const concurrentJobs = cfg.concurrency;
  const runner = await run({
    logger,
    noHandleSignals: true,
    preset: {
      worker: {
        connectionString: pgUrl(cfg.ns),
        schema: cfg.ns.name,
        concurrentJobs,
        maxPoolSize: 10,
        localQueue: { size: concurrentJobs + 1 },
        completeJobBatchDelay: 0,
        failJobBatchDelay: 0,
        events,
      },
    },
    taskList: {
      in: async (payload, helpers) => {
        const { n, chat } = payload as Payload;
        handled.set(n, (handled.get(n) ?? 0) + 1);
        if (cfg.oneJob) {
          const r = ran.get(n);
          ran.delete(n);
          return r?.();
        }
        const job = await helpers.addJob("out", { n, chat }, { jobKey: `m-${n}:0` });
        // The job_key caveat in graphile-worker's docs: under contention on one key add_job may return null.
        if (!job) throw new Error(`addJob of the reply to m-${n} returned null`);
      },
      out: async (payload, helpers) => {
        const { n, chat } = payload as Payload;
        await provider.send(`c${chat}`, `r:m-${n}`, { idempotencyKey: helpers.job.key!, attempt: helpers.job.attempts, signal: abort.signal });
      },
    },
  });
  const sql = postgres(pgUrl(cfg.ns), { max: 1, onnotice: () => {} });
  const left = async () => (await sql.unsafe(`select count(*)::int as n from "${cfg.ns.name}"._private_jobs`))[0]!.n as number;
  let sent = 0;
  const { total, result } = await closedLoop(cfg, async (n, c) => {
    sent++;
    const done = cfg.oneJob ? new Promise<void>((resolve) => ran.set(n, resolve)) : replied(`m-${n}`);
    await runner.addJob("in", { n, chat: c });
    await done;
  }, async () => {
    // Every job of both tasks succeeded (this process's runner's events), then released (deleted).
    for (;;) {
      if (errors.length > 0) throw new Error(errors[0]);
      if (succeeded.in >= sent && (cfg.oneJob || succeeded.out >= sent) && await left() === 0) return;
      await new Promise<void>((resolve) => {
        wake = resolve;
        setTimeout(resolve, 20);
      });
    }
  });
  const remaining = await left();
  await sql.end({ timeout: 5 });
  await runner.stop();
  if (errors.length > 0) throw new Error(errors[0]);
  const wrong = Array.from({ length: total }, (_, n) => handled.get(n) ?? 0).filter((x) => x !== 1).length;
  if (wrong > 0) throw new Error(`${wrong} of ${total} inbound jobs not handled exactly once`);
  if (!cfg.oneJob) provider.verify(total);
  const want = { in: total, out: cfg.oneJob ? 0 : total };
  if (succeeded.in !== want.in || succeeded.out !== want.out || remaining !== 0) {
    throw new Error(`succeeded in ${succeeded.in}, out ${succeeded.out}, ${remaining} jobs left in the table; expected in ${want.in}, out ${want.out}, none left`);
  }
  return {
    ...result,
    note: `concurrentJobs ${concurrentJobs}, localQueue.size ${concurrentJobs + 1}, completeJobBatchDelay 0, failJobBatchDelay 0, maxPoolSize 10`,
  };
});
