/**
 * Telegram media: the reference sealed into the inbox record, and loading the
 * file again (`getFile`, then the download, at most 20 MB).
 *
 * @module
 */
import { isRetryableStatus, ProviderError } from "../../src/errors.ts";
import {
  type LoadedMedia,
  type MediaLoadContext,
  type MediaSeal,
  MediaUnavailableError,
  type StoredMediaRef,
} from "../../src/media.ts";
import type { JsonValue } from "../../src/contract.ts";
import { readCapped } from "../../src/read_capped.ts";
import { showValue as show } from "../../src/show.ts";
import type { BotApi, BotApiCall } from "./api.ts";
import { asError, isObj } from "./values.ts";

/** The largest file the Bot API lets a bot download (`getFile`): 20 MB. */
export const TELEGRAM_MAX_DOWNLOAD_BYTES: number = 20 * 1024 * 1024;

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
 * The stored form of an inbound file: sealed, or not durable when Telegram
 * says it is over the 20 MB the Bot API lets a bot download.
 *
 * @param seal the provider's seal
 * @param ref the file's reference
 * @returns the value for `InboundMessage.media`
 */
export async function sealMediaRef(seal: MediaSeal, ref: TelegramMediaRef): Promise<StoredMediaRef> {
  return ref.fileSize !== undefined && ref.fileSize > TELEGRAM_MAX_DOWNLOAD_BYTES
    ? seal.notDurable(`the file is ${ref.fileSize} bytes, over the Bot API's 20 MB download limit`)
    : await seal.seal(ref as unknown as JsonValue);
}

/** What loading media needs of the provider. */
export interface MediaLoading {
  /** The seal the references were sealed with. */
  seal: MediaSeal;
  /** Bot API calls (`getFile`). */
  call: BotApiCall;
  /** The download. */
  api: BotApi;
}

/**
 * Load the media of an inbound message again: `getFile`, then the download.
 *
 * @param media the journaled reference
 * @param context the message and an abort signal
 * @param loading the seal and the Bot API
 * @returns the bytes, the MIME type and the file name when Telegram gave them
 * @throws {MediaUnavailableError} `rehydrate-failed` when the reference is invalid or tampered with, or Telegram no longer has the file; `not-durable` for a file over 20 MB
 * @throws {ProviderError} (retryable) on 5xx, 429, network errors and timeouts
 */
export async function loadTelegramMedia(media: StoredMediaRef, context: MediaLoadContext, loading: MediaLoading): Promise<LoadedMedia> {
  const { seal, call, api } = loading;
  const messageId = context.message.id;
  const ref = await seal.open(media, messageId);
  if (!isObj(ref) || typeof ref.fileId !== "string") {
    throw new MediaUnavailableError("rehydrate-failed", `The media reference of message ${show(messageId)} has no "fileId"`, { messageId });
  }
  let file: unknown;
  try {
    file = await call("getFile", { file_id: ref.fileId }, { signal: context.signal });
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
  const timeout = AbortSignal.timeout(api.requestTimeoutMs * 4);
  const signal = context.signal ? AbortSignal.any([context.signal, timeout]) : timeout;
  let response: Response;
  try {
    response = await api.fetchFile(path, signal);
  } catch (error) {
    throw new ProviderError(`Telegram file download for message ${show(messageId)} failed: ${api.redact(asError(error).message)}`, {
      retryable: true,
      cause: api.safe(error),
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
