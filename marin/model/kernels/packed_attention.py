"""cuDNN flash attention over packed rows: per-row segment offsets and lengths (`attention.impl=cudnn`).

A loader row holds several documents back to back (segment ids 1, 2, ..., 0 = padding). cuDNN's
packed layout reads them as M segments per row, each given by its start offset and its length;
positions in no segment (padding) are read by nothing. With the causal mask and, on local layers,
`sliding_window_length = window` (key s visible from query t iff t − s < window), that is exactly
`attention.attention_mask`'s rule on every real position.

`segment_layout` builds the offsets and lengths from segment ids (pure JAX, any backend);
`layout_mask` is the [B, T, T] mask they imply (the tests compare it with `attention_mask`);
`cudnn_packed_attention` is the fused call (GPU, 16-bit); `xla_packed_attention` computes the same
thing in plain JAX from the same layout, so the whole `cudnn` kernel runs on CPU in tests.

JAX exposes segment offsets only through its private cuDNN module (`jax.nn.dot_product_attention`
takes per-row lengths, not per-segment ones); `_cudnn_api` is the one place that imports it.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp


class SegmentLayout(NamedTuple):
    """Where each row's documents lie, as cuDNN's packed layout takes them (M = max_documents).

    offsets    int32 [B, M + 1]  start of each document, then −1 (at least the last column)
    lengths    int32 [B, M]      its length, −1 past the row's documents
    documents  int32 [B]         documents the row really holds (may exceed M)
    """
    offsets: jax.Array
    lengths: jax.Array
    documents: jax.Array

    @property
    def fits(self) -> jax.Array:
        """True when no row holds more than M documents (the layout then covers every one)."""
        return jnp.all(self.documents <= self.lengths.shape[1])


def segment_layout(segment_ids: jax.Array, max_documents: int) -> SegmentLayout:
    """The first `max_documents` documents of each row of segment_ids [B, T]. A document is a
    contiguous run of one non-zero id, so padding may stand anywhere (the loader's is at the end)."""
    real = segment_ids != 0
    changes = segment_ids[:, 1:] != segment_ids[:, :-1]
    edge = jnp.ones_like(real[:, :1])
    first = real & jnp.concatenate([edge, changes], axis=1)   # a document starts here
    last = real & jnp.concatenate([changes, edge], axis=1)    # a document ends here
    seq = segment_ids.shape[1]

    def first_positions(flags):   # [B, M]: the first M flagged positions of each row, ascending; T past them
        return jax.vmap(lambda row: jnp.nonzero(row, size=max_documents, fill_value=seq)[0])(flags)

    starts, ends = first_positions(first), first_positions(last)
    present = starts < seq
    lengths = jnp.where(present, ends - starts + 1, -1)
    offsets = jnp.concatenate([jnp.where(present, starts, -1), jnp.full_like(starts[:, :1], -1)], axis=1)
    documents = jnp.sum(first, axis=1)
    return SegmentLayout(offsets.astype(jnp.int32), lengths.astype(jnp.int32), documents.astype(jnp.int32))


def layout_mask(layout: SegmentLayout, seq: int, window: int | None) -> jax.Array:
    """[B, T, T] True where query t may read key s under cuDNN's packed, causal mask (and sliding
    window, if given): both in one listed segment, 0 ≤ t − s (< window). Padding reads nothing."""
    document = _listed_document(layout, seq)
    distance = jnp.arange(seq)[:, None] - jnp.arange(seq)[None, :]
    allowed = (document[:, :, None] == document[:, None, :]) & (document[:, :, None] >= 0) & (distance >= 0)
    if window is not None:
        allowed &= distance < window
    return allowed


def _listed_document(layout: SegmentLayout, seq: int) -> jax.Array:
    """[B, T] the listed segment each position lies in; −1 for none (padding, or past the M-th)."""
    positions = jnp.arange(seq)
    starts = layout.offsets[:, :-1, None]
    inside = (positions >= starts) & (positions < starts + layout.lengths[:, :, None])  # never for −1, −1
    return jnp.where(jnp.any(inside, axis=1), jnp.argmax(inside, axis=1), -1)


def _cudnn_api():
    """JAX's private cuDNN attention (segment offsets) and its mask enum: the one import of it."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType, dot_product_attention
    except ImportError as err:   # a private module: a JAX upgrade may move it
        raise RuntimeError(f"attention.impl=cudnn: jax {jax.__version__} has no cuDNN attention with segment "
                           f"offsets where this code looks ({err}); use attention.impl=blockwise") from err
    return dot_product_attention, MaskType


def cudnn_packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: SegmentLayout,
                           window: int | None) -> jax.Array:
    """cuDNN's fused attention of q [B, T, H, h] over k, v [B, T, KV, h] (grouped heads: query head
    q reads KV head q // (H / KV), inside the kernel), float32 [B, T, H, h]. Positions outside
    every segment (padding) are set to 0: the packed layout defines nothing there, and a NaN left
    there would reach the next layer's values (0 · NaN in P·V)."""
    dot_product_attention, mask_type = _cudnn_api()
    out = dot_product_attention(
        q, k, v, q_seqlen=layout.lengths, kv_seqlen=layout.lengths, q_offsets=layout.offsets,
        kv_offsets=layout.offsets, scale=1.0 / math.sqrt(q.shape[-1]), mask_type=mask_type.CAUSAL,
        qkv_layout="BTNH", sliding_window_length=window)
    return _zero_outside_segments(out.astype(jnp.float32), layout, q.shape[1])


def xla_packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, layout: SegmentLayout,
                         window: int | None) -> jax.Array:
    """What `cudnn_packed_attention` computes, in plain JAX on the [B, H, T, T] scores (tests)."""
    heads, kv = q.shape[2], k.shape[2]
    k, v = (jnp.repeat(t, heads // kv, axis=2) for t in (k, v))    # query head q reads q // (H / KV)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    mask = layout_mask(layout, q.shape[1], window)[:, None]
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return _zero_outside_segments(out, layout, q.shape[1])


def _zero_outside_segments(out: jax.Array, layout: SegmentLayout, seq: int) -> jax.Array:
    return jnp.where((_listed_document(layout, seq) >= 0)[:, :, None, None], out, 0.0)
