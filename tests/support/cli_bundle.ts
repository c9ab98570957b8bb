/**
 * The CLI bundled for Node (`bun build --target=node`), as the tests run it on Node 20: the database
 * clients stay external and resolve from the repository's node_modules.
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
