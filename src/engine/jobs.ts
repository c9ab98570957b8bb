/**
 * Inbound jobs and timers: which run of its handler a job is on, and the timer a record carries.
 *
 * @module
 */
import type { InboundRecord, JsonValue } from "../contract.ts";
import type { InboundJob, JournaledTimer } from "./types.ts";

/** The payload field of an inbox record that makes it a timer rather than a message. */
export const TIMER_FIELD = "$timer";

/**
 * The run a journaled job is on, once it began (the runs its record's handler began, this one included;
 * for a timer, less the run its leased admission counted, which was only its arming).
 * @param job a job with its record
 * @returns at least 1
 */
export function attemptsOf(job: InboundJob & { record: InboundRecord }): number {
  return runOf(job.record.attempts, job.timer !== undefined);
}

/** The run number of a record whose journal counts `attempts` runs (a timer's arming admission is not one). */
export function runOf(attempts: number, timer: boolean): number {
  return Math.max(1, timer ? attempts - 1 : attempts);
}

/** The timer an inbox record's payload carries, or `undefined` for a message. */
export function timerOf(payload: JsonValue): JournaledTimer | undefined {
  if (typeof payload !== "object" || payload === null || Array.isArray(payload)) return undefined;
  const timer = payload[TIMER_FIELD] as { at?: unknown; data?: JsonValue } | undefined;
  if (typeof timer !== "object" || timer === null || typeof timer.at !== "number" || !Number.isFinite(timer.at)) return undefined;
  return { at: timer.at, data: timer.data ?? null };
}
