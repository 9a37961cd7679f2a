"""Test helper: a real single-member etcd server on free loopback ports.

Owns: starting `/usr/bin/etcd` (Debian etcd-server) in a temporary data dir with fast raft
timers, waiting until it is healthy, optionally turning on authentication (root user via
`etcdctl`), and stopping it (kill, wait, remove the data dir). Tests use the `etcd_server`
pytest fixture; they are skipped with a clear reason when the binary is missing.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Iterator

import pytest

ETCD_BIN = os.environ.get("FTRUN_TEST_ETCD", "/usr/bin/etcd")
ETCDCTL_BIN = os.environ.get("FTRUN_TEST_ETCDCTL", "/usr/bin/etcdctl")
START_TIMEOUT = 15.0


def free_port() -> int:
    """A currently free loopback TCP port (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    _log: object | None = field(default=None, repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def start(self, timeout: float = START_TIMEOUT) -> None:
        """Start etcd on fresh free ports and wait until /health says true."""
        last = ""
        for _attempt in range(3):  # a port picked free can be taken before etcd binds it
            self.client_port, self.peer_port = free_port(), free_port()
            peer = f"http://127.0.0.1:{self.peer_port}"
            self.log_path = os.path.join(self.data_dir, "etcd.log")
            self._log = open(self.log_path, "ab")
            member_dir = os.path.join(self.data_dir, "member-data")
            shutil.rmtree(member_dir, ignore_errors=True)
            self.proc = subprocess.Popen(
                [ETCD_BIN, "--name", "t", "--data-dir", member_dir,
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"t={peer}", "--log-level", "error", "--logger", "zap",
                 "--heartbeat-interval", "10", "--election-timeout", "100"],
                stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if self._wait_healthy(timeout):
                return
            last = self._tail()
            self.stop(remove=False)
        raise RuntimeError(f"etcd did not become healthy within {timeout}s: {last}")

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


def start_etcd() -> EtcdServer:
    """Start a fresh etcd (skips the calling test when the binary is missing)."""
    if not etcd_available():
        pytest.skip(f"etcd binary not found at {ETCD_BIN} (apt-get install etcd-server)")
    server = EtcdServer(data_dir=tempfile.mkdtemp(prefix="ftrun-etcd-"))
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
