/**
 * The web DLQ console: a server-rendered operations view of the durable
 * inbox and outbox, as a Web-standard `(request: Request) => Promise<Response>`
 * handler that mounts in `Bun.serve`, `Deno.serve`, or Node's `http` through
 * {@link nodeHandler}.
 *
 * Views (plain HTML, no JavaScript): an overview with counts per state, a
 * list per journal and state (chat filter, limit), and one record. Actions
 * (replay an inbound record, retry or discard a send) each go through a
 * confirmation page whose form POSTs with a CSRF token; a GET never changes
 * anything. Every request must pass `auth`.
 *
 * @module
 */
import { checkKnownOptions } from "../options.ts";
import type {
  DamagedRecord,
  DurabilityBackend,
  InboundRecord,
  InboundState,
  JsonValue,
  ListOptions,
  OutboxEntry,
  OutboxState,
} from "../contract.ts";
import { type DurabilityControl, type DurabilityMetrics, listDamaged } from "../engine.ts";
import { html, type HtmlValue, SafeHtml } from "./html.ts";

/** Who is using the console, as established by {@link ConsoleAuth}. */
export interface ConsoleIdentity {
  /** The operator's name (shown in the page, bound into every CSRF token). */
  user: string;
}

/**
 * Authenticates a console request: the identity, or `null` to refuse it (401).
 * When the function has a `challenge` property (as {@link basicAuth}'s does),
 * a refused request gets it as its `WWW-Authenticate` header.
 */
export type ConsoleAuth =
  & ((request: Request) => Promise<ConsoleIdentity | null> | ConsoleIdentity | null)
  & { readonly challenge?: string };

/** Options of {@link durabilityConsole}. */
export interface DurabilityConsoleOptions {
  /**
   * Where the console is mounted, e.g. `"/ops/dlq"` (default `""`: the root).
   * Must start with `/` and not end with one. Requests outside it get 404.
   */
  basePath?: string;
  /** Required: authenticates every request (reads and writes); see {@link basicAuth}. */
  auth: ConsoleAuth;
  /**
   * The key of the CSRF tokens' HMAC, at least 16 bytes (a string or bytes).
   * Default: random per handler (tokens then do not survive a restart or
   * work across replicas behind a load balancer; give a shared secret there).
   */
  csrfSecret?: string | Uint8Array;
  /** The page title (default `"Durability console"`). */
  title?: string;
  /** Counts on the overview stop at this many per state, shown as `N+` (default 1000, 1…100000). */
  countCap?: number;
  /** How long a confirmation page's token stays valid, in ms (default 1 hour, 1 s…24 h). */
  tokenMaxAgeMs?: number;
}

/** The part of a `Bot` the console uses: its operator surface. */
export interface ConsoleBot {
  /** `bot.durability`: `undefined` when the bot has no durability configured. */
  readonly durability: DurabilityControl | undefined;
}

/** What the console operates on: a bot (actions go through `bot.durability`) or a bare backend. */
export type ConsoleTarget = ConsoleBot | DurabilityBackend;

/** A Web-standard request handler. */
export type ConsoleHandler = (request: Request) => Promise<Response>;

const INBOUND_STATES: readonly InboundState[] = ["pending", "processing", "failed", "done", "dead"];
const OUTBOUND_STATES: readonly OutboxState[] = ["queued", "sending", "failed", "sent", "dead", "unknown"];
const DEFAULT_LIMIT = 50;
const MAX_LIMIT = 1000;
const MAX_FORM_BYTES = 16 * 1024;
const MAX_PARAM_CHARS = 1024;
const MAX_SHOWN_JSON = 256 * 1024;

type Journal = "inbound" | "outbound";
type ActionName = "replay" | "retry" | "discard";

interface ActionSpec {
  journal: Journal;
  name: ActionName;
  label: string;
  /** The states the record may be in for the action. */
  allowed: readonly string[];
  explain: string;
  notice: string;
}

const ACTIONS: Record<string, ActionSpec> = {
  "inbound/replay": {
    journal: "inbound",
    name: "replay",
    label: "Replay",
    allowed: ["done", "failed", "dead"],
    explain: "The record is made pending again (attempts reset) and its handler runs again.",
    notice: "Replayed: the record is pending again.",
  },
  "outbound/retry": {
    journal: "outbound",
    name: "retry",
    label: "Retry",
    allowed: ["dead", "failed", "unknown"],
    explain:
      "The send is queued again (attempts reset) and the provider is called again. For an unknown send the message may be delivered twice.",
    notice: "Retried: the send is queued again.",
  },
  "outbound/discard": {
    journal: "outbound",
    name: "discard",
    label: "Discard",
    allowed: ["queued", "failed", "sent", "dead", "unknown"],
    explain: "The entry is deleted from the outbox. It will not be sent, and its idempotency key is forgotten.",
    notice: "Discarded.",
  },
};

const SECURITY_HEADERS: Record<string, string> = {
  "content-security-policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'",
  "x-frame-options": "DENY",
  "referrer-policy": "no-referrer",
  "cache-control": "no-store",
  "x-content-type-options": "nosniff",
};

/** The operations the console needs, over a bot or a backend. */
interface Ops {
  inboxList(options: ListOptions<InboundState>): Promise<InboundRecord[]>;
  inboxGet(id: string): Promise<InboundRecord | null>;
  outboxList(options: ListOptions<OutboxState>): Promise<OutboxEntry[]>;
  outboxGet(key: string): Promise<OutboxEntry | null>;
  replay(id: string): Promise<boolean>;
  retry(key: string): Promise<boolean>;
  discard(key: string): Promise<boolean>;
  damaged(options: { limit: number }): Promise<DamagedRecord[]>;
  /** This process's counters (a bot only). */
  metrics?: () => DurabilityMetrics;
}

function isObject(value: unknown): value is Record<string, unknown> {
  return (typeof value === "object" || typeof value === "function") && value !== null;
}

function opsOf(target: unknown): Ops {
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
      damaged: (o) => d().damaged(o),
      metrics: () => d().metrics(),
    };
  }
  const backend = target as unknown as DurabilityBackend;
  if (!isObject(backend.inbox) || !isObject(backend.outbox) || typeof backend.inbox.list !== "function") {
    throw new TypeError(`Argument "target" must be a Bot or a DurabilityBackend (with inbox and outbox journals)`);
  }
  return {
    inboxList: (o) => backend.inbox.list(o),
    inboxGet: (id) => backend.inbox.get(id),
    outboxList: (o) => backend.outbox.list(o),
    outboxGet: (key) => backend.outbox.get(key),
    replay: (id) => backend.inbox.replay(id),
    retry: (key) => backend.outbox.retry(key),
    discard: (key) => backend.outbox.discard(key),
    damaged: (o) => listDamaged(backend, o),
  };
}

// ---------------------------------------------------------------------------
// Crypto helpers (Web Crypto only)

const encoder = new TextEncoder();

function base64url(bytes: Uint8Array): string {
  let binary = "";
  for (const b of bytes) binary += String.fromCharCode(b);
  return btoa(binary).replace(/\+/g, "-").replace(/\//g, "_").replace(/=+$/, "");
}

/** Compare two byte strings in constant time (lengths are public: digests and tokens have fixed sizes). */
function constantTimeEqual(a: Uint8Array, b: Uint8Array): boolean {
  if (a.length !== b.length) return false;
  let diff = 0;
  for (let i = 0; i < a.length; i++) diff |= a[i]! ^ b[i]!;
  return diff === 0;
}

async function sha256(text: string): Promise<Uint8Array> {
  return new Uint8Array(await crypto.subtle.digest("SHA-256", encoder.encode(text)));
}

// ---------------------------------------------------------------------------
// Basic auth

/** Options of {@link basicAuth}. */
export interface BasicAuthOptions {
  /** The realm shown by the browser (default `"Durability console"`). */
  realm?: string;
}

/**
 * HTTP Basic authentication for one operator account, for {@link durabilityConsole}'s
 * `auth`. Credentials are compared in constant time (SHA-256 digests of both
 * sides); a refused request gets `WWW-Authenticate: Basic realm="…", charset="UTF-8"`.
 * Use it only over HTTPS (or on localhost): Basic credentials are not encrypted.
 *
 * @param user the expected user name (non-empty, no `:`)
 * @param password the expected password (non-empty)
 * @param options `realm`
 * @returns an auth function whose identity is `{ user }`
 * @throws {TypeError} when `user` or `password` is not a non-empty string, or `user` contains `:`
 * @example
 * ```ts
 * import { Bot, MemoryDurability } from "@botmesh/durable";
 * import { MockProvider } from "@botmesh/durable/testing";
 * const bot = new Bot({ provider: new MockProvider(), durability: { backend: new MemoryDurability(), instanceId: "bot-1" } });
 * import { basicAuth, durabilityConsole } from "@botmesh/durable/ops";
 * const handler = durabilityConsole(bot, { auth: basicAuth("ops", "a-long-password-from-your-vault") });
 * ```
 */
export function basicAuth(user: string, password: string, options: BasicAuthOptions = {}): ConsoleAuth {
  if (typeof user !== "string" || user === "" || user.includes(":")) {
    throw new TypeError(`Argument "user" must be a non-empty string without ":", got ${JSON.stringify(user) ?? typeof user}`);
  }
  if (typeof password !== "string" || password === "") {
    throw new TypeError(`Argument "password" must be a non-empty string`);
  }
  const realm = options.realm ?? "Durability console";
  if (typeof realm !== "string" || /["\\\r\n]/.test(realm)) {
    throw new TypeError(`Option "realm" must be a string without quotes, backslashes or line breaks`);
  }
  const expected = Promise.all([sha256(`u:${user}`), sha256(`p:${password}`)]);
  const check = async (request: Request): Promise<ConsoleIdentity | null> => {
    const header = request.headers.get("authorization");
    const match = header ? /^Basic[ ]+([A-Za-z0-9+/]+={0,2})[ ]*$/i.exec(header) : null;
    if (!match) return null;
    let decoded: string;
    try {
      const binary = atob(match[1]!);
      decoded = new TextDecoder("utf-8", { fatal: true }).decode(Uint8Array.from(binary, (c) => c.charCodeAt(0)));
    } catch {
      return null;
    }
    const colon = decoded.indexOf(":");
    if (colon < 0) return null;
    const [wantUser, wantPassword] = await expected;
    const [gotUser, gotPassword] = await Promise.all([
      sha256(`u:${decoded.slice(0, colon)}`),
      sha256(`p:${decoded.slice(colon + 1)}`),
    ]);
    // Both comparisons always run (no short circuit).
    const userOk = constantTimeEqual(wantUser, gotUser);
    const passwordOk = constantTimeEqual(wantPassword, gotPassword);
    return userOk && passwordOk ? { user } : null;
  };
  return Object.assign(check, { challenge: `Basic realm="${realm}", charset="UTF-8"` });
}

// ---------------------------------------------------------------------------
// CSRF tokens

class CsrfTokens {
  #key: Promise<CryptoKey>;
  #maxAgeMs: number;

  constructor(secret: Uint8Array<ArrayBuffer>, maxAgeMs: number) {
    this.#key = crypto.subtle.importKey("raw", secret, { name: "HMAC", hash: "SHA-256" }, false, ["sign", "verify"]);
    this.#maxAgeMs = maxAgeMs;
  }

  async #mac(user: string, action: string, id: string, issuedAt: number): Promise<Uint8Array> {
    const message = encoder.encode(JSON.stringify(["botmesh-console-csrf-v1", user, action, id, issuedAt]));
    return new Uint8Array(await crypto.subtle.sign("HMAC", await this.#key, message));
  }

  async issue(user: string, action: string, id: string): Promise<string> {
    const issuedAt = Date.now();
    return `${issuedAt}.${base64url(await this.#mac(user, action, id, issuedAt))}`;
  }

  /** @returns `null` when valid, else why not. */
  async check(token: string | null, user: string, action: string, id: string): Promise<string | null> {
    if (!token) return "the CSRF token is missing";
    const match = /^(\d{1,16})\.([A-Za-z0-9_-]{43})$/.exec(token);
    if (!match) return "the CSRF token is malformed";
    const issuedAt = Number(match[1]);
    const now = Date.now();
    const expected = base64url(await this.#mac(user, action, id, issuedAt));
    if (!constantTimeEqual(encoder.encode(expected), encoder.encode(match[2]!))) return "the CSRF token is not valid";
    if (issuedAt > now + 60_000 || now - issuedAt > this.#maxAgeMs) {
      return "the confirmation page has expired: open it again";
    }
    return null;
  }
}

// ---------------------------------------------------------------------------
// Responses

class HttpError extends Error {
  readonly status: number;
  readonly headers: Record<string, string>;
  constructor(status: number, message: string, headers: Record<string, string> = {}) {
    super(message);
    this.status = status;
    this.headers = headers;
  }
}

function respond(status: number, body: string | null, headers: Record<string, string> = {}): Response {
  const h = new Headers({ "content-type": "text/html; charset=utf-8", ...SECURITY_HEADERS, ...headers });
  return new Response(body, { status, headers: h });
}

const STATUS_TEXT: Record<number, string> = {
  400: "Bad request",
  401: "Authentication required",
  403: "Forbidden",
  404: "Not found",
  405: "Method not allowed",
  409: "Conflict",
  413: "Request too large",
  415: "Unsupported media type",
  500: "Internal error",
};

const STYLE = `
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}
header{background:#1d2330;color:#fff;padding:10px 20px;display:flex;gap:20px;align-items:center;flex-wrap:wrap}
header a{color:#cfe0ff;text-decoration:none}header strong{font-size:16px}header .who{margin-left:auto;color:#aab}
main{padding:16px 20px;max-width:1200px}
h1{font-size:20px;margin:4px 0 12px}h2{font-size:16px;margin:18px 0 8px}
table{border-collapse:collapse;background:#fff;min-width:320px}
th,td{border:1px solid #dde1e8;padding:5px 9px;text-align:left;vertical-align:top}
th{background:#eef1f5;font-weight:600}
td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#fff;border:1px solid #dde1e8;padding:10px;overflow:auto;max-height:480px;white-space:pre-wrap;word-break:break-all}
.state{display:inline-block;padding:0 6px;border-radius:3px;background:#e4e8ee;font-size:12px}
.state-dead,.state-unknown{background:#ffd9d6;color:#8a1308}.state-failed{background:#ffefc7;color:#7a5200}
.state-done,.state-sent{background:#d9f2df;color:#14622b}
.notice{background:#e5f4ff;border:1px solid #9cc8f0;padding:8px 12px;margin:8px 0}
.error{background:#fff0ef;border:1px solid #f0aaa3;padding:8px 12px;margin:8px 0}
.note{color:#5a6272;font-size:13px}
.actions{display:flex;gap:10px;margin:12px 0}
.button{display:inline-block;padding:6px 14px;border-radius:4px;border:1px solid #2a5bd7;background:#2a5bd7;color:#fff;text-decoration:none;font:inherit;cursor:pointer}
.button.secondary{background:#fff;color:#2a5bd7}.button.danger{background:#c3261b;border-color:#c3261b}
form.filters{display:flex;gap:10px;align-items:end;margin:8px 0 12px;flex-wrap:wrap}
form.filters label{display:flex;flex-direction:column;font-size:12px;color:#5a6272}
td.err{max-width:420px;word-break:break-word;color:#8a1308}
td.id{word-break:break-all;max-width:320px}
`;

function fmtTime(ms: number | null | undefined): string {
  if (ms === null || ms === undefined || !Number.isFinite(ms)) return "—";
  try {
    return new Date(ms).toISOString();
  } catch {
    return String(ms);
  }
}

function prettyJson(value: JsonValue): string {
  let text: string;
  try {
    text = JSON.stringify(value, null, 2) ?? "null";
  } catch {
    text = String(value);
  }
  return text.length > MAX_SHOWN_JSON ? `${text.slice(0, MAX_SHOWN_JSON)}\n… (truncated, ${text.length} characters)` : text;
}

function truncate(text: string | null, max: number): string {
  if (text === null) return "";
  return text.length > max ? `${text.slice(0, max)}…` : text;
}

function stateBadge(state: string): SafeHtml {
  return html`<span class="state state-${state}">${state}</span>`;
}

// ---------------------------------------------------------------------------
// The handler

interface Page {
  status?: number;
  title: string;
  body: SafeHtml;
}

/**
 * Create the web DLQ console: a Web-standard request handler that shows the
 * durable inbox and outbox (counts, lists, records) and lets an operator
 * replay an inbound record or retry/discard a send. Every request must pass
 * `options.auth` (401 otherwise); actions need a confirmation page and a POST
 * carrying its CSRF token (403 otherwise); a GET never changes anything.
 * Responses carry a strict Content-Security-Policy (no scripts at all),
 * `X-Frame-Options: DENY`, `Referrer-Policy: no-referrer` and
 * `Cache-Control: no-store`; everything rendered is HTML-escaped.
 *
 * Routes, under `basePath`: `/` (overview), `/inbound` and `/outbound`
 * (`?state=&chat=&limit=`), `/damaged` (records set aside as damaged), `/inbound/record?id=`, `/outbound/record?id=`,
 * `/inbound/replay?id=`, `/outbound/retry?id=`, `/outbound/discard?id=`
 * (GET: the confirmation page; POST: the action).
 *
 * @param target a `Bot` with durability (actions go through `bot.durability`,
 *   so metrics stay right and the worker wakes at once) or a bare `DurabilityBackend`
 * @param options `auth` (required), `basePath`, `csrfSecret`, `title`, `countCap`, `tokenMaxAgeMs`
 * @returns the handler, for `Bun.serve({ fetch })`, `Deno.serve(handler)` or {@link nodeHandler}
 * @throws {TypeError} when `target` is neither a bot with durability nor a backend,
 *   `options.auth` is missing or not a function, or an option has the wrong type
 * @throws {RangeError} when `csrfSecret` is shorter than 16 bytes, or `countCap`/`tokenMaxAgeMs` is out of range
 * @example
 * ```ts ignore
 * import { basicAuth, durabilityConsole } from "@botmesh/durable/ops";
 * const dlq = durabilityConsole(bot, { basePath: "/ops", auth: basicAuth("ops", "s3cret-password") });
 * Bun.serve({ port: 8080, fetch: dlq });
 * ```
 */
export function durabilityConsole(target: ConsoleTarget, options: DurabilityConsoleOptions): ConsoleHandler {
  if (!isObject(options)) {
    throw new TypeError(`Argument "options" is required: durabilityConsole(target, { auth }) — "auth" must be given`);
  }
  checkKnownOptions(options, ["basePath", "auth", "csrfSecret", "title", "countCap", "tokenMaxAgeMs"]);
  if (options.auth === undefined || options.auth === null) {
    throw new TypeError(
      `Option "auth" is required: a function (request) => { user } | null (for example basicAuth(user, password)); the console allows no anonymous access`,
    );
  }
  if (typeof options.auth !== "function") {
    throw new TypeError(`Option "auth" must be a function (request) => { user } | null, got ${typeof options.auth}`);
  }
  const auth = options.auth;
  const ops = opsOf(target);

  const basePath = options.basePath ?? "";
  if (typeof basePath !== "string" || (basePath !== "" && (!/^\/[A-Za-z0-9._~\-\/]*$/.test(basePath) || basePath.endsWith("/") || basePath.includes("//")))) {
    throw new TypeError(
      `Option "basePath" must be "" or a path like "/ops/dlq" (starting with "/", not ending with one, letters, digits, "-", "_", ".", "~"), got ${JSON.stringify(basePath)}`,
    );
  }
  const title = options.title ?? "Durability console";
  if (typeof title !== "string" || title === "") throw new TypeError(`Option "title" must be a non-empty string`);
  const countCap = options.countCap ?? 1000;
  if (!Number.isInteger(countCap) || countCap < 1 || countCap > 100_000) {
    throw new RangeError(`Option "countCap" must be an integer from 1 to 100000, got ${String(countCap)}`);
  }
  const tokenMaxAgeMs = options.tokenMaxAgeMs ?? 3_600_000;
  if (!Number.isInteger(tokenMaxAgeMs) || tokenMaxAgeMs < 1000 || tokenMaxAgeMs > 86_400_000) {
    throw new RangeError(`Option "tokenMaxAgeMs" must be an integer from 1000 to 86400000, got ${String(tokenMaxAgeMs)}`);
  }
  let secret: Uint8Array<ArrayBuffer>;
  if (options.csrfSecret === undefined) {
    secret = crypto.getRandomValues(new Uint8Array(32));
  } else if (typeof options.csrfSecret === "string") {
    secret = encoder.encode(options.csrfSecret);
  } else if (options.csrfSecret instanceof Uint8Array) {
    secret = new Uint8Array(options.csrfSecret);
  } else {
    throw new TypeError(`Option "csrfSecret" must be a string or a Uint8Array, got ${typeof options.csrfSecret}`);
  }
  if (secret.length < 16) throw new RangeError(`Option "csrfSecret" must be at least 16 bytes, got ${secret.length}`);
  const csrf = new CsrfTokens(secret, tokenMaxAgeMs);

  const url = (path: string, params: Record<string, string | number | undefined> = {}): string => {
    const query = Object.entries(params)
      .filter(([, v]) => v !== undefined && v !== "")
      .map(([k, v]) => `${encodeURIComponent(k)}=${encodeURIComponent(String(v))}`)
      .join("&");
    return `${basePath}${path}${query ? `?${query}` : ""}`;
  };

  const layout = (page: Page, user: string): Response => {
    const body = html`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>${page.title} · ${title}</title><style>${new SafeHtml(STYLE)}</style></head>
<body><header><strong><a href="${url("/")}">${title}</a></strong>
<a href="${url("/inbound", { state: "dead" })}">Inbound DLQ</a>
<a href="${url("/outbound", { state: "dead" })}">Outbound DLQ</a>
<a href="${url("/outbound", { state: "unknown" })}">Unknown sends</a>
<a href="${url("/damaged")}">Damaged</a>
<span class="who">Signed in as ${user}</span></header>
<main>${page.body}</main></body></html>`;
    return respond(page.status ?? 200, body.html);
  };

  const errorPage = (status: number, message: string, user: string | null): Response => {
    const heading = STATUS_TEXT[status] ?? "Error";
    const body = html`<h1>${heading}</h1><div class="error">${message}</div><p><a href="${url("/")}">Back to the overview</a></p>`;
    if (user === null) {
      return respond(status, html`<!doctype html><html lang="en"><head><meta charset="utf-8"><title>${heading}</title></head><body>${body}</body></html>`.html);
    }
    return layout({ status, title: heading, body }, user);
  };

  // ---- parameters

  const param = (query: URLSearchParams, name: string): string | null => {
    const value = query.get(name);
    if (value !== null && value.length > MAX_PARAM_CHARS) {
      throw new HttpError(400, `Parameter "${name}" is too long (at most ${MAX_PARAM_CHARS} characters)`);
    }
    return value;
  };

  const parseState = <S extends string>(query: URLSearchParams, states: readonly S[]): S | undefined => {
    const raw = param(query, "state");
    if (raw === null || raw === "" || raw === "all") return undefined;
    if (!(states as readonly string[]).includes(raw)) {
      throw new HttpError(400, `Parameter "state" must be one of ${["all", ...states].join(", ")}; got "${raw}"`);
    }
    return raw as S;
  };

  const parseLimit = (query: URLSearchParams): number => {
    const raw = param(query, "limit");
    if (raw === null || raw === "") return DEFAULT_LIMIT;
    const n = /^\d{1,7}$/.test(raw) ? Number(raw) : NaN;
    if (!Number.isInteger(n) || n < 1 || n > MAX_LIMIT) {
      throw new HttpError(400, `Parameter "limit" must be an integer from 1 to ${MAX_LIMIT}; got "${raw}"`);
    }
    return n;
  };

  const requireId = (query: URLSearchParams): string => {
    const id = param(query, "id");
    if (id === null || id === "") throw new HttpError(400, `Parameter "id" is required`);
    return id;
  };

  // ---- views

  const countRow = async (journal: Journal, state: string): Promise<SafeHtml> => {
    const rows = journal === "inbound"
      ? await ops.inboxList({ state: state as InboundState, limit: countCap + 1 })
      : await ops.outboxList({ state: state as OutboxState, limit: countCap + 1 });
    const count = rows.length > countCap ? `${countCap}+` : String(rows.length);
    return html`<tr><td>${stateBadge(state)}</td><td class="num"><a href="${url(`/${journal}`, { state })}">${count}</a></td></tr>`;
  };

  /** The rate limiter's line and throttled sends of this process (a bot only). */
  const rateLimits = (): SafeHtml | string => {
    const m = ops.metrics?.();
    if (m === undefined) return "";
    return html`<section><h2>Rate limits (this process)</h2><table><tbody>
<tr><td>Sends waiting for the rate limiter</td><td class="num" id="outbox-waiting-for-limit">${String(m.outboxWaitingForLimit)}</td></tr>
<tr><td>Sends throttled since start (waited, or paused by a 429)</td><td class="num" id="outbox-throttled">${String(m.outboxThrottled)}</td></tr>
</tbody></table></section>`;
  };

  const overview = async (): Promise<Page> => {
    const inbound = await Promise.all(INBOUND_STATES.map((s) => countRow("inbound", s)));
    const outbound = await Promise.all(OUTBOUND_STATES.map((s) => countRow("outbound", s)));
    return {
      title: "Overview",
      body: html`<h1>Overview</h1>
<p class="note">Counts stop at ${countCap}: a state with more records shows ${countCap}+.</p>
<div style="display:flex;gap:40px;flex-wrap:wrap">
<section><h2>Inbound (inbox)</h2><table><thead><tr><th>State</th><th>Records</th></tr></thead><tbody>${inbound}</tbody></table>
<p><a href="${url("/inbound")}">All inbound records</a></p></section>
<section><h2>Outbound (outbox)</h2><table><thead><tr><th>State</th><th>Sends</th></tr></thead><tbody>${outbound}</tbody></table>
<p><a href="${url("/outbound")}">All sends</a></p></section>
</div>${rateLimits()}`,
    };
  };

  const damagedView = async (query: URLSearchParams): Promise<Page> => {
    const limit = parseLimit(query);
    const found = await ops.damaged({ limit: limit + 1 });
    const byJournal = (["inbox", "outbox"] as const).map((j) => found.filter((d) => d.journal === j));
    const more = byJournal.some((list) => list.length > limit);
    const rows = byJournal.flatMap((list) => list.slice(0, limit)).map((d) =>
      html`<tr><td>${d.journal === "inbox" ? "inbound" : "outbound"}</td><td class="id">${d.id}</td><td>${fmtTime(d.setAsideAt)}</td><td>${
        d.reported ? "yes" : "no"
      }</td><td class="err">${truncate(d.problem, 400)}</td></tr>`
    );
    return {
      title: "Damaged records",
      body: html`<h1>Damaged records</h1>
<p class="note">Records the backend could not read back. Each was set aside as it was stored (never deleted), left out of the lists, the due scans and its chat's order, and reported once as an error by a bot. Repair or remove them with the backend's own tools.</p>
${
        rows.length === 0 ? html`<p>No damaged records.</p>` : html`<table><thead><tr><th>Journal</th><th>Id</th><th>Set aside</th><th>Reported</th><th>Problem</th></tr></thead><tbody>${rows}</tbody></table>`
      }${more ? html`<p class="note">Showing the first ${limit} per journal.</p>` : ""}`,
    };
  };

  const listView = async (journal: Journal, query: URLSearchParams, notice: string | null): Promise<Page> => {
    const states: readonly string[] = journal === "inbound" ? INBOUND_STATES : OUTBOUND_STATES;
    const state = parseState(query, states);
    const limit = parseLimit(query);
    const chat = param(query, "chat") ?? "";
    const filter = { ...(state ? { state } : {}), ...(chat ? { chatId: chat } : {}), limit: limit + 1 };
    let rows: SafeHtml[];
    let more: boolean;
    if (journal === "inbound") {
      const records = await ops.inboxList(filter as ListOptions<InboundState>);
      more = records.length > limit;
      rows = records.slice(0, limit).map((r) =>
        html`<tr><td class="id"><a href="${url("/inbound/record", { id: r.id })}">${r.id}</a></td><td>${r.chatId}</td><td>${stateBadge(r.state)}</td><td class="num">${r.attempts}</td><td>${fmtTime(r.receivedAt)}</td><td>${fmtTime(r.updatedAt)}</td><td class="err">${truncate(r.error, 200)}</td></tr>`
      );
    } else {
      const entries = await ops.outboxList(filter as ListOptions<OutboxState>);
      more = entries.length > limit;
      rows = entries.slice(0, limit).map((e) =>
        html`<tr><td class="id"><a href="${url("/outbound/record", { id: e.key })}">${e.key}</a></td><td>${e.chatId}</td><td>${stateBadge(e.state)}</td><td class="num">${e.attempts}</td><td>${fmtTime(e.createdAt)}</td><td>${fmtTime(e.updatedAt)}</td><td class="err">${truncate(e.error, 200)}</td></tr>`
      );
    }
    const heading = `${journal === "inbound" ? "Inbound" : "Outbound"} · ${state ?? "all states"}`;
    const options = ["all", ...states].map((s) =>
      html`<option value="${s}"${new SafeHtml((state ?? "all") === s ? " selected" : "")}>${s}</option>`
    );
    const idHeader = journal === "inbound" ? "Id" : "Key";
    const createdHeader = journal === "inbound" ? "Received" : "Created";
    return {
      title: heading,
      body: html`<h1>${heading}</h1>
${notice ? html`<div class="notice">${notice}</div>` : null}
<form class="filters" method="get" action="${url(`/${journal}`)}">
<label>State<select name="state">${options}</select></label>
<label>Chat id<input name="chat" value="${chat}" placeholder="any chat"></label>
<label>Limit<input name="limit" type="number" min="1" max="${MAX_LIMIT}" value="${limit}"></label>
<button class="button secondary" type="submit">Filter</button></form>
${
        rows.length === 0
          ? html`<p>No records.</p>`
          : html`<table><thead><tr><th>${idHeader}</th><th>Chat</th><th>State</th><th>Attempts</th><th>${createdHeader}</th><th>Updated</th><th>Last error</th></tr></thead><tbody>${rows}</tbody></table>`
      }
<p class="note">Showing ${rows.length} record${rows.length === 1 ? "" : "s"}${more ? `; more exist` : ""}, in ${
        journal === "inbound" ? "receipt" : "reservation"
      } order.
${
        more && limit < MAX_LIMIT
          ? html`<a href="${url(`/${journal}`, { state, chat, limit: Math.min(limit * 2, MAX_LIMIT) })}">Show up to ${
            Math.min(limit * 2, MAX_LIMIT)
          }</a>`
          : null
      }</p>`,
    };
  };

  const field = (name: string, value: HtmlValue): SafeHtml => html`<tr><th>${name}</th><td>${value}</td></tr>`;

  const leaseRows = (r: InboundRecord | OutboxEntry): SafeHtml[] =>
    r.lease
      ? [
        field("Lease owner", r.lease.owner),
        field("Lease incarnation", r.lease.incarnation),
        field("Lease token", r.lease.token),
        field("Lease expires", fmtTime(r.lease.expiresAt)),
      ]
      : [field("Lease", "none")];

  const actionButtons = (journal: Journal, state: string, id: string): SafeHtml[] =>
    Object.entries(ACTIONS)
      .filter(([, spec]) => spec.journal === journal && spec.allowed.includes(state))
      .map(([path, spec]) =>
        html`<a class="button${new SafeHtml(spec.name === "discard" ? " danger" : "")}" href="${url(`/${path}`, { id })}">${spec.label}…</a>`
      );

  const recordView = async (journal: Journal, query: URLSearchParams, notice: string | null): Promise<Page> => {
    const id = requireId(query);
    if (journal === "inbound") {
      const r = await ops.inboxGet(id);
      if (!r) throw new HttpError(404, `No inbound record with id "${id}"`);
      return {
        title: `Inbound ${id}`,
        body: html`<h1>Inbound record</h1>
${notice ? html`<div class="notice">${notice}</div>` : null}
<table><tbody>
${field("Id", r.id)}${field("State", stateBadge(r.state))}${field("Kind", r.kind)}${field("Chat", r.chatId)}
${field("Provider", r.provider)}${field("Attempts", r.attempts)}${field("Last error", r.error ?? "—")}
${field("Next attempt", fmtTime(r.nextAttemptAt))}${leaseRows(r)}${field("Fencing token (last issued)", r.fence)}
${field("Received", fmtTime(r.receivedAt))}${field("Updated", fmtTime(r.updatedAt))}
</tbody></table>
<div class="actions">${actionButtons("inbound", r.state, r.id)}<a class="button secondary" href="${
          url("/inbound", { state: r.state })
        }">Back to the list</a></div>
<h2>Payload</h2><pre>${prettyJson(r.payload)}</pre>`,
      };
    }
    const e = await ops.outboxGet(id);
    if (!e) throw new HttpError(404, `No outbound entry with key "${id}"`);
    return {
      title: `Outbound ${id}`,
      body: html`<h1>Outbound entry</h1>
${notice ? html`<div class="notice">${notice}</div>` : null}
<table><tbody>
${field("Key", e.key)}${field("State", stateBadge(e.state))}${field("Chat", e.chatId)}
${field("Inbound record", e.inboundId ? html`<a href="${url("/inbound/record", { id: e.inboundId })}">${e.inboundId}</a>` : "—")}
${field("Attempts", e.attempts)}${field("Last error", e.error ?? "—")}${field("Provider message id", e.messageId ?? "—")}
${field("Next attempt", fmtTime(e.nextAttemptAt))}${leaseRows(e)}${field("Fencing token (last issued)", e.fence)}
${field("Sequence", e.seq)}${field("Content hash", e.contentHash)}
${field("Created", fmtTime(e.createdAt))}${field("Updated", fmtTime(e.updatedAt))}
</tbody></table>
<div class="actions">${actionButtons("outbound", e.state, e.key)}<a class="button secondary" href="${
        url("/outbound", { state: e.state })
      }">Back to the list</a></div>
<h2>Content</h2><pre>${prettyJson(e.content)}</pre>`,
    };
  };

  const currentState = async (spec: ActionSpec, id: string): Promise<string | null> => {
    const record = spec.journal === "inbound" ? await ops.inboxGet(id) : await ops.outboxGet(id);
    return record ? record.state : null;
  };

  const confirmView = async (path: string, spec: ActionSpec, query: URLSearchParams, user: string): Promise<Page> => {
    const id = requireId(query);
    const state = await currentState(spec, id);
    if (state === null) throw new HttpError(404, `No ${spec.journal} record with id "${id}"`);
    const recordUrl = url(`/${spec.journal}/record`, { id });
    if (!spec.allowed.includes(state)) {
      return {
        status: 409,
        title: `${spec.label} not possible`,
        body: html`<h1>${spec.label} not possible</h1><div class="error">The record is ${state}; ${spec.name} needs one of: ${
          spec.allowed.join(", ")
        }.</div><p><a href="${recordUrl}">Back to the record</a></p>`,
      };
    }
    const token = await csrf.issue(user, path, id);
    return {
      title: `${spec.label}?`,
      body: html`<h1>${spec.label} this ${spec.journal === "inbound" ? "record" : "send"}?</h1>
<table><tbody>${field(spec.journal === "inbound" ? "Id" : "Key", id)}${field("State", stateBadge(state))}</tbody></table>
<p>${spec.explain}</p>
<form method="post" action="${url(`/${path}`, { id })}">
<input type="hidden" name="csrf" value="${token}">
<div class="actions"><button class="button${new SafeHtml(spec.name === "discard" ? " danger" : "")}" type="submit">Yes, ${
        spec.name
      }</button><a class="button secondary" href="${recordUrl}">Cancel</a></div>
</form>`,
    };
  };

  const performAction = async (
    path: string,
    spec: ActionSpec,
    request: Request,
    query: URLSearchParams,
    user: string,
  ): Promise<Response> => {
    const site = request.headers.get("sec-fetch-site");
    if (site !== null && site !== "same-origin") {
      throw new HttpError(403, `Cross-site form posts are refused (Sec-Fetch-Site: ${site})`);
    }
    const type = (request.headers.get("content-type") ?? "").split(";")[0]!.trim().toLowerCase();
    if (type !== "application/x-www-form-urlencoded") {
      throw new HttpError(415, `The form must be posted as application/x-www-form-urlencoded`);
    }
    const declared = Number(request.headers.get("content-length") ?? "0");
    if (declared > MAX_FORM_BYTES) throw new HttpError(413, `The form is larger than ${MAX_FORM_BYTES} bytes`);
    const text = await request.text();
    if (text.length > MAX_FORM_BYTES) throw new HttpError(413, `The form is larger than ${MAX_FORM_BYTES} bytes`);
    const form = new URLSearchParams(text);
    const id = requireId(query);
    const problem = await csrf.check(form.get("csrf"), user, path, id);
    if (problem !== null) throw new HttpError(403, `Refused: ${problem}. Nothing was changed.`);
    const state = await currentState(spec, id);
    if (state === null) throw new HttpError(404, `No ${spec.journal} record with id "${id}"`);
    let done = false;
    if (spec.allowed.includes(state)) {
      done = spec.name === "replay"
        ? await ops.replay(id)
        : spec.name === "retry"
        ? await ops.retry(id)
        : await ops.discard(id);
    }
    if (!done) {
      const now = (await currentState(spec, id)) ?? "gone";
      throw new HttpError(409, `Nothing was changed: the record is ${now}; ${spec.name} needs one of: ${spec.allowed.join(", ")}.`);
    }
    const location = spec.name === "discard"
      ? url(`/${spec.journal}`, { state, notice: spec.name })
      : url(`/${spec.journal}/record`, { id, notice: spec.name });
    return respond(303, null, { location });
  };

  const noticeOf = (query: URLSearchParams): string | null => {
    const name = query.get("notice");
    // Fixed texts only: nothing from the query is reflected.
    for (const spec of Object.values(ACTIONS)) if (spec.name === name) return spec.notice;
    return null;
  };

  return async (request: Request): Promise<Response> => {
    let user: string | null = null;
    try {
      let parsed: URL;
      try {
        parsed = new URL(request.url);
      } catch {
        throw new HttpError(400, "The request URL is not valid");
      }
      let path = parsed.pathname;
      if (basePath !== "") {
        if (path !== basePath && !path.startsWith(`${basePath}/`)) throw new HttpError(404, "Not found");
        path = path.slice(basePath.length);
      }
      if (path === "") path = "/";
      if (path.length > 1 && path.endsWith("/")) path = path.slice(0, -1);

      let identity: ConsoleIdentity | null;
      try {
        identity = await auth(request);
      } catch {
        throw new HttpError(500, "Authentication failed with an error");
      }
      if (!isObject(identity) || typeof identity.user !== "string" || identity.user === "") {
        const headers: Record<string, string> = auth.challenge ? { "www-authenticate": auth.challenge } : {};
        throw new HttpError(401, "Sign in to use the durability console.", headers);
      }
      user = identity.user;

      const method = request.method.toUpperCase();
      const read = method === "GET" || method === "HEAD";
      const query = parsed.searchParams;
      const notice = noticeOf(query);
      let page: Page;
      const view = path.slice(1);
      if (path === "/") {
        if (!read) throw new HttpError(405, `Method ${method} is not allowed here`, { allow: "GET, HEAD" });
        page = await overview();
      } else if (view === "inbound" || view === "outbound") {
        if (!read) throw new HttpError(405, `Method ${method} is not allowed here`, { allow: "GET, HEAD" });
        page = await listView(view, query, notice);
      } else if (view === "damaged") {
        if (!read) throw new HttpError(405, `Method ${method} is not allowed here`, { allow: "GET, HEAD" });
        page = await damagedView(query);
      } else if (view === "inbound/record" || view === "outbound/record") {
        if (!read) throw new HttpError(405, `Method ${method} is not allowed here`, { allow: "GET, HEAD" });
        page = await recordView(view === "inbound/record" ? "inbound" : "outbound", query, notice);
      } else if (Object.hasOwn(ACTIONS, view)) {
        const spec = ACTIONS[view]!;
        if (method === "POST") return await performAction(view, spec, request, query, user);
        if (!read) throw new HttpError(405, `Method ${method} is not allowed here`, { allow: "GET, HEAD, POST" });
        page = await confirmView(view, spec, query, user);
      } else {
        throw new HttpError(404, "Not found");
      }
      const response = layout(page, user);
      return method === "HEAD" ? new Response(null, { status: response.status, headers: response.headers }) : response;
    } catch (error) {
      if (error instanceof HttpError) {
        const response = errorPage(error.status, error.message, user);
        for (const [name, value] of Object.entries(error.headers)) response.headers.set(name, value);
        return response;
      }
      const message = error instanceof Error ? `${error.name}: ${error.message}` : String(error);
      return errorPage(500, `The backend failed: ${message}`, user);
    }
  };
}

// ---------------------------------------------------------------------------
// Node adapter

/** The parts of Node's `http.IncomingMessage` that {@link nodeHandler} uses. */
export interface NodeRequestLike extends AsyncIterable<unknown> {
  method?: string;
  url?: string;
  headers: Record<string, string | string[] | undefined>;
  /** Node's socket; a TLS socket has `encrypted: true` (then the URL is `https:`). */
  socket?: unknown;
}

/** The parts of Node's `http.ServerResponse` that {@link nodeHandler} uses. */
export interface NodeResponseLike {
  statusCode: number;
  setHeader(name: string, value: string | string[]): unknown;
  end(body?: Uint8Array): unknown;
}

/** Options of {@link nodeHandler}. */
export interface NodeHandlerOptions {
  /** Request bodies larger than this are refused with 413 (default 1 MiB). */
  maxBodyBytes?: number;
}

const HOP_BY_HOP = new Set(["connection", "keep-alive", "transfer-encoding", "upgrade", "content-length", "http2-settings"]);

/**
 * Adapt a Web-standard handler (such as {@link durabilityConsole}'s) to Node's
 * `http.createServer` listener signature, without importing any `node:` module.
 * The request URL is built from the `Host` header and the socket's TLS state.
 *
 * @param handler the Web-standard handler
 * @param options `maxBodyBytes`
 * @returns a `(req, res)` listener; it never rejects (a failure becomes a 500)
 * @throws {TypeError} when `handler` is not a function
 * @example
 * ```ts ignore
 * import { createServer } from "node:http";
 * import { basicAuth, durabilityConsole, nodeHandler } from "@botmesh/durable/ops";
 * const dlq = durabilityConsole(bot, { auth: basicAuth("ops", "s3cret-password") });
 * createServer(nodeHandler(dlq)).listen(8080);
 * ```
 */
export function nodeHandler(
  handler: (request: Request) => Response | Promise<Response>,
  options: NodeHandlerOptions = {},
): (req: NodeRequestLike, res: NodeResponseLike) => Promise<void> {
  if (typeof handler !== "function") throw new TypeError(`Argument "handler" must be a function, got ${typeof handler}`);
  const maxBodyBytes = options.maxBodyBytes ?? 1024 * 1024;
  if (!Number.isInteger(maxBodyBytes) || maxBodyBytes < 0) {
    throw new RangeError(`Option "maxBodyBytes" must be a non-negative integer, got ${String(maxBodyBytes)}`);
  }
  const send = (res: NodeResponseLike, status: number, text: string): void => {
    res.statusCode = status;
    res.setHeader("content-type", "text/plain; charset=utf-8");
    for (const [name, value] of Object.entries(SECURITY_HEADERS)) res.setHeader(name, value);
    res.end(encoder.encode(text));
  };
  return async (req, res) => {
    try {
      const method = (req.method ?? "GET").toUpperCase();
      const host = typeof req.headers.host === "string" && req.headers.host !== "" ? req.headers.host : "localhost";
      let url: URL;
      try {
        url = new URL(req.url ?? "/", `${isObject(req.socket) && req.socket.encrypted === true ? "https" : "http"}://${host}`);
      } catch {
        send(res, 400, "Bad request URL");
        return;
      }
      const headers = new Headers();
      for (const [name, value] of Object.entries(req.headers)) {
        if (value === undefined || name.startsWith(":") || HOP_BY_HOP.has(name.toLowerCase())) continue;
        for (const v of Array.isArray(value) ? value : [value]) headers.append(name, v);
      }
      let body: Uint8Array<ArrayBuffer> | undefined;
      if (method !== "GET" && method !== "HEAD") {
        const chunks: Uint8Array[] = [];
        let size = 0;
        for await (const chunk of req) {
          const bytes = typeof chunk === "string" ? encoder.encode(chunk) : new Uint8Array(chunk as Uint8Array);
          size += bytes.length;
          if (size > maxBodyBytes) {
            send(res, 413, "Request body too large");
            return;
          }
          chunks.push(bytes);
        }
        body = new Uint8Array(size);
        let offset = 0;
        for (const c of chunks) {
          body.set(c, offset);
          offset += c.length;
        }
      }
      const response = await handler(new Request(url, { method, headers, ...(body ? { body } : {}) }));
      res.statusCode = response.status;
      const cookies: string[] = [];
      response.headers.forEach((value, name) => {
        if (name === "set-cookie") cookies.push(value);
        else res.setHeader(name, value);
      });
      if (cookies.length > 0) res.setHeader("set-cookie", cookies);
      res.end(method === "HEAD" ? undefined : new Uint8Array(await response.arrayBuffer()));
    } catch {
      try {
        send(res, 500, "Internal error");
      } catch {
        // the response was already under way; nothing more to do
      }
    }
  };
}
