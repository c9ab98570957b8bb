/**
 * Which Bot API calls go through the outbox, what is journaled of them, and
 * the answer grammY gets back.
 *
 * @module
 */
import type { SendResult } from "../../src/engine.ts";
import { isObj, type Obj } from "../telegram/values.ts";

/** Methods that look like sends but create no message a user could get twice. */
const NOT_JOURNALED = new Set(["sendChatAction", "sendMessageDraft", "sendRichMessageDraft"]);
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
  return /^send[A-Z]/.test(method) || /^(forward|copy)Messages?$/.test(method);
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
  for (const [key, item] of Object.entries(value)) if (item !== undefined) out[key] = plain(item);
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
  return items.map((item) => (isObj(item) && item.message_id !== undefined ? String(item.message_id) : "")).filter((id) => id !== "").join(",");
}

/**
 * The answer grammY gets for a send the outbox has but whose real answer is
 * gone (sent before a crash, or by another process): a minimal `Message` of
 * `message_id` and `chat.id` per message (`MessageId` for copies), `true`
 * for a method that answers no message.
 *
 * @param method the Bot API method
 * @param payload its parameters
 * @param messageIds what the receipt kept
 * @returns the answer
 */
export function minimalResult(method: string, payload: Obj, messageIds: string): unknown {
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
  return minimalResult(method, payload, ARRAY_RESULTS.has(method) || method === "sendGift" ? "" : "0");
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
