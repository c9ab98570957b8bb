/**
 * The leases this incarnation holds: which records it works on under which fencing token, the outbox
 * leases it gave up before their provider call (only this process knows no call was made under them),
 * the heartbeat rounds that extend them, and the gate that keeps a claim scan from racing a renewal of
 * its own leases (BullMQ's `LockManager` plays this part there).
 *
 * @module
 */
import type { DurabilityBackend } from "../contract.ts";
import { BoundedMap } from "../bounded_map.ts";
import type { Clock, ClockTimer } from "../clock.ts";
import type { DurabilityWarning } from "./types.ts";

/** Outbox leases given up before their provider call that this process remembers (the latest ones). */
const GIVEN_UP_CAPACITY = 1024;
/** A wall-clock step larger than this (against the monotonic clock) renews every held lease before a sweep claims. */
const CLOCK_STEP_MS = 1000;

/** A journal whose records are leased. */
export type LeaseKind = "inbox" | "outbox";

/**
 * A lease this incarnation holds, from the claim until its outcome is
 * written (heartbeats extend it). One object per held record: when a sweep of
 * this incarnation re-leases a record it is still working on (its lease looked
 * lapsed after a clock step), the new token is written into this object, so
 * the work under way carries on with it.
 */
export interface HeldLease {
  kind: LeaseKind;
  id: string;
  token: number;
  lost: boolean;
  /** Monotonic time at which the backend last confirmed the lease (the start of the claim or heartbeat call). */
  confirmedAt: number;
  /** When this process first held it, as an order among its leases ({@link Leases.lastOrder}): kept when the token is handed on. */
  readonly order: number;
  /**
   * Its outcome is being written: `retry` (a failure to retry later: once it lands, the record is due
   * again and a claim of it is a new attempt) or `final` (done, sent, dead: a claim of it can only
   * mean the lease looked lapsed before the write landed).
   */
  settling?: "retry" | "final";
  /** The record's attempts under `token`, once a re-lease handed it on (else the claimed record's). */
  attempts?: number;
}

/** What the leases need from the engine. */
export interface LeaseHost {
  backend: DurabilityBackend;
  clock: Clock;
  /** Lease length per journal (ms). */
  leaseMs: { inbox: number; outbox: number };
  /** Whether a simulated process death stopped the engine (nothing is renewed then). */
  halted(): boolean;
  warn(warning: DurabilityWarning): void;
  /** Report an error that has no caller. */
  report(error: unknown, context: string): void;
}

/** The held leases and their renewal. */
export class Leases {
  readonly #host: LeaseHost;
  /** Leases held, by kind and id (two maps: no key to build per lookup). */
  readonly #held = { inbox: new Map<string, HeldLease>(), outbox: new Map<string, HeldLease>() };
  /** Outbox leases given up before their provider call (an announcement unanswered): key → token. */
  readonly #givenUpUncalled = new BoundedMap<string, number>(GIVEN_UP_CAPACITY);
  /** The order of the latest lease first held. */
  #order = 0;
  /** Clocks at the start of the last heartbeat round (monotonic and wall), to tell a stall or a clock step. */
  #lastRound = { monotonic: 0, wall: 0 };
  /** Claim scans run one at a time. */
  #scans: Promise<unknown> = Promise.resolve();
  /** The heartbeat round under way (a claim scan waits for it: it would find a lease lapsed that the round is extending). */
  #renewing: Promise<void> | null = null;

  constructor(host: LeaseHost) {
    this.#host = host;
  }

  /** Heartbeats run three times per (shorter) lease. */
  get heartbeatEveryMs(): number {
    return Math.max(5, Math.floor(Math.min(this.#host.leaseMs.inbox, this.#host.leaseMs.outbox) / 3));
  }

  /**
   * Hold the lease of `id` under `token`: the held lease of that token if there is one, else a new one.
   * @param confirmedAt monotonic time at which the claim was made (default: now)
   */
  hold(kind: LeaseKind, id: string, token: number, confirmedAt: number = this.#host.clock.monotonic()): HeldLease {
    const existing = this.#held[kind].get(id);
    if (existing !== undefined && existing.token === token) return existing;
    const lease: HeldLease = { kind, id, token, lost: false, confirmedAt, order: ++this.#order };
    this.#held[kind].set(id, lease);
    return lease;
  }

  /** Hand a re-leased record's new token to the work under way on it (known from now on, like a claim). */
  handOn(lease: HeldLease, token: number, confirmedAt: number, attempts: number): void {
    lease.token = token;
    lease.confirmedAt = confirmedAt;
    lease.attempts = attempts;
  }

  /** The order of the lease held last: every lease held so far has an order at most this. */
  get lastOrder(): number {
    return this.#order;
  }

  /** Let go of the lease of `id` when it is still the one of `token`. */
  release(kind: LeaseKind, id: string, token: number): void {
    const held = this.#held[kind];
    if (held.get(id)?.token === token) held.delete(id);
  }

  /** Let go of `lease` when it is still the one held for its record. */
  drop(lease: HeldLease): void {
    if (this.#held[lease.kind].get(lease.id) === lease) this.#held[lease.kind].delete(lease.id);
  }

  /** The lease held on `id`, if any. */
  get(kind: LeaseKind, id: string): HeldLease | undefined {
    return this.#held[kind].get(id);
  }

  /** How many leases of `kind` are held. */
  count(kind: LeaseKind): number {
    return this.#held[kind].size;
  }

  /** Whether a lease is held on `id`. */
  has(kind: LeaseKind, id: string): boolean {
    return this.#held[kind].has(id);
  }

  /**
   * Whether the outbox lease of `key` under `token` was given up before its provider call: still
   * leased to this incarnation, nobody called under it, so a send of its key may take it up.
   */
  givenUpUncalled(key: string, token: number): boolean {
    return this.#givenUpUncalled.get(key) === token;
  }

  /**
   * Remember that no call was made under the lease `token` of outbox `key`: given up before its call (its
   * announcement unanswered), or a reservation's whose answer was lost.
   */
  markUncalled(key: string, token: number): void {
    this.#givenUpUncalled.set(key, token);
  }

  /** Forget every held lease (the engine stopped). */
  clear(): void {
    this.#held.inbox.clear();
    this.#held.outbox.clear();
  }

  /** The rounds start counting from now (the engine started). */
  startRounds(): void {
    this.#lastRound = { monotonic: this.#host.clock.monotonic(), wall: this.#host.clock.now() };
  }

  /** A heartbeat round. It never waits for a claim scan (a slow scan must not cost leases); scans wait for it. */
  heartbeat(): Promise<void> {
    const round = this.#renewAll();
    const settled = round.catch(() => {}).then(() => {
      if (this.#renewing === settled) this.#renewing = null;
    });
    this.#renewing = settled;
    return round;
  }

  /**
   * A claim scan, after the heartbeat round under way and after renewing this incarnation's leases if
   * they may look lapsed (a stall, a clock step): a scan never races a renewal of its own leases.
   * Scans run one at a time.
   */
  claimScan<T>(claim: () => Promise<T>): Promise<T> {
    const op = async () => {
      if (this.#renewing !== null) {
        // A hung heartbeat call must not stop the sweeps: wait for the round at most half a lease.
        const leaseMs = Math.min(this.#host.leaseMs.inbox, this.#host.leaseMs.outbox);
        let timer: ClockTimer | undefined;
        await Promise.race([this.#renewing, new Promise<void>((resolve) => timer = this.#host.clock.setTimeout(resolve, leaseMs / 2))]);
        this.#host.clock.clearTimeout(timer);
      }
      if (this.#needRenewal()) await this.heartbeat();
      return await claim();
    };
    const run = this.#scans.then(op, op);
    this.#scans = run.catch(() => {});
    return run;
  }

  /** Extend one held lease: `held`, `lost` (another instance has it, or it settled) or `error` (unknown). */
  async renew(h: HeldLease, announceCall = false): Promise<"held" | "lost" | "error"> {
    const { backend, clock } = this.#host;
    const journal = h.kind === "inbox" ? backend.inbox : backend.outbox;
    const leaseMs = this.#host.leaseMs[h.kind];
    const startedAt = clock.monotonic();
    const token = h.token;
    try {
      const held = announceCall
        ? await backend.outbox.markCalling(h.id, token, leaseMs)
        : await journal.heartbeat(h.id, token, leaseMs);
      if (held) {
        if (h.token === token) h.confirmedAt = Math.max(h.confirmedAt, startedAt);
        return "held";
      }
      if (this.#held[h.kind].get(h.id) !== h || h.token !== token) return "lost"; // settled or re-leased meanwhile
      if (h.settling !== undefined) return "lost"; // its outcome write landed first (the heartbeat found it settled)
      h.lost = true;
      this.#host.warn({
        code: "lease-lost",
        message: `Lost the lease on ${h.kind} record "${h.id}" (fencing token ${token}): another instance took it`,
        ...(h.kind === "inbox" ? { id: h.id } : { key: h.id }),
      });
      return "lost";
    } catch (error) {
      this.#host.report(error, `${announceCall ? "call announcement" : "heartbeat"} of ${h.kind} record "${h.id}"`);
      return "error";
    }
  }

  async #renewAll(): Promise<void> {
    if (this.#host.halted()) return;
    this.startRounds();
    const held = [...this.#held.inbox.values(), ...this.#held.outbox.values()].filter((h) => !h.lost);
    await Promise.all(held.map((h) => this.renew(h)));
  }

  /**
   * Whether held leases may look lapsed to the backend: the heartbeat round is overdue (a stall, a
   * timer that fired late) or the wall clock stepped against the monotonic one since it ran.
   */
  #needRenewal(): boolean {
    if (this.#held.inbox.size === 0 && this.#held.outbox.size === 0) return false;
    const { clock } = this.#host;
    const elapsed = clock.monotonic() - this.#lastRound.monotonic;
    const wallElapsed = clock.now() - this.#lastRound.wall;
    return elapsed >= this.heartbeatEveryMs || Math.abs(wallElapsed - elapsed) > CLOCK_STEP_MS;
  }
}
