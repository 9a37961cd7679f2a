"""AgentState: the agent's phase moves and is recorded; a stopping agent stays stopping."""

from __future__ import annotations

from launcher.agent.agent_state import AgentPhase, AgentState
from launcher.observe.logs import AgentLog, read_event_file


class _Nothing:
    """A part the phase bookkeeping never touches."""


def _state(tmp_path) -> AgentState:
    log = AgentLog(0, str(tmp_path / "events.jsonl"), quiet=True)
    nothing = _Nothing()
    return AgentState(nothing, log, "h", nothing, nothing, nothing, nothing)  # type: ignore[arg-type]


def test_phases_are_recorded_and_stopping_is_left_only_for_done(tmp_path) -> None:
    s = _state(tmp_path)
    assert s.phase is AgentPhase.STARTING
    for p in (AgentPhase.JOINING, AgentPhase.ENTERING, AgentPhase.RUNNING, AgentPhase.STOPPING):
        s.enter(p)
    s.enter(AgentPhase.RUNNING)  # a world entered while stopping does not undo the stop
    assert s.phase is AgentPhase.STOPPING
    s.enter(AgentPhase.DONE)
    assert s.phase is AgentPhase.DONE
    s.log.close()
    phases = [
        (e["was"], e["phase"])
        for e in read_event_file(str(tmp_path / "events.jsonl"))
        if e["event"] == "agent-phase"
    ]
    assert phases == [
        ("starting", "joining"),
        ("joining", "entering"),
        ("entering", "running"),
        ("running", "stopping"),
        ("stopping", "done"),
    ]


def test_only_stopping_and_done_are_final() -> None:
    assert {p for p in AgentPhase if p.final} == {AgentPhase.STOPPING, AgentPhase.DONE}
