/**
 * WhatsApp media: the media message types, and loading an inbound message's
 * media again through the Graph API (its URL, then the bytes, checked
 * against Meta's SHA-256).
 *
 * @module
 */
import { ProviderError } from "../../src/errors.ts";
import { type LoadedMedia, type MediaLoadContext, type MediaSeal, MediaUnavailableError, type StoredMediaRef } from "../../src/media.ts";
import { showValue as show } from "../../src/show.ts";
import { type GraphApi, graphError } from "./api.ts";
import { isObject, snippet } from "./values.ts";

/** The message types that carry media. */
export const MEDIA_TYPES: readonly ["image", "audio", "video", "document", "sticker"] = ["image", "audio", "video", "document", "sticker"] as const;

const decoder = new TextDecoder();

/** What loading media needs of the provider. */
export interface MediaLoading {
  /** The seal the references were sealed with. */
  seal: MediaSeal;
  /** The Graph API. */
  api: GraphApi;
  /** The Graph API base URL, without a trailing slash. */
  graphBase: string;
  /** The Graph API version. */
  graphVersion: string;
  /** The business phone number id. */
  phoneNumberId: string;
  /** The largest download accepted. */
  maxMediaBytes: number;
}

/**
 * Load an inbound message's media again: the media id's URL from the Graph
 * API, then the bytes (checked against the SHA-256 Meta gives). The
 * download URL gets the access token too, as Meta requires, but only over
 * https (or when it is on `graphBase` itself, as with a test server).
 *
 * @param media the journaled reference
 * @param context the message, and an abort signal
 * @param loading the seal, the Graph API and the limits
 * @returns the bytes, MIME type and file name
 * @throws {MediaUnavailableError} `rehydrate-failed` when the reference is tampered with, the media expired
 *   (Meta answers 400/404 for a media id older than about 30 days) or its bytes do not match its hash
 * @throws {ProviderError} on a network error, timeout or 5xx (the inbox retries the message)
 */
export async function loadWhatsAppMedia(media: StoredMediaRef, context: MediaLoadContext, loading: MediaLoading): Promise<LoadedMedia> {
  const { seal, api, graphBase, graphVersion, phoneNumberId, maxMediaBytes } = loading;
  const messageId = context?.message?.id;
  const ref = await seal.open(media, messageId);
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
  const metaUrl = `${graphBase}/${graphVersion}/${encodeURIComponent(ref.mediaId)}?phone_number_id=${
    encodeURIComponent(phoneNumberId)
  }`;
  const { response, text } = await api.call("GET", metaUrl, undefined, context?.signal, "media lookup");
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
  if (target.protocol !== "https:" && target.origin !== new URL(graphBase).origin) {
    // the access token only goes over TLS, or to the configured Graph base itself
    throw new ProviderError(`WhatsApp media lookup of ${show(ref.mediaId)} gave a URL that is not https: ${show(meta.url)}`, {
      retryable: true,
      status: response.status,
    });
  }
  const download = await api.fetchBytes("GET", meta.url, undefined, context?.signal, "media download", maxMediaBytes)
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

function toHex(bytes: Uint8Array): string {
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function toBase64(bytes: Uint8Array): string {
  let binary = "";
  for (const byte of bytes) binary += String.fromCharCode(byte);
  return btoa(binary);
}
