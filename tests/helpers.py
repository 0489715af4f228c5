"""Test helpers: compose a config exactly as launch.py does (Hydra's compose API)."""
from __future__ import annotations

import os
from pathlib import Path

from marin.config.store import compose
from marin.launch.checks import load
from marin.launch.distributed import FORCED_DEVICES_FLAG

ROOT = Path(__file__).resolve().parents[1]
# The suite's own XLA flag (tests/conftest.py puts it in XLA_FLAGS; marin passes the environment's
# XLA_FLAGS on to every process of a run): LLVM at -O0 halves a tiny train step's compile, which is
# most of the suite's CPU, and slows its few steps about 3x (benchmarks/test_flags.py).
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"


def compose_dict(*overrides: str):
    return compose(overrides)


def make_config(*overrides: str):
    """The resolved `Config` for these overrides (validation included)."""
    return load(compose_dict(*overrides))[1]


def fake_run_dir(out_dir, resolved_yaml: str, name: str = "probe") -> str:
    """A run directory under `out_dir/runs/` as record.create leaves it (record.json, the saved
    configs), with no training behind it, for tools that only look a run up; returns its run id."""
    import json

    run_dir = out_dir / "runs" / f"{name}-0a0a0a0a-20261201-100000-abcdef"
    run_dir.mkdir(parents=True)
    run_id = "a1b2c3d4" * 4
    (run_dir / "record.json").write_text(json.dumps({"run_id": run_id, "tracking_uri": "sqlite:///x",
                                                     "experiment": "default"}))
    (run_dir / "composed.yaml").write_text(f"run: {{name: {name}}}\n")
    (run_dir / "resolved.yaml").write_text(resolved_yaml)
    return run_id


def subprocess_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """The environment of a `python -m tests.…` child that forces `devices` host devices."""
    flags = TEST_XLA_FLAGS + (f" {FORCED_DEVICES_FLAG}={devices}" if devices > 1 else "")
    return dict(os.environ, XLA_FLAGS=flags, PJRT_NPROC=str(max(16, 2 * devices)), JAX_PLATFORMS="cpu",
                PYTHONPATH=str(ROOT), **extra)
