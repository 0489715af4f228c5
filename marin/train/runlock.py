"""One trainer per run: an exclusive lock on `<run dir>/train.lock`, held while a process trains it.

Two processes training one run directory write the same checkpoints and log the same steps
twice (a temporary checkpoint left behind, duplicate metric rows). `resume=` takes the lock before
it writes anything and the Trainer takes it as it starts (a no-op where this process holds it
already), so a second `resume=` of a run being trained, or of a run still in its first launch, is
refused in one line that names the holder. The lock is the kernel's (`flock`), so it goes with
the process however it ends: a killed trainer never leaves a run locked. The file itself stays
(removing a lock file races with the next holder); it holds the last holder's pid and host.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
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


def _holder(fd: int) -> str:
    """'pid N (host H)' as the holder wrote it; a holder that has not written it yet is unnamed."""
    try:
        entry = json.loads(os.pread(fd, 4096, 0) or b"null")
        return f"pid {int(entry['pid'])} (host {entry['host']})"
    except (OSError, ValueError, TypeError, KeyError):
        return "another process"
