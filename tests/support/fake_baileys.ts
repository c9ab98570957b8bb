/**
 * A fake Baileys socket: what `makeWASocket` returns, as far as
 * `@botmesh/durable/baileys` uses it, with the event and message shapes of
 * Baileys 6.17's published types (`lib/Types/Events.d.ts`,
 * `lib/Types/Message.d.ts`, `WAProto/index.d.ts`):
 *
 * - `ev.on/off` of an event emitter; `messages.upsert` is `{ messages: WAMessage[], type: "notify" | "append" }`,
 *   `messages.update` is `[{ key, update: { status } }]`, `message-receipt.update` is
 *   `[{ key, receipt: { userJid, receiptTimestamp | readTimestamp } }]`, `connection.update` is
 *   `{ connection, lastDisconnect }`;
 * - `WAMessage`s with protobuf shapes: `messageTimestamp` a `Long` (`{ low, high, unsigned }`),
 *   media nodes with `mediaKey`, `fileSha256` and `fileEncSha256` as `Uint8Array`s and `fileLength` a `Long`;
 * - `sendMessage(jid, content, { messageId })` resolving with the sent `WAMessage` (`status: PENDING`,
 *   `key.id` the given `messageId`, as `generateWAMessage` does), or throwing what Baileys throws: a
 *   Boom (`{ isBoom: true, output: { statusCode } }`) "Connection Closed" (428) when the socket is not open.
 *
 * The "server" side is a {@link FakeWhatsApp}: it holds what each chat received (by message id, so a
 * resend with the same id shows as a duplicate id), and the media store `downloadMediaMessage` reads.
 */

/** `proto.WebMessageInfo.Status`. */
export const STATUS = { ERROR: 0, PENDING: 1, SERVER_ACK: 2, DELIVERY_ACK: 3, READ: 4, PLAYED: 5 } as const;

/** A protobuf Long as protobufjs decodes a uint64. */
export type Long = { low: number; high: number; unsigned: boolean };

/** A `WAMessage` as the fake emits it. */
export interface FakeWAMessage {
  key: { remoteJid: string; fromMe: boolean; id: string; participant?: string };
  message?: Record<string, unknown>;
  messageTimestamp?: Long | number;
  pushName?: string;
  broadcast?: boolean;
}

/** A protobuf Long as protobufjs decodes a uint64. */
export function long(n: number): Long {
  return { low: n % 2 ** 32 | 0, high: Math.floor(n / 2 ** 32) | 0, unsigned: true };
}

/** A Boom error as `@hapi/boom` builds it. */
export function boom(message: string, statusCode: number): Error {
  const error = new Error(message) as Error & { isBoom: boolean; output: unknown; data: unknown };
  error.isBoom = true;
  error.output = { statusCode, payload: { statusCode, error: "Error", message }, headers: {} };
  error.data = null;
  return error;
}

type Listener = (arg: unknown) => void;

/** The events Baileys' event buffer holds (`connection.update` is never buffered). */
const BUFFERED_EVENTS = new Set(["messages.upsert", "messages.update", "message-receipt.update"]);

/** What a send did on the "server". */
export interface Delivered {
  jid: string;
  messageId: string;
  content: unknown;
  socket: number;
}

/** The "server": every socket made from it shares the chats and the media. */
export class FakeWhatsApp {
  /** Every message that reached the server, in order (a resend of an id is listed again). */
  readonly delivered: Delivered[] = [];
  /** Media by direct path: the bytes, and the media key that unlocks them. */
  readonly media: Map<string, { bytes: Uint8Array; mediaKey: Uint8Array }> = new Map();
  readonly me: string = "15550000000:7@s.whatsapp.net";
  #sockets = 0;
  #counter = 0;

  /** A new socket, as `makeWASocket` returns one (connecting; call `open()`). */
  socket(): FakeSocket {
    return new FakeSocket(this, ++this.#sockets);
  }

  /** Distinct message ids delivered to `jid`. */
  idsTo(jid: string): string[] {
    return [...new Set(this.delivered.filter((d) => d.jid === jid).map((d) => d.messageId))];
  }

  /** The texts delivered to `jid`, one per message id (a resend of an id counted once, as a phone shows it). */
  textsTo(jid: string): string[] {
    const seen = new Map<string, string>();
    for (const d of this.delivered) {
      if (d.jid === jid && !seen.has(d.messageId)) seen.set(d.messageId, String((d.content as { text?: unknown }).text));
    }
    return [...seen.values()];
  }

  /** A user's text message (`conversation`), as Baileys emits it. */
  text(jid: string, text: string, options: { id?: string; participant?: string; fromMe?: boolean; extended?: boolean } = {}): FakeWAMessage {
    const id = options.id ?? this.nextId();
    return {
      key: { remoteJid: jid, fromMe: options.fromMe ?? false, id, ...(options.participant ? { participant: options.participant } : {}) },
      message: options.extended
        ? { extendedTextMessage: { text, contextInfo: { expiration: 0 } }, messageContextInfo: { deviceListMetadata: {} } }
        : { conversation: text },
      messageTimestamp: long(1_760_000_000 + this.#counter),
      pushName: "Alice",
      broadcast: false,
    };
  }

  /** A user's image message whose encrypted file is on the "CDN" (`media`). */
  image(jid: string, bytes: Uint8Array, options: { id?: string; caption?: string; ephemeral?: boolean } = {}): FakeWAMessage {
    const id = options.id ?? this.nextId();
    const mediaKey = crypto.getRandomValues(new Uint8Array(32));
    const directPath = `/v/t62.7118-24/${id}.enc`;
    this.media.set(directPath, { bytes, mediaKey });
    const imageMessage = {
      url: `https://mmg.whatsapp.net${directPath}`,
      mimetype: "image/jpeg",
      caption: options.caption,
      fileSha256: crypto.getRandomValues(new Uint8Array(32)),
      fileLength: long(bytes.length),
      height: 10,
      width: 10,
      mediaKey,
      fileEncSha256: crypto.getRandomValues(new Uint8Array(32)),
      directPath,
      mediaKeyTimestamp: long(1_760_000_000),
      jpegThumbnail: new Uint8Array(400),
    };
    const content = { imageMessage };
    return {
      key: { remoteJid: jid, fromMe: false, id },
      message: options.ephemeral ? { ephemeralMessage: { message: content } } : content,
      messageTimestamp: long(1_760_000_100),
      pushName: "Alice",
    };
  }

  /**
   * What Baileys' `downloadMediaMessage(message, "buffer", {})` does with the node: fetch the
   * direct path and decrypt it with `mediaKey` (here: the key must match).
   */
  downloadMediaMessage: (message: { key: unknown; message?: object | null }) => Promise<Uint8Array> = async (message: { key: unknown; message?: object | null }): Promise<Uint8Array> => {
    const content = message.message as Record<string, Record<string, unknown>> | undefined;
    const kind = content && Object.keys(content).find((k) => k.endsWith("Message"));
    const node = kind ? content![kind]! : undefined;
    if (!node || !(node.mediaKey instanceof Uint8Array)) throw new Error("Cannot derive from empty media key");
    const stored = this.media.get(String(node.directPath));
    if (!stored) throw boom("Failed to fetch stream from https://mmg.whatsapp.net", 404);
    if (stored.mediaKey.length !== node.mediaKey.length || stored.mediaKey.some((b, i) => b !== (node.mediaKey as Uint8Array)[i])) {
      throw new Error("Bad MAC");
    }
    return stored.bytes;
  };

  nextId(): string {
    return `3A${(++this.#counter).toString(16).toUpperCase().padStart(18, "0")}`;
  }

  /** Internal: a socket's send reached the server. */
  deliver(d: Delivered): void {
    this.delivered.push(d);
  }
}

/** How the next sends behave. */
export type SendBehaviour =
  /** Goes out, resolves. */
  | "ok"
  /** Throws Boom 428 "Connection Closed" before anything goes out (the socket is not open). */
  | "closed"
  /** Throws Boom 408 "Timed Out": a usync query before the relay timed out; nothing went out. */
  | "query-timeout"
  /** The stanza goes out but `sendMessage` never resolves (the socket died after writing). */
  | "hang-after-write"
  /** `sendMessage` never resolves and nothing goes out. */
  | "hang-before-write";

/** A fake `WASocket`. */
export class FakeSocket {
  readonly server: FakeWhatsApp;
  readonly number: number;
  readonly listeners: Map<string, Set<Listener>> = new Map();
  /** The behaviour of the next sends, first first; `"ok"` once the list is empty. */
  readonly plan: SendBehaviour[] = [];
  /** Every `sendMessage` call. */
  readonly calls: { jid: string; content: unknown; options: Record<string, unknown> | undefined }[] = [];
  isOpen = false;
  user: { id: string; name?: string } | undefined;
  readonly ev: {
    on(event: string, listener: Listener): void;
    off(event: string, listener: Listener): void;
    emit(event: string, arg: unknown): void;
    /** Baileys' `ev.buffer()`: message events wait (a logged-in socket buffers until the offline queue is drained). */
    buffer(): void;
    /** Baileys' `ev.flush(force)`: what waited is emitted, in order (without Baileys' merging of events). */
    flush(force?: boolean): boolean;
  };
  /** Whether the socket's events are being buffered (`ev.buffer()` until `ev.flush()`). */
  buffering = false;
  readonly #buffered: [string, unknown][] = [];

  constructor(server: FakeWhatsApp, number: number) {
    this.server = server;
    this.number = number;
    this.ev = {
      on: (event, listener) => {
        if (!this.listeners.has(event)) this.listeners.set(event, new Set());
        this.listeners.get(event)!.add(listener);
      },
      off: (event, listener) => {
        this.listeners.get(event)?.delete(listener);
      },
      emit: (event, arg) => {
        if (this.buffering && BUFFERED_EVENTS.has(event)) {
          this.#buffered.push([event, arg]);
          return;
        }
        for (const listener of [...(this.listeners.get(event) ?? [])]) listener(arg);
      },
      buffer: () => {
        this.buffering = true;
      },
      flush: () => {
        if (!this.buffering) return false;
        this.buffering = false;
        for (const [event, arg] of this.#buffered.splice(0)) this.ev.emit(event, arg);
        return true;
      },
    };
  }

  listenerCount(event: string): number {
    return this.listeners.get(event)?.size ?? 0;
  }

  /** The connection opens (`connection.update { connection: "open" }`). */
  open(): this {
    this.isOpen = true;
    this.user = { id: this.server.me, name: "Bot" };
    this.ev.emit("connection.update", { connection: "open" });
    return this;
  }

  /** The connection closes (`connection.update { connection: "close", lastDisconnect }`). */
  close(statusCode = 428): void {
    this.isOpen = false;
    this.ev.emit("connection.update", { connection: "close", lastDisconnect: { error: boom("Connection Closed", statusCode), date: new Date() } });
  }

  /** `messages.upsert` as Baileys emits it. */
  upsert(messages: unknown[], type: "notify" | "append" = "notify"): void {
    this.ev.emit("messages.upsert", { messages, type });
  }

  /** A receipt for one of our messages (`messages.update`, status from the receipt's type). */
  receipt(jid: string, messageId: string, status: number = STATUS.DELIVERY_ACK): void {
    this.ev.emit("messages.update", [{ key: { remoteJid: jid, id: messageId, fromMe: true }, update: { status } }]);
  }

  /** A group member's receipt (`message-receipt.update`). */
  groupReceipt(jid: string, messageId: string, userJid: string): void {
    this.ev.emit("message-receipt.update", [{ key: { remoteJid: jid, id: messageId, fromMe: true }, receipt: { userJid, receiptTimestamp: 1_760_000_000 } }]);
  }

  sendMessage: (jid: string, content: unknown, options?: Record<string, unknown>) => Promise<FakeWAMessage> = async (jid, content, options) => {
    this.calls.push({ jid, content, options });
    const behaviour = this.plan.shift() ?? "ok";
    const messageId = typeof options?.messageId === "string" ? options.messageId : this.server.nextId();
    if (behaviour === "closed" || !this.isOpen) throw boom("Connection Closed", 428);
    if (behaviour === "query-timeout") throw boom("Timed Out", 408);
    if (behaviour === "hang-before-write") return await new Promise<never>(() => {});
    this.server.deliver({ jid, messageId, content, socket: this.number });
    if (behaviour === "hang-after-write") return await new Promise<never>(() => {});
    return { key: { remoteJid: jid, fromMe: true, id: messageId }, message: { extendedTextMessage: content }, messageTimestamp: long(1_760_000_500), status: STATUS.PENDING };
  };
}
