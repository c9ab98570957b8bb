/**
 * Anchor: BullMQ on the same Redis. Each message = one `queue.add` with a
 * unique jobId, processed by a Worker (concurrency = chats, so 100 or 1).
 * Closed loop per chat: the next job is added once the previous one
 * completed (the worker's `completed` event, in-process). Latency = add
 * called → processor entered (where our handler would send its reply).
 *
 *   bun bench/anchors/bullmq.ts '{"ns":{...},"chats":100,"messages":20000}'
 */
import { Queue, Worker } from "bullmq";
import { REDIS_URL } from "../../tests/support/services.ts";
import { childMain, loadResult, type Ns, type RowResult } from "../lib.ts";

const cfg = JSON.parse(process.argv[2] ?? "{}") as { ns: Ns; chats: number; messages: number };

childMain(async (): Promise<RowResult> => {
  const chats = cfg.chats, perChat = Math.ceil(cfg.messages / chats), total = perChat * chats;
  const url = new URL(REDIS_URL);
  const connection = { host: url.hostname, port: Number(url.port || 6379) };
  const prefix = cfg.ns.name.replace(/:$/, ""); // BullMQ keys: <prefix>:<queue>:…
  const name = "bench";
  const queue = new Queue(name, { connection, prefix });
  const addedAt = new Float64Array(total), latency = new Float64Array(total);
  const processed = new Uint32Array(total);
  const worker = new Worker(name, async (job) => {
    const n = job.data.n as number;
    latency[n] = performance.now() - addedAt[n]!;
    processed[n]!++;
  }, { connection, prefix, concurrency: chats });
  await worker.waitUntilReady();
  const waiting = new Map<string, () => void>();
  worker.on("completed", (job) => waiting.get(job.id!)?.());
  worker.on("failed", (job, error) => console.error(`job ${job?.id} failed: ${error}`));
  const chat = async (c: number) => {
    for (let k = 0; k < perChat; k++) {
      const n = k * chats + c, id = `j-${n}`;
      const completed = new Promise<void>((resolve) => waiting.set(id, resolve));
      addedAt[n] = performance.now();
      await queue.add("msg", { n, chat: c }, { jobId: id });
      await completed;
      waiting.delete(id);
    }
  };
  const started = performance.now();
  await Promise.all(Array.from({ length: chats }, (_, c) => chat(c)));
  const ms = performance.now() - started;
  const wrong = processed.filter((x) => x !== 1).length;
  const counts = await queue.getJobCounts("waiting", "active", "delayed", "failed", "completed");
  await worker.close();
  await queue.obliterate({ force: true });
  await queue.close();
  if (wrong > 0) throw new Error(`${wrong} of ${total} jobs not processed exactly once`);
  if (counts.completed !== total || counts.waiting + counts.active + counts.delayed + counts.failed > 0) {
    throw new Error(`unexpected job counts ${JSON.stringify(counts)}`);
  }
  return loadResult(total, ms, latency);
});
