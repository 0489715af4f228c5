"""A run with one 120 KB override value against the same run without it (issue 42's probe).

    python benchmarks/big_override.py [--pairs 2] [--steps 30] [--size 120000] [--project DIR]

Runs `launch.py train.steps=STEPS` with and without `+hardware.env.MARIN_NOTE=<SIZE characters>` (a free-text
field: it reaches argv, the overrides, record.json and MLflow's tags), PAIRS pairs, alternating
which goes first, each a fresh process against its own store. Per run: the wall clock, and the
training rate (steps/s between the first and the last train/loss of metrics.jsonl, which a stall
waiting on the MLflow run also lowers). Then, in this process, `secrets.mask` of a record.json
with the value against one without. `--project` runs another checkout's launch.py (this
project's .venv): the figures before a change. The machine is shared and noisy: ratios within
one run, never a timed assertion.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(project: Path, out: Path, steps: int, extra: list[str]) -> tuple[float, float]:
    """(wall seconds, steps/s between the first and last logged train/loss)."""
    cmd = [sys.executable, "launch.py", f"train.steps={steps}", f"run.out_dir={out}", "tracking.report=false",
           "tracking.system_metrics=false", *extra]
    env = dict(os.environ, PYTHONPATH=str(project))
    env.pop("MLFLOW_TRACKING_URI", None)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"launch.py failed ({done.returncode}):\n{done.stderr[-2000:]}")
    [metrics] = list(out.glob("runs/*/metrics.jsonl"))
    losses = [json.loads(line) for line in metrics.read_text().splitlines() if '"train/loss"' in line]
    first, last = losses[0], losses[-1]
    return wall, (last["step"] - first["step"]) / max((last["timestamp"] - first["timestamp"]) / 1000, 1e-9)


def mask_cost(project: Path, size: int, repeats: int = 3) -> tuple[float, float]:
    """Microseconds per KB to mask a record.json-like text (argv, overrides, the store's
    sqlite:/// URI) with the big value, and without it: equal when masking is linear."""
    sys.path.insert(0, str(project))
    from marin.track import secrets

    def text(value: str) -> str:
        return json.dumps({"tracking_uri": "sqlite:////tmp/mlflow.db", "argv": ["launch.py", f"+hardware.env.MARIN_NOTE={value}"],
                          "overrides": [f"+hardware.env.MARIN_NOTE={value}"]}, indent=2)

    def best(t: str) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            secrets.mask(t)
            times.append(time.perf_counter() - t0)
        return min(times)

    big, small = text("x" * size), text("x" * 8)
    return best(big) * 1e6 / (len(big) / 1024), best(small) * 1e6 / (len(small) / 1024)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--size", type=int, default=120_000)
    p.add_argument("--project", type=Path, default=ROOT, help="the checkout whose launch.py runs (default: this one)")
    p.add_argument("--skip-runs", action="store_true", help="only the in-process masking figure")
    args = p.parse_args()
    big = [f"+hardware.env.MARIN_NOTE={'x' * args.size}"]
    if not args.skip_runs:
        results: dict[str, list[tuple[float, float]]] = {"plain": [], "big": []}
        with tempfile.TemporaryDirectory() as tmp:
            run(args.project, Path(tmp) / "warm", args.steps, [])  # the compilation cache
            for pair in range(args.pairs):
                order = ["plain", "big"] if pair % 2 == 0 else ["big", "plain"]
                for which in order:
                    out = Path(tmp) / f"{which}-{pair}"
                    results[which].append(run(args.project, out, args.steps, big if which == "big" else []))
                    print(f"pair {pair} {which:5s}: {results[which][-1][0]:6.1f} s wall, "
                          f"{results[which][-1][1]:5.2f} steps/s", flush=True)
        for i, name in ((0, "wall s"), (1, "steps/s")):
            plain = statistics.median(r[i] for r in results["plain"])
            with_big = statistics.median(r[i] for r in results["big"])
            ratio = statistics.median(b[i] / a[i] for a, b in zip(results["plain"], results["big"]))
            print(f"{name:8s} median: without {plain:7.2f}, with a {args.size:,}-character override "
                  f"{with_big:7.2f}; with / without, median of the pairs: {ratio:.2f}×")
    with_big, without = mask_cost(args.project, args.size)
    print(f"secrets.mask of a record.json: {with_big:,.1f} µs/KB with the override, {without:,.1f} µs/KB "
          f"without ({with_big / without:.1f}×)")


if __name__ == "__main__":
    main()
