"""The tracker against a real sqlite store; a tracking server that goes away."""
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow import MlflowClient

from marin.track import record, tracker
from marin.track.record import RunRecord

ROOT = Path(__file__).resolve().parents[2]


def test_metrics_tags_text_artifacts_read_back(configure, store, tmp_path):
    rec = record.create(*configure("run.name=trk"))
    (tmp_path / "plan.txt").write_text("the plan")
    with tracker.Tracker(rec) as t:
        for step in range(5):
            t.log_metrics({"train/loss": 5.0 - step, "lr": 1e-3}, step=step)
        t.set_tags({"phase": "pretrain", "WANDB_API_KEY": "hunter2"})
        t.log_text("summary.txt", "done")
        t.log_artifact(tmp_path / "plan.txt")
    client = MlflowClient(store["uri"])
    history = client.get_metric_history(rec.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 5.0 - s) for s in range(5)]
    run = client.get_run(rec.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["phase"] == "pretrain" and run.data.tags["WANDB_API_KEY"] != "hunter2"
    names = {a.path for a in client.list_artifacts(rec.run_id)}
    assert {"summary.txt", "plan.txt"} <= names
    assert rec.info()["status"] == "FINISHED"


def test_exception_finishes_failed_and_other_processes_log_nothing(configure, store):
    rec = record.create(*configure("run.name=trk-fail"))
    tracker.Tracker(rec, process_index=1).log_metrics({"loss": 1.0}, step=0)
    with pytest.raises(ZeroDivisionError):
        with tracker.Tracker(rec, process_index=0) as t:
            1 / 0
    client = MlflowClient(store["uri"])
    assert client.get_run(rec.run_id).info.status == "FAILED"
    assert client.get_metric_history(rec.run_id, "loss") == []
    with pytest.raises(ValueError, match="status must be one of"):
        t.finish("DONE")


def test_unreachable_store_keeps_metrics_and_sends_them_later(configure, store, caplog):
    real = record.create(*configure("run.name=trk-away"))
    away = RunRecord(real.run_dir, real.run_id, "http://127.0.0.1:9", real.experiment_name)
    t = tracker.Tracker(away, flush_every_s=0.0)
    with caplog.at_level(logging.WARNING, logger="marin.track"):
        for step in range(3):
            t.log_metrics({"train/loss": float(step)}, step=step)   # training goes on
    assert sum("does not answer" in r.message for r in caplog.records) == 1  # warned once
    t.finish("FINISHED")
    spilled = (real.run_dir / tracker.UNSENT).read_text().splitlines()
    assert [json.loads(line)["step"] for line in spilled] == [0, 1, 2]
    assert tracker.send_unsent(real) == 3
    assert MlflowClient(store["uri"]).get_run(real.run_id).info.status == "FINISHED"  # sent with them
    history = MlflowClient(store["uri"]).get_metric_history(real.run_id, "train/loss")
    assert sorted(m.step for m in history) == [0, 1, 2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(db, artifacts, port):
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{db}",
                             "--default-artifact-root", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    for _ in range(120):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    pytest.skip("mlflow server did not start")


def _stop(proc):
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


@pytest.mark.slow
def test_server_restart_during_training_loses_no_metric(configure, tmp_path):
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    proc = _server(tmp_path / "db.sqlite", tmp_path / "art", port)
    try:
        rec = record.create(*configure("run.name=restart", f"tracking.uri={uri}"))
        t = tracker.Tracker(rec, flush_every_s=0.0)
        t.log_metrics({"loss": 0.0}, step=0)
        _stop(proc)
        t.log_metrics({"loss": 1.0}, step=1)   # server away: kept
        proc = _server(tmp_path / "db.sqlite", tmp_path / "art", port)
        t._retry_at = 0.0                      # do not wait out the back-off in a test
        t.log_metrics({"loss": 2.0}, step=2)
        t.finish("FINISHED")
        history = MlflowClient(uri).get_metric_history(rec.run_id, "loss")
        assert sorted(m.step for m in history) == [0, 1, 2]
        assert not (rec.run_dir / tracker.UNSENT).exists()
    finally:
        _stop(proc)


def _status(store, rec):
    return MlflowClient(store["uri"]).get_run(rec.run_id).info.status


def test_setup_crash_and_failed_resume_end_the_run_failed_or_killed(configure, store, monkeypatch):
    """An exception after the MLflow run exists but before the loop (mesh, restore, compile) used
    to leave it RUNNING; a resume reopens it as RUNNING, so a crashing resume did the same."""
    import marin.launch.mesh
    from marin.train import loop

    composed, resolved, overrides = configure("run.name=trk-setup")
    rec = record.create(composed, resolved, overrides)

    def broken_mesh(cfg):
        raise RuntimeError("no devices")

    monkeypatch.setattr(marin.launch.mesh, "make_mesh", broken_mesh)
    with pytest.raises(RuntimeError, match="no devices"):
        loop.train(resolved, rec)
    assert _status(store, rec) == "FAILED" and rec.info()["status"] == "FAILED"

    tracker.Tracker(rec).finish("KILLED")            # an earlier attempt, stopped
    with pytest.raises(RuntimeError, match="no devices"):
        loop.train(resolved, rec)                    # the resume reopens it, then crashes
    assert _status(store, rec) == "FAILED"

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(marin.launch.mesh, "make_mesh", interrupted)
    with pytest.raises((KeyboardInterrupt, SystemExit)) as ended:   # Ctrl-C: exit 130, no traceback
        loop.train(resolved, rec)
    assert ended.type is KeyboardInterrupt or ended.value.code == 130
    assert _status(store, rec) == "KILLED"


def test_status_the_store_missed_is_sent_with_the_unsent_metrics(configure, store):
    real = record.create(*configure("run.name=trk-away-status"))
    away = RunRecord(real.run_dir, real.run_id, "http://127.0.0.1:9", real.experiment_name)
    t = tracker.Tracker(away, flush_every_s=0.0)
    t.log_metrics({"train/loss": 1.0}, step=0)
    t.finish("FAILED")
    assert _status(store, real) == "RUNNING"         # the store never heard of the end …
    assert real.info()["status_unsent"] == "FAILED"  # … so the run directory keeps it
    assert tracker.send_unsent(real) == 1
    assert _status(store, real) == "FAILED" and real.info()["status_unsent"] is None

    crashed = record.create(*configure("run.name=trk-away-setup"))   # set-up crash during an outage
    tracker.end_if_running(RunRecord(crashed.run_dir, crashed.run_id, "http://127.0.0.1:9",
                                     crashed.experiment_name), "FAILED")
    assert _status(store, crashed) == "RUNNING"
    assert tracker.send_unsent(crashed) == 0         # no metrics, but the status
    assert _status(store, crashed) == "FAILED"


@pytest.mark.slow
def test_two_jobs_opening_a_new_sqlite_store_at_once_both_succeed(tmp_path):
    """MLflow creates a sqlite store's tables on first use; two jobs doing it at once used to
    crash one ("table already exists"). Both wait for a start file, then open the store."""
    uri = f"sqlite:///{tmp_path}/mlflow/mlflow.db"
    go = tmp_path / "go"
    code = (f"import pathlib, time\nfrom marin.track import backend\n"
            f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.01)\n"
            f"backend.experiment_id(backend.client({uri!r}), 'race', {uri!r})\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    jobs = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    time.sleep(4)  # both have imported MLflow and wait
    go.touch()
    errors = [job.communicate(timeout=120)[1] for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], errors
    assert MlflowClient(uri).get_experiment_by_name("race") is not None
