"""Slurm launch through submitit: one task per JAX process (per GPU, or per CPU process).

At submit time (`submit`): check the install, create the run record (directory + MLflow run;
an unreachable tracking server stops here, before anything is submitted), submit, print the job
id, run directory and MLflow run id, and return — or, with `wait=true`, follow the job and exit
with its result. The job gets everything it needs as arguments (the composed config and the
record's directory, run id, tracking URI and experiment), so a requeued job — which runs the
same pickled submission again — continues the same run.

In each task (`TrainJob.__call__` → `job_main`): install the preemption handler, join the other
processes (`jax.distributed.initialize` from Slurm's variables), rebuild the config and call the
training loop. `TrainJob` is a submitit `Checkpointable`: if Slurm signals before the loop has
installed its own handler, submitit requeues the same submission.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import submitit
from omegaconf import OmegaConf

from marin.cli import fail, setup_logging
from marin.config import derive
from marin.config.schema import Config
from marin.launch import distributed
from marin.launch.checks import load
from marin.launch.distributed import check_gpu_install, process_environment
from marin.launch.memory import over_memory
from marin.track import backend, secrets
from marin.track import record as run_record
from marin.track.record import RunRecord, config_dict, update_info
from marin.track.secrets import mask, safe_uri
from marin.train import preempt

log = logging.getLogger("marin.slurm")

DEFAULT_ENTRY = "marin.train.loop:train"   # what a task runs: entry(resolved_config, run_record)
ENTRY_VARIABLE = "MARIN_SLURM_ENTRY"        # module:function to run instead (smoke tests of the launch path)
# Besides SLURM_* (submitit's clean_env), variables of the submitting shell that would mislead the
# job's processes: its GPU binding and a fixed JAX coordinator (two jobs on a node would collide).
HIDDEN_FROM_JOBS = ("CUDA_VISIBLE_DEVICES", "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_NUM_PROCESSES",
                    "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")
ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED")


class SubmitError(RuntimeError):
    """Nothing was submitted; the message says why."""


# ---------------------------------------------------------------------------- what is requested

def setup_lines(cfg) -> list[str]:
    """Shell lines of the batch script before `srun`: the hardware's environment (exported, so
    every task has it before Python starts) and its own setup lines. A secret (by name or value)
    is never written into the script (it lies in the run directory): sbatch passes it from the
    submitting environment instead (`secret_environment`)."""
    env = process_environment(cfg.hardware)
    lines = [f"# {k}: a secret, passed in sbatch's environment" if k in _secret_env(cfg)
             else f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    return [secrets.mask(line) for line in lines + list(cfg.hardware.setup)]


def _secret_env(cfg) -> dict[str, str]:
    """The hardware's environment variables that hold secrets (by name, or by a remembered value)."""
    return {k: str(v) for k, v in cfg.hardware.env.items()
            if (secrets.looks_secret(k) or secrets.mask(str(v)) != str(v)) and v != secrets.REDACTED}


@contextlib.contextmanager
def secret_environment(cfg):
    """While sbatch runs: the hardware's secrets in this process's environment, which sbatch
    exports to the job (so neither the batch script nor the pickled submission holds them)."""
    env = _secret_env(cfg)
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def slurm_parameters(cfg) -> dict:
    """Parameters of `submitit.SlurmExecutor` for this hardware (None = not requested)."""
    hw = cfg.hardware
    params = {
        "job_name": f"marin-{cfg.run.name}",
        "nodes": derive.total_nodes(hw),   # every rack: racks × nodes of one rack
        "ntasks_per_node": hw.tasks_per_node,
        "cpus_per_task": hw.cpus_per_task,
        "gpus_per_node": hw.gpus_per_node or None,   # every task sees all of its node's GPUs
        "mem": f"{hw.mem_gb}GB" if hw.mem_gb else None,
        "partition": hw.partition,
        "account": hw.account,
        "qos": hw.qos,
        "constraint": hw.constraint,
        "time": hw.time_min,
        "signal_delay_s": hw.signal_delay_s,
        "setup": setup_lines(cfg),
    }
    return {k: v for k, v in params.items() if v is not None}


def executor(cfg, folder: Path) -> submitit.SlurmExecutor:
    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=cfg.hardware.max_requeues)
    ex.update_parameters(**slurm_parameters(cfg))
    return ex


def describe(cfg) -> str:
    """What would be submitted, in a few lines (dry runs print this)."""
    hw = cfg.hardware
    p = slurm_parameters(cfg)
    nodes, tasks = derive.total_nodes(hw), derive.process_count(hw)
    gpus = f"{hw.gpus_per_node} GPUs" if hw.gpus_per_node else "no GPUs"
    where = ", ".join(f"{k} {p[k]}" for k in ("partition", "account", "qos", "constraint") if k in p) or "default partition"
    per_node = [gpus, f"{hw.cpus_per_task * hw.tasks_per_node} CPUs", p.get("mem", "no memory request")]
    racks = f"; {hw.racks} racks of {hw.nodes} nodes" if hw.racks != 1 else ""
    lines = [
        f"slurm: {nodes} node{'s' if nodes != 1 else ''} × {hw.tasks_per_node} tasks = {tasks} processes "
        f"({nodes * hw.gpus_per_node} GPUs); per node: {', '.join(per_node)}{racks}",
        f"  {where}; time limit {hw.time_min} min (USR2 {hw.signal_delay_s} s before); "
        f"at most {hw.max_requeues} requeues",
        "  environment:",
        *(f"    {line}" for line in p["setup"]),
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------- submit

def submit(composed, resolved, overrides: list[str]) -> None:
    """`launch.py` with a Slurm hardware: record, submit, print, return (or follow with wait)."""
    if (problem := memory_problem(resolved)) is not None:
        fail(problem)
    if (problem := check_gpu_install(resolved.hardware)) is not None:
        fail(problem)
    try:
        rec = run_record.create(composed, resolved, overrides)
    except backend.TrackingUnavailable as err:
        fail(f"{err}\nnothing was submitted")
    try:
        job = submit_record(composed, resolved, rec)
    except SubmitError as err:
        _mark_unsubmitted(rec, str(err))
        fail(f"{err}\nthe run directory {rec.run_dir} and MLflow run {rec.run_id} were created; "
             f"submit again with {shlex.quote(f'resume={rec.run_dir}')}", code=1)
    if resolved.wait:
        code = follow(job)
        if code:
            sys.exit(code)


def memory_problem(resolved) -> str | None:
    """The refusal of a run whose memory estimate exceeds the device's usable memory (the dry
    run's figures), unless plan.allow_over_memory; checked before anything is written."""
    if resolved.plan.allow_over_memory:
        return None
    return over_memory(resolved)


def _mark_unsubmitted(rec, reason: str) -> None:
    """The MLflow run of a job that sbatch refused: FAILED, with the reason (resume= reopens it)."""
    try:
        client = backend.client(rec.tracking_uri)
        client.set_tag(rec.run_id, "submit_error", mask(reason)[:5000])
        client.set_terminated(rec.run_id, "FAILED")
    except Exception as err:  # the record stays as it is; the message already says what to do
        log.warning("could not mark MLflow run %s as failed: %s", rec.run_id, err)


def _job_label(rec) -> str:
    return f"run directory: {rec.run_dir}\nmlflow run: {rec.run_id} ({safe_uri(rec.tracking_uri)})"


def clean_environment():
    """While sbatch runs (it exports the submitting environment): no SLURM_* of an outer job,
    nothing of `HIDDEN_FROM_JOBS`."""
    return submitit.helpers.clean_env(HIDDEN_FROM_JOBS)


def entry() -> str:
    return os.environ.get(ENTRY_VARIABLE) or DEFAULT_ENTRY


def submit_record(composed, resolved, rec):
    """Submit the training job of an existing run record; returns the submitit job."""
    folder = Path(rec.run_dir) / "slurm"
    ex = executor(resolved, folder)
    task = TrainJob(config_yaml(composed), record_fields(rec), entry())
    try:
        with clean_environment(), secret_environment(resolved):
            job = ex.submit(task)
    except (submitit.core.utils.FailedJobError, OSError, subprocess.SubprocessError) as err:
        raise SubmitError(f"sbatch failed: {mask(str(err).strip())}") from err
    _remember_job(rec, job.job_id)
    print(f"slurm job: {job.job_id}\n{_job_label(rec)}\nlogs: {folder}/{job.job_id}_*_log.out", flush=True)
    return job


def _remember_job(rec, job_id: str) -> None:
    jobs = rec.info().get("slurm_jobs", [])
    update_info(rec, slurm_jobs=[*jobs, str(job_id)])


def active_job(rec) -> str | None:
    """The run's newest Slurm job if it is still queued or running (else None)."""
    jobs = rec.info().get("slurm_jobs") or []
    if not jobs:
        return None
    try:
        done = subprocess.run(["squeue", "-h", "-j", jobs[-1], "-o", "%T"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = done.stdout.strip().split("\n")[0] if done.returncode == 0 else ""
    return jobs[-1] if state in ACTIVE_STATES else None


def follow(job, poll_s: float = 2.0) -> int:
    """Wait for the job (through requeues), printing its state changes; 0 if it succeeded."""
    last = None
    while not job.done(force_check=True):
        state = job.state
        if state != last:
            print(f"slurm job {job.job_id}: {state}", file=sys.stderr, flush=True)
            last = state
        time.sleep(poll_s)
    try:
        job.results()  # every task's (one per process)
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as err:
        print(f"error: slurm job {job.job_id} failed ({job.state}):\n{str(err)[-3000:]}", file=sys.stderr)
        return 1
    print(f"slurm job {job.job_id}: COMPLETED", file=sys.stderr, flush=True)
    return 0


# ---------------------------------------------------------------------------- in the job

def config_yaml(composed) -> str:
    """The composed config for the job, secrets <redacted> (the submission is pickled into the run
    directory; the job takes them from its environment, see `secret_environment`)."""
    return secrets.mask(OmegaConf.to_yaml(OmegaConf.create(secrets.redact(config_dict(composed)))))


def record_fields(rec) -> dict:
    return {"run_dir": str(rec.run_dir), "run_id": rec.run_id, "tracking_uri": rec.tracking_uri,
            "experiment_name": rec.experiment_name}


def rebuild(composed_yaml: str):
    """(composed, resolved) from the YAML of a composed config, validated again."""
    return load(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(composed_yaml)))


def job_main(composed_yaml: str, fields: dict, entry: str = DEFAULT_ENTRY):
    """What every task runs: preemption handler, distributed init, config, record, loop."""
    setup_logging()
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every step of every save at INFO
    _, resolved = rebuild(composed_yaml)
    distributed.apply_environment(resolved.hardware)
    preempt.install(max_requeues=resolved.hardware.max_requeues)
    distributed.initialize(resolved.hardware)
    rec = RunRecord(Path(fields["run_dir"]), fields["run_id"], fields["tracking_uri"], fields["experiment_name"])
    module, name = entry.split(":")
    return getattr(importlib.import_module(module), name)(resolved, rec)


class TrainJob(submitit.helpers.Checkpointable):
    """The submitted callable. Requeued as is (`checkpoint()` returns the same submission): the
    state it resumes from is the run directory's newest checkpoint, not anything in memory."""

    def __init__(self, composed_yaml: str, fields: dict, entry: str = DEFAULT_ENTRY):
        self.composed_yaml = composed_yaml
        self.fields = fields
        self.entry = entry

    def __call__(self):
        return job_main(self.composed_yaml, self.fields, self.entry)
