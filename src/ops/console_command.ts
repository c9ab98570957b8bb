/**
 * `botmesh-durable console`: the web console served on its own, for
 * operators who do not mount it in their bot's server. It opens the backend
 * from its URL, serves {@link durabilityConsole} on a port, and stops on
 * SIGINT or SIGTERM (closing the server, then the backend).
 *
 * Credentials come from the environment: `BOTMESH_CONSOLE_USER` and
 * `BOTMESH_CONSOLE_PASSWORD` (HTTP Basic, at least 12 characters). Without
 * them it refuses to start, unless `--no-auth` is given with a loopback
 * `--host` (127.0.0.1, ::1, localhost); then it answers only requests whose
 * `Host` is a loopback name with its port, so that a web page of another
 * site cannot reach it through a DNS name rebound to 127.0.0.1 (403
 * otherwise). `BOTMESH_CONSOLE_CSRF_SECRET` keeps
 * confirmation pages valid across restarts.
 *
 * @module
 */
import { errorMessage } from "../errors.ts";
import type { CliIo, CliOptions, OpenedBackend } from "./cli.ts";
import { basicAuth, type ConsoleAuth, durabilityConsole } from "./console.ts";
import { hideCredentials } from "./url_credentials.ts";
import { remoteAddressOf } from "../runtime/remote_address.ts";

/** A server the command listens with (the runtime's: `Bun.serve`, `Deno.serve`, Node `http`). */
export interface ServedConsole {
  /** The port it listens on. */
  readonly port: number;
  /** Stops listening. */
  close(): Promise<void>;
}

/** Starts serving `fetch` on `hostname:port` (the command line's entry gives the runtime's). */
export type ConsoleServe = (
  fetch: (request: Request) => Promise<Response>,
  address: { port: number; hostname: string },
) => Promise<ServedConsole>;

/** The environment variables of the console command. */
export const CONSOLE_ENV = {
  user: "BOTMESH_CONSOLE_USER",
  password: "BOTMESH_CONSOLE_PASSWORD",
  csrfSecret: "BOTMESH_CONSOLE_CSRF_SECRET",
} as const;

/** The help of `botmesh-durable console`. */
export const CONSOLE_USAGE: string = `Usage: botmesh-durable console [--backend <url>] [--port 8080] [--host 127.0.0.1] [--base-path /ops] [--no-auth]

Serves the web console (lists, records, replay, retry, discard, mark as delivered,
bulk actions) for the backend, until Ctrl-C / SIGTERM.

Options:
  -b, --backend <url>   the backend (or set BOTMESH_DURABLE_BACKEND)
  --port <n>            the port (default 8080; 0: any free port)
  --host <address>      the address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)
  --base-path <path>    serve under this path, e.g. /ops (default: the root)
  --no-auth             no sign-in: only with a loopback --host (127.0.0.1, ::1, localhost); it
                        then answers only a loopback Host (localhost, 127.0.0.1 or [::1], with the port)
  -h, --help            this help

Environment:
  ${CONSOLE_ENV.user}, ${CONSOLE_ENV.password}   the operator's HTTP Basic credentials (required
                        unless --no-auth; the password at least 12 characters). Serve it over
                        HTTPS (a reverse proxy) when it is reachable from other hosts.
  ${CONSOLE_ENV.csrfSecret}   optional, at least 16 characters: confirmation pages stay valid
                        across restarts and replicas
`;

const MIN_PASSWORD = 12;

/** A bad command line: exit code 2. */
class ConsoleUsageError extends Error {
  override name = "ConsoleUsageError";
}

/**
 * Whether `argv` runs the `console` command: its first argument that is not
 * the `--backend` flag (with its value) is `console`.
 * @param argv the arguments after the program name
 * @returns whether to hand them to {@link runConsoleCommand}
 */
export function isConsoleCommand(argv: readonly string[]): boolean {
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === "-b" || arg === "--backend") {
      i++;
      continue;
    }
    if (arg.startsWith("--backend=")) continue;
    return arg === "console";
  }
  return false;
}

function isLoopback(host: string): boolean {
  return host === "localhost" || host === "::1" || host === "[::1]" || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(host);
}

/**
 * Whether a `Host` header names a loopback address (`localhost`, `127.x.y.z`,
 * `[::1]`) with the port the console listens on (80 when it names none).
 * @param host the `Host` header
 * @param port the port the console listens on
 * @returns whether the console without sign-in answers it
 */
function isLoopbackHost(host: string, port: number): boolean {
  const match = /^(\[[0-9a-f:.]+\]|[^:\[\]]+)(?::(\d{1,5}))?$/.exec(host.trim().toLowerCase());
  if (!match) return false;
  const name = match[1]!;
  return (match[2] === undefined ? 80 : Number(match[2])) === port &&
    (name === "localhost" || name === "[::1]" || /^127\.\d{1,3}\.\d{1,3}\.\d{1,3}$/.test(name));
}

/**
 * The console without sign-in: requests whose `Host` is not a loopback name
 * with the console's port are refused with a 403 (a DNS name rebound to
 * 127.0.0.1 would otherwise let a web page of another site use it).
 * @param handler the console
 * @param port the port it listens on, once known
 * @returns the guarded handler
 */
function loopbackOnly(
  handler: (request: Request) => Promise<Response>,
  port: () => number | undefined,
): (request: Request) => Promise<Response> {
  return async (request) => {
    const host = request.headers.get("host") ?? new URL(request.url).host;
    const listening = port();
    if (listening !== undefined && isLoopbackHost(host, listening)) return await handler(request);
    return new Response(
      `Refused: this console runs without sign-in (--no-auth) and answers only requests to localhost, 127.0.0.1 or [::1] ` +
        `with its port${listening === undefined ? "" : ` ${listening}`}, not to Host ${JSON.stringify(host)}. ` +
        `Open it through one of those, or give it credentials to serve it under another name.\n`,
      { status: 403, headers: { "content-type": "text/plain; charset=utf-8", "cache-control": "no-store", "x-content-type-options": "nosniff" } },
    );
  };
}

interface ConsoleArgs {
  backend?: string;
  port: number;
  host: string;
  basePath: string;
  noAuth: boolean;
  help: boolean;
}

function parse(argv: readonly string[]): ConsoleArgs {
  const out: ConsoleArgs = { port: 8080, host: "127.0.0.1", basePath: "", noAuth: false, help: false };
  const seen = new Set<string>();
  let command = false;
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === "console" && !command) {
      command = true;
      continue;
    }
    const eq = arg.indexOf("=");
    const name = arg === "-b" ? "backend" : arg === "-h" ? "help" : arg.startsWith("--") ? arg.slice(2, eq === -1 ? undefined : eq) : null;
    if (name === null) throw new ConsoleUsageError(`Unexpected argument ${JSON.stringify(arg)} for "console"`);
    if (name === "help" || name === "no-auth") {
      if (eq !== -1) throw new ConsoleUsageError(`Flag "--${name}" takes no value, got ${JSON.stringify(arg)}`);
      if (name === "help") out.help = true;
      else out.noAuth = true;
      continue;
    }
    if (!["backend", "port", "host", "base-path"].includes(name)) {
      throw new ConsoleUsageError(`Unknown flag ${JSON.stringify(arg)} for "console"; it takes --backend, --port, --host, --base-path, --no-auth`);
    }
    const value = eq !== -1 && arg.startsWith("--") ? arg.slice(eq + 1) : argv[++i];
    if (value === undefined) throw new ConsoleUsageError(`Flag "--${name}" needs a value`);
    if (seen.has(name)) throw new ConsoleUsageError(`Flag "--${name}" is given twice`);
    seen.add(name);
    if (name === "backend") out.backend = value;
    else if (name === "host") out.host = value;
    else if (name === "base-path") out.basePath = value;
    else {
      if (!/^\d{1,5}$/.test(value) || Number(value) > 65535) {
        throw new ConsoleUsageError(`Flag "--port" must be a port number from 0 to 65535, got ${JSON.stringify(value)}`);
      }
      out.port = Number(value);
    }
  }
  return out;
}

/**
 * Runs `botmesh-durable console`: serves the web console for a backend until
 * `options.untilShutdown` resolves (SIGINT/SIGTERM in the command line).
 *
 * @param argv the arguments after the program name (including `console`)
 * @param io where messages go (the address on stdout, the rest on stderr)
 * @param options the command line's options: `open`, `serve` and `untilShutdown` are needed, `env` gives the credentials
 * @param backendEnv the environment variable read when `--backend` is not given
 * @returns the exit code: 0 stopped cleanly, 1 it could not start (backend, port), 2 bad usage or missing credentials
 */
export async function runConsoleCommand(
  argv: readonly string[],
  io: CliIo,
  options: CliOptions,
  backendEnv: string,
): Promise<number> {
  const usage = async (message: string): Promise<number> => {
    await io.stderr(`botmesh-durable console: ${hideCredentials(message)}\n\n${CONSOLE_USAGE}`);
    return 2;
  };
  let args: ConsoleArgs;
  try {
    args = parse(argv);
  } catch (error) {
    return await usage(errorMessage(error));
  }
  if (args.help) {
    await io.stdout(CONSOLE_USAGE);
    return 0;
  }
  const env = (name: string): string => options.env?.(name) ?? "";
  const url = args.backend ?? env(backendEnv);
  if (url === "") return await usage(`Missing the backend: give --backend <url> or set ${backendEnv}`);
  const user = env(CONSOLE_ENV.user);
  const password = env(CONSOLE_ENV.password);
  let auth: ConsoleAuth;
  if (args.noAuth) {
    if (!isLoopback(args.host)) {
      return await usage(`--no-auth is refused with --host ${args.host}: it is allowed only on a loopback address (127.0.0.1, ::1, localhost)`);
    }
    if (user !== "" || password !== "") return await usage(`--no-auth is given but ${CONSOLE_ENV.user}/${CONSOLE_ENV.password} are set: choose one`);
    auth = () => ({ user: "local operator" });
  } else {
    if (user === "" || password === "") {
      return await usage(
        `Refusing to start without credentials: set ${CONSOLE_ENV.user} and ${CONSOLE_ENV.password} (or give --no-auth with a loopback --host)`,
      );
    }
    if (password.length < MIN_PASSWORD) {
      return await usage(`${CONSOLE_ENV.password} must be at least ${MIN_PASSWORD} characters, got ${password.length}`);
    }
    try {
      // Failed sign-ins count per client address (else per user name: a guesser would lock the operator out too).
      auth = basicAuth(user, password, { clientKey: (request) => remoteAddressOf(request) ?? null });
    } catch (error) {
      return await usage(`${CONSOLE_ENV.user}: ${errorMessage(error)}`);
    }
  }
  if (options.serve === undefined || options.untilShutdown === undefined) {
    await io.stderr("botmesh-durable console: this runtime cannot serve HTTP here (no server given)\n");
    return 1;
  }
  const csrfSecret = env(CONSOLE_ENV.csrfSecret);
  let handler: ReturnType<typeof durabilityConsole>;
  let opened: OpenedBackend | undefined;
  try {
    opened = await options.open(url);
    handler = durabilityConsole(opened.backend, {
      auth,
      basePath: args.basePath,
      openBackend: false,
      ...(csrfSecret !== "" ? { csrfSecret } : {}),
      onError: (error) => void io.stderr(`botmesh-durable console: ${errorMessage(error)}\n`),
    });
  } catch (error) {
    await opened?.close().catch(() => {});
    await io.stderr(`botmesh-durable console: ${errorMessage(error)}\n`);
    return error instanceof TypeError ? 2 : 1;
  }
  let server: ServedConsole | undefined;
  const served = args.noAuth ? loopbackOnly(handler, () => server?.port) : handler;
  // Listening for the stop signal before serving: a SIGTERM right after the address is printed stops it cleanly.
  const shutdown = options.untilShutdown();
  try {
    server = await options.serve(served, { port: args.port, hostname: args.host });
  } catch (error) {
    await opened.close().catch(() => {});
    await io.stderr(`botmesh-durable console: cannot listen on ${args.host}:${args.port}: ${errorMessage(error)}\n`);
    return 1;
  }
  const host = args.host.includes(":") && !args.host.startsWith("[") ? `[${args.host}]` : args.host;
  await io.stderr(
    `botmesh-durable console: serving ${opened.description} ${args.noAuth ? "without sign-in (loopback only)" : `for user ${JSON.stringify(user)}`}; stop with Ctrl-C\n`,
  );
  await io.stdout(`http://${host}:${server.port}${args.basePath}/\n`);
  await shutdown;
  await server.close().catch(() => {});
  await opened.close().catch(async (error) => {
    await io.stderr(`botmesh-durable console: warning: closing ${opened.description} failed: ${errorMessage(error)}\n`);
  });
  await io.stderr("botmesh-durable console: stopped\n");
  return 0;
}
