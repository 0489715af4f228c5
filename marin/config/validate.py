"""Validation, run right after Hydra composes and before anything is imported or written.

`load(cfg)` turns the composed DictConfig into the typed `Config`, checks every leaf against the
rules its field carries (`marin.config.fields`: choices, ranges, ``auto``), resolves derived
values, checks the relations between fields, then runs the `checks` it is given, which need more than the
config (data files, the parameter table, a registered forecast, a checkpoint: marin.launch.checks). Every problem is
reported as ``<field>: <what is allowed>``; the caller prints them and exits non-zero.
Pure Python: no JAX.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable, Iterable

from omegaconf import DictConfig, ListConfig, OmegaConf

from marin.config import derive, fields
from marin.config.keys import unknown_key_message
from marin.config.schema import GROUPS, Config

Check = Callable[[Config], "list[tuple[str, str]]"]

class ConfigError(ValueError):
    """One or more invalid fields; `str()` lists them one per line as ``field: message``."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{name}: {msg}" for name, msg in problems))


def _empty_refs(cfg: Config) -> list[tuple[str, str]]:
    """`resume=`, `reproduce=`, `fork=`, `train.init_from=` with nothing after the `=` would
    silently start a fresh run of the defaults."""
    given = {"resume": cfg.resume, "reproduce": cfg.reproduce, "fork": cfg.fork, "train.init_from": cfg.train.init_from}
    return [(name, "give a run directory or an MLflow run id" + ("@<step>" if name == "fork" else "")
             + " (got an empty value)") for name, value in given.items() if value is not None and not str(value).strip()]


def unknown_keys(cfg: DictConfig, prefix: str = "") -> list[tuple[str, str]]:
    """Keys the schema does not have. Hydra's ``+key=value`` adds a key even to a typed node
    (it lifts struct mode for the addition), and `OmegaConf.to_object` then sets it as a plain
    attribute on the dataclass: the run would silently carry, or drop, a misspelt setting."""
    problems = []
    kind = OmegaConf.get_type(cfg)
    fields = {f.name for f in dataclasses.fields(kind)} if dataclasses.is_dataclass(kind) else None
    for key in cfg.keys():
        name = f"{prefix}{key}"
        if fields is not None and key not in fields and not (key == "hydra" and not prefix):
            problems.append((name, f"not a field of the schema ({kind.__name__}); {unknown_key_message(name)}"))
            continue
        node = cfg._get_node(key)  # noqa: SLF001 (no public accessor that keeps the node's type)
        if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():  # noqa: SLF001
            problems += unknown_keys(node, name + ".")
        elif isinstance(node, ListConfig):
            for i, item in enumerate(node):
                if isinstance(item, DictConfig):
                    problems += unknown_keys(item, f"{name}.{i}.")
    return problems


COMPILE_DRY_RUNS = ("compile", "compile_json")  # the real steps compiled: a table, or one JSON object


# A run name ends up in folder names, Slurm job names and printed shell commands: letters, digits
# and . _ - + = only, starting with a letter or digit (so no hidden folder, no option-like name,
# nothing a shell would expand).
RUN_NAME_MAX = 120
RUN_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._+=-]{{0,{RUN_NAME_MAX - 1}}}")
NOT_IN_RUN_NAME = re.compile(r"[^A-Za-z0-9._+=-]")  # what a made-up name (sweep.job_name) replaces with _


def missing_keys(cfg: DictConfig) -> list[tuple[str, str]]:
    """Mandatory values left unset (``???``): a group's `name` when no option was chosen (``~model``)."""
    problems = []
    for key in sorted(k for k in OmegaConf.missing_keys(cfg) if not k.startswith("hydra.")):
        group, _, leaf = key.partition(".")
        if leaf == "name" and group in GROUPS:
            problems.append((key, f"no {group} option chosen: give {group}=<option> (conf/{group}/*.yaml)"))
        else:
            problems.append((key, "has no value: give one"))
    return problems


SWEEP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_run_name(name) -> list[tuple[str, str]]:
    """run.name names a folder directly inside run.out_dir/runs: a safe set of characters only
    (`../../x`, `${oc.env:HOME}`, `q$(touch x)` or `.` are refused)."""
    text = str(name)
    if RUN_NAME.fullmatch(text):
        return []
    return [("run.name", "must be a plain folder name: 1–120 letters, digits or . _ - + =, starting with a "
             f"letter or digit; got {_shown(text)}")]


def check_sweep_id(sweep_id) -> list[tuple[str, str]]:
    """run.sweep_id ends the sweep's folder name and is the tag its jobs find their parent by
    (MLflow cuts a tag past 8,000 characters, and a later job would find none)."""
    if sweep_id is None or SWEEP_ID.fullmatch(str(sweep_id)):
        return []
    return [("run.sweep_id", f"must be 1–64 letters, digits or . _ -, starting with a letter or digit; got "
             f"{_shown(str(sweep_id))}")]


def _shown(text: str, most: int = 80) -> str:
    """A refused value as an error line quotes it: its first `most` characters (a 120 KB value
    pasted by mistake is not printed whole)."""
    return repr(text) if len(text) <= most else f"{text[:most]!r}… ({len(text):,} characters)"


def check_leaves(cfg: Config) -> list[tuple[str, str]]:
    """Checks on single leaves that the schema's types cannot express."""
    problems = check_run_name(cfg.run.name) + check_sweep_id(cfg.run.sweep_id)
    problems += fields.problems(cfg)  # every leaf against its field's choices or range (finite, int32)
    problems += _empty_refs(cfg)
    if cfg.model.ep_transport == "ragged" and cfg.hardware.platform == "cpu" and cfg.dry_run in (False, *COMPILE_DRY_RUNS):
        problems.append(("model.ep_transport", "ragged needs a GPU (XLA:CPU cannot compile or run "
                         "ragged_all_to_all): use fixed or pooled on CPU, or dry_run=true to plan"))
    if cfg.dry_run not in (False, True, "json", *COMPILE_DRY_RUNS, "config"):
        problems.append(("dry_run", f"must be false, true, json, compile, compile_json or config; got {cfg.dry_run!r}"))
    if cfg.model.remat not in (True, False, *derive.REMAT_MODES):
        problems.append(("model.remat", f"must be one of {', '.join(derive.REMAT_MODES)} (or true = full, "
                         f"false = none); got {cfg.model.remat!r}"))
    elif cfg.model.offload_carry is True and derive.remat_mode(cfg.model.remat) == "none":  # auto: off there
        problems.append(("model.offload_carry", "stages the carry of rematerialised blocks: needs model.remat "
                         "full or dots; got model.remat none"))
    if cfg.optim.offload is True and cfg.optim.name == "muonh" and cfg.optim.grad_clip is not None:  # auto: off there
        problems.append(("optim.grad_clip", "with optim.offload under muonh the experts' fp32 masters and "
                         "gradients stay in host memory, read one layer at a time; global-norm clipping "
                         f"would read them whole: set optim.grad_clip=null or optim.offload=false; got {cfg.optim.grad_clip}"))
    start, end = cfg.train.stage_start, cfg.train.stage_end
    if start is not None and end is not None and not start < end:
        problems.append(("train.stage_end", f"must be above train.stage_start ({start}); got {end}"))
    return problems


def check_relations(cfg: Config) -> list[tuple[str, str]]:
    """Checks between fields of a resolved config."""
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
    if m.grouped_matmul == "mosaic" and (hw.platform != "gpu" or m.compute_dtype != "bfloat16"):
        problems.append(("model.grouped_matmul", "mosaic needs hardware.platform=gpu and model.compute_dtype=bfloat16 "
                         f"(got {hw.platform}, {m.compute_dtype}); use auto or xla"))
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
    if t.eval_batch_size % shards:
        problems.append(("train.eval_batch_size", f"must be divisible by the data-parallel size "
                         f"(replica_dcn × data × expert = {shards}); got {t.eval_batch_size}"))
    if cfg.eval.with_drops and m.ep_transport == "ragged":
        # Production's with-drops pass ran only until the ragged switch (spec §9, marin#8859).
        problems.append(("eval.with_drops", "must be false with model.ep_transport=ragged (production's "
                         "with-drops evaluation stopped at the ragged switch); got true"))
    if t.stop_after is not None and t.stop_after > t.steps:
        problems.append(("train.stop_after", f"must be ≤ train.steps ({t.steps}); got {t.stop_after}"))
    if t.stop_at is not None and t.stop_at > t.steps:
        problems.append(("train.stop_at", f"must be ≤ train.steps ({t.steps}); got {t.stop_at}"))
    window = cfg.data.shuffle_window
    if window and window % t.seq_len:
        problems.append(("data.shuffle_window", f"must be a multiple of train.seq_len ({t.seq_len}): a window "
                         f"holds whole rows; got {window}"))
    h = cfg.schedule.horizon_steps
    if h is not None and not 1 <= h <= t.steps:
        problems.append(("schedule.horizon_steps", f"must be in [1, train.steps={t.steps}]; got {h}"))
    if t.init_seq_len and not t.init_from and not cfg.dry_run:
        problems.append(("train.init_from", "a context-extension stage (train.init_seq_len is set) starts "
                         "from another run's checkpoint: give its run directory"))
    if t.stage_start is not None and not t.init_seq_len:
        problems.append(("train.stage_start", "only a context-extension stage (train.init_seq_len set) starts mid-run; "
                         f"got {t.stage_start} without train.init_seq_len"))
    problems += _int32_problems(cfg)
    start = cfg.schedule.horizon_from_step
    if start is not None and not 0 <= start < (h or t.steps):
        problems.append(("schedule.horizon_from_step", f"must be in [0, schedule.horizon_steps={h}); got {start}"))
    return problems


def _int32_problems(cfg: Config) -> list[tuple[str, str]]:
    """Sizes whose products the device indexes with int32 (marin/model/dispatch.py, routers.py)."""
    m, r, t = cfg.model, cfg.router, cfg.train
    limit = fields.INT32_MAX
    problems = []
    assignments = t.seq_len * t.global_batch * r.top_k   # token→expert assignments per step, summed over devices
    if assignments > limit:
        problems.append(("train.global_batch", f"train.seq_len × global_batch × router.top_k must be ≤ {limit} "
                         f"(int32 counts); got {t.seq_len} × {t.global_batch} × {r.top_k} = {assignments}"))
    slots = m.num_experts * t.seq_len * t.micro_batch   # expert slots per device: E × C, C ≤ tokens per device
    if slots > limit:
        problems.append(("model.num_experts", f"model.num_experts × train.seq_len × train.micro_batch must be ≤ "
                         f"{limit} (int32 dispatch slots); got {m.num_experts} × {t.seq_len} × {t.micro_batch} = {slots}"))
    if r.kind == "qb" and m.num_experts * r.qb_bins > limit:
        problems.append(("router.qb_bins", f"model.num_experts × router.qb_bins must be ≤ {limit} (int32 histogram); "
                         f"got {m.num_experts} × {r.qb_bins}"))
    return problems


def to_config(cfg: DictConfig) -> Config:
    """The typed config object of a composed DictConfig (the ``hydra`` node is not part of it)."""
    return OmegaConf.to_object(cfg)


def _valid_only(memory: derive.MemoryEstimate) -> derive.MemoryEstimate:
    """`memory` asked only of configs whose other fields are valid (the plan's arithmetic assumes
    them); for the rest offload `auto` resolves off and the checks below report the fields."""
    def estimate(cfg: Config) -> derive.OffloadCost:
        if fields.problems(cfg) or check_relations(cfg):
            raise derive.CannotEstimate
        return memory(cfg)
    return estimate


def load(cfg: DictConfig | Config, checks: Iterable[Check] = (),
         memory: derive.MemoryEstimate | None = None) -> tuple[Config, Config]:
    """Validate a composed config; return (composed, resolved) or raise ConfigError.

    `checks`: functions of the resolved config returning ``(field, message)`` problems, run after
    the config's own rules. They live in the layers above (data files, checkpoints, forecasts):
    marin.launch.checks.load passes them all. `memory`: the memory plan that resolves
    optim.offload / model.offload_carry `auto` (`derive.MemoryEstimate`; marin.model.accounting's
    `offload_estimate`, passed down from the layers above)."""
    if isinstance(cfg, DictConfig) and (problems := unknown_keys(cfg) or missing_keys(cfg)):
        raise ConfigError(problems)
    composed = to_config(cfg) if isinstance(cfg, DictConfig) else cfg
    problems = check_leaves(composed)
    if problems:
        raise ConfigError(problems)
    try:
        resolved = derive.resolve(composed, memory and _valid_only(memory))
    except derive.NeedsMemoryPlan as err:
        raise ConfigError([(err.field, str(err))]) from None
    problems = fields.problems(resolved)  # derived values must fit too
    if not problems:
        problems = check_relations(resolved) + [p for check in checks for p in check(resolved)]
    if problems:
        raise ConfigError(problems)
    return composed, resolved
