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

import math
from dataclasses import dataclass

from marin.config.schema import Config
# The shapes and parameter counts live in counts.py, which marin.config.derive reads for the
# token budget: this module builds on derive, never the other way round (no import circle).
from marin.model.counts import (Shapes, _embed_and_head, _layer_matrices,  # noqa: F401 (re-exported)
                                active_params_of, total_params_of)


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


def all_leaves(cfg: Config) -> int:
    return all_leaves_of(Shapes.of(cfg))


def flops_per_token(cfg: Config, with_head: bool = True) -> int:
    """Training-step FLOPs are 3 × this × tokens."""
    return forward_flops_per_token(Shapes.of(cfg), cfg.train.seq_len, cfg.attention.window, with_head)


def train_flops(cfg: Config, with_head: bool = True, steps: int | None = None) -> int:
    """Spec §1b: 3 × forward FLOPs per token × the run's tokens (steps × seq_len × global batch);
    `steps` = those this run trains (a stage's own), default train.steps."""
    steps = cfg.train.steps if steps is None else steps
    return 3 * flops_per_token(cfg, with_head) * steps * cfg.train.seq_len * cfg.train.global_batch


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
# The train step's peak is the state it holds (parameters, optimizer state where it lives on the
# device, the batch) plus the largest of three phases' transients:
#   loss      every saved activation of the forward pass, and the logits with their gradient;
#   backward  the saved activations, the gradients accumulating, and one layer's working set
#             (recomputed intermediates and their cotangents, attention, dispatch buffers);
#   update    the gradients and the optimizer's temporaries (plus the optimizer state brought
#             from host memory, with optim.offload).
# Constants marked "calibrated" are fitted to XLA's memory analysis of the compiled step
# (`dry_run=compile`); see tests/launch/test_memory_plan.py for the comparison.

GIB = 2 ** 30
FP32 = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
FSDP_MIN_SIZE = 2 ** 14       # as marin/train/state.py: smaller leaves stay replicated
# Calibrated on ladder_d768 variants compiled on 64 forced host devices (reference attention,
# replicated non-expert state): full vocabulary 71.1 GiB compiled / 67.7 estimated; vocabulary
# 1,024 at T 4,096: 28.8 / 29.9; at T 512 (same tokens): 17.7 / 17.1; remat none: 264 / 267.
# Not yet calibrated: FSDP, offload, blockwise attention, micro-batch scans (4 micro-batches:
# 15.4 compiled / 19.6 estimated), the update phase (NS_COPIES).
LOGIT_COPIES = 2.0            # calibrated: fp32 logits and their gradient live together
ATTN_SCORE_COPIES = 2.4       # calibrated: reference attention's [B,H,T,T] fp32 arrays in one layer's backward
ATTN_SAVED_COPIES = 4.2       # calibrated: the same arrays each layer keeps without remat
LAYER_WORK_COPIES = 3.0       # calibrated: one layer's intermediates, their cotangents and recompute
NS_COPIES = 3.0               # calibrated: MuonH Newton–Schulz temporaries per matrix (fp32)
BLOCK = 512                   # query/key block of blockwise attention (its temporaries)
PHASES = ("loss", "backward", "update")


def optimizer_moments(leaf: Leaf, optimizer: str) -> int:
    """fp32 state tensors per parameter: AdamW keeps two moments everywhere; MuonH keeps one
    momentum on its matrices and two Adam moments on the adam / adamh groups."""
    if optimizer == "muonh" and leaf.group == "muonh":
        return 1
    return 2


def remat_mode(remat) -> str:
    """`model.remat` as none | full | dots | offload (true = full, false = none)."""
    if isinstance(remat, bool):
        return "full" if remat else "none"
    return str(remat)


def attention_impl(cfg: Config) -> str:
    """`attention.impl` with auto resolved: cuDNN flash attention on GPUs, blockwise elsewhere."""
    impl = getattr(cfg.attention, "impl", "auto")
    if impl == "auto":
        return "cudnn" if cfg.hardware.platform == "gpu" else "blockwise"
    return impl


def fsdp(cfg: Config) -> bool:
    """Non-expert state sharded over the rack (hardware.mesh.fsdp, where the schema has it)."""
    return bool(getattr(cfg.hardware.mesh, "fsdp", False))


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


def layer_activations_per_token(s: Shapes, slots: float, impl: str) -> dict[str, float]:
    """Values one block computes in its forward pass, per token (elements, compute dtype);
    `slots` = dispatch rows per token (E·C / T). Attention's own stats only for flash-style
    implementations (one log-sum-exp per head); reference scores are counted per layer apart."""
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
    """What remat=dots keeps per token and layer: outputs of matmuls without batch dims."""
    return (s.H * s.h + 2 * s.kv_local * s.h + s.d + s.H + 2 * s.E  # q, k, v, W_o, gate, router (fp32)
            + s.latent + s.d + 2 * s.r * 2)                          # latent down / up, GatedNorm bottlenecks


def attention_bytes(cfg: Config, batch: int, copies: float = ATTN_SCORE_COPIES) -> float:
    """One layer's attention working set beyond its per-token values: reference attention forms
    [B, H, T, T] fp32 scores (and a [B, T, T] mask); blockwise / cuDNN only block tiles."""
    s, T = Shapes.of(cfg), cfg.train.seq_len
    if attention_impl(cfg) == "reference":
        return batch * (copies * s.H * T * T * FP32 + T * T)
    tile = min(BLOCK, T)
    return batch * s.H * 4 * tile * tile * FP32


def _state_bytes(cfg: Config) -> tuple[float, float, float]:
    """(parameters, optimizer state, one fp32 Newton–Schulz matrix set) per device, bytes."""
    s = Shapes.of(cfg)
    params = moments = ns = 0.0
    for leaf in leaves_of(s):
        local = leaf.size / leaf_shards(leaf, cfg)
        params += local
        moments += local * optimizer_moments(leaf, cfg.optim.name)
        if cfg.optim.name == "muonh" and leaf.group == "muonh":
            ns = max(ns, local)  # leaves are orthogonalised one after another
    return params * FP32, moments * FP32, ns * FP32


def memory_per_device(cfg: Config, remat: bool | str | None = None) -> dict[str, float]:
    """GiB per device of a resolved config's train step, by part, with their total ("total");
    "host" is what optim.offload / model.offload_carry keep in pinned host memory instead (not
    in the total); "peak_phase" indexes PHASES. Tensor parallelism (mesh.model) is not counted."""
    s = Shapes.of(cfg)
    t, m = cfg.train, cfg.model
    mode = remat_mode(m.remat if remat is None else remat)
    act = DTYPE_BYTES[m.compute_dtype]
    from marin.config.derive import batch_shards  # local: derive imports this module

    per_device = t.global_batch // batch_shards(cfg.hardware)     # sequences per device and step
    micro = int(t.micro_batch)
    n_micro = max(1, per_device // micro)
    tokens = micro * t.seq_len                                    # one micro-batch on one device
    slots = m.num_experts * capacity(tokens, s.k, s.E, m.capacity_factor) / tokens

    params, moments, ns = _state_bytes(cfg)
    offload = bool(cfg.optim.offload)
    grads = params * (2 if n_micro > 1 else 1)                    # + the accumulator
    batch = 4 * 4 * per_device * t.seq_len                        # inputs, targets, segments, mask (int32)

    per_layer = sum(layer_activations_per_token(s, slots, attention_impl(cfg)).values()) * act
    carry = s.d * FP32                                            # the fp32 residual stream
    if mode == "none":
        saved = s.L * per_layer
    elif mode == "dots":
        saved = s.L * (carry + _dot_outputs_per_token(s) * act)
    else:
        saved = s.L * carry
    host = 0.0
    if m.offload_carry and mode != "none":
        host += tokens * s.L * carry
        saved -= (s.L - 2) * carry                                # two carries in flight
    activations = tokens * saved
    if mode == "none":  # every layer keeps its attention arrays too
        activations += s.L * attention_bytes(cfg, micro, ATTN_SAVED_COPIES)
    layer_work = tokens * LAYER_WORK_COPIES * per_layer + attention_bytes(cfg, micro)
    if offload:
        host += moments
    # Each phase's transients: (activations, gradients, working); the largest one is the peak.
    phases = {
        "loss": (activations, grads - params if n_micro > 1 else 0.0, tokens * s.V * FP32 * LOGIT_COPIES),
        "backward": (activations, grads, layer_work),
        "update": (0.0, grads, (moments if offload else 0.0) + NS_COPIES * ns),
    }
    peak = max(phases, key=lambda name: sum(phases[name]))
    parts = {"params": params, "optimizer": 0.0 if offload else moments, "batch": batch,
             **dict(zip(("activations", "gradients", "working"), phases[peak]))}
    gib = {name: value / GIB for name, value in parts.items()}
    gib["total"] = sum(gib.values())
    gib["host"] = host / GIB
    gib["peak_phase"] = list(phases).index(peak)  # 0 loss, 1 backward, 2 update (PHASES)
    return gib


def eval_memory_per_device(cfg: Config) -> float:
    """GiB per device of the eval step: the state it is passed (the optimizer state too unless
    offloaded), the per-device batch in one forward pass (no micro-batches, nothing saved for a
    backward pass): the larger of the logits and one layer's intermediates. Dropless evaluation
    sizes the dispatch buffers by `model.eval_dispatch` (where the schema has it): `waves`
    reuses the training capacity, `unbounded` (today's code without it) gives every expert
    room for all T tokens."""
    s = Shapes.of(cfg)
    t, m = cfg.train, cfg.model
    from marin.config.derive import batch_shards  # local: derive imports this module

    per_device = t.global_batch // batch_shards(cfg.hardware)
    tokens = per_device * t.seq_len
    unbounded = m.eval_dropless and getattr(m, "eval_dispatch", "unbounded") == "unbounded"
    cap = tokens if unbounded else capacity(tokens, s.k, s.E, m.capacity_factor)
    per_layer = sum(layer_activations_per_token(s, s.E * cap / tokens, attention_impl(cfg)).values())
    params, moments, _ = _state_bytes(cfg)
    layer = tokens * per_layer * DTYPE_BYTES[m.compute_dtype] + attention_bytes(cfg, per_device)
    logits = tokens * s.V * FP32
    state = params + (0.0 if cfg.optim.offload else moments)
    return (state + 16 * tokens + max(layer, logits)) / GIB
