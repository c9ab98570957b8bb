/**
 * The end-of-run checks. Each failure names an invariant; the summary counts
 * failures by it.
 *
 * Metrics equalities (summed over every incarnation of every replica) that
 * are exact and checked here:
 * - `outboxAmbiguous` == `durability:ambiguous` events (the engine counts and emits together);
 * - `outboxDead` == outbound `durability:dead` events, `inboundDead` == inbound ones (same);
 * - `staleLeases` == `stale-lease` warnings (same code path).
 * Checked against the ground truth, not only against the engine's own events:
 * - every stale lease counted must stand for a `StaleLeaseError` the backend really returned
 *   to that incarnation for that token because someone else ended the lease, not its own
 *   earlier write whose reply was lost (`false-stale-lease`);
 * - a genuine stale lease needs a lease-losing fault in the run: a stall, a clock step, a
 *   long delay or a failed heartbeat (`stale-without-lease-loss`); a crash, a lost reply or a
 *   slow provider call (heartbeats cover it) are not;
 * - every entry left `unknown` and every record or entry left `dead` was reported by an
 *   event (`silent-unknown`, `silent-dead`), unless the process that wrote the transition
 *   died before its reply arrived (nothing can report it then).
 * - no transition is reported twice: per key, `durability:ambiguous` events <= ambiguity
 *   transitions, `durability:dead` events <= dead transitions (`reported-twice`).
 * Order, time and attempts, from the harness's own record of every handler run the engine starts
 * (a tracer: its `botmesh.handle` span opens where a run starts, after a timer's not-due check, never
 * for a record dead-lettered unread or cut off; runs of a dead process are not counted):
 * - `chat-order`: a chat's messages are ordered by the commit of their admissions in true time (the
 *   journal's receipt; timer records are not messages and are left out). For messages j before k, the
 *   first run of j must start before the first run of k. Any later run (a retry after a failure, a rerun
 *   after a crash or a lost lease, an operator's replay) may come after k's: once j has started, it never
 *   holds k back. Not judged: a j that never ran (see `dead-never-ran`), a j an operator replayed, and a
 *   pair whose `receivedAt` (the admitting processes' wall clocks, the journal's arrival order) is the
 *   other way round (a wall-clock step between two replicas). The detail says when j's admission
 *   committed with its reply lost (the engine answered the channel "rejected" and holds no job for it).
 * - `timer-early`: a timer record's deadline is `$timer.at`, wall-clock ms of the process that armed it.
 *   A run of it that starts at true time t on a process whose injected clock offset is then o fires early
 *   when t + o < at: the only clock the firing process has is its own, so it is judged by it (with no
 *   clock step, t < at). The arming process's offset is not subtracted: a process whose clock runs ahead
 *   may fire a timer earlier in true time, never earlier on its own clock.
 * - `dead-never-ran`: an inbox record left `dead` whose handler never started is a failure (an unreadable
 *   message, dead-lettered unread by design, aside); a poison record whose runs were cut off is explained
 *   only once its handler started at least once.
 * - `silent-resend`: every accepted provider call of a key after its first (by start) needs a
 *   `durability:ambiguous` event for that key at or before the call's start, unless an operator retried
 *   or discarded the key.
 * Durable steps (`ctx.step`, see `service.ts`): a handler of a message with a step first runs step "svc"
 * (key `<id>:step:svc`), whose function calls the world's fake service, and every reply carries the
 * result it got (`[svc=<result>]`). The service records every call (its attempt and token, whether it took
 * effect, the result `svc-<n>` it returned). A step's attempts are outbox entries: the send checks above
 * skip what is a send's own (channel acceptance, message ids, provider-call explanations); a step's
 * dead-letter is reported with kind "step" (counted in `reported-twice` and `silent-dead` under that
 * kind, and never in `outboxDead`). Every check below is skipped for a step one of whose attempts an
 * operator retried or discarded (that lets it run again, by the operator's choice):
 * - `step-effect-twice`: a step that is not idempotent takes effect at most once. An interruption whose
 *   outcome is unknown (reported `durability:ambiguous` with `step`) never lets it run again on its own:
 *   stricter than "at most once unless reported ambiguous", as the engine holds such a step.
 * - `step-repeat-unexplained`: an idempotent step is called again after an earlier call took effect only
 *   when that call's outcome was lost to the engine: the call timed out (maybe delivered; each call is an
 *   attempt of its own, so the retry is the next attempt), or the call's attempt was made `unknown` (an ambiguity
 *   transition of its token: its lease lost after the call was announced, by a crash, a stall, lost
 *   heartbeats) before the new call started. Both are what a lost lease or an ambiguity report means.
 * - `step-call-after-result`: no call of a step starts once a result of it was journaled (a rerun gets
 *   the result back instead).
 * - `step-not-run-called`: an attempt settled as never run (`STEP_NOT_RUN`, when written or in the end)
 *   had no call under it that took effect (else the next attempt repeats the effect).
 * - `step-result-twice`, `step-result-unexplained`: in the end at most one attempt of a step holds a
 *   result, and every result journaled is one the service returned to a call of that attempt.
 * - `step-reply-result`, `step-results-reached-user`: the replies that reached the channel carry one
 *   result per step, the one journaled; `handler-diverged`: no handler rerun makes a reply (a key) with
 *   content other than the journaled one (it got another result of its step).
 * - `step-done-without-result`: a message that is done has its step's result journaled.
 * - `step-ambiguous-event`, `step-ambiguous-not-held`: a `durability:ambiguous` event of a step's attempt
 *   names the step and the message's chat; its message ends dead-lettered (held for an operator) unless
 *   the step was settled after all (a late outcome, an idempotent step's next attempt).
 * - `unexplained-dead` for a dead step attempt: a failed call of its own, and a permanent error or more
 *   failed calls of the step than its retries.
 * Live: `step-call-without-lease`, `step-call-under-lost-lease` (a call under an attempt's token that had
 * ended or was superseded), `step-key` (the function got the step's key as `idempotencyKey`).
 * Not exact, so not checked: `inboundJournaled`/`outboxJournaled` (an admission or
 * reservation whose reply was lost is journaled but counted by nobody), `outboxDeduped`,
 * `inboundDuplicates`, `inboundReplayed`, `outboxRetried`, `outboxDeferred`.
 *
 * @module
 */
import type { InboundRecord, OutboxEntry } from "../../contract.ts";
import type { DurabilityMetrics } from "../../engine.ts";
import type { SimChannel } from "./channel.ts";
import type { AdmissionRecord, HandleStart, LostBy, StepCallRecord } from "./ledger.ts";
import { type Scenario, stepKeyOf } from "./scenario.ts";
import { STEP_NOT_RUN, stepOf, stepResultOf } from "../../engine/steps.ts";
import type { World } from "./world.ts";
import { SIM_EPOCH } from "./scheduler.ts";

/** One violated invariant. */
export interface SimFailure {
  invariant: string;
  detail: string;
}

/** What the checks look at. */
export interface CheckInput {
  world: World;
  channel: SimChannel;
  scenario: Scenario;
  inbox: InboundRecord[];
  outbox: OutboxEntry[];
  metrics: DurabilityMetrics;
  strictAmbiguity: boolean;
  /** Count a duplicate send after an accepted-then-timeout call as a failure. */
  strictTimeouts: boolean;
  /** Allowed anomalies, counted. */
  notes: { timeoutDuplicates: number };
}

const SETTLED_OUT = new Set(["sent", "dead", "unknown"]);
const SETTLED_IN = new Set(["done", "dead"]);
/** Handler failures the scenario causes on purpose or through injected faults. */
const EXPLAINED_INBOUND =
  /sim handler failure|ConnectionRefused|ConnectionReset|Processing was cut off|journal did not confirm|Step "svc"/;

/**
 * Check every invariant.
 * @param input the run's state
 * @returns the failures (empty when all hold)
 */
export function checkInvariants(input: CheckInput): SimFailure[] {
  const { world, channel, scenario, inbox, outbox, metrics } = input;
  const ledger = world.ledger;
  const failures: SimFailure[] = [];
  const fail = (invariant: string, detail: string) => failures.push({ invariant, detail });
  const at = (t: number) => `${((t - SIM_EPOCH) / 1000).toFixed(3)}s`;

  for (const v of ledger.live) fail(v.invariant, `at ${at(v.time)}: ${v.detail}`);

  // Inbox: nothing acknowledged is lost, everything admitted settles.
  const records = new Map(inbox.map((r) => [r.id, r]));
  for (const m of scenario.messages) {
    if (m.malformed) {
      if (!channel.refused.has(m.id)) fail("malformed-id", `message id ${JSON.stringify(m.id)} is not well-formed Unicode but was not refused with a TypeError`);
      if (ledger.handled.has(m.id)) fail("malformed-id", `message id ${JSON.stringify(m.id)} is not well-formed Unicode but was handled`);
      continue;
    }
    const record = inbox.find((r) => r.id === m.id);
    if (channel.acked.has(m.id) && !ledger.handled.has(m.id) && record?.state !== "dead") {
      fail("never-handled", `message ${JSON.stringify(m.id)} was acknowledged but its handler never ran (taken for another message?)`);
    }
    if (!channel.acked.has(m.id)) {
      fail("not-settled", `message ${m.id} was never acknowledged to the channel`);
      continue;
    }
    if (!records.has(m.id)) fail("inbound-lost", `message ${m.id} was acknowledged but is not in the journal`);
    // (A conversation the bot ended and reported, a step of it having failed on the last attempt of the
    // record that ran it, may have no timer and no timeout reply.)
    if (m.askTimeoutMs !== undefined && record?.state === "done" && !ledger.conversationsEnded.has(m.id)) {
      // Its handler asked (the step is done only once the ask and its timer are recorded): the timeout
      // fired, as a journaled timer of its own, and its step's reply was made. A timer record may end
      // dead like any record (its step failed on every attempt): the dead-letter checks below cover it.
      const timer = records.get(`${m.id}:t1`);
      const reply = `${m.id}:t1:1`;
      // An ask whose timer could not be journaled (its step failed there) and whose deadline passed before
      // the step's retry is timed out by that retry, in line, with no timer record: not lost if it fired.
      const firedInLine = timer === undefined && ledger.timedOut.has(m.id) && outbox.some((e) => e.key === reply);
      if (firedInLine) {
        // checked: the handler saw the timeout and its reply is journaled
      } else if (timer?.state !== "done" && timer?.state !== "dead") {
        fail("ask-timeout-lost", `${m.id} asked, but its timeout record is ${timer ? timer.state : "missing"}`);
      } else if (timer.state === "done") {
        if (!ledger.timedOut.has(m.id)) fail("ask-timeout-lost", `${m.id} asked, but its handler never saw the ask time out`);
        if (!outbox.some((e) => e.key === reply) && !ledger.operatorDiscarded.has(reply)) {
          fail("ask-timeout-lost", `${m.id} timed out, but its reply ${reply} is not in the outbox (nor discarded by an operator)`);
        }
      }
    }
  }
  for (const r of inbox) {
    if (!SETTLED_IN.has(r.state)) fail("not-settled", `inbox record ${r.id} is ${r.state}`);
  }
  for (const e of outbox) {
    if (!SETTLED_OUT.has(e.state)) fail("not-settled", `outbox entry ${e.key} is ${e.state}`);
  }

  // Effectively once per key.
  const acceptedBy = new Map<string, number>();
  for (const c of ledger.calls) if (c.accepted) acceptedBy.set(c.key, (acceptedBy.get(c.key) ?? 0) + 1);
  const resend = scenario.outbox.onAmbiguous === "resend";
  for (const [key, n] of acceptedBy) {
    // With 'resend', each ambiguity after a real provider call allows one more delivery; a false one
    // (no call had started) allows none: a second delivery then means a call under a lost lease.
    // An ambiguity the holder's own process made of its live lease allows nothing: it must carry on.
    const ambiguous = ledger.ambiguities.filter((a) => a.key === key && a.verdict === "call" && !a.selfSteal).length;
    const timeouts = ledger.calls.filter((c) => c.key === key && c.accepted && c.outcome.startsWith("provider-timeout")).length;
    // A call that timed out (maybe delivered) is held as unknown with 'hold'; with 'resend' it is
    // reported and sent again, so each allows one more delivery there.
    const allowance = 1 + (ledger.operatorRetried.get(key) ?? 0) + (ledger.operatorDiscarded.get(key) ?? 0) +
      (resend ? ambiguous + timeouts : 0);
    if (n > allowance && n <= allowance + timeouts && !input.strictTimeouts) {
      // Only with --no-strict-timeouts (the engine before timeouts were held as ambiguous).
      input.notes.timeoutDuplicates += n - allowance;
    } else if (n > allowance) {
      const calls = ledger.calls.filter((c) => c.key === key && c.accepted).map((c) => `#${c.n} by ${c.inc} t${c.token} at ${at(c.start)}`);
      fail("duplicate-send", `${key} reached the channel ${n} times (allowed ${allowance}): ${calls.join("; ")}`);
    }
  }

  // Ambiguity only when a call may really have happened.
  for (const a of ledger.ambiguities) {
    const text = `${a.key} made ambiguous by ${a.by} at ${at(a.time)}: ${a.detail}`;
    // No call under the token, and none announced in the journal (markCalling): the send was certainly
    // never made, so recovery must send it instead of leaving it to an operator. An announced call that
    // did not happen (a crash right after the announcement) is the one window the journal cannot tell.
    if (a.verdict !== "call" && a.verdict !== "announced" && a.verdict !== "inherited-call" && input.strictAmbiguity) {
      fail(`ambiguity-${a.verdict}`, text);
    }
  }

  // The first start of each record's handler (the harness's tracer sees every run the engine starts).
  const firstStart = new Map<string, HandleStart>();
  for (const s of ledger.handleStarts) if (!firstStart.has(s.id)) firstStart.set(s.id, s);

  // Every final state is explained and reported.
  const ambiguousEventKeys = new Set(ledger.ambiguousEvents.map((e) => e.key));
  const deadEventIds = new Set(ledger.deadEvents.map((e) => `${e.kind}:${e.id}`));
  // Excused: the writer died before it could learn that its write landed (a crash after the commit,
  // or a lost reply and a crash before its check of the record).
  const diedUnaware = (t: { lostBy: LostBy; inc?: string; time?: number } | undefined) => {
    if (t === undefined) return false;
    if (t.lostBy === "crash") return true;
    if (t.lostBy !== "lost-reply" || t.inc === undefined || t.time === undefined) return false;
    const died = ledger.diedAt.get(t.inc);
    return died !== undefined && died - t.time <= world.leaseMs;
  };
  for (const e of outbox) {
    // A step's attempt: no provider call; its own checks are in checkSteps.
    const isStep = stepOf(e) !== undefined;
    if (e.state === "sent" && !isStep && !acceptedBy.has(e.key)) fail("sent-not-accepted", `${e.key} is sent but the channel never accepted it`);
    if (e.state === "sent" && !isStep) {
      // Its message id is that of a call of this key the channel accepted (also when a status or confirm resolved it).
      const n = /^msg-(\d+)$/.exec(e.messageId ?? "")?.[1];
      const call = n === undefined ? undefined : ledger.calls[Number(n) - 1];
      if (!call || call.key !== e.key || !call.accepted) {
        fail("sent-wrong-message-id", `${e.key} is sent as ${JSON.stringify(e.messageId)}, not the id of an accepted call of that key`);
      }
    }
    if (e.state === "unknown") {
      const lastAmbiguity = ledger.ambiguities.filter((a) => a.key === e.key).at(-1);
      // Excused: the process died before it could finish: its call, or the write of its outcome, was
      // still under way at its death (then an unknown, reported entry is right).
      const died = lastAmbiguity ? ledger.diedAt.get(lastAmbiguity.by) : undefined;
      const cutShort = lastAmbiguity !== undefined && died !== undefined && (
        ledger.calls.some((c) => c.key === e.key && c.inc === lastAmbiguity.by && (c.end === null || c.end >= died)) ||
        ledger.stepCalls.some((c) => c.attemptKey === e.key && c.inc === lastAmbiguity.by && (c.end === null || c.end >= died)) ||
        ((ledger.outcomeStarted.get(`${e.key}#${lastAmbiguity.token}`) ?? Infinity) <= died &&
          !ledger.isOutRecorded(e.key, lastAmbiguity.token))
      );
      if (lastAmbiguity?.selfSteal && !cutShort) {
        fail("self-steal", `${e.key} is unknown: its own process made its live lease ambiguous (${lastAmbiguity.detail}) instead of finishing its send`);
      }
      if (!ledger.ambiguities.some((a) => a.key === e.key)) fail("unexplained-unknown", `${e.key} is unknown without an ambiguity transition`);
      // Excused: the process that made the transition died before it could see it (nothing can report it then).
      const last = ledger.ambiguities.filter((a) => a.key === e.key).at(-1);
      if (!ambiguousEventKeys.has(e.key) && !diedUnaware(last && { lostBy: last.lostBy, inc: last.by, time: last.time })) {
        fail("silent-unknown", `${e.key} is unknown but no durability:ambiguous event reported it (the transition's reply was ${last?.lostBy ?? "delivered"})`);
      }
    }
    if (e.state === "dead") {
      const last = [...ledger.outDead].reverse().find((d) => d.key === e.key);
      if (!deadEventIds.has(`${isStep ? "step" : "outbound"}:${e.key}`) && !diedUnaware(last)) {
        fail("silent-dead", `outbox entry ${e.key} is dead but no durability:dead event reported it (the dead write's reply was ${last?.lostBy ?? "delivered"})`);
      }
      if (isStep) continue; // explained in checkSteps
      const failedCalls = last ? ledger.callsOf(e.key, last.token).filter((c) => c.outcome !== "ok" && c.end !== null) : [];
      const call = failedCalls.at(-1);
      const explained = failedCalls.some((c) => c.outcome.startsWith("provider-permanent")) ||
        (call !== undefined && e.attempts > scenario.outbox.retries);
      if (!explained) {
        fail(
          "unexplained-dead",
          `outbox entry ${e.key} is dead (attempts ${e.attempts}, retries ${scenario.outbox.retries}, error ${e.error}); last call: ${
            call ? `#${call.n} ${call.outcome}` : "no failed call under the dead token"
          }`,
        );
      }
    }
  }
  for (const r of inbox) {
    if (r.state !== "dead") continue;
    const last = [...ledger.inDead].reverse().find((d) => d.id === r.id);
    if (!deadEventIds.has(`inbound:${r.id}`) && !diedUnaware(last)) {
      fail("silent-dead", `inbox record ${r.id} is dead but no durability:dead event reported it (the dead write's reply was ${last?.lostBy ?? "delivered"})`);
    }
    const unreadable = /^Unreadable /.test(r.error ?? "");
    if (!unreadable && !firstStart.has(r.id)) {
      const claims = [...ledger.inLeases.keys()].filter((k) => k.startsWith(`${r.id}#`)).length;
      fail("dead-never-ran", `inbox record ${r.id} is dead (${r.error}) but its handler never started (${claims} claim(s), attempts ${r.attempts})`);
    } else if (!EXPLAINED_INBOUND.test(r.error ?? "")) {
      fail("unexplained-dead", `inbox record ${r.id} is dead: ${r.error}`);
    }
  }

  // Each chat's messages first start their handlers in receipt order.
  const received = new Map<string, AdmissionRecord[]>();
  for (const a of ledger.admissions.values()) {
    if (a.timerAt !== undefined) continue;
    const list = received.get(a.chatId) ?? [];
    list.push(a);
    received.set(a.chatId, list);
  }
  for (const [chat, list] of received) {
    list.sort((a, b) => a.commit - b.commit);
    check: for (let k = 1; k < list.length; k++) {
      const later = list[k]!;
      const laterStart = firstStart.get(later.id);
      if (laterStart === undefined) continue;
      for (let j = 0; j < k; j++) {
        const earlier = list[j]!;
        const earlierStart = firstStart.get(earlier.id);
        if (earlierStart === undefined || earlierStart.seq < laterStart.seq) continue;
        // The journal's arrival order is the admitting processes' wall clocks: a clock step may put them the other way round.
        if (earlier.receivedAt > later.receivedAt || ledger.operatorReplayed.has(earlier.id)) continue;
        fail(
          "chat-order",
          `chat ${chat}: ${earlier.id} (received ${j + 1}${ordinal(j + 1)}, at ${at(earlier.time)} by ${earlier.inc}) first started at ${
            at(earlierStart.time)
          } on ${earlierStart.inc}, after ${later.id} (received ${k + 1}${ordinal(k + 1)}, at ${at(later.time)} by ${later.inc}) had started at ${
            at(laterStart.time)
          } on ${laterStart.inc}${
            earlier.lostBy === "lost-reply" ? ` (${earlier.id}'s admission committed, leased to ${earlier.inc}, but its reply was lost)` : ""
          }`,
        );
        break check;
      }
    }
  }

  // A timer never fires before its deadline on the clock of the process that fires it.
  const early = new Set<string>();
  for (const s of ledger.handleStarts) {
    const deadline = ledger.admissions.get(s.id)?.timerAt;
    if (deadline === undefined || s.wall >= deadline || early.has(s.id)) continue;
    early.add(s.id);
    fail(
      "timer-early",
      `timer ${s.id} (deadline ${at(deadline)} wall) fired on ${s.inc} at ${at(s.time)} true time, its clock reading ${at(s.wall)} (offset ${
        s.wall - s.time
      }ms): ${deadline - s.wall}ms early`,
    );
  }

  // Every second copy of a send that reached the channel was reported ambiguous before it went out.
  for (const [key, n] of acceptedBy) {
    if (n < 2 || ledger.operatorRetried.has(key) || ledger.operatorDiscarded.has(key)) continue;
    const calls = ledger.calls.filter((c) => c.key === key && c.accepted).sort((a, b) => a.start - b.start);
    if (!input.strictTimeouts && calls.some((c) => c.outcome.startsWith("provider-timeout"))) continue;
    for (const c of calls.slice(1)) {
      if (ledger.ambiguousEvents.some((e) => e.key === key && e.time <= c.start)) continue;
      fail(
        "silent-resend",
        `${key} reached the channel again by call #${c.n} (${c.inc} at ${at(c.start)}) with no durability:ambiguous event for it before (first copy: call #${
          calls[0]!.n
        } by ${calls[0]!.inc} at ${at(calls[0]!.start)}; events: ${ledger.ambiguousEvents.filter((e) => e.key === key).map((e) => `${e.inc} at ${at(e.time)}`).join(", ") || "none"})`,
      );
      break;
    }
  }

  // Replies of one chat leave in order (by journal seq).
  const byChat = new Map<string, { key: string; seq: number; first: number }[]>();
  const firstAccepted = new Map<string, number>();
  for (const c of ledger.calls) {
    if (c.accepted && !firstAccepted.has(c.key)) firstAccepted.set(c.key, c.acceptedIndex!);
  }
  for (const [key, seqs] of ledger.seqs) {
    // Excepted: keys an operator touched, and ambiguous ones (a call of a dead or cut-off sender may land any time).
    if (seqs.length !== 1 || ledger.operatorRetried.has(key) || ledger.operatorDiscarded.has(key)) continue;
    if (ledger.ambiguities.some((a) => a.key === key)) continue;
    const first = firstAccepted.get(key);
    if (first === undefined) continue;
    const chat = ledger.chatOf.get(key)!;
    const list = byChat.get(chat) ?? [];
    list.push({ key, seq: seqs[0]!, first });
    byChat.set(chat, list);
  }
  for (const [chat, list] of byChat) {
    list.sort((a, b) => a.seq - b.seq);
    for (let i = 1; i < list.length; i++) {
      if (list[i]!.first < list[i - 1]!.first) {
        fail("order", `chat ${chat}: ${list[i]!.key} (seq ${list[i]!.seq}) reached the channel before ${list[i - 1]!.key} (seq ${list[i - 1]!.seq})`);
        break;
      }
    }
  }

  // Each transition is reported at most once (else the counters count it twice).
  const perKey = (keys: string[]) => {
    const m = new Map<string, number>();
    for (const k of keys) m.set(k, (m.get(k) ?? 0) + 1);
    return m;
  };
  // With 'resend' a timed-out call is reported and retried (no unknown state): it counts as a transition.
  const timedOut = resend
    ? ledger.calls.filter((c) => c.outcome.startsWith("provider-timeout")).map((c) => c.key)
    : [];
  const transitions = perKey([...ledger.ambiguities.map((a) => a.key), ...timedOut]);
  // A scan whose reply was lost is asked again by its request id: its transitions are reported from its
  // answer, once, like any scan's. Every repeat is a failure.
  for (const [key, n] of perKey(ledger.ambiguousEvents.map((e) => e.key))) {
    if (n > (transitions.get(key) ?? 0)) {
      fail("reported-twice", `${key}: ${n} durability:ambiguous events for ${transitions.get(key) ?? 0} ambiguity transition(s) (by ${
        ledger.ambiguousEvents.filter((e) => e.key === key).map((e) => `${e.inc} at ${at(e.time)}`).join(", ")
      })`);
    }
  }
  // A step attempt's dead-letter is reported with kind "step" (and not counted in `outboxDead`).
  const deadTransitions = perKey([
    ...ledger.outDead.map((d) => `${ledger.stepOfAttempt.has(d.key) ? "step" : "outbound"}:${d.key}`),
    ...ledger.inDead.map((d) => `inbound:${d.id}`),
  ]);
  for (const [id, n] of perKey(ledger.deadEvents.map((e) => `${e.kind}:${e.id}`))) {
    if (n > (deadTransitions.get(id) ?? 0)) {
      fail("reported-twice", `${id}: ${n} durability:dead events for ${deadTransitions.get(id) ?? 0} dead transition(s)`);
    }
  }

  checkSteps(input, fail, at);

  // Metrics against what happened.
  const events = {
    ambiguous: ledger.ambiguousEvents.length,
    outDead: ledger.deadEvents.filter((e) => e.kind === "outbound").length,
    inDead: ledger.deadEvents.filter((e) => e.kind === "inbound").length,
  };
  if (metrics.outboxAmbiguous !== events.ambiguous) {
    fail("metrics", `outboxAmbiguous ${metrics.outboxAmbiguous} != ${events.ambiguous} durability:ambiguous events`);
  }
  if (metrics.outboxDead !== events.outDead) fail("metrics", `outboxDead ${metrics.outboxDead} != ${events.outDead} outbound dead events`);
  if (metrics.outboxResolved !== ledger.resolvedEvents.length) {
    fail("metrics", `outboxResolved ${metrics.outboxResolved} != ${ledger.resolvedEvents.length} durability:resolved events`);
  }
  if (metrics.inboundDead !== events.inDead) fail("metrics", `inboundDead ${metrics.inboundDead} != ${events.inDead} inbound dead events`);
  if (metrics.staleLeases !== ledger.staleWarnings.length) {
    fail("metrics", `staleLeases ${metrics.staleLeases} != ${ledger.staleWarnings.length} stale-lease warnings`);
  }
  // Each counted stale lease must stand for a rejection the backend really returned to that
  // incarnation because someone else took the lease (not its own earlier write, a lost reply).
  let genuine = 0;
  let first: (typeof ledger.staleWarnings)[number] | undefined;
  for (const w of ledger.staleWarnings) {
    const rejections = ledger.stale.filter((s) =>
      s.kind === w.kind && s.id === w.id && s.inc === w.inc && (w.token === null || s.token === w.token)
    );
    if (rejections.some((s) => s.genuine)) {
      genuine++;
      first ??= w;
      continue;
    }
    fail(
      "false-stale-lease",
      `${w.kind} ${w.id} token ${w.token}: ${w.inc} counted a stale lease at ${at(w.time)}, but ${
        rejections.length > 0
          ? "the lease was ended by its own earlier write (a lost reply)"
          : "the backend returned it no stale-lease rejection for that token"
      }`,
    );
  }
  if (first !== undefined && world.leaseThreats === 0) {
    fail(
      "stale-without-lease-loss",
      `${genuine} genuine stale lease(s) (first: ${first.kind} ${first.id} token ${first.token} at ${
        at(first.time)
      } by ${first.inc}) in a run without a stall, clock step, long delay or failed heartbeat`,
    );
  }
  return failures;
}

function ordinal(n: number): string {
  return n % 100 >= 11 && n % 100 <= 13 ? "th" : ["th", "st", "nd", "rd"][n % 10] ?? "th";
}

/** The step checks (see the module comment, "Durable steps"). */
function checkSteps(input: CheckInput, fail: (invariant: string, detail: string) => void, at: (t: number) => string): void {
  const { world, scenario, inbox, outbox } = input;
  const ledger = world.ledger;
  const retriesDefault = scenario.outbox.retries;
  const callText = (c: StepCallRecord) =>
    `#${c.n} by ${c.inc} (${c.attemptKey ?? "?"} t${c.token ?? "?"}) at ${at(c.start)} ${c.outcome}${c.effect ? ", took effect" : ""}`;
  const attemptsOf = (key: string) => [...ledger.stepOfAttempt].filter(([, k]) => k === key).map(([a]) => a);
  // An operator retried or discarded one of its attempts: the step may run again, by the operator's choice.
  const touched = (key: string) => attemptsOf(key).some((a) => ledger.operatorRetried.has(a) || ledger.operatorDiscarded.has(a));
  /** The results journaled in the end (state `sent`, not the not-run mark), by step key. */
  const journaled = new Map<string, { attempt: string; value: string }[]>();
  for (const e of outbox) {
    const step = stepOf(e);
    if (step === undefined) continue;
    const result = e.state === "sent" ? stepResultOf(e.messageId) : undefined;
    if (result !== undefined) {
      const list = journaled.get(step.key) ?? [];
      list.push({ attempt: e.key, value: JSON.stringify(result.value) });
      journaled.set(step.key, list);
    }
    if (e.state === "dead") {
      // Dead only for a failure the step gives up on: a permanent error, or its retries spent.
      const plan = scenario.messages.find((m) => stepKeyOf(m) === step.key);
      const retries = plan?.step?.retries ?? retriesDefault;
      const gen = ledger.genOf(e.key);
      // Each call is an attempt of its own: the step's failed calls (of every attempt) count against its retries.
      const failed = ledger.stepCalls.filter((c) => c.attemptKey === e.key && c.gen === gen && c.end !== null && c.outcome !== "ok" && !c.outcome.startsWith("crash"));
      const spent = ledger.stepCalls.filter((c) => c.stepKey === step.key && c.end !== null && c.outcome !== "ok" && !c.outcome.startsWith("crash")).length;
      if (failed.length === 0 || (!failed.some((c) => c.outcome === "provider-permanent") && spent <= retries)) {
        fail("unexplained-dead", `step attempt ${e.key} is dead (${e.error}) after ${failed.length} failed call(s) of its own, ${spent} of the step's, retries ${retries}`);
      }
    }
  }

  for (const plan of scenario.messages) {
    if (plan.step === undefined || plan.malformed) continue;
    const key = stepKeyOf(plan);
    const { idempotent } = plan.step;
    const results = journaled.get(key) ?? [];
    if (results.length > 1) {
      fail("step-result-twice", `step ${key} has results journaled by ${results.length} attempts: ${results.map((r) => `${r.attempt} ${r.value}`).join(", ")}`);
    }
    const calls = ledger.stepCalls.filter((c) => c.stepKey === key);
    const settled = ledger.stepSettled.filter((s) => ledger.stepOfAttempt.get(s.attempt) === key);
    // The journaled result is one the service returned to a call of that attempt.
    for (const s of settled) {
      if (stepResultOf(s.messageId) === undefined) continue; // not run, or superseded: no result
      const value = stepResultOf(s.messageId)?.value;
      if (!calls.some((c) => c.attemptKey === s.attempt && c.result !== null && c.result === value)) {
        fail("step-result-unexplained", `step ${key}: attempt ${s.attempt} journaled ${s.messageId}, a result no call of that attempt returned`);
      }
    }
    // An attempt settled as never run must never have run: the next attempt would run the step again.
    // (Each settlement seen, and the attempts left so in the end.)
    const notRun = [
      ...settled.filter((s) => s.messageId === STEP_NOT_RUN).map((s) => ({ attempt: s.attempt, time: s.time, by: `by ${s.inc} at ${at(s.time)}` })),
      ...outbox.filter((e) => stepOf(e)?.key === key && e.state === "sent" && e.messageId === STEP_NOT_RUN)
        .map((e) => ({ attempt: e.key, time: Infinity, by: "in the end" })),
    ];
    for (const s of notRun) {
      const gen = ledger.genOf(s.attempt);
      const ran = calls.filter((c) => c.attemptKey === s.attempt && c.gen === gen && c.effect && c.start <= s.time);
      if (ran.length > 0 && !touched(key)) {
        fail("step-not-run-called", `step ${key}: attempt ${s.attempt} was settled as never run (${s.by}), but call ${callText(ran[0]!)} had taken effect`);
        break;
      }
    }
    const inbound = inbox.find((r) => r.id === plan.id);
    // A done message's handler went past its step: the step's result is journaled.
    if (inbound?.state === "done" && results.length === 0 && !touched(key)) {
      fail("step-done-without-result", `message ${plan.id} is done but its step ${key} has no journaled result (calls: ${calls.map(callText).join("; ") || "none"})`);
    }
    // Replies carry the journaled result, one result per step.
    const carried = new Set<string>();
    for (const c of ledger.calls) {
      if (!c.accepted || typeof c.content !== "string") continue;
      const m = /^reply \d+ to (\S+) \[svc=(.*)\]$/.exec(c.content);
      if (m === null || m[1] !== plan.id) continue;
      carried.add(m[2]!);
    }
    if (!touched(key)) {
      if (carried.size > 1) fail("step-results-reached-user", `replies of ${plan.id} carried ${carried.size} different results of step ${key}: ${[...carried].join(", ")}`);
      for (const r of carried) {
        if (results.length === 0 || results.every((j) => j.value !== JSON.stringify(r))) {
          fail("step-reply-result", `a reply of ${plan.id} carried ${r}, not the result journaled for step ${key} (${results.map((j) => j.value).join(", ") || "none"})`);
          break;
        }
      }
    }
    if (touched(key)) continue;
    // No call of a step starts once a result of it was journaled: a rerun gets the result back.
    const resultAt = settled.filter((s) => stepResultOf(s.messageId) !== undefined).map((s) => s.time).sort((a, b) => a - b)[0];
    const late = resultAt === undefined ? undefined : calls.find((c) => c.start >= resultAt);
    if (late !== undefined) {
      fail("step-call-after-result", `step ${key} was called again (${callText(late)}) after its result was journaled at ${at(resultAt!)}`);
    }
    const effects = calls.filter((c) => c.effect);
    if (!idempotent) {
      // A step that is not idempotent takes effect at most once: an interruption whose outcome is unknown
      // is held and reported, never run again but by an operator.
      if (effects.length > 1) {
        const reports = ledger.ambiguousEvents.filter((e) => ledger.stepOfAttempt.get(e.key) === key).map((e) => `${e.key} by ${e.inc} at ${at(e.time)}`);
        fail("step-effect-twice", `step ${key} (not idempotent) took effect ${effects.length} times: ${effects.map(callText).join("; ")} (ambiguity reports: ${reports.join(", ") || "none"})`);
      }
    } else {
      // An idempotent step runs again after an earlier call took effect only when that call's outcome was
      // lost: it timed out and the same attempt retries it, or its attempt was made unknown (its lease
      // lost after the call was announced: a crash, a stall, a lost heartbeat) before the new call.
      for (const c2 of calls) {
        const c1 = effects.filter((c) => c.start < c2.start).at(-1);
        if (c1 === undefined) continue;
        // (Each call is an attempt of its own: a timed-out call's retry is the next attempt.)
        const retried = c1.outcome === "provider-timeout";
        const lost = ledger.ambiguities.some((a) => a.key === c1.attemptKey && a.token === c1.token && a.time <= c2.start);
        if (!retried && !lost) {
          fail("step-repeat-unexplained", `idempotent step ${key} was called again (${callText(c2)}) after call ${callText(c1)} took effect, with no timeout retried nor its attempt made unknown before`);
          break;
        }
      }
    }
  }

  // A step reported ambiguous names itself and its message's chat, and its message is dead-lettered
  // (held for an operator), unless the step was settled after all (a late outcome, an idempotent step's
  // next attempt) or an operator took it up.
  for (const e of ledger.ambiguousEvents) {
    const key = ledger.stepOfAttempt.get(e.key);
    if (key === undefined) continue;
    const plan = scenario.messages.find((m) => m.step !== undefined && stepKeyOf(m) === key);
    if (plan === undefined) continue;
    if (e.step !== "svc" || e.chatId !== plan.chatId) {
      fail("step-ambiguous-event", `durability:ambiguous for step attempt ${e.key} by ${e.inc} named step ${JSON.stringify(e.step)} in chat ${e.chatId}, not "svc" in ${plan.chatId}`);
    }
    const record = inbox.find((r) => r.id === plan.id);
    if (record?.state !== "dead" && !journaled.has(key) && !touched(key)) {
      fail("step-ambiguous-not-held", `step attempt ${e.key} was reported ambiguous (${e.inc} at ${at(e.time)}), but message ${plan.id} is ${record?.state ?? "missing"} and the step has no result`);
    }
  }

  // A handler that ran again made the same replies (with steps: it got the same result back).
  for (const d of ledger.diverged) {
    const id = d.key.replace(/^enq:/, "").replace(/:\d+$/, "");
    const plan = scenario.messages.find((m) => m.id === id);
    if (plan?.step !== undefined && touched(stepKeyOf(plan))) continue;
    fail("handler-diverged", `${d.inc} made ${d.key} again at ${at(d.time)} with content different from the journaled one`);
  }
}
