/**
 * What BuilderBot's core sees of a journaled WhatsApp message (the context its
 * flows get, as `@builderbot/provider-meta` builds it), and what a BuilderBot
 * answer becomes as a WhatsApp Cloud API message.
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import type { InboundMessage, OutboundContent } from "../../src/provider.ts";
import { isObj, type Obj } from "../telegram/values.ts";
import { fingerprint } from "./refs.ts";

/** The message context BuilderBot's `handleMsg` gets (its `BotContext`). */
export interface BuilderBotMessage {
  /** The chat: the sender's phone number (`wa_id`), or `bsuid:…` / `group:…` (see `whatsAppChatId`). */
  from: string;
  /** The text, a button's title, or one of BuilderBot's event bodies (`_event_media__<id>`, …). */
  body: string;
  /** The sender's profile name, when Meta gave one. */
  name?: string;
  /** The same as `name` (provider-meta's field). */
  pushName?: string;
  /** The phone number id the message was sent to. */
  to: string;
  /** WhatsApp's type of the message (`text`, `image`, `interactive`, …). */
  type: string;
  /** The `wamid`. */
  message_id: string;
  /** A media message's caption. */
  caption?: string;
  /** A group message's participant. */
  author?: string;
  /** The message as the journal keeps it. */
  inbound: InboundMessage;
  [key: string]: unknown;
}

/** BuilderBot's event keywords (`EVENTS.MEDIA`, …) by WhatsApp type: the body its event flows match. */
const EVENT_OF: Record<string, string> = {
  image: "_event_media_",
  video: "_event_media_",
  sticker: "_event_media_",
  document: "_event_document_",
  audio: "_event_voice_note_",
  voice: "_event_voice_note_",
  location: "_event_location_",
  order: "_event_order_",
};

/** A UUID-shaped id made from the wamid: the same body on every run of the message. */
function uuidOf(id: string): string {
  const hex = fingerprint(id, 1) + fingerprint(id, 2) + fingerprint(id, 3);
  return `${hex.slice(0, 8)}-${hex.slice(8, 12)}-${hex.slice(12, 16)}-${hex.slice(16, 20)}-${hex.slice(20, 32)}`;
}

/**
 * The body BuilderBot's flows match for a message: the text; a button's title (a list row's id, as
 * provider-meta does); an event body for media, documents, voice notes, locations and orders.
 *
 * @param message the journaled message
 * @returns the body, `""` when there is none (BuilderBot ignores the message then)
 */
export function bodyOf(message: InboundMessage): string {
  const extra = isObj(message.extra) ? message.extra : {};
  const waType = typeof extra.waType === "string" ? extra.waType : message.type;
  // provider-meta gives the flows none of these: a 👍 must not answer a question.
  if (waType === "reaction" || waType === "system" || waType === "unsupported") return "";
  const event = EVENT_OF[waType];
  if (event !== undefined) return `${event}_${uuidOf(message.id)}`;
  if (message.type === "interaction" && message.interaction !== undefined) {
    const value = isObj(message.interaction.value) ? message.interaction.value : {};
    if (value.kind === "list_reply") return message.interaction.id;
    return typeof value.title === "string" && value.title !== "" ? value.title : message.interaction.id;
  }
  return message.text ?? "";
}

/**
 * The context BuilderBot gets for a journaled message.
 *
 * @param message the journaled message
 * @param to the phone number id
 * @returns the context
 */
export function builderBotMessage(message: InboundMessage, to: string): BuilderBotMessage {
  const extra = isObj(message.extra) ? message.extra : {};
  const waType = typeof extra.waType === "string" ? extra.waType : message.type;
  const out: BuilderBotMessage = { from: message.chatId, body: bodyOf(message), to, type: waType, message_id: message.id, inbound: message };
  if (typeof extra.profileName === "string") {
    out.name = extra.profileName;
    out.pushName = extra.profileName;
  }
  if (EVENT_OF[waType] !== undefined && typeof message.text === "string") out.caption = message.text;
  if (message.from !== undefined) out.author = message.from;
  return out;
}

const MEDIA_KIND: [RegExp, string][] = [
  [/\.(jpe?g|png|webp)(\?|#|$)/i, "image"],
  [/\.(mp4|3gpp?)(\?|#|$)/i, "video"],
  [/\.(mp3|ogg|opus|aac|amr|m4a)(\?|#|$)/i, "audio"],
];

/**
 * A BuilderBot answer as a WhatsApp message: text; with `options.buttons` (up to 3), reply buttons;
 * with `options.media` (an http(s) URL), an image, video, audio or document by its extension, the
 * answer as its caption.
 *
 * @param answer the text BuilderBot sends
 * @param args BuilderBot's third argument (the step: `options.media`, `options.buttons`), or a
 *   WhatsApp message object given as is (`{ type, … }`)
 * @returns the content for the outbox
 * @throws {TypeError} for media that is not an http(s) URL, or more than 3 buttons
 */
export function whatsAppContent(answer: unknown, args: unknown): OutboundContent {
  const text = Array.isArray(answer) ? answer.join("\n") : typeof answer === "string" ? answer : String(answer ?? "");
  // A step's `options` (what BuilderBot's core passes), or the options themselves (`sendMessage(to, text, { media })`).
  const options: Obj = isObj(args) ? (isObj(args.options) ? args.options : args) : {};
  const media = typeof options.media === "string" && options.media !== "" ? options.media : undefined;
  const buttons = Array.isArray(options.buttons) ? options.buttons : [];
  if (media !== undefined) {
    if (!/^https?:\/\//i.test(media)) {
      throw new TypeError(`BuilderBot media must be an http(s) URL for the WhatsApp Cloud API (a local file cannot be journaled), got ${JSON.stringify(media)}`);
    }
    const kind = MEDIA_KIND.find(([pattern]) => pattern.test(media))?.[1] ?? "document";
    const body: Obj = { link: media };
    if (text.trim() !== "" && kind !== "audio") body.caption = text;
    return { [kind]: body };
  }
  if (buttons.length > 0) {
    if (buttons.length > 3) throw new TypeError(`WhatsApp reply buttons are at most 3, got ${buttons.length}`);
    return {
      interactive: {
        type: "button",
        body: { text },
        action: {
          buttons: buttons.map((b, i) => {
            const title = isObj(b) && typeof b.body === "string" ? b.body : String(b);
            return { type: "reply", reply: { id: `btn-${i}-${title}`.slice(0, 256), title: title.slice(0, 20) } };
          }),
        },
      },
    } as { [key: string]: JsonValue };
  }
  return text;
}
