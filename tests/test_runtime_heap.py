"""launcher.runtime.heap: a spare's heap faulted in ahead of the replacement's allocations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# in a fresh interpreter (the heap settings are the process's): allocate and fill 20 tensors of
# 8 MB (the replacement's model and optimizer state), count the page faults that took
PROBE = r"""
import json, os, resource, sys
sys.path.insert(0, {root!r})
import torch
from launcher.runtime import heap
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
prepared = heap.prepare(int(sys.argv[1]))
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
ts = [torch.empty(2 << 20) for _ in range(20)]
for t in ts:
    t.fill_(1.0)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
del ts, t
before = rss()
heap.settle()
libc = heap.libc()
libc.free(libc.malloc(1 << 20))  # a free that consolidates lets glibc trim the heap's top
print(json.dumps({{"prepared": prepared, "faults": faults, "rss_before_settle": before,
                  "rss_after": rss()}}))
"""


def _probe(nbytes: int, **env: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(root=ROOT), str(nbytes)],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, THP_MEM_ALLOC_ENABLE="1", **env),
        timeout=120,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap")
def test_prepared_heap_takes_the_allocations_without_page_faults():
    cold = _probe(0)
    warm = _probe(200 << 20, FTRUN_SPARE_HEAP="1")
    assert cold["prepared"] == 0 and warm["prepared"] >= 200 << 20
    # 160 MB in fresh memory: one fault per page (or per huge page) on first touch
    assert cold["faults"] > 70, cold  # 10380 here (4 KB pages around the huge ones)
    assert cold["faults"] > 20 * warm["faults"], (cold, warm)
    # settled (FTRUN_SPARE_HEAP set, as a spare sets it for its replacement): the heap's unused
    # top goes back to the kernel like any process's
    assert warm["rss_after"] < warm["rss_before_settle"] - (100 << 20), warm


def test_nothing_to_prepare_is_a_no_op():
    from launcher.runtime import heap

    assert heap.prepare(0) == 0
    heap.settle()  # without FTRUN_SPARE_HEAP: nothing changes


def test_a_spare_takes_at_most_a_quarter_of_the_available_memory():
    code = (
        "import sys; sys.path.insert(0, %r)\n"
        "from launcher.runtime import heap\n"
        "heap.available_bytes = lambda: 400 << 20\n"
        "print(heap.prepare(1 << 40))\n"
    ) % ROOT
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    from launcher.runtime import heap

    assert 0 < int(out.stdout) <= (100 << 20) + heap.MMAP_THRESHOLD  # in whole blocks of < 32 MB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc heap")
def test_in_use_bytes_sees_a_ranks_model_and_state_whether_heap_or_mmapped():
    """Issue 32: what a rank allocated by its first commit (more than its registered state: DDP's
    gradient buckets, a framework's buffers) is the heap a spare prepares for its replacement."""
    import torch

    from launcher.runtime import heap

    before = heap.in_use_bytes()
    small = [torch.ones(1 << 20) for _ in range(8)]  # 8 x 4 MB: below the mmap threshold
    big = torch.ones(16 << 20)  # 64 MB: mmapped
    grown = heap.in_use_bytes() - before
    assert 96 << 20 <= grown < 120 << 20, grown
    del small, big
    assert heap.in_use_bytes() - before < 8 << 20  # given back
