/**
 * Chat ids: a phone number as is, `bsuid:<id>` for a user known only by
 * business-scoped user id, `group:<id>` for a group.
 *
 * @module
 */
import { showValue as show } from "../../src/show.ts";

/** The prefix of a chat id that is a business-scoped user id (a user whose phone number Meta withholds). */
export const USER_PREFIX: string = "bsuid:";
/** The prefix of a chat id that is a group (Groups API). */
export const GROUP_PREFIX: string = "group:";
/** A business-scoped user id or parent one: country code, a period, (`ENT.`), up to 128 alphanumerics. */
const BSUID_PATTERN = /^[A-Z]{2}\.(?:ENT\.)?[A-Za-z0-9]{1,128}$/;

/** Who a chat id addresses: a phone number, a business-scoped user id, or a group. */
export type WhatsAppRecipient =
  /** A WhatsApp user by phone number (`wa_id`, digits): sent with `to`. */
  | { kind: "phone"; phone: string }
  /** A WhatsApp user by business-scoped user id (or parent one): sent with `recipient`. */
  | { kind: "user"; userId: string }
  /** A group made with the Groups API: sent with `recipient_type: "group"` and `to`. */
  | { kind: "group"; groupId: string };

/**
 * The chat id the provider uses for a recipient: the phone number as is
 * (digits, as before business-scoped user ids existed), `bsuid:<user id>`
 * for a user known only by business-scoped user id, `group:<group id>` for a
 * group. The prefixes keep the three apart whatever Meta's ids look like.
 *
 * @param recipient a phone number, a business-scoped user id, or a group id
 * @returns the chat id
 * @throws {TypeError} when the id is empty
 *
 * @example
 * ```ts
 * import { whatsAppChatId } from "@botmesh/durable/whatsapp";
 * whatsAppChatId({ kind: "user", userId: "US.13491208655302741918" }); // "bsuid:US.13491208655302741918"
 * ```
 */
export function whatsAppChatId(recipient: WhatsAppRecipient): string {
  const id = recipient.kind === "phone" ? recipient.phone : recipient.kind === "user" ? recipient.userId : recipient.groupId;
  if (typeof id !== "string" || id === "") throw new TypeError(`A WhatsApp ${recipient.kind} id must be a non-empty string, got ${show(id)}`);
  return recipient.kind === "phone" ? id : `${recipient.kind === "user" ? USER_PREFIX : GROUP_PREFIX}${id}`;
}

/**
 * Read a chat id back: `group:<id>` is a group, `bsuid:<id>` (or a bare
 * business-scoped user id such as `US.13491208655302741918`) a user by
 * business-scoped user id, anything else a phone number.
 *
 * @param chatId a chat id of this provider
 * @returns who it addresses
 */
export function parseWhatsAppChatId(chatId: string): WhatsAppRecipient {
  if (chatId.startsWith(GROUP_PREFIX)) return { kind: "group", groupId: chatId.slice(GROUP_PREFIX.length) };
  if (chatId.startsWith(USER_PREFIX)) return { kind: "user", userId: chatId.slice(USER_PREFIX.length) };
  if (BSUID_PATTERN.test(chatId)) return { kind: "user", userId: chatId };
  return { kind: "phone", phone: chatId };
}

/** The longest id that gets a prefix in a chat id (a BSUID is at most 2 + 1 + 4 + 128 characters). */
export const MAX_PREFIXED_ID: number = 256;
