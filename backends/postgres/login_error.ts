/**
 * A login the server refused, said as such: which user, at which server.
 * Without it the first statement's error ("password authentication failed")
 * reads as a problem of whatever that statement was for.
 *
 * @module
 */
import { errorMessage } from "../../src/errors.ts";

/**
 * SQLSTATEs of a refused login: a wrong password (28P01); no such role, no
 * `pg_hba.conf` entry for this host, user and database, a role that may not
 * log in (28000).
 */
const LOGIN_REFUSED = new Set(["28P01", "28000"]);

/** What porsager's client says of where it connects (`sql.options`); its password is never read. */
interface Target {
  user?: unknown;
  host?: unknown;
  port?: unknown;
  /** The Unix socket, when it connects to one (else `false`). */
  path?: unknown;
}

/** `db.example:5432`, `[::1]:5432`, several hosts joined by commas, or the Unix socket's path. */
function serverOf(target: Target | undefined): string {
  if (typeof target?.path === "string" && target.path !== "") return target.path;
  const hosts = Array.isArray(target?.host) ? target.host : [];
  const ports = Array.isArray(target?.port) ? target.port : [];
  return hosts
    .map((host, i) => {
      const name = typeof host === "string" && host.includes(":") ? `[${host}]` : String(host);
      const port = ports[i] ?? ports[0];
      return port === undefined ? name : `${name}:${port}`;
    })
    .join(",");
}

/**
 * The message of a refused login, or `null` for any other error.
 * @param error what a statement failed with (a porsager `PostgresError` carries its SQLSTATE as `code`)
 * @param sql the client: its user and server are named when it is porsager's (`sql.options`)
 * @returns `Postgres login failed for user "app" at db.example:5432: <the server's message>`, or `null`
 */
export function loginFailure(error: unknown, sql: unknown): string | null {
  const code = (error as { code?: unknown } | null)?.code;
  if (typeof code !== "string" || !LOGIN_REFUSED.has(code)) return null;
  const target = (sql as { options?: Target } | null)?.options;
  const user = typeof target?.user === "string" ? ` for user ${JSON.stringify(target.user)}` : "";
  const server = serverOf(target);
  return `Postgres login failed${user}${server === "" ? "" : ` at ${server}`}: ${errorMessage(error)}`;
}
