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
import { EventsDurability } from "./events/durability.ts";
import { FileEventJournal } from "./events/file_journal.ts";
import { SharedFileEventJournal } from "./events/shared_journal.ts";
import { checkFile, checkPostgresTables, checkRedisPrefix, checkSqliteTables, type RedisProbe } from "./open_checks.ts";
import { PostgresDurability } from "./postgres/mod.ts";
import { loginFailure } from "./postgres/login_error.ts";
import { RedisDurability } from "./redis/mod.ts";
import { SQLiteDurability } from "./sqlite/mod.ts";
import { hideCredentials } from "../src/ops/url_credentials.ts";
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
  let backend: DurabilityBackend;
  try {
    const tablePrefix = params.get("tablePrefix");
    backend = kind === "sqlite"
      ? new SQLiteDurability(tablePrefix === undefined ? { file: path } : { file: path, tablePrefix })
      : new FileDurability({ path });
  } catch (error) {
    throw new BackendUrlError(shown, errorMessage(error));
  }
  await checkFile(path, kind === "sqlite" ? "SQLite file" : "Backend file", shown);
  if (kind === "sqlite") await checkSqliteTables(path, params.get("tablePrefix") ?? "botmesh_", shown);
  await backend.open?.();
  return { backend, description: `${kind} ${path}`, close: async () => await backend.close?.() };
}

async function openJournal(kind: "file" | "shared", path: string, shown: string): Promise<OpenedBackend> {
  if (path === "") throw new BackendUrlError(shown, `Backend URL ${JSON.stringify(shown)} has no path`);
  await checkFile(
    path,
    "Events journal file",
    shown,
    `${kind === "file" ? "FileEventJournal" : "SharedFileEventJournal"}.open() creates it (the app opens the journal for its bot)`,
  );
  if (kind === "file" && (await statFile(`${path}.log`)) !== null) {
    // FileEventJournal.open would take the log over (replay it into the snapshot and remove it).
    throw new OperationError(
      `Events journal ${JSON.stringify(path)} has the append log of a SharedFileEventJournal (${path}.log): ` +
        `open it with events+shared: (events+file: would take the log over and change the file)`,
    );
  }
  let journal: FileEventJournal | SharedFileEventJournal;
  try {
    journal = kind === "file" ? await FileEventJournal.open(path, { lock: true }) : await SharedFileEventJournal.open(path);
  } catch (error) {
    const locked = (error as { name?: unknown } | null)?.name === "FileLockedError";
    throw new OperationError(
      `Cannot open events journal ${JSON.stringify(path)} (from ${JSON.stringify(shown)}): ${errorMessage(error)}` +
        (locked
          ? kind === "file"
            ? " (a FileEventJournal is open only in one process: stop the bot first)"
            : " (the bot uses a FileEventJournal: stop it, then open the file with events+file:)"
          : ""),
    );
  }
  const backend = new EventsDurability({ journal });
  return {
    backend,
    description: `events+${kind} ${path}`,
    close: async () => {
      await backend.close();
      await journal.close();
    },
  };
}

/**
 * Opens a durability backend from a URL or a path, and calls its `open()`:
 *
 * - `sqlite:./data/bot.db`, `sqlite:///abs/path.db`, or a path ending in
 *   `.db`, `.sqlite`, `.sqlite3` (`?tablePrefix=`);
 * - `file:./data/bot.json`, `file:///abs/path.json`, or a path ending in `.json`;
 * - `events+file:./data/events.json` (a `FileEventJournal`, its lock taken) or
 *   `events+shared:./data/events.json` (a `SharedFileEventJournal`), as an
 *   `EventsDurability` with the journal's outbox sidecar;
 * - `postgres://…` / `postgresql://…` with `?schema=…&tablePrefix=…` (other
 *   parameters go to the driver), through the `postgres` package;
 * - `redis+upstash://<token>@host[:port]` (https; `?insecure=1` or
 *   `redis+upstash+http://` for http), through `@upstash/redis`;
 * - `redis://host:port` / `rediss://…`, through `ioredis`;
 * - Redis forms take `?keyPrefix=…`.
 *
 * Nothing is created: a file that does not exist, a SQLite file or a Postgres
 * schema without the backend's tables (of that `tablePrefix`), a Redis key
 * prefix under which nothing was journaled are refused, the error naming
 * what was not found and the backends that are there. Nothing is upgraded
 * either: a SQLite file or Postgres schema of another schema version than
 * this package's is refused (it would be upgraded under the bots of the
 * older version that may be using it; a bot of this version upgrades it
 * when it starts).
 *
 * @param url the URL or path
 * @returns the open backend and how to close it (ending the client it created)
 * @throws {BackendUrlError} when the URL has no known form or a bad parameter (the message lists the forms)
 * @throws {OperationError} naming the package when the driver is not installed, what was not found when the
 *   backend does not exist, both versions when its schema is of another version, or the backend's error when
 *   it cannot be opened
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
  if (scheme === "sqlite" || scheme === "file" || scheme === "events+file" || scheme === "events+shared") {
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
    if (scheme === "events+file" || scheme === "events+shared") return await openJournal(scheme === "events+file" ? "file" : "shared", path, shown);
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
    await checkPostgresTables(sql, backend.schema, backend.tablePrefix, shown);
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
    if (error instanceof OperationError) throw error;
    const login = loginFailure(error, sql);
    if (login !== null) throw new OperationError(`${login} (from ${JSON.stringify(shown)})`);
    throw new OperationError(`Cannot open Postgres at ${JSON.stringify(shown)}: ${errorMessage(error)}`);
  }
}

/** Keys one SCAN page looks at (when listing the key prefixes there are). */
const SCAN_COUNT = 1000;

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

async function openRedis(
  backend: RedisDurability,
  probe: RedisProbe,
  shown: string,
  end: () => Promise<unknown>,
  what: string,
): Promise<OpenedBackend> {
  try {
    await backend.open();
    await checkRedisPrefix(probe, backend.keyPrefix, shown);
  } catch (error) {
    await end().catch(() => {});
    if (error instanceof OperationError) throw error;
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
  const Redis = mod.Redis as new (options: Record<string, unknown>) => {
    exists(...keys: string[]): Promise<number>;
    scan(cursor: string, options: { match: string; count: number }): Promise<[string | number, string[]]>;
  };
  let backend: RedisDurability;
  const client = new Redis({ url: rest, token, retry: false });
  try {
    backend = new RedisDurability({ client, ...keyPrefixOf(u) });
  } catch (error) {
    throw new BackendUrlError(shown, errorMessage(error));
  }
  const probe: RedisProbe = {
    exists: (keys) => client.exists(...keys),
    scan: async (cursor, match) => {
      const [next, keys] = await client.scan(cursor, { match, count: SCAN_COUNT });
      return [String(next), keys];
    },
  };
  return await openRedis(backend, probe, shown, () => Promise.resolve(), `upstash ${rest}`);
}

async function openIoredis(url: string, shown: string): Promise<OpenedBackend> {
  const u = parseUrl(url, shown);
  onlyParams(u, shown, ["keyPrefix"]);
  const prefix = keyPrefixOf(u);
  u.searchParams.delete("keyPrefix");
  const mod: Record<string, unknown> = await import("ioredis").catch(notLoaded("ioredis", "redis:// URLs"));
  const IORedis = (mod.default ?? mod.Redis ?? mod) as new (url: string, options: Record<string, unknown>) => {
    on(event: string, fn: (error: unknown) => void): unknown;
    exists(...keys: string[]): Promise<number>;
    scan(cursor: string, ...args: (string | number)[]): Promise<[string, string[]]>;
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
    const probe: RedisProbe = {
      exists: (keys) => client.exists(...keys),
      scan: (cursor, match) => client.scan(cursor, "MATCH", match, "COUNT", SCAN_COUNT),
    };
    return await openRedis(backend, probe, shown, end, `redis ${u.host}${u.pathname === "/" ? "" : u.pathname}`);
  } catch (error) {
    client.disconnect();
    if (lastError !== undefined && !errorMessage(error).includes(errorMessage(lastError))) {
      throw new OperationError(`${errorMessage(error)} (${errorMessage(lastError)})`);
    }
    throw error;
  }
}
