"""What the recovery benchmark reads of a running job from outside.

Owns: the job's processes as /proc shows them (`children`, `descendants`, `worker_pids`: the
workers of a script by their RANK, `warm_spares`: ftrun's warm spares once their imports are
done) and the files the benchmark workers write (`read_steps`: one record per completed step,
`read_starts`: when each worker process began its first step).
"""

from __future__ import annotations

import glob
import json
import os
import time


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def warm_spares(root: int) -> list[int] | None:
    """Pids of the job's warm spares (`launcher.workers.spare` descendants of `root`, the fork
    server aside, whose imports are done: main thread asleep waiting for its assignment, in a
    futex wait or a read of its stdin, no CPU time used over 20 ms), None while a spare is still
    warming up or none was started."""
    todo, spares = [root], []
    while todo:
        pid = todo.pop()
        kids = children(pid)
        todo += kids
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/comm", "rb") as f:
                comm = f.read().strip()
            # the fork server (launcher.workers.spare_server, named ftrun-spare-srv) is not a
            # spare; the spares it forked are (they keep its command line)
            if b"launcher.workers.spare" in cmd and comm != b"ftrun-spare-srv":
                spares.append(pid)
        except OSError:
            pass

    def cpu(pid: int) -> tuple[int, str] | None:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/syscall", encoding="ascii") as f:
                nr = f.read().split()[0]
        except (OSError, IndexError):
            return None
        return int(fields[11]) + int(fields[12]), fields[0] + nr

    if not spares:
        return None
    before = [cpu(p) for p in spares]
    time.sleep(0.02)
    after = [cpu(p) for p in spares]
    if any(a is None or a != b or a[1] not in ("S202", "S0") for a, b in zip(after, before)):
        return None
    return spares


def read_steps(out: str) -> dict[int, list[dict]]:
    res: dict[int, list[dict]] = {}
    for path in glob.glob(os.path.join(out, "steps.*.jsonl")):
        rank = int(path.split(".")[-2])
        with open(path, encoding="utf-8") as f:
            res[rank] = [json.loads(line) for line in f if line.strip()]
    return res


def descendants(root: int) -> list[int]:
    """Every process below `root` (children, their children, ...)."""
    todo, out = [root], []
    while todo:
        kids = children(todo.pop())
        out += kids
        todo += kids
    return out


def worker_pids(root: int, script: str) -> dict[int, int]:
    """{RANK: pid} of the live processes below `root` running `script` (by their command line
    and environment; a process that exits meanwhile is left out)."""
    found: dict[int, int] = {}
    for pid in descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if script.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
        except OSError:
            continue
        if b"RANK" in env:
            found[int(env[b"RANK"])] = pid
    return found


def read_starts(out: str) -> dict[int, dict[int, float]]:
    """{rank: {pid: time}}: when each worker process of the job began its first step."""
    res: dict[int, dict[int, float]] = {}
    for path in glob.glob(os.path.join(out, "starts.*.jsonl")):
        rank = int(path.split(".")[-2])
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    res.setdefault(rank, {})[rec["pid"]] = rec["time"]
    return res
