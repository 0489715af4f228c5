"""The hang watchdog (marin/train/watchdog.py): its clock in-process, then a real hang injected with
`debug.hang_at_step` into a tiny launch.py run (the stacks, the exit status, the detection time).
A hang in a 2-task Slurm job, caught and restarted: tests/launch/test_slurm.py."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from marin.train import watchdog
from marin.train.preempt import WATCHDOG_EXIT
from tests.helpers import new_store

ROOT = Path(__file__).resolve().parents[2]
TOKENS = f"data.cache_dir={ROOT / 'outputs' / 'cache' / 'tokens'}"  # the project's token cache: tokenized once


class Exits:
    """Stands in for os._exit, so the test process survives the watchdog's firing."""

    def __init__(self):
        self.codes = []

    def __call__(self, code):
        self.codes.append(code)


def beat_for(dog, seconds: float, step: int) -> int:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        step += 1
        dog.beat(step)
        time.sleep(0.02)
    return step


def test_fires_only_when_steps_stop_not_during_the_first_step_or_slow_work(capfd):
    exits = Exits()
    # A limit of 1 s with beats every 20 ms: a loaded 2-core machine (the suite's other workers,
    # Slurm jobs) can stall this thread for a few hundred ms, never for a second between beats.
    dog = watchdog.Watchdog(1.0, exit=exits, grace_s=0)
    try:
        time.sleep(2.0)                 # the first step (restore, compile): the slow allowance
        step = beat_for(dog, 1.5, 0)    # steps keep coming
        with dog.slow():                # an eval or a checkpoint, longer than the limit
            time.sleep(2.0)
        step = beat_for(dog, 0.5, step)
        assert exits.codes == []
        stopped_at = time.monotonic()
        while not exits.codes and time.monotonic() - stopped_at < 5:
            time.sleep(0.01)
        assert exits.codes == [WATCHDOG_EXIT]
    finally:
        dog.stop()
    err = capfd.readouterr().err
    fired = re.search(r"no step completed for ([\d.]+) s \(allowed 1.0 s\) after step (\d+)", err)
    assert fired and float(fired.group(1)) >= 1.0 and int(fired.group(2)) == step, err[:500]
    assert "test_fires_only_when_steps_stop" in err  # every thread's stack, this one's included


def test_process_0_exits_last_so_the_others_outlive_the_coordination_service_it_hosts():
    """Were process 0 to exit first, the others would abort on the lost jax.distributed service
    (SIGABRT, exit 134) before their own exit, and the job's fault would read as a crash."""
    exited = {}
    dogs = [watchdog.Watchdog(0.5, process_index=i, exit=lambda code, i=i: exited.setdefault(i, time.monotonic()),
                              grace_s=0.5) for i in (0, 1)]
    try:
        for dog in dogs:
            dog.beat(1)  # past the first step: the 0.5 s limit holds
        end = time.monotonic() + 20
        while len(exited) < 2 and time.monotonic() < end:
            time.sleep(0.01)
    finally:
        for dog in dogs:
            dog.stop()
    # both fire within 0.05 s; process 0 exits after the other, well inside srun's KillWait (5 s here)
    assert 1.0 <= exited[0] - exited[1] <= 3.0, exited


def test_off_without_a_limit():
    dog = watchdog.Watchdog(None)
    assert dog._thread is None
    dog.beat(1)
    with dog.slow():
        pass


def test_the_injected_hang_happens_once_per_run(tmp_path):
    cfg = SimpleNamespace(debug=SimpleNamespace(hang_at_step=3, hang_process=0))
    watchdog.hang_if_asked(cfg, 2, tmp_path)  # another step: nothing
    (tmp_path / watchdog.HANG_MARKER).write_text("{}")
    watchdog.hang_if_asked(cfg, 3, tmp_path)  # it happened before this restart: nothing


@pytest.mark.slow
def test_a_hung_run_dumps_its_stacks_and_exits_124_within_the_limit(tmp_path):
    """launch.py, tiny model, limit 3 s, process 0 hangs before step 3 (about 15 s)."""
    from mlflow import MlflowClient

    uri = new_store(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    limit_s = 3.0
    done = subprocess.run([sys.executable, "launch.py", "model=micro", "train.steps=8", "train.seq_len=32",
                           "train.global_batch=4", "train.eval_every=0", f"run.out_dir={tmp_path}",
                           f"tracking.uri={uri}",
                           f"train.watchdog_minutes={limit_s / 60}", "debug.hang_at_step=3", TOKENS],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == WATCHDOG_EXIT, done.stderr[-3000:]
    fired = re.search(r"watchdog: process 0: no step completed for ([\d.]+) s \(allowed ([\d.]+) s\) after step 2",
                      done.stderr)
    assert fired, done.stderr[-3000:]
    assert float(fired.group(2)) == limit_s
    assert limit_s <= float(fired.group(1)) < limit_s + 60       # caught within the limit plus one minute
    assert "in hang_if_asked" in done.stderr.split("watchdog: process 0")[1]  # the main thread's stack
    run_dir = Path(re.search(r"run directory: (.+)", done.stderr).group(1))
    log = (run_dir / "run.log").read_text()
    assert "watchdog: process 0" in log and "in hang_if_asked" in log
    assert json.loads((run_dir / watchdog.HANG_MARKER).read_text()) == {"step": 3, "process": 0}
    run_id = json.loads((run_dir / "record.json").read_text())["run_id"]
    end = time.monotonic() + 60  # the tracking process ends the run of a process that died
    while (status := MlflowClient(uri).get_run(run_id).info.status) == "RUNNING" and time.monotonic() < end:
        time.sleep(0.5)
    assert status == "FAILED"


def test_the_hero_has_production_watchdog_and_other_runs_none():
    from tests.helpers import make_config

    assert make_config("experiment=mochi_535b_a23b", "dry_run=true").train.watchdog_minutes == 15
    assert make_config("model=micro").train.watchdog_minutes is None
