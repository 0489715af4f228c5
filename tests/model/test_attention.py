"""Attention, its masks, RoPE, XSA and the gate; the document-masked causal conv; the norms.

"Position t reads position s" is checked on the real module through its Jacobian: the output at t
must have exactly zero derivative with respect to the input at every forbidden s."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.model import blockwise_attention
from marin.model.attention import Attention, apply_rope, attention_mask, exclude_self_value, kv_head_index
from marin.model.conv import CausalConv, causal_conv
from marin.model.norms import GatedNorm, RMSNorm
from tests.helpers import make_config

WINDOW = 3
SEGMENTS = np.array([[1] * 5 + [2] * 5 + [0] * 2])  # two documents, then padding
GQA = ("model=tiny", "attention.head_dim=16", "attention.kv_heads_local=2", "attention.kv_heads_global=1",
       f"attention.window={WINDOW}")


def _cfg(*overrides):
    return make_config(*GQA, *overrides)


def _expected_mask(segments, is_global, window):
    """The rule, written as plain loops."""
    batch, seq = segments.shape
    allowed = np.zeros((batch, seq, seq), bool)
    for b in range(batch):
        for t in range(seq):
            for s in range(seq):
                ok = s <= t and segments[b, s] == segments[b, t] and segments[b, s] != 0
                ok = ok and (is_global or t - s < window)
                allowed[b, t, s] = ok or s == t
    return allowed


@pytest.mark.parametrize("is_global", [False, True])
def test_mask_is_causal_windowed_and_per_document(is_global):
    segments = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 0, 0], [1, 1, 2, 2, 2, 2, 2, 2, 2, 3]])
    mask = attention_mask(jnp.asarray(segments), jnp.array(is_global), WINDOW)
    np.testing.assert_array_equal(mask, _expected_mask(segments, is_global, WINDOW))


def _init_attention(cfg, seq=SEGMENTS.shape[1]):
    module = Attention(cfg)
    x = jax.random.normal(jax.random.key(1), (1, seq, cfg.model.d_model))
    params = jax.jit(lambda key: module.init(key, x, jnp.asarray(SEGMENTS), jnp.array(False)))(jax.random.key(0))["params"]
    # A non-zero gate and a mixing conv (both start trivial), so every path is exercised.
    params = dict(params, gate=0.1 * jax.random.normal(jax.random.key(2), params["gate"].shape),
                  conv_k=jax.random.normal(jax.random.key(3), params["conv_k"].shape))
    return module, params, x


def _reads(module, params, x, is_global):
    """[T, T] bool: does the output at t depend on the input at s (any channel)?

    One gradient per output position t, of its channels weighted at random (a zero stays exactly
    zero; a dependence does not cancel). Not `jit(jacrev)`: XLA's CPU compilation of that batched
    transpose mixes rows after RMS-norm + RoPE on some head counts (jax 0.10.2), inventing reads."""
    def weighted(x, cotangent):
        out = module.apply({"params": params}, x, jnp.asarray(SEGMENTS), jnp.array(is_global))
        return jnp.sum(out * cotangent)
    grad = jax.jit(jax.grad(weighted))
    weights = jax.random.normal(jax.random.key(5), x.shape)
    rows = [grad(x, weights * (jnp.arange(x.shape[1]) == t)[None, :, None])[0] for t in range(x.shape[1])]
    return np.asarray(jnp.any(jnp.stack(rows) != 0, axis=-1))


@pytest.mark.parametrize("impl", ["reference", "blockwise"])
@pytest.mark.parametrize("is_global", [False, True])
def test_attention_reads_only_allowed_positions(monkeypatch, is_global, impl):
    monkeypatch.setattr(blockwise_attention, "BLOCK", 4)   # three blocks of the 12 positions
    cfg = _cfg(f"attention.impl={impl}")
    module, params, x = _init_attention(cfg)
    reads = _reads(module, params, x, is_global)
    # conv_k lets key s carry the inputs s-K+1..s of its own document (padding counts as one),
    # except where a query reads one key only: then its softmax weight is 1 whatever the key
    # (exactly so in the reference; the blockwise backward leaves a rounding residue there).
    allowed = _expected_mask(SEGMENTS, is_global, WINDOW)[0]
    seq, taps, seg = SEGMENTS.shape[1], cfg.model.conv_kernel, SEGMENTS[0]
    expected, residue = allowed.copy(), allowed.copy()
    for t in range(seq):
        for s_key in np.flatnonzero(allowed[t]):
            for s in range(max(0, s_key - taps + 1), s_key + 1):
                residue[t, s] |= seg[s] == seg[s_key]
                expected[t, s] |= seg[s] == seg[s_key] and allowed[t].sum() > 1
    if impl == "reference":
        np.testing.assert_array_equal(reads, expected)
    else:
        np.testing.assert_array_equal(reads | (residue & ~expected), residue)
        np.testing.assert_array_equal(reads & expected, expected)


def test_kv_head_mapping_global_layers_use_the_first_heads():
    np.testing.assert_array_equal(kv_head_index(4, 2, 1, jnp.array(False)), [0, 0, 1, 1])
    np.testing.assert_array_equal(kv_head_index(4, 2, 1, jnp.array(True)), [0, 0, 0, 0])
    cfg = _cfg()
    module, params, x = _init_attention(cfg)
    h = cfg.attention.head_dim

    def loss(params, is_global):
        return jnp.sum(module.apply({"params": params}, x, jnp.asarray(SEGMENTS), is_global) ** 2)
    grads = lambda is_global: jax.jit(jax.grad(loss))(params, jnp.array(is_global))
    for name in ("wk", "wv"):
        assert np.any(grads(False)[name][:, h:]), name      # local: both stored KV heads are read
        assert not np.any(grads(True)[name][:, h:]), name  # global: only the first one


def test_rope_rotates_only_the_configured_fraction():
    head_dim, rotary = 16, 8
    x = jax.random.normal(jax.random.key(0), (1, 6, 2, head_dim))
    positions = jnp.arange(6)
    y = apply_rope(x, positions, rotary, 10000.0)
    np.testing.assert_array_equal(y[..., rotary:], x[..., rotary:])      # the rest untouched
    np.testing.assert_allclose(y[:, 0], x[:, 0], atol=1e-6)              # position 0: no rotation
    assert np.all(np.any(np.asarray(y[:, 1:, :, :rotary] != x[:, 1:, :, :rotary]), axis=-1))
    np.testing.assert_allclose(jnp.linalg.norm(y, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5)
    # Relative: q·k depends on the distance only.
    q, k = x[0, 4, 0], x[0, 1, 1]
    score = lambda m, n: jnp.dot(apply_rope(q[None, None, None], jnp.array([m]), rotary, 1e4)[0, 0, 0],
                                 apply_rope(k[None, None, None], jnp.array([n]), rotary, 1e4)[0, 0, 0])
    np.testing.assert_allclose(score(5, 2), score(13, 10), rtol=1e-4)
    np.testing.assert_array_equal(apply_rope(x, positions, 0, 10000.0), x)


def test_rope_on_local_layers_only_unless_asked():
    module, params, x = _init_attention(_cfg())
    run = lambda cfg, is_global: Attention(cfg).apply({"params": params}, x, jnp.asarray(SEGMENTS), jnp.array(is_global))
    no_rope = _cfg("attention.rope_fraction=0.0")
    assert not np.allclose(run(_cfg(), False), run(no_rope, False))              # local: RoPE
    np.testing.assert_allclose(run(_cfg(), True), run(no_rope, True), atol=1e-6)  # global: NoPE
    assert not np.allclose(run(_cfg("attention.rope_on_global=true"), True), run(no_rope, True))


def test_xsa_removes_the_own_value_direction():
    out, v = jax.random.normal(jax.random.key(0), (2, 2, 5, 3, 8))
    np.testing.assert_allclose(jnp.sum(exclude_self_value(out, v) * v, axis=-1), 0.0, atol=1e-5)
    # The first token of a document reads only itself, so XSA leaves nothing of it.
    cfg = _cfg()
    module, params, x = _init_attention(cfg)
    y = module.apply({"params": params}, x, jnp.asarray(SEGMENTS), jnp.array(False))
    np.testing.assert_allclose(y[0, [0, 5]], 0.0, atol=1e-6)
    y = Attention(_cfg("attention.xsa=false")).apply({"params": params}, x, jnp.asarray(SEGMENTS), jnp.array(False))
    assert np.all(np.abs(y[0, [0, 5]]).max(-1) > 1e-3)


def test_output_gate_starts_at_one():
    module, params, x = _init_attention(_cfg())
    params = dict(params, gate=jnp.zeros_like(params["gate"]))           # its initial value
    ungated = {k: v for k, v in params.items() if k != "gate"}
    args = (x, jnp.asarray(SEGMENTS), jnp.array(False))
    np.testing.assert_allclose(module.apply({"params": params}, *args),
                               Attention(_cfg("attention.output_gate=false")).apply({"params": ungated}, *args),
                               atol=1e-6)


def test_conv_identity_init_causal_and_per_document():
    taps, seq = 3, 10
    segments = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2, 2, 0]])
    x = jax.random.normal(jax.random.key(0), (1, seq, 4))
    conv = CausalConv(taps)
    params = conv.init(jax.random.key(0), x, segments)["params"]
    np.testing.assert_array_equal(conv.apply({"params": params}, x, segments), x)   # identity at init
    kernel = jax.random.normal(jax.random.key(1), (taps, 4))
    jac = jax.jacrev(lambda x: causal_conv(x, kernel, segments)[0])(x)[:, :, 0]    # [T, C, T, C]
    reads = np.asarray(jnp.any(jac != 0, axis=(1, 3)))
    seg = np.asarray(segments[0])
    expected = np.array([[0 <= t - s < taps and seg[s] == seg[t] for s in range(seq)] for t in range(seq)])
    np.testing.assert_array_equal(reads, expected)
    assert CausalConv(0).init(jax.random.key(0), x, segments) == {}          # K = 0: off, no params


def test_norms_in_float32_and_gated_norm_off_at_rank_zero():
    x = (3.0 * jax.random.normal(jax.random.key(0), (2, 5, 16))).astype(jnp.bfloat16)
    y = RMSNorm(1e-5).apply({"params": {"scale": jnp.ones(16)}}, x)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(jnp.sqrt(jnp.mean(y ** 2, axis=-1)), 1.0, rtol=1e-3)
    assert GatedNorm(0, 0.1).init(jax.random.key(0), y) == {}
    np.testing.assert_array_equal(GatedNorm(0, 0.1).apply({}, y), y)
    params = GatedNorm(4, 0.1).init(jax.random.key(0), y)["params"]
    assert params["down"].shape == (16, 4) and params["up"].shape == (4, 16)
    gated = GatedNorm(4, 0.1).apply({"params": params}, y)
    assert np.all((0 < gated / y) & (gated / y < 1))  # a sigmoid gate in (0, 1) per channel
