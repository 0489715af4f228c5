"""The published ladder forecast as Marin's plot_scaling_ladder.py computed it (spec §9): C of every
rung from its config, evaluations snapped to the nearest 5%, the crashed d2048 rung past its last
evaluation on its 60–80% line plus its correction, and the dry run saying why its C counts 5 global
layers where the model runs 6."""
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from marin import forecast
from marin.launch.plan import format_plan, plan
from marin.model import accounting
from marin.track import record
from tests.helpers import make_config

# Published data (plot_scaling_ladder.py's FLOPS table): C without the lm head, per step and whole.
PUBLISHED = {
    "ladder_d768": (2.320210052775936e15, 2.649679880270119e19),
    "ladder_d1024": (1.129954355970048e16, 1.7261182741798453e20),
    "ladder_d1536": (9.130921800656486e16, 1.3813258500033133e21),
    "ladder_d2048": (3.857022193930076e17, 7.741814947656449e21),
    "mochi_535b_a23b": (6.690294608796058e18, 2.6108941613772703e24),
}
# The published figures are products of doubles (C_per_step × steps); the rule's integers agree to
# the last bit or two of a double.
ULPS = 4e-16


def rung_config(name: str, *overrides: str):
    return make_config(f"experiment={name}", "dry_run=true", *overrides)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_C_of_each_rung_is_the_published_constant(name):
    per_step, whole = PUBLISHED[name]
    cfg = rung_config(name)
    assert accounting.forecast_flops(cfg) == pytest.approx(whole, rel=ULPS, abs=0)
    assert forecast.training_flops_per_step(cfg) == pytest.approx(per_step, rel=ULPS, abs=0)


def test_d2048_C_counts_5_global_layers_of_the_6_the_model_runs():
    cfg = rung_config("ladder_d2048")
    assert sum(accounting.Shapes.of(cfg).global_layers) == 6
    assert sum(accounting.forecast_shapes(cfg).global_layers) == 5
    as_run = rung_config("ladder_d2048", "forecast.c_last_layer_global=true")
    assert accounting.forecast_flops(as_run) > PUBLISHED["ladder_d2048"][1] * 1.004  # the 6th layer: +0.5%
    text = format_plan(plan(cfg))
    assert "C counts 5 global layers, the model runs 6" in text and "forecast.c_last_layer_global false" in text
    assert "C counts" not in format_plan(plan(rung_config("ladder_d1536")))


def test_evaluations_snap_to_the_nearest_5_percent_the_later_one_winning():
    history = [(48, 4.0), (103, 3.5), (149, 3.2), (152, 3.1), (1000, 2.0)]
    assert forecast.snapped(history, 1000) == [(50.0, 4.0), (100.0, 3.5), (150.0, 3.1), (1000.0, 2.0)]
    rung = forecast.Rung("r", "id", 1000, 1.0, forecast.snapped(history, 1000))
    assert rung.loss_at(0.15 * 1000) == 3.1 and rung.loss_at(0.1 * 1000) == 3.5


class FakeStore:
    """The two calls `forecast.rungs_of` makes of MLflow, over runs written as records are."""

    def __init__(self, runs):
        self.runs = runs

    def children(self, client, parent):
        return [SimpleNamespace(info=SimpleNamespace(run_id=n, run_name=n), data=SimpleNamespace(tags={"run_dir": d}))
                for n, d, _ in self.runs]

    def get_metric_history(self, run_id, metric):
        assert metric == forecast.METRIC  # the default: the dropless Paloma macro loss
        history = next(h for n, _, h in self.runs if n == run_id)
        return [SimpleNamespace(step=s, value=v, timestamp=i) for i, (s, v) in enumerate(history)]


def test_the_published_ladder_forecasts_the_hero_with_the_d2048_correction(tmp_path, monkeypatch):
    law = lambda C: 1.5 + 40.0 * C ** -0.12  # noqa: E731: the loss every rung follows
    runs = []
    for name in ("ladder_d768", "ladder_d1024", "ladder_d1536", "ladder_d2048"):
        cfg = rung_config(name)
        folder = tmp_path / name
        folder.mkdir()
        OmegaConf.save(OmegaConf.structured(cfg), folder / record.RESOLVED)
        OmegaConf.save(OmegaConf.structured(cfg), folder / record.COMPOSED)
        steps, per_step = cfg.train.steps, forecast.training_flops_per_step(cfg)
        last = round(0.81 * steps) if name == "ladder_d2048" else steps  # the d2048 rung crashed at 81%
        evals = sorted({*range(cfg.train.eval_every, last + 1, cfg.train.eval_every), last})
        runs.append((name, str(folder), [(s + 1, law(per_step * s)) for s in evals]))  # a step off its point
    store = FakeStore(runs)
    monkeypatch.setattr(forecast.sweep, "children", store.children)
    rungs = forecast.rungs_of(store, None, forecast.ladder_metric(store, None))  # their headline: Paloma
    d2048 = rungs[-1]
    assert d2048.offset == 0.005 and d2048.stopped_at == 0.8 * d2048.steps and rungs[0].offset == 0.0
    C = {r.name: r.flops_per_step * r.steps for r in rungs}
    assert C == pytest.approx({n: PUBLISHED[n][1] for n in C}, rel=ULPS)
    at_80, at_90 = forecast.fit_at(rungs, 0.8, 1.5), forecast.fit_at(rungs, 0.9, 1.5)
    assert at_80.extrapolated == () and at_90.extrapolated == ("ladder_d2048",)
    slope, intercept = d2048.line
    assert at_90.points[-1][1] == pytest.approx(intercept + slope * 0.9 * d2048.steps + 0.005)
    # measured, no correction: the last evaluation snapped to 80% (the one where it stopped, at 81%)
    assert at_80.points[-1][1] == [v for s, v in runs[-1][2] if round(s / d2048.steps * 20) == 16][-1]
    hero = rung_config("mochi_535b_a23b")
    final = forecast.fit_at(rungs, 1.0, 1.5)
    for fit in (at_80, at_90, final):
        fit.target_C = accounting.forecast_flops(hero) * fit.fraction
    assert final.target_C == pytest.approx(PUBLISHED["mochi_535b_a23b"][1], rel=ULPS)
    text = forecast.table([at_80, at_90, final], "mochi_535b_a23b", rungs=rungs)
    assert "forecast.extrapolation_offset (ladder_d2048 +0.005)" in text.splitlines()[-1]
