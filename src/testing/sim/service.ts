/**
 * The world's fake external service that the simulated handler's durable step calls (`ctx.step`): a
 * payment API, an LLM. It records every call it receives (the ledger's `stepCalls`) with the
 * idempotency key it was given, whether it took effect and the result it returned. Its faults are the
 * provider's, drawn from the same plan and fault kinds: a timeout after the effect (`maybeDelivered`), a
 * retryable error (503, 429 with a retry-after) and a permanent one (400), none of which took effect, a
 * slow call (past a lease), the death of the calling process during the call (after the effect or
 * before it); a stalled process sees its answer only when it resumes.
 *
 * @module
 */
import { ProviderError } from "../../errors.ts";
import type { StepCall } from "../../engine/steps.ts";
import type { StepCallRecord } from "./ledger.ts";
import type { Incarnation, World } from "./world.ts";

/**
 * One call of a step's function.
 * @param world the run
 * @param inc the calling incarnation
 * @param stepKey the step's key, as the handler expects it (`<message id>:step:svc`)
 * @param idempotent whether the step was declared idempotent
 * @param call what the engine gave the function
 * @returns the service's result, `svc-<n>`
 */
export async function callService(world: World, inc: Incarnation, stepKey: string, idempotent: boolean, call: StepCall): Promise<string> {
  if (!inc.alive) throw world.death();
  const ledger = world.ledger;
  const now = world.sched.time;
  if (call.idempotencyKey !== stepKey) {
    ledger.live.push({ invariant: "step-key", time: now, detail: `${inc.id} called step ${stepKey} with idempotencyKey ${call.idempotencyKey}` });
  }
  const held = ledger.stepHeld.get(`${inc.id}|${stepKey}`);
  if (held === undefined) {
    ledger.live.push({ invariant: "step-call-without-lease", time: now, detail: `${inc.id} called step ${stepKey} without an attempt the sim saw leased to it` });
  } else if (ledger.isOutClosed(held.attempt, held.token) || ledger.outFenceOf(held.attempt) > held.token) {
    ledger.live.push({
      invariant: "step-call-under-lost-lease",
      time: now,
      detail: `${inc.id} called step ${stepKey} under attempt ${held.attempt} token ${held.token}, but ${
        ledger.isOutClosed(held.attempt, held.token) ? "that lease had already ended" : `token ${ledger.outFenceOf(held.attempt)} was issued since`
      }`,
    });
  }
  const record: StepCallRecord = {
    n: ledger.stepCalls.length + 1,
    stepKey,
    attemptKey: held?.attempt,
    token: held?.token,
    gen: held === undefined ? 0 : ledger.genOf(held.attempt),
    inc: inc.id,
    idempotent,
    attempt: call.attempt,
    start: now,
    end: null,
    outcome: "pending",
    effect: false,
    result: null,
  };
  ledger.stepCalls.push(record);
  const { outcome, latency } = world.pickCallFault("step");
  const where = `step call #${record.n} ${stepKey} (${held ? `${held.attempt} t${held.token}` : "no attempt"}, attempt ${call.attempt}${
    idempotent ? ", idempotent" : ""
  })`;
  world.log(inc.id, `${where}${outcome !== "ok" ? ` [${outcome}]` : ""}${latency > 100 ? ` (${latency}ms)` : ""}`);
  if (outcome === "provider-crash") {
    await world.sched.sleep(world.plan.int(0, latency));
    record.effect = world.plan.chance(0.5);
    record.end = world.sched.time;
    record.outcome = record.effect ? "crash after the effect" : "crash before the effect";
    world.log(inc.id, `${where}: ${record.outcome}`);
    if (inc.alive) {
      world.crashes++;
      world.crash(inc, `during step call #${record.n} for ${stepKey}`);
    }
    throw world.death();
  }
  await world.sched.sleep(latency);
  record.end = world.sched.time;
  let error: Error | null = null;
  switch (outcome) {
    case "ok":
      record.effect = true;
      record.result = `svc-${record.n}`;
      break;
    case "provider-timeout":
      record.effect = true;
      error = Object.assign(new Error("timed out after the service took the call (sim)"), { name: "TimeoutError" });
      break;
    case "provider-transient":
      error = new ProviderError("503 service unavailable (sim)", { status: 503 });
      break;
    case "provider-permanent":
      error = new ProviderError("400 invalid request (sim)", { status: 400 });
      break;
    case "provider-retry-after":
      error = new ProviderError("429 too many requests (sim)", { status: 429, retryAfterMs: world.plan.int(100, 3000) });
      break;
  }
  record.outcome = outcome;
  world.log(inc.id, `${where} -> ${outcome}${record.result ? ` ${record.result}` : ""}${inc.alive ? "" : " (the caller is dead)"}`);
  await world.thaw(inc.replica);
  if (!inc.alive) throw world.death();
  if (error) throw error;
  return record.result!;
}
