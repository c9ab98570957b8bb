/**
 * `botmesh-durable`: the command line of `@botmesh/durable` (inspect and
 * repair a durability backend's inbox and outbox). Runs under Bun
 * (`bun cli.ts …`), Deno (`deno run -A cli.ts …`) and Node (the npm build's
 * `dist/cli.js`, the package's `bin`).
 *
 * @example
 * ```sh
 * botmesh-durable --backend sqlite:./data/bot.db list inbox --state dead
 * ```
 *
 * @module
 */
import { runCli } from "./src/ops/cli.ts";
import { cliArgs, cliEnv, exitProcess, writeStderr, writeStdout } from "./src/runtime/cli.ts";
import pkg from "./package.json" with { type: "json" };

const code: number = await runCli(cliArgs(), { stdout: writeStdout, stderr: writeStderr }, {
  version: pkg.version,
  env: cliEnv,
});
exitProcess(code);
