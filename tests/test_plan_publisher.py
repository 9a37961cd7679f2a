"""launcher.control.plan_publisher: the `plan` event is logged as soon as the plan key is
written (the agents can read it), before the writes that follow it (the job's generation, the
controller's saved state), which queue behind the plan's fan-out on a busy store."""

from __future__ import annotations

from launcher.control.controller import Controller
from launcher.control.controller_settings import ControllerSettings
from launcher.control.decision import Decision
from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.store.memory import LocalKV


class OrderLog(AgentLog):
    """Records, at the `plan` event, which of the publish's keys were written."""

    def __init__(self, kv: LocalKV) -> None:
        super().__init__(0, None, quiet=True)
        self.kv = kv
        self.at_plan: dict[str, bool] = {}

    def info(self, kind: str, message: str, **fields) -> None:
        if kind == "plan":
            self.at_plan = {
                "plan": self.kv.try_get(P.plan_key(fields["generation"])) is not None,
                "generation": self.kv.try_get(P.GENERATION_KEY) is not None,
            }
        super().info(kind, message, **fields)


def test_the_plan_event_comes_once_the_plan_is_readable_before_the_later_writes() -> None:
    kv = LocalKV()
    log = OrderLog(kv)
    settings = ControllerSettings(4, 1, 3, (P.RECOVER_IN_PLACE, P.RESTART_ALL))
    c = Controller(kv, log, settings)
    cause = P.Fault(kind="signal", rank=2, node=0, generation=0, message="x")
    d = Decision(P.RECOVER_IN_PLACE, "test", failed_ranks=(2,), restart_ranks=(2,), cause=cause)
    plan = c.publish(d)
    assert log.at_plan == {"plan": True, "generation": False}
    assert kv.try_get(P.GENERATION_KEY) == str(plan.generation).encode()  # written after it
