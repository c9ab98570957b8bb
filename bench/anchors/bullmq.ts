/**
 * Anchor: BullMQ on the same Redis server as the row it is compared with.
 *
 * - equal work (`oneJob` false): per message an inbound job (`jobId` = the message id) on queue "in";
 *   its processor adds the reply job on queue "out" with `jobId` = the idempotency key (a second add
 *   of that key is a no-op in BullMQ); a reply worker sends it to the same in-process mock provider
 *   our rows use. Both workers have concurrency = chats. The closed loop closes on that send; the
 *   measured interval ends once every job of both queues completed.
 * - one job (`oneJob` true): per message one job with a unique jobId, a processor that does nothing;
 *   the closed loop closes on the worker's `completed` event.
 *
 * Latency = add called → the send (equal work) or → processor entered (one job).
 *
 *   bun bench/anchors/bullmq.ts '{"ns":{...},"chats":100,"seconds":2,"warmSeconds":0.5,"oneJob":false}'
 */
import { Queue, Worker } from "bullmq";
import { REDIS_URL } from "../../tests/support/services.ts";
import { BenchProvider, childMain, closedLoop, type LoadConfig, type Ns, replyWaiters, type RowResult } from "../lib.ts";

const cfg = JSON.parse(process.argv[2] ?? "{}") as LoadConfig & { ns: Ns; oneJob?: boolean };

childMain(async (): Promise<RowResult> => {
  const url = new URL(cfg.ns.redisUrl ?? REDIS_URL);
  const connection = { host: url.hostname, port: Number(url.port || 6379) };
  const prefix = cfg.ns.name.replace(/:$/, ""); // BullMQ keys: <prefix>:<queue>:…
  const provider = new BenchProvider();
  const replied = replyWaiters(provider);
  const abort = new AbortController();
  const errors: string[] = [];
  const inbound = new Queue("in", { connection, prefix });
  const replies = new Queue("out", { connection, prefix });
  const completed = { in: 0, out: 0 };
  let wake: () => void = () => {};
  const processed = new Map<number, number>();
  const inWorker = new Worker("in", async (job) => {
    const n = job.data.n as number;
    processed.set(n, (processed.get(n) ?? 0) + 1);
    if (cfg.oneJob) return;
    await replies.add("reply", { n, chat: job.data.chat }, { jobId: `${job.id}-r0` });
  }, { connection, prefix, concurrency: cfg.chats });
  const outWorker = cfg.oneJob ? null : new Worker("out", async (job) => {
    await provider.send(`c${job.data.chat}`, `r:m-${job.data.n}`, { idempotencyKey: job.id!, attempt: job.attemptsMade + 1, signal: abort.signal });
  }, { connection, prefix, concurrency: cfg.chats });
  const waiting = new Map<string, () => void>();
  inWorker.on("completed", (job) => {
    completed.in++;
    wake();
    const w = waiting.get(job.id!);
    if (w) {
      waiting.delete(job.id!);
      w();
    }
  });
  outWorker?.on("completed", () => {
    completed.out++;
    wake();
  });
  for (const w of [inWorker, outWorker]) w?.on("failed", (job, error) => errors.push(`job ${job?.id} failed: ${error}`));
  await inWorker.waitUntilReady();
  await outWorker?.waitUntilReady();
  let sent = 0;
  const { total, result } = await closedLoop(cfg, async (n, c) => {
    const id = `m-${n}`;
    sent++;
    const done = cfg.oneJob ? new Promise<void>((resolve) => waiting.set(id, resolve)) : replied(id);
    await inbound.add("msg", { n, chat: c }, { jobId: id });
    await done;
  }, async () => {
    // Every job of both queues completed (the `completed` events of this process's workers).
    while (completed.in < sent || (!cfg.oneJob && completed.out < sent)) {
      if (errors.length > 0) throw new Error(errors[0]);
      await new Promise<void>((resolve) => {
        wake = resolve;
        setTimeout(resolve, 50);
      });
    }
  });
  const counts = await Promise.all([inbound, replies].map((q) => q.getJobCounts("waiting", "active", "delayed", "failed", "completed")));
  await outWorker?.close();
  await inWorker.close();
  for (const q of [inbound, replies]) {
    await q.obliterate({ force: true });
    await q.close();
  }
  if (errors.length > 0) throw new Error(errors[0]);
  const wrong = Array.from({ length: total }, (_, n) => processed.get(n) ?? 0).filter((x) => x !== 1).length;
  if (wrong > 0) throw new Error(`${wrong} of ${total} inbound jobs not processed exactly once`);
  if (!cfg.oneJob) provider.verify(total);
  const want = [total, cfg.oneJob ? 0 : total];
  counts.forEach((c, i) => {
    if (c.completed !== want[i] || c.waiting + c.active + c.delayed + c.failed > 0) {
      throw new Error(`queue ${i === 0 ? "in" : "out"}: job counts ${JSON.stringify(c)}, expected ${want[i]} completed`);
    }
  });
  return result;
});
