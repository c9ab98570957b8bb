/**
 * The outbox journal in Postgres (the `outbox` of `PostgresDurability`).
 *
 * @module
 */
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  DamagedRecordError,
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
import { OUTBOX } from "../../src/machine.ts";
import { checkFinite, checkOutcome } from "../../src/rules.ts";
import { checkScanRequest, isEmptyClaim } from "../../src/scan_answers.ts";
import { Aside, DAMAGED_ROUNDS, type JournalRun, leasedBy, listed } from "./aside.ts";
import type { Context, ManyRows, Row } from "./connection.ts";
import {
  duration,
  inBatches,
  listParams,
  MAX_DURATION_MS,
  outboxOf,
  pgClaim,
  pgId,
  pgListFilter,
  pgOutbound,
  pgString,
  textForPg,
  tokenOk,
  written,
} from "./rows.ts";
import { PgScanAnswers } from "./scan_answers.ts";
import { type AsideSql, outboxSql, type OutboxSql } from "./sql.ts";

/** Chat rows are dropped by `purge` only when untouched for at least this long. */
const CHAT_ROW_MIN_AGE_MS = 3_600_000;

export class PgOutbox implements OutboxJournal {
  readonly #c: Context;
  readonly #q: OutboxSql & AsideSql;
  readonly #t: string;
  readonly #aside: Aside<OutboxEntry>;
  readonly #answers: PgScanAnswers;

  constructor(c: Context) {
    this.#c = c;
    this.#q = outboxSql(c.t);
    this.#t = c.t.outbox;
    this.#aside = new Aside(c, "outbox", this.#t, this.#q, (row) => outboxOf(row));
    this.#answers = new PgScanAnswers(c, "outbox", this.#t);
  }

  #run(op: string, text: string, params: unknown[]): Promise<Row[] & { count?: number }> {
    return this.#c.run(`outbox.${op}`, this.#t, text, params);
  }

  /** A write that joins the group commit (see `Context.write`). */
  #write(op: string, text: string, params: unknown[], many?: ManyRows, chat?: string): Promise<Row[] & { count?: number }> {
    return this.#c.write(`outbox.${op}`, this.#t, text, params, many, chat);
  }

  async reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    const input = pgOutbound(entry); // a TypeError naming the field, before anything is written
    if (lease !== undefined) pgClaim(lease, "outbox.reserve");
    const params = [
      input.key,
      input.chatId,
      JSON.stringify(input.content),
      input.contentHash,
      input.inboundId,
      lease !== undefined,
      lease?.owner ?? null,
      lease?.incarnation ?? null,
      duration(lease?.leaseMs ?? 0),
    ] as const;
    const [key, chat_id, content, content_hash, inbound_id, leased, owner, inc, lease_ms] = params;
    const rows = await this.#write("reserve", this.#q.reserve, [...params], {
      kind: "outbox.reserve",
      text: this.#q.reserveMany,
      key,
      row: { key, chat_id, content, content_hash, inbound_id, leased, owner, inc, lease_ms },
      partition: chat_id,
    }, chat_id);
    const row = rows[0];
    if (row && row.status === "new") {
      const created = written(outboxOf(row, input.content), this.#t);
      const leased = OUTBOX[created.state].leased;
      if (leased) this.#c.know(this.#t, created.key, created.chatId);
      return { status: leased ? "leased" : "queued", entry: created };
    }
    const known = row ? await this.#aside.settle("reserve", row) : null;
    if (known instanceof DamagedRecordError) throw known;
    if (known) return { status: "exists", entry: known };
    // The key was journaled by a concurrent reserve after this statement's snapshot was taken.
    const existing = await this.get(input.key);
    if (!existing) throw new Error(`Postgres outbox.reserve on ${this.#t}: entry ${JSON.stringify(input.key)} vanished`);
    return { status: "exists", entry: existing };
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    pgClaim(options, "outbox.claimDue");
    checkFinite(options.limit, `outbox.claimDue: option "limit"`);
    const requestId = checkScanRequest(options, "outbox.claimDue");
    if (options.repeat === true) {
      const kept = await this.#answers.repeat(requestId!) as OutboxClaim | null;
      if (kept === null) return { due: [], ambiguous: [] };
      if (typeof kept !== "object" || !Array.isArray(kept.due) || !Array.isArray(kept.ambiguous)) {
        throw new Error(`Postgres outbox.claimDue on ${this.#t}: the answer kept for requestId ${JSON.stringify(requestId)} is not {due, ambiguous}`);
      }
      return { due: kept.due, ambiguous: kept.ambiguous };
    }
    // A named scan runs in one transaction with the storing of its answer (see `scan_answers.ts`).
    if (requestId !== undefined) return await this.#answers.kept(requestId, (run) => this.#scanDue(options, run), isEmptyClaim);
    return await this.#scanDue(options, (op, text, params) => this.#run(op, text, params));
  }

  /** The due scan of {@link claimDue}, its statements run by `run`. */
  async #scanDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }, run: JournalRun): Promise<OutboxClaim> {
    const limit = Math.max(0, Math.min(Math.ceil(options.limit), 1_000_000));
    const text = this.#q.claimDue(options.reclaimOwn === true, options.resendAmbiguous === true);
    const due: OutboxEntry[] = [];
    const ambiguous: OutboxEntry[] = [];
    // Each row is read on its own: a damaged one is set aside (its chat's next entry gets its due mark, see
    // "Damaged records" in `mod.ts`), the others are returned, and the scan runs again for
    // what it left (the first round runs whatever the limit: it resolves the lost sends).
    for (let round = 0, damaged = true; damaged && (round === 0 || due.length < limit) && round < DAMAGED_ROUNDS; round++) {
      damaged = false;
      const rows = await run("claimDue", text, [options.owner, options.incarnation, duration(options.leaseMs), limit - due.length]);
      for (const row of rows) {
        const read = await this.#aside.settle("claimDue", row, run);
        if (read instanceof DamagedRecordError) damaged = true;
        const entry = leasedBy(read, row);
        if (!entry) continue;
        this.#c.know(this.#t, entry.key, entry.chatId);
        if (row.part === "ambiguous") {
          ambiguous.push(entry);
          if (options.resendAmbiguous) due.push(structuredClone(entry));
        } else {
          due.push(entry);
        }
      }
    }
    due.sort((a, b) => a.seq - b.seq);
    ambiguous.sort((a, b) => a.seq - b.seq);
    return { due, ambiguous };
  }

  /** `many`: the multi-row statement of the write's kind, and the row's columns besides `key` and `token`. */
  async #fenced(op: string, text: string, key: string, token: number, more: unknown[], many?: [string, Record<string, unknown>]): Promise<boolean> {
    pgId(key, `outbox.${op}: "key"`);
    checkFinite(token, `outbox.${op}: "token"`);
    if (!tokenOk(token)) return false;
    const rows = await this.#write(op, text, [key, token, ...more], many ? { kind: `outbox.${op}`, text: many[0], key, row: { key, token, ...many[1] } } : undefined);
    return rows.length === 1;
  }

  async heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `outbox.heartbeat: "leaseMs"`);
    const ms = duration(leaseMs);
    return await this.#fenced("heartbeat", this.#q.heartbeat, key, token, [ms], [this.#q.heartbeatMany, { lease_ms: ms }]);
  }

  async markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `outbox.markCalling: "leaseMs"`);
    // One statement, group-committed as a heartbeat is (the hot path: one per send).
    const ms = duration(leaseMs);
    return await this.#fenced("markCalling", this.#q.markCalling, key, token, [ms], [this.#q.markCallingMany, { lease_ms: ms }]);
  }

  async markSent(key: string, token: number, messageId: string): Promise<void> {
    pgString(messageId, `outbox.markSent: "messageId"`);
    const many: [string, Record<string, unknown>] = [this.#q.markSentMany, { message_id: messageId }];
    const sent = await this.#fenced("markSent", this.#q.markSent, key, token, [messageId], many);
    this.#c.forget(this.#t, key);
    if (!sent) throw new StaleLeaseError("outbox", key, token);
  }

  async markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    checkOutcome(outcome, "outbox.markFailed", true);
    if (outcome.ambiguous) {
      // `unknown`, no longer blocking its chat (see markAmbiguous in sql.ts).
      const unknown = await this.#fenced("markFailed", this.#q.markAmbiguous, key, token, [textForPg(outcome.error)]);
      this.#c.forget(this.#t, key);
      if (!unknown) throw new StaleLeaseError("outbox", key, token);
      return;
    }
    const dead = outcome.dead === true;
    const retry = dead ? 0 : duration((outcome as { retryInMs: number }).retryInMs);
    const failed = await this.#fenced("markFailed", this.#q.markFailed, key, token, [dead, textForPg(outcome.error), retry, outcome.throttled === true]);
    this.#c.forget(this.#t, key);
    if (!failed) throw new StaleLeaseError("outbox", key, token);
  }

  async get(key: string): Promise<OutboxEntry | null> {
    pgId(key, `outbox.get: "key"`);
    const rows = await this.#run("get", this.#q.get, [key]);
    const read = rows.length ? await this.#aside.settle("get", rows[0]!) : null;
    if (read instanceof DamagedRecordError) throw read;
    return read;
  }

  list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    pgListFilter(options, "outbox.list");
    const filter = listParams(options);
    if (!filter) return Promise.resolve([]);
    return listed(this.#aside, filter.limit, () => this.#run("list", this.#q.list(filter.chat, filter.states.length), filter.params));
  }

  async retry(key: string): Promise<boolean> {
    pgId(key, `outbox.retry: "key"`);
    const rows = await this.#run("retry", this.#q.retry, [key]);
    return Number(rows[0]?.n ?? 0) === 1;
  }

  async discard(key: string): Promise<boolean> {
    pgId(key, `outbox.discard: "key"`);
    return ((await this.#run("discard", this.#q.discard, [key])).count ?? 0) === 1;
  }

  async purge(olderThanMs: number): Promise<number> {
    checkFinite(olderThanMs, `outbox.purge: "olderThanMs"`);
    const older = Math.max(-MAX_DURATION_MS, Math.min(MAX_DURATION_MS, Math.floor(olderThanMs)));
    const batch = this.#c.purgeBatch;
    const total = await inBatches(batch, async () => (await this.#run("purge", this.#q.purge, [older, batch])).count ?? 0);
    // Chat rows of chats with no entry left (see "Per-chat order" in `mod.ts`).
    const chatAge = Math.max(older, CHAT_ROW_MIN_AGE_MS);
    await inBatches(batch, async () => (await this.#c.run("outbox.purge", this.#c.t.chat, this.#q.purgeChats, [chatAge, batch])).count ?? 0);
    await this.#answers.sweep(); // the answers of named due scans no longer kept
    return total;
  }

  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#aside.damaged(options);
  }

  reportDamaged(key: string): Promise<boolean> {
    return this.#aside.report(key);
  }
}
