"""A stop signal the main thread cannot take still stops the process (outside Slurm).

Python runs a signal's handler (marin.train.preempt) only when the main thread gets back to
Python code; while it waits inside XLA (a compile, a step, or a computation that never answers:
issue 42's run under `ulimit -v`) a Ctrl-C or SIGTERM does nothing. The C-level handler still
writes each signal's number to a wakeup file descriptor (`signal.set_wakeup_fd`), and this
module's thread reads it there, with the interpreter lock free:

- a first stop signal the main thread has not taken within `NOTICE_S`: one line saying it stops
  at the next step boundary, and that the same signal again stops it at once;
- a second one not taken within `STOP_NOW_S`: one line, then `os._exit(128 + signal)`. The
  tracking process (marin.track.worker) sees the trainer gone and ends its MLflow run FAILED;
  the newest checkpoint is kept.

A taken signal is counted by the handler (`took`); signals taken in time change nothing here. The
counts only grow (a signal is read here before or after its handler runs: either order matches).
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time

NOTICE_S = 5.0      # a first stop signal not taken by then: say why nothing happens yet
STOP_NOW_S = 5.0    # a second one not taken by then: the process ends here

_arrived = 0        # stop signals delivered (the wakeup fd) ...
_taken = 0          # ... and those whose Python handler ran
_stop_signals: frozenset = frozenset()
_handler = None     # their Python handler (marin.train.preempt's)
_write_fd: int | None = None


def took(signum: int) -> None:  # noqa: ARG001 — called by the Python handler of each stop signal
    global _taken
    _taken += 1


def start(stop_signals, handler) -> None:
    """Watch `stop_signals` from a thread while `handler` (which calls `took`) is their Python
    handler (main thread only: set_wakeup_fd's rule). The wakeup fd reports every signal that has
    a Python handler: one another handler took is not counted."""
    global _write_fd, _stop_signals, _handler
    _stop_signals, _handler = frozenset(int(s) for s in stop_signals), handler
    if _write_fd is None:
        read_fd, _write_fd = os.pipe()
        os.set_blocking(_write_fd, False)  # the C handler must never block
        threading.Thread(target=_watch, args=(read_fd,), name="marin-signal-escort", daemon=True).start()
    signal.set_wakeup_fd(_write_fd, warn_on_full_buffer=False)


def _watch(read_fd: int) -> None:
    global _arrived
    due: list[tuple[float, int, int]] = []  # (when, signal, its count): a check to make then
    while True:
        wait = max(0.0, min(when for when, _, _ in due) - time.monotonic()) if due else None
        if select.select([read_fd], [], [], wait)[0]:
            for signum in os.read(read_fd, 64):
                if signum in _stop_signals and signal.getsignal(signum) is _handler:
                    _arrived += 1
                    due.append((time.monotonic() + (NOTICE_S if _arrived == 1 else STOP_NOW_S), signum, _arrived))
        now = time.monotonic()
        for entry in [e for e in due if e[0] <= now]:
            due.remove(entry)
            _check(entry[1], entry[2])


def _check(signum: int, count: int) -> None:
    if _taken >= count:
        return
    name = signal.Signals(signum).name
    if count == 1:
        os.write(2, f"[marin] {name}: the training process is inside XLA (a compile, a step, or a computation "
                    f"that does not answer); it stops at the next step boundary; {name} again stops it at once\n"
                    .encode())
        return
    os.write(2, f"[marin] {name} again, and the training process is still inside XLA: stopping now (exit "
                f"{128 + signum}); the MLflow run ends FAILED, the newest checkpoint is kept\n".encode())
    os._exit(128 + signum)
