"""Preemption: SIGTERM / SIGUSR2 set a flag that the loop checks once per step.

Slurm sends USR2 `hardware.signal_delay_s` before the time limit (submitit's `--signal`), and
SIGTERM (then USR2, as submitit's `_interrupt` does) when a job is preempted. Acting inside the
signal handler could interrupt a collective or a half-dispatched step, so the handler only sets
a flag; the loop then checkpoints at a step boundary and calls `requeue()`:

    if preempt.requested():                    # every process agrees on the same step
        ckpt.save(step, state, meta, force=True); ckpt.wait()
        preempt.requeue()                      # under Slurm: requeue the job and exit
        return                                 # (only reached outside Slurm)

The requeued job starts the same submitted function again; it restores the newest complete
checkpoint of the same run directory and logs to the same MLflow run.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

log = logging.getLogger("marin.preempt")

SIGNALS = (signal.SIGTERM, signal.SIGUSR2)
_flag = threading.Event()
_max_requeues = 3


def _on_signal(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    if not _flag.is_set():
        # No logging here: the logging lock may be held by the interrupted code.
        os.write(2, f"[marin] caught {signal.Signals(signum).name}: checkpointing at the next step\n".encode())
    _flag.set()


def install(max_requeues: int = 3) -> None:
    """Route SIGTERM and SIGUSR2 to the flag (replacing submitit's handlers). Main thread only.
    `max_requeues` (hardware.max_requeues) bounds how often `requeue()` requeues one job."""
    global _max_requeues
    _max_requeues = max_requeues
    if threading.current_thread() is not threading.main_thread():
        log.warning("preemption handler not installed: not on the main thread")
        return
    for sig in SIGNALS:
        signal.signal(sig, _on_signal)


def trigger() -> None:
    """Ask for a checkpoint-and-stop as a signal would (tests, or code that sees a deadline)."""
    _flag.set()


def reset() -> None:
    _flag.clear()


def _any_process(flag: bool) -> bool:
    """True if any process of the job saw a signal: they must all stop at the same step, or the
    checkpoint's collective writes would wait forever for the processes that did not."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.array([flag], dtype=np.int32))))


def requested() -> bool:
    """Whether the run should checkpoint and stop now (one small collective with several processes)."""
    return _any_process(_flag.is_set())


def under_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


def restart_count() -> int:
    """How many times Slurm has requeued this job already."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def requeue(max_requeues: int | None = None) -> bool:
    """Under Slurm: requeue this job (process 0) and exit every process without a result, so
    submitit keeps waiting for the requeued run. Outside Slurm: return False (the run stops; it
    continues with `resume=<run directory>`)."""
    if not under_slurm():
        log.warning("stopped by a signal; continue with: python launch.py resume=<run directory>")
        return False
    import jax

    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("marin-preempt-requeue")  # every checkpoint is written
    if max_requeues is None:
        max_requeues = _max_requeues
    if restart_count() >= max_requeues:
        log.error("job %s was already requeued %d times (hardware.max_requeues); not requeueing: "
                  "continue with resume=<run directory>", os.environ["SLURM_JOB_ID"], restart_count())
        _exit(1)
    if jax.process_index() == 0:
        job_id = os.environ["SLURM_JOB_ID"]  # an array element's own id: requeues just that element
        subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=60)
        log.warning("requeued Slurm job %s (restart %d of at most %d)", job_id, restart_count() + 1, max_requeues)
    _exit(0)


def _exit(code: int) -> None:
    """Leave without a submitit result file: SystemExit is not an Exception, so submitit writes
    neither a result nor an error, and `job.result()` waits for the requeued run."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)
