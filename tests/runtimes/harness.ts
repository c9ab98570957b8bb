/**
 * A tiny describe/test/expect for running the conformance suite on runtimes
 * without bun:test (Node 20 through a bundle, Deno with `deno run`). It has
 * only the matchers the suite uses (see `ConformanceMatchers`).
 */
import type { ConformanceHarness, ConformanceMatchers } from "../../src/testing/conformance.ts";

interface Case {
  name: string;
  fn?: () => Promise<void> | void;
}

/** Structural equality as jest's `toEqual`: object keys whose value is `undefined` count as absent. */
export function deepEqual(a: unknown, b: unknown): boolean {
  if (Object.is(a, b)) return true;
  if (typeof a !== "object" || typeof b !== "object" || a === null || b === null) return false;
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  if (Array.isArray(a)) {
    const bb = b as unknown[];
    return a.length === bb.length && a.every((v, i) => deepEqual(v, bb[i]));
  }
  if (a instanceof Uint8Array || b instanceof Uint8Array) {
    return a instanceof Uint8Array && b instanceof Uint8Array && a.length === b.length && a.every((v, i) => v === b[i]);
  }
  const ka = Object.keys(a).filter((k) => (a as Record<string, unknown>)[k] !== undefined);
  const kb = Object.keys(b).filter((k) => (b as Record<string, unknown>)[k] !== undefined);
  if (ka.length !== kb.length) return false;
  return ka.every((k) => deepEqual((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k]));
}

function show(value: unknown): string {
  try {
    return JSON.stringify(value) ?? String(value);
  } catch {
    return String(value);
  }
}

function matchers(actual: unknown, message: string | undefined, negate: boolean): ConformanceMatchers {
  const check = (ok: boolean, what: string, expected: unknown) => {
    if (ok !== negate) return;
    const head = message ? `${message}: ` : "";
    throw new Error(`${head}expected ${show(actual)} ${negate ? "not " : ""}${what} ${show(expected)}`);
  };
  const m: ConformanceMatchers = {
    toBe: (e) => check(Object.is(actual, e), "to be", e),
    toEqual: (e) => check(deepEqual(actual, e), "to equal", e),
    toBeGreaterThan: (e) => check((actual as number) > e, "to be >", e),
    toBeGreaterThanOrEqual: (e) => check((actual as number) >= e, "to be >=", e),
    toBeLessThan: (e) => check((actual as number) < e, "to be <", e),
    toBeLessThanOrEqual: (e) => check((actual as number) <= e, "to be <=", e),
    get not() {
      return matchers(actual, message, !negate);
    },
  };
  return m;
}

/** A harness that collects tests; `run()` runs them one after the other. */
export function createHarness(): ConformanceHarness & {
  run(options?: { timeoutMs?: number; log?: (line: string) => void }): Promise<{ passed: number; failed: string[]; skipped: number }>;
} {
  const cases: Case[] = [];
  const path: string[] = [];
  const test = Object.assign(
    (name: string, fn: () => Promise<void> | void) => void cases.push({ name: [...path, name].join(" > "), fn }),
    { skip: (name: string) => void cases.push({ name: [...path, name].join(" > ") }) },
  );
  return {
    describe(name, fn) {
      path.push(name);
      try {
        fn();
      } finally {
        path.pop();
      }
    },
    test,
    expect: (actual, message) => matchers(actual, message, false),
    async run(options) {
      const log = options?.log ?? ((line: string) => console.log(line));
      const timeoutMs = options?.timeoutMs ?? 20_000;
      const failed: string[] = [];
      let passed = 0;
      let skipped = 0;
      for (const c of cases) {
        if (!c.fn) {
          skipped++;
          continue;
        }
        let timer: ReturnType<typeof setTimeout> | undefined;
        try {
          await Promise.race([
            Promise.resolve().then(c.fn),
            new Promise((_, reject) => {
              timer = setTimeout(() => reject(new Error(`timed out after ${timeoutMs} ms`)), timeoutMs);
            }),
          ]);
          passed++;
        } catch (error) {
          failed.push(c.name);
          log(`FAIL ${c.name}\n  ${error instanceof Error ? error.stack ?? error.message : String(error)}`);
        } finally {
          clearTimeout(timer);
        }
      }
      return { passed, failed, skipped };
    },
  };
}
