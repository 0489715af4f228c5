"""`python launch.py resume=<run directory or MLflow run id> [overrides]`: continue a stopped or
crashed run — in the same directory and MLflow run, from its newest complete checkpoint, here
or on Slurm as its (possibly new) hardware says.

The config is the run's own, recomposed with the overrides of every earlier resume and of this
command line (`marin.launch.reproduce.recompose`). Overrides usually shorten the horizon
(`schedule.horizon_steps`, the failure plan) or move the run to other hardware. MLflow params
are immutable, so a change is recorded as a tag (`resume_<n>`) and a new config artifact
(`record/resolved.resume-<n>.yaml`, also kept in the run directory); record.json lists resumes,
updated only once the checkpoint is restored (on Slurm: once the job is submitted).

A mixture change (`data=…`, `data.sources`, the cells file; spec §8: the step-108,000 weights)
keeps every source's read position (saved in the checkpoint, `marin.data.loader`) and applies the
new weights from the restored step: tag `data_mixture` ("<name> from step N (…)").

`train.stop_after` belongs to one invocation: a resume runs to the end unless it is given again.
`train.stop_at` (a lineage's cutover: the run ends there with a checkpoint) is kept, so a resumed
or requeued run still ends at exactly that step; `train.stop_at=null` trains on.
A run whose newest checkpoint is already at its last step (or at stop_after / stop_at) is
not re-run: one line says so, exit 0, nothing written. A run another process is training (its
lock, marin.track.runlock) is refused in one line naming that process, before anything is written.
Overrides that change the train state's structure (model shapes, optimizer tree) are refused
before anything is written: no checkpoint could be restored into that state (use reproduce=).
"""
from __future__ import annotations

import json
import logging
import sys
import time


from marin.cli import config_errors, fail
from marin.launch.memory import launch_refusal
from marin.config.store import last_per_key, override, override_key, shell_join
from marin.config.validate import ConfigError
from marin.launch import slurm as slurm_launch
from marin.launch.distributed import apply_environment, check_gpu_install
from marin.launch.plan import print_plan
from marin.launch.reproduce import ReproduceError, lookup_uri, out_dir, recompose
from marin.track import backend, record, runlock, secrets
from marin.track.record import flatten
from marin.train.checkpoint import (
    CheckpointError,
    NoCheckpointError,
    StructureMismatch,
    abstract_state,
    check_structure,
    checkpoint_dir,
)

log = logging.getLogger("marin.resume")

IGNORED = ("resume", "reproduce", "fork", "dry_run", "wait", "tracking.uri", "train.stop_after", "train.stop_at",
           "data.tokens_per_core_s")   # not changes of the run (the last: a preparation plan's figure, auto = measured)
PER_INVOCATION = ("train.stop_after",)   # never carried into a later resume
MIXTURE_KEYS = ("data.name", "data.sources", "data.cells_file", "data.phase_names", "data.phase_boundaries")



def changes_between(old: dict, new: dict) -> dict[str, list]:
    """{dotted key: [old, new]} of the resolved configs, bookkeeping keys left out."""
    a, b = flatten(old), flatten(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in IGNORED}


def _describe(changes: dict) -> str:
    return "; ".join(f"{k}: {v[0]} → {v[1]}" for k, v in changes.items())


def _recompose(source, overrides: list[str], previous: dict):
    """(composed, resolved, changes against `previous`) of the run with `overrides`."""
    if not any(override_key(o) in PER_INVOCATION for o in overrides):  # the saved run's stop_after ended its invocation
        overrides = [*overrides, *(f"{k}=null" for k in PER_INVOCATION)]
    try:
        composed, resolved, _ = recompose(str(source.run_dir), overrides, verb="resuming")
    except ReproduceError as err:
        fail(f"resume: {err}")
    except ConfigError as err:
        fail(config_errors(err, prefix="resume: "))
    for cfg in (composed, resolved):  # a continuation, not a reproduction: its own store and folder
        cfg.reproduce = None
        cfg.tracking.uri = source.tracking_uri
        cfg.run.out_dir = previous["run"]["out_dir"]
    return composed, resolved, changes_between(previous, record.config_dict(resolved))


def resume(command_overrides: list[str], dry_run=False, wait: bool = False, ref: str | None = None) -> None:
    new = [o for o in command_overrides if override_key(o) != "resume"]
    ref = ref or next(o.split("=", 1)[1] for o in command_overrides if override_key(o) == "resume")
    try:
        source = record.open(ref, tracking_uri=lookup_uri(new), out_dir=out_dir(new))
    except record.RecordError as err:
        fail(f"resume: {err}")
    took = False
    if not dry_run:  # before anything is written: a run being trained is another process's (a dry run only reads)
        try:
            took = runlock.hold(source.run_dir, source.run_id)
        except runlock.RunBusy as err:
            fail(f"resume: {err}")
    try:
        _resume(source, new, dry_run, wait)
    except record.RecordError as err:   # a resume's saved config damaged (one line)
        fail(f"resume: {err}")
    finally:
        if took:
            runlock.release(source.run_dir)


def _resume(source, new: list[str], dry_run, wait: bool) -> None:
    earlier = source.info().get("resumes") or []
    carried = last_per_key([o for r in earlier for o in r.get("overrides", []) if override_key(o) not in PER_INVOCATION] + new)
    base = earlier[-1]["resolved"] if earlier and earlier[-1].get("resolved") else record.RESOLVED
    previous = record.load_config_file(source.run_dir / base)
    steps = sorted(int(p.name) for p in checkpoint_dir(source.run_dir).glob("[0-9]*") if p.name.isdigit())
    composed, resolved, changes = _recompose(source, carried, previous)
    if ("schedule.horizon_steps" in changes and steps
            and not any(override_key(o) == "schedule.horizon_from_step" for o in carried)):
        # The failure plan: the lr follows the original decay up to the checkpoint, then decays
        # to the new last step (marin/optim/schedule.py); the mixture's phases follow the horizon.
        carried.append(f"schedule.horizon_from_step={steps[-1]}")
        new.append(carried[-1])
        composed, resolved, changes = _recompose(source, carried, previous)
    if steps and (done := _done(source, resolved, steps[-1])):  # nothing left to train: say so, exit 0
        print(done, file=sys.stderr if dry_run == "json" else sys.stdout, flush=True)
        return
    print(f"resuming run {source.run_id} in {source.run_dir}\n  newest checkpoint: "
          f"{('step ' + str(steps[-1])) if steps else 'none (starts from step 0)'}"
          + (f"\n  changes: {_describe(changes)}" if changes else ""),
          file=sys.stderr if dry_run == "json" else sys.stdout, flush=True)  # json: stdout is the plan
    if steps:
        if resolved.hardware.launcher != "slurm":  # trained here: JAX starts (for the check) as the run needs it
            apply_environment(resolved.hardware)
        _check_structure(source, resolved, changes, new)
    if dry_run:
        print_plan(resolved, as_json=dry_run == "json")
        return

    rec = record.RunRecord(source.run_dir, source.run_id, source.tracking_uri, source.experiment_name)
    slurm = resolved.hardware.launcher == "slurm"
    if slurm:
        if (job := slurm_launch.active_job(rec)) is not None:
            fail(f"resume: run {rec.run_id} is still queued or running as Slurm job {job}; scancel it first")
        if (problem := slurm_launch.memory_problem(resolved) or check_gpu_install(resolved.hardware)) is not None:
            fail(problem)
    elif (problem := launch_refusal(resolved)) is not None:  # a CPU run bigger than this machine
        fail(problem)
    try:
        backend.check_reachable(rec.tracking_uri)
    except backend.TrackingUnavailable as err:
        fail(f"resume: {err}")

    def note(step=None) -> None:  # the step restored (Slurm: the newest checkpoint, restored by the job)
        step = step if step is not None else (steps[-1] if steps else 0)
        _note_resume(rec, earlier, new, changes, composed, resolved, step=step)

    if slurm:
        note()
        job = slurm_launch.submit_record(composed, resolved, rec)
        if wait:
            code = slurm_launch.follow(job)
            if code:
                sys.exit(code)
        return
    from marin.train.components import NonFiniteLoss  # JAX: the trainer stays off the dry-run path
    from marin.train.loop import train  # JAX

    apply_environment(resolved.hardware)
    try:  # the MLflow run was reopened: these end it FAILED (train does that) with one line here
        train(resolved, rec, on_restored=note)
    except NonFiniteLoss as err:
        fail(str(err), code=3)
    except (NoCheckpointError, CheckpointError, StructureMismatch) as err:
        fail(f"resume: {err}", code=1)


def _done(source, resolved, newest: int) -> str | None:
    """One line if the run's newest checkpoint is past the step this resume would stop at (its last
    step, train.stop_after, train.stop_at): it would train nothing and log its final eval under that
    earlier step. At that step exactly, only a run that ended well is done: one that failed after
    its last checkpoint (in the final eval) is resumed, and that eval runs."""
    total = resolved.schedule.horizon_steps or resolved.train.steps
    stop = resolved.train.stop_after
    finished = source.info().get("status") == "FINISHED"

    def past(end) -> bool:
        return end is not None and (newest > end or (finished and newest >= end))

    if past(total) and finished:
        return (f"run {source.run_id} is finished (step {newest} of {total}): nothing to resume; its report: "
                f"{source.run_dir / 'report.html'}. To train on from its weights, start a new run with "
                f"{shell_join([override('train.init_from', source.run_dir)])}")
    if past(total):  # train.steps (or the horizon) lowered below where the run is
        return (f"run {source.run_id} is already at step {newest}, past its last step {total}: nothing to run; give "
                f"train.steps above {newest}, or start a new run from its weights with "
                f"{shell_join([override('train.init_from', source.run_dir)])}")
    if past(stop):
        return (f"run {source.run_id} is already at step {newest} of {total} (train.stop_after={stop}): nothing to "
                f"run; give a later train.stop_after, or none to train to step {total}")
    if past(at := resolved.train.stop_at):
        return (f"run {source.run_id} is already at step {newest} of {total} (train.stop_at={at}, kept by resume=): "
                f"nothing to run; give a later train.stop_at, or train.stop_at=null to train to step {total}")
    return None


def _check_structure(source, resolved, changes: dict, new: list[str]) -> None:
    """Exit 2, before anything is written, if the new config's train state cannot take the
    newest checkpoint (compares jax.eval_shape of the state with orbax's stored metadata)."""
    try:
        check_structure(source.run_dir, abstract_state(resolved))
    except StructureMismatch as err:
        given = {override_key(o) for o in new}
        named = [k for k in changes if k in given] or [
            k for k in changes if not k.startswith(("schedule.", "hardware.", "run.", "tracking.", "train.checkpoint."))]
        fields = ", ".join(f"{k} {changes[k][0]} → {changes[k][1]}" for k in named) or "the config"
        leaves = "; ".join(err.differences[:2]) + (f" (+{len(err.differences) - 2} more)" if len(err.differences) > 2 else "")
        fail(f"resume: {fields} changes the train state ({leaves}), so checkpoint {err.where} cannot be "
             f"restored into it; nothing was changed. Start a new run from this one instead: "
             + shell_join(["python", "launch.py", override("reproduce", source.run_dir), *(o for o in new if override_key(o) not in IGNORED)]))


def _note_resume(rec, earlier: list, overrides: list[str], changes: dict, composed, resolved, step: int = 0) -> None:
    """record.json's resume list; with changes, the new config beside the old and in MLflow."""
    n = len(earlier) + 1
    overrides = [secrets.redact_override(o) for o in overrides]  # written and tagged: no secrets
    changes = {k: ([secrets.REDACTED] * 2 if secrets.looks_secret(k.rsplit(".", 1)[-1]) else secrets.redact(v))
               for k, v in changes.items()}
    entry = {"n": n, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "overrides": overrides, "changes": changes}
    client = backend.client(rec.tracking_uri)
    if changes:
        names = {"composed": f"composed.resume-{n}.yaml", "resolved": f"resolved.resume-{n}.yaml"}
        for which, cfg in (("composed", composed), ("resolved", resolved)):
            path = rec.run_dir / names[which]
            secrets.write_private(path, record.to_yaml(secrets.redact(record.config_dict(cfg))))
            client.log_artifact(rec.run_id, str(path), artifact_path="record")
        entry.update(names)
        client.set_tag(rec.run_id, f"resume_{n}", record._tag_value(_describe(changes)))  # noqa: SLF001
        if "schedule.horizon_steps" in changes or "train.steps" in changes:
            client.set_tag(rec.run_id, "horizon_steps", str(resolved.schedule.horizon_steps or resolved.train.steps))
        if any(k.startswith("model.ep_") or k == "model.capacity_factor" for k in changes):
            m = resolved.model  # a transport switch (spec §6: pooled waves → ragged at step 81,716)
            client.set_tag(rec.run_id, "ep_transport", f"{m.ep_transport} from step {step} (capacity_factor "
                           f"{m.capacity_factor}, send {m.ep_send_capacity_factor}, recv "
                           f"{m.ep_recv_capacity_factor}, waves {m.ep_waves}, chunks {m.ep_expert_chunks})")
        if any(k in MIXTURE_KEYS for k in changes):
            # A mixture swap (spec §8: the step-108,000 weights): every source continues from its
            # read position in the checkpoint; the new weights apply from `step` on.
            d = resolved.data
            client.set_tag(rec.run_id, "data_mixture", record._tag_value(  # noqa: SLF001
                f"{d.name} from step {step} (" + ", ".join(k for k in changes if k in MIXTURE_KEYS)
                + (f"; cells {d.cells_file}" if d.cells_file else "") + "); read positions kept"))
    client.set_tag(rec.run_id, "resumes", str(n))
    # trains again: the last invocation's status no longer holds (the directory's readers show
    # RUNNING, or FAILED should this one be killed: marin.track.runfiles)
    record.update_info(rec, resumes=[*earlier, json.loads(json.dumps(entry, default=str))], status=None, ended=None)
