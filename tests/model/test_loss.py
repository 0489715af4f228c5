"""The fused head + cross-entropy (marin/model/loss.py) against the plain one: full fp32 logits
and JAX's own autodiff. Tight in float32, within bf16 rounding in bfloat16; masks, the z-loss
and several row chunks and vocabulary tiles (the last one padded) included. Then the dtypes of
the lowered bf16 train step's vocabulary-sized matmuls and arrays."""
from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.model import loss, loss_tiling

B, T, D, V = 4, 24, 32, 1000
Z = 1e-2   # large z-loss weight, so that its gradient term is visible against the cross-entropy's


def _inputs(seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(k[0], (B, T, D), jnp.float32)
    kernel = jax.random.normal(k[1], (D, V), jnp.float32) * 0.3
    targets = jax.random.randint(k[2], (B, T), 0, V)
    mask = (jax.random.uniform(k[3], (B, T)) > 0.3).astype(jnp.float32)
    return hidden, kernel, targets, mask


def _reference(hidden, kernel, targets, mask, dtype):
    """The loss as JAX differentiates it from whole logits (what the model did before)."""
    logits = jnp.einsum("btd,dv->btv", hidden.astype(dtype), kernel.astype(dtype),
                        preferred_element_type=jnp.float32)
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jnp.sum((lse - target) * mask), jnp.sum(jnp.square(lse) * mask)


def _objective(fn, dtype):
    """ce + Z·lse² (both terms differentiated), and its two parts."""
    def total(hidden, kernel, targets, mask):
        ce, lse_sq = fn(hidden, kernel, targets, mask, dtype)
        return ce + Z * lse_sq, (ce, lse_sq)
    return jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True))


def _fused(**tiling):
    return lambda h, k, t, m, dtype: loss.linear_cross_entropy(h, k, t, m, dtype, **tiling)


def test_tiling_covers_the_vocabulary_and_the_rows():
    assert loss_tiling.vocab_tiling(512) == (1, 512)  # the tiny model: one exact tile
    assert loss_tiling.vocab_tiling(128256) == (8, 16128)  # Marin's tokenizer: 8 tiles, 768 columns padding
    tiles, width = loss_tiling.vocab_tiling(V, 256)
    assert tiles * width >= V > (tiles - 1) * width and width % loss_tiling.TILE_ALIGN == 0
    assert loss_tiling.row_chunks(2, 16) == 1  # a short batch: one chunk
    assert loss_tiling.row_chunks(32, 4096) == 16  # 131,072 tokens → chunks of 8,192
    assert loss_tiling.row_chunks(32, 4096, batch_shards=8) == 2  # per device: 4 rows · 2048 positions
    assert loss_tiling.row_chunks(4, 24, tokens=16) == 6  # a divisor of T: 4 rows · 4 positions ≤ 16


@pytest.mark.parametrize("dtype,rtol", [(jnp.float32, 2e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("tiling", [{}, {"row_tokens": 16, "vocab_tile": 256}])
def test_loss_and_gradients_equal_the_plain_ones(dtype, rtol, tiling):
    args = _inputs()
    if tiling:  # the tiling under test: several chunks and tiles, the last tile part padding
        assert loss_tiling.row_chunks(B, T, tokens=tiling["row_tokens"]) > 1
        assert loss_tiling.vocab_tiling(V, tiling["vocab_tile"]) == (4, 256)
    (total, parts), grads = _objective(_fused(**tiling), dtype)(*args)
    (ref_total, ref_parts), ref_grads = _objective(_reference, dtype)(*args)
    np.testing.assert_allclose(parts, ref_parts, rtol=1e-5)   # the forward is fp32 either way
    np.testing.assert_allclose(total, ref_total, rtol=1e-5)
    for g, ref in zip(grads, ref_grads):
        assert g.dtype == jnp.float32
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(g, ref, atol=rtol * scale, rtol=rtol)


def test_masked_positions_get_no_gradient_and_change_nothing():
    hidden, kernel, targets, mask = _inputs()
    fn = _objective(_fused(row_tokens=16, vocab_tile=256), jnp.float32)
    (_, _), (dh, _) = fn(hidden, kernel, targets, mask)
    assert np.all(np.asarray(dh)[np.asarray(mask) == 0] == 0)
    assert np.all(np.abs(np.asarray(dh)[np.asarray(mask) == 1]).sum(-1) > 0)
    # a masked position's hidden state and target change nothing
    other = jnp.where(mask[..., None] == 0, 100.0, hidden), jnp.where(mask == 0, 0, targets)
    (total, _), _ = fn(other[0], kernel, other[1], mask)
    (ref, _), _ = fn(hidden, kernel, targets, mask)
    np.testing.assert_allclose(total, ref, rtol=1e-6)


# --- the train step as lowered: which dots touch the vocabulary, in which dtypes ---

DOT = re.compile(r"stablehlo\.dot_general.*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)")
TYPE = re.compile(r"tensor<((?:\d+x)*)(\w+)>")


def _shape(tensor_type: str) -> tuple[tuple[int, ...], str]:
    dims, dtype = TYPE.fullmatch(tensor_type).groups()
    return tuple(int(n) for n in dims.split("x") if n), dtype


def test_the_bf16_train_step_has_no_float32_vocabulary_matmul_or_logits(monkeypatch):
    """Issue 39 item 4: with bf16 compute, every dot over the vocabulary (forward, recomputation,
    both backward GEMMs) takes bf16 operands, and no fp32 array over the vocabulary is larger
    than one [row chunk, vocabulary tile] or the head's own size. Before, the backward of
    `dot(h_bf16, W_bf16) → fp32 logits` ran both GEMMs on fp32 operands over [B, T, V]."""
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import init_state
    from marin.train.step import make_train_step
    from tests.helpers import make_config

    vocab, batch, seq = 500, 4, 32   # a vocabulary no other dimension of model=tiny has
    cfg = make_config("model=tiny", "model.compute_dtype=bfloat16", f"model.vocab_size={vocab}",
                      f"train.seq_len={seq}", f"train.global_batch={batch}")
    monkeypatch.setattr(loss_tiling, "ROW_TOKENS", 32)   # 4 chunks of 32 rows
    monkeypatch.setattr(loss_tiling, "VOCAB_TILE", 256)  # 2 tiles of 256 columns, 12 of them padding
    tiles, width = loss_tiling.vocab_tiling(vocab)
    rows = batch * seq // loss_tiling.row_chunks(batch, seq)
    assert (tiles, width, rows) == (2, 256, 32)

    tx = build_optimizer(cfg)
    state = jax.eval_shape(lambda: init_state(cfg, tx, jax.random.key(0)))
    data = {"inputs": np.zeros((batch, seq), np.int32), "targets": np.zeros((batch, seq), np.int32),
            "segment_ids": np.ones((batch, seq), np.int32), "loss_mask": np.ones((batch, seq), np.float32)}
    text = jax.jit(make_train_step(cfg, tx, make_mesh(cfg))).lower(state, data).as_text()

    vocab_dims = {vocab, width, tiles * width}
    over_vocab = lambda shape: bool(vocab_dims & set(shape))
    dots = [[_shape(t) for t in dot] for dot in DOT.findall(text)]
    vocab_dots = [dot for dot in dots if any(over_vocab(shape) for shape, _ in dot)]
    assert len(vocab_dots) >= 4     # logits (forward and again in the backward), dh, dW
    assert all(lhs[1] == rhs[1] == "bf16" for lhs, rhs, _ in vocab_dots), vocab_dots

    d = cfg.model.d_model
    largest = max(rows * width, d * tiles * width)   # a tile of logits; the head (its gradient)
    f32_over_vocab = [shape for shape, dtype in (_shape(m.group(0)) for m in TYPE.finditer(text))
                      if dtype == "f32" and over_vocab(shape)]
    assert f32_over_vocab and max(math.prod(s) for s in f32_over_vocab) <= largest
