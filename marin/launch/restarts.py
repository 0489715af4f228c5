"""Automatic restarts of a Slurm job whose task died, within a budget (`hardware.max_restarts`).

The batch script runs the tasks with `srun --kill-on-bad-exit=1`, so one task that dies (a
non-zero exit, `kill -9`, the hang watchdog's `WATCHDOG_EXIT`, a GPU fault) ends the whole step;
after a failed srun the same script runs this module, outside the step (alive whichever task died):

    python -m marin.launch.restarts <submitit folder> --exit-code $? --started <epoch s>

(the run directory and `hardware.max_restarts` come from the job's pickled submission there)

- srun succeeded (0): nothing to do (the batch script does not start it then).
- a task died and this job has restarted fewer than N times after a fault: record the restart,
  set aside the result files the dead start's tasks left (`wait=true` must not read them as the
  job's end) and `scontrol requeue` the job. The requeued job runs the same submission, which
  restores the newest verified checkpoint of the run directory and logs to the same MLflow run
  (RUNNING again).
- the budget is spent: record that, and end the MLflow run FAILED — the tracking process died with
  the step, so nobody else would (the run would stay RUNNING). The job ends with srun's status.

Each fault is a line of `<run dir>/restarts.jsonl` (job, the job's fault count, step reached,
checkpoint step resumed from, cause (what a task raised, and srun's status), minutes of training
lost since that checkpoint, time, whether it restarted); the run's restarts (every job's) are
`restarts` in record.json, MLflow metrics at the step reached (`restart/count`,
`restart/minutes_lost`, `restart/resume_step`) and tags (`restarts`, `restart.<n>.cause`). The
budget is per Slurm job and apart from preemption's (SIGTERM/USR2, `hardware.max_requeues`): each
task learns its job's fault restarts (MARIN_FAULT_RESTARTS, set by marin.launch.slurm.job_main),
which marin.train.preempt subtracts from SLURM_RESTART_COUNT.

No JAX is imported here: the run record, submitit's pickle and MLflow.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from marin.cli import Parser, setup_logging
from marin.track import record as run_record
from marin.track import secrets
from marin.track.errors import first_line
from marin.train.checkpoint import checkpoint_dir, listed_steps
from marin.train.ending import resume_command
from marin.train.preempt import WATCHDOG_EXIT

log = logging.getLogger("marin.restarts")

RESTARTS = "restarts.jsonl"       # in the run directory: one line per fault of a job
FAULT_RESTARTS_VARIABLE = "MARIN_FAULT_RESTARTS"
LOSS = "train/loss"
_TAIL_BYTES = 1 << 20             # metrics.jsonl grows with the run: the step reached is near its end


def cause(exit_code: int) -> str:
    """srun's status in words (srun reports a task killed by signal n as 128 + n)."""
    if exit_code == WATCHDOG_EXIT:
        return f"the hang watchdog ended a task (exit {exit_code})"
    if exit_code > 128:
        try:
            name = signal.Signals(exit_code - 128).name
        except ValueError:
            name = f"signal {exit_code - 128}"
        return f"a task was killed by {name} (exit {exit_code})"
    return f"a task exited with status {exit_code}"


def task_error(folder: Path, job: str) -> str | None:
    """`task <n> raised <Type>: <message>` for the first task of this start that raised (secrets
    masked), else None. srun's status alone can mislead: once one task exits 1, srun ends the
    others, and one still starting (or exiting) dies by SIGTERM, which becomes srun's status
    (143). submitit writes the traceback of a task that raised to its result file (a task killed
    by a signal or the watchdog's exit writes none); earlier starts' files are set aside as
    `.fault<n>`."""
    from submitit.core.utils import pickle_load

    raised = []
    for path in Path(folder).glob(f"{job}_*_result.pkl"):
        try:
            outcome, value = pickle_load(path)
        except Exception:  # noqa: BLE001 — a file cut short by the kill: srun's status still says it
            continue
        if outcome == "error":
            lines = [line.strip() for line in str(value).splitlines() if line.strip()]
            task = path.name[len(job) + 1:].split("_")[0]
            raised.append((path.stat().st_mtime, f"task {task} raised {lines[-1] if lines else 'an error'}"))
    return secrets.mask(min(raised)[1]) if raised else None


def recorded(run_dir: Path) -> list[dict]:
    """Every recorded fault of the run, oldest first."""
    path = Path(run_dir) / RESTARTS
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut short when a node died
            continue
    return rows


def faults(run_dir: Path, job_id: str) -> list[dict]:
    """The recorded faults of Slurm job `job_id` (its budget; a `resume=` job starts a new one)."""
    return [row for row in recorded(run_dir) if str(row.get("job")) == str(job_id)]


def step_reached(run_dir: Path) -> int | None:
    """The last step whose training loss the run logged (from the end of metrics.jsonl)."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - _TAIL_BYTES))
            tail = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    steps = []
    for line in tail:
        try:
            row = json.loads(line)
        except ValueError:  # the first (cut) line of the tail, or a line the kill cut short
            continue
        if row.get("key") == LOSS:
            steps.append(int(row["step"]))
    return max(steps) if steps else None


def newest_checkpoint(run_dir: Path) -> tuple[int | None, float | None]:
    """(step, time written) of the newest committed checkpoint; the restart restores it, or the
    one before it if its bytes do not match its manifest."""
    steps = listed_steps(checkpoint_dir(run_dir))
    if not steps:
        return None, None
    step_dir = checkpoint_dir(run_dir) / str(steps[-1])
    # its manifests are written last, once the state is committed
    return steps[-1], max([p.stat().st_mtime for p in step_dir.iterdir()] + [step_dir.stat().st_mtime])


def fault_record(run_dir: Path, job_id: str, exit_code: int, started: float | None, now: float,
                 error: str | None = None) -> dict:
    """What is known of this fault: its cause (`error`, what a task raised, then srun's status;
    the watchdog first), the step reached, the checkpoint resumed from and the training lost since
    it (since the job started when there is none)."""
    resume_step, written = newest_checkpoint(run_dir)
    since = written if written is not None and (started is None or written >= started) else started
    if not error:
        why = cause(exit_code)
    elif exit_code == WATCHDOG_EXIT:  # a task's error then came of its peers' exit (a collective lost them)
        why = f"{cause(exit_code)}; then {error}"
    else:
        why = f"{error}; {cause(exit_code)}"
    return {"job": str(job_id), "count": len(faults(run_dir, job_id)) + 1, "step": step_reached(run_dir),
            "resume_step": resume_step or 0, "cause": why, "exit_code": exit_code,
            "minutes_lost": round(max(0.0, now - since) / 60, 3) if since is not None else None,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(now))}


def remember(run_dir: Path, fault: dict) -> None:
    with (Path(run_dir) / RESTARTS).open("a") as out:
        out.write(json.dumps(fault) + "\n")


def to_mlflow(rec, fault: dict, total: int, spent: bool) -> None:
    """The fault into the run's MLflow run (`total`: the run's restarts so far, every job's); past
    the budget, the run ends FAILED. Never raises: the requeue (or the job's failure) must not
    wait on the tracking store."""
    from marin.track import backend, worker

    try:
        if rec.tracking_uri.startswith(("http://", "https://")):
            backend.check_reachable(rec.tracking_uri, timeout=5.0)
        client = backend.client(rec.tracking_uri)
        step = fault["step"] or 0
        if not spent:
            client.log_metric(rec.run_id, "restart/count", total, step=step)
            client.log_metric(rec.run_id, "restart/resume_step", fault["resume_step"], step=step)
            if fault["minutes_lost"] is not None:
                client.log_metric(rec.run_id, "restart/minutes_lost", fault["minutes_lost"], step=step)
            client.set_tag(rec.run_id, f"restart.{total}.cause", fault["cause"])
        client.set_tag(rec.run_id, "restarts", str(total))
        if spent:
            client.set_tag(rec.run_id, "failure", f"{fault['cause']} at step {fault['step']}; restart budget "
                           f"spent ({fault['count'] - 1} restarts of this job, hardware.max_restarts)")
            worker.end(rec.tracking_uri, rec.run_id, "FAILED")
    except Exception as err:  # noqa: BLE001 — the run directory keeps the record
        log.warning("could not record the fault in MLflow run %s: %s", rec.run_id, first_line(err))


def handle(run_dir: Path, exit_code: int, max_restarts: int, job_id: str, started: float | None = None,
           requeue=None, error: str | None = None) -> str:
    """After srun: 'done' (it succeeded), 'requeued' or 'failed' (the budget is spent)."""
    if exit_code == 0:
        return "done"
    rec = run_record.open(run_dir)
    fault = fault_record(run_dir, job_id, exit_code, started, time.time(), error)
    spent = fault["count"] > max_restarts
    fault["restarted"] = not spent
    remember(run_dir, fault)
    restarts = fault["count"] - (1 if spent else 0)   # this job's
    total = sum(1 for row in recorded(run_dir) if row.get("restarted"))   # the run's, every job's
    run_record.update_info(rec, restarts=total)
    to_mlflow(rec, fault, total, spent)
    if spent:
        run_record.update_info(rec, status="FAILED", ended=fault["time"])
        log.error("job %s: %s at step %s; %d restarts of at most %d spent: MLflow run %s ends FAILED; "
                  "continue with: %s", job_id, fault["cause"], fault["step"], restarts,
                  max_restarts, rec.run_id, resume_command(run_dir))
        return "failed"
    log.warning("job %s: %s at step %s; restart %d of at most %d, from the checkpoint at step %s "
                "(%s min of training lost)", job_id, fault["cause"], fault["step"], restarts, max_restarts,
                fault["resume_step"], fault["minutes_lost"])
    (requeue or _requeue)(job_id)
    return "requeued"


def _requeue(job_id: str) -> None:
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)


def set_aside_results(folder: Path, job: str, count: int) -> None:
    """Rename the result files the dead start's tasks left (a task that raised writes its error
    there) to `…_result.pkl.fault<count>`: `wait=true` (submitit) would read them as the job's
    end while the requeued job runs; the restarted tasks write their own."""
    for path in Path(folder).glob(f"{job}_*_result.pkl"):
        path.rename(path.with_name(f"{path.name}.fault{count}"))


def submitit_job_id() -> str:
    """This job's id as submitit names its files (`<array>_<index>` for an array's element)."""
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    return f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ["SLURM_JOB_ID"]


def submission(folder: Path) -> tuple[Path, int]:
    """(run directory, hardware.max_restarts) of this job (an array's element included), from
    the submission submitit pickled into `folder`."""
    from omegaconf import OmegaConf
    from submitit.core.utils import DelayedSubmission, JobPaths

    task = DelayedSubmission.load(JobPaths(folder, job_id=submitit_job_id()).submitted_pickle).function  # a TrainJob
    composed = OmegaConf.create(task.composed_yaml)
    secrets.scan(OmegaConf.to_container(composed))  # its secret values are masked in the fault's cause
    hardware = composed.get("hardware") or {}
    return Path(task.fields["run_dir"]), int(hardware.get("max_restarts") or 0)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.launch.restarts", description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="the job's submitit folder")
    parser.add_argument("--exit-code", type=int, required=True, help="srun's exit status")
    parser.add_argument("--started", type=float, help="when this start of the job began (seconds since the epoch)")
    args = parser.parse_args(argv)
    if args.exit_code == 0:
        return 0
    setup_logging()
    try:
        run_dir, max_restarts = submission(args.folder)
        job_id, files = os.environ["SLURM_JOB_ID"], submitit_job_id()   # an array element's files: <array>_<index>
        count = len(faults(run_dir, job_id)) + 1

        def requeue(job: str) -> None:
            set_aside_results(args.folder, files, count)
            _requeue(job)

        handle(run_dir, args.exit_code, max_restarts, job_id, args.started, requeue, task_error(args.folder, files))
    except Exception as err:  # noqa: BLE001 — the job still ends with srun's status
        log.error("restart policy failed (%s); the job ends with status %d", first_line(err), args.exit_code)
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
