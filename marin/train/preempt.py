"""Preemption and interruption: SIGTERM / SIGUSR2 / SIGINT set a flag that the loop checks once
per step (`poll`).

Slurm sends USR2 `hardware.signal_delay_s` before the time limit (submitit's `--signal`), and
SIGTERM (then USR2, as submitit's `_interrupt` does) when a job is preempted. Acting inside the
signal handler could interrupt a collective or a half-dispatched step, so the handler only sets
a flag; at each step boundary the loop (`marin.train.trainer`) asks `poll()`, which gives every
process the same answer, and on a signal checkpoints and then requeues or stops:

    signum, rolling = preempt.poll(ckpt.time_due())   # every process agrees on the same step
    if signum:
        ckpt.save(step, state, meta, force=True); ckpt.wait()
        if preempt.requeues(signum):
            preempt.requeue()                  # under Slurm: requeue the job and exit
        raise Stopped(signum, step)            # the run ends with exit_code(signum)

The requeued job starts the same submitted function again; it restores the newest complete
checkpoint of the same run directory and logs to the same MLflow run.

Outside Slurm (and for SIGINT anywhere) the run stops instead: checkpoint at the step boundary,
MLflow run KILLED, one line with the `resume=` command, exit status 128 + the signal number
(130 for Ctrl-C, 143 for SIGTERM). A second Ctrl-C raises KeyboardInterrupt at once.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading

log = logging.getLogger("marin.preempt")

SIGNALS = (signal.SIGTERM, signal.SIGUSR2)   # preemption and time limit (requeue under Slurm)
STOP_SIGNALS = (signal.SIGINT,)               # Ctrl-C: checkpoint and stop, never requeue
_flag = threading.Event()
_received = 0          # the first signal's number
_max_requeues = 3


def _on_signal(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    global _received
    # No logging here: the logging lock may be held by the interrupted code.
    if signum == signal.SIGINT and _flag.is_set():
        os.write(2, b"[marin] second SIGINT: stopping now, without a checkpoint\n")
        raise KeyboardInterrupt
    if not _flag.is_set():
        _received = signum
        again = " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
        os.write(2, f"[marin] caught {signal.Signals(signum).name}: checkpointing at the next step{again}\n".encode())
    _flag.set()


def install(max_requeues: int = 3) -> None:
    """Route SIGTERM and SIGUSR2 to the flag (replacing submitit's handlers). Main thread only.
    `max_requeues` (hardware.max_requeues) bounds how often `requeue()` requeues one job."""
    global _max_requeues
    _max_requeues = max_requeues
    if threading.current_thread() is not threading.main_thread():
        log.warning("preemption handler not installed: not on the main thread")
        return
    for sig in SIGNALS + STOP_SIGNALS:
        signal.signal(sig, _on_signal)


def reset() -> None:
    global _received
    _flag.clear()
    _received = 0


def poll(time_due: bool = False) -> tuple[int, bool]:
    """At a step boundary: (signal to stop for, 0 if none; whether a rolling checkpoint is due).
    Every process gets the same answer: any process's signal stops them all, and process 0's
    clock decides the checkpoint. One small collective with several processes, none with one."""
    import jax

    sig = _received if _flag.is_set() else 0
    if jax.process_count() == 1:
        return sig, time_due
    import numpy as np
    from jax.experimental import multihost_utils

    rows = np.asarray(multihost_utils.process_allgather(np.array([sig, int(time_due)], dtype=np.int32)))
    rows = rows.reshape(-1, 2)
    return int(rows[:, 0].max()), bool(rows[0, 1])


def requeues(signum: int) -> bool:
    """Whether this stop is a Slurm requeue (preemption / time limit) rather than the end."""
    return under_slurm() and signum not in STOP_SIGNALS


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number."""
    return 128 + int(signum)


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
