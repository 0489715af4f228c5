"""`resume=`: a stopped run continues in its own directory and MLflow run; a shortened horizon
is applied as the failure plan and recorded as a tag and a new config artifact (MLflow params
are immutable). The Slurm branch is exercised with the probe entry on the local cluster."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ["model=tiny", "train.steps=16", "train.seq_len=32", "train.global_batch=4", "train.eval_every=0",
        "train.eval_batches=1", "train.checkpoint.every_steps=3"]


def launch(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, env=env)


def run_dir_of(done) -> Path:
    match = re.search(r"run directory: (\S+)", done.stdout + done.stderr)
    assert match, done.stdout + done.stderr
    return Path(match.group(1))


@pytest.mark.slow
def test_stopped_local_run_resumes_with_a_shortened_horizon(tmp_path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    first = launch(*TINY, "train.stop_after=6", f"run.out_dir={tmp_path}", f"tracking.uri={uri}")
    assert first.returncode == 0, first.stderr[-3000:]
    run_dir = run_dir_of(first)
    run_id = json.loads((run_dir / "record.json").read_text())["run_id"]

    dry = launch(f"resume={run_dir}", "schedule.horizon_steps=12", "dry_run=true")
    assert dry.returncode == 0, dry.stderr[-3000:]
    assert "newest checkpoint: step 6" in dry.stdout and "schedule.horizon_steps: None → 12" in dry.stdout
    assert "resumes" not in json.loads((run_dir / "record.json").read_text())  # a dry run changes nothing

    second = launch(f"resume={run_dir}", "train.stop_after=null", "schedule.horizon_steps=12")
    assert second.returncode == 0, second.stderr[-3000:]
    assert f"resuming run {run_id} in {run_dir}" in second.stdout
    assert "schedule.horizon_from_step: None → 6" in second.stdout      # the failure plan, from the checkpoint

    info = json.loads((run_dir / "record.json").read_text())
    assert info["resumes"][0]["changes"]["schedule.horizon_steps"] == [None, 12]
    assert (run_dir / "resolved.resume-1.yaml").is_file()
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert "schedule.horizon_steps: None → 12" in run.data.tags["resume_1"] and run.data.tags["horizon_steps"] == "12"
    assert run.data.params["schedule.horizon_steps"] == "None"            # params stay as first logged
    assert "record/resolved.resume-1.yaml" in [a.path for a in client.list_artifacts(run_id, "record")]
    steps = sorted({m.step for m in client.get_metric_history(run_id, "train/loss")})
    assert steps == list(range(12))                                        # 0..5, then 6..11: one run, no gap
    assert run.info.status == "FINISHED"
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.slurm
@pytest.mark.slow
def test_slurm_run_resumes_in_the_same_directory(tmp_path, tracking_uri):
    import os

    env = {**os.environ, "MARIN_SLURM_ENTRY": "tests.launch.slurm_entries:probe"}
    first = launch("hardware=slurm_cpu", "model=tiny", "wait=true", f"run.out_dir={tmp_path}",
                   f"tracking.uri={tracking_uri}", env=env)
    assert first.returncode == 0, first.stdout + first.stderr[-3000:]
    run_dir = run_dir_of(first)
    (run_dir / "probe-0.json").unlink()
    again = launch(f"resume={run_dir}", "wait=true", env=env)
    assert again.returncode == 0, again.stdout + again.stderr[-3000:]
    assert run_dir_of(again) == run_dir and (run_dir / "probe-0.json").is_file()
    assert len(json.loads((run_dir / "record.json").read_text())["slurm_jobs"]) == 2
