/**
 * What the operations console does to the journals, over a bot (through
 * `bot.durability`, so metrics and events stay right and the worker wakes at
 * once) or over a bare backend (opened at the console's first request).
 *
 * @module
 */
import type {
  DamagedRecord,
  DurabilityBackend,
  InboundRecord,
  InboundState,
  ListOptions,
  OutboxEntry,
  OutboxState,
} from "../contract.ts";
import { type DurabilityControl, type DurabilityMetrics, listDamaged } from "../engine.ts";
import { errorMessage } from "../errors.ts";
import { markDeliveredInJournal } from "./mark_delivered.ts";
import { isObject } from "./console_render.ts";

/** The part of a `Bot` the console uses: its operator surface. */
export interface ConsoleBot {
  /** `bot.durability`: `undefined` when the bot has no durability configured. */
  readonly durability: DurabilityControl | undefined;
}

/** What the console operates on: a bot (actions go through `bot.durability`) or a bare backend. */
export type ConsoleTarget = ConsoleBot | DurabilityBackend;

/** The backend could not be opened: the console answers 503 and says why. */
export class BackendUnavailableError extends Error {
  override name = "BackendUnavailableError";
}

/** The operations the console needs, over a bot or a backend. */
export interface ConsoleOps {
  inboxList(options: ListOptions<InboundState>): Promise<InboundRecord[]>;
  inboxGet(id: string): Promise<InboundRecord | null>;
  outboxList(options: ListOptions<OutboxState>): Promise<OutboxEntry[]>;
  outboxGet(key: string): Promise<OutboxEntry | null>;
  replay(id: string): Promise<boolean>;
  retry(key: string): Promise<boolean>;
  discard(key: string): Promise<boolean>;
  /** An `unknown` send recorded as delivered, without a new call. */
  markDelivered(key: string, messageId: string): Promise<boolean>;
  damaged(options: { limit: number }): Promise<DamagedRecord[]>;
  /** This process's counters (a bot only). */
  metrics?: () => DurabilityMetrics;
  /** Undo the console's own `open()` of a bare backend (nothing for a bot). */
  close(): Promise<void>;
}

/**
 * The console's operations on `target`.
 * @param target a bot with durability, or a bare backend
 * @param openBackend whether to open a bare backend before its first use
 * @returns the operations
 * @throws {TypeError} when `target` is neither
 */
export function opsOf(target: unknown, openBackend: boolean): ConsoleOps {
  if (!isObject(target)) {
    throw new TypeError(`Argument "target" must be a Bot or a DurabilityBackend, got ${target === null ? "null" : typeof target}`);
  }
  if ("durability" in target) {
    const bot = target as unknown as ConsoleBot;
    if (!isObject(bot.durability)) {
      throw new TypeError(`Argument "target" is a Bot without durability: configure its "durability" option`);
    }
    const d = (): DurabilityControl => {
      const control = bot.durability;
      if (!control) throw new Error("The bot has no durability");
      return control;
    };
    return {
      inboxList: (o) => d().inbox.list(o),
      inboxGet: (id) => d().inbox.get(id),
      outboxList: (o) => d().outbox.list(o),
      outboxGet: (key) => d().outbox.get(key),
      replay: (id) => d().replayInbound(id),
      retry: (key) => d().retrySend(key),
      discard: (key) => d().outbox.discard(key),
      markDelivered: (key, messageId) => d().markDelivered(key, messageId),
      damaged: (o) => d().damaged(o),
      metrics: () => d().metrics(),
      close: () => Promise.resolve(),
    };
  }
  const backend = target as unknown as DurabilityBackend;
  if (!isObject(backend.inbox) || !isObject(backend.outbox) || typeof backend.inbox.list !== "function") {
    throw new TypeError(`Argument "target" must be a Bot or a DurabilityBackend (with inbox and outbox journals)`);
  }
  let opening: Promise<boolean> | undefined;
  const ready = async (): Promise<void> => {
    if (!openBackend || typeof backend.open !== "function") return;
    opening ??= backend.open().then(() => true, (error) => {
      opening = undefined; // the next request tries again
      throw new BackendUnavailableError(`The ${backend.name} backend could not be opened: ${errorMessage(error)}`, { cause: error });
    });
    await opening;
  };
  const withBackend = <A extends unknown[], R>(fn: (...args: A) => Promise<R>) => async (...args: A): Promise<R> => {
    await ready();
    return await fn(...args);
  };
  return {
    inboxList: withBackend((o) => backend.inbox.list(o)),
    inboxGet: withBackend((id) => backend.inbox.get(id)),
    outboxList: withBackend((o) => backend.outbox.list(o)),
    outboxGet: withBackend((key) => backend.outbox.get(key)),
    replay: withBackend((id) => backend.inbox.replay(id)),
    retry: withBackend((key) => backend.outbox.retry(key)),
    discard: withBackend((key) => backend.outbox.discard(key)),
    markDelivered: withBackend((key: string, messageId: string) => markDeliveredInJournal(backend, key, messageId)),
    damaged: withBackend((o) => listDamaged(backend, o)),
    close: async () => {
      const opened = opening !== undefined && await opening.catch(() => false);
      opening = undefined;
      if (opened) await backend.close?.();
    },
  };
}
