/**
 * The options of the Postgres backend's classes ({@link PostgresOptions}),
 * checked by `resolveOptions`, and the part of the client they use
 * ({@link PostgresClient}).
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import { showValue as show } from "../../src/show.ts";
import { IDENTIFIER, LONGEST_SUFFIX } from "./sql.ts";

/**
 * The part of a [postgres](https://github.com/porsager/postgres) (porsager)
 * client this module uses. A `postgres()` client (`Sql`) has it; declared
 * here so that this module does not depend on the driver's types.
 */
export interface PostgresClient {
  /**
   * Runs one statement with `$1`… parameters.
   * @returns the rows (an array; porsager's `RowList` also has `count`)
   */
  // deno-lint-ignore no-explicit-any
  unsafe(query: string, parameters?: any[], options?: { prepare?: boolean }): PromiseLike<any>;
  /**
   * Runs `fn`'s statements in one transaction on one connection (porsager's
   * `sql.begin`; its statements are pipelined). Without it, journal writes
   * are not group-committed: each is its own transaction.
   */
  // deno-lint-ignore no-explicit-any
  begin?(fn: (tx: PostgresClient) => PromiseLike<any>): PromiseLike<any>;
}

/** Options of {@link PostgresDurability}, {@link PostgresStore} and {@link PostgresKv}. */
export interface PostgresOptions {
  /** A porsager `postgres()` client (required). It stays the caller's: this module never ends it. */
  sql: PostgresClient;
  /** The schema of the tables (default `"public"`; created when missing): `^[a-z_][a-z0-9_]*$`. */
  schema?: string;
  /** Prepended to the table names (default `"botmesh_"`): `^[a-z_][a-z0-9_]*$`, at most 40 characters. */
  tablePrefix?: string;
  /** Rows one purge statement deletes at most (default 1000; 1 to 100000). */
  purgeBatchSize?: number;
  /**
   * Group commits of journal writes under way at once (default 2; 1 to 16), each on its own connection;
   * each chat's writes go to one of them (see "Statements" in the module documentation).
   */
  groupLanes?: number;
  /**
   * The time every statement uses, in ms since epoch (default: the server's clock,
   * `clock_timestamp()`). For tests on simulated time (a `TestClock`): every process on the schema must
   * use the same clock. Statements then carry the time as text and are not prepared.
   */
  clock?: () => number;
}

/** Options of {@link PostgresDurability}. */
export type PostgresDurabilityOptions = PostgresOptions;
/** Options of {@link PostgresStore}. */
export type PostgresStoreOptions = PostgresOptions;
/** Options of {@link PostgresKv}. */
export type PostgresKvOptions = PostgresOptions;

const OPTION_NAMES = ["sql", "schema", "tablePrefix", "purgeBatchSize", "groupLanes", "clock"] as const;
const DEFAULT_PURGE_BATCH = 1000;
const MAX_PURGE_BATCH = 100_000;
/** Postgres cuts identifiers at 63 bytes; the prefix leaves room for the longest table/index suffix. */
const MAX_PREFIX = 63 - LONGEST_SUFFIX - 4;

/** Option `groupLanes`: its default and its most (see `laneOf` in `connection.ts`). */
const DEFAULT_LANES = 2;
const MAX_LANES = 16;

/** The options, checked, with their defaults. */
export interface Resolved {
  sql: PostgresClient;
  schema: string;
  prefix: string;
  purgeBatch: number;
  lanes: number;
  /** The test clock, or `undefined`: the server's. */
  clock?: () => number;
}

/** Checks the options of a Postgres class (a TypeError or RangeError naming the option) and applies the defaults. */
export function resolveOptions(options: unknown): Resolved {
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`Postgres options must be an object with a "sql" client, got ${show(options)}`);
  }
  const o = options as Record<string, unknown>;
  checkKnownOptions(o, OPTION_NAMES, "Postgres option");
  const sql = o.sql;
  if (
    (typeof sql !== "function" && (typeof sql !== "object" || sql === null)) ||
    typeof (sql as { unsafe?: unknown }).unsafe !== "function"
  ) {
    throw new TypeError(`Postgres option "sql" must be a postgres (porsager) client, as postgres(url) returns, got ${show(sql)}`);
  }
  const schema = o.schema ?? "public";
  if (typeof schema !== "string") throw new TypeError(`Postgres option "schema" must be a string, got ${show(schema)}`);
  if (!IDENTIFIER.test(schema) || schema.length > 63) {
    throw new RangeError(
      `Postgres option "schema" must match ^[a-z_][a-z0-9_]*$ (lowercase letters, digits, "_"; at most 63), got ${show(schema)}`,
    );
  }
  const prefix = o.tablePrefix ?? "botmesh_";
  if (typeof prefix !== "string") throw new TypeError(`Postgres option "tablePrefix" must be a string, got ${show(prefix)}`);
  if (!IDENTIFIER.test(prefix) || prefix.length > MAX_PREFIX) {
    throw new RangeError(
      `Postgres option "tablePrefix" must match ^[a-z_][a-z0-9_]*$ (lowercase letters, digits, "_"; at most ${MAX_PREFIX}), got ${
        show(prefix)
      }`,
    );
  }
  const batch = o.purgeBatchSize ?? DEFAULT_PURGE_BATCH;
  if (typeof batch !== "number") {
    throw new TypeError(`Postgres option "purgeBatchSize" must be a number, got ${show(batch)}`);
  }
  if (!Number.isInteger(batch) || batch < 1 || batch > MAX_PURGE_BATCH) {
    throw new RangeError(`Postgres option "purgeBatchSize" must be an integer from 1 to ${MAX_PURGE_BATCH}, got ${show(batch)}`);
  }
  const lanes = o.groupLanes ?? DEFAULT_LANES;
  if (typeof lanes !== "number") throw new TypeError(`Postgres option "groupLanes" must be a number, got ${show(lanes)}`);
  if (!Number.isInteger(lanes) || lanes < 1 || lanes > MAX_LANES) {
    throw new RangeError(`Postgres option "groupLanes" must be an integer from 1 to ${MAX_LANES}, got ${show(lanes)}`);
  }
  const clock = o.clock;
  if (clock !== undefined && typeof clock !== "function") {
    throw new TypeError(`Postgres option "clock" must be a function returning ms since epoch, got ${show(clock)}`);
  }
  return { sql: sql as PostgresClient, schema, prefix, purgeBatch: batch, lanes, ...(clock ? { clock: clock as () => number } : {}) };
}
