"""Measuring instruments for scripts/bench_scale.py.

Owns: `StoreHost` (the job's store server, `rendezvous.store.server.StoreServer`, in a process
of its own so its CPU is its own: `python scripts/scale_measure.py serve`; its request counter
on demand), `wire_bytes` (bytes in and out of every established TCP connection of a listening
port, from the kernel's tcp_info via `ss`), `thread_cpu` (on-CPU seconds of this process's
threads by role: controller, proxies, simulated ranks, agents), `read_events` (the
controller's events.jsonl) and `CountingStoreClient` with `RequestCounts` (an agent's store
requests as they go on the wire, by the source that made them and the op: the steady state's
breakdown per node) and `FanoutProbe` (one connection per node that waits for a key and reads
it, as an agent's plan feed does, all on one selector thread: when the real store had delivered
a round's plan to every node, apart from the simulated agents' interpreter locks).
"""

from __future__ import annotations

import glob
import json
import os
import re
import selectors
import socket
import subprocess
import sys
import threading
import time

from bench_store import cpu_seconds as process_cpu  # noqa: E402  (scripts/ is sys.path[0])

from launcher.protocol import plan as PL  # noqa: E402
from rendezvous.store import protocol as SP  # noqa: E402
from rendezvous.store.client import StoreClient  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class StoreHost:
    """The store server process. `start()`, `stats()`, `stop()`."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self._lock = threading.Lock()

    def start(self) -> "StoreHost":
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "serve"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("port "):
            raise RuntimeError(f"the store host did not start: {line!r}")
        self.port = int(line.split()[1])
        return self

    def stats(self) -> dict:
        """{"requests": n, "cpu_s": on-CPU seconds of the whole store process}."""
        assert self.proc is not None
        with self._lock:
            self.proc.stdin.write("stats\n")
            self.proc.stdin.flush()
            out = json.loads(self.proc.stdout.readline())
        out["cpu_s"] = process_cpu(self.proc.pid)
        return out

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(5)


def serve() -> None:
    """The store host's main: serve until "quit" on stdin; "stats" prints the counters."""
    from rendezvous.store.server import StoreServer

    server = StoreServer(host="127.0.0.1", port=0, log=lambda m: None).start()
    print(f"port {server.port}", flush=True)
    with server:
        for line in sys.stdin:
            if line.strip() == "stats":
                print(json.dumps({"requests": server.stats["requests"]}), flush=True)
            elif line.strip() == "quit":
                break


_BYTES = re.compile(r"bytes_(received|acked):(\d+)")


def wire_bytes(port: int) -> int:
    """Bytes received plus bytes sent (acked) on every established connection of the listening
    `port` (its server side), as the kernel counts them. Connections closed meanwhile drop
    out: compare two readings of a world whose connections stay open."""
    out = subprocess.run(
        ["ss", "-tinH", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return sum(int(m.group(2)) for m in _BYTES.finditer(out))


ROLES = (
    ("controller", ("ftrun-controller",)),
    ("proxies", ("ftrun-proxy",)),
    ("ranks", ("sim-ranks",)),
)


def thread_cpu() -> dict[str, float]:
    """On-CPU seconds of this process's threads by role (see ROLES; the rest: "agents", the
    agents' membership, feeds and loops plus the benchmark's own thread)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out = {role: 0.0 for role, _ in ROLES}
    out["agents"] = 0.0
    for path in glob.glob(f"/proc/{os.getpid()}/task/*/schedstat"):
        tid = int(path.split("/")[-2])
        try:
            with open(path) as f:
                ns = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        name = names.get(tid, "")
        role = next((r for r, prefixes in ROLES if name.startswith(prefixes)), "agents")
        out[role] += ns / 1e9
    return out


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 4) for k in after}


def read_events(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    except OSError:
        pass
    return out


# the source of a request: the agent thread that made it (by name prefix), else its key
THREAD_SOURCES = (
    ("ftrun-membership-heartbeat", "heartbeat"),
    ("ftrun-membership-checker", "liveness-watch"),
    ("ftrun-membership-events", "event-follower"),
    ("ftrun-plans", "plan-feed"),
    ("ftrun-inject", "inject-feed"),
    ("ftrun-controller", "controller"),
    ("ftrun-status", "status-relay"),
)
KEY_SOURCES = (
    (PL.RESTARTS_USED_KEY, "observer"),
    (PL.node_status_key(0).rsplit("/", 1)[0], "observer"),
    (PL.progress_key(0).rsplit("/", 1)[0], "progress"),
)


class RequestCounts:
    """Wire requests by (source, op), shared by the agents of one process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def add(self, source: str, op: str, n: int = 1) -> None:
        key = f"{source}.{op}"
        with self._lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)


def request_source(keys: tuple) -> str:
    """Who made a request of the calling thread with wire `keys` (see THREAD_SOURCES)."""
    name = threading.current_thread().name
    for prefix, source in THREAD_SOURCES:
        if name.startswith(prefix):
            return source
    key = keys[0].decode("utf-8", "replace") if keys else ""
    for prefix, source in KEY_SOURCES:
        if prefix and prefix in key:
            return source
    return "other:" + name.split("-")[0]


class CountingStoreClient(StoreClient):
    """A `StoreClient` that counts its wire requests (WAIT, and CANCEL_WAIT when a wait runs
    out, as two) in `counts`, and stamps the wall time each SET of a key containing one of
    `stamped` returned (`stamps`: key -> time; the agent's relay of its node's statuses)."""

    def __init__(self, *args, counts: RequestCounts, stamped: tuple[str, ...] = (), **kw) -> None:
        super().__init__(*args, **kw)
        self.counts = counts
        self.stamped = stamped
        self.stamps: dict[str, float] = {}

    def set(self, key: str, value: bytes) -> None:
        super().set(key, value)
        if any(part in key for part in self.stamped):
            self.stamps[key] = time.time()

    def _call(self, req, count: int = 0):
        self.counts.add(request_source(req.keys), SP.OP_NAMES[req.op])
        return super()._call(req, count)

    def _wait_wire(self, wks: tuple, timeout: float) -> bool:
        source = request_source(wks)
        self.counts.add(source, "WAIT")
        found = super()._wait_wire(wks, timeout)
        if not found:
            self.counts.add(source, "CANCEL_WAIT")
        return found


def per_node_rates(before: dict[str, int], after: dict[str, int], nodes: int, dt: float) -> dict:
    """Requests per node per second: by source (`by_source`) and by source.op (`by_op`)."""
    by_op = {
        k: round((after.get(k, 0) - before.get(k, 0)) / nodes / dt, 3)
        for k in sorted(after)
        if after.get(k, 0) != before.get(k, 0)
    }
    by_source: dict[str, float] = {}
    for k, v in by_op.items():
        src = k.rsplit(".", 1)[0]
        by_source[src] = round(by_source.get(src, 0.0) + v, 3)
    return {"total": round(sum(by_op.values()), 3), "by_source": by_source, "by_op": by_op}


class FanoutProbe:
    """`n` connections to the store at `port`, each waiting for `key` with FT_WAIT_VALUES (the
    wake-up carries the value), the wire pattern of an agent's plan feed on ftrun's store, or
    (`carried=False`) with torch's client's WAIT then MULTI_GET; one selector thread.
    Run in a process of its own (`ProbeProcess`), so no simulated agent shares its
    interpreter: wall times of the first wake-up and of the last value read."""

    def __init__(self, port: int, key: str, n: int, carried: bool = True) -> None:
        self.wk = SP.wire_key(key)
        # carried: FT_WAIT_VALUES; else torch's client's pattern, a WAIT then a MULTI_GET
        self.carried = carried
        self.socks: list[socket.socket] = []
        self.first = self.last = 0.0
        self.done = 0
        self._thread = threading.Thread(target=self._run, name="probe-fanout", daemon=True)
        try:
            for i in range(n):
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.socks.append(s)
                s.sendall(SP.handshake_bytes(i + 1))
                self._reply(s, SP.Reply.U32)
                op = SP.Op.FT_WAIT_VALUES if carried else SP.Op.WAIT
                s.sendall(SP.encode_request(SP.Request(op, (self.wk,))))
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _reply(s: socket.socket, shape: int, count: int = 0):
        buf = b""
        while True:
            r = SP.parse_reply(buf, 0, shape, count) if buf else None
            if r is not None:
                return r[0]
            chunk = s.recv(65536)
            if not chunk:
                raise ConnectionError("the store closed a probe connection")
            buf += chunk

    def start(self) -> "FanoutProbe":
        self._thread.start()
        return self

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        for s in self.socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ, [b"", "values" if self.carried else "wake"])
        get = SP.encode_request(SP.Request(SP.Op.MULTI_GET, (self.wk,)))
        deadline = time.monotonic() + 600
        while self.done < len(self.socks) and time.monotonic() < deadline:
            for k, _ in sel.select(1.0):
                s, state = k.fileobj, k.data
                chunk = s.recv(65536)
                if not chunk:
                    sel.unregister(s)
                    continue
                state[0] += chunk
                if state[1] == "wake":  # torch's pattern: woken, now read the value
                    r = SP.parse_reply(state[0], 0, SP.Reply.U8)
                    if r is None:
                        continue
                    self.first = self.first or time.time()
                    state[0], state[1] = state[0][r[1] :], "get"
                    s.sendall(get)
                    continue
                shape = SP.Reply.WAIT_VALUES if state[1] == "values" else SP.Reply.MULTI
                if SP.parse_reply(state[0], 0, shape, 1) is None:
                    continue
                self.last = time.time()
                self.first = self.first or self.last
                self.done += 1
                sel.unregister(s)
        sel.close()

    def result(self, timeout: float = 10.0) -> dict:
        self._thread.join(timeout)
        return {"first_wake": self.first, "last_value": self.last, "nodes": self.done}

    def close(self) -> None:
        for s in self.socks:
            try:
                s.close()
            except OSError:
                pass


class ProbeProcess:
    """A `FanoutProbe` in its own process (`scale_measure.py probe PORT KEY N MODE`):
    connected and waiting when the constructor returns; `result()` once the key was written."""

    def __init__(self, port: int, key: str, n: int, carried: bool = True) -> None:
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        mode = "carried" if carried else "wait-get"
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "probe", str(port), key, str(n), mode],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.close()
            raise RuntimeError(f"the fan-out probe did not start: {line!r}")

    def result(self, timeout: float = 30.0) -> dict:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
            return json.loads(out.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            self.close()
            return {"first_wake": 0.0, "last_value": 0.0, "nodes": 0}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


PROBE_NICE = -10  # the store loop's own (rendezvous.store.loop_priority): the probe is the
# instrument; at the simulation's priority its reads queue behind thousands of simulated threads


def probe_main(port: int, key: str, n: int, mode: str) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, PROBE_NICE)
    except OSError:  # not allowed here: the probe's wake-ups then include its own queueing
        pass
    probe = FanoutProbe(port, key, n, carried=mode == "carried")
    print("ready", flush=True)
    try:
        probe.start()
        print(json.dumps(probe.result(600.0)), flush=True)
    finally:
        probe.close()


def wait_until(pred, timeout: float, what: str, step: float = 0.01) -> float:
    """Poll `pred` until true; the wall time it became true. TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:g} s")
        time.sleep(step)
    return time.time()


if __name__ == "__main__":
    if sys.argv[1:] == ["serve"]:
        serve()
    elif sys.argv[1:2] == ["probe"] and len(sys.argv) == 6:
        probe_main(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5])
    else:
        sys.exit("usage: scale_measure.py serve | probe PORT KEY N carried|wait-get")
