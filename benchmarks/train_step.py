"""The whole train step: model FLOP rate against a matmul, and compile time against depth.

    python benchmarks/train_step.py                 # the default run's step (CPU), and compile 4 vs 48 layers
    python benchmarks/train_step.py --preset h200   # one H200: d 2048, 8 layers, 64 experts top-8
                                                    # (width 1024, latent 1024), seq 4096, bf16

Reported as ratios taken in one run (the machine is shared and noisy):
- step: model FLOPs per step (3 × forward FLOPs per token × tokens, the spec's §1b rule) over
  the median step time, against a back-to-back N³ matmul of the compute dtype; on a GPU also
  against the device's dense peak (--peak-tflops, 989 for H200 bf16): that is MFU.
- compile: the train step of a 48-layer model against the same at 4 layers, equal width (the
  layers are one scan, so the target is ≤ 1.5×). The persistent compilation cache is off.

Both presets are composed through Hydra as launch.py composes them (`--preset h200` is
benchmarks/presets.py's `d2048`, on hardware=h200).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))   # presets.py

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from marin.config.schema import Config  # noqa: E402
from marin.model import accounting  # noqa: E402


def compose_config(*overrides: str) -> Config:
    """A config composed exactly as launch.py composes it (Hydra, the schema checks, derive)."""
    from marin.config.store import compose
    from marin.launch.checks import load

    return load(compose(overrides))[1]


def preset_overrides(preset: str) -> list[str]:
    """`default`: the default run; `h200`: benchmarks/presets.py's hero-shaped one-GPU config
    (d 2048, 8 layers, E64 top-8, expert width and latent 1024, seq 4,096, bf16)."""
    if preset == "default":
        return []
    from presets import PRESETS
    return list(PRESETS["d2048"])


def random_batch(cfg) -> dict:
    rng = np.random.default_rng(0)
    B, T = cfg.train.global_batch, cfg.train.seq_len
    tokens = rng.integers(0, min(cfg.model.vocab_size, 256), (B, T + 1), dtype=np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": np.ones((B, T), np.int32), "loss_mask": np.ones((B, T), np.float32)}


def build_step(cfg):
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import init_state
    from marin.train.step import make_train_step

    mesh = make_mesh(cfg)
    tx = build_optimizer(cfg)
    state = jax.jit(lambda k: init_state(cfg, tx, k))(jax.random.key(0))
    return jax.jit(make_train_step(cfg, tx, mesh), donate_argnums=0), state


def median_time(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_rate(cfg, rounds: int, matmul_n: int, peak_tflops: float) -> None:
    step, state = build_step(cfg)
    batch = {k: jnp.asarray(v) for k, v in random_batch(cfg).items()}
    holder = {"state": state}

    def one_step():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]

    dtype = jnp.bfloat16 if cfg.model.compute_dtype == "bfloat16" else jnp.float32
    x = jnp.ones((matmul_n, matmul_n), dtype)
    matmul = jax.jit(lambda a: a @ a)
    one_step(), jax.block_until_ready(matmul(x))  # compile both
    step_times, matmul_times = [], []
    for _ in range(rounds):  # interleaved, so noise hits both alike
        step_times.append(median_time(one_step, 1))
        matmul_times.append(median_time(lambda: matmul(x), 3))
    tokens = cfg.train.seq_len * cfg.train.global_batch
    model_flops = 3 * accounting.flops_per_token(cfg) * tokens
    step_s, matmul_s = statistics.median(step_times), statistics.median(matmul_times)
    step_rate_, matmul_rate = model_flops / step_s, 2 * matmul_n ** 3 / matmul_s
    print(f"train step  d {cfg.model.d_model} × {cfg.model.num_layers} layers, E {cfg.model.num_experts} "
          f"top-{cfg.router.top_k}, {tokens} tokens, {cfg.model.compute_dtype}, {jax.default_backend()}")
    print(f"  step {step_s * 1e3:9.1f} ms   model FLOP rate {step_rate_ / 1e9:9.1f} GFLOP/s   "
          f"tokens/s {tokens / step_s:,.0f}")
    print(f"  matmul {matmul_n}³ {dtype.dtype.name}: {matmul_rate / 1e9:9.1f} GFLOP/s")
    print(f"  step rate / matmul rate = {step_rate_ / matmul_rate:.1%}")
    if peak_tflops:
        print(f"  MFU vs {peak_tflops:g} TFLOP/s peak = {step_rate_ / (peak_tflops * 1e12):.1%}")


def compile_seconds(cfg) -> float:
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import init_state
    from marin.train.step import make_train_step

    tx = build_optimizer(cfg)
    abstract_state = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    batch = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), random_batch(cfg))
    start = time.perf_counter()
    jax.jit(make_train_step(cfg, tx, make_mesh(cfg))).lower(abstract_state, batch).compile()
    return time.perf_counter() - start


def compile_ratio(shallow: Config, deep: Config, rounds: int) -> None:
    jax.config.update("jax_enable_compilation_cache", False)
    pairs = [(compile_seconds(shallow), compile_seconds(deep)) for _ in range(rounds)]
    s, d = statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
    print(f"compile  {shallow.model.num_layers} layers {s:.2f} s, {deep.model.num_layers} layers {d:.2f} s "
          f"(d {deep.model.d_model}): ratio {d / s:.2f}× (target ≤ 1.5×)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", choices=("default", "h200"), default="default")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--matmul", type=int, default=2048)
    p.add_argument("--peak-tflops", type=float, default=0.0, help="device dense peak for MFU (H200 bf16: 989)")
    p.add_argument("--skip-compile", action="store_true")
    a = p.parse_args()
    overrides = preset_overrides(a.preset)
    step_rate(compose_config(*overrides), a.rounds, a.matmul, a.peak_tflops)
    if not a.skip_compile:
        shallow, deep = (compose_config(*overrides, f"model.num_layers={n}") for n in (4, 48))
        compile_ratio(shallow, deep, max(1, a.rounds // 2))


if __name__ == "__main__":
    main()
