"""The model's shapes and parameter counts from the config alone (spec §1a): config arithmetic
that `marin.config.derive` needs (the active count sets ``train.steps: auto``) and that
`marin.model.accounting` builds on (FLOPs, leaves, memory). Pure Python, no JAX.
"""
from __future__ import annotations

from dataclasses import dataclass

from marin.config.schema import Config


def layer_is_global(num_layers: int, global_every: int, last_layer_global: bool) -> list[bool]:
    """Layer i (0-based) is global when (i+1) % global_every == 0; the last one too if asked."""
    pattern = [global_every > 0 and (i + 1) % global_every == 0 for i in range(num_layers)]
    if last_layer_global and num_layers:
        pattern[-1] = True
    return pattern


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


def total_params(cfg: Config) -> int:
    return total_params_of(Shapes.of(cfg))


def active_params(cfg: Config) -> int:
    return active_params_of(Shapes.of(cfg))
