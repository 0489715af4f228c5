"""Optimizers and schedules (`conf/optim/`, `conf/schedule/`; spec §3).

`build_optimizer(cfg)` returns one optax GradientTransformation with the schedule inside:
- `adamw`: AdamW on every parameter.
- `muonh`: MuonH on matrices, AdamH on the output head, Adam on the rest, chosen per parameter
  by `param_groups` (explicit rules on whole path components).
Peak learning rates per group come from `marin.config.derive.group_lrs` (the spec's rule lives
there); the schedule scales them by the step. The optimizer's update count is the train step.
"""
from __future__ import annotations

import optax

from marin.config.derive import group_lrs
from marin.config.schema import Config
from marin.optim.groups import ADAM, ADAMH, ADAMW, MUONH, param_groups
from marin.optim.muonh import adamh, muonh
from marin.optim.schedule import lr_at, lr_schedule

__all__ = ["build_optimizer", "param_groups", "lr_at"]


def build_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The optimizer of a resolved config, learning-rate schedule included."""
    o = cfg.optim
    peaks = {group: lr_schedule(cfg, peak) for group, peak in group_lrs(cfg).items()}
    if o.name == "adamw":
        core = optax.adamw(peaks[ADAMW], b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay)
    elif o.name == "muonh":
        core = optax.multi_transform(
            {
                MUONH: muonh(peaks[MUONH], momentum=o.momentum, ns_steps=o.ns_steps),
                ADAMH: adamh(peaks[ADAMH], b1=o.b1, b2=o.b2, eps=o.eps),
                ADAM: optax.adam(peaks[ADAM], b1=o.b1, b2=o.b2, eps=o.eps),
            },
            lambda params: param_groups(params, "muonh"),
        )
    else:
        raise ValueError(f"unknown optim.name {o.name!r}")
    if o.grad_clip is None:
        return core
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), core)
