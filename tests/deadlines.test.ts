import { describe, expect, test } from "bun:test";
import { BoundedMap, BoundedSet } from "../src/bounded_map.ts";
import type { Clock, ClockTimer } from "../src/clock.ts";
import { Deadlines } from "../src/deadlines.ts";

/** A clock whose time moves only by `advance`; it counts the timers it holds armed. */
function manualClock() {
  let now = 0;
  const timers = new Map<number, { at: number; fn: () => void }>();
  let next = 1;
  const clock: Clock = {
    now: () => now,
    monotonic: () => now,
    random: () => 0.5,
    setTimeout(fn, ms) {
      const id = next++;
      timers.set(id, { at: now + ms, fn });
      return id as unknown as ClockTimer;
    },
    clearTimeout(timer) {
      timers.delete(timer as unknown as number);
    },
  };
  return {
    clock,
    get armed() {
      return timers.size;
    },
    async advance(ms: number) {
      now += ms;
      for (const [id, t] of [...timers].sort((a, b) => a[1].at - b[1].at)) {
        if (t.at <= now && timers.delete(id)) t.fn();
      }
      await new Promise((r) => setTimeout(r, 0));
    },
  };
}

describe("Deadlines", () => {
  test("a promise that settles in time keeps its value or error; one that does not is rejected at its deadline", async () => {
    const m = manualClock();
    const deadlines = new Deadlines(m.clock);
    const fast = deadlines.within(Promise.resolve(1), 100, () => new Error("late"));
    const failing = deadlines.within(Promise.reject(new Error("own")), 100, () => new Error("late"));
    let release!: (v: number) => void;
    const slow = deadlines.within(new Promise<number>((r) => release = r), 100, () => new Error("late"));
    let slowError: unknown;
    slow.catch((e) => slowError = e);
    expect(await fast).toBe(1);
    await expect(failing).rejects.toThrow("own");
    await m.advance(99);
    expect(slowError).toBeUndefined();
    await m.advance(1);
    expect((slowError as Error).message).toBe("late");
    release(2); // a late settlement changes nothing
    await expect(slow).rejects.toThrow("late");
  });

  test("deadlines of different lengths each fire on time under one timer", async () => {
    const m = manualClock();
    const deadlines = new Deadlines(m.clock);
    const fired: string[] = [];
    for (const [name, ms] of [["a", 300], ["b", 100], ["c", 200]] as const) {
      deadlines.within(new Promise<never>(() => {}), ms, () => new Error(name)).catch((e) => fired.push((e as Error).message));
    }
    expect(m.armed).toBe(1);
    await m.advance(100);
    expect(fired).toEqual(["b"]);
    await m.advance(100);
    expect(fired).toEqual(["b", "c"]);
    await m.advance(100);
    expect(fired).toEqual(["b", "c", "a"]);
    expect(m.armed).toBe(0);
  });

  test("close leaves no timer armed once nothing is pending, and later calls still time out", async () => {
    const m = manualClock();
    const deadlines = new Deadlines(m.clock);
    await deadlines.within(Promise.resolve(1), 100, () => new Error("late"));
    expect(m.armed).toBe(1); // kept armed while running: it fires once and finds nothing
    deadlines.close();
    expect(m.armed).toBe(0);
    let release!: () => void;
    const pending = deadlines.within(new Promise<void>((r) => release = r), 100, () => new Error("late"));
    expect(m.armed).toBe(1);
    release();
    await pending;
    expect(m.armed).toBe(0);
    const late = deadlines.within(new Promise<never>(() => {}), 50, () => new Error("late")).catch((e: Error) => e.message);
    await m.advance(50);
    expect(await late).toBe("late");
  });

  test("settled waiters do not pile up: many sequential promises leave a bounded heap behind", async () => {
    const m = manualClock();
    const deadlines = new Deadlines(m.clock);
    for (let i = 0; i < 20_000; i++) await deadlines.within(Promise.resolve(i), 10_000, () => new Error("late"));
    expect(deadlines.kept).toBeLessThanOrEqual(1025);
    let release!: () => void;
    const last = deadlines.within(new Promise<void>((r) => release = r), 10_000, () => new Error("late")).catch((e: Error) => e.message);
    expect(m.armed).toBe(1);
    await m.advance(10_000);
    expect(await last).toBe("late");
    release();
  });
});

describe("BoundedMap and BoundedSet", () => {
  test("keep the newest capacity keys; a key deleted and added again is new, and its old slot evicts nothing", () => {
    const set = new BoundedSet<string>(3);
    for (const v of ["a", "b", "c"]) set.add(v);
    set.delete("a");
    set.add("a"); // now newest
    set.add("d"); // 4 kept would be too many: the oldest live one, b, goes
    expect(["a", "b", "c", "d"].filter((v) => set.has(v))).toEqual(["a", "c", "d"]);
    expect(set.size).toBe(3);
    for (let i = 0; i < 10_000; i++) set.add(`x${i}`);
    expect(set.size).toBe(3);
    expect(["x9997", "x9998", "x9999"].every((v) => set.has(v))).toBe(true);
  });

  test("set on an existing key replaces its value and keeps its place", () => {
    const map = new BoundedMap<string, number>(2);
    map.set("a", 1);
    map.set("b", 2);
    map.set("a", 3);
    map.set("c", 4);
    expect(map.get("a")).toBeUndefined();
    expect(map.get("b")).toBe(2);
    expect(map.get("c")).toBe(4);
    expect(() => new BoundedMap(0)).toThrow(RangeError);
  });
});
