/**
 * The waits of a bot library's plugin (grammY's, Telegraf's): the backoff of long polling while the
 * journal refuses updates, and a journaled call's wait for a send Telegram's flood limit paused.
 *
 * @module
 */
import type { SendResult } from "../../src/engine.ts";
import type { OutboxEntry } from "../../src/contract.ts";
import type { GrammyProvider } from "./provider.ts";

/** The first retry of refused updates, and the most it backs off to. */
export const REFUSED_BACKOFF_MS: readonly [number, number] = [500, 30_000];
/** After a 429, how much longer than its `retry_after` a call waits for the outbox to send it. */
const FLOOD_GRACE_MS = 5_000;
/** How often a call paused by a 429 looks whether the outbox sent it. */
const FLOOD_POLL_MS = 50;

/**
 * Sleep `ms`, or less when `signal` aborts (the call that follows then fails with the library's abort error).
 *
 * @param ms how long
 * @param signal ends the sleep early
 * @returns resolves when slept
 */
export function abortableSleep(ms: number, signal: AbortSignal | undefined): Promise<void> {
  if (signal?.aborted) return Promise.resolve();
  return new Promise((resolve) => {
    const done = () => {
      clearTimeout(timer);
      signal?.removeEventListener("abort", done);
      resolve();
    };
    const timer = setTimeout(done, ms);
    signal?.addEventListener("abort", done, { once: true });
  });
}

/**
 * A send Telegram refused for its flood limit (429) is paused in the outbox, no attempt spent: the
 * caller waits for it to go out (the `retry_after`, then its slot) and gets the real answer, as
 * without the outbox. It gets the placeholder if the send is not out soon after, or the bot stops.
 *
 * @param result what the outbox answered the call
 * @param provider the provider that made the call (its answers and its 429s)
 * @param outbox reads the entry
 * @param stopped whether the bot is stopping
 * @returns the result to answer the call with
 */
export async function afterFlood(
  result: SendResult,
  provider: GrammyProvider,
  outbox: { get(key: string): Promise<OutboxEntry | null> },
  stopped: () => boolean,
): Promise<SendResult> {
  if (result.state !== "queued" && result.state !== "failed") return result;
  const retryAfterMs = provider.floodWaitOf(result.key);
  if (retryAfterMs === undefined) return result;
  const deadline = Date.now() + retryAfterMs + FLOOD_GRACE_MS;
  while (!stopped() && Date.now() < deadline) {
    await abortableSleep(FLOOD_POLL_MS, undefined);
    if (provider.hasAnswer(result.key)) return { key: result.key, state: "sent" };
    const entry = await outbox.get(result.key);
    if (entry === null) return result;
    if (entry.state === "sent") return { key: result.key, state: "sent", messageId: entry.messageId ?? "" };
    if (entry.state === "dead") return { key: result.key, state: "dead", ...(entry.error !== null ? { error: entry.error } : {}) };
  }
  return result;
}
