#!/usr/bin/env bash
# The gateway's acceptance suite (tests/http): the official `openai` Python client and headless
# Chromium against a live `dgr up` swarm of the built target/release/dgr on the default model.
# Sets up what it needs: a venv at target/http-venv with pinned packages, Debian's chromium when
# /usr/bin/chromium is missing and its openssl when that is (as root, e.g. on a fresh CI machine). Nothing is skipped: a missing
# binary, model, browser or package is a failure. Extra arguments go to this suite's pytest.
# Then runs a scaled-down soak (tests/soak, scripts/soak.sh) of DGR_SOAK_REQUESTS (64) requests at
# DGR_SOAK_CONCURRENCY (8). Leaves target/test-artifacts/: the dashboard screenshots (over HTTP and HTTPS), pytest's junit
# XML of each suite, dgr up's log, the soak's figures and logs (soak/).
set -euo pipefail
cd "$(dirname "$0")/.."

dgr=target/release/dgr
[ -x "$dgr" ] || { echo "test-http: $dgr is missing: run cargo build --release -p dgr first" >&2; exit 1; }
DGR_MODEL=${DGR_MODEL:-$(scripts/fetch-model.sh)}
export DGR_MODEL DGR_BIN=$PWD/$dgr

venv=$(scripts/http-venv.sh)

[ -x /usr/bin/chromium ] || scripts/apt-install.sh chromium
# test_https.py makes its CA and certificates with the openssl CLI.
command -v openssl >/dev/null || scripts/apt-install.sh openssl

artifacts=target/test-artifacts
mkdir -p "$artifacts"
export DGR_TEST_ARTIFACTS=$PWD/$artifacts CHROMIUM=/usr/bin/chromium PYTHONDONTWRITEBYTECODE=1
status=0
timeout 1200 "$venv/bin/python" -m pytest tests/http -q -rfE --junitxml="$artifacts/http-junit.xml" "$@" || status=$?

# Then a scaled-down soak (tests/soak; scripts/soak.sh runs the full one): its own swarm, hurt while
# it serves (a worker killed and restarted, one stopped and continued, the tracker restarted, client
# cancels). Its junit XML counts in scripts/test.sh's total; its figures go to $artifacts/soak/.
DGR_SOAK_REQUESTS=${DGR_SOAK_REQUESTS:-64} DGR_SOAK_CONCURRENCY=${DGR_SOAK_CONCURRENCY:-8} \
    timeout 300 "$venv/bin/python" -m pytest tests/soak -q -s -rfE --junitxml="$artifacts/soak-junit.xml" || {
    soak_status=$?
    [ "$status" -ne 0 ] || status=$soak_status
}
exit "$status"
