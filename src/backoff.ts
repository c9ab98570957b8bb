/**
 * Retry delays.
 *
 * @module
 */
import type { ResolvedBackoff } from "./config.ts";

/**
 * Exponential backoff with full jitter: a random delay in
 * `[0, min(capMs, baseMs * 2^(failures - 1))]`, and never less than a
 * channel's retry-after.
 *
 * @param failures how many attempts failed so far (1 after the first failure)
 * @param backoff base and cap
 * @param retryAfterMs the channel's Retry-After, if any
 * @param random a random source in [0, 1)
 * @returns the delay in ms
 */
export function retryDelay(
  failures: number,
  backoff: ResolvedBackoff,
  retryAfterMs?: number,
  random: () => number = Math.random,
): number {
  const exp = Math.min(backoff.capMs, backoff.baseMs * 2 ** Math.min(Math.max(0, failures - 1), 52));
  const jittered = Math.floor(random() * exp);
  return retryAfterMs !== undefined && retryAfterMs > jittered ? Math.ceil(retryAfterMs) : jittered;
}
