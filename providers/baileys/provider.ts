/**
 * BaileysProvider: the bot's provider over the user's Baileys socket
 * (`makeWASocket`): `messages.upsert` journaled, sends through the outbox
 * with a message id derived from the outbox key, receipts settling
 * ambiguous sends, media loaded again on reprocess, and a socket swapped on
 * every reconnect ({@link BaileysProvider.attach}).
 *
 * @module
 */
import { BoundedMap } from "../../src/bounded_map.ts";
import { UnencodableContentError } from "../../src/content.ts";
import { ProviderError } from "../../src/errors.ts";
import { type LoadedMedia, type MediaLoadContext, MediaSeal, MediaUnavailableError, type StoredMediaRef } from "../../src/media.ts";
import {
  classifyProviderError,
  type ErrorClassification,
  type InboundMessage,
  type InboundSink,
  type OutboundContent,
  type Provider,
  type SendConfirmation,
  type SendContext,
  type SendInQuestion,
  type SendReceipt,
} from "../../src/provider.ts";
import { sha256Hex } from "../../src/sha256_hex.ts";
import { showValue as show } from "../../src/show.ts";
import { baileysStatusOf, classifyBaileysError } from "./errors.ts";
import {
  type BaileysMediaRef,
  fromBase64,
  isObj,
  MEDIA_KINDS,
  messageKeyId,
  type SkipReason,
  skipReason,
  toInbound,
  toJson,
} from "./messages.ts";
import {
  BAILEYS_STATUS,
  type BaileysConnectionUpdate,
  type BaileysMessageUpdate,
  type BaileysReceiptUpdate,
  type BaileysSocketLike,
  type BaileysUpsert,
  type BaileysWAMessage,
} from "./socket.ts";

/** Options of {@link BaileysProvider}. */
export interface BaileysProviderOptions {
  /** The socket to start with; {@link BaileysProvider.attach} gives it (and every later one) too. */
  socket?: BaileysSocketLike;
  /** The provider's name, journaled with every inbound record (default `"baileys"`). */
  name?: string;
  /** The account (default: the socket's `user.id` without its device, when known at construction). */
  connectionId?: string;
  /**
   * The HMAC key sealing media references in the journal (at least 16 bytes). Default: one derived
   * from the name, which detects a damaged reference but not a forged one: give a secret.
   */
  mediaKey?: string | Uint8Array;
  /**
   * Download an inbound message's media for `loadMediaOf(ctx)`: Baileys'
   * `downloadMediaMessage(message, "buffer", {}, { logger, reuploadRequest: sock.updateMediaMessage })`.
   * Gets a `WAMessage` rebuilt from the journal (the key and the media node, bytes as `Uint8Array`).
   */
  downloadMedia?: (message: BaileysWAMessage, context: { signal?: AbortSignal }) => Promise<Uint8Array>;
  /**
   * The `messages.upsert` types handled, a non-empty list of `"notify"` and `"append"` (default both): Baileys emits the
   * messages WhatsApp queued while the socket was away (the offline replay) as `append`.
   */
  upsertTypes?: readonly string[];
  /**
   * How long `sendMessage` may take before the send is held as ambiguous (default 180 000 ms, well above
   * Baileys' 60 s query timeout; at most 2^31−1). A `sendMessage` cut off is still watched: its late outcome settles the send.
   */
  sendTimeoutMs?: number;
  /** Turn the bot's content into Baileys' `AnyMessageContent` (default: a string is `{ text }`, an object goes as it is). */
  prepareContent?: (content: OutboundContent, chatId: string) => unknown;
  /** Told of every upserted message the bot does not get, with why. */
  onSkipped?: (message: BaileysWAMessage, reason: SkipReason) => void;
  /** Errors no caller sees (default: the bot's `error` event, or `console.warn` before the bot starts). */
  onError?: (error: Error) => void;
}

/** How long a send waits, without spending an attempt, while no socket is open. */
export const DISCONNECTED_WAIT_MS = 1_000;
/** How many sockets the provider listens to: the current one and the latest previous ones (a dying socket may still emit). */
export const KEPT_SOCKETS = 4;
/** Receipts and keys remembered (the latest ones). */
const REMEMBERED = 10_000;
/** setTimeout's largest delay. */
const MAX_TIMER_MS = 2 ** 31 - 1;
/** How long `confirm` waits for a cut-off `sendMessage` to tell how it ended (the bot waits 10 s for the answer). */
const CONFIRM_WAIT_MS = 5_000;
/** Default of `sendTimeoutMs`: well above Baileys' own query timeout (`defaultQueryTimeoutMs`, 60 s), so a query before the relay fails first. */
const DEFAULT_SEND_TIMEOUT_MS = 180_000;
/** Backoff of an admission the journal refused: first and largest wait. */
const ADMIT_RETRY_MS = [250, 30_000] as const;

const OPTION_NAMES = new Set([
  "socket",
  "name",
  "connectionId",
  "mediaKey",
  "downloadMedia",
  "upsertTypes",
  "sendTimeoutMs",
  "prepareContent",
  "onSkipped",
  "onError",
]);

/**
 * The WhatsApp message id a send of outbox key `key` goes out with: `3EB0`
 * and 36 hex digits of the key's SHA-256 (the form of Baileys'
 * `generateMessageID`). The same key always gives the same id, so a delivery
 * receipt names the send it settles, even after a restart.
 *
 * @param key the outbox idempotency key
 * @returns the message id
 */
export async function baileysMessageIdFor(key: string): Promise<string> {
  return `3EB0${(await sha256Hex(`botmesh/baileys/v1/${key}`)).slice(0, 36).toUpperCase()}`;
}

/**
 * A provider over a Baileys socket.
 *
 * Inbound: every `messages.upsert` of type `notify` or `append` is read; a
 * user's message (not `fromMe`, not `status@broadcast`, not a stub or a
 * protocol message) is handed to the bot with its key (`remoteJid,fromMe,id`)
 * as id, so a redelivery is a duplicate. Messages of one chat reach the bot in
 * the order Baileys emitted them, without waiting for each other's journal
 * write. Baileys has already acknowledged the message to WhatsApp when it
 * emits it, so a refused admission is retried here (with backoff) until the
 * journal takes it, and one refused for good (content the journal cannot
 * encode, the bot's inbound checks) is handed over again as `unreadable`, to be
 * journaled and dead-lettered; messages that come while the bot is stopped wait
 * in memory for `start`, each chat in its order.
 *
 * Outbound: `sock.sendMessage(chatId, content, { messageId })`, the id derived
 * from the outbox key ({@link baileysMessageIdFor}). A receipt
 * (`messages.update` status ≥ `SERVER_ACK`, or `message-receipt.update`) for
 * that id, or one merged into the echo of our own send, calls
 * `sink.confirmSent`, which settles a send left ambiguous; a `sendMessage` cut
 * off by `sendTimeoutMs` is still watched, and its late outcome settles it too.
 */
export class BaileysProvider implements Provider {
  readonly name: string;
  readonly #seal: MediaSeal;
  readonly #downloadMedia: BaileysProviderOptions["downloadMedia"];
  readonly #upsertTypes: ReadonlySet<string>;
  readonly #sendTimeoutMs: number;
  readonly #prepareContent: (content: OutboundContent, chatId: string) => unknown;
  readonly #onSkipped: BaileysProviderOptions["onSkipped"];
  readonly #onError: BaileysProviderOptions["onError"];
  /** The account: the `connectionId` option, else the socket's user id (without its device) once one was known. */
  connectionId?: string;
  #socket: BaileysSocketLike | undefined;
  #connection: string | undefined;
  /** The sockets listened to: the current one last, and the latest previous ones. */
  #listening: { socket: BaileysSocketLike; remove: () => void }[] = [];
  #sink: InboundSink | undefined;
  /** Messages that came while no sink was there, in order. */
  #pending: { message: BaileysWAMessage; upsertType: string }[] = [];
  /** Per chat, the conversions under way (a chat's messages reach the bot in order). */
  readonly #chains = new Map<string, Promise<void>>();
  /** Per chat, a refused admission being tried again: the chat's later messages wait behind it. */
  readonly #retrying = new Map<string, Promise<void>>();
  /** Admissions under way. */
  readonly #inflight = new Set<Promise<void>>();
  /** Message id we sent → outbox key. */
  readonly #keys = new BoundedMap<string, string>(REMEMBERED);
  /** Message id → the best status a receipt gave, for ids whose key is not known yet. */
  readonly #receipts = new BoundedMap<string, number>(REMEMBERED);
  /** Message id → a cut-off `sendMessage` still watched. */
  readonly #late = new Map<string, Promise<void>>();
  /** Message id → the status of the Boom a cut-off `sendMessage` failed with later, before anything went out. */
  readonly #notSent = new BoundedMap<string, number>(REMEMBERED);
  /** Message id → `confirm` calls waiting for a cut-off `sendMessage` that a receipt answers as well. */
  readonly #receiptWaiters = new Map<string, Set<() => void>>();
  readonly #waits = new Set<{ timer: ReturnType<typeof setTimeout>; resolve: () => void }>();

  /**
   * @param options the socket, media download, and the optional settings
   * @throws {TypeError} naming an unknown option or one of the wrong type
   */
  constructor(given: BaileysProviderOptions = {}) {
    if (!isObj(given)) throw new TypeError(`BaileysProvider options must be an object, got ${show(given)}`);
    const options: BaileysProviderOptions = given;
    for (const name of Object.keys(options)) {
      if (!OPTION_NAMES.has(name)) throw new TypeError(`Unknown BaileysProvider option ${show(name)}`);
    }
    const fn = (name: keyof BaileysProviderOptions) => {
      const value = options[name];
      if (value !== undefined && typeof value !== "function") throw new TypeError(`Option "${name}" must be a function, got ${show(value)}`);
    };
    fn("downloadMedia");
    fn("prepareContent");
    fn("onSkipped");
    fn("onError");
    this.name = options.name ?? "baileys";
    if (typeof this.name !== "string" || this.name === "") throw new TypeError(`Option "name" must be a non-empty string, got ${show(this.name)}`);
    const timeout = options.sendTimeoutMs ?? DEFAULT_SEND_TIMEOUT_MS;
    if (typeof timeout !== "number") throw new TypeError(`Option "sendTimeoutMs" must be a number of ms, got ${show(timeout)}`);
    if (!Number.isFinite(timeout) || !(timeout > 0) || timeout > MAX_TIMER_MS) {
      throw new RangeError(`Option "sendTimeoutMs" must be a positive finite number of ms up to ${MAX_TIMER_MS} (2^31-1), got ${show(timeout)}`);
    }
    this.#sendTimeoutMs = timeout;
    const types = options.upsertTypes ?? ["notify", "append"];
    if (!Array.isArray(types) || types.length === 0 || types.some((t) => t !== "notify" && t !== "append")) {
      throw new TypeError(`Option "upsertTypes" must be a non-empty array of "notify" and "append", got ${show(types)}`);
    }
    this.#upsertTypes = new Set(types);
    this.#seal = new MediaSeal({ provider: this.name, key: options.mediaKey ?? `botmesh/baileys-media/v1/${this.name}` });
    this.#downloadMedia = options.downloadMedia;
    this.#prepareContent = options.prepareContent ?? ((content) => typeof content === "string" ? { text: content } : content);
    this.#onSkipped = options.onSkipped;
    this.#onError = options.onError;
    if (options.connectionId !== undefined) this.connectionId = options.connectionId;
    if (options.socket !== undefined) this.attach(options.socket);
  }

  /** The socket sends go through now (the last one attached). */
  get socket(): BaileysSocketLike | undefined {
    return this.#socket;
  }

  // ---- the socket -----------------------------------------------------------------

  /**
   * Use `socket` from now on for sends. Call it with every socket your reconnect loop makes, right after
   * `makeWASocket` (before any event can be emitted). The provider keeps listening to the previous
   * sockets' messages and receipts (the latest {@link KEPT_SOCKETS}): Baileys acknowledged every message
   * it emits, including the ones a dying socket still emits (its offline replay's buffer, flushed here
   * when it closes, or a message whose processing was under way); a copy that also comes through another
   * socket is dropped as a duplicate by its key. Sends fail as retryable while no open socket is there
   * (the outbox sends them again), and admissions already under way finish.
   *
   * @param socket the socket `makeWASocket` returned
   */
  attach(socket: BaileysSocketLike): void {
    if (!isObj(socket) || !isObj(socket.ev) || typeof socket.ev.on !== "function" || typeof socket.sendMessage !== "function") {
      throw new TypeError(`attach() needs a Baileys socket (with "ev.on" and "sendMessage"), got ${show(socket)}`);
    }
    const previous = this.#socket;
    this.#socket = socket;
    this.#connection = undefined;
    if (this.connectionId === undefined && typeof socket.user?.id === "string") this.connectionId = bareJid(socket.user.id);
    // What the previous socket still holds in its event buffer (acknowledged already) comes out now.
    if (previous !== undefined && previous !== socket) this.#flush(previous);
    if (this.#listening.some((entry) => entry.socket === socket)) return;
    const onUpsert = (upsert: BaileysUpsert) => this.#onUpsert(upsert);
    const onUpdate = (updates: BaileysMessageUpdate[]) => this.#onUpdates(updates);
    const onReceipt = (receipts: BaileysReceiptUpdate[]) => this.#onReceipts(receipts);
    const onConnection = (update: BaileysConnectionUpdate) => {
      if (this.#socket === socket && isObj(update) && typeof update.connection === "string") this.#connection = update.connection;
      if (this.connectionId === undefined && typeof socket.user?.id === "string") this.connectionId = bareJid(socket.user.id);
      // Baileys' end() never flushes: messages of an offline replay cut short (each acknowledged) would stay in the buffer.
      if (isObj(update) && update.connection === "close") this.#flush(socket);
    };
    socket.ev.on("messages.upsert", onUpsert);
    socket.ev.on("messages.update", onUpdate);
    socket.ev.on("message-receipt.update", onReceipt);
    socket.ev.on("connection.update", onConnection);
    this.#listening.push({
      socket,
      remove: () => {
        socket.ev.off("messages.upsert", onUpsert);
        socket.ev.off("messages.update", onUpdate);
        socket.ev.off("message-receipt.update", onReceipt);
        socket.ev.off("connection.update", onConnection);
      },
    });
    while (this.#listening.length > KEPT_SOCKETS) this.#unlisten(this.#listening.shift()!);
  }

  /**
   * Stop listening to every socket (what their event buffers hold is flushed first); sends fail as
   * retryable until the next {@link attach}.
   */
  detach(): void {
    this.#socket = undefined;
    this.#connection = undefined;
    const listening = this.#listening;
    this.#listening = [];
    for (const entry of listening) this.#unlisten(entry);
  }

  #unlisten(entry: { socket: BaileysSocketLike; remove: () => void }): void {
    this.#flush(entry.socket);
    try {
      entry.remove();
    } catch (error) {
      this.#report(error instanceof Error ? error : new Error(String(error)));
    }
  }

  /** `ev.flush(true)`: the events Baileys buffered are emitted now (to the listeners still there). */
  #flush(socket: BaileysSocketLike): void {
    if (typeof socket.ev?.flush !== "function") return;
    try {
      socket.ev.flush(true);
    } catch (error) {
      this.#report(error instanceof Error ? error : new Error(String(error)));
    }
  }

  // ---- the bot --------------------------------------------------------------------

  /**
   * Called by `bot.start()`: messages go to the bot from now on, the ones that
   * came while it was stopped first.
   *
   * @param sink where inbound messages go
   */
  start(sink: InboundSink): void {
    this.#sink = sink;
    const pending = this.#pending;
    this.#pending = [];
    for (const { message, upsertType } of pending) this.#enqueue(message, upsertType);
  }

  /** Called by `bot.stop()`: later messages wait in memory for the next `start` (a bot made with this provider): Baileys acknowledged them already. */
  stop(): void {
    if (this.#pending.length > 0 || this.#chains.size > 0 || this.#inflight.size > 0 || this.#retrying.size > 0) {
      this.#report(
        new Error(
          "The bot stopped while WhatsApp messages were still held in the provider's memory (Baileys acknowledged them, " +
            "the journal does not have them yet): they wait for the next bot started with this provider, and are lost if the process ends first",
        ),
      );
    }
    this.#sink = undefined;
    for (const wait of this.#waits) {
      clearTimeout(wait.timer);
      wait.resolve();
    }
    this.#waits.clear();
  }

  #report(error: Error): void {
    try {
      if (this.#onError !== undefined) this.#onError(error);
      else if (this.#sink?.reportError !== undefined) this.#sink.reportError(error);
      else console.warn(`[@botmesh/durable/baileys] ${error.message}`);
    } catch {
      // a throwing onError must not break the socket's event loop
    }
  }

  // ---- inbound --------------------------------------------------------------------

  #onUpsert(upsert: BaileysUpsert): void {
    if (!isObj(upsert) || !Array.isArray(upsert.messages)) {
      this.#report(new Error(`Baileys emitted a messages.upsert without "messages": ${show(upsert)}`));
      return;
    }
    const type = String(upsert.type);
    for (const message of upsert.messages) {
      // Baileys' event buffer merges a receipt that came while buffering into the upsert of our own
      // echo (its status, its userReceipt): read it before the echo is skipped as from-me.
      if (isObj(message) && isObj(message.key) && message.key.fromMe === true && typeof message.key.id === "string") this.#echoReceipt(message);
      const reason: SkipReason | undefined = skipReason(message) ?? (this.#upsertTypes.has(type) ? undefined : "upsert-type");
      if (reason !== undefined) {
        if (this.#onSkipped !== undefined) {
          try {
            this.#onSkipped(message, reason);
          } catch (error) {
            this.#report(error instanceof Error ? error : new Error(String(error)));
          }
        }
        continue;
      }
      this.#enqueue(message, type);
    }
  }

  #enqueue(message: BaileysWAMessage, upsertType: string): void {
    const chat = message.key.remoteJid!;
    if (this.#sink === undefined && !this.#chains.has(chat) && !this.#retrying.has(chat)) {
      // Nothing of the chat under way: straight to the messages waiting for `start`. (Else behind what
      // is under way, which joins them when it finds no bot: a message still being sealed keeps its place.)
      this.#pending.push({ message, upsertType });
      return;
    }
    // The conversions of a chat run in order, so its messages reach the bot in the order Baileys
    // emitted them; the admissions themselves are not waited for (the bot keeps each message's place
    // in its chat while it is journaled), so a burst (the offline replay) is journaled as fast as the
    // journal takes it: Baileys acknowledged every one of them already.
    const previous = this.#chains.get(chat) ?? Promise.resolve();
    const next = previous.then(async () => {
      // No bot (stopped): converted again at the next start.
      const inbound = this.#sink === undefined ? undefined : await this.#convert(message, upsertType);
      const retrying = this.#retrying.get(chat);
      if (retrying !== undefined) await retrying; // behind a refused message of the chat
      if (inbound === undefined) this.#pending.push({ message, upsertType });
      else this.#deliver(chat, message, upsertType, inbound);
    }).catch((error) => {
      this.#report(error instanceof Error ? error : new Error(String(error)));
    });
    this.#chains.set(chat, next);
    void next.then(() => {
      if (this.#chains.get(chat) === next) this.#chains.delete(chat);
    });
  }

  async #convert(message: BaileysWAMessage, upsertType: string): Promise<InboundMessage> {
    try {
      return await toInbound(message, { seal: this.#seal, upsertType });
    } catch (error) {
      const reason = `The Baileys message could not be read: ${error instanceof Error ? error.message : String(error)}`;
      this.#report(new Error(`${reason} (${messageKeyId(message.key)})`));
      return unreadableOf(message, reason);
    }
  }

  /** Hand one message to the bot; a refusal is tried again, holding the chat's later messages behind it. */
  #deliver(chat: string, message: BaileysWAMessage, upsertType: string, inbound: InboundMessage): void {
    const sink = this.#sink;
    if (sink === undefined) {
      this.#pending.push({ message, upsertType });
      return;
    }
    const admission = this.#receiveOnce(sink, inbound).then(async (refused) => {
      let error = refused;
      if (error !== undefined && isPermanentRefusal(error) && inbound.unreadable === undefined) {
        // Never journaled as it is, however often it is tried: journaled as unreadable instead (the core
        // dead-letters it), so that it is kept and its chat goes on.
        inbound = this.#unreadable(message, error);
        error = await this.#receiveOnce(sink, inbound);
      }
      if (error === undefined) return;
      if (isPermanentRefusal(error)) {
        this.#report(new Error(`WhatsApp message ${inbound.id} cannot be journaled, even as unreadable: dropped (${error.message})`, { cause: error }));
        return;
      }
      const refusal = error;
      const before = this.#retrying.get(chat) ?? Promise.resolve();
      const retry = before.then(() => this.#retry(message, upsertType, inbound, refusal));
      this.#retrying.set(chat, retry);
      await retry;
      if (this.#retrying.get(chat) === retry) this.#retrying.delete(chat);
    }).catch((error) => {
      this.#report(error instanceof Error ? error : new Error(String(error)));
    });
    this.#inflight.add(admission);
    void admission.then(() => this.#inflight.delete(admission));
  }

  /** One `sink.receive`: `undefined` once taken (admitted, a duplicate, unjournaled), else why it was refused. */
  async #receiveOnce(sink: InboundSink, inbound: InboundMessage): Promise<Error | undefined> {
    try {
      const result = await sink.receive(inbound);
      return result.status === "rejected" ? result.error : undefined;
    } catch (thrown) {
      return thrown instanceof Error ? thrown : new Error(String(thrown));
    }
  }

  async #retry(message: BaileysWAMessage, upsertType: string, given: InboundMessage, first: Error): Promise<void> {
    let inbound = given;
    let error: Error | undefined = first;
    let delay: number = ADMIT_RETRY_MS[0];
    while (error !== undefined) {
      this.#report(
        new Error(`The journal refused WhatsApp message ${inbound.id}; Baileys acknowledged it already, so it is tried again in ${delay} ms: ${error.message}`, {
          cause: error,
        }),
      );
      await this.#wait(delay);
      delay = Math.min(delay * 2, ADMIT_RETRY_MS[1]);
      const sink = this.#sink;
      if (sink === undefined) {
        this.#pending.push({ message, upsertType });
        return;
      }
      error = await this.#receiveOnce(sink, inbound);
      if (error !== undefined && isPermanentRefusal(error)) {
        if (inbound.unreadable !== undefined) {
          this.#report(new Error(`WhatsApp message ${inbound.id} cannot be journaled, even as unreadable: dropped (${error.message})`, { cause: error }));
          return;
        }
        inbound = this.#unreadable(message, error);
        error = await this.#receiveOnce(sink, inbound);
      }
    }
  }

  /** The message as unreadable (the reason, and the raw `WAMessage` as JSON): what the journal takes of one it refused for good. */
  #unreadable(message: BaileysWAMessage, error: Error): InboundMessage {
    const reason = `The journal cannot take the Baileys message as read: ${error.message}`;
    this.#report(new Error(`${reason} (${messageKeyId(message.key)}); journaled as unreadable`, { cause: error }));
    return unreadableOf(message, reason);
  }

  #wait(ms: number): Promise<void> {
    return new Promise((resolve) => {
      const wait = { timer: undefined as unknown as ReturnType<typeof setTimeout>, resolve };
      wait.timer = setTimeout(() => {
        this.#waits.delete(wait);
        resolve();
      }, ms);
      this.#waits.add(wait);
    });
  }

  /** How many inbound messages wait for the bot to start (taken while it was stopped). */
  get pendingCount(): number {
    return this.#pending.length;
  }

  /**
   * Resolves once every admission under way has ended (admitted, or waiting in memory for `start`).
   * For tests and graceful shutdowns.
   */
  async idle(): Promise<void> {
    while (this.#chains.size > 0 || this.#inflight.size > 0 || this.#retrying.size > 0) {
      await Promise.all([...this.#chains.values(), ...this.#inflight, ...this.#retrying.values()]);
    }
  }

  // ---- receipts -------------------------------------------------------------------

  #onUpdates(updates: BaileysMessageUpdate[]): void {
    if (!Array.isArray(updates)) return;
    for (const entry of updates) {
      if (!isObj(entry) || !isObj(entry.key) || !isObj(entry.update)) continue;
      const status = entry.update.status;
      if (typeof status !== "number" || entry.key.fromMe !== true || typeof entry.key.id !== "string") continue;
      this.#receipt(entry.key.id, status);
    }
  }

  #onReceipts(receipts: BaileysReceiptUpdate[]): void {
    if (!Array.isArray(receipts)) return;
    for (const entry of receipts) {
      if (!isObj(entry) || !isObj(entry.key) || entry.key.fromMe !== true || typeof entry.key.id !== "string") continue;
      const read = isObj(entry.receipt) && entry.receipt.readTimestamp !== undefined && entry.receipt.readTimestamp !== null;
      this.#receipt(entry.key.id, read ? BAILEYS_STATUS.READ : BAILEYS_STATUS.DELIVERY_ACK);
    }
  }

  /** The receipts an upsert of one of our own messages carries (`status`, `userReceipt`). */
  #echoReceipt(message: BaileysWAMessage): void {
    const id = message.key.id!;
    if (typeof message.status === "number") this.#receipt(id, message.status);
    if (!Array.isArray(message.userReceipt)) return;
    for (const entry of message.userReceipt) {
      if (!isObj(entry)) continue;
      const set = (v: unknown) => v !== undefined && v !== null && v !== 0;
      if (set(entry.readTimestamp) || set(entry.playedTimestamp)) this.#receipt(id, BAILEYS_STATUS.READ);
      else if (set(entry.receiptTimestamp)) this.#receipt(id, BAILEYS_STATUS.DELIVERY_ACK);
    }
  }

  #receipt(messageId: string, status: number): void {
    const key = this.#keys.get(messageId);
    if (status === BAILEYS_STATUS.ERROR) {
      if (key !== undefined) this.#report(new Error(`WhatsApp refused message ${messageId} (outbox key ${key}) after it was sent`));
      return;
    }
    if (status < BAILEYS_STATUS.SERVER_ACK) return;
    const best = Math.max(status, this.#receipts.get(messageId) ?? 0);
    this.#receipts.set(messageId, best);
    const waiters = this.#receiptWaiters.get(messageId);
    if (waiters !== undefined) for (const wake of [...waiters]) wake();
    if (key === undefined) return;
    const sink = this.#sink;
    if (sink?.confirmSent === undefined) return;
    sink.confirmSent(key, messageId).catch((error) => {
      this.#report(new Error(`Settling send ${key} on its receipt failed: ${error instanceof Error ? error.message : String(error)}`, { cause: error }));
    });
  }

  // ---- sends ----------------------------------------------------------------------

  /**
   * Send through the attached socket: `sock.sendMessage(chatId, content, { messageId })`, the id
   * derived from the outbox key. A string is sent as `{ text }`; an object as Baileys'
   * `AnyMessageContent` (`{ image: { url }, caption }`, `{ react: { text, key } }`, …).
   *
   * @param chatId the chat's jid (`ctx.message.chatId`)
   * @param content the content
   * @param context the outbox key, the attempt, and the bot's signal
   * @returns the message id
   * @throws {ProviderError} retryable when no socket is open; maybe delivered when `sendMessage` did not return in time
   */
  async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    const messageId = await baileysMessageIdFor(context.idempotencyKey);
    this.#keys.set(messageId, context.idempotencyKey);
    // A receipt for this id already came (the previous attempt got through): no second message.
    if ((this.#receipts.get(messageId) ?? 0) >= BAILEYS_STATUS.SERVER_ACK) return { messageId };
    const socket = this.#socket;
    if (socket === undefined || this.#connection === "close") {
      // Nothing was sent: the send waits for the reconnect without spending an attempt.
      throw new ProviderError("No open Baileys socket: the send waits for the reconnect (attach the new socket)", {
        retryable: true,
        rateLimited: "chat",
        retryAfterMs: DISCONNECTED_WAIT_MS,
      });
    }
    const payload = this.#prepareContent(content, chatId);
    let timer: ReturnType<typeof setTimeout> | undefined;
    let onAbort: (() => void) | undefined;
    const cut = new Promise<never>((_, reject) => {
      timer = setTimeout(
        () => reject(new ProviderError(`sendMessage did not return within ${this.#sendTimeoutMs} ms: it may have gone out`, { maybeDelivered: true })),
        this.#sendTimeoutMs,
      );
      onAbort = () => reject(new ProviderError("The bot stopped during sendMessage: it may have gone out", { maybeDelivered: true }));
      context.signal?.addEventListener("abort", onAbort, { once: true });
    });
    this.#notSent.delete(messageId);
    const sending = socket.sendMessage(chatId, payload, { messageId });
    try {
      const sent = await Promise.race([sending, cut]);
      const id = isObj(sent) && isObj(sent.key) && typeof sent.key.id === "string" ? sent.key.id : messageId;
      return { messageId: id };
    } catch (error) {
      if (error instanceof ProviderError && error.maybeDelivered) this.#watchLate(messageId, sending);
      throw error;
    } finally {
      clearTimeout(timer);
      if (onAbort !== undefined) context.signal?.removeEventListener("abort", onAbort);
    }
  }

  /**
   * Whether a send left ambiguous arrived: yes when a receipt for its message id came (since this
   * process started), else `null`; its key is remembered, so a receipt that comes later settles it.
   *
   * @param send the send in question
   * @returns the confirmation, or `null` when no receipt came yet
   */
  async confirm(send: SendInQuestion): Promise<SendConfirmation | null> {
    const messageId = await baileysMessageIdFor(send.idempotencyKey);
    this.#keys.set(messageId, send.idempotencyKey);
    const late = this.#late.get(messageId);
    if (late !== undefined && (this.#receipts.get(messageId) ?? 0) < BAILEYS_STATUS.SERVER_ACK) {
      // The cut-off sendMessage may still tell: wait a little for it, or for a receipt (the bot waits 10 s for this answer).
      let timer: ReturnType<typeof setTimeout> | undefined;
      let wake: (() => void) | undefined;
      const waiters = this.#receiptWaiters.get(messageId) ?? new Set<() => void>();
      this.#receiptWaiters.set(messageId, waiters);
      await Promise.race([late, new Promise<void>((resolve) => {
        wake = () => resolve();
        waiters.add(wake);
        timer = setTimeout(wake, CONFIRM_WAIT_MS);
        send.signal?.addEventListener("abort", wake, { once: true });
      })]);
      clearTimeout(timer);
      if (wake !== undefined) send.signal?.removeEventListener("abort", wake);
      waiters.delete(wake!);
      if (waiters.size === 0 && this.#receiptWaiters.get(messageId) === waiters) this.#receiptWaiters.delete(messageId);
    }
    if ((this.#receipts.get(messageId) ?? 0) >= BAILEYS_STATUS.SERVER_ACK) return { delivered: true, messageId };
    return this.#notSent.has(messageId) ? { delivered: false } : null;
  }

  /**
   * A `sendMessage` cut off by the timeout (or the bot's stop) is still watched: resolving later, it went
   * out (settled like a receipt); failing later with a Boom Baileys throws before the stanza leaves (408,
   * 428, another 4xx), it did not, and {@link confirm} says so.
   */
  #watchLate(messageId: string, sending: Promise<unknown>): void {
    const late = sending.then(
      () => this.#receipt(messageId, BAILEYS_STATUS.SERVER_ACK),
      (error) => {
        const status = baileysStatusOf(error);
        if (status !== undefined && status >= 400 && status < 500 && status !== 401 && status !== 403) {
          this.#notSent.set(messageId, status);
        }
      },
    ).finally(() => {
      if (this.#late.get(messageId) === late) this.#late.delete(messageId);
    });
    this.#late.set(messageId, late);
  }

  /**
   * Whether a failed send may be retried (see {@link classifyBaileysError}).
   *
   * @param error what `send` threw
   * @returns the classification
   */
  classifyError(error: unknown): ErrorClassification {
    if (error instanceof ProviderError) return classifyProviderError(error);
    return classifyBaileysError(error);
  }

  // ---- media ----------------------------------------------------------------------

  /**
   * Load an inbound message's media again: the `WAMessage` rebuilt from the sealed reference
   * (key and media node) goes to the `downloadMedia` option (Baileys' `downloadMediaMessage`).
   *
   * @param media the journaled reference
   * @param context the message and an abort signal
   * @returns the bytes, MIME type and file name
   * @throws {MediaUnavailableError} `rehydrate-failed` when the reference is damaged, no `downloadMedia` was given, or
   *   WhatsApp no longer has the media (404/410 after Baileys' re-upload request)
   */
  async loadMedia(media: StoredMediaRef, context: MediaLoadContext): Promise<LoadedMedia> {
    const messageId = context?.message?.id;
    const ref = await this.#seal.open(media, messageId) as unknown as BaileysMediaRef;
    if (!isObj(ref) || !isObj(ref.key) || typeof ref.kind !== "string" || !(ref.kind in MEDIA_KINDS) || !isObj(ref.node)) {
      throw new MediaUnavailableError("rehydrate-failed", `The media reference of message ${show(messageId)} is not a Baileys one`, { messageId });
    }
    if (this.#downloadMedia === undefined) {
      throw new MediaUnavailableError(
        "rehydrate-failed",
        `BaileysProvider has no "downloadMedia" option: the media of message ${show(messageId)} cannot be loaded`,
        { messageId },
      );
    }
    const node: { [field: string]: unknown } = { ...ref.node };
    for (const field of ["mediaKey", "fileEncSha256", "fileSha256"]) {
      if (typeof node[field] === "string") node[field] = fromBase64(node[field] as string);
    }
    const message: BaileysWAMessage = { key: { ...ref.key }, message: { [ref.kind]: node } };
    let data: Uint8Array;
    try {
      data = await this.#downloadMedia(message, { signal: context?.signal });
    } catch (error) {
      const status = baileysStatusOf(error);
      if (status === 404 || status === 410) {
        throw new MediaUnavailableError("rehydrate-failed", `WhatsApp no longer has the media of message ${show(messageId)} (${status})`, {
          messageId,
          cause: error,
        });
      }
      throw error;
    }
    if (!(data instanceof Uint8Array)) throw new TypeError(`downloadMedia must resolve with bytes, got ${show(data)}`);
    const out: LoadedMedia = { data };
    if (typeof ref.node.mimetype === "string") out.mimeType = ref.node.mimetype;
    if (typeof ref.node.fileName === "string") out.fileName = ref.node.fileName;
    return out;
  }
}

/**
 * Whether the bot refused a message for good: content the journal cannot encode, or the bot's own checks
 * of an inbound message (a `TypeError` naming an "Inbound message field"). Trying again cannot help.
 */
function isPermanentRefusal(error: Error): boolean {
  return error instanceof UnencodableContentError || error.name === "UnencodableContentError" ||
    (error instanceof TypeError && error.message.startsWith("Inbound message"));
}

/** `123:4@s.whatsapp.net` → `123@s.whatsapp.net` (the account, without the device). */
function bareJid(jid: string): string {
  return jid.replace(/:\d+(?=@)/, "");
}

/** A message journaled as unreadable: the reason, and the raw `WAMessage` as JSON. */
function unreadableOf(message: BaileysWAMessage, reason: string): InboundMessage {
  return { id: messageKeyId(message.key), chatId: message.key.remoteJid!, type: "other", unreadable: reason, extra: { raw: toJson(message, 24) } };
}
