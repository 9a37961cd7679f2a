"""Who runs the controller (launcher.control.controller_role): the leader on the embedded store, the
elected agent with etcd, and the handoff line when the controller's node is lost."""

from __future__ import annotations

from launcher.control.controller import Controller
from launcher.control.controller_role import ControllerRole
from launcher.control.controller_settings import ControllerSettings
from launcher.observe.logs import AgentLog, read_event_file
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


class FakeElection:
    def __init__(self, on_elected, on_deposed) -> None:
        self.on_elected, self.on_deposed = on_elected, on_deposed
        self.previous: dict | None = None


class FakeStack:
    """What the role uses of launcher.agent.store_stack.StoreStack."""

    def __init__(
        self, can_elect: bool, lost: list[int] | None = None, members: dict[int, int] | None = None
    ) -> None:
        self.can_elect = can_elect
        self._members = {1: 1} if members is None else members
        self.election: FakeElection | None = None
        self._lost = lost or []

    def elect(self, on_elected, on_deposed) -> FakeElection:
        self.election = FakeElection(on_elected, on_deposed)
        return self.election

    def lost_nodes(self) -> list[int]:
        return list(self._lost)

    def members(self) -> dict[int, int]:
        return dict(self._members)

    def why_gone(self, node: int, incarnation: int) -> str:
        return "its lease expired (node crashed or cut off from etcd)"


def _role(tmp_path, stack, built: list, kv=None) -> tuple[ControllerRole, AgentLog]:
    kv = LocalKV() if kv is None else kv
    log = AgentLog(1, str(tmp_path / "events.jsonl"), quiet=True)

    def build() -> Controller:
        c = Controller(
            kv, log, ControllerSettings(2, 2, 3, (P.RESTART_ALL, P.EXIT), phase_timeout=5.0)
        )
        built.append(c)
        return c

    return ControllerRole(log, stack, build, 1, "hostB"), log


def test_embedded_store_the_leader_runs_it_others_never(tmp_path) -> None:
    for leader in (True, False):
        built: list = []
        role, log = _role(tmp_path, FakeStack(can_elect=False), built)
        role.start(is_leader=leader)
        assert (role.controller is not None) is leader and not role.elected
        role.stop()
        assert role.controller is None
        log.close()


def test_etcd_takeover_names_the_lost_node_why_and_who(tmp_path) -> None:
    built: list = []
    stack = FakeStack(can_elect=True, lost=[0])
    role, log = _role(tmp_path, stack, built)
    try:
        role.start(is_leader=False)
        assert role.elected and role.controller is None  # not elected yet
        stack.election.previous = {"group_rank": 0, "incarnation": 1, "host": "hostA"}
        stack.election.on_elected()
        c = role.controller
        assert c is not None and c.lost_nodes == {0}  # known lost: no restart barrier for it
        stack.election.on_deposed()
        assert role.controller is None and not c._thread.is_alive()
    finally:
        role.stop()
        log.close()
    ev = read_event_file(str(tmp_path / "events.jsonl"))
    took = [e for e in ev if e["event"] == "controller-takeover"]
    assert len(took) == 1 and took[0]["lost_node"] == 0 and took[0]["controller"] == 1
    assert took[0]["message"] == (
        "the controller's node 0 (hostA) is lost: its lease expired "
        "(node crashed or cut off from etcd); node 1 (hostB) takes "
        "over as controller (elected)"
    )
    assert any(e["event"] == "controller-deposed" for e in ev)


def test_a_stopped_role_starts_no_controller_on_a_late_election(tmp_path) -> None:
    built: list = []
    stack = FakeStack(can_elect=True)
    role, log = _role(tmp_path, stack, built)
    role.start(is_leader=True)
    role.stop()
    stack.election.on_elected()
    assert role.controller is None and not any(c._thread.is_alive() for c in built)
    log.close()


def test_a_spare_that_took_the_lost_controllers_node_before_the_election_is_reported(
    tmp_path,
) -> None:
    """The hot spare claimed node 0 (incarnation 2) before node 1 was elected: the membership's
    join news found no controller on node 1. On election the new controller sees node 0 held by
    an incarnation its predecessor never accounted for and reports the arrival (one round)."""
    from launcher.control import controller_state as CS

    kv = LocalKV()
    CS.save(kv, CS.SavedState(CS.take_term(kv), 0, known={0: 1, 1: 1}))
    built: list = []
    stack = FakeStack(can_elect=True, lost=[], members={0: 2, 1: 1})
    role, log = _role(tmp_path, stack, built, kv)
    try:
        role.start(is_leader=False)
        stack.election.previous = {"group_rank": 0, "incarnation": 1, "host": "hostA"}
        stack.election.on_elected()
        raw = kv.get(P.fault_key(1), 5.0)
        f = P.Fault.from_json(raw)
        assert f.node == 0 and f.evidence["node_joined"] and f.evidence["incarnation"] == 2
        assert role.controller.note_arrival(0, 2) is None  # the late join news: no second one
        assert kv.try_get(P.FAULT_SEQ) == b"1"
    finally:
        role.stop()
        log.close()
