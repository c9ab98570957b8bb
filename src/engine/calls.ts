/**
 * A provider call's edges: a timeout that leaves the call running, and a `confirm` answer checked.
 *
 * @module
 */
import type { Clock, ClockTimer } from "../clock.ts";
import type { SendConfirmation } from "../provider.ts";

/** `work`, or a rejection with `timeoutError()` when it has not settled within `ms` (`work` goes on). */
export function withTimeout<T>(clock: Clock, work: Promise<T>, ms: number, timeoutError: () => Error): Promise<T> {
  let timer: ClockTimer | undefined;
  const timeout = new Promise<never>((_, reject) => {
    timer = clock.setTimeout(() => reject(timeoutError()), ms);
  });
  work.catch(() => {}); // a late failure after the timeout is nobody's to handle
  return Promise.race([work, timeout]).finally(() => clock.clearTimeout(timer));
}

/** A provider's `confirm` answer, checked: `null`, or a well-formed {@link SendConfirmation}. */
export function checkConfirmation(answer: unknown, provider: string): SendConfirmation | null {
  if (answer === null || answer === undefined) return null;
  const a = answer as { delivered?: unknown; messageId?: unknown };
  if (typeof answer === "object" && a.delivered === false) return { delivered: false };
  if (typeof answer === "object" && a.delivered === true) {
    if (typeof a.messageId === "string") return { delivered: true, messageId: a.messageId };
    if (typeof a.messageId === "number" && Number.isFinite(a.messageId)) return { delivered: true, messageId: String(a.messageId) };
    throw new TypeError(`Provider "${provider}" confirm() answered delivered without a usable "messageId" (got ${JSON.stringify(a.messageId) ?? "undefined"})`);
  }
  throw new TypeError(
    `Provider "${provider}" confirm() must answer null, { delivered: false } or { delivered: true, messageId }, got field "delivered" ${
      JSON.stringify(a?.delivered) ?? "undefined"
    }`,
  );
}
