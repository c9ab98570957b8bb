/**
 * {@link nodeHandler}: serve a Web-standard fetch handler (such as the
 * operations console) from Node's `http` module without importing any
 * `node:` module.
 *
 * @module
 */
import { noteRemoteAddress } from "../runtime/remote_address.ts";
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
  const send = (res: NodeResponseLike, status: number, text: string, unread: boolean): void => {
    res.statusCode = status;
    if (unread) res.setHeader("connection", "close");
    res.setHeader("content-type", "text/plain; charset=utf-8");
    for (const [name, value] of Object.entries(SECURITY_HEADERS)) res.setHeader(name, value);
    res.end(encoder.encode(text));
  };
  return async (req, res) => {
    let unread = false;
    try {
      const method = (req.method ?? "GET").toUpperCase();
      const host = typeof req.headers.host === "string" && req.headers.host !== "" ? req.headers.host : "localhost";
      let url: URL;
      try {
        url = new URL(req.url ?? "/", `${isObject(req.socket) && req.socket.encrypted === true ? "https" : "http"}://${host}`);
      } catch {
        send(res, 400, "Bad request URL", false);
        return;
      }
      const headers = new Headers();
      for (const [name, value] of Object.entries(req.headers)) {
        if (value === undefined || name.startsWith(":") || HOP_BY_HOP.has(name.toLowerCase())) continue;
        for (const v of Array.isArray(value) ? value : [value]) headers.append(name, v);
      }
      // The body is handed on as a stream, read as the handler reads it: a provider's deadline and size cap
      // then apply to it, and a handler that answers without reading it (a wrong secret) answers at once.
      let body: ReadableStream<Uint8Array> | undefined;
      let tooLarge = false;
      if (method !== "GET" && method !== "HEAD") {
        const chunks = req[Symbol.asyncIterator]();
        let size = 0;
        unread = true;
        body = new ReadableStream<Uint8Array>({
          async pull(controller) {
            const { done, value } = await chunks.next();
            if (done) {
              unread = false;
              controller.close();
              return;
            }
            const bytes = typeof value === "string" ? encoder.encode(value) : new Uint8Array(value as Uint8Array);
            size += bytes.length;
            if (size > maxBodyBytes) {
              tooLarge = true;
              controller.error(new RangeError(`The request body is over maxBodyBytes (${maxBodyBytes} bytes)`));
              return;
            }
            controller.enqueue(bytes);
          },
        });
      }
      let response: Response | undefined;
      try {
        const request = new Request(url, { method, headers, ...(body ? { body, duplex: "half" } : {}) } as RequestInit);
        noteRemoteAddress(request, isObject(req.socket) && typeof req.socket.remoteAddress === "string" ? req.socket.remoteAddress : undefined);
        response = await handler(request);
      } catch (error) {
        if (!tooLarge) throw error;
      }
      // Over maxBodyBytes is a 413, whatever the handler made of its body's failing.
      if (tooLarge || response === undefined) {
        send(res, 413, "Request body too large", unread);
        return;
      }
      res.statusCode = response.status;
      const cookies: string[] = [];
      response.headers.forEach((value, name) => {
        if (name === "set-cookie") cookies.push(value);
        else res.setHeader(name, value);
      });
      if (cookies.length > 0) res.setHeader("set-cookie", cookies);
      const answer = method === "HEAD" ? undefined : new Uint8Array(await response.arrayBuffer());
      // What is left of the body is not waited for: the answer closes the connection, as Node does once the answer is
      // written (on a keep-alive connection it would read the rest first, however long that takes).
      if (unread) res.setHeader("connection", "close");
      res.end(answer);
    } catch {
      try {
        send(res, 500, "Internal error", unread);
      } catch {
        // the response was already under way; nothing more to do
      }
    }
  };
}

