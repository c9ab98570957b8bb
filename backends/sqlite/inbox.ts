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
    return c.write((now) => {
      // Due records in arrival order (lapsed leases too, this incarnation's own included): those due at
      // a time (retries, lapsed leases) and the previous incarnations' are all read and sorted; pending
      // ones (due at 0: a backlog may be large) are read in order from the index a page at a time, as
      // the merge reaches them (records of held chats are skipped, so a page may not be enough).
      const timed = c.stmt(`SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due WHERE due_at > 0 AND due_at <= ?`)
        .all(now);
      if (options.reclaimOwn) {
        timed.push(
          ...c.stmt(
            `SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due
            WHERE due_at IS NOT NULL AND lease_owner = ? AND ${IN_LEASED_SQL} AND lease_incarnation <> ? AND set_aside_seq IS NULL`,
          ).all(options.owner, options.incarnation),
        );
      }
      timed.sort(arrival);
      const size = Math.ceil(options.limit);
      let page = c.stmt(`SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due
        WHERE due_at = 0 ORDER BY received_at, ord LIMIT ?`).all(size);
      const nextPage = (last: Row) =>
        c.stmt(`SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_due
          WHERE due_at = 0 AND (received_at, ord) > (?, ?) ORDER BY received_at, ord LIMIT ?`)
          .all(last.received_at, last.ord, size);
      // Per chat looked at: its first record processing under a lease held elsewhere (null: none). A
      // damaged one holds nothing back: it is set aside here.
      const holds = new Map<SqliteValue, Row | null>();
      const heldBack = (row: Row): boolean => {
        const chat = row.chat_id;
        let hold = holds.get(chat);
        if (hold === undefined) {
          const leased = c.stmt(
            `SELECT ${INBOX_COLUMNS} FROM ${t} INDEXED BY ${t}_chat_leased
            WHERE chat_id = ? AND ${IN_LEASED_SQL} AND set_aside_seq IS NULL ORDER BY received_at, ord`,
          ).all(chat);
          hold = leased.find((r) => {
            const cur = this.#damaged.current(c, r, now);
            return cur !== null && holdsChat(cur, now, options);
          }) ?? null;
          holds.set(chat, hold);
        }
        return hold !== null && arrival(hold, row) < 0;
      };
      const seen = new Set<number>();
      const out: InboundRecord[] = [];
      let i = 0, j = 0;
      while (out.length < options.limit) {
        if (j === page.length && j === size) [page, j] = [nextPage(page[j - 1]!), 0];
        const a = timed[i], b = page[j];
        if (a === undefined && b === undefined) break;
        const row = b === undefined || (a !== undefined && arrival(a, b) < 0) ? timed[i++]! : page[j++]!;
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
