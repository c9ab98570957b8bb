/**
 * What the engine measures and traces: the duration histograms of
 * `bot.durability.histograms()`, and, with `durability.tracer`, the spans
 * `botmesh.admit` → `botmesh.handle` → `botmesh.send`.
 *
 * The admit span's `traceparent` is journaled with the inbound record (the
 * payload's `$trace` field: a message's own keys starting with `$` are
 * escaped, so it never collides), so the handler of a record taken up again
 * (a retry, a restart, another replica) runs in the same trace.
 *
 * @module
 */
import type { Clock } from "./clock.ts";
import type { InboundRecord, JsonValue } from "./contract.ts";
import { BoundedMap } from "./bounded_map.ts";
import { type DurabilityHistograms, emptyHistograms } from "./histogram.ts";
import type { InboundMessage } from "./provider.ts";
import {
  type ContextLike,
  contextWithParent,
  formatTraceparent,
  parseTraceparent,
  SPAN_KIND,
  type SpanContextLike,
  type SpanLike,
  type SpanOptionsLike,
  STATUS_ERROR,
  type TracerLike,
} from "./tracing.ts";

/** The inbound payload field that carries the admission's `traceparent`. */
export const TRACE_FIELD = "$trace";

/** Inbound messages whose receipt time and handle span this process remembers. */
const REMEMBERED_INBOUND = 10_000;

/** What the engine knows of a provider call it is about to make. */
export interface ProviderCall {
  key: string;
  chatId: string;
  attempt: number;
  /** The inbound record the send answers, if any. */
  inboundId: string | null;
  /** The outbox entry's `createdAt`, for a journaled send. */
  createdAt?: number;
}

/**
 * @param payload an inbound record's payload
 * @returns the `traceparent` journaled with it, if any
 */
function traceOf(payload: JsonValue): string | undefined {
  if (typeof payload !== "object" || payload === null || Array.isArray(payload)) return undefined;
  const value = payload[TRACE_FIELD];
  return typeof value === "string" ? value : undefined;
}

/**
 * The payload without the journaled trace field, before it is decoded: a message's own `$trace`
 * field is journaled escaped (`$$trace`), so it is kept.
 *
 * @param payload an inbound record's payload, as journaled
 * @returns the payload without the trace field
 */
export function withoutTrace(payload: JsonValue): JsonValue {
  if (typeof payload !== "object" || payload === null || Array.isArray(payload) || !(TRACE_FIELD in payload)) return payload;
  const copy = { ...payload };
  delete copy[TRACE_FIELD];
  return copy;
}

/** The engine's histograms and spans. */
export class Observer {
  readonly #clock: Clock;
  readonly #tracer: TracerLike | null;
  readonly #histograms = emptyHistograms();
  readonly #inbound = new BoundedMap<string, { receivedAt: number; span: SpanContextLike | null }>(REMEMBERED_INBOUND);

  /**
   * @param clock the engine's clock
   * @param tracer spans go there; `null` for none
   */
  constructor(clock: Clock, tracer: TracerLike | null) {
    this.#clock = clock;
    this.#tracer = tracer;
  }

  /** @returns a snapshot of the histograms */
  histograms(): DurabilityHistograms {
    const h = this.#histograms;
    return {
      replyLatency: h.replyLatency.snapshot(),
      providerCall: h.providerCall.snapshot(),
      outboxQueued: h.outboxQueued.snapshot(),
    };
  }

  /**
   * Run an admission in a `botmesh.admit` span (a child of the caller's active span).
   * @param message the inbound message
   * @param run the admission, given the `traceparent` to journal (undefined without a tracer)
   * @returns what `run` returns
   */
  admit<T extends { status: string }>(message: InboundMessage, run: (traceparent?: string) => Promise<T>): Promise<T> {
    const tracer = this.#tracer;
    if (tracer === null) return run();
    const options: SpanOptionsLike = {
      kind: SPAN_KIND.consumer,
      attributes: { "botmesh.message_id": message.id, "botmesh.chat_id": message.chatId },
    };
    return tracer.startActiveSpan("botmesh.admit", options, (span: SpanLike) =>
      ended(span, run(formatTraceparent(span.spanContext())), (result) => {
        span.setAttribute("botmesh.admit.status", result.status);
        if (result.status === "rejected") span.setStatus({ code: STATUS_ERROR, message: "rejected" });
      }));
  }

  /**
   * Run a handler in a `botmesh.handle` span, a child of the record's admission span, and remember
   * when the record was received (for the reply latency).
   * @param message the message handled
   * @param record its inbound record (`null` when it was not journaled)
   * @param run the handler
   * @returns what `run` returns
   */
  handle<T>(message: InboundMessage, record: InboundRecord | null, run: () => Promise<T>): Promise<T> {
    const remembered = { receivedAt: record?.receivedAt ?? this.#clock.now(), span: null as SpanContextLike | null };
    this.#inbound.set(message.id, remembered);
    const tracer = this.#tracer;
    if (tracer === null) return run();
    const options: SpanOptionsLike = {
      kind: SPAN_KIND.internal,
      attributes: {
        "botmesh.message_id": message.id,
        "botmesh.chat_id": message.chatId,
        "botmesh.attempt": record?.attempts ?? 1,
      },
    };
    const fn = (span: SpanLike) => {
      remembered.span = span.spanContext();
      return ended(span, run());
    };
    const parent = record === null ? null : parseTraceparent(traceOf(record.payload));
    return parent === null
      ? tracer.startActiveSpan("botmesh.handle", options, fn)
      : tracer.startActiveSpan("botmesh.handle", options, contextWithParent(parent), fn);
  }

  /**
   * Make a provider call: its duration, the outbox entry's time queued before its first call, and a
   * `botmesh.send` span, a child of the handle span of the message it answers.
   * @param call what is sent
   * @param run the provider call
   * @returns what `run` returns
   */
  providerCall<T>(call: ProviderCall, run: () => Promise<T>): Promise<T> {
    const clock = this.#clock;
    const h = this.#histograms;
    if (call.createdAt !== undefined && call.attempt === 1) h.outboxQueued.observe((clock.now() - call.createdAt) / 1000);
    const started = clock.monotonic();
    // A provider that throws instead of rejecting still gives a rejected promise.
    const timed = (): Promise<T> =>
      new Promise<T>((resolve) => resolve(run())).finally(() => h.providerCall.observe((clock.monotonic() - started) / 1000));
    const tracer = this.#tracer;
    if (tracer === null) return timed();
    const options: SpanOptionsLike = {
      kind: SPAN_KIND.client,
      attributes: { "botmesh.idempotency_key": call.key, "botmesh.chat_id": call.chatId, "botmesh.attempt": call.attempt },
    };
    if (call.inboundId !== null) options.attributes!["botmesh.inbound_id"] = call.inboundId;
    const parent = call.inboundId === null ? null : this.#inbound.get(call.inboundId)?.span ?? null;
    const fn = (span: SpanLike) => ended(span, timed());
    return parent === null
      ? tracer.startActiveSpan("botmesh.send", options, fn)
      : tracer.startActiveSpan("botmesh.send", options, contextWithParent(parent), fn);
  }

  /**
   * A reply was recorded as sent: observe the time since its inbound message was received, when this
   * process handled that message.
   * @param inboundId the inbound record the send answers
   */
  replySent(inboundId: string | null): void {
    if (inboundId === null) return;
    const inbound = this.#inbound.get(inboundId);
    if (inbound !== undefined) this.#histograms.replyLatency.observe((this.#clock.now() - inbound.receivedAt) / 1000);
  }
}

/** Ends `span` once `work` settles: an error status for a rejection, `onResult` for a result. */
async function ended<T>(span: SpanLike, work: Promise<T>, onResult?: (result: T) => void): Promise<T> {
  try {
    const result = await work;
    onResult?.(result);
    return result;
  } catch (error) {
    span.recordException(error instanceof Error ? error : String(error));
    span.setStatus({ code: STATUS_ERROR, message: error instanceof Error ? error.message : String(error) });
    throw error;
  } finally {
    span.end();
  }
}
