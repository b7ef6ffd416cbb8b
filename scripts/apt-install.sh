#!/usr/bin/env bash
# Installs Debian packages, as root or through sudo (CI runs as root on a fresh Debian machine);
# the acceptance suites' scripts call it for what they need.
set -euo pipefail
echo "apt-install: installing Debian's $*" >&2
sudo=
[ "$(id -u)" -eq 0 ] || sudo=sudo
$sudo apt-get update -qq >&2
$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
