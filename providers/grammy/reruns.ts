/**
 * Calls that pass straight through (not journaled) are made again when the middleware runs again
 * for an update; some then fail only because their first making took effect. On a rerun those
 * failures are answered as success.
 *
 * @module
 */
import { isAlreadyDone as isDoneOnTelegram } from "../telegram/sends.ts";
import { isObj } from "../telegram/values.ts";

/**
 * Whether a Bot API error answer, on a rerun of the middleware, only says that the first run's call
 * took effect (an edit to the same text, an answered button press, a deleted message): the Telegram
 * provider's rule.
 *
 * @param method the Bot API method
 * @param response the Bot API's answer
 * @returns whether to answer it as success instead
 */
export function isAlreadyDone(method: string, response: unknown): boolean {
  if (!isObj(response) || response.ok !== false || typeof response.error_code !== "number") return false;
  return isDoneOnTelegram(method, response.error_code, String(response.description ?? ""));
}
