"""Reproducing a finished run from its record (no overrides) gives bitwise-identical losses on CPU."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.helpers import new_store

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=micro", "train.steps=8", "train.seq_len=32", "train.global_batch=4", "train.eval_every=0",
        "train.eval_batches=1"]


def launch(*args):
    done = subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return re.search(r"mlflow run: (\w+)", done.stderr).group(1), re.search(r"run directory: (\S+)", done.stderr).group(1)


def losses(client, run_id):
    return [m.value for m in sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)]


@pytest.mark.slow
def test_reproduced_run_has_bitwise_identical_losses(tmp_path):
    uri = new_store(tmp_path)
    first_id, first_dir = launch(*TINY, "train.seed=3", f"run.out_dir={tmp_path}", f"tracking.uri={uri}")
    again_id, again_dir = launch(f"reproduce={first_dir}", f"tracking.uri={uri}", f"run.out_dir={tmp_path}")
    assert again_dir != first_dir  # a new run, never the old directory
    client = MlflowClient(uri)
    original, reproduced = losses(client, first_id), losses(client, again_id)
    assert len(original) == 8 and original == reproduced  # exact float equality
    tags = client.get_run(again_id).data.tags
    assert tags["reproduced_from"] == first_id
    assert client.get_run(again_id).data.params["train.seed"] == "3"
