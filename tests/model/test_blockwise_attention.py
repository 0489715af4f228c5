"""The attention kernels agree: blockwise (and the cuDNN path's masks) against the reference, on
outputs and gradients, in the layer and through the whole model; the blockwise kernel holds no
[T, T] buffer; `attention.impl` resolves and validates."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.config import derive
from marin.config.validate import ConfigError
from marin.launch.checks import load
from marin.model import blockwise_attention as bw
from marin.model import transformer
from marin.model.attention import Attention, cudnn_attention, reference_attention
from tests.helpers import compose_dict, make_config

TOL = dict(atol=1e-5, rtol=1e-5)
WINDOW = 5
BLOCK = 8        # small blocks, so short sequences span several (and T = 37 leaves a tail)


def _segments(batch, seq):
    """Row 0: three documents; row 1: one document, then padding; row 2 (if any): one document."""
    seg = np.ones((batch, seq), np.int32)
    seg[0, seq // 4:] = 2
    seg[0, seq // 2:] = 3
    seg[1, seq - seq // 5:] = 0
    return jnp.asarray(seg)


def _qkv(batch, seq, heads=3, h=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q, k, v = (jax.random.normal(key, (batch, seq, heads, h)) for key in keys[:3])
    return q, k, v, jax.random.normal(keys[3], (batch, seq, heads, h))


@pytest.mark.parametrize("seq,is_global", [(37, False), (64, True)])   # 37: a tail shorter than a block
def test_kernel_matches_reference_outputs_and_gradients(seq, is_global):
    q, k, v, cotangent = _qkv(2, seq)
    seg, flag, scale = _segments(2, seq), jnp.array(is_global), 1 / np.sqrt(q.shape[-1])
    kernels = {"reference": lambda q, k, v: reference_attention(q, k, v, seg, flag, WINDOW),
               "blockwise": lambda q, k, v: bw.blockwise_attention(q, k, v, seg, flag, WINDOW, scale, BLOCK)}
    results = {name: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(fn(*a) * cotangent), argnums=(0, 1, 2)))(q, k, v)
               for name, fn in kernels.items()}
    outs = {name: jax.jit(fn)(q, k, v) for name, fn in kernels.items()}
    np.testing.assert_allclose(outs["blockwise"], outs["reference"], **TOL)
    for ref, got in zip(results["reference"][1], results["blockwise"][1]):
        np.testing.assert_allclose(got, ref, **TOL)
    assert np.abs(results["reference"][1][1]).max() > 1e-2   # the gradients are not trivially zero


def _layer_cfg(impl):
    return make_config("model=tiny", "attention.head_dim=16", "attention.kv_heads_local=2",
                       "attention.kv_heads_global=1", f"attention.window={WINDOW}", f"attention.impl={impl}")


def test_layer_matches_reference_with_xsa_gate_gqa_and_rope(monkeypatch):
    """The whole attention layer (GQA, QK-norm, qk_mult, partial RoPE / NoPE, conv_k, XSA, gate) on
    local and global layers: outputs and gradients with respect to its input and every parameter."""
    monkeypatch.setattr(bw, "BLOCK", BLOCK)
    seq = 29
    x = jax.random.normal(jax.random.key(1), (2, seq, 64))
    seg = _segments(2, seq)
    params = jax.jit(lambda key: Attention(_layer_cfg("reference")).init(key, x, seg, jnp.array(False)))(jax.random.key(0))["params"]
    params = dict(params, gate=0.3 * jax.random.normal(jax.random.key(2), params["gate"].shape),
                  conv_k=jax.random.normal(jax.random.key(3), params["conv_k"].shape))
    cotangent = jax.random.normal(jax.random.key(4), x.shape)

    def compiled(impl):
        module = Attention(_layer_cfg(impl))
        loss = lambda p, x, flag: jnp.sum(module.apply({"params": p}, x, seg, flag) * cotangent)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    reference, blockwise = compiled("reference"), compiled("blockwise")
    for is_global in (False, True):
        (ref_loss, ref_grads), (loss, grads) = (fn(params, x, jnp.array(is_global)) for fn in (reference, blockwise))
        np.testing.assert_allclose(loss, ref_loss, **TOL)
        for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree_util.tree_leaves(grads)):
            np.testing.assert_allclose(got, ref, **TOL, err_msg=f"is_global={is_global} {jax.tree_util.keystr(path)}")


@pytest.mark.slow
def test_tiny_model_loss_and_gradients_match_reference(monkeypatch):
    monkeypatch.setattr(bw, "BLOCK", BLOCK)
    seq = 21
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (2, seq + 1))
    seg = _segments(2, seq)
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
             "segment_ids": seg, "loss_mask": (seg > 0).astype(jnp.float32)}

    def run(impl):
        cfg = make_config("model=tiny", "attention.window=4", f"attention.impl={impl}")
        params = transformer.init_params(cfg, jax.random.key(0))
        bias = jnp.zeros((cfg.model.num_layers, cfg.model.num_experts))
        fn = lambda p: transformer.loss_fn(p, batch, bias, cfg, train=True)[0]  # noqa: E731
        return jax.jit(jax.value_and_grad(fn))(params)
    (ref_loss, ref_grads), (loss, grads) = run("reference"), run("blockwise")
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    for (path, ref), got in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree_util.tree_leaves(grads)):
        np.testing.assert_allclose(got, ref, **TOL, err_msg=jax.tree_util.keystr(path))


def _train_temp_bytes(kernel, seq, heads=2, h=32):
    spec = jax.ShapeDtypeStruct((1, seq, heads, h), jnp.float32)
    seg = jax.ShapeDtypeStruct((1, seq), jnp.int32)

    def loss(q, k, v, seg):
        return jnp.sum(kernel(q, k, v, seg, jnp.array(True), 2048))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec, seg).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_forward_and_backward_hold_no_t_by_t_buffer():
    """Compile only: at T = 8,192 one [H, T, T] float32 score matrix is 512 MiB; the blockwise
    kernel's forward + backward needs a small fraction of that (the reference needs several)."""
    seq, heads = 8192, 2
    scores_bytes = heads * seq * seq * 4
    blockwise = lambda q, k, v, seg, g, w: bw.blockwise_attention(q, k, v, seg, g, w, 0.125)  # noqa: E731
    assert _train_temp_bytes(blockwise, seq, heads) < scores_bytes / 16
    assert _train_temp_bytes(reference_attention, seq, heads) > scores_bytes   # the measure sees it


def test_cudnn_path_masks_match_reference():
    """The cuDNN call's packed-row masks (segment offsets: causal, window, documents, trailing
    padding), run by XLA on CPU: equal to the reference on every real position, for rows of one
    document and of several; padding positions come out 0 (never NaN)."""
    seq = 24
    q, k, v, _ = _qkv(2, seq)
    one_doc = jnp.asarray(np.array([[1] * seq, [1] * 19 + [0] * 5], np.int32))
    run = jax.jit(lambda seg, flag: (cudnn_attention(q, k, v, seg, flag, WINDOW, implementation="xla"),
                                     reference_attention(q, k, v, seg, flag, WINDOW)))
    for seg in (one_doc, _segments(2, seq)):
        real = np.asarray(seg > 0)
        for is_global in (False, True):
            got, want = run(seg, jnp.array(is_global))
            np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], **TOL)
            assert np.all(np.asarray(got)[~real] == 0)


def test_impl_auto_resolves_per_platform_and_cudnn_needs_a_gpu():
    assert make_config().attention.impl == "blockwise"
    gpu = make_config("hardware=h200_node", "model.compute_dtype=bfloat16")
    assert derive.attention_impl(gpu) == "cudnn" and gpu.attention.impl == "cudnn"
    assert make_config("hardware=h200_node").attention.impl == "blockwise"     # float32: no cuDNN kernel
    for bad in ("attention.impl=cudnn", "attention.impl=flash"):
        with pytest.raises(ConfigError, match="attention.impl"):
            load(compose_dict(bad))
