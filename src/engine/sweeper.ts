/**
 * The sweeper: due and abandoned work taken up (inbox and outbox claim scans, in chat order), lost sends
 * found and reported, old records purged. Each scan is named (`requestId`): one whose reply never came
 * (an error that may hide a commit) is asked again (`repeat`) until it answers, so that what it leased
 * to this process is taken up and what it made ambiguous is reported. Sweeps run one at a time; a
 * sweep asked for during one runs once after it.
 *
 * @module
 */
import { type ClockTimer, sleep } from "../clock.ts";
import { decodeContent } from "../content.ts";
import type { ClaimDueOptions, InboundRecord, OutboxClaim } from "../contract.ts";
import { isProcessDeath } from "../errors.ts";
import { SCAN_ANSWER_KEEP_MS } from "../contract.ts";
import { withoutTrace } from "../observe.ts";
import type { InboundMessage } from "../provider.ts";
import type { Throttle } from "../throttle.ts";
import type { Ambiguity } from "./ambiguity.ts";
import type { Inbound } from "./inbound.ts";
import { timerOf } from "./jobs.ts";
import type { HeldLease } from "./leases.ts";
import type { Outbound } from "./outbound.ts";
import type { SweepCounts } from "./settling.ts";
import type { EngineCore, InboundJob } from "./types.ts";

/** Records a sweep takes per claim scan. */
const SWEEP_BATCH = 64;
/** Tries of a scan's repeat right after its reply was lost (the rest wait for the next sweep). */
const REPEAT_TRIES = 3;
/** Records the first inbox scan of the first sweep after a start (the one that reclaims) takes at most. */
const RECLAIM_BATCH = 1024;
/** What the first sweep's inbox scans grow to (each full batch doubles the next one). */
const RECLAIM_BATCH_MAX = 8192;
/**
 * Inbox leases held beyond which a restart's reclaim takes no more for now: every held lease is renewed
 * each heartbeat round, so a backlog taken all at once would cost a renewal per record per round until
 * it is worked off (work growing with the square of the backlog). The rest stays in the journal, leased
 * to the previous incarnation, and later sweeps reclaim it as the work taken drains.
 */
const RECLAIM_AHEAD = 8192;
/** While a reclaim waits for the work it took to drain, how often it looks again (ms). */
const RECLAIM_POLL_MS = 50;
/** Under rate limits, deliveries the sweeps keep claimed ahead of the limiter (the rest wait in the journal, unleased). */
const AHEAD_OF_LIMIT = 256;

/** What the sweeper needs from the engine. */
export interface SweeperHost extends EngineCore {
  inbound: Inbound;
  outbound: Outbound;
  ambiguity: Ambiguity;
  /** The outbox's rate limits (`null`: none). */
  throttle: Throttle | null;
  /** Whether the engine started (sweeps before that do nothing). */
  started(): boolean;
}

/** A scan whose reply never came: asked again until it answers. */
interface UnansweredScan {
  journal: "inbox" | "outbox";
  options: ClaimDueOptions & { resendAmbiguous?: boolean };
  /** When it was sent (monotonic): the leases it issued date from then. */
  claimedAt: number;
}

/** The sweeps of one engine. */
export class Sweeper {
  readonly #h: SweeperHost;
  /** Scans whose reply never came, oldest first. */
  #unanswered: UnansweredScan[] = [];
  /** Admissions waiting for the inbox scans under way or unanswered (see {@link inboxScansPending}). */
  #inboxWaiters: (() => void)[] = [];
  #waitingStopped = false;
  /** Claim scans whose results are not all held yet (their records are leased to us but look unheld). */
  #claims = 0;
  /** The inbox claim scan under way (settled once what it claimed is on the chats' queues), or null. */
  #inboxScan: Promise<void> | null = null;
  #sweeping: Promise<void> | null = null;
  /** Scans named so far. */
  #requests = 0;
  #sweepAgain = false;
  #lastPurge = -Infinity;
  /** What the sweeps of this process took up. */
  readonly #swept: SweepCounts = { inbound: 0, outbound: 0, ambiguous: 0, purges: 0 };
  /** Deliveries the sweeps dispatched that have not finished (under rate limits they are capped). */
  #sweptInFlight = 0;
  /** A restart's reclaim stopped at {@link RECLAIM_AHEAD} leases held: later sweeps go on with it. */
  #reclaiming = false;
  /** The timer of a reclaim waiting for the work it took to drain. */
  #reclaimTimer: ClockTimer | undefined;

  constructor(host: SweeperHost) {
    this.#h = host;
  }

  /** Claim scans whose records are not all held yet: those under way, and those whose reply never came. */
  get claimsInFlight(): number {
    return this.#claims + this.#unanswered.length;
  }

  /** Whether an inbox claim scan went unanswered (what it leased here is not queued yet). */
  get inboxScansUnanswered(): boolean {
    return this.#unanswered.some((scan) => scan.journal === "inbox");
  }

  /**
   * Resolves once no inbox scan of this process is under way or unanswered (what they leased here is
   * on the chats' queues); `null` when none is.
   */
  inboxScansPending(): Promise<void> | null {
    if (this.#inboxScansQuiet() || this.#waitingStopped) return null;
    return new Promise((resolve) => this.#inboxWaiters.push(resolve));
  }

  /** The engine stops (or died): nothing waits for the inbox scans any more. */
  stopWaiting(): void {
    this.#waitingStopped = true;
    for (const resolve of this.#inboxWaiters.splice(0)) resolve();
  }

  #inboxScansQuiet(): boolean {
    return this.#inboxScan === null && !this.inboxScansUnanswered;
  }

  #wakeInboxWaiters(): void {
    if (this.#inboxScansQuiet()) for (const resolve of this.#inboxWaiters.splice(0)) resolve();
  }

  /**
   * At stop: what the unanswered outbox scans made ambiguous is reported now (the next incarnation
   * cannot ask for their answers). What they leased here lapses, and the next start takes it.
   */
  async reportUnanswered(): Promise<void> {
    for (const scan of this.#unanswered.splice(0)) {
      if (scan.journal !== "outbox") continue;
      const claimed = await this.#h.backend.outbox.claimDue({ ...scan.options, repeat: true }).catch(() => null);
      for (const entry of claimed?.ambiguous ?? []) {
        if (!this.#h.ambiguity.wasReported(entry.key, entry.fence)) this.#h.ambiguity.report(entry);
      }
    }
    this.#wakeInboxWaiters();
  }


  /** What the sweeps took up so far. */
  get swept(): SweepCounts {
    return this.#swept;
  }

  /** A send reported ambiguous, counted in the sweep totals. */
  countAmbiguous(): void {
    this.#swept.ambiguous++;
  }


  /** Look for due and abandoned work now. Concurrent calls share one sweep (and ask for one more). */
  sweep(): Promise<void> {
    if (this.#h.halted() || !this.#h.started() || this.#h.damaged() !== null) return Promise.resolve();
    if (this.#sweeping) {
      this.#sweepAgain = true;
      return this.#sweeping;
    }
    const run = async () => {
      do {
        this.#sweepAgain = false;
        try {
          await this.sweepOnce(false);
        } catch (error) {
          if (this.#h.report(error, "sweep")) return;
        }
      } while (this.#sweepAgain && !this.#h.halted() && !this.#h.stopping());
    };
    this.#sweeping = run().finally(() => {
      this.#sweeping = null;
    });
    this.#h.host.track(this.#sweeping);
    return this.#sweeping;
  }

  /** One sweep: the repeats of unanswered scans, inbox and outbox claim scans, a purge when due (`first`: the start's recovery). */
  async sweepOnce(first: boolean): Promise<void> {
    if (this.#h.stopping() && !first) return;
    if (this.#unanswered.length > 0) await this.#repeatUnanswered();
    // A restart takes back everything the previous incarnation held at once: its backlog can be large, so
    // larger batches, growing while they come back full (fewer scans, each with its fixed cost; the first
    // stays small, so that the first replies go out soon).
    const reclaim = first || this.#reclaiming;
    let batch = reclaim ? RECLAIM_BATCH : SWEEP_BATCH;
    const inboxClaim = { ...this.#h.claim("inbox"), reclaimOwn: reclaim, limit: batch };
    for (;;) {
      if (reclaim && this.#h.leases.count("inbox") >= RECLAIM_AHEAD) {
        // Taken faster than it is worked off: the rest waits (in the journal, under the previous incarnation's leases).
        this.#reclaiming = true;
        this.#awaitDrain();
        break;
      }
      inboxClaim.limit = batch;
      const claimedAt = this.#h.clock.monotonic();
      const options = { ...inboxClaim, requestId: this.#nextRequestId() };
      let records: InboundRecord[];
      this.#claims++;
      let scanned!: () => void;
      const scan = this.#inboxScan = new Promise<void>((resolve) => scanned = resolve);
      const scanDone = () => {
        if (this.#inboxScan === scan) this.#inboxScan = null;
        scanned();
        this.#wakeInboxWaiters();
      };
      try {
        // A sweep must never take work this very process is doing: leases that may look lapsed are renewed first.
        records = await this.#h.leases.claimScan(() => this.#h.backend.inbox.claimDue(options));
      } catch (error) {
        this.#claims--;
        try {
          // An admission meanwhile waits (bounded) for what the scan may have leased to this process.
          await this.#unansweredScan({ journal: "inbox", options, claimedAt }, error);
        } finally {
          scanDone();
        }
        throw error;
      }
      this.#claims--; // #takeInbound holds them all before it yields
      this.#takeInbound(records, claimedAt);
      scanDone();
      if (records.length < batch) {
        if (reclaim) this.#reclaiming = false;
        break;
      }
      if (reclaim) batch = Math.min(RECLAIM_BATCH_MAX, batch * 2);
    }
    const outboxClaim = {
      ...this.#h.claim("outbox"),
      reclaimOwn: first,
      limit: SWEEP_BATCH,
      resendAmbiguous: this.#h.config.outbox.onAmbiguous === "resend",
    };
    for (;;) {
      // Under rate limits, only what the limiter may admit soon is claimed: the rest waits unleased.
      if (this.#h.throttle !== null) outboxClaim.limit = Math.max(1, Math.min(SWEEP_BATCH, AHEAD_OF_LIMIT - this.#sweptInFlight));
      const claimedAt = this.#h.clock.monotonic();
      const options = { ...outboxClaim, requestId: this.#nextRequestId() };
      let claimed: OutboxClaim;
      this.#claims++;
      try {
        claimed = await this.#h.leases.claimScan(() => this.#h.backend.outbox.claimDue(options));
      } catch (error) {
        this.#claims--;
        await this.#unansweredScan({ journal: "outbox", options, claimedAt }, error);
        throw error;
      }
      outboxClaim.reclaimOwn = false;
      await this.#takeOutbound(claimed, claimedAt); // (its claim counted until the due entries are held)
      if (this.#h.halted()) return;
      if (claimed.due.length < SWEEP_BATCH && claimed.ambiguous.length < SWEEP_BATCH) break;
    }
    const purgeEvery = Math.min(this.#h.config.retentionMs / 10, 3_600_000);
    if (this.#h.clock.monotonic() - this.#lastPurge >= purgeEvery) {
      this.#lastPurge = this.#h.clock.monotonic();
      await this.#h.backend.inbox.purge(this.#h.config.retentionMs);
      await this.#h.backend.outbox.purge(this.#h.config.retentionMs);
      this.#swept.purges++;
    }
  }

  /**
   * A reclaim waits: once half of the inbox leases held at its stop are worked off, a sweep goes on with it
   * (without sweep timers, the next `bot.sweep()` does).
   */
  #awaitDrain(): void {
    if (this.#reclaimTimer !== undefined || this.#h.config.sweepIntervalMs === 0) return;
    const check = () => {
      this.#reclaimTimer = undefined;
      if (this.#h.halted() || this.#h.stopping() || !this.#reclaiming) return;
      if (this.#h.started() && this.#h.leases.count("inbox") < RECLAIM_AHEAD / 2) void this.sweep();
      else this.#reclaimTimer = this.#h.clock.setTimeout(check, RECLAIM_POLL_MS);
    };
    this.#reclaimTimer = this.#h.clock.setTimeout(check, RECLAIM_POLL_MS);
  }

  /** A fresh name for a scan (unique within this incarnation, and across incarnations by its prefix). */
  #nextRequestId(): string {
    return `${this.#h.incarnation}:${++this.#requests}`;
  }

  /** Hold and dispatch the records an inbox scan leased to this process (all of them before it yields). */
  #takeInbound(records: readonly InboundRecord[], claimedAt: number): void {
    for (const record of records) {
      const mine = this.#h.leases.get("inbox", record.id);
      if (mine !== undefined && !mine.lost && mine.settling !== "retry") {
        // Still being handled here: its lease only looked lapsed (a server clock step). Carry on under the new token.
        if (record.fence > mine.token) this.#h.leases.handOn(mine, record.fence, claimedAt, record.attempts);
        continue;
      }
      if (mine !== undefined && mine.token >= record.fence) continue; // an answer older than what is held here
      const lease = this.#h.leases.hold("inbox", record.id, record.fence, claimedAt);
      this.#swept.inbound++;
      if (record.attempts > 0 && record.error === null) this.#h.metrics.inboundReplayed++; // a run began, no outcome
      this.#dispatchRecord(record, lease);
    }
  }

  /**
   * Take up what an outbox scan answered: deliver the due entries leased to this process, report the
   * ambiguous ones. The caller counted the scan in `#claims`: released once the due entries are held.
   */
  async #takeOutbound(claimed: OutboxClaim, claimedAt: number): Promise<void> {
    const { due, ambiguous } = claimed;
    let unheld = true;
    try {
      // Which of them this process was working on (its lease only looked lapsed: a server clock step).
      const mineBefore = new Map<string, HeldLease>();
      for (const entry of [...due, ...ambiguous]) {
        const mine = this.#h.leases.get("outbox", entry.key);
        if (mine !== undefined && !mine.lost) mineBefore.set(entry.key, mine);
      }
      const dueKeys = new Set(due.map((entry) => entry.key));
      const ambiguousKeys = new Set(ambiguous.map((entry) => entry.key));
      // Deliveries run on their own (a hung provider call must not stall the sweeps); once one
      // settles, the next entry of its chat may be due, so look again. The lease is held from here on.
      for (const entry of due) {
        const mine = mineBefore.get(entry.key);
        // A held send being settled that comes back due without being ambiguous is a new attempt: its
        // failure was recorded (the reply lost) and its retry is due.
        if (mine !== undefined && (mine.settling !== "retry" || ambiguousKeys.has(entry.key))) {
          if (entry.fence > mine.token) this.#h.leases.handOn(mine, entry.fence, claimedAt, entry.attempts); // re-leased while still ours
          continue;
        }
        const held = this.#h.leases.get("outbox", entry.key);
        if (held !== undefined && held.token >= entry.fence) continue; // an answer older than what is held here
        const lease = this.#h.leases.hold("outbox", entry.key, entry.fence, claimedAt);
        this.#swept.outbound++;
        const resend = ambiguousKeys.has(entry.key);
        this.#sweptInFlight++;
        this.#h.outbound.inChatOrder(entry.chatId, () => this.#h.outbound.deliver(lease, entry, undefined, resend)).then(
          () => {
            this.#sweptInFlight--;
            this.#h.wake(0);
          },
          (error) => {
            this.#sweptInFlight--;
            this.#h.report(error, `delivery of outbox entry "${entry.key}"`);
          },
        );
      }
      unheld = false;
      this.#claims--;
      for (const entry of ambiguous) {
        const mine = mineBefore.get(entry.key);
        // A reservation whose answer is still on its way may be ours too, or another process's entry
        // that it only found: it cannot tell, so that one is reported.
        if (mine === undefined) {
          if (this.#h.ambiguity.wasReported(entry.key, entry.fence)) continue; // a repeated answer
          if (entry.state === "unknown") this.#h.ambiguity.settle(entry);
          else this.#h.ambiguity.report(entry);
          // A reservation of ours whose answer is still on its way may hold this very lease: it must not call.
          if (entry.state === "unknown") this.#h.outbound.rememberMadeUnknown(entry.key, entry.fence);
          continue;
        }
        if (dueKeys.has(entry.key)) continue; // re-leased to us ('resend'): the work under way took the new token
        if (this.#h.outbound.calling.has(entry.key)) {
          // Its call is under way: reported now (were this process to die during the call, nobody else
          // would), and the call's outcome still resolves the entry (a late outcome is accepted).
          this.#h.ambiguity.report(entry);
          continue;
        }
        // Its call never started: nothing to report, send it again in its turn.
        this.#h.leases.drop(mine);
        const requeued = await this.#h.backend.outbox.retry(entry.key).catch((error) => {
          this.#h.report(error, `requeue of outbox entry "${entry.key}"`);
          return false;
        });
        if (requeued) this.#h.wake(0);
        else if (!this.#h.halted()) this.#h.ambiguity.report(entry); // left unknown: an operator must see it
      }
    } finally {
      if (unheld) this.#claims--;
    }
  }

  /**
   * A scan failed: it may have committed with its reply lost. Ask it again at once (what it leased to
   * this process is taken up before those leases lapse, what it made ambiguous is reported); when it
   * still does not answer, the next sweep asks first.
   */
  async #unansweredScan(scan: UnansweredScan, error: unknown): Promise<void> {
    if (isProcessDeath(error) || this.#h.halted()) return; // nothing of this process's is taken up any more
    this.#unanswered.push(scan);
    for (let tries = 0; tries < REPEAT_TRIES && this.#unanswered.length > 0; tries++) {
      if (tries > 0) await sleep(this.#h.clock, 10 * 2 ** tries);
      if (this.#h.halted()) return;
      try {
        await this.#repeatUnanswered();
      } catch (again) {
        if (isProcessDeath(again)) return;
      }
    }
  }

  /** Ask the unanswered scans again, oldest first, and take up their answers. @throws the journal's error when one still does not answer */
  async #repeatUnanswered(): Promise<void> {
    while (this.#unanswered.length > 0 && !this.#h.halted()) {
      const scan = this.#unanswered[0]!;
      if (this.#h.clock.monotonic() - scan.claimedAt > SCAN_ANSWER_KEEP_MS) {
        this.#unanswered.shift(); // its answer is no longer kept, and its leases lapsed long ago
        this.#wakeInboxWaiters();
        continue;
      }
      const options = { ...scan.options, repeat: true };
      this.#claims++;
      if (scan.journal === "inbox") {
        let records: InboundRecord[];
        try {
          records = await this.#h.backend.inbox.claimDue(options);
        } finally {
          this.#claims--;
        }
        if (this.#unanswered[0] !== scan) continue; // taken up by a concurrent repeat
        this.#unanswered.shift();
        this.#takeInbound(records, scan.claimedAt);
        this.#wakeInboxWaiters();
      } else {
        let claimed: OutboxClaim;
        try {
          claimed = await this.#h.backend.outbox.claimDue(options);
        } catch (error) {
          this.#claims--;
          throw error;
        }
        if (this.#unanswered[0] !== scan) {
          this.#claims--;
          continue;
        }
        this.#unanswered.shift();
        await this.#takeOutbound(claimed, scan.claimedAt);
      }
    }
  }

  /** Wait (briefly) until no claim scan of this process has results it is not holding yet. */
  async claimScansHeld(): Promise<void> {
    for (let waited = 0; this.#claims > 0 && waited < 50 && !this.#h.halted(); waited++) {
      await sleep(this.#h.clock, 5);
    }
  }

  /** Dispatch a claimed record as a job that runs under `lease`. */
  #dispatchRecord(record: InboundRecord, lease: HeldLease): void {
    let message: InboundMessage;
    const timer = timerOf(record.payload);
    try {
      message = timer
        ? { id: record.id, chatId: record.chatId, type: "timeout" }
        : decodeContent(withoutTrace(record.payload), "payload") as InboundMessage;
    } catch (error) {
      message = { id: record.id, chatId: record.chatId, type: "unknown" };
      this.#h.report(error, `payload of inbound record "${record.id}"`);
    }
    const job: InboundJob = { message, record, sends: [], sendCount: 0, ...(timer ? { timer } : {}) };
    this.#h.inbound.jobLeases.set(job, lease);
    this.#h.host.dispatch(job);
  }
}
