"""CLI parity with torch's own `torch.distributed.run` parser, derived from its actions."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import pytest
from torch.distributed.run import get_args_parser

from launcher.cli.ftrun import ALL_OPTIONS, COMMAND, parse

SCRIPT = __file__  # any existing file will do as the training script


def torch_actions() -> list[argparse.Action]:
    return [a for a in get_args_parser()._actions if a.option_strings and a.dest != "help"]


def test_every_torchrun_option_spelling_is_accepted() -> None:
    ours = {n: o for o in ALL_OPTIONS for n in o.names}
    for action in torch_actions():
        for name in action.option_strings:
            assert name in ours, f"torchrun option {name} missing from ftrun"
            assert ours[name].dest == action.dest, name


@pytest.mark.parametrize("action", torch_actions(), ids=lambda a: a.dest)
def test_defaults_match_torchrun(action: argparse.Action) -> None:
    ours = parse([SCRIPT])
    theirs = action.default
    if isinstance(theirs, list):
        theirs = list(theirs)
    assert ours[action.dest] == theirs, action.dest


@pytest.mark.parametrize(
    "action",
    [
        a
        for a in torch_actions()
        if a.nargs != 0 and a.type in (int, float, str) and a.choices is None
    ],
    ids=lambda a: a.dest,
)
def test_value_types_match_torchrun(action: argparse.Action) -> None:
    sample = {int: "7", float: "0.25", str: "abc"}[action.type]
    ours = parse([action.option_strings[-1], sample, SCRIPT])
    theirs = get_args_parser().parse_args([action.option_strings[-1], sample, SCRIPT])
    assert ours[action.dest] == getattr(theirs, action.dest)


@pytest.mark.parametrize(
    "action", [a for a in torch_actions() if a.nargs == 0], ids=lambda a: a.dest
)
def test_flags_and_pet_env_fallback(
    action: argparse.Action, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse([action.option_strings[0], SCRIPT])[action.dest] is True
    monkeypatch.setenv("PET_" + action.dest.upper(), "1")
    assert parse([SCRIPT])[action.dest] is True


def test_pet_env_fallback_for_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_MAX_RESTARTS", "4")
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    raw = parse([SCRIPT])
    assert raw["max_restarts"] == 4 and raw["nproc_per_node"] == "3"
    assert parse(["--max_restarts", "1", SCRIPT])["max_restarts"] == 1  # the flag wins


def test_script_args_pass_through_untouched() -> None:
    raw = parse(["--nproc_per_node", "2", SCRIPT, "--nnodes", "5", "-m", "--lr=0.1", "pos"])
    assert raw["training_script"] == SCRIPT
    assert list(raw["training_script_args"]) == ["--nnodes", "5", "-m", "--lr=0.1", "pos"]
    assert raw["nnodes"] == "1:1"


def test_unambiguous_abbreviation_and_equals_form() -> None:
    raw = parse(["--max_restart", "3", "--monitor-interval=0.5", SCRIPT])
    assert raw["max_restarts"] == 3 and raw["monitor_interval"] == 0.5


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "launcher", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--nproc", "2", SCRIPT], "ambiguous option: --nproc"),
        (["--bogus", SCRIPT], "--bogus"),
        (["--nproc_per_node", "0", SCRIPT], "--nproc-per-node: 0"),
        (["--max_restarts", "-1", SCRIPT], "--max-restarts"),
        (["--monitor_interval", "0", SCRIPT], "--monitor-interval"),
        (["/no/such/script.py"], "does not exist"),
        (["--nnodes", "3:2", SCRIPT], "--nnodes"),
        (["--rdzv_backend", "zookeeper", SCRIPT], "--rdzv-backend"),
        (["--redirects", "7", SCRIPT], "--redirects"),
        (["--signals_to_handle", "SIGFOO", SCRIPT], "--signals-to-handle"),
        (["--recover_strategy", "pray", SCRIPT], "--recover-strategy"),
        (["-m", "--no-python", SCRIPT], "--no-python"),
        (
            ["--rdzv_backend", "etcd", "--rdzv_endpoint", "tcp://h:1", SCRIPT],
            "--rdzv-endpoint 'tcp://h:1'",
        ),
        (
            ["--rdzv_backend", "c10d", "--rdzv_endpoint", "::1", "--nnodes", "2", SCRIPT],
            "[addr]:port",
        ),
        ([], "missing training script"),
    ],
)
def test_bad_input_is_one_line_exit_2(args: list[str], needle: str) -> None:
    r = run_cli(*args)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("ftrun: error:") and needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr


def test_port_in_use_is_a_clear_error() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_cli("--nnodes", "1", "--master_port", str(port), SCRIPT)
    assert r.returncode == 2 and f"port {port} is already in use" in r.stderr


def test_help_lists_ftrun_flags() -> None:
    r = run_cli("--help")
    assert r.returncode == 0
    for flag in (
        "--nproc-per-node",
        "--max-restarts",
        "--recover-strategy",
        "--hang-timeout",
        "--enable_tiered_parallel_tcpstore",
    ):
        assert flag in r.stdout


def test_print_completion() -> None:
    r = run_cli("--print-completion", "bash")
    assert r.returncode == 0 and "_FTRUN_COMPLETE" in r.stdout
    assert COMMAND.name == "ftrun"


def _run_python(code: str, timeout: float) -> tuple[subprocess.CompletedProcess, float]:
    """Run `code` in a fresh interpreter; returns its result and how long it took."""
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout
    )
    return res, time.monotonic() - t0


def test_an_exit_that_hangs_is_cut_short_with_the_same_code_and_the_threads_named():
    """run_agent has stopped everything it started; a library thread that is not a daemon must
    not keep the finished agent alive (a job whose agent never exits never ends)."""
    res, took = _run_python(
        "import threading, time, sys\n"
        "from launcher.cli.ftrun import _exit_within\n"
        "threading.Thread(target=time.sleep, args=(60,), name='stuck-library-thread').start()\n"
        "_exit_within(3, 0.5)\n"
        "sys.exit(3)\n",
        timeout=30,
    )
    assert res.returncode == 3, res.stderr
    assert took < 20
    assert (
        "ftrun: exit took longer than 0.5 s" in res.stderr and "stuck-library-thread" in res.stderr
    ), res.stderr


def test_an_exit_that_hangs_in_the_interpreters_finalization_still_ends() -> None:
    """A hang in module teardown (a `__del__`) stops every Python thread, the guard's timer
    too: the process stayed (here 20 s, for good with a lock a left-behind thread holds). Now
    faulthandler's watchdog dumps the stacks and exits 1 after grace + last resort."""
    res, took = _run_python(
        "import sys, time\n"
        "from launcher.cli.ftrun import _exit_within\n"
        "class Stuck:\n"
        "    def __del__(self):\n"
        "        time.sleep(20)\n"
        "stuck_at_teardown = Stuck()\n"
        "_exit_within(0, 0.3, 0.5)\n"
        "sys.exit(0)\n",
        timeout=60,
    )
    assert took < 10, f"took {took:.1f} s"
    assert res.returncode == 1, res.stderr
    assert "Timeout" in res.stderr and "__del__" in res.stderr, res.stderr
