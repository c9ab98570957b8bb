/**
 * A provider for tests: inbound messages are fed with `receive()`, sends are
 * recorded in `sent`.
 *
 * @module
 */
import type { JsonValue } from "../contract.ts";
import { checkClock, type Clock, sleep, systemClock } from "../clock.ts";
import { ProviderError } from "../errors.ts";
import { type LoadedMedia, type MediaLoadContext, MediaSeal, type StoredMediaRef } from "../media.ts";
import type {
  AdmitResult,
  InboundSink,
  Interaction,
  MessageType,
  OutboundContent,
  Provider,
  SendContext,
  SendReceipt,
} from "../provider.ts";

/** One send the mock provider performed. */
export interface SentMessage {
  chatId: string;
  content: OutboundContent;
  messageId: string;
  idempotencyKey: string;
}

/** An inbound message for {@link MockProvider.receive}; `id` defaults to a fresh one. */
export interface MockInbound {
  id?: string;
  chatId: string;
  text?: string;
  /**
   * The media: its `type` (`'image'`, `'audio'`, …) becomes the message type
   * (default `'image'`). The mock seals it like a real provider; `loadMediaOf`
   * returns `data` (text as UTF-8) and `mimeType`. `viewOnce: true` stores it
   * as not durable.
   */
  media?: { type?: string; data?: string; mimeType?: string; viewOnce?: boolean; [key: string]: JsonValue | undefined };
  interaction?: Interaction;
  /** Overrides the derived message type. */
  type?: MessageType;
  /** Anything else the channel gave (journaled with the message). */
  extra?: JsonValue;
  /** The message could not be parsed (the reason): journaled and dead-lettered unhandled. */
  unreadable?: string;
}

/** Options of {@link MockProvider}. */
export interface MockProviderOptions {
  /** The provider name (default `'mock'`). */
  name?: string;
  /** Each send takes this long (to test heartbeats and slow uploads). */
  sendDelayMs?: number;
  /** The clock `sendDelayMs` is measured on (default: the real clock); a `TestClock` in simulated time. */
  clock?: Clock;
  /** The key that seals media references (default: a fixed test key, the same for every mock of one name). */
  mediaKey?: string | Uint8Array;
}

/**
 * A provider for tests.
 *
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 * const mock = new MockProvider();
 * const bot = new Bot({ provider: mock, durability: { backend: new MemoryDurability(), instanceId: "t" } });
 * bot.when("ping", (ctx) => ctx.reply("pong"));
 * await bot.start();
 * await mock.receive({ chatId: "c1", text: "ping" });
 * await bot.idle();
 * console.log(mock.sent.map((s) => s.content)); // ["pong"]
 * await bot.stop();
 * ```
 */
export class MockProvider implements Provider {
  readonly name: string;
  /** What went out, in order. */
  readonly sent: SentMessage[] = [];
  /** Every provider call, including failed ones (key and outcome). */
  readonly calls: { idempotencyKey: string; chatId: string; ok: boolean }[] = [];
  sendDelayMs: number;
  readonly #clock: Clock;
  #sink: InboundSink | undefined;
  #failures: { remaining: number; error: unknown }[] = [];
  #nextId = 0;
  #nextMessageId = 0;
  #seal: MediaSeal;

  constructor(options: MockProviderOptions = {}) {
    this.name = options.name ?? "mock";
    this.sendDelayMs = options.sendDelayMs ?? 0;
    this.#clock = options.clock === undefined ? systemClock : checkClock(options.clock, "clock");
    this.#seal = new MediaSeal({ provider: this.name, key: options.mediaKey ?? `botmesh-mock-media-key/${this.name}` });
  }

  /** Called by `bot.start()`. */
  start(sink: InboundSink): void {
    this.#sink = sink;
  }

  /** Called by `bot.stop()`. */
  stop(): void {
    this.#sink = undefined;
  }

  /**
   * Deliver one inbound message or interaction to the bot.
   *
   * @param input the message
   * @returns once it is admitted (journaled) or refused
   * @throws {Error} when the bot was not started
   */
  async receive(input: MockInbound): Promise<AdmitResult> {
    if (!this.#sink) throw new Error("MockProvider is not started: call bot.start() first");
    const type: MessageType = input.type ??
      (input.interaction ? "interaction" : input.media ? (input.media.type ?? "image") : "text");
    const message = {
      id: input.id ?? `mock-in-${++this.#nextId}`,
      chatId: input.chatId,
      type,
      ...(input.text !== undefined ? { text: input.text } : {}),
      ...(input.media !== undefined ? { media: await this.#sealMedia(input.media) } : {}),
      ...(input.interaction !== undefined ? { interaction: input.interaction } : {}),
      ...(input.extra !== undefined ? { extra: input.extra } : {}),
      ...(input.unreadable !== undefined ? { unreadable: input.unreadable } : {}),
    };
    return this.#sink.receive(message);
  }

  /**
   * Report, as a channel's delivery status would, that the send with `idempotencyKey` arrived as
   * `messageId` (`sink.confirmSent`).
   * @returns whether an `unknown` entry was resolved by it
   */
  async reportDelivered(idempotencyKey: string, messageId: string): Promise<boolean> {
    if (!this.#sink) throw new Error("MockProvider is not started: call bot.start() first");
    return await this.#sink.confirmSent?.(idempotencyKey, messageId) ?? false;
  }

  async #sealMedia(media: NonNullable<MockInbound["media"]>): Promise<JsonValue> {
    if (media.viewOnce === true) return this.#seal.notDurable("view-once media");
    try {
      return await this.#seal.seal(media as JsonValue);
    } catch {
      return media as JsonValue; // not JSON: passed on as given, for the bot to refuse
    }
  }

  /** Called by `loadMediaOf`: the sealed `data` as bytes. */
  async loadMedia(media: StoredMediaRef, context: MediaLoadContext): Promise<LoadedMedia> {
    const ref = await this.#seal.open(media, context.message.id) as Record<string, JsonValue>;
    const data = typeof ref.data === "string" ? new TextEncoder().encode(ref.data) : new Uint8Array();
    return { data, ...(typeof ref.mimeType === "string" ? { mimeType: ref.mimeType } : {}) };
  }

  /**
   * Make the next `n` sends fail with `error` (default: a retryable
   * `ProviderError`). A `ProviderError` with `retryable: false` is permanent.
   * A new call replaces what an earlier one left (it does not add up);
   * `failNext(0)` fails nothing.
   *
   * @param n how many sends
   * @param error what they throw
   */
  failNext(n: number, error?: unknown): void {
    if (!Number.isInteger(n) || n < 0) throw new RangeError(`Argument "n" must be a non-negative integer, got ${n}`);
    // A new call replaces what an earlier one left; `failNext(0)` fails nothing.
    this.#failures = n === 0 ? [] : [{ remaining: n, error: error ?? new ProviderError("Mock send failure", { retryable: true }) }];
  }

  /**
   * The mock's calls that create no message, sent without the outbox: content objects with
   * `kind: "typing"` (a typing indicator) or `kind: "edit"` (an edit of a sent message).
   *
   * @param content what is sent
   * @returns `false` for a typing indicator or an edit
   */
  isJournaled(content: OutboundContent): boolean {
    return !(typeof content === "object" && content !== null && (content.kind === "typing" || content.kind === "edit"));
  }

  /** Record the send (or fail it, after `failNext`). */
  async send(chatId: string, content: OutboundContent, context: SendContext): Promise<SendReceipt> {
    if (this.sendDelayMs > 0) {
      if (this.#clock === systemClock) await new Promise((resolve) => setTimeout(resolve, this.sendDelayMs));
      else await sleep(this.#clock, this.sendDelayMs);
    }
    const failure = this.#failures[0];
    if (failure) {
      if (--failure.remaining <= 0) this.#failures.shift();
      this.calls.push({ idempotencyKey: context.idempotencyKey, chatId, ok: false });
      throw failure.error;
    }
    const messageId = `mock-msg-${++this.#nextMessageId}`;
    this.calls.push({ idempotencyKey: context.idempotencyKey, chatId, ok: true });
    this.sent.push({ chatId, content, messageId, idempotencyKey: context.idempotencyKey });
    return { messageId };
  }
}
