/**
 * A throwaway PgBouncer (Debian's `pgbouncer`) on a free loopback port, in
 * front of the tests' PostgreSQL, for the suites that check the Postgres
 * backend behind a pooler.
 */
import { spawnSync } from "node:child_process";
import { chmodSync, existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { freePort, POSTGRES_URL, SERVICES_REQUIRED, tcpReachable } from "./services.ts";

/** A running PgBouncer. */
export interface PgBouncer {
  /** The connection URL through it (the same user and database as {@link POSTGRES_URL}). */
  url: string;
  /** Its pool mode. */
  mode: "session" | "transaction";
  stop(): Promise<void>;
}

const BINARY = ["/usr/sbin/pgbouncer", "/usr/bin/pgbouncer"].find((path) => existsSync(path));

/** A skip reason when PgBouncer is not installed, or `false` (a failure instead with `BOTMESH_REQUIRE_SERVICES=1`). */
export function pgbouncerSkip(): string | false {
  if (BINARY) return false;
  if (SERVICES_REQUIRED) throw new Error("BOTMESH_REQUIRE_SERVICES=1 but pgbouncer is not installed (apt-get install pgbouncer)");
  const reason = "pgbouncer is not installed: skipping the tests through it (apt-get install pgbouncer)";
  console.warn(reason);
  return reason;
}


/**
 * Starts PgBouncer in `mode` in front of the tests' PostgreSQL.
 * @param mode the pool mode
 * @param poolSize server connections per user and database
 * @returns the running pooler
 */
export async function startPgBouncer(mode: "session" | "transaction", poolSize = 20): Promise<PgBouncer> {
  if (!BINARY) throw new Error("pgbouncer is not installed");
  const target = new URL(POSTGRES_URL);
  const database = target.pathname.slice(1) || "postgres";
  const user = decodeURIComponent(target.username || "postgres");
  const dir = mkdtempSync(join(tmpdir(), "botmesh-pgbouncer-"));
  chmodSync(dir, 0o777); // PgBouncer refuses to run as root: started as root, it runs as `postgres`
  const port = await freePort();
  const ini = join(dir, "pgbouncer.ini");
  writeFileSync(
    ini,
    [
      "[databases]",
      `${database} = host=${target.hostname || "127.0.0.1"} port=${target.port || 5432} dbname=${database} user=${user}`,
      "[pgbouncer]",
      "listen_addr = 127.0.0.1",
      `listen_port = ${port}`,
      "unix_socket_dir =",
      "auth_type = any",
      `pool_mode = ${mode}`,
      "max_client_conn = 1000",
      `default_pool_size = ${poolSize}`,
      "ignore_startup_parameters = extra_float_digits,options",
      `logfile = ${join(dir, "pgbouncer.log")}`,
      `pidfile = ${join(dir, "pgbouncer.pid")}`,
      "",
    ].join("\n"),
  );
  chmodSync(ini, 0o644);
  const root = typeof process.getuid === "function" && process.getuid() === 0;
  const started = spawnSync(BINARY, ["-d", ...(root ? ["-u", "postgres"] : []), ini], { encoding: "utf8" });
  if (started.status !== 0) {
    throw new Error(`pgbouncer did not start (exit ${started.status}): ${started.stderr || started.stdout}`);
  }
  const log = () => (existsSync(join(dir, "pgbouncer.log")) ? readFileSync(join(dir, "pgbouncer.log"), "utf8") : "");
  for (let i = 0; i < 100 && !(await tcpReachable("127.0.0.1", port, 200)); i++) await new Promise((r) => setTimeout(r, 50));
  if (!(await tcpReachable("127.0.0.1", port, 500))) throw new Error(`pgbouncer is not listening on ${port}: ${log().slice(-2000)}`);
  const url = new URL(POSTGRES_URL);
  url.hostname = "127.0.0.1";
  url.port = String(port);
  return {
    url: url.toString(),
    mode,
    stop: async () => {
      const pidFile = join(dir, "pgbouncer.pid");
      const pid = existsSync(pidFile) ? Number(readFileSync(pidFile, "utf8").trim()) : NaN;
      if (Number.isInteger(pid)) {
        try {
          process.kill(pid, "SIGTERM");
        } catch {
          // gone already
        }
        for (let i = 0; i < 100; i++) {
          try {
            process.kill(pid, 0);
          } catch {
            break;
          }
          await new Promise((r) => setTimeout(r, 20));
        }
      }
      if (process.env.BOTMESH_KEEP_PGBOUNCER === "1") console.warn(`pgbouncer log kept in ${dir}`);
      else rmSync(dir, { recursive: true, force: true });
    },
  };
}
