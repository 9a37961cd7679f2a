"""`ftctl status`: is the job healthy right now? One screen: nodes, ranks, budget, round, faults.

Owns: building a `RunView` of a job from its live store (the node status every agent's observer
publishes under `plan.node_status_key`, the leader's adding the faults and rounds, plus the
controller's own keys: generation, budget, per-round statuses) or from a run directory's
`events.jsonl` (a finished run, or a live one whose store cannot be reached), and drawing it as
rich tables (`--json` prints the same view as one JSON object; `--watch` redraws it, see
`launcher.observe.status_watch`), with the world's size now against the original (its changes:
`launcher.observe.world_history`) and, after the source, a pause or a hot switch in progress
(`launcher.observe.pause_state`, `launcher.observe.switch_state`). Also a
rank's current step as its agent published it (`rank_step`, for `ftctl inject --at-step`).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import click
from rich.markup import escape

from launcher.observe.ftrun_exits import mark_ftrun_exits
from launcher.observe.logs import read_event_file, run_event_files
from launcher.observe.pause_state import pause_state
from launcher.observe.run_view import Bar, FaultRow, NodeRow, RankRow, Round, RunView, WorldChange
from launcher.observe.switch_state import HALTING, SWITCHING, switch_state
from launcher.observe.timeline import Timeline
from launcher.observe.world_history import change_words, ranks_now, world_words
from launcher.protocol import plan as P
from launcher.protocol.budget import restarts_left

SHOWN_CHANGES = 5  # the world's last changes under its line
MAX_NODE_GAP = 8  # node ranks probed past the last one found (a lost node leaves a hole)
STEPPING = ("training", "waiting", "paused", "finished")  # rank states in which its step only grows
STATE_STYLE = {
    "training": "green",
    "waiting": "yellow",
    "paused": "magenta",
    "recovering": "bold yellow",
    "replacement": "bold cyan",
    "finished": "dim",
    "failed": "bold red",
    "stopped": "dim",
    "starting": "cyan",
    "running": "green",
    "done": "dim",
    "lost": "bold red",
    "succeeded": "bold green",
    "in-progress": "bold yellow",
}


# ---------------------------------------------------------------------- sources
def from_dir(path: str) -> RunView:
    """The view of the run in `path` (its run directory, or the --log_dir base) from its events."""
    files = run_event_files(path)
    if not files:
        raise click.ClickException(
            f"{path}: no events.jsonl here or in its subdirectories "
            "(pass the run's log directory, printed by ftrun at start)"
        )
    events: list[dict] = []
    for f in files:
        events.extend(read_event_file(f))
    view = Timeline().feed_all(events).view(now=None)
    mark_ftrun_exits(view)  # what ftrun itself ended, told by the ranks' stderr.log
    return view


def _rows(cls: type, items: list[dict]) -> list:
    names = set(cls.__dataclass_fields__)
    return [cls(**{k: v for k, v in it.items() if k in names}) for it in items]


def _round(d: dict) -> Round:
    ro = _rows(Round, [d])[0]
    ro.fault = _rows(FaultRow, [d["fault"]])[0] if d.get("fault") else None
    ro.bars = _rows(Bar, d.get("bars") or [])
    return ro


def node_snapshots(kv: Any) -> list[dict]:
    """Every node status the agents published (node ranks probed upwards)."""
    out, miss, n = [], 0, 0
    while miss <= MAX_NODE_GAP:
        raw = kv.try_get(P.node_status_key(n))
        if raw is None:
            miss += 1
        else:
            miss = 0
            out.append(json.loads(raw))
        n += 1
    return out


def rank_step(snapshots: list[dict], rank: int) -> int | None:
    """The step `rank` is at, as its agent last published it (the newest node status that lists
    it), while it trains or once it finished; None when no status lists it, its step is not
    known yet, or it is starting or in a recovery round (its step may go back)."""
    newest: tuple[float, dict] | None = None
    for snap in snapshots:
        for row in snap.get("ranks") or []:
            t = float(snap.get("time") or 0.0)
            if row.get("rank") == rank and (newest is None or t > newest[0]):
                newest = (t, row)
    if newest is None:
        return None
    step, state = newest[1].get("step"), newest[1].get("state")
    if state not in STEPPING or not isinstance(step, int) or step < 0:
        return None
    return step


def from_store(kv: Any, now: float | None = None) -> RunView:
    """The live view: the agents' node statuses plus the controller's keys."""
    now = now or time.time()
    snaps = node_snapshots(kv)
    if not snaps:
        raise click.ClickException(
            "the store has no node status: is this an ftrun job's store, "
            "and has its agent finished starting?"
        )
    v = RunView(now=now)
    leader = next((s for s in snaps if s.get("leader")), snaps[0])
    job = leader.get("job") or {}
    v.run_id, v.script, v.start = job.get("run_id", ""), job.get("script", ""), job.get("start")
    v.world_size, v.nnodes, v.store_addr = (
        job.get("world_size"),
        job.get("nnodes"),
        job.get("store_addr", ""),
    )
    v.outcome = job.get("outcome", "running")
    v.faults = _rows(FaultRow, job.get("faults") or [])
    v.rounds = [_round(d) for d in job.get("rounds") or []]
    v.world_history = _rows(WorldChange, job.get("world_history") or [])
    v.original_world_size = job.get("original_world_size")
    v.settle_time_lost()  # as of this reading: a running round's time lost grows to `now`
    raw = kv.try_get(P.GENERATION_KEY)
    v.generation = int(raw) if raw is not None else max(int(s.get("generation", 0)) for s in snaps)
    raw = kv.try_get(P.RESTARTS_USED_KEY)
    v.restarts_used = int(raw) if raw is not None else int(leader.get("restarts_used", 0))
    v.max_restarts = int(leader.get("max_restarts", 0))
    for s in snaps:
        state = (
            "recovering"
            if s.get("recovering") and s.get("state") == "running"
            else s.get("state", "")
        )
        v.nodes.append(
            NodeRow(
                node=s["node"],
                host=s.get("host", ""),
                state=state,
                last_seen=float(s.get("time", 0.0)),
                leader=bool(s.get("leader")),
                spare=bool(s.get("spare")),
                spares_ready=int(s.get("spares_ready") or 0),
                spare_ready_s=s.get("spare_ready_s"),
            )
        )
        v.ranks.extend(_rows(RankRow, s.get("ranks") or []))
        v.log_dirs.append(s.get("log_dir", ""))
    v.ranks.sort(key=lambda r: r.rank)
    return v


def round_progress(kv: Any, generation: int, ranks: list[int]) -> str:
    """How far the current process-level round of the world of `ranks` is, from the store:
    statuses and resumes."""
    reported = sum(kv.try_get(P.status_key(generation, r)) is not None for r in ranks)
    resumed = sum(kv.try_get(P.resumed_key(generation, r)) is not None for r in ranks)
    planned = kv.try_get(P.repair_key(generation)) is not None
    n = len(ranks)
    return (
        f"{reported}/{n} ranks reported, repair plan {'out' if planned else 'pending'}, "
        f"{resumed}/{n} resumed"
    )


def connect(addr: str, token_file: str | None) -> Any:
    from rendezvous.store.auth import TokenError, resolve_token
    from rendezvous.store.client import StoreClient
    from rendezvous.store.store_cli import parse_addr

    try:
        host, port = parse_addr(addr)
        token = resolve_token(token_file)
    except (ValueError, TokenError) as e:
        raise click.BadParameter(str(e), param_hint="--addr") from None
    return StoreClient(host, port, token=token, timeout=5.0)


def load(target: str | None, addr: str | None, token_file: str | None) -> tuple[RunView, str]:
    """(view, where it came from). A run directory of a live job is read through its store."""
    from rendezvous.kv import StoreError

    if addr is None and target is not None:
        view = from_dir(target)
        if view.outcome != "running" or not view.store_addr:
            return view, f"events of {target}"
        addr = view.store_addr
        try:
            return _live(addr, token_file, view)
        except (StoreError, OSError, click.ClickException):
            return view, f"events of {target} (its store {addr} does not answer)"
    if addr is None:
        raise click.UsageError("give the run's log directory or --addr HOST:PORT of its store")
    try:
        return _live(addr, token_file, None)
    except (StoreError, OSError) as e:
        raise click.ClickException(f"store {addr}: {e}") from None


def _live(addr: str, token_file: str | None, fallback: RunView | None) -> tuple[RunView, str]:
    kv = connect(addr, token_file)
    try:
        view = from_store(kv)
        if fallback is not None and not view.run_id:
            view.run_id, view.script = fallback.run_id, fallback.script
        cur = view.current_round
        detail = ""
        if cur is not None and cur.strategy in ("retry", "recover-in-place") and view.world_size:
            ranks = ranks_now(view.world_history) or list(range(int(view.world_size)))
            detail = round_progress(kv, cur.generation, ranks)
        paused = pause_state(kv)  # `ftctl pause` in effect: said after the source
        said = f"; {paused.describe()}" if paused is not None and paused.in_effect else ""
        switch = switch_state(kv)  # a hot switch in progress: its stage (its halt included)
        if switch is not None:
            said = ("" if switch.stage in (HALTING, SWITCHING) else said) + f"; {switch.describe()}"
        view.store_addr = view.store_addr or addr
        return view, f"live, store {addr}" + (f"; round: {detail}" if detail else "") + said
    finally:
        kv.close()


# ---------------------------------------------------------------------- drawing
def _age(now: float, t: float | None) -> str:
    if not t:
        return "-"
    d = max(0.0, now - t)
    return f"{d:.1f}s" if d < 120 else f"{d / 60:.0f}m" if d < 7200 else f"{d / 3600:.1f}h"


def _styled(text: str) -> str:
    style = STATE_STYLE.get(text)
    return f"[{style}]{text}[/]" if style else text


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def render(view: RunView, source: str) -> Any:
    """The status screen as one rich renderable."""
    from rich.console import Group
    from rich.text import Text

    now = view.now or time.time()
    state = (
        "recovering"
        if view.current_round is not None and view.outcome == "running"
        else view.outcome
    )
    left = restarts_left(view.restarts_used, view.max_restarts)
    head = Text.from_markup(
        f"[bold]ftrun job {escape(view.run_id or '?')}[/]  "
        f"{escape(os.path.basename(view.script))}  "
        f"{_styled(state)}  generation {view.generation}  up {_age(now, view.start)}\n"
        f"restart budget: {view.restarts_used} used of {view.max_restarts}, [bold]{left} left[/]   "
        f"faults: {len(view.faults)}   time lost to recovery: {view.time_lost_s:.2f}s   "
        f"[dim]({escape(source)})[/]"
    )
    parts: list[Any] = [head]
    world = world_words(view, _clock)
    if world:
        changes = view.world_changes[-SHOWN_CHANGES:]
        parts.append(
            Text("\n".join([world] + [f"  {_clock(c.time)} {change_words(c)}" for c in changes]))
        )
    cur = view.current_round
    if cur is not None:
        f = cur.fault
        cause = f"rank {f.rank} {f.kind}" if f is not None else "?"
        parts.append(
            Text.from_markup(
                f"[bold yellow]recovery round, generation {cur.generation}: {cur.strategy}, phase "
                f"{cur.phase or '?'}[/], running {_age(now, cur.start)} (cause: {cause})"
            )
        )
    parts += [_nodes_table(view, now), _ranks_table(view, now)]
    if view.faults:
        parts.append(_faults_table(view))
    return Group(*parts)


def _nodes_table(view: RunView, now: float) -> Any:
    from rich.table import Table

    t = Table(title="nodes", title_justify="left", box=None, pad_edge=False)
    for c in ("node", "host", "state", "role", "heard from", "warm spare"):
        t.add_column(c)
    for n in view.nodes:
        t.add_row(
            str(n.node),
            escape(n.host),
            _styled(n.state),
            "leader" if n.leader else "",
            _age(now, n.last_seen) + " ago",
            _spares(n),
        )
    return t


def _spares(n: NodeRow) -> str:
    """The warm-spare cell: how many are ready, and how soon the first was after the start."""
    when = f" (first {n.spare_ready_s:.1f} s after start)" if n.spare_ready_s is not None else ""
    if n.spares_ready:
        return f"{n.spares_ready} ready{when}"
    return ("ready" if n.spare else "-") + (when if n.spare_ready_s is not None else "")


def _ranks_table(view: RunView, now: float) -> Any:
    from rich.table import Table

    t = Table(title="ranks", title_justify="left", box=None, pad_edge=False)
    for c in (
        "rank",
        "node",
        "pid",
        "gen",
        "step",
        "phase",
        "state",
        "steps/s",
        "restarts",
        "seen",
    ):
        t.add_column(
            c,
            justify="right"
            if c in ("rank", "pid", "gen", "step", "steps/s", "restarts")
            else "left",
        )
    for r in view.ranks:
        step = "-" if r.committed_step is None or r.committed_step < 0 else str(r.committed_step)
        rate = "-" if r.steps_per_s is None else f"{r.steps_per_s:.2f}"
        t.add_row(
            str(r.rank),
            str(r.node if r.node is not None else "-"),
            str(r.pid or "-"),
            str(r.generation),
            step,
            escape(r.phase or "-"),
            _styled(r.state),
            rate,
            str(r.restarts),
            _age(now, r.last_seen) + " ago",
        )
    return t


def _faults_table(view: RunView) -> Any:
    from rich.table import Table

    t = Table(title="faults", title_justify="left", box=None, pad_edge=False, expand=True)
    for c in ("time", "rank", "node", "kind", "strategy", "gen", "MTTR", "steps lost"):
        t.add_column(c, no_wrap=True)
    t.add_column("what happened", overflow="fold", min_width=40, ratio=1)
    for f in view.faults:
        t.add_row(
            _clock(f.time),
            str(f.rank if f.rank is not None else "node"),
            str(f.node),
            escape(
                f.kind + (" [injected]" if f.injected else "") + (" (ftrun)" if f.cause else "")
            ),
            f.strategy or "-",
            "-" if f.round is None else f"{f.generation}->{f.round}",
            "-" if f.mttr_s is None else f"{f.mttr_s:.2f}s",
            "-" if f.steps_lost is None else str(f.steps_lost),
            escape(f.summary or f.evidence[:200]),
        )
    return t


# ---------------------------------------------------------------------- the command
@click.command("status")
@click.argument("run_dir", required=False, type=click.Path(exists=True, file_okay=False))
@click.option(
    "--addr",
    default=None,
    metavar="HOST:PORT",
    help="The job's store (printed by ftrun at start; in <run dir>/store.json).",
)
@click.option("--token-file", default=None, help="Job token file, when the store requires one.")
@click.option("--json", "as_json", is_flag=True, help="Print the view as one JSON object.")
@click.option(
    "--watch",
    is_flag=True,
    help="Redraw in place every --interval seconds until the job ends (or Ctrl-C).",
)
@click.option(
    "--interval",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=0.1),
    help="Seconds between redraws (--watch).",
)
@click.option(
    "--count",
    default=0,
    type=click.IntRange(min=0),
    help="With --watch: stop after this many redraws (0: until Ctrl-C).",
)
def status(
    run_dir: str | None,
    addr: str | None,
    token_file: str | None,
    as_json: bool,
    watch: bool,
    interval: float,
    count: int,
) -> None:
    """Show a job's nodes, ranks, restart budget, recovery round and faults (RUN_DIR: the run's
    log directory; or --addr of its live store)."""
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=False)
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=False, width=160)
    if not watch:
        view, source = load(run_dir, addr, token_file)
        _emit(console, view, source, as_json)
        return
    from launcher.observe.status_watch import LiveScreen, watch

    def read() -> tuple[RunView, str]:
        return load(run_dir, addr, token_file)

    try:
        if console.is_terminal and not as_json:
            with LiveScreen(console) as screen:
                watch(read, from_dir, lambda v, src: screen.show(render(v, src)), interval, count)
        else:
            watch(read, from_dir, lambda v, src: _emit(console, v, src, as_json), interval, count)
    except KeyboardInterrupt:
        pass


def _emit(console: Any, view: RunView, source: str, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({"source": source, **view.to_dict()}, default=str))
    else:
        console.print(render(view, source))
