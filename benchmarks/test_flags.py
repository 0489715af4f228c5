"""The test suite's XLA flags (`TEST_XLA_FLAGS`, tests/helpers.py) against XLA's defaults, and
against the same flags less one: the CPU time of compiling the tests' tiny 2-layer train step, and
that step's run time.

    python benchmarks/test_flags.py [--repeats 2]

Each (flags, repeat) compiles in a fresh process with the persistent compilation cache off, the
flag sets interleaved; reported as medians and as ratios to the defaults. Compiling is most of the
suite's CPU, and a test runs a step a few times at most, so the flags trade a slower step for a
faster compile. The loss after 10 steps is printed too: it may differ in the last digits (LLVM
-O0 orders float operations differently), which is why every process of a test run gets the same
flags (marin passes the environment's XLA_FLAGS on).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CASES = {"qb + muonh": ["router=qb", "optim=muonh"], "softmax_aux + adamw": ["router=softmax_aux", "optim=adamw"]}


def measure(overrides: list[str]) -> dict:
    """In this process (XLA_FLAGS already set): compile CPU seconds, ms per step, the 10th loss."""
    import time

    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    from marin.model.mesh import make_mesh
    from marin.optim import build_optimizer
    from marin.train.state import init_state
    from marin.train.step import make_train_step
    from tests.helpers import make_config
    from tests.train.test_step import SMALL, batch_of

    cfg = make_config(*SMALL, *overrides)
    tx = build_optimizer(cfg)
    state, batch = init_state(cfg, tx, jax.random.key(0)), batch_of(cfg)
    lowered = jax.jit(make_train_step(cfg, tx, make_mesh(cfg))).lower(state, batch)
    cpu = time.process_time()
    step = lowered.compile()
    cpu = time.process_time() - cpu
    state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    wall = time.perf_counter()
    for _ in range(9):
        state, metrics = step(state, batch)
    jax.block_until_ready(metrics)
    return {"compile_cpu_s": cpu, "step_ms": (time.perf_counter() - wall) / 9 * 1e3, "loss": float(metrics["loss"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(CASES[args.child])))
        return
    from tests.helpers import TEST_XLA_FLAGS

    # all of the suite's flags, and all but one: what each one buys on top of the others (alone, a
    # flag can do little or even cost: together they do far more than apart)
    flags = TEST_XLA_FLAGS.split()
    flag_sets = {"XLA defaults": "", "TEST_XLA_FLAGS": TEST_XLA_FLAGS,
                 **{f"without {flag}": " ".join(f for f in flags if f != flag) for flag in flags}}
    runs: dict = {(c, f): [] for c in CASES for f in flag_sets}
    for _ in range(args.repeats):
        for case in CASES:
            for name, flags in flag_sets.items():
                env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
                out = subprocess.run([sys.executable, __file__, "--child", case], env=env, cwd=ROOT,
                                     capture_output=True, text=True, check=True).stdout
                runs[case, name].append(json.loads(out.strip().splitlines()[-1]))
    print(f"TEST_XLA_FLAGS = {TEST_XLA_FLAGS!r}\n")
    print("| step | flags | compile CPU | vs defaults | step time | vs defaults | loss at step 10 |\n|---|---|---|---|---|---|---|")
    for case in CASES:
        base = {k: statistics.median(r[k] for r in runs[case, "XLA defaults"]) for k in ("compile_cpu_s", "step_ms")}
        for name in flag_sets:
            med = {k: statistics.median(r[k] for r in runs[case, name]) for k in ("compile_cpu_s", "step_ms")}
            print(f"| {case} | {name} | {med['compile_cpu_s']:.2f} s | {med['compile_cpu_s'] / base['compile_cpu_s']:.2f}× "
                  f"| {med['step_ms']:.1f} ms | {med['step_ms'] / base['step_ms']:.2f}× | {runs[case, name][0]['loss']:.6f} |")


if __name__ == "__main__":
    main()
