"""The tracking companion (marin.track.companion): a local run's MLflow work happens in a process
of its own, in order, and nothing is lost when that process dies."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from marin.track import record, tracker
from marin.track.companion import Companion, CompanionError, CompanionGone
from marin.track.tracker import RemoteTracker

ROOT = Path(__file__).resolve().parents[2]


def test_calls_run_in_order_in_another_process():
    companion = Companion.start(warm="")
    try:
        pids = [companion.call(os.getpid) for _ in range(3)]
        assert {f.result(timeout=60) for f in pids} == {companion.pid} != {os.getpid()}
        with pytest.raises(CompanionError, match="ValueError"):
            companion.call(int, "not a number").result(timeout=60)
        with pytest.raises(CompanionError, match="cannot be sent back"):
            companion.call(threading.Lock).result(timeout=60)
        assert companion.call(sum, [1, 2, 3]).result(timeout=60) == 6  # it goes on after failures
    finally:
        companion.close()


def test_a_dead_companion_fails_every_unanswered_call():
    companion = Companion.start(warm="")
    companion.call(os.getpid).result(timeout=60)
    os.kill(companion.pid, signal.SIGKILL)
    with pytest.raises(CompanionGone):
        companion.call(time.sleep, 0).result(timeout=60)
    assert not companion.alive
    companion.close()


def test_metrics_survive_the_companion_dying(configure, store):
    """The tracker replays, in this process, every call the companion did not confirm sent."""
    composed, resolved, overrides = configure("run.name=companion-dies")
    companion = Companion.start()
    pending = tracker.create_in(companion, composed, resolved, overrides)
    remote = RemoteTracker(companion, pending, flush_every_s=3600)
    remote.log_metrics({"train/loss": 3.0}, 1)
    rec = pending.ready()
    remote.log_metrics({"train/loss": 2.0}, 2)
    os.kill(companion.pid, signal.SIGKILL)
    remote.log_metrics({"train/loss": 1.0}, 3)
    remote.finish("FINISHED")
    remote.close()
    client = MlflowClient(store["uri"])
    assert sorted({(m.step, m.value) for m in client.get_metric_history(rec.run_id, "train/loss")}) == [
        (1, 3.0), (2, 2.0), (3, 1.0)]
    assert client.get_run(rec.run_id).info.status == "FINISHED"


def test_a_run_that_cannot_be_made_leaves_no_directory(configure, tmp_path):
    """The companion's failure to make the MLflow run comes back as one line; the directory goes."""
    garbage = tmp_path / "store" / "mlflow.db"
    garbage.parent.mkdir()
    garbage.write_text("not a database")  # the folder is fine (checked here); the store is not
    composed, resolved, overrides = configure("run.name=companion-refused", f"tracking.uri=sqlite:///{garbage}")
    companion = Companion.start(warm="")
    pending = tracker.create_in(companion, composed, resolved, overrides)
    assert pending.run_dir.is_dir()
    with pytest.raises(record.RunNotMade, match="database"):
        pending.ready()
    assert not pending.run_dir.exists()
    companion.close()


@pytest.mark.slow
def test_mlflow_never_loads_in_the_training_process_and_a_killed_run_ends_failed(tmp_path):
    """A local run trains without importing MLflow (its companion logs); when the training
    process is killed outright, the companion ends the MLflow run FAILED instead of RUNNING."""
    out, uri = tmp_path / "out", f"sqlite:///{tmp_path}/mlflow.db"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from tests.helpers import compose_dict
        from marin.config.validate import load
        from marin.train import loop
        overrides = ["model=tiny", "train.seq_len=32", "train.global_batch=8", "train.eval_batches=1",
                     "train.eval_every=0", "run.out_dir={out}", "tracking.uri={uri}", *sys.argv[1:]]
        composed, resolved = load(compose_dict(*overrides))
        loop.run_local(composed, resolved, overrides)
        print("mlflow loaded:", "mlflow" in sys.modules, flush=True)
    """))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, str(script), "train.steps=3"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mlflow loaded: False" in done.stdout
    run_id = done.stderr.split("mlflow run: ", 1)[1].split()[0]
    assert MlflowClient(uri).get_run(run_id).info.status == "FINISHED"

    slow = subprocess.Popen([sys.executable, str(script), "train.steps=100000"], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = ""
    while "mlflow run: " not in seen:  # the run exists: its first step has been compiled
        line = slow.stderr.readline()
        assert line, f"the run ended early: {seen[-2000:]}"
        seen += line
    run_id = seen.split("mlflow run: ", 1)[1].split()[0]
    slow.kill()
    slow.wait()
    client, deadline = MlflowClient(uri), time.monotonic() + 60
    while client.get_run(run_id).info.status == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert client.get_run(run_id).info.status == "FAILED"


@pytest.mark.slow
def test_a_run_whose_mlflow_run_cannot_be_made_stops_early_and_leaves_nothing(tmp_path):
    """The training process goes on while the companion makes the run; when the companion cannot,
    training stops at once: one line, exit 2, no run directory."""
    garbage = tmp_path / "store" / "mlflow.db"
    garbage.parent.mkdir()
    garbage.write_text("not a database")
    out = tmp_path / "out"
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(f"""
        from tests.helpers import compose_dict
        from marin.config.validate import load
        from marin.train import loop
        overrides = ["model=tiny", "train.seq_len=32", "train.global_batch=8", "train.eval_batches=1",
                     "train.steps=100000", "run.out_dir={out}", "tracking.uri=sqlite:///{garbage}"]
        composed, resolved = load(compose_dict(*overrides))
        loop.run_local(composed, resolved, overrides)
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "error: could not create the run record" in done.stderr and "Traceback" not in done.stderr
    assert not list((out / "runs").iterdir())
