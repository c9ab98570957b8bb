import { expect, test } from "bun:test";
import { errorDetail } from "../src/errors.ts";

test("errorDetail: the error, its causes (a non-Error cause by its type only) and the first frames of its stack, bounded", () => {
  const secret = new Error("outer", { cause: { config: { headers: { Authorization: "Bearer sk_live_SECRET" } } } });
  const text = errorDetail(secret);
  expect(text).not.toContain("SECRET");
  expect(text.split("\n").slice(0, 2)).toEqual(["Error: outer", "Caused by: a value of type object"]);

  const chained = new Error("a", { cause: new TypeError("b", { cause: "c" }) });
  const lines = errorDetail(chained).split("\n");
  expect(lines.slice(0, 3)).toEqual(["Error: a", "Caused by: TypeError: b", "Caused by: c"]);
  expect(lines.length).toBeGreaterThan(3);
  expect(lines.slice(3).every((line) => /^ {4}at /.test(line))).toBe(true);

  const loop = new Error("self");
  (loop as { cause?: unknown }).cause = loop;
  expect(errorDetail(loop).split("\n")[1]).not.toContain("Caused by");

  expect(errorDetail(new Error("x".repeat(10_000))).length).toBeLessThanOrEqual(4001);
  expect(errorDetail("plain")).toBe("plain");
});
