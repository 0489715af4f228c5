"""Per-layer, per-expert routing load over training, kept as one small array file in the run
directory (`expert_load.npz`: ``steps`` [n], ``load`` [n, L, E] float32, each row a layer's
fraction of assignments per expert) and logged to MLflow as an artifact at the end.

Why not MLflow metrics: the hero run has L × E = 60 × 384 values per snapshot, which would be
23,000 metric series. Snapshots are taken at the log cadence but at most `MAX_SNAPSHOTS` times per
run (the cadence is widened to a multiple of `train.log_every`), so the file stays a few tens of
MB for the largest model and the loop does nothing extra on the other steps. A resumed run keeps
the snapshots written before the step it resumes from. Only process 0 writes.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

FILE = "expert_load.npz"
MAX_SNAPSHOTS = 256


def cadence(log_every: int, total_steps: int) -> int:
    """Steps between snapshots: a multiple of `log_every`, at most MAX_SNAPSHOTS per run."""
    log_every = max(1, int(log_every))
    wanted = -(-max(1, int(total_steps)) // MAX_SNAPSHOTS)
    return log_every * -(-wanted // log_every)


def read(run_dir: str | Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps [n], load [n, L, E]) of a run, or None when it has no snapshots."""
    path = Path(run_dir) / FILE
    if not path.is_file():
        return None
    with np.load(path) as data:
        return data["steps"], data["load"]


class ExpertLoadLog:
    """`add(step, load [L, E])` at every logged step; `save()` writes what was kept."""

    def __init__(self, run_dir: str | Path, start: int, total_steps: int, log_every: int, enabled: bool = True):
        self.path = Path(run_dir) / FILE
        self.every = cadence(log_every, total_steps)
        self.enabled = enabled
        self.steps: list[int] = []
        self.loads: list[np.ndarray] = []
        self._dirty = False
        old = read(run_dir) if enabled else None
        if old is not None:  # a resumed run from state `start` (start updates taken): keep steps 1…start
            keep = old[0] <= start
            self.steps, self.loads = list(old[0][keep]), list(old[1][keep])

    def wants(self, step: int, last: bool = False) -> bool:
        return self.enabled and (step % self.every == 0 or last)

    def add(self, step: int, load) -> None:
        self.steps.append(int(step))
        self.loads.append(np.asarray(load, np.float32))
        self._dirty = True

    def save(self) -> Path | None:
        """Write the file (atomically) if anything was added since the last save."""
        if not (self.enabled and self._dirty and self.steps):
            return None
        tmp = self.path.with_name(self.path.name + ".tmp.npz")
        np.savez_compressed(tmp, steps=np.asarray(self.steps, np.int64), load=np.stack(self.loads))
        tmp.replace(self.path)
        self._dirty = False
        return self.path
