"""The training loop, shared by in-process runs and every Slurm task.

    run_local(composed, resolved, overrides)   create the run record here, then train
    train(cfg, record)                         the loop itself (resumes from the newest checkpoint)

Per step the loop only dispatches the jitted step and reads back the previous step's scalars
(one step behind, so the host never stalls the device). Batches are a pure function of the
step, so a resumed run sees exactly the batches an uninterrupted one would.
"""
from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time

from marin.track import record  # run.log (cheap: no MLflow, no JAX)

log = logging.getLogger("marin.train")


# A non-finite loss this soon after a restore is blamed on the checkpoint, not the lr.
RESTORE_SUSPECT_STEPS = 10


class NonFiniteLoss(RuntimeError):
    pass


def run_local(composed, resolved, overrides, on_created=None) -> dict:
    """Create the run record here, then train here; `on_created(record)` is called in between
    (verify=true keeps the record of its replay).

    MLflow runs in the tracking companion (marin.track.companion), started first: it imports
    MLflow and makes the run while this process starts JAX and trains; a checkpoint and the run's
    end wait for that run (a run that cannot be made stops at once, nothing left)."""
    from marin.data.loader import Loader
    from marin.data.prepare import UnreadableSource
    from marin.launch.cli import fail
    from marin.track import backend
    from marin.track.companion import Companion
    from marin.track.tracker import create_in

    out = backend.out_dir(resolved)
    if (problem := _unwritable(out)) is not None:  # before the data cache or the run is written there
        fail(f"run.out_dir: cannot write to {out}: {problem}")
    uri = backend.tracking_uri(resolved)
    if not backend.is_sqlite(uri):  # a sqlite store is made under run.out_dir by record.create
        try:
            backend.check_reachable(uri)
        except backend.TrackingUnavailable as err:
            fail(f"tracking.uri: {err}")
    companion = Companion.start()  # MLflow's import, in parallel with what follows
    try:
        try:  # read (and cache) the data before the run exists: a bad source leaves nothing behind
            loader = Loader(resolved)
        except (UnreadableSource, ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        if resolved.optim.offload:  # pinned host memory must exist before anything is written
            from marin.train.state import check_host_memory

            if (why := check_host_memory()) is not None:
                print(f"error: {why}", file=sys.stderr)
                sys.exit(2)
        try:  # all or nothing: a failure leaves no directory and no MLflow run
            rec = create_in(companion, composed, resolved, overrides)
        except (backend.TrackingUnavailable, OSError) as err:
            fail(f"could not create the run record ({backend.safe_uri(uri)}, {out}): {str(err).splitlines()[0]}")
        _say(f"run directory: {rec.run_dir}")
        try:
            if on_created is not None:
                on_created(_made(rec))
            return train(resolved, rec, loader)
        except record.RunNotMade as err:  # the directory is gone again; nothing was trained
            fail(f"could not create the run record ({backend.safe_uri(uri)}, {out}): {err}")
        except NonFiniteLoss as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(3)
    finally:
        companion.close()


def _made(rec, say=None):
    """A pending record's run, waited for (its id said the first time); a made one as it is."""
    if not isinstance(rec, record.PendingRecord):
        return rec
    first = not rec.is_made
    made = rec.ready()
    if first:
        (say or _say)(f"mlflow run: {made.run_id} ({made.tracking_uri})")
    return made


def _say(line: str) -> None:
    """A line for the user: on stderr, and in the run's run.log."""
    print(line, file=sys.stderr, flush=True)
    record.to_run_log(line)


def _unwritable(path) -> str | None:
    """Why `path` (existing or to be made) cannot be written, or None. Nothing is created."""
    from pathlib import Path

    path = Path(path)
    while not path.exists():
        if path.is_symlink() or path.parent == path:
            return f"{path} cannot be created"
        path = path.parent
    if not path.is_dir():
        return f"{path} is not a directory"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    return None


def enable_compilation_cache(cfg) -> None:
    """JAX's persistent compilation cache: a repeated run skips compilation entirely."""
    import jax

    from marin.config.store import project_path

    path = os.environ.get("MARIN_JAX_CACHE") or str(project_path(cfg.run.out_dir) / "cache" / "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def train(cfg, rec, loader=None, on_restored=None) -> dict:
    """Train the run of `rec`, from its newest checkpoint if it has one. `on_restored(step)` is
    called once the checkpoint is restored (resume= records the resume only then).

    Endings: FINISHED; FAILED on an exception (a failed restore or set-up included); KILLED on
    SIGINT, or SIGTERM outside Slurm: checkpoint, one line with the resume= command,
    SystemExit(128 + signal). Under Slurm, SIGTERM / SIGUSR2 checkpoint and requeue (a SystemExit:
    the MLflow run stays open on purpose)."""
    try:
        return _run(cfg, rec, loader, on_restored)
    except (Exception, KeyboardInterrupt) as err:
        import jax

        from marin.track.tracker import end_if_running

        if jax.process_index() == 0 and isinstance(rec, record.RunRecord):  # a pending one: its tracker ended it
            end_if_running(rec, "KILLED" if isinstance(err, KeyboardInterrupt) else "FAILED")
        raise


def _run(cfg, rec, loader, on_restored) -> dict:
    import jax

    enable_compilation_cache(cfg)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every save step at INFO
    from marin.track.tracker import RemoteTracker, Tracker
    from marin.train import preempt

    preempt.install(cfg.hardware.max_requeues)  # from here a signal checkpoints at the next step
    if isinstance(rec, record.PendingRecord):  # its companion logs to MLflow
        tracker = RemoteTracker(rec.companion, rec)
    else:
        tracker = Tracker(rec, process_index=jax.process_index())
    status = "FAILED"  # what MLflow records if anything below raises (a failed restore included)
    try:
        summary, status = _train(cfg, rec, loader, tracker, on_restored)
        return summary
    except KeyboardInterrupt:  # a second Ctrl-C: no checkpoint, but a clean ending
        status = "KILLED"
        _say(f"interrupted without a checkpoint (the newest one is kept); continue with: "
             f"python launch.py resume={rec.run_dir}")
        raise SystemExit(preempt.exit_code(signal.SIGINT)) from None
    except SystemExit as end:
        # preempt.requeue(): exit 0 leaves the MLflow run open for the requeued job; past
        # hardware.max_requeues (exit 1) the run ends KILLED. A signal's stop has finished it.
        status = None if end.code == 0 else "KILLED"
        raise
    finally:
        if status is not None:
            tracker.finish(status)
            if jax.process_index() == 0:
                tracker.report()


def _train(cfg, rec, loader, tracker, on_restored) -> tuple[dict, str | None]:
    """The loop; returns (summary, MLflow status to end with, None to leave the run open)."""
    import jax
    import numpy as np

    from marin.data.loader import Loader
    from marin.launch.mesh import make_mesh
    from marin.model import accounting
    from marin.optim import build_optimizer, lr_at
    from marin.track.expert_load import ExpertLoadLog
    from marin.track.forecast_check import Check
    from marin.train import preempt
    from marin.track import backend
    from marin.train import init_from
    from marin.train.checkpoint import Checkpointer, restore_from
    from marin.optim.hparams import structure_key
    from marin.train.executables import Cached
    from marin.train.state import batch_sharding, init_sharded
    from marin.train.step import hyperparams, jit_steps

    process = jax.process_index()
    mesh = make_mesh(cfg)
    loader = loader or Loader(cfg, process_index=process, process_count=jax.process_count())
    tx = build_optimizer(cfg)

    state, shardings = init_sharded(cfg, tx, mesh, cfg.train.seed)
    batch_spec = batch_sharding(mesh)
    ckpt = Checkpointer(rec.run_dir, cfg)
    restored_from = None
    if ckpt.latest_step() is not None or ckpt.set_aside():  # a requeued or resumed run
        state, saved = ckpt.restore(state)   # NoCheckpointError if every checkpoint is damaged
        restored_from = ckpt.restored_from
        loader.resume_tokens_seen(int(state.step), saved.get("tokens_seen", {}))
        log.info("resumed from step %d (%s)", int(state.step), restored_from)
    elif cfg.train.init_from:  # a stage continuing another run (context extension), from <run>[@<step>]
        start_at = init_from.locate(cfg.train.init_from, rec.tracking_uri, backend.out_dir(cfg))
        state, saved = restore_from(start_at.checkpoints, state, at_most=start_at.step)
        loader.resume_tokens_seen(int(state.step), saved.get("tokens_seen", {}))
        log.info("init from %s step %d (%s)", start_at.run_dir, int(state.step),
                 "the newest" if start_at.asked is None else f"asked {start_at.asked}")
        tracker.update_info(init_from={"run_dir": str(start_at.run_dir), "step": int(state.step),
                                       "asked": start_at.asked})
    if on_restored is not None:
        on_restored(int(state.step))

    # Compiled at their first call, or loaded from the executables cache (marin.train.executables).
    structure = structure_key(cfg)
    train_step, eval_step = (Cached(name, step, structure)
                             for name, step in zip(("train_step", "eval_step"), jit_steps(cfg, tx, mesh, shardings)))
    hp = hyperparams(cfg, mesh)  # the optimizer's numbers: inputs of the step, not constants

    def to_global(batch):
        return {k: jax.make_array_from_process_local_data(batch_spec, v) for k, v in batch.items()
                if k in ("inputs", "targets", "segment_ids", "loss_mask")}

    total = cfg.schedule.horizon_steps or cfg.train.steps  # a shortened horizon ends the run early
    stop = min(total, cfg.train.stop_after or total)
    start = int(state.step)
    tokens_per_step = cfg.train.seq_len * cfg.train.global_batch
    flops_per_step = 3 * accounting.flops_per_token(cfg) * tokens_per_step
    peak = cfg.hardware.peak_flops_per_device * jax.device_count()
    eval_every = cfg.train.eval_every
    check_forecast = Check(cfg, tracker)  # forecast.registered: forecast/* at each 5% point
    tracker.log_device_info()

    def meta(step: int) -> dict:
        """What a checkpoint carries besides the state (the data position is the step itself)."""
        return {"mlflow_run_id": made().run_id, "tokens_seen": loader.tokens_seen(step)}

    def made(wait: bool = True):
        """The run's record once its MLflow run exists. A local run's companion makes that run
        while the first steps train; a checkpoint (which names it) and the run's end wait for
        it, and a run that could not be made stops at the first step after the companion says so."""
        nonlocal rec
        if isinstance(rec, record.PendingRecord) and (wait or rec.ready_to_read()):
            rec = _made(rec, progress.write)
        return rec

    def evaluate(step: int) -> dict:
        tracker.log_metrics({f"data/tokens/{k}": v for k, v in loader.tokens_seen(step).items()}, step)
        tracker.log_metrics({f"data/epochs/{k}": v for k, v in loader.epochs_seen(step).items()}, step)
        losses = {}
        for name, batches in loader.eval_batches().items():
            values = [jax.device_get(eval_step(state, to_global(b))) for b in batches]
            for key in values[0]:  # loss (dropless), and loss_dropped with eval.with_drops
                losses[f"eval/{name}/{key}"] = sum(float(v[key]) for v in values) / len(values)
        dropless = [v for k, v in losses.items() if k.endswith("/loss")]
        if dropless:
            losses["eval/macro_loss"] = sum(dropless) / len(dropless)
            progress.write(f"step {step}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in losses.items()))
        tracker.log_metrics(losses, step)
        check_forecast(step, losses, progress.write)
        return losses

    progress = _progress(start, stop, process == 0)
    loads = ExpertLoadLog(rec.run_dir, start, total, cfg.train.log_every, enabled=process == 0)
    pending = None  # (step, metrics on device, wall time at dispatch)
    last_time = time.perf_counter()
    summary = {}

    def record_step(step, metrics, seconds):
        """Log the metrics of the update from state `step`: optimizer step n = step + 1, so the
        metrics of step n, the eval and checkpoint after it, and `marin.status` all say n."""
        nonlocal summary
        n = step + 1
        metrics = jax.device_get(metrics)
        values = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
        per_layer = {f"train/{k.removesuffix('_per_layer')}/layer_{i}": float(x)
                     for k, v in metrics.items() if np.ndim(v) == 1 for i, x in enumerate(v)}
        if not math.isfinite(values["loss"]):
            if restored_from is not None and step - start < RESTORE_SUSPECT_STEPS:
                raise NonFiniteLoss(f"non-finite loss ({values['loss']}) at step {n}, {n - start} step(s) "
                                    f"after restoring {restored_from}: that checkpoint's state is the likely cause "
                                    "(move it aside to resume from the one before it)")
            raise NonFiniteLoss(f"non-finite loss ({values['loss']}) at step {n}: stopping. "
                                "Lower optim.lr or check the data; the last checkpoint is kept.")
        tps = tokens_per_step / seconds if seconds > 0 else float("nan")
        row = {f"train/{k}": v for k, v in values.items()} | per_layer
        row.update({"train/tokens_per_s": tps, "train/model_flops_per_s": flops_per_step / seconds})
        if peak > 0:
            row["train/mfu"] = flops_per_step / seconds / peak
        lrs = lr_at(cfg, step)  # {group: lr} this update applied (the schedule counts from 0); train/lr is the Adam(W) one
        row["train/lr"] = lrs.get("adamw", lrs.get("adam"))
        if len(lrs) > 1:
            row.update({f"train/lr/{group}": lr for group, lr in lrs.items()})
        if n % cfg.train.log_every == 0 or n == stop:
            tracker.log_metrics(row, n)
        if "expert_load" in metrics and loads.wants(n, last=n == stop):
            loads.add(n, metrics["expert_load"])
        progress.update(step, values["loss"], tps)
        summary = {"step": step + 1, "loss": values["loss"]}

    try:
        for step in range(start, stop):
            batch = to_global(loader.batch(step))
            state, metrics = train_step(state, batch, hp)
            made(wait=False)
            if step == start:
                _import_in_background("orbax.checkpoint")  # for the first save, while the device works
            if pending is not None:
                now = time.perf_counter()
                record_step(pending[0], pending[1], now - last_time)
                last_time = now
            pending = (step, metrics)
            if eval_every and (step + 1) % eval_every == 0 and step + 1 < stop:
                record_step(*pending, time.perf_counter() - last_time)
                pending, last_time = None, time.perf_counter()
                summary.update(evaluate(step + 1))
                last_time = time.perf_counter()
            signum, rolling = preempt.poll(ckpt.time_due())  # the same answer on every process
            if rolling or ckpt.should_save(step + 1):
                ckpt.save(step + 1, state, meta(step + 1), force=True)
            if signum:
                if pending is not None:
                    record_step(*pending, time.perf_counter() - last_time)
                ckpt.save(step + 1, state, meta(step + 1), force=True)
                ckpt.wait()
                tracker.flush(force=True)
                if preempt.requeues(signum):
                    log.warning("preemption signal: checkpointed at step %d; requeueing", step + 1)
                    preempt.requeue()  # requeues and exits; the MLflow run stays open
                tracker.finish("KILLED")
                progress.close()
                name = signal.Signals(signum).name
                _say(f"stopped by {name} at step {step + 1} (checkpoint saved); continue with: "
                     f"python launch.py resume={rec.run_dir}")
                raise SystemExit(preempt.exit_code(signum))
        if pending is not None:
            record_step(pending[0], pending[1], time.perf_counter() - last_time)
        loads.save()
        # While the final eval runs, orbax writes the last checkpoint (asynchronously) and the
        # tracking companion draws the run's figures.
        ckpt.save(stop, state, meta(stop), force=True)
        tracker.draw_report()
        summary.update(evaluate(stop))
        ckpt.wait()
        return summary, "FINISHED"
    finally:
        progress.close()
        ckpt.close()
        loads.save()


def _import_in_background(module: str) -> None:
    """Import `module` in a thread: it runs while the loop waits on the device (a wait releases
    the interpreter lock), instead of in front of the first checkpoint."""
    import importlib
    import threading

    if module not in sys.modules:
        threading.Thread(target=importlib.import_module, args=(module,), name=f"import-{module}", daemon=True).start()


class _progress:
    """A tqdm bar on stderr: step, loss, tokens/s and ETA (process 0 only)."""

    def __init__(self, start: int, stop: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=stop, initial=start, disable=not enabled, file=sys.stderr,
                        unit="step", dynamic_ncols=True, mininterval=0.5)
        self.closed = False

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        self.bar.update(step + 1 - self.bar.n)

    def write(self, line: str) -> None:
        if not self.bar.disable:
            self.bar.write(line, file=sys.stderr)
            record.to_run_log(line)  # the eval lines belong in the run directory's log too

    def close(self) -> None:
        if not self.bar.disable and self.bar.n > self.bar.initial and not self.closed:
            record.to_run_log(str(self.bar))  # the bar's last state: steps, time, loss, tokens/s
        self.closed = True
        self.bar.close()
