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
import json
import itertools
import math
from pathlib import Path
from typing import Callable, NamedTuple

from marin.config.counts import active_params
from marin.config.fields import is_auto
from marin.config.paths import PROJECT_ROOT
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
    return ("cudnn" if gpu_16_bit(cfg) else "blockwise") if is_auto(impl) else impl


def grouped_matmul_impl(cfg: Config) -> str:
    """`model.grouped_matmul`; ``auto`` = JAX's Mosaic GPU grouped GEMM on GPUs when the compute
    dtype is 16-bit (the kernel is wgmma's: Hopper, 16-bit operands), else XLA's ragged_dot. Whether
    the kernel really runs on this GPU is decided at run time (marin/model/grouped.py refuses a
    ragged path it cannot run, before training)."""
    impl = cfg.model.grouped_matmul
    return ("mosaic" if gpu_16_bit(cfg) else "xla") if is_auto(impl) else impl


def gpu_16_bit(cfg: Config) -> bool:
    """A GPU run in bfloat16: what the GPU kernels (cuDNN's attention, the Mosaic GEMM) take."""
    return cfg.hardware.platform == "gpu" and cfg.model.compute_dtype == "bfloat16"


def attention_kernel(cfg: Config) -> str:
    """The attention kernel that will really run, in words (the plan's line): cudnn runs cuDNN's
    packed-row kernel up to `attention.cudnn_max_documents` documents a row, blockwise beyond."""
    impl = attention_impl(cfg)
    if impl == "cudnn":
        return (f"cudnn (packed rows, segment offsets, ≤ {cfg.attention.cudnn_max_documents} documents "
                "a row; blockwise beyond)")
    return impl


def pooled_capacities(tokens: int, top_k: int, num_experts: int, peers: int, waves: int,
                      send_factor: float, recv_factor: float) -> tuple[int, int]:
    """(S, R) of the published pooled-wave transport (spec §9; marin/model/dispatch.py).

    S = ⌈send_factor · T·k / (peers · waves)⌉: a destination's pool rows per wave, shared by all
    its local experts (at most ⌈T·min(k, local) / waves⌉, all a sender can owe one destination in
    a wave). R = ⌈recv_factor · T·k / (local · waves)⌉ rows per (local expert, wave) at the
    receiver (at most peers · min(S, T): all that can arrive for one expert in a wave)."""
    local = num_experts // peers
    send = max(1, min(math.ceil(send_factor * tokens * top_k / (peers * waves)),
                      -(-tokens * min(top_k, local) // waves)))
    recv = max(1, min(math.ceil(recv_factor * tokens * top_k / (local * waves)), peers * min(send, tokens)))
    return send, recv


def ragged_buffer_rows(tokens: int, top_k: int, num_experts: int, peers: int, recv_factor: float,
                       chunks: int = 1) -> int:
    """Receive-buffer rows of the ragged transport for one chunk of the device's local experts
    (marin/model/expert_parallel.py): ⌈⌈recv_factor · T·k⌉ / chunks⌉ rows, a multiple of 8, at
    most the worst case peers · T · min(k, E/peers) (where it is exact by construction). With
    `model.ep_expert_chunks` = 2 (production, spec §9) the chunks run one after the other, so one
    chunk's buffer is live at a time."""
    worst = peers * tokens * min(top_k, num_experts // peers)
    rows = -(-math.ceil(recv_factor * tokens * top_k) // chunks)
    return max(1, min(8 * math.ceil(rows / 8), worst))


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


def drops_microbatches(cfg: Config, rows: int) -> int:
    """Pieces the with-drops pass splits an eval batch of `rows` rows (all devices) into, so that
    each device's MoE shard holds the training forward's rows (`train.micro_batch`): the capacity,
    and so the drops, of the trained shard size. 1 where a batch holds no more rows per device
    than training (the hero: 1 sequence per device against 16, as production's with-drops pass
    ran), or does not split into whole micro-batches. Pure arithmetic: marin/train/step.py's eval step
    splits by it, the eval memory estimate (marin/model/accounting.py) sizes that pass's buffers by it."""
    per_device, micro = rows // batch_shards(cfg.hardware), cfg.train.micro_batch
    return per_device // micro if per_device > micro and per_device % micro == 0 else 1


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


def simulated_epoch_fraction(cfg: Config, run_flops: float) -> float | None:
    """The share of each cell's tokens a run reads under `data.simulated_epoching` (Marin's ladder,
    levanter's experiment_budget / target_budget): the run's tokens (its planned steps) / the target's,
    so a cell drawn e epochs by the target run is drawn e epochs by this one. None when off: no
    target, or `run_flops` (the run's training FLOPs, head included) above `below_flops`."""
    sim = cfg.data.simulated_epoching
    if sim.target_tokens is None or (sim.below_flops is not None and run_flops > sim.below_flops):
        return None
    steps = cfg.schedule.horizon_steps or cfg.train.steps
    return steps * cfg.train.seq_len * cfg.train.global_batch / sim.target_tokens


def simulated_chunks(chunks: int, fraction: float | None) -> int:
    """A cell's sequences (chunks of seq_len tokens) under simulated epoching: levanter's
    int(length × fraction), at least one so that a tiny cell still has something to repeat."""
    return chunks if fraction is None else min(chunks, max(1, int(chunks * fraction)))


class OffloadCost(NamedTuple):
    """What the memory plan says of one offload layout (per device): the device estimate a
    verdict judges, the pinned host bytes, and the bytes moved over the host link per step."""
    device_gib: float
    host_gib: float
    moved_bytes: float


# The memory plan, passed down from above (marin.model.accounting.offload_estimate): the cost of a
# resolved config's layout. marin.config cannot import it (it is the bottom layer).
MemoryEstimate = Callable[[Config], OffloadCost]
OFFLOAD_FIELDS = ("optim.offload", "model.offload_carry")


class CannotEstimate(Exception):
    """Raised by a MemoryEstimate for a config it cannot cost (invalid in other fields, which
    validation then reports): `auto` resolves off."""


class NeedsMemoryPlan(ValueError):
    """An offload `auto` on hardware with a memory figure, resolved without the memory plan."""

    def __init__(self, field: str):
        self.field = field
        super().__init__("auto needs the memory plan to decide: validate through marin.launch.checks.load "
                         "(or pass validate.load its `memory`), or set true or false")


def offload_value(cfg: Config, name: str):
    group, leaf = name.split(".")
    return getattr(getattr(cfg, group), leaf)


def _offload_set(cfg: Config, name: str, value: bool) -> None:
    group, leaf = name.split(".")
    setattr(getattr(cfg, group), leaf, value)


def offload_allowed(cfg: Config, name: str) -> bool:
    """Whether `name` may be on at all: the carry is staged only for rematerialised blocks; under
    MuonH the offloaded masters rule out global-norm clipping (validate's own checks)."""
    if name == "model.offload_carry":
        return remat_mode(cfg.model.remat) != "none"
    return not (cfg.optim.name == "muonh" and cfg.optim.grad_clip is not None)


def offload_options(cfg: Config) -> list[dict[str, bool]]:
    """Every layout `auto` may choose between: an `auto` field off or (where allowed) on, the
    others as given."""
    choices = []
    for name in OFFLOAD_FIELDS:
        value = offload_value(cfg, name)
        choices.append([False, True] if is_auto(value) and offload_allowed(cfg, name)
                       else [False] if is_auto(value) else [bool(value)])
    return [dict(zip(OFFLOAD_FIELDS, values)) for values in itertools.product(*choices)]


def with_offload(cfg: Config, layout: dict[str, bool]) -> Config:
    out = copy.deepcopy(cfg)
    for name, value in layout.items():
        _offload_set(out, name, value)
    return out


def offload_fits(cfg: Config, cost: OffloadCost) -> bool:
    """The device estimate within memory_limit_gib, and the host bytes within the host memory
    per device where the hardware gives it."""
    limit, host = memory_limit_gib(cfg.hardware), cfg.hardware.host_memory_per_device_gib
    return cost.device_gib <= limit and (host is None or cost.host_gib <= host)


def choose_offload(cfg: Config, memory: MemoryEstimate) -> dict[str, bool]:
    """The layout `auto` resolves to: of those that fit, the one moving the fewest bytes over the
    host link per step (so nothing is offloaded where everything fits). Not a fixed order
    (carries first, say): which offload is cheaper depends on the model and the batch. For the
    hero the carries free 36 GiB of the device for 72 GiB moved (out and back: 0.5 byte freed
    per byte moved) and the optimizer state with the expert masters 61.6 GiB for 366 GiB moved
    (each step fetches every layer's masters twice and reads their gradients, masters and
    momentum in the update: 0.17), so the carries go first; neither alone fits, so both are on.
    The plan computes this for every config instead of assuming the hero's order. Where nothing
    fits: the layout with the smallest device estimate (the plan then says it does not fit)."""
    costs = [(layout, memory(with_offload(cfg, layout))) for layout in offload_options(cfg)]
    fitting = [(layout, cost) for layout, cost in costs if offload_fits(cfg, cost)]
    if fitting:
        return min(fitting, key=lambda lc: (lc[1].moved_bytes, sum(lc[0].values())))[0]
    return min(costs, key=lambda lc: lc[1].device_gib)[0]


def resolve_offload(cfg: Config, memory: MemoryEstimate | None) -> None:
    """optim.offload and model.offload_carry `auto` (in place, on an otherwise resolved config):
    off where the hardware has no memory figure (a CPU run: nothing to fit, and offload only
    slows it), else `choose_offload`."""
    autos = [name for name in OFFLOAD_FIELDS if is_auto(offload_value(cfg, name))]
    if not autos:
        return
    if memory_limit_gib(cfg.hardware) is None:
        layout = dict.fromkeys(autos, False)
    elif memory is None:
        raise NeedsMemoryPlan(autos[0])
    else:
        try:
            layout = choose_offload(cfg, memory)
        except CannotEstimate:
            layout = dict.fromkeys(autos, False)
    for name in autos:
        _offload_set(cfg, name, layout[name])


# Production's eval batch: 64 sequences per rack (the hero's 704 = one per device; spec §9).
EVAL_ROWS_PER_RACK = 64
# permanent_every auto: a permanent checkpoint (a fork point) at every tenth of a run of at least
# this many steps; shorter runs (tests, smoke runs) keep only their rolling and final ones.
PERMANENT_MIN_STEPS = 100


def eval_batch_size(hw: HardwareConfig) -> int:
    """`train.eval_batch_size: auto`: EVAL_ROWS_PER_RACK per rack, rounded up to a whole row per
    batch shard (a config naming its total nodes in one "rack" still splits evenly)."""
    shards = batch_shards(hw)
    return -(-EVAL_ROWS_PER_RACK * hw.racks // shards) * shards


def permanent_every(steps: int) -> int:
    """`train.checkpoint.permanent_every: auto`: every 10% of the run's steps, 0 under PERMANENT_MIN_STEPS."""
    return steps // 10 if steps >= PERMANENT_MIN_STEPS else 0


def headline_metric(cfg: Config) -> str:
    """`eval.headline: auto`: the dropless Paloma macro average where a set is named paloma (the
    published run's headline and forecast metric, spec §9), else the mean over every set."""
    if any(s.name == "paloma" or s.name.startswith("paloma/") for s in cfg.data.eval_sets):
        return "eval/paloma/macro_loss"
    return "eval/macro_loss"


def resolve(cfg: Config, memory: MemoryEstimate | None = None) -> Config:
    """Return a copy of `cfg` with every ``auto`` leaf replaced by its derived value.

    Fields are filled in dependency order: shapes first (they feed the parameter count), then
    the mesh, then steps (from the active parameter count), then the optimizer rule (from steps),
    last the offload switches (from the memory plan `memory` of everything else: `resolve_offload`).
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
            setattr(m, name, max(1, d // 2))  # d_model 1: width 1, not an invalid 0
    if is_auto(m.init_std):
        m.init_std = 0.5 / math.sqrt(d)
    if is_auto(a.qk_mult):
        a.qk_mult = qk_mult_through(a.qk_mult_base, stage_seq_lens(cfg))
    if is_auto(a.qk_norm_eps):
        a.qk_norm_eps = m.norm_eps
    a.impl = attention_impl(cfg)
    m.grouped_matmul = grouped_matmul_impl(cfg)

    if is_auto(hw.mesh.data):
        others = hw.mesh.replica_dcn * hw.mesh.expert * hw.mesh.model
        hw.mesh.data = max(1, device_count(hw) // max(1, others))
    if is_auto(t.eval_seq_len):
        t.eval_seq_len = t.seq_len
    if is_auto(t.micro_batch):
        t.micro_batch = max(1, t.global_batch // max(1, batch_shards(hw)))

    tokens_per_step = t.seq_len * t.global_batch
    if is_auto(t.steps):
        t.steps = steps_from_budget(active_params(cfg), t.tokens_per_active_param, tokens_per_step)

    if t.stage_end < 1 and t.stop_after is None and isinstance(t.steps, int):
        t.stop_after = max(1, round(t.stage_end * t.steps))  # a stage stops where the next one starts

    if is_auto(t.eval_every) and isinstance(t.steps, int):
        t.eval_every = max(1, t.steps // 20)  # every 5% of training, as the ladder forecast reads it
    if is_auto(t.eval_batch_size):
        t.eval_batch_size = eval_batch_size(hw)
    if is_auto(t.checkpoint.permanent_every) and isinstance(t.steps, int):
        t.checkpoint.permanent_every = permanent_every(t.steps)
    if is_auto(cfg.eval.with_drops):  # production's with-drops pass ran until the ragged switch (spec §9)
        cfg.eval.with_drops = m.ep_transport != "ragged"
    if is_auto(cfg.eval.headline):
        cfg.eval.headline = headline_metric(cfg)

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
    if is_auto(cfg.data.tokens_per_core_s):
        cfg.data.tokens_per_core_s = tokenize_rate(AUTO_RATE).tokens_per_core_s
    if is_auto(cfg.data.verify_inputs):
        cfg.data.verify_inputs = verify_inputs(AUTO_RATE, process_count(hw))
    resolve_offload(cfg, memory)
    return cfg


def group_lrs(cfg: Config) -> dict[str, float]:
    """Peak learning rate of each optimizer parameter group (resolved config)."""
    o = cfg.optim
    if o.name == "muonh":
        return {"muonh": o.muonh_lr_ratio * o.lr, "adamh": o.muonh_lr_ratio * o.lr, "adam": o.lr}
    return {"adamw": o.lr}


def preparation_hours(tokens: float, tokens_per_core_s: float, cores: int) -> float:
    """Wall hours to tokenize `tokens` on `cores` cores at a measured per-core rate (the data
    preparation plan, `marin.data.prepare_tasks`)."""
    return tokens / (tokens_per_core_s * max(cores, 1)) / 3600.0


# data.tokens_per_core_s `auto`: the figure benchmarks/tokenizer_rate.py measured on this machine,
# else a stated default (a few million tokens/s per core is typical of a byte-level BPE; 1e6 errs long).
TOKENIZE_BENCH = PROJECT_ROOT / "outputs" / "bench" / "tokenize.json"
DEFAULT_TOKENS_PER_CORE_S = 1.0e6


AUTO_RATE = "auto"


class TokenizeRate(NamedTuple):
    tokens_per_core_s: float
    source: str   # where the figure came from, as the plan prints it


def tokenize_rate(configured, bench: Path | None = None) -> TokenizeRate:
    """`data.tokens_per_core_s`: `auto`: the measured figure in `bench` (default `TOKENIZE_BENCH`;
    when it holds a positive one), else `DEFAULT_TOKENS_PER_CORE_S`; a number: as given, said to be
    the measured or default figure when it is the one `auto` gives (a resolved config holds numbers).
    Reads a small JSON file only."""
    bench = Path(TOKENIZE_BENCH if bench is None else bench)
    if not is_auto(configured):
        auto = tokenize_rate(AUTO_RATE, bench)
        return auto if float(configured) == auto.tokens_per_core_s else \
            TokenizeRate(float(configured), "data.tokens_per_core_s")
    try:
        found = json.loads(Path(bench).read_text())
        rate = float(found["tokens_per_core_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return TokenizeRate(DEFAULT_TOKENS_PER_CORE_S, f"default: no measurement in {bench}")
    if not rate > 0:
        return TokenizeRate(DEFAULT_TOKENS_PER_CORE_S, f"default: {bench} holds no positive rate")
    with_tok = f", tokenizer {found['tokenizer_path']}" if found.get("tokenizer_path") else ""
    return TokenizeRate(rate, f"measured: {bench}{with_tok}, {found.get('measured', 'undated')}")


def verify_inputs(configured, process_count: int) -> bool:
    """`data.verify_inputs`: auto = verify in a one-process run (cheap there; a changed file is
    tokenized anew, as a user editing a small corpus expects), not in a multi-process one (every
    process would glob and stat every input file before its first step: the preparation step checks)."""
    return process_count == 1 if is_auto(configured) else bool(configured)
