"""Fault memory per device: how often each device had an uncorrectable memory error (UCE).

Owns: a small JSON state file (`fault_memory.json` in the base log directory, so it outlives one
launch) and the seed's rule that a second UCE on the same device within 24 hours stops in-place
retries on it. Writes are atomic (temp file, fsync, rename); a damaged file is set aside, not
trusted.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

WINDOW_S = 24 * 3600.0
REPEAT_UCE = 2  # this many UCEs on one device within the window: no more in-place retries


@dataclass
class FaultMemory:
    path: str
    window_s: float = WINDOW_S

    def _load(self) -> dict[str, list[float]]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            os.replace(self.path, self.path + ".corrupt")
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            str(k): [float(t) for t in v]
            for k, v in data.get("uce", {}).items()
            if isinstance(v, list)
        }

    def _save(self, uce: dict[str, list[float]]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = f"{self.path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"uce": uce}, f, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def record_uce(self, device: str, now: float | None = None) -> int:
        """Record a UCE on `device`; return how many it had within the window (this one
        included)."""
        now = time.time() if now is None else now
        uce = self._load()
        times = [t for t in uce.get(device, []) if now - t < self.window_s]
        times.append(now)
        uce[device] = times
        self._save(uce)
        return len(times)

    def uce_count(self, device: str, now: float | None = None) -> int:
        now = time.time() if now is None else now
        return sum(1 for t in self._load().get(device, []) if now - t < self.window_s)

    def record_uce_evidence(self, device: str, now: float | None = None) -> dict:
        """Record a UCE on `device`; the evidence a fault report carries for the decision
        (`repeat_uce`: the device reached REPEAT_UCE within the window)."""
        count = self.record_uce(device, now)
        return {"device": device, "uce_count_24h": count, "repeat_uce": count >= REPEAT_UCE}
