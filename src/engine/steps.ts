/**
 * Durable steps: a handler's other effects (an LLM call, a payment, a write to the bot's own database)
 * journaled in the outbox as sends are, so that a rerun of the message gets the recorded result back
 * instead of running the step again.
 *
 * A step is a sequence of outbox entries, its attempts: `<key>` first, then `<key>#2`, `<key>#3`, … Each
 * attempt is reserved leased (its own chat `step:<key>`, so nothing else ever queues behind it), the
 * call announced (`markCalling`) before the step's function runs, and its result recorded with
 * `markSent` (the result's JSON is the entry's `messageId`). A failure the step gives up on is recorded
 * `dead`; a call that may have had its effect when its outcome was lost becomes `unknown` (the same rule
 * as a send: a lapsed lease after `markCalling`) and is reported. A lapsed attempt that never announced
 * its call, or one an operator requeued, is settled by the sweep that finds it as `sent` with the
 * {@link STEP_NOT_RUN} mark: the next run of the message starts the next attempt. An attempt whose
 * `markCalling` went unanswered (no call made) is given up as uncalled, and the next run of its message
 * in this process takes it up under the same lease, as a send's retry does.
 *
 * @module
 */
import { retryDelay } from "../backoff.ts";
import { sleep } from "../clock.ts";
import { hashText, isOverUtf8Limit } from "../content.ts";
import type { BoundedSet } from "../bounded_map.ts";
import { type JsonValue, type NewOutboxEntry, type OutboxEntry, StaleLeaseError } from "../contract.ts";
import { errorText, isProcessDeath } from "../errors.ts";
import { classifyProviderError } from "../provider.ts";
import { showValue as show } from "../show.ts";
import { checkWellFormed } from "../well_formed.ts";
import type { Ambiguity } from "./ambiguity.ts";
import type { HeldLease } from "./leases.ts";
import type { Outcomes } from "./outcomes.ts";
import type { EngineCore } from "./types.ts";

/** The `kind` of a step entry's content. */
export const STEP_KIND = "botmesh:step";
/** The `messageId` of a step attempt that never ran (settled by a sweep): the next attempt runs the step. */
export const STEP_NOT_RUN = "botmesh:step-not-run";
/** The `messageId` of a step attempt that ran (or may have) but whose result is not the step's: the next attempt's is. */
export const STEP_SUPERSEDED = "botmesh:step-superseded";
/** The chat of a step's attempts: `step:<key>`. */
export const STEP_CHAT_PREFIX = "step:";
/** The longest step name. */
const MAX_NAME = 200;

/** What a step's function is given. */
export interface StepCall {
  /**
   * The step's key, the same on every run and retry: pass it to a callee that deduplicates (Stripe's
   * `Idempotency-Key` header, an upsert's id), then the step is safe to run again (`idempotent: true`).
   */
  readonly idempotencyKey: string;
  /** 1 on the first call, more on a retry (of this run, or of a new attempt after an interruption). */
  readonly attempt: number;
  /** Aborted when the process dies under the step (a test's simulated death); `bot.stop()` waits for the step instead. */
  readonly signal: AbortSignal;
}

/** Options of `ctx.step()`. */
export interface StepOptions {
  /** The step's key (default `<message id>:step:<name>`, the message that fed the handler's current step). */
  key?: string;
  /**
   * Running the step again after an interruption whose outcome is unknown does no harm (it is idempotent
   * by nature, or its callee honours `idempotencyKey`). Default `false`: such a step is held and
   * reported ({@link StepAmbiguousError}), never run a second time on its own.
   */
  idempotent?: boolean;
  /**
   * How often a failed call is retried (with `durability.outbox.backoff`) before the step fails for
   * good (default `durability.outbox.retries`). An error is retried when it is retryable as a send's
   * would be: anything but an error with `retryable: false` (or a non-retryable `status`); an error that
   * may have taken effect (`maybeDelivered: true`, a `TimeoutError`) is retried only by an idempotent step.
   */
  retries?: number;
}

/**
 * The step failed for good (its error was not retryable, or its retries were spent): journaled, so a
 * rerun of the message throws this again without calling the step. Escaping the handler, it
 * dead-letters the message at once.
 */
export class StepFailedError extends Error {
  /** The step's key. */
  readonly key: string;
  /** The step's name. */
  readonly step: string;
  /**
   * @param step the step's name
   * @param key the step's key
   * @param error the journaled error text
   * @param cause the error itself, when this run made the call
   */
  constructor(step: string, key: string, error: string, cause?: unknown) {
    super(`Step "${step}" failed: ${error}`, cause === undefined ? undefined : { cause });
    this.name = "StepFailedError";
    this.step = step;
    this.key = key;
  }
}

/**
 * The step may have had its effect, but its result was not recorded (the process died during it, or it
 * timed out), and it is not `idempotent`: it is not run again. Reported as `durability:ambiguous`;
 * escaping the handler, it dead-letters the message. An operator checks what happened and either
 * confirms the step (`markDelivered`, optionally with its result as JSON) or lets it run again
 * (`retry`), then replays the message.
 */
export class StepAmbiguousError extends Error {
  /** The step's key. */
  readonly key: string;
  /** The step's name. */
  readonly step: string;
  /** The key of the attempt held as `unknown`. */
  readonly attemptKey: string;
  /**
   * @param step the step's name
   * @param key the step's key
   * @param attemptKey the attempt's outbox key
   * @param cause the error of the call, when this run made it
   */
  constructor(step: string, key: string, attemptKey: string, cause?: unknown) {
    super(
      `Step "${step}" may have run without its result being recorded (outbox entry "${attemptKey}" is unknown); ` +
        `it is not run again: confirm it or retry it, then replay the message`,
      cause === undefined ? undefined : { cause },
    );
    this.name = "StepAmbiguousError";
    this.step = step;
    this.key = key;
    this.attemptKey = attemptKey;
  }
}

/** Whether an error escaping a handler is a step's settled outcome (the message is dead-lettered at once). */
export function isStepOutcomeError(error: unknown): boolean {
  return error instanceof StepFailedError || error instanceof StepAmbiguousError;
}

/** The content of a step's attempt entry. */
interface StepContent {
  kind: typeof STEP_KIND;
  name: string;
  chatId: string;
  key: string;
}

/** The step content of an outbox entry, or `undefined` for a send. */
export function stepOf(entry: Pick<OutboxEntry, "chatId" | "content">): StepContent | undefined {
  const content = entry.content;
  if (!entry.chatId.startsWith(STEP_CHAT_PREFIX) || typeof content !== "object" || content === null || Array.isArray(content)) return undefined;
  const c = content as Record<string, JsonValue>;
  if (c.kind !== STEP_KIND || typeof c.name !== "string" || typeof c.chatId !== "string" || typeof c.key !== "string") return undefined;
  return c as unknown as StepContent;
}

/**
 * A step's result as its entry records it: `{"v": <result>}`, `{}` for `undefined`.
 * @throws {TypeError} when it is not JSON (a `BigInt`, a cycle)
 */
export function encodeStepResult(value: unknown): string {
  return JSON.stringify(value === undefined ? {} : { v: value });
}

/** The result a step entry recorded: `{ value }` (no `value`: `undefined`), or `undefined` when it holds none. */
export function stepResultOf(messageId: string | null): { value: JsonValue | undefined } | undefined {
  if (messageId === null || messageId === STEP_NOT_RUN || messageId === STEP_SUPERSEDED) return undefined;
  try {
    const parsed = JSON.parse(messageId) as unknown;
    if (typeof parsed === "object" && parsed !== null && !Array.isArray(parsed)) {
      return { value: (parsed as { v?: JsonValue }).v };
    }
  } catch {
    // an operator's confirmation without a result: the step returns undefined
  }
  return { value: undefined };
}

/**
 * What an operator's confirmation of a step records: its result given as JSON text (`""`: none).
 * @throws {TypeError} when `result` is not JSON
 */
export function stepResultText(result: string, key: string): string {
  if (result === "") return encodeStepResult(undefined);
  try {
    return encodeStepResult(JSON.parse(result) as JsonValue);
  } catch {
    throw new TypeError(`The result confirmed for step "${key}" must be JSON (or empty for none), got ${show(result)}`);
  }
}

/** One step call of a handler. */
export interface StepRequest {
  /** The inbound record whose handler runs the step. */
  recordId: string;
  /** Its chat. */
  chatId: string;
  key: string;
  name: string;
  fn: (call: StepCall) => unknown;
  options: StepOptions | undefined;
}

/** What steps need from the engine. */
export interface StepsHost extends EngineCore {
  outcomes: Outcomes;
  ambiguity: Ambiguity;
  /** Outbox keys whose call this incarnation started and whose outcome is not recorded (shared with sends). */
  calling: BoundedSet<string>;
  /** Whether `entry` is leased to this incarnation, not held here, and nobody called under its lease (shared with sends). */
  ownUncalled(entry: OutboxEntry): boolean;
  /** The signal of the process's calls (aborted when it dies). */
  signal: AbortSignal;
  /** Stop the engine: a simulated process death. */
  halt(): void;
}

/**
 * Check a step's arguments.
 * @throws {TypeError} naming the argument or option that is wrong
 * @throws {RangeError} when `retries` is out of range
 */
export function checkStepArguments(name: unknown, fn: unknown, options: unknown): void {
  if (typeof name !== "string" || name === "" || name.length > MAX_NAME) {
    throw new TypeError(`Argument "name" of ctx.step() must be a non-empty string of at most ${MAX_NAME} characters, got ${show(name)}`);
  }
  checkWellFormed(name, `Argument "name" of ctx.step()`);
  if (typeof fn !== "function") throw new TypeError(`Argument "fn" of ctx.step("${name}") must be a function, got ${show(fn)}`);
  if (options === undefined) return;
  if (typeof options !== "object" || options === null) throw new TypeError(`Options of ctx.step("${name}") must be an object, got ${show(options)}`);
  for (const field of Object.keys(options)) {
    if (!["key", "idempotent", "retries"].includes(field)) throw new TypeError(`Unknown option "${field}" of ctx.step("${name}")`);
  }
  const { key, idempotent, retries } = options as StepOptions;
  if (key !== undefined && (typeof key !== "string" || key === "" || key.length > 512)) {
    throw new TypeError(`Option "key" of ctx.step("${name}") must be a non-empty string of at most 512 characters, got ${show(key)}`);
  }
  if (key !== undefined) checkWellFormed(key, `Option "key" of ctx.step("${name}")`);
  if (idempotent !== undefined && typeof idempotent !== "boolean") {
    throw new TypeError(`Option "idempotent" of ctx.step("${name}") must be a boolean, got ${show(idempotent)}`);
  }
  if (retries !== undefined && (typeof retries !== "number" || !Number.isInteger(retries) || retries < 0 || retries > 1000)) {
    throw new RangeError(`Option "retries" of ctx.step("${name}") must be an integer from 0 to 1000, got ${show(retries)}`);
  }
}

/** The attempts' outbox key: `<key>`, then `<key>#<n>`. */
function attemptKey(key: string, n: number): string {
  return n === 1 ? key : `${key}#${n}`;
}

/** The number of the attempt `entryKey` of the step `key` (`undefined`: not one of its attempts). */
function attemptNumber(entryKey: string, key: string): number | undefined {
  if (entryKey === key) return 1;
  if (!entryKey.startsWith(`${key}#`)) return undefined;
  const n = Number(entryKey.slice(key.length + 1));
  return Number.isInteger(n) && n >= 2 ? n : undefined;
}

/** How the call of one attempt ended, when the step goes on: its result, or a retry after `delayMs`. */
type CallOutcome = { value: JsonValue | undefined } | { retryInMs: number };

/** Runs steps for handlers. */
export class Steps {
  readonly #h: StepsHost;

  constructor(host: StepsHost) {
    this.#h = host;
  }

  /**
   * Run a step of a handler, or return the result a run of it recorded. The step's state is its latest
   * attempt (the highest number of those journaled: an earlier one may have been purged).
   * @returns the step's result as recorded (its JSON round trip)
   * @throws {StepFailedError} when the step failed for good (now or on an earlier run)
   * @throws {StepAmbiguousError} when an earlier run may have had its effect and the step is not idempotent
   */
  async run(request: StepRequest): Promise<JsonValue | undefined> {
    const { key, name } = request;
    const idempotent = request.options?.idempotent === true;
    const retries = request.options?.retries ?? this.#h.config.outbox.retries;
    const outbox = this.#h.backend.outbox;
    let failedCalls = 0;
    for (let waited = 0;;) {
      this.#alive(request);
      const latest = await this.#latest(request);
      let next = 1;
      if (latest !== undefined) {
        const { n, entry } = latest;
        next = n + 1;
        if (entry.state === "sent") {
          const result = stepResultOf(entry.messageId);
          if (result !== undefined) {
            this.#h.metrics.stepsReplayed++;
            return result.value;
          }
          // no result in it (never run, or superseded): the next attempt
        } else if (entry.state === "dead") {
          this.#h.metrics.stepsReplayed++;
          throw new StepFailedError(name, key, entry.error ?? "failed");
        } else if (entry.state === "unknown") {
          // Not run again. (Reported once, by whoever made it unknown; the message's dead letter names it too.)
          if (!idempotent) throw new StepAmbiguousError(name, key, entry.key);
          // Safe to run again: the cut-off attempt is settled as superseded (so its alert closes, and a late
          // outcome of it can no longer stand for the step), then the next attempt runs.
          if (!await this.#supersede(request, entry)) continue;
        } else if (entry.state === "sending" && this.#h.ownUncalled(entry)) {
          // An earlier run of this process gave it up before its call (its announcement unanswered): its
          // lease is still ours and nothing ran under it, so this run takes it up (no lapse into an ambiguity).
          const lease = this.#h.leases.hold("outbox", entry.key, entry.fence, -Infinity);
          // What was read may be stale: a sweep of this process may have settled it since (an operator's
          // requeue, settled as never run) and let its lease go. Held here now, it is looked at again.
          const fresh = await outbox.get(entry.key).catch(() => null);
          if (fresh?.state !== "sending" || fresh.fence !== entry.fence || (fresh.called && !this.#h.leases.givenUpUncalled(entry.key, entry.fence))) {
            this.#h.leases.release("outbox", entry.key, lease.token);
            continue;
          }
          const outcome = await this.#call(request, entry, lease, n, failedCalls < retries);
          if ("value" in outcome) return outcome.value;
          failedCalls++;
          await sleep(this.#h.clock, outcome.retryInMs);
          continue;
        } else {
          // Another run has it (or had it: once its lease lapses, a sweep settles it).
          const leaseMs = this.#h.config.outbox.leaseMs;
          if (this.#h.config.sweepIntervalMs === 0 || waited > 2 * leaseMs) {
            throw new Error(`Step "${name}" is held by an earlier run of its message (outbox entry "${entry.key}" is ${entry.state}); retried later`);
          }
          const pause = Math.max(5, Math.min(1000, Math.floor(leaseMs / 4)));
          this.#h.wake(0);
          await sleep(this.#h.clock, pause);
          waited += pause;
          continue;
        }
      }
      const attempt = attemptKey(key, next);
      const reservedAt = this.#h.clock.monotonic();
      const reserved = await outbox.reserve(this.#entryOf(request, attempt), this.#h.claim("outbox"));
      if (reserved.status !== "leased") {
        // Journaled meanwhile (a concurrent run of the message, or a repeat of a reservation whose reply was lost).
        if (stepOf(reserved.entry)?.key !== key) {
          throw new TypeError(`The key "${attempt}" of step "${name}" is journaled for something else (a send, or another step): give the step a key of its own`);
        }
        continue;
      }
      const lease = this.#h.leases.hold("outbox", attempt, reserved.entry.fence, reservedAt);
      const outcome = await this.#call(request, reserved.entry, lease, next, failedCalls < retries);
      if ("value" in outcome) return outcome.value;
      failedCalls++;
      await sleep(this.#h.clock, outcome.retryInMs);
    }
  }

  /** The step's latest journaled attempt. */
  async #latest(request: StepRequest): Promise<{ n: number; entry: OutboxEntry } | undefined> {
    const entries = await this.#h.backend.outbox.list({ chatId: `${STEP_CHAT_PREFIX}${request.key}`, limit: 10_000 });
    let latest: { n: number; entry: OutboxEntry } | undefined;
    for (const entry of entries) {
      const n = attemptNumber(entry.key, request.key);
      if (n !== undefined && stepOf(entry)?.key === request.key && (latest === undefined || n > latest.n)) latest = { n, entry };
    }
    // (None: its first attempt's key may still be journaled by something else, a send; the reservation says so.)
    return latest;
  }

  /** Settle an `unknown` attempt of an idempotent step as superseded. @returns `false` when it changed meanwhile (look again) */
  async #supersede(request: StepRequest, entry: OutboxEntry): Promise<boolean> {
    try {
      await this.#h.backend.outbox.markSent(entry.key, entry.fence, STEP_SUPERSEDED);
    } catch (error) {
      if (error instanceof StaleLeaseError) return false;
      throw error;
    }
    this.#h.ambiguity.resolved({ key: entry.key, chatId: request.chatId, state: "sent", via: "rerun" });
    return true;
  }

  #entryOf(request: StepRequest, attempt: string): NewOutboxEntry {
    const content: StepContent = { kind: STEP_KIND, name: request.name, chatId: request.chatId, key: request.key };
    return {
      key: attempt,
      chatId: `${STEP_CHAT_PREFIX}${request.key}`,
      content: content as unknown as JsonValue,
      contentHash: hashText(JSON.stringify(content)),
      inboundId: request.recordId,
    };
  }

  /** Throws when the handler's message is no longer this process's (its lease lost) or the process stops. */
  #alive(request: StepRequest): void {
    if (this.#h.halted()) throw new Error("The process died");
    const inbound = this.#h.leases.get("inbox", request.recordId);
    if (inbound?.lost === true) throw new Error(`Step "${request.name}": the lease on inbound record "${request.recordId}" was lost; its next run takes the step up`);
  }

  /**
   * Journal the call of a leased attempt (`markCalling`, asked again when its answer is lost or late),
   * make it, and record how it ended: the result; failed for good; `unknown` (it may have taken effect);
   * or, for a failure to retry, superseded (the next attempt retries it), so that a crash during the
   * backoff leaves nothing ambiguous behind.
   */
  async #call(request: StepRequest, entry: OutboxEntry, lease: HeldLease, n: number, mayRetry: boolean): Promise<CallOutcome> {
    const { key, name, fn } = request;
    const idempotent = request.options?.idempotent === true;
    const outbox = this.#h.backend.outbox;
    const calling = this.#h.calling;
    let settled = false;
    try {
      if (!await this.#announce(lease)) {
        // Nothing ran under this lease: a rerun of the message in this process may take it up.
        this.#h.leases.markUncalled(lease.id, lease.token);
        throw new Error(`Step "${name}": its call could not be journaled (outbox entry "${entry.key}"); not called, retried later`);
      }
      calling.add(entry.key);
      let value: unknown;
      this.#h.metrics.stepsCalled++;
      try {
        value = await fn({ idempotencyKey: key, attempt: n, signal: this.#h.signal });
      } catch (error) {
        if (isProcessDeath(error) || this.#h.halted()) {
          this.#h.halt();
          throw error;
        }
        const classified = classifyProviderError(error);
        const text = errorText(error);
        const maybeDone = classified.maybeDelivered === true;
        if (classified.retryable && maybeDone && !idempotent) {
          // It may have taken effect: held as unknown and reported, never run again on its own.
          const outcome = { error: text, ambiguous: true } as const;
          settled = await this.#h.outcomes.record(lease, (token) => outbox.markFailed(entry.key, token, outcome), ["unknown"]);
          if (settled) this.#h.ambiguity.report({ ...entry, fence: lease.token });
          throw new StepAmbiguousError(name, key, entry.key, error);
        }
        if (classified.retryable && mayRetry && !this.#h.stopping()) {
          settled = await this.#h.outcomes.record(lease, (token) => outbox.markSent(entry.key, token, STEP_SUPERSEDED), ["sent"]);
          if (!settled) throw error;
          const { backoff } = this.#h.config.outbox;
          const delay = retryDelay(n, backoff, classified.retryAfterMs, () => this.#h.clock.random());
          return { retryInMs: Math.min(delay, backoff.capMs) };
        }
        settled = await this.#failed(lease, entry.key, text);
        throw new StepFailedError(name, key, text, error);
      }
      let text: string | undefined;
      let refusal: string | undefined;
      try {
        text = encodeStepResult(value);
      } catch (error) {
        refusal = `its result is not JSON (${errorText(error)})`;
      }
      if (text !== undefined && isOverUtf8Limit(text, this.#h.config.outbox.maxPayloadBytes)) {
        refusal = `its result is larger than outbox.maxPayloadBytes (${this.#h.config.outbox.maxPayloadBytes})`;
      }
      if (refusal !== undefined || text === undefined) {
        // It ran: it must not run again. Recorded as failed for good, with the reason.
        settled = await this.#failed(lease, entry.key, `Step "${name}" ran, but ${refusal}`);
        throw new TypeError(`Step "${name}" ran, but ${refusal}; return JSON (or store it elsewhere and return its id)`);
      }
      const resultText = text;
      let answered = false;
      settled = await this.#h.outcomes.record(lease, async (token) => {
        await outbox.markSent(entry.key, token, resultText);
        answered = true;
      }, ["sent"]);
      // A write taken for ours after a lost reply (no answer) may be a rerun's (an idempotent step's attempt
      // superseded under the same fence): then the result is ours only if the entry holds it.
      const now = answered ? null : await outbox.get(entry.key).catch(() => null);
      if (settled && now !== null && now.messageId !== resultText) settled = false;
      if (!settled) {
        throw new Error(
          `Step "${name}" ran, but its result could not be recorded: its attempt (outbox entry "${entry.key}") was taken over ` +
            `(${now === null ? "gone" : `now ${now.state}`})`,
        );
      }
      if (lease.lost || this.#h.ambiguity.wasReported(entry.key, lease.token)) {
        // Taken for lost during the call (a stall) and reported: its recorded result settles the alert.
        this.#h.ambiguity.resolved({ key: entry.key, chatId: request.chatId, state: "sent", via: "call" });
      }
      return { value: stepResultOf(resultText)!.value };
    } finally {
      // An attempt whose outcome is not recorded stays "calling": this process's sweep reports it, never requeues it.
      if (settled) calling.delete(entry.key);
      this.#h.leases.release("outbox", entry.key, lease.token);
    }
  }

  /**
   * `markCalling` under the attempt's lease, asked again when its answer is lost (a repeat under the same
   * token answers `true` again) or came later than half a lease.
   * @returns whether the call may go out now
   */
  async #announce(lease: HeldLease): Promise<boolean> {
    const leaseMs = this.#h.config.outbox.leaseMs;
    for (let tries = 1; tries <= 3; tries++) {
      const token = lease.token;
      const renewed = await this.#h.leases.renew(lease, true);
      if (this.#h.halted()) throw new Error("The process died");
      if (renewed === "lost" || lease.lost || lease.token !== token) return false;
      if (renewed === "held" && this.#h.clock.monotonic() - lease.confirmedAt < leaseMs / 2) return true;
      if (renewed === "error") await sleep(this.#h.clock, Math.max(1, Math.floor(leaseMs / 10)));
    }
    return false;
  }

  async #failed(lease: HeldLease, attempt: string, error: string): Promise<boolean> {
    const outcome = { error, dead: true } as const;
    const recorded = await this.#h.outcomes.record(lease, (token) => this.#h.backend.outbox.markFailed(attempt, token, outcome), ["dead"]);
    if (recorded) {
      this.#h.metrics.stepsFailed++;
      this.#h.host.events.emit("durability:dead", { kind: "step", id: attempt, error });
    }
    return recorded;
  }
}

/**
 * A step attempt a sweep leased as due work (its run died before it announced the call, or an operator
 * requeued it): nobody can run it but its message's handler, so it is settled as never run
 * ({@link STEP_NOT_RUN}); with `resend` (it was called, re-leased by `onAmbiguous: 'resend'`) it is held
 * as `unknown` instead, as a step's ambiguity is never resent.
 * @returns the state it was left in
 */
export async function settleAbandonedStep(
  host: { backend: EngineCore["backend"]; outcomes: Outcomes },
  lease: HeldLease,
  entry: OutboxEntry,
  resend: boolean,
): Promise<"sent" | "unknown" | "lost"> {
  const outbox = host.backend.outbox;
  if (resend) {
    const outcome = { error: "A step's call may have run; its result was not recorded", ambiguous: true } as const;
    return await host.outcomes.record(lease, (token) => outbox.markFailed(entry.key, token, outcome), ["unknown"]) ? "unknown" : "lost";
  }
  return await host.outcomes.record(lease, (token) => outbox.markSent(entry.key, token, STEP_NOT_RUN), ["sent"]) ? "sent" : "lost";
}
