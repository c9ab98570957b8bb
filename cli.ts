/**
 * `botmesh-durable`: the command line of `@botmesh/durable` (inspect and
 * repair a durability backend's inbox and outbox). Runs under Node (the npm
 * package's `bin`), Bun (`bunx botmesh-durable …`) and Deno
 * (`deno run -A jsr:@botmesh/durable/cli …`).
 *
 * @example
 * ```sh
 * npx botmesh-durable --backend sqlite:./data/bot.db list inbox --state dead
 * # the console runs until SIGTERM: start the bin itself (npx would not pass the signal on)
 * BOTMESH_CONSOLE_USER=ops BOTMESH_CONSOLE_PASSWORD=… node_modules/.bin/botmesh-durable console --backend sqlite:./data/bot.db --port 8080
 * ```
 *
 * @module
 */
import { runCli } from "./src/ops/cli.ts";
import { openBackend } from "./backends/open_url.ts";
import { cliArgs, cliEnv, exitProcess, writeStderr, writeStdout } from "./src/runtime/cli.ts";
import { serveHttp, untilSignal } from "./src/runtime/serve.ts";
import { nodeHandler } from "./src/ops/node_handler.ts";
import pkg from "./package.json" with { type: "json" };

const code: number = await runCli(cliArgs(), { stdout: writeStdout, stderr: writeStderr }, {
  open: openBackend,
  version: pkg.version,
  env: cliEnv,
  serve: (fetch, { port, hostname }) => serveHttp({ port, hostname, fetch, nodeListener: nodeHandler(fetch) }),
  untilShutdown: untilSignal,
});
exitProcess(code);
