"""Test worker for signal tests: writes $OUT_DIR/pid.<RANK>, then sleeps --sleep seconds and
exits with --code (only in the first attempt when --first-only), or sleeps again in later
attempts. With --ignore-term it ignores SIGTERM (a worker slow to stop)."""

import argparse
import os
import signal
import time

p = argparse.ArgumentParser()
p.add_argument("--sleep", type=float, default=600.0)
p.add_argument("--code", type=int, default=0)
p.add_argument("--ignore-term", action="store_true")
p.add_argument("--first-only", action="store_true")
a = p.parse_args()
if a.ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
with open(os.path.join(os.environ["OUT_DIR"], f"pid.{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(a.sleep)
if a.first_only and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
    time.sleep(600)
raise SystemExit(a.code)
