#!/usr/bin/env bash
# Debian/Ubuntu packages edgeq's demo and tests need. Installs only what is missing.
set -euo pipefail

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
# redis-cli builds the test Redis Cluster; redis-benchmark drives `edgeq capacity --redis-ceiling`.
{ command -v redis-cli && command -v redis-benchmark; } >/dev/null || missing+=(redis-tools)
# systemd-analyze, for tests/test_units.py (offline: systemd is not started).
command -v systemd-analyze >/dev/null || missing+=(systemd)
# systemd-nspawn, for tests/box (a container that boots systemd: the units under a real PID 1).
command -v systemd-nspawn >/dev/null || missing+=(systemd-container)
python3 -c 'import ensurepip, venv' 2>/dev/null || missing+=(python3-venv)
[ ${#missing[@]} -eq 0 ] && exit 0

sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo
echo "edgeq: installing ${missing[*]} with apt-get"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
