"""One tiny trained run shared by the tests that read a finished run (the report, generation):
trained once per test session (4 steps, a checkpoint at the end), in its own MLflow store."""
from __future__ import annotations

from tests.helpers import compose_dict, new_store, signals_kept

TINY_RUN = ["model=micro", "train.seq_len=32", "train.global_batch=4", "train.steps=4", "train.eval_every=0",
            "train.eval_batches=1", "optim.lr=1e-2"]
_made: dict = {}


def overrides_for(root) -> list[str]:
    # its report is read (tests/track/test_report.py): drawn at its end, as a user's run is (the
    # suite's site leaves it out, tests/site/local/site.yaml)
    return [*TINY_RUN, "tracking.report=true", f"run.out_dir={root}", f"tracking.uri={new_store(root)}"]


def tiny_run(tmp_path_factory):
    """(record, resolved config) of the shared run; trains it on first use."""
    if "run" not in _made:
        from marin.launch.checks import load
        from marin.track import record
        from marin.train.loop import train

        root = tmp_path_factory.mktemp("tiny_run")
        overrides = overrides_for(root)
        composed, cfg = load(compose_dict(*overrides))
        rec = record.create(composed, cfg, overrides)
        train(cfg, rec)
        _made["run"] = (rec, cfg)
    return _made["run"]


def untrained_run(tmp_path_factory):
    """A run record with no checkpoint (made, never trained), beside the shared run (same store:
    making a new MLflow store's tables takes seconds)."""
    from marin.launch.checks import load
    from marin.track import record

    overrides = overrides_for(tiny_run(tmp_path_factory)[0].run_dir.parent.parent)
    composed, cfg = load(compose_dict(*overrides))
    return record.create(composed, cfg, overrides)


FORKABLE = ["model=micro", "train.seq_len=32", "train.global_batch=4", "train.steps=6", "train.eval_every=0",
            "train.eval_batches=1", "train.checkpoint.every_steps=3"]


def forkable_run(tmp_path_factory):
    """A tiny run trained in-process to step 6 with checkpoints at 3 and 6 (in its own sqlite store),
    shared read-only by the fork, lineage and A/B tests: a fork at 3 must repeat its steps 4…6."""
    if "forkable" not in _made:
        from marin.launch.checks import load
        from marin.track import record
        from marin.train.loop import train

        root = tmp_path_factory.mktemp("forkable")
        overrides = [*FORKABLE, f"run.out_dir={root}", f"tracking.uri={new_store(root)}"]
        composed, cfg = load(compose_dict(*overrides))
        rec = record.create(composed, cfg, overrides)
        with signals_kept():
            train(cfg, rec)
        _detach_run_logs()  # as if it had run in its own process: later lines are not its run.log's
        _made["forkable"] = rec
    return _made["forkable"]


def fork_of(tmp_path_factory, *overrides: str):
    """The record of a fork of `forkable_run` at step 3 with `overrides`, made in-process once per
    distinct overrides (marin.launch.fork, as `launch.py fork=<run>@3 …` runs it)."""
    key = ("fork", overrides)
    if key not in _made:
        from omegaconf import OmegaConf

        from marin.launch.fork import fork

        parent = forkable_run(tmp_path_factory)
        spec = f"{parent.run_dir}@3"
        with signals_kept():
            _made[key] = fork(OmegaConf.create({"fork": spec, "dry_run": False}), [f"fork={spec}", *overrides])
        _detach_run_logs()
    return _made[key]


# What `marin.ab` prints of its two arms side by side (tests/track/test_ab.py, and its Slurm run in
# tests/launch/test_fork.py).
AB_TABLE = ("loss (mean)", "eval loss (last)", "dropped fraction (mean)", "tokens/s (steady)", "MFU (steady)",
            "peak memory GiB (max)")


def ab_sweeps(parent) -> set:
    """The A/B sweeps made so far from the shared parent (every A/B test of this worker adds its own)."""
    return set((parent.run_dir.parent.parent / "sweeps").glob("ab-*"))


def arms(sweeps) -> list[str]:
    """The `+ab=` overrides of every job of these sweeps, sorted."""
    import json

    jobs = [json.loads(line) for s in sweeps for line in (s / "jobs.jsonl").read_text().splitlines()]
    return sorted(o for j in jobs for o in j["overrides"] if o.startswith("+ab="))


def _detach_run_logs() -> None:
    import logging

    from marin.track import record

    for handler in [h for h in logging.getLogger().handlers if getattr(h, "marin_run_log", False)]:
        record.detach_log(handler)
