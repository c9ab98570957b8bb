import { chmod, readFile, writeFile } from "node:fs/promises";
import { defineConfig } from "tsup";

// One build for every entry, the CLI included: a single declaration pass, and no second build
// whose output (or whose `clean`) races the first's.
export default defineConfig({
  entry: {
    "mod": "mod.ts",
    "backend": "backend.ts",
    "provider": "provider.ts",
    "ops": "ops.ts",
    "testing": "testing.ts",
    "cli": "cli.ts",
    "backends/memory/mod": "backends/memory/mod.ts",
    "backends/kv/mod": "backends/kv/mod.ts",
    "backends/file/mod": "backends/file/mod.ts",
    "backends/sqlite/mod": "backends/sqlite/mod.ts",
    "backends/events/mod": "backends/events/mod.ts",
    "backends/postgres/mod": "backends/postgres/mod.ts",
    "backends/redis/mod": "backends/redis/mod.ts",
    "providers/telegram/mod": "providers/telegram/mod.ts",
    "providers/whatsapp/mod": "providers/whatsapp/mod.ts",
    "providers/grammy/mod": "providers/grammy/mod.ts",
    "providers/telegraf/mod": "providers/telegraf/mod.ts",
    "providers/builderbot/mod": "providers/builderbot/mod.ts",
    "providers/baileys/mod": "providers/baileys/mod.ts",
  },
  // The SQLite drivers and the client packages are imported lazily, by the runtime or the kind of
  // backend URL that needs them: never bundled.
  external: ["bun:sqlite", "node:sqlite", "better-sqlite3", "postgres", "ioredis", "@upstash/redis", "grammy", "telegraf", "@builderbot/bot", "baileys"],
  outDir: "dist",
  format: ["esm"],
  target: "node20",
  dts: true,
  clean: true,
  splitting: true,
  // No source maps in the published build: they were most of the tarball, and the chunks are
  // readable ESM already (not minified).
  sourcemap: false,
  // Keep `node:` specifiers: `node:sqlite` exists only under that name.
  removeNodeProtocol: false,
  // The botmesh-durable bin (package.json "bin"): a banner would land on every chunk, so the
  // shebang is added to the CLI entry alone.
  async onSuccess() {
    const cli = "dist/cli.js";
    const code = await readFile(cli, "utf8");
    if (!code.startsWith("#!")) await writeFile(cli, `#!/usr/bin/env node\n${code}`);
    await chmod(cli, 0o755);
  },
});
