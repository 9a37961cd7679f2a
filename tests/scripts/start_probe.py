"""Test worker: how this rank's process started. Writes `$OUT_DIR/start.<RANK>.json`: its pid and
parent, torch's intra-op thread count, numpy's OpenBLAS thread count and the threads the process
had before the script started any, its environment (`os.environ`, and the C library's as
`getenv` sees it for the variables torch and the runtime read), a draw of torch's and numpy's
global generators (no seed set: a fresh process draws its own), whether faulthandler is on,
sys.argv, sys.path[0], __name__ and the exception being handled (none), after an all_reduce
over gloo."""

import ctypes
import json
import os
import sys

import numpy
import torch
import torch.distributed as dist

libc = ctypes.CDLL(None)
libc.getenv.restype = ctypes.c_char_p
TASKS = len(os.listdir("/proc/self/task"))  # threads before the job started any: its libraries'


def blas_threads() -> int | None:
    """numpy's OpenBLAS thread count (None: not found)."""
    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "openblas" in ln.lower() and "/" in ln})
    for path in paths:
        lib = ctypes.CDLL(path)
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_"):
            fn = getattr(lib, name, None)
            if fn is not None:
                return int(fn())
    return None


def c_getenv(name: str) -> str | None:
    value = libc.getenv(name.encode())
    return None if value is None else value.decode()


def main() -> None:
    import faulthandler

    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    names = ("OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "FTRUN_REPLACEMENT", "PYTHONFAULTHANDLER")
    info = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "threads": torch.get_num_threads(),
        "tasks": TASKS,
        "blas_threads": blas_threads(),
        "env": dict(os.environ),
        "environb": {os.fsdecode(k): os.fsdecode(v) for k, v in os.environb.items()},
        "c_env": {n: c_getenv(n) for n in names},
        "torch_draw": torch.rand(1).item(),
        "numpy_draw": float(numpy.random.rand()),
        "faulthandler": faulthandler.is_enabled(),
        "argv": sys.argv,
        "path0": sys.path[0],
        "name": __name__,
        "handling": repr(sys.exc_info()[0]),
        "sum": t.item(),
    }
    print(f"rank {dist.get_rank()} pid {info['pid']} ppid {info['ppid']} threads {info['threads']}")
    out = os.path.join(os.environ["OUT_DIR"], f"start.{os.environ['RANK']}.json")
    with open(out, "w") as f:
        json.dump(info, f, sort_keys=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
