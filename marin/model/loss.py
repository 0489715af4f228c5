"""The head and its cross-entropy, fused: logits = hidden · kernel never exist whole.

    Σ_rows mask · (logsumexp(logits) − logits[target]),   Σ_rows mask · logsumexp(logits)²

The output head is most of a small model's FLOPs (2·d·V per token at V = 128K), and a plain
autodiff of `dot(h_bf16, W_bf16) → fp32 logits` differentiates into two GEMMs that take the
fp32 cotangent: fp32 × fp32 over the vocabulary (TF32 on Hopper), plus an fp32 [rows, V] block
per chunk. Here a `jax.custom_vjp` tiles both ways:

- rows: the sequence is cut into chunks of at most `ROW_TOKENS` tokens per device (every batch
  row keeps its place in each chunk, so a batch split over devices stays split);
- vocabulary: at most `VOCAB_TILE` columns at a time, the logsumexp kept online (running max
  and sum). Both sizes and the arithmetic of the tiling: marin/model/loss_tiling.py (JAX-free:
  the memory plan reads it).

Forward keeps only each row's logsumexp and target logit. Backward recomputes a tile's logits,
forms dlogits = (softmax − onehot)·g_ce + 2·g_z·lse·softmax in fp32 (the second term is the
derivative of the z-loss's lse²), casts it to the compute dtype, and runs both GEMMs
(dh += dlogits · Wᵀ, dW_tile += hᵀ · dlogits) on compute-dtype operands with fp32 accumulation.
The largest fp32 block is one [row chunk, vocabulary tile]. With a float32 compute dtype every
step is float32; a tiny vocabulary and a short batch are one tile and one chunk.
"""
from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from marin.model.loss_tiling import row_chunks, vocab_tiling


@jax.named_scope("head_loss")   # a part of its own in profiles (benchmarks/gpu_profile.py)
def linear_cross_entropy(hidden, kernel, targets, mask, dtype, *, batch_shards: int = 1,
                         row_tokens: int | None = None, vocab_tile: int | None = None):
    """(Σ mask · cross-entropy, Σ mask · logsumexp²) of logits = hidden [B, T, d] · kernel [d, V],
    matmuls in `dtype` with float32 accumulation; targets int [B, T], mask float [B, T].
    Gradients flow to hidden and kernel (each in its own dtype). `row_tokens`, `vocab_tile`:
    the tiling (default loss_tiling.ROW_TOKENS, VOCAB_TILE, read at the call)."""
    B, T, _ = hidden.shape
    tiles, width = vocab_tiling(kernel.shape[1], vocab_tile)
    layout = Layout(jnp.dtype(dtype), row_chunks(B, T, batch_shards, row_tokens), tiles, width,
                    B, T, kernel.shape[1], jnp.dtype(hidden.dtype), jnp.dtype(kernel.dtype))
    return _fused(layout, hidden, kernel, targets, mask.astype(jnp.float32))


class Layout(NamedTuple):
    """The static shape of one call (hashable: the custom VJP's non-differentiable argument)."""
    dtype: Any          # compute dtype of the GEMMs
    chunks: int         # row chunks (the sequence axis cut into this many)
    tiles: int          # vocabulary tiles
    width: int          # columns per tile (tiles · width ≥ vocab)
    batch: int
    seq: int
    vocab: int
    hidden_dtype: Any
    kernel_dtype: Any

    @property
    def padded(self) -> bool:
        return self.tiles * self.width != self.vocab


# --- the custom VJP: layout helpers, forward, backward ---

def _to_chunks(x, chunks):
    """[B, T, ...] → [chunks, B·T/chunks, ...]: chunk c holds positions c·T/chunks … of every row."""
    B, T = x.shape[:2]
    x = jnp.moveaxis(x.reshape(B, chunks, T // chunks, *x.shape[2:]), 1, 0)
    return x.reshape(chunks, B * (T // chunks), *x.shape[3:])


def _from_chunks(x, B, T):
    chunks = x.shape[0]
    x = jnp.moveaxis(x.reshape(chunks, B, T // chunks, *x.shape[2:]), 0, 1)
    return x.reshape(B, T, *x.shape[3:])


def _to_tiles(kernel, lay: Layout):
    """[d, V] → [tiles, d, width] in the compute dtype, zero columns past V."""
    d = kernel.shape[0]
    kernel = jnp.pad(kernel.astype(lay.dtype), ((0, 0), (0, lay.tiles * lay.width - lay.vocab)))
    return jnp.moveaxis(kernel.reshape(d, lay.tiles, lay.width), 1, 0)


def _tile_logits(h, w, start, lay: Layout):
    """fp32 logits [rows, width] of one tile (compute-dtype operands); padding columns are −inf."""
    logits = jax.lax.dot_general(h, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    if lay.padded:
        logits = jnp.where(start + jnp.arange(lay.width) < lay.vocab, logits, -jnp.inf)
    return logits


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fused(lay: Layout, hidden, kernel, targets, mask):
    return _fwd(lay, hidden, kernel, targets, mask)[0]


def _fwd(lay: Layout, hidden, kernel, targets, mask):
    h_all, w_all = _to_chunks(hidden.astype(lay.dtype), lay.chunks), _to_tiles(kernel, lay)
    t_all, m_all = _to_chunks(targets, lay.chunks), _to_chunks(mask, lay.chunks)
    starts = jnp.arange(lay.tiles) * lay.width

    def chunk(_, xs):
        h, t = xs

        def tile(carry, ws):   # online logsumexp over the vocabulary tiles
            top, total, target = carry
            w, start = ws
            logits = _tile_logits(h, w, start, lay)
            new_top = jnp.maximum(top, jnp.max(logits, axis=1))
            total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(logits - new_top[:, None]), axis=1)
            local = t - start
            here = (local >= 0) & (local < lay.width)
            hit = jnp.take_along_axis(logits, jnp.clip(local, 0, lay.width - 1)[:, None], axis=1)[:, 0]
            return (new_top, total, target + jnp.where(here, hit, 0.0)), None

        rows = h.shape[0]
        init = (jnp.full((rows,), -jnp.inf), jnp.zeros((rows,)), jnp.zeros((rows,)))
        (top, total, target), _ = jax.lax.scan(tile, init, (w_all, starts))
        return None, (top + jnp.log(total), target)

    _, (lse, target) = jax.lax.scan(chunk, None, (h_all, t_all))
    out = (jnp.sum((lse - target) * m_all), jnp.sum(jnp.square(lse) * m_all))
    return out, (h_all, w_all, t_all, m_all, lse)


def _bwd(lay: Layout, res, g):
    h_all, w_all, t_all, m_all, lse_all = res
    g_ce, g_z = g
    starts = jnp.arange(lay.tiles) * lay.width

    def chunk(dw, xs):
        h, t, m, lse = xs
        w_onehot = g_ce * m                      # per row: weight of −onehot (cross-entropy)
        w_soft = w_onehot + 2.0 * g_z * m * lse  # per row: weight of softmax (cross-entropy + z-loss)

        def tile(carry, ws):
            dh, dw = carry
            w, start, i = ws
            p = jnp.exp(_tile_logits(h, w, start, lay) - lse[:, None])
            onehot = (start + jnp.arange(lay.width))[None, :] == t[:, None]
            # the cast that keeps both GEMMs below on compute-dtype operands
            dlogits = (p * w_soft[:, None] - jnp.where(onehot, w_onehot[:, None], 0.0)).astype(lay.dtype)
            dh = dh + jax.lax.dot_general(dlogits, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
            dw_tile = jax.lax.dot_general(h, dlogits, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
            return (dh, dw.at[i].add(dw_tile)), None

        dh0 = jnp.zeros(h.shape, jnp.float32)
        (dh, dw), _ = jax.lax.scan(tile, (dh0, dw), (w_all, starts, jnp.arange(lay.tiles)))
        return dw, dh

    dw0 = jnp.zeros((lay.tiles, w_all.shape[1], lay.width), jnp.float32)
    dw, dh = jax.lax.scan(chunk, dw0, (h_all, t_all, m_all, lse_all))
    dkernel = jnp.moveaxis(dw, 0, 1).reshape(w_all.shape[1], lay.tiles * lay.width)[:, :lay.vocab]
    dhidden = _from_chunks(dh, lay.batch, lay.seq)
    return dhidden.astype(lay.hidden_dtype), dkernel.astype(lay.kernel_dtype), None, None


_fused.defvjp(_fwd, _bwd)
