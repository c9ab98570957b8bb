/**
 * The runtime side of serving HTTP for the `botmesh-durable console`
 * command: `Bun.serve`, `Deno.serve`, or Node's `http` module, and the
 * process signals that stop it. The console itself is a Web-standard fetch
 * handler; Node gets it already adapted to a `(req, res)` listener.
 *
 * @module
 */
import { noteRemoteAddress } from "./remote_address.ts";

/** A listening server. */
export interface HttpServer {
  /** The port it listens on (the one chosen when `0` was asked). */
  readonly port: number;
  /** Stops listening and ends open connections. */
  close(): Promise<void>;
}

/** What {@link serveHttp} serves, and where. */
export interface ServeHttpOptions {
  /** The port (`0`: any free one). */
  port: number;
  /** The address to listen on, e.g. `127.0.0.1`. */
  hostname: string;
  /** The Web-standard handler (Bun, Deno). */
  fetch: (request: Request) => Promise<Response>;
  /** The same handler as a Node `http` listener (Node). */
  nodeListener: (req: never, res: never) => unknown;
}

interface BunServe {
  serve(options: {
    port: number;
    hostname: string;
    fetch: (request: Request, server: { requestIP(request: Request): { address: string } | null }) => Promise<Response>;
  }): {
    port: number;
    stop(closeActive?: boolean): unknown;
  };
}

interface DenoServe {
  serve(
    options: { port: number; hostname: string; onListen?: (addr: unknown) => void },
    handler: (request: Request, info: { remoteAddr?: { hostname?: string } }) => Promise<Response>,
  ): { addr: { port: number }; shutdown(): Promise<void> };
  addSignalListener(signal: string, handler: () => void): void;
  removeSignalListener(signal: string, handler: () => void): void;
}

interface NodeSignals {
  once(signal: string, handler: () => void): unknown;
  off(signal: string, handler: () => void): unknown;
}

const g = globalThis as unknown as { Bun?: BunServe; Deno?: DenoServe; process?: NodeSignals };


/**
 * Listen for HTTP on `hostname:port` with the runtime's own server.
 *
 * @param options `port`, `hostname`, `fetch`, `nodeListener`
 * @returns the listening server
 * @throws {Error} when the address is taken or cannot be listened on
 * @example
 * ```ts ignore
 * const server = await serveHttp({ port: 8080, hostname: "127.0.0.1", fetch, nodeListener: nodeHandler(fetch) });
 * await server.close();
 * ```
 */
export async function serveHttp(options: ServeHttpOptions): Promise<HttpServer> {
  const { port, hostname, fetch } = options;
  if (g.Bun !== undefined) {
    const server = g.Bun.serve({
      port,
      hostname,
      fetch: (request, bun) => {
        noteRemoteAddress(request, bun.requestIP(request)?.address);
        return fetch(request);
      },
    });
    return { port: server.port, close: async () => void server.stop(true) };
  }
  if (g.Deno !== undefined) {
    const server = g.Deno.serve({ port, hostname, onListen: () => {} }, (request, info) => {
      noteRemoteAddress(request, info?.remoteAddr?.hostname);
      return fetch(request);
    });
    return { port: server.addr.port, close: () => server.shutdown() };
  }
  const http = await import("node:http");
  const server = http.createServer(options.nodeListener as unknown as Parameters<typeof http.createServer>[0]);
  await new Promise<void>((resolve, reject) => {
    server.once("error", reject);
    server.listen(port, hostname, () => {
      server.off("error", reject);
      resolve();
    });
  });
  const address = server.address();
  return {
    port: typeof address === "object" && address !== null ? address.port : port,
    close: () =>
      new Promise<void>((resolve) => {
        server.close(() => resolve());
        server.closeAllConnections?.();
      }),
  };
}

/**
 * Resolves at the first SIGINT or SIGTERM of the process (never where there are no signals).
 *
 * @returns a promise of the signal's name
 * @example
 * ```ts ignore
 * await untilSignal(); // Ctrl-C
 * ```
 */
export function untilSignal(): Promise<string> {
  return new Promise((resolve) => {
    const signals = ["SIGINT", "SIGTERM"];
    const handlers = signals.map((signal) => {
      const handler = () => {
        signals.forEach((s, i) => remove(s, handlers[i]!));
        resolve(signal);
      };
      return handler;
    });
    const remove = (signal: string, handler: () => void) => {
      if (g.Deno !== undefined) g.Deno.removeSignalListener(signal, handler);
      else g.process?.off(signal, handler);
    };
    signals.forEach((signal, i) => {
      if (g.Deno !== undefined) g.Deno.addSignalListener(signal, handlers[i]!);
      else g.process?.once(signal, handlers[i]!);
    });
  });
}
