"""tests/helpers_leaks.py: what a test leaves running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from helpers_leaks import Holdings, holdings_now, listening_inodes, live_descendants

TABLE = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1
   1: 0100007F:A1B2 0100007F:1F90 01 00000000:00000000 00:00000000 00000000     0        0 222 1
   2: 00000000:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1
"""


def test_listening_sockets_are_read_from_the_kernel_table() -> None:
    assert listening_inodes(TABLE) == {111: 8080, 333: 80}
    assert listening_inodes("header only\n") == {}


def test_holdings_subtract_and_intersect() -> None:
    a = Holdings(frozenset({1, 2}), frozenset({(10, 5, "x")}))
    b = Holdings(frozenset({2}), frozenset())
    assert a - b == Holdings(frozenset({1}), frozenset({(10, 5, "x")}))
    assert a & b == Holdings(frozenset({2}), frozenset())
    assert not (b - a) and a


def test_a_listening_socket_and_a_child_left_running_are_seen() -> None:
    before = holdings_now()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with socket.socket() as listener, socket.socket() as bound:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            bound.bind(("127.0.0.1", 0))  # not listening: not reported
            left = (holdings_now() - before).listening_only()
            assert {pid for pid, _, _ in left.children} == {child.pid}
            assert f"listening on port {listener.getsockname()[1]}" in left.describe()
            assert str(bound.getsockname()[1]) not in left.describe()
            assert "time.sleep(30)" in left.describe()
    finally:
        child.kill()
        child.wait()
    assert not (holdings_now() - before).listening_only()


SPAWNS_A_GRANDCHILD = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
time.sleep(30)
"""


def _pids_under(pid: int) -> set[int]:
    return {p for p, _, _ in live_descendants(pid)}


def test_descendants_of_children_count_and_zombies_do_not() -> None:
    parent = subprocess.Popen([sys.executable, "-c", SPAWNS_A_GRANDCHILD])
    try:
        deadline = time.monotonic() + 20
        while not _pids_under(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        (grandchild,) = _pids_under(parent.pid)
        assert {parent.pid, grandchild} <= _pids_under(os.getpid())
    finally:
        left = _pids_under(parent.pid)
        parent.kill()
        parent.wait()
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    zombie = subprocess.Popen(["true"])  # exits at once; not waited for yet: a zombie
    deadline = time.monotonic() + 20
    while zombie.pid in _pids_under(os.getpid()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert zombie.pid not in _pids_under(os.getpid())
    zombie.wait()
