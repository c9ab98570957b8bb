/**
 * `new EventsDurability({ journal })`: a durability backend whose inbox records
 * are events of an app's {@link LeasedEventJournal}, so that the app's
 * `list()` and `replay()` see the bot's inbound messages too.
 *
 * @module
 */
import { copyClaim, isEmptyClaim, ScanAnswers } from "../../src/scan_answers.ts";
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
  type ListOptions,
  type NewInboundRecord,
  type NewOutboxEntry,
  type OutboxClaim,
  type OutboxEntry,
  type OutboxJournal,
  type OutboxState,
  type ReserveResult,
} from "../../src/contract.ts";
import { checkClaim, checkFinite, checkId, checkNewInbound, checkOutcome, matchesList, normalizeList } from "../../src/rules.ts";
import { showValue as show } from "../../src/show.ts";
import { describeJsonKind } from "../../src/stored_records.ts";
import { MAX_STORED_DEPTH, nestsDeeperThan } from "../../src/content.ts";
import { KvDurability } from "../kv/durability.ts";
import {
  BOT_CHANNEL,
  DamagedEventError,
  type EventRecord,
  INBOUND_INTERACTION_EVENT,
  INBOUND_MESSAGE_EVENT,
  LEASED_EVENT_JOURNAL_METHODS,
  type LeasedEventJournal,
  type NewEventRecord,
} from "../../src/events/types.ts";

/** Options of {@link EventsDurability}. */
export interface EventsDurabilityOptions {
  /** The events journal, opened by the caller (and closed by the caller after `bot.stop()`). */
  journal: LeasedEventJournal;
  /**
   * Where the outbox lives: a {@link DurableKv} (the outbox of `new KvDurability(kv)`,
   * e.g. a Postgres or Redis kv for heavy traffic), or absent: the journal's
   * own sidecar (`journal.outbox`, same file and same atomic write).
   */
  outbox?: DurableKv;
}

/**
 * The payload of a bot inbox record in the events journal (channel
 * {@link BOT_CHANNEL}, eventType {@link INBOUND_MESSAGE_EVENT} or
 * {@link INBOUND_INTERACTION_EVENT}, `createdAt` = the record's `receivedAt`,
 * `orderKey` = its `chatId`, id = the record's id). Every other field of the inbox record (state,
 * attempts, lease, fence, error, …) is the event's own.
 */
export interface InboundEventPayload {
  /** Room for other JSON fields (none are written). */
  [key: string]: JsonValue;
  /** The chat the message came from. */
  chatId: string;
  /** The provider's name. */
  provider: string;
  /** The inbound message (the inbox record's `payload`). */
  message: JsonValue;
}

/**
 * The event that journals inbox record `record` (see {@link InboundEventPayload}).
 *
 * @param record a checked inbox record
 * @returns the event to append
 */
export function inboundToEvent(record: NewInboundRecord): NewEventRecord {
  const payload: InboundEventPayload = { chatId: record.chatId, provider: record.provider, message: record.payload };
  return {
    id: record.id,
    channel: BOT_CHANNEL,
    orderKey: record.chatId, // the journal keeps each chat's order through a failover
    eventType: record.kind === "interaction" ? INBOUND_INTERACTION_EVENT : INBOUND_MESSAGE_EVENT,
    payload,
    createdAt: record.receivedAt,
  };
}

/** Why an event of the bot's channel is not an inbox record (naming the field), or `null` when it is one. */
function inboundProblem(event: EventRecord): string | null {
  if (event.eventType !== INBOUND_MESSAGE_EVENT && event.eventType !== INBOUND_INTERACTION_EVENT) {
    return `field "eventType" is ${JSON.stringify(event.eventType)}, not an inbound record's ` +
      `(${INBOUND_MESSAGE_EVENT} or ${INBOUND_INTERACTION_EVENT})`;
  }
  const p = event.payload;
  if (typeof p !== "object" || p === null || Array.isArray(p)) {
    return `field "payload" must be an object { chatId, provider, message }, got ${describeJsonKind(p)}`;
  }
  for (const field of ["chatId", "provider"]) {
    if (typeof p[field] !== "string") return `field "payload.${field}" must be a string, got ${describeJsonKind(p[field])}`;
  }
  if (nestsDeeperThan(p.message, MAX_STORED_DEPTH)) {
    return `field "payload.message" must be a JSON value nested at most ${MAX_STORED_DEPTH} levels deep (MAX_STORED_DEPTH)`;
  }
  return null;
}

/**
 * The inbox record an event holds, or `null` when the event is not one of
 * the bot's inbox records (another channel or eventType, or a payload
 * without `chatId` / `provider`).
 *
 * @param event an event of the journal
 * @returns the inbox record
 */
export function eventToInbound(event: EventRecord): InboundRecord | null {
  if (event.channel !== BOT_CHANNEL || inboundProblem(event) !== null) return null;
  const kind = event.eventType === INBOUND_MESSAGE_EVENT ? "message" : "interaction";
  const p = event.payload as InboundEventPayload;
  return {
    id: event.id,
    kind,
    chatId: p.chatId,
    provider: p.provider,
    payload: p.message === undefined ? null : p.message,
    receivedAt: event.createdAt,
    state: event.state,
    attempts: event.attempts,
    nextAttemptAt: event.nextAttemptAt,
    lease: event.lease,
    fence: event.fence,
    error: event.error,
    updatedAt: event.updatedAt,
  };
}

/** Receipt order: `receivedAt`, then the journal's order. */
function byReceipt(a: InboundRecord, b: InboundRecord): number {
  return a.receivedAt - b.receivedAt;
}

/** A damaged-record error of `backend`: the same, under the name of the backend that holds it. */
function renamed(error: unknown, backend: string): unknown {
  if (!(error instanceof DamagedRecordError) || error.backend === backend) return error;
  return new DamagedRecordError({ journal: error.journal, id: error.id, backend, problem: error.problem });
}

/** The inbox of {@link EventsDurability}: the journal's records in {@link BOT_CHANNEL}. */
class EventsInbox implements InboxJournal, DamagedRecords {
  readonly #journal: LeasedEventJournal;
  readonly #inboxAnswers = new ScanAnswers<InboundRecord[]>(() => [], (a) => a.length === 0);
  /** The backend's name, in damaged records. */
  readonly #backend: string;

  constructor(journal: LeasedEventJournal, backend: string) {
    this.#journal = journal;
    this.#backend = backend;
  }

  /**
   * Sets aside an event of the bot's channel that is not an inbox record
   * (written there by someone else, or damaged), so that the bot's sweep does
   * not take it again and again. A journal without `setAside` (an earlier
   * contract) gets a claimed one made `dead`, as before.
   */
  async #setAside(event: EventRecord, problem: string): Promise<void> {
    if (this.#journal.setAside !== undefined) await this.#journal.setAside(event.id, problem).catch(() => {});
    else if (event.lease) await this.#journal.fail(event.id, event.lease.token, { error: problem, dead: true }).catch(() => {});
  }

  #damagedError(id: string, problem: string): DamagedRecordError {
    return new DamagedRecordError({ journal: "inbox", id, backend: this.#backend, problem });
  }

  /** Maps claimed events to inbox records; one that is not an inbox record is set aside. */
  async #mapClaimed(events: EventRecord[]): Promise<InboundRecord[]> {
    const out: InboundRecord[] = [];
    for (const event of events) {
      const record = eventToInbound(event);
      if (record) out.push(record);
      else await this.#setAside(event, inboundProblem(event) ?? `field "channel" is not ${JSON.stringify(BOT_CHANNEL)}`);
    }
    return out;
  }

  async admit(record: NewInboundRecord, lease?: ClaimOptions): Promise<InboundRecord | null> {
    if (lease !== undefined) checkClaim(lease, "inbox.admit");
    const input = checkNewInbound(record);
    const event = await this.#journal.append(inboundToEvent(input), lease);
    if (event) return eventToInbound(event);
    // A redelivery is a duplicate; an app event that has the message's id is not, and must not swallow it.
    let existing: { channel: string | null; eventType: string } | null;
    try {
      existing = await this.#journal.get(input.id);
    } catch (error) {
      if (!(error instanceof DamagedEventError)) throw error;
      // A record set aside as damaged keeps its id: a redelivery is a duplicate of it, unless it is an app's.
      if (error.channel === undefined || error.channel === BOT_CHANNEL) return null;
      existing = { channel: error.channel, eventType: "(damaged)" };
    }
    if (existing !== null && existing.channel !== BOT_CHANNEL) {
      throw new Error(
        `Inbound ${input.kind} ${JSON.stringify(input.id)} cannot be journaled: ${this.#journal.name} already holds ` +
          `an app event with that id (channel ${JSON.stringify(existing.channel)}, eventType ` +
          `${JSON.stringify(existing.eventType)}); give the app's events ids of their own`,
      );
    }
    return null;
  }

  async claim(id: string, options: ClaimOptions): Promise<InboundRecord | null> {
    checkId(id, `inbox.claim: "id"`);
    checkClaim(options, "inbox.claim");
    const event = await this.#journal.claim(id, { ...options, channel: BOT_CHANNEL });
    if (!event) return null;
    const [record] = await this.#mapClaimed([event]);
    return record ?? null;
  }

  async claimDue(options: ClaimDueOptions): Promise<InboundRecord[]> {
    checkClaim(options, "inbox.claimDue");
    checkFinite(options.limit, `inbox.claimDue: option "limit"`);
    const { requestId: _, repeat: __, ...scan } = options;
    return await this.#inboxAnswers.answer(
      options,
      async () => this.#mapClaimed(await this.#journal.claimDue({ ...scan, channel: BOT_CHANNEL })),
      (a) => structuredClone(a),
    );
  }

  async heartbeat(id: string, token: number, leaseMs: number): Promise<boolean> {
    checkId(id, `inbox.heartbeat: "id"`);
    return await this.#journal.heartbeat(id, token, leaseMs);
  }

  async start(id: string, token: number, attempt: number): Promise<boolean> {
    checkId(id, `inbox.start: "id"`);
    return await this.#journal.start(id, token, attempt);
  }

  async schedule(id: string, token: number, dueInMs: number): Promise<void> {
    checkId(id, `inbox.schedule: "id"`);
    return await this.#journal.schedule(id, token, dueInMs);
  }

  async complete(id: string, token: number): Promise<void> {
    checkId(id, `inbox.complete: "id"`);
    return await this.#journal.complete(id, token);
  }

  async fail(id: string, token: number, outcome: FailOutcome): Promise<void> {
    checkId(id, `inbox.fail: "id"`);
    checkOutcome(outcome, "inbox.fail"); // named as the inbox's (an ambiguous outcome is refused: no unknown state)
    return await this.#journal.fail(id, token, outcome);
  }

  async get(id: string): Promise<InboundRecord | null> {
    checkId(id, `inbox.get: "id"`);
    let event: EventRecord | null;
    try {
      event = await this.#journal.get(id);
    } catch (error) {
      if (!(error instanceof DamagedEventError)) throw error;
      if (error.channel !== undefined && error.channel !== BOT_CHANNEL) return null; // an app's
      throw this.#damagedError(id, error.problem);
    }
    if (event === null || event.channel !== BOT_CHANNEL) return null;
    const problem = inboundProblem(event);
    if (problem === null) return eventToInbound(event);
    if (this.#journal.setAside === undefined) return null;
    await this.#setAside(event, problem);
    throw this.#damagedError(id, problem);
  }

  async damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    if (options !== undefined && (typeof options !== "object" || options === null)) {
      throw new TypeError(`inbox.damaged: the options must be an object, got ${show(options)}`);
    }
    if (this.#journal.damaged === undefined) return [];
    const found = await this.#journal.damaged({ ...options, channel: BOT_CHANNEL });
    return found.map(({ id, problem, setAsideAt, reported }) => ({ journal: "inbox", id, backend: this.#backend, problem, setAsideAt, reported }));
  }

  async reportDamaged(id: string): Promise<boolean> {
    checkId(id, `inbox.reportDamaged: "id"`);
    return (await this.#journal.reportDamaged?.(id, { channel: BOT_CHANNEL })) ?? false;
  }

  async list(options?: ListOptions<InboundState>): Promise<InboundRecord[]> {
    const filter = normalizeList(options);
    if (filter.limit === 0) return [];
    const events = await this.#journal.list({
      channel: BOT_CHANNEL,
      state: filter.states === null ? undefined : [...filter.states],
      limit: Number.MAX_SAFE_INTEGER,
    });
    const records: InboundRecord[] = [];
    for (const event of events) {
      const record = eventToInbound(event);
      if (record === null) await this.#setAside(event, inboundProblem(event)!);
      else if (matchesList(record, filter)) records.push(record);
    }
    records.sort(byReceipt); // stable: append order on ties
    return records.slice(0, filter.limit);
  }

  async replay(id: string): Promise<boolean> {
    checkId(id, `inbox.replay: "id"`);
    // The channel of a record never changes: only the bot's records are replayed here.
    const event = await this.#journal.get(id).catch((error) => {
      if (error instanceof DamagedEventError) return null; // set aside: nothing changes
      throw error;
    });
    if (!event || eventToInbound(event) === null) return false;
    return this.#journal.replay(id);
  }

  purge(olderThanMs: number): Promise<number> {
    return this.#journal.purge(olderThanMs, { channel: BOT_CHANNEL });
  }
}

/** The outbox of {@link EventsDurability}: the journal's sidecar or a kv's, its damaged entries named as this backend's. */
class EventsOutbox implements OutboxJournal, DamagedRecords {
  readonly #inner: OutboxJournal;
  readonly #backend: string;

  readonly #answers = new ScanAnswers<OutboxClaim>(() => ({ due: [], ambiguous: [] }), isEmptyClaim);

  readonly #innerAnswersRepeats: boolean;

  constructor(inner: OutboxJournal, backend: string, innerAnswersRepeats: boolean) {
    this.#inner = inner;
    this.#innerAnswersRepeats = innerAnswersRepeats;
    this.#backend = backend;
  }

  reserve(entry: NewOutboxEntry, lease?: ClaimOptions): Promise<ReserveResult> {
    return this.#inner.reserve(entry, lease).catch((error) => Promise.reject(renamed(error, this.#backend)));
  }
  claimDue(options: ClaimDueOptions & { resendAmbiguous?: boolean }): Promise<OutboxClaim> {
    // A kv's outbox answers repeats itself (with what it had confirmed when a scan failed); a sidecar here.
    if (this.#innerAnswersRepeats) return this.#inner.claimDue(options);
    const { requestId: _, repeat: __, ...scan } = options;
    return this.#answers.answer(options, () => this.#inner.claimDue(scan), copyClaim);
  }
  heartbeat(key: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#inner.heartbeat(key, token, leaseMs);
  }
  markCalling(key: string, token: number, leaseMs: number): Promise<boolean> {
    return this.#inner.markCalling(key, token, leaseMs);
  }
  markSent(key: string, token: number, messageId: string): Promise<void> {
    return this.#inner.markSent(key, token, messageId);
  }
  markFailed(key: string, token: number, outcome: FailOutcome): Promise<void> {
    return this.#inner.markFailed(key, token, outcome);
  }
  get(key: string): Promise<OutboxEntry | null> {
    return this.#inner.get(key).catch((error) => Promise.reject(renamed(error, this.#backend)));
  }
  list(options?: ListOptions<OutboxState>): Promise<OutboxEntry[]> {
    return this.#inner.list(options);
  }
  retry(key: string): Promise<boolean> {
    return this.#inner.retry(key);
  }
  discard(key: string): Promise<boolean> {
    return this.#inner.discard(key);
  }
  purge(olderThanMs: number): Promise<number> {
    return this.#inner.purge(olderThanMs);
  }
  async damaged(options?: DamagedListOptions): Promise<DamagedRecord[]> {
    if (this.#inner.damaged === undefined) return [];
    return (await this.#inner.damaged(options)).map((record) => ({ ...record, backend: this.#backend }));
  }
  async reportDamaged(key: string): Promise<boolean> {
    return (await this.#inner.reportDamaged?.(key)) ?? false;
  }
}

/**
 * A durability backend over an events journal: inbox records are events in
 * channel {@link BOT_CHANNEL} with eventType {@link INBOUND_MESSAGE_EVENT} or
 * {@link INBOUND_INTERACTION_EVENT} and the payload
 * {@link InboundEventPayload}; the bot claims in that channel only, so a
 * `journal.replay(id)` of one of them is picked up by the bot's next sweep,
 * and an `EventWorker` (which never claims that channel) never takes them.
 * The inbox's `list`/`get` see only the bot's records. Each record's
 * `orderKey` is its chat id, so the journal's due scans keep each chat's
 * order as `InboxJournal.claimDue` says (records journaled by an earlier
 * version have no key: they are claimed without it), and a leased `admit`
 * is the journal's leased `append`: journaled `pending` while a record of its
 * chat comes first, as `InboxJournal.admit` says. An inbound id already
 * used by an app event makes `admit` throw (the bot then fails closed and the
 * channel redelivers), rather than take the message for a duplicate.
 *
 * Damaged records: an event the journal set aside as damaged (see
 * `DamagedEvent`: its stored form is not a record) is, if it is in the bot's
 * channel (or its channel cannot be read), a damaged inbox record: listed by
 * `inbox.damaged()` and reported once by the bot, `get` rejects with a
 * `DamagedRecordError`, due scans neither take it nor let it hold back its
 * chat, and a redelivery of its id is a duplicate. An event of the bot's
 * channel that is a valid event but not an inbox record (another eventType,
 * or a payload without `chatId` / `provider`: written there by someone else,
 * or damaged) is set aside the same way by the first `claimDue`, `claim`,
 * `list` or `get` of the inbox that meets it (`journal.setAside`; a journal
 * without it gets a claimed one made `dead`, as before). The outbox's damaged
 * entries are its own (the sidecar's, or the kv backend's), named as this
 * backend's.
 *
 * The outbox is the journal's sidecar (`journal.outbox`), or the outbox of
 * `new KvDurability(options.outbox)` when a {@link DurableKv} is given.
 *
 * The journal belongs to the caller: `open()` and `close()` do nothing to it
 * (close the journal after `bot.stop()`); once it is closed, every operation
 * rejects with the journal's error.
 *
 * @param options.journal the events journal (already opened)
 * @param options.outbox a DurableKv for the outbox instead of the journal's sidecar
 * @throws {TypeError} when an option has the wrong type
 *
 * @example
 * ```ts
 * import { EventsDurability, MemoryEventJournal } from "@botmesh/durable/events";
 *
 * const journal = new MemoryEventJournal();
 * const backend = new EventsDurability({ journal });
 * // new Bot({ provider, durability: { backend } }); … await bot.stop(); await journal.close();
 * ```
 */
export class EventsDurability implements DurabilityBackend {
  /** `events(<journal.name>)`. */
  readonly name: string;
  /** The journal's scope. */
  readonly scope: BackendScope;
  /** The inbox: the journal's bot channel. */
  readonly inbox: InboxJournal;
  /** The outbox: the journal's sidecar or the given kv's. */
  readonly outbox: OutboxJournal;

  constructor(options: EventsDurabilityOptions) {
    if (typeof options !== "object" || options === null) {
      throw new TypeError(`EventsDurability options must be an object, got ${show(options)}`);
    }
    checkKnownOptions(options, ["journal", "outbox"], "EventsDurability option");
    const journal = options.journal;
    if (
      typeof journal !== "object" || journal === null || typeof journal.claimDue !== "function" ||
      typeof journal.append !== "function" || typeof journal.name !== "string"
    ) {
      throw new TypeError(`EventsDurability option "journal" must be a LeasedEventJournal, got ${show(journal)}`);
    }
    const missing = LEASED_EVENT_JOURNAL_METHODS.find((name) => typeof (journal as unknown as Record<string, unknown>)[name] !== "function");
    if (missing !== undefined) {
      throw new TypeError(`EventsDurability option "journal": ${journal.name} has no method "${missing}" of a LeasedEventJournal`);
    }
    if ((journal as { locked?: unknown }).locked === false) {
      // Without the pid lock a second process could open the file and overwrite the bot's records.
      throw new TypeError(
        `EventsDurability option "journal": ${journal.name} was opened without a lock; ` +
          `open it with { lock: true } to use it for the bot's durability`,
      );
    }
    const kv = options.outbox;
    if (kv !== undefined && (typeof kv !== "object" || kv === null || typeof kv.set !== "function" || typeof kv.list !== "function")) {
      throw new TypeError(`EventsDurability option "outbox" must be a DurableKv, got ${show(kv)}`);
    }
    let outbox: OutboxJournal;
    if (kv !== undefined) {
      outbox = new KvDurability(kv).outbox;
    } else {
      if (typeof journal.outbox !== "object" || journal.outbox === null) {
        throw new TypeError(`EventsDurability: journal ${JSON.stringify(journal.name)} has no outbox sidecar; pass option "outbox"`);
      }
      outbox = journal.outbox;
    }
    this.name = `events(${journal.name})`;
    this.scope = journal.scope;
    this.inbox = new EventsInbox(journal, this.name);
    this.outbox = new EventsOutbox(outbox, this.name, kv !== undefined);
  }

  /** Nothing to open: the caller opened the journal. */
  async open(): Promise<void> {}

  /** Nothing to close: the caller closes the journal after `bot.stop()`. */
  async close(): Promise<void> {}
}
