"""`ftctl inject` (launcher.cli.inject) against a real store: the request it writes, the checks it
makes before writing, and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from launcher.cli import ftctl
from launcher.protocol import plan as P
from rendezvous.store import auth
from rendezvous.store.server import StoreServer
from tests.helpers_launch import env_with

FTCTL = [sys.executable, "-m", "launcher.cli.ftctl"]
WORLD_SIZE_KEY = "ftrun/world_size"  # published by the agent; inject checks ranks against it


@pytest.fixture
def store():
    with StoreServer(host="127.0.0.1") as s:
        yield s


def inject(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    """The real command line, as a user runs it."""
    return subprocess.run(
        FTCTL + ["inject", *args], capture_output=True, text=True, timeout=60, env=env or env_with()
    )


def inject_here(capsys, *args: str) -> tuple[int, str, str]:
    """The same command in this process (fast): (exit code, stdout, stderr)."""
    try:
        ftctl.main(["inject", *args])
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def requests(s: StoreServer) -> list[P.Injection]:
    raw = s.kv.try_get(P.INJECT_SEQ)
    n = int(raw) if raw is not None else 0
    return [P.Injection.from_json(s.kv.get(P.inject_key(i), 1.0)) for i in range(1, n + 1)]


def test_cli_writes_one_numbered_request_per_call(store: StoreServer) -> None:
    addr = f"127.0.0.1:{store.port}"
    r = inject("--addr", addr, "--rank", "1", "--kind", "kill")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "injection #1: kill into rank 1 now"
    r = inject(
        "--rank",
        "0",
        "--kind",
        "uce-low",
        "--at-step",
        "5",
        "--phase",
        "backward",
        env=env_with(FTRUN_STORE_ADDR=addr),
    )  # --addr from the environment
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "injection #2: uce-low into rank 0 at step 5 (backward)"
    got = [(i.rank, i.kind, i.step, i.phase) for i in requests(store)]
    assert got == [(1, "kill", None, None), (0, "uce-low", 5, "backward")]


def test_at_step_defaults_to_the_forward_phase(store: StoreServer, capsys) -> None:
    code, out, err = inject_here(
        capsys,
        "--addr",
        f"127.0.0.1:{store.port}",
        "--rank",
        "0",
        "--kind",
        "hang",
        "--at-step",
        "0",
    )
    assert code == 0, err
    assert out.strip() == "injection #1: hang into rank 0 at step 0 (forward)"
    assert [(i.step, i.phase) for i in requests(store)] == [(0, None)]


def test_every_kind_is_accepted(store: StoreServer, capsys) -> None:
    kinds = ("kill", "segv", "hang", "exit", "exception", "uce-low", "uce-high", "network")
    for kind in kinds:
        code, _, err = inject_here(
            capsys, "--addr", f"127.0.0.1:{store.port}", "--rank", "0", "--kind", kind
        )
        assert code == 0, err
    assert [i.kind for i in requests(store)] == list(kinds)


def test_rank_outside_the_job_is_refused_and_nothing_written(store: StoreServer, capsys) -> None:
    store.kv.set(WORLD_SIZE_KEY, b"2")
    addr = f"127.0.0.1:{store.port}"
    code, _, err = inject_here(capsys, "--addr", addr, "--rank", "2", "--kind", "kill")
    assert code == 2 and err.strip() == (
        "ftctl: error: Invalid value for --rank: rank 2 is not in this job (world size 2)"
    )
    assert requests(store) == []
    assert inject_here(capsys, "--addr", addr, "--rank", "1", "--kind", "kill")[0] == 0


def publish(s: StoreServer, node: int, t: float, **steps: tuple[int, str]) -> None:
    """A node status as the agent's observer publishes it: `rank<N>=(step, state)`."""
    ranks = [
        {"rank": int(k[4:]), "node": node, "step": step, "state": state}
        for k, (step, state) in steps.items()
    ]
    s.kv.set(
        P.node_status_key(node), json.dumps({"node": node, "time": t, "ranks": ranks}).encode()
    )


def test_a_step_the_rank_already_passed_is_refused_and_nothing_written(
    store: StoreServer, capsys
) -> None:
    publish(store, 0, 100.0, rank0=(101, "training"), rank1=(100, "training"))
    addr = f"127.0.0.1:{store.port}"
    code, out, err = inject_here(
        capsys, "--addr", addr, "--rank", "1", "--kind", "uce-low", "--at-step", "20"
    )
    assert code == 2 and out == "", out
    assert err.strip().splitlines() == [
        "ftctl: error: Invalid value for --at-step: step 20 has already passed: "
        "rank 1 is at step 100"
    ]
    assert requests(store) == []
    for step in ("100", "150"):  # the step it is at (a later phase may still come) and later
        code, out, err = inject_here(
            capsys, "--addr", addr, "--rank", "1", "--kind", "exit", "--at-step", step
        )
        assert code == 0, err
    assert [i.step for i in requests(store)] == [100, 150]


def test_a_step_is_accepted_when_the_ranks_step_is_not_known_or_may_go_back(
    store: StoreServer, capsys
) -> None:
    addr = f"127.0.0.1:{store.port}"
    args = ("--addr", addr, "--kind", "hang", "--at-step", "3")
    assert inject_here(capsys, *args, "--rank", "0")[0] == 0  # no status published yet
    publish(
        store,
        0,
        50.0,
        rank0=(40, "recovering"),  # a restart-all may take it back to a checkpoint
        rank1=(-1, "starting"),
        rank2=(40, "replacement"),
    )
    for rank in ("0", "1", "2", "3"):  # rank 3: not in any status
        code, _, err = inject_here(capsys, *args, "--rank", rank)
        assert code == 0, err
    assert len(requests(store)) == 5


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--rank", "0", "--kind", "kill", "--phase", "forward"], "--phase needs --at-step"),
        (["--rank", "0", "--kind", "melt"], "'melt' is not one of"),
        (["--rank", "-1", "--kind", "kill"], "--rank"),
        (["--rank", "0", "--kind", "kill", "--at-step", "-3"], "--at-step"),
        (["--rank", "0", "--kind", "kill", "--at-step", "1", "--phase", "idle"], "--phase"),
        (["--kind", "kill"], "Missing option '--rank'"),
    ],
)
def test_bad_flags_are_one_line_exit_2_before_touching_the_store(
    store: StoreServer, capsys, args: list[str], needle: str
) -> None:
    code, out, err = inject_here(capsys, "--addr", f"127.0.0.1:{store.port}", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and needle in lines[0], err
    assert lines[0].startswith("ftctl: error:")
    assert requests(store) == []


@pytest.mark.parametrize("addr", ["nonsense", "host:", ":5", "h:x"])
def test_bad_address_is_one_line(capsys, addr: str) -> None:
    code, _, err = inject_here(capsys, "--addr", addr, "--rank", "0", "--kind", "kill")
    assert code == 2 and err.strip().endswith("is not HOST:PORT"), err
    assert len(err.strip().splitlines()) == 1


def test_ipv6_address_in_brackets(capsys) -> None:
    try:
        s = StoreServer(host="::1").start()
    except Exception as e:  # pragma: no cover - host without IPv6 loopback
        pytest.skip(f"no IPv6 loopback here: {e}")
    try:
        code, out, err = inject_here(
            capsys, "--addr", f"[::1]:{s.port}", "--rank", "3", "--kind", "segv"
        )
        assert code == 0, err
        assert [(i.rank, i.kind) for i in requests(s)] == [(3, "segv")]
    finally:
        s.stop()


def test_job_token_from_file_or_environment(tmp_path) -> None:
    token = auth.generate_token()
    path = auth.write_token_file(tmp_path / "job.token", token)
    with StoreServer(host="127.0.0.1", token=token) as s:
        addr = f"127.0.0.1:{s.port}"
        env = env_with()
        env.pop(auth.TOKEN_ENV, None)
        r = inject(
            "--addr", addr, "--token-file", str(path), "--rank", "0", "--kind", "kill", env=env
        )
        assert r.returncode == 0, r.stderr
        r = inject(
            "--addr", addr, "--rank", "1", "--kind", "kill", env={**env, auth.TOKEN_ENV: token}
        )
        assert r.returncode == 0, r.stderr
        # without the token the store refuses: one line, no traceback
        r = inject("--addr", addr, "--rank", "0", "--kind", "kill", env=env)
        assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("ftctl: error:") and "token" in lines[0]
        assert [i.rank for i in requests(s)] == [0, 1]
    os.chmod(path, 0o644)  # a token file others can read is refused before connecting
    r = inject("--addr", addr, "--token-file", str(path), "--rank", "0", "--kind", "kill", env=env)
    assert r.returncode == 1 and len(r.stderr.strip().splitlines()) == 1, r.stderr
