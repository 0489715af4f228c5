"""Mochi attention (spec §2): grouped-query attention with local (sliding-window) and global layers.

One module serves both kinds, because every layer runs in the same `nn.scan`: `is_global` is a
traced boolean, and the differences are selected arithmetically, never by Python branches.

    local layer                          global layer
    keys t-window+1 .. t                 keys 0 .. t (full causal)
    RoPE on the first rope_fraction      no position encoding (NoPE), unless rope_on_global
      of each head's dims
    all kv_heads_local stored KV heads   only the first kv_heads_global of them

Both: documents never see each other and nothing attends to padding (segment 0); q and k are
RMS-normalised per head without a gain, queries × qk_mult, then the usual 1/√h softmax scale;
exclusive self-attention (XSA) removes from each head's output its component along the
position's own value vector; a per-head output gate 2·sigmoid(x·W_gate) starts at 1.

The masked softmax itself runs in the kernel `attention.impl` names (`attend`): `reference` forms
the whole [B, H, T, T] score matrix (tests); `blockwise` (`blockwise_attention.py`) never does
beyond one block (a shorter sequence is that one tile), and local layers visit only the key
blocks inside their window; `cudnn` is cuDNN's fused kernel (GPU).
"""
from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from marin.config import derive
from marin.config.registry import ATTENTION
from marin.config.schema import Config
from marin.model import blockwise_attention as blockwise
from marin.model.conv import causal_conv, identity_kernel_init
from marin.model.norms import matmul, matrix_init, rms_normalize

XSA_EPS = 1e-6  # keeps the projection finite where a value vector is zero


def kv_head_index(num_heads: int, kv_local: int, kv_global: int, is_global: jax.Array) -> jax.Array:
    """[H] stored KV head read by each query head: query head q reads q // (H / kv) with
    kv = kv_global on global layers (so only the first kv_global heads are used), kv_local else."""
    heads = jnp.arange(num_heads)
    local = heads // (num_heads // kv_local)
    global_ = heads // (num_heads // kv_global)
    return jnp.where(is_global, global_, local)


def attention_mask(segment_ids: jax.Array, is_global: jax.Array, window: int) -> jax.Array:
    """[B, T, T] boolean, True where query t may read key s.

    Causal, same document, key not padding, and on local layers t - s < window. Every position
    may also read itself, so a padding query's row is never empty (its output is never used).
    """
    positions = jnp.arange(segment_ids.shape[1])
    distance = positions[:, None] - positions[None, :]
    causal = distance >= 0
    in_window = jnp.logical_or(is_global, distance < window)
    same_doc = segment_ids[:, :, None] == segment_ids[:, None, :]
    real_key = (segment_ids != 0)[:, None, :]
    allowed = causal & in_window & same_doc & real_key
    return allowed | (distance == 0)


ROPE_PAIRINGS = ("halves", "interleaved")


def apply_rope(x: jax.Array, positions: jax.Array, rotary_dims: int, theta: float,
               pairing: str = "halves") -> jax.Array:
    """Rotate the first `rotary_dims` dims of each head of x [B, T, H, h]; the remaining dims pass
    through unchanged. Pair i (frequency theta^(-i/half)) is, by `pairing` (`attention.rope_pairing`):

    halves       dims (i, i + rotary_dims/2)  (rotate-half)
    interleaved  dims (2i, 2i + 1)            (production's fused kernel; its checkpoints' layout)

    The two are the same rotation up to a permutation of the rotated dims (`rope_permutation`),
    so q·k, hence attention, agrees once q and k (their projections' columns) are permuted."""
    if pairing not in ROPE_PAIRINGS:
        raise ValueError(f"attention.rope_pairing: {pairing!r} is not one of {', '.join(ROPE_PAIRINGS)}")
    if rotary_dims == 0:
        return x
    half = rotary_dims // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq          # [T, half]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]  # broadcast over heads
    rest = x[..., rotary_dims:]
    if pairing == "halves":
        x1, x2 = x[..., :half], x[..., half:rotary_dims]
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    else:
        x1, x2 = x[..., 0:rotary_dims:2], x[..., 1:rotary_dims:2]
        rotated = jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).reshape(*x.shape[:-1], rotary_dims)
    return jnp.concatenate([rotated, rest], axis=-1).astype(x.dtype)


def rope_permutation(head_dim: int, rotary_dims: int):
    """Index list p with apply_rope(x, ..., "interleaved")[..., p] == apply_rope(x[..., p], ..., "halves"):
    the halves layout's dim j is the interleaved layout's dim p[j] (even dims first, then odd; the
    unrotated tail stays). Converts a checkpoint's q/k projection columns, per head, between the two."""
    return [*range(0, rotary_dims, 2), *range(1, rotary_dims, 2), *range(rotary_dims, head_dim)]


def exclude_self_value(out: jax.Array, v_self: jax.Array, dtype=jnp.float32) -> jax.Array:
    """XSA: out − (out·v / v·v) v per head, with v the position's own value vector [B, T, H, h],
    computed and returned in `dtype` (`attention.xsa_dtype`; production: bf16)."""
    out, v_self = out.astype(dtype), v_self.astype(dtype)
    coeff = jnp.sum(out * v_self, axis=-1, keepdims=True)
    coeff = coeff / (jnp.sum(jnp.square(v_self), axis=-1, keepdims=True) + XSA_EPS)
    return out - coeff * v_self


def attention_impl(cfg: Config) -> str:
    """The kernel to run: `attention.impl`, with ``auto`` resolved by `derive.attention_impl`
    (a config built in code may skip `derive.resolve`)."""
    return derive.attention_impl(cfg)


def attend(impl: str, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
           is_global: jax.Array, window: int) -> jax.Array:
    """Masked softmax attention, [B, T, H, h] float32, of q, k, v [B, T, H, h] (K/V one per query
    head) by the kernel registered as `impl`; every kernel applies `attention_mask`'s rule and the
    1/√h scale."""
    return ATTENTION.get(impl)(q, k, v, segment_ids, is_global, window)


kernel = ATTENTION.register   # `@kernel("name")`: an attention.impl


@kernel("blockwise")
def blockwise_kernel(q, k, v, segment_ids, is_global, window) -> jax.Array:
    """The blockwise kernel; on one block the [T, T] scores are that tile, and plain autodiff is faster."""
    if q.shape[1] > blockwise.BLOCK:
        return blockwise.blockwise_attention(q, k, v, segment_ids, is_global, window, 1.0 / math.sqrt(q.shape[-1]))
    return reference_attention(q, k, v, segment_ids, is_global, window)


@kernel("reference")
def reference_attention(q, k, v, segment_ids, is_global, window) -> jax.Array:
    """The plain formula on the whole [B, H, T, T] score matrix (tests, short sequences)."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    mask = attention_mask(segment_ids, is_global, window)[:, None]  # broadcast over heads
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)


@kernel("cudnn")
def cudnn_attention(q, k, v, segment_ids, is_global, window, implementation="cudnn") -> jax.Array:
    """cuDNN's fused flash attention through `jax.nn.dot_product_attention` (16-bit dtypes, GPU).

    What it can express: causal, the sliding window (local_window_size=(window − 1, 0), i.e.
    t − s < window) and padding at the end of a row (query/key lengths). What it cannot: several
    packed documents in one row, so a batch holding any such row runs `blockwise_attention`
    instead (chosen at run time; both are compiled). `implementation="xla"` runs the same calls
    on any backend (tests).
    """
    lengths = jnp.sum(segment_ids != 0, axis=1).astype(jnp.int32)

    def fused(local_window):
        return jax.nn.dot_product_attention(
            q, k, v, is_causal=True, query_seq_lengths=lengths, key_value_seq_lengths=lengths,
            local_window_size=local_window, implementation=implementation).astype(jnp.float32)

    def packed_documents():
        return attend("blockwise", q, k, v, segment_ids, is_global, window)

    # One document (ids ≤ 1) then padding (non-increasing ids) in every row: cuDNN's masks suffice.
    one_document = jnp.all(segment_ids <= 1) & jnp.all(segment_ids[:, 1:] <= segment_ids[:, :-1])
    branch = jnp.where(one_document, 1 + jnp.asarray(is_global, jnp.int32), 0)
    return jax.lax.switch(branch, [packed_documents, lambda: fused((window - 1, 0)), lambda: fused(None)])


class Attention(nn.Module):
    """Params: wq [d, H·h], wk/wv [d, KV·h] (KV = kv_heads_local), wo [H·h, d],
    gate [d, H] (zero init; if output_gate), conv_k [K, KV·h] (identity init; if conv_k and K > 0)."""
    cfg: Config
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, is_global: jax.Array) -> jax.Array:
        a, m = self.cfg.attention, self.cfg.model
        batch, seq, d = x.shape
        heads, kv, h = a.num_heads, a.kv_heads_local, a.head_dim
        init = matrix_init(m.init_std)
        wq = self.param("wq", init, (d, heads * h), jnp.float32)
        wk = self.param("wk", init, (d, kv * h), jnp.float32)
        wv = self.param("wv", init, (d, kv * h), jnp.float32)
        wo = self.param("wo", init, (heads * h, d), jnp.float32)

        q = matmul(x, wq, self.dtype).reshape(batch, seq, heads, h)
        k = matmul(x, wk, self.dtype)
        if a.conv_k and m.conv_kernel > 0:
            conv_k = self.param("conv_k", identity_kernel_init, (m.conv_kernel, kv * h), jnp.float32)
            k = causal_conv(k, conv_k, segment_ids)
        k = k.reshape(batch, seq, kv, h)
        v = matmul(x, wv, self.dtype).reshape(batch, seq, kv, h)

        # Expand the stored KV heads to one per query head (GQA), per the layer's kind.
        kv_index = kv_head_index(heads, kv, a.kv_heads_global, is_global)
        k = jnp.take(k, kv_index, axis=2)
        v = jnp.take(v, kv_index, axis=2)

        if a.qk_norm:
            q, k = rms_normalize(q, a.qk_norm_eps), rms_normalize(k, a.qk_norm_eps)
        q = q * a.qk_mult
        use_rope = jnp.logical_or(a.rope_on_global, jnp.logical_not(is_global))
        positions = jnp.arange(seq)
        rotary_dims = int(h * a.rope_fraction)
        rope = lambda t: apply_rope(t, positions, rotary_dims, a.rope_theta, a.rope_pairing)
        q = jnp.where(use_rope, rope(q), q)
        k = jnp.where(use_rope, rope(k), k)

        q, k, v = (t.astype(self.dtype) for t in (q, k, v))
        out = attend(attention_impl(self.cfg), q, k, v, segment_ids, is_global, a.window)

        if a.xsa:
            out = exclude_self_value(out, v, jnp.dtype(a.xsa_dtype))
        if a.output_gate:
            w_gate = self.param("gate", nn.initializers.zeros, (d, heads), jnp.float32)
            gate = 2.0 * jax.nn.sigmoid(matmul(x, w_gate, self.dtype, jnp.float32))
            out = out * gate[..., None]
        return matmul(out.reshape(batch, seq, heads * h), wo, self.dtype)
