/**
 * Small helpers shared by the conformance suites (not exported from `/testing`).
 *
 * @module
 */
import { delay } from "../runtime/mod.ts";

/** Resolves after `ms` milliseconds of real time. */
export function sleep(ms: number): Promise<void> {
  return delay(ms);
}

/** A unique id with a readable prefix. */
export function uid(prefix: string): string {
  return `${prefix}-${crypto.randomUUID()}`;
}
