"""Short causal depthwise convolution, masked at document boundaries (spec §2).

y[t, c] = Σ_{s=0}^{K-1} w[K-1-s, c] · x[t-s, c] · [segment(t-s) == segment(t)]

Tap K-1 multiplies the current position, so the identity initialisation is w[K-1] = 1 and the
rest 0. A position never mixes in values from an earlier document of the same packed row.
"""
from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def identity_kernel_init(key, shape, dtype=jnp.float32):
    """[K, C] kernel whose last tap (the current position) is one: the conv starts as identity."""
    del key
    return jnp.zeros(shape, dtype).at[-1].set(1.0)


def shift_right(x: jax.Array, s: int, fill=0) -> jax.Array:
    """x[:, t - s] along axis 1 (the time axis), `fill` where t - s < 0."""
    if s == 0:
        return x
    pad = [(0, 0)] * x.ndim
    pad[1] = (s, 0)
    return jnp.pad(x, pad, constant_values=fill)[:, : x.shape[1]]


def causal_conv(x: jax.Array, kernel: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """x [B, T, C] convolved causally with `kernel` [K, C], never across documents.

    `segment_ids` [B, T]. Out-of-row positions get segment -1, so they never match.
    K is a handful of taps: a Python loop of shifted, masked multiply-adds is clearest.
    """
    taps = kernel.shape[0]
    kernel = kernel.astype(x.dtype)
    y = jnp.zeros_like(x)
    for s in range(taps):
        same_doc = shift_right(segment_ids, s, fill=-1) == segment_ids
        y = y + jnp.where(same_doc[..., None], shift_right(x, s), 0) * kernel[taps - 1 - s]
    return y


class CausalConv(nn.Module):
    """Depthwise causal conv with parameter `kernel` [K, C]; the identity when K == 0."""
    taps: int

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        if self.taps == 0:
            return x
        kernel = self.param("kernel", identity_kernel_init, (self.taps, x.shape[-1]), jnp.float32)
        return causal_conv(x, kernel, segment_ids)
