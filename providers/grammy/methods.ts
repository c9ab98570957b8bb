/**
 * Which Bot API calls go through the outbox, what is journaled of them, and
 * the answer grammY gets back.
 *
 * @module
 */
import type { SendResult } from "../../src/engine.ts";
import { setOwn } from "../../src/rules.ts";
import { isObj, type Obj } from "../telegram/values.ts";

/** Methods that look like sends but create no message a user could get twice. */
const NOT_JOURNALED = new Set(["sendChatAction", "sendMessageDraft", "sendRichMessageDraft"]);
/**
 * Calls with no `chat_id` that create a message or spend Stars: journaled too, in the chat of the
 * user they concern (`user_id`), of the business account (`business_connection_id`) or of the guest
 * query (`guest_query_id`).
 */
const UNCHATTED = new Set([
  "giftPremiumSubscription",
  "transferBusinessAccountStars",
  "postStory",
  "repostStory",
  "answerGuestQuery",
]);
/** Journaled methods whose answer is `true`, whatever the receipt kept. */
const TRUE_RESULTS = new Set(["sendGift", "giftPremiumSubscription", "transferBusinessAccountStars"]);
/** Journaled methods whose answer is a `Story` (`{ chat, id }`). */
const STORY_RESULTS = new Set(["postStory", "repostStory"]);
/** Message-creating methods whose answer is an array. */
const ARRAY_RESULTS = new Set(["sendMediaGroup", "forwardMessages", "copyMessages"]);
/** Message-creating methods whose answer is a `MessageId` (`{ message_id }`) rather than a `Message`. */
const MESSAGE_ID_RESULTS = new Set(["copyMessage", "copyMessages"]);

/**
 * Whether a Bot API method creates a message and so goes through the outbox:
 * every `send*` but `sendChatAction` and the drafts, `forwardMessage(s)` and
 * `copyMessage(s)`. Edits, deletions, callback answers and everything else
 * are called directly.
 *
 * @param method the Bot API method
 * @returns whether calls of it are journaled
 */
export function isJournaledMethod(method: string): boolean {
  if (NOT_JOURNALED.has(method)) return false;
  return /^send[A-Z]/.test(method) || /^(forward|copy)Messages?$/.test(method) || UNCHATTED.has(method);
}

function idOf(value: unknown): string | undefined {
  return typeof value === "number" || (typeof value === "string" && value !== "") ? String(value) : undefined;
}

/**
 * The chat a journaled call is kept in order (and rate-limited) under: its `chat_id`; else, for a
 * call that has none, the user it concerns (`user_id`, as that user's private chat), the business
 * account (`business:<business_connection_id>`) or the guest query (`guest:<guest_query_id>`).
 *
 * @param payload the call's parameters
 * @returns the chat, `undefined` when the call names none (it is then made directly)
 */
export function journalChatOf(payload: Obj): string | undefined {
  const chat = idOf(payload.chat_id) ?? idOf(payload.user_id);
  if (chat !== undefined) return chat;
  const connection = idOf(payload.business_connection_id);
  if (connection !== undefined) return `business:${connection}`;
  const guest = idOf(payload.guest_query_id);
  return guest === undefined ? undefined : `guest:${guest}`;
}

/** Whether a value is an upload (a grammY `InputFile`, a stream, a Blob): it cannot be journaled. */
function isUpload(value: object): boolean {
  return typeof (value as { toRaw?: unknown }).toRaw === "function" ||
    (typeof Blob !== "undefined" && value instanceof Blob) ||
    (typeof ReadableStream !== "undefined" && value instanceof ReadableStream) ||
    (typeof (value as { pipe?: unknown }).pipe === "function");
}

function plain(value: unknown): unknown {
  if (typeof value !== "object" || value === null) return value;
  if (isUpload(value) || value instanceof Uint8Array) return value;
  if (Array.isArray(value)) return value.map(plain);
  const proto = Object.getPrototypeOf(value);
  // A grammY Keyboard or InlineKeyboard: what grammY would put on the wire is its JSON.
  if (proto !== Object.prototype && proto !== null) return JSON.parse(JSON.stringify(value));
  const out: Obj = {};
  for (const [key, item] of Object.entries(value)) if (item !== undefined) setOwn(out, key, plain(item));
  return out;
}

/**
 * The outbound content of one call: `{ method, ...payload }`, with keyboard
 * objects turned into the JSON grammY would send. An upload (`InputFile`) is
 * kept as it is: the bot then sends that content once, without the journal.
 *
 * @param method the Bot API method
 * @param payload its parameters
 * @returns the content
 */
export function callContent(method: string, payload: Obj): Obj {
  return { ...(plain(payload) as Obj), method };
}

/**
 * The message id(s) of a call's answer, as the receipt keeps them: comma-separated for an array.
 *
 * @param result what the Bot API answered
 * @returns the ids, `""` when the answer holds none (`true`)
 */
export function messageIdsOf(result: unknown): string {
  const items = Array.isArray(result) ? result : [result];
  const idOfItem = (item: unknown): string => {
    if (!isObj(item)) return "";
    if (item.message_id !== undefined) return String(item.message_id);
    // A story (`id`), a guest query's inline message (`inline_message_id`).
    if (typeof item.inline_message_id === "string") return item.inline_message_id;
    return item.id !== undefined && isObj(item.chat) ? String(item.id) : "";
  };
  return items.map(idOfItem).filter((id) => id !== "").join(",");
}

/**
 * The answer grammY gets for a send the outbox has but whose real answer is
 * gone (sent before a crash, or by another process): a minimal `Message` of
 * `message_id` and `chat.id` per message (`MessageId` for copies), `{ id }`
 * for a story, `{ inline_message_id }` for a guest query's answer, `true`
 * for a method that answers no message.
 *
 * @param method the Bot API method
 * @param payload its parameters
 * @param messageIds what the receipt kept
 * @returns the answer
 */
export function minimalResult(method: string, payload: Obj, messageIds: string): unknown {
  if (TRUE_RESULTS.has(method)) return true;
  if (STORY_RESULTS.has(method)) return { id: Number(messageIds) || 0 };
  if (method === "answerGuestQuery") return { inline_message_id: messageIds };
  if (messageIds === "") return ARRAY_RESULTS.has(method) ? [] : true;
  const chatId = payload.chat_id;
  const chat = { id: typeof chatId === "string" && /^-?\d+$/.test(chatId) ? Number(chatId) : chatId };
  const items = messageIds.split(",").map((id) => {
    const messageId = Number(id);
    return MESSAGE_ID_RESULTS.has(method) ? { message_id: messageId } : { message_id: messageId, chat };
  });
  return ARRAY_RESULTS.has(method) ? items : items[0];
}

/**
 * A placeholder answer for a send the outbox holds for later (queued for a
 * retry, or of unknown outcome): `message_id` is `0`, the chat is the one
 * sent to. The send itself is the outbox's from here on.
 *
 * @param method the Bot API method
 * @param payload its parameters
 * @returns the answer
 */
export function placeholderResult(method: string, payload: Obj): unknown {
  return minimalResult(method, payload, ARRAY_RESULTS.has(method) || TRUE_RESULTS.has(method) || method === "answerGuestQuery" ? "" : "0");
}

/** The Bot API's error answer for a send that ended `dead`. */
export interface ApiFailure {
  ok: false;
  error_code: number;
  description: string;
  parameters?: Obj;
}

/**
 * The error answer grammY turns into a `GrammyError` for a dead send: the
 * Bot API's own, when this process made the call, else one read from the
 * outbox's last error.
 *
 * @param result the outbox's answer
 * @param seen the Bot API's error answer of the call, when known
 * @returns the answer
 */
export function failureOf(result: SendResult, seen: ApiFailure | undefined): ApiFailure {
  if (seen !== undefined) return seen;
  const text = result.error ?? "the send was dead-lettered";
  const code = /\b([45]\d\d)\b/.exec(text)?.[1];
  return { ok: false, error_code: code === undefined ? 400 : Number(code), description: text };
}
