"""The allowed range of every numeric leaf of the schema, in one table.

`numeric_leaves()` walks the dataclasses of `marin.config.schema` (nested ones included) and
lists every int/float leaf, with whether it may be null (``Optional``) or ``auto``. `RANGES`
gives each of them its range; `tests/config/test_numeric_leaves.py` fails when a numeric field is
added without one, so no new field goes unchecked. On top of its range every leaf must be finite
(NaN and infinities are refused everywhere) and an integer leaf must fit int32: the model's
index maths (dispatch slots, router histograms, token counts) is int32 on the device.

Pure Python: no JAX.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Any

from marin.config import derive
from marin.config.schema import Config

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class Range:
    """``lo ≤ value ≤ hi`` (``<`` where open); `integer` leaves must be whole numbers."""
    integer: bool
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def describe(self) -> str:
        kind = "an integer" if self.integer else "a finite number"
        hi = INT32_MAX if self.integer and self.hi is None else self.hi
        if self.lo is not None and hi is not None:
            return f"{kind} in {'(' if self.lo_open else '['}{_fmt(self.lo)}, {_fmt(hi)}{')' if self.hi_open else ']'}"
        if self.lo is not None:
            return f"{kind} {'>' if self.lo_open else '≥'} {_fmt(self.lo)}"
        return kind

    def allows(self, value) -> bool:
        if self.integer and (not isinstance(value, int) or abs(value) > INT32_MAX):
            return False
        if not math.isfinite(value):
            return False
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        if self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi):
            return False
        return True


def _fmt(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def count(lo: int = 0, hi: int | None = None) -> Range:
    return Range(True, lo, hi)


def real(lo: float | None = None, hi: float | None = None, lo_open: bool = False, hi_open: bool = False) -> Range:
    return Range(False, lo, hi, lo_open, hi_open)


POSITIVE = real(0.0, lo_open=True)
NON_NEGATIVE = real(0.0)
FRACTION = real(0.0, 1.0)
BETA = real(0.0, 1.0, hi_open=True)       # Adam's b1/b2, momentum: 1 would never forget

RANGES: dict[str, Range] = {
    # model
    "model.d_model": count(1), "model.num_layers": count(1), "model.vocab_size": count(1),
    "model.num_experts": count(1), "model.expert_width": count(1), "model.latent_dim": count(1),
    "model.num_shared_experts": count(0), "model.shared_width": count(1),
    "model.capacity_factor": POSITIVE, "model.ep_send_capacity_factor": POSITIVE,
    "model.ep_recv_capacity_factor": POSITIVE, "model.ep_waves": count(1), "model.gated_norm_rank": count(0), "model.conv_kernel": count(0),
    "model.norm_eps": POSITIVE, "model.init_std": POSITIVE, "model.z_loss": NON_NEGATIVE,
    # attention
    "attention.head_dim": count(1), "attention.num_heads": count(1), "attention.kv_heads_local": count(1),
    "attention.kv_heads_global": count(1), "attention.window": count(1),
    "attention.global_every": count(0),  # 0: no periodic global layers (the last one, if asked)
    "attention.rope_fraction": FRACTION, "attention.rope_theta": POSITIVE, "attention.qk_mult": POSITIVE,
    "attention.qk_mult_base": POSITIVE, "attention.qk_norm_eps": POSITIVE,
    # router
    "router.top_k": count(1), "router.combine_sum": POSITIVE, "router.qb_bins": count(2),
    "router.aux_loss_weight": NON_NEGATIVE, "router.bias_update_rate": NON_NEGATIVE,
    # data (list leaves — source weights, phase boundaries — are checked by marin.data.mixture)
    "data.max_epochs": POSITIVE, "data.cells_expected": count(1),
    # hardware
    "hardware.nodes": count(1), "hardware.tasks_per_node": count(1), "hardware.gpus_per_node": count(0),
    "hardware.host_devices": count(1), "hardware.cpus_per_task": count(1), "hardware.mem_gb": count(1),
    "hardware.time_min": count(1), "hardware.max_requeues": count(0), "hardware.signal_delay_s": count(0),
    "hardware.init_timeout_s": count(1), "hardware.peak_flops_per_device": NON_NEGATIVE,
    "hardware.memory_per_device_gib": POSITIVE, "hardware.memory_usable_fraction": real(0.0, 1.0, lo_open=True),
    "hardware.mesh.replica_dcn": count(1), "hardware.mesh.data": count(1), "hardware.mesh.expert": count(1),
    "hardware.mesh.model": count(1),
    # optim
    "optim.lr": POSITIVE, "optim.muonh_lr_ratio": POSITIVE, "optim.adam_lr_cap": POSITIVE,
    "optim.b1": BETA, "optim.b2": BETA, "optim.eps": POSITIVE, "optim.weight_decay": NON_NEGATIVE,
    "optim.momentum": BETA, "optim.ns_steps": count(1), "optim.grad_clip": POSITIVE, "optim.ns_eps": POSITIVE,
    # schedule
    "schedule.warmup_frac": FRACTION, "schedule.final_ratio": FRACTION, "schedule.horizon_steps": count(1),
    "schedule.horizon_from_step": count(0),
    # train
    "train.steps": count(1), "train.stop_after": count(1), "train.tokens_per_active_param": POSITIVE,
    "train.seq_len": count(1), "train.global_batch": count(1), "train.micro_batch": count(1),
    "train.seed": count(0), "train.eval_every": count(0), "train.eval_batches": count(1),
    "train.log_every": count(1), "train.init_seq_len": count(1),
    "train.stage_start": real(0.0, 1.0, hi_open=True), "train.stage_end": real(0.0, 1.0, lo_open=True),
    "train.checkpoint.every_steps": count(0), "train.checkpoint.keep_last": count(0),
    "train.checkpoint.permanent_every": count(0), "train.checkpoint.every_minutes": NON_NEGATIVE,
    # root
    "verify_rtol": NON_NEGATIVE,
    "schema_version": count(Config.schema_version, Config.schema_version),
}


@dataclass(frozen=True)
class Leaf:
    name: str          # dotted
    integer: bool
    nullable: bool     # Optional[...]: null allowed
    auto: bool         # "auto" allowed


def _numeric(hint, default) -> tuple[bool, bool] | None:
    """(integer, nullable) for a numeric type hint; None for other leaves."""
    args = typing.get_args(hint)
    nullable = typing.get_origin(hint) is typing.Union and type(None) in args
    if nullable:
        hint = next(a for a in args if a is not type(None))
    if hint in (int, float):
        return hint is int, nullable
    if hint is Any and (derive.is_auto(default) or (isinstance(default, (int, float)) and not isinstance(default, bool))):
        return not isinstance(default, float), nullable   # `auto` ints (steps, num_heads…) or numbers (lr…)
    return None


def numeric_leaves(cls=Config, prefix: str = "") -> list[Leaf]:
    """Every int/float leaf of the schema, nested dataclasses included (lists are not walked)."""
    leaves = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        if dataclasses.is_dataclass(hint):
            leaves += numeric_leaves(hint, f"{prefix}{f.name}.")
            continue
        if (kind := _numeric(hint, default)) is not None:
            integer, nullable = kind
            if f"{prefix}{f.name}" in _FLOAT_AUTO:
                integer = False
            leaves.append(Leaf(f"{prefix}{f.name}", integer, nullable, derive.is_auto(default) or hint is Any))
    return leaves


# `auto` leaves whose number is a float (the others — steps, widths, heads — are integers).
_FLOAT_AUTO = {"model.init_std", "attention.qk_mult", "attention.qk_norm_eps", "optim.lr", "optim.b2", "optim.eps"}


def _get(cfg, dotted: str):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def check(cfg: Config) -> list[tuple[str, str]]:
    """``(field, what is allowed)`` for every numeric leaf outside its range."""
    problems = []
    for leaf in numeric_leaves():
        value = _get(cfg, leaf.name)
        if value is None and leaf.nullable or leaf.auto and derive.is_auto(value):
            continue
        rule = RANGES.get(leaf.name) or Range(leaf.integer)  # a leaf missing from the table: at least finite
        rule = dataclasses.replace(rule, integer=leaf.integer or rule.integer)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not rule.allows(value):
            extra = ("'auto' or " if leaf.auto else "") + ("null or " if leaf.nullable else "")
            problems.append((leaf.name, f"must be {extra}{rule.describe()}; got {value!r}"))
    return problems
