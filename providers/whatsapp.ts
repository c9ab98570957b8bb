/**
 * The WhatsApp Cloud API provider (`@botmesh/durable/whatsapp`).
 *
 * Inbound: a Web-standard webhook handler ({@link WhatsAppProvider.webhook})
 * that answers Meta's verification GET (`hub.challenge`), checks the
 * `X-Hub-Signature-256` of every POST, admits each message of the payload to
 * the bot (ids are the `wamid`s, so Meta's redeliveries are recognised) and
 * answers 200 only once every message is admitted; when one is refused (the
 * journal failed: fail closed) it answers 503 and Meta redelivers the whole
 * POST, whose already admitted messages come back as duplicates and are
 * dropped by the bot. Status callbacks (sent, delivered, read, failed) are not
 * messages: they go to the `onStatus` option.
 *
 * Outbound: `POST /{version}/{phone-number-id}/messages` on the Graph API,
 * with errors classified from the HTTP status and the Graph error code
 * (throttling and transient errors are retried, honouring `Retry-After`;
 * permanent ones go straight to the dead-letter queue).
 *
 * Media: the media id of an inbound image, audio, video, document or sticker
 * is sealed into the inbox record, and `loadMediaOf(ctx)` downloads it again
 * through the Graph API (Cloud API media ids live about 30 days).
 *
 * Web-standard only (`fetch`, `Request`/`Response`, Web Crypto), so the
 * webhook mounts in `Bun.serve`, `Deno.serve`, or Node's `http` through the
 * core's adapter: `createServer(nodeHandler(provider.webhook))`.
 *
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { WhatsAppProvider } from "@botmesh/durable/whatsapp";
 *
 * const provider = new WhatsAppProvider({
 *   accessToken: "EAAG…",
 *   phoneNumberId: "106540352242922",
 *   appSecret: "the app secret of the Meta app",
 *   verifyToken: "the token typed into the webhook settings",
 * });
 * const bot = new Bot({ provider, durability: { backend: new MemoryDurability(), instanceId: "wa-1" } });
 * bot.when(/hello/i, (ctx) => ctx.reply("Hi!"));
 * await bot.start();
 * Deno.serve({ port: 8080 }, provider.webhook);
 * ```
 *
 * @module
 */
import type { JsonValue } from "../src/backend.ts";
import { ProviderError } from "../src/errors.ts";
import { type LoadedMedia, type MediaLoadContext, MediaSeal, MediaUnavailableError, type StoredMediaRef } from "../src/media.ts";
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
} from "../src/provider.ts";
import { readCapped } from "../src/read_capped.ts";
import { showValue as show } from "../src/show.ts";

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
  /** The recipient's WhatsApp id. */
  recipientId?: string;
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
   */
  onStatus?: (status: WhatsAppStatus) => void | Promise<void>;
  /**
   * Called with each problem of a webhook POST that does not make Meta
   * redeliver it: a message or status entry with missing or invalid fields
   * (skipped; the rest of the batch is admitted), an `onStatus` that threw.
   * Default: the bot's `error` event (`console.warn` before the bot started).
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
 * has one of the wrong type; `path` locates it in the payload and `field`
 * names the field. It is skipped; the rest of the batch is admitted.
 */
export class WhatsAppPayloadError extends Error {
  /** Where in the payload, e.g. `entry[0].changes[0].value.messages[1]`. */
  readonly path: string;
  /** The field, e.g. `from` or `text.body`. */
  readonly field: string;
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
  }
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

/** A message of a webhook POST, parsed, before its media is sealed. */
interface ParsedMessage {
  message: Omit<InboundMessage, "media">;
  media?: { ref: { [key: string]: JsonValue } } | { why: string };
}

/** What a webhook POST was answered, in its JSON body. */
interface WebhookSummary {
  ok: boolean;
  admitted: number;
  duplicates: number;
  rejected: number;
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
 * bot is not started or a message was not admitted (Meta redelivers), else 200
 * with a JSON summary; other methods 405. A change for another phone number id
 * is ignored (answered 200; its messages are reported once per number through
 * `onError`): give each number its own provider and webhook URL. The messages of one chat in a
 * POST are admitted one after the other in payload order; when one is refused,
 * the chat's later ones are held back, so the redelivery keeps their order.
 *
 * Sends: a string is a text message; `{ text, previewUrl?, replyTo? }` too;
 * `{ image | audio | video | document | sticker: { link | id, caption?, filename? } }`,
 * `{ interactive }`, `{ template }`, `{ location }`, `{ contacts }`,
 * `{ reaction }` send that type; `{ type, ... }` is sent as given (the Graph
 * message object without `messaging_product` and `to`). `replyTo` (a `wamid`)
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
    for (const key of Object.keys(o)) {
      if (!OPTION_NAMES.includes(key)) {
        throw new TypeError(`Unknown option ${show(key)}; known options are ${OPTION_NAMES.map((n) => `"${n}"`).join(", ")}`);
      }
    }
    this.#accessToken = checkString(o, "accessToken", true)!;
    const phoneNumberId = checkString(o, "phoneNumberId", true)!;
    if (!/^[A-Za-z0-9_-]{1,64}$/.test(phoneNumberId)) {
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

    const summary: WebhookSummary = { ok: true, admitted: 0, duplicates: 0, rejected: 0, statuses: 0, ignored: 0, errors: [] };
    const parsed: ParsedMessage[] = [];
    const statuses: { status: WhatsAppStatus; path: string }[] = [];
    const fail = (error: Error) => {
      summary.errors.push(error.message);
      this.#report(error);
    };
    payload.entry.forEach((entry, e) => {
      const ePath = `entry[${e}]`;
      if (!isObject(entry) || !Array.isArray(entry.changes)) {
        fail(new WhatsAppPayloadError(ePath, "changes", `field "changes" must be an array, got ${brief(isObject(entry) ? entry.changes : entry)}`));
        return;
      }
      entry.changes.forEach((change, c) => {
        const cPath = `${ePath}.changes[${c}]`;
        if (!isObject(change)) {
          fail(new WhatsAppPayloadError(cPath, "", `a change must be an object, got ${brief(change)}`));
          return;
        }
        if (change.field !== "messages") {
          summary.ignored++; // another subscription (templates, account updates, …)
          return;
        }
        if (!isObject(change.value)) {
          fail(new WhatsAppPayloadError(cPath, "value", `field "value" must be an object, got ${brief(change.value)}`));
          return;
        }
        const value = change.value;
        const phone = isObject(value.metadata) ? value.metadata.phone_number_id : undefined;
        if (phone !== this.phoneNumberId) {
          summary.ignored++;
          // Reported once per number: a mistyped phoneNumberId would otherwise drop every message silently.
          const other = String(phone);
          if (Array.isArray(value.messages) && value.messages.length > 0 && !this.#otherNumbers.has(other)) {
            this.#otherNumbers.add(other);
            this.#report(
              new Error(
                `WhatsApp webhook: messages for phone number id ${show(phone)} were ignored: this provider is for ` +
                  `${show(this.phoneNumberId)} (the business phone number id, not the phone number). Give each number ` +
                  `its own provider and webhook URL`,
              ),
            );
          }
          return;
        }
        const names = new Map<string, string>();
        if (Array.isArray(value.contacts)) {
          for (const contact of value.contacts) {
            if (isObject(contact) && typeof contact.wa_id === "string" && isObject(contact.profile)) {
              const name = contact.profile.name;
              if (typeof name === "string") names.set(contact.wa_id, name);
            }
          }
        }
        if (value.messages !== undefined) {
          if (!Array.isArray(value.messages)) {
            fail(new WhatsAppPayloadError(`${cPath}.value`, "messages", `field "messages" must be an array, got ${brief(value.messages)}`));
          } else {
            value.messages.forEach((m, i) => {
              try {
                parsed.push(parseMessage(m, `${cPath}.value.messages[${i}]`, names));
              } catch (error) {
                fail(error as Error);
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
      });
    });

    const messages = await Promise.all(parsed.map(async (p): Promise<InboundMessage> => {
      if (p.media === undefined) return p.message as InboundMessage;
      const media = "ref" in p.media ? await this.#seal.seal(p.media.ref) : this.#seal.notDurable(p.media.why);
      return { ...p.message, media: media as unknown as JsonValue };
    }));
    // Each chat's messages are admitted one after the other, in payload order; once one is
    // refused, the chat's later messages are not offered (Meta redelivers them all, in order,
    // with the refused one). Chats are admitted concurrently.
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
    for (const { status, path } of statuses) {
      summary.statuses++;
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

    if (refused.length > 0 || statusFailed) {
      summary.ok = false;
      const why = refused.length > 0
        ? `${refused.length} message(s) were not admitted (${refused.join("; ")})`
        : "onStatus failed";
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
   * @param chatId the recipient's WhatsApp id (`wa_id`)
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

  #messageBody(to: string, content: OutboundContent, key: string | undefined): Record<string, unknown> {
    const base: Record<string, unknown> = { messaging_product: "whatsapp", recipient_type: "individual", to };
    const permanent = (message: string) => new ProviderError(message, { retryable: false });
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
        body = { ...base, ...c, messaging_product: "whatsapp", to };
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

function requireString(m: Record<string, unknown>, field: string, path: string): string {
  const value = m[field];
  if (typeof value !== "string" || value === "" || value.length > 512) {
    throw new WhatsAppPayloadError(
      path,
      field,
      `field "${field}" must be a non-empty string of at most 512 characters, got ${value === undefined ? "undefined" : brief(value)}`,
    );
  }
  return value;
}

function parseTimestamp(value: unknown, path: string): number | undefined {
  if (value === undefined) return undefined;
  const n = typeof value === "string" && /^\d{1,12}$/.test(value) ? Number(value) : typeof value === "number" ? value : NaN;
  if (!Number.isFinite(n) || n < 0) {
    throw new WhatsAppPayloadError(path, "timestamp", `field "timestamp" must be seconds since the epoch, got ${brief(value)}`);
  }
  return n * 1000;
}

function parseMessage(raw: unknown, path: string, names: Map<string, string>): ParsedMessage {
  if (!isObject(raw)) throw new WhatsAppPayloadError(path, "", `a message must be an object, got ${brief(raw)}`);
  const id = requireString(raw, "id", path);
  const from = requireString(raw, "from", path);
  const type = requireString(raw, "type", path);
  const timestamp = parseTimestamp(raw.timestamp, path);
  const extra: { [key: string]: JsonValue } = { waType: type };
  const name = names.get(from);
  if (name !== undefined) extra.profileName = name;
  for (const key of ["context", "referral", "errors"]) {
    if (raw[key] !== undefined) extra[key] = raw[key] as JsonValue;
  }
  const message: Omit<InboundMessage, "media"> = { id, chatId: from, type, from };
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

function parseStatus(raw: unknown, path: string): WhatsAppStatus {
  if (!isObject(raw)) throw new WhatsAppPayloadError(path, "", `a status must be an object, got ${brief(raw)}`);
  const id = requireString(raw, "id", path);
  const status = requireString(raw, "status", path);
  const result: WhatsAppStatus = { id, status, raw: raw as JsonValue };
  if (typeof raw.recipient_id === "string") result.recipientId = raw.recipient_id;
  const timestamp = parseTimestamp(raw.timestamp, path);
  if (timestamp !== undefined) result.timestamp = timestamp;
  if (typeof raw.biz_opaque_callback_data === "string") result.callbackData = raw.biz_opaque_callback_data;
  if (raw.errors !== undefined) result.errors = raw.errors as JsonValue;
  return result;
}
