#!/usr/bin/env bash
# Installs what ftrun needs on a fresh Debian/Ubuntu machine with Python >= 3.10:
#   - torch pinned to the 2.13.0 CPU build (a bare `pip install torch` pulls a 5 GB CUDA build),
#   - ftrun itself (editable) with its test extras,
#   - with --test: the etcd server (Debian package etcd-server) used by the etcd tests,
#   - the /etc/hosts line `::ffff:127.0.0.1 localhost-v4mapped`: without it torch's store client
#     stalls 5-10 s on reverse DNS when >20 clients connect at once (benchmarks and tests need it).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"
$PIP install -q "torch==2.13.0" numpy
$PIP install -q -e ".[test]"
if [ "${1:-}" = "--test" ] && ! command -v etcd >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server >/dev/null
fi
if ! grep -q "localhost-v4mapped" /etc/hosts 2>/dev/null; then
  if [ -w /etc/hosts ]; then
    echo "::ffff:127.0.0.1 localhost-v4mapped" >> /etc/hosts
  else
    echo "::ffff:127.0.0.1 localhost-v4mapped" | sudo tee -a /etc/hosts >/dev/null || \
      echo "warning: could not add '::ffff:127.0.0.1 localhost-v4mapped' to /etc/hosts" >&2
  fi
fi
