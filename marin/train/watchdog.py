"""The hang watchdog (`train.watchdog_minutes`) and its fault-injection knob (`debug.hang_at_step`).

A hung collective blocks every process of a job inside the step, where no Python runs and no
signal is acted on, until Slurm's time limit. So each process has a thread that checks the time
since the last completed step; past the limit it writes every thread's Python stack (faulthandler)
to its log (stderr: the terminal, or the task's Slurm log; process 0's also to run.log) and ends
the process with `preempt.WATCHDOG_EXIT` (124, as the published run's watchdog) `EXIT_GRACE_S`
later, when the other processes of the job have dumped theirs too (process 0 last). Nothing is
cleaned up on the way out: the main thread is stuck, so the thread exits with `os._exit`; the
newest checkpoint is untouched, and a local run's tracking process ends its MLflow run FAILED.
Under Slurm the exit is a task fault: the restart policy (hardware.max_restarts) resumes the job
from the newest checkpoint.

Not fooled by slow work that is not a hang: until the first step completes (restore and compile)
and inside `slow()` (evaluations, checkpoint saves and waits), the allowance is `SLOW_FACTOR` times
the limit, at least `SLOW_MIN_S`.

    dog = Watchdog.from_config(cfg, process_index, process_count, run_dir)   # started; a no-op when off
    dog.beat(n)                      # step n completed (MetricLogger.step)
    with dog.slow(): ...             # an eval or a checkpoint (MetricLogger.paused)
    dog.stop()
"""
from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import threading
import time
from pathlib import Path

from marin.track.record import LOG
from marin.train.preempt import WATCHDOG_EXIT

SLOW_FACTOR = 4          # the first step, evals and checkpoints: 4 × the limit ...
SLOW_MIN_S = 600.0       # ... and at least 10 minutes (a restore and a compile of a big model)
HANG_MARKER = "debug_hang.json"   # <run dir>/: the injected hang happened (a restarted job runs on)
# Between the dump and the exit. The processes of a hung job stopped at the same step, so their
# watchdogs fire within a second or two of each other; were the first to exit at once, srun
# would kill the others (--kill-on-bad-exit), or their collective would fail (gloo sees the peer
# gone), before they wrote their own stacks.
EXIT_GRACE_S = 5.0
# Process 0 hosts jax.distributed's coordination service; were it to exit first, the others would
# abort on the lost service (SIGABRT, 134) before their own exit, and the fault would read as a
# crash. So it exits this much later than they do: after them (the watchdogs fire within a poll
# interval, 1 s, of each other), and well before srun's SIGKILL (KillWait after the first exit:
# 30 s by default, 5 s on the test cluster).
COORDINATOR_LAST_S = 1.5


class Watchdog:
    """A daemon thread that ends this process when no step completes within `limit_s` (see the
    module docstring). `exit` is `os._exit`; a test passes its own to see the call."""

    def __init__(self, limit_s: float | None, process_index: int = 0, run_log: Path | None = None, exit=os._exit,
                 grace_s: float = EXIT_GRACE_S):
        self.limit_s, self.process_index, self.run_log, self._exit = limit_s, process_index, run_log, exit
        self.grace_s = grace_s
        self.slow_s = max(SLOW_FACTOR * limit_s, SLOW_MIN_S) if limit_s else None
        self.last_step: int | None = None
        self._slow_depth = 0
        self._since = time.monotonic()
        self._allowed = self.slow_s  # until the first step completes
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = None
        if limit_s:
            self._thread = threading.Thread(target=self._watch, name="marin-watchdog", daemon=True)
            self._thread.start()

    @classmethod
    def from_config(cls, cfg, process_index: int, process_count: int, run_dir) -> "Watchdog":
        minutes = cfg.train.watchdog_minutes
        return cls(60.0 * minutes if minutes else None, process_index,
                   Path(run_dir) / LOG if process_index == 0 else None,
                   grace_s=EXIT_GRACE_S if process_count > 1 else 0.0)  # alone: nobody to wait for

    def beat(self, step: int) -> None:
        """Step `step` completed: the next one has `limit_s`."""
        with self._lock:
            self.last_step = step
            self._since = time.monotonic()
            self._allowed = self.slow_s if self._slow_depth else self.limit_s

    @contextlib.contextmanager
    def slow(self):
        """Slow work that is progress (an eval, a checkpoint): `slow_s` from its start and the
        limit again from its end."""
        with self._lock:
            self._slow_depth += 1
            self._since, self._allowed = time.monotonic(), self.slow_s
        try:
            yield
        finally:
            with self._lock:
                self._slow_depth -= 1
                self._since = time.monotonic()
                self._allowed = self.slow_s if self._slow_depth or self.last_step is None else self.limit_s

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        interval = min(self.limit_s / 10, 1.0)  # at most a second late: a hung job's processes fire together
        while not self._stopped.wait(interval):
            with self._lock:
                waited, allowed, step = time.monotonic() - self._since, self._allowed, self.last_step
            if waited > allowed:
                self._fire(waited, allowed, step)
                return

    def _fire(self, waited: float, allowed: float, step: int | None) -> None:
        """Stacks to stderr (and run.log), then exit. Only os.write and faulthandler: both write
        straight to the file descriptor, taking no lock the stuck thread might hold."""
        after = f"after step {step}" if step is not None else "before the first step"
        line = (f"[marin] watchdog: process {self.process_index}: no step completed for {waited:.1f} s "
                f"(allowed {allowed:.1f} s) {after}; Python stacks follow; exiting with status {WATCHDOG_EXIT}\n")
        os.write(2, line.encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
        if self.run_log is not None:
            with contextlib.suppress(OSError), open(self.run_log, "a") as log:
                log.write(line)
                log.flush()
                faulthandler.dump_traceback(file=log, all_threads=True)
        time.sleep(self.grace_s + (COORDINATOR_LAST_S if self.process_index == 0 else 0))
        self._exit(WATCHDOG_EXIT)


def hang_if_asked(cfg, step: int, run_dir) -> None:
    """`debug.hang_at_step`: process `debug.hang_process` stops before step `step`, as a hung
    collective would stop it (the others then wait in the step's collectives). Once per run: a
    marker in the run directory lets the restarted or resumed job run through."""
    if cfg.debug.hang_at_step != step:
        return
    marker = Path(run_dir) / HANG_MARKER
    if marker.exists():
        return
    import jax

    if jax.process_index() != cfg.debug.hang_process:
        return
    marker.write_text(json.dumps({"step": step, "process": cfg.debug.hang_process}))
    os.write(2, f"[marin] debug.hang_at_step={step}: process {cfg.debug.hang_process} hangs here\n".encode())
    while True:  # a stack the watchdog's dump shows in this function
        time.sleep(3600)
