/**
 * An async context: a value that follows a call through its awaits, timers
 * and promise callbacks (`AsyncLocalStorage` on Node, Bun, Deno and workerd
 * with `nodejs_compat`). Runtimes without one (a browser) get `null`.
 *
 * @module
 */

/** A value carried through the async calls that `run` starts. */
export interface AsyncContext<T> {
  /** Run `fn` with `value` as the context of everything it calls, now or later. */
  run<R>(value: T, fn: () => R): R;
  /** The value of the innermost `run` this call descends from, or `undefined`. */
  get(): T | undefined;
}

interface AsyncLocalStorageLike<T> {
  run<R>(value: T, fn: () => R): R;
  getStore(): T | undefined;
}

type StorageClass = new <T>() => AsyncLocalStorageLike<T>;

let storageClass: Promise<StorageClass | null> | undefined;

function loadStorageClass(): Promise<StorageClass | null> {
  const global = (globalThis as { AsyncLocalStorage?: StorageClass }).AsyncLocalStorage;
  if (typeof global === "function") return Promise.resolve(global);
  return import("node:async_hooks").then(
    (hooks) => (hooks as unknown as { AsyncLocalStorage?: StorageClass }).AsyncLocalStorage ?? null,
    () => null,
  );
}

/**
 * Make a new async context, or `null` where the runtime has none.
 *
 * @returns the context, or `null`
 */
export async function createAsyncContext<T>(): Promise<AsyncContext<T> | null> {
  storageClass ??= loadStorageClass();
  const Storage = await storageClass;
  if (Storage === null) return null;
  const storage = new Storage<T>();
  return { run: (value, fn) => storage.run(value, fn), get: () => storage.getStore() };
}
