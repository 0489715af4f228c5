"""A multirun's jobs, checked together before the first one starts (the launcher's step 1).

Kept out of hydra_plugins/ (Hydra imports that package's modules in its own way) so the checks
are plain functions: the local and the Slurm paths of `MarinLauncher` share them, and tests call
them without Hydra's machinery. No JAX.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import filter_overrides
from omegaconf import DictConfig

from marin.config.validate import ConfigError
from marin.launch.checks import load
from marin.launch.distributed import check_gpu_install
from marin.launch.fork import ForkError
from marin.launch.fork import compose as compose_fork
from marin.launch.memory import launch_refusal
from marin.launch.reproduce import ReproduceError, recompose
from marin.track.errors import first_line


@dataclass
class Job:
    idx: int
    overrides: list[str]
    sweep_config: Optional[DictConfig] = None  # with its `hydra` node
    task: Optional[DictConfig] = None          # without it: what the task function gets
    composed: Any = None                       # the validated Config (None: not validated here)
    resolved: Any = None
    label: str = ""
    problems: list[str] = field(default_factory=list)
    record_overrides: Optional[list[str]] = None  # a fork's: the parent's, then the job's (marin/launch/fork.py)

    @property
    def trains(self) -> bool:
        """Makes a run record (not a dry run; resume/reproduce reuse or recompose their own)."""
        t = self.task
        return t is not None and not t.get("dry_run") and not t.get("resume") and not t.get("reproduce")

    @property
    def slurm(self) -> bool:
        return self.trains and self.task.hardware.launcher == "slurm"


def labels(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """What tells each job apart: its overrides that not every job shares (all, for one job)."""
    lists = [filter_overrides(list(o)) for o in job_overrides]
    common = set.intersection(*(set(o) for o in lists)) if len(lists) > 1 else set()
    return [" ".join(o for o in ovr if o not in common) or "(no overrides)" for ovr in lists]


def check_jobs(jobs: list[Job]) -> list[str]:
    """Validate every composed job (schema and cross-field checks, a Slurm job's GPU install);
    fills `composed`/`resolved`, returns one line per problem: `job 2/4 (optim.lr=-1): field: why`."""
    lines, first_of = [], {}
    for n, job in enumerate(jobs, start=1):
        same = first_of.setdefault(frozenset(job.overrides), n)
        if same != n:  # `optim.lr=1e-3,1e-3`: the same run twice, under one name
            shown = job.label if job.label != "(no overrides)" else " ".join(filter_overrides(job.overrides))
            lines.append(f"job {n}/{len(jobs)} ({shown}): the same overrides as job {same}: a value is listed twice")
            continue
        where = f"job {n}/{len(jobs)} ({job.label})"
        if job.problems:
            lines += [f"{where}: {p}" for p in job.problems]
            continue
        if job.task.get("resume"):
            continue  # checked against the run when the job runs (its lock, its checkpoints)
        if job.task.get("reproduce"):  # the saved run found and its config recomposed; run again by the job
            try:
                _as_the_job(job, lambda: _quietly(recompose, str(job.task.reproduce), filter_overrides(job.overrides)))
            except ReproduceError as err:
                lines.append(f"{where}: reproduce: {err}")
            except ConfigError as err:
                lines += [f"{where}: {name}: {msg}" for name, msg in err.problems]
            continue
        if job.task.get("fork"):  # the parent's config with the job's overrides (a paired A/B's arms)
            try:
                made = _as_the_job(job, lambda: compose_fork(str(job.task.fork), filter_overrides(job.overrides)))
            except ForkError as err:
                lines.append(f"{where}: {err}")
                continue
            job.composed, job.resolved, job.record_overrides = made.composed, made.resolved, made.overrides
            if job.trains and (problem := launch_refusal(job.resolved)) is not None:
                lines.append(f"{where}: {problem}")
            continue
        try:
            job.composed, job.resolved = load(job.task)
        except ConfigError as err:
            lines += [f"{where}: {name}: {msg}" for name, msg in err.problems]
            continue
        except Exception as err:  # an OmegaConf type error while converting, say
            lines.append(f"{where}: {first_line(err)}")
            continue
        if job.slurm and (problem := check_gpu_install(job.resolved.hardware)) is not None:
            lines.append(f"{where}: {problem}")
        if job.trains and (problem := launch_refusal(job.resolved)) is not None:
            lines.append(f"{where}: {problem}")
    return lines


def _quietly(fn, *args):
    """`fn(*args)` without its log lines (what a reproduction says is said when its job runs)."""
    logger = logging.getLogger("marin.launch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return fn(*args)
    finally:
        logger.setLevel(level)


def _as_the_job(job: Job, fn):
    """`fn()` with HydraConfig set to the job's (its config search path: an A/B's `ab` group)."""
    if job.sweep_config is None:
        return fn()
    before = HydraConfig.instance().cfg
    HydraConfig.instance().set_config(job.sweep_config)
    try:
        return fn()
    finally:
        HydraConfig.instance().cfg = before


SWEEP_FILE = "multirun.yaml"


def discard_sweep_file(sweep_dir) -> None:
    """Remove the sweep folder (marin.config.store.sweep_folder: Hydra's ``multirun.yaml`` there is
    a link to /dev/null) once the launcher starts, and again when it ends (Hydra makes the folder
    again for each job): nothing reads it, marin writes each sweep's record itself."""
    if not sweep_dir:
        return
    folder = Path(str(sweep_dir))
    (folder / SWEEP_FILE).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # not empty (a job's files), or already gone
        pass

