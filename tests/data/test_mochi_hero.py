"""The hero's mixture structure: 200 cells, two phases, boundary at 80%, the epoch cap."""
from __future__ import annotations

import csv
import math

import pytest

from marin.config.validate import ConfigError
from marin.data import mixture
from tests.helpers import make_config

HERO = ("data=mochi_hero", "dry_run=true")


def test_placeholder_cells_file_has_the_right_shape():
    cfg = make_config(*HERO)
    path = mixture.config_path(cfg.data.cells_file)
    assert "placeholder" in path.name and "PLACEHOLDER" in path.read_text().splitlines()[0]
    cells = mixture.sources(cfg)
    assert len(cells) == 200 and len({c.name for c in cells}) == 200
    for phase in range(2):
        assert math.isclose(sum(c.weights[phase] for c in cells), 1.0, abs_tol=1e-9)
    assert sum(c.tokens for c in cells) == pytest.approx(23.106e12, rel=1e-6)


def test_dry_run_reports_epochs_per_cell():
    cfg = make_config(*HERO)
    assert mixture.boundary_steps(cfg) == [round(0.8 * cfg.train.steps)]
    epochs = mixture.epochs_per_source(cfg)
    assert len(epochs) == 200 and all(len(e) == 2 for e in epochs.values())
    pretrain, midtrain = mixture.phase_tokens(cfg)
    assert pretrain == 4 * midtrain
    cell = mixture.sources(cfg)[0]
    assert epochs[cell.name][1] == pytest.approx(cell.weights[1] * midtrain / cell.tokens)


def test_a_cell_over_the_cap_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        make_config(*HERO, "train.steps=100000000", "train.global_batch=4096", "train.seq_len=4096")
    (name, msg), = err.value.problems
    assert name == "data.cells_file" and "would repeat more than data.max_epochs=8 epochs" in msg


def test_cells_file_problems(tmp_path):
    path = tmp_path / "cells.csv"
    with open(mixture.config_path("conf/data/mochi_hero_cells.placeholder.csv")) as f:
        rows = [r for r in csv.reader(line for line in f if not line.startswith("#"))]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows[:-1])  # a cell missing
    with pytest.raises(ConfigError) as err:
        make_config(*HERO, f"data.cells_file={path}")
    messages = [m for n, m in err.value.problems if n == "data.cells_file"]
    assert messages[0] == "must list every cell: expected 200, found 199"
    with pytest.raises(ConfigError, match="no cells file at"):
        make_config(*HERO, f"data.cells_file={tmp_path}/nope.csv")


def test_weights_of_cells_must_sum_to_one(tmp_path):
    path = tmp_path / "cells.csv"
    text = mixture.config_path("conf/data/mochi_hero_cells.placeholder.csv").read_text()
    path.write_text(text.replace("t00_q1,topic00,1,358328512381,0.008567971687",
                                 "t00_q1,topic00,1,358328512381,0.108567971687"))
    with pytest.raises(ConfigError, match=r"data.cells_file: phase 0 \(pretrain\) weights sum to 1.1, not 1"):
        make_config(*HERO, f"data.cells_file={path}")


def test_training_needs_the_cells_files():
    with pytest.raises(ConfigError) as err:
        make_config("data=mochi_hero")
    (name, msg), = err.value.problems
    assert name == "data.cells_paths" and msg.startswith("200 of 200 cells cannot be read")
