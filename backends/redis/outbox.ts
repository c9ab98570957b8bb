/**
 * The outbox journal on Redis: each call one script (see `lua.ts`).
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  type FailOutcome,
  type JsonValue,
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
import {
  checkClaim,
  checkFinite,
  checkId,
  checkListFilter,
  checkNewOutbox,
  checkOutcome,
  checkString,
} from "../../src/rules.ts";
import { checkScanRequest } from "../../src/scan_answers.ts";
import { Aside } from "./aside.ts";
import { checkLimit, claimArgs, finishArgs, leaseArgs, listArgs, listRead, purgeAll } from "./journal_calls.ts";
import { fieldsOf, outboxOf } from "./records.ts";
import { list, type Runner, strings } from "./runner.ts";

export class RedisOutbox implements OutboxJournal {
  readonly #r: Runner;
  readonly #aside: Aside;

  constructor(runner: Runner) {
    this.#r = runner;
    this.#aside = new Aside(runner, "outbox");
  }

  async reserve(input: NewOutboxEntry, lease?: ReserveOptions): Promise<ReserveResult> {
    const e = checkNewOutbox(input);
    if (lease !== undefined) checkClaim(lease, "outbox.reserve");
    const content = JSON.stringify(e.content);
    const reply = list(
      await this.#r.run("outReserve", [
        e.key,
        e.chatId,
        content,
        e.contentHash,
        e.inboundId === null ? "0" : "1",
        e.inboundId ?? "",
        ...leaseArgs(lease),
        ...(lease?.calling === true ? ["1"] : []),
      ]),
    );
    const [status, flat] = reply;
    if (status === "aside") throw this.#aside.error(e.key, String(flat));
    if (status === "leased" || status === "queued") {
      // A new entry, as the script wrote it: the script answers only what it chose (seq, time, lease).
      const [, seq, at, leaseExp, called] = strings(reply);
      const leased = status === "leased";
      if (leased && lease === undefined) throw new Error(`Redis outbox.reserve: ${JSON.stringify(e.key)} was leased without a lease`);
      const now = Number(at);
      const entry: OutboxEntry = {
        key: e.key,
        chatId: e.chatId,
        content: JSON.parse(content) as JsonValue,
        contentHash: e.contentHash,
        inboundId: e.inboundId,
        state: leased ? "sending" : "queued",
        attempts: leased ? 1 : 0,
        nextAttemptAt: leased ? null : now,
        lease: leased ? { owner: lease!.owner, incarnation: lease!.incarnation, token: 1, expiresAt: Number(leaseExp) } : null,
        fence: leased ? 1 : 0,
        called: called === "1",
        messageId: null,
        error: null,
        seq: Number(seq),
        createdAt: now,
        updatedAt: now,
      };
      return { status, entry };
    }
    let entry: OutboxEntry | null;
    try {
      entry = outboxOf(flat, this.#r, e.key);
    } catch (error) {
      // An existing entry that only this reader finds damaged: set aside, as get does.
      await this.#aside.setAside(e.key, flat, errorMessage(error));
      throw this.#aside.error(e.key, errorMessage(error));
    }
    if (!entry) throw new Error(`Redis outbox.reserve: the entry ${JSON.stringify(e.key)} was not returned`);
    const kind = status === "leased" ? "leased" : status === "queued" ? "queued" : "exists";
    return { status: kind, entry };
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    checkClaim(options, "outbox.claimDue");
    const limit = checkLimit(options.limit, "outbox.claimDue");
    const requestId = checkScanRequest(options, "outbox.claimDue");
    // A named scan's reply stays under its request key (see REQUEST_TTL_MS in lua.ts): a repeat closes the request and reads it there.
    const key = requestId === undefined ? undefined : this.#r.scanKey("out", requestId);
    const [due, ambiguous] = list(
      options.repeat === true
        ? await this.#r.run("scanAnswer", ["out"], key)
        : await this.#r.run("outClaimDue", [...claimArgs(options), options.resendAmbiguous === true ? "1" : "0", String(limit)], key),
    );
    // Each entry is read on its own: one that cannot be read is set aside, the others are returned. With
    // resendAmbiguous an entry is in both lists: read once, one object in both.
    const read = new Map<string, OutboxEntry | null>();
    const entries = async (items: unknown): Promise<OutboxEntry[]> => {
      const out: OutboxEntry[] = [];
      for (const flat of list(items)) {
        const key = fieldsOf(flat)?.get("key") ?? "";
        if (!read.has(key)) read.set(key, (await this.#aside.read(flat, "key", () => outboxOf(flat, this.#r, ""))).value);
        const entry = read.get(key);
        if (entry) out.push(entry);
      }
      return out;
    };
    return { due: await entries(due), ambiguous: await entries(ambiguous) };
  }

  async heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(key, `outbox.heartbeat: "key"`);
    checkFinite(token, `outbox.heartbeat: "token"`);
    checkFinite(leaseMs, `outbox.heartbeat: "leaseMs"`);
    const [status] = list(await this.#r.run("outHeartbeat", [key, String(token), String(leaseMs)]));
    return status === "ok";
  }

  async markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(key, `outbox.markCalling: "key"`);
    checkFinite(token, `outbox.markCalling: "token"`);
    checkFinite(leaseMs, `outbox.markCalling: "leaseMs"`);
    const [status] = list(await this.#r.run("outMarkCalling", [key, String(token), String(leaseMs)]));
    return status === "ok";
  }

  async markSent(key: string, token: number, messageId: string): Promise<void> {
    checkId(key, `outbox.markSent: "key"`);
    checkFinite(token, `outbox.markSent: "token"`);
    checkString(messageId, `outbox.markSent: "messageId"`);
    const [status] = list(await this.#r.run("outFinish", [key, String(token), "sent", messageId, "0"]));
    if (status !== "ok") throw new StaleLeaseError("outbox", key, token);
  }

  async markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    checkId(key, `outbox.markFailed: "key"`);
    checkFinite(token, `outbox.markFailed: "token"`);
    checkOutcome(outcome, "outbox.markFailed", true);
    const [status] = list(await this.#r.run("outFinish", [key, String(token), ...finishArgs(outcome)]));
    if (status !== "ok") throw new StaleLeaseError("outbox", key, token);
  }

  async get(key: string): Promise<OutboxEntry | null> {
    checkId(key, `outbox.get: "key"`);
    for (let round = 0; ; round++) {
      const reply = await this.#r.run("outGet", [key]);
      const entry = await this.#aside.got(key, reply, (flat) => outboxOf(flat, this.#r, key), round >= 2);
      if (entry !== undefined) return entry;
    }
  }

  async list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    checkListFilter(options, "outbox.list");
    const { args, limit } = listArgs(options);
    if (limit === 0) return [];
    return await listRead(this.#r, "outList", args, (flat) => this.#aside.read(flat, "key", () => outboxOf(flat, this.#r, "")));
  }

  async damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return await this.#aside.list(options);
  }

  async reportDamaged(key: string): Promise<boolean> {
    return await this.#aside.report(key);
  }

  async retry(key: string): Promise<boolean> {
    checkId(key, `outbox.retry: "key"`);
    const [status] = list(await this.#r.run("outRetry", [key]));
    return status === "ok";
  }

  async discard(key: string): Promise<boolean> {
    checkId(key, `outbox.discard: "key"`);
    const [status] = list(await this.#r.run("outDiscard", [key]));
    return status === "ok";
  }

  async purge(olderThanMs: number): Promise<number> {
    checkFinite(olderThanMs, `outbox.purge: "olderThanMs"`);
    return await purgeAll(this.#r, "outPurge", olderThanMs);
  }
}
