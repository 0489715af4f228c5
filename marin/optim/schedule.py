"""Learning-rate schedules, registered under `schedule.name` (`@SCHEDULES.register`), with the
option file conf/schedule/<name>.yaml: `warmup_linear` (spec §3, failure plan §7).

The multiplier of the peak lr is a pure function of the step and the resolved config — a
piecewise-linear curve through a few breakpoints — so a resumed run recomputes the same values
and a changed horizon needs no schedule state:

    (0, 0) … (W, 1)                     linear warmup over W = max(1, int(warmup_frac·steps))
    (W, 1) … (H−1, final_ratio)         linear decay; H = schedule.horizon_steps or train.steps

As production (spec §9, Levanter's warmup = optax.linear_schedule(0, peak, W)): lr(0) = 0, so
the first update moves only the optimizer's moments, and the peak is reached at step W. Past
H−1 the lr stays at final_ratio·peak. (The curve is interpolated from breakpoints rather than
built from optax's schedules so that its numbers can be inputs of the compiled step:
`interp_schedule`; tests/optim/test_schedule.py compares it with optax's at 0 and W.)

Shortening the horizon mid-run (the failure plan): with `schedule.horizon_from_step = s0` the
curve follows the original plan (decay to step train.steps−1) up to s0 and from there decays
linearly to final_ratio at the new last step H−1, so the lr is continuous at s0. Without it the
whole decay is laid out for H, as if H had been planned from the start (right for a fresh run;
for a resumed one the lr would drop at the resume step). Only one shortening is expressible: a
second one would need the history of horizons.
"""
from __future__ import annotations

import numpy as np

from marin.config import derive
from marin.config.derive import group_lrs
from marin.config.registry import SCHEDULES
from marin.config.schema import Config


def warmup_steps(cfg: Config) -> int:
    return derive.warmup_steps(cfg)  # int(warmup_frac · steps), as production


def breakpoints(cfg: Config) -> tuple[list[float], list[float]]:
    """(steps, multipliers) of the piecewise-linear schedule `schedule.name`, steps strictly increasing."""
    return SCHEDULES.get(cfg.schedule.name)(cfg)


@SCHEDULES.register("warmup_linear")
def warmup_linear(cfg: Config) -> tuple[list[float], list[float]]:
    """Linear warmup to peak, then linear decay to final_ratio at the horizon (module docstring)."""
    s, steps = cfg.schedule, cfg.train.steps
    peak_step = warmup_steps(cfg)   # W ≥ 1
    xs, ys = [0.0, float(peak_step)], [0.0, 1.0]

    last = (s.horizon_steps or steps) - 1
    start = s.horizon_from_step
    if start is not None and start > peak_step:
        if not start < last:
            raise ValueError(f"schedule.horizon_from_step must be < horizon_steps − 1 ({last}); got {start}")
        planned_last = steps - 1  # the original plan, followed until the horizon changed
        ys.append(float(np.interp(start, [peak_step, planned_last], [1.0, s.final_ratio])))
        xs.append(float(start))
    if last > xs[-1]:  # a run shorter than its warmup just stays at peak
        xs.append(float(last))
        ys.append(s.final_ratio)
    return xs, ys


def interp_schedule(peak, xs, ys):
    """An optax schedule, peak × the multiplier at the optimizer's update count (= train step),
    from arrays (possibly traced: `marin.optim.hparams`), so neither the peak nor the
    breakpoints are constants of the compiled step."""
    import jax.numpy as jnp

    return lambda count: peak * jnp.interp(jnp.asarray(count, jnp.float32), xs, ys)


def lr_at(cfg: Config, step: int) -> dict[str, float]:
    """{group: lr} applied at `step` (for logging; plain NumPy, no device work)."""
    scale = float(np.interp(step, *breakpoints(cfg)))
    return {group: peak * scale for group, peak in group_lrs(cfg).items()}
