"""One trainer per run: an exclusive lock on `<run dir>/train.lock`, held while a process trains it.

Two processes training one run directory write the same checkpoints and log the same steps
twice (a temporary checkpoint left behind, duplicate metric rows). `resume=` takes the lock before
it writes anything and the Trainer takes it as it starts (a no-op where this process holds it
already), so a second `resume=` of a run being trained, or of a run still in its first launch, is
refused in one line that names the holder. The lock is the kernel's (`flock`), so it goes with
the process however it ends: a killed trainer never leaves a run locked. The file itself stays
(removing a lock file races with the next holder); it holds the last holder's pid and host,
which is how `trainer_gone` knows a run killed outright (SIGKILL, the OOM killer) from one
training: the tools that read a run's directory show it FAILED, and the catch-up
(`python -m marin.track.tracker <run>`) ends its MLflow run FAILED with the metrics it lacks.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
from pathlib import Path

LOCK = "train.lock"
_held: dict[Path, int] = {}  # run directories this process holds -> the locked descriptor


class RunBusy(RuntimeError):
    """Another process trains the run (the message names it)."""


def hold(run_dir: str | Path, name: str | None = None) -> bool:
    """Lock the run for this process. True when this call took the lock (release it), False when
    this process held it already. RunBusy when another process holds it; `name` names the run."""
    key = Path(run_dir).resolve()
    if key in _held:
        return False
    fd = os.open(key / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = _holder(fd)
        os.close(fd)
        raise RunBusy(f"run {name or key} is being trained by {holder}; wait for it to end, or stop it "
                      f"(Ctrl-C, or kill -INT on its pid: it checkpoints) and resume then") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode(), 0)
    _held[key] = fd
    return True


def release(run_dir: str | Path) -> None:
    """Let the run go (this process stops training it)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor of the lock releases it


# Slurm's states of a job that may still run the trainer (squeue's %T); anything else has ended
SLURM_LIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "REQUEUE_HOLD",
              "REQUEUE_FED", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED")


def trainer_gone(run_dir: str | Path, slurm_job: str | None = None) -> bool:
    """Whether the process that last trained the run is known to be gone: the lock names a
    process of this machine that no longer exists, or, with `slurm_job` (the run's last job),
    Slurm no longer runs or queues that job. False when it may still train (it lives, it ran
    on another machine and no job is named, or the run never took the lock): a run is never
    called dead on a guess."""
    if slurm_job:
        try:
            done = subprocess.run(["squeue", "-h", "-j", str(slurm_job), "-o", "%T"], capture_output=True,
                                  text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        if done.returncode == 0 or "Invalid job id" in done.stderr:  # listed, or ended long ago
            return not set(done.stdout.split()) & set(SLURM_LIVE)
        return False
    try:
        holder = _entry((Path(run_dir) / LOCK).read_bytes())
    except OSError:
        return False
    if holder is None or holder[1] != socket.gethostname():
        return False
    try:
        os.kill(holder[0], 0)
    except (ProcessLookupError, PermissionError):  # gone, or another user's process has that pid now
        return True
    return False


def _holder(fd: int) -> str:
    """'pid N (host H)' as the holder wrote it; a holder that has not written it yet is unnamed."""
    try:
        holder = _entry(os.pread(fd, 4096, 0))
    except OSError:
        holder = None
    return f"pid {holder[0]} (host {holder[1]})" if holder else "another process"


def _entry(raw: bytes) -> tuple[int, str] | None:
    """(pid, host) from the lock file's content; None for an empty or damaged one."""
    try:
        entry = json.loads(raw or b"null")
        return int(entry["pid"]), str(entry["host"])
    except (ValueError, TypeError, KeyError):
        return None
