#!/usr/bin/env bash
# Sets up and runs dgr's main job on the default model: fetches SmolLM2-135M-Instruct Q4_1 into the
# model cache, builds dgr in release mode, then generates through a local route of two worker
# processes (layers 0..15 and 15..30). Extra arguments go to `dgr generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/fetch-model.sh >/dev/null
cargo build --release --locked -p dgr
prompt="The three most useful things to know about distributed inference are"
if [ $# -eq 0 ]; then set -- --prompt "$prompt" --max-tokens 64; fi
exec target/release/dgr generate --split 2 "$@"
