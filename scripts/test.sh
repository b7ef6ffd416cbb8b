#!/usr/bin/env bash
# Runs every test: lints, fetches the default model and gemma-3-270m into the cache (the
# acceptance suites run on them), then the whole workspace's tests in release mode (the real-model
# tests time real work), then the gateway's acceptance suite (scripts/test-http.sh: the official
# OpenAI client and headless Chromium against a live `dgr up`) and the namespace suite
# (scripts/test-netns.sh: tracker, workers and gateway on hosts in network namespaces; needs
# root), and ends with one line that totals every suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Plain `cargo test` runs what needs no download; these features add the suites on the real
# default model and the ledger's tests on PostgreSQL (against the server started below), which
# change no code of the binary, and workers that can be told to lie (for the spot-check test).
test_only=dgr/real-model,dgr-gguf/real-model,dgr-tokenizer/real-model,dgr/postgres-tests
features=$test_only,dgr/fault-injection
# Lints before any test, failing the run at once: formatting, then clippy with warnings as errors.
cargo fmt --all --check
cargo clippy --workspace --all-targets --release --locked --features "$features" -- -D warnings
scripts/fetch-model.sh >/dev/null
scripts/fetch-model.sh gemma3 >/dev/null
# The GPU backend's suites run on Mesa's lavapipe, a software Vulkan device, where no GPU is.
[ -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ] || scripts/apt-install.sh mesa-vulkan-drivers libvulkan1
log=$(mktemp)
# A PostgreSQL server of this run's own for the ledger's tests (each makes a database on it).
trap 'rm -f "$log"; scripts/postgres.sh stop' EXIT
DGR_TEST_POSTGRES=$(scripts/postgres.sh start)
export DGR_TEST_POSTGRES
status=0
cargo test --release --workspace --locked --no-fail-fast --features "$features" "$@" 2>&1 | tee "$log" || status=$?
read -r passed failed < <(awk '/^test result:/ { p += $4; f += $6 } END { print p + 0, f + 0 }' "$log")
if [ "$status" -ne 0 ] && [ "$failed" -eq 0 ]; then
    failed=1  # cargo failed with no failing test to show for it (a build or doctest compile error)
fi

# The gateway suite and the soak (both in scripts/test-http.sh) and the namespace suite
# (scripts/test-netns.sh: hosts in network namespaces, which needs root) run the built binary;
# their counts come from pytest's junit XML (a test that errored or was skipped counts as failed;
# a suite that could not run at all counts as one).
junits=(target/test-artifacts/http-junit.xml target/test-artifacts/soak-junit.xml target/test-artifacts/netns-junit.xml)
rm -f "${junits[@]}"
http_status=0
# The binary they run has no fault injection; the features that only add tests change none of its
# code, and with them most of the test build is reused.
{ cargo build --release --locked -p dgr --features "$test_only" && scripts/test-http.sh; } || http_status=$?
scripts/test-netns.sh || { netns_status=$?; [ "$http_status" -ne 0 ] || http_status=$netns_status; }
read -r http_passed http_failed < <(python3 - "${junits[@]}" <<'PY'
import sys, xml.etree.ElementTree as ET
total = bad = 0
for path in sys.argv[1:]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):  # missing, or cut short
        total, bad = total + 1, bad + 1
        continue
    suites = [root] if root.tag == "testsuite" else root.iter("testsuite")
    for s in suites:
        total += int(s.get("tests", 0))
        bad += int(s.get("failures", 0)) + int(s.get("errors", 0)) + int(s.get("skipped", 0))
print(total - bad, bad)
PY
)
if [ "$http_status" -ne 0 ] && [ "$http_failed" -eq 0 ]; then
    http_failed=1  # pytest passed every test it ran, yet the suite failed (setup, teardown, timeout)
fi
[ "$http_status" -eq 0 ] || [ "$status" -ne 0 ] || status=$http_status

# Coverage-guided fuzzing of every hostile-input parser, 10 s a target: one check, passed when no
# input crashes, hangs or blows up a target (scripts/fuzz.sh prints any crasher's path).
fuzz_passed=1 fuzz_failed=0
if ! scripts/fuzz.sh 10; then
    fuzz_passed=0 fuzz_failed=1
    [ "$status" -ne 0 ] || status=1
fi
echo "$((passed + http_passed + fuzz_passed)) passed, $((failed + http_failed + fuzz_failed)) failed"
exit "$status"
