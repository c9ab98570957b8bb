/**
 * The operator surface, `bot.durability`: the journals to read, replays and retries (each wakes the
 * sweeper), an `unknown` send marked delivered, the counters and histograms, the damaged records.
 *
 * @module
 */
import { stepOf, stepResultText } from "./steps.ts";
import type { DurabilityBackend, OutboxEntry, OutboxState } from "../contract.ts";
import type { DurabilityHistograms } from "../histogram.ts";
import { type DurabilityControl, type DurabilityMetrics, listDamaged } from "./types.ts";

/** What the operator surface needs from the engine. */
export interface ControlHost {
  backend: DurabilityBackend;
  instanceId(): string;
  /** An inbound record was made pending again: counted, forgotten as a duplicate, swept for. */
  replayed(id: string): void;
  /** An outbox entry was queued again: swept for. */
  requeued(): void;
  /** Record an `unknown` entry as sent on an operator's word. */
  resolveSent(entry: OutboxEntry, messageId: string): Promise<"resolved" | OutboxState | "gone">;
  metrics(): DurabilityMetrics;
  histograms(): DurabilityHistograms;
}

/**
 * The operator surface over an engine.
 * @param h what it needs from the engine
 * @returns `bot.durability`
 */
export function operatorControl(h: ControlHost): DurabilityControl {
  const { backend } = h;
  return {
    get instanceId() {
      return h.instanceId();
    },
    inbox: {
      list: (options) => backend.inbox.list(options),
      get: (id) => backend.inbox.get(id),
    },
    outbox: {
      list: (options) => backend.outbox.list(options),
      get: (key) => backend.outbox.get(key),
      discard: (key) => backend.outbox.discard(key),
    },
    replayInbound: async (id) => {
      const replayed = await backend.inbox.replay(id);
      if (replayed) h.replayed(id);
      return replayed;
    },
    retrySend: async (key) => {
      const requeued = await backend.outbox.retry(key);
      if (requeued) h.requeued();
      return requeued;
    },
    markDelivered: async (key, messageId = "") => {
      if (typeof messageId !== "string") {
        throw new TypeError(`Argument "messageId" of markDelivered() must be a string, got ${JSON.stringify(messageId) ?? typeof messageId}`);
      }
      const entry = await backend.outbox.get(key);
      if (entry === null || entry.state !== "unknown") return false;
      // A step's attempt: `messageId` is the step's result as JSON ("": none, the step returns undefined).
      const recorded = stepOf(entry) === undefined ? messageId : stepResultText(messageId, key);
      return await h.resolveSent(entry, recorded) === "resolved";
    },
    metrics: () => h.metrics(),
    histograms: () => h.histograms(),
    damaged: (options) => listDamaged(backend, options),
  };
}
