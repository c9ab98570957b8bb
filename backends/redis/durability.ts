/**
 * RedisDurability, RedisStore and RedisKv (see `mod.ts` for the user
 * documentation; the Lua scripts are in `lua.ts`).
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import {
  type BackendScope,
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
import {
  checkClaim,
  checkDamagedList,
  checkFinite,
  checkListFilter,
  checkNewInbound,
  checkNewOutbox,
  checkOutcome,
  checkId,
  checkString,
  normalizeList,
} from "../../src/rules.ts";
import { sessionEntry, type SessionStore } from "../../src/store.ts";
import { storedCalled, storedInboundProblem, storedOutboxProblem } from "../../src/stored_records.ts";
import { showValue as show } from "../../src/show.ts";
import { BATCH, BATCHED, type BatchedName, type LuaScript, type ScriptName, SCRIPTS } from "./lua.ts";
import { type RedisCommands, toCommands } from "./clients.ts";

export {
  type BunRedisLike,
  fromBunRedis,
  fromIoredis,
  fromNodeRedis,
  fromUpstash,
  type IoredisLike,
  type NodeRedisLike,
  type RedisCommands,
  type UpstashLike,
} from "./clients.ts";

/** Options of {@link RedisDurability}, {@link RedisStore} and {@link RedisKv}. */
export interface RedisOptions {
  /**
   * The client: an `@upstash/redis` client, an `ioredis` client, a connected
   * `redis` (node-redis) client, a Bun `RedisClient`, or a {@link RedisCommands}. Required.
   */
  client: unknown;
  /**
   * Every key starts with `{keyPrefix}` (default `"botmesh:"`): 1 to 128
   * characters, without `{` or `}`. Give each bot (tenant, test run) its own.
   */
  keyPrefix?: string;
}

/** Options of {@link RedisDurability}. */
export type RedisDurabilityOptions = RedisOptions;
/** Options of {@link RedisStore}. */
export type RedisStoreOptions = RedisOptions;
/** Options of {@link RedisKv}. */
export type RedisKvOptions = RedisOptions;

const OPTION_NAMES = ["client", "keyPrefix"] as const;
/** Records deleted per purge script call. */
const PURGE_BATCH = 500;

interface Resolved {
  commands: RedisCommands;
  keyPrefix: string;
}

function resolveOptions(options: unknown, what: string): Resolved {
  if (typeof options !== "object" || options === null || Array.isArray(options)) {
    throw new TypeError(`${what} options must be an object with a "client", got ${show(options)}`);
  }
  const o = options as Record<string, unknown>;
  checkKnownOptions(o, OPTION_NAMES, "Redis option");
  const commands = toCommands(o.client, `Redis option "client"`);
  const keyPrefix = o.keyPrefix ?? "botmesh:";
  if (typeof keyPrefix !== "string") {
    throw new TypeError(`Redis option "keyPrefix" must be a string, got ${show(keyPrefix)}`);
  }
  if (keyPrefix.length === 0 || keyPrefix.length > 128 || /[{}]/.test(keyPrefix)) {
    throw new RangeError(
      `Redis option "keyPrefix" must be 1 to 128 characters without "{" or "}", got ${show(keyPrefix)}`,
    );
  }
  return { commands, keyPrefix };
}

// ---- scripts -----------------------------------------------------------------

const shaCache = new WeakMap<LuaScript, Promise<string>>();

async function sha1Hex(text: string): Promise<string> {
  const digest = await crypto.subtle.digest("SHA-1", new TextEncoder().encode(text));
  let out = "";
  for (const b of new Uint8Array(digest)) out += b.toString(16).padStart(2, "0");
  return out;
}

function shaOf(script: LuaScript): Promise<string> {
  let sha = shaCache.get(script);
  if (!sha) {
    sha = sha1Hex(script.text);
    shaCache.set(script, sha);
  }
  return sha;
}

function messageOf(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

const BATCHABLE: ReadonlySet<string> = new Set<string>(BATCHED);
/** Operations per batch script call (a call blocks the server while it runs). */
const BATCH_MAX = 64;
/** Batch calls in flight at once; the operations issued meanwhile wait and go together in the next one. */
const BATCH_IN_FLIGHT = 2;

interface Pending {
  name: BatchedName;
  args: readonly string[];
  resolve(value: unknown): void;
  reject(error: unknown): void;
}

/**
 * Runs the backend's scripts over one client under one key prefix.
 *
 * The writes of the hot path ({@link BATCHED}) issued in one turn of the event loop go to Redis in
 * one script call ({@link BATCH}), each answered on its own. At most {@link BATCH_IN_FLIGHT} such
 * calls are in flight: the writes issued meanwhile wait for one to return, so that under load the
 * batches grow instead of the calls.
 */
class Runner {
  readonly commands: RedisCommands;
  readonly keyPrefix: string;
  /** The hash-tagged prefix every key starts with. */
  readonly tag: string;
  #queue: Pending[] = [];
  #inFlight = 0;
  #scheduled = false;
  #sha = new Map<LuaScript, string>();

  constructor(resolved: Resolved) {
    this.commands = resolved.commands;
    this.keyPrefix = resolved.keyPrefix;
    this.tag = `{${resolved.keyPrefix}}`;
  }

  #failure(name: string, error: unknown): Error {
    return new Error(`Redis ${name} (key prefix ${JSON.stringify(this.keyPrefix)}) failed: ${messageOf(error)}`, {
      cause: error,
    });
  }

  /** `EVALSHA` of `script`; a `NOSCRIPT` answer loads it and runs it again. */
  async #eval(script: LuaScript, keys: string[], argv: string[]): Promise<unknown> {
    const sha = this.#sha.get(script) ?? await shaOf(script);
    this.#sha.set(script, sha);
    try {
      return await this.commands.evalsha(sha, keys, argv);
    } catch (error) {
      if (!/NOSCRIPT/.test(messageOf(error))) throw error;
      await this.commands.scriptLoad(script.text);
      return await this.commands.evalsha(sha, keys, argv);
    }
  }

  /**
   * Runs script `name` with `args` (after the prefix) and returns its decoded
   * reply. A `NOSCRIPT` answer loads the script and runs it again.
   */
  run(name: ScriptName, args: readonly string[]): Promise<unknown> {
    if (BATCHABLE.has(name)) {
      return new Promise((resolve, reject) => {
        this.#queue.push({ name: name as BatchedName, args, resolve, reject });
        this.#schedule();
      });
    }
    return this.#runAlone(name, args);
  }

  async #runAlone(name: ScriptName, args: readonly string[]): Promise<unknown> {
    const script = SCRIPTS[name];
    // A mutating script runs once per call: a re-sent call (after a lost reply) gets the first run's reply.
    const keys = script.once ? [this.tag, `${this.tag}rq:${crypto.randomUUID()}`] : [this.tag];
    let reply: unknown;
    try {
      reply = await this.#eval(script, keys, [this.tag, ...args]);
    } catch (error) {
      throw this.#failure(script.name, error);
    }
    return decodeReply(reply, script.name);
  }

  #schedule(): void {
    if (this.#scheduled || this.#inFlight >= BATCH_IN_FLIGHT || this.#queue.length === 0) return;
    this.#scheduled = true;
    queueMicrotask(() => {
      this.#scheduled = false;
      while (this.#inFlight < BATCH_IN_FLIGHT && this.#queue.length > 0) {
        void this.#flush(this.#queue.splice(0, BATCH_MAX));
      }
    });
  }

  async #flush(batch: Pending[]): Promise<void> {
    this.#inFlight++;
    try {
      const argv = [this.tag];
      let once = false;
      for (const op of batch) {
        const script = SCRIPTS[op.name];
        once ||= script.once;
        argv.push(op.name, script.once ? "1" : "0", String(op.args.length), ...op.args);
      }
      // One request key for the call, when an operation in it is run once per request.
      const keys = once ? [this.tag, `${this.tag}rq:${crypto.randomUUID()}`] : [this.tag];
      let replies: unknown[];
      try {
        const decoded = decodeReply(await this.#eval(BATCH, keys, argv), BATCH.name);
        if (!Array.isArray(decoded) || decoded.length !== batch.length) {
          throw new Error(`the batch's reply has ${Array.isArray(decoded) ? decoded.length : "no"} answers for ${batch.length} operations`);
        }
        replies = decoded;
      } catch (error) {
        for (const op of batch) op.reject(this.#failure(SCRIPTS[op.name].name, error));
        return;
      }
      batch.forEach((op, i) => {
        const r = replies[i];
        if (typeof r === "object" && r !== null && !Array.isArray(r) && typeof (r as { err?: unknown }).err === "string") {
          op.reject(this.#failure(SCRIPTS[op.name].name, new Error((r as { err: string }).err)));
        } else {
          op.resolve(r);
        }
      });
    } finally {
      this.#inFlight--;
      this.#schedule();
    }
  }

  /** The server's time (ms since epoch). */
  async now(): Promise<number> {
    const [t] = strings(await this.run("time", []));
    return Number(t);
  }
}

/**
 * A script's reply: the JSON text it returned (an Upstash client with
 * automatic deserialization has already parsed it).
 */
function decodeReply(reply: unknown, name: string): unknown {
  if (typeof reply === "string") {
    try {
      return JSON.parse(reply);
    } catch (error) {
      throw new Error(`Redis ${name}: the script's reply is not JSON: ${messageOf(error)}`);
    }
  }
  if (reply instanceof Uint8Array) return decodeReply(new TextDecoder().decode(reply), name);
  if (typeof reply === "object" && reply !== null) return reply;
  throw new Error(`Redis ${name}: unexpected script reply ${show(reply)}`);
}

/** A decoded array (cjson encodes an empty one as `{}`). */
function list(value: unknown): unknown[] {
  return Array.isArray(value) ? value : [];
}

function strings(value: unknown): string[] {
  return list(value).map((v) => String(v));
}

/** An `HGETALL` array as a map, or `null` when empty. */
function fieldsOf(flat: unknown): Map<string, string> | null {
  const items = list(flat);
  if (items.length === 0) return null;
  const m = new Map<string, string>();
  for (let i = 0; i + 1 < items.length; i += 2) m.set(String(items[i]), String(items[i + 1]));
  return m;
}

/** A number field: the number, the raw text when it is not one (so the check quotes it), `undefined` when absent. */
function numField(m: Map<string, string>, field: string): number | string | undefined {
  const raw = m.get(field);
  if (raw === undefined) return undefined;
  const n = Number(raw);
  return raw.trim() !== "" && Number.isFinite(n) ? n : raw;
}

function optNum(m: Map<string, string>, field: string): number | string | null {
  return m.has(field) ? numField(m, field)! : null;
}

function jsonField(m: Map<string, string>, field: string, what: string): JsonValue | undefined {
  const raw = m.get(field);
  if (raw === undefined) return undefined;
  try {
    return JSON.parse(raw) as JsonValue;
  } catch (error) {
    throw new Error(`${what}: field "${field}" is not JSON (${messageOf(error)}): ${show(raw.slice(0, 80))}`);
  }
}

/**
 * The `called` field as the record check wants it: a boolean for `1`/`0`, `undefined` when absent
 * (an entry written before the field existed: {@link storedCalled} reads it as `true`), else the raw
 * text, so that the check quotes it.
 */
function calledField(m: Map<string, string>): boolean | string | undefined {
  const raw = m.get("called");
  return raw === "1" ? true : raw === "0" ? false : raw;
}

function leaseOf(m: Map<string, string>): unknown {
  if (!m.has("leaseOwner")) return null;
  return {
    owner: m.get("leaseOwner"),
    incarnation: m.get("leaseInc"),
    token: numField(m, "leaseToken"),
    expiresAt: numField(m, "leaseExp"),
  };
}

function inboundOf(flat: unknown, runner: Runner, id: string): InboundRecord | null {
  const m = fieldsOf(flat);
  if (!m) return null;
  const what = `Redis inbox record at key ${JSON.stringify(`${runner.tag}in:r:${m.get("id") ?? id}`)}`;
  const record = {
    id: m.get("id"),
    kind: m.get("kind"),
    chatId: m.get("chatId"),
    provider: m.get("provider"),
    payload: jsonField(m, "payload", what),
    receivedAt: numField(m, "receivedAt"),
    state: m.get("state"),
    attempts: numField(m, "attempts"),
    nextAttemptAt: optNum(m, "nextAttemptAt"),
    lease: leaseOf(m),
    fence: numField(m, "fence"),
    error: m.get("error") ?? null,
    updatedAt: numField(m, "updatedAt"),
  };
  const problem = storedInboundProblem(record);
  if (problem) throw new Error(`${what}: ${problem}`);
  return record as InboundRecord;
}

function outboxOf(flat: unknown, runner: Runner, key: string): OutboxEntry | null {
  const m = fieldsOf(flat);
  if (!m) return null;
  const what = `Redis outbox entry at key ${JSON.stringify(`${runner.tag}out:r:${m.get("key") ?? key}`)}`;
  const entry = {
    key: m.get("key"),
    chatId: m.get("chatId"),
    content: jsonField(m, "content", what),
    contentHash: m.get("contentHash"),
    inboundId: m.get("inboundId") ?? null,
    state: m.get("state"),
    attempts: numField(m, "attempts"),
    nextAttemptAt: optNum(m, "nextAttemptAt"),
    lease: leaseOf(m),
    fence: numField(m, "fence"),
    called: calledField(m),
    messageId: m.get("messageId") ?? null,
    error: m.get("error") ?? null,
    seq: numField(m, "seq"),
    createdAt: numField(m, "createdAt"),
    updatedAt: numField(m, "updatedAt"),
  };
  const problem = storedOutboxProblem(entry);
  if (problem) throw new Error(`${what}: ${problem}`);
  entry.called = storedCalled(entry.called);
  return entry as OutboxEntry;
}

/** The backend's name, in the damaged records it reports. */
const NAME = "redis";

/**
 * The records of one journal set aside as damaged. The scripts set a record
 * aside as soon as they meet it damaged; these calls list and report them, and
 * set aside one that the scripts found sound but this reader cannot read.
 */
class Aside {
  readonly #r: Runner;
  readonly #journal: "inbox" | "outbox";

  constructor(runner: Runner, journal: "inbox" | "outbox") {
    this.#r = runner;
    this.#journal = journal;
  }

  error(id: string, problem: string): DamagedRecordError {
    return new DamagedRecordError({ journal: this.#journal, id, backend: NAME, problem });
  }

  async list(options: DamagedListOptions | undefined): Promise<DamagedRecord[]> {
    const { unreported, limit } = checkDamagedList(options, `${this.#journal}.damaged`);
    if (limit === 0) return [];
    const flat = strings(
      await this.#r.run(this.#journal === "inbox" ? "inDamaged" : "outDamaged", [unreported ? "1" : "0", String(limit)]),
    );
    const out: DamagedRecord[] = [];
    for (let i = 0; i + 3 < flat.length; i += 4) {
      out.push({
        journal: this.#journal,
        id: flat[i]!,
        backend: NAME,
        problem: flat[i + 1]!,
        setAsideAt: Number(flat[i + 2]),
        reported: flat[i + 3] === "1",
      });
    }
    return out;
  }

  async report(id: string): Promise<boolean> {
    checkId(id, `${this.#journal}.reportDamaged: "id"`);
    const [status] = list(await this.#r.run(this.#journal === "inbox" ? "inReportDamaged" : "outReportDamaged", [id]));
    return status === "ok";
  }

  /**
   * Sets aside the record of `id` read as `flat`, which this reader cannot read, unless it changed since.
   * @returns `"changed"` when it changed since it was read (read it again), else `"ok"`/`"no"`
   */
  async setAside(id: string, flat: unknown, problem: string): Promise<string> {
    const m = fieldsOf(flat) ?? new Map<string, string>();
    const name = this.#journal === "inbox" ? "inSetAside" : "outSetAside";
    const [status] = strings(await this.#r.run(name, [id, problem, m.get("fence") ?? "", m.get("updatedAt") ?? ""]));
    return status ?? "no";
  }

  /** A record of a claim or list reply: parsed, or set aside (a failed set-aside leaves it for a later call). */
  async read<T>(flat: unknown, idField: string, parse: () => T | null): Promise<{ value: T | null; changed: boolean }> {
    try {
      return { value: parse(), changed: false };
    } catch (error) {
      const id = fieldsOf(flat)?.get(idField);
      if (id === undefined) return { value: null, changed: false };
      try {
        await this.setAside(id, flat, messageOf(error));
        return { value: null, changed: true };
      } catch {
        return { value: null, changed: false };
      }
    }
  }

  /** `get`: the reply of the get script as a record, `null`, or a {@link DamagedRecordError}; `undefined`: read it again. */
  async got<T>(id: string, reply: unknown, parse: (flat: unknown) => T | null, last: boolean): Promise<T | null | undefined> {
    const [status, value] = list(reply);
    if (status === undefined) return null;
    if (status === "aside") throw this.error(id, String(value));
    try {
      return parse(value);
    } catch (error) {
      const problem = messageOf(error);
      if ((await this.setAside(id, value, problem)) === "changed" && !last) return undefined;
      throw this.error(id, problem);
    }
  }
}

function leaseArgs(lease: ClaimOptions | undefined): string[] {
  return lease ? ["1", lease.owner, lease.incarnation, String(lease.leaseMs), "0"] : ["0"];
}

function claimArgs(options: ClaimOptions): string[] {
  return [options.owner, options.incarnation, String(options.leaseMs), options.reclaimOwn === true ? "1" : "0"];
}

function listArgs<S extends string>(options: ListOptions<S> | undefined): { args: string[]; limit: number } {
  const { states, chatId, limit } = normalizeList(options);
  const wanted = states === null ? [] : [...states];
  return {
    args: [chatId === undefined ? "0" : "1", chatId ?? "", String(limit), String(wanted.length), ...wanted],
    limit,
  };
}

function finishArgs(outcome: FailOutcome): string[] {
  if (outcome.ambiguous) return ["unknown", outcome.error, "0"];
  return outcome.dead ? ["dead", outcome.error, "0"] : ["retry", outcome.error, String(outcome.retryInMs)];
}

async function purgeAll(runner: Runner, name: "inPurge" | "outPurge", olderThanMs: number): Promise<number> {
  let total = 0;
  for (;;) {
    const [deleted, scanned] = strings(await runner.run(name, [String(olderThanMs), String(PURGE_BATCH)]));
    total += Number(deleted);
    if (Number(scanned) < PURGE_BATCH) return total;
  }
}

/**
 * A list script's records, parsed. One that only this reader finds damaged is set aside, and the list
 * read again (a few times at most: then the records it can read).
 */
async function listRead<T>(
  runner: Runner,
  name: "inList" | "outList",
  args: string[],
  read: (flat: unknown) => Promise<{ value: T | null; changed: boolean }>,
): Promise<T[]> {
  for (let round = 0; ; round++) {
    const out: T[] = [];
    let changed = false;
    for (const flat of list(await runner.run(name, args))) {
      const r = await read(flat);
      if (r.value) out.push(r.value);
      changed ||= r.changed;
    }
    if (!changed || round >= 2) return out;
  }
}

function checkLimit(limit: unknown, op: string): number {
  checkFinite(limit, `${op}: option "limit"`);
  return Math.max(0, Math.floor(limit as number));
}

// ---- journals --------------------------------------------------------------------

class RedisInbox implements InboxJournal {
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
    const leased = state === "processing";
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
    if (limit === 0) return [];
    const out = list(await this.#r.run("inClaimDue", [...claimArgs(options), String(limit)]));
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

class RedisOutbox implements OutboxJournal {
  readonly #r: Runner;
  readonly #aside: Aside;

  constructor(runner: Runner) {
    this.#r = runner;
    this.#aside = new Aside(runner, "outbox");
  }

  async reserve(input: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
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
      ]),
    );
    const [status, flat] = reply;
    if (status === "aside") throw this.#aside.error(e.key, String(flat));
    if (status === "leased" || status === "queued") {
      // A new entry, as the script wrote it: the script answers only what it chose (seq, time, lease).
      const [, seq, at, leaseExp] = strings(reply);
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
        called: false,
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
      await this.#aside.setAside(e.key, flat, messageOf(error));
      throw this.#aside.error(e.key, messageOf(error));
    }
    if (!entry) throw new Error(`Redis outbox.reserve: the entry ${JSON.stringify(e.key)} was not returned`);
    const kind = status === "leased" ? "leased" : status === "queued" ? "queued" : "exists";
    return { status: kind, entry };
  }

  async claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    checkClaim(options, "outbox.claimDue");
    const limit = checkLimit(options.limit, "outbox.claimDue");
    const [due, ambiguous] = list(
      await this.#r.run("outClaimDue", [...claimArgs(options), options.resendAmbiguous === true ? "1" : "0", String(limit)]),
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

// ---- public classes ----------------------------------------------------------------

/**
 * The options objects made by {@link durabilityOn}, with the runner each
 * stands for: the constructor takes that runner instead of making its own.
 */
const sharedRunners = new WeakMap<object, Runner>();

/**
 * A backend over `runner` (for {@link RedisStore.durability}, which shares its
 * client and prefix): the public constructor, given options that stand for `runner`.
 */
function durabilityOn(runner: Runner): RedisDurability {
  const options: RedisDurabilityOptions = { client: null };
  sharedRunners.set(options, runner);
  return new RedisDurability(options);
}

/**
 * A durability backend on Redis: the inbox and outbox journals, shared by
 * many replicas on many hosts (`scope: "shared"`). Every transition is one
 * atomic Lua script with the server's clock and the fencing check inside;
 * due scans read sorted sets of due entries only (and the inbox scan the
 * active records of their chats).
 *
 * An inbox due scan leases in arrival order (`receivedAt`, then admission
 * order) and keeps each chat's order through a failover: it walks the chat's
 * active records from the first, and takes none after one that is
 * `processing` under a live lease held elsewhere (see
 * `InboxJournal.claimDue`). Being one script, two concurrent scans never
 * split a chat. Records of chats held elsewhere do not fill the batch: the
 * pending backlog is read on, page by page, up to `limit + 1000` records a
 * scan. See the module documentation for the clients and the key layout.
 *
 * A damaged record (a hash this library did not write: a payload that is not
 * JSON, an unknown state, …) never fails a call nor stalls its chat: the
 * first call that meets it sets it aside, its hash kept as it is. `list` and
 * due scans go on without it, `get` rejects with a `DamagedRecordError`, and
 * `inbox.damaged()`/`outbox.damaged()` list what was set aside (the bot
 * reports each one once as an `error` event).
 *
 * The backend does not own the client: `open()` checks that Redis answers
 * (and runs Lua), `close()` does nothing; close the client after `bot.stop()`.
 *
 * @example With a TCP client (ioredis)
 * ```ts ignore
 * import Redis from "ioredis";
 * import { Bot } from "@botmesh/durable";
 * import { RedisDurability } from "@botmesh/durable/redis";
 *
 * const client = new Redis(process.env.REDIS_URL!);
 * const bot = new Bot({
 *   provider,
 *   durability: { backend: new RedisDurability({ client, keyPrefix: "shop-bot:" }), instanceId: "bot-1" },
 * });
 * await bot.start();
 * // …
 * await bot.stop();
 * client.disconnect();
 * ```
 *
 * @example With Upstash (edge workers)
 * ```ts ignore
 * import { Redis } from "@upstash/redis";
 * import { RedisDurability } from "@botmesh/durable/redis";
 *
 * const backend = new RedisDurability({ client: Redis.fromEnv(), keyPrefix: "shop-bot:" });
 * await backend.open();
 * const id = crypto.randomUUID();
 * await backend.inbox.admit({ id, kind: "message", chatId: "c1", provider: "test", payload: { text: "hi" }, receivedAt: Date.now() });
 * const record = await backend.inbox.claim(id, { owner: "edge-1", incarnation: "a", leaseMs: 60_000 });
 * await backend.inbox.complete(id, record!.lease!.token);
 * console.log((await backend.inbox.get(id))?.state); // "done"
 * ```
 */
export class RedisDurability implements DurabilityBackend {
  /** Always `'redis'`. */
  readonly name: string = "redis";
  /** Shared by many replicas on many hosts. */
  readonly scope: "shared" = "shared";
  /** The inbound journal. */
  readonly inbox: InboxJournal & DamagedRecords;
  /** The outbound journal. */
  readonly outbox: OutboxJournal & DamagedRecords;
  /** The key prefix (inside the hash tag: keys start with `{keyPrefix}`). */
  readonly keyPrefix: string;
  readonly #runner: Runner;

  /**
   * @param options `client` (required), `keyPrefix`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: RedisDurabilityOptions) {
    const runner = sharedRunners.get(options) ?? new Runner(resolveOptions(options, "RedisDurability"));
    this.#runner = runner;
    this.keyPrefix = runner.keyPrefix;
    this.inbox = new RedisInbox(runner);
    this.outbox = new RedisOutbox(runner);
  }

  /**
   * Checks that Redis answers and runs the backend's scripts (loading them when needed).
   * @throws {Error} naming the key prefix and the client's error when it does not
   */
  async open(): Promise<void> {
    await this.#runner.now();
  }

  /** Nothing to release: the client is the caller's. */
  async close(): Promise<void> {}

  /**
   * The server's clock.
   * @returns ms since epoch by Redis `TIME`
   */
  now(): Promise<number> {
    return this.#runner.now();
  }
}

/**
 * The bot's session store on Redis: JSON values under `{keyPrefix}s:<key>`,
 * with an optional time to live (`SET … PX`, expired by Redis itself).
 * `durability()` journals the inbox and outbox with the same client and
 * prefix.
 *
 * @example
 * ```ts ignore
 * import Redis from "ioredis";
 * import { RedisStore } from "@botmesh/durable/redis";
 *
 * const store = new RedisStore({ client: new Redis(), keyPrefix: "shop-bot:" });
 * await store.set("chat:1", { step: 2 }, { ttlMs: 60_000 });
 * console.log(await store.get("chat:1")); // { step: 2 }
 * const backend = store.durability(); // give it to the Bot
 * ```
 */
export class RedisStore implements SessionStore {
  /** The key prefix. */
  readonly keyPrefix: string;
  readonly #runner: Runner;
  #durability: RedisDurability | null = null;

  /**
   * @param options `client` (required), `keyPrefix`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: RedisStoreOptions) {
    this.#runner = new Runner(resolveOptions(options, "RedisStore"));
    this.keyPrefix = this.#runner.keyPrefix;
  }

  /**
   * The durability backend over the same client and key prefix (one instance per store).
   * @returns the backend
   */
  durability(): RedisDurability {
    if (!this.#durability) {
      this.#durability = durabilityOn(this.#runner);
    }
    return this.#durability;
  }

  /**
   * @param key the session key
   * @returns the value of `key`, or `undefined` when absent or expired
   * @throws {Error} naming the key when the stored value is not JSON
   */
  async get(key: string): Promise<JsonValue | undefined> {
    checkId(key, `Session key`);
    const [raw] = list(await this.#runner.run("storeGet", [key]));
    if (raw === undefined) return undefined;
    try {
      return JSON.parse(String(raw)) as JsonValue;
    } catch (error) {
      throw new Error(
        `Redis session value at key ${JSON.stringify(`${this.#runner.tag}s:${key}`)} is not JSON (${messageOf(error)})`,
      );
    }
  }

  /**
   * Stores `value` (JSON); with `ttlMs` it expires after that many ms.
   * @throws {RangeError} when `ttlMs` is not a positive number
   * @throws {TypeError} when `value` is not JSON
   */
  async set(key: string, value: JsonValue, options?: { ttlMs?: number }): Promise<void> {
    const { text, ttlMs: ttl } = sessionEntry(key, value, options);
    await this.#runner.run("storeSet", [key, text, ttl === null ? "" : String(Math.ceil(ttl))]);
  }

  /** Deletes `key`. */
  async delete(key: string): Promise<void> {
    checkId(key, `Session key`);
    await this.#runner.run("storeDelete", [key]);
  }
}

function byteCompare(a: string, b: string): number {
  const x = new TextEncoder().encode(a);
  const y = new TextEncoder().encode(b);
  const n = Math.min(x.length, y.length);
  for (let i = 0; i < n; i++) if (x[i] !== y[i]) return x[i]! - y[i]!;
  return x.length - y.length;
}

/**
 * A {@link DurableKv} on Redis: versioned compare-and-set in one script per
 * call. A version is a number from one counter per key prefix, so it is never
 * reused (not even after a delete); `list` is in byte order (a sorted set
 * read `BYLEX`); `now()` is Redis `TIME`. Use it with `new KvDurability(kv)` or
 * as the shared outbox of `new EventsDurability({ journal, outbox: kv })`.
 *
 * @example
 * ```ts ignore
 * import Redis from "ioredis";
 * import { KvDurability } from "@botmesh/durable/kv";
 * import { RedisKv } from "@botmesh/durable/redis";
 *
 * const kv = new RedisKv({ client: new Redis(), keyPrefix: "shop-bot-kv:" });
 * const version = await kv.set("a", { n: 1 }, null); // create
 * console.log(await kv.set("a", { n: 2 }, version)); // a new version
 * const backend = new KvDurability(kv);
 * ```
 */
export class RedisKv implements DurableKv {
  /** Always `'redis'`. */
  readonly name: string = "redis";
  /** Shared by many hosts. */
  readonly scope: BackendScope = "shared";
  /** The key prefix. */
  readonly keyPrefix: string;
  readonly #runner: Runner;

  /**
   * @param options `client` (required), `keyPrefix`
   * @throws {TypeError|RangeError} naming the option when one is invalid
   */
  constructor(options: RedisKvOptions) {
    this.#runner = new Runner(resolveOptions(options, "RedisKv"));
    this.keyPrefix = this.#runner.keyPrefix;
  }

  #value(key: string, raw: unknown): JsonValue {
    try {
      return JSON.parse(String(raw)) as JsonValue;
    } catch (error) {
      throw new Error(
        `Redis kv value at key ${JSON.stringify(`${this.#runner.tag}kv:r:${key}`)}: field "v" is not JSON (${messageOf(error)})`,
      );
    }
  }

  /**
   * @param key the key
   * @returns its value and version, or `null`
   */
  async get(key: string): Promise<KvEntry | null> {
    checkId(key, `kv.get: "key"`);
    const r = list(await this.#runner.run("kvGet", [key]));
    if (r.length < 2) return null;
    return { key, value: this.#value(key, r[0]), version: String(r[1]) };
  }

  /**
   * Writes `value` if the current version is `expectVersion` (`null`: the key
   * must not exist; `undefined`: unconditional).
   * @returns the new version, or `null` when the condition failed
   * @throws {TypeError} when `value` is not JSON
   */
  async set(key: string, value: JsonValue, expectVersion?: string | null): Promise<string | null> {
    checkId(key, `kv.set: "key"`);
    if (expectVersion !== undefined && expectVersion !== null) checkString(expectVersion, `kv.set: "expectVersion"`);
    let text: string | undefined;
    try {
      text = JSON.stringify(value);
    } catch (error) {
      throw new TypeError(`kv.set: the value of ${JSON.stringify(key)} is not JSON: ${messageOf(error)}`, { cause: error });
    }
    if (text === undefined) throw new TypeError(`kv.set: the value of ${JSON.stringify(key)} is not JSON, got ${show(value)}`);
    const mode = expectVersion === undefined ? "any" : expectVersion === null ? "absent" : "match";
    const [version] = list(await this.#runner.run("kvSet", [key, text, mode, expectVersion ?? ""]));
    return version === undefined ? null : String(version);
  }

  /**
   * Deletes `key` if its version is `expectVersion` (unconditional when `undefined`).
   * @returns whether a key was deleted
   */
  async delete(key: string, expectVersion?: string): Promise<boolean> {
    checkId(key, `kv.delete: "key"`);
    if (expectVersion !== undefined) checkString(expectVersion, `kv.delete: "expectVersion"`);
    const [done] = list(
      await this.#runner.run("kvDelete", [key, expectVersion === undefined ? "0" : "1", expectVersion ?? ""]),
    );
    return String(done) === "1";
  }

  /**
   * Keys starting with `prefix`, in byte order, after `after` when given, at most `limit`.
   * @returns the entries
   */
  async list(prefix: string, options?: { after?: string; limit?: number }): Promise<KvEntry[]> {
    checkString(prefix, `kv.list: "prefix"`);
    const after = options?.after;
    if (after !== undefined) checkString(after, `kv.list: option "after"`);
    const limitOpt = options?.limit;
    if (limitOpt !== undefined) checkFinite(limitOpt, `kv.list: option "limit"`);
    const limit = limitOpt === undefined ? -1 : Math.max(0, Math.floor(limitOpt));
    if (limit === 0) return [];
    const start = after !== undefined && byteCompare(after, prefix) >= 0
      ? `(${after}`
      : prefix === ""
      ? "-"
      : `[${prefix}`;
    const flat = list(await this.#runner.run("kvList", [start, prefix, String(limit)]));
    const out: KvEntry[] = [];
    for (let i = 0; i + 2 < flat.length; i += 3) {
      const key = String(flat[i]);
      out.push({ key, value: this.#value(key, flat[i + 1]), version: String(flat[i + 2]) });
    }
    return out;
  }

  /** @returns the server's clock (ms since epoch, Redis `TIME`) */
  now(): Promise<number> {
    return this.#runner.now();
  }
}
