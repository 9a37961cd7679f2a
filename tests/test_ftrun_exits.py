"""launcher/observe/ftrun_exits.py: a replacement that an older ftrun ended because its skipped
random init could not be proven harmless (it printed why on stderr and exited 1) is shown by
`ftctl status` and `ftctl report` as ftrun's doing, not as the script's exit; today's runtime
never exits for it (tests/test_runtime_skip_init.py)."""

from __future__ import annotations

import json

from helpers_observe import event_at, ftctl

T = 1_700_000_000.0
OLD_LINE = (
    "[ftrun rank 1] skipped random parameter inits cannot be proven harmless: random numbers "
    "were drawn after a skipped init, before the state arrived; exiting so that a new "
    "replacement inits normally (FTRUN_SKIP_INIT=0 turns the skip off)\n"
)


def ev(t: float, name: str, generation: int = 0, **fields) -> dict:
    return event_at(T + t, name, generation, **fields)


def older_run(tmp_path, said: str):
    run = tmp_path / "run"
    stderr = run / "attempt_1" / "1" / "stderr.log"
    stderr.parent.mkdir(parents=True)
    stderr.write_text("loading...\n" + said)
    events = [
        ev(0, "start", config={"rdzv_id": "old", "max_restarts": 3, "max_nodes": 1}),
        ev(0.1, "rendezvous", group_rank=0, world_size=2),
        *[ev(0.2, "spawn", rank=r, local_rank=r, pid=10 + r) for r in (0, 1)],
        ev(
            2.0,
            "worker-failed",
            rank=1,
            pid=11,
            exitcode=-9,
            signal="SIGKILL",
            fault_kind="signal",
            message="rank 1 (pid 11) signal: SIGKILL",
        ),
        ev(2.1, "decide", rank=1, fault_kind="signal", strategy="recover-in-place", reason="r"),
        ev(2.2, "plan", 1, strategy="recover-in-place", failed_ranks=[1], restart_ranks=[1]),
        ev(2.3, "spawn", 1, rank=1, local_rank=1, pid=21, replacement=True),
        ev(
            5.0,
            "worker-failed",
            1,
            rank=1,
            pid=21,
            exitcode=1,
            fault_kind="exit",
            stderr_file=str(stderr),
            message="rank 1 (pid 21) exit: exited with code 1 (no error "
            "file: decorate main with torch.distributed.elastic.multiprocessing.errors.record)",
        ),
        ev(5.1, "round-superseded", 1, message="rank 1 failed during recovery"),
        ev(5.2, "plan", 2, strategy="recover-in-place", failed_ranks=[1], restart_ranks=[1]),
        *[ev(9.0, "rank-resumed", 2, rank=r, step=3) for r in (0, 1)],
        ev(12.0, "job-done"),
    ]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run


def test_an_older_replacements_skip_init_exit_is_told_as_ftruns_doing(tmp_path):
    run = older_run(tmp_path, OLD_LINE)
    res = ftctl("status", "--json", str(run))
    assert res.returncode == 0, res.stderr
    first, second = json.loads(res.stdout)["faults"]
    assert first["cause"] == "" and second["cause"].startswith("the replacement's check")
    assert second["summary"].startswith(
        "rank 1's process was ended by ftrun itself, not by the script: the replacement's check "
        "of its skipped random init failed"
    )
    assert "exited with code" not in second["summary"]
    screen = ftctl("status", str(run))
    assert "exit (ftrun)" in screen.stdout and "ended by ftrun itself" in screen.stdout
    out = tmp_path / "report.html"
    assert ftctl("report", str(run), "-o", str(out)).returncode == 0
    page = out.read_text()
    assert "<td>exit (by ftrun)</td>" in page and "ended by ftrun itself, not by the script" in page


def test_a_scripts_own_exit_stays_the_scripts(tmp_path):
    run = older_run(tmp_path, "Traceback (most recent call last):\nValueError: bad batch\n")
    res = ftctl("status", "--json", str(run))
    second = json.loads(res.stdout)["faults"][1]
    assert second["cause"] == "" and second["summary"].startswith(
        "rank 1's process exited with code 1"
    )
