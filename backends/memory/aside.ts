/**
 * Records set aside as damaged by a loader (the file backend): kept as they
 * were stored, listed by `damaged()` and reported once.
 *
 * @module
 */
import { type DamagedListOptions, type DamagedRecord, DamagedRecordError, type JsonValue } from "../../src/contract.ts";
import { checkDamagedList, checkId } from "../../src/rules.ts";

/** A record set aside as damaged, with what was stored (see {@link MemoryRecords.damaged}). */
export interface SetAsideRecord extends DamagedRecord {
  /** The record's stored form, kept as it was. */
  stored: JsonValue;
}

/** The records of one journal that a loader set aside as damaged, in the order they were set aside. */
export class AsideList {
  readonly #journal: "inbox" | "outbox";
  #items: SetAsideRecord[] = [];

  constructor(journal: "inbox" | "outbox") {
    this.#journal = journal;
  }

  has(id: string): boolean {
    return this.#items.some((item) => item.id === id);
  }

  /** The error of `get` for `id`, or `null` when no record of this id was set aside. */
  error(id: string): DamagedRecordError | null {
    const item = this.#items.find((item) => item.id === id);
    return item ? new DamagedRecordError(item) : null;
  }

  list(options: DamagedListOptions | undefined): DamagedRecord[] {
    const { unreported, limit } = checkDamagedList(options, `${this.#journal}.damaged`);
    const out: DamagedRecord[] = [];
    for (const { stored: _, ...record } of this.#items) {
      if (out.length >= limit) break;
      if (!unreported || !record.reported) out.push(record);
    }
    return out;
  }

  report(id: string): boolean {
    checkId(id, `${this.#journal}.reportDamaged: "id"`);
    const i = this.#items.findIndex((item) => item.id === id && !item.reported);
    if (i < 0) return false;
    // Replaced, not changed: an exported snapshot holds the objects themselves.
    this.#items[i] = { ...this.#items[i], reported: true };
    return true;
  }

  import(items: readonly SetAsideRecord[]): void {
    if (this.#items.length > 0) throw new Error(`importRecords needs an empty ${this.#journal}`);
    this.#items = items.filter((item) => item.journal === this.#journal);
  }

  export(): SetAsideRecord[] {
    return this.#items;
  }
}
