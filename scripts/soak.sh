#!/usr/bin/env bash
# The soak (tests/soak): requests at concurrency through a swarm of a tracker, two replicas of each
# half of the default model and a gateway, while a worker is SIGKILLed and restarted, another is
# SIGSTOPped and continued, the tracker is SIGKILLed and restarted on its database and port, and
# ~15% of the clients close their stream early. Fails unless every request ends in time, identical
# to its fault-free output (or a prefix of it when cancelled, or with a typed error), every worker's
# sessions and KV return to zero, and the ledger equals the per-request usage.
#
#   scripts/soak.sh [--requests N] [--concurrency C] [--seed S] [PYTEST ARGS...]
#
# Default: the full soak, 300 requests at concurrency 16 (scripts/test-http.sh runs a scaled-down
# one in CI). Runs the built target/release/dgr with the venv scripts/test-http.sh sets up. Leaves
# target/test-artifacts/soak/: result.json (the figures, every request's outcome) and each process's
# log.
set -euo pipefail
cd "$(dirname "$0")/.."

requests=300 concurrency=16 seed=
while [ $# -gt 0 ]; do
    case "$1" in
        --requests) requests=$2; shift 2 ;;
        --concurrency) concurrency=$2; shift 2 ;;
        --seed) seed=$2; shift 2 ;;
        -h | --help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) break ;;
    esac
done

dgr=target/release/dgr
[ -x "$dgr" ] || { echo "soak: $dgr is missing: run cargo build --release -p dgr first" >&2; exit 1; }
venv=$(scripts/http-venv.sh)
DGR_MODEL=${DGR_MODEL:-$(scripts/fetch-model.sh)}
mkdir -p target/test-artifacts
export DGR_MODEL DGR_BIN=$PWD/$dgr DGR_TEST_ARTIFACTS=$PWD/target/test-artifacts PYTHONDONTWRITEBYTECODE=1
export DGR_SOAK_REQUESTS=$requests DGR_SOAK_CONCURRENCY=$concurrency DGR_SOAK_SEED=$seed
exec timeout 3600 "$venv/bin/python" -m pytest tests/soak -q -s -rfE "$@"
