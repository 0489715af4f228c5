"""Preemption, interruption and forced checkpoints: SIGTERM / SIGUSR2 / SIGINT set a flag that
the loop checks once per step (`poll`); SIGUSR1 asks for a checkpoint and the run goes on.

Slurm sends USR2 `hardware.signal_delay_s` before the time limit (submitit's `--signal`), and
SIGTERM (then USR2, as submitit's `_interrupt` does) when a job is preempted. Acting inside the
signal handler could interrupt a collective or a half-dispatched step, so the handler only sets
a flag; at each step boundary the loop (`marin.train.trainer`) asks `poll()`, which gives every
process the same answer, and on a signal checkpoints and then requeues or stops:

    signum, save = preempt.poll(ckpt.time_due())      # every process agrees on the same step
    if signum:
        ckpt.save(step, state, meta, force=True); ckpt.wait()
        if preempt.requeues(signum):
            preempt.requeue()                  # under Slurm: requeue the job and exit
        raise Stopped(signum, step)            # the run ends with exit_code(signum)

The requeued job starts the same submitted function again; it restores the newest complete
checkpoint of the same run directory and logs to the same MLflow run.

Outside Slurm (and for SIGINT anywhere) the run stops instead: checkpoint at the step boundary,
MLflow run KILLED, one line with the `resume=` command, exit status 128 + the signal number
(130 for Ctrl-C, 143 for SIGTERM). A second Ctrl-C (or SIGTERM, outside Slurm) raises
KeyboardInterrupt at once; one the main thread cannot take, waiting inside XLA, ends the process
from marin.train.escort's thread within seconds.

SIGUSR1 (`python -m marin.ctl checkpoint <run>`: `kill -USR1` on this machine, `scancel
--signal=USR1` under Slurm) is a forced checkpoint: `poll` answers `Save.FORCED` at the next step
boundary on every process, the loop writes, verifies and logs a checkpoint there and trains on.
USR1 is free: submitit uses USR2 (NCCL caught USR1 only in 2.12, and only for a debug dump since).
So that the tool can find the processes, each one writes `<run dir>/processes/<index>.json` (pid,
host, start time, Slurm job) once its handlers are installed (`announce`), holds it open while it
trains (how `marin.ctl` tells the trainer from any other process) and removes it at the end.

A hang is the watchdog's (marin/train/watchdog.py): it ends the process with `WATCHDOG_EXIT`.
"""
from __future__ import annotations

import enum
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from marin.train import escort

log = logging.getLogger("marin.preempt")

SIGNALS = (signal.SIGTERM, signal.SIGUSR2)   # preemption and time limit (requeue under Slurm)
STOP_SIGNALS = (signal.SIGINT,)               # Ctrl-C: checkpoint and stop, never requeue
CHECKPOINT_SIGNAL = signal.SIGUSR1            # a forced checkpoint; the run continues
# The hang watchdog's exit status (marin/train/watchdog.py), as the published run's watchdog
# (spec §8 "Operations"): distinct from 1 (a crash), 2 (bad input), 3 (a non-finite loss) and
# 128 + n (a signal). Slurm's restart policy treats it, as any non-zero task exit, as a fault.
WATCHDOG_EXIT = 124
PROCESSES = "processes"                       # <run dir>/processes/<index>.json: who to signal
_flag = threading.Event()
_received = 0          # the first signal's number
_max_requeues = 3
_asked = 0             # forced checkpoints asked for (SIGUSR1) ...
_answered = 0          # ... and those already taken at a step boundary
_stopped_now = 0       # the second stop signal, which stops at once (KeyboardInterrupt)


class Save(enum.IntEnum):
    """Which checkpoint `poll` says is due besides the config's regular ones (truthy: one is)."""
    NONE = 0
    ROLLING = 1        # train.checkpoint.every_minutes has passed on process 0's clock
    FORCED = 2         # asked for with SIGUSR1 on any process


def _on_signal(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    global _received, _stopped_now
    # No logging here: the logging lock may be held by the interrupted code.
    escort.took(signum)
    if _flag.is_set() and (signum == signal.SIGINT or (signum == signal.SIGTERM and not under_slurm())):
        _stopped_now = signum
        os.write(2, f"[marin] second {signal.Signals(signum).name}: stopping now, without a checkpoint\n".encode())
        raise KeyboardInterrupt
    if not _flag.is_set():
        _received = signum
        again = " (Ctrl-C again stops at once)" if signum == signal.SIGINT else ""
        os.write(2, f"[marin] caught {signal.Signals(signum).name}: checkpointing at the next step{again}\n".encode())
    _flag.set()


def _on_checkpoint_signal(signum, frame) -> None:  # noqa: ARG001 (signal handler signature)
    global _asked
    _asked += 1
    os.write(2, b"[marin] caught SIGUSR1: a checkpoint at the next step boundary; training continues\n")


def install(max_requeues: int = 3) -> None:
    """Route SIGTERM and SIGUSR2 to the flag (replacing submitit's handlers), SIGUSR1 to a forced
    checkpoint. Main thread only. `max_requeues` (hardware.max_requeues) bounds how often
    `requeue()` requeues one job."""
    global _max_requeues
    _max_requeues = max_requeues
    if threading.current_thread() is not threading.main_thread():
        log.warning("preemption handler not installed: not on the main thread")
        return
    for sig in SIGNALS + STOP_SIGNALS:
        signal.signal(sig, _on_signal)
    signal.signal(CHECKPOINT_SIGNAL, _on_checkpoint_signal)
    if not under_slurm():  # a stop signal the main thread cannot take (it waits inside XLA) still stops it
        escort.start((signal.SIGINT, signal.SIGTERM), _on_signal)


def stopped_now() -> int:
    """The signal that stopped the run at once (a second SIGINT, or SIGTERM outside Slurm); 0 if none."""
    return _stopped_now


def reset() -> None:
    global _received, _asked, _answered, _stopped_now
    _flag.clear()
    _received = _asked = _answered = _stopped_now = 0


def poll(time_due: bool = False) -> tuple[int, Save]:
    """At a step boundary: (signal to stop for, 0 if none; the checkpoint due, a `Save`). Every
    process gets the same answer: any process's signal stops them all, any process's SIGUSR1
    forces a checkpoint, and process 0's clock decides the rolling one. One small collective with
    several processes, none with one."""
    import jax

    global _answered
    sig = _received if _flag.is_set() else 0
    asked = _asked  # a SIGUSR1 arriving from here on is for the next boundary
    mine = [sig, int(time_due), int(asked > _answered)]
    if jax.process_count() == 1:
        agreed = mine
    else:
        import numpy as np
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(np.array(mine, dtype=np.int32))).reshape(-1, 3)
        agreed = [int(rows[:, 0].max()), int(rows[0, 1]), int(rows[:, 2].max())]
    if agreed[2]:
        _answered = asked  # this process's requests are served by the agreed checkpoint
    return agreed[0], Save.FORCED if agreed[2] else Save(agreed[1])


def announce(run_dir: str | Path, process_index: int = 0) -> Path:
    """Write `<run_dir>/processes/<process_index>.json`: how `marin.ctl` finds and checks this
    process (pid, host, the kernel's start time of the pid: a reused pid does not match; the Slurm
    job, signalled with scancel). The file stays open until `withdraw`, which removes it: a file
    anyone can write proves nothing, but which process holds it open only the kernel says
    (`holds`), so a stale or edited entry never names another program as the trainer."""
    path = Path(run_dir) / PROCESSES / f"{process_index}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"pid": os.getpid(), "host": socket.gethostname(), "started": process_start(os.getpid()),
             "slurm_job": os.environ.get("SLURM_JOB_ID") if under_slurm() else None}
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.write(fd, json.dumps(entry).encode())
    tmp.replace(path)  # the open descriptor follows the file to its name
    _held[path] = fd
    return path


def withdraw(path: Path | None) -> None:
    """Remove an `announce`d file and let it go (the process is ending)."""
    if path is not None:
        path.unlink(missing_ok=True)
        fd = _held.pop(path, None)
        if fd is not None:
            os.close(fd)


_held: dict[Path, int] = {}  # announced files -> the descriptor kept open on each


def holds(pid: int, path: Path) -> bool:
    """Whether process `pid` (on this machine) has the file at `path` open: it is the process that
    announced itself there (False where /proc or the process's descriptors cannot be read)."""
    try:
        target = os.stat(path)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            held = os.stat(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if (held.st_dev, held.st_ino) == (target.st_dev, target.st_ino):
            return True
    return False


def process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (/proc/<pid>/stat field 22), or
    None where there is no /proc or no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # after the command name, which may hold spaces


def requeues(signum: int) -> bool:
    """Whether this stop is a Slurm requeue (preemption / time limit) rather than the end."""
    return under_slurm() and signum not in STOP_SIGNALS


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number."""
    return 128 + int(signum)


def under_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


def restart_count() -> int:
    """How many times this job was requeued after a preemption or time limit: Slurm's count less
    the restarts after a dead task (MARIN_FAULT_RESTARTS, set by marin.launch.slurm.job_main;
    those have their own budget, hardware.max_restarts: marin/launch/restarts.py)."""
    total = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    return max(0, total - int(os.environ.get("MARIN_FAULT_RESTARTS", "0") or 0))


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
