"""Helpers for tests that run `ftrun` (python -m launcher) and `torchrun` as real processes."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

from helpers_ports import free_port  # noqa: F401  (re-exported for the tests)

from launcher.observe.logs import read_events as events  # noqa: F401  (re-exported for the tests)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "tests", "scripts")
FTRUN = [sys.executable, "-m", "launcher"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


def env_with(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def spawned_pids(evs: list[dict]) -> dict[int, list[int]]:
    """rank -> the pid of each process that ran as the rank, in order, from `spawn` events. A
    warm spare that overtook a cold replacement still starting (`overtook`: that process's pid)
    takes its place in the list: the rank was restarted once, as ftrun counts it."""
    pids: dict[int, list[int]] = {}
    for e in evs:
        if e["event"] != "spawn":
            continue
        ranks = pids.setdefault(e["rank"], [])
        if e.get("overtook") and ranks and ranks[-1] == e["overtook"]:
            ranks[-1] = e["pid"]
        else:
            ranks.append(e["pid"])
    return pids


def run(
    cmd: list[str], env: dict[str, str] | None = None, timeout: float = 120, cwd: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, env=env or env_with(), capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO
    )


def communicate_all(procs, timeout: float):
    """Every process's (stdout, stderr) once all exited, read concurrently: one agent whose pipe
    fills is never blocked while another is waited for, as it was with `communicate()` called
    on one after the other. `procs`: a list (returns a list in its order) or a dict (a dict).
    Past `timeout` s the processes still running get SIGTERM (an agent's shutdown logs where it
    was, and its exit guard dumps every thread's stack when the shutdown itself hangs), SIGKILL
    20 s later, and the test fails with the end of every process's stderr (a CI failure of a
    multi-agent test once showed six lines of one agent and nothing of the other)."""
    import signal
    import threading

    named = dict(procs) if isinstance(procs, dict) else dict(enumerate(procs))
    outs: dict = {}
    late: list = []

    def drain(tag, p: subprocess.Popen) -> None:
        try:
            outs[tag] = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            late.append(tag)

    threads = [threading.Thread(target=drain, args=(t, p)) for t, p in named.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    if late:
        for t in late:
            named[t].send_signal(signal.SIGTERM)
        for t in late:
            try:
                outs[t] = named[t].communicate(timeout=20)
            except subprocess.TimeoutExpired:
                named[t].kill()
                outs[t] = named[t].communicate(timeout=30)
        tails = "\n".join(
            f"--- process {t} (exit {named[t].returncode}), stderr's end:\n"
            f"{(outs[t][1] or '')[-6000:]}"
            for t in named
        )
        raise AssertionError(f"processes {sorted(late)} still running after {timeout:g} s\n{tails}")
    if isinstance(procs, dict):
        return {t: outs[t] for t in named}
    return [outs[t] for t in named]


FAILED_TAIL_LINES = 40


def _tail(path: str, lines: int) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return "\n".join(text.rstrip().splitlines()[-lines:])


def failed_worker_logs(log_dir: str, lines: int = FAILED_TAIL_LINES) -> str:
    """What each worker that failed in the ftrun job(s) under `log_dir` (the --log_dir base)
    said last: for every `worker-failed` event, the last `lines` lines of that process's
    stderr.log (`--tee 2` / `--redirects 2`; else its stderr went to the console) and its
    error.json, if any. "" when no worker failed. For assertion messages: the cause of a
    failure shows in the next CI log."""
    try:
        evs = events(log_dir)
    except (OSError, ValueError) as e:
        return f"(no events under {log_dir}: {e})"
    spawns = {(e.get("node"), e.get("pid")): e for e in evs if e["event"] == "spawn"}
    out: list[str] = []
    for e in evs:
        if e["event"] != "worker-failed":
            continue
        sp = spawns.get((e.get("node"), e.get("pid")), {})
        gen, local = sp.get("generation", e.get("generation", 0)), sp.get("local_rank")
        head = (
            f"--- rank {e.get('rank')} (pid {e.get('pid')}, node {e.get('node')}, generation "
            f"{gen}) failed: {e.get('message', '')}"
        )
        dirs = (
            []
            if local is None
            else sorted(glob.glob(os.path.join(log_dir, "*", f"attempt_{gen}", str(local))))
        )
        err = e.get("stderr_file") or next(
            (
                os.path.join(d, "stderr.log")
                for d in dirs
                if os.path.isfile(os.path.join(d, "stderr.log"))
            ),
            "",
        )
        tail = _tail(err, lines) if err else None
        out.append(head)
        out.append(
            f"last {lines} lines of {err}:\n{tail}"
            if tail is not None
            else "no stderr.log (the job ran without --tee 2/--redirects 2: its stderr is in "
            "the job's output)"
        )
        for d in dirs:
            ej = _tail(os.path.join(d, "error.json"), lines)
            if ej is not None:
                out.append(f"{os.path.join(d, 'error.json')}:\n{ej}")
    return "\n".join(out)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def wait_for_files(pattern: str, n: int, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(glob.glob(pattern))
        if len(found) >= n:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"expected {n} files matching {pattern}, found {sorted(glob.glob(pattern))}")
