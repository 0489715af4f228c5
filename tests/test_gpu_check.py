"""benchmarks/gpu.py, the GPU check, at toy size on this machine's CPU: every part runs and writes
its figures, so the command a GPU machine runs cannot rot between the times one is at hand."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_the_gpu_check_runs_every_part_at_toy_size(tmp_path):
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny", "--out", str(out),
                           "--budget-s", "400", "--rounds", "2"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    parts = json.loads((out / "gpu.json").read_text())["parts"]
    failed = {name: part for name, part in parts.items() if isinstance(part, dict) and ("error" in part or "skipped" in part)}
    assert not failed, failed
    assert set(parts) == {"env", "ceilings", "steps", "profile", "attention", "grouped"}

    steps = parts["steps"]
    assert [row["variant"] for row in steps] == ["base", "reference attention"]
    for row in steps:
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and row["step_ms"] > 0 and row["compile_s"] > 0
        assert row["plan_gib"] > 0
    # Each variant was composed with its own overrides (through Hydra) and ran the kernel it names.
    assert [row["resolved"]["attention.impl"] for row in steps] == ["blockwise", "reference"]

    profile = parts["profile"]["profile"]
    by_part = profile["by_part_ms"]
    # The model's scopes reach the HLO metadata: every part of the step is found by name.
    for part in ("attention", "routing", "dispatch", "expert GEMMs", "head and loss", "optimizer"):
        assert by_part.get(part, 0) > 0, (part, by_part)
    assert sum(by_part.values()) == pytest.approx(profile["kernel_ms"], rel=0.01)
    # Most of the step's instructions carry a part's name. (Not their time: at toy size on a shared
    # CPU one descheduled thread can hold a single kernel for longer than the whole step.)
    ops = profile["ops_by_part"]
    assert ops.get("other", 0) < 0.5 * sum(ops.values()), ops

    for kernel, result in parts["attention"]["results"].items():
        assert "error" not in result and result["ms"] > 0, (kernel, result)
        assert result["max_abs_diff"] < 0.05, (kernel, result)
    grouped = parts["grouped"]["results"]
    assert grouped["einsum (capacity 1.25)"]["flops_over_useful"] < 1.5
    assert grouped["ragged_dot (XLA)"]["flops_over_useful"] > 0

    report = (out / "gpu.md").read_text()
    for heading in ("## ceilings", "## steps", "## profile", "## attention", "## grouped"):
        assert heading in report
    assert "| micro | base | blockwise |" in report
