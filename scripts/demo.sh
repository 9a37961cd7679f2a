#!/usr/bin/env bash
# Install ftrun (CPU torch) and run the demo: 4 ranks, a worker killed mid-run, recovered, finished.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec python3 scripts/demo.py
