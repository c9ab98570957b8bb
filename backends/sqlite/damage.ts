/**
 * A damaged database file: the check at open, and the `DamagedStorageError`
 * that names the file and what to do about it.
 *
 * @module
 */
import { DamagedStorageError } from "../../src/contract.ts";
import { errorMessage } from "../../src/errors.ts";
import { isDamageError, type SqliteDatabase } from "../../src/runtime/sqlite.ts";

/** Problems `quick_check` lists at most (its answer can be one line per damaged page). */
const MAX_PROBLEMS = 3;
/** The longest problem text quoted in the error. */
const MAX_PROBLEM_CHARS = 300;

/** What to do about a damaged file, for the error. */
function remedy(file: string): string {
  const path = JSON.stringify(file);
  return `stop every process that uses it, then restore it from a backup, or recover what it holds: ` +
    `sqlite3 ${path} ".recover" | sqlite3 ${JSON.stringify(`${file}.recovered`)}, ` +
    `then put that file in its place and delete ${JSON.stringify(`${file}-wal`)} and ${JSON.stringify(`${file}-shm`)}`;
}

/** Where a damaged file was met, for {@link damagedFile}. */
export interface DamageContext {
  /** The driver's error. */
  cause?: unknown;
  /** Met while the file was being opened: the error says that it could not be opened. */
  opening?: boolean;
  /** The driver, when one was loaded. */
  driver?: string | null;
  /** Whether the file may not be a SQLite database at all (the driver could not read it as one). */
  unreadable?: boolean;
}

/**
 * The error for a damaged file.
 *
 * @param file the database file
 * @param problem what is wrong (the driver's message, or what `quick_check` found)
 * @param context the driver's error, and whether the file was being opened
 * @returns the error, naming the file, the problem and what to do
 */
export function damagedFile(file: string, problem: string, context: DamageContext = {}): DamagedStorageError {
  const text = problem.length > MAX_PROBLEM_CHARS ? `${problem.slice(0, MAX_PROBLEM_CHARS)}…` : problem;
  const state = context.unreadable ? "it is not a SQLite database, or it is damaged" : "it is damaged";
  const via = context.driver ? ` (${context.driver})` : "";
  const what = context.opening
    ? `Cannot open SQLite file ${JSON.stringify(file)}${via}: ${state} (${text})`
    : `SQLite file ${JSON.stringify(file)} is damaged (${text})`;
  return new DamagedStorageError(`${what}; nothing read from it can be trusted: ${remedy(file)}`, {
    backend: "sqlite",
    location: file,
    cause: context.cause,
  });
}

/**
 * Checks every page and b-tree of the file (`PRAGMA quick_check`: it reads the
 * whole file, but does not check that each index matches its table).
 *
 * @param db the open database
 * @param file its path, for the error
 * @throws {DamagedStorageError} naming the file and what the check found
 */
export function checkPages(db: SqliteDatabase, file: string): void {
  let problems: string[];
  try {
    problems = db.prepare(`PRAGMA quick_check(${MAX_PROBLEMS})`).all().map((row) => String(Object.values(row)[0]));
  } catch (error) {
    if (isDamageError(error)) throw damagedFile(file, errorMessage(error), { cause: error, opening: true, driver: db.driver });
    throw error;
  }
  if (problems.length === 1 && problems[0] === "ok") return;
  const found = problems.flatMap((text) => text.split("\n")).filter((line) => line !== "" && !line.startsWith("*** in database"));
  throw damagedFile(file, `quick_check: ${found.join("; ")}`, { opening: true, driver: db.driver });
}
