/**
 * The answers of due scans kept in the process, so that a scan whose reply
 * was lost can be asked again (`ClaimDueOptions.repeat`): for a backend
 * whose scan runs in the caller's process (memory, file, SQLite, an events
 * journal), where the answer is known the moment the scan commits.
 *
 * @module
 */
import type { ClaimDueOptions, OutboxClaim } from "./contract.ts";

/** Callers whose latest answer is kept (the least recently scanning go first past it). */
const CALLERS = 256;

/**
 * Keeps the latest non-empty answer of each caller's named scans (owner and
 * incarnation: a caller asks again before it scans again) and answers a
 * repeat from it. In the process, a scan has committed when its promise
 * settles, so a repeat (made after that) closes nothing.
 *
 * @example
 * ```ts
 * import { ScanAnswers } from "@botmesh/durable/backend";
 *
 * const answers = new ScanAnswers<string[]>(() => [], (a) => a.length === 0);
 * const options = { owner: "o", incarnation: "i", leaseMs: 1000, limit: 10, requestId: "r1" };
 * await answers.answer(options, async () => ["a"]);
 * console.log(await answers.answer({ ...options, repeat: true }, async () => ["never run"])); // ["a"]
 * ```
 */
export class ScanAnswers<T> {
  readonly #kept = new Map<string, { id: string; answer: T }>();
  readonly #empty: () => T;
  readonly #isEmpty: (answer: T) => boolean;

  /**
   * @param empty the answer to a repeat of a scan that took nothing (or is no longer kept)
   * @param isEmpty whether an answer took nothing (such answers are not kept)
   */
  constructor(empty: () => T, isEmpty: (answer: T) => boolean) {
    this.#empty = empty;
    this.#isEmpty = isEmpty;
  }

  /**
   * Run `scan` and keep its answer under `options.requestId`; with
   * `options.repeat`, answer the kept one instead (or the empty answer) and
   * run nothing. `copy` gives the caller its own copy of a kept answer.
   */
  async answer(options: ClaimDueOptions, scan: () => Promise<T> | T, copy: (answer: T) => T = (a) => a): Promise<T> {
    checkScanRequest(options, "claimDue");
    if (options.repeat === true) {
      const kept = this.#kept.get(callerOf(options));
      return kept !== undefined && kept.id === options.requestId ? copy(kept.answer) : this.#empty();
    }
    const answer = await scan();
    this.keep(options, answer, copy);
    return answer;
  }

  /**
   * Keep `answer` (a copy, by `copy`) as the caller's latest under `options.requestId`, unless it took
   * nothing: for a scan that is not one atomic step, what it had confirmed when it failed.
   */
  keep(options: ClaimDueOptions, answer: T, copy: (answer: T) => T = (a) => a): void {
    const id = options.requestId;
    if (id === undefined || options.repeat === true) return;
    const caller = callerOf(options);
    this.#kept.delete(caller);
    if (this.#isEmpty(answer)) return;
    this.#kept.set(caller, { id, answer: copy(answer) });
    if (this.#kept.size > CALLERS) this.#kept.delete(this.#kept.keys().next().value!);
  }
}

function callerOf(options: ClaimDueOptions): string {
  return `${options.owner}\u0000${options.incarnation}`;
}

/**
 * Checks a due scan's `requestId` and `repeat` (`repeat` needs a `requestId`).
 * @param options the scan's options
 * @param op the operation, for the error (e.g. `"inbox.claimDue"`)
 * @returns the `requestId`, or `undefined` when the scan has none
 * @throws {TypeError} naming the option
 */
export function checkScanRequest(options: ClaimDueOptions, op = "claimDue"): string | undefined {
  const id: unknown = options.requestId;
  if (id !== undefined && (typeof id !== "string" || id === "")) {
    throw new TypeError(`${op}: option "requestId" must be a non-empty string, got ${JSON.stringify(id) ?? String(id)}`);
  }
  if (options.repeat === true && id === undefined) throw new TypeError(`${op}: option "repeat" needs a "requestId"`);
  return id;
}

/** Whether an outbox scan took nothing. */
export function isEmptyClaim(claim: OutboxClaim): boolean {
  return claim.due.length === 0 && claim.ambiguous.length === 0;
}

/** A deep copy of an outbox scan's answer (an entry in both lists stays one object in the copy). */
export function copyClaim(claim: OutboxClaim): OutboxClaim {
  return structuredClone(claim);
}
