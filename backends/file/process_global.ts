/**
 * Module state shared by every copy of a module in the process: the package
 * may be loaded twice (an ESM and a CommonJS build, two installed versions,
 * a bundle beside the source), and the file backends' registries (open
 * files, held locks, held mutexes) must be one per process all the same.
 *
 * Internal to the file backends: not part of the public API.
 *
 * @module
 */

/**
 * The value kept in the `globalThis` slot `Symbol.for(key)`, created on first use.
 *
 * @param key the slot's name (a `Symbol.for` key: the same in every copy of the module)
 * @param create makes the value when the slot is empty
 * @returns the value in the slot
 */
export function processGlobal<T>(key: string, create: () => T): T {
  return ((globalThis as Record<symbol, unknown>)[Symbol.for(key)] ??= create()) as T;
}
