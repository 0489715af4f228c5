"""The preemption flag and the requeue decision (the Slurm side runs in tests/launch/test_slurm.py)."""
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from marin.train import preempt
from tests.helpers import new_store


@pytest.fixture(autouse=True)
def clean_flag():
    old = {s: signal.getsignal(s) for s in preempt.SIGNALS + preempt.STOP_SIGNALS}
    preempt.reset()
    yield
    preempt.reset()
    for s, handler in old.items():
        signal.signal(s, handler)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR2])
def test_signal_sets_the_flag_and_nothing_else(sig):
    preempt.install()
    assert preempt.poll() == (0, False)
    os.kill(os.getpid(), sig)  # would end the process without the handler
    assert preempt.poll() == (sig, False)


def test_outside_slurm_requeue_only_stops(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert preempt.requeue() is False


def test_under_slurm_process_zero_requeues_then_exits(monkeypatch):
    calls = []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    preempt.install(max_requeues=3)
    with pytest.raises(SystemExit) as exit_:
        preempt.requeue()
    assert exit_.value.code == 0
    assert calls == [["scontrol", "requeue", "4242"]]


def test_requeues_are_bounded(monkeypatch):
    calls = []
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    preempt.install(max_requeues=3)
    with pytest.raises(SystemExit) as exit_:
        preempt.requeue()
    assert exit_.value.code == 1 and calls == []


def test_ctrl_c_stops_and_a_second_one_stops_at_once(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")   # even under Slurm, Ctrl-C is a stop, not a requeue
    preempt.install()
    os.kill(os.getpid(), signal.SIGINT)          # would raise KeyboardInterrupt without the handler
    assert preempt.poll() == (signal.SIGINT, False)
    assert not preempt.requeues(signal.SIGINT) and preempt.requeues(signal.SIGTERM)
    assert preempt.exit_code(signal.SIGINT) == 130 and preempt.exit_code(signal.SIGTERM) == 143
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)


def test_poll_passes_the_rolling_checkpoint_decision():
    assert preempt.poll(time_due=True) == (0, True)
    assert preempt.poll(time_due=False) == (0, False)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_outside_slurm_checkpoints_and_ends_killed(tmp_path, capfd, sig, code):
    """launch.py's dispatch in this process (as `launch_here`: no new interpreter and tracking
    process to start); the signal comes to this process once the first step is logged, as the
    shell's Ctrl-C or a `kill` would. The run lives under a folder with a space: the resume command
    in the run's last line (stdout) is shell-quoted."""
    import re
    import shlex

    from mlflow import MlflowClient

    from tests.helpers import launch_here_acting

    uri, out, steps = new_store(tmp_path), tmp_path / "my runs", 3000  # ends by itself if the signal never came
    rc = launch_here_acting(out, lambda run_dir: os.kill(os.getpid(), sig),
                            "model=micro", f"train.steps={steps}", "train.seq_len=32", "train.global_batch=4",
                            "train.eval_every=0", f"run.out_dir={out}", f"tracking.uri={uri}", "tracking.report=true")
    said, text = capfd.readouterr()
    assert rc == code, text[-3000:]
    run_dir = Path(re.search(r"run directory: (.+)", text).group(1))
    assert run_dir.parent.parent == out
    assert "resume=" not in text  # said once, in the summary line
    (line,) = said.splitlines()
    assert re.match(rf"killed at step \d+ of {steps} \({signal.Signals(sig).name}, checkpoint saved\): train loss \d",
                    line)
    assert f"; run directory {run_dir}; mlflow run " in line and f"; report {run_dir / 'report.html'}; " in line, line
    assert shlex.split(line.split("continue with: ")[1]) == ["python", "launch.py", f"resume={run_dir}"], line
    assert "Traceback" not in text
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    run_id = json.loads((run_dir / "record.json").read_text())["run_id"]
    assert MlflowClient(uri).get_run(run_id).info.status == "KILLED"
