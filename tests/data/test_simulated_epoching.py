"""Simulated epoching (`data.simulated_epoching`, spec §9): a run below the FLOPs limit reads only its
share of each cell (its tokens / the target's), so every cell repeats as often as in the target run;
a run above the limit reads whole cells, as without the setting."""
from __future__ import annotations

import numpy as np
import pytest

from marin.config.schema import SimulatedEpochingConfig
from marin.config.validate import ConfigError
from marin.data import mixture
from marin.data.loader import Loader
from marin.launch.checks import load
from tests.data.mixtures import composed, resolved, write_jsonl

T, B = 32, 8  # tests/data/mixtures.py: train.seq_len, train.global_batch
STEPS, SCALE = 50, 16  # the rung's steps; the target trains SCALE times its tokens


def cell(tmp_path, name: str, docs: int):
    # documents of 31 bytes + end of document: `docs` chunks of T tokens
    write_jsonl(tmp_path / f"{name}.jsonl", [chr(97 + i % 26) * 31 for i in range(docs)])
    return dict(name=name, kind="jsonl", paths=[f"{name}.jsonl"])


@pytest.fixture
def cells(tmp_path):
    """Two phases (as the hero's mixture) over a large and a small cell: the target run draws the
    small cell about 6 epochs, the large one about 3."""
    a, b = cell(tmp_path, "large", 1600), cell(tmp_path, "small", 320)
    return [{**a, "weights": [0.7, 0.5]}, {**b, "weights": [0.3, 0.5]}]


def config(tmp_path, cells, steps: int, **sim):
    return resolved(tmp_path, cells, boundaries=[0.8], names=["pretrain", "midtrain"],
                    overrides=[f"train.steps={steps}"], simulated_epoching=SimulatedEpochingConfig(**sim))


def test_a_rung_repeats_each_cell_as_often_as_the_target_run(tmp_path, cells):
    target = config(tmp_path, cells, STEPS * SCALE)  # the full run: no simulation, whole cells
    rung = config(tmp_path, cells, STEPS, target_tokens=STEPS * SCALE * B * T, below_flops=1e23)
    assert mixture.simulated_fraction(target) is None and mixture.simulated_fraction(rung) == 1 / SCALE
    full, small = Loader(target, progress=False), Loader(rung, progress=False)
    expected, got = full.epochs_seen(STEPS * SCALE), small.epochs_seen(STEPS)
    assert expected["small"] > 4 and expected["large"] > 2  # the target repeats both cells
    for name in expected:  # equal up to a row per phase of the closed-form row counts (a row: 1/chunks epochs)
        assert got[name] == pytest.approx(expected[name], abs=2 / small._chunks[small.source_names.index(name)])
    # what the dry run and the epoch cap read (the cells' token counts): the target's epochs too
    available = {n: int(t) for n, t in zip(small.source_names, small._num_tokens)}
    planned, target_planned = mixture.epochs_per_source(rung, available), mixture.epochs_per_source(target, available)
    for name in expected:
        assert sum(planned[name]) == pytest.approx(sum(target_planned[name]), rel=1e-9)
        assert sum(planned[name]) == pytest.approx(expected[name], abs=0.05)


def test_the_rung_reads_the_same_share_of_a_cell_every_epoch(tmp_path, cells):
    rung = Loader(config(tmp_path, cells, STEPS, target_tokens=STEPS * SCALE * B * T), progress=False)
    small = rung.source_names.index("small")
    chunks, tokens = int(rung._chunks[small]), int(rung._num_tokens[small])
    assert chunks == 320 // SCALE
    starts = [rung.rows(step) for step in range(STEPS)]
    read = np.concatenate([start[src == small] for _, src, start in starts])
    assert len(read) > 4 * chunks  # several epochs of its share ...
    window = np.sort((read - read.min()) % tokens)
    assert len(window) and np.array_equal(np.unique(window), np.arange(chunks) * T)  # one window, every epoch
    whole = Loader(config(tmp_path, cells, STEPS), progress=False)  # without: a new offset each epoch
    moved = np.concatenate([start[src == small] for _, src, start in (whole.rows(s) for s in range(STEPS))])
    assert len(np.unique(moved)) > chunks


def test_a_rung_above_the_flops_limit_reads_whole_cells(tmp_path, cells):
    plain = config(tmp_path, cells, STEPS)
    above = config(tmp_path, cells, STEPS, target_tokens=STEPS * SCALE * B * T, below_flops=1.0)
    assert mixture.simulated_fraction(above) is None
    a, b = Loader(plain, progress=False), Loader(above, progress=False)
    assert a.epochs_seen(STEPS) == b.epochs_seen(STEPS)
    for step in (0, 17, STEPS - 1):
        assert all((x == y).all() for x, y in zip(a.rows(step), b.rows(step)))
    assert mixture.epochs_per_source(above) == mixture.epochs_per_source(plain)


def test_a_target_smaller_than_the_run_is_refused_naming_the_field(tmp_path, cells):
    with pytest.raises(ConfigError) as err:
        load(composed(tmp_path, cells, boundaries=[0.8], names=["pretrain", "midtrain"],
                      overrides=[f"train.steps={STEPS}"],
                      simulated_epoching=SimulatedEpochingConfig(target_tokens=STEPS * B * T / 2)))
    assert "data.simulated_epoching.target_tokens" in str(err.value) and "less than the run's" in str(err.value)
    with pytest.raises(ConfigError, match="data.simulated_epoching: cuts cells under data.sampling=epoch only"):
        load(composed(tmp_path, cells, boundaries=[0.8], names=["pretrain", "midtrain"], sampling="random",
                      overrides=[f"train.steps={STEPS}"],
                      simulated_epoching=SimulatedEpochingConfig(target_tokens=STEPS * SCALE * B * T)))


def test_the_ladder_rungs_repeat_the_hero_cells_as_the_published_budget_does():
    import json

    from marin.config.paths import project_path
    from marin.launch.plan import format_plan, plan
    from tests.helpers import make_config

    published = json.loads(project_path("conf/data/published/harrier_mix_2026_08_18.json").read_text())
    budgets = published["phase_budgets"]  # 15T + 3.75T: the reference budget Marin's rungs simulated
    weights = (published["phase0_weights"], published["phase1_weights"])
    epochs = {c: sum(b * w[c] for b, w in zip(budgets, weights)) / n for c, n in published["available_tokens"].items()}
    for rung in ("ladder_d768", "ladder_d2048"):
        cfg = make_config(f"experiment={rung}", "dry_run=true")
        assert cfg.data.simulated_epoching.target_tokens == sum(budgets)
        sim = plan(cfg)["simulated_epoching"]
        assert sim["on"] and sim["fraction"] == sim["run_tokens"] / sum(budgets) < 0.05
        # the rung's phases split its steps on mixture blocks (≈ 80%), the reference budget exactly
        assert sim["max_epochs"] == pytest.approx(max(epochs.values()), rel=0.01)
        assert sim["cells"] == len(epochs) and sim["cells_repeated"] > 0
        line = f"{sim['cells_repeated']} of 200 cells repeat, at most {sim['max_epochs']:.2f} epochs"
        assert line in format_plan(plan(cfg))
    hero = ["experiment=mochi_535b_a23b", "dry_run=true"]
    same = [f"data.simulated_epoching.{k}={v}" for k, v in make_config("experiment=ladder_d768", "dry_run=true")
            .data.simulated_epoching.__dict__.items()]
    off = plan(make_config(*hero, *same))
    assert not off["simulated_epoching"]["on"] and off["data"] == plan(make_config(*hero))["data"]
    why = "off: the run's 2.7e+24 training FLOPs are above data.simulated_epoching.below_flops 1e+23"
    assert why in format_plan(off)
