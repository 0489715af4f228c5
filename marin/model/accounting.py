"""Exact parameter and FLOP accounting from the config alone (spec §1a, §1b).

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
