/**
 * `@botmesh/durable/ops`: running a bot. The operations console (a fetch
 * handler with its own pages, no scripts; or on its own: `botmesh-durable
 * console`), Prometheus metrics, the building blocks of the `botmesh-durable`
 * command line, and `nodeHandler` to serve any fetch handler from Node's
 * `http` module.
 *
 * @example
 * ```ts ignore
 * import { basicAuth, durabilityConsole, prometheusMetrics, PROMETHEUS_CONTENT_TYPE } from "@botmesh/durable/ops";
 *
 * const console = durabilityConsole(bot, { basePath: "/ops", auth: basicAuth("admin", Deno.env.get("OPS_PASSWORD")!) });
 * Deno.serve(async (request) => {
 *   const path = new URL(request.url).pathname;
 *   if (path.startsWith("/ops")) return console(request);
 *   if (path === "/metrics") return new Response(await prometheusMetrics(bot), { headers: { "content-type": PROMETHEUS_CONTENT_TYPE } });
 *   return new Response("not found", { status: 404 });
 * });
 * ```
 *
 * @module
 */
export {
  basicAuth,
  type BasicAuthOptions,
  type ConsoleAuth,
  type ConsoleBot,
  type ConsoleHandler,
  type ConsoleIdentity,
  type ConsoleTarget,
  durabilityConsole,
  type DurabilityConsoleOptions,
  nodeHandler,
  type NodeHandlerOptions,
  type NodeRequestLike,
  type NodeResponseLike,
  SignInLimitedError,
} from "./src/ops/console.ts";
export { remoteAddressOf } from "./src/runtime/remote_address.ts";
export {
  countRecords,
  PROMETHEUS_CONTENT_TYPE,
  prometheusMetrics,
  type PrometheusOptions,
  type PrometheusSource,
  type RecordCounts,
} from "./src/ops/prometheus.ts";
export {
  BACKEND_ENV,
  type BackendOpener,
  BackendUrlError,
  type CliIo,
  type CliOptions,
  type OpenedBackend,
  runCli,
  USAGE,
} from "./src/ops/cli.ts";
export {
  CONSOLE_ENV,
  CONSOLE_USAGE,
  type ConsoleServe,
  runConsoleCommand,
  type ServedConsole,
} from "./src/ops/console_command.ts";
export { openBackend } from "./backends/open_url.ts";
