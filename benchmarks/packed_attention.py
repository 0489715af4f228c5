"""The cudnn attention kernel on packed rows against blockwise, forward + backward (GPU, bf16).

    python benchmarks/packed_attention.py                      # B 8 × T 4096, 6 heads × 128, window 2,048
    python benchmarks/packed_attention.py --kv-heads 2 --kv-global 1 --doc-len 512 --max-documents 64

Times jitted gradients (dq, dk, dv of sum(out · cotangent)) of the two kernels exactly as the
model calls them (`marin.model.attention.cudnn_attention` and `blockwise_kernel`, the stored KV
heads unexpanded), on rows packed with documents of random length around --doc-len, for a local
and a global layer, interleaved round after round, best round reported. Also prints each
kernel's largest difference from blockwise on real positions (bf16 noise: ~1e-2), and how many
documents the fullest row holds (more than --max-documents sends cudnn to its blockwise fallback).
Needs a GPU with cuDNN (Hopper or later for packed rows).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from marin.model.attention import blockwise_kernel, cudnn_attention  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--kv-heads", type=int, default=6, help="stored KV heads (local layers)")
    p.add_argument("--kv-global", type=int, default=None, help="KV heads global layers read (default: all)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--doc-len", type=int, default=1024, help="mean document length (exponential)")
    p.add_argument("--max-documents", type=int, default=64, help="attention.cudnn_max_documents")
    p.add_argument("--rounds", type=int, default=10)
    return p.parse_args(argv)


def packed_rows(batch: int, seq: int, doc_len: int, rng) -> np.ndarray:
    """segment_ids as the loader packs them: documents 1, 2, ... back to back, the last one cut."""
    seg = np.zeros((batch, seq), np.int32)
    for b in range(batch):
        start, doc = 0, 1
        while start < seq:
            n = max(1, int(rng.exponential(doc_len)))
            seg[b, start:start + n] = doc
            start, doc = start + n, doc + 1
    return seg


def main(argv=None):
    a = parse_args(argv)
    rng = np.random.default_rng(0)
    seg = jnp.asarray(packed_rows(a.batch, a.seq, a.doc_len, rng))
    q, cotangent = (jnp.asarray(rng.standard_normal((a.batch, a.seq, a.heads, a.head_dim)), jnp.bfloat16)
                    for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((a.batch, a.seq, a.kv_heads, a.head_dim)), jnp.bfloat16) for _ in range(2))
    kernels = {"blockwise": lambda q, k, v, flag: blockwise_kernel(q, k, v, seg, flag, a.window, a.kv_global),
               "cudnn": lambda q, k, v, flag: cudnn_attention(q, k, v, seg, flag, a.window, a.kv_global, a.max_documents)}
    cases, diffs = {}, {}
    real = np.asarray(seg != 0)
    for layer, is_global in (("local", False), ("global", True)):
        flag = jnp.array(is_global)
        outs = {}
        for name, fn in kernels.items():
            outs[name] = np.asarray(jax.jit(fn)(q, k, v, flag), np.float32)
            grad = jax.jit(jax.grad(lambda q, k, v, fn=fn, flag=flag: jnp.sum(fn(q, k, v, flag) * cotangent),
                                    argnums=(0, 1, 2)))
            cases[f"{layer} {name}"] = lambda grad=grad: jax.block_until_ready(grad(q, k, v))
        diffs[layer] = float(np.abs(outs["cudnn"] - outs["blockwise"])[real].max())
    documents = int(np.max([len(np.unique(r[r != 0])) for r in np.asarray(seg)]))
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; B {a.batch} × T {a.seq}, {a.heads} heads × "
          f"{a.head_dim}, kv {a.kv_heads}/{a.kv_global or a.kv_heads}, window {a.window}; fullest row "
          f"{documents} documents (max {a.max_documents}); forward + backward, {a.rounds} rounds")
    for fn in cases.values():   # warm-up: compile
        fn()
    times = {name: [] for name in cases}
    for _ in range(a.rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    print(f"  {'':<18} {'best':>9}    {'median':>9}")
    for name, t in times.items():
        print(f"  {name:<18} {1e3 * min(t):9.2f} ms {1e3 * statistics.median(t):9.2f} ms")
    for layer in ("local", "global"):
        speedup = min(times[f"{layer} blockwise"]) / min(times[f"{layer} cudnn"])
        print(f"{layer}: cudnn {speedup:.2f}× faster than blockwise; max |cudnn − blockwise| {diffs[layer]:.3g}")


if __name__ == "__main__":
    main()
