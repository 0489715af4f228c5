"""Sweeps in MLflow: one parent per launch, a child per job, the parent closed by the last job.
(`multirun_job` runs a job's record creation as Hydra's basic launcher would: see conftest.)"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from marin.config.store import PROJECT_ROOT
from marin.track import record, sweep, tracker


def _launch(multirun_job, monkeypatch, lrs):
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=lr_grid", "model=tiny"])
    return [record.create(*multirun_job(i, "sweep=lr_grid", f"optim.lr={lr}")) for i, lr in enumerate(lrs)]


def test_one_parent_per_launch_and_a_child_per_job(store, multirun_job, monkeypatch):
    lrs = [0.001, 0.003, 0.01, 0.03]
    first = _launch(multirun_job, monkeypatch, lrs)
    second = _launch(multirun_job, monkeypatch, lrs[:1])
    client = MlflowClient(store["uri"])
    runs = [client.get_run(r.run_id) for r in first]
    parent_ids = {r.data.tags["mlflow.parentRunId"] for r in runs}
    assert len(parent_ids) == 1
    parent = client.get_run(parent_ids.pop())
    assert parent.data.tags["sweep_role"] == "parent" and parent.data.tags["sweep"] == "lr_grid"
    assert parent.data.tags["expected_jobs"] == "4"
    assert [json.loads(r.data.tags["sweep_overrides"]) for r in runs] == [[f"optim.lr={lr}"] for lr in lrs]
    assert client.get_run(second[0].run_id).data.tags["mlflow.parentRunId"] != parent.info.run_id  # new launch

    sweep_dir = runs[0].data.tags["sweep_dir"]
    info = json.loads((Path(sweep_dir) / "sweep.json").read_text())
    assert info["parent_run_id"] == parent.info.run_id
    assert len((Path(sweep_dir) / "jobs.jsonl").read_text().splitlines()) == 4

    for i, rec in enumerate(first):   # the parent ends with its last job
        assert client.get_run(parent.info.run_id).info.status == "RUNNING"
        tracker.Tracker(rec).finish("FINISHED" if i < 3 else "FAILED")
    assert client.get_run(parent.info.run_id).info.status == "FAILED"


def test_explicit_sweep_id_joins_an_existing_parent(store, multirun_job, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["launch.py"])
    a = record.create(*multirun_job(0, "sweep=capacity_factor", "run.sweep_id=joined"))
    b = record.create(*multirun_job(0, "sweep=capacity_factor", "run.sweep_id=joined"))
    client = MlflowClient(store["uri"])
    parents = {client.get_run(r.run_id).data.tags["mlflow.parentRunId"] for r in (a, b)}
    assert len(parents) == 1


def test_sqlite_store_refused_for_a_slurm_sweep(store, multirun_job, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=lr_grid"])
    job = multirun_job(0, "sweep=lr_grid", "hardware=slurm_cpu", "run.name=sqlite-slurm")
    with pytest.raises(sweep.SweepError, match="one writer at a time.*tracking.uri=http"):
        record.create(*job)
    assert not list(store["out"].glob("runs/sqlite-slurm-*"))


def _launch_py(*args):
    return subprocess.run([sys.executable, "launch.py", *args], cwd=PROJECT_ROOT, capture_output=True,
                          text=True, timeout=300)


def test_every_sweep_composes_as_a_dry_run():
    done = _launch_py("-m", "sweep=lr_grid", "train.steps=2", "model=tiny", "dry_run=json")
    assert done.returncode == 0, done.stderr[-2000:]
    decoder, text, plans = json.JSONDecoder(), done.stdout.strip(), []
    while text:   # one JSON plan per job
        plan, end = decoder.raw_decode(text)
        plans.append(plan)
        text = text[end:].strip()
    assert len(plans) == 4
    done = _launch_py("-m", "sweep=ladder_cpu", "dry_run=true")
    assert done.returncode == 0, done.stderr[-2000:]
    shapes = [line.split("layers")[1].split("(")[0].strip() for line in done.stdout.splitlines() if "width × layers" in line]
    assert shapes == ["64 × 2", "96 × 3", "128 × 4"]


def test_sweep_typos_fail_before_any_job():
    done = _launch_py("-m", "sweep=lr_gird", "dry_run=true")
    assert done.returncode != 0 and "Could not find 'sweep/lr_gird'" in done.stderr
    done = _launch_py("-m", "sweep=lr_grid", "optim.lrr=1,2", "dry_run=true")
    assert done.returncode != 0 and "lrr" in done.stderr and "#0" not in done.stderr


def test_every_job_of_every_sweep_validates():
    import itertools

    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    from marin.config.store import SWEEPS_DIR, options
    from tests.helpers import make_config

    parser = OverridesParser.create()
    for name in options("sweep"):
        params = OmegaConf.load(SWEEPS_DIR / f"{name}.yaml").hydra.sweeper.params
        swept = [parser.parse_override(f"{k}={v}") for k, v in params.items()]
        grid = [[f"{o.key_or_group}={v}" for v in o.sweep_string_iterator()] for o in swept]
        for job in itertools.product(*grid):
            cfg = make_config(f"sweep={name}", "model=tiny", *job)
            assert cfg.run.sweep == name
