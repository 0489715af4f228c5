"""The hero's mixtures (spec §5, §8): Marin's published launch mixture (`data=mochi_hero`) and the
step-108,000 one (`data=mochi_hero_108k`): 200 cells, two phases, boundary at 80%, the epoch cap."""
from __future__ import annotations

import csv
import math

import pytest

from marin.config.validate import ConfigError
from marin.data import mixture
from tests.helpers import make_config

HERO = ("data=mochi_hero", "dry_run=true")
OPTIONS = ("mochi_hero", "mochi_hero_108k")


@pytest.mark.parametrize("option", OPTIONS)
def test_both_published_mixtures_compose_and_validate(option):
    cfg = make_config(f"data={option}", "dry_run=true")
    assert cfg.data.name == option
    cells = mixture.sources(cfg)
    assert len(cells) == 200 and len({c.name for c in cells}) == 200
    assert {c.name for c in cells} == {f"c{t:02d}q{q}" for t in range(40) for q in range(5)}
    for phase in range(2):  # each phase a simplex over all cells, as published (not normalised here)
        assert math.isclose(math.fsum(c.weights[phase] for c in cells), 1.0, abs_tol=mixture.WEIGHT_TOLERANCE)
        assert all(c.weights[phase] >= 0 for c in cells)
    assert sum(c.tokens for c in cells) == 23_106_103_007_622  # spec §5: 23.106T after dedup/decontamination


def test_the_108k_mixture_keeps_the_launch_cells_and_changes_the_weights():
    launch = {c.name: c for c in mixture.sources(make_config(*HERO))}
    later = {c.name: c for c in mixture.sources(make_config("data=mochi_hero_108k", "dry_run=true"))}
    assert launch.keys() == later.keys()
    assert all(later[n].tokens == launch[n].tokens for n in launch)  # available tokens: the launch file's
    assert later["c30q4"].weights == (0.04901123046875, 0.09116617838541667)
    assert launch["c30q4"].weights == (0.04759503480043832, 0.02865497188099325)
    assert later["c22q0"].weights == (0.0, 0.0)  # a zero weight is allowed, a negative one is not


def test_dry_run_reports_epochs_per_cell():
    cfg = make_config(*HERO)
    assert mixture.boundary_steps(cfg) == [round(0.8 * cfg.train.steps)]
    epochs = mixture.epochs_per_source(cfg)
    assert len(epochs) == 200 and all(len(e) == 2 for e in epochs.values())
    pretrain, midtrain = mixture.phase_tokens(cfg)
    assert pretrain == 4 * midtrain
    cell = mixture.sources(cfg)[0]
    assert epochs[cell.name][1] == pytest.approx(cell.weights[1] * midtrain / cell.tokens)


def test_the_hero_plan_shows_real_epochs_without_the_documents():
    """The hero's schedule (390,251 steps × 46,137,344 tokens): its most repeated cell is c12q4,
    1.670 epochs in pretraining; every cell is under the 8-epoch cap. No document is needed."""
    cfg = make_config("experiment=mochi_535b_a23b", "dry_run=true")
    epochs = mixture.epochs_per_source(cfg)
    top = max(epochs, key=lambda n: epochs[n][0])
    assert top == "c12q4" and epochs[top][0] == pytest.approx(1.670, abs=5e-4)
    assert max(sum(e) for e in epochs.values()) < cfg.data.max_epochs


def test_a_cell_over_the_cap_is_refused():
    with pytest.raises(ConfigError) as err:
        make_config(*HERO, "train.steps=100000000", "train.global_batch=4096", "train.seq_len=4096")
    (name, msg), = err.value.problems
    assert name == "data.cells_file" and "would repeat more than data.max_epochs=8 epochs" in msg


def _rows():
    with open(mixture.config_path("conf/data/mochi_hero_cells.csv")) as f:
        return [r for r in csv.reader(line for line in f if not line.startswith("#"))]


def test_cells_file_problems(tmp_path):
    path = tmp_path / "cells.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(_rows()[:-1])  # a cell missing
    with pytest.raises(ConfigError) as err:
        make_config(*HERO, f"data.cells_file={path}")
    messages = [m for n, m in err.value.problems if n == "data.cells_file"]
    assert messages[0] == "must list every cell: expected 200, found 199"
    with pytest.raises(ConfigError, match="no cells file at"):
        make_config(*HERO, f"data.cells_file={tmp_path}/nope.csv")


def test_weights_of_cells_must_sum_to_one(tmp_path):
    rows = _rows()
    assert rows[1][:5] == ["c00q0", "c00", "0", "9126994294", "0.0002759551045798378"]
    rows[1][4] = repr(float(rows[1][4]) + 0.1)
    path = tmp_path / "cells.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    with pytest.raises(ConfigError, match=r"data.cells_file: phase 0 \(pretrain\) weights sum to 1.1, not 1"):
        make_config(*HERO, f"data.cells_file={path}")


def test_training_needs_the_cells_files_and_the_site_tokenizer():
    with pytest.raises(ConfigError) as err:
        make_config("data=mochi_hero")
    problems = dict(err.value.problems)
    assert problems["data.cells_paths"].startswith("200 of 200 cells cannot be read")
    assert problems["data.tokenizer"].startswith("no tokenizer file at")
    assert problems["data.tokenizer"].endswith("marin-tokenizer/tokenizer.json")


def test_nothing_says_the_published_weights_are_private():
    from marin.config.paths import PROJECT_ROOT

    for path in [PROJECT_ROOT / "README.md", *sorted((PROJECT_ROOT / "docs").glob("*.md")),
                 *sorted((PROJECT_ROOT / "conf" / "data").glob("*"))]:
        if path.is_file():
            text = path.read_text(encoding="utf-8").lower()
            assert "not redistributable" not in text and "placeholder" not in text, path


def test_the_108k_swap_counts_the_launch_weights_before_it():
    """Production drew the launch weights for steps 0–108,000, then the new ones: its most repeated
    cell is c13q0, (4.98T·1.36e-6 + 9.42T·8.14e-5) / 135.7M = 5.698 epochs in pretraining. The
    new weights alone from step 0 would repeat it 9.7 times, past the 8-epoch cap."""
    cfg = make_config("experiment=mochi_535b_a23b", "dry_run=true", "data=mochi_hero_108k")
    assert (cfg.data.cells_from_step, cfg.data.cells_before) == (108_000, "conf/data/mochi_hero_cells.csv")
    epochs = mixture.epochs_per_source(cfg)
    launch = mixture.phase_tokens_between(cfg, 0, 108_000)
    after = mixture.phase_tokens_between(cfg, 108_000, cfg.train.steps)
    assert [a + b for a, b in zip(launch, after)] == mixture.phase_tokens(cfg) and launch[1] == 0
    expected = (1.3588122376458724e-06 * launch[0] + 8.138020833333333e-05 * after[0]) / 135_733_770
    assert epochs["c13q0"][0] == pytest.approx(expected) and epochs["c13q0"][0] == pytest.approx(5.698, abs=5e-4)
    with pytest.raises(ConfigError, match=r"2 source\(s\) would repeat more than data.max_epochs=8 epochs"):
        make_config("experiment=mochi_535b_a23b", "dry_run=true", "data=mochi_hero_108k", "data.cells_from_step=0")


def test_the_cells_before_a_swap_must_be_the_same_cells(tmp_path):
    rows = _rows()
    path = tmp_path / "cells.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows[:-1])
    with pytest.raises(ConfigError) as err:
        make_config("data=mochi_hero_108k", "dry_run=true", f"data.cells_before={path}")
    assert dict(err.value.problems)["data.cells_before"].startswith("must list the same cells as data.cells_file")
    with pytest.raises(ConfigError, match="data.cells_before: no cells file at"):
        make_config("data=mochi_hero_108k", "dry_run=true", f"data.cells_before={tmp_path}/nope.csv")


@pytest.mark.parametrize("column, value, expected", [
    (0, "c00\nq0", "names are letters, digits, '_', '-' and '.'"),     # issue 42's probe: accepted
    (0, "c00 q0", "names are letters, digits, '_', '-' and '.'"),
    (0, "c٠٠q0", "names are letters, digits, '_', '-' and '.'"),     # Arabic-Indic digits
    (3, "٩١٢٦٩٩٤٢٩٤", "tokens and weights must be numbers written in ASCII"),   # float() reads them
    (4, "０.０００２７５９５５１０４５７９８３７８", "tokens and weights must be numbers written in ASCII"),
])
def test_cell_names_and_numbers_are_plain_text(tmp_path, column, value, expected):
    rows = _rows()
    rows[1][column] = value
    path = tmp_path / "cells.csv"
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows(rows)
    with pytest.raises(ConfigError) as err:
        make_config(*HERO, f"data.cells_file={path}")
    [message] = [m for n, m in err.value.problems if n == "data.cells_file" and expected in m]
    assert "row 2" in message and "\n" not in message


def test_a_cells_file_over_the_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """issue 42's probe: a million cells made a silent 10-minute dry run (a quadratic duplicate
    check); a table past `mixture.MAX_CELLS` rows is refused in one line, the count in it."""
    rows = _rows()
    monkeypatch.setattr(mixture, "MAX_CELLS", len(rows) - 2)
    path = tmp_path / "cells.csv"
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    with pytest.raises(ConfigError) as err:
        make_config(*HERO, f"data.cells_file={path}")
    [message] = [m for n, m in err.value.problems if n == "data.cells_file"]
    assert f"lists {len(rows) - 1} cells; at most {len(rows) - 2}" in message
