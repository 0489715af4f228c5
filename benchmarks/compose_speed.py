"""Composing and printing a config must not cost more than a bare Hydra app (target ≤ 1.5×).

Runs, alternately in one session, `python launch.py --cfg job`, `python launch.py dry_run=json`
(compose + validate + plan) and a bare Hydra app that prints its config, N times each, and
reports the median times and their ratios. Also checks that neither launch.py command imports JAX.

    python benchmarks/compose_speed.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

BARE_APP = '''
import hydra
from omegaconf import DictConfig, OmegaConf

@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg: DictConfig) -> None:
    print(OmegaConf.to_yaml(cfg))

if __name__ == "__main__":
    main()
'''


def timed(cmd: list[str], cwd: Path) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, check=True, capture_output=True)
    return time.perf_counter() - start


def imports_jax(args: list[str]) -> bool:
    probe = ("import atexit, runpy, sys; sys.argv = ['launch.py', *sys.argv[1:]]\n"
             "atexit.register(lambda: print('JAX_IMPORTED' if 'jax' in sys.modules else 'NO_JAX', file=sys.stderr))\n"
             "runpy.run_path('launch.py', run_name='__main__')\n")  # launch.py ends the process itself
    out = subprocess.run([sys.executable, "-c", probe, *args], cwd=ROOT, capture_output=True, text=True)
    return "JAX_IMPORTED" in out.stderr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp, "bare_app.py")
        bare.write_text(BARE_APP)
        commands = {
            "bare hydra app --cfg job": ([sys.executable, str(bare), "--cfg", "job", "+x=1"], Path(tmp)),
            "launch.py --cfg job": ([sys.executable, "launch.py", "--cfg", "job"], ROOT),
            "launch.py dry_run=json": ([sys.executable, "launch.py", "dry_run=json"], ROOT),
        }
        times = {name: [] for name in commands}
        for _ in range(args.repeats):  # interleaved, so machine noise hits all alike
            for name, (cmd, cwd) in commands.items():
                times[name].append(timed(cmd, cwd))
    base = statistics.median(times["bare hydra app --cfg job"])
    print(f"{'command':28s} {'median s':>9s} {'vs bare':>8s}")
    for name, values in times.items():
        print(f"{name:28s} {statistics.median(values):9.3f} {statistics.median(values) / base:7.2f}×")
    for cmd in (["--cfg", "job"], ["dry_run=json"]):
        print(f"launch.py {' '.join(cmd)} imports jax: {imports_jax(cmd)}")


if __name__ == "__main__":
    main()
