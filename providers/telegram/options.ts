/**
 * The options of the Telegram provider, and their checks.
 *
 * @module
 */
import { checkKnownOptions } from "../../src/options.ts";
import { MediaSeal } from "../../src/media.ts";
import { showValue as show } from "../../src/show.ts";
import { type SkippedUpdate, TELEGRAM_HANDLED_UPDATES } from "./updates.ts";
import { isObj, type Obj } from "./values.ts";

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
  /** The most time a webhook body may take to arrive, in ms (default 10 000); a body still arriving then is answered 408. */
  bodyTimeoutMs?: number;
  /**
   * Problems no caller sees: a malformed update, a failed `getUpdates`, a
   * failed `answerCallbackQuery` (default: the bot's `error` event while the
   * provider is started, `console.error` otherwise).
   */
  onError?: (error: Error) => void;
  /** Called for each update of a kind the provider does not handle (it is acknowledged and dropped). */
  onSkippedUpdate?: (skipped: SkippedUpdate) => void;
}

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
  "bodyTimeoutMs",
  "onError",
  "onSkippedUpdate",
] as const;

const TOKEN_RE = /^(\d+):([A-Za-z0-9_-]+)$/;
const SECRET_RE = /^[A-Za-z0-9_-]{1,256}$/;

/** The options, checked, with their defaults. */
export interface TelegramSettings {
  /** The bot token. */
  token: string;
  /** The bot's id: the part of the token before `:`. */
  botId: string;
  /** `'webhook'` or `'polling'`. */
  mode: "webhook" | "polling";
  /** The webhook's secret token, or `false` for none. */
  secret: string | false;
  /** The Bot API server, without a trailing slash. */
  apiBase: string;
  /** The `fetch` to call the API with. */
  fetch: typeof fetch;
  /** The provider name. */
  name: string;
  /** Seals media references. */
  seal: MediaSeal;
  /** Long-poll `timeout` of `getUpdates`, in seconds. */
  pollTimeoutSec: number;
  /** How long one API call may take, in ms. */
  requestTimeoutMs: number;
  /** The largest webhook body accepted. */
  maxBodyBytes: number;
  /** The most time a webhook body may take to arrive, in ms. */
  bodyTimeoutMs: number;
  /** `allowed_updates` of `getUpdates` and `setWebhook`. */
  allowedUpdates: readonly string[];
  /** Polling mode: call `deleteWebhook` before the first `getUpdates`. */
  deleteWebhookOnStart: boolean;
  /** Polling backoff. */
  backoff: { baseMs: number; capMs: number };
  /** Where problems no caller sees go. */
  onError: (error: Error) => void;
  /** The `onSkippedUpdate` option. */
  onSkipped: ((skipped: SkippedUpdate) => void) | undefined;
}

/**
 * Check the options of a Telegram provider.
 *
 * @param options the options as given
 * @param defaultOnError where problems go when `onError` is not given
 * @returns the options with their defaults
 * @throws {TypeError} when an option is missing, unknown or of the wrong type (the message names it)
 * @throws {RangeError} when a number option is out of range or `mediaKey` is too short
 */
export function telegramSettings(options: TelegramProviderOptions, defaultOnError: (error: Error) => void): TelegramSettings {
  if (!isObj(options)) throw new TypeError(`Telegram options must be an object with a "token", got ${show(options)}`);
  const o = options as unknown as Obj;
  checkKnownOptions(o, OPTION_NAMES, "Telegram option");
  const token = o.token;
  if (typeof token !== "string") fail("token", 'a bot token string like "123456:ABC-DEF…"', token === undefined ? token : typeof token);
  const match = TOKEN_RE.exec(token);
  // The token is a secret: never quote it back.
  if (!match) throw new TypeError(`Option "token" must look like "123456:ABC-DEF…" (digits, ":", then letters, digits, "-", "_"), got a string of ${token.length} characters that does not`);
  const mode = o.mode ?? "webhook";
  if (mode !== "webhook" && mode !== "polling") fail("mode", '"webhook" or "polling"', mode);
  const secret = o.secretToken;
  let checkedSecret: string | false;
  if (secret === undefined) {
    if (mode === "webhook") {
      throw new TypeError(
        `Option "secretToken" is required in webhook mode: the secret given to setWebhook (1-256 of A-Z, a-z, 0-9, "_", "-"), or false to accept unauthenticated requests`,
      );
    }
    checkedSecret = false;
  } else if (secret === false) {
    checkedSecret = false;
  } else if (typeof secret !== "string" || !SECRET_RE.test(secret)) {
    throw new TypeError(
      `Option "secretToken" must be 1-256 characters of A-Z, a-z, 0-9, "_", "-" (or false), got ${
        typeof secret === "string" ? `a string of ${secret.length} characters that is not` : show(secret)
      }`,
    );
  } else {
    checkedSecret = secret;
  }
  const apiBase = o.apiBase ?? "https://api.telegram.org";
  let url: URL | null = null;
  try {
    url = typeof apiBase === "string" ? new URL(apiBase) : null;
  } catch {
    url = null;
  }
  if (url === null || (url.protocol !== "https:" && url.protocol !== "http:")) fail("apiBase", "an http(s) URL", apiBase);
  const f = o.fetch ?? globalThis.fetch;
  if (typeof f !== "function") fail("fetch", "a function", f);
  const name = o.name ?? "telegram";
  if (typeof name !== "string" || name === "") fail("name", "a non-empty string", name);
  const mediaKey = o.mediaKey ?? `botmesh/telegram-media/v1/${token}`;
  if (typeof mediaKey !== "string" && !(mediaKey instanceof Uint8Array)) fail("mediaKey", "a string or a Uint8Array", mediaKey);
  const seal = new MediaSeal({ provider: name, key: mediaKey as string | Uint8Array });
  const pollTimeoutSec = intOption(o, "pollTimeoutSec", 30, 0, 50);
  const requestTimeoutMs = intOption(o, "requestTimeoutMs", 30_000, 100, 600_000);
  const maxBodyBytes = intOption(o, "maxBodyBytes", 1024 * 1024, 1024, 64 * 1024 * 1024);
  const bodyTimeoutMs = intOption(o, "bodyTimeoutMs", 10_000, 1, 600_000);
  const allowed = o.allowedUpdates ?? TELEGRAM_HANDLED_UPDATES;
  if (!Array.isArray(allowed) || !allowed.every((k) => typeof k === "string" && /^[a-z_]+$/.test(k))) {
    fail("allowedUpdates", 'an array of update kinds like ["message", "callback_query"]', allowed);
  }
  const del = o.deleteWebhookOnStart ?? false;
  if (typeof del !== "boolean") fail("deleteWebhookOnStart", "a boolean", del);
  const backoff = o.pollBackoff ?? {};
  if (!isObj(backoff)) fail("pollBackoff", "an object { baseMs?, capMs? }", backoff);
  const baseMs = intOption(backoff, "baseMs", 500, 1, 3_600_000);
  const capMs = intOption(backoff, "capMs", Math.max(30_000, baseMs), 1, 3_600_000);
  if (capMs < baseMs) fail("pollBackoff.capMs", `at least pollBackoff.baseMs (${baseMs})`, capMs, RangeError);
  const onError = o.onError ?? defaultOnError;
  if (typeof onError !== "function") fail("onError", "a function", onError);
  if (o.onSkippedUpdate !== undefined && typeof o.onSkippedUpdate !== "function") {
    fail("onSkippedUpdate", "a function", o.onSkippedUpdate);
  }
  return {
    token,
    botId: match[1]!,
    mode,
    secret: checkedSecret,
    apiBase: (apiBase as string).replace(/\/+$/, ""),
    fetch: f as typeof fetch,
    name,
    seal,
    pollTimeoutSec,
    requestTimeoutMs,
    maxBodyBytes,
    bodyTimeoutMs,
    allowedUpdates: [...allowed],
    deleteWebhookOnStart: del,
    backoff: { baseMs, capMs },
    onError: onError as (error: Error) => void,
    onSkipped: o.onSkippedUpdate as ((skipped: SkippedUpdate) => void) | undefined,
  };
}

function fail(option: string, rule: string, value: unknown, Kind: typeof TypeError | typeof RangeError = TypeError): never {
  throw new Kind(`Option "${option}" must be ${rule}, got ${show(value)}`);
}

function intOption(o: Obj, name: string, dflt: number, min: number, max: number): number {
  const v = o[name] ?? dflt;
  if (typeof v !== "number") fail(name, `an integer from ${min} to ${max}`, v);
  if (!Number.isInteger(v) || v < min || v > max) fail(name, `an integer from ${min} to ${max}`, v, RangeError);
  return v;
}
