"""`train.init_from=<run directory or MLflow run id>[@<step>]`: the checkpoint a run starts from.

A stage experiment continues another run's state: the hero's 8K stage starts from the pretraining
run at 50% (`train.init_from=<hero run>@195125`), the 65K stage near the end. Without `@<step>`
the source's newest checkpoint is used; with it, the newest checkpoint at or below that step
(checkpoints are taken every so many steps, so the asked step need not be one). `verify_steps`
(marin/launch/verify.py) starts a window replay the same way.

`locate` runs during validation, before anything is written: a malformed step, a source without
checkpoints, or a step below its first checkpoint is a `train.init_from` error (exit 2). Pure
Python: importing this module never imports JAX.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from marin.config.paths import project_path
from marin.track import backend, record
from marin.train.checkpoint import listed_steps

SEP = "@"


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
    (a dry run plans on any machine, as for data paths)."""

    spec = cfg.train.init_from
    if not spec:
        return []
    try:
        if cfg.dry_run:
            split(spec)
        else:
            locate(spec, tracking_uri=backend.tracking_uri(cfg), out_dir=backend.out_dir(cfg))
    except InitFromError as err:
        return [("train.init_from", str(err))]
    return []
