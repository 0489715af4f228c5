"""python -m marin.status: jobs, Slurm reconciliation, closing the parent.

Slurm's accounting is stood in for by a `sacct` script on PATH (the states are what matters
here; the real cluster is exercised by the Slurm tests)."""
import os
import sys

import pytest

from mlflow import MlflowClient

from marin import status
from marin.track import record, tracker


def _fake_sacct(tmp_path, monkeypatch, states: dict):
    script = tmp_path / "bin" / "sacct"
    script.parent.mkdir(exist_ok=True)
    lines = "\\n".join(f"{job}|{state}" for job, state in states.items())
    script.write_text(f"#!/bin/sh\nprintf '{lines}\\n'\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{script.parent}:{os.environ['PATH']}")


def test_status_reconciles_slurm_and_closes_the_parent(store, multirun_job, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=router_ablation"])
    routers = ["qb", "softmax_aux", "bias_update"]
    recs = [record.create(*multirun_job(i, "sweep=router_ablation", f"router={r}")) for i, r in enumerate(routers)]
    client = MlflowClient(store["uri"])
    done = tracker.Tracker(recs[0])
    for step in range(1, 4):  # optimizer step n logs at n
        done.log_metrics({"train/loss": 5.0 - step}, step)
    done.finish("FINISHED")
    client.set_tag(recs[1].run_id, "slurm_job_id", "77_1")      # set by the Slurm launcher
    record.update_info(recs[2], slurm_jobs=["77_2"])            # or kept in record.json
    _fake_sacct(tmp_path, monkeypatch, {"77_1": "CANCELLED by 0", "77_2": "RUNNING"})

    sweep_dir = client.get_run(recs[0].run_id).data.tags["sweep_dir"]
    assert status.main([sweep_dir]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("router=")}
    assert rows["router=qb"][1:4] == ["FINISHED", "-", "3/4"] and rows["router=qb"][4] == "2.0000"  # step 3 of 4
    assert rows["router=softmax_aux"][1:4] == ["FAILED", "77_1", "CANCELLED"]
    assert rows["router=bias_update"][1:4] == ["RUNNING", "77_2", "RUNNING"]
    assert client.get_run(recs[1].run_id).info.status == "FAILED"
    parent_id = client.get_run(recs[0].run_id).data.tags["mlflow.parentRunId"]
    assert client.get_run(parent_id).info.status == "RUNNING"

    assert client.get_run(recs[0].run_id).info.run_name == "router=qb"  # children named by their overrides

    _fake_sacct(tmp_path, monkeypatch, {"77_1": "CANCELLED", "77_2": "TIMEOUT"})
    assert status.main([parent_id, "--tracking-uri", store["uri"]]) == 0
    assert "parent run closed FAILED" in capsys.readouterr().out
    assert client.get_run(parent_id).info.status == "FAILED"


def test_status_finds_a_sweep_by_name(store, multirun_job, monkeypatch, capsys):
    """`marin.status lr_grid` opens the newest sweep of that name (sweeps/lr_grid-<id>)."""
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=capacity_factor"])
    rec = record.create(*multirun_job(0, "sweep=capacity_factor", "model.capacity_factor=2.0"))
    parent_id = MlflowClient(store["uri"]).get_run(rec.run_id).data.tags["mlflow.parentRunId"]
    assert status.main(["capacity_factor", "--out-dir", str(store["out"])]) == 0
    out = capsys.readouterr().out
    assert parent_id in out.splitlines()[0] and "capacity_factor=2.0" in out


def test_status_errors(store, tmp_path, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        status.main([str(tmp_path)])
    assert "not a sweep directory" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="^2$"):
        status.main(["0123456789abcdef0123456789abcdef", "--tracking-uri", store["uri"]])
    capsys.readouterr()
    with pytest.raises(SystemExit, match="^2$"):
        status.main(["no_such_sweep", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no sweep of that name" in err
    with pytest.raises(SystemExit) as exit_:
        status.main([])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "required: sweep" in err


def test_run_tools_usage_errors_are_one_line(tmp_path, capsys):
    from marin import diff, forecast

    for main, argv in ((diff.main, []), (forecast.main, ["some_sweep"]), (status.main, ["a", "--bogus"])):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    with pytest.raises(SystemExit, match="^2$"):
        diff.main([str(tmp_path / "a"), str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such run directory" in err
