"""Checkpoints of a run: orbax, asynchronous, atomic, in `<run_dir>/checkpoints/<step>/`.

A checkpoint holds the whole train state (parameters, optimizer state, the router state — QB's
pending betas —, the step, and an RNG key if the state has one) plus a small JSON `meta`: step,
data position, MLflow run id, horizon and the RNG seed (filled in by `save` when the loop does
not give them). Orbax writes each step into a temporary directory and renames it when every
process has finished, so a half-written checkpoint is never listed, let alone restored.
Retention: the last `keep_last`, and forever every permanent one (each multiple of `permanent_every`,
each of `permanent_steps`) and every forced one. Permanence is written into the checkpoint's meta
("permanent", like "forced"), so a later config (a resume with another cadence or horizon) never
deletes it: a checkpoint is the user's data.

Integrity (marin/train/manifest.py): once orbax has committed a step, every process hashes the
files it wrote, on a thread pool in the background, into `manifest.<process>.json`; the step's
meta records how many manifests it has. A checkpoint counts only when all of them exist
(`listed_steps`, `restore`), and retention keeps the newest one that every process has sealed
until its successor is sealed too. `restore` verifies them, each process its share, in parallel:
a checkpoint whose own bytes differ is set aside as `<step>.corrupt` (never deleted) and the one
before it is used; one that lacks a manifest it was written with (a save killed before it was
sealed, or a deleted manifest) is left in place, not restored, with a warning naming what is
missing, and the one before it is used. Only a checkpoint whose meta records no manifests and
that has none (written before manifests existed) is restored unverified, with a warning; one with
process 0's single `marin_manifest.json` (the previous version) is verified against it.

Nothing else renames a checkpoint: a state whose structure differs from the checkpoint's (a
config that changed the model or the optimizer) raises `StructureMismatch`, checked from orbax's
metadata before anything is read, and a verified checkpoint that still fails to restore raises.

Every process calls `save` and `restore` together (each writes and reads its own shards).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from marin.track import errors
from marin.train import manifest

log = logging.getLogger("marin.checkpoint")


class NoCheckpointError(FileNotFoundError):
    """No complete, readable checkpoint in a run directory."""


class NoneSealed(NoCheckpointError):
    """Every checkpoint lacks a manifest (none damaged): none was ever verified, e.g. the job died
    between orbax's commit and the manifests of its first checkpoint."""


class StructureMismatch(ValueError):
    """The state to restore into differs in structure (leaves, shapes, dtypes) from a checkpoint."""

    def __init__(self, where: str, differences: list[str]):
        self.where, self.differences = where, differences
        shown = "; ".join(differences[:3]) + (f" (+{len(differences) - 3} more)" if len(differences) > 3 else "")
        super().__init__(f"the train state does not match checkpoint {where}: {shown}")


class CheckpointError(RuntimeError):
    """A checkpoint whose bytes are intact (or unverifiable) but that does not restore."""


class DiskFull(CheckpointError, errors.DiskFull):
    """A checkpoint not saved for want of space (its message is the one line the run prints)."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).resolve() / "checkpoints"


def listed_steps(directory: str | Path) -> list[int]:
    """The checkpoints that count in a checkpoints directory, oldest first: committed (a step is a
    folder named by its integer; a save in flight is a temporary folder, a damaged one set aside
    is `<step>.corrupt`) and sealed (every process's manifest there, or from before manifests).
    Pure Python: no JAX, so validation can call it."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir()
                  if p.name.isdigit() and p.is_dir() and manifest.complete(p))


@dataclasses.dataclass
class _KeepNewestSealed:
    """Orbax preservation rule: keep the newest checkpoint that every process has sealed, so that
    retention never removes the last verified checkpoint while its successor is still unsealed."""

    newest: Callable[[], int | None]

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        keep = self.newest()
        return [c.step == keep for c in checkpoints]


@dataclasses.dataclass
class _KeepForced:
    """Orbax preservation rule: a forced checkpoint (`marin.ctl checkpoint`, meta "forced") is kept:
    someone asked for that step (a fork point, an A/B's start), so rolling retention never takes it;
    so is one written as permanent (meta "permanent"), whatever the config says now."""

    directory: Path
    seen: dict = dataclasses.field(default_factory=dict)   # step -> forced (a checkpoint's meta never changes)

    def forced(self, step: int) -> bool:
        if step not in self.seen:
            try:
                meta = json.loads((self.directory / str(step) / manifest.META_FILE).read_text())
                self.seen[step] = bool(meta.get("forced") or meta.get("permanent"))
            except (OSError, ValueError):
                return False   # not committed yet: asked again at the next save
        return self.seen[step]

    def should_preserve(self, checkpoints, *, context) -> list[bool]:
        return [self.forced(c.step) for c in checkpoints]


def _retention(ckpt_cfg, newest_sealed: Callable[[], int | None], directory: Path):
    """`keep_last` newest (0: all), every multiple of `permanent_every`, the forced ones and the
    newest sealed one."""
    from orbax.checkpoint import checkpoint_managers as cm

    rules = [cm.LatestN(n=ckpt_cfg.keep_last or None), _KeepForced(directory)]
    if newest_sealed is not None:
        rules.append(_KeepNewestSealed(newest_sealed))
    if ckpt_cfg.permanent_every > 0:
        rules.append(cm.EveryNSteps(ckpt_cfg.permanent_every))
    return cm.AnyPreservationPolicy(rules)


def _open_manager(directory: Path, ckpt_cfg=None, read_only: bool = False, newest_sealed=None):
    import orbax.checkpoint as ocp

    if read_only:  # orbax warns that a read-only manager is read-only
        logging.getLogger("absl").setLevel(logging.ERROR)
    options = ocp.CheckpointManagerOptions(
        preservation_policy=_retention(ckpt_cfg, newest_sealed, directory) if ckpt_cfg and not read_only else None,
        enable_async_checkpointing=bool(ckpt_cfg.async_save) if ckpt_cfg else False,
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,   # leftovers of a save that was killed
    )
    # The meta's file name is fixed here: manifest.META_FILE reads it without orbax.
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler(filename="metadata")}
    return ocp.CheckpointManager(directory, options=options, item_handlers=handlers)  # handlers: metadata readable


def _abstract(template):
    """Shapes, dtypes and shardings of `template` (restored arrays land on the same devices)."""
    import jax
    import orbax.checkpoint as ocp

    return jax.tree.map(ocp.utils.to_shape_dtype_struct, template)


def abstract_state(cfg):
    """The train state's structure for `cfg` (shapes and dtypes only; nothing is allocated)."""
    import jax

    from marin.optim import build_optimizer  # JAX: init_from (launch.checks) lists checkpoints on the config path
    from marin.train.state import init_state  # JAX

    tx = build_optimizer(cfg)
    return jax.eval_shape(lambda k: init_state(cfg, tx, k), jax.random.key(0))


# ---------------------------------------------------------------------------- integrity

OK, DAMAGED, UNSEALED = 0, 1, 2   # a checkpoint's verdict; the largest any process finds wins


def _verdict(step_dir: Path) -> tuple[int, str | None]:
    """This process's verdict on a checkpoint: UNSEALED (a manifest it was written with is
    missing: nothing to verify against), DAMAGED (bytes that differ from this process's share of
    the manifests) or OK; the same answer on every process (agreed by one small collective)."""
    import jax

    gone = manifest.missing(step_dir)
    if gone:
        verdict, problem = UNSEALED, (f"it lacks {', '.join(gone)} (of the {manifest.expected(step_dir)} "
                                      "per-process manifests it was written with)")
    else:
        problem = manifest.damage(step_dir, jax.process_index(), jax.process_count())
        verdict = DAMAGED if problem else OK
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        verdicts = np.asarray(multihost_utils.process_allgather(np.int32(verdict))).reshape(-1)
        worst = int(verdicts.max())
        if worst != verdict:
            verdict, problem = worst, f"found by process {int(verdicts.argmax())}: see its log"
    return verdict, problem


# ---------------------------------------------------------------------------- structure

def _dotted(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def _leaves(tree) -> dict[str, tuple]:
    import jax

    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
            leaf = jax.eval_shape(jax.random.key_data, leaf)  # stored as its raw key data
            dtype = leaf.dtype
        out[_dotted(path)] = (tuple(getattr(leaf, "shape", ())), None if dtype is None else str(dtype))
    return out


def differences(saved_metadata, template) -> list[str]:
    """Leaves that differ between a checkpoint's stored metadata and a state (or its abstract)."""
    saved, wanted = _leaves(saved_metadata), _leaves(template)
    changed, gone, new = [], [], []
    for name in sorted(set(saved) | set(wanted)):
        a, b = saved.get(name), wanted.get(name)
        if a is None:
            new.append(f"{name}: not in the checkpoint")
        elif b is None:
            gone.append(f"{name}: in the checkpoint, not in the new state")
        elif a != b:
            changed.append(f"{name}: {a[0]} {a[1]} → {b[0]} {b[1]}")
    changed.sort(key=lambda d: not d.startswith("params."))   # the most telling first
    return changed + new + gone


def _structure_problem(manager, step: int, template) -> list[str] | None:
    """Differences against `step`'s metadata; None when the metadata cannot be read."""
    try:
        saved = manager.item_metadata(step)["state"]
    except Exception as err:  # unreadable metadata is damage, found by restore
        log.debug("metadata of step %d unreadable: %s", step, err)
        return None
    if saved is None:
        return None
    return differences(saved, template)


def check_structure(run_dir: str | Path, template, step: int | None = None) -> None:
    """Raise StructureMismatch if the newest checkpoint with readable metadata (or `step`'s: a
    fork's) differs from `template` (a state or `abstract_state(cfg)`). Reads metadata only."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return
    manager = _open_manager(directory, read_only=True)
    try:
        for step in [step] if step is not None else sorted(manager.all_steps(), reverse=True):
            diffs = _structure_problem(manager, step, template)
            if diffs is None:
                continue
            if diffs:
                raise StructureMismatch(str(directory / str(step)), diffs)
            return
    finally:
        manager.close()


# ---------------------------------------------------------------------------- restore

def _set_aside(manager, step: int) -> None:
    """Rename a damaged checkpoint to `<step>.corrupt` (kept for inspection), so that the
    resumed run can save that step again. Process 0 renames; every process then re-lists."""
    import jax

    if jax.process_index() == 0:
        path = Path(manager.directory) / str(step)
        target = path.with_name(f"{step}.corrupt")
        n = 1
        while target.exists():
            target, n = path.with_name(f"{step}.corrupt{n}"), n + 1
        path.rename(target)
        log.warning("moved the damaged checkpoint to %s", target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"marin-checkpoint-set-aside-{step}")
    manager.reload()


def set_aside_steps(directory: Path) -> list[str]:
    return sorted(p.name for p in Path(directory).glob("*.corrupt*"))


def _restore_newest(manager, template, where: str, set_aside: bool = True, at_most: int | None = None):
    """Restore the newest intact step (at or below `at_most` when given); older ones if the
    newest's bytes are damaged (set aside) or cannot be verified (a manifest missing: left in place).

    Returns (state, meta, the step directory it came from)."""
    import orbax.checkpoint as ocp

    steps = sorted((s for s in manager.all_steps() if at_most is None or s <= at_most), reverse=True)
    if not steps and at_most is not None:
        raise NoCheckpointError(f"no complete checkpoint at or below step {at_most} in {where}")
    if not steps:
        aside = set_aside_steps(manager.directory)
        raise NoCheckpointError(f"no complete checkpoint in {where}"
                                + (f" (set aside as damaged: {', '.join(aside)})" if aside else ""))
    args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(template)), meta=ocp.args.JsonRestore())
    damaged, unsealed = [], []
    for i, step in enumerate(steps):
        step_dir = Path(manager.directory) / str(step)
        older = f"trying step {steps[i + 1]}" if i + 1 < len(steps) else "no older one left"
        verdict, problem = _verdict(step_dir)
        if verdict == UNSEALED:   # maybe sound, but unverifiable: never restored, never renamed
            log.warning("checkpoint %s cannot be verified: %s; not restored, left in place; %s",
                        step_dir, problem, older)
            unsealed.append(step)
            continue
        if verdict == DAMAGED:
            log.warning("checkpoint %s is damaged (%s); %s", step_dir, problem, older)
            damaged.append(step)
            if set_aside:
                _set_aside(manager, step)
            continue
        verified = manifest.kind(step_dir) != "none"
        diffs = _structure_problem(manager, step, template)
        if diffs:
            raise StructureMismatch(str(step_dir), diffs)
        if not verified:
            log.warning("checkpoint %s has no manifest and its meta records none (written before manifests): "
                        "restored unverified", step_dir)
        try:
            restored = manager.restore(step, args=args)
        except Exception as err:
            first = (str(err).splitlines() or [""])[0][:300]
            raise CheckpointError(f"checkpoint {step_dir} ({'bytes verified' if verified else 'unverified'}) "
                                  f"does not restore: {type(err).__name__}: {first}; it was left in place") from err
        meta = dict(restored.meta or {})
        meta.setdefault("step", step)
        if i:
            log.warning("restored step %d instead of the newest checkpoint %d", step, steps[0])
        return restored.state, meta, step_dir
    why = [f"damaged: {', '.join(map(str, damaged))}" + (" (set aside)" if set_aside else "")] if damaged else []
    why += [f"a manifest missing, left in place: {', '.join(map(str, unsealed))}"] if unsealed else []
    error = NoneSealed if not damaged else NoCheckpointError
    raise error(f"no intact checkpoint in {where} (tried steps {steps}; {'; '.join(why)})")


def _quiet_closed_loop_callbacks() -> None:
    """After a failed save orbax closes its event loop while tensorstore still has writes in
    flight; each one's completion callback then raises "Event loop is closed" inside tensorstore,
    which reports it through sys.unraisablehook: a traceback per write (40 in the probe's run), none
    saying more than the save's own error. Those alone are dropped; anything else goes on as before."""
    previous = sys.unraisablehook
    if getattr(previous, "_marin_quiet", False):
        return

    def hook(unraisable):
        err = unraisable.exc_value
        if not (isinstance(err, RuntimeError) and str(err) == "Event loop is closed"):
            previous(unraisable)

    hook._marin_quiet = True
    sys.unraisablehook = hook


class Checkpointer:
    """Save and restore the train state of the run in `run_dir` (config: `train.checkpoint`)."""

    def __init__(self, run_dir: str | Path, cfg, clock=time.monotonic):
        import jax

        self.run_cfg = cfg
        self.cfg = cfg.train.checkpoint
        self.directory = checkpoint_dir(run_dir)
        self._clock = clock
        self._last_save = clock()
        self.restored_from: Path | None = None
        self._process = (jax.process_index(), jax.process_count())
        self._sealer: threading.Thread | None = None   # hashes the save in flight once orbax commits it
        self._seal_error: BaseException | None = None
        self._sealed_here: int | None = None   # this process wrote its manifest; the others' not yet agreed
        self.newest_sealed: int | None = None    # every process's manifest written (retention keeps it)
        self._saving: int | None = None   # the step of the save in flight
        absl = logging.getLogger("absl")   # orbax's threads log a full disk with tracebacks: one DiskFull instead
        if errors.quiet_disk_full not in absl.filters:
            absl.addFilter(errors.quiet_disk_full)
        _quiet_closed_loop_callbacks()

    @functools.cached_property
    def _manager(self):
        """Orbax's manager, opened at the first save or restore (importing orbax takes a quarter of
        a second; a fresh run's loop imports it in the background while its first steps run)."""
        return _open_manager(self.directory, self.cfg, newest_sealed=lambda: self.newest_sealed)

    def _seal(self, step: int) -> None:
        """Once orbax has committed `step` (every process's shards, renamed into place), hash the
        files this process wrote into its manifest. Runs on the sealer thread for an async save."""
        try:
            self._manager.wait_until_finished()
            t0 = time.perf_counter()
            path = manifest.write(self.directory / str(step), *self._process)
            log.debug("checkpoint %d sealed: %s in %.1f s", step, path.name, time.perf_counter() - t0)
            self._sealed_here = step
        except BaseException as err:  # raised on the training thread, by wait()
            self._seal_error = err

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (None if there is none)."""
        if not self.directory.is_dir():  # a fresh run: no need for orbax yet
            return None
        self._manager.reload()
        return self._manager.latest_step()

    def set_aside(self) -> list[str]:
        """Names of checkpoints set aside as damaged."""
        return set_aside_steps(self.directory)

    def permanent(self, step: int) -> bool:
        """Whether the config makes `step` a permanent checkpoint: a multiple of `permanent_every`
        or one of `permanent_steps`."""
        every = self.cfg.permanent_every
        return (every > 0 and step % every == 0) or step in (getattr(self.cfg, "permanent_steps", None) or ())

    def should_save(self, step: int) -> bool:
        """The config's regular saves: every `every_steps`, and each permanent step."""
        every = self.cfg.every_steps
        return (every > 0 and step % every == 0) or self.permanent(step)

    def due(self, step: int, rolling: bool = False) -> bool:
        """Whether the loop saves at `step`: a regular save, or a rolling one (`time_due`, agreed)."""
        return rolling or self.should_save(step)

    def time_due(self) -> bool:
        """Whether this process's clock says a rolling checkpoint is due (`every_minutes`). Only
        process 0's answer counts: the loop makes every process agree (see preempt.poll)."""
        minutes = getattr(self.cfg, "every_minutes", 0) or 0
        return minutes > 0 and self._clock() - self._last_save >= 60.0 * minutes

    def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
        """Start saving `state` at `step` (asynchronously); returns whether a save was started.

        Without `force` only the steps of `should_save` are written, so the loop may call this
        every step. `meta` must be JSON (step, data position, MLflow run id, horizon, ...).
        """
        import orbax.checkpoint as ocp

        if not (force or self.should_save(step)):
            return False
        self._agree_sealed()   # the previous save sealed everywhere: retention may count on it
        if step in self._manager.all_steps():
            if not manifest.complete(self.directory / str(step)):
                log.warning("checkpoint %s exists without all its manifests (left in place); not saved again",
                            self.directory / str(step))
            return False  # already saved (e.g. a forced save right after a regular one)
        horizon = self.run_cfg.schedule.horizon_steps or self.run_cfg.train.steps
        # Batches are a pure function of the step and the mixture history: `data_position` is the
        # step; each source's read position is in meta["data"] (the Loader's rows drawn per phase).
        # The RNG is a pure function of the seed and the step (the state holds no key of its own).
        # `manifests`: how many per-process manifests seal it, so one that goes missing is noticed.
        meta = {"data_position": int(step), "horizon": horizon, "rng_seed": self.run_cfg.train.seed,
                **meta, "step": int(step), manifest.META_KEY: self._process[1]}
        if self.permanent(step):   # kept forever, whatever a later config's retention says
            meta["permanent"] = True
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._saving = int(step)
        with self._full_disk_as_one_error():
            started = bool(self._manager.save(step, args=args, force=True))
        self._last_save = self._clock()
        if started and self.cfg.async_save:   # hashed off the training thread, after orbax's commit
            self._sealer = threading.Thread(target=self._seal, args=(int(step),), name=f"marin-seal-{step}", daemon=True)
            self._sealer.start()
        elif started:
            self._seal(int(step))
            self._raise_seal_error()
        return started

    def _raise_seal_error(self) -> None:
        err, self._seal_error = self._seal_error, None
        if err is not None:
            first = (str(err).splitlines() or [""])[0][:300]
            raise CheckpointError(f"a checkpoint in {self.directory} was committed but not sealed "
                                  f"(its manifest was not written: {type(err).__name__}: {first})") from err

    def _agree_sealed(self) -> None:
        """Wait for the save in flight and its manifest; then (one barrier) every process has
        written its own, and `newest_sealed` moves to that step on all of them alike."""
        self.wait()
        if self._sealed_here is None:
            return
        if self._process[1] > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"marin-checkpoint-sealed-{self._sealed_here}")
        self.newest_sealed, self._sealed_here = self._sealed_here, None

    def restore(self, template_state) -> tuple[object, dict] | None:
        """The newest intact checkpoint as (state, meta); `template_state` gives the structure,
        shapes and shardings. A damaged newest checkpoint is set aside with a warning; one that lacks
        a manifest is left in place, with a warning; either way the one before it is tried. None
        when no checkpoint was ever sealed (none damaged): the run starts from step 0."""
        self._agree_sealed()
        try:
            state, meta, self.restored_from = _restore_newest(self._manager, template_state, str(self.directory))
        except NoneSealed as err:
            log.warning("%s: none was verified, starting from step 0", err)
            return None
        self.newest_sealed = int(self.restored_from.name)
        return state, meta

    def wait(self) -> None:
        """Block until the pending save is committed on disk and sealed by this process."""
        with self._full_disk_as_one_error():
            if self._opened:
                self._manager.wait_until_finished()
            if self._sealer is not None:
                self._sealer.join()
                self._sealer = None
            self._raise_seal_error()

    @contextlib.contextmanager
    def _full_disk_as_one_error(self):
        """A save that fails for want of space (orbax's ValueError "RESOURCE_EXHAUSTED … No space
        left on device", an OSError ENOSPC) becomes one DiskFull naming the step, the folder and the
        checkpoint a resume starts from; the unsealed step is never restored (`restore`)."""
        try:
            yield
        except Exception as err:
            if not errors.disk_full(err) or isinstance(err, DiskFull):
                raise
            if self._sealer is not None:   # the sealer thread ends on the same error
                self._sealer.join()
                self._sealer, self._seal_error = None, None
            newest = self.newest_sealed if self.newest_sealed is not None else self._sealed_here
            start = f"checkpoint {newest}" if newest is not None else "step 0 (no checkpoint was saved)"
            raise DiskFull(f"checkpoint {self._saving} not saved: no space left on device in {self.directory}; "
                           f"free some space, then resume= starts from {start}") from None

    def close(self) -> None:
        if self._opened:
            self.wait()
            self._manager.close()

    @property
    def _opened(self) -> bool:
        return "_manager" in self.__dict__  # functools.cached_property keeps it there


def restore_from(source: str | Path, template_state, at_most: int | None = None) -> tuple[object, dict]:
    """The newest checkpoint of another run (its run directory, or its checkpoints directory), at
    or below step `at_most` when given, read-only: how a stage experiment (`train.init_from`)
    starts from an earlier run (see marin/train/init_from.py)."""
    source = Path(source)
    directory = source if source.name == "checkpoints" else checkpoint_dir(source)
    if not directory.is_dir():
        raise NoCheckpointError(f"{directory} does not exist")
    manager = _open_manager(directory.resolve(), read_only=True)
    try:
        return _restore_newest(manager, template_state, str(directory), set_aside=False, at_most=at_most)[:2]
    finally:
        manager.close()
