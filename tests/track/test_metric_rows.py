"""A metrics.jsonl line that is not a metric row (hand-edited, damaged, another tool's) is left out
by every reader with one warning naming the file, not a traceback (issue 42's probe: lineage and
verify failed on one); a line cut short by a crash (the last) is left out silently as before."""
import json
import logging

from marin.launch.verify import read_jsonl
from marin.track.tracker import METRICS, read_metrics

GOOD = [{"key": "train/loss", "value": 6.5, "step": 1, "timestamp": 1},
        {"key": "train/loss", "value": 6.25, "step": 2, "timestamp": 2}]
BAD = ['{"key": "train/loss", "step": "x", "value": 1}', "[1, 2]", '{"step": 2}', "null",
       '{"key": "train/loss", "step": 3, "value": "high"}', '{"key": 7, "step": 3, "value": 1.0}']


def write(run_dir, lines):
    (run_dir / METRICS).write_text("\n".join(lines) + "\n")


def test_rows_that_are_not_metrics_are_left_out_with_one_warning(tmp_path, caplog):
    write(tmp_path, [json.dumps(GOOD[0]), *BAD, json.dumps(GOOD[1])])
    with caplog.at_level(logging.WARNING):
        assert read_metrics(tmp_path) == GOOD
        assert read_jsonl(tmp_path / METRICS) == {("train/loss", 1): 6.5, ("train/loss", 2): 6.25}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and all(str(tmp_path / METRICS) in w and f"{len(BAD)} line" in w
                                      and "line 2" in w for w in warnings), warnings


def test_a_last_line_cut_short_is_left_out_silently(tmp_path, caplog):
    write(tmp_path, [json.dumps(GOOD[0]), json.dumps(GOOD[1])[:20]])
    with caplog.at_level(logging.WARNING):
        assert read_metrics(tmp_path) == GOOD[:1]
        assert read_jsonl(tmp_path / METRICS) == {("train/loss", 1): 6.5}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_resume_forgets_the_rows_past_its_checkpoint(tmp_path):
    """kill -9 after step 5, newest checkpoint 3: the resumed run logs steps 4 and 5 again, so the
    rows the killed run wrote past 3 go (issue 42's probe: two rows at each such step). The file of
    rows not yet sent to MLflow (the catch-up's) loses them too."""
    from marin.track.tracker import UNSENT, forget_after

    rows = [{"key": k, "value": float(s), "step": s, "timestamp": s} for s in range(1, 6)
            for k in ("train/loss", "eval/loss")]
    write(tmp_path, [json.dumps(r) for r in rows] + ['{"key": "train/loss", "val'])   # a line cut by the kill
    (tmp_path / UNSENT).write_text("".join(json.dumps(r) + "\n" for r in rows[6:]))
    assert forget_after(tmp_path, 3) == 4
    assert read_metrics(tmp_path) == [r for r in rows if r["step"] <= 3]
    assert (tmp_path / UNSENT).read_text() == ""
    assert forget_after(tmp_path, 3) == 0
