/**
 * Anchor: DBOS Transact (@dbos-inc/dbos-sdk) on the same Postgres, its system database in its own
 * schema (`systemDatabaseSchemaName`) of the bench's database; runs under Bun, and under Node for the
 * `(Node)` row (bench/run.ts bundles it for Node).
 *
 * Equal work: per message one workflow started with `DBOS.startWorkflow` and workflow ID = the message
 * id (`m-<n>`: DBOS's idempotency key; a second start with that ID returns the same workflow instead of
 * running it again), of two steps: "inbound" (handles the message) and "reply" (sends the reply to the
 * same in-process mock provider our rows use, with `<workflow ID>:0` as the send's idempotency key). A
 * step's result is checkpointed before the workflow goes on, so a recovered workflow skips the steps it
 * finished. The closed loop closes on the reply's send; the measured interval ends once every
 * workflow's result is recorded (each handle's `getResult()`).
 *
 * Configured as DBOS's docs show for an application: `setConfig` with a name, an `applicationVersion`
 * (else a hash of the workflows' source), `systemDatabaseUrl`; defaults otherwise (system database pool
 * of 10, LISTEN/NOTIFY on). Logging at "error" (its console logger would write on stdout, the child's
 * result channel). Latency = startWorkflow called → the reply's send.
 *
 *   bun bench/anchors/dbos.ts '{"ns":{...},"chats":100,"seconds":2,"warmSeconds":0.5}'
 */
import { DBOS, type WorkflowHandle } from "@dbos-inc/dbos-sdk";
import postgres from "postgres";
import { BenchProvider, childMain, closedLoop, type LoadConfig, type Ns, pgUrl, replyWaiters, type RowResult } from "../lib.ts";

const cfg = JSON.parse(process.argv[2] ?? "{}") as LoadConfig & { ns: Ns };

childMain(async (): Promise<RowResult> => {
  const provider = new BenchProvider();
  const replied = replyWaiters(provider);
  const abort = new AbortController();
  const handled = new Map<number, number>();
  const workflow = DBOS.registerWorkflow(async (n: number, chat: number): Promise<void> => {
    await DBOS.runStep(async () => {
      handled.set(n, (handled.get(n) ?? 0) + 1);
    }, { name: "inbound" });
    await DBOS.runStep(async () => {
      const receipt = await provider.send(`c${chat}`, `r:m-${n}`, { idempotencyKey: `${DBOS.workflowID}:0`, attempt: 1, signal: abort.signal });
      return receipt.messageId;
    }, { name: "reply" });
  }, { name: "message" });
  DBOS.setConfig({
    name: "botmesh-bench",
    applicationVersion: "0.1.0",
    systemDatabaseUrl: pgUrl(cfg.ns),
    systemDatabaseSchemaName: cfg.ns.name,
    logLevel: "error",
  });
  await DBOS.launch();
  const pending: WorkflowHandle<void>[] = [];
  const { total, result } = await closedLoop(cfg, async (n, c) => {
    const done = replied(`m-${n}`);
    pending.push(await DBOS.startWorkflow(workflow, { workflowID: `m-${n}` })(n, c));
    await done;
  }, async () => {
    // Every workflow's outcome recorded.
    while (pending.length > 0) await Promise.all(pending.splice(0).map((h) => h.getResult()));
  });
  await DBOS.shutdown();
  const sql = postgres(pgUrl(cfg.ns), { max: 1, onnotice: () => {} });
  const counts = await sql.unsafe(`select status, count(*)::int as n from "${cfg.ns.name}".workflow_status group by status order by status`);
  const steps = await sql.unsafe(`select function_name, count(*)::int as n from "${cfg.ns.name}".operation_outputs group by function_name order by function_name`);
  await sql.end({ timeout: 5 });
  const wrong = Array.from({ length: total }, (_, n) => handled.get(n) ?? 0).filter((x) => x !== 1).length;
  if (wrong > 0) throw new Error(`${wrong} of ${total} inbound steps not run exactly once`);
  provider.verify(total);
  const shown = counts.map((r) => `${r.status}: ${r.n}`).join(", ");
  if (counts.length !== 1 || counts[0]!.status !== "SUCCESS" || counts[0]!.n !== total) throw new Error(`workflow_status holds ${shown}; expected SUCCESS: ${total}`);
  const shownSteps = steps.map((r) => `${r.function_name}: ${r.n}`).join(", ");
  if (steps.length !== 2 || steps.some((r) => r.n !== total)) throw new Error(`operation_outputs holds ${shownSteps}; expected inbound and reply: ${total} each`);
  return { ...result, note: "startWorkflow with workflowID = message id, steps inbound + reply; system database pool 10 (default)" };
});
