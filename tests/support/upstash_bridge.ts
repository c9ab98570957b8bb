/**
 * An Upstash-REST server on loopback in front of a real Redis, so that the
 * `@upstash/redis` client (HTTP, fetch) can be tested against real Redis.
 *
 * It speaks what the client sends (see `@upstash/redis`'s `HttpClient`):
 * - `POST /` with a JSON array command → `{ result }`, or status 400 `{ error }`;
 * - `POST /pipeline` with an array of commands → an array of `{ result }`/`{ error }`;
 * - `POST /multi-exec` → the same, run in `MULTI`/`EXEC` (a queuing error
 *   aborts the whole transaction with status 400);
 * - `Authorization: Bearer <token>` is checked (401 `{ error: "Unauthorized" }`);
 * - with `Upstash-Encoding: base64` every string of the result, nested arrays
 *   too, is the base64 of its raw bytes; integers stay numbers, nil is `null`.
 *
 * Redis is reached over TCP with the small binary-safe RESP2 client below.
 */
import { createServer, type IncomingMessage, type Server, type ServerResponse } from "node:http";
import { connect, type Socket } from "node:net";
import type { AddressInfo } from "node:net";
import { REDIS_URL } from "./services.ts";

/** A RESP2 reply: a simple string, bulk (bytes), integer, nil, array, or an error. */
export type RespReply = string | Buffer | number | null | RespReply[] | RespError;

/** An error reply of Redis (`-ERR …`). */
export class RespError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "RespError";
  }
}

/** Thrown to the callers of a connection that closed before they got their reply. */
export class RespConnectionLost extends Error {
  constructor(cause?: unknown) {
    super("the connection to Redis was lost", { cause });
    this.name = "RespConnectionLost";
  }
}

type Pending = { resolve: (reply: RespReply) => void; reject: (error: Error) => void };

/** One TCP connection to Redis; requests are pipelined, replies come back in order. */
export class RespConnection {
  readonly #socket: Socket;
  readonly #pending: Pending[] = [];
  #buffer: Buffer = Buffer.alloc(0);
  #closed = false;
  readonly ready: Promise<void>;

  constructor(host: string, port: number) {
    this.#socket = connect({ host, port });
    this.#socket.setNoDelay(true);
    this.ready = new Promise((resolve, reject) => {
      this.#socket.once("connect", () => resolve());
      this.#socket.once("error", reject);
    });
    this.ready.catch(() => {});
    this.#socket.on("data", (chunk: Buffer) => this.#onData(chunk));
    this.#socket.on("error", () => {});
    this.#socket.on("close", () => this.#fail(new RespConnectionLost()));
  }

  get closed(): boolean {
    return this.#closed;
  }

  /** Sends several commands in one write; resolves with their replies (errors as {@link RespError} values). */
  async sendMany(commands: readonly (readonly (string | Buffer)[])[]): Promise<RespReply[]> {
    await this.ready;
    if (this.#closed) throw new RespConnectionLost();
    const parts: Buffer[] = [];
    const replies: Promise<RespReply>[] = [];
    for (const args of commands) {
      parts.push(Buffer.from(`*${args.length}\r\n`));
      for (const arg of args) {
        const bytes = typeof arg === "string" ? Buffer.from(arg, "utf8") : arg;
        parts.push(Buffer.from(`$${bytes.length}\r\n`), bytes, Buffer.from("\r\n"));
      }
      replies.push(new Promise<RespReply>((resolve, reject) => this.#pending.push({ resolve, reject })));
    }
    this.#socket.write(Buffer.concat(parts));
    return Promise.all(replies);
  }

  async send(args: readonly (string | Buffer)[]): Promise<RespReply> {
    return (await this.sendMany([args]))[0]!;
  }

  /** Destroys the socket (as a network failure would). */
  destroy(): void {
    this.#socket.destroy();
    this.#fail(new RespConnectionLost());
  }

  #fail(error: Error): void {
    this.#closed = true;
    for (const p of this.#pending.splice(0)) p.reject(error);
  }

  #onData(chunk: Buffer): void {
    this.#buffer = this.#buffer.length === 0 ? chunk : Buffer.concat([this.#buffer, chunk]);
    for (;;) {
      const parsed = parseReply(this.#buffer, 0);
      if (parsed === null) return;
      this.#buffer = this.#buffer.subarray(parsed.end);
      const p = this.#pending.shift();
      if (p) p.resolve(parsed.value);
    }
  }
}

/** Parses one reply at `at`; `null` when the buffer does not hold all of it yet. */
function parseReply(buf: Buffer, at: number): { value: RespReply; end: number } | null {
  if (at >= buf.length) return null;
  const lineEnd = buf.indexOf("\r\n", at);
  if (lineEnd < 0) return null;
  const type = String.fromCharCode(buf[at]!);
  const line = buf.toString("utf8", at + 1, lineEnd);
  const next = lineEnd + 2;
  switch (type) {
    case "+":
      return { value: line, end: next };
    case "-":
      return { value: new RespError(line), end: next };
    case ":":
      return { value: Number(line), end: next };
    case "$": {
      const n = Number(line);
      if (n < 0) return { value: null, end: next };
      if (buf.length < next + n + 2) return null;
      return { value: Buffer.from(buf.subarray(next, next + n)), end: next + n + 2 };
    }
    case "*": {
      const n = Number(line);
      if (n < 0) return { value: null, end: next };
      const items: RespReply[] = [];
      let pos = next;
      for (let i = 0; i < n; i++) {
        const item = parseReply(buf, pos);
        if (item === null) return null;
        items.push(item.value);
        pos = item.end;
      }
      return { value: items, end: pos };
    }
    default:
      throw new Error(`unexpected RESP type byte ${JSON.stringify(type)}`);
  }
}

/** A reply as the REST API returns it (errors nested in arrays become their message). */
function toJson(reply: RespReply, base64: boolean): unknown {
  if (reply === null || typeof reply === "number") return reply;
  if (reply instanceof RespError) return reply.message;
  if (Array.isArray(reply)) return reply.map((item) => toJson(item, base64));
  const bytes = typeof reply === "string" ? Buffer.from(reply, "utf8") : reply;
  return base64 ? bytes.toString("base64") : bytes.toString("utf8");
}

/** Options of {@link startUpstashBridge}. */
export interface UpstashBridgeOptions {
  /** The Redis to forward to (default `REDIS_URL` of the test services). */
  redisUrl?: string;
  /** The port to listen on (default: a free one). */
  port?: number;
  /** The bearer token (default: random). */
  token?: string;
}

/** A running bridge. */
export interface UpstashBridge {
  /** The REST url to give `new Redis({ url, token })`. */
  readonly url: string;
  readonly token: string;
  readonly port: number;
  /** Requests served so far (each HTTP request counts once). */
  readonly requests: number;
  /** Stops listening and closes the Redis connections. */
  stop(): Promise<void>;
  /** Closes the HTTP server (dropping open connections) and listens again on the same port. */
  restart(): Promise<void>;
  /** Closes the HTTP server only (a later {@link UpstashBridge.restart} listens again). */
  pause(): Promise<void>;
  /** Destroys the bridge's TCP connections to Redis; the next request opens a new one. */
  killRedisConnections(): void;
}

function readBody(req: IncomingMessage): Promise<string> {
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    req.on("data", (c: Buffer) => chunks.push(c));
    req.on("end", () => resolve(Buffer.concat(chunks).toString("utf8")));
    req.on("error", reject);
  });
}

function send(res: ServerResponse, status: number, body: unknown): void {
  const text = JSON.stringify(body);
  res.writeHead(status, { "content-type": "application/json", "content-length": Buffer.byteLength(text) });
  res.end(text);
}

function isCommand(value: unknown): value is (string | number | boolean)[] {
  return Array.isArray(value) && value.length > 0 &&
    value.every((v) => typeof v === "string" || typeof v === "number" || typeof v === "boolean");
}

/**
 * Starts a bridge on 127.0.0.1.
 *
 * @param options `redisUrl`, `port`, `token`
 * @returns the running bridge
 */
export async function startUpstashBridge(options: UpstashBridgeOptions = {}): Promise<UpstashBridge> {
  const redis = new URL(options.redisUrl ?? REDIS_URL);
  const host = redis.hostname || "127.0.0.1";
  const redisPort = Number(redis.port || 6379);
  const token = options.token ?? crypto.randomUUID().replaceAll("-", "");
  const connections = new Set<RespConnection>();
  let shared: RespConnection | null = null;
  let requests = 0;

  const open = (): RespConnection => {
    const c = new RespConnection(host, redisPort);
    connections.add(c);
    c.ready.catch(() => connections.delete(c));
    return c;
  };
  const conn = (): RespConnection => {
    if (!shared || shared.closed) shared = open();
    return shared;
  };

  const handle = async (req: IncomingMessage, res: ServerResponse): Promise<void> => {
    requests++;
    if (req.method !== "POST") return send(res, 405, { error: "Method not allowed" });
    if (req.headers.authorization !== `Bearer ${token}`) return send(res, 401, { error: "Unauthorized" });
    const base64 = String(req.headers["upstash-encoding"] ?? "").toLowerCase() === "base64";
    let body: unknown;
    try {
      body = JSON.parse(await readBody(req));
    } catch {
      return send(res, 400, { error: "ERR failed to parse the request body as JSON" });
    }
    const path = (req.url ?? "/").split("?")[0]!.replace(/\/+$/, "") || "/";
    const args = (cmd: (string | number | boolean)[]): string[] => cmd.map((a) => String(a));
    try {
      if (path === "/") {
        if (!isCommand(body)) return send(res, 400, { error: "ERR the body must be a JSON array command" });
        const reply = await conn().send(args(body));
        if (reply instanceof RespError) return send(res, 400, { error: reply.message });
        return send(res, 200, { result: toJson(reply, base64) });
      }
      if (path === "/pipeline" || path === "/multi-exec") {
        if (!Array.isArray(body) || body.length === 0 || !body.every(isCommand)) {
          return send(res, 400, { error: "ERR the body must be a JSON array of commands" });
        }
        const commands = body.map(args);
        if (path === "/pipeline") {
          const replies = await conn().sendMany(commands);
          return send(res, 200, replies.map((r) => r instanceof RespError ? { error: r.message } : { result: toJson(r, base64) }));
        }
        // One write: MULTI, the commands, EXEC. Nothing else can interleave on this connection.
        const replies = await conn().sendMany([["MULTI"], ...commands, ["EXEC"]]);
        const exec = replies[replies.length - 1]!;
        if (exec instanceof RespError || exec === null || !Array.isArray(exec)) {
          const queued = replies.slice(1, -1).find((r) => r instanceof RespError) as RespError | undefined;
          const message = queued?.message ?? (exec instanceof RespError ? exec.message : "EXECABORT transaction aborted");
          return send(res, 400, { error: message });
        }
        return send(res, 200, exec.map((r) => r instanceof RespError ? { error: r.message } : { result: toJson(r, base64) }));
      }
      return send(res, 404, { error: `ERR unknown path ${path}` });
    } catch (error) {
      return send(res, 500, { error: `ERR bridge: ${(error as Error).message}` });
    }
  };

  let server: Server | null = null;
  let port = options.port ?? 0;
  const listen = (): Promise<void> =>
    new Promise((resolve, reject) => {
      const s = createServer((req, res) => {
        handle(req, res).catch((error) => send(res, 500, { error: `ERR bridge: ${String(error)}` }));
      });
      s.once("error", reject);
      s.listen(port, "127.0.0.1", () => {
        port = (s.address() as AddressInfo).port;
        server = s;
        resolve();
      });
    });
  const close = (): Promise<void> =>
    new Promise((resolve) => {
      const s = server;
      server = null;
      if (!s) return resolve();
      s.close(() => resolve());
      s.closeAllConnections();
    });

  await listen();
  const killRedisConnections = (): void => {
    for (const c of connections) c.destroy();
    connections.clear();
    shared = null;
  };
  return {
    get url() {
      return `http://127.0.0.1:${port}`;
    },
    token,
    get port() {
      return port;
    },
    get requests() {
      return requests;
    },
    async stop() {
      await close();
      killRedisConnections();
    },
    async restart() {
      await close();
      await listen();
    },
    pause: close,
    killRedisConnections,
  };
}
