/**
 * Bot API calls: one method call over HTTP (JSON, or multipart for files),
 * Telegram's answer read and classified (retryable or permanent), and the
 * token kept out of every error.
 *
 * @module
 */
import { isRetryableStatus, ProviderError } from "../../src/errors.ts";
import { showValue as show } from "../../src/show.ts";
import { redactError, redactToken } from "./redact.ts";
import { asError, isObj } from "./values.ts";

/** A Bot API method name: `getMe`, `sendMessage`, … */
export const METHOD_RE: RegExp = /^[A-Za-z][A-Za-z0-9]*$/;

/** A Bot API call: the provider's `call`. */
export type BotApiCall = (method: string, params?: Record<string, unknown>, options?: { signal?: AbortSignal; timeoutMs?: number }) => Promise<unknown>;

/** Where the Bot API is and how to reach it. */
export interface BotApiSettings {
  /** The bot token (in every URL, never in an error). */
  token: string;
  /** The Bot API server, without a trailing slash. */
  apiBase: string;
  /** The `fetch` to call it with. */
  fetch: typeof fetch;
  /** How long one call may take, in ms. */
  requestTimeoutMs: number;
}

interface CallResult {
  ok: true;
  result: unknown;
}

/** The Bot API of one bot. */
export class BotApi {
  /** How long one call may take, in ms. */
  readonly requestTimeoutMs: number;
  readonly #token: string;
  readonly #apiBase: string;
  readonly #fetch: (input: string, init?: RequestInit) => Promise<Response>;

  /**
   * Reach the Bot API of one bot.
   *
   * @param settings the token, the server, `fetch` and the timeout
   */
  constructor(settings: BotApiSettings) {
    this.#token = settings.token;
    this.#apiBase = settings.apiBase;
    const { fetch: call } = settings;
    // Called as a plain function: Workers' fetch throws "Illegal invocation" when called on another object.
    this.#fetch = (input, init) => call(input, init);
    this.requestTimeoutMs = settings.requestTimeoutMs;
  }

  /**
   * Call a Bot API method with JSON parameters (or multipart when a value is
   * a `Uint8Array`/`Blob`).
   *
   * @param method the method, e.g. `"getMe"`
   * @param params its parameters
   * @param options `signal` aborts the call; `timeoutMs` overrides `requestTimeoutMs`
   * @returns the `result` field of Telegram's answer
   * @throws {ProviderError} `retryable` for 429 (with `retryAfterMs`), 5xx, network errors and timeouts; permanent for other 4xx and for a body that is not Telegram's envelope
   */
  async call(method: string, params: Record<string, unknown> = {}, options: { signal?: AbortSignal; timeoutMs?: number } = {}): Promise<unknown> {
    if (typeof method !== "string" || !METHOD_RE.test(method)) {
      throw new TypeError(`Argument "method" must be a Bot API method name like "sendMessage", got ${show(method)}`);
    }
    const timeoutMs = options.timeoutMs ?? this.requestTimeoutMs;
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
          cause: this.safe(error),
        });
      }
      if (options.signal?.aborted) {
        throw new ProviderError(`Telegram ${method} was aborted`, { retryable: true, cause: this.safe(error) });
      }
      throw new ProviderError(`Telegram ${method} failed: ${this.redact(asError(error).message)}`, { retryable: true, cause: this.safe(error) });
    }
    let json: unknown;
    try {
      json = JSON.parse(text);
    } catch {
      json = undefined;
    }
    const status = response.status;
    if (!isObj(json) || typeof json.ok !== "boolean") {
      const snippet = this.redact(text.slice(0, 200));
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
    const description = typeof json.description === "string" ? this.redact(json.description) : "no description";
    const parameters = isObj(json.parameters) ? json.parameters : {};
    const retryAfter = typeof parameters.retry_after === "number" && parameters.retry_after >= 0 ? parameters.retry_after : undefined;
    const migrate = parameters.migrate_to_chat_id;
    throw new ProviderError(
      `Telegram ${method} failed with ${code}: ${description}${migrate !== undefined ? ` (the group moved to chat ${show(migrate)})` : ""}`,
      { status: code, retryable: isRetryableStatus(code), ...(retryAfter !== undefined ? { retryAfterMs: retryAfter * 1000 } : {}) },
    );
  }

  /**
   * Start the download of a file (`file_path` from `getFile`).
   *
   * @param path the file's `file_path`
   * @param signal aborts the download
   * @returns Telegram's answer, its body unread
   */
  fetchFile(path: string, signal: AbortSignal): Promise<Response> {
    return this.#fetch(`${this.#apiBase}/file/bot${this.#token}/${path.split("/").map(encodeURIComponent).join("/")}`, { signal });
  }

  /**
   * A text without the token (see `redactToken`: also its percent-encoded form, and any `bot<id>:<secret>`).
   *
   * @param text a message or a body that may quote the URL
   * @returns the text with `<token>` in place of the token
   */
  redact(text: string): string {
    return redactToken(text, this.#token);
  }

  /**
   * A `fetch` error without what could carry the token (the URL holds it: a
   * runtime may keep it in a `path` or `url` property): see `redactError` (name,
   * redacted message, stack and causes, no other property).
   *
   * @param error what `fetch` threw
   * @returns an error safe to keep as a `cause`
   */
  safe(error: unknown): Error {
    return redactError(error, this.#token);
  }
}

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
