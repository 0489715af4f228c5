"""Normalisation sites of the Mochi block (spec §2), and the two primitives every layer shares.

- `RMSNorm`: x / rms(x) · gain, computed in float32 whatever the compute dtype.
- `GatedNorm`: x ⊙ sigmoid(silu(x·W_down)·W_up), a rank-r bottleneck gate; r = 0 turns it off.
- `rms_normalize`: the same RMS division without a gain (used for per-head QK-norm).
- `matrix_init` / `matmul`: every weight matrix starts truncated normal (±3σ, σ = init_std) and
  is multiplied in the compute dtype while the stored (master) parameter stays float32.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def matrix_init(std: float):
    """Truncated normal on ±3σ (σ of the untruncated distribution, as the spec states it)."""
    return nn.initializers.truncated_normal(stddev=std, lower=-3.0, upper=3.0)


def matmul(x: jax.Array, w: jax.Array, dtype, out_dtype=None) -> jax.Array:
    """x @ w (last axis of x against the first of w), both cast to the compute dtype; the
    result is in `out_dtype` (default: the compute dtype)."""
    contract = (((x.ndim - 1,), (0,)), ((), ()))
    return jax.lax.dot_general(x.astype(dtype), w.astype(dtype), contract,
                               preferred_element_type=out_dtype or dtype)


def rms_normalize(x: jax.Array, eps: float) -> jax.Array:
    """x / sqrt(mean(x²) + eps) over the last axis, in float32; returns float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + eps)


class RMSNorm(nn.Module):
    """RMS normalisation with a learned per-channel gain (`scale`, initialised to one)."""
    eps: float

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
        return rms_normalize(x, self.eps) * scale


class GatedNorm(nn.Module):
    """x ⊙ sigmoid(silu(x·W_down)·W_up) with W_down [d, r], W_up [r, d]; the identity when r = 0.

    Both matrices start truncated normal like every other matrix (they are in the MuonH group,
    whose norm-preserving step would keep a zero matrix at zero), so the gate starts near 1/2.
    """
    rank: int
    init_std: float
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.rank == 0:
            return x
        d = x.shape[-1]
        down = self.param("down", matrix_init(self.init_std), (d, self.rank), jnp.float32)
        up = self.param("up", matrix_init(self.init_std), (self.rank, d), jnp.float32)
        hidden = nn.silu(matmul(x, down, self.dtype))
        gate = jax.nn.sigmoid(matmul(hidden, up, self.dtype).astype(jnp.float32))
        return x * gate
