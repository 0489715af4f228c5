"""marin's Hydra launcher: every job of a multirun is validated before the first one starts.

`python launch.py -m optim.lr=1e-3,3e-3 [hardware=slurm_cpu]`:

1. compose and validate every job (`check_jobs`): a bad job prints one line naming its overrides
   and the field and exits 2 before anything is trained, written or submitted;
2. make the sweep's MLflow parent run and print its id, directory and the `marin.status` command;
3. jobs with a Slurm hardware: create each job's run directory and MLflow run and submit them as
   one job array per distinct request (submitit's `executor.batch()`), print a line per job and
   return (`wait=true` follows the array);
4. other jobs run here, one after another; one that fails does not stop the others; the parent
   ends FINISHED, FAILED or KILLED (Ctrl-C) with them, and the exit status is the worst job's.

A multirun `dry_run=json` prints one JSON line per job: its overrides and its plan; `dry_run=true`
one row per job under one header (marin.launch.plan.plan_row; a single job's table: run it alone).
hydra-submitit-launcher is not used: it blocks until every job ends and cannot start the
multi-process JAX tasks this project needs (see marin/launch/slurm.py).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from typing import Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, filter_overrides, run_job, setup_globals
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, open_dict

from marin.cli import fail, setup_logging
from marin.config.schema import Config
from marin.config.store import name_options, shell_join
from marin.launch import slurm
from marin.launch.command_line import hydra_problem
from marin.launch.multirun import Job, check_jobs, discard_sweep_file, labels
from marin.launch.plan import plan, plan_row, row_header
from marin.track import backend, record, secrets, sweep
from marin.track.errors import first_line

log = logging.getLogger("marin.launcher")


def _task_config(sweep_config: DictConfig) -> DictConfig:
    task = OmegaConf.create(OmegaConf.to_container(sweep_config, resolve=False))
    with open_dict(task):
        del task["hydra"]
    return name_options(OmegaConf.merge(_schema(), task), sweep_config.hydra.runtime.choices)


def _schema():
    return OmegaConf.structured(Config)


class MarinLauncher(Launcher):
    def __init__(self, array_parallelism: int = 64, poll_s: float = 5.0) -> None:
        super().__init__()
        self.array_parallelism = array_parallelism
        self.poll_s = poll_s
        self.config: Optional[DictConfig] = None
        self.task_function: Optional[TaskFunction] = None
        self.hydra_context: Optional[HydraContext] = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.hydra_context = hydra_context
        self.task_function = task_function

    # ------------------------------------------------------------------ all jobs
    def compose(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Job]:
        jobs = []
        for (idx, overrides), label in zip(enumerate(job_overrides, start=initial_job_idx), labels(job_overrides)):
            job = Job(idx, list(overrides), label=label)
            try:
                job.sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
                with open_dict(job.sweep_config):
                    job.sweep_config.hydra.job.id = idx
                    job.sweep_config.hydra.job.num = idx
                job.task = _task_config(job.sweep_config)
            except Exception as err:  # Hydra's composition: an unknown key or option
                job.problems.append(hydra_problem(err))
            jobs.append(job)
        return jobs

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        setup_logging()
        assert self.config is not None and self.hydra_context is not None
        sweep_dir = self.config.hydra.sweep.dir
        discard_sweep_file(sweep_dir)  # Hydra's copy of the command line, secrets included
        try:
            return self._launch(job_overrides, initial_job_idx)
        finally:
            discard_sweep_file(sweep_dir)

    def _launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        jobs = self.compose(job_overrides, initial_job_idx)
        problems = check_jobs(jobs)
        if problems:  # one line each; nothing was started, written or submitted
            print("\n".join(f"error: {p}" for p in problems), file=sys.stderr)
            sys.exit(2)

        sweeps = self._begin_sweeps([j for j in jobs if j.trains])
        returns: dict[int, JobReturn] = {}
        slurm = [j for j in jobs if j.slurm]
        if slurm:
            returns.update(self._submit_array(slurm))
        local = [j for j in jobs if j.idx not in returns]
        failed, interrupted = [], False
        try:
            for job in local:
                if job.task.get("dry_run") == "json" and job.resolved is not None:
                    returns[job.idx] = self._json_plan(job)
                    continue
                if job.task.get("dry_run") is True and job.resolved is not None:  # one row per job
                    returns[job.idx] = self._plan_row(job, f"{jobs.index(job) + 1}/{len(jobs)}", header=not returns)
                    continue
                log.info("job %d/%d: %s", jobs.index(job) + 1, len(jobs), job.label)
                returns[job.idx], code = self._run_here(job)
                if code:
                    failed.append((job, code))
        except KeyboardInterrupt:
            interrupted = True
            raise
        finally:
            self._end_sweeps(sweeps, slurm, interrupted)
        if failed:
            for job, code in failed:
                print(f"error: job {jobs.index(job) + 1}/{len(jobs)} ({job.label}) failed (exit status {code})",
                      file=sys.stderr)
            sys.exit(max(code for _, code in failed))
        return [returns[j.idx] for j in jobs]

    def _run_here(self, job: Job) -> tuple[JobReturn, int]:
        """Run one job in this process; (its return, 0 or the exit status it failed with)."""
        try:
            ret = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                          config=job.sweep_config, job_dir_key="hydra.sweep.dir",
                          job_subdir_key="hydra.sweep.subdir")
        except SystemExit as exit_:  # `fail(...)` or a non-finite loss: the other jobs still run
            code = exit_.code if isinstance(exit_.code, int) else 1
            ret = JobReturn(overrides=job.overrides, status=JobStatus.COMPLETED if not code else JobStatus.FAILED)
            ret.return_value = None if not code else RuntimeError(f"exit status {code}")
            return ret, code
        if ret.status == JobStatus.FAILED:
            err = ret._return_value  # noqa: SLF001 (reading it would raise)
            log.error("job %s failed", job.label, exc_info=(type(err), err, err.__traceback__))
            return ret, 1
        return ret, 0

    def _plan_row(self, job: Job, number: str, header: bool) -> JobReturn:
        if header:
            print(row_header())
        print(plan_row(plan(job.resolved), number, job.label), flush=True)
        ret = JobReturn(overrides=job.overrides, status=JobStatus.COMPLETED)
        ret.return_value = None
        return ret

    def _json_plan(self, job: Job) -> JobReturn:
        print(json.dumps({"job": job.idx, "overrides": filter_overrides(job.overrides), **plan(job.resolved)},
                         default=str), flush=True)
        ret = JobReturn(overrides=job.overrides, status=JobStatus.COMPLETED)
        ret.return_value = None
        return ret

    # ------------------------------------------------------------------ the sweep's parent
    def _begin_sweeps(self, jobs: list[Job]) -> list:
        """Make each sweep's parent run before any job and say where to watch it."""
        groups: dict[tuple, list[Job]] = {}
        for job in jobs:
            r = job.resolved
            groups.setdefault((backend.tracking_uri(r), backend.experiment_name(r), sweep.sweep_name(r)), []).append(job)
        made = []
        try:
            for members in groups.values():
                before = HydraConfig.instance().cfg
                HydraConfig.instance().set_config(members[0].sweep_config)  # as the job will see it
                try:
                    launch = sweep.begin(members[0].resolved, expected=len(members))
                finally:
                    HydraConfig.instance().cfg = before
                if launch is None:
                    continue
                made.append(launch)
                print(announce(launch, len(members)), file=sys.stderr, flush=True)
        except backend.TrackingUnavailable as err:
            fail(f"{err}\nno job was started")
        return made

    def _end_sweeps(self, sweeps: list, slurm: list[Job], interrupted: bool) -> None:
        """Close the parents of jobs that ran here (Slurm children close theirs when they end)."""
        if slurm:
            sweep.release()
            return
        for launch in sweeps:
            try:
                status = sweep.end(launch, interrupted)
                log.info("sweep %s: parent run %s %s", launch.name, launch.parent_id, status)
            except Exception as err:  # the store went away: status= closes it later
                log.warning("could not close the sweep's parent run %s: %s", launch.parent_id, first_line(err) or type(err).__name__)

    # ------------------------------------------------------------------ Slurm
    def _submit_array(self, jobs: list[Job]) -> list[tuple[int, JobReturn]]:
        records = []
        try:
            for job in jobs:
                # as Hydra's run_job does: the record reads the job's Hydra config (multirun mode,
                # job number) to attach the job to its sweep's MLflow parent run
                HydraConfig.instance().set_config(job.sweep_config)
                records.append(record.create(job.composed, job.resolved, job.record_overrides or job.overrides))
        except backend.TrackingUnavailable as err:
            fail(f"{err}\nnothing was submitted")

        # One array per distinct request (an array shares its sbatch parameters). The job name is
        # not part of the request: each job's run.name is its own (sweep.job_name), the array's is the sweep's.
        groups: dict[str, list[int]] = {}
        for i, job in enumerate(jobs):
            request = {k: v for k, v in slurm.slurm_parameters(job.resolved).items() if k != "job_name"}
            groups.setdefault(repr(sorted(request.items())), []).append(i)
        out_root = backend.out_dir(jobs[0].resolved) / "slurm-arrays"
        submitted = {}
        for members in groups.values():
            first = jobs[members[0]].resolved
            folder = out_root / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            ex = slurm.executor(first, folder)
            ex.update_parameters(array_parallelism=self.array_parallelism,
                                 job_name=f"marin-{sweep.sweep_name(first) or first.run.name}")
            # secrets reach the jobs through sbatch's environment, not the script or the submission
            with slurm.clean_environment(), slurm.secret_environment(first), ex.batch():
                pending = [ex.submit(slurm.TrainJob(slurm.config_yaml(jobs[i].composed), slurm.record_fields(records[i]),
                                                    slurm.entry()))
                           for i in members]
            for i, sub in zip(members, pending):
                submitted[i] = sub
                slurm._remember_job(records[i], sub.job_id)  # noqa: SLF001 (same package)
            print(f"slurm array {pending[0].job_id.split('_')[0]}: {len(members)} jobs, logs in {folder}", flush=True)

        returns = []
        for i, job in enumerate(jobs):
            sub, rec = submitted[i], records[i]
            print(f"  {job.label}: job {sub.job_id}  run {rec.run_id}  {rec.run_dir}", flush=True)
            ret = JobReturn(overrides=job.overrides, cfg=job.task, hydra_cfg=job.sweep_config,
                            working_dir=os.getcwd(), task_name=job.sweep_config.hydra.job.name,
                            status=JobStatus.COMPLETED)
            ret.return_value = {"job_id": sub.job_id, "run_dir": str(rec.run_dir), "run_id": rec.run_id}
            returns.append((job.idx, ret))

        if any(job.resolved.wait for job in jobs):
            failed = [submitted[i].job_id for i in range(len(jobs)) if slurm.follow(submitted[i], self.poll_s)]
            if failed:
                print(f"error: {len(failed)} of {len(jobs)} jobs failed: {', '.join(failed)}", file=sys.stderr)
                sys.exit(1)
        return returns


def announce(launch: sweep.Launch, jobs: int) -> str:
    """The sweep's lines before its first job: its parent run, its directory (absolute: the line
    is pasted from a log read elsewhere, or after a `cd`) and the command that watches it."""
    folder = str(launch.folder.resolve())
    return (f"sweep {launch.name}: {jobs} jobs, MLflow parent run {launch.parent_id} "
            f"(experiment {launch.experiment}, {secrets.safe_uri(launch.uri)})\n"
            f"  directory: {folder}\n"
            f"  watch it:  {shell_join(['python', '-m', 'marin.status', folder])}")
