/**
 * `botmesh-durable`: the command line of `@botmesh/durable` (inspect and
 * repair a durability backend's inbox and outbox). Runs under Node (the npm
 * package's `bin`), Bun (`bunx botmesh-durable …`) and Deno
 * (`deno run -A jsr:@botmesh/durable/cli …`).
 *
 * @example
 * ```sh
 * npx botmesh-durable --backend sqlite:./data/bot.db list inbox --state dead
 * ```
 *
 * @module
 */
import { runCli } from "./src/ops/cli.ts";
import { openBackend } from "./backends/open_url.ts";
import { cliArgs, cliEnv, exitProcess, writeStderr, writeStdout } from "./src/runtime/cli.ts";
import pkg from "./package.json" with { type: "json" };

const code: number = await runCli(cliArgs(), { stdout: writeStdout, stderr: writeStderr }, {
  open: openBackend,
  version: pkg.version,
  env: cliEnv,
});
exitProcess(code);
