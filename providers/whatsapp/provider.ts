/**
 * WhatsAppProvider (see `mod.ts` for the user documentation): the options,
 * the Graph API, the webhook, the sends and the media loader of one business
 * phone number, tied together.
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
import { escapeControls } from "../../src/controls.ts";
import type { RateLimits } from "../../src/rate_limit.ts";
import { GraphApi } from "./api.ts";
import { PayloadReader } from "./changes.ts";
import { loadWhatsAppMedia } from "./media.ts";
import { type WhatsAppProviderOptions, whatsAppSettings } from "./options.ts";
import { markRead, sendMessage, type Sender } from "./sends.ts";
import type { WhatsAppStatus } from "./statuses.ts";
import { handleWebhook, type WebhookHandling } from "./webhook.ts";

/**
 * WhatsApp Cloud API defaults: 80 messages/s per phone number (the default throughput; Meta raises it
 * on request), and per recipient 1 message per 6 s with bursts of up to 20 (the pair rate limit).
 */
export const WHATSAPP_RATE_LIMITS: RateLimits = {
  global: { count: 80, perMs: 1000 },
  perChat: { count: 1, perMs: 6000, burst: 20 },
};

/**
 * The WhatsApp Cloud API provider: a webhook handler for inbound messages,
 * sends through the Graph API, and media loaded again on reprocess.
 *
 * Webhook answers: GET verification 200 (the challenge) or 403; POST 401 when
 * the `X-Hub-Signature-256` is missing or wrong, 413 over `maxBodyBytes`, 408 when the
 * body did not arrive within `bodyTimeoutMs`, 400
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
  /**
   * The outbox's default limits for one phone number: 80 messages per second
   * (the Cloud API's default throughput), and per recipient one message per
   * 6 s with bursts of up to 20 (Meta's pair rate limit). Override them with
   * `durability.outbox.rateLimit` (a number upgraded to higher throughput).
   */
  readonly rateLimits: RateLimits = WHATSAPP_RATE_LIMITS;
  /** The phone number id. */
  readonly connectionId: string;
  /** The phone number id this provider sends from and receives for. */
  readonly phoneNumberId: string;
  /** The Graph API base URL, without a trailing slash. */
  readonly graphBase: string;
  /** The Graph API version. */
  readonly graphVersion: string;
  readonly #api: GraphApi;
  readonly #sender: Sender;
  readonly #handling: WebhookHandling;
  readonly #maxMediaBytes: number;
  readonly #onStatus: ((status: WhatsAppStatus) => void | Promise<void>) | undefined;
  readonly #onError: (error: Error) => void;
  readonly #seal: MediaSeal;
  #sink: InboundSink | undefined;

  /**
   * The webhook: mount it at the callback URL configured in the Meta app
   * (`Bun.serve({ fetch: provider.webhook })`, `Deno.serve(provider.webhook)`).
   * It never throws; see the class documentation for its answers.
   *
   * @param request Meta's request
   * @returns the answer for Meta
   */
  readonly webhook: (request: Request) => Promise<Response> = (request) => handleWebhook(request, this.#handling);

  /**
   * Make a provider; nothing is contacted until the bot starts and sends.
   *
   * @param options access token, phone number id, app secret, verify token, and the optional settings
   * @throws {TypeError} naming the option when one is missing, of the wrong type, or unknown
   * @throws {RangeError} naming the option when one is out of range
   */
  constructor(options: WhatsAppProviderOptions) {
    const settings = whatsAppSettings(options, (error) => {
      if (this.#sink?.reportError) this.#sink.reportError(error);
      else console.warn(escapeControls(`[@botmesh/durable/whatsapp] ${error.message}`, true));
    });
    this.phoneNumberId = settings.phoneNumberId;
    this.connectionId = settings.phoneNumberId;
    this.graphBase = settings.graphBase;
    this.graphVersion = settings.graphVersion;
    this.name = settings.name;
    this.#maxMediaBytes = settings.maxMediaBytes;
    this.#onStatus = settings.onStatus;
    this.#onError = settings.onError;
    this.#seal = settings.seal;
    this.#api = new GraphApi(settings);
    this.#sender = {
      api: this.#api,
      messagesUrl: `${this.graphBase}/${this.graphVersion}/${encodeURIComponent(this.phoneNumberId)}/messages`,
      phoneNumberId: this.phoneNumberId,
      callbackData: settings.callbackData,
    };
    const report = (error: Error) => this.#report(error);
    this.#handling = {
      verifyToken: settings.verifyToken,
      appSecret: settings.appSecretKey,
      maxBodyBytes: settings.maxBodyBytes,
      bodyTimeoutMs: settings.bodyTimeoutMs,
      phoneNumberId: this.phoneNumberId,
      seal: this.#seal,
      reader: new PayloadReader(this.phoneNumberId, report),
      sink: () => this.#sink,
      onStatus: this.#onStatus === undefined ? undefined : (status) => this.#onStatus!(status),
      report,
    };
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
    return await sendMessage(chatId, content, context, this.#sender);
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
    await markRead(messageId, options, this.#sender);
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
    return await loadWhatsAppMedia(media, context, {
      seal: this.#seal,
      api: this.#api,
      graphBase: this.graphBase,
      graphVersion: this.graphVersion,
      phoneNumberId: this.phoneNumberId,
      maxMediaBytes: this.#maxMediaBytes,
    });
  }
}
