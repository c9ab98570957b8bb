/**
 * The runtime side of the `botmesh-durable` command line: arguments, the
 * environment, standard output and error, and the exit code, on Node, Bun and
 * Deno. The command itself (`src/ops/cli.ts`) is Web-standard and gets these
 * as functions.
 *
 * @module
 */

interface DenoCli {
  args: string[];
  env: { get(name: string): string | undefined };
  stdout: { write(bytes: Uint8Array): Promise<number> };
  stderr: { write(bytes: Uint8Array): Promise<number> };
  exit(code: number): never;
}

interface NodeStream {
  write(text: string, callback: (error?: Error | null) => void): boolean;
}

interface NodeProcess {
  argv: string[];
  env: Record<string, string | undefined>;
  stdout: NodeStream;
  stderr: NodeStream;
  exit(code: number): never;
}

const g = globalThis as unknown as { Deno?: DenoCli; process?: NodeProcess };

/**
 * The command-line arguments after the program (and script) name.
 *
 * @returns the arguments
 * @example
 * ```ts
 * // bun cli.ts list inbox  →  ["list", "inbox"]
 * const args = cliArgs();
 * ```
 */
export function cliArgs(): string[] {
  if (g.Deno !== undefined) return [...g.Deno.args];
  if (g.process !== undefined) return g.process.argv.slice(2);
  return [];
}

/**
 * Reads an environment variable, or `undefined` when it is unset or cannot
 * be read (Deno without `--allow-env`).
 *
 * @param name the variable
 * @returns its value
 * @example
 * ```ts
 * const url = cliEnv("BOTMESH_DURABLE_BACKEND");
 * ```
 */
export function cliEnv(name: string): string | undefined {
  try {
    if (g.Deno !== undefined) return g.Deno.env.get(name);
    return g.process?.env[name];
  } catch {
    return undefined;
  }
}

async function writeDeno(stream: { write(bytes: Uint8Array): Promise<number> }, text: string): Promise<void> {
  let bytes = new TextEncoder().encode(text);
  while (bytes.length > 0) bytes = bytes.subarray(await stream.write(bytes));
}

function writeNode(stream: NodeStream, text: string): Promise<void> {
  return new Promise((resolve, reject) => stream.write(text, (error) => (error ? reject(error) : resolve())));
}

/**
 * Writes text to standard output; resolves once it was handed to the OS.
 *
 * @param text what to write (no newline is added)
 * @returns when written
 * @example
 * ```ts
 * await writeStdout("hello\n");
 * ```
 */
export function writeStdout(text: string): Promise<void> {
  if (g.Deno !== undefined) return writeDeno(g.Deno.stdout, text);
  if (g.process !== undefined) return writeNode(g.process.stdout, text);
  return Promise.resolve();
}

/**
 * Writes text to standard error; resolves once it was handed to the OS.
 *
 * @param text what to write (no newline is added)
 * @returns when written
 * @example
 * ```ts
 * await writeStderr("oops\n");
 * ```
 */
export function writeStderr(text: string): Promise<void> {
  if (g.Deno !== undefined) return writeDeno(g.Deno.stderr, text);
  if (g.process !== undefined) return writeNode(g.process.stderr, text);
  return Promise.resolve();
}

/**
 * Ends the process with `code`.
 *
 * @param code the exit code
 * @returns never
 * @throws {Error} where there is no process to end
 * @example
 * ```ts
 * exitProcess(2);
 * ```
 */
export function exitProcess(code: number): never {
  if (g.Deno !== undefined) return g.Deno.exit(code);
  if (g.process !== undefined) return g.process.exit(code);
  throw new Error(`Cannot exit with code ${code}: no process on this runtime`);
}
