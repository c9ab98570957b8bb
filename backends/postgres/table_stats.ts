/**
 * Keeps the server's statistics of the journal's tables in step with a
 * burst of writes.
 *
 * The client prepares each statement once per connection, and after a few
 * runs the server keeps one generic plan for it, made with the table's size
 * and statistics of that moment. It plans again only when the table's
 * statistics change, which autovacuum does at most once a minute (its
 * naptime) and only past its thresholds. A journal that grows from empty, or
 * by a whole restart's backlog, within that minute keeps plans made for a
 * table of a few rows: sequential scans, and index combinations read from
 * statistics where no record was `processing`. Each such statement then reads
 * the whole table, and a backlog's recovery grows with its square (measured:
 * a restart's 100,000 records took 2.5× as long as with this check).
 *
 * So each claim scan may check, at most every {@link CHECK_EVERY_MS}, how many
 * rows of the inbox and the outbox changed since their last `ANALYZE`
 * (`pg_stat_user_tables`, every writer's changes): a table whose changes
 * outnumber its rows at that `ANALYZE` (plus {@link MIN_CHANGES}) is analyzed
 * at once, in the background (`SKIP_LOCKED`, and not while a `VACUUM` or
 * `ANALYZE` of it is under way). A table only grows that fast in a burst: in
 * steady traffic autovacuum (at 10% by default) gets there first. The new
 * statistics also make every session plan its statements on the table again.
 * A role that may not analyze the table (not its owner) is never asked to. A
 * failed check is ignored, and the next one waits a minute (autovacuum still
 * runs).
 *
 * @module
 */
import type { PostgresClient } from "./options.ts";

/** The least time between two checks of one backend. */
export const CHECK_EVERY_MS = 5_000;
/** Changes a table takes beyond its analyzed row count before this analyzes it. */
export const MIN_CHANGES = 1_000;

/** After a failed check, the next one waits this long. */
export const RETRY_AFTER_ERROR_MS = 60_000;

/**
 * Per table: whether this role may analyze it, and whether its changes since its last `ANALYZE` outnumber
 * its rows then, while no `VACUUM` or `ANALYZE` of it is under way (autovacuum's, another replica's: this
 * one would skip it, with a warning).
 */
const STALE_SQL = `SELECT t.name,
    (pg_has_role(current_user, c.relowner, 'USAGE') OR EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND rolsuper)) AS may,
    s.n_mod_since_analyze > greatest(c.reltuples, 0) + $2::bigint
      AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_analyze a WHERE a.relid = c.oid)
      AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_vacuum v WHERE v.relid = c.oid) AS stale
  FROM json_array_elements_text($1::text::json) AS t(name)
    JOIN pg_class c ON c.oid = to_regclass(t.name)
    JOIN pg_stat_user_tables s ON s.relid = c.oid`;

/**
 * Analyzes the tables whose statistics a burst of writes left behind (see the module documentation).
 *
 * @example
 * ```ts ignore
 * const stats = new TableStats(sql, ['"public"."botmesh_inbox"'], () => ready());
 * stats.check(); // from each claim scan; at most one check per CHECK_EVERY_MS
 * ```
 */
export class TableStats {
  readonly #sql: PostgresClient;
  readonly #tables: ReadonlySet<string>;
  readonly #names: string;
  readonly #ready: () => Promise<void>;
  readonly #now: () => number;
  #nextCheck = -Infinity;
  #running = false;
  /** Tables this role may not analyze: never asked again. */
  readonly #refused = new Set<string>();

  constructor(sql: PostgresClient, tables: readonly string[], ready: () => Promise<void>, now: () => number = () => Date.now()) {
    this.#sql = sql;
    this.#tables = new Set(tables);
    this.#names = JSON.stringify(tables);
    this.#ready = ready;
    this.#now = now;
  }

  /** Starts a check in the background when none ran for {@link CHECK_EVERY_MS}; never throws. */
  check(): void {
    const now = this.#now();
    if (this.#running || now < this.#nextCheck) return;
    this.#nextCheck = now + CHECK_EVERY_MS;
    this.#running = true;
    void this.#analyzeStale().catch(() => {
      this.#nextCheck = this.#now() + RETRY_AFTER_ERROR_MS; // (a server before 13, a lost connection: autovacuum still runs)
    }).finally(() => {
      this.#running = false;
    });
  }

  /** Runs one check now (tests): the tables it analyzed. */
  async analyzeStale(): Promise<string[]> {
    return await this.#analyzeStale();
  }

  async #analyzeStale(): Promise<string[]> {
    await this.#ready();
    const rows = await this.#sql.unsafe(STALE_SQL, [this.#names, MIN_CHANGES], { prepare: false }) as Record<string, unknown>[];
    const analyzed: string[] = [];
    for (const row of rows) {
      const name = String(row.name);
      if (!this.#tables.has(name) || row.stale !== true || this.#refused.has(name)) continue; // (ours: quoted, schema-qualified)
      if (row.may !== true) {
        this.#refused.add(name);
        continue;
      }
      await this.#sql.unsafe(`ANALYZE (SKIP_LOCKED) ${name}`, [], { prepare: false });
      analyzed.push(name);
    }
    return analyzed;
  }
}
