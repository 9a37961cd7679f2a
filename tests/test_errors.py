"""Error files and the failure summary: root cause first, bystanders apart."""

from __future__ import annotations

import json

from launcher.agent.errors import (
    Failure,
    JobFailures,
    copy_root_error_file,
    failure_from_exit,
    format_summary,
    read_error_file,
    root_cause,
    stderr_cause,
    stderr_last_words,
)
from launcher.protocol import plan as P


def write_error(path, msg: str, ts: float) -> None:
    path.write_text(
        json.dumps(
            {
                "message": {
                    "message": msg,
                    "extraInfo": {
                        "py_callstack": f"Traceback (most recent call last):\n  ...\n{msg}",
                        "timestamp": str(int(ts)),
                    },
                }
            }
        )
    )


def test_read_error_file_and_failure(tmp_path) -> None:
    ef = tmp_path / "error.json"
    write_error(ef, "RuntimeError: boom", 100.0)
    assert read_error_file(str(ef))[0] == "RuntimeError: boom"
    f = failure_from_exit(1, 1, "h", 42, 1, 200.0, 0, 0, str(ef))
    assert f.time == 100.0 and f.message == "RuntimeError: boom" and f.error_file == str(ef)
    g = failure_from_exit(2, 0, "h", 43, -9, 150.0, 0, 0, str(tmp_path / "none.json"))
    assert g.signal == "SIGKILL" and "Signal 9 (SIGKILL)" in g.message and g.error_file == ""


def test_root_cause_is_the_earliest_and_printed_first() -> None:
    late = Failure(0, 0, "h", 10, 1, 200.0, 0, message="late")
    early = Failure(3, 1, "h", 11, -9, 100.0, 0, message="Signal 9 (SIGKILL) received by PID 11")
    assert root_cause([late, early]) is early
    text = format_summary("train.py", [late, early], [(1, 12), (2, 13)], reason="budget spent")
    root = text[text.index("Root Cause") : text.index("Other Failures")]
    assert "rank      : 3" in root and "(SIGKILL)" in root
    assert "Terminated by ftrun (not failures): rank 1 (pid 12), rank 2 (pid 13)" in text
    assert text.splitlines()[0] == "=" * 60 and "reason: budget spent" in text


def test_no_other_failures_marker() -> None:
    text = format_summary("x.py", [Failure(0, 0, "h", 1, 3, 1.0, 0, message="m")], [])
    assert "<NO_OTHER_FAILURES>" in text and "Terminated" not in text


def test_copy_root_error_file_is_atomic_and_sets_error_code(tmp_path) -> None:
    ef = tmp_path / "child.json"
    write_error(ef, "ValueError: x", 5.0)
    f = failure_from_exit(0, 0, "h", 1, 7, 6.0, 0, 0, str(ef))
    dest = tmp_path / "parent" / "error.json"
    assert copy_root_error_file(f, str(dest))
    data = json.loads(dest.read_text())
    assert data["message"]["errorCode"] == 7 and data["message"]["message"] == "ValueError: x"
    assert sorted(p.name for p in dest.parent.iterdir()) == ["error.json"]
    assert not copy_root_error_file(f, None)


HISTORY = [
    {
        "rank": 2,
        "kind": "uce-low",
        "node": 0,
        "pid": 22,
        "message": "injected uce-low",
        "injected": True,
        "handling": [["retry", 1]],
        "outcome": "recovered",
        "consequences": 0,
    },
    {
        "rank": 0,
        "kind": "signal",
        "node": 0,
        "pid": 20,
        "message": "Signal 9",
        "injected": False,
        "handling": [["recover-in-place", 2]],
        "outcome": "recovered",
        "consequences": 0,
    },
    {
        "rank": 1,
        "kind": "hang",
        "node": 0,
        "pid": 21,
        "message": "rank 1 hangs",
        "injected": False,
        "handling": [["recover-in-place", 3], ["restart-all", 3], ["exit", 4]],
        "outcome": "failed: restart budget spent",
        "consequences": 3,
    },
]


def test_the_root_cause_is_the_fault_whose_handling_failed_and_earlier_faults_are_history() -> None:
    jf = JobFailures()
    jf.add(
        Failure(0, 0, "h", 20, -9, 50.0, 1, node=0, kind="signal", message="Signal 9")
    )  # recovered
    jf.add(Failure(1, 1, "h", 21, -9, 90.0, 3, node=0, kind="hang", message="hung: stopped"))
    jf.add(Failure(3, 3, "h", 23, 1, 95.0, 3, node=0, message="exited with code 1"))
    plan = P.Plan(
        4,
        P.EXIT,
        [1],
        [],
        "budget spent",
        history=HISTORY,
        root_cause={
            "kind": "hang",
            "rank": 1,
            "node": 0,
            "generation": 3,
            "pid": 21,
            "time": 89.0,
            "message": "rank 1 hangs",
        },
    )
    jf.note_plan(plan)
    root, failures, _ = jf.for_summary()
    assert root is not None and (root.rank, root.kind, root.time) == (1, "hang", 89.0)
    text = format_summary("train.py", failures, [], "budget spent", root, jf.history)
    head = text[text.index("Root Cause") : text.index("Earlier faults")]
    assert "(the fault whose handling failed)" in head and "rank      : 1" in head
    assert (
        "handling  : recover-in-place (gen 3) -> restart-all (gen 3) -> exit (gen 4): "
        "failed: restart budget spent"
    ) in head
    hist = text[text.index("Earlier faults") : text.index("Other Failures")]
    assert (
        "rank 2 uce-low [injected] on node 0: injected uce-low -> retry (gen 1): recovered" in hist
    )
    assert "rank 0 signal" in hist
    other = text[text.index("Other Failures") :]
    assert "rank      : 3" in other and "rank      : 0" not in other  # rank 0 is history


def test_a_root_cause_seen_on_another_node_is_summarised_from_the_plan() -> None:
    jf = JobFailures()
    jf.note_plan(
        P.Plan(
            2,
            P.EXIT,
            [5],
            [],
            "r",
            history=HISTORY[2:],
            root_cause={
                "kind": "hang",
                "rank": 5,
                "node": 1,
                "generation": 1,
                "pid": 55,
                "time": 10.0,
                "message": "rank 5 hangs",
                "host": "other",
            },
        )
    )
    root, failures, _ = jf.for_summary()
    assert root is not None and root.rank == 5 and root in failures and root.host == "other"


def test_a_signal_death_points_at_the_ranks_stderr_file_and_shows_its_end() -> None:
    f = Failure(
        1,
        1,
        "h",
        42,
        -6,
        100.0,
        0,
        node=0,
        kind="signal",
        message="Signal 6 (SIGABRT) received by PID 42",
        stderr_file="/logs/attempt_0/1/stderr.log",
        traceback="last 1 lines of /logs/attempt_0/1/stderr.log:\nterminate called after throwing",
    )
    text = format_summary("train.py", [f], [])
    assert "  exitcode  : -6 (pid: 42)  (SIGABRT)" in text
    assert "  stderr    : /logs/attempt_0/1/stderr.log" in text
    assert (
        "    terminate called after throwing" in text and "message   : Signal 6 (SIGABRT)" in text
    )
    # seen on another node: the controller's root cause carries the file in its evidence
    jf = JobFailures()
    jf.note_plan(
        P.Plan(
            2,
            P.EXIT,
            [1],
            [],
            "r",
            root_cause={
                "kind": "signal",
                "rank": 1,
                "node": 1,
                "generation": 0,
                "pid": 42,
                "time": 10.0,
                "message": "Signal 6 (SIGABRT) received by PID 42",
                "host": "other",
                "evidence": {
                    "stderr_file": "/logs/attempt_0/1/stderr.log",
                    "traceback": "terminate",
                },
            },
        )
    )
    root, _, _ = jf.for_summary()
    assert root is not None and root.stderr_file == "/logs/attempt_0/1/stderr.log"
    assert "  stderr    : /logs/attempt_0/1/stderr.log" in format_summary(
        "t.py", [root], [], root=root
    )


_DUMP = (
    "Fatal Python error: Aborted\n\nThread 0x00007f (most recent call first):\n"
    + "".join(f'  File "/x/mod{i}.py", line {i} in f{i}\n' for i in range(30))
    + "\nExtension modules: numpy.core._multiarray_umath, torch._C (total: 2)\n"
)


def test_a_stderr_ending_in_pythons_fatal_error_dump_keeps_the_cause_before_it() -> None:
    """faulthandler's dump (every thread's stack, the module list) is longer than the lines a
    failure keeps: the line that says why (here torch's C++ terminate) comes first, then the
    dump's head, not the module list. Without a dump: the last lines, as before."""
    tail = "step 3 done\nterminate called without an active exception\n" + _DUMP
    words = stderr_last_words(tail, 20)
    assert len(words) == 20 and words[:2] == [
        "step 3 done",
        "terminate called without an active exception",
    ]
    assert words[2] == "Fatal Python error: Aborted" and "Extension modules" not in "\n".join(words)
    assert stderr_cause(tail) == "terminate called without an active exception"
    plain = "".join(f"line {i}\n" for i in range(30))
    assert stderr_last_words(plain, 20) == [f"line {i}" for i in range(10, 30)]
    assert stderr_cause(plain) == "line 29" and stderr_cause("") == ""
    short = "boom\nFatal Python error: Aborted\n\nCurrent thread 0x1 (most recent call first):\n"
    assert stderr_last_words(short, 20) == short.rstrip().splitlines()  # a short dump: all of it
    assert stderr_cause(_DUMP) == "Fatal Python error: Aborted"  # nothing before it
