/**
 * The answers of named due scans (`ClaimDueOptions.requestId`), kept in the
 * schema's `<prefix>scan_answer` table (schema version 7) so that a scan whose
 * reply was lost can be asked again (`ClaimDueOptions.repeat`), by this
 * process or any other on the schema.
 *
 * A named scan runs in one transaction with the storing of its answer: the
 * answer is there exactly when the scan committed. It is kept as references,
 * JSON text keyed by the journal and the SHA-256 of the `requestId` (any string
 * fits): on the inbox `[{id, token}]`, on the outbox `{due: [{key, token}],
 * ambiguous: [{key, fence}]}` (the journals' `claimDue` re-reads the rows for a
 * repeat). An answer older than {@link SCAN_ANSWER_KEEP_MS} by the database's
 * clock (the test clock, with option `clock`) counts as gone. Each store
 * deletes a few of those, and `purge` the rest of its journal's.
 *
 * A repeat closes its request: it first inserts a placeholder row under the id
 * (the journal's empty answer; `ON CONFLICT DO NOTHING`, which waits for a scan
 * that stored its answer and has not committed yet), then reads. The scan's
 * store is a plain `INSERT`: a scan whose commit had not begun when the
 * placeholder went in fails on the key and rolls back entirely (it never
 * happened, and its caller gets an error, as its reply was lost anyway). So the
 * repeat's answer is final: either the scan committed before it and it reads
 * the scan's answer, or the scan will never commit. A scan that took nothing
 * stores nothing: it leased nothing (every row its statements leased is in its
 * answer, or set aside as damaged), so whenever it commits, "nothing" is its
 * answer. (A client without `begin` runs the scan and the store as statements
 * of their own: a placeholder between the two fails the store after the scan
 * committed.)
 *
 * @module
 */
import { SCAN_ANSWER_KEEP_MS } from "../../src/contract.ts";
import { errorMessage } from "../../src/errors.ts";
import { sha256Hex } from "../../src/sha256_hex.ts";
import type { JournalRun } from "./aside.ts";
import type { Context } from "./connection.ts";
import { inBatches } from "./rows.ts";
import { NOW_MS, type Tables } from "./sql.ts";

/** The SQLSTATE of a statement's failure (its cause, as `Context` wraps it), if any. */
function sqlState(error: unknown): unknown {
  for (let e: unknown = error, depth = 0; e !== null && typeof e === "object" && depth < 4; e = (e as { cause?: unknown }).cause, depth++) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === "string" && /^[0-9A-Z]{5}$/.test(code)) return code;
  }
  return undefined;
}

/** Old answers one store deletes at most (so that the table stays about as large as SCAN_ANSWER_KEEP_MS of named scans). */
const SWEEP_ON_STORE = 16;

/** The statements of the scan answers. `$1` is always the journal (`inbox`, `outbox`). */
export interface ScanAnswerSql {
  /** Keeps an answer ($2 the id, $3 the answer), failing on one of the same id; deletes a few old answers. */
  store: string;
  /** Closes the request $2: keeps $3 (the journal's empty answer) unless an answer of that id is there (or on its way). */
  close: string;
  /** The answer of id $2, when kept and not older than {@link SCAN_ANSWER_KEEP_MS}. */
  read: string;
  /** Deletes at most $2 of the journal's old answers. */
  sweep: string;
}

/** The scan answer statements of one schema + prefix. */
export function scanAnswerSql(t: Tables): ScanAnswerSql {
  const a = t.scanAnswer;
  const keep = String(SCAN_ANSWER_KEEP_MS);
  return {
    // The store's own id is left out of the sweep: one statement must not delete and upsert one row.
    // SKIP LOCKED: concurrent stores sweep different rows, and none waits for another.
    store: `WITH n AS (SELECT ${NOW_MS} AS now),
      gone AS (
        DELETE FROM ${a} WHERE (journal, id) IN (
          SELECT journal, id FROM ${a}
            WHERE stored_at < (SELECT now FROM n) - ${keep} AND NOT (journal = $1 AND id = $2)
            ORDER BY stored_at LIMIT ${SWEEP_ON_STORE} FOR UPDATE SKIP LOCKED)
      )
      INSERT INTO ${a} (journal, id, answer, stored_at) VALUES ($1, $2, $3, (SELECT now FROM n))`,
    close: `INSERT INTO ${a} (journal, id, answer, stored_at) VALUES ($1, $2, $3, (SELECT ${NOW_MS})) ON CONFLICT (journal, id) DO NOTHING`,
    read: `SELECT answer FROM ${a} WHERE journal = $1 AND id = $2 AND stored_at >= (SELECT ${NOW_MS}) - ${keep}`,
    sweep: `DELETE FROM ${a} WHERE (journal, id) IN (
      SELECT journal, id FROM ${a} WHERE stored_at < (SELECT ${NOW_MS}) - ${keep} AND journal = $1
        ORDER BY stored_at LIMIT $2 FOR UPDATE SKIP LOCKED)`,
  };
}

/** The kept answers of one journal's named due scans. */
export class PgScanAnswers {
  readonly #c: Context;
  readonly #journal: "inbox" | "outbox";
  /** The journal's table, which names the scan in errors. */
  readonly #table: string;
  readonly #q: ScanAnswerSql;

  constructor(c: Context, journal: "inbox" | "outbox", table: string) {
    this.#c = c;
    this.#journal = journal;
    this.#table = table;
    this.#q = scanAnswerSql(c.t);
  }

  /**
   * Runs `scan` (its statements by the `run` it is given) and keeps its answer's references (`refs`)
   * under `requestId`, in one transaction; an answer that took nothing (`refs` answers `null`) is not kept.
   * A repeat that closed the request first fails the store (the scan rolls back).
   */
  async kept<T>(requestId: string, scan: (run: JournalRun) => Promise<T>, refs: (answer: T) => unknown): Promise<T> {
    const id = await sha256Hex(requestId);
    const op = `${this.#journal}.claimDue`;
    return await this.#c.transaction(op, this.#table, async (run) => {
      const answer = await scan((o, text, params) => run(`${this.#journal}.${o}`, this.#table, text, params));
      const kept = refs(answer);
      if (kept === null) return answer;
      try {
        await run(op, this.#c.t.scanAnswer, this.#q.store, [this.#journal, id, JSON.stringify(kept)]);
      } catch (error) {
        if (sqlState(error) !== "23505") throw error;
        // (`transaction` names the operation and the table before it)
        throw new Error(`a repeat of requestId ${JSON.stringify(requestId)} closed the request first: this scan rolled back (it took nothing)`, {
          cause: error,
        });
      }
      return answer;
    });
  }

  /**
   * Closes the request `requestId` (a later scan of that id fails and takes nothing, see the module's
   * doc), then answers what is kept under it: the references of the scan's answer, or `null` (never
   * kept, gone, or the placeholder: nothing).
   * @param empty the journal's empty answer, as JSON text (the placeholder)
   */
  async repeat(requestId: string, empty: string): Promise<unknown> {
    const id = await sha256Hex(requestId);
    const op = `${this.#journal}.claimDue`;
    // Two statements: the read, after the insert waited for a scan under way, sees what it committed.
    await this.#c.run(op, this.#c.t.scanAnswer, this.#q.close, [this.#journal, id, empty]);
    const rows = await this.#c.run(op, this.#c.t.scanAnswer, this.#q.read, [this.#journal, id]);
    const text = rows[0]?.answer;
    if (typeof text !== "string") return null;
    try {
      return JSON.parse(text);
    } catch (error) {
      throw new Error(
        `Postgres ${this.#journal}.claimDue on ${this.#c.t.scanAnswer}: the answer kept for requestId ${
          JSON.stringify(requestId)
        } is not JSON: ${errorMessage(error)}`,
      );
    }
  }

  /** Deletes the journal's answers that are gone (older than {@link SCAN_ANSWER_KEEP_MS}), in bounded batches. */
  async sweep(): Promise<number> {
    const batch = this.#c.purgeBatch;
    return await inBatches(batch, async () =>
      (await this.#c.run(`${this.#journal}.purge`, this.#c.t.scanAnswer, this.#q.sweep, [this.#journal, batch])).count ?? 0
    );
  }
}
