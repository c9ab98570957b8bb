/**
 * Calls that pass straight through (not journaled) are made again when the middleware runs again
 * for an update; some then fail only because their first making took effect. On a rerun those
 * failures are answered as success.
 *
 * @module
 */
import { isObj } from "../telegram/values.ts";

/** Per method family, the Bot API errors (400) that say the call's effect is already there. */
const ALREADY_DONE: readonly { method: RegExp; description: RegExp }[] = [
  // An edit to the text (markup, caption, …) it already has.
  { method: /^edit/, description: /message is not modified/i },
  // A button press answered by the first run.
  { method: /^answerCallbackQuery$/, description: /query is too old|query id is invalid/i },
  // A message the first run deleted.
  { method: /^deleteMessages?$/, description: /message to delete not found/i },
];

/**
 * Whether a Bot API error answer, on a rerun of the middleware, only says that the first run's call
 * took effect (an edit to the same text, an answered button press, a deleted message).
 *
 * @param method the Bot API method
 * @param response the Bot API's answer
 * @returns whether to answer it as success instead
 */
export function isAlreadyDone(method: string, response: unknown): boolean {
  if (!isObj(response) || response.ok !== false || response.error_code !== 400) return false;
  const description = String(response.description ?? "");
  return ALREADY_DONE.some((rule) => rule.method.test(method) && rule.description.test(description));
}
