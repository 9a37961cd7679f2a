#!/usr/bin/env bash
# Installs what ftrun needs on a fresh Debian/Ubuntu machine with Python >= 3.10:
#   - torch pinned to the 2.13.0 CPU build (a bare `pip install torch` pulls a 5 GB CUDA build),
#   - ftrun itself (editable) with its test extras (pytest; megatron-core 0.16.1 + psutil for the
#     framework-callbacks example scripts/examples/megatron_train.py),
#   - with --test: every program the tests run (see TEST_PROGRAMS below), each from its Debian
#     package, only when missing (a second run installs nothing and takes a few seconds),
#   - the /etc/hosts line `::ffff:127.0.0.1 localhost-v4mapped`: without it torch's store client
#     stalls 5-10 s on reverse DNS when >20 clients connect at once (benchmarks and tests need it).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-python3 -m pip}"

# Programs the tests run, as "path package": the paths are the ones tests/helpers_etcd.py uses
# (it honours the same FTRUN_TEST_* overrides). etcdctl is in etcd-client, not in etcd-server.
TEST_PROGRAMS=(
  "${FTRUN_TEST_ETCD:-/usr/bin/etcd} etcd-server"
  "${FTRUN_TEST_ETCDCTL:-/usr/bin/etcdctl} etcd-client"
  "/usr/bin/chromium chromium"  # headless browser of tests/test_report.py (the ftctl report page)
  "/usr/bin/gcc gcc"  # builds rendezvous/store/_quickstore.c at install (tests/test_quickstore.py)
  "/sbin/ip iproute2"  # network namespaces, veths and the bridge of the multi-node (netns) tests
)

install_test_programs() {
  local entry path pkg missing=()
  for entry in "${TEST_PROGRAMS[@]}"; do
    read -r path pkg <<<"$entry"
    [ -x "$path" ] || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if ! command -v apt-get >/dev/null 2>&1; then
    echo "setup.sh: the tests need Debian package(s) ${missing[*]}, and apt-get is not here;" \
         "install them by hand" >&2
    return 1
  fi
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo"
  echo "setup.sh: installing ${missing[*]} (programs the tests run)"
  if ! { $sudo apt-get update -qq && \
         DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null; }; then
    echo "setup.sh: apt-get could not install ${missing[*]} (see above)" >&2
    return 1
  fi
  for entry in "${TEST_PROGRAMS[@]}"; do
    read -r path pkg <<<"$entry"
    if [ ! -x "$path" ]; then
      echo "setup.sh: $pkg is installed but $path is still missing" >&2
      return 1
    fi
  done
}

if [ "${1:-}" = "--test" ]; then  # first: the install below compiles the C extension with gcc
  install_test_programs
fi
$PIP install -q "torch==2.13.0" numpy
$PIP install -q -e ".[test]"
if ! grep -q "localhost-v4mapped" /etc/hosts 2>/dev/null; then
  if [ -w /etc/hosts ]; then
    echo "::ffff:127.0.0.1 localhost-v4mapped" >> /etc/hosts
  else
    echo "::ffff:127.0.0.1 localhost-v4mapped" | sudo tee -a /etc/hosts >/dev/null || \
      echo "warning: could not add '::ffff:127.0.0.1 localhost-v4mapped' to /etc/hosts" >&2
  fi
fi
