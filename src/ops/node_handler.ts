/**
 * {@link nodeHandler}: serve a Web-standard fetch handler (such as the
 * operations console) from Node's `http` module without importing any
 * `node:` module.
 *
 * @module
 */
import { isObject, SECURITY_HEADERS } from "./console_render.ts";

const encoder = new TextEncoder();

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

