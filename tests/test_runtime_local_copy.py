"""Same-host reads of a peer's tensors (launcher.runtime.local_copy): the spans of an offer are
laid over differently cut destinations, split across threads without losing or doubling a byte,
read for real from another process, and every failure comes back as a reason (never a partial
success): a dead sender, another host, a size mismatch, the switch turned off."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from launcher.runtime import local_copy
from launcher.runtime.local_copy import Offer, _pairs, _split


def _offer(views: list[torch.Tensor]) -> Offer:
    offer = Offer.of(views)
    assert offer is not None
    return offer


def test_pairs_lay_the_spans_over_differently_cut_destinations():
    src = [torch.arange(10, dtype=torch.uint8), torch.arange(10, 16, dtype=torch.uint8)]
    dst = [
        torch.empty(3, dtype=torch.uint8),
        torch.empty(9, dtype=torch.uint8),
        torch.empty(4, dtype=torch.uint8),
    ]
    pairs = _pairs(_offer(src), dst)
    assert sum(n for _, _, n in pairs) == 16
    assert [n for _, _, n in pairs] == [3, 7, 2, 4]  # cut at every boundary of either side
    with pytest.raises(ValueError, match="offer covers 16 bytes, receiver expects 15"):
        _pairs(_offer(src), dst[:2] + [torch.empty(3, dtype=torch.uint8)])


@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_split_covers_every_byte_once(parts):
    pieces = [(1000, 5000, 10), (2000, 6000, 1), (3000, 7000, 25)]
    runs = _split(pieces, parts)
    assert 1 <= len(runs) <= parts
    covered = sorted((loc + i, rem + i) for run in runs for rem, loc, n in run for i in range(n))
    expected = sorted((loc + i, rem + i) for rem, loc, n in pieces for i in range(n))
    assert covered == expected
    sizes = [sum(n for _, _, n in run) for run in runs]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("threads", [1, 3])
def test_read_copies_this_process_memory_into_the_destinations(threads):
    src = [torch.randn(1000), torch.arange(77, dtype=torch.int64)]
    dst = [torch.empty(1000), torch.empty(77, dtype=torch.int64)]
    views = [t.view(torch.uint8) for t in src]
    assert (
        local_copy.read(_offer(views), [t.view(torch.uint8) for t in dst], threads=threads) is None
    )
    assert torch.equal(src[0], dst[0]) and torch.equal(src[1], dst[1])


READER_PEER = r"""
import sys, torch
from launcher.runtime.local_copy import Offer
t = torch.arange(3 << 20, dtype=torch.float32)  # 12 MB: read on several threads
o = Offer.of([t.view(torch.uint8)])
print(o.pid, o.spans[0][0], o.spans[0][1], o.host, flush=True)
sys.stdin.readline()
"""


def test_read_copies_another_process_tensor_and_reports_a_dead_one():
    proc = subprocess.Popen(
        [sys.executable, "-c", READER_PEER],
        stdout=subprocess.PIPE,
        stdin=subprocess.PIPE,
        text=True,
    )
    try:
        pid, addr, n, host = proc.stdout.readline().split()
        offer = Offer(host, int(pid), ((int(addr), int(n)),))
        dst = torch.empty(3 << 20, dtype=torch.float32)
        assert local_copy.threads_for(int(n)) >= 1
        assert local_copy.read(offer, [dst.view(torch.uint8)]) is None
        assert torch.equal(dst, torch.arange(3 << 20, dtype=torch.float32))
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
    why = local_copy.read(offer, [dst.view(torch.uint8)])
    assert why is not None and "No such process" in why


def test_read_refuses_another_host_and_the_switch(monkeypatch):
    src = torch.ones(8)
    offer = _offer([src.view(torch.uint8)])
    other = Offer("another-boot:1", offer.pid, offer.spans)
    assert "another host" in local_copy.read(other, [torch.empty(8).view(torch.uint8)])
    monkeypatch.setenv("FTRUN_TRANSFER_LOCAL", "0")
    assert not local_copy.enabled()
    assert local_copy.read(offer, [torch.empty(8).view(torch.uint8)]) == "same-host reads are off"


def test_offer_survives_its_dict_form():
    offer = _offer([torch.ones(4).view(torch.uint8)])
    assert Offer.from_dict(offer.as_dict()) == offer
    assert Offer.from_dict(None) is None


def test_readers_allowed_is_harmless_without_yama_and_reads_still_work():
    """Without Yama (this kernel) PR_SET_PTRACER fails and nothing changes; with it, the window
    is closed again on exit. Either way a read inside the window works."""
    src = torch.arange(16, dtype=torch.float32)
    with local_copy.ReadersAllowed() as allowed:
        assert isinstance(allowed.set, bool)
        dst = torch.empty(16)
        assert local_copy.read(_offer([src.view(torch.uint8)]), [dst.view(torch.uint8)]) is None
    assert torch.equal(src, dst)
