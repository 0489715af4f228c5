"""Whether a run fits its devices' memory, from the estimate of `marin.model.accounting`: what the
dry run prints (marin/launch/plan.py) and what a Slurm submission refuses (marin/launch/slurm.py).
Pure Python, no JAX."""
from __future__ import annotations

from marin.config import derive
from marin.config.schema import Config
from marin.model import accounting


def fits(cfg: Config, estimate_gib: float) -> bool | None:
    """Whether the estimate is within derive.memory_limit_gib; None where the hardware has no figure."""
    limit = derive.memory_limit_gib(cfg.hardware)
    return None if limit is None else estimate_gib <= limit


def device_peak(cfg: Config) -> float:
    """The larger of the train step's and the eval step's estimates (GiB per device)."""
    return max(accounting.memory_per_device(cfg)["total"], accounting.eval_memory_per_device(cfg))


def over_memory(cfg: Config) -> str | None:
    """One line with the figures when the run's memory estimate exceeds the device's usable
    memory (None when it fits or the hardware has no figure)."""
    hw = cfg.hardware
    train, evaluation = accounting.memory_per_device(cfg)["total"], accounting.eval_memory_per_device(cfg)
    estimate = max(train, evaluation)
    if fits(cfg, estimate) is not False:
        return None
    step = "train" if train >= evaluation else "eval"
    return (f"memory: the estimate is {estimate:.1f} GiB per device ({step} step), over the {derive.memory_limit_gib(hw):.1f} GiB "
            f"this hardware allows ({hw.name}: hardware.memory_per_device_gib {hw.memory_per_device_gib} × "
            f"memory_usable_fraction {hw.memory_usable_fraction}); lower train.micro_batch, offload "
            f"(optim.offload, model.remat) or set plan.allow_over_memory=true")
