/**
 * Inbound messages and timers: each message journaled (leased to this process) before it is dispatched,
 * duplicates and redeliveries told apart, late and lost admissions taken up in their place in the chat;
 * a run journaled as it begins, its handler run under its lease, its outcome recorded (done, a retry with
 * backoff, dead); a timer armed as `scheduled` and fired once, never before its deadline.
 *
 * @module
 */
import { retryDelay } from "../backoff.ts";
import { BoundedMap, BoundedSet } from "../bounded_map.ts";
import { sleep } from "../clock.ts";
import { encodeContent } from "../content.ts";
import { damagedStorageOf, type InboundRecord, type JsonValue } from "../contract.ts";
import type { Deadlines } from "../deadlines.ts";
import { errorDetail, errorText, isProcessDeath } from "../errors.ts";
import { type Observer, TRACE_FIELD } from "../observe.ts";
import type { AdmitResult, InboundMessage } from "../provider.ts";
import { TIMER_STATE, WRITER_TOKEN } from "../rules.ts";
import { runOf, TIMER_FIELD, timerOf } from "./jobs.ts";
import type { HeldLease } from "./leases.ts";
import type { Outcomes } from "./outcomes.ts";
import { isStepOutcomeError } from "./steps.ts";
import { asError, type EngineCore, type InboundJob } from "./types.ts";

/** Inbound ids remembered as admitted here (the latest ones). */
const DEDUPE_CAPACITY = 10_000;
/** Claims beyond the handler retries that a record may take without an outcome (crashes) before it is dead. */
const POISON_ALLOWANCE = 3;

/** One admission's place in its chat: `late` while a write answered after its timeout may still land. */
interface AdmissionSlot {
  late: Promise<void> | null;
  /** The message's `receivedAt`, given when it arrives (its place in its chat's order). */
  receivedAt: number;
}

/** The answer to a message that arrives while the bot stops: the channel delivers it again. */
function stoppingAnswer(id: string): AdmitResult {
  return { status: "rejected", id, error: new Error("The bot is stopping; the message was not admitted") };
}

/** What the inbound side needs from the engine. */
export interface InboundHost extends EngineCore {
  outcomes: Outcomes;
  observer: Observer;
  /** The admission timeouts. */
  deadlines: Deadlines;
  /** Stop the engine: a simulated process death. */
  halt(): void;
  /** Claim scans whose records are not all held yet. */
  claimsInFlight(): number;
  /** Resolves once the claim scans under way hold their records. */
  claimScansHeld(): Promise<void>;
  /** Whether an inbox claim scan of this process went unanswered (it is asked again by the sweeps). */
  inboxScansUnanswered(): boolean;
  /** Resolves once no inbox scan of this process is under way or unanswered; `null` when none is. */
  inboxScansPending(): Promise<void> | null;
}

/** The inbound side of the engine. */
export class Inbound {
  readonly #h: InboundHost;
  /** Admissions being journaled, by inbound id. */
  readonly admitting: Map<string, Promise<AdmitResult>> = new Map<string, Promise<AdmitResult>>();
  /** The lease each dispatched job runs under (a later claim of the record holds a new one). */
  readonly jobLeases: WeakMap<InboundJob, HeldLease> = new WeakMap<InboundJob, HeldLease>();
  readonly #dedupe = new BoundedSet<string>(DEDUPE_CAPACITY);
  /**
   * Chats with a record this process took up but did not run (its lease lost or left to lapse): the
   * latest such record's `receivedAt`, and the order of the last lease held when it was let go.
   */
  readonly #notRun = new BoundedMap<string, { receivedAt: number; order: number }>(DEDUPE_CAPACITY);
  /** Admissions answered `rejected` whose write may still land (a timeout) or be read back (an error), by id. */
  readonly #lateAdmissions = new Map<string, Promise<void>>();
  /**
   * The `receivedAt` of admissions answered `rejected` whose write may have been issued, by id: the channel's
   * redelivery is journaled with it, so that the journal keeps the chat's receipt order (a later message of
   * the chat admitted meanwhile comes after it there too, as in the chat's queue).
   */
  readonly #rejectedReceivedAt = new Map<string, number>();
  #lastReceivedAt = Number.NEGATIVE_INFINITY;

  constructor(host: InboundHost) {
    this.#h = host;
  }

  /** A redelivery of a message journaled already: counted, answered `duplicate`. */
  #duplicate(id: string): AdmitResult {
    this.#h.metrics.inboundDuplicates++;
    return { status: "duplicate", id };
  }

  /** Forget that `id` was admitted here (an operator's replay makes its redelivery a new message). */
  forget(id: string): void {
    this.#dedupe.delete(id);
  }

  /**
   * Admit an inbound message: dedupe, journal (leased to this instance), dispatch.
   * @param message the provider's message
   * @param dispatch where the admitted job goes (its place in the bot's per-chat queue): called once
   *   with the job, or with `null` when there is none; for an admission the journal confirms only after
   *   `admitTimeoutMs` (answered `rejected`), after that confirmation, so that the message keeps its
   *   place in its chat ahead of the messages that came after it
   * @param place called at once with the message's `receivedAt` (this process's arrival order: after
   *   every earlier admission here, also across a step back of the wall clock), for its queue's place
   * @returns what happened; `rejected` means "let the channel redeliver"
   */
  admit(message: InboundMessage, dispatch: (job: InboundJob | null) => void, place: (receivedAt: number) => void = () => {}): Promise<AdmitResult> {
    const slot: AdmissionSlot = { late: null, receivedAt: this.#rejectedReceivedAt.get(message.id) ?? this.#nextReceivedAt() };
    place(slot.receivedAt);
    const result = this.#h.observer.admit(message, (traceparent) => this.#admit(message, dispatch, traceparent, slot));
    const release = () => {
      if (slot.late === null) dispatch(null);
      else void slot.late.then(() => dispatch(null));
    };
    // The slot is settled (or handed to the late write) before the channel gets its answer.
    return result.then((answer) => {
      release();
      return answer;
    }, (error: unknown) => {
      release();
      throw error;
    });
  }

  /**
   * An admission answered `rejected` whose write was still on its way (`admitTimeoutMs`) or whose error
   * may hide a commit (read back): when it landed leased to this process, its job runs in the place its
   * message had in the chat's queue.
   */
  async #lateAdmission(
    message: InboundMessage,
    writing: Promise<InboundRecord | null>,
    dispatch: (job: InboundJob) => void,
    open: () => boolean,
  ): Promise<void> {
    const id = message.id;
    let record: InboundRecord | null;
    try {
      record = await writing;
    } catch {
      return; // not journaled: the channel delivers it again
    }
    if (record === null || record.state !== "processing" || this.#h.halted() || this.#h.stopping() || !open()) return;
    // A claim scan of this process whose answer is still on its way (or unanswered: asked again) may hold
    // earlier records of the chat: they go first (past the late admission's bound, its lease lapses and
    // a sweep takes it in order).
    const pending = this.#h.inboxScansPending();
    if (pending !== null) {
      await this.#h.deadlines.within(pending, this.#h.config.inbox.leaseMs, () => new Error("unanswered claim scan")).catch(() => {});
    }
    if (this.#h.halted() || this.#h.stopping() || !open()) return;
    if ((this.#h.leases.get("inbox", id)?.token ?? 0) >= record.fence) return; // taken up meanwhile (a redelivery)
    this.#remember(id);
    this.#h.metrics.inboundJournaled++;
    const job: InboundJob = { message, record, sends: [], sendCount: 0, runCounted: record.attempts > 0 };
    this.jobLeases.set(job, this.#h.leases.hold("inbox", id, record.fence));
    dispatch(job);
  }

  async #admit(
    message: InboundMessage,
    dispatch: (job: InboundJob) => void,
    traceparent: string | undefined,
    slot: AdmissionSlot,
  ): Promise<AdmitResult> {
    const id = message.id;
    // A redelivery of a message whose late admission is still on its way waits for it.
    const late = this.#lateAdmissions.get(id);
    if (late !== undefined) {
      await late;
      if (this.#dedupe.has(id)) return this.#duplicate(id);
    }
    if (this.#h.halted() || this.#h.stopping()) return stoppingAnswer(id);
    // Damaged storage answers nothing that can be trusted: the channel keeps the message (failOpen too).
    const damage = this.#h.damaged();
    if (damage !== null) return { status: "rejected", id, error: damage };
    // A redelivery that arrives while the first delivery is still being journaled waits for it: it is a
    // duplicate only once that one is journaled. Were it answered "duplicate" at once, the channel would
    // take it as delivered, and a failure of the first write would lose the message.
    for (let first = this.admitting.get(id); first !== undefined; first = this.admitting.get(id)) {
      if ((await first).status !== "rejected") return this.#duplicate(id);
    }
    const admission = this.#admitOnce(message, dispatch, traceparent, slot);
    this.admitting.set(id, admission);
    try {
      return await admission;
    } finally {
      if (this.admitting.get(id) === admission) this.admitting.delete(id);
    }
  }

  async #admitOnce(
    message: InboundMessage,
    dispatch: (job: InboundJob) => void,
    traceparent: string | undefined,
    slot: AdmissionSlot,
  ): Promise<AdmitResult> {
    const id = message.id;
    if (this.#h.halted() || this.#h.stopping()) return stoppingAnswer(id);
    if (this.#dedupe.has(id)) return this.#duplicate(id);
    this.#remember(id);
    let payload: JsonValue;
    try {
      payload = encodeContent(message, "message");
      if (traceparent !== undefined) payload = { ...payload as Record<string, JsonValue>, [TRACE_FIELD]: traceparent };
    } catch (error) {
      this.#dedupe.delete(id);
      const err = asError(error);
      this.#h.report(err, `admission of inbound message "${id}"`);
      return { status: "rejected", id, error: err };
    }
    let record: InboundRecord | null;
    const admittedAt = this.#h.clock.monotonic();
    const receivedAt = slot.receivedAt;
    this.#rejectedReceivedAt.delete(id);
    const writing = this.#h.backend.inbox.admit({
      id,
      kind: message.type === "interaction" ? "interaction" : "message",
      chatId: message.chatId,
      provider: this.#h.host.provider.name,
      payload,
      receivedAt,
    // While a scan of this process is unanswered, what it leased here is not queued yet: journaled
    // pending, the message is taken in its chat's order by a later scan.
    }, this.#h.inboxScansUnanswered() ? undefined : this.#h.claim("inbox"));
    let timedOut = false;
    try {
      record = await this.#h.deadlines.within(writing, this.#h.config.inbox.admitTimeoutMs, () => {
        timedOut = true;
        return new Error(
          `The journal did not confirm the admission of "${id}" within ${this.#h.config.inbox.admitTimeoutMs} ms ` +
            `(durability.inbox.admitTimeoutMs); answered rejected so that the channel delivers it again`,
        );
      });
    } catch (error) {
      this.#dedupe.delete(id);
      const err = asError(error);
      if (this.#h.report(error, `journal of inbound message "${id}"`)) return { status: "rejected", id, error: err };
      if (this.#h.config.failOpen) {
        dispatch({ message, record: null, sends: [], sendCount: 0 });
        return { status: "unjournaled", id, error: err };
      }
      // The write may still land (a timeout), or may have landed with its reply lost (an error after the
      // commit: read back), leased to this process: its message keeps its chat's place until that is known,
      // so that the chat's later messages never run before it. Bounded by a lease: past it, the record (if
      // it landed) is a sweep's to take, and the chat moves on.
      const landing = timedOut ? writing : this.#readBackAdmission(id);
      let open = true;
      const late = this.#lateAdmission(message, landing, dispatch, () => open);
      const tracked = this.#h.deadlines.within(late, this.#h.config.inbox.leaseMs, () => new Error("late admission")).catch(() => {}).then(() => {
        open = false;
        if (this.#lateAdmissions.get(id) === tracked) this.#lateAdmissions.delete(id);
      });
      this.#lateAdmissions.set(id, tracked);
      slot.late = tracked;
      this.#rejectedReceivedAt.set(id, receivedAt);
      if (this.#rejectedReceivedAt.size > DEDUPE_CAPACITY) this.#rejectedReceivedAt.delete(this.#rejectedReceivedAt.keys().next().value!);
      return { status: "rejected", id, error: err };
    }
    if (record === null) record = await this.#ownLostAdmission(id);
    if (record === null) return this.#duplicate(id);
    this.#h.metrics.inboundJournaled++;
    if (record.state === "pending") {
      // Journaled behind a record of its chat that comes first (held by another replica, or due): a sweep
      // takes the chat in order once it is free. Look now, in case it already is.
      this.#h.wake(0);
      return { status: "admitted", id };
    }
    // Leased: nothing of its chat comes first in the journal but records leased to this very process.
    // A claim scan of this process whose answer is still on its way (or unanswered: asked again) may
    // hold earlier records of the chat: let them reach the chat's queue first (they go ahead of this
    // message there).
    const scan = this.#h.inboxScansPending();
    if (scan !== null) {
      // Bounded: a scan that hangs must not hold the channel's answer.
      await this.#h.deadlines.within(scan, Math.min(2000, this.#h.config.inbox.leaseMs / 4), () => new Error("slow claim scan")).catch(() => {});
    }
    // Taken up meanwhile (a redelivery read it back, or a sweep re-claimed it after a clock step): that job handles it.
    if ((this.#h.leases.get("inbox", id)?.token ?? 0) >= record.fence) return { status: "admitted", id };
    const job: InboundJob = { message, record, sends: [], sendCount: 0, runCounted: record.attempts > 0 };
    const lease = this.#h.leases.hold("inbox", id, record.fence, admittedAt);
    this.jobLeases.set(job, lease);
    const slow = this.#h.inboxScansPending();
    if (slow !== null) {
      // The scan (or its repeat after a lost reply) is still on its way: the channel has its answer
      // now, and the job takes its place in the chat's queue once what the scan leased to this process is
      // queued ahead of it (the job is held, and heartbeated, meanwhile: let go, its lease would hold
      // back nothing of its chat for this process, whose later messages would then run first).
      slot.late = slow.then(() => {
        if (!this.#h.halted() && !this.#h.stopping()) return dispatch(job);
        // Stopping: its lease lapses, and the next start takes it back.
        this.jobLeases.delete(job);
        this.#h.leases.release("inbox", id, lease.token);
      });
      return { status: "admitted", id };
    }
    dispatch(job);
    return { status: "admitted", id };
  }

  /**
   * After an admission whose reply was an error: the record, if the write committed leased to this very
   * incarnation (its reply lost), else `null`. Read until the journal answers, within the caller's bound.
   */
  async #readBackAdmission(id: string): Promise<InboundRecord | null> {
    const until = this.#h.clock.monotonic() + this.#h.config.inbox.leaseMs;
    for (let read = 0; !this.#h.halted() && !this.#h.stopping() && this.#h.clock.monotonic() < until; read++) {
      try {
        const record = await this.#h.backend.inbox.get(id);
        return record !== null && this.#leasedByOwnAdmission(record) ? record : null;
      } catch (error) {
        if (isProcessDeath(error)) return null;
        await sleep(this.#h.clock, Math.min(Math.max(5, Math.floor(this.#h.config.inbox.leaseMs / 8)), 25 * 2 ** Math.min(read, 6)));
      }
    }
    return null;
  }

  /**
   * Journal a timer as an inbox record of `chatId` that becomes due at `at`
   * (wall-clock ms): admitted leased to this process, then `scheduled` at
   * the deadline (`inbox.schedule`), so that it holds back nothing of its chat, and any
   * process's sweep (a `bot.sweep()` of a cron trigger too) takes it up once
   * due. It comes back as a job with `timer` set. Idempotent: a timer whose id
   * is journaled already is left as it is. A crash between the two writes
   * leaves it leased; once its lease lapses a sweep takes it, finds it not due
   * and arms it again (as for a timer taken up early anywhere).
   * @param id the record id (unique in the inbox: derive it from the message the timer belongs to)
   * @param chatId the chat whose queue runs it
   * @param at when it is due
   * @param data what the timer's job needs when it fires
   * @throws the journal's error when the admission failed (the caller's step fails and is retried)
   */
  async scheduleTimer(id: string, chatId: string, at: number, data: JsonValue): Promise<void> {
    let record = await this.#h.backend.inbox.admit({
      id,
      kind: "message",
      chatId,
      provider: this.#h.host.provider.name,
      payload: { id, chatId, type: "timeout", [TIMER_FIELD]: { at, data } },
      receivedAt: this.#nextReceivedAt(),
    }, this.#h.claim("inbox"));
    if (record === null) {
      // Journaled already (armed by an earlier run of the step), unless a message took its id.
      const existing = await this.#h.backend.inbox.get(id).catch(() => null);
      if (existing !== null && timerOf(existing.payload) === undefined) {
        this.#h.report(
          new Error(`The timer "${id}" (an ask's timeout) was not journaled: an inbound message has that id; the ask times out only when its chat's next message arrives`),
          `timer "${id}"`,
        );
        return;
      }
      // Admitted by an earlier run of the step whose reply was lost, and not armed: still leased to this
      // incarnation by that admission, held by nothing here. Armed now, not a lease later.
      if (existing === null || !this.#isOwnAdmission(existing)) return;
      record = existing;
    }
    // Pending behind its chat: a due scan takes it and arms it (see process()).
    if (record.state !== "processing") return;
    // Taken up already by this process as lost work (its admission's answer came late): that job arms
    // it, or fires it when due.
    if (this.#h.leases.has("inbox", id)) return;
    // Held while it is armed, so that nothing of this process takes it for lost work meanwhile.
    const lease = this.#h.leases.hold("inbox", id, record.fence);
    try {
      await this.#h.outcomes.record(lease, (token) => this.#armTimer(id, token, at), [TIMER_STATE]);
    } catch (error) {
      if (isProcessDeath(error)) throw error;
      // It is journaled: once its lease lapses, a sweep arms it.
    } finally {
      this.#h.leases.release("inbox", id, lease.token);
    }
  }

  /** Make a leased timer record `scheduled`, due at `at` (attempts unchanged: arming is not a run). */
  async #armTimer(id: string, token: number, at: number): Promise<void> {
    const dueInMs = Math.max(0, Math.ceil(at - this.#h.clock.now()));
    await this.#h.backend.inbox.schedule(id, token, dueInMs);
    this.#h.wake(dueInMs);
  }

  /**
   * The record of `id` when an earlier admission by this very incarnation
   * landed but its reply was lost (a connection cut after the commit, or a
   * client that retried the write): it is leased to us and nobody works on it,
   * so it is ours to dispatch now rather than after its lease lapses.
   */
  async #ownLostAdmission(id: string): Promise<InboundRecord | null> {
    if (this.#h.leases.has("inbox", id)) return null;
    let existing: InboundRecord | null;
    try {
      existing = await this.#h.backend.inbox.get(id);
    } catch {
      return null; // a duplicate all the same; the lease lapses and a sweep takes it
    }
    // (Had this process run it and then lost its outcome, running it now rather than once its lease
    // lapses is the rerun a sweep would make.)
    return existing !== null && this.#isOwnAdmission(existing) ? existing : null;
  }

  /**
   * Whether `record` is still leased by this very incarnation's admission (the writer's token: no claim
   * issues it) and held by nothing here: the admission's lost reply is its answer.
   */
  #isOwnAdmission(record: InboundRecord): boolean {
    return this.#leasedByOwnAdmission(record) && !this.#h.leases.has("inbox", record.id);
  }

  /** Whether `record` is still leased by this very incarnation's admission (the writer's token, which no claim issues). */
  #leasedByOwnAdmission(record: InboundRecord): boolean {
    const lease = record.lease;
    return record.state === "processing" && lease !== null && lease.token === WRITER_TOKEN && record.fence === WRITER_TOKEN &&
      lease.owner === this.#h.instanceId() && lease.incarnation === this.#h.incarnation;
  }

  /**
   * The wall time of an admission, strictly after this process's previous one: messages of one chat
   * that arrive in the same millisecond keep their arrival order in every backend's due scan, whose
   * order is `receivedAt` (a backend without an admission counter breaks ties by id).
   */
  #nextReceivedAt(): number {
    const now = this.#h.clock.now();
    this.#lastReceivedAt = now > this.#lastReceivedAt ? now : this.#lastReceivedAt + 1;
    return this.#lastReceivedAt;
  }

  #remember(id: string): void {
    this.#dedupe.add(id);
  }

  /**
   * A record taken up here that is not run here: its lease let go (it lapses, or another process holds
   * it), and the later records of its chat this process holds already are not run here either (a sweep
   * takes them in their chat's order once it comes to them).
   */
  #letGo(record: InboundRecord, lease: HeldLease): void {
    const held = this.#h.leases.get("inbox", record.id);
    // (A job of an older lease of a record this process holds again, under a newer one: that one runs it.)
    if (held === undefined || held === lease) {
      this.#notRun.set(record.chatId, { receivedAt: record.receivedAt, order: this.#h.leases.lastOrder });
    }
    this.#h.leases.release("inbox", record.id, lease.token);
  }

  /**
   * Run a job's handler under its lease, then record the outcome: done, a
   * retry with backoff, or dead.
   * @param job the job
   * @param handle runs the handler and awaits the sends it made
   */
  async process(job: InboundJob, handle: () => Promise<void>): Promise<void> {
    const record = job.record;
    if (this.#h.halted()) return;
    const unreadable = job.message.unreadable;
    if (record === null) {
      if (unreadable !== undefined) {
        return void this.#h.report(new Error(`Unreadable inbound message "${job.message.id}": ${unreadable}`), "unjournaled message");
      }
      try {
        await this.#h.observer.handle(job.message, null, handle);
      } catch (error) {
        this.#h.report(error, `handler of unjournaled message "${job.message.id}"`);
      }
      return;
    }
    // The job's lease, whose token a sweep of this incarnation may hand on while the handler runs.
    const lease = this.jobLeases.get(job) ?? this.#h.leases.get("inbox", record.id) ?? this.#h.leases.hold("inbox", record.id, record.fence);
    if (this.#h.damaged() !== null) {
      // Not run on damaged storage: its lease lapses, and it runs once the storage is repaired.
      this.#h.leases.release("inbox", record.id, lease.token);
      return;
    }
    if (job.timer && job.timer.at > this.#h.clock.now()) {
      // Taken up before it is due (admitted behind its chat, a lease lost before it was armed, an
      // operator's replay, a clock of another process ahead of this one): armed again, not run.
      const at = job.timer.at;
      try {
        await this.#h.outcomes.record(lease, (token) => this.#armTimer(record.id, token, at), [TIMER_STATE]);
      } finally {
        this.#h.leases.release("inbox", record.id, lease.token);
      }
      return;
    }
    const ahead = this.#notRun.get(record.chatId);
    if (ahead !== undefined && record.receivedAt > ahead.receivedAt && lease.order <= ahead.order) {
      // Taken up here before an earlier record of its chat that was then not run here (its lease lost,
      // another replica may hold it): that one comes first, wherever it runs. Not run here either: its
      // lease lapses and a sweep takes it in its chat's order.
      return this.#letGo(record, lease);
    }
    const retries = this.#h.config.inbox.retries;
    // This run's number in the journal: an admission that ran it at once counted it; otherwise it is
    // journaled now. A timer's leased admission counted a run that was only its arming: its runs are one less.
    const journaled = job.runCounted === true ? Math.max(1, record.attempts) : record.attempts + 1;
    const attempts = runOf(journaled, job.timer !== undefined);
    let failure: unknown;
    let failed = false;
    let deadNow = false;
    /** The failure is the handler's own error: journaled with its causes and stack for an operator. */
    let handlerThrew = false;
    if (unreadable !== undefined) {
      // The provider could not parse it: journaled so that nothing a user sent vanishes, never handled.
      failed = deadNow = true;
      failure = new Error(`Unreadable ${record.provider} message: ${unreadable}`);
    } else if (attempts > retries + 1 + POISON_ALLOWANCE) {
      // Its handler began that many runs, none with an outcome: it takes the process down with it.
      failed = true;
      failure = new Error(`Processing was cut off (crash or lost lease) in ${attempts - 1} attempts`);
    } else if (
      job.runCounted !== true ? !await this.#startRun(lease, record.id, journaled) : lease.lost || this.#h.leases.get("inbox", record.id) !== lease
    ) {
      // Not journaled as begun (the lease was lost, or the journal failed), or, begun by its admission, its
      // lease lost while it waited in its chat's queue: not run here. Its lease lapses (or was taken) and a
      // sweep takes it up again.
      return this.#letGo(record, lease);
    } else {
      record.attempts = journaled;
      job.runCounted = true;
      try {
        await this.#h.observer.handle(job.message, record, handle);
      } catch (error) {
        if (isProcessDeath(error) || this.#h.halted()) return void this.#h.halt();
        if (damagedStorageOf(error) !== undefined) {
          // Its store is damaged, not the handler wrong: no outcome (never a dead-letter); its lease lapses.
          this.#h.report(error, `handler of inbound record "${record.id}"`);
          this.#h.leases.release("inbox", record.id, lease.token);
          return;
        }
        failed = true;
        failure = error;
        handlerThrew = true;
        // A step's journaled failure or ambiguity: every rerun would end the same way, so it is dead now.
        if (isStepOutcomeError(error)) deadNow = true;
      }
    }
    if (this.#h.halted()) return;
    const inbox = this.#h.backend.inbox;
    try {
      if (!failed) {
        await this.#h.outcomes.record(lease, (token) => inbox.complete(record.id, token), ["done"]);
      } else if (deadNow || attempts > retries) {
        const text = errorText(failure);
        const dead = { error: handlerThrew ? errorDetail(failure) : text, dead: true } as const;
        if (!await this.#h.outcomes.record(lease, (token) => inbox.fail(record.id, token, dead), ["dead"])) {
          return;
        }
        this.#h.metrics.inboundDead++;
        this.#h.host.events.emit("durability:dead", { kind: "inbound", id: record.id, error: text });
        this.#h.report(failure, deadNow
          ? handlerThrew
            ? `handler of inbound record "${record.id}" (dead-lettered at once: a step's outcome is journaled)`
            : `inbound record "${record.id}" (dead-lettered unread; the record keeps what the channel sent)`
          : `handler of inbound record "${record.id}" (dead after ${attempts} attempts)`);
      } else {
        const retryInMs = retryDelay(attempts, this.#h.config.inbox.backoff, undefined, () => this.#h.clock.random());
        const outcome = { error: handlerThrew ? errorDetail(failure) : errorText(failure), retryInMs };
        if (!await this.#h.outcomes.record(lease, (token) => inbox.fail(record.id, token, outcome), ["failed"])) return;
        this.#h.warn({
          code: "handler-retry",
          id: record.id,
          message: `The handler of inbound record "${record.id}" failed (attempt ${attempts} of ${
            retries + 1
          }); retrying in ${retryInMs} ms: ${errorText(failure)}`,
        });
        this.#h.wake(retryInMs);
      }
    } finally {
      this.#h.leases.release("inbox", record.id, lease.token);
    }
  }

  /**
   * Journal that run `attempt` of an inbox record's handler begins (`inbox.start`), retrying a journal
   * error while this process holds the lease (a repeat after a lost reply changes nothing).
   * @returns whether it is journaled; `false` when the lease was lost (or the bot stops while the journal fails)
   */
  async #startRun(lease: HeldLease, id: string, attempt: number): Promise<boolean> {
    for (let tries = 1;; tries++) {
      const token = lease.token;
      try {
        if (await this.#h.backend.inbox.start(id, token, attempt)) return true;
        // A claim scan of this process may have re-leased it (its lease looked lapsed: a server clock step)
        // with the answer still on its way: that scan hands this job the new token.
        if (lease.token === token && this.#h.claimsInFlight() > 0) await this.#h.claimScansHeld();
        // Re-leased to this very process meanwhile (a sweep handed the work a new token): again with it.
        if (lease.token !== token && !lease.lost && this.#h.leases.get("inbox", id) === lease) continue;
        return false;
      } catch (error) {
        if (this.#h.report(error, `journal of inbox record "${id}" (start of run ${attempt}, try ${tries})`)) return false;
        // Retried while the lease is held (heartbeats keep it): giving up would let the chat's next message
        // run first, and a start that committed with its reply lost would count a run never made.
        if (lease.lost || this.#h.leases.get("inbox", id) !== lease || (this.#h.stopping() && tries >= 3)) return false;
        await sleep(this.#h.clock, Math.min(Math.max(5, Math.floor(this.#h.config.inbox.leaseMs / 4)), 50 * 2 ** tries));
        if (this.#h.halted()) return false;
      }
    }
  }
}
