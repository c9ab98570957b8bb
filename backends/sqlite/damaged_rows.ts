/**
 * Damaged journal rows: set aside once (kept as stored), then left out of
 * everything but `get` (which names the problem), `damaged()` and `reportDamaged()`.
 *
 * @module
 */
import { type DamagedListOptions, type DamagedRecord, DamagedRecordError } from "../../src/contract.ts";
import { checkDamagedList, checkId } from "../../src/rules.ts";
import type { SqliteValue } from "../../src/runtime/sqlite.ts";
import { Damage } from "../../src/stored_records.ts";
import type { Connection, Gate } from "./connection.ts";
import { ASIDE_COLUMNS, num, type Row } from "./rows.ts";

/**
 * The damaged rows of one journal table: sets them aside (once: the row is
 * kept as stored, its set-aside columns filled and its `due_at` cleared, so
 * that due scans no longer find it), lists and reports them.
 */
export class DamagedRows<T> {
  readonly #gate: Gate;
  readonly #journal: "inbox" | "outbox";
  readonly #t: string;
  /** The row's storage key (`ord`, `seq`) and its id column (`id`, `key`). */
  readonly #pk: "ord" | "seq";
  readonly #idColumn: "id" | "key";
  readonly #columns: string;
  readonly #read: (row: Row) => T | Damage;
  /** Called in the transaction that set `row` aside (the outbox moves its chat on). */
  readonly #setAsideHook: (c: Connection, row: Row) => void;

  constructor(
    gate: Gate,
    journal: "inbox" | "outbox",
    columns: string,
    read: (row: Row) => T | Damage,
    setAsideHook: (c: Connection, row: Row) => void = () => {},
  ) {
    this.#gate = gate;
    this.#journal = journal;
    this.#t = `${gate.prefix}${journal}`;
    [this.#pk, this.#idColumn] = journal === "inbox" ? ["ord", "id"] : ["seq", "key"];
    this.#columns = columns;
    this.#read = read;
    this.#setAsideHook = setAsideHook;
  }

  /** The row's id or key; its storage key (`ord:<n>`, `seq:<n>`) when the id itself is unreadable. */
  #idOf(row: Row): string {
    const id = row[this.#idColumn];
    return typeof id === "string" ? id : `${this.#pk}:${row[this.#pk]}`;
  }

  /** The error `get` rejects with for a row set aside. */
  #error(row: Row): DamagedRecordError {
    return new DamagedRecordError({ journal: this.#journal, id: this.#idOf(row), backend: "sqlite", problem: String(row.damage) });
  }

  /**
   * In a write: the record of `row`, or `null` when it was set aside, or is
   * damaged (then it is set aside now).
   */
  current(c: Connection, row: Row, now: number): T | null {
    if (row.set_aside_seq !== null) return null;
    const read = this.#read(row);
    if (!(read instanceof Damage)) return read;
    this.#setAside(c, row, read.problem, now);
    return null;
  }

  /** In a write, on a row read in it: sets it aside with `problem` unless it is already. */
  #setAside(c: Connection, row: Row, problem: string, now: number): void {
    const t = this.#t;
    const { changes } = c.stmt(
      `UPDATE ${t} SET damage = ?, set_aside_at = ?, damage_reported = 0, due_at = NULL,
        set_aside_seq = (SELECT COALESCE(MAX(set_aside_seq), 0) + 1 FROM ${t} INDEXED BY ${t}_aside WHERE set_aside_seq IS NOT NULL)
      WHERE ${this.#pk} = ? AND set_aside_seq IS NULL`,
    ).run(problem, now, row[this.#pk]);
    if (changes === 1) this.#setAsideHook(c, row);
  }

  /**
   * For a read outside a transaction: the records of `rows`, or `null` when
   * some were damaged. Those are then set aside (each read again in the write
   * transaction, so that a row repaired or set aside meanwhile is left as it
   * is) and the caller reads again.
   */
  async readAll(c: Connection, rows: Row[]): Promise<T[] | null> {
    const records: T[] = [];
    const damaged: SqliteValue[] = [];
    for (const row of rows) {
      const read = row.set_aside_seq === null ? this.#read(row) : null;
      if (read === null) continue;
      if (read instanceof Damage) damaged.push(row[this.#pk]);
      else records.push(read);
    }
    if (damaged.length === 0) return records;
    await c.write((now) => {
      for (const key of damaged) {
        const row = c.stmt(`SELECT ${this.#columns} FROM ${this.#t} WHERE ${this.#pk} = ?`).get(key);
        if (row) this.current(c, row, now);
      }
    });
    return null;
  }

  /** `get`: the record of `id`, `null`, or a {@link DamagedRecordError} (a damaged row is set aside first). */
  async get(id: string): Promise<T | null> {
    const c = await this.#gate.ready();
    for (;;) {
      const row = c.stmt(`SELECT ${this.#columns} FROM ${this.#t} WHERE ${this.#idColumn} = ?`).get(id);
      if (!row) return null;
      if (row.set_aside_seq !== null) throw this.#error(row);
      const [record] = (await this.readAll(c, [row])) ?? [];
      if (record !== undefined) return record;
    }
  }

  async list(options: DamagedListOptions | undefined): Promise<DamagedRecord[]> {
    const { unreported, limit } = checkDamagedList(options, `${this.#journal}.damaged`);
    const c = await this.#gate.ready();
    if (limit === 0) return [];
    const t = this.#t;
    const rows = c.stmt(
      unreported
        ? `SELECT ${this.#pk}, ${this.#idColumn}, ${ASIDE_COLUMNS} FROM ${t} INDEXED BY ${t}_unreported
          WHERE damage_reported = 0 ORDER BY set_aside_seq LIMIT ?`
        : `SELECT ${this.#pk}, ${this.#idColumn}, ${ASIDE_COLUMNS} FROM ${t} INDEXED BY ${t}_aside
          WHERE set_aside_seq IS NOT NULL ORDER BY set_aside_seq LIMIT ?`,
    ).all(limit);
    return rows.map((row) => ({
      journal: this.#journal,
      id: this.#idOf(row),
      backend: "sqlite",
      problem: String(row.damage),
      setAsideAt: num(row.set_aside_at),
      reported: row.damage_reported === 1,
    }));
  }

  async report(id: string): Promise<boolean> {
    checkId(id, `${this.#journal}.reportDamaged: "id"`);
    const c = await this.#gate.ready();
    const t = this.#t;
    const byKey = new RegExp(`^${this.#pk}:(\\d+)$`).exec(id);
    // At most one of the two statements writes (one operation, no savepoint needed).
    return c.write(() =>
      c.stmt(`UPDATE ${t} SET damage_reported = 1 WHERE ${this.#idColumn} = ? AND damage_reported = 0`).run(id).changes === 1 ||
      (byKey !== null && c.stmt(
          `UPDATE ${t} SET damage_reported = 1 WHERE ${this.#pk} = ? AND damage_reported = 0 AND typeof(${this.#idColumn}) <> 'text'`,
        ).run(Number(byKey[1])).changes === 1), true);
  }
}
