"""The agent's side of the worker channel: what a runtime-aware worker tells its agent.

Owns: `WorkerMessages.on_message(ChannelMessage)`: Hello (the rank uses the runtime: noted in the
store, its death notice watched, the plan executor told), Heartbeat (the hang guard's and the warm
spare's news), FaultReport (a fault the runtime saw: reported to the controller with its evidence,
repeated UCEs on one device from the fault memory), Recovered (the rank resumed after a recovery
round), Imports (the modules the rank had loaded by its start and by its first step: the warm
spares import them too) and Bye (the rank is done with the job); and `on_inject`, an `ftctl inject`
request for a local rank, carried out (`launcher.agent.injections`: on the channel for a runtime
rank, else by signal); an `ftctl pause` (an injection of kind `plan.PAUSE_KIND` for every rank) is
sent to every local runtime-aware rank as `Pause`; a hot switch's order (`plan.SWITCH_KIND`) goes
to launcher.agent.hot_switch, whose new processes' messages are not acted on until they are in
their ranks' places.
"""

from __future__ import annotations

import dataclasses

from launcher.agent.agent_events import InjectEvent
from launcher.agent.agent_state import AgentState
from launcher.agent.injections import carry_out
from launcher.protocol import plan as P
from launcher.protocol.faults import FaultKind
from launcher.protocol.messages import Bye, FaultReport, Heartbeat, Hello, Imports, Pause, Recovered
from launcher.workers.channel import ChannelMessage


class WorkerMessages:
    def __init__(self, state: AgentState) -> None:
        self.state = state

    def on_message(self, ev: ChannelMessage) -> None:
        s, msg = self.state, ev.msg
        if s.executor is not None and s.executor.incoming.holds(ev.pid):
            return  # a hot switch's new process, not in its rank's place yet
        if isinstance(msg, Hello):
            self._on_hello(msg, ev.pid)
        elif isinstance(msg, Heartbeat):
            s.log.observe("heartbeat", **dataclasses.asdict(msg))
            s.hangs.on_heartbeat(msg)
            if s.spawner is not None:
                s.spawner.rank_progressed(
                    msg.rank, msg.committed_step, max(msg.state_bytes, msg.heap_bytes)
                )
        elif isinstance(msg, FaultReport):
            self._on_fault_report(msg, ev.pid)
        elif isinstance(msg, Recovered):
            self._on_recovered(msg)
        elif isinstance(msg, Imports):
            if s.spawner is not None:
                s.spawner.learn_imports(msg.rank, msg.modules, msg.at)
        elif isinstance(msg, Bye):
            s.hangs.on_bye(msg.rank)
            w = s.workers.by_rank(msg.rank)
            if w is not None and w.alive and (ev.pid is None or ev.pid == w.pid):
                w.said_bye = True
                s.mark_finished(w)

    def on_inject(self, ev: InjectEvent) -> None:
        s = self.state
        if ev.injection.kind == P.PAUSE_KIND:  # `ftctl pause`: every local runtime-aware rank
            assert s.channel is not None
            told = [  # not a rank out of the world (a returning process: live grow)
                w.rank
                for w in s.workers.all()
                if w.alive and w.rank in s.workers.aware and w.rank not in s.workers.left
            ]
            for rank in told:
                s.channel.send(rank, Pause())
            s.log.info(
                "pause",
                f"ftctl pause: told local ranks {told} (generation {s.generation})",
                generation=s.generation,
            )
            return
        if ev.injection.kind == P.SWITCH_KIND and s.executor is not None:
            s.executor.incoming.on_order()  # a hot switch started or was abandoned
            return
        w = s.workers.by_rank(ev.injection.rank)
        if w is None:
            return  # another node's rank
        assert s.channel is not None
        carry_out(ev.injection, w, w.rank in s.workers.aware, s.channel.send, s.log)

    def _on_recovered(self, msg: Recovered) -> None:
        s = self.state
        if s.spawner is not None:
            s.spawner.rank_recovered(msg.rank, msg.generation, msg.resume_step)
        if s.executor is not None:
            s.executor.returning.recovered(msg.rank)  # a live grow's rank is back
        s.log.info(
            "rank-recovered",
            f"rank {msg.rank} resumed generation {msg.generation} at step {msg.resume_step}",
            rank=msg.rank,
            generation=msg.generation,
            resume_step=msg.resume_step,
            action=msg.action,
            replacement=msg.replacement,
            marks=msg.marks,
            transfer_bytes=msg.transfer_bytes,
            transfer_s=msg.transfer_s,
            source=msg.source,
            transfer_path=msg.transfer_path,
            **msg.timings,
        )

    def _on_hello(self, msg: Hello, pid: int | None) -> None:
        s = self.state
        assert s.loop_store is not None and s.executor is not None
        if msg.rank not in s.workers.aware:
            s.workers.aware.add(msg.rank)
            s.loop_store.put(P.aware_key(msg.rank), b"1")
        s.log.info(
            "hello", f"rank {msg.rank} (pid {pid}) uses the ftrun runtime", rank=msg.rank, pid=pid
        )
        self._watch_death(msg, pid)
        s.executor.on_hello(msg.rank, msg.generation)

    def _watch_death(self, msg: Hello, pid: int | None) -> None:
        """The rank holds its death-notice slot: report its exit the moment it starts dying."""
        s = self.state
        w = s.workers.by_rank(msg.rank)
        if (
            not msg.notice_tid
            or w is None
            or not w.notice
            or w.proc is None
            or pid != w.pid
            or s.notices is None
            or s.reaper is None
        ):
            return
        proc, reaper = w.proc, s.reaper
        s.notices.watch(
            w.notice, w.proc.pid, msg.notice_tid, lambda code: reaper.announce(w, proc, code)
        )

    def _on_fault_report(self, msg: FaultReport, pid: int | None) -> None:
        s = self.state
        assert s.world is not None
        kind = FaultKind.parse(msg.kind)
        s.log.error(
            "worker-fault",
            f"rank {msg.rank} reports {kind.value}"
            + (" [injected]" if msg.injected else "")
            + f": {msg.message}",
            rank=msg.rank,
            fault_kind=kind.value,
            injected=msg.injected,
            step=msg.step,
        )
        w = s.workers.by_rank(msg.rank)
        evidence: dict = {
            "step": msg.step,
            "phase": msg.phase,
            "finished_ranks": s.workers.finished(),
        }
        if msg.collective:
            evidence["collective"] = msg.collective  # possibly a consequence: the controller blames
        if kind in (FaultKind.UCE_LOW, FaultKind.UCE_HIGH) and w is not None:
            evidence.update(s.fault_memory.record_uce_evidence(f"{s.host}:{w.local_rank}"))
            if evidence["repeat_uce"]:
                s.log.warning(
                    "uce-repeat",
                    f"device {evidence['device']} had "
                    f"{evidence['uce_count_24h']} UCEs within 24 h: no more in-place "
                    "retries on it",
                    rank=msg.rank,
                    device=evidence["device"],
                )
        s.report(
            P.Fault(
                kind=kind.value,
                rank=msg.rank,
                node=s.the_world().group_rank,
                generation=msg.generation if msg.generation >= 0 else s.generation,
                message=msg.message,
                pid=pid,
                local_rank=w.local_rank if w else None,
                host=s.host,
                injected=msg.injected,
                evidence=evidence,
            )
        )
