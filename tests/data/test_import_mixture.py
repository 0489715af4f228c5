"""`python -m marin.data.import_mixture`: Marin's published mixture JSON → the cells table, exactly."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest

from marin.config.paths import PROJECT_ROOT
from marin.data import import_mixture

PUBLISHED = PROJECT_ROOT / "conf" / "data" / "published"
LAUNCH = PUBLISHED / "harrier_mix_2026_08_18.json"
STEP_108K = PUBLISHED / "best_mixture_996f489106c7b922.json"


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(line for line in f if not line.startswith("#")))


def test_the_launch_mixture_converts_exactly(tmp_path):
    out = tmp_path / "cells.csv"
    assert import_mixture.main([str(LAUNCH), "-o", str(out)]) == 0
    rows = {r["name"]: r for r in read_csv(out)}
    assert len(rows) == 200 and list(rows)[0] == "c00q0" and list(rows)[-1] == "c39q4"
    # values quoted from the published file (marin-community/marin, experiments/grug/moe_hero_ep/)
    assert rows["c00q0"]["tokens"] == "9126994294"
    assert float(rows["c00q0"]["weight_pretrain"]) == 0.0002759551045798378
    assert float(rows["c00q0"]["weight_midtrain"]) == 0.00012078691263627796
    assert rows["c22q0"]["tokens"] == "3385150"
    assert float(rows["c22q0"]["weight_pretrain"]) == 9.587165281576292e-09
    assert rows["c30q4"] == {"name": "c30q4", "topic": "c30", "quality": "4", "tokens": "675660118643",
                             "weight_pretrain": "0.04759503480043832", "weight_midtrain": "0.02865497188099325"}
    published = json.loads(LAUNCH.read_text())
    for name, row in rows.items():  # every cell, every value: the same doubles
        assert int(row["tokens"]) == published["available_tokens"][name]
        assert float(row["weight_pretrain"]) == published["phase0_weights"][name]
        assert float(row["weight_midtrain"]) == published["phase1_weights"][name]


def test_the_shipped_tables_are_the_converters_output(tmp_path):
    conf = PROJECT_ROOT / "conf" / "data"
    assert (conf / "mochi_hero_cells.csv").read_text() == import_mixture.to_csv(
        import_mixture.rows(LAUNCH), LAUNCH)
    assert (conf / "mochi_hero_108k_cells.csv").read_text() == import_mixture.to_csv(
        import_mixture.rows(STEP_108K, LAUNCH), STEP_108K, LAUNCH)


def test_the_step_108k_mixture_takes_its_tokens_from_the_launch_file():
    rows = {r["name"]: r for r in import_mixture.rows(STEP_108K, available_from=LAUNCH)}
    assert len(rows) == 200
    assert rows["c28q4"]["weight_pretrain"] == 0.054178873697916664
    assert rows["c30q4"]["weight_midtrain"] == 0.09116617838541667
    assert rows["c28q4"]["tokens"] == 258064765630


def test_cli_refuses_a_mixture_without_available_tokens(tmp_path):
    result = subprocess.run([sys.executable, "-m", "marin.data.import_mixture", str(STEP_108K)],
                            capture_output=True, text=True, cwd=PROJECT_ROOT)
    assert result.returncode == 2 and result.stdout == ""
    line, = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "has no 'available_tokens': give --available-from the launch mixture" in line


@pytest.mark.parametrize("text, expected", [
    ("not json", "cannot read the mixture"),
    ('{"phase0_weights": {"c00q0": 1.0}}', "has no 'phase1_weights' table"),
    ('{"phase0_weights": {"c00q0": 1.0}, "phase1_weights": {"c00q1": 1.0}, "available_tokens": {"c00q0": 5}}',
     "name different cells"),
    ('{"phase0_weights": {"c00q0": "x"}, "phase1_weights": {"c00q0": 1.0}, "available_tokens": {"c00q0": 5}}',
     "phase0_weights must hold finite numbers"),
    # issue 42's probe: these were tracebacks, or an infinite weight written to the table
    ("[" * 100_000 + "]" * 100_000, "cannot read the mixture"),
    ('{"phase0_weights": {"c00q0": ' + "1" * 5000 + "}}", "cannot read the mixture"),
    ('{"phase0_weights": {"c00q0": 1e999}, "phase1_weights": {"c00q0": 1.0}, "available_tokens": {"c00q0": 5}}',
     "phase0_weights must hold finite numbers"),
    ('{"phase0_weights": {"c00q0": 1.0}, "phase1_weights": {"c00q0": 1.0}, "available_tokens": {"c00q0": 1e40}}',
     "available_tokens must hold whole numbers"),
    ('{"phase0_weights": {"c00q0": 1.0}, "phase1_weights": {"c00q0": 1.0}, "available_tokens": {"c00q0": '
     + str(2**70) + "}}", "available_tokens must hold whole numbers"),
])
def test_bad_published_files_are_one_line(tmp_path, capsys, text, expected):
    path = tmp_path / "mix.json"
    path.write_text(text)
    assert import_mixture.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and expected in err
