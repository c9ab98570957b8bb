// The deterministic simulation (src/testing/sim) on MemoryDurability: seeds through the same runner as
// `npm run sim`, and the determinism check (one seed twice gives the identical trace).
// A failing seed prints the invariant and the command that replays it.
import { describe, expect, test } from "bun:test";
import { MemoryDurability } from "../backends/memory/durability.ts";
import { FAULT_KINDS, parseFaults, Prng, runSimulation, SIM_EPOCH, SimScheduler } from "../src/testing/sim/mod.ts";

const create = (serverNow: () => number) => new MemoryDurability({ clock: serverNow });
const SEEDS = Number(process.env.SIM_SEEDS ?? 300);
const CHUNK = 50;

describe("simulation", () => {
  test("the scheduler fires timers by due time, then insertion order", async () => {
    const sched = new SimScheduler();
    const order: string[] = [];
    sched.after(10, () => order.push("b"));
    sched.after(5, () => order.push("a"));
    sched.after(10, () => order.push("c"));
    const cancelled = sched.after(7, () => order.push("x"));
    sched.cancel(cancelled);
    expect(await sched.runUntil(SIM_EPOCH + 100)).toBe("empty");
    expect(order).toEqual(["a", "b", "c"]);
    expect(sched.elapsed).toBe(100); // time runs on to the deadline
  });

  test("the PRNG is reproducible and its forks are independent", () => {
    const a = new Prng(7);
    const b = new Prng(7);
    const xs = Array.from({ length: 5 }, () => a.next());
    expect(Array.from({ length: 5 }, () => b.next())).toEqual(xs);
    expect(new Prng(7).fork("x").next()).not.toBe(new Prng(7).fork("y").next());
    expect(xs.every((x) => x >= 0 && x < 1)).toBe(true);
  });

  test("--faults takes known kinds only", () => {
    expect(parseFaults("crash,lost-reply")).toEqual(["crash", "lost-reply"]);
    expect(() => parseFaults("crash,meteor")).toThrow(/meteor/);
    expect(FAULT_KINDS).toContain("server-clock-step");
  });

  test("the same seed twice gives the identical trace", async () => {
    for (const seed of [1, 2, 15, 38, 69, 179, 307, 496, 2953, 4242]) {
      const first = await runSimulation(create, { seed });
      const second = await runSimulation(create, { seed });
      expect(second.trace).toEqual(first.trace);
      expect(second.failures).toEqual(first.failures);
      expect(first.trace.length).toBeGreaterThan(5);
    }
  });

  test("a run arms no real timer", async () => {
    const result = await runSimulation(create, { seed: 3 });
    expect(result.failures.filter((f) => f.invariant === "real-timer")).toEqual([]);
  });

  for (let from = 1; from <= SEEDS; from += CHUNK) {
    const to = Math.min(SEEDS, from + CHUNK - 1);
    test(`seeds ${from}..${to} hold every invariant`, async () => {
      const failed: string[] = [];
      for (let seed = from; seed <= to; seed++) {
        const result = await runSimulation(create, { seed });
        for (const f of result.failures) {
          failed.push(`seed ${seed} ${f.invariant}: ${f.detail}\n    replay: npm run sim -- --seed ${seed}`);
        }
      }
      expect(failed).toEqual([]);
    }, 60_000);
  }
});
