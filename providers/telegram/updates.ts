/**
 * Telegram updates: what the provider hands to the bot (messages, channel
 * posts, business messages, button presses), what it skips, and the record
 * of a user's update that cannot be parsed.
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import type { MediaSeal } from "../../src/media.ts";
import type { InboundMessage, MessageType } from "../../src/provider.ts";
import { cutDeepNesting, MAX_CONTENT_DEPTH } from "../../src/content.ts";
import { jsonText, sha256Hex } from "../../src/sha256_hex.ts";
import { showValue as show } from "../../src/show.ts";
import { sealMediaRef, type TelegramMediaRef } from "./media.ts";
import { isObj, type Obj } from "./values.ts";

/**
 * The default `allowedUpdates`: the update kinds this provider turns into
 * inbound messages. It also takes `business_message` when `allowedUpdates`
 * asks for it (a reply to one needs the `business_connection_id` it carries in
 * `extra.businessConnectionId`).
 */
export const TELEGRAM_HANDLED_UPDATES: readonly string[] = Object.freeze(["message", "channel_post", "callback_query"]);

/** A Telegram update the provider acknowledged without handing it to the bot. */
export interface SkippedUpdate {
  /** The update's `update_id`. */
  updateId: number;
  /** Its kind (`edited_message`, `my_chat_member`, …). */
  kind: string;
  /** The update as Telegram sent it. */
  update: Record<string, unknown>;
}

/**
 * The deepest nesting of objects and arrays an update may have (the update itself is level 1); a deeper
 * one is unreadable (the error names where), and its record keeps it cut at this depth. Telegram's own
 * updates nest about ten levels; an update is kept in its record two levels down (`extra.raw`), well
 * within the journal's bound ({@link MAX_CONTENT_DEPTH}, 64), which keeps a `[[[[…]]]]` some thousands
 * of levels deep from overflowing the stack where the journal encodes it.
 */
export const TELEGRAM_MAX_UPDATE_DEPTH = 32;

/**
 * A malformed Telegram update: `field` names what is wrong. The provider
 * reports it to `onError`; a user's update (a message, channel post, business
 * message or callback query) is then handed to the bot as unreadable, any
 * other is acknowledged and dropped.
 *
 * @example
 * ```ts
 * import { TelegramProvider, TelegramUpdateError } from "@botmesh/durable/telegram";
 * const telegram = new TelegramProvider({ token: "123:abc", secretToken: false });
 * try {
 *   await telegram.parseUpdate({ update_id: 1, message: { message_id: 2, date: 0 } });
 * } catch (error) {
 *   if (error instanceof TelegramUpdateError) console.log(error.field); // "message.chat"
 * }
 * ```
 */
export class TelegramUpdateError extends Error {
  /** The path of the offending field, e.g. `message.chat.id`. */
  readonly field: string;
  /** The update's `update_id`, when it has one. */
  readonly updateId: number | undefined;
  /**
   * Make the error.
   *
   * @param field the path of the offending field
   * @param message what is wrong
   * @param updateId the update's id, when known
   */
  constructor(field: string, message: string, updateId?: number) {
    super(message);
    this.name = "TelegramUpdateError";
    this.field = field;
    this.updateId = updateId;
  }
}

/** The result of parsing one update: a message for the bot, or a kind that is skipped. */
export type ParsedUpdate =
  | { kind: "message"; updateId: number; message: InboundMessage; callbackQueryId?: string }
  | { kind: "skipped"; updateId: number; skipped: SkippedUpdate };

/** The update kinds whose object is a Message this provider hands to the bot. */
export const MESSAGE_UPDATES = ["message", "channel_post", "business_message"] as const;
/**
 * The update kinds that carry what a user sent: one that cannot be parsed is
 * journaled as unreadable, never acknowledged and dropped.
 */
const USER_UPDATES: readonly string[] = [...MESSAGE_UPDATES, "callback_query"];
/**
 * The media fields of an inbound message, the more specific first: the Bot API
 * sets `document` as well on an animation, so `animation` is checked before it.
 */
const INBOUND_MEDIA = ["animation", "photo", "video", "video_note", "voice", "audio", "sticker", "document"] as const;
const TYPE_OF: Record<(typeof INBOUND_MEDIA)[number], MessageType> = {
  photo: "image",
  document: "document",
  voice: "audio",
  audio: "audio",
  video: "video",
  animation: "video",
  video_note: "video",
  sticker: "sticker",
};
/**
 * The other message kinds that keep their own type, with their object (or
 * array) in `extra` under the Bot API's field name, the more specific first:
 * the Bot API sets `location` as well on a venue, so `venue` is checked
 * before it. `required` lists fields that must be strings.
 */
const TYPED_KINDS: readonly { field: string; shape: "object" | "array"; required?: readonly string[] }[] = [
  { field: "venue", shape: "object", required: ["title", "address"] },
  { field: "location", shape: "object" },
  { field: "contact", shape: "object" },
  { field: "poll", shape: "object" },
  { field: "dice", shape: "object" },
  { field: "paid_media", shape: "object" },
  { field: "story", shape: "object" },
  { field: "game", shape: "object" },
  { field: "invoice", shape: "object" },
  { field: "giveaway", shape: "object" },
  { field: "giveaway_winners", shape: "object" },
  { field: "checklist", shape: "object" },
  { field: "web_app_data", shape: "object", required: ["data", "button_text"] },
  { field: "users_shared", shape: "object" },
  { field: "chat_shared", shape: "object" },
  { field: "successful_payment", shape: "object" },
  { field: "refunded_payment", shape: "object" },
  { field: "new_chat_members", shape: "array" },
  { field: "left_chat_member", shape: "object" },
];

function needInt(value: unknown, field: string, updateId?: number): number {
  if (typeof value !== "number" || !Number.isSafeInteger(value)) {
    throw new TelegramUpdateError(field, `Telegram update field "${field}" must be an integer, got ${show(value)}`, updateId);
  }
  return value;
}

function needObj(value: unknown, field: string, updateId?: number): Obj {
  if (!isObj(value)) {
    throw new TelegramUpdateError(field, `Telegram update field "${field}" must be an object, got ${show(value)}`, updateId);
  }
  return value;
}

function optString(value: unknown, field: string, updateId: number): string | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== "string") {
    throw new TelegramUpdateError(field, `Telegram update field "${field}" must be a string, got ${show(value)}`, updateId);
  }
  return value;
}

function fileRef(value: unknown, kind: string, field: string, updateId: number): TelegramMediaRef {
  let file = value;
  if (kind === "photo") {
    if (!Array.isArray(value) || value.length === 0) {
      throw new TelegramUpdateError(field, `Telegram update field "${field}" must be a non-empty array of sizes, got ${show(value)}`, updateId);
    }
    // The largest size: by width × height, the later one on a tie (Telegram lists them smallest first).
    const area = (s: unknown) => (isObj(s) ? Number(s.width) * Number(s.height) || 0 : -1);
    file = value.reduce((best: unknown, size: unknown) => (area(size) >= area(best) ? size : best), value[0]);
  }
  const f = needObj(file, field, updateId);
  const fileId = f.file_id;
  const fileUniqueId = f.file_unique_id;
  if (typeof fileId !== "string" || fileId === "") {
    throw new TelegramUpdateError(`${field}.file_id`, `Telegram update field "${field}.file_id" must be a non-empty string, got ${show(fileId)}`, updateId);
  }
  // Absent from updates older than Bot API 4.5 (as in the Bot API docs' own examples): "" then.
  if (fileUniqueId !== undefined && typeof fileUniqueId !== "string") {
    throw new TelegramUpdateError(
      `${field}.file_unique_id`,
      `Telegram update field "${field}.file_unique_id" must be a string, got ${show(fileUniqueId)}`,
      updateId,
    );
  }
  const ref: TelegramMediaRef = { fileId, fileUniqueId: fileUniqueId ?? "", kind };
  const mime = optString(f.mime_type, `${field}.mime_type`, updateId) ?? (kind === "photo" ? "image/jpeg" : undefined);
  if (mime !== undefined) ref.mimeType = mime;
  const name = optString(f.file_name, `${field}.file_name`, updateId);
  if (name !== undefined) ref.fileName = name;
  if (typeof f.file_size === "number" && Number.isFinite(f.file_size)) ref.fileSize = f.file_size;
  return ref;
}

function sender(from: unknown): { from?: string; username?: string } {
  if (!isObj(from) || (typeof from.id !== "number" && typeof from.id !== "string")) return {};
  return { from: String(from.id), ...(typeof from.username === "string" ? { username: from.username } : {}) };
}

/**
 * Turn one Telegram update into an inbound message (or say it is skipped).
 *
 * @param update the update as Telegram sent it
 * @param botId the bot's id (in every message id)
 * @param seal seals media references
 * @returns the message, or the skipped kind
 * @throws {TelegramUpdateError} naming the field when the update is malformed
 */
export async function parseTelegramUpdate(update: unknown, botId: string, seal: MediaSeal): Promise<ParsedUpdate> {
  const u = needObj(update, "update");
  const updateId = needInt(u.update_id, "update_id");
  const { cutAt } = cutDeepNesting(u, TELEGRAM_MAX_UPDATE_DEPTH);
  if (cutAt !== undefined) {
    throw new TelegramUpdateError(
      cutAt,
      `Telegram update field "${cutAt}" nests deeper than ${TELEGRAM_MAX_UPDATE_DEPTH} levels of objects and arrays ` +
        `(TELEGRAM_MAX_UPDATE_DEPTH): the update is kept cut at that depth`,
      updateId,
    );
  }
  if (u.callback_query !== undefined) {
    const q = needObj(u.callback_query, "callback_query", updateId);
    const queryId = q.id;
    if (typeof queryId !== "string" || queryId === "") {
      throw new TelegramUpdateError("callback_query.id", `Telegram update field "callback_query.id" must be a non-empty string, got ${show(queryId)}`, updateId);
    }
    const data = optString(q.data, "callback_query.data", updateId);
    const game = optString(q.game_short_name, "callback_query.game_short_name", updateId);
    const who = sender(q.from);
    let chatId: string;
    let messageId: number | undefined;
    if (q.message !== undefined) {
      const m = needObj(q.message, "callback_query.message", updateId);
      const chat = needObj(m.chat, "callback_query.message.chat", updateId);
      chatId = String(needInt(chat.id, "callback_query.message.chat.id", updateId));
      if (typeof m.message_id === "number") messageId = m.message_id;
    } else if (who.from !== undefined) {
      chatId = who.from; // an inline message's button: the user's private chat
    } else {
      throw new TelegramUpdateError("callback_query.from.id", `Telegram update field "callback_query.from.id" is missing (and there is no "message")`, updateId);
    }
    const value: Record<string, JsonValue> = { callbackQueryId: queryId };
    if (data !== undefined) value.data = data;
    if (game !== undefined) value.gameShortName = game;
    if (messageId !== undefined) value.messageId = messageId;
    if (typeof q.inline_message_id === "string") value.inlineMessageId = q.inline_message_id;
    if (typeof q.chat_instance === "string") value.chatInstance = q.chat_instance;
    const message: InboundMessage = {
      id: `tg:${botId}:${updateId}:cb:${queryId}`,
      chatId,
      type: "interaction",
      interaction: { id: data ?? game ?? "", value },
      ...(who.from !== undefined ? { from: who.from } : {}),
      extra: { updateId, ...(who.username !== undefined ? { username: who.username } : {}) },
    };
    return { kind: "message", updateId, message, callbackQueryId: queryId };
  }
  const key = MESSAGE_UPDATES.find((k) => u[k] !== undefined);
  if (key === undefined) {
    const kind = Object.keys(u).find((k) => k !== "update_id") ?? "unknown";
    return { kind: "skipped", updateId, skipped: { updateId, kind, update: u } };
  }
  const m = needObj(u[key], key, updateId);
  const chat = needObj(m.chat, `${key}.chat`, updateId);
  const chatId = String(needInt(chat.id, `${key}.chat.id`, updateId));
  const messageId = needInt(m.message_id, `${key}.message_id`, updateId);
  const id = `tg:${botId}:${updateId}:${chatId}:${messageId}`;
  const text = optString(m.text, `${key}.text`, updateId);
  const caption = optString(m.caption, `${key}.caption`, updateId);
  let type: MessageType;
  let media: JsonValue | undefined;
  const extra: Record<string, JsonValue> = { updateId, messageId };
  if (typeof chat.type === "string") extra.chatType = chat.type;
  // The more specific kinds first: an animation also has "document", a venue also has "location".
  // A field that is null (as some serializers write an absent one) counts as absent.
  const mediaField = INBOUND_MEDIA.find((f) => m[f] != null);
  const typed = mediaField === undefined ? TYPED_KINDS.find((k) => m[k.field] != null) : undefined;
  if (mediaField !== undefined) {
    const ref = fileRef(m[mediaField], mediaField, `${key}.${mediaField}`, updateId);
    type = TYPE_OF[mediaField];
    media = await sealMediaRef(seal, ref);
  } else if (typed !== undefined) {
    const field = `${key}.${typed.field}`;
    const value = m[typed.field];
    if (typed.shape === "array" ? !Array.isArray(value) || !value.every(isObj) : !isObj(value)) {
      const rule = typed.shape === "array" ? "an array of objects" : "an object";
      throw new TelegramUpdateError(field, `Telegram update field "${field}" must be ${rule}, got ${show(value)}`, updateId);
    }
    for (const name of typed.required ?? []) {
      if (typeof (value as Obj)[name] !== "string") {
        throw new TelegramUpdateError(
          `${field}.${name}`,
          `Telegram update field "${field}.${name}" must be a string, got ${show((value as Obj)[name])}`,
          updateId,
        );
      }
    }
    type = typed.field;
    extra[typed.field] = value as JsonValue;
  } else if (text !== undefined) {
    type = "text";
  } else {
    // A service message (a new title, a pinned message, …) or a kind newer than this provider
    // (a caption without a known media field): its content stays readable in the raw object.
    type = "other";
    extra.raw = m as JsonValue;
  }
  if (typeof m.media_group_id === "string") extra.mediaGroupId = m.media_group_id;
  if (key === "business_message" && typeof m.business_connection_id === "string") {
    extra.businessConnectionId = m.business_connection_id;
  }
  const who = sender(m.from);
  if (who.username !== undefined) extra.username = who.username;
  const body = text ?? caption;
  const message: InboundMessage = {
    id,
    chatId,
    type,
    ...(body !== undefined ? { text: body } : {}),
    ...(media !== undefined ? { media } : {}),
    ...(who.from !== undefined ? { from: who.from } : {}),
    ...(typeof m.date === "number" && m.date > 0 ? { timestamp: m.date * 1000 } : {}),
    extra,
  };
  return { kind: "message", updateId, message };
}

/**
 * The record for a user's update that {@link parseTelegramUpdate} could not parse:
 * journaled with `unreadable` (the reason) and the update in `extra.raw` (cut at
 * {@link TELEGRAM_MAX_UPDATE_DEPTH} levels), so
 * that the bot dead-letters it instead of it being acknowledged and lost. Its
 * id is stable across redeliveries: the usual
 * `tg:<bot id>:<update_id>:<chat id>:<message_id>` (or `…:cb:<query id>`),
 * with `-` for an id that is missing, and a SHA-256 of the update in place of
 * an `update_id` that is not an integer. Its chat is the chat id present in
 * the update, else `tg:<bot id>:unreadable`.
 *
 * @param update the update as Telegram sent it
 * @param error why it could not be parsed
 * @param botId the bot's id
 * @returns the message, or `undefined` when the update is certainly not a user's (not an object, or of no message-carrying kind)
 */
export async function unreadableUpdate(received: unknown, error: Error, botId: string): Promise<InboundMessage | undefined> {
  if (!isObj(received)) return undefined;
  // Kept cut at TELEGRAM_MAX_UPDATE_DEPTH: an update nested deeper could not be journaled.
  const update = cutDeepNesting(received, TELEGRAM_MAX_UPDATE_DEPTH).value as Obj;
  const kind = USER_UPDATES.find((k) => update[k] !== undefined);
  if (kind === undefined) return undefined;
  const intOf = (v: unknown) => (typeof v === "number" && Number.isSafeInteger(v) ? v : undefined);
  const updateId = intOf(update.update_id);
  // Of the update as sent, not as kept: two updates cut to the same copy are still two updates.
  const idPart = updateId !== undefined ? String(updateId) : `h${(await sha256Hex(jsonText(received)!)).slice(0, 32)}`;
  const body = update[kind];
  const m = kind === "callback_query" ? (isObj(body) ? body.message : undefined) : body;
  let chat = isObj(m) && isObj(m.chat) ? intOf(m.chat.id) : undefined;
  const who = sender(isObj(body) ? body.from : undefined);
  let id: string;
  if (kind === "callback_query") {
    const queryId = isObj(body) && typeof body.id === "string" && body.id !== "" ? body.id : "-";
    id = `tg:${botId}:${idPart}:cb:${queryId}`;
    // An inline message's button: the user's private chat, as for a readable one.
    if (chat === undefined && who.from !== undefined && /^-?\d+$/.test(who.from)) chat = Number(who.from);
  } else {
    const messageId = isObj(m) ? intOf(m.message_id) : undefined;
    id = `tg:${botId}:${idPart}:${chat ?? "-"}:${messageId ?? "-"}`;
  }
  const date = isObj(m) ? intOf(m.date) : undefined;
  return {
    id,
    chatId: chat !== undefined ? String(chat) : `tg:${botId}:unreadable`,
    type: "unreadable",
    unreadable: error.message,
    ...(who.from !== undefined ? { from: who.from } : {}),
    ...(date !== undefined && date > 0 ? { timestamp: date * 1000 } : {}),
    extra: { updateKind: kind, ...(updateId !== undefined ? { updateId } : {}), raw: update as JsonValue },
  };
}
