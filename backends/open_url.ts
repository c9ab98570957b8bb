/**
 * Opens any backend of this package from a URL or path: the backend opener of
 * the `botmesh-durable` command line and of tools that take a backend URL.
 * The client packages (`postgres`, `ioredis`, `@upstash/redis`) are loaded
 * only when a URL of their kind is opened.
 *
 * @module
 */
import { errorMessage } from "../src/errors.ts";
import type { DurabilityBackend } from "../src/contract.ts";
import { BackendUrlError, type OpenedBackend, OperationError } from "../src/ops/cli.ts";
import { statFile } from "../src/runtime/fs.ts";
import { FileDurability } from "./file/mod.ts";
import { PostgresDurability } from "./postgres/mod.ts";
import { RedisDurability } from "./redis/mod.ts";
import { SQLiteDurability } from "./sqlite/mod.ts";
/**
 * What a failed import of a client package throws. Each package is imported
 * only when a URL of its kind is opened (the npm build keeps it external;
 * deno.json maps it to an `npm:` specifier); the `.catch` at each import also
 * tells bundlers that the package is optional.
 */
function notLoaded(name: string, forWhat: string): (error: unknown) => never {
  return (error) => {
    throw new OperationError(
      `The "${name}" package is needed for ${forWhat} but could not be loaded (install it: npm install ${name}): ${
        errorMessage(error)
      }`,
    );
  };
}

function hideCredentials(url: string): string {
  return url.replace(/^([a-z][a-z0-9+.-]*:\/\/)([^@/?#]*)@/i, (_, scheme: string, auth: string) => {
    if (scheme.toLowerCase().startsWith("redis+upstash")) return `${scheme}***@`;
    const colon = auth.indexOf(":");
    return colon === -1 ? `${scheme}${auth}@` : `${scheme}${auth.slice(0, colon)}:***@`;
  });
}

function splitQuery(text: string, shown: string, allowed: readonly string[]): { rest: string; params: Map<string, string> } {
  const q = text.indexOf("?");
  const params = new Map<string, string>();
  if (q === -1) return { rest: text, params };
  for (const [k, v] of new URLSearchParams(text.slice(q + 1))) {
    if (!allowed.includes(k)) {
      throw new BackendUrlError(
        shown,
        `Backend URL ${JSON.stringify(shown)} has an unknown parameter ${JSON.stringify(k)}${
          allowed.length ? `; it takes ${allowed.map((a) => JSON.stringify(a)).join(", ")}` : "; it takes none"
        }`,
      );
    }
    params.set(k, v);
  }
  return { rest: text.slice(0, q), params };
}

async function openLocal(
  kind: "sqlite" | "file",
  path: string,
  shown: string,
  params: Map<string, string>,
): Promise<OpenedBackend> {
  if (path === "") throw new BackendUrlError(shown, `Backend URL ${JSON.stringify(shown)} has no path`);
  const st = await statFile(path);
  if (st === null) throw new OperationError(`Backend file ${JSON.stringify(path)} does not exist (from ${JSON.stringify(shown)})`);
  if (st.isDirectory) throw new OperationError(`Backend file ${JSON.stringify(path)} is a directory`);
  let backend: DurabilityBackend;
  if (kind === "sqlite") {
    const tablePrefix = params.get("tablePrefix");
    backend = new SQLiteDurability(tablePrefix === undefined ? { file: path } : { file: path, tablePrefix });
  } else {
    backend = new FileDurability({ path });
  }
  await backend.open?.();
  return { backend, description: `${kind} ${path}`, close: async () => await backend.close?.() };
}

/**
 * Opens a durability backend from a URL or a path, and calls its `open()`:
 *
 * - `sqlite:./data/bot.db`, `sqlite:///abs/path.db`, or a path ending in
 *   `.db`, `.sqlite`, `.sqlite3` (`?tablePrefix=`); the file must exist;
 * - `file:./data/bot.json`, `file:///abs/path.json`, or a path ending in `.json`;
 * - `postgres://…` / `postgresql://…` with `?schema=…&tablePrefix=…` (other
 *   parameters go to the driver), through the `postgres` package;
 * - `redis+upstash://<token>@host[:port]` (https; `?insecure=1` or
 *   `redis+upstash+http://` for http), through `@upstash/redis`;
 * - `redis://host:port` / `rediss://…`, through `ioredis`;
 * - Redis forms take `?keyPrefix=…`.
 *
 * @param url the URL or path
 * @returns the open backend and how to close it (ending the client it created)
 * @throws {BackendUrlError} when the URL has no known form or a bad parameter (the message lists the forms)
 * @throws {Error} naming the package when the driver is not installed, the file when it does not exist,
 *   or the backend's error when it cannot be opened
 * @example
 * ```ts
 * const { backend, close } = await openBackend("sqlite:./data/bot.db");
 * console.log(await backend.inbox.list({ state: "dead" }));
 * await close();
 * ```
 */
export async function openBackend(url: string): Promise<OpenedBackend> {
  const shown = hideCredentials(url);
  const scheme = /^([a-z][a-z0-9+.-]+):/i.exec(url)?.[1]?.toLowerCase();
  if (scheme === "sqlite" || scheme === "file") {
    const { rest, params } = splitQuery(url.slice(scheme.length + 1), shown, scheme === "sqlite" ? ["tablePrefix"] : []);
    let path = rest;
    if (path.startsWith("//")) {
      path = path.slice(2);
      if (!path.startsWith("/")) {
        throw new BackendUrlError(
          shown,
          `Backend URL ${JSON.stringify(shown)} names a host; write ${scheme}:./relative/path or ${scheme}:///absolute/path`,
        );
      }
    }
    return await openLocal(scheme, path, shown, params);
  }
  if (scheme === "postgres" || scheme === "postgresql") return await openPostgres(url, shown);
  if (scheme === "redis+upstash" || scheme === "redis+upstash+http" || scheme === "redis+upstash+https") {
    return await openUpstash(url, shown, scheme);
  }
  if (scheme === "redis" || scheme === "rediss") return await openIoredis(url, shown);
  if (scheme === undefined || /^[a-z]:[\\/]/i.test(url)) {
    const { rest, params } = splitQuery(url, shown, /\.(db|sqlite3?)(\?|$)/i.test(url) ? ["tablePrefix"] : []);
    if (/\.(db|sqlite|sqlite3)$/i.test(rest)) return await openLocal("sqlite", rest, shown, params);
    if (/\.json$/i.test(rest)) return await openLocal("file", rest, shown, params);
  }
  throw new BackendUrlError(
    shown,
    url === "" ? "Backend URL is empty" : `Backend URL ${JSON.stringify(shown)} is of no known form`,
  );
}

function parseUrl(url: string, shown: string): URL {
  try {
    return new URL(url);
  } catch {
    throw new BackendUrlError(shown, `Backend URL ${JSON.stringify(shown)} is not a valid URL`);
  }
}

async function openPostgres(url: string, shown: string): Promise<OpenedBackend> {
  const u = parseUrl(url, shown);
  const schema = u.searchParams.get("schema") ?? undefined;
  const tablePrefix = u.searchParams.get("tablePrefix") ?? undefined;
  u.searchParams.delete("schema");
  u.searchParams.delete("tablePrefix");
  const mod: Record<string, unknown> = await import("postgres").catch(notLoaded("postgres", "postgres:// URLs"));
  const postgres = (mod.default ?? mod) as (url: string, options: Record<string, unknown>) => {
    end(options?: { timeout?: number }): Promise<void>;
    unsafe(query: string, parameters?: unknown[]): PromiseLike<unknown>;
  };
  const sql = postgres(u.toString(), { max: 2, onnotice: () => {}, connect_timeout: 10 });
  try {
    const backend = new PostgresDurability({
      sql,
      ...(schema !== undefined ? { schema } : {}),
      ...(tablePrefix !== undefined ? { tablePrefix } : {}),
    });
    await backend.open();
    const where = `${u.hostname}${u.port ? `:${u.port}` : ""}${u.pathname}`;
    return {
      backend,
      description: `postgres ${where} (schema ${backend.schema}, tables ${backend.tablePrefix}*)`,
      close: async () => {
        await backend.close();
        await sql.end({ timeout: 1 });
      },
    };
  } catch (error) {
    await sql.end({ timeout: 0 }).catch(() => {});
    if (error instanceof TypeError || error instanceof RangeError) throw new BackendUrlError(shown, errorMessage(error));
    throw new OperationError(`Cannot open Postgres at ${JSON.stringify(shown)}: ${errorMessage(error)}`);
  }
}

function keyPrefixOf(u: URL): { keyPrefix?: string } {
  const keyPrefix = u.searchParams.get("keyPrefix");
  return keyPrefix === null ? {} : { keyPrefix };
}

function onlyParams(u: URL, shown: string, allowed: readonly string[]): void {
  for (const k of u.searchParams.keys()) {
    if (!allowed.includes(k)) {
      throw new BackendUrlError(
        shown,
        `Backend URL ${JSON.stringify(shown)} has an unknown parameter ${JSON.stringify(k)}; it takes ${
          allowed.map((a) => JSON.stringify(a)).join(", ")
        }`,
      );
    }
  }
}

async function openRedis(backend: RedisDurability, shown: string, end: () => Promise<unknown>, what: string): Promise<OpenedBackend> {
  try {
    await backend.open();
  } catch (error) {
    await end().catch(() => {});
    throw new OperationError(`Cannot open Redis at ${JSON.stringify(shown)}: ${errorMessage(error)}`);
  }
  return {
    backend,
    description: `${what} (keys ${backend.keyPrefix}*)`,
    close: async () => {
      await backend.close();
      await end();
    },
  };
}

async function openUpstash(url: string, shown: string, scheme: string): Promise<OpenedBackend> {
  const u = parseUrl(url.replace(/^[a-z+]+:/i, "http:"), shown);
  onlyParams(u, shown, ["keyPrefix", "insecure"]);
  const token = decodeURIComponent(u.password || u.username);
  if (token === "") {
    throw new BackendUrlError(shown, `Backend URL ${JSON.stringify(shown)} has no token: write redis+upstash://<token>@host`);
  }
  const insecure = u.searchParams.get("insecure");
  if (insecure !== null && insecure !== "1" && insecure !== "0" && insecure !== "true" && insecure !== "false") {
    throw new BackendUrlError(shown, `Backend URL parameter "insecure" must be 1 or 0, got ${JSON.stringify(insecure)}`);
  }
  const http = scheme === "redis+upstash+http" || insecure === "1" || insecure === "true";
  const rest = `${http ? "http" : "https"}://${u.host}${u.pathname === "/" ? "" : u.pathname}`;
  const mod: Record<string, unknown> = await import("@upstash/redis").catch(notLoaded("@upstash/redis", "redis+upstash:// URLs"));
  const Redis = mod.Redis as new (options: Record<string, unknown>) => unknown;
  let backend: RedisDurability;
  try {
    backend = new RedisDurability({ client: new Redis({ url: rest, token, retry: false }), ...keyPrefixOf(u) });
  } catch (error) {
    throw new BackendUrlError(shown, errorMessage(error));
  }
  return await openRedis(backend, shown, () => Promise.resolve(), `upstash ${rest}`);
}

async function openIoredis(url: string, shown: string): Promise<OpenedBackend> {
  const u = parseUrl(url, shown);
  onlyParams(u, shown, ["keyPrefix"]);
  const prefix = keyPrefixOf(u);
  u.searchParams.delete("keyPrefix");
  const mod: Record<string, unknown> = await import("ioredis").catch(notLoaded("ioredis", "redis:// URLs"));
  const IORedis = (mod.default ?? mod.Redis ?? mod) as new (url: string, options: Record<string, unknown>) => {
    on(event: string, fn: (error: unknown) => void): unknown;
    quit(): Promise<unknown>;
    disconnect(): void;
  };
  let lastError: unknown;
  const client = new IORedis(u.toString(), {
    maxRetriesPerRequest: 1,
    connectTimeout: 5000,
    retryStrategy: (times: number) => (times > 2 ? null : 200),
  });
  client.on("error", (error) => (lastError = error));
  const end = async (): Promise<void> => {
    await client.quit().catch(() => client.disconnect());
  };
  let backend: RedisDurability;
  try {
    backend = new RedisDurability({ client, ...prefix });
  } catch (error) {
    client.disconnect();
    throw new BackendUrlError(shown, errorMessage(error));
  }
  try {
    return await openRedis(backend, shown, end, `redis ${u.host}${u.pathname === "/" ? "" : u.pathname}`);
  } catch (error) {
    client.disconnect();
    if (lastError !== undefined && !errorMessage(error).includes(errorMessage(lastError))) {
      throw new OperationError(`${errorMessage(error)} (${errorMessage(lastError)})`);
    }
    throw error;
  }
}
