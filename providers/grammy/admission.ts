/**
 * The admission of updates in a bot library's plugin (grammY's, Telegraf's): each update is journaled
 * before the webhook is answered or long polling confirms its offset, and an update the journal
 * refuses under long polling is asked for again by the next `getUpdates`, with a backoff.
 *
 * @module
 */
import type { Obj } from "../telegram/values.ts";
import type { GrammyProvider } from "./provider.ts";
import { updateRecord } from "./updates.ts";
import { abortableSleep, REFUSED_BACKOFF_MS } from "./waits.ts";

/** What an {@link UpdateAdmission} uses of its plugin. */
export interface AdmissionHost {
  /** The provider the updates are journaled through (it has no sink while the core is stopped). */
  readonly provider: GrammyProvider;
  /** The library's name, in the refusal of a stopped bot (`grammY`, `Telegraf`). */
  readonly library: string;
  /** Whether the plugin's `stop()` was called. */
  stopped(): boolean;
  /** Starts the plugin (once; later calls return the same promise). */
  start(): Promise<void>;
}

/** The updates a plugin admits into the journal, and the offset of its long polling. */
export class UpdateAdmission {
  readonly #host: AdmissionHost;
  /** Admissions under way: a `getUpdates` waits for them, so that it confirms only journaled updates. */
  readonly #admitting = new Set<Promise<unknown>>();
  /** Updates (by `update_id`) that the journal refused under long polling: `getUpdates` asks for them again. */
  readonly #refused = new Set<number>();
  #backoffMs: number = REFUSED_BACKOFF_MS[0];
  /** Whether updates come by long polling (a `getUpdates` went through the plugin). */
  #polling = false;
  /** While the library's own stop ends its polling: its last `getUpdates` (which confirms the offset) does not back off. */
  #pollStopping = false;

  /**
   * @param host the plugin
   */
  constructor(host: AdmissionHost) {
    this.#host = host;
  }

  /**
   * Track an admission until it settles: a `getUpdates`, `idle()` and `stop()` wait for it.
   *
   * @param work the admission
   * @returns resolves or rejects as `work` does
   */
  async track(work: Promise<void>): Promise<void> {
    this.#admitting.add(work);
    try {
      await work;
    } finally {
      this.#admitting.delete(work);
    }
  }

  /**
   * The admissions under way now.
   *
   * @returns them
   */
  underWay(): Promise<unknown>[] {
    return [...this.#admitting];
  }

  /**
   * Journal an update (starting the plugin first unless it is stopped).
   *
   * @param update the update as the library hands it over
   * @param byWebhook whether a webhook delivered it
   * @returns resolves once the update is journaled (or a duplicate), or refused under long polling (the
   *   next `getUpdates` asks Telegram for it again)
   * @throws the refusal, or what journaling threw: a webhook answers with an error and Telegram delivers
   *   the update again; any other caller of `handleUpdate` is told by it
   */
  async admit(update: unknown, byWebhook: boolean): Promise<void> {
    const host = this.#host;
    if (!host.stopped()) await host.start();
    const provider = host.provider;
    const message = await updateRecord(update, provider.connectionId, provider.seal);
    const sink = provider.sink;
    const result = sink === undefined
      ? { status: "rejected" as const, error: new Error(`The durable ${host.library} bot is stopped; Telegram delivers the update again`) }
      : await sink.receive(message);
    const updateId = (update as { update_id: number }).update_id;
    if (result.status !== "rejected") {
      this.#refused.delete(updateId);
      return;
    }
    // Long polling (the library's own, or grammY's runner) must not stop, or it would confirm the offset:
    // the next getUpdates asks Telegram for the update again instead.
    if (byWebhook || !this.#polling) throw result.error;
    this.#refused.add(updateId);
  }

  /**
   * Before a `getUpdates`: its offset must not confirm an update that is not journaled. Waits for the
   * admissions under way; while the journal refuses updates, asks for the first refused one again,
   * after a backoff.
   *
   * @param payload the `getUpdates` payload
   * @param signal the call's abort signal (ends the backoff early)
   * @returns the payload to call with
   */
  async beforePoll(payload: Obj, signal: AbortSignal | undefined): Promise<Obj> {
    this.#polling = true;
    while (this.#admitting.size > 0) await Promise.allSettled([...this.#admitting]);
    if (this.#refused.size === 0 || typeof payload.offset !== "number") {
      this.#backoffMs = REFUSED_BACKOFF_MS[0];
      return payload;
    }
    const first = Math.min(...this.#refused);
    if (payload.offset <= first) return payload;
    // Stopped, every update is refused: a poller still running (grammY's runner) backs off too, it does
    // not spin. Only the library's own stop confirms the offset at once.
    if (!this.#pollStopping) {
      await abortableSleep(this.#backoffMs, signal);
      this.#backoffMs = Math.min(REFUSED_BACKOFF_MS[1], this.#backoffMs * 2);
    }
    return { ...payload, offset: first };
  }

  /**
   * Run the library's own stop of its long polling: the `getUpdates` it confirms the offset with does
   * not back off.
   *
   * @param stop ends the library's polling
   * @returns resolves once `stop` did
   */
  async stoppingPolls(stop: () => Promise<void>): Promise<void> {
    this.#pollStopping = true;
    try {
      await stop();
    } finally {
      this.#pollStopping = false;
    }
  }
}
