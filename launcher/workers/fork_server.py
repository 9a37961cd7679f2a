"""The agent's handle on its node's spare fork server (the process is `spare_server`).

Owns: `ForkServer`, owned by the agent's spare pool (`launcher.workers.spare.SparePool`): start
the server (`python -u -m launcher.workers.spare_server FD --nice WARM,BASE`, its priorities in
its command line; `--imports FILE`: the job's modules to import too; born at the warm-up
priority unless `urgent`, when the job's ranks wait for its start-up), `poll_ready()` without
blocking, `wait_ready()` with a bound, `extend(FILE)` (import more of the job's modules: the
server is busy until its answer, which `poll_ready()` reads), `fork()` a warm spare with a
timeout (the spare becomes the agent's own child: the agent is a child subreaper,
`launcher.workers.adopted`), or the same in two halves that never block the agent's loop on the
server's 20-50 ms fork (`request_fork()`, then `collect_fork()` at a later health check: one
request outstanding at a time), `stop()`. Nothing here imports torch or runs in the server.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import time
from typing import Callable

from launcher.workers.adopted import AdoptedChild, set_subreaper
from launcher.workers.priority import born_warm, warm_priority
from launcher.workers.spare_process import IMPORTS_FLAG, nice_args

SERVER_MODULE = "launcher.workers.spare_server"
FORK_TIMEOUT_S = 2.0  # the server answers a fork request within this long, or is given up
ANSWER_BYTES = 1 << 16  # the server's answers are at most this long


class ForkServer:
    """The agent's handle on its node's fork server. Not thread-safe: one owner (SparePool)."""

    def __init__(
        self,
        python: str,
        env: dict[str, str],
        nice: tuple[int, int],
        imports: str | None = None,
        urgent: bool = False,
    ) -> None:
        if not set_subreaper(True):
            raise OSError("PR_SET_CHILD_SUBREAPER refused")
        parent = os.getpid()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.proc = subprocess.Popen(
                [
                    python,
                    "-u",
                    "-m",
                    SERVER_MODULE,
                    str(theirs.fileno()),
                    *nice_args(*nice),
                    *([IMPORTS_FLAG, imports] if imports else []),
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=None,
                stderr=None,
                pass_fds=[theirs.fileno()],
                close_fds=True,
                preexec_fn=born_warm(parent, nice, idle=not urgent),  # urgent: ranks wait
            )
        except BaseException:
            ours.close()
            set_subreaper(False)
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.nice = nice  # (its warm-up niceness, the agent's)
        self.started = time.monotonic()
        self.ready = False
        self.busy = False  # importing more modules (`extend`): no fork until it answers
        self.threads = 0
        # the modules of its last imports that failed (a few named, and how many)
        self.failed: list[list[str]] = []
        self.failed_count = 0
        self.answers = 0  # answers read (the ready one, then one per `extend`)
        self.new_modules = 0  # modules the last `extend` added (0: its spares lack nothing)
        self.pending: float | None = None  # monotonic time of the fork request not yet answered
        self.pending_heap = 0  # the heap that request's spare prepares (bytes)

    def extend(self, imports: str) -> None:
        """Import the modules an `--imports` file lists (the server answers when done; until
        `poll_ready()` reads that answer it forks nothing); raises OSError when it cannot."""
        assert self.ready and not self.busy and self.pending is None
        if self.nice[0] != self.nice[1]:  # it imports at the warm-up priority, back when done
            warm_priority(self.nice[0], self.proc.pid)
        self.sock.settimeout(FORK_TIMEOUT_S)
        try:
            self.sock.send(json.dumps({"imports": imports}).encode())
        except (OSError, socket.timeout) as exc:
            raise OSError(f"the fork server took no import request ({exc or 'timeout'})") from exc
        finally:
            self.sock.settimeout(None)
        self.busy = True

    def poll_ready(self) -> bool:
        """Whether the server can fork now: its imports (the first ones, or an `extend`'s) are
        done (never blocks); raises OSError when it died or reported more than one thread."""
        if self.ready and not self.busy:
            return True
        self.sock.setblocking(False)
        try:
            msg = self.sock.recv(ANSWER_BYTES)
        except BlockingIOError:
            if self.proc.poll() is not None:
                raise OSError(f"the fork server exited with {self.proc.returncode}") from None
            return False
        finally:
            self.sock.setblocking(True)
        if not msg:
            raise OSError(f"the fork server closed its socket (exit {self.proc.poll()})")
        info = json.loads(msg)
        self.answers += 1
        self.threads = int(info.get("threads", 0))
        self.failed = [list(f) for f in info.get("failed", [])]
        self.failed_count = int(info.get("failed_count", len(self.failed)))
        self.new_modules = int(info.get("new", 0))
        if self.threads != 1:
            raise OSError(
                f"the fork server has {self.threads} threads after its imports; "
                "forking it is not safe"
            )
        self.ready, self.busy = True, False
        return True

    def wait_ready(self, timeout: float) -> bool:
        """Block until the server can fork (`poll_ready`) or `timeout` s passed: whether it
        can; raises OSError as `poll_ready` does (a server that died is seen within 0.1 s)."""
        deadline = time.monotonic() + timeout
        while not self.poll_ready():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            select.select([self.sock], [], [], min(left, 0.1))
        return True

    def fork(
        self, timeout: float = FORK_TIMEOUT_S, heap_bytes: int = 0, prepare: bool = True
    ) -> tuple[AdoptedChild, int]:
        """A new warm spare, the agent's own child, that faults in `heap_bytes` of heap while
        it waits (`launcher.runtime.heap`; with `prepare` false, for a replacement waiting now,
        it neither owns its pages nor faults its heap in), and the read end of the pipe it
        writes one byte to once prepared; raises OSError when the server cannot. Waits for the
        answer (`request_fork` + `collect_fork` do not)."""
        self.request_fork(heap_bytes, prepare, timeout)
        got = self.collect_fork(timeout)
        if got is None:
            self.pending = None  # given up: its answer, if it comes, is never read as another's
            raise OSError("no answer from the fork server (timeout)")
        return got

    def request_fork(
        self, heap_bytes: int = 0, prepare: bool = True, timeout: float = FORK_TIMEOUT_S
    ) -> None:
        """Ask for a spare (as `fork`) without waiting for it: `collect_fork` takes the answer;
        raises OSError when the server takes no request."""
        assert self.ready and not self.busy and self.pending is None
        self.sock.settimeout(timeout)
        try:
            req = {"fork": True, "heap_bytes": int(heap_bytes), "prepare": prepare}
            self.sock.send(json.dumps(req).encode())
        except (OSError, socket.timeout) as exc:
            raise OSError(f"the fork server took no fork request ({exc or 'timeout'})") from exc
        finally:
            self.sock.settimeout(None)
        self.pending = time.monotonic()
        self.pending_heap = int(heap_bytes) if prepare else 0  # what that spare prepares

    def collect_fork(self, timeout: float = 0.0) -> tuple[AdoptedChild, int] | None:
        """The spare of the outstanding `request_fork` (as `fork` returns it) once the server
        answered, waiting at most `timeout` s (0: never blocks); None while it has not (or no
        request is outstanding); raises OSError when the server failed the fork, or did not
        answer within FORK_TIMEOUT_S of the request."""
        if self.pending is None:
            return None
        if not select.select([self.sock], [], [], max(0.0, timeout))[0]:
            if time.monotonic() - self.pending > FORK_TIMEOUT_S:
                self.pending = None
                raise OSError(f"no answer from the fork server within {FORK_TIMEOUT_S:g} s")
            return None
        self.pending = None
        self.sock.setblocking(False)
        try:
            msg, fds, _, _ = socket.recv_fds(self.sock, 4096, 2)
        except OSError as exc:
            raise OSError(f"no answer from the fork server ({exc})") from exc
        finally:
            self.sock.setblocking(True)
        return _spare_from_answer(msg, fds, self.proc.poll())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, log: Callable[[str], None] | None = None, timeout: float = 5.0) -> None:
        """End the server at once: it holds nothing (every spare it forked is the agent's own
        child already, and no fork is under way outside `fork()`); waits `timeout` s for it."""
        try:
            self.sock.close()
        except OSError:
            pass
        self.proc.kill()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # D-state, or starved of CPU
            if log:
                log(
                    f"spare fork server pid {self.proc.pid} did not exit within {timeout:.1f} s "
                    "of SIGKILL; left behind"
                )


def _spare_from_answer(
    msg: bytes, fds: list[int], exit_code: int | None
) -> tuple[AdoptedChild, int]:
    """The forked spare a fork answer names (its pid; its assignment pipe and ready pipe are
    `fds`); raises OSError (the fds closed) when the answer is an error or malformed."""
    if not msg:
        for fd in fds:
            os.close(fd)
        raise OSError(f"the fork server closed its socket (exit {exit_code})")
    info = json.loads(msg)
    if "pid" not in info or len(fds) != 2:
        for fd in fds:
            os.close(fd)
        raise OSError(info.get("error", f"bad answer {msg!r}"))
    try:
        child = AdoptedChild(int(info["pid"]), os.fdopen(fds[0], "wb"))
    except OSError:
        for fd in fds:
            os.close(fd)
        raise
    return child, fds[1]
