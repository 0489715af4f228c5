"""The training loop end to end on a tiny model: the loss falls, MLflow holds the run, a
non-finite loss stops the run with a clear error."""
import math

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers import compose_dict
from marin.config.validate import load

TINY = ["model=tiny", "train.seq_len=64", "train.global_batch=8", "train.eval_every=10",
        "train.eval_batches=1", "optim.lr=1e-2"]


def start(tmp_path, *overrides):
    from marin.track import record

    composed, cfg = load(compose_dict(*TINY, f"run.out_dir={tmp_path}",
                                      f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", *overrides))
    return cfg, record.create(composed, cfg, list(overrides))


def test_loss_falls_and_run_is_tracked(tmp_path):
    """Through the tracking companion, as launch.py runs it: MLflow is made and logged in another
    process, nothing lost; run.log keeps the progress bar's eval lines and its last state."""
    from marin.track.companion import Companion
    from marin.track.tracker import create_in
    from marin.train.loop import train

    composed, cfg = load(compose_dict(*TINY, f"run.out_dir={tmp_path}", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db",
                                      "train.steps=40"))
    companion = Companion.start()
    try:
        pending = create_in(companion, composed, cfg, ["train.steps=40"])
        summary = train(cfg, pending)
    finally:
        companion.close()
    rec = pending.ready()
    log = (rec.run_dir / "run.log").read_text()
    assert "step 10: " in log and "macro_loss" in log and "40/40" in log, log
    client = MlflowClient(rec.tracking_uri)
    losses = [m.value for m in sorted(client.get_metric_history(rec.run_id, "train/loss"), key=lambda m: m.step)]
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)
    run = client.get_run(rec.run_id)
    assert run.info.status == "FINISHED"
    per_layer = [f"train/{m}/layer_{i}" for m in ("dropped_frac", "load_spread") for i in range(cfg.model.num_layers)]
    for name in ("train/lr", "train/grad_norm", "train/tokens_per_s", "train/dropped_frac", "eval/macro_loss", *per_layer):
        assert name in run.data.metrics, name
    assert any(k.startswith("eval/") and k.endswith("/loss") and k != "eval/macro_loss" for k in run.data.metrics)
    assert run.data.params["model.d_model"] == str(cfg.model.d_model)
    assert math.isfinite(summary["loss"])


def test_non_finite_loss_stops_with_a_clear_error(tmp_path):
    from marin.train.loop import NonFiniteLoss, train

    cfg, rec = start(tmp_path, "train.steps=5", "model.init_std=1e30")
    with pytest.raises(NonFiniteLoss, match="non-finite loss"):
        train(cfg, rec)
    assert MlflowClient(rec.tracking_uri).get_run(rec.run_id).info.status == "FAILED"


@pytest.mark.slow
def test_context_extension_stage_starts_from_another_runs_checkpoint(tmp_path):
    """A stage (train.init_from) continues the earlier run's state at a longer sequence, with
    qk_mult rescaled by the spec's rule."""
    from marin.train.loop import train

    short = ["train.steps=8", "train.stop_after=4", "train.seq_len=32", "train.eval_every=0"]
    cfg, first = start(tmp_path, *short)
    train(cfg, first)
    cfg, stage = start(tmp_path, "train.steps=8", "train.seq_len=64", "train.eval_every=0", "attention.qk_mult=auto",
                       f"train.init_from={first.run_dir}", "train.init_seq_len=32")
    assert cfg.attention.qk_mult == pytest.approx(1.3 * (1 + 0.1 * math.log(2)))
    train(cfg, stage)
    steps = [m.step for m in MlflowClient(stage.tracking_uri).get_metric_history(stage.run_id, "train/loss")]
    assert sorted(steps) == [5, 6, 7, 8]  # the stage picks up where the first run stopped (4 steps taken)
