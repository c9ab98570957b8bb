/**
 * `new PostgresRateLimiter({ sql })`: the outbox's rate-limit buckets in a
 * Postgres table every replica shares (one row per bucket key, the GCRA
 * state as the time of the next send), decided by one statement on the
 * server's clock with the rows locked: a take of several buckets is all or
 * nothing, and replicas together stay within the limits.
 *
 * @module
 */
import type { RateBucket, RateLimiter, RateTake } from "../../src/contract.ts";
import { checkKnownOptions } from "../../src/options.ts";
import { gcraParams } from "../../src/rate_limit.ts";
import { showValue as show } from "../../src/show.ts";
import { clientPrepares } from "./connection.ts";
import { type PostgresClient, resolveOptions } from "./options.ts";

/** Options of {@link PostgresRateLimiter}. */
export interface PostgresRateLimiterOptions {
  /** A porsager `postgres()` client (required). It stays the caller's: this module never ends it. */
  sql: PostgresClient;
  /** The schema of the table (default `"public"`, created when missing). */
  schema?: string;
  /** Prepended to the table name (default `"botmesh_"`): the table is `<prefix>rate_limits`. */
  tablePrefix?: string;
}

/** Takes between two deletions of idle rows (full buckets: a missing row is a full bucket). */
const PURGE_EVERY = 5000;
/** A row whose next send is this far in the past is a full bucket: deleted by the purge. */
const IDLE_MS = 3_600_000;
/** Keys this process knows to have a row (a take of an unknown key inserts it first). */
const KNOWN_KEYS = 100_000;

/**
 * The rate-limit buckets of every replica in one Postgres table.
 *
 * @example
 * ```ts ignore
 * import postgres from "postgres";
 * import { PostgresRateLimiter } from "@botmesh/durable/postgres";
 * const limiter = new PostgresRateLimiter({ sql: postgres(process.env.DATABASE_URL!) });
 * // new Bot({ provider, durability: { backend, outbox: { rateLimit: { limiter } } } })
 * ```
 */
export class PostgresRateLimiter implements RateLimiter {
  readonly name = "postgres";
  readonly scope = "shared" as const;
  readonly #sql: PostgresClient;
  readonly #prepare: boolean;
  readonly #table: string;
  readonly #schema: string;
  #ready: Promise<void> | null = null;
  readonly #known = new Set<string>();
  #takes = 0;

  /**
   * @param options the client, schema and table prefix
   * @throws {TypeError} naming the option for a missing client or an unknown option
   * @throws {RangeError} naming the option for a bad schema or prefix
   */
  constructor(options: PostgresRateLimiterOptions) {
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`PostgresRateLimiter options must be an object with a "sql" client, got ${show(options)}`);
    }
    checkKnownOptions(options, ["sql", "schema", "tablePrefix"], "PostgresRateLimiter option");
    const resolved = resolveOptions(options);
    this.#sql = resolved.sql;
    this.#prepare = clientPrepares(resolved.sql);
    this.#schema = resolved.schema;
    this.#table = `"${resolved.schema}"."${resolved.prefix}rate_limits"`;
  }

  #setup(): Promise<void> {
    this.#ready ??= (async () => {
      try {
        await this.#sql.unsafe(`CREATE SCHEMA IF NOT EXISTS "${this.#schema}"`);
        await this.#sql.unsafe(`CREATE TABLE IF NOT EXISTS ${this.#table} (key text PRIMARY KEY, tat double precision NOT NULL)`);
      } catch (error) {
        // Two processes creating it at once: one of them gets a unique violation, and the table exists.
        const code = (error as { code?: unknown }).code;
        if (code !== "23505" && code !== "42P07") throw error;
      }
    })().catch((error) => {
      this.#ready = null;
      throw error;
    });
    return this.#ready;
  }

  static #params(buckets: readonly RateBucket[]): string {
    return JSON.stringify(buckets.map((b) => {
      const { interval, tolerance } = gcraParams(b);
      return { key: b.key, i: interval, tol: tolerance };
    }));
  }

  /** @inheritdoc */
  async take(buckets: readonly RateBucket[]): Promise<RateTake> {
    if (buckets.length === 0) return { ok: true };
    await this.#setup();
    // Idle rows go now and then, off the send's path (a row purged under a take is put back below).
    if (++this.#takes % PURGE_EVERY === 0) void this.#purge().catch(() => {});
    const params = PostgresRateLimiter.#params(buckets);
    if (buckets.some((b) => !this.#known.has(b.key))) await this.#insertMissing(params, buckets);
    for (let round = 0;; round++) {
      // The rows are locked in key order (no deadlock between takes of several buckets), read at their
      // latest version, and written only when every bucket has a send to give (the GCRA step of
      // gcraStep in src/rate_limit.ts).
      const rows = await this.#sql.unsafe(
        `WITH n AS (SELECT (extract(epoch FROM clock_timestamp()) * 1000)::float8 AS now),
        b AS (SELECT x.key, x.i, x.tol FROM jsonb_to_recordset($1::text::jsonb) AS x(key text, i float8, tol float8)),
        locked AS (SELECT r.key, r.tat FROM ${this.#table} r WHERE r.key IN (SELECT key FROM b) ORDER BY r.key FOR UPDATE),
        w AS (
          SELECT b.key, greatest(l.tat, n.now) - b.tol - n.now AS wait, greatest(l.tat, n.now) + b.i AS next
          FROM b JOIN locked l ON l.key = b.key CROSS JOIN n
        ),
        verdict AS (SELECT count(*) = (SELECT count(*) FROM b) AS complete, coalesce(bool_and(wait <= 0), true) AS ok FROM w),
        u AS (
          UPDATE ${this.#table} r SET tat = w.next FROM w, verdict
          WHERE verdict.complete AND verdict.ok AND r.key = w.key RETURNING r.key
        )
        SELECT v.complete, v.ok, (SELECT count(*) FROM u)::int AS written,
          (SELECT w.key FROM w ORDER BY w.wait DESC LIMIT 1) AS key, (SELECT max(w.wait) FROM w) AS wait
        FROM verdict v`,
        [params],
        { prepare: this.#prepare },
      );
      const row = rows[0] as { complete: boolean; ok: boolean; key: string | null; wait: number | string | null };
      if (!row.complete) {
        // A row was purged meanwhile: put it back (a full bucket) and take again.
        if (round >= 3) throw new Error(`PostgresRateLimiter: the rows of ${show(buckets.map((b) => b.key))} keep vanishing`);
        for (const b of buckets) this.#known.delete(b.key);
        await this.#insertMissing(params, buckets);
        continue;
      }
      if (row.ok) return { ok: true };
      return { ok: false, waitMs: Math.max(0, Number(row.wait)), key: row.key ?? buckets[0]!.key };
    }
  }

  async #insertMissing(params: string, buckets: readonly RateBucket[]): Promise<void> {
    await this.#sql.unsafe(
      `INSERT INTO ${this.#table} (key, tat) SELECT x.key, 0 FROM jsonb_to_recordset($1::text::jsonb) AS x(key text) ORDER BY x.key
      ON CONFLICT (key) DO NOTHING`,
      [params],
      { prepare: this.#prepare },
    );
    if (this.#known.size + buckets.length > KNOWN_KEYS) this.#known.clear();
    for (const b of buckets) this.#known.add(b.key);
  }

  async #purge(): Promise<void> {
    await this.#sql.unsafe(
      `DELETE FROM ${this.#table} WHERE tat < (extract(epoch FROM clock_timestamp()) * 1000)::float8 - $1::float8`,
      [IDLE_MS],
      { prepare: this.#prepare },
    );
  }

  /** @inheritdoc */
  async pause(bucket: RateBucket, ms: number): Promise<void> {
    await this.#setup();
    const { tolerance } = gcraParams(bucket);
    await this.#sql.unsafe(
      `INSERT INTO ${this.#table} AS r (key, tat) VALUES ($1, (extract(epoch FROM clock_timestamp()) * 1000)::float8 + $2::float8)
      ON CONFLICT (key) DO UPDATE SET tat = greatest(r.tat, EXCLUDED.tat)`,
      [bucket.key, Math.max(0, ms) + tolerance],
      { prepare: this.#prepare },
    );
    this.#known.add(bucket.key);
  }
}
