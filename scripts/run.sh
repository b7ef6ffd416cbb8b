#!/usr/bin/env bash
# Sets up and runs dgr's main job on the default model: builds dgr in release mode, then `dgr up`
# fetches SmolLM2-135M-Instruct Q4_1 into the model cache if it is missing and serves it through
# a local swarm (a tracker, a route of two worker processes, the OpenAI-compatible gateway on
# http://127.0.0.1:8000/v1 with a dashboard at /) until Ctrl-C. Extra arguments go to `dgr up`.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p dgr
exec target/release/dgr up "$@"
