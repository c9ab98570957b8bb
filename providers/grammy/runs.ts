/**
 * The middleware runs of a bot library's plugin (grammY's, Telegraf's): each journaled update runs
 * the bot's middleware inside a run that its calls and session writes descend from, and that tells a
 * rerun (the record's second attempt or later) from the first.
 *
 * @module
 */
import type { Bot } from "../../src/bot.ts";
import type { SessionStore } from "../../src/store.ts";
import { type AsyncContext, createAsyncContext } from "../../src/runtime/async_context.ts";
import type { Obj } from "../telegram/values.ts";
import { checkStorageArguments, DurableStorage, type DurableStorageOptions } from "./storage.ts";
import { journaledUpdate } from "./updates.ts";

/** The middleware run a call descends from (one object per run). */
export interface MiddlewareRun {
  /** The inbound record id of the update being handled. */
  readonly id: string;
  /** Whether the run is a rerun: the record's second attempt or later. */
  readonly rerun: boolean;
}

/** The runs of one plugin's middleware. */
export class MiddlewareRuns {
  /** `null` before {@link init}, and where the runtime has no async context: no run is known then. */
  #context: AsyncContext<MiddlewareRun> | null = null;

  /**
   * Make the async context the runs are carried in (when the plugin starts).
   *
   * @returns resolves once made
   */
  async init(): Promise<void> {
    this.#context = await createAsyncContext();
  }

  /**
   * Hand every update `core` takes from its inbox to `handle`, inside its run.
   *
   * @param core the durability core
   * @param handle runs the bot's middleware for the update journaled in the record
   */
  route(core: Bot, handle: (update: Obj) => Promise<void>): void {
    core.when(() => true, (ctx) => {
      const update = journaledUpdate(ctx.message);
      const run = () => handle(update);
      return this.#context === null ? run() : this.#context.run({ id: ctx.message.id, rerun: ctx.attempt > 1 }, run);
    });
  }

  /**
   * The run the caller descends from.
   *
   * @returns it, `undefined` outside one
   */
  current(): MiddlewareRun | undefined {
    return this.#context?.get();
  }

  /**
   * A storage on `store` whose writes take effect with the run that makes them (see {@link DurableStorage}).
   *
   * @param core the durability core (the states of its inbound records)
   * @param store the session store
   * @param options `ttlMs`: each write expires after that long
   * @returns the storage
   * @throws {TypeError} when `store` is not a session store, or an option is unknown or of the wrong type
   * @throws {RangeError} when `ttlMs` is not a positive number
   */
  storage<T>(core: Bot, store: SessionStore, options: DurableStorageOptions | undefined): DurableStorage<T> {
    const ttlMs = checkStorageArguments(store, options);
    return new DurableStorage<T>(store, {
      current: () => this.current(),
      stateOf: async (id) => (await core.durability!.inbox.get(id))?.state ?? null,
    }, ttlMs);
  }
}
