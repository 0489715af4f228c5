"""`python -m marin.ctl checkpoint <run>` (marin/ctl.py): refusals, then a forced checkpoint in a
real run that goes on to finish (the Slurm side, `marin.ctl` in a process of its own against a
job's processes: tests/launch/test_slurm.py)."""
import json
import os
import re
import signal
from pathlib import Path

import pytest

from marin import ctl
from marin.train import manifest, preempt
from tests.helpers import new_store

ROOT = Path(__file__).resolve().parents[2]


def ctl_main(*args: str, capsys) -> tuple[int, str, str]:
    try:
        code = ctl.main(list(args))
    except SystemExit as end:
        code = end.code
    out, err = capsys.readouterr()
    return code, out, err


def fake_run(tmp_path: Path) -> Path:
    """The files `record.open` needs, no process."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "record.json").write_text(json.dumps({"run_id": "0" * 32, "tracking_uri": "sqlite:///x.db",
                                                     "experiment": "default"}))
    (run_dir / "composed.yaml").write_text("{}\n")
    return run_dir


def test_a_missing_run_is_one_line_exit_2(tmp_path, capsys):
    code, out, err = ctl_main("checkpoint", str(tmp_path / "nope"), capsys=capsys)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err


def test_a_run_whose_process_is_gone_or_reused_is_not_signalled(tmp_path, capsys):
    run_dir = fake_run(tmp_path)
    announced = preempt.announce(run_dir, 0)   # this test process, as if it were the run ...
    [entry] = ctl.listed(run_dir)
    assert ctl.alive_here(entry)
    entry["started"] = str(int(entry["started"]) + 1)   # ... but its pid now belongs to another process
    (run_dir / "processes" / "0.json").write_text(json.dumps({k: v for k, v in entry.items() if k != "path"}))
    old = signal.signal(signal.SIGUSR1, lambda *a: pytest.fail("a reused pid was signalled"))
    try:
        code, out, err = ctl_main("checkpoint", str(run_dir), capsys=capsys)
    finally:
        signal.signal(signal.SIGUSR1, old)
        preempt.withdraw(announced)
    assert code == 2 and "no running process" in err and err.count("\n") == 1, err


def test_sigusr1_asks_for_one_checkpoint_at_the_next_step_boundary():
    old = {s: signal.getsignal(s) for s in (*preempt.SIGNALS, *preempt.STOP_SIGNALS, preempt.CHECKPOINT_SIGNAL)}
    preempt.reset()
    try:
        preempt.install()
        assert preempt.poll() == (0, preempt.Save.NONE)
        os.kill(os.getpid(), signal.SIGUSR1)   # would end the process without the handler
        os.kill(os.getpid(), signal.SIGUSR1)   # two asks before one boundary: one checkpoint
        assert preempt.poll(time_due=True) == (0, preempt.Save.FORCED)
        assert preempt.poll() == (0, preempt.Save.NONE)   # asked once, taken once; the run goes on
    finally:
        preempt.reset()
        for sig, handler in old.items():
            signal.signal(sig, handler)


@pytest.mark.slow
def test_a_forced_checkpoint_is_written_verified_logged_and_the_run_finishes(tmp_path, capfd):
    """A micro run of 100 steps in this process (launch.py's dispatch, as `launch_here`: no new
    interpreter and tracking process to start) and, from another thread once its first step is
    logged, `marin.ctl checkpoint <run>`: it finds the run's process (this one) and signals it."""
    from mlflow import MlflowClient

    from tests.helpers import launch_here_acting

    uri, steps, asked = new_store(tmp_path), 100, {}

    def ask(run_dir: Path) -> None:
        asked["run_dir"] = run_dir
        try:
            asked["code"] = ctl.main(["checkpoint", str(run_dir)])
        except SystemExit as end:
            asked["code"] = end.code

    rc = launch_here_acting(tmp_path, ask, "model=micro", f"train.steps={steps}", "train.seq_len=32",
                            "train.global_batch=4", "train.eval_every=0", f"run.out_dir={tmp_path}",
                            # retention keeps the forced checkpoint and the newest one
                            "train.checkpoint.every_steps=25", "train.checkpoint.keep_last=1",
                            "train.checkpoint.permanent_every=0",
                            f"tracking.uri={uri}", f"data.cache_dir={ROOT / 'outputs' / 'cache' / 'tokens'}")
    out, err = capfd.readouterr()
    assert rc == 0 and "run_dir" in asked, err[-3000:]
    run_dir = asked["run_dir"]
    assert asked["code"] == 0 and f"process {os.getpid()} (SIGUSR1)" in out, out + err[-3000:]
    forced = re.search(r"forced checkpoint at step (\d+) written and verified", (run_dir / "run.log").read_text())
    assert forced, (run_dir / "run.log").read_text()[-2000:]
    step = int(forced.group(1))
    assert 1 <= step < steps                          # at a step boundary, before the end
    step_dir = run_dir / "checkpoints" / str(step)
    kept = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert step in kept and not ({25, 50} - {step}) & set(kept), kept   # retention (keep_last=1) kept the forced one
    assert not manifest.missing(step_dir) and manifest.damage(step_dir) is None and manifest.kind(step_dir) == "per-process"
    run = MlflowClient(uri).get_run(json.loads((run_dir / "record.json").read_text())["run_id"])
    assert run.info.status == "FINISHED" and run.data.tags["checkpoint.forced"] == str(step)
    history = MlflowClient(uri).get_metric_history(run.info.run_id, "usage/checkpoint/forced")
    assert [(m.step, m.value) for m in history] == [(step, step)]
    assert max(m.step for m in MlflowClient(uri).get_metric_history(run.info.run_id, "train/loss")) == steps
    assert not list((run_dir / "processes").iterdir())   # gone with the run ...
    code, _, err = ctl_main("checkpoint", str(run_dir), capsys=capfd)
    assert code == 2 and "no running process" in err  # ... so a finished run is not signalled


def test_a_listed_process_that_is_not_the_runs_trainer_is_not_signalled(tmp_path, capsys):
    """processes/0.json naming another program (its pid, host and start time all true: a stale or
    edited entry on a finished run) is refused: only a process that holds the run's entry open
    (preempt.announce keeps it) is its trainer."""
    import socket
    import subprocess

    run_dir = fake_run(tmp_path)
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (run_dir / "processes").mkdir()
        (run_dir / "processes" / "0.json").write_text(json.dumps(
            {"pid": sleeper.pid, "host": socket.gethostname(), "started": preempt.process_start(sleeper.pid),
             "slurm_job": None}))
        code, out, err = ctl_main("checkpoint", str(run_dir), capsys=capsys)
        assert code == 2 and out == "" and "no running process" in err and err.count("\n") == 1, err
        assert sleeper.poll() is None, "marin.ctl signalled a process that is not the run's trainer"
    finally:
        sleeper.kill()
        sleeper.wait()
