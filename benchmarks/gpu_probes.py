"""Kernel probes of benchmarks/gpu.py: the attention kernels and the grouped GEMM, fwd+bwd.

Each probe times the project's own code path (the `attention.impl` registry; `kernels.grouped_matmul`
as `model.dispatch=ragged_dot` and `model.ep_transport=ragged` call it, by `model.grouped_matmul`) at the first preset's
shapes, and compares it with the kernel it would replace.
"""
from __future__ import annotations

import math

import numpy as np


def cuda_versions() -> dict:
    """CUDA runtime and cuDNN versions as jaxlib reports them (empty off CUDA)."""
    try:
        from jax._src.lib import cuda_versions as cv
    except ImportError:
        return {}
    if cv is None:
        return {}
    out = {}
    for key, fn in (("cuda", "cuda_runtime_get_version"), ("cudnn", "cudnn_get_version")):
        try:
            out[key] = getattr(cv, fn)()
        except Exception:  # a CPU-only jaxlib has the module but no library behind it
            pass
    return out


def _timed(fn, args, rounds: int) -> float:
    from gpu import bench
    return bench(fn, *args, rounds=rounds)


def allowed_pairs(seg: np.ndarray, window: int, is_global: bool) -> int:
    """(query, key) pairs the mask allows: causal, same document, within the window on local layers."""
    total = 0
    for row in seg:
        starts = np.zeros(row.size, np.int64)
        for t in range(1, row.size):
            starts[t] = starts[t - 1] if row[t] == row[t - 1] else t
        span = np.arange(row.size) - starts + 1
        total += int((span if is_global else np.minimum(span, window)).sum())
    return total


def attention(cfg, doc_len: int, tiny: bool, left) -> dict:
    """Each attention kernel's fwd+bwd on packed rows, local and global layers, and its largest
    difference from blockwise (the reference every kernel is tested against)."""
    import jax
    import jax.numpy as jnp

    from gpu_step import segment_ids
    from marin.model.attention import attend
    a = cfg.attention
    B, T = (2, 128) if tiny else (8, cfg.train.seq_len)
    H, KV, h, window = a.num_heads, a.kv_heads_local, a.head_dim, a.window
    rng = np.random.default_rng(0)
    q, do = (jnp.asarray(rng.standard_normal((B, T, H, h)), jnp.bfloat16) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((B, T, KV, h)), jnp.bfloat16) for _ in range(2))   # stored KV heads
    seg_np = segment_ids(B, T, "packed", min(doc_len, T // 4), np.random.default_rng(1))
    seg = jnp.asarray(seg_np)
    kernels = ["blockwise", "reference"] if jax.default_backend() == "cpu" else ["blockwise", "cudnn"]
    results = {}
    for is_global in (False, True):
        flops = 4.0 * h * H * allowed_pairs(seg_np, window, is_global) * 3.5   # fwd 2 GEMMs, bwd 5
        reference = None
        for impl in kernels:
            key = f"{impl} / {'global' if is_global else 'local'}"
            if left() < 10:
                results[key] = {"error": "skipped: budget"}
                continue
            try:
                options = {"max_documents": a.cudnn_max_documents} if impl == "cudnn" else {}
                fn = lambda q, k, v: attend(impl, q, k, v, seg, jnp.asarray(is_global), window, a.kv_heads_global, **options)
                out = np.asarray(jax.jit(fn)(q, k, v), np.float32)
                reference = out if reference is None else reference
                grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v) * do.astype(jnp.float32)), argnums=(0, 1, 2)))
                sec = _timed(grad, (q, k, v), 3)
                results[key] = {"ms": sec * 1e3, "tflops_per_s": flops / sec / 1e12,
                                "max_abs_diff": float(np.max(np.abs(out - reference)[seg_np != 0]))}
            except Exception as exc:
                results[key] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    return {"shape": f"B {B} × T {T}, {H} heads × {h} ({KV} KV heads, {a.kv_heads_global} on global layers), "
                     f"window {window}, packed (mean {doc_len} tokens, ≤ {int(seg_np.max())} a row)",
            "results": results}


def grouped(cfg, tiny: bool, left) -> dict:
    """`jax.lax.ragged_dot` (XLA's lowering) and, on GPU, `kernels.grouped_matmul` with JAX's Mosaic
    GPU kernels (`model.grouped_matmul=mosaic`) against the capacity-padded batched einsum of
    `model.dispatch=sort`, fwd+bwd of one expert matmul; `flops_over_useful` ≈ the group count means
    XLA rewrote the ragged dot into a dense one (a kernel is a custom call: ≈ 0). The Mosaic entry's
    `max_abs_diff` is its largest |Δ| from XLA's ragged_dot over the forward output and both
    gradients (`max_abs_diff_by_output`: y, dx, dw)."""
    import jax
    import jax.numpy as jnp

    from marin.model.kernels.grouped_matmul import grouped_matmul
    m = cfg.model
    rows, kd, nd, groups = (256, 32, 64, 4) if tiny else (16384 * 8, int(m.latent_dim), int(m.expert_width), m.num_experts)
    rows = rows if tiny else min(rows, cfg.train.global_batch * cfg.train.seq_len * cfg.router.top_k)
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(np.bincount(rng.integers(0, groups, rows), minlength=groups).astype(np.int32))
    x = jnp.asarray(rng.standard_normal((rows, kd)) * 0.1, jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((groups, kd, nd)) * 0.03, jnp.bfloat16)
    c = jnp.asarray(rng.standard_normal((rows, nd)), jnp.bfloat16)
    useful = 3 * 2.0 * rows * kd * nd
    cap = int(math.ceil(1.25 * rows / groups / 8) * 8)
    xe = jnp.asarray(rng.standard_normal((groups, cap, kd)) * 0.1, jnp.bfloat16)
    ce = jnp.asarray(rng.standard_normal((groups, cap, nd)), jnp.bfloat16)
    ragged = {"ragged_dot (XLA)": jax.lax.ragged_dot}
    if jax.default_backend() == "gpu":
        ragged["grouped_matmul (Mosaic GPU)"] = lambda a, b, s: grouped_matmul(a, b, s, impl="mosaic")
    modes = {"einsum (capacity 1.25)": (lambda a, b: jnp.sum((jnp.einsum("gck,gkn->gcn", a, b) * ce).astype(jnp.float32)), (xe, w))}
    for name, matmul in ragged.items():
        modes[name] = ((lambda mm: lambda a, b: jnp.sum((mm(a, b, sizes) * c).astype(jnp.float32)))(matmul), (x, w))
    results, outputs = {}, {}
    for name, (loss, args) in modes.items():
        if left() < 10:
            results[name] = {"error": "skipped: budget"}
            continue
        try:
            compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            sec = _timed(compiled, args, 3)
            results[name] = {"ms": sec * 1e3, "tflops_per_s": useful / sec / 1e12,
                             "flops_over_useful": float((cost or {}).get("flops", float("nan"))) / useful}
            if name in ragged:   # the forward output and both gradients, for the |Δ| against XLA's
                outputs[name] = (jax.jit(ragged[name])(x, w, sizes), *compiled(*args))
            reference = outputs.get("ragged_dot (XLA)")
            if name in outputs and name != "ragged_dot (XLA)" and reference is not None:
                parts = {part: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
                         for part, a, b in zip(("y", "dx", "dw"), outputs[name], reference)}
                results[name] |= {"max_abs_diff": max(parts.values()), "max_abs_diff_by_output": parts}
        except Exception as exc:
            results[name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    return {"shape": f"rows {rows}, {kd} → {nd}, {groups} groups", "results": results}
