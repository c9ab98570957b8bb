/**
 * The checks `openBackend` makes before it opens a backend, so that opening
 * one never creates it: a backend's `open()` creates what is missing (a
 * SQLite file's tables, a Postgres schema, a journal file), and a Redis key
 * prefix that holds nothing reads as an empty backend. A mistyped path,
 * `?schema=`, `?tablePrefix=` or `?keyPrefix=` is refused instead, naming
 * what was not found, what is there, and how a backend is created.
 *
 * Nor does opening one upgrade it: `open()` migrates a SQLite file or a
 * Postgres schema of an older version of this package, under the bots of
 * that older version that may be using it (a SQLite file upgraded under
 * them fails their writes). A schema of another version than this
 * package's is refused, naming both versions.
 *
 * @module
 */
import { errorMessage } from "../src/errors.ts";
import { OperationError } from "../src/ops/cli_command.ts";
import { dirName, resolvePath, statFile } from "../src/runtime/fs.ts";
import { openSqlite } from "../src/runtime/sqlite.ts";
import { POSTGRES_SCHEMA_VERSION, tables } from "./postgres/sql.ts";
import { SQLITE_SCHEMA_VERSION } from "./sqlite/schema.ts";

/** How a backend comes to exist, for the errors. */
const CREATED_BY = "a bot creates it when it starts (bot.start() calls the backend's open())";

/** What is found at most when listing the backends that are there instead. */
const MAX_FOUND = 10;

function others(kind: string, found: string[]): string {
  if (found.length === 0) return "";
  const shown = found.slice(0, MAX_FOUND).join(", ");
  return `; ${kind} found: ${shown}${found.length > MAX_FOUND ? ", …" : ""}`;
}

/**
 * Refuses a path that is not an existing file, naming the missing directory
 * when the directory is missing too.
 *
 * @param path the file
 * @param what what it is, for the message (`"SQLite file"`, `"Events journal file"`)
 * @param shown the URL as given (credentials hidden)
 * @param createdBy how such a file comes to exist (default: a bot creates it when it starts)
 * @throws {OperationError} naming the path and how the file is created
 */
export async function checkFile(path: string, what: string, shown: string, createdBy: string = CREATED_BY): Promise<void> {
  const st = await statFile(path);
  if (st !== null && !st.isDirectory) return;
  if (st !== null) throw new OperationError(`${what} ${JSON.stringify(path)} is a directory, not a file (from ${JSON.stringify(shown)})`);
  const dir = await dirName(await resolvePath(path));
  const dirMissing = (await statFile(dir)) === null;
  throw new OperationError(
    `${what} ${JSON.stringify(path)} does not exist${dirMissing ? ` (nor does its directory ${JSON.stringify(dir)})` : ""} ` +
      `(from ${JSON.stringify(shown)}): check the path; nothing is created here, ${createdBy}`,
  );
}

/**
 * Refuses a schema version other than the one this package writes: an older
 * one would be upgraded by `open()` under the bots that use it, a newer one
 * is not read by this package.
 *
 * @param where the backend, for the message (`SQLite file "x.db", tablePrefix "botmesh_"`)
 * @param found the stored `schema_version`, or `undefined` when there is none
 * @param current the version this package writes
 * @param shown the URL as given (credentials hidden)
 * @throws {OperationError} naming both versions and what to do
 */
export function checkSchemaVersion(where: string, found: unknown, current: number, shown: string): void {
  const version = typeof found === "string" && /^\d{1,9}$/.test(found) ? Number(found) : typeof found === "number" ? found : null;
  if (version === current) return;
  const from = `(from ${JSON.stringify(shown)})`;
  if (version === null) {
    throw new OperationError(
      `${where} has ${found === undefined || found === null ? "no schema version" : `an invalid schema version ${JSON.stringify(found)}`} ${from}: ` +
        `is it the bot's backend? Nothing is changed here`,
    );
  }
  if (version > current) {
    throw new OperationError(
      `${where} has schema version ${version}, written by a newer @botmesh/durable; this botmesh-durable reads schema version ` +
        `${current} ${from}: use the botmesh-durable of the bots' version (upgrade @botmesh/durable)`,
    );
  }
  throw new OperationError(
    `${where} has schema version ${version}, of an older @botmesh/durable; this botmesh-durable needs schema version ${current} ` +
      `${from}; it is not upgraded here, as bots of the older version may be using it: ` +
      `use the botmesh-durable of the bots' version, or start a bot of this version (it upgrades the schema when it starts)`,
  );
}

/**
 * Refuses a SQLite file without this backend's tables (another `tablePrefix`,
 * or not the bot's database), or of another schema version than this
 * package's ({@link checkSchemaVersion}).
 *
 * @param file an existing file
 * @param prefix the table prefix
 * @param shown the URL as given
 * @throws {OperationError} naming the file, the prefix, and the prefixes found; or both schema versions
 */
export async function checkSqliteTables(file: string, prefix: string, shown: string): Promise<void> {
  let names: string[];
  let version: unknown;
  try {
    const db = await openSqlite(file);
    try {
      names = db.prepare("SELECT name FROM sqlite_master WHERE type = 'table'").all().map((r) => String(r.name));
      if (names.includes(`${prefix}meta`)) {
        version = db.prepare(`SELECT value FROM "${`${prefix}meta`.replaceAll('"', '""')}" WHERE key = 'schema_version'`).get()?.value;
      }
    } finally {
      db.close();
    }
  } catch (error) {
    throw new OperationError(`Cannot read SQLite file ${JSON.stringify(file)} (from ${JSON.stringify(shown)}): ${errorMessage(error)}`);
  }
  const tables = new Set(names);
  if (tables.has(`${prefix}meta`)) {
    return checkSchemaVersion(`SQLite file ${JSON.stringify(file)} (tablePrefix ${JSON.stringify(prefix)})`, version, SQLITE_SCHEMA_VERSION, shown);
  }
  const found = names
    .filter((n) => n.endsWith("meta") && tables.has(`${n.slice(0, -4)}inbox`) && tables.has(`${n.slice(0, -4)}outbox`))
    .map((n) => `tablePrefix ${JSON.stringify(n.slice(0, -4))}`);
  throw new OperationError(
    `SQLite file ${JSON.stringify(file)} has no tables of tablePrefix ${JSON.stringify(prefix)}` +
      `${others("tables", found)} (from ${JSON.stringify(shown)}): ` +
      (found.length ? "give ?tablePrefix=… of the bot's backend" : `is it the bot's database? Nothing is created here, ${CREATED_BY}`),
  );
}

/** The part of a porsager client the Postgres check uses. */
interface SqlClient {
  unsafe(query: string, parameters?: unknown[]): PromiseLike<unknown>;
}

/**
 * Refuses a Postgres schema that does not exist, or has no tables of this
 * prefix (opening the backend would create them), or is of another schema
 * version than this package's ({@link checkSchemaVersion}).
 *
 * @param sql the client
 * @param schema the schema
 * @param prefix the table prefix
 * @param shown the URL as given (credentials hidden)
 * @throws {OperationError} naming the schema and prefix, and the ones found; or both schema versions
 */
export async function checkPostgresTables(sql: SqlClient, schema: string, prefix: string, shown: string): Promise<void> {
  const [here] = (await sql.unsafe(
    `SELECT to_regnamespace($1) IS NOT NULL AS schema_found,
            to_regclass(quote_ident($1) || '.' || quote_ident($2 || 'meta')) IS NOT NULL AS tables_found`,
    [schema, prefix],
  )) as { schema_found: boolean; tables_found: boolean }[];
  if (here?.tables_found) {
    const [row] = (await sql.unsafe(
      `SELECT value FROM ${tables(schema, prefix).meta} WHERE key = 'schema_version'`,
      [],
    )) as { value: string }[];
    return checkSchemaVersion(
      `Postgres schema ${JSON.stringify(schema)} (tablePrefix ${JSON.stringify(prefix)})`,
      row?.value,
      POSTGRES_SCHEMA_VERSION,
      shown,
    );
  }
  const found = ((await sql.unsafe(
    `SELECT n.nspname AS schema, left(c.relname, length(c.relname) - 4) AS prefix
       FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
      WHERE c.relkind IN ('r', 'p') AND c.relname LIKE '%meta'
        AND EXISTS (SELECT 1 FROM pg_class o WHERE o.relnamespace = c.relnamespace
                    AND o.relname = left(c.relname, length(c.relname) - 4) || 'outbox')
      ORDER BY 1, 2 LIMIT ${MAX_FOUND + 1}`,
    [],
  )) as { schema: string; prefix: string }[]).map((r) => `schema=${r.schema}&tablePrefix=${r.prefix}`);
  const what = here?.schema_found
    ? `Postgres schema ${JSON.stringify(schema)} has no tables of tablePrefix ${JSON.stringify(prefix)}`
    : `Postgres schema ${JSON.stringify(schema)} does not exist`;
  throw new OperationError(
    `${what}${others("backends", found)} (from ${JSON.stringify(shown)}): ` +
      `check ?schema= and ?tablePrefix= (the bot's "schema" and "tablePrefix" options); nothing is created here, ${CREATED_BY}`,
  );
}

/** The part of a Redis client the check uses: `EXISTS` and one `SCAN` page. */
export interface RedisProbe {
  /** How many of `keys` exist. */
  exists(keys: string[]): Promise<number>;
  /** One `SCAN` page: the next cursor and the keys matching `match`. */
  scan(cursor: string, match: string): Promise<[string, string[]]>;
}

/** SCAN pages read at most to list the prefixes found. */
const MAX_SCAN_PAGES = 20;

/**
 * Refuses a Redis key prefix under which no inbox or outbox was ever written
 * (its admission and send counters, `{prefix}in:ord` and `{prefix}out:seq`,
 * outlive every purge).
 *
 * @param probe the client's `EXISTS` and `SCAN`
 * @param keyPrefix the key prefix
 * @param shown the URL as given (credentials hidden)
 * @throws {OperationError} naming the prefix and the prefixes found
 */
export async function checkRedisPrefix(probe: RedisProbe, keyPrefix: string, shown: string): Promise<void> {
  const tag = `{${keyPrefix}}`;
  if ((await probe.exists([`${tag}in:ord`, `${tag}out:seq`])) > 0) return;
  const found = new Set<string>();
  for (const suffix of ["in:ord", "out:seq"]) {
    let cursor = "0";
    for (let page = 0; page < MAX_SCAN_PAGES && found.size <= MAX_FOUND; page++) {
      const [next, keys] = await probe.scan(cursor, `{*}${suffix}`);
      for (const key of keys) {
        const end = key.lastIndexOf("}");
        if (key.startsWith("{") && end > 0) found.add(`keyPrefix=${key.slice(1, end)}`);
      }
      cursor = next;
      if (cursor === "0") break;
    }
  }
  throw new OperationError(
    `Redis has no inbox or outbox under key prefix ${JSON.stringify(keyPrefix)} (no key ${tag}in:ord nor ${tag}out:seq)` +
      `${others("prefixes", [...found].sort())} (from ${JSON.stringify(shown)}): ` +
      `check ?keyPrefix= (the bot's "keyPrefix" option, default "botmesh:"); nothing is created here, ` +
      "a bot writes these keys when it journals its first message",
  );
}
