#!/usr/bin/env bash
# Runs every test: fetches the default model into the cache (the acceptance suite runs on it),
# then the whole workspace's tests in release mode (the real-model tests time real work).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >/dev/null
cargo test --release --workspace --locked "$@"
