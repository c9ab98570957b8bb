/**
 * The sweeper: due and abandoned work taken up (inbox and outbox claim scans, in chat order), lost sends
 * found and reported, leases of this incarnation that a lost reply hid adopted, old records purged.
 * Sweeps run one at a time; a sweep asked for during one runs once after it.
 *
 * @module
 */
import { sleep } from "../clock.ts";
import { decodeContent } from "../content.ts";
import type { DurabilityBackend, InboundRecord } from "../contract.ts";
import { isProcessDeath } from "../errors.ts";
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
/**
 * Records one lost-reply adoption lists per state (it runs only after a claim or reservation failed).
 * A backend's list has no time order filter: past this many `unknown` entries waiting for an operator,
 * a send a lost scan made unknown may go unreported.
 */
const ADOPT_LIST_LIMIT = 10_000;
/**
 * How far apart this process's clock and the backend's may be when looking for the sends a lost scan
 * made unknown (wide: a missed one would be silent, an extra one is only a second report).
 */
const LOST_SCAN_SLACK_MS = 60_000;
/** Records one inbox scan of the first sweep after a start (the one that reclaims) takes at most. */
const RECLAIM_BATCH = 1024;
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

/** The sweeps of one engine. */
export class Sweeper {
  readonly #h: SweeperHost;
  /** A claim or reservation failed without an answer: its records may be leased to this incarnation unknown to it. */
  #adoptPending = false;
  /** Claim scans whose results are not all held yet (their records are leased to us but look unheld). */
  #claims = 0;
  /** The inbox claim scan under way (settled once what it claimed is on the chats' queues), or null. */
  #inboxScan: Promise<void> | null = null;
  /**
   * Wall time at the start of the earliest outbox claim scan that failed without an answer since the
   * last adoption: it may have moved sends to `unknown` whose report was lost with its reply.
   */
  #lostScanSince: { from: number; to: number } | null = null;
  #sweeping: Promise<void> | null = null;
  #sweepAgain = false;
  #lastPurge = -Infinity;
  /** What the sweeps of this process took up. */
  readonly #swept: SweepCounts = { inbound: 0, outbound: 0, ambiguous: 0, purges: 0 };
  /** Deliveries the sweeps dispatched that have not finished (under rate limits they are capped). */
  #sweptInFlight = 0;

  constructor(host: SweeperHost) {
    this.#h = host;
  }

  /** Claim scans whose records are not all held yet. */
  get claimsInFlight(): number {
    return this.#claims;
  }

  /** The inbox claim scan under way, or null. */
  get inboxScan(): Promise<void> | null {
    return this.#inboxScan;
  }

  /** What the sweeps took up so far. */
  get swept(): SweepCounts {
    return this.#swept;
  }

  /** A send reported ambiguous, counted in the sweep totals. */
  countAmbiguous(): void {
    this.#swept.ambiguous++;
  }

  /** A claim, reservation or call announcement failed without an answer: the next sweep adopts what it may have leased to us. */
  adoptLater(): void {
    this.#adoptPending = true;
  }

  /** Look for due and abandoned work now. Concurrent calls share one sweep (and ask for one more). */
  sweep(): Promise<void> {
    if (this.#h.halted() || !this.#h.started()) return Promise.resolve();
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

  /** One sweep: adoption of lost leases if needed, inbox and outbox claim scans, a purge when due (`first`: the start's recovery). */
  async sweepOnce(first: boolean): Promise<void> {
    if (this.#h.stopping() && !first) return;
    if (this.#adoptPending) await this.#adoptOwnLost();
    // A restart takes back everything the previous incarnation held at once: its backlog can be large, and
    // each reclaiming scan reads the owner's records (those already taken back too), so fewer, larger batches.
    const batch = first ? RECLAIM_BATCH : SWEEP_BATCH;
    const inboxClaim = { ...this.#h.claim("inbox"), reclaimOwn: first, limit: batch };
    for (;;) {
      const claimedAt = this.#h.clock.monotonic();
      let records: InboundRecord[];
      this.#claims++;
      let scanned!: () => void;
      const scan = this.#inboxScan = new Promise<void>((resolve) => scanned = resolve);
      const scanDone = () => {
        if (this.#inboxScan === scan) this.#inboxScan = null;
        scanned();
      };
      try {
        // A sweep must never take work this very process is doing: leases that may look lapsed are renewed first.
        records = await this.#h.leases.claimScan(() => this.#h.backend.inbox.claimDue(inboxClaim));
      } catch (error) {
        this.#claims--;
        try {
          // An admission meanwhile waits (bounded) for the adoption of what the scan may have leased to us.
          await this.#afterUnansweredClaim(error);
        } finally {
          scanDone();
        }
        throw error;
      }
      this.#claims--; // the loop below holds them all before it yields
      for (const record of records) {
        const mine = this.#h.leases.get("inbox", record.id);
        if (mine !== undefined && !mine.lost && mine.settling !== "retry") {
          // Still being handled here: its lease only looked lapsed (a server clock step). Carry on under the new token.
          this.#h.leases.handOn(mine, record.fence, claimedAt, record.attempts);
          continue;
        }
        const lease = this.#h.leases.hold("inbox", record.id, record.fence, claimedAt);
        this.#swept.inbound++;
        if (record.attempts > 0 && record.error === null) this.#h.metrics.inboundReplayed++; // a run began, no outcome
        this.#dispatchRecord(record, lease);
      }
      scanDone();
      if (records.length < batch) break;
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
      let claimed: Awaited<ReturnType<DurabilityBackend["outbox"]["claimDue"]>>;
      const scanStartedAt = this.#h.clock.now();
      this.#claims++;
      try {
        claimed = await this.#h.leases.claimScan(() => this.#h.backend.outbox.claimDue(outboxClaim));
      } catch (error) {
        this.#claims--;
        const scanEndedAt = this.#h.clock.now();
        this.#widenLostScan(Math.min(scanStartedAt, scanEndedAt), Math.max(scanStartedAt, scanEndedAt));
        await this.#afterUnansweredClaim(error);
        throw error;
      }
      const { due, ambiguous } = claimed;
      outboxClaim.reclaimOwn = false;
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
            this.#h.leases.handOn(mine, entry.fence, claimedAt, entry.attempts); // re-leased while still ours
            continue;
          }
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
      if (this.#h.halted()) return;
      if (due.length < SWEEP_BATCH && ambiguous.length < SWEEP_BATCH) break;
    }
    const purgeEvery = Math.min(this.#h.config.retentionMs / 10, 3_600_000);
    if (this.#h.clock.monotonic() - this.#lastPurge >= purgeEvery) {
      this.#lastPurge = this.#h.clock.monotonic();
      await this.#h.backend.inbox.purge(this.#h.config.retentionMs);
      await this.#h.backend.outbox.purge(this.#h.config.retentionMs);
      this.#swept.purges++;
    }
  }

  /** Wait (briefly) until no claim scan of this process has results it is not holding yet. */
  async claimScansHeld(): Promise<void> {
    for (let waited = 0; this.#claims > 0 && waited < 50 && !this.#h.halted(); waited++) {
      await sleep(this.#h.clock, 5);
    }
  }

  /** Add the wall-time span of an unanswered outbox claim scan to the span the next adoption looks at. */
  #widenLostScan(from: number, to: number): void {
    const span = this.#lostScanSince;
    this.#lostScanSince = span === null ? { from, to } : { from: Math.min(span.from, from), to: Math.max(span.to, to) };
  }

  /** Dispatch a claimed record as a job that runs under `lease`. */
  #dispatchRecord(record: InboundRecord, lease: HeldLease): void {
    let message: InboundMessage;
    const timer = timerOf(record.payload);
    try {
      message = timer
        ? { id: record.id, chatId: record.chatId, type: "timeout" }
        : decodeContent(withoutTrace(record.payload)) as InboundMessage;
    } catch (error) {
      message = { id: record.id, chatId: record.chatId, type: "unknown" };
      this.#h.report(error, `payload of inbound record "${record.id}"`);
    }
    const job: InboundJob = { message, record, sends: [], sendCount: 0, ...(timer ? { timer } : {}) };
    this.#h.inbound.jobLeases.set(job, lease);
    this.#h.host.dispatch(job);
  }

  /**
   * A claim scan failed: it may have committed with its reply lost. Take up what it leased to this
   * incarnation at once (before those leases lapse); if that fails too, the next sweep tries again.
   */
  async #afterUnansweredClaim(error: unknown): Promise<void> {
    this.#adoptPending = true;
    if (isProcessDeath(error) || this.#h.halted()) return;
    await this.#adoptOwnLost().catch(() => {});
  }

  /**
   * After a claim or reservation failed without an answer, take up what it may have leased to this
   * incarnation: records `processing`/`sending` under this incarnation's lease that it does not hold.
   * Nothing was done with them here, so they are handled and sent now instead of waiting for their
   * leases to lapse (and, for a send, instead of being taken for an ambiguous one).
   */
  async #adoptOwnLost(): Promise<void> {
    this.#adoptPending = false;
    const lostScanSince = this.#lostScanSince;
    this.#lostScanSince = null;
    try {
      if (lostScanSince !== null) {
        // A scan that moved sends to `unknown` reports them; its reply was lost, so report the sends
        // that became unknown since it started (another replica may report one of them too: better twice
        // than never). The slack covers a backend clock that runs behind this one.
        for (const entry of await this.#h.backend.outbox.list({ state: "unknown", limit: ADOPT_LIST_LIMIT })) {
          if (entry.updatedAt < lostScanSince.from - LOST_SCAN_SLACK_MS) continue;
          if (entry.updatedAt > lostScanSince.to + LOST_SCAN_SLACK_MS) continue;
          if (this.#h.ambiguity.wasReported(entry.key, entry.fence)) continue;
          this.#h.ambiguity.settle(entry);
        }
      }
      const [records, entries] = await Promise.all([
        this.#h.backend.inbox.list({ state: "processing", limit: ADOPT_LIST_LIMIT }),
        this.#h.backend.outbox.list({ state: "sending", limit: ADOPT_LIST_LIMIT }),
      ]);
      for (const record of records) {
        const lease = record.lease;
        if (!lease || lease.owner !== this.#h.instanceId() || lease.incarnation !== this.#h.incarnation) continue;
        if (lease.token !== record.fence || this.#h.leases.has("inbox", record.id) || this.#claims > 0) continue;
        if (this.#h.inbound.admitting.has(record.id)) continue; // its admission's answer is on its way
        if (this.#h.leases.knew("inbox", record.id, record.fence)) continue; // handled here already (the list is stale)
        this.#dispatchRecord(record, this.#h.leases.hold("inbox", record.id, record.fence, -Infinity));
      }
      for (const entry of entries) {
        if (!this.#h.outbound.isOwnUncalled(entry)) continue;
        // With 'resend', a lost scan re-leases abandoned sends to us instead of making them unknown:
        // one that was called before may have been delivered, so it is reported before it goes again
        // (perhaps one that had only failed: a report too many rather than a silent resend).
        if (lostScanSince !== null && this.#h.config.outbox.onAmbiguous === "resend" && entry.attempts > 1) {
          this.#h.ambiguity.report(entry);
        }
        const lease = this.#h.leases.hold("outbox", entry.key, entry.fence, -Infinity);
        this.#h.outbound.inChatOrder(entry.chatId, () => this.#h.outbound.deliver(lease, entry)).then(
          () => this.#h.wake(0),
          (error) => void this.#h.report(error, `delivery of outbox entry "${entry.key}"`),
        );
      }
    } catch (error) {
      this.#adoptPending = true;
      if (lostScanSince !== null) this.#widenLostScan(lostScanSince.from, lostScanSince.to);
      throw error;
    }
  }
}
