"""The ladder forecast recovers a known law from synthetic runs logged to a real sqlite store."""
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from marin import forecast
from marin.track import record, sweep, tracker

RUNGS = [(64, 2), (96, 3), (128, 4), (160, 5)]
STEPS = 40


def _ladder(multirun_job, monkeypatch, sweep_id: str, law):
    """A ladder sweep whose runs log eval/macro_loss = law(C) at every 5% of training."""
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=ladder_cpu"])
    recs = []
    for i, (d, layers) in enumerate(RUNGS):
        composed, resolved, overrides = multirun_job(
            i, "sweep=ladder_cpu", f"run.sweep_id={sweep_id}", f"train.steps={STEPS}", "train.eval_every=2",
            f"model={{name:rung_d{d},d_model:{d},num_layers:{layers}}}")
        rec = record.create(composed, resolved, overrides)
        per_step = forecast.training_flops_per_step(resolved)
        with tracker.Tracker(rec) as t:
            for step in range(2, STEPS + 1, 2):
                t.log_metrics({"eval/macro_loss": law(per_step * step)}, step)
        recs.append(rec)
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
