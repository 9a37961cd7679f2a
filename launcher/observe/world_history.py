"""The world's size over time, rebuilt from a run's events, and what each change cost.

Owns: `WorldBook`, the part of `launcher.observe.timeline.Timeline` that follows the world: its
size at the start (the first `rendezvous`), each hot switch (`switch-done`: the same size, ranks
moved to new processes, its cost the seconds it held the ranks), each `world-shrink` and
`world-grow` (live, by
elastic-training: no rank restarts; or by a restart-all in a new rendezvous round: a lost node
nobody took over, `scale_up=restart`) and a restart-all that brings every rank back after a live
shrink (`restart-all-go`); which ranks are in the world of each generation (`outside`: the ranks
a round does not wait for); and `settle`, which writes the view's `world_history` (one
`WorldChange` per entry, `launcher.observe.run_view`) with each change's first step and cost:
a shrink's or a restart-all's is the time lost of its recovery round (the one rule of
`launcher.observe.run_view`, read, not recomputed), a live grow's its event's `cost_s` (the
seconds it held the ranks), else its round's. `change_words`: a change in words ("shrink 4 -> 3
(rank 3's replica left): 0.40 s lost"), `world_words` (the world now), `ranks_now` (its
ranks). Pure: no I/O.
"""

from __future__ import annotations

from typing import Callable

from launcher.observe.run_view import Round, RunView, WorldChange

ALL = None  # a world of every rank of the job's numbering (the start, after a restart-all)
VERBS = {
    "shrink": "shrunk",
    "grow": "grew",
    "restart-all": "every rank back by restart-all",
    "switch": "ranks moved by a hot switch",
}


class WorldBook:
    """Incremental, as the timeline: `feed(kind, event, t)` in time order, `settle(view)`."""

    def __init__(self) -> None:
        self.original: int | None = None
        self.start: float | None = None
        self.current: int | None = None
        self.changes: list[WorldChange] = []
        self._members: list[tuple[int, frozenset[int] | None]] = [(0, ALL)]  # from generation
        self._plan_next: list[WorldChange] = []  # restart-style changes: the next plan is theirs
        self._size_next: WorldChange | None = None  # a restart-style grow: the new rendezvous

    # ------------------------------------------------------------------ feeding
    def feed(self, kind: str, ev: dict, t: float) -> None:
        handler = _HANDLERS.get(kind)
        if handler is not None:
            handler(self, ev, t)

    def _on_rendezvous(self, ev: dict, t: float) -> None:
        size = ev.get("world_size")
        if not isinstance(size, int) or size <= 0:
            return
        if self.original is None:
            self.original, self.start, self.current = size, t, size
        elif size != self.current:
            self._new_size(size, t, int(ev.get("generation", 0)))

    def _new_size(self, size: int, t: float, generation: int) -> None:
        """A new rendezvous round formed a world of `size`: the restart-style grow waiting for
        it, else a change nothing announced (an older run)."""
        c = self._size_next
        self._size_next = None
        if c is None:
            kind = "shrink" if size < (self.current or 0) else "grow"
            c = self._add(t, kind, "a new rendezvous round", self.current, generation, live=False)
        c.world_size = self.current = size

    def _on_shrink(self, ev: dict, t: float) -> None:
        g = int(ev.get("generation", 0))
        before = _int(ev.get("world_size"), self.current)
        if "lost_node" in ev:  # a lost node nobody took over: restart-all in a smaller world
            node = ev["lost_node"] if isinstance(ev.get("lost_node"), int) else None
            c = self._add(t, "shrink", f"node {node} lost; restart-all", before, g, live=False)
            c.node = node
            self._plan_next.append(c)
        else:
            prev = self.members(g)
            world = ev.get("world")
            now = frozenset(world) if isinstance(world, list) else None
            if now is None:
                dropped = set(ev.get("dropped") or [])
                now = frozenset(r for r in self._all(prev, before) if r not in dropped)
            left = sorted(self._all(prev, before) - now)
            c = self._add(t, "shrink", _left_words(left), before, g, live=True)
            c.ranks, c.round = left, g
            self._members.append((g, now))
        size = _int(ev.get("new_world_size"), None)
        c.world_size = self.current = size if size is not None else (self.current or 0)

    def _on_grow(self, ev: dict, t: float) -> None:
        g = int(ev.get("generation", 0))
        before = _int(ev.get("world_size"), self.current)
        size = _int(ev.get("new_world_size"), None)
        if size is None:  # scale_up=restart: a new round for the waiting agents; size to come
            c = self._add(t, "grow", "nodes joined; restart-all", before, g, live=False)
            self._plan_next.append(c)
            self._size_next = c
            return
        world = ev.get("world")
        prev = self.members(g)
        now = frozenset(world) if isinstance(world, list) else None
        joined = sorted(now - self._all(prev, before)) if now is not None else []
        c = self._add(t, "grow", _joined_words(joined), before, g, live=True)
        c.ranks, c.world_size, self.current, c.round = joined, size, size, g
        cost = ev.get("cost_s")
        c.cost_s = round(float(cost), 4) if isinstance(cost, (int, float)) else None
        c.step = _int(ev.get("resume_step"), _int(ev.get("step"), None))
        self._members.append((g, now if now is not None and len(now) != self.original else ALL))

    def _on_switch(self, ev: dict, t: float) -> None:
        """A hot switch (`switch-done`): the same world, ranks moved to new processes."""
        g = int(ev.get("generation", 0))
        moved = [r for r in ev.get("moved") or [] if isinstance(r, int)]
        why = ("rank " if len(moved) == 1 else "ranks ") + ", ".join(map(str, moved))
        c = self._add(t, "switch", f"{why} moved to new processes", self.current, g, live=True)
        c.ranks, c.world_size, c.round = moved, self.current or 0, g
        cost = ev.get("cost_s")
        c.cost_s = round(float(cost), 4) if isinstance(cost, (int, float)) else None
        c.step = _int(ev.get("resume_step"), None)

    def _on_plan(self, ev: dict, t: float) -> None:
        g = int(ev.get("generation", 0))
        for c in self._plan_next:
            c.round = g
        if self._plan_next:
            self._members.append((g, ALL))  # a new rendezvous round numbers its ranks anew
        self._plan_next = []

    def _on_restart_all_go(self, ev: dict, t: float) -> None:
        """Every rank restarts: after a live shrink, the world of every rank is back."""
        g = int(ev.get("generation", 0))
        if self.members(g) is ALL or self.original is None:
            return
        c = self._add(t, "restart-all", "restart-all: every rank restarted", self.current, g, False)
        c.round, c.world_size, self.current = g, self.original, self.original
        c.ranks = sorted(set(range(self.original)) - (self.members(g) or set()))
        self._members.append((g, ALL))

    def _add(
        self, t: float, kind: str, why: str, before: int | None, g: int, live: bool
    ) -> WorldChange:
        c = WorldChange(t, self.current or 0, kind, why, before, generation=g, live=live)
        self.changes.append(c)
        return c

    # ------------------------------------------------------------------ membership
    def members(self, generation: int) -> frozenset[int] | None:
        """The ranks in the world of `generation` (None: every rank of the job's numbering)."""
        now: frozenset[int] | None = ALL
        for g, members in self._members:
            if g <= generation:
                now = members
        return now

    def outside(self, generation: int) -> Callable[[int], bool]:
        """Whether a rank is outside the world of `generation` (left it by a live shrink)."""
        members = self.members(generation)
        return lambda rank: members is not None and rank not in members

    def _all(self, members: frozenset[int] | None, size: int | None) -> frozenset[int]:
        if members is not None:
            return members
        return frozenset(range(self.original or size or 0))

    # ------------------------------------------------------------------ the view
    def settle(self, v: RunView) -> None:
        """The view's `world_history` (the start, then every change with its first step and
        cost; the rounds must be settled) and its world sizes, original and current."""
        original = self.original
        if original is None:
            first = next((c.before for c in self.changes if c.before), None)
            original = first or v.world_size or len(v.ranks) or None
        if original is None:
            v.world_history = []
            return
        v.original_world_size = original
        start = self.start if self.start is not None else (v.start or 0.0)
        rounds = {ro.generation: ro for ro in v.rounds}
        history = [WorldChange(start, original, "start", "the job's world")]
        for c in self.changes:
            _charge(c, rounds.get(c.round) if c.round is not None else None, history[-1])
            history.append(c)
        v.world_history = history
        if self.changes:
            v.world_size = history[-1].world_size


def _charge(c: WorldChange, ro: Round | None, prev: WorldChange) -> None:
    """`c`'s cost and first step from its round (a live grow that said its cost keeps it): a
    round that began before the previous change is another change's, not this one's."""
    if ro is None or ro.start < prev.time and prev.kind != "start":
        return
    if c.cost_s is None or c.kind not in ("grow", "switch"):
        c.cost_s, c.cost_open = ro.time_lost_s, ro.lost_open
    if c.step is None and c.live and ro.resume_step is not None:
        c.step = int(ro.resume_step)


def ranks_now(history: list[WorldChange]) -> list[int]:
    """The ranks in the world at the end of `history` (a live shrink takes its ranks out, a
    live grow puts its own back, a change by restart-all numbers every rank anew)."""
    ranks: set[int] = set()
    for c in history:
        if c.kind == "shrink" and c.live:
            ranks -= set(c.ranks)
        elif c.kind == "grow" and c.live and c.ranks:
            ranks |= set(c.ranks)
        elif c.kind == "switch":
            continue  # the same ranks, in new processes
        else:
            ranks = set(range(c.world_size))
    return sorted(ranks)


def change_words(c: WorldChange) -> str:
    """ "shrink 4 -> 3 (rank 3's replica left): 0.40 s lost"."""
    before = "?" if c.before is None else str(c.before)
    cost = (
        "cost not known"
        if c.cost_s is None
        else f"{c.cost_s:.2f} s lost" + (" so far" if c.cost_open else "")
    )
    step = f" at step {c.step}" if c.step is not None else ""
    return f"{c.kind} {before} -> {c.world_size}{step} ({c.why}): {cost}"


def world_words(v: RunView, clock: Callable[[float], str]) -> str:
    """The world now, for `ftctl status`: "world 3 of 4 ranks since 09:12:01 (shrunk at step
    17)"; "" while its size is not known."""
    now = v.world_now()
    if now is None:
        return ""
    size, original = now["size"], now["original"]
    if not now["changes"]:
        return f"world {size} ranks (as started)"
    step = f" at step {now['step']}" if now["step"] is not None else ""
    verb = VERBS.get(now["kind"], now["kind"])
    return f"world {size} of {original} ranks since {clock(now['since'])} ({verb}{step})"


def _left_words(ranks: list[int]) -> str:
    if not ranks:
        return "ranks left"
    if len(ranks) == 1:
        return f"rank {ranks[0]}'s replica left"
    return "ranks " + ", ".join(map(str, ranks)) + " left (their replicas)"


def _joined_words(ranks: list[int]) -> str:
    if not ranks:
        return "ranks joined"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) + " joined"


def _int(value: object, default: int | None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


_HANDLERS = {
    "rendezvous": WorldBook._on_rendezvous,
    "round-joined": WorldBook._on_rendezvous,
    "world-shrink": WorldBook._on_shrink,
    "world-grow": WorldBook._on_grow,
    "plan": WorldBook._on_plan,
    "restart-all-go": WorldBook._on_restart_all_go,
    "switch-done": WorldBook._on_switch,
}
