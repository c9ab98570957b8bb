// The console's Basic sign-in: a bounded number of failed attempts per client within a window, then 429
// with Retry-After until the window ends; a successful sign-in clears the count.
import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory/durability.ts";
import type { Clock } from "../src/clock.ts";
import { basicAuth, durabilityConsole, SignInLimitedError } from "../src/ops/console.ts";

function manualClock() {
  let t = 1_700_000_000_000;
  const clock: Clock = { now: () => t, monotonic: () => t, setTimeout: () => undefined, clearTimeout: () => {}, random: () => 0.5 };
  return { clock, advance: (ms: number) => void (t += ms) };
}

const as = (user: string, password: string, from?: string): Request =>
  new Request("http://127.0.0.1/", {
    headers: { authorization: `Basic ${btoa(`${user}:${password}`)}`, ...(from === undefined ? {} : { "x-client": from }) },
  });

describe("console sign-in limit", () => {
  test("after maxFailures wrong passwords: 429 with Retry-After, the right password too, until the window ends", async () => {
    const { clock, advance } = manualClock();
    const dlq = durabilityConsole(new MemoryDurability(), {
      auth: basicAuth("ops", "correct horse", { maxFailures: 3, failureWindowMs: 60_000, clock }),
      onError: () => {},
    });
    for (let i = 0; i < 3; i++) expect((await dlq(as("ops", `guess-${i}`))).status).toBe(401);
    advance(10_000);
    const limited = await dlq(as("ops", "guess-3"));
    expect(limited.status).toBe(429);
    expect(limited.headers.get("retry-after")).toBe("50");
    expect(await limited.text()).toContain("Too many failed sign-ins");
    expect((await dlq(as("ops", "correct horse"))).status).toBe(429);
    advance(50_000);
    expect((await dlq(as("ops", "correct horse"))).status).toBe(200);
    await dlq.close();
  });

  test("a successful sign-in clears the count", async () => {
    const { clock } = manualClock();
    const auth = basicAuth("ops", "correct horse", { maxFailures: 3, clock });
    for (let round = 0; round < 5; round++) {
      expect(await auth(as("ops", "a"))).toBeNull();
      expect(await auth(as("ops", "b"))).toBeNull();
      expect(await auth(as("ops", "correct horse"))).toEqual({ user: "ops" });
    }
  });

  test("wrong user names count together and do not push the operator's count out", async () => {
    const { clock } = manualClock();
    const auth = basicAuth("ops", "correct horse", { maxFailures: 3, clock });
    for (let i = 0; i < 3; i++) expect(await auth(as("ops", `guess-${i}`))).toBeNull();
    for (let i = 0; i < 20_000; i++) {
      try {
        await auth(as(`user-${i}`, "x"));
      } catch (error) {
        expect(error).toBeInstanceOf(SignInLimitedError);
      }
    }
    await expect(auth(as("ops", "guess-3"))).rejects.toBeInstanceOf(SignInLimitedError);
  });

  test("with clientKey, each client has its own count", async () => {
    const { clock } = manualClock();
    const auth = basicAuth("ops", "correct horse", { maxFailures: 2, clock, clientKey: (r) => r.headers.get("x-client") });
    for (let i = 0; i < 2; i++) expect(await auth(as("ops", "wrong", "10.0.0.1"))).toBeNull();
    await expect(auth(as("ops", "wrong", "10.0.0.1"))).rejects.toBeInstanceOf(SignInLimitedError);
    expect(await auth(as("ops", "correct horse", "10.0.0.2"))).toEqual({ user: "ops" });
  });

  test("requests without credentials are not counted; options are checked", async () => {
    const { clock } = manualClock();
    const auth = basicAuth("ops", "correct horse", { maxFailures: 1, clock });
    for (let i = 0; i < 5; i++) expect(await auth(new Request("http://127.0.0.1/"))).toBeNull();
    expect(await auth(as("ops", "correct horse"))).toEqual({ user: "ops" });
    expect(() => basicAuth("ops", "pw", { maxFailures: 0 })).toThrow(/maxFailures/);
    expect(() => basicAuth("ops", "pw", { failureWindowMs: 10 })).toThrow(/failureWindowMs/);
  });
});
