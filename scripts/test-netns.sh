#!/usr/bin/env bash
# dgr across network namespaces (tests/netns): builds a hub namespace with a bridge and six host
# namespaces (scripts/netns.sh), runs the suite inside the hub against target/release/dgr, and
# deletes the namespaces and everything in them on exit, failed or not. Needs root, iproute2 and
# nftables (installed from Debian when missing); without them the suite fails, it never skips.
# Leaves target/test-artifacts/netns-junit.xml and each process's log under
# target/test-artifacts/netns/. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

dgr=target/release/dgr
[ -x "$dgr" ] || { echo "test-netns: $dgr is missing: run cargo build --release -p dgr first" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || { echo "test-netns: network namespaces need root (CI runs as root)" >&2; exit 1; }
command -v ip >/dev/null && command -v ss >/dev/null || scripts/apt-install.sh iproute2
command -v nft >/dev/null || scripts/apt-install.sh nftables
DGR_MODEL=${DGR_MODEL:-$(scripts/fetch-model.sh)}
venv=$(scripts/http-venv.sh)

artifacts=$PWD/target/test-artifacts
rm -rf "$artifacts/netns"
mkdir -p "$artifacts/netns"
# A prefix of this run's own: namespaces are machine-wide, and other runs may be building theirs.
prefix=dgrnet$$
# Deleting the namespaces kills what runs in them: the suite (in the hub) and every dgr it started.
trap 'scripts/netns.sh down "$prefix"' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
scripts/netns.sh up "$prefix"
export DGR_MODEL DGR_BIN=$PWD/$dgr DGR_TEST_ARTIFACTS=$artifacts DGR_NETNS_PREFIX=$prefix PYTHONDONTWRITEBYTECODE=1
# In the background, so that a signal to this script is handled at once, not when pytest ends.
timeout 300 ip netns exec "$prefix-hub" "$venv/bin/python" -m pytest tests/netns -q -s -rfE \
    --junitxml="$artifacts/netns-junit.xml" "$@" &
wait $!
