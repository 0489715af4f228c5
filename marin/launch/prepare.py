"""`python -m marin.data.prepare` at the tool layer: the data module's command, plus a Slurm job
array for hardware with ``launcher: slurm`` (`submit_array`).

The array has one task per task of the plan (`marin.data.prepare_tasks.run_task`: its file groups
into shards, then the index of every source it completed), each a single process of
`hardware.cpus_per_task` CPUs, with the hardware's partition, account, time limit and environment
(`marin.launch.slurm.slurm_parameters`). Its logs and submissions are under
``<cache>/slurm/``. With ``wait=true`` the command follows the array and prints the prepared
sources (a bar counts the tasks ended); otherwise it returns after submitting: the array's last task writes each index, and the
same command run again afterwards checks every shard and redoes what is missing.
"""
from __future__ import annotations

import subprocess
import sys
import time

import submitit

from marin.data import prepare as data_prepare
from marin.data import prepare_tasks
from marin.launch import command_line
from marin.launch.slurm import clean_environment, secret_environment, slurm_parameters
from marin.track.secrets import guard_output, mask


def array_parameters(cfg, tasks: int) -> dict:
    """The hardware's Slurm parameters for one task of the array: one node, one process."""
    params = slurm_parameters(cfg)
    params.pop("additional_parameters", None)   # a training job's placement (racks, segments)
    params.pop("gpus_per_node", None)
    params.pop("exclusive", None)
    params.update(job_name=f"marin-prepare-{cfg.data.name}", nodes=1, ntasks_per_node=1,
                  array_parallelism=tasks)
    return params


def submit_array(cfg, plan) -> bool:
    """Submit the plan's tasks as one array; with `cfg.wait`, follow it (True when every source is
    indexed). Raises `UnreadableSource` (a task's failure, naming it) when a task failed."""
    n = len(plan.tasks)
    folder = data_prepare.cache_dir(cfg) / "slurm" / time.strftime("%Y%m%d-%H%M%S")
    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=cfg.hardware.max_requeues)
    ex.update_parameters(**array_parameters(cfg, n))
    try:
        with clean_environment(), secret_environment(cfg):
            jobs = ex.map_array(prepare_tasks.run_task, [plan] * n, list(range(n)))
    except (submitit.core.utils.FailedJobError, OSError, subprocess.SubprocessError) as err:
        raise prepare_tasks.UnreadableSource(f"sbatch failed: {mask(str(err).strip())}") from err
    array = jobs[0].job_id.split("_")[0] if jobs else "?"
    print(f"slurm array: {array} ({n} tasks)\nlogs: {folder}/{array}_*_log.out", flush=True)
    if not cfg.wait:
        print("its last task writes each source's index; run this command again afterwards to check every "
              "shard (and redo any a killed task lost)", flush=True)
        return False
    _follow(jobs)
    failed = []
    for t, job in enumerate(jobs):
        try:
            job.result()
        except Exception as err:  # submitit's FailedJobError carries the task's traceback
            failed.append(f"task {t} ({job.job_id}): {str(err).strip().splitlines()[-1] if str(err).strip() else err}")
    if failed:
        raise prepare_tasks.UnreadableSource("the array failed:\n  " + "\n  ".join(failed))
    for s in range(len(plan.sources)):
        prepare_tasks.finalize(plan, s)
    return True


def _follow(jobs, poll_s: float = 2.0) -> None:
    """A bar of the array's tasks ended, until all have (submitit polls Slurm's accounting)."""
    from tqdm import tqdm

    with tqdm(total=len(jobs), desc="array tasks ended", unit="task", file=sys.stderr) as bar:
        while (ended := sum(job.done() for job in jobs)) < len(jobs):
            bar.update(ended - bar.n)
            time.sleep(poll_s)
        bar.update(ended - bar.n)


def main(argv: list[str] | None = None) -> int:
    """launch.py's command line, refused and reported as launch.py's is (one line, exit 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    guard_output(argv)
    command_line.refuse(["python -m marin.data.prepare", *argv], sweep_hint="prepare one config at a time")
    command_line.report_in_one_line()
    return data_prepare.main(argv, submit=submit_array)


if __name__ == "__main__":
    sys.exit(main())
