#!/usr/bin/env bash
# Runs every test: fetches the default model into the cache (the acceptance suite runs on it),
# then the whole workspace's tests in release mode (the real-model tests time real work), and
# ends with one line that totals every suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >/dev/null
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --release --workspace --locked "$@" 2>&1 | tee "$log" || status=$?
awk '/^test result:/ { passed += $4; failed += $6 } END { printf "%d passed, %d failed\n", passed, failed }' "$log"
exit "$status"
