/**
 * The journals' state machines as one table: every state of the inbox and of
 * the outbox with its properties, and every journal operation with the states
 * it applies to and the state it leads to. The state types of the contract,
 * the rules of `rules.ts`, the state lists of the SQL and Lua backends, the
 * operator tools and the diagram in the architecture guide are derived from
 * it; the conformance matrix runs every operation on every state of every
 * backend and compares the outcome with it.
 *
 * @module
 */

/** Every inbound state, in lifecycle order. */
export const INBOX_STATES = ["pending", "processing", "scheduled", "failed", "done", "dead"] as const;
/** Every outbox state, in lifecycle order. */
export const OUTBOX_STATES = ["queued", "sending", "sent", "failed", "dead", "unknown"] as const;

/** An inbound record's state. */
export type InboxStateName = typeof INBOX_STATES[number];
/** An outbox entry's state. */
export type OutboxStateName = typeof OUTBOX_STATES[number];

/**
 * When a record in a state is due for a scan (`claimDue`): `always`; at its
 * `nextAttemptAt` (none: at once); once its lease lapses; or `never`.
 */
export type DueBy = "always" | "nextAttemptAt" | "leaseExpiry" | "never";

/** What a state is. */
export interface StateTraits {
  /** Still to be worked on (not settled). */
  readonly active: boolean;
  /** Held under a lease, whose fencing token every completion must carry. */
  readonly leased: boolean;
  /** Holds back later records of its chat (outbox: later sends wait behind it). */
  readonly blocksChat: boolean;
  /** When a due scan takes it. */
  readonly due: DueBy;
  /** Finished as far as the worker is concerned; due scans never look at it. */
  readonly settled: boolean;
  /** An operator may run it again: `inbox.replay` / `outbox.retry`. */
  readonly retryable: boolean;
  /** `outbox.discard` deletes it. */
  readonly discardable: boolean;
  /** `purge` deletes it once old enough. */
  readonly purgeable: boolean;
  /** A late outcome (`markSent`/`markFailed`) under its `fence` still resolves it. */
  readonly acceptsLateOutcome: boolean;
  /** One line for the docs. */
  readonly doc: string;
}

/** A boolean property of {@link StateTraits}. */
export type StateFlag = Exclude<keyof StateTraits, "due" | "doc">;

/** One journal's state table. */
export type StateTable<S extends string> = { readonly [K in S]: StateTraits };

const no = {
  active: false,
  leased: false,
  blocksChat: false,
  due: "never",
  settled: false,
  retryable: false,
  discardable: false,
  purgeable: false,
  acceptsLateOutcome: false,
} as const;

/** The inbound states. */
export const INBOX: StateTable<InboxStateName> = {
  pending: { ...no, active: true, due: "always", doc: "admitted, not yet claimed" },
  processing: { ...no, active: true, leased: true, due: "leaseExpiry", doc: "leased to an instance" },
  scheduled: { ...no, active: true, due: "nextAttemptAt", doc: "a timer: due at nextAttemptAt, its deadline" },
  failed: { ...no, active: true, due: "nextAttemptAt", retryable: true, doc: "the handler threw; retried at nextAttemptAt" },
  done: { ...no, settled: true, retryable: true, purgeable: true, doc: "handled" },
  dead: { ...no, settled: true, retryable: true, doc: "the inbound dead-letter queue" },
};

/** The outbox states. */
export const OUTBOX: StateTable<OutboxStateName> = {
  queued: { ...no, active: true, blocksChat: true, due: "nextAttemptAt", discardable: true, doc: "journaled, waiting for the worker" },
  sending: { ...no, active: true, leased: true, blocksChat: true, due: "leaseExpiry", doc: "leased: the provider call may be under way" },
  sent: { ...no, settled: true, discardable: true, purgeable: true, doc: "delivered" },
  failed: {
    ...no,
    active: true,
    blocksChat: true,
    due: "nextAttemptAt",
    retryable: true,
    discardable: true,
    doc: "the call failed; retried at nextAttemptAt",
  },
  dead: { ...no, settled: true, retryable: true, discardable: true, doc: "the outbound dead-letter queue" },
  unknown: {
    ...no,
    settled: true,
    retryable: true,
    discardable: true,
    acceptsLateOutcome: true,
    doc: "the call may have reached the channel",
  },
};

/** The traits of `state` in `table`, or `undefined` when it is not one of its states (a damaged record's). */
export function traitsOf<S extends string>(table: StateTable<S>, state: string): StateTraits | undefined {
  return Object.prototype.hasOwnProperty.call(table, state) ? table[state as S] : undefined;
}

/** The states of `table`, in table order, that have `flag` (or, given a predicate, pass it). */
export function statesWhere<S extends string>(
  table: StateTable<S>,
  flag: StateFlag | ((traits: StateTraits, state: S) => boolean),
): S[] {
  const test = typeof flag === "function" ? flag : (t: StateTraits) => t[flag];
  return (Object.keys(table) as S[]).filter((s) => test(table[s], s));
}

/** The states of `table` that a due scan takes by `due` (one kind of {@link DueBy}, or several). */
export function statesDueBy<S extends string>(table: StateTable<S>, ...due: DueBy[]): S[] {
  return statesWhere(table, (t) => due.includes(t.due));
}

/** The states of `table` a due scan may take at some time. */
export function dueStates<S extends string>(table: StateTable<S>): S[] {
  return statesWhere(table, (t) => t.due !== "never");
}

/** `table`'s states in the operators' order: the active ones, then the settled ones. */
export function operatorOrder<S extends string>(table: StateTable<S>): S[] {
  return [...statesWhere(table, "active"), ...statesWhere(table, (t) => !t.active)];
}

/**
 * The one state of `table` that has `flag`: for a statement that names it
 * (e.g. the leased state of a claim). Throws when there is not exactly one.
 */
export function theState<S extends string>(table: StateTable<S>, flag: StateFlag): S {
  const states = statesWhere(table, flag);
  if (states.length !== 1) throw new Error(`expected one state with "${flag}", got ${states.length}: ${states.join(", ")}`);
  return states[0]!;
}

// ---- transitions --------------------------------------------------------------

/** What an operation answers when the state (or token) does not allow it. */
export type Refusal =
  /** `null`: claim, admit of an existing id. */
  | "null"
  /** `false`: heartbeat, markCalling, replay, retry, discard. */
  | "false"
  /** A `StaleLeaseError`: complete, fail, markSent, markFailed. */
  | "stale"
  /** Not returned by the scan; the record stays as it was. */
  | "skipped"
  /** Not counted; the record stays. */
  | "kept"
  /** `{ status: "exists" }`: reserve of an existing key. */
  | "exists";

/**
 * The extra condition under which an operation applies to a state of its
 * `from` set: `due` (the state's {@link DueBy} has come), `token` (the caller
 * holds the record's live lease), `tokenOrFence` (`token`, or for a state that
 * accepts a late outcome its `fence` still the caller's token), `olderThan`
 * (last changed long enough ago), `none`.
 */
export type Guard = "none" | "due" | "token" | "tokenOrFence" | "olderThan";

/** One operation of a journal. */
export interface Transition<S extends string> {
  /** The states it applies to (empty for an operation that creates the record). */
  readonly from: readonly S[];
  /** Its result by outcome: the new state, or `deleted`. */
  readonly to: { readonly [outcome: string]: S | "deleted" };
  /** Outcomes that arise from some states of `from` only (the others arise from all of them). */
  readonly outcomeFrom?: { readonly [outcome: string]: readonly S[] };
  readonly guard: Guard;
  /** What it answers for a state outside `from`, or a guard that does not hold. */
  readonly refusal: Refusal;
  /** An operator's call (console, CLI), not the engine's. */
  readonly operator: boolean;
}

/** A state machine: its states and its operations. */
export interface Machine<S extends string, T extends string> {
  /** `inbox` or `outbox`. */
  readonly journal: "inbox" | "outbox";
  readonly states: StateTable<S>;
  readonly transitions: { readonly [K in T]: Transition<S> };
}

/** The operations of the inbox journal that change a record. */
export type InboxTransitionName =
  | "admit"
  | "claim"
  | "claimDue"
  | "start"
  | "heartbeat"
  | "schedule"
  | "complete"
  | "fail"
  | "replay"
  | "purge";
/** The operations of the outbox journal (and the console) that change an entry. */
export type OutboxTransitionName =
  | "reserve"
  | "claimDue"
  | "heartbeat"
  | "markCalling"
  | "markSent"
  | "markFailed"
  | "markDelivered"
  | "retry"
  | "discard"
  | "purge";

const INBOX_LEASED = statesWhere(INBOX, "leased");
const INBOX_DUE = dueStates(INBOX);

/** The inbox: its states and operations. */
export const INBOX_MACHINE: Machine<InboxStateName, InboxTransitionName> = {
  journal: "inbox",
  states: INBOX,
  transitions: {
    admit: { from: [], to: { plain: "pending", leased: "processing", chatBusy: "pending" }, guard: "none", refusal: "null", operator: false },
    claim: { from: INBOX_DUE, to: { ok: "processing" }, guard: "due", refusal: "null", operator: false },
    claimDue: { from: INBOX_DUE, to: { ok: "processing" }, guard: "due", refusal: "skipped", operator: false },
    start: { from: INBOX_LEASED, to: { ok: "processing" }, guard: "token", refusal: "false", operator: false },
    heartbeat: { from: INBOX_LEASED, to: { ok: "processing" }, guard: "token", refusal: "false", operator: false },
    // A timer armed (or armed again, when taken up before its deadline): attempts unchanged.
    schedule: { from: INBOX_LEASED, to: { ok: "scheduled" }, guard: "token", refusal: "stale", operator: false },
    complete: { from: INBOX_LEASED, to: { ok: "done" }, guard: "token", refusal: "stale", operator: false },
    fail: { from: INBOX_LEASED, to: { retry: "failed", dead: "dead" }, guard: "token", refusal: "stale", operator: false },
    replay: { from: statesWhere(INBOX, "retryable"), to: { ok: "pending" }, guard: "none", refusal: "false", operator: true },
    purge: { from: statesWhere(INBOX, "purgeable"), to: { ok: "deleted" }, guard: "olderThan", refusal: "kept", operator: true },
  },
};

const OUTBOX_LEASED = statesWhere(OUTBOX, "leased");
const OUTBOX_OUTCOME = statesWhere(OUTBOX, (t) => t.leased || t.acceptsLateOutcome);

/** The outbox: its states and operations. */
export const OUTBOX_MACHINE: Machine<OutboxStateName, OutboxTransitionName> = {
  journal: "outbox",
  states: OUTBOX,
  transitions: {
    reserve: { from: [], to: { plain: "queued", leased: "sending", chatBusy: "queued" }, guard: "none", refusal: "exists", operator: false },
    // A lapsed `sending` entry whose call was announced becomes `unknown` (or, with resendAmbiguous, is leased again).
    claimDue: {
      from: dueStates(OUTBOX),
      to: { ok: "sending", lostCalled: "unknown", lostCalledResend: "sending" },
      outcomeFrom: { lostCalled: OUTBOX_LEASED, lostCalledResend: OUTBOX_LEASED },
      guard: "due",
      refusal: "skipped",
      operator: false,
    },
    heartbeat: { from: OUTBOX_LEASED, to: { ok: "sending" }, guard: "token", refusal: "false", operator: false },
    markCalling: { from: OUTBOX_LEASED, to: { ok: "sending" }, guard: "token", refusal: "false", operator: false },
    markSent: { from: OUTBOX_OUTCOME, to: { ok: "sent" }, guard: "tokenOrFence", refusal: "stale", operator: false },
    markFailed: {
      from: OUTBOX_OUTCOME,
      to: { retry: "failed", throttled: "failed", dead: "dead", ambiguous: "unknown" },
      guard: "tokenOrFence",
      refusal: "stale",
      operator: false,
    },
    // The console's "it was delivered": `markSent` under the entry's fence.
    markDelivered: {
      from: statesWhere(OUTBOX, "acceptsLateOutcome"),
      to: { ok: "sent" },
      guard: "none",
      refusal: "false",
      operator: true,
    },
    retry: { from: statesWhere(OUTBOX, "retryable"), to: { ok: "queued" }, guard: "none", refusal: "false", operator: true },
    discard: { from: statesWhere(OUTBOX, "discardable"), to: { ok: "deleted" }, guard: "none", refusal: "false", operator: true },
    purge: { from: statesWhere(OUTBOX, "purgeable"), to: { ok: "deleted" }, guard: "olderThan", refusal: "kept", operator: true },
  },
};

// ---- renderings -----------------------------------------------------------------

/** `'a', 'b'`: states as SQL string literals, for an `IN (…)` list. */
export function sqlStates(states: readonly string[]): string {
  if (states.length === 0) throw new Error("an SQL state list needs at least one state");
  return states.map((s) => `'${s}'`).join(", ");
}

/** `column = 'a'` or `column IN ('a', 'b')`. */
export function sqlIn(column: string, states: readonly string[]): string {
  return states.length === 1 ? `${column} = '${states[0]}'` : `${column} IN (${sqlStates(states)})`;
}

/** `{a = true, b = true}`: a Lua set of states. */
export function luaSet(states: readonly string[]): string {
  return states.map((s) => `${s} = true`).join(", ");
}

/**
 * The Mermaid `stateDiagram-v2` of `machine`: one arrow per operation and
 * from-state (operations of one pair on one arrow), `[*]` for creation and deletion.
 */
export function mermaidDiagram<S extends string, T extends string>(machine: Machine<S, T>): string {
  const arrows = new Map<string, string[]>();
  const add = (from: string, to: string, label: string): void => {
    const key = `${from} --> ${to}`;
    const labels = arrows.get(key) ?? [];
    if (!labels.includes(label)) labels.push(label);
    arrows.set(key, labels);
  };
  for (const name of Object.keys(machine.transitions) as T[]) {
    const t = machine.transitions[name];
    for (const outcome of Object.keys(t.to)) {
      const to = t.to[outcome]!;
      const target = to === "deleted" ? "[*]" : to;
      if (t.from.length === 0) add("[*]", target, name);
      for (const from of t.outcomeFrom?.[outcome] ?? t.from) {
        if (from !== to) add(from, target, name); // an operation that keeps the state (heartbeat) draws no arrow
      }
    }
  }
  const lines = ["stateDiagram-v2"];
  for (const [key, labels] of arrows) lines.push(`  ${key}: ${labels.join(", ")}`);
  for (const s of Object.keys(machine.states) as S[]) lines.push(`  note right of ${s}: ${noteOf(machine.states[s])}`);
  return lines.join("\n");
}

function noteOf(t: StateTraits): string {
  const due = t.due === "never" ? "" : t.due === "always" ? "due" : `due at ${t.due}`;
  const flags = (["leased", "blocksChat", "settled", "acceptsLateOutcome"] as const).filter((f) => t[f]);
  return [due, ...flags].filter((x) => x !== "").join(", ") || "-";
}

/** `column <> 'a'` or `column NOT IN ('a', 'b')`. */
export function sqlNotIn(column: string, states: readonly string[]): string {
  return states.length === 1 ? `${column} <> '${states[0]}'` : `${column} NOT IN (${sqlStates(states)})`;
}

const DUE_ORDER: readonly DueBy[] = ["always", "nextAttemptAt", "leaseExpiry", "never"];

/**
 * An SQL condition over the states of `table` by when they are due: for each
 * kind of {@link DueBy} in `when` (in the order always, nextAttemptAt,
 * leaseExpiry, never), its states, and its condition when one is given (`""`:
 * none), joined by OR. E.g. claimable: `{ always: "", nextAttemptAt: "… <= now",
 * leaseExpiry: "<lease abandoned>" }`.
 */
export function sqlByDue<S extends string>(
  table: StateTable<S>,
  column: string,
  when: { readonly [D in DueBy]?: string },
): string {
  const terms: string[] = [];
  for (const due of DUE_ORDER) {
    const condition = when[due];
    const states = statesDueBy(table, due);
    if (condition === undefined || states.length === 0) continue;
    terms.push(condition === "" ? sqlIn(column, states) : `(${sqlIn(column, states)} AND ${condition})`);
  }
  if (terms.length === 0) throw new Error("sqlByDue needs at least one kind of due with states");
  return `(${terms.join(" OR ")})`;
}
