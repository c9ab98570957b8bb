/**
 * The inbox journal on Redis: each call one script (see `lua.ts`).
 *
 * @module
 */
import {
  type ClaimDueOptions,
  type ClaimOptions,
  type DamagedListOptions,
  type DamagedRecord,
  type FailOutcome,
  type InboundRecord,
  type InboundState,
  type InboxJournal,
  type JsonValue,
  type ListOptions,
  type NewInboundRecord,
  StaleLeaseError,
} from "../../src/contract.ts";
import { INBOX } from "../../src/machine.ts";
import { checkAttempt, checkClaim, checkFinite, checkId, checkListFilter, checkNewInbound, checkOutcome } from "../../src/rules.ts";
import { checkScanRequest } from "../../src/scan_answers.ts";
import { Aside } from "./aside.ts";
import { checkLimit, claimArgs, finishArgs, leaseArgs, listArgs, listRead, purgeAll } from "./journal_calls.ts";
import { inboundOf } from "./records.ts";
import { list, type Runner, strings } from "./runner.ts";

export class RedisInbox implements InboxJournal {
  readonly #r: Runner;
  readonly #aside: Aside;

  constructor(runner: Runner) {
    this.#r = runner;
    this.#aside = new Aside(runner, "inbox");
  }

  async admit(input: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null> {
    const rec = checkNewInbound(input);
    if (lease !== undefined) checkClaim(lease, "inbox.admit");
    const payload = JSON.stringify(rec.payload);
    const [status, state, updatedAt, leaseExp] = strings(
      await this.#r.run("inAdmit", [
        rec.id,
        rec.kind,
        rec.chatId,
        rec.provider,
        payload,
        String(rec.receivedAt),
        ...leaseArgs(lease),
      ]),
    );
    if (status !== "ok") return null;
    // The record as the script wrote it: the script answers only what it chose (state, times).
    const leased = INBOX[state as InboundState]?.leased === true;
    if (leased && lease === undefined) throw new Error(`Redis inbox.admit: ${JSON.stringify(rec.id)} was leased without a lease`);
    return {
      id: rec.id,
      kind: rec.kind,
      chatId: rec.chatId,
      provider: rec.provider,
      payload: JSON.parse(payload) as JsonValue,
      receivedAt: rec.receivedAt,
      state: leased ? "processing" : "pending",
      attempts: leased ? 1 : 0,
      nextAttemptAt: null,
      lease: leased ? { owner: lease!.owner, incarnation: lease!.incarnation, token: 1, expiresAt: Number(leaseExp) } : null,
      fence: leased ? 1 : 0,
      error: null,
      updatedAt: Number(updatedAt),
    };
  }

  async claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    checkId(id, `inbox.claim: "id"`);
    checkClaim(options, "inbox.claim");
    const [status, flat] = list(await this.#r.run("inClaim", [id, ...claimArgs(options)]));
    return status === "ok" ? (await this.#aside.read(flat, "id", () => inboundOf(flat, this.#r, id))).value : null;
  }

  async claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    checkClaim(options, "inbox.claimDue");
    const limit = checkLimit(options.limit, "inbox.claimDue");
    const requestId = checkScanRequest(options, "inbox.claimDue");
    // A named scan's reply stays under its request key (see REQUEST_TTL_MS in lua.ts): a repeat closes the request and reads it there.
    const key = requestId === undefined ? undefined : this.#r.scanKey("in", requestId);
    let out: unknown[];
    if (options.repeat === true) {
      out = list(await this.#r.run("scanAnswer", ["in"], key));
    } else {
      if (limit === 0) return [];
      out = list(await this.#r.run("inClaimDue", [...claimArgs(options), String(limit)], key));
    }
    // Each record is read on its own: one that cannot be read is set aside, the others are returned.
    const records: InboundRecord[] = [];
    for (const flat of out) {
      const { value } = await this.#aside.read(flat, "id", () => inboundOf(flat, this.#r, ""));
      if (value) records.push(value);
    }
    return records;
  }

  async heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(id, `inbox.heartbeat: "id"`);
    checkFinite(token, `inbox.heartbeat: "token"`);
    checkFinite(leaseMs, `inbox.heartbeat: "leaseMs"`);
    const [status] = list(await this.#r.run("inHeartbeat", [id, String(token), String(leaseMs)]));
    return status === "ok";
  }

  async start(id: string, token: number, attempt: number): Promise<boolean> {
    checkId(id, `inbox.start: "id"`);
    checkFinite(token, `inbox.start: "token"`);
    checkAttempt(attempt, "inbox.start");
    const [status] = list(await this.#r.run("inStart", [id, String(token), String(attempt)]));
    return status === "ok";
  }

  async schedule(id: string, token: number, dueInMs: number): Promise<void> {
    checkId(id, `inbox.schedule: "id"`);
    checkFinite(token, `inbox.schedule: "token"`);
    checkFinite(dueInMs, `inbox.schedule: "dueInMs"`);
    const [status] = list(await this.#r.run("inFinish", [id, String(token), "schedule", "", String(Math.max(0, Math.ceil(dueInMs)))]));
    if (status !== "ok") throw new StaleLeaseError("inbox", id, token);
  }

  async complete(id: string, token: number): Promise<void> {
    checkId(id, `inbox.complete: "id"`);
    checkFinite(token, `inbox.complete: "token"`);
    const [status] = list(await this.#r.run("inFinish", [id, String(token), "done", "", "0"]));
    if (status !== "ok") throw new StaleLeaseError("inbox", id, token);
  }

  async fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    checkId(id, `inbox.fail: "id"`);
    checkFinite(token, `inbox.fail: "token"`);
    checkOutcome(outcome, "inbox.fail");
    const [status] = list(await this.#r.run("inFinish", [id, String(token), ...finishArgs(outcome)]));
    if (status !== "ok") throw new StaleLeaseError("inbox", id, token);
  }

  async get(id: string): Promise<InboundRecord | null> {
    checkId(id, `inbox.get: "id"`);
    for (let round = 0; ; round++) {
      const reply = await this.#r.run("inGet", [id]);
      const record = await this.#aside.got(id, reply, (flat) => inboundOf(flat, this.#r, id), round >= 2);
      if (record !== undefined) return record;
    }
  }

  async list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    checkListFilter(options, "inbox.list");
    const { args, limit } = listArgs(options);
    if (limit === 0) return [];
    return await listRead(this.#r, "inList", args, (flat) => this.#aside.read(flat, "id", () => inboundOf(flat, this.#r, "")));
  }

  async damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    return await this.#aside.list(options);
  }

  async reportDamaged(id: string): Promise<boolean> {
    return await this.#aside.report(id);
  }

  async replay(id: string): Promise<boolean> {
    checkId(id, `inbox.replay: "id"`);
    const [status] = list(await this.#r.run("inReplay", [id]));
    return status === "ok";
  }

  async purge(olderThanMs: number): Promise<number> {
    checkFinite(olderThanMs, `inbox.purge: "olderThanMs"`);
    return await purgeAll(this.#r, "inPurge", olderThanMs);
  }
}
