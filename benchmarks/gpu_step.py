"""One variant's train step for benchmarks/gpu.py, built exactly as the loop builds it.

The state comes from `marin.train.state.init_sharded`, the step from `marin.train.step.jit_steps`
with the optimizer's numbers from `hyperparams` (what `marin.train.trainer` does); the batch is
synthetic in the loader's layout (inputs, targets, segment ids 1, 2, … per row, loss mask).
"""
from __future__ import annotations

import statistics
import time

import numpy as np


def segment_ids(batch: int, seq: int, docs: str, doc_len: int, rng) -> np.ndarray:
    """[B, T] as the loader packs rows: documents of exponential length (mean doc_len, at least
    16 tokens) numbered 1, 2, … in each row (`packed`), or one document a row (`single`)."""
    seg = np.ones((batch, seq), np.int32)
    if docs == "packed":
        for row in range(batch):
            pos, sid = 0, 1
            while pos < seq:
                n = max(16, int(rng.exponential(doc_len)))
                seg[row, pos:pos + n] = sid
                pos, sid = pos + n, sid + 1
    return seg


def synthetic_batch(cfg, docs: str, doc_len: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    B, T = cfg.train.global_batch, cfg.train.seq_len
    tokens = rng.integers(0, cfg.model.vocab_size, (B, T + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segment_ids(B, T, docs, doc_len, rng),
            "loss_mask": np.ones((B, T), np.float32)}


def measure(cfg, spec: dict) -> dict:
    import jax

    from marin.config import derive
    from marin.model import accounting
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import batch_sharding, init_sharded
    from marin.train.step import hyperparams, jit_steps

    mesh = make_mesh(cfg)
    tx = build_optimizer(cfg)
    state, shardings = init_sharded(cfg, tx, mesh, 0)
    train_step, _ = jit_steps(cfg, tx, mesh, shardings)
    hp = hyperparams(cfg, mesh)
    batch = jax.device_put(synthetic_batch(cfg, spec["docs"], spec["doc_len"]), batch_sharding(mesh))

    start = time.perf_counter()
    compiled = train_step.lower(state, batch, hp).compile()
    compile_s = time.perf_counter() - start
    holder = {"state": state}

    def one():
        holder["state"], metrics = compiled(holder["state"], batch, hp)
        return metrics["loss"]

    for _ in range(2):
        jax.block_until_ready(one())
    times = []
    for _ in range(spec["rounds"]):
        start = time.perf_counter()
        loss = jax.block_until_ready(one())
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)

    tokens = cfg.train.global_batch * cfg.train.seq_len
    model_flops = 3 * accounting.flops_per_token(cfg) * tokens
    peak = cfg.hardware.peak_flops_per_device * derive.device_count(cfg.hardware)
    memory = compiled.memory_analysis()
    stats = jax.devices()[0].memory_stats() or {}
    plan = accounting.memory_per_device(cfg)
    result = {
        "compile_s": compile_s, "step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s,
        "model_tflops_per_s": model_flops / step_s / 1e12, "mfu": model_flops / step_s / peak if peak else None,
        "loss": float(loss), "tokens": tokens,
        "peak_gib": stats["peak_bytes_in_use"] / 2 ** 30 if "peak_bytes_in_use" in stats else None,
        "compiled_temp_gib": getattr(memory, "temp_size_in_bytes", 0) / 2 ** 30 if memory else None,
        "plan_gib": plan["total"], "plan_host_gib": plan["host"],
        "resolved": {"attention.impl": derive.attention_impl(cfg), "model.ep_transport": cfg.model.ep_transport,
                     "model.remat": cfg.model.remat, "optim.offload": cfg.optim.offload,
                     "model.offload_carry": cfg.model.offload_carry},
    }
    if spec.get("profile"):
        from gpu_profile import profile_step
        result["profile"] = profile_step(one, compiled.as_text())
    return result
