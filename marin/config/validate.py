"""Cross-field checks, run right after Hydra composes and before anything is imported or written.

`load(cfg)` turns the composed DictConfig into the typed `Config`, checks the leaves that Hydra's
types cannot (``auto`` or a number, choices, ranges), resolves derived values, then checks the
relations between fields. Every problem is reported as ``<field>: <what is allowed>``; the caller
prints them and exits non-zero. Pure Python: no JAX.
"""
from __future__ import annotations

import math

from omegaconf import DictConfig, OmegaConf

from marin.config import derive
from marin.config.schema import Config

CHOICES = {
    "model.dispatch": ("sort", "ragged_dot", "dense"),
    "model.eval_dispatch": ("waves", "unbounded"),
    "model.compute_dtype": ("float32", "bfloat16"),
    "model.router_dtype": ("float32", "bfloat16"),
    "attention.impl": ("auto", "blockwise", "cudnn", "reference"),
    "router.kind": ("qb", "softmax_aux", "bias_update"),
    "router.combine": ("sigmoid", "softmax"),
    "data.sampling": ("epoch", "random"),
    "hardware.launcher": ("local", "slurm"),
    "hardware.platform": ("cpu", "gpu"),
    "optim.name": ("adamw", "muonh"),
    "optim.ns_dtype": ("float32", "bfloat16"),
    "schedule.name": ("warmup_linear",),
}


class ConfigError(ValueError):
    """One or more invalid fields; `str()` lists them one per line as ``field: message``."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{name}: {msg}" for name, msg in problems))


def _get(cfg: Config, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def _auto_or(value, kind: str, positive: bool = True) -> str | None:
    """None if `value` is ``auto`` or a number of `kind`; else what is allowed."""
    if derive.is_auto(value):
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    if ok and (not positive or value > 0):
        return None
    return f"expected 'auto' or a {'positive ' if positive else ''}{'integer' if kind == 'int' else 'number'}, got {value!r}"


def check_run_name(name) -> list[tuple[str, str]]:
    """run.name names a folder directly inside run.out_dir/runs: no path separator, no `..`, not
    absolute, no control characters (so `../../x` or `${oc.env:HOME}` cannot escape out_dir)."""
    text = str(name)
    bad = ("/" in text or "\\" in text or ".." in text or not text.strip() or len(text) > 120
           or any(ord(c) < 32 or ord(c) == 127 for c in text))
    if not bad:
        return []
    return [("run.name", "must be a plain folder name (no '/', '\\', '..' or control characters, "
             f"not empty, at most 120 characters); got {text!r}")]


def check_leaves(cfg: Config) -> list[tuple[str, str]]:
    """Checks on single leaves that the schema's types cannot express."""
    problems = check_run_name(cfg.run.name)
    for name, allowed in CHOICES.items():
        value = _get(cfg, name)
        if value not in allowed:
            problems.append((name, f"must be one of {', '.join(allowed)}; got {value!r}"))
    auto_ints = ["attention.num_heads", "attention.kv_heads_local", "attention.kv_heads_global",
                 "model.expert_width", "model.latent_dim", "model.shared_width", "train.steps",
                 "train.micro_batch", "hardware.mesh.data"]
    if (msg := _auto_or(cfg.train.eval_every, "int", positive=False)) is not None:
        problems.append(("train.eval_every", msg))
    for name in auto_ints:
        if (msg := _auto_or(_get(cfg, name), "int")) is not None:
            problems.append((name, msg))
    for name in ["model.init_std", "attention.qk_mult", "optim.lr", "optim.b2", "optim.eps"]:
        if (msg := _auto_or(_get(cfg, name), "float")) is not None:
            problems.append((name, msg))
    positive_ints = ["model.d_model", "model.num_layers", "model.vocab_size", "model.num_experts",
                     "attention.head_dim", "router.top_k", "train.seq_len", "train.global_batch",
                     "hardware.nodes", "hardware.tasks_per_node", "hardware.host_devices",
                     "hardware.mesh.replica_dcn", "hardware.mesh.expert", "hardware.mesh.model"]
    for name in positive_ints:
        if _get(cfg, name) < 1:
            problems.append((name, f"must be ≥ 1; got {_get(cfg, name)}"))
    for name in ("optim.ns_eps", "attention.qk_norm_eps"):
        eps = _get(cfg, name)
        if not derive.is_auto(eps) and not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
            problems.append((name, f"must be a finite number > 0{' or auto' if name.startswith('attention') else ''}; got {eps!r}"))
    if cfg.model.remat not in (True, False, *derive.REMAT_MODES):
        problems.append(("model.remat", f"must be one of {', '.join(derive.REMAT_MODES)} (or true = full, "
                         f"false = none); got {cfg.model.remat!r}"))
    elif cfg.model.offload_carry and derive.remat_mode(cfg.model.remat) == "none":
        problems.append(("model.offload_carry", "stages the carry of rematerialised blocks: needs model.remat "
                         "full or dots; got model.remat none"))
    if cfg.optim.offload and cfg.optim.name == "muonh" and cfg.optim.grad_clip is not None:
        problems.append(("optim.grad_clip", "with optim.offload under muonh the experts' fp32 masters and "
                         "gradients stay in host memory, read one layer at a time; global-norm clipping "
                         f"would read them whole: set optim.grad_clip=null or optim.offload=false; got {cfg.optim.grad_clip}"))
    if cfg.model.capacity_factor <= 0:
        problems.append(("model.capacity_factor", f"must be > 0; got {cfg.model.capacity_factor}"))
    if not 0.0 <= cfg.attention.rope_fraction <= 1.0:
        problems.append(("attention.rope_fraction", f"must be in [0, 1]; got {cfg.attention.rope_fraction}"))
    if cfg.dry_run not in (False, True, "json", "compile"):
        problems.append(("dry_run", f"must be false, true, json or compile; got {cfg.dry_run!r}"))
    if cfg.train.stop_after is not None and cfg.train.stop_after < 1:
        problems.append(("train.stop_after", f"must be ≥ 1 or null; got {cfg.train.stop_after}"))
    start, end = cfg.train.stage_start, cfg.train.stage_end
    if start is not None and not 0.0 <= start < 1.0:
        problems.append(("train.stage_start", f"must be in [0, 1) (a fraction of the run's steps) or null; got {start}"))
    elif not (start or 0.0) < end <= 1.0:
        problems.append(("train.stage_end", f"must be in (train.stage_start, 1]; got {end}"))
    return problems


def check_relations(cfg: Config) -> list[tuple[str, str]]:
    """Checks between fields of a resolved config."""
    from marin.data.mixture import check as check_data  # pure Python, no JAX
    from marin.optim.decay import check as check_decay  # pure Python, no JAX

    m, a, r, hw, t = cfg.model, cfg.attention, cfg.router, cfg.hardware, cfg.train
    problems = []
    if a.num_heads * a.head_dim != m.d_model:
        problems.append(("attention.num_heads", f"num_heads × head_dim must equal model.d_model "
                         f"({m.d_model}); got {a.num_heads} × {a.head_dim} = {a.num_heads * a.head_dim}"))
    for name in ("kv_heads_local", "kv_heads_global"):
        kv = getattr(a, name)
        if kv < 1 or a.num_heads % kv:
            problems.append((f"attention.{name}", f"must divide attention.num_heads ({a.num_heads}); got {kv}"))
    if a.kv_heads_global > a.kv_heads_local:
        problems.append(("attention.kv_heads_global", f"must be ≤ attention.kv_heads_local "
                         f"({a.kv_heads_local}): global layers use the first stored KV heads; got {a.kv_heads_global}"))
    if a.impl == "cudnn" and (hw.platform != "gpu" or m.compute_dtype != "bfloat16"):
        problems.append(("attention.impl", "cudnn needs hardware.platform=gpu and model.compute_dtype=bfloat16 "
                         f"(got {hw.platform}, {m.compute_dtype}); use auto, blockwise or reference"))
    if int(a.head_dim * a.rope_fraction) % 2:
        problems.append(("attention.rope_fraction", f"head_dim × rope_fraction must be even; got {a.head_dim} × {a.rope_fraction}"))
    if r.top_k > m.num_experts:
        problems.append(("router.top_k", f"must be ≤ model.num_experts ({m.num_experts}); got {r.top_k}"))
    elif r.kind == "qb" and r.top_k >= m.num_experts:
        problems.append(("router.top_k", f"QB routing needs top_k < model.num_experts ({m.num_experts}) "
                         f"for its threshold; got {r.top_k}"))
    if m.latent_dim > m.d_model:
        problems.append(("model.latent_dim", f"must be ≤ model.d_model ({m.d_model}); got {m.latent_dim}"))
    if m.gated_norm_rank < 0:
        problems.append(("model.gated_norm_rank", f"must be ≥ 0 (0 = off); got {m.gated_norm_rank}"))
    if cfg.optim.lr <= 0:
        problems.append(("optim.lr", f"must be > 0; got {cfg.optim.lr}"))
    problems += check_decay(cfg)

    devices = derive.device_count(hw)
    mesh = hw.mesh
    product = mesh.replica_dcn * mesh.data * mesh.expert * mesh.model
    if product != devices:
        problems.append(("hardware.mesh", f"replica_dcn × data × expert × model must equal the device "
                         f"count {devices}; got {mesh.replica_dcn} × {mesh.data} × {mesh.expert} × {mesh.model} = {product}"))
    if m.num_experts % mesh.expert:
        problems.append(("hardware.mesh.expert", f"must divide model.num_experts ({m.num_experts}); got {mesh.expert}"))
    shards = derive.batch_shards(hw)
    if t.global_batch % shards:
        problems.append(("train.global_batch", f"must be divisible by the data-parallel size "
                         f"(replica_dcn × data × expert = {shards}); got {t.global_batch}"))
    elif t.global_batch % (t.micro_batch * shards):
        problems.append(("train.micro_batch", f"micro_batch × {shards} devices must divide train.global_batch "
                         f"({t.global_batch}); got {t.micro_batch}"))
    if t.stop_after is not None and t.stop_after > t.steps:
        problems.append(("train.stop_after", f"must be ≤ train.steps ({t.steps}); got {t.stop_after}"))
    h = cfg.schedule.horizon_steps
    if h is not None and not 1 <= h <= t.steps:
        problems.append(("schedule.horizon_steps", f"must be in [1, train.steps={t.steps}]; got {h}"))
    if t.init_seq_len and not t.init_from and not cfg.dry_run:
        problems.append(("train.init_from", "a context-extension stage (train.init_seq_len is set) starts "
                         "from another run's checkpoint: give its run directory"))
    if t.stage_start is not None and not t.init_seq_len:
        problems.append(("train.stage_start", "only a context-extension stage (train.init_seq_len set) starts mid-run; "
                         f"got {t.stage_start} without train.init_seq_len"))
    start = cfg.schedule.horizon_from_step
    if start is not None and not 0 <= start < (h or t.steps):
        problems.append(("schedule.horizon_from_step", f"must be in [0, schedule.horizon_steps={h}); got {start}"))
    problems += check_data(cfg)
    return problems


def to_config(cfg: DictConfig) -> Config:
    """The typed config object of a composed DictConfig (the ``hydra`` node is not part of it)."""
    return OmegaConf.to_object(cfg)


def load(cfg: DictConfig | Config) -> tuple[Config, Config]:
    """Validate a composed config; return (composed, resolved) or raise ConfigError."""
    composed = to_config(cfg) if isinstance(cfg, DictConfig) else cfg
    problems = check_leaves(composed)
    if problems:
        raise ConfigError(problems)
    resolved = derive.resolve(composed)
    problems = check_relations(resolved)
    if problems:
        raise ConfigError(problems)
    return composed, resolved
