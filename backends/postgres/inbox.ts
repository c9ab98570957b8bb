/**
 * The inbox journal in Postgres (the `inbox` of `PostgresDurability`).
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
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type ListOptions,
  type NewInboundRecord,
  StaleLeaseError,
} from "../../src/contract.ts";
import { INBOX } from "../../src/machine.ts";
import { checkAttempt, checkFinite, checkOutcome } from "../../src/rules.ts";
import { checkScanRequest } from "../../src/scan_answers.ts";
import { Aside, DAMAGED_ROUNDS, type JournalRun, leasedBy, listed } from "./aside.ts";
import type { Context, ManyRows, Row } from "./connection.ts";
import {
  duration,
  inBatches,
  inboundOf,
  listParams,
  MAX_DURATION_MS,
  pgClaim,
  pgId,
  pgInbound,
  pgListFilter,
  textForPg,
  tokenOk,
  written,
} from "./rows.ts";
import { PgScanAnswers } from "./scan_answers.ts";
import { type AsideSql, inboxSql, type InboxSql } from "./sql.ts";

/** A record a named scan answered: `{id, token}` (or, kept by an earlier version, the record itself). */
function inboxRef(item: unknown): { id: string; token: number } | null {
  const o = item as { id?: unknown; token?: unknown; lease?: { token?: unknown } | null } | null;
  if (typeof o !== "object" || o === null || typeof o.id !== "string") return null;
  const token = o.token ?? o.lease?.token;
  return typeof token === "number" ? { id: o.id, token } : null;
}

export class PgInbox implements InboxJournal {
  readonly #c: Context;
  readonly #q: InboxSql & AsideSql;
  readonly #t: string;
  readonly #aside: Aside<InboundRecord>;
  readonly #answers: PgScanAnswers;

  constructor(c: Context) {
    this.#c = c;
    this.#q = inboxSql(c.t);
    this.#t = c.t.inbox;
    this.#aside = new Aside(c, "inbox", this.#t, this.#q, (row) => inboundOf(row));
    this.#answers = new PgScanAnswers(c, "inbox", this.#t);
  }

  #run(op: string, text: string, params: unknown[]): Promise<Row[] & { count?: number }> {
    return this.#c.run(`inbox.${op}`, this.#t, text, params);
  }

  /** A write that joins the group commit (see `Context.write`); `chat` when the caller knows it. */
  #write(op: string, text: string, params: unknown[], many?: ManyRows, chat?: string): Promise<Row[] & { count?: number }> {
    return this.#c.write(`inbox.${op}`, this.#t, text, params, many, chat);
  }

  async admit(record: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null> {
    const input = pgInbound(record); // a TypeError naming the field, before anything is written
    if (lease !== undefined) pgClaim(lease, "inbox.admit");
    const params = [
      input.id,
      input.kind,
      input.chatId,
      input.provider,
      JSON.stringify(input.payload),
      input.receivedAt,
      lease !== undefined,
      lease?.owner ?? null,
      lease?.incarnation ?? null,
      duration(lease?.leaseMs ?? 0),
    ] as const;
    const [id, kind, chat_id, provider, payload, received_at, leased, owner, inc, lease_ms] = params;
    const rows = await this.#write("admit", this.#q.admit, [...params], {
      kind: "inbox.admit",
      text: this.#q.admitMany,
      key: id,
      row: { id, kind, chat_id, provider, payload, received_at, leased, owner, inc, lease_ms },
    }, chat_id);
    if (rows.length && lease !== undefined) this.#c.know(this.#t, id, chat_id);
    return rows.length ? written(inboundOf(rows[0]!, input.payload), this.#t) : null;
  }

  async claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    pgId(id, `inbox.claim: "id"`);
    pgClaim(options, "inbox.claim");
    const text = options.reclaimOwn ? this.#q.claimReclaim : this.#q.claim;
    const rows = await this.#run("claim", text, [options.owner, options.incarnation, duration(options.leaseMs), id]);
    const read = rows.length ? await this.#aside.settle("claim", rows[0]!) : null;
    const record = read instanceof DamagedRecordError ? null : leasedBy(read, rows[0]);
    if (record) this.#c.know(this.#t, record.id, record.chatId);
    return record;
  }

  async claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    pgClaim(options, "inbox.claimDue");
    checkFinite(options.limit, `inbox.claimDue: option "limit"`);
    const requestId = checkScanRequest(options, "inbox.claimDue");
    this.#c.stats.check();
    if (options.repeat === true) return await this.#repeat(options, requestId!);
    if (!(options.limit > 0)) return [];
    // A named scan runs in one transaction with the storing of its answer's references (see `scan_answers.ts`).
    if (requestId !== undefined) {
      return await this.#answers.kept(
        requestId,
        (run) => this.#scanDue(options, run),
        (a) => a.length === 0 ? null : a.map((r) => ({ id: r.id, token: r.lease!.token })),
      );
    }
    return await this.#scanDue(options, (op, text, params) => this.#run(op, text, params));
  }

  /**
   * The repeat of the scan named `requestId`: the records it leased that are still as it left them
   * (`processing`, leased to the caller under the token it issued), read again, in its order.
   */
  async #repeat(options: ClaimDueOptions, requestId: string): Promise<InboundRecord[]> {
    const kept = await this.#answers.repeat(requestId, "[]");
    if (kept === null) return [];
    const refs = Array.isArray(kept) ? kept.map(inboxRef) : null;
    if (refs === null || refs.includes(null)) {
      throw new Error(`Postgres inbox.claimDue on ${this.#t}: the answer kept for requestId ${JSON.stringify(requestId)} is not a list of {id, token}`);
    }
    if (refs.length === 0) return [];
    const rows = await this.#run("claimDue", this.#q.getMany, [JSON.stringify(refs.map((r) => r!.id))]);
    const byId = new Map(rows.map((row) => [String(row.id), row]));
    const out: InboundRecord[] = [];
    for (const ref of refs) {
      const row = byId.get(ref!.id);
      // Each row is read on its own: a damaged one is set aside and left out, as a scan does.
      const read = row ? await this.#aside.settle("claimDue", row) : null;
      if (read === null || read instanceof DamagedRecordError || !INBOX[read.state].leased) continue;
      const lease = read.lease;
      if (lease?.owner !== options.owner || lease.incarnation !== options.incarnation || lease.token !== ref!.token) continue;
      this.#c.know(this.#t, read.id, read.chatId);
      out.push(read);
    }
    return out;
  }

  /** The due scan of {@link claimDue}, its statements run by `run`. */
  async #scanDue(options: ClaimDueOptions, run: JournalRun): Promise<InboundRecord[]> {
    const text = options.reclaimOwn ? this.#q.claimDueReclaim : this.#q.claimDue;
    const limit = Math.min(Math.ceil(options.limit), 1_000_000);
    const good: { ord: number; record: InboundRecord }[] = [];
    // Each row is read on its own: a damaged one is set aside (see "Damaged records" in `mod.ts`), the
    // others are returned, and the scan runs again for what it left.
    for (let round = 0, damaged = true; damaged && good.length < limit && round < DAMAGED_ROUNDS; round++) {
      damaged = false;
      const rows = await run("claimDue", text, [options.owner, options.incarnation, duration(options.leaseMs), limit - good.length]);
      for (const row of rows) {
        const read = await this.#aside.settle("claimDue", row, run);
        if (read instanceof DamagedRecordError) damaged = true;
        const record = leasedBy(read, row);
        if (record) {
          good.push({ ord: Number(row.ord), record });
          this.#c.know(this.#t, record.id, record.chatId);
        }
      }
    }
    // An UPDATE returns rows in no particular order: arrival order, as the scan picked them.
    return good.sort((a, b) => a.record.receivedAt - b.record.receivedAt || a.ord - b.ord).map((item) => item.record);
  }

  /** `many`: the multi-row statement of the write's kind, and the row's columns besides `id` and `token`. */
  async #fenced(op: string, text: string, id: string, token: number, more: unknown[], many?: [string, Record<string, unknown>]): Promise<boolean> {
    pgId(id, `inbox.${op}: "id"`);
    checkFinite(token, `inbox.${op}: "token"`);
    if (!tokenOk(token)) return false;
    const rows = await this.#write(op, text, [id, token, ...more], many ? { kind: `inbox.${op}`, text: many[0], key: id, row: { id, token, ...many[1] } } : undefined);
    return rows.length === 1;
  }

  async heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    checkFinite(leaseMs, `inbox.heartbeat: "leaseMs"`);
    const ms = duration(leaseMs);
    return await this.#fenced("heartbeat", this.#q.heartbeat, id, token, [ms], [this.#q.heartbeatMany, { lease_ms: ms }]);
  }

  async start(id: string, token: number, attempt: number): Promise<boolean> {
    checkAttempt(attempt, "inbox.start");
    const run = Math.min(attempt, 2 ** 31 - 1);
    return await this.#fenced("start", this.#q.start, id, token, [run], [this.#q.startMany, { attempt: run }]);
  }

  async schedule(id: string, token: number, dueInMs: number): Promise<void> {
    checkFinite(dueInMs, `inbox.schedule: "dueInMs"`);
    const armed = await this.#fenced("schedule", this.#q.schedule, id, token, [duration(dueInMs)]);
    this.#c.forget(this.#t, id);
    if (!armed) throw new StaleLeaseError("inbox", id, token);
  }

  async complete(id: string, token: number): Promise<void> {
    const done = await this.#fenced("complete", this.#q.complete, id, token, [], [this.#q.completeMany, {}]);
    this.#c.forget(this.#t, id);
    if (!done) throw new StaleLeaseError("inbox", id, token);
  }

  async fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    checkOutcome(outcome, "inbox.fail");
    const dead = outcome.dead === true;
    const retry = dead ? 0 : duration((outcome as { retryInMs: number }).retryInMs);
    const failed = await this.#fenced("fail", this.#q.fail, id, token, [dead, textForPg(outcome.error), retry]);
    this.#c.forget(this.#t, id);
    if (!failed) throw new StaleLeaseError("inbox", id, token);
  }

  async get(id: string): Promise<InboundRecord | null> {
    pgId(id, `inbox.get: "id"`);
    const rows = await this.#run("get", this.#q.get, [id]);
    const read = rows.length ? await this.#aside.settle("get", rows[0]!) : null;
    if (read instanceof DamagedRecordError) throw read;
    return read;
  }

  list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    pgListFilter(options, "inbox.list");
    const filter = listParams(options);
    if (!filter) return Promise.resolve([]);
    return listed(this.#aside, filter.limit, () => this.#run("list", this.#q.list(filter.chat, filter.states.length), filter.params));
  }

  async replay(id: string): Promise<boolean> {
    pgId(id, `inbox.replay: "id"`);
    return (await this.#run("replay", this.#q.replay, [id])).length === 1;
  }

  async purge(olderThanMs: number): Promise<number> {
    checkFinite(olderThanMs, `inbox.purge: "olderThanMs"`);
    const older = Math.max(-MAX_DURATION_MS, Math.min(MAX_DURATION_MS, Math.floor(olderThanMs)));
    const batch = this.#c.purgeBatch;
    const total = await inBatches(batch, async () => (await this.#run("purge", this.#q.purge, [older, batch])).count ?? 0);
    await this.#answers.sweep(); // the answers of named due scans no longer kept
    return total;
  }

  damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return this.#aside.damaged(options);
  }

  reportDamaged(id: string): Promise<boolean> {
    return this.#aside.report(id);
  }
}
