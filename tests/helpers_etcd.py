"""Test helper: a real etcd server, and membership agents as real processes.

Owns: starting `/usr/bin/etcd` (Debian etcd-server) on free loopback ports in a temporary data
dir with fast raft timers, waiting until it is healthy, optionally turning on authentication
(root user via `etcdctl`), and stopping it (kill, wait, remove the data dir). Tests use the
`etcd_server` pytest fixture; they are skipped with a clear reason when the binary is missing.

Also owns `AgentProc`: a child process (`python tests/helpers_etcd.py agent ...`) that runs one
`rendezvous.nodes.membership.Membership` over etcd or the embedded TCP store and prints one JSON
line per event (world, dead, join, leader), so tests can SIGKILL real agents.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator

import pytest
from helpers_ports import free_port

ETCD_BIN = os.environ.get("FTRUN_TEST_ETCD", "/usr/bin/etcd")
ETCDCTL_BIN = os.environ.get("FTRUN_TEST_ETCDCTL", "/usr/bin/etcdctl")
START_TIMEOUT = 15.0


def etcd_available() -> bool:
    return os.access(ETCD_BIN, os.X_OK)


@dataclass
class EtcdServer:
    """One etcd process; `endpoint` is "127.0.0.1:<client port>"."""

    data_dir: str
    client_port: int = 0
    peer_port: int = 0
    proc: subprocess.Popen | None = None
    log_path: str = ""
    auth: tuple[str, str] | None = None
    ipv6: bool = False  # also listen on [::1]:client_port
    _log: object | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def endpoint_v6(self) -> str:
        return f"[::1]:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start etcd on fresh free ports and wait until /health says true."""
        last = ""
        for _attempt in range(3):  # a port picked free can be taken before etcd binds it
            self.client_port, self.peer_port = free_port(), free_port()
            shutil.rmtree(os.path.join(self.data_dir, "member-data"), ignore_errors=True)
            if self._launch(timeout):
                return
            last = self._tail()
            self.stop(remove=False)
        raise RuntimeError(f"etcd did not become healthy within {timeout}s: {last}")

    def restart(self, down_for: float = 0.0, timeout: float = START_TIMEOUT) -> None:
        """Kill etcd and start it again on the same ports with the same data."""
        self.stop(remove=False)
        time.sleep(down_for)
        if not self._launch(timeout):
            raise RuntimeError(f"etcd did not come back within {timeout}s: {self._tail()}")

    def _launch(self, timeout: float) -> bool:
        peer = f"http://127.0.0.1:{self.peer_port}"
        listen = self.url + (f",http://[::1]:{self.client_port}" if self.ipv6 else "")
        self.log_path = os.path.join(self.data_dir, "etcd.log")
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                ETCD_BIN,
                "--name",
                "t",
                "--data-dir",
                os.path.join(self.data_dir, "member-data"),
                "--listen-client-urls",
                listen,
                "--advertise-client-urls",
                self.url,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"t={peer}",
                "--log-level",
                "error",
                "--logger",
                "zap",
                "--heartbeat-interval",
                "10",
                "--election-timeout",
                "100",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        return self._wait_healthy(timeout)

    def _wait_healthy(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=0.5) as r:
                    if json.loads(r.read()).get("health") == "true":
                        return True
            except (OSError, ValueError):
                pass
            time.sleep(0.02)
        return False

    def _tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-600:].decode(errors="replace").strip()
        except OSError:
            return ""

    def etcdctl(self, *args: str, timeout: float = 10.0) -> str:
        """Run etcdctl against this server (as root when auth is on)."""
        cmd = [ETCDCTL_BIN, f"--endpoints={self.url}", *args]
        if self.auth is not None:
            cmd.insert(2, f"--user={self.auth[0]}:{self.auth[1]}")
        env = dict(os.environ, ETCDCTL_API="3")
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if res.returncode != 0:
            raise RuntimeError(f"etcdctl {' '.join(args)} failed: {res.stderr.strip()}")
        return res.stdout

    def enable_auth(self, user: str = "root", password: str = "s3cret") -> None:
        """Create `user` with the root role and turn authentication on."""
        self.etcdctl("user", "add", f"{user}:{password}", "--interactive=false")
        if user != "root":
            self.etcdctl("user", "add", "root:" + password, "--interactive=false")
        self.etcdctl("role", "add", "root")
        self.etcdctl("user", "grant-role", user, "root")
        if user != "root":
            self.etcdctl("user", "grant-role", "root", "root")
        self.etcdctl("auth", "enable")
        self.auth = (user, password)

    def stop(self, remove: bool = True) -> None:
        """Kill etcd, wait for it, close its log; remove the data dir when `remove`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - kill -9 does not stall
                pass
        self.proc = None
        if self._log is not None:
            self._log.close()  # type: ignore[attr-defined]
            self._log = None
        if remove:
            shutil.rmtree(self.data_dir, ignore_errors=True)


def start_etcd(ipv6: bool = False) -> EtcdServer:
    """Start a fresh etcd (skips the calling test when the binary is missing)."""
    if not etcd_available():
        pytest.skip(f"etcd binary not found at {ETCD_BIN} (apt-get install etcd-server)")
    server = EtcdServer(data_dir=tempfile.mkdtemp(prefix="ftrun-etcd-"), ipv6=ipv6)
    try:
        server.start()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture
def etcd_server() -> Iterator[EtcdServer]:
    """A running etcd for one test; stopped and removed afterwards."""
    server = start_etcd()
    try:
        yield server
    finally:
        server.stop()


# ----------------------------------------------------------------------------------------------
# Membership agents as real processes

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class AgentProc:
    """One membership agent process; `expect()` returns its next matching JSON event."""

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        node_rank: int | None,
        nnodes: str,
        local_world_size: int = 1,
        hb_interval: float = 0.25,
        hb_timeout: float = 1.5,
        last_call: float = 1.0,
        join_timeout: float = 20.0,
        name: str = "agent",
        rejoin: bool = False,
        hosts_store: bool = False,
        wrap=None,
        base_env: dict[str, str] | None = None,
    ) -> None:
        """`rejoin`: when lost, self-fence, rejoin as a fresh node and try a stale write (see
        `_rejoin_loop`). `wrap(argv)` runs the agent elsewhere (a netns `Host.argv`)."""
        self.name = name
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "agent",
            "--backend",
            backend,
            "--endpoint",
            endpoint,
            "--run-id",
            run_id,
            "--nnodes",
            nnodes,
            "--node-rank",
            "-1" if node_rank is None else str(node_rank),
            "--lws",
            str(local_world_size),
            "--hb-interval",
            str(hb_interval),
            "--hb-timeout",
            str(hb_timeout),
            "--last-call",
            str(last_call),
            "--join-timeout",
            str(join_timeout),
            "--host",
            name,
        ]
        cmd += ["--rejoin"] if rejoin else []
        cmd += ["--hosts-store"] if hosts_store else []
        cmd = wrap(cmd) if wrap is not None else cmd
        env = dict(os.environ if base_env is None else base_env)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            cwd=REPO,
            env=env,
        )
        self.events: queue.Queue = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self.events.put(json.loads(line))
            except ValueError:
                self.events.put({"event": "garbage", "line": line})
        self.events.put({"event": "exit"})

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-2000:]

    def expect(self, event: str, timeout: float, **match: object) -> dict:
        """The next event named `event` (with fields equal to `match`) within `timeout` s."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                ev = self.events.get(timeout=max(0.0, left))
            except queue.Empty:
                raise AssertionError(
                    f"{self.name}: no {event} {match} within {timeout}s; stderr: {self.stderr()}"
                ) from None
            if ev.get("event") == "exit" and event != "exit":
                raise AssertionError(
                    f"{self.name} exited ({self.proc.wait()}) waiting for {event}: {self.stderr()}"
                )
            if ev.get("event") == event and all(ev.get(k) == v for k, v in match.items()):
                return ev

    def term(self) -> float:
        """SIGTERM the agent; return the wall time of the signal."""
        t = time.time()
        self.proc.send_signal(signal.SIGTERM)
        return t

    def kill(self) -> float:
        """SIGKILL the agent; return the wall time of the kill."""
        t = time.time()
        self.proc.kill()
        self.proc.wait(timeout=10)
        return t

    def stop(self) -> None:
        """Graceful: close stdin (the agent leaves and exits); kill if it does not."""
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._err.close()


def _agent_main(argv: list[str]) -> int:
    import argparse
    import logging

    ap = argparse.ArgumentParser(prog="helpers_etcd agent")
    ap.add_argument("--backend", choices=["etcd", "tcp"], required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--nnodes", required=True)
    ap.add_argument("--node-rank", type=int, default=-1)
    ap.add_argument("--lws", type=int, default=1)
    ap.add_argument("--hb-interval", type=float, default=0.25)
    ap.add_argument("--hb-timeout", type=float, default=1.5)
    ap.add_argument("--last-call", type=float, default=1.0)
    ap.add_argument("--join-timeout", type=float, default=20.0)
    ap.add_argument("--host", default="agent")
    ap.add_argument("--rejoin", action="store_true")
    ap.add_argument("--hosts-store", action="store_true")
    a = ap.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(threadName)s %(message)s"
    )
    from helpers_membership import member

    from rendezvous.errors import JoinInterrupted
    from rendezvous.nodes.keys import LEAVE_SIGNAL

    if a.backend == "etcd":
        from rendezvous.store.etcd import EtcdConf, EtcdKV

        kv = EtcdKV(a.endpoint, f"/ftrun/{a.run_id}", EtcdConf(request_timeout=3.0))
    else:
        from rendezvous.store.client import StoreClient

        host, _, port = a.endpoint.rpartition(":")
        kv = StoreClient(host, int(port), timeout=5.0)
    lo, _, hi = a.nnodes.partition(":")
    out_lock = threading.Lock()

    def out(**d: object) -> None:
        with out_lock:
            print(json.dumps(d), flush=True)

    m = member(
        kv,
        None if a.node_rank < 0 else a.node_rank,
        int(lo),
        int(hi or lo),
        a.lws,
        a.host,
        a.run_id,
        join_timeout=a.join_timeout,
        last_call_timeout=a.last_call,
        keep_alive_interval=a.hb_interval,
        heartbeat_timeout=a.hb_timeout,
        read_timeout=5.0,
        hosts_store=a.hosts_store,
    )
    done, termed = threading.Event(), threading.Event()

    def on_term(_sig: int, _frame: object) -> None:  # what an agent does: no I/O here
        termed.set()
        done.set()
        m.interrupt()

    signal.signal(signal.SIGTERM, on_term)
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    out(event="joining", t=time.time())
    try:
        _start(m, out)
    except JoinInterrupted as exc:
        out(event="interrupted", error=str(exc), t=time.time())
        kv.close()
        return 143
    if a.rejoin:
        m = _rejoin_loop(m, out, done)
    else:
        done.wait()  # parent closes stdin (or sends SIGTERM) to stop us
    if termed.is_set():
        m.leave(LEAVE_SIGNAL)
        out(event="left", t=time.time())
    else:
        m.stop()
    kv.close()
    return 143 if termed.is_set() else 0


def _start(m, out) -> None:
    """join, report the world, watch (events as JSON lines)."""
    w = m.join()
    out(
        event="world",
        group_rank=w.group_rank,
        world_size=w.world_size,
        group_world_size=w.group_world_size,
        leader=w.leader_node,
        rejoined=w.rejoined,
        generation=w.generation,
        hosts=[n.host for n in w.nodes],
        incarnation=m.incarnation,
        rank_bases=[n.rank_base for n in w.nodes],
        t=time.time(),
    )
    m.watch_nodes(
        lambda g: out(event="dead", node=g, t=time.time()),
        lambda g: out(event="join", node=g, t=time.time()),
        lambda g: out(event="leader", node=g, t=time.time()),
        lambda lost: out(event="lost", kind=lost.kind, t=time.time()),
    )


def _rejoin_loop(m, out, stdin_closed: threading.Event):
    """What an agent does when lost: self-fence (stop), rejoin as a fresh node, and show that
    the old identity's writes are refused. Returns the membership in use at the end."""
    from rendezvous.errors import FencedError
    from rendezvous.kv import StoreError

    while not stdin_closed.wait(0.05):
        if not m.lost.is_set():
            continue
        old = m
        old.stop(leave=False)
        while not stdin_closed.is_set():
            try:
                m = old.renew()
                _start(m, out)
                break
            except StoreError as exc:  # still cut off: try again
                out(event="rejoin-failed", error=str(exc)[:200], t=time.time())
                time.sleep(0.5)
        for what, write in (
            ("checked_set", lambda: old.checked_set("ftrun/test/stale", b"x")),
            ("advance_generation", lambda: old.advance_generation(0, 99)),
        ):
            try:
                write()
                out(event="stale-write-accepted", what=what)
            except FencedError as exc:
                out(event="fenced", what=what, error=str(exc), t=time.time())
    return m


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "agent":
        sys.exit(_agent_main(sys.argv[2:]))
    sys.exit("usage: helpers_etcd.py agent --backend etcd|tcp --endpoint H:P ...")
