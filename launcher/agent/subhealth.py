"""A node's sub-health file: a device plugin says a node (or some of its devices) is suspect.

Owns: `SubhealthWatch` (the agent's thread that looks at the file every `POLL_S` seconds),
`parse_subhealth` (its format) and `post_migrate` (one migrate request in the job's store, the
one `ftctl migrate` writes too). The file is named by `--rdzv-conf subhealth_file=PATH` or
`FTRUN_SUBHEALTH_FILE` (launcher.config); each agent watches its own node's. Its format is one
JSON object:

    {"state": "subhealthy", "local_ranks": [1], "reason": "HBM correctable ECC errors rising"}

  state        "subhealthy": move ranks to new processes (a hot switch, launcher.control.
               hot_switch); "healthy" (or no file): nothing
  local_ranks  the node's local ranks (devices) that are suspect; left out or "all": every
               rank of the node
  reason       free text, carried into the switch's lines

Every new content written while the job runs, in the subhealthy state, is one request (the
content found when the agent starts, or the same content written again, is none); a content
that is not this format is one warning line and ignored.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from launcher.observe.logs import AgentLog
from launcher.protocol import plan as P
from rendezvous.kv import KVStore, StoreError

POLL_S = 1.0  # how often the file is looked at
MAX_BYTES = 65536  # a larger file is not a sub-health report
STATES = ("subhealthy", "healthy")


@dataclass(frozen=True)
class Subhealth:
    """One report: the suspect local ranks (None: every rank of the node) and why."""

    local_ranks: tuple[int, ...] | None
    reason: str


def parse_subhealth(text: str, nproc: int) -> tuple[Subhealth | None, str]:
    """The report in `text` (None when the node is healthy) and ""; or None and what is wrong
    with it. `nproc`: the node's ranks (local ranks 0..nproc-1)."""
    try:
        data = json.loads(text)
    except ValueError as e:
        return None, f"not JSON ({e})"
    if not isinstance(data, dict):
        return None, "not a JSON object"
    state = data.get("state")
    if state not in STATES:
        return None, f'"state" is {state!r}; allowed: {", ".join(STATES)}'
    if state == "healthy":
        return None, ""
    reason = str(data.get("reason") or "")
    local = data.get("local_ranks", "all")
    if local == "all":
        return Subhealth(None, reason), ""
    ok = isinstance(local, list) and local and all(type(r) is int for r in local)
    if not ok or not all(0 <= r < nproc for r in local):
        return None, f'"local_ranks" is {local!r}; allowed: "all" or a list of 0..{nproc - 1}'
    return Subhealth(tuple(sorted(set(local))), reason), ""


def post_migrate(kv: KVStore, ranks: list[int], node: int | None, source: str, why: str) -> int:
    """Write one migrate request to the job's store; its number."""
    seq = int(kv.add(P.MIGRATE_SEQ, 1))
    req = P.MigrateRequest(seq=seq, ranks=sorted(set(ranks)), node=node, source=source, why=why)
    kv.set(P.migrate_key(seq), req.to_json())
    return seq


class SubhealthWatch:
    """The agent's look at its node's sub-health file. Owned by the agent: `stop()` ends it."""

    def __init__(
        self, path: str, kv: KVStore, node: int, rank_base: int, nproc: int, log: AgentLog
    ) -> None:
        self.path, self.kv, self.node, self.log = path, kv, node, log
        self.rank_base, self.nproc = rank_base, nproc
        self._text: str | None = None  # the content acted on last
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ftrun-subhealth", daemon=True)

    def start(self) -> None:
        self._text = self._read()  # what is there at the start is not news: a change is
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            self.check()

    def check(self) -> int | None:
        """One look: the request written for a new subhealthy content, else None."""
        text = self._read()
        if text is None or text == self._text:
            return None
        self._text = text
        return self._act(text)

    def _read(self) -> str | None:
        try:
            with open(self.path, "rb") as f:
                return f.read(MAX_BYTES + 1).decode(errors="replace")
        except OSError:
            return None

    def _act(self, text: str) -> int | None:
        report, bad = parse_subhealth(text, self.nproc)
        if bad or len(text) > MAX_BYTES:
            self.log.warning(
                "subhealth", f"sub-health file {self.path}: {bad or 'too large'}; ignored"
            )
            return None
        if report is None:
            return None
        local = report.local_ranks
        ranks = [self.rank_base + r for r in local] if local is not None else []
        node = self.node if local is None else None
        what = f"node {self.node}" if local is None else f"ranks {ranks}"
        why = f"{self.path}: {report.reason or 'subhealthy'}"
        try:
            seq = post_migrate(self.kv, ranks, node, "subhealth", why)
        except StoreError as e:
            self._text = None  # the next look tries again
            self.log.warning("subhealth", f"sub-health of {what}: request not written ({e})")
            return None
        self.log.warning(
            "subhealth",
            f"sub-health file {self.path} says {what} is suspect ({report.reason or 'no reason'}"
            f"): hot switch request #{seq}",
            seq=seq,
            ranks=ranks,
            node=node,
        )
        return seq
