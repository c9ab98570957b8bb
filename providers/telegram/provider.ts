/**
 * TelegramProvider (see `mod.ts` for the user documentation): the options,
 * the Bot API, the webhook, the poller and the media loader of one bot, tied
 * together.
 *
 * @module
 */
import type { LoadedMedia, MediaLoadContext, MediaSeal, StoredMediaRef } from "../../src/media.ts";
import {
  classifyProviderError,
  type ErrorClassification,
  type InboundSink,
  type OutboundContent,
  type Provider,
  type SendContext,
  type SendReceipt,
} from "../../src/provider.ts";
import type { RateLimits } from "../../src/rate_limit.ts";
import { errorLogText } from "../../src/errors.ts";
import { showValue as show } from "../../src/show.ts";
import { BotApi } from "./api.ts";
import { type Delivery, deliverUpdate } from "./delivery.ts";
import { loadTelegramMedia } from "./media.ts";
import { type TelegramProviderOptions, telegramSettings } from "./options.ts";
import { Poller } from "./polling.ts";
import { isJournaledContent, sendContent } from "./sends.ts";
import { type ParsedUpdate, parseTelegramUpdate, type SkippedUpdate } from "./updates.ts";
import { handleWebhook } from "./webhook.ts";

/** Telegram's documented limits: 30 sends/s overall, 1/s per chat, 20/min per group (negative chat id). */
export const TELEGRAM_RATE_LIMITS: RateLimits = {
  global: { count: 30, perMs: 1000 },
  perChat: (chatId) => chatId.startsWith("-") ? { count: 20, perMs: 60_000 } : { count: 1, perMs: 1000 },
};

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
  /**
   * Telegram's limits (the outbox's defaults): about 30 messages per second
   * in all, one per second in a chat, 20 per minute in a group, supergroup or
   * channel (negative chat ids). Override them with `durability.outbox.rateLimit`.
   */
  readonly rateLimits: RateLimits = TELEGRAM_RATE_LIMITS;
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
  readonly #api: BotApi;
  readonly #secret: string | false;
  readonly #seal: MediaSeal;
  readonly #allowedUpdates: readonly string[];
  readonly #deleteWebhookOnStart: boolean;
  readonly #onError: (error: Error) => void;
  readonly #onSkipped: ((skipped: SkippedUpdate) => void) | undefined;
  readonly #poller: Poller;
  #sink: InboundSink | undefined;
  #sideEffects = new Set<Promise<unknown>>();

  /**
   * Make a provider; nothing is called until `start()` (or a send).
   *
   * @param options `token` (required), `mode`, `secretToken` (required in webhook mode), and the rest of {@link TelegramProviderOptions}
   * @throws {TypeError} when an option is missing, unknown or of the wrong type (the message names it)
   * @throws {RangeError} when a number option is out of range or `mediaKey` is too short
   */
  constructor(options: TelegramProviderOptions) {
    const settings = telegramSettings(options, (error) => {
      if (this.#sink?.reportError) this.#sink.reportError(error);
      else console.error(errorLogText("[@botmesh/durable/telegram]", error));
    });
    this.connectionId = settings.botId;
    this.mode = settings.mode;
    this.name = settings.name;
    this.#secret = settings.secret;
    this.#seal = settings.seal;
    this.#allowedUpdates = settings.allowedUpdates;
    this.#deleteWebhookOnStart = settings.deleteWebhookOnStart;
    this.#onError = settings.onError;
    this.#onSkipped = settings.onSkipped;
    this.#api = new BotApi(settings);
    const deliver = (sink: InboundSink, update: unknown) => this.#deliver(sink, update);
    this.#poller = new Poller({
      call: (method, params, callOptions) => this.call(method, params, callOptions),
      deliver,
      report: (error) => this.#report(error),
      pollTimeoutSec: settings.pollTimeoutSec,
      requestTimeoutMs: settings.requestTimeoutMs,
      allowedUpdates: settings.allowedUpdates,
      backoff: settings.backoff,
    });
    const handling = {
      mode: settings.mode,
      secret: settings.secret,
      maxBodyBytes: settings.maxBodyBytes,
      bodyTimeoutMs: settings.bodyTimeoutMs,
      sink: () => this.#sink,
      deliver,
    };
    this.webhook = (request) => handleWebhook(request, handling);
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
      this.#poller.start(sink);
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
    await this.#poller.stop();
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
    return await this.#api.call(method, params, options);
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
   * Whether a send goes through the outbox: everything but edits (`editMessageText`, …: idempotent),
   * `sendChatAction` and `sendMessageDraft` (transient), which go straight to the Bot API, once.
   *
   * @param content what is sent
   * @returns whether it is journaled
   */
  isJournaled(content: OutboundContent): boolean {
    return isJournaledContent(content);
  }

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
    return await sendContent((method, params, options) => this.call(method, params, options), chatId, content, context);
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
    return await loadTelegramMedia(media, context, {
      seal: this.#seal,
      call: (method, params, options) => this.call(method, params, options),
      api: this.#api,
    });
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
    return await parseTelegramUpdate(update, this.connectionId, this.#seal);
  }

  #deliver(sink: InboundSink, update: unknown): Promise<Delivery> {
    return deliverUpdate(sink, update, {
      botId: this.connectionId,
      parse: (u) => this.parseUpdate(u),
      report: (error) => this.#report(error),
      skipped: (skipped) => this.#onSkipped?.(skipped),
      answerCallback: (queryId) => this.#answerCallback(queryId),
    });
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
}
