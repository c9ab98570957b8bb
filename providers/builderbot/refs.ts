/**
 * Stable names for the refs of a BuilderBot flow.
 *
 * BuilderBot names each step of a flow with a random UUID made when the flow
 * is defined (`key_<uuid>`, `ans_<uuid>`), and each serialized step with an
 * MD5 of its index, its answer and its parent's ref (`refSerialize`). The
 * history it keeps (the last step sent to a user: `getPrevByNumber`) holds
 * those refs, so a history written by one process names steps no other
 * process has: after a restart the captured answer finds no callback, and the
 * user falls out of the flow. This module gives every step a name made of what
 * the flow says (its keywords, its answers, in order), the same in every
 * process that defines the same flows: the history is written with those
 * names and read back with the refs of the process reading it.
 *
 * @module
 */
import { isObj, type Obj } from "../telegram/values.ts";
import { hashText } from "../../src/content.ts";

/** Marks a stored ref (`\u0001r:<stable>`) and a stored refSerialize (`\u0001s:<stable>`). */
const REF = "\u0001r:";
const SERIAL = "\u0001s:";

/** A short fingerprint of a step's text (14 hex digits; `seed` gives another one of the same text). */
export const fingerprint: (text: string, seed?: number) => string = hashText;

/**
 * BuilderBot's event keywords (`EVENTS.WELCOME`, `EVENTS.MEDIA`, …) are made random at each start
 * (`_event_welcome__<uuid>`): a flow's name keeps their kind only.
 */
function withoutEventIds(text: string): string {
  return text.replace(/(_event_[a-z_]+?_)_[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/gi, "$1");
}

/** What this module reads of BuilderBot's `FlowClass` (`bot.flowClass`). */
export interface FlowClassLike {
  /** Every step of every flow, serialized (`{ ref, keyword, answer, options, refSerialize }`). */
  flowSerialize: unknown[];
}

/** The two-way dictionary between one process's refs and their stable names. */
export class StableRefs {
  readonly #toStable = new Map<string, string>();
  readonly #fromStable = new Map<string, string>();

  /**
   * @param flow BuilderBot's `FlowClass` of the bot (`bot.flowClass`)
   * @param keywordName the name of a keyword that BuilderBot makes anew at each start (a custom event:
   *   `utils.setEvent(name)`), `undefined` for the others
   */
  constructor(flow: FlowClassLike, keywordName: (keyword: string) => string | undefined = () => undefined) {
    const named = (keyword: unknown): unknown =>
      typeof keyword === "string" ? keywordName(keyword) ?? keyword : Array.isArray(keyword) ? keyword.map(named) : keyword;
    const steps: Obj[] = [];
    const serials: { step: Obj; index: number; scope: string }[] = [];
    // Every step, in flowSerialize and (recursively) in the nested flows of its steps' options.
    const seenArrays = new Set<unknown[]>();
    const collect = (list: unknown[], scope: string): void => {
      if (seenArrays.has(list)) return;
      seenArrays.add(list);
      list.forEach((item, index) => {
        if (!isObj(item) || typeof item.ref !== "string") return;
        steps.push(item);
        if (typeof item.refSerialize === "string") serials.push({ step: item, index, scope });
        const nested = isObj(item.options) ? item.options.nested : undefined;
        if (Array.isArray(nested)) collect(nested, "n");
      });
    };
    collect(Array.isArray(flow.flowSerialize) ? flow.flowSerialize : [], "g");
    const byRef = new Map<string, Obj>();
    for (const step of steps) if (!byRef.has(step.ref as string)) byRef.set(step.ref as string, step);
    // A step's name: its parent's name and its own answer; a root's: its keywords and options.
    const names = new Map<string, string>();
    const taken = new Map<string, number>();
    const nameOf = (ref: string, depth = 0): string => {
      const known = names.get(ref);
      if (known !== undefined) return known;
      const step = byRef.get(ref)!;
      const parent = typeof step.keyword === "string" && byRef.has(step.keyword) && step.keyword !== ref && depth < 10_000
        ? nameOf(step.keyword, depth + 1)
        : undefined;
      const own = parent === undefined
        ? `k${fingerprint(withoutEventIds(JSON.stringify([named(step.keyword) ?? null, isObj(step.options) ? [step.options.sensitive ?? null, step.options.regex ?? null] : null])))}`
        : `${parent}>${fingerprint(JSON.stringify([step.answer ?? null, isObj(step.options) ? step.options.capture ?? null : null]))}`;
      // The same text twice (two flows alike): told apart by the order they were defined in.
      const n = taken.get(own) ?? 0;
      taken.set(own, n + 1);
      const name = n === 0 ? own : `${own}#${n}`;
      names.set(ref, name);
      return name;
    };
    for (const ref of byRef.keys()) this.#add(ref, nameOf(ref));
    for (const { step, index, scope } of serials) {
      this.#add(step.refSerialize as string, `${scope}${index}@${names.get(step.ref as string)}`, true);
    }
  }

  #add(value: string, stable: string, serial = false): void {
    if (this.#toStable.has(value)) return;
    const marked = (serial ? SERIAL : REF) + stable;
    this.#toStable.set(value, marked);
    if (!this.#fromStable.has(marked)) this.#fromStable.set(marked, value);
  }

  /** How many refs and refSerializes are named. */
  get size(): number {
    return this.#toStable.size;
  }

  /**
   * A copy of `value` (JSON-like) with this process's refs replaced by their stable names, and what is
   * not JSON (functions, undefined) left out.
   */
  encode(value: unknown): unknown {
    return this.#walk(value, (s) => this.#toStable.get(s) ?? s);
  }

  /**
   * A copy of `value` as {@link encode} wrote it, with the stable names replaced by this process's refs.
   * A name no step of this process has (the flow changed since) is left as it is: BuilderBot then finds
   * no step for it, as it finds none for a ref of another process.
   */
  decode(value: unknown): unknown {
    return this.#walk(value, (s) => this.#fromStable.get(s) ?? s);
  }

  #walk(value: unknown, map: (s: string) => string, depth = 0): unknown {
    if (typeof value === "string") return map(value);
    if (value === null || typeof value === "number" || typeof value === "boolean") return value;
    if (depth > 200) return null;
    if (Array.isArray(value)) return value.map((v) => this.#walk(v, map, depth + 1) ?? null);
    if (isObj(value)) {
      const out: Obj = {};
      for (const [k, v] of Object.entries(value)) {
        const mapped = this.#walk(v, map, depth + 1);
        if (mapped !== undefined) Object.defineProperty(out, k, { value: mapped, enumerable: true, writable: true, configurable: true });
      }
      return out;
    }
    return undefined;
  }
}
