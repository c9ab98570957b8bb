/**
 * The database servers the shared backends' tests run against, and whether
 * they are reachable. On a laptop without them those tests skip with a message;
 * with `BOTMESH_REQUIRE_SERVICES=1` (set by `.ci/run`) a missing server fails
 * the run instead.
 */
import { connect, createServer } from "node:net";

/** Where the tests find PostgreSQL (`BOTMESH_PG_URL` overrides; trust auth, database `test`). */
export const POSTGRES_URL: string = process.env.BOTMESH_PG_URL ?? "postgres://postgres@127.0.0.1:5432/test";
/** Where the tests find Redis over TCP (`BOTMESH_REDIS_URL` overrides). */
export const REDIS_URL: string = process.env.BOTMESH_REDIS_URL ?? "redis://127.0.0.1:6379";

/** Whether a missing server must fail the run (CI) rather than skip its tests. */
export const SERVICES_REQUIRED: boolean = process.env.BOTMESH_REQUIRE_SERVICES === "1";

function hostPort(url: string, defaultPort: number): { host: string; port: number } {
  const u = new URL(url);
  return { host: u.hostname || "127.0.0.1", port: Number(u.port || defaultPort) };
}

/** Whether something accepts TCP connections at `host:port` within `timeoutMs`. */
export function tcpReachable(host: string, port: number, timeoutMs = 1_000): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = connect({ host, port });
    const done = (ok: boolean) => {
      clearTimeout(timer);
      socket.destroy();
      resolve(ok);
    };
    const timer = setTimeout(() => done(false), timeoutMs);
    socket.once("connect", () => done(true));
    socket.once("error", () => done(false));
  });
}

const probes = new Map<string, Promise<boolean>>();

function probe(name: string, url: string, defaultPort: number): Promise<boolean> {
  let p = probes.get(name);
  if (!p) {
    const { host, port } = hostPort(url, defaultPort);
    p = tcpReachable(host, port);
    probes.set(name, p);
  }
  return p;
}

/**
 * A skip reason for tests that need `service`, or `false` when it is reachable.
 * @throws {Error} when it is not reachable and `BOTMESH_REQUIRE_SERVICES=1`
 */
export async function serviceSkip(service: "postgres" | "redis"): Promise<string | false> {
  const url = service === "postgres" ? POSTGRES_URL : REDIS_URL;
  const up = await probe(service, url, service === "postgres" ? 5432 : 6379);
  if (up) return false;
  const where = new URL(url).host;
  if (SERVICES_REQUIRED) {
    throw new Error(`BOTMESH_REQUIRE_SERVICES=1 but ${service} is not reachable at ${where}`);
  }
  const reason = `${service} is not reachable at ${where}: skipping its tests (start it, or set ` +
    `${service === "postgres" ? "BOTMESH_PG_URL" : "BOTMESH_REDIS_URL"})`;
  console.warn(reason);
  return reason;
}

/** A random name part for one test run's schema, table prefix or key prefix. */
export function runId(): string {
  return crypto.randomUUID().replaceAll("-", "").slice(0, 12);
}

/** A TCP port on loopback that nothing listens on now (the OS picks it). */
export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const { port } = server.address() as { port: number };
      server.close(() => resolve(port));
    });
  });
}
