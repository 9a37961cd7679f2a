"""Test worker: write its pid to $OUT_DIR/pid.<RANK> and sleep (for signal/orphan tests)."""

import os
import time

with open(os.path.join(os.environ["OUT_DIR"], f"pid.{os.environ['RANK']}"), "w") as f:
    f.write(str(os.getpid()))
time.sleep(600)
