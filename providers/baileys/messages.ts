/**
 * From a Baileys `WAMessage` to the bot's `InboundMessage`: which upserts are
 * user messages, the id (the message key), the type, text, interaction and
 * media reference, and a JSON copy of the message.
 *
 * @module
 */
import type { JsonValue } from "../../src/contract.ts";
import type { MediaSeal, StoredMediaRef } from "../../src/media.ts";
import type { InboundMessage } from "../../src/provider.ts";
import { setOwn } from "../../src/rules.ts";
import type { BaileysLong, BaileysMessageKey, BaileysWAMessage } from "./socket.ts";

/** A plain object. */
export type Obj = { [key: string]: unknown };

/** Whether `value` is a plain object (not an array, not null). */
export function isObj(value: unknown): value is Obj {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

/** The wrappers Baileys' `normalizeMessageContent` opens (a message inside a message). */
const WRAPPERS = [
  "ephemeralMessage",
  "viewOnceMessage",
  "viewOnceMessageV2",
  "viewOnceMessageV2Extension",
  "documentWithCaptionMessage",
  "editedMessage",
  "botInvokeMessage",
  "groupMentionedMessage",
  "lottieStickerMessage",
] as const;

/** Fields of `message` that accompany the content and are never the content itself. */
const ACCOMPANYING = new Set(["messageContextInfo", "senderKeyDistributionMessage", "fastRatchetKeySenderKeyDistributionMessage"]);

/** The media message kinds and the bot's type for each. */
export const MEDIA_KINDS: Readonly<Record<string, string>> = {
  imageMessage: "image",
  videoMessage: "video",
  ptvMessage: "video",
  audioMessage: "audio",
  documentMessage: "document",
  stickerMessage: "sticker",
};

/** What `downloadMediaMessage` needs of a media node, kept in the sealed reference. */
const MEDIA_FIELDS = ["url", "directPath", "mediaKey", "fileEncSha256", "fileSha256", "mimetype", "fileLength", "fileName", "mediaKeyTimestamp"] as const;

/** The sealed reference of a Baileys media message. */
export interface BaileysMediaRef {
  /** The message's key (the re-upload request names it). */
  key: { remoteJid: string; fromMe: boolean; id: string; participant?: string };
  /** The media field's name: `imageMessage`, `videoMessage`, `ptvMessage`, `audioMessage`, `documentMessage`, `stickerMessage`. */
  kind: string;
  /** The media node's download fields, binary ones (`mediaKey`, `fileEncSha256`, `fileSha256`) as base64. */
  node: { [field: string]: string | number };
  /** Whether the media was view-once (kept all the same: the bot may read it once more after a crash). */
  viewOnce?: boolean;
}

/**
 * Open the wrappers around a message's content (`ephemeralMessage`,
 * `viewOnceMessage`, …), as Baileys' `normalizeMessageContent` does.
 *
 * @param message `WAMessage.message`
 * @returns the inner content, and whether a view-once wrapper was opened
 */
export function unwrapContent(message: unknown): { content: Obj | undefined; viewOnce: boolean } {
  let content = isObj(message) ? message : undefined;
  let viewOnce = false;
  for (let depth = 0; depth < 5 && content !== undefined; depth++) {
    const wrapper = WRAPPERS.find((name) => isObj(content![name]) && isObj((content![name] as Obj).message));
    if (wrapper === undefined) break;
    if (wrapper.startsWith("viewOnce")) viewOnce = true;
    content = (content[wrapper] as Obj).message as Obj;
  }
  return { content, viewOnce };
}

/** The content's kind: its first field that is set and not an accompanying one. */
export function contentKind(content: Obj | undefined): string | undefined {
  if (content === undefined) return undefined;
  return Object.keys(content).find((name) => !ACCOMPANYING.has(name) && content[name] !== null && content[name] !== undefined);
}

/** Why an upserted message is not handed to the bot, or `undefined` for a user message to journal. */
export type SkipReason =
  | "from-me"
  | "status-broadcast"
  | "stub"
  | "protocol"
  | "no-content"
  | "no-key"
  | "upsert-type";

/**
 * Whether an upserted message is a user's message the bot handles.
 *
 * @param message the `WAMessage`
 * @returns the reason to skip it, or `undefined`
 */
export function skipReason(message: BaileysWAMessage): SkipReason | undefined {
  const key = message?.key;
  if (!isObj(key) || typeof key.remoteJid !== "string" || key.remoteJid === "" || typeof key.id !== "string" || key.id === "") {
    return "no-key";
  }
  if (key.fromMe === true) return "from-me";
  if (key.remoteJid === "status@broadcast" || key.remoteJid.endsWith("@broadcast")) return "status-broadcast";
  const { content } = unwrapContent(message.message);
  const kind = contentKind(content);
  if (kind === undefined) return message.messageStubType !== undefined && message.messageStubType !== null ? "stub" : "no-content";
  if (kind === "protocolMessage" || kind === "keepInChatMessage" || kind === "pinInChatMessage" || kind === "encReactionMessage") {
    return "protocol";
  }
  return undefined;
}

/**
 * The journal id of a message: its key, `remoteJid`, `fromMe` and `id`, joined
 * with commas (not the order of Baileys' `stringifyMessageKey`, which is
 * `remoteJid,id,fromMe`). A redelivery (the offline replay
 * of a message not yet acknowledged, a placeholder resend) has the same key.
 *
 * @param key the message key
 * @returns `<remoteJid>,<fromMe 1|0>,<id>`
 */
export function messageKeyId(key: BaileysMessageKey): string {
  return `${key.remoteJid ?? ""},${key.fromMe ? "1" : "0"},${key.id ?? ""}`;
}

/** A number from a protobuf `Long`, a number or a numeric string. */
export function toNumber(value: number | string | BaileysLong | null | undefined): number | undefined {
  if (typeof value === "number") return Number.isFinite(value) ? value : undefined;
  if (typeof value === "string") {
    const n = Number(value);
    return value.trim() !== "" && Number.isFinite(n) ? n : undefined;
  }
  if (typeof value === "bigint") return Number(value);
  if (isObj(value)) {
    if (typeof value.toNumber === "function") return (value as { toNumber(): number }).toNumber();
    if (typeof value.low === "number" && typeof value.high === "number") {
      return (value.high >>> 0) * 2 ** 32 + (value.low >>> 0);
    }
  }
  return undefined;
}

function toBase64(bytes: Uint8Array): string {
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

/** Base64 back to bytes (what the sealed reference keeps). */
export function fromBase64(text: string): Uint8Array {
  const binary = atob(text);
  return Uint8Array.from(binary, (c) => c.charCodeAt(0));
}

/** Fields of a JSON copy dropped for size: thumbnails are previews, not the message. */
const DROPPED = new Set(["jpegThumbnail", "thumbnailDirectPath", "thumbnailSha256", "thumbnailEncSha256", "waveform", "pngThumbnail"]);

/**
 * A JSON copy of a Baileys value (a protobuf object): bytes as base64, `Long`s
 * as numbers, thumbnails dropped, cut at `maxDepth` levels.
 *
 * @param value the value
 * @param maxDepth the deepest level kept
 * @returns JSON
 */
export function toJson(value: unknown, maxDepth = 24): JsonValue {
  const walk = (v: unknown, depth: number): JsonValue | undefined => {
    if (v === null) return null;
    switch (typeof v) {
      case "string":
      case "boolean":
        return v;
      case "number":
        return Number.isFinite(v) ? v : null;
      case "bigint":
        return Number(v);
      case "object":
        break;
      default:
        return undefined;
    }
    if (v instanceof Uint8Array) return toBase64(v);
    if (depth >= maxDepth) return null;
    if (Array.isArray(v)) return v.map((item) => walk(item, depth + 1) ?? null);
    const obj = v as Obj;
    if (typeof obj.low === "number" && typeof obj.high === "number" && typeof obj.unsigned === "boolean") return toNumber(obj as never) ?? null;
    const out: { [key: string]: JsonValue } = {};
    for (const name of Object.keys(obj)) {
      if (DROPPED.has(name)) continue;
      const item = walk(obj[name], depth + 1);
      if (item !== undefined) setOwn(out, name, item); // "__proto__" (from JSON.parse) kept as a key
    }
    return out;
  };
  return walk(value, 0) ?? null;
}

/** The bot's type for a content kind. */
function typeOf(kind: string): string {
  if (kind === "conversation" || kind === "extendedTextMessage") return "text";
  if (kind in MEDIA_KINDS) return MEDIA_KINDS[kind]!;
  if (
    kind === "buttonsResponseMessage" || kind === "listResponseMessage" || kind === "templateButtonReplyMessage" ||
    kind === "interactiveResponseMessage"
  ) return "interaction";
  const map: Record<string, string> = {
    reactionMessage: "reaction",
    locationMessage: "location",
    liveLocationMessage: "location",
    contactMessage: "contact",
    contactsArrayMessage: "contacts",
    pollCreationMessage: "poll",
    pollCreationMessageV2: "poll",
    pollCreationMessageV3: "poll",
    pollUpdateMessage: "poll_update",
    eventMessage: "event",
  };
  return map[kind] ?? kind.replace(/Message$/, "");
}

/** The text a user typed, or the caption. */
function textOf(kind: string, node: unknown): string | undefined {
  if (kind === "conversation") return typeof node === "string" ? node : undefined;
  if (!isObj(node)) return undefined;
  if (typeof node.text === "string") return node.text;
  if (typeof node.caption === "string") return node.caption;
  if (kind === "buttonsResponseMessage" && typeof node.selectedDisplayText === "string") return node.selectedDisplayText;
  if (kind === "listResponseMessage" && typeof node.title === "string") return node.title;
  if (kind === "templateButtonReplyMessage" && typeof node.selectedDisplayText === "string") return node.selectedDisplayText;
  return undefined;
}

/**
 * How deep a flow reply's parsed `paramsJson` is kept (deeper objects become `null`): the journal takes
 * 64 levels (`MAX_CONTENT_DEPTH`) and the value sits at level 3 of the message.
 */
export const INTERACTION_VALUE_DEPTH = 24;

/** A button press, list choice or flow reply. */
function interactionOf(kind: string, node: unknown): InboundMessage["interaction"] {
  if (!isObj(node)) return undefined;
  if (kind === "buttonsResponseMessage" && typeof node.selectedButtonId === "string") return { id: node.selectedButtonId };
  if (kind === "listResponseMessage" && isObj(node.singleSelectReply) && typeof node.singleSelectReply.selectedRowId === "string") {
    return { id: node.singleSelectReply.selectedRowId };
  }
  if (kind === "templateButtonReplyMessage" && typeof node.selectedId === "string") return { id: node.selectedId };
  if (kind === "interactiveResponseMessage") {
    const flow = isObj(node.nativeFlowResponseMessage) ? node.nativeFlowResponseMessage : undefined;
    const params = typeof flow?.paramsJson === "string" ? flow.paramsJson : undefined;
    let value: JsonValue | undefined;
    try {
      // Sanitised like the rest of the message: a number JSON.parse reads as Infinity ("1e999") becomes
      // null, nesting past INTERACTION_VALUE_DEPTH is cut, so the journal can always take it.
      value = params === undefined ? undefined : toJson(JSON.parse(params), INTERACTION_VALUE_DEPTH);
    } catch {
      value = params;
    }
    const id = typeof flow?.name === "string" ? flow.name : "interactive";
    return value === undefined ? { id } : { id, value };
  }
  return undefined;
}

/** The media node's download fields, for the sealed reference. */
function mediaNode(node: Obj): BaileysMediaRef["node"] | undefined {
  const out: BaileysMediaRef["node"] = {};
  for (const field of MEDIA_FIELDS) {
    const value = node[field];
    if (value instanceof Uint8Array) out[field] = toBase64(value);
    else if (typeof value === "string") out[field] = value;
    else if (typeof value === "number" || isObj(value)) {
      const n = toNumber(value as number | BaileysLong);
      if (n !== undefined) out[field] = n;
    }
  }
  return typeof out.mediaKey === "string" && (typeof out.url === "string" || typeof out.directPath === "string") ? out : undefined;
}

/** What converting an upserted message needs. */
export interface Conversion {
  /** Seals media references. */
  seal: MediaSeal;
  /** `messages.upsert`'s `type`. */
  upsertType: string;
}

/**
 * The bot's message for a Baileys user message (one {@link skipReason} lets
 * through).
 *
 * @param message the `WAMessage`
 * @param conversion the seal and the upsert type
 * @returns the inbound message
 */
export async function toInbound(message: BaileysWAMessage, conversion: Conversion): Promise<InboundMessage> {
  const key = message.key;
  const remoteJid = key.remoteJid!;
  const { content, viewOnce } = unwrapContent(message.message);
  const kind = contentKind(content)!;
  const node = content![kind];
  const type = typeOf(kind);
  const keyJson: BaileysMediaRef["key"] = {
    remoteJid,
    fromMe: key.fromMe === true,
    id: key.id!,
    ...(typeof key.participant === "string" && key.participant !== "" ? { participant: key.participant } : {}),
  };
  const inbound: InboundMessage = { id: messageKeyId(key), chatId: remoteJid, type };
  const text = textOf(kind, node);
  if (text !== undefined) inbound.text = text;
  const interaction = interactionOf(kind, node);
  if (interaction !== undefined) inbound.interaction = interaction;
  const participant = keyJson.participant ?? (typeof message.participant === "string" && message.participant !== "" ? message.participant : undefined);
  if (participant !== undefined) inbound.from = participant;
  const seconds = toNumber(message.messageTimestamp);
  if (seconds !== undefined) inbound.timestamp = seconds * 1000;
  if (kind in MEDIA_KINDS && isObj(node)) {
    const stored = mediaNode(node);
    const ref: StoredMediaRef = stored === undefined
      ? await conversion.seal.notDurable("the media message has no media key or URL")
      : await conversion.seal.seal({ key: keyJson, kind, node: stored, ...(viewOnce ? { viewOnce } : {}) } as unknown as JsonValue);
    inbound.media = ref as unknown as JsonValue;
  }
  const extra: { [key: string]: JsonValue } = {
    key: keyJson as unknown as JsonValue,
    kind,
    upsertType: conversion.upsertType,
    message: toJson(message),
  };
  if (typeof message.pushName === "string") extra.pushName = message.pushName;
  if (viewOnce) extra.viewOnce = true;
  inbound.extra = extra;
  return inbound;
}
