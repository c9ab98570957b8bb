/**
 * A fake Telegram Bot API server on loopback (Bun.serve, port 0) that speaks the
 * real HTTP API: `/bot<token>/<method>` with JSON, form or multipart parameters,
 * `/file/bot<token>/<file_path>` downloads, Telegram's envelopes
 * (`{ ok: true, result }`, `{ ok: false, error_code, description, parameters? }`).
 *
 * It keeps a queue of updates for `getUpdates` with offset semantics (an offset
 * confirms and drops every older update; a long poll waits up to `timeout`
 * seconds; a second concurrent `getUpdates` ends the first with 409), records
 * sends with increasing `message_id`s per chat, serves files, and injects
 * faults per method: a status with Telegram's error body (429 with
 * `retry_after`, 5xx, 400/403), a hang, or a malformed body. It can also
 * deliver updates to a webhook URL as Telegram does (secret header, retried on
 * a non-2xx answer). With `limits` it enforces Telegram's flood limits on
 * sends (at most `count` accepted sends in any window of `perMs`: overall,
 * per private chat, per group: a negative chat id), answering 429 with
 * `retry_after` (whole seconds, at least 1) as Telegram does.
 *
 * It keeps each sent message's text and inline keyboard, which `editMessageText` and
 * `editMessageReplyMarkup` change (an edit of the text without `reply_markup` removes the keyboard, as
 * on Telegram); `pressUpdate` makes a button press of a message as it is now. With `repeats: true`
 * it refuses what Telegram refuses to a repeat: a second answer of a callback query ("query is too
 * old"), an edit to the content the message already has ("message is not modified"); with
 * `queryTtlMs`, an answer of a query (of `callbackUpdate`/`pressUpdate`) older than that too.
 */

/** At most `count` sends in any window of `perMs` ms. */
export interface FakeLimit {
  count: number;
  perMs: number;
}

/** The flood limits the fake enforces (Telegram's: 30/s overall, 1/s per chat, 20/min per group). */
export interface FakeLimits {
  global?: FakeLimit;
  perChat?: FakeLimit;
  perGroup?: FakeLimit;
}

/** Telegram's limits, `factor` times faster (the windows shrink). */
export function telegramLimits(factor = 1): FakeLimits {
  return {
    global: { count: 30, perMs: 1000 / factor },
    perChat: { count: 1, perMs: 1000 / factor },
    perGroup: { count: 20, perMs: 60_000 / factor },
  };
}

export interface FakeSend {
  method: string;
  chatId: string;
  params: Record<string, unknown>;
  messageId: number;
  /** When the fake received it (ms since epoch). */
  at: number;
}

export interface FakeCall {
  method: string;
  params: Record<string, unknown>;
  at: number;
  /** The HTTP status the fake answered. */
  status: number;
}

export type Fault =
  | { kind: "status"; status: number; description?: string; retryAfter?: number }
  | { kind: "hang" }
  | { kind: "body"; body: string; status?: number }
  | { kind: "garbage-ok" };

interface Waiter {
  resolve: () => void;
}

interface StoredFile {
  fileId: string;
  fileUniqueId: string;
  path: string;
  data: Uint8Array;
  mimeType?: string;
}

const DESCRIPTIONS: Record<number, string> = {
  400: "Bad Request: chat not found",
  401: "Unauthorized",
  403: "Forbidden: bot was blocked by the user",
  404: "Not Found",
  409: "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running",
  429: "Too Many Requests: retry after 1",
  500: "Internal Server Error",
  502: "Bad Gateway",
};

/** A sent message as it is now (after its edits). */
export interface FakeMessage {
  text?: string;
  reply_markup?: unknown;
}

const NOT_MODIFIED =
  "Bad Request: message is not modified: specified new message content and reply markup are exactly the same as a content and reply markup of the current message";
const QUERY_TOO_OLD = "Bad Request: query is too old and response timeout expired or query ID is invalid";

export class FakeTelegram {
  readonly token: string;
  readonly botId: number;
  /** Every API call, in arrival order. */
  readonly calls: FakeCall[] = [];
  /** Successful sends, in order. */
  readonly sent: FakeSend[] = [];
  /** answerCallbackQuery ids. */
  readonly answeredCallbacks: string[] = [];
  /** Successful `editMessageText` calls. */
  readonly edits: { chatId: string; messageId: number; text: string }[] = [];
  /** Successful `editMessageReplyMarkup` calls. */
  readonly markupEdits: { chatId: string; messageId: number; reply_markup: unknown }[] = [];
  /** The offsets getUpdates was called with (undefined when none was given). */
  readonly offsets: (number | undefined)[] = [];
  /** The highest offset a getUpdates confirmed. */
  confirmedOffset = 0;
  /** The webhook set with setWebhook ("" when none). */
  webhookUrl = "";
  #server: ReturnType<typeof Bun.serve> | undefined;
  #queue: Record<string, unknown>[] = [];
  #nextUpdateId = 100_000;
  #nextMessageId = new Map<string, number>();
  #faults = new Map<string, Fault[]>();
  #waiters: Waiter[] = [];
  #activePoll: (() => void) | undefined;
  #files = new Map<string, StoredFile>();
  #blocked = new Set<string>();
  #hangs = new Set<() => void>();
  #callListeners: (() => void)[] = [];
  #limits: FakeLimits | undefined;
  /** Accepted send times (performance.now()) per limit key, oldest first. */
  #windows = new Map<string, number[]>();
  /** Sends answered 429 for a flood limit (not injected faults). */
  floodRefusals = 0;
  /** Each sent message as it is now, by `<chat id>:<message_id>`. */
  #messages = new Map<string, FakeMessage>();
  /** Refuse repeated answers and edits as Telegram does. */
  #repeats: boolean;
  #queryTtlMs: number | undefined;
  /** When each callback query of `callbackUpdate`/`pressUpdate` was made (ms since epoch). */
  #queries = new Map<string, number>();
  #answered = new Set<string>();

  constructor(options: { token?: string; limits?: FakeLimits; repeats?: boolean; queryTtlMs?: number } = {}) {
    this.token = options.token ?? "123456789:AAH-fake_secret_token_part_0123456789";
    this.botId = Number(this.token.split(":")[0]);
    this.#limits = options.limits;
    this.#repeats = options.repeats ?? false;
    this.#queryTtlMs = options.queryTtlMs;
  }

  /** A sent message as it is now (its text and inline keyboard after the edits), if it was sent. */
  message(chatId: string | number, messageId: number): FakeMessage | undefined {
    const m = this.#messages.get(`${chatId}:${messageId}`);
    return m === undefined ? undefined : { ...m };
  }

  /** Enforce `limits` from now on (`undefined`: none). */
  enforce(limits: FakeLimits | undefined): void {
    this.#limits = limits;
    this.#windows.clear();
  }

  /**
   * The flood check of a send to `chatId` arriving at `at`: `null` when accepted (and counted), else
   * the ms until the window that refuses it frees a place.
   */
  #flood(chatId: string, at: number): number | null {
    const limits = this.#limits;
    if (!limits) return null;
    const group = chatId.startsWith("-");
    const checks: [string, FakeLimit | undefined][] = [
      ["global", limits.global],
      [`chat:${chatId}`, group ? limits.perGroup : limits.perChat],
    ];
    let wait = 0;
    for (const [key, limit] of checks) {
      if (!limit) continue;
      const times = this.#windows.get(key) ?? [];
      while (times.length > 0 && times[0]! <= at - limit.perMs) times.shift();
      this.#windows.set(key, times);
      if (times.length >= limit.count) wait = Math.max(wait, times[0]! + limit.perMs - at);
    }
    if (wait > 0) return wait;
    for (const [key, limit] of checks) if (limit) this.#windows.get(key)!.push(at);
    return null;
  }

  /** The apiBase for the provider. */
  get url(): string {
    if (!this.#server) throw new Error("FakeTelegram is not started");
    return `http://127.0.0.1:${this.#server.port}`;
  }

  start(): this {
    this.#server = Bun.serve({ port: 0, hostname: "127.0.0.1", fetch: (request) => this.#handle(request) });
    return this;
  }

  async stop(): Promise<void> {
    for (const release of this.#hangs) release();
    for (const w of this.#waiters.splice(0)) w.resolve();
    await this.#server?.stop(true);
  }

  // ---- scripting ------------------------------------------------------------------

  /** Queue an update for getUpdates; `update_id` is assigned when missing. Returns the update. */
  push(update: Record<string, unknown>): Record<string, unknown> {
    const u = { ...update };
    if (typeof u.update_id !== "number") u.update_id = this.#nextUpdateId++;
    else this.#nextUpdateId = Math.max(this.#nextUpdateId, (u.update_id as number) + 1);
    this.#queue.push(u);
    this.#queue.sort((a, b) => (a.update_id as number) - (b.update_id as number));
    for (const w of this.#waiters.splice(0)) w.resolve();
    return u;
  }

  /** Put an update back (a redelivery: same update_id), even if it was confirmed. */
  redeliver(update: Record<string, unknown>): void {
    this.#queue.push({ ...update });
    this.#queue.sort((a, b) => (a.update_id as number) - (b.update_id as number));
    for (const w of this.#waiters.splice(0)) w.resolve();
  }

  /** Updates still waiting to be confirmed. */
  get pending(): number {
    return this.#queue.length;
  }

  /** The inbound id the provider gives an update: `tg:<bot>:<update_id>:<chat>:<message_id>`, or `tg:<bot>:<update_id>:cb:<query id>`. */
  inboundId(update: Record<string, unknown>): string {
    const q = update.callback_query as { id: string } | undefined;
    if (q) return `tg:${this.botId}:${update.update_id}:cb:${q.id}`;
    const m = (update.message ?? update.channel_post) as { chat: { id: number }; message_id: number };
    return `tg:${this.botId}:${update.update_id}:${m.chat.id}:${m.message_id}`;
  }

  /** A new update with a text message (not queued). */
  textUpdate(chatId: number, text: string, extra: Record<string, unknown> = {}): Record<string, unknown> {
    return { update_id: this.#nextUpdateId++, message: { ...this.#messageBase(chatId), text, ...extra } };
  }

  /** A new update with a media message whose file is stored at the fake (not queued). */
  mediaUpdate(
    chatId: number,
    kind: "photo" | "document" | "voice" | "audio" | "video",
    data: Uint8Array,
    options: { caption?: string; mimeType?: string; fileName?: string; fileSize?: number } = {},
  ): { update: Record<string, unknown>; fileId: string } {
    const file = this.addFile(data, { mimeType: options.mimeType, ext: kind === "photo" ? "jpg" : "bin" });
    const base = { file_id: file.fileId, file_unique_id: file.fileUniqueId, file_size: options.fileSize ?? data.byteLength };
    let value: unknown;
    if (kind === "photo") {
      value = [
        { file_id: `${file.fileId}-thumb`, file_unique_id: `${file.fileUniqueId}-t`, width: 90, height: 90, file_size: 10 },
        { ...base, width: 800, height: 600 },
      ];
    } else {
      value = {
        ...base,
        ...(options.mimeType ? { mime_type: options.mimeType } : {}),
        ...(options.fileName ? { file_name: options.fileName } : {}),
        ...(kind === "voice" || kind === "audio" || kind === "video" ? { duration: 3 } : {}),
      };
    }
    const message = { ...this.#messageBase(chatId), [kind]: value, ...(options.caption ? { caption: options.caption } : {}) };
    return { update: { update_id: this.#nextUpdateId++, message }, fileId: file.fileId };
  }

  /** A new callback_query update (not queued). */
  callbackUpdate(chatId: number, data: string): Record<string, unknown> {
    const queryId = `cbq-${crypto.randomUUID().slice(0, 8)}`;
    this.#queries.set(queryId, Date.now());
    return {
      update_id: this.#nextUpdateId++,
      callback_query: {
        id: queryId,
        from: { id: chatId, is_bot: false, first_name: "Ada" },
        message: { message_id: 1, date: Math.floor(Date.now() / 1000), chat: { id: chatId, type: "private" }, text: "Pick one" },
        chat_instance: "-42",
        data,
      },
    };
  }

  /**
   * A new callback_query update (not queued): a press of the button with `data` of the sent message
   * `messageId`, as the message is now (its text and keyboard).
   */
  pressUpdate(chatId: number, messageId: number, data: string): Record<string, unknown> {
    const m = this.#messages.get(`${chatId}:${messageId}`);
    if (m === undefined) throw new Error(`no message ${messageId} was sent to chat ${chatId}`);
    const queryId = `cbq-${crypto.randomUUID().slice(0, 8)}`;
    this.#queries.set(queryId, Date.now());
    return {
      update_id: this.#nextUpdateId++,
      callback_query: {
        id: queryId,
        from: { id: chatId, is_bot: false, first_name: "Ada" },
        message: {
          message_id: messageId,
          date: Math.floor(Date.now() / 1000),
          chat: { id: chatId, type: "private" },
          from: { id: this.botId, is_bot: true, first_name: "Fake" },
          ...(m.text !== undefined ? { text: m.text } : {}),
          ...(m.reply_markup !== undefined ? { reply_markup: m.reply_markup } : {}),
        },
        chat_instance: "-42",
        data,
      },
    };
  }

  #messageBase(chatId: number): Record<string, unknown> {
    return {
      message_id: Math.floor(Math.random() * 1e6),
      from: { id: chatId, is_bot: false, first_name: "Ada", username: "ada" },
      chat: { id: chatId, type: "private", first_name: "Ada" },
      date: Math.floor(Date.now() / 1000),
    };
  }

  addFile(data: Uint8Array, options: { mimeType?: string; ext?: string } = {}): StoredFile {
    const n = this.#files.size + 1;
    const file: StoredFile = {
      fileId: `BQACAgIAAxk-${n}-${crypto.randomUUID().slice(0, 8)}`,
      fileUniqueId: `AgAD${n}`,
      path: `files/file_${n}.${options.ext ?? "bin"}`,
      data,
      ...(options.mimeType ? { mimeType: options.mimeType } : {}),
    };
    this.#files.set(file.fileId, file);
    return file;
  }

  /** Telegram forgets the file: getFile answers 400. */
  deleteFile(fileId: string): void {
    this.#files.delete(fileId);
  }

  /** Sends to this chat answer 403 "bot was blocked by the user". */
  block(chatId: string | number): void {
    this.#blocked.add(String(chatId));
  }

  /** The next `times` calls of `method` (or `"*"`) get `fault`. */
  inject(method: string, fault: Fault, times = 1): void {
    const list = this.#faults.get(method) ?? [];
    for (let i = 0; i < times; i++) list.push(fault);
    this.#faults.set(method, list);
  }

  /** Resolves once `check()` holds (or resolves to true), re-checked after each API call (and every 50 ms). */
  async until(what: string, check: () => boolean | Promise<boolean>, timeoutMs = 10_000): Promise<void> {
    const end = Date.now() + timeoutMs;
    while (!(await check())) {
      if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
      await new Promise<void>((resolve) => {
        const timer = setTimeout(done, 50);
        function done() {
          clearTimeout(timer);
          resolve();
        }
        this.#callListeners.push(done);
      });
    }
  }

  /**
   * POST an update to a webhook as Telegram does: JSON, the secret header;
   * on a non-2xx answer it tries again (up to `attempts`, `retryDelayMs` apart).
   * Returns the statuses it got.
   */
  async deliverWebhook(
    url: string,
    update: Record<string, unknown>,
    options: { secret?: string; attempts?: number; retryDelayMs?: number } = {},
  ): Promise<number[]> {
    const statuses: number[] = [];
    const attempts = options.attempts ?? 1;
    for (let i = 0; i < attempts; i++) {
      const response = await fetch(url, {
        method: "POST",
        headers: {
          "content-type": "application/json",
          ...(options.secret !== undefined ? { "x-telegram-bot-api-secret-token": options.secret } : {}),
        },
        body: JSON.stringify(update),
      });
      await response.arrayBuffer();
      statuses.push(response.status);
      if (response.ok) break;
      await new Promise((resolve) => setTimeout(resolve, options.retryDelayMs ?? 50));
    }
    return statuses;
  }

  // ---- the server ---------------------------------------------------------------

  #notify(): void {
    for (const listener of this.#callListeners.splice(0)) listener();
  }

  async #handle(request: Request): Promise<Response> {
    const url = new URL(request.url);
    const file = /^\/file\/bot([^/]+)\/(.+)$/.exec(url.pathname);
    if (file) {
      if (file[1] !== this.token) return this.#error(401);
      const path = decodeURIComponent(file[2]!);
      const stored = [...this.#files.values()].find((f) => f.path === path);
      if (!stored) return this.#error(404);
      return new Response(stored.data as Uint8Array<ArrayBuffer>, {
        headers: { "content-type": stored.mimeType ?? "application/octet-stream" },
      });
    }
    const m = /^\/bot([^/]*)\/([A-Za-z]+)$/.exec(url.pathname);
    if (!m) return this.#error(404);
    const [, token, method] = m as unknown as [string, string, string];
    const arrivedAt = performance.now();
    const params = await this.#params(request, url);
    const call: FakeCall = { method, params, at: Date.now(), status: 0 };
    this.calls.push(call);
    this.#notify();
    const record = (status: number) => {
      call.status = status;
      this.#notify();
    };
    if (token !== this.token) {
      record(401);
      return this.#error(401);
    }
    const fault = this.#faults.get(method)?.shift() ?? this.#faults.get("*")?.shift();
    if (fault) {
      if (fault.kind === "hang") {
        record(0);
        await new Promise<void>((resolve) => {
          this.#hangs.add(resolve);
          request.signal.addEventListener("abort", () => resolve(), { once: true });
        });
        return new Response("", { status: 504 });
      }
      if (fault.kind === "body") {
        record(fault.status ?? 200);
        return new Response(fault.body, { status: fault.status ?? 200, headers: { "content-type": "application/json" } });
      }
      if (fault.kind === "garbage-ok") {
        record(200);
        return Response.json({ ok: true, result: { chat: { id: 1 } } });
      }
      record(fault.status);
      return this.#error(fault.status, fault.description, fault.retryAfter);
    }
    const response = await this.#method(method, params, request.signal, arrivedAt);
    record(response.status);
    return response;
  }

  async #params(request: Request, url: URL): Promise<Record<string, unknown>> {
    const params: Record<string, unknown> = Object.fromEntries(url.searchParams);
    if (request.method !== "POST") return params;
    const type = request.headers.get("content-type") ?? "";
    // Telegraf's node-fetch under Bun gzips request bodies (`compress: true`).
    if (request.headers.get("content-encoding") === "gzip" && request.body !== null) {
      const headers = new Headers(request.headers);
      headers.delete("content-encoding");
      headers.delete("content-length");
      request = new Request(request.url, { method: request.method, headers, body: Bun.gunzipSync(new Uint8Array(await request.arrayBuffer())) });
    }
    try {
      if (type.includes("application/json")) {
        const text = await request.text();
        if (text !== "") Object.assign(params, JSON.parse(text));
      } else if (type.includes("multipart/form-data") || type.includes("application/x-www-form-urlencoded")) {
        const form = await request.formData();
        for (const [key, value] of form) {
          params[key] = typeof value === "string" ? value : { upload: value.name, size: value.size };
        }
      }
    } catch {
      params.__unparsable = true;
    }
    return params;
  }

  #error(status: number, description?: string, retryAfter?: number): Response {
    return Response.json({
      ok: false,
      error_code: status,
      description: description ?? DESCRIPTIONS[status] ?? `Error ${status}`,
      ...(retryAfter !== undefined ? { parameters: { retry_after: retryAfter } } : {}),
    }, { status });
  }

  #ok(result: unknown): Response {
    return Response.json({ ok: true, result });
  }

  async #method(method: string, params: Record<string, unknown>, signal: AbortSignal, arrivedAt: number): Promise<Response> {
    if (params.__unparsable) return this.#error(400, "Bad Request: can't parse request body");
    switch (method) {
      case "getMe":
        return this.#ok({ id: this.botId, is_bot: true, first_name: "Fake", username: "fake_bot" });
      case "setWebhook":
        this.webhookUrl = String(params.url ?? "");
        return this.#ok(true);
      case "deleteWebhook":
        this.webhookUrl = "";
        return this.#ok(true);
      case "getUpdates":
        return await this.#getUpdates(params, signal);
      case "answerCallbackQuery": {
        const id = String(params.callback_query_id);
        const made = this.#queries.get(id);
        if (this.#repeats && this.#answered.has(id)) return this.#error(400, QUERY_TOO_OLD);
        if (this.#queryTtlMs !== undefined && made !== undefined && Date.now() - made > this.#queryTtlMs) return this.#error(400, QUERY_TOO_OLD);
        this.#answered.add(id);
        this.answeredCallbacks.push(id);
        return this.#ok(true);
      }
      case "getFile": {
        const stored = this.#files.get(String(params.file_id ?? ""));
        if (!stored) return this.#error(400, "Bad Request: wrong file_id or the file is temporarily unavailable");
        return this.#ok({ file_id: stored.fileId, file_unique_id: stored.fileUniqueId, file_size: stored.data.byteLength, file_path: stored.path });
      }
      case "sendChatAction":
        return this.#ok(true);
      case "editMessageText": {
        const chatId = String(params.chat_id ?? "");
        const edited = this.sent.find((m) => m.chatId === chatId && m.messageId === Number(params.message_id));
        if (!edited) return this.#error(400, "Bad Request: message to edit not found");
        const key = `${chatId}:${edited.messageId}`;
        const now: FakeMessage = { text: String(params.text ?? ""), reply_markup: params.reply_markup };
        if (this.#repeats && sameMessage(this.#messages.get(key), now)) return this.#error(400, NOT_MODIFIED);
        this.#messages.set(key, now);
        this.edits.push({ chatId, messageId: edited.messageId, text: String(params.text ?? "") });
        return this.#ok({ message_id: edited.messageId, date: Math.floor(edited.at / 1000), chat: { id: Number(chatId), type: "private" }, text: params.text });
      }
      case "editMessageReplyMarkup": {
        const chatId = String(params.chat_id ?? "");
        const edited = this.sent.find((m) => m.chatId === chatId && m.messageId === Number(params.message_id));
        if (!edited) return this.#error(400, "Bad Request: message to edit not found");
        const key = `${chatId}:${edited.messageId}`;
        const before = this.#messages.get(key) ?? {};
        const now: FakeMessage = { ...before, reply_markup: params.reply_markup };
        if (this.#repeats && sameMessage(before, now)) return this.#error(400, NOT_MODIFIED);
        this.#messages.set(key, now);
        this.markupEdits.push({ chatId, messageId: edited.messageId, reply_markup: params.reply_markup });
        return this.#ok({
          message_id: edited.messageId,
          date: Math.floor(edited.at / 1000),
          chat: { id: Number(chatId), type: "private" },
          ...(now.text !== undefined ? { text: now.text } : {}),
          ...(now.reply_markup !== undefined ? { reply_markup: now.reply_markup } : {}),
        });
      }
      default: {
        if (!/^(send[A-Z]\w*|copyMessage|forwardMessage)$/.test(method)) return this.#error(404);
        const chatId = params.chat_id;
        if (chatId === undefined || chatId === "") return this.#error(400, "Bad Request: chat_id is empty");
        if (this.#blocked.has(String(chatId))) return this.#error(403);
        const flood = this.#flood(String(chatId), arrivedAt);
        if (flood !== null) {
          this.floodRefusals++;
          const retryAfter = Math.max(1, Math.ceil(flood / 1000));
          return this.#error(429, `Too Many Requests: retry after ${retryAfter}`, retryAfter);
        }
        if (method === "sendMessage" && (typeof params.text !== "string" || params.text === "")) {
          return this.#error(400, "Bad Request: message text is empty");
        }
        const next = (this.#nextMessageId.get(String(chatId)) ?? 0) + 1;
        this.#nextMessageId.set(String(chatId), next);
        this.sent.push({ method, chatId: String(chatId), params, messageId: next, at: Date.now() });
        this.#messages.set(`${chatId}:${next}`, {
          ...(typeof params.text === "string" ? { text: params.text } : {}),
          ...(params.reply_markup !== undefined ? { reply_markup: params.reply_markup } : {}),
        });
        return this.#ok({
          message_id: next,
          date: Math.floor(Date.now() / 1000),
          chat: { id: Number(chatId), type: "private" },
          ...(typeof params.text === "string" ? { text: params.text } : {}),
        });
      }
    }
  }

  async #getUpdates(params: Record<string, unknown>, signal: AbortSignal): Promise<Response> {
    if (this.webhookUrl !== "") {
      return this.#error(409, "Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to delete the webhook first");
    }
    // A newer getUpdates ends the one that is waiting, as Telegram does.
    this.#activePoll?.();
    const offset = params.offset === undefined ? undefined : Number(params.offset);
    this.offsets.push(offset);
    if (offset !== undefined && offset > 0) {
      this.confirmedOffset = Math.max(this.confirmedOffset, offset);
      this.#queue = this.#queue.filter((u) => (u.update_id as number) >= offset);
    }
    const limit = Math.min(100, Math.max(1, Number(params.limit ?? 100)));
    const timeoutSec = Number(params.timeout ?? 0);
    const end = Date.now() + timeoutSec * 1000;
    let conflicted = false;
    const me = () => {
      conflicted = true;
      for (const w of this.#waiters.splice(0)) w.resolve();
    };
    this.#activePoll = me;
    try {
      while (this.#queue.length === 0 && Date.now() < end && !signal.aborted && !conflicted) {
        await new Promise<void>((resolve) => {
          const timer = setTimeout(done, end - Date.now());
          const waiter = { resolve: done };
          function done() {
            clearTimeout(timer);
            signal.removeEventListener("abort", done);
            resolve();
          }
          signal.addEventListener("abort", done, { once: true });
          this.#waiters.push(waiter);
        });
      }
    } finally {
      if (this.#activePoll === me) this.#activePoll = undefined;
    }
    if (conflicted) return this.#error(409);
    return this.#ok(this.#queue.slice(0, limit));
  }
}

/** Whether an edit leaves a message as it was (its text and keyboard): Telegram's "message is not modified". */
function sameMessage(before: FakeMessage | undefined, after: FakeMessage): boolean {
  if (before === undefined) return false;
  return before.text === after.text && JSON.stringify(before.reply_markup ?? null) === JSON.stringify(after.reply_markup ?? null);
}
