/**
 * KvDurability (see `mod.ts` for the user documentation).
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  DamagedRecordError,
  type DamagedRecords,
  type DurabilityBackend,
  type DurableKv,
  type FailOutcome,
  type InboundRecord,
  type InboundState,
  type BackendScope,
  type InboxJournal,
  type JsonValue,
  type KvEntry,
  type ListOptions,
  type NewInboundRecord,
  type NewOutboxEntry,
  type OutboxClaim,
  type OutboxEntry,
  type OutboxJournal,
  type OutboxState,
  type ReserveResult,
  StaleLeaseError,
} from "../../src/contract.ts";
import { delay } from "../../src/runtime/mod.ts";
import { isEmptyClaim, ScanAnswers } from "../../src/scan_answers.ts";
import {
  acceptsOutcome,
  ACTIVE_INBOX_STATES,
  AMBIGUOUS_OUTBOX_STATE,
  admitsLeased,
  ambiguousOutbox,
  BLOCKING_OUTBOX_STATES,
  callingOutbox,
  checkAttempt,
  claimedInbound,
  claimToken,
  scheduledInbound,
  startedInbound,
  claimedOutbox,
  cloneJson,
  doneInbound,
  extendedLease,
  failedFields,
  failedOutbox,
  holdsChat,
  inboxDueAt,
  isInboxClaimable,
  isLeasedWith,
  isLeaseAbandoned,
  matchesList,
  checkClaim,
  checkFinite,
  checkId,
  checkNewInbound,
  checkNewOutbox,
  checkOutcome,
  checkString,
  newInboundRecord,
  newOutboxEntry,
  normalizeList,
  outboxDueAt,
  replayedInbound,
  requeuedOutbox,
  sentOutbox,
  checkDamagedList,
} from "../../src/rules.ts";
import { INBOX, OUTBOX, theState, traitsOf } from "../../src/machine.ts";
import { describeJsonKind, storedInboundProblem, storedOutboxProblem, withStoredCalled } from "../../src/stored_records.ts";

/** Options of {@link KvDurability}. */
export interface KvDurabilityOptions {
  /**
   * Prepended to every key (default `""`). Give each backend sharing one kv
   * its own prefix ending in a separator, e.g. `"bot-a:"`.
   */
  prefix?: string;
}

/** Entries per `list` call of a scan. */
const PAGE = 256;
/** Lost compare-and-sets in a row before an operation gives up. */
const MAX_RACES = 100;
/** A hint written for a record that never got created is stale after this. */
const ORPHAN_GRACE_MS = 10 * 60_000;

/** A record as stored: the record and the index keys it owns. */
interface Stored<R> {
  rec: R;
  hints: string[];
}

/** A record as read, with its version. */
interface Loaded<R> extends Stored<R> {
  version: string;
}

/** The value of an index key: the record version its writer based its CAS on, and when it was written. */
interface HintValue {
  b: string | null;
  t: number;
}

/** The value of a set-aside marker `d/<in|out>/<id>`: a damaged record and its report. */
interface AsideValue {
  problem: string;
  setAsideAt: number;
  reported: boolean;
  /** The version of the record's value that was set aside. */
  v: string;
}

/** A record value that is not a record: its id (from its key), what is wrong, and the value as read. */
class Damage {
  constructor(readonly id: string, readonly problem: string, readonly entry: KvEntry) {}
}

/** A parsed due hint. */
interface DueHint {
  entry: KvEntry;
  dueAt: number;
  order: number;
  state: string;
  chatId: string | null;
  id: string;
}

/** Escapes `%` and `/` so that a value is one key segment. */
function esc(value: string): string {
  return value.replace(/[%/]/g, (c) => (c === "%" ? "%25" : "%2F"));
}

function unesc(segment: string): string {
  return segment.replace(/%(25|2F)/g, (_, code) => (code === "25" ? "%" : "/"));
}

/** A non-negative integer as 16 digits, so that key order is numeric order. */
function pad(n: number): string {
  const v = Number.isNaN(n) ? 0 : Math.min(Math.max(Math.floor(n), 0), Number.MAX_SAFE_INTEGER);
  return String(v).padStart(16, "0");
}

function nonce(): string {
  const bytes = new Uint8Array(8);
  crypto.getRandomValues(bytes);
  let out = "";
  for (const b of bytes) out += b.toString(16).padStart(2, "0");
  return out;
}

/** A hint key without its nonce: what the hint says. */
function logicalOf(hint: string): string {
  return hint.slice(0, hint.lastIndexOf("/"));
}

function compareStrings(a: string, b: string): number {
  return a < b ? -1 : a > b ? 1 : 0;
}

/** Runs best-effort cleanups, ignoring their failures (also a kv method that throws at once). */
async function quietly<T>(items: readonly T[], work: (item: T) => Promise<unknown>): Promise<void> {
  await Promise.allSettled(items.map(async (item) => await work(item)));
}

/** What the rest of a record's life needs from it. */
interface Journaled {
  state: string;
  chatId: string;
  updatedAt: number;
}

/** The storage half shared by the inbox and the outbox: records, hints, CAS loops, scans. */
abstract class KvJournal<R extends Journaled> implements DamagedRecords {
  protected readonly kv: DurableKv;
  protected readonly prefix: string;
  readonly #records: string;
  /** Set-aside markers of this journal. */
  readonly #aside: string;
  readonly #journal: "inbox" | "outbox";
  readonly #backend: string;
  /** id → the version of its damaged value this instance knows is set aside (no marker write again). */
  readonly #known = new Map<string, string>();
  /** Due index prefix of this journal. */
  protected readonly duePrefix: string;
  /** State index prefix of this journal. */
  protected readonly statePrefix: string;

  constructor(kv: DurableKv, prefix: string, kind: "in" | "out", backend: string) {
    this.kv = kv;
    this.prefix = prefix;
    this.#records = `${prefix}r/${kind}/`;
    this.#aside = `${prefix}d/${kind}/`;
    this.#journal = kind === "in" ? "inbox" : "outbox";
    this.#backend = backend;
    this.duePrefix = `${prefix}i/due/${kind}/`;
    this.statePrefix = `${prefix}i/st/${kind}/`;
  }

  /** The record's id. */
  protected abstract idOf(rec: R): string;
  /** The index keys (without nonces) that `rec` needs. */
  protected abstract hintsFor(rec: R): string[];
  /** What is wrong with a stored record, naming the field, or `null`. */
  protected abstract problemOf(rec: unknown): string | null;
  /** `rec` as read from the kv, with fields that older versions did not store filled in. */
  protected revive(rec: R): R {
    return rec;
  }

  #recordKey(id: string): string {
    return this.#records + esc(id);
  }

  /** The record of a record key's entry, or the {@link Damage} of one that is not a record. */
  #unwrap(entry: KvEntry): Loaded<R> | Damage {
    const id = unesc(entry.key.slice(this.#records.length));
    const value = entry.value as unknown as Stored<R> | null;
    const idField = this.#journal === "inbox" ? "id" : "key";
    const problem = typeof value !== "object" || value === null || Array.isArray(value)
      ? `the stored value must be an object with "rec" and "hints", got ${describeJsonKind(value)}`
      : !Array.isArray(value.hints) || !value.hints.every((hint) => typeof hint === "string")
      ? `field "hints" must be an array of strings, got ${describeJsonKind(value.hints)}`
      : typeof value.rec !== "object" || value.rec === null || Array.isArray(value.rec)
      ? `field "rec" must be an object, got ${describeJsonKind(value.rec)}`
      : this.problemOf(value.rec) ??
        ((value.rec as unknown as Record<string, unknown>)[idField] !== id
          ? `field "${idField}" must be the one of its key (${JSON.stringify(id)}), got ${
            JSON.stringify((value.rec as unknown as Record<string, unknown>)[idField])
          }`
          : null);
    if (problem !== null) return new Damage(id, problem, entry);
    return { rec: this.revive(value!.rec), hints: value!.hints, version: entry.version };
  }

  #asideKey(id: string): string {
    return this.#aside + esc(id);
  }

  /** Sets a damaged record aside: one compare-and-set creates its marker, so only the first caller does. */
  async #setAside(damage: Damage): Promise<void> {
    if (this.#known.get(damage.id) === damage.entry.version) return;
    const marker: AsideValue = { problem: damage.problem, setAsideAt: await this.clock(), reported: false, v: damage.entry.version };
    await this.kv.set(this.#asideKey(damage.id), marker as unknown as JsonValue, null);
    this.#known.set(damage.id, damage.entry.version);
  }

  /** The error `get` (and `reserve`) rejects with for a damaged record. */
  protected damagedError(damage: Damage): DamagedRecordError {
    return new DamagedRecordError({ journal: this.#journal, id: damage.id, backend: this.#backend, problem: damage.problem });
  }

  async damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    const { unreported, limit } = checkDamagedList(options, `${this.#journal}.damaged`);
    if (limit === 0) return [];
    const found: DamagedRecord[] = [];
    for await (const entry of this.scan(this.#aside)) {
      const v = entry.value as unknown as Partial<AsideValue> | null;
      if (typeof v !== "object" || v === null) continue;
      const reported = v.reported === true;
      if (unreported && reported) continue;
      found.push({
        journal: this.#journal,
        id: unesc(entry.key.slice(this.#aside.length)),
        backend: this.#backend,
        problem: typeof v.problem === "string" ? v.problem : "(the set-aside marker does not say)",
        setAsideAt: typeof v.setAsideAt === "number" ? v.setAsideAt : 0,
        reported,
      });
    }
    // Markers are listed by id: set-aside order is their time (ties by id).
    found.sort((a, b) => a.setAsideAt - b.setAsideAt || compareStrings(a.id, b.id));
    return found.slice(0, limit);
  }

  async reportDamaged(id: string): Promise<boolean> {
    checkId(id, `${this.#journal}.reportDamaged: "id"`);
    for (let race = 0;; race++) {
      const cur = await this.kv.get(this.#asideKey(id));
      const v = cur?.value as unknown as AsideValue | null | undefined;
      if (!cur || typeof v !== "object" || v === null || v.reported !== false) return false;
      if ((await this.kv.set(cur.key, { ...v, reported: true } as unknown as JsonValue, cur.version)) !== null) return true;
      if (race >= MAX_RACES) {
        throw new Error(`kv durability: gave up reporting "${id}" after ${MAX_RACES} lost compare-and-sets`);
      }
    }
  }

  /** The kv clock (a kv method that throws at once still gives a rejected promise). */
  protected async clock(): Promise<number> {
    return await this.kv.now();
  }

  /** Reads record `id`: `null` when there is none, its {@link Damage} (set aside now) when it is damaged. */
  protected async read(id: string): Promise<Loaded<R> | Damage | null> {
    const entry = await this.kv.get(this.#recordKey(id));
    if (!entry) return null;
    const read = this.#unwrap(entry);
    if (read instanceof Damage) await this.#setAside(read);
    return read;
  }

  /** Reads record `id`: `null` when there is none, or it is damaged (then set aside). */
  protected async load(id: string): Promise<Loaded<R> | null> {
    const read = await this.read(id);
    return read instanceof Damage ? null : read;
  }

  /**
   * Replaces `cur` (`null`: creates) with `next` by one CAS, keeping hints
   * crash-safe: new hints before, dropped hints after.
   * @param since local `Date.now()` when `now` was read (to notice a create so slow that scans took its hints for orphans).
   * @returns the stored record, or `null` when the CAS lost (nothing changed).
   */
  protected async write(
    cur: Loaded<R> | null,
    next: R,
    now: number,
    since: number = Date.now(),
  ): Promise<Loaded<R> | null> {
    const old = cur?.hints ?? [];
    const byLogical = new Map(old.map((hint) => [logicalOf(hint), hint]));
    const hints: string[] = [];
    const fresh: string[] = [];
    for (const logical of this.hintsFor(next)) {
      const kept = byLogical.get(logical);
      if (kept !== undefined) {
        hints.push(kept);
      } else {
        const hint = `${logical}/${nonce()}`;
        hints.push(hint);
        fresh.push(hint);
      }
    }
    const base = cur?.version ?? null;
    const mark: HintValue = { b: base, t: now };
    await Promise.all(fresh.map(async (hint) => await this.kv.set(hint, mark as unknown as JsonValue)));
    const stored: Stored<R> = { rec: next, hints };
    const version = await this.kv.set(this.#recordKey(this.idOf(next)), stored as unknown as JsonValue, base);
    if (version === null) {
      await quietly(fresh, (hint) => this.kv.delete(hint));
      return null;
    }
    await quietly(old.filter((hint) => !hints.includes(hint)), (hint) => this.kv.delete(hint));
    if (cur === null) {
      // A scan may have taken the hints of a very slow create for orphans: put them back.
      const elapsed = Date.now() - since;
      if (!(elapsed >= 0 && elapsed < ORPHAN_GRACE_MS / 4)) {
        const again: HintValue = { b: version, t: now };
        await quietly(fresh, (hint) => this.kv.set(hint, again as unknown as JsonValue));
      }
    }
    return { rec: next, hints, version };
  }

  /** Deletes `cur` if unchanged, then its hints. @returns whether it was deleted. */
  protected async remove(cur: Loaded<R>): Promise<boolean> {
    const deleted = await this.kv.delete(this.#recordKey(this.idOf(cur.rec)), cur.version);
    if (deleted) await quietly(cur.hints, (hint) => this.kv.delete(hint));
    return deleted;
  }

  /**
   * A CAS loop: reads the record, asks `decide` for its next value (`null`:
   * leave it), writes it; a lost CAS re-reads and re-decides.
   * @param first an already loaded record and the time it was read at, to start from.
   * @returns the last record seen, and the record written (`null`: nothing changed).
   */
  protected async mutate(
    id: string,
    decide: (rec: R, now: number) => R | null,
    first?: { cur: Loaded<R>; now: number },
  ): Promise<{ seen: R | null; written: Loaded<R> | null }> {
    let state = first;
    for (let race = 0;; race++) {
      if (!state) {
        const [cur, now] = await Promise.all([this.load(id), this.clock()]);
        if (!cur) return { seen: null, written: null };
        state = { cur, now };
      }
      const next = decide(state.cur.rec, state.now);
      if (next === null) return { seen: state.cur.rec, written: null };
      const written = await this.write(state.cur, next, state.now);
      if (written) return { seen: state.cur.rec, written };
      if (race >= MAX_RACES) {
        throw new Error(`kv durability: gave up on record "${id}" after ${MAX_RACES} lost compare-and-sets`);
      }
      state = undefined;
    }
  }

  /**
   * Checks a hint against its record (read now, after the hint was listed).
   * Deletes it when stale for good.
   * @returns the record when the hint is valid, else `null`.
   */
  protected async check(hint: KvEntry, id: string, now: number): Promise<Loaded<R> | null> {
    const read = await this.read(id);
    if (read instanceof Damage) {
      // Set aside: none of its index keys counts any more (nothing writes the record again).
      await quietly([hint], (stale) => this.kv.delete(stale.key, stale.version));
      return null;
    }
    const cur = read;
    if (cur && cur.hints.includes(hint.key)) return cur;
    const value = hint.value as unknown as Partial<HintValue> | null;
    const base = typeof value === "object" && value !== null ? value.b : undefined;
    const written = typeof value === "object" && value !== null && typeof value.t === "number" ? value.t : 0;
    const pending = cur
      ? base === cur.version // its writer's CAS may be on the way
      : base === null && now - written < ORPHAN_GRACE_MS; // a create on the way
    if (!pending) await quietly([hint], (stale) => this.kv.delete(stale.key, stale.version));
    return null;
  }

  /** Every entry under `prefix` in key order, a page at a time. */
  protected async *scan(prefix: string): AsyncGenerator<KvEntry> {
    let after: string | undefined;
    for (;;) {
      const page = await this.kv.list(prefix, after === undefined ? { limit: PAGE } : { after, limit: PAGE });
      for (const entry of page) yield entry;
      if (page.length < PAGE) return;
      after = page[page.length - 1].key;
    }
  }

  /** Due hints up to `now`; with `reclaimOwn`, also later ones in `leasedState`. */
  protected async dueHints(now: number, reclaimOwn: boolean, leasedState: string): Promise<DueHint[]> {
    const out: DueHint[] = [];
    for await (const entry of this.scan(this.duePrefix)) {
      const parts = entry.key.slice(this.duePrefix.length).split("/");
      if (parts.length !== 5 && parts.length !== 6) continue;
      const dueAt = Number(parts[0]);
      const state = parts[2];
      if (dueAt > now) {
        if (!reclaimOwn) break;
        if (state !== leasedState) continue;
      }
      out.push({
        entry,
        dueAt,
        order: Number(parts[1]),
        state,
        chatId: parts.length === 6 ? unesc(parts[3]) : null,
        id: unesc(parts[parts.length - 2]),
      });
    }
    out.sort((a, b) => a.order - b.order || compareStrings(a.id, b.id));
    return out;
  }

  /**
   * `list`: through the state index when states are given, else over all records.
   * @param inOrder whether a state's index is already in list order (then a scan stops at `limit`).
   */
  protected async listRecords(
    filter: { states: ReadonlySet<string> | null; chatId: string | undefined; limit: number },
    compare: (a: R, b: R) => number,
    inOrder: (state: string) => boolean,
  ): Promise<R[]> {
    if (filter.limit === 0) return [];
    const out: R[] = [];
    if (filter.states === null) {
      for await (const entry of this.scan(this.#records)) {
        const read = this.#unwrap(entry);
        if (read instanceof Damage) await this.#setAside(read);
        else if (matchesList(read.rec, filter)) out.push(read.rec);
      }
    } else {
      const now = await this.kv.now();
      for (const state of filter.states) {
        const prefix = `${this.statePrefix}${esc(state)}/`;
        let found = 0;
        for await (const entry of this.scan(prefix)) {
          const parts = entry.key.slice(prefix.length).split("/");
          if (parts.length !== 3) continue;
          const cur = await this.check(entry, unesc(parts[1]), now);
          if (!cur || cur.rec.state !== state || !matchesList(cur.rec, filter)) continue;
          out.push(cur.rec);
          if (++found >= filter.limit && inOrder(state)) break;
        }
      }
    }
    return out.sort(compare).slice(0, filter.limit);
  }

  /** Deletes records in `state` whose `updatedAt` is at most `now - olderThanMs`. */
  protected async purgeState(state: string, olderThanMs: number): Promise<number> {
    const now = await this.kv.now();
    const cutoff = now - olderThanMs;
    const prefix = `${this.statePrefix}${state}/`;
    let count = 0;
    for await (const entry of this.scan(prefix)) {
      const parts = entry.key.slice(prefix.length).split("/");
      if (parts.length !== 3) continue;
      if (!(Number(parts[0]) <= cutoff)) break;
      const cur = await this.check(entry, unesc(parts[1]), now);
      if (!cur || cur.rec.state !== state || !(cur.rec.updatedAt <= cutoff)) continue;
      if (await this.remove(cur)) count++;
    }
    return count;
  }
}

/** Arrival order of inbox records: `receivedAt`, then id. */
function byArrival(a: InboundRecord, b: InboundRecord): number {
  return a.receivedAt - b.receivedAt || compareStrings(a.id, b.id);
}

/**
 * Whether `holder` (held elsewhere) holds back `rec` of its chat: `rec` arrived after it, or in the same
 * millisecond (ids do not tell which of two records admitted by different engines in one millisecond came
 * first, so a held record holds back its whole millisecond).
 */
function holdsBack(holder: InboundRecord, rec: InboundRecord): boolean {
  return holder.id !== rec.id && holder.receivedAt <= rec.receivedAt;
}

/** What one due scan knows of a chat. */
interface ChatTurn {
  /** The records the scan may claim, in arrival order: claimable, and before the first record held elsewhere (and its millisecond). */
  queue: Loaded<InboundRecord>[];
  /** The first record held elsewhere, if any. */
  holder: InboundRecord | null;
  /** Ids of the chat's active records that the chat index listed. */
  indexed: Set<string>;
  /** How many of `queue` the scan has claimed. */
  next: number;
  /** Set when a claim was lost: the scan leaves the chat. */
  stopped: boolean;
}

/** Whether `rec` is leased to the caller of `options` under `token` (a claim of its that committed). */
function leasedBy(rec: InboundRecord | OutboxEntry, options: ClaimOptions, token: number): boolean {
  const lease = rec.lease;
  return lease !== null && lease.owner === options.owner && lease.incarnation === options.incarnation && lease.token === token &&
    rec.fence === token;
}

class KvInbox extends KvJournal<InboundRecord> implements InboxJournal {
  readonly #answers = new ScanAnswers<InboundRecord[]>(() => [], (a) => a.length === 0);
  constructor(kv: DurableKv, prefix: string, backend: string) {
    super(kv, prefix, "in", backend);
  }

  protected idOf(rec: InboundRecord): string {
    return rec.id;
  }

  protected problemOf(rec: unknown): string | null {
    return storedInboundProblem(rec);
  }

  #chatPrefix(chatId: string): string {
    return `${this.prefix}i/chat-in/${esc(chatId)}/`;
  }

  protected hintsFor(rec: InboundRecord): string[] {
    const id = esc(rec.id);
    const time = INBOX[rec.state].purgeable ? rec.updatedAt : rec.receivedAt;
    const hints = [`${this.statePrefix}${rec.state}/${pad(time)}/${id}`];
    const dueAt = inboxDueAt(rec);
    if (dueAt !== null) hints.push(`${this.duePrefix}${pad(dueAt)}/${pad(rec.receivedAt)}/${rec.state}/${id}`);
    if (ACTIVE_INBOX_STATES.includes(rec.state)) hints.push(`${this.#chatPrefix(rec.chatId)}${pad(rec.receivedAt)}/${id}`);
    return hints;
  }

  /**
   * Reads the chat's active records (through its index) and what a scan under `options` may claim of them.
   * @param seen a record of the chat just read (not read again).
   */
  async #chatTurn(chatId: string, now: number, options: ClaimOptions, seen: Loaded<InboundRecord>): Promise<ChatTurn> {
    const prefix = this.#chatPrefix(chatId);
    const entries: KvEntry[] = [];
    for await (const entry of this.scan(prefix)) entries.push(entry);
    const records: Loaded<InboundRecord>[] = [];
    for (let i = 0; i < entries.length; i += PAGE) {
      const page = await Promise.all(entries.slice(i, i + PAGE).map((entry) => {
        if (seen.hints.includes(entry.key)) return seen;
        const parts = entry.key.slice(prefix.length).split("/");
        return parts.length === 3 ? this.check(entry, unesc(parts[1]), now) : null;
      }));
      for (const cur of page) {
        if (cur && cur.rec.chatId === chatId && ACTIVE_INBOX_STATES.includes(cur.rec.state)) records.push(cur);
      }
    }
    records.sort((a, b) => byArrival(a.rec, b.rec));
    const turn: ChatTurn = { queue: [], holder: null, indexed: new Set(), next: 0, stopped: false };
    for (const cur of records) {
      turn.indexed.add(cur.rec.id);
      if (turn.holder) continue;
      if (holdsChat(cur.rec, now, options)) turn.holder = cur.rec;
      else if (isInboxClaimable(cur.rec, now, options)) turn.queue.push(cur);
    }
    const holder = turn.holder;
    if (holder) turn.queue = turn.queue.filter((item) => !holdsBack(holder, item.rec));
    return turn;
  }

  /**
   * The chat index keys of `chatId` for records received up to `receivedAt` (the new record's): the
   * records that may come before a record admitted now.
   */
  async #listedBefore(chatId: string, receivedAt: number): Promise<{ entry: KvEntry; id: string }[]> {
    const prefix = this.#chatPrefix(chatId);
    const bound = Number(pad(receivedAt));
    const out: { entry: KvEntry; id: string }[] = [];
    for await (const entry of this.scan(prefix)) {
      const parts = entry.key.slice(prefix.length).split("/");
      if (parts.length !== 3) continue;
      if (Number(parts[0]) > bound) break; // arrived later: comes after the new record
      out.push({ entry, id: unesc(parts[1]) });
    }
    return out;
  }

  /**
   * Whether a record of `chatId` received at `receivedAt` may be admitted leased under `lease`: each
   * active record listed before it (see `#listedBefore`) lets it (`admitsLeased`). A key whose record
   * does not list it (set aside, not created yet, stale) counts as nothing.
   */
  async #admitsLeased(
    chatId: string,
    receivedAt: number,
    listed: { entry: KvEntry; id: string }[],
    now: number,
    lease: ClaimOptions,
  ): Promise<boolean> {
    for (let i = 0; i < listed.length; i += PAGE) {
      const page = await Promise.all(listed.slice(i, i + PAGE).map(({ entry, id }) => this.check(entry, id, now)));
      for (const cur of page) {
        if (!cur || cur.rec.chatId !== chatId || !ACTIVE_INBOX_STATES.includes(cur.rec.state)) continue;
        // The same receivedAt: the record already there came first.
        if (cur.rec.receivedAt <= receivedAt && !admitsLeased(cur.rec, now, lease)) return false;
      }
    }
    return true;
  }

  async admit(record: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null> {
    if (lease !== undefined) checkClaim(lease, "inbox.admit");
    const input = checkNewInbound(record);
    const since = Date.now();
    // With a lease, the chat's index is listed beside the clock read, then what it lists is read.
    const [now, listed] = await Promise.all([
      this.kv.now(),
      lease === undefined ? null : this.#listedBefore(input.chatId, input.receivedAt),
    ]);
    const leased = lease !== undefined && listed !== null &&
        await this.#admitsLeased(input.chatId, input.receivedAt, listed, now, lease)
      ? lease
      : undefined;
    const written = await this.write(null, newInboundRecord(input, now, leased), now, since);
    return written ? cloneJson(written.rec) : null;
  }

  async claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    checkId(id, `inbox.claim: "id"`);
    checkClaim(options, "inbox.claim");
    const { written } = await this.mutate(
      id,
      (rec, now) => (isInboxClaimable(rec, now, options) ? claimedInbound(rec, now, options) : null),
    );
    return written?.rec ?? null;
  }

  async claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    checkClaim(options, "inbox.claimDue");
    checkFinite(options.limit, `inbox.claimDue: option "limit"`);
    if (options.repeat === true) return await this.#answers.answer(options, () => [], cloneJson);
    // Each record is claimed by its own compare-and-set: a scan that fails keeps what it had confirmed.
    const out: InboundRecord[] = [];
    try {
      return (await this.#scanDue(options, out)).sort(byArrival);
    } finally {
      this.#answers.keep(options, [...out].sort(byArrival), cloneJson);
    }
  }

  async #scanDue(options: ClaimDueOptions, out: InboundRecord[]): Promise<InboundRecord[]> {
    if (!(options.limit > 0)) return [];
    const now = await this.kv.now();
    const hints = await this.dueHints(now, options.reclaimOwn === true, theState(INBOX, "leased"));
    const chats = new Map<string, ChatTurn>();
    const claim = (rec: InboundRecord, at: number) =>
      isInboxClaimable(rec, at, options) ? claimedInbound(rec, at, options) : null;
    for (const hint of hints) {
      if (out.length >= options.limit) break;
      const cur = await this.check(hint.entry, hint.id, now);
      if (!cur || !isInboxClaimable(cur.rec, now, options)) continue;
      const chatId = cur.rec.chatId;
      let turn = chats.get(chatId);
      if (!turn) chats.set(chatId, turn = await this.#chatTurn(chatId, now, options, cur));
      if (turn.stopped || (turn.holder && holdsBack(turn.holder, cur.rec))) continue;
      let at = turn.queue.findIndex((item) => item.rec.id === cur.rec.id);
      if (at < 0) {
        // The chat index was read after the hint: it knows better, unless it does not list the record (stored before the index existed).
        if (turn.indexed.has(cur.rec.id)) continue;
        turn.indexed.add(cur.rec.id);
        at = turn.queue.findIndex((item) => byArrival(item.rec, cur.rec) > 0);
        if (at < 0) at = turn.queue.length;
        if (at < turn.next) continue; // behind records this scan claimed: left for a later scan
        turn.queue.splice(at, 0, cur);
      }
      // Its chat's earlier claimable records first (the due index orders ties of a millisecond by id, not exactly).
      while (turn.next <= at && out.length < options.limit) {
        const item = turn.queue[turn.next++];
        const { written } = await this.mutate(item.rec.id, claim, { cur: item, now }).catch(async (error) => {
          // The write's reply was lost: read it back, so that the scan's answer holds it if it committed.
          const back = await this.get(item.rec.id).catch(() => null);
          if (back !== null && leasedBy(back, options, claimToken(item.rec.fence))) out.push(back);
          throw error;
        });
        if (!written) {
          turn.stopped = true;
          break;
        }
        out.push(written.rec);
      }
    }
    return out;
  }

  async heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(id, `inbox.heartbeat: "id"`);
    checkFinite(token, `inbox.heartbeat: "token"`);
    checkFinite(leaseMs, `inbox.heartbeat: "leaseMs"`);
    const { written } = await this.mutate(id, (rec, now) =>
      isLeasedWith(rec, token) ? extendedLease(rec, now, leaseMs) : null);
    return written !== null;
  }

  async start(id: string, token: number, attempt: number): Promise<boolean> {
    checkId(id, `inbox.start: "id"`);
    checkFinite(token, `inbox.start: "token"`);
    checkAttempt(attempt, "inbox.start");
    const { written } = await this.mutate(id, (rec, now) =>
      isLeasedWith(rec, token) ? startedInbound(rec, attempt, now) : null);
    return written !== null;
  }

  async schedule(id: string, token: number, dueInMs: number): Promise<void> {
    checkId(id, `inbox.schedule: "id"`);
    checkFinite(token, `inbox.schedule: "token"`);
    checkFinite(dueInMs, `inbox.schedule: "dueInMs"`);
    const { written } = await this.mutate(id, (rec, now) =>
      isLeasedWith(rec, token) ? scheduledInbound(rec, dueInMs, now) : null);
    if (!written) throw new StaleLeaseError("inbox", id, token);
  }

  async complete(id: string, token: number): Promise<void> {
    checkId(id, `inbox.complete: "id"`);
    checkFinite(token, `inbox.complete: "token"`);
    const { written } = await this.mutate(id, (rec, now) =>
      isLeasedWith(rec, token) ? doneInbound(rec, now) : null);
    if (!written) throw new StaleLeaseError("inbox", id, token);
  }

  async fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    checkId(id, `inbox.fail: "id"`);
    checkFinite(token, `inbox.fail: "token"`);
    checkOutcome(outcome, "inbox.fail");
    const { written } = await this.mutate(id, (rec, now) =>
      isLeasedWith(rec, token) ? { ...rec, ...failedFields(outcome, now) } : null);
    if (!written) throw new StaleLeaseError("inbox", id, token);
  }

  async get(id: string): Promise<InboundRecord | null> {
    checkId(id, `inbox.get: "id"`);
    const read = await this.read(id);
    if (read instanceof Damage) throw this.damagedError(read);
    return read?.rec ?? null;
  }

  list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    return this.listRecords(normalizeList(options), byArrival, (state) => traitsOf(INBOX, state)?.purgeable !== true);
  }

  async replay(id: string): Promise<boolean> {
    checkId(id, `inbox.replay: "id"`);
    const { written } = await this.mutate(id, (rec, now) =>
      replayedInbound(rec, now));
    return written !== null;
  }

  purge(olderThanMs: number): Promise<number> {
    return this.purgeState(theState(INBOX, "purgeable"), olderThanMs);
  }
}

function isBlocking(state: OutboxState): boolean {
  return BLOCKING_OUTBOX_STATES.includes(state);
}

class KvOutbox extends KvJournal<OutboxEntry> implements OutboxJournal {
  readonly #answers = new ScanAnswers<OutboxClaim>(() => ({ due: [], ambiguous: [] }), isEmptyClaim);
  readonly #counter: string;
  #seqTurn: Promise<unknown> = Promise.resolve();
  /** chatId → the tail of this instance's queue of reserves for that chat. */
  readonly #chatQueues = new Map<string, Promise<void>>();

  constructor(kv: DurableKv, prefix: string, backend: string) {
    super(kv, prefix, "out", backend);
    this.#counter = `${prefix}c/out/seq`;
  }

  protected problemOf(entry: unknown): string | null {
    return storedOutboxProblem(entry);
  }

  /** Runs `work` after this instance's earlier reserves for `chatId` finished. */
  async #inChat<T>(chatId: string, work: () => Promise<T>): Promise<T> {
    const before = this.#chatQueues.get(chatId);
    let release!: () => void;
    const done = new Promise<void>((resolve) => (release = resolve));
    const tail = before ? before.then(() => done) : done;
    this.#chatQueues.set(chatId, tail);
    try {
      if (before) await before;
      return await work();
    } finally {
      release();
      if (this.#chatQueues.get(chatId) === tail) this.#chatQueues.delete(chatId);
    }
  }

  protected idOf(entry: OutboxEntry): string {
    return entry.key;
  }

  /** An entry stored before `called` existed has none: a call may have started under its lease, so it reads as `true`. */
  protected override revive(entry: OutboxEntry): OutboxEntry {
    return withStoredCalled(entry);
  }

  #chatPrefix(chatId: string): string {
    return `${this.prefix}i/chat/${esc(chatId)}/`;
  }

  protected hintsFor(entry: OutboxEntry): string[] {
    const key = esc(entry.key);
    const time = OUTBOX[entry.state].purgeable ? entry.updatedAt : entry.seq;
    const hints = [`${this.statePrefix}${entry.state}/${pad(time)}/${key}`];
    const dueAt = outboxDueAt(entry);
    if (dueAt !== null) {
      hints.push(`${this.duePrefix}${pad(dueAt)}/${pad(entry.seq)}/${entry.state}/${esc(entry.chatId)}/${key}`);
    }
    if (isBlocking(entry.state)) hints.push(`${this.#chatPrefix(entry.chatId)}${pad(entry.seq)}/${key}`);
    return hints;
  }

  /** The next sequence number: a counter advanced by CAS. */
  /**
   * The next outbox sequence number. Callers of this instance take turns (a
   * compare-and-set they race each other on is lost by all but one, over and
   * over under load); a set lost to another process is tried again after a
   * short random pause.
   */
  #nextSeq(): Promise<number> {
    const turn = this.#seqTurn.then(() => this.#casSeq());
    this.#seqTurn = turn.catch(() => {});
    return turn;
  }

  async #casSeq(): Promise<number> {
    for (let race = 0;; race++) {
      const cur = await this.kv.get(this.#counter);
      const next = (typeof cur?.value === "number" ? cur.value : 0) + 1;
      if ((await this.kv.set(this.#counter, next, cur ? cur.version : null)) !== null) return next;
      if (race >= MAX_RACES) {
        throw new Error(`kv durability: gave up on the outbox sequence after ${MAX_RACES} lost compare-and-sets`);
      }
      await delay(Math.random() * Math.min(20, 2 ** Math.min(race, 5)));
    }
  }

  /** Whether the chat has an unsettled entry with a `seq` below `seq`. */
  async #chatBlocked(chatId: string, seq: number, now: number): Promise<boolean> {
    const prefix = this.#chatPrefix(chatId);
    for await (const entry of this.scan(prefix)) {
      const parts = entry.key.slice(prefix.length).split("/");
      if (parts.length !== 3) continue;
      if (Number(parts[0]) >= seq) return false;
      const cur = await this.check(entry, unesc(parts[1]), now);
      if (cur && isBlocking(cur.rec.state) && cur.rec.seq < seq) return true;
    }
    return false;
  }

  /**
   * Reserves of one chat run one after the other within this instance, so
   * that the chat check and the write are not interleaved; across instances
   * they are not (chats are sticky to one replica).
   */
  reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    let input: NewOutboxEntry;
    try {
      if (lease !== undefined) checkClaim(lease, "outbox.reserve");
      input = checkNewOutbox(entry);
    } catch (error) {
      return Promise.reject(error);
    }
    return this.#inChat(input.chatId, () => this.#reserve(input, lease));
  }

  async #reserve(input: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    for (let race = 0;; race++) {
      const since = Date.now();
      const [existing, now] = await Promise.all([this.read(input.key), this.clock()]);
      // The key is journaled, but its entry cannot be read: whether it was sent is unknown.
      if (existing instanceof Damage) throw this.damagedError(existing);
      if (existing) return { status: "exists", entry: existing.rec };
      const seq = await this.#nextSeq();
      const clear = lease !== undefined && !(await this.#chatBlocked(input.chatId, seq, now));
      const entry = newOutboxEntry(input, seq, now, clear ? lease : undefined);
      const written = await this.write(null, entry, now, since);
      if (written) return { status: clear ? "leased" : "queued", entry: cloneJson(written.rec) };
      if (race >= MAX_RACES) {
        throw new Error(`kv durability: gave up reserving "${input.key}" after ${MAX_RACES} lost compare-and-sets`);
      }
    }
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    checkClaim(options, "outbox.claimDue");
    checkFinite(options.limit, `outbox.claimDue: option "limit"`);
    if (options.repeat === true) return await this.#answers.answer(options, () => ({ due: [], ambiguous: [] }), cloneJson);
    // Each entry is resolved by its own compare-and-set: a scan that fails keeps what it had confirmed.
    const claim: OutboxClaim = { due: [], ambiguous: [] };
    try {
      return await this.#scanDue(options, claim);
    } finally {
      this.#answers.keep(options, claim, cloneJson);
    }
  }

  async #scanDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }, claim: OutboxClaim): Promise<OutboxClaim> {
    const { due, ambiguous } = claim;
    const resend = options.resendAmbiguous === true;
    const now = await this.kv.now();
    const hints = await this.dueHints(now, options.reclaimOwn === true, theState(OUTBOX, "leased"));
    const lost = (rec: OutboxEntry, at: number): boolean =>
      OUTBOX[rec.state].due === "leaseExpiry" && isLeaseAbandoned(rec.lease, at, options);

    // (1) Abandoned `sending` entries, each resolved exactly once (the CAS decides): one whose call
    // was never announced is leased again as due work; an announced one becomes `unknown`, or with
    // `resendAmbiguous` is leased again and reported. Leasing counts against `limit`: over it, the
    // entry is left `sending` for a later scan.
    const resolved = (rec: OutboxEntry, at: number): OutboxEntry | null => {
      if (!lost(rec, at)) return null;
      if (rec.called && !resend) return ambiguousOutbox(rec, at);
      return due.length < options.limit ? claimedOutbox(rec, at, options) : null;
    };
    for (const hint of hints) {
      if (traitsOf(OUTBOX, hint.state)?.due !== "leaseExpiry") continue;
      if (resend && due.length >= options.limit) break; // every lost entry would be leased: none fits
      const cur = await this.check(hint.entry, hint.id, now);
      if (!cur || resolved(cur.rec, now) === null) continue;
      const { seen, written } = await this.mutate(hint.id, resolved, { cur, now }).catch(async (error) => {
        // The write's reply was lost: read it back, so that the scan's answer holds it if it committed.
        const back = await this.get(hint.id).catch(() => null);
        if (back !== null && leasedBy(back, options, claimToken(cur.rec.fence))) {
          if (cur.rec.called) ambiguous.push(back);
          due.push(cloneJson(back));
        } else if (back !== null && back.state === AMBIGUOUS_OUTBOX_STATE && back.fence === cur.rec.fence && cur.rec.state !== back.state) {
          ambiguous.push(back); // made unknown by this scan (or one racing it: reported twice rather than never)
        }
        throw error;
      });
      if (!written) continue;
      if (!seen!.called) {
        due.push(written.rec);
        continue;
      }
      ambiguous.push(written.rec);
      if (resend) due.push(cloneJson(written.rec));
    }

    // (2) Due `queued`/`failed` entries that are first in their chat, by seq.
    const seen = new Set<string>(); // chats whose first due entry was looked at
    for (const hint of hints) {
      if (due.length >= options.limit) break;
      if (traitsOf(OUTBOX, hint.state)?.due !== "nextAttemptAt") continue;
      if (hint.chatId !== null && seen.has(hint.chatId)) continue;
      const cur = await this.check(hint.entry, hint.id, now);
      if (!cur) continue;
      const entry = cur.rec;
      if (OUTBOX[entry.state].due !== "nextAttemptAt" || (entry.nextAttemptAt ?? 0) > now) continue;
      seen.add(entry.chatId);
      if (await this.#chatBlocked(entry.chatId, entry.seq, now)) continue;
      const { written } = await this.mutate(
        hint.id,
        (rec, at) =>
          OUTBOX[rec.state].due === "nextAttemptAt" && (rec.nextAttemptAt ?? 0) <= at
            ? claimedOutbox(rec, at, options)
            : null,
        { cur, now },
      ).catch(async (error) => {
        // The write's reply was lost: read it back, so that the scan's answer holds it if it committed.
        const back = await this.get(hint.id).catch(() => null);
        if (back !== null && leasedBy(back, options, claimToken(cur.rec.fence))) due.push(back);
        throw error;
      });
      if (written) due.push(written.rec);
    }
    return claim;
  }

  async heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(key, `outbox.heartbeat: "key"`);
    checkFinite(token, `outbox.heartbeat: "token"`);
    checkFinite(leaseMs, `outbox.heartbeat: "leaseMs"`);
    const { written } = await this.mutate(key, (rec, now) =>
      isLeasedWith(rec, token) ? extendedLease(rec, now, leaseMs) : null);
    return written !== null;
  }

  async markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(key, `outbox.markCalling: "key"`);
    checkFinite(token, `outbox.markCalling: "token"`);
    checkFinite(leaseMs, `outbox.markCalling: "leaseMs"`);
    const { written } = await this.mutate(key, (rec, now) =>
      isLeasedWith(rec, token) ? callingOutbox(rec, now, leaseMs) : null);
    return written !== null;
  }

  async markSent(key: string, token: number, messageId: string): Promise<void> {
    checkId(key, `outbox.markSent: "key"`);
    checkFinite(token, `outbox.markSent: "token"`);
    checkString(messageId, `outbox.markSent: "messageId"`);
    const { written } = await this.mutate(key, (rec, now) =>
      acceptsOutcome(rec, token) ? sentOutbox(rec, messageId, now) : null);
    if (!written) throw new StaleLeaseError("outbox", key, token);
  }

  async markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    checkId(key, `outbox.markFailed: "key"`);
    checkFinite(token, `outbox.markFailed: "token"`);
    checkOutcome(outcome, "outbox.markFailed", true);
    // An ambiguous outcome: `unknown` (see failedOutbox); its chat index key goes with the write (hintsFor).
    const { written } = await this.mutate(key, (rec, now) =>
      acceptsOutcome(rec, token) ? failedOutbox(rec, outcome, now) : null);
    if (!written) throw new StaleLeaseError("outbox", key, token);
  }

  async get(key: string): Promise<OutboxEntry | null> {
    checkId(key, `outbox.get: "key"`);
    const read = await this.read(key);
    if (read instanceof Damage) throw this.damagedError(read);
    return read?.rec ?? null;
  }

  list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    return this.listRecords(
      normalizeList(options),
      (a, b) => a.seq - b.seq || compareStrings(a.key, b.key),
      (state) => traitsOf(OUTBOX, state)?.purgeable !== true,
    );
  }

  async retry(key: string): Promise<boolean> {
    checkId(key, `outbox.retry: "key"`);
    const { written } = await this.mutate(key, (rec, now) =>
      requeuedOutbox(rec, now));
    return written !== null;
  }

  async discard(key: string): Promise<boolean> {
    checkId(key, `outbox.discard: "key"`);
    for (let race = 0;; race++) {
      const cur = await this.load(key);
      if (!cur || !OUTBOX[cur.rec.state].discardable) return false;
      if (await this.remove(cur)) return true;
      if (race >= MAX_RACES) {
        throw new Error(`kv durability: gave up discarding "${key}" after ${MAX_RACES} lost compare-and-sets`);
      }
    }
  }

  purge(olderThanMs: number): Promise<number> {
    return this.purgeState(theState(OUTBOX, "purgeable"), olderThanMs);
  }
}

/**
 * A durability backend over any {@link DurableKv}: the full inbox and outbox
 * contract built on compare-and-set alone, safe for several engines sharing
 * one kv. Due scans, purges and lists by state go through index keys kept in
 * the kv (see the module documentation), so they cost O(due), not O(all). A
 * stored value that is not a record is set aside, kept as it is, and listed
 * by each journal's `damaged()` (see the module documentation).
 *
 * @param kv the store. Its versions must never repeat for a key, also after a delete.
 * @param options.prefix prepended to every key (default `""`).
 *
 * @example Usage
 * ```ts
 * import { KvDurability } from "@botmesh/durable/kv";
 * import { MemoryKv } from "@botmesh/durable/memory";
 *
 * const backend = new KvDurability(new MemoryKv(), { prefix: "bot-a:" });
 * const reserved = await backend.outbox.reserve(
 *   { key: "invoice:42", chatId: "c1", content: { text: "hi" }, contentHash: "h", inboundId: null },
 *   { owner: "host/bot/1", incarnation: "x", leaseMs: 60_000 },
 * );
 * // reserved.status === "leased": call the provider, then markSent.
 * ```
 */
export class KvDurability implements DurabilityBackend {
  /** `kv:<kv.name>`. */
  readonly name: string;
  /** The kv's scope. */
  readonly scope: BackendScope;
  /** The inbox journal. */
  readonly inbox: InboxJournal;
  /** The outbox journal. */
  readonly outbox: OutboxJournal;

  constructor(kv: DurableKv, options?: KvDurabilityOptions) {
    if (typeof options === "object" && options !== null) checkKnownOptions(options, ["prefix"], "KvDurability option");
    const prefix = options?.prefix ?? "";
    if (typeof prefix !== "string") {
      throw new TypeError(`KvDurability option "prefix" must be a string, got ${typeof prefix}`);
    }
    this.name = `kv:${kv.name}`;
    this.scope = kv.scope;
    this.inbox = new KvInbox(kv, prefix, this.name);
    this.outbox = new KvOutbox(kv, prefix, this.name);
  }
}
