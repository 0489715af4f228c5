"""The Trainer: set up, restore, run the step loop, end the MLflow run. Shared by in-process runs
and every Slurm task (`marin.train.loop.train` builds one).

Per step the loop dispatches the jitted step, makes the next batch while the device runs it, and
hands the step's metrics to the MetricLogger (which waits for them: the step's time); the evaluator, the checkpointer and the
preemption flag each say whether they act at that step (marin.train.components). Batches are a
pure function of the step, so a resumed run sees exactly the batches an uninterrupted one would.

Endings, decided in one place (`fit`): FINISHED; FAILED on an exception (a failed restore or
set-up included); KILLED on SIGINT, or SIGTERM outside Slurm: checkpoint, one line with the
resume= command, SystemExit(128 + signal); a second Ctrl-C: no checkpoint, exit 130. Under Slurm,
SIGTERM / SIGUSR2 checkpoint and requeue (SystemExit(0): the MLflow run stays open on purpose).
"""
from __future__ import annotations

import logging
import os
import shlex
import signal
import sys

from marin.config.paths import project_path
from marin.data.loader import Loader
from marin.model.mesh import make_mesh
from marin.optim import build_optimizer
from marin.track import backend, record, secrets
from marin.track.errors import first_line
from marin.track.expert_load import ExpertLoadLog
from marin.track.tracker import Tracker
from marin.train import init_from, preempt
from marin.train.checkpoint import Checkpointer, restore_from
from marin.train.components import Evaluator, MetricLogger
from marin.train.state import batch_sharding, init_sharded
from marin.train.step import hyperparams, jit_steps

log = logging.getLogger("marin.train")


class Stopped(Exception):
    """A stop signal, taken at a step boundary after a checkpoint."""

    def __init__(self, signum: int, step: int):
        super().__init__(signum, step)
        self.signum, self.step = signum, step


def say(line: str) -> None:
    """A line for the user: on stderr, and in the run's run.log."""
    print(line, file=sys.stderr, flush=True)
    record.to_run_log(line)


class RunNotMade(RuntimeError):
    """The tracking process could not make the run's MLflow run (the message says why)."""


class Trainer:
    """Trains the run of `rec` (a RunRecord). A new local run passes its prepared directory
    (record.Draft) as `rec` and the Future of its MLflow run as `registering`: the tracking
    process makes that run while JAX starts and compiles; the loop looks for it at each step and
    waits for it only where the run id is needed (a checkpoint names it) or at the end."""

    def __init__(self, cfg, rec, loader=None, on_restored=None, registering=None):
        import jax

        self.cfg, self.rec, self.loader, self.on_restored = cfg, rec, loader, on_restored
        self.registering = registering
        self.tracker = Tracker(registering or rec, process_index=jax.process_index(), run_dir=rec.run_dir)
        self.metrics = self.ckpt = self.loads = None

    def _made(self, wait: bool) -> None:
        """Once a new local run's MLflow run exists (`wait`: wait for it), say so; RunNotMade if
        the tracking process could not make it (nothing was trained: its directory goes)."""
        if self.registering is None or not (wait or self.registering.done()):
            return
        future, self.registering = self.registering, None
        try:
            self.rec = record.made(future.result(), self.rec)
        except Exception as err:  # noqa: BLE001 — one line for the user, not a traceback
            raise RunNotMade(first_line(err)) from None
        line = f"mlflow run: {self.rec.run_id} ({secrets.safe_uri(self.rec.tracking_uri)})"
        if self.metrics is not None:
            self.metrics.write(line)  # above the progress bar
        else:
            say(line)

    def fit(self) -> dict:
        """Train to the end (or `train.stop_after`); returns {step, loss, eval losses}."""

        status, line = "FAILED", None  # what MLflow records if anything below raises
        resume = f"continue with: python launch.py {shlex.quote(f'resume={self.rec.run_dir}')}"
        try:
            summary = self._fit()
            status = "FINISHED"
            return summary
        except Stopped as stop:
            status = "KILLED"
            line = f"stopped by {signal.Signals(stop.signum).name} at step {stop.step} (checkpoint saved); {resume}"
            raise SystemExit(preempt.exit_code(stop.signum)) from None
        except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint, but a clean ending
            status = "KILLED"
            line = f"interrupted without a checkpoint (the newest one is kept); {resume}"
            raise SystemExit(preempt.exit_code(signal.SIGINT)) from None
        except SystemExit as end:  # preempt.requeue(): 0 leaves the run open; past max_requeues, KILLED
            status = None if end.code == 0 else "KILLED"
            raise
        finally:
            self._end(status, line)

    def _fit(self) -> dict:
        state = self._setup()
        state = self._loop(state)
        self._made(wait=True)
        self.loads.save()
        self.ckpt.save(self.stop, state, self.meta(self.stop), force=True)  # written while the final eval runs
        with self.metrics.paused("eval", self.stop):
            losses = self.evaluator.run(self.stop, state)
        self.ckpt.wait()
        return self.metrics.summary | losses

    def _loop(self, state):
        batch = self.to_global(self.loader.batch(self.start))
        for step in range(self.start, self.stop):
            n = step + 1
            state, metrics = self.train_step(state, batch, self.hp)
            if n < self.stop:  # the next batch, made while the device runs this step
                batch = self.to_global(self.loader.batch(n))
            if step == self.start:
                _import_in_background("orbax.checkpoint")  # for the first save, while the device works
            self.metrics.step(n, metrics)  # waits for step n
            self._made(wait=False)
            signum, rolling = preempt.poll(self.ckpt.time_due())  # the same answer on every process
            if self.evaluator.due(n):
                with self.metrics.paused("eval", n):
                    self.evaluator.run(n, state)
            if signum or self.ckpt.due(n, rolling):
                with self.metrics.paused("checkpoint", n):
                    self.ckpt.save(n, state, self.meta(n), force=True)
            if signum:
                self._stop(signum, n)
        return state

    def _stop(self, signum: int, n: int) -> None:
        self.ckpt.wait()
        if preempt.requeues(signum):
            log.warning("preemption signal: checkpointed at step %d; requeueing", n)
            preempt.requeue()  # requeues and exits (SystemExit); the MLflow run stays open
        raise Stopped(signum, n)

    def meta(self, step: int) -> dict:
        """What a checkpoint carries besides the state: the data's read positions (each source's
        rows drawn, per phase: a resume on another mixture continues each where it was)."""
        self._made(wait=True)  # a checkpoint names its MLflow run
        return {"mlflow_run_id": self.rec.run_id, "tokens_seen": self.loader.tokens_seen(step),
                "data": self.loader.position(step)}

    def to_global(self, batch: dict) -> dict:
        """This process's rows of a batch, as global arrays over the mesh's batch axes."""
        import jax

        return {k: jax.make_array_from_process_local_data(self.batch_spec, v) for k, v in batch.items()
                if k in ("inputs", "targets", "segment_ids", "loss_mask")}

    def _setup(self):
        """Mesh, data, state (restored from the run's newest checkpoint, or `train.init_from`),
        the jitted steps and the components. Returns the state."""
        import jax


        cfg, rec = self.cfg, self.rec
        enable_compilation_cache(cfg)
        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
        preempt.install(cfg.hardware.max_requeues)  # from here a signal checkpoints at the next step
        process = jax.process_index()
        mesh = make_mesh(cfg)
        self.loader = self.loader or Loader(cfg, process_index=process, process_count=jax.process_count())
        tx = build_optimizer(cfg)
        state, shardings = init_sharded(cfg, tx, mesh, cfg.train.seed)
        self.batch_spec = batch_sharding(mesh)
        self.ckpt = Checkpointer(rec.run_dir, cfg)
        initialised_from = None
        if self.ckpt.latest_step() is not None or self.ckpt.set_aside():  # a requeued or resumed run
            state, saved = self.ckpt.restore(state)  # NoCheckpointError if every checkpoint is damaged
            self.loader.resume(int(state.step), saved)
            log.info("resumed from step %d (%s)", int(state.step), self.ckpt.restored_from)
        elif cfg.train.init_from:  # a stage continuing another run (context extension), from <run>[@<step>]
            start_at = init_from.locate(cfg.train.init_from, rec.tracking_uri, backend.out_dir(cfg))
            state, saved = restore_from(start_at.checkpoints, state, at_most=start_at.step)
            self.loader.resume(int(state.step), saved)
            log.info("init from %s step %d (%s)", start_at.run_dir, int(state.step),
                     "the newest" if start_at.asked is None else f"asked {start_at.asked}")
            initialised_from = {"run_dir": str(start_at.run_dir), "step": int(state.step), "asked": start_at.asked}
        if self.on_restored is not None:
            self.on_restored(int(state.step))

        self.train_step, eval_step = jit_steps(cfg, tx, mesh, shardings)  # compiled at their first call
        if initialised_from is not None:
            self.tracker.update_info(init_from=initialised_from)
        self.hp = hyperparams(cfg, mesh)  # the optimizer's numbers: inputs of the step, not constants
        total = cfg.schedule.horizon_steps or cfg.train.steps  # a shortened horizon ends the run early
        self.start, self.stop = int(state.step), min(total, cfg.train.stop_after or total)
        self.loads = ExpertLoadLog(rec.run_dir, self.start, total, cfg.train.log_every, enabled=process == 0)
        self.metrics = MetricLogger(cfg, self.tracker, self.loads, self.start, self.stop, self.ckpt.restored_from,
                                    enabled=process == 0)
        self.evaluator = Evaluator(cfg, eval_step, self.loader, self.to_global, self.tracker, self.metrics.write, self.stop)
        self.tracker.log_device_info()
        return state

    def _end(self, status: str | None, line: str | None) -> None:
        """The one ending: close the components, end the MLflow run with `status` (None: leave it
        open for the requeued job), say `line`, write the report."""
        try:
            if self.metrics is not None:
                self.metrics.close()
            if self.loads is not None:
                self.loads.save()
            if self.ckpt is not None:
                self.ckpt.close()
        finally:
            if self.tracker is not None:
                self.tracker.finish(status)
            if line:
                say(line)
            if status is not None and self.tracker is not None:
                self.tracker.report()


def _import_in_background(module: str) -> None:
    """Import `module` in a thread: it runs while the loop waits on the device (a wait releases
    the interpreter lock), instead of in front of the first checkpoint."""
    import importlib
    import threading

    if module not in sys.modules:
        threading.Thread(target=importlib.import_module, args=(module,), name=f"import-{module}", daemon=True).start()


def enable_compilation_cache(cfg) -> None:
    """JAX's persistent compilation cache (the one cross-process compile cache): a repeated run
    skips XLA's compilation."""
    import jax

    path = os.environ.get("MARIN_JAX_CACHE") or str(project_path(cfg.run.out_dir) / "cache" / "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
