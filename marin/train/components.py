"""What the Trainer's step loop calls, each deciding for itself when to act (marin.train.trainer):

    MetricLogger   each step's metrics, timed from one step's completion to the next; the
                   progress bar; expert-load snapshots; a non-finite loss stops
    Evaluator      `due(step)`, `run(step, state)`: eval losses, data counters, the forecast check
    (the Checkpointer, marin.train.checkpoint, is the third: `due(step, rolling)`, `save`)
    confirm_forced a forced checkpoint (SIGUSR1, marin.train.preempt): waited for, verified, logged

The MetricLogger also keeps the hang watchdog (marin.train.watchdog) informed: a completed step is
a beat, and what it times as paused (eval, checkpoint) is slow work, not a hang.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from pathlib import Path

from marin.model import accounting
from marin.optim import lr_at
from marin.track import record
from marin.track.forecast_check import Check
from marin.train.host import to_host

log = logging.getLogger("marin.train")

# A non-finite loss this soon after a restore is blamed on the checkpoint, not the lr.
RESTORE_SUSPECT_STEPS = 10


class NonFiniteLoss(RuntimeError):
    pass


def peak_memory_gib() -> float | None:
    """The highest device-memory high-water mark of this process's devices, in GiB; None where
    the backend keeps none (CPU)."""
    import jax

    peaks = [s["peak_bytes_in_use"] for s in (d.memory_stats() or {} for d in jax.local_devices())
             if "peak_bytes_in_use" in s]
    return max(peaks) / 2**30 if peaks else None


class MetricLogger:
    """`step(n, metrics)` logs optimizer step n, waiting for it to complete: a step's time runs
    from the previous step's completion to its own (waiting one step behind instead would time
    the dispatch wherever the device runs a step inline, as XLA:CPU does). `paused(name, n)` times
    what it wraps (eval, checkpoint) as `time/<name>_s` and keeps it out of the next step's time,
    so train/tokens_per_s and train/mfu measure steps only. `watchdog` (marin.train.watchdog)
    hears of each completed step and of each pause."""

    def __init__(self, cfg, tracker, loads, start: int, stop: int, restored_from=None, enabled: bool = True,
                 watchdog=None, total: int | None = None):
        import jax


        self.cfg, self.tracker, self.loads = cfg, tracker, loads
        self.start, self.stop, self.restored_from = start, stop, restored_from
        self.tokens_per_step = cfg.train.seq_len * cfg.train.global_batch
        self.flops_per_step = 3 * accounting.flops_per_token(cfg) * self.tokens_per_step
        self.peak = cfg.hardware.peak_flops_per_device * jax.device_count()
        self.progress = _Progress(start, total or stop, enabled, last=stop)  # N/M: M the run's last step, past stop_after
        self.last_done = time.perf_counter()
        self.summary: dict = {}
        self.watchdog = watchdog

    @contextlib.contextmanager
    def paused(self, name: str, n: int):
        began = time.perf_counter()
        with self.watchdog.slow() if self.watchdog else contextlib.nullcontext():
            yield
        self.last_done = time.perf_counter()
        self.tracker.log_metrics({f"time/{name}_s": self.last_done - began}, n)

    def write(self, line: str) -> None:
        self.progress.write(line)

    def close(self) -> None:
        self.progress.close()

    def step(self, n: int, metrics) -> None:
        """Log the metrics of optimizer step n (the update from state n − 1): the metrics of
        step n, the eval and checkpoint after it, and `marin.status` all say n."""
        import numpy as np

        metrics = to_host(metrics)  # waits for step n to complete (raises, not hangs, if it failed)
        if self.watchdog is not None:
            self.watchdog.beat(n)
        now = time.perf_counter()
        seconds, self.last_done = max(now - self.last_done, 1e-9), now
        values = {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}
        if not math.isfinite(values["loss"]):
            raise NonFiniteLoss(self._non_finite(n, values["loss"]))
        row = {f"train/{k}": v for k, v in values.items()}
        row.update({f"train/{k.removesuffix('_per_layer')}/layer_{i}": float(x)
                    for k, v in metrics.items() if np.ndim(v) == 1 for i, x in enumerate(v)})
        tps = self.tokens_per_step / seconds
        row.update({"train/tokens_per_s": tps, "train/model_flops_per_s": self.flops_per_step / seconds})
        if self.peak > 0:
            row["train/mfu"] = self.flops_per_step / seconds / self.peak
        if (peak := peak_memory_gib()) is not None:  # the A/B's peak memory (marin.ab); CPU devices keep none
            row["train/peak_memory_gib"] = peak
        lrs = lr_at(self.cfg, n - 1)  # {group: lr} this update applied; train/lr is the Adam(W) one
        row["train/lr"] = lrs.get("adamw", lrs.get("adam"))
        if len(lrs) > 1:
            row.update({f"train/lr/{group}": lr for group, lr in lrs.items()})
        if n % self.cfg.train.log_every == 0 or n == self.stop:
            self.tracker.log_metrics(row, n)
        if "expert_load" in metrics and self.loads.wants(n, last=n == self.stop):
            self.loads.add(n, metrics["expert_load"])
        self.progress.update(n, values["loss"], tps)
        self.summary = {"step": n, "loss": values["loss"]}

    def _non_finite(self, n: int, loss: float) -> str:
        if self.restored_from is not None and n - 1 - self.start < RESTORE_SUSPECT_STEPS:
            return (f"non-finite loss ({loss}) at step {n}, {n - self.start} step(s) after restoring "
                    f"{self.restored_from}: that checkpoint's state is the likely cause (move it aside to "
                    "resume from the one before it)")
        return (f"non-finite loss ({loss}) at step {n}: stopping. Lower optim.lr or check the data; the last "
                "checkpoint is kept.")


def confirm_forced(ckpt, step: int, tracker, write) -> bool:
    """After a forced checkpoint's `save` (every process): wait until it is committed and sealed,
    check this process's share of its bytes against its manifests (marin.train.manifest), agree on
    the verdict (one small collective), and say it in run.log and on stderr (`write`, process 0)
    with the MLflow tag `checkpoint.forced` = step and the metric `checkpoint/forced` (usage/…) at that step.
    A failed check is said, not raised: the run trains on and the checkpoint is left as it is."""
    import jax

    from marin.train import manifest

    began = time.perf_counter()
    ckpt.wait()  # committed, and this process's manifest written
    process, count = jax.process_index(), jax.process_count()
    step_dir = Path(ckpt.directory) / str(step)
    if not (step_dir / manifest.name(process)).is_file():
        problem = f"{manifest.name(process)} is missing" if step_dir.is_dir() else "it was not written"
    else:
        problem = manifest.damage(step_dir, process, count)
    if problem:
        log.warning("forced checkpoint at step %d: process %d: %s", step, process, problem)
    failed = [process] if problem else []
    if count > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        bad = np.asarray(multihost_utils.process_allgather(np.int32(problem is not None))).reshape(-1)
        failed = [int(p) for p in np.flatnonzero(bad)]
    if process == 0:
        if failed:
            write(f"forced checkpoint at step {step} FAILED verification on process(es) {failed} "
                  f"({problem or 'see their logs'}; {step_dir})")
        else:
            write(f"forced checkpoint at step {step} written and verified in {time.perf_counter() - began:.1f} s "
                  f"({step_dir}); training continues")
            tracker.set_tags({"checkpoint.forced": str(step)})
            tracker.log_metrics({"checkpoint/forced": float(step)}, step)
    return not failed


class Evaluator:
    """Every `train.eval_every` steps before the last, at each registered forecast point, and at
    the last: the eval sets' losses and bits per byte (and their macro averages), the data
    counters, and the registered forecast's check.

    Metric names and the published ones (Marin's W&B runs; spec §8), one to one:

    ==============================  ======================================  ===================
    here                            published                               pass
    ==============================  ======================================  ===================
    ``eval/<set>/loss``             ``eval_dropless/<set>/loss``            dropless
    ``eval/<set>/bpb``              ``eval_dropless/<set>/bpb``             dropless
    ``eval/<set>/loss_dropped``     ``eval/<set>/loss``                     with drops
    ``eval/<set>/bpb_dropped``      ``eval/<set>/bpb``                      with drops
    ``eval/macro_loss``, ``_bpb``   ``eval_dropless/macro_loss``, ``_bpb``  dropless
    ``eval/macro_loss_dropped``     ``eval/macro_loss``                     with drops
    ``eval/macro_bpb_dropped``      ``eval/macro_bpb``                      with drops
    ==============================  ======================================  ===================

    (the ``_dropped`` ones with ``eval.with_drops``). A folder of subsets (``subsets: true``, e.g.
    a site's Paloma copy as set ``paloma``) gives ``eval/paloma/<subset>/…`` and the macro averages
    over its subsets ``eval/paloma/macro_loss`` / ``macro_bpb`` (published
    ``eval_dropless/paloma/macro_loss``: the headline, spec §9; ``_dropped``: published
    ``eval/paloma/macro_loss``); ``eval/macro_*`` averages every set.
    Bits per byte = loss / ln 2 / the set's UTF-8 bytes per scored token
    (`Loader.eval_bytes_per_token`); the loss is the mean over the set's scored tokens (each batch
    weighed by its count, so the padded last batch counts for what it holds). The run's headline
    is `eval.headline` (auto: ``eval/paloma/macro_loss`` where a set is named paloma, production's
    ``eval_dropless/paloma/macro_loss``; else ``eval/macro_loss``)."""

    def __init__(self, cfg, eval_step, loader, to_global, tracker, write, stop: int):

        self.every, self.stop = cfg.train.eval_every, stop
        self.eval_step, self.loader, self.to_global = eval_step, loader, to_global
        self.tracker, self.write = tracker, write
        self.check = Check(cfg, tracker, cfg.eval.headline)  # forecast.registered: forecast/* at each 5% point
        self.last: dict = {}  # the latest evaluation's losses: the run's summary line names them

    def due(self, step: int) -> bool:
        if step >= self.stop:
            return False
        return (bool(self.every) and step % self.every == 0) or step in self.check.points

    def run(self, step: int, state) -> dict:
        self.tracker.log_metrics({f"data/tokens/{k}": v for k, v in self.loader.tokens_seen(step).items()}, step)
        self.tracker.log_metrics({f"data/epochs/{k}": v for k, v in self.loader.epochs_seen(step).items()}, step)
        losses = {}
        bytes_per_token = self.loader.eval_bytes_per_token()
        for name, batches in self.loader.eval_batches().items():
            values = [dict(to_host(self.eval_step(state, self.to_global(b)))) for b in batches]
            # Each batch weighs its scored targets (the padded last one less): the set's token mean.
            weights = [float(v.pop("scored", b["loss_mask"].sum())) for v, b in zip(values, batches)]
            total = sum(weights)
            weights = [w / total for w in weights] if total else [1.0 / len(weights)] * len(weights)
            for key in values[0]:  # loss (dropless), and loss_dropped with eval.with_drops
                losses[f"eval/{name}/{key}"] = loss = sum(w * float(v[key]) for w, v in zip(weights, values))
                bpt = bytes_per_token.get(name, math.nan)
                if bpt > 0:
                    losses[f"eval/{name}/{key.replace('loss', 'bpb')}"] = loss / math.log(2) / bpt
        for metric in ("loss", "bpb", "loss_dropped", "bpb_dropped"):  # the _dropped ones with eval.with_drops
            per_set = {k.removeprefix("eval/").removesuffix(f"/{metric}"): v for k, v in losses.items()
                       if k.endswith(f"/{metric}")}
            groups: dict[str, list[float]] = {}
            for name, v in per_set.items():  # a folder of subsets (data.eval_sets[].subsets): its own average
                if "/" in name:
                    groups.setdefault(name.rsplit("/", 1)[0], []).append(v)
            for group, values in groups.items():
                losses[f"eval/{group}/macro_{metric}"] = sum(values) / len(values)
            if per_set:
                losses[f"eval/macro_{metric}"] = sum(per_set.values()) / len(per_set)
        if losses:
            self.write(f"step {step}: " + ", ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in losses.items()))
        self.tracker.log_metrics(losses, step)
        self.check(step, losses, self.write)
        self.last = losses
        return losses


class _Progress:
    """A tqdm bar on stderr: step N of the run's last step M, loss, tokens/s and ETA (process 0
    only). It is drawn from the first completed step on, so the lines said before it (the run
    directory, the MLflow run) are printed once, above it, not again inside its redraws. The
    invocation's last step (`last`: M, or train.stop_after) is drawn once, when the bar closes
    (at the first line written after it, or at the end): not also by its update and again by a
    redraw under the eval line, which a log file (Slurm's, a pipe) kept as copies of one bar."""

    def __init__(self, start: int, total: int, enabled: bool, last: int | None = None):
        self.start, self.total, self.enabled = start, total, enabled
        self.last = total if last is None else last
        self.bar = None
        self.closed = False

    def update(self, n: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled or self.closed:
            return
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.start, file=sys.stderr, unit="step", dynamic_ncols=True,
                            mininterval=0.5)
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)
        if n >= self.last:  # counted, not drawn: closing draws it
            self.bar.n = n
        else:
            self.bar.update(n - self.bar.n)

    def write(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.closed and self.bar.n >= self.last:
            self.close()  # the final bar, then the line under it
        if self.bar is None or self.closed:
            print(line, file=sys.stderr, flush=True)
        else:
            self.bar.write(line, file=sys.stderr)
        record.to_run_log(line)  # the eval lines belong in the run directory's log too

    def close(self) -> None:
        if self.closed:
            return
        if self.bar is not None and self.bar.n > self.bar.initial:
            record.to_run_log(str(self.bar))  # the bar's last state: steps, time, loss, tokens/s
        self.closed = True
        if self.bar is not None:
            self.bar.close()
