"""PauseGate (launcher.runtime.pause) on a shared torch HashStore, two ranks in threads: the
agreed step is the largest first step any rank can halt after, the same on both; the wait ends on
the resume key, on the request's maximum (expired, for every rank), on a stop; a rank that never
answers, or a recovery round that came first, abandons the pause for every rank. The live job is
tests/test_pause.py's."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from launcher.protocol import plan as P
from launcher.runtime import pause as pause_mod
from launcher.runtime.env import RuntimeEnv
from launcher.runtime.pause import PauseGate
from launcher.runtime.rank_state import RankLinks, RankState, RuntimeOptions
from launcher.runtime.replicas import Layout
from launcher.runtime.signals import StopSignal

WORLD = 2


class Rank:
    def __init__(self, rank: int, store: dist.Store) -> None:
        env = RuntimeEnv.from_environ(
            {
                "RANK": str(rank),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_RANK": str(rank),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": "29500",
            }
        )
        self.lines: list[str] = []
        self.phases: list[str] = []
        self.stop = StopSignal()
        self.state = RankState(0, False, Layout.ddp(WORLD))
        self.links = RankLinks(env, self.stop, self.lines.append, RuntimeOptions())
        self.links.store = store
        self.gate = PauseGate(
            self.state, self.links, lambda: list(range(WORLD)), self.phases.append
        )

    def run(self, first: int, last: int, step_s: float = 0.0) -> list[tuple[int, float]]:
        """Steps first..last, as rt.steps() runs them: (step, when it ended) each."""
        ended = []
        for s in range(first, last + 1):
            self.state.current_step = s
            time.sleep(step_s)
            ended.append((s, time.monotonic()))
            if self.gate.request is not None:
                self.gate.at_step_end(s)
        return ended


def request(store: dist.Store, seq: int = 1, max_s: float = 60.0) -> None:
    store.set(P.PAUSE_KEY, P.PauseRequest(seq=seq, max_s=max_s).to_json())


def test_the_ranks_halt_after_the_largest_first_step_and_resume_together() -> None:
    store = dist.HashStore()
    a, b = Rank(0, store), Rank(1, store)
    request(store)
    a.state.current_step, b.state.current_step = 3, 5  # b is further: it can halt after 6
    a.gate.notice()
    b.gate.notice()
    assert store.get(P.pause_at_key(1, 0)) == b"4" and store.get(P.pause_at_key(1, 1)) == b"6"
    out: dict[int, list] = {}
    ta = threading.Thread(target=lambda: out.setdefault(0, a.run(4, 9)))
    tb = threading.Thread(target=lambda: out.setdefault(1, b.run(6, 9)))
    ta.start(), tb.start()
    time.sleep(0.5)
    assert store.get(P.pause_step_key(1)) == b"6"
    assert "paused" in a.phases and "paused" in b.phases and ta.is_alive() and tb.is_alive()
    # each rank marks its halt (a world grow waits for every mark: launcher.control.grow)
    assert store.get(P.pause_halted_key(1, 0)) == b"6" == store.get(P.pause_halted_key(1, 1))
    t_resume = time.monotonic()
    store.set(P.resume_key(1), b"ftctl resume")
    ta.join(5), tb.join(5)
    for ended in out.values():
        before = [s for s, t in ended if t < t_resume]
        assert before[-1] == 6 and [s for s, t in ended if t >= t_resume] == [7, 8, 9]
    assert any("paused after step 6 (pause #1" in line for line in a.lines)
    assert any("(pause #1: ftctl resume)" in line for line in b.lines)
    assert a.gate.request is None and b.gate.request is None
    a.gate.notice()  # the same request again (a late nudge): carried out already
    assert a.gate.request is None


def test_a_pause_expires_for_every_rank_after_its_maximum() -> None:
    store = dist.HashStore()
    ranks = [Rank(r, store) for r in range(WORLD)]
    request(store, max_s=1.0)
    for r in ranks:
        r.gate.notice()
    t0 = time.monotonic()
    threads = [threading.Thread(target=r.run, args=(0, 2)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert 0.5 < time.monotonic() - t0 < 4
    assert store.get(P.resume_key(1)) == b"expired after 1 s"
    assert all(any("expired after 1 s" in line for line in r.lines) for r in ranks)


def test_a_rank_that_never_answers_abandons_the_pause_for_everyone(monkeypatch) -> None:
    monkeypatch.setattr(pause_mod, "AGREE_TIMEOUT", 0.3)
    store = dist.HashStore()
    a = Rank(0, store)
    request(store)
    a.gate.notice()  # rank 1's agent never tells it
    assert a.run(0, 3) and a.gate.request is None
    assert store.get(P.resume_key(1)) == b"abandoned: ranks [1] did not answer"
    assert "paused" not in a.phases


def test_a_stop_ends_the_wait_and_a_new_generation_abandons_the_pause() -> None:
    store = dist.HashStore()
    a, b = Rank(0, store), Rank(1, store)
    request(store)
    a.gate.notice()
    b.gate.notice()
    threading.Timer(0.3, a.stop.request, (1,)).start()
    t0 = time.monotonic()
    a.run(0, 0)  # heard of it before its first step: halts after step 0
    assert time.monotonic() - t0 < 3 and a.gate.request is None
    assert any("a recovery round started" in line for line in a.lines)
    b.state.generation = 1  # b went through the recovery round before its next step end
    b.run(0, 0)
    assert store.get(P.resume_key(1)) == b"abandoned: recovery round of generation 1"
    assert b.gate.request is None and "paused" not in b.phases
