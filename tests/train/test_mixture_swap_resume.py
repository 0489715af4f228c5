"""Issue 18 item 5 end to end: a tiny run on mixture A for 10 steps, `resume=` on mixture B (other
weights over the same sources). Each source continues from its read position in the checkpoint,
B's weights apply from step 10, and the switch is an MLflow tag with its step. A fork at step 10
onto B (the hero's step-108,000 cutover, README) continues from the same positions."""
from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import new_store, signals_kept

TINY = ["model=micro", "train.steps=20", "train.seq_len=32", "train.global_batch=4", "train.eval_every=0",
        "train.eval_batches=1", "train.checkpoint.every_steps=5", "train.checkpoint.keep_last=10"]
B_MIX = ["data.sources.0.weights=[0.75]", "data.sources.1.weights=[0.25]"]  # A: 0.5 / 0.5 (data=builtin)


def _saved_meta(run_dir, step: int) -> dict:
    import orbax.checkpoint as ocp

    from marin.train.checkpoint import Checkpointer, checkpoint_dir  # noqa: F401

    manager = ocp.CheckpointManager(checkpoint_dir(run_dir), item_handlers={"meta": ocp.JsonCheckpointHandler()})
    return dict(manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta)


@pytest.mark.slow
def test_resume_on_another_mixture_keeps_every_read_position(tmp_path):
    from mlflow import MlflowClient

    from marin.data.loader import Loader
    from marin.launch.checks import load
    from marin.launch.resume import resume
    from marin.track import record
    from marin.train.loop import train
    from tests.helpers import compose_dict

    overrides = [*TINY, "train.stop_after=10", f"run.out_dir={tmp_path}", f"tracking.uri={new_store(tmp_path)}"]
    composed, on_a = load(compose_dict(*overrides))
    rec = record.create(composed, on_a, overrides)
    with signals_kept():
        train(on_a, rec)
        resume([f"resume={rec.run_dir}", *B_MIX])
        from omegaconf import OmegaConf

        from marin.launch.fork import fork

        spec = f"{rec.run_dir}@10"
        forked = fork(OmegaConf.create({"fork": spec}), [f"fork={spec}", *B_MIX])

    at_swap, at_end = _saved_meta(rec.run_dir, 10), _saved_meta(rec.run_dir, 20)
    tags = MlflowClient(rec.tracking_uri).get_run(rec.run_id).data.tags
    assert "from step 10" in tags["data_mixture"] and "data.sources" in tags["data_mixture"]

    on_b = load(compose_dict(*overrides[:-3], *B_MIX, f"run.out_dir={tmp_path}"))[1]
    a_loader, b_loader = Loader(on_a, progress=False), Loader(on_b, progress=False)
    b_loader.resume(10, at_swap)
    assert at_swap["data"] == a_loader.position(10)
    assert at_end["data"] == b_loader.position(20)  # what the resumed run saved: positions continued
    assert _saved_meta(forked.run_dir, 20)["data"] == at_end["data"]  # the fork onto B: the same reads
    names = b_loader.source_names
    rows = {n: at_end["data"]["rows"][f"{n}/pretrain"] - at_swap["data"]["rows"][f"{n}/pretrain"] for n in names}
    assert rows == pytest.approx({names[0]: 30, names[1]: 10}, abs=1)  # B's weights over 10 steps × 4 rows
    # No chunk of any source read twice: steps 0–9 on A, then 10–19 from the saved positions on B.
    seen = {s: np.zeros(int(n), np.int64) for s, n in enumerate(b_loader._num_tokens)}
    for loader, steps in ((a_loader, range(10)), (b_loader, range(10, 20))):
        for step in steps:
            _, src, start = loader.rows(step)
            for s, st in zip(src, start):
                np.add.at(seen[s], (st + np.arange(32)) % len(seen[s]), 1)
    assert all(c.max() == 1 for c in seen.values())
