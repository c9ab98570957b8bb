#!/usr/bin/env bash
# The whole suite, in order, stopping at the first failure. `npm test` runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/node_modules/.bin:$PATH"
export DENO_NO_UPDATE_CHECK=1

step() { printf '\n==> %s\n' "$*"; }

step "typecheck (tsc)";          tsc -p tsconfig.json
step "bun test";                 bun test --timeout=20000
step "deno check";               deno check mod.ts testing.ts backends/file.ts backends/sqlite.ts backends/events.ts backends/postgres.ts backends/redis.ts providers/telegram.ts providers/whatsapp.ts cli.ts
step "deno smoke: examples/echo.ts"; deno run --no-prompt examples/echo.ts
step "conformance on Deno (file, sqlite via node:sqlite, events journals, postgres via porsager)"
deno run -A tests/runtimes/conformance.ts file sqlite events-file events-shared postgres
step "conformance on Node $(node --version) (file, sqlite via better-sqlite3, events journals, postgres via porsager)"
rm -rf .tmp/rt && bun build tests/runtimes/conformance.ts --target=node --outdir .tmp/rt --external better-sqlite3 --external postgres >/dev/null
node .tmp/rt/conformance.js file sqlite events-file events-shared postgres
step "build (tsup)";             tsup
step "node smoke";               node scripts/node-smoke.mjs; node dist/cli.js --version
step "sqlite smoke of the npm build: Node, Deno, Bun"
node scripts/sqlite-smoke.mjs
deno run -A scripts/sqlite-smoke.mjs
bun scripts/sqlite-smoke.mjs
step "the crash demo (npm run demo)"; bun examples/demo/main.ts --quiet
step "deno publish --dry-run";   deno publish --dry-run --allow-dirty
printf '\nall checks passed\n'
