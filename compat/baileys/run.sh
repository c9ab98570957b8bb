#!/usr/bin/env bash
# Checks @botmesh/durable/baileys against the real baileys package: installs it here (npm overrides
# replace its GitHub-only dependencies, libsignal and @whiskeysockets/eslint-config, with npm-published
# builds), type-checks the real types against the provider's structural ones, and runs
# real_baileys.test.ts. Not part of `npm test` or CI: the repository's own install stays free of Baileys.
set -euo pipefail
cd "$(dirname "$0")"
root="$(cd ../.. && pwd)"
[ -d node_modules/baileys ] || npm ci --ignore-scripts --no-audit --no-fund
"$root/node_modules/.bin/tsc" -p tsconfig.json
"$root/node_modules/.bin/bun" test --timeout=20000 ./real_baileys.test.ts
