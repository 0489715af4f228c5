"""Values past MLflow's limits (params 6,000 characters, tags 8,000) are logged cut short with a
note saying how long they were and where they are whole. MLflow 3's client would cut them itself,
silently but for a warning per call, and refuse them (the whole batch, its metrics too, on every
retry) with MLFLOW_TRUNCATE_LONG_VALUES=false or against an MLflow 2 server."""
import json
import logging

from mlflow import MlflowClient
from mlflow.utils.validation import MAX_TAG_VAL_LENGTH

from marin.track import record, report, tracker


def test_a_tag_past_the_limit_is_shortened_and_the_metrics_with_it_are_sent(configure, store, caplog):
    rec = record.create(*configure("run.name=big-tag"))
    t = tracker.Tracker(rec, report=False)
    with caplog.at_level(logging.WARNING, logger="marin.track"):
        t.set_tags({"fork_changes": "data.root: " + "y" * 20_000})
        t.log_metrics({"train/loss": 2.5}, step=1)
        assert t.flush(timeout=60)
        t.finish()
    assert not [r for r in caplog.records if "does not answer" in r.getMessage()]
    run = MlflowClient(store["uri"]).get_run(rec.run_id)
    assert run.data.metrics["train/loss"] == 2.5
    tag = run.data.tags["fork_changes"]
    assert len(tag) == MAX_TAG_VAL_LENGTH and tag.endswith("(truncated: 20,011 characters, whole in record/record.json)")


def test_a_report_reads_an_overrides_tag_cut_short_by_an_older_version():
    cut = json.dumps(["model=micro", "run.sweep_id=" + "x" * 9000])[:7980] + " …(truncated)"
    assert report._json_list(cut) == [cut]
    assert report._json_list('["a=1", "b=2"]') == ["a=1", "b=2"]
    assert report._json_list(None) == []
