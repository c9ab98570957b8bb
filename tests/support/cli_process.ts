/**
 * The CLI as a process: run by Bun from the sources, or bundled for Node (`bun build --target=node`)
 * as the tests run it on Node 20 (the database clients stay external and resolve from the
 * repository's node_modules).
 */
import { join } from "node:path";

const root = join(import.meta.dir, "..", "..");

/**
 * Bundles cli.ts to `out` for Node.
 * @returns `out`
 * @throws when the build fails (with its output)
 */
export function bundleCliForNode(out: string): string {
  const build = Bun.spawnSync([
    join(root, "node_modules", ".bin", "bun"),
    "build",
    join(root, "cli.ts"),
    "--target=node",
    "--outfile",
    out,
    ...["postgres", "ioredis", "@upstash/redis", "better-sqlite3"].flatMap((p) => ["--external", p]),
  ]);
  if (build.exitCode !== 0) throw new Error(`bun build of cli.ts for Node failed: ${build.stderr.toString()}${build.stdout.toString()}`);
  return out;
}

/** What a CLI process printed, and its exit code. */
export interface CliRun {
  code: number;
  stdout: string;
  stderr: string;
}

/**
 * Runs `bun cli.ts <args>` in `cwd`, with no backend from the environment.
 * @returns its exit code and output
 */
export async function runCliProcess(cwd: string, args: string[]): Promise<CliRun> {
  const child = Bun.spawn([join(root, "node_modules", ".bin", "bun"), join(root, "cli.ts"), ...args], {
    cwd,
    stdout: "pipe",
    stderr: "pipe",
    env: { ...process.env, BOTMESH_DURABLE_BACKEND: "" },
  });
  const [stdout, stderr, code] = await Promise.all([new Response(child.stdout).text(), new Response(child.stderr).text(), child.exited]);
  return { code, stdout, stderr };
}
