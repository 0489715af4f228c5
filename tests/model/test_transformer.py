"""The whole model: parameter tree, scan vs layer-by-layer, isolation of documents and of the
future end to end, remat, bf16, and a finite loss with finite gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.model import transformer
from marin.model.norms import GatedNorm, RMSNorm
from tests.helpers import make_config

TINY = ("model=tiny", "attention.window=4")


def _batch(cfg, batch=2, seq=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.model.vocab_size, (batch, seq + 1))
    segments = np.ones((batch, seq), np.int32)
    segments[0, 6:] = 2           # two documents in row 0
    segments[1, 12:] = 0          # padding at the end of row 1
    return {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
            "segment_ids": jnp.asarray(segments), "loss_mask": jnp.asarray(segments > 0, jnp.float32)}


def _bias(cfg):
    return jnp.zeros((cfg.model.num_layers, cfg.model.num_experts))


@pytest.fixture(scope="module")
def tiny():
    cfg = make_config(*TINY)
    return cfg, transformer.init_params(cfg, jax.random.key(0))


@pytest.fixture(scope="module")
def eval_logits(tiny):
    """inputs → logits of the tiny model in evaluation mode (dropless: tokens cannot interact
    through expert capacity), compiled once for the tests that share it."""
    cfg, params = tiny
    batch = _batch(cfg)
    return jax.jit(lambda inputs: transformer.forward(
        params, dict(batch, inputs=inputs), _bias(cfg), cfg, train=False)[0])


def _loss_and_grads(cfg, params, batch):
    fn = lambda p: transformer.loss_fn(p, batch, _bias(cfg), cfg, train=True)
    return jax.jit(jax.value_and_grad(fn, has_aux=True))(params)


def test_parameter_tree_names_shapes_and_init(tiny):
    cfg, params = tiny
    m, a = cfg.model, cfg.attention
    L, d, H, h, KV, K, r = m.num_layers, m.d_model, a.num_heads, a.head_dim, a.kv_heads_local, m.conv_kernel, m.gated_norm_rank
    layers = params["layers"]
    expected = {
        ("embed", "embedding"): (m.vocab_size, d), ("head", "kernel"): (d, m.vocab_size),
        ("embed_norm", "scale"): (d,), ("embed_gated_norm", "down"): (d, r), ("final_gated_norm", "up"): (r, d),
    }
    for path, shape in expected.items():
        assert params[path[0]][path[1]].shape == shape, path
    assert layers["attn"]["wq"].shape == (L, d, H * h)
    assert layers["attn"]["wk"].shape == layers["attn"]["wv"].shape == (L, d, KV * h)
    assert layers["attn"]["wo"].shape == (L, H * h, d)
    assert layers["attn"]["gate"].shape == (L, d, H)
    assert layers["attn"]["conv_k"].shape == (L, K, KV * h)
    assert layers["attn_out_conv"]["kernel"].shape == layers["moe_out_conv"]["kernel"].shape == (L, K, d)
    assert layers["attn_gated_norm"]["down"].shape == (L, d, r)
    assert layers["moe"]["router"].shape == (L, d, m.num_experts)
    # Initialisation: gates zero, convs identity, gains one, matrices truncated at ±3σ.
    assert not np.any(layers["attn"]["gate"])
    identity = np.zeros((L, K, d)); identity[:, -1] = 1
    np.testing.assert_array_equal(layers["attn_out_conv"]["kernel"], identity)
    np.testing.assert_array_equal(layers["moe_norm"]["scale"], np.ones((L, d)))
    wq = np.asarray(layers["attn"]["wq"])
    assert np.abs(wq).max() <= 3 * m.init_std and 0.7 * m.init_std < wq.std() < 1.1 * m.init_std
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(params))


def test_switches_remove_parameters():
    cfg = make_config("model=tiny", "model.gated_norm_rank=0", "model.conv_kernel=0", "attention.output_gate=false")
    shapes = transformer.param_shapes(cfg)
    assert "embed_gated_norm" not in shapes and "attn_gated_norm" not in shapes["layers"]
    assert "attn_out_conv" not in shapes["layers"] and "conv_k" not in shapes["layers"]["attn"]
    assert "gate" not in shapes["layers"]["attn"]


def test_loss_and_gradients_finite_and_metrics_add_up(tiny):
    cfg, params = tiny
    (loss, metrics), grads = _loss_and_grads(cfg, params, _batch(cfg))
    assert np.isfinite(loss) and 0 < metrics["ce"] < 2 * np.log(cfg.model.vocab_size)
    np.testing.assert_allclose(loss, metrics["ce"] + metrics["z_loss"] + metrics["aux_loss"], rtol=1e-6)
    assert metrics["router"]["load"].shape == (cfg.model.num_layers, cfg.model.num_experts)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert np.any(grads["layers"]["attn"]["gate"])  # the zero-initialised gate still learns


def test_scan_equals_layer_by_layer(tiny, eval_logits):
    cfg, params = tiny
    batch = _batch(cfg)
    logits = eval_logits(batch["inputs"])

    m, seg = cfg.model, batch["segment_ids"]

    def site(name, x):
        x = RMSNorm(m.norm_eps).apply({"params": params[f"{name}_norm"]}, x)
        return GatedNorm(m.gated_norm_rank, m.init_std).apply({"params": params[f"{name}_gated_norm"]}, x)

    @jax.jit
    def unrolled(inputs):
        x = site("embed", params["embed"]["embedding"][inputs])
        for i, is_global in enumerate([False, True]):  # tiny: layer 0 local, the last one global
            layer = jax.tree.map(lambda p: p[i], params["layers"])
            x, _ = transformer.Block(cfg, train=False).apply(
                {"params": layer}, x, (jnp.array(is_global), _bias(cfg)[i]), seg)
        return site("final", x) @ params["head"]["kernel"]
    reference = unrolled(batch["inputs"])
    np.testing.assert_allclose(logits, reference, atol=2e-5, rtol=2e-5)


def test_no_leak_across_documents_or_from_the_future(tiny, eval_logits):
    cfg, params = tiny
    inputs = _batch(cfg)["inputs"]
    bump = lambda t: inputs.at[0, t].set((inputs[0, t] + 1) % cfg.model.vocab_size)
    base = eval_logits(inputs)
    # Row 0: document 1 is positions 0..5, document 2 starts at 6. Change the first token of doc 2:
    # the earlier positions (the past, and another document) must not move; doc 2 must.
    changed = eval_logits(bump(6))
    np.testing.assert_allclose(changed[0, :6], base[0, :6], atol=1e-6)
    assert not np.allclose(changed[0, 6:], base[0, 6:])
    # Change the last token of doc 1: doc 2 (later positions) must not see it, nor other rows.
    changed = eval_logits(bump(5))
    np.testing.assert_allclose(changed[0, 6:], base[0, 6:], atol=1e-6)
    np.testing.assert_allclose(changed[1], base[1], atol=1e-6)


@pytest.mark.slow  # one more train-step compile (~15 s of CPU on a small box)
def test_remat_gives_the_same_loss_and_gradients(tiny):
    cfg, params = tiny
    batch = _batch(cfg)
    (loss, _), grads = _loss_and_grads(cfg, params, batch)
    (loss_remat, _), grads_remat = _loss_and_grads(make_config(*TINY, "model.remat=true"), params, batch)
    np.testing.assert_allclose(loss_remat, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads_remat, grads)


@pytest.mark.slow  # bf16 compiles slowest on CPU (~25 s)
def test_bfloat16_compute_keeps_float32_params_logits_and_gradients(tiny):
    cfg, params = tiny
    batch = _batch(cfg)
    bf16 = make_config(*TINY, "model.compute_dtype=bfloat16")
    logits = jax.eval_shape(lambda p: transformer.forward(p, batch, _bias(bf16), bf16, train=False)[0], params)
    assert logits.dtype == jnp.float32
    (loss, _), _ = _loss_and_grads(cfg, params, batch)
    (loss_bf16, _), grads_bf16 = _loss_and_grads(bf16, params, batch)
    assert abs(loss_bf16 - loss) < 0.02 * loss
    assert all(g.dtype == jnp.float32 and np.all(np.isfinite(g)) for g in jax.tree.leaves(grads_bf16))
