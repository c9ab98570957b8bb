/**
 * WhatsAppProvider (see `mod.ts` for the user documentation).
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import type { JsonValue } from "../../src/contract.ts";
import { ProviderError } from "../../src/errors.ts";
import { type LoadedMedia, type MediaLoadContext, MediaSeal, MediaUnavailableError, type StoredMediaRef } from "../../src/media.ts";
import {
  type AdmitResult,
  classifyProviderError,
  type ErrorClassification,
  type InboundMessage,
  type InboundSink,
  type Interaction,
  type OutboundContent,
  type Provider,
  type SendContext,
  type SendReceipt,
} from "../../src/provider.ts";
import { readCapped } from "../../src/read_capped.ts";
import { sha256Hex } from "../../src/sha256_hex.ts";
import { showValue as show } from "../../src/show.ts";
import { isWellFormed } from "../../src/well_formed.ts";

/** The Graph API version used when `graphVersion` is not given. */
export const DEFAULT_GRAPH_VERSION = "v24.0";
/** The Graph API base URL used when `graphBase` is not given. */
export const DEFAULT_GRAPH_BASE = "https://graph.facebook.com";

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
  /** The errors of a `failed` status, as Meta sent them. */
  errors?: JsonValue;
  /** The status object as Meta sent it. */
  raw: JsonValue;
}

/** Options of {@link WhatsAppProvider}. */
export interface WhatsAppProviderOptions {
  /** A system-user or user access token with `whatsapp_business_messaging` permission. */
  accessToken: string;
  /** The business phone number id (not the phone number): the sender, and the `connectionId`. */
  phoneNumberId: string;
  /** The Meta app's secret: the key of the webhook's `X-Hub-Signature-256`. */
  appSecret: string;
  /** The verify token typed into the app's webhook settings, compared with `hub.verify_token`. */
  verifyToken: string;
  /** The Graph API base URL (default `https://graph.facebook.com`); tests point it at a fake server. */
  graphBase?: string;
  /** The Graph API version, `vNN.N` (default {@link DEFAULT_GRAPH_VERSION}). */
  graphVersion?: string;
  /** The `fetch` to call the Graph API with (default `globalThis.fetch`). */
  fetch?: typeof fetch;
  /**
   * The key that seals media references in inbox records (16+ bytes).
   * Default: derived from `appSecret`, so rotating the app secret makes the
   * references already journaled fail with `rehydrate-failed`; set a key of
   * its own to rotate the secret freely.
   */
  mediaKey?: string | Uint8Array;
  /** Timeout of each Graph API request and media download, in ms (default 30 000). */
  requestTimeoutMs?: number;
  /** The provider name journaled with every inbound record (default `'whatsapp'`). */
  name?: string;
  /** The largest webhook body accepted, in bytes (default 1 MiB); a bigger one is answered 413. */
  maxBodyBytes?: number;
  /** The largest media download accepted, in bytes (default 100 MiB, WhatsApp's largest document). */
  maxMediaBytes?: number;
  /**
   * Called with each status callback (sent, delivered, read, failed) of a
   * webhook POST, before it is answered. When it throws, the POST is answered
   * 503 so Meta redelivers it (its messages then come back as duplicates).
   * A redelivered POST (after a 503 for any reason) calls it again with the
   * same statuses: key what it records by status id and status.
   */
  onStatus?: (status: WhatsAppStatus) => void | Promise<void>;
  /**
   * Called with each problem of a webhook POST: a message entry with
   * missing or invalid fields, or of a change whose
   * `metadata.phone_number_id` is missing or malformed (journaled as
   * unreadable all the same, see {@link WhatsAppPayloadError}), a status
   * entry with missing or invalid fields (skipped), an error Meta sent at the
   * change level (`value.errors`, a {@link WhatsAppChangeError}), messages
   * for another phone number id (ignored; once per number), none of which
   * makes Meta redeliver the POST; and a failed `sink.confirmSent` or a
   * throwing `onStatus`, which do (the POST is answered 503). Default: the
   * bot's `error` event (`console.warn` before the bot started).
   */
  onError?: (error: Error) => void;
  /**
   * Send the outbox idempotency key as `biz_opaque_callback_data`, so status
   * callbacks carry it as `callbackData` (default `true`).
   */
  callbackData?: boolean;
}

/**
 * An error answer of the Graph API: the HTTP status, and the Graph error
 * `code`, `subcode`, `type`, `details` and `fbtraceId`. `retryable` and
 * `retryAfterMs` say what the bot's outbox does with it.
 *
 * @example
 * ```ts
 * import { WhatsAppApiError } from "@botmesh/durable/whatsapp";
 * const error = new WhatsAppApiError("(#131047) Re-engagement message", { status: 400, code: 131047, retryable: false });
 * console.log(error.code, error.retryable); // 131047 false
 * ```
 */
export class WhatsAppApiError extends ProviderError {
  /** The Graph error code (`error.code`), when the body had one. */
  readonly code: number | undefined;
  /** The Graph error subcode (`error.error_subcode`), when the body had one. */
  readonly subcode: number | undefined;
  /** The Graph error type (`OAuthException`, …). */
  readonly type: string | undefined;
  /** `error.error_data.details`: Meta's explanation. */
  readonly details: string | undefined;
  /** `error.fbtrace_id`, for Meta support. */
  readonly fbtraceId: string | undefined;

  /**
   * Make the error of one Graph API answer.
   *
   * @param message what happened
   * @param options the HTTP status, Graph fields, and the classification
   */
  constructor(
    message: string,
    options: {
      status?: number;
      code?: number;
      subcode?: number;
      type?: string;
      details?: string;
      fbtraceId?: string;
      retryable?: boolean;
      retryAfterMs?: number;
      cause?: unknown;
    } = {},
  ) {
    super(message, {
      status: options.status,
      retryable: options.retryable,
      retryAfterMs: options.retryAfterMs,
      cause: options.cause,
    });
    this.name = "WhatsAppApiError";
    this.code = options.code;
    this.subcode = options.subcode;
    this.type = options.type;
    this.details = options.details;
    this.fbtraceId = options.fbtraceId;
  }
}

/**
 * A message or status entry of a webhook POST that lacks a required field or
 * has one of the wrong type, or a message entry of a change whose
 * `metadata.phone_number_id` is missing or malformed; `path` locates the
 * entry in the payload and `field` names the field. A message entry is
 * journaled all the same, as an unreadable message
 * (`InboundMessage.unreadable` is {@link reason}, Meta's object is in
 * `extra.raw`), which the bot dead-letters at once; a status entry is
 * skipped. The rest of the batch is admitted either way.
 */
export class WhatsAppPayloadError extends Error {
  /** Where in the payload, e.g. `entry[0].changes[0].value.messages[1]`. */
  readonly path: string;
  /**
   * The field, e.g. `from` or `text.body`; a field of the change around the
   * entry by its full path, e.g. `entry[0].changes[0].value.metadata.phone_number_id`.
   */
  readonly field: string;
  /** What is wrong, in sentence case and without the path: the `unreadable` reason of the journaled message. */
  readonly reason: string;
  /**
   * Make the error of one payload entry.
   *
   * @param path where in the payload
   * @param field the field
   * @param message what is wrong
   */
  constructor(path: string, field: string, message: string) {
    super(`WhatsApp webhook ${path}: ${message}`);
    this.name = "WhatsAppPayloadError";
    this.path = path;
    this.field = field;
    this.reason = message.charAt(0).toUpperCase() + message.slice(1);
  }
}

/**
 * An error Meta sent at the change level of a webhook POST (`value.errors`,
 * beside or instead of messages and statuses): a problem of the app, the
 * account or the platform that is not tied to one message, such as 130429
 * (throughput reached) or 131000 (something went wrong). It goes to `onError`;
 * the POST is answered as usual. It names no message id, so no `onStatus`
 * call can carry it: a send it concerns gets its own `failed` status.
 */
export class WhatsAppChangeError extends Error {
  /** Where in the payload, e.g. `entry[0].changes[0].value.errors[0]`. */
  readonly path: string;
  /** Meta's error code (`code`), when it is a number. */
  readonly code: number | undefined;
  /** Meta's error title (`title`, else `message`). */
  readonly title: string | undefined;
  /** `error_data.details`: Meta's explanation. */
  readonly details: string | undefined;
  /** The error object as Meta sent it. */
  readonly raw: JsonValue;
  /**
   * Make the error of one change-level error object.
   *
   * @param path where in the payload
   * @param raw the error object as Meta sent it
   */
  constructor(path: string, raw: unknown) {
    const o = isObject(raw) ? raw : {};
    const code = typeof o.code === "number" ? o.code : undefined;
    const title = typeof o.title === "string" ? o.title : typeof o.message === "string" ? o.message : undefined;
    const data = isObject(o.error_data) ? o.error_data : undefined;
    const details = typeof data?.details === "string" ? data.details : undefined;
    const head = code !== undefined ? `error ${code}` : `an error without a numeric "code" (${brief(o.code)})`;
    super(
      `WhatsApp webhook ${path}: Meta reported ${head}${title !== undefined ? ` "${title}"` : ""}` +
        `${details !== undefined && details !== title ? `: ${details}` : ""} (field "errors" of the change, not tied to a message)`,
    );
    this.name = "WhatsAppChangeError";
    this.path = path;
    this.code = code;
    this.title = title;
    this.details = details;
    this.raw = (raw ?? null) as JsonValue;
  }
}

// ---- chat ids -------------------------------------------------------------------

/** The prefix of a chat id that is a business-scoped user id (a user whose phone number Meta withholds). */
const USER_PREFIX = "bsuid:";
/** The prefix of a chat id that is a group (Groups API). */
const GROUP_PREFIX = "group:";
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

// ---- error classification ----------------------------------------------------

/** Throttling codes: retry, not before Retry-After (or the default wait here, in ms). */
const THROTTLE_CODES: ReadonlyMap<number, number | undefined> = new Map([
  [4, 60_000], // application request limit reached
  [17, 60_000], // user request limit reached
  [32, 60_000], // page request limit reached
  [613, 60_000], // calls to this API exceeded the rate limit
  [80007, 60_000], // WhatsApp Business Account rate limit
  [130429, 1_000], // Cloud API throughput reached
  [131048, 60_000], // spam rate limit
  [131056, 6_000], // (business, consumer) pair rate limit: one message per 6 s
]);
/** Transient server-side codes: retry with the outbox backoff. */
const TRANSIENT_CODES: ReadonlySet<number> = new Set([1, 2, 131000, 131016, 131057, 133004]);
/** Codes that never succeed on a retry of the same request, whatever the HTTP status says. */
const PERMANENT_CODES: ReadonlySet<number> = new Set([
  0, 3, 10, 33, 100, 190, 368, 131005, 131008, 131009, 131021, 131026, 131030, 131031, 131042, 131045, 131047,
  131049, 131050, 131051, 131052, 131053,
]);
const MAX_RETRY_AFTER_MS = 24 * 3600_000;

/**
 * Parse a `Retry-After` header: delay-seconds or an HTTP date.
 *
 * @param value the header value
 * @param now the current time (ms)
 * @returns the delay in ms, or `undefined` when absent or unreadable
 */
export function parseRetryAfter(value: string | null | undefined, now: number = Date.now()): number | undefined {
  if (value === null || value === undefined) return undefined;
  const text = value.trim();
  if (text === "") return undefined;
  if (/^\d+(\.\d+)?$/.test(text)) return Math.min(MAX_RETRY_AFTER_MS, Math.ceil(Number(text) * 1000));
  const at = Date.parse(text);
  if (Number.isNaN(at)) return undefined;
  return Math.min(MAX_RETRY_AFTER_MS, Math.max(0, at - now));
}

/** `estimated_time_to_regain_access` (minutes) of Meta's usage headers, in ms. */
function regainAccessMs(headers: Headers): number | undefined {
  let best: number | undefined;
  for (const name of ["x-business-use-case-usage", "x-app-usage", "x-ad-account-usage"]) {
    const raw = headers.get(name);
    if (!raw) continue;
    try {
      const walk = (value: unknown): void => {
        if (Array.isArray(value)) value.forEach(walk);
        else if (isObject(value)) {
          const minutes = value.estimated_time_to_regain_access;
          if (typeof minutes === "number" && minutes > 0) best = Math.max(best ?? 0, minutes * 60_000);
          Object.values(value).forEach(walk);
        }
      };
      walk(JSON.parse(raw));
    } catch {
      // not JSON: ignored
    }
  }
  return best === undefined ? undefined : Math.min(best, MAX_RETRY_AFTER_MS);
}

/**
 * Classify a Graph API error answer.
 *
 * @param status the HTTP status
 * @param code the Graph error code, when there is one
 * @param headers the response headers (`Retry-After`, usage headers)
 * @returns whether a retry may succeed, and not before when
 */
export function classifyGraphError(status: number, code: number | undefined, headers: Headers = new Headers()): ErrorClassification {
  const retryAfter = parseRetryAfter(headers.get("retry-after"));
  if (code !== undefined && THROTTLE_CODES.has(code)) {
    return { retryable: true, retryAfterMs: retryAfter ?? regainAccessMs(headers) ?? THROTTLE_CODES.get(code) };
  }
  if (code !== undefined && TRANSIENT_CODES.has(code)) return { retryable: true, retryAfterMs: retryAfter };
  if (code !== undefined && PERMANENT_CODES.has(code)) return { retryable: false };
  if (code !== undefined && code >= 132000 && code < 133000) return { retryable: false }; // template errors
  if (code !== undefined && code >= 200 && code < 300) return { retryable: false }; // permissions
  if (status === 429) return { retryable: true, retryAfterMs: retryAfter ?? regainAccessMs(headers) };
  if (status === 408 || status === 425 || status >= 500) return { retryable: true, retryAfterMs: retryAfter };
  return { retryable: false };
}

// ---- helpers ------------------------------------------------------------------

const encoder = new TextEncoder();
const decoder = new TextDecoder();

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function plain(status: number, text: string, headers: Record<string, string> = {}): Response {
  return new Response(text, {
    status,
    headers: { "content-type": "text/plain; charset=utf-8", "x-content-type-options": "nosniff", ...headers },
  });
}

function json(status: number, body: unknown): Response {
  return new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json" } });
}

/** Constant-time comparison of two byte strings (the length leaks, the content does not). */
function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  let diff = a.byteLength ^ b.byteLength;
  const n = Math.max(a.byteLength, b.byteLength);
  for (let i = 0; i < n; i++) diff |= (a[i] ?? 0) ^ (b[i] ?? 0);
  return diff === 0;
}

function hexToBytes(hex: string): Uint8Array<ArrayBuffer> | null {
  if (!/^[0-9a-fA-F]*$/.test(hex) || hex.length % 2 !== 0) return null;
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}

function toHex(bytes: Uint8Array): string {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function toBase64(bytes: Uint8Array): string {
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return btoa(binary);
}

/** Aborts when either does (`AbortSignal.any`, or its equivalent on Node before 20.3). */
function anySignal(a: AbortSignal, b: AbortSignal): AbortSignal {
  if (typeof AbortSignal.any === "function") return AbortSignal.any([a, b]);
  const controller = new AbortController();
  const abort = (source: AbortSignal) => () => controller.abort(source.reason);
  if (a.aborted) controller.abort(a.reason);
  else if (b.aborted) controller.abort(b.reason);
  else {
    a.addEventListener("abort", abort(a), { once: true });
    b.addEventListener("abort", abort(b), { once: true });
  }
  return controller.signal;
}

/** Read at most `max` bytes of a body; `null` when it is bigger. */

function checkString(options: Record<string, unknown>, name: string, required: boolean): string | undefined {
  const value = options[name];
  if (value === undefined && !required) return undefined;
  if (typeof value !== "string" || value === "") {
    throw new TypeError(`Option "${name}" must be a non-empty string, got ${value === undefined ? "undefined" : show(value)}`);
  }
  return value;
}

function checkPositiveInt(options: Record<string, unknown>, name: string, fallback: number): number {
  const value = options[name];
  if (value === undefined) return fallback;
  if (typeof value !== "number") throw new TypeError(`Option "${name}" must be a number, got ${show(value)}`);
  if (!Number.isInteger(value) || value < 1 || value > 2 ** 31 - 1) {
    throw new RangeError(`Option "${name}" must be an integer from 1 to 2147483647, got ${show(value)}`);
  }
  return value;
}

const OPTION_NAMES = [
  "accessToken",
  "phoneNumberId",
  "appSecret",
  "verifyToken",
  "graphBase",
  "graphVersion",
  "fetch",
  "mediaKey",
  "requestTimeoutMs",
  "name",
  "maxBodyBytes",
  "maxMediaBytes",
  "onStatus",
  "onError",
  "callbackData",
];

const MEDIA_TYPES = ["image", "audio", "video", "document", "sticker"] as const;
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

/** Statuses that say a send reached WhatsApp: with its `biz_opaque_callback_data`, `sink.confirmSent` settles it. */
const CONFIRMING_STATUSES: ReadonlySet<string> = new Set(["sent", "delivered", "read", "played"]);

/** A message of a webhook POST, parsed, before its media is sealed. */
interface ParsedMessage {
  message: Omit<InboundMessage, "media">;
  media?: { ref: { [key: string]: JsonValue } } | { why: string };
}

/** A message entry of a webhook POST: parsed, or not parseable (journaled as unreadable). */
type MessageEntry = { parsed: ParsedMessage } | { raw: unknown; error: WhatsAppPayloadError };

/** What a webhook POST was answered, in its JSON body. */
interface WebhookSummary {
  ok: boolean;
  /** Messages journaled now (unreadable ones included). */
  admitted: number;
  duplicates: number;
  rejected: number;
  /** Of the messages offered, how many could not be parsed (journaled as unreadable, dead-lettered by the bot). */
  unreadable: number;
  statuses: number;
  ignored: number;
  errors: string[];
}

// ---- the provider -----------------------------------------------------------------

/**
 * The WhatsApp Cloud API provider: a webhook handler for inbound messages,
 * sends through the Graph API, and media loaded again on reprocess.
 *
 * Webhook answers: GET verification 200 (the challenge) or 403; POST 401 when
 * the `X-Hub-Signature-256` is missing or wrong, 413 over `maxBodyBytes`, 400
 * for a body that is not JSON or not a WhatsApp webhook payload, 503 when the
 * bot is not started, a message was not admitted, `sink.confirmSent` failed or
 * `onStatus` threw (Meta redelivers), else 200 with a JSON summary; other
 * methods 405. A change for another phone number id (a well-formed one that
 * is not ours) is ignored (answered 200; its messages are reported once per
 * number through `onError`): give each number its own provider and webhook
 * URL. A change whose `metadata.phone_number_id` is missing or malformed may
 * be ours: its messages are journaled as unreadable (the reason names the
 * field), its statuses skipped; a numeric id whose decimal form is ours (a
 * safe integer) is taken as ours, reported once. The messages of one chat in a
 * POST are admitted one after the other in payload order; when one is refused,
 * the chat's later ones are held back, so the redelivery keeps their order.
 *
 * Chats: a message's chat id is the sender's phone number whenever Meta gives
 * one (`from`), `bsuid:<from_user_id>` only when it withholds it (a user with a
 * username), and `group:<group_id>` for a group message, whose participant is
 * `InboundMessage.from` (see {@link whatsAppChatId}). Each message is looked
 * at alone: a user whose phone number Meta shows only sometimes alternates
 * between two chat ids (the number, `bsuid:<id>`), which nothing merges. A
 * message that cannot be parsed is journaled as unreadable (the reason names
 * the field, Meta's object is in `extra.raw`) and dead-lettered by the bot,
 * never acknowledged unseen; only what is certainly not a user message
 * (statuses, other subscriptions) is answered without a journal record. Errors Meta sends at the change level
 * (`value.errors`) go to `onError`. A `sent`, `delivered`, `read` or `played`
 * status whose `biz_opaque_callback_data` is an outbox key calls
 * `sink.confirmSent`, which settles a send left ambiguous by a timeout.
 *
 * Sends: a string is a text message; `{ text, previewUrl?, replyTo? }` too;
 * `{ image | audio | video | document | sticker: { link | id, caption?, filename? } }`,
 * `{ interactive }`, `{ template }`, `{ location }`, `{ contacts }`,
 * `{ reaction }` send that type; `{ type, ... }` is sent as given (the Graph
 * message object without `messaging_product` and the addressing fields, which
 * the chat id gives). `replyTo` (a `wamid`)
 * quotes a message. The Cloud API has no idempotency key: a send that timed out
 * after Meta took it is sent again on retry.
 *
 * @example
 * ```ts
 * import { Bot, IMAGE, loadMediaOf, MemoryDurability } from "@botmesh/durable";
 * import { WhatsAppProvider } from "@botmesh/durable/whatsapp";
 *
 * const provider = new WhatsAppProvider({
 *   accessToken: Deno.env.get("WA_TOKEN")!,
 *   phoneNumberId: Deno.env.get("WA_PHONE_NUMBER_ID")!,
 *   appSecret: Deno.env.get("WA_APP_SECRET")!,
 *   verifyToken: Deno.env.get("WA_VERIFY_TOKEN")!,
 *   onStatus: (s) => console.log(s.id, s.status),
 * });
 * const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "wa-1" } });
 * bot.when(IMAGE, async (ctx) => {
 *   const media = await loadMediaOf(ctx);
 *   await ctx.reply(media ? `${media.data.byteLength} bytes` : "Please send it again");
 * });
 * await bot.start();
 * Deno.serve({ port: 8080 }, provider.webhook);
 * ```
 */
export class WhatsAppProvider implements Provider {
  readonly name: string;
  /** The phone number id. */
  readonly connectionId: string;
  /** The phone number id this provider sends from and receives for. */
  readonly phoneNumberId: string;
  /** The Graph API base URL, without a trailing slash. */
  readonly graphBase: string;
  /** The Graph API version. */
  readonly graphVersion: string;
  readonly #accessToken: string;
  readonly #appSecret: Promise<CryptoKey>;
  readonly #verifyToken: Uint8Array;
  readonly #fetch: typeof fetch;
  readonly #timeoutMs: number;
  readonly #maxBodyBytes: number;
  readonly #maxMediaBytes: number;
  readonly #onStatus: ((status: WhatsAppStatus) => void | Promise<void>) | undefined;
  readonly #onError: (error: Error) => void;
  readonly #callbackData: boolean;
  readonly #seal: MediaSeal;
  #sink: InboundSink | undefined;
  /** Other phone number ids whose messages were reported as ignored. */
  #otherNumbers = new Set<string>();
  /** Whether a numeric `phone_number_id` equal to ours was reported (once). */
  #numericIdReported = false;

  /**
   * The webhook: mount it at the callback URL configured in the Meta app
   * (`Bun.serve({ fetch: provider.webhook })`, `Deno.serve(provider.webhook)`).
   * It never throws; see the class documentation for its answers.
   *
   * @param request Meta's request
   * @returns the answer for Meta
   */
  readonly webhook: (request: Request) => Promise<Response> = (request) => this.#webhook(request);

  /**
   * Make a provider; nothing is contacted until the bot starts and sends.
   *
   * @param options access token, phone number id, app secret, verify token, and the optional settings
   * @throws {TypeError} naming the option when one is missing, of the wrong type, or unknown
   * @throws {RangeError} naming the option when one is out of range
   */
  constructor(options: WhatsAppProviderOptions) {
    if (!isObject(options)) throw new TypeError(`WhatsAppProvider options must be an object, got ${show(options)}`);
    const o = options as unknown as Record<string, unknown>;
    checkKnownOptions(o, OPTION_NAMES, "WhatsApp option");
    this.#accessToken = checkString(o, "accessToken", true)!;
    const phoneNumberId = checkString(o, "phoneNumberId", true)!;
    if (!PHONE_NUMBER_ID.test(phoneNumberId)) {
      throw new RangeError(`Option "phoneNumberId" must be the phone number id (digits), got ${show(phoneNumberId)}`);
    }
    this.phoneNumberId = phoneNumberId;
    this.connectionId = phoneNumberId;
    const appSecret = checkString(o, "appSecret", true)!;
    this.#verifyToken = encoder.encode(checkString(o, "verifyToken", true)!);
    const base = checkString(o, "graphBase", false) ?? DEFAULT_GRAPH_BASE;
    let url: URL | null = null;
    try {
      url = new URL(base);
    } catch {
      url = null;
    }
    if (url === null || (url.protocol !== "https:" && url.protocol !== "http:") || url.search !== "" || url.hash !== "") {
      throw new TypeError(`Option "graphBase" must be an http(s) URL without query or fragment, got ${show(base)}`);
    }
    this.graphBase = base.replace(/\/+$/, "");
    const version = checkString(o, "graphVersion", false) ?? DEFAULT_GRAPH_VERSION;
    if (!/^v\d{1,3}\.\d{1,3}$/.test(version)) {
      throw new RangeError(`Option "graphVersion" must look like "v24.0", got ${show(version)}`);
    }
    this.graphVersion = version;
    if (o.fetch !== undefined && typeof o.fetch !== "function") {
      throw new TypeError(`Option "fetch" must be a function, got ${show(o.fetch)}`);
    }
    const f = (o.fetch as typeof fetch | undefined) ?? globalThis.fetch;
    if (typeof f !== "function") throw new TypeError(`Option "fetch" is required: this runtime has no global fetch`);
    this.#fetch = f;
    this.#timeoutMs = checkPositiveInt(o, "requestTimeoutMs", 30_000);
    this.#maxBodyBytes = checkPositiveInt(o, "maxBodyBytes", 1024 * 1024);
    this.#maxMediaBytes = checkPositiveInt(o, "maxMediaBytes", 100 * 1024 * 1024);
    this.name = checkString(o, "name", false) ?? "whatsapp";
    for (const name of ["onStatus", "onError"] as const) {
      if (o[name] !== undefined && typeof o[name] !== "function") {
        throw new TypeError(`Option "${name}" must be a function, got ${show(o[name])}`);
      }
    }
    this.#onStatus = options.onStatus;
    this.#onError = options.onError ?? ((error) => {
      if (this.#sink?.reportError) this.#sink.reportError(error);
      else console.warn(`[@botmesh/durable/whatsapp] ${error.message}`);
    });
    if (o.callbackData !== undefined && typeof o.callbackData !== "boolean") {
      throw new TypeError(`Option "callbackData" must be a boolean, got ${show(o.callbackData)}`);
    }
    this.#callbackData = options.callbackData ?? true;
    if (o.mediaKey !== undefined && typeof o.mediaKey !== "string" && !(o.mediaKey instanceof Uint8Array)) {
      throw new TypeError(`Option "mediaKey" must be a string or a Uint8Array, got ${show(o.mediaKey)}`);
    }
    this.#seal = new MediaSeal({
      provider: this.name,
      key: options.mediaKey ?? `botmesh.whatsapp.media-key\n${appSecret}`,
    });
    this.#appSecret = crypto.subtle.importKey(
      "raw",
      encoder.encode(appSecret),
      { name: "HMAC", hash: "SHA-256" },
      false,
      ["sign", "verify"],
    );
  }

  /**
   * Called by `bot.start()`: the webhook admits messages from now on.
   *
   * @param sink where inbound messages go
   */
  start(sink: InboundSink): void {
    this.#sink = sink;
  }

  /** Called by `bot.stop()`: the webhook answers 503 from now on (Meta redelivers later). */
  stop(): void {
    this.#sink = undefined;
  }

  // ---- webhook ------------------------------------------------------------------

  async #webhook(request: Request): Promise<Response> {
    try {
      if (request.method === "GET") return this.#verify(request);
      if (request.method !== "POST") {
        return plain(405, `Method ${request.method} not allowed: the WhatsApp webhook takes GET and POST`, {
          allow: "GET, POST",
        });
      }
      return await this.#post(request);
    } catch (error) {
      this.#report(error instanceof Error ? error : new Error(String(error)));
      return plain(500, "The webhook failed; redeliver later");
    }
  }

  #verify(request: Request): Response {
    const params = new URL(request.url).searchParams;
    const mode = params.get("hub.mode");
    const token = params.get("hub.verify_token");
    const challenge = params.get("hub.challenge");
    if (mode !== "subscribe" || token === null || challenge === null) {
      return plain(403, "Webhook verification needs hub.mode=subscribe, hub.verify_token and hub.challenge");
    }
    if (!sameBytes(encoder.encode(token), this.#verifyToken)) {
      return plain(403, "Webhook verification failed: hub.verify_token does not match");
    }
    return plain(200, challenge);
  }

  async #post(request: Request): Promise<Response> {
    const length = request.headers.get("content-length");
    if (length !== null && Number(length) > this.#maxBodyBytes) {
      await request.body?.cancel().catch(() => {});
      return plain(413, `Webhook body of ${length} bytes is over the limit of ${this.#maxBodyBytes} bytes`);
    }
    const header = request.headers.get("x-hub-signature-256");
    if (header === null) {
      await request.body?.cancel().catch(() => {});
      return plain(401, "Missing X-Hub-Signature-256 header");
    }
    const raw = await readCapped(request.body, this.#maxBodyBytes);
    if (raw === null) return plain(413, `Webhook body is over the limit of ${this.#maxBodyBytes} bytes`);
    const match = /^sha256=([0-9a-fA-F]{64})$/.exec(header.trim());
    const signature = match ? hexToBytes(match[1]) : null;
    if (signature === null) {
      return plain(401, `Malformed X-Hub-Signature-256 header: expected "sha256=" and 64 hex digits`);
    }
    const valid = await crypto.subtle.verify("HMAC", await this.#appSecret, signature, raw as Uint8Array<ArrayBuffer>);
    if (!valid) return plain(401, "X-Hub-Signature-256 does not match the body (wrong app secret, or the body was altered)");

    let payload: unknown;
    try {
      payload = JSON.parse(decoder.decode(raw));
    } catch (error) {
      return plain(400, `Webhook body is not valid JSON: ${(error as Error).message}`);
    }
    if (!isObject(payload)) return plain(400, `Webhook body must be a JSON object, got ${brief(payload)}`);
    if (payload.object !== "whatsapp_business_account") {
      return plain(400, `Webhook field "object" must be "whatsapp_business_account", got ${brief(payload.object)}`);
    }
    if (!Array.isArray(payload.entry)) return plain(400, `Webhook field "entry" must be an array, got ${brief(payload.entry)}`);

    const sink = this.#sink;
    if (sink === undefined) return plain(503, "The bot is not started; redeliver later", { "retry-after": "10" });

    const summary: WebhookSummary = {
      ok: true,
      admitted: 0,
      duplicates: 0,
      rejected: 0,
      unreadable: 0,
      statuses: 0,
      ignored: 0,
      errors: [],
    };
    const entries: MessageEntry[] = [];
    const statuses: { status: WhatsAppStatus; path: string }[] = [];
    const fail = (error: Error) => {
      summary.errors.push(error.message);
      this.#report(error);
    };
    /** A part of the payload that may hold a user message but cannot be read: journaled as unreadable. */
    const unreadable = (raw: unknown, error: WhatsAppPayloadError) => {
      fail(error);
      entries.push({ raw, error });
    };
    payload.entry.forEach((entry, e) => {
      const ePath = `entry[${e}]`;
      if (!isObject(entry) || !Array.isArray(entry.changes)) {
        unreadable(
          entry,
          new WhatsAppPayloadError(ePath, "changes", `field "changes" must be an array, got ${brief(isObject(entry) ? entry.changes : entry)}`),
        );
        return;
      }
      entry.changes.forEach((change, c) => {
        const cPath = `${ePath}.changes[${c}]`;
        if (!isObject(change)) {
          unreadable(change, new WhatsAppPayloadError(cPath, "", `a change must be an object, got ${brief(change)}`));
          return;
        }
        if (change.field !== "messages") {
          summary.ignored++; // another subscription (templates, account updates, calls, echoes, …): never a user message
          return;
        }
        if (!isObject(change.value)) {
          unreadable(change, new WhatsAppPayloadError(cPath, "value", `field "value" must be an object, got ${brief(change.value)}`));
          return;
        }
        const value = change.value;
        const vPath = `${cPath}.value`;
        const owner = ownerOf(value, vPath, this.phoneNumberId);
        if (owner.kind === "other") {
          summary.ignored++;
          // Reported once per number: a mistyped phoneNumberId would otherwise drop every message silently.
          if (Array.isArray(value.messages) && value.messages.length > 0 && !this.#otherNumbers.has(owner.id)) {
            this.#otherNumbers.add(owner.id);
            this.#report(
              new Error(
                `WhatsApp webhook: messages for phone number id ${show(owner.id)} were ignored: this provider is for ` +
                  `${show(this.phoneNumberId)} (the business phone number id, not the phone number). Give each number ` +
                  `its own provider and webhook URL`,
              ),
            );
          }
          return;
        }
        if (owner.kind === "unknown") {
          // No usable phone number id: the change may well be ours, so its messages are journaled as
          // unreadable (never acknowledged unseen); its statuses and errors, which are no user
          // messages and may be another number's, are skipped.
          const messages = value.messages;
          if (messages === undefined || (Array.isArray(messages) && messages.length === 0)) {
            summary.ignored++;
            return;
          }
          if (!Array.isArray(messages)) {
            unreadable(messages, new WhatsAppPayloadError(`${vPath}.messages`, owner.field, owner.message));
          } else {
            messages.forEach((m, i) => unreadable(m, new WhatsAppPayloadError(`${vPath}.messages[${i}]`, owner.field, owner.message)));
          }
          return;
        }
        if (owner.numeric !== undefined && !this.#numericIdReported) {
          this.#numericIdReported = true;
          this.#report(
            new Error(
              `WhatsApp webhook ${vPath}.metadata.phone_number_id: the phone number id is the number ${owner.numeric}, ` +
                `not a string; taken as this provider's ${show(this.phoneNumberId)} (reported once)`,
            ),
          );
        }
        const contacts = contactsOf(value);
        if (value.messages !== undefined) {
          if (!Array.isArray(value.messages)) {
            unreadable(
              value.messages,
              new WhatsAppPayloadError(`${cPath}.value`, "messages", `field "messages" must be an array, got ${brief(value.messages)}`),
            );
          } else {
            value.messages.forEach((m, i) => {
              try {
                entries.push({ parsed: parseMessage(m, `${cPath}.value.messages[${i}]`, contacts) });
              } catch (error) {
                if (!(error instanceof WhatsAppPayloadError)) throw error;
                unreadable(m, error);
              }
            });
          }
        }
        if (value.statuses !== undefined) {
          if (!Array.isArray(value.statuses)) {
            fail(new WhatsAppPayloadError(`${cPath}.value`, "statuses", `field "statuses" must be an array, got ${brief(value.statuses)}`));
          } else {
            value.statuses.forEach((s, i) => {
              const path = `${cPath}.value.statuses[${i}]`;
              try {
                statuses.push({ status: parseStatus(s, path), path });
              } catch (error) {
                fail(error as Error);
              }
            });
          }
        }
        if (value.errors !== undefined) {
          // Errors of the app, the account or the platform, not tied to a message (130429, 131000, …).
          if (!Array.isArray(value.errors)) {
            fail(new WhatsAppPayloadError(`${cPath}.value`, "errors", `field "errors" must be an array, got ${brief(value.errors)}`));
          } else {
            value.errors.forEach((raw, i) => fail(new WhatsAppChangeError(`${cPath}.value.errors[${i}]`, raw)));
          }
        }
      });
    });

    const messages = await Promise.all(entries.map(async (entry): Promise<InboundMessage> => {
      if ("error" in entry) return await unreadableMessage(entry.raw, entry.error, this.phoneNumberId);
      const p = entry.parsed;
      if (p.media === undefined) return p.message as InboundMessage;
      const media = "ref" in p.media ? await this.#seal.seal(p.media.ref) : this.#seal.notDurable(p.media.why);
      return { ...p.message, media: media as unknown as JsonValue };
    }));
    summary.unreadable = messages.filter((m) => m.unreadable !== undefined).length;
    // Each chat's messages are admitted one after the other, in payload order; once one is
    // refused, the chat's later messages are not offered (Meta redelivers them all, in order,
    // with the refused one). Chats are admitted concurrently. A group is one chat.
    const chats = new Map<string, InboundMessage[]>();
    for (const m of messages) {
      const list = chats.get(m.chatId);
      if (list) list.push(m);
      else chats.set(m.chatId, [m]);
    }
    const refused: string[] = [];
    await Promise.all([...chats.values()].map(async (list) => {
      for (const [i, m] of list.entries()) {
        let result: AdmitResult;
        try {
          result = await sink.receive(m);
        } catch (error) {
          result = { status: "rejected", id: m.id, error: error instanceof Error ? error : new Error(String(error)) };
        }
        if (result.status === "rejected") {
          summary.rejected += list.length - i;
          refused.push(`${m.id}: ${result.error?.message ?? "rejected"}`);
          for (const later of list.slice(i + 1)) refused.push(`${later.id}: held back behind ${m.id}`);
          return;
        }
        if (result.status === "duplicate") summary.duplicates++;
        else summary.admitted++;
      }
    }));

    let statusFailed = false;
    let confirmFailed = false;
    for (const { status, path } of statuses) {
      summary.statuses++;
      // A status that says the send reached WhatsApp settles an ambiguous send with that outbox key.
      // Only a callback data that can be a journal key is offered (well-formed, no NUL): any other is
      // no outbox key of ours, and a journal that refuses it would refuse it on every redelivery.
      const key = status.callbackData;
      if (
        key !== undefined && key !== "" && isWellFormed(key) && !key.includes("\u0000") &&
        CONFIRMING_STATUSES.has(status.status) && sink.confirmSent
      ) {
        try {
          await sink.confirmSent(key, status.id);
        } catch (error) {
          // The journal failed: answered 503, so that Meta redelivers the POST and the status with it.
          confirmFailed = true;
          fail(
            new Error(
              `WhatsApp webhook ${path}: confirmSent(${show(status.callbackData)}, ${show(status.id)}) failed for the ` +
                `"${status.status}" status: ${(error as Error)?.message ?? String(error)}`,
              { cause: error },
            ),
          );
        }
      }
      if (this.#onStatus === undefined) continue;
      try {
        await this.#onStatus(status);
      } catch (error) {
        statusFailed = true;
        fail(new Error(`WhatsApp webhook ${path}: onStatus threw for ${show(status.id)}: ${(error as Error)?.message ?? String(error)}`, {
          cause: error,
        }));
      }
    }

    if (refused.length > 0 || statusFailed || confirmFailed) {
      summary.ok = false;
      const why = [
        refused.length > 0 ? `${refused.length} message(s) were not admitted (${refused.join("; ")})` : "",
        confirmFailed ? "confirmSent failed" : "",
        statusFailed ? "onStatus failed" : "",
      ].filter((s) => s !== "").join("; ");
      summary.errors.unshift(`${why}; redeliver the POST`);
      return json(503, summary);
    }
    return json(200, summary);
  }

  #report(error: Error): void {
    try {
      this.#onError(error);
    } catch {
      // a throwing onError must not break the webhook
    }
  }

  // ---- sends --------------------------------------------------------------------

  /**
   * Send content to a chat (a WhatsApp id) through the Graph API.
   *
   * @param chatId the chat: a phone number (`wa_id`, sent with `to`), `bsuid:<business-scoped user id>`
   *   (sent with `recipient`), or `group:<group id>` (sent with `recipient_type: "group"`); see {@link whatsAppChatId}
   * @param content text, or a message object (see the class documentation)
   * @param context the outbox key, the attempt, and the bot's abort signal
   * @returns the `wamid` of the sent message
   * @throws {WhatsAppApiError} when the Graph API refuses it (`retryable` says whether to retry)
   * @throws {ProviderError} on a network error or timeout (retryable), or content that cannot be sent (permanent)
   */
  async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    const body = this.#messageBody(chatId, content, context?.idempotencyKey);
    const url = `${this.graphBase}/${this.graphVersion}/${encodeURIComponent(this.phoneNumberId)}/messages`;
    const { response, text } = await this.#call("POST", url, JSON.stringify(body), context?.signal, "send");
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
  async markRead(messageId: string, options: { typing?: boolean; signal?: AbortSignal } = {}): Promise<void> {
    if (typeof messageId !== "string" || messageId === "") {
      throw new TypeError(`Argument "messageId" must be a non-empty string, got ${show(messageId)}`);
    }
    const body: Record<string, unknown> = { messaging_product: "whatsapp", status: "read", message_id: messageId };
    if (options.typing === true) body.typing_indicator = { type: "text" };
    const url = `${this.graphBase}/${this.graphVersion}/${encodeURIComponent(this.phoneNumberId)}/messages`;
    const { response, text } = await this.#call("POST", url, JSON.stringify(body), options.signal, "mark as read");
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

  /**
   * Say whether an error thrown by {@link WhatsAppProvider.send} may be retried.
   *
   * @param error what `send` threw
   * @returns retryable or not, and the retry-after
   */
  classifyError(error: unknown): ErrorClassification {
    return classifyProviderError(error);
  }

  #messageBody(chatId: string, content: OutboundContent, key: string | undefined): Record<string, unknown> {
    const permanent = (message: string) => new ProviderError(message, { retryable: false });
    const target = this.#target(chatId);
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
      this.#callbackData && typeof key === "string" && key !== "" && key.length <= 512 && body.type !== "reaction" &&
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
  #target(chatId: string): Record<string, string> {
    const permanent = (message: string) => new ProviderError(message, { retryable: false });
    if (typeof chatId !== "string" || chatId === "") throw permanent(`WhatsApp cannot send to chat ${show(chatId)}: the chat id is empty`);
    if (chatId === `wa:${this.phoneNumberId}:unreadable` || /^wa:[^:]*:unreadable$/.test(chatId)) {
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

  /** One Graph API request with the bearer token, under the request timeout and `signal`. */
  async #call(
    method: "GET" | "POST",
    url: string,
    body: string | undefined,
    signal: AbortSignal | undefined,
    what: string,
  ): Promise<{ response: Response; text: string }> {
    const { response, bytes } = await this.#fetchBytes(method, url, body, signal, what, 4 * 1024 * 1024);
    return { response, text: decoder.decode(bytes) };
  }

  async #fetchBytes(
    method: "GET" | "POST",
    url: string,
    body: string | undefined,
    signal: AbortSignal | undefined,
    what: string,
    maxBytes: number,
  ): Promise<{ response: Response; bytes: Uint8Array }> {
    const timeout = AbortSignal.timeout(this.#timeoutMs);
    const combined = signal ? anySignal(signal, timeout) : timeout;
    const headers: Record<string, string> = { authorization: `Bearer ${this.#accessToken}` };
    if (body !== undefined) headers["content-type"] = "application/json";
    try {
      const response = await this.#fetch(url, { method, headers, body, signal: combined });
      const bytes = await readCapped(response.body, maxBytes);
      if (bytes === null) {
        throw new ProviderError(`WhatsApp ${what}: the answer is over ${maxBytes} bytes`, {
          retryable: false,
          status: response.status,
        });
      }
      return { response, bytes };
    } catch (error) {
      if (error instanceof ProviderError) throw error;
      if (timeout.aborted) {
        throw new ProviderError(`WhatsApp ${what} timed out after ${this.#timeoutMs} ms (requestTimeoutMs)`, {
          retryable: true,
          maybeDelivered: true, // Meta may have accepted it before the answer was cut off
          cause: error,
        });
      }
      if (signal?.aborted) throw new ProviderError(`WhatsApp ${what} was aborted`, { retryable: true, cause: error });
      throw new ProviderError(`WhatsApp ${what} failed: ${(error as Error)?.message ?? String(error)}`, {
        retryable: true,
        cause: error,
      });
    }
  }

  // ---- media --------------------------------------------------------------------

  /**
   * Load an inbound message's media again: the media id's URL from the Graph
   * API, then the bytes (checked against the SHA-256 Meta gives). The
   * download URL gets the access token too, as Meta requires, but only over
   * https (or when it is on `graphBase` itself, as with a test server).
   *
   * @param media the journaled reference
   * @param context the message, and an abort signal
   * @returns the bytes, MIME type and file name
   * @throws {MediaUnavailableError} `rehydrate-failed` when the reference is tampered with, the media expired
   *   (Meta answers 400/404 for a media id older than about 30 days) or its bytes do not match its hash
   * @throws {ProviderError} on a network error, timeout or 5xx (the inbox retries the message)
   */
  async loadMedia(media: StoredMediaRef, context: MediaLoadContext): Promise<LoadedMedia> {
    const messageId = context?.message?.id;
    const ref = await this.#seal.open(media, messageId);
    if (!isObject(ref) || typeof ref.mediaId !== "string" || ref.mediaId === "") {
      throw new MediaUnavailableError("rehydrate-failed", `The media reference of message ${show(messageId)} has no "mediaId"`, {
        messageId,
      });
    }
    const gone = (what: string, cause: unknown) =>
      new MediaUnavailableError(
        "rehydrate-failed",
        `The media ${show(ref.mediaId)} of message ${show(messageId)} is no longer available (${what})`,
        { messageId, cause },
      );
    const metaUrl = `${this.graphBase}/${this.graphVersion}/${encodeURIComponent(ref.mediaId)}?phone_number_id=${
      encodeURIComponent(this.phoneNumberId)
    }`;
    const { response, text } = await this.#call("GET", metaUrl, undefined, context?.signal, "media lookup");
    let meta: unknown;
    try {
      meta = JSON.parse(text);
    } catch {
      meta = undefined;
    }
    if (!response.ok) {
      const error = graphError(response, meta, text, "media lookup");
      // Graph sends throttling codes (4, 80007, 130429, …) with a 400 too: those are retried, not "gone".
      if (!error.retryable && (response.status === 400 || response.status === 404 || response.status === 410)) {
        throw gone(`the Graph API answered HTTP ${response.status}: ${error.message}`, error);
      }
      throw error;
    }
    if (!isObject(meta) || typeof meta.url !== "string" || meta.url === "") {
      throw new ProviderError(`WhatsApp media lookup of ${show(ref.mediaId)} answered without a "url": got ${snippet(text)}`, {
        retryable: true,
        status: response.status,
      });
    }
    let target: URL;
    try {
      target = new URL(meta.url);
    } catch {
      target = new URL("invalid:");
    }
    if (target.protocol !== "https:" && target.origin !== new URL(this.graphBase).origin) {
      // the access token only goes over TLS, or to the configured Graph base itself
      throw new ProviderError(`WhatsApp media lookup of ${show(ref.mediaId)} gave a URL that is not https: ${show(meta.url)}`, {
        retryable: true,
        status: response.status,
      });
    }
    const download = await this.#fetchBytes("GET", meta.url, undefined, context?.signal, "media download", this.#maxMediaBytes)
      .catch((error) => {
        if (error instanceof ProviderError && error.retryable === false) throw gone(error.message, error);
        throw error;
      });
    if (!download.response.ok) {
      const status = download.response.status;
      const error = graphError(download.response, undefined, decoder.decode(download.bytes), "media download");
      if (status === 400 || status === 403 || status === 404 || status === 410) {
        throw gone(`the download answered HTTP ${status}`, error);
      }
      throw error;
    }
    const expected = typeof meta.sha256 === "string" && meta.sha256 !== ""
      ? meta.sha256
      : typeof ref.sha256 === "string" && ref.sha256 !== ""
      ? ref.sha256
      : undefined;
    if (expected !== undefined) {
      const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", download.bytes as Uint8Array<ArrayBuffer>));
      const hex = toHex(digest);
      const b64 = toBase64(digest);
      const e = expected.trim();
      if (e.toLowerCase() !== hex && e !== b64 && e !== b64.replace(/=+$/, "")) {
        throw gone(`its SHA-256 is ${hex}, Meta said ${e}`, undefined);
      }
    }
    const mimeType = typeof meta.mime_type === "string" ? meta.mime_type : typeof ref.mimeType === "string" ? ref.mimeType : undefined;
    const fileName = typeof ref.fileName === "string" ? ref.fileName : undefined;
    return {
      data: download.bytes,
      ...(mimeType !== undefined ? { mimeType } : {}),
      ...(fileName !== undefined ? { fileName } : {}),
    };
  }
}

/** `show(value)`, cut to 200 characters. */
function brief(value: unknown): string {
  const text = show(value);
  return text.length > 200 ? `${text.slice(0, 200)}…` : text;
}

function snippet(text: string): string {
  return text === "" ? "an empty body" : show(text.length > 200 ? `${text.slice(0, 200)}…` : text);
}

/** The error for a non-2xx Graph answer, classified. */
function graphError(response: Response, parsed: unknown, text: string, what: string): WhatsAppApiError {
  const status = response.status;
  const error = isObject(parsed) && isObject(parsed.error) ? parsed.error : undefined;
  const code = typeof error?.code === "number" ? error.code : undefined;
  const subcode = typeof error?.error_subcode === "number" ? error.error_subcode : undefined;
  const type = typeof error?.type === "string" ? error.type : undefined;
  const message = typeof error?.message === "string" ? error.message : undefined;
  const data = isObject(error?.error_data) ? error.error_data : undefined;
  const details = typeof data?.details === "string" ? data.details : undefined;
  const fbtraceId = typeof error?.fbtrace_id === "string" ? error.fbtrace_id : undefined;
  const { retryable, retryAfterMs } = classifyGraphError(status, code, response.headers);
  const head = code !== undefined ? `error ${code}${subcode !== undefined ? `/${subcode}` : ""}` : "error";
  const text2 = error
    ? `${message ?? "no message"}${details !== undefined && details !== message ? ` (${details})` : ""}${
      fbtraceId ? ` [fbtrace_id ${fbtraceId}]` : ""
    }`
    : `not a Graph error body: ${snippet(text)}`;
  return new WhatsAppApiError(`WhatsApp ${what} failed with HTTP ${status}, ${head}: ${text2}`, {
    status,
    code,
    subcode,
    type,
    details,
    fbtraceId,
    retryable,
    retryAfterMs,
  });
}

// ---- webhook payload parsing ------------------------------------------------------------

/** A non-empty string of at most `max` characters, well-formed Unicode (ids, chat ids); otherwise an error naming the field. */
function requireString(m: Record<string, unknown>, field: string, path: string, max = 512): string {
  const value = m[field];
  if (typeof value !== "string" || value === "" || value.length > max) {
    throw new WhatsAppPayloadError(
      path,
      field,
      `field "${field}" must be a non-empty string of at most ${max} characters, got ${value === undefined ? "undefined" : brief(value)}`,
    );
  }
  if (!isWellFormed(value)) {
    throw new WhatsAppPayloadError(path, field, `field "${field}" must be well-formed Unicode (it has a lone surrogate), got ${brief(value)}`);
  }
  return value;
}

/** Like {@link requireString}, but absent, `null` and `""` are `undefined` (Meta omits or empties a withheld phone number). */
function optionalString(m: Record<string, unknown>, field: string, path: string, max = 512): string | undefined {
  const value = m[field];
  if (value === undefined || value === null || value === "") return undefined;
  return requireString(m, field, path, max);
}

/** The same, for a salvage: whatever is not a usable string is `undefined`. */
function usableString(value: unknown, max: number): string | undefined {
  return typeof value === "string" && value !== "" && value.length <= max && isWellFormed(value) ? value : undefined;
}

function parseTimestamp(value: unknown, path: string): number | undefined {
  if (value === undefined) return undefined;
  const n = typeof value === "string" && /^\d{1,12}$/.test(value) ? Number(value) : typeof value === "number" ? value : NaN;
  if (!Number.isFinite(n) || n < 0) {
    throw new WhatsAppPayloadError(path, "timestamp", `field "timestamp" must be seconds since the epoch, got ${brief(value)}`);
  }
  return n * 1000;
}

/** The longest id that gets a prefix in a chat id (a BSUID is at most 2 + 1 + 4 + 128 characters). */
const MAX_PREFIXED_ID = 256;

/** What the `contacts` array of a change says about each sender, by phone number and by user id. */
interface ContactInfo {
  name?: string;
  username?: string;
}

/** The contacts of a change, keyed by `wa_id` and by `user_id` (and `parent_user_id`). */
function contactsOf(value: Record<string, unknown>): Map<string, ContactInfo> {
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

function senderOf(raw: Record<string, unknown>, path: string): Sender {
  const phone = optionalString(raw, "from", path);
  const userId = optionalString(raw, "from_user_id", path, MAX_PREFIXED_ID);
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
        `the message has no sender: field "from" (the phone number) is ${brief(raw.from)} and field "from_user_id" ` +
          `(the business-scoped user id) is ${brief(raw.from_user_id)}`,
      );
    })();
  if (participant !== undefined) sender.from = participant;
  if (phone !== undefined) sender.phone = phone;
  if (userId !== undefined) sender.userId = userId;
  if (parentUserId !== undefined) sender.parentUserId = parentUserId;
  return sender;
}

function parseMessage(raw: unknown, path: string, contacts: Map<string, ContactInfo>): ParsedMessage {
  if (!isObject(raw)) throw new WhatsAppPayloadError(path, "", `a message must be an object, got ${brief(raw)}`);
  const id = requireString(raw, "id", path);
  const sender = senderOf(raw, path);
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
  const body = raw[type];

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
    extra[type] = info;
  } else if (type === "interactive") {
    if (!isObject(body) || typeof body.type !== "string") {
      throw new WhatsAppPayloadError(path, "interactive.type", `field "interactive.type" must be a string, got ${brief(isObject(body) ? body.type : body)}`);
    }
    const reply = body[body.type];
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
    if (body !== undefined) extra[type] = body as JsonValue;
  }
  message.extra = extra;
  return media === undefined ? { message } : { message, media };
}

/** A phone number id as the `phoneNumberId` option takes it (and as a change of another number must spell it). */
const PHONE_NUMBER_ID = /^[A-Za-z0-9_-]{1,64}$/;

/**
 * Whose change a `messages` change is, by `value.metadata.phone_number_id`:
 * - `ours`: our id, or (`numeric`) a JSON number whose decimal form is our id
 *   (a safe integer, so it is exactly what was sent: it can only mean our id);
 * - `other`: another well-formed phone number id (a string);
 * - `unknown`: `metadata` or `phone_number_id` missing or malformed (another
 *   number, our id spelt badly, ...): it may be ours; `field` is the full
 *   path of the field at fault and `message` says what is wrong with it.
 */
type ChangeOwner =
  | { kind: "ours"; numeric?: number }
  | { kind: "other"; id: string }
  | { kind: "unknown"; field: string; message: string };

function ownerOf(value: Record<string, unknown>, path: string, ours: string): ChangeOwner {
  const metadata = value.metadata;
  const mPath = `${path}.metadata`;
  if (metadata === undefined) return { kind: "unknown", field: mPath, message: `field "${mPath}" is missing` };
  if (!isObject(metadata)) {
    return { kind: "unknown", field: mPath, message: `field "${mPath}" must be an object, got ${brief(metadata)}` };
  }
  const id = metadata.phone_number_id;
  const iPath = `${mPath}.phone_number_id`;
  if (id === ours) return { kind: "ours" };
  if (id === undefined) return { kind: "unknown", field: iPath, message: `field "${iPath}" is missing` };
  if (typeof id === "number" && Number.isSafeInteger(id) && String(id) === ours) return { kind: "ours", numeric: id };
  if (typeof id !== "string") {
    return { kind: "unknown", field: iPath, message: `field "${iPath}" must be a string, got ${brief(id)}` };
  }
  if (!PHONE_NUMBER_ID.test(id)) {
    return {
      kind: "unknown",
      field: iPath,
      message: `field "${iPath}" must be a phone number id (1 to 64 letters, digits, "_" or "-"), got ${brief(id)}`,
    };
  }
  return { kind: "other", id };
}

/**
 * A user message that could not be parsed, as it is journaled: `unreadable`
 * says why (naming the field), `extra.raw` keeps Meta's object. Its id is the
 * `wamid` when the message has a usable one, else `unreadable:sha256:` and the
 * SHA-256 of the message's JSON, so a redelivery of the POST is a duplicate.
 * Its chat is whatever sender or group field is usable, else
 * `wa:<phone number id>:unreadable`.
 */
async function unreadableMessage(raw: unknown, error: WhatsAppPayloadError, phoneNumberId: string): Promise<InboundMessage> {
  const m = isObject(raw) ? raw : {};
  let id = usableString(m.id, 512);
  if (id === undefined) {
    id = `unreadable:sha256:${await sha256Hex(JSON.stringify(raw) ?? "undefined")}`;
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

function parseStatus(raw: unknown, path: string): WhatsAppStatus {
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
