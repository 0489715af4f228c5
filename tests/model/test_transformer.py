"""The whole model: parameter tree, scan vs layer-by-layer, isolation of documents and of the
future end to end, remat, bf16, and a finite loss with finite gradients."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.model.norms import GatedNorm, RMSNorm
from tests.helpers import make_config


from marin.model import transformer


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
    cfg = make_config("model=tiny", "attention.window=4")
    return cfg, transformer.init_params(cfg, jax.random.key(0))


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
    batch = _batch(cfg)
    grad_fn = jax.jit(jax.value_and_grad(
        lambda p: transformer.loss_fn(p, batch, _bias(cfg), cfg, train=True), has_aux=True))
    (loss, metrics), grads = grad_fn(params)
    assert np.isfinite(loss) and 0 < metrics["ce"] < 2 * np.log(cfg.model.vocab_size)
    np.testing.assert_allclose(loss, metrics["ce"] + metrics["z_loss"] + metrics["aux_loss"], rtol=1e-6)
    assert metrics["router"]["load"].shape == (cfg.model.num_layers, cfg.model.num_experts)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert np.any(grads["layers"]["attn"]["gate"])  # the zero-initialised gate still learns


def test_scan_equals_layer_by_layer(tiny):
    cfg, params = tiny
    batch = _batch(cfg)
    logits, _ = transformer.forward(params, batch, _bias(cfg), cfg, train=False)

    m, seg = cfg.model, batch["segment_ids"]
    def site(name, x):
        x = RMSNorm(m.norm_eps).apply({"params": params[f"{name}_norm"]}, x)
        return GatedNorm(m.gated_norm_rank, m.init_std).apply({"params": params[f"{name}_gated_norm"]}, x)
    x = site("embed", params["embed"]["embedding"][batch["inputs"]])
    for i, is_global in enumerate([False, True]):  # tiny: layer 0 local, the last one global
        layer = jax.tree.map(lambda p: p[i], params["layers"])
        x, _ = transformer.Block(cfg, train=False).apply(
            {"params": layer}, x, (jnp.array(is_global), _bias(cfg)[i]), seg)
    reference = site("final", x) @ params["head"]["kernel"]
    np.testing.assert_allclose(logits, reference, atol=2e-5, rtol=2e-5)


def test_no_leak_across_documents_or_from_the_future(tiny):
    cfg, params = tiny
    batch = _batch(cfg)
    run = jax.jit(lambda inputs: transformer.forward(
        params, dict(batch, inputs=inputs), _bias(cfg), cfg, train=False)[0])
    base = run(batch["inputs"])
    # Row 0: document 1 is positions 0..5, document 2 starts at 6. Change the first token of doc 2.
    changed = run(batch["inputs"].at[0, 6].set((batch["inputs"][0, 6] + 1) % cfg.model.vocab_size))
    np.testing.assert_allclose(changed[0, :6], base[0, :6], atol=1e-6)   # earlier positions, other doc
    assert not np.allclose(changed[0, 6:], base[0, 6:])
    # Change the last token of doc 1: doc 2 (later positions) must not see it.
    changed = run(batch["inputs"].at[0, 5].set((batch["inputs"][0, 5] + 1) % cfg.model.vocab_size))
    np.testing.assert_allclose(changed[0, 6:], base[0, 6:], atol=1e-6)
    np.testing.assert_allclose(changed[1], base[1], atol=1e-6)           # other rows untouched


def test_remat_matches_and_bf16_runs(tiny):
    cfg, params = tiny
    batch = _batch(cfg)
    def loss_and_grads(cfg):
        fn = lambda p: transformer.loss_fn(p, batch, _bias(cfg), cfg, train=True)[0]
        return jax.jit(jax.value_and_grad(fn))(params)
    loss, grads = loss_and_grads(cfg)
    loss_remat, grads_remat = loss_and_grads(make_config("model=tiny", "attention.window=4", "model.remat=true"))
    np.testing.assert_allclose(loss_remat, loss, rtol=1e-6)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6), grads_remat, grads)

    bf16 = make_config("model=tiny", "attention.window=4", "model.compute_dtype=bfloat16")
    logits, _ = transformer.forward(params, batch, _bias(bf16), bf16, train=False)
    loss_bf16, grads_bf16 = loss_and_grads(bf16)
    assert logits.dtype == jnp.float32
    assert abs(loss_bf16 - loss) < 0.05 * loss
    assert all(g.dtype == jnp.float32 and np.all(np.isfinite(g)) for g in jax.tree.leaves(grads_bf16))
