"""Error files and the failure summary: root cause first, bystanders apart."""
from __future__ import annotations

import json

from launcher.errors import (Failure, copy_root_error_file, failure_from_exit, format_summary,
                             read_error_file, root_cause)


def write_error(path, msg: str, ts: float) -> None:
    path.write_text(json.dumps({"message": {"message": msg, "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n  ...\n{msg}", "timestamp": str(int(ts))}}}))


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
    root = text[text.index("Root Cause"):text.index("Other Failures")]
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
