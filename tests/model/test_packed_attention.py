"""The cudnn kernel on packed rows: the segment offsets and lengths imply exactly `attention_mask`'s
rule; grouped KV heads read unexpanded equal the expanded reference; a row with more documents than
`attention.cudnn_max_documents` runs blockwise, logged once; the tiny model with it equals the
reference; lowered for CUDA it is cuDNN's packed call (the plan's line: tests/launch/test_plan.py).

cuDNN does not run on CPU: the kernel runs here with `implementation="xla"`, the same layout and
branches with the fused call computed in plain JAX (`packed_attention.xla_packed_attention`)."""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from marin.model import attention, transformer
from marin.model.attention import attention_mask, blockwise_kernel, cudnn_attention, expand_kv_heads, reference_attention
from marin.model.kernels import packed_attention as packed
from tests.helpers import make_config

WINDOW = 3
MAX_DOCS = 3
TOL = dict(atol=1e-5, rtol=1e-5)


def _rows(lengths_per_row, seq):
    """segment_ids [B, T] with documents of the given lengths numbered 1, 2, ..., then padding."""
    seg = np.zeros((len(lengths_per_row), seq), np.int32)
    for b, lengths in enumerate(lengths_per_row):
        start = 0
        for doc, n in enumerate(lengths, 1):
            seg[b, start:start + n] = doc
            start += n
    return seg


# T = 12, M = 3: several documents and padding; one document, no padding; exactly M documents
# (one of length 1); M + 1 documents.
SEQ = 12
SEGMENTS = _rows([[4, 5], [12], [5, 1, 4], [3, 3, 3, 3]], SEQ)
FITS = np.array([True, True, True, False])


def _random_rows(rng, batch, seq, max_docs):
    """Random loader-like rows: 1..max_docs documents of random lengths, then padding."""
    rows = []
    for _ in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq + 1), size=rng.integers(1, max_docs + 1), replace=False))
        rows.append(np.diff(np.concatenate([[0], cuts])).tolist())
    return _rows(rows, seq)


@pytest.mark.parametrize("is_global", [False, True])
def test_layout_implies_the_attention_mask(is_global):
    """Offsets + lengths + causal (+ window on local layers), rebuilt as a mask, equal
    `attention_mask` on every row that fits (padding reads nothing there; the rule lets it read
    itself); a row of more documents is covered up to its M-th document only."""
    seg = jnp.asarray(np.concatenate([SEGMENTS, _random_rows(np.random.default_rng(0), 16, SEQ, MAX_DOCS)]))
    layout = packed.segment_layout(seg, MAX_DOCS)
    implied = np.asarray(packed.layout_mask(layout, SEQ, None if is_global else WINDOW))
    rule = np.asarray(attention_mask(seg, jnp.array(is_global), WINDOW))
    real = np.asarray(seg) != 0
    fits = np.asarray(layout.documents) <= MAX_DOCS
    np.testing.assert_array_equal(fits[:4], FITS)
    assert fits[4:].all()
    for b in np.flatnonzero(fits):
        np.testing.assert_array_equal(implied[b] | np.diag(~real[b]), rule[b], err_msg=f"row {b}")
    overflow = 3
    covered = np.asarray(seg[overflow]) <= MAX_DOCS      # queries of its first M documents
    np.testing.assert_array_equal(implied[overflow][covered], rule[overflow][covered])
    assert not implied[overflow][~covered].any()


def test_layout_lists_each_document_once_padded_with_minus_one():
    layout = packed.segment_layout(jnp.asarray(SEGMENTS), MAX_DOCS)
    np.testing.assert_array_equal(layout.documents, [2, 1, 3, 4])
    np.testing.assert_array_equal(layout.offsets, [[0, 4, -1, -1], [0, -1, -1, -1], [0, 5, 6, -1], [0, 3, 6, -1]])
    np.testing.assert_array_equal(layout.lengths, [[4, 5, -1], [12, -1, -1], [5, 1, 4], [3, 3, 3]])
    assert not bool(layout.fits) and bool(packed.segment_layout(jnp.asarray(SEGMENTS[:3]), MAX_DOCS).fits)


def _qkv(batch, heads=4, kv=2, h=8, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (batch, SEQ, heads, h))
    k, v = (jax.random.normal(key, (batch, SEQ, kv, h)) for key in keys[1:3])
    return q, k, v, jax.random.normal(keys[3], q.shape)


@pytest.mark.parametrize("is_global", [False, True])
def test_unexpanded_kv_heads_match_the_expanded_reference(is_global):
    """4 query heads over 2 stored KV heads (global layers: the first 1): the cudnn kernel's
    grouped call and the blockwise kernel, outputs and gradients, equal the reference run on K/V
    expanded to one head per query head (`kv_head_index`), on every real position."""
    seg = jnp.asarray(SEGMENTS[:3])
    q, k, v, cotangent = _qkv(3)
    flag, kv_global = jnp.array(is_global), 1
    real = (seg != 0)[:, :, None, None]

    def expanded(q, k, v):
        k, v = (expand_kv_heads(t, q.shape[2], kv_global, flag) for t in (k, v))
        return reference_attention(q, k, v, seg, flag, WINDOW)
    kernels = {"expanded": expanded,
               "cudnn": lambda q, k, v: cudnn_attention(q, k, v, seg, flag, WINDOW, kv_global, MAX_DOCS, "xla"),
               "blockwise": lambda q, k, v: blockwise_kernel(q, k, v, seg, flag, WINDOW, kv_global)}
    results = {name: jax.jit(jax.value_and_grad(lambda *a: jnp.sum(jnp.where(real, fn(*a), 0) * cotangent),
                                                argnums=(0, 1, 2)))(q, k, v)
               for name, fn in kernels.items()}
    (want_loss, want_grads) = results.pop("expanded")
    for name, (loss, grads) in results.items():
        np.testing.assert_allclose(loss, want_loss, **TOL, err_msg=name)
        for want, got in zip(want_grads, grads):
            np.testing.assert_allclose(got, want, **TOL, err_msg=name)
    # the global layer reads only the first KV head: the second one's gradient is zero there
    assert (np.abs(want_grads[1][:, :, 1]).max() == 0) == is_global


def test_more_documents_than_the_maximum_run_blockwise_and_say_so_once(monkeypatch, caplog):
    """The fused call serves batches whose rows all fit; one row over the maximum sends the whole
    batch to blockwise (both branches compiled, chosen at run time), with one log line per process."""
    fused_marker = 7.0
    monkeypatch.setattr(packed, "xla_packed_attention", lambda q, k, v, layout, window: jnp.full(q.shape, fused_marker))
    monkeypatch.setattr(attention, "_fallback_logged", False)
    q, k, v, _ = _qkv(2)
    cfg = make_config("model=tiny")
    cfg.attention.impl, cfg.attention.cudnn_max_documents = "cudnn", MAX_DOCS

    def kernel_and_report(seg):   # the model reports once per forward, outside its layer scan
        attention.report_fallback(seg, cfg)
        return cudnn_attention(q, k, v, seg, jnp.array(False), WINDOW, 1, MAX_DOCS, "xla")

    run = jax.jit(kernel_and_report)
    with caplog.at_level(logging.WARNING, logger=attention.__name__):
        fitting = run(jnp.asarray(SEGMENTS[1:3]))
        jax.effects_barrier()
        assert not caplog.records
        overflowing = jnp.asarray(SEGMENTS[2:4])
        for _ in range(3):
            out = run(overflowing)
        jax.effects_barrier()
    assert np.all(np.asarray(fitting) == fused_marker)
    want = reference_attention(q, k, v, overflowing, jnp.array(False), WINDOW, 1)
    np.testing.assert_allclose(out, want, **TOL)
    assert len(caplog.records) == 1
    assert "4 documents" in caplog.text and "attention.cudnn_max_documents=3" in caplog.text



def test_cudnn_kernel_lowers_for_cuda_to_the_packed_fused_call(monkeypatch):
    """Lowered for CUDA here (no GPU): forward and backward are cuDNN's fused attention, fed the
    stored KV heads (local: all 2; global: the first 1), M segments a row, the window on local
    layers only. JAX's cuDNN module asks the GPU driver for versions while tracing, so those
    questions are answered here as a Hopper with cuDNN 9.10 would."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_module
    from jax._src.interpreters import mlir
    monkeypatch.setattr(cudnn_module, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn_module, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(cudnn_module, "is_cuda_compute_capability_equal", lambda capability: False)
    batch, seq, heads, kv, h, window, max_docs = 2, 256, 4, 2, 64, 128, 8
    spec = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    loss = lambda q, k, v, seg, flag: jnp.sum(cudnn_attention(q, k, v, seg, flag, window, 1, max_docs))  # noqa: E731
    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(
        spec(batch, seq, heads, h), spec(batch, seq, kv, h), spec(batch, seq, kv, h),
        spec(batch, seq, dtype=jnp.int32), spec(dtype=jnp.bool_))
    text = traced.lower(lowering_platforms=("cuda",),
                        _private_parameters=mlir.LoweringParameters(for_export=True)).as_text()
    forward = [line for line in text.splitlines() if "custom_call @__cudnn$fmhaSoftmax(" in line]
    assert len(forward) == 2 and text.count("custom_call @__cudnn$fmhaSoftmaxBackward(") == 2
    for line in forward:
        assert f"\\22max_seg_per_batch\\22: {max_docs}," in line
    called = {(kv_heads, w) for line in forward for kv_heads in (kv, 1) for w in (window, 0)   # w 0: none
              if f", tensor<{batch}x{seq}x{kv_heads}x{h}xbf16>, " in line and f"\\22sliding_window_length\\22: {w}," in line}
    assert called == {(kv, window), (1, 0)}     # local layers; global layers


@pytest.mark.parametrize("max_documents", [3, 2])   # 2: the first row holds 3 documents → blockwise
def test_tiny_model_with_the_cudnn_kernel_matches_reference(monkeypatch, max_documents):
    """The whole model (layer scan, remat, local and global layers, GQA) with attention.impl=cudnn,
    the fused call computed by XLA: loss and gradients equal the reference kernel's, whichever
    branch the batch takes. (cudnn is refused on a CPU config, so the resolved config is edited.)"""
    monkeypatch.setattr(packed, "cudnn_packed_attention", packed.xla_packed_attention)
    monkeypatch.setattr(attention, "_fallback_logged", False)
    seq = 16
    seg = jnp.asarray(_rows([[5, 6, 3], [16]], seq))
    tokens = np.random.default_rng(0).integers(0, 512, (2, seq + 1))
    batch = {"inputs": jnp.asarray(tokens[:, :-1], jnp.int32), "targets": jnp.asarray(tokens[:, 1:], jnp.int32),
             "segment_ids": seg, "loss_mask": (seg > 0).astype(jnp.float32)}

    def run(impl):
        cfg = make_config("model=tiny", "attention.window=4", "attention.kv_heads_local=2",
                          "attention.kv_heads_global=1", "model.remat=full")
        cfg.attention.impl, cfg.attention.cudnn_max_documents = impl, max_documents
        params = transformer.init_params(cfg, jax.random.key(0))
        bias = jnp.zeros((cfg.model.num_layers, cfg.model.num_experts))
        return jax.jit(jax.value_and_grad(lambda p: transformer.loss_fn(p, batch, bias, cfg, train=True)[0]))(params)
    (want_loss, want_grads), (loss, grads) = run("reference"), run("cudnn")
    jax.effects_barrier()
    assert attention._fallback_logged == (max_documents == 2)   # the branch the batch took
    np.testing.assert_allclose(loss, want_loss, **TOL)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(want_grads), jax.tree_util.tree_leaves(grads)):
        np.testing.assert_allclose(got, want, **TOL, err_msg=jax.tree_util.keystr(path))


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in (value if isinstance(value, (list, tuple)) else [value]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_the_layer_scan_body_has_no_effect(monkeypatch):
    """The fallback's log line is a host callback, an effect; in the layer scan's body it made Flax
    0.12.10 (the H200 image's) refuse the model at init: "broadcasted variable has a data
    dependency on the scan body". It is traced once per forward, outside the scan."""
    monkeypatch.setattr(packed, "cudnn_packed_attention", packed.xla_packed_attention)
    cfg = make_config("model=tiny", "model.remat=full")
    cfg.attention.impl = "cudnn"
    params = transformer.init_params(cfg, jax.random.key(0))
    seg = jnp.asarray(_rows([[5, 6, 3], [16]], 16))
    batch = {"inputs": jnp.zeros((2, 16), jnp.int32), "targets": jnp.zeros((2, 16), jnp.int32),
             "segment_ids": seg, "loss_mask": (seg > 0).astype(jnp.float32)}
    bias = jnp.zeros((cfg.model.num_layers, cfg.model.num_experts))
    jaxpr = jax.make_jaxpr(lambda p: transformer.loss_fn(p, batch, bias, cfg, train=True)[0])(params).jaxpr
    scans = [eqn for eqn in _eqns(jaxpr) if eqn.primitive.name == "scan" and eqn.params["length"] == cfg.model.num_layers]
    assert scans and not any(eqn.params["jaxpr"].effects for eqn in scans)
    assert any(eqn.primitive.name == "debug_callback" for eqn in _eqns(jaxpr))   # the report, outside the scan
