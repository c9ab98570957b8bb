// The mini harness must fail when it should: a harness whose checks cannot fail would make the Node/Deno runs worthless.
import { describe, expect, test } from "bun:test";
import { createHarness, deepEqual } from "./harness.ts";

describe("mini harness for Node/Deno runs", () => {
  test("deepEqual", () => {
    expect(deepEqual({ a: [1, { b: "x" }], c: undefined }, { a: [1, { b: "x" }] })).toBe(true);
    expect(deepEqual({ a: [1, 2] }, { a: [2, 1] })).toBe(false);
    expect(deepEqual([1], { 0: 1 })).toBe(false);
    expect(deepEqual(null, {})).toBe(false);
    expect(deepEqual(NaN, NaN)).toBe(true);
  });

  test("reports failing, passing, skipped and timed-out tests", async () => {
    const h = createHarness();
    h.describe("suite", () => {
      h.test("passes", () => h.expect(1).toBe(1));
      h.test("fails toBe", () => h.expect(1, "one").toBe(2));
      h.test("fails not.toEqual", () => h.expect({ a: 1 }).not.toEqual({ a: 1 }));
      h.test("fails toBeGreaterThan", () => h.expect(1).toBeGreaterThan(1));
      h.test("fails async", async () => {
        await Promise.resolve();
        h.expect([1]).toEqual([2]);
      });
      h.test("times out", () => new Promise(() => {}));
      h.test.skip!("skipped", () => {});
    });
    const lines: string[] = [];
    const result = await h.run({ timeoutMs: 50, log: (l) => lines.push(l) });
    expect(result.passed).toBe(1);
    expect(result.skipped).toBe(1);
    expect(result.failed).toEqual([
      "suite > fails toBe",
      "suite > fails not.toEqual",
      "suite > fails toBeGreaterThan",
      "suite > fails async",
      "suite > times out",
    ]);
    expect(lines[0]).toContain("one: expected 1 to be 2");
  });
});
