"""Framework callbacks (launcher.runtime.callbacks, torch_collectives, megatron): a framework
that owns its loop and its process groups survives rank loss through the callbacks only.

Fast: the commit/rollback dispatch, misuse refused in-process, a routed torch.distributed
collective left on a stop. Through the real CLI: a tiny loop's callback order in two recovery
rounds (bit-identical to an in-process reference), and megatron-core TP=2 x DP=2 killed in
forward, backward and the optimizer update, bit-identical to the same script without ftrun."""

from __future__ import annotations

import importlib.util
import json
import socket
import time
from pathlib import Path

import pytest
import torch
from helpers_launch import (
    FTRUN,
    TORCHRUN,
    env_with,
    events,
    free_port,
    run,
    script,
    spawned_pids,
)
from helpers_runtime import (
    EXAMPLES,
    assert_bit_identical,
    load_params,
    master_store,
    run_workers,
    worker_logs,
)

from launcher.runtime.callbacks import FrameworkCallbacks, resume_callback


def test_resume_callback_dispatch():
    seen: list = []
    both = FrameworkCallbacks(
        rollback=lambda s: seen.append(("rollback", s)), commit=lambda s: seen.append(("commit", s))
    )
    resume_callback(both, "rollback")(3)
    resume_callback(both, "commit")(4)
    resume_callback(FrameworkCallbacks(rollback=lambda s: seen.append(("rollback", s))), "commit")(
        5
    )
    assert seen == [("rollback", 3), ("commit", 4), ("rollback", 5)]
    assert resume_callback(FrameworkCallbacks(), "rollback") is None
    with pytest.raises(ValueError, match="allowed: rollback, commit"):
        resume_callback(both, "restart")


def test_the_framework_path_inits_replacements_normally_unless_asked():
    from launcher.runtime.callbacks import framework_environ
    from launcher.runtime.env import RuntimeEnv

    base = {"WORLD_SIZE": "2", "RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    assert RuntimeEnv.from_environ(base).skip_init  # ftr.init(): the skip is on by default
    assert not RuntimeEnv.from_environ(framework_environ(base)).skip_init  # attach(): off
    assert RuntimeEnv.from_environ(framework_environ({**base, "FTRUN_SKIP_INIT": "1"})).skip_init
    assert "FTRUN_SKIP_INIT" not in base  # the caller's mapping is not changed


def test_hooks_refuse_out_of_order_calls(monkeypatch):
    # torch._dynamo (the optimizer imports it) imported while a group exists keeps torch's
    # default store alive for good: imported first, the store this rank hosts stops at finish
    import torch._dynamo  # noqa: F401
    import torch.distributed as dist

    from launcher.runtime import callbacks as ftcb

    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("FTRUN_AGENT_SOCKET", raising=False)
    original = dist.all_reduce
    hooks = ftcb.attach(backend="gloo", environ=env)
    try:
        assert getattr(dist.all_reduce, "__ftrun_routed__", False)
        with pytest.raises(RuntimeError, match="register"):
            hooks.start()
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(TypeError, match="FrameworkCallbacks"):
            hooks.register({"rollback": print}, model=model)  # type: ignore[arg-type]
        hooks.register(FrameworkCallbacks(), model=model, optimizer=opt)
        with pytest.raises(RuntimeError, match="start"):
            hooks.step_start(0)
        assert hooks.start() == 0
        with pytest.raises(ValueError, match="expects step 0"):
            hooks.step_start(1)
        with pytest.raises(RuntimeError, match="outside a step"):
            hooks.optimizer_update_start()
        hooks.step_start(0)
        with pytest.raises(RuntimeError, match="without optimizer_update_start"):
            hooks.optimizer_update_end()
        t = torch.ones(3)
        dist.all_reduce(t)  # routed, world of one
        work = dist.all_reduce(t, async_op=True)
        work.wait()
        del work  # a Work keeps its group (and the group its store) alive
        assert t.tolist() == [1.0, 1.0, 1.0]
        hooks.optimizer_update_start()
        opt.step()
        hooks.optimizer_update_end()
        hooks.step_start(1)  # ends step 0
        assert hooks.committed_step == 0
        with pytest.raises(ValueError, match="not real"):
            hooks.recover(ValueError("not real"))  # not a fault under plain torchrun: re-raised
    finally:
        hooks.finish()
    assert dist.all_reduce is original
    assert hooks.committed_step == 1
    with socket.socket() as s:  # without an agent the rank hosted torch's store: gone now
        assert s.connect_ex(("127.0.0.1", int(env["MASTER_PORT"]))) != 0


def test_megatron_group_handles_are_repointed_and_stale_ones_refused():
    import torch.distributed as dist

    from launcher.runtime.megatron import group_mapping, parallel_state_groups, repoint_groups

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:

        class PgCollection:  # like megatron's ProcessGroupCollection
            def __init__(self, tp, dp):
                self.tp, self.dp, self.hcp = tp, dp, [tp]

        class FakeParallelState:  # a module namespace of groups, like megatron's parallel_state
            pass

        old_tp, old_dp, new_tp, new_dp, stray = (dist.new_group([0]) for _ in range(5))
        old_ps, new_ps = FakeParallelState(), FakeParallelState()
        old_ps._TP_GROUP, old_ps._DP_GROUP, old_ps._ALL = old_tp, old_dp, [None, old_tp, old_dp]
        new_ps._TP_GROUP, new_ps._DP_GROUP, new_ps._ALL = new_tp, new_dp, [None, new_tp, new_dp]
        mapping = group_mapping(parallel_state_groups(old_ps), parallel_state_groups(new_ps))
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        model[0].tp_group = old_tp
        shared = PgCollection(old_tp, old_dp)
        model[0].pg_collection = model[1].pg_collection = shared
        model[1].tp_group = new_tp  # already current: left alone
        assert repoint_groups([model], mapping, [new_tp, new_dp]) == 4
        assert model[0].tp_group is new_tp and shared.tp is new_tp and shared.dp is new_dp
        assert shared.hcp == [new_tp] and model[1].pg_collection is shared
        model[1].stale = stray
        with pytest.raises(RuntimeError, match=r"model\[0\]\.1\.stale holds a process group"):
            repoint_groups([model], mapping, [new_tp, new_dp])
        del old_ps._TP_GROUP
        with pytest.raises(RuntimeError, match="_DP_GROUP was not re-created"):
            group_mapping(parallel_state_groups(old_ps), {"_TP_GROUP": new_tp})
    finally:
        dist.destroy_process_group()


ROUTED_WORKER = r"""
import os, threading, time
import torch, torch.distributed as dist
from launcher.runtime.collectives import Graveyard, Interruptible
from launcher.runtime.signals import StopRequested, StopSignal
from launcher.runtime.torch_collectives import CollectiveRouting

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
dist.init_process_group("gloo", store=dist.PrefixStore("g0", store), rank=rank, world_size=world)
group = dist.new_group([0, 1])  # a framework's own group, used with plain torch.distributed calls
if rank == 1:  # never joins: rank 0 stays blocked until its stop
    store.wait(["done"])
    os._exit(0)
stop = StopSignal()
coll = Interruptible(stop, Graveyard(), lambda: 0, 120.0, lambda exc, what: None)
routing = CollectiveRouting(coll).install()
timer = threading.Timer(0.5, stop.request, args=(1,))
timer.start()
t0 = time.time()
try:
    dist.all_reduce(torch.ones(4), group=group)
    raise SystemExit("a blocked routed all_reduce returned")
except StopRequested:
    sync_s = time.time() - t0
stop2 = StopSignal()
coll._stop = stop2
work = dist.all_reduce(torch.ones(4), group=group, async_op=True)  # megatron's async dgrad style
threading.Timer(0.5, stop2.request, args=(1,)).start()
t0 = time.time()
try:
    work.wait()
    raise SystemExit("a blocked routed async work returned")
except StopRequested:
    async_s = time.time() - t0
routing.uninstall()
assert not getattr(dist.all_reduce, "__ftrun_routed__", False)
print(f"left sync {sync_s:.3f}s async {async_s:.3f}s", flush=True)
store.set("done", "1")
os._exit(0 if sync_s < 5 and async_s < 5 else 1)
"""


def test_routed_collective_leaves_on_stop(tmp_path):
    store = master_store()
    procs = run_workers(ROUTED_WORKER, 2, tmp_path, store)
    codes = [p.wait(timeout=120) for p in procs]
    logs = worker_logs(tmp_path, 2)
    assert codes == [0, 0], logs
    assert "left sync" in logs


def tiny_reference(steps: int) -> dict[str, torch.Tensor]:
    """tests/scripts/callbacks_loop.py's 2-rank training, computed in one process."""
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        grads = []
        for rank in range(2):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(16, 8, generator=g)
            model.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True)).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1).div_(2)
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


def read_callbacks(path: Path) -> list[tuple]:
    with open(path, encoding="utf-8") as f:
        return [(e["cb"], e["arg"], e["pid"]) for e in map(json.loads, f)]


def test_callback_order_in_two_recovery_rounds(tmp_path):
    plan = [
        {"rank": 1, "step": 3, "phase": "backward", "kind": "kill"},
        {"rank": 0, "step": 5, "phase": "optimizer", "kind": "kill", "generation": 1},
    ]
    cmd = FTRUN + [
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "3",
        "--log_dir",
        str(tmp_path / "logs"),
        script("callbacks_loop.py"),
        "--steps",
        "8",
        "--out",
        str(tmp_path / "out{rank}.pt"),
        "--events",
        str(tmp_path / "cb{rank}.jsonl"),
    ]
    res = run(
        cmd,
        env_with(FTRUN_FAULT_PLAN=json.dumps(plan), FTRUN_STORE_TIMEOUT="60"),
        timeout=300,
        cwd=str(tmp_path),
    )
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-6000:]}\n{res.stderr[-6000:]}"
    cb0, cb1 = read_callbacks(tmp_path / "cb0.jsonl"), read_callbacks(tmp_path / "cb1.jsonl")
    # Round 1 resumes at step 3 (rank 1 committed 2 before its kill), or at 2 when the death
    # notice stopped rank 0 while it still committed step 2; round 2 at 6 (rank 1 committed step
    # 5 before rank 0 died in its update), or at 5 (it had not yet). The callbacks are the same.
    # Round 2's plan says "commit" instead of "rollback" when rank 1 had committed step 5 and
    # rank 0 died inside that step's update (the step is done: both ranks go on at 6): the loop
    # registers both callbacks, so the round ends with the one its plan names.
    plans = [e for e in events(str(tmp_path / "logs")) if e["event"] == "repair-plan"]
    (first, second), ends = [e["resume_step"] for e in plans], [e["action"] for e in plans]
    assert first in (2, 3) and second in (5, 6), (first, second)
    assert ends[0] == "rollback" and ends[1] in ("rollback", "commit"), ends
    # rank 0 survives round 1 (resume and re-run), then is killed in step 5's update
    first0 = cb0[0][2]
    assert [c[:2] for c in cb0 if c[2] == first0] == [
        ("stop", None),
        ("clean", None),
        ("rebuild_groups", 1),
        ("rollback", first),
    ]
    # its replacement only rolls back to the resume step: it built its groups at start-up
    assert [c[:2] for c in cb0 if c[2] != first0] == [(ends[1], second)]
    # rank 1's replacement joined round 1, then survived round 2
    assert [c[:2] for c in cb1] == [
        ("rollback", first),
        ("stop", None),
        ("clean", None),
        ("rebuild_groups", 2),
        (ends[1], second),
    ]
    assert len({c[2] for c in cb1}) == 1
    ref = tiny_reference(8)
    for r in range(2):
        assert_bit_identical(load_params(tmp_path / f"out{r}.pt"), ref)


def _megatron_available() -> bool:
    """Installed (found without importing it: the import alone takes seconds)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(
    not _megatron_available(), reason="megatron-core not importable (pip install .[megatron])"
)
def test_megatron_killed_in_every_phase_is_bit_identical_to_a_run_without_ftrun(tmp_path):
    example = str(EXAMPLES / "megatron_train.py")
    ref_dir, wd = tmp_path / "ref", tmp_path / "ft"
    ref_dir.mkdir()
    wd.mkdir()
    ref = run(
        TORCHRUN
        + [
            "--nproc_per_node",
            "4",
            "--master_port",
            str(free_port()),
            example,
            "--steps",
            "8",
            "--no-ftrun",
            "--out",
            str(ref_dir / "out{rank}.pt"),
        ],
        env_with(),
        timeout=300,
        cwd=str(ref_dir),
    )
    assert ref.returncode == 0, f"torchrun exit {ref.returncode}\n{ref.stderr[-6000:]}"
    plan = [
        {"rank": 1, "step": 2, "phase": "forward", "kind": "kill"},
        {"rank": 2, "step": 4, "phase": "backward", "kind": "kill", "generation": 1},
        {"rank": 3, "step": 6, "phase": "optimizer", "kind": "kill", "generation": 2},
    ]
    t0 = time.monotonic()
    res = run(
        FTRUN
        + [
            "--nproc_per_node",
            "4",
            "--max_restarts",
            "3",
            "--log_dir",
            str(wd / "logs"),
            example,
            "--steps",
            "8",
            "--out",
            str(wd / "out{rank}.pt"),
        ],
        # the framework path leaves torch's random fills alone by default (attach): Megatron's
        # CPU init fills a master weight outside the state, so a skip would never be proven
        # harmless; the example asks megatron itself to skip them in a replacement
        # (perform_initialization=not hooks.receives_state)
        env_with(FTRUN_FAULT_PLAN=json.dumps(plan), FTRUN_STORE_TIMEOUT="90"),
        timeout=420,
        cwd=str(wd),
    )
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-8000:]}\n{res.stderr[-4000:]}"
    ev = events(str(wd / "logs"))
    # a warm spare that overtook a cold replacement counts as that one restart
    spawned = sorted(r for r, pids in spawned_pids(ev).items() for _ in pids)
    out = res.stdout + res.stderr
    fallback = [e for e in ev if e["event"] == "fallback"]
    if fallback:
        # the stop (within milliseconds of a death) found a killed rank's only replica a step
        # behind it (framework path: a stop before the optimizer update leaves the step
        # uncommitted): no healthy replica for that shard, so that round restarted all
        assert all("no healthy replica" in e["message"] for e in fallback), fallback
    else:
        assert spawned == [0, 1, 1, 2, 2, 3, 3], spawned  # only the killed ranks got new processes
        assert out.count("megatron groups rebuilt for generation") >= 9, out[
            -6000:
        ]  # 3 survivors x 3 rounds
        # each replacement built its model without megatron's random init (values arrived)
        assert out.count("model built without random init") == 3, out[-6000:]
    for r in range(4):
        assert_bit_identical(load_params(wd / f"out{r}.pt"), load_params(ref_dir / f"out{r}.pt"))
    print(f"megatron run with 3 recoveries: {time.monotonic() - t0:.1f} s")


SHARED_GROUPS_WORKER = r"""
import os, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
from megatron.core import parallel_state as ps
from launcher.runtime.group_sockets import new_connected_sockets, open_sockets
from launcher.runtime.megatron import initialize_model_parallel, rebuild_parallel_state

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
LAZY = os.environ["LAZY"] == "1"
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
dist.init_process_group("gloo", store=dist.PrefixStore("g0", store), rank=rank, world_size=world)
counted = []
real = ps.create_group
def counting(*a, **kw):
    counted.append(kw.get("ranks"))
    return real(*a, **kw)
ps.create_group = counting  # what reaches megatron's own create_group (and torch's new_group)
before = open_sockets()
initialize_model_parallel(lazy_connect=LAZY, tensor_model_parallel_size=2)
made = len(counted)
def connected_since(before):
    # pairs connected since `before`: eagerly 7 here (every pair of this rank's 6 groups),
    # lazily 0-1 (a peer's first use of a pair may come before this rank looks)
    n = len(new_connected_sockets(before, open_sockets()))
    assert (n <= 2) if LAZY else (n >= 6), n
connected_since(before)
assert "TORCH_GLOO_LAZY_INIT" not in os.environ  # only for megatron's groups
assert ps.create_group is counting  # put back
# PP=1: the model-parallel group has the tensor-parallel group's ranks: one group for both
assert ps.get_model_parallel_group() is ps.get_tensor_model_parallel_group()
tp = ps.get_tensor_model_parallel_group()
assert dist.get_process_group_ranks(tp) == [rank // 2 * 2, rank // 2 * 2 + 1]
x = torch.ones(1) * rank
dist.all_reduce(x, group=ps.get_tensor_model_parallel_group())
dist.all_reduce(x, group=ps.get_data_parallel_group())
assert x.item() == 6.0, x  # (0 + 1) + (2 + 3) on every rank

class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tp_group = ps.get_tensor_model_parallel_group()  # cached at construction

model = torch.nn.Sequential(Layer())
old = model[0].tp_group
dist.destroy_process_group()  # a recovery round: a new default group, then megatron's
dist.init_process_group("gloo", store=dist.PrefixStore("g1", store), rank=rank, world_size=world)
counted.clear()
before = open_sockets()
assert rebuild_parallel_state(model, tensor_model_parallel_size=2) == 1
assert len(counted) == made  # shared again: the same groups, in the same order
connected_since(before)  # rebuilt the same way
new = model[0].tp_group
assert new is not old and new is ps.get_tensor_model_parallel_group()
assert new is ps.get_model_parallel_group()
x = torch.ones(1)
dist.all_reduce(x, group=new)
assert x.item() == 2.0
print(f"requests {made}", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.skipif(
    not _megatron_available(), reason="megatron-core not importable (pip install .[megatron])"
)
@pytest.mark.parametrize("lazy", ["1", "0"])
def test_megatron_groups_with_the_same_ranks_are_made_once_and_rebuilt_the_same_way(
    tmp_path, lazy: str
):
    """`initialize_model_parallel` creates each distinct group once (4 ranks, TP=2: 47 requests
    of megatron, 11 distinct), groups with the same ranks are one object, collectives on them
    work, and `rebuild_parallel_state` after a new default group shares them the same way and
    re-points the cached handle. Its gloo groups connect at their first use (`lazy_connect`,
    the default; the rebuild keeps the mode), or at once when asked."""
    store = master_store()
    procs = run_workers(SHARED_GROUPS_WORKER, 4, tmp_path, store, {"LAZY": lazy})
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0, 0, 0], worker_logs(tmp_path, 4)
    made = int((tmp_path / "worker0.log").read_text().split("requests ")[1].split()[0])
    assert 0 < made < 20, made  # megatron asks for 47; without sharing each reaches torch
