/**
 * Handing one update to the bot, for the webhook and the poller alike: what
 * Telegram is told (acknowledged, or to deliver it again) follows from what
 * the bot answered.
 *
 * @module
 */
import type { InboundSink } from "../../src/provider.ts";
import { type ParsedUpdate, type SkippedUpdate, unreadableUpdate } from "./updates.ts";
import { asError } from "./values.ts";

/**
 * What became of one update: `'ack'` when Telegram may forget it, `'retry'`
 * when it must come again, `'malformed'` when it cannot be parsed and is
 * certainly not a user's message (acknowledged, not journaled); `unreadable`
 * is the reason when it was handed on as unreadable.
 */
export interface Delivery {
  /** What Telegram is told. */
  outcome: "ack" | "retry" | "malformed";
  /** Why it is malformed, or why it must come again. */
  error?: Error;
  /** Why it could not be parsed, when it was journaled as unreadable. */
  unreadable?: string;
}

/** What delivering an update needs of the provider. */
export interface DeliveryHooks {
  /** The bot's id, for the record of an unreadable update. */
  botId: string;
  /** The provider's `parseUpdate`. */
  parse(update: unknown): Promise<ParsedUpdate>;
  /** Reports a problem no caller sees. */
  report(error: Error): void;
  /** Calls the `onSkippedUpdate` option, when there is one. */
  skipped(skipped: SkippedUpdate): void;
  /** Answers a button press once admitted. */
  answerCallback(queryId: string): void;
}

/**
 * Hand one update to the bot. A user's update that cannot be parsed is
 * handed on as unreadable: acknowledged only once admitted, like any message.
 *
 * @param sink the bot
 * @param update the update as Telegram sent it
 * @param hooks the parser, the reports and the answer to a button press
 * @returns what Telegram is told
 */
export async function deliverUpdate(sink: InboundSink, update: unknown, hooks: DeliveryHooks): Promise<Delivery> {
  let parsed: ParsedUpdate;
  try {
    parsed = await hooks.parse(update);
  } catch (error) {
    const err = asError(error);
    hooks.report(err);
    const message = await unreadableUpdate(update, err, hooks.botId);
    if (message === undefined) return { outcome: "malformed", error: err };
    let result: Awaited<ReturnType<InboundSink["receive"]>>;
    try {
      result = await sink.receive(message);
    } catch (thrown) {
      const e = asError(thrown);
      hooks.report(e);
      return { outcome: "retry", error: e };
    }
    if (result.status === "rejected") return { outcome: "retry", error: result.error };
    return { outcome: "ack", unreadable: err.message };
  }
  if (parsed.kind === "skipped") {
    try {
      hooks.skipped(parsed.skipped);
    } catch (error) {
      hooks.report(asError(error));
    }
    return { outcome: "ack" };
  }
  let result: Awaited<ReturnType<InboundSink["receive"]>>;
  try {
    result = await sink.receive(parsed.message);
  } catch (error) {
    // A sink that throws instead of answering "rejected": not admitted, so it must come again.
    const err = asError(error);
    hooks.report(err);
    return { outcome: "retry", error: err };
  }
  if (result.status === "rejected") return { outcome: "retry", error: result.error };
  if (parsed.callbackQueryId !== undefined && result.status !== "duplicate") hooks.answerCallback(parsed.callbackQueryId);
  return { outcome: "ack" };
}
