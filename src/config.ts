/**
 * Durability options: their defaults and their validation. A bad value throws a
 * `TypeError` (wrong type, unknown option) or `RangeError` (out of range) whose
 * message names the option and quotes the value.
 *
 * @module
 */
import { checkKnownOptions } from "./options.ts";
import { showValue as show } from "./show.ts";
import { type DurabilityBackend, INBOX_JOURNAL_METHODS, OUTBOX_JOURNAL_METHODS } from "./contract.ts";
import { isTracer, type TracerLike } from "./tracing.ts";
import { checkRateLimitOption, type RateLimitOptions } from "./rate_limit.ts";

/** Exponential backoff with full jitter: a retry waits `random(0, min(capMs, baseMs * 2^attempt))`. */
export interface BackoffOptions {
  baseMs?: number;
  capMs?: number;
}

/** Inbox options. */
export interface InboxOptions {
  /** Lease on a record being processed (default 60 000). */
  leaseMs?: number;
  /** Handler retries before the record is dead (default 3). */
  retries?: number;
  /** Backoff between handler retries (default `{ baseMs: 1000, capMs: 60_000 }`). */
  backoff?: BackoffOptions;
  /**
   * An admission the journal has not confirmed within this time is answered
   * `rejected`, so the channel delivers the message again instead of a
   * webhook waiting forever on a stuck connection (default 10 000). If the
   * write lands after all, the redelivery finds it, or a sweep takes it once
   * its lease lapses.
   */
  admitTimeoutMs?: number;
}

/** Outbox options. */
export interface OutboxOptions {
  /** Retries of a failed send before it is dead (default 5). */
  retries?: number;
  /** Backoff between send retries (default `{ baseMs: 1000, capMs: 60_000 }`). */
  backoff?: BackoffOptions;
  /** Lease on a send in flight (default 60 000, at least 20). */
  leaseMs?: number;
  /** Content larger than this bypasses the outbox (default 1 MiB). */
  maxPayloadBytes?: number;
  /** What to do with a send whose sender died mid-call (default `'hold'`). */
  onAmbiguous?: "hold" | "resend";
  /**
   * Outbound rate limits (default: the provider's `rateLimits`, in this process): sends wait in the
   * outbox for them. `false` turns them off; see docs/rate-limits.md.
   */
  rateLimit?: RateLimitOptions | false;
}

/** The `durability` option of `Bot`. */
export interface DurabilityOptions {
  /** Where the journals live. Required. */
  backend: DurabilityBackend;
  /** Stable across restarts, unique per running replica (see the README). */
  instanceId?: string;
  /** How long `done`/`sent` records are kept: ms or a duration such as `'7d'` (default `'7d'`). */
  retention?: number | string;
  /** Dispatch an inbound message even when the journal cannot record it (default `false`). */
  failOpen?: boolean;
  inbox?: InboxOptions;
  outbox?: OutboxOptions;
  /**
   * How often to look for due and abandoned work (default derived from the lease times). `0`: no
   * sweep timer and no retry timers; due work waits in the journal until `bot.sweep()` is called (a
   * cron trigger on serverless platforms, see docs/serverless.md).
   */
  sweepIntervalMs?: number;
  /**
   * An OpenTelemetry tracer (`trace.getTracer("my-bot")` of `@opentelemetry/api`): spans
   * `botmesh.admit`, `botmesh.handle` and `botmesh.send`, in the trace of the inbound message.
   * Without it, no span is made and nothing of OpenTelemetry is loaded.
   */
  tracer?: TracerLike;
}

/** Backoff with defaults applied. */
export interface ResolvedBackoff {
  baseMs: number;
  capMs: number;
}

/** Durability options with defaults applied. */
export interface ResolvedDurability {
  backend: DurabilityBackend;
  instanceId: string | undefined;
  retentionMs: number;
  failOpen: boolean;
  inbox: { leaseMs: number; retries: number; backoff: ResolvedBackoff; admitTimeoutMs: number };
  outbox: {
    retries: number;
    backoff: ResolvedBackoff;
    leaseMs: number;
    maxPayloadBytes: number;
    onAmbiguous: "hold" | "resend";
    /** `false`: off; otherwise the overrides of the provider's limits. */
    rateLimit: RateLimitOptions | false;
  };
  /** `0`: sweeps and retries run only when `bot.sweep()` is called. */
  sweepIntervalMs: number;
  tracer: TracerLike | null;
}

const UNITS: Record<string, number> = { ms: 1, s: 1000, m: 60_000, h: 3_600_000, d: 86_400_000, w: 604_800_000 };

/**
 * Parse a duration: a number of ms, or a string such as `'500ms'`, `'30s'`,
 * `'15m'`, `'12h'`, `'7d'`, `'2w'`.
 *
 * @param value the duration
 * @param option the option's name, for the error
 * @returns milliseconds
 * @throws {TypeError} when it is neither
 * @throws {RangeError} when it is negative or not finite
 * @example
 * ```ts
 * import { parseDuration } from "@botmesh/durable";
 * parseDuration("7d", "retention"); // 604800000
 * ```
 */
export function parseDuration(value: unknown, option: string): number {
  if (typeof value === "number") {
    if (!Number.isFinite(value) || value < 0) {
      throw new RangeError(`Option "${option}" must be a non-negative finite number of ms, got ${show(value)}`);
    }
    return value;
  }
  if (typeof value === "string") {
    const match = /^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)\s*$/.exec(value);
    if (!match) {
      throw new TypeError(
        `Option "${option}" must be a number of ms or a duration such as "30s", "15m", "12h", "7d", got ${show(value)}`,
      );
    }
    return Math.round(Number(match[1]) * UNITS[match[2]!]!);
  }
  throw new TypeError(`Option "${option}" must be a number of ms or a duration string, got ${show(value)}`);
}

function checkKeys(value: unknown, option: string, allowed: readonly string[]): Record<string, unknown> {
  if (typeof value !== "object" || value === null || Array.isArray(value)) {
    throw new TypeError(`Option "${option}" must be an object, got ${show(value)}`);
  }
  checkKnownOptions(value, allowed, "option", option);
  return value as Record<string, unknown>;
}

/** setTimeout's largest delay: longer timer options would fire at once. */
const MAX_TIMER_MS = 2_147_483_647;

function integer(value: unknown, option: string, fallback: number, min: number, max = Number.MAX_SAFE_INTEGER): number {
  if (value === undefined) return fallback;
  if (typeof value !== "number" || !Number.isInteger(value)) {
    throw new TypeError(`Option "${option}" must be an integer, got ${show(value)}`);
  }
  if (value < min || value > max) {
    const range = max === Number.MAX_SAFE_INTEGER ? `at least ${min}` : `between ${min} and ${max}`;
    throw new RangeError(`Option "${option}" must be ${range}, got ${show(value)}`);
  }
  return value;
}

function backoff(value: unknown, option: string): ResolvedBackoff {
  if (value === undefined) return { baseMs: 1000, capMs: 60_000 };
  const raw = checkKeys(value, option, ["baseMs", "capMs"]);
  const baseMs = integer(raw.baseMs, `${option}.baseMs`, 1000, 0, MAX_TIMER_MS);
  const capMs = integer(raw.capMs, `${option}.capMs`, Math.max(60_000, baseMs), 0, MAX_TIMER_MS);
  if (capMs < baseMs) {
    throw new RangeError(`Option "${option}.capMs" must be at least baseMs (${baseMs}), got ${capMs}`);
  }
  return { baseMs, capMs };
}

function isBackend(value: unknown): value is DurabilityBackend {
  if (typeof value !== "object" || value === null) return false;
  const b = value as Partial<DurabilityBackend>;
  return typeof b.inbox === "object" && b.inbox !== null && typeof b.outbox === "object" && b.outbox !== null;
}

/** The first journal method a backend lacks (`outbox.markCalling`, …), or `null`. */
function missingJournalMethod(b: DurabilityBackend): string | null {
  for (const name of INBOX_JOURNAL_METHODS) if (typeof (b.inbox as unknown as Record<string, unknown>)[name] !== "function") return `inbox.${name}`;
  for (const name of OUTBOX_JOURNAL_METHODS) if (typeof (b.outbox as unknown as Record<string, unknown>)[name] !== "function") return `outbox.${name}`;
  return null;
}

/**
 * Validate `durability` options and apply the defaults.
 *
 * @param value the `durability` option given to `Bot`
 * @returns the resolved options
 * @throws {TypeError} for a missing backend, an unknown option or a wrong type
 * @throws {RangeError} for a value out of range
 */
export function resolveDurability(value: unknown): ResolvedDurability {
  const raw = checkKeys(value, "durability", [
    "backend",
    "instanceId",
    "retention",
    "failOpen",
    "inbox",
    "outbox",
    "sweepIntervalMs",
    "tracer",
  ]);
  if (raw.backend === undefined) {
    throw new TypeError(`Option "durability.backend" is required when "durability" is given`);
  }
  if (!isBackend(raw.backend)) {
    throw new TypeError(
      `Option "durability.backend" must be a durability backend (with inbox and outbox journals), got ${show(raw.backend)}`,
    );
  }
  const missing = missingJournalMethod(raw.backend);
  if (missing !== null) {
    const name = typeof raw.backend.name === "string" ? ` "${raw.backend.name}"` : "";
    throw new TypeError(
      `Option "durability.backend": backend${name} has no method "${missing}" (a backend written for an older contract? see DurabilityBackend)`,
    );
  }
  let instanceId: string | undefined;
  if (raw.instanceId !== undefined) {
    if (typeof raw.instanceId !== "string" || raw.instanceId.trim() === "" || raw.instanceId.length > 200) {
      throw new TypeError(
        `Option "durability.instanceId" must be a non-empty string of at most 200 characters, got ${show(raw.instanceId)}`,
      );
    }
    instanceId = raw.instanceId;
  }
  const retentionMs = raw.retention === undefined ? 7 * UNITS.d! : parseDuration(raw.retention, "durability.retention");
  if (raw.failOpen !== undefined && typeof raw.failOpen !== "boolean") {
    throw new TypeError(`Option "durability.failOpen" must be a boolean, got ${show(raw.failOpen)}`);
  }
  const inboxRaw = raw.inbox === undefined ? {} : checkKeys(raw.inbox, "durability.inbox", ["leaseMs", "retries", "backoff", "admitTimeoutMs"]);
  const outboxRaw = raw.outbox === undefined ? {} : checkKeys(raw.outbox, "durability.outbox", [
    "retries",
    "backoff",
    "leaseMs",
    "maxPayloadBytes",
    "onAmbiguous",
    "rateLimit",
  ]);
  const inbox = {
    leaseMs: integer(inboxRaw.leaseMs, "durability.inbox.leaseMs", 60_000, 20, MAX_TIMER_MS),
    retries: integer(inboxRaw.retries, "durability.inbox.retries", 3, 0, 1000),
    backoff: backoff(inboxRaw.backoff, "durability.inbox.backoff"),
    admitTimeoutMs: integer(inboxRaw.admitTimeoutMs, "durability.inbox.admitTimeoutMs", 10_000, 1, MAX_TIMER_MS),
  };
  const onAmbiguous = outboxRaw.onAmbiguous ?? "hold";
  if (onAmbiguous !== "hold" && onAmbiguous !== "resend") {
    throw new TypeError(`Option "durability.outbox.onAmbiguous" must be "hold" or "resend", got ${show(onAmbiguous)}`);
  }
  const outbox = {
    retries: integer(outboxRaw.retries, "durability.outbox.retries", 5, 0, 1000),
    backoff: backoff(outboxRaw.backoff, "durability.outbox.backoff"),
    leaseMs: integer(outboxRaw.leaseMs, "durability.outbox.leaseMs", 60_000, 20, MAX_TIMER_MS),
    maxPayloadBytes: integer(outboxRaw.maxPayloadBytes, "durability.outbox.maxPayloadBytes", 1024 * 1024, 1),
    onAmbiguous: onAmbiguous as "hold" | "resend",
    rateLimit: checkRateLimitOption(outboxRaw.rateLimit, "durability.outbox.rateLimit"),
  };
  const derivedSweep = Math.max(10, Math.min(5000, Math.floor(Math.min(inbox.leaseMs, outbox.leaseMs) / 2)));
  if (raw.sweepIntervalMs !== undefined && typeof raw.sweepIntervalMs === "number" && raw.sweepIntervalMs < 0) {
    throw new RangeError(
      `Option "durability.sweepIntervalMs" must be 0 (no timers: sweep only when bot.sweep() is called) or a positive interval, got ${show(raw.sweepIntervalMs)}`,
    );
  }
  const sweepIntervalMs = integer(raw.sweepIntervalMs, "durability.sweepIntervalMs", derivedSweep, 0, MAX_TIMER_MS);
  if (raw.tracer !== undefined && !isTracer(raw.tracer)) {
    throw new TypeError(
      `Option "durability.tracer" must be an OpenTelemetry tracer (with startSpan and startActiveSpan), got ${show(raw.tracer)}`,
    );
  }
  return {
    backend: raw.backend,
    instanceId,
    retentionMs,
    failOpen: raw.failOpen === true,
    inbox,
    outbox,
    sweepIntervalMs,
    tracer: (raw.tracer as TracerLike | undefined) ?? null,
  };
}
