/**
 * The outbox journal in SQLite (see `mod.ts` for what it guarantees).
 *
 * @module
 */
import { copyClaim, isEmptyClaim, ScanAnswers } from "../../src/scan_answers.ts";
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  type DamagedRecords,
  type FailOutcome,
  type ListOptions,
  type NewOutboxEntry,
  type OutboxClaim,
  type OutboxEntry,
  type OutboxJournal,
  type OutboxState,
  type ReserveResult,
  StaleLeaseError,
} from "../../src/contract.ts";
import {
  acceptsOutcome,
  ambiguousOutbox,
  checkClaim,
  checkFinite,
  checkId,
  checkListFilter,
  checkNewOutbox,
  checkOutcome,
  checkString,
  claimedOutbox,
  extendedLease,
  failedOutbox,
  isLeaseAbandoned,
  isLeasedWith,
  newOutboxEntry,
  requeuedOutbox,
  sentOutbox,
} from "../../src/rules.ts";
import { Damage } from "../../src/stored_records.ts";
import type { Connection, Gate } from "./connection.ts";
import { DamagedRows } from "./damaged_rows.ts";
import { listRows, PURGE_BATCH, purgeInBatches } from "./journal_queries.ts";
import { leaseParams, num, numOrNull, OUTBOX_COLUMNS, outboxOf, uncalledFence } from "./rows.ts";
import { OUTBOX, sqlIn, statesDueBy } from "../../src/machine.ts";
import { BLOCKING_SQL, OUT_DISCARDABLE_SQL, OUT_LEASED_SQL, OUT_PURGEABLE_SQL, OUT_UNLEASED_SQL } from "./schema.ts";

// Every value bound to a statement is checked first, so that a caller gets a
// TypeError naming the argument (the same on every driver: bun:sqlite binds
// `undefined` as NULL, node:sqlite and better-sqlite3 throw an unnamed error).

/** What a write answers when the row it met is damaged (it leaves setting it aside to another operation). */
const DAMAGED: unique symbol = Symbol("damaged");

/** The outbox journal of a {@link SQLiteDurability}. */
export class SqliteOutbox implements OutboxJournal, DamagedRecords {
  readonly #gate: Gate;
  /** The SQL of the hot statements, built once (a statement is looked up by its text on every call). */
  readonly #sql: Readonly<Record<"select" | "update" | "hasUnsettled" | "head" | "insert" | "markCalling" | "setDue", string>>;
  readonly #t: string;
  readonly #damaged: DamagedRows<OutboxEntry>;

  readonly #answers = new ScanAnswers<OutboxClaim>(() => ({ due: [], ambiguous: [] }), isEmptyClaim);

  constructor(gate: Gate) {
    this.#gate = gate;
    this.#t = `${gate.prefix}outbox`;
    this.#sql = {
      select: `SELECT ${OUTBOX_COLUMNS} FROM ${this.#t} WHERE key = ?`,
      update: `UPDATE ${this.#t} SET state = ?, attempts = ?, next_attempt_at = ?,
        lease_owner = ?, lease_incarnation = ?, lease_token = ?, lease_expires_at = ?,
        fence = ?, uncalled_fence = ?, message_id = ?, error = ?, updated_at = ?, due_at = ?
      WHERE key = ? AND state = ? AND fence = ? AND lease_token IS ?`,
      hasUnsettled: `SELECT 1 AS x FROM ${this.#t} INDEXED BY ${this.#t}_chat
      WHERE chat_id = ? AND state IN (${BLOCKING_SQL}) AND set_aside_seq IS NULL LIMIT 1`,
      head: `SELECT seq, state, next_attempt_at, due_at FROM ${this.#t} INDEXED BY ${this.#t}_chat
      WHERE chat_id = ? AND state IN (${BLOCKING_SQL}) AND set_aside_seq IS NULL ORDER BY seq LIMIT 1`,
      insert: `INSERT INTO ${this.#t} (key, chat_id, content, content_hash, inbound_id, state, attempts, next_attempt_at,
          lease_owner, lease_incarnation, lease_token, lease_expires_at, fence, uncalled_fence, message_id, error, created_at,
          updated_at, due_at)
        VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (key) DO NOTHING RETURNING seq`,
      markCalling: `UPDATE ${this.#t} SET uncalled_fence = NULL, lease_expires_at = ?, due_at = ?
        WHERE key = ? AND ${OUT_LEASED_SQL} AND lease_token = ? AND set_aside_seq IS NULL`,
      setDue: `UPDATE ${this.#t} SET due_at = ? WHERE seq = ?`,
    };
    // An entry set aside no longer blocks its chat: the next one becomes the chat's head.
    this.#damaged = new DamagedRows(gate, "outbox", OUTBOX_COLUMNS, outboxOf, (c, row) => {
      if (typeof row.chat_id === "string") this.#syncHead(c, row.chat_id);
    });
  }

  /** In a write: the entry of `key`, or `null` when there is none or it is damaged (set aside, now if not yet). */
  #select(c: Connection, key: string, now: number): OutboxEntry | null {
    const row = c.stmt(this.#sql.select).get(key);
    return row ? this.#damaged.current(c, row, now) : null;
  }

  /** Whether the chat has an unsettled (`queued`, `sending`, `failed`) entry (set-aside ones left out). */
  #hasUnsettled(c: Connection, chatId: string): boolean {
    return c.stmt(this.#sql.hasUnsettled).get(chatId) !== undefined;
  }

  /** Whether the chat has an unsettled (`queued`, `sending`, `failed`) entry before `seq`. */
  #blocked(c: Connection, chatId: string, seq: number): boolean {
    return c.stmt(
      `SELECT 1 AS x FROM ${this.#t} INDEXED BY ${this.#t}_chat
      WHERE chat_id = ? AND state IN (${BLOCKING_SQL}) AND seq < ? AND set_aside_seq IS NULL LIMIT 1`,
    ).get(chatId, seq) !== undefined;
  }

  /**
   * Writes `next` over `prev`, guarded in SQL by the state, fencing token and
   * lease token read in this transaction. `due_at` is the lease expiry of a
   * `sending` entry, else left to {@link #syncHead} (only a chat's first
   * unsettled entry has one).
   */
  #update(c: Connection, prev: OutboxEntry, next: OutboxEntry): boolean {
    const { changes } = c.stmt(
      this.#sql.update,
    ).run(
      next.state,
      next.attempts,
      next.nextAttemptAt,
      ...leaseParams(next.lease),
      next.fence,
      uncalledFence(next),
      next.messageId,
      next.error,
      next.updatedAt,
      OUTBOX[next.state].leased ? (next.lease?.expiresAt ?? 0) : null,
      prev.key,
      prev.state,
      prev.fence,
      prev.lease?.token ?? null,
    );
    if (changes !== 1) return false;
    if (!OUTBOX[next.state].leased) this.#syncHead(c, next.chatId);
    return true;
  }

  /** Gives the chat's first unsettled entry, when `queued`/`failed`, the `due_at` a due scan finds it by. */
  #syncHead(c: Connection, chatId: string): void {
    // Usually the chat has no unsettled entry left: an unordered probe (cheaper than the ordered read) says so.
    if (!this.#hasUnsettled(c, chatId)) return;
    const head = c.stmt(
      this.#sql.head,
    ).get(chatId);
    if (!head || OUTBOX[head.state as OutboxState]?.leased) return;
    const dueAt = numOrNull(head.next_attempt_at) ?? 0;
    if (head.due_at !== dueAt) c.stmt(this.#sql.setDue).run(dueAt, head.seq);
  }

  /**
   * A change (`op`, for errors) that is fenced by `token`: of a `sending`
   * entry leased with it, or with `outcome` (markSent, markFailed) also of an
   * `unknown` entry whose fence is still `token` (see {@link acceptsOutcome}).
   */
  async #fenced(
    op: string,
    key: string,
    token: number,
    change: (entry: OutboxEntry, now: number) => OutboxEntry,
    outcome = false,
  ): Promise<boolean> {
    checkId(key, `outbox.${op}: "key"`);
    checkFinite(token, `outbox.${op}: "token"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, key, now);
      if (!cur || !(outcome ? acceptsOutcome(cur, token) : isLeasedWith(cur, token))) return false;
      const next = change(cur, now);
      if (!OUTBOX[cur.state].blocksChat && OUTBOX[next.state].blocksChat) {
        // It blocks its chat again: later queued/failed entries of its chat are no longer first.
        this.#unmarkBehind(c, cur.chatId, cur.seq);
      }
      return this.#update(c, cur, next);
    });
  }

  /** Drops the due marks of the chat's queued/failed entries after `seq` (an earlier entry blocks them again). */
  #unmarkBehind(c: Connection, chatId: string, seq: number): void {
    c.stmt(
      `UPDATE ${this.#t} INDEXED BY ${this.#t}_chat SET due_at = NULL
      WHERE chat_id = ? AND state IN (${BLOCKING_SQL}) AND seq > ? AND ${OUT_UNLEASED_SQL} AND due_at IS NOT NULL`,
    ).run(chatId, seq);
  }

  async reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    const input = checkNewOutbox(entry); // a TypeError naming the field, before anything is written
    if (lease !== undefined) checkClaim(lease, "outbox.reserve");
    const content = JSON.stringify(input.content);
    const c = await this.#gate.ready();
    for (;;) {
      const result = await this.#reserve(c, input, content, lease);
      if (result !== DAMAGED) return result;
      // The key's entry is damaged: set aside (in an operation of its own, so that the reserve above
      // stays one writing statement) and refused with a DamagedRecordError by get, unless it changed since.
      const existing = await this.#damaged.get(input.key);
      if (existing) return { status: "exists", entry: existing };
    }
  }

  /** The reserve itself: one writing statement (the insert); {@link DAMAGED} when the key's entry is damaged. */
  #reserve(
    c: Connection,
    input: NewOutboxEntry,
    content: string,
    lease: ClaimOptions | undefined,
  ): Promise<ReserveResult | typeof DAMAGED> {
    return c.write((now): ReserveResult | typeof DAMAGED => {
      // The insert comes first (it writes nothing when the key exists): one statement fewer in the usual case.
      const clear = !this.#hasUnsettled(c, input.chatId);
      const draft = newOutboxEntry(input, 0, now, clear ? lease : undefined);
      const dueAt = OUTBOX[draft.state].leased ? draft.lease!.expiresAt : clear ? (draft.nextAttemptAt ?? 0) : null;
      const row = c.stmt(
        this.#sql.insert,
      ).get(
        draft.key,
        draft.chatId,
        content,
        draft.contentHash,
        draft.inboundId,
        draft.state,
        draft.attempts,
        draft.nextAttemptAt,
        ...leaseParams(draft.lease),
        draft.fence,
        uncalledFence(draft),
        draft.messageId,
        draft.error,
        draft.createdAt,
        draft.updatedAt,
        dueAt,
      );
      if (row === undefined) {
        const found = c.stmt(this.#sql.select).get(input.key);
        const existing = found === undefined || found.set_aside_seq !== null ? null : outboxOf(found);
        return existing === null || existing instanceof Damage ? DAMAGED : { status: "exists", entry: existing };
      }
      const entry: OutboxEntry = { ...draft, seq: num(row.seq) }; // its content is the checked copy
      return { status: OUTBOX[entry.state].leased ? "leased" : "queued", entry };
    }, true);
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    checkClaim(options, "outbox.claimDue");
    checkFinite(options.limit, `outbox.claimDue: option "limit"`);
    return await this.#answers.answer(options, () => this.#scanDue(options), copyClaim);
  }

  async #scanDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    const c = await this.#gate.ready();
    return c.write((now) => {
      const due: OutboxEntry[] = [];
      const ambiguous: OutboxEntry[] = [];

      // (1) Abandoned `sending` entries: lapsed leases, and the previous incarnation's under reclaimOwn.
      const rows = c.stmt(
        `SELECT ${OUTBOX_COLUMNS} FROM ${this.#t} INDEXED BY ${this.#t}_due WHERE due_at <= ? AND ${sqlIn("state", statesDueBy(OUTBOX, "leaseExpiry"))}`,
      ).all(now);
      if (options.reclaimOwn) {
        rows.push(
          ...c.stmt(`SELECT ${OUTBOX_COLUMNS} FROM ${this.#t} INDEXED BY ${this.#t}_due
            WHERE due_at IS NOT NULL AND lease_owner = ? AND ${OUT_LEASED_SQL} AND set_aside_seq IS NULL`).all(options.owner),
        );
      }
      const seen = new Set<number>();
      const lost = rows
        .filter((row) => !seen.has(num(row.seq)) && seen.add(num(row.seq)))
        .map((row) => this.#damaged.current(c, row, now))
        .filter((entry): entry is OutboxEntry => entry !== null && isLeaseAbandoned(entry.lease, now, options))
        .sort((a, b) => a.seq - b.seq);
      for (const cur of lost) {
        if (!cur.called) {
          // Its holder never announced a provider call: nothing was sent, it is due work again
          // (claimedOutbox keeps its attempts). It stays its chat's head: `sending`, due at its new expiry.
          if (!(due.length < options.limit)) continue; // left for a later scan
          const next = claimedOutbox(cur, now, options);
          if (this.#update(c, cur, next)) due.push(next);
        } else if (options.resendAmbiguous) {
          if (!(due.length < options.limit)) continue; // left for a later scan
          const next = claimedOutbox(cur, now, options);
          if (!this.#update(c, cur, next)) continue;
          ambiguous.push(next);
          due.push({ ...next, lease: { ...next.lease! } });
        } else {
          const next = ambiguousOutbox(cur, now);
          if (this.#update(c, cur, next)) ambiguous.push(next);
        }
      }

      // (2) Due chat heads (including those just freed by step 1), in seq order. Any state but `sending`
      // (step 1's): a head whose state was damaged is met here, and set aside.
      const page = Math.max(options.limit, 16);
      let after = 0;
      scan: while (due.length < options.limit) {
        const heads = c.stmt(
          `SELECT ${OUTBOX_COLUMNS}, due_at FROM ${this.#t} INDEXED BY ${this.#t}_due
          WHERE due_at <= ? AND ${OUT_UNLEASED_SQL} AND seq > ? ORDER BY seq LIMIT ?`,
        ).all(now, after, page);
        for (const row of heads) {
          if (due.length >= options.limit) break;
          after = num(row.seq);
          const cur = this.#damaged.current(c, row, now);
          // Set aside: the next entry of its chat may be its head now, due: read on from here.
          if (!cur) continue scan;
          if (
            OUTBOX[cur.state]?.due !== "nextAttemptAt" || (cur.nextAttemptAt ?? 0) > now ||
            this.#blocked(c, cur.chatId, cur.seq)
          ) {
            // Not (or no longer) first in its chat: drop the stale due mark.
            c.stmt(`UPDATE ${this.#t} SET due_at = NULL WHERE seq = ?`).run(cur.seq);
            this.#syncHead(c, cur.chatId);
            continue;
          }
          const next = claimedOutbox(cur, now, options);
          if (this.#update(c, cur, next)) due.push(next);
        }
        if (heads.length < page) break;
      }
      return { due, ambiguous };
    });
  }

  async heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `outbox.heartbeat: "leaseMs"`);
    return await this.#fenced("heartbeat", key, token, (entry, now) => extendedLease(entry, now, leaseMs));
  }

  async markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(key, `outbox.markCalling: "key"`);
    checkFinite(token, `outbox.markCalling: "token"`);
    checkFinite(leaseMs, `outbox.markCalling: "leaseMs"`);
    const c = await this.#gate.ready();
    // On the hot path (once per send): one conditional UPDATE, no read, no savepoint. Accepted as
    // heartbeat is (`sending`, leased with `token`); sets `called` and extends the lease (callingOutbox).
    return c.write((now) => {
      const expiresAt = now + leaseMs;
      return c.stmt(
        this.#sql.markCalling,
      ).run(expiresAt, expiresAt, key, token).changes === 1;
    }, true);
  }

  async markSent(key: string, token: number, messageId: string): Promise<void> {
    checkString(messageId, `outbox.markSent: "messageId"`);
    const done = await this.#fenced("markSent", key, token, (entry, now) => sentOutbox(entry, messageId, now), true);
    if (!done) throw new StaleLeaseError("outbox", key, token);
  }

  async markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    checkOutcome(outcome, "outbox.markFailed", true);
    // An ambiguous outcome: `unknown` (see failedOutbox); #update then due-marks the chat's next head,
    // as for claimDue's move of a lost send to `unknown`.
    const done = await this.#fenced(
      "markFailed",
      key,
      token,
      (entry, now) => failedOutbox(entry, outcome, now),
      true,
    );
    if (!done) throw new StaleLeaseError("outbox", key, token);
  }

  get(key: string): Promise<OutboxEntry | null> {
    checkId(key, `outbox.get: "key"`);
    return this.#damaged.get(key);
  }

  async list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    checkListFilter(options, "outbox.list");
    const c = await this.#gate.ready();
    const t = this.#t;
    for (;;) {
      const rows = listRows(c, t, OUTBOX_COLUMNS, "seq", {
        byOrder: null, // the primary key
        byChat: `${t}_chat_all`,
        byState: `${t}_state`,
      }, options);
      // Damaged rows met are set aside, and the list read again without them.
      const entries = await this.#damaged.readAll(c, rows);
      if (entries) return entries;
    }
  }

  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#damaged.list(options);
  }

  reportDamaged(key: string): Promise<boolean> {
    return this.#damaged.report(key);
  }

  async retry(key: string): Promise<boolean> {
    checkId(key, `outbox.retry: "key"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, key, now);
      const next = cur && requeuedOutbox(cur, now);
      if (!next) return false;
      // It is unsettled again: later queued/failed entries of its chat are no longer first.
      this.#unmarkBehind(c, cur.chatId, cur.seq);
      return this.#update(c, cur, next);
    });
  }

  async discard(key: string): Promise<boolean> {
    checkId(key, `outbox.discard: "key"`);
    const c = await this.#gate.ready();
    return c.write((now) => {
      const cur = this.#select(c, key, now);
      if (!cur || OUTBOX[cur.state]?.discardable !== true) return false;
      c.stmt(`DELETE FROM ${this.#t} WHERE key = ? AND ${OUT_DISCARDABLE_SQL}`).run(key);
      this.#syncHead(c, cur.chatId);
      return true;
    });
  }

  purge(olderThanMs: number): Promise<number> {
    return purgeInBatches(
      this.#gate,
      olderThanMs,
      `DELETE FROM ${this.#t} WHERE seq IN (
        SELECT seq FROM ${this.#t} INDEXED BY ${this.#t}_sent
        WHERE ${OUT_PURGEABLE_SQL} AND updated_at <= ? AND set_aside_seq IS NULL LIMIT ${PURGE_BATCH})`,
    );
  }
}
