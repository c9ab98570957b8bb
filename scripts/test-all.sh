#!/usr/bin/env bash
# The whole suite, in order, stopping at the first failure. `npm test` runs this.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/node_modules/.bin:$PATH"
export DENO_NO_UPDATE_CHECK=1

step() { printf '\n==> %s\n' "$*"; }

step "typecheck (tsc)";          tsc -p tsconfig.json
step "bun test (the Postgres and Redis suites in a second process, side by side with the rest)"
# Two processes, one per core, each with its own schemas and key prefixes: the suites on the Postgres
# and Redis servers (their conformance on simulated time, the replica processes, the cluster) in one,
# the rest in the other, about as long.
SERVER_TESTS=(conformance_postgres conformance_redis conformance_pgbouncer postgres_backend redis_backend postgres_outage redis_outage redis_cluster replicas events_shared)
server_files=()
other_files=()
for f in tests/*.test.ts tests/runtimes/*.test.ts; do
  name=$(basename "$f" .test.ts)
  if [[ " ${SERVER_TESTS[*]} " == *" $name "* ]]; then server_files+=("./$f"); else other_files+=("./$f"); fi
done
mkdir -p .tmp
bun test --timeout=20000 "${server_files[@]}" > .tmp/bun-test-servers.log 2>&1 &
servers_pid=$!
others_status=0
bun test --timeout=20000 "${other_files[@]}" 2>&1 | tee .tmp/bun-test-others.log || others_status=$?
servers_status=0
wait "$servers_pid" || servers_status=$?
printf '\n==> bun test: the Postgres and Redis suites (%s)\n' "${server_files[*]}"
cat .tmp/bun-test-servers.log
if [ "$others_status" -ne 0 ] || [ "$servers_status" -ne 0 ]; then
  # A CI log keeps only its tail: repeat each failure (with the lines bun printed before it) last.
  for log in .tmp/bun-test-others.log .tmp/bun-test-servers.log; do
    if grep -q '^(fail)' "$log"; then
      printf '\n==> failures in %s\n' "$log"
      awk '{ buf[NR % 40] = $0 } /^\(fail\)/ { for (i = NR - 39; i <= NR; i++) if (i > last && i > 0) print buf[i % 40]; last = NR; print "----" }' "$log" | tail -n 200
    fi
    printf '\n==> the end of %s\n' "$log"
    tail -n 12 "$log"
  done
  echo "bun test failed (other suites: exit $others_status; Postgres and Redis suites: exit $servers_status)" >&2
  exit 1
fi
step "deno check";               deno check mod.ts backend.ts provider.ts ops.ts testing.ts cli.ts backends/memory/mod.ts backends/kv/mod.ts backends/file/mod.ts backends/sqlite/mod.ts backends/events/mod.ts backends/postgres/mod.ts backends/redis/mod.ts providers/telegram/mod.ts providers/whatsapp/mod.ts providers/grammy/mod.ts providers/telegraf/mod.ts providers/builderbot/mod.ts providers/baileys/mod.ts
# Every JSDoc example of the published code type-checks (a snippet that cannot stand alone says `ts ignore`).
step "deno check --doc-only (the JSDoc examples)"
deno check --doc-only mod.ts backend.ts provider.ts ops.ts testing.ts $(find src backends providers -name '*.ts' | sort)
step "deno smoke: examples/echo.ts"; deno run --no-prompt examples/echo.ts
# The runtime seam: the journal contract on the runtime's file system and lock files (file, the events
# journal's file) and SQLite driver; the whole suite (a real bot: async context, timers) on the file
# backend; on Deno (Deno Deploy's runtime with Postgres) also porsager's sockets and the production
# statements of Postgres (the server's clock). The shared events journal uses the same file-system
# calls as the file journals; the Bun suite runs it, and the replica processes run Postgres's
# production statements on Bun.
step "conformance on Deno (file, sqlite via node:sqlite, the events journal's file, postgres via porsager)"
deno run -A tests/runtimes/conformance.ts file:full sqlite events-file postgres
step "conformance on Node $(node --version) (file, sqlite via better-sqlite3, the events journal's file)"
rm -rf .tmp/rt && bun build tests/runtimes/conformance.ts --target=node --outdir .tmp/rt --external better-sqlite3 --external postgres >/dev/null
node .tmp/rt/conformance.js file:full sqlite events-file
step "build (tsup)";             tsup
step "docs snippets (type-checked against the build)"; bun scripts/docs-snippets.ts
step "node smoke";               node scripts/node-smoke.mjs; node dist/cli.js --version
step "sqlite smoke of the npm build: Node, Deno, Bun"
node scripts/sqlite-smoke.mjs
deno run -A scripts/sqlite-smoke.mjs
bun scripts/sqlite-smoke.mjs
step "pack smoke: npm pack, installed in a fresh project, type-checked and run on Node and Bun"
bash scripts/pack-smoke.sh
step "the crash demo (npm run demo)"; bun examples/demo/main.ts --quiet
step "deno publish --dry-run"
# CI runs on a clean clone (build outputs are ignored): the tree must be clean there. A working
# copy with uncommitted changes is allowed outside CI only.
publish_flags=()
if [ -n "$(git status --porcelain)" ]; then
  git status --porcelain
  if [ "${BOTMESH_REQUIRE_SERVICES:-}" = "1" ]; then
    echo "deno publish: the tree has uncommitted changes (listed above)" >&2
    exit 1
  fi
  echo "(uncommitted changes outside CI: --allow-dirty)"
  publish_flags+=(--allow-dirty)
fi
NO_COLOR=1 deno publish --dry-run ${publish_flags[@]+"${publish_flags[@]}"} 2>&1 | tee .tmp/deno-publish.log
# The dry run succeeds with warnings (an unanalyzable dynamic import, a slow type): none is accepted.
if grep -q 'warning\[' .tmp/deno-publish.log; then
  echo "deno publish --dry-run printed warnings (above)" >&2
  exit 1
fi
printf '\nall checks passed\n'
