"""Test helpers: compose a config exactly as launch.py does (Hydra's compose API)."""
from __future__ import annotations

from marin.config.store import compose
from marin.launch.checks import load


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
