"""A run trained on data prepared as many shards by a process pool equals, bit for bit, one
trained on the same data prepared in one process into one shard per file group (the built-in text's
groups: `marin.data.builtin.ranges`; 230,000 tokens: the largest built-in document fits)."""
import pytest
from mlflow.tracking import MlflowClient

from marin.launch.checks import load
from tests.helpers import compose_dict, new_store

TINY = ["model=micro", "train.seq_len=64", "train.global_batch=8", "train.steps=4", "train.eval_every=0",
        "train.eval_batches=1", "optim.lr=1e-2"]


def losses(tmp_path, name, *overrides, pool: bool):
    from marin.data import prepare
    from marin.track import record
    from marin.train.loop import train

    out = tmp_path / name
    composed, cfg = load(compose_dict(*TINY, f"run.out_dir={out}", f"tracking.uri={new_store(out)}", *overrides))
    if pool:
        plan = prepare.plan(cfg)
        assert len(plan.tasks) == 2
        prepare.run_pool(plan, progress=False)
    rec = record.create(composed, cfg, list(overrides))
    train(cfg, rec)
    shards = {s.name: len(s.shard_ids) for s in prepare.prepare(cfg, progress=False)[0] if s}
    history = MlflowClient(rec.tracking_uri).get_metric_history(rec.run_id, "train/loss")
    return [m.value for m in sorted(history, key=lambda m: m.step)], shards


@pytest.mark.slow
def test_training_on_sharded_data_equals_training_on_one_shard_per_source(tmp_path):
    one, one_shards = losses(tmp_path, "one", pool=False)
    many, many_shards = losses(tmp_path, "many", "data.shard_tokens=230000", "data.prepare_tasks=2", pool=True)
    assert all(many_shards[n] > one_shards[n] for n in one_shards), (one_shards, many_shards)
    assert len(one) == 4 and one == many
