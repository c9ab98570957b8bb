/**
 * The options of the WhatsApp provider, and their checks.
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import { MediaSeal } from "../../src/media.ts";
import { showValue as show } from "../../src/show.ts";
import type { WhatsAppStatus } from "./statuses.ts";
import { isObject } from "./values.ts";

/** The Graph API version used when `graphVersion` is not given. */
export const DEFAULT_GRAPH_VERSION = "v24.0";
/** The Graph API base URL used when `graphBase` is not given. */
export const DEFAULT_GRAPH_BASE = "https://graph.facebook.com";

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
  /**
   * The most time a webhook body may take to arrive, in ms (default 10 000); a body still arriving then
   * is answered 408 before its signature is checked, so a client that never ends its body holds nothing.
   */
  bodyTimeoutMs?: number;
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

/** A phone number id as the `phoneNumberId` option takes it (and as a change of another number must spell it). */
export const PHONE_NUMBER_ID: RegExp = /^[A-Za-z0-9_-]{1,64}$/;

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
  "bodyTimeoutMs",
  "maxMediaBytes",
  "onStatus",
  "onError",
  "callbackData",
];

const encoder = new TextEncoder();

/** The options, checked, with their defaults. */
export interface WhatsAppSettings {
  /** The access token. */
  accessToken: string;
  /** The business phone number id. */
  phoneNumberId: string;
  /** The app secret as an HMAC key (the webhook's signatures). */
  appSecretKey: Promise<CryptoKey>;
  /** The verify token, as bytes. */
  verifyToken: Uint8Array;
  /** The Graph API base URL, without a trailing slash. */
  graphBase: string;
  /** The Graph API version. */
  graphVersion: string;
  /** The `fetch` to call the Graph API with. */
  fetch: typeof fetch;
  /** Timeout of each request, in ms. */
  timeoutMs: number;
  /** The largest webhook body accepted. */
  maxBodyBytes: number;
  /** The most time a webhook body may take to arrive, in ms. */
  bodyTimeoutMs: number;
  /** The largest media download accepted. */
  maxMediaBytes: number;
  /** The provider name. */
  name: string;
  /** The `onStatus` option. */
  onStatus: ((status: WhatsAppStatus) => void | Promise<void>) | undefined;
  /** Where problems of the webhook go. */
  onError: (error: Error) => void;
  /** Whether sends carry their outbox key as `biz_opaque_callback_data`. */
  callbackData: boolean;
  /** Seals media references. */
  seal: MediaSeal;
}

/**
 * Check the options of a WhatsApp provider.
 *
 * @param options the options as given
 * @param defaultOnError where problems go when `onError` is not given
 * @returns the options with their defaults
 * @throws {TypeError} naming the option when one is missing, of the wrong type, or unknown
 * @throws {RangeError} naming the option when one is out of range
 */
export function whatsAppSettings(options: WhatsAppProviderOptions, defaultOnError: (error: Error) => void): WhatsAppSettings {
  if (!isObject(options)) throw new TypeError(`WhatsAppProvider options must be an object, got ${show(options)}`);
  const o = options as unknown as Record<string, unknown>;
  checkKnownOptions(o, OPTION_NAMES, "WhatsApp option");
  const accessToken = checkString(o, "accessToken", true)!;
  const phoneNumberId = checkString(o, "phoneNumberId", true)!;
  if (!PHONE_NUMBER_ID.test(phoneNumberId)) {
    throw new RangeError(`Option "phoneNumberId" must be the phone number id (digits), got ${show(phoneNumberId)}`);
  }
  const appSecret = checkString(o, "appSecret", true)!;
  const verifyToken = encoder.encode(checkString(o, "verifyToken", true)!);
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
  const version = checkString(o, "graphVersion", false) ?? DEFAULT_GRAPH_VERSION;
  if (!/^v\d{1,3}\.\d{1,3}$/.test(version)) {
    throw new RangeError(`Option "graphVersion" must look like "v24.0", got ${show(version)}`);
  }
  if (o.fetch !== undefined && typeof o.fetch !== "function") {
    throw new TypeError(`Option "fetch" must be a function, got ${show(o.fetch)}`);
  }
  const f = (o.fetch as typeof fetch | undefined) ?? globalThis.fetch;
  if (typeof f !== "function") throw new TypeError(`Option "fetch" is required: this runtime has no global fetch`);
  const timeoutMs = checkPositiveInt(o, "requestTimeoutMs", 30_000);
  const maxBodyBytes = checkPositiveInt(o, "maxBodyBytes", 1024 * 1024);
  const bodyTimeoutMs = checkPositiveInt(o, "bodyTimeoutMs", 10_000);
  const maxMediaBytes = checkPositiveInt(o, "maxMediaBytes", 100 * 1024 * 1024);
  const name = checkString(o, "name", false) ?? "whatsapp";
  for (const option of ["onStatus", "onError"] as const) {
    if (o[option] !== undefined && typeof o[option] !== "function") {
      throw new TypeError(`Option "${option}" must be a function, got ${show(o[option])}`);
    }
  }
  const onStatus = options.onStatus;
  const onError = options.onError ?? defaultOnError;
  if (o.callbackData !== undefined && typeof o.callbackData !== "boolean") {
    throw new TypeError(`Option "callbackData" must be a boolean, got ${show(o.callbackData)}`);
  }
  const callbackData = options.callbackData ?? true;
  if (o.mediaKey !== undefined && typeof o.mediaKey !== "string" && !(o.mediaKey instanceof Uint8Array)) {
    throw new TypeError(`Option "mediaKey" must be a string or a Uint8Array, got ${show(o.mediaKey)}`);
  }
  const seal = new MediaSeal({
    provider: name,
    key: options.mediaKey ?? `botmesh.whatsapp.media-key\n${appSecret}`,
  });
  const appSecretKey = crypto.subtle.importKey(
    "raw",
    encoder.encode(appSecret),
    { name: "HMAC", hash: "SHA-256" },
    false,
    ["sign", "verify"],
  );
  return {
    accessToken,
    phoneNumberId,
    appSecretKey,
    verifyToken,
    graphBase: base.replace(/\/+$/, ""),
    graphVersion: version,
    fetch: f,
    timeoutMs,
    maxBodyBytes,
    bodyTimeoutMs,
    maxMediaBytes,
    name,
    onStatus,
    onError,
    callbackData,
    seal,
  };
}

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
