/**
 * What a journaled call of a bot library's plugin (grammY's, Telegraf's) returns: the call goes
 * through the outbox, and its caller gets the Bot API's answer, one made from what the outbox knows,
 * or the error answer of a dead send.
 *
 * @module
 */
import type { Bot } from "../../src/bot.ts";
import type { SendResult } from "../../src/engine.ts";
import type { Obj } from "../telegram/values.ts";
import { type ApiFailure, callContent, failureOf, minimalResult, placeholderResult } from "./methods.ts";
import type { GrammyProvider } from "./provider.ts";
import { afterFlood } from "./waits.ts";

/** The Bot API answer of a journaled call: its result, or the error answer of a dead send. */
export type JournaledAnswer = { readonly ok: true; readonly result: unknown } | ApiFailure;

/**
 * Send a call through the outbox (waiting out a flood limit, see {@link afterFlood}) and answer it.
 *
 * @param core the durability core
 * @param provider the provider that makes the outbox's calls
 * @param chat the chat the call is journaled in
 * @param method the Bot API method
 * @param payload its payload
 * @param stopped whether the plugin is stopping
 * @returns the answer
 */
export async function sendJournaled(
  core: Bot,
  provider: GrammyProvider,
  chat: string,
  method: string,
  payload: Obj,
  stopped: () => boolean,
): Promise<JournaledAnswer> {
  const sent = await core.send(chat, callContent(method, payload));
  const result = await afterFlood(sent, provider, core.durability!.outbox, stopped);
  return journaledAnswer(provider, method, payload, result);
}

/**
 * What a call the outbox took answers.
 *
 * @param provider the provider that made the outbox's calls (their answers and failures)
 * @param method the Bot API method
 * @param payload its payload
 * @param result what the outbox answered
 * @returns the answer
 */
export function journaledAnswer(provider: GrammyProvider, method: string, payload: Obj, result: SendResult): JournaledAnswer {
  const answer = provider.takeAnswer(result.key);
  if (result.state === "dead") return failureOf(result, provider.takeFailure(result.key));
  if (answer !== undefined) return { ok: true, result: answer };
  if (result.state === "sent") return { ok: true, result: minimalResult(method, payload, result.messageId ?? "") };
  // Queued for a retry, being sent by another process, or of unknown outcome: the outbox has it.
  return { ok: true, result: placeholderResult(method, payload) };
}
