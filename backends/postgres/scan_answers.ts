/**
 * The answers of named due scans (`ClaimDueOptions.requestId`), kept in the
 * schema's `<prefix>scan_answer` table (schema version 7) so that a scan whose
 * reply was lost can be asked again (`ClaimDueOptions.repeat`), by this
 * process or any other on the schema.
 *
 * A named scan runs in one transaction with the storing of its answer: the
 * answer is there exactly when the scan committed. It is the answer as the
 * caller got it (the records read back, damaged rows set aside), as JSON text,
 * keyed by the journal and the SHA-256 of the `requestId` (any string fits). A
 * repeat reads it; an answer older than {@link SCAN_ANSWER_KEEP_MS} by the
 * database's clock (the test clock, with option `clock`) counts as gone. Each
 * store deletes a few of those, and `purge` the rest of its journal's.
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

/** Old answers one store deletes at most (so that the table stays about as large as two minutes of named scans). */
const SWEEP_ON_STORE = 16;

/** The statements of the scan answers. `$1` is always the journal (`inbox`, `outbox`). */
export interface ScanAnswerSql {
  /** Keeps an answer ($2 the id, $3 the answer), replacing one of the same id; deletes a few old answers. */
  store: string;
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
      INSERT INTO ${a} (journal, id, answer, stored_at) VALUES ($1, $2, $3, (SELECT now FROM n))
      ON CONFLICT (journal, id) DO UPDATE SET answer = EXCLUDED.answer, stored_at = EXCLUDED.stored_at`,
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
   * Runs `scan` (its statements by the `run` it is given) and keeps its answer under `requestId`, in
   * one transaction; an answer that took nothing is not kept.
   */
  async kept<T>(requestId: string, scan: (run: JournalRun) => Promise<T>, isEmpty: (answer: T) => boolean): Promise<T> {
    const id = await sha256Hex(requestId);
    const op = `${this.#journal}.claimDue`;
    return await this.#c.transaction(op, this.#table, async (run) => {
      const answer = await scan((o, text, params) => run(`${this.#journal}.${o}`, this.#table, text, params));
      if (!isEmpty(answer)) await run(op, this.#c.t.scanAnswer, this.#q.store, [this.#journal, id, JSON.stringify(answer)]);
      return answer;
    });
  }

  /** The answer kept under `requestId`, or `null` (never kept, or gone). */
  async repeat(requestId: string): Promise<unknown> {
    const id = await sha256Hex(requestId);
    const rows = await this.#c.run(`${this.#journal}.claimDue`, this.#c.t.scanAnswer, this.#q.read, [this.#journal, id]);
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
