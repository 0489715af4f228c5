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
import functools
import importlib
import logging
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import submitit
from omegaconf import OmegaConf

from marin.cli import fail, raise_if_interrupted, setup_logging
from marin.config import derive
from marin.config.schema import Config
from marin.launch import distributed, restarts
from marin.launch.checks import load
from marin.launch.distributed import check_gpu_install, process_environment
from marin.launch.memory import launch_refusal
from marin.track import backend, secrets
from marin.track import record as run_record
from marin.track.record import RunRecord, config_dict, update_info
from marin.track.secrets import mask
from marin.train import preempt
from marin.train.ending import resume_command

log = logging.getLogger("marin.slurm")

DEFAULT_ENTRY = "marin.train.loop:train"   # what a task runs: entry(resolved_config, run_record)
ENTRY_VARIABLE = "MARIN_SLURM_ENTRY"        # module:function to run instead (smoke tests of the launch path)
# Besides SLURM_* (submitit's clean_env), variables of the submitting shell that would mislead the
# job's processes: its GPU binding and a fixed JAX coordinator (two jobs on a node would collide).
HIDDEN_FROM_JOBS = ("CUDA_VISIBLE_DEVICES", "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT", "JAX_NUM_PROCESSES",
                    "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS")
ACTIVE_STATES = ("PENDING", "RUNNING", "REQUEUED", "CONFIGURING", "COMPLETING", "RESIZING", "SUSPENDED")
SEGMENT_SINCE = (24, 5)   # sbatch --segment (with topology/block) came in Slurm 24.05
# An older Slurm keeps a one-segment job in one rack with --switches=1@<wait> on topology/tree (a
# leaf switch per rack); the wait is capped by the site's SchedulerParameters=max_switch_wait.
SWITCH_WAIT = "24:00:00"
# srun ends the step when any task exits non-zero (a dead task would leave the others hanging in
# a collective); the batch script then applies the restart policy (marin/launch/restarts.py).
SRUN_ARGS = ["--kill-on-bad-exit=1"]


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
        "mem": None if hw.mem_gb is None else f"{hw.mem_gb}GB" if hw.mem_gb else "0",   # 0: all of it
        "exclusive": True if hw.exclusive else None,
        "partition": hw.partition,
        "account": hw.account,
        "qos": hw.qos,
        "constraint": hw.constraint,
        "time": hw.time_min,
        "signal_delay_s": hw.signal_delay_s,
        "setup": setup_lines(cfg),
        "srun_args": SRUN_ARGS,
        "additional_parameters": placement(hw, slurm_version()) or None,
    }
    return {k: v for k, v in params.items() if v is not None}


@functools.lru_cache(maxsize=1)
def slurm_version() -> tuple[int, int] | None:
    """(major, minor) of this machine's sbatch (`slurm-wlm 22.05.8` → (22, 5)); None without one."""
    try:
        done = subprocess.run(["sbatch", "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"(\d+)\.(\d+)", done.stdout)
    return (int(match.group(1)), int(match.group(2))) if match else None


def placement(hw, version: tuple[int, int] | None) -> dict:
    """sbatch options that keep each `segment_nodes` nodes in one NVLink domain: `--segment`
    (Slurm ≥ 24.05, topology/block), or on an older Slurm `--switches=1@…` for a job that is one
    segment (topology/tree with a leaf switch per rack). `placement_problem` refuses the rest."""
    if not hw.segment_nodes:
        return {}
    if version is None or version >= SEGMENT_SINCE:  # no sbatch here (a dry run): as on a current Slurm
        return {"segment": hw.segment_nodes}
    return {"switches": f"1@{SWITCH_WAIT}"}


def placement_problem(cfg, version: tuple[int, int] | None = None) -> str | None:
    """One line if this Slurm cannot place the job as `hardware.segment_nodes` asks; else None."""
    hw = cfg.hardware
    if not hw.segment_nodes:
        return None
    nodes = derive.total_nodes(hw)
    if nodes % hw.segment_nodes:
        return (f"hardware.segment_nodes={hw.segment_nodes} must divide the job's {nodes} nodes "
                f"(hardware.racks × hardware.nodes)")
    version = version or slurm_version()
    if version is not None and version < SEGMENT_SINCE and nodes > hw.segment_nodes:
        return (f"hardware.segment_nodes={hw.segment_nodes}: Slurm {version[0]}.{version[1]:02d} has no --segment "
                f"(Slurm ≥ {SEGMENT_SINCE[0]}.{SEGMENT_SINCE[1]:02d} with topology/block); submit one job per "
                f"replica (hardware.racks=1: {hw.segment_nodes} nodes kept in one rack by --switches=1 on "
                f"topology/tree) or set hardware.segment_nodes=null")
    return None


def executor(cfg, folder: Path) -> submitit.SlurmExecutor:
    """submitit's executor for `cfg`, writing into `folder`; its batch script ends with the
    restart policy (`restart_lines`)."""
    ex = submitit.SlurmExecutor(folder=folder, max_num_timeout=cfg.hardware.max_requeues)
    params = slurm_parameters(cfg)
    params["setup"] = [*params["setup"], "marin_started=$(date +%s)  # for the restart policy"]
    ex.update_parameters(**params, teardown=restart_lines(folder))
    return ex


def restart_lines(folder: Path) -> list[str]:
    """The batch script's lines after srun: a failed srun's status goes to the restart policy,
    which requeues the job or ends its MLflow run FAILED (after one that succeeded there is nothing
    to do, and no interpreter to start); the job ends with srun's status."""
    policy = shlex.join([sys.executable, "-m", "marin.launch.restarts", str(Path(folder).resolve())])
    return ["marin_exit=$?  # srun's status: a task that died ended the step",
            f'if [ "$marin_exit" -ne 0 ]; then {policy} --exit-code "$marin_exit" --started "$marin_started"; fi',
            'exit "$marin_exit"']


def describe(cfg) -> str:
    """What would be submitted, in a few lines (dry runs print this)."""
    hw = cfg.hardware
    p = slurm_parameters(cfg)
    nodes, tasks = derive.total_nodes(hw), derive.process_count(hw)
    gpus = f"{hw.gpus_per_node} GPUs" if hw.gpus_per_node else "no GPUs"
    where = ", ".join(f"{k} {p[k]}" for k in ("partition", "account", "qos", "constraint") if k in p) or "default partition"
    memory = {None: "no memory request", "0": "all of its memory"}.get(p.get("mem"), p.get("mem"))
    per_node = [gpus, f"{hw.cpus_per_task * hw.tasks_per_node} CPUs", memory]
    racks = f"; {hw.racks} racks of {hw.nodes} nodes" if hw.racks != 1 else ""
    problem = placement_problem(cfg)
    lines = [
        f"slurm: {nodes} node{'s' if nodes != 1 else ''} × {hw.tasks_per_node} tasks = {tasks} processes "
        f"({nodes * hw.gpus_per_node} GPUs); per node: {', '.join(per_node)}{racks}",
        f"  {where}; time limit {hw.time_min} min (USR2 {hw.signal_delay_s} s before); "
        f"at most {hw.max_requeues} requeues after preemption, {hw.max_restarts} "
        f"restart{'' if hw.max_restarts == 1 else 's'} after a task dies",
        *([f"  placement: {_placement_words(p, problem)}"] if "exclusive" in p or "additional_parameters" in p else []),
        "  environment:",
        *(f"    {line}" for line in p["setup"]),
    ]
    return "\n".join(lines)


def _placement_words(p: dict, problem: str | None) -> str:
    if problem:  # what the job needs, and why this Slurm cannot give it
        return f"refused by this Slurm: {problem}"
    flags = [f"--{k}={v}" for k, v in p.get("additional_parameters", {}).items()]
    flags += ["--exclusive"] if p.get("exclusive") else []
    flags += ["--mem=0"] if p.get("mem") == "0" else []
    return " ".join(flags)


# ---------------------------------------------------------------------------- submit

def submit(composed, resolved, overrides: list[str]) -> None:
    """`launch.py` with a Slurm hardware: record, submit, print, return (or follow with wait)."""
    if (problem := placement_problem(resolved)) is not None:
        fail(problem)
    if (problem := memory_problem(resolved)) is not None:
        fail(problem)
    if (problem := check_gpu_install(resolved.hardware)) is not None:
        fail(problem)
    raise_if_interrupted()  # the last moment a Ctrl-C leaves nothing behind
    try:
        rec = run_record.create(composed, resolved, overrides)
    except backend.TrackingUnavailable as err:
        fail(f"{err}\nnothing was submitted")
    try:
        job = submit_record(composed, resolved, rec)
    except SubmitError as err:
        _mark_unsubmitted(rec, str(err))
        fail(f"{err}\nthe run directory {rec.run_dir} and MLflow run {rec.run_id} were created; "
             f"submit again with {resume_command(rec.run_dir)}", code=1)
    if resolved.wait:
        code = follow(job)
        if code:
            sys.exit(code)


def memory_problem(resolved) -> str | None:
    """The refusal of a run whose memory estimate exceeds the device's usable memory (the dry
    run's figures), unless plan.allow_over_memory; checked before anything is written."""
    return launch_refusal(resolved) if resolved.hardware.launcher == "slurm" else None


def _mark_unsubmitted(rec, reason: str) -> None:
    """The MLflow run of a job that sbatch refused: FAILED, with the reason (resume= reopens it)."""
    try:
        client = backend.client(rec.tracking_uri)
        client.set_tag(rec.run_id, "submit_error", mask(reason)[:5000])
        client.set_terminated(rec.run_id, "FAILED")
    except Exception as err:  # the record stays as it is; the message already says what to do
        log.warning("could not mark MLflow run %s as failed: %s", rec.run_id, err)


def _job_label(rec) -> str:
    return f"run directory: {rec.run_dir}\nmlflow run: {rec.run_id} ({run_record.mlflow_link(rec)})"


def clean_environment():
    """While sbatch runs (it exports the submitting environment): no SLURM_* of an outer job,
    nothing of `HIDDEN_FROM_JOBS`."""
    return submitit.helpers.clean_env(HIDDEN_FROM_JOBS)


def entry() -> str:
    return os.environ.get(ENTRY_VARIABLE) or DEFAULT_ENTRY


def submit_record(composed, resolved, rec):
    """Submit the training job of an existing run record; returns the submitit job."""
    if (problem := placement_problem(resolved)) is not None:
        raise SubmitError(problem)
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


def _ended(job) -> bool:
    """Whether Slurm has ended the job. Not submitit's `done()`: that counts a task's result file,
    and tasks that raised leave one while the restart policy requeues the job (where Slurm's
    state is unknown, as there, the result files decide)."""
    state = job.watcher.get_state(job.job_id, mode="force").upper()
    if state == "UNKNOWN":
        return job.done()
    return state not in ACTIVE_STATES + ("READY", "PREEMPTED")


def follow(job, poll_s: float = 2.0) -> int:
    """Wait for the job (through requeues), printing its state changes; 0 if it succeeded."""
    last = None
    while not _ended(job):
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
    # the requeues after a dead task are the restart policy's, not preemption's (max_requeues)
    faults = restarts.faults(fields["run_dir"], os.environ.get("SLURM_JOB_ID", ""))
    os.environ[restarts.FAULT_RESTARTS_VARIABLE] = str(len(faults))
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
