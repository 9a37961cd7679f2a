#!/usr/bin/env bash
# Set up (see scripts/setup.sh) and run the test suite: the CI subset (slow chaos tests are
# marked `slow` and skipped; run them with: python3 -m pytest -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
exec python3 -m pytest -q -p no:cacheprovider "$@"
