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

The masked softmax itself runs in the kernel `attention.impl` names (`attend`), which receives the
stored KV heads unexpanded (query head q reads KV head q // (H / kv), kv per the layer's kind):
`reference` forms the whole [B, H, T, T] score matrix (tests); `blockwise` (`blockwise_attention.py`)
never does beyond one block (a shorter sequence is that one tile), and local layers visit only the
key blocks inside their window; both expand K/V to one head per query head first. `cudnn`
(`kernels/packed_attention.py`, GPU, bf16) is cuDNN's fused flash attention over packed rows: each
row's documents passed as segment offsets and lengths, grouped KV heads read inside the kernel; a
batch with a row of more than `attention.cudnn_max_documents` documents runs `blockwise` instead
(chosen at run time, both compiled; logged once per process).
"""
from __future__ import annotations

import logging
import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from marin.config import derive
from marin.config.registry import ATTENTION
from marin.config.schema import AttentionConfig, Config
from marin.model import blockwise_attention as blockwise
from marin.model.conv import causal_conv, identity_kernel_init
from marin.model.kernels import packed_attention as packed
from marin.model.norms import matmul, matrix_init, rms_normalize

XSA_EPS = 1e-6  # keeps the projection finite where a value vector is zero

log = logging.getLogger(__name__)


def kv_head_index(num_heads: int, kv_local: int, kv_global: int, is_global: jax.Array) -> jax.Array:
    """[H] stored KV head read by each query head: query head q reads q // (H / kv) with
    kv = kv_global on global layers (so only the first kv_global heads are used), kv_local else."""
    heads = jnp.arange(num_heads)
    local = heads // (num_heads // kv_local)
    global_ = heads // (num_heads // kv_global)
    return jnp.where(is_global, global_, local)


def expand_kv_heads(x: jax.Array, num_heads: int, kv_global: int | None, is_global: jax.Array) -> jax.Array:
    """Stored KV heads x [B, T, KV, h] → one per query head [B, T, H, h] (`kv_head_index`;
    kv_global None: global layers read all KV heads too). Nothing to do when KV = H = kv_global."""
    kv = x.shape[2]
    kv_global = kv if kv_global is None else kv_global
    if kv == num_heads == kv_global:
        return x
    return jnp.take(x, kv_head_index(num_heads, kv, kv_global, is_global), axis=2)


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
           is_global: jax.Array, window: int, kv_global: int | None = None, **options) -> jax.Array:
    """Masked softmax attention, [B, T, H, h] float32, of q [B, T, H, h] over the stored KV heads
    k, v [B, T, KV, h] (global layers read only the first kv_global; None: all) by the kernel
    registered as `impl`; every kernel applies `attention_mask`'s rule, the 1/√h scale and the
    `kv_head_index` head mapping. `options`: the kernel's own settings (`kernel_options`)."""
    return ATTENTION.get(impl)(q, k, v, segment_ids, is_global, window, kv_global, **options)


def kernel_options(cfg: Config) -> dict:
    """The chosen kernel's own settings from the config (cudnn: max_documents)."""
    if attention_impl(cfg) == "cudnn":
        return {"max_documents": cfg.attention.cudnn_max_documents}
    return {}


kernel = ATTENTION.register   # `@kernel("name")`: an attention.impl


@kernel("blockwise")
def blockwise_kernel(q, k, v, segment_ids, is_global, window, kv_global=None) -> jax.Array:
    """The blockwise kernel; on one block the [T, T] scores are that tile, and plain autodiff is faster."""
    if q.shape[1] > blockwise.BLOCK:
        k, v = (expand_kv_heads(t, q.shape[2], kv_global, is_global) for t in (k, v))
        return blockwise.blockwise_attention(q, k, v, segment_ids, is_global, window, 1.0 / math.sqrt(q.shape[-1]))
    return reference_attention(q, k, v, segment_ids, is_global, window, kv_global)


@kernel("reference")
def reference_attention(q, k, v, segment_ids, is_global, window, kv_global=None) -> jax.Array:
    """The plain formula on the whole [B, H, T, T] score matrix (tests, short sequences)."""
    k, v = (expand_kv_heads(t, q.shape[2], kv_global, is_global) for t in (k, v))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / math.sqrt(q.shape[-1])
    mask = attention_mask(segment_ids, is_global, window)[:, None]  # broadcast over heads
    probs = jax.nn.softmax(jnp.where(mask, scores, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)


DEFAULT_MAX_DOCUMENTS = AttentionConfig.cudnn_max_documents   # the config's default, for calls outside one
_fallback_logged = False


def _log_fallback(documents, max_documents: int) -> None:
    """Host side of the fallback branch: one log line per process, however many layers and steps."""
    global _fallback_logged
    if not _fallback_logged:
        _fallback_logged = True
        log.warning("attention: a row holds %d documents, more than attention.cudnn_max_documents=%d: such "
                    "batches run the blockwise kernel instead of cuDNN (logged once)", int(documents), max_documents)


def report_fallback(segment_ids: jax.Array, cfg: Config) -> None:
    """One log line (per process) when the batch has a row of more documents than the cudnn kernel
    takes, so its layers run blockwise. Called once per forward, outside the layer scan: a host
    callback is an effect, and an effect in a scanned body makes Flax (≥ 0.12.10) refuse the scan
    ("broadcasted variable has a data dependency on the scan body"). The callback is traced in the
    fallback branch only, so it runs when that branch does."""
    if attention_impl(cfg) != "cudnn":
        return
    max_documents = cfg.attention.cudnn_max_documents
    documents = jnp.max(packed.segment_layout(segment_ids, max_documents).documents)
    jax.lax.cond(documents > max_documents,
                 lambda: jax.debug.callback(_log_fallback, documents, max_documents), lambda: None)


@kernel("cudnn")
def cudnn_attention(q, k, v, segment_ids, is_global, window, kv_global=None,
                    max_documents: int = DEFAULT_MAX_DOCUMENTS, implementation: str = "cudnn") -> jax.Array:
    """cuDNN's fused flash attention over packed rows (16-bit dtypes, GPU): each row's first
    `max_documents` documents as segment offsets and lengths (`packed_attention.segment_layout`),
    causal, the sliding window on local layers, the stored KV heads read by grouped query heads
    inside the kernel (global layers: the first kv_global). A batch holding a row of more documents
    runs `blockwise_attention` instead (chosen at run time: all branches are compiled); the model
    says so once (`report_fallback`). `implementation="xla"` runs the same layout in plain JAX on any backend (tests)."""
    layout = packed.segment_layout(segment_ids, max_documents)
    fused = {"cudnn": packed.cudnn_packed_attention, "xla": packed.xla_packed_attention}[implementation]
    kv_global = k.shape[2] if kv_global is None else kv_global

    def too_many_documents():   # said once per forward by `report_fallback`, outside the layer scan
        return blockwise_kernel(q, k, v, segment_ids, is_global, window, kv_global)

    def local():
        return fused(q, k, v, layout, window)

    def global_():   # the first kv_global stored heads; no window
        return fused(q, k[:, :, :kv_global], v[:, :, :kv_global], layout, None)

    branch = jnp.where(layout.fits, 1 + jnp.asarray(is_global, jnp.int32), 0)
    return jax.lax.switch(branch, [too_many_documents, local, global_])


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

        # QK-norm and RoPE act per head, so they run on the stored KV heads: the kernel maps query heads to them.
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
        out = attend(attention_impl(self.cfg), q, k, v, segment_ids, is_global, a.window, a.kv_heads_global,
                     **kernel_options(self.cfg))

        if a.xsa:
            v_self = expand_kv_heads(v, heads, a.kv_heads_global, is_global)   # each query head's own value
            out = exclude_self_value(out, v_self, jnp.dtype(a.xsa_dtype))
        if a.output_gate:
            w_gate = self.param("gate", nn.initializers.zeros, (d, heads), jnp.float32)
            gate = 2.0 * jax.nn.sigmoid(matmul(x, w_gate, self.dtype, jnp.float32))
            out = out * gate[..., None]
        return matmul(out.reshape(batch, seq, heads * h), wo, self.dtype)
