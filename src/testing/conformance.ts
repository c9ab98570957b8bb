/**
 * The backend conformance suite: the journal contract of
 * {@link DurabilityBackend} as tests, run against every backend (memory,
 * generic kv, file, SQLite, Postgres, Redis, events journal) and usable by
 * third-party backend authors.
 *
 * The suite does not import a test runner: the caller passes its own
 * `describe`, `test` and `expect` (bun:test, jest, vitest, Deno's
 * `@std/testing/bdd` + `@std/expect`), so it runs under Bun, Deno and Node.
 *
 * Lease expiry is tested with small leases and sleeps: in real time by
 * default (shared backends take time from their server), or in simulated
 * time with `simulatedTime: true` for a backend whose clock can be injected
 * (each test then runs on its own {@link TestClock}, passed to `create`).
 *
 * @module
 */
import { uid } from "./util.ts";
import type { Clock } from "../clock.ts";
import { SuiteTime } from "./suite_time.ts";
import type { TestClock } from "./test_clock.ts";
import { expectExactJson, hostile } from "./exact_json.ts";
import { DamagedRecordError, StaleLeaseError } from "../contract.ts";
import { INBOX_MACHINE, type Machine, OUTBOX_MACHINE, type Refusal, type Transition } from "../machine.ts";
import type {
  ClaimOptions,
  DurabilityBackend,
  FailOutcome,
  InboundRecord,
  InboundState,
  JsonValue,
  NewInboundRecord,
  NewOutboxEntry,
  OutboxClaim,
  OutboxEntry,
  OutboxState,
  ReserveResult,
} from "../contract.ts";

/**
 * The token of the first claim of a record written pending or queued (fence 0): 2, never the token an
 * admission or a reservation leases under (1), so that a lease under token 1 is always its writer's.
 */
const FIRST_CLAIM = 2;

/** The matchers the suite uses (a subset of jest's / bun:test's). */
export interface ConformanceMatchers {
  toBe(expected: unknown): void;
  toEqual(expected: unknown): void;
  toBeGreaterThan(expected: number): void;
  toBeGreaterThanOrEqual(expected: number): void;
  toBeLessThan(expected: number): void;
  toBeLessThanOrEqual(expected: number): void;
  readonly not: ConformanceMatchers;
}

/**
 * The test-runner functions the suite needs, with jest / bun:test shapes.
 * `expect`'s second argument is a failure message (bun:test and Deno's
 * `@std/expect` print it; jest ignores it).
 */
export interface ConformanceHarness {
  describe: (name: string, fn: () => void) => void;
  test: ((name: string, fn: () => Promise<void> | void) => void) & {
    skip?: (name: string, fn: () => Promise<void> | void) => void;
  };
  expect: (actual: unknown, message?: string) => ConformanceMatchers;
}

/** What `create` and `reopen` of {@link BackendConformanceOptions} get: the test's clock. */
export interface ConformanceContext {
  /**
   * The clock of the test: a {@link TestClock} under `simulatedTime`, else
   * the real clock. Every `Bot` of the suite runs on it.
   */
  clock: Clock;
  /** `clock.now()`: pass it as the backend's clock option (`new MemoryDurability({ clock: context.now })`). */
  now: () => number;
  /** Whether the test runs in simulated time. */
  simulated: boolean;
}

/** Options of {@link runBackendContract}. */
export interface BackendConformanceOptions {
  /** The backend's name, used in the suite's title. */
  name: string;
  /**
   * A fresh backend over an empty journal, called once per test. A backend
   * on a shared server should use a namespace of its own per call (a key
   * prefix, a schema) and drop it in `cleanup`: the due-scan, limit and purge
   * tests count what they find. Ids are random per test all the same.
   * Under `simulatedTime`, the backend must take its time from
   * `context.now` (e.g. `clock: context.now`).
   */
  create: (context: ConformanceContext) => DurabilityBackend | Promise<DurabilityBackend>;
  /** Called after each test, after the backend's `close()`. */
  cleanup?: (backend: DurabilityBackend) => void | Promise<void>;
  /**
   * Simulates a process restart for the crash matrix: returns a new backend
   * over the same storage (not yet opened). The old one must be let go as a
   * killed process would (no new writes) and is never used again. Without it,
   * the recovering bot runs on the same backend object. `context` is the
   * test's, as given to `create`.
   */
  reopen?: (backend: DurabilityBackend, context: ConformanceContext) => DurabilityBackend | Promise<DurabilityBackend>;
  /**
   * Damages the stored form of one record in place, as a bad disk or a hand
   * edit would (e.g. its payload made invalid JSON, its state an unknown
   * word), for the damaged-records tests; resolves to the backend to go on
   * with (a file backend reopens over the edited file; others return
   * `backend`). Without it those tests are skipped: the backend keeps no
   * stored form that could be damaged (memory).
   */
  damage?: (
    backend: DurabilityBackend,
    journal: "inbox" | "outbox",
    id: string,
    context: ConformanceContext,
  ) => DurabilityBackend | Promise<DurabilityBackend>;
  /** The test runner's `describe`, `test` and `expect`. */
  harness: ConformanceHarness;
  /** A reason to skip the whole suite (e.g. the database is not reachable); `false` or absent runs it. */
  skip?: string | false;
  /**
   * Multiplies every lease, retry delay and sleep (default 1: leases of
   * 40 ms, sleeps of 100 ms). Raise it for a backend with slow round trips
   * in real time; simulated time needs no margin.
   */
  timeScale?: number;
  /**
   * Run every test in simulated time (default `false`): each test gets a
   * fresh {@link TestClock} in `create`'s context, the bots run on it, and the
   * suite's sleeps cost no real time. Virtual time stands still while a call
   * into the backend (or `create`, `reopen`, `cleanup`) is in flight, so slow
   * real I/O never lets a lease lapse. Only for a backend whose every time
   * read comes from `context.now` (not a server's clock).
   */
  simulatedTime?: boolean;
}

type Expect = ConformanceHarness["expect"];

/** FNV-1a of the JSON text: a stand-in for the engine's content hash. */
function hashOf(content: JsonValue): string {
  const text = JSON.stringify(content);
  let h = 0x811c9dc5;
  for (let i = 0; i < text.length; i++) {
    h ^= text.charCodeAt(i);
    h = Math.imul(h, 0x01000193) >>> 0;
  }
  return h.toString(16).padStart(8, "0");
}

function snapshot<T>(value: T): T {
  return JSON.parse(JSON.stringify(value)) as T;
}

function ids(list: readonly { id: string }[]): string[] {
  return list.map((r) => r.id);
}

function keys(list: readonly { key: string }[]): string[] {
  return list.map((e) => e.key);
}

/** JSON values that every backend must store and return unchanged. */
function tricky(): JsonValue {
  return {
    text: "héllo wörld — ünïcödé ✓ 你好 世界 مرحبا שלום 🎉👨‍👩‍👧‍👦 e\u0301",
    empty: "",
    quotes: "\"'`\\ \\n not a newline, a real one:\n\ttab\r\n",
    numbers: [0, 1, -1, 42.5, 0.1, -1234567.875, 9007199254740991, 1e21, 1e-7],
    bools: [true, false],
    nothing: null,
    emptyArray: [],
    emptyObject: {},
    "": "empty key",
    "ключ ✓": { nested: { deeper: [1, [2, [3, { four: "4" }]], { five: null }] } },
    list: [{ a: 1 }, { b: [] }, "x", null, false],
  };
}

/** About 100 KB of JSON. */
function large(): JsonValue {
  const rows: JsonValue[] = [];
  for (let i = 0; i < 500; i++) {
    rows.push({ i, text: `row ${i} ✓ ${"x".repeat(100)}`, flag: i % 2 === 0, nested: { n: i * 1.5 } });
  }
  return { blob: "ab€🎉".repeat(10_000), rows };
}

async function expectStale(expect: Expect, run: () => Promise<unknown>, what: string): Promise<void> {
  let error: unknown = undefined;
  try {
    await run();
  } catch (e) {
    error = e;
  }
  expect(error instanceof StaleLeaseError, `${what}: expected a StaleLeaseError, got ${String(error)}`).toBe(true);
}

/**
 * Registers the backend journal-contract tests (inbox and outbox of
 * {@link DurabilityBackend}) with the given test runner. Each test creates a
 * fresh backend (`create()`, then `open()` when present) and closes it
 * afterwards (`close()`, then `cleanup`). The whole suite takes about two
 * seconds at `timeScale` 1.
 *
 * @example
 * ```ts
 * import { describe, expect, test } from "bun:test";
 * import { runBackendContract } from "@botmesh/durable/testing";
 * import { MemoryDurability } from "@botmesh/durable";
 *
 * runBackendContract({
 *   name: "memory",
 *   create: () => new MemoryDurability(),
 *   harness: { describe, test, expect },
 * });
 * ```
 *
 * @example
 * ```ts ignore
 * // A backend on a server that may be absent:
 * runBackendContract({
 *   name: "postgres",
 *   create: () => new PostgresDurability({ sql, schema: `t_${crypto.randomUUID().slice(0, 8)}` }),
 *   cleanup: (b) => dropSchema(b),
 *   harness: { describe, test, expect },
 *   skip: process.env.DATABASE_URL ? false : "DATABASE_URL is not set",
 *   timeScale: 2,
 * });
 * ```
 */
export function runBackendContract(options: BackendConformanceOptions): void {
  const { describe, test, expect } = options.harness;
  const title = `durability backend contract: ${options.name}`;
  if (options.skip) {
    const reason = options.skip;
    console.warn(`[conformance] ${title} skipped: ${reason}`);
    describe(title, () => {
      (test.skip ?? test)(`skipped: ${reason}`, () => {});
    });
    return;
  }

  const scale = options.timeScale ?? 1;
  const ms = (n: number): number => Math.max(1, Math.round(n * scale));
  /** The time of the running test (tests of one suite run one at a time). */
  let time = new SuiteTime(false);
  /** Resolves after `ms` on the running test's clock. */
  const sleep = (ms: number): Promise<void> => time.sleep(ms);
  /** A lease meant to lapse during the test. */
  const SHORT = ms(40);
  /** A sleep that outlasts {@link SHORT} by a wide margin. */
  const LAPSE = ms(100);
  /** A lease or delay that never lapses during the test. */
  const LONG = 600_000;

  async function withBackend(run: (b: DurabilityBackend) => Promise<void>): Promise<void> {
    time = new SuiteTime(options.simulatedTime === true);
    try {
      const b = await time.create(options);
      let opened = false;
      try {
        if (b.open) await b.open();
        opened = true;
        await run(b);
      } finally {
        try {
          if (opened && b.close) await b.close();
        } finally {
          await time.cleanup(options, b);
        }
      }
    } finally {
      time.stop();
    }
  }

  const it = (name: string, run: (b: DurabilityBackend) => Promise<void>): void => {
    test(name, () => withBackend(run));
  };

  function claimer(owner: string = uid("owner"), leaseMs: number = LONG, incarnation: string = uid("inc")): ClaimOptions {
    return { owner, incarnation, leaseMs };
  }

  function inbound(chatId: string, receivedAt: number = 1_700_000_000_000, payload: JsonValue = { text: "hi" }): NewInboundRecord {
    return { id: uid("in"), kind: "message", chatId, provider: "conformance", payload, receivedAt };
  }

  function outbound(chatId: string, content: JsonValue = { text: "hello" }, inboundId: string | null = null): NewOutboxEntry {
    return { key: uid("out"), chatId, content, contentHash: hashOf(content), inboundId };
  }

  async function mustGetIn(b: DurabilityBackend, id: string): Promise<InboundRecord> {
    const r = await b.inbox.get(id);
    if (r === null) throw new Error(`inbox record ${id} is missing`);
    return r;
  }

  async function mustGetOut(b: DurabilityBackend, key: string): Promise<OutboxEntry> {
    const e = await b.outbox.get(key);
    if (e === null) throw new Error(`outbox entry ${key} is missing`);
    return e;
  }

  async function mustClaim(b: DurabilityBackend, id: string, c: ClaimOptions): Promise<InboundRecord> {
    const r = await b.inbox.claim(id, c);
    if (r === null) throw new Error(`claim of inbox record ${id} returned null`);
    return r;
  }

  async function admitted(b: DurabilityBackend, rec: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord> {
    const r = await b.inbox.admit(rec, lease);
    if (r === null) throw new Error(`admit of ${rec.id} returned null`);
    return r;
  }

  /**
   * Reserve `entry`; with `lease`, leased to the caller and, when it was leased at once, its provider
   * call announced (`markCalling` under the same lease length), as the engine does before it calls:
   * such an entry whose lease lapses is ambiguous. Tests of the uncalled case reserve directly.
   */
  async function reserved(b: DurabilityBackend, entry: NewOutboxEntry, lease?: ClaimOptions): Promise<OutboxEntry> {
    const result = await b.outbox.reserve(entry, lease);
    if (lease === undefined || result.status !== "leased") return result.entry;
    if (!await b.outbox.markCalling(result.entry.key, tokenOf(result.entry), lease.leaseMs)) {
      throw new Error(`markCalling refused the lease reserve just issued on "${result.entry.key}"`);
    }
    return (await b.outbox.get(result.entry.key))!;
  }

  /** Announce the provider call of leased entries (as the engine does before calling), under `leaseMs`. */
  async function announced(b: DurabilityBackend, entries: readonly OutboxEntry[], leaseMs: number): Promise<void> {
    for (const e of entries) {
      if (!await b.outbox.markCalling(e.key, tokenOf(e), leaseMs)) throw new Error(`markCalling refused the lease on "${e.key}"`);
    }
  }

  /** The fencing token of a leased record (throws when it has no lease). */
  function tokenOf(r: InboundRecord | OutboxEntry): number {
    if (r.lease === null) throw new Error(`record has no lease (state ${r.state})`);
    return r.lease.token;
  }

  /** A `done` inbox record in `chatId`. */
  async function doneRecord(b: DurabilityBackend, chatId: string, receivedAt?: number): Promise<string> {
    const r = await admitted(b, inbound(chatId, receivedAt), claimer());
    await b.inbox.complete(r.id, tokenOf(r));
    return r.id;
  }

  /** An entry leased by one incarnation of `owner`, and the `unknown` it becomes when the next incarnation reclaims it. */
  async function unknownEntry(b: DurabilityBackend, chatId: string): Promise<OutboxEntry> {
    const owner = uid("owner");
    const e = await reserved(b, outbound(chatId), claimer(owner));
    const claim = await b.outbox.claimDue({ ...claimer(owner), reclaimOwn: true, limit: 100 });
    expect(keys(claim.ambiguous), "reclaimOwn resolves the previous incarnation's send").toEqual([e.key]);
    return mustGetOut(b, e.key);
  }


  // ---- the state machine matrix ------------------------------------------------------------------
  // Every operation of src/machine.ts on a record in every state (leased states also with a lapsed
  // lease, the outbox's also lapsed after its call was announced), each record in a chat of its own,
  // put there through the journal's public operations. The outcome is compared with the table: the new
  // state (or gone), or the refusal the contract names, the record unchanged. Attempts are not looked at.

  /** A record put into a state: its state, whether it is due now, and for a lost send whether its call was announced. */
  interface Variant<S> {
    name: string;
    state: S;
    due: boolean;
    calledLost: boolean;
    id: string;
    /** The last fencing token issued for it: its lease's token, or the fence an outcome would carry. */
    token: number;
  }

  /** How to put an inbox record into each state (`lapsed`: its lease lapses during the test's sleep). */
  const INBOX_RECIPES: { [S in InboundState]: (b: DurabilityBackend, lapsed: boolean) => Promise<InboundRecord> } = {
    pending: (b) => admitted(b, inbound(uid("chat"))),
    processing: (b, lapsed) => admitted(b, inbound(uid("chat")), claimer(uid("holder"), lapsed ? SHORT : LONG)),
    scheduled: async (b) => {
      const r = await admitted(b, inbound(uid("chat")), claimer());
      await b.inbox.schedule(r.id, tokenOf(r), 0);
      return mustGetIn(b, r.id);
    },
    failed: async (b) => {
      const r = await admitted(b, inbound(uid("chat")), claimer());
      await b.inbox.fail(r.id, tokenOf(r), { error: "boom", retryInMs: 0 });
      return mustGetIn(b, r.id);
    },
    done: async (b) => mustGetIn(b, await doneRecord(b, uid("chat"))),
    dead: async (b) => {
      const r = await admitted(b, inbound(uid("chat")), claimer());
      await b.inbox.fail(r.id, tokenOf(r), { error: "boom", dead: true });
      return mustGetIn(b, r.id);
    },
  };

  /** How to put an outbox entry into each state (`lapsed`: its lease lapses; `called`: its call was announced). */
  const OUTBOX_RECIPES: {
    [S in OutboxState]: (b: DurabilityBackend, lapsed: boolean, called: boolean) => Promise<OutboxEntry>;
  } = {
    queued: async (b) => (await b.outbox.reserve(outbound(uid("chat")))).entry,
    sending: async (b, lapsed, called) => {
      const lease = claimer(uid("holder"), lapsed ? SHORT : LONG);
      const { entry } = await b.outbox.reserve(outbound(uid("chat")), lease);
      if (called && !await b.outbox.markCalling(entry.key, tokenOf(entry), lease.leaseMs)) throw new Error("markCalling refused");
      return mustGetOut(b, entry.key);
    },
    sent: async (b) => {
      const e = await reserved(b, outbound(uid("chat")), claimer());
      await b.outbox.markSent(e.key, tokenOf(e), "m-1");
      return mustGetOut(b, e.key);
    },
    failed: async (b) => {
      const e = await reserved(b, outbound(uid("chat")), claimer());
      await b.outbox.markFailed(e.key, tokenOf(e), { error: "boom", retryInMs: 0 });
      return mustGetOut(b, e.key);
    },
    dead: async (b) => {
      const e = await reserved(b, outbound(uid("chat")), claimer());
      await b.outbox.markFailed(e.key, tokenOf(e), { error: "boom", dead: true });
      return mustGetOut(b, e.key);
    },
    unknown: async (b) => {
      const e = await reserved(b, outbound(uid("chat")), claimer());
      await b.outbox.markFailed(e.key, tokenOf(e), { error: "maybe", ambiguous: true });
      return mustGetOut(b, e.key);
    },
  };

  /** One record per state of `machine` (a leased state twice: live and lapsed; the outbox's lapsed one also announced), then the lapse. */
  async function variants<S extends string, R extends { state: string; fence: number }>(
    machine: Machine<S, string>,
    make: (state: S, lapsed: boolean, called: boolean) => Promise<R>,
    idOf: (r: R) => string,
  ): Promise<Variant<S>[]> {
    const out: Variant<S>[] = [];
    let lapses = false;
    for (const state of Object.keys(machine.states) as S[]) {
      const traits = machine.states[state];
      const kinds: { lapsed: boolean; called: boolean; name: string }[] = [{ lapsed: false, called: false, name: state }];
      if (traits.due === "leaseExpiry") {
        lapses = true;
        kinds.push({ lapsed: true, called: false, name: `${state} (lease lapsed)` });
        if (machine.journal === "outbox") kinds.push({ lapsed: true, called: true, name: `${state} (lease lapsed, call announced)` });
      }
      for (const kind of kinds) {
        const r = await make(state, kind.lapsed, kind.called);
        if (r.state !== state) throw new Error(`the recipe for ${kind.name} made a ${r.state} record`);
        const due = traits.due === "always" || traits.due === "nextAttemptAt" || (traits.due === "leaseExpiry" && kind.lapsed);
        out.push({ name: kind.name, state, due, calledLost: kind.called, id: idOf(r), token: r.fence });
      }
    }
    if (lapses) await sleep(LAPSE);
    return out;
  }

  /** What the table expects of `transition` (outcome `outcome`) on `v`: the new state, `deleted`, or the refusal. */
  function expected<S extends string>(
    t: Transition<S>,
    outcome: string,
    v: Variant<S>,
  ): { to: S | "deleted" } | { refused: Refusal } {
    if (!t.from.includes(v.state)) return { refused: t.refusal };
    if (t.guard === "due" && !v.due) return { refused: t.refusal };
    const only = t.outcomeFrom?.[outcome];
    if (only !== undefined && !only.includes(v.state)) return { refused: t.refusal };
    return { to: t.to[outcome]! };
  }

  /** Runs `apply` on every variant and checks its answer and the record's state against the table. */
  async function checkMatrix<S extends string>(
    machine: Machine<S, string>,
    name: string,
    outcome: string,
    vs: readonly Variant<S>[],
    read: (id: string) => Promise<{ state: string } | null>,
    apply: (v: Variant<S>) => Promise<unknown>,
    /** For a scan: the outcome a variant takes (default `outcome`), and whether the answer lists it. */
    scan?: { outcomeOf: (v: Variant<S>) => string; listed: (answer: unknown, v: Variant<S>) => boolean; answer: unknown },
  ): Promise<void> {
    const t = machine.transitions[name]!;
    for (const v of vs) {
      const want = expected(t, scan ? scan.outcomeOf(v) : outcome, v);
      const what = `${machine.journal}.${name}${outcome === "ok" ? "" : ` (${outcome})`} on ${v.name}`;
      let answer: unknown;
      let error: unknown = null;
      if (scan) {
        answer = scan.listed(scan.answer, v);
      } else {
        try {
          answer = await apply(v);
        } catch (e) {
          error = e;
        }
      }
      const after = await read(v.id);
      if ("refused" in want) {
        switch (want.refused) {
          case "stale":
            expect(error instanceof StaleLeaseError, `${what}: a StaleLeaseError, got ${String(error)}`).toBe(true);
            break;
          case "null":
            expect(error, `${what}: no error`).toBe(null);
            expect(answer, `${what}: null`).toBe(null);
            break;
          case "false":
          case "skipped":
          case "kept":
            expect(error, `${what}: no error`).toBe(null);
            expect(answer, `${what}: ${want.refused}`).toBe(false);
            break;
          case "exists":
            expect(error, `${what}: no error`).toBe(null);
            expect((answer as ReserveResult).status, `${what}: exists`).toBe("exists");
            break;
        }
        expect(after?.state, `${what}: unchanged`).toBe(v.state);
      } else {
        expect(error, `${what}: no error`).toBe(null);
        if (answer === false || answer === null) throw new Error(`${what}: refused (${String(answer)}), the table says ${want.to}`);
        expect(want.to === "deleted" ? null : after?.state, `${what}: ${want.to}`).toBe(want.to === "deleted" ? null : want.to);
      }
    }
  }

  function stateMatrix(): void {
    const IM = INBOX_MACHINE;
    const OM = OUTBOX_MACHINE;
    const inboxVariants = (b: DurabilityBackend) =>
      variants(IM, (s, lapsed) => INBOX_RECIPES[s](b, lapsed), (r) => r.id);
    const outboxVariants = (b: DurabilityBackend) =>
      variants(OM, (s, lapsed, called) => OUTBOX_RECIPES[s](b, lapsed, called), (e) => e.key);
    const readIn = (b: DurabilityBackend) => (id: string) => b.inbox.get(id);
    const readOut = (b: DurabilityBackend) => (key: string) => b.outbox.get(key);

    describe("inbox", () => {
      it("admit: a new record is pending, or leased processing; an existing id in any state is refused", async (b) => {
        expect((await admitted(b, inbound(uid("chat")))).state, "admit").toBe(IM.transitions.admit.to.plain);
        expect((await admitted(b, inbound(uid("chat")), claimer())).state, "admit leased").toBe(IM.transitions.admit.to.leased);
        const vs = await inboxVariants(b);
        await checkMatrix(IM, "admit", "plain", vs, readIn(b), async (v) => {
          const r = await b.inbox.admit({ ...inbound(uid("chat")), id: v.id });
          return r;
        });
      });
      it("claim", async (b) => {
        const vs = await inboxVariants(b);
        const c = claimer();
        await checkMatrix(IM, "claim", "ok", vs, readIn(b), (v) => b.inbox.claim(v.id, c));
      });
      it("claimDue", async (b) => {
        const vs = await inboxVariants(b);
        const taken = await b.inbox.claimDue({ ...claimer(), limit: 100 });
        await checkMatrix(IM, "claimDue", "ok", vs, readIn(b), () => Promise.resolve(), {
          answer: taken,
          outcomeOf: () => "ok",
          listed: (answer, v) => ids(answer as InboundRecord[]).includes(v.id),
        });
      });
      it("start", async (b) => {
        const vs = await inboxVariants(b);
        await checkMatrix(IM, "start", "ok", vs, readIn(b), (v) => b.inbox.start(v.id, v.token, 9));
      });
      it("heartbeat", async (b) => {
        const vs = await inboxVariants(b);
        await checkMatrix(IM, "heartbeat", "ok", vs, readIn(b), (v) => b.inbox.heartbeat(v.id, v.token, LONG));
      });
      it("schedule", async (b) => {
        const vs = await inboxVariants(b);
        await checkMatrix(IM, "schedule", "ok", vs, readIn(b), (v) => b.inbox.schedule(v.id, v.token, LONG));
      });
      it("complete", async (b) => {
        const vs = await inboxVariants(b);
        await checkMatrix(IM, "complete", "ok", vs, readIn(b), (v) => b.inbox.complete(v.id, v.token));
      });
      it("fail: a retry", async (b) => {
        const vs = await inboxVariants(b);
        await checkMatrix(IM, "fail", "retry", vs, readIn(b), (v) => b.inbox.fail(v.id, v.token, { error: "x", retryInMs: LONG }));
      });
      it("fail: dead", async (b) => {
        const vs = await inboxVariants(b);
        await checkMatrix(IM, "fail", "dead", vs, readIn(b), (v) => b.inbox.fail(v.id, v.token, { error: "x", dead: true }));
      });
      it("replay", async (b) => {
        const vs = await inboxVariants(b);
        await checkMatrix(IM, "replay", "ok", vs, readIn(b), (v) => b.inbox.replay(v.id));
      });
      it("purge", async (b) => {
        const vs = await inboxVariants(b);
        const purged = await b.inbox.purge(0);
        expect(purged, "purged").toBe(vs.filter((v) => IM.transitions.purge.from.includes(v.state)).length);
        const gone = new Set<string>();
        for (const v of vs) if (await readIn(b)(v.id) === null) gone.add(v.id);
        await checkMatrix(IM, "purge", "ok", vs, readIn(b), () => Promise.resolve(), {
          answer: gone,
          outcomeOf: () => "ok",
          listed: (answer, v) => (answer as Set<string>).has(v.id),
        });
      });
    });

    describe("outbox", () => {
      it("reserve: a new entry is queued, or leased sending; an existing key in any state is refused", async (b) => {
        expect((await b.outbox.reserve(outbound(uid("chat")))).entry.state, "reserve").toBe(OM.transitions.reserve.to.plain);
        expect((await b.outbox.reserve(outbound(uid("chat")), claimer())).entry.state, "reserve leased")
          .toBe(OM.transitions.reserve.to.leased);
        const vs = await outboxVariants(b);
        await checkMatrix(OM, "reserve", "plain", vs, readOut(b), async (v) => {
          const e = (await mustGetOut(b, v.id));
          return b.outbox.reserve({ key: v.id, chatId: e.chatId, content: e.content, contentHash: e.contentHash, inboundId: e.inboundId });
        });
      });
      for (const resend of [false, true]) {
        it(`claimDue${resend ? " with resendAmbiguous" : ""}`, async (b) => {
          const vs = await outboxVariants(b);
          const claim = await b.outbox.claimDue({ ...claimer(), limit: 100, resendAmbiguous: resend });
          await checkMatrix(OM, "claimDue", "ok", vs, readOut(b), () => Promise.resolve(), {
            answer: claim,
            outcomeOf: (v) => v.calledLost ? (resend ? "lostCalledResend" : "lostCalled") : "ok",
            listed: (answer, v) => {
              const { due, ambiguous } = answer as OutboxClaim;
              const inDue = keys(due).includes(v.id);
              const inAmbiguous = keys(ambiguous).includes(v.id);
              // A lost announced send is reported ambiguous (and, re-leased, due as well); any other taken one due only.
              if (v.calledLost) expect(inDue, `claimDue on ${v.name}: in due`).toBe(resend && inAmbiguous);
              else expect(inAmbiguous, `claimDue on ${v.name}: not ambiguous`).toBe(false);
              return v.calledLost ? inAmbiguous : inDue;
            },
          });
        });
      }
      it("heartbeat", async (b) => {
        const vs = await outboxVariants(b);
        await checkMatrix(OM, "heartbeat", "ok", vs, readOut(b), (v) => b.outbox.heartbeat(v.id, v.token, LONG));
      });
      it("markCalling", async (b) => {
        const vs = await outboxVariants(b);
        await checkMatrix(OM, "markCalling", "ok", vs, readOut(b), (v) => b.outbox.markCalling(v.id, v.token, LONG));
      });
      it("markSent", async (b) => {
        const vs = await outboxVariants(b);
        await checkMatrix(OM, "markSent", "ok", vs, readOut(b), (v) => b.outbox.markSent(v.id, v.token, "m-2"));
      });
      const outcomes: Record<string, FailOutcome> = {
        retry: { error: "x", retryInMs: LONG },
        throttled: { error: "x", retryInMs: LONG, throttled: true },
        dead: { error: "x", dead: true },
        ambiguous: { error: "x", ambiguous: true },
      };
      for (const [outcome, fail] of Object.entries(outcomes)) {
        it(`markFailed: ${outcome}`, async (b) => {
          const vs = await outboxVariants(b);
          await checkMatrix(OM, "markFailed", outcome, vs, readOut(b), (v) => b.outbox.markFailed(v.id, v.token, fail));
        });
      }
      it("retry", async (b) => {
        const vs = await outboxVariants(b);
        await checkMatrix(OM, "retry", "ok", vs, readOut(b), (v) => b.outbox.retry(v.id));
      });
      it("discard", async (b) => {
        const vs = await outboxVariants(b);
        await checkMatrix(OM, "discard", "ok", vs, readOut(b), (v) => b.outbox.discard(v.id));
      });
      it("purge", async (b) => {
        const vs = await outboxVariants(b);
        const purged = await b.outbox.purge(0);
        expect(purged, "purged").toBe(vs.filter((v) => OM.transitions.purge.from.includes(v.state)).length);
        const gone = new Set<string>();
        for (const v of vs) if (await readOut(b)(v.id) === null) gone.add(v.id);
        await checkMatrix(OM, "purge", "ok", vs, readOut(b), () => Promise.resolve(), {
          answer: gone,
          outcomeOf: () => "ok",
          listed: (answer, v) => (answer as Set<string>).has(v.id),
        });
      });
    });
  }

  describe(title, () => {
    describe("state machine matrix", () => stateMatrix());

    test("has a name, a scope and both journals", async () => {
      await withBackend(async (b) => {
        expect(typeof b.name === "string" && b.name.length > 0, "name").toBe(true);
        expect(["process", "host", "shared"].includes(b.scope), `scope ${String(b.scope)}`).toBe(true);
        expect(typeof b.inbox.admit, "inbox").toBe("function");
        expect(typeof b.outbox.reserve, "outbox").toBe("function");
      });
    });

    describe("inbox", () => {
      it("admit without a lease journals a pending record", async (b) => {
        const input = inbound(uid("chat"), 1_700_000_000_123, { text: "hello", n: [1, 2] });
        const r = await admitted(b, { ...input, kind: "interaction" });
        expect(r.id).toBe(input.id);
        expect(r.kind).toBe("interaction");
        expect(r.chatId).toBe(input.chatId);
        expect(r.provider).toBe("conformance");
        expect(r.payload).toEqual({ text: "hello", n: [1, 2] });
        expect(r.receivedAt).toBe(1_700_000_000_123);
        expect(r.state).toBe("pending");
        expect(r.attempts).toBe(0);
        expect(r.fence).toBe(0);
        expect(r.lease).toBe(null);
        expect(r.nextAttemptAt).toBe(null);
        expect(r.error).toBe(null);
        expect(typeof r.updatedAt).toBe("number");
        expect(await b.inbox.get(input.id), "get returns what admit returned").toEqual(r);
        expect(await b.inbox.get(uid("in")), "get of an unknown id").toBe(null);
      });

      it("admit with a lease journals a processing record with token 1", async (b) => {
        const c = claimer("owner-a", ms(5_000), "inc-a");
        const r = await admitted(b, inbound(uid("chat")), c);
        expect(r.state).toBe("processing");
        expect(r.attempts).toBe(1);
        expect(r.fence).toBe(1);
        expect(r.lease?.owner).toBe("owner-a");
        expect(r.lease?.incarnation).toBe("inc-a");
        expect(r.lease?.token).toBe(1);
        const expiresIn = (r.lease?.expiresAt ?? 0) - r.updatedAt;
        expect(expiresIn, "lease.expiresAt - updatedAt ≈ leaseMs").toBeGreaterThanOrEqual(ms(5_000) - 1);
        expect(expiresIn, "lease.expiresAt - updatedAt ≈ leaseMs").toBeLessThanOrEqual(ms(5_000) + 1_000);
        expect(await b.inbox.get(r.id)).toEqual(r);
        expect(await b.inbox.claim(r.id, claimer()), "another owner cannot claim a leased record").toBe(null);
      });

      it("admit of a known id returns null and changes nothing", async (b) => {
        const input = inbound(uid("chat"));
        const first = await admitted(b, input, claimer("owner-a"));
        expect(await b.inbox.admit({ ...input, payload: { other: true }, receivedAt: 1 }), "duplicate").toBe(null);
        expect(await b.inbox.admit(input, claimer("owner-b")), "duplicate with a lease").toBe(null);
        expect(await b.inbox.get(input.id)).toEqual(first);

        const pending = inbound(uid("chat"));
        const p = await admitted(b, pending);
        expect(await b.inbox.admit(pending, claimer()), "duplicate of a pending record").toBe(null);
        expect(await b.inbox.get(pending.id)).toEqual(p);
      });

      it("concurrent admits of one id: exactly one wins", async (b) => {
        const input = inbound(uid("chat"));
        const results = await Promise.all(
          Array.from({ length: 10 }, (_, i) => b.inbox.admit(input, i % 2 === 0 ? claimer() : undefined)),
        );
        expect(results.filter((r) => r !== null).length).toBe(1);
      });

      it("claim leases a pending record and issues a token above its fence and above the one an admission leases under (claimToken); a claim counts no run", async (b) => {
        const chat = uid("chat");
        const r = await admitted(b, inbound(chat));
        const c = claimer("owner-a", LONG, "inc-a");
        const claimed = await mustClaim(b, r.id, c);
        expect(claimed.state).toBe("processing");
        expect(claimed.attempts, "a claim is not a run").toBe(0);
        expect(claimed.fence).toBe(FIRST_CLAIM);
        expect(claimed.lease?.token).toBe(FIRST_CLAIM);
        expect(claimed.lease?.owner).toBe("owner-a");
        expect(claimed.lease?.incarnation).toBe("inc-a");
        expect(claimed.payload).toEqual(r.payload);
        expect(await b.inbox.get(r.id)).toEqual(claimed);
        expect(await b.inbox.claim(r.id, claimer()), "a live lease is not taken by another owner").toBe(null);
        expect(await b.inbox.claim(r.id, claimer("owner-a")), "nor by another incarnation without reclaimOwn").toBe(null);
        expect(await b.inbox.claim(uid("in"), claimer()), "unknown id").toBe(null);
        await b.inbox.complete(r.id, FIRST_CLAIM);
        expect(await b.inbox.claim(r.id, claimer()), "a done record is not claimable").toBe(null);
      });

      it("start counts a run: once per attempt, under the lease; a claim counts none, a leased admission its first", async (b) => {
        const chat = uid("chat");
        const owner = claimer(uid("owner"), LONG, "inc-1");
        const first = await admitted(b, inbound(chat, 1_000), owner);
        expect(first.state).toBe("processing");
        expect(first.attempts, "a leased admission counts the run its caller makes of it").toBe(1);
        const pending = await admitted(b, inbound(chat, 1_001));
        const behind = await mustClaim(b, pending.id, owner);
        expect(behind.attempts, "claimed: no run yet").toBe(0);
        expect(await b.inbox.start(behind.id, behind.fence, 1)).toBe(true);
        expect((await mustGetIn(b, behind.id)).attempts).toBe(1);
        expect(await b.inbox.start(behind.id, behind.fence, 1), "a repeat (lost reply) changes nothing").toBe(true);
        expect((await mustGetIn(b, behind.id)).attempts).toBe(1);
        expect(await b.inbox.start(behind.id, behind.fence + 1, 2), "a token that is not the lease's").toBe(false);
        expect((await mustGetIn(b, behind.id)).attempts).toBe(1);
        expect(await b.inbox.start(uid("in"), 1, 1), "unknown id").toBe(false);
        await b.inbox.complete(behind.id, behind.fence);
        expect(await b.inbox.start(behind.id, behind.fence, 2), "a done record").toBe(false);
        // A claim after a run cut off counts nothing; the next start counts the second run.
        const again = await mustClaim(b, first.id, { ...owner, incarnation: "inc-2", reclaimOwn: true });
        expect(again.attempts).toBe(1);
        expect(await b.inbox.start(first.id, again.fence, 2)).toBe(true);
        expect((await mustGetIn(b, first.id)).attempts).toBe(2);
        for (const bad of [0, -1, 1.5, Number.NaN, "1"]) {
          const error = await b.inbox.start(first.id, again.fence, bad as number).then(() => null, (e: unknown) => e);
          expect(error instanceof RangeError && /"attempt"/.test(error.message), `attempt ${String(bad)}: ${String(error)}`).toBe(true);
        }
        expect((await mustGetIn(b, first.id)).attempts).toBe(2);
      });

      it("schedule arms a timer: due at its deadline, never before, holding back nothing of its chat until then; attempts unchanged", async (b) => {
        const chat = uid("chat");
        const owner = claimer(uid("owner"), LONG);
        const timer = await admitted(b, inbound(chat, 1_000), owner);
        expect(timer.attempts).toBe(1);
        await b.inbox.schedule(timer.id, tokenOf(timer), LONG);
        const armed = await mustGetIn(b, timer.id);
        expect(armed.state).toBe("scheduled");
        expect(armed.attempts, "arming is not a run").toBe(1);
        expect(armed.lease).toBe(null);
        expect(armed.error, "a timer is not a failure").toBe(null);
        expect(armed.nextAttemptAt! - armed.updatedAt, "due dueInMs after the backend's now").toBe(LONG);
        expect(await b.inbox.claim(timer.id, claimer()), "not claimable before its deadline").toBe(null);
        expect(ids(await b.inbox.claimDue({ ...claimer(), limit: 100 })).includes(timer.id), "nor taken by a due scan").toBe(false);
        expect(ids(await b.inbox.list({ state: "scheduled", chatId: chat }))).toEqual([timer.id]);
        expect(await b.inbox.replay(timer.id), "not an operator's to replay").toBe(false);
        expect(await b.inbox.purge(0), "not purged").toBe(0);
        // The chat's next message is admitted leased: the timer holds back nothing until it is due.
        const next = await admitted(b, inbound(chat, 2_000), owner);
        expect(next.state).toBe("processing");
        await b.inbox.complete(next.id, tokenOf(next));
        // Stale and bad calls change nothing.
        const stale = await b.inbox.schedule(timer.id, tokenOf(timer), 0).then(() => null, (e: unknown) => e);
        expect(stale instanceof StaleLeaseError, `schedule of a scheduled record: ${String(stale)}`).toBe(true);
        const unknown = await b.inbox.schedule(uid("in"), 1, 0).then(() => null, (e: unknown) => e);
        expect(unknown instanceof StaleLeaseError, `schedule of an unknown id: ${String(unknown)}`).toBe(true);
        expect(await mustGetIn(b, timer.id)).toEqual(armed);
        // Armed again at no cost, due at once this time: a claim takes it, attempts still those of its admission.
        const early = await admitted(b, inbound(uid("chat"), 3_000), owner);
        for (const bad of [Number.NaN, Infinity, "5", null]) {
          const error = await b.inbox.schedule(early.id, tokenOf(early), bad as number).then(() => null, (e: unknown) => e);
          expect(error instanceof TypeError && /"dueInMs"/.test(error.message), `dueInMs ${String(bad)}: ${String(error)}`).toBe(true);
        }
        expect((await mustGetIn(b, early.id)).state, "a refused schedule leaves it leased").toBe("processing");
        await b.inbox.schedule(early.id, tokenOf(early), 0);
        const taken = await mustClaim(b, early.id, claimer());
        expect(taken.attempts, "taken up: still no run of its own").toBe(1);
        await b.inbox.schedule(early.id, tokenOf(taken), ms(60));
        expect(await b.inbox.claim(early.id, claimer()), "armed again: not before its deadline").toBe(null);
        await sleep(ms(120));
        const due = await b.inbox.claimDue({ ...claimer(), limit: 100 });
        expect(ids(due).includes(early.id), "due at its deadline: a due scan takes it").toBe(true);
        expect(due.find((r) => r.id === early.id)!.attempts).toBe(1);
      });

      it("every claim issues a greater token; stale completions throw and change nothing", async (b) => {
        const owner = uid("owner");
        const r = await admitted(b, inbound(uid("chat")), claimer(owner));
        const second = await mustClaim(b, r.id, { ...claimer(owner), reclaimOwn: true });
        expect(second.fence).toBe(2);
        expect(second.attempts, "the admission counted its run; the claim counts none").toBe(1);
        const third = await mustClaim(b, r.id, { ...claimer(owner), reclaimOwn: true });
        expect(third.fence).toBe(3);
        expect(tokenOf(third)).toBe(3);
        expect(third.attempts).toBe(1);

        const before = await mustGetIn(b, r.id);
        for (const stale of [1, 2]) {
          await expectStale(expect, () => b.inbox.complete(r.id, stale), `complete with token ${stale}`);
          await expectStale(expect, () => b.inbox.fail(r.id, stale, { error: "x", retryInMs: 0 }), `fail with token ${stale}`);
          await expectStale(expect, () => b.inbox.fail(r.id, stale, { error: "x", dead: true }), `fail dead with token ${stale}`);
          expect(await b.inbox.heartbeat(r.id, stale, LONG), `heartbeat with token ${stale}`).toBe(false);
        }
        await expectStale(expect, () => b.inbox.complete(r.id, 4), "complete with a token never issued");
        expect(await b.inbox.get(r.id), "stale operations changed nothing").toEqual(before);

        expect(await b.inbox.heartbeat(r.id, 3, LONG), "heartbeat with the current token").toBe(true);
        await b.inbox.complete(r.id, 3);
        const done = await mustGetIn(b, r.id);
        expect(done.state).toBe("done");
        expect(done.lease).toBe(null);
        expect(done.attempts, "one run (its admission's); the claims counted none").toBe(1);
        expect(done.fence).toBe(3);
      });

      it("stale-token operations on an unknown id do not create it", async (b) => {
        const id = uid("in");
        let threw = false;
        try {
          await b.inbox.complete(id, 1);
        } catch {
          threw = true;
        }
        expect(threw, "complete of an unknown id throws").toBe(true);
        expect(await b.inbox.heartbeat(id, 1, LONG)).toBe(false);
        expect(await b.inbox.get(id)).toBe(null);
      });

      it("a completion after the lease lapsed succeeds when nobody retook it", async (b) => {
        const chat = uid("chat");
        const a = await admitted(b, inbound(chat), claimer(uid("owner"), SHORT));
        const f = await admitted(b, inbound(uid("chat")), claimer(uid("owner"), SHORT));
        const h = await admitted(b, inbound(uid("chat")), claimer(uid("owner"), SHORT));
        await sleep(LAPSE);
        await b.inbox.complete(a.id, 1);
        expect((await mustGetIn(b, a.id)).state).toBe("done");
        await b.inbox.fail(f.id, 1, { error: "late failure", dead: true });
        expect((await mustGetIn(b, f.id)).state).toBe("dead");
        expect(await b.inbox.heartbeat(h.id, 1, LONG), "a late heartbeat keeps an untaken lease").toBe(true);
        expect(await b.inbox.claim(h.id, claimer()), "… and extends it").toBe(null);
      });

      it("a lapsed lease is taken over by another owner, not before", async (b) => {
        const chat = uid("chat");
        const a = claimer("owner-a", SHORT, "inc-a");
        const short = await admitted(b, inbound(chat, 1_000), a);
        // Other chats: on a slow backend the short lease may lapse before the next admission, which would wait behind it.
        const long = await admitted(b, inbound(uid("chat"), 2_000), { ...a, leaseMs: LONG });
        const heartbeated = await admitted(b, inbound(uid("chat"), 3_000), a);
        expect(await b.inbox.heartbeat(heartbeated.id, 1, LONG), "heartbeat with the current token").toBe(true);
        const extended = await mustGetIn(b, heartbeated.id);
        expect(extended.lease?.expiresAt ?? 0, "heartbeat moved expiresAt").toBeGreaterThan(heartbeated.lease?.expiresAt ?? 0);
        expect(extended.lease?.token, "heartbeat keeps the token").toBe(1);

        const bOwner = claimer("owner-b", LONG, "inc-b");
        expect(ids(await b.inbox.claimDue({ ...bOwner, limit: 100 })).includes(long.id), "a live lease is not due").toBe(false);
        expect(await b.inbox.claim(long.id, bOwner)).toBe(null);

        await sleep(LAPSE);
        const due = await b.inbox.claimDue({ ...bOwner, limit: 100 });
        expect(ids(due), "only the lapsed lease is due").toEqual([short.id]);
        const taken = due[0]!;
        expect(taken.state).toBe("processing");
        expect(taken.lease?.owner).toBe("owner-b");
        expect(taken.lease?.incarnation).toBe("inc-b");
        expect(taken.lease?.token).toBe(2);
        expect(taken.fence).toBe(2);
        expect(taken.attempts, "taken over: the run its admission counted, no more").toBe(1);
        expect(await b.inbox.get(short.id)).toEqual(taken);

        await expectStale(expect, () => b.inbox.complete(short.id, 1), "the old owner's completion");
        expect(await b.inbox.heartbeat(short.id, 1, LONG), "the old owner's heartbeat").toBe(false);
        expect(await b.inbox.get(short.id)).toEqual(taken);
        expect(await b.inbox.claim(short.id, claimer()), "the new lease holds").toBe(null);
        await b.inbox.complete(short.id, 2);
        expect((await mustGetIn(b, short.id)).state).toBe("done");

        expect((await mustGetIn(b, long.id)).lease?.owner, "the live lease is untouched").toBe("owner-a");
        expect((await mustGetIn(b, heartbeated.id)).lease?.owner, "the heartbeated lease is untouched").toBe("owner-a");
      });

      it("a claim whose reply was lost is not stranded: the same incarnation takes its own lapsed lease back", async (b) => {
        const chat = uid("chat");
        const me = claimer("owner-s", SHORT, "inc-s");
        const lost = await admitted(b, inbound(chat, 1_000), me); // as if the reply of this write never arrived
        const live = await admitted(b, inbound(chat, 2_000), { ...me, leaseMs: LONG });
        expect(await b.inbox.claim(lost.id, me), "not while the lease is live").toBe(null);
        await sleep(LAPSE);
        const due = await b.inbox.claimDue({ ...me, limit: 100 });
        expect(ids(due), "the lapsed one, not the live one").toEqual([lost.id]);
        expect(due[0]?.lease?.token).toBe(2);
        await expectStale(expect, () => b.inbox.complete(lost.id, 1), "the lost claim's token");
        await b.inbox.complete(lost.id, 2);
        expect((await mustGetIn(b, live.id)).lease?.token, "the live lease is untouched").toBe(1);

        const lostReserve = await b.outbox.reserve(outbound(uid("chat")), me);
        expect(lostReserve.status).toBe("leased");
        const sent = await reserved(b, outbound(uid("chat")), me);
        await sleep(LAPSE);
        const claim = await b.outbox.claimDue({ ...me, limit: 100 });
        expect(keys(claim.due), "its own lapsed uncalled send is leased again").toEqual([lostReserve.entry.key]);
        expect(claim.due[0]?.lease?.token).toBe(2);
        expect(keys(claim.ambiguous), "its own lapsed announced send is resolved as ambiguous").toEqual([sent.key]);
        expect((await b.outbox.get(sent.key))?.state).toBe("unknown");
      });

      it("a due scan asked again by its requestId (repeat) answers what it took and changes nothing", async (b) => {
        const me = claimer("owner-q", LONG, "inc-q");
        const chat = uid("chat");
        const first = await admitted(b, inbound(chat, 1_000));
        const second = await admitted(b, inbound(chat, 2_000));
        const scan = uid("scan");
        const took = await b.inbox.claimDue({ ...me, limit: 1, requestId: scan });
        expect(ids(took)).toEqual([first.id]);
        const again = await b.inbox.claimDue({ ...me, limit: 10, requestId: scan, repeat: true });
        expect(ids(again), "the repeat answers the first answer").toEqual([first.id]);
        expect(again[0]?.lease?.token, "under the token the scan issued").toBe(took[0]?.lease?.token);
        expect(again[0]?.lease?.owner).toBe("owner-q");
        expect((await mustGetIn(b, second.id)).state, "the repeat claims nothing more").toBe("pending");
        expect(await b.inbox.get(first.id), "nor changes what it took").toEqual(took[0]);
        expect(await b.inbox.claimDue({ ...me, limit: 10, requestId: uid("scan"), repeat: true }), "a scan never run").toEqual([]);
        const nothing = uid("scan");
        expect(await b.inbox.claimDue({ ...claimer(), limit: 10, requestId: nothing }), "another owner's scan: the chat is held")
          .toEqual([]);
        expect(await b.inbox.claimDue({ ...me, limit: 10, requestId: nothing, repeat: true }), "a scan that took nothing").toEqual([]);
        expect((await mustGetIn(b, second.id)).state).toBe("pending");
        expect(ids(await b.inbox.claimDue({ ...me, limit: 10, requestId: uid("scan") })), "a new scan takes the rest").toEqual([second.id]);

        // The outbox: a due entry leased, and a lost announced send made ambiguous, by one scan.
        const queued = await reserved(b, outbound(uid("chat")));
        const lost = await reserved(b, outbound(uid("chat")), claimer("owner-gone", SHORT));
        await sleep(LAPSE);
        const later = await reserved(b, outbound(uid("chat")));
        const outScan = uid("scan");
        const claim = await b.outbox.claimDue({ ...me, limit: 1, requestId: outScan });
        expect(keys(claim.due), "the due head, the limit reached").toEqual([queued.key]);
        expect(keys(claim.ambiguous)).toEqual([lost.key]);
        const repeated = await b.outbox.claimDue({ ...me, limit: 10, requestId: outScan, repeat: true });
        expect(keys(repeated.due), "the repeat answers the first answer").toEqual([queued.key]);
        expect(repeated.due[0]?.lease?.token).toBe(claim.due[0]?.lease?.token);
        expect(keys(repeated.ambiguous)).toEqual([lost.key]);
        expect((await mustGetOut(b, later.key)).state, "the repeat leases nothing more").toBe("queued");
        expect((await mustGetOut(b, lost.key)).state).toBe("unknown");
        // The lost sender's late outcome settles it: a repeat still answers it ambiguous (the scan made it
        // unknown, and so let the later sends of its chat go first: the report is owed whatever came after).
        await b.outbox.markSent(lost.key, lost.fence, "late-id");
        expect((await mustGetOut(b, lost.key)).state).toBe("sent");
        const afterLate = await b.outbox.claimDue({ ...me, limit: 10, requestId: outScan, repeat: true });
        expect(keys(afterLate.ambiguous), "made ambiguous by the scan, settled since").toEqual([lost.key]);
        expect(afterLate.ambiguous[0]?.fence).toBe(lost.fence);
        expect(keys(afterLate.due)).toEqual([queued.key]);
        expect(await b.outbox.claimDue({ ...me, limit: 10, requestId: uid("scan"), repeat: true }), "a scan never run")
          .toEqual({ due: [], ambiguous: [] });
        expect(keys((await b.outbox.claimDue({ ...me, limit: 10, requestId: uid("scan") })).due)).toEqual([later.key]);
      });

      it("reclaimOwn: the next incarnation takes back at once; other owners and the same incarnation cannot", async (b) => {
        const chat = uid("chat");
        const old = claimer("owner-o", LONG, "inc-1");
        const r1 = await admitted(b, inbound(chat, 1_000), old);
        const r2 = await admitted(b, inbound(chat, 2_000), old);
        const before1 = await mustGetIn(b, r1.id);

        expect(await b.inbox.claim(r1.id, { ...old, reclaimOwn: true }), "the same incarnation never takes its own").toBe(null);
        expect(await b.inbox.claim(r1.id, { ...claimer("owner-p"), reclaimOwn: true }), "another owner cannot").toBe(null);
        expect(await b.inbox.claim(r1.id, claimer("owner-o", LONG, "inc-2")), "not without reclaimOwn").toBe(null);
        expect(await b.inbox.get(r1.id)).toEqual(before1);

        const dueSame = await b.inbox.claimDue({ ...old, reclaimOwn: true, limit: 100 });
        const dueOther = await b.inbox.claimDue({ ...claimer("owner-p"), reclaimOwn: true, limit: 100 });
        expect(ids(dueSame).concat(ids(dueOther)), "claimDue: same incarnation or other owner").toEqual([]);

        const next = claimer("owner-o", LONG, "inc-2");
        const taken = await mustClaim(b, r1.id, { ...next, reclaimOwn: true });
        expect(taken.lease?.incarnation).toBe("inc-2");
        expect(taken.lease?.token).toBe(2);
        expect(taken.attempts).toBe(1);
        await expectStale(expect, () => b.inbox.complete(r1.id, 1), "the old incarnation's completion");

        const due = await b.inbox.claimDue({ ...next, reclaimOwn: true, limit: 100 });
        expect(ids(due), "claimDue reclaims the old incarnation's, not its own").toEqual([r2.id]);
        expect(due[0]?.lease?.incarnation).toBe("inc-2");
        expect(due[0]?.lease?.token).toBe(2);
      });

      it("reclaimOwn in batches: each claimDue takes the oldest of the previous incarnation's, until none is left", async (b) => {
        const chat = uid("chat");
        const owner = uid("owner");
        const old = claimer(owner, LONG, "inc-1");
        const times = [7_000, 3_000, 9_000, 1_000, 5_000, 8_000, 2_000, 6_000, 4_000, 10_000];
        const records = [];
        for (const t of times) records.push(await admitted(b, inbound(chat, t), old));
        const next = claimer(owner, LONG, "inc-2");
        const inOrder = [...records].sort((x, y) => x.receivedAt - y.receivedAt).map((r) => r.id);
        const batches: string[][] = [];
        for (let i = 0; i < 6; i++) {
          const due = await b.inbox.claimDue({ ...next, reclaimOwn: true, limit: 3 });
          batches.push(ids(due));
          if (due.length < 3) break;
        }
        expect(batches, "oldest first, each batch after the one before, the last one short").toEqual([
          inOrder.slice(0, 3),
          inOrder.slice(3, 6),
          inOrder.slice(6, 9),
          inOrder.slice(9),
        ]);
        for (const r of records) expect((await mustGetIn(b, r.id)).lease?.incarnation).toBe("inc-2");
      });

      it("reclaimOwn after several dead incarnations: batches take the oldest of all of them, each once, until none is left", async (b) => {
        const owner = uid("owner");
        const times = [7_000, 3_000, 9_000, 1_000, 5_000, 8_000, 2_000, 6_000, 4_000];
        const records = [];
        // Three earlier incarnations of one owner, their records interleaved in time (each in its own chat).
        for (const [i, t] of times.entries()) {
          records.push(await admitted(b, inbound(uid("chat"), t), claimer(owner, LONG, `inc-${1 + (i % 3)}`)));
        }
        const next = claimer(owner, LONG, "inc-4");
        const inOrder = [...records].sort((x, y) => x.receivedAt - y.receivedAt).map((r) => r.id);
        const batches: string[][] = [];
        for (let i = 0; i < 6; i++) {
          const due = await b.inbox.claimDue({ ...next, reclaimOwn: true, limit: 4 });
          batches.push(ids(due));
          if (due.length < 4) break;
        }
        expect(batches, "oldest first across the incarnations, each record once").toEqual([
          inOrder.slice(0, 4),
          inOrder.slice(4, 8),
          inOrder.slice(8),
        ]);
        for (const r of records) expect((await mustGetIn(b, r.id)).lease?.incarnation).toBe("inc-4");
      });

      it("reclaimOwn in batches, another owner holding a chat midway: its later records wait, the rest go in order, each once", async (b) => {
        const [chatA, chatB] = [uid("chat"), uid("chat")];
        const owner = uid("owner");
        const old = claimer(owner, LONG, "inc-1");
        const other = claimer(uid("owner"), LONG, "inc-p");
        // Chat B: another owner holds the record of 3,500; the previous incarnation's record before it is
        // leased, the ones after it were admitted pending (a lease held elsewhere came first).
        const held = await admitted(b, inbound(chatB, 3_500), other);
        const a = [];
        for (const t of [1_000, 2_000, 5_000, 6_000]) a.push(await admitted(b, inbound(chatA, t), old));
        const b3 = await admitted(b, inbound(chatB, 3_000), old);
        const after = [await admitted(b, inbound(chatB, 4_000), old), await admitted(b, inbound(chatB, 7_000), old)];
        expect(after.map((r) => r.state), "admitted behind a lease held elsewhere").toEqual(["pending", "pending"]);
        const next = claimer(owner, LONG, "inc-2");
        const batches: string[][] = [];
        for (let i = 0; i < 6; i++) {
          const due = await b.inbox.claimDue({ ...next, reclaimOwn: true, limit: 2 });
          batches.push(ids(due));
          if (due.length < 2) break;
        }
        expect(batches, "oldest first, chat B's records after the held one left out").toEqual([
          [a[0]!.id, a[1]!.id],
          [b3.id, a[2]!.id],
          [a[3]!.id],
        ]);
        // Once the holder is done, the chat's later records are due, in order.
        await b.inbox.complete(held.id, held.fence);
        expect(ids(await b.inbox.claimDue({ ...next, reclaimOwn: true, limit: 10 }))).toEqual(after.map((r) => r.id));
      });

      it("fail with a retry: failed, not claimable until nextAttemptAt, then claimable", async (b) => {
        const chat = uid("chat");
        const retryInMs = ms(100);
        const r = await admitted(b, inbound(chat, 1_000), claimer());
        const later = await admitted(b, inbound(uid("chat"), 2_000), claimer());
        await b.inbox.fail(r.id, 1, { error: "boom", retryInMs });
        await b.inbox.fail(later.id, 1, { error: "later", retryInMs: LONG });
        const failed = await mustGetIn(b, r.id);
        expect(failed.state).toBe("failed");
        expect(failed.error).toBe("boom");
        expect(failed.lease).toBe(null);
        expect(failed.attempts).toBe(1);
        expect(failed.fence).toBe(1);
        const delay = (failed.nextAttemptAt ?? 0) - failed.updatedAt;
        expect(delay, "nextAttemptAt - updatedAt ≈ retryInMs").toBeGreaterThanOrEqual(retryInMs - 1);
        expect(delay, "nextAttemptAt - updatedAt ≈ retryInMs").toBeLessThanOrEqual(retryInMs + 1_000);

        expect(await b.inbox.claim(r.id, claimer()), "not claimable before nextAttemptAt").toBe(null);
        expect(ids(await b.inbox.claimDue({ ...claimer(), limit: 100 })), "not due before nextAttemptAt").toEqual([]);
        await sleep(retryInMs + LAPSE);
        expect(ids(await b.inbox.claimDue({ ...claimer("owner-c"), limit: 100 })), "due after nextAttemptAt").toEqual([r.id]);
        const again = await mustGetIn(b, r.id);
        expect(again.state).toBe("processing");
        expect(again.lease?.owner).toBe("owner-c");
        expect(again.lease?.token).toBe(2);
        expect(again.attempts, "the retry's claim counts no run").toBe(1);
        expect(again.nextAttemptAt).toBe(null);
        expect((await mustGetIn(b, later.id)).state, "a later retry stays failed").toBe("failed");
      });

      it("fail dead: dead, never claimable", async (b) => {
        const r = await admitted(b, inbound(uid("chat")), claimer());
        await b.inbox.fail(r.id, 1, { error: "permanent", dead: true });
        const dead = await mustGetIn(b, r.id);
        expect(dead.state).toBe("dead");
        expect(dead.error).toBe("permanent");
        expect(dead.lease).toBe(null);
        expect(dead.nextAttemptAt).toBe(null);
        expect(await b.inbox.claim(r.id, claimer())).toBe(null);
        expect(await b.inbox.claim(r.id, { ...claimer(), reclaimOwn: true })).toBe(null);
        expect(ids(await b.inbox.claimDue({ ...claimer(), limit: 100 }))).toEqual([]);
      });

      it("claimDue takes the oldest receivedAt first, at most limit", async (b) => {
        const chat = uid("chat");
        const order = [3, 1, 4, 0, 2];
        const recs: string[] = [];
        for (const n of order) recs[n] = (await admitted(b, inbound(n % 2 === 0 ? chat : uid("chat"), 1_000 + n))).id;
        const c = claimer("owner-a", LONG, "inc-a");
        const first = await b.inbox.claimDue({ ...c, limit: 2 });
        expect(ids(first)).toEqual([recs[0], recs[1]]);
        for (const r of first) {
          expect(r.state).toBe("processing");
          expect(r.lease?.owner).toBe("owner-a");
          expect(r.lease?.token).toBe(FIRST_CLAIM);
          expect(r.attempts).toBe(0);
        }
        expect(ids(await b.inbox.claimDue({ ...c, limit: 100 }))).toEqual([recs[2], recs[3], recs[4]]);
        expect(ids(await b.inbox.claimDue({ ...claimer(), limit: 100 })), "nothing left").toEqual([]);
      });

      it("concurrent claimDue: every due record is leased exactly once", async (b) => {
        const recs = new Set<string>();
        for (let i = 0; i < 10; i++) recs.add((await admitted(b, inbound(uid("chat"), 1_000 + i))).id);
        const results = await Promise.all(
          Array.from({ length: 20 }, (_, i) => b.inbox.claimDue({ ...claimer(`owner-${i}`), limit: 3 })),
        );
        const got = results.flatMap((list) => ids(list));
        expect(got.length, "no record leased twice").toBe(10);
        expect(new Set(got).size).toBe(10);
        expect([...got].sort()).toEqual([...recs].sort());
        for (let i = 0; i < results.length; i++) {
          for (const r of results[i]!) {
            const now = await mustGetIn(b, r.id);
            expect(now.lease?.owner, "the journal agrees with the winner").toBe(`owner-${i}`);
            expect(now.fence).toBe(FIRST_CLAIM);
          }
        }
      });

      it("chat order through a failover: a later record waits while an earlier one of its chat is leased elsewhere; lapsed ones are taken in order", async (b) => {
        const chat = uid("chat");
        // Admitted under a long lease (a short one could lapse between the admissions of a slow backend).
        const lost = claimer("owner-lost", LONG);
        // The lost replica held three records of the chat; the first (its handler running) was heartbeated last.
        const first = await admitted(b, inbound(chat, 1_000), lost);
        const second = await admitted(b, inbound(chat, 2_000), lost);
        const third = await admitted(b, inbound(chat, 3_000), lost);
        for (const r of [second, third]) expect(await b.inbox.heartbeat(r.id, tokenOf(r), SHORT)).toBe(true);
        const other = await admitted(b, inbound(uid("chat"), 2_500), { ...lost, leaseMs: SHORT });
        await sleep(LAPSE);
        const y = claimer("owner-y");
        expect(ids(await b.inbox.claimDue({ ...y, limit: 100 })), "the chat waits behind its first record; another chat is not held back").toEqual([other.id]);
        expect((await mustGetIn(b, second.id)).lease?.owner, "not taken").toBe("owner-lost");
        // The first record's lease lapses too: the chat is taken in arrival order, one claimer at a time.
        expect(await b.inbox.heartbeat(first.id, tokenOf(first), SHORT)).toBe(true);
        await sleep(LAPSE);
        expect(ids(await b.inbox.claimDue({ ...y, limit: 1 })), "the first record first").toEqual([first.id]);
        const z = claimer("owner-z");
        expect(ids(await b.inbox.claimDue({ ...z, limit: 100 })), "a second claimer takes nothing of a chat held elsewhere").toEqual([]);
        expect(ids(await b.inbox.claimDue({ ...y, limit: 100 })), "the holder takes the rest behind its own lease").toEqual([second.id, third.id]);
        expect(ids(await b.inbox.claimDue({ ...z, limit: 100 }))).toEqual([]);
        // Settled, the chat is free again: a record made pending later (a replay) is anyone's.
        for (const r of [first, second, third]) await b.inbox.complete(r.id, (await mustGetIn(b, r.id)).lease!.token);
        expect(await b.inbox.replay(second.id)).toBe(true);
        expect(ids(await b.inbox.claimDue({ ...z, limit: 100 }))).toEqual([second.id]);
      });

      it("chat order at admission: a leased admit behind a record of its chat held elsewhere, or due first, is journaled pending, and taken in order by a due scan", async (b) => {
        const chat = uid("chat");
        const a = claimer("owner-a");
        const first = await admitted(b, inbound(chat, 1_000), a);
        const third = await admitted(b, inbound(chat, 2_000), a);
        expect([third.state, third.lease?.owner, third.fence], "the holder's own lease holds nothing back").toEqual(["processing", "owner-a", 1]);
        const second = await admitted(b, inbound(chat, 3_000), claimer("owner-b"));
        expect([second.state, second.lease, second.attempts, second.fence], "not leased: held back").toEqual(["pending", null, 0, 0]);
        const elsewhere = await admitted(b, inbound(uid("chat"), 2_500), claimer("owner-b"));
        expect(elsewhere.state, "another chat is not held back").toBe("processing");
        expect(ids(await b.inbox.claimDue({ ...claimer("owner-b"), limit: 100 })), "nothing while the chat is held").toEqual([]);
        await b.inbox.complete(first.id, tokenOf(first));
        await b.inbox.complete(third.id, tokenOf(third));
        expect(ids(await b.inbox.claimDue({ ...claimer("owner-b"), limit: 100 }))).toEqual([second.id]);
        // A failed record waiting for its retry holds nothing back, at admission either.
        const chat2 = uid("chat");
        const failing = await admitted(b, inbound(chat2, 1_000), a);
        await b.inbox.fail(failing.id, tokenOf(failing), { error: "boom", retryInMs: LONG });
        expect((await admitted(b, inbound(chat2, 2_000), claimer("owner-b"))).state).toBe("processing");
        // A lapsed lease or a pending record comes first: a due scan takes the chat in order.
        const chat3 = uid("chat");
        const lost = await admitted(b, inbound(chat3, 1_000), claimer("owner-lost", SHORT));
        await sleep(LAPSE);
        const behindLost = await admitted(b, inbound(chat3, 2_000), claimer("owner-b"));
        expect(behindLost.state, "behind a lapsed lease").toBe("pending");
        const behindPending = await admitted(b, inbound(chat3, 3_000), claimer("owner-b"));
        expect(behindPending.state, "behind a pending record").toBe("pending");
        expect(ids(await b.inbox.claimDue({ ...claimer("owner-b"), limit: 100 }))).toEqual([lost.id, behindLost.id, behindPending.id]);
      });

      it("chat order: a record processing elsewhere holds back every later one of its chat, pending and lapsed alike; a failed one waiting for its retry holds back nothing", async (b) => {
        const chat = uid("chat");
        const x = claimer("owner-x", LONG);
        const held = await admitted(b, inbound(chat, 1_000), x);
        const pending = await admitted(b, inbound(chat, 2_000));
        const lapsed = await admitted(b, inbound(chat, 3_000), claimer("owner-w", SHORT));
        await sleep(LAPSE);
        expect(ids(await b.inbox.claimDue({ ...claimer(), limit: 100 })), "nothing while the first is held elsewhere").toEqual([]);
        expect(ids(await b.inbox.claimDue({ ...x, limit: 100 })), "its holder takes the later ones, in order").toEqual([pending.id, lapsed.id]);
        // A failed record waiting for its retry: the next ones of its chat are handled meanwhile.
        const chat2 = uid("chat");
        const waiting = await admitted(b, inbound(chat2, 1_000), x);
        await b.inbox.fail(waiting.id, tokenOf(waiting), { error: "boom", retryInMs: LONG });
        const next = await admitted(b, inbound(chat2, 2_000));
        expect(ids(await b.inbox.claimDue({ ...claimer(), limit: 100 })), "not held back by a retry that is not due").toEqual([next.id]);
        // A failed record that is due comes first, ahead of the later ones of its chat.
        const chat3 = uid("chat");
        const due = await admitted(b, inbound(chat3, 1_000), x);
        await b.inbox.fail(due.id, tokenOf(due), { error: "boom", retryInMs: SHORT });
        const after = await admitted(b, inbound(chat3, 2_000));
        await sleep(LAPSE);
        expect(ids(await b.inbox.claimDue({ ...claimer(), limit: 100 }))).toEqual([due.id, after.id]);
        // The previous incarnation's records are the next one's under reclaimOwn, in order; another owner's live lease still holds back.
        const chat4 = uid("chat");
        const mine = claimer("owner-r", LONG, "inc-1");
        const theirs = await admitted(b, inbound(chat4, 1_000), claimer("owner-s", LONG));
        const own = await admitted(b, inbound(chat4, 2_000), mine);
        const reclaim = { ...claimer("owner-r", LONG, "inc-2"), reclaimOwn: true, limit: 100 };
        expect(ids(await b.inbox.claimDue(reclaim)), "held back by another owner's earlier record").toEqual([]);
        await b.inbox.complete(theirs.id, tokenOf(theirs));
        expect(ids(await b.inbox.claimDue(reclaim))).toEqual([own.id]);
      });

      it("chat order under concurrent due scans: a chat's records are never split between claimers, and each holds a prefix of its chat", async (b) => {
        const chats = [uid("chat"), uid("chat"), uid("chat")];
        const order = new Map<string, string[]>();
        let t = 1_000;
        for (let i = 0; i < 5; i++) {
          for (const chat of chats) {
            const r = await admitted(b, inbound(chat, t++), claimer("owner-lost", SHORT));
            order.set(chat, [...order.get(chat) ?? [], r.id]);
          }
        }
        await sleep(LAPSE);
        const results = await Promise.all(
          Array.from({ length: 6 }, (_, i) => b.inbox.claimDue({ ...claimer(`owner-${i}`), limit: 2 })),
        );
        const holder = new Map<string, string>();
        for (let i = 0; i < results.length; i++) for (const r of results[i]!) holder.set(r.id, `owner-${i}`);
        for (const chat of chats) {
          const list = order.get(chat)!;
          const taken = list.filter((id) => holder.has(id));
          expect(taken, `chat ${chat}: the records taken are the first of the chat`).toEqual(list.slice(0, taken.length));
          expect(new Set(taken.map((id) => holder.get(id))).size, `chat ${chat}: one claimer`).toBeLessThanOrEqual(1);
          for (const id of taken) expect((await mustGetIn(b, id)).lease?.owner, "the journal agrees").toBe(holder.get(id));
        }
        expect(holder.size, "some records were taken").toBeGreaterThan(0);
      });

      it("concurrent claims of one record: exactly one wins", async (b) => {
        const r = await admitted(b, inbound(uid("chat")));
        const results = await Promise.all(Array.from({ length: 10 }, () => b.inbox.claim(r.id, claimer())));
        const winners = results.filter((x) => x !== null);
        expect(winners.length).toBe(1);
        expect((await mustGetIn(b, r.id)).lease?.owner).toBe(winners[0]?.lease?.owner);
      });

      it("replay: done, failed and dead become pending with attempts reset; processing is left alone", async (b) => {
        const chat = uid("chat");
        const done = await doneRecord(b, chat, 1_000);
        const dead = await admitted(b, inbound(chat, 2_000), claimer());
        await b.inbox.fail(dead.id, 1, { error: "dead", dead: true });
        const failed = await admitted(b, inbound(chat, 3_000), claimer());
        await b.inbox.fail(failed.id, 1, { error: "retry", retryInMs: LONG });
        const processing = await admitted(b, inbound(chat, 4_000), claimer());

        for (const id of [done, dead.id, failed.id]) {
          expect(await b.inbox.replay(id), `replay ${id}`).toBe(true);
          const r = await mustGetIn(b, id);
          expect(r.state).toBe("pending");
          expect(r.attempts).toBe(0);
          expect(r.lease).toBe(null);
          expect(r.nextAttemptAt).toBe(null);
        }
        expect(await b.inbox.replay(processing.id), "processing").toBe(false);
        expect(await b.inbox.get(processing.id)).toEqual(processing);
        expect(await b.inbox.replay(uid("in")), "unknown id").toBe(false);

        const due = await b.inbox.claimDue({ ...claimer(), limit: 100 });
        expect(ids(due), "replayed records are due").toEqual([done, dead.id, failed.id]);
        for (const r of due) {
          expect(r.attempts, "reset by the replay; the claim counts no run").toBe(0);
          expect(tokenOf(r), "tokens keep increasing across a replay").toBe(2);
        }
      });

      it("list filters by state, several states, chatId and limit, in receipt order", async (b) => {
        const chat = uid("chat");
        const other = uid("chat");
        const r0 = await doneRecord(b, chat, 1_000);
        const r1 = await admitted(b, inbound(chat, 2_000), claimer());
        await b.inbox.fail(r1.id, 1, { error: "dead", dead: true });
        const r2 = await admitted(b, inbound(chat, 3_000), claimer());
        const r3 = await admitted(b, inbound(chat, 4_000));
        const r4 = await admitted(b, inbound(other, 5_000));

        expect(ids(await b.inbox.list({ chatId: chat }))).toEqual([r0, r1.id, r2.id, r3.id]);
        expect(ids(await b.inbox.list({ chatId: other }))).toEqual([r4.id]);
        expect(ids(await b.inbox.list({ chatId: chat, state: "done" }))).toEqual([r0]);
        expect(ids(await b.inbox.list({ chatId: chat, state: ["pending", "dead"] }))).toEqual([r1.id, r3.id]);
        expect(ids(await b.inbox.list({ chatId: chat, state: ["failed"] }))).toEqual([]);
        expect(ids(await b.inbox.list({ chatId: chat, limit: 2 }))).toEqual([r0, r1.id]);
        expect(ids(await b.inbox.list({ chatId: chat, limit: 0 }))).toEqual([]);

        const processing = await b.inbox.list({ state: "processing", limit: 1_000 });
        expect(processing.every((r) => r.state === "processing"), "state filter").toBe(true);
        expect(ids(processing).includes(r2.id)).toBe(true);
        const all = ids(await b.inbox.list({ limit: 1_000 }));
        for (const id of [r0, r1.id, r2.id, r3.id, r4.id]) expect(all.includes(id), `list() has ${id}`).toBe(true);
        const listed = (await b.inbox.list({ chatId: chat, state: "processing" }))[0];
        expect(listed, "list returns whole records").toEqual(r2);
      });

      it("list of one state with limit 1 is its oldest record by receivedAt, across chats", async (b) => {
        // What the age gauges of the Prometheus exposition read.
        await admitted(b, inbound(uid("chat"), 9_000));
        const early = await admitted(b, inbound(uid("chat"), 2_000)); // admitted later, received earlier
        await admitted(b, inbound(uid("chat"), 5_000));
        const dead = await admitted(b, inbound(uid("chat"), 7_000), claimer());
        await b.inbox.fail(dead.id, tokenOf(dead), { error: "dead", dead: true });
        expect(ids(await b.inbox.list({ state: "pending", limit: 1 }))).toEqual([early.id]);
        expect(ids(await b.inbox.list({ state: "dead", limit: 1 }))).toEqual([dead.id]);
      });

      it("purge removes done records older than olderThanMs only", async (b) => {
        const chat = uid("chat");
        // Wide margins: on a loaded machine the writes between the recent record and the purge take time.
        const olderThanMs = ms(300);
        const oldDone = await doneRecord(b, chat, 1_000);
        const c = claimer(); // one holder: a chat's records admitted under another lease would wait behind its own
        const dead = await admitted(b, inbound(chat, 2_000), c);
        await b.inbox.fail(dead.id, 1, { error: "dead", dead: true });
        const failed = await admitted(b, inbound(chat, 3_000), c);
        await b.inbox.fail(failed.id, 1, { error: "retry", retryInMs: LONG });
        const processing = await admitted(b, inbound(chat, 5_000), c);
        await sleep(2 * olderThanMs);
        const recent = await admitted(b, inbound(chat, 6_000), c);
        await b.inbox.complete(recent.id, tokenOf(recent));
        const recentDone = recent.id;
        const pending = await admitted(b, inbound(chat, 4_000));

        expect(await b.inbox.purge(olderThanMs), "purge returns how many it deleted").toBe(1);
        expect(await b.inbox.get(oldDone), "old done is gone").toBe(null);
        expect(ids(await b.inbox.list({ chatId: chat }))).toEqual([dead.id, failed.id, pending.id, processing.id, recentDone]);
        expect(await b.inbox.purge(olderThanMs), "nothing left to purge").toBe(0);
      });

      it("returned records are copies", async (b) => {
        const payload = { nested: { value: 1 }, list: [1] };
        const r = await admitted(b, inbound(uid("chat"), 1_000, payload));
        const original = snapshot(r);
        payload.nested.value = 3;
        const mutate = (x: InboundRecord): void => {
          x.state = "dead";
          x.attempts = 99;
          const p = x.payload as { nested: { value: number }; list: number[] };
          p.nested.value = 2;
          p.list.push(2);
        };
        mutate(r);
        mutate(await mustGetIn(b, r.id));
        for (const x of await b.inbox.list({ chatId: r.chatId })) mutate(x);
        expect(await b.inbox.get(r.id)).toEqual(original);
        const claimed = await mustClaim(b, r.id, claimer());
        const claimedCopy = snapshot(claimed);
        mutate(claimed);
        if (claimed.lease) claimed.lease.token = 99;
        expect(await b.inbox.get(r.id)).toEqual(claimedCopy);
      });

      it("payloads round-trip: nested JSON, unicode, empty strings, ~100 KB", async (b) => {
        const chat = uid("chat");
        const payloads: JsonValue[] = [tricky(), large(), "", "✓", 0, true, null, [], {}];
        for (let i = 0; i < payloads.length; i++) {
          const payload = payloads[i]!;
          const r = await admitted(b, inbound(chat, 1_000 + i, payload));
          expect(r.payload).toEqual(payload);
          expect((await mustGetIn(b, r.id)).payload, `payload ${JSON.stringify(payload).slice(0, 40)}`).toEqual(payload);
        }
        const claimed = await b.inbox.claimDue({ ...claimer(), limit: 100 });
        expect(claimed[0]?.payload).toEqual(tricky());
        expect(claimed[1]?.payload).toEqual(large());
      });
    });

    describe("outbox", () => {
      it("reserve with a lease: leased, sending, token 1", async (b) => {
        const chat = uid("chat");
        const input = outbound(chat, { text: "hi" }, "in-1");
        const res = await b.outbox.reserve(input, claimer("owner-a", ms(5_000), "inc-a"));
        expect(res.status).toBe("leased");
        const e = res.entry;
        expect(e.key).toBe(input.key);
        expect(e.chatId).toBe(chat);
        expect(e.content).toEqual({ text: "hi" });
        expect(e.contentHash).toBe(input.contentHash);
        expect(e.inboundId).toBe("in-1");
        expect(e.state).toBe("sending");
        expect(e.attempts).toBe(1);
        expect(e.fence).toBe(1);
        expect(e.lease?.owner).toBe("owner-a");
        expect(e.lease?.incarnation).toBe("inc-a");
        expect(e.lease?.token).toBe(1);
        const expiresIn = (e.lease?.expiresAt ?? 0) - e.updatedAt;
        expect(expiresIn, "lease.expiresAt - updatedAt ≈ leaseMs").toBeGreaterThanOrEqual(ms(5_000) - 1);
        expect(expiresIn, "lease.expiresAt - updatedAt ≈ leaseMs").toBeLessThanOrEqual(ms(5_000) + 1_000);
        expect(e.messageId).toBe(null);
        expect(e.error).toBe(null);
        expect(typeof e.seq).toBe("number");
        expect(typeof e.createdAt).toBe("number");
        expect(await b.outbox.get(e.key)).toEqual(e);
        expect(await b.outbox.get(uid("out")), "get of an unknown key").toBe(null);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "a leased entry is not due").toEqual([]);
      });

      it("reserve without a lease: queued and due now", async (b) => {
        const res = await b.outbox.reserve(outbound(uid("chat")));
        expect(res.status).toBe("queued");
        expect(res.entry.state).toBe("queued");
        expect(res.entry.attempts).toBe(0);
        expect(res.entry.fence).toBe(0);
        expect(res.entry.lease).toBe(null);
        expect(res.entry.messageId).toBe(null);
        expect(await b.outbox.get(res.entry.key)).toEqual(res.entry);
        const claim = await b.outbox.claimDue({ ...claimer("owner-a"), limit: 100 });
        expect(keys(claim.due)).toEqual([res.entry.key]);
        expect(claim.ambiguous).toEqual([]);
        const e = claim.due[0]!;
        expect(e.state).toBe("sending");
        expect(e.attempts).toBe(1);
        expect(e.lease?.owner).toBe("owner-a");
        expect(e.lease?.token).toBe(FIRST_CLAIM);
        expect(await b.outbox.get(e.key)).toEqual(e);
      });

      it("reserve of a known key: exists, nothing changes (also with other content)", async (b) => {
        const chat = uid("chat");
        const input = outbound(chat, { text: "first" });
        const first = await reserved(b, input);
        const again = await b.outbox.reserve(input, claimer());
        expect(again.status).toBe("exists");
        expect(again.entry).toEqual(first);
        const changed = await b.outbox.reserve({ ...input, content: { text: "second" }, contentHash: hashOf({ text: "second" }) });
        expect(changed.status).toBe("exists");
        expect(changed.entry.content, "the journaled content is returned").toEqual({ text: "first" });
        expect(changed.entry.contentHash).toBe(input.contentHash);
        expect(await b.outbox.get(input.key)).toEqual(first);

        const sending = await reserved(b, outbound(uid("chat")), claimer());
        const dup = await b.outbox.reserve({ key: sending.key, chatId: sending.chatId, content: 1, contentHash: "x", inboundId: null });
        expect(dup.status).toBe("exists");
        expect(dup.entry).toEqual(sending);
      });

      it("concurrent reserves of one key: exactly one journals it", async (b) => {
        const input = outbound(uid("chat"));
        const results = await Promise.all(Array.from({ length: 10 }, () => b.outbox.reserve(input, claimer())));
        expect(results.filter((r) => r.status !== "exists").length).toBe(1);
        expect(results.filter((r) => r.status === "leased").length).toBe(1);
      });

      it("concurrent reserves in one chat: one leased, the rest queued behind it in seq order", async (b) => {
        const chat = uid("chat");
        const results = await Promise.all(Array.from({ length: 6 }, () => b.outbox.reserve(outbound(chat), claimer())));
        const leased = results.filter((r) => r.status === "leased");
        expect(leased.length).toBe(1);
        expect(results.filter((r) => r.status === "queued").length).toBe(5);
        const seqs = results.map((r) => r.entry.seq);
        expect(new Set(seqs).size, "distinct seq").toBe(6);
        expect(leased[0]!.entry.seq, "the leased one is the earliest").toBe(Math.min(...seqs));
        const listed = await b.outbox.list({ chatId: chat });
        expect(listed.map((e) => e.seq), "list in seq order").toEqual([...seqs].sort((x, y) => x - y));
      });

      it("per-chat order: a later send waits behind a sending or queued one", async (b) => {
        const chat = uid("chat");
        const other = uid("chat");
        const a = await b.outbox.reserve(outbound(chat, { n: 1 }), claimer());
        expect(a.status).toBe("leased");
        const second = await b.outbox.reserve(outbound(chat, { n: 2 }), claimer());
        expect(second.status, "behind a sending entry").toBe("queued");
        expect(second.entry.state).toBe("queued");
        expect(second.entry.lease).toBe(null);
        expect(second.entry.seq).toBeGreaterThan(a.entry.seq);
        const otherChat = await b.outbox.reserve(outbound(other), claimer());
        expect(otherChat.status, "other chats are not blocked").toBe("leased");
        const third = await b.outbox.reserve(outbound(chat, { n: 3 }), claimer());
        expect(third.status, "behind a sending and a queued entry").toBe("queued");

        const freeChat = uid("chat");
        const free = await reserved(b, outbound(freeChat));
        const claim1 = await b.outbox.claimDue({ ...claimer(), limit: 100 });
        expect(keys(claim1.due), "only the other chat's entry is due").toEqual([free.key]);

        await b.outbox.markSent(a.entry.key, 1, "m-1");
        const claim2 = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(claim2.due), "after the first is sent the second is due, not the third").toEqual([second.entry.key]);
        expect(claim2.due[0]!.lease?.token).toBe(FIRST_CLAIM);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due)).toEqual([]);
        await b.outbox.markSent(second.entry.key, FIRST_CLAIM, "m-2");
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due)).toEqual([third.entry.key]);
      });

      it("per-chat order: a queued entry blocks, the first queued is due first", async (b) => {
        const chat = uid("chat");
        const a = await reserved(b, outbound(chat, { n: 1 }));
        const second = await b.outbox.reserve(outbound(chat, { n: 2 }), claimer());
        expect(second.status, "behind a queued entry").toBe("queued");
        const claim = await b.outbox.claimDue({ ...claimer(), limit: 100 });
        expect(keys(claim.due)).toEqual([a.key]);
        expect((await mustGetOut(b, second.entry.key)).state).toBe("queued");
      });

      it("per-chat order: a failed entry blocks; dead and unknown entries do not", async (b) => {
        const failedChat = uid("chat");
        const f = await reserved(b, outbound(failedChat), claimer());
        await b.outbox.markFailed(f.key, 1, { error: "retry later", retryInMs: LONG });
        const behindFailed = await b.outbox.reserve(outbound(failedChat), claimer());
        expect(behindFailed.status, "behind a failed entry").toBe("queued");
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "nothing due in that chat").toEqual([]);

        const deadChat = uid("chat");
        const d = await reserved(b, outbound(deadChat), claimer());
        const queuedBehindDead = await reserved(b, outbound(deadChat));
        await b.outbox.markFailed(d.key, 1, { error: "permanent", dead: true });
        expect((await b.outbox.reserve(outbound(deadChat), claimer())).status, "still behind the queued entry").toBe("queued");
        const claim = await b.outbox.claimDue({ ...claimer(), limit: 100 });
        expect(keys(claim.due), "a dead entry does not block claimDue").toEqual([queuedBehindDead.key]);

        const unknownChat = uid("chat");
        await unknownEntry(b, unknownChat);
        expect((await b.outbox.reserve(outbound(unknownChat), claimer())).status, "an unknown entry does not block").toBe("leased");

        const unknownChat2 = uid("chat");
        await unknownEntry(b, unknownChat2);
        const q = await reserved(b, outbound(unknownChat2));
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "nor claimDue").toEqual([q.key]);

        const deadChat2 = uid("chat");
        const d2 = await reserved(b, outbound(deadChat2), claimer());
        await b.outbox.markFailed(d2.key, 1, { error: "permanent", dead: true });
        expect((await b.outbox.reserve(outbound(deadChat2), claimer())).status, "reserve after a dead entry").toBe("leased");
      });

      it("markSent stores the messageId; stale tokens throw and change nothing", async (b) => {
        const owner = uid("owner");
        const e = await reserved(b, outbound(uid("chat")), claimer(owner));
        const claim = await b.outbox.claimDue({ ...claimer(owner), reclaimOwn: true, resendAmbiguous: true, limit: 100 });
        expect(keys(claim.ambiguous)).toEqual([e.key]);
        expect(keys(claim.due)).toEqual([e.key]);
        const retaken = claim.due[0]!;
        expect(retaken.lease?.token, "a new token").toBe(2);
        expect(retaken.fence).toBe(2);
        expect(retaken.attempts).toBe(2);

        const before = await mustGetOut(b, e.key);
        await expectStale(expect, () => b.outbox.markSent(e.key, 1, "stale"), "markSent with token 1");
        await expectStale(expect, () => b.outbox.markFailed(e.key, 1, { error: "x", retryInMs: 0 }), "markFailed with token 1");
        await expectStale(expect, () => b.outbox.markFailed(e.key, 1, { error: "x", dead: true }), "markFailed dead with token 1");
        await expectStale(expect, () => b.outbox.markSent(e.key, 3, "never issued"), "markSent with token 3");
        expect(await b.outbox.heartbeat(e.key, 1, LONG), "heartbeat with token 1").toBe(false);
        expect(await b.outbox.get(e.key), "stale operations changed nothing").toEqual(before);

        expect(await b.outbox.heartbeat(e.key, 2, LONG)).toBe(true);
        await b.outbox.markSent(e.key, 2, "provider-message-1");
        const sent = await mustGetOut(b, e.key);
        expect(sent.state).toBe("sent");
        expect(sent.messageId).toBe("provider-message-1");
        expect(sent.lease).toBe(null);
        expect(sent.attempts).toBe(2);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due)).toEqual([]);
      });

      it("a markSent after the lease lapsed succeeds when nobody retook it", async (b) => {
        const s = await reserved(b, outbound(uid("chat")), claimer(uid("owner"), SHORT));
        const f = await reserved(b, outbound(uid("chat")), claimer(uid("owner"), SHORT));
        const h = await reserved(b, outbound(uid("chat")), claimer(uid("owner"), SHORT));
        await sleep(LAPSE);
        await b.outbox.markSent(s.key, 1, "late");
        const sent = await mustGetOut(b, s.key);
        expect(sent.state).toBe("sent");
        expect(sent.messageId).toBe("late");
        await b.outbox.markFailed(f.key, 1, { error: "late", dead: true });
        expect((await mustGetOut(b, f.key)).state).toBe("dead");
        expect(await b.outbox.heartbeat(h.key, 1, LONG), "a late heartbeat keeps an untaken lease").toBe(true);
        const claim = await b.outbox.claimDue({ ...claimer(), limit: 100 });
        expect(keys(claim.ambiguous).concat(keys(claim.due)), "… and extends it").toEqual([]);
      });

      it("markFailed with a retry: failed, due after retryInMs", async (b) => {
        const chat = uid("chat");
        const retryInMs = ms(100);
        const e = await reserved(b, outbound(chat), claimer());
        await b.outbox.markFailed(e.key, 1, { error: "429", retryInMs });
        const failed = await mustGetOut(b, e.key);
        expect(failed.state).toBe("failed");
        expect(failed.error).toBe("429");
        expect(failed.lease).toBe(null);
        expect(failed.attempts).toBe(1);
        const delay = (failed.nextAttemptAt ?? 0) - failed.updatedAt;
        expect(delay, "nextAttemptAt - updatedAt ≈ retryInMs").toBeGreaterThanOrEqual(retryInMs - 1);
        expect(delay, "nextAttemptAt - updatedAt ≈ retryInMs").toBeLessThanOrEqual(retryInMs + 1_000);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "not due yet").toEqual([]);
        await sleep(retryInMs + LAPSE);
        const claim = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(claim.due)).toEqual([e.key]);
        const retried = claim.due[0]!;
        expect(retried.state).toBe("sending");
        expect(retried.lease?.owner).toBe("owner-b");
        expect(retried.lease?.token).toBe(2);
        expect(retried.attempts).toBe(2);
        expect(retried.content).toEqual(e.content);
      });

      it("markFailed throttled (a 429): failed, due after retryInMs, its attempt given back; its chat waits behind it", async (b) => {
        const chat = uid("chat");
        const retryInMs = ms(100);
        const e = await reserved(b, outbound(chat, { n: 1 }), claimer());
        const behind = await reserved(b, outbound(chat, { n: 2 }));
        expect(e.attempts).toBe(1);
        await b.outbox.markFailed(e.key, 1, { error: "429 Too Many Requests", retryInMs, throttled: true });
        const paused = await mustGetOut(b, e.key);
        expect(paused.state).toBe("failed");
        expect(paused.error).toBe("429 Too Many Requests");
        expect(paused.lease).toBe(null);
        expect(paused.attempts, "the throttled call spent no attempt").toBe(0);
        expect(paused.fence).toBe(1);
        const delay = (paused.nextAttemptAt ?? 0) - paused.updatedAt;
        expect(delay, "nextAttemptAt - updatedAt ≈ retryInMs").toBeGreaterThanOrEqual(retryInMs - 1);
        expect(delay, "nextAttemptAt - updatedAt ≈ retryInMs").toBeLessThanOrEqual(retryInMs + 1_000);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "neither it nor the send behind it is due yet").toEqual([]);
        await sleep(retryInMs + LAPSE);
        const claim = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(claim.due), "the paused send first, the one behind it still waits").toEqual([e.key]);
        expect(claim.due[0]!.attempts, "the retry counts as the first attempt again").toBe(1);
        expect(claim.due[0]!.lease?.token).toBe(2);
        await b.outbox.markSent(e.key, 2, "m-1");
        expect(keys((await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 })).due)).toEqual([behind.key]);
        // Never below zero, whatever the count.
        const again = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(again.key, 1, { error: "429", retryInMs: 0, throttled: true });
        await b.outbox.retry(again.key);
        const requeued = (await b.outbox.claimDue({ ...claimer(), limit: 100 })).due.find((x) => x.key === again.key)!;
        await b.outbox.markFailed(again.key, requeued.fence, { error: "429", retryInMs: 0, throttled: true });
        expect((await mustGetOut(b, again.key)).attempts).toBe(0);
      });

      it("markFailed dead: dead, never due", async (b) => {
        const e = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(e.key, 1, { error: "invalid recipient", dead: true });
        const dead = await mustGetOut(b, e.key);
        expect(dead.state).toBe("dead");
        expect(dead.error).toBe("invalid recipient");
        expect(dead.lease).toBe(null);
        expect(dead.messageId).toBe(null);
        const claim = await b.outbox.claimDue({ ...claimer(), reclaimOwn: true, resendAmbiguous: true, limit: 100 });
        expect(keys(claim.due).concat(keys(claim.ambiguous))).toEqual([]);
      });

      it("a lapsed send becomes unknown, reported in ambiguous exactly once", async (b) => {
        const chat = uid("chat");
        const a = claimer("owner-a", SHORT, "inc-a");
        const lapsed = await reserved(b, outbound(chat, { n: 1 }), a);
        const behind = await reserved(b, outbound(chat, { n: 2 }));
        const live = await reserved(b, outbound(uid("chat")), { ...a, leaseMs: LONG });
        await sleep(LAPSE);
        const first = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(first.ambiguous)).toEqual([lapsed.key]);
        const reported = first.ambiguous[0]!;
        expect(reported.state).toBe("unknown");
        expect(reported.lease).toBe(null);
        expect(reported.attempts).toBe(1);
        expect(keys(first.due).includes(lapsed.key), "an unknown entry is not re-sent").toBe(false);
        const unknown = await mustGetOut(b, lapsed.key);
        expect(unknown.state).toBe("unknown");
        expect(unknown.lease).toBe(null);
        expect(unknown.messageId).toBe(null);

        const second = await b.outbox.claimDue({ ...claimer("owner-c"), limit: 100 });
        expect(second.ambiguous, "the second claimer sees nothing").toEqual([]);
        expect(keys(first.due).concat(keys(second.due)), "the entry behind it becomes due once").toEqual([behind.key]);
        expect(await b.outbox.heartbeat(lapsed.key, 1, LONG), "the lost sender's heartbeat").toBe(false);
        expect((await mustGetOut(b, lapsed.key)).state).toBe("unknown");
        expect((await mustGetOut(b, live.key)).state, "the live lease is untouched").toBe("sending");
      });

      it("a late markSent resolves an unknown entry: sent with its messageId, no longer unknown", async (b) => {
        const chat = uid("chat");
        const lapsed = await reserved(b, outbound(chat), claimer("owner-a", SHORT));
        const token = tokenOf(lapsed);
        await sleep(LAPSE);
        const claim = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(claim.ambiguous)).toEqual([lapsed.key]);
        const unknown = await mustGetOut(b, lapsed.key);
        expect(unknown.state).toBe("unknown");
        expect(unknown.fence, "an unknown entry keeps its fence").toBe(token);
        expect(await b.outbox.heartbeat(lapsed.key, token, LONG), "a heartbeat does not revive it").toBe(false);
        expect(await b.outbox.get(lapsed.key), "… and changes nothing").toEqual(unknown);

        // The sender was alive after all (a stall): its provider call finishes.
        await b.outbox.markSent(lapsed.key, token, "late-message");
        const sent = await mustGetOut(b, lapsed.key);
        expect(sent.state).toBe("sent");
        expect(sent.messageId).toBe("late-message");
        expect(sent.lease).toBe(null);
        expect(sent.nextAttemptAt).toBe(null);
        expect(sent.attempts, "no new attempt").toBe(1);
        expect(sent.fence, "no new token").toBe(token);
        expect(keys(await b.outbox.list({ chatId: chat, state: "sent" })), "listed as sent").toEqual([lapsed.key]);
        expect(keys(await b.outbox.list({ chatId: chat, state: "unknown" })), "no longer unknown").toEqual([]);
        expect(keys(await b.outbox.list({ state: "unknown", limit: 1_000 })).includes(lapsed.key)).toBe(false);
        expect((await b.outbox.list({ state: ["sent", "unknown"], limit: 1_000 })).filter((e) => e.key === lapsed.key))
          .toEqual([sent]);

        await expectStale(expect, () => b.outbox.markSent(lapsed.key, token, "again"), "markSent on the sent entry");
        await expectStale(
          expect,
          () => b.outbox.markFailed(lapsed.key, token, { error: "x", retryInMs: 0 }),
          "markFailed on the sent entry",
        );
        expect(await b.outbox.get(lapsed.key), "stale outcomes changed nothing").toEqual(sent);
        const after = await b.outbox.claimDue({ ...claimer("owner-c"), reclaimOwn: true, resendAmbiguous: true, limit: 100 });
        expect(keys(after.due).concat(keys(after.ambiguous)), "a sent entry is never due").toEqual([]);
        expect((await b.outbox.reserve(outbound(chat), claimer())).status, "the chat is clear").toBe("leased");
      });

      it("a late markFailed resolves an unknown entry: failed and due after retryInMs, or dead", async (b) => {
        const retryInMs = ms(100);
        const r = await reserved(b, outbound(uid("chat")), claimer("owner-a", SHORT));
        const d = await reserved(b, outbound(uid("chat")), claimer("owner-a", SHORT));
        await sleep(LAPSE);
        const claim = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(claim.ambiguous).sort()).toEqual([r.key, d.key].sort());

        await b.outbox.markFailed(r.key, tokenOf(r), { error: "503", retryInMs });
        const failed = await mustGetOut(b, r.key);
        expect(failed.state).toBe("failed");
        expect(failed.error).toBe("503");
        expect(failed.lease).toBe(null);
        expect(failed.attempts).toBe(1);
        expect(failed.fence).toBe(tokenOf(r));
        const delay = (failed.nextAttemptAt ?? 0) - failed.updatedAt;
        expect(delay, "nextAttemptAt - updatedAt ≈ retryInMs").toBeGreaterThanOrEqual(retryInMs - 1);
        expect(delay, "nextAttemptAt - updatedAt ≈ retryInMs").toBeLessThanOrEqual(retryInMs + 1_000);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "not due yet").toEqual([]);

        await b.outbox.markFailed(d.key, tokenOf(d), { error: "invalid recipient", dead: true });
        const dead = await mustGetOut(b, d.key);
        expect(dead.state).toBe("dead");
        expect(dead.error).toBe("invalid recipient");
        expect(dead.lease).toBe(null);
        expect(keys(await b.outbox.list({ state: "dead", limit: 1_000 })).includes(d.key), "listed as dead").toBe(true);
        const unknownLeft = keys(await b.outbox.list({ state: "unknown", limit: 1_000 }));
        expect(unknownLeft.includes(r.key) || unknownLeft.includes(d.key), "neither is unknown any more").toBe(false);

        await sleep(retryInMs + LAPSE);
        const again = await b.outbox.claimDue({ ...claimer("owner-c"), limit: 100 });
        expect(keys(again.due), "the failed one is due again; the dead one never").toEqual([r.key]);
        const retried = again.due[0]!;
        expect(retried.state).toBe("sending");
        expect(retried.lease?.owner).toBe("owner-c");
        expect(tokenOf(retried), "a new token").toBe(tokenOf(r) + 1);
        expect(retried.attempts).toBe(2);
        await expectStale(expect, () => b.outbox.markSent(r.key, tokenOf(r), "late"), "the old token after the claim");
        await expectStale(expect, () => b.outbox.markSent(d.key, tokenOf(d), "late"), "markSent on the dead entry");
        expect(await b.outbox.get(d.key)).toEqual(dead);
        await b.outbox.markSent(r.key, tokenOf(retried), "m");
        expect((await mustGetOut(b, r.key)).messageId).toBe("m");
      });

      it("a late outcome stays stale once the unknown entry was retried or re-leased", async (b) => {
        // An operator retry: queued (the old token is stale), then claimed with a new token.
        const retried = await unknownEntry(b, uid("chat"));
        const old = retried.fence;
        expect(await b.outbox.retry(retried.key)).toBe(true);
        const queued = await mustGetOut(b, retried.key);
        await expectStale(expect, () => b.outbox.markSent(retried.key, old, "late"), "markSent after a retry");
        await expectStale(
          expect,
          () => b.outbox.markFailed(retried.key, old, { error: "late", retryInMs: 0 }),
          "markFailed after a retry",
        );
        await expectStale(
          expect,
          () => b.outbox.markFailed(retried.key, old, { error: "late", dead: true }),
          "markFailed dead after a retry",
        );
        expect(await b.outbox.get(retried.key), "nothing changed").toEqual(queued);
        const claim = await b.outbox.claimDue({ ...claimer("owner-b", SHORT), limit: 100 });
        expect(keys(claim.due)).toEqual([retried.key]);
        const second = tokenOf(claim.due[0]!);
        expect(second).toBe(old + 1);
        await expectStale(expect, () => b.outbox.markSent(retried.key, old, "late"), "markSent after the new claim");
        expect(await b.outbox.heartbeat(retried.key, old, LONG)).toBe(false);
        expect(await b.outbox.markCalling(retried.key, old, LONG), "markCalling with the old token").toBe(false);
        await announced(b, claim.due, SHORT);

        // That claim lapses too: unknown again, with the new fence; only its token resolves it.
        await sleep(LAPSE);
        const lost = await b.outbox.claimDue({ ...claimer("owner-c"), limit: 100 });
        expect(keys(lost.ambiguous)).toEqual([retried.key]);
        const unknownAgain = await mustGetOut(b, retried.key);
        expect(unknownAgain.state).toBe("unknown");
        expect(unknownAgain.fence).toBe(second);
        await expectStale(expect, () => b.outbox.markSent(retried.key, old, "late"), "an unknown entry with another fence");
        await expectStale(
          expect,
          () => b.outbox.markFailed(retried.key, old, { error: "late", dead: true }),
          "markFailed on an unknown entry with another fence",
        );
        expect(await b.outbox.get(retried.key)).toEqual(unknownAgain);
        await b.outbox.markFailed(retried.key, second, { error: "permanent", dead: true });
        expect((await mustGetOut(b, retried.key)).state).toBe("dead");

        // resendAmbiguous re-leases the lapsed send with a new fence: the lost sender's token stays stale.
        const lapsed = await reserved(b, outbound(uid("chat")), claimer("owner-a", SHORT));
        await sleep(LAPSE);
        const resend = await b.outbox.claimDue({ ...claimer("owner-d"), resendAmbiguous: true, limit: 100 });
        expect(keys(resend.due)).toEqual([lapsed.key]);
        const releasedToken = tokenOf(resend.due[0]!);
        expect(releasedToken).toBe(tokenOf(lapsed) + 1);
        const before = await mustGetOut(b, lapsed.key);
        await expectStale(expect, () => b.outbox.markSent(lapsed.key, tokenOf(lapsed), "old"), "markSent after a resend");
        await expectStale(
          expect,
          () => b.outbox.markFailed(lapsed.key, tokenOf(lapsed), { error: "old", retryInMs: 0 }),
          "markFailed after a resend",
        );
        expect(await b.outbox.get(lapsed.key)).toEqual(before);
        await b.outbox.markSent(lapsed.key, releasedToken, "new");
        const sent = await mustGetOut(b, lapsed.key);
        expect(sent.state).toBe("sent");
        expect(sent.messageId).toBe("new");
      });

      it("a late outcome is stale on a queued, sent, failed or dead entry", async (b) => {
        const queued = await reserved(b, outbound(uid("chat")));
        const sent = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markSent(sent.key, 1, "m");
        const failed = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(failed.key, 1, { error: "later", retryInMs: LONG });
        const dead = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(dead.key, 1, { error: "dead", dead: true });
        for (const key of [queued.key, sent.key, failed.key, dead.key]) {
          const before = await mustGetOut(b, key);
          for (const token of [before.fence, before.fence + 1]) {
            await expectStale(expect, () => b.outbox.markSent(key, token, "late"), `markSent(${token}) on ${before.state}`);
            await expectStale(
              expect,
              () => b.outbox.markFailed(key, token, { error: "late", retryInMs: 0 }),
              `markFailed(${token}) on ${before.state}`,
            );
            await expectStale(
              expect,
              () => b.outbox.markFailed(key, token, { error: "late", dead: true }),
              `markFailed dead (${token}) on ${before.state}`,
            );
          }
          expect(await b.outbox.get(key), `${before.state}: nothing changed`).toEqual(before);
        }
      });

      it("chat order through a failover: the lost replica's sends of a chat are taken by one claimer, head first; the rest wait behind it", async (b) => {
        const chat = uid("chat");
        const lost = claimer("owner-lost", SHORT);
        const head = await reserved(b, outbound(chat), lost); // its call was under way
        const second = (await b.outbox.reserve(outbound(chat))).entry;
        const third = (await b.outbox.reserve(outbound(chat))).entry;
        expect([second.state, third.state]).toEqual(["queued", "queued"]);
        await sleep(LAPSE);
        const claims = await Promise.all(
          Array.from({ length: 4 }, (_, i) => b.outbox.claimDue({ ...claimer(`owner-${i}`), limit: 10 })),
        );
        expect(claims.flatMap((c) => keys(c.ambiguous)), "the lost call is ambiguous, once").toEqual([head.key]);
        let due = claims.flatMap((c) => keys(c.due));
        expect(due.length <= 1 && due.every((k) => k === second.key), `at most the next send of the chat, by one claimer: ${due}`).toBe(true);
        // Scans that all began before one of them made the head unknown may each find the chat still
        // held (as in "a lapsed send becomes unknown…"): then the next scan takes the next send.
        if (due.length === 0) due = keys((await b.outbox.claimDue({ ...claimer("owner-next"), limit: 10 })).due);
        expect(due, "only the next send of the chat is leased, by one claimer").toEqual([second.key]);
        const holder = (await mustGetOut(b, second.key)).lease!;
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 10 })).due), "nothing while it is held").toEqual([]);
        await b.outbox.markSent(second.key, holder.token, "m-2");
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 10 })).due), "then the third").toEqual([third.key]);
      });

      it("per-chat order: an unknown entry resolved to failed blocks its chat again until it is sent", async (b) => {
        const chat = uid("chat");
        const retryInMs = ms(150);
        const lapsed = await reserved(b, outbound(chat, { n: 1 }), claimer("owner-a", SHORT));
        const second = await reserved(b, outbound(chat, { n: 2 }));
        await sleep(LAPSE);
        const first = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(first.ambiguous)).toEqual([lapsed.key]);
        // The entry behind it is due in this scan or the next (as in "a lapsed send becomes unknown…").
        const freed = first.due.length > 0 ? first.due : (await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 })).due;
        expect(keys(freed), "an unknown entry does not block its chat").toEqual([second.key]);
        await b.outbox.markSent(second.key, tokenOf(freed[0]!), "m-2");
        const third = await reserved(b, outbound(chat, { n: 3 }));

        await b.outbox.markFailed(lapsed.key, tokenOf(lapsed), { error: "503", retryInMs });
        expect((await mustGetOut(b, lapsed.key)).state).toBe("failed");
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "the chat waits behind it").toEqual([]);
        const fourth = await b.outbox.reserve(outbound(chat, { n: 4 }), claimer());
        expect(fourth.status, "a new send queues behind it").toBe("queued");
        expect((await mustGetOut(b, third.key)).state).toBe("queued");

        await sleep(retryInMs + LAPSE);
        const retry = await b.outbox.claimDue({ ...claimer("owner-c"), limit: 100 });
        expect(keys(retry.due), "the resolved entry goes first").toEqual([lapsed.key]);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "the chat waits while it is sent").toEqual([]);
        await b.outbox.markSent(lapsed.key, tokenOf(retry.due[0]!), "m-1");
        const next = await b.outbox.claimDue({ ...claimer(), limit: 100 });
        expect(keys(next.due), "then the chat moves on, in order").toEqual([third.key]);
        await b.outbox.markSent(third.key, tokenOf(next.due[0]!), "m-3");
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due)).toEqual([fourth.entry.key]);
      });

      it("markFailed ambiguous: unknown like a lost send (lease dropped, fence, attempts and error kept), listed as unknown, not due; its chat moves on at once", async (b) => {
        const chat = uid("chat");
        const owner = uid("owner");
        const sending = await reserved(b, outbound(chat, { n: 1 }), claimer(owner));
        const behind = await reserved(b, outbound(chat, { n: 2 }));
        expect(behind.state, "queued behind the send").toBe("queued");
        const token = tokenOf(sending);
        const before = await mustGetOut(b, sending.key);

        await b.outbox.markFailed(sending.key, token, { error: "timed out after the request was sent", ambiguous: true });
        const unknown = await mustGetOut(b, sending.key);
        expect(unknown.state).toBe("unknown");
        expect(unknown.lease).toBe(null);
        expect(unknown.nextAttemptAt).toBe(null);
        expect(unknown.error, "the error text is kept").toBe("timed out after the request was sent");
        expect(unknown.fence, "the fence is unchanged").toBe(token);
        expect(unknown.attempts, "no new attempt").toBe(before.attempts);
        expect(unknown.messageId).toBe(null);
        expect(unknown.content).toEqual(before.content);
        expect(unknown.seq).toBe(before.seq);
        expect(unknown.updatedAt).toBeGreaterThanOrEqual(before.updatedAt);
        expect(keys(await b.outbox.list({ chatId: chat, state: "unknown" })), "listed as unknown").toEqual([sending.key]);
        expect(keys(await b.outbox.list({ state: "sending", limit: 1_000 })).includes(sending.key), "no longer sending").toBe(false);
        expect(await b.outbox.heartbeat(sending.key, token, LONG), "a heartbeat does not revive it").toBe(false);
        expect(await b.outbox.get(sending.key), "… and changes nothing").toEqual(unknown);

        // Not re-sent on its own, not reported again as ambiguous; the queued entry behind it is due right away.
        const claim = await b.outbox.claimDue({ ...claimer(owner), reclaimOwn: true, resendAmbiguous: true, limit: 100 });
        expect(keys(claim.ambiguous), "claimDue does not report it again").toEqual([]);
        expect(keys(claim.due), "the next entry of its chat is due at once; the unknown one is not").toEqual([behind.key]);
        expect(tokenOf(claim.due[0]!)).toBe(FIRST_CLAIM);
        expect(await b.outbox.get(sending.key), "the scan left it alone").toEqual(unknown);
        await b.outbox.markSent(behind.key, tokenOf(claim.due[0]!), "m-2");
        expect((await b.outbox.reserve(outbound(chat), claimer())).status, "an unknown entry does not block its chat").toBe("leased");
      });

      it("markFailed ambiguous: a late outcome under the same token resolves it (sent, or dead)", async (b) => {
        const chat = uid("chat");
        const s = await reserved(b, outbound(chat), claimer());
        await b.outbox.markFailed(s.key, tokenOf(s), { error: "timeout", ambiguous: true });
        expect((await mustGetOut(b, s.key)).state).toBe("unknown");
        await b.outbox.markSent(s.key, tokenOf(s), "late-message");
        const sent = await mustGetOut(b, s.key);
        expect(sent.state).toBe("sent");
        expect(sent.messageId).toBe("late-message");
        expect(sent.lease).toBe(null);
        expect(sent.fence, "no new token").toBe(tokenOf(s));
        expect(sent.attempts, "no new attempt").toBe(1);
        expect(keys(await b.outbox.list({ chatId: chat, state: "unknown" })), "no longer unknown").toEqual([]);
        expect(keys(await b.outbox.list({ chatId: chat, state: "sent" })), "listed as sent").toEqual([s.key]);
        await expectStale(expect, () => b.outbox.markSent(s.key, tokenOf(s), "again"), "markSent on the sent entry");
        await expectStale(
          expect,
          () => b.outbox.markFailed(s.key, tokenOf(s), { error: "again", ambiguous: true }),
          "markFailed ambiguous on the sent entry",
        );
        expect(await b.outbox.get(s.key), "stale outcomes changed nothing").toEqual(sent);

        const d = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(d.key, tokenOf(d), { error: "timeout", ambiguous: true });
        await b.outbox.markFailed(d.key, tokenOf(d), { error: "invalid recipient", dead: true });
        const dead = await mustGetOut(b, d.key);
        expect(dead.state).toBe("dead");
        expect(dead.error).toBe("invalid recipient");
        const after = await b.outbox.claimDue({ ...claimer(), reclaimOwn: true, resendAmbiguous: true, limit: 100 });
        expect(keys(after.due).concat(keys(after.ambiguous)), "neither is ever due").toEqual([]);
      });

      it("markFailed ambiguous: an operator retry requeues it; the next claim issues a new token, the old one is stale", async (b) => {
        const chat = uid("chat");
        const e = await reserved(b, outbound(chat), claimer());
        const old = tokenOf(e);
        await b.outbox.markFailed(e.key, old, { error: "timeout", ambiguous: true });
        expect(await b.outbox.retry(e.key)).toBe(true);
        const queued = await mustGetOut(b, e.key);
        expect(queued.state).toBe("queued");
        expect(queued.attempts, "attempts reset").toBe(0);
        expect(queued.lease).toBe(null);
        expect(queued.nextAttemptAt, "due now").not.toBe(null);
        await expectStale(expect, () => b.outbox.markSent(e.key, old, "late"), "markSent with the old token after a retry");
        await expectStale(
          expect,
          () => b.outbox.markFailed(e.key, old, { error: "late", ambiguous: true }),
          "markFailed ambiguous with the old token after a retry",
        );
        expect(await b.outbox.get(e.key), "nothing changed").toEqual(queued);

        const claim = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(claim.due)).toEqual([e.key]);
        const token = tokenOf(claim.due[0]!);
        expect(token, "a new token").toBe(old + 1);
        await expectStale(expect, () => b.outbox.markSent(e.key, old, "late"), "markSent with the old token after the claim");
        await b.outbox.markSent(e.key, token, "m");
        const sent = await mustGetOut(b, e.key);
        expect(sent.state).toBe("sent");
        expect(sent.messageId).toBe("m");
      });

      it("markFailed ambiguous with a stale token throws and changes nothing", async (b) => {
        // A re-leased entry: the old token is stale, the current one works.
        const e = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(e.key, 1, { error: "503", retryInMs: 0 });
        const claim = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(claim.due)).toEqual([e.key]);
        const leased = await mustGetOut(b, e.key);
        for (const token of [1, 3]) {
          await expectStale(
            expect,
            () => b.outbox.markFailed(e.key, token, { error: "late", ambiguous: true }),
            `markFailed ambiguous(${token}) on an entry leased with 2`,
          );
        }
        expect(await b.outbox.get(e.key), "nothing changed").toEqual(leased);

        // Queued, sent, failed, dead entries, and an unknown entry with another fence.
        const queued = await reserved(b, outbound(uid("chat")));
        const sent = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markSent(sent.key, 1, "m");
        const failed = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(failed.key, 1, { error: "later", retryInMs: LONG });
        const dead = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(dead.key, 1, { error: "dead", dead: true });
        const unknown = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(unknown.key, 1, { error: "timeout", ambiguous: true });
        for (const key of [queued.key, sent.key, failed.key, dead.key, unknown.key]) {
          const before = await mustGetOut(b, key);
          for (const token of before.state === "unknown" ? [before.fence - 1, before.fence + 1] : [before.fence, before.fence + 1]) {
            await expectStale(
              expect,
              () => b.outbox.markFailed(key, token, { error: "late", ambiguous: true }),
              `markFailed ambiguous(${token}) on ${before.state}`,
            );
          }
          expect(await b.outbox.get(key), `${before.state}: nothing changed`).toEqual(before);
        }
        await expectStale(
          expect,
          () => b.outbox.markFailed(uid("out"), 1, { error: "late", ambiguous: true }),
          "markFailed ambiguous on an unknown key",
        );
      });

      it("markCalling: called, lease extended; idempotent; stale tokens and unknown entries answer false and change nothing", async (b) => {
        const chat = uid("chat");
        const res = await b.outbox.reserve(outbound(chat, { n: 1 }), claimer("owner-a", SHORT));
        expect(res.status).toBe("leased");
        expect(res.entry.called, "a leased reserve starts uncalled").toBe(false);
        expect((await mustGetOut(b, res.entry.key)).called).toBe(false);
        const queued = await reserved(b, outbound(chat, { n: 2 }));
        expect(queued.called, "a queued entry is not called").toBe(false);
        expect(await b.outbox.markCalling(queued.key, 1, LONG), "a queued entry has no lease").toBe(false);
        expect(await b.outbox.get(queued.key)).toEqual(queued);
        expect(await b.outbox.markCalling(res.entry.key, 2, LONG), "a token never issued").toBe(false);
        expect((await mustGetOut(b, res.entry.key)).called).toBe(false);

        expect(await b.outbox.markCalling(res.entry.key, 1, LONG)).toBe(true);
        const called = await mustGetOut(b, res.entry.key);
        expect(called.called).toBe(true);
        expect(called.state).toBe("sending");
        expect(called.attempts).toBe(1);
        expect(called.fence).toBe(1);
        expect(called.lease?.token).toBe(1);
        expect(called.lease!.expiresAt, "the lease is extended").toBeGreaterThan(res.entry.lease!.expiresAt);
        expect(await b.outbox.markCalling(res.entry.key, 1, LONG), "a repeat (its reply was lost)").toBe(true);
        expect((await mustGetOut(b, res.entry.key)).called).toBe(true);
        await sleep(LAPSE);
        const claim = await b.outbox.claimDue({ ...claimer("owner-b"), limit: 100 });
        expect(keys(claim.due).concat(keys(claim.ambiguous)), "the extended lease has not lapsed").toEqual([]);

        await b.outbox.markSent(res.entry.key, 1, "m-1");
        const sent = await mustGetOut(b, res.entry.key);
        expect(await b.outbox.markCalling(res.entry.key, 1, LONG), "a sent entry").toBe(false);
        expect(await b.outbox.get(res.entry.key)).toEqual(sent);

        const unknown = await unknownEntry(b, uid("chat"));
        expect(await b.outbox.markCalling(unknown.key, unknown.fence, LONG), "an unknown entry").toBe(false);
        expect(await b.outbox.get(unknown.key)).toEqual(unknown);
        expect(await b.outbox.markCalling(uid("out"), 1, LONG), "an unknown key").toBe(false);
      });

      it("reserve with calling: leased at once, it is written called (as markCalling would); queued, uncalled; a known key changes nothing", async (b) => {
        const chat = uid("chat");
        const res = await b.outbox.reserve(outbound(chat, { n: 1 }), { ...claimer("owner-a", SHORT, "inc-a"), calling: true });
        expect(res.status).toBe("leased");
        const e = res.entry;
        expect([e.state, e.attempts, e.fence, e.lease?.token, e.lease?.owner, e.called], "leased, token 1, its call announced")
          .toEqual(["sending", 1, 1, 1, "owner-a", true]);
        const expiresIn = (e.lease?.expiresAt ?? 0) - e.updatedAt;
        expect(expiresIn, "a fresh lease of leaseMs").toBeGreaterThanOrEqual(SHORT - 1);
        expect(await b.outbox.get(e.key), "as answered").toEqual(e);
        // Behind it in its chat: queued, and not announced (its call is not made now).
        const behind = await b.outbox.reserve(outbound(chat, { n: 2 }), { ...claimer("owner-a", LONG, "inc-a"), calling: true });
        expect([behind.status, behind.entry.state, behind.entry.called, behind.entry.lease]).toEqual(["queued", "queued", false, null]);
        // Without a lease `calling` means nothing: queued, uncalled.
        const plain = await b.outbox.reserve(outbound(uid("chat")), undefined);
        expect(plain.entry.called).toBe(false);
        // A repeat of the key (a lost reply) answers the entry as it is.
        const again = await b.outbox.reserve({ ...outbound(chat, { n: 1 }), key: e.key }, { ...claimer("owner-b"), calling: true });
        expect(again.status).toBe("exists");
        expect(again.entry).toEqual(e);
        // markCalling under its lease is a repeat: true, still called, the lease renewed.
        expect(await b.outbox.markCalling(e.key, 1, LONG)).toBe(true);
        const renewed = await mustGetOut(b, e.key);
        expect([renewed.called, renewed.fence]).toEqual([true, 1]);
        expect(renewed.lease!.expiresAt).toBeGreaterThan(e.lease!.expiresAt);
        await b.outbox.markSent(e.key, 1, "m-1");
        const sent = await mustGetOut(b, e.key);
        expect([sent.state, sent.messageId, sent.lease]).toEqual(["sent", "m-1", null]);
        // The chat goes on: the entry behind it is due, and leased uncalled.
        const next = await b.outbox.claimDue({ ...claimer("owner-a"), limit: 100 });
        expect(next.due.filter((d) => d.chatId === chat).map((d) => [d.key, d.called])).toEqual([[behind.entry.key, false]]);
      });

      it("reserve with calling, its lease lapsed before any outcome: ambiguous (unknown), exactly as after markCalling", async (b) => {
        const chat = uid("chat");
        const res = await b.outbox.reserve(outbound(chat, { n: 1 }), { ...claimer("owner-a", SHORT, "inc-a"), calling: true });
        expect(res.entry.called).toBe(true);
        const behind = await reserved(b, outbound(chat, { n: 2 }));
        await sleep(LAPSE);
        const claim = await b.outbox.claimDue({ ...claimer("owner-b", LONG, "inc-b"), limit: 100 });
        expect(keys(claim.ambiguous), "announced, its sender lost: ambiguous").toEqual([res.entry.key]);
        const unknown = await mustGetOut(b, res.entry.key);
        expect([unknown.state, unknown.lease, unknown.fence, unknown.attempts]).toEqual(["unknown", null, 1, 1]);
        // (The same scan, or the next one, takes the entry behind it.)
        const next = claim.due.length > 0 ? claim : await b.outbox.claimDue({ ...claimer("owner-b", LONG, "inc-b"), limit: 100 });
        expect(keys(next.due), "no longer blocking its chat").toEqual([behind.key]);
        // Its sender was alive after all (a stall): the late outcome settles it.
        await b.outbox.markSent(res.entry.key, 1, "late");
        expect((await mustGetOut(b, res.entry.key)).state).toBe("sent");
        // With resendAmbiguous, leased again and kept called (its call may still reach the channel).
        const other = await b.outbox.reserve(outbound(uid("chat")), { ...claimer("owner-a", SHORT, "inc-a"), calling: true });
        await sleep(LAPSE);
        const resent = await b.outbox.claimDue({ ...claimer("owner-b", LONG, "inc-b"), limit: 100, resendAmbiguous: true });
        expect(keys(resent.ambiguous)).toEqual([other.entry.key]);
        expect(keys(resent.due)).toEqual([other.entry.key]);
        expect([resent.due[0]!.called, resent.due[0]!.fence, resent.due[0]!.attempts]).toEqual([true, 2, 2]);
      });

      it("a lapsed send whose call was never announced is not ambiguous: leased again as due, attempts unchanged, ahead of its chat", async (b) => {
        const chat = uid("chat");
        const res = await b.outbox.reserve(outbound(chat, { n: 1 }), claimer("owner-a", SHORT, "inc-a"));
        const behind = await reserved(b, outbound(chat, { n: 2 }));
        await sleep(LAPSE);
        const claim = await b.outbox.claimDue({ ...claimer("owner-b", LONG, "inc-b"), limit: 100 });
        expect(keys(claim.ambiguous), "never called: not ambiguous").toEqual([]);
        expect(keys(claim.due), "leased again, still ahead of its chat").toEqual([res.entry.key]);
        for (const e of [claim.due[0]!, await mustGetOut(b, res.entry.key)]) {
          expect(e.state).toBe("sending");
          expect(e.called).toBe(false);
          expect(e.lease?.owner).toBe("owner-b");
          expect(e.lease?.incarnation).toBe("inc-b");
          expect(e.lease?.token).toBe(2);
          expect(e.fence).toBe(2);
          expect(e.attempts, "its lost lease started no attempt").toBe(1);
        }
        expect(await b.outbox.markCalling(res.entry.key, 1, LONG), "the lost holder cannot announce a call now").toBe(false);
        await expectStale(expect, () => b.outbox.markSent(res.entry.key, 1, "old"), "the lost holder's markSent");
        expect(await b.outbox.markCalling(res.entry.key, 2, LONG)).toBe(true);
        await b.outbox.markSent(res.entry.key, 2, "new");
        expect((await mustGetOut(b, res.entry.key)).messageId).toBe("new");
        const next = await b.outbox.claimDue({ ...claimer("owner-c"), limit: 100 });
        expect(keys(next.due)).toEqual([behind.key]);
        expect(next.due[0]!.called).toBe(false);
        expect(next.due[0]!.attempts).toBe(1);

        // With resendAmbiguous it is due only, not reported; a claimed (not reserved) one alike.
        const again = await b.outbox.reserve(outbound(uid("chat")), claimer("owner-a", SHORT));
        await sleep(LAPSE);
        const resend = await b.outbox.claimDue({ ...claimer("owner-d", SHORT), resendAmbiguous: true, limit: 100 });
        expect(keys(resend.ambiguous)).toEqual([]);
        expect(keys(resend.due)).toEqual([again.entry.key]);
        await sleep(LAPSE);
        const third = await b.outbox.claimDue({ ...claimer("owner-e"), limit: 100 });
        expect(keys(third.ambiguous), "its claim lapsed uncalled too").toEqual([]);
        expect(keys(third.due)).toEqual([again.entry.key]);
        expect(third.due[0]!.fence).toBe(3);
        expect(third.due[0]!.attempts).toBe(1);
      });

      it("resendAmbiguous keeps a lost call's mark: the re-leased send lost before its own call is ambiguous again", async (b) => {
        const lapsed = await reserved(b, outbound(uid("chat")), claimer("owner-a", SHORT));
        await sleep(LAPSE);
        const resend = await b.outbox.claimDue({ ...claimer("owner-b", SHORT), resendAmbiguous: true, limit: 100 });
        expect(keys(resend.ambiguous)).toEqual([lapsed.key]);
        expect(keys(resend.due)).toEqual([lapsed.key]);
        expect(resend.due[0]!.called, "the first call may still reach the channel").toBe(true);
        expect((await mustGetOut(b, lapsed.key)).called).toBe(true);
        // owner-b is lost before it calls: not a send never made, an ambiguous one again.
        await sleep(LAPSE);
        const again = await b.outbox.claimDue({ ...claimer("owner-c", LONG), resendAmbiguous: true, limit: 100 });
        expect(keys(again.ambiguous), "ambiguous again, reported").toEqual([lapsed.key]);
        expect(again.due[0]?.attempts, "each re-lease of a called send is an attempt").toBe(3);
        const hold = await reserved(b, outbound(uid("chat")), claimer("owner-a", SHORT));
        await sleep(LAPSE);
        const first = await b.outbox.claimDue({ ...claimer("owner-d", SHORT), resendAmbiguous: true, limit: 100 });
        expect(keys(first.due)).toEqual([hold.key]);
        expect(await b.outbox.markCalling(hold.key, first.due[0]!.fence, SHORT)).toBe(true);
        await b.outbox.markSent(hold.key, first.due[0]!.fence, "m");
        expect((await mustGetOut(b, hold.key)).state).toBe("sent");
      });

      it("concurrent claimers lease a lapsed uncalled send exactly once; limit is respected", async (b) => {
        const lapsed = await Promise.all(
          Array.from({ length: 3 }, () => b.outbox.reserve(outbound(uid("chat")), claimer(uid("owner"), SHORT))),
        );
        await sleep(LAPSE);
        const limited = await b.outbox.claimDue({ ...claimer(), limit: 1 });
        expect(limited.due.length, "limit counts re-leased uncalled sends").toBe(1);
        const results = await Promise.all(
          Array.from({ length: 8 }, () => b.outbox.claimDue({ ...claimer(), limit: 100 })),
        );
        expect(results.flatMap((r) => keys(r.ambiguous))).toEqual([]);
        expect(keys(limited.due).concat(results.flatMap((r) => keys(r.due))).sort()).toEqual(lapsed.map((r) => r.entry.key).sort());
      });

      it("reclaimOwn: the previous incarnation's uncalled send is leased again at once, not ambiguous", async (b) => {
        const old = claimer("owner-o", LONG, "inc-1");
        const current = claimer("owner-o", LONG, "inc-2");
        const previous = await b.outbox.reserve(outbound(uid("chat")), old);
        const mine = await b.outbox.reserve(outbound(uid("chat")), current);
        const claim = await b.outbox.claimDue({ ...current, reclaimOwn: true, limit: 100 });
        expect(keys(claim.ambiguous)).toEqual([]);
        expect(keys(claim.due)).toEqual([previous.entry.key]);
        expect(claim.due[0]!.lease?.incarnation).toBe("inc-2");
        expect(claim.due[0]!.attempts).toBe(1);
        expect(await b.outbox.get(mine.entry.key), "never its own in-flight sends").toEqual(mine.entry);
      });

      it("concurrent claimers report an ambiguous send exactly once", async (b) => {
        const lapsed = await reserved(b, outbound(uid("chat")), claimer(uid("owner"), SHORT));
        await sleep(LAPSE);
        const results = await Promise.all(
          Array.from({ length: 8 }, () => b.outbox.claimDue({ ...claimer(), limit: 100 })),
        );
        expect(results.flatMap((r) => keys(r.ambiguous))).toEqual([lapsed.key]);
        expect(results.flatMap((r) => keys(r.due))).toEqual([]);
      });

      it("resendAmbiguous re-leases a lapsed send with a new token", async (b) => {
        const chat = uid("chat");
        const lapsed = await reserved(b, outbound(chat, { n: 1 }), claimer("owner-a", SHORT));
        const behind = await reserved(b, outbound(chat, { n: 2 }));
        await sleep(LAPSE);
        const first = await b.outbox.claimDue({ ...claimer("owner-b", LONG, "inc-b"), resendAmbiguous: true, limit: 100 });
        expect(keys(first.ambiguous)).toEqual([lapsed.key]);
        expect(keys(first.due), "re-leased, and still ahead of its chat").toEqual([lapsed.key]);
        for (const e of [first.due[0]!, first.ambiguous[0]!, await mustGetOut(b, lapsed.key)]) {
          expect(e.state).toBe("sending");
          expect(e.lease?.owner).toBe("owner-b");
          expect(e.lease?.incarnation).toBe("inc-b");
          expect(e.lease?.token).toBe(2);
          expect(e.fence).toBe(2);
          expect(e.attempts).toBe(2);
        }
        const second = await b.outbox.claimDue({ ...claimer("owner-c"), resendAmbiguous: true, limit: 100 });
        expect(keys(second.ambiguous).concat(keys(second.due)), "the second claimer sees nothing").toEqual([]);
        await expectStale(expect, () => b.outbox.markSent(lapsed.key, 1, "old"), "the lost sender's markSent");
        await b.outbox.markSent(lapsed.key, 2, "new");
        expect((await mustGetOut(b, lapsed.key)).messageId).toBe("new");
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due)).toEqual([behind.key]);
      });

      it("reclaimOwn: the previous incarnation's send is unknown at once; the current one's and other owners' are untouched", async (b) => {
        const old = claimer("owner-o", LONG, "inc-1");
        const current = claimer("owner-o", LONG, "inc-2");
        const previous = await reserved(b, outbound(uid("chat")), old);
        const mine = await reserved(b, outbound(uid("chat")), current);
        const others = await reserved(b, outbound(uid("chat")), claimer("owner-p", LONG));

        const without = await b.outbox.claimDue({ ...current, limit: 100 });
        expect(keys(without.ambiguous), "nothing without reclaimOwn").toEqual([]);
        const otherOwner = await b.outbox.claimDue({ ...claimer("owner-q"), reclaimOwn: true, limit: 100 });
        expect(keys(otherOwner.ambiguous), "another owner cannot").toEqual([]);

        const claim = await b.outbox.claimDue({ ...current, reclaimOwn: true, limit: 100 });
        expect(keys(claim.ambiguous)).toEqual([previous.key]);
        expect(claim.due).toEqual([]);
        expect((await mustGetOut(b, previous.key)).state).toBe("unknown");
        expect(await b.outbox.get(mine.key), "never its own in-flight sends").toEqual(mine);
        expect(await b.outbox.get(others.key), "another owner's send").toEqual(others);
      });

      it("retry: dead, failed and unknown become queued and due now with attempts reset", async (b) => {
        const dead = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(dead.key, 1, { error: "dead", dead: true });
        const failed = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(failed.key, 1, { error: "later", retryInMs: LONG });
        const unknown = await unknownEntry(b, uid("chat"));
        const sent = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markSent(sent.key, 1, "m");
        const sending = await reserved(b, outbound(uid("chat")), claimer());

        for (const key of [dead.key, failed.key, unknown.key]) {
          expect(await b.outbox.retry(key), `retry ${key}`).toBe(true);
          const e = await mustGetOut(b, key);
          expect(e.state).toBe("queued");
          expect(e.attempts).toBe(0);
          expect(e.lease).toBe(null);
        }
        expect(await b.outbox.retry(sent.key), "sent").toBe(false);
        expect(await b.outbox.retry(sending.key), "sending").toBe(false);
        expect(await b.outbox.get(sending.key)).toEqual(sending);
        expect(await b.outbox.retry(uid("out")), "unknown key").toBe(false);

        const claim = await b.outbox.claimDue({ ...claimer(), limit: 100 });
        expect(keys(claim.due).sort(), "due now").toEqual([dead.key, failed.key, unknown.key].sort());
        for (const e of claim.due) {
          expect(e.attempts).toBe(1);
          expect(tokenOf(e), "tokens keep increasing across a retry").toBe(2);
        }
      });

      it("discard forgets an entry that is not sending, and unblocks its chat", async (b) => {
        const chat = uid("chat");
        const failed = await reserved(b, outbound(chat), claimer());
        await b.outbox.markFailed(failed.key, 1, { error: "later", retryInMs: LONG });
        const behind = await reserved(b, outbound(chat));
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due)).toEqual([]);
        expect(await b.outbox.discard(failed.key)).toBe(true);
        expect(await b.outbox.get(failed.key)).toBe(null);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "the chat is unblocked").toEqual([behind.key]);

        const sending = await reserved(b, outbound(uid("chat")), claimer());
        expect(await b.outbox.discard(sending.key), "a sending entry").toBe(false);
        expect(await b.outbox.get(sending.key)).toEqual(sending);
        const queued = await reserved(b, outbound(uid("chat")));
        expect(await b.outbox.discard(queued.key)).toBe(true);
        const dead = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markFailed(dead.key, 1, { error: "dead", dead: true });
        expect(await b.outbox.discard(dead.key)).toBe(true);
        const unknown = await unknownEntry(b, uid("chat"));
        expect(await b.outbox.discard(unknown.key)).toBe(true);
        for (const key of [queued.key, dead.key, unknown.key]) expect(await b.outbox.get(key)).toBe(null);
        expect(await b.outbox.discard(uid("out")), "unknown key").toBe(false);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due), "discarded entries are not due").toEqual([]);
      });

      it("purge removes sent entries older than olderThanMs only", async (b) => {
        const chat = uid("chat");
        const olderThanMs = ms(300); // wide margins, as for the inbox
        const oldSent = await reserved(b, outbound(chat), claimer());
        await b.outbox.markSent(oldSent.key, 1, "m-old");
        const unknown = await unknownEntry(b, uid("chat"));
        const dead = await reserved(b, outbound(chat), claimer());
        await b.outbox.markFailed(dead.key, 1, { error: "dead", dead: true });
        const failed = await reserved(b, outbound(chat), claimer());
        await b.outbox.markFailed(failed.key, 1, { error: "later", retryInMs: LONG });
        const queued = await reserved(b, outbound(chat));
        const sending = await reserved(b, outbound(uid("chat")), claimer());
        await sleep(2 * olderThanMs);
        const recent = await reserved(b, outbound(uid("chat")), claimer());
        await b.outbox.markSent(recent.key, 1, "m-new");

        expect(await b.outbox.purge(olderThanMs), "purge returns how many it deleted").toBe(1);
        expect(await b.outbox.get(oldSent.key), "old sent is gone").toBe(null);
        for (const key of [dead.key, failed.key, queued.key, unknown.key, sending.key, recent.key]) {
          expect(await b.outbox.get(key) !== null, `${key} is kept`).toBe(true);
        }
        expect(await b.outbox.purge(olderThanMs), "nothing left to purge").toBe(0);
      });

      it("list filters by state, several states, chatId and limit, in seq order", async (b) => {
        const chat = uid("chat");
        const other = uid("chat");
        const e0 = await reserved(b, outbound(chat), claimer());
        await b.outbox.markSent(e0.key, 1, "m0");
        const e1 = await reserved(b, outbound(chat), claimer());
        await b.outbox.markFailed(e1.key, 1, { error: "dead", dead: true });
        const e2 = await reserved(b, outbound(chat), claimer());
        const e3 = await reserved(b, outbound(chat));
        const e4 = await reserved(b, outbound(other));
        expect(e2.state).toBe("sending");
        expect(e3.state).toBe("queued");

        const listed = await b.outbox.list({ chatId: chat });
        expect(keys(listed)).toEqual([e0.key, e1.key, e2.key, e3.key]);
        for (let i = 1; i < listed.length; i++) expect(listed[i]!.seq).toBeGreaterThan(listed[i - 1]!.seq);
        expect(keys(await b.outbox.list({ chatId: other }))).toEqual([e4.key]);
        expect(keys(await b.outbox.list({ chatId: chat, state: "sent" }))).toEqual([e0.key]);
        expect((await b.outbox.list({ chatId: chat, state: "sent" }))[0]?.messageId).toBe("m0");
        expect(keys(await b.outbox.list({ chatId: chat, state: ["queued", "dead"] }))).toEqual([e1.key, e3.key]);
        expect(keys(await b.outbox.list({ chatId: chat, state: ["unknown"] }))).toEqual([]);
        expect(keys(await b.outbox.list({ chatId: chat, limit: 2 }))).toEqual([e0.key, e1.key]);
        expect(keys(await b.outbox.list({ chatId: chat, limit: 0 }))).toEqual([]);

        const queued = await b.outbox.list({ state: "queued", limit: 1_000 });
        expect(queued.every((e) => e.state === "queued"), "state filter").toBe(true);
        const queuedKeys = keys(queued);
        expect(queuedKeys.includes(e3.key) && queuedKeys.includes(e4.key)).toBe(true);
        const all = keys(await b.outbox.list({ limit: 1_000 }));
        for (const key of [e0.key, e1.key, e2.key, e3.key, e4.key]) expect(all.includes(key), `list() has ${key}`).toBe(true);
        expect(all.indexOf(e3.key), "reservation order across chats").toBeLessThan(all.indexOf(e4.key));
        expect((await b.outbox.list({ chatId: chat, state: "sending" }))[0], "list returns whole entries").toEqual(e2);
      });

      it("list of one state with limit 1 is its first reserved entry, across chats", async (b) => {
        // What the age gauges of the Prometheus exposition read.
        const first = await reserved(b, outbound(uid("chat")));
        const second = await reserved(b, outbound(uid("chat")));
        await reserved(b, outbound(uid("chat")));
        expect(first.createdAt).toBeLessThanOrEqual(second.createdAt);
        expect(keys(await b.outbox.list({ state: "queued", limit: 1 }))).toEqual([first.key]);
      });

      it("returned entries are copies", async (b) => {
        const content = { nested: { value: 1 }, list: [1] };
        const res = await b.outbox.reserve(outbound(uid("chat"), content));
        const original = snapshot(res.entry);
        const mutate = (e: OutboxEntry): void => {
          e.state = "dead";
          e.seq = -1;
          const c = e.content as { nested: { value: number }; list: number[] };
          c.nested.value = 2;
          c.list.push(2);
        };
        mutate(res.entry);
        mutate(await mustGetOut(b, original.key));
        for (const e of await b.outbox.list({ chatId: original.chatId })) mutate(e);
        mutate((await b.outbox.reserve(outbound(original.chatId, { nested: { value: 1 }, list: [1] }))).entry);
        const dup = await b.outbox.reserve({ ...outbound(original.chatId, { nested: { value: 1 }, list: [] }), key: original.key });
        mutate(dup.entry);
        expect(await b.outbox.get(original.key)).toEqual(original);
        content.nested.value = 3;
        expect(await b.outbox.get(original.key), "the caller's input is copied too").toEqual(original);

        const claim = await b.outbox.claimDue({ ...claimer(), limit: 1 });
        const claimed = claim.due[0]!;
        const claimedCopy = snapshot(claimed);
        mutate(claimed);
        if (claimed.lease) claimed.lease.token = 99;
        expect(await b.outbox.get(original.key)).toEqual(claimedCopy);
      });

      it("content round-trips: nested JSON, unicode, empty strings, ~100 KB", async (b) => {
        for (const content of [tricky(), large(), "", "✓", 0, false, null, [], {}] as JsonValue[]) {
          const input = outbound(uid("chat"), content);
          const res = await b.outbox.reserve(input);
          expect(res.entry.content).toEqual(content);
          const got = await mustGetOut(b, input.key);
          expect(got.content, `content ${JSON.stringify(content).slice(0, 40)}`).toEqual(content);
          expect(got.contentHash).toBe(input.contentHash);
        }
        const claim = await b.outbox.claimDue({ ...claimer(), limit: 100 });
        expect(claim.due.length).toBe(9);
        expect(claim.due.some((e) => JSON.stringify(e.content) === JSON.stringify(large()))).toBe(true);
      });

      it("concurrent claimDue: every due entry is leased exactly once", async (b) => {
        const want = new Set<string>();
        for (let i = 0; i < 10; i++) want.add((await reserved(b, outbound(uid("chat")))).key);
        const results = await Promise.all(
          Array.from({ length: 20 }, (_, i) => b.outbox.claimDue({ ...claimer(`owner-${i}`), limit: 3 })),
        );
        const got = results.flatMap((r) => keys(r.due));
        expect(got.length, "no entry leased twice").toBe(10);
        expect(new Set(got).size).toBe(10);
        expect([...got].sort()).toEqual([...want].sort());
        for (let i = 0; i < results.length; i++) {
          for (const e of results[i]!.due) {
            const now = await mustGetOut(b, e.key);
            expect(now.lease?.owner, "the journal agrees with the winner").toBe(`owner-${i}`);
            expect(now.fence).toBe(FIRST_CLAIM);
          }
        }
      });

      it("concurrent claimDue on one chat leases only its first entry", async (b) => {
        const chat = uid("chat");
        const first = await reserved(b, outbound(chat));
        for (let i = 0; i < 4; i++) await reserved(b, outbound(chat));
        const results = await Promise.all(
          Array.from({ length: 10 }, () => b.outbox.claimDue({ ...claimer(), limit: 5 })),
        );
        expect(results.flatMap((r) => keys(r.due))).toEqual([first.key]);
      });
    });

    describe("bad input", () => {
      async function typeErrorOf(run: () => Promise<unknown>): Promise<string> {
        try {
          await run();
        } catch (error) {
          expect(error instanceof TypeError, `expected a TypeError, got ${String(error)}`).toBe(true);
          return (error as Error).message;
        }
        throw new Error("expected a TypeError, but the call succeeded");
      }

      it("admit refuses a record JSON cannot hold, naming the field, and writes nothing", async (b) => {
        const chat = uid("chat");
        const cases: [Record<string, unknown>, string][] = [
          [{ receivedAt: Number.NaN }, "receivedAt"],
          [{ kind: "email" }, "kind"],
          [{ chatId: 42 }, "chatId"],
          [{ payload: { rows: [1, { n: 10n }] } }, "payload.rows[1].n"],
          [{ payload: { at: new Date(0) } }, "payload.at"],
          [{ payload: [1, undefined] }, "payload[1]"],
          [{ payload: { x: Number.POSITIVE_INFINITY } }, "payload.x"],
        ];
        for (const [bad, field] of cases) {
          const record = { ...inbound(chat), ...bad } as unknown as NewInboundRecord;
          const message = await typeErrorOf(() => b.inbox.admit(record, claimer()));
          expect(message.includes(field), `the error names "${field}": ${message}`).toBe(true);
          expect(await b.inbox.get(record.id), `nothing written for a bad "${field}"`).toBe(null);
        }
        expect(await b.inbox.list({ chatId: chat })).toEqual([]);
        const cyclic: Record<string, unknown> = { a: 1 };
        cyclic.self = cyclic;
        const message = await typeErrorOf(() => b.inbox.admit({ ...inbound(chat), payload: cyclic as JsonValue }));
        expect(message.includes("payload.self"), message).toBe(true);
      });

      it("reserve refuses an entry JSON cannot hold, naming the field; a missing inboundId is null", async (b) => {
        const chat = uid("chat");
        const cases: [Record<string, unknown>, string][] = [
          [{ content: { n: 1n } }, "content.n"],
          [{ content: ["a", undefined] }, "content[1]"],
          [{ key: "" }, "key"],
          [{ inboundId: 7 }, "inboundId"],
        ];
        for (const [bad, field] of cases) {
          const entry = { ...outbound(chat), ...bad } as unknown as NewOutboxEntry;
          const message = await typeErrorOf(() => b.outbox.reserve(entry, claimer()));
          expect(message.includes(field), `the error names "${field}": ${message}`).toBe(true);
          if (entry.key) expect(await b.outbox.get(entry.key), `nothing written for a bad "${field}"`).toBe(null);
        }
        expect(await b.outbox.list({ chatId: chat })).toEqual([]);
        const { inboundId: _, ...withoutInbound } = outbound(chat);
        const e = await reserved(b, withoutInbound as NewOutboxEntry);
        expect(e.inboundId).toBe(null);
        expect((await mustGetOut(b, e.key)).inboundId).toBe(null);
        // Keys whose value is undefined are left out, as JSON does.
        const kept = await reserved(b, outbound(uid("chat"), { a: 1, gone: undefined } as unknown as JsonValue));
        expect((await mustGetOut(b, kept.key)).content).toEqual({ a: 1 });
      });

      it("journal calls with a bad argument reject with a TypeError naming it, and change nothing", async (b) => {
        const chat = uid("chat");
        const held = await admitted(b, inbound(chat), claimer());
        const sending = await reserved(b, outbound(chat), claimer());
        const pending = await admitted(b, inbound(chat));
        const inboxBefore = await b.inbox.list({ chatId: chat });
        const outboxBefore = await b.outbox.list({ chatId: chat });
        const bad = (o: Record<string, unknown>) => o as unknown as ClaimOptions & { limit: number };
        const cases: [() => Promise<unknown>, string][] = [
          [() => b.inbox.claim(pending.id, bad({ incarnation: "i", leaseMs: 1000 })), "owner"],
          [() => b.inbox.claimDue(bad({ ...claimer(), leaseMs: "60s", limit: 10 })), "leaseMs"],
          [() => b.inbox.claimDue(bad({ ...claimer(), limit: undefined })), "limit"],
          [() => b.inbox.admit(inbound(chat), bad({ owner: "o", leaseMs: 1000 })), "incarnation"],
          [() => b.inbox.complete(held.id, undefined as unknown as number), "token"],
          [() => b.inbox.fail(held.id, tokenOf(held), { error: 42 } as unknown as FailOutcome), "error"],
          [() => b.inbox.fail(held.id, tokenOf(held), { error: "x", retryInMs: Number.NaN }), "retryInMs"],
          [() => b.inbox.fail(held.id, tokenOf(held), { error: "x", retryInMs: 5, throttled: true }), "throttled"],
          [() => b.inbox.heartbeat(held.id, tokenOf(held), "1s" as unknown as number), "leaseMs"],
          [() => b.inbox.list({ chatId: 5 as unknown as string }), "chatId"],
          [() => b.outbox.reserve(outbound(chat), bad({ owner: "o", incarnation: "i" })), "leaseMs"],
          [() => b.outbox.claimDue(bad({ owner: 1, incarnation: "i", leaseMs: 1000, limit: 5 })), "owner"],
          [() => b.outbox.markSent(sending.key, tokenOf(sending), undefined as unknown as string), "messageId"],
          [() => b.outbox.markFailed(sending.key, tokenOf(sending), { error: "x", retryInMs: "soon" } as unknown as FailOutcome), "retryInMs"],
          [() => b.outbox.list({ state: [null] as unknown as OutboxEntry["state"][] }), "state"],
        ];
        for (const [call, field] of cases) {
          const message = await typeErrorOf(call);
          expect(message.includes(field), `the error names "${field}": ${message}`).toBe(true);
        }
        expect(await b.inbox.list({ chatId: chat }), "the inbox is unchanged").toEqual(inboxBefore);
        expect(await b.outbox.list({ chatId: chat }), "the outbox is unchanged").toEqual(outboxBefore);
      });

      it("an ambiguous outcome is refused with a TypeError naming the field: with dead or retryInMs, not a boolean, or by inbox.fail; nothing changes", async (b) => {
        const chat = uid("chat");
        const held = await admitted(b, inbound(chat), claimer());
        const sending = await reserved(b, outbound(chat), claimer());
        const inboxBefore = await b.inbox.list({ chatId: chat });
        const outboxBefore = await b.outbox.list({ chatId: chat });
        const cases: [() => Promise<unknown>, string][] = [
          [() => b.outbox.markFailed(sending.key, tokenOf(sending), { error: "x", ambiguous: true, dead: true } as unknown as FailOutcome), "ambiguous"],
          [() => b.outbox.markFailed(sending.key, tokenOf(sending), { error: "x", ambiguous: true, dead: true } as unknown as FailOutcome), "dead"],
          [() => b.outbox.markFailed(sending.key, tokenOf(sending), { error: "x", ambiguous: true, retryInMs: 5 } as unknown as FailOutcome), "retryInMs"],
          [() => b.outbox.markFailed(sending.key, tokenOf(sending), { error: "x", ambiguous: "yes" } as unknown as FailOutcome), "ambiguous"],
          [() => b.outbox.markFailed(sending.key, tokenOf(sending), { error: 7, ambiguous: true } as unknown as FailOutcome), "error"],
          [() => b.outbox.markFailed(sending.key, tokenOf(sending), { error: "x", retryInMs: 5, throttled: "yes" } as unknown as FailOutcome), "throttled"],
          [() => b.outbox.markFailed(sending.key, tokenOf(sending), { error: "x", dead: true, throttled: true } as unknown as FailOutcome), "throttled"],
          [() => b.outbox.markFailed(sending.key, tokenOf(sending), { error: "x", ambiguous: true, throttled: true } as unknown as FailOutcome), "throttled"],
          [() => b.inbox.fail(held.id, tokenOf(held), { error: "x", ambiguous: true }), "ambiguous"],
        ];
        for (const [call, field] of cases) {
          const message = await typeErrorOf(call);
          expect(message.includes(field), `the error names "${field}": ${message}`).toBe(true);
        }
        expect(await b.inbox.list({ chatId: chat }), "the inbox is unchanged").toEqual(inboxBefore);
        expect(await b.outbox.list({ chatId: chat }), "the outbox is unchanged").toEqual(outboxBefore);
        // Both still settle with a valid outcome.
        await b.inbox.fail(held.id, tokenOf(held), { error: "x", dead: true });
        await b.outbox.markFailed(sending.key, tokenOf(sending), { error: "x", ambiguous: true, dead: false });
        expect((await mustGetOut(b, sending.key)).state).toBe("unknown");
      });
    });

    describe("hostile input", () => {
      async function refusal(run: () => Promise<unknown>): Promise<unknown> {
        try {
          await run();
        } catch (error) {
          return error;
        }
        throw new Error("expected the call to be refused, but it succeeded");
      }

      it("ids, chat ids, keys and lease owners with a lone surrogate are refused with a TypeError naming the field; nothing is written", async (b) => {
        const chat = uid("chat");
        const base = uid("lone");
        // What a lone surrogate becomes on a backend that stores it as U+FFFD: it must never be reached.
        const held = await admitted(b, { ...inbound(chat), id: `${base}\uFFFD` }, claimer());
        const done = await admitted(b, { ...inbound(uid("chat")), id: `${base}\uFFFDdone` }, claimer());
        await b.inbox.complete(done.id, tokenOf(done));
        const sending = await reserved(b, { ...outbound(chat), key: `${base}\uFFFD` }, claimer());
        const dead = await reserved(b, { ...outbound(uid("chat")), key: `${base}\uFFFDdead` }, claimer());
        await b.outbox.markFailed(dead.key, tokenOf(dead), { error: "403", dead: true });
        const inboxBefore = await b.inbox.list();
        const outboxBefore = await b.outbox.list();
        // "k\uD83D" and "k\uDE00" (text cut mid-emoji) differ, and differ from "k\uFFFD": all are refused.
        for (const [lone, at] of [[`${base}\uD83D`, base.length], [`${base}\uDE00`, base.length], [`\uDE00${base}\uD83D`, 0]] as const) {
          const doneLone = `${base}\uD83Ddone`;
          const deadLone = `${base}\uD83Ddead`;
          const records = {
            id: { ...inbound(chat), id: lone },
            chatId: inbound(lone),
          };
          const entries = {
            key: { ...outbound(chat), key: lone },
            chatId: outbound(lone),
            inboundId: outbound(chat, { text: "x" }, lone),
          };
          const cases: [() => Promise<unknown>, string, string][] = [
            [() => b.inbox.admit(records.id), "id", lone],
            [() => b.inbox.admit(records.id, claimer()), "id", lone],
            [() => b.inbox.admit(records.chatId, claimer()), "chatId", lone],
            [() => b.inbox.admit(inbound(uid("chat")), claimer(lone)), "owner", lone],
            [() => b.inbox.claim(lone, claimer()), "id", lone],
            [() => b.inbox.claim(held.id, claimer(uid("owner"), LONG, lone)), "incarnation", lone],
            [() => b.inbox.claimDue({ ...claimer(lone), reclaimOwn: true, limit: 10 }), "owner", lone],
            [() => b.inbox.get(lone), "id", lone],
            [() => b.inbox.heartbeat(lone, tokenOf(held), LONG), "id", lone],
            [() => b.inbox.complete(lone, tokenOf(held)), "id", lone],
            [() => b.inbox.fail(lone, tokenOf(held), { error: "x", dead: true }), "id", lone],
            [() => b.inbox.replay(doneLone), "id", doneLone],
            [() => b.inbox.list({ chatId: lone }), "chatId", lone],
            [() => b.outbox.reserve(entries.key), "key", lone],
            [() => b.outbox.reserve(entries.key, claimer()), "key", lone],
            [() => b.outbox.reserve(entries.chatId, claimer()), "chatId", lone],
            [() => b.outbox.reserve(entries.inboundId), "inboundId", lone],
            [() => b.outbox.reserve(outbound(uid("chat")), claimer(uid("owner"), LONG, lone)), "incarnation", lone],
            [() => b.outbox.claimDue({ ...claimer(uid("owner"), LONG, lone), limit: 10 }), "incarnation", lone],
            [() => b.outbox.get(lone), "key", lone],
            [() => b.outbox.heartbeat(lone, tokenOf(sending), LONG), "key", lone],
            [() => b.outbox.retry(deadLone), "key", deadLone],
            [() => b.outbox.discard(deadLone), "key", deadLone],
            [() => b.outbox.list({ chatId: lone }), "chatId", lone],
          ];
          for (const [call, field, value] of cases) {
            const error = await refusal(call);
            expect(error instanceof TypeError, `${JSON.stringify(value)} as "${field}": expected a TypeError, got ${String(error)}`).toBe(true);
            const message = (error as Error).message;
            expect(message.includes(`"${field}"`), `the error names "${field}": ${message}`).toBe(true);
            expect(message.includes("well-formed Unicode"), `the error says why: ${message}`).toBe(true);
            const quoted = JSON.stringify(value);
            expect(message.includes(quoted), `the error quotes the value escaped (${quoted}): ${message}`).toBe(true);
          }
          const first = (await refusal(() => b.outbox.get(lone))) as Error;
          expect(first.message.includes(`lone surrogate at index ${at}`), first.message).toBe(true);
          // An outcome for a key nobody could reserve: refused, or stale where keys are kept exactly; never the neighbour's.
          for (const call of [
            () => b.outbox.markSent(lone, tokenOf(sending), "m-lone"),
            () => b.outbox.markFailed(lone, tokenOf(sending), { error: "x", dead: true }),
          ]) {
            const error = await refusal(call);
            expect(error instanceof TypeError || error instanceof StaleLeaseError, `an outcome for ${JSON.stringify(lone)}: ${String(error)}`).toBe(true);
          }
          for (const [field, record] of Object.entries(records)) {
            if (field !== "id") expect(await b.inbox.get(record.id), `nothing admitted for a lone surrogate in "${field}"`).toBe(null);
          }
          for (const [field, entry] of Object.entries(entries)) {
            if (field !== "key") expect(await b.outbox.get(entry.key), `nothing reserved for a lone surrogate in "${field}"`).toBe(null);
          }
        }
        expect(await b.inbox.list(), "the inbox is unchanged").toEqual(inboxBefore);
        expect(await b.outbox.list(), "the outbox is unchanged").toEqual(outboxBefore);
        expect(await mustGetIn(b, held.id)).toEqual(held);
        expect(await mustGetOut(b, sending.key)).toEqual(sending);
      });

      it("payloads with own __proto__, constructor and prototype keys round-trip exactly (admit, get, claim, claimDue, list)", async (b) => {
        const chat = uid("chat");
        const payloads = [hostile(), [hostile(), { nested: hostile() }], JSON.parse('{"__proto__": null}') as JsonValue];
        const ids: string[] = [];
        const c = claimer(); // one holder: its own leases do not hold back the chat's later records
        for (let i = 0; i < payloads.length; i++) {
          const payload = payloads[i]!;
          const r = await admitted(b, inbound(chat, 2_000 + i, payload), i === 0 ? c : undefined);
          ids.push(r.id);
          expectExactJson(expect, r.payload, payload, `admit's record ${i}`);
          expectExactJson(expect, (await mustGetIn(b, r.id)).payload, payload, `get ${i}`);
        }
        expectExactJson(expect, (await mustClaim(b, ids[1]!, c)).payload, payloads[1]!, "claim");
        const listed = await b.inbox.list({ chatId: chat });
        expect(listed.map((r) => r.id)).toEqual(ids);
        listed.forEach((r, i) => expectExactJson(expect, r.payload, payloads[i]!, `list ${i}`));
        const due = (await b.inbox.claimDue({ ...c, limit: 100 })).filter((r) => r.chatId === chat);
        expect(due.map((r) => r.id)).toEqual([ids[2]]);
        expectExactJson(expect, due[0]!.payload, payloads[2]!, "claimDue");
        expect(({} as Record<string, unknown>).polluted, "Object.prototype is untouched").toBe(undefined);
      });

      it("content with own __proto__, constructor and prototype keys round-trips exactly (reserve, get, claimDue, list)", async (b) => {
        const chat = uid("chat");
        const contents = [hostile(), [hostile(), { nested: hostile() }], JSON.parse('{"__proto__": null}') as JsonValue];
        const keyList: string[] = [];
        for (let i = 0; i < contents.length; i++) {
          const content = contents[i]!;
          const res = await b.outbox.reserve(outbound(chat, content));
          keyList.push(res.entry.key);
          expectExactJson(expect, res.entry.content, content, `reserve's entry ${i}`);
          expectExactJson(expect, (await mustGetOut(b, res.entry.key)).content, content, `get ${i}`);
          const again = await b.outbox.reserve({ ...outbound(chat, content), key: res.entry.key });
          expect(again.status).toBe("exists");
          expectExactJson(expect, again.entry.content, content, `the existing entry ${i}`);
        }
        const listed = await b.outbox.list({ chatId: chat });
        expect(keys(listed)).toEqual(keyList);
        listed.forEach((e, i) => expectExactJson(expect, e.content, contents[i]!, `list ${i}`));
        const claim = await b.outbox.claimDue({ ...claimer(), limit: 100 });
        const due = claim.due.filter((e) => e.chatId === chat);
        expect(keys(due)).toEqual([keyList[0]]);
        expectExactJson(expect, due[0]!.content, contents[0]!, "claimDue");
        const leased = await reserved(b, outbound(uid("chat"), hostile()), claimer());
        expectExactJson(expect, leased.content, hostile(), "a leased reserve");
        expectExactJson(expect, (await mustGetOut(b, leased.key)).content, hostile(), "get of a leased reserve");
        expect(({} as Record<string, unknown>).polluted, "Object.prototype is untouched").toBe(undefined);
      });
    });

    describe("writes issued together", () => {
      // Backends may group the writes of one turn of the event loop into one transaction (group
      // commit): each must still settle on its own, as if it had been issued alone.
      it("each settles on its own: a stale or duplicate one among them changes nothing else", async (b) => {
        const chats = Array.from({ length: 6 }, () => uid("chat"));
        const holders = chats.map(() => claimer());
        const held = await Promise.all(chats.map((chat, i) => admitted(b, inbound(chat), holders[i])));
        const sending = await Promise.all(chats.map((chat) => reserved(b, outbound(chat), claimer())));
        const fresh = chats.map((chat) => inbound(chat));
        const outcomes = await Promise.allSettled([
          ...fresh.map((rec, i) => b.inbox.admit(rec, holders[i])), // behind the holder's own record: leased
          b.inbox.admit({ ...inbound(chats[0]!), id: held[0]!.id }, claimer()),
          b.inbox.complete(held[0]!.id, tokenOf(held[0]!)),
          b.inbox.complete(held[1]!.id, tokenOf(held[1]!) + 1),
          b.inbox.fail(held[2]!.id, tokenOf(held[2]!), { error: "boom", dead: true }),
          b.outbox.markSent(sending[0]!.key, tokenOf(sending[0]!), "m-0"),
          b.outbox.markSent(sending[1]!.key, tokenOf(sending[1]!) + 1, "m-1"),
          b.outbox.markFailed(sending[2]!.key, tokenOf(sending[2]!), { error: "later", retryInMs: 60_000 }),
          b.outbox.reserve(outbound(chats[3]!), claimer()),
          b.outbox.reserve({ ...outbound(chats[4]!), key: sending[4]!.key }, claimer()),
        ]);
        const value = (i: number) => {
          const o = outcomes[i]!;
          if (o.status === "rejected") throw new Error(`write ${i} rejected: ${String(o.reason)}`);
          return o.value;
        };
        const reason = (i: number) => {
          const o = outcomes[i]!;
          if (o.status === "fulfilled") throw new Error(`write ${i} was expected to reject`);
          return o.reason;
        };
        fresh.forEach((rec, i) => expect((value(i) as InboundRecord | null)?.id, "a new admit journals").toBe(rec.id));
        const n = fresh.length;
        expect(value(n), "a duplicate admit returns null").toBe(null);
        expect(value(n + 1)).toBe(undefined);
        await expectStale(expect, () => Promise.reject(reason(n + 2)), "a stale complete among others");
        expect(value(n + 3)).toBe(undefined);
        expect(value(n + 4)).toBe(undefined);
        await expectStale(expect, () => Promise.reject(reason(n + 5)), "a stale markSent among others");
        expect(value(n + 6)).toBe(undefined);
        expect((value(n + 7) as ReserveResult).status, "sending[3] is unsettled: the new entry queues").toBe("queued");
        expect((value(n + 8) as ReserveResult).status, "a known key").toBe("exists");
        for (const rec of fresh) expect((await mustGetIn(b, rec.id)).state).toBe("processing");
        expect((await mustGetIn(b, held[0]!.id)).state).toBe("done");
        expect((await mustGetIn(b, held[1]!.id)).state, "the stale complete changed nothing").toBe("processing");
        expect((await mustGetIn(b, held[2]!.id)).state).toBe("dead");
        expect((await mustGetOut(b, sending[0]!.key)).messageId).toBe("m-0");
        expect((await mustGetOut(b, sending[1]!.key)).state, "the stale markSent changed nothing").toBe("sending");
        expect((await mustGetOut(b, sending[2]!.key)).state).toBe("failed");
        expect((await b.outbox.list({ chatId: chats[3]! })).map((e) => e.state)).toEqual(["sending", "queued"]);
        expect((await b.outbox.list({ chatId: chats[4]! })).length, "the known key added nothing").toBe(1);
      });

      it("many chats at once: reserves, calls and sends of different chats issued together keep each chat's order", async (b) => {
        const chats = Array.from({ length: 5 }, () => uid("chat"));
        const owner = claimer(uid("owner"), LONG);
        // Three reserves per chat, every chat's in one turn: each chat's first is leased, the rest queue behind it.
        const reserves = await Promise.all(chats.flatMap((chat) => [0, 1, 2].map(() => b.outbox.reserve(outbound(chat), owner))));
        const bySeq = new Map(chats.map((chat) => [
          chat,
          reserves.map((r) => r.entry).filter((e) => e.chatId === chat).sort((x, y) => x.seq - y.seq),
        ]));
        let heads = reserves.filter((r) => r.status === "leased").map((r) => r.entry);
        expect(heads.map((e) => e.chatId).sort(), "one leased head per chat").toEqual([...chats].sort());
        const sentOrder = new Map<string, string[]>(chats.map((chat) => [chat, []]));
        for (let round = 0; round < 3; round++) {
          for (const e of heads) expect(e.key, `round ${round}: the head of its chat is its next entry by seq`).toBe(bySeq.get(e.chatId)![round]!.key);
          const called = await Promise.all(heads.map((e) => b.outbox.markCalling(e.key, tokenOf(e), LONG)));
          expect(called, "every head's call announced").toEqual(heads.map(() => true));
          await Promise.all(heads.map((e) => b.outbox.markSent(e.key, tokenOf(e), `m-${e.key}`)));
          for (const e of heads) sentOrder.get(e.chatId)!.push(e.key);
          const { due } = await b.outbox.claimDue({ ...owner, limit: 100 });
          heads = due;
          expect(heads.length, `round ${round}: each chat's next entry is due, and only it`).toBe(round < 2 ? chats.length : 0);
        }
        for (const chat of chats) {
          expect(sentOrder.get(chat), "sent in seq order").toEqual(bySeq.get(chat)!.map((e) => e.key));
          for (const e of bySeq.get(chat)!) expect((await mustGetOut(b, e.key)).state).toBe("sent");
        }
      });
    });

    describe("damaged records", () => {
      if (!options.damage) {
        (test.skip ?? test)("skipped: no damage option (the backend keeps no stored form that could be damaged)", () => {});
        return;
      }
      const damage = options.damage;
      /** Runs `run` on a fresh backend; `hurt` damages a record and swaps the backend the test goes on with. */
      const withDamage = (
        name: string,
        run: (
          current: () => DurabilityBackend,
          hurt: (journal: "inbox" | "outbox", id: string) => Promise<void>,
          restart: () => Promise<void>,
        ) => Promise<void>,
      ) =>
        test(name, async () => {
          time = new SuiteTime(options.simulatedTime === true);
          let b = await time.create(options);
          let open = false;
          try {
            await b.open?.();
            open = true;
            await run(() => b, async (journal, id) => {
              open = false;
              b = await time.damage(damage, b, journal, id);
              await b.open?.();
              open = true;
            }, async () => {
              open = false;
              b = await time.reopen(options.reopen!, b);
              await b.open?.();
              open = true;
            });
          } finally {
            try {
              if (open) await b.close?.();
            } finally {
              await time.cleanup(options, b); // the backend the test ended on (a damage or a restart may have reopened it)
              time.stop();
            }
          }
        });

      async function rejection(run: () => Promise<unknown>): Promise<unknown> {
        try {
          await run();
        } catch (error) {
          return error;
        }
        return undefined;
      }

      withDamage("inbox: a damaged record is set aside: list returns the rest, due scans take the rest in chat order, get names it; nothing is deleted", async (current, hurt) => {
        const chat = uid("chat");
        // Admitted under a long lease (a short one could lapse between the admissions of a slow backend), then shortened.
        const lost = claimer("owner-lost", LONG);
        const a = await admitted(current(), inbound(chat, 1_000), lost);
        const bad = await admitted(current(), inbound(chat, 2_000), lost);
        const c = await admitted(current(), inbound(chat, 3_000), lost);
        const done = await doneRecord(current(), uid("chat"), 4_000);
        await hurt("inbox", bad.id);
        const b = current();
        for (const r of [a, c]) expect(await b.inbox.heartbeat(r.id, tokenOf(r), SHORT)).toBe(true);
        expect(ids(await b.inbox.list({ limit: 100 })), "list returns every other record").toEqual([a.id, c.id, done]);
        expect(ids(await b.inbox.list({ state: "processing", chatId: chat })), "and filters them").toEqual([a.id, c.id]);
        const found = await b.inbox.damaged();
        expect(found.map((d) => [d.journal, d.id, d.backend, d.reported]), "set aside").toEqual([["inbox", bad.id, b.name, false]]);
        expect(typeof found[0]!.problem === "string" && found[0]!.problem.length > 0, "the problem is named").toBe(true);
        expect(typeof found[0]!.setAsideAt, "setAsideAt").toBe("number");
        const error = await rejection(() => b.inbox.get(bad.id));
        expect(error instanceof DamagedRecordError, `get rejects with a DamagedRecordError, got ${String(error)}`).toBe(true);
        expect([(error as DamagedRecordError).id, (error as DamagedRecordError).backend, (error as DamagedRecordError).journal]).toEqual([bad.id, b.name, "inbox"]);
        expect(String((error as Error).message).includes(bad.id), "the message names it").toBe(true);
        await sleep(LAPSE);
        expect(ids(await b.inbox.claimDue({ ...claimer(), limit: 100 })), "the damaged record neither taken nor holding back its chat").toEqual([a.id, c.id]);
        expect(await b.inbox.replay(bad.id), "replay changes nothing").toBe(false);
        expect(await b.inbox.purge(0) >= 1, "purge removes done records").toBe(true);
        expect((await b.inbox.damaged()).map((d) => d.id), "still set aside, never deleted").toEqual([bad.id]);
      });

      withDamage("outbox: a damaged entry is set aside: its chat moves on, list returns the rest, retry and discard change nothing", async (current, hurt) => {
        const chat = uid("chat");
        const bad = await reserved(current(), outbound(chat));
        const next = await reserved(current(), outbound(chat));
        const sent = await reserved(current(), outbound(uid("chat")), claimer());
        await current().outbox.markSent(sent.key, tokenOf(sent), "m-1");
        expect([bad.state, next.state]).toEqual(["queued", "queued"]);
        await hurt("outbox", bad.key);
        const b = current();
        const claim = await b.outbox.claimDue({ ...claimer(), limit: 100 });
        expect([keys(claim.due), keys(claim.ambiguous)], "the next send of the chat is due").toEqual([[next.key], []]);
        expect(keys(await b.outbox.list({ limit: 100 })), "list returns the rest").toEqual([next.key, sent.key]);
        const found = await b.outbox.damaged();
        expect(found.map((d) => [d.journal, d.id, d.backend, d.reported])).toEqual([["outbox", bad.key, b.name, false]]);
        const error = await rejection(() => b.outbox.get(bad.key));
        expect(error instanceof DamagedRecordError, `get rejects with a DamagedRecordError, got ${String(error)}`).toBe(true);
        expect(await b.outbox.retry(bad.key), "retry changes nothing").toBe(false);
        expect(await b.outbox.discard(bad.key), "discard changes nothing").toBe(false);
        expect((await b.outbox.damaged()).map((d) => d.id), "still set aside").toEqual([bad.key]);
      });

      withDamage("a record met first by a due scan is set aside by it; each damaged record is reported by exactly one of several callers", async (current, hurt) => {
        const lost = claimer("owner-lost", SHORT);
        const inBad = await admitted(current(), inbound(uid("chat"), 1_000), lost);
        const inGood = await admitted(current(), inbound(uid("chat"), 2_000), lost);
        const outBad = await reserved(current(), outbound(uid("chat")));
        const outGood = await reserved(current(), outbound(uid("chat")));
        await hurt("inbox", inBad.id);
        await hurt("outbox", outBad.key);
        const b = current();
        await sleep(LAPSE);
        expect(ids(await b.inbox.claimDue({ ...claimer(), limit: 100 }))).toEqual([inGood.id]);
        expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 100 })).due)).toEqual([outGood.key]);
        for (const [journal, id] of [["inbox", inBad.id], ["outbox", outBad.key]] as const) {
          const j = b[journal];
          expect((await j.damaged({ unreported: true })).map((d) => d.id), `${journal}: unreported`).toEqual([id]);
          const answers = await Promise.all([1, 2, 3, 4].map(() => j.reportDamaged(id)));
          expect(answers.filter((x) => x).length, `${journal}: exactly one caller reports it`).toBe(1);
          expect(await j.reportDamaged(id), `${journal}: reported already`).toBe(false);
          expect(await j.damaged({ unreported: true }), `${journal}: none unreported`).toEqual([]);
          expect((await j.damaged()).map((d) => [d.id, d.reported]), `${journal}: listed, reported`).toEqual([[id, true]]);
          expect(await j.reportDamaged(uid("nothing")), `${journal}: an id that is not damaged`).toBe(false);
        }
      });

      if (options.reopen) {
        withDamage("set aside records survive a restart, reported flag included", async (current, hurt, restart) => {
          const bad = await admitted(current(), inbound(uid("chat"), 1_000));
          const badOut = await reserved(current(), outbound(uid("chat")));
          await hurt("inbox", bad.id);
          await hurt("outbox", badOut.key);
          expect(await current().inbox.list({ limit: 100 })).toEqual([]);
          expect(await current().outbox.list({ limit: 100 })).toEqual([]);
          expect(await current().inbox.reportDamaged(bad.id)).toBe(true);
          await restart();
          expect((await current().inbox.damaged()).map((d) => [d.id, d.reported])).toEqual([[bad.id, true]]);
          expect((await current().outbox.damaged()).map((d) => [d.id, d.reported])).toEqual([[badOut.key, false]]);
        });
      }
    });

    describe("restart", () => {
      if (!options.reopen) {
        (test.skip ?? test)("skipped: no reopen option (the backend keeps nothing across processes)", () => {});
        return;
      }
      const reopen = options.reopen;
      test("a reopened backend has every record, state, lease, fence and order, and goes on from them", async () => {
        time = new SuiteTime(options.simulatedTime === true);
        let b = await time.create(options);
        let opened = false;
        try {
          await b.open?.();
          opened = true;
          const chat = uid("chat");
          const other = uid("chat");
          const owner = claimer();
          // Inbox: one record of every state.
          // (Admitted leased first: a leased admission behind a pending record of its chat would wait.)
          const processing = await admitted(b, inbound(chat, 1_700_000_000_002), owner);
          const failing = await admitted(b, inbound(chat, 1_700_000_000_003), owner);
          await b.inbox.fail(failing.id, tokenOf(failing), { error: "boom ✗", retryInMs: LONG });
          const pending = await admitted(b, inbound(chat, 1_700_000_000_001, tricky()));
          const dead = await admitted(b, inbound(other, 1_700_000_000_004), claimer());
          await b.inbox.fail(dead.id, tokenOf(dead), { error: "dead", dead: true });
          const done = await doneRecord(b, other, 1_700_000_000_005);
          // Outbox: every state, two chats, per-chat order.
          const sent = await reserved(b, outbound(chat), claimer());
          await b.outbox.markSent(sent.key, tokenOf(sent), "mid-1");
          const sending = await reserved(b, outbound(chat, tricky()), owner);
          const queued = await reserved(b, outbound(chat));
          const failed = await reserved(b, outbound(other), claimer());
          await b.outbox.markFailed(failed.key, tokenOf(failed), { error: "429", retryInMs: LONG });
          const deadOut = await reserved(b, outbound(uid("chat")), claimer());
          await b.outbox.markFailed(deadOut.key, tokenOf(deadOut), { error: "403", dead: true });
          const unknown = await unknownEntry(b, uid("chat"));
          const uncalled = (await b.outbox.reserve(outbound(uid("chat")), owner)).entry;
          const reservedCalling = (await b.outbox.reserve(outbound(uid("chat")), { ...owner, calling: true })).entry;
          const inboxBefore = await b.inbox.list();
          const outboxBefore = await b.outbox.list();
          expect(inboxBefore.length).toBe(5);
          expect(outboxBefore.length).toBe(8);

          b = await time.reopen(reopen, b);
          await b.open?.();
          expect(await b.inbox.list(), "inbox after reopen").toEqual(inboxBefore);
          expect(await b.outbox.list(), "outbox after reopen").toEqual(outboxBefore);
          expect((await mustGetIn(b, pending.id)).payload, "payload after reopen").toEqual(tricky());
          expect((await mustGetOut(b, sending.key)).content, "content after reopen").toEqual(tricky());
          expect((await mustGetOut(b, unknown.key)).state).toBe("unknown");
          expect((await mustGetOut(b, sending.key)).called, "an announced call after reopen").toBe(true);
          expect((await mustGetOut(b, uncalled.key)).called, "an unannounced one after reopen").toBe(false);
          expect((await mustGetOut(b, reservedCalling.key)).called, "a call announced by its reservation after reopen").toBe(true);
          expect((await mustGetIn(b, done)).state).toBe("done");

          // Leases and fences go on: the holder completes, a stale token is refused, a new claim gets a greater token.
          await expectStale(expect, () => b.inbox.complete(failing.id, tokenOf(failing)), "stale inbox token after reopen");
          await b.inbox.complete(processing.id, tokenOf(processing));
          expect((await mustGetIn(b, processing.id)).state).toBe("done");
          const retaken = await mustClaim(b, pending.id, claimer());
          expect(tokenOf(retaken)).toBe(Math.max(pending.fence, 1) + 1);
          // Per-chat order survives: `queued` waits behind `sending` until it is sent.
          expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 10 })).due)).toEqual([]);
          await b.outbox.markSent(sending.key, tokenOf(sending), "mid-2");
          expect(keys((await b.outbox.claimDue({ ...claimer(), limit: 10 })).due)).toEqual([queued.key]);
          // New entries come after the old ones.
          const later = await reserved(b, outbound(uid("chat")));
          expect(later.seq).toBeGreaterThan(Math.max(...outboxBefore.map((e) => e.seq)));
          expect((await b.inbox.admit(inbound(chat), undefined)) !== null).toBe(true);
          expect(await b.inbox.admit({ ...inbound(chat), id: pending.id })).toBe(null);
        } finally {
          try {
            if (opened) await b.close?.();
          } finally {
            try {
              await time.cleanup(options, b);
            } finally {
              time.stop();
            }
          }
        }
      });

      test("payloads and content with own __proto__ keys round-trip exactly through a reopen", async () => {
        time = new SuiteTime(options.simulatedTime === true);
        let b = await time.create(options);
        let opened = false;
        try {
          await b.open?.();
          opened = true;
          const chat = uid("chat");
          const values = [hostile(), [{ nested: hostile() }], JSON.parse('{"__proto__": null}') as JsonValue];
          const ids: string[] = [];
          const outKeys: string[] = [];
          const c = claimer(); // one holder: its own leases do not hold back the chat's later records
          for (let i = 0; i < values.length; i++) {
            ids.push((await admitted(b, inbound(chat, 4_000 + i, values[i]!), i === 0 ? c : undefined)).id);
            outKeys.push((await reserved(b, outbound(chat, values[i]!), i === 0 ? claimer() : undefined)).key);
          }
          // Changes after the first write (a claim, a failure) rewrite the records on some backends.
          await mustClaim(b, ids[1]!, c);
          const failing = await mustGetOut(b, outKeys[0]!);
          await b.outbox.markFailed(failing.key, tokenOf(failing), { error: "later", retryInMs: LONG });

          b = await time.reopen(reopen, b);
          await b.open?.();
          for (let i = 0; i < values.length; i++) {
            expectExactJson(expect, (await mustGetIn(b, ids[i]!)).payload, values[i]!, `payload ${i} after reopen`);
            expectExactJson(expect, (await mustGetOut(b, outKeys[i]!)).content, values[i]!, `content ${i} after reopen`);
          }
          const listedIn = await b.inbox.list({ chatId: chat });
          listedIn.forEach((r, i) => expectExactJson(expect, r.payload, values[i]!, `listed payload ${i} after reopen`));
          const listedOut = await b.outbox.list({ chatId: chat });
          listedOut.forEach((e, i) => expectExactJson(expect, e.content, values[i]!, `listed content ${i} after reopen`));
          const due = (await b.inbox.claimDue({ ...c, limit: 100 })).filter((r) => r.chatId === chat);
          expect(due.map((r) => r.id)).toEqual([ids[2]]);
          expectExactJson(expect, due[0]!.payload, values[2]!, "claimDue after reopen");
          expect(({} as Record<string, unknown>).polluted, "Object.prototype is untouched").toBe(undefined);
        } finally {
          try {
            if (opened) await b.close?.();
          } finally {
            try {
              await time.cleanup(options, b);
            } finally {
              time.stop();
            }
          }
        }
      });
    });

    describe("per-chat order under concurrency", () => {
      /** The chat's entries that are `sending`, each with every earlier entry of the chat settled. */
      async function checkChat(b: DurabilityBackend, chat: string, when: string): Promise<OutboxEntry[]> {
        const entries = await b.outbox.list({ chatId: chat, limit: 1_000 });
        const sending = entries.filter((e) => e.state === "sending");
        expect(sending.length, `${when}: at most one entry of the chat is sending`).toBeLessThanOrEqual(1);
        for (const s of sending) {
          const before = entries.filter((e) => e.seq < s.seq && ["queued", "sending", "failed"].includes(e.state));
          expect(keys(before), `${when}: nothing unsettled before the sending entry`).toEqual([]);
        }
        return sending;
      }

      it("many concurrent leased reserves in one chat: at most one leased; sends leave in seq order", async (b) => {
        // Warm up: a backend with a connection pool opens its connections (and prepares its
        // statements) now, so that the reserves below really run at the same moment.
        await Promise.all(Array.from({ length: 24 }, () => b.outbox.reserve(outbound(uid("chat")), claimer())));
        const chats = Array.from({ length: 4 }, () => uid("chat"));
        const results = await Promise.all(
          Array.from({ length: 48 }, (_, i) => b.outbox.reserve(outbound(chats[i % 4]!, { n: i }), claimer(`owner-${i % 3}`))),
        );
        expect(results.filter((r) => r.status === "exists").length).toBe(0);
        const seqsOf = new Map<string, number[]>();
        const holders = new Map<string, OutboxEntry>();
        for (const chat of chats) {
          const mine = results.filter((r) => r.entry.chatId === chat);
          const seqs = mine.map((r) => r.entry.seq);
          seqsOf.set(chat, seqs);
          expect(new Set(seqs).size, "distinct seq").toBe(12);
          const leased = mine.filter((r) => r.status === "leased");
          expect(leased.length, "at most one reserve of the chat leased").toBeLessThanOrEqual(1);
          if (leased.length === 1) {
            expect(leased[0]!.entry.seq, "the leased one is the chat's earliest").toBe(Math.min(...seqs));
            holders.set(chat, leased[0]!.entry);
          }
          await checkChat(b, chat, "after the reserves");
        }

        // Drain the chats as concurrent workers would: only a chat's head is ever due.
        const sent = new Map<string, number[]>(chats.map((chat) => [chat, []]));
        for (let round = 0; round < 30 && [...sent.values()].some((list) => list.length < 12); round++) {
          for (const [chat, holder] of holders) {
            await b.outbox.markSent(holder.key, tokenOf(holder), `m-${holder.seq}`);
            sent.get(chat)!.push(holder.seq);
          }
          holders.clear();
          const claims = await Promise.all(Array.from({ length: 4 }, () => b.outbox.claimDue({ ...claimer(), limit: 100 })));
          for (const chat of chats) {
            const mine = claims.flatMap((c) => c.due).filter((e) => e.chatId === chat);
            expect(mine.length, `round ${round}: at most the head of the chat is due`).toBeLessThanOrEqual(1);
            if (mine[0]) holders.set(chat, mine[0]);
            await checkChat(b, chat, `round ${round}`);
          }
        }
        for (const chat of chats) {
          expect(sent.get(chat), "every entry sent once, in seq order").toEqual([...seqsOf.get(chat)!].sort((x, y) => x - y));
        }
      });

      it("leased reserves racing the sends of their chat never overtake an earlier entry", async (b) => {
        await Promise.all(Array.from({ length: 12 }, () => b.outbox.reserve(outbound(uid("chat")), claimer()))); // warm up
        const chat = uid("chat");
        const sent: number[] = [];
        const all: number[] = [];
        let holder: OutboxEntry | null = null;
        for (let round = 0; round < 6; round++) {
          const send = holder
            ? b.outbox.markSent(holder.key, tokenOf(holder), `m-${holder.seq}`).then(() => holder!.seq)
            : Promise.resolve(null);
          const [done, ...results] = await Promise.all([
            send,
            ...Array.from({ length: 6 }, (_, i) => b.outbox.reserve(outbound(chat, { round, i }), claimer())),
          ]);
          if (done !== null) sent.push(done);
          all.push(...results.map((r) => r.entry.seq));
          const leased = results.filter((r) => r.status === "leased");
          expect(leased.length, `round ${round}: at most one leased`).toBeLessThanOrEqual(1);
          const sending = await checkChat(b, chat, `round ${round}`);
          holder = sending[0] ?? null;
          if (!holder) {
            const claim = await b.outbox.claimDue({ ...claimer(), limit: 100 });
            const mine = claim.due.filter((e) => e.chatId === chat);
            expect(mine.length, `round ${round}: one head is due`).toBeLessThanOrEqual(1);
            holder = mine[0] ?? null;
          }
        }
        while (holder) {
          await b.outbox.markSent(holder.key, tokenOf(holder), `m-${holder.seq}`);
          sent.push(holder.seq);
          const claim = await b.outbox.claimDue({ ...claimer(), limit: 100 });
          holder = claim.due.find((e) => e.chatId === chat) ?? null;
        }
        expect(sent, "every entry sent once, in seq order").toEqual([...all].sort((x, y) => x - y));
      });
    });
  });
}
