"""`ftctl status --watch`: the status screen redrawn in place until the job ends.

Owns: `watch`, the redraw loop. On a terminal each frame is rendered first, then replaces the
previous one (rich `Live`: the cursor goes back over the old frame and overwrites it; the screen
is never cleared, so it is never blank); elsewhere (a pipe, `--json`) the frames follow one
another. When the job ends while watched, the loop draws one last frame and returns (exit 0):
the finished
run from its directory's events (the run directory given, or the one the agents published in
their status), or the last live view marked "job ended" when no directory can be read. A job
is over when its view says so (succeeded, failed) or when its store, which answered before,
stopped answering: the store lives in the job's leader agent and goes away with it.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable

import click

from launcher.observe.run_view import RunView

Loader = Callable[[], tuple[RunView, str]]
Emit = Callable[[RunView, str], Any]


@dataclass
class Frame:
    view: RunView
    source: str
    live: bool  # read from the job's store


def watch(
    load: Loader,
    from_dir: Callable[[str], RunView],
    show: Emit,
    interval: float,
    count: int,
) -> None:
    """Redraw `show(view, source)` every `interval` s (`count` frames; 0: until the job ends or
    Ctrl-C). `load()` reads the job; `from_dir(path)` a run directory's events."""
    shown, last = 0, None
    while count == 0 or shown < count:
        frame = _next(load, from_dir, last)
        show(frame.view, frame.source)
        shown += 1
        if _ended(frame, last):
            return
        last = frame
        if count and shown >= count:
            return
        time.sleep(interval)


def _next(load: Loader, from_dir: Callable[[str], RunView], last: Frame | None) -> Frame:
    try:
        view, source = load()
    except click.ClickException:
        if last is None or not last.live:
            raise  # never reached: say why, as without --watch
        return _after_end(last, from_dir)
    return Frame(view, source, source.startswith("live"))


def _ended(frame: Frame, last: Frame | None) -> bool:
    """The job ended while watched: its view says so now, or its store answered before and no
    longer does. (A run already over at the first frame is redrawn like any other.)"""
    if last is None or last.view.outcome not in ("running", ""):
        return False
    return frame.view.outcome not in ("running", "") or (last.live and not frame.live)


def _after_end(last: Frame, from_dir: Callable[[str], RunView]) -> Frame:
    """The store went away with the job: the finished run from the directory its agents
    published, else the last live view, said to be ended."""
    for path in dict.fromkeys(d for d in last.view.log_dirs if d):
        try:
            view = from_dir(path)
        except (click.ClickException, OSError):
            continue
        return Frame(view, f"job ended; events of {path}", False)
    outcome = "ended" if last.view.outcome == "running" else last.view.outcome
    view = dataclasses.replace(last.view, outcome=outcome, now=time.time())
    return Frame(view, "job ended: its store went away and no run directory could be read", False)


class LiveScreen:
    """The frames on a terminal: each rendered in full, then put in place of the last one."""

    def __init__(self, console: Any) -> None:
        from rich.live import Live

        self._live = Live(console=console, auto_refresh=False, redirect_stdout=False)

    def __enter__(self) -> "LiveScreen":
        self._live.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._live.stop()  # the last frame stays on the screen

    def show(self, renderable: Any) -> None:
        self._live.update(renderable, refresh=True)
