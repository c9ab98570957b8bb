/**
 * Sends: outbound content as a Bot API method and its parameters, and the
 * message id of the answer.
 *
 * @module
 */
import { ProviderError } from "../../src/errors.ts";
import type { OutboundContent, SendContext, SendReceipt } from "../../src/provider.ts";
import { showValue as show } from "../../src/show.ts";
import { type BotApiCall, METHOD_RE } from "./api.ts";
import { isObj, type Obj } from "./values.ts";

const MEDIA_FIELDS = ["photo", "document", "voice", "audio", "video", "animation", "video_note", "sticker"] as const;
const SEND_METHOD: Record<(typeof MEDIA_FIELDS)[number], string> = {
  photo: "sendPhoto",
  document: "sendDocument",
  voice: "sendVoice",
  audio: "sendAudio",
  video: "sendVideo",
  animation: "sendAnimation",
  video_note: "sendVideoNote",
  sticker: "sendSticker",
};

/**
 * Send content to a chat.
 *
 * @param call the Bot API
 * @param chatId the chat (`chat_id`)
 * @param content a string or an object
 * @param context the outbox key, attempt and abort signal
 * @returns Telegram's `message_id`
 * @throws {ProviderError} retryable or permanent (see the provider's `call`); permanent for content of no known form
 */
export async function sendContent(call: BotApiCall, chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
  const { method, params } = toRequest(chatId, content);
  let result: unknown;
  try {
    result = await call(method, params, { signal: context.signal });
  } catch (error) {
    // A call whose effect is already there (a retry after a lost answer, say) has taken effect.
    if (error instanceof ProviderError && error.status !== undefined && isAlreadyDone(method, error.status, error.message)) {
      return { messageId: params.message_id === undefined ? "" : String(params.message_id) };
    }
    throw error;
  }
  return { messageId: messageIdOf(method, result) };
}

/** Per method family, the Bot API errors (400) that say the call's effect is already there. */
const ALREADY_DONE: readonly { method: RegExp; description: RegExp }[] = [
  // An edit to the text (markup, caption, …) it already has.
  { method: /^edit/, description: /message is not modified/i },
  // A button press already answered.
  { method: /^answerCallbackQuery$/, description: /query is too old|query id is invalid/i },
  // A message already deleted.
  { method: /^deleteMessages?$/, description: /message to delete not found/i },
];

/**
 * Whether a Bot API error says only that the call's effect is already there: a repeat of a call that
 * took effect (a retry after its answer was lost, a handler run again), answered as success.
 *
 * @param method the Bot API method
 * @param status the error's code
 * @param description Telegram's description
 * @returns whether the call has taken effect
 */
export function isAlreadyDone(method: string, status: number, description: string): boolean {
  return status === 400 && ALREADY_DONE.some((rule) => rule.method.test(method) && rule.description.test(description));
}

/** Methods that are not journaled: typing indicators and drafts are transient. */
const TRANSIENT_METHODS = new Set(["sendChatAction", "sendMessageDraft"]);

/**
 * Whether `content` goes through the outbox: everything but edits (`edit…`
 * methods, idempotent: a repeat is answered "message is not modified", which
 * counts as done), `sendChatAction` and `sendMessageDraft` (transient). Other
 * methods that create no message (a deletion, a callback answer, a pin) stay
 * journaled, so that a handler run again after a crash is answered from the
 * outbox instead of repeating a call that would now fail.
 *
 * @param content what a send carries
 * @returns whether it goes through the outbox
 */
export function isJournaledContent(content: OutboundContent): boolean {
  if (typeof content !== "object" || content === null || typeof content.method !== "string") return true;
  const method = content.method;
  return !(TRANSIENT_METHODS.has(method) || /^edit[A-Z]/.test(method));
}

function badContent(message: string): never {
  throw new ProviderError(message, { retryable: false });
}

/** The method and parameters for one send. */
function toRequest(chatId: string, content: OutboundContent): { method: string; params: Record<string, unknown> } {
  if (typeof content === "string") {
    if (content === "") badContent("Telegram cannot send an empty text message");
    return { method: "sendMessage", params: { chat_id: chatId, text: content } };
  }
  if (!isObj(content)) badContent(`Telegram content must be a string or an object, got ${show(content)}`);
  if (content.method !== undefined) {
    const { method, ...rest } = content;
    if (typeof method !== "string" || !METHOD_RE.test(method)) {
      badContent(`Telegram content field "method" must be a Bot API method name like "sendPoll", got ${show(method)}`);
    }
    return { method, params: { chat_id: chatId, ...rest } };
  }
  const field = MEDIA_FIELDS.find((f) => content[f] !== undefined);
  if (field !== undefined) {
    const value = content[field];
    if (typeof value !== "string" && !(value instanceof Uint8Array)) {
      badContent(`Telegram content field "${field}" must be a URL, a file_id or a Uint8Array, got ${show(value)}`);
    }
    const { text, ...rest } = content;
    return {
      method: SEND_METHOD[field],
      params: { ...(typeof text === "string" && rest.caption === undefined ? { caption: text } : {}), ...rest, chat_id: chatId },
    };
  }
  if (typeof content.text === "string" && content.text !== "") {
    return { method: "sendMessage", params: { ...content, chat_id: chatId } };
  }
  badContent(
    `Telegram content must be a string, { text }, { photo | document | voice | audio | video | animation | video_note | sticker }, or { method }; got an object with keys ${
      show(Object.keys(content))
    }`,
  );
}

/** The message id in a result; a send method must have one. */
function messageIdOf(method: string, result: unknown): string {
  if (isObj(result) && (typeof result.message_id === "number" || typeof result.message_id === "string")) return String(result.message_id);
  if (Array.isArray(result) && result.length > 0 && result.every((r) => isObj(r) && typeof r.message_id === "number")) {
    return result.map((r) => String((r as Obj).message_id)).join(",");
  }
  const needsId = (method.startsWith("send") && method !== "sendChatAction") || method === "forwardMessage" || method === "copyMessage";
  if (needsId) {
    throw new ProviderError(
      `Telegram ${method} answered ok but without a "message_id" (result ${show(result)}); the message may have been sent, so it is not retried on its own`,
      { retryable: false },
    );
  }
  return "";
}
