/**
 * Sends whose outcome is unknown (a call that may have reached the channel): reported at once as
 * `durability:ambiguous`, then settled when the channel can tell (a delivery status the bot saw, the
 * provider's `confirm`) or by an operator, and told as `durability:resolved`.
 *
 * @module
 */
import { retryDelay } from "../backoff.ts";
import { BoundedSet } from "../bounded_map.ts";
import type { Clock } from "../clock.ts";
import type { ResolvedDurability } from "../config.ts";
import { decodeContent } from "../content.ts";
import { type DurabilityBackend, type OutboxEntry, type OutboxState, StaleLeaseError } from "../contract.ts";
import type { OutboundContent, SendConfirmation } from "../provider.ts";
import { checkConfirmation, withTimeout } from "./calls.ts";
import { stepOf } from "./steps.ts";
import type { BotEvents, DurabilityMetrics, EngineHost } from "./types.ts";

/** How long a provider's `confirm` may take before the send is left to an operator. */
const CONFIRM_TIMEOUT_MS = 10_000;
/** Delivery statuses and reports remembered (the latest ones). */
const REMEMBERED = 10_000;

/** What the ambiguity handling needs from the engine. */
export interface AmbiguityHost {
  backend: DurabilityBackend;
  config: ResolvedDurability;
  host: EngineHost;
  clock: Clock;
  /** The engine's counters (updated in place). */
  metrics: DurabilityMetrics;
  /** The signal of the process's calls (aborted when it dies). */
  signal: AbortSignal;
  halted(): boolean;
  report(error: unknown, context: string): void;
  wake(inMs: number): void;
  /** Counts a send reported ambiguous in the sweep totals. */
  countAmbiguous(): void;
}

/** The sends this process reported ambiguous, and how they settle. */
export class Ambiguity {
  readonly #a: AmbiguityHost;
  /** Keys the channel confirmed delivered while their entry was still on its way: key → message id. */
  readonly #confirmed = new Map<string, string>();
  /** `key#fence` of the sends this incarnation reported ambiguous (a lost scan's report must not repeat them). */
  readonly #reported = new BoundedSet<string>(REMEMBERED);

  constructor(host: AmbiguityHost) {
    this.#a = host;
  }

  /**
   * The channel says the send of `key` arrived (a delivery status): an `unknown` entry is settled as
   * sent; one still on its way is remembered, so that its next call, or its ambiguity, uses it.
   * @returns whether an `unknown` entry was settled
   */
  async confirmSent(key: string, messageId: string): Promise<boolean> {
    if (typeof key !== "string" || key === "") throw new TypeError(`confirmSent: "key" must be a non-empty string, got ${JSON.stringify(key) ?? "undefined"}`);
    if (typeof messageId !== "string") {
      throw new TypeError(`confirmSent: "messageId" must be a string, got ${JSON.stringify(messageId) ?? "undefined"}`);
    }
    if (this.#a.halted()) return false;
    // Remembered before the entry is read: a sweep that makes it unknown after the read finds it here.
    this.#confirmed.set(key, messageId);
    if (this.#confirmed.size > REMEMBERED) this.#confirmed.delete(this.#confirmed.keys().next().value!);
    const entry = await this.#a.backend.outbox.get(key);
    if (entry === null || entry.state === "sent" || entry.state === "dead") {
      this.#confirmed.delete(key);
      return false;
    }
    if (entry.state !== "unknown") return false; // on its way: its next call, or its ambiguity, uses it
    this.#confirmed.delete(key);
    return await this.resolveSent(entry, messageId, "status") === "resolved";
  }

  /** The message id a delivery status gave for `key`, if one came while it was on its way. */
  confirmedId(key: string): string | undefined {
    return this.#confirmed.get(key);
  }

  /** Forget a delivery status of `key` (its entry is settled). */
  forgetConfirmed(key: string): void {
    this.#confirmed.delete(key);
  }

  /** Whether this incarnation reported the send of `key` under `fence` ambiguous. */
  wasReported(key: string, fence: number): boolean {
    return this.#reported.has(`${key}#${fence}`);
  }

  /**
   * An entry that just became `unknown`: reported at once (the report must not wait on anything a
   * crash could cut short), then settled if the channel can tell: a delivery status seen earlier, or
   * the provider's `confirm`.
   */
  settle(entry: OutboxEntry): void {
    this.report(entry);
    if (stepOf(entry) !== undefined) return; // a step: only its own code could tell, an operator settles it
    const provider = this.#a.host.provider;
    const stashed = this.#confirmed.get(entry.key);
    if (stashed === undefined && provider.confirm === undefined) return;
    const work = this.#resolve(entry, stashed).catch((error) => {
      if (!this.#a.halted()) this.#a.report(error, `confirmation of ambiguous send "${entry.key}" by provider "${provider.name}"`);
    });
    this.#a.host.track(work);
  }

  /** Report a send (or a step) as ambiguous: counted and told (`durability:ambiguous`). */
  report(entry: { key: string; chatId: string; fence?: number; content?: OutboxEntry["content"] }): void {
    if (entry.fence !== undefined) {
      this.#reported.add(`${entry.key}#${entry.fence}`);
    }
    this.#a.metrics.outboxAmbiguous++;
    this.#a.countAmbiguous();
    const step = entry.content === undefined ? undefined : stepOf({ chatId: entry.chatId, content: entry.content });
    this.#a.host.events.emit(
      "durability:ambiguous",
      step === undefined ? { key: entry.key, chatId: entry.chatId } : { key: entry.key, chatId: step.chatId, step: step.name },
    );
  }

  /** The provider's `confirm` answer for `entry`, checked, within {@link CONFIRM_TIMEOUT_MS}. */
  async askConfirm(entry: OutboxEntry): Promise<SendConfirmation | null> {
    const provider = this.#a.host.provider;
    const asked = provider.confirm!({
      idempotencyKey: entry.key,
      chatId: entry.chatId,
      content: decodeContent(entry.content) as OutboundContent,
      signal: this.#a.signal,
    });
    return checkConfirmation(
      await withTimeout(this.#a.clock, Promise.resolve(asked), CONFIRM_TIMEOUT_MS, () => new Error(`no answer within ${CONFIRM_TIMEOUT_MS} ms`)),
      provider.name,
    );
  }

  /** Record an `unknown` entry as sent on the channel's word: `resolved`, or its state now (someone else acted). */
  async resolveSent(entry: OutboxEntry, messageId: string, via: "status" | "confirm" | "operator"): Promise<"resolved" | OutboxState | "gone"> {
    try {
      await this.#a.backend.outbox.markSent(entry.key, entry.fence, messageId);
    } catch (error) {
      if (!(error instanceof StaleLeaseError)) throw error;
      return (await this.#a.backend.outbox.get(entry.key))?.state ?? "gone";
    }
    const step = stepOf(entry);
    this.resolved({ key: entry.key, chatId: step?.chatId ?? entry.chatId, state: "sent", messageId, via });
    return "resolved";
  }

  /** An ambiguous send settled (by the channel or an operator): counted and told (`durability:resolved`). */
  resolved(event: BotEvents["durability:resolved"]): void {
    this.#a.metrics.outboxResolved++;
    this.#a.host.events.emit("durability:resolved", event);
  }

  async #resolve(entry: OutboxEntry, stashed: string | undefined): Promise<void> {
    if (stashed !== undefined) {
      this.#confirmed.delete(entry.key);
      if (await this.resolveSent(entry, stashed, "status") !== "unknown") return;
    }
    const provider = this.#a.host.provider;
    if (provider.confirm === undefined) return;
    const answer = await this.askConfirm(entry);
    if (answer === null || this.#a.halted()) return;
    if (answer.delivered) {
      await this.resolveSent(entry, answer.messageId, "confirm");
      return;
    }
    // It certainly never arrived: a failed attempt like any other, retried after its backoff under the
    // same retry budget (dead once spent), and only while nobody acted on the entry since (fenced).
    const error = `Provider "${provider.name}" confirmed that the send never arrived`;
    const { outbox } = this.#a.config;
    const dead = entry.attempts > outbox.retries;
    const retryInMs = retryDelay(entry.attempts, outbox.backoff, undefined, () => this.#a.clock.random());
    const outcome = dead ? { error, dead: true } as const : { error, retryInMs };
    try {
      await this.#a.backend.outbox.markFailed(entry.key, entry.fence, outcome);
    } catch (failure) {
      if (failure instanceof StaleLeaseError) return; // resolved or retried meanwhile
      throw failure;
    }
    this.resolved({ key: entry.key, chatId: entry.chatId, state: dead ? "dead" : "failed", via: "confirm" });
    if (dead) {
      this.#a.metrics.outboxDead++;
      this.#a.host.events.emit("durability:dead", { kind: "outbound", id: entry.key, error });
    } else {
      this.#a.wake(retryInMs);
    }
  }
}
