/**
 * Inbound messages of a webhook POST: a message entry read into an inbound
 * message (its chat, sender, type and media), or journaled as unreadable.
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import type { MediaSeal } from "../../src/media.ts";
import type { InboundMessage, Interaction } from "../../src/provider.ts";
import { setOwn } from "../../src/rules.ts";
import { jsonText, sha256Hex } from "../../src/sha256_hex.ts";
import { GROUP_PREFIX, MAX_PREFIXED_ID, USER_PREFIX } from "./chat_ids.ts";
import { MEDIA_TYPES } from "./media.ts";
import { optionalString, parseTimestamp, requireString, usableString, WhatsAppPayloadError } from "./payloads.ts";
import { brief, isObject } from "./values.ts";

/** A message of a webhook POST, parsed, before its media is sealed. */
export interface ParsedMessage {
  message: Omit<InboundMessage, "media">;
  media?: { ref: { [key: string]: JsonValue } } | { why: string };
}

/** A message entry of a webhook POST: parsed, or not parseable (journaled as unreadable). */
export type MessageEntry = { parsed: ParsedMessage } | {
  /** The entry as it is kept (cut at `WHATSAPP_MAX_MESSAGE_DEPTH`). */
  raw: unknown;
  /** The entry as Meta sent it, whole. */
  received: unknown;
  error: WhatsAppPayloadError;
};

/**
 * The field `key` of an object from the payload, when it is the object's own:
 * a key the sender names (a message's `type`, an interactive reply's `type`)
 * never reads a member of `Object.prototype` (`constructor`, `toString`,
 * `__proto__`, …).
 */
function ownField(object: Record<string, unknown>, key: string): unknown {
  return Object.hasOwn(object, key) ? object[key] : undefined;
}

/** What the `contacts` array of a change says about each sender, by phone number and by user id. */
export interface ContactInfo {
  name?: string;
  username?: string;
}

/** The contacts of a change, keyed by `wa_id` and by `user_id` (and `parent_user_id`). */
export function contactsOf(value: Record<string, unknown>): Map<string, ContactInfo> {
  const contacts = new Map<string, ContactInfo>();
  if (!Array.isArray(value.contacts)) return contacts;
  for (const contact of value.contacts) {
    if (!isObject(contact)) continue;
    const profile = isObject(contact.profile) ? contact.profile : {};
    const info: ContactInfo = {};
    if (typeof profile.name === "string") info.name = profile.name;
    if (typeof profile.username === "string") info.username = profile.username;
    for (const key of ["wa_id", "user_id", "parent_user_id"]) {
      const id = contact[key];
      if (typeof id === "string" && id !== "" && !contacts.has(id)) contacts.set(id, info);
    }
  }
  return contacts;
}

/**
 * The business-scoped user id of a change's only contact (`contacts[0].user_id`, else its
 * `parent_user_id`), when the change has exactly one: the sender of a message that names none itself.
 */
export function soleContactUserId(value: Record<string, unknown>): string | undefined {
  if (!Array.isArray(value.contacts) || value.contacts.length !== 1 || !isObject(value.contacts[0])) return undefined;
  const contact = value.contacts[0];
  return usableString(contact.user_id, MAX_PREFIXED_ID) ?? usableString(contact.parent_user_id, MAX_PREFIXED_ID);
}

/**
 * The sender of a message and the chat it belongs to. The chat id rule: a
 * group message's chat is `group:<group_id>`; otherwise the chat is the
 * sender's phone number (`from`) whenever Meta gives it, and `bsuid:<user id>`
 * only when it does not (a user with a username whose phone number is
 * withheld). A user's chat id therefore stays the phone number as long as
 * Meta shares it, which keeps every chat journaled before business-scoped user
 * ids existed; it changes only when Meta stops sharing the phone number.
 */
interface Sender {
  chatId: string;
  /** The participant (a phone number or `bsuid:<id>`), when known. */
  from?: string;
  phone?: string;
  userId?: string;
  parentUserId?: string;
  groupId?: string;
}

function senderOf(raw: Record<string, unknown>, path: string, soleUserId: string | undefined): Sender {
  const phone = optionalString(raw, "from", path);
  // A message that names no sender of its own belongs to the change's only contact, when there is one.
  const userId = optionalString(raw, "from_user_id", path, MAX_PREFIXED_ID) ??
    (raw.from === undefined && raw.from_parent_user_id === undefined ? soleUserId : undefined);
  const parentUserId = optionalString(raw, "from_parent_user_id", path, MAX_PREFIXED_ID);
  const groupId = raw.group_id === undefined || raw.group_id === null
    ? undefined
    : requireString(raw, "group_id", path, MAX_PREFIXED_ID);
  const participant = phone ?? (userId !== undefined ? USER_PREFIX + userId : parentUserId !== undefined ? USER_PREFIX + parentUserId : undefined);
  const sender: Sender = groupId !== undefined
    ? { chatId: GROUP_PREFIX + groupId, groupId }
    : participant !== undefined
    ? { chatId: participant }
    : (() => {
      throw new WhatsAppPayloadError(
        path,
        "from_user_id",
        `the message has no sender: field "from" (the phone number) is ${brief(raw.from)}, field "from_user_id" ` +
          `(the business-scoped user id) is ${brief(raw.from_user_id)}, and the change has no sole contact with a "user_id"`,
      );
    })();
  if (participant !== undefined) sender.from = participant;
  if (phone !== undefined) sender.phone = phone;
  if (userId !== undefined) sender.userId = userId;
  if (parentUserId !== undefined) sender.parentUserId = parentUserId;
  return sender;
}

/**
 * Read one message entry.
 *
 * @param raw the entry as Meta sent it
 * @param path where it is in the payload
 * @param contacts the contacts of its change
 * @param soleUserId the user id of the change's only contact (see {@link soleContactUserId}): the sender of a message that names none
 * @returns the message, its media not yet sealed
 * @throws {WhatsAppPayloadError} naming the field when a required one is missing or invalid
 */
export function parseMessage(raw: unknown, path: string, contacts: Map<string, ContactInfo>, soleUserId?: string): ParsedMessage {
  if (!isObject(raw)) throw new WhatsAppPayloadError(path, "", `a message must be an object, got ${brief(raw)}`);
  const id = requireString(raw, "id", path);
  const sender = senderOf(raw, path, soleUserId);
  const type = requireString(raw, "type", path);
  const timestamp = parseTimestamp(raw.timestamp, path);
  const extra: { [key: string]: JsonValue } = { waType: type };
  const contact = (sender.phone !== undefined ? contacts.get(sender.phone) : undefined) ??
    (sender.userId !== undefined ? contacts.get(sender.userId) : undefined) ??
    (sender.parentUserId !== undefined ? contacts.get(sender.parentUserId) : undefined);
  if (contact?.name !== undefined) extra.profileName = contact.name;
  if (contact?.username !== undefined) extra.username = contact.username;
  if (sender.phone !== undefined) extra.waId = sender.phone;
  if (sender.userId !== undefined) extra.userId = sender.userId;
  if (sender.parentUserId !== undefined) extra.parentUserId = sender.parentUserId;
  if (sender.groupId !== undefined) extra.groupId = sender.groupId;
  for (const key of ["context", "referral", "errors"]) {
    if (raw[key] !== undefined) extra[key] = raw[key] as JsonValue;
  }
  const message: Omit<InboundMessage, "media"> = { id, chatId: sender.chatId, type };
  if (sender.from !== undefined) message.from = sender.from;
  if (timestamp !== undefined) message.timestamp = timestamp;
  let media: ParsedMessage["media"];
  const body = ownField(raw, type);

  if (type === "text") {
    if (!isObject(body) || typeof body.body !== "string") {
      throw new WhatsAppPayloadError(path, "text.body", `field "text.body" must be a string, got ${brief(isObject(body) ? body.body : body)}`);
    }
    message.text = body.body;
  } else if ((MEDIA_TYPES as readonly string[]).includes(type)) {
    if (!isObject(body)) throw new WhatsAppPayloadError(path, type, `field "${type}" must be an object, got ${brief(body)}`);
    if (typeof body.caption === "string") message.text = body.caption;
    if (typeof body.id === "string" && body.id !== "") {
      const ref: { [key: string]: JsonValue } = { mediaId: body.id };
      if (typeof body.mime_type === "string") ref.mimeType = body.mime_type;
      if (typeof body.sha256 === "string") ref.sha256 = body.sha256;
      if (typeof body.filename === "string") ref.fileName = body.filename;
      media = { ref };
    } else {
      media = { why: `the ${type} has no media id (view-once or not downloadable)` };
    }
    const info: { [key: string]: JsonValue } = {};
    for (const key of ["mime_type", "filename", "voice", "animated"]) {
      if (body[key] !== undefined) info[key] = body[key] as JsonValue;
    }
    setOwn(extra, type, info);
  } else if (type === "interactive") {
    if (!isObject(body) || typeof body.type !== "string") {
      throw new WhatsAppPayloadError(path, "interactive.type", `field "interactive.type" must be a string, got ${brief(isObject(body) ? body.type : body)}`);
    }
    const reply = ownField(body, body.type);
    let interaction: Interaction;
    if (body.type === "button_reply" || body.type === "list_reply") {
      if (!isObject(reply) || typeof reply.id !== "string" || reply.id === "") {
        throw new WhatsAppPayloadError(
          path,
          `interactive.${body.type}.id`,
          `field "interactive.${body.type}.id" must be a non-empty string, got ${brief(isObject(reply) ? reply.id : reply)}`,
        );
      }
      const value: { [key: string]: JsonValue } = { kind: body.type };
      if (typeof reply.title === "string") value.title = reply.title;
      if (typeof reply.description === "string") value.description = reply.description;
      interaction = { id: reply.id, value };
    } else if (body.type === "nfm_reply" && isObject(reply)) {
      // a WhatsApp Flow's answer
      const value: { [key: string]: JsonValue } = { kind: "nfm_reply" };
      if (typeof reply.body === "string") value.title = reply.body;
      if (typeof reply.response_json === "string") {
        try {
          value.response = JSON.parse(reply.response_json) as JsonValue;
        } catch {
          value.response = reply.response_json;
        }
      }
      interaction = { id: typeof reply.name === "string" && reply.name !== "" ? reply.name : "flow", value };
    } else {
      interaction = { id: body.type, value: { kind: body.type, raw: (reply ?? null) as JsonValue } };
    }
    message.type = "interaction";
    message.interaction = interaction;
  } else if (type === "button") {
    // a quick-reply button of a template message
    if (!isObject(body) || (typeof body.payload !== "string" && typeof body.text !== "string")) {
      throw new WhatsAppPayloadError(path, "button.payload", `field "button.payload" must be a string, got ${brief(isObject(body) ? body.payload : body)}`);
    }
    const id = typeof body.payload === "string" && body.payload !== "" ? body.payload : String(body.text);
    const value: { [key: string]: JsonValue } = { kind: "button" };
    if (typeof body.text === "string") value.title = body.text;
    if (typeof body.payload === "string") value.payload = body.payload;
    message.type = "interaction";
    message.interaction = { id, value };
  } else {
    // reaction, location, contacts, order, system, unsupported, …: admitted as their own type,
    // with Meta's object in `extra`, for a handler that wants them (no handler, no harm).
    if (type === "reaction" && isObject(body) && typeof body.emoji === "string") message.text = body.emoji;
    if (type === "location" && isObject(body)) {
      const label = [body.name, body.address].filter((s) => typeof s === "string" && s !== "").join(", ");
      if (label !== "") message.text = label;
    }
    // A type naming a member of Object.prototype with no such field reads as null, not as the member.
    if (body !== undefined) setOwn(extra, type, body as JsonValue);
    else if (type in extra) setOwn(extra, type, null);
  }
  message.extra = extra;
  return media === undefined ? { message } : { message, media };
}

/**
 * A user message that could not be parsed, as it is journaled: `unreadable`
 * says why (naming the field), `extra.raw` keeps Meta's object. Its id is the
 * `wamid` when the message has a usable one, else `unreadable:sha256:` and the
 * SHA-256 of the message's JSON (whole, as Meta sent it), so a redelivery of the POST is a duplicate.
 * Its chat is whatever sender or group field is usable, else
 * `wa:<phone number id>:unreadable`.
 */
async function unreadableMessage(entry: { raw: unknown; received: unknown; error: WhatsAppPayloadError }, phoneNumberId: string): Promise<InboundMessage> {
  const { raw, error } = entry;
  const m = isObject(raw) ? raw : {};
  let id = usableString(m.id, 512);
  if (id === undefined) {
    // Of the message as sent, not as kept: two messages cut to the same copy are still two messages.
    id = `unreadable:sha256:${await sha256Hex(jsonText(entry.received) ?? "undefined")}`;
  }
  const groupId = usableString(m.group_id, MAX_PREFIXED_ID);
  const phone = usableString(m.from, 512);
  const userId = usableString(m.from_user_id, MAX_PREFIXED_ID) ?? usableString(m.from_parent_user_id, MAX_PREFIXED_ID);
  const participant = phone ?? (userId !== undefined ? USER_PREFIX + userId : undefined);
  const chatId = groupId !== undefined ? GROUP_PREFIX + groupId : participant ?? `wa:${phoneNumberId}:unreadable`;
  const waType = usableString(m.type, 64);
  const extra: { [key: string]: JsonValue } = { raw: (raw ?? null) as JsonValue, field: error.field, path: error.path };
  if (waType !== undefined) extra.waType = waType;
  const message: InboundMessage = { id, chatId, type: waType ?? "unreadable", unreadable: error.reason, extra };
  if (participant !== undefined) message.from = participant;
  try {
    const timestamp = parseTimestamp(m.timestamp, error.path);
    if (timestamp !== undefined) message.timestamp = timestamp;
  } catch {
    // no usable timestamp: none
  }
  return message;
}

/**
 * The inbound message of one message entry, as it is journaled: its media
 * sealed, or unreadable.
 *
 * @param entry the entry, parsed or not
 * @param seal seals media references
 * @param phoneNumberId the business phone number id (the chat of an unreadable message without a sender)
 * @returns the message for the bot
 */
export async function inboundMessageOf(entry: MessageEntry, seal: MediaSeal, phoneNumberId: string): Promise<InboundMessage> {
  if ("error" in entry) return await unreadableMessage(entry, phoneNumberId);
  const p = entry.parsed;
  if (p.media === undefined) return p.message as InboundMessage;
  const media = "ref" in p.media ? await seal.seal(p.media.ref) : seal.notDurable(p.media.why);
  return { ...p.message, media: media as unknown as JsonValue };
}
