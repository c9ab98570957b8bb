/**
 * The simulator's ground truth: what really happened in a run, as seen from
 * outside the engine (every journal call's real effect, every provider call
 * and whether the channel accepted it, every event the bots emitted). The
 * invariants are checked against it.
 *
 * @module
 */

/** One provider call that reached the channel. */
export interface CallRecord {
  n: number;
  key: string;
  chatId: string;
  content: unknown;
  /** The replica's instanceId. */
  replica: string;
  /** `<instanceId>#<incarnation number>`. */
  inc: string;
  /** The key's generation (a discarded key reserved again starts a new one, its tokens from 1). */
  gen: number;
  /** The fencing token the calling incarnation held for the key (from its last claim of that attempt). */
  token: number | undefined;
  attempt: number;
  start: number;
  end: number | null;
  outcome: string;
  /** Whether the channel delivered it. */
  accepted: boolean;
  /** Position in the channel's log of accepted deliveries (when accepted). */
  acceptedIndex: number | null;
}

/**
 * One call of a step's function (`ctx.step`) at the world's fake external service: the step's "effect".
 * The service records every call it receives with the idempotency key it was given, whether it took
 * effect (an `ok` call, a timeout after the effect, a crash after the effect) and the result it
 * returned (`svc-<n>`, unique per call, so a reply shows which call's result it carries).
 */
export interface StepCallRecord {
  n: number;
  /** The step's key (`idempotencyKey` as the function got it). */
  stepKey: string;
  /** The attempt's outbox key and fencing token the calling incarnation held (from its reservation or a hand-on). */
  attemptKey: string | undefined;
  token: number | undefined;
  /** The attempt key's generation (a discarded attempt reserved again starts a new one). */
  gen: number;
  inc: string;
  idempotent: boolean;
  /** `StepCall.attempt`. */
  attempt: number;
  start: number;
  end: number | null;
  outcome: string;
  /** Whether the call took effect at the service. */
  effect: boolean;
  /** The result it returned (only an `ok` call returns one). */
  result: string | null;
}

/** Why a reply never reached the engine: its process died, or the connection was reset after the commit. */
export type LostBy = "crash" | "lost-reply" | null;

/** Who was granted a lease (a fencing token) on a record. */
export interface LeaseGrant {
  inc: string;
  time: number;
  /** Whether the grant's reply reached the engine (`false`: lost reply, or the process died), or it learned of the lease otherwise. */
  delivered: boolean;
  lostBy: LostBy;
  /** The grant's reply is still on its way to the engine (a delay). */
  pending: boolean;
  /** When the lease really lapses in true (virtual) time: grant or last heartbeat plus the lease length. */
  expires: number;
}

/** A record moved to `unknown` (or re-leased as ambiguous) by a backend claim. */
export interface AmbiguityRecord {
  key: string;
  chatId: string;
  /** The abandoned fencing token. */
  token: number;
  time: number;
  /** Who made the claim. */
  by: string;
  delivered: boolean;
  lostBy: LostBy;
  /**
   * Why the sim thinks it was ambiguous: `call` a call under the token started (justified);
   * `crash-before-call` its holder died before calling; `stalled-before-call` its holder was
   * stalled past the lease before calling (to the others, like a crash); `lost-grant` the
   * holder never learned it held the lease (the reply of its reserve or claim was lost);
   * `held` the holder got the lease and kept it without calling; `announced` no call, but its
   * holder had journaled one (`markCalling`) and then crashed, stalled or lost that reply before
   * calling: the one window the journal cannot tell from a call (allowed); `announced-not-called`
   * announced, and its holder lived on with the answer, unstalled, and never called (an engine defect);
   * `inherited-call` no call under the token, but the lease re-sent (resendAmbiguous) an earlier token's
   * ambiguous call, which may still reach the channel (allowed; no extra delivery allowed for it).
   */
  verdict: "call" | "announced" | "inherited-call" | "announced-not-called" | "crash-before-call" | "stalled-before-call" | "lost-grant" | "held";
  /** Made by the holder's own process while its lease was live in true time (a server clock step). */
  selfSteal?: boolean;
  detail: string;
}

/** An inbox record created by an admission that committed (the journal's receipt of it). */
export interface AdmissionRecord {
  id: string;
  chatId: string;
  /** Position among the run's committed admissions (the true order of receipt). */
  commit: number;
  time: number;
  /** The `receivedAt` the admitting process gave it (its wall clock): the journal's arrival order. */
  receivedAt: number;
  inc: string;
  /** A timer record (`scheduleTimer`): its deadline, wall-clock ms of the process that armed it. */
  timerAt?: number;
  /** Whether the admission's reply reached the engine (`lostBy` why not). */
  delivered: boolean;
  lostBy: LostBy;
}

/** One handler run that started (the engine's `botmesh.handle` span of a journaled record). */
export interface HandleStart {
  id: string;
  inc: string;
  /** True (virtual) time. */
  time: number;
  /** The starting process's wall clock then (virtual time plus its injected clock offset). */
  wall: number;
  /** Position among the run's handler starts. */
  seq: number;
  /** The record's `attempts` as the engine held it. */
  attempts: number;
}

/** A completion rejected as stale that reached the engine. */
export interface StaleRecord {
  kind: "inbox" | "outbox";
  id: string;
  token: number;
  time: number;
  inc: string;
  /** `false` when the rejected write was the caller's own, already committed (a lost reply). */
  genuine: boolean;
}

/** A violation found while the run went on (not only at the end). */
export interface LiveViolation {
  invariant: string;
  detail: string;
  time: number;
}

const tk = (id: string, token: number) => `${id}#${token}`;

/** The ground truth of one run. */
export class Ledger {
  calls: CallRecord[] = [];
  /**
   * Every provider call announced in the journal (a `markCalling` that committed, or a reservation written with its call announced), by `key#token`:
   * who, when, and whether its reply reached the engine (`pending` while it is on its way).
   */
  announced: Map<string, { inc: string; time: number; delivered: boolean; lostBy: LostBy; pending: boolean }> = new Map();
  /** `durability:resolved` events. */
  resolvedEvents: { key: string; inc: string; time: number; state: string; via: string }[] = [];
  /** Outcome writes (`markSent`, `markFailed`) started, by `key#token`: when (the first one). */
  outcomeStarted: Map<string, number> = new Map();
  acceptedCount = 0;
  /** outbox key#token → grant. */
  outLeases: Map<string, LeaseGrant> = new Map();
  /** inbox id#token → grant. */
  inLeases: Map<string, LeaseGrant> = new Map();
  /** Tokens whose lease ended by a committed outcome or an ambiguity transition. */
  outClosed: Set<string> = new Set();
  inClosed: Set<string> = new Set();
  /** Highest token seen per outbox key / inbox id. */
  outFence: Map<string, number> = new Map();
  inFence: Map<string, number> = new Map();
  /** inc|key|attempt → token (what a provider call of that incarnation runs under). */
  claimTokens: Map<string, number> = new Map();
  /** key → seq (per reservation; a discarded key reserved again gets a new one). */
  seqs: Map<string, number[]> = new Map();
  chatOf: Map<string, string> = new Map();
  ambiguities: AmbiguityRecord[] = [];
  ambiguousEvents: { key: string; inc: string; time: number; chatId?: string; step?: string }[] = [];
  /** Calls of step functions at the fake service (see {@link StepCallRecord}). */
  stepCalls: StepCallRecord[] = [];
  /** `inc|stepKey` → the step attempt (outbox key, token) the incarnation last leased for the step. */
  stepHeld: Map<string, { attempt: string; token: number }> = new Map();
  /** Step attempt outbox key → its step's key (every attempt reserved in the run). */
  stepOfAttempt: Map<string, string> = new Map();
  /** Step attempts' `markSent` writes that committed: the result (or the not-run mark) journaled, and when. */
  stepSettled: { attempt: string; token: number; messageId: string; inc: string; time: number }[] = [];
  /** `outbox-diverged` warnings: a key reused with different content (a handler rerun that made another reply). */
  diverged: { key: string; inc: string; time: number }[] = [];
  /** Inbox records created, by id (the first creation; ids are not reused in a run). */
  admissions: Map<string, AdmissionRecord> = new Map();
  /** Every handler run that started, in order. */
  handleStarts: HandleStart[] = [];
  /** Inbound ids whose handler ran (as the handler saw them). */
  handled: Set<string> = new Set();
  /** Ask plans whose handler saw its ask time out (in any incarnation, replays included). */
  timedOut: Set<string> = new Set();
  /** Conversations (by first message id) the bot ended and reported: a step failed on its last attempt. */
  conversationsEnded: Set<string> = new Set();
  deadEvents: { kind: "inbound" | "outbound" | "step"; id: string; inc: string; error: string }[] = [];
  /** Dead transitions the backend committed. */
  outDead: { key: string; token: number; delivered: boolean; lostBy: LostBy; error: string; inc: string; time: number }[] = [];
  inDead: { id: string; token: number; delivered: boolean; lostBy: LostBy; error: string; inc: string; time: number }[] = [];
  stale: StaleRecord[] = [];
  /** `stale-lease` warnings the engines emitted (each one counted in `staleLeases`). */
  staleWarnings: { kind: "inbox" | "outbox"; id: string; token: number | null; inc: string; time: number }[] = [];
  operatorRetried: Map<string, number> = new Map();
  operatorDiscarded: Map<string, number> = new Map();
  operatorReplayed: Map<string, number> = new Map();
  live: LiveViolation[] = [];
  /** Incarnations that died, and when. */
  diedAt: Map<string, number> = new Map();

  /** Outbox key → generation: bumped when a reservation creates the entry (again, after a discard). */
  generation: Map<string, number> = new Map();

  genOf(key: string): number {
    return this.generation.get(key) ?? 0;
  }

  /** A reservation created the entry of `key`: its tokens start over. */
  newGeneration(key: string): void {
    this.generation.set(key, this.genOf(key) + 1);
    this.outFence.delete(this.#g(key));
  }

  #g(key: string): string {
    return `${key}@${this.genOf(key)}`;
  }

  outFenceOf(key: string): number {
    return this.outFence.get(this.#g(key)) ?? 0;
  }

  grantOut(key: string, token: number, grant: LeaseGrant): void {
    this.outLeases.set(tk(this.#g(key), token), grant);
    if (token > this.outFenceOf(key)) this.outFence.set(this.#g(key), token);
  }

  grantIn(id: string, token: number, grant: LeaseGrant): void {
    this.inLeases.set(tk(id, token), grant);
    if (token > (this.inFence.get(id) ?? 0)) this.inFence.set(id, token);
  }

  outLease(key: string, token: number): LeaseGrant | undefined {
    return this.outLeases.get(tk(this.#g(key), token));
  }

  inLease(id: string, token: number): LeaseGrant | undefined {
    return this.inLeases.get(tk(id, token));
  }

  /** Outcome writes committed (markSent/markFailed, complete/fail), by id#token. */
  outRecorded: Set<string> = new Set();
  inRecorded: Set<string> = new Set();

  /** The lease of `token` ended: by an outcome write of its holder (`recorded`), or an ambiguity transition. */
  closeOut(key: string, token: number, recorded = false): void {
    this.outClosed.add(tk(this.#g(key), token));
    if (recorded) this.outRecorded.add(tk(this.#g(key), token));
  }

  isOutRecorded(key: string, token: number): boolean {
    return this.outRecorded.has(tk(this.#g(key), token));
  }

  isInRecorded(id: string, token: number): boolean {
    return this.inRecorded.has(tk(id, token));
  }

  closeIn(id: string, token: number, recorded = false): void {
    this.inClosed.add(tk(id, token));
    if (recorded) this.inRecorded.add(tk(id, token));
  }

  isOutClosed(key: string, token: number): boolean {
    return this.outClosed.has(tk(this.#g(key), token));
  }

  isInClosed(id: string, token: number): boolean {
    return this.inClosed.has(tk(id, token));
  }

  isDead(inc: string): boolean {
    return this.diedAt.has(inc);
  }

  /** Step calls under the attempt `key`'s `token` (of its current generation). */
  stepCallsOf(key: string, token: number): StepCallRecord[] {
    const gen = this.genOf(key);
    return this.stepCalls.filter((c) => c.attemptKey === key && c.token === token && c.gen === gen);
  }

  /** Provider calls for `key` under `token` (of its current generation). */
  callsOf(key: string, token: number): CallRecord[] {
    const gen = this.genOf(key);
    return this.calls.filter((c) => c.key === key && c.token === token && c.gen === gen);
  }

  bump(map: Map<string, number>, key: string): void {
    map.set(key, (map.get(key) ?? 0) + 1);
  }
}
