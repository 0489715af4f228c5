"""One tiny trained run shared by the tests that read a finished run (the report, generation):
trained once per test session (4 steps, a checkpoint at the end), in its own MLflow store."""
from __future__ import annotations

from tests.helpers import compose_dict

TINY_RUN = ["model=tiny", "train.seq_len=32", "train.global_batch=4", "train.steps=4", "train.eval_every=0",
            "train.eval_batches=1", "optim.lr=1e-2"]
_made: dict = {}


def overrides_for(root) -> list[str]:
    return [*TINY_RUN, f"run.out_dir={root}", f"tracking.uri=sqlite:///{root}/mlflow.db"]


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
