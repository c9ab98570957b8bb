/**
 * The damaged records of one journal: listed and reported by their scripts,
 * and set aside by this reader when it cannot read one the scripts found sound.
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import { type DamagedListOptions, type DamagedRecord, DamagedRecordError } from "../../src/contract.ts";
import { checkDamagedList, checkId } from "../../src/rules.ts";
import { fieldsOf } from "./records.ts";
import { list, type Runner, strings } from "./runner.ts";

/** The backend's name, in the damaged records it reports. */
const NAME = "redis";

/**
 * The records of one journal set aside as damaged. The scripts set a record
 * aside as soon as they meet it damaged; these calls list and report them, and
 * set aside one that the scripts found sound but this reader cannot read.
 */
export class Aside {
  readonly #r: Runner;
  readonly #journal: "inbox" | "outbox";

  constructor(runner: Runner, journal: "inbox" | "outbox") {
    this.#r = runner;
    this.#journal = journal;
  }

  error(id: string, problem: string): DamagedRecordError {
    return new DamagedRecordError({ journal: this.#journal, id, backend: NAME, problem });
  }

  async list(options: DamagedListOptions | undefined): Promise<DamagedRecord[]> {
    const { unreported, limit } = checkDamagedList(options, `${this.#journal}.damaged`);
    if (limit === 0) return [];
    const flat = strings(
      await this.#r.run(this.#journal === "inbox" ? "inDamaged" : "outDamaged", [unreported ? "1" : "0", String(limit)]),
    );
    const out: DamagedRecord[] = [];
    for (let i = 0; i + 3 < flat.length; i += 4) {
      out.push({
        journal: this.#journal,
        id: flat[i]!,
        backend: NAME,
        problem: flat[i + 1]!,
        setAsideAt: Number(flat[i + 2]),
        reported: flat[i + 3] === "1",
      });
    }
    return out;
  }

  async report(id: string): Promise<boolean> {
    checkId(id, `${this.#journal}.reportDamaged: "id"`);
    const [status] = list(await this.#r.run(this.#journal === "inbox" ? "inReportDamaged" : "outReportDamaged", [id]));
    return status === "ok";
  }

  /**
   * Sets aside the record of `id` read as `flat`, which this reader cannot read, unless it changed since.
   * @returns `"changed"` when it changed since it was read (read it again), else `"ok"`/`"no"`
   */
  async setAside(id: string, flat: unknown, problem: string): Promise<string> {
    const m = fieldsOf(flat) ?? new Map<string, string>();
    const name = this.#journal === "inbox" ? "inSetAside" : "outSetAside";
    const [status] = strings(await this.#r.run(name, [id, problem, m.get("fence") ?? "", m.get("updatedAt") ?? ""]));
    return status ?? "no";
  }

  /** A record of a claim or list reply: parsed, or set aside (a failed set-aside leaves it for a later call). */
  async read<T>(flat: unknown, idField: string, parse: () => T | null): Promise<{ value: T | null; changed: boolean }> {
    try {
      return { value: parse(), changed: false };
    } catch (error) {
      const id = fieldsOf(flat)?.get(idField);
      if (id === undefined) return { value: null, changed: false };
      try {
        await this.setAside(id, flat, errorMessage(error));
        return { value: null, changed: true };
      } catch {
        return { value: null, changed: false };
      }
    }
  }

  /** `get`: the reply of the get script as a record, `null`, or a {@link DamagedRecordError}; `undefined`: read it again. */
  async got<T>(id: string, reply: unknown, parse: (flat: unknown) => T | null, last: boolean): Promise<T | null | undefined> {
    const [status, value] = list(reply);
    if (status === undefined) return null;
    if (status === "aside") throw this.error(id, String(value));
    try {
      return parse(value);
    } catch (error) {
      const problem = errorMessage(error);
      if ((await this.setAside(id, value, problem)) === "changed" && !last) return undefined;
      throw this.error(id, problem);
    }
  }
}
