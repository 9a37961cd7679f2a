"""Durable checkpoints in Megatron's directory layout.

Owns: the files of a durable checkpoint and their atomicity:
    <dir>/iter_0000123_tmp/<shard>/model_optim_rng.pt   written first (temp file, fsync, rename)
    <dir>/iter_0000123/                                  the tmp dir renamed once every shard is in
    <dir>/latest_checkpointed_iteration.txt              "123", replaced atomically afterwards
A save killed at any point leaves the previous checkpoint and tracker intact; leftover `_tmp`
directories are ignored by readers and overwritten by the next save of that iteration.
Iteration N means N steps are complete: loading it resumes at step N. Files hold only tensors
and primitives (numpy RNG arrays are stored as tensors), so they load with weights_only=True.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

TRACKER = "latest_checkpointed_iteration.txt"
FILENAME = "model_optim_rng.pt"


def iter_dir(root: str | os.PathLike, iteration: int, tmp: bool = False) -> Path:
    if iteration < 0:
        raise ValueError(f"checkpoint iteration {iteration} must be >= 0")
    return Path(root) / (f"iter_{iteration:07d}" + ("_tmp" if tmp else ""))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _encode_rng(rng: dict) -> dict:
    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    return {
        **rng,
        "numpy": [
            kind,
            torch.from_numpy(np.asarray(keys).copy()),
            int(pos),
            int(has_gauss),
            float(gauss),
        ],
    }


def _decode_rng(rng: dict) -> dict:
    kind, keys, pos, has_gauss, gauss = rng["numpy"]
    py = rng["python"]
    python = (py[0], tuple(py[1]), py[2]) if isinstance(py, (list, tuple)) else py
    return {
        **rng,
        "python": python,
        "numpy": (kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss),
    }


def write_shard(root: str | os.PathLike, iteration: int, shard: str, state: dict) -> Path:
    """Write one shard's file into the iteration's tmp directory (atomic, fsync'd)."""
    d = iter_dir(root, iteration, tmp=True) / shard
    d.mkdir(parents=True, exist_ok=True)
    _fsync_dir(d.parent)
    payload = {**state, "rng": _encode_rng(state["rng"]), "iteration": iteration, "shard": shard}
    target = d / FILENAME
    _atomic_write(target, lambda f: torch.save(payload, f))
    return target


def commit(root: str | os.PathLike, iteration: int, shards: list[str]) -> Path:
    """Rename iter_N_tmp -> iter_N once every shard file exists, then update the tracker."""
    root = Path(root)
    tmp = iter_dir(root, iteration, tmp=True)
    missing = [s for s in shards if not (tmp / s / FILENAME).is_file()]
    if missing:
        raise RuntimeError(f"checkpoint {tmp} lacks shard(s) {missing}; not committing")
    for s in shards:
        _fsync_dir(tmp / s)
    _fsync_dir(tmp)
    final = iter_dir(root, iteration)
    if final.exists():  # the same iteration saved again (after a restart-all): replace it
        old = root / f".{final.name}.old.{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(root)
    _atomic_write(root / TRACKER, lambda f: f.write(f"{iteration}\n".encode()))
    return final


def latest(root: str | os.PathLike) -> int | None:
    """The committed iteration the tracker names, or None when there is none."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise RuntimeError(f"{tracker} holds {text!r}, not an iteration number") from None
    if not iter_dir(root, iteration).is_dir():
        raise RuntimeError(
            f"{tracker} names iteration {iteration} but {iter_dir(root, iteration)} is missing"
        )
    return iteration


def read_shard(root: str | os.PathLike, iteration: int, shard: str) -> dict:
    path = iter_dir(root, iteration) / shard / FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("iteration") != iteration or state.get("shard") != shard:
        raise RuntimeError(
            f"{path} holds iteration {state.get('iteration')} shard {state.get('shard')!r}, "
            f"expected {iteration} {shard!r}"
        )
    state["rng"] = _decode_rng(state["rng"])
    return state
