/**
 * Helpers of the steps conformance suite (`conformance_steps.ts`): what the crash matrix of a step
 * expects at each crash point, and small error helpers for the harness's few matchers.
 *
 * @module
 */

/** The error `promise` rejects with (`undefined` when it resolves). */
export async function caught(promise: Promise<unknown>): Promise<unknown> {
  try {
    await promise;
    return undefined;
  } catch (error) {
    return error;
  }
}

/** An error's `name: message`, for asserting on it with the harness's few matchers. */
export function told(error: unknown): string {
  return error instanceof Error ? `${error.name}: ${error.message}` : String(error);
}

/**
 * The journal steps of a step where the crash matrix kills the process (`outbox.markFailed`: a failing
 * step; `outbox.heartbeat`: a step slower than its lease, the process dies during its call).
 */
export const STEP_CRASH_POINTS = ["outbox.reserve", "outbox.markCalling", "step.call", "outbox.heartbeat", "outbox.markSent", "outbox.markFailed"] as const;

/** How a crash matrix run ends: the message done, or dead with the step ambiguous, or dead with the step failed. */
export interface MatrixOutcome {
  outcome: "done" | "ambiguous" | "failed";
  /** How often the step's function took effect, over both processes. */
  effects: number;
  /** Whether the step's attempt was announced when the process died (it becomes `unknown`, reported). */
  reported: boolean;
}

/**
 * What a crash at `point` must lead to. A crash before the call was announced leaves an attempt that never
 * ran (the next run starts the next attempt); one after it, and before the outcome was recorded, leaves it
 * `unknown` and reported: not run again, unless the step is idempotent.
 */
export function expectedOutcome(point: (typeof STEP_CRASH_POINTS)[number], when: "before" | "after", idempotent: boolean): MatrixOutcome {
  const failing = point === "outbox.markFailed";
  const ranInA = (point === "step.call" && when === "after") || point === "outbox.heartbeat" || point === "outbox.markSent" || failing ? 1 : 0;
  const announced = (point === "outbox.markCalling" && when === "after") || point === "step.call" || point === "outbox.heartbeat" ||
    (point === "outbox.markSent" && when === "before") || (point === "outbox.markFailed" && when === "before");
  if (announced) {
    if (!idempotent) return { outcome: "ambiguous", effects: ranInA, reported: true };
    return { outcome: failing ? "failed" : "done", effects: ranInA + 1, reported: true };
  }
  if (failing) return { outcome: "failed", effects: 1, reported: false }; // after markFailed: journaled dead
  return { outcome: "done", effects: 1, reported: false };
}
