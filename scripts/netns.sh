#!/usr/bin/env bash
# The namespace hosts of tests/netns: `netns.sh up PREFIX` builds a hub namespace PREFIX-hub
# holding a bridge (10.77.0.100/24, where the suite itself runs) and hosts PREFIX-h1 .. PREFIX-h6,
# each joined to the bridge by a veth pair, its eth0 at 10.77.0.N/24 and its loopback up.
# `netns.sh down PREFIX` kills what runs in them and deletes them (safe to run twice).
# Needs root and iproute2's `ip`.
set -euo pipefail
hosts=6
cmd=${1:?usage: netns.sh up|down PREFIX}
prefix=${2:?usage: netns.sh up|down PREFIX}
hub=$prefix-hub

down() {
    local ns
    for ns in "$hub" $(seq -f "$prefix-h%g" 1 "$hosts"); do
        ip netns list | grep -qx "$ns\( .*\)\?" || continue
        # Only what the suite started runs in its own namespaces: kill it by pid, then the namespace.
        for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns"
    done
}

up() {
    down
    ip netns add "$hub"
    ip -n "$hub" link set lo up
    ip -n "$hub" link add br0 type bridge
    ip -n "$hub" addr add 10.77.0.100/24 dev br0
    ip -n "$hub" link set br0 up
    for i in $(seq 1 "$hosts"); do
        local ns=$prefix-h$i
        ip netns add "$ns"
        ip -n "$ns" link set lo up
        # Both ends are made inside the namespaces, so their names cannot meet another run's.
        ip -n "$hub" link add "vh$i" type veth peer name eth0 netns "$ns"
        ip -n "$hub" link set "vh$i" master br0 up
        ip -n "$ns" addr add "10.77.0.$i/24" dev eth0
        ip -n "$ns" link set eth0 up
    done
}

case $cmd in
up) up ;;
down) down ;;
*) echo "usage: netns.sh up|down PREFIX" >&2; exit 2 ;;
esac
