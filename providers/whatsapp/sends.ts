/**
 * Sends through the Graph API: outbound content as a Cloud API message
 * object, addressed by the chat id, and read receipts.
 *
 * @module
 */
import { ProviderError } from "../../src/errors.ts";
import type { OutboundContent, SendContext, SendReceipt } from "../../src/provider.ts";
import { showValue as show } from "../../src/show.ts";
import { type GraphApi, graphError } from "./api.ts";
import { GROUP_PREFIX, parseWhatsAppChatId, USER_PREFIX } from "./chat_ids.ts";
import { MEDIA_TYPES } from "./media.ts";
import { brief, isObject, snippet } from "./values.ts";

const CONTENT_TYPES = [
  "image",
  "audio",
  "video",
  "document",
  "sticker",
  "interactive",
  "template",
  "location",
  "contacts",
  "reaction",
] as const;

/** Who sends, and how. */
export interface Sender {
  /** The Graph API. */
  api: GraphApi;
  /** `…/{version}/{phone-number-id}/messages`. */
  messagesUrl: string;
  /** The business phone number id. */
  phoneNumberId: string;
  /** Whether sends carry their outbox key as `biz_opaque_callback_data`. */
  callbackData: boolean;
}

/**
 * Send content to a chat (a WhatsApp id) through the Graph API.
 *
 * @param chatId the chat: a phone number (`wa_id`, sent with `to`), `bsuid:<business-scoped user id>`
 *   (sent with `recipient`), or `group:<group id>` (sent with `recipient_type: "group"`); see `whatsAppChatId`
 * @param content text, or a message object (see the class documentation)
 * @param context the outbox key, the attempt, and the bot's abort signal
 * @param sender the Graph API and the sender's settings
 * @returns the `wamid` of the sent message
 * @throws {WhatsAppApiError} when the Graph API refuses it (`retryable` says whether to retry)
 * @throws {ProviderError} on a network error or timeout (retryable), or content that cannot be sent (permanent)
 */
export async function sendMessage(chatId: string, content: OutboundContent, context: SendContext, sender: Sender): Promise<SendReceipt> {
  const body = messageBody(chatId, content, context?.idempotencyKey, sender);
  const { response, text } = await sender.api.call("POST", sender.messagesUrl, JSON.stringify(body), context?.signal, "send");
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch {
    parsed = undefined;
  }
  if (!response.ok) throw graphError(response, parsed, text, "send");
  const id = isObject(parsed) && Array.isArray(parsed.messages) && isObject(parsed.messages[0])
    ? parsed.messages[0].id
    : undefined;
  if (typeof id !== "string" || id === "") {
    // Meta may have taken the message: sending it again could deliver it twice, so it is
    // not retried; it goes to the dead-letter queue for an operator to check.
    throw new ProviderError(
      `WhatsApp send answered HTTP ${response.status} without "messages[0].id" (the message may or may not ` +
        `have been sent; not retried): got ${snippet(text)}`,
      { retryable: false, status: response.status },
    );
  }
  return { messageId: id };
}

/**
 * Mark an inbound message as read (blue ticks), optionally showing a typing
 * indicator until the next reply or for up to 25 seconds. Not journaled:
 * read receipts and typing indicators are transient.
 *
 * @param messageId the `wamid` of the inbound message (`ctx.message.id`)
 * @param options `typing: true` to show the typing indicator; `signal` to abort
 * @param sender the Graph API and the sender's settings
 * @returns once Meta accepted it
 * @throws {WhatsAppApiError} when the Graph API refuses it
 * @throws {ProviderError} on a network error or timeout
 *
 * @example
 * ```ts ignore
 * bot.when(/.+/, async (ctx) => {
 *   await provider.markRead(ctx.message.id, { typing: true });
 *   await ctx.reply("Thinking…");
 * });
 * ```
 */
export async function markRead(messageId: string, options: { typing?: boolean; signal?: AbortSignal }, sender: Sender): Promise<void> {
  if (typeof messageId !== "string" || messageId === "") {
    throw new TypeError(`Argument "messageId" must be a non-empty string, got ${show(messageId)}`);
  }
  const body: Record<string, unknown> = { messaging_product: "whatsapp", status: "read", message_id: messageId };
  if (options.typing === true) body.typing_indicator = { type: "text" };
  const { response, text } = await sender.api.call("POST", sender.messagesUrl, JSON.stringify(body), options.signal, "mark as read");
  if (!response.ok) {
    let parsed: unknown;
    try {
      parsed = JSON.parse(text);
    } catch {
      parsed = undefined;
    }
    throw graphError(response, parsed, text, "mark as read");
  }
}

/** The Cloud API message object of one send. */
function messageBody(chatId: string, content: OutboundContent, key: string | undefined, sender: Sender): Record<string, unknown> {
  const permanent = (message: string) => new ProviderError(message, { retryable: false });
  const target = addressOf(chatId, sender.phoneNumberId);
  const base: Record<string, unknown> = { messaging_product: "whatsapp", ...target };
  let body: Record<string, unknown>;
  if (typeof content === "string") {
    body = { ...base, type: "text", text: { body: content } };
  } else if (!isObject(content) || ArrayBuffer.isView(content)) {
    throw permanent(
      `WhatsApp cannot send ${brief(content)}: send text, a message object, or binary media uploaded first (by "link" or "id")`,
    );
  } else {
    const { replyTo, previewUrl, ...c } = content as Record<string, unknown>;
    if (replyTo !== undefined && (typeof replyTo !== "string" || replyTo === "")) {
      throw permanent(`WhatsApp content field "replyTo" must be a message id, got ${show(replyTo)}`);
    }
    if (typeof c.type === "string") {
      // the chat id says who gets it: the content's own to, recipient or recipient_type are not used
      const { to: _to, recipient: _recipient, recipient_type: _type, ...rest } = c;
      body = { ...base, ...rest, messaging_product: "whatsapp", ...target };
    } else if (typeof c.text === "string") {
      const preview = previewUrl ?? c.preview_url;
      body = { ...base, type: "text", text: { body: c.text, ...(preview !== undefined ? { preview_url: preview } : {}) } };
    } else if (isObject(c.text)) {
      body = { ...base, type: "text", text: c.text };
    } else {
      const type = CONTENT_TYPES.find((t) => c[t] !== undefined);
      if (type === undefined) {
        throw permanent(
          `WhatsApp content must be a string or have "text", "type" or one of ${CONTENT_TYPES.map((t) => `"${t}"`).join(", ")}; ` +
            `got keys ${show(Object.keys(content))}`,
        );
      }
      const payload = c[type];
      if ((MEDIA_TYPES as readonly string[]).includes(type)) {
        if (!isObject(payload) || (typeof payload.link !== "string" && typeof payload.id !== "string")) {
          throw permanent(`WhatsApp content field "${type}" must be an object with "link" or "id", got ${brief(payload)}`);
        }
      }
      body = { ...base, type, [type]: payload };
    }
    if (replyTo !== undefined) body.context = { message_id: replyTo };
  }
  if (
    sender.callbackData && typeof key === "string" && key !== "" && key.length <= 512 && body.type !== "reaction" &&
    body.biz_opaque_callback_data === undefined
  ) {
    body.biz_opaque_callback_data = key;
  }
  return body;
}

/**
 * The addressing fields of a send to `chatId`: `to` for a phone number,
 * `recipient` (and no `to`) for a business-scoped user id, `recipient_type:
 * "group"` and `to` for a group.
 */
function addressOf(chatId: string, phoneNumberId: string): Record<string, string> {
  const permanent = (message: string) => new ProviderError(message, { retryable: false });
  if (typeof chatId !== "string" || chatId === "") throw permanent(`WhatsApp cannot send to chat ${show(chatId)}: the chat id is empty`);
  if (chatId === `wa:${phoneNumberId}:unreadable` || /^wa:[^:]*:unreadable$/.test(chatId)) {
    throw permanent(
      `WhatsApp cannot send to chat ${show(chatId)}: it is where unreadable messages without a usable sender are journaled, not a recipient`,
    );
  }
  const recipient = parseWhatsAppChatId(chatId);
  if (recipient.kind === "group") {
    if (recipient.groupId === "") throw permanent(`WhatsApp cannot send to chat ${show(chatId)}: no group id after "${GROUP_PREFIX}"`);
    return { recipient_type: "group", to: recipient.groupId };
  }
  if (recipient.kind === "user") {
    if (recipient.userId === "") throw permanent(`WhatsApp cannot send to chat ${show(chatId)}: no user id after "${USER_PREFIX}"`);
    return { recipient_type: "individual", recipient: recipient.userId };
  }
  return { recipient_type: "individual", to: recipient.phone };
}
