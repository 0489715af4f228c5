"""The ladder forecast recovers a known law from synthetic runs logged to a real sqlite store."""
import sys
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from marin import forecast
from marin.track import record, sweep, tracker

RUNGS = [(64, 2), (96, 3), (128, 4), (160, 5)]
STEPS = 40


def _ladder(multirun_job, monkeypatch, sweep_id: str, law):
    """A ladder sweep whose runs log their headline metric (eval.headline: the CPU ladder's data has
    no Paloma set, so eval/macro_loss) = law(C) at every 5% of training."""
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=ladder_cpu"])
    recs = []
    for i, (d, layers) in enumerate(RUNGS):
        composed, resolved, overrides = multirun_job(
            i, "sweep=ladder_cpu", f"run.sweep_id={sweep_id}", f"train.steps={STEPS}", "train.eval_every=2",
            f"model={{name:rung_d{d},d_model:{d},num_layers:{layers}}}")
        rec = record.create(composed, resolved, overrides)
        per_step = forecast.training_flops_per_step(resolved)
        t = tracker.Tracker(rec)
        for step in range(2, STEPS + 1, 2):
            t.log_metrics({resolved.eval.headline: law(per_step * step)}, step)
        t.finish()
        recs.append(rec)
    assert resolved.eval.headline == "eval/macro_loss"
    return recs


def test_fixed_E_recovers_A_and_alpha(store, multirun_job, monkeypatch, tmp_path):
    A, alpha = 40.0, 0.12
    recs = _ladder(multirun_job, monkeypatch, "fc-fixed", lambda C: 1.5 + A * C ** -alpha)
    client = MlflowClient(store["uri"])
    _, parent = sweep.open_parent(client.get_run(recs[0].run_id).data.tags["mlflow.parentRunId"], store["uri"])
    fits, target = forecast.forecast(client, parent, "ladder_d768")
    assert [round(f.fraction * 100) for f in fits] == list(range(5, 105, 5))
    for fit in fits:
        assert fit.E == 1.5 and len(fit.points) == len(RUNGS)
        assert fit.A == pytest.approx(A, rel=1e-6) and fit.alpha == pytest.approx(alpha, rel=1e-6)
    C_target = 3 * forecast.accounting.flops_per_token(target, with_head=False) \
        * target.train.seq_len * target.train.global_batch * target.train.steps
    assert fits[-1].target_C == pytest.approx(C_target)
    assert fits[-1].predict(C_target) == pytest.approx(1.5 + A * C_target ** -alpha)


def test_fitted_E_and_the_command_line(store, multirun_job, monkeypatch, capsys):
    E, A, alpha = 2.0, 25.0, 0.15
    recs = _ladder(multirun_job, monkeypatch, "fc-fitted", lambda C: E + A * C ** -alpha)
    client = MlflowClient(store["uri"])
    parent_id = client.get_run(recs[0].run_id).data.tags["mlflow.parentRunId"]
    sweep_dir = client.get_run(parent_id).data.tags["sweep_dir"]
    assert forecast.main([sweep_dir, "--target", "ladder_d768", "--fit-E"]) == 0
    out = capsys.readouterr().out
    assert "forecast for ladder_d768 at 100% of training" in out
    _, parent = sweep.open_parent(parent_id, store["uri"])
    fits, _ = forecast.forecast(client, parent, "ladder_d768", E=None)
    for fit in fits:
        assert fit.E == pytest.approx(E, abs=1e-3) and fit.alpha == pytest.approx(alpha, rel=1e-2)
    assert (Path(sweep_dir) / "forecast-ladder_d768.png").stat().st_size > 10_000
    logged = {a.path for a in client.list_artifacts(parent_id, "forecast")}
    assert "forecast/forecast-ladder_d768.png" in logged and "forecast/forecast-ladder_d768.json" in logged
    assert "forecast/ladder_d768" in client.get_run(parent_id).data.metrics


def test_interpolates_between_evaluations():
    rung = forecast.Rung("r", "id", 100, 1.0, [(10, 4.0), (20, 3.0)])
    assert rung.loss_at(15) == pytest.approx(3.5)
    assert rung.loss_at(5) is None and rung.loss_at(25) is None


def _rung(name, flops, losses, **leaves):
    base = {"model.d_model": 64, "optim.lr": "auto", "router.kind": "qb"}
    return forecast.Rung(name, name, 40, flops, [(s, l) for s, l in losses], {**base, **leaves})


def test_refuses_what_is_not_a_ladder():
    same_size = [_rung(f"lr{i}", 1e9, [(40, 3.0)], **{"optim.lr": lr}) for i, lr in enumerate((1e-3, 3e-3, 1e-2))]
    with pytest.raises(forecast.NotALadder, match="1 distinct compute scale"):
        forecast.check_ladder(same_size)
    routers = [_rung(f"r{i}", 1e9 * (i + 1), [(40, 3.0)], **{"model.d_model": 64 * (i + 1), "router.kind": k})
               for i, k in enumerate(("qb", "softmax_aux", "qb"))]
    with pytest.raises(forecast.NotALadder, match=r"differ in more than size and steps \(router.kind"):
        forecast.check_ladder(routers)
    sizes = [_rung(f"d{i}", 1e9 * (i + 1), [(40, 3.0)], **{"model.d_model": 64 * (i + 1), "train.steps": 40 + i})
             for i in range(3)]
    forecast.check_ladder(sizes)  # size and steps may differ


def test_refuses_a_fit_that_cannot_be_trusted():
    C = np.array([1e9, 1e10, 1e11, 1e12])
    rising = [forecast.Rung(f"d{i}", str(i), 40, c / 40, [(40, 3.0 + 0.1 * i)]) for i, c in enumerate(C)]
    fit = forecast.fit_at(rising, 1.0, 1.5)
    with pytest.raises(forecast.NotALadder, match="alpha = .* ≤ 0"):
        forecast.check_fit(fit, 0.9)
    noisy = [forecast.Rung(f"d{i}", str(i), 40, c / 40, [(40, l)]) for i, (c, l) in enumerate(zip(C, (4.0, 3.0, 3.6, 2.0)))]
    fit = forecast.fit_at(noisy, 1.0, 1.5)
    assert fit.alpha > 0
    with pytest.raises(forecast.NotALadder, match="R² = .* < --min-r2 0.9"):
        forecast.check_fit(fit, 0.9)
    forecast.check_fit(fit, 0.0)


def test_prediction_band_from_the_regression():
    C = np.array([1e9, 3e9, 1e10, 3e10, 1e11])
    rng = np.random.default_rng(0)
    law = 1.5 + 40 * C ** -0.12
    rungs = [forecast.Rung(f"d{i}", str(i), 40, c / 40, [(40, l)])
             for i, (c, l) in enumerate(zip(C, law * np.exp(rng.normal(0, 0.01, len(C)))))]
    for E in (1.5, None):
        fit = forecast.fit_at(rungs, 1.0, E)
        low, high = fit.band(1e13)
        assert low < fit.predict(1e13) < high and high - low < (0.5 if E else 2.0)  # 2 dof when E is fitted
        near_low, near_high = fit.band(1e10)
        assert near_high - near_low < high - low  # wider away from the rungs
    exact = [forecast.Rung(f"d{i}", str(i), 40, c / 40, [(40, l)]) for i, (c, l) in enumerate(zip(C, law))]
    low, high = forecast.fit_at(exact, 1.0, 1.5).band(1e13)
    assert high - low == pytest.approx(0, abs=1e-9)


def test_an_lr_sweep_is_refused_on_the_command_line(store, lr_sweep_parent, capsys):
    parent_id = lr_sweep_parent("fc-lr")
    client = MlflowClient(store["uri"])
    with pytest.raises(SystemExit, match="^2$"):
        forecast.main([parent_id, "--tracking-uri", store["uri"], "--target", "ladder_d768", "--metric", "eval/macro_loss"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a ladder: 3 run(s) at 1 distinct compute scale(s)" in err
    assert not client.list_artifacts(parent_id, "forecast") and not client.get_run(parent_id).data.metrics


def test_a_resumed_rungs_repeated_steps_count_once():
    """A rung killed after its last checkpoint and resumed logged its last steps twice in MLflow
    (the store cannot drop the first values): the fit reads the value logged last at each step."""
    from types import SimpleNamespace as M

    from marin.forecast import last_per_step

    points = [M(step=1, value=6.0, timestamp=1), M(step=2, value=5.0, timestamp=2), M(step=3, value=9.0, timestamp=3),
              M(step=3, value=4.5, timestamp=9), M(step=2, value=5.1, timestamp=8)]
    assert last_per_step(points) == [(1, 6.0), (2, 5.1), (3, 4.5)]
