"""The run tools start fast: `marin.status`, `marin.diff` and `marin.lineage` list from the run
directories without importing MLflow or JAX (target ≤ 1.5 s each on the CI-kind machine).

Makes an output folder with two runs (their real composed and resolved configs, 200 steps of
metrics.jsonl each, no MLflow store), then runs, interleaved N times, `python -c pass`,
`python -c "import mlflow"` (what the tools no longer pay) and each tool, and reports medians and
the difference to `python -c pass`. Also reports which of mlflow / jax each tool's process imported.

    python benchmarks/tool_startup.py [--repeats 5]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
STEPS = 200  # model=tiny's train.steps: the runs ended where they were meant to


def make_run(out: Path, name: str, overrides: list[str]) -> Path:
    """A run directory as record.create leaves it and a finished run's metrics, without a store."""
    from marin.config.store import compose
    from marin.config.validate import load
    from marin.track import record

    composed, resolved = load(compose(["model=tiny", f"run.name={name}", *overrides]))
    run_dir = out / "runs" / f"{name}-0a0a0a0a-20261201-100000-{name[:6]}"
    run_dir.mkdir(parents=True)
    (run_dir / "record.json").write_text(json.dumps({"run_id": (name * 32)[:32], "tracking_uri": f"sqlite:///{out}/none.db",
                                                     "experiment": "default", "status": "FINISHED"}))
    (run_dir / "composed.yaml").write_text(record.to_yaml(record.config_dict(composed)))
    (run_dir / "resolved.yaml").write_text(record.to_yaml(record.config_dict(resolved)))
    with (run_dir / "metrics.jsonl").open("w") as f:
        for step in range(1, STEPS + 1):
            for key in ("train/loss", "train/tokens_per_s", "train/mfu", "optim/lr/adam"):
                f.write(json.dumps({"key": key, "value": 1.0 / step, "step": step, "timestamp": 0}) + "\n")
    return run_dir


def timed(cmd: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, capture_output=True, check=False)
    return time.perf_counter() - start


def imported(module: str, argv: list[str]) -> list[str]:
    probe = ("import runpy, sys\ntry:\n    runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)\n"
             "except SystemExit:\n    pass\n"
             "import json\nprint('IMPORTED', json.dumps([m for m in ('mlflow', 'jax') if m in sys.modules]), file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe, module, *argv], cwd=ROOT, capture_output=True, text=True)
    line = [x for x in done.stderr.splitlines() if x.startswith("IMPORTED")]
    return json.loads(line[-1].split(" ", 1)[1]) if line else ["?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        a = make_run(out, "alpha", [])
        b = make_run(out, "beta", ["optim.lr=0.004"])
        py = sys.executable
        tools = {
            "marin.status (list)": ["marin.status", "--out-dir", str(out)],
            "marin.status <run>": ["marin.status", str(a)],
            "marin.diff A B": ["marin.diff", str(a), str(b)],
            "marin.lineage <run>": ["marin.lineage", str(a), "--metric", "train/loss"],
        }
        commands = {"python -c pass": [py, "-c", "pass"], "python -c 'import mlflow'": [py, "-c", "import mlflow"],
                    **{name: [py, "-m", *argv] for name, argv in tools.items()}}
        times = {name: [] for name in commands}
        for _ in range(args.repeats):  # interleaved, so machine noise hits all alike
            for name, cmd in commands.items():
                times[name].append(timed(cmd))
        base = statistics.median(times["python -c pass"])
        print(f"{'command':28s} {'median s':>9s} {'- pass s':>9s}  imports")
        for name, values in times.items():
            median = statistics.median(values)
            what = ", ".join(imported(tools[name][0], tools[name][1:])) or "neither mlflow nor jax" if name in tools else ""
            print(f"{name:28s} {median:9.3f} {median - base:9.3f}  {what}")


if __name__ == "__main__":
    main()
