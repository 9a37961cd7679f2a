"""A graceful pause (`ftctl pause` / `ftctl resume`) inside a rank: halt between steps, no rollback.

Owns: `PauseGate`, the rank's side of a pause request: `notice` (on the channel's reader thread,
when the agent forwards `ftctl pause`), `at_step_end` (on the training thread, after each step
while a request is pending: `Runtime.pause_point`, called by `rt.steps()` and by the framework
hooks' `step_end`), the bounded wait in between, and `close` (the rank leaves the job).

The ranks must halt after the same step: a rank that went on would wait in the next step's
collectives for peers that halted. The rule, without any collective of its own:
  - on hearing of request n, a rank writes `plan.pause_at_key(n, rank)` = (its current step + 1),
    a step it has not ended yet (the request is marked pending before the write, so the
    training thread's next step-end check comes at that step or earlier);
  - at its first step end with the request pending the rank waits for every rank's value
    (written by their reader threads, so a peer blocked in a collective on this rank still
    answers) and takes the largest, T: every rank reads the same values, so the same T, and no
    rank has ended a step after T (each rank's own value exceeds the steps it had ended);
  - every rank runs on to the end of step T, writes `plan.pause_halted_key(n, rank)` and waits
    (phase "paused", which the hang watch does not time) until `plan.resume_key(n)` is set.
The wait is bounded: `PauseRequest.max_s` after the request the first rank to notice sets the
resume key to "expired after S s" and every rank continues (a forgotten pause never holds a job
for ever). A rank that does not answer within `AGREE_TIMEOUT` (or a recovery round that comes
first: a new generation) abandons the pause the same way ("abandoned: ..."), so the ranks keep
running together. A stop during the wait leaves it at once; the recovery round follows.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from launcher.protocol import plan as P
from launcher.runtime.rank_state import RankLinks, RankState

AGREE_TIMEOUT = 30.0  # every rank's reader thread answers within this, or the pause is abandoned
POLL_CAP = 0.1  # a paused rank sees the resume within this


class PauseGate:
    """The pause requests of one rank; `request` is read on the hot path (an attribute a step)."""

    def __init__(
        self,
        state: RankState,
        links: RankLinks,
        members: Callable[[], list[int]],
        set_phase: Callable[[str], None],
    ) -> None:
        self._state = state
        self._links = links
        self._members = members  # the ranks of the current world
        self._set_phase = set_phase
        self._lock = threading.Lock()
        self.request: P.PauseRequest | None = None  # heard of, not yet carried out
        self._generation = -1  # the generation the request was heard in
        self._handled = 0  # the latest request carried out or given up
        self._halt_at: int | None = None

    # ---------------------------------------------------------------- reader thread
    def notice(self) -> None:
        """The agent forwarded `ftctl pause`: read the request, take part in choosing the step."""
        links = self._links
        raw = links.try_get(P.PAUSE_KEY)
        if raw is None:
            links.log("pause: no request in the store (ignored)")
            return
        req = P.PauseRequest.from_json(raw)
        with self._lock:
            if req.seq <= self._handled or (self.request and self.request.seq >= req.seq):
                return
            if links.try_get(P.resume_key(req.seq)) is not None:
                return  # ended before this rank heard of it
            first = self._state.current_step + 1  # not ended yet (see the module docstring)
            self._generation = self._state.generation
            self._halt_at = None
            self.request = req  # before the write: the next step-end check is at `first` or before
        links.store.set(P.pause_at_key(req.seq, links.rank), str(first).encode())
        links.log(f"pause #{req.seq} requested: this rank can halt after step {first} or later")

    # ---------------------------------------------------------------- training thread
    def at_step_end(self, step: int) -> None:
        """Step `step` ended (committed) with a request pending: agree on the step, halt after
        it, wait for the resume."""
        req = self.request
        if req is None:
            return
        if self._state.generation != self._generation:
            self._give_up(req, f"abandoned: recovery round of generation {self._state.generation}")
            return
        if self._halt_at is None:
            self._halt_at = self._agree(req)
            if self._halt_at is None:
                return
        if step < self._halt_at:
            return
        self._hold(req, step)

    def _agree(self, req: P.PauseRequest) -> int | None:
        """The step every rank halts after (the largest first step any rank can halt after);
        None when the pause was given up."""
        ranks = self._members()
        links, keys = self._links, [P.pause_at_key(req.seq, r) for r in ranks]
        deadline = time.monotonic() + min(AGREE_TIMEOUT, req.max_s)
        delay = 0.001
        while not links.store.check(keys):
            if links.stop.newer_than(self._state.generation):
                self._give_up(req, "abandoned: a recovery round started")
                return None
            if links.try_get(P.resume_key(req.seq)) is not None:
                self._give_up(req, "")
                return None
            if time.monotonic() > deadline:
                missing = [r for r, k in zip(ranks, keys) if not links.store.check([k])]
                self._give_up(req, f"abandoned: ranks {missing} did not answer")
                return None
            links.stop.wait_newer(self._state.generation, delay)
            delay = min(delay * 2, POLL_CAP)
        halt = max(int(v) for v in links.store.multi_get(keys))
        links.store.compare_set(P.pause_step_key(req.seq), b"", str(halt).encode())
        links.log(f"pause #{req.seq}: every rank halts after step {halt}")
        return halt

    def _hold(self, req: P.PauseRequest, step: int) -> None:
        """Halted after `step`: wait for the resume, the pause's end, or a stop."""
        links, state = self._links, self._state
        self._set_phase("paused")
        links.store.set(P.pause_halted_key(req.seq, links.rank), str(step).encode())
        t0 = time.monotonic()
        links.log(f"paused after step {step} (pause #{req.seq}, at most {req.max_s:g} s)")
        delay = 0.002
        while True:
            why = links.try_get(P.resume_key(req.seq))
            if why is not None:
                break
            if links.stop.newer_than(state.generation):
                why = b"a recovery round started"
                break
            if time.time() > req.time + req.max_s:
                why = self._end(req, f"expired after {req.max_s:g} s")
                break
            links.stop.wait_newer(state.generation, delay)
            delay = min(delay * 2, POLL_CAP)
        links.log(
            f"resumed after {time.monotonic() - t0:.2f} s paused (pause #{req.seq}: "
            f"{why.decode(errors='replace')})"
        )
        self._set_phase("committed")
        self._finish(req)

    def close(self, why: str) -> None:
        """The rank leaves the job (`rt.finish()`): a pause it has not carried out ends for every
        rank (it would never be agreed or resumed without this rank)."""
        req = self.request
        if req is not None and self._links.store is not None:
            self._give_up(req, f"abandoned: {why}")

    def _give_up(self, req: P.PauseRequest, why: str) -> None:
        if why:
            why = self._end(req, why).decode(errors="replace")
            self._links.log(f"pause #{req.seq} {why}; training goes on")
        self._finish(req)

    def _end(self, req: P.PauseRequest, why: str) -> bytes:
        """Set the resume key (the first reason wins); the reason it holds."""
        return self._links.store.compare_set(P.resume_key(req.seq), b"", why.encode())

    def _finish(self, req: P.PauseRequest) -> None:
        with self._lock:
            self._handled = max(self._handled, req.seq)
            if self.request is req:
                self.request = None
            self._halt_at = None
