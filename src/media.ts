/**
 * Media on reprocess (docs/conversations-and-media.md): a provider seals the reference to an
 * inbound message's media into the inbox record (versioned, HMAC-protected),
 * and {@link loadMediaOf} loads it again, on the first processing or after a
 * crash, a retry or a replay.
 *
 * @module
 */
import type { JsonValue } from "./contract.ts";
import type { InboundMessage, Provider } from "./provider.ts";
import { showValue as show } from "./show.ts";

/** Why the media of a message cannot be loaded. */
export type MediaUnavailableReason =
  /** The provider did not keep a reference (view-once media, or one it cannot serialize). */
  | "not-durable"
  /** Another provider wrote the record. */
  | "provider-mismatch"
  /** The stored reference is invalid, of an unknown version, tampered with, or the channel no longer has the media. */
  | "rehydrate-failed";

/**
 * The media of an inbound message cannot be loaded; `reason` says why.
 *
 * @example
 * ```ts
 * import { MediaUnavailableError } from "@botmesh/durable";
 * const error = new MediaUnavailableError("not-durable", "The image was view-once");
 * console.log(error.reason); // "not-durable"
 * ```
 */
export class MediaUnavailableError extends Error {
  readonly reason: MediaUnavailableReason;
  /** The inbound message whose media it is, when known. */
  readonly messageId: string | undefined;
  /**
   * @param reason why
   * @param message what happened
   * @param options the message id, and the underlying error
   */
  constructor(reason: MediaUnavailableReason, message: string, options: { messageId?: string; cause?: unknown } = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = "MediaUnavailableError";
    this.reason = reason;
    this.messageId = options.messageId;
  }
}

/** Media loaded again from the channel. */
export interface LoadedMedia {
  data: Uint8Array;
  /** The MIME type, when the channel says it. */
  mimeType?: string;
  /** The file name, when the channel has one. */
  fileName?: string;
}

/** What a provider's `loadMedia` gets besides the stored reference. */
export interface MediaLoadContext {
  /** The inbound message whose media it is. */
  message: InboundMessage;
  /** Aborts the download. */
  signal?: AbortSignal;
}

/** The version of the sealed form written today. */
export const MEDIA_REF_VERSION = 1;

/** A sealed media reference as it is journaled in `InboundMessage.media`. */
export type StoredMediaRef =
  | { v: 1; provider: string; ref: JsonValue; mac: string }
  | { v: 1; provider: string; durable: false; why: string };

/** Options of {@link MediaSeal}. */
export interface MediaSealOptions {
  /** The provider name written into each reference (`Provider.name`). */
  provider: string;
  /** The HMAC key: at least 16 bytes (a string is taken as UTF-8). Keep it stable across restarts. */
  key: string | Uint8Array;
}

const encoder = new TextEncoder();

function canonicalJson(value: unknown): string {
  if (typeof value === "object" && value !== null && typeof (value as { toJSON?: unknown }).toJSON === "function") {
    value = (value as { toJSON(): unknown }).toJSON(); // as JSON.stringify does: a Date seals as its string
  }
  if (Array.isArray(value)) return `[${value.map(canonicalJson).join(",")}]`;
  if (typeof value === "object" && value !== null) {
    const keys = Object.keys(value).filter((k) => (value as Record<string, unknown>)[k] !== undefined).sort();
    return `{${keys.map((k) => `${JSON.stringify(k)}:${canonicalJson((value as Record<string, unknown>)[k])}`).join(",")}}`;
  }
  const text = JSON.stringify(value);
  if (text === undefined) throw new TypeError(`Media reference is not JSON: found ${show(value)}`);
  return text;
}

function base64url(bytes: Uint8Array): string {
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return btoa(binary).replaceAll("+", "-").replaceAll("/", "_").replace(/=+$/, "");
}

function fromBase64url(text: string): Uint8Array | null {
  if (!/^[A-Za-z0-9_-]*$/.test(text)) return null;
  try {
    const binary = atob(text.replaceAll("-", "+").replaceAll("_", "/"));
    return Uint8Array.from(binary, (c) => c.charCodeAt(0));
  } catch {
    return null;
  }
}

/**
 * Seals media references for one provider and opens them again. A sealed
 * reference is `{ v, provider, ref, mac }`, where `mac` is HMAC-SHA-256 over
 * the version, the provider name and the reference's canonical JSON.
 *
 * @example
 * ```ts
 * import { MediaSeal } from "@botmesh/durable/provider";
 * const seal = new MediaSeal({ provider: "telegram", key: "a secret of 16+ bytes" });
 * const stored = await seal.seal({ fileId: "AgAC…" });
 * console.log(await seal.open(stored, "m1")); // { fileId: "AgAC…" }
 * ```
 */
export class MediaSeal {
  readonly provider: string;
  readonly #raw: Uint8Array;
  #imported: Promise<CryptoKey> | undefined;

  /**
   * @param options the provider name and the key
   * @throws {TypeError} when the provider name or the key is not one
   * @throws {RangeError} when the key is shorter than 16 bytes
   */
  constructor(options: MediaSealOptions) {
    if (typeof options?.provider !== "string" || options.provider === "") {
      throw new TypeError(`Option "provider" must be a non-empty string, got ${show(options?.provider)}`);
    }
    const key = options.key;
    const bytes = typeof key === "string" ? encoder.encode(key) : key instanceof Uint8Array ? key : null;
    if (bytes === null) throw new TypeError(`Option "mediaKey" must be a string or a Uint8Array, got ${show(key)}`);
    if (bytes.byteLength < 16) {
      throw new RangeError(`Option "mediaKey" must be at least 16 bytes, got ${bytes.byteLength}`);
    }
    this.provider = options.provider;
    this.#raw = bytes.slice();
  }

  /** The HMAC key, imported on first use (constructing a provider stays cheap). */
  get #key(): Promise<CryptoKey> {
    this.#imported ??= crypto.subtle.importKey(
      "raw",
      this.#raw as Uint8Array<ArrayBuffer>,
      { name: "HMAC", hash: "SHA-256" },
      false,
      ["sign", "verify"],
    );
    return this.#imported;
  }

  #signed(ref: JsonValue): Uint8Array<ArrayBuffer> {
    return encoder.encode(`botmesh.media/v${MEDIA_REF_VERSION}\n${this.provider}\n${canonicalJson(ref)}`);
  }

  /**
   * Seal a reference for the inbox record.
   *
   * @param ref what the provider needs to load the media again (JSON)
   * @returns the sealed form, for `InboundMessage.media`
   * @throws {TypeError} when `ref` is not JSON
   */
  async seal(ref: JsonValue): Promise<StoredMediaRef> {
    canonicalJson(ref); // throws when it is not JSON (a function, a symbol, a cycle)
    ref = JSON.parse(JSON.stringify(ref)); // what the journal will hold (a Date as its string), so it verifies after the round trip
    const data = this.#signed(ref);
    const mac = new Uint8Array(await crypto.subtle.sign("HMAC", await this.#key, data));
    return { v: MEDIA_REF_VERSION, provider: this.provider, ref, mac: base64url(mac) };
  }

  /**
   * The stored form of media that cannot be loaded again (view-once, or a
   * reference the provider cannot serialize).
   *
   * @param why a short reason, shown in the error
   * @returns the stored form
   */
  notDurable(why: string): StoredMediaRef {
    return { v: MEDIA_REF_VERSION, provider: this.provider, durable: false, why };
  }

  /**
   * Check a stored reference and return what was sealed.
   *
   * @param stored `InboundMessage.media` as journaled
   * @param messageId the message, for the error
   * @returns the reference given to {@link MediaSeal.seal}
   * @throws {MediaUnavailableError} `not-durable`, `provider-mismatch` or `rehydrate-failed`
   */
  async open(stored: unknown, messageId?: string): Promise<JsonValue> {
    const envelope = checkEnvelope(stored, this.provider, messageId);
    if (!("mac" in envelope)) {
      throw new MediaUnavailableError("not-durable", `The media of message ${show(messageId)} was not kept: ${envelope.why}`, {
        messageId,
      });
    }
    const mac = typeof envelope.mac === "string" ? fromBase64url(envelope.mac) : null;
    let valid = false;
    try {
      valid = mac !== null && await crypto.subtle.verify(
        "HMAC",
        await this.#key,
        mac as Uint8Array<ArrayBuffer>,
        this.#signed(envelope.ref),
      );
    } catch {
      valid = false; // a reference that is not JSON cannot be verified
    }
    if (!valid) {
      throw new MediaUnavailableError(
        "rehydrate-failed",
        `The media reference of message ${show(messageId)} failed its integrity check (tampered with, or sealed with another key)`,
        { messageId },
      );
    }
    return envelope.ref;
  }
}

/**
 * Check the outer shape of a stored reference: version, provider, and the
 * fields of the sealed or the not-durable form. The MAC is not checked here.
 *
 * @param stored `InboundMessage.media` as journaled
 * @param provider the provider that must have written it
 * @param messageId the message, for the error
 * @returns the envelope
 * @throws {MediaUnavailableError} `provider-mismatch` or `rehydrate-failed`
 */
export function checkEnvelope(stored: unknown, provider: string, messageId?: string): StoredMediaRef {
  const where = `of message ${show(messageId)}`;
  if (typeof stored !== "object" || stored === null || Array.isArray(stored)) {
    throw new MediaUnavailableError("rehydrate-failed", `The media reference ${where} is not a sealed reference, got ${show(stored)}`, {
      messageId,
    });
  }
  const e = stored as Record<string, unknown>;
  if (e.v !== MEDIA_REF_VERSION) {
    throw new MediaUnavailableError(
      "rehydrate-failed",
      `The media reference ${where} has an unknown version ${show(e.v)} (this library reads version ${MEDIA_REF_VERSION})`,
      { messageId },
    );
  }
  if (typeof e.provider !== "string") {
    throw new MediaUnavailableError("rehydrate-failed", `The media reference ${where} has no "provider" field`, { messageId });
  }
  if (e.provider !== provider) {
    throw new MediaUnavailableError(
      "provider-mismatch",
      `The media reference ${where} was written by provider ${show(e.provider)}, not ${show(provider)}`,
      { messageId },
    );
  }
  if (e.durable === false) {
    return { v: 1, provider: e.provider, durable: false, why: typeof e.why === "string" ? e.why : "not kept" };
  }
  if (typeof e.mac !== "string" || !("ref" in e)) {
    throw new MediaUnavailableError("rehydrate-failed", `The media reference ${where} lacks its "ref" or "mac" field`, {
      messageId,
    });
  }
  return e as StoredMediaRef;
}

/** Options of {@link loadMediaOf}. */
export interface LoadMediaOptions {
  /** Throw a {@link MediaUnavailableError} instead of resolving `null` (default `false`). */
  throwOnError?: boolean;
  /** Aborts the download. */
  signal?: AbortSignal;
}

/** What {@link loadMediaOf} needs of a handler's context. */
export interface MediaContext {
  readonly message: InboundMessage;
  readonly bot: { readonly provider: Provider };
}

/**
 * Load the media of the message a handler is processing, on its first
 * processing or on a reprocess after a crash, a retry or a replay.
 *
 * Errors that are not about the reference (a network failure, a 5xx) are
 * thrown as they are whatever `throwOnError` says, so the inbox retries the
 * message with backoff.
 *
 * @param ctx the handler's context
 * @param options `throwOnError`, `signal`
 * @returns the media; `null` when it is unavailable and `throwOnError` is not set
 * @throws {MediaUnavailableError} with `throwOnError`, when the media cannot be loaded
 *
 * @example
 * ```ts
 * import { Bot, IMAGE, loadMediaOf, MediaUnavailableError } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 * const provider = new MockProvider();
 * const bot = new Bot({ provider });
 * bot.when(IMAGE, async (ctx) => {
 *   try {
 *     const media = await loadMediaOf(ctx, { throwOnError: true });
 *     await ctx.reply(`Got ${media!.data.byteLength} bytes`);
 *   } catch (error) {
 *     if (error instanceof MediaUnavailableError) return ctx.reply("Please send the image again.");
 *     throw error;
 *   }
 * });
 * await bot.start();
 * await provider.receive({ chatId: "c1", media: { type: "image", data: "PNG…" } });
 * await bot.idle();
 * console.log(provider.sent[0].content); // "Got 6 bytes"
 * await bot.stop();
 * ```
 */
export async function loadMediaOf(ctx: MediaContext, options: LoadMediaOptions = {}): Promise<LoadedMedia | null> {
  if (typeof options !== "object" || options === null) {
    throw new TypeError(`Argument "options" must be an object, got ${show(options)}`);
  }
  const { message, bot } = ctx;
  try {
    const media = message.media;
    if (media === undefined || media === null) {
      throw new MediaUnavailableError("not-durable", `Message ${show(message.id)} carries no media reference`, {
        messageId: message.id,
      });
    }
    const provider = bot.provider;
    if (typeof provider.loadMedia !== "function") {
      throw new MediaUnavailableError("not-durable", `Provider ${show(provider.name)} cannot load media again`, {
        messageId: message.id,
      });
    }
    if (typeof media !== "object" || Array.isArray(media) || !("v" in media)) {
      throw new MediaUnavailableError(
        "not-durable",
        `Message ${show(message.id)} carries media the provider did not seal for loading again, got ${show(media)}`,
        { messageId: message.id },
      );
    }
    const envelope = checkEnvelope(media, provider.name, message.id);
    if (!("mac" in envelope)) {
      throw new MediaUnavailableError("not-durable", `The media of message ${show(message.id)} was not kept: ${envelope.why}`, {
        messageId: message.id,
      });
    }
    const loaded = await provider.loadMedia(envelope, { message, signal: options.signal });
    if (!(loaded?.data instanceof Uint8Array)) {
      throw new TypeError(`Provider ${show(provider.name)} returned media without a Uint8Array "data" field`);
    }
    return loaded;
  } catch (error) {
    if (error instanceof MediaUnavailableError && options.throwOnError !== true) return null;
    throw error;
  }
}
