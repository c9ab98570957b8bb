/**
 * The inbox journal in SQLite (see `mod.ts` for what it guarantees).
 *
 * @module
 */
import { ScanAnswers } from "../../src/scan_answers.ts";
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  type DamagedRecords,
  type FailOutcome,
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type ListOptions,
  type NewInboundRecord,
  StaleLeaseError,
} from "../../src/contract.ts";
import {
  admitsLeased,
  checkClaim,
  checkFinite,
  checkId,
  checkListFilter,
  checkNewInbound,
  checkOutcome,
  checkAttempt,
  claimedInbound,
  scheduledInbound,
  startedInbound,
  doneInbound,
  extendedLease,
  failedFields,
  holdsChat,
  inboxDueAt,
  isInboxClaimable,
  isLeasedWith,
  newInboundRecord,
  replayedInbound,
} from "../../src/rules.ts";
import type { SqliteValue } from "../../src/runtime/sqlite.ts";
import type { Connection, Gate } from "./connection.ts";
import { DamagedRows } from "./damaged_rows.ts";
import { listRows, PURGE_BATCH, purgeInBatches } from "./journal_queries.ts";
import { arrival, INBOX_COLUMNS, inboundOf, leaseParams, num, type Row } from "./rows.ts";
import { INBOX, sqlByDue } from "../../src/machine.ts";
import { ACTIVE_SQL, IN_LEASED_SQL, IN_PURGEABLE_SQL } from "./schema.ts";

// Every value bound to a statement is checked first, so that a caller gets a
// TypeError naming the argument (the same on every driver: bun:sqlite binds
// `undefined` as NULL, node:sqlite and better-sqlite3 throw an unnamed error).

/**
 * The first active record of a chat (`chat_id`, received no later than `received_at`; parameters after
 * them: `after`'s, then now, owner, incarnation, now) that keeps a new record admitted under that lease
 * pending: `admitsLeased` of the journal rules, negated, in columns (see `SqliteInbox.admit`).
 */
function comesFirstSql(t: string, after: string, columns = INBOX_COLUMNS, order = "ORDER BY received_at, ord LIMIT 1"): string {
  return `SELECT ${columns} FROM ${t} INDEXED BY ${t}_chat_active
    WHERE chat_id = ? AND state IN (${ACTIVE_SQL}) AND set_aside_seq IS NULL AND received_at <= ?${after}
      AND ${sqlByDue(INBOX, "state", {
    always: "",
    nextAttemptAt: "COALESCE(next_attempt_at, 0) <= ?",
    leaseExpiry: "NOT COALESCE(lease_owner = ? AND lease_incarnation = ? AND lease_expires_at > ?, 0)",
  })}
    ${order}`;
}

/** Rows in arrival order, read a page at a time (`next`: the page after a row; null: all read at once). */
interface Stream {
  rows: Row[];
  at: number;
  next: ((last: Row) => Row[]) | null;
}

/** The next row of `s` (its next page read once its page of `size` is used up), or undefined at its end. */
function head(s: Stream, size: number): Row | undefined {
  if (s.at === s.rows.length && s.next !== null && s.rows.length === size) [s.rows, s.at] = [s.next(s.rows[s.at - 1]!), 0];
  return s.rows[s.at];
}

/** The inbox journal of a {@link SQLiteDurability}. */
export class SqliteInbox implements InboxJournal, DamagedRecords {
  readonly #gate: Gate;
  /** The SQL of the hot statements, built once (a statement is looked up by its text on every call). */
  readonly #sql: Readonly<Record<"select" | "update" | "insert", string>>;
  readonly #t: string;
  readonly #damaged: DamagedRows<InboundRecord>;
  /** The statements of `#comesFirst`: whether any row matches, the first from the chat's start, the next after a row. */
  readonly #comesFirstSql: readonly [string, string, string];

  readonly #answers = new ScanAnswers<InboundRecord[]>(() => [], (a) => a.length === 0);

  constructor(gate: Gate) {
    this.#gate = gate;
    this.#t = `${gate.prefix}inbox`;
    this.#sql = {
      select: `SELECT ${INBOX_COLUMNS} FROM ${this.#t} WHERE id = ?`,
      update: `UPDATE ${this.#t} SET state = ?, attempts = ?, next_attempt_at = ?,
        lease_owner = ?, lease_incarnation = ?, lease_token = ?, lease_expires_at = ?,
        fence = ?, error = ?, updated_at = ?, due_at = ?
      WHERE id = ? AND state = ? AND fence = ? AND lease_token IS ?`,
      insert: `INSERT INTO ${this.#t} (id, kind, chat_id, provider, payload, received_at, state, attempts,
          next_attempt_at, lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, error, updated_at, due_at)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING`,
    };
    this.#damaged = new DamagedRows(gate, "inbox", INBOX_COLUMNS, inboundOf);
    this.#comesFirstSql = [
      comesFirstSql(this.#t, "", "1 AS x", "LIMIT 1"),
      comesFirstSql(this.#t, ""),
      comesFirstSql(this.#t, " AND (received_at, ord) > (?, ?)"),
    ];
  }

  /** In a write: the record of `id`, or `null` when there is none or it is damaged (set aside, now if not yet). */
  #select(c: Connection, id: string, now: number): InboundRecord | null {
    const row = c.stmt(this.#sql.select).get(id);
    return row ? this.#damaged.current(c, row, now) : null;
  }

  /**
   * Writes the changed fields of `next` over `prev`, guarded in SQL by the
   * state, fencing token and lease token read in this transaction.
   */
  #update(c: Connection, prev: InboundRecord, next: InboundRecord): boolean {
    const { changes } = c.stmt(
      this.#sql.update,
    ).run(
      next.state,
      next.attempts,
      next.nextAttemptAt,
      ...leaseParams(next.lease),
      next.fence,
      next.error,
      next.updatedAt,
      inboxDueAt(next),
      prev.id,
      prev.state,
      prev.fence,
      prev.lease?.token ?? null,
    );
    return changes === 1;
  }

  /** A fenced change (`op`, for errors): applies `change` when the record is leased with `token`. */
  async #fenced(
    op: string,
    id: string,
    token: number,
    change: (record: InboundRecord, now: number) => InboundRecord,
  ): Promise<boolean> {
    checkId(id, `inbox.${op}: "id"`);
    checkFinite(token, `inbox.${op}: "token"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, id, now);
      if (!cur || !isLeasedWith(cur, token)) return false;
      return this.#update(c, cur, change(cur, now));
    }, true);
  }

  /**
   * In the admit's write: whether an active record of the chat of `input` comes before it (received
   * no later; admitted earlier, as every existing row is) and does not let it be admitted leased under
   * `lease` (see `admitsLeased`). One range read of the partial index of the chat's active records
   * (received no later), in arrival order, stopping at the first row that keeps the new record pending
   * (the same rule, in columns): it passes over the caller's own live leases and retries not yet due,
   * and in the usual case finds nothing. Only a row found is read whole and checked by the rule (a
   * damaged one is set aside here, and the read goes on after it).
   */
  #comesFirst(c: Connection, input: NewInboundRecord, now: number, lease: ClaimOptions): boolean {
    const [any, first, next] = this.#comesFirstSql;
    const rule = [now, lease.owner, lease.incarnation, now];
    // The usual answer is none: an unordered probe says so at a fraction of the cost of the ordered read
    // (an ORDER BY costs several µs per call on bun:sqlite even when the index yields the order).
    if (c.stmt(any).get(input.chatId, input.receivedAt, ...rule) === undefined) return false;
    let row = c.stmt(first).get(input.chatId, input.receivedAt, ...rule);
    while (row !== undefined) {
      const cur = this.#damaged.current(c, row, now);
      if (cur !== null && !admitsLeased(cur, now, lease)) return true;
      // Set aside as damaged just now (or, were SQL and the rule ever to disagree, the rule's word): the next one.
      row = c.stmt(next).get(input.chatId, input.receivedAt, row.received_at, row.ord, ...rule);
    }
    return false;
  }

  async admit(record: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null> {
    const input = checkNewInbound(record); // a TypeError naming the field, before anything is written
    if (lease !== undefined) checkClaim(lease, "inbox.admit");
    const payload = JSON.stringify(input.payload);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const held = lease !== undefined && this.#comesFirst(c, input, now, lease);
      const next = newInboundRecord(input, now, held ? undefined : lease);
      const { changes } = c.stmt(
        this.#sql.insert,
      ).run(
        next.id,
        next.kind,
        next.chatId,
        next.provider,
        payload,
        next.receivedAt,
        next.state,
        next.attempts,
        next.nextAttemptAt,
        ...leaseParams(next.lease),
        next.fence,
        next.error,
        next.updatedAt,
        inboxDueAt(next),
      );
      return changes === 1 ? next : null; // its payload is the checked copy, not the caller's object
    }, true);
  }

  async claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    checkId(id, `inbox.claim: "id"`);
    checkClaim(options, "inbox.claim");
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, id, now);
      if (!cur || !isInboxClaimable(cur, now, options)) return null;
      const next = claimedInbound(cur, now, options);
      return this.#update(c, cur, next) ? next : null;
    }, true);
  }

  async claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    checkClaim(options, "inbox.claimDue");
    checkFinite(options.limit, `inbox.claimDue: option "limit"`);
    return await this.#answers.answer(options, () => this.#scanDue(options), (a) => structuredClone(a));
  }

  async #scanDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    const c = await this.#gate.ready();
    if (!(options.limit > 0)) return [];
    const t = this.#t;
    const size = Math.ceil(options.limit);
    return c.write((now) => {
      // Due records in arrival order, merged from streams that each yield theirs in that order: those due
      // at a time (retries, lapsed leases, this incarnation's own included: all read and sorted), the
      // pending ones (due at 0: a backlog may be large) and, under reclaimOwn, the records leased by each
      // of the owner's other incarnations (by the lease index). The last two are read a page at a time as
      // the merge reaches them (records of held chats are skipped, so a page may not be enough). None of
      // them reads the leases the caller holds: a restart's backlog is reclaimed in linear work.
      const timed = c.stmt(`SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due WHERE due_at > 0 AND due_at <= ?`)
        .all(now).sort(arrival);
      const streams: Stream[] = [
        { rows: timed, at: 0, next: null },
        this.#paged(size, (after) =>
          c.stmt(`SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due
          WHERE due_at = 0${after ? " AND (received_at, ord) > (?, ?)" : ""} ORDER BY received_at, ord LIMIT ?`)
            .all(...(after ? [after.received_at, after.ord] : []), size)),
      ];
      if (options.reclaimOwn) {
        for (const inc of this.#incarnations(c, options.owner)) {
          if (inc === options.incarnation) continue;
          streams.push(this.#paged(size, (after) =>
            c.stmt(`SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_lease
              WHERE lease_owner = ? AND lease_incarnation = ? AND ${IN_LEASED_SQL} AND set_aside_seq IS NULL${
              after ? " AND (received_at, ord) > (?, ?)" : ""
            } ORDER BY received_at, ord LIMIT ?`).all(options.owner, inc, ...(after ? [after.received_at, after.ord] : []), size)
          ));
        }
      }
      // Per chat looked at: its first record processing under a lease held elsewhere (null: none). A
      // damaged one holds nothing back: it is set aside here.
      const holds = new Map<SqliteValue, Row | null>();
      const heldBack = (row: Row): boolean => {
        const chat = row.chat_id;
        let hold = holds.get(chat);
        if (hold === undefined) {
          hold = this.#holder(c, chat, now, options);
          holds.set(chat, hold);
        }
        return hold !== null && arrival(hold, row) < 0;
      };
      const seen = new Set<number>();
      const out: InboundRecord[] = [];
      while (out.length < options.limit) {
        let from: Stream | undefined, row: Row | undefined;
        for (const s of streams) {
          const r = head(s, size);
          if (r !== undefined && (row === undefined || arrival(r, row) < 0)) [from, row] = [s, r];
        }
        if (from === undefined || row === undefined) break;
        from.at++;
        if (seen.has(num(row.ord))) continue;
        seen.add(num(row.ord));
        if (heldBack(row)) continue;
        const cur = this.#damaged.current(c, row, now);
        if (!cur || !isInboxClaimable(cur, now, options)) continue;
        const next = claimedInbound(cur, now, options);
        if (this.#update(c, cur, next)) out.push(next);
        else holds.set(row.chat_id, row); // not taken after all: the rest of its chat must not overtake it
      }
      return out;
    });
  }

  /** A stream read `size` rows at a time by `page` (after the last row read, or from the start). */
  #paged(size: number, page: (after: Row | null) => Row[]): Stream {
    return { rows: page(null), at: 0, next: (last) => page(last) };
  }

  /** The incarnations of `owner` that hold leases, by the lease index (one step per incarnation). */
  #incarnations(c: Connection, owner: string): string[] {
    const t = this.#t;
    const out: string[] = [];
    let row = c.stmt(`SELECT lease_incarnation FROM ${t} INDEXED BY ${t}_lease
      WHERE lease_owner = ? AND ${IN_LEASED_SQL} AND lease_incarnation IS NOT NULL ORDER BY lease_incarnation LIMIT 1`).get(owner);
    while (row !== undefined) {
      const inc = row.lease_incarnation as string;
      out.push(inc);
      row = c.stmt(`SELECT lease_incarnation FROM ${t} INDEXED BY ${t}_lease
        WHERE lease_owner = ? AND ${IN_LEASED_SQL} AND lease_incarnation > ? ORDER BY lease_incarnation LIMIT 1`).get(owner, inc);
    }
    return out;
  }

  /**
   * In a due scan: the first record of `chat` processing under a lease held elsewhere (holdsChat of the
   * rules), or null. The chat's lease index is read by holder (owner and incarnation), one step per
   * holder: the leases of the caller (under reclaimOwn, of its owner: none of them holds the chat) are
   * passed over without being read, and of every other holder only its first live lease is read (and
   * the next ones while those are damaged: a damaged one holds nothing back, it is set aside).
   */
  #holder(c: Connection, chat: SqliteValue, now: number, options: ClaimDueOptions): Row | null {
    const t = this.#t;
    const groupSql = (after: "" | "owner" | "holder") =>
      `SELECT lease_owner, lease_incarnation FROM ${t} INDEXED BY ${t}_chat_lease
      WHERE chat_id = ? AND ${IN_LEASED_SQL} AND lease_owner IS NOT NULL AND lease_incarnation IS NOT NULL${
        after === "owner" ? " AND lease_owner > ?" : after === "holder" ? " AND (lease_owner, lease_incarnation) > (?, ?)" : ""
      }
      ORDER BY lease_owner, lease_incarnation LIMIT 1`;
    const firstSql = (after: boolean) =>
      `SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_chat_lease
      WHERE chat_id = ? AND lease_owner = ? AND lease_incarnation = ? AND ${IN_LEASED_SQL} AND set_aside_seq IS NULL
        AND lease_expires_at > ?${after ? " AND (received_at, ord) > (?, ?)" : ""}
      ORDER BY received_at, ord LIMIT 1`;
    let first: Row | null = null;
    let group = c.stmt(groupSql("")).get(chat);
    while (group !== undefined) {
      const owner = group.lease_owner, inc = group.lease_incarnation;
      const ownerSkipped = options.reclaimOwn === true && owner === options.owner;
      if (!ownerSkipped && !(owner === options.owner && inc === options.incarnation)) {
        let row = c.stmt(firstSql(false)).get(chat, owner, inc, now);
        while (row !== undefined && (first === null || arrival(row, first) < 0)) {
          const cur = this.#damaged.current(c, row, now);
          if (cur !== null && holdsChat(cur, now, options)) {
            first = row;
            break;
          }
          row = c.stmt(firstSql(true)).get(chat, owner, inc, now, row.received_at, row.ord);
        }
      }
      group = ownerSkipped ? c.stmt(groupSql("owner")).get(chat, owner) : c.stmt(groupSql("holder")).get(chat, owner, inc);
    }
    return first;
  }

  async start(id: string, token: number, attempt: number): Promise<boolean> {
    checkAttempt(attempt, "inbox.start");
    return await this.#fenced("start", id, token, (rec, now) => startedInbound(rec, attempt, now));
  }

  async heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `inbox.heartbeat: "leaseMs"`);
    return await this.#fenced("heartbeat", id, token, (rec, now) => extendedLease(rec, now, leaseMs));
  }

  async schedule(id: string, token: number, dueInMs: number): Promise<void> {
    checkFinite(dueInMs, `inbox.schedule: "dueInMs"`);
    const done = await this.#fenced("schedule", id, token, (rec, now) => scheduledInbound(rec, dueInMs, now));
    if (!done) throw new StaleLeaseError("inbox", id, token);
  }

  async complete(id: string, token: number): Promise<void> {
    if (!(await this.#fenced("complete", id, token, doneInbound))) throw new StaleLeaseError("inbox", id, token);
  }

  async fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    checkOutcome(outcome, "inbox.fail");
    const done = await this.#fenced("fail", id, token, (rec, now) => ({ ...rec, ...failedFields(outcome, now) }));
    if (!done) throw new StaleLeaseError("inbox", id, token);
  }

  get(id: string): Promise<InboundRecord | null> {
    checkId(id, `inbox.get: "id"`);
    return this.#damaged.get(id);
  }

  async list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    checkListFilter(options, "inbox.list");
    const c = await this.#gate.ready();
    const t = this.#t;
    for (;;) {
      const rows = listRows(c, t, INBOX_COLUMNS, "received_at, ord", {
        byOrder: `${t}_received`,
        byChat: `${t}_chat`,
        byState: `${t}_state`,
      }, options);
      // Damaged rows met are set aside, and the list read again without them.
      const records = await this.#damaged.readAll(c, rows);
      if (records) return records;
    }
  }

  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#damaged.list(options);
  }

  reportDamaged(id: string): Promise<boolean> {
    return this.#damaged.report(id);
  }

  async replay(id: string): Promise<boolean> {
    checkId(id, `inbox.replay: "id"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, id, now);
      const next = cur && replayedInbound(cur, now);
      return next ? this.#update(c, cur, next) : false;
    });
  }

  purge(olderThanMs: number): Promise<number> {
    return purgeInBatches(
      this.#gate,
      olderThanMs,
      `DELETE FROM ${this.#t} WHERE ord IN (
        SELECT ord FROM ${this.#t} INDEXED BY ${this.#t}_done
        WHERE ${IN_PURGEABLE_SQL} AND updated_at <= ? AND set_aside_seq IS NULL LIMIT ${PURGE_BATCH})`,
    );
  }
}
