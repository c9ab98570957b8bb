/**
 * Writing a record's outcome under its lease (done, failed, dead, sent, a timer armed): retried while
 * the lease is held, read back when a reply may have been lost after the write committed, and told
 * apart from a lease that another instance took (a stale lease, counted and warned about).
 *
 * @module
 */
import type { Clock } from "../clock.ts";
import { sleep } from "../clock.ts";
import { type DurabilityBackend, StaleLeaseError } from "../contract.ts";
import { isProcessDeath } from "../errors.ts";
import { TIMER_STATE } from "../rules.ts";
import type { HeldLease, LeaseKind, Leases } from "./leases.ts";

/** What the outcome writer needs from the engine. */
export interface OutcomeHost {
  backend: DurabilityBackend;
  clock: Clock;
  leases: Leases;
  /** Lease length per journal (ms). */
  leaseMs: { inbox: number; outbox: number };
  halted(): boolean;
  stopping(): boolean;
  /** Stop the engine: a simulated process death. */
  halt(): void;
  /** Report an error that has no caller; `true` when it was a process death. */
  report(error: unknown, context: string): boolean;
  /** Count and warn about a write refused for a lease another instance took. */
  stale(kind: LeaseKind, id: string, error: StaleLeaseError): void;
}

/** Writes outcomes under leases. */
export class Outcomes {
  readonly #h: OutcomeHost;

  constructor(host: OutcomeHost) {
    this.#h = host;
  }


  /**
   * Record the outcome of held work (complete, fail, markSent, markFailed). A
   * journal error is retried while this process holds the lease (heartbeats
   * keep it), so a live process never leaves a record half-settled; it gives
   * up when the lease is lost, the process dies, or the bot stops. A write
   * that committed but whose reply was lost is recognised on the retry: the
   * record is in the outcome's state under this very token, so it counts as
   * recorded, not as a stale lease.
   * @param lease the held lease (its current token is used)
   * @param write the write, given the token
   * @param landed the states the write leaves the record in
   * @returns whether the outcome was recorded
   */
  async record(lease: HeldLease, write: (token: number) => Promise<void>, landed: readonly string[]): Promise<boolean> {
    const { kind, id } = lease;
    const leaseMs = this.#h.leaseMs[kind];
    lease.settling = landed.some((state) => state === "failed" || state === TIMER_STATE) ? "retry" : "final";
    // Whether an earlier attempt failed in a way that may hide a commit (a lost reply).
    let uncertain = false;
    for (let attempt = 1;; attempt++) {
      const token = lease.token;
      try {
        await write(token);
        return true;
      } catch (error) {
        if (error instanceof StaleLeaseError) {
          // Re-leased to this very process meanwhile (a sweep handed the work the new token): write again.
          if (lease.token !== token && !lease.lost && this.#h.leases.get(kind, id) === lease) continue;
          // Read until the answer is known: a dead-letter or an ambiguity whose write landed must be reported.
          let outcome = await this.landed(kind, id, token, landed);
          for (let read = 1; outcome === undefined && read < 5 && !this.#h.halted(); read++) {
            await sleep(this.#h.clock, Math.min(Math.max(5, Math.floor(leaseMs / 8)), 25 * 2 ** read));
            outcome = await this.landed(kind, id, token, landed);
          }
          if (outcome === true) return true;
          // After an unanswered attempt, a record that moved on may have moved on from our own write
          // (a failure recorded, then retried): not counted as a stale lease, nothing is claimed of it.
          if (!uncertain && outcome === false) this.#h.stale(kind, id, error);
          return false;
        }
        uncertain = true;
        if (this.#h.report(error, `journal of ${kind} record "${id}" (write attempt ${attempt})`)) return false;
        // The write may have committed with its reply lost: look before the record moves on.
        if (await this.landed(kind, id, token, landed) === true) return true;
        const held = this.#h.leases.get(kind, id);
        if (!held || (this.#h.stopping() && attempt >= 3)) return false;
        // A lost lease gives up, unless its late outcome still resolves the send (unknown under this token).
        if (held.lost && !(kind === "outbox" && await this.#resolvableLate(id, token))) return false;
        await sleep(this.#h.clock, Math.min(Math.max(5, Math.floor(leaseMs / 4)), 50 * 2 ** attempt));
        if (this.#h.halted()) return false;
      }
    }
  }

  /** Whether an outbox entry is `unknown` under `token`: a late outcome of that call still resolves it. */
  async #resolvableLate(key: string, token: number): Promise<boolean> {
    const entry = await this.#h.backend.outbox.get(key).catch(() => null);
    return entry !== null && entry.state === "unknown" && entry.fence === token;
  }

  /**
   * Whether a fenced write with `token` already took effect (an earlier attempt committed, its reply
   * was lost). @returns `undefined` when the record could not be read
   */
  async landed(kind: LeaseKind, id: string, token: number, states: readonly string[]): Promise<boolean | undefined> {
    try {
      const record = kind === "inbox" ? await this.#h.backend.inbox.get(id) : await this.#h.backend.outbox.get(id);
      return record !== null && record.fence === token && states.includes(record.state);
    } catch (error) {
      if (isProcessDeath(error)) this.#h.halt();
      return undefined;
    }
  }
}
