"""RankLinks' store wait (value, stop, timeout) and RankState's starting point."""

from __future__ import annotations

import threading
import time

import pytest
from helpers_runtime import DictStore

from launcher.runtime.env import RuntimeEnv
from launcher.runtime.rank_state import RankLinks, RankState, RuntimeOptions
from launcher.runtime.replicas import Layout
from launcher.runtime.signals import StopRequested, StopSignal

BASE = {
    "RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "1",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def _links(store_timeout: str = "5") -> tuple[RankLinks, StopSignal, DictStore]:
    env = RuntimeEnv.from_environ({**BASE, "FTRUN_STORE_TIMEOUT": store_timeout})
    stop = StopSignal()
    links = RankLinks(env, stop, lambda msg: None, RuntimeOptions(poll_interval=0.005))
    links.store = DictStore()
    return links, stop, links.store


def test_wait_key_returns_the_value_once_it_is_set() -> None:
    links, _, store = _links()
    threading.Timer(0.05, store.set, ("k", b"v")).start()
    assert links.wait_key(0, "k", "a key") == b"v"
    assert links.try_get("k") == b"v" and links.try_get("other") is None


def test_wait_key_raises_a_stop_newer_than_its_generation() -> None:
    links, stop, _ = _links()
    threading.Timer(0.05, stop.request, (2,)).start()
    with pytest.raises(StopRequested) as info:
        links.wait_key(1, "k", "the plan")
    assert info.value.generation == 2 and "the plan" in str(info.value)


def test_wait_key_ignores_a_stop_of_its_own_generation_and_times_out() -> None:
    links, stop, _ = _links(store_timeout="0.2")
    stop.request(1)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="the plan"):
        links.wait_key(1, "k", "the plan")
    assert 0.15 < time.monotonic() - t0 < 3


def test_note_waiting_without_a_channel_is_a_no_op() -> None:
    links, _, _ = _links()
    links.note_waiting(True)


def test_a_rank_starts_with_nothing_committed_and_no_snapshot() -> None:
    state = RankState(3, needs_state=True, layout=Layout.ddp(2))
    assert (state.generation, state.committed, state.current_step, state.phase) == (
        3,
        -1,
        -1,
        "init",
    )
    assert state.snapshots == {} and not state.registered and not state.dirty
