/**
 * The webhook: Meta's verification GET, and each POST checked (size,
 * `X-Hub-Signature-256`, JSON), its messages admitted chat by chat and its
 * statuses handed on; the answer tells Meta whether to redeliver it.
 *
 * @module
 */
import type { MediaSeal } from "../../src/media.ts";
import type { AdmitResult, InboundMessage, InboundSink } from "../../src/provider.ts";
import { readCapped, ReadTimeoutError } from "../../src/read_capped.ts";
import { showValue as show } from "../../src/show.ts";
import { isWellFormed } from "../../src/well_formed.ts";
import type { PayloadReader } from "./changes.ts";
import { inboundMessageOf } from "./messages.ts";
import { CONFIRMING_STATUSES, type WhatsAppStatus } from "./statuses.ts";
import { brief, isObject } from "./values.ts";

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** What the webhook needs of the provider. */
export interface WebhookHandling {
  /** The verify token, as bytes. */
  verifyToken: Uint8Array;
  /** The app secret as an HMAC key. */
  appSecret: Promise<CryptoKey>;
  /** The largest body accepted. */
  maxBodyBytes: number;
  /** The most time the body may take to arrive, in ms. */
  bodyTimeoutMs: number;
  /** The business phone number id. */
  phoneNumberId: string;
  /** Seals media references. */
  seal: MediaSeal;
  /** Reads the payloads. */
  reader: PayloadReader;
  /** The bot, while the provider is started. */
  sink(): InboundSink | undefined;
  /** Calls the `onStatus` option; `undefined` when there is none. */
  onStatus: ((status: WhatsAppStatus) => void | Promise<void>) | undefined;
  /** Reports a problem. */
  report(error: Error): void;
}

/** What a webhook POST was answered, in its JSON body. */
interface WebhookSummary {
  ok: boolean;
  /** Messages journaled now (unreadable ones included). */
  admitted: number;
  duplicates: number;
  rejected: number;
  /** Of the messages offered, how many could not be parsed (journaled as unreadable, dead-lettered by the bot). */
  unreadable: number;
  statuses: number;
  ignored: number;
  errors: string[];
}

/**
 * Answer one webhook request; it never throws (see the provider's class
 * documentation for its answers).
 *
 * @param request Meta's request
 * @param handling the provider's settings, the bot and the reports
 * @returns the answer for Meta
 */
export async function handleWebhook(request: Request, handling: WebhookHandling): Promise<Response> {
  try {
    if (request.method === "GET") return verify(request, handling);
    if (request.method !== "POST") {
      return plain(405, `Method ${request.method} not allowed: the WhatsApp webhook takes GET and POST`, {
        allow: "GET, POST",
      });
    }
    return await post(request, handling);
  } catch (error) {
    handling.report(error instanceof Error ? error : new Error(String(error)));
    return plain(500, "The webhook failed; redeliver later");
  }
}

function verify(request: Request, handling: WebhookHandling): Response {
  const params = new URL(request.url).searchParams;
  const mode = params.get("hub.mode");
  const token = params.get("hub.verify_token");
  const challenge = params.get("hub.challenge");
  if (mode !== "subscribe" || token === null || challenge === null) {
    return plain(403, "Webhook verification needs hub.mode=subscribe, hub.verify_token and hub.challenge");
  }
  if (!sameBytes(encoder.encode(token), handling.verifyToken)) {
    return plain(403, "Webhook verification failed: hub.verify_token does not match");
  }
  return plain(200, challenge);
}

async function post(request: Request, handling: WebhookHandling): Promise<Response> {
  const { maxBodyBytes } = handling;
  const length = request.headers.get("content-length");
  if (length !== null && Number(length) > maxBodyBytes) {
    await request.body?.cancel().catch(() => {});
    return plain(413, `Webhook body of ${length} bytes is over the limit of ${maxBodyBytes} bytes`);
  }
  const header = request.headers.get("x-hub-signature-256");
  if (header === null) {
    await request.body?.cancel().catch(() => {});
    return plain(401, "Missing X-Hub-Signature-256 header");
  }
  let raw: Uint8Array | null;
  try {
    raw = await readCapped(request.body, maxBodyBytes, { timeoutMs: handling.bodyTimeoutMs });
  } catch (error) {
    if (error instanceof ReadTimeoutError) {
      return plain(408, `Webhook body did not arrive within ${handling.bodyTimeoutMs} ms (bodyTimeoutMs)`);
    }
    return plain(400, `Webhook body could not be read: ${(error as Error)?.message ?? String(error)}`);
  }
  if (raw === null) return plain(413, `Webhook body is over the limit of ${maxBodyBytes} bytes`);
  const match = /^sha256=([0-9a-fA-F]{64})$/.exec(header.trim());
  const signature = match ? hexToBytes(match[1]) : null;
  if (signature === null) {
    return plain(401, `Malformed X-Hub-Signature-256 header: expected "sha256=" and 64 hex digits`);
  }
  const valid = await crypto.subtle.verify("HMAC", await handling.appSecret, signature, raw as Uint8Array<ArrayBuffer>);
  if (!valid) return plain(401, "X-Hub-Signature-256 does not match the body (wrong app secret, or the body was altered)");

  let payload: unknown;
  try {
    payload = JSON.parse(decoder.decode(raw));
  } catch (error) {
    return plain(400, `Webhook body is not valid JSON: ${(error as Error).message}`);
  }
  if (!isObject(payload)) return plain(400, `Webhook body must be a JSON object, got ${brief(payload)}`);
  if (payload.object !== "whatsapp_business_account") {
    return plain(400, `Webhook field "object" must be "whatsapp_business_account", got ${brief(payload.object)}`);
  }
  if (!Array.isArray(payload.entry)) return plain(400, `Webhook field "entry" must be an array, got ${brief(payload.entry)}`);

  const sink = handling.sink();
  if (sink === undefined) return plain(503, "The bot is not started; redeliver later", { "retry-after": "10" });

  const summary: WebhookSummary = {
    ok: true,
    admitted: 0,
    duplicates: 0,
    rejected: 0,
    unreadable: 0,
    statuses: 0,
    ignored: 0,
    errors: [],
  };
  const fail = (error: Error) => {
    summary.errors.push(error.message);
    handling.report(error);
  };
  const { entries, statuses } = handling.reader.read(payload.entry, {
    fail,
    ignore: () => {
      summary.ignored++;
    },
  });

  const messages = await Promise.all(entries.map((entry) => inboundMessageOf(entry, handling.seal, handling.phoneNumberId)));
  summary.unreadable = messages.filter((m) => m.unreadable !== undefined).length;
  // Each chat's messages are admitted one after the other, in payload order; once one is
  // refused, the chat's later messages are not offered (Meta redelivers them all, in order,
  // with the refused one). Chats are admitted concurrently. A group is one chat.
  const chats = new Map<string, InboundMessage[]>();
  for (const m of messages) {
    const list = chats.get(m.chatId);
    if (list) list.push(m);
    else chats.set(m.chatId, [m]);
  }
  const refused: string[] = [];
  await Promise.all([...chats.values()].map(async (list) => {
    for (const [i, m] of list.entries()) {
      let result: AdmitResult;
      try {
        result = await sink.receive(m);
      } catch (error) {
        result = { status: "rejected", id: m.id, error: error instanceof Error ? error : new Error(String(error)) };
      }
      if (result.status === "rejected") {
        summary.rejected += list.length - i;
        refused.push(`${m.id}: ${result.error?.message ?? "rejected"}`);
        for (const later of list.slice(i + 1)) refused.push(`${later.id}: held back behind ${m.id}`);
        return;
      }
      if (result.status === "duplicate") summary.duplicates++;
      else summary.admitted++;
    }
  }));

  let statusFailed = false;
  let confirmFailed = false;
  for (const { status, path } of statuses) {
    summary.statuses++;
    // A status that says the send reached WhatsApp settles an ambiguous send with that outbox key.
    // Only a callback data that can be a journal key is offered (well-formed, no NUL): any other is
    // no outbox key of ours, and a journal that refuses it would refuse it on every redelivery.
    const key = status.callbackData;
    if (
      key !== undefined && key !== "" && isWellFormed(key) && !key.includes("\u0000") &&
      CONFIRMING_STATUSES.has(status.status) && sink.confirmSent
    ) {
      try {
        await sink.confirmSent(key, status.id);
      } catch (error) {
        // The journal failed: answered 503, so that Meta redelivers the POST and the status with it.
        confirmFailed = true;
        fail(
          new Error(
            `WhatsApp webhook ${path}: confirmSent(${show(status.callbackData)}, ${show(status.id)}) failed for the ` +
              `"${status.status}" status: ${(error as Error)?.message ?? String(error)}`,
            { cause: error },
          ),
        );
      }
    }
    if (handling.onStatus === undefined) continue;
    try {
      await handling.onStatus(status);
    } catch (error) {
      statusFailed = true;
      fail(new Error(`WhatsApp webhook ${path}: onStatus threw for ${show(status.id)}: ${(error as Error)?.message ?? String(error)}`, {
        cause: error,
      }));
    }
  }

  if (refused.length > 0 || statusFailed || confirmFailed) {
    summary.ok = false;
    const why = [
      refused.length > 0 ? `${refused.length} message(s) were not admitted (${refused.join("; ")})` : "",
      confirmFailed ? "confirmSent failed" : "",
      statusFailed ? "onStatus failed" : "",
    ].filter((s) => s !== "").join("; ");
    summary.errors.unshift(`${why}; redeliver the POST`);
    return json(503, summary);
  }
  return json(200, summary);
}

function plain(status: number, text: string, headers: Record<string, string> = {}): Response {
  return new Response(text, {
    status,
    headers: { "content-type": "text/plain; charset=utf-8", "x-content-type-options": "nosniff", ...headers },
  });
}

function json(status: number, body: unknown): Response {
  return new Response(JSON.stringify(body), { status, headers: { "content-type": "application/json" } });
}

/** Constant-time comparison of two byte strings (the length leaks, the content does not). */
function sameBytes(a: Uint8Array, b: Uint8Array): boolean {
  let diff = a.byteLength ^ b.byteLength;
  const n = Math.max(a.byteLength, b.byteLength);
  for (let i = 0; i < n; i++) diff |= (a[i] ?? 0) ^ (b[i] ?? 0);
  return diff === 0;
}

function hexToBytes(hex: string): Uint8Array<ArrayBuffer> | null {
  if (!/^[0-9a-fA-F]*$/.test(hex) || hex.length % 2 !== 0) return null;
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}
