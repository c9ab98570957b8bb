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
  type ReserveOptions,
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

/** The placeholder a repeat keeps when its scan kept nothing: the empty answer. */
const EMPTY_CLAIM = JSON.stringify({ due: [], ambiguous: [] });

/**
 * An entry a named scan answered: `{key, token}` (due) or `{key, fence}` (ambiguous), as `n`; or, kept by
 * an earlier version, the entry itself (its lease's token, its fence).
 */
function outboxRef(item: unknown, field: "token" | "fence"): { key: string; n: number } | null {
  const o = item as { key?: unknown; token?: unknown; fence?: unknown; lease?: { token?: unknown } | null } | null;
  if (typeof o !== "object" || o === null || typeof o.key !== "string") return null;
  const n = field === "fence" ? o.fence : o.token ?? o.lease?.token;
  return typeof n === "number" ? { key: o.key, n } : null;
}

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

  async reserve(entry: NewOutboxEntry, lease?: ReserveOptions): Promise<ReserveResult> {
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
      lease?.calling === true,
    ] as const;
    const [key, chat_id, content, content_hash, inbound_id, leased, owner, inc, lease_ms, calling] = params;
    const rows = await this.#write("reserve", this.#q.reserve, [...params], {
      kind: "outbox.reserve",
      text: this.#q.reserveMany,
      key,
      row: { key, chat_id, content, content_hash, inbound_id, leased, owner, inc, lease_ms, calling },
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
    this.#c.stats.check();
    if (options.repeat === true) return await this.#repeat(options, requestId!);
    // A named scan runs in one transaction with the storing of its answer's references (see `scan_answers.ts`).
    if (requestId !== undefined) {
      return await this.#answers.kept(requestId, (run) => this.#scanDue(options, run), (a) =>
        isEmptyClaim(a) ? null : {
          due: a.due.map((e) => ({ key: e.key, token: e.lease!.token })),
          ambiguous: a.ambiguous.map((e) => ({ key: e.key, fence: e.fence })),
        });
    }
    return await this.#scanDue(options, (op, text, params) => this.#run(op, text, params));
  }

  /**
   * The repeat of the scan named `requestId`: the entries it answered that are still as it left them,
   * read again, in its order. Due: `sending`, leased to the caller under the token it issued.
   * Ambiguous: every entry it made ambiguous, whatever its state now (its report is owed).
   */
  async #repeat(options: ClaimDueOptions, requestId: string): Promise<OutboxClaim> {
    const kept = await this.#answers.repeat(requestId, EMPTY_CLAIM) as { due?: unknown; ambiguous?: unknown } | null;
    if (kept === null) return { due: [], ambiguous: [] };
    const due = Array.isArray(kept?.due) ? kept.due.map((e) => outboxRef(e, "token")) : null;
    const ambiguous = Array.isArray(kept?.ambiguous) ? kept.ambiguous.map((e) => outboxRef(e, "fence")) : null;
    if (due === null || ambiguous === null || due.includes(null) || ambiguous.includes(null)) {
      throw new Error(
        `Postgres outbox.claimDue on ${this.#t}: the answer kept for requestId ${JSON.stringify(requestId)} is not {due: [{key, token}], ambiguous: [{key, fence}]}`,
      );
    }
    if (due.length === 0 && ambiguous.length === 0) return { due: [], ambiguous: [] };
    const keys = [...new Set([...due, ...ambiguous].map((r) => r!.key))];
    const rows = await this.#run("claimDue", this.#q.getMany, [JSON.stringify(keys)]);
    const byKey = new Map(rows.map((row) => [String(row.key), row]));
    const read = new Map<string, OutboxEntry | null>();
    // Each row is read on its own: a damaged one is set aside and left out, as a scan does.
    for (const key of keys) {
      const row = byKey.get(key);
      const entry = row ? await this.#aside.settle("claimDue", row) : null;
      read.set(key, entry instanceof DamagedRecordError ? null : entry);
    }
    const dueToken = new Map(due.map((r) => [r!.key, r!.n]));
    const leasedAs = (e: OutboxEntry | null | undefined, token: number | undefined): e is OutboxEntry =>
      e !== null && e !== undefined && token !== undefined && OUTBOX[e.state].leased && e.lease?.token === token &&
      e.lease.owner === options.owner && e.lease.incarnation === options.incarnation;
    const claim: OutboxClaim = { due: [], ambiguous: [] };
    // Every entry the scan made ambiguous is answered, as it is now: the scan let the later sends of its
    // chat go ahead of it, so its report is owed even when a late outcome (or an operator) settled it since.
    for (const ref of ambiguous) {
      const e = read.get(ref!.key);
      if (e !== null && e !== undefined) claim.ambiguous.push(e);
    }
    const answered = new Set(claim.ambiguous.map((e) => e.key));
    for (const ref of due) {
      const e = read.get(ref!.key);
      if (!leasedAs(e, ref!.n)) continue;
      // With resendAmbiguous an entry is in both lists: a copy in due, as the scan answers it.
      claim.due.push(answered.has(e.key) ? structuredClone(e) : e);
    }
    for (const e of [...claim.ambiguous, ...claim.due]) if (OUTBOX[e.state].leased) this.#c.know(this.#t, e.key, e.chatId);
    return claim;
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
