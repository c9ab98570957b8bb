/**
 * Faults for the lost-reply tests: a journal or kv whose chosen methods are replaced (to lose a reply
 * after the commit, or refuse a call), and a wait on a condition instead of a fixed sleep.
 */

/** `target` with the methods in `overrides` replaced; its other methods bound to it. */
export function proxied<T extends object>(target: T, overrides: Record<string, unknown>): T {
  return new Proxy(target, {
    get(t, prop, receiver) {
      if (typeof prop === "string" && prop in overrides) return overrides[prop];
      const value = Reflect.get(t, prop, receiver);
      return typeof value === "function" ? value.bind(t) : value;
    },
  });
}

/** Waits until `check()` holds (checked every 5 ms); fails naming `what` after `timeoutMs`. */
export async function until(check: () => boolean, what: string, timeoutMs = 10_000): Promise<void> {
  const deadline = performance.now() + timeoutMs;
  while (!check()) {
    if (performance.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 5));
  }
}
