"""Optimizers and schedules (`conf/optim/`, `conf/schedule/`; spec §3).

`build_optimizer(cfg)` returns one optax GradientTransformation with the schedule inside:
- `adamw`: AdamW on every parameter.
- `muonh`: MuonH on matrices, AdamH on the output head, Adam on the rest, chosen per parameter
  by `param_groups` (explicit rules on whole path components).
Every group ends with the scheduled weight decay of `optim.decay` (`marin.optim.decay`).
Peak learning rates per group come from `marin.config.derive.group_lrs` (the spec's rule lives
there); the schedule scales them by the step. The optimizer's update count is the train step.

Importing this package does not import JAX (`build_optimizer` does): config validation uses
`marin.optim.decay` and `marin.optim.groups`.
"""
from __future__ import annotations

from marin.config.derive import group_lrs
from marin.config.schema import Config
from marin.optim.groups import ADAM, ADAMH, ADAMW, MUONH, param_groups
from marin.optim.schedule import lr_at, lr_schedule

__all__ = ["build_optimizer", "param_groups", "lr_at"]


def build_optimizer(cfg: Config):
    """The optimizer (an optax GradientTransformation) of a resolved config, learning-rate
    schedule and weight-decay rules included."""
    import jax.numpy as jnp
    import optax

    from marin.optim.decay import scheduled_decay
    from marin.optim.muonh import adamh, muonh

    o = cfg.optim
    peaks = {group: lr_schedule(cfg, peak) for group, peak in group_lrs(cfg).items()}

    def decayed(group: str, core: optax.GradientTransformation) -> optax.GradientTransformation:
        return optax.chain(core, scheduled_decay(peaks[group], list(o.decay), group))

    if o.name == "adamw":
        core = decayed(ADAMW, optax.adamw(peaks[ADAMW], b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay))
    elif o.name == "muonh":
        ns_dtype = jnp.dtype(o.ns_dtype)
        core = optax.multi_transform(
            {
                MUONH: decayed(MUONH, muonh(peaks[MUONH], momentum=o.momentum, ns_steps=o.ns_steps,
                                            ns_dtype=ns_dtype, ns_eps=o.ns_eps)),
                ADAMH: decayed(ADAMH, adamh(peaks[ADAMH], b1=o.b1, b2=o.b2, eps=o.eps)),
                ADAM: decayed(ADAM, optax.adam(peaks[ADAM], b1=o.b1, b2=o.b2, eps=o.eps)),
            },
            lambda params: param_groups(params, "muonh"),
        )
    else:
        raise ValueError(f"unknown optim.name {o.name!r}")
    if o.grad_clip is None:
        return core
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), core)
