"""Exact parameter and FLOP accounting from the config alone (spec §1a, §1b), the parameter
tree as a table of leaves, and the memory-per-device estimate of the dry run (spec §6).

Nothing here allocates or imports JAX: the 535B plan is computed in microseconds. The counts
mirror the shapes built in `marin/model/transformer.py`; `tests/model/test_accounting.py`
checks the all-leaf count against `jax.eval_shape` of the real model.

Symbols as in the spec: d width, L layers, H query heads of dim h, KV the stored (local) KV
heads, E experts with top-k, ℓ latent width, I expert width, S shared experts of width I_s,
V vocabulary, r GatedNorm rank.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, replace

from marin.config.counts import Shapes, active_params_of, layer_is_global, total_params_of  # shapes: config arithmetic
from marin.config.derive import OffloadCost, batch_shards, pooled_capacities, ragged_buffer_rows, remat_mode
from marin.config.derive import drops_microbatches as derive_drops_microbatches
from marin.config.derive import simulated_epoch_fraction as derive_fraction
from marin.config.schema import Config
from marin.model import loss_tiling  # pure Python: the fused loss's tile sizes


def _gated_norm(s: Shapes) -> int:
    return 2 * s.d * s.r               # W_down d×r and W_up r×d (zero when r = 0)


def extra_leaves_per_layer(s: Shapes) -> dict[str, int]:
    """Every non-matrix leaf of one layer, by name (router bias excluded: it is train state)."""
    return {
        "gated_norms": 2 * _gated_norm(s),
        "head_gate": s.d * s.H if s.output_gate else 0,
        "rms_gains": 2 * s.d,
        "latent_gain": s.latent,
        "conv_k": s.kv_local * s.h * s.conv if s.conv_k else 0,
        "conv_attn_out": s.d * s.conv,
        "conv_moe_out": s.d * s.conv,
    }


def all_leaves_of(s: Shapes, router_bias_in_params: bool = False) -> int:
    """Every parameter leaf the model stores. QB's router bias lives in the train state, not
    among the parameters, so it is excluded unless asked (it changes the count by L·E)."""
    per_layer = sum(extra_leaves_per_layer(s).values()) + (s.E if router_bias_in_params else 0)
    once = 2 * (s.d + _gated_norm(s))  # RMSNorm + GatedNorm after the embedding and before the head
    return total_params_of(s) + s.L * per_layer + once


def forward_flops_per_token(s: Shapes, seq_len: int, window: int, with_head: bool = True) -> int:
    """Spec §1b: forward FLOPs per token; attention span = seq_len on global layers, the window
    (at most seq_len) on local ones."""
    uniform = (
        2 * 3 * s.latent * s.I * s.k   # routed experts, in the latent
        + 2 * 3 * s.d * s.I_s * s.S    # shared experts
        + 2 * s.d * s.E                # router
        + 2 * 2 * s.d * s.latent       # latent projections
        + 2 * s.d * s.H * s.h          # output projection
    )
    total = s.L * uniform
    for is_global in s.global_layers:
        kv = s.kv_global if is_global else s.kv_local
        span = seq_len if is_global else min(window, seq_len)
        total += 2 * s.d * (s.H * s.h + 2 * kv * s.h)
        total += 4 * span * s.H * s.h + 3 * span * s.H
    if with_head:
        total += 2 * s.d * s.V
    return total


# Convenience wrappers over a resolved config.
def total_params(cfg: Config) -> int:
    return total_params_of(Shapes.of(cfg))


def active_params(cfg: Config) -> int:
    return active_params_of(Shapes.of(cfg))


def flops_per_token(cfg: Config, with_head: bool = True) -> int:
    """Training-step FLOPs are 3 × this × tokens."""
    return forward_flops_per_token(Shapes.of(cfg), cfg.train.seq_len, cfg.attention.window, with_head)


def train_flops(cfg: Config, with_head: bool = True, steps: int | None = None) -> int:
    """Spec §1b: 3 × forward FLOPs per token × the run's tokens (steps × seq_len × global batch);
    `steps` = those this run trains (a stage's own), default train.steps."""
    steps = cfg.train.steps if steps is None else steps
    return 3 * flops_per_token(cfg, with_head) * steps * cfg.train.seq_len * cfg.train.global_batch


def forecast_shapes(cfg: Config) -> Shapes:
    """The shapes the forecast's C counts: the model's own, or with `forecast.c_last_layer_global`
    false every 4th layer global but not the last one too. Marin's ladder FLOPs (levanter's
    `lm_flops_per_token`) counted d2048's 22 layers so: 5 global where the model ran 6, and the
    published C of that rung is that count (the other rungs' last layer is a 4th one anyway)."""
    s = Shapes.of(cfg)
    if cfg.forecast.c_last_layer_global:
        return s
    a = cfg.attention
    return dataclasses.replace(s, global_layers=tuple(layer_is_global(s.L, a.global_every, False)))


def forecast_flops(cfg: Config, steps: int | None = None) -> int:
    """C of the ladder forecast (spec §4, §9): training FLOPs without the head over `steps` (default
    the run's horizon: schedule.horizon_steps, else train.steps), counted on `forecast_shapes`."""
    steps = (cfg.schedule.horizon_steps or cfg.train.steps) if steps is None else steps
    per_token = forward_flops_per_token(forecast_shapes(cfg), cfg.train.seq_len, cfg.attention.window, False)
    return 3 * per_token * steps * cfg.train.seq_len * cfg.train.global_batch


def simulated_epoch_fraction(cfg: Config) -> float | None:
    """`derive.simulated_epoch_fraction` for this run: its training FLOPs (head included, over its
    planned steps, as Marin's rule reads them) decide whether it simulates."""
    steps = cfg.schedule.horizon_steps or cfg.train.steps
    return derive_fraction(cfg, train_flops(cfg, steps=steps))


# --- Every parameter leaf, with its optimizer group and sharding (for the memory plan) ---

@dataclass(frozen=True)
class Leaf:
    path: str                 # as in the parameter tree (docs/CONTRACTS.md)
    shape: tuple[int, ...]    # as the model stores it; `layers/` leaves stack L first
    group: str                # optimizer group under muonh: muonh | adamh | adam
    expert: bool              # has the E axis (dim 1), so it is sharded over mesh.expert

    @property
    def size(self) -> int:
        return math.prod(self.shape)


def leaves_of(s: Shapes) -> list[Leaf]:
    """The parameter tree as a flat list; sums to `all_leaves_of(s)`. Groups follow spec §3:
    MuonH on every matrix but embedding, router, head gate and head; AdamH on the head."""
    d, L, r, K = s.d, s.L, s.r, s.conv
    kv = s.kv_local * s.h

    def gated_norm(prefix: str, stack: tuple[int, ...]) -> list[Leaf]:
        if not r:
            return []
        return [Leaf(f"{prefix}/down", (*stack, d, r), "muonh", False),
                Leaf(f"{prefix}/up", (*stack, r, d), "muonh", False)]

    leaves = [
        Leaf("embed/embedding", (s.V, d), "adam", False),
        Leaf("embed_norm/scale", (d,), "adam", False), *gated_norm("embed_gated_norm", ()),
        Leaf("layers/attn_norm/scale", (L, d), "adam", False), *gated_norm("layers/attn_gated_norm", (L,)),
        Leaf("layers/attn/wq", (L, d, s.H * s.h), "muonh", False),
        Leaf("layers/attn/wk", (L, d, kv), "muonh", False),
        Leaf("layers/attn/wv", (L, d, kv), "muonh", False),
        Leaf("layers/attn/wo", (L, s.H * s.h, d), "muonh", False),
    ]
    if s.output_gate:
        leaves.append(Leaf("layers/attn/gate", (L, d, s.H), "adam", False))
    if s.conv_k and K:
        leaves.append(Leaf("layers/attn/conv_k", (L, K, kv), "adam", False))
    if K:
        leaves.append(Leaf("layers/attn_out_conv/kernel", (L, K, d), "adam", False))
    leaves += [
        Leaf("layers/moe_norm/scale", (L, d), "adam", False), *gated_norm("layers/moe_gated_norm", (L,)),
        Leaf("layers/moe/router", (L, d, s.E), "adam", False),
        Leaf("layers/moe/latent_down", (L, d, s.latent), "muonh", False),
        Leaf("layers/moe/latent_norm/scale", (L, s.latent), "adam", False),
        Leaf("layers/moe/latent_up", (L, s.latent, d), "muonh", False),
        Leaf("layers/moe/w_gate", (L, s.E, s.latent, s.I), "muonh", True),
        Leaf("layers/moe/w_up", (L, s.E, s.latent, s.I), "muonh", True),
        Leaf("layers/moe/w_down", (L, s.E, s.I, s.latent), "muonh", True),
    ]
    if s.S:
        leaves += [Leaf("layers/moe/shared_gate", (L, s.S, d, s.I_s), "muonh", False),
                   Leaf("layers/moe/shared_up", (L, s.S, d, s.I_s), "muonh", False),
                   Leaf("layers/moe/shared_down", (L, s.S, s.I_s, d), "muonh", False)]
    if K:
        leaves.append(Leaf("layers/moe_out_conv/kernel", (L, K, d), "adam", False))
    leaves += [
        Leaf("final_norm/scale", (d,), "adam", False), *gated_norm("final_gated_norm", ()),
        Leaf("head/kernel", (d, s.V), "adamh", False),
    ]
    return [leaf for leaf in leaves if leaf.size]


# --- Memory per device: the layout the code uses, an estimate for the dry run (spec §6) ---
#
# The estimate is of what `dry_run=compile` reports (marin/launch/compile_plan.py): XLA's memory
# analysis of the compiled step on one replica, device side. The train step holds its arguments
# (parameters, batch, the optimizer state unless optim.offload moves it to pinned host memory, in
# which case the largest leaf is staged in at a time) plus the largest of four phases' transients:
#   forward   one layer's buffers (dispatch, attention) and the embedding's, with the carries saved so far;
#   loss      one tile of the fused head + loss (marin/model/loss.py: a row chunk by a vocabulary
#             tile, marin/model/loss_tiling.py): its fp32 logits and their gradient, the
#             gathered head and its gradient;
#   backward  the gradients accumulating, one layer's recomputed buffers and their cotangents;
#   update    the gradients and the optimizer's temporaries (MuonH: one layer at a time).
# Each phase is counted in the layout's own arrays (per device, one micro-batch of `tokens`):
#   X  one fp32 [tokens, d] array (the residual stream, its cotangent, norms' outputs);
#   A  one fp32 [tokens, H·h] array (queries, attention outputs and their cotangents);
#   D  one fp32 dispatch buffer of the training transport (`dispatch_rows`: E·C rows for fixed, one
#      wave's for pooled, the shared receive buffer for ragged) of max(ℓ, I) (marin/model/dispatch.py,
#      expert_parallel.py); evaluation's: E·C rows (or E·T unbounded);
#   LAT one fp32 [tokens, ℓ] array (the latent: down-projected, normed, combined);
#   LC one tile of fp32 logits [row chunk, vocabulary tile];  HV the head (or embedding) [d, V] fp32;
#   LCD the same tile's gradient, cast to the compute dtype for the head's two backward matmuls;
#   W  one layer's non-expert weights in fp32, gathered whole under FSDP (and their gradient).
# The "copies" of each are calibrated on the compiled ladder rungs, stages and hero (their table
# and the 20% check: tests/launch/test_memory_plan.py). XLA:CPU computes bf16 matmuls in fp32, so
# a CPU compile holds X, A, LAT, D (and the logits' cotangent) in fp32; XLA:GPU keeps them in
# model.compute_dtype. The estimate counts them at `working_bytes(cfg, backend)`: fp32 for what
# `dry_run=compile` reports (backend "cpu"), the compute dtype for a GPU (the plan of GPU
# hardware; checked against one H200's measured peaks in tests/launch/test_memory_plan.py).
# The copies are the same on both: only the element size differs.
# XLA packs the buffers into one arena and loses some of it to fragmentation (ARENA).

GIB = 2 ** 30
FP32 = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
FSDP_MIN_SIZE = 2 ** 14       # as marin/train/state.py: smaller leaves stay replicated
PHASES = ("forward", "loss", "backward", "update")
# Calibrated (see above): copies of each array live at the phase's high-water mark.
FORWARD = {"D": 3.0, "X": 10.0, "HV": 3.0}
# LOSS's LC and LCD: the fused loss's tile (logits and softmax; the cast gradient), not yet
# calibrated on a compile of it: the loss phase is below the backward's on the rungs and the hero.
LOSS = {"LC": 2.0, "LCD": 1.0, "HV": 4.0, "X": 13.0}
BACKWARD = {"D": 6.0, "X": 28.0, "A": 13.0, "LAT": 5.0, "HV": 1.0, "W": 3.0}
ARENA = 1.08                  # the arena over a phase's live buffers (compiled rungs: ≈4–8%; hero more)
UPDATE_LEAF = 2.0             # whole-leaf fp32 temporaries of the largest stacked leaf (momentum, direction)
NS_COPIES = 6.0               # Newton–Schulz temporaries of one layer's slice of a matrix leaf
# The eval step (one forward per pass, nothing saved; `eval_memory_per_device`), calibrated on the
# compiled rung (peak in the loss) and hero (peak where the head is tiled), 2026-12 with the eval batch
# of `train.eval_batch_size`: over the step, the head gathered and cut into vocabulary tiles (one HV,
# hoisted out of both passes' losses) and, under FSDP, XLA:CPU's relayout of the sharded layer stacks
# (hoisted out of both passes' layer scans); then the largest of three phases:
EVAL_HEAD = {"HV": 1.0, "X": 3.0}       # tiling the head: the gathered, transposed copy it is cut from
EVAL_LAYER = {"D": 3.0, "X": 4.0}       # one layer: its dispatch buffers (either pass) and the residual's arrays
EVAL_LOSS = {"LC": 2.0}                 # one loss tile: the logits and their masked copy
ATTN_SCORE_COPIES = 2.4       # reference attention: [B, H, T, T] fp32 arrays in one layer
ATTN_SAVED_COPIES = 4.2       # the same arrays each layer keeps without remat
# cuDNN 9.19's packed-row backward, bytes per (row, position, head, head dim) and document slot: one
# H200 (ladder_d768, B 32 × 4,096, 6 heads × 128) compiled the train step to 63.2 GiB of temporaries
# with 64 slots and 23.8 GiB with 8 (benchmarks/gpu.py, 2026-12-04, jax 0.11.2): 39.4 GiB / 56 slots.
CUDNN_SLOT_BYTES = 7.5


def optimizer_moments(leaf: Leaf, optimizer: str) -> int:
    """fp32 state tensors per parameter: AdamW keeps two moments everywhere; MuonH keeps one
    momentum on its matrices and two Adam moments on the adam / adamh groups."""
    if optimizer == "muonh" and leaf.group == "muonh":
        return 1
    return 2


def fsdp(cfg: Config) -> bool:
    """Non-expert state sharded over the rack (hardware.mesh.fsdp)."""
    return bool(cfg.hardware.mesh.fsdp)


def leaf_shards(leaf: Leaf, cfg: Config) -> int:
    """Ways one leaf is split over a replica's devices, as marin/train/state.py lays it out:
    expert leaves over `expert` (and, with FSDP, their largest other dim over `data`); with FSDP
    every other leaf of at least FSDP_MIN_SIZE elements over data × expert, on a dim that size
    divides (never the stacked-layer dim); the rest replicated."""
    mesh = cfg.hardware.mesh
    data, expert = int(mesh.data), mesh.expert
    stacked = leaf.path.startswith("layers/") and len(leaf.shape) > 1
    if leaf.expert:
        other = leaf.shape[2:]
        return expert * (data if fsdp(cfg) and data > 1 and any(n % data == 0 for n in other) else 1)
    if not fsdp(cfg) or leaf.size < FSDP_MIN_SIZE:
        return 1
    rack = data * expert
    free = leaf.shape[1:] if stacked else leaf.shape
    return rack if any(n % rack == 0 for n in free) else 1


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Rows per expert on one device (marin/model/dispatch.py: cf·T·k/E up to a multiple of 8, ≤ T)."""
    c = math.ceil(capacity_factor * tokens * top_k / num_experts)
    return max(1, min(8 * math.ceil(c / 8), tokens))


def dispatch_rows(cfg: Config, tokens: int) -> int:
    """Rows of one dispatch buffer of the training transport (`model.ep_transport`) on one device
    holding `tokens` tokens, as marin/model/dispatch.py and expert_parallel.py size them
    (`derive.pooled_capacities`, `derive.ragged_buffer_rows`):
      fixed   E·C (the [E, C, ℓ] send buffer; the receive side is as large);
      pooled  ep_waves × one wave's max(peers·S, local·R) (its send pool, its receive buffer): as
              compiled inside a recomputed block (XLA:CPU, ladder_d768: pooled 15.05 GiB, fixed
              15.64, ragged 15.61) the waves' buffers add up at the backward pass's high-water
              mark like one fixed buffer, so their sum is what counts;
      ragged  max(T·k, one chunk's receive buffer): the sorted send rows and the receive buffer of
              the chunk of local experts in flight (`model.ep_expert_chunks`)."""
    s, m = Shapes.of(cfg), cfg.model
    k, E = s.k, s.E
    peers = max(1, int(cfg.hardware.mesh.expert))
    local = max(1, E // peers)
    n = tokens * k
    if m.ep_transport == "pooled":
        waves = max(1, int(m.ep_waves))
        send, recv = pooled_capacities(tokens, k, E, peers, waves, m.ep_send_capacity_factor, m.ep_recv_capacity_factor)
        return waves * max(peers * send, local * recv)
    if m.ep_transport == "ragged":
        chunks = max(1, min(int(m.ep_expert_chunks), local)) if peers > 1 else 1
        return max(n, ragged_buffer_rows(tokens, k, E, peers, m.ep_recv_capacity_factor, chunks))
    return E * capacity(tokens, k, E, m.capacity_factor)


def layer_activations_per_token(s: Shapes, slots: float, impl: str) -> dict[str, float]:
    """Values one block computes in its forward pass, per token (elements, compute dtype);
    `slots` = dispatch rows per token (E·C / T). What remat=none saves for every layer."""
    qkv = s.H * s.h + 2 * s.kv_local * s.h
    return {
        "attn_norms": 3 * s.d + s.r,                    # RMSNorm out, GatedNorm bottleneck, gate, out
        "qkv": qkv + s.kv_local * s.h + 2 * s.H * s.h,  # + conv(K); q and k (expanded to H) normed
        "attention": 3 * s.H * s.h + (2 * s.H if impl != "reference" else s.H),  # out, XSA, gated; lse, gate
        "attn_out": 2 * s.d,                            # W_o output, convolution
        "moe_norms": 3 * s.d + s.r,
        "router": 2 * s.E,                              # fp32 logits
        "latent": 3 * s.latent + s.d,                   # down, normed, combined; up
        "experts": slots * (2 * s.latent + 3 * s.I),    # dispatch send/recv, gate, up, product
        "shared": s.S * 3 * s.I_s,
        "moe_out": 2 * s.d,                             # convolution, residual
    }


def _dot_outputs_per_token(s: Shapes) -> float:
    """What remat=dots keeps per token and layer: outputs of matmuls without batch dims (as
    compiled: ladder_d768 with dots saves these and the carry, nothing else)."""
    return (s.H * s.h + 2 * s.kv_local * s.h + s.d + s.H + s.E      # q, k, v, W_o, head gate, router
            + s.latent + s.d + 2 * s.r + 2 * s.S * s.I_s)           # latent down / up, GatedNorm downs, shared gate / up


def attention_bytes(cfg: Config, batch: int, copies: float = ATTN_SCORE_COPIES) -> float:
    """One layer's attention arrays beyond A: reference attention forms [B, H, T, T] fp32 scores
    (and a [B, T, T] mask); the blockwise kernel (and cuDNN's) only block tiles, within A's copies."""
    s, T = Shapes.of(cfg), cfg.train.seq_len
    if cfg.attention.impl == "reference":
        return batch * (copies * s.H * T * T * FP32 + T * T)
    return 0.0


def cudnn_packed_bytes(cfg: Config, batch: int) -> float:
    """The backward workspace of cuDNN's packed-row attention (`attention.impl=cudnn`, a GPU's run):
    it grows with the document slots of the segment offsets (`attention.cudnn_max_documents`),
    CUDNN_SLOT_BYTES per (row, position, head, head dim) per slot."""
    if cfg.attention.impl != "cudnn":
        return 0.0
    s = Shapes.of(cfg)
    return CUDNN_SLOT_BYTES * cfg.attention.cudnn_max_documents * batch * cfg.train.seq_len * s.H * s.h


def offloaded_masters(cfg: Config) -> bool:
    """Whether the routed experts' fp32 masters live in pinned host memory (as
    marin/train/state.py `offloaded_masters`): optim.offload under MuonH, whose update streams
    them one layer at a time."""
    return bool(cfg.optim.offload) and cfg.optim.name == "muonh"


def _state(cfg: Config) -> dict[str, float]:
    """Per device, bytes: parameters on the device and in host memory, all their gradients,
    the optimizer state, its largest leaf the step copies to the device whole (with
    optim.offload: MuonH streams its momentum per layer instead), the largest stacked MuonH leaf
    and one layer's slice of the largest MuonH matrix, one layer's non-expert weights
    gathered whole (FSDP), and the FSDP-sharded non-expert layer stacks as one device holds them."""
    s = Shapes.of(cfg)
    keys = ("params", "host_params", "grads", "moments", "staged", "muon_leaf", "muon_slice", "layer_weights",
            "layer_stacks")
    out = dict.fromkeys(keys, 0.0)
    for leaf in leaves_of(s):
        local = leaf.size / leaf_shards(leaf, cfg) * FP32
        out["host_params" if leaf.expert and offloaded_masters(cfg) else "params"] += local
        out["grads"] += local
        moments = optimizer_moments(leaf, cfg.optim.name)
        out["moments"] += local * moments
        streamed = cfg.optim.name == "muonh" and leaf.group == "muonh"
        if not streamed:
            out["staged"] = max(out["staged"], local)
        if cfg.optim.name == "muonh" and leaf.group == "muonh":
            stacked = leaf.path.startswith("layers/")
            out["muon_leaf"] = max(out["muon_leaf"], local)
            out["muon_slice"] = max(out["muon_slice"], local / (s.L if stacked else 1))
        if leaf.path.startswith("layers/") and not leaf.expert and fsdp(cfg):
            out["layer_weights"] += leaf.size / s.L * FP32
            if leaf_shards(leaf, cfg) > 1:
                out["layer_stacks"] += local
    return out


BACKENDS = ("cpu", "gpu")


def backend_of(cfg: Config, backend: str | None = None) -> str:
    """What the estimate is of: `backend` if given, else the hardware's platform (a GPU's run;
    `dry_run=compile` asks for "cpu", the XLA:CPU program it compiles)."""
    backend = backend or cfg.hardware.platform
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    return backend


def working_bytes(cfg: Config, backend: str) -> int:
    """Bytes per element of the arrays around the bf16 matmuls (X, A, LAT, D, what remat=dots
    keeps, the logits' cotangent): XLA:CPU's float normalization computes every bf16 op in fp32
    (docs/memory.md, "bf16 slices on XLA:CPU"), so the CPU compile holds them in fp32; XLA:GPU
    keeps them in model.compute_dtype (half, for bf16: one H200's measured peaks)."""
    return FP32 if backend == "cpu" else DTYPE_BYTES[cfg.model.compute_dtype]


def loss_tile_bytes(cfg: Config, sequences: int, element_bytes: int = FP32) -> float:
    """One tile of the fused loss's logits on a device holding `sequences` rows:
    [row chunk, vocabulary tile] (marin/model/loss.py, its sizes from marin/model/loss_tiling.py).
    The one place the plan models the loss kernel."""
    T = cfg.train.seq_len
    rows = sequences * T // loss_tiling.row_chunks(sequences, T)   # `sequences` is already per device
    return rows * loss_tiling.vocab_tiling(Shapes.of(cfg).V)[1] * element_bytes


def _units(cfg: Config, tokens: int, micro: int, eval_dispatch: bool = False,
           backend: str = "cpu") -> dict[str, float]:
    """The arrays of the module comment, in bytes per device, for `micro` sequences (`tokens`)
    on one device, on `backend` (`working_bytes`)."""
    s, m = Shapes.of(cfg), cfg.model
    unbounded = eval_dispatch and m.eval_dropless and m.eval_dispatch == "unbounded"
    cap = tokens if unbounded else capacity(tokens, s.k, s.E, m.capacity_factor)
    # Training: the transport's buffers; dropless evaluation: the fixed capacity's (in waves) or C = T.
    rows = s.E * cap if eval_dispatch else dispatch_rows(cfg, tokens)
    work = working_bytes(cfg, backend)
    return {"X": tokens * s.d * work, "A": tokens * s.H * s.h * work, "LAT": tokens * s.latent * work,
            "D": rows * max(s.latent, s.I) * work,
            "LC": loss_tile_bytes(cfg, micro),                  # the logits: fp32 on every backend
            "LCD": loss_tile_bytes(cfg, micro, work),           # their gradient, cast for the head's matmuls
            "HV": s.d * s.V * FP32, "W": _state(cfg)["layer_weights"]}


def micro_batches(cfg: Config) -> int:
    """Micro-batches per step (as marin/train/step.py `num_microbatches`): the per-device batch
    over train.micro_batch."""

    return max(1, cfg.train.global_batch // batch_shards(cfg.hardware) // int(cfg.train.micro_batch))


def _copies(units: dict[str, float], copies: dict[str, float]) -> float:
    return sum(n * units[name] for name, n in copies.items())


def memory_per_device(cfg: Config, remat: bool | str | None = None, backend: str | None = None) -> dict[str, float]:
    """GiB per device of a resolved config's train step, by part, with their total ("total");
    "host" is what optim.offload / model.offload_carry keep in pinned host memory instead (not
    in the total); "peak_phase" indexes PHASES. `backend`: `backend_of` (default: the hardware's
    platform). Tensor parallelism (mesh.model) is not counted."""

    s = Shapes.of(cfg)
    t, m = cfg.train, cfg.model
    mode = remat_mode(m.remat if remat is None else remat)
    backend = backend_of(cfg, backend)
    per_device = t.global_batch // batch_shards(cfg.hardware)     # sequences per device and step
    micro = int(t.micro_batch)
    n_micro = micro_batches(cfg)
    tokens = micro * t.seq_len                                    # one micro-batch on one device
    u = _units(cfg, tokens, micro, backend=backend)
    state = _state(cfg)
    params = state["params"]
    offload = bool(cfg.optim.offload)
    optimizer = state["staged"] if offload else state["moments"]  # offload: one leaf at a time
    # Every parameter's gradient, on the device as XLA:CPU compiles the step: it drops the
    # placement of the offloaded masters' gradients in host memory (their transpose), which a
    # GPU keeps there (the hero: 30 GiB less). The accumulator of micro-batches holds them too.
    grads = state["grads"] * (2 if n_micro > 1 else 1)
    batch = 4 * 4 * per_device * t.seq_len                        # inputs, targets, segments, mask (int32)

    # Saved for the backward pass: every layer's values without remat; the carries (fp32) and,
    # with dots, the matmul outputs; offload_carry keeps the carries in host memory.
    carry = tokens * s.d * DTYPE_BYTES.get(str(getattr(m, "residual_dtype", "float32")), FP32)  # the residual stream
    if mode == "none":
        slots = s.E * capacity(tokens, s.k, s.E, m.capacity_factor) / tokens
        per_layer = sum(layer_activations_per_token(s, slots, cfg.attention.impl).values())
        saved = s.L * (tokens * per_layer * DTYPE_BYTES[m.compute_dtype] + attention_bytes(cfg, micro, ATTN_SAVED_COPIES))
    else:
        # fp32 as XLA:CPU compiles the bf16 matmuls (a GPU keeps bf16 ones at half)
        dots = tokens * _dot_outputs_per_token(s) * working_bytes(cfg, backend) if mode == "dots" else 0.0
        saved = s.L * (dots + (0.0 if m.offload_carry else carry))
    host = s.L * carry if m.offload_carry and mode != "none" else 0.0
    if offload:
        host += state["moments"] + state["host_params"]

    accumulator = grads - state["grads"]
    phases = {  # (activations, gradients, working) of each phase
        "forward": (saved, accumulator, _copies(u, FORWARD) + attention_bytes(cfg, micro)),
        "loss": (saved, accumulator, _copies(u, LOSS)),
        "backward": (saved, grads, _copies(u, BACKWARD) + attention_bytes(cfg, micro)),
        "update": (0.0, grads, UPDATE_LEAF * state["muon_leaf"] + NS_COPIES * state["muon_slice"]),
    }
    phases = {name: (saved_, grads_, ARENA * work) for name, (saved_, grads_, work) in phases.items()}
    if backend == "gpu":   # one workspace of cuDNN's backward (the CPU compile runs blockwise): no arena
        saved_, grads_, work = phases["backward"]
        phases["backward"] = (saved_, grads_, work + cudnn_packed_bytes(cfg, micro))
    peak = max(phases, key=lambda name: sum(phases[name]))
    parts = {"params": params, "optimizer": optimizer, "batch": batch,
             **dict(zip(("activations", "gradients", "working"), phases[peak]))}
    gib = {name: value / GIB for name, value in parts.items()}
    gib["total"] = sum(gib.values())
    gib["host"] = host / GIB
    gib["peak_phase"] = list(phases).index(peak)
    return gib


def eval_memory_per_device(cfg: Config, backend: str | None = None) -> float:
    """GiB per device of the eval step (marin/train/step.py `make_eval_step`): the parameters (jit
    drops the optimizer state, which the step does not read), the per-device eval batch
    (`train.eval_batch_size`) and what XLA keeps over the whole step (`EVAL_*` above: the tiled
    head, the relaid layer stacks), plus the largest phase of its forward passes (no micro-batches,
    nothing saved): tiling the head, one layer, one loss tile. Two passes with `eval.with_drops`:
    the dropless one sizes its dispatch buffers by `model.eval_dispatch` (`waves` reuses the
    training capacity, `unbounded` gives every expert room for all T tokens); the with-drops one
    runs the training transport on pieces of `train.micro_batch` rows (`derive.drops_microbatches`).
    T is `train.eval_seq_len` (a context stage scores at pretraining's length)."""

    if isinstance(cfg.train.eval_seq_len, int) and cfg.train.eval_seq_len != cfg.train.seq_len:
        cfg = replace(cfg, train=replace(cfg.train, seq_len=cfg.train.eval_seq_len))
    t = cfg.train
    backend = backend_of(cfg, backend)
    per_device = max(1, t.eval_batch_size // batch_shards(cfg.hardware))   # the eval batch's rows
    u = _units(cfg, per_device * t.seq_len, per_device, eval_dispatch=True, backend=backend)
    state = _state(cfg)
    tiled_head = u["HV"]                    # gathered once, cut into vocabulary tiles, kept for every loss
    relaid_stacks = state["layer_stacks"]   # XLA:CPU's relayout of the FSDP-sharded stacks (counted on a GPU too)
    resident = state["params"] + 16 * per_device * t.seq_len + tiled_head + relaid_stacks
    layer = _copies(u, EVAL_LAYER) + attention_bytes(cfg, per_device)     # the dropless pass
    if cfg.eval.with_drops is True:          # (resolved) the with-drops pass: the training transport on its pieces
        piece = per_device // derive_drops_microbatches(cfg, t.eval_batch_size)
        drops = _units(cfg, piece * t.seq_len, piece, backend=backend)
        layer = max(layer, _copies(drops, EVAL_LAYER) + attention_bytes(cfg, piece))
    phases = {"head": _copies(u, EVAL_HEAD), "layer": layer, "loss": _copies(u, EVAL_LOSS)}
    return (resident + max(phases.values())) / GIB


# --- What a verdict judges, and what offload moves over the host link ---

def verdict_backends(cfg: Config) -> tuple[str, ...]:
    """The estimates a verdict (fits, a Slurm refusal, optim.offload / model.offload_carry `auto`)
    takes the larger of: the CPU compile's, and on a GPU the GPU's. The GPU figure (bf16 buffers)
    is within 7% of one H200's measured peaks, but that device ran no collectives; on a rack the
    GPU also holds all-to-all and NCCL buffers neither figure models, and production's peaks
    (pooled 136–150 GiB per GB200) sat at the CPU compile's figure (143.5 GiB), not the GPU
    model's (~96): on the GPU figure alone the hero would seem to fit without optimizer offload."""
    return tuple(dict.fromkeys(("cpu", cfg.hardware.platform)))


def step_peaks(cfg: Config) -> dict[str, float]:
    """{"train": GiB, "eval": GiB}: each step's estimate per device, the larger over `verdict_backends`."""
    backends = verdict_backends(cfg)
    return {"train": max(memory_per_device(cfg, backend=b)["total"] for b in backends),
            "eval": max(eval_memory_per_device(cfg, backend=b) for b in backends)}


def device_peak(cfg: Config) -> float:
    """What a verdict judges (GiB per device): the larger of the train and eval steps' `step_peaks`."""
    return max(step_peaks(cfg).values())


def host_traffic(cfg: Config) -> dict[str, float]:
    """Bytes per device and step between pinned host memory and the device, as the train step
    moves them ("<part>_in": host→device, "<part>_out": device→host; "in", "out": the sums):
      optimizer  optim.offload: the state the update stages whole (Adam moments) comes in and goes
                 back; MuonH's momentum is read and written one layer at a time: each once a step;
      masters    the experts' offloaded fp32 masters (optim.offload under MuonH): each layer's slice
                 fetched in the forward pass and again in the recomputed one (remat), per
                 micro-batch, its gradient sent back per micro-batch; then per layer MuonH reads
                 the gradient and the master and writes the update, the parameter update reads
                 both and writes the master, and grad_norm reads the gradient (marin/train/step.py,
                 marin/optim/muonh.py `per_layer`): in 5, out 2 of their size;
      carries    model.offload_carry: every layer's carry out in the forward pass, in for the backward.
    One H200, ladder_d768 at batch 32 with the recipe's offload: ≈47 GB host→device per step
    (tests/launch/test_memory_plan.py)."""
    s, t, m = Shapes.of(cfg), cfg.train, cfg.model
    out = dict.fromkeys(("optimizer_in", "optimizer_out", "masters_in", "masters_out", "carries_in", "carries_out"), 0.0)
    n_micro = micro_batches(cfg)
    if cfg.optim.offload:
        state = _state(cfg)
        out["optimizer_in"] = out["optimizer_out"] = state["moments"]
        masters = state["host_params"]
        fetches = (1 if remat_mode(m.remat) == "none" else 2) * n_micro
        out["masters_in"] = masters * (fetches + 5)
        out["masters_out"] = masters * (n_micro + 2)
    if m.offload_carry and remat_mode(m.remat) != "none":
        per_device = t.global_batch // batch_shards(cfg.hardware)
        carries = s.L * per_device * t.seq_len * s.d * DTYPE_BYTES[m.residual_dtype]
        out["carries_in"] = out["carries_out"] = carries
    out["in"] = sum(v for k, v in out.items() if k.endswith("_in"))
    out["out"] = sum(v for k, v in out.items() if k.endswith("_out"))
    return out


def host_link_seconds(cfg: Config, traffic: dict[str, float] | None = None) -> float | None:
    """Seconds a step's host traffic takes at `hardware.host_link_gbps` (GB/s per direction, both
    directions at once: the larger one); None where the hardware has no figure."""
    gbps = cfg.hardware.host_link_gbps
    if gbps is None:
        return None
    traffic = host_traffic(cfg) if traffic is None else traffic
    return max(traffic["in"], traffic["out"]) / (gbps * 1e9)


def offload_estimate(cfg: Config) -> OffloadCost:
    """The memory plan of a resolved config's offload layout, as marin.config.derive resolves
    optim.offload / model.offload_carry `auto` with it (passed down by marin.launch.checks.load)."""
    traffic = host_traffic(cfg)
    return OffloadCost(device_peak(cfg), memory_per_device(cfg)["host"], traffic["in"] + traffic["out"])
