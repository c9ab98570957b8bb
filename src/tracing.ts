/**
 * The part of an OpenTelemetry `Tracer` the bot uses, typed structurally so
 * that the core never imports `@opentelemetry/api`: pass
 * `trace.getTracer("my-bot")` as `durability.tracer` and the bot makes spans;
 * without it, nothing of this runs.
 *
 * A span parent is handed to the tracer as a context holding a span under the
 * API's span key, `Symbol.for("OpenTelemetry Context Key SPAN")`: the API
 * creates its context keys with `Symbol.for` so that copies of the API
 * interoperate, which is what lets this file work without it.
 *
 * @module
 */

/** The ids of a span, as `span.spanContext()` gives them. */
export interface SpanContextLike {
  traceId: string;
  spanId: string;
  traceFlags: number;
  isRemote?: boolean;
}

/** The methods of an OpenTelemetry `Span` the bot calls. */
export interface SpanLike {
  spanContext(): SpanContextLike;
  setAttribute(key: string, value: string | number | boolean): unknown;
  setStatus(status: { code: number; message?: string }): unknown;
  recordException(exception: Error | string): unknown;
  end(): void;
}

/** An OpenTelemetry `Context` (immutable key-value map). */
export interface ContextLike {
  getValue(key: symbol): unknown;
  setValue(key: symbol, value: unknown): ContextLike;
  deleteValue(key: symbol): ContextLike;
}

/** Options of `startSpan` the bot sets. */
export interface SpanOptionsLike {
  kind?: number;
  attributes?: Record<string, string | number | boolean>;
}

/**
 * What `durability.tracer` must be: an OpenTelemetry `Tracer` (`trace.getTracer(name)` of
 * `@opentelemetry/api` 1.x) or anything with the same two methods.
 */
export interface TracerLike {
  startSpan(name: string, options?: SpanOptionsLike, context?: ContextLike): SpanLike;
  startActiveSpan<F extends (span: SpanLike) => unknown>(
    name: string,
    options: SpanOptionsLike,
    context: ContextLike,
    fn: F,
  ): ReturnType<F>;
  startActiveSpan<F extends (span: SpanLike) => unknown>(name: string, options: SpanOptionsLike, fn: F): ReturnType<F>;
}

/** OpenTelemetry `SpanKind` values. */
export const SPAN_KIND = { internal: 0, server: 1, client: 2, producer: 3, consumer: 4 } as const;
/** OpenTelemetry `SpanStatusCode.ERROR`. */
export const STATUS_ERROR = 2;

const SPAN_KEY = Symbol.for("OpenTelemetry Context Key SPAN");

/** A context of this file's own making: what the API's `ROOT_CONTEXT` is, without the API. */
class BareContext implements ContextLike {
  readonly #values: Map<symbol, unknown>;

  constructor(values: Map<symbol, unknown> = new Map()) {
    this.#values = values;
  }

  getValue(key: symbol): unknown {
    return this.#values.get(key);
  }

  setValue(key: symbol, value: unknown): ContextLike {
    return new BareContext(new Map(this.#values).set(key, value));
  }

  deleteValue(key: symbol): ContextLike {
    const values = new Map(this.#values);
    values.delete(key);
    return new BareContext(values);
  }
}

/** An empty context: a span started in it is a root span. */
const EMPTY_CONTEXT: ContextLike = new BareContext();

/** The stand-in the API puts in a context for a parent known only by its ids (a `NonRecordingSpan`). */
function parentSpan(ids: SpanContextLike): SpanLike & { isRecording(): boolean } {
  const span = {
    spanContext: () => ids,
    isRecording: () => false,
    setAttribute: () => span,
    setAttributes: () => span,
    addEvent: () => span,
    addLink: () => span,
    addLinks: () => span,
    setStatus: () => span,
    updateName: () => span,
    recordException: () => {},
    end: () => {},
  };
  return span;
}

/**
 * @param ids the parent span's ids
 * @returns a context whose span is that parent (spans started in it are its children)
 */
export function contextWithParent(ids: SpanContextLike): ContextLike {
  return EMPTY_CONTEXT.setValue(SPAN_KEY, parentSpan(ids));
}

const TRACEPARENT = /^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$/;

/**
 * @param ids a span's ids
 * @returns its W3C `traceparent` header value (version 00)
 */
export function formatTraceparent(ids: SpanContextLike): string {
  return `00-${ids.traceId}-${ids.spanId}-${(ids.traceFlags & 0xff).toString(16).padStart(2, "0")}`;
}

/**
 * @param value a W3C `traceparent` value
 * @returns the remote span's ids, or `null` when `value` is not a valid version-00 traceparent
 */
export function parseTraceparent(value: unknown): SpanContextLike | null {
  if (typeof value !== "string") return null;
  const m = TRACEPARENT.exec(value);
  if (!m || /^0+$/.test(m[1]!) || /^0+$/.test(m[2]!)) return null;
  return { traceId: m[1]!, spanId: m[2]!, traceFlags: parseInt(m[3]!, 16), isRemote: true };
}

/**
 * @param value a candidate for `durability.tracer`
 * @returns whether it has the methods of a {@link TracerLike}
 */
export function isTracer(value: unknown): value is TracerLike {
  if (typeof value !== "object" || value === null) return false;
  const t = value as Record<string, unknown>;
  return typeof t.startSpan === "function" && typeof t.startActiveSpan === "function";
}
