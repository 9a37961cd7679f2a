"""The end of an agent's life is bounded: a process still running past its limit leaves anyway.

Owns: `ExitGuard`, a watchdog armed when the agent starts shutting down (after job-done, a
failure or a signal) and again for the interpreter's own exit. When the limit passes it prints
one line naming the threads still running, then every thread's Python stack (faulthandler), and
ends the process with the agent's exit code (`os._exit`), so a hang anywhere on the way out (a
lock, a store call, a library thread, an atexit handler) costs at most the limit and leaves the
stack that shows where it was. With `last_resort` it also arms faulthandler's own watchdog
thread (C, needs no Python thread to run): a hang in the interpreter's finalization (module
teardown, a `__del__`), where the Python timer no longer runs, ends `last_resort` s later with
every stack and exit code 1.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading


class ExitGuard:
    def __init__(
        self, code: int, limit: float, what: str, last_resort: float | None = None
    ) -> None:
        self.code, self.limit, self.what = code, limit, what
        self._timer = threading.Timer(limit, self._force)
        self._timer.name = f"ftrun-exit-guard-{what}"
        self._timer.daemon = True
        self._timer.start()
        self._last_resort = last_resort is not None
        if last_resort is not None:
            faulthandler.dump_traceback_later(limit + last_resort, exit=True)

    def cancel(self) -> None:
        self._timer.cancel()
        if self._last_resort:
            faulthandler.cancel_dump_traceback_later()

    def _force(self) -> None:
        names = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        try:
            print(
                f"ftrun: {self.what} took longer than {self.limit:g} s (threads still running: "
                f"{', '.join(names) or 'none'}); exiting with code {self.code}; their stacks:",
                file=sys.stderr,
                flush=True,
            )
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        finally:
            os._exit(self.code)
