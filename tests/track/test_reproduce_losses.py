"""Reproducing a finished run from its record (no overrides) gives bitwise-identical losses on CPU."""
import json

import pytest
from mlflow import MlflowClient

from tests.helpers import launch_here, new_store

TINY = ["model=micro", "train.steps=8", "train.seq_len=32", "train.global_batch=4", "train.eval_every=0",
        "train.eval_batches=1"]


def launch(out, *args):
    """`launch.py <args>` (in this process) that makes one new run under `out`: (its MLflow run id, its directory)."""
    before = set((out / "runs").glob("*"))
    assert launch_here(*args) == 0
    [run_dir] = set((out / "runs").glob("*")) - before
    return json.loads((run_dir / "record.json").read_text())["run_id"], run_dir


def losses(client, run_id):
    return [m.value for m in sorted(client.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)]


@pytest.mark.slow
def test_reproduced_run_has_bitwise_identical_losses(tmp_path):
    uri = new_store(tmp_path)
    first_id, first_dir = launch(tmp_path, *TINY, "train.seed=3", f"run.out_dir={tmp_path}", f"tracking.uri={uri}")
    again_id, again_dir = launch(tmp_path, f"reproduce={first_dir}", f"tracking.uri={uri}", f"run.out_dir={tmp_path}")
    assert again_dir != first_dir  # a new run, never the old directory
    client = MlflowClient(uri)
    original, reproduced = losses(client, first_id), losses(client, again_id)
    assert len(original) == 8 and original == reproduced  # exact float equality
    tags = client.get_run(again_id).data.tags
    assert tags["reproduced_from"] == first_id
    assert client.get_run(again_id).data.params["train.seed"] == "3"
