"""Automatic restarts after a task dies (marin/launch/restarts.py): what a fault records, and on
the local Slurm cluster a job whose tasks failed restarting by itself, and one whose task 0 was
killed (SIGKILL) with its budget spent ending its MLflow run FAILED. (A training job killed mid-run and finishing with the
losses of an unfaulted one: tests/launch/test_slurm.py.)"""
import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from marin.launch import restarts
from marin.status import Job, print_jobs
from tests.launch.test_slurm import field, launch, wait_for_job

ENTRIES = "tests.launch.slurm_entries"


def test_cause_names_the_watchdog_a_signal_or_a_status():
    assert "hang watchdog" in restarts.cause(124)
    assert restarts.cause(137) == "a task was killed by SIGKILL (exit 137)"
    assert restarts.cause(1) == "a task exited with status 1"


def test_the_cause_names_the_error_a_task_of_this_start_raised_masked(tmp_path, monkeypatch):
    """srun's status alone misleads: a task that raised (status 1) makes srun end the others, and
    one still starting dies by SIGTERM (143), srun's status. submitit's result file of the task
    that raised names the error; the last start's files (set aside as .faultN) do not count."""
    from submitit.core.utils import cloudpickle_dump

    from marin.track import secrets

    trace = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: {}\n"
    cloudpickle_dump(("error", trace.format("store s3cr3t-v4lue unreachable")), tmp_path / "9_1_result.pkl")
    cloudpickle_dump(("success", None), tmp_path / "9_0_result.pkl")
    cloudpickle_dump(("error", trace.format("an older start")), tmp_path / "9_0_result.pkl.fault1")
    cloudpickle_dump(("error", trace.format("another job")), tmp_path / "8_0_result.pkl")
    monkeypatch.setattr(secrets, "_known", {"s3cr3t-v4lue"})
    assert restarts.task_error(tmp_path, "9") == "task 1 raised RuntimeError: store <redacted> unreachable"
    assert restarts.task_error(tmp_path, "7") is None
    fault = restarts.fault_record(tmp_path, "9", 143, None, time.time(), restarts.task_error(tmp_path, "9"))
    assert fault["cause"] == ("task 1 raised RuntimeError: store <redacted> unreachable; "
                              "a task was killed by SIGTERM (exit 143)")
    # srun's 124 is the watchdog's: what a task raised then came of its peers' exit (a collective lost them)
    fault = restarts.fault_record(tmp_path, "9", 124, None, time.time(), "task 0 raised JaxRuntimeError: Gloo all-reduce failed")
    assert fault["cause"] == "the hang watchdog ended a task (exit 124); then task 0 raised JaxRuntimeError: Gloo all-reduce failed"


def test_a_fault_records_the_step_reached_the_checkpoint_and_the_training_lost(tmp_path):
    rows = [{"key": "train/loss", "value": 1.0, "step": s, "timestamp": 0} for s in (1, 2, 3, 4, 5, 6)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"key": "train/lo')
    step_dir = tmp_path / "checkpoints" / "4"
    step_dir.mkdir(parents=True)
    (tmp_path / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()   # a save in flight: not restorable
    now = time.time()
    os.utime(step_dir, (now - 600, now - 600))
    fault = restarts.fault_record(tmp_path, "77", 137, started=now - 3600, now=now)
    assert (fault["step"], fault["resume_step"], fault["count"]) == (6, 4, 1)
    assert fault["minutes_lost"] == pytest.approx(10, abs=0.01) and "SIGKILL" in fault["cause"]
    restarts.remember(tmp_path, fault)
    assert restarts.fault_record(tmp_path, "77", 137, None, now)["count"] == 2    # this job's second fault
    assert restarts.fault_record(tmp_path, "78", 137, None, now)["count"] == 1    # another job's budget


def test_without_a_checkpoint_the_training_lost_counts_from_the_jobs_start(tmp_path):
    now = time.time()
    fault = restarts.fault_record(tmp_path, "5", 1, started=now - 120, now=now)
    assert (fault["step"], fault["resume_step"], fault["minutes_lost"]) == (None, 0, 2.0)


def test_a_dead_starts_result_files_are_set_aside_not_read_as_the_jobs_end(tmp_path):
    for name in ("12_0_result.pkl", "12_1_result.pkl", "13_0_result.pkl", "12_submitted.pkl"):
        (tmp_path / name).write_text(name)
    restarts.set_aside_results(tmp_path, "12", 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "12_0_result.pkl.fault1", "12_1_result.pkl.fault1", "12_submitted.pkl", "13_0_result.pkl"]


def test_the_policy_reads_an_array_elements_run_and_budget_from_its_submission(tmp_path, monkeypatch):
    from submitit.core.utils import DelayedSubmission

    from marin.launch.slurm import TrainJob

    task = TrainJob("hardware:\n  max_restarts: 7\n", {"run_dir": str(tmp_path / "run")})
    DelayedSubmission(task).dump(tmp_path / "40_1_submitted.pkl")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "42")   # the element's own id: what is requeued
    assert restarts.submission(tmp_path) == (tmp_path / "run", 7)


def test_preemption_requeues_are_counted_apart_from_fault_restarts(monkeypatch):
    from marin.train import preempt

    monkeypatch.setenv("SLURM_RESTART_COUNT", "5")
    monkeypatch.setenv(restarts.FAULT_RESTARTS_VARIABLE, "3")   # set by job_main from restarts.jsonl
    assert preempt.restart_count() == 2                          # what hardware.max_requeues bounds


def test_status_shows_a_restarts_column_once_a_job_has_restarted():
    jobs = [Job("r1", "lr=0.1", "RUNNING", "7", "RUNNING", 5, 1.5, 10, None, restarts=2),
            Job("r2", "lr=0.2", "FINISHED", "8", "COMPLETED", 10, 1.2, 10)]
    out = io.StringIO()
    print_jobs(jobs, out)
    head, first, second = out.getvalue().splitlines()
    assert "restarts" in head and first.split()[4] == "2" and second.split()[4] == "0"
    out = io.StringIO()
    print_jobs(jobs[1:], out)
    assert "restarts" not in out.getvalue()


@pytest.mark.slurm
@pytest.mark.slow
def test_failed_tasks_restart_the_job_which_completes_and_wait_follows_it(tmp_path, tracking_uri):
    """Both tasks raise in the first start: each leaves submitit an error result, which `wait=true`
    must not take for the job's end while the job restarts."""
    from mlflow import MlflowClient

    done = launch("hardware=slurm_cpu", "model=micro", "wait=true", f"run.out_dir={tmp_path}",
                  f"tracking.uri={tracking_uri}", extra_env={"MARIN_SLURM_ENTRY": f"{ENTRIES}:fail_once"})
    assert done.returncode == 0, done.stdout + done.stderr
    run_dir, job_id = Path(field(done.stdout, "run directory")), field(done.stdout, "slurm job")
    assert json.loads((run_dir / "probe-1.json").read_text())["process_count"] == 2   # the restarted job ran
    assert wait_for_job(job_id).startswith("COMPLETED")
    show = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True).stdout
    assert "Restarts=1" in show, show
    [fault] = [json.loads(line) for line in (run_dir / restarts.RESTARTS).read_text().splitlines()]
    assert (fault["job"], fault["count"], fault["restarted"]) == (job_id, 1, True)
    run_id = field(done.stdout, "mlflow run")
    # srun's status: 1, or 143 when srun's SIGTERM caught a task on its way out after raising
    said = (rf"task [01] raised RuntimeError: deliberate failure in the first start of {run_id}; "
            r"a task (exited with status 1|was killed by SIGTERM \(exit 143\))")
    assert re.fullmatch(said, fault["cause"]), fault
    assert sorted(p.name for p in (run_dir / "slurm").glob("*_result.pkl*")) == [
        f"{job_id}_0_result.pkl", f"{job_id}_0_result.pkl.fault1", f"{job_id}_1_result.pkl", f"{job_id}_1_result.pkl.fault1"]
    assert json.loads((run_dir / "record.json").read_text())["restarts"] == 1
    run = MlflowClient(tracking_uri).get_run(run_id)
    assert run.data.tags["restarts"] == "1" and run.data.tags["restart.1.cause"] == fault["cause"]
    assert run.data.metrics["restart/count"] == 1
    status = subprocess.run([sys.executable, "-m", "marin.status", str(run_dir)], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    assert "restarts" in status.stdout.splitlines()[1], status.stdout + status.stderr


@pytest.mark.slurm
@pytest.mark.slow
def test_a_spent_budget_ends_the_mlflow_run_failed_when_process_0_died(tmp_path, tracking_uri):
    from mlflow import MlflowClient

    done = launch("hardware=slurm_cpu", "model=micro", "wait=true", "hardware.max_restarts=0", f"run.out_dir={tmp_path}",
                  f"tracking.uri={tracking_uri}",
                  extra_env={"MARIN_SLURM_ENTRY": f"{ENTRIES}:die", "MARIN_TEST_DYING_TASK": "0"})
    assert done.returncode == 1, done.stdout + done.stderr
    run_dir = Path(field(done.stdout, "run directory"))
    run = MlflowClient(tracking_uri).get_run(field(done.stdout, "mlflow run"))
    assert run.info.status == "FAILED" and "restart budget spent" in run.data.tags["failure"]
    [fault] = [json.loads(line) for line in (run_dir / restarts.RESTARTS).read_text().splitlines()]
    assert fault["restarted"] is False and "SIGKILL" in fault["cause"]
    info = json.loads((run_dir / "record.json").read_text())
    assert info["status"] == "FAILED" and info["restarts"] == 0
    logs = "".join(p.read_text() for p in (run_dir / "slurm").glob("*_0_log.err"))
    assert "restarts of at most 0 spent" in logs and "resume=" in logs
