"""A pre-registered forecast: `marin.forecast --register` writes it, validation ties it to its
target, and a run checks itself against it at each 5% of training."""
import math
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from mlflow import MlflowClient

from marin import forecast
from marin.config.validate import ConfigError
from marin.launch.checks import load
from marin.model import accounting
from marin.track import forecast_check, record
from tests.helpers import compose_dict, launch_here, make_config
from tests.track.test_forecast import _ladder

TARGET = "ladder_cpu_d160"


def _law(C):  # a known law, bent a little so the band has a width
    return 1.5 + 40.0 * C ** -0.12 * (1 + 0.01 * math.sin(3 * math.log(C)))


def test_register_writes_the_forecast_and_the_ladder(store, multirun_job, monkeypatch, tmp_path, capsys):
    recs = _ladder(multirun_job, monkeypatch, "fc-register", _law)
    client = MlflowClient(store["uri"])
    parent_id = client.get_run(recs[0].run_id).data.tags["mlflow.parentRunId"]
    path = tmp_path / "forecasts" / f"{TARGET}.yaml"
    argv = [parent_id, "--tracking-uri", store["uri"], "--target", TARGET, "--register", str(path)]
    # the rungs trained 40 steps, the target 200: flagged, and refused for registration
    with pytest.raises(SystemExit, match="^2$"):
        forecast.main(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--register refused: the rungs train 40 steps" in err and "--force" in err, err
    assert not path.exists()
    assert forecast.main([*argv, "--set", "train.steps=40"]) == 0   # trained as the rungs were
    out = capsys.readouterr().out
    assert f"registered: {path}" in out and "warning:" not in out and "note:" not in out  # outside the project
    doc = forecast_check.read(path)
    assert "caveats" not in doc
    target = make_config(f"experiment={TARGET}", "dry_run=true", "train.steps=40")
    assert doc["target"] == TARGET and doc["target_C"] == accounting.train_flops(target, with_head=False)
    assert [r["run_id"] for r in doc["ladder"]] == [r.run_id for r in recs]
    assert [p["fraction"] for p in doc["points"]] == [round(0.05 * k, 2) for k in range(1, 21)]
    t = forecast._t95(len(recs) - 2)
    for p in doc["points"]:
        fit = p["fit"]
        assert fit["rungs"] == len(recs) and fit["alpha"] == pytest.approx(0.12, rel=0.05) and fit["r2"] > 0.99
        assert p["C"] == pytest.approx(p["fraction"] * doc["target_C"])
        assert p["predicted"] == pytest.approx(fit["E"] + fit["A"] * p["C"] ** -fit["alpha"])
        assert p["lower"] < p["predicted"] < p["upper"]
        assert p["sigma"] == pytest.approx((p["upper"] - p["lower"]) / (2 * t))
    assert f"forecast/{TARGET}.yaml" in {a.path for a in client.list_artifacts(parent_id, "forecast")}
    # the hero from this ladder: 13 orders of magnitude beyond it, and trained unlike it
    hero = [parent_id, "--tracking-uri", store["uri"], "--target", "mochi_535b_a23b", "--register", str(tmp_path / "h.yaml")]
    with pytest.raises(SystemExit, match="^2$"):
        forecast.main(hero)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--register refused: the target's compute" in err and "more caveat" in err, err
    assert not (tmp_path / "h.yaml").exists()
    assert forecast.main([*hero, "--force"]) == 0
    out = capsys.readouterr().out.splitlines()
    headline = next(line for line in out if line.startswith("forecast for mochi_535b_a23b"))
    warnings = [line for line in out if line.startswith("warning: ")]
    assert "caveat(s), see the warning: lines above" in headline
    assert any("more than 100×" in w for w in warnings) and any("the rungs train 40 steps" in w for w in warnings)
    assert forecast_check.read(tmp_path / "h.yaml")["caveats"] == [w.removeprefix("warning: ") for w in warnings]


def test_register_refuses_a_non_ladder_and_writes_nothing(store, lr_sweep_parent, tmp_path, capsys):
    parent_id = lr_sweep_parent("fc-reg-lr")
    path = tmp_path / "lr.yaml"
    argv = [parent_id, "--tracking-uri", store["uri"], "--target", TARGET, "--register", str(path)]
    with pytest.raises(SystemExit, match="^2$"):
        forecast.main(argv)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a ladder" in err and not path.exists()


def test_register_refuses_points_without_a_band():
    C = [1e9, 1e10, 1e11]  # three rungs with E fitted: no degrees of freedom left for a band
    rungs = [forecast.Rung(f"d{i}", str(i), 40, c / 40, [(40, _law(c))]) for i, c in enumerate(C)]
    fit = forecast.fit_at(rungs, 1.0, None)
    fit.target_C = 1e12
    parent = SimpleNamespace(info=SimpleNamespace(run_id="p"), data=SimpleNamespace(tags={}))
    with pytest.raises(forecast.NotALadder, match="100% of training has no band .* 4 with --fit-E"):
        forecast.registration([fit], rungs, make_config(f"experiment={TARGET}", "dry_run=true"), TARGET,
                              "eval/macro_loss", None, parent, [])


def _registered(path, cfg, points):
    return forecast_check.write(path, {"target": cfg.run.experiment, "target_C": accounting.train_flops(cfg, with_head=False),
                                       "metric": "eval/macro_loss", "points": points})


def _point(fraction, predicted, half):
    return {"fraction": fraction, "C": 1.0, "predicted": predicted, "lower": predicted - half,
            "upper": predicted + half, "sigma": half / 2, "fit": {}}


def test_validation_ties_the_file_to_its_target(tmp_path):
    cfg = make_config(f"experiment={TARGET}")
    path = _registered(tmp_path / "f.yaml", cfg, [_point(1.0, 3.0, 0.1)])
    load(compose_dict(f"experiment={TARGET}", f"forecast.registered={path}"))  # its own target: fine
    cases = {("model=tiny",): "forecasts experiment 'ladder_cpu_d160', but this run is experiment None",
             (f"experiment={TARGET}", "train.steps=100"): "forecasts a run of C = .* this run's config gives C = "}
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message) as err:
            load(compose_dict(*overrides, f"forecast.registered={path}"))
        assert [name for name, _ in err.value.problems] == ["forecast.registered"]
    (tmp_path / "bad.yaml").write_text("points: 3\n")
    with pytest.raises(ConfigError, match="is not a registered forecast"):
        load(compose_dict(f"experiment={TARGET}", f"forecast.registered={tmp_path / 'bad.yaml'}"))


def test_a_mismatched_file_stops_the_launch_before_anything_is_written(tmp_path, capsys):
    cfg = make_config(f"experiment={TARGET}")
    path = _registered(tmp_path / "f.yaml", cfg, [_point(1.0, 3.0, 0.1)])
    out = tmp_path / "out"
    code = launch_here("model=tiny", f"forecast.registered={path}", f"run.out_dir={out}",
                       f"tracking.uri=sqlite:///{tmp_path}/m.db")
    err = capsys.readouterr().err
    assert code == 2, err
    assert "forecast.registered:" in err and "this run is experiment None" in err
    assert not out.exists() and not (tmp_path / "m.db").exists()


class FakeTracker:
    def __init__(self):
        self.metrics, self.tags = {}, {}

    def log_metrics(self, metrics, step):
        self.metrics[step] = metrics

    def set_tags(self, tags):
        self.tags.update(tags)


def test_the_check_logs_at_registered_points_and_alerts_outside_the_band(tmp_path):
    cfg = make_config(f"experiment={TARGET}")  # 200 steps: 5% = step 10
    path = _registered(tmp_path / "f.yaml", cfg, [_point(0.05, 4.0, 0.2), _point(0.1, 3.5, 0.2), _point(0.15, 3.2, 0.2)])
    cfg.forecast.registered = str(path)
    fake, lines = FakeTracker(), []
    check = forecast_check.Check(cfg, fake)
    check(10, {"eval/macro_loss": 4.1}, lines.append)
    assert fake.metrics[10] == pytest.approx({"forecast/predicted": 4.0, "forecast/residual": 0.1, "forecast/z": 1.0,
                                              "forecast/lower": 3.8, "forecast/upper": 4.2})
    assert not lines and not fake.tags
    check(15, {"eval/macro_loss": 9.0}, lines.append)  # not a registered point
    assert 15 not in fake.metrics and not lines
    check(20, {"eval/macro_loss": 3.9}, lines.append)
    check(30, {"eval/macro_loss": 2.9}, lines.append)
    assert fake.metrics[20]["forecast/z"] == pytest.approx(4.0) and fake.metrics[30]["forecast/z"] == pytest.approx(-3.0)
    assert len(lines) == 2 and lines[0].startswith("forecast alert: step 20 (10% of training)")
    assert "outside the registered band [3.3000, 3.7000]" in lines[0] and "training continues" in lines[0]
    assert fake.tags == {"forecast.alert": "20"}  # the first departure
    path.unlink()  # gone since validation: the run trains on, unchecked
    assert forecast_check.Check(cfg, fake).points == {}


@pytest.mark.slow
def test_a_ladder_registers_a_forecast_that_a_larger_run_checks(store, multirun_job, monkeypatch, tmp_path):
    """End to end on real (very short) CPU runs: a 3-rung ladder_cpu sweep, its forecast for
    ladder_cpu_d160 registered (here at the last rung's shape, to share its compile), and that
    run logging forecast/* at every 5% of training; the last point's band is narrowed to
    nothing, so the run must raise an alert there."""
    from marin.train.loop import train

    # Rungs without the block's optional parts (as model=micro): what is under test is the
    # forecast around the runs, and these programs take 0.6 of the CPU to compile.
    short = ["train.steps=20", "train.seq_len=32", "train.global_batch=4", "train.eval_batches=1",
             "data.cache_dir=" + str(store["root"] / "tokens"),
             "model.gated_norm_rank=0", "model.conv_kernel=0", "model.num_shared_experts=0"]
    monkeypatch.setattr(sys, "argv", ["launch.py", "-m", "sweep=ladder_cpu"])
    rungs = []
    for i, (d, layers) in enumerate([(64, 2), (96, 3), (128, 4)]):
        composed, resolved, overrides = multirun_job(
            i, "sweep=ladder_cpu", "run.sweep_id=fc-e2e",
            f"model={{name:ladder_cpu_d{d},d_model:{d},num_layers:{layers}}}", *short)
        rec = record.create(composed, resolved, overrides)
        train(resolved, rec)
        rungs.append(rec)
    client = MlflowClient(store["uri"])
    parent_id = client.get_run(rungs[0].run_id).data.tags["mlflow.parentRunId"]
    path = tmp_path / f"{TARGET}.yaml"
    # no --metric: the rungs' headline, eval/macro_loss (no Paloma set here), what the check reads too
    argv = [parent_id, "--tracking-uri", store["uri"], "--target", TARGET, "--register", str(path)]
    # The target at the last rung's shape: its steps are then read from the compilation cache (a
    # fourth shape would be a fourth compile); the forecast and its check do not depend on the size.
    target = [*short, "model.d_model=128", "model.num_layers=4"]
    for o in target:
        argv += ["--set", o]
    assert forecast.main(argv) == 0
    doc = forecast_check.read(path)
    doc["points"][-1].update(lower=doc["points"][-1]["predicted"] - 1e-9, upper=doc["points"][-1]["predicted"] + 1e-9)
    forecast_check.write(path, {k: v for k, v in doc.items() if k != "format"})

    composed, resolved = load(compose_dict(f"experiment={TARGET}", *target, f"forecast.registered={path}",
                                           f"tracking.uri={store['uri']}", f"run.out_dir={store['out']}"))
    rec = record.create(composed, resolved, [])
    train(resolved, rec)
    run = client.get_run(rec.run_id)
    history = {k: {m.step: m.value for m in client.get_metric_history(rec.run_id, k)}
               for k in ("eval/macro_loss", *(f"forecast/{m}" for m in forecast_check.METRICS))}
    steps = list(range(1, 21))  # eval_every auto = 1: every 5% of 20 steps
    assert sorted(history["forecast/predicted"]) == steps
    for step, point in zip(steps, doc["points"]):
        actual = history["eval/macro_loss"][step]
        assert history["forecast/predicted"][step] == pytest.approx(point["predicted"])
        assert history["forecast/residual"][step] == pytest.approx(actual - point["predicted"])
        assert history["forecast/z"][step] == pytest.approx((actual - point["predicted"]) / point["sigma"])
    outside = [s for s in steps if not history["forecast/lower"][s] <= history["eval/macro_loss"][s]
               <= history["forecast/upper"][s]]
    assert outside and outside[-1] == 20 and run.data.tags["forecast.alert"] == str(outside[0])
    assert run.info.status == "FINISHED"  # an alert does not stop training
    assert np.isfinite(list(history["forecast/z"].values())[:-1]).all()
