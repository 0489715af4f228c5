"""Loader speed against the default run's token consumption, measured in one run.

    python benchmarks/data_loader.py [overrides ...] [--steps 200] [--train-steps 10]

1. Builds the `Loader` of the composed config (default: the built-in mixture; the cache is
   prepared first and not timed) and times `batch(step)` over --steps consecutive steps:
   loader tokens/s = steps × global_batch × seq_len / time (one process, all rows).
2. Times --train-steps jitted train steps of the same config (compiled first, not timed) with
   `marin.train.step.make_train_step`: consumption tokens/s = tokens per step / step time.
3. Prints the ratio. Target: loader ≥ 20× the step's consumption on the default run.

If the training code cannot be imported, step 2 is skipped and the consumption to beat is
printed as a formula of the step time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 20.0


def compose(overrides: list[str]):
    from marin.config.store import compose as compose_config
    from marin.launch.checks import load

    return load(compose_config(overrides))[1]


def loader_rate(cfg, steps: int) -> tuple[float, float]:
    """(tokens/s, median seconds per batch) of Loader.batch over consecutive steps."""
    from marin.data.loader import Loader

    loader = Loader(cfg)
    loader.batch(0)
    times = []
    for step in range(steps):
        start = time.perf_counter()
        loader.batch(step % cfg.train.steps)
        times.append(time.perf_counter() - start)
    tokens = steps * cfg.train.global_batch * cfg.train.seq_len
    return tokens / sum(times), statistics.median(times)


def step_time(cfg, steps: int) -> float:
    """Median seconds of one jitted train step of `cfg` (after compilation)."""
    import jax

    from marin.data.loader import Loader
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import batch_sharding, init_state, state_sharding
    from marin.train.step import make_train_step

    mesh = make_mesh(cfg)
    tx = build_optimizer(cfg)
    abstract = jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))
    shardings = state_sharding(cfg, abstract, mesh)
    spec = batch_sharding(mesh)
    with jax.set_mesh(mesh):
        state = jax.jit(lambda k: init_state(cfg, tx, k), out_shardings=shardings)(jax.random.key(0))
    step = jax.jit(make_train_step(cfg, tx, mesh), in_shardings=(shardings, spec),
                   out_shardings=(shardings, None), donate_argnums=0)
    loader = Loader(cfg, progress=False)
    keys = ("inputs", "targets", "segment_ids", "loss_mask")
    batches = [{k: jax.device_put(v, spec) for k, v in loader.batch(s).items() if k in keys}
               for s in range(steps + 1)]
    state, metrics = step(state, batches[0])
    jax.block_until_ready(metrics)
    times = []
    for batch in batches[1:]:
        start = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py")
    parser.add_argument("--steps", type=int, default=200, help="loader batches timed")
    parser.add_argument("--train-steps", type=int, default=10, help="train steps timed")
    args = parser.parse_args(argv)
    cfg = compose(args.overrides)
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    rate, per_batch = loader_rate(cfg, args.steps)
    print(f"loader: {rate:,.0f} tokens/s ({per_batch * 1e3:.2f} ms per batch of "
          f"{cfg.train.global_batch} × {cfg.train.seq_len} = {tokens_per_step:,} tokens)")
    try:
        seconds = step_time(cfg, args.train_steps)
    except ImportError as err:
        print(f"train step: not measured ({err}); the loader keeps up with any step slower than "
              f"{TARGET:g} × {per_batch * 1e3:.2f} ms = {TARGET * per_batch * 1e3:.1f} ms")
        return 0
    consumption = tokens_per_step / seconds
    ratio = rate / consumption
    print(f"train step: {seconds * 1e3:.1f} ms → consumes {consumption:,.0f} tokens/s "
          f"(model={cfg.model.name}, {cfg.hardware.name})")
    print(f"ratio loader / consumption: {ratio:,.1f}× (target ≥ {TARGET:g}×): "
          f"{'OK' if ratio >= TARGET else 'TOO SLOW'}")
    return 0 if ratio >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
