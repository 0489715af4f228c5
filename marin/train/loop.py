"""Training's entry point, shared by in-process runs (marin.launch.local), resume= and every
Slurm task (marin.launch.slurm's DEFAULT_ENTRY).

    train(cfg, record)   a Trainer (marin.train.trainer) for the record's run, from its newest
                         checkpoint if it has one
"""
from __future__ import annotations

from marin.train.trainer import Trainer


def train(cfg, rec, loader=None, on_restored=None) -> dict:
    """Train the run of `rec` (see marin.train.trainer for its endings). `on_restored(step)` is
    called once the checkpoint is restored (resume= records the resume only then)."""
    return Trainer(cfg, rec, loader, on_restored).fit()
