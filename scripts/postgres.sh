#!/usr/bin/env bash
# A throwaway PostgreSQL server for the ledger's tests: `scripts/postgres.sh start` installs
# Debian's postgresql if its binaries are missing, makes a fresh cluster (trust auth, loopback
# only, a free port), creates the database `dgr` and prints its postgres:// URL; `stop` stops the
# server and removes the cluster. The cluster lives in $DGR_POSTGRES_DIR [default: a directory
# under $TMPDIR named for this checkout], so `stop` finds what `start` made. Postgres refuses to
# run as root, so as root the server runs as the `postgres` OS user.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${DGR_POSTGRES_DIR:-${TMPDIR:-/tmp}/dgr-postgres-$(printf %s "$PWD" | sha256sum | cut -c1-12)}

bindir() {
    ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1
}

as_owner() {
    if [ "$(id -u)" -eq 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

case "${1:-}" in
start)
    if [ -z "$(bindir)" ]; then
        echo "postgres.sh: installing Debian's postgresql" >&2
        apt-get update >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends postgresql >&2
    fi
    bin=$(bindir)
    [ -x "$bin/initdb" ] || { echo "postgres.sh: no initdb under /usr/lib/postgresql" >&2; exit 1; }
    if [ -f "$dir/data/postmaster.pid" ]; then
        as_owner "$bin/pg_ctl" -D "$dir/data" -m immediate stop >&2 || true
    fi
    rm -rf "$dir"
    mkdir -p "$dir/socket"
    [ "$(id -u)" -ne 0 ] || chown -R postgres: "$dir"
    as_owner "$bin/initdb" -D "$dir/data" -U postgres -A trust -E UTF8 --no-instructions >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    # Tests open many databases and connections at once (one database per test).
    as_owner "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -t 60 \
        -o "-c listen_addresses=127.0.0.1 -p $port -k $dir/socket -c max_connections=300" start >&2 \
        || { cat "$dir/server.log" >&2; exit 1; }
    as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U postgres dgr
    echo "$port" >"$dir/port"
    echo "postgres://postgres@127.0.0.1:$port/dgr"
    ;;
stop)
    bin=$(bindir)
    if [ -n "$bin" ] && [ -f "$dir/data/postmaster.pid" ]; then
        as_owner "$bin/pg_ctl" -D "$dir/data" -m fast -w stop >&2 || true
    fi
    rm -rf "$dir"
    ;;
*)
    echo "usage: scripts/postgres.sh start|stop" >&2
    exit 2
    ;;
esac
