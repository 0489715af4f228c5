"""A run directory whose saved configs or record.json are damaged (a write cut short, a hand edit) is
refused when the run is opened, in one line naming the file and what is wrong, by every tool that
opens runs (issue 42's probe: lineage, resume and fork printed tracebacks)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from marin.config.paths import PROJECT_ROOT
from marin.track import record
from tests.helpers import fake_run_dir


def damaged_run(tmp_path, name: str, text: str) -> Path:
    fake_run_dir(tmp_path, "train: {steps: 4}\nrun: {name: probe}\n")
    [run_dir] = (tmp_path / "runs").iterdir()
    if name == "record.json" and text.startswith("+"):   # a field of a wrong type added to a sound record
        info = json.loads((run_dir / name).read_text())
        info.update(json.loads(text[1:]))
        text = json.dumps(info)
    (run_dir / name).write_text(text)
    return run_dir


@pytest.mark.parametrize("name, text, expected", [
    ("resolved.yaml", "train: [unclosed\n  : :\n", "resolved.yaml is damaged"),
    ("composed.yaml", "- a list\n- not a config\n", "composed.yaml is damaged"),
    ("resolved.yaml", "[" * 5000, "resolved.yaml is damaged"),
    ("record.json", '+{"run_id": 5}', "run_id"),
    ("record.json", '+{"resumes": "yesterday"}', "resumes"),
    ("record.json", '+{"slurm_jobs": {"a": 1}}', "slurm_jobs"),
    ("record.json", '+{"restarts": "many"}', "restarts"),
])
def test_a_damaged_run_file_is_one_error_naming_it(tmp_path, name, text, expected):
    run_dir = damaged_run(tmp_path, name, text)
    with pytest.raises(record.RecordError) as err:
        record.open(run_dir)
    assert expected in str(err.value) and str(run_dir / name) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_sound_run_opens(tmp_path):
    fake_run_dir(tmp_path, "train: {steps: 4}\nrun: {name: probe}\n")
    [run_dir] = (tmp_path / "runs").iterdir()
    assert record.open(run_dir).resolved().train.steps == 4


def test_lineage_of_a_run_with_a_damaged_config_is_one_line(tmp_path):
    run_dir = damaged_run(tmp_path, "resolved.yaml", "train: [unclosed\n  : :\n")
    result = subprocess.run([sys.executable, "-m", "marin.lineage", str(run_dir)], capture_output=True,
                            text=True, cwd=PROJECT_ROOT)
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: lineage:") and "resolved.yaml is damaged" in line


def test_the_list_shows_a_run_whose_record_has_a_wrong_typed_field(tmp_path):
    """`marin.status` with no argument lists every run: one damaged record.json leaves out its bad
    fields there (opening that run names them) instead of failing the whole list."""
    from marin.track import runfiles

    run_dir = damaged_run(tmp_path, "record.json", '+{"resumes": 5, "restarts": "many", "status": "FINISHED"}')
    row = runfiles.read(run_dir)
    assert row.state == "FINISHED" and row.total == 4 and "resumes" not in row.info


def test_the_list_shows_a_run_whose_files_nest_too_deeply(tmp_path):
    """A deeply nested resolved.yaml, record.json or metrics.jsonl line (Python's recursion limit in
    the parsers) leaves that value out of the list, not a RecursionError for the whole list."""
    from marin.track import runfiles

    run_dir = damaged_run(tmp_path, "resolved.yaml", "[" * 5000)
    (run_dir / "metrics.jsonl").write_text('{"key": "train/loss", "step": 1, "value": 6.5}\n' + "[" * 100_000 + "\n")
    row = runfiles.read(run_dir)
    assert row.total is None and row.step == 1
    (run_dir / "record.json").write_text("[" * 100_000)
    assert runfiles.read(run_dir).run_id == "?"
