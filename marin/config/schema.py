"""Typed schemas: one dataclass per config group, plus the root.

Each dataclass is registered in Hydra's ConfigStore (see `marin.config.store`) as the schema of
its group's YAML files, so an unknown key or a wrong type fails while Hydra composes. Every field
carries its own rules (`marin.config.fields.setting`): a one-line help, and its allowed values
(`choices`) or numeric `range`, which `marin.config.validate` checks. Fields that may be derived
say so with the value ``"auto"``; `marin.config.derive.resolve` is the only place that replaces
them with numbers.

Importing this module never imports JAX.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from marin.config.fields import AUTO, BETA, FRACTION, NON_NEGATIVE, POSITIVE, count, real, setting
from marin.config.registry import ATTENTION, ROUTERS, SCHEDULES, TRANSPORTS

__all__ = ["AUTO", "Config", "GROUPS"]

DTYPES = ("float32", "bfloat16")
# optim.offload, model.offload_carry: on, off, or auto (marin.config.derive: on only where the memory
# plan does not fit without it)
OFFLOAD_CHOICES = (True, False, AUTO)
# A group's `name` is the option Hydra chose (marin.config.store.name_options): missing until then.
CHOSEN = "???"


@dataclass
class ModelConfig:
    """Transformer shapes and the MoE block (`conf/model/`, code in `marin/model/`)."""
    name: str = setting(CHOSEN, "the option chosen; option files do not repeat it (marin.config.store.name_options)")
    d_model: int = setting(256, "hidden width d", range=count(1))
    num_layers: int = setting(4, "every layer is an MoE block", range=count(1))
    vocab_size: int = setting(512, "≥ the tokenizer's vocabulary", range=count(1))
    num_experts: int = setting(8, "routed experts E", range=count(1))
    expert_width: Any = setting(AUTO, "I; auto = d/2 (ladder rule)", range=count(1))
    latent_dim: Any = setting(AUTO, "ℓ; auto = d/2; the routed path runs in this width", range=count(1))
    num_shared_experts: int = setting(2, "S, full-width SwiGLUs on every token", range=count(0))
    shared_width: Any = setting(AUTO, "I_s; auto = d/2", range=count(1))
    capacity_factor: float = setting(1.25, "fixed per-expert capacity = cf · T·k/E", range=POSITIVE)
    dispatch: str = setting("sort", "sort | ragged_dot | dense (reference paths)", choices=("sort", "ragged_dot", "dense"))
    grouped_matmul: str = setting(
        "auto", "the ragged paths' grouped GEMM (model.dispatch=ragged_dot, model.ep_transport=ragged): mosaic = JAX's "
        "Hopper Pallas Mosaic-GPU kernels | xla = jax.lax.ragged_dot; auto = mosaic on gpu in bf16, xla elsewhere",
        choices=("auto", "mosaic", "xla"))
    ep_transport: str = setting("fixed", "training-time expert transport", choices=TRANSPORTS.names)
    ep_send_capacity_factor: float = setting(
        1.25, "pooled: the sender pool = cf · T·k rows per device, cf · T·k / (ep_waves · peers) per wave and "
        "destination, shared by its local experts", range=POSITIVE)
    ep_recv_capacity_factor: float = setting(
        1.25, "pooled: receive rows per (local expert, wave) = cf · T·k / (local experts · ep_waves); "
        "ragged: the receive buffer = cf · T·k rows, split over model.ep_expert_chunks", range=POSITIVE)
    ep_waves: int = setting(3, "pooled: static waves; each destination's pool is striped over them by rank "
                            "(every wave carries every local expert)", range=count(1))
    ep_expert_chunks: int = setting(2, "ragged: the local experts in this many chunks, run one after another, each "
                                    "with a receive buffer of ⌈cf · T·k⌉ / chunks rows (1 = one shared buffer)",
                                    range=count(1))
    eval_dropless: bool = setting(True, "evaluation runs without capacity drops")
    eval_dispatch: str = setting("waves", "waves (training capacity, repeated; bounded memory) | unbounded (C = T)",
                                 choices=("waves", "unbounded"))
    gated_norm_rank: int = setting(128, "GatedNorm bottleneck r; 0 turns GatedNorm off", range=count(0))
    conv_kernel: int = setting(4, "short causal depthwise convolutions; 0 turns them off", range=count(0))
    norm_eps: float = setting(1e-5, "RMSNorm epsilon", range=POSITIVE)
    init_std: Any = setting(AUTO, "auto = 0.5/sqrt(d)", range=POSITIVE)
    z_loss: float = setting(1e-4, "coefficient of logsumexp² in the loss", range=NON_NEGATIVE)
    remat: Any = setting(False, "none | full | dots: what a block keeps for the backward pass (true = full, false = none)")
    offload_carry: Any = setting(False, "stage each layer's residual carry in host memory for the backward pass (needs "
                                 "remat); auto = on only where the memory plan does not fit without it",
                                 choices=OFFLOAD_CHOICES)
    compute_dtype: str = setting("float32", "matmul dtype (master weights stay float32)", choices=DTYPES)
    router_dtype: str = setting("float32", "the router matmul's output dtype (then cast to float32)", choices=DTYPES)
    residual_dtype: str = setting("float32", "dtype of the residual stream (each layer's carry); the hero: bfloat16",
                                  choices=DTYPES)
    combine_dtype: str = setting("float32", "dtype the MoE layer's output is summed in (routed experts' "
                                 "up-projection plus the shared experts); the hero: bfloat16", choices=DTYPES)


@dataclass
class AttentionConfig:
    """Grouped-query attention with local (sliding-window) and global layers (`conf/attention/`)."""
    name: str = setting(CHOSEN, "the option chosen; option files do not repeat it (marin.config.store.name_options)")
    head_dim: int = setting(64, "per-head width h", range=count(1))
    num_heads: Any = setting(AUTO, "auto = d / head_dim", range=count(1))
    kv_heads_local: Any = setting(AUTO, "auto = max(1, heads // 4); the projection stores these", range=count(1))
    kv_heads_global: Any = setting(AUTO, "auto = max(1, heads // 8); global layers use the first ones", range=count(1))
    window: int = setting(128, "sliding window of local layers, in tokens", range=count(1))
    global_every: int = setting(4, "layer i is global when (i+1) % global_every == 0; 0: no periodic global layers",
                                range=count(0))
    last_layer_global: bool = setting(True, "the last layer is global")
    rope_fraction: float = setting(0.5, "fraction of each head's dims rotated (local layers)", range=FRACTION)
    rope_theta: float = setting(10000.0, "RoPE base", range=POSITIVE)
    rope_on_global: bool = setting(False, "False = NoPE on global layers")
    qk_norm: bool = setting(True, "per-head RMS norm of q and k (no gain)")
    qk_norm_eps: Any = setting(AUTO, "eps of that norm; auto = model.norm_eps", range=POSITIVE)
    qk_mult: Any = setting(1.3, "multiplies the normed queries; auto = qk_mult_base rescaled per extension",
                           range=POSITIVE)
    qk_mult_base: float = setting(1.3, "qk_mult of the pretraining stage: where auto starts", range=POSITIVE)
    xsa: bool = setting(True, "exclusive self-attention")
    xsa_dtype: str = setting("float32", "dtype of the XSA projection (out − (out·v / v·v) v); the hero: bfloat16",
                             choices=DTYPES)
    rope_pairing: str = setting("halves", "dims RoPE rotates together: halves (i with i + r/2) | interleaved "
                                "(2i with 2i+1: production's fused kernel, its checkpoints' layout)",
                                choices=("halves", "interleaved"))
    output_gate: bool = setting(True, "per-head gate 2·sigmoid(x·W_gate)")
    conv_k: bool = setting(True, "causal conv after the K projection (model.conv_kernel taps)")
    impl: str = setting("auto", "the kernel; auto = cudnn on gpu in bf16, blockwise elsewhere",
                        choices=lambda: ("auto", *ATTENTION.names()))
    cudnn_max_documents: int = setting(16, "cudnn: documents per row its segment offsets hold; a batch with a "
                                       "row of more runs blockwise instead. cuDNN's backward workspace grows with "
                                       "it (the plan's estimate counts it: 0.7 GiB a slot on ladder_d768)",
                                       range=count(1))


@dataclass
class RouterConfig:
    """Token → expert routing (`conf/router/`, code in `marin/model/routers.py`)."""
    name: str = setting(CHOSEN, "the option chosen; option files do not repeat it (marin.config.store.name_options)")
    kind: str = setting("qb", "the routing rule (a class registered in marin/model/routers.py)", choices=ROUTERS.names)
    top_k: int = setting(2, "experts per token k", range=count(1))
    combine: str = setting("sigmoid", "how chosen experts' weights are formed", choices=("sigmoid", "softmax"))
    combine_sum: float = setting(2.5, "sigmoid weights are rescaled to sum to this per token", range=POSITIVE)
    qb_bins: int = setting(10000, "histogram bins of the QB quantile estimator", range=count(2))
    aux_loss_weight: float = setting(0.0, "softmax_aux: weight of the load-balancing loss", range=NON_NEGATIVE)
    bias_update_rate: float = setting(0.0, "bias_update: step size of the per-expert bias", range=NON_NEGATIVE)


SOURCE_KINDS = ("builtin", "text", "jsonl", "parquet")
# data.loss_targets: which next-token targets the loss scores (marin.data.loader.scored_targets)
LOSS_TARGETS = ("causal", "document")


@dataclass
class SourceConfig:
    """One source (or mixture cell) of the data mixture (checked by `marin.data.mixture`)."""
    name: str = "???"
    kind: str = "text"                   # builtin | text | jsonl | parquet
    paths: List[str] = setting(help="files or globs (relative to data.root); builtin: pydoc_data | stdlib", factory=list)
    weights: List[float] = setting(help="one weight per phase", factory=list)
    tokens: Optional[int] = setting(None, "available tokens, for epoch accounting")
    text_field: str = setting("text", "jsonl / parquet column")


@dataclass
class EvalSetConfig:
    """A held-out evaluation set (zero weight in training)."""
    name: str = "???"
    kind: str = "text"                   # builtin | text | jsonl | parquet
    paths: List[str] = setting(help="as in a source; builtin: pydoc_data/heldout | stdlib/heldout", factory=list)
    text_field: str = "text"
    subsets: bool = setting(False, "a folder of subsets (e.g. a site's Paloma copy, paths: [paloma/*/*.jsonl.gz]): "
                            "each folder (or file) below the paths' fixed part is a set <name>/<subset>, "
                            "averaged in eval/<name>/macro_loss and macro_bpb")


@dataclass
class SimulatedEpochingConfig:
    """A small run repeats each cell as often as a larger target run would (spec §9, Marin's ladder):
    every cell is cut to the run's tokens / target_tokens of its tokens (`marin.config.derive`)."""
    target_tokens: Optional[float] = setting(None, "the token budget whose epochs the run simulates (the hero "
                                             "mixture's 15T + 3.75T = 1.875e13); None = off", range=POSITIVE)
    below_flops: Optional[float] = setting(None, "only runs of at most this many training FLOPs (spec §1b, head "
                                           "included) simulate; larger ones read whole cells (Marin: 1e23); "
                                           "None = any run", range=POSITIVE)


@dataclass
class DataConfig:
    """The mixture (`conf/data/`, code in `marin/data/`); list leaves are checked by marin.data.mixture."""
    name: str = setting(CHOSEN, "the option chosen; option files do not repeat it (marin.config.store.name_options)")
    root: str = setting(".", "site-specific: where relative paths resolve")
    tokenizer: str = setting("byte", "byte | path to a tokenizer.json (relative: project root)")
    allow_vocab_mismatch: bool = setting(False, "let model.vocab_size exceed the tokenizer's ids rounded up to a "
                                         "multiple of 128, plus 128 (docs/data.md)")
    sources: List[SourceConfig] = setting(factory=list)
    cells_file: Optional[str] = setting(None, "CSV of cells: name, tokens, weight_<phase> (relative: project root)")
    cells_paths: str = setting("cells/{name}/*.parquet", "each cell's files under data.root ({name}, {topic}, {quality})")
    cells_kind: str = setting("parquet", "text | jsonl | parquet: the cells' file format")
    cells_expected: Optional[int] = setting(None, "the cells file must list exactly this many cells", range=count(1))
    cells_from_step: int = setting(0, "the step this cells file's weights apply from (a swap at resume: the "
                                   "hero's 108,000); earlier steps drew data.cells_before's", range=count(0))
    cells_before: Optional[str] = setting(None, "the cells file in force before data.cells_from_step (the "
                                          "epoch accounting counts both)")
    phase_names: List[str] = setting(factory=lambda: ["pretrain"])
    phase_boundaries: List[float] = setting(help="fractions of the run in (0, 1)", factory=list)
    max_epochs: float = setting(8.0, "no source may repeat more than this", range=POSITIVE)
    simulated_epoching: SimulatedEpochingConfig = setting(factory=SimulatedEpochingConfig)
    sampling: str = setting("epoch", "epoch (each source read in seeded epochs) | random (with replacement)",
                            choices=("epoch", "random"))
    shuffle_window: int = setting(
        0, "data.sampling=epoch: tokens read in order within each shuffled window (a multiple of every stage's "
        "train.seq_len): a stage of another seq_len then continues each source exactly where it was; 0 = every "
        "chunk shuffled alone", range=count(0))
    eval_sets: List[EvalSetConfig] = setting(factory=list)
    cache_dir: Optional[str] = setting(None, "token cache; default <run.out_dir>/cache/tokens")
    loss_targets: str = setting(
        "causal", "the targets the loss scores: causal (Levanter's LmExample.causal, production's: every target of "
        "a row of T tokens, the next document's first token after an end-of-document included, the row's last "
        "position none: T-1 per row) | document (only targets in the input's document, all T positions)",
        choices=LOSS_TARGETS)
    shard_tokens: int = setting(2**31 - 1, "most tokens in one cache shard (marin.data.shards; 2³¹ − 1: config "
                                "integers are int32); a document longer is skipped and counted as huge",
                                range=count(1))
    max_bad_fraction: float = setting(0.001, "bad input records (unreadable, invalid UTF-8, malformed JSON, missing "
                                      "field, huge) a shard tolerates, as a fraction of its records; beyond it "
                                      "preparation fails naming the file and line", range=FRACTION)
    prepare_tasks: int = setting(0, "tasks of python -m marin.data.prepare (a process pool locally, a Slurm array "
                                 "on Slurm); 0 = auto: the CPUs here, or one per file group up to 1,000 on Slurm",
                                 range=count(0))
    verify_inputs: Any = setting(
        AUTO, "whether a training process checks the input files against its cache before opening it (a glob and a "
        "stat of every file; changed files are tokenized anew): true | false (open the last preparation of each "
        "source's config as it is, reading no input file; one never prepared is prepared) | auto = true for a "
        "one-process run, false for more (run python -m marin.data.prepare after changing inputs)",
        choices=(True, False, AUTO))
    tokens_per_core_s: Any = setting(AUTO, "tokenizer throughput per core, tokens/s, for the preparation plan's "
                                     "hours; auto = the figure benchmarks/tokenizer_rate.py wrote to "
                                     "outputs/bench/tokenize.json, else 1e6 (the plan says which)", range=POSITIVE)


@dataclass
class MeshConfig:
    """Device mesh; the product of the axes is the device count."""
    replica_dcn: int = setting(1, "replicas across the data-centre network", range=count(1))
    data: Any = setting(AUTO, "auto = devices / (replica_dcn · expert · model)", range=count(1))
    expert: int = setting(1, "expert-parallel size", range=count(1))
    model: int = setting(1, "tensor-parallel size", range=count(1))
    fsdp: bool = setting(False, "shard non-expert weights, grads and optimizer state over data × expert")


@dataclass
class HardwareConfig:
    """Where a run goes (`conf/hardware/`, code in `marin/launch/`)."""
    name: str = setting(CHOSEN, "the option chosen; option files do not repeat it (marin.config.store.name_options)")
    launcher: str = setting("local", "local | slurm", choices=("local", "slurm"))
    platform: str = setting("cpu", "cpu | gpu", choices=("cpu", "gpu"))
    racks: int = setting(1, "number of identical racks/replicas of this hardware unit, data parallel across "
                         "racks (mesh.replica_dcn); total nodes = racks × nodes", range=count(1))
    nodes: int = setting(1, "nodes of one rack/unit (the job has racks × nodes)", range=count(1))
    tasks_per_node: int = setting(1, "JAX processes per node (one per GPU on GPU nodes)", range=count(1))
    gpus_per_node: int = setting(0, "GPUs per node", range=count(0))
    host_devices: int = setting(1, "forced XLA host devices per process (CPU only)", range=count(1))
    cpus_per_task: int = setting(1, "CPUs per process", range=count(1))
    mem_gb: Optional[int] = setting(None, "None = no memory request; 0 = all of each node's memory (--mem=0)",
                                    range=count(0))
    exclusive: bool = setting(False, "whole nodes (--exclusive): no other job shares them")
    segment_nodes: Optional[int] = setting(
        None, "nodes that must share one NVLink domain (a GB200 NVL72 replica: 16): Slurm's --segment on "
        "topology/block (Slurm ≥ 24.05; older: one segment per job, --switches=1); None = anywhere", range=count(1))
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    constraint: Optional[str] = None
    time_min: int = setting(60, "Slurm time limit, minutes", range=count(1))
    max_requeues: int = setting(3, "Slurm requeues after preemption / time limit, then stop", range=count(0))
    max_restarts: int = setting(
        0, "requeues of a Slurm job after a task dies (non-zero exit, kill -9, the hang watchdog), each resuming "
        "from the newest checkpoint; then the run ends FAILED (the hero: 1,000)", range=count(0))
    signal_delay_s: int = setting(120, "Slurm sends USR2 this long before the time limit (checkpoint time)", range=count(0))
    init_timeout_s: int = setting(300, "jax.distributed.initialize, and every process's wait for the others before the "
                                   "first collective (marin.train.barrier), waits this long", range=count(1))
    env: Dict[str, str] = setting(help="exported to every process of the job", factory=dict)
    xla_flags: str = setting("", "XLA_FLAGS of every process (with the forced host devices, and the environment's own XLA_FLAGS that this does not set)")
    setup: List[str] = setting(help="shell lines run before the job (module load, ...)", factory=list)
    peak_flops_per_device: float = setting(0.0, "for MFU; 0 = measure nothing, report no MFU", range=NON_NEGATIVE)
    memory_per_device_gib: Optional[float] = setting(None, "accelerator memory per device; None = unknown", range=POSITIVE)
    host_memory_per_device_gib: Optional[float] = setting(
        None, "host (CPU) memory per device for pinned-host offload; None = unknown", range=POSITIVE)
    host_link_gbps: Optional[float] = setting(
        None, "host↔device bandwidth per direction, GB/s (GB200 NVLink-C2C ≈ 450, H200 PCIe Gen5 ≈ 50): the plan's "
        "time for the bytes offload moves per step; None = unknown", range=POSITIVE)
    memory_usable_fraction: float = setting(0.9, "of that memory, what a run may plan to use (allocator, NCCL buffers)",
                                            range=real(0.0, 1.0, lo_open=True))
    mesh: MeshConfig = setting(factory=MeshConfig)


@dataclass
class DecayRule:
    """Decoupled weight decay on some parameters, decaying linearly to zero (`optim.decay`).

    The coefficient lies on the line from `value` at step `origin` to 0 at step `end`, and is 0
    outside [start, end): `origin` < `start` switches a decay on part-way down its line (the
    published run: 0.02 from step 0, on at 58,014, so 0.01703 there). Like AdamW's, it is
    multiplied by the group's learning rate.
    List items: checked by `marin.optim.decay.check`.
    """
    pattern: str = "???"                 # a group (muonh | adamh | adam | adamw) or a path suffix on whole components: "attn/gate", "a|b/c"
    value: float = 0.0                   # coefficient at `start`, ≥ 0
    start: int = 0                       # first step with decay
    end: Any = AUTO                      # the coefficient reaches 0 here; auto = train.steps
    origin: Any = AUTO                   # the line's coefficient is `value` here (≤ start); auto = start


@dataclass
class OptimConfig:
    """Optimizer (`conf/optim/`, code in `marin/optim/`)."""
    name: str = setting(CHOSEN, "the optimizer: the option chosen (optim=<name>)", choices=("adamw", "muonh"))
    lr: Any = setting(3e-3, "peak Adam lr: a number or auto (the spec's rule)", range=POSITIVE)
    muonh_lr_ratio: float = setting(13 / 3, "muonh_lr = ratio · adam lr (muonh and adamh groups)", range=POSITIVE)
    adam_lr_cap: float = setting(0.05, "cap of the auto rule", range=POSITIVE)
    b1: float = setting(0.9, "Adam β1", range=BETA)
    b2: Any = setting(0.95, "Adam β2: a number or auto", range=BETA)
    eps: Any = setting(1e-8, "Adam ε: a number or auto", range=POSITIVE)
    weight_decay: float = setting(0.0, "adamw only", range=NON_NEGATIVE)
    decay: List[DecayRule] = setting(help="scheduled decay rules, every optimizer; one rule per parameter", factory=list)
    momentum: float = setting(0.95, "MuonH Nesterov momentum", range=BETA)
    ns_steps: int = setting(5, "Newton–Schulz iterations", range=count(1))
    ns_dtype: str = setting("float32", "dtype of the Newton–Schulz iteration", choices=DTYPES)
    ns_eps: float = setting(1e-7, "Newton–Schulz normalisation: x / (‖x‖_F + ns_eps)", range=POSITIVE)
    ns_coefficients: Any = setting(
        "simple", "Newton–Schulz (a, b, c) per iteration: simple (one triple), quintic (the published 5-step "
        "schedule) or a list of ns_steps [a, b, c] triples (checked by marin.optim.newton_schulz)")
    grad_clip: Optional[float] = setting(None, "global-norm clip; None = off", range=POSITIVE)
    offload: Any = setting(False, "optimizer state (and fp32 masters) in pinned host memory; auto = on only where "
                           "the memory plan does not fit without it", choices=OFFLOAD_CHOICES)


@dataclass
class ScheduleConfig:
    """Learning-rate schedule (`conf/schedule/`, code registered in `marin/optim/schedule.py`), driven by train.steps."""
    name: str = setting(CHOSEN, "the schedule: the option chosen (schedule=<name>)", choices=SCHEDULES.names)
    warmup_frac: float = setting(0.01, "fraction of steps warming up", range=FRACTION)
    final_ratio: float = setting(0.05, "lr at the last step, as a fraction of peak", range=FRACTION)
    horizon_steps: Optional[int] = setting(None, "failure plan: a shortened horizon (≤ train.steps)", range=count(1))
    horizon_from_step: Optional[int] = setting(
        None, "resumed run: step the new horizon took effect (lr continuous there)", range=count(0))
    mixture_block: int = setting(
        0, "sequences per data-mixture block: a phase boundary moves down to a whole number of blocks "
        "(production 49,152); 0 = the nearest step", range=count(0))


@dataclass
class CheckpointConfig:
    every_steps: int = setting(0, "0 = only at the end and on preemption", range=count(0))
    keep_last: int = setting(2, "rolling checkpoints kept (permanent and forced ones are kept besides)", range=count(0))
    permanent_every: Any = setting(AUTO, "a permanent checkpoint (kept forever, a fork point) every M steps; 0 = none; "
                                   "auto = every 10% of train.steps in runs of 100 steps or more, else none",
                                   range=count(0))
    permanent_steps: List[int] = setting(help="steps written as permanent checkpoints besides permanent_every "
                                         "(production's one-off 55,000)", factory=list)
    async_save: bool = setting(True, "save in the background")
    every_minutes: float = setting(60.0, "a rolling checkpoint this often (0 = off); permanent ones by permanent_every / permanent_steps",
                                   range=NON_NEGATIVE)


@dataclass
class TrainConfig:
    """The loop (`marin/train/`)."""
    steps: Any = setting(AUTO, "auto = from the token budget, or a number", range=count(1))
    stop_after: Optional[int] = setting(None, "stop early; the schedule is unchanged", range=count(1))
    stop_at: Optional[int] = setting(
        None, "end this run at exactly this step with a checkpoint there, for a fork=<run>@<step> (a lineage's "
        "cutover); unlike stop_after, resume= and requeues keep it (train.stop_at=null goes on)", range=count(1))
    tokens_per_active_param: float = setting(791.0, "token budget rule for steps=auto", range=POSITIVE)
    seq_len: int = setting(128, "tokens per sequence (at least 2: a row of T tokens has T−1 next-token targets)",
                           range=count(2))
    global_batch: int = setting(16, "sequences per step, all processes together", range=count(1))
    micro_batch: Any = setting(AUTO, "sequences per device per forward; auto = global/devices", range=count(1))
    seed: int = setting(0, "seeds the init and the data order", range=count(0))
    eval_every: Any = setting(50, "steps between held-out evaluations (0 = only at the end); auto = every 5% of steps",
                              range=count(0))
    eval_batches: Optional[int] = setting(None, "batches per evaluation set; None = every batch of each set "
                                          "(production's)", range=count(1))
    eval_batch_size: Any = setting(AUTO, "sequences per evaluation batch, all processes together; auto = 64 per "
                                   "rack (hardware.racks): the hero's 704, one per device", range=count(1))
    eval_seq_len: Any = setting(AUTO, "tokens per eval sequence; auto = train.seq_len (a context-extension stage keeps "
                           "pretraining's 4,096, so its scores compare with the run before)", range=count(2))
    log_every: int = setting(1, "steps between logged metric rows (the loss is checked every step)", range=count(1))
    init_from: Optional[str] = setting(None, "start from another run's checkpoint (<run>[@<step>])")
    init_from_mode: str = setting(
        "weights", "weights: its parameters and router state, then train.steps new steps from step 0 (fresh "
        "optimizer and schedule); continue: its whole state and step counter (a context-extension stage)",
        choices=("weights", "continue"))
    init_seq_len: Optional[int] = setting(None, "sequence length of that run (qk_mult is rescaled)", range=count(1))
    earlier_seq_lens: List[int] = setting(help="lengths of the stages before that run, oldest first", factory=list)
    stage_start: Optional[float] = setting(
        None, "context-extension stage: where it starts, as a fraction of the run's steps (init_from's checkpoint)",
        range=real(0.0, 1.0, hi_open=True))
    stage_end: float = setting(1.0, "where it ends (the next stage starts there); sets stop_after when < 1",
                               range=real(0.0, 1.0, lo_open=True))
    watchdog_minutes: Optional[float] = setting(
        None, "end the job (exit 124, Python stacks in each process's log) when no step completes for this long; "
        "the first step, evals and checkpoints get 4x, at least 10 min; None = off", range=POSITIVE)
    checkpoint: CheckpointConfig = setting(factory=CheckpointConfig)


@dataclass
class TrackingConfig:
    uri: Optional[str] = setting(None, "else $MLFLOW_TRACKING_URI, else sqlite under run.out_dir")
    experiment: Optional[str] = setting(None, "MLflow experiment; default: the experiment name or \"default\"")
    system_metrics: bool = setting(True, "log the machine's CPU, memory, disk, network (GPU with nvidia-ml-py) "
                                   "as system/… every 10 s (MLflow's monitor, in the tracking process); false: off")
    report: bool = setting(True, "draw report.html at the run's end (in the tracking process); false: only when "
                           "asked, python -m marin.report <run>")


@dataclass
class RunConfig:
    name: str = setting("default", "names the run directory (experiments set it)")
    experiment: Optional[str] = setting(None, "set by conf/experiment/*.yaml; names the MLflow experiment")
    sweep: Optional[str] = setting(None, "set by sweeps/*.yaml; names the MLflow parent run")
    sweep_id: Optional[str] = setting(None, "groups a sweep's jobs under one parent; default: one per launch")
    out_dir: str = setting("outputs", "relative paths resolve against the project root")


@dataclass
class EvalConfig:
    """Held-out evaluation: every `train.eval_every` steps (the issue's `eval.every_steps`: one
    field, kept where saved runs have it), at each registered forecast point and at the end;
    always dropless, with drops too when `with_drops`. Metric names and the published ones:
    `marin.train.components.Evaluator`."""
    with_drops: Any = setting(False, "also log eval/<set>/loss_dropped and bpb_dropped, at the training capacity, "
                              "transport and shard size (published: eval/<set>/loss; the dropless one: "
                              "eval_dropless/...); auto = on with the fixed and pooled transports, off with ragged "
                              "(production's pass stopped at the ragged switch); true with ragged is refused",
                              choices=(True, False, AUTO))
    headline: Any = setting(AUTO, "the metric the run's summary line and its report lead with; auto = "
                            "eval/paloma/macro_loss (production's: the dropless Paloma macro average, published "
                            "eval_dropless/paloma/macro_loss) where an eval set is named paloma, else eval/macro_loss")


@dataclass
class PlanConfig:
    """What the dry run and the launch check before a run starts."""
    allow_over_memory: bool = setting(False, "launch even when the memory estimate exceeds the device's "
                                      "(Slurm) or this machine's (a CPU run here)")


@dataclass
class ForecastConfig:
    """A pre-registered loss forecast this run is checked against (`marin/track/forecast_check.py`)."""
    registered: Optional[str] = setting(None, "outputs/forecasts/<experiment>.yaml from `marin.forecast --register` "
                                        "(or its committed copy in conf/forecasts/)")
    extrapolation_offset: float = setting(0.0, "added to this rung's loss where the forecast extends it past its "
                                          "last evaluation (the published d2048 rung: its 60–80% line + 0.005)")
    c_last_layer_global: bool = setting(True, "the forecast's C counts the last layer as global, as the model runs "
                                        "it; false: every 4th layer only, as Marin's ladder FLOPs counted d2048 "
                                        "(5 of its 22 layers, the model ran 6)")


@dataclass
class DebugConfig:
    """Fault injection for tests of the hang watchdog (`marin/train/watchdog.py`)."""
    hang_at_step: Optional[int] = setting(None, "one process stops before step N, once per run (a hung collective)",
                                          range=count(1))
    hang_process: int = setting(0, "the process that hangs (jax.process_index)", range=count(0))


SCHEMA_VERSION = 1


@dataclass
class Config:
    """The root: group choices plus top-level settings (`conf/config.yaml`)."""
    model: ModelConfig = setting(factory=ModelConfig)
    attention: AttentionConfig = setting(factory=AttentionConfig)
    router: RouterConfig = setting(factory=RouterConfig)
    data: DataConfig = setting(factory=DataConfig)
    hardware: HardwareConfig = setting(factory=HardwareConfig)
    optim: OptimConfig = setting(factory=OptimConfig)
    schedule: ScheduleConfig = setting(factory=ScheduleConfig)
    train: TrainConfig = setting(factory=TrainConfig)
    tracking: TrackingConfig = setting(factory=TrackingConfig)
    run: RunConfig = setting(factory=RunConfig)
    eval: EvalConfig = setting(factory=EvalConfig)
    plan: PlanConfig = setting(factory=PlanConfig)
    forecast: ForecastConfig = setting(factory=ForecastConfig)
    debug: DebugConfig = setting(factory=DebugConfig)
    dry_run: Any = setting(False, "false | true | json | compile | compile_json | config")
    reproduce: Optional[str] = setting(None, "a run: its directory, name or MLflow run id, a unique prefix of "
                                       "one, or <sweep>/<job> (docs/runs.md)")
    reproduce_trust: bool = setting(False, "apply a saved config's hardware.env/xla_flags/setup even where they "
                                    "differ from the shipped option")
    verify: bool = setting(False, "with reproduce=: replay the run and compare every logged metric with its record")
    verify_steps: Optional[str] = setting(None, "a:b: replay only steps a…b, from the original's newest checkpoint ≤ a")
    verify_rtol: float = setting(0.0, "relative tolerance of the comparison (0 = bit for bit)", range=NON_NEGATIVE)
    resume: Optional[str] = setting(None, "a run: its directory, name or MLflow run id, a unique prefix of "
                                    "one, or <sweep>/<job> (docs/runs.md)")
    fork: Optional[str] = setting(None, "<run directory or MLflow run id>@<step>: a new run from that checkpoint "
                                  "(marin/launch/fork.py)")
    wait: bool = setting(False, "Slurm: follow the job and exit with its result")
    schema_version: int = setting(SCHEMA_VERSION, "bumped when a field is renamed",
                                  range=count(SCHEMA_VERSION, SCHEMA_VERSION))


GROUPS = {
    "model": ModelConfig,
    "attention": AttentionConfig,
    "router": RouterConfig,
    "data": DataConfig,
    "hardware": HardwareConfig,
    "optim": OptimConfig,
    "schedule": ScheduleConfig,
}
