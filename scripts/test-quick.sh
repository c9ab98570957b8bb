#!/usr/bin/env bash
# The edit–test loop (`npm run test:quick`): the type check, the unit tests, the conformance suites on
# the in-process and file backends, and 200 simulation seeds. No server, no child process, no browser;
# `npm test` is what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/node_modules/.bin:$PATH"

step() { printf '\n==> %s\n' "$*"; }

QUICK_TESTS=(
  machine config options layout exports error_detail deadlines crashable media mock_provider tracing
  test_clock engine_modules prometheus memory_backend kv_backend events_memory events_worker console clock_step
  conversation conversation_stores conformance_memory conformance_kv conformance_file conformance_sqlite
  conformance_events_file sqlite_backend telegram_corpus whatsapp_corpus baileys
  lost_scan_chat_order lost_scan_outage kv_lost_scan_chat_order kv_lost_scan_partial events_kv_lost_scan
  steps_faults steps_lost_report sim_steps damaged_storage throttle_hints chat_order_lost_lease
)
files=()
for name in "${QUICK_TESTS[@]}"; do files+=("./tests/$name.test.ts"); done

step "typecheck (tsc)";            tsc -p tsconfig.json
step "bun test (${#files[@]} files)"; bun test --timeout=20000 "${files[@]}"
step "simulation (200 seeds)";     bun scripts/sim.ts --seeds 200 --quiet
