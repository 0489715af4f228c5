"""Forecasts that warn: a target far beyond the ladder, a target trained unlike its rungs and an
unbounded band are flagged in the table and headline, and refused for --register unless --force
(the command line: test_forecast_register.py); a registration goes to the git-ignored
outputs/forecasts/ by default."""
import math

from marin import forecast
from marin.config.paths import PROJECT_ROOT
from tests.helpers import make_config

TARGET = "ladder_cpu_d160"   # 200 steps


def _law(C):
    return 1.5 + 40.0 * C ** -0.12 * (1 + 0.01 * math.sin(3 * math.log(C)))


def _rungs(target, steps: int, scales=(1 / 8, 1 / 4, 1 / 2, 1.0)):
    """Four rungs at fractions of the target's compute per step, each trained `steps` steps, the
    tokens per active parameter scaled as a fixed-steps ladder's would be."""
    per_step, tpp = forecast.training_flops_per_step(target), forecast.tokens_per_param(target)
    return [forecast.Rung(f"r{i}", str(i), steps, per_step * f, [(steps, _law(per_step * f * steps))],
                          tokens_per_param=tpp * steps / forecast.horizon(target) / f)
            for i, f in enumerate(scales)]


def _final_fit(rungs, target):
    fit = forecast.fit_at(rungs, 1.0, forecast.DEFAULT_E)
    fit.target_C = forecast.training_flops_per_step(target) * forecast.horizon(target)
    return [fit]


def test_a_ladder_of_the_targets_steps_has_no_caveat():
    target = make_config(f"experiment={TARGET}", "dry_run=true")
    rungs = _rungs(target, 200)
    assert forecast.caveats(_final_fit(rungs, target), rungs, target) == []


def test_a_100_step_ladder_for_a_200_step_target_is_flagged():
    target = make_config(f"experiment={TARGET}", "dry_run=true")
    rungs = _rungs(target, 100)
    (caveat,) = forecast.caveats(_final_fit(rungs, target), rungs, target)
    assert caveat.startswith("the rungs train 100 steps") and "the target 200 (" in caveat


def test_a_target_far_beyond_the_largest_rung_is_flagged():
    target = make_config(f"experiment={TARGET}", "dry_run=true")
    rungs = _rungs(target, 200, scales=(1e-5, 2e-5, 4e-5, 8e-5))
    far = [c for c in forecast.caveats(_final_fit(rungs, target), rungs, target) if "more than 100×" in c]
    assert len(far) == 1 and "is 1.25e+04× the largest rung's" in far[0]


def test_an_uninformative_band_prints_as_unbounded():
    assert forecast.unbounded((1.5, 853565.7433), 3.2) and forecast.unbounded((1.5, math.inf), 3.2)
    assert not forecast.unbounded((3.0, 3.4), 3.2) and not forecast.unbounded(None, 3.2)
    fit = forecast.Fit(1.0, 1.5, 40.0, 0.12, 0.99, [(1.0, 3.0)], target_C=1e20, t95=4.3,
                       band_fn=lambda c: (1.5, 853565.7433))
    text = forecast.table([fit], TARGET, ["the 95% band at 100% of training is unbounded"])
    row = text.splitlines()[1]
    assert row.endswith("unbounded") and "853565" not in row
    assert text.splitlines()[-1] == "warning: the 95% band at 100% of training is unbounded"


def test_registrations_default_to_the_ignored_outputs_folder():
    path = forecast.default_register_path(TARGET)
    assert path == PROJECT_ROOT / "outputs" / "forecasts" / f"{TARGET}.yaml"
    assert forecast.commit_note(path) is None                       # git-ignored: later runs stay clean
    note = forecast.commit_note(PROJECT_ROOT / "conf" / "forecasts" / f"{TARGET}.yaml")
    assert note.startswith(f"conf/forecasts/{TARGET}.yaml is in the project's tracked tree: commit it")
