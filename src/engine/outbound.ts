/**
 * Sends: journaled (reserved) before the provider call, the call announced (`markCalling`) and made
 * under the entry's lease, its outcome recorded; failures retried with backoff, dead-lettered, held as
 * ambiguous when the call may have arrived, paused for a channel's rate limit; content the journal
 * cannot hold sent once, bypassing it. Each chat's sends go one after another.
 *
 * @module
 */
import { retryDelay } from "../backoff.ts";
import { BoundedSet } from "../bounded_map.ts";
import { sleep } from "../clock.ts";
import { decodeContent, encodeContent, hashText, isOverUtf8Limit, UnencodableContentError } from "../content.ts";
import type { JsonValue, NewOutboxEntry, OutboxEntry } from "../contract.ts";
import { StaleLeaseError } from "../contract.ts";
import { errorText, isProcessDeath } from "../errors.ts";
import type { Observer } from "../observe.ts";
import { classifyProviderError, type OutboundContent } from "../provider.ts";
import { BLOCKING_OUTBOX_STATES, WRITER_TOKEN } from "../rules.ts";
import type { Throttle } from "../throttle.ts";
import type { Ambiguity } from "./ambiguity.ts";
import type { HeldLease } from "./leases.ts";
import type { Outcomes } from "./outcomes.ts";
import { settleAbandonedStep, stepOf } from "./steps.ts";
import type { EngineCore, SendResult } from "./types.ts";
import { MAX_TIMER_MS } from "./wakeups.ts";

/** Keys remembered as called or made unknown (the latest ones). */
const REMEMBERED = 10_000;
/** How long a 429 without `retry_after` holds its send back. */
const DEFAULT_RETRY_AFTER_MS = 1000;

/** What sending needs from the engine. */
export interface OutboundHost extends EngineCore {
  outcomes: Outcomes;
  ambiguity: Ambiguity;
  observer: Observer;
  /** The outbox's rate limits (`null`: none). */
  throttle: Throttle | null;
  /** The signal of the process's calls (aborted when it dies). */
  signal: AbortSignal;
  /** Whether the engine started (the instanceId is known). */
  ready(): boolean;
  /** Stop the engine: a simulated process death. */
  halt(): void;
}

/** The outbound side of the engine. */
export class Outbound {
  readonly #h: OutboundHost;
  /**
   * Outbox keys whose provider call this incarnation started and whose outcome is not recorded: the
   * only ones of its own leases that may have reached the channel. Kept when the outcome could not be
   * written, so that such a key is never taken for one that was never sent.
   */
  readonly calling: BoundedSet<string> = new BoundedSet<string>(REMEMBERED);
  /** Sends a sweep of this process made `unknown` (and reported) that it did not hold: key → fence. */
  readonly madeUnknown: Map<string, number> = new Map<string, number>();
  /** Keys being reserved (a reservation leases to us before its answer arrives). */
  readonly #reserving = new Map<string, number>();
  readonly #chatTails = new Map<string, Promise<unknown>>();

  constructor(host: OutboundHost) {
    this.#h = host;
  }

  /** Remember that a sweep of this process made the send of `key` unknown under `fence`. */
  rememberMadeUnknown(key: string, fence: number): void {
    this.madeUnknown.set(key, fence);
    if (this.madeUnknown.size > REMEMBERED) this.madeUnknown.delete(this.madeUnknown.keys().next().value!);
  }

  /**
   * Journal a send and, in `now` mode, deliver it at once (unless an earlier
   * send of the chat is pending).
   * @param chatId the chat
   * @param content what to send
   * @param key the idempotency key
   * @param inboundId the inbound record the send was made for
   * @param mode `now` sends now; `enqueue` leaves it to the worker
   * @returns what happened
   */
  async send(
    chatId: string,
    content: OutboundContent,
    key: string,
    inboundId: string | null,
    mode: "now" | "enqueue",
  ): Promise<SendResult> {
    if (this.#h.halted()) throw new Error("The process died");
    if (!this.#h.ready()) throw new Error("Call bot.start() before sending: the outbox needs the instanceId");
    let json: JsonValue;
    let text: string;
    try {
      json = encodeContent(content);
      text = JSON.stringify(json);
    } catch (error) {
      if (!(error instanceof UnencodableContentError)) throw error;
      return this.#bypass(chatId, content, key, error.message);
    }
    if (isOverUtf8Limit(text, this.#h.config.outbox.maxPayloadBytes)) {
      return this.#bypass(
        chatId,
        content,
        key,
        `the content is larger than outbox.maxPayloadBytes (${this.#h.config.outbox.maxPayloadBytes}); send large media by URL or path`,
      );
    }
    const entry: NewOutboxEntry = { key, chatId, content: json, contentHash: hashText(text), inboundId };
    const run = (answered?: (result: SendResult) => void) => this.inChatOrder(chatId, () => this.#reserveAndDeliver(entry, content, mode, answered));
    // Not a handler's: answered once its outcome is journaled (a script may end right after it).
    if (inboundId === null) return run();
    // A handler's send answers it once the provider answered: the outcome's journal write goes on (the
    // chat's next send waits for it), so the message's done mark is written alongside it, not after.
    let answered!: (result: SendResult) => void;
    const early = new Promise<SendResult>((resolve) => answered = resolve);
    return Promise.race([early, run(answered)]);
  }

  /**
   * Content the provider does not journal (an edit, a typing indicator): one provider call now,
   * no outbox entry, no retry; its error goes to the caller.
   */
  sendDirect(chatId: string, content: OutboundContent, key: string): Promise<SendResult> {
    if (this.#h.halted()) return Promise.reject(new Error("The process died"));
    const call = { key, chatId, attempt: 1, inboundId: null };
    const work = this.#h.observer.providerCall(call, () => this.#h.host.provider.send(chatId, content, { idempotencyKey: key, attempt: 1, signal: this.#h.signal }))
      .then((receipt): SendResult => ({ key, state: "sent", messageId: String(receipt?.messageId ?? "") }));
    this.#h.host.track(work.catch(() => {}));
    return work;
  }

  /** Run sends of one chat one after another, in call order. */
  inChatOrder<T>(chatId: string, fn: () => Promise<T>): Promise<T> {
    const previous = this.#chatTails.get(chatId) ?? Promise.resolve();
    const run = previous.then(fn, fn);
    const tail = run.then(() => {}, () => {});
    this.#chatTails.set(chatId, tail);
    void tail.then(() => {
      if (this.#chatTails.get(chatId) === tail) this.#chatTails.delete(chatId);
    });
    this.#h.host.track(tail);
    return run;
  }

  async #reserveAndDeliver(
    entry: NewOutboxEntry,
    content: OutboundContent,
    mode: "now" | "enqueue",
    answered?: (result: SendResult) => void,
  ): Promise<SendResult> {
    let result;
    const reservedAt = this.#h.clock.monotonic();
    const reserved = () => {
      const n = (this.#reserving.get(entry.key) ?? 1) - 1;
      if (n > 0) this.#reserving.set(entry.key, n);
      else this.#reserving.delete(entry.key);
    };
    const claim = mode === "now" ? this.#h.claim("outbox") : undefined;
    // Sent at once if leased: the reservation announces the call too (one journal write fewer).
    const calling = claim !== undefined && this.#callsAtOnce(entry.key);
    this.#reserving.set(entry.key, (this.#reserving.get(entry.key) ?? 0) + 1);
    try {
      result = await this.#h.backend.outbox.reserve(entry, calling ? { ...claim, calling: true } : claim);
      reserved();
    } catch (error) {
      reserved();
      // Its reply lost, the reservation may have committed leased to us with the call announced: no call
      // was made under its lease (token 1), so it is ours to send, not an ambiguous send.
      if (calling) this.#h.leases.markUncalled(entry.key, WRITER_TOKEN);
      if (isProcessDeath(error)) this.#h.halt();
      if (this.#h.halted()) throw error;
      // The reservation may have committed with its reply lost: then the entry is leased to this
      // incarnation and nobody else will send it before the lease lapses. Look (its key names the
      // call: the writer's token under this incarnation is this reservation's), and send it if so.
      const landed = await this.#h.backend.outbox.get(entry.key).catch(() => null);
      if (landed === null || !this.#sameSend(landed, entry)) throw error;
      this.#h.metrics.outboxJournaled++;
      if (this.isOwnUncalled(landed)) {
        return this.deliver(this.#h.leases.hold("outbox", landed.key, landed.fence, -Infinity), landed, content, false, false, answered);
      }
      // Journaled all the same (queued behind its chat, or taken up by a sweep meanwhile): the send
      // stands and goes out in its turn, so the handler is answered with it, as a reservation answered
      // in time would have been.
      if (landed.state === "queued") this.#h.wake(0);
      return this.#resultOf(landed);
    }
    const journaled = result.entry;
    if (result.status === "exists" && this.#sameSend(journaled, entry) && this.isOwnUncalled(journaled)) {
      // Reserved by this incarnation, its reply lost (the handler retried), or given up here before its
      // call: never sent under this lease, ours to send now.
      return this.deliver(this.#h.leases.hold("outbox", journaled.key, journaled.fence, -Infinity), journaled, content, false, false, answered);
    }
    if (result.status === "exists") {
      if (journaled.contentHash !== entry.contentHash) {
        this.#h.metrics.outboxDiverged++;
        this.#h.warn({
          code: "outbox-diverged",
          key: entry.key,
          message:
            `Idempotency key "${entry.key}" was reused with different content; the journaled send stands and nothing was sent (is the handler deterministic?)`,
        });
      } else {
        this.#h.metrics.outboxDeduped++;
      }
      return { ...this.#resultOf(journaled), deduped: true };
    }
    this.#h.metrics.outboxJournaled++;
    if (result.status === "queued") {
      this.#h.metrics.outboxDeferred++;
      this.#h.wake(0);
      return this.#resultOf(journaled);
    }
    const taken = this.#h.leases.get("outbox", journaled.key);
    if (taken !== undefined && taken.token >= journaled.fence) {
      // Taken up while the reservation's answer was on its way (a sweep re-leased it, or a concurrent
      // send of the same key took it up): that delivery sends it.
      return { key: journaled.key, state: "sending", deduped: true };
    }
    // Reserved with its call announced (a backend that ignores `calling` wrote it uncalled: then
    // `deliver` announces it with markCalling, as for any lease).
    const announced = calling && journaled.called;
    return this.deliver(this.#h.leases.hold("outbox", journaled.key, journaled.fence, reservedAt), journaled, content, false, announced, answered);
  }

  /**
   * Whether a send made now goes to the provider as soon as its reservation leases it, so that the
   * reservation may announce the call: nothing but the journal can hold it back (no rate limit to wait
   * for, no delivery status that spares the call). Its chat's earlier sends are the journal's to tell:
   * an entry queued behind them is written uncalled.
   */
  #callsAtOnce(key: string): boolean {
    return this.#h.throttle === null && this.#h.ambiguity.confirmedId(key) === undefined && !this.#h.stopping();
  }

  /** Whether a journaled entry is the send `entry` describes (same chat and content), not another use of its key. */
  #sameSend(journaled: OutboxEntry, entry: NewOutboxEntry): boolean {
    return journaled.chatId === entry.chatId && journaled.contentHash === entry.contentHash;
  }

  /**
   * Whether `entry` is `sending` under a lease of this very incarnation that it does not hold and
   * under which nobody called the provider: its reservation's (the writer's token, which no claim
   * issues), never announced (a reservation whose reply was lost), or one given up here before the
   * call (its announcement unanswered). Nobody sent it under that lease. A lease this process gave up
   * after its call (its outcome unrecorded) is neither: it is not sent again; nor is one of its own
   * claims, which the claim's scan takes up.
   */
  isOwnUncalled(entry: OutboxEntry): boolean {
    const lease = entry.lease;
    return !this.#reserving.has(entry.key) && entry.state === "sending" && lease !== null && lease.owner === this.#h.instanceId() &&
      lease.incarnation === this.#h.incarnation && lease.token === entry.fence &&
      !this.#h.leases.has("outbox", entry.key) && !this.calling.has(entry.key) &&
      ((entry.fence === WRITER_TOKEN && !entry.called) || this.#h.leases.givenUpUncalled(entry.key, entry.fence));
  }

  #resultOf(entry: OutboxEntry): SendResult {
    const result: SendResult = { key: entry.key, state: entry.state };
    if (entry.messageId !== null) result.messageId = entry.messageId;
    if (entry.error !== null && entry.state !== "sent") result.error = entry.error;
    return result;
  }

  /**
   * Call the provider for a leased entry and record the outcome. The lease is
   * held (heartbeated) from its claim on; the call is first journaled
   * (`markCalling`, which renews the lease), and made only if that answered
   * within half a lease that the lease is still ours. A channel that already
   * confirmed the send (a delivery status; with `resend`, `confirm`) spares
   * the call. `answered` is told the result as soon as the provider answered, before its journal write.
   */
  async deliver(
    lease: HeldLease,
    entry: OutboxEntry,
    content?: OutboundContent,
    resend = false,
    announced = false,
    answered?: (result: SendResult) => void,
  ): Promise<SendResult> {
    const { key, chatId } = entry;
    let attempt = entry.attempts;
    const provider = this.#h.host.provider;
    let called = false;
    let settled = false;
    try {
      if (stepOf(entry) !== undefined) {
        // A step's attempt: only its message's handler can run it.
        const state = await settleAbandonedStep(this.#h, lease, entry, resend);
        return { key, state: state === "lost" ? entry.state : state };
      }
      let confirmed = this.#h.ambiguity.confirmedId(key);
      let via: "status" | "confirm" = "status";
      if (confirmed === undefined && resend && provider.confirm !== undefined) {
        // 'resend' of an ambiguous send: ask the channel first whether the lost call arrived.
        const answer = await this.#h.ambiguity.askConfirm(entry).catch((error) => {
          if (!this.#h.halted()) this.#h.report(error, `confirmation of ambiguous send "${key}" by provider "${provider.name}"`);
          return null;
        });
        if (this.#h.halted()) throw new Error("The process died");
        if (answer?.delivered) {
          confirmed = answer.messageId;
          via = "confirm";
        }
      }
      if (confirmed !== undefined) {
        // The channel already said an earlier attempt arrived (a delivery status, or confirm): no second call.
        this.#h.ambiguity.forgetConfirmed(key);
        const messageId = confirmed;
        settled = await this.#h.outcomes.record(lease, (token) => this.#h.backend.outbox.markSent(key, token, messageId), ["sent"]);
        if (settled) {
          this.#h.ambiguity.resolved({ key, chatId, state: "sent", messageId, via });
        }
        return { key, state: "sent", messageId };
      }
      if (!await this.#admitByLimits(lease, chatId, content !== undefined)) return await this.#notOurs(key);
      // Announced by its reservation: the call goes out now, unless that answer came too late (then the
      // announcement is made again, renewing the lease, as after a late markCalling answer).
      if (!(announced && this.#freshlyAnnounced(lease)) && !await this.#announceCall(lease)) return await this.#notOurs(key);
      // Re-leased to this process while it waited (its own sweep took the lease for lapsed): the call
      // is the attempt of the token it announced under.
      attempt = lease.attempts ?? attempt;
      if (attempt > 1) this.#h.metrics.outboxRetried++;
      let messageId: string;
      try {
        this.calling.add(key);
        called = true;
        const call = { key, chatId, attempt, inboundId: entry.inboundId, createdAt: entry.createdAt };
        const receipt = await this.#h.observer.providerCall(call, () => provider.send(
          chatId,
          content ?? decodeContent(entry.content) as OutboundContent,
          { idempotencyKey: key, attempt, signal: this.#h.signal },
        ));
        messageId = this.#messageIdOf(receipt, key);
        answered?.({ key, state: "sent", messageId });
      } catch (error) {
        if (isProcessDeath(error) || this.#h.halted()) {
          this.#h.halt();
          throw error;
        }
        const failed = await this.#sendFailed(lease, entry, error);
        settled = failed.recorded;
        return failed.result;
      }
      settled = await this.#h.outcomes.record(lease, (token) => this.#h.backend.outbox.markSent(key, token, messageId), ["sent"]);
      if (settled) {
        this.#h.observer.replySent(entry.inboundId);
        // Recorded late: the send had been taken for lost during the call and reported ambiguous (by a sweep
        // of this process, or of another, which refused this lease's heartbeat); its outcome settles the alert.
        if (!resend && (lease.lost || this.#h.ambiguity.wasReported(key, lease.token))) {
          this.#h.ambiguity.resolved({ key, chatId, state: "sent", messageId, via: "call" });
        }
      }
      this.#h.ambiguity.forgetConfirmed(key);
      return { key, state: "sent", messageId };
    } catch (error) {
      if (isProcessDeath(error)) this.#h.halt();
      throw error;
    } finally {
      if (settled || !called) this.calling.delete(key);
      this.#h.leases.release("outbox", key, lease.token);
    }
  }

  /**
   * Wait, holding the lease (heartbeats renew it), until the rate limits admit a send to `chatId`.
   * Nothing is journaled meanwhile: a crash during the wait leaves the send never called, so it is sent
   * again later without an attempt spent, never taken for an ambiguous one.
   * A send made now (a handler's reply) goes ahead of sends the worker took from the journal (a
   * broadcast), so a reply never waits behind a backlog.
   * @returns whether the send may go on (`false`: the lease was lost, or the process stops)
   */
  async #admitByLimits(lease: HeldLease, chatId: string, urgent: boolean): Promise<boolean> {
    const throttle = this.#h.throttle;
    if (throttle === null) return true;
    const gone = () => this.#h.halted() || this.#h.stopping() || lease.lost || this.#h.leases.get("outbox", lease.id) !== lease;
    const admitted = await throttle.admit(chatId, gone, urgent);
    if (admitted === "waited") this.#h.metrics.outboxThrottled++;
    return admitted !== false && !gone();
  }

  /**
   * Journal the provider call under an outbox `lease` (`markCalling`, which also renews it) and say
   * whether the call may go out now: still held, not lost, and answered within half a lease. A lease
   * lost before the announcement was never called, so recovery sends it again instead of holding it
   * as ambiguous.
   */
  async #announceCall(lease: HeldLease): Promise<boolean> {
    if (this.#h.halted()) return false;
    if (lease.lost || this.#h.leases.get("outbox", lease.id) !== lease) return false;
    if (this.madeUnknown.get(lease.id) === lease.token) {
      // This process's own sweep already made this lease unknown (its answer came late): no call under it.
      // It was never called, so it goes back in the queue (already reported, an operator sees it).
      this.madeUnknown.delete(lease.id);
      if (await this.#h.backend.outbox.retry(lease.id).catch(() => false)) this.#h.wake(0);
      return false;
    }
    const leaseMs = this.#h.config.outbox.leaseMs;
    // A journal error leaves it unknown whether the lease holds (a renewal whose reply was lost): ask again.
    for (let attempt = 1; attempt <= 3; attempt++) {
      const token = lease.token;
      const renewed = await this.#h.leases.renew(lease, true);
      if (this.#h.halted()) return false;
      // Re-leased to this process meanwhile (a sweep handed it the new token): announce under that one.
      if (renewed === "lost" && lease.token !== token && !lease.lost) continue;
      // Held when the backend answered; an answer that came late (a stall, a slow network) may be older
      // than the lease itself: then it is renewed again before a call goes out under it.
      if (renewed === "held" && this.#h.clock.monotonic() - lease.confirmedAt >= leaseMs / 2 && !lease.lost && lease.token === token) continue;
      // Held, and still ours here: a sweep may have given it up (requeued it) while the renewal was out.
      if (renewed === "held") return this.#h.leases.get("outbox", lease.id) === lease && !lease.lost && lease.token === token;
      if (renewed === "lost") return false;
      if (this.#h.clock.monotonic() - lease.confirmedAt >= leaseMs) break;
      await sleep(this.#h.clock, Math.max(1, Math.floor(leaseMs / 10)));
    }
    // Still leased to us, perhaps: a send of its key takes it up again (as a lease it never confirmed),
    // or a sweep once its lease lapses.
    this.#h.leases.markUncalled(lease.id, lease.token);
    // Its call may be journaled (by the reservation, or by an announcement above whose answer came late or
    // not at all) though none was made: taken back as a retry that gives its attempt back, so that a sweep
    // does not take the lapsed lease for an ambiguous call (failing that, it is reported ambiguous, never
    // sent twice silently).
    const error = "The call announced for this send was not made: its lease was not confirmed in time";
    for (let tries = 0; tries < 3 && !this.#h.halted(); tries++) {
      if (tries > 0) await sleep(this.#h.clock, Math.max(1, Math.floor(leaseMs / 10)));
      const written = await this.#h.backend.outbox.markFailed(lease.id, lease.token, { error, retryInMs: 0, throttled: true }).then(
        () => true,
        (failure) => failure instanceof StaleLeaseError ? null : false, // null: taken or settled meanwhile
      );
      if (written === false) continue;
      if (written) {
        this.#h.leases.drop(lease);
        this.#h.wake(0);
      }
      break;
    }
    return false;
  }

  /**
   * Whether a lease whose reservation announced its call may be called now without another journal
   * write: still held and not lost, not made unknown here meanwhile, and the reservation answered
   * within half a lease (`confirmedAt` is when it was asked), as {@link #announceCall} requires of a
   * markCalling answer.
   */
  #freshlyAnnounced(lease: HeldLease): boolean {
    return !this.#h.halted() && !lease.lost && this.#h.leases.get("outbox", lease.id) === lease &&
      this.madeUnknown.get(lease.id) !== lease.token &&
      this.#h.clock.monotonic() - lease.confirmedAt < this.#h.config.outbox.leaseMs / 2;
  }

  /** The answer for a send whose lease another instance took before the provider call: it is theirs now. */
  async #notOurs(key: string): Promise<SendResult> {
    if (this.#h.halted()) throw new Error("The process died");
    const current = await this.#h.backend.outbox.get(key).catch(() => null);
    return current === null ? { key, state: "queued" } : { ...this.#resultOf(current), deduped: true };
  }


  #messageIdOf(receipt: unknown, key: string): string {
    const messageId = (receipt as { messageId?: unknown } | null | undefined)?.messageId;
    if (typeof messageId === "string" && messageId !== "") return messageId;
    if (typeof messageId === "number" && Number.isFinite(messageId)) return String(messageId);
    this.#h.warn({
      code: "provider-receipt",
      key,
      message: `Provider "${this.#h.host.provider.name}" returned no usable "messageId" for send "${key}" (got ${
        JSON.stringify(messageId) ?? "undefined"
      }); recorded as sent without a message id`,
    });
    return "";
  }

  async #sendFailed(lease: HeldLease, entry: OutboxEntry, error: unknown): Promise<{ result: SendResult; recorded: boolean }> {
    const { key } = entry;
    const provider = this.#h.host.provider;
    let classified;
    try {
      classified = (provider.classifyError ?? classifyProviderError)(error);
    } catch {
      classified = classifyProviderError(error);
    }
    const text = errorText(error);
    const outbox = this.#h.backend.outbox;
    if (classified.retryable && classified.maybeDelivered === true) {
      // The call may have reached the channel (a timeout after the request went out): ambiguous, as if
      // its sender had died during it. Held as unknown and reported; 'resend' reports it and retries.
      if (this.#h.config.outbox.onAmbiguous === "hold") {
        const outcome = { error: text, ambiguous: true } as const;
        const recorded = await this.#h.outcomes.record(lease, (token) => outbox.markFailed(key, token, outcome), ["unknown"]);
        if (recorded) this.#h.ambiguity.settle({ ...entry, state: "unknown", fence: lease.token });
        return { result: { key, state: "unknown", error: text }, recorded };
      }
      this.#h.ambiguity.report(entry);
    }
    if (classified.retryable && classified.rateLimited !== undefined && classified.maybeDelivered !== true) {
      return await this.#throttled(lease, entry, text, classified.rateLimited, classified.retryAfterMs);
    }
    const dead = !classified.retryable || entry.attempts > this.#h.config.outbox.retries;
    if (dead) {
      const outcome = { error: text, dead: true } as const;
      const recorded = await this.#h.outcomes.record(lease, (token) => outbox.markFailed(key, token, outcome), ["dead"]);
      if (recorded) {
        this.#h.metrics.outboxDead++;
        this.#h.host.events.emit("durability:dead", { kind: "outbound", id: key, error: text });
      }
      return { result: { key, state: "dead", error: text }, recorded };
    }
    const retryInMs = retryDelay(entry.attempts, this.#h.config.outbox.backoff, classified.retryAfterMs, () => this.#h.clock.random());
    const outcome = { error: text, retryInMs };
    const recorded = await this.#h.outcomes.record(lease, (token) => outbox.markFailed(key, token, outcome), ["failed"]);
    if (recorded) this.#h.wake(retryInMs);
    return { result: { key, state: "failed", error: text }, recorded };
  }

  /**
   * The channel refused a send for its rate limit (nothing was sent): due again after `retryAfterMs`
   * with its attempt given back (`throttled`). Its chat waits behind it (the journal keeps chat order);
   * a global limit also pauses every chat through the rate limiter.
   */
  async #throttled(
    lease: HeldLease,
    entry: OutboxEntry,
    text: string,
    scope: "chat" | "global",
    retryAfterMs: number | undefined,
  ): Promise<{ result: SendResult; recorded: boolean }> {
    const { key } = entry;
    const retryInMs = Math.min(MAX_TIMER_MS, Math.max(0, Math.ceil(retryAfterMs ?? DEFAULT_RETRY_AFTER_MS)));
    const bucket = scope === "global" ? this.#h.throttle?.globalBucket() : undefined;
    if (bucket !== undefined) {
      await this.#h.throttle!.pause(bucket, retryInMs).catch((error) => void this.#h.report(error, "outbox rate limiter pause"));
    }
    const outcome = { error: text, retryInMs, throttled: true };
    const recorded = await this.#h.outcomes.record(lease, (token) => this.#h.backend.outbox.markFailed(key, token, outcome), ["failed"]);
    if (recorded) {
      this.#h.metrics.outboxThrottled++;
      this.#h.wake(retryInMs);
    }
    return { result: { key, state: "failed", error: text }, recorded };
  }

  async #bypass(chatId: string, content: OutboundContent, key: string, reason: string): Promise<SendResult> {
    this.#h.metrics.outboxBypassed++;
    this.#h.warn({
      code: "outbox-bypassed",
      key,
      message: `Send "${key}" bypassed the outbox (sent once, no journal, no retries): ${reason}`,
    });
    const run = async (): Promise<SendResult> => {
      // Not journaled, so it cannot queue behind earlier sends of the chat: it waits for them here.
      for (;;) {
        await this.#chatTails.get(chatId);
        if (this.#h.halted()) throw new Error("The process died");
        if (this.#h.stopping()) break;
        const earlier = await this.#h.backend.outbox.list({ chatId, state: BLOCKING_OUTBOX_STATES, limit: 1 });
        if (earlier.length === 0) break;
        // Without timers an earlier send is retried only by the next bot.sweep(), after this request
        // is over: waiting would hold the request to its end. It goes now, ahead of them.
        if (this.#h.config.sweepIntervalMs === 0) break;
        await sleep(this.#h.clock, Math.max(20, this.#h.config.sweepIntervalMs));
      }
      return this.inChatOrder(chatId, async () => {
        const call = { key, chatId, attempt: 1, inboundId: null };
        const receipt = await this.#h.observer.providerCall(call, () =>
          this.#h.host.provider.send(chatId, content, { idempotencyKey: key, attempt: 1, signal: this.#h.signal }));
        return { key, state: "sent" as const, messageId: this.#messageIdOf(receipt, key), bypassed: true };
      });
    };
    const result = run();
    this.#h.host.track(result);
    return result;
  }
}
