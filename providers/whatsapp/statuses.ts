/**
 * Status callbacks: the delivery status of a message the bot sent, as the
 * webhook reads it.
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import { GROUP_PREFIX, MAX_PREFIXED_ID, USER_PREFIX } from "./chat_ids.ts";
import { parseTimestamp, requireString, usableString, WhatsAppPayloadError } from "./payloads.ts";
import { brief, isObject } from "./values.ts";

/** A delivery status of a message the bot sent, from a status callback of the webhook. */
export interface WhatsAppStatus {
  /** The `wamid` of the sent message (the `messageId` its send returned). */
  id: string;
  /** `'sent'`, `'delivered'`, `'read'`, `'failed'`, or whatever else Meta reports. */
  status: string;
  /** The recipient's WhatsApp id (its phone number), or the group id of a send to a group; absent for a send to a business-scoped user id whose phone number Meta withholds. */
  recipientId?: string;
  /** The recipient's business-scoped user id (`recipient_user_id`), when Meta gives it. */
  recipientUserId?: string;
  /**
   * The chat the send went to, as the provider's chat ids spell it (see
   * {@link whatsAppChatId}): the group for a send to a group, else the phone
   * number when Meta gives it, else the business-scoped user id.
   */
  chatId?: string;
  /** For a send to a group: the participant this status is about (`recipient_participant_id`, else its user id). */
  participant?: string;
  /** When it happened (ms since epoch). */
  timestamp?: number;
  /** The `biz_opaque_callback_data` of the send: its outbox idempotency key, unless `callbackData: false`. */
  callbackData?: string;
  /** The errors of a `failed` status, as Meta sent them (cut at `WHATSAPP_MAX_MESSAGE_DEPTH` levels, as `raw` is). */
  errors?: JsonValue;
  /** The status object as Meta sent it; nested deeper than `WHATSAPP_MAX_MESSAGE_DEPTH` levels, it is cut there. */
  raw: JsonValue;
}

/** Statuses that say a send reached WhatsApp: with its `biz_opaque_callback_data`, `sink.confirmSent` settles it. */
export const CONFIRMING_STATUSES: ReadonlySet<string> = new Set(["sent", "delivered", "read", "played"]);

/**
 * Read one status entry.
 *
 * @param raw the entry as Meta sent it
 * @param path where it is in the payload
 * @returns the status
 * @throws {WhatsAppPayloadError} naming the field when a required one is missing or invalid
 */
export function parseStatus(raw: unknown, path: string): WhatsAppStatus {
  if (!isObject(raw)) throw new WhatsAppPayloadError(path, "", `a status must be an object, got ${brief(raw)}`);
  const id = requireString(raw, "id", path);
  const status = requireString(raw, "status", path);
  const result: WhatsAppStatus = { id, status, raw: raw as JsonValue };
  const recipientId = usableString(raw.recipient_id, 512);
  const recipientUserId = usableString(raw.recipient_user_id, MAX_PREFIXED_ID) ??
    usableString(raw.recipient_parent_user_id, MAX_PREFIXED_ID);
  if (recipientId !== undefined) result.recipientId = recipientId;
  if (recipientUserId !== undefined) result.recipientUserId = recipientUserId;
  if (raw.recipient_type === "group" && recipientId !== undefined) {
    result.chatId = GROUP_PREFIX + recipientId;
    const participant = usableString(raw.recipient_participant_id, 512) ?? usableString(raw.participant_recipient_id, 512);
    const participantUser = usableString(raw.recipient_participant_user_id, MAX_PREFIXED_ID) ??
      usableString(raw.recipient_participant_parent_user_id, MAX_PREFIXED_ID);
    if (participant !== undefined) result.participant = participant;
    else if (participantUser !== undefined) result.participant = USER_PREFIX + participantUser;
  } else if (recipientId !== undefined) {
    result.chatId = recipientId;
  } else if (recipientUserId !== undefined) {
    result.chatId = USER_PREFIX + recipientUserId;
  }
  const timestamp = parseTimestamp(raw.timestamp, path);
  if (timestamp !== undefined) result.timestamp = timestamp;
  if (typeof raw.biz_opaque_callback_data === "string") result.callbackData = raw.biz_opaque_callback_data;
  if (raw.errors !== undefined) result.errors = raw.errors as JsonValue;
  return result;
}
