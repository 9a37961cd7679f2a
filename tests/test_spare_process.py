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


_RUN_JOB = """
import faulthandler, json, os, sys
from launcher.workers.spare_process import run_job
faulthandler.enable()  # as the fork server has it (PYTHONFAULTHANDLER=1 in its environment)
os.environ["SERVER_ONLY"] = "1"
job = json.loads(sys.argv[1])
run_job(job)
"""


def test_a_job_runs_with_exactly_its_environment_and_faulthandler_as_it_says(tmp_path) -> None:
    """A forked rank did not start an interpreter: `run_job` makes the assignment's environment
    the whole environment (os.environ, os.environb and the C library's, which torch reads),
    adds the `exec` mark only when asked (a rank's first start: no), and turns faulthandler on
    or off as PYTHONFAULTHANDLER in it says (a hung unmodified rank dumps its stacks on
    SIGABRT)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "out.json"
    script = tmp_path / "job.py"
    script.write_text(
        "import ctypes, faulthandler, json, os, sys\n"
        "libc = ctypes.CDLL(None); libc.getenv.restype = ctypes.c_char_p\n"
        "c = {n: (libc.getenv(n.encode()) or b'').decode() for n in ('A', 'SERVER_ONLY')}\n"
        "envb = {os.fsdecode(k): os.fsdecode(v) for k, v in os.environb.items()}\n"
        "json.dump({'env': dict(os.environ), 'envb': envb, 'c': c,\n"
        "           'fh': faulthandler.is_enabled()}, open(sys.argv[1], 'w'))\n"
    )
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for fh, mark in (("1", False), ("", True)):
        env = {"A": "x", "PATH": os.environ["PATH"]}
        if fh:
            env["PYTHONFAULTHANDLER"] = fh
        job = {
            "env": env,
            "argv": [str(script), str(out)],
            "cwd": str(tmp_path),
            "module": False,
            "nice": None,
        }
        if not mark:
            job["exec_mark"] = False
        subprocess.run(
            [sys.executable, "-c", _RUN_JOB, json.dumps(job)],
            check=True,
            timeout=60,
            env=dict(os.environ, PYTHONPATH=repo),
        )
        res = json.loads(out.read_text())
        want = dict(env, FTRUN_EXEC_TIME=res["env"].get("FTRUN_EXEC_TIME", "")) if mark else env
        assert res["env"] == want and res["envb"] == want
        assert ("FTRUN_EXEC_TIME" in res["env"]) is mark
        assert res["c"] == {"A": "x", "SERVER_ONLY": ""}  # what getenv(3) sees: the job's
        assert res["fh"] is bool(fh)
