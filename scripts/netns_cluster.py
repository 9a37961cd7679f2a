"""A cluster of hosts on one machine, for multi-node tests and benchmarks over real addresses.

Owns: creating N network namespaces joined by a Linux bridge (one veth pair each, a private
/24 with one address per host), running processes inside a host, the node faults the tests
need (link down for a while, every process of a host killed), and removing all of it again
(processes, namespaces, veths, bridge) even when a test fails.

Needs root and iproute2 (`ip netns`, veth, bridge). `unavailable()` says in one line why a
cluster cannot be built here, for `pytest.skip`. Namespaces share the file system, so
`/etc/hosts`, the repository and Python are the same in every host; each host has its own
loopback and its own `eth0` with its address, so gloo runs over the veths when
`GLOO_SOCKET_IFNAME=eth0` (set by `Host.env`).

Names (namespaces, veths, bridge) start with the cluster's `prefix` ("ft" for the tests,
"bm" for scripts/bench_multinode.py) and carry the creating process id, so clusters of
different users of one machine do not collide. tests/helpers_netns.py re-exports this module.
"""

from __future__ import annotations

import itertools
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

_IDS = itertools.count()
IFNAME = "eth0"  # the interface name inside every host


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def unavailable() -> str | None:
    """None when namespaces can be built here, else the reason in one line."""
    if os.geteuid() != 0:
        return "network-namespace cluster needs root"
    if shutil.which("ip") is None:
        return "network-namespace cluster needs iproute2 (`ip`)"
    name = f"ftprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as e:
        err = getattr(e, "stderr", "") or str(e)
        return f"cannot create a network namespace here: {err.strip()}"
    _ip("netns", "del", name, check=False)
    return None


NET = "10.231."  # every cluster takes a free /24 in 10.231.0.0/16


def _used_subnets() -> set[int]:
    out = _ip("-o", "-4", "addr", "show", check=False).stdout
    used: set[int] = set()
    for word in out.split():
        if word.startswith(NET):
            used.add(int(word.split(".")[2]))
    return used


@dataclass
class Host:
    """One host of the cluster: a namespace with one address on the bridge."""

    name: str  # namespace name
    index: int
    addr: str
    veth: str  # the host-side end, on the bridge: setting it down cuts the host off
    procs: list[subprocess.Popen] = field(default_factory=list)

    def env(self, base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        env["GLOO_SOCKET_IFNAME"] = IFNAME
        env.update({k: str(v) for k, v in extra.items()})
        return env

    def argv(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def popen(self, cmd: list[str], env: dict[str, str] | None = None, **kw) -> subprocess.Popen:
        """Start `cmd` inside this host; the cluster stops it at close."""
        p = subprocess.Popen(self.argv(cmd), env=env if env is not None else self.env(), **kw)
        self.procs.append(p)
        return p

    def run(
        self, cmd: list[str], timeout: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(cmd),
            env=env if env is not None else self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def pids(self) -> list[int]:
        """Every process living in this host's namespace."""
        out = _ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def kill_all(self, sig: int = signal.SIGKILL) -> int:
        """The host crashes: every process in its namespace gets `sig`. Returns how many."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return len(pids)

    def link(self, up: bool) -> None:
        """Cut the host off the network (or reconnect it); processes keep running."""
        _ip("link", "set", self.veth, "up" if up else "down")


class Cluster:
    """N hosts on one bridge. Use as a context manager; `close()` removes everything."""

    def __init__(self, n: int, prefix: str = "ft") -> None:
        if n < 1 or n > 200:
            raise ValueError(f"a cluster has 1..200 hosts, not {n}")
        if not (prefix.isalpha() and prefix.islower() and 1 <= len(prefix) <= 3):
            raise ValueError(f"cluster prefix {prefix!r}: 1-3 lower-case letters")
        self.n = n
        self.prefix = prefix
        tag = f"{os.getpid() % 100000}{next(_IDS)}"
        self.tag = tag
        self.bridge = f"{prefix}br{tag}"[:15]
        self.hosts: list[Host] = []
        self._subnet: int | None = None

    def __enter__(self) -> "Cluster":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build(self) -> None:
        used = _used_subnets()
        start = 1 if self.prefix == "ft" else 128  # the benchmark's subnets apart from the tests'
        self._subnet = next(s for s in [*range(start, 255), *range(1, start)] if s not in used)
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{NET}{self._subnet}.254/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            self.hosts.append(self._add_host(i))

    def _add_host(self, i: int) -> Host:
        ns = f"{self.prefix}{self.tag}h{i}"
        veth, peer = f"{self.prefix}v{self.tag}h{i}"[:15], f"{self.prefix}p{self.tag}h{i}"[:15]
        addr = f"{NET}{self._subnet}.{i + 1}"
        host = Host(name=ns, index=i, addr=addr, veth=veth)
        _ip("netns", "add", ns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", ns)
        _ip("-n", ns, "link", "set", peer, "name", IFNAME)
        _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
        _ip("-n", ns, "link", "set", IFNAME, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "set", veth, "master", self.bridge)
        _ip("link", "set", veth, "up")
        return host

    def close(self) -> None:
        """Stop every process, remove namespaces, veths and the bridge. Idempotent."""
        for host in self.hosts:
            for p in host.procs:
                if p.poll() is None:
                    p.kill()
            host.kill_all()
        for host in self.hosts:
            for p in host.procs:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            _ip("link", "del", host.veth, check=False)  # removes the peer inside the namespace too
            _ip("netns", "del", host.name, check=False)
        if self.bridge:
            _ip("link", "del", self.bridge, check=False)
        self.hosts = []

    def leftovers(self) -> list[str]:
        """Names of this cluster's namespaces or links that still exist (for tests of close)."""
        names = _ip("netns", "list", check=False).stdout + _ip("-o", "link", check=False).stdout
        return sorted(
            {
                w.split("@")[0].rstrip(":")
                for w in names.split()
                if self.tag in w and w.startswith(self.prefix)
            }
        )


def start_etcd(
    host: Host, port: int, peer_port: int, data_dir: str, binary: str = "/usr/bin/etcd"
) -> str:
    """Start etcd inside `host` on its bridge address, `port`; wait until healthy (20 s); its
    client URL. The process belongs to the host (the cluster's close() stops it)."""
    import urllib.request

    url = f"http://{host.addr}:{port}"
    peer = f"http://127.0.0.1:{peer_port}"
    host.popen(
        [
            binary,
            "--name",
            "t",
            "--data-dir",
            data_dir,
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"t={peer}",
            "--log-level",
            "error",
            "--heartbeat-interval",
            "10",
            "--election-timeout",
            "100",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=0.5) as r:
                return b'"true"' in r.read()
        except OSError:
            return False

    if not wait_until(healthy, 20):
        raise RuntimeError(f"etcd in host {host.addr} did not become healthy within 20 s")
    return url


def wait_until(pred, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()
