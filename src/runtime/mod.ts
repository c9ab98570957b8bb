/**
 * The runtime shim: the only module of the core that touches `node:*`,
 * `Deno.*` or `Bun.*`. Everything else in `src/` is Web-standard.
 *
 * @module
 */

interface DenoLike {
  hostname(): string;
}

const runtimeGlobals = globalThis as unknown as { Deno?: DenoLike; process?: unknown };

let cachedHostname: string | undefined;

/**
 * The machine's hostname, or `'localhost'` where it cannot be read (Deno
 * without `--allow-sys`, a browser, a worker).
 *
 * @returns the hostname
 */
export async function hostname(): Promise<string> {
  if (cachedHostname !== undefined) return cachedHostname;
  let name = "localhost";
  try {
    if (runtimeGlobals.Deno !== undefined) {
      name = runtimeGlobals.Deno.hostname();
    } else if (runtimeGlobals.process !== undefined) {
      const os = await import("node:os");
      name = os.hostname();
    }
  } catch {
    // No permission or no such API: keep the fallback.
  }
  cachedHostname = name || "localhost";
  return cachedHostname;
}

/** A random id (UUID v4) from Web Crypto. */
export function randomId(): string {
  return crypto.randomUUID();
}

/**
 * Resolve after `ms` milliseconds, or reject when `signal` aborts.
 *
 * @param ms the delay
 * @param signal aborts the wait
 * @returns a promise resolved after the delay
 */
export function delay(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(signal.reason);
    const timer = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    const onAbort = () => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/**
 * Run `fn` on the next turn of the event loop, after the pending microtasks
 * (`setImmediate` where the runtime has it, else `setTimeout(fn, 0)`): the
 * group commits of the SQLite and Postgres backends and the Redis backend's batched script
 * calls gather what one turn called.
 *
 * @param fn what to run
 */
export function nextTurn(fn: () => void): void {
  const immediate = (globalThis as { setImmediate?: (fn: () => void) => unknown }).setImmediate;
  if (typeof immediate === "function") immediate(fn);
  else setTimeout(fn, 0);
}

/**
 * Keep a timer from holding the process open (Node, Bun, Deno).
 *
 * @param timer what `setTimeout`/`setInterval` returned
 */
export function unrefTimer(timer: unknown): void {
  if (typeof timer === "number" && runtimeGlobals.Deno !== undefined) {
    (runtimeGlobals.Deno as unknown as { unrefTimer?(id: number): void }).unrefTimer?.(timer);
    return;
  }
  (timer as { unref?: () => void } | undefined)?.unref?.();
}
