/**
 * The SQLite part of the runtime shim: picks a driver for the running runtime
 * and normalizes it to one tiny synchronous interface.
 *
 * | runtime | driver |
 * | --- | --- |
 * | Bun | `bun:sqlite` |
 * | Deno, Node ≥ 22.13 (22.5 with `--experimental-sqlite`) | `node:sqlite` |
 * | Node 20 (or `node:sqlite` unavailable) | `better-sqlite3` (optional peer dependency) |
 *
 * Each driver is loaded only when it is tried, so a runtime never loads the
 * driver of another. `better-sqlite3` (a CommonJS package, for Node 20) is
 * loaded with `require` from `node:module`, not `import()`: Deno, which never
 * uses it, then does not fetch it with the rest of the module graph.
 *
 * @module
 */

/** A value bound to a `?` parameter or read from a column. */
export type SqliteValue = string | number | null;

/** A result row, by column name. */
export type SqliteRow = Record<string, SqliteValue>;

/** A prepared statement with positional `?` parameters. */
export interface SqliteStatement {
  /**
   * Runs a statement that returns no rows. @returns how many rows it changed
   * @throws {TypeError} (as `get` and `all` do) when a parameter is not a string, a number or null
   */
  run(...params: SqliteValue[]): { changes: number };
  /** The first row, or `undefined` when there is none. */
  get(...params: SqliteValue[]): SqliteRow | undefined;
  /** Every row. */
  all(...params: SqliteValue[]): SqliteRow[];
}

/** The drivers this shim knows. */
export type SqliteDriverName = "bun:sqlite" | "node:sqlite" | "better-sqlite3";

/** An open database connection. */
export interface SqliteDatabase {
  /** Which driver opened it. */
  readonly driver: SqliteDriverName;
  /** Runs one or more statements without parameters. */
  exec(sql: string): void;
  /** Compiles one statement. */
  prepare(sql: string): SqliteStatement;
  /** Closes the connection (idempotent). */
  close(): void;
  /** Whether a transaction is open, or `null` when the driver does not say (node:sqlite before Node 22.16). */
  inTransaction(): boolean | null;
}

/** The drivers known, in the order `"auto"` tries them per runtime. */
export const SQLITE_DRIVERS: readonly SqliteDriverName[] = ["bun:sqlite", "node:sqlite", "better-sqlite3"];

interface RuntimeGlobals {
  Bun?: { version?: string };
  Deno?: { version?: { deno?: string } };
  process?: { versions?: { node?: string } };
}

const runtimeGlobals = globalThis as unknown as RuntimeGlobals;

/** A short name of the running runtime, for messages. */
export function runtimeName(): string {
  if (runtimeGlobals.Bun !== undefined) return `Bun ${runtimeGlobals.Bun.version ?? ""}`.trim();
  if (runtimeGlobals.Deno !== undefined) return `Deno ${runtimeGlobals.Deno.version?.deno ?? ""}`.trim();
  const node = runtimeGlobals.process?.versions?.node;
  return node ? `Node ${node}` : "this runtime";
}

/** The drivers `"auto"` tries on the running runtime, best first. */
export function driverCandidates(): SqliteDriverName[] {
  if (runtimeGlobals.Bun !== undefined) return ["bun:sqlite"];
  if (runtimeGlobals.Deno !== undefined) return ["node:sqlite"];
  return ["node:sqlite", "better-sqlite3"];
}

type RawStatement = {
  run(...params: unknown[]): { changes: number | bigint };
  get(...params: unknown[]): unknown;
  all(...params: unknown[]): unknown[];
};
type RawDatabase = { exec(sql: string): unknown; prepare(sql: string): RawStatement; close(): unknown };
type DatabaseClass = new (file: string, options?: Record<string, unknown> | number) => RawDatabase;

/**
 * Refuses a parameter that is not a {@link SqliteValue}, the same way on every
 * driver (bun:sqlite binds `undefined` as NULL; node:sqlite and better-sqlite3
 * throw an error that names neither the parameter nor the value).
 */
function checkParams(params: SqliteValue[]): SqliteValue[] {
  for (let i = 0; i < params.length; i++) {
    const value: unknown = params[i];
    if (value === null || typeof value === "string" || (typeof value === "number" && !Number.isNaN(value))) continue;
    throw new TypeError(
      `Cannot bind parameter ${i + 1} to SQLite: it must be a string, a number or null, got ${
        typeof value === "bigint" ? `${value}n` : typeof value === "number" ? "NaN" : value === undefined ? "undefined" : typeof value
      }`,
    );
  }
  return params;
}

function wrap(driver: SqliteDriverName, raw: RawDatabase): SqliteDatabase {
  let closed = false;
  return {
    driver,
    exec(sql) {
      raw.exec(sql);
    },
    prepare(sql) {
      const statement = raw.prepare(sql);
      return {
        run: (...params) => ({ changes: Number(statement.run(...checkParams(params)).changes) }),
        // bun:sqlite answers `null` when there is no row.
        get: (...params) => (statement.get(...checkParams(params)) ?? undefined) as SqliteRow | undefined,
        all: (...params) => statement.all(...checkParams(params)) as SqliteRow[],
      };
    },
    close() {
      if (closed) return;
      closed = true;
      raw.close();
    },
    inTransaction() {
      // bun:sqlite and better-sqlite3: `inTransaction`; node:sqlite: `isTransaction`.
      const flags = raw as { inTransaction?: unknown; isTransaction?: unknown };
      const open = flags.inTransaction ?? flags.isTransaction;
      return typeof open === "boolean" ? open : null;
    },
  };
}

/** Loads the constructor of `driver`, or throws what the import threw. */
async function loadDriver(driver: SqliteDriverName): Promise<DatabaseClass> {
  // Typed as records: the drivers' own types differ, and only the
  // constructor is used. The `.catch` marks each import as optional for
  // bundlers (an app bundled for Node has no bun:sqlite).
  const rethrow = (error: unknown): never => {
    throw error;
  };
  if (driver === "bun:sqlite") {
    const mod: Record<string, unknown> = await import("bun:sqlite").catch(rethrow);
    return mod.Database as DatabaseClass;
  }
  if (driver === "node:sqlite") {
    const mod: Record<string, unknown> = await import("node:sqlite").catch(rethrow);
    return mod.DatabaseSync as DatabaseClass;
  }
  // better-sqlite3 through require (not import(), which Deno would fetch from npm on every first run,
  // though it never uses it), resolved from this module, or from the working directory where this
  // module has no file URL (bundled to CommonJS, loaded over https).
  const { createRequire } = await import("node:module");
  const here = typeof import.meta.url === "string" && import.meta.url.startsWith("file:") ? import.meta.url : undefined;
  const cwd = (globalThis as { process?: { cwd?: () => string } }).process?.cwd?.() ?? ".";
  const requireFromHere = createRequire(here ?? `${cwd}/package.json`);
  return requireFromHere("better-sqlite3") as DatabaseClass;
}

/**
 * Creates the directory that will hold `file` when it does not exist
 * (`:memory:` and `file:` URIs are left alone). Best effort: when it cannot,
 * opening the database reports why.
 *
 * @param file the database path
 */
export async function ensureParentDir(file: string): Promise<void> {
  if (file === ":memory:" || file === "" || file.startsWith("file:")) return;
  const cut = Math.max(file.lastIndexOf("/"), file.lastIndexOf("\\"));
  if (cut <= 0) return;
  try {
    const { mkdirSync } = await import("node:fs");
    mkdirSync(file.slice(0, cut), { recursive: true });
  } catch {
    // No fs or no permission: the open reports it.
  }
}

/**
 * The local file that a database name lets the driver create: the path itself, or the path of a
 * `file:` URI (`file:/data/bot.db?mode=rwc`, `file:///data/bot.db`, `file:bot.db`, percent-escapes
 * decoded). `null` when it creates none: `:memory:`, `""` (a temporary database), a URI of an
 * in-memory database (`file::memory:`, `mode=memory`), one opened without creating (`mode=ro`,
 * `mode=rw`), or one naming another host.
 *
 * @param file the database name given to the driver
 * @returns the path, or `null`
 */
export function createdSqlitePath(file: string): string | null {
  if (file === ":memory:" || file === "") return null;
  if (!file.startsWith("file:")) return file;
  let rest = file.slice("file:".length).split("#", 1)[0]!;
  const query = rest.indexOf("?");
  const params = new URLSearchParams(query === -1 ? "" : rest.slice(query + 1));
  if (query !== -1) rest = rest.slice(0, query);
  if ((params.get("mode") ?? "rwc") !== "rwc") return null;
  if (rest.startsWith("//")) {
    const slash = rest.indexOf("/", 2);
    const authority = rest.slice(2, slash === -1 ? rest.length : slash);
    if (authority !== "" && authority !== "localhost") return null;
    rest = slash === -1 ? "" : rest.slice(slash);
  }
  let path: string;
  try {
    path = decodeURIComponent(rest);
  } catch {
    return null; // a bad escape: the driver reports it
  }
  return path === "" || path === ":memory:" ? null : path;
}

/**
 * Creates the file that opening `file` would create (see {@link createdSqlitePath}) empty,
 * readable and writable by its owner only (0600), when it does not exist: the driver then
 * opens a private file, and SQLite gives the `-wal` and `-shm` files it creates beside it
 * the same mode. Best effort, like {@link ensureParentDir}.
 *
 * @param file the database path or `file:` URI
 */
async function createPrivateFile(file: string): Promise<void> {
  const path = createdSqlitePath(file);
  if (path === null) return;
  try {
    const { closeSync, openSync } = await import("node:fs");
    closeSync(openSync(path, "wx", 0o600));
  } catch {
    // It exists (its mode is kept), or the open reports why it cannot be created.
  }
}

/** SQLite's primary result codes that mean the file is damaged: SQLITE_CORRUPT and SQLITE_NOTADB. */
const DAMAGE_CODES: ReadonlySet<number> = new Set([11, 26]);

/**
 * Whether a driver's error says that the database file is damaged:
 * `SQLITE_CORRUPT` (and its extended codes, such as `SQLITE_CORRUPT_INDEX`) or
 * `SQLITE_NOTADB`. bun:sqlite and better-sqlite3 name the code in `code`;
 * node:sqlite gives its number in `errcode` (`code` is `ERR_SQLITE_ERROR`).
 *
 * @param error what a driver threw
 * @returns whether it reports damage
 */
export function isDamageError(error: unknown): boolean {
  if (typeof error !== "object" || error === null) return false;
  const { code, errcode } = error as { code?: unknown; errcode?: unknown };
  if (typeof code === "string" && /^SQLITE_(CORRUPT|NOTADB)(_|$)/.test(code)) return true;
  return typeof errcode === "number" && DAMAGE_CODES.has(errcode & 0xff);
}

/**
 * Opens a SQLite database with the driver of the running runtime, or the
 * one asked for.
 *
 * @param file the database path (created when missing, with mode 0600)
 * @param driver `"auto"` (default) or a driver name
 * @returns the open connection
 * @throws {Error} naming what to install when no driver can be loaded, or
 *   the driver's error when the file cannot be opened
 */
export async function openSqlite(file: string, driver: SqliteDriverName | "auto" = "auto"): Promise<SqliteDatabase> {
  const candidates = driver === "auto" ? driverCandidates() : [driver];
  const failures: string[] = [];
  for (const name of candidates) {
    let Database: DatabaseClass;
    try {
      Database = await loadDriver(name);
      if (typeof Database !== "function") throw new Error("it exports no database class");
    } catch (error) {
      failures.push(`${name}: ${error instanceof Error ? error.message : String(error)}`);
      continue;
    }
    await ensureParentDir(file);
    await createPrivateFile(file);
    // bun:sqlite reads a name as a URI only when asked to (SQLITE_OPEN_READWRITE | CREATE | URI).
    const raw = name === "bun:sqlite" && file.startsWith("file:") ? new Database(file, 0x02 | 0x04 | 0x40) : new Database(file);
    return wrap(name, raw);
  }
  const hint = driver === "auto" && runtimeGlobals.Bun === undefined && runtimeGlobals.Deno === undefined
    ? "install better-sqlite3 (npm install better-sqlite3), or run on Node 22.13 or later (node:sqlite; 22.5 with --experimental-sqlite)"
    : driver === "better-sqlite3"
    ? "install better-sqlite3 (npm install better-sqlite3)"
    : `use a runtime that has ${driver === "auto" ? "a SQLite driver" : driver}`;
  throw new Error(
    `No SQLite driver could be loaded on ${runtimeName()}: ${hint} (tried ${failures.join("; ")})`,
  );
}
