"""prctl: the name `ps` shows, and dying with the parent."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_set_process_name_sets_it_and_returns_the_previous_one() -> None:
    code = textwrap.dedent(
        """
        from launcher.workers.prctl import set_process_name
        old = set_process_name(b"ftrun-test-name-too-long")
        print(old.decode(), open("/proc/self/comm").read().strip())
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    old, now = out.stdout.split()
    assert old == "python3" or old.startswith("python")
    assert now == "ftrun-test-name"  # at most 15 bytes


def test_a_child_whose_parent_is_already_gone_exits_at_once() -> None:
    code = textwrap.dedent(
        """
        import os
        from launcher.workers.prctl import die_with_parent
        die_with_parent(os.getppid() + 1_000_000, new_session=False)
        print("still here")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "still here" not in out.stdout
