"""The Trainer: set up, restore, run the step loop, end the MLflow run. Shared by in-process runs
and every Slurm task (`marin.train.loop.train` builds one).

Per step the loop dispatches the jitted step, makes the next batch while the device runs it, and
hands the step's metrics to the MetricLogger (which waits for them: the step's time); the evaluator, the checkpointer and the
preemption flag each say whether they act at that step (marin.train.components). Batches are a
pure function of the step, so a resumed run sees exactly the batches an uninterrupted one would.

Endings, decided in one place (`fit`): FINISHED (at the last step, or at train.stop_after: then
"stopped"); FAILED on an exception (a failed restore or set-up included); KILLED on SIGINT, or
SIGTERM outside Slurm: checkpoint, SystemExit(128 + signal); a second Ctrl-C (SIGTERM): no checkpoint,
exit 130 (143); one the main thread cannot take inside XLA ends the process (marin.train.escort).
Each ends with one summary line on stdout (marin.train.ending: how, final losses, directory,
MLflow run, report, and the resume= command when unfinished) and the MLflow tag `ended`. Under Slurm,
SIGTERM / SIGUSR2 checkpoint and requeue (SystemExit(0): the MLflow run stays open on purpose).
SIGUSR1 is no ending: a forced checkpoint at the next step boundary, verified and logged. A hang
ends the process from the watchdog's thread (`train.watchdog_minutes`, exit 124, marin.train.watchdog).
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from marin.config.paths import project_path
from marin.data.loader import Loader
from marin.model.expert_parallel import expert_parallel_size
from marin.model.grouped import check_ragged
from marin.model.mesh import make_mesh
from marin.optim import build_optimizer
from marin.track import backend, record, runlock
from marin.track.errors import first_line
from marin.track.expert_load import ExpertLoadLog
from marin.track.tracker import SYSTEM_METRICS_S, Tracker, forget_after
from marin.train import cache_entries, init_from, preempt
from marin.train.barrier import meet
from marin.train.checkpoint import Checkpointer
from marin.train.components import Evaluator, MetricLogger, confirm_forced
from marin.train.ending import Ending, summary_line
from marin.train.host import ready
from marin.train.state import batch_sharding, init_sharded
from marin.train.step import hyperparams, jit_steps
from marin.train.watchdog import Watchdog, hang_if_asked

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
    process makes that run while JAX starts and compiles the steps; its line is printed once, as
    soon as it exists (from the tracking call's thread), and before the progress bar (the loop
    waits for it once the first step is dispatched)."""

    def __init__(self, cfg, rec, loader=None, on_restored=None, registering=None):
        import jax

        self.cfg, self.rec, self.loader, self.on_restored = cfg, rec, loader, on_restored
        self.registering = registering
        self.tracker = Tracker(registering or rec, process_index=jax.process_index(), run_dir=rec.run_dir,
                               system_metrics_s=SYSTEM_METRICS_S if cfg.tracking.system_metrics else None,
                               report=cfg.tracking.report)
        self.metrics = self.ckpt = self.loads = self.watchdog = self.announced = None
        self.locked = False  # whether this Trainer took the run's lock (marin.track.runlock)
        self._saying, self._said = threading.Lock(), False  # the MLflow run's line: once, whoever comes first
        if registering is not None:
            registering.add_done_callback(self._say_made)

    def _say_made(self, future) -> None:
        """Say the new MLflow run's line once it is made: called in the thread that made it (not
        after the first step: the compile can take minutes) and by `_made`. The lock is held while
        printing, so the progress bar cannot start before the line is out."""
        if future.exception() is not None:  # not made: _made says why (RunNotMade)
            return
        with self._saying:
            if self._said:
                return
            self._said = True
            rec = future.result()
            line = f"mlflow run: {rec.run_id} ({record.mlflow_link(rec)})"  # a server's: the run's page
            if self.metrics is not None:
                self.metrics.write(line)  # above the progress bar
            else:
                say(line)

    def _phase_done(self, what: str, began: float) -> None:
        """One line per phase before the first step, with its seconds: no silent minute between
        `run directory:` and the progress bar."""
        if self.tracker.enabled:
            say(f"{what}… {time.perf_counter() - began:.1f} s")

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
        self._say_made(future)  # if the callback has not yet

    def fit(self) -> dict:
        """Train to the end (or `train.stop_after`); returns {step, loss, eval losses}."""

        status, ending = "FAILED", None  # what MLflow records if anything below raises
        try:
            summary = self._fit()
            status = "FINISHED"
            ending = self._ending("finished" if self.stop >= self.total else "stopped", self.stop,
                                  "" if self.stop >= self.total else self._stopped_by())
            return summary
        except Stopped as stop:
            status = "KILLED"
            ending = self._ending("killed", stop.step, f"{signal.Signals(stop.signum).name}, checkpoint saved")
            raise SystemExit(preempt.exit_code(stop.signum)) from None
        except KeyboardInterrupt:  # a second Ctrl-C (or SIGTERM): no checkpoint, but a clean ending
            status = "KILLED"
            signum = preempt.stopped_now() or signal.SIGINT
            again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            ending = self._ending("killed", None, f"a second {again}: no checkpoint, the newest one is kept")
            raise SystemExit(preempt.exit_code(signum)) from None
        except SystemExit as end:  # preempt.requeue(): 0 leaves the run open; past max_requeues, KILLED
            status = None if end.code == 0 else "KILLED"
            ending = self._ending("requeued" if end.code == 0 else "killed", None,
                                  "preempted" if end.code == 0 else "preempted past hardware.max_requeues")
            raise
        except RunNotMade:  # nothing was made: no run to sum up (run_local removes its directory)
            raise
        except Exception as err:
            ending = self._ending("failed", None, type(err).__name__)
            raise
        finally:
            self._end(status, ending)

    def _stopped_by(self) -> str:
        """The field that ended the run short of its last step: train.stop_at (a lineage's cutover,
        kept by resume=) or train.stop_after (this invocation's)."""
        return "train.stop_at" if self.stop == self.cfg.train.stop_at else "train.stop_after"

    def _ending(self, how: str, step: int | None, why: str = "") -> Ending:
        """How this invocation ended; `step` None: the last step logged (or restored)."""
        if step is None:
            step = self.metrics.summary.get("step", self.start) if self.metrics is not None else None
        total = getattr(self, "total", None) or self.cfg.schedule.horizon_steps or self.cfg.train.steps
        return Ending(how, step, total, why)

    def _fit(self) -> dict:
        state = self._setup()
        state = self._loop(state)
        with self.watchdog.slow():  # the last checkpoint and eval: slow work, not a hang
            self._made(wait=True)
            self.loads.save()
            self.ckpt.save(self.stop, state, self.meta(self.stop), force=True)  # written while the final eval runs
            with self.metrics.paused("eval", self.stop):
                losses = self.evaluator.run(self.stop, state)
            self.ckpt.wait()
        return self.metrics.summary | losses

    def _loop(self, state):
        batch = self.to_global(self.loader.batch(self.start))
        self._compile(state, batch)
        for step in range(self.start, self.stop):
            n = step + 1
            hang_if_asked(self.cfg, n, self.rec.run_dir)  # debug.hang_at_step: the watchdog's test
            state, metrics = self.train_step(state, batch, self.hp)
            if n < self.stop:  # the next batch, made while the device runs this step
                batch = self.to_global(self.loader.batch(n))
            if step == self.start:
                _import_in_background("orbax.checkpoint")  # for the first save, while the device works
            self._made(wait=step == self.start)  # its line comes before the progress bar (made as JAX compiled)
            self.metrics.step(n, metrics)  # waits for step n
            signum, save = preempt.poll(self.ckpt.time_due())  # the same answer on every process
            if self.evaluator.due(n):
                with self.metrics.paused("eval", n):
                    self.evaluator.run(n, state)
            if signum or self.ckpt.due(n, save):
                with self.metrics.paused("checkpoint", n):
                    forced = save is preempt.Save.FORCED   # kept by retention (marin.train.checkpoint)
                    self.ckpt.save(n, state, self.meta(n) | {"forced": forced}, force=True)
                    if forced:  # SIGUSR1 (marin.ctl checkpoint): verified, logged
                        confirm_forced(self.ckpt, n, self.tracker, self.metrics.write)
            if signum:
                self._stop(signum, n)
        return state

    def _eval_shaped(self, batch: dict) -> dict:
        """A batch of the eval batches' shape: the train batch's, unless train.eval_seq_len differs (a
        context stage scores at pretraining's length): then the first eval batch."""
        if self.cfg.train.eval_seq_len == self.cfg.train.seq_len:
            return batch
        first = next((b[0] for b in self.loader.eval_batches().values() if b), None)
        return batch if first is None else self.to_global(first)

    def _compile(self, state, batch) -> None:
        """Both steps compiled here, each timed on its own line (their calls reuse these
        executables: nothing compiles in the loop). A job of several processes then waits for the
        others (marin.train.barrier): one whose compile lagged must not leave the first step's
        collectives waiting past gloo's 30 s."""
        import jax

        began = time.perf_counter()
        self.train_step.lower(state, batch, self.hp).compile()
        self._phase_done("compiling the train step", began)
        began = time.perf_counter()
        self.evaluator.eval_step.lower(state, self._eval_shaped(batch)).compile()
        self._phase_done("compiling eval", began)
        if jax.process_count() > 1:
            meet("compiled", self.cfg.hardware.init_timeout_s)

    def _stop(self, signum: int, n: int) -> None:
        with self.watchdog.slow():
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
        began = time.perf_counter()
        enable_compilation_cache(cfg)
        logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
        preempt.install(cfg.hardware.max_requeues)  # from here a signal checkpoints at the next step
        process = jax.process_index()
        # One trainer per run (resume= took the lock already). Not under Slurm: a dead node's lock on
        # a network file system outlives it by the lease, which would refuse the job's own requeue;
        # a Slurm job is one already (resume= refuses a second while it is queued or running).
        if process == 0 and not preempt.under_slurm():
            self.locked = runlock.hold(rec.run_dir, getattr(rec, "run_id", None))
        self.announced = preempt.announce(rec.run_dir, process)  # marin.ctl finds this process here
        self.watchdog = Watchdog.from_config(cfg, process, jax.process_count(), rec.run_dir)  # restore, compile: slow allowance
        mesh = make_mesh(cfg)
        # GPU, ragged path: the grouped kernel (model.grouped_matmul); refused (one line) before the
        # step compiles if it cannot run here or XLA would still run it dense over every expert.
        grouped_matmuls = check_ragged(cfg, expert_parallel_size(mesh))
        if grouped_matmuls:
            log.info("ragged grouped matmuls (%s): %.2f× the useful FLOPs, %d custom calls (Pallas lowering %s)",
                     grouped_matmuls["impl"], grouped_matmuls["ratio"], grouped_matmuls["custom_calls"],
                     "on" if grouped_matmuls["pallas"] else "off")
        self.loader = self.loader or Loader(cfg, process_index=process, process_count=jax.process_count())
        tx = build_optimizer(cfg)
        # ready(): an init (or restore, below) that ran out of memory raises; `int(state.step)` would hang
        state, shardings = init_sharded(cfg, tx, mesh, cfg.train.seed)
        state = ready(state)
        self.batch_spec = batch_sharding(mesh)
        self.ckpt = Checkpointer(rec.run_dir, cfg)
        initialised_from = None
        meet("set-up", cfg.hardware.init_timeout_s)  # a restore's first act is a collective (its verdict)
        # A requeued or resumed run: NoCheckpointError if every checkpoint is damaged, None if none was sealed
        restored = self.ckpt.restore(state) if self.ckpt.latest_step() is not None or self.ckpt.set_aside() else None
        if restored is not None:
            state, saved = restored
            state = ready(state)
            self.loader.resume(int(state.step), saved)
            log.info("resumed from step %d (%s)", int(state.step), self.ckpt.restored_from)
        elif cfg.train.init_from:  # another run's weights, or its whole state (init_from_mode), from <run>[@<step>]
            start_at = init_from.locate(cfg.train.init_from, rec.tracking_uri, backend.out_dir(cfg))
            state, saved, initialised_from = init_from.restore(cfg, state, start_at)
            state = ready(state)
            if saved is not None:  # continue mode: every source goes on from its read position too
                self.loader.resume(int(state.step), saved)
            log.info("%s, %s mode: training steps %d…", start_at.describe(), cfg.train.init_from_mode, int(state.step) + 1)
            initialised_from["changes"] = start_at.changes(cfg)
            if cfg.fork:  # marin/launch/fork.py: what the fork changed, beside its forked_from tag
                self.tracker.set_tags({"fork_changes": "; ".join(
                    f"{k}: {a} → {b}" for k, (a, b) in initialised_from["changes"].items())[:4000] or "none"})
        if process == 0:   # a run killed past its newest checkpoint logged the steps it will repeat
            dropped = forget_after(rec.run_dir, int(state.step))
            if dropped:
                log.info("%d metric rows past step %d left out of metrics.jsonl (logged again from here)",
                         dropped, int(state.step))
        if self.on_restored is not None:
            self.on_restored(int(state.step))
        self._phase_done("initialising the state" + (f" (restored step {int(state.step)})" if restored is not None else ""),
                         began)

        self.train_step, eval_step = jit_steps(cfg, tx, mesh, shardings)  # compiled by _compile
        if initialised_from is not None:
            self.tracker.update_info(init_from=initialised_from)
        self.hp = hyperparams(cfg, mesh)  # the optimizer's numbers: inputs of the step, not constants
        self.total = total = cfg.schedule.horizon_steps or cfg.train.steps  # a shortened horizon ends the run early
        self.start, self.stop = int(state.step), min(total, cfg.train.stop_after or total, cfg.train.stop_at or total)
        self.loads = ExpertLoadLog(rec.run_dir, self.start, total, cfg.train.log_every, enabled=process == 0)
        self.metrics = MetricLogger(cfg, self.tracker, self.loads, self.start, self.stop, self.ckpt.restored_from,
                                    enabled=process == 0, watchdog=self.watchdog, total=total)
        self.evaluator = Evaluator(cfg, eval_step, self.loader, self.to_global, self.tracker, self.metrics.write, self.stop)
        self.tracker.log_device_info()
        return state

    def _end(self, status: str | None, ending: Ending | None) -> None:
        """The one ending: close the components, end the MLflow run with `status` (None: leave it
        open for the requeued job) tagged with how it `ended`, write the report, then print the
        summary line (marin.train.ending)."""
        try:
            if self.watchdog is not None:
                self.watchdog.stop()
            preempt.withdraw(self.announced)
            if self.metrics is not None:
                self.metrics.close()
            if self.loads is not None:
                self.loads.save()
            if self.ckpt is not None:
                self.ckpt.close()
        finally:
            if self.locked:  # every checkpoint is written: another process may train the run now
                runlock.release(self.rec.run_dir)
            if self.tracker is not None:
                if ending is not None:
                    self.tracker.set_tags({"ended": ending.describe()})
                self.tracker.finish(status)
            if status is not None and self.tracker is not None:
                self.tracker.report()
            if ending is not None and self.tracker is not None and self.tracker.enabled:
                try:
                    self._summarise(ending)
                except Exception as err:  # noqa: BLE001 — the summary never changes how the run ended
                    log.warning("no summary line (%s)", first_line(err))

    def _summarise(self, ending: Ending) -> None:
        """The run's last line, on stdout and in run.log: how it ended, its final losses, its
        directory, MLflow run and report, and the resume= command when unfinished."""
        try:
            self._made(wait=False)
        except RunNotMade:
            pass
        run_id = getattr(self.rec, "run_id", None)
        losses = self.evaluator.last if getattr(self, "evaluator", None) is not None else {}
        report = self.rec.run_dir / "report.html"
        line = summary_line(ending, (self.metrics.summary if self.metrics is not None else {}).get("loss"),
                            losses.get(self.cfg.eval.headline), self.rec.run_dir, run_id,
                            record.mlflow_link(self.rec) if run_id else None, report if report.is_file() else None)
        # A verify replay's stdout is the verdict (marin.launch.verify): its own ending goes to stderr.
        print(line, file=sys.stderr if self.cfg.verify else sys.stdout, flush=True)
        record.to_run_log(line)


def _import_in_background(module: str) -> None:
    """Import `module` in a thread: it runs while the loop waits on the device (a wait releases
    the interpreter lock), instead of in front of the first checkpoint."""
    import importlib
    import threading

    if module not in sys.modules:
        threading.Thread(target=importlib.import_module, args=(module,), name=f"import-{module}", daemon=True).start()


def unsafe_cache_folder(path: str) -> str | None:
    """Why a compilation cache folder may have been written by someone else (None: it may not):
    owned by another user than this one (or root), or writable by group or others (a sticky bit does
    not help: another user could still create the entry a key names). A folder not made yet is
    made by JAX with this process's umask."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if st.st_uid not in (os.getuid(), 0):
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o022:
        return f"writable by others (mode {oct(st.st_mode & 0o777)})"
    return None


def enable_compilation_cache(cfg) -> None:
    """JAX's persistent compilation cache (the one cross-process compile cache): a repeated run
    skips XLA's compilation. Every program is cached (thresholds 0: a tiny run's start is mostly
    small programs) unless the environment sets JAX's own thresholds (the test suite does)."""
    import jax

    path = os.environ.get("MARIN_JAX_CACHE") or str(project_path(cfg.run.out_dir) / "cache" / "jax")
    unsafe = unsafe_cache_folder(path)
    if unsafe:
        log.warning("compilation cache %s not used: %s; its entries are machine code this process would run "
                    "(chmod go-w it, or set MARIN_JAX_CACHE to a folder of your own)", path, unsafe)
        jax.config.update("jax_compilation_cache_dir", None)
        return
    jax.config.update("jax_compilation_cache_dir", path)
    cache_entries.install()   # an entry is loaded only if it is the program its key names
    for option in ("jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes"):
        if option.upper() not in os.environ:
            jax.config.update(option, 0)
