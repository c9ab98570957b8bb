/**
 * The damaged rows of a journal (see "Damaged records" in `mod.ts`): the
 * reads that set aside a row that does not read back as a record, the lists
 * that leave such rows out, and the list of the rows set aside.
 *
 * @module
 */
import { type DamagedListOptions, type DamagedRecord, DamagedRecordError } from "../../src/contract.ts";
import { showValue as show } from "../../src/show.ts";
import { Damage } from "../../src/stored_records.ts";
import type { Context, Row } from "./connection.ts";
import { num, pgId } from "./rows.ts";
import type { AsideSql } from "./sql.ts";

/** The `backend` of a {@link DamagedRecord}: the journals' `name`. */
const BACKEND = "postgres";

/** The options of `damaged`, checked. */
function damagedOptions(options: DamagedListOptions | undefined, op: string): { unreported: boolean; limit: number } {
  if (options === undefined) return { unreported: false, limit: 100 };
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`${op}: options must be an object, got ${show(options)}`);
  }
  const { unreported = false, limit = 100 } = options;
  if (typeof unreported !== "boolean") throw new TypeError(`${op}: option "unreported" must be a boolean, got ${show(unreported)}`);
  if (!Number.isSafeInteger(limit) || limit < 0) throw new RangeError(`${op}: option "limit" must be a non-negative integer, got ${show(limit)}`);
  return { unreported, limit };
}

/** Runs one statement of a journal (`op` without the journal's name): see `Context.run` and `Context.transaction`. */
export type JournalRun = (op: string, text: string, params: unknown[]) => Promise<Row[] & { count?: number }>;

/** Reads of a journal's rows that stop at a damaged row: a due scan or list runs again for what it left, this many times at most. */
export const DAMAGED_ROUNDS = 10;
/** A row that changed between its read and its set-aside is read again, this many times at most. */
const SETTLE_TRIES = 5;

/**
 * The damaged rows of one journal (see "Damaged records" in
 * `mod.ts`): reads that set aside a row they cannot read, the list of
 * the rows set aside, and their reports.
 */
export class Aside<T> {
  readonly #c: Context;
  readonly #journal: "inbox" | "outbox";
  readonly #table: string;
  readonly #q: AsideSql;
  readonly #pk: "ord" | "seq";
  readonly #id: "id" | "key";
  readonly #read: (row: Row) => T | Damage;

  constructor(c: Context, journal: "inbox" | "outbox", table: string, q: AsideSql, read: (row: Row) => T | Damage) {
    this.#c = c;
    this.#journal = journal;
    this.#table = table;
    this.#q = q;
    [this.#pk, this.#id] = journal === "inbox" ? ["ord", "id"] : ["seq", "key"];
    this.#read = read;
  }

  #error(row: Row, problem: unknown): DamagedRecordError {
    return new DamagedRecordError({ journal: this.#journal, id: String(row[this.#id]), backend: BACKEND, problem: String(problem) });
  }

  /**
   * The record of `row` (read with its set-aside columns and version), or,
   * when it is damaged, the error naming it, once it is set aside (by this
   * call or another); `null` when the row is gone. The set-aside applies to
   * the version read only: a row that changed since is read again (a few
   * times: one that never stops changing is named but left for a later call). `run` runs its
   * statements (a transaction's, see `Context.transaction`; by default each its own).
   */
  async settle(op: string, row: Row, run: JournalRun = (o, text, params) => this.#run(o, text, params)): Promise<T | DamagedRecordError | null> {
    let r: Row | undefined = row;
    for (let tries = 1; r; tries++) {
      if (r.set_aside_seq !== null && r.set_aside_seq !== undefined) return this.#error(r, r.damage);
      const read = this.#read(r);
      if (!(read instanceof Damage)) return read;
      const at: unknown[] = [String(r[this.#pk])];
      if ((await run(op, this.#q.setAside, [...at, String(r.xv), read.problem])).length === 1) return this.#error(r, read.problem);
      if (tries === SETTLE_TRIES) return this.#error(r, read.problem); // still changing: a later call sets it aside
      r = (await run(op, this.#q.row, at))[0];
    }
    return null;
  }

  #run(op: string, text: string, params: unknown[]): Promise<Row[] & { count?: number }> {
    return this.#c.run(`${this.#journal}.${op}`, this.#table, text, params);
  }

  async damaged(options: DamagedListOptions | undefined): Promise<DamagedRecord[]> {
    const { unreported, limit } = damagedOptions(options, `${this.#journal}.damaged`);
    if (limit === 0) return [];
    const rows = await this.#run("damaged", this.#q.damaged(unreported), [limit]);
    return rows.map((r) => ({
      journal: this.#journal,
      id: String(r.id),
      backend: BACKEND,
      problem: String(r.damage),
      setAsideAt: Number(r.set_aside_at),
      reported: r.damage_reported === true,
    }));
  }

  async report(id: string): Promise<boolean> {
    pgId(id, `${this.#journal}.reportDamaged: "${this.#id}"`);
    return (await this.#run("reportDamaged", this.#q.report, [id])).length === 1;
  }
}

/**
 * The record a claim returned, when it read back as the row the claim wrote: not damaged, not changed since
 * (set aside, claimed again) by another call while it was read again.
 */
export function leasedBy<T extends { fence: number; state: string }>(read: T | DamagedRecordError | null, row: Row | undefined): T | null {
  if (read === null || read instanceof DamagedRecordError || !row) return null;
  return read.fence === num(row.fence) && read.state === row.state ? read : null;
}

/**
 * The records of a list (`query`, a page of at most `limit` rows), the damaged rows set aside: when a full
 * page held one, the page is read again (without it) so that it holds as many records as the limit allows.
 */
export async function listed<T>(aside: Aside<T>, limit: number, query: () => Promise<Row[]>): Promise<T[]> {
  let records: T[] = [];
  for (let round = 0, again = true; again && round < DAMAGED_ROUNDS; round++) {
    const rows = await query();
    records = [];
    let damaged = false;
    for (const row of rows) {
      const read = await aside.settle("list", row);
      if (read instanceof DamagedRecordError) damaged = true;
      else if (read !== null) records.push(read);
    }
    again = damaged && rows.length >= limit;
  }
  return records;
}
