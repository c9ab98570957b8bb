/**
 * The Graph API: requests with the access token (under a timeout, the answer
 * read up to a cap), and its error answers classified (throttling and
 * transient errors are retried, honouring `Retry-After`; permanent ones are not).
 *
 * @module
 */
import { ProviderError } from "../../src/errors.ts";
import type { ErrorClassification } from "../../src/provider.ts";
import { readCapped } from "../../src/read_capped.ts";
import { isObject, snippet } from "./values.ts";

const decoder = new TextDecoder();

/**
 * An error answer of the Graph API: the HTTP status, and the Graph error
 * `code`, `subcode`, `type`, `details` and `fbtraceId`. `retryable` and
 * `retryAfterMs` say what the bot's outbox does with it.
 *
 * @example
 * ```ts
 * import { WhatsAppApiError } from "@botmesh/durable/whatsapp";
 * const error = new WhatsAppApiError("(#131047) Re-engagement message", { status: 400, code: 131047, retryable: false });
 * console.log(error.code, error.retryable); // 131047 false
 * ```
 */
export class WhatsAppApiError extends ProviderError {
  /** The Graph error code (`error.code`), when the body had one. */
  readonly code: number | undefined;
  /** The Graph error subcode (`error.error_subcode`), when the body had one. */
  readonly subcode: number | undefined;
  /** The Graph error type (`OAuthException`, …). */
  readonly type: string | undefined;
  /** `error.error_data.details`: Meta's explanation. */
  readonly details: string | undefined;
  /** `error.fbtrace_id`, for Meta support. */
  readonly fbtraceId: string | undefined;

  /**
   * Make the error of one Graph API answer.
   *
   * @param message what happened
   * @param options the HTTP status, Graph fields, and the classification
   */
  constructor(
    message: string,
    options: {
      status?: number;
      code?: number;
      subcode?: number;
      type?: string;
      details?: string;
      fbtraceId?: string;
      retryable?: boolean;
      retryAfterMs?: number;
      rateLimited?: "chat" | "global";
      cause?: unknown;
    } = {},
  ) {
    super(message, {
      status: options.status,
      retryable: options.retryable,
      retryAfterMs: options.retryAfterMs,
      cause: options.cause,
      // Graph answers some throttles with HTTP 400: only what the classification says is a rate limit.
      rateLimited: options.rateLimited,
    });
    this.name = "WhatsAppApiError";
    this.code = options.code;
    this.subcode = options.subcode;
    this.type = options.type;
    this.details = options.details;
    this.fbtraceId = options.fbtraceId;
  }
}

/** The (business, consumer) pair rate limit: one recipient's messages, not the number's. */
const PAIR_RATE_CODE = 131056;
/** Throttling codes: retry, not before Retry-After (or the default wait here, in ms). */
const THROTTLE_CODES: ReadonlyMap<number, number | undefined> = new Map([
  [4, 60_000], // application request limit reached
  [17, 60_000], // user request limit reached
  [32, 60_000], // page request limit reached
  [613, 60_000], // calls to this API exceeded the rate limit
  [80007, 60_000], // WhatsApp Business Account rate limit
  [130429, 1_000], // Cloud API throughput reached
  [131048, 60_000], // spam rate limit
  [131056, 6_000], // (business, consumer) pair rate limit: one message per 6 s
]);
/** Transient server-side codes: retry with the outbox backoff. */
const TRANSIENT_CODES: ReadonlySet<number> = new Set([1, 2, 131000, 131016, 131057, 133004]);
/** Codes that never succeed on a retry of the same request, whatever the HTTP status says. */
const PERMANENT_CODES: ReadonlySet<number> = new Set([
  0, 3, 10, 33, 100, 190, 368, 131005, 131008, 131009, 131021, 131026, 131030, 131031, 131042, 131045, 131047,
  131049, 131050, 131051, 131052, 131053,
]);
const MAX_RETRY_AFTER_MS = 24 * 3600_000;

/**
 * Parse a `Retry-After` header: delay-seconds or an HTTP date.
 *
 * @param value the header value
 * @param now the current time (ms)
 * @returns the delay in ms, or `undefined` when absent or unreadable
 */
export function parseRetryAfter(value: string | null | undefined, now: number = Date.now()): number | undefined {
  if (value === null || value === undefined) return undefined;
  const text = value.trim();
  if (text === "") return undefined;
  if (/^\d+(\.\d+)?$/.test(text)) return Math.min(MAX_RETRY_AFTER_MS, Math.ceil(Number(text) * 1000));
  const at = Date.parse(text);
  if (Number.isNaN(at)) return undefined;
  return Math.min(MAX_RETRY_AFTER_MS, Math.max(0, at - now));
}

/** `estimated_time_to_regain_access` (minutes) of Meta's usage headers, in ms. */
function regainAccessMs(headers: Headers): number | undefined {
  let best: number | undefined;
  for (const name of ["x-business-use-case-usage", "x-app-usage", "x-ad-account-usage"]) {
    const raw = headers.get(name);
    if (!raw) continue;
    try {
      const walk = (value: unknown): void => {
        if (Array.isArray(value)) value.forEach(walk);
        else if (isObject(value)) {
          const minutes = value.estimated_time_to_regain_access;
          if (typeof minutes === "number" && minutes > 0) best = Math.max(best ?? 0, minutes * 60_000);
          Object.values(value).forEach(walk);
        }
      };
      walk(JSON.parse(raw));
    } catch {
      // not JSON: ignored
    }
  }
  return best === undefined ? undefined : Math.min(best, MAX_RETRY_AFTER_MS);
}

/**
 * Classify a Graph API error answer.
 *
 * @param status the HTTP status
 * @param code the Graph error code, when there is one
 * @param headers the response headers (`Retry-After`, usage headers)
 * @returns whether a retry may succeed, and not before when
 */
export function classifyGraphError(status: number, code: number | undefined, headers: Headers = new Headers()): ErrorClassification {
  const retryAfter = parseRetryAfter(headers.get("retry-after"));
  if (code !== undefined && THROTTLE_CODES.has(code)) {
    // The pair limit (131056) holds one recipient; every other throttle the whole number or account.
    const rateLimited = code === PAIR_RATE_CODE ? "chat" : "global";
    return { retryable: true, retryAfterMs: retryAfter ?? regainAccessMs(headers) ?? THROTTLE_CODES.get(code), rateLimited };
  }
  if (code !== undefined && TRANSIENT_CODES.has(code)) return { retryable: true, retryAfterMs: retryAfter };
  if (code !== undefined && PERMANENT_CODES.has(code)) return { retryable: false };
  if (code !== undefined && code >= 132000 && code < 133000) return { retryable: false }; // template errors
  if (code !== undefined && code >= 200 && code < 300) return { retryable: false }; // permissions
  if (status === 429) return { retryable: true, retryAfterMs: retryAfter ?? regainAccessMs(headers), rateLimited: "global" };
  if (status === 408 || status === 425 || status >= 500) return { retryable: true, retryAfterMs: retryAfter };
  return { retryable: false };
}

/** The error for a non-2xx Graph answer, classified. */
export function graphError(response: Response, parsed: unknown, text: string, what: string): WhatsAppApiError {
  const status = response.status;
  const error = isObject(parsed) && isObject(parsed.error) ? parsed.error : undefined;
  const code = typeof error?.code === "number" ? error.code : undefined;
  const subcode = typeof error?.error_subcode === "number" ? error.error_subcode : undefined;
  const type = typeof error?.type === "string" ? error.type : undefined;
  const message = typeof error?.message === "string" ? error.message : undefined;
  const data = isObject(error?.error_data) ? error.error_data : undefined;
  const details = typeof data?.details === "string" ? data.details : undefined;
  const fbtraceId = typeof error?.fbtrace_id === "string" ? error.fbtrace_id : undefined;
  const { retryable, retryAfterMs, rateLimited } = classifyGraphError(status, code, response.headers);
  const head = code !== undefined ? `error ${code}${subcode !== undefined ? `/${subcode}` : ""}` : "error";
  const text2 = error
    ? `${message ?? "no message"}${details !== undefined && details !== message ? ` (${details})` : ""}${
      fbtraceId ? ` [fbtrace_id ${fbtraceId}]` : ""
    }`
    : `not a Graph error body: ${snippet(text)}`;
  return new WhatsAppApiError(`WhatsApp ${what} failed with HTTP ${status}, ${head}: ${text2}`, {
    status,
    code,
    subcode,
    type,
    details,
    fbtraceId,
    retryable,
    retryAfterMs,
    rateLimited,
  });
}

/** Where the Graph API is reached from, and how. */
export interface GraphApiSettings {
  /** The access token (a bearer token on every request). */
  accessToken: string;
  /** The `fetch` to call it with. */
  fetch: typeof fetch;
  /** Timeout of each request, in ms. */
  timeoutMs: number;
}

/** Requests to the Graph API with one access token. */
export class GraphApi {
  readonly #accessToken: string;
  readonly #fetch: (input: string, init?: RequestInit) => Promise<Response>;
  readonly #timeoutMs: number;

  /**
   * Reach the Graph API with one access token.
   *
   * @param settings the token, `fetch` and the timeout
   */
  constructor(settings: GraphApiSettings) {
    this.#accessToken = settings.accessToken;
    const { fetch: call } = settings;
    // Called as a plain function: Workers' fetch throws "Illegal invocation" when called on another object.
    this.#fetch = (input, init) => call(input, init);
    this.#timeoutMs = settings.timeoutMs;
  }

  /**
   * One Graph API request with the bearer token, under the request timeout
   * and `signal`, its answer read as text (up to 4 MiB).
   *
   * @param method the HTTP method
   * @param url the URL
   * @param body a JSON body
   * @param signal aborts the request
   * @param what what is being done, for the errors
   * @returns the answer and its text
   * @throws {ProviderError} on a network error or timeout (retryable), or an answer over 4 MiB (permanent)
   */
  async call(
    method: "GET" | "POST",
    url: string,
    body: string | undefined,
    signal: AbortSignal | undefined,
    what: string,
  ): Promise<{ response: Response; text: string }> {
    const { response, bytes } = await this.fetchBytes(method, url, body, signal, what, 4 * 1024 * 1024);
    return { response, text: decoder.decode(bytes) };
  }

  /**
   * One Graph API request with the bearer token, under the request timeout
   * and `signal`, its answer read up to `maxBytes`.
   *
   * @param method the HTTP method
   * @param url the URL
   * @param body a JSON body
   * @param signal aborts the request
   * @param what what is being done, for the errors
   * @param maxBytes the largest answer read
   * @returns the answer and its bytes
   * @throws {ProviderError} on a network error or timeout (retryable), or an answer over `maxBytes` (permanent)
   */
  async fetchBytes(
    method: "GET" | "POST",
    url: string,
    body: string | undefined,
    signal: AbortSignal | undefined,
    what: string,
    maxBytes: number,
  ): Promise<{ response: Response; bytes: Uint8Array }> {
    const timeout = AbortSignal.timeout(this.#timeoutMs);
    const combined = signal ? anySignal(signal, timeout) : timeout;
    const headers: Record<string, string> = { authorization: `Bearer ${this.#accessToken}` };
    if (body !== undefined) headers["content-type"] = "application/json";
    try {
      const response = await this.#fetch(url, { method, headers, body, signal: combined });
      const bytes = await readCapped(response.body, maxBytes);
      if (bytes === null) {
        throw new ProviderError(`WhatsApp ${what}: the answer is over ${maxBytes} bytes`, {
          retryable: false,
          status: response.status,
        });
      }
      return { response, bytes };
    } catch (error) {
      if (error instanceof ProviderError) throw error;
      if (timeout.aborted) {
        throw new ProviderError(`WhatsApp ${what} timed out after ${this.#timeoutMs} ms (requestTimeoutMs)`, {
          retryable: true,
          maybeDelivered: true, // Meta may have accepted it before the answer was cut off
          cause: error,
        });
      }
      if (signal?.aborted) throw new ProviderError(`WhatsApp ${what} was aborted`, { retryable: true, cause: error });
      throw new ProviderError(`WhatsApp ${what} failed: ${(error as Error)?.message ?? String(error)}`, {
        retryable: true,
        cause: error,
      });
    }
  }
}

/** Aborts when either does (`AbortSignal.any`, or its equivalent on Node before 20.3). */
function anySignal(a: AbortSignal, b: AbortSignal): AbortSignal {
  if (typeof AbortSignal.any === "function") return AbortSignal.any([a, b]);
  const controller = new AbortController();
  const abort = (source: AbortSignal) => () => controller.abort(source.reason);
  if (a.aborted) controller.abort(a.reason);
  else if (b.aborted) controller.abort(b.reason);
  else {
    a.addEventListener("abort", abort(a), { once: true });
    b.addEventListener("abort", abort(b), { once: true });
  }
  return controller.signal;
}
