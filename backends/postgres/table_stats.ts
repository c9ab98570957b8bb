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
 * So each claim scan may check, at most every {@link CHECK_EVERY_MS} per set
 * of tables in a process (backends built per request share it), how many rows
 * of the inbox and the outbox changed since their last `ANALYZE` (the
 * server's count, every writer's changes): a table whose changes outnumber
 * its rows at that `ANALYZE` (plus {@link MIN_CHANGES}) is analyzed at once,
 * in the background, unless something holds a lock `ANALYZE` would wait for
 * (a `VACUUM` or `ANALYZE` under way, autovacuum's or another replica's;
 * `SKIP_LOCKED` and `client_min_messages = error` cover a lock taken since,
 * without a warning in the client's notices). A table only grows that fast
 * in a burst: in steady traffic autovacuum (at 10% by default) gets there
 * first. The new statistics also make every session plan its statements on
 * the table again. A role that may not analyze the table (not its owner) is
 * never asked to. A failed check is ignored, and the next one waits a minute
 * (autovacuum still runs).
 *
 * @module
 */
import { BoundedMap } from "../../src/bounded_map.ts";
import type { PostgresClient } from "./options.ts";

/** The least time between two checks of one set of tables, in one process. */
export const CHECK_EVERY_MS = 5_000;
/** Changes a table takes beyond its analyzed row count before this analyzes it. */
export const MIN_CHANGES = 1_000;
/** After a failed check, the next one waits this long. */
export const RETRY_AFTER_ERROR_MS = 60_000;
/** Sets of tables whose checks this process remembers at most (the oldest are forgotten first). */
const MAX_REMEMBERED = 1_000;

/**
 * Per table: whether this role may analyze it, and whether its changes since its last `ANALYZE` outnumber
 * its rows then, while nothing holds a lock that `ANALYZE` would wait for (a `VACUUM` or `ANALYZE` under
 * way, autovacuum's or another replica's; an index built concurrently). `pg_locks` shows every session's
 * locks to every role (the progress views hide other roles' tables), and the change count is read for
 * the tables alone (the view `pg_stat_user_tables` aggregates every table of the database).
 */
const STALE_SQL = `SELECT t.name,
    (pg_has_role(current_user, c.relowner, 'USAGE') OR EXISTS (SELECT 1 FROM pg_roles WHERE rolname = current_user AND rolsuper)) AS may,
    pg_stat_get_mod_since_analyze(c.oid) > greatest(c.reltuples, 0) + $2::bigint
      AND NOT EXISTS (
        SELECT 1 FROM pg_locks l WHERE l.locktype = 'relation' AND l.relation = c.oid AND l.granted
          AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
          AND l.mode IN ('ShareUpdateExclusiveLock', 'ShareLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')
      ) AS stale
  FROM json_array_elements_text($1::text::json) AS t(name)
    JOIN pg_class c ON c.oid = to_regclass(t.name)`;

/** The checks of one set of tables in this process (shared by every backend on them: one per request is common). */
interface Checks {
  next: number;
  running: boolean;
}
const checksByTables = new BoundedMap<string, Checks>(MAX_REMEMBERED);

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

  /** `now`: a monotonic clock in ms (a wall clock stepped back would hold the checks back by the step). */
  constructor(sql: PostgresClient, tables: readonly string[], ready: () => Promise<void>, now: () => number = () => performance.now()) {
    this.#sql = sql;
    this.#tables = new Set(tables);
    this.#names = JSON.stringify(tables);
    this.#ready = ready;
    this.#now = now;
  }

  #checks(): Checks {
    let checks = checksByTables.get(this.#names);
    if (checks === undefined) {
      checks = { next: -Infinity, running: false };
      checksByTables.set(this.#names, checks);
    }
    return checks;
  }

  /** Starts a check in the background unless one of these tables ran in this process within {@link CHECK_EVERY_MS}; never throws. */
  check(): void {
    const checks = this.#checks();
    const now = this.#now();
    if (checks.running || now < checks.next) return;
    checks.next = now + CHECK_EVERY_MS;
    checks.running = true;
    void this.analyzeStale().catch(() => {
      checks.next = this.#now() + RETRY_AFTER_ERROR_MS; // (a server before 12, a lost connection: autovacuum still runs)
    }).finally(() => {
      checks.running = false;
    });
  }

  /** Runs one check now, whenever the last one ran (`check` runs it in the background): the tables it analyzed. */
  async analyzeStale(): Promise<string[]> {
    await this.#ready();
    const rows = await this.#sql.unsafe(STALE_SQL, [this.#names, MIN_CHANGES], { prepare: false }) as Record<string, unknown>[];
    const analyzed: string[] = [];
    for (const row of rows) {
      const name = String(row.name);
      // (ours: quoted, schema-qualified; a role that may not analyze it would get a warning, and nothing done)
      if (!this.#tables.has(name) || row.stale !== true || row.may !== true) continue;
      // A lock taken since the check makes it skip the table: quietly (no WARNING for the client's onnotice).
      const analyze = `ANALYZE (SKIP_LOCKED) ${name}`;
      if (typeof this.#sql.begin === "function") {
        await this.#sql.begin(async (tx) => {
          await tx.unsafe("SELECT set_config('client_min_messages', 'error', true)", [], { prepare: false });
          await tx.unsafe(analyze, [], { prepare: false });
        });
      } else {
        await this.#sql.unsafe(analyze, [], { prepare: false });
      }
      analyzed.push(name);
    }
    return analyzed;
  }
}
