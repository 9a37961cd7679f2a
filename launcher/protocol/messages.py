"""The worker channel's messages: one dataclass per message, shared by the agent and the runtime.

Owns: every message a runtime-aware worker and its node's agent exchange over the Unix socket
(`FTRUN_AGENT_SOCKET`), with its fields, and their encoding: one JSON object per line whose "op"
names the message. `encode()` and `decode()` are the only (de)serialisers, used by both ends
(`launcher.workers.channel` in the agent, `launcher.runtime.channel` in the worker); this
module imports no agent code and no torch.

  worker -> agent  Hello (once, first), Heartbeat (on progress, and every heartbeat interval),
                   FaultReport (a fault the worker detected itself), Recovered (a recovery round
                   completed), Imports (twice, when it joins and at its first committed step: the
                   modules it has loaded, for the warm spares), Bye (the worker finished)
  agent -> worker  Stop (stop for generation g: abort collectives, join the recovery round),
                   Inject (`ftctl inject` forwarded to the worker's fault injector), Pause
                   (`ftctl pause`: halt at the end of an agreed step, launcher.runtime.pause)

The records exchanged through the store (RankStatus, RepairPlan) are `launcher.protocol.plan`'s.

Heartbeat phases: "init" (between init() and the first step), "step", the script's phase names
("forward", "backward", ...), "optimizer", "committed", "checkpoint", "recovering" (inside a
recovery round), "resumed", "paused" (halted between steps by `ftctl pause`), "done". "waiting"
is true while the rank is blocked in a runtime collective (for over 50 ms) or waits for the
agent after a collective failed: it waits on a peer.

Extending: a new message is a dataclass decorated with `@message("op")`; a new field gets a
default, so a message from an older peer still decodes. Unknown fields are ignored; a line that is
not JSON, has an unknown op, lacks a required field or has a field of the wrong type raises
`MessageError`.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, TypeVar, Union

T = TypeVar("T")
MESSAGES: dict[str, type] = {}  # op -> message class


class MessageError(ValueError):
    """A channel line that is not a valid message (the text says what is wrong)."""


def message(op: str) -> Callable[[type[T]], type[T]]:
    """Register a message dataclass under `op`."""

    def register(cls: type[T]) -> type[T]:
        if op in MESSAGES:
            raise ValueError(f"message op {op!r} registered twice")
        cls.op = op  # type: ignore[attr-defined]
        MESSAGES[op] = cls
        return cls

    return register


# ---------------------------------------------------------------- worker -> agent
@message("hello")
@dataclass
class Hello:
    op: ClassVar[str]
    rank: int
    local_rank: int = 0
    pid: int = 0
    generation: int = 0
    replacement: bool = False
    notice_tid: int = 0  # the thread holding its FTRUN_DEATH_NOTICE slot (0: none held)


@message("heartbeat")
@dataclass
class Heartbeat:
    op: ClassVar[str]
    rank: int
    step: int = -1
    phase: str = "init"
    committed_step: int = -1
    waiting: bool = False  # inside a collective, waiting on peers (not hung itself)
    time: float = 0.0
    step_s: float = (
        0.0  # how long the rank's last committed step took, by its own clock (0: none yet)
    )
    state_bytes: int = (
        0  # the bytes of its registered state (a replacement receives as much; 0: unknown)
    )
    # the most its heap grew from its start through its first step (a replacement allocates as
    # much: the heap a spare prepares; launcher.runtime.heap.in_use_bytes; 0: unknown)
    heap_bytes: int = 0
    generation: int = (
        -1
    )  # the generation the rank last entered (its start or a round it joined; -1: unknown)
    stuck: bool = (
        False  # its C++ collective wait outlived the stop's socket shutdown (it will not end)
    )

    def progress(self) -> tuple[int, str, int]:
        """What counts as progress (not mere liveness) for the agent's hang check."""
        return (self.step, self.phase, self.committed_step)


@message("fault")
@dataclass
class FaultReport:
    op: ClassVar[str]
    rank: int
    kind: str  # a launcher.protocol.faults.WORKER_FAULT_KINDS value
    message: str = ""
    step: int = -1
    phase: str = ""
    injected: bool = False
    fatal: bool = False  # the process cannot continue: it exits, the agent restarts it
    generation: int = -1  # the generation the rank was in (-1: unknown, the agent's is used)
    collective: str = ""  # the collective that failed or timed out: possibly a peer's fault


@message("recovered")
@dataclass
class Recovered:
    op: ClassVar[str]
    rank: int
    generation: int
    resume_step: int
    action: str  # "commit" or "rollback"
    replacement: bool = False
    timings: dict[str, float] = field(default_factory=dict)  # <phase>_s -> seconds
    marks: dict[str, float] = field(default_factory=dict)  # round edge -> wall-clock time
    transfer_bytes: int = 0  # state received in this round
    transfer_s: float = 0.0  # time spent sending or receiving state
    source: int | None = None  # the rank the state came from
    transfer_path: str = ""  # how it came: "wire", "memory" (same host), "memory+wire"


FTRUN_PACKAGES = ("launcher", "rendezvous")
RUNTIME_PACKAGE = "launcher.runtime"


def ftrun_module_not_for_spares(name: str) -> bool:
    """ftrun's own modules the spares are not told to import: all but the runtime's. The spares'
    warm-up imports `launcher.runtime.runtime` itself; the runtime modules a job adds (framework
    callbacks, megatron's groups, the routing of torch's collectives, rt.ddp) are reported like
    any library (a megatron-core replacement imported them on the round's critical path: 10.7
    ms here)."""
    if name.split(".", 1)[0] not in FTRUN_PACKAGES:
        return False
    return not (name == RUNTIME_PACKAGE or name.startswith(RUNTIME_PACKAGE + "."))


@message("imports")
@dataclass
class Imports:
    op: ClassVar[str]
    rank: int
    # the modules loaded by the rank's start (`at` "start": the script's top-level imports, told
    # when it joins) or by its first step ("first-step"), in import order: not the standard
    # library's, not the script's own directory's (launcher.runtime.loaded_modules)
    modules: list[str] = field(default_factory=list)
    at: str = "first-step"


@message("bye")
@dataclass
class Bye:
    op: ClassVar[str]
    rank: int


# ---------------------------------------------------------------- agent -> worker
@message("stop")
@dataclass
class Stop:
    op: ClassVar[str]
    generation: int
    strategy: str = ""
    failed_ranks: list[int] = field(default_factory=list)


@message("inject")
@dataclass
class Inject:
    op: ClassVar[str]
    kind: str  # a launcher.protocol.faults.INJECTION_KINDS value
    step: int | None = None  # None: fire at the next phase edge
    phase: str | None = None


@message("pause")
@dataclass
class Pause:
    """`ftctl pause` was asked for: the rank reads the request (`plan.PAUSE_KEY`) from the store
    and halts at the end of the step the ranks agree on (launcher.runtime.pause)."""

    op: ClassVar[str]
    seq: int = 0  # 0: the latest request in the store


Message = Union[Hello, Heartbeat, FaultReport, Recovered, Imports, Bye, Stop, Inject, Pause]


# ---------------------------------------------------------------- encoding
def encode(msg: Any) -> bytes:
    """One message as one line of JSON (newline included)."""
    if MESSAGES.get(getattr(type(msg), "op", None)) is not type(msg):  # type: ignore[arg-type]
        raise TypeError(f"{type(msg).__name__} is not a registered channel message")
    body = {"op": msg.op, **dataclasses.asdict(msg)}
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def decode(line: bytes | str) -> Message:
    """One line (without its newline) back into its message; MessageError when invalid."""
    try:
        data = json.loads(line)
    except ValueError:
        raise MessageError(f"not JSON: {line[:200]!r}") from None
    if not isinstance(data, dict):
        raise MessageError(f"not a JSON object: {line[:200]!r}")
    cls = MESSAGES.get(data.get("op"))  # type: ignore[arg-type]
    if cls is None:
        raise MessageError(f"unknown op {data.get('op')!r}")
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{cls.op} without {f.name!r}")
            continue
        if not _matches(data[f.name], hints[f.name]):
            want = getattr(hints[f.name], "__name__", str(hints[f.name]))
            raise MessageError(f"{cls.op}.{f.name}={data[f.name]!r} is not {want}")
        kwargs[f.name] = data[f.name]
    return cls(**kwargs)


def _matches(value: Any, tp: Any) -> bool:
    """Whether a decoded JSON value fits a field annotation (the few shapes messages use)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is list:
        return isinstance(value, list) and all(_matches(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(
            isinstance(k, str) and _matches(v, args[1]) for k, v in value.items()
        )
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    raise TypeError(f"message field type {tp!r} is not supported by the channel codec")
