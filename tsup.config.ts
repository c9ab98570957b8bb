import { defineConfig } from "tsup";

export default defineConfig([{
  entry: {
    mod: "mod.ts",
    testing: "testing.ts",
    "backends/file": "backends/file.ts",
    "backends/sqlite": "backends/sqlite.ts",
    "backends/events": "backends/events.ts",
    "backends/postgres": "backends/postgres.ts",
    "backends/redis": "backends/redis.ts",
    "providers/telegram": "providers/telegram.ts",
    "providers/whatsapp": "providers/whatsapp.ts",
  },
  // Runtime drivers resolved at run time by src/runtime/, never bundled.
  external: ["bun:sqlite", "node:sqlite", "better-sqlite3"],
  outDir: "dist",
  format: ["esm"],
  target: "node20",
  dts: true,
  clean: true,
  splitting: true,
  sourcemap: true,
}, {
  // The botmesh-durable CLI (package.json "bin"): one file with a shebang. Its driver packages are
  // imported at run time and stay out of the bundle.
  entry: { cli: "cli.ts" },
  external: ["bun:sqlite", "node:sqlite", "better-sqlite3"],
  outDir: "dist",
  format: ["esm"],
  target: "node20",
  dts: false,
  clean: false,
  splitting: false,
  sourcemap: true,
  banner: { js: "#!/usr/bin/env node" },
}]);
