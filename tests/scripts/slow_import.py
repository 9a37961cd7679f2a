"""Test module whose import is slow in a replacement, so that a cold replacement still imports it
when the warm spare becomes ready (tests/test_spawner.py). In a first start it takes no time.

The spare fork server imports it too (FTRUN_SPARE_IMPORTS), with the environment of a generation
0 replacement: there it waits for the file FTRUN_TEST_SLOW_IMPORT_GATE (the test writes it when
it kills a rank), then FTRUN_TEST_SLOW_IMPORT_S seconds, so the spare is never ready before the
fault. A replacement of a later generation (the cold one) takes FTRUN_TEST_SLOW_IMPORT_COLD_S
seconds. Every process that finished importing it appends its pid to FTRUN_TEST_SLOW_IMPORT_LOG.
"""

import os
import time

_env = os.environ
if _env.get("FTRUN_REPLACEMENT") == "1":
    _gate = _env.get("FTRUN_TEST_SLOW_IMPORT_GATE", "")
    if _env.get("FTRUN_GENERATION") == "0" and _gate:
        _deadline = time.monotonic() + 120
        while not os.path.exists(_gate) and time.monotonic() < _deadline:
            time.sleep(0.05)
        time.sleep(float(_env.get("FTRUN_TEST_SLOW_IMPORT_S", "0")))
    else:
        time.sleep(float(_env.get("FTRUN_TEST_SLOW_IMPORT_COLD_S", "0")))
if _env.get("FTRUN_TEST_SLOW_IMPORT_LOG"):
    with open(_env["FTRUN_TEST_SLOW_IMPORT_LOG"], "a") as _f:
        _f.write(f"{os.getpid()}\n")
