/**
 * Error classes of the core.
 *
 * @module
 */
import { escapeControls } from "./controls.ts";

/**
 * Marks an error as the death of the process (the crash harness throws one).
 * The engine stops all work at once when it sees one, as a killed process would.
 */
export const PROCESS_DEATH: unique symbol = Symbol.for("@botmesh/durable.processDeath");

/** Whether `error` is a simulated process death. */
export function isProcessDeath(error: unknown): boolean {
  return typeof error === "object" && error !== null && (error as Record<symbol, unknown>)[PROCESS_DEATH] === true;
}

/** Options of a {@link ProviderError}. */
export interface ProviderErrorOptions {
  /** Whether sending again may succeed (network, 5xx, 429). Default `true`. */
  retryable?: boolean;
  /** Do not retry before this many ms (a channel's Retry-After). */
  retryAfterMs?: number;
  /** The channel's HTTP status, when there is one. */
  status?: number;
  /**
   * The request may have reached the channel and been delivered (it timed out after it was sent).
   * Such a send is ambiguous: held as `unknown` and reported (or sent again with
   * `onAmbiguous: 'resend'`), never retried silently. Default `false`.
   */
  maybeDelivered?: boolean;
  /**
   * The channel refused the send for its rate limit (nothing was sent): it waits `retryAfterMs`
   * without spending an attempt. `chat`: only its chat waits (later sends of the chat wait behind it);
   * `global`: every chat of the bot waits. Default `chat` for status 429, none otherwise.
   */
  rateLimited?: "chat" | "global";
  cause?: unknown;
}

/**
 * An error a provider throws from `send` to say whether it may be retried.
 *
 * @example
 * ```ts
 * import { ProviderError } from "@botmesh/durable";
 * throw new ProviderError("Recipient blocked the bot", { retryable: false, status: 403 });
 * ```
 */
export class ProviderError extends Error {
  readonly retryable: boolean;
  readonly retryAfterMs: number | undefined;
  readonly status: number | undefined;
  /** Whether the request may have been delivered before it failed (see {@link ProviderErrorOptions.maybeDelivered}). */
  readonly maybeDelivered: boolean;
  /** Refused for the channel's rate limit, and for whom (see {@link ProviderErrorOptions.rateLimited}). */
  readonly rateLimited: "chat" | "global" | undefined;
  constructor(message: string, options: ProviderErrorOptions = {}) {
    super(message, options.cause === undefined ? undefined : { cause: options.cause });
    this.name = "ProviderError";
    this.status = options.status;
    this.retryable = options.retryable ?? (options.status === undefined ? true : isRetryableStatus(options.status));
    this.retryAfterMs = options.retryAfterMs;
    this.maybeDelivered = options.maybeDelivered === true;
    this.rateLimited = options.rateLimited ?? (options.status === 429 ? "chat" : undefined);
  }
}

/** Whether an HTTP status means "try again later": 408, 425, 429 and 5xx. */
export function isRetryableStatus(status: number): boolean {
  return status === 408 || status === 425 || status === 429 || status >= 500;
}

/**
 * The message of a thrown value: `error.message` for an `Error`, else the value as text.
 *
 * @param error what was thrown
 * @returns its message
 */
export function errorMessage(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

/** Text of an error for a journal (`name: message`, bounded). */
export function errorText(error: unknown): string {
  let text: string;
  if (error instanceof Error) text = `${error.name}: ${error.message}`;
  else {
    try {
      text = typeof error === "string" ? error : JSON.stringify(error) ?? String(error);
    } catch {
      text = String(error);
    }
  }
  return text.length > 2000 ? `${text.slice(0, 2000)}…` : text;
}

/**
 * What the library prints for an error that nobody handles (no `error`
 * listener, no `onError`): `prefix`, then the error as {@link errorDetail}
 * gives it, with every control, format or separator character but the
 * newline as a `\u` escape. The text comes partly from the bot's users and
 * lands in a terminal (`docker logs -f`); the error itself stays as it is.
 *
 * @param prefix what prints first (`[@botmesh/durable] …:`)
 * @param error what failed
 * @returns the text to print
 */
export function errorLogText(prefix: string, error: unknown): string {
  return escapeControls(`${prefix} ${errorDetail(error)}`, true);
}

/** How much of a stack a journaled handler error keeps (frames). */
export const STACK_FRAMES = 12;
/** What starts each cause's line in {@link errorDetail}'s text. */
const CAUSE_PREFIX = "Caused by: ";
/** A stack frame: V8's `at fn (file:1:2)`, or `fn@file:1:2`; journaled indented. */
const FRAME = /^\s*(at\s|[^\s:]*@)/;

/**
 * Text of a handler's error for the inbound journal, where an operator reads
 * it (console, CLI): `name: message`, then each `cause` as `Caused by: name:
 * message`, then the first frames of the stack. Bounded to 4,000 characters.
 *
 * @param error what the handler threw
 * @returns the text
 */
export function errorDetail(error: unknown): string {
  if (!(error instanceof Error)) return errorText(error);
  const lines = [errorText(error)];
  const seen = new Set<unknown>([error]);
  let cause: unknown = error.cause;
  while (cause !== undefined && cause !== null && !seen.has(cause) && seen.size < 6) {
    seen.add(cause);
    // A cause that is not an Error (a response object, a config) may hold credentials: its type only.
    const known = cause instanceof Error || typeof cause === "string";
    lines.push(`${CAUSE_PREFIX}${known ? errorText(cause) : `a value of type ${Array.isArray(cause) ? "array" : typeof cause}`}`);
    cause = cause instanceof Error ? cause.cause : undefined;
  }
  // The stack's first line repeats the message; its frames follow (indented in V8, not in Firefox).
  const frames = typeof error.stack === "string" ? error.stack.split("\n").slice(1).filter((line) => FRAME.test(line)) : [];
  for (const frame of frames.slice(0, STACK_FRAMES)) lines.push(`    ${frame.trim()}`);
  const text = lines.join("\n");
  return text.length > 4000 ? `${text.slice(0, 4000)}…` : text;
}

/** A journaled error split in its parts (see {@link errorParts}). */
export interface ErrorParts {
  /** The message (its lines). */
  head: string[];
  /** Each cause, without its `Caused by:` (a cause's continuation lines appended to it). */
  causes: string[];
  /** The stack frames, trimmed. */
  stack: string[];
}

/**
 * Splits an error journaled by {@link errorDetail} into its message, its causes and its stack
 * frames (indented lines that read as frames).
 *
 * @param text the error as journaled
 * @returns its parts
 */
export function errorParts(text: string): ErrorParts {
  const parts: ErrorParts = { head: [], causes: [], stack: [] };
  for (const line of text.split("\n")) {
    if (line.startsWith(CAUSE_PREFIX)) parts.causes.push(line.slice(CAUSE_PREFIX.length));
    else if (/^\s/.test(line) && FRAME.test(line)) parts.stack.push(line.trim());
    else if (parts.causes.length > 0) parts.causes[parts.causes.length - 1] += `\n${line}`;
    else parts.head.push(line);
  }
  return parts;
}
