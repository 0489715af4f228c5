"""The LatentMoE block (spec §2 "Mixture of experts").

    logits = x·W_router (fp32)                     → route: k experts + combine weights per token
    routed = latent_up(combine(experts(dispatch(RMSNorm(latent_down(x))))))   (experts in width ℓ)
    shared = Σ_s SwiGLU_s(x)                        (full width, every token)
    y      = routed + shared

Matmuls run in `model.compute_dtype` on float32 master weights; the router and norm statistics
are float32; the layer's output (routed experts' up-projection plus shared experts) is summed in
`model.combine_dtype` (float32, or bfloat16 as production ran the hero); each token's top-k
weighted sum accumulates in float32 inside the transport. With `train=False` and
`model.eval_dropless` nothing is dropped (in bounded memory: see `dispatch.wave_dispatch`). When
the mesh's `expert` axis is larger than one the routed path runs expert-parallel
(`expert_parallel.py`); otherwise plain `jit` sharding applies.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from marin.model.dispatch import ExpertWeights, routed_experts
from marin.model.expert_parallel import expert_parallel_size, routed_experts_ep
from marin.model.norms import RMSNorm, matmul, matrix_init


class MoE(nn.Module):
    """`__call__(x [B,T,d], router_bias [E], *, train, mesh=None, valid=None) -> (y [B,T,d], stats)`;
    valid [B,T] (None: all): the tokens that route (padding takes no expert and no statistic);
    stats = {beta [E], load [E], dropped_frac [] (and by stage: dropped_frac/send, /recv), aux_loss []}
    (see `dispatch.routed_experts`)."""
    cfg: Any

    @nn.compact
    def __call__(self, x, router_bias, *, train: bool, mesh=None, valid=None):
        m = self.cfg.model
        d, num_experts = x.shape[-1], m.num_experts
        latent, width = int(m.latent_dim), int(m.expert_width)
        shared, shared_width = m.num_shared_experts, int(m.shared_width)
        dtype = jnp.dtype(m.compute_dtype)
        init = matrix_init(float(m.init_std))

        router = self.param("router", init, (d, num_experts), jnp.float32)
        latent_down = self.param("latent_down", init, (d, latent), jnp.float32)
        latent_up = self.param("latent_up", init, (latent, d), jnp.float32)
        experts = ExpertWeights(
            self.param("w_gate", init, (num_experts, latent, width), jnp.float32).astype(dtype),
            self.param("w_up", init, (num_experts, latent, width), jnp.float32).astype(dtype),
            self.param("w_down", init, (num_experts, width, latent), jnp.float32).astype(dtype),
        )

        tokens = x.reshape(-1, d)
        valid = None if valid is None else valid.reshape(-1)
        # Named scopes: the parts of a profile (benchmarks/gpu_profile.py); the latent projections
        # and shared experts count with the experts' matmuls, the rest of the layer is dispatch.
        with jax.named_scope("routing"):
            logits = matmul(tokens, router, jnp.dtype(m.router_dtype)).astype(jnp.float32)
        with jax.named_scope("expert_gemm"):
            h = matmul(tokens, latent_down, dtype)
        h = RMSNorm(m.norm_eps, name="latent_norm")(h).astype(dtype)
        if expert_parallel_size(mesh) > 1:
            routed, stats = routed_experts_ep(h, logits, router_bias, experts, self.cfg, train=train, mesh=mesh,
                                              valid=valid)
        else:
            routed, stats = routed_experts(h, logits, router_bias, experts, self.cfg, train=train, valid=valid)
        combine = jnp.dtype(m.combine_dtype)  # the layer's output sum: routed experts' up-projection + shared experts
        with jax.named_scope("expert_gemm"):
            y = matmul(routed, latent_up, dtype, combine)

        if shared:
            gate = self.param("shared_gate", init, (shared, d, shared_width), jnp.float32)
            up = self.param("shared_up", init, (shared, d, shared_width), jnp.float32)
            down = self.param("shared_down", init, (shared, shared_width, d), jnp.float32)
            xc = tokens.astype(dtype)
            with jax.named_scope("expert_gemm"):
                hs = jax.nn.silu(jnp.einsum("td,sdi->tsi", xc, gate.astype(dtype))) * \
                    jnp.einsum("td,sdi->tsi", xc, up.astype(dtype))
                y = y + jnp.einsum("tsi,sid->td", hs, down.astype(dtype), preferred_element_type=combine)
        return y.reshape(x.shape).astype(x.dtype), stats
