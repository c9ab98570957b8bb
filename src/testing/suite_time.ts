/**
 * The time of one conformance test: a {@link TestClock} when the suite runs
 * in simulated time, else the real clock (not exported from `/testing`).
 *
 * @module
 */
import { type Clock, systemClock } from "../clock.ts";
import type { DurabilityBackend } from "../contract.ts";
import type { BackendConformanceOptions, ConformanceContext } from "./conformance.ts";
import { TestClock, trackCalls } from "./test_clock.ts";
import { sleep as realSleep } from "./util.ts";

/** One test's clock, its sleeps, and the backends it created (tracked views in simulated time). */
export class SuiteTime {
  /** The clock of the test: pass it to every `Bot`. */
  readonly clock: Clock;
  /** What `create` and `reopen` get. */
  readonly context: ConformanceContext;
  readonly #test: TestClock | null;
  readonly #raw = new WeakMap<object, object>();

  constructor(simulated: boolean) {
    this.#test = simulated ? new TestClock() : null;
    const clock: Clock = this.#test ?? systemClock;
    this.clock = clock;
    this.context = { clock, now: () => clock.now(), simulated };
  }

  /** Whether time is simulated. */
  get simulated(): boolean {
    return this.#test !== null;
  }

  /** Resolves after `ms` on the test's clock. */
  sleep(ms: number): Promise<void> {
    return this.#test ? this.#test.sleep(ms) : realSleep(ms);
  }

  /** The test clock's wall-clock time. */
  now(): number {
    return this.clock.now();
  }

  /** Runs real work that simulated time waits for. */
  track<T>(work: () => T | Promise<T>): Promise<T> {
    if (this.#test) return this.#test.track(work) as Promise<T>;
    return (async () => await work())();
  }

  /** A fresh backend from `options.create`, as the test uses it. */
  async create(options: BackendConformanceOptions): Promise<DurabilityBackend> {
    return this.view(await this.track(() => options.create(this.context)), ["inbox", "outbox"]);
  }

  /** `options.reopen` of a backend the test used (given the backend `create` or `reopen` returned). */
  async reopen(
    reopen: NonNullable<BackendConformanceOptions["reopen"]>,
    backend: DurabilityBackend,
  ): Promise<DurabilityBackend> {
    return this.view(await this.track(() => reopen(this.raw(backend), this.context)), ["inbox", "outbox"]);
  }

  /** `options.damage` of a backend the test used: the backend to go on with. */
  async damage(
    damage: NonNullable<BackendConformanceOptions["damage"]>,
    backend: DurabilityBackend,
    journal: "inbox" | "outbox",
    id: string,
  ): Promise<DurabilityBackend> {
    const raw = this.raw(backend);
    const next = await this.track(() => damage(raw, journal, id, this.context));
    return next === raw ? backend : this.view(next, ["inbox", "outbox"]);
  }

  /** `options.cleanup` of a backend the test used. */
  async cleanup(options: BackendConformanceOptions, backend: DurabilityBackend): Promise<void> {
    const cleanup = options.cleanup;
    if (cleanup) await this.track(() => cleanup(this.raw(backend)));
  }

  /** The object `create`/`reopen` returned behind a view the test used. */
  raw<T extends object>(view: T): T {
    return (this.#raw.get(view) as T | undefined) ?? view;
  }

  /** Ends the test's time: no timer of its clock fires any more. */
  stop(): void {
    this.#test?.stop();
  }

  /** A view of `raw` whose calls simulated time waits for (`raw` itself in real time). */
  view<T extends object>(raw: T, nested: readonly string[] = []): T {
    if (!this.#test) return raw;
    const view = trackCalls(raw, this.#test, nested);
    this.#raw.set(view, raw);
    return view;
  }
}
