import { describe, expect, test } from "bun:test";
import { ProviderError } from "../mod.ts";
import { MockProvider } from "../testing.ts";

const ctx = (key: string) => ({ idempotencyKey: key, attempt: 1, signal: new AbortController().signal });

describe("MockProvider.failNext", () => {
  test("fails the next n sends, then sends again", async () => {
    const mock = new MockProvider();
    mock.failNext(2);
    await expect(mock.send("c", "a", ctx("a"))).rejects.toBeInstanceOf(ProviderError);
    await expect(mock.send("c", "b", ctx("b"))).rejects.toBeInstanceOf(ProviderError);
    expect((await mock.send("c", "c", ctx("c"))).messageId).toBe("mock-msg-1");
    expect(mock.calls.map((c) => c.ok)).toEqual([false, false, true]);
  });

  test("failNext(0) fails nothing", async () => {
    const mock = new MockProvider();
    mock.failNext(0);
    await mock.send("c", "a", ctx("a"));
    expect(mock.sent.map((s) => s.idempotencyKey)).toEqual(["a"]);
  });

  test("a new call replaces what an earlier one left; failNext(0) cancels it", async () => {
    const mock = new MockProvider();
    mock.failNext(3);
    mock.failNext(1, new ProviderError("blocked", { retryable: false }));
    await expect(mock.send("c", "a", ctx("a"))).rejects.toThrow("blocked");
    await mock.send("c", "b", ctx("b"));
    mock.failNext(5);
    mock.failNext(0);
    await mock.send("c", "c", ctx("c"));
    expect(mock.calls.map((c) => c.ok)).toEqual([false, true, true]);
  });

  test("a negative or fractional count is a RangeError naming the argument", () => {
    const mock = new MockProvider();
    expect(() => mock.failNext(-1)).toThrow(RangeError);
    expect(() => mock.failNext(1.5)).toThrow(/Argument "n"/);
  });
});
