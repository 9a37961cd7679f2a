"""One rank's phases in a process-level recovery round (retry, recover-in-place), as they were.

Owns: `process_edges`, the consecutive phase edges of one rank in one round from what the ranks
and agents recorded, and `live_phase`, the phase a running round is in. The edges, per rank:

  stop      a survivor: its agent got the plan -> it left its collectives and posted its status
            (`rank-recovered.marks.status`; before that event, or without one because the round
            was superseded, the `rank-stopped` its agent recorded from the rank's heartbeat)
  respawn   a replacement: its agent got the plan -> its process runs the script's code
            (`marks.exec`: interpreter start of a new process, assignment of a warm spare)
  imports   `marks.exec` -> the script's imports done (`marks.imported`)
  start-up  `marks.imported` -> its status posted; and again, after the group rebuild, until
            its state transfer began (the script builds its model and optimizer and reaches its
            first step, where it receives its state)
  wait      status posted -> the controller's repair plan (`marks.plan`); a survivor also waits
            after the rebuild until the transfer it takes part in begins (the replacement's
            start-up), or for the whole repair when it neither sends nor receives
  rebuild   repair plan -> process groups of the new generation built (`marks.rebuilt`)
  transfer  the state transfer itself: received (`marks.received`) or sent, minus
            `transfer_s` -> repaired (`marks.repaired`; a sender's `transfer_s` counts its wait
            for the receiver, so the receiver's is used when shorter); a rank restoring its own
            step-start state: rebuilt -> repaired
  resume    repaired -> its first step after the round committed (`rank-resumed`)

Older runs without `exec`/`imported` marks: respawn runs to the rank's `hello` (process start
and imports) and start-up from there, or respawn to its status when no hello was seen; the
replacement's start-up is never drawn as transfer. A round that ended without the rank's
`rank-recovered` (superseded, failed) draws what was recorded and a last phase to its end.
"""

from __future__ import annotations

from launcher.observe.run_view import PHASES, Bar, RoundData

Edge = tuple[str, float | None, float | None, str]


def process_edges(rd: RoundData, rank: int, start: float, moved: str) -> list[Edge]:
    """`rank`'s edges in `rd`'s round from `start` (its agent got the plan); `moved`: what the
    transfer moved, in words. An edge without an end is the phase still running (or the last
    one of a round that ended without it)."""
    ro = rd.round
    marks = (rd.recovered.get(rank) or {}).get("marks") or {}
    status = marks.get("status") or rd.stopped.get(rank)
    if rank in ro.restart_ranks:
        edges = _start_up(rd, rank, start, marks, status)
    else:
        edges = [("stop", start, status, "left its collectives and posted its status")]
    if "plan" not in marks:  # no rank-recovered (yet): what its agent saw
        if status is not None and rank in ro.restart_ranks and rd.repair_planned is not None:
            return edges + [
                ("wait", status, rd.repair_planned, "for every rank's status and the repair plan"),
                ("start-up", rd.repair_planned, None, "rebuild, start-up, state transfer"),
            ]
        return edges + [("wait", status, None, "for the other ranks and the repair plan")]
    edges += [
        ("wait", status, marks["plan"], "for every rank's status and the repair plan"),
        ("rebuild", marks["plan"], marks.get("rebuilt"), "process groups of the new generation"),
    ]
    edges += _repair(rd, rank, marks, moved)
    edges.append(("resume", marks.get("repaired"), (rd.resumed.get(rank) or {}).get("time"), ""))
    return edges


def _start_up(
    rd: RoundData, rank: int, start: float, marks: dict, status: float | None
) -> list[Edge]:
    """A replacement from the plan to its status: respawn, imports, script start-up."""
    spawn = rd.spawned.get(rank)
    how = "from the warm spare" if spawn and spawn.get("warm") else "new process"
    exec_at, imported = marks.get("exec"), marks.get("imported")
    if exec_at is not None and imported is not None:
        return [
            ("respawn", start, exec_at, f"{how}: until its code runs"),
            ("imports", exec_at, imported, "the script's imports"),
            ("start-up", imported, status, "the script's start-up until it joined the round"),
        ]
    hello = rd.hello.get(rank)
    if hello is not None and (status is None or hello <= status):
        return [
            ("respawn", start, hello, f"{how}: process start and imports (until its hello)"),
            ("start-up", hello, status, "the script's start-up until it joined the round"),
        ]
    return [("respawn", start, status, how)]


def _repair(rd: RoundData, rank: int, marks: dict, moved: str) -> list[Edge]:
    """Rebuilt -> repaired: the transfer itself, and before it the replacement's start-up or a
    survivor's wait for it."""
    ro = rd.round
    rebuilt, repaired = marks.get("rebuilt"), marks.get("repaired")
    ev = rd.recovered.get(rank) or {}
    if rebuilt is None or repaired is None:
        return [("transfer", rebuilt, repaired, moved)]
    took = ev.get("transfer_s")
    received = int(ev.get("transfer_bytes") or 0) > 0
    sent = any(p and p[0] == rank for p in ro.pairs)
    if sent and took:  # a send waits for its receiver to be ready: the transfer is the receipt
        took = min(float(took), _receipt(rd, rank) or float(took))
    if received or (sent and took):
        end = float(marks.get("received") or repaired) if received else float(repaired)
        begin = min(float(repaired), max(float(rebuilt), end - float(took or 0.0)))
    elif ro.pairs and took is not None and not sent:
        begin = float(repaired)  # others moved state: this rank waited at the end of the round
    else:  # its own state restored (no pairs), or an older run that did not say
        begin = float(rebuilt)
    edges: list[Edge] = []
    if begin > rebuilt:
        edges.append(
            ("start-up", rebuilt, begin, _registered(marks))
            if rank in ro.restart_ranks
            else ("wait", rebuilt, begin, "for the state transfer (the replacement's start-up)")
        )
    if repaired > begin or not edges:
        edges.append(("transfer", begin, repaired, moved))
    return edges


def _receipt(rd: RoundData, rank: int) -> float | None:
    """How long the ranks `rank` sent to took to receive (the longest), when they said."""
    took = [
        float((rd.recovered.get(p[1]) or {}).get("transfer_s") or 0.0)
        for p in rd.round.pairs
        if p and p[0] == rank and (rd.recovered.get(p[1]) or {}).get("transfer_bytes")
    ]
    return max(took) if took else None


def _registered(marks: dict) -> str:
    at, rebuilt = marks.get("registered"), marks.get("rebuilt")
    if at is None or rebuilt is None:
        return "the script's start-up until its first step"
    return (
        f"the script's start-up until its first step (model and optimizer registered "
        f"{max(0.0, at - rebuilt):.3f} s after the rebuild)"
    )


def live_phase(bars: list[Bar]) -> str:
    """The phase a running round is in: the earliest phase (in round order) of the ranks' open
    bars, i.e. the one the slowest rank is in and the round waits on; "resume" when every open
    bar has closed (the ranks step again, not all seen yet); "stop" before any rank's bar."""
    running = [b.phase for b in bars if b.open and b.phase in PHASES]
    if running:
        return min(running, key=PHASES.index)
    return "resume" if bars else "stop"
