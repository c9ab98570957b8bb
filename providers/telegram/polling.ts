/**
 * Long polling: the `getUpdates` loop, whose `offset` (what Telegram may
 * forget) moves only past updates the bot has admitted.
 *
 * @module
 */
import { delay } from "../../src/runtime/mod.ts";
import { ProviderError } from "../../src/errors.ts";
import type { InboundSink } from "../../src/provider.ts";
import { showValue as show } from "../../src/show.ts";
import type { BotApiCall } from "./api.ts";
import type { Delivery } from "./delivery.ts";
import { MESSAGE_UPDATES } from "./updates.ts";
import { asError, isObj } from "./values.ts";

/** What the poller needs of the provider. */
export interface PollerSettings {
  /** Bot API calls (`getUpdates`). */
  call: BotApiCall;
  /** Hands an update to the bot. */
  deliver(sink: InboundSink, update: unknown): Promise<Delivery>;
  /** Reports a problem no caller sees. */
  report(error: Error): void;
  /** Long-poll `timeout` of `getUpdates`, in seconds. */
  pollTimeoutSec: number;
  /** How long one API call may take, in ms (a long poll gets `pollTimeoutSec` on top). */
  requestTimeoutMs: number;
  /** `allowed_updates` of `getUpdates`. */
  allowedUpdates: readonly string[];
  /** The backoff after a failed `getUpdates` or a refused admission. */
  backoff: { baseMs: number; capMs: number };
}

/** The `getUpdates` loop of one provider. */
export class Poller {
  readonly #settings: PollerSettings;
  #stopper: AbortController | undefined;
  #loop: Promise<void> | undefined;
  #offset: number | undefined;
  /** The offset the last successful getUpdates confirmed. */
  #confirmed: number | undefined;

  /**
   * Make the poller; nothing is called until `start()`.
   *
   * @param settings the Bot API, the delivery and the polling options
   */
  constructor(settings: PollerSettings) {
    this.#settings = settings;
  }

  /**
   * Start the loop.
   *
   * @param sink where updates go
   */
  start(sink: InboundSink): void {
    const stopper = new AbortController();
    this.#stopper = stopper;
    this.#loop = this.#pollLoop(sink, stopper.signal);
  }

  /**
   * Abort the long poll under way and resolve once the loop ended. Updates
   * admitted since the last `getUpdates` are then confirmed with one short
   * `getUpdates` (`timeout: 0`), so that a restart does not fetch them again
   * (they would be dropped as duplicates anyway).
   */
  async stop(): Promise<void> {
    const { call, allowedUpdates, requestTimeoutMs } = this.#settings;
    this.#stopper?.abort();
    await this.#loop;
    this.#loop = undefined;
    this.#stopper = undefined;
    const offset = this.#offset;
    if (offset !== undefined && offset !== this.#confirmed) {
      try {
        await call("getUpdates", { offset, timeout: 0, limit: 1, allowed_updates: allowedUpdates }, {
          timeoutMs: Math.min(requestTimeoutMs, 5_000),
        });
        this.#confirmed = offset;
      } catch (error) {
        this.#settings.report(new Error(`Telegram getUpdates could not confirm offset ${offset} on stop (those updates come again after a restart and are dropped as duplicates)`, { cause: error }));
      }
    }
  }

  async #pollLoop(sink: InboundSink, signal: AbortSignal): Promise<void> {
    const { call, pollTimeoutSec, requestTimeoutMs, allowedUpdates } = this.#settings;
    let failures = 0;
    while (!signal.aborted) {
      let updates: unknown;
      const offset = this.#offset;
      try {
        updates = await call("getUpdates", {
          ...(offset !== undefined ? { offset } : {}),
          timeout: pollTimeoutSec,
          allowed_updates: allowedUpdates,
        }, { signal, timeoutMs: requestTimeoutMs + pollTimeoutSec * 1000 });
        if (!Array.isArray(updates)) {
          throw new ProviderError(`Telegram getUpdates answered a "result" that is not an array: ${show(updates)}`, { retryable: true });
        }
      } catch (error) {
        if (signal.aborted) break;
        failures++;
        const err = asError(error);
        const status = err instanceof ProviderError ? err.status : undefined;
        const hint = status === 409
          ? " (another getUpdates is running with this token, or a webhook is set: call deleteWebhook or set deleteWebhookOnStart)"
          : status === 401 || status === 404
          ? " (the token is wrong or revoked)"
          : "";
        this.#settings.report(new Error(`Telegram long polling failed${hint}: ${err.message}`, { cause: err }));
        const retryAfter = err instanceof ProviderError ? err.retryAfterMs : undefined;
        await delay(this.#pollDelay(failures, retryAfter, status === 401 || status === 404), signal).catch(() => {}); // an abort ends the wait
        continue;
      }
      this.#confirmed = offset;
      failures = Math.max(0, failures - 1);
      const next = await this.#admitBatch(sink, updates);
      if (next.offset !== undefined) this.#offset = next.offset;
      if (next.rejected) {
        failures++;
        await delay(this.#pollDelay(failures, undefined, false), signal).catch(() => {});
      } else {
        failures = 0;
      }
    }
  }

  #pollDelay(failures: number, retryAfterMs: number | undefined, atCap: boolean): number {
    const { baseMs, capMs } = this.#settings.backoff;
    const exp = atCap ? capMs : Math.min(capMs, baseMs * 2 ** Math.min(failures - 1, 30));
    const ms = Math.max(exp / 2 + Math.random() * exp / 2, retryAfterMs ?? 0);
    return Math.ceil(ms);
  }

  /** Admit one batch: per chat in order, chats in parallel; the offset to confirm next. */
  async #admitBatch(sink: InboundSink, updates: unknown[]): Promise<{ offset: number | undefined; rejected: boolean }> {
    const chats = new Map<string, unknown[]>();
    let maxId: number | undefined;
    let minId: number | undefined;
    for (const update of updates) {
      const raw = isObj(update) && typeof update.update_id === "number" && Number.isSafeInteger(update.update_id) ? update.update_id : undefined;
      if (raw !== undefined) maxId = maxId === undefined ? raw : Math.max(maxId, raw);
      if (raw !== undefined) minId = minId === undefined ? raw : Math.min(minId, raw);
      const chat = chatKeyOf(update);
      const list = chats.get(chat);
      if (list) list.push(update);
      else chats.set(chat, [update]);
    }
    let lowestRejected: number | undefined;
    let unconfirmable = false;
    await Promise.all([...chats.values()].map(async (list) => {
      for (const update of list) {
        const { outcome } = await this.#settings.deliver(sink, update);
        if (outcome === "retry") {
          const raw = isObj(update) ? update.update_id : undefined;
          // Without an update_id of its own, nothing of this batch is confirmed: it all comes again.
          const id = typeof raw === "number" && Number.isSafeInteger(raw) ? raw : minId;
          if (id === undefined) unconfirmable = true;
          else lowestRejected = lowestRejected === undefined ? id : Math.min(lowestRejected, id);
          return; // later updates of this chat must not overtake it
        }
      }
    }));
    if (unconfirmable) return { offset: undefined, rejected: true };
    if (lowestRejected !== undefined) return { offset: lowestRejected, rejected: true };
    return { offset: maxId === undefined ? undefined : maxId + 1, rejected: false };
  }
}

/** The chat an update belongs to, for ordering (malformed ones each on their own). */
function chatKeyOf(update: unknown): string {
  if (!isObj(update)) return "?";
  for (const key of MESSAGE_UPDATES) {
    const m = update[key];
    if (isObj(m) && isObj(m.chat) && m.chat.id !== undefined) return `c:${String(m.chat.id)}`;
  }
  const q = update.callback_query;
  if (isObj(q)) {
    if (isObj(q.message) && isObj(q.message.chat) && q.message.chat.id !== undefined) return `c:${String(q.message.chat.id)}`;
    if (isObj(q.from) && q.from.id !== undefined) return `c:${String(q.from.id)}`;
  }
  return `u:${String(update.update_id)}`;
}
