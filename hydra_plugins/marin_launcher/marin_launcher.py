"""A Hydra launcher that submits a multirun's Slurm jobs as one job array and returns at once.

`python launch.py -m hydra/launcher=marin_slurm hardware=slurm_cpu optim.lr=1e-3,3e-3` composes
every job, validates them all (one bad job stops the multirun before anything is created),
creates each job's run directory and MLflow run, then submits them through submitit's
`executor.batch()` — one `sbatch --array` per distinct hardware request — prints one line per
job and returns. `wait=true` follows the array. Jobs whose hardware is not Slurm (and dry runs)
run in this process one after another, as Hydra's basic launcher would run them.

hydra-submitit-launcher is not used: it blocks until every job ends and cannot start the
multi-process JAX tasks this project needs (see marin/launch/slurm.py).
"""
from __future__ import annotations

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

log = logging.getLogger("marin.launcher")


def _task_config(sweep_config: DictConfig) -> DictConfig:
    task = OmegaConf.create(OmegaConf.to_container(sweep_config, resolve=False))
    with open_dict(task):
        del task["hydra"]
    return OmegaConf.merge(_schema(), task)


def _schema():
    from marin.config.schema import Config

    return OmegaConf.structured(Config)


def _goes_to_slurm(task: DictConfig) -> bool:
    return (task.hardware.launcher == "slurm" and not task.get("dry_run")
            and not task.get("resume") and not task.get("reproduce"))


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

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.config is not None and self.hydra_context is not None
        jobs = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            jobs.append((idx, list(overrides), sweep_config, _task_config(sweep_config)))
        slurm = [j for j in jobs if _goes_to_slurm(j[3])]
        returns = dict(self._submit_array(slurm)) if slurm else {}
        for idx, overrides, sweep_config, task in jobs:
            if idx not in returns:
                log.info("#%d : %s", idx, " ".join(filter_overrides(overrides)))
                returns[idx] = run_job(hydra_context=self.hydra_context, task_function=self.task_function,
                                       config=sweep_config, job_dir_key="hydra.sweep.dir",
                                       job_subdir_key="hydra.sweep.subdir")
        return [returns[idx] for idx, *_ in jobs]

    # ------------------------------------------------------------------ Slurm
    def _submit_array(self, jobs) -> list[tuple[int, JobReturn]]:
        from marin.config.validate import ConfigError, load
        from marin.launch import slurm
        from marin.launch.distributed import check_gpu_install
        from marin.launch.entry import fail, setup_logging
        from marin.track import backend, record

        setup_logging()
        loaded, problems = [], []
        for idx, overrides, sweep_config, task in jobs:
            try:
                composed, resolved = load(task)
            except ConfigError as err:
                problems += [f"  job #{idx} ({' '.join(overrides)}): {n}: {m}" for n, m in err.problems]
                continue
            if (problem := check_gpu_install(resolved.hardware)) is not None:
                problems.append(f"  job #{idx}: {problem}")
            if (problem := slurm.memory_problem(resolved)) is not None:
                problems.append(f"  job #{idx}: {problem}")
            loaded.append((idx, overrides, sweep_config, composed, resolved))
        if problems:
            fail("invalid multirun: nothing was created or submitted\n" + "\n".join(problems))

        records = []
        try:
            for idx, overrides, sweep_config, composed, resolved in loaded:
                # as Hydra's run_job does: the record reads the job's Hydra config (multirun mode,
                # job number) to attach the job to its sweep's MLflow parent run
                HydraConfig.instance().set_config(sweep_config)
                records.append(record.create(composed, resolved, overrides))
        except backend.TrackingUnavailable as err:
            fail(f"{err}\nnothing was submitted")

        # One array per distinct request (an array shares its sbatch parameters).
        groups: dict[str, list[int]] = {}
        for i, (_, _, _, _, resolved) in enumerate(loaded):
            groups.setdefault(repr(sorted(slurm.slurm_parameters(resolved).items())), []).append(i)
        out_root = backend.out_dir(loaded[0][4]) / "slurm-arrays"
        submitted = {}
        for members in groups.values():
            first = loaded[members[0]][4]
            folder = out_root / f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
            ex = slurm.executor(first, folder)
            ex.update_parameters(array_parallelism=self.array_parallelism,
                                 job_name=f"marin-{first.run.sweep or first.run.name}")
            with slurm.clean_environment(), ex.batch():
                pending = [ex.submit(slurm.TrainJob(slurm.config_yaml(loaded[i][3]), slurm.record_fields(records[i]), slurm.entry()))
                           for i in members]
            for i, job in zip(members, pending):
                submitted[i] = job
                slurm._remember_job(records[i], job.job_id)  # noqa: SLF001 (same package)
            print(f"slurm array {pending[0].job_id.split('_')[0]}: {len(members)} jobs, logs in {folder}", flush=True)

        returns = []
        for i, (idx, overrides, sweep_config, composed, resolved) in enumerate(loaded):
            job, rec = submitted[i], records[i]
            print(f"  #{idx} job {job.job_id}  run {rec.run_id}  {rec.run_dir}", flush=True)
            ret = JobReturn(overrides=overrides, cfg=_task_config(sweep_config), hydra_cfg=sweep_config,
                            working_dir=os.getcwd(), task_name=sweep_config.hydra.job.name,
                            status=JobStatus.COMPLETED)
            ret.return_value = {"job_id": job.job_id, "run_dir": str(rec.run_dir), "run_id": rec.run_id}
            returns.append((idx, ret))

        if any(resolved.wait for *_, resolved in loaded):
            failed = [submitted[i].job_id for i in range(len(loaded)) if slurm.follow(submitted[i], self.poll_s)]
            if failed:
                print(f"error: {len(failed)} of {len(loaded)} jobs failed: {', '.join(failed)}", file=sys.stderr)
                sys.exit(1)
        return returns
