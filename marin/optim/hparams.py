"""The optimizer's numbers as inputs of the train step, not constants in it (compile-once sweeps).

A sweep over learning rates, betas, eps, weight decay, decay rules, warmup or steps changes only
numbers. Were they Python floats closed over by the optimizer, each would be baked into the
compiled step as a constant: every sweep point a new XLA program (a 20 s compile on `model=tiny`)
and a new key in JAX's persistent compilation cache. Instead `values(cfg)` gathers them into a
small pytree of float32 scalars (and the schedule's breakpoints, padded to a fixed length) that
the jitted train step takes as an argument; `build_optimizer(cfg, hp)` builds the optimizer from
it while tracing. What stays static is the structure: optimizer name, which groups, decay rule
patterns, Newton–Schulz steps and dtype, whether clipping is on — `structure_key(cfg)` is the
config with the numbers blanked, under which `marin.train.step.jit_steps` reuses one jitted step
in a process. Across processes the lowered program is the same text, so the persistent cache hits.

Pure NumPy: importing this module does not import JAX.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from marin.config.derive import group_lrs
from marin.config.schema import Config
from marin.optim.decay import origin_of
from marin.optim.schedule import breakpoints

# Most breakpoints a schedule has (marin.optim.schedule.breakpoints: start of warmup, peak,
# horizon change, last step); shorter lists are padded flat so the input's shape never changes.
SCHEDULE_POINTS = 4

OPTIM_NUMBERS = ("lr", "muonh_lr_ratio", "adam_lr_cap", "b1", "b2", "eps", "weight_decay", "momentum", "ns_eps")


def padded_breakpoints(cfg: Config) -> tuple[np.ndarray, np.ndarray]:
    """The schedule's (steps, multipliers) as two float32 arrays of length SCHEDULE_POINTS,
    padded past the last breakpoint with the same multiplier (steps kept strictly increasing,
    so `interp` gives the same curve)."""

    xs, ys = breakpoints(cfg)
    while len(xs) < SCHEDULE_POINTS:
        xs, ys = [*xs, xs[-1] + 1.0], [*ys, ys[-1]]
    return np.asarray(xs, np.float32), np.asarray(ys, np.float32)


def values(cfg: Config) -> dict:
    """Every number of a resolved config the train step's optimizer reads, as float32 scalars:
    {peaks: {group: lr}, b1, b2, eps, weight_decay, momentum, ns_eps, [grad_clip],
    schedule: (steps[4], multipliers[4]), decay: [(value, start, end, origin) per rule]}."""
    o, f32 = cfg.optim, np.float32
    hp = {"peaks": {group: f32(peak) for group, peak in group_lrs(cfg).items()},
          "b1": f32(o.b1), "b2": f32(o.b2), "eps": f32(o.eps), "weight_decay": f32(o.weight_decay),
          "momentum": f32(o.momentum), "ns_eps": f32(o.ns_eps),
          "schedule": padded_breakpoints(cfg),
          "decay": [(f32(r.value), f32(r.start), f32(r.end), f32(origin_of(r))) for r in o.decay]}
    if o.grad_clip is not None:
        hp["grad_clip"] = f32(o.grad_clip)
    return hp


def structure_key(cfg: Config) -> str:
    """What the train and eval steps are traced from, with the numbers `values` carries blanked:
    two configs with the same key trace the same steps (run names, step counts, checkpointing,
    evaluation cadence and the schedule never enter them)."""
    o, t = cfg.optim, cfg.train
    optim = dataclasses.replace(
        o, **{name: 0.0 for name in OPTIM_NUMBERS},
        grad_clip=None if o.grad_clip is None else 0.0,
        decay=[dataclasses.replace(r, value=0.0, start=0, end=0, origin=0) for r in o.decay])
    train = (t.seq_len, t.global_batch, t.micro_batch, cfg.eval.with_drops, t.init_seq_len, t.earlier_seq_lens)
    return repr((cfg.model, cfg.attention, cfg.router, cfg.data, cfg.hardware, optim, train))
