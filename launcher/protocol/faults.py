"""The fault taxonomy: every kind of fault ftrun tells apart, and the kinds that can be injected.

Owns: `FaultKind` (shared by agents, controller, the in-worker runtime and the logs), the kinds a
worker reports itself, the kinds after which the process stays alive (`IN_PLACE_KINDS`), and the
injection kinds of `ftctl inject` and `FTRUN_FAULT_PLAN`. Pure data: the runtime imports it, so
nothing here imports agent code. Which strategy handles which kind is `launcher.control.decision`'s.
"""

from __future__ import annotations

import enum


class FaultKind(str, enum.Enum):
    EXIT = "exit"  # process exited with a non-zero code
    SIGNAL = "signal"  # process killed by a signal
    HANG = "hang"  # no progress for --hang-timeout
    UCE_LOW = "uce-low"  # uncorrectable memory error, memory reusable: repair in place
    UCE_HIGH = "uce-high"  # uncorrectable memory error, state objects must be rebuilt
    NETWORK = "network"  # collective/link error, retryable
    UNSAFE_DATA = "unsafe-data"  # access to data marked unsafe after a fault
    EXCEPTION = "exception"  # any other exception reported by the runtime
    NODE_LOST = "node-lost"  # a node's agent is gone (lease expired, no heartbeat, left by signal)
    UNKNOWN = "unknown"

    @classmethod
    def parse(cls, raw: object) -> "FaultKind":
        """A kind from the wire; anything not in the taxonomy is UNKNOWN."""
        try:
            return cls(raw)
        except ValueError:
            return cls.UNKNOWN


# Kinds a runtime-aware worker reports itself (the agent sees exit, signal and hang).
WORKER_FAULT_KINDS: tuple[str, ...] = tuple(
    k.value
    for k in (
        FaultKind.UCE_LOW,
        FaultKind.UCE_HIGH,
        FaultKind.NETWORK,
        FaultKind.UNSAFE_DATA,
        FaultKind.EXCEPTION,
    )
)

# Faults after which the process itself is healthy and can stay (no restart needed).
IN_PLACE_KINDS = frozenset(
    {FaultKind.UCE_LOW, FaultKind.UCE_HIGH, FaultKind.NETWORK, FaultKind.UNSAFE_DATA}
)

# Injections. Signal injections the agent performs itself on any worker (a real SIGKILL, SIGSEGV,
# or SIGSTOP for a hang); process injections a runtime-aware worker performs on itself at a
# chosen step; every worker-reported kind is raised inside the worker as an injected fault.
SIGNAL_INJECTIONS: tuple[str, ...] = ("kill", "segv", "hang")
# stuck-wait: blocked as if inside a collective a recovery stop cannot break (it tells the agent
# it waits on its peers and ignores stops): the rank the agent's stop-answer rule kills.
PROCESS_INJECTIONS: tuple[str, ...] = ("kill", "segv", "exit", "hang", "stuck-wait")
INJECTION_KINDS: tuple[str, ...] = PROCESS_INJECTIONS + WORKER_FAULT_KINDS
# Kinds only the runtime can produce (an unmodified worker has no one to raise them).
RUNTIME_INJECTIONS = frozenset(INJECTION_KINDS) - frozenset(SIGNAL_INJECTIONS)

# Process states (/proc/<pid>/stat) in which a process counts as hung once it stops progressing.
FROZEN_STATES = {
    "T": "stopped (SIGSTOP, state T)",
    "t": "stopped by a tracer (state t)",
    "D": "stuck in the kernel (uninterruptible sleep, state D)",
}

# What a backend prints when a collective failed because of a peer (a peer that hangs or died):
# the exit of a worker that says so may be a consequence of another rank's fault.
COLLECTIVE_FAILURE_TEXT = (
    ("timed out waiting", "gloo collective timeout"),
    ("watchdog caught collective operation timeout", "NCCL collective timeout"),
    ("collective operation timeout", "collective timeout"),
    ("connection closed by peer", "peer connection closed"),
    ("connection reset by peer", "peer connection reset"),
)


def collective_failure(text: str) -> str:
    """The collective failure a worker's last output or error file reports ("" when none)."""
    low = text.lower()
    return next((what for needle, what in COLLECTIVE_FAILURE_TEXT if needle in low), "")
