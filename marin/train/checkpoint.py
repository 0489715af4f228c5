"""Checkpoints of a run: orbax, asynchronous, atomic, in `<run_dir>/checkpoints/<step>/`.

A checkpoint holds the whole train state (parameters, optimizer state, the router state — QB's
pending betas —, the step, and an RNG key if the state has one) plus a small JSON `meta`: step,
data position, MLflow run id, horizon and the RNG seed (filled in by `save` when the loop does
not give them). Orbax writes each step into a temporary directory and renames it when every
process has finished, so a half-written checkpoint is never listed, let alone restored.
Retention: the last `keep_last`, plus every multiple of `permanent_every` forever.

Integrity: each step directory carries `marin_manifest.json`, the sha256 of every file in it,
written by process 0 after orbax has finalized the items and before it renames the temporary
directory (orbax's post-finalization callback), so a committed checkpoint has its manifest from
the first moment it is listed. `restore` checks it: a checkpoint whose own bytes differ is set
aside as `<step>.corrupt` (never deleted) and the one before it is used. A checkpoint without a
manifest (written before manifests existed) is restored unverified, with a warning.

Nothing else renames a checkpoint: a state whose structure differs from the checkpoint's (a
config that changed the model or the optimizer) raises `StructureMismatch`, checked from orbax's
metadata before anything is read, and a verified checkpoint that still fails to restore raises.

Every process calls `save` and `restore` together (each writes and reads its own shards).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from pathlib import Path

log = logging.getLogger("marin.checkpoint")

MANIFEST = "marin_manifest.json"
# Orbax rewrites these at the rename (commit time stamps, markers); they hold no train state.
UNHASHED = ("_CHECKPOINT_METADATA", "commit_success.txt")


class NoCheckpointError(FileNotFoundError):
    """No complete, readable checkpoint in a run directory."""


class StructureMismatch(ValueError):
    """The state to restore into differs in structure (leaves, shapes, dtypes) from a checkpoint."""

    def __init__(self, where: str, differences: list[str]):
        self.where, self.differences = where, differences
        shown = "; ".join(differences[:3]) + (f" (+{len(differences) - 3} more)" if len(differences) > 3 else "")
        super().__init__(f"the train state does not match checkpoint {where}: {shown}")


class CheckpointError(RuntimeError):
    """A checkpoint whose bytes are intact (or unverifiable) but that does not restore."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).resolve() / "checkpoints"


def listed_steps(directory: str | Path) -> list[int]:
    """The committed checkpoint steps in a checkpoints directory, as orbax lists them (a step is
    a folder named by its integer; a save in flight is a temporary folder, a damaged one set aside
    is `<step>.corrupt`), oldest first. Pure Python: no JAX, so validation can call it."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit() and p.is_dir())


def _open_manager(directory: Path, ckpt_cfg=None, read_only: bool = False, on_finalized=None):
    import orbax.checkpoint as ocp

    if read_only:  # orbax warns that a read-only manager is read-only
        logging.getLogger("absl").setLevel(logging.ERROR)
    use_async = bool(ckpt_cfg.async_save) if ckpt_cfg else False
    options = ocp.CheckpointManagerOptions(
        max_to_keep=ckpt_cfg.keep_last if ckpt_cfg and ckpt_cfg.keep_last > 0 else None,
        keep_period=ckpt_cfg.permanent_every if ckpt_cfg and ckpt_cfg.permanent_every > 0 else None,
        enable_async_checkpointing=use_async,
        # Runs on process 0 after the items are finalized, before the directory is renamed.
        async_options=ocp.AsyncOptions(post_finalization_callback=on_finalized) if use_async and on_finalized else None,
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,   # leftovers of a save that was killed
    )
    handlers = {"state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()}
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

def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_manifest(step_dir: Path) -> None:
    """sha256 of every file of a finalized step directory, into `marin_manifest.json`."""
    files = sorted(p for p in step_dir.rglob("*")
                   if p.is_file() and p.name != MANIFEST and str(p.relative_to(step_dir)) not in UNHASHED)
    manifest = {"algorithm": "sha256", "files": {str(p.relative_to(step_dir)): _sha256(p) for p in files}}
    tmp = step_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=0))
    tmp.replace(step_dir / MANIFEST)


def damage(step_dir: Path) -> str | None:
    """What is wrong with the bytes of a checkpoint (None: they match its manifest, or it has
    none — see `has_manifest`)."""
    path = step_dir / MANIFEST
    if not path.is_file():
        return None
    try:
        files = json.loads(path.read_text())["files"]
    except (ValueError, KeyError, OSError) as err:
        return f"its manifest is unreadable ({err})"
    for name, digest in files.items():
        f = step_dir / name
        if not f.is_file():
            return f"{name} is missing"
        if _sha256(f) != digest:
            return f"{name} does not match its sha256"
    return None


def _damage_agreed(step_dir: Path) -> str | None:
    """`damage` as process 0 sees it, the same answer on every process."""
    import jax

    problem = damage(step_dir) if jax.process_index() == 0 else None
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils

        bad = multihost_utils.broadcast_one_to_all(np.array(problem is not None))
        problem = (problem or "damaged (see process 0)") if bool(bad) else None
    return problem


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


def check_structure(run_dir: str | Path, template) -> None:
    """Raise StructureMismatch if the newest checkpoint with readable metadata differs from
    `template` (a state or `abstract_state(cfg)`). Reads metadata only; writes nothing."""
    directory = checkpoint_dir(run_dir)
    if not directory.is_dir():
        return
    manager = _open_manager(directory, read_only=True)
    try:
        for step in sorted(manager.all_steps(), reverse=True):
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
    newest's bytes are damaged.

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
    for i, step in enumerate(steps):
        step_dir = Path(manager.directory) / str(step)
        older = f"trying step {steps[i + 1]}" if i + 1 < len(steps) else "no older one left"
        problem = _damage_agreed(step_dir)
        if problem:
            log.warning("checkpoint %s is damaged (%s); %s", step_dir, problem, older)
            if set_aside:
                _set_aside(manager, step)
            continue
        verified = (step_dir / MANIFEST).is_file()
        diffs = _structure_problem(manager, step, template)
        if diffs:
            raise StructureMismatch(str(step_dir), diffs)
        if not verified:
            log.warning("checkpoint %s has no %s (written before manifests): restored unverified", step_dir, MANIFEST)
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
    raise NoCheckpointError(f"no intact checkpoint in {where} (tried steps {steps}; damaged ones set aside)"
                            if set_aside else f"no intact checkpoint in {where} (tried steps {steps})")


class Checkpointer:
    """Save and restore the train state of the run in `run_dir` (config: `train.checkpoint`)."""

    def __init__(self, run_dir: str | Path, cfg, clock=time.monotonic):
        import jax

        self.run_cfg = cfg
        self.cfg = cfg.train.checkpoint
        self.directory = checkpoint_dir(run_dir)
        self._clock = clock
        self._last_save = clock()
        self._saving: int | None = None       # the step of the save in flight (sealed on finalize)
        self.restored_from: Path | None = None
        self._primary = jax.process_index() == 0

    @functools.cached_property
    def _manager(self):
        """Orbax's manager, opened at the first save or restore (importing orbax takes a quarter of
        a second; a fresh run's loop imports it in the background while its first steps run)."""
        return _open_manager(self.directory, self.cfg, on_finalized=self._seal_in_flight)

    def _seal_in_flight(self) -> None:
        """Orbax's post-finalization callback (process 0, background thread): the manifest goes
        into the still-temporary directory, so it is committed by the same rename."""
        step = self._saving
        if step is None:
            return
        candidates = [p for p in self.directory.glob(f"{step}.orbax-checkpoint-tmp*") if p.is_dir()]
        write_manifest(candidates[0] if len(candidates) == 1 else self.directory / str(step))

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (None if there is none)."""
        if not self.directory.is_dir():  # a fresh run: no need for orbax yet
            return None
        self._manager.reload()
        return self._manager.latest_step()

    def set_aside(self) -> list[str]:
        """Names of checkpoints set aside as damaged."""
        return set_aside_steps(self.directory)

    def should_save(self, step: int) -> bool:
        """The config's regular saves: every `every_steps`, and each permanent step."""
        every, permanent = self.cfg.every_steps, self.cfg.permanent_every
        return (every > 0 and step % every == 0) or (permanent > 0 and step % permanent == 0)

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
        if step in self._manager.all_steps():
            return False  # already saved (e.g. a forced save right after a regular one)
        horizon = self.run_cfg.schedule.horizon_steps or self.run_cfg.train.steps
        # Batches are a pure function of the step and the mixture history: `data_position` is the
        # step; each source's read position is in meta["data"] (the Loader's rows drawn per phase).
        # The RNG is a pure function of the seed and the step (the state holds no key of its own).
        meta = {"data_position": int(step), "horizon": horizon, "rng_seed": self.run_cfg.train.seed,
                **meta, "step": int(step)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        self._manager.wait_until_finished()   # orbax waits for the previous save anyway
        self._saving = int(step)
        started = bool(self._manager.save(step, args=args, force=True))
        self._last_save = self._clock()
        if started and not self.cfg.async_save:
            self._seal_sync(step)
        return started

    def _seal_sync(self, step: int) -> None:
        import jax

        if self._primary:
            write_manifest(self.directory / str(step))
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"marin-checkpoint-sealed-{step}")

    def restore(self, template_state) -> tuple[object, dict]:
        """The newest intact checkpoint as (state, meta); `template_state` gives the structure,
        shapes and shardings. A damaged newest checkpoint is set aside with a warning."""
        self.wait()
        state, meta, self.restored_from = _restore_newest(self._manager, template_state, str(self.directory))
        return state, meta

    def wait(self) -> None:
        """Block until the pending asynchronous save is complete (committed on disk)."""
        if self._opened:
            self._manager.wait_until_finished()

    def close(self) -> None:
        if self._opened:
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
