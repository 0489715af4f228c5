"""Checkpoints of a run: orbax, asynchronous, atomic, in `<run_dir>/checkpoints/<step>/`.

A checkpoint holds the whole train state (parameters, optimizer state, the router state — QB's
pending betas —, the step, and an RNG key if the state has one) plus a small JSON `meta`: step,
data position, MLflow run id, horizon and the RNG seed (filled in by `save` when the loop does
not give them). Orbax writes each step into a temporary directory and renames it when every
process has finished, so a half-written checkpoint is never listed, let alone restored.
Retention: the last `keep_last`, plus every multiple of `permanent_every` forever.

Every process calls `save` and `restore` together (each writes and reads its own shards).
"""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("marin.checkpoint")


class NoCheckpointError(FileNotFoundError):
    """No complete, readable checkpoint in a run directory."""


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir).resolve() / "checkpoints"


def _manager(directory: Path, ckpt_cfg=None, read_only: bool = False):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(
        max_to_keep=ckpt_cfg.keep_last if ckpt_cfg and ckpt_cfg.keep_last > 0 else None,
        keep_period=ckpt_cfg.permanent_every if ckpt_cfg and ckpt_cfg.permanent_every > 0 else None,
        enable_async_checkpointing=bool(ckpt_cfg.async_save) if ckpt_cfg else False,
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,   # leftovers of a save that was killed
    )
    return ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))


def _abstract(template):
    """Shapes, dtypes and shardings of `template` (restored arrays land on the same devices)."""
    import jax
    import orbax.checkpoint as ocp

    return jax.tree.map(ocp.utils.to_shape_dtype_struct, template)


def _set_aside(manager, step: int) -> None:
    """Rename an unreadable checkpoint to `<step>.corrupt` (kept for inspection), so that the
    resumed run can save that step again. Process 0 renames; every process then re-lists."""
    import jax

    if jax.process_index() == 0:
        path = Path(manager.directory) / str(step)
        target = path.with_name(f"{step}.corrupt")
        n = 1
        while target.exists():
            target, n = path.with_name(f"{step}.corrupt{n}"), n + 1
        path.rename(target)
        log.warning("moved the unreadable checkpoint to %s", target)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(f"marin-checkpoint-set-aside-{step}")
    manager.reload()


def _restore_newest(manager, template, where: str, set_aside: bool = True):
    """Restore the newest step that reads back whole; older ones if the newest is corrupt."""
    import orbax.checkpoint as ocp

    steps = sorted(manager.all_steps(), reverse=True)
    if not steps:
        raise NoCheckpointError(f"no complete checkpoint in {where}")
    args = ocp.args.Composite(state=ocp.args.StandardRestore(_abstract(template)), meta=ocp.args.JsonRestore())
    for i, step in enumerate(steps):
        try:
            restored = manager.restore(step, args=args)
        except Exception as err:  # a damaged checkpoint can fail in many ways (missing file, bad bytes)
            older = f"trying step {steps[i + 1]}" if i + 1 < len(steps) else "no older one left"
            log.warning("checkpoint %s/%d is unreadable (%s: %s); %s",
                        where, step, type(err).__name__, (str(err).splitlines() or [""])[0][:200], older)
            if set_aside:
                _set_aside(manager, step)
            continue
        meta = dict(restored.meta or {})
        meta.setdefault("step", step)
        if i:
            log.warning("restored step %d instead of the newest checkpoint %d", step, steps[0])
        return restored.state, meta
    raise NoCheckpointError(f"no readable checkpoint in {where} (tried steps {steps})")


class Checkpointer:
    """Save and restore the train state of the run in `run_dir` (config: `train.checkpoint`)."""

    def __init__(self, run_dir: str | Path, cfg):
        self.run_cfg = cfg
        self.cfg = cfg.train.checkpoint
        self.directory = checkpoint_dir(run_dir)
        self._manager = _manager(self.directory, self.cfg)

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step (None if there is none)."""
        self._manager.reload()
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def should_save(self, step: int) -> bool:
        """The config's regular saves: every `every_steps`, and each permanent step."""
        every, permanent = self.cfg.every_steps, self.cfg.permanent_every
        return (every > 0 and step % every == 0) or (permanent > 0 and step % permanent == 0)

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
        # Batches are a pure function of the step, so the data position is the step itself.
        # The RNG is a pure function of the seed and the step (the state holds no key of its own).
        meta = {"data_position": int(step), "horizon": horizon, "rng_seed": self.run_cfg.train.seed,
                **meta, "step": int(step)}
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return bool(self._manager.save(step, args=args, force=True))

    def restore(self, template_state) -> tuple[object, dict]:
        """The newest readable checkpoint as (state, meta); `template_state` gives the structure,
        shapes and shardings. A corrupt newest checkpoint is skipped with a warning."""
        self.wait()
        return _restore_newest(self._manager, template_state, str(self.directory))

    def wait(self) -> None:
        """Block until the pending asynchronous save is complete (committed on disk)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def restore_from(source: str | Path, template_state) -> tuple[object, dict]:
    """The newest checkpoint of another run (its run directory, or its checkpoints directory),
    read-only: how a stage experiment (`train.init_from`) starts from an earlier run."""
    source = Path(source)
    directory = source if source.name == "checkpoints" else checkpoint_dir(source)
    if not directory.is_dir():
        raise NoCheckpointError(f"{directory} does not exist")
    manager = _manager(directory.resolve(), read_only=True)
    try:
        return _restore_newest(manager, template_state, str(directory), set_aside=False)
    finally:
        manager.close()
