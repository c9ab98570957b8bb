/**
 * **Internal building block** of the snapshot-file backends
 * (`FileDurability` in `./durability.ts`, `FileEventJournal` in
 * `../events/file_journal.ts`); not exported by the package.
 *
 * {@link SnapshotCommitter} holds a backend's in-memory state and makes it
 * durable by rewriting the whole snapshot file, with group commit:
 *
 * - A version counter is bumped per change ({@link SnapshotCommitter.changed});
 *   an operation waits until the version it observed is on disk
 *   ({@link SnapshotCommitter.waitDurable}).
 * - One write loop at a time: operations called in the same tick join one
 *   rewrite, and each rewrite settles every waiter whose target it covers.
 * - A failed rewrite rejects every waiter (their changes were all made on the
 *   state that could not be written), bumps the generation (an operation that
 *   ran on the discarded state rejects), and reloads the state from the file
 *   (operations wait for the reload); when the reload fails too, the
 *   committer is failed ({@link SnapshotCommitter.failure}) until the next
 *   {@link SnapshotCommitter.attach}.
 * - {@link SnapshotCommitter.crash} lets it go as a killed process would: a
 *   write under way finishes, waiting and later operations reject.
 *
 * The backend keeps its lifecycle (open/close, lock file, registration of
 * the file) and supplies the format ({@link SnapshotCommitterOptions.serialize},
 * {@link SnapshotCommitterOptions.parse}, or a write and reload of its own such
 * as an append-only log) and the check of the state an operation runs on
 * ({@link SnapshotCommitterOptions.current}).
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import { StaleLeaseError } from "../../src/contract.ts";
import { readFileBytes } from "../../src/runtime/fs.ts";
import { writeSnapshot } from "./snapshot.ts";

/** Rewrite counters of a {@link SnapshotCommitter}. */
export interface SnapshotCommitStats {
  /** Snapshot rewrites that reached the disk. */
  rewrites: number;
  /** Rewrites that failed (their operations were rejected). */
  failedRewrites: number;
  /** Size of the last snapshot written, in UTF-16 code units of its JSON text. */
  lastSnapshotChars: number;
  /** Duration of the last successful rewrite in ms (serialization, write, flushes and rename). */
  lastRewriteMs: number;
}

/** The backend-specific parts of a {@link SnapshotCommitter}. */
export interface SnapshotCommitterOptions<S> {
  /** The backend named in error messages, e.g. `"FileDurability"`. */
  label: string;
  /** The snapshot file (its absolute real path once open). */
  file: () => string;
  /** Flush every rewrite (file and directory) before its waiters resolve. */
  fsync: boolean;
  /** Permission bits of the file, kept across rewrites. */
  mode: () => number;
  /** The whole state as the snapshot's text; synchronous, so the snapshot is consistent. */
  serialize?: (state: S) => string;
  /** The state from the file's bytes (after a failed rewrite); throws when they are damaged. */
  parse?: (file: string, bytes: Uint8Array) => S;
  /**
   * Makes the state durable in a way of the backend's own (an append to a log, say) instead of
   * {@link serialize} and a whole rewrite; it keeps its own size counters.
   */
  write?: (state: S) => Promise<void>;
  /**
   * The state as the files hold it, after a failed write, instead of reading and {@link parse}-ing
   * the snapshot; throws when it cannot be had (the committer is then failed).
   */
  reload?: (failure: Error) => Promise<S>;
  /**
   * The state an operation runs on: {@link SnapshotCommitter.state}, or
   * throws when the backend is not open, was let go, or is failed
   * ({@link SnapshotCommitter.failure}).
   */
  current: () => S;
  /** How the state was replaced after a failed rewrite, in the error of a discarded operation: `"rebuilt"` or `"reloaded"`. */
  reloaded: string;
  /** The end of the failed state's message, after `Every operation rejects`: how to recover. */
  recovery: string;
}

/** An operation waiting for the state it observed (`target`) to be on disk. */
interface Waiter {
  target: number;
  resolve: () => void;
  reject: (error: unknown) => void;
}


/**
 * Group commit of an in-memory state into one snapshot file (see the
 * module). Internal: used by `FileDurability` and `FileEventJournal`.
 */
export class SnapshotCommitter<S> {
  readonly #options: SnapshotCommitterOptions<S>;
  /** The state while attached (open); `null` when detached (closed) or let go. */
  #state: S | null = null;
  /** Set when a reload after a failed rewrite failed: every operation rejects with it until the next attach. */
  #failure: Error | null = null;
  /** Let go by {@link crash}: never used again. */
  #crashed = false;
  /** Bumped when the state is reloaded from the file after a failed rewrite. */
  #generation = 0;
  /** The reload under way: operations wait for it. */
  #reloading: Promise<void> | null = null;
  /** Bumped after each change. */
  #version = 0;
  /** The version on disk. */
  #durable = 0;
  /** Waiting operations, in nondecreasing `target` order. */
  #waiters: Waiter[] = [];
  /** The write loop, while it runs. */
  #writing: Promise<void> | null = null;
  readonly #stats: SnapshotCommitStats = { rewrites: 0, failedRewrites: 0, lastSnapshotChars: 0, lastRewriteMs: 0 };

  /** @param options the backend's format, checks and wording */
  constructor(options: SnapshotCommitterOptions<S>) {
    if (!options.serialize && !options.write) throw new TypeError("SnapshotCommitter needs serialize or write");
    if (!options.parse && !options.reload) throw new TypeError("SnapshotCommitter needs parse or reload");
    this.#options = options;
  }

  /** The state while attached, else `null`. */
  get state(): S | null {
    return this.#state;
  }

  /** The failed state (a reload after a failed rewrite failed), else `null`. */
  get failure(): Error | null {
    return this.#failure;
  }

  /** Whether {@link crash} was called. */
  get crashed(): boolean {
    return this.#crashed;
  }

  /** A copy of the rewrite counters. */
  get stats(): SnapshotCommitStats {
    return { ...this.#stats };
  }

  /** Takes `state` (loaded from the file, so on disk: version and durable version 0) and clears the failed state. */
  attach(state: S): void {
    this.#state = state;
    this.#failure = null;
    this.#version = this.#durable = 0;
  }

  /**
   * Drops the state and the failed state (closed, or a failed open); a
   * waiter left (one that slipped in after a failed final rewrite) is
   * rejected by the write loop.
   */
  detach(): void {
    this.#state = null;
    this.#failure = null;
    if (this.#waiters.length > 0) this.#writing ??= this.#writeLoop();
  }

  /** Records a change of the state (to be written by the next rewrite). */
  changed(): void {
    this.#version++;
  }

  /**
   * Records a change and waits for it to be on disk (a new file written at
   * open, so a bad path or permission shows at once).
   *
   * @throws the rewrite's error, or the failed state
   */
  async writeNow(): Promise<void> {
    this.#version++;
    await this.waitDurable(this.#version);
    if (this.#failure !== null) throw this.#failure;
  }

  /**
   * Resolves once version `target` (default: every change so far) is on
   * disk; rejects when its rewrite fails or the committer is let go.
   */
  waitDurable(target: number = this.#version): Promise<void> {
    if (target <= this.#durable) return Promise.resolve();
    if (this.#crashed) return Promise.reject(this.#crashError());
    return new Promise<void>((resolve, reject) => {
      this.#waiters.push({ target, resolve, reject });
      this.#writing ??= this.#writeLoop();
    });
  }

  /**
   * The last close of a backend: `settle` (wait for operations and write what
   * is left), then detach the state and `release` (the lock, the registry)
   * whatever happened. Throws the write failure, the release failure, or both
   * as an `AggregateError` (the write failure first).
   *
   * @param settle waits for the operations under way and flushes
   * @param release lets go of the lock and the in-process registration
   */
  async close(settle: () => Promise<void>, release: () => Promise<void>): Promise<void> {
    let failure: unknown = null;
    let releaseFailure: unknown = null;
    try {
      await settle();
    } catch (error) {
      failure = error;
    } finally {
      if (failure === null && this.failure !== null) failure = this.failure;
      this.detach(); // rejects operations that slipped in after a failed final rewrite
      try {
        await release();
      } catch (error) {
        releaseFailure = error;
      }
    }
    if (failure !== null && releaseFailure !== null) {
      throw new AggregateError(
        [failure, releaseFailure],
        `${errorMessage(failure)} (releasing the lock file failed too: ${errorMessage(releaseFailure)})`,
        { cause: failure },
      );
    }
    if (failure !== null) throw failure;
    if (releaseFailure !== null) throw releaseFailure;
  }

  /**
   * Waits until the write loop is idle and every change is on disk (for
   * `close()`).
   *
   * @param options `untilCrash`: stop, without an error, once the committer is let go
   * @throws the error of a failed rewrite, or of being let go
   */
  async flush(options: { untilCrash?: boolean } = {}): Promise<void> {
    while (!(options.untilCrash && this.#crashed) && (this.#writing !== null || this.#durable < this.#version)) {
      if (this.#writing !== null) await this.#writing;
      else await this.waitDurable(this.#version);
    }
  }

  /**
   * Runs one operation on the state ({@link SnapshotCommitterOptions.current},
   * after a reload under way) and resolves once what it observed is on disk.
   * `changed` says whether it changed the state (from its result, or asking
   * the state). A {@link StaleLeaseError} also waits for what it observed
   * (the claim that took the lease) to be on disk. An operation that ran on
   * a state discarded by a reload (after a failed rewrite) rejects.
   */
  async run<T>(operation: (state: S) => Promise<T>, changed: (result: T, state: S) => boolean): Promise<T> {
    while (this.#reloading !== null) await this.#reloading;
    const state = this.#options.current();
    const generation = this.#generation;
    let result: T;
    try {
      result = await operation(state);
    } catch (error) {
      if (generation !== this.#generation) throw this.#discardedError();
      if (error instanceof StaleLeaseError) await this.waitDurable(this.#version);
      throw error;
    }
    // Between the change in memory and the waiter's registration, a failed rewrite may have reloaded the state.
    if (generation !== this.#generation) throw this.#discardedError();
    if (changed(result, state)) this.#version++;
    await this.waitDurable(this.#version);
    return result;
  }

  /**
   * Lets the committer go as a killed process: waiting operations reject, a
   * write under way finishes (as the kernel would finish a rename), then the
   * state is dropped; later operations reject.
   */
  async crash(): Promise<void> {
    this.#crashed = true;
    const error = this.#crashError();
    for (const waiter of this.#waiters.splice(0)) waiter.reject(error);
    if (this.#writing !== null) await this.#writing;
    this.#state = null;
  }

  #discardedError(): Error {
    const { label, file, reloaded } = this.#options;
    return new Error(
      `${label} could not write ${file()}: a failed rewrite discarded the state this operation ran on ` +
        `(it was ${reloaded} from the file); the operation did not take effect`,
    );
  }

  #crashError(): Error {
    return new Error(
      `${this.#options.label} ${this.#options.file()} was let go by simulateCrash() before this change was written`,
    );
  }

  /** Rewrites the file until every waiter is settled; each rewrite serves every waiter that arrived before it. */
  async #writeLoop(): Promise<void> {
    const { label, file } = this.#options;
    try {
      await null; // operations called in the same tick join this rewrite
      while (this.#waiters.length > 0) {
        if (this.#crashed || this.#state === null) {
          // Let go (simulateCrash) or closed after a failed final rewrite: nothing more will be written.
          const error = this.#crashed
            ? this.#crashError()
            : new Error(`${label} ${file()} was closed before this change was written`);
          for (const waiter of this.#waiters.splice(0)) waiter.reject(error);
          break;
        }
        const version = this.#version;
        try {
          await this.#rewrite(this.#state);
        } catch (error) {
          this.#stats.failedRewrites++;
          const failure = new Error(`${label} could not write ${file()}: ${errorMessage(error)}`, { cause: error });
          // Every waiting operation's change is on the state that could not be written, not only those the
          // failed rewrite covered: reject them all and reload the state from the file.
          this.#generation++;
          const waiters = this.#waiters.splice(0);
          const reload = this.#reload(failure);
          this.#reloading = reload;
          try {
            await reload;
          } finally {
            this.#reloading = null;
          }
          for (const waiter of waiters) waiter.reject(failure);
          continue;
        }
        this.#durable = Math.max(this.#durable, version);
        let settled = 0;
        while (settled < this.#waiters.length && this.#waiters[settled].target <= version) settled++;
        for (const waiter of this.#waiters.splice(0, settled)) waiter.resolve();
      }
    } finally {
      this.#writing = null;
    }
  }

  /**
   * After a failed rewrite: replaces the state with the file's (the last
   * snapshot written; the rename is atomic), or, when the file cannot be
   * read, enters the failed state. Never rejects.
   */
  async #reload(failure: Error): Promise<void> {
    const { label, file: fileOf, parse, reload, recovery } = this.#options;
    const file = fileOf();
    try {
      let state: S;
      if (reload) state = await reload(failure);
      else {
        const bytes = await readFileBytes(file);
        if (bytes === null) throw new Error("the file is gone (deleted, or its directory was)");
        state = parse!(file, bytes);
      }
      if (this.#state !== null && !this.#crashed) this.#state = state;
    } catch (error) {
      this.#failure = new Error(
        `${label} could not write ${file} (${errorMessage(failure.cause)}) nor reload it to drop the unwritten ` +
          `changes (${errorMessage(error)}). Every operation rejects${recovery}`,
        { cause: failure },
      );
    }
    this.#durable = this.#version; // memory holds only what is on disk (or nothing more will be written)
  }

  /** One snapshot rewrite: the state serialized, then an atomic replace keeping the file's mode. */
  async #rewrite(state: S): Promise<void> {
    const started = performance.now();
    const { write, serialize } = this.#options;
    if (write) await write(state);
    else {
      const text = serialize!(state);
      await writeSnapshot(this.#options.file(), text, { fsync: this.#options.fsync, mode: this.#options.mode() });
      this.#stats.lastSnapshotChars = text.length;
    }
    this.#stats.rewrites++;
    this.#stats.lastRewriteMs = performance.now() - started;
  }
}
