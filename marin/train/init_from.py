"""`train.init_from=<run directory or MLflow run id>[@<step>]`: the checkpoint a run starts from.

Without `@<step>` the source's newest checkpoint is used; with it, the newest checkpoint at or
below that step (checkpoints are taken every so many steps, so the asked step need not be one).
`train.init_from_mode` says what is taken from it:

    weights    (default) the parameters and the router state; the run then trains train.steps
               new steps from step 0 with a fresh optimizer state, schedule and data order
    continue   the whole train state and its step counter: the run goes on from that step to
               train.steps on the source's schedule, as the hero's context-extension stages
               (`train.init_from=<hero run>@195125`), a fork and a `verify_steps` window do

Before anything is written: `problems` (validation, pure Python) refuses a malformed step, a
source without checkpoints, a step below its first checkpoint, and in continue mode a run that
would end at or before the restored step; `structure_problem` (launch, JAX) refuses a model or
optimizer whose train state the checkpoint cannot fill. Each is one line, exit 2. Importing this
module never imports JAX.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from marin.config.paths import project_path
from marin.track import backend, record
from marin.train import manifest
from marin.train.checkpoint import StructureMismatch, check_structure, listed_steps, restore_from

SEP = "@"
# Not changes of what is trained: where a run lives, how it was launched, its lineage's own fields.
NOT_CHANGES = ("run.", "tracking.", "train.init_from", "train.stop_after", "train.stop_at", "fork", "reproduce", "resume",
               "dry_run", "wait", "verify", "data.root", "data.cache_dir")


class InitFromError(ValueError):
    """A `train.init_from` that names no usable checkpoint; the message is one line."""


@dataclass(frozen=True)
class Start:
    checkpoints: Path        # the source run's checkpoints directory
    step: int                # the checkpoint to restore
    asked: int | None        # the step asked for (None: the newest)

    @property
    def run_dir(self) -> Path:
        return self.checkpoints.parent

    def describe(self) -> str:
        asked = "the newest" if self.asked is None else f"asked {self.asked}"
        return f"init from {self.run_dir} step {self.step} ({asked})"

    def changes(self, cfg) -> dict[str, list]:
        """{dotted key: [source's value, this run's]} where `cfg` differs from the source run's
        resolved config (bookkeeping left out): what a fork or a stage changed. {} without one."""
        path = self.run_dir / record.RESOLVED
        if not path.is_file():
            return {}
        import yaml  # the saved file is plain YAML (record.to_yaml)

        old, new = record.flatten(yaml.safe_load(path.read_text()) or {}), record.flatten(record.config_dict(cfg))
        return {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new))
                if old.get(k) != new.get(k) and not k.startswith(NOT_CHANGES)}


def split(spec: str) -> tuple[str, int | None]:
    """(run reference, asked step or None). The step is what follows the last `@`, unless that
    tail holds a `/` (then the `@` belongs to the path)."""
    ref, sep, tail = str(spec).rpartition(SEP)
    if not sep or "/" in tail:
        return str(spec), None
    if not tail.isdigit():
        raise InitFromError(f"the step after '{SEP}' must be a whole number ≥ 0 "
                            f"(<run directory or MLflow run id>{SEP}<step>); got {tail!r}")
    if not ref:
        raise InitFromError(f"give the run before '{SEP}<step>' (<run directory or MLflow run id>{SEP}<step>)")
    return ref, int(tail)


def _checkpoints(ref: str, tracking_uri: str | None, out_dir: Path | None) -> Path:
    """The checkpoints directory of a run directory (or the directory itself), a run name under
    <out_dir>/runs/, or an MLflow run id (its run_dir tag)."""

    for candidate in (Path(ref).expanduser(), project_path(ref)):
        if candidate.is_dir():
            candidate = candidate.resolve()
            return candidate if candidate.name == "checkpoints" else candidate / "checkpoints"

    try:
        return record.open(ref, tracking_uri=tracking_uri, out_dir=out_dir).run_dir / "checkpoints"
    except record.RecordError as err:
        raise InitFromError(str(err)) from None


def locate(spec: str, tracking_uri: str | None = None, out_dir: Path | None = None) -> Start:
    """The checkpoint `spec` names; raises InitFromError (one line) when there is none."""

    ref, asked = split(spec)
    directory = _checkpoints(ref, tracking_uri, out_dir)
    steps = listed_steps(directory)
    if not steps:
        raise InitFromError(f"{directory.parent} has no complete checkpoint (no step folder under {directory})")
    if asked is None:
        return Start(directory, steps[-1], None)
    below = [s for s in steps if s <= asked]
    if not below:
        raise InitFromError(f"step {asked} is below the first checkpoint of {directory.parent} (step {steps[0]}; "
                            f"checkpoints: {_shown(steps)})")
    return Start(directory, below[-1], asked)


def _shown(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 8 else f"{', '.join(map(str, steps[:4]))}, …, {steps[-1]}"


def problems(cfg) -> list[tuple[str, str]]:
    """validate's check of `train.init_from`: its form always, its checkpoint unless a dry run
    (a dry run plans on any machine, as for data paths), and in continue mode that the run ends
    above the restored step (else it would train nothing and still end FINISHED)."""

    t = cfg.train
    if t.stage_start is not None and t.init_seq_len and t.init_from_mode != "continue":  # a stage's steps are the run's
        return [("train.init_from_mode", "a context-extension stage (train.stage_start is set) continues its "
                 f"source's step counter and schedule: set train.init_from_mode=continue; got {t.init_from_mode}")]
    if not t.init_from:
        return []
    try:
        if cfg.dry_run:
            split(t.init_from)
            return []
        start = locate(t.init_from, tracking_uri=backend.tracking_uri(cfg), out_dir=backend.out_dir(cfg))
    except InitFromError as err:
        return [("train.init_from", str(err))]
    # A step named exactly is restored exactly or not at all: a damaged one fell back to the step
    # before it while the log and record said the one named. Checked here for a run trained on this
    # machine; a Slurm job's processes verify their shares at the restore (`restore`).
    if start.asked == start.step and cfg.hardware.launcher != "slurm" and (wrong := unsound(start)):
        return [("train.init_from", wrong)]
    if t.init_from_mode == "continue" and (ends := _last_step(cfg))[1] <= start.step:
        field, last = ends
        return [(field, f"must be above step {start.step}, where train.init_from_mode=continue restores "
                 f"{start.run_dir} (the step counter goes on from there: the run would train nothing); got {last}. "
                 f"To train that many new steps from its weights: train.init_from_mode=weights")]
    return []


def unsound(start: Start) -> str | None:
    """Why checkpoint `start.step` cannot be restored as it is (its bytes differ from its manifests,
    or a manifest is missing), naming the sound checkpoints near it; None when it verifies. The
    others are hashed only on this failure path."""
    def problem(step: int) -> str | None:
        step_dir = start.checkpoints / str(step)
        if gone := manifest.missing(step_dir):
            return f"cannot be verified (it lacks {', '.join(gone)})"
        return f"is damaged ({damaged})" if (damaged := manifest.damage(step_dir)) else None

    wrong = problem(start.step)
    if wrong is None:
        return None
    others = [s for s in listed_steps(start.checkpoints) if s != start.step][-8:]
    sound = [s for s in others if problem(s) is None]
    return (f"checkpoint {start.step} of {start.run_dir} {wrong}; a start from a named step restores exactly that "
            f"step, so nothing was written: name a sound one (sound: {', '.join(map(str, sound)) or 'none'})")


def _last_step(cfg) -> tuple[str, int]:
    """(the field that sets the run's last step, that step): stop_after, else the horizon."""
    t, horizon = cfg.train, cfg.schedule.horizon_steps
    field, last = ("schedule.horizon_steps", horizon) if horizon else ("train.steps", t.steps)
    for name, value in (("train.stop_after", t.stop_after), ("train.stop_at", t.stop_at)):
        if value is not None and value < last:
            field, last = name, value
    return field, last


def structure_problem(cfg) -> str | None:
    """One line if the run's train state (its model and optimizer) cannot take the `init_from`
    checkpoint, else None. Reads the checkpoint's metadata only (JAX: the state's shapes), so a
    launch refuses before anything is written, as `resume=` does."""
    from marin.train.checkpoint import abstract_state  # JAX

    start = locate(cfg.train.init_from, backend.tracking_uri(cfg), backend.out_dir(cfg))
    try:
        check_structure(start.run_dir, abstract_state(cfg), step=start.step)
    except StructureMismatch as err:
        shown = "; ".join(err.differences[:3]) + (f" (+{len(err.differences) - 3} more)" if len(err.differences) > 3 else "")
        return (f"train.init_from: checkpoint {err.where} does not fit this run's train state ({shown}): the model "
                f"and the optimizer must have the source run's shapes; nothing was written")
    return None


def restore(cfg, state, start: Start):
    """`state` (freshly initialised, laid out on the mesh) filled from checkpoint `start`:
    (state, the checkpoint's meta or None, what record.json keeps). Weights mode keeps the fresh
    step 0 and optimizer state (the checkpoint's are dropped) and no data position."""
    restored, meta = restore_from(start.checkpoints, state, at_most=start.step)
    step = int(restored.step)
    if start.asked == start.step and step != start.step:  # damaged (its warning said so): the step named, or none
        raise InitFromError(f"{'fork' if cfg.fork else 'train.init_from'}: checkpoint {start.step} of {start.run_dir} "
                            f"could not be restored (see the warning above); a start from a named step restores "
                            f"exactly that step, not step {step}: name a sound one")
    if cfg.train.init_from_mode == "weights":
        restored, meta = state.replace(params=restored.params, router_state=restored.router_state), None
    info = {"run_dir": str(start.run_dir), "step": step, "asked": start.asked, "mode": cfg.train.init_from_mode}
    return restored, meta, info
