/**
 * The options of {@link SQLiteStore} and {@link SQLiteDurability}, and their checks.
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import { SQLITE_DRIVERS, type SqliteDriverName } from "../../src/runtime/sqlite.ts";
import { showValue as show } from "../../src/show.ts";

/** Options of {@link SQLiteStore} and {@link SQLiteDurability}. */
export interface SQLiteOptions {
  /** Path of the database file (created 0600, with its directory, when missing), or a SQLite `file:` URI. Required. */
  file: string;
  /** How long a statement waits for another process's write lock, in ms (default 5000). */
  busyTimeoutMs?: number;
  /**
   * `"full"` (default): each commit (one per group commit) is fsynced and survives a power loss.
   * `"normal"`: faster; safe against a process crash, but a power loss may
   * roll back the last commits.
   */
  synchronous?: "full" | "normal";
  /** `"auto"` (default: by runtime) or `"bun:sqlite"`, `"node:sqlite"`, `"better-sqlite3"`. */
  driver?: "auto" | SqliteDriverName;
  /** Prepended to the table names (default `"botmesh_"`); letters, digits and `_`. */
  tablePrefix?: string;
  /**
   * The clock in ms since epoch (default `() => Date.now()`): every lease
   * expiry, due time, `updatedAt` and session expiry is computed from it.
   * Every process on the file must use the same clock: replace it only for
   * tests in simulated time. It must return a finite number.
   */
  clock?: () => number;
  /**
   * Check every page of the file when it is opened (`PRAGMA quick_check`), so that a damaged file is
   * refused at once (default `true`). It reads the whole file: about 1 s for a 400 MB file of two
   * million records. Without it, damage is found by the first statement that meets it.
   */
  checkOnOpen?: boolean;
}

/** Options of {@link SQLiteStore}. */
export type SQLiteStoreOptions = SQLiteOptions;
/** Options of {@link SQLiteDurability}. */
export type SQLiteDurabilityOptions = SQLiteOptions;

const OPTION_NAMES = ["file", "busyTimeoutMs", "synchronous", "driver", "tablePrefix", "clock", "checkOnOpen"] as const;
const DEFAULT_BUSY_TIMEOUT_MS = 5000;

/** The checked options, with their defaults. */
export interface ResolvedOptions {
  file: string;
  busyTimeoutMs: number;
  synchronous: "full" | "normal";
  driver: "auto" | SqliteDriverName;
  prefix: string;
  /** The checked clock. */
  clock: () => number;
  checkOnOpen: boolean;
}

/** Checks `options` (a TypeError or RangeError naming the option) and fills in the defaults. */
export function resolveOptions(options: unknown): ResolvedOptions {
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`SQLite options must be an object with a "file", got ${show(options)}`);
  }
  const o = options as Record<string, unknown>;
  checkKnownOptions(o, OPTION_NAMES, "SQLite option");
  const file = o.file;
  if (typeof file !== "string" || file.length === 0) {
    throw new TypeError(`SQLite option "file" must be a non-empty string, got ${show(file)}`);
  }
  const busy = o.busyTimeoutMs ?? DEFAULT_BUSY_TIMEOUT_MS;
  if (typeof busy !== "number") {
    throw new TypeError(`SQLite option "busyTimeoutMs" must be a number, got ${show(busy)}`);
  }
  if (!Number.isInteger(busy) || busy < 0 || busy > 2_147_483_647) {
    throw new RangeError(`SQLite option "busyTimeoutMs" must be an integer from 0 to 2147483647, got ${show(busy)}`);
  }
  const synchronous = o.synchronous ?? "full";
  if (synchronous !== "full" && synchronous !== "normal") {
    throw new RangeError(`SQLite option "synchronous" must be "full" or "normal", got ${show(synchronous)}`);
  }
  const driver = o.driver ?? "auto";
  if (driver !== "auto" && !(SQLITE_DRIVERS as readonly unknown[]).includes(driver)) {
    throw new RangeError(
      `SQLite option "driver" must be "auto", ${SQLITE_DRIVERS.map((d) => `"${d}"`).join(", ")}, got ${show(driver)}`,
    );
  }
  const prefix = o.tablePrefix ?? "botmesh_";
  if (typeof prefix !== "string") {
    throw new TypeError(`SQLite option "tablePrefix" must be a string, got ${show(prefix)}`);
  }
  if (!/^[A-Za-z_][A-Za-z0-9_]{0,47}$/.test(prefix)) {
    throw new RangeError(
      `SQLite option "tablePrefix" must start with a letter or "_" and hold only letters, digits and "_" (at most 48), got ${
        show(prefix)
      }`,
    );
  }
  const clock = o.clock ?? (() => Date.now());
  if (typeof clock !== "function") {
    throw new TypeError(`SQLite option "clock" must be a function, got ${show(clock)}`);
  }
  const checked = (): number => {
    const time = (clock as () => unknown)();
    if (typeof time !== "number" || !Number.isFinite(time)) {
      throw new TypeError(`SQLite option "clock" must return a finite number, got ${show(time)}`);
    }
    return time;
  };
  const checkOnOpen = o.checkOnOpen ?? true;
  if (typeof checkOnOpen !== "boolean") {
    throw new TypeError(`SQLite option "checkOnOpen" must be a boolean, got ${show(checkOnOpen)}`);
  }
  return { file, busyTimeoutMs: busy, synchronous, driver: driver as ResolvedOptions["driver"], prefix, clock: checked, checkOnOpen };
}
