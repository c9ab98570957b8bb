/**
 * TelegramProvider (see `mod.ts` for the user documentation).
 *
 * @module
 */
import { delay } from "../../src/runtime/mod.ts";
import { checkKnownOptions } from "../../src/options.ts";
import type { JsonValue } from "../../src/contract.ts";
import { isRetryableStatus, ProviderError } from "../../src/errors.ts";
import { type LoadedMedia, type MediaLoadContext, MediaSeal, MediaUnavailableError, type StoredMediaRef } from "../../src/media.ts";
import {
  classifyProviderError,
  type ErrorClassification,
  type InboundMessage,
  type InboundSink,
  type MessageType,
  type OutboundContent,
  type Provider,
  type SendContext,
  type SendReceipt,
} from "../../src/provider.ts";
import { readCapped } from "../../src/read_capped.ts";
import { sha256Hex } from "../../src/sha256_hex.ts";
import { showValue as show } from "../../src/show.ts";

/** The largest file the Bot API lets a bot download (`getFile`): 20 MB. */
export const TELEGRAM_MAX_DOWNLOAD_BYTES: number = 20 * 1024 * 1024;

/**
 * The default `allowedUpdates`: the update kinds this provider turns into
 * inbound messages. It also takes `business_message` when `allowedUpdates`
 * asks for it (a reply to one needs the `business_connection_id` it carries in
 * `extra.businessConnectionId`).
 */
export const TELEGRAM_HANDLED_UPDATES: readonly string[] = Object.freeze(["message", "channel_post", "callback_query"]);

/** A Telegram update the provider acknowledged without handing it to the bot. */
export interface SkippedUpdate {
  /** The update's `update_id`. */
  updateId: number;
  /** Its kind (`edited_message`, `my_chat_member`, …). */
  kind: string;
  /** The update as Telegram sent it. */
  update: Record<string, unknown>;
}

/** Options of {@link TelegramProvider}. */
export interface TelegramProviderOptions {
  /** The bot token from @BotFather (`123456:ABC-…`). Required. */
  token: string;
  /**
   * `'webhook'` (default): updates arrive through {@link TelegramProvider.webhook};
   * `'polling'`: `start()` runs a `getUpdates` long-poll loop (the bot's webhook
   * must be deleted: see `deleteWebhookOnStart`).
   */
  mode?: "webhook" | "polling";
  /**
   * The secret Telegram sends in `X-Telegram-Bot-Api-Secret-Token` (1–256 of
   * `A-Z a-z 0-9 _ -`, as given to `setWebhook`). Required in webhook mode;
   * `false` turns the check off (anyone who finds the URL can then inject updates).
   */
  secretToken?: string | false;
  /** The Bot API server (default `https://api.telegram.org`). */
  apiBase?: string;
  /** The `fetch` to call the API with (default `globalThis.fetch`). */
  fetch?: typeof fetch;
  /**
   * The HMAC key sealing media references in the inbox (at least 16 bytes).
   * Default: derived from the token, so rotating the token makes stored
   * references fail with `rehydrate-failed` (their `file_id`s stay valid for
   * the bot, but give a fixed key to keep them loadable).
   */
  mediaKey?: string | Uint8Array;
  /** Long-poll `timeout` of `getUpdates`, in seconds (default 30; 0…50). */
  pollTimeoutSec?: number;
  /** How long one API call may take, in ms (default 30000; a long poll gets `pollTimeoutSec` on top). */
  requestTimeoutMs?: number;
  /** `allowed_updates` of `getUpdates` and {@link TelegramProvider.setWebhook} (default {@link TELEGRAM_HANDLED_UPDATES}). */
  allowedUpdates?: readonly string[];
  /** The provider name, journaled with each record (default `'telegram'`). */
  name?: string;
  /** Polling mode: call `deleteWebhook` before the first `getUpdates` (default `false`). */
  deleteWebhookOnStart?: boolean;
  /** Polling backoff after a failed `getUpdates` or a refused admission (default `{ baseMs: 500, capMs: 30000 }`). */
  pollBackoff?: { baseMs?: number; capMs?: number };
  /** Webhook request bodies larger than this are refused with 413 (default 1 MiB). */
  maxBodyBytes?: number;
  /**
   * Problems no caller sees: a malformed update, a failed `getUpdates`, a
   * failed `answerCallbackQuery` (default: the bot's `error` event while the
   * provider is started, `console.error` otherwise).
   */
  onError?: (error: Error) => void;
  /** Called for each update of a kind the provider does not handle (it is acknowledged and dropped). */
  onSkippedUpdate?: (skipped: SkippedUpdate) => void;
}

/** What the provider seals into `InboundMessage.media` (inside a {@link MediaSeal} envelope). */
export interface TelegramMediaRef {
  /** Telegram's `file_id` (what `getFile` takes). */
  fileId: string;
  /** Telegram's `file_unique_id` (the same file across bots); `""` when the update has none (before Bot API 4.5). */
  fileUniqueId: string;
  /** `photo`, `document`, `voice`, `audio`, `video`, `video_note`, `animation`, `sticker`. */
  kind: string;
  /** The MIME type Telegram gave (`image/jpeg` for a photo). */
  mimeType?: string;
  /** The file name Telegram gave (documents, audio, video). */
  fileName?: string;
  /** The size in bytes Telegram gave. */
  fileSize?: number;
}

/**
 * A malformed Telegram update: `field` names what is wrong. The provider
 * reports it to `onError`; a user's update (a message, channel post, business
 * message or callback query) is then handed to the bot as unreadable, any
 * other is acknowledged and dropped.
 *
 * @example
 * ```ts
 * import { TelegramProvider, TelegramUpdateError } from "@botmesh/durable/telegram";
 * const telegram = new TelegramProvider({ token: "123:abc", secretToken: false });
 * try {
 *   await telegram.parseUpdate({ update_id: 1, message: { message_id: 2, date: 0 } });
 * } catch (error) {
 *   if (error instanceof TelegramUpdateError) console.log(error.field); // "message.chat"
 * }
 * ```
 */
export class TelegramUpdateError extends Error {
  /** The path of the offending field, e.g. `message.chat.id`. */
  readonly field: string;
  /** The update's `update_id`, when it has one. */
  readonly updateId: number | undefined;
  /**
   * Make the error.
   *
   * @param field the path of the offending field
   * @param message what is wrong
   * @param updateId the update's id, when known
   */
  constructor(field: string, message: string, updateId?: number) {
    super(message);
    this.name = "TelegramUpdateError";
    this.field = field;
    this.updateId = updateId;
  }
}

/** The result of parsing one update: a message for the bot, or a kind that is skipped. */
export type ParsedUpdate =
  | { kind: "message"; updateId: number; message: InboundMessage; callbackQueryId?: string }
  | { kind: "skipped"; updateId: number; skipped: SkippedUpdate };

const OPTION_NAMES = [
  "token",
  "mode",
  "secretToken",
  "apiBase",
  "fetch",
  "mediaKey",
  "pollTimeoutSec",
  "requestTimeoutMs",
  "allowedUpdates",
  "name",
  "deleteWebhookOnStart",
  "pollBackoff",
  "maxBodyBytes",
  "onError",
  "onSkippedUpdate",
] as const;

const TOKEN_RE = /^(\d+):([A-Za-z0-9_-]+)$/;
const SECRET_RE = /^[A-Za-z0-9_-]{1,256}$/;
const METHOD_RE = /^[A-Za-z][A-Za-z0-9]*$/;
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
const TYPE_OF: Record<(typeof MEDIA_FIELDS)[number], MessageType> = {
  photo: "image",
  document: "document",
  voice: "audio",
  audio: "audio",
  video: "video",
  animation: "video",
  video_note: "video",
  sticker: "sticker",
};
/**
 * The media fields of an inbound message, the more specific first: the Bot API
 * sets `document` as well on an animation, so `animation` is checked before it.
 */
const INBOUND_MEDIA = ["animation", "photo", "video", "video_note", "voice", "audio", "sticker", "document"] as const;
/**
 * The other message kinds that keep their own type, with their object (or
 * array) in `extra` under the Bot API's field name, the more specific first:
 * the Bot API sets `location` as well on a venue, so `venue` is checked
 * before it. `required` lists fields that must be strings.
 */
const TYPED_KINDS: readonly { field: string; shape: "object" | "array"; required?: readonly string[] }[] = [
  { field: "venue", shape: "object", required: ["title", "address"] },
  { field: "location", shape: "object" },
  { field: "contact", shape: "object" },
  { field: "poll", shape: "object" },
  { field: "dice", shape: "object" },
  { field: "paid_media", shape: "object" },
  { field: "story", shape: "object" },
  { field: "game", shape: "object" },
  { field: "invoice", shape: "object" },
  { field: "giveaway", shape: "object" },
  { field: "giveaway_winners", shape: "object" },
  { field: "checklist", shape: "object" },
  { field: "web_app_data", shape: "object", required: ["data", "button_text"] },
  { field: "users_shared", shape: "object" },
  { field: "chat_shared", shape: "object" },
  { field: "successful_payment", shape: "object" },
  { field: "refunded_payment", shape: "object" },
  { field: "new_chat_members", shape: "array" },
  { field: "left_chat_member", shape: "object" },
];
/** The update kinds whose object is a Message this provider hands to the bot. */
const MESSAGE_UPDATES = ["message", "channel_post", "business_message"] as const;
/**
 * The update kinds that carry what a user sent: one that cannot be parsed is
 * journaled as unreadable, never acknowledged and dropped.
 */
const USER_UPDATES: readonly string[] = [...MESSAGE_UPDATES, "callback_query"];
const encoder = new TextEncoder();

type Obj = Record<string, unknown>;
const isObj = (v: unknown): v is Obj => typeof v === "object" && v !== null && !Array.isArray(v);

function fail(option: string, rule: string, value: unknown, Kind: typeof TypeError | typeof RangeError = TypeError): never {
  throw new Kind(`Option "${option}" must be ${rule}, got ${show(value)}`);
}

function intOption(o: Obj, name: string, dflt: number, min: number, max: number): number {
  const v = o[name] ?? dflt;
  if (typeof v !== "number") fail(name, `an integer from ${min} to ${max}`, v);
  if (!Number.isInteger(v) || v < min || v > max) fail(name, `an integer from ${min} to ${max}`, v, RangeError);
  return v;
}

/** Constant-time comparison of two strings (through SHA-256, so the length does not leak either). */
async function sameSecret(a: string, b: string): Promise<boolean> {
  const [x, y] = await Promise.all([
    crypto.subtle.digest("SHA-256", encoder.encode(a)),
    crypto.subtle.digest("SHA-256", encoder.encode(b)),
  ]);
  const p = new Uint8Array(x);
  const q = new Uint8Array(y);
  let diff = 0;
  for (let i = 0; i < p.length; i++) diff |= p[i]! ^ q[i]!;
  return diff === 0;
}

function asError(error: unknown): Error {
  return error instanceof Error ? error : new Error(String(error));
}

function textResponse(status: number, text: string): Response {
  return new Response(text, { status, headers: { "content-type": "text/plain; charset=utf-8" } });
}

// ---- parsing updates ---------------------------------------------------------------

function needInt(value: unknown, field: string, updateId?: number): number {
  if (typeof value !== "number" || !Number.isSafeInteger(value)) {
    throw new TelegramUpdateError(field, `Telegram update field "${field}" must be an integer, got ${show(value)}`, updateId);
  }
  return value;
}

function needObj(value: unknown, field: string, updateId?: number): Obj {
  if (!isObj(value)) {
    throw new TelegramUpdateError(field, `Telegram update field "${field}" must be an object, got ${show(value)}`, updateId);
  }
  return value;
}

function optString(value: unknown, field: string, updateId: number): string | undefined {
  if (value === undefined || value === null) return undefined;
  if (typeof value !== "string") {
    throw new TelegramUpdateError(field, `Telegram update field "${field}" must be a string, got ${show(value)}`, updateId);
  }
  return value;
}

function fileRef(value: unknown, kind: string, field: string, updateId: number): TelegramMediaRef {
  let file = value;
  if (kind === "photo") {
    if (!Array.isArray(value) || value.length === 0) {
      throw new TelegramUpdateError(field, `Telegram update field "${field}" must be a non-empty array of sizes, got ${show(value)}`, updateId);
    }
    // The largest size: by width × height, the later one on a tie (Telegram lists them smallest first).
    const area = (s: unknown) => (isObj(s) ? Number(s.width) * Number(s.height) || 0 : -1);
    file = value.reduce((best: unknown, size: unknown) => (area(size) >= area(best) ? size : best), value[0]);
  }
  const f = needObj(file, field, updateId);
  const fileId = f.file_id;
  const fileUniqueId = f.file_unique_id;
  if (typeof fileId !== "string" || fileId === "") {
    throw new TelegramUpdateError(`${field}.file_id`, `Telegram update field "${field}.file_id" must be a non-empty string, got ${show(fileId)}`, updateId);
  }
  // Absent from updates older than Bot API 4.5 (as in the Bot API docs' own examples): "" then.
  if (fileUniqueId !== undefined && typeof fileUniqueId !== "string") {
    throw new TelegramUpdateError(
      `${field}.file_unique_id`,
      `Telegram update field "${field}.file_unique_id" must be a string, got ${show(fileUniqueId)}`,
      updateId,
    );
  }
  const ref: TelegramMediaRef = { fileId, fileUniqueId: fileUniqueId ?? "", kind };
  const mime = optString(f.mime_type, `${field}.mime_type`, updateId) ?? (kind === "photo" ? "image/jpeg" : undefined);
  if (mime !== undefined) ref.mimeType = mime;
  const name = optString(f.file_name, `${field}.file_name`, updateId);
  if (name !== undefined) ref.fileName = name;
  if (typeof f.file_size === "number" && Number.isFinite(f.file_size)) ref.fileSize = f.file_size;
  return ref;
}

function sender(from: unknown): { from?: string; username?: string } {
  if (!isObj(from) || (typeof from.id !== "number" && typeof from.id !== "string")) return {};
  return { from: String(from.id), ...(typeof from.username === "string" ? { username: from.username } : {}) };
}

// ---- the provider ------------------------------------------------------------------

interface CallResult {
  ok: true;
  result: unknown;
}

/**
 * The Telegram Bot API as a {@link Provider}.
 *
 * Inbound: `message`, `channel_post` and `business_message` updates become
 * messages, the more specific kind first where the Bot API sets two fields
 * (an animation also has `document`, a venue also has `location`): `text`;
 * `photo` → `image`; `document`; `voice`/`audio` → `audio`;
 * `video`/`video_note`/`animation` → `video`; `sticker`; a caption goes into
 * `text`. `venue`, `location`, `contact`, `poll`, `dice`, `paid_media`,
 * `story`, `game`, `invoice`, `giveaway`, `giveaway_winners`, `checklist`,
 * `web_app_data`, `users_shared`, `chat_shared`, `successful_payment`,
 * `refunded_payment`, `new_chat_members` and `left_chat_member` keep the Bot
 * API field's name as their type and its value in `extra` under that name
 * (a Web App's `data` is not put in `text`: a client can send anything there).
 * Any other message (service messages, kinds newer than this provider) is
 * type `other` with the message object in `extra.raw`. `callback_query`
 * updates become interactions (`interaction.id` is the button's
 * `callback_data`) and are answered with `answerCallbackQuery` once admitted.
 * Other update kinds (`edited_message`, `my_chat_member`, …) are acknowledged
 * and dropped (see `onSkippedUpdate`); edits too, since the message was
 * handled when it came. A malformed update is reported to `onError` with the
 * field named; a user's one is then handed to the bot as unreadable (see the
 * module docs), any other is acknowledged and dropped.
 *
 * Media: the reference (`file_id`, …) is sealed into the inbox record;
 * `loadMedia` calls `getFile` and downloads the file. A file larger than
 * 20 MB (the Bot API's download limit, known from `file_size`) is stored as
 * not durable (`not-durable`); a `file_id` Telegram no longer knows, or a file
 * that is gone, is `rehydrate-failed`.
 *
 * Sends: a string → `sendMessage`; `{ text, ...params }` → `sendMessage`;
 * `{ photo | document | voice | audio | video | animation | video_note | sticker: url, file_id or Uint8Array, caption?, ...params }`
 * → the matching `send…` method (bytes go as a multipart upload, named by
 * `fileName`); `{ method: "sendPoll", ...params }` → that method as given.
 * `chat_id` is the chat. The receipt's `messageId` is Telegram's
 * `message_id` (ids joined with `,` for `sendMediaGroup`, `""` for methods
 * that return no message). Errors: 429 (with `retry_after`), 5xx, network
 * failures and timeouts are retryable; 400, 401, 403 and 404 are permanent,
 * with Telegram's `description` in the message. A 2xx whose body cannot be
 * read, or lacks the `message_id`, is permanent too: Telegram may have sent
 * the message, so it is not sent again on its own (an operator can retry it
 * from the dead-letter queue).
 *
 * @example Long polling
 * ```ts ignore
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { TelegramProvider } from "@botmesh/durable/telegram";
 *
 * const telegram = new TelegramProvider({ token: Deno.env.get("TELEGRAM_TOKEN")!, mode: "polling", deleteWebhookOnStart: true });
 * const bot = new Bot({ provider: telegram, durability: { backend: new MemoryDurability(), instanceId: "tg-1" } });
 * bot.when(/ping/, (ctx) => ctx.reply("pong"));
 * await bot.start();
 * ```
 */
export class TelegramProvider implements Provider {
  /** The provider name (default `'telegram'`). */
  readonly name: string;
  /** The bot's id: the part of the token before `:` (never the secret part). */
  readonly connectionId: string;
  /** `'webhook'` or `'polling'`. */
  readonly mode: "webhook" | "polling";
  /**
   * The webhook handler, for `Bun.serve({ fetch })`, `Deno.serve(handler)` or
   * `nodeHandler(handler)`: `405` unless POST, `401` on a wrong secret, `413`
   * on a body over `maxBodyBytes`, `400` on a body that is not an update,
   * `503` while the bot is not started or when the journal refused the update
   * (Telegram delivers it again), `200` once it is admitted (an unreadable one
   * too), a duplicate, of a kind that is skipped, or malformed and not a
   * user's message. Bound: pass it as it is. In polling mode it
   * answers `404`.
   */
  readonly webhook: (request: Request) => Promise<Response>;
  readonly #token: string;
  readonly #secret: string | false;
  readonly #apiBase: string;
  readonly #fetch: typeof fetch;
  readonly #seal: MediaSeal;
  readonly #pollTimeoutSec: number;
  readonly #requestTimeoutMs: number;
  readonly #allowedUpdates: readonly string[];
  readonly #deleteWebhookOnStart: boolean;
  readonly #backoff: { baseMs: number; capMs: number };
  readonly #maxBodyBytes: number;
  readonly #onError: (error: Error) => void;
  readonly #onSkipped: ((skipped: SkippedUpdate) => void) | undefined;
  #sink: InboundSink | undefined;
  #stopper: AbortController | undefined;
  #loop: Promise<void> | undefined;
  #offset: number | undefined;
  /** The offset the last successful getUpdates confirmed. */
  #confirmed: number | undefined;
  #sideEffects = new Set<Promise<unknown>>();

  /**
   * Make a provider; nothing is called until `start()` (or a send).
   *
   * @param options `token` (required), `mode`, `secretToken` (required in webhook mode), and the rest of {@link TelegramProviderOptions}
   * @throws {TypeError} when an option is missing, unknown or of the wrong type (the message names it)
   * @throws {RangeError} when a number option is out of range or `mediaKey` is too short
   */
  constructor(options: TelegramProviderOptions) {
    if (!isObj(options)) throw new TypeError(`Telegram options must be an object with a "token", got ${show(options)}`);
    const o = options as unknown as Obj;
    checkKnownOptions(o, OPTION_NAMES, "Telegram option");
    const token = o.token;
    if (typeof token !== "string") fail("token", 'a bot token string like "123456:ABC-DEF…"', token === undefined ? token : typeof token);
    const match = TOKEN_RE.exec(token);
    // The token is a secret: never quote it back.
    if (!match) throw new TypeError(`Option "token" must look like "123456:ABC-DEF…" (digits, ":", then letters, digits, "-", "_"), got a string of ${token.length} characters that does not`);
    this.#token = token;
    this.connectionId = match[1]!;
    const mode = o.mode ?? "webhook";
    if (mode !== "webhook" && mode !== "polling") fail("mode", '"webhook" or "polling"', mode);
    this.mode = mode;
    const secret = o.secretToken;
    if (secret === undefined) {
      if (mode === "webhook") {
        throw new TypeError(
          `Option "secretToken" is required in webhook mode: the secret given to setWebhook (1-256 of A-Z, a-z, 0-9, "_", "-"), or false to accept unauthenticated requests`,
        );
      }
      this.#secret = false;
    } else if (secret === false) {
      this.#secret = false;
    } else if (typeof secret !== "string" || !SECRET_RE.test(secret)) {
      throw new TypeError(
        `Option "secretToken" must be 1-256 characters of A-Z, a-z, 0-9, "_", "-" (or false), got ${
          typeof secret === "string" ? `a string of ${secret.length} characters that is not` : show(secret)
        }`,
      );
    } else {
      this.#secret = secret;
    }
    const apiBase = o.apiBase ?? "https://api.telegram.org";
    let url: URL | null = null;
    try {
      url = typeof apiBase === "string" ? new URL(apiBase) : null;
    } catch {
      url = null;
    }
    if (url === null || (url.protocol !== "https:" && url.protocol !== "http:")) fail("apiBase", "an http(s) URL", apiBase);
    this.#apiBase = (apiBase as string).replace(/\/+$/, "");
    const f = o.fetch ?? globalThis.fetch;
    if (typeof f !== "function") fail("fetch", "a function", f);
    this.#fetch = f as typeof fetch;
    const name = o.name ?? "telegram";
    if (typeof name !== "string" || name === "") fail("name", "a non-empty string", name);
    this.name = name;
    const mediaKey = o.mediaKey ?? `botmesh/telegram-media/v1/${token}`;
    if (typeof mediaKey !== "string" && !(mediaKey instanceof Uint8Array)) fail("mediaKey", "a string or a Uint8Array", mediaKey);
    this.#seal = new MediaSeal({ provider: name, key: mediaKey as string | Uint8Array });
    this.#pollTimeoutSec = intOption(o, "pollTimeoutSec", 30, 0, 50);
    this.#requestTimeoutMs = intOption(o, "requestTimeoutMs", 30_000, 100, 600_000);
    this.#maxBodyBytes = intOption(o, "maxBodyBytes", 1024 * 1024, 1024, 64 * 1024 * 1024);
    const allowed = o.allowedUpdates ?? TELEGRAM_HANDLED_UPDATES;
    if (!Array.isArray(allowed) || !allowed.every((k) => typeof k === "string" && /^[a-z_]+$/.test(k))) {
      fail("allowedUpdates", 'an array of update kinds like ["message", "callback_query"]', allowed);
    }
    this.#allowedUpdates = [...allowed];
    const del = o.deleteWebhookOnStart ?? false;
    if (typeof del !== "boolean") fail("deleteWebhookOnStart", "a boolean", del);
    this.#deleteWebhookOnStart = del;
    const backoff = o.pollBackoff ?? {};
    if (!isObj(backoff)) fail("pollBackoff", "an object { baseMs?, capMs? }", backoff);
    const baseMs = intOption(backoff, "baseMs", 500, 1, 3_600_000);
    const capMs = intOption(backoff, "capMs", Math.max(30_000, baseMs), 1, 3_600_000);
    if (capMs < baseMs) fail("pollBackoff.capMs", `at least pollBackoff.baseMs (${baseMs})`, capMs, RangeError);
    this.#backoff = { baseMs, capMs };
    const onError = o.onError ?? ((error: Error) => {
      if (this.#sink?.reportError) this.#sink.reportError(error);
      else console.error("[@botmesh/durable/telegram]", error);
    });
    if (typeof onError !== "function") fail("onError", "a function", onError);
    this.#onError = onError as (error: Error) => void;
    if (o.onSkippedUpdate !== undefined && typeof o.onSkippedUpdate !== "function") {
      fail("onSkippedUpdate", "a function", o.onSkippedUpdate);
    }
    this.#onSkipped = o.onSkippedUpdate as ((skipped: SkippedUpdate) => void) | undefined;
    this.webhook = (request) => this.#handleWebhook(request);
  }

  // ---- lifecycle -------------------------------------------------------------------

  /**
   * Called by `bot.start()`. In polling mode, starts the long-poll loop (after
   * `deleteWebhook` when `deleteWebhookOnStart` is set).
   *
   * @param sink where inbound messages go
   * @throws {ProviderError} when `deleteWebhookOnStart` is set and `deleteWebhook` fails
   */
  async start(sink: InboundSink): Promise<void> {
    if (this.#sink) throw new Error(`Telegram provider ${show(this.name)} is already started`);
    if (this.mode === "polling") {
      if (this.#deleteWebhookOnStart) await this.call("deleteWebhook", { drop_pending_updates: false });
      this.#sink = sink;
      const stopper = new AbortController();
      this.#stopper = stopper;
      this.#loop = this.#pollLoop(sink, stopper.signal);
    } else {
      this.#sink = sink;
    }
  }

  /**
   * Called by `bot.stop()`: aborts the long poll under way and resolves once
   * the loop ended. Updates admitted since the last `getUpdates` are then
   * confirmed with one short `getUpdates` (`timeout: 0`), so that a restart
   * does not fetch them again (they would be dropped as duplicates anyway).
   */
  async stop(): Promise<void> {
    this.#sink = undefined;
    this.#stopper?.abort();
    await this.#loop;
    this.#loop = undefined;
    this.#stopper = undefined;
    const offset = this.#offset;
    if (offset !== undefined && offset !== this.#confirmed) {
      try {
        await this.call("getUpdates", { offset, timeout: 0, limit: 1, allowed_updates: this.#allowedUpdates }, {
          timeoutMs: Math.min(this.#requestTimeoutMs, 5_000),
        });
        this.#confirmed = offset;
      } catch (error) {
        this.#report(new Error(`Telegram getUpdates could not confirm offset ${offset} on stop (those updates come again after a restart and are dropped as duplicates)`, { cause: error }));
      }
    }
    await Promise.allSettled([...this.#sideEffects]);
  }

  // ---- the Bot API -------------------------------------------------------------------

  /**
   * Call a Bot API method with JSON parameters (or multipart when a value is
   * a `Uint8Array`/`Blob`).
   *
   * @param method the method, e.g. `"getMe"`
   * @param params its parameters
   * @param options `signal` aborts the call; `timeoutMs` overrides `requestTimeoutMs`
   * @returns the `result` field of Telegram's answer
   * @throws {ProviderError} `retryable` for 429 (with `retryAfterMs`), 5xx, network errors and timeouts; permanent for other 4xx and for a body that is not Telegram's envelope
   * @example
   * ```ts ignore
   * const me = await telegram.call("getMe");
   * ```
   */
  async call(method: string, params: Record<string, unknown> = {}, options: { signal?: AbortSignal; timeoutMs?: number } = {}): Promise<unknown> {
    if (typeof method !== "string" || !METHOD_RE.test(method)) {
      throw new TypeError(`Argument "method" must be a Bot API method name like "sendMessage", got ${show(method)}`);
    }
    const timeoutMs = options.timeoutMs ?? this.#requestTimeoutMs;
    const timeout = AbortSignal.timeout(timeoutMs);
    const signal = options.signal ? AbortSignal.any([options.signal, timeout]) : timeout;
    const body = encodeParams(params);
    let response: Response;
    let text: string;
    try {
      response = await this.#fetch(`${this.#apiBase}/bot${this.#token}/${method}`, { method: "POST", body, signal, ...(typeof body === "string" ? { headers: { "content-type": "application/json" } } : {}) });
      text = await response.text();
    } catch (error) {
      if (timeout.aborted && !options.signal?.aborted) {
        throw new ProviderError(`Telegram ${method} timed out after ${timeoutMs} ms`, {
          retryable: true,
          maybeDelivered: true, // Telegram may have done it before the answer was cut off
          cause: this.#safe(error),
        });
      }
      if (options.signal?.aborted) {
        throw new ProviderError(`Telegram ${method} was aborted`, { retryable: true, cause: this.#safe(error) });
      }
      throw new ProviderError(`Telegram ${method} failed: ${this.#redact(asError(error).message)}`, { retryable: true, cause: this.#safe(error) });
    }
    let json: unknown;
    try {
      json = JSON.parse(text);
    } catch {
      json = undefined;
    }
    const status = response.status;
    if (!isObj(json) || typeof json.ok !== "boolean") {
      const snippet = this.#redact(text.slice(0, 200));
      if (status >= 200 && status < 300) {
        throw new ProviderError(
          `Telegram ${method} answered HTTP ${status} with a body that is not a Bot API answer (${show(snippet)}); the call may have taken effect, so it is not retried on its own`,
          { retryable: false, status },
        );
      }
      throw new ProviderError(`Telegram ${method} failed with HTTP ${status}: ${show(snippet)}`, {
        retryable: isRetryableStatus(status),
        status,
      });
    }
    if (json.ok === true && status >= 200 && status < 300) return (json as unknown as CallResult).result;
    const code = typeof json.error_code === "number" ? json.error_code : status >= 400 ? status : 500;
    const description = typeof json.description === "string" ? this.#redact(json.description) : "no description";
    const parameters = isObj(json.parameters) ? json.parameters : {};
    const retryAfter = typeof parameters.retry_after === "number" && parameters.retry_after >= 0 ? parameters.retry_after : undefined;
    const migrate = parameters.migrate_to_chat_id;
    throw new ProviderError(
      `Telegram ${method} failed with ${code}: ${description}${migrate !== undefined ? ` (the group moved to chat ${show(migrate)})` : ""}`,
      { status: code, retryable: isRetryableStatus(code), ...(retryAfter !== undefined ? { retryAfterMs: retryAfter * 1000 } : {}) },
    );
  }

  #redact(text: string): string {
    return text.replaceAll(this.#token, "<token>");
  }

  /**
   * A `fetch` error without what could carry the token (the URL holds it: a
   * runtime may keep it in a `path` or `url` property): name and redacted
   * message only.
   */
  #safe(error: unknown): Error {
    const e = asError(error);
    const safe = new Error(this.#redact(e.message));
    safe.name = e.name;
    return safe;
  }

  /**
   * Point Telegram's webhook at `url`, with this provider's `secretToken` and `allowedUpdates`.
   *
   * @param url the public HTTPS URL of {@link TelegramProvider.webhook}
   * @param params more `setWebhook` parameters (`max_connections`, `drop_pending_updates`, …)
   * @returns once Telegram accepted it
   * @throws {ProviderError} when Telegram refuses it
   * @example
   * ```ts ignore
   * await telegram.setWebhook("https://bot.example.com/telegram");
   * ```
   */
  async setWebhook(url: string, params: Record<string, unknown> = {}): Promise<void> {
    if (typeof url !== "string" || url === "") throw new TypeError(`Argument "url" must be a non-empty string, got ${show(url)}`);
    await this.call("setWebhook", {
      url,
      allowed_updates: this.#allowedUpdates,
      ...(this.#secret !== false ? { secret_token: this.#secret } : {}),
      ...params,
    });
  }

  // ---- sends ---------------------------------------------------------------------

  /**
   * Send content to a chat (see the class docs for the content forms).
   *
   * @param chatId the chat (`chat_id`)
   * @param content a string or an object
   * @param context the outbox key, attempt and abort signal
   * @returns Telegram's `message_id`
   * @throws {ProviderError} retryable or permanent (see {@link TelegramProvider.call}); permanent for content of no known form
   */
  async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    const { method, params } = toRequest(chatId, content);
    let result: unknown;
    try {
      result = await this.call(method, params, { signal: context.signal });
    } catch (error) {
      // An edit whose content is already there (a retry after a lost answer, say) has taken effect.
      if (
        method.startsWith("edit") && error instanceof ProviderError && error.status === 400 &&
        /message is not modified/i.test(error.message)
      ) {
        return { messageId: params.message_id === undefined ? "" : String(params.message_id) };
      }
      throw error;
    }
    return { messageId: messageIdOf(method, result) };
  }

  /**
   * Whether a send error may be retried: a `ProviderError` says it itself.
   *
   * @param error what `send` threw
   * @returns the classification
   */
  classifyError(error: unknown): ErrorClassification {
    return classifyProviderError(error);
  }

  // ---- media ---------------------------------------------------------------------

  /**
   * Load the media of an inbound message again: `getFile`, then the download.
   *
   * @param media the journaled reference
   * @param context the message and an abort signal
   * @returns the bytes, the MIME type and the file name when Telegram gave them
   * @throws {MediaUnavailableError} `rehydrate-failed` when the reference is invalid or tampered with, or Telegram no longer has the file; `not-durable` for a file over 20 MB
   * @throws {ProviderError} (retryable) on 5xx, 429, network errors and timeouts
   */
  async loadMedia(media: StoredMediaRef, context: MediaLoadContext): Promise<LoadedMedia> {
    const messageId = context.message.id;
    const ref = await this.#seal.open(media, messageId);
    if (!isObj(ref) || typeof ref.fileId !== "string") {
      throw new MediaUnavailableError("rehydrate-failed", `The media reference of message ${show(messageId)} has no "fileId"`, { messageId });
    }
    let file: unknown;
    try {
      file = await this.call("getFile", { file_id: ref.fileId }, { signal: context.signal });
    } catch (error) {
      if (error instanceof ProviderError && error.status === 400) {
        throw new MediaUnavailableError("rehydrate-failed", `Telegram no longer has the file of message ${show(messageId)}: ${error.message}`, {
          messageId,
          cause: error,
        });
      }
      throw error;
    }
    const path = isObj(file) ? file.file_path : undefined;
    if (typeof path !== "string" || path === "") {
      throw new MediaUnavailableError(
        "rehydrate-failed",
        `Telegram getFile gave no "file_path" for the file of message ${show(messageId)} (it cannot be downloaded)`,
        { messageId },
      );
    }
    const timeout = AbortSignal.timeout(this.#requestTimeoutMs * 4);
    const signal = context.signal ? AbortSignal.any([context.signal, timeout]) : timeout;
    let response: Response;
    try {
      response = await this.#fetch(`${this.#apiBase}/file/bot${this.#token}/${path.split("/").map(encodeURIComponent).join("/")}`, { signal });
    } catch (error) {
      throw new ProviderError(`Telegram file download for message ${show(messageId)} failed: ${this.#redact(asError(error).message)}`, {
        retryable: true,
        cause: this.#safe(error),
      });
    }
    if (response.status === 404 || response.status === 400) {
      await response.body?.cancel();
      throw new MediaUnavailableError("rehydrate-failed", `Telegram has no file for message ${show(messageId)} (HTTP ${response.status})`, {
        messageId,
      });
    }
    if (!response.ok) {
      await response.body?.cancel();
      throw new ProviderError(`Telegram file download for message ${show(messageId)} failed with HTTP ${response.status}`, {
        status: response.status,
        retryable: isRetryableStatus(response.status),
      });
    }
    const data = await readCapped(response.body, TELEGRAM_MAX_DOWNLOAD_BYTES);
    if (data === null) {
      throw new MediaUnavailableError("not-durable", `The file of message ${show(messageId)} is larger than 20 MB`, { messageId });
    }
    const mimeType = typeof ref.mimeType === "string" ? ref.mimeType : response.headers.get("content-type") ?? undefined;
    return {
      data,
      ...(mimeType ? { mimeType } : {}),
      ...(typeof ref.fileName === "string" ? { fileName: ref.fileName } : {}),
    };
  }

  // ---- inbound -------------------------------------------------------------------

  /**
   * Turn one Telegram update into an inbound message (or say it is skipped).
   * The webhook and the poller hand a user's update that this throws for to
   * the bot as unreadable instead.
   *
   * @param update the update as Telegram sent it
   * @returns the message, or the skipped kind
   * @throws {TelegramUpdateError} naming the field when the update is malformed
   */
  async parseUpdate(update: unknown): Promise<ParsedUpdate> {
    const u = needObj(update, "update");
    const updateId = needInt(u.update_id, "update_id");
    if (u.callback_query !== undefined) {
      const q = needObj(u.callback_query, "callback_query", updateId);
      const queryId = q.id;
      if (typeof queryId !== "string" || queryId === "") {
        throw new TelegramUpdateError("callback_query.id", `Telegram update field "callback_query.id" must be a non-empty string, got ${show(queryId)}`, updateId);
      }
      const data = optString(q.data, "callback_query.data", updateId);
      const game = optString(q.game_short_name, "callback_query.game_short_name", updateId);
      const who = sender(q.from);
      let chatId: string;
      let messageId: number | undefined;
      if (q.message !== undefined) {
        const m = needObj(q.message, "callback_query.message", updateId);
        const chat = needObj(m.chat, "callback_query.message.chat", updateId);
        chatId = String(needInt(chat.id, "callback_query.message.chat.id", updateId));
        if (typeof m.message_id === "number") messageId = m.message_id;
      } else if (who.from !== undefined) {
        chatId = who.from; // an inline message's button: the user's private chat
      } else {
        throw new TelegramUpdateError("callback_query.from.id", `Telegram update field "callback_query.from.id" is missing (and there is no "message")`, updateId);
      }
      const value: Record<string, JsonValue> = { callbackQueryId: queryId };
      if (data !== undefined) value.data = data;
      if (game !== undefined) value.gameShortName = game;
      if (messageId !== undefined) value.messageId = messageId;
      if (typeof q.inline_message_id === "string") value.inlineMessageId = q.inline_message_id;
      if (typeof q.chat_instance === "string") value.chatInstance = q.chat_instance;
      const message: InboundMessage = {
        id: `tg:${this.connectionId}:${updateId}:cb:${queryId}`,
        chatId,
        type: "interaction",
        interaction: { id: data ?? game ?? "", value },
        ...(who.from !== undefined ? { from: who.from } : {}),
        extra: { updateId, ...(who.username !== undefined ? { username: who.username } : {}) },
      };
      return { kind: "message", updateId, message, callbackQueryId: queryId };
    }
    const key = MESSAGE_UPDATES.find((k) => u[k] !== undefined);
    if (key === undefined) {
      const kind = Object.keys(u).find((k) => k !== "update_id") ?? "unknown";
      return { kind: "skipped", updateId, skipped: { updateId, kind, update: u } };
    }
    const m = needObj(u[key], key, updateId);
    const chat = needObj(m.chat, `${key}.chat`, updateId);
    const chatId = String(needInt(chat.id, `${key}.chat.id`, updateId));
    const messageId = needInt(m.message_id, `${key}.message_id`, updateId);
    const id = `tg:${this.connectionId}:${updateId}:${chatId}:${messageId}`;
    const text = optString(m.text, `${key}.text`, updateId);
    const caption = optString(m.caption, `${key}.caption`, updateId);
    let type: MessageType;
    let media: JsonValue | undefined;
    const extra: Record<string, JsonValue> = { updateId, messageId };
    if (typeof chat.type === "string") extra.chatType = chat.type;
    // The more specific kinds first: an animation also has "document", a venue also has "location".
    // A field that is null (as some serializers write an absent one) counts as absent.
    const mediaField = INBOUND_MEDIA.find((f) => m[f] != null);
    const typed = mediaField === undefined ? TYPED_KINDS.find((k) => m[k.field] != null) : undefined;
    if (mediaField !== undefined) {
      const ref = fileRef(m[mediaField], mediaField, `${key}.${mediaField}`, updateId);
      type = TYPE_OF[mediaField];
      media = ref.fileSize !== undefined && ref.fileSize > TELEGRAM_MAX_DOWNLOAD_BYTES
        ? this.#seal.notDurable(`the file is ${ref.fileSize} bytes, over the Bot API's 20 MB download limit`)
        : await this.#seal.seal(ref as unknown as JsonValue);
    } else if (typed !== undefined) {
      const field = `${key}.${typed.field}`;
      const value = m[typed.field];
      if (typed.shape === "array" ? !Array.isArray(value) || !value.every(isObj) : !isObj(value)) {
        const rule = typed.shape === "array" ? "an array of objects" : "an object";
        throw new TelegramUpdateError(field, `Telegram update field "${field}" must be ${rule}, got ${show(value)}`, updateId);
      }
      for (const name of typed.required ?? []) {
        if (typeof (value as Obj)[name] !== "string") {
          throw new TelegramUpdateError(
            `${field}.${name}`,
            `Telegram update field "${field}.${name}" must be a string, got ${show((value as Obj)[name])}`,
            updateId,
          );
        }
      }
      type = typed.field;
      extra[typed.field] = value as JsonValue;
    } else if (text !== undefined) {
      type = "text";
    } else {
      // A service message (a new title, a pinned message, …) or a kind newer than this provider
      // (a caption without a known media field): its content stays readable in the raw object.
      type = "other";
      extra.raw = m as JsonValue;
    }
    if (typeof m.media_group_id === "string") extra.mediaGroupId = m.media_group_id;
    if (key === "business_message" && typeof m.business_connection_id === "string") {
      extra.businessConnectionId = m.business_connection_id;
    }
    const who = sender(m.from);
    if (who.username !== undefined) extra.username = who.username;
    const body = text ?? caption;
    const message: InboundMessage = {
      id,
      chatId,
      type,
      ...(body !== undefined ? { text: body } : {}),
      ...(media !== undefined ? { media } : {}),
      ...(who.from !== undefined ? { from: who.from } : {}),
      ...(typeof m.date === "number" && m.date > 0 ? { timestamp: m.date * 1000 } : {}),
      extra,
    };
    return { kind: "message", updateId, message };
  }

  /**
   * The record for a user's update that {@link TelegramProvider.parseUpdate}
   * could not parse: journaled with `unreadable` (the reason) and the update
   * in `extra.raw`, so that the bot dead-letters it instead of it being
   * acknowledged and lost. Its id is stable across redeliveries: the usual
   * `tg:<bot id>:<update_id>:<chat id>:<message_id>` (or `…:cb:<query id>`),
   * with `-` for an id that is missing, and a SHA-256 of the update in place of
   * an `update_id` that is not an integer. Its chat is the chat id present in
   * the update, else `tg:<bot id>:unreadable`.
   *
   * @param update the update as Telegram sent it
   * @param error why it could not be parsed
   * @returns the message, or `undefined` when the update is certainly not a user's (not an object, or of no message-carrying kind)
   */
  async #unreadable(update: unknown, error: Error): Promise<InboundMessage | undefined> {
    if (!isObj(update)) return undefined;
    const kind = USER_UPDATES.find((k) => update[k] !== undefined);
    if (kind === undefined) return undefined;
    const intOf = (v: unknown) => (typeof v === "number" && Number.isSafeInteger(v) ? v : undefined);
    const updateId = intOf(update.update_id);
    const idPart = updateId !== undefined ? String(updateId) : `h${(await sha256Hex(JSON.stringify(update))).slice(0, 32)}`;
    const body = update[kind];
    const m = kind === "callback_query" ? (isObj(body) ? body.message : undefined) : body;
    let chat = isObj(m) && isObj(m.chat) ? intOf(m.chat.id) : undefined;
    const who = sender(isObj(body) ? body.from : undefined);
    let id: string;
    if (kind === "callback_query") {
      const queryId = isObj(body) && typeof body.id === "string" && body.id !== "" ? body.id : "-";
      id = `tg:${this.connectionId}:${idPart}:cb:${queryId}`;
      // An inline message's button: the user's private chat, as for a readable one.
      if (chat === undefined && who.from !== undefined && /^-?\d+$/.test(who.from)) chat = Number(who.from);
    } else {
      const messageId = isObj(m) ? intOf(m.message_id) : undefined;
      id = `tg:${this.connectionId}:${idPart}:${chat ?? "-"}:${messageId ?? "-"}`;
    }
    const date = isObj(m) ? intOf(m.date) : undefined;
    return {
      id,
      chatId: chat !== undefined ? String(chat) : `tg:${this.connectionId}:unreadable`,
      type: "unreadable",
      unreadable: error.message,
      ...(who.from !== undefined ? { from: who.from } : {}),
      ...(date !== undefined && date > 0 ? { timestamp: date * 1000 } : {}),
      extra: { updateKind: kind, ...(updateId !== undefined ? { updateId } : {}), raw: update as JsonValue },
    };
  }

  /**
   * Hand one update to the bot. A user's update that cannot be parsed is
   * handed on as unreadable (see {@link TelegramProvider.parseUpdate}'s
   * callers): acknowledged only once admitted, like any message.
   * @returns `'ack'` when Telegram may forget it, `'retry'` when it must come again, `'malformed'` when it cannot be parsed and is certainly not a user's message (acknowledged, not journaled); `unreadable` is the reason when it was handed on as unreadable
   */
  async #deliver(
    sink: InboundSink,
    update: unknown,
  ): Promise<{ outcome: "ack" | "retry" | "malformed"; error?: Error; unreadable?: string }> {
    let parsed: ParsedUpdate;
    try {
      parsed = await this.parseUpdate(update);
    } catch (error) {
      const err = asError(error);
      this.#report(err);
      const message = await this.#unreadable(update, err);
      if (message === undefined) return { outcome: "malformed", error: err };
      let result: Awaited<ReturnType<InboundSink["receive"]>>;
      try {
        result = await sink.receive(message);
      } catch (thrown) {
        const e = asError(thrown);
        this.#report(e);
        return { outcome: "retry", error: e };
      }
      if (result.status === "rejected") return { outcome: "retry", error: result.error };
      return { outcome: "ack", unreadable: err.message };
    }
    if (parsed.kind === "skipped") {
      try {
        this.#onSkipped?.(parsed.skipped);
      } catch (error) {
        this.#report(asError(error));
      }
      return { outcome: "ack" };
    }
    let result: Awaited<ReturnType<InboundSink["receive"]>>;
    try {
      result = await sink.receive(parsed.message);
    } catch (error) {
      // A sink that throws instead of answering "rejected": not admitted, so it must come again.
      const err = asError(error);
      this.#report(err);
      return { outcome: "retry", error: err };
    }
    if (result.status === "rejected") return { outcome: "retry", error: result.error };
    if (parsed.callbackQueryId !== undefined && result.status !== "duplicate") this.#answerCallback(parsed.callbackQueryId);
    return { outcome: "ack" };
  }

  #answerCallback(queryId: string): void {
    const work = this.call("answerCallbackQuery", { callback_query_id: queryId }).catch((error) => {
      this.#report(new Error(`Telegram answerCallbackQuery for ${show(queryId)} failed (the button shows a spinner until it times out)`, { cause: error }));
    });
    this.#sideEffects.add(work);
    work.finally(() => this.#sideEffects.delete(work));
  }

  #report(error: Error): void {
    try {
      this.#onError(error);
    } catch {
      // a throwing listener must not break delivery
    }
  }

  async #handleWebhook(request: Request): Promise<Response> {
    if (this.mode !== "webhook") return textResponse(404, "This Telegram provider polls for updates; its webhook is off");
    if (request.method !== "POST") {
      const response = textResponse(405, "Method not allowed: Telegram webhooks are POST requests");
      response.headers.set("allow", "POST");
      return response;
    }
    if (this.#secret !== false) {
      const given = request.headers.get("x-telegram-bot-api-secret-token") ?? "";
      if (!(await sameSecret(given, this.#secret))) {
        await request.body?.cancel().catch(() => {});
        return textResponse(401, "Unauthorized: wrong or missing X-Telegram-Bot-Api-Secret-Token");
      }
    }
    const sink = this.#sink;
    if (!sink) {
      await request.body?.cancel().catch(() => {});
      return textResponse(503, "The bot is not running; Telegram will deliver this update again");
    }
    const length = Number(request.headers.get("content-length") ?? "0");
    if (length > this.#maxBodyBytes) {
      await request.body?.cancel().catch(() => {});
      return textResponse(413, `Request body too large (over ${this.#maxBodyBytes} bytes)`);
    }
    let bytes: Uint8Array | null;
    try {
      bytes = await readCapped(request.body, this.#maxBodyBytes);
    } catch {
      return textResponse(400, "Bad request: the body could not be read");
    }
    if (bytes === null) return textResponse(413, `Request body too large (over ${this.#maxBodyBytes} bytes)`);
    let update: unknown;
    try {
      update = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes));
    } catch (error) {
      return textResponse(400, `Bad request: the body is not a JSON Telegram update (${asError(error).message})`);
    }
    if (typeof update !== "object" || update === null || Array.isArray(update)) {
      return textResponse(400, `Bad request: the body is not a JSON Telegram update, got ${show(update)}`);
    }
    const { outcome, error, unreadable } = await this.#deliver(sink, update);
    // An update that can never be parsed and is not a user's message (no message, channel post,
    // business message or callback query in it) is reported (onError / the bot's error event) and
    // answered 200: a non-2xx would make Telegram send it again and again, holding back the updates
    // after it. A user's one was journaled as unreadable (dead-lettered with the reason) first.
    if (outcome === "malformed") return textResponse(200, `ok (update skipped: ${error!.message})`);
    if (outcome === "retry") return textResponse(503, "The update could not be journaled; Telegram will deliver it again");
    if (unreadable !== undefined) return textResponse(200, `ok (journaled as unreadable: ${unreadable})`);
    return textResponse(200, "ok");
  }

  async #pollLoop(sink: InboundSink, signal: AbortSignal): Promise<void> {
    let failures = 0;
    while (!signal.aborted) {
      let updates: unknown;
      const offset = this.#offset;
      try {
        updates = await this.call("getUpdates", {
          ...(offset !== undefined ? { offset } : {}),
          timeout: this.#pollTimeoutSec,
          allowed_updates: this.#allowedUpdates,
        }, { signal, timeoutMs: this.#requestTimeoutMs + this.#pollTimeoutSec * 1000 });
        if (!Array.isArray(updates)) {
          throw new ProviderError(`Telegram getUpdates answered a "result" that is not an array: ${show(updates)}`, { retryable: true });
        }
      } catch (error) {
        if (signal.aborted) break;
        failures++;
        const err = asError(error);
        const status = err instanceof ProviderError ? err.status : undefined;
        const hint = status === 409
          ? " (another getUpdates is running with this token, or a webhook is set: call deleteWebhook or set deleteWebhookOnStart)"
          : status === 401 || status === 404
          ? " (the token is wrong or revoked)"
          : "";
        this.#report(new Error(`Telegram long polling failed${hint}: ${err.message}`, { cause: err }));
        const retryAfter = err instanceof ProviderError ? err.retryAfterMs : undefined;
        await delay(this.#pollDelay(failures, retryAfter, status === 401 || status === 404), signal).catch(() => {}); // an abort ends the wait
        continue;
      }
      this.#confirmed = offset;
      failures = Math.max(0, failures - 1);
      const next = await this.#admitBatch(sink, updates);
      if (next.offset !== undefined) this.#offset = next.offset;
      if (next.rejected) {
        failures++;
        await delay(this.#pollDelay(failures, undefined, false), signal).catch(() => {});
      } else {
        failures = 0;
      }
    }
  }

  #pollDelay(failures: number, retryAfterMs: number | undefined, atCap: boolean): number {
    const { baseMs, capMs } = this.#backoff;
    const exp = atCap ? capMs : Math.min(capMs, baseMs * 2 ** Math.min(failures - 1, 30));
    const ms = Math.max(exp / 2 + Math.random() * exp / 2, retryAfterMs ?? 0);
    return Math.ceil(ms);
  }

  /** Admit one batch: per chat in order, chats in parallel; the offset to confirm next. */
  async #admitBatch(sink: InboundSink, updates: unknown[]): Promise<{ offset: number | undefined; rejected: boolean }> {
    const chats = new Map<string, unknown[]>();
    let maxId: number | undefined;
    let minId: number | undefined;
    for (const update of updates) {
      const raw = isObj(update) && typeof update.update_id === "number" && Number.isSafeInteger(update.update_id) ? update.update_id : undefined;
      if (raw !== undefined) maxId = maxId === undefined ? raw : Math.max(maxId, raw);
      if (raw !== undefined) minId = minId === undefined ? raw : Math.min(minId, raw);
      const chat = chatKeyOf(update);
      const list = chats.get(chat);
      if (list) list.push(update);
      else chats.set(chat, [update]);
    }
    let lowestRejected: number | undefined;
    let unconfirmable = false;
    await Promise.all([...chats.values()].map(async (list) => {
      for (const update of list) {
        const { outcome } = await this.#deliver(sink, update);
        if (outcome === "retry") {
          const raw = isObj(update) ? update.update_id : undefined;
          // Without an update_id of its own, nothing of this batch is confirmed: it all comes again.
          const id = typeof raw === "number" && Number.isSafeInteger(raw) ? raw : minId;
          if (id === undefined) unconfirmable = true;
          else lowestRejected = lowestRejected === undefined ? id : Math.min(lowestRejected, id);
          return; // later updates of this chat must not overtake it
        }
      }
    }));
    if (unconfirmable) return { offset: undefined, rejected: true };
    if (lowestRejected !== undefined) return { offset: lowestRejected, rejected: true };
    return { offset: maxId === undefined ? undefined : maxId + 1, rejected: false };
  }
}

/** The chat an update belongs to, for ordering (malformed ones each on their own). */
function chatKeyOf(update: unknown): string {
  if (!isObj(update)) return "?";
  for (const key of MESSAGE_UPDATES) {
    const m = update[key];
    if (isObj(m) && isObj(m.chat) && m.chat.id !== undefined) return `c:${String(m.chat.id)}`;
  }
  const q = update.callback_query;
  if (isObj(q)) {
    if (isObj(q.message) && isObj(q.message.chat) && q.message.chat.id !== undefined) return `c:${String(q.message.chat.id)}`;
    if (isObj(q.from) && q.from.id !== undefined) return `c:${String(q.from.id)}`;
  }
  return `u:${String(update.update_id)}`;
}

/** Read a body up to `cap` bytes; `null` when it is larger. */

/** JSON, or multipart when a parameter is binary. */
function encodeParams(params: Record<string, unknown>): string | FormData {
  const binary = Object.values(params).some((v) => v instanceof Uint8Array || v instanceof Blob);
  if (!binary) return JSON.stringify(params);
  const form = new FormData();
  const fileName = typeof params.fileName === "string" ? params.fileName : undefined;
  for (const [key, value] of Object.entries(params)) {
    if (value === undefined || key === "fileName") continue;
    if (value instanceof Uint8Array) form.append(key, new Blob([value as Uint8Array<ArrayBuffer>]), fileName ?? key);
    else if (value instanceof Blob) form.append(key, value, fileName ?? key);
    else form.append(key, typeof value === "string" ? value : JSON.stringify(value));
  }
  return form;
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
