"""Every file marin writes that can hold a secret masking missed is its owner's alone (mode 0600,
whatever the umask): record.json, the saved configs and git.diff (tests/track/test_record.py),
and these: a text artifact kept while the store was away, run.log, a sweep's jobs.jsonl."""
import os
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from marin.track import record, sweep, tracker
from marin.track.record import RunRecord


@pytest.fixture
def loose_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_text_artifact_kept_for_later_and_run_log_are_private(configure, loose_umask):
    real = record.create(*configure("run.name=private-unsent"))
    away = RunRecord(real.run_dir, real.run_id, "http://127.0.0.1:9", real.experiment_name)
    t = tracker.Tracker(away, flush_every_s=0.0, report=False)
    t.log_text("plan/summary.txt", "the plan, with HF_TOKEN=hf_abc in a pasted command")
    t.finish("FINISHED")
    kept = real.run_dir / "unsent_artifacts" / "plan" / "summary.txt"
    assert kept.read_text().startswith("the plan")
    assert mode(kept) == 0o600
    assert mode(real.run_dir / record.LOG) == 0o600


def test_a_sweeps_jobs_file_is_private_even_one_made_before(tmp_path, loose_umask):
    folder = tmp_path / "sweep"
    folder.mkdir()
    tags = {"sweep_dir": str(folder), "sweep_overrides": '["optim.lr=0.001"]'}
    sweep.note_child(SimpleNamespace(run_id="r1", run_dir=tmp_path / "r1"), tags)
    jobs = folder / "jobs.jsonl"
    assert mode(jobs) == 0o600
    jobs.chmod(0o644)                   # written by an earlier version
    sweep.note_child(SimpleNamespace(run_id="r2", run_dir=tmp_path / "r2"), tags)
    assert mode(jobs) == 0o600
    assert len(jobs.read_text().splitlines()) == 2


def test_an_ab_arms_option_files_are_private(tmp_path):
    from marin import ab

    ab.write_arms(tmp_path, {"optim.lr": 0.005, "hardware.env.HF_TOKEN": "arm-secret"})
    for arm in ("control", "candidate"):
        assert stat.S_IMODE((tmp_path / "ab" / f"{arm}.yaml").stat().st_mode) == 0o600
