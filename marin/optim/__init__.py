"""Optimizers and schedules (`conf/optim/`, `conf/schedule/`; spec §3).

`build_optimizer(cfg)` returns one optax GradientTransformation with the schedule inside:
- `adamw`: AdamW on every parameter.
- `muonh`: MuonH on matrices, AdamH on the output head, Adam on the rest, chosen per parameter
  by `param_groups` (explicit rules on whole path components).
Every group ends with the scheduled weight decay of `optim.decay` (`marin.optim.decay`).
Peak learning rates per group come from `marin.config.derive.group_lrs` (the spec's rule lives
there); the schedule scales them by the step. The optimizer's update count is the train step.
Every number (lrs, betas, eps, decay values, the schedule's breakpoints) is read from `hp`
(`marin.optim.hparams.values`): the train step takes it as an input, so a sweep over these
compiles one step (README "Sweeps compile once").

Importing this package does not import JAX (`build_optimizer` does): config validation uses
`marin.optim.decay` and `marin.optim.groups`.
"""
from __future__ import annotations

from marin.config.schema import Config
from marin.optim.decay import scheduled_decay
from marin.optim.groups import ADAM, ADAMH, ADAMW, MUONH, param_groups
from marin.optim.hparams import values
from marin.optim.schedule import interp_schedule, lr_at

__all__ = ["build_optimizer", "param_groups", "lr_at"]


def build_optimizer(cfg: Config, hp: dict | None = None):
    """The optimizer (an optax GradientTransformation) of a resolved config, learning-rate
    schedule and weight-decay rules included. Its numbers come from `hp` (the pytree of
    `marin.optim.hparams.values(cfg)`, traced inside the train step), or from `cfg` when None;
    `cfg` gives only the structure (optimizer, groups, rule patterns, Newton–Schulz steps/dtype)."""
    import jax.numpy as jnp
    import optax

    from marin.optim.muonh import adamh, muonh  # JAX: optim.decay and the schedule are on the config path

    o = cfg.optim
    hp = values(cfg) if hp is None else hp
    peaks = {group: interp_schedule(peak, *hp["schedule"]) for group, peak in hp["peaks"].items()}

    def decayed(group: str, core: optax.GradientTransformation) -> optax.GradientTransformation:
        return optax.chain(core, scheduled_decay(peaks[group], list(o.decay), group, numbers=hp["decay"]))

    b1, b2, eps = hp["b1"], hp["b2"], hp["eps"]
    if o.name == "adamw":
        core = decayed(ADAMW, optax.adamw(peaks[ADAMW], b1=b1, b2=b2, eps=eps, weight_decay=hp["weight_decay"]))
    elif o.name == "muonh":
        ns_dtype = jnp.dtype(o.ns_dtype)
        core = optax.multi_transform(
            {
                MUONH: decayed(MUONH, muonh(peaks[MUONH], momentum=hp["momentum"], ns_steps=o.ns_steps,
                                            ns_dtype=ns_dtype, ns_eps=hp["ns_eps"],
                                            ns_coefficients=o.ns_coefficients)),
                ADAMH: decayed(ADAMH, adamh(peaks[ADAMH], b1=b1, b2=b2, eps=eps)),
                ADAM: decayed(ADAM, optax.adam(peaks[ADAM], b1=b1, b2=b2, eps=eps)),
            },
            lambda params: param_groups(params, "muonh"),
        )
    else:
        raise ValueError(f"unknown optim.name {o.name!r}")
    if o.grad_clip is None:
        return core
    return optax.chain(optax.clip_by_global_norm(hp["grad_clip"]), core)
