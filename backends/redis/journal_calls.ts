/**
 * What both journals share: the arguments of their scripts (lease, claim,
 * list, failure outcome), and the calls that loop (purge in batches, a list
 * read again after a record was set aside).
 *
 * @module
 */
import type { ClaimOptions, FailOutcome, ListOptions } from "../../src/contract.ts";
import { checkFinite, normalizeList } from "../../src/rules.ts";
import { list, type Runner, strings } from "./runner.ts";

/** Records deleted per purge script call. */
const PURGE_BATCH = 500;

export function leaseArgs(lease: ClaimOptions | undefined): string[] {
  return lease ? ["1", lease.owner, lease.incarnation, String(lease.leaseMs), "0"] : ["0"];
}

export function claimArgs(options: ClaimOptions): string[] {
  return [options.owner, options.incarnation, String(options.leaseMs), options.reclaimOwn === true ? "1" : "0"];
}

export function listArgs<S extends string>(options: ListOptions<S> | undefined): { args: string[]; limit: number } {
  const { states, chatId, limit } = normalizeList(options);
  const wanted = states === null ? [] : [...states];
  return {
    args: [chatId === undefined ? "0" : "1", chatId ?? "", String(limit), String(wanted.length), ...wanted],
    limit,
  };
}

export function finishArgs(outcome: FailOutcome): string[] {
  if (outcome.ambiguous) return ["unknown", outcome.error, "0"];
  if (outcome.dead) return ["dead", outcome.error, "0"];
  return [outcome.throttled === true ? "throttled" : "retry", outcome.error, String(outcome.retryInMs)];
}

export async function purgeAll(runner: Runner, name: "inPurge" | "outPurge", olderThanMs: number): Promise<number> {
  let total = 0;
  for (;;) {
    const [deleted, scanned] = strings(await runner.run(name, [String(olderThanMs), String(PURGE_BATCH)]));
    total += Number(deleted);
    if (Number(scanned) < PURGE_BATCH) return total;
  }
}

/**
 * A list script's records, parsed. One that only this reader finds damaged is set aside, and the list
 * read again (a few times at most: then the records it can read).
 */
export async function listRead<T>(
  runner: Runner,
  name: "inList" | "outList",
  args: string[],
  read: (flat: unknown) => Promise<{ value: T | null; changed: boolean }>,
): Promise<T[]> {
  for (let round = 0; ; round++) {
    const out: T[] = [];
    let changed = false;
    for (const flat of list(await runner.run(name, args))) {
      const r = await read(flat);
      if (r.value) out.push(r.value);
      changed ||= r.changed;
    }
    if (!changed || round >= 2) return out;
  }
}

export function checkLimit(limit: unknown, op: string): number {
  checkFinite(limit, `${op}: option "limit"`);
  return Math.max(0, Math.floor(limit as number));
}
