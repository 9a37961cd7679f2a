"""Shared helpers for the store tests: real torch clients and gloo workers in subprocesses.

Torch's Python bindings for some store ops (queue ops) keep the GIL while they block, so a
torch client must never run in the process that hosts a Python server; these helpers always
run torch code in child processes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from helpers_ports import free_port  # noqa: F401  (re-exported for the tests)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Exercises every TCPStore op from torch's own C++ client and checks each result.
TORCH_OPS = r"""
import sys, time
from datetime import timedelta
import torch.distributed as d
host, port = sys.argv[1], int(sys.argv[2])
token = sys.argv[3] if len(sys.argv) > 3 else ""
ns = sys.argv[4] if len(sys.argv) > 4 else "t"
queues = not (len(sys.argv) > 5 and sys.argv[5] == "noqueue")
c = d.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
if token:
    c.set("ftrun/auth", token)
def eq(a, b, what):
    if a != b:
        print(f"FAIL {what}: {a!r} != {b!r}", flush=True); sys.exit(1)
k = lambda s: f"{ns}/{s}"
c.set(k("a"), b"1")
eq(c.get(k("a")), b"1", "get")
eq(c.add(k("n"), 5), 5, "add")
eq(c.add(k("n"), -7), -2, "add negative")
eq(c.compare_set(k("a"), b"1", b"2"), b"2", "compare_set hit")
eq(c.compare_set(k("a"), b"x", b"3"), b"2", "compare_set miss")
eq(c.compare_set(k("new"), b"", b"z"), b"z", "compare_set create")
eq(c.compare_set(k("none"), b"e", b"z"), b"e", "compare_set missing")
eq(c.check([k("a"), k("n")]), True, "check ready")
eq(c.check([k("a"), k("absent")]), False, "check not ready")
c.wait([k("a"), k("n")])
t = time.monotonic()
try:
    c.wait([k("absent")], timedelta(milliseconds=200))
    eq("no timeout", "timeout", "wait timeout")
except Exception as e:
    eq(type(e).__name__, "DistStoreError", "wait timeout type")
eq(time.monotonic() - t < 2.0, True, "wait timeout took too long")
c.set(k("after"), b"ok")  # the connection is still usable after CANCEL_WAIT
eq(c.get(k("after")), b"ok", "get after cancel")
before = c.num_keys()
c.set(k("cnt"), b"0")
eq(c.num_keys(), before + 1, "num_keys")
eq(c.delete_key(k("cnt")), True, "delete")
eq(c.delete_key(k("cnt")), False, "delete missing")
c.append(k("ap"), b"x"); c.append(k("ap"), b"y")
eq(c.get(k("ap")), b"xy", "append")
c.multi_set([k("m1"), k("m2")], [b"v1", b"v2"])
eq(c.multi_get([k("m1"), k("m2")]), [b"v1", b"v2"], "multi_get")
if queues:
    c.queue_push(k("q"), b"q1"); c.queue_push(k("q"), b"q2")
    eq(c.queue_len(k("q")), 2, "queue_len")
    eq(c.queue_pop(k("q")), b"q1", "queue_pop")
    eq(c.queue_pop(k("q"), block=False), b"q2", "queue_pop nonblock")
    try:
        c.queue_pop(k("q"), block=False)
        eq("value", "empty", "queue_pop empty")
    except Exception as e:
        eq(type(e).__name__, "QueueEmptyError", "queue empty type")
keys = c.list_keys()
eq(k("a") in keys and k("m2") in keys, True, "list_keys")
c.barrier(k("bar"), 1)
eq(c.get(k("bar")), b"1", "barrier counter")
c2 = c.clone()  # a new connection: it must authenticate on its own
if token:
    c2.set("ftrun/auth", token)
eq(c2.get(k("a")), b"2", "clone get")
p = d.PrefixStore("pfx", c)
p.set("x", b"px")
eq(c.get("pfx/x"), b"px", "prefix store")
big = bytes(range(256)) * 4096
c.set(k("big"), big)
eq(c.get(k("big")), big, "1 MiB value")
print("ALL-OPS-OK", flush=True)
"""

# An unmodified gloo worker: env:// init through the agent store, all_reduce, new_group.
GLOO_WORKER = r"""
import os, sys
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="env://")
r, w = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(r + 1)])
dist.all_reduce(t)
g = dist.new_group(list(range(w)))
t2 = torch.ones(2)
dist.all_reduce(t2, group=g)
dist.barrier()
print(f"GLOO-OK rank={r} sum={t.item():g} group_sum={t2[0].item():g}", flush=True)
dist.destroy_process_group()
"""


def recv_exact(s: socket.socket, n: int) -> bytes:
    """Exactly n bytes from a blocking socket; ConnectionError when it closes first."""
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def thread_states(pid: int) -> list[str]:
    """The state letter (R, S, T, ...) of every thread of process `pid`, from /proc."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="utf-8") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
    return states


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every thread of it is stopped (state T). The stop is not
    done when kill() returns: the thread that takes the signal stops the others, and until then
    a thread of a store can still answer a client (seen: 3 of 30 stores answered a probe sent
    right after kill() on a loaded 2-core VM). TimeoutError when it is not stopped in time."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while any(s != "T" for s in thread_states(pid)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"pid {pid} not stopped after {timeout:g} s: {thread_states(pid)}")
        time.sleep(0.001)


def child_env(**extra: object) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_torch_ops(
    host: str, port: int, token: str = "", ns: str = "t", queues: bool = True, timeout: float = 60
) -> subprocess.CompletedProcess:
    """Every TCPStore op from torch's client; `queues=False` skips the queue ops (which a
    KVStore upstream cannot serve)."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            TORCH_OPS,
            host,
            str(port),
            token,
            ns,
            "queue" if queues else "noqueue",
        ],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_torch(code: str, *args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_gloo_world(host: str, ports: list[int], timeout: float = 90) -> list[str]:
    """Start len(ports) gloo ranks; rank i uses MASTER_PORT=ports[i] (a server or a proxy).
    Returns each rank's stdout; raises AssertionError with stderr when a rank fails."""
    world = len(ports)
    procs = []
    for rank, port in enumerate(ports):
        env = child_env(
            MASTER_ADDR=host,
            MASTER_PORT=port,
            RANK=rank,
            WORLD_SIZE=world,
            LOCAL_RANK=rank,
            TORCHELASTIC_USE_AGENT_STORE="True",
            TORCHELASTIC_RUN_ID="storetest",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", GLOO_WORKER],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outs = []
    try:
        for rank, p in enumerate(procs):
            out, err = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise AssertionError(f"rank {rank} exited {p.returncode}: {err[-2000:]}")
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


# A fuzzing client: `total` frames over a few pipelined connections. ~90% are random but
# well-formed requests, the rest random garbage, absurd lengths, or a truncated frame
# followed by a hang-up; a connection the server closes is replaced. Prints a JSON summary.
FUZZER = r"""
import json, random, socket, struct, sys, time
host, port, total, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
Q = struct.Struct("<Q").pack
def b(x): return Q(len(x)) + x
dkeys = [b"/fz/d%d" % i for i in range(64)]
ckeys = [b"/fz/c%d" % i for i in range(16)]
def dk(): return rng.choice(dkeys)
def ck(): return rng.choice(ckeys)
def val(): return rng.randbytes(rng.choice((0, 1, 8, 100, 2000)))
def klist(): return Q(len(ks := [dk() for _ in range(rng.randint(0, 4))])) + b"".join(map(b, ks))
GOOD = [
    lambda: b"\x01" + b(dk()) + b(val()),
    lambda: b"\x02" + b(dk()) + b(val()) + b(val()),
    lambda: b"\x03" + b(dk()),
    lambda: b"\x04" + b(ck()) + struct.pack("<q", rng.randint(-5, 5)),
    lambda: b"\x05" + klist(),
    lambda: b"\x06" + klist(),
    lambda: b"\x07",
    lambda: b"\x08" + b(dk()),
    lambda: b"\x09" + b(dk()) + b(val()),
    lambda: b"\x0a" + klist(),
    lambda: b"\x0b" + Q(2) + b(dk()) + b(val()) + b(dk()) + b(val()),
    lambda: b"\x0c",
    lambda: b"\x0d" + struct.pack("<I", rng.getrandbits(32)),
    lambda: b"\x0e" + b(dk()) + b(val()),
    lambda: b"\x0f" + b(dk()),
    lambda: b"\x10" + b(dk()),
    lambda: b"\x11",
    lambda: b"\x12" + b(ck()) + struct.pack("<q", rng.randint(0, 3)),
    lambda: b"\x00" + struct.pack("<I", 0x3C85F7CE),
]
BAD = [
    lambda: rng.randbytes(rng.randint(1, 40)),
    lambda: bytes((rng.randint(19, 239),)) + rng.randbytes(8),
    lambda: b"\x03" + Q(rng.choice((2**63, 2**40, 10**9))),
    lambda: b"\x01" + b(dk()) + Q(2**62),
    lambda: b"\x06" + Q(2**50),
    lambda: b"\x0b" + Q(10**12),
]
HELLO = b"\x00" + struct.pack("<I", 0x3C85F7CE) + b"\x0d" + struct.pack("<I", 1)
def conn():
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(HELLO)
    return s
def drain(s):
    try:
        while s.recv(65536, socket.MSG_DONTWAIT):
            pass
        return False  # EOF: the server closed it
    except BlockingIOError:
        return True
    except OSError:
        return False
socks = [conn() for _ in range(8)]
sent = bad = truncated = reconnects = 0
t0 = time.monotonic()
while sent < total:
    i = rng.randrange(len(socks))
    s = socks[i]
    chunk = []
    for _ in range(min(200, total - sent)):
        r = rng.random()
        sent += 1
        if r < 0.9:
            chunk.append(GOOD[rng.randrange(len(GOOD))]())
            continue
        if r < 0.95:
            chunk.append(BAD[rng.randrange(len(BAD))]())
            bad += 1
        else:
            f = GOOD[rng.randrange(len(GOOD))]()
            chunk.append(f[:rng.randrange(1, len(f))] if len(f) > 1 else f)
            truncated += 1
        break
    try:
        s.sendall(b"".join(chunk))
    except OSError:
        pass
    if r >= 0.9 or not drain(s):
        s.close()
        socks[i] = conn()
        reconnects += 1
for s in socks:
    s.close()
print(json.dumps({"frames": sent, "bad": bad, "truncated": truncated,
                  "reconnects": reconnects, "seconds": round(time.monotonic() - t0, 2)}))
"""

# A well-behaved torch client: loops over ordinary ops until key "stop" exists and prints
# the slowest op latency in ms.
STEADY_CLIENT = r"""
import json, sys, time
from datetime import timedelta
import torch.distributed as d
c = d.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=timedelta(seconds=10))
lat = []
i = 0
c.set("steady/ready", b"1")
while True:
    i += 1
    for op in (lambda: c.set("steady/k", str(i).encode()),
               lambda: c.get("steady/k"),
               lambda: c.add("steady/n", 1),
               lambda: c.check(["steady/k"]),
               lambda: c.multi_get(["steady/k", "steady/n"])):
        t = time.perf_counter(); op(); lat.append(time.perf_counter() - t)
    if c.check(["stop"]):
        break
    time.sleep(0.002)
lat.sort()
print(json.dumps({"ops": len(lat), "max_ms": round(lat[-1] * 1000, 2),
                  "p99_ms": round(lat[int(len(lat) * 0.99)] * 1000, 2),
                  "over_100ms": sum(x > 0.1 for x in lat)}))
"""
