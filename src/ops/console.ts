/**
 * The web DLQ console: a server-rendered operations view of the durable
 * inbox and outbox, as a Web-standard `(request: Request) => Promise<Response>`
 * handler that mounts in `Bun.serve`, `Deno.serve`, or Node's `http` through
 * {@link nodeHandler}.
 *
 * Views (plain HTML, no JavaScript): an overview with counts per state, a
 * list per journal (state, chat, error text and age filters, pages by
 * cursor), and one record. Actions on one record (replay, retry, discard,
 * mark as delivered) and on a whole filtered list (replay, retry, discard
 * all) each go through a confirmation page whose form POSTs with a CSRF
 * token; a GET never changes anything. Every request must pass `auth`.
 *
 * @module
 */
import { checkKnownOptions } from "../options.ts";
import { errorLogText, errorText } from "../errors.ts";
import { type ConsoleAuth, type ConsoleIdentity, CsrfTokens, encoder, SignInLimitedError } from "./console_auth.ts";
import { BULK, bulkConfirm, type BulkContext, bulkNotice, bulkPerform } from "./console_bulk.ts";
import { type Journal, param } from "./console_list.ts";
import { BackendUnavailableError, type ConsoleTarget, opsOf } from "./console_ops.ts";
import { MAX_MESSAGE_ID_LENGTH } from "./mark_delivered.ts";
import { HttpError, integerOption, isObject, respond, STATUS_TEXT, STYLE } from "./console_render.ts";
import { ACTIONS, type Page, type ViewContext, views } from "./console_views.ts";
import { html, SafeHtml } from "./html.ts";
import { readCapped, ReadTimeoutError } from "../read_capped.ts";

export { basicAuth, type BasicAuthOptions, type ConsoleAuth, type ConsoleIdentity, SignInLimitedError } from "./console_auth.ts";
export { type ConsoleBot, type ConsoleTarget } from "./console_ops.ts";
export { nodeHandler, type NodeHandlerOptions, type NodeRequestLike, type NodeResponseLike } from "./node_handler.ts";

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
  /** How long reading a form body may take, in ms (default 10 s, 1 ms…10 min); a slower body is answered 408. */
  bodyTimeoutMs?: number;
  /**
   * For a bare backend: open it (`backend.open()`) before the first request
   * is served (default `true`; backends count their opens, so one opened
   * already stays open until both closed it: call `handler.close()` when you
   * stop serving). A backend that cannot be opened gets a 503 page saying
   * why, and the next request tries again. Ignored for a bot (`bot.start()` opens its backend).
   */
  openBackend?: boolean;
  /**
   * Told every failure the console answers with a 500 or 503 page (a backend
   * error, a backend that cannot be opened). Default: `console.error`.
   */
  onError?: (error: unknown) => void;
}

/** A Web-standard request handler, with `close()` to let go of a backend the console opened. */
export type ConsoleHandler = ((request: Request) => Promise<Response>) & {
  /** Undo the console's own `open()` of a bare backend (nothing for a bot). */
  close(): Promise<void>;
};

const MAX_FORM_BYTES = 16 * 1024;

async function readForm(request: Request, bodyTimeoutMs: number): Promise<URLSearchParams> {
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
  let bytes: Uint8Array | null;
  try {
    // Read up to the limit only: a body without Content-Length (chunked) is cut there, and a slow one at the deadline.
    bytes = await readCapped(request.body, MAX_FORM_BYTES, { timeoutMs: bodyTimeoutMs });
  } catch (error) {
    if (error instanceof ReadTimeoutError) throw new HttpError(408, `The form did not arrive within ${bodyTimeoutMs} ms`);
    throw new HttpError(400, `The form could not be read: ${errorText(error)}`);
  }
  if (bytes === null) throw new HttpError(413, `The form is larger than ${MAX_FORM_BYTES} bytes`);
  return new URLSearchParams(new TextDecoder().decode(bytes));
}

/**
 * Create the web DLQ console: a Web-standard request handler that shows the
 * durable inbox and outbox (counts, filtered lists with pages, records) and
 * lets an operator replay an inbound record, retry or discard a send, mark an
 * `unknown` send as delivered, or do the first three to a whole filtered list.
 * Every request must pass `options.auth` (401 otherwise); actions need a
 * confirmation page and a POST carrying its CSRF token (403 otherwise); a GET
 * never changes anything. Responses carry a strict Content-Security-Policy
 * (no scripts at all), `X-Frame-Options: DENY`, `Referrer-Policy: no-referrer`
 * and `Cache-Control: no-store`; everything rendered is HTML-escaped.
 *
 * Routes, under `basePath`: `/` (overview), `/inbound` and `/outbound`
 * (`?state=&chat=&error=&older=&newer=&after=&limit=&refresh=`), `/damaged`,
 * `/inbound/record?id=`, `/outbound/record?id=`; actions (GET: the
 * confirmation page; POST: the action) `/inbound/replay?id=`,
 * `/outbound/retry?id=`, `/outbound/discard?id=`, `/outbound/delivered?id=`,
 * and for a filtered list `/inbound/bulk/replay`, `/outbound/bulk/retry`,
 * `/outbound/bulk/discard` (with the list's filter parameters).
 *
 * @param target a `Bot` with durability (actions go through `bot.durability`,
 *   so metrics stay right and the worker wakes at once) or a bare `DurabilityBackend`
 * @param options `auth` (required), `basePath`, `csrfSecret`, `title`, `countCap`, `tokenMaxAgeMs`, `bodyTimeoutMs`, `openBackend`, `onError`
 * @returns the handler, for `Bun.serve({ fetch })`, `Deno.serve(handler)` or {@link nodeHandler}
 * @throws {TypeError} when `target` is neither a bot with durability nor a backend,
 *   `options.auth` is missing or not a function, or an option has the wrong type
 * @throws {RangeError} when `csrfSecret` is shorter than 16 bytes, or `countCap`/`tokenMaxAgeMs`/`bodyTimeoutMs` is out of range
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
  checkKnownOptions(options, ["basePath", "auth", "csrfSecret", "title", "countCap", "tokenMaxAgeMs", "bodyTimeoutMs", "openBackend", "onError"]);
  if (options.auth === undefined || options.auth === null) {
    throw new TypeError(
      `Option "auth" is required: a function (request) => { user } | null (for example basicAuth(user, password)); the console allows no anonymous access`,
    );
  }
  if (typeof options.auth !== "function") {
    throw new TypeError(`Option "auth" must be a function (request) => { user } | null, got ${typeof options.auth}`);
  }
  const auth = options.auth;
  const openBackend = options.openBackend ?? true;
  if (typeof openBackend !== "boolean") throw new TypeError(`Option "openBackend" must be a boolean, got ${typeof openBackend}`);
  const onError = options.onError ?? ((error: unknown) => console.error(errorLogText("[@botmesh/durable] durability console:", error)));
  if (typeof onError !== "function") throw new TypeError(`Option "onError" must be a function, got ${typeof onError}`);
  const report = (error: unknown): void => {
    try {
      onError(error);
    } catch {
      // a failing logger must not change the answer
    }
  };
  const ops = opsOf(target, openBackend);

  const basePath = options.basePath ?? "";
  if (typeof basePath !== "string" || (basePath !== "" && (!/^\/[A-Za-z0-9._~\-\/]*$/.test(basePath) || basePath.endsWith("/") || basePath.includes("//")))) {
    throw new TypeError(
      `Option "basePath" must be "" or a path like "/ops/dlq" (starting with "/", not ending with one, letters, digits, "-", "_", ".", "~"), got ${JSON.stringify(basePath)}`,
    );
  }
  const title = options.title ?? "Durability console";
  if (typeof title !== "string" || title === "") throw new TypeError(`Option "title" must be a non-empty string`);
  const countCap = integerOption(options.countCap, "countCap", 1000, 1, 100_000);
  const tokenMaxAgeMs = integerOption(options.tokenMaxAgeMs, "tokenMaxAgeMs", 3_600_000, 1000, 86_400_000);
  const bodyTimeoutMs = integerOption(options.bodyTimeoutMs, "bodyTimeoutMs", 10_000, 1, 600_000);
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
  const now = () => Date.now();
  const ctx: ViewContext & BulkContext = { ops, csrf, url, now, countCap };
  const v = views(ctx);

  const layout = (page: Page, user: string): Response => {
    const body = html`<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width,initial-scale=1">
<meta name="referrer" content="no-referrer">${
      page.refresh ? html`<meta http-equiv="refresh" content="${page.refresh}">` : null
    }
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

  const performAction = async (path: string, request: Request, query: URLSearchParams, user: string): Promise<Response> => {
    const spec = ACTIONS[path]!;
    const form = await readForm(request, bodyTimeoutMs);
    const id = param(query, "id");
    if (id === null || id === "") throw new HttpError(400, `Parameter "id" is required`);
    const problem = await csrf.check(form.get("csrf"), user, path, id);
    if (problem !== null) throw new HttpError(403, `Refused: ${problem}. Nothing was changed.`);
    const state = await v.currentState(spec.journal, id);
    if (state === null) throw new HttpError(404, `No ${spec.journal} record with id "${id}"`);
    let done = false;
    if (spec.allowed.includes(state)) {
      const messageId = (form.get("messageId") ?? "").trim();
      if (messageId.length > MAX_MESSAGE_ID_LENGTH) {
        throw new HttpError(400, `Form field "messageId" is too long (at most ${MAX_MESSAGE_ID_LENGTH} characters); nothing was changed`);
      }
      done = spec.name === "replay"
        ? await ops.replay(id)
        : spec.name === "retry"
        ? await ops.retry(id)
        : spec.name === "delivered"
        ? await ops.markDelivered(id, messageId)
        : await ops.discard(id);
    }
    if (!done) {
      const current = (await v.currentState(spec.journal, id)) ?? "gone";
      throw new HttpError(409, `Nothing was changed: the record is ${current}; ${spec.verb} needs one of: ${spec.allowed.join(", ")}.`);
    }
    const location = spec.name === "discard"
      ? url(`/${spec.journal}`, { state, notice: spec.name })
      : url(`/${spec.journal}/record`, { id, notice: spec.name });
    return respond(303, null, { location });
  };

  const noticeOf = (query: URLSearchParams): string | null => {
    const name = query.get("notice");
    // Fixed texts and whole numbers only: nothing else from the query is reflected.
    for (const spec of Object.values(ACTIONS)) if (spec.name === name) return spec.notice;
    return bulkNotice(query);
  };

  const readOnly = (method: string): void => {
    if (method !== "GET" && method !== "HEAD") throw new HttpError(405, `Method ${method} is not allowed here`, { allow: "GET, HEAD" });
  };

  const handler = async (request: Request): Promise<Response> => {
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
      } catch (error) {
        if (error instanceof SignInLimitedError) {
          const seconds = Math.max(1, Math.ceil(error.retryAfterMs / 1000));
          throw new HttpError(429, `Too many failed sign-ins: try again in ${seconds} s.`, { "retry-after": String(seconds) });
        }
        report(error);
        throw new HttpError(500, "Authentication failed with an error");
      }
      if (!isObject(identity) || typeof identity.user !== "string" || identity.user === "") {
        const headers: Record<string, string> = auth.challenge ? { "www-authenticate": auth.challenge } : {};
        throw new HttpError(401, "Sign in to use the durability console.", headers);
      }
      user = identity.user;

      const method = request.method.toUpperCase();
      const query = parsed.searchParams;
      const notice = noticeOf(query);
      let page: Page;
      const view = path.slice(1);
      if (path === "/") {
        readOnly(method);
        page = await v.overview(query);
      } else if (view === "inbound" || view === "outbound") {
        readOnly(method);
        page = await v.list(view, query, notice);
      } else if (view === "damaged") {
        readOnly(method);
        page = await v.damaged(query);
      } else if (view === "inbound/record" || view === "outbound/record") {
        readOnly(method);
        page = await v.record(view.slice(0, view.indexOf("/")) as Journal, query, notice);
      } else if (Object.hasOwn(ACTIONS, view)) {
        if (method === "POST") return await performAction(view, request, query, user);
        if (method !== "GET" && method !== "HEAD") throw new HttpError(405, `Method ${method} is not allowed here`, { allow: "GET, HEAD, POST" });
        page = await v.confirm(view, query, user);
      } else if (Object.hasOwn(BULK, view)) {
        if (method === "POST") return respond(303, null, { location: await bulkPerform(ctx, view, query, await readForm(request, bodyTimeoutMs), user) });
        if (method !== "GET" && method !== "HEAD") throw new HttpError(405, `Method ${method} is not allowed here`, { allow: "GET, HEAD, POST" });
        page = await bulkConfirm(ctx, view, query, user);
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
      report(error);
      if (error instanceof BackendUnavailableError) return errorPage(503, error.message, user);
      return errorPage(500, `The backend failed: ${errorText(error)}`, user);
    }
  };
  return Object.assign(handler, { close: () => ops.close() });
}
