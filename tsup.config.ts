import { defineConfig } from "tsup";

export default defineConfig([{
  entry: {
    "mod": "mod.ts",
    "backend": "backend.ts",
    "provider": "provider.ts",
    "ops": "ops.ts",
    "testing": "testing.ts",
    "backends/memory/mod": "backends/memory/mod.ts",
    "backends/kv/mod": "backends/kv/mod.ts",
    "backends/file/mod": "backends/file/mod.ts",
    "backends/sqlite/mod": "backends/sqlite/mod.ts",
    "backends/events/mod": "backends/events/mod.ts",
    "backends/postgres/mod": "backends/postgres/mod.ts",
    "backends/redis/mod": "backends/redis/mod.ts",
    "providers/telegram/mod": "providers/telegram/mod.ts",
    "providers/whatsapp/mod": "providers/whatsapp/mod.ts",
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
  dts: true,
  clean: false,
  splitting: false,
  sourcemap: true,
  banner: { js: "#!/usr/bin/env node" },
}]);
