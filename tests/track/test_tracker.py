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
from tests.helpers import new_store

ROOT = Path(__file__).resolve().parents[2]


def test_metrics_tags_text_artifacts_read_back(configure, store, tmp_path):
    rec = record.create(*configure("run.name=trk"))
    (tmp_path / "plan.txt").write_text("the plan")
    t = tracker.Tracker(rec)
    for step in range(5):
        t.log_metrics({"train/loss": 5.0 - step, "lr": 1e-3}, step=step)
    t.log_metrics({"time/eval_s": 0.5, "data/tokens/web/pretrain": 64.0}, step=4)
    t.set_tags({"phase": "pretrain", "WANDB_API_KEY": "hunter2"})
    t.log_text("summary.txt", "done")
    t.log_artifact(tmp_path / "plan.txt")
    t.finish()
    client = MlflowClient(store["uri"])
    history = client.get_metric_history(rec.run_id, "train/loss")
    assert [(m.step, m.value) for m in history] == [(s, 5.0 - s) for s in range(5)]
    run = client.get_run(rec.run_id)
    assert run.info.status == "FINISHED"
    # bookkeeping is filed under usage/, so MLflow's UI (code-point order) lists train/ and eval/ first
    names = sorted(run.data.metrics)
    assert names == ["lr", "train/loss", "usage/data/tokens/web/pretrain", "usage/time/eval_s"]
    assert {json.loads(line)["key"] for line in (rec.run_dir / tracker.METRICS).read_text().splitlines()} == set(names)
    assert run.data.tags["phase"] == "pretrain" and run.data.tags["WANDB_API_KEY"] != "hunter2"
    names = {a.path for a in client.list_artifacts(rec.run_id)}
    assert {"summary.txt", "plan.txt"} <= names
    assert rec.info()["status"] == "FINISHED"


def test_with_the_report_off_a_run_ends_without_its_page(configure, store):
    """tracking.report=false: `report` draws nothing (python -m marin.report draws it when asked)."""
    rec = record.create(*configure("run.name=trk-quiet"))
    t = tracker.Tracker(rec, report=False)
    t.log_metrics({"train/loss": 5.0}, step=1)
    t.finish()
    t.report()
    assert not (rec.run_dir / "report.html").exists()
    assert MlflowClient(store["uri"]).get_run(rec.run_id).info.status == "FINISHED"


def test_other_processes_log_nothing_and_statuses_are_checked(configure, store):
    rec = record.create(*configure("run.name=trk-fail"))
    other = tracker.Tracker(rec, process_index=1)
    other.log_metrics({"loss": 1.0}, step=0)
    other.finish("FINISHED")                        # a no-op: process 0 ends the run
    t = tracker.Tracker(rec, process_index=0)
    t.finish("FAILED")
    client = MlflowClient(store["uri"])
    assert client.get_run(rec.run_id).info.status == "FAILED"
    assert client.get_metric_history(rec.run_id, "loss") == []
    with pytest.raises(ValueError, match="status must be one of"):
        t.finish("DONE")


def test_unreachable_store_keeps_metrics_and_sends_them_later(configure, store, caplog):
    real = record.create(*configure("run.name=trk-away", "tracking.report=true"))  # the suite's site: false
    away = RunRecord(real.run_dir, real.run_id, "http://127.0.0.1:9", real.experiment_name)
    t = tracker.Tracker(away, flush_every_s=0.0)
    with caplog.at_level(logging.WARNING, logger="marin.track"):
        for step in range(3):
            t.log_metrics({"train/loss": float(step)}, step=step)   # training goes on
            t.flush(timeout=10)
        t.finish("FINISHED")
    assert sum("does not answer" in r.message for r in caplog.records) == 1  # warned once
    spilled = (real.run_dir / tracker.UNSENT).read_text().splitlines()
    assert [json.loads(line)["step"] for line in spilled] == [0, 1, 2]
    t.report()                                                       # skipped: the store is away …
    assert not (real.run_dir / "report.html").exists()
    assert tracker.catch_up(real) == (3, real.run_dir / "report.html", False)   # … drawn when it is back
    assert MlflowClient(store["uri"]).get_run(real.run_id).info.status == "FINISHED"  # sent with them
    history = MlflowClient(store["uri"]).get_metric_history(real.run_id, "train/loss")
    assert sorted(m.step for m in history) == [0, 1, 2]


def test_catching_up_draws_no_report_for_a_run_that_asked_for_none(configure, store):
    real = record.create(*configure("run.name=trk-noreport", "tracking.report=false"))
    away = RunRecord(real.run_dir, real.run_id, "http://127.0.0.1:9", real.experiment_name)
    t = tracker.Tracker(away, flush_every_s=0.0, report=False)
    t.log_metrics({"train/loss": 1.0}, step=0)
    t.finish("FINISHED")
    assert tracker.catch_up(real) == (1, None, False)                # the metric and status are sent …
    assert not (real.run_dir / "report.html").exists()       # … and tracking.report=false still holds
    assert MlflowClient(store["uri"]).get_run(real.run_id).info.status == "FINISHED"


def test_the_catch_up_command_sends_and_says_so_in_one_line(configure, store, capsys):
    """`python -m marin.track.tracker <run>` (what a run printed when its store was away): its
    metrics sent, or one error line (no traceback) for a run that is not found."""
    real = record.create(*configure("run.name=trk-command", "tracking.report=false"))
    away = RunRecord(real.run_dir, real.run_id, "http://127.0.0.1:9", real.experiment_name)
    t = tracker.Tracker(away, flush_every_s=0.0, report=False)
    t.log_metrics({"train/loss": 1.0}, step=0)
    t.finish("FINISHED")
    capsys.readouterr()
    assert tracker.main([str(real.run_dir)]) == 0
    assert capsys.readouterr().out == "sent 1 metrics\n"
    with pytest.raises(SystemExit) as exit_:
        tracker.main([str(real.run_dir) + "-gone"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err


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
    pytest.fail("mlflow server did not start within 60 s")  # a failure, not a skip: the test would pass unchecked


def _stop(proc):
    os.killpg(proc.pid, 15)
    proc.wait(timeout=30)


@pytest.mark.slow
def test_server_restart_during_training_loses_no_metric(configure, tmp_path):
    port = _free_port()
    uri = f"http://127.0.0.1:{port}"
    new_store(tmp_path, "db.sqlite")  # migrated already: the server starts without MLflow's migrations
    proc = _server(tmp_path / "db.sqlite", tmp_path / "art", port)
    try:
        rec = record.create(*configure("run.name=restart", f"tracking.uri={uri}"))
        t = tracker.Tracker(rec, flush_every_s=0.0)
        t.log_metrics({"loss": 0.0}, step=0)
        _stop(proc)
        t.log_metrics({"loss": 1.0}, step=1)   # server away: kept
        proc = _server(tmp_path / "db.sqlite", tmp_path / "art", port)
        t.log_metrics({"loss": 2.0}, step=2)
        # The server is back: what the tracker kept reaches it. Its call made while the server was
        # away may still sit in MLflow's own backoff (2, 4, 8, 16 s...): on a loaded machine that
        # outlasted finish's 30 s and the metrics went to unsent_metrics.jsonl (once in a full run).
        assert t.flush(timeout=180)
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
    from marin.train import loop, trainer

    composed, resolved, overrides = configure("run.name=trk-setup")
    rec = record.create(composed, resolved, overrides)

    def broken_mesh(cfg):
        raise RuntimeError("no devices")

    monkeypatch.setattr(trainer, "make_mesh", broken_mesh)
    with pytest.raises(RuntimeError, match="no devices"):
        loop.train(resolved, rec)
    assert _status(store, rec) == "FAILED" and rec.info()["status"] == "FAILED"

    tracker.Tracker(rec).finish("KILLED")            # an earlier attempt, stopped
    with pytest.raises(RuntimeError, match="no devices"):
        loop.train(resolved, rec)                    # the resume reopens it, then crashes
    assert _status(store, rec) == "FAILED"

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer, "make_mesh", interrupted)
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
    tracker.Tracker(RunRecord(crashed.run_dir, crashed.run_id, "http://127.0.0.1:9",
                              crashed.experiment_name)).finish("FAILED")
    assert _status(store, crashed) == "RUNNING"
    assert tracker.send_unsent(crashed) == 0         # no metrics, but the status
    assert _status(store, crashed) == "FAILED"


def test_a_frozen_server_never_stalls_the_caller(configure, store):
    """A server that accepts connections and never answers: every call returns at once (only
    the sender thread waits), and `finish` gives up after its timeout, keeping the metrics and
    the status in the run directory."""
    real = record.create(*configure("run.name=trk-frozen"))
    with socket.socket() as frozen:
        frozen.bind(("127.0.0.1", 0))
        frozen.listen(16)
        away = RunRecord(real.run_dir, real.run_id, f"http://127.0.0.1:{frozen.getsockname()[1]}",
                         real.experiment_name)
        t = tracker.Tracker(away, flush_every_s=0.0)
        t.end_timeout_s = 1.0
        began = time.monotonic()
        for step in range(200):
            t.log_metrics({"train/loss": float(step)}, step=step)
            t.set_tags({"step": str(step)})
        # A call that waited on the server would block for MLflow's HTTP timeout (120 s); these
        # bounds leave room for a loaded machine and still tell the two apart.
        assert time.monotonic() - began < 5.0
        t.finish("FINISHED")
        assert time.monotonic() - began < 15.0
    assert len((real.run_dir / tracker.UNSENT).read_text().splitlines()) == 200
    assert real.info()["status_unsent"] == "FINISHED"
    assert tracker.send_unsent(real) == 200
    assert _status(store, real) == "FINISHED"


@pytest.mark.slow
def test_a_killed_process_leaves_its_run_failed(configure, store):
    """SIGKILL gives no chance to end the run: the tracking process (marin.track.worker) ends it
    FAILED; also after a SIGTERM to the whole process group (which the trainer answers and the
    tracking process ignores) and after the tracking process died and was replaced."""
    import signal
    import textwrap

    rec = record.create(*configure("run.name=trk-killed"))
    code = textwrap.dedent(f"""
        import signal, sys
        from marin.track import record, tracker, worker
        signal.signal(signal.SIGTERM, lambda *_: None)  # the trainer's handler: a checkpoint, here nothing
        t = tracker.Tracker(record.open({str(rec.run_dir)!r}), flush_every_s=0.0)
        for step, _ in enumerate(iter(sys.stdin.readline, ""), start=1):  # one step per line from the test
            t.log_metrics({{"train/loss": 1.0}}, step)
            t.flush(timeout=60)  # the sender has started: the tracking process watches the run
            print(worker.Worker.get()._process.pid, flush=True)
    """)
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)

    def step() -> int:
        child.stdin.write("\n")
        child.stdin.flush()
        return int(child.stdout.readline())

    first = step()
    deadline = time.monotonic() + 60
    while _status(store, rec) != "RUNNING" and time.monotonic() < deadline:  # its sender reopened it
        time.sleep(0.1)
    os.killpg(child.pid, signal.SIGTERM)                  # scancel, Ctrl-C of a shell: every process
    assert step() == first                                # the tracking process lived through it
    os.kill(first, signal.SIGKILL)                        # and if it dies anyway, its successor watches
    assert step() != first
    child.send_signal(signal.SIGKILL)
    child.wait()
    while _status(store, rec) == "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _status(store, rec) == "FAILED"

    done = record.create(*configure("run.name=trk-done"))  # a run ended on purpose stays as it ended
    # Its tracking process is up before `finish` (which waits 30 s, then leaves the status to send
    # later): on a loaded machine the start alone, MLflow's import and the store's, outlasted that
    # once, and the run stayed RUNNING. What is under test is what that process does afterwards.
    code = textwrap.dedent(f"""
        from marin.track import record, tracker
        t = tracker.Tracker(record.open({str(done.run_dir)!r}))
        assert t.flush(timeout=180)
        t.finish("KILLED")
    """)
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True,
                   timeout=120)
    time.sleep(1.0)  # the tracking process has seen its trainer go
    assert _status(store, done) == "KILLED"


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


def test_a_dead_tracking_process_loses_nothing_and_a_job_signal_does_not_end_it(configure, store):
    """The tracking process (marin.track.worker) shrugs off the signals Slurm sends to every
    process of a job; if it dies anyway, the Tracker starts another and sends what was queued."""
    import signal

    from marin.track import worker

    rec = record.create(*configure("run.name=trk-worker-dies"))
    t = tracker.Tracker(rec, flush_every_s=0.0)
    t.log_metrics({"train/loss": 0.0}, step=1)
    assert t.flush(timeout=60)
    first = worker.Worker.get()
    first._process.send_signal(signal.SIGUSR2)       # noqa: SLF001 — scancel --signal=USR2 reaches it too
    t.log_metrics({"train/loss": 1.0}, step=2)
    assert t.flush(timeout=60) and first.alive and first._process.poll() is None  # noqa: SLF001
    first._process.kill()                             # noqa: SLF001
    first._process.wait()                             # noqa: SLF001
    t.log_metrics({"train/loss": 2.0}, step=3)
    t.finish("FINISHED")
    assert worker.Worker.get() is not first
    history = MlflowClient(store["uri"]).get_metric_history(rec.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3]
    kept = [json.loads(line)["step"] for line in (rec.run_dir / tracker.METRICS).read_text().splitlines()]
    assert kept == [1, 2, 3]                              # the retry replays nothing into the local record
    assert _status(store, rec) == "FINISHED" and not (rec.run_dir / tracker.UNSENT).exists()


def test_system_metrics_are_logged_by_the_tracking_process_when_asked(configure, store):
    """MLflow's monitor samples the machine into system/… metrics (tracking.system_metrics), and
    stops with the run; a run without it has none."""
    client = MlflowClient(store["uri"])
    on = record.create(*configure("run.name=trk-sysmetrics"))
    t = tracker.Tracker(on, flush_every_s=0.0, system_metrics_s=0.2)
    t.log_metrics({"train/loss": 1.0}, step=1)
    deadline = time.monotonic() + 60
    while not any(k.startswith("system/") for k in client.get_run(on.run_id).data.metrics) and time.monotonic() < deadline:
        time.sleep(0.2)
    t.finish("FINISHED")
    names = set(client.get_run(on.run_id).data.metrics)
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= names, names
    off = record.create(*configure("run.name=trk-nosysmetrics"))
    t = tracker.Tracker(off, flush_every_s=0.0)
    t.log_metrics({"train/loss": 1.0}, step=1)
    time.sleep(0.5)
    t.finish("FINISHED")
    assert not any(k.startswith("system/") for k in client.get_run(off.run_id).data.metrics)


def test_the_printed_catch_up_command_is_shell_quoted(configure, store, caplog, tmp_path):
    """A run directory holding `$(…)`: the command the tracker prints (send later with …) pastes into
    a shell as that one path and runs nothing."""
    import shlex
    import shutil

    real = record.create(*configure("run.name=trk-quote"))
    hostile = tmp_path / "runs" / "x $(touch pwned) `touch pwned2` y"
    shutil.copytree(real.run_dir, hostile)
    t = tracker.Tracker(RunRecord(hostile, real.run_id, "http://127.0.0.1:9", real.experiment_name), flush_every_s=0.0)
    with caplog.at_level(logging.WARNING, logger="marin.track"):
        t.log_metrics({"train/loss": 1.0}, step=0)
        t.finish("FINISHED")       # the store is away: the metric and the status wait, a command says how to send them
    said = [r.getMessage() for r in caplog.records if "python -m marin.track.tracker " in r.getMessage()]
    assert len(said) == 2, said
    for message in said:
        pasted = message.split("python -m marin.track.tracker ", 1)[1]
        assert shlex.split(pasted) == [str(hostile)], message
        subprocess.run(["bash", "-c", f": {pasted}"], cwd=tmp_path, check=True)   # as a user pastes it
        assert not list(tmp_path.glob("pwned*")), message


@pytest.mark.slow
def test_a_run_killed_with_its_tracking_process_is_ended_failed_by_the_catch_up(configure, store, capsys, tmp_path):
    """kill -9 of the trainer and its tracking process together: nothing can end the MLflow run
    then. The run's directory shows it FAILED at once; the catch-up sends the steps the store
    lacks (from metrics.jsonl) and ends it FAILED."""
    import signal
    import textwrap

    from marin import status
    from marin.track import runfiles

    rec = record.create(*configure("run.name=trk-both-killed", f"run.out_dir={tmp_path}"))
    code = textwrap.dedent(f"""
        import sys
        from marin.track import record, runlock, tracker
        run = record.open({str(rec.run_dir)!r})
        runlock.hold(run.run_dir)                  # as the Trainer does
        t = tracker.Tracker(run, flush_every_s=3600.0)
        for step in (1, 2, 3):
            t.log_metrics({{"train/loss": 4.0 - step, "lr": 0.1}}, step)
        assert t.flush(timeout=60)                 # the store has steps 1-3 ...
        for step in (4, 5):
            t.log_metrics({{"train/loss": 4.0 - step, "lr": 0.1}}, step)  # ... and not these
        print("ready", flush=True)
        sys.stdin.readline()
    """)
    child = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert child.stdout.readline() == "ready\n"
    os.killpg(child.pid, signal.SIGKILL)           # the trainer and its tracking process
    child.wait()
    time.sleep(0.5)
    assert _status(store, rec) == "RUNNING"         # nobody was left to end it
    assert runfiles.read(rec.run_dir).state == "FAILED"
    assert status.main(["--out-dir", str(tmp_path)]) == 0     # the list says so, and what to run
    said = capsys.readouterr().out
    assert "FAILED" in said and f"killed before it ended; MLflow shows it RUNNING until {tracker.catch_up_command(rec.run_dir)}" in said, said

    assert tracker.main([str(rec.run_dir)]) == 0
    said = capsys.readouterr().out
    assert "sent 4 metrics" in said and "killed before it ended: FAILED" in said, said
    assert _status(store, rec) == "FAILED"
    history = MlflowClient(store["uri"]).get_metric_history(rec.run_id, "train/loss")
    assert sorted(m.step for m in history) == [1, 2, 3, 4, 5]   # each step once
    assert rec.info()["status"] == "FAILED"
    assert tracker.end_abandoned(rec) is None       # ended now: a second catch-up does nothing
