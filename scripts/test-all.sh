#!/usr/bin/env bash
# The whole suite, in order, stopping at the first failure. `npm test` runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/node_modules/.bin:$PATH"
export DENO_NO_UPDATE_CHECK=1

step() { printf '\n==> %s\n' "$*"; }

step "typecheck (tsc)";          tsc -p tsconfig.json
step "bun test";                 bun test --timeout=20000
step "deno check";               deno check mod.ts testing.ts
step "deno smoke: examples/echo.ts"; deno run --no-prompt examples/echo.ts
step "build (tsup)";             tsup
step "node smoke";               node scripts/node-smoke.mjs
step "deno publish --dry-run";   deno publish --dry-run --allow-dirty
printf '\nall checks passed\n'
