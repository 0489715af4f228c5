"""Blockwise (flash-style) attention in plain JAX: never forms a [T, T] tensor, forward or backward.

The sequence is cut into blocks of `BLOCK` positions. Each query block runs an online softmax
(running max m, running sum l, running output o) over the key/value blocks it may read, and keeps
only its log-sum-exp. The backward pass (`jax.custom_vjp`) recomputes each block's probabilities
from that log-sum-exp (FlashAttention-2, §3.1.1), so memory is O(T · block) in both passes.

Which key blocks a query block visits is computed at run time, so one compiled body serves both
layer kinds inside the layer scan (`is_global` is traced):

    first key block   local layer: the one holding (first query − window + 1); global: 0;
                      both: no earlier than the document of the block's first query starts
    last key block    the diagonal block (causal)

so a local layer costs O(T · window) and a global layer at most O(T²/2), less for short documents.
Inside a visited block the exact mask is applied (`attention.attention_mask`'s rule):
causal, same document, key not padding (segment 0), within the window on local layers, and every
position may read itself.

Assumes what the loader produces: each document is one contiguous run of positions (its segment
id appears nowhere else in the row), padding anywhere.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 512          # positions per query / key block; a shorter sequence is one block
NEG = -1e30          # masked score: finite, so a block with nothing to read stays NaN-free


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                        is_global: jax.Array, window: int, scale: float, block: int | None = None) -> jax.Array:
    """softmax(q·kᵀ·scale + mask) · v for q, k, v [B, T, H, h] (K/V already one per query head),
    segment_ids [B, T]; returns [B, T, H, h] float32. T need not be a multiple of `block`
    (default BLOCK): the tail is padded with segment 0 (read by nothing) and cut off again."""
    seq = q.shape[1]
    block = min(block or BLOCK, seq)
    pad = -seq % block
    if pad:
        widen = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
        q, k, v, segment_ids = widen(q), widen(k), widen(v), widen(segment_ids)
    # Heads ahead of positions inside the kernel: every block product is then a plain batched matmul.
    q, k, v = (jnp.swapaxes(x, 1, 2) for x in (q, k, v))
    out = _attention(q, k, v, segment_ids, jnp.asarray(is_global), window, scale, block)
    return jnp.swapaxes(out, 1, 2)[:, :seq]


def _doc_starts(segment_ids: jax.Array) -> jax.Array:
    """[B, T]: the first position of each position's document; a padding position is its own
    document of one (it reads only itself). Non-decreasing along T."""
    seq = segment_ids.shape[1]
    pos = jnp.arange(seq)
    previous = jnp.pad(segment_ids[:, :-1], [(0, 0), (1, 0)], constant_values=-1)
    starts = (segment_ids != previous) | (segment_ids == 0)
    return lax.cummax(jnp.where(starts, pos, 0), axis=1)


def _key_blocks(i, doc_starts, is_global, window: int, block: int):
    """(first, last + 1) key block read by query block i. The block's first query reads the
    earliest key of all (window and document start are non-decreasing along T)."""
    first_query = i * block
    earliest = jnp.min(doc_starts[:, first_query])
    earliest = jnp.maximum(earliest, jnp.where(is_global, 0, first_query - window + 1))
    return jnp.maximum(earliest, 0) // block, i + 1


def _block_inputs(i, block, *arrays):
    """Positions i·block .. (i+1)·block − 1 of each array: [B, H, T, h] → [B, H, block, h],
    segment ids [B, T] → [B, block]."""
    return [lax.dynamic_slice_in_dim(x, i * block, block, axis=2 if x.ndim == 4 else 1) for x in arrays]


def _scores(q_i, k_j, seg_q, seg_k, i, j, is_global, window, scale, block):
    """Masked scores [B, H, bq, bk] float32 and the mask [B, 1, bq, bk]."""
    s = jnp.einsum("bhqd,bhkd->bhqk", q_i, k_j, preferred_element_type=jnp.float32) * scale
    distance = (i * block + jnp.arange(block))[:, None] - (j * block + jnp.arange(block))[None, :]
    allowed = (distance >= 0) & (is_global | (distance < window))
    allowed = allowed & (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_k != 0)[:, None, :]
    allowed = (allowed | (distance == 0))[:, None]
    return jnp.where(allowed, s, NEG), allowed


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _attention(q, k, v, segment_ids, is_global, window, scale, block):
    return _forward(q, k, v, segment_ids, is_global, window, scale, block)[0]


def _forward(q, k, v, segment_ids, is_global, window, scale, block):
    """(out [B, H, T, h] float32, lse [B, H, T] float32) of q, k, v [B, H, T, h]."""
    batch, heads, seq, h = q.shape
    doc_starts = _doc_starts(segment_ids)

    def query_block(i):
        q_i, seg_q = _block_inputs(i, block, q, segment_ids)

        def key_block(j, carry):
            o, m, l = carry
            k_j, v_j, seg_k = _block_inputs(j, block, k, v, segment_ids)
            s, allowed = _scores(q_i, k_j, seg_q, seg_k, i, j, is_global, window, scale, block)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.where(allowed, jnp.exp(s - m_new[..., None]), 0.0)
            correction = jnp.exp(m - m_new)
            o = o * correction[..., None] + jnp.einsum("bhqk,bhkd->bhqd", p.astype(v.dtype), v_j,
                                                       preferred_element_type=jnp.float32)
            return o, m_new, l * correction + jnp.sum(p, axis=-1)

        init = (jnp.zeros((batch, heads, block, h), jnp.float32),
                jnp.full((batch, heads, block), NEG, jnp.float32),
                jnp.zeros((batch, heads, block), jnp.float32))
        o, m, l = lax.fori_loop(*_key_blocks(i, doc_starts, is_global, window, block), key_block, init)
        return o / l[..., None], m + jnp.log(l)   # every row reads itself: l > 0

    out, lse = lax.map(query_block, jnp.arange(seq // block))   # [n, B, H, bq, h], [n, B, H, bq]
    out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, seq, h)
    lse = jnp.moveaxis(lse, 0, 2).reshape(batch, heads, seq)
    return out, lse


def _attention_fwd(q, k, v, segment_ids, is_global, window, scale, block):
    out, lse = _forward(q, k, v, segment_ids, is_global, window, scale, block)
    return out, (q, k, v, segment_ids, is_global, out, lse)


def _attention_bwd(window, scale, block, residuals, d_out):
    """One pass over query blocks; each recomputes its probabilities block by block, adds its
    dq locally and its dk, dv into full-length accumulators (O(T) each)."""
    q, k, v, segment_ids, is_global, out, lse = residuals
    seq = q.shape[2]
    doc_starts = _doc_starts(segment_ids)
    delta = jnp.sum(d_out * out, axis=-1)                      # rowsum(dO ∘ O) [B, H, T]
    mm = functools.partial(jnp.einsum, preferred_element_type=jnp.float32)

    def query_block(i, grads):
        dq, dk, dv = grads
        q_i, do_i, seg_q = _block_inputs(i, block, q, d_out.astype(q.dtype), segment_ids)
        lse_i, delta_i = (lax.dynamic_slice_in_dim(x, i * block, block, axis=2) for x in (lse, delta))

        def key_block(j, carry):
            dq_i, dk, dv = carry
            k_j, v_j, seg_k = _block_inputs(j, block, k, v, segment_ids)
            s, allowed = _scores(q_i, k_j, seg_q, seg_k, i, j, is_global, window, scale, block)
            p = jnp.where(allowed, jnp.exp(s - lse_i[..., None]), 0.0)
            ds = p * (mm("bhqd,bhkd->bhqk", do_i, v_j) - delta_i[..., None]) * scale
            dv_j = mm("bhqk,bhqd->bhkd", p.astype(v.dtype), do_i)
            dk_j = mm("bhqk,bhqd->bhkd", ds.astype(q.dtype), q_i)
            dq_i = dq_i + mm("bhqk,bhkd->bhqd", ds.astype(k.dtype), k_j)
            add = lambda acc, x: lax.dynamic_update_slice_in_dim(  # noqa: E731
                acc, lax.dynamic_slice_in_dim(acc, j * block, block, axis=2) + x, j * block, axis=2)
            return dq_i, add(dk, dk_j), add(dv, dv_j)

        dq_i = jnp.zeros(q_i.shape, jnp.float32)
        first, stop = _key_blocks(i, doc_starts, is_global, window, block)
        dq_i, dk, dv = lax.fori_loop(first, stop, key_block, (dq_i, dk, dv))
        return lax.dynamic_update_slice_in_dim(dq, dq_i, i * block, axis=2), dk, dv

    zeros = lambda x: jnp.zeros(x.shape, jnp.float32)  # noqa: E731
    dq, dk, dv = lax.fori_loop(0, seq // block, query_block, (zeros(q), zeros(k), zeros(v)))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
