"""Typed schemas: one dataclass per config group, plus the root.

Each dataclass is registered in Hydra's ConfigStore (see `marin.config.store`) as the schema of
its group's YAML files, so an unknown key or a wrong type fails while Hydra composes. Fields that
may be derived say so with the value ``"auto"``; `marin.config.derive.resolve` is the only place
that replaces them with numbers.

Importing this module never imports JAX.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

AUTO = "auto"


@dataclass
class ModelConfig:
    """Transformer shapes and the MoE block (`conf/model/`, code in `marin/model/`)."""
    name: str = "small"
    d_model: int = 256                   # hidden width d
    num_layers: int = 4                  # every layer is an MoE block
    vocab_size: int = 512                # ≥ the tokenizer's vocabulary
    num_experts: int = 8                 # routed experts E
    expert_width: Any = AUTO             # I; auto = d/2 (ladder rule)
    latent_dim: Any = AUTO               # ℓ; auto = d/2; the routed path runs in this width
    num_shared_experts: int = 2          # S, full-width SwiGLUs on every token
    shared_width: Any = AUTO             # I_s; auto = d/2
    capacity_factor: float = 1.25        # fixed per-expert capacity = cf · T·k/E
    dispatch: str = "sort"               # sort | ragged_dot | dense (reference paths)
    ep_transport: str = "fixed"          # training-time expert transport: fixed | pooled | ragged
    ep_send_capacity_factor: float = 1.25  # pooled: rows per wave from a device to a peer = cf · T·k / peers
    ep_recv_capacity_factor: float = 1.25  # pooled: rows per wave per expert = cf · T·k / local experts;
                                         # ragged: receive buffer = cf · ep_waves · T·k rows
    ep_waves: int = 3                    # pooled: waves before anything drops (unneeded ones are skipped)
    eval_dropless: bool = True           # evaluation runs without capacity drops
    eval_dispatch: str = "waves"         # waves (training capacity, repeated; bounded memory) | unbounded (C = T)
    gated_norm_rank: int = 128           # GatedNorm bottleneck r; 0 turns GatedNorm off
    conv_kernel: int = 4                 # short causal depthwise convolutions; 0 turns them off
    norm_eps: float = 1e-5
    init_std: Any = AUTO                 # auto = 0.5/sqrt(d)
    z_loss: float = 1e-4                 # coefficient of logsumexp² in the loss
    remat: Any = False                   # none | full | dots: what a block keeps for the backward pass (true = full, false = none)
    offload_carry: bool = False          # stage each layer's residual carry in host memory for the backward pass (needs remat)
    compute_dtype: str = "float32"       # float32 | bfloat16 (master weights stay float32)
    router_dtype: str = "float32"        # float32 | bfloat16: the router matmul's output dtype (then cast to float32)


@dataclass
class AttentionConfig:
    """Grouped-query attention with local (sliding-window) and global layers (`conf/attention/`)."""
    name: str = "mochi"
    head_dim: int = 64
    num_heads: Any = AUTO                # auto = d / head_dim
    kv_heads_local: Any = AUTO           # auto = max(1, heads // 4); the projection stores these
    kv_heads_global: Any = AUTO          # auto = max(1, heads // 8); global layers use the first ones
    window: int = 128                    # sliding window of local layers, in tokens
    global_every: int = 4                # layer i is global when (i+1) % global_every == 0
    last_layer_global: bool = True
    rope_fraction: float = 0.5           # fraction of each head's dims rotated (local layers)
    rope_theta: float = 10000.0
    rope_on_global: bool = False         # False = NoPE on global layers
    qk_norm: bool = True                 # per-head RMS norm of q and k (no gain)
    qk_norm_eps: Any = AUTO              # eps of that norm; auto = model.norm_eps
    qk_mult: Any = 1.3                   # multiplies the normed queries; auto = qk_mult_base rescaled per extension
    qk_mult_base: float = 1.3            # qk_mult of the pretraining stage: where auto starts
    xsa: bool = True                     # exclusive self-attention
    output_gate: bool = True             # per-head gate 2·sigmoid(x·W_gate)
    conv_k: bool = True                  # causal conv after the K projection (model.conv_kernel taps)
    impl: str = "auto"                   # auto | blockwise | cudnn | reference; auto = cudnn on gpu in bf16, blockwise elsewhere


@dataclass
class RouterConfig:
    """Token → expert routing (`conf/router/`, code in `marin/model/routers.py`)."""
    name: str = "qb"
    kind: str = "qb"                     # qb | softmax_aux | bias_update
    top_k: int = 2
    combine: str = "sigmoid"             # sigmoid | softmax: how chosen experts' weights are formed
    combine_sum: float = 2.5             # sigmoid weights are rescaled to sum to this per token
    qb_bins: int = 10000                 # histogram bins of the QB quantile estimator
    aux_loss_weight: float = 0.0         # softmax_aux: weight of the load-balancing loss
    bias_update_rate: float = 0.0        # bias_update: step size of the per-expert bias


@dataclass
class SourceConfig:
    """One source (or mixture cell) of the data mixture."""
    name: str = "???"
    kind: str = "text"                   # builtin | text | jsonl | parquet
    paths: List[str] = field(default_factory=list)   # files or globs (relative to data.root); builtin: pydoc_data | stdlib
    weights: List[float] = field(default_factory=list)  # one weight per phase
    tokens: Optional[int] = None         # available tokens, for epoch accounting
    text_field: str = "text"             # jsonl / parquet column


@dataclass
class EvalSetConfig:
    """A held-out evaluation set (zero weight in training)."""
    name: str = "???"
    kind: str = "text"                   # builtin | text | jsonl | parquet
    paths: List[str] = field(default_factory=list)   # as in a source; builtin: pydoc_data/heldout | stdlib/heldout
    text_field: str = "text"


@dataclass
class DataConfig:
    """The mixture (`conf/data/`, code in `marin/data/`)."""
    name: str = "builtin"
    root: str = "."                      # site-specific: where relative paths resolve
    tokenizer: str = "byte"              # byte | path to a tokenizer.json (relative: project root)
    sources: List[SourceConfig] = field(default_factory=list)
    cells_file: Optional[str] = None     # CSV of cells: name, tokens, weight_<phase> (relative: project root)
    cells_paths: str = "cells/{name}/*.parquet"  # each cell's files under data.root ({name}, {topic}, {quality})
    cells_kind: str = "parquet"          # text | jsonl | parquet: the cells' file format
    cells_expected: Optional[int] = None  # the cells file must list exactly this many cells
    phase_names: List[str] = field(default_factory=lambda: ["pretrain"])
    phase_boundaries: List[float] = field(default_factory=list)  # fractions of the run in (0, 1)
    max_epochs: float = 8.0              # no source may repeat more than this
    sampling: str = "epoch"              # epoch (each source read in seeded epochs) | random (with replacement)
    eval_sets: List[EvalSetConfig] = field(default_factory=list)
    cache_dir: Optional[str] = None      # token cache; default <run.out_dir>/cache/tokens


@dataclass
class MeshConfig:
    """Device mesh; the product of the axes is the device count."""
    replica_dcn: int = 1
    data: Any = AUTO                     # auto = devices / (replica_dcn · expert · model)
    expert: int = 1
    model: int = 1
    fsdp: bool = False                   # shard non-expert weights, grads and optimizer state over data × expert


@dataclass
class HardwareConfig:
    """Where a run goes (`conf/hardware/`, code in `marin/launch/`)."""
    name: str = "local_cpu"
    launcher: str = "local"              # local | slurm
    platform: str = "cpu"                # cpu | gpu
    nodes: int = 1
    tasks_per_node: int = 1              # JAX processes per node (one per GPU on GPU nodes)
    gpus_per_node: int = 0
    host_devices: int = 1                # forced XLA host devices per process (CPU only)
    cpus_per_task: int = 1
    mem_gb: Optional[int] = None         # None = no memory request
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time_min: int = 60
    max_requeues: int = 3                # Slurm requeues after preemption / time limit, then stop
    signal_delay_s: int = 120            # Slurm sends USR2 this long before the time limit (checkpoint time)
    init_timeout_s: int = 300            # jax.distributed.initialize waits this long for every process
    env: Dict[str, str] = field(default_factory=dict)   # exported to every process of the job
    xla_flags: str = ""                  # XLA_FLAGS of every process (forced host devices are added)
    setup: List[str] = field(default_factory=list)      # shell lines run before the job (module load, ...)
    peak_flops_per_device: float = 0.0   # for MFU; 0 = measure nothing, report no MFU
    memory_per_device_gib: Optional[float] = None  # accelerator memory per device; None = unknown
    memory_usable_fraction: float = 0.9  # of that memory, what a run may plan to use (allocator, NCCL buffers)
    mesh: MeshConfig = field(default_factory=MeshConfig)


@dataclass
class DecayRule:
    """Decoupled weight decay on some parameters, decaying linearly to zero (`optim.decay`).

    The coefficient is `value` at step `start`, falls linearly to 0 at step `end` and is 0
    outside [start, end). Like AdamW's, it is multiplied by the group's learning rate.
    """
    pattern: str = "???"                 # a group (muonh | adamh | adam | adamw) or a path suffix on whole components: "attn/gate", "a|b/c"
    value: float = 0.0                   # coefficient at `start`, ≥ 0
    start: int = 0                       # first step with decay
    end: Any = AUTO                      # the coefficient reaches 0 here; auto = train.steps


@dataclass
class OptimConfig:
    """Optimizer (`conf/optim/`, code in `marin/optim/`)."""
    name: str = "adamw"                  # adamw | muonh
    lr: Any = 3e-3                       # peak Adam lr: a number or auto (the spec's rule)
    muonh_lr_ratio: float = 13 / 3       # muonh_lr = ratio · adam lr (muonh and adamh groups)
    adam_lr_cap: float = 0.05            # cap of the auto rule
    b1: float = 0.9
    b2: Any = 0.95                       # a number or auto
    eps: Any = 1e-8                      # a number or auto
    weight_decay: float = 0.0            # adamw only
    decay: List[DecayRule] = field(default_factory=list)  # scheduled decay rules, every optimizer; one rule per parameter
    momentum: float = 0.95               # MuonH Nesterov momentum
    ns_steps: int = 5                    # Newton–Schulz iterations
    ns_dtype: str = "float32"            # float32 | bfloat16: dtype of the Newton–Schulz iteration
    ns_eps: float = 1e-7                 # Newton–Schulz normalisation: x / (‖x‖_F + ns_eps)
    grad_clip: Optional[float] = None    # global-norm clip; None = off
    offload: bool = False                # optimizer state (and fp32 masters) in pinned host memory


@dataclass
class ScheduleConfig:
    """Learning-rate schedule (`conf/schedule/`), driven by train.steps."""
    name: str = "warmup_linear"
    warmup_frac: float = 0.01
    final_ratio: float = 0.05            # lr at the last step, as a fraction of peak
    horizon_steps: Optional[int] = None  # failure plan: a shortened horizon (≤ train.steps)
    horizon_from_step: Optional[int] = None  # resumed run: step the new horizon took effect (lr continuous there)


@dataclass
class CheckpointConfig:
    every_steps: int = 0                 # 0 = only at the end and on preemption
    keep_last: int = 2
    permanent_every: int = 0             # 0 = none
    async_save: bool = True
    every_minutes: float = 60.0          # a rolling checkpoint this often (0 = off); permanent ones by every_steps


@dataclass
class TrainConfig:
    """The loop (`marin/train/`)."""
    steps: Any = AUTO                    # auto = from the token budget, or a number
    stop_after: Optional[int] = None     # stop early; the schedule is unchanged
    tokens_per_active_param: float = 791.0  # token budget rule for steps=auto
    seq_len: int = 128
    global_batch: int = 16               # sequences per step, all processes together
    micro_batch: Any = AUTO              # sequences per device per forward; auto = global/devices
    seed: int = 0
    eval_every: Any = 50                 # steps between held-out evaluations (0 = only at the end); auto = every 5% of steps
    eval_batches: int = 2
    log_every: int = 1                   # steps between logged metric rows (the loss is checked every step)
    init_from: Optional[str] = None      # start from another run's checkpoint (context extension)
    init_seq_len: Optional[int] = None   # sequence length of that run (qk_mult is rescaled)
    earlier_seq_lens: List[int] = field(default_factory=list)  # lengths of the stages before that run, oldest first
    stage_start: Optional[float] = None  # context-extension stage: where it starts, as a fraction of the run's steps (init_from's checkpoint)
    stage_end: float = 1.0               # where it ends (the next stage starts there); sets stop_after when < 1
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)


@dataclass
class TrackingConfig:
    uri: Optional[str] = None            # else $MLFLOW_TRACKING_URI, else sqlite under run.out_dir
    experiment: Optional[str] = None     # MLflow experiment; default: the experiment name or "default"


@dataclass
class RunConfig:
    name: str = "default"                # names the run directory (experiments set it)
    experiment: Optional[str] = None     # set by conf/experiment/*.yaml; names the MLflow experiment
    sweep: Optional[str] = None          # set by sweeps/*.yaml; names the MLflow parent run
    sweep_id: Optional[str] = None       # groups a sweep's jobs under one parent; default: one per launch
    out_dir: str = "outputs"             # relative paths resolve against the project root


@dataclass
class EvalConfig:
    """Held-out evaluation (every train.eval_every steps; always dropless)."""
    with_drops: bool = False             # also log eval/<set>/loss_dropped, at the training capacity and transport


@dataclass
class PlanConfig:
    """What the dry run and the Slurm submission check before a run starts."""
    allow_over_memory: bool = False      # submit even when the memory estimate exceeds the device's


@dataclass
class ForecastConfig:
    """A pre-registered loss forecast this run is checked against (`marin/track/forecast_check.py`)."""
    registered: Optional[str] = None     # conf/forecasts/<experiment>.yaml from `marin.forecast --register`


@dataclass
class Config:
    """The root: group choices plus top-level settings (`conf/config.yaml`)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    router: RouterConfig = field(default_factory=RouterConfig)
    data: DataConfig = field(default_factory=DataConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    run: RunConfig = field(default_factory=RunConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    forecast: ForecastConfig = field(default_factory=ForecastConfig)
    dry_run: Any = False                 # false | true | json | compile | config
    reproduce: Optional[str] = None      # run directory or MLflow run id
    reproduce_trust: bool = False        # apply a saved config's hardware.env/xla_flags/setup even where they differ from the shipped option
    verify: bool = False                 # with reproduce=: replay the run and compare every logged metric with its record
    verify_steps: Optional[str] = None   # a:b: replay only steps a…b, from the original's newest checkpoint ≤ a
    verify_rtol: float = 0.0             # relative tolerance of the comparison (0 = bit for bit)
    resume: Optional[str] = None         # run directory or MLflow run id
    wait: bool = False                   # Slurm: follow the job and exit with its result
    schema_version: int = 1


GROUPS = {
    "model": ModelConfig,
    "attention": AttentionConfig,
    "router": RouterConfig,
    "data": DataConfig,
    "hardware": HardwareConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
}
