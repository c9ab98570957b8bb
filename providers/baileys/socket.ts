/**
 * The part of a Baileys socket (`makeWASocket`) the provider uses, typed
 * structurally: nothing here imports Baileys. The shapes follow Baileys
 * 6.17's published types (`lib/Types/Events.d.ts`, `lib/Types/Message.d.ts`,
 * `WAProto/index.d.ts`): a real `WASocket` is assignable to
 * {@link BaileysSocketLike} (checked by `compat/baileys/types_check.ts`).
 *
 * @module
 */

/** A message's key (`proto.IMessageKey`): what WhatsApp identifies a message by. */
export interface BaileysMessageKey {
  /** The chat: `<number>@s.whatsapp.net`, `<lid>@lid`, `<id>@g.us` (a group), `status@broadcast`. */
  remoteJid?: string | null;
  /** Whether our own account sent it (from this socket or another of our devices). */
  fromMe?: boolean | null;
  /** The message id. */
  id?: string | null;
  /** The sender within a group. */
  participant?: string | null;
}

/** A protobuf `Long` as protobufjs gives 64-bit integers (`messageTimestamp`, `fileLength`). */
export interface BaileysLong {
  low: number;
  high: number;
  unsigned?: boolean;
  toNumber?(): number;
}

/**
 * A message as Baileys emits it (`WAMessage`, that is `proto.IWebMessageInfo`):
 * `message` holds one field naming its kind (`conversation`,
 * `extendedTextMessage`, `imageMessage`, …); a stub (a group event) has
 * `messageStubType` and no `message`.
 */
export interface BaileysWAMessage {
  key: BaileysMessageKey;
  /** The content: an object with one field naming its kind (`proto.IMessage`). */
  message?: object | null;
  messageTimestamp?: number | string | BaileysLong | null;
  pushName?: string | null;
  participant?: string | null;
  status?: number | null;
  /** Receipts of our own message (a group's members), as Baileys' event buffer merges them into its upsert. */
  userReceipt?: { userJid?: string | null; receiptTimestamp?: unknown; readTimestamp?: unknown; playedTimestamp?: unknown }[] | null;
  messageStubType?: number | null;
  messageStubParameters?: (string | null)[] | null;
  broadcast?: boolean | null;
}

/** `messages.upsert`: `notify` for a message received live, `append` for the offline replay and our own echoes. */
export interface BaileysUpsert {
  messages: BaileysWAMessage[];
  type: "notify" | "append" | (string & {});
  /** Set when the message is the phone's answer to a placeholder resend request. */
  requestId?: string;
}

/** One entry of `messages.update`: a receipt (`update.status`), an edit, a deletion. */
export interface BaileysMessageUpdate {
  key: BaileysMessageKey;
  update: { status?: number | null };
}

/** One entry of `message-receipt.update`: a group member's delivery or read receipt. */
export interface BaileysReceiptUpdate {
  key: BaileysMessageKey;
  receipt: { userJid?: string | null; receiptTimestamp?: unknown; readTimestamp?: unknown };
}

/** `connection.update` (only the fields the provider reads). */
export interface BaileysConnectionUpdate {
  connection?: "open" | "connecting" | "close" | (string & {});
  lastDisconnect?: { error?: unknown; date?: unknown };
  receivedPendingNotifications?: boolean;
}

/** The events the provider listens to, with Baileys' names. */
export interface BaileysEvents {
  "messages.upsert": BaileysUpsert;
  "messages.update": BaileysMessageUpdate[];
  "message-receipt.update": BaileysReceiptUpdate[];
  "connection.update": BaileysConnectionUpdate;
}

/**
 * What the provider needs of `sock.ev` (Baileys' `BaileysEventEmitter`).
 * Declared as methods (bivariant parameters), so Baileys' generic
 * `on<T extends keyof BaileysEventMap>(event: T, listener: (arg: BaileysEventMap[T]) => void)`
 * fits.
 */
export interface BaileysEventsLike {
  // deno-lint-ignore no-explicit-any
  on(event: any, listener: (arg: any) => void): unknown;
  // deno-lint-ignore no-explicit-any
  off(event: any, listener: (arg: any) => void): unknown;
  /**
   * Emit what is buffered now (Baileys' `flush(force)`): called with `true` when a socket closes or is
   * let go, since Baileys' `end()` leaves an offline replay cut short in the buffer, acknowledged.
   */
  flush?(force?: boolean): unknown;
}

/** The options of `sock.sendMessage` the provider sets (`MiscMessageGenerationOptions`). */
export interface BaileysSendOptions {
  /** "override the message ID with a custom provided string" (Baileys' `MinimalRelayOptions.messageId`). */
  messageId?: string;
  [option: string]: unknown;
}

/**
 * The Baileys socket as the provider sees it: `makeWASocket(...)`'s result
 * fits. Only `ev`, `sendMessage` and `user` are used.
 */
export interface BaileysSocketLike {
  ev: BaileysEventsLike;
  // deno-lint-ignore no-explicit-any
  sendMessage(jid: string, content: any, options?: any): Promise<BaileysWAMessage | undefined>;
  /** Our own account once connected (`{ id: "<number>:<device>@s.whatsapp.net" }`). */
  user?: { id: string } | undefined;
}

/** `proto.WebMessageInfo.Status`: the values of `status` in `messages.update`. */
export const BAILEYS_STATUS = {
  ERROR: 0,
  PENDING: 1,
  SERVER_ACK: 2,
  DELIVERY_ACK: 3,
  READ: 4,
  PLAYED: 5,
} as const;
