"""launcher.runtime.group_sockets: the sockets a gloo group opened, shut down to break C++ waits.

Real gloo groups in real processes: three ranks train a DDP model; rank 2 stops taking part
(sleeps) while ranks 0 and 1 wait in DDP's C++ all-reduce inside `backward()`. The ledger's
`break_before` (from another thread, as the agent channel's reader calls it on a stop) makes
that wait raise within a second; rank 2's own next collective fails the same way; every
process stays alive and exits normally; the store's connection and gloo's listening socket
are never recorded or touched.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

from helpers_launch import free_port

from launcher.runtime.group_sockets import (
    GroupSocket,
    SocketLedger,
    new_connected_sockets,
    open_sockets,
    shutdown,
)

WORKER = textwrap.dedent(r"""
    import json, os, sys, threading, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from launcher.runtime.group_sockets import SocketLedger
    rank, world, port = int(sys.argv[1]), 3, int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
    ledger = SocketLedger()
    with ledger.track(0):
        dist.init_process_group("gloo", store=dist.PrefixStore("g0", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
    mine = ledger.sockets(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    result = {"rank": rank, "sockets": len(mine)}
    if rank == 2:
        time.sleep(3.0)  # not at the all-reduce: ranks 0 and 1 wait for it
    else:
        threading.Timer(0.5, lambda: result.__setitem__("shut", ledger.break_before(1))).start()
    t0 = time.monotonic()
    try:
        model(torch.randn(4, 8)).sum().backward()
        result["backward"] = "completed"
    except RuntimeError as exc:
        result["backward"] = str(exc).splitlines()[0][:200]
    result["seconds"] = round(time.monotonic() - t0, 3)
    store.set(f"done{rank}", "1")
    store.wait([f"done{r}" for r in range(world)], timedelta(seconds=30))
    # rank 0 hosts the store: it leaves last (it left at once in a CI run while rank 2's wait
    # was still unanswered: "Connection reset by peer")
    if rank == 0:
        store.wait([f"bye{r}" for r in range(1, world)], timedelta(seconds=30))
    else:
        store.set(f"bye{rank}", "1")
    print("RESULT " + json.dumps(result), flush=True)
    os._exit(0)
""")


def test_a_c_plus_plus_ddp_wait_on_a_silent_peer_is_broken_and_every_process_lives(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = free_port()
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(3)
    ]
    results = {}
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
        line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
        r = json.loads(line[len("RESULT ") :])
        results[r["rank"]] = r
    for rank in (0, 1):
        r = results[rank]
        assert r["sockets"] == 2  # one connected pair per peer; the listener is not recorded
        assert r["shut"] >= 1
        assert r["backward"] != "completed" and r["seconds"] < 2.0, (
            r
        )  # left at once, not after 60 s
    assert results[2]["backward"] != "completed"  # its peers' sockets are gone: it fails, it lives


def test_only_new_connected_stream_sockets_are_recorded_and_a_reused_descriptor_is_skipped():
    listener = socket.create_server(("127.0.0.1", 0))
    before = open_sockets()
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    other_listener = socket.create_server(("127.0.0.1", 0))
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        found = new_connected_sockets(before, open_sockets())
        assert {s.fd for s in found} == {
            client.fileno(),
            server_side.fileno(),
        }  # no listener, no UDP
        stale = GroupSocket(
            client.fileno(), os.fstat(udp.fileno()).st_ino
        )  # another socket's inode
        assert not shutdown(stale)
        client.setblocking(True)
        assert shutdown(next(s for s in found if s.fd == server_side.fileno()))
        assert client.recv(1) == b""  # the peer sees the connection closed
    finally:
        for s in (listener, client, server_side, other_listener, udp):
            s.close()


def test_ledger_breaks_only_older_generations_and_forgets_destroyed_ones():
    listener = socket.create_server(("127.0.0.1", 0))
    ledger = SocketLedger()
    conns = []
    try:
        for generation in (0, 1):
            with ledger.track(generation):
                conns.append(socket.create_connection(listener.getsockname()))
            conns.append(listener.accept()[0])
        assert len(ledger.sockets(0)) == 1 and len(ledger.sockets(1)) == 1
        assert ledger.break_before(1) == 1  # generation 0 only
        conns[2].setblocking(True)
        conns[1].settimeout(0.5)
        assert conns[1].recv(1) == b""  # generation 0's peer sees it closed
        ledger.forget(1)
        assert ledger.sockets(1) == [] and ledger.break_before(5) == 0
    finally:
        for s in [listener, *conns]:
            s.close()


def test_a_group_built_after_its_stop_arrived_is_broken_at_once():
    listener = socket.create_server(("127.0.0.1", 0))
    ledger = SocketLedger(stop_target=lambda: 3)
    ledger.enabled = True
    try:
        with ledger.track(2):
            client = socket.create_connection(listener.getsockname())
        peer = listener.accept()[0]
        peer.settimeout(0.5)
        assert peer.recv(1) == b""
    finally:
        for s in (listener, client, peer):
            s.close()


def test_connections_an_older_listener_accepts_meanwhile_are_not_recorded():
    """A TCPStore server in this process accepting a peer's new client while a group is built."""
    server = socket.create_server(("127.0.0.1", 0))
    ledger = SocketLedger()
    try:
        with ledger.track(0):
            client = socket.create_connection(server.getsockname())  # ours: recorded
            accepted = server.accept()[0]  # the old listener's: left alone
        assert [s.fd for s in ledger.sockets(0)] == [client.fileno()]
    finally:
        for s in (server, client, accepted):
            s.close()


QUEUED_SEND = textwrap.dedent(r"""
    import os, signal, sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    from launcher.runtime.group_sockets import SocketLedger
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    ledger = SocketLedger()
    with ledger.track(0):
        dist.init_process_group("gloo", store=dist.PrefixStore("g0", store), rank=rank,
                                world_size=2, timeout=timedelta(seconds=3))
    store.set(f"pid{rank}", str(os.getpid()))
    dist.barrier()
    big = torch.zeros(64 * 1024 * 1024)  # 256 MB: more than the socket buffers hold
    if rank == 0:
        work = dist.irecv(big, src=1)
        store.set("posted", "1")
        time.sleep(120)  # stopped by rank 1 long before, then killed
    store.wait(["posted"], timedelta(seconds=30))
    time.sleep(0.3)
    os.kill(int(store.get("pid0")), signal.SIGSTOP)  # the receiver stops reading
    work = dist.isend(big, dst=0)
    time.sleep(1.0)  # gloo has queued the rest of the send on the connection
    t0 = time.monotonic()
    shut = ledger.break_before(1)
    try:
        work.wait()
        outcome = "completed"
    except RuntimeError as exc:
        outcome = str(exc).splitlines()[0][:200]
    print("RESULT", shut, round(time.monotonic() - t0, 3), outcome, flush=True)
    os._exit(0)
""")


def test_a_send_gloo_already_queued_is_not_released_by_the_shutdown_only_by_the_group_timeout(
    tmp_path,
):
    """Why the agent kills a survivor still waiting FTRUN_HANG_STOP after a stop (hang_watch):
    gloo's pair, when its connection fails, fails the bound buffers in its transmit queue but
    not the unbound ones its collectives and send/recv use, so a send queued before the
    shutdown waits for the group's timeout (3 s here). Seen in CI as a survivor stuck in DDP's
    ring all-reduce after a peer was killed. If this test fails, gloo fixed it."""
    script = tmp_path / "queued.py"
    script.write_text(QUEUED_SEND)
    port = free_port()
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    }
    receiver = subprocess.Popen(
        [sys.executable, str(script), "0", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        sender = subprocess.run(
            [sys.executable, str(script), "1", str(port)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
    finally:
        receiver.kill()
        receiver.wait(timeout=30)
    assert sender.returncode == 0, sender.stderr[-3000:]
    _, shut, seconds, outcome = next(
        ln for ln in sender.stdout.splitlines() if ln.startswith("RESULT ")
    ).split(" ", 3)
    assert int(shut) == 1  # the connection to rank 0 was shut down ...
    assert outcome != "completed" and "Timed out" in outcome, outcome
    assert float(seconds) >= 2.5, (
        seconds
    )  # ... and still only the group's 3 s timeout ended the send
