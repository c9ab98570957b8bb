// Durable steps in the deterministic simulation: the step invariants catch a deliberately broken engine.
// The engine is broken from outside, by a backend wrapper (the code under test is unchanged): the
// journal lies to it about a step's attempts in one controlled way, and the run's ground truth (the
// fake service's record of every step call) shows the harm.
import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory/durability.ts";
import type { DurabilityBackend, FailOutcome, OutboxEntry } from "../src/contract.ts";
import { STEP_CHAT_PREFIX, STEP_NOT_RUN } from "../src/engine/steps.ts";
import { runSimulation, type SimResult } from "../src/testing/sim/mod.ts";

const create = (serverNow: () => number) => new MemoryDurability({ clock: serverNow });

const isStep = (entry: Pick<OutboxEntry, "chatId">) => entry.chatId.startsWith(STEP_CHAT_PREFIX);

/**
 * A rerun that ignores the journaled `unknown` state: an `unknown` step attempt reads as settled "never
 * run", so the rerun goes on to the next attempt and calls the step again, idempotent or not.
 */
function forgetsUnknown(serverNow: () => number): DurabilityBackend {
  const inner = create(serverNow);
  const forget = (entry: OutboxEntry): OutboxEntry =>
    isStep(entry) && entry.state === "unknown" ? { ...entry, state: "sent", messageId: STEP_NOT_RUN, error: null } : entry;
  const get = inner.outbox.get.bind(inner.outbox);
  inner.outbox.get = async (key: string) => {
    const entry = await get(key);
    return entry === null ? null : forget(entry);
  };
  // The engine reads a step's attempts by their chat (the harness's own listing of everything stays true).
  const list = inner.outbox.list.bind(inner.outbox);
  inner.outbox.list = async (options) => {
    const entries = await list(options);
    return options?.chatId?.startsWith(STEP_CHAT_PREFIX) === true ? entries.map(forget) : entries;
  };
  return inner;
}

/**
 * Step attempts whose call may have run are settled as never run: an ambiguous outcome of a step attempt
 * (a call that timed out, a lapsed announced attempt re-leased with `onAmbiguous: 'resend'`) is written
 * as `sent` with the not-run mark.
 */
function settlesCalledAsNotRun(serverNow: () => number): DurabilityBackend {
  const inner = create(serverNow);
  const markFailed = inner.outbox.markFailed.bind(inner.outbox);
  const get = inner.outbox.get.bind(inner.outbox);
  inner.outbox.markFailed = async (key: string, token: number, outcome: FailOutcome) => {
    const entry = await get(key);
    if (entry !== null && isStep(entry) && "ambiguous" in outcome && outcome.ambiguous === true) {
      return await inner.outbox.markSent(key, token, STEP_NOT_RUN);
    }
    return await markFailed(key, token, outcome);
  };
  return inner;
}

/**
 * A rerun that does not get the journaled result back: the step's attempts, read by their chat, show
 * another result than the one recorded.
 */
function misreadsResult(serverNow: () => number): DurabilityBackend {
  const inner = create(serverNow);
  const list = inner.outbox.list.bind(inner.outbox);
  inner.outbox.list = async (options) => {
    const entries = await list(options);
    if (options?.chatId?.startsWith(STEP_CHAT_PREFIX) !== true) return entries;
    return entries.map((e) => e.state === "sent" && e.messageId?.startsWith("{") === true ? { ...e, messageId: JSON.stringify({ v: "forged" }) } : e);
  };
  return inner;
}

/** The first seed from `from` whose run reports `invariant`, within `count` seeds. */
async function firstFailing(factory: (serverNow: () => number) => DurabilityBackend, invariant: string, from: number, count: number) {
  for (let seed = from; seed < from + count; seed++) {
    const result: SimResult = await runSimulation(factory, { seed });
    const failure = result.failures.find((f) => f.invariant === invariant);
    if (failure) return { seed, failure, result };
  }
  return undefined;
}

describe("simulation: durable steps", () => {
  test("the scenario runs steps: calls, effects and results reach the trace", async () => {
    // The first seed whose run reports a step ambiguous (which seed that is moves with the engine's journal calls).
    const ambiguous = /durability:ambiguous .*\(step svc, chat c\d\)/;
    let result: Awaited<ReturnType<typeof runSimulation>> | undefined;
    for (let seed = 1; seed <= 200 && result === undefined; seed++) {
      const run = await runSimulation(create, { seed });
      expect(run.failures).toEqual([]);
      if (run.trace.some((line) => ambiguous.test(line))) result = run;
    }
    expect(result, "some seed of 1..200 reports a step ambiguous").toBeDefined();
    expect(result!.scenario).toContain("steps in");
    expect(result!.trace.some((line) => /step call #\d+ .* -> ok svc-\d+/.test(line))).toBe(true);
  });

  test("a rerun that ignores the journaled unknown state is caught (a non-idempotent step takes effect twice)", async () => {
    const found = await firstFailing(forgetsUnknown, "step-effect-twice", 1, 400);
    expect(found).toBeDefined();
    console.log(`forgetsUnknown: seed ${found!.seed}: ${found!.failure.detail}`);
    // The same seed with the engine as it is holds every invariant.
    expect((await runSimulation(create, { seed: found!.seed })).failures).toEqual([]);
  }, 120_000);

  test("a rerun that gets another result than the journaled one is caught (a reply carries it)", async () => {
    const found = await firstFailing(misreadsResult, "step-reply-result", 1, 400);
    expect(found).toBeDefined();
    console.log(`misreadsResult: seed ${found!.seed}: ${found!.failure.detail}`);
    expect((await runSimulation(create, { seed: found!.seed })).failures).toEqual([]);
    // Where the rerun's reply had already been journaled with the true result, the journal refuses the new content.
    const diverged = await firstFailing(misreadsResult, "handler-diverged", 1, 400);
    expect(diverged).toBeDefined();
    expect((await runSimulation(create, { seed: diverged!.seed })).failures).toEqual([]);
  }, 120_000);

  test("settling called step attempts as never run is caught", async () => {
    const found = await firstFailing(settlesCalledAsNotRun, "step-not-run-called", 1, 400);
    expect(found).toBeDefined();
    console.log(`settlesCalledAsNotRun: seed ${found!.seed}: ${found!.failure.detail}`);
    expect((await runSimulation(create, { seed: found!.seed })).failures).toEqual([]);
  }, 120_000);
});
