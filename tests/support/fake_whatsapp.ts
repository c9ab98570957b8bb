/**
 * A fake of Meta's side of the WhatsApp Cloud API, on loopback:
 *
 * - the Graph API paths the provider uses (`POST /{version}/{phone-number-id}/messages`,
 *   `GET /{version}/{media-id}`, and the media download URL it hands out), with the
 *   real JSON shapes and Graph error bodies, the bearer token checked (190 OAuthException);
 * - fault injection for the next sends or media requests: Graph errors with an HTTP
 *   status and code (and `Retry-After`), 5xx with an HTML body, a hang (the client's
 *   timeout fires), garbage 200 bodies;
 * - Meta's webhook sender: payloads signed with the app secret (`X-Hub-Signature-256`),
 *   POSTed to the bot's webhook, redelivered on a non-2xx answer.
 */

export interface FakeWhatsAppOptions {
  accessToken: string;
  phoneNumberId: string;
  appSecret: string;
}

/** One request to the messages endpoint, whatever its outcome. */
export interface FakeSendAttempt {
  /** When the fake received it (ms since epoch). */
  at: number;
  phoneNumberId: string;
  version: string;
  // deno-lint-ignore no-explicit-any
  body: any;
  status: number;
  /** The wamid returned, when the send succeeded. */
  wamid?: string;
}

/** A fault the fake answers a request with instead of the normal answer. */
export type Fault =
  | {
    kind: "graph";
    status: number;
    code: number;
    message: string;
    type?: string;
    subcode?: number;
    details?: string;
    retryAfter?: string;
    headers?: Record<string, string>;
  }
  | { kind: "http"; status: number; body: string; contentType?: string; headers?: Record<string, string> }
  | { kind: "hang" };

interface Media {
  bytes: Uint8Array;
  mimeType: string;
  sha256: string;
  expired: false | number;
}

const encoder = new TextEncoder();

function hex(bytes: ArrayBuffer | Uint8Array): string {
  return Array.from(new Uint8Array(bytes), (b) => b.toString(16).padStart(2, "0")).join("");
}

function traceId(): string {
  return btoa(String.fromCharCode(...crypto.getRandomValues(new Uint8Array(12)))).replace(/[+/=]/g, "x");
}

/** A wamid as Meta makes them: `wamid.` and base64. */
export function makeWamid(): string {
  return `wamid.${btoa(String.fromCharCode(...crypto.getRandomValues(new Uint8Array(30))))}`;
}

function graphBody(code: number, message: string, extra: { type?: string; subcode?: number; details?: string } = {}) {
  return {
    error: {
      message,
      type: extra.type ?? "OAuthException",
      code,
      ...(extra.subcode !== undefined ? { error_subcode: extra.subcode } : {}),
      error_data: { messaging_product: "whatsapp", details: extra.details ?? message },
      fbtrace_id: traceId(),
    },
  };
}

function graphResponse(status: number, code: number, message: string, extra: Parameters<typeof graphBody>[2] = {}, headers: Record<string, string> = {}) {
  return Response.json(graphBody(code, message, extra), { status, headers });
}

export const MESSAGE_TYPES: string[] = [
  "text",
  "image",
  "audio",
  "video",
  "document",
  "sticker",
  "interactive",
  "template",
  "location",
  "contacts",
  "reaction",
];

/** The fake Graph API and webhook sender. */
export class FakeWhatsApp {
  readonly options: FakeWhatsAppOptions;
  /** Every request to the messages endpoint, in arrival order. */
  readonly attempts: FakeSendAttempt[] = [];
  /** Read receipts (and typing indicators) received, in order. */
  readonly reads: { messageId: string; typing: boolean }[] = [];
  /** Media lookups and downloads, in arrival order (`lookup:<id>` / `download:<id>`). */
  readonly mediaRequests: string[] = [];
  #server: ReturnType<typeof Bun.serve>;
  #sendFaults: Fault[] = [];
  #mediaFaults: Fault[] = [];
  #downloadFaults: Fault[] = [];
  #media = new Map<string, Media>();
  #hangs = new Set<() => void>();
  #sendWaiters = new Set<(attempt: FakeSendAttempt) => void>();
  #attemptWaiters = new Set<() => void>();
  #nextMedia = 1;

  private constructor(options: FakeWhatsAppOptions) {
    this.options = options;
    this.#server = Bun.serve({ hostname: "127.0.0.1", port: 0, idleTimeout: 0, fetch: (request) => this.#handle(request) });
  }

  /** Start a fake on a free loopback port. */
  static start(options: FakeWhatsAppOptions): FakeWhatsApp {
    return new FakeWhatsApp(options);
  }

  /** The Graph base URL to give the provider (`graphBase`). */
  get url(): string {
    return `http://127.0.0.1:${this.#server.port}`;
  }

  /** The successful sends, in order. */
  get sent(): FakeSendAttempt[] {
    return this.attempts.filter((a) => a.wamid !== undefined);
  }

  /**
   * Resolves with the first successful send (already received or still to come) that `match` accepts.
   * @throws {Error} after `timeoutMs`
   */
  waitForSend(match: (attempt: FakeSendAttempt) => boolean, timeoutMs = 10_000): Promise<FakeSendAttempt> {
    const found = this.sent.find(match);
    if (found) return Promise.resolve(found);
    return new Promise((resolve, reject) => {
      const waiter = (attempt: FakeSendAttempt) => {
        if (!match(attempt)) return;
        clearTimeout(timer);
        this.#sendWaiters.delete(waiter);
        resolve(attempt);
      };
      const timer = setTimeout(() => {
        this.#sendWaiters.delete(waiter);
        reject(new Error(`no matching send within ${timeoutMs} ms (sent: ${JSON.stringify(this.sent.map((a) => a.body))})`));
      }, timeoutMs);
      this.#sendWaiters.add(waiter);
    });
  }

  /** Resolves once the messages endpoint has received `count` requests in all. */
  waitForAttempts(count: number, timeoutMs = 10_000): Promise<void> {
    if (this.attempts.length >= count) return Promise.resolve();
    return new Promise((resolve, reject) => {
      const check = () => {
        if (this.attempts.length < count) return;
        clearTimeout(timer);
        this.#attemptWaiters.delete(check);
        resolve();
      };
      const timer = setTimeout(() => {
        this.#attemptWaiters.delete(check);
        reject(new Error(`the messages endpoint got ${this.attempts.length} requests, not ${count}, within ${timeoutMs} ms`));
      }, timeoutMs);
      this.#attemptWaiters.add(check);
    });
  }

  /** Answer the next sends with these faults, one each, in order. */
  failSends(...faults: Fault[]): void {
    this.#sendFaults.push(...faults);
  }

  /** Answer the next media lookups (`GET /{version}/{media-id}`) with these faults, one each, in order. */
  failMedia(...faults: Fault[]): void {
    this.#mediaFaults.push(...faults);
  }

  /** Answer the next media downloads (the URL a lookup gives) with these faults, one each, in order. */
  failDownloads(...faults: Fault[]): void {
    this.#downloadFaults.push(...faults);
  }

  /**
   * Store media; returns its id (as a webhook carries it).
   * @param sha256 what the lookup says the hash is (default: the real one, in hex)
   */
  async addMedia(bytes: Uint8Array, mimeType: string, sha256?: string): Promise<string> {
    const id = `${1_000_000_000_000_000 + this.#nextMedia++}`;
    const real = hex(await crypto.subtle.digest("SHA-256", bytes as Uint8Array<ArrayBuffer>));
    this.#media.set(id, { bytes, mimeType, sha256: sha256 ?? real, expired: false });
    return id;
  }

  /** The media id no longer exists: lookups answer a Graph error (`status`: 404, or 400 code 100/33 as Meta does). */
  expireMedia(id: string, status = 404): void {
    const media = this.#media.get(id);
    if (!media) throw new Error(`no media ${id}`);
    media.expired = status;
  }

  close(): void {
    for (const release of this.#hangs) release();
    this.#server.stop(true);
  }

  #nextFault(list: Fault[]): Fault | undefined {
    return list.shift();
  }

  async #answerFault(fault: Fault, request: Request): Promise<Response> {
    if (fault.kind === "hang") {
      await new Promise<void>((resolve) => {
        const release = () => {
          this.#hangs.delete(release);
          resolve();
        };
        this.#hangs.add(release);
        request.signal.addEventListener("abort", release, { once: true });
      });
      return new Response("too late", { status: 504 });
    }
    if (fault.kind === "http") {
      return new Response(fault.body, {
        status: fault.status,
        headers: { "content-type": fault.contentType ?? "text/html", ...fault.headers },
      });
    }
    const headers: Record<string, string> = { ...fault.headers };
    if (fault.retryAfter !== undefined) headers["retry-after"] = fault.retryAfter;
    return graphResponse(fault.status, fault.code, fault.message, fault, headers);
  }

  async #handle(request: Request): Promise<Response> {
    const url = new URL(request.url);
    const parts = url.pathname.split("/").filter((p) => p !== "").map(decodeURIComponent);
    const auth = request.headers.get("authorization");
    if (auth !== `Bearer ${this.options.accessToken}`) {
      return graphResponse(401, 190, "Invalid OAuth access token - Cannot parse access token", { type: "OAuthException" }, {
        "www-authenticate": 'OAuth "Facebook Platform" "invalid_token" "Invalid OAuth access token"',
      });
    }
    if (parts[0] === "media-download" && parts.length === 2 && request.method === "GET") return this.#download(parts[1], request);
    if (parts.length === 3 && parts[2] === "messages" && request.method === "POST") {
      return this.#send(parts[0], parts[1], request);
    }
    if (parts.length === 2 && request.method === "GET") return this.#lookup(parts[1], request);
    return graphResponse(400, 100, `Unknown path components: /${parts.slice(1).join("/")}`, { type: "OAuthException" });
  }

  async #send(version: string, phoneNumberId: string, request: Request): Promise<Response> {
    const at = Date.now();
    const text = await request.text();
    // deno-lint-ignore no-explicit-any
    let body: any;
    try {
      body = JSON.parse(text);
    } catch {
      body = text;
    }
    const attempt: FakeSendAttempt = { at, phoneNumberId, version, body, status: 0 };
    this.attempts.push(attempt);
    for (const waiter of [...this.#attemptWaiters]) waiter();
    const answer = await (async (): Promise<Response> => {
      const fault = this.#nextFault(this.#sendFaults);
      if (fault) return this.#answerFault(fault, request);
      if (phoneNumberId !== this.options.phoneNumberId) {
        return graphResponse(400, 100, `Unsupported post request. Object with ID '${phoneNumberId}' does not exist, cannot be loaded due to missing permissions, or does not support this operation.`, {
          type: "GraphMethodException",
          subcode: 33,
        });
      }
      if (typeof body !== "object" || body === null) return graphResponse(400, 100, "(#100) The parameter messaging_product is required.");
      if (body.messaging_product !== "whatsapp") {
        return graphResponse(400, 100, "(#100) The parameter messaging_product is required.");
      }
      if (body.status === "read") {
        if (typeof body.message_id !== "string" || !body.message_id.startsWith("wamid.")) {
          return graphResponse(400, 100, "(#100) Invalid parameter", { details: "Invalid message_id" });
        }
        this.reads.push({ messageId: body.message_id, typing: body.typing_indicator?.type === "text" });
        return Response.json({ success: true });
      }
      // Addressing as the Cloud API takes it: `to` (a phone number, or a group id with recipient_type
      // "group"), or `recipient` (a business-scoped user id) without `to`; `to` wins when both are given.
      const recipientType = body.recipient_type ?? "individual";
      if (recipientType !== "individual" && recipientType !== "group") {
        return graphResponse(400, 100, `(#100) Param recipient_type must be one of {individual, group} - got "${recipientType}".`);
      }
      const hasTo = typeof body.to === "string" && body.to !== "";
      const hasRecipient = typeof body.recipient === "string" && body.recipient !== "";
      if (!hasTo && (recipientType === "group" || !hasRecipient)) {
        return graphResponse(400, 100, "(#100) The parameter to is required.");
      }
      if (!hasTo && !/^[A-Z]{2}\.(ENT\.)?[A-Za-z0-9]+$/.test(body.recipient)) {
        return graphResponse(400, 100, "(#100) Invalid parameter", { details: `Invalid recipient ${JSON.stringify(body.recipient)}` });
      }
      if (!MESSAGE_TYPES.includes(body.type) || typeof body[body.type] !== "object") {
        return graphResponse(400, 100, `(#100) Param ${body.type} is not a valid message type`, { details: `Invalid message type ${JSON.stringify(body.type)}` });
      }
      if (body.type === "text" && (typeof body.text.body !== "string" || body.text.body === "")) {
        return graphResponse(400, 100, "(#100) Invalid parameter", { details: "The parameter text['body'] is required." });
      }
      const wamid = makeWamid();
      attempt.wamid = wamid;
      if (recipientType === "group") {
        return Response.json({ messaging_product: "whatsapp", contacts: [{ input: body.to }], messages: [{ id: wamid, group_id: body.to }] });
      }
      return Response.json({
        messaging_product: "whatsapp",
        contacts: [hasTo ? { input: body.to, wa_id: body.to } : { input: body.recipient, user_id: body.recipient }],
        messages: [{ id: wamid }],
      });
    })();
    attempt.status = answer.status;
    if (attempt.wamid !== undefined) for (const waiter of [...this.#sendWaiters]) waiter(attempt);
    return answer;
  }

  async #lookup(id: string, request: Request): Promise<Response> {
    this.mediaRequests.push(`lookup:${id}`);
    const fault = this.#nextFault(this.#mediaFaults);
    if (fault) return this.#answerFault(fault, request);
    const media = this.#media.get(id);
    const gone = `Unsupported get request. Object with ID '${id}' does not exist, cannot be loaded due to missing permissions, or does not support this operation.`;
    if (!media) return graphResponse(400, 100, gone, { type: "GraphMethodException", subcode: 33 });
    if (media.expired !== false) return graphResponse(media.expired, 100, gone, { type: "GraphMethodException", subcode: 33 });
    return Response.json({
      messaging_product: "whatsapp",
      url: `${this.url}/media-download/${encodeURIComponent(id)}?ext=${Date.now()}&hash=${traceId()}`,
      mime_type: media.mimeType,
      sha256: media.sha256,
      file_size: media.bytes.byteLength,
      id,
    });
  }

  async #download(id: string, request: Request): Promise<Response> {
    this.mediaRequests.push(`download:${id}`);
    const fault = this.#nextFault(this.#downloadFaults);
    if (fault) return this.#answerFault(fault, request);
    const media = this.#media.get(id);
    if (!media || media.expired !== false) return new Response("Not Found", { status: 404 });
    return new Response(media.bytes as Uint8Array<ArrayBuffer>, { headers: { "content-type": media.mimeType } });
  }

  // ---- Meta's webhook sender ---------------------------------------------------------

  /** `sha256=<hex>` of HMAC-SHA256(app secret, body). */
  async sign(body: string | Uint8Array, secret: string = this.options.appSecret): Promise<string> {
    const key = await crypto.subtle.importKey("raw", encoder.encode(secret), { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
    const data = typeof body === "string" ? encoder.encode(body) : body;
    return `sha256=${hex(await crypto.subtle.sign("HMAC", key, data as Uint8Array<ArrayBuffer>))}`;
  }

  /**
   * POST one delivery to the webhook, signed unless `signature` is given (`null`: no header).
   * @returns the status and the body
   */
  async post(
    webhookUrl: string,
    payload: unknown,
    options: { signature?: string | null; headers?: Record<string, string> } = {},
  ): Promise<{ status: number; text: string; headers: Headers }> {
    const body = typeof payload === "string" ? payload : JSON.stringify(payload);
    const headers: Record<string, string> = { "content-type": "application/json", "user-agent": "facebookexternalua", ...options.headers };
    const signature = options.signature === undefined ? await this.sign(body) : options.signature;
    if (signature !== null) headers["x-hub-signature-256"] = signature;
    const response = await fetch(webhookUrl, { method: "POST", headers, body });
    return { status: response.status, text: await response.text(), headers: response.headers };
  }

  /**
   * Deliver like Meta: POST, and redeliver the same body while the answer is not 2xx,
   * up to `maxAttempts` times.
   * @returns the status of each attempt
   */
  async deliver(webhookUrl: string, payload: unknown, maxAttempts = 5): Promise<number[]> {
    const statuses: number[] = [];
    for (let i = 0; i < maxAttempts; i++) {
      const { status } = await this.post(webhookUrl, payload);
      statuses.push(status);
      if (status >= 200 && status < 300) break;
    }
    return statuses;
  }
}

// ---- webhook payloads ------------------------------------------------------------------

let seq = 0;
const nowSeconds = () => String(Math.floor(Date.now() / 1000));

/** A `messages` webhook payload for one phone number id. */
export function webhookPayload(
  phoneNumberId: string,
  value: { messages?: unknown[]; statuses?: unknown[]; contacts?: unknown[]; errors?: unknown[] },
  field = "messages",
): Record<string, unknown> {
  return {
    object: "whatsapp_business_account",
    entry: [{
      id: "102290129340398",
      changes: [{
        value: {
          messaging_product: "whatsapp",
          metadata: { display_phone_number: "15550783881", phone_number_id: phoneNumberId },
          ...value,
        },
        field,
      }],
    }],
  };
}

/** Inbound message objects as Meta sends them in `value.messages`. */
export const inbound = {
  text(from: string, body: string, id: string = makeWamid()): Record<string, unknown> {
    return { from, id, timestamp: nowSeconds(), type: "text", text: { body } };
  },
  media(
    type: "image" | "audio" | "video" | "document" | "sticker",
    from: string,
    media: Record<string, unknown>,
    id: string = makeWamid(),
  ): Record<string, unknown> {
    return { from, id, timestamp: nowSeconds(), type, [type]: media };
  },
  buttonReply(from: string, replyId: string, title: string, id: string = makeWamid()): Record<string, unknown> {
    return {
      context: { from: "15550783881", id: `wamid.context${++seq}` },
      from,
      id,
      timestamp: nowSeconds(),
      type: "interactive",
      interactive: { type: "button_reply", button_reply: { id: replyId, title } },
    };
  },
  listReply(from: string, rowId: string, title: string, description: string, id: string = makeWamid()): Record<string, unknown> {
    return {
      context: { from: "15550783881", id: `wamid.context${++seq}` },
      from,
      id,
      timestamp: nowSeconds(),
      type: "interactive",
      interactive: { type: "list_reply", list_reply: { id: rowId, title, description } },
    };
  },
  templateButton(from: string, payload: string, text: string, id: string = makeWamid()): Record<string, unknown> {
    return {
      context: { from: "15550783881", id: `wamid.context${++seq}` },
      from,
      id,
      timestamp: nowSeconds(),
      type: "button",
      button: { payload, text },
    };
  },
  other(from: string, type: string, body: unknown, id: string = makeWamid()): Record<string, unknown> {
    return { from, id, timestamp: nowSeconds(), type, ...(body === undefined ? {} : { [type]: body }) };
  },
};

/** A status object as Meta sends it in `value.statuses`. */
export function statusUpdate(id: string, status: string, recipient: string, extra: Record<string, unknown> = {}): Record<string, unknown> {
  return { id, status, timestamp: nowSeconds(), recipient_id: recipient, ...extra };
}

// ---- the corpus of real payloads ------------------------------------------------------------

/** One real webhook payload of `tests/corpus/whatsapp/*.json` (see its SOURCES.md). */
export interface CorpusSample {
  /** Unique within its file. */
  name: string;
  /** A URL of Meta's documentation, or `owner/repo/path@commit`. */
  source: string;
  licence: string;
  // deno-lint-ignore no-explicit-any
  payload: any;
}

const corpusDir = new URL("../corpus/whatsapp/", import.meta.url);

/** Every sample of every corpus file, with the file name. */
export async function loadCorpus(): Promise<(CorpusSample & { file: string })[]> {
  const { readdirSync, readFileSync } = await import("node:fs");
  const { fileURLToPath } = await import("node:url");
  const dir = fileURLToPath(corpusDir);
  const out: (CorpusSample & { file: string })[] = [];
  for (const file of readdirSync(dir).filter((f) => f.endsWith(".json")).sort()) {
    const samples = JSON.parse(readFileSync(`${dir}/${file}`, "utf8")) as CorpusSample[];
    for (const sample of samples) out.push({ ...sample, file });
  }
  return out;
}

/** The sample `name` of corpus file `file` (a deep copy of its payload). */
export async function corpusPayload(file: string, name: string): Promise<Record<string, unknown>> {
  const sample = (await loadCorpus()).find((s) => s.file === file && s.name === name);
  if (!sample) throw new Error(`no corpus sample ${JSON.stringify(name)} in ${file}`);
  return structuredClone(sample.payload);
}

/**
 * The payload addressed to `phoneNumberId`: every change's `metadata.phone_number_id` is set to it,
 * nothing else changes (the samples come from different accounts; a provider admits only its own).
 */
// deno-lint-ignore no-explicit-any
export function addressedTo(payload: any, phoneNumberId: string): any {
  const copy = structuredClone(payload);
  for (const entry of Array.isArray(copy?.entry) ? copy.entry : []) {
    for (const change of Array.isArray(entry?.changes) ? entry.changes : []) {
      if (change?.value?.metadata && typeof change.value.metadata === "object") change.value.metadata.phone_number_id = phoneNumberId;
    }
  }
  return copy;
}
