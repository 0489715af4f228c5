"""Attention kernels, forward + backward, as ratios measured in one run (machine noise cancels).

    python benchmarks/attention.py                       # CPU defaults: 4 heads × 64, window 2,048
    python benchmarks/attention.py --block 256 --rounds 7

Four jitted gradient computations (sum of the output → dq, dk, dv) are timed round after round,
interleaved, and compared by their best round (load on a shared machine only ever adds time;
medians are printed too):
- `local  T=8192` and `local  T=16384`: the blockwise kernel on a local (sliding-window) layer.
  Target: 16K ≤ 2.3× 8K (cost linear in T, as the window bounds the keys a query visits; the
  exact work, T·W − W²/2 query-key pairs, makes the ideal ratio 2.14 at W = 2,048).
- `global T=2048` blockwise and reference (the [T, T] formula). Target: blockwise ≤ 2.0× reference.
One document per row (no document boundary shortens the global layer's work).

Needs only jax and numpy (plus this repository on the path).
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

from marin.model import blockwise_attention as bw  # noqa: E402
from marin.model.attention import reference_attention  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--window", type=int, default=2048)
    p.add_argument("--local-seq", type=int, default=8192, help="the shorter local-layer length (the longer is 2×)")
    p.add_argument("--global-seq", type=int, default=2048)
    p.add_argument("--block", type=int, default=bw.BLOCK, help="blockwise block size")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (after one warm-up)")
    return p.parse_args(argv)


def gradient_fn(kernel, seq, is_global, a):
    """A jitted () → (dq, dk, dv) of sum(attention) on fixed random inputs, and its inputs."""
    keys = jax.random.split(jax.random.key(seq), 3)
    q, k, v = (jax.random.normal(key, (1, seq, a.heads, a.head_dim)) for key in keys)
    seg = jnp.ones((1, seq), jnp.int32)
    flag = jnp.array(is_global)
    loss = lambda q, k, v: jnp.sum(kernel(q, k, v, seg, flag, a.window))  # noqa: E731
    fn = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    return lambda: jax.block_until_ready(fn(q, k, v))


def main(argv=None):
    a = parse_args(argv)
    scale = a.head_dim ** -0.5
    blockwise = lambda q, k, v, seg, g, w: bw.blockwise_attention(q, k, v, seg, g, w, scale, a.block)  # noqa: E731
    cases = {
        f"local  T={a.local_seq} blockwise": gradient_fn(blockwise, a.local_seq, False, a),
        f"local  T={2 * a.local_seq} blockwise": gradient_fn(blockwise, 2 * a.local_seq, False, a),
        f"global T={a.global_seq} blockwise": gradient_fn(blockwise, a.global_seq, True, a),
        f"global T={a.global_seq} reference": gradient_fn(reference_attention, a.global_seq, True, a),
    }
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; {a.heads} heads × {a.head_dim}, "
          f"window {a.window}, block {a.block}; forward + backward, {a.rounds} rounds")
    for fn in cases.values():   # warm-up: compile
        fn()
    times = {name: [] for name in cases}
    for _ in range(a.rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    best = {name: min(t) for name, t in times.items()}
    print(f"  {'':<32} {'best':>9}    {'median':>9}")
    for name, t in times.items():
        print(f"  {name:<32} {1e3 * min(t):9.1f} ms {1e3 * statistics.median(t):9.1f} ms")
    names = list(best)
    local_ratio = best[names[1]] / best[names[0]]
    global_ratio = best[names[2]] / best[names[3]]
    print(f"local 2T / T      = {local_ratio:.2f}×  (target ≤ 2.3×: linear in T)  "
          f"{'ok' if local_ratio <= 2.3 else 'MISSED'}")
    print(f"global blockwise / reference = {global_ratio:.2f}×  (target ≤ 2.0×)  "
          f"{'ok' if global_ratio <= 2.0 else 'MISSED'}")


if __name__ == "__main__":
    main()
