"""tests/helpers_ports.py: the test processes' port allocator."""

from __future__ import annotations

import importlib
import os
import socket

import helpers_ports
from helpers_ports import (
    PortLane,
    band_below,
    ephemeral_low,
    free_port,
    is_unheld,
    lane_start,
)


def test_the_band_lies_just_below_the_ephemeral_range(tmp_path) -> None:
    f = tmp_path / "range"
    f.write_text("32768\t60999\n")
    assert ephemeral_low(str(f)) == 32768
    assert ephemeral_low(str(tmp_path / "absent")) == 32768
    f.write_text("garbage")
    assert ephemeral_low(str(f)) == 32768
    assert band_below(32768) == range(20768, 32768)
    assert band_below(15000) == range(10000, 15000)  # never below LOWEST_PORT
    assert len(band_below(9000)) == 0  # no room: the kernel picks


def test_lanes_of_neighbouring_pids_start_far_apart() -> None:
    size = 12000
    starts = sorted(lane_start(pid, size) for pid in range(1000, 1064))
    assert all(0 <= s < size for s in starts)
    assert min(b - a for a, b in zip(starts, starts[1:])) > 20
    assert lane_start(5, 0) == 0


def test_a_held_port_is_not_unheld() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        assert not is_unheld(s.getsockname()[1])
    with socket.socket() as s:  # bound, not listening: held too
        s.bind(("0.0.0.0", 0))
        assert not is_unheld(s.getsockname()[1])


def test_a_lane_gives_each_port_once_and_skips_held_ones() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        held = s.getsockname()[1]
        band = range(held - 2, held + 3)
        lane = PortLane(band, os.getpid(), offset=0)
        given = [lane.next() for _ in range(4)]
        assert held not in given and len(set(given)) == 4 and set(given) < set(band)
        fallback = lane.next()  # the band is used up: the kernel picks, outside the band
        assert fallback not in band


def test_free_port_walks_this_process_lane_and_is_bindable() -> None:
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    assert all(p in helpers_ports.LANE.band for p in ports)
    for p in ports[:3]:
        with socket.socket() as s:
            s.bind(("0.0.0.0", p))


def test_a_second_import_name_shares_the_lane() -> None:
    again = importlib.import_module("tests.helpers_ports")
    assert again.LANE is helpers_ports.LANE


def test_a_forked_child_walks_its_own_lane() -> None:
    lane = PortLane(band_below(32768), os.getpid() + 1, offset=0, given=7)  # "forked" state
    port = lane.next()
    assert lane.pid == os.getpid() and lane.offset == lane_start(os.getpid(), len(lane.band))
    assert port in lane.band
