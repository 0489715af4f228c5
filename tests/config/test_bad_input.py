"""Bad input: one clear message naming the field, a non-zero exit, no traceback, nothing written.

These run `launch.py` as a user would, in an empty working directory with the output folder
pointed inside it, and then check that the directory is still empty (Hydra's own output folder
included) and that no MLflow store was created.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CASES = [
    # (overrides, text that must appear in the message)
    (["model=nope"], "model/nope"),
    (["hardware=nope"], "hardware/nope"),
    (["experiment=nope"], "experiment/nope"),
    (["model.hiden=3"], "hiden"),
    (["train.steps=abc"], "train.steps"),
    (["attention.num_heads=7"], "attention.num_heads"),
    (["router.top_k=9"], "router.top_k"),
    (["model.num_experts=0"], "model.num_experts"),
    (["optim.lr=-0.1"], "optim.lr"),
    (["optim.decay=[{pattern: attn/gate, value: 0.1}, {pattern: nope, value: 0.1}]"], "optim.decay[1].pattern"),
    (["optim.ns_dtype=float16"], "optim.ns_dtype"),
    (["optim=muonh", "optim.offload=true", "optim.grad_clip=1.0"], "optim.grad_clip"),
    (["run.name=../../escaped"], "run.name: must be a plain folder name"),
    (["data.sources.0.weights=[0]", "data.sources.1.weights=[0]"], "all zero"),
    (["data.sources.0.kind=text", "data.sources.0.paths=[/nonexistent/corpus.txt]"], "data.sources[0]"),
]


@pytest.mark.parametrize("overrides,needle", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_input_is_rejected_before_anything_is_written(tmp_path, overrides, needle):
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["HYDRA_FULL_ERROR"] = "0"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), *overrides, f"run.out_dir={tmp_path / 'out'}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == [], "something was written before validation failed"


def test_a_context_extension_stage_needs_its_starting_checkpoint():
    from marin.config.validate import ConfigError, load
    from tests.helpers import compose_dict

    with pytest.raises(ConfigError, match="train.init_from"):
        load(compose_dict("train.init_seq_len=64", "train.seq_len=256"))
    load(compose_dict("train.init_seq_len=64", "train.seq_len=256", "dry_run=true"))  # a plan needs none
