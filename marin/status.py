"""`python -m marin.status <sweep>`: a sweep's jobs at a glance.

The sweep is its name (`lr_grid`: the newest sweep of that name), its directory (printed when
`launch.py -m` starts) or its parent MLflow run id. Prints each job (the overrides that make it
differ) with its MLflow state, Slurm state, step N of M and latest training loss. Reconciles Slurm's view: a job that Slurm ended badly
(CANCELLED, OUT_OF_MEMORY, TIMEOUT, FAILED, …) while its MLflow run still says RUNNING never got
to finish its run, so the run is marked FAILED. The parent run is closed once every job has ended.
"""
from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from marin.cli import Parser, fail
from marin.track import backend, record, sweep
from marin.track.errors import first_line

SLURM_FAILED = ("CANCELLED", "OUT_OF_MEMORY", "TIMEOUT", "FAILED", "NODE_FAIL", "BOOT_FAIL", "DEADLINE")
LOSS = "train/loss"


@dataclass
class Job:
    run_id: str
    label: str
    state: str
    slurm_job: str | None
    slurm_state: str | None
    step: int | None      # steps done (the last logged step: optimizer step n logs at n)
    loss: float | None
    total: int | None = None  # the steps it will run (train.stop_after or train.steps)


def slurm_job_of(run) -> str | None:
    """The child's Slurm job: its slurm_job_id tag, else the newest in its record.json."""
    if run.data.tags.get("slurm_job_id"):
        return run.data.tags["slurm_job_id"]
    run_dir = run.data.tags.get("run_dir")
    try:
        jobs = json.loads((Path(run_dir) / record.INFO).read_text()).get("slurm_jobs") or []
    except (OSError, TypeError, ValueError):
        return None
    return str(jobs[-1]) if jobs else None


def slurm_states(job_ids: list[str]) -> dict[str, str]:
    """{job id: state} from sacct (first word: "CANCELLED by 0" → CANCELLED); {} without Slurm."""
    if not job_ids:
        return {}
    try:
        done = subprocess.run(["sacct", "-n", "-P", "-X", "-o", "JobID,State", "-j", ",".join(job_ids)],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    states = {}
    for line in done.stdout.splitlines():
        job, _, state = line.partition("|")
        if state:
            states[job.strip()] = state.split()[0]
    return states


def _latest(client, run_id: str, key: str) -> tuple[int | None, float | None]:
    history = client.get_metric_history(run_id, key)
    if not history:
        return None, None
    last = max(history, key=lambda m: (m.step, m.timestamp))
    return last.step, last.value


def _total(params: dict) -> int | None:
    """The steps a run will take, from its logged config."""
    for key in ("train.stop_after", "schedule.horizon_steps", "train.steps"):
        if str(params.get(key, "None")).isdigit():
            return int(params[key])
    return None


def reconcile(client, parent) -> tuple[list[Job], str | None]:
    """The jobs of the sweep, after marking FAILED the runs whose Slurm job ended badly; and the
    status the parent was closed with (None if it stays open)."""
    kids = sweep.children(client, parent)
    slurm_ids = {k.info.run_id: slurm_job_of(k) for k in kids}
    states = slurm_states(sorted({j for j in slurm_ids.values() if j}))
    jobs = []
    for kid in kids:
        run_id, status = kid.info.run_id, kid.info.status
        slurm_job = slurm_ids[run_id]
        slurm_state = states.get(slurm_job) if slurm_job else None
        if slurm_state in SLURM_FAILED and status not in sweep.TERMINAL:
            client.set_tag(run_id, "slurm_state", slurm_state)
            client.set_terminated(run_id, "FAILED")
            status = "FAILED"
        step, loss = _latest(client, run_id, LOSS)
        label = sweep.child_name(json.loads(kid.data.tags.get("sweep_overrides", "[]"))) or kid.info.run_name
        jobs.append(Job(run_id, label, status, slurm_job, slurm_state, step, loss,
                        _total(kid.data.params)))
    closed = sweep.close_if_done(client, parent.info.run_id)
    return jobs, closed


def print_table(parent, jobs: list[Job], closed: str | None, out=None) -> None:
    out = out or sys.stdout
    tags = parent.data.tags
    expected = tags.get("expected_jobs")
    print(f"sweep {tags.get('sweep')} ({tags.get('sweep_id')}): parent run {parent.info.run_id} "
          f"{parent.info.status}, "
          f"{len(jobs)}{'/' + expected if expected else ''} jobs", file=out)
    width = max([len(j.label) for j in jobs] + [3])
    on_slurm = any(j.slurm_job for j in jobs)  # the Slurm column only for sweeps that use it
    head = f"{'slurm':<22}  " if on_slurm else ""
    print(f"{'job':<{width}}  {'state':<9}  {head}{'step':>11}  {'loss':>8}  run", file=out)
    for j in jobs:
        slurm = (f"{j.slurm_job} {j.slurm_state or ''}".strip() if j.slurm_job else "-") if on_slurm else ""
        slurm = f"{slurm:<22}  " if on_slurm else ""
        step = f"{'-' if j.step is None else j.step}/{'?' if j.total is None else j.total}"
        loss = "-" if j.loss is None else f"{j.loss:.4f}"
        print(f"{j.label:<{width}}  {j.state:<9}  {slurm}{step:>11}  {loss:>8}  {j.run_id}", file=out)
    if closed:
        print(f"every job has ended: parent run closed {closed}", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m marin.status", description=__doc__.split("\n")[0])
    parser.add_argument("sweep", help="the sweep's name (its newest run), its directory "
                        "(outputs/sweeps/<name>-<id>) or its parent's MLflow run id")
    parser.add_argument("--tracking-uri", help="default: the sweep directory's, $MLFLOW_TRACKING_URI or the project's")
    parser.add_argument("--out-dir", help="where sweep names are looked up (default: the project's outputs/)")
    args = parser.parse_args(argv)
    try:
        client, parent = sweep.open_parent(args.sweep, args.tracking_uri, args.out_dir)
        jobs, closed = reconcile(client, parent)
    except (sweep.SweepNotFound, backend.TrackingUnavailable) as err:
        fail(first_line(err))
    except Exception as err:  # the store answered with an error
        fail(f"{args.sweep}: {first_line(err)}")
    print_table(client.get_run(parent.info.run_id), jobs, closed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
