"""python -m marin.status: jobs, Slurm reconciliation, closing the parent.

Slurm's accounting is stood in for by a `sacct` script on PATH (the states are what matters
here; the real cluster is exercised by the Slurm tests)."""
import os
import sys

import pytest
from mlflow import MlflowClient

from marin import status
from marin.track import record, tracker


def _fake_sacct(tmp_path, monkeypatch, states: dict, queued: dict | None = None):
    """`sacct` answering `states` and `squeue` answering `queued` (the jobs not started), on PATH."""
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    for name, table in (("sacct", states), ("squeue", queued or {})):
        lines = "".join(f"{job}|{state}\\n" for job, state in table.items())
        (folder / name).write_text(f"#!/bin/sh\nprintf '{lines}'\n")
        (folder / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")


def test_status_reconciles_slurm_and_closes_the_parent(store, multirun_job, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=router_ablation"])
    routers = ["qb", "softmax_aux", "bias_update"]
    recs = [record.create(*multirun_job(i, "sweep=router_ablation", f"router={r}")) for i, r in enumerate(routers)]
    client = MlflowClient(store["uri"])
    done = tracker.Tracker(recs[0])
    for step in range(1, 4):  # optimizer step n logs at n
        done.log_metrics({"train/loss": 5.0 - step}, step)
    done.finish("FINISHED")
    client.set_tag(recs[1].run_id, "slurm_job_id", "77_1")      # an older launcher's tag
    record.update_info(recs[1], slurm_jobs=["77_1"])            # as the Slurm launcher keeps it
    record.update_info(recs[2], slurm_jobs=["77_2"])            # or kept in record.json
    _fake_sacct(tmp_path, monkeypatch, {"77_1": "CANCELLED by 0", "77_2": "RUNNING"})

    sweep_dir = client.get_run(recs[0].run_id).data.tags["sweep_dir"]
    assert status.main([sweep_dir]) == 0   # from the run directories: Slurm's view shown, nothing written
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("router=")}
    assert rows["router=softmax_aux"][1:4] == ["FAILED", "77_1", "CANCELLED"]
    assert rows["router=bias_update"][1:4] == ["RUNNING", "77_2", "RUNNING"]
    assert client.get_run(recs[1].run_id).info.status == "RUNNING"
    assert status.main([sweep_dir, "--mlflow"]) == 0   # the store's view, reconciled
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("router=")}
    assert rows["router=qb"][1:4] == ["FINISHED", "-", "3/4"] and rows["router=qb"][4] == "2.0000"  # step 3 of 4
    assert rows["router=softmax_aux"][1:4] == ["FAILED", "77_1", "CANCELLED"]
    assert rows["router=bias_update"][1:4] == ["RUNNING", "77_2", "RUNNING"]
    assert client.get_run(recs[1].run_id).info.status == "FAILED"
    parent_id = client.get_run(recs[0].run_id).data.tags["mlflow.parentRunId"]
    assert client.get_run(parent_id).info.status == "RUNNING"

    assert client.get_run(recs[0].run_id).info.run_name == "router=qb"  # children named by their overrides
    assert status.main([f"{sweep_dir}/router=qb"]) == 0  # one job of the sweep, by its override name
    assert recs[0].run_id in capsys.readouterr().out.splitlines()[-1]

    _fake_sacct(tmp_path, monkeypatch, {"77_1": "CANCELLED", "77_2": "TIMEOUT"})
    assert status.main([parent_id, "--tracking-uri", store["uri"], "--mlflow"]) == 0
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
    assert "3 job(s) pending: not started" in out  # 4 swept values, one run made so far
    assert status.main([parent_id[:8], "--out-dir", str(store["out"])]) == 0  # a unique prefix of the parent's id
    assert parent_id in capsys.readouterr().out.splitlines()[0]


def test_status_errors(store, tmp_path, capsys):
    with pytest.raises(SystemExit, match="^2$"):
        status.main([str(tmp_path)])
    assert "neither a run directory (record.json) nor a sweep directory" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="^2$"):
        status.main(["0123456789abcdef0123456789abcdef", "--tracking-uri", store["uri"]])
    capsys.readouterr()
    with pytest.raises(SystemExit, match="^2$"):
        status.main(["no_such_sweep", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no_such_sweep: no sweep or run of that name" in err
    with pytest.raises(SystemExit, match="^2$"):  # was ": neither a run directory …" (the working directory)
        status.main([""])
    assert capsys.readouterr().err == "error: the run or sweep is empty: give its name, directory or id (none: every run)\n"
    with pytest.raises(SystemExit) as exit_:
        status.main(["--watch", "0"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--watch" in err


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


def _row(out: str, label: str) -> list[str]:
    return next(line.split() for line in out.splitlines() if line.startswith(label))


def test_no_argument_lists_recent_sweeps_and_runs_and_watch_refreshes(store, configure, multirun_job, monkeypatch,
                                                                     capsys, tmp_path):
    # An output folder of its own: the session store's other runs (one with a Slurm job) would add columns.
    out = tmp_path / "out"
    rec = record.create(*configure("run.name=listed", f"run.out_dir={out}"))  # before multirun_job makes this a multirun
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=lr_grid"])
    job = record.create(*multirun_job(0, "sweep=lr_grid", "optim.lr=1e-3", f"run.out_dir={out}"))
    client = MlflowClient(store["uri"])
    logged = tracker.Tracker(rec)  # into metrics.jsonl and record.json, and the store
    logged.log_metrics({"train/loss": 4.5, "eval/macro_loss": 4.75}, 2)
    logged.set_tags({"ended": "stopped at step 2 of 4 (train.stop_after)"})  # as the trainer says it
    logged.finish("FINISHED")

    for store_too in ([], ["--mlflow"]):  # from the run directories (the default), from the store
        assert status.main(["--out-dir", str(tmp_path / "out"), "--watch", "0.01", "--count", "2", *store_too]) == 0
        out = capsys.readouterr().out
        assert out.count("runs (python -m marin.status <run>") == 2  # printed twice, then it stopped
        assert _row(out, rec.run_dir.name)[1:] == ["STOPPED", "2/4", "4.5000", "4.7500", rec.run_id], store_too
        sweep_dir = client.get_run(job.run_id).data.tags["sweep_dir"]
        assert _row(out, f"  {sweep_dir.rsplit('/', 1)[-1]}")[1:4] == ["RUNNING", "0/4", "jobs"], store_too
        assert job.run_dir.name not in out  # a sweep's jobs are under `marin.status <sweep>`
    # the sweep's own header counts as its line in the list does (it said "1/4 jobs": runs made)
    listed = _row(out, f"  {sweep_dir.rsplit('/', 1)[-1]}")[2:5]
    assert status.main([sweep_dir]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.endswith(", " + " ".join(listed)) and listed == ["0/4", "jobs", "ended"], (header, listed)


def test_listing_and_a_runs_row_start_no_mlflow_or_jax(store, configure, multirun_job, monkeypatch, tmp_path):
    """The list, a sweep's table and one run's row come from the run directories: the process never
    imports MLflow (seconds of start-up) or JAX; --mlflow asks the store (benchmarks/tool_startup.py
    times them)."""
    import subprocess

    from tests.helpers import ROOT

    out = tmp_path / "out"
    rec = record.create(*configure("run.name=listed", f"run.out_dir={out}"))
    logged = tracker.Tracker(rec)
    logged.log_metrics({"train/loss": 4.5}, 4)
    logged.finish("FINISHED")
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=lr_grid"])
    job = record.create(*multirun_job(0, "sweep=lr_grid", "optim.lr=1e-3", f"run.out_dir={out}"))
    sweep_dir = MlflowClient(store["uri"]).get_run(job.run_id).data.tags["sweep_dir"]
    probe = ("import sys\nfrom marin import diff, lineage, status\n"
             f"status.main(['--out-dir', {str(out)!r}]); status.main([{str(rec.run_dir)!r}])\n"
             f"status.main([{sweep_dir!r}])\n"
             f"lineage.main([{str(rec.run_dir)!r}])\n"
             f"code = diff.main([{str(rec.run_dir)!r}, {str(rec.run_dir)!r}])\n"
             "print('imported:', sorted(m for m in ('mlflow', 'jax') if m in sys.modules), code)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "imported: [] 0", done.stdout
    assert "lr=1e-3  RUNNING" in done.stdout and "parent run " in done.stdout, done.stdout
    assert _row(done.stdout, rec.run_dir.name)[1:4] == ["FINISHED", "4/4", "4.5000"]


def test_one_run_by_id_prefix_and_a_pending_slurm_job(store, configure, monkeypatch, tmp_path, capsys):
    rec = record.create(*configure("run.name=queued"))
    record.update_info(rec, slurm_jobs=["88"])  # as the Slurm launcher keeps it at submit time
    _fake_sacct(tmp_path, monkeypatch, {}, queued={"88": "PENDING"})  # accounting lists it only once started
    assert status.main([rec.run_id[:10], "--out-dir", str(store["out"])]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"run {rec.run_dir}"
    assert _row(out, rec.run_dir.name)[1:4] == ["PENDING", "88", "PENDING"]


@pytest.mark.slurm
def test_a_queued_slurm_job_shows_pending(store, configure, capsys):
    """On the local cluster: a held job (submitted, not started) is PENDING in its run's row."""
    import subprocess

    rec = record.create(*configure("run.name=held"))
    job = subprocess.run(["sbatch", "--parsable", "--hold", "-o", "/dev/null", "--wrap", "true"],
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip().split(";")[0]
    try:
        record.update_info(rec, slurm_jobs=[job])
        assert status.main([str(rec.run_dir)]) == 0
        assert _row(capsys.readouterr().out, rec.run_dir.name)[1:4] == ["PENDING", job, "PENDING"]
    finally:
        subprocess.run(["scancel", job], timeout=60)
