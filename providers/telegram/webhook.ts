/**
 * The webhook: Telegram's POST checked (method, secret token, size, JSON) and
 * its update handed to the bot; the answer tells Telegram whether to deliver
 * it again.
 *
 * @module
 */
import type { InboundSink } from "../../src/provider.ts";
import { readCapped, ReadTimeoutError } from "../../src/read_capped.ts";
import { showValue as show } from "../../src/show.ts";
import type { Delivery } from "./delivery.ts";
import { asError } from "./values.ts";

const encoder = new TextEncoder();

/** What the webhook needs of the provider. */
export interface WebhookHandling {
  /** `'webhook'` or `'polling'` (the webhook is off then). */
  mode: "webhook" | "polling";
  /** The expected `X-Telegram-Bot-Api-Secret-Token`, or `false` for none. */
  secret: string | false;
  /** The largest body accepted. */
  maxBodyBytes: number;
  /** The most time the body may take to arrive, in ms. */
  bodyTimeoutMs: number;
  /** The bot, while the provider is started. */
  sink(): InboundSink | undefined;
  /** Hands an update to the bot. */
  deliver(sink: InboundSink, update: unknown): Promise<Delivery>;
}

/**
 * Answer one webhook request: `404` in polling mode, `405` unless POST, `401`
 * on a wrong secret, `503` while the bot is not started, `413` on a body over
 * `maxBodyBytes`, `408` on a body that did not arrive within `bodyTimeoutMs`, `400` on a body that is not an update, `503` when the
 * journal refused the update, else `200`.
 *
 * @param request Telegram's request
 * @param handling the provider's settings and the delivery
 * @returns the answer for Telegram
 */
export async function handleWebhook(request: Request, handling: WebhookHandling): Promise<Response> {
  const { maxBodyBytes } = handling;
  if (handling.mode !== "webhook") return textResponse(404, "This Telegram provider polls for updates; its webhook is off");
  if (request.method !== "POST") {
    const response = textResponse(405, "Method not allowed: Telegram webhooks are POST requests");
    response.headers.set("allow", "POST");
    return response;
  }
  if (handling.secret !== false) {
    const given = request.headers.get("x-telegram-bot-api-secret-token") ?? "";
    if (!(await sameSecret(given, handling.secret))) {
      await request.body?.cancel().catch(() => {});
      return textResponse(401, "Unauthorized: wrong or missing X-Telegram-Bot-Api-Secret-Token");
    }
  }
  const sink = handling.sink();
  if (!sink) {
    await request.body?.cancel().catch(() => {});
    return textResponse(503, "The bot is not running; Telegram will deliver this update again");
  }
  const length = Number(request.headers.get("content-length") ?? "0");
  if (length > maxBodyBytes) {
    await request.body?.cancel().catch(() => {});
    return textResponse(413, `Request body too large (over ${maxBodyBytes} bytes)`);
  }
  let bytes: Uint8Array | null;
  try {
    bytes = await readCapped(request.body, maxBodyBytes, { timeoutMs: handling.bodyTimeoutMs });
  } catch (error) {
    if (error instanceof ReadTimeoutError) {
      return textResponse(408, `Request timeout: the body did not arrive within ${handling.bodyTimeoutMs} ms (bodyTimeoutMs)`);
    }
    return textResponse(400, "Bad request: the body could not be read");
  }
  if (bytes === null) return textResponse(413, `Request body too large (over ${maxBodyBytes} bytes)`);
  let update: unknown;
  try {
    update = JSON.parse(new TextDecoder("utf-8", { fatal: true }).decode(bytes));
  } catch (error) {
    return textResponse(400, `Bad request: the body is not a JSON Telegram update (${asError(error).message})`);
  }
  if (typeof update !== "object" || update === null || Array.isArray(update)) {
    return textResponse(400, `Bad request: the body is not a JSON Telegram update, got ${show(update)}`);
  }
  const { outcome, error, unreadable } = await handling.deliver(sink, update);
  // An update that can never be parsed and is not a user's message (no message, channel post,
  // business message or callback query in it) is reported (onError / the bot's error event) and
  // answered 200: a non-2xx would make Telegram send it again and again, holding back the updates
  // after it. A user's one was journaled as unreadable (dead-lettered with the reason) first.
  if (outcome === "malformed") return textResponse(200, `ok (update skipped: ${error!.message})`);
  if (outcome === "retry") return textResponse(503, "The update could not be journaled; Telegram will deliver it again");
  if (unreadable !== undefined) return textResponse(200, `ok (journaled as unreadable: ${unreadable})`);
  return textResponse(200, "ok");
}

/** Constant-time comparison of two strings (through SHA-256, so the length does not leak either). */
async function sameSecret(a: string, b: string): Promise<boolean> {
  const [x, y] = await Promise.all([
    crypto.subtle.digest("SHA-256", encoder.encode(a)),
    crypto.subtle.digest("SHA-256", encoder.encode(b)),
  ]);
  const p = new Uint8Array(x);
  const q = new Uint8Array(y);
  let diff = 0;
  for (let i = 0; i < p.length; i++) diff |= p[i]! ^ q[i]!;
  return diff === 0;
}

function textResponse(status: number, text: string): Response {
  return new Response(text, { status, headers: { "content-type": "text/plain; charset=utf-8" } });
}
