"""Time to a finished short run: `python launch.py model=tiny train.steps=5` against a hand-written
JAX loop training the same model the same 5 steps (same model code, same batches, plain jit, no
MLflow, no Hydra, the same persistent compilation cache). Target: ≤ 1.5×.

    python benchmarks/startup.py [--pairs 3] [--steps 5]

Both are run once first to warm the compilation cache and the data cache; then PAIRS pairs,
alternating which goes first, each timed as a whole fresh process (wall clock, imports
included). The machine is shared and noisy, hence per-pair ratios and their median.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The baseline: the library's model, loss and optimizer, in a plain jit loop.
PLAIN = r"""
import sys, time
sys.path.insert(0, {root!r})
import jax
from marin.config.store import compose
from marin.launch.checks import load
from marin.data.loader import Loader
from marin.optim import build_optimizer
from marin.train.state import init_state
from marin.train.step import make_train_step
from marin.model.mesh import make_mesh
from marin.train.trainer import enable_compilation_cache

cfg = load(compose({overrides!r}))[1]
enable_compilation_cache(cfg)
tx = build_optimizer(cfg)
state = jax.jit(lambda k: init_state(cfg, tx, k))(jax.random.key(cfg.train.seed))
step = jax.jit(make_train_step(cfg, tx, make_mesh(cfg)), donate_argnums=0)
loader = Loader(cfg, progress=False)
keys = ("inputs", "targets", "segment_ids", "loss_mask")
for i in range(cfg.train.steps):
    state, metrics = step(state, {{k: v for k, v in loader.batch(i).items() if k in keys}})
print(float(metrics["loss"]))
"""


def timed(cmd: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"{' '.join(cmd[:3])} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()

    out = Path(tempfile.mkdtemp(prefix="marin-startup-"))
    overrides = ["model=tiny", f"train.steps={args.steps}", f"run.out_dir={out}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MARIN_JAX_CACHE=str(out / "jax-cache"))
    script = out / "plain.py"
    script.write_text(PLAIN.format(root=str(ROOT), overrides=overrides))
    launch = [sys.executable, "launch.py", *overrides]
    plain = [sys.executable, str(script)]

    timed(launch, env), timed(plain, env)  # warm both caches
    ratios = []
    for i in range(args.pairs):
        first, second = (launch, plain) if i % 2 == 0 else (plain, launch)
        a, b = timed(first, env), timed(second, env)
        t_launch, t_plain = (a, b) if first is launch else (b, a)
        ratios.append(t_launch / t_plain)
        print(f"pair {i + 1}: launch.py {t_launch:.1f} s, plain JAX {t_plain:.1f} s, ratio {ratios[-1]:.2f}")
    print(f"median ratio launch.py / plain JAX over {args.pairs} pairs: {statistics.median(ratios):.2f} (target ≤ 1.5)")


if __name__ == "__main__":
    main()
