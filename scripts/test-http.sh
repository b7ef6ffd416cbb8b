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

# Installs Debian packages (CI runs as root on a fresh Debian machine).
apt_install() {
    echo "test-http: installing Debian's $*" >&2
    local sudo=
    [ "$(id -u)" -eq 0 ] || sudo=sudo
    $sudo apt-get update -qq >&2
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

# Pinned: the official client, pytest, a JSON-schema validator (structured output), and what
# they resolve to.
requirements='
openai==3.57.0
pytest==9.2.0
jsonschema==4.26.0
attrs==26.1.0
jsonschema-specifications==2025.9.1
referencing==0.37.0
rpds-py==2026.9.1
annotated-types==0.8.0
anyio==4.16.0
h11==0.16.0
httpcore2==2.16.2
httpx2==2.16.2
idna==3.20
iniconfig==2.3.1
jiter==0.19.0
packaging==26.4
pluggy==1.7.0
pydantic==2.14.4
pydantic_core==2.50.5
Pygments==2.21.0
sniffio==1.3.1
truststore==0.10.5
typing-inspection==0.4.5
typing_extensions==4.16.0
'
venv=target/http-venv
stamp=$venv/.requirements
if [ ! -x "$venv/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$(printf %s "$requirements")" ]; then
    echo "test-http: setting up $venv" >&2
    # Debian's python3 makes venvs only with its python3-venv package.
    python3 -m venv --clear "$venv" >/dev/null 2>&1 || { apt_install python3-venv && python3 -m venv --clear "$venv"; }
    printf '%s' "$requirements" > "$venv/requirements.txt"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$venv/requirements.txt" >&2
    printf '%s' "$requirements" > "$stamp"
fi

[ -x /usr/bin/chromium ] || apt_install chromium
# test_https.py makes its CA and certificates with the openssl CLI.
command -v openssl >/dev/null || apt_install openssl

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
