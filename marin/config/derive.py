"""Derived values: the only place where numbers are computed from the config.

`resolve(cfg)` returns a copy of the composed config with every ``auto`` replaced by its value
(head counts, KV heads, MoE widths, init std, qk_mult after context extensions, the attention kernel, the
data-parallel size, steps from the token budget, micro-batch, and the learning-rate / β2 / ε
rule). Everything downstream reads the resolved config; the composed one (with its ``auto``
leaves) is what a run saves for reproduction, so derived values are recomputed when a run is
reproduced.

Pure Python: importing this module never imports JAX.
"""
from __future__ import annotations

import copy
import math

from marin.config.counts import active_params
from marin.config.fields import is_auto
from marin.config.schema import Config, HardwareConfig

REMAT_MODES = ("none", "full", "dots")


def remat_mode(remat) -> str:
    """`model.remat` as one of REMAT_MODES (true and false are aliases of full and none)."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    return remat


def attention_impl(cfg: Config) -> str:
    """`attention.impl`; ``auto`` = cuDNN's fused kernel on GPUs when the compute dtype is 16-bit
    (cuDNN has no float32 flash attention), else the blockwise kernel (any backend)."""
    impl = cfg.attention.impl
    if not is_auto(impl):
        return impl
    gpu_kernel = cfg.hardware.platform == "gpu" and cfg.model.compute_dtype == "bfloat16"
    return "cudnn" if gpu_kernel else "blockwise"


def attention_kernel(cfg: Config) -> str:
    """The attention kernel that will really run, in words (the plan's line): cudnn runs cuDNN's
    packed-row kernel up to `attention.cudnn_max_documents` documents a row, blockwise beyond."""
    impl = attention_impl(cfg)
    if impl == "cudnn":
        return (f"cudnn (packed rows, segment offsets, ≤ {cfg.attention.cudnn_max_documents} documents "
                "a row; blockwise beyond)")
    return impl


def devices_per_process(hw: HardwareConfig) -> int:
    if hw.platform == "gpu":
        return max(1, hw.gpus_per_node // max(1, hw.tasks_per_node))
    return max(1, hw.host_devices)


def total_nodes(hw: HardwareConfig) -> int:
    """Nodes of the job: racks × nodes of one rack (what Slurm is asked for)."""
    return hw.racks * hw.nodes


def process_count(hw: HardwareConfig) -> int:
    """JAX processes of the job: total nodes × processes per node."""
    return total_nodes(hw) * hw.tasks_per_node


def device_count(hw: HardwareConfig) -> int:
    """Devices the job sees: total nodes × processes per node × devices per process."""
    return process_count(hw) * devices_per_process(hw)


def memory_limit_gib(hw: HardwareConfig) -> float | None:
    """GiB per device a run may plan to use (`memory_per_device_gib × memory_usable_fraction`);
    None where the hardware has no memory figure (CPU)."""
    if hw.memory_per_device_gib is None:
        return None
    return hw.memory_per_device_gib * hw.memory_usable_fraction


def batch_shards(hw: HardwareConfig) -> int:
    """How many ways the global batch is split: every mesh axis but `model` holds its own tokens."""
    m = hw.mesh
    return m.replica_dcn * int(m.data) * m.expert


def qk_mult_for_length(qk_mult_old: float, old_len: int, new_len: int) -> float:
    """Context-extension rule: qk_mult_new = qk_mult_old · (1 + 0.1 · ln(new_len / old_len))."""
    return qk_mult_old * (1.0 + 0.1 * math.log(new_len / old_len))


def qk_mult_through(qk_mult_base: float, seq_lens: list[int]) -> float:
    """qk_mult after extending the context through `seq_lens` (the pretraining length first):
    the rule applied once per extension, so 4K → 8K → 65K compounds both steps."""
    qk_mult = qk_mult_base
    for old_len, new_len in zip(seq_lens, seq_lens[1:]):
        qk_mult = qk_mult_for_length(qk_mult, old_len, new_len)
    return qk_mult


def stage_seq_lens(cfg: Config) -> list[int]:
    """Sequence lengths from pretraining to this run: earlier stages, the run init_from
    continues (train.init_seq_len), then train.seq_len."""
    t = cfg.train
    return [*t.earlier_seq_lens, *([t.init_seq_len] if t.init_seq_len else []), t.seq_len]


def stage_steps(cfg: Config) -> tuple[int, int]:
    """(first, last) step of what this run trains, in the run's step count.

    A context-extension stage continues the run's schedule (its tokens per step are the
    pretraining's, so `train.steps` is the whole run's horizon): it starts at
    `train.stage_start` × steps, the step its init_from checkpoint was taken at (nominal: the
    loop starts from the checkpoint's own step), and ends at `train.stop_after` (derived from
    `train.stage_end`). A plain run trains 0 … stop_after or steps.
    """
    t = cfg.train
    first = round(t.stage_start * t.steps) if t.stage_start is not None else 0
    return first, t.stop_after or t.steps


def lr_rule(total_tokens: float, d_model: int, batch_tokens: float, cap: float) -> dict[str, float]:
    """The spec's learning-rate / β2 / ε rule (§3) from the token budget T, width d and batch B."""
    adam_lr = min(cap, 0.087571 * total_tokens ** -0.3461 * d_model ** -0.3448 * math.sqrt(batch_tokens))
    b2 = min(max(0.999 ** (batch_tokens / 131072), 0.95), 0.9999)
    eps = 9.676e-18 * math.sqrt(total_tokens / batch_tokens)
    return {"lr": adam_lr, "b2": b2, "eps": eps}


def steps_from_budget(active_params: int, tokens_per_active_param: float, tokens_per_step: int) -> int:
    """Token budget rule: steps = round(tokens_per_active_param × active / tokens_per_step)."""
    return max(1, round(tokens_per_active_param * active_params / tokens_per_step))


def warmup_steps(cfg: Config) -> int:
    """Linear-warmup length: int(warmup_frac · train.steps), at least 1. Truncated, not rounded,
    as production's levanter (`_convert_frac_or_steps`): 3,902 for the hero's 390,251 steps."""
    return max(1, int(cfg.schedule.warmup_frac * cfg.train.steps))


def phase_step_multiple(cfg: Config) -> int:
    """Steps between the points where a whole number of mixture blocks (`schedule.mixture_block`
    sequences) has been drawn: block / gcd(block, global batch); 1 when blocks are off."""
    block = cfg.schedule.mixture_block
    return block // math.gcd(block, cfg.train.global_batch) if block else 1


def phase_boundary_steps(cfg: Config) -> list[int]:
    """First step of each data phase after the first, from `data.phase_boundaries` (fractions of
    the planned steps: the shortened horizon if set).

    With `schedule.mixture_block` (production's rule, marin `_phase_1_start_step`): int(f · steps),
    moved down to a multiple of `phase_step_multiple` (at least one multiple), so the new weights
    start on a block edge: the hero's 0.8 · 390,251 → 312,192 (multiple 48 = 49,152 / gcd(49,152,
    11,264)). Without: the nearest step."""
    steps = cfg.schedule.horizon_steps or cfg.train.steps
    if not cfg.schedule.mixture_block:
        return [math.floor(f * steps + 0.5) for f in cfg.data.phase_boundaries]
    multiple = phase_step_multiple(cfg)
    return [max(multiple, max(1, int(f * steps)) // multiple * multiple) for f in cfg.data.phase_boundaries]


def resolve(cfg: Config) -> Config:
    """Return a copy of `cfg` with every ``auto`` leaf replaced by its derived value.

    Fields are filled in dependency order: shapes first (they feed the parameter count), then
    the mesh, then steps (from the active parameter count), then the optimizer rule (from steps).
    Leaves that are not ``auto`` are kept as given; `marin.config.validate` checks them.
    """
    cfg = copy.deepcopy(cfg)
    m, a, hw, t, o = cfg.model, cfg.attention, cfg.hardware, cfg.train, cfg.optim
    d = m.d_model
    if is_auto(a.num_heads):
        a.num_heads = max(1, d // a.head_dim)
    if is_auto(a.kv_heads_local):
        a.kv_heads_local = max(1, a.num_heads // 4)
    if is_auto(a.kv_heads_global):
        a.kv_heads_global = max(1, a.num_heads // 8)
    for name in ("expert_width", "latent_dim", "shared_width"):
        if is_auto(getattr(m, name)):
            setattr(m, name, d // 2)
    if is_auto(m.init_std):
        m.init_std = 0.5 / math.sqrt(d)
    if is_auto(a.qk_mult):
        a.qk_mult = qk_mult_through(a.qk_mult_base, stage_seq_lens(cfg))
    if is_auto(a.qk_norm_eps):
        a.qk_norm_eps = m.norm_eps
    a.impl = attention_impl(cfg)

    if is_auto(hw.mesh.data):
        others = hw.mesh.replica_dcn * hw.mesh.expert * hw.mesh.model
        hw.mesh.data = max(1, device_count(hw) // max(1, others))
    if is_auto(t.micro_batch):
        t.micro_batch = max(1, t.global_batch // max(1, batch_shards(hw)))

    tokens_per_step = t.seq_len * t.global_batch
    if is_auto(t.steps):
        t.steps = steps_from_budget(active_params(cfg), t.tokens_per_active_param, tokens_per_step)

    if t.stage_end < 1 and t.stop_after is None and isinstance(t.steps, int):
        t.stop_after = max(1, round(t.stage_end * t.steps))  # a stage stops where the next one starts

    if is_auto(t.eval_every) and isinstance(t.steps, int):
        t.eval_every = max(1, t.steps // 20)  # every 5% of training, as the ladder forecast reads it

    if any(is_auto(v) for v in (o.lr, o.b2, o.eps)) and isinstance(t.steps, int):
        rule = lr_rule(t.steps * tokens_per_step, d, tokens_per_step, o.adam_lr_cap)
        for name in ("lr", "b2", "eps"):
            if is_auto(getattr(o, name)):
                setattr(o, name, rule[name])
    for decay in o.decay:  # a weight-decay rule reaches 0 at the last step unless told otherwise
        if is_auto(decay.end) and isinstance(t.steps, int):
            decay.end = t.steps
        if is_auto(decay.origin):  # the line starts where the rule switches on unless told otherwise
            decay.origin = decay.start
    return cfg


def group_lrs(cfg: Config) -> dict[str, float]:
    """Peak learning rate of each optimizer parameter group (resolved config)."""
    o = cfg.optim
    if o.name == "muonh":
        return {"muonh": o.muonh_lr_ratio * o.lr, "adamh": o.muonh_lr_ratio * o.lr, "adam": o.lr}
    return {"adamw": o.lr}
