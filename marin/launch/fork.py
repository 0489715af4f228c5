"""`python launch.py fork=<run directory or MLflow run id>@<step> [overrides]`: a new run that
continues another from one of its checkpoints (spec §8: every production cutover was one).

A fork is "resume into a new run record": the parent's config is recomposed with the overrides
as `resume=` does (`marin.launch.reproduce.recompose`), the same structure check refuses an
override that changes the train state (exit 2, nothing written), and the new run restores the
parent's full train state at that step — step counter, optimizer, router state, data read
positions — through `train.init_from=<parent dir>@<step>` (read-only: the parent's directory and
MLflow run are never touched). The new run has its own directory, MLflow run and name
(`<parent name>-step<step>` unless `run.name` is given); its config says `fork=<parent run
id>@<step>`, MLflow tags it `forked_from` and `fork_changes`, and record.json's `init_from`
lists the changes. `python -m marin.lineage <run>` follows the chain back.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

from omegaconf import OmegaConf

from marin.cli import config_errors, fail
from marin.config.store import last_per_key, override, override_key, shell_join
from marin.config.validate import ConfigError
from marin.launch.distributed import apply_environment
from marin.launch.memory import launch_refusal
from marin.launch.plan import print_plan
from marin.launch.reproduce import ReproduceError, lookup_uri, out_dir, recompose
from marin.launch.resume import IGNORED, PER_INVOCATION, _describe, changes_between
from marin.launch.slurm import submit
from marin.track import record
from marin.train.checkpoint import StructureMismatch, abstract_state, check_structure, checkpoint_dir, listed_steps
from marin.train.init_from import InitFromError, split

# Where the new run lives follows the parent unless the command line says otherwise.
FOLLOWS_PARENT = ("tracking.uri", "run.out_dir")


class ForkError(ValueError):
    """A fork that cannot be made as asked; the message is one line naming the field."""


@dataclass
class Fork:
    composed: object
    resolved: object
    overrides: list[str]          # for the new record: the parent's, then this command line's
    parent: record.RunRecord
    step: int
    changes: dict                 # {key: [parent's, fork's]}


def nearest_steps(steps: list[int], step: int, shown: int = 8) -> str:
    """The checkpoint steps nearest `step`, in order (a long run's whole list would fill the line)."""
    near = sorted(sorted(steps, key=lambda s: (abs(s - step), s))[:shown])
    return (", ".join(map(str, near)) + (f" ({len(steps)} in all)" if len(steps) > len(near) else "")) or "none"


def _parent(spec: str, new: list[str]) -> tuple[record.RunRecord, int]:
    try:
        ref, step = split(spec)
    except InitFromError as err:
        raise ForkError(f"fork: {err}") from None
    if step is None:
        raise ForkError(f"fork: give the checkpoint step: fork=<run directory or MLflow run id>@<step> (got {spec!r})")
    try:
        parent = record.open(ref, tracking_uri=lookup_uri(new), out_dir=out_dir(new))
    except record.RecordError as err:
        raise ForkError(f"fork: {err}") from None
    steps = listed_steps(checkpoint_dir(parent.run_dir))
    if step not in steps:
        shown = nearest_steps(steps, step)
        raise ForkError(f"fork: run {parent.run_id} has no checkpoint at step {step} (its checkpoints: {shown}); "
                        f"make one: {how_to_make(parent, steps, step)}")
    return parent, step


def how_to_make(parent: record.RunRecord, steps: list[int], step: int) -> str:
    """The command that makes a checkpoint at exactly `step` (`train.stop_at`: the run ends there
    with one): past the parent's last step, a fork of its last checkpoint run to it (`train.steps`);
    the parent resumed to it while its newest checkpoint is below it; else a fork of the checkpoint
    below it run up to it (then fork from that run); else the run reproduced up to it."""
    at = f"train.stop_at={step}"
    resolved = parent.resolved()
    name = f"{resolved.run.name}-to{step}"
    then = ", then " + shell_join(["python", "launch.py", override("fork", f"{name}@{step}")])
    if steps and isinstance(resolved.train.steps, int) and step > resolved.train.steps:  # past the run's end
        return (f"(the run ends at step {resolved.train.steps}) "
                + shell_join(["python", "launch.py", override("fork", f"{parent.run_id}@{steps[-1]}"),
                              f"train.steps={step}", override("run.name", name)]) + then)
    if steps and steps[-1] < step:
        return shell_join(["python", "launch.py", override("resume", parent.run_dir), at])
    below = [s for s in steps if s < step]
    if below:
        return (shell_join(["python", "launch.py", override("fork", f"{parent.run_id}@{below[-1]}"), at,
                            override("run.name", name)]) + then)
    return shell_join(["python", "launch.py", override("reproduce", parent.run_id), at])


def compose(spec: str, command_overrides: list[str]) -> Fork:
    """The new run's config: the parent's, recomposed with `command_overrides` (a `fork=` entry
    among them is ignored), starting from the parent's checkpoint `step`. Raises ForkError."""
    new = [o for o in command_overrides if override_key(o) != "fork"]
    parent, step = _parent(spec, new)
    given = {override_key(o) for o in new}
    # The parent as it last ran: the overrides of its resumes too (a transport switched by resume=)
    earlier = parent.info().get("resumes") or []
    new = last_per_key([o for r in earlier for o in r.get("overrides", []) if override_key(o) not in PER_INVOCATION] + new)
    latest = earlier[-1]["resolved"] if earlier and earlier[-1].get("resolved") else record.RESOLVED
    try:
        parent_cfg = record.load_config_file(parent.run_dir / latest)
    except record.RecordError as err:
        raise ForkError(f"fork: {err}") from None
    # The parent's stop_after was its own invocation's; its stop_at, the end of its part of the lineage.
    extra = [f"{k}=null" for k in (*PER_INVOCATION, "train.stop_at") if k not in given]
    if "run.name" not in given:
        extra.append(override("run.name", f"{parent_cfg['run']['name']}-step{step}"))
    extra += [override("train.init_from", f"{parent.run_dir}@{step}"), "train.init_from_mode=continue"]  # the whole state
    try:
        composed, resolved, overrides = recompose(str(parent.run_dir), [*new, *extra], verb="forking")
    except ReproduceError as err:
        raise ForkError(f"fork: {err}") from None
    except ConfigError as err:
        raise ForkError(config_errors(err, prefix="fork: ")) from None
    for cfg in (composed, resolved):  # a new run of the lineage, not a reproduction
        cfg.reproduce = None
        cfg.fork = f"{parent.run_id}@{step}"
        for key in FOLLOWS_PARENT:
            if key not in given:
                section, leaf = key.split(".")
                setattr(getattr(cfg, section), leaf, parent.tracking_uri if key == "tracking.uri"
                        else parent_cfg["run"]["out_dir"])
    overrides = [o for o in overrides if override_key(o) != "reproduce"] + [override("fork", f"{parent.run_id}@{step}")]
    changes = {k: v for k, v in changes_between(parent_cfg, record.config_dict(resolved)).items()
               if k not in IGNORED and not k.startswith(("run.", "train.init_from"))}
    if resolved.hardware.launcher != "slurm":  # trained here: JAX starts (for the check) as the run needs it
        apply_environment(resolved.hardware)
    _check_structure(parent, step, resolved, changes, given)  # its checkpoint's bytes: init_from.problems
    return Fork(composed, resolved, overrides, parent, step, changes)


def _check_structure(parent, step: int, resolved, changes: dict, given: set[str]) -> None:
    """As resume= does: the new config's train state must take the parent's checkpoint."""
    try:
        check_structure(parent.run_dir, abstract_state(resolved), step=step)
    except StructureMismatch as err:
        named = [k for k in changes if k in given] or list(changes)
        fields = ", ".join(f"{k} {changes[k][0]} → {changes[k][1]}" for k in named) or "the config"
        leaves = "; ".join(err.differences[:2]) + (f" (+{len(err.differences) - 2} more)" if len(err.differences) > 2 else "")
        raise ForkError(f"fork: {fields} changes the train state ({leaves}), so checkpoint {err.where} cannot be "
                        f"restored into it; nothing was written. Start a new run with train.init_from or "
                        f"reproduce= instead") from None


def fork(cfg, command_overrides: list[str]) -> record.RunRecord | None:
    """launch.py's `fork=`: compose, say what changes, then dry-run, submit or train here (the
    new run's record: None for a dry run or a Slurm submission)."""
    try:
        made = compose(str(cfg.fork), command_overrides)
    except ForkError as err:
        fail(str(err))
    resolved = made.resolved
    dry_run = OmegaConf.select(cfg, "dry_run")
    print(f"forking run {made.parent.run_id} ({made.parent.run_dir}) at step {made.step}"
          + (f"\n  changes: {_describe(made.changes)}" if made.changes else "\n  changes: none"),
          file=sys.stderr if dry_run == "json" else sys.stdout, flush=True)
    if dry_run:
        print_plan(resolved, as_json=dry_run == "json")
        return None
    if resolved.hardware.launcher == "slurm":
        submit(made.composed, resolved, made.overrides)
        return None
    if (problem := launch_refusal(resolved)) is not None:  # a CPU run bigger than this machine
        fail(problem)
    from marin.launch.local import run_local  # JAX: the trainer's imports stay off the dry-run path

    return run_local(made.composed, resolved, made.overrides)
