/**
 * Anchor: pg-boss 10 on the same Postgres, in its own schema. Each message =
 * one `boss.send(queue, data, { id })` with a fresh uuid, processed by
 * `boss.work()`. pg-boss 10's worker loop (src/worker.js) sleeps
 * `pollingInterval - fetchDuration` after every fetch, even a non-empty one,
 * unless `notifyWorker(id)` woke it; the minimum interval is 0.5 s. So every
 * send is followed by `boss.notifyWorker(id)` (in-process, like our own
 * wake-ups); without it a closed loop waits up to 0.5 s per round.
 *
 * - closed: per chat, the next send once the handler ran for the previous job
 *   (pg-boss completes the batch after the handler, without a hook to await it);
 * - open: all sends with `inFlight` sends outstanding, until every job was handled.
 *
 * Latency = send called → handler entered.
 *
 *   bun bench/anchors/pgboss.ts '{"ns":{...},"chats":100,"messages":20000,"workers":2,"batchSize":50}'
 */
import { randomUUID } from "node:crypto";
import PgBoss from "pg-boss";
import { POSTGRES_URL } from "../../tests/support/services.ts";
import { childMain, loadResult, type Ns, type RowResult } from "../lib.ts";

const cfg = JSON.parse(process.argv[2] ?? "{}") as {
  ns: Ns;
  chats: number;
  messages: number;
  workers: number;
  batchSize: number;
  open?: boolean;
  notify?: boolean;
};

childMain(async (): Promise<RowResult> => {
  const chats = cfg.chats, perChat = Math.ceil(cfg.messages / chats), total = perChat * chats;
  const boss = new PgBoss({ connectionString: POSTGRES_URL, schema: cfg.ns.name, max: 10, supervise: false, schedule: false });
  const errors: unknown[] = [];
  boss.on("error", (e) => errors.push(e));
  await boss.start();
  const queue = "bench";
  await boss.createQueue(queue);
  const sentAt = new Float64Array(total), latency = new Float64Array(total), handled = new Uint32Array(total);
  const waiting = new Map<number, () => void>();
  let done = 0, allDone: () => void = () => {};
  const finished = new Promise<void>((resolve) => (allDone = resolve));
  const workers: string[] = [];
  for (let w = 0; w < cfg.workers; w++) {
    workers.push(await boss.work<{ n: number }>(queue, { batchSize: cfg.batchSize, pollingIntervalSeconds: 0.5 }, async (jobs) => {
      const now = performance.now();
      for (const job of jobs) {
        const n = job.data.n;
        latency[n] = now - sentAt[n]!;
        handled[n]!++;
        waiting.get(n)?.();
        if (++done === total) allDone();
      }
    }));
  }
  let rr = 0;
  const send = async (n: number) => {
    sentAt[n] = performance.now();
    await boss.send(queue, { n }, { id: randomUUID() });
    if (cfg.notify !== false) boss.notifyWorker(workers[rr++ % workers.length]!);
  };
  const started = performance.now();
  if (cfg.open) {
    let next = 0;
    await Promise.all(Array.from({ length: chats }, async () => {
      while (next < total) await send(next++);
    }));
  } else {
    await Promise.all(Array.from({ length: chats }, async (_, c) => {
      for (let k = 0; k < perChat; k++) {
        const n = k * chats + c;
        const ran = new Promise<void>((resolve) => waiting.set(n, resolve));
        await send(n);
        await ran;
        waiting.delete(n);
      }
    }));
  }
  await finished;
  const ms = performance.now() - started;
  await boss.stop({ graceful: true, wait: true, timeout: 10_000 });
  const wrong = handled.filter((x) => x !== 1).length;
  if (wrong > 0) throw new Error(`${wrong} of ${total} jobs not handled exactly once`);
  if (errors.length > 0) throw new Error(`pg-boss errors: ${String(errors[0])}`);
  return {
    ...loadResult(total, ms, latency),
    note: `${cfg.open ? `open loop, ${chats} sends in flight` : "closed loop"}; ${cfg.workers} work() worker(s), batchSize ${cfg.batchSize}, pollingIntervalSeconds 0.5, notifyWorker ${cfg.notify !== false ? "after each send" : "off"}`,
  };
});
