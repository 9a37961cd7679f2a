"""spare_process: the agent's settings a spare gets in its command line, and its assignment."""

from __future__ import annotations

import json

from launcher.workers.spare_process import NICE_FLAG, job_nice, nice_args, parse_nice


def test_the_priorities_the_agent_writes_are_the_ones_the_spare_reads() -> None:
    args = nice_args(10, 0)
    assert args[0] == NICE_FLAG
    assert parse_nice(args[1]) == (10, 0)
    assert parse_nice(nice_args(-5, -15)[1]) == (-5, -15)


def test_an_assignment_asks_for_its_own_niceness_or_gets_the_agents() -> None:
    assert job_nice(json.dumps({"env": {}, "nice": -10}), 0) == -10
    assert job_nice(json.dumps({"env": {}, "nice": None}), 3) == 3
    assert job_nice(json.dumps({"env": {}}), 3) == 3
    assert job_nice("not json", 5) == 5
    assert job_nice(json.dumps([1, 2]), 5) == 5  # not an object


def test_a_spare_imports_the_listed_modules_and_skips_the_ones_that_fail(tmp_path) -> None:
    """Issue 32, item 4: the job's modules (an `--imports` file) are imported in the spare, the
    script's directory on the path meanwhile; a module that fails is named, never fatal."""
    import json
    import sys

    from launcher.workers.spare_process import (
        failed_line,
        flag_value,
        import_listed,
        read_imports,
        write_imports,
    )

    (tmp_path / "okmod_for_spare.py").write_text("VALUE = 7\n")
    (tmp_path / "badmod_for_spare.py").write_text("raise RuntimeError('broken at import')\n")
    (tmp_path / "exitmod_for_spare.py").write_text("raise SystemExit(3)\n")
    path = str(tmp_path / "imports.json")
    names = ["okmod_for_spare", "badmod_for_spare", "exitmod_for_spare", "no_such_mod_xyz"]
    write_imports(path, names, [str(tmp_path)])
    assert read_imports(path) == (names, [str(tmp_path)])
    assert json.loads(open(path).read())["modules"] == names
    try:
        failed = import_listed(path)
        assert sys.modules["okmod_for_spare"].VALUE == 7
        assert [n for n, _ in failed] == names[1:]
        assert "RuntimeError: broken at import" in failed[0][1]
        assert str(tmp_path) not in sys.path  # the script's directory only while importing
        line = failed_line(failed, "spare pid 1")
        assert "\n" not in line and "3 of the job's modules not imported" in line
    finally:
        for n in names:
            sys.modules.pop(n, None)
    assert read_imports(str(tmp_path / "missing.json")) == ([], [])
    assert flag_value(["--imports", "f", "--nice", "1,0"], "--imports") == "f"
    assert flag_value(["--imports"], "--imports") is None
