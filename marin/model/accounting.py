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

from dataclasses import dataclass

from marin.config.schema import Config


@dataclass(frozen=True)
class Shapes:
    d: int
    L: int
    H: int
    h: int
    kv_local: int
    kv_global: int
    E: int
    k: int
    latent: int
    I: int
    S: int
    I_s: int
    V: int
    r: int
    conv: int
    output_gate: bool
    conv_k: bool
    global_layers: tuple[bool, ...]

    @classmethod
    def of(cls, cfg: Config) -> "Shapes":
        """Shapes of a resolved config (no ``auto`` leaves in the fields used here)."""
        from marin.config.derive import layer_is_global  # local: derive imports this module

        m, a = cfg.model, cfg.attention
        return cls(
            d=m.d_model, L=m.num_layers, H=int(a.num_heads), h=a.head_dim,
            kv_local=int(a.kv_heads_local), kv_global=int(a.kv_heads_global),
            E=m.num_experts, k=cfg.router.top_k, latent=int(m.latent_dim), I=int(m.expert_width),
            S=m.num_shared_experts, I_s=int(m.shared_width), V=m.vocab_size,
            r=m.gated_norm_rank, conv=m.conv_kernel, output_gate=a.output_gate, conv_k=a.conv_k,
            global_layers=tuple(layer_is_global(m.num_layers, a.global_every, a.last_layer_global)),
        )


def _layer_matrices(s: Shapes, experts: int) -> int:
    """One layer's weight matrices with `experts` routed experts counted."""
    return (
        2 * s.d * s.H * s.h            # Q and O
        + 2 * s.d * s.kv_local * s.h   # K and V (the stored, local count)
        + s.d * s.E                    # router
        + experts * 3 * s.latent * s.I  # routed SwiGLU experts inside the latent
        + 2 * s.d * s.latent           # latent down and up projections
        + s.S * 3 * s.d * s.I_s        # shared experts
    )


def _embed_and_head(s: Shapes) -> int:
    return 2 * s.V * s.d               # untied input embedding and output head


def total_params_of(s: Shapes) -> int:
    """Matrices only (the published 535.3B)."""
    return _embed_and_head(s) + s.L * _layer_matrices(s, s.E)


def active_params_of(s: Shapes) -> int:
    """Active per token, non-embedding: only k experts, no embedding or head (the 22.76B)."""
    return s.L * _layer_matrices(s, s.k)


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
    path: str      # as in the parameter tree (docs/CONTRACTS.md)
    size: int      # elements, all layers together
    group: str     # optimizer group under muonh: muonh | adamh | adam
    expert: bool   # has the E axis, so it is sharded over mesh.expert


def leaves_of(s: Shapes) -> list[Leaf]:
    """The parameter tree as a flat list; sums to `all_leaves_of(s)`. Groups follow spec §3:
    MuonH on every matrix but embedding, router, head gate and head; AdamH on the head."""
    d, L, r, K = s.d, s.L, s.r, s.conv
    kv = s.kv_local * s.h

    def gated_norm(prefix: str, times: int) -> list[Leaf]:
        if not r:
            return []
        return [Leaf(f"{prefix}/down", times * d * r, "muonh", False),
                Leaf(f"{prefix}/up", times * r * d, "muonh", False)]

    leaves = [
        Leaf("embed/embedding", s.V * d, "adam", False),
        Leaf("embed_norm/scale", d, "adam", False), *gated_norm("embed_gated_norm", 1),
        Leaf("layers/attn_norm/scale", L * d, "adam", False), *gated_norm("layers/attn_gated_norm", L),
        Leaf("layers/attn/wq", L * d * s.H * s.h, "muonh", False),
        Leaf("layers/attn/wk", L * d * kv, "muonh", False),
        Leaf("layers/attn/wv", L * d * kv, "muonh", False),
        Leaf("layers/attn/wo", L * s.H * s.h * d, "muonh", False),
    ]
    if s.output_gate:
        leaves.append(Leaf("layers/attn/gate", L * d * s.H, "adam", False))
    if s.conv_k and K:
        leaves.append(Leaf("layers/attn/conv_k", L * K * kv, "adam", False))
    if K:
        leaves.append(Leaf("layers/attn_out_conv/kernel", L * K * d, "adam", False))
    leaves += [
        Leaf("layers/moe_norm/scale", L * d, "adam", False), *gated_norm("layers/moe_gated_norm", L),
        Leaf("layers/moe/router", L * d * s.E, "adam", False),
        Leaf("layers/moe/latent_down", L * d * s.latent, "muonh", False),
        Leaf("layers/moe/latent_norm/scale", L * s.latent, "adam", False),
        Leaf("layers/moe/latent_up", L * s.latent * d, "muonh", False),
        *(Leaf(f"layers/moe/{w}", L * s.E * s.latent * s.I, "muonh", True)
          for w in ("w_gate", "w_up", "w_down")),
        *(Leaf(f"layers/moe/{w}", L * s.S * d * s.I_s, "muonh", False)
          for w in ("shared_gate", "shared_up", "shared_down")),
    ]
    if K:
        leaves.append(Leaf("layers/moe_out_conv/kernel", L * K * d, "adam", False))
    leaves += [
        Leaf("final_norm/scale", d, "adam", False), *gated_norm("final_gated_norm", 1),
        Leaf("head/kernel", d * s.V, "adamh", False),
    ]
    return [leaf for leaf in leaves if leaf.size]


# --- Memory per device (spec §6 layout), an estimate for the dry run ---

GIB = 2 ** 30
FP32 = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def optimizer_moments(leaf: Leaf, optimizer: str) -> int:
    """fp32 state tensors per parameter: AdamW keeps two moments everywhere; MuonH keeps one
    momentum on its matrices and two Adam moments on the adam / adamh groups."""
    if optimizer == "muonh" and leaf.group == "muonh":
        return 1
    return 2


def layer_activations_per_token(s: Shapes, capacity_factor: float) -> dict[str, float]:
    """Values one block keeps for its backward pass, per token (elements, compute dtype).
    Attention is assumed memory-efficient (no T×T scores kept: only a log-sum-exp per head)."""
    qkv = s.H * s.h + 2 * s.kv_local * s.h
    slots = capacity_factor * s.k                       # dispatched copies of each token
    return {
        "attn_norms": 3 * s.d + s.r,                    # RMSNorm out, GatedNorm bottleneck, gate, out
        "qkv": qkv + s.kv_local * s.h + s.H * s.h + s.kv_local * s.h,  # + conv(K), normed q and k
        "attention": 3 * s.H * s.h + 2 * s.H,           # output, XSA, gated output; lse and gate
        "attn_out": 2 * s.d,                            # W_o output, convolution
        "moe_norms": 3 * s.d + s.r,
        "router": 2 * s.E,                              # fp32 logits
        "latent": 3 * s.latent + s.d,                   # down, normed, combined; up
        "experts": slots * (2 * s.latent + 3 * s.I),    # dispatched in/out, gate, up, product
        "shared": s.S * 3 * s.I_s,
        "moe_out": 2 * s.d,                             # convolution, residual
    }


def memory_per_device(cfg: Config, remat: bool | None = None) -> dict[str, float]:
    """Bytes → GiB per device of a resolved config, by part, and their total.

    Layout as spec §6: expert weights are sharded over mesh.expert; every other weight and its
    optimizer state over the rack's devices (mesh.data × mesh.expert), replicated across
    mesh.replica_dcn. Parameters, gradients and optimizer state are fp32. Activations are per
    micro-batch (train.micro_batch sequences): with remat only each block's input is kept, plus
    one block recomputed at a time; without, every block's saved values. Logits are fp32, with
    their gradient. Tensor parallelism (mesh.model) is not counted.
    """
    s = Shapes.of(cfg)
    mesh = cfg.hardware.mesh
    remat = cfg.model.remat if remat is None else remat
    rack = int(mesh.data) * mesh.expert
    params = moments = 0.0
    for leaf in leaves_of(s):
        local = leaf.size / (mesh.expert if leaf.expert else rack)
        params += local
        moments += local * optimizer_moments(leaf, cfg.optim.name)
    tokens = int(cfg.train.micro_batch) * cfg.train.seq_len
    per_layer = sum(layer_activations_per_token(s, cfg.model.capacity_factor).values())
    saved = s.L * s.d + per_layer if remat else s.L * per_layer
    parts = {
        "params": params * FP32,
        "optimizer": moments * FP32,
        "gradients": params * FP32,
        "activations": tokens * saved * DTYPE_BYTES[cfg.model.compute_dtype],
        "logits": 2 * tokens * s.V * FP32,
    }
    gib = {name: value / GIB for name, value in parts.items()}
    gib["total"] = sum(gib.values())
    return gib
