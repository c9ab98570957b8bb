/**
 * The crash harness: a backend wrapper that "kills the process" at a chosen
 * journal step, and a provider that dies with it.
 *
 * @module
 */
import type { DurabilityBackend, InboxJournal, OutboxJournal } from "../contract.ts";
import { PROCESS_DEATH } from "../errors.ts";
import type { InboundSink, OutboundContent, Provider, SendContext, SendReceipt } from "../provider.ts";
import { MockProvider, type MockInbound, type SentMessage } from "./mock_provider.ts";
import type { AdmitResult } from "../provider.ts";
import type { LoadedMedia, MediaLoadContext, StoredMediaRef } from "../media.ts";
import type { SessionStore } from "../store.ts";

/** Every step at which the harness can crash. */
export const CRASH_POINTS = [
  "inbox.admit",
  "inbox.claim",
  "inbox.start",
  "inbox.heartbeat",
  "inbox.schedule",
  "inbox.complete",
  "inbox.fail",
  "inbox.replay",
  "inbox.purge",
  "inbox.reportDamaged",
  "outbox.reserve",
  "outbox.reserveCalling",
  "outbox.claim",
  "outbox.heartbeat",
  "outbox.markCalling",
  "provider.send",
  "step.call",
  "outbox.markSent",
  "outbox.markFailed",
  "outbox.retry",
  "outbox.discard",
  "outbox.purge",
  "outbox.reportDamaged",
  "store.set",
] as const;

/**
 * A step at which the harness can crash. `outbox.reserve` is every reservation; `outbox.reserveCalling`
 * only one that announces its call in the same write (`reserve` with `calling: true`, a send that goes
 * out at once): it is both points.
 */
export type CrashPoint = (typeof CRASH_POINTS)[number];

/** What every operation throws once the simulated process has died. */
export class SimulatedCrash extends Error {
  readonly point: CrashPoint | undefined;
  constructor(point: CrashPoint | undefined, when: "before" | "after" | "dead") {
    super(
      when === "dead"
        ? `The process died earlier (at "${point}"); nothing it does takes effect`
        : `Simulated crash ${when} "${point}"`,
    );
    this.name = "SimulatedCrash";
    this.point = point;
    Object.defineProperty(this, PROCESS_DEATH, { value: true });
  }
}

const INBOX_POINTS: Record<keyof InboxJournal, CrashPoint | null> = {
  admit: "inbox.admit",
  claim: "inbox.claim",
  claimDue: "inbox.claim",
  start: "inbox.start",
  heartbeat: "inbox.heartbeat",
  schedule: "inbox.schedule",
  complete: "inbox.complete",
  fail: "inbox.fail",
  replay: "inbox.replay",
  purge: "inbox.purge",
  reportDamaged: "inbox.reportDamaged",
  get: null,
  list: null,
  damaged: null,
};

const OUTBOX_POINTS: Record<keyof OutboxJournal, CrashPoint | null> = {
  reserve: "outbox.reserve",
  claimDue: "outbox.claim",
  heartbeat: "outbox.heartbeat",
  markCalling: "outbox.markCalling",
  markSent: "outbox.markSent",
  markFailed: "outbox.markFailed",
  retry: "outbox.retry",
  discard: "outbox.discard",
  purge: "outbox.purge",
  reportDamaged: "outbox.reportDamaged",
  get: null,
  list: null,
  damaged: null,
};

/** When to crash: at the `at`-th call of the point from now on (default 1). */
export interface CrashOptions {
  at?: number;
}

/** A backend that can be made to crash; see {@link crashable}. */
export interface CrashableBackend extends DurabilityBackend {
  /** Die just before the `at`-th call of `point` (it never takes effect). */
  crashBefore(point: CrashPoint, options?: CrashOptions): void;
  /** Die just after the `at`-th call of `point` took effect (its result is never seen). */
  crashAfter(point: CrashPoint, options?: CrashOptions): void;
  /** Whether the simulated process died. */
  readonly crashed: boolean;
  /** Where it died. */
  readonly crashedAt: CrashPoint | undefined;
  /** How often each point was reached. */
  readonly hits: Readonly<Record<string, number>>;
  /**
   * Operations that were under way when the process died and took effect in
   * the backend afterwards (a real write in flight at the crash): the dead
   * process never saw them succeed, so it never acted on them (no event).
   * `id` is the record id or outbox key the operation was called with.
   */
  readonly landedAfterCrash: readonly { point: CrashPoint; id: string }[];
  /**
   * Outbox keys whose provider call was announced in the journal (`markCalling` took effect with
   * `true`, or a reservation wrote its entry leased with `called`), whether or not the process lived
   * to see it: the only sends of this process that may become ambiguous without a provider call.
   */
  readonly announced: ReadonlySet<string>;
  /** Run `fn` as the step `point` (used by {@link CrashableProvider} for `'provider.send'`). */
  step<T>(point: CrashPoint, fn: () => Promise<T>): Promise<T>;
}

/**
 * Wrap a backend so that a test can crash the "process" at any journal step.
 * After the crash every operation through the wrapper fails, and results of
 * operations that were under way are never seen, as if the process had died;
 * a second bot on the inner backend then recovers.
 *
 * @param backend the shared state (for example a `MemoryDurability`)
 * @returns the crashable wrapper
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { crashable, CrashableProvider, MockProvider } from "@botmesh/durable/testing";
 * const shared = new MemoryDurability();
 * const a = crashable(shared);
 * a.crashBefore("outbox.markSent");
 * const botA = new Bot({ provider: new CrashableProvider(a), durability: { backend: a, instanceId: "i1" } });
 * ```
 */
export function crashable(backend: DurabilityBackend): CrashableBackend {
  const plans = new Map<CrashPoint, { when: "before" | "after"; at: number }>();
  const hits: Record<string, number> = {};
  let crashedAt: CrashPoint | undefined;
  let crashed = false;
  const landedAfterCrash: { point: CrashPoint; id: string }[] = [];
  const announced = new Set<string>();

  const die = (point: CrashPoint, when: "before" | "after"): never => {
    crashed = true;
    crashedAt = point;
    throw new SimulatedCrash(point, when);
  };

  const step = async <T>(points: CrashPoint | readonly CrashPoint[] | null, fn: () => Promise<T>, id?: unknown): Promise<T> => {
    if (crashed) throw new SimulatedCrash(crashedAt, "dead");
    let plan: { when: "before" | "after"; at: number } | undefined;
    let point: CrashPoint | null = null;
    for (const p of points === null ? [] : typeof points === "string" ? [points] : points) {
      point ??= p;
      hits[p] = (hits[p] ?? 0) + 1;
      const planned = plans.get(p);
      if (planned && --planned.at <= 0 && plan === undefined) {
        plans.delete(p);
        plan = planned;
        point = p;
      }
    }
    if (point !== null && plan?.when === "before") die(point, "before");
    let result: T;
    try {
      result = await fn();
    } catch (error) {
      if (crashed) throw new SimulatedCrash(crashedAt, "dead");
      // "After" means after the call returned, whatever it returned: a failed call consumes the plan too.
      if (plan?.when === "after") die(point!, "after");
      throw error;
    }
    if (crashed) {
      // The process died while this was under way: it took effect, but nobody saw it.
      if (point !== null && typeof id === "string") landedAfterCrash.push({ point, id });
      throw new SimulatedCrash(crashedAt, "dead");
    }
    if (plan?.when === "after") die(point!, "after");
    return result;
  };

  const wrap = <J extends object>(journal: J, points: Record<keyof J, CrashPoint | null>): J => {
    const wrapped = {} as Record<string, unknown>;
    for (const method of Object.keys(points) as (keyof J & string)[]) {
      if (typeof journal[method] !== "function") continue; // an optional method the backend lacks
      wrapped[method] = (...args: unknown[]) =>
        step(
          points[method] === "outbox.reserve" && (args[1] as { calling?: unknown } | undefined)?.calling === true
            ? ["outbox.reserve", "outbox.reserveCalling"]
            : points[method],
          async () => {
            const result = await (journal[method] as (...a: unknown[]) => Promise<unknown>).apply(journal, args);
            if (points[method] === "outbox.markCalling" && result === true) announced.add(args[0] as string);
            if (points[method] === "outbox.reserve") {
              const reserved = result as { status?: string; entry?: { key?: string; called?: boolean } };
              if (reserved.status === "leased" && reserved.entry?.called === true) announced.add(reserved.entry.key!);
            }
            return result;
          },
          typeof args[0] === "object" && args[0] !== null
            ? ((args[0] as { id?: unknown; key?: unknown }).id ?? (args[0] as { key?: unknown }).key)
            : args[0],
        );
    }
    return wrapped as J;
  };

  const plan = (when: "before" | "after") => (point: CrashPoint, options?: CrashOptions) => {
    if (!(CRASH_POINTS as readonly string[]).includes(point)) {
      throw new RangeError(`Unknown crash point "${point}"; known points are ${CRASH_POINTS.join(", ")}`);
    }
    const at = options?.at ?? 1;
    if (!Number.isInteger(at) || at < 1) throw new RangeError(`Option "at" must be an integer of at least 1, got ${at}`);
    plans.set(point, { when, at });
  };

  return {
    name: `crashable(${backend.name})`,
    scope: backend.scope,
    inbox: wrap(backend.inbox, INBOX_POINTS),
    outbox: wrap(backend.outbox, OUTBOX_POINTS),
    open: () => step(null, async () => await backend.open?.()),
    close: () => step(null, async () => await backend.close?.()),
    crashBefore: plan("before"),
    crashAfter: plan("after"),
    get crashed() {
      return crashed;
    },
    landedAfterCrash,
    announced,
    get crashedAt() {
      return crashedAt;
    },
    hits,
    step: (point, fn) => step(point, fn),
  };
}

/**
 * A provider that dies with a {@link crashable} backend: its sends are the
 * crash point `'provider.send'`, and fail once the process died.
 */
export class CrashableProvider implements Provider {
  readonly name: string;
  readonly inner: MockProvider;
  #backend: CrashableBackend;

  /**
   * @param backend the crashable backend it dies with
   * @param inner the provider that does the work (default a new `MockProvider`)
   */
  constructor(backend: CrashableBackend, inner: MockProvider = new MockProvider()) {
    this.#backend = backend;
    this.inner = inner;
    this.name = inner.name;
  }

  /** What went out, in order. */
  get sent(): SentMessage[] {
    return this.inner.sent;
  }

  start(sink: InboundSink): void {
    this.inner.start(sink);
  }

  stop(): void {
    this.inner.stop();
  }

  /** Deliver an inbound message (see `MockProvider.receive`). */
  receive(input: MockInbound): Promise<AdmitResult> {
    return this.inner.receive(input);
  }

  /** Make the next `n` sends fail (see `MockProvider.failNext`). */
  failNext(n: number, error?: unknown): void {
    this.inner.failNext(n, error);
  }

  send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    return this.#backend.step("provider.send", () => this.inner.send(chatId, content, context));
  }

  /** Load media again (see `MockProvider.loadMedia`); fails once the process died. */
  loadMedia(media: StoredMediaRef, context: MediaLoadContext): Promise<LoadedMedia> {
    if (this.#backend.crashed) return Promise.reject(new SimulatedCrash(this.#backend.crashedAt, "dead"));
    return this.inner.loadMedia(media, context);
  }
}

/**
 * A session store that dies with a {@link crashable} backend: each `set` (a
 * conversation's transcript, a session) is the crash point `'store.set'`, and
 * every call fails once the process died.
 *
 * @param backend the crashable backend it dies with
 * @param store the store that keeps the data (shared with the next "process")
 * @returns the wrapped store
 */
export function crashableStore(backend: CrashableBackend, store: SessionStore): SessionStore {
  const alive = () => {
    if (backend.crashed) throw new SimulatedCrash(backend.crashedAt, "dead");
  };
  return {
    get: async (key) => {
      alive();
      const value = await store.get(key);
      alive();
      return value;
    },
    set: (key, value, options) => backend.step("store.set", () => store.set(key, value, options)),
    delete: async (key) => {
      alive();
      await store.delete(key);
      alive();
    },
  };
}
